/* Floor 7 of the extension: usmipc.memory.IPCMemoryHandle, the exporter's
 * side (IPCMemoryHandle(mem), to_bytes(), pickling) and the importer's
 * (open, close_mapping). Calls memory.c, interop.c, memory_core.c,
 * queue.c, handle_bytes.c, device.c and util.c (module.c lists the
 * floors). Its length serves that one type: its exports, ordered handoffs
 * and release tickets, and its opens, the hot path of a re-open loop.
 *
 * Ordering (the default where the device's backend has events): the handle
 * keeps the queue the producer's work runs on (stream=, else the memory's
 * own queue, a torch tensor's current stream, a CuPy array's current
 * stream), and every handoff (to_bytes(), pickling, open() of the handle
 * object) records a fresh event there with usmipc_ipc_handle_order, so
 * the importer waits for the work submitted before that handoff. The
 * ordering runs without the GIL, one thread at a time per handle (the
 * library's handle is ordered by one thread at a time). ordered=False
 * keeps the old path: to_bytes() returns the same bytes object each time.
 *
 * An exported handle holds the memory object it was taken from, so the
 * allocation outlives the handle's bytes for as long as the handle lives,
 * and keeps the library's handle until it dies. Another library's tensor
 * exported through __dlpack__ is held twice: by the object and by the
 * consumed DLPack tensor, whose deleter (run when the handle dies) is what
 * DLPack promises keeps the producer's memory alive. A handle rebuilt from
 * bytes (unpickled, from_bytes) carries only the bytes.
 *
 * open and close_mapping are the hot path of a re-open loop: both are C
 * class methods that cost one library call and, for open, one object.
 */
#include "ipc_handle.h"

#include <stddef.h>
#include <structmember.h>

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "device.h"
#include "handle_bytes.h"
#include "interop.h"
#include "memory.h"
#include "memory_core.h"
#include "queue.h"
#include "util.h"

typedef struct handle_object {
  PyObject_HEAD PyObject *memory; /* the exported memory object, or NULL */
  PyObject *tensor; /* capsule owning a consumed DLPack tensor, or NULL */
  /* bytes: the serialized handle, unordered for an exported handle; the
   * bytes given for one made from bytes */
  PyObject *data;
  usmipc_ipc_handle_t *handle; /* the library's handle, or NULL */
  /* Ordered exported handles: the usmipc.Queue each handoff records on,
   * the bytes of the latest handoff (or NULL), and the lock that makes one
   * thread at a time order the library's handle (taken without the GIL). */
  PyObject *order_queue;
  char release; /* release=True: every handoff carries a release ticket */
  PyObject *last;
  pthread_mutex_t order_lock;
  char lock_ready;
  char closed; /* close() was called: no more bytes */
  usmipc_ipc_handle_info_t info;
} Handle;

static pyusmipc_module_state_t *handle_state(PyObject *self) {
  /* The type is final and made by this module. */
  return (pyusmipc_module_state_t *)PyType_GetModuleState(Py_TYPE(self));
}

/* ---- construction -------------------------------------------------------- */

/* The exported range [offset, offset + nbytes) of a region of size bytes:
 * nbytes_obj None means to the end. Returns 0 or -1 (ValueError). */
static int export_range(Py_ssize_t size, Py_ssize_t offset,
                        PyObject *nbytes_obj, Py_ssize_t *nbytes) {
  if (offset < 0 || offset >= size) {
    pyusmipc_value_error("offset %zd is outside the %zd bytes", offset, size);
    return -1;
  }
  *nbytes = size - offset;
  if (nbytes_obj != Py_None) {
    Py_ssize_t n = PyLong_AsSsize_t(nbytes_obj);
    if (n == -1 && PyErr_Occurred()) {
      pyusmipc_retype_parse_error(); /* a wrong type: ArgumentTypeError */
      return -1;
    }
    if (n <= 0 || n > size - offset) {
      pyusmipc_value_error("nbytes must be in 1..%zd for offset %zd, not %zd",
                           size - offset, offset, n);
      return -1;
    }
    *nbytes = n;
  }
  return 0;
}

/* Exports [ptr, ptr + nbytes) and returns a new handle holding owner and
 * tensor (NULL, or the capsule of a consumed DLPack tensor). mem (or NULL
 * for foreign memory) is the usmipc memory object, counted as busy while
 * the GIL is released so that a concurrent close waits. */
static PyObject *export_memory(PyTypeObject *type, pyusmipc_module_state_t *st,
                               PyObject *owner, PyObject *tensor,
                               pyusmipc_memory_object_t *mem, const char *ptr,
                               Py_ssize_t nbytes) {
  Handle *self = (Handle *)pyusmipc_object_alloc(type);
  if (self == NULL) {
    return NULL;
  }
  self->tensor = Py_XNewRef(tensor);
  if (mem != NULL && pyusmipc_memory_begin(mem) < 0) {
    Py_DECREF(self);
    return NULL;
  }
  usmipc_ipc_handle_t *handle = NULL;
  const void *data = NULL;
  size_t len = 0;
  int rc;
  Py_BEGIN_ALLOW_THREADS
  rc = usmipc_ipc_get_handle(ptr, (size_t)nbytes, &handle);
  rc = pyusmipc_handle_describe(rc, handle, &data, &len, &self->info);
  Py_END_ALLOW_THREADS
  self->handle = handle; /* freed by dealloc, even after a failure */
  if (rc < 0) {
    pyusmipc_raise(st, rc);
    if (mem != NULL) {
      (void)pyusmipc_memory_end(mem);
    }
    Py_DECREF(self);
    return NULL;
  }
  if (mem != NULL && pyusmipc_memory_end(mem) < 0) {
    Py_DECREF(self);
    return NULL;
  }
  self->data = PyBytes_FromStringAndSize(data, (Py_ssize_t)len);
  if (self->data == NULL) {
    Py_DECREF(self);
    return NULL;
  }
  self->memory = Py_NewRef(owner);
  return (PyObject *)self;
}

/* Makes a new exported handle ordered (or leaves it unordered): ordered is
 * 1 (asked for), 0 (ordered=False) or -1 (the default: ordered where the
 * device's backend has events). device is the memory's Device; mem the
 * usmipc memory object, or NULL for another library's array obj. 0 or -1. */
