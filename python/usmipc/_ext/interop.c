/* Zero-copy interop of the memory types with other array libraries: DLPack
 * (__dlpack__, __dlpack_device__; torch, CuPy, NumPy, JAX) and the CUDA
 * array interface (__cuda_array_interface__, version 3), plus reading another
 * library's __cuda_array_interface__ so that IPCMemoryHandle can export
 * foreign device memory (a torch tensor, a CuPy array).
 *
 * A DLPack capsule counts as a buffer export of the memory object (it holds a
 * reference and the export count), so closing a mapping while a consumer
 * still holds the tensor defers the unmap to the tensor's deleter, exactly as
 * for a memoryview. The deleter may run on any thread without the GIL
 * (NumPy's dlpack.c): it takes the GIL itself, and does nothing once the
 * interpreter is finalized.
 *
 * The import side reads another library's tensor for IPCMemoryHandle: its
 * __cuda_array_interface__, or else its __dlpack__ capsule, which it
 * consumes as NumPy's from_dlpack does (the capsule renamed "used_...", the
 * managed tensor moved into an internal capsule whose destructor calls the
 * producer's deleter).
 *
 * A mapping opened with a device-side wait (IPCMemoryHandle.open with a
 * stream) keeps its handle bytes: __dlpack__(stream=...) then makes the
 * consumer's stream wait for the producer's event as well, as the DLPack
 * protocol asks of a producer (the event is opened on first need). Other
 * memory needs no synchronization: usmipc's own copies and fills have
 * completed when they return, and a mapping opened with a host wait was
 * complete when open() returned.
 *
 * The DLPack structures below are copied from dlpack.h (v1.0; its ABI is
 * stable), so the build needs no extra header.
 */
#include "ext.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "dlpack.h"

/* ---- the device of a memory object ----------------------------------------
 */

static DLDevice dl_device_of(usmipc_memory_object_t *mem) {
  DLDevice dev = {kDLCPU, 0};
  int index = 0;
  if (mem->device != NULL) {
    index =
        usmipc_device_index(((usmipc_device_object_t *)mem->device)->device);
  }
  switch (mem->backend) {
  case USMIPC_BACKEND_HOST:
    break;
  case USMIPC_BACKEND_CUDA:
    if (mem->kind == USMIPC_MEM_HOST) {
      dev.device_type = kDLCUDAHost;
    } else {
      dev.device_type =
          mem->kind == USMIPC_MEM_SHARED ? kDLCUDAManaged : kDLCUDA;
      dev.device_id = index;
    }
    break;
  case USMIPC_BACKEND_LEVEL_ZERO:
    dev.device_type = kDLOneAPI;
    dev.device_id = index;
    break;
  }
  return dev;
}

PyObject *usmipc_memory_dlpack_device(PyObject *self,
                                      PyObject *Py_UNUSED(ignored)) {
  DLDevice dev = dl_device_of((usmipc_memory_object_t *)self);
  return Py_BuildValue("(ii)", (int)dev.device_type, (int)dev.device_id);
}

/* ---- __dlpack__ -----------------------------------------------------------
 */

/* What a capsule owns, in one malloc block: the deleter may free it on any
 * thread without the GIL (PyMem_RawFree is not in the 3.11 limited API). */
typedef struct {
  union {
    DLManagedTensor unversioned;
    DLManagedTensorVersioned versioned;
  } managed;
  int64_t shape[1];
  int64_t strides[1];
} dl_context_t;

/* Ends the export the capsule held; safe on any thread. */
static void dl_release(PyObject *mem) {
  if (!Py_IsInitialized()) {
    return; /* too late to touch Python objects: leak, as NumPy does */
  }
  PyGILState_STATE gil = PyGILState_Ensure();
  PyObject *type, *value, *traceback;
  PyErr_Fetch(&type, &value, &traceback);
  if (usmipc_memory_end((usmipc_memory_object_t *)mem) < 0) {
    PyErr_WriteUnraisable(mem);
  }
  Py_DECREF(mem);
  PyErr_Restore(type, value, traceback);
  PyGILState_Release(gil);
}

