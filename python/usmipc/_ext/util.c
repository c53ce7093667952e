/* Floor 1 of the extension usmipc._usmipc: the helpers every other file
 * uses, and which call no other file of the extension. The module state's
 * lookup from a type, the mapping of usmipc error codes to Python
 * exceptions (usmipc.Error and its kinds, with .code, .name and
 * .native_code), the extension's own argument errors, and the argument
 * parsing of METH_FASTCALL functions (the limited API has neither
 * _PyArg_Parser nor Argument Clinic). CPython's _sqlite keeps the same
 * apart from its module.c, which here is the top floor: module init.
 *
 * The module's definition lives in module.c; the state lookups compare
 * against the pointer module.c's exec hands over (pyusmipc_set_module_def)
 * before it makes any type, so this floor names nothing above it. */
#include "util.h"

#include <errno.h>
#include <stdarg.h>
#include <string.h>

/* The definition of usmipc._usmipc (module.c), set by its exec. */
static const PyModuleDef *module_def;

void pyusmipc_set_module_def(const PyModuleDef *def) { module_def = def; }

/* ---- module state lookup ------------------------------------------------- */

pyusmipc_module_state_t *pyusmipc_state_from_type(PyTypeObject *type) {
  PyTypeObject *t = type;
  while (t != NULL) {
    if (PyType_GetFlags(t) & Py_TPFLAGS_HEAPTYPE) {
      PyObject *module = PyType_GetModule(t); /* borrowed */
      if (module == NULL) {
        PyErr_Clear(); /* a heap type without a module: a Python subclass */
      } else if (PyModule_GetDef(module) == module_def) {
        return (pyusmipc_module_state_t *)PyModule_GetState(module);
      }
    }
    t = (PyTypeObject *)PyType_GetSlot(t, Py_tp_base);
  }
  pyusmipc_type_error(
      "usmipc: object's type does not derive from a usmipc type");
  return NULL;
}

/* ---- errors -------------------------------------------------------------- */

static PyObject *exception_type_for(pyusmipc_module_state_t *st, int code) {
  switch (code) {
  case USMIPC_EINVAL:
  case USMIPC_EBADHANDLE:
  case USMIPC_EHANDLEVERSION:
  case USMIPC_ERANGE:
  case USMIPC_EOTHERHOST:
  case USMIPC_EWRONGDEVICE:
    return st->ArgumentError;
  case USMIPC_EMEMKIND:
    return st->MemoryKindError;
  case USMIPC_ENOMEM:
    return st->OutOfMemoryError;
  case USMIPC_ETIMEDOUT:
    /* usmipc.IPCTimeoutError: both a usmipc.Error and a TimeoutError, so
     * that code catching either (or OSError with errno ETIMEDOUT) sees it. */
    return st->TimeoutError;
  default:
    /* Also USMIPC_EINTR without a pending exception, USMIPC_EMFILE,
     * USMIPC_ENAMESPACE and USMIPC_EUNTRUSTED: runtime conditions, told
     * apart by .code / .name. */
    return st->Error;
  }
}

static PyObject *raise_with_type(pyusmipc_module_state_t *st, PyObject *type,
                                 int code, const char *message, long native);

static PyObject *raise_with(pyusmipc_module_state_t *st, int code,
                            const char *message, long native) {
  return raise_with_type(st, exception_type_for(st, code), code, message,
                         native);
}

PyObject *pyusmipc_raise_as(pyusmipc_module_state_t *st, PyObject *type,
                            int code) {
  const char *message = usmipc_last_error();
  if (message == NULL || message[0] == '\0')
    message = usmipc_strerror(code);
  return raise_with_type(st, type, code, message, usmipc_last_native_error());
}

/* The library's messages are written for C callers and name C calls; a
 * Python caller reads the Python call instead. Each pair: the C words,
 * then the Python words (tests/python/conftest.py fails a test whose
 * caught exception still names a C function). */
static const char *const PYTHON_WORDS[][2] = {
    {" / usmipc_ipc_handle_data()", ""},
    {"usmipc_bundle_order_ex(..., USMIPC_ORDER_RELEASE), or share(..., "
     "release=True) in Python",
     "share(..., release=True)"},
    {"usmipc_ipc_release: ", "returning the release ticket: "},
    {"usmipc_ipc_forward: ", "forward_shared(): "},
    {"(they were not written by usmipc_ipc_handle_order_ex or "
     "usmipc_bundle_order_ex)",
     "(they were not written by share(..., release=True))"},
    {"usmipc_bundle_update: ", "UpdatePlan.update(): "},
    {"usmipc_pool_malloc: ", "MemoryPool.allocate(): "},
    {"open them with usmipc_ipc_open (IPCMemoryHandle.open)",
     "open them with IPCMemoryHandle.open()"},
};