static int setup_order(pyusmipc_module_state_t *st, Handle *self,
                       PyObject *stream, int ordered, PyObject *device,
                       pyusmipc_memory_object_t *mem, PyObject *obj) {
  if (ordered == 0) {
    if (stream != NULL) {
      pyusmipc_value_error(
          "IPCMemoryHandle(): stream= is the queue each handoff "
          "is ordered on, so it cannot go with ordered=False; "
          "drop one of them");
      return -1;
    }
    return 0;
  }
  if (stream != NULL) {
    ordered = 1; /* a stream asks for ordering */
  }
  int has = pyusmipc_device_has_events(st, device);
  if (has < 0) {
    return -1;
  }
  if (!has) {
    if (ordered < 0) {
      return 0; /* no events on this backend: plain handles, as before */
    }
    usmipc_device_t *d = ((pyusmipc_device_object_t *)device)->device;
    char message[320];
    snprintf(message, sizeof(message),
             "IPCMemoryHandle(): %s devices do not support events yet, so "
             "the handle cannot make importers wait for the producer's "
             "work; pass ordered=False and synchronize that work before "
             "sending the bytes",
             usmipc_backend_name(usmipc_device_backend(d)));
    pyusmipc_raise_msg(st, USMIPC_ENOTSUP, message);
    return -1;
  }
  PyObject *queue = NULL;
  if (stream != NULL) {
    queue = pyusmipc_queue_from_stream(st, stream, NULL, device,
                                       "IPCMemoryHandle()");
  } else if (mem != NULL) {
    queue = Py_XNewRef(pyusmipc_memory_queue_object(mem));
  } else {
    PyObject *current = pyusmipc_foreign_current_stream(obj);
    if (current == NULL) {
      return -1;
    }
    if (current != Py_None) {
      queue = pyusmipc_queue_from_stream(st, current, NULL, device,
                                         "IPCMemoryHandle()");
    } else if (usmipc_device_backend(
                   ((pyusmipc_device_object_t *)device)->device) ==
               USMIPC_BACKEND_CUDA) {
      /* An array of a library whose streams usmipc does not know: the
       * legacy default stream, which waits for the work of every blocking
       * stream of the context. */
      queue = pyusmipc_queue_wrap(st, device, NULL, NULL, "IPCMemoryHandle()");
    } else {
      queue = pyusmipc_default_queue(st, device);
    }
    Py_DECREF(current);
  }
  if (queue == NULL) {
    return -1;
  }
  if (pthread_mutex_init(&self->order_lock, NULL) != 0) {
    Py_DECREF(queue);
    PyErr_SetString(PyExc_RuntimeError,
                    "IPCMemoryHandle(): could not initialize a mutex");
    return -1;
  }
  self->lock_ready = 1;
  self->order_queue = queue;
  return 0;
}

/* release=True: every handoff also carries a release ticket, ordered or
 * not (the lock that orders the library's handle guards tickets too). */
static int setup_release(Handle *self, int release) {
  if (!release) {
    return 0;
  }
  if (!self->lock_ready) {
    if (pthread_mutex_init(&self->order_lock, NULL) != 0) {
      PyErr_SetString(PyExc_RuntimeError,
                      "IPCMemoryHandle(): could not initialize a mutex");
      return -1;
    }
    self->lock_ready = 1;
  }
  self->release = 1;
  return 0;
}

static PyObject *handle_new(PyTypeObject *type, PyObject *args,
                            PyObject *kwds) {
  static char *kwlist[] = {"memory",  "offset",  "nbytes", "stream",
                           "ordered", "release", NULL};
  PyObject *mem_obj;
  Py_ssize_t offset = 0;
  PyObject *nbytes_obj = Py_None;
  PyObject *stream = NULL, *ordered_obj = NULL;
  int release = 0;
  Py_ssize_t nbytes;
  if (!PyArg_ParseTupleAndKeywords(args, kwds, "O|nO$OOp:IPCMemoryHandle",
                                   kwlist, &mem_obj, &offset, &nbytes_obj,
                                   &stream, &ordered_obj, &release)) {
    pyusmipc_retype_parse_error();
    return NULL;
  }
  if (stream == Py_None) {
    stream = NULL;
  }
  int ordered = -1;
  if (ordered_obj != NULL && (ordered = PyObject_IsTrue(ordered_obj)) < 0) {
    return NULL;
  }
  pyusmipc_module_state_t *st = pyusmipc_state_from_type(type);
  if (st == NULL) {
    return NULL;
  }

  if (!PyObject_TypeCheck(mem_obj, st->MemoryType)) {
    /* Another library's device memory (a torch tensor, a CuPy array, a JAX
     * array): the library decides from the pointer whether it can be
     * exported. __cuda_array_interface__ first: reading it costs a dict,
     * where __dlpack__ makes the producer build and later free a tensor. */
    void *ptr;
    Py_ssize_t size;
    PyObject *tensor = NULL;
    int found = pyusmipc_cuda_array_range(mem_obj, &ptr, &size);
    if (found == 0) {
      found = pyusmipc_dlpack_range(mem_obj, &ptr, &size, &tensor);
    }
    if (found < 0) {
      return NULL;
    }
    if (found == 0) {
      pyusmipc_type_error(
          "IPCMemoryHandle() exports device memory allocated by "
          "usmipc (MemoryUSMDevice) or an array with "
          "__cuda_array_interface__ or __dlpack__, not %R",
          (PyObject *)Py_TYPE(mem_obj));
      return NULL;
    }
    PyObject *handle = NULL;
    if (export_range(size, offset, nbytes_obj, &nbytes) == 0) {
      handle = export_memory(type, st, mem_obj, tensor, NULL,
                             (const char *)ptr + offset, nbytes);
    }
    Py_XDECREF(tensor); /* on failure, gives the tensor back to its producer */
    if (handle != NULL && ordered != 0) {
      PyObject *device = pyusmipc_device_of_info(st, &((Handle *)handle)->info);
      int rc = device == NULL ? -1
               : device == Py_None
                   ? 0 /* exported, yet not a device of ours: unordered */
                   : setup_order(st, (Handle *)handle, stream, ordered, device,
                                 NULL, mem_obj);
      Py_XDECREF(device);
      if (rc < 0) {
        Py_CLEAR(handle);
      }
    } else if (handle != NULL && stream != NULL) {
      if (setup_order(st, (Handle *)handle, stream, 0, NULL, NULL, NULL) < 0) {
        Py_CLEAR(handle);
      }
    }
    if (handle != NULL && setup_release((Handle *)handle, release) < 0) {
      Py_CLEAR(handle);
    }
    return handle;
  }

  pyusmipc_memory_object_t *mem = (pyusmipc_memory_object_t *)mem_obj;
  if (mem->kind != USMIPC_MEM_DEVICE) {
    PyObject *name = PyType_GetName(Py_TYPE(mem_obj));
    if (name != NULL) { /* usmipc.MemoryKindError, a TypeError */
      pyusmipc_raise_format(st, USMIPC_EMEMKIND,
                            "IPCMemoryHandle() exports device memory only "
                            "(MemoryUSMDevice); %U memory is of kind '%s'",
                            name, pyusmipc_kind_name(mem->kind));
      Py_DECREF(name);
    }
    return NULL;
  }
  if (mem->closed || mem->released) {
    pyusmipc_value_error("mapping is closed");
    return NULL;
  }
  if (mem->device == NULL) {
    pyusmipc_value_error("memory object is not initialized");
    return NULL;
  }
  usmipc_device_t *device = ((pyusmipc_device_object_t *)mem->device)->device;
  if (!usmipc_device_has_ipc(device)) {
    char message[256];
    snprintf(message, sizeof(message),
             "device %s ('%s') does not support IPC memory "
             "(has_aspect_ipc_memory is False); share the data through the "
             "host instead",
             usmipc_device_filter_string(device), usmipc_device_name(device));
    return pyusmipc_raise_msg(st, USMIPC_ENOTSUP, message);
  }
  if (export_range(mem->nbytes, offset, nbytes_obj, &nbytes) < 0) {
    return NULL;
  }
  PyObject *handle = export_memory(type, st, mem_obj, NULL, mem,
                                   (const char *)mem->ptr + offset, nbytes);
  if (handle != NULL && (setup_order(st, (Handle *)handle, stream, ordered,
                                     mem->device, mem, mem_obj) < 0 ||
                         setup_release((Handle *)handle, release) < 0)) {
    Py_CLEAR(handle);
  }
  return handle;
}