static void dl_deleter(DLManagedTensor *self) {
  PyObject *mem = (PyObject *)self->manager_ctx;
  free(self); /* the context starts with the managed tensor */
  dl_release(mem);
}

static void dl_deleter_versioned(DLManagedTensorVersioned *self) {
  PyObject *mem = (PyObject *)self->manager_ctx;
  free(self);
  dl_release(mem);
}

/* A capsule that no consumer took still owns its tensor. */
static void dl_capsule_destructor(PyObject *capsule) {
  if (PyCapsule_IsValid(capsule, "used_dltensor") ||
      PyCapsule_IsValid(capsule, "used_dltensor_versioned")) {
    return;
  }
  PyObject *type, *value, *traceback;
  PyErr_Fetch(&type, &value, &traceback);
  if (PyCapsule_IsValid(capsule, "dltensor")) {
    DLManagedTensor *m = PyCapsule_GetPointer(capsule, "dltensor");
    m->deleter(m);
  } else if (PyCapsule_IsValid(capsule, "dltensor_versioned")) {
    DLManagedTensorVersioned *m =
        PyCapsule_GetPointer(capsule, "dltensor_versioned");
    m->deleter(m);
  }
  PyErr_Restore(type, value, traceback);
}

/* The consumer's stream of __dlpack__ as a Queue (new reference), or
 * Py_None when no synchronization is asked for. On CUDA (DLPack's
 * device-specific notes): None is the legacy default stream, as is 1; 2 the
 * per-thread default stream; -1 asks for no synchronization; other ints
 * are CUstreams (0, which the protocol disallows as ambiguous, is taken as
 * the legacy default stream). Elsewhere None asks for nothing and other
 * values go through the stream resolver (a usmipc.Queue, ...). */
static PyObject *dlpack_stream_queue(usmipc_memory_object_t *mem,
                                     PyObject *stream, int32_t device_type) {
  usmipc_module_state_t *st = usmipc_state_from_device(mem->device);
  int is_int = stream != NULL && PyLong_Check(stream) && !PyBool_Check(stream);
  if (is_int) {
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(stream, &overflow);
    if (v == -1 && PyErr_Occurred()) {
      return NULL;
    }
    if (overflow == 0 && v == -1) {
      Py_RETURN_NONE;
    }
    if (overflow < 0 || (overflow == 0 && v < -1)) {
      PyErr_Format(PyExc_BufferError,
                   "__dlpack__: stream must be None, -1 or a positive int "
                   "(DLPack), not %R",
                   stream);
      return NULL;
    }
  }
  if (device_type == kDLCUDA || device_type == kDLCUDAManaged) {
    if (stream == NULL || stream == Py_None) {
      return usmipc_queue_wrap(st, mem->device, NULL, NULL, "__dlpack__()");
    }
    if (is_int) {
      unsigned long long v = PyLong_AsUnsignedLongLong(stream);
      if (v == (unsigned long long)-1 && PyErr_Occurred()) {
        return NULL;
      }
      void *native = v <= 1 ? NULL : (void *)(uintptr_t)v;
      return usmipc_queue_wrap(st, mem->device, native, NULL, "__dlpack__()");
    }
  } else if (stream == NULL || stream == Py_None) {
    Py_RETURN_NONE;
  }
  return usmipc_queue_from_stream(st, stream, NULL, mem->device,
                                  "__dlpack__()");
}

/* Makes the consumer's stream wait for the producer's event of an ordered
 * mapping opened with a device-side wait; the event is opened on the first
 * call that needs it. 0, or -1 with an exception set. */
