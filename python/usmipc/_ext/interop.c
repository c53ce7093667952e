/* Floor 5 of the extension: zero-copy interop of the memory types with
 * other array libraries, DLPack (__dlpack__, __dlpack_device__; torch,
 * CuPy, NumPy, JAX) and the CUDA array interface
 * (__cuda_array_interface__, version 3), plus reading another library's
 * __cuda_array_interface__ so that IPCMemoryHandle can export foreign
 * device memory (a torch tensor, a CuPy array). Calls memory_core.c,
 * queue.c, device.c and util.c (module.c lists the floors). Its length
 * serves that one concern: the readers of other libraries' arrays and the
 * exporters of usmipc memory share the DLPack machinery (consuming a
 * capsule, contiguity, the device checks).
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
 * The DLPack structures are copied from dlpack.h (v1.0; its ABI is stable)
 * into this directory's dlpack.h, so the build needs no extra header.
 */
#include "interop.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "device.h"
#include "dlpack.h"
#include "memory_core.h"
#include "queue.h"
#include "util.h"

/* ---- the device of a memory object --------------------------------------- */

DLDevice pyusmipc_dl_device(usmipc_backend_t backend, usmipc_mem_kind_t kind,
                            int index) {
  DLDevice dev = {kDLCPU, 0};
  switch (backend) {
  case USMIPC_BACKEND_HOST:
    break;
  case USMIPC_BACKEND_CUDA:
    if (kind == USMIPC_MEM_HOST) {
      dev.device_type = kDLCUDAHost;
    } else {
      dev.device_type = kind == USMIPC_MEM_SHARED ? kDLCUDAManaged : kDLCUDA;
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

static DLDevice dl_device_of(pyusmipc_memory_object_t *mem) {
  int index = 0;
  if (mem->device != NULL) {
    index =
        usmipc_device_index(((pyusmipc_device_object_t *)mem->device)->device);
  }
  return pyusmipc_dl_device(mem->backend, mem->kind, index);
}

PyObject *pyusmipc_memory_dlpack_device(PyObject *self,
                                        PyObject *Py_UNUSED(ignored)) {
  DLDevice dev = dl_device_of((pyusmipc_memory_object_t *)self);
  return Py_BuildValue("(ii)", (int)dev.device_type, (int)dev.device_id);
}

/* ---- __dlpack__ ---------------------------------------------------------- */

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
  if (pyusmipc_memory_end((pyusmipc_memory_object_t *)mem) < 0) {
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
void pyusmipc_dl_capsule_destructor(PyObject *capsule) {
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
static PyObject *dlpack_stream_queue(pyusmipc_memory_object_t *mem,
                                     PyObject *stream, int32_t device_type) {
  pyusmipc_module_state_t *st = pyusmipc_state_from_device(mem->device);
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
      return pyusmipc_queue_wrap(st, mem->device, NULL, NULL, "__dlpack__()");
    }
    if (is_int) {
      unsigned long long v = PyLong_AsUnsignedLongLong(stream);
      if (v == (unsigned long long)-1 && PyErr_Occurred()) {
        return NULL;
      }
      void *native = v <= 1 ? NULL : (void *)(uintptr_t)v;
      return pyusmipc_queue_wrap(st, mem->device, native, NULL, "__dlpack__()");
    }
  } else if (stream == NULL || stream == Py_None) {
    Py_RETURN_NONE;
  }
  return pyusmipc_queue_from_stream(st, stream, NULL, mem->device,
                                    "__dlpack__()");
}

/* Makes the consumer's stream wait for the producer's event of an ordered
 * mapping opened with a device-side wait; the event is opened on the first
 * call that needs it. 0, or -1 with an exception set. */
static int dlpack_sync(pyusmipc_memory_object_t *mem, PyObject *stream,
                       int32_t device_type) {
  PyObject *queue_obj = dlpack_stream_queue(mem, stream, device_type);
  if (queue_obj == NULL) {
    return -1;
  }
  if (queue_obj == Py_None) {
    Py_DECREF(queue_obj);
    return 0;
  }
  pyusmipc_module_state_t *st = pyusmipc_state_from_device(mem->device);
  usmipc_device_t *device = ((pyusmipc_device_object_t *)mem->device)->device;
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
      pyusmipc_raise(st, rc);
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
    usmipc_queue_t *queue = ((pyusmipc_queue_object_t *)queue_obj)->queue;
    Py_BEGIN_ALLOW_THREADS
    rc = usmipc_event_wait(event, queue);
    Py_END_ALLOW_THREADS
  }
  Py_DECREF(queue_obj);
  if (rc < 0) {
    pyusmipc_raise(st, rc);
    return -1;
  }
  return 0;
}

static int parse_int_pair(PyObject *obj, const char *what, long *a, long *b) {
  if (!PyTuple_Check(obj) || PyTuple_Size(obj) != 2) {
    pyusmipc_type_error("%s must be a tuple of two ints", what);
    return -1;
  }
  *a = PyLong_AsLong(PyTuple_GetItem(obj, 0));
  if (*a == -1 && PyErr_Occurred()) {
    pyusmipc_retype_parse_error(); /* a wrong type: ArgumentTypeError */
    return -1;
  }
  *b = PyLong_AsLong(PyTuple_GetItem(obj, 1));
  if (*b == -1 && PyErr_Occurred()) {
    pyusmipc_retype_parse_error(); /* a wrong type: ArgumentTypeError */
    return -1;
  }
  return 0;
}

/* A capsule of a host copy of the memory (__dlpack__(copy=True) to the
 * CPU): the tensor's context and the bytes in one malloc block, which the
 * deleter frees on any thread, Python not needed. */
static void dl_deleter_owned(DLManagedTensor *self) { free(self); }
static void dl_deleter_owned_versioned(DLManagedTensorVersioned *self) {
  free(self);
}

/* Fills the one-dimensional uint8 tensor of nbytes at data. */
static void dl_fill(dl_context_t *ctx, int versioned, void *data,
                    DLDevice device, Py_ssize_t nbytes) {
  ctx->shape[0] = (int64_t)nbytes;
  ctx->strides[0] = 1;
  DLTensor *t = versioned ? &ctx->managed.versioned.dl_tensor
                          : &ctx->managed.unversioned.dl_tensor;
  t->data = data;
  t->device = device;
  t->ndim = 1;
  t->dtype.code = kDLUInt;
  t->dtype.bits = 8;
  t->dtype.lanes = 1;
  t->shape = ctx->shape;
  t->strides = ctx->strides;
  t->byte_offset = 0;
}

static PyObject *dl_host_copy(pyusmipc_memory_object_t *mem, int versioned) {
  if (mem->closed || mem->released) {
    return pyusmipc_value_error("mapping is closed");
  }
  dl_context_t *ctx = malloc(sizeof(*ctx) + (size_t)mem->nbytes);
  if (ctx == NULL) {
    return PyErr_NoMemory();
  }
  memset(ctx, 0, sizeof(*ctx));
  void *data = ctx + 1;
  if (pyusmipc_memory_copy_out(mem, data) < 0) {
    free(ctx);
    return NULL;
  }
  DLDevice cpu = {kDLCPU, 0};
  dl_fill(ctx, versioned, data, cpu, mem->nbytes);
  PyObject *capsule;
  if (versioned) {
    DLManagedTensorVersioned *m = &ctx->managed.versioned;
    m->version.major = 1;
    m->version.minor = 0;
    m->deleter = dl_deleter_owned_versioned;
    m->flags = DLPACK_FLAG_BITMASK_IS_COPIED;
    capsule =
        PyCapsule_New(m, "dltensor_versioned", pyusmipc_dl_capsule_destructor);
  } else {
    DLManagedTensor *m = &ctx->managed.unversioned;
    m->deleter = dl_deleter_owned;
    capsule = PyCapsule_New(m, "dltensor", pyusmipc_dl_capsule_destructor);
  }
  if (capsule == NULL) {
    free(ctx);
  }
  return capsule;
}

/* __dlpack__(copy=True) on the memory's own device: a new allocation of
 * the same kind and device, filled by a device copy (copy_from_device) and
 * exported without a further copy; its capsule holds it. */
static PyObject *dl_device_copy(pyusmipc_memory_object_t *mem,
                                PyObject *const *a) {
  pyusmipc_module_state_t *st = pyusmipc_state_from_device(mem->device);
  PyTypeObject *cls = mem->kind == USMIPC_MEM_HOST ? st->MemoryUSMHostType
                      : mem->kind == USMIPC_MEM_SHARED
                          ? st->MemoryUSMSharedType
                          : st->MemoryUSMDeviceType;
  PyObject *queue = pyusmipc_memory_queue_object(mem); /* borrowed */
  if (queue == NULL) {
    return NULL;
  }
  PyObject *args = Py_BuildValue("(n)", mem->nbytes);
  PyObject *kwargs = args ? Py_BuildValue("{sO}", "queue", queue) : NULL;
  PyObject *fresh =
      kwargs ? PyObject_Call((PyObject *)cls, args, kwargs) : NULL;
  Py_XDECREF(args);
  Py_XDECREF(kwargs);
  if (fresh == NULL) {
    return NULL;
  }
  PyObject *r =
      PyObject_CallMethod(fresh, "copy_from_device", "O", (PyObject *)mem);
  if (r == NULL) {
    Py_DECREF(fresh);
    return NULL;
  }
  Py_DECREF(r);
  PyObject *kw[3] = {a[0] ? a[0] : Py_None, a[1] ? a[1] : Py_None, Py_None};
  PyObject *names = Py_BuildValue("(ss)", "max_version", "dl_device");
  PyObject *capsule = NULL;
  if (names != NULL) {
    /* stream positionally, then max_version and dl_device=None */
    capsule = pyusmipc_memory_dlpack(fresh, kw, 1, names);
    Py_DECREF(names);
  }
  Py_DECREF(fresh); /* the capsule holds it */
  if (capsule != NULL && PyCapsule_IsValid(capsule, "dltensor_versioned")) {
    DLManagedTensorVersioned *m =
        PyCapsule_GetPointer(capsule, "dltensor_versioned");
    m->flags |= DLPACK_FLAG_BITMASK_IS_COPIED;
  }
  return capsule;
}

PyObject *pyusmipc_memory_dlpack(PyObject *self, PyObject *const *args,
                                 Py_ssize_t nargs, PyObject *kwnames) {
  static const char *const names[] = {"stream", "max_version", "dl_device",
                                      "copy"};
  PyObject *a[4];
  pyusmipc_memory_object_t *mem = (pyusmipc_memory_object_t *)self;
  /* stream may come positionally: consumers written for DLPack 0.x do so. */
  if (pyusmipc_parse_fastcall("__dlpack__", args, nargs, kwnames, names, 4, 1,
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
  /* dl_device: the memory's own device, or the CPU (1, 0) for memory the
   * host can read (the DLPack protocol's way for NumPy to take Level Zero
   * host and shared memory: numpy.from_dlpack(mem, device="cpu")). */
  int to_cpu = 0;
  if (a[2] != NULL && a[2] != Py_None) {
    long type, id;
    if (parse_int_pair(a[2], "dl_device", &type, &id) < 0) {
      return NULL;
    }
    if (type == kDLCPU && id == 0) {
      to_cpu = dev.device_type != kDLCPU;
    } else if (type != dev.device_type || id != dev.device_id) {
      PyErr_Format(PyExc_BufferError,
                   "usmipc memory lives on DLPack device (%d, %d) and is "
                   "exported there or, when the host can read it, to the "
                   "CPU (1, 0); not to (%ld, %ld)",
                   (int)dev.device_type, (int)dev.device_id, type, id);
      return NULL;
    }
  }
  /* copy: True always copies (the DLPack protocol), False never; None
   * never either: memory the host cannot read is not silently copied to
   * the CPU (a NumPy array that no longer aliases the memory). */
  int copy = 0;
  if (a[3] != NULL && a[3] != Py_None && (copy = PyObject_IsTrue(a[3])) < 0) {
    return NULL;
  }
  if (to_cpu && !mem->host_accessible && !copy) {
    PyErr_Format(PyExc_BufferError,
                 "%s memory of a %s device is not accessible from the host: "
                 "it reaches the CPU (dl_device=(1, 0)) only as a copy; pass "
                 "copy=True",
                 pyusmipc_kind_name(mem->kind),
                 usmipc_backend_name(mem->backend));
    return NULL;
  }
  DLDevice out = to_cpu ? (DLDevice){kDLCPU, 0} : dev;
  if (out.device_type == kDLCPU && a[0] != NULL && a[0] != Py_None) {
    PyErr_SetString(PyExc_BufferError,
                    "stream must be None for memory on the CPU");
    return NULL;
  }
  if (copy) {
    return out.device_type == kDLCPU ? dl_host_copy(mem, versioned)
                                     : dl_device_copy(mem, a);
  }
  if (pyusmipc_memory_begin(mem) < 0) {
    return NULL;
  }
  /* Only mappings opened with a device-side wait need synchronization. */
  if ((mem->order_handle != NULL || mem->order_event != NULL) &&
      out.device_type != kDLCPU &&
      dlpack_sync(mem, a[0], out.device_type) < 0) {
    (void)pyusmipc_memory_end(mem);
    return NULL;
  }
  dl_context_t *ctx = malloc(sizeof(*ctx));
  if (ctx == NULL) {
    (void)pyusmipc_memory_end(mem);
    return PyErr_NoMemory();
  }
  memset(ctx, 0, sizeof(*ctx));
  dl_fill(ctx, versioned, mem->ptr, out, mem->nbytes);

  PyObject *capsule;
  Py_INCREF(self); /* owned by the tensor until its deleter runs */
  if (versioned) {
    DLManagedTensorVersioned *m = &ctx->managed.versioned;
    m->version.major = 1;
    m->version.minor = 0;
    m->manager_ctx = self;
    m->deleter = dl_deleter_versioned;
    m->flags = 0; /* writable, not a copy */
    capsule =
        PyCapsule_New(m, "dltensor_versioned", pyusmipc_dl_capsule_destructor);
    if (capsule == NULL) {
      m->deleter(m);
    }
  } else {
    DLManagedTensor *m = &ctx->managed.unversioned;
    m->manager_ctx = self;
    m->deleter = dl_deleter;
    capsule = PyCapsule_New(m, "dltensor", pyusmipc_dl_capsule_destructor);
    if (capsule == NULL) {
      m->deleter(m);
    }
  }
  return capsule;
}

/* ---- __cuda_array_interface__ -------------------------------------------- */

PyObject *pyusmipc_memory_cuda_array_interface(PyObject *self, void *closure) {
  (void)closure;
  pyusmipc_memory_object_t *mem = (pyusmipc_memory_object_t *)self;
  if (mem->backend != USMIPC_BACKEND_CUDA) {
    PyErr_Format(PyExc_AttributeError,
                 "__cuda_array_interface__ describes CUDA memory only; this "
                 "memory is on the %s backend (use the buffer protocol or "
                 "__dlpack__)",
                 usmipc_backend_name(mem->backend));
    return NULL;
  }
  if (mem->closed || mem->released) {
    pyusmipc_value_error("mapping is closed");
    return NULL;
  }
  /* stream None: no synchronization is needed (see __dlpack__). */
  return Py_BuildValue("{s(n)sss[(ss)]s(NO)sOsisO}", "shape", mem->nbytes,
                       "typestr", "|u1", "descr", "", "|u1", "data",
                       PyLong_FromVoidPtr(mem->ptr), Py_False, "strides",
                       Py_None, "version", 3, "stream", Py_None);
}

/* ---- reading another library's __cuda_array_interface__ ------------------ */

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

int pyusmipc_cuda_array_range(PyObject *obj, void **ptr, Py_ssize_t *nbytes) {
  PyObject *cai = pyusmipc_optional_attr(obj, "__cuda_array_interface__");
  if (cai == NULL) {
    return PyErr_Occurred() ? -1 : 0;
  }
  PyObject *data = NULL, *shape = NULL, *typestr = NULL, *strides = NULL;
  int rc = -1;
  if (!PyDict_Check(cai)) {
    pyusmipc_type_error("__cuda_array_interface__ is not a dict");
    goto done;
  }
  if (dict_item(cai, "data", &data) <= 0 ||
      dict_item(cai, "shape", &shape) <= 0 ||
      dict_item(cai, "typestr", &typestr) <= 0 ||
      dict_item(cai, "strides", &strides) < 0) {
    if (!PyErr_Occurred()) {
      pyusmipc_value_error(
          "__cuda_array_interface__ lacks data, shape or typestr");
    }
    goto done;
  }
  if (!PyTuple_Check(data) || PyTuple_Size(data) < 1 || !PyTuple_Check(shape) ||
      !PyUnicode_Check(typestr)) {
    pyusmipc_value_error(
        "__cuda_array_interface__ is malformed (data must be a "
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
    pyusmipc_value_error("__cuda_array_interface__ typestr %R has no item size",
                         typestr);
    goto done;
  }
  Py_ssize_t ndim = PyTuple_Size(shape);
  Py_ssize_t count = 1;
  for (Py_ssize_t i = 0; i < ndim; i++) {
    Py_ssize_t n = PyLong_AsSsize_t(PyTuple_GetItem(shape, i));
    if (n < 0) {
      if (!PyErr_Occurred()) {
        pyusmipc_value_error("negative extent in shape");
      }
      goto done;
    }
    if (__builtin_mul_overflow(count, n, &count)) {
      pyusmipc_value_error("__cuda_array_interface__ shape has more elements "
                           "than a Py_ssize_t counts");
      goto done;
    }
  }
  if (count > PY_SSIZE_T_MAX / itemsize) {
    pyusmipc_value_error("__cuda_array_interface__ describes more bytes than a "
                         "Py_ssize_t counts");
    goto done;
  }
  /* Only a C-contiguous array is one byte range. */
  if (strides != NULL && strides != Py_None) {
    if (!PyTuple_Check(strides) || PyTuple_Size(strides) != ndim) {
      pyusmipc_value_error(
          "__cuda_array_interface__ strides do not match shape");
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
        pyusmipc_value_error(
            "only C-contiguous arrays can be exported: make the "
            "array contiguous first");
        goto done;
      }
      /* At most count * itemsize (checked above) unless count is 0, which
       * is refused below. */
      if (__builtin_mul_overflow(expect, extent, &expect)) {
        break;
      }
    }
  }
  if (count == 0) {
    pyusmipc_value_error("cannot export an empty array");
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

/* ---- reading another library's __dlpack__ -------------------------------- */

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
      pyusmipc_type_error("__dlpack__ returned %R, not a DLPack capsule "
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
    pyusmipc_value_error("the DLPack tensor has a bad shape (ndim %d)",
                         (int)t->ndim);
    return -1;
  }
  uint64_t bits = (uint64_t)t->dtype.bits * t->dtype.lanes;
  if (bits == 0) {
    pyusmipc_value_error("the DLPack tensor's element type has no size");
    return -1;
  }
  uint64_t count = 1;
  for (int32_t i = 0; i < t->ndim; i++) {
    if (t->shape[i] < 0) {
      pyusmipc_value_error("the DLPack tensor has a negative extent");
      return -1;
    }
    uint64_t extent = (uint64_t)t->shape[i];
    if (extent != 0 && count > (uint64_t)PY_SSIZE_T_MAX / extent) {
      pyusmipc_value_error("the DLPack tensor is too large");
      return -1;
    }
    count *= extent;
  }
  if (count == 0) {
    pyusmipc_value_error("cannot export an empty array");
    return -1;
  }
  /* Strides count elements, not bytes; NULL means C-contiguous. An extent
   * of 1 may have any stride (torch gives such dimensions odd ones). */
  if (t->strides != NULL) {
    int64_t expect = 1;
    for (int32_t i = t->ndim - 1; i >= 0; i--) {
      if (t->shape[i] > 1 && t->strides[i] != expect) {
        pyusmipc_value_error(
            "IPCMemoryHandle needs contiguous memory: the DLPack "
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
      pyusmipc_value_error("the DLPack tensor is too large");
      return -1;
    }
    nbytes = count * itemsize;
  } else {
    if (count > ((uint64_t)PY_SSIZE_T_MAX - 7) / bits) {
      pyusmipc_value_error("the DLPack tensor is too large");
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
    pyusmipc_kind_error(
        "IPCMemoryHandle() exports device memory only; this DLPack "
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
      pyusmipc_kind_error(
          "IPCMemoryHandle() exports device memory only; this "
          "DLPack tensor is ordinary CPU memory (device type 1), "
          "not usmipc device memory: copy it into shareable memory "
          "with usmipc.memory.host_array(array) (or into a "
          "MemoryUSMDevice) to share it");
      return -1;
    }
    if (info.kind != USMIPC_MEM_DEVICE) {
      pyusmipc_kind_error("IPCMemoryHandle() exports device memory only; this "
                          "DLPack tensor is usmipc memory of kind '%s'",
                          pyusmipc_kind_name(info.kind));
      return -1;
    }
    return 0;
  }
  pyusmipc_kind_error(
      "IPCMemoryHandle() exports CUDA and oneAPI device memory "
      "from DLPack tensors; this one is on DLPack device type %d",
      (int)type);
  return -1;
}

int pyusmipc_dlpack_read(PyObject *obj, void *tensor, uint64_t *flags,
                         PyObject **owner) {
  *owner = NULL;
  PyObject *method = pyusmipc_optional_attr(obj, "__dlpack__");
  if (method == NULL) {
    return PyErr_Occurred() ? -1 : 0;
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

int pyusmipc_dlpack_range(PyObject *obj, void **ptr, Py_ssize_t *nbytes,
                          PyObject **owner) {
  DLTensor t;
  uint64_t flags;
  PyObject *tensor_owner;
  *owner = NULL;
  int found = pyusmipc_dlpack_read(obj, &t, &flags, &tensor_owner);
  if (found <= 0) {
    return found;
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

/* ---- __sycl_usm_array_interface__ -----------------------------------------
 *
 * dpctl's protocol for USM arrays (its docs: "__sycl_usm_array_interface__
 * attribute"): data (address, read-only flag), shape, typestr (NumPy's, of
 * a bool or number type), strides in elements (None: C-contiguous), offset
 * in elements, version 1, and syclobj, from which the memory's context is
 * found. usmipc's memory gives its Queue as syclobj; reading, usmipc takes a
 * usmipc.Queue, a usmipc.Device or a filter string, and checks with the
 * library that the pointer is memory of that device (dpctl checks the
 * pointer against the context the same way). */

PyObject *pyusmipc_memory_suai(PyObject *self, void *closure) {
  (void)closure;
  pyusmipc_memory_object_t *mem = (pyusmipc_memory_object_t *)self;
  PyObject *queue = pyusmipc_memory_queue_object(mem); /* borrowed */
  if (queue == NULL) {
    return NULL;
  }
  /* A closed mapping: no memory, as dpctl's MemoryIPCDevice after
   * SyclIPCCloseMemHandle (and hasattr() still answers). */
  int gone = mem->is_mapping && (mem->closed || mem->released);
  return Py_BuildValue(
      "{s(NO)s(n)sOsssisO}", "data", PyLong_FromVoidPtr(gone ? NULL : mem->ptr),
      Py_False, "shape", gone ? (Py_ssize_t)0 : mem->nbytes, "strides", Py_None,
      "typestr", "|u1", "version", 1, "syclobj", queue);
}

/* An int of the interface (shape, strides, offset, data[0]): -1 with
 * ArgumentError when it is not an int or does not fit. */
static int suai_int(PyObject *v, const char *field, long long *out) {
  if (!PyLong_Check(v) && !PyIndex_Check(v)) {
    pyusmipc_value_error("__sycl_usm_array_interface__ is malformed: %s holds "
                         "%R, not an int",
                         field, (PyObject *)Py_TYPE(v));
    return -1;
  }
  PyObject *index = PyNumber_Index(v);
  if (index == NULL) {
    return -1;
  }
  int overflow = 0;
  *out = PyLong_AsLongLongAndOverflow(index, &overflow);
  Py_DECREF(index);
  if (*out == -1 && PyErr_Occurred()) {
    return -1;
  }
  if (overflow != 0) {
    pyusmipc_value_error("__sycl_usm_array_interface__ is malformed: %s is out "
                         "of range",
                         field);
    return -1;
  }
  return 0;
}

/* The size of a typestr's item ("<f4": 4), or -1 with ArgumentError: a
 * byte order, a bool or number kind, a size (dpctl accepts bool, int,
 * uint, float and complex types). */
static Py_ssize_t suai_itemsize(PyObject *typestr) {
  const char *ts =
      PyUnicode_Check(typestr) ? PyUnicode_AsUTF8AndSize(typestr, NULL) : NULL;
  if (ts == NULL) {
    if (PyErr_Occurred() && !PyErr_ExceptionMatches(PyExc_UnicodeError)) {
      return -1;
    }
    PyErr_Clear();
    pyusmipc_value_error("__sycl_usm_array_interface__ is malformed: typestr "
                         "%R is not a str such as '|u1' or '<f4'",
                         typestr);
    return -1;
  }
  char *end = NULL;
  long size = strlen(ts) >= 3 ? strtol(ts + 2, &end, 10) : 0;
  if (strchr("<>|=", ts[0]) == NULL || ts[0] == '\0' ||
      strchr("biufc", ts[1]) == NULL || ts[1] == '\0' || size <= 0 ||
      size > 64 || end == NULL || *end != '\0') {
    pyusmipc_value_error("__sycl_usm_array_interface__ is malformed: typestr "
                         "'%s' is not a bool or number type such as '|u1' or "
                         "'<f4'",
                         ts);
    return -1;
  }
  return (Py_ssize_t)size;
}

/* The lowest and highest element of the array, in elements from data[0]
 * (dpctl's _pointers_from_shape_and_stride, without its one-element
 * answer for an empty array: there is no memory to take). 0 or -1. */
static int suai_extent(PyObject *shape, PyObject *strides, long long offset,
                       long long *low, long long *high) {
  if (!PyTuple_Check(shape) && !PyList_Check(shape)) {
    pyusmipc_value_error("__sycl_usm_array_interface__ is malformed: shape is "
                         "a %R, not a tuple of ints",
                         (PyObject *)Py_TYPE(shape));
    return -1;
  }
  PyObject *sh = PySequence_Tuple(shape);
  if (sh == NULL) {
    return -1;
  }
  PyObject *sd = NULL;
  Py_ssize_t nd = PyTuple_Size(sh);
  int rc = -1;
  if (strides != Py_None) {
    if (PyTuple_Check(strides) || PyList_Check(strides)) {
      sd = PySequence_Tuple(strides);
      if (sd == NULL) {
        goto done;
      }
    }
    if (sd == NULL || PyTuple_Size(sd) != nd) {
      pyusmipc_value_error("__sycl_usm_array_interface__ is malformed: strides "
                           "must be None or a tuple as long as shape (%zd)",
                           nd);
      goto done;
    }
  }
  *low = *high = offset;
  /* Each extent is read once: a second read through __index__ could give
   * another value than the one checked. */
  long long count = 1;
  for (Py_ssize_t i = 0; i < nd; i++) {
    long long n, step = 0;
    if (suai_int(PyTuple_GetItem(sh, i), "shape", &n) < 0 ||
        (sd != NULL &&
         suai_int(PyTuple_GetItem(sd, i), "strides", &step) < 0)) {
      goto done;
    }
    if (n < 0) {
      pyusmipc_value_error("__sycl_usm_array_interface__ is malformed: shape "
                           "has the negative extent %lld",
                           n);
      goto done;
    }
    if (n == 0) {
      pyusmipc_value_error("the array has no element: there is no memory to "
                           "take");
      goto done;
    }
    if (sd == NULL) { /* C-contiguous: counted */
      if (__builtin_mul_overflow(count, n, &count)) {
        pyusmipc_value_error("__sycl_usm_array_interface__ is malformed: "
                             "shape overflows");
        goto done;
      }
      continue;
    }
    long long span;
    if (__builtin_mul_overflow(step, n - 1, &span) ||
        __builtin_add_overflow(span > 0 ? *high : *low, span,
                               span > 0 ? high : low)) {
      pyusmipc_value_error("__sycl_usm_array_interface__ is malformed: strides "
                           "and shape overflow");
      goto done;
    }
  }
  if (sd == NULL && __builtin_add_overflow(offset, count - 1, high)) {
    pyusmipc_value_error("__sycl_usm_array_interface__ is malformed: "
                         "offset and shape overflow");
    goto done;
  }
  rc = 0;
done:
  Py_DECREF(sh);
  Py_XDECREF(sd);
  return rc;
}

/* The Device (and Queue) that syclobj names: a usmipc.Queue, Device or
 * filter string. Another runtime's object (dpctl's SyclQueue or
 * SyclContext, a capsule) names memory usmipc's drivers did not allocate
 * in their contexts. 0 or -1. */
static int suai_syclobj(pyusmipc_module_state_t *st, PyObject *syclobj,
                        const char *what, PyObject **device, PyObject **queue) {
  *device = *queue = NULL;
  if (syclobj == NULL || syclobj == Py_None) {
    pyusmipc_value_error("%s: __sycl_usm_array_interface__ has no syclobj: "
                         "the device of the memory is unknown",
                         what);
    return -1;
  }
  if (!PyObject_TypeCheck(syclobj, st->QueueType) &&
      !PyObject_TypeCheck(syclobj, st->DeviceType) &&
      !PyUnicode_Check(syclobj)) {
    pyusmipc_value_error(
        "%s: the interface's syclobj is a %R, not a usmipc.Queue, "
        "usmipc.Device or filter string: memory of another SYCL runtime "
        "(dpctl) belongs to a context usmipc does not use; copy it into "
        "usmipc memory (copy_from_host) or share it with IPCMemoryHandle",
        what, (PyObject *)Py_TYPE(syclobj));
    return -1;
  }
  *device = pyusmipc_device_from_arg(st, syclobj);
  if (*device == NULL) {
    return -1;
  }
  if (PyObject_TypeCheck(syclobj, st->QueueType)) {
    *queue = Py_NewRef(syclobj);
  }
  return 0;
}

int pyusmipc_suai_read(pyusmipc_module_state_t *st, PyObject *obj,
                       const char *what, pyusmipc_suai_t *out) {
  memset(out, 0, sizeof(*out));
  PyObject *iface = pyusmipc_optional_attr(obj, "__sycl_usm_array_interface__");
  if (iface == NULL) {
    return PyErr_Occurred() ? -1 : 0;
  }
  PyObject *data = NULL, *shape = NULL, *typestr = NULL, *strides = NULL,
           *offset_obj = NULL, *version = NULL, *syclobj = NULL;
  int rc = -1;
  if (!PyDict_Check(iface)) {
    pyusmipc_value_error("%s: %R does not expose __sycl_usm_array_interface__ "
                         "correctly: it is a %R, not a dict",
                         what, (PyObject *)Py_TYPE(obj),
                         (PyObject *)Py_TYPE(iface));
    goto done;
  }
  if (dict_item(iface, "data", &data) < 0 ||
      dict_item(iface, "shape", &shape) < 0 ||
      dict_item(iface, "typestr", &typestr) < 0 ||
      dict_item(iface, "strides", &strides) < 0 ||
      dict_item(iface, "offset", &offset_obj) < 0 ||
      dict_item(iface, "version", &version) < 0 ||
      dict_item(iface, "syclobj", &syclobj) < 0) {
    goto done;
  }
  long long v = 0;
  if (version == NULL || suai_int(version, "version", &v) < 0 || v != 1) {
    PyErr_Clear();
    pyusmipc_value_error("%s: __sycl_usm_array_interface__ is malformed: "
                         "version %R is unexpected; the only recognized "
                         "version is 1",
                         what, version ? version : Py_None);
    goto done;
  }
  if (data == NULL || !PyTuple_Check(data) || PyTuple_Size(data) != 2) {
    pyusmipc_value_error("%s: __sycl_usm_array_interface__ is malformed: "
                         "'data' is required, a tuple (usm_pointer, "
                         "is_read_only)",
                         what);
    goto done;
  }
  long long address;
  if (suai_int(PyTuple_GetItem(data, 0), "data[0]", &address) < 0) {
    goto done;
  }
  int readonly = PyObject_IsTrue(PyTuple_GetItem(data, 1));
  if (readonly < 0) {
    goto done;
  }
  if (shape == NULL || typestr == NULL) {
    pyusmipc_value_error("%s: __sycl_usm_array_interface__ is malformed: "
                         "'shape' and 'typestr' are required",
                         what);
    goto done;
  }
  Py_ssize_t itemsize = suai_itemsize(typestr);
  long long offset = 0, low, high;
  if (itemsize < 0 ||
      (offset_obj != NULL && offset_obj != Py_None &&
       suai_int(offset_obj, "offset", &offset) < 0) ||
      suai_extent(shape, strides ? strides : Py_None, offset, &low, &high) <
          0) {
    goto done;
  }
  long long first, span;
  if (__builtin_mul_overflow(low, (long long)itemsize, &first) ||
      __builtin_mul_overflow(high - low + 1, (long long)itemsize, &span) ||
      span > PY_SSIZE_T_MAX) {
    pyusmipc_value_error("%s: __sycl_usm_array_interface__ is malformed: the "
                         "array is too large",
                         what);
    goto done;
  }
  if (suai_syclobj(st, syclobj, what, &out->device, &out->queue) < 0) {
    goto done;
  }
  char *ptr = (char *)(uintptr_t)(unsigned long long)address + first;
  usmipc_device_t *device = ((pyusmipc_device_object_t *)out->device)->device;
  usmipc_pointer_info_t info;
  int q;
  Py_BEGIN_ALLOW_THREADS
  q = usmipc_pointer_query(ptr, &info);
  Py_END_ALLOW_THREADS
  if (q < 0 || info.device != device) {
    pyusmipc_value_error(
        "%s: __sycl_usm_array_interface__ is malformed: the pointer %p is "
        "not memory of %s as its syclobj says (%s)",
        what, (void *)ptr, usmipc_device_filter_string(device),
        q < 0 ? "usmipc does not know it"
              : usmipc_device_filter_string(info.device));
    goto done;
  }
  if ((uintptr_t)ptr + (uintptr_t)span >
      (uintptr_t)info.base + (uintptr_t)info.size) {
    pyusmipc_value_error("%s: the array's %lld bytes at %p pass the end of "
                         "its allocation (%zu bytes at %p)",
                         what, span, (void *)ptr, info.size, info.base);
    goto done;
  }
  out->ptr = ptr;
  out->nbytes = (Py_ssize_t)span;
  out->kind = info.kind;
  out->readonly = readonly;
  rc = 1;

done:
  if (rc < 0) {
    Py_CLEAR(out->device);
    Py_CLEAR(out->queue);
  }
  Py_XDECREF(data);
  Py_XDECREF(shape);
  Py_XDECREF(typestr);
  Py_XDECREF(strides);
  Py_XDECREF(offset_obj);
  Py_XDECREF(version);
  Py_XDECREF(syclobj);
  Py_DECREF(iface);
  return rc;
}