/* The bytes of the next handoff (new reference): for an ordered exported
 * handle, freshly ordered on its queue (without the GIL); otherwise the
 * handle's bytes, the same object each time. */
static PyObject *handle_closed_error(void) {
  /* usmipc.ArgumentError: a usmipc.Error, so a RuntimeError as before. */
  return pyusmipc_value_error("the IPCMemoryHandle is closed (close() was "
                              "called): it gives no more bytes; make a new "
                              "one of the memory: IPCMemoryHandle(mem)");
}

static PyObject *handle_current_bytes(Handle *self) {
  if (self->closed) {
    return handle_closed_error();
  }
  if ((self->order_queue == NULL && !self->release) || self->handle == NULL) {
    return Py_NewRef(self->data);
  }
  PyObject *queue_obj = Py_XNewRef(self->order_queue);
  usmipc_queue_t *queue =
      queue_obj ? ((pyusmipc_queue_object_t *)queue_obj)->queue : NULL;
  unsigned flags = self->release ? USMIPC_ORDER_RELEASE : 0;
  usmipc_ipc_handle_t *handle = self->handle;
  /* The bytes are copied out under the lock (the next handoff rewrites
   * them); a handle fits the stack buffer but for an unusual number of
   * extension records. */
  char small[1024];
  char *copy = NULL;
  size_t len = 0;
  int rc;
  Py_BEGIN_ALLOW_THREADS
  pthread_mutex_lock(&self->order_lock);
  const void *data = NULL;
  /* close() may have taken the handle meanwhile (under this lock). */
  handle = self->handle;
  rc = handle == NULL ? 1 : usmipc_ipc_handle_order_ex(handle, queue, flags);
  if (rc == 0) {
    rc = usmipc_ipc_handle_data(handle, &data, &len);
  }
  if (rc == 0) {
    copy = len <= sizeof(small) ? small : malloc(len);
    if (copy != NULL) {
      memcpy(copy, data, len);
    }
  }
  pthread_mutex_unlock(&self->order_lock);
  Py_END_ALLOW_THREADS
  Py_XDECREF(queue_obj);
  if (rc == 1) {
    return handle_closed_error();
  }
  if (rc < 0) {
    return pyusmipc_raise(handle_state((PyObject *)self), rc);
  }
  if (copy == NULL) {
    return PyErr_NoMemory();
  }
  PyObject *bytes = PyBytes_FromStringAndSize(copy, (Py_ssize_t)len);
  if (copy != small) {
    free(copy);
  }
  if (bytes != NULL) {
    PyObject *old = self->last;
    self->last = Py_NewRef(bytes);
    Py_XDECREF(old);
  }
  return bytes;
}

/* Memory handle bytes given as bytes, an IPCMemoryHandle or any buffer.
 * For an IPCMemoryHandle, fresh != 0 takes the bytes of a new handoff
 * (ordered afresh), fresh == 0 the bytes it last gave out. 0, or -1 with
 * an exception set. */
static int handle_bytes(pyusmipc_module_state_t *st, PyObject *obj,
                        pyusmipc_handle_bytes_t *hb, int fresh) {
  if (Py_IS_TYPE(obj, st->IPCMemoryHandleType)) {
    Handle *h = (Handle *)obj;
    PyObject *bytes = fresh ? handle_current_bytes(h)
                            : Py_NewRef(h->last ? h->last : h->data);
    if (bytes == NULL) {
      return -1;
    }
    return pyusmipc_handle_bytes_of(obj, bytes, hb);
  }
  return pyusmipc_handle_bytes_read(
      obj, hb, st->IPCEventHandleType,
      "expected the bytes of a memory handle or an IPCMemoryHandle, not an "
      "IPCEventHandle (open it with IPCEventHandle.open())",
      "handle bytes or an IPCMemoryHandle");
}

static PyObject *handle_from_bytes(PyObject *cls, PyTypeObject *defining_class,
                                   PyObject *const *args, Py_ssize_t nargs,
                                   PyObject *kwnames) {
  (void)cls;
  PyObject *raw;
  pyusmipc_module_state_t *st = PyType_GetModuleState(defining_class);
  if (pyusmipc_parse_one_arg("from_bytes", "data", args, nargs, kwnames, &raw) <
      0) {
    return NULL;
  }
  PyTypeObject *type = st->IPCMemoryHandleType;
  if (type == NULL) {
    return pyusmipc_state_cleared();
  }
  pyusmipc_handle_bytes_t hb;
  if (handle_bytes(st, raw, &hb, 1) < 0) {
    return NULL;
  }
  Handle *self = (Handle *)pyusmipc_object_alloc(type);
  if (self != NULL &&
      (self->data = pyusmipc_handle_bytes_decode(
           st, &hb, &self->info, 0,
           "IPCMemoryHandle.from_bytes(): these are the bytes of an event "
           "handle, not of memory; use IPCEventHandle.from_bytes()")) == NULL) {
    Py_CLEAR(self);
  }
  pyusmipc_handle_bytes_release(&hb);
  return (PyObject *)self;
}

/* ---- GC ------------------------------------------------------------------ */

static int handle_traverse(PyObject *op, visitproc visit, void *arg) {
  Handle *self = (Handle *)op;
  Py_VISIT(Py_TYPE(op));
  Py_VISIT(self->memory);
  Py_VISIT(self->data);
  Py_VISIT(self->order_queue);
  Py_VISIT(self->last);
  return 0;
}

static int handle_clear(PyObject *op) {
  Handle *self = (Handle *)op;
  Py_CLEAR(self->memory);
  Py_CLEAR(self->data);
  Py_CLEAR(self->order_queue);
  Py_CLEAR(self->last);
  return 0;
}

static void handle_dealloc(PyObject *op) {
  Handle *self = (Handle *)op;
  PyObject_GC_UnTrack(op);
  /* Before dropping the memory: the handle names that allocation. */
  PYUSMIPC_DESTROY_WITHOUT_GIL(usmipc_ipc_handle_t, self->handle,
                               usmipc_ipc_free_handle);
  /* The producer may free its memory once the deleter has run, so only
   * after the library's handle is gone; not in tp_clear, which may run
   * before (the capsule is no GC object and takes part in no cycle). */
  Py_CLEAR(self->tensor);
  handle_clear(op);
  if (self->lock_ready) {
    pthread_mutex_destroy(&self->order_lock);
    self->lock_ready = 0;
  }
  pyusmipc_object_free(op);
}

/* ---- the importer's side ------------------------------------------------- */

/* IPCMemoryHandle.open()'s refusal of event handle bytes. */
#define EVENT_BYTES_TO_OPEN                                                    \
  "IPCMemoryHandle.open(): these are the bytes of an event handle "            \
  "(IPCEventHandle), not of memory; open them with IPCEventHandle.open()"

/* Whether handle bytes carry a release ticket, as the library decodes them
 * (the extension knows no wire offsets). The decode costs 50 to 80 ns per
 * open on an x86 host (handles of 216 to 324 bytes), a tenth of a cached
 * re-open's 0.4 to 0.6 us from Python, so every open pays it rather than
 * peeking at where the ticket's record sits in the bytes. */
static int carries_release_ticket(const char *data, Py_ssize_t len) {
  usmipc_ipc_handle_info_t info;
  return usmipc_ipc_handle_inspect(data, (size_t)len, &info) == 0 &&
         info.release_ticket != 0;
}

