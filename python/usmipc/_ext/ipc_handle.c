/* usmipc.memory.IPCMemoryHandle: the exporter's side (IPCMemoryHandle(mem),
 * to_bytes(), pickling) and the importer's (open, close_mapping).
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
#include "ext.h"

#include <stddef.h>
#include <structmember.h>

#include <stdio.h>
#include <string.h>

typedef struct handle_object {
  PyObject_HEAD PyObject *memory; /* the exported memory object, or NULL */
  PyObject *tensor; /* capsule owning a consumed DLPack tensor, or NULL */
  PyObject *data;   /* bytes: the serialized handle */
  usmipc_ipc_handle_t *handle; /* the library's handle, or NULL */
  usmipc_ipc_handle_info_t info;
} Handle;

static usmipc_module_state_t *handle_state(PyObject *self) {
  /* The type is final and made by this module. */
  return (usmipc_module_state_t *)PyType_GetModuleState(Py_TYPE(self));
}

/* ---- construction -------------------------------------------------------- */

/* The exported range [offset, offset + nbytes) of a region of size bytes:
 * nbytes_obj None means to the end. Returns 0 or -1 (ValueError). */
static int export_range(Py_ssize_t size, Py_ssize_t offset,
                        PyObject *nbytes_obj, Py_ssize_t *nbytes) {
  if (offset < 0 || offset >= size) {
    PyErr_Format(PyExc_ValueError, "offset %zd is outside the %zd bytes",
                 offset, size);
    return -1;
  }
  *nbytes = size - offset;
  if (nbytes_obj != Py_None) {
    Py_ssize_t n = PyLong_AsSsize_t(nbytes_obj);
    if (n == -1 && PyErr_Occurred()) {
      return -1;
    }
    if (n <= 0 || n > size - offset) {
      PyErr_Format(PyExc_ValueError,
                   "nbytes must be in 1..%zd for offset %zd, not %zd",
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
static PyObject *export_memory(PyTypeObject *type, usmipc_module_state_t *st,
                               PyObject *owner, PyObject *tensor,
                               usmipc_memory_object_t *mem, const char *ptr,
                               Py_ssize_t nbytes) {
  allocfunc alloc = (allocfunc)PyType_GetSlot(type, Py_tp_alloc);
  Handle *self = (Handle *)alloc(type, 0);
  if (self == NULL) {
    return NULL;
  }
  self->tensor = Py_XNewRef(tensor);
  if (mem != NULL && usmipc_memory_begin(mem) < 0) {
    Py_DECREF(self);
    return NULL;
  }
  usmipc_ipc_handle_t *handle = NULL;
  const void *data = NULL;
  size_t len = 0;
  int rc;
  Py_BEGIN_ALLOW_THREADS
  rc = usmipc_ipc_get_handle(ptr, (size_t)nbytes, &handle);
  if (rc == 0) {
    rc = usmipc_ipc_handle_data(handle, &data, &len);
  }
  if (rc == 0) {
    rc = usmipc_ipc_handle_inspect(data, len, &self->info);
  }
  Py_END_ALLOW_THREADS
  self->handle = handle; /* freed by dealloc, even after a failure */
  if (rc < 0) {
    usmipc_raise(st, rc);
    if (mem != NULL) {
      (void)usmipc_memory_end(mem);
    }
    Py_DECREF(self);
    return NULL;
  }
  if (mem != NULL && usmipc_memory_end(mem) < 0) {
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

static PyObject *handle_new(PyTypeObject *type, PyObject *args,
                            PyObject *kwds) {
  static char *kwlist[] = {"memory", "offset", "nbytes", NULL};
  PyObject *mem_obj;
  Py_ssize_t offset = 0;
  PyObject *nbytes_obj = Py_None;
  Py_ssize_t nbytes;
  if (!PyArg_ParseTupleAndKeywords(args, kwds, "O|$nO:IPCMemoryHandle", kwlist,
                                   &mem_obj, &offset, &nbytes_obj)) {
    return NULL;
  }
  usmipc_module_state_t *st = usmipc_state_from_type(type);
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
    int found = usmipc_cuda_array_range(mem_obj, &ptr, &size);
    if (found == 0) {
      found = usmipc_dlpack_range(mem_obj, &ptr, &size, &tensor);
    }
    if (found < 0) {
      return NULL;
    }
    if (found == 0) {
      PyErr_Format(PyExc_TypeError,
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
    return handle;
  }

  usmipc_memory_object_t *mem = (usmipc_memory_object_t *)mem_obj;
  if (mem->kind != USMIPC_MEM_DEVICE) {
    PyObject *name = PyType_GetName(Py_TYPE(mem_obj));
    if (name != NULL) {
      PyErr_Format(PyExc_TypeError,
                   "IPCMemoryHandle() exports device memory only "
                   "(MemoryUSMDevice); %U memory is of kind '%s'",
                   name, mem->kind == USMIPC_MEM_HOST ? "host" : "shared");
      Py_DECREF(name);
    }
    return NULL;
  }
  if (mem->closed || mem->released) {
    PyErr_SetString(PyExc_ValueError, "mapping is closed");
    return NULL;
  }
  if (mem->device == NULL) {
    PyErr_SetString(PyExc_ValueError, "memory object is not initialized");
    return NULL;
  }
  usmipc_device_t *device = ((usmipc_device_object_t *)mem->device)->device;
  if (!usmipc_device_has_ipc(device)) {
    char message[256];
    snprintf(message, sizeof(message),
             "device %s ('%s') does not support IPC memory "
             "(has_aspect_ipc_memory is False); share the data through the "
             "host instead",
             usmipc_device_filter_string(device), usmipc_device_name(device));
    return usmipc_raise_msg(st, USMIPC_ENOTSUP, message);
  }
  if (export_range(mem->nbytes, offset, nbytes_obj, &nbytes) < 0) {
    return NULL;
  }
  return export_memory(type, st, mem_obj, NULL, mem,
                       (const char *)mem->ptr + offset, nbytes);
}

/* Borrowed pointer and length of handle bytes given as bytes, an
 * IPCMemoryHandle or any buffer; *view is filled (and must be released)
 * only in the last case, *have_view says so. */
static int handle_bytes(usmipc_module_state_t *st, PyObject *obj,
                        const char **data, Py_ssize_t *len, Py_buffer *view,
                        int *have_view) {
  *have_view = 0;
  if (PyBytes_Check(obj)) {
    char *p;
    if (PyBytes_AsStringAndSize(obj, &p, len) < 0) {
      return -1;
    }
    *data = p;
    return 0;
  }
  if (Py_IS_TYPE(obj, st->IPCMemoryHandleType)) {
    char *p;
    if (PyBytes_AsStringAndSize(((Handle *)obj)->data, &p, len) < 0) {
      return -1;
    }
    *data = p;
    return 0;
  }
  if (PyObject_CheckBuffer(obj)) {
    if (PyObject_GetBuffer(obj, view, PyBUF_SIMPLE) < 0) {
      return -1;
    }
    *have_view = 1;
    *data = view->buf;
    *len = view->len;
    return 0;
  }
  PyErr_Format(PyExc_TypeError,
               "expected handle bytes or an IPCMemoryHandle, not %R",
               (PyObject *)Py_TYPE(obj));
  return -1;
}

static PyObject *handle_from_bytes(PyObject *cls, PyTypeObject *defining_class,
                                   PyObject *const *args, Py_ssize_t nargs,
                                   PyObject *kwnames) {
  (void)cls;
  static const char *const names[] = {"data"};
  PyObject *raw;
  usmipc_module_state_t *st = PyType_GetModuleState(defining_class);
  if (usmipc_parse_fastcall("from_bytes", args, nargs, kwnames, names, 1, 1,
                            &raw) < 0) {
    return NULL;
  }
  if (raw == NULL) {
    PyErr_SetString(PyExc_TypeError, "from_bytes() missing argument 'data'");
    return NULL;
  }
  PyTypeObject *type = st->IPCMemoryHandleType;
  if (type == NULL) {
    return usmipc_state_cleared();
  }
  const char *data;
  Py_ssize_t len;
  Py_buffer view;
  int have_view;
  if (handle_bytes(st, raw, &data, &len, &view, &have_view) < 0) {
    return NULL;
  }
  allocfunc alloc = (allocfunc)PyType_GetSlot(type, Py_tp_alloc);
  Handle *self = (Handle *)alloc(type, 0);
  if (self != NULL) {
    int rc = usmipc_ipc_handle_inspect(data, (size_t)len, &self->info);
    if (rc < 0) {
      usmipc_raise(st, rc);
      Py_CLEAR(self);
    } else if (PyBytes_CheckExact(raw)) {
      self->data = Py_NewRef(raw);
    } else {
      self->data = PyBytes_FromStringAndSize(data, len);
      if (self->data == NULL) {
        Py_CLEAR(self);
      }
    }
  }
  if (have_view) {
    PyBuffer_Release(&view);
  }
  return (PyObject *)self;
}

/* ---- GC ------------------------------------------------------------------ */

static int handle_traverse(PyObject *op, visitproc visit, void *arg) {
  Handle *self = (Handle *)op;
  Py_VISIT(Py_TYPE(op));
  Py_VISIT(self->memory);
  Py_VISIT(self->data);
  return 0;
}

static int handle_clear(PyObject *op) {
  Handle *self = (Handle *)op;
  Py_CLEAR(self->memory);
  Py_CLEAR(self->data);
  return 0;
}

static void handle_dealloc(PyObject *op) {
  Handle *self = (Handle *)op;
  PyTypeObject *tp = Py_TYPE(op);
  PyObject_GC_UnTrack(op);
  if (self->handle != NULL) {
    /* Before dropping the memory: the handle names that allocation. */
    usmipc_ipc_handle_t *handle = self->handle;
    self->handle = NULL;
    Py_BEGIN_ALLOW_THREADS
    usmipc_ipc_free_handle(handle);
    Py_END_ALLOW_THREADS
  }
  /* The producer may free its memory once the deleter has run, so only
   * after the library's handle is gone; not in tp_clear, which may run
   * before (the capsule is no GC object and takes part in no cycle). */
  Py_CLEAR(self->tensor);
  handle_clear(op);
  freefunc tp_free = (freefunc)PyType_GetSlot(tp, Py_tp_free);
  tp_free(op);
  Py_DECREF(tp);
}

/* ---- the importer's side ------------------------------------------------- */

/* open() and open_sycl(): the same arguments; sycl selects
 * usmipc_ipc_open_sycl (bytes of a SYCL program's IPC handle). */
static PyObject *open_common(PyTypeObject *defining_class,
                             PyObject *const *args, Py_ssize_t nargs,
                             PyObject *kwnames, int sycl) {
  static const char *const names[] = {"handle", "device", "nbytes"};
  PyObject *a[3];
  usmipc_module_state_t *st = PyType_GetModuleState(defining_class);
  if (kwnames == NULL && nargs >= 1 && nargs <= 3) {
    a[0] = args[0];
    a[1] = nargs > 1 ? args[1] : NULL;
    a[2] = nargs > 2 ? args[2] : NULL;
  } else if (usmipc_parse_fastcall(sycl ? "open_sycl" : "open", args, nargs,
                                   kwnames, names, 3, 3, a) < 0) {
    return NULL;
  }
  if (a[0] == NULL) {
    PyErr_SetString(PyExc_TypeError,
                    "open() missing required argument 'handle'");
    return NULL;
  }

  size_t nbytes = 0;
  if (a[2] != NULL && a[2] != Py_None) {
    Py_ssize_t n = PyLong_AsSsize_t(a[2]);
    if (n == -1 && PyErr_Occurred()) {
      return NULL;
    }
    if (n <= 0) {
      PyErr_Format(PyExc_ValueError,
                   "nbytes must be positive or None (the exported size), "
                   "not %zd",
                   n);
      return NULL;
    }
    nbytes = (size_t)n;
  }

  PyObject *device_obj = NULL; /* strong */
  usmipc_device_t *device = NULL;
  if (a[1] != NULL && a[1] != Py_None) {
    if (Py_IS_TYPE(a[1], st->DeviceType)) {
      device_obj = Py_NewRef(a[1]);
    } else {
      device_obj = usmipc_device_from_arg(st, a[1]);
      if (device_obj == NULL) {
        return NULL;
      }
    }
    device = ((usmipc_device_object_t *)device_obj)->device;
  }

  const char *data;
  Py_ssize_t len;
  Py_buffer view;
  int have_view;
  if (handle_bytes(st, a[0], &data, &len, &view, &have_view) < 0) {
    Py_XDECREF(device_obj);
    return NULL;
  }

  void *ptr = NULL;
  size_t mapped = 0;
  int rc;
  int query_failed = 0;
  char query_message[256];
  Py_BEGIN_ALLOW_THREADS
  rc = sycl ? usmipc_ipc_open_sycl(data, (size_t)len, device, nbytes, &ptr,
                                   &mapped)
            : usmipc_ipc_open(data, (size_t)len, device, nbytes, &ptr,
                              &mapped);
  if (rc == 0 && device == NULL) {
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
  if (have_view) {
    PyBuffer_Release(&view);
  }
  /* The open may wait on the exporting process; the interrupt hook
   * (module.c) runs signal handlers meanwhile. If one raised (Ctrl-C), the
   * core gave up with USMIPC_EINTR and that exception, KeyboardInterrupt,
   * is pending on this thread: propagate it rather than a usmipc.Error. */
  if (rc == USMIPC_EINTR && PyErr_Occurred()) {
    Py_XDECREF(device_obj);
    return NULL;
  }
  if (rc == 0 && PyErr_Occurred()) {
    /* A handler raised but the open completed anyway: the exception wins,
     * and the mapping must not leak. */
    Py_XDECREF(device_obj);
    goto fail;
  }
  if (rc < 0) {
    Py_XDECREF(device_obj);
    return query_failed ? usmipc_raise_msg(st, rc, query_message)
                        : usmipc_raise(st, rc);
  }
  if (device_obj == NULL) {
    device_obj = usmipc_device_object(st, device);
    if (device_obj == NULL) {
      goto fail;
    }
  }
  PyObject *mem = usmipc_mapping_new(st, device_obj, ptr, mapped);
  Py_DECREF(device_obj);
  if (mem == NULL) {
    goto fail;
  }
  return mem;

fail:
  Py_BEGIN_ALLOW_THREADS
  usmipc_ipc_close(ptr);
  Py_END_ALLOW_THREADS
  return NULL;
}

static PyObject *handle_open(PyObject *cls, PyTypeObject *defining_class,
                             PyObject *const *args, Py_ssize_t nargs,
                             PyObject *kwnames) {
  (void)cls;
  return open_common(defining_class, args, nargs, kwnames, 0);
}

static PyObject *handle_open_sycl(PyObject *cls, PyTypeObject *defining_class,
                                  PyObject *const *args, Py_ssize_t nargs,
                                  PyObject *kwnames) {
  (void)cls;
  return open_common(defining_class, args, nargs, kwnames, 1);
}

static PyObject *handle_close_mapping(PyObject *cls,
                                      PyTypeObject *defining_class,
                                      PyObject *const *args, Py_ssize_t nargs,
                                      PyObject *kwnames) {
  (void)cls;
  static const char *const names[] = {"memory"};
  PyObject *mem;
  usmipc_module_state_t *st = PyType_GetModuleState(defining_class);
  if (kwnames == NULL && nargs == 1) {
    mem = args[0];
  } else if (usmipc_parse_fastcall("close_mapping", args, nargs, kwnames, names,
                                   1, 1, &mem) < 0) {
    return NULL;
  } else if (mem == NULL) {
    PyErr_SetString(PyExc_TypeError,
                    "close_mapping() missing required argument 'memory'");
    return NULL;
  }
  if (!PyObject_TypeCheck(mem, st->MemoryIPCDeviceType)) {
    PyErr_Format(PyExc_TypeError,
                 "close_mapping() takes a MemoryIPCDevice returned by "
                 "IPCMemoryHandle.open(), not %R",
                 (PyObject *)Py_TYPE(mem));
    return NULL;
  }
  if (usmipc_mapping_close(st, (usmipc_memory_object_t *)mem) < 0) {
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
  usmipc_module_state_t *st = PyType_GetModuleState(defining_class);
  if (nargs != 0 || (kwnames != NULL && PyTuple_Size(kwnames) != 0)) {
    PyErr_SetString(PyExc_TypeError, "is_available() takes no arguments");
    return NULL;
  }
  usmipc_device_t *devices[64];
  size_t count = 0;
  int rc = usmipc_get_devices(devices, 64, &count);
  if (rc < 0) {
    return usmipc_raise(st, rc);
  }
  if (count > 64) {
    count = 64;
  }
  for (size_t i = 0; i < count; i++) {
    if (usmipc_device_has_ipc(devices[i])) {
      Py_RETURN_TRUE;
    }
  }
  Py_RETURN_FALSE;
}

static PyObject *handle_set_cache_size(PyObject *cls,
                                       PyTypeObject *defining_class,
                                       PyObject *const *args, Py_ssize_t nargs,
                                       PyObject *kwnames) {
  (void)cls;
  static const char *const names[] = {"entries"};
  PyObject *arg;
  usmipc_module_state_t *st = PyType_GetModuleState(defining_class);
  if (usmipc_parse_fastcall("set_cache_size", args, nargs, kwnames, names, 1, 1,
                            &arg) < 0) {
    return NULL;
  }
  if (arg == NULL) {
    PyErr_SetString(PyExc_TypeError,
                    "set_cache_size() missing argument 'entries'");
    return NULL;
  }
  Py_ssize_t entries = PyLong_AsSsize_t(arg);
  if (entries == -1 && PyErr_Occurred()) {
    return NULL;
  }
  if (entries < 0) {
    PyErr_SetString(PyExc_ValueError, "entries must be >= 0");
    return NULL;
  }
  int rc = usmipc_ipc_set_cache_size((size_t)entries);
  if (rc < 0) {
    return usmipc_raise(st, rc);
  }
  Py_RETURN_NONE;
}

static PyObject *info_dict(const usmipc_ipc_handle_info_t *info,
                           Py_ssize_t len) {
  return Py_BuildValue(
      "{sssy#sksKsKsKsKsIsn}", "backend", usmipc_backend_name(info->backend),
      "device_uuid", (const char *)info->device_uuid, (Py_ssize_t)16,
      "exporter_pid", (unsigned long)info->exporter_pid, "buffer_id",
      (unsigned long long)info->buffer_id, "allocation_size",
      (unsigned long long)info->allocation_size, "offset",
      (unsigned long long)info->offset, "nbytes",
      (unsigned long long)info->nbytes, "handle_kind",
      (unsigned int)info->handle_kind, "length", len);
}

static PyObject *handle_inspect(PyObject *cls, PyTypeObject *defining_class,
                                PyObject *const *args, Py_ssize_t nargs,
                                PyObject *kwnames) {
  (void)cls;
  static const char *const names[] = {"handle"};
  PyObject *raw;
  usmipc_module_state_t *st = PyType_GetModuleState(defining_class);
  if (usmipc_parse_fastcall("inspect", args, nargs, kwnames, names, 1, 1,
                            &raw) < 0) {
    return NULL;
  }
  if (raw == NULL) {
    PyErr_SetString(PyExc_TypeError, "inspect() missing argument 'handle'");
    return NULL;
  }
  const char *data;
  Py_ssize_t len;
  Py_buffer view;
  int have_view;
  if (handle_bytes(st, raw, &data, &len, &view, &have_view) < 0) {
    return NULL;
  }
  usmipc_ipc_handle_info_t info;
  int rc = usmipc_ipc_handle_inspect(data, (size_t)len, &info);
  if (have_view) {
    PyBuffer_Release(&view);
  }
  if (rc < 0) {
    return usmipc_raise(st, rc);
  }
  return info_dict(&info, len);
}

/* ---- instance methods and getters ---------------------------------------- */

static PyObject *handle_to_bytes(PyObject *self, PyObject *Py_UNUSED(ignored)) {
  return Py_NewRef(((Handle *)self)->data);
}

static PyObject *handle_reduce(PyObject *self, PyObject *Py_UNUSED(ignored)) {
  PyObject *from_bytes =
      PyObject_GetAttrString((PyObject *)Py_TYPE(self), "from_bytes");
  if (from_bytes == NULL) {
    return NULL;
  }
  PyObject *r = Py_BuildValue("(N(O))", from_bytes, ((Handle *)self)->data);
  return r;
}

static PyObject *handle_get_backend(PyObject *self, void *closure) {
  (void)closure;
  return PyUnicode_FromString(
      usmipc_backend_name(((Handle *)self)->info.backend));
}

static PyObject *handle_get_device_uuid(PyObject *self, void *closure) {
  (void)closure;
  return PyBytes_FromStringAndSize(
      (const char *)((Handle *)self)->info.device_uuid, 16);
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
  usmipc_module_state_t *st = handle_state(op);
  if (self->memory != NULL && st->MemoryType != NULL &&
      PyObject_TypeCheck(self->memory, st->MemoryType)) {
    PyObject *device = ((usmipc_memory_object_t *)self->memory)->device;
    if (device != NULL) {
      return Py_NewRef(device);
    }
  }
  usmipc_device_t *devices[64];
  size_t count = 0;
  int rc = usmipc_get_devices(devices, 64, &count);
  if (rc < 0) {
    return usmipc_raise(st, rc);
  }
  if (count > 64) {
    count = 64;
  }
  for (size_t i = 0; i < count; i++) {
    uint8_t uuid[16];
    usmipc_device_uuid(devices[i], uuid);
    if (usmipc_device_backend(devices[i]) == self->info.backend &&
        memcmp(uuid, self->info.device_uuid, 16) == 0) {
      return usmipc_device_object(st, devices[i]);
    }
  }
  Py_RETURN_NONE;
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
  return PyUnicode_FromFormat("<usmipc.memory.IPCMemoryHandle: %s; %zd-byte "
                              "handle>",
                              text, self->data ? PyBytes_Size(self->data) : 0);
}

static PyObject *handle_richcompare(PyObject *self, PyObject *other, int op) {
  if ((op != Py_EQ && op != Py_NE) || !Py_IS_TYPE(other, Py_TYPE(self))) {
    Py_RETURN_NOTIMPLEMENTED;
  }
  return PyObject_RichCompare(((Handle *)self)->data, ((Handle *)other)->data,
                              op);
}

static Py_hash_t handle_hash(PyObject *self) {
  return PyObject_Hash(((Handle *)self)->data);
}

#define CMETHOD(f) (PyCFunction)(void (*)(void))(f)
#define CLASS_FLAGS (METH_CLASS | METH_METHOD | METH_FASTCALL | METH_KEYWORDS)

static PyMethodDef handle_methods[] = {
    {"open", CMETHOD(handle_open), CLASS_FLAGS,
     "open($cls, /, handle, device=None, nbytes=None)\n--\n\n"
     "Returns a MemoryIPCDevice. "
     "Maps handle bytes (or an IPCMemoryHandle) on device (None: the device "
     "the\nhandle names). nbytes=None maps the exported size; more is "
     "refused with\nValueError. Opening the same allocation again is cheap "
     "(mappings are\nshared and cached)."},
    {"open_sycl", CMETHOD(handle_open_sycl), CLASS_FLAGS,
     "open_sycl($cls, /, handle, device=None, nbytes=None)\n--\n\n"
     "Returns a MemoryIPCDevice mapping memory that a SYCL program "
     "exported:\nthe bytes of dpctl's IPCMemoryHandle.to_bytes() (a UMF "
     "blob of 108 or\n120 bytes over a Level Zero handle), never usmipc "
     "handle bytes. device:\na level_zero device (None: level_zero:gpu:0). "
     "nbytes=None maps from the\nexported pointer to the end of its "
     "allocation. Weaker than open(): the\nblob does not prove who exported "
     "it, and a freed allocation is not\ndetected (docs/level-zero.md). "
     "Each call maps anew; close with\nclose_mapping()."},
    {"close_mapping", CMETHOD(handle_close_mapping), CLASS_FLAGS,
     "close_mapping($cls, /, memory)\n--\n\nCloses a mapping returned by "
     "open(); "
     "idempotent. While memoryviews of it are\nalive the unmap waits for "
     "the last one."},
    {"is_available", CMETHOD(handle_is_available), CLASS_FLAGS,
     "is_available($cls, /)\n--\n\nTrue if any available device supports IPC."},
    {"inspect", CMETHOD(handle_inspect), CLASS_FLAGS,
     "inspect($cls, /, handle)\n--\n\nValidates handle bytes without opening "
     "them "
     "and returns their metadata\n(backend, device_uuid, exporter_pid, "
     "buffer_id, allocation_size, offset,\nnbytes, handle_kind, length)."},
    {"set_cache_size", CMETHOD(handle_set_cache_size), CLASS_FLAGS,
     "set_cache_size($cls, /, entries)\n--\n\n"
     "How many closed mappings this process keeps for cheap re-opens\n"
     "(default 64, or USMIPC_IPC_CACHE_SIZE); 0 unmaps on the last close.\n"
     "The same as usmipc.set_ipc_cache_size()."},
    {"from_bytes", CMETHOD(handle_from_bytes), CLASS_FLAGS,
     "from_bytes($cls, /, data)\n--\n\nAn IPCMemoryHandle carrying only the "
     "given bytes (validated), as after unpickling."},
    {"to_bytes", handle_to_bytes, METH_NOARGS,
     "to_bytes() -> bytes: the serialized handle, for any channel."},
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
    {"backend", handle_get_backend, NULL, "The backend's name.", NULL},
    {"device_uuid", handle_get_device_uuid, NULL,
     "UUID of the exporting device.", NULL},
    {"device", handle_get_device, NULL,
     "The exporting Device, or None if this process does not see it.", NULL},
    {"memory", handle_get_memory, NULL,
     "The exported memory object (None for a handle made from bytes).", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

PyDoc_STRVAR(handle_doc,
             "IPCMemoryHandle(memory, *, offset=0, nbytes=None)\n--\n\n"
             "Exports device memory allocated by usmipc (MemoryUSMDevice), or "
             "another\nlibrary's C-contiguous CUDA array with "
             "__cuda_array_interface__ or\n__dlpack__ (torch, CuPy, JAX), for "
             "other processes: send to_bytes() (or\npickle the handle) by any "
             "channel and call IPCMemoryHandle.open() there.\nThe handle keeps "
             "the memory alive (a DLPack tensor's deleter runs when the\n"
             "handle dies). Raises TypeError for other memory kinds and objects, "
             "ValueError\nfor strided arrays, usmipc.Error if the device does "
             "not support IPC.\n\n"
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

int usmipc_init_ipc_handle_type(PyObject *module, usmipc_module_state_t *st) {
  st->IPCMemoryHandleType =
      (PyTypeObject *)PyType_FromModuleAndSpec(module, &handle_spec, NULL);
  if (st->IPCMemoryHandleType == NULL) {
    return -1;
  }
  return PyModule_AddType(module, st->IPCMemoryHandleType);
}
