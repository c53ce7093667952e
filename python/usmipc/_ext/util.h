/* Floor 1 of the extension usmipc._usmipc (util.c): the module state, the
 * heap-type helpers, errors and argument parsing, which every other file
 * uses. It includes no other header of the extension.
 *
 * The extension is built against the limited API of CPython 3.11
 * (Py_LIMITED_API=0x030B0000, abi3): no struct access to PyTypeObject, no
 * PyType_GetModuleByDef (limited only from 3.13). Methods that need the
 * module state are PyCMethods (METH_METHOD) and use their defining class;
 * slot functions walk the type's bases (pyusmipc_state_from_type) or reach
 * the state through the Device object they hold, whose type is never
 * subclassed.
 *
 * The extension's own names start with pyusmipc_ (PYUSMIPC_ for macros),
 * those of the C API it wraps with usmipc_: as CPython's _sqlite keeps
 * pysqlite_ apart from sqlite3_. */
#ifndef PYUSMIPC_UTIL_H
#define PYUSMIPC_UTIL_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stddef.h>
#include <stdint.h>

#include "usmipc.h"

struct pyusmipc_device_slot; /* device.h */

/* One per module object: its exceptions, its types, and the per-device
 * cache of Device and default Queue objects (device.c). */
typedef struct pyusmipc_module_state {
  PyObject *Error;        /* usmipc.Error, a RuntimeError */
  PyObject *TimeoutError; /* usmipc.IPCTimeoutError(Error, TimeoutError) */
  /* usmipc.SyclDeviceCreationError(Error, ValueError): Device() failed */
  PyObject *DeviceCreationError;
  /* The library's errors that Python code expects as built-in kinds: each
   * a usmipc.Error too (one root), with .code and .name. */
  PyObject *ArgumentError;   /* usmipc.ArgumentError(Error, ValueError) */
  PyObject *MemoryKindError; /* usmipc.MemoryKindError(Error, TypeError) */
  /* usmipc.ArgumentTypeError(Error, TypeError): an argument of the wrong
   * type, found by the extension's own parsing */
  PyObject *ArgumentTypeError;
  PyObject *OutOfMemoryError; /* usmipc.OutOfMemoryError(Error, MemoryError) */
  PyTypeObject *DeviceType;
  PyTypeObject *QueueType;
  PyTypeObject *MemoryType; /* usmipc.memory._Memory, the base */
  PyTypeObject *MemoryUSMDeviceType;
  PyTypeObject *MemoryPoolType; /* usmipc.memory.MemoryPool */
  PyTypeObject *MemoryUSMHostType;
  PyTypeObject *MemoryUSMSharedType;
  PyTypeObject *MemoryIPCDeviceType;
  PyTypeObject *IPCMemoryHandleType;
  PyTypeObject *EventType;
  PyTypeObject *IPCEventHandleType;
  PyObject *SharedBundleType; /* usmipc.SharedBundle (bundle.c) */
  PyObject *SharedArrayType;  /* usmipc.SharedArray */
  PyObject *CopyPlanType;     /* usmipc._CopyPlan (update.c) */
  /* open_shared(to="torch"): torch._C._from_dlpack, looked up (and torch's
   * CUDA initialized) once per process, not per open (shared_array.c) */
  PyObject *torch_from_dlpack;
  long torch_from_dlpack_pid; /* the process that looked it up */

  struct pyusmipc_device_slot *slots; /* the per-device cache: device.h */
  Py_ssize_t nslots;
  Py_ssize_t slots_capacity;
} pyusmipc_module_state_t;

/* Hands util.c the module's definition (module.c's exec, before it makes
 * any type): the state lookups below recognize the module by it. */
void pyusmipc_set_module_def(const PyModuleDef *def);

/* ---- heap-type objects ---------------------------------------------------
 * Every type of the extension is a heap type; the limited API reaches its
 * tp_alloc and tp_free only through PyType_GetSlot. */

/* A new instance of type, zero-filled (its tp_alloc), or NULL with an
 * exception set. */
static inline PyObject *pyusmipc_object_alloc(PyTypeObject *type) {
  allocfunc alloc = (allocfunc)PyType_GetSlot(type, Py_tp_alloc);
  return alloc(type, 0);
}