/* open() and open_sycl(): the same first arguments; sycl selects
 * usmipc_ipc_open_sycl (bytes of a SYCL program's IPC handle), which has
 * no ordering (stream, ordered). handle= is the old name of handle_bytes.
 * The positional call without keywords is the benchmarked re-open path: it
 * parses nothing more than before and costs one library call. */
static PyObject *open_common(PyTypeObject *defining_class,
                             PyObject *const *args, Py_ssize_t nargs,
                             PyObject *kwnames, int sycl) {
  /* ordered first among the keywords: open(raw, ordered=False) is the
   * re-open loop of callers that order their work themselves. */
  static const char *const names[] = {"handle_bytes", "device", "nbytes",
                                      "ordered",      "stream", "handle"};
  static const char *const sycl_names[] = {"handle_bytes", "device", "nbytes",
                                           "handle"};
  const char *funcname = sycl ? "open_sycl" : "open";
  PyObject *a[6] = {NULL, NULL, NULL, NULL, NULL, NULL};
  pyusmipc_module_state_t *st = PyType_GetModuleState(defining_class);
  if (kwnames == NULL && nargs >= 1 && nargs <= 3) {
    a[0] = args[0];
    a[1] = nargs > 1 ? args[1] : NULL;
    a[2] = nargs > 2 ? args[2] : NULL;
  } else if (sycl) {
    if (pyusmipc_parse_fastcall(funcname, args, nargs, kwnames, sycl_names, 4,
                                3, a) < 0) {
      return NULL;
    }
    a[5] = a[3];
    a[3] = NULL;
  } else if (pyusmipc_parse_fastcall(funcname, args, nargs, kwnames, names, 6,
                                     3, a) < 0) {
    return NULL;
  }
  if (a[5] != NULL) {
    if (a[0] != NULL) {
      pyusmipc_type_error(
          "%s() got handle_bytes and its old name handle; give one", funcname);
      return NULL;
    }
    a[0] = a[5];
  }
  if (a[0] == NULL) {
    pyusmipc_type_error("%s() missing required argument 'handle_bytes'",
                        funcname);
    return NULL;
  }
  PyObject *stream = a[4] == Py_None ? NULL : a[4];
  unsigned flags = 0;
  if (a[3] != NULL) {
    int ordered = a[3] == Py_False ? 0 : PyObject_IsTrue(a[3]);
    if (ordered < 0) {
      return NULL;
    }
    if (!ordered) {
      flags = USMIPC_OPEN_UNORDERED;
    }
  }

  size_t nbytes = 0;
  if (a[2] != NULL && a[2] != Py_None) {
    Py_ssize_t n = PyLong_AsSsize_t(a[2]);
    if (n == -1 && PyErr_Occurred()) {
      pyusmipc_retype_parse_error(); /* a wrong type: ArgumentTypeError */
      return NULL;
    }
    if (n <= 0) {
      pyusmipc_value_error(
          "nbytes must be positive or None (the exported size), "
          "not %zd",
          n);
      return NULL;
    }
    nbytes = (size_t)n;
  }

  PyObject *device_obj; /* strong, or NULL */
  usmipc_device_t *device;
  if (pyusmipc_optional_device_arg(st, a[1], &device_obj, &device) < 0) {
    return NULL;
  }

  pyusmipc_handle_bytes_t hb;
  if (handle_bytes(st, a[0], &hb, 1) < 0) {
    Py_XDECREF(device_obj);
    return NULL;
  }
  const char *data = hb.data;
  Py_ssize_t len = hb.len;

  /* The consumer's stream: its work waits for the producer's on the
   * device. An int or a stream that does not name its GPU is taken on the
   * target device, else on the device the handle names. */
  PyObject *queue_obj = NULL;
  usmipc_queue_t *queue = NULL;
  if (stream != NULL) {
    PyObject *fallback = device_obj ? Py_NewRef(device_obj) : NULL;
    if (fallback == NULL && !PyObject_TypeCheck(stream, st->QueueType)) {
      usmipc_ipc_handle_info_t info;
      int rc = usmipc_ipc_handle_inspect(data, (size_t)len, &info);
      if (rc < 0) {
        pyusmipc_raise_open_error(st, rc, NULL, 0, 0, EVENT_BYTES_TO_OPEN);
      } else {
        fallback = pyusmipc_device_of_info(st, &info);
        if (fallback == Py_None) {
          Py_CLEAR(fallback);
        }
      }
    }
    if (!PyErr_Occurred()) {
      queue_obj = pyusmipc_queue_from_stream(st, stream, NULL, fallback,
                                             "IPCMemoryHandle.open()");
    }
    Py_XDECREF(fallback);
    if (queue_obj == NULL) {
      goto fail_args;
    }
    queue = ((pyusmipc_queue_object_t *)queue_obj)->queue;
  }

  void *ptr = NULL;
  size_t mapped = 0;
  int rc;
  int query_failed = 0;
  char query_message[256];
  Py_BEGIN_ALLOW_THREADS
  rc = sycl ? usmipc_ipc_open_sycl(data, (size_t)len, device, nbytes, &ptr,
                                   &mapped)
            : usmipc_ipc_open_ex(data, (size_t)len, device, nbytes, queue,
                                 flags, &ptr, &mapped);
  if (rc == 0 && device == NULL && queue != NULL) {
    device = usmipc_queue_device(queue);
  } else if (rc == 0 && device == NULL) {
    usmipc_pointer_info_t info;
    int qrc = usmipc_pointer_query(ptr, &info);
    if (qrc == 0) {
      device = info.device;
    } else {
      snprintf(query_message, sizeof(query_message),
               "opened the handle but could not tell its device: %s",
               usmipc_last_error());
      (void)usmipc_ipc_close(ptr);
      rc = qrc;
      query_failed = 1;
    }
  }
  Py_END_ALLOW_THREADS
  /* The open may wait on the exporting process, or (ordered) for the
   * producer's work; the interrupt hook (module.c) runs signal handlers
   * meanwhile. If one raised (Ctrl-C), the core gave up with USMIPC_EINTR
   * and that exception, KeyboardInterrupt, is pending on this thread:
   * propagate it rather than a usmipc.Error. */
  if (rc == USMIPC_EINTR && PyErr_Occurred()) {
    goto fail_args;
  }
  if (rc == 0 && PyErr_Occurred()) {
    /* A handler raised but the open completed anyway: the exception wins,
     * and the mapping must not leak. */
    goto fail;
  }
  if (rc < 0) {
    if (query_failed) {
      pyusmipc_raise_msg(st, rc, query_message);
    } else if (sycl) {
      pyusmipc_raise(st, rc);
    } else {
      pyusmipc_raise_open_error(st, rc, data, len, 0, EVENT_BYTES_TO_OPEN);
    }
    goto fail_args;
  }
  if (device_obj == NULL) {
    device_obj = pyusmipc_device_object(st, device);
    if (device_obj == NULL) {
      goto fail;
    }
  }
  PyObject *mem = pyusmipc_mapping_new(st, device_obj, ptr, mapped);
  if (mem == NULL) {
    goto fail;
  }
  /* Waited on the device: keep the bytes, so that __dlpack__(stream=...)
   * can make another stream wait for the producer too (the host has no
   * streams: nothing to keep there). */
  if (queue != NULL && flags == 0 &&
      usmipc_device_backend(device) != USMIPC_BACKEND_HOST) {
    PyObject *bytes = pyusmipc_handle_bytes_object(&hb);
    if (bytes == NULL) {
      Py_DECREF(mem); /* closes the mapping */
      ptr = NULL;
      goto fail_args;
    }
    ((pyusmipc_memory_object_t *)mem)->order_handle = bytes;
  }
  if (!sycl && carries_release_ticket(data, len)) {
    PyObject *bytes = pyusmipc_handle_bytes_object(&hb);
    if (bytes == NULL || !PyBytes_Check(bytes)) {
      Py_XDECREF(bytes);
      Py_DECREF(mem);
      ptr = NULL;
      if (!PyErr_Occurred()) {
        pyusmipc_type_error("handle bytes are not bytes");
      }
      goto fail_args;
    }
    ((pyusmipc_memory_object_t *)mem)->release_handle = bytes;
    pyusmipc_mapping_ticket_list((pyusmipc_memory_object_t *)mem);
  }
  pyusmipc_handle_bytes_release(&hb);
  Py_XDECREF(queue_obj);
  Py_DECREF(device_obj);
  return mem;

fail:
  Py_BEGIN_ALLOW_THREADS
  usmipc_ipc_close(ptr);
  Py_END_ALLOW_THREADS
fail_args:
  pyusmipc_handle_bytes_release(&hb);
  Py_XDECREF(queue_obj);
  Py_XDECREF(device_obj);
  return NULL;
}