static int dlpack_sync(usmipc_memory_object_t *mem, PyObject *stream,
                       int32_t device_type) {
  PyObject *queue_obj = dlpack_stream_queue(mem, stream, device_type);
  if (queue_obj == NULL) {
    return -1;
  }
  if (queue_obj == Py_None) {
    Py_DECREF(queue_obj);
    return 0;
  }
  usmipc_module_state_t *st = usmipc_state_from_device(mem->device);
  usmipc_device_t *device = ((usmipc_device_object_t *)mem->device)->device;
  int rc = 0;
  if (mem->order_event == NULL && mem->order_handle != NULL) {
    PyObject *bytes = Py_NewRef(mem->order_handle);
    char *data;
    Py_ssize_t len;
    if (PyBytes_AsStringAndSize(bytes, &data, &len) < 0) {
      Py_DECREF(bytes);
      Py_DECREF(queue_obj);
      return -1;
    }
    usmipc_event_t *event = NULL;
    Py_BEGIN_ALLOW_THREADS
    rc = usmipc_ipc_open_handle_event(data, (size_t)len, device, &event);
    Py_END_ALLOW_THREADS
    Py_DECREF(bytes);
    if (rc < 0) {
      Py_DECREF(queue_obj);
      usmipc_raise(st, rc);
      return -1;
    }
    if (mem->order_event != NULL) {
      /* another thread opened it meanwhile */
      Py_BEGIN_ALLOW_THREADS
      usmipc_event_destroy(event);
      Py_END_ALLOW_THREADS
    } else {
      mem->order_event = event; /* NULL: the handle was not ordered */
      Py_CLEAR(mem->order_handle);
    }
  }
  usmipc_event_t *event = mem->order_event;
  if (event != NULL) {
    usmipc_queue_t *queue = ((usmipc_queue_object_t *)queue_obj)->queue;
    Py_BEGIN_ALLOW_THREADS
    rc = usmipc_event_wait(event, queue);
    Py_END_ALLOW_THREADS
  }
  Py_DECREF(queue_obj);
  if (rc < 0) {
    usmipc_raise(st, rc);
    return -1;
  }
  return 0;
}

static int parse_int_pair(PyObject *obj, const char *what, long *a, long *b) {
  if (!PyTuple_Check(obj) || PyTuple_Size(obj) != 2) {
    usmipc_type_error("%s must be a tuple of two ints", what);
    return -1;
  }
  *a = PyLong_AsLong(PyTuple_GetItem(obj, 0));
  if (*a == -1 && PyErr_Occurred()) {
    return -1;
  }
  *b = PyLong_AsLong(PyTuple_GetItem(obj, 1));
  if (*b == -1 && PyErr_Occurred()) {
    return -1;
  }
  return 0;
}