static PyObject *python_words(PyObject *text) {
  const char *utf8 = PyUnicode_AsUTF8AndSize(text, NULL);
  if (utf8 == NULL) {
    PyErr_Clear();
    return text;
  }
  if (strstr(utf8, "usmipc_") == NULL)
    return text;
  for (size_t i = 0; i < sizeof(PYTHON_WORDS) / sizeof(PYTHON_WORDS[0]); i++) {
    PyObject *from = PyUnicode_FromString(PYTHON_WORDS[i][0]);
    PyObject *to = from ? PyUnicode_FromString(PYTHON_WORDS[i][1]) : NULL;
    PyObject *out = to ? PyUnicode_Replace(text, from, to, -1) : NULL;
    Py_XDECREF(from);
    Py_XDECREF(to);
    Py_DECREF(text);
    if (out == NULL)
      return NULL;
    text = out;
  }
  return text;
}

static PyObject *raise_with_type(pyusmipc_module_state_t *st, PyObject *type,
                                 int code, const char *message, long native) {
  (void)st;
  if (type == NULL) {
    type = PyExc_RuntimeError; /* the module state was cleared (shutdown) */
  }
  PyObject *text =
      PyUnicode_DecodeUTF8(message, (Py_ssize_t)strlen(message), "replace");
  if (text != NULL)
    text = python_words(text);
  if (text == NULL) {
    return NULL;
  }
  PyObject *exc = PyObject_CallFunctionObjArgs(type, text, NULL);
  Py_DECREF(text);
  if (exc == NULL) {
    return NULL;
  }
  PyObject *code_obj = PyLong_FromLong(code);
  PyObject *name_obj = PyUnicode_FromString(usmipc_err_name(code));
  PyObject *native_obj = PyLong_FromLong(native);
  if (code_obj == NULL || name_obj == NULL || native_obj == NULL ||
      PyObject_SetAttrString(exc, "code", code_obj) < 0 ||
      PyObject_SetAttrString(exc, "name", name_obj) < 0 ||
      PyObject_SetAttrString(exc, "native_code", native_obj) < 0) {
    Py_XDECREF(code_obj);
    Py_XDECREF(name_obj);
    Py_XDECREF(native_obj);
    Py_DECREF(exc);
    return NULL;
  }
  Py_DECREF(code_obj);
  Py_DECREF(name_obj);
  Py_DECREF(native_obj);
  if (code == USMIPC_ETIMEDOUT && PyObject_IsSubclass(type, PyExc_OSError)) {
    /* As an OSError it says errno ETIMEDOUT (str() stays the message). */
    PyObject *errno_obj = PyLong_FromLong(ETIMEDOUT);
    if (errno_obj == NULL ||
        PyObject_SetAttrString(exc, "errno", errno_obj) < 0) {
      Py_XDECREF(errno_obj);
      Py_DECREF(exc);
      return NULL;
    }
    Py_DECREF(errno_obj);
  }
  PyErr_SetObject(type, exc);
  Py_DECREF(exc);
  return NULL;
}

PyObject *pyusmipc_raise(pyusmipc_module_state_t *st, int code) {
  if (code == USMIPC_EINTR && PyErr_Occurred()) {
    /* The interrupt hook ran a signal handler that raised (Ctrl-C:
     * KeyboardInterrupt) and so abandoned the call: that exception, left
     * pending on this thread, is the one to propagate. */
    return NULL;
  }
  /* Both are thread-local in the core and valid until the next usmipc call
   * on this thread; nothing below calls into usmipc before they are used. */
  const char *message = usmipc_last_error();
  long native = usmipc_last_native_error();
  if (message == NULL || message[0] == '\0') {
    message = usmipc_strerror(code);
  }
  return raise_with(st, code, message, native);
}

PyObject *pyusmipc_raise_msg(pyusmipc_module_state_t *st, int code,
                             const char *message) {
  return raise_with(st, code, message, 0);
}

PyObject *pyusmipc_raise_format(pyusmipc_module_state_t *st, int code,
                                const char *format, ...) {
  va_list ap;
  va_start(ap, format);
  PyObject *text = PyUnicode_FromFormatV(format, ap);
  va_end(ap);
  if (text == NULL) {
    return NULL;
  }
  const char *message = PyUnicode_AsUTF8AndSize(text, NULL);
  if (message != NULL) {
    pyusmipc_raise_msg(st, code, message);
  }
  Py_DECREF(text);
  return NULL;
}

/* ---- the extension's own argument errors ---------------------------------
 *
 * Errors the extension finds itself (a bad argument, memory of the wrong
 * kind) are usmipc.Error subclasses too, with the code they would have had
 * from the library. Raising one finds the module's state through
 * sys.modules, so that any function can raise without a state at hand;
 * errors are the slow path. If the module is gone (interpreter shutdown),
 * the plain built-in exception is raised instead. */