/* close_mapping(memory, stream=None) and release(memory, stream=None):
 * both return the mapping's release ticket (if the producer asked for one
 * and it was not returned yet) after the work submitted to stream (None:
 * now); close_mapping then closes the mapping. */
static PyObject *mapping_release_or_close(PyTypeObject *defining_class,
                                          PyObject *const *args,
                                          Py_ssize_t nargs, PyObject *kwnames,
                                          int close) {
  static const char *const names[] = {"memory", "stream"};
  const char *funcname = close ? "close_mapping" : "release";
  PyObject *a[2] = {NULL, NULL};
  pyusmipc_module_state_t *st = PyType_GetModuleState(defining_class);
  if (kwnames == NULL && nargs == 1) {
    a[0] = args[0];
  } else if (pyusmipc_parse_fastcall(funcname, args, nargs, kwnames, names, 2,
                                     1, a) < 0) {
    return NULL;
  }
  if (a[0] == NULL) {
    pyusmipc_type_error("%s() missing required argument 'memory'", funcname);
    return NULL;
  }
  PyObject *mem = a[0];
  if (!PyObject_TypeCheck(mem, st->MemoryIPCDeviceType)) {
    /* dpctl raises RuntimeError for memory that is no mapping. */
    if (!PyObject_TypeCheck(mem, st->MemoryType)) {
      return pyusmipc_type_error("%s() takes a MemoryIPCDevice returned by "
                                 "IPCMemoryHandle.open(), not a %R",
                                 funcname, (PyObject *)Py_TYPE(mem));
    }
    return pyusmipc_raise_format(
        st, USMIPC_ENOTMAPPED,
        "%s() takes a MemoryIPCDevice returned by IPCMemoryHandle.open(), "
        "not non-IPC memory %R (memory allocated here is freed by dropping "
        "it)",
        funcname, (PyObject *)Py_TYPE(mem));
  }
  pyusmipc_memory_object_t *m = (pyusmipc_memory_object_t *)mem;
  if (a[1] != NULL && a[1] != Py_None && m->release_handle != NULL) {
    PyObject *queue_obj =
        pyusmipc_queue_from_stream(st, a[1], NULL, m->device,
                                   close ? "IPCMemoryHandle.close_mapping()"
                                         : "IPCMemoryHandle.release()");
    if (queue_obj == NULL) {
      return NULL;
    }
    int rc = pyusmipc_mapping_release(
        st, m, ((pyusmipc_queue_object_t *)queue_obj)->queue);
    Py_DECREF(queue_obj);
    if (rc < 0) {
      return NULL;
    }
  } else if (!close && pyusmipc_mapping_release(st, m, NULL) < 0) {
    return NULL;
  }
  if (close && pyusmipc_mapping_close(st, m) < 0) {
    return NULL;
  }
  Py_RETURN_NONE;
}

static PyObject *handle_is_available(PyObject *cls,
                                     PyTypeObject *defining_class,
                                     PyObject *const *args, Py_ssize_t nargs,
                                     PyObject *kwnames) {
  (void)cls;
  (void)args;
  pyusmipc_module_state_t *st = PyType_GetModuleState(defining_class);
  if (nargs != 0 || (kwnames != NULL && PyTuple_Size(kwnames) != 0)) {
    pyusmipc_type_error("is_available() takes no arguments");
    return NULL;
  }
  usmipc_device_t *devices[PYUSMIPC_MAX_DEVICES];
  size_t count;
  if (pyusmipc_list_devices(st, devices, &count) < 0) {
    return NULL;
  }
  for (size_t i = 0; i < count; i++) {
    if (usmipc_device_has_ipc(devices[i])) {
      Py_RETURN_TRUE;
    }
  }
  Py_RETURN_FALSE;
}

PyObject *pyusmipc_set_ipc_cache_size(pyusmipc_module_state_t *st,
                                      PyObject *arg) {
  Py_ssize_t entries = PyLong_AsSsize_t(arg);
  if (entries == -1 && PyErr_Occurred()) {
    pyusmipc_retype_parse_error(); /* a wrong type: ArgumentTypeError */
    return NULL;
  }
  if (entries < 0) {
    pyusmipc_value_error("entries must be >= 0");
    return NULL;
  }
  int rc = usmipc_ipc_set_cache_size((size_t)entries);
  if (rc < 0) {
    return pyusmipc_raise(st, rc);
  }
  Py_RETURN_NONE;
}

static PyObject *handle_set_cache_size(PyObject *cls,
                                       PyTypeObject *defining_class,
                                       PyObject *const *args, Py_ssize_t nargs,
                                       PyObject *kwnames) {
  (void)cls;
  PyObject *arg;
  pyusmipc_module_state_t *st = PyType_GetModuleState(defining_class);
  if (pyusmipc_parse_one_arg("set_cache_size", "entries", args, nargs, kwnames,
                             &arg) < 0) {
    return NULL;
  }
  return pyusmipc_set_ipc_cache_size(st, arg);
}

static PyObject *handle_inspect(PyObject *cls, PyTypeObject *defining_class,
                                PyObject *const *args, Py_ssize_t nargs,
                                PyObject *kwnames) {
  (void)cls;
  PyObject *raw;
  pyusmipc_module_state_t *st = PyType_GetModuleState(defining_class);
  if (pyusmipc_parse_one_arg("inspect", "handle", args, nargs, kwnames, &raw) <
      0) {
    return NULL;
  }
  pyusmipc_handle_bytes_t hb;
  if (st->IPCEventHandleType != NULL &&
      Py_IS_TYPE(raw, st->IPCEventHandleType)) {
    /* Any handle's bytes can be inspected: take the event handle's. */
    PyObject *bytes = PyObject_CallMethod(raw, "to_bytes", NULL);
    if (bytes == NULL || pyusmipc_handle_bytes_of(raw, bytes, &hb) < 0) {
      return NULL;
    }
  } else if (handle_bytes(st, raw, &hb, 0) < 0) {
    return NULL;
  }
  Py_ssize_t len = hb.len;
  usmipc_ipc_handle_info_t info;
  int rc = usmipc_ipc_handle_inspect(hb.data, (size_t)len, &info);
  pyusmipc_handle_bytes_release(&hb);
  if (rc < 0) {
    return pyusmipc_raise(st, rc);
  }
  return pyusmipc_handle_info_dict(&info, len);
}