PyObject *usmipc_memory_dlpack(PyObject *self, PyObject *const *args,
                               Py_ssize_t nargs, PyObject *kwnames) {
  static const char *const names[] = {"stream", "max_version", "dl_device",
                                      "copy"};
  PyObject *a[4];
  usmipc_memory_object_t *mem = (usmipc_memory_object_t *)self;
  /* stream may come positionally: consumers written for DLPack 0.x do so. */
  if (usmipc_parse_fastcall("__dlpack__", args, nargs, kwnames, names, 4, 1,
                            a) < 0) {
    return NULL;
  }
  DLDevice dev = dl_device_of(mem);
  int versioned = 0;
  if (a[1] != NULL && a[1] != Py_None) {
    long major, minor;
    if (parse_int_pair(a[1], "max_version", &major, &minor) < 0) {
      return NULL;
    }
    versioned = major >= 1;
  }
  if (a[2] != NULL && a[2] != Py_None) {
    long type, id;
    if (parse_int_pair(a[2], "dl_device", &type, &id) < 0) {
      return NULL;
    }
    if (type != dev.device_type || id != dev.device_id) {
      PyErr_Format(PyExc_BufferError,
                   "usmipc memory lives on DLPack device (%d, %d) and cannot "
                   "be exported to (%ld, %ld) without a copy",
                   (int)dev.device_type, (int)dev.device_id, type, id);
      return NULL;
    }
  }
  if (a[3] != NULL && a[3] != Py_None) {
    int copy = PyObject_IsTrue(a[3]);
    if (copy < 0) {
      return NULL;
    }
    if (copy) {
      PyErr_SetString(PyExc_BufferError,
                      "__dlpack__(copy=True) is not supported: usmipc exports "
                      "its memory without a copy; use copy_to_host()");
      return NULL;
    }
  }
  if (dev.device_type == kDLCPU && a[0] != NULL && a[0] != Py_None) {
    PyErr_SetString(PyExc_BufferError,
                    "stream must be None for memory on the CPU");
    return NULL;
  }
  if (usmipc_memory_begin(mem) < 0) {
    return NULL;
  }
  /* Only mappings opened with a device-side wait need synchronization. */
  if ((mem->order_handle != NULL || mem->order_event != NULL) &&
      dev.device_type != kDLCPU &&
      dlpack_sync(mem, a[0], dev.device_type) < 0) {
    (void)usmipc_memory_end(mem);
    return NULL;
  }
  dl_context_t *ctx = malloc(sizeof(*ctx));
  if (ctx == NULL) {
    (void)usmipc_memory_end(mem);
    return PyErr_NoMemory();
  }
  memset(ctx, 0, sizeof(*ctx));
  ctx->shape[0] = (int64_t)mem->nbytes;
  ctx->strides[0] = 1;
  DLTensor *t = versioned ? &ctx->managed.versioned.dl_tensor
                          : &ctx->managed.unversioned.dl_tensor;
  t->data = mem->ptr;
  t->device = dev;
  t->ndim = 1;
  t->dtype.code = kDLUInt;
  t->dtype.bits = 8;
  t->dtype.lanes = 1;
  t->shape = ctx->shape;
  t->strides = ctx->strides;
  t->byte_offset = 0;

  PyObject *capsule;
  Py_INCREF(self); /* owned by the tensor until its deleter runs */
  if (versioned) {
    DLManagedTensorVersioned *m = &ctx->managed.versioned;
    m->version.major = 1;
    m->version.minor = 0;
    m->manager_ctx = self;
    m->deleter = dl_deleter_versioned;
    m->flags = 0; /* writable, not a copy */
    capsule = PyCapsule_New(m, "dltensor_versioned", dl_capsule_destructor);
    if (capsule == NULL) {
      m->deleter(m);
    }
  } else {
    DLManagedTensor *m = &ctx->managed.unversioned;
    m->manager_ctx = self;
    m->deleter = dl_deleter;
    capsule = PyCapsule_New(m, "dltensor", dl_capsule_destructor);
    if (capsule == NULL) {
      m->deleter(m);
    }
  }
  return capsule;
}

/* ---- __cuda_array_interface__ ---------------------------------------------
 */

PyObject *usmipc_memory_cuda_array_interface(PyObject *self, void *closure) {
  (void)closure;
  usmipc_memory_object_t *mem = (usmipc_memory_object_t *)self;
  if (mem->backend != USMIPC_BACKEND_CUDA) {
    PyErr_Format(PyExc_AttributeError,
                 "__cuda_array_interface__ describes CUDA memory only; this "
                 "memory is on the %s backend (use the buffer protocol or "
                 "__dlpack__)",
                 usmipc_backend_name(mem->backend));
    return NULL;
  }
  if (mem->closed || mem->released) {
    usmipc_value_error("mapping is closed");
    return NULL;
  }
  /* stream None: no synchronization is needed (see __dlpack__). */
  return Py_BuildValue("{s(n)sss[(ss)]s(NO)sOsisO}", "shape", mem->nbytes,
                       "typestr", "|u1", "descr", "", "|u1", "data",
                       PyLong_FromVoidPtr(mem->ptr), Py_False, "strides",
                       Py_None, "version", 3, "stream", Py_None);
}

/* ---- reading another library's __cuda_array_interface__ -------------------
 */