static pyusmipc_module_state_t *state_of_imported_module(void) {
  PyObject *name = PyUnicode_FromString("usmipc._usmipc");
  if (name == NULL) {
    return NULL;
  }
  PyObject *module = PyImport_GetModule(name); /* new reference or NULL */
  Py_DECREF(name);
  if (module == NULL) {
    PyErr_Clear();
    return NULL;
  }
  pyusmipc_module_state_t *st = NULL;
  if (PyModule_Check(module) && PyModule_GetDef(module) == module_def) {
    st = PyModule_GetState(module);
  } else {
    PyErr_Clear();
  }
  Py_DECREF(module); /* sys.modules keeps it alive */
  return st;
}

static PyObject *raise_own(int which, const char *format, va_list va) {
  PyErr_Clear(); /* replaces a pending exception, as PyErr_Format does */
  PyObject *text = PyUnicode_FromFormatV(format, va);
  if (text == NULL) {
    return NULL;
  }
  pyusmipc_module_state_t *st = state_of_imported_module();
  PyObject *type = NULL, *builtin;
  int code;
  switch (which) {
  case 1:
    builtin = PyExc_TypeError;
    code = USMIPC_EINVAL;
    type = st ? st->ArgumentTypeError : NULL;
    break;
  case 2:
    builtin = PyExc_TypeError;
    code = USMIPC_EMEMKIND;
    type = st ? st->MemoryKindError : NULL;
    break;
  default:
    builtin = PyExc_ValueError;
    code = USMIPC_EINVAL;
    type = st ? st->ArgumentError : NULL;
    break;
  }
  if (type == NULL) {
    PyErr_SetObject(builtin, text);
    Py_DECREF(text);
    return NULL;
  }
  const char *message = PyUnicode_AsUTF8AndSize(text, NULL);
  if (message == NULL) {
    Py_DECREF(text);
    return NULL;
  }
  raise_with_type(st, type, code, message, 0);
  Py_DECREF(text);
  return NULL;
}

PyObject *pyusmipc_value_error(const char *format, ...) {
  va_list va;
  va_start(va, format);
  raise_own(0, format, va);
  va_end(va);
  return NULL;
}

PyObject *pyusmipc_type_error(const char *format, ...) {
  va_list va;
  va_start(va, format);
  raise_own(1, format, va);
  va_end(va);
  return NULL;
}

PyObject *pyusmipc_kind_error(const char *format, ...) {
  va_list va;
  va_start(va, format);
  raise_own(2, format, va);
  va_end(va);
  return NULL;
}

int pyusmipc_retype_parse_error(void) {
  if (!PyErr_Occurred() || !PyErr_ExceptionMatches(PyExc_TypeError)) {
    return -1;
  }
  PyObject *type, *value, *traceback;
  PyErr_Fetch(&type, &value, &traceback);
  PyErr_NormalizeException(&type, &value, &traceback);
  pyusmipc_module_state_t *st = state_of_imported_module();
  if (st == NULL || st->ArgumentTypeError == NULL || type != PyExc_TypeError ||
      value == NULL) {
    /* already one of ours (or a subclass someone raised): leave it */
    PyErr_Restore(type, value, traceback);
    return -1;
  }
  PyObject *text = PyObject_Str(value);
  const char *message = text ? PyUnicode_AsUTF8AndSize(text, NULL) : NULL;
  if (message == NULL) {
    Py_XDECREF(text);
    PyErr_Clear();
    PyErr_Restore(type, value, traceback);
    return -1;
  }
  raise_with_type(st, st->ArgumentTypeError, USMIPC_EINVAL, message, 0);
  Py_DECREF(text);
  Py_XDECREF(type);
  Py_XDECREF(value);
  Py_XDECREF(traceback);
  return -1;
}

PyObject *pyusmipc_state_cleared(void) {
  PyErr_SetString(PyExc_RuntimeError,
                  "usmipc: the usmipc._usmipc module was already finalized");
  return NULL;
}

/* ---- argument parsing ---------------------------------------------------- */

int pyusmipc_parse_fastcall(const char *funcname, PyObject *const *args,
                            Py_ssize_t nargs, PyObject *kwnames,
                            const char *const *names, Py_ssize_t nnames,
                            Py_ssize_t npositional, PyObject **out) {
  for (Py_ssize_t i = 0; i < nnames; i++) {
    out[i] = NULL;
  }
  if (nargs > npositional) {
    pyusmipc_type_error(
        "%s() takes at most %zd positional argument%s (%zd given)", funcname,
        npositional, npositional == 1 ? "" : "s", nargs);
    return -1;
  }
  for (Py_ssize_t i = 0; i < nargs; i++) {
    out[i] = args[i];
  }
  if (kwnames == NULL) {
    return 0;
  }
  Py_ssize_t nkw = PyTuple_Size(kwnames);
  for (Py_ssize_t k = 0; k < nkw; k++) {
    PyObject *key = PyTuple_GetItem(kwnames, k); /* borrowed */
    Py_ssize_t j = 0;
    while (j < nnames && PyUnicode_CompareWithASCIIString(key, names[j]) != 0) {
      j++;
    }
    if (j == nnames) {
      pyusmipc_type_error("%s() got an unexpected keyword argument '%U'",
                          funcname, key);
      return -1;
    }
    if (out[j] != NULL) {
      pyusmipc_type_error("%s() got multiple values for argument '%s'",
                          funcname, names[j]);
      return -1;
    }
    out[j] = args[nargs + k];
  }
  return 0;
}