/* ---- instance methods and getters ---------------------------------------- */

static PyObject *handle_to_bytes(PyObject *self, PyObject *Py_UNUSED(ignored)) {
  return handle_current_bytes((Handle *)self);
}

static PyObject *handle_reduce(PyObject *self, PyObject *Py_UNUSED(ignored)) {
  PyObject *from_bytes =
      PyObject_GetAttrString((PyObject *)Py_TYPE(self), "from_bytes");
  if (from_bytes == NULL) {
    return NULL;
  }
  PyObject *bytes = handle_current_bytes((Handle *)self);
  if (bytes == NULL) {
    Py_DECREF(from_bytes);
    return NULL;
  }
  return Py_BuildValue("(N(N))", from_bytes, bytes);
}

static PyObject *handle_get_ordered(PyObject *op, void *closure) {
  (void)closure;
  Handle *self = (Handle *)op;
  return PyBool_FromLong(self->handle != NULL ? self->order_queue != NULL
                                              : self->info.is_ordered);
}

static PyObject *handle_get_releases(PyObject *op, void *closure) {
  (void)closure;
  Handle *self = (Handle *)op;
  uint64_t sent = 0, back = 0;
  if (self->handle != NULL) {
    int rc = usmipc_ipc_handle_releases(self->handle, &sent, &back);
    if (rc < 0) {
      return pyusmipc_raise(handle_state(op), rc);
    }
  }
  return Py_BuildValue("(KK)", (unsigned long long)sent,
                       (unsigned long long)back);
}

static PyObject *handle_get_release_key(PyObject *op, void *closure) {
  (void)closure;
  Handle *self = (Handle *)op;
  return PyLong_FromUnsignedLongLong(
      self->handle != NULL ? usmipc_ipc_handle_release_key(self->handle) : 0);
}

/* wait_released(stream=None): every release ticket handed out so far came
 * back; then stream waits for the consumers' work on the device, or the
 * host waits. */
static PyObject *handle_wait_released(PyObject *op, PyObject *const *args,
                                      Py_ssize_t nargs, PyObject *kwnames) {
  static const char *const names[] = {"stream"};
  PyObject *stream = NULL;
  Handle *self = (Handle *)op;
  pyusmipc_module_state_t *st = handle_state(op);
  if (pyusmipc_parse_fastcall("wait_released", args, nargs, kwnames, names, 1,
                              0, &stream) < 0) {
    return NULL;
  }
  if (self->closed) {
    return handle_closed_error();
  }
  if (self->handle == NULL) {
    pyusmipc_value_error(
        "wait_released(): this handle was made from bytes; only "
        "the exporter's own handle hands out release tickets");
    return NULL;
  }
  PyObject *queue_obj = NULL;
  usmipc_queue_t *queue = NULL;
  if (stream != NULL && stream != Py_None) {
    PyObject *device = pyusmipc_device_of_info(st, &self->info);
    if (device == NULL) {
      return NULL;
    }
    queue_obj = pyusmipc_queue_from_stream(st, stream, NULL,
                                           device == Py_None ? NULL : device,
                                           "IPCMemoryHandle.wait_released()");
    Py_DECREF(device);
    if (queue_obj == NULL) {
      return NULL;
    }
    queue = ((pyusmipc_queue_object_t *)queue_obj)->queue;
  }
  usmipc_ipc_handle_t *handle = self->handle;
  int rc;
  Py_BEGIN_ALLOW_THREADS
  rc = usmipc_ipc_handle_wait_released(handle, queue);
  Py_END_ALLOW_THREADS
  Py_XDECREF(queue_obj);
  if (rc == USMIPC_EINTR && PyErr_Occurred()) {
    return NULL; /* KeyboardInterrupt from the interrupt hook */
  }
  if (rc < 0) {
    return pyusmipc_raise(st, rc);
  }
  Py_RETURN_NONE;
}

static PyObject *handle_get_queue(PyObject *op, void *closure) {
  (void)closure;
  PyObject *queue = ((Handle *)op)->order_queue;
  return Py_NewRef(queue ? queue : Py_None);
}

static PyObject *handle_get_memory(PyObject *self, void *closure) {
  (void)closure;
  PyObject *memory = ((Handle *)self)->memory;
  return Py_NewRef(memory ? memory : Py_None);
}

/* The device the handle names, if this process has it; else None. */
static PyObject *handle_get_device(PyObject *op, void *closure) {
  (void)closure;
  Handle *self = (Handle *)op;
  pyusmipc_module_state_t *st = handle_state(op);
  if (self->memory != NULL && st->MemoryType != NULL &&
      PyObject_TypeCheck(self->memory, st->MemoryType)) {
    PyObject *device = ((pyusmipc_memory_object_t *)self->memory)->device;
    if (device != NULL) {
      return Py_NewRef(device);
    }
  }
  return pyusmipc_device_of_info(st, &self->info);
}

static PyObject *handle_repr(PyObject *op) {
  Handle *self = (Handle *)op;
  char text[160];
  snprintf(text, sizeof(text),
           "%llu bytes at offset %llu of a %s allocation, exported by pid "
           "%u",
           (unsigned long long)self->info.nbytes,
           (unsigned long long)self->info.offset,
           usmipc_backend_name(self->info.backend),
           (unsigned)self->info.exporter_pid);
  int ordered =
      self->handle != NULL ? self->order_queue != NULL : self->info.is_ordered;
  Py_ssize_t len = self->data ? PyBytes_Size(self->data) : 0;
  if (!ordered || self->handle == NULL)
    return PyUnicode_FromFormat("<usmipc.memory.IPCMemoryHandle: %s; "
                                "%zd-byte handle%s>",
                                text, len, ordered ? ", ordered" : "");
  /* An exporter's ordered handle: each to_bytes() appends the record of
   * the event it records (docs/handle-format.md), so its bytes are longer
   * than the handle itself. */
  const char *backend = usmipc_backend_name(self->info.backend);
  int record = strcmp(backend, "cuda") == 0         ? 136
               : strcmp(backend, "level_zero") == 0 ? 104
                                                    : 72;
  return PyUnicode_FromFormat("<usmipc.memory.IPCMemoryHandle: %s; %zd-byte "
                              "handle, ordered: to_bytes() gives %zd bytes "
                              "with its event record>",
                              text, len, len + record);
}

/* Handles are equal when they name the same exported range of the same
 * export: the ordering record differs at every handoff and is ignored, so
 * that a pickled handle equals the one it came from. */
static int same_export(const usmipc_ipc_handle_info_t *a,
                       const usmipc_ipc_handle_info_t *b) {
  return a->backend == b->backend &&
         memcmp(a->device_uuid, b->device_uuid, 16) == 0 &&
         a->exporter_pid == b->exporter_pid &&
         a->exporter_nonce == b->exporter_nonce &&
         a->exporter_uid == b->exporter_uid && a->buffer_id == b->buffer_id &&
         a->allocation_size == b->allocation_size && a->offset == b->offset &&
         a->nbytes == b->nbytes && a->handle_kind == b->handle_kind;
}