static int dict_item(PyObject *dict, const char *key, PyObject **out) {
  *out = PyMapping_GetItemString(dict, key); /* new reference */
  if (*out == NULL) {
    if (PyErr_ExceptionMatches(PyExc_KeyError)) {
      PyErr_Clear();
      return 0;
    }
    return -1;
  }
  return 1;
}

int usmipc_cuda_array_range(PyObject *obj, void **ptr, Py_ssize_t *nbytes) {
  PyObject *cai = PyObject_GetAttrString(obj, "__cuda_array_interface__");
  if (cai == NULL) {
    if (PyErr_ExceptionMatches(PyExc_AttributeError)) {
      PyErr_Clear();
      return 0;
    }
    return -1;
  }
  PyObject *data = NULL, *shape = NULL, *typestr = NULL, *strides = NULL;
  int rc = -1;
  if (!PyDict_Check(cai)) {
    usmipc_type_error("__cuda_array_interface__ is not a dict");
    goto done;
  }
  if (dict_item(cai, "data", &data) <= 0 ||
      dict_item(cai, "shape", &shape) <= 0 ||
      dict_item(cai, "typestr", &typestr) <= 0 ||
      dict_item(cai, "strides", &strides) < 0) {
    if (!PyErr_Occurred()) {
      usmipc_value_error("__cuda_array_interface__ lacks data, shape or typestr");
    }
    goto done;
  }
  if (!PyTuple_Check(data) || PyTuple_Size(data) < 1 || !PyTuple_Check(shape) ||
      !PyUnicode_Check(typestr)) {
    usmipc_value_error("__cuda_array_interface__ is malformed (data must be a "
                    "tuple, shape a tuple, typestr a str)");
    goto done;
  }
  void *address = PyLong_AsVoidPtr(PyTuple_GetItem(data, 0));
  if (address == NULL && PyErr_Occurred()) {
    goto done;
  }
  /* "<f4", "|u1", "<c16": byte order, kind, then the item size. */
  Py_ssize_t tlen;
  const char *ts = PyUnicode_AsUTF8AndSize(typestr, &tlen);
  if (ts == NULL) {
    goto done;
  }
  long itemsize = tlen > 2 ? strtol(ts + 2, NULL, 10) : 0;
  if (itemsize <= 0) {
    usmipc_value_error("__cuda_array_interface__ typestr %R has no item size",
                 typestr);
    goto done;
  }
  Py_ssize_t ndim = PyTuple_Size(shape);
  Py_ssize_t count = 1;
  for (Py_ssize_t i = 0; i < ndim; i++) {
    Py_ssize_t n = PyLong_AsSsize_t(PyTuple_GetItem(shape, i));
    if (n < 0) {
      if (!PyErr_Occurred()) {
        usmipc_value_error("negative extent in shape");
      }
      goto done;
    }
    count *= n;
  }
  /* Only a C-contiguous array is one byte range. */
  if (strides != NULL && strides != Py_None) {
    if (!PyTuple_Check(strides) || PyTuple_Size(strides) != ndim) {
      usmipc_value_error("__cuda_array_interface__ strides do not match shape");
      goto done;
    }
    Py_ssize_t expect = itemsize;
    for (Py_ssize_t i = ndim - 1; i >= 0; i--) {
      Py_ssize_t extent = PyLong_AsSsize_t(PyTuple_GetItem(shape, i));
      Py_ssize_t stride = PyLong_AsSsize_t(PyTuple_GetItem(strides, i));
      if (stride == -1 && PyErr_Occurred()) {
        goto done;
      }
      if (extent > 1 && stride != expect) {
        usmipc_value_error("only C-contiguous arrays can be exported: make the "
                        "array contiguous first");
        goto done;
      }
      expect *= extent;
    }
  }
  if (count == 0) {
    usmipc_value_error("cannot export an empty array");
    goto done;
  }
  *ptr = address;
  *nbytes = count * itemsize;
  rc = 1;

done:
  Py_XDECREF(data);
  Py_XDECREF(shape);
  Py_XDECREF(typestr);
  Py_XDECREF(strides);
  Py_DECREF(cai);
  return rc;
}