/* The last step of a tp_dealloc: frees op with its type's tp_free and drops
 * the reference every instance of a heap type holds to its type. */
static inline void pyusmipc_object_free(PyObject *op) {
  PyTypeObject *tp = Py_TYPE(op);
  freefunc tp_free = (freefunc)PyType_GetSlot(tp, Py_tp_free);
  tp_free(op);
  Py_DECREF(tp);
}

/* For a tp_dealloc: takes the library object (a type *) out of field, an
 * lvalue left NULL, and passes it to destroy without the GIL, as every
 * library call that may block (a driver call) runs; nothing if field is
 * NULL. */
/* As written: clang-format 14 would read the macro and the cast after it
 * as one call, Py_BEGIN_ALLOW_THREADS(void). */
/* clang-format off */
#define PYUSMIPC_DESTROY_WITHOUT_GIL(type, field, destroy)                     \
  do {                                                                         \
    if ((field) != NULL) {                                                     \
      type *taken_ = (field);                                                  \
      (field) = NULL;                                                          \
      Py_BEGIN_ALLOW_THREADS                                                   \
      (void)destroy(taken_);                                                   \
      Py_END_ALLOW_THREADS                                                     \
    }                                                                          \
  } while (0)
/* clang-format on */

/* ---- errors and arguments ------------------------------------------------ */

/* The state of the module that defined type (or one of its bases); sets
 * TypeError and returns NULL if none of them belongs to usmipc._usmipc. */
pyusmipc_module_state_t *pyusmipc_state_from_type(PyTypeObject *type);

/* Raises the Python exception for a failed usmipc call that returned code,
 * with usmipc_last_error() as the message (so call it right after the
 * failing call, on the same thread, before any other usmipc call). The
 * exception carries .code (int) and .name ("USMIPC_EINVAL"). Returns NULL.
 * For USMIPC_EINTR with an exception already pending (the one a signal
 * handler raised from the interrupt hook: KeyboardInterrupt) it raises
 * nothing new and leaves that exception to propagate. */
PyObject *pyusmipc_raise(pyusmipc_module_state_t *st, int code);
/* pyusmipc_raise with the exception type given (a subclass of usmipc.Error). */
PyObject *pyusmipc_raise_as(pyusmipc_module_state_t *st, PyObject *type,
                            int code);
/* The same with a message of the extension's own. */
PyObject *pyusmipc_raise_msg(pyusmipc_module_state_t *st, int code,
                             const char *message);
/* The same with the message formatted as PyUnicode_FromFormat does. */
PyObject *pyusmipc_raise_format(pyusmipc_module_state_t *st, int code,
                                const char *format, ...);

/* The extension's own errors, each a usmipc.Error with .code and .name
 * (PyUnicode_FromFormat's conversions; no state needed, the module is
 * found in sys.modules). All return NULL.
 *   pyusmipc_value_error  usmipc.ArgumentError (a ValueError), USMIPC_EINVAL
 *   pyusmipc_type_error   usmipc.ArgumentTypeError (a TypeError), EINVAL
 *   pyusmipc_kind_error   usmipc.MemoryKindError (a TypeError), EMEMKIND */
PyObject *pyusmipc_value_error(const char *format, ...);
PyObject *pyusmipc_type_error(const char *format, ...);
PyObject *pyusmipc_kind_error(const char *format, ...);
/* After a failed PyArg_Parse*: turns CPython's pending TypeError (a
 * missing or unexpected argument, a wrong type) into ArgumentTypeError with
 * the same message; leaves other exceptions (OverflowError) alone.
 * Returns -1. */
int pyusmipc_retype_parse_error(void);

/* Raises RuntimeError for use after the module state was cleared (only
 * possible from finalizers at interpreter shutdown). Returns NULL. */
PyObject *pyusmipc_state_cleared(void);

/* A minimal parser for METH_FASTCALL | METH_KEYWORDS arguments (the limited
 * API has no _PyArg_Parser): fills out[0..nnames) with borrowed references
 * (NULL for arguments not given), names[i] being the keyword of parameter i.
 * The first npositional parameters may also come positionally. Returns 0, or
 * -1 with TypeError set. */
int pyusmipc_parse_fastcall(const char *funcname, PyObject *const *args,
                            Py_ssize_t nargs, PyObject *kwnames,
                            const char *const *names, Py_ssize_t nnames,
                            Py_ssize_t npositional, PyObject **out);