static PyObject *handle_richcompare(PyObject *self, PyObject *other, int op) {
  if ((op != Py_EQ && op != Py_NE) || !Py_IS_TYPE(other, Py_TYPE(self))) {
    Py_RETURN_NOTIMPLEMENTED;
  }
  int equal = same_export(&((Handle *)self)->info, &((Handle *)other)->info);
  return PyBool_FromLong(op == Py_EQ ? equal : !equal);
}

static Py_hash_t handle_hash(PyObject *self) {
  const usmipc_ipc_handle_info_t *info = &((Handle *)self)->info;
  PyObject *key = Py_BuildValue(
      "(KKKK)", (unsigned long long)info->exporter_nonce,
      (unsigned long long)info->buffer_id, (unsigned long long)info->offset,
      (unsigned long long)info->nbytes);
  if (key == NULL) {
    return -1;
  }
  Py_hash_t h = PyObject_Hash(key);
  Py_DECREF(key);
  return h;
}

PYUSMIPC_CLASSMETHOD_WHICH(handle_open_cls, open_common, IPCMemoryHandleType, 0)
PYUSMIPC_CLASSMETHOD_WHICH(handle_open_sycl_cls, open_common,
                           IPCMemoryHandleType, 1)
PYUSMIPC_CLASSMETHOD_WHICH(handle_close_mapping_cls, mapping_release_or_close,
                           IPCMemoryHandleType, 1)
PYUSMIPC_CLASSMETHOD_WHICH(handle_release_cls, mapping_release_or_close,
                           IPCMemoryHandleType, 0)
PYUSMIPC_CLASSMETHOD(handle_is_available_cls, handle_is_available,
                     IPCMemoryHandleType)
PYUSMIPC_CLASSMETHOD(handle_inspect_cls, handle_inspect, IPCMemoryHandleType)
PYUSMIPC_CLASSMETHOD(handle_set_cache_size_cls, handle_set_cache_size,
                     IPCMemoryHandleType)
PYUSMIPC_CLASSMETHOD(handle_from_bytes_cls, handle_from_bytes,
                     IPCMemoryHandleType)

/* close(): the handle gives no more bytes and lets go of its memory. The
 * export of usmipc's own memory belongs to the allocation: bytes already
 * sent stay valid while it lives. The export of another library's memory
 * belongs to its handles: the last one closed refuses the bytes. */
static PyObject *handle_close(PyObject *op, PyObject *Py_UNUSED(ignored)) {
  Handle *self = (Handle *)op;
  if (self->closed) {
    Py_RETURN_NONE;
  }
  self->closed = 1;
  usmipc_ipc_handle_t *handle;
  if (self->lock_ready) {
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&self->order_lock);
    handle = self->handle;
    self->handle = NULL;
    pthread_mutex_unlock(&self->order_lock);
    Py_END_ALLOW_THREADS
  } else {
    handle = self->handle;
    self->handle = NULL;
  }
  if (handle != NULL) {
    Py_BEGIN_ALLOW_THREADS
    usmipc_ipc_free_handle(handle);
    Py_END_ALLOW_THREADS
  }
  Py_CLEAR(self->tensor); /* after the export: see handle_dealloc */
  Py_CLEAR(self->memory);
  Py_CLEAR(self->last);
  Py_RETURN_NONE;
}

static PyMethodDef handle_methods[] = {
    {"close", handle_close, METH_NOARGS,
     "close()\n--\n\nEnds this handle: to_bytes() (and pickling) raise "
     "RuntimeError afterwards, and the handle no longer keeps its memory "
     "alive. Bytes already sent stay valid for usmipc's own memory while it "
     "lives (the export belongs to the allocation); for another library's "
     "array, the last handle closed ends the export, and its bytes are "
     "refused. Idempotent."},
    {"open", PYUSMIPC_CMETHOD(handle_open_cls), PYUSMIPC_CLASS_FLAGS,
     "open($cls, /, handle_bytes, device=None, nbytes=None, *, stream=None, "
     "ordered=True)\n--\n\n"
     "Returns a MemoryIPCDevice. "
     "Maps handle bytes (or an IPCMemoryHandle) on device (None: the device "
     "the\nhandle names, or stream's). nbytes=None maps the exported size; "
     "more is\nrefused with ValueError. Opening the same allocation again "
     "is cheap\n(mappings are shared and cached). handle= is the old name "
     "of handle_bytes.\n\n"
     "When the bytes are ordered (the exporter's default), the producer's "
     "work\nbefore the handoff is waited for: with stream (a usmipc.Queue, "
     "a torch or\nCuPy stream, an object with __cuda_stream__, an int "
     "CUstream) later work\non that stream waits on the device, and "
     "__dlpack__(stream=...) of the\nmapping makes the consumer's stream "
     "wait too; without, the host waits\n(set_event_timeout(), Ctrl-C). "
     "ordered=False skips the wait, for callers\nthat order the work "
     "themselves. Event handle bytes raise ValueError."},
    {"open_sycl", PYUSMIPC_CMETHOD(handle_open_sycl_cls), PYUSMIPC_CLASS_FLAGS,
     "open_sycl($cls, /, handle_bytes, device=None, nbytes=None)\n--\n\n"
     "Returns a MemoryIPCDevice mapping memory that a SYCL program "
     "exported:\nthe bytes of dpctl's IPCMemoryHandle.to_bytes() (a UMF "
     "blob of 108 or\n120 bytes over a Level Zero handle), never usmipc "
     "handle bytes. device:\na level_zero device (None: level_zero:gpu:0). "
     "nbytes=None maps from the\nexported pointer to the end of its "
     "allocation. Weaker than open(): the\nblob does not prove who exported "
     "it, and a freed allocation is not\ndetected (docs/level-zero.md). "
     "Each call maps anew; close with\nclose_mapping()."},
    {"close_mapping", PYUSMIPC_CMETHOD(handle_close_mapping_cls),
     PYUSMIPC_CLASS_FLAGS,
     "close_mapping($cls, /, memory, stream=None)\n--\n\nCloses a mapping "
     "returned by open(); idempotent. While memoryviews of it are\nalive the "
     "unmap waits for the last one. If the producer asked for a\nrelease "
     "(IPCMemoryHandle(..., release=True)), its ticket is returned first,\n"
     "after the work submitted to stream (None: now)."},
    {"release", PYUSMIPC_CMETHOD(handle_release_cls), PYUSMIPC_CLASS_FLAGS,
     "release($cls, /, memory, stream=None)\n--\n\nTells the producer "
     "that this consumer is done with the mapping, after the\nwork "
     "submitted to stream (None: now), without closing it. Does nothing\n"
     "when the producer asked for no release or was told already."},
    {"wait_released", PYUSMIPC_CMETHOD(handle_wait_released),
     METH_FASTCALL | METH_KEYWORDS,
     "wait_released($self, /, stream=None)\n--\n\nWaits until every "
     "release ticket handed out so far came back (the\nevent timeout "
     "applies), then makes stream wait on the device for the\nconsumers' "
     "work, or (stream None) waits on the host."},
    {"is_available", PYUSMIPC_CMETHOD(handle_is_available_cls),
     PYUSMIPC_CLASS_FLAGS,
     "is_available($cls, /)\n--\n\nTrue if any available device supports IPC."},
    {"inspect", PYUSMIPC_CMETHOD(handle_inspect_cls), PYUSMIPC_CLASS_FLAGS,
     "inspect($cls, /, handle)\n--\n\nValidates handle bytes without opening "
     "them "
     "and returns their metadata\n(backend, device_uuid, exporter_pid, "
     "buffer_id, allocation_size, offset,\nnbytes, handle_kind, length, "
     "is_event, is_ordered, event_point). Takes\nmemory and event handle "
     "bytes; for an IPCMemoryHandle object, the bytes\nit last gave out."},
    {"set_cache_size", PYUSMIPC_CMETHOD(handle_set_cache_size_cls),
     PYUSMIPC_CLASS_FLAGS,
     "set_cache_size($cls, /, entries)\n--\n\n"
     "At most how many closed mappings this process keeps for cheap\n"
     "re-opens (default: every one whose allocation is still exported;\n"
     "or USMIPC_IPC_CACHE_SIZE); 0 unmaps on the last close.\n"
     "The same as usmipc.set_ipc_cache_size()."},
    {"from_bytes", PYUSMIPC_CMETHOD(handle_from_bytes_cls),
     PYUSMIPC_CLASS_FLAGS,
     "from_bytes($cls, /, data)\n--\n\nAn IPCMemoryHandle carrying only the "
     "given bytes (validated), as after unpickling: its to_bytes() returns "
     "them\nas they are."},
    {"to_bytes", handle_to_bytes, METH_NOARGS,
     "to_bytes() -> bytes: the serialized handle, for any channel. An "
     "ordered\nhandle records a fresh event on its queue at every call (and "
     "every\npickling), naming the work submitted so far; where the queue "
     "is idle\na completed record serves and the bytes may repeat."},
    {"__bytes__", handle_to_bytes, METH_NOARGS, NULL},
    {"__reduce__", handle_reduce, METH_NOARGS, NULL},
    {NULL, NULL, 0, NULL},
};