/* ---- reading another library's __dlpack__ ---------------------------------
 */

/* The internal capsules that own a consumed tensor (NumPy's
 * "numpy_dltensor"): destroying one calls the producer's deleter, once. */
#define DL_OWNER_NAME "usmipc_dltensor"
#define DL_OWNER_NAME_VERSIONED "usmipc_dltensor_versioned"

/* Calls the producer's deleter of a consumed tensor, which may run Python
 * code: an exception being raised meanwhile is kept aside. GIL held. */
static void dl_delete(void *managed, int versioned) {
  PyObject *type, *value, *traceback;
  PyErr_Fetch(&type, &value, &traceback);
  if (versioned) {
    DLManagedTensorVersioned *m = managed;
    if (m->deleter != NULL) {
      m->deleter(m);
    }
  } else {
    DLManagedTensor *m = managed;
    if (m->deleter != NULL) {
      m->deleter(m);
    }
  }
  PyErr_Restore(type, value, traceback);
}

static void dl_owner_destructor(PyObject *capsule) {
  if (PyCapsule_IsValid(capsule, DL_OWNER_NAME_VERSIONED)) {
    dl_delete(PyCapsule_GetPointer(capsule, DL_OWNER_NAME_VERSIONED), 1);
  } else if (PyCapsule_IsValid(capsule, DL_OWNER_NAME)) {
    dl_delete(PyCapsule_GetPointer(capsule, DL_OWNER_NAME), 0);
  }
}

/* method(max_version=(1, 0)), or method() for producers written before
 * DLPack 1.0 that refuse the keyword with TypeError (NumPy's from_dlpack
 * does the same). */
static PyObject *call_dlpack(PyObject *method) {
  PyObject *kwargs = Py_BuildValue("{s(ii)}", "max_version", 1, 0);
  if (kwargs == NULL) {
    return NULL;
  }
  PyObject *empty = PyTuple_New(0);
  if (empty == NULL) {
    Py_DECREF(kwargs);
    return NULL;
  }
  PyObject *capsule = PyObject_Call(method, empty, kwargs);
  Py_DECREF(kwargs);
  Py_DECREF(empty);
  if (capsule == NULL && PyErr_ExceptionMatches(PyExc_TypeError)) {
    PyErr_Clear();
    capsule = PyObject_CallNoArgs(method);
  }
  return capsule;
}

/* Takes the managed tensor out of a producer's capsule: renames the capsule
 * "used_dltensor[_versioned]" (so that its destructor leaves the tensor
 * alone) and returns a new internal capsule owning the tensor, with *tensor
 * and *flags read from it. NULL with an exception set if the capsule is not
 * a fresh DLPack capsule; a versioned tensor of another major version is
 * consumed and deleted without being read, as dlpack.h asks. */