int pyusmipc_parse_one_arg(const char *funcname, const char *name,
                           PyObject *const *args, Py_ssize_t nargs,
                           PyObject *kwnames, PyObject **out) {
  const char *const names[] = {name};
  if (pyusmipc_parse_fastcall(funcname, args, nargs, kwnames, names, 1, 1,
                              out) < 0) {
    return -1;
  }
  if (*out == NULL) {
    pyusmipc_type_error("%s() missing argument '%s'", funcname, name);
    return -1;
  }
  return 0;
}

PyObject *pyusmipc_optional_attr(PyObject *obj, const char *name) {
  PyObject *value = PyObject_GetAttrString(obj, name);
  if (value == NULL && PyErr_ExceptionMatches(PyExc_AttributeError)) {
    PyErr_Clear();
  }
  return value;
}

PyObject *pyusmipc_type_name(PyObject *obj) {
  return PyType_GetName(Py_TYPE(obj));
}

const char *pyusmipc_article(PyObject *name) {
  /* By the first letter only: "an int", "an ndarray", "a list", "a
   * Tensor" (good enough for type names; "an usmipc..." never occurs:
   * usmipc's own types are never the wrong ones). */
  if (name == NULL || !PyUnicode_Check(name) || PyUnicode_GetLength(name) < 1)
    return "a";
  Py_UCS4 c = PyUnicode_ReadChar(name, 0);
  return c == 'a' || c == 'e' || c == 'i' || c == 'o' || c == 'u' || c == 'A' ||
                 c == 'E' || c == 'I' || c == 'O' || c == 'U'
             ? "an"
             : "a";
}

int pyusmipc_intern_names(const pyusmipc_named_t *names, size_t n) {
  for (size_t i = 0; i < n; i++)
    if (*names[i].at == NULL &&
        (*names[i].at = PyUnicode_InternFromString(names[i].name)) == NULL)
      return -1;
  return 0;
}

int pyusmipc_take_config(PyObject *config, const pyusmipc_named_t *keys,
                         size_t n, const char *what) {
  if (!PyDict_Check(config)) {
    pyusmipc_type_error("%s: a dict", what);
    return -1;
  }
  PyObject **got = PyMem_Calloc(n ? n : 1, sizeof(*got));
  if (got == NULL) {
    PyErr_NoMemory();
    return -1;
  }
  int rc = 0;
  /* Each held as it is found: a lookup may run a key's __eq__, which may
   * change the dict. */
  for (size_t i = 0; i < n && rc == 0; i++) {
    got[i] = PyDict_GetItemString(config, keys[i].name);
    if (got[i] == NULL) {
      pyusmipc_value_error("%s: no %s", what, keys[i].name);
      rc = -1;
    } else {
      Py_INCREF(got[i]);
    }
  }
  for (size_t i = 0; i < n; i++) {
    if (rc == 0) { /* the references move to *at; the old ones go */
      PyObject *old = *keys[i].at;
      *keys[i].at = got[i];
      got[i] = old;
    }
    Py_XDECREF(got[i]);
  }
  PyMem_Free(got);
  return rc;
}

int pyusmipc_dict_add(PyObject *counts, PyObject *key, Py_ssize_t n) {
  PyObject *v = PyDict_GetItemWithError(counts, key);
  if (v == NULL)
    return PyErr_Occurred() ? -1 : 0;
  Py_ssize_t was = PyLong_AsSsize_t(v);
  PyObject *nv =
      was == -1 && PyErr_Occurred() ? NULL : PyLong_FromSsize_t(was + n);
  int rc = nv == NULL ? -1 : PyDict_SetItem(counts, key, nv);
  Py_XDECREF(nv);
  return rc;
}

int pyusmipc_fold_counts(PyObject *counts, Py_ssize_t *pending,
                         PyObject **const *keys, int n) {
  for (int i = 0; i < n; i++) {
    if (pending[i] == 0 || counts == NULL || *keys[i] == NULL)
      continue;
    Py_ssize_t add = pending[i];
    pending[i] = 0;
    if (pyusmipc_dict_add(counts, *keys[i], add) < 0)
      return -1;
  }
  return 0;
}