/* The handle's decoded fields, read-only. */
static PyMemberDef handle_members[] = {
    {"nbytes", T_ULONGLONG, offsetof(Handle, info.nbytes), READONLY,
     "Exported size in bytes."},
    {"offset", T_ULONGLONG, offsetof(Handle, info.offset), READONLY,
     "Offset of the exported range in its allocation."},
    {"allocation_size", T_ULONGLONG, offsetof(Handle, info.allocation_size),
     READONLY, "Size of the whole exported allocation."},
    {"buffer_id", T_ULONGLONG, offsetof(Handle, info.buffer_id), READONLY,
     "The exporter's unique id of the allocation."},
    {"exporter_pid", T_UINT, offsetof(Handle, info.exporter_pid), READONLY,
     "Process id of the exporter."},
    {NULL, 0, 0, 0, NULL},
};

static PyGetSetDef handle_getset[] = {
    {"backend", pyusmipc_info_get_backend, NULL, "The backend's name.",
     PYUSMIPC_INFO_OF(Handle)},
    {"device_uuid", pyusmipc_info_get_device_uuid, NULL,
     "UUID of the exporting device.", PYUSMIPC_INFO_OF(Handle)},
    {"device", handle_get_device, NULL,
     "The exporting Device, or None if this process does not see it.", NULL},
    {"memory", handle_get_memory, NULL,
     "The exported memory object (None for a handle made from bytes).", NULL},
    {"releases", handle_get_releases, NULL,
     "(sent, returned): release tickets handed out (one per handoff of a "
     "handle made\nwith release=True) and returned by consumers so far.",
     NULL},
    {"_release_key", handle_get_release_key, NULL,
     "The key usmipc._releases_wait() names this handle by (0 before its "
     "first\nticket).",
     NULL},
    {"ordered", handle_get_ordered, NULL,
     "True if the handle's bytes make importers wait for the producer's "
     "work.",
     NULL},
    {"queue", handle_get_queue, NULL,
     "The usmipc.Queue each handoff of an ordered handle is recorded on "
     "(None\nfor an unordered handle or one made from bytes).",
     NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

PyDoc_STRVAR(
    handle_doc,
    "IPCMemoryHandle(memory, offset=0, nbytes=None, *, stream=None, "
    "ordered=True,\nrelease=False)\n--\n\n"
    "Exports device memory allocated by usmipc (MemoryUSMDevice), or "
    "another\nlibrary's C-contiguous CUDA array with "
    "__cuda_array_interface__ or\n__dlpack__ (torch, CuPy, JAX), for "
    "other processes: send to_bytes() (or\npickle the handle) by any "
    "channel and call IPCMemoryHandle.open() there.\nThe handle keeps "
    "the memory alive (a DLPack tensor's deleter runs when the\n"
    "handle dies). Raises TypeError for other memory kinds and objects, "
    "ValueError\nfor strided arrays, usmipc.Error if the device does "
    "not support IPC.\n\n"
    "Ordering (correct by default): every to_bytes() and every "
    "pickling records\na fresh event on the producer's queue (none if "
    "idle), carried in the bytes, and\nIPCMemoryHandle.open() waits for it "
    "(on the importer's stream, or on the\nhost), so the importer "
    "never reads before the work submitted before the\nhandoff is "
    "done. The queue: stream (a usmipc.Queue, a torch or CuPy\n"
    "stream, an object with __cuda_stream__, an int CUstream) if "
    "given; else\nthe memory's own queue (usmipc memory), "
    "torch.cuda.current_stream() of a\ntorch tensor's device, "
    "cupy.cuda.get_current_stream() for a CuPy array,\nthe legacy "
    "default stream for other CUDA arrays; taken at construction.\n"
    "ordered=False makes plain handles (the same bytes at every "
    "call, no\nevent). Every backend has events (on the host a record "
    "is complete at once).\n\n"
    "release=True: every handoff also carries a release ticket, which the\n"
    "consumer returns when it closes the mapping (or with release()); "
    "the\nproducer's wait_released() waits for all of them, and then "
    "for the\nconsumers' work; releases says how many are out.\n\n"
    "Security: the bytes are a capability for the whole allocation, "
    "not only\nfor [offset, offset + nbytes): a holder can edit "
    "those fields and open\nall of it. Share separate allocations "
    "with consumers that must not see\neach other's data. Only "
    "processes of the exporter's user can open the\nhandle. Another "
    "library's tensor stays exported while a handle of it\nlives: "
    "once the last one dies, its bytes are refused everywhere\n"
    "(docs/security.md).");

static PyType_Slot handle_slots[] = {
    {Py_tp_doc, (void *)handle_doc},
    {Py_tp_new, handle_new},
    {Py_tp_dealloc, handle_dealloc},
    {Py_tp_traverse, handle_traverse},
    {Py_tp_clear, handle_clear},
    {Py_tp_repr, handle_repr},
    {Py_tp_richcompare, handle_richcompare},
    {Py_tp_hash, handle_hash},
    {Py_tp_methods, handle_methods},
    {Py_tp_members, handle_members},
    {Py_tp_getset, handle_getset},
    {0, NULL},
};

static PyType_Spec handle_spec = {
    .name = "usmipc.memory.IPCMemoryHandle",
    .basicsize = sizeof(Handle),
    .itemsize = 0,
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = handle_slots,
};

int pyusmipc_init_ipc_handle_type(PyObject *module,
                                  pyusmipc_module_state_t *st) {
  st->IPCMemoryHandleType =
      (PyTypeObject *)PyType_FromModuleAndSpec(module, &handle_spec, NULL);
  if (st->IPCMemoryHandleType == NULL) {
    return -1;
  }
  return PyModule_AddType(module, st->IPCMemoryHandleType);
}