static PyObject *dl_consume(PyObject *capsule, DLTensor *tensor,
                            uint64_t *flags) {
  int versioned;
  const char *name, *used_name, *owner_name;
  if (PyCapsule_IsValid(capsule, "dltensor_versioned")) {
    versioned = 1;
    name = "dltensor_versioned";
    used_name = "used_dltensor_versioned";
    owner_name = DL_OWNER_NAME_VERSIONED;
  } else if (PyCapsule_IsValid(capsule, "dltensor")) {
    versioned = 0;
    name = "dltensor";
    used_name = "used_dltensor";
    owner_name = DL_OWNER_NAME;
  } else {
    if (PyCapsule_IsValid(capsule, "used_dltensor") ||
        PyCapsule_IsValid(capsule, "used_dltensor_versioned")) {
      PyErr_SetString(PyExc_BufferError,
                      "__dlpack__ returned a capsule that was already "
                      "consumed");
    } else {
      usmipc_type_error("__dlpack__ returned %R, not a DLPack capsule "
                   "(\"dltensor\" or \"dltensor_versioned\")",
                   (PyObject *)Py_TYPE(capsule));
    }
    return NULL;
  }
  void *managed = PyCapsule_GetPointer(capsule, name);
  if (managed == NULL) {
    return NULL;
  }
  /* From here the tensor is ours: the producer's capsule no longer deletes
   * it, and every path below either hands it to the owner or deletes it. */
  if (PyCapsule_SetName(capsule, used_name) < 0) {
    return NULL;
  }
  PyObject *owner = PyCapsule_New(managed, owner_name, dl_owner_destructor);
  if (owner == NULL) {
    dl_delete(managed, versioned);
    return NULL;
  }
  if (versioned) {
    DLManagedTensorVersioned *m = managed;
    if (m->version.major != 1) {
      unsigned major = m->version.major, minor = m->version.minor;
      Py_DECREF(owner); /* only the deleter may be used */
      PyErr_Format(PyExc_BufferError,
                   "__dlpack__ returned a DLPack %u.%u tensor although "
                   "max_version=(1, 0) was asked for; usmipc reads DLPack 1.x",
                   major, minor);
      return NULL;
    }
    *tensor = m->dl_tensor;
    *flags = m->flags;
  } else {
    *tensor = ((DLManagedTensor *)managed)->dl_tensor;
    *flags = 0;
  }
  return owner;
}

/* The size in bytes of a C-contiguous tensor, or -1 with ValueError. */
static Py_ssize_t dl_contiguous_nbytes(const DLTensor *t, uint64_t flags) {
  if (t->ndim < 0 || (t->ndim > 0 && t->shape == NULL)) {
    usmipc_value_error("the DLPack tensor has a bad shape (ndim %d)", (int)t->ndim);
    return -1;
  }
  uint64_t bits = (uint64_t)t->dtype.bits * t->dtype.lanes;
  if (bits == 0) {
    usmipc_value_error("the DLPack tensor's element type has no size");
    return -1;
  }
  uint64_t count = 1;
  for (int32_t i = 0; i < t->ndim; i++) {
    if (t->shape[i] < 0) {
      usmipc_value_error("the DLPack tensor has a negative extent");
      return -1;
    }
    uint64_t extent = (uint64_t)t->shape[i];
    if (extent != 0 && count > (uint64_t)PY_SSIZE_T_MAX / extent) {
      usmipc_value_error("the DLPack tensor is too large");
      return -1;
    }
    count *= extent;
  }
  if (count == 0) {
    usmipc_value_error("cannot export an empty array");
    return -1;
  }
  /* Strides count elements, not bytes; NULL means C-contiguous. An extent
   * of 1 may have any stride (torch gives such dimensions odd ones). */
  if (t->strides != NULL) {
    int64_t expect = 1;
    for (int32_t i = t->ndim - 1; i >= 0; i--) {
      if (t->shape[i] > 1 && t->strides[i] != expect) {
        usmipc_value_error("IPCMemoryHandle needs contiguous memory: the DLPack "
                        "tensor is strided; make it C-contiguous first");
        return -1;
      }
      expect *= t->shape[i];
    }
  }
  /* Sub-byte elements (fp4, fp6) are packed unless the producer says they
   * are padded to whole bytes. */
  uint64_t nbytes;
  if (bits % 8 == 0 || (flags & DLPACK_FLAG_BITMASK_IS_SUBBYTE_TYPE_PADDED)) {
    uint64_t itemsize = (bits + 7) / 8;
    if (count > (uint64_t)PY_SSIZE_T_MAX / itemsize) {
      usmipc_value_error("the DLPack tensor is too large");
      return -1;
    }
    nbytes = count * itemsize;
  } else {
    if (count > ((uint64_t)PY_SSIZE_T_MAX - 7) / bits) {
      usmipc_value_error("the DLPack tensor is too large");
      return -1;
    }
    nbytes = (count * bits + 7) / 8;
  }
  return (Py_ssize_t)nbytes;
}