/* obj.name (new reference), or NULL: with an exception set, or without one
 * when obj has no such attribute (the AttributeError is cleared). */
PyObject *pyusmipc_optional_attr(PyObject *obj, const char *name);
/* The name of obj's type, for messages (new reference, or NULL). */
PyObject *pyusmipc_type_name(PyObject *obj);
/* "an" before a type name that starts with a vowel ("an int"), else "a". */
const char *pyusmipc_article(PyObject *name);
/* pyusmipc_parse_fastcall for a function of one parameter, name, which must
 * be given (positionally or by keyword): 0 with *out borrowed, or -1 with
 * TypeError set ("<funcname>() missing argument '<name>'" if absent). */
int pyusmipc_parse_one_arg(const char *funcname, const char *name,
                           PyObject *const *args, Py_ssize_t nargs,
                           PyObject *kwnames, PyObject **out);

/* Python objects a file of the extension keeps from a set-up call (the
 * config dict usmipc.torch passes) or makes once (interned names). */
typedef struct pyusmipc_named {
  PyObject **at;
  const char *name;
} pyusmipc_named_t;
/* Interns each name of names[0..n) not made yet into *at: 0, or -1 with
 * an exception. */
int pyusmipc_intern_names(const pyusmipc_named_t *names, size_t n);
/* Sets *at of each of keys[0..n) to config[name] (a dict), the references
 * moved in and the old ones dropped, only once all are found: 0, or -1
 * with ValueError "<what>: no <name>" (nothing changed). */
int pyusmipc_take_config(PyObject *config, const pyusmipc_named_t *keys,
                         size_t n, const char *what);
/* counts[key] += n where counts (a dict) holds an int under key; nothing
 * where it holds none. 0, or -1 with an exception. */
int pyusmipc_dict_add(PyObject *counts, PyObject *key, Py_ssize_t n);
/* Counters kept in C and added to a dict when it is read: counts[*keys[i]]
 * += pending[i] for i < n, each pending[i] set to 0 (a counter whose key or
 * dict is not there yet waits). 0, or -1 with an exception. */
int pyusmipc_fold_counts(PyObject *counts, Py_ssize_t *pending,
                         PyObject **const *keys, int n);

/* A method table's entry for a function of another signature than
 * PyCFunction (METH_FASTCALL, METH_KEYWORDS, METH_METHOD). */
#define PYUSMIPC_CMETHOD(f) (PyCFunction)(void (*)(void))(f)

/* Classmethods are METH_CLASS functions without METH_METHOD: CPython 3.11
 * gives a bound PyCMethod no __doc__ (help(IPCMemoryHandle.open) showed
 * nothing), a bound PyCFunction its docstring. This defines name, calling
 * impl (a PyCMethod) with the defining class found from cls (the type, or
 * a subclass, of the module's typefield). */
#define PYUSMIPC_CLASSMETHOD(name, impl, typefield)                            \
  PYUSMIPC_CLASSMETHOD_CALLING_(                                               \
      name, typefield,                                                         \
      impl(cls, defining_class_, args, (size_t)nargs, kwnames))
/* The same for one impl behind several classmethods, told apart by which:
 * name calls impl(defining_class, args, nargs, kwnames, which). */
#define PYUSMIPC_CLASSMETHOD_WHICH(name, impl, typefield, which)               \
  PYUSMIPC_CLASSMETHOD_CALLING_(                                               \
      name, typefield, impl(defining_class_, args, nargs, kwnames, which))
#define PYUSMIPC_CLASSMETHOD_CALLING_(name, typefield, call)                   \
  static PyObject *name(PyObject *cls, PyObject *const *args,                  \
                        Py_ssize_t nargs, PyObject *kwnames) {                 \
    pyusmipc_module_state_t *st_ =                                             \
        pyusmipc_state_from_type((PyTypeObject *)cls);                         \
    if (st_ == NULL)                                                           \
      return NULL;                                                             \
    PyTypeObject *defining_class_ = (PyTypeObject *)st_->typefield;            \
    return call;                                                               \
  }
#define PYUSMIPC_CLASS_FLAGS (METH_CLASS | METH_FASTCALL | METH_KEYWORDS)

#endif /* PYUSMIPC_UTIL_H */