/* TypeError unless the tensor's device holds memory that can be exported:
 * CUDA or oneAPI (Level Zero) device memory, whose kind the library checks
 * itself, or on the CPU usmipc's own device memory (the host backend's,
 * shareable through its memfd). 0 or -1. */
static int dl_check_device(const DLTensor *t, const void *ptr) {
  int32_t type = t->device.device_type;
  if (type == kDLCUDA || type == kDLOneAPI) {
    return 0; /* the library tells the driver's allocations apart */
  }
  if (type == kDLCUDAHost || type == kDLCUDAManaged) {
    usmipc_kind_error("IPCMemoryHandle() exports device memory only; this DLPack "
                 "tensor is CUDA %s memory (device type %d)",
                 type == kDLCUDAHost ? "pinned host" : "managed", (int)type);
    return -1;
  }
  if (type == kDLCPU) {
    usmipc_pointer_info_t info;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = usmipc_pointer_query(ptr, &info);
    Py_END_ALLOW_THREADS
    if (rc < 0 || info.device == NULL ||
        usmipc_device_backend(info.device) != USMIPC_BACKEND_HOST) {
      usmipc_kind_error("IPCMemoryHandle() exports device memory only; this "
                      "DLPack tensor is ordinary CPU memory (device type 1), "
                      "not usmipc device memory: copy it into a "
                      "MemoryUSMDevice to share it");
      return -1;
    }
    if (info.kind != USMIPC_MEM_DEVICE) {
      usmipc_kind_error("IPCMemoryHandle() exports device memory only; this "
                   "DLPack tensor is usmipc memory of kind '%s'",
                   info.kind == USMIPC_MEM_HOST     ? "host"
                   : info.kind == USMIPC_MEM_SHARED ? "shared"
                                                    : "unknown");
      return -1;
    }
    return 0;
  }
  usmipc_kind_error("IPCMemoryHandle() exports CUDA and oneAPI device memory "
               "from DLPack tensors; this one is on DLPack device type %d",
               (int)type);
  return -1;
}

int usmipc_dlpack_range(PyObject *obj, void **ptr, Py_ssize_t *nbytes,
                        PyObject **owner) {
  *owner = NULL;
  PyObject *method = PyObject_GetAttrString(obj, "__dlpack__");
  if (method == NULL) {
    if (PyErr_ExceptionMatches(PyExc_AttributeError)) {
      PyErr_Clear();
      return 0;
    }
    return -1;
  }
  PyObject *capsule = call_dlpack(method);
  Py_DECREF(method);
  if (capsule == NULL) {
    return -1;
  }
  DLTensor t;
  uint64_t flags;
  PyObject *tensor_owner = dl_consume(capsule, &t, &flags);
  Py_DECREF(capsule);
  if (tensor_owner == NULL) {
    return -1;
  }
  void *address = (char *)t.data + t.byte_offset;
  Py_ssize_t size;
  if (dl_check_device(&t, address) < 0 ||
      (size = dl_contiguous_nbytes(&t, flags)) < 0) {
    Py_DECREF(tensor_owner); /* gives the tensor back to its producer */
    return -1;
  }
  *ptr = address;
  *nbytes = size;
  *owner = tensor_owner;
  return 1;
}

int usmipc_dlpack_read(PyObject *obj, void *tensor, uint64_t *flags,
                       PyObject **owner) {
  *owner = NULL;
  PyObject *method = PyObject_GetAttrString(obj, "__dlpack__");
  if (method == NULL) {
    if (PyErr_ExceptionMatches(PyExc_AttributeError)) {
      PyErr_Clear();
      return 0;
    }
    return -1;
  }
  PyObject *capsule = call_dlpack(method);
  Py_DECREF(method);
  if (capsule == NULL) {
    return -1;
  }
  *owner = dl_consume(capsule, tensor, flags);
  Py_DECREF(capsule);
  return *owner == NULL ? -1 : 1;
}
