/* Floor 3 of the extension: usmipc.Queue, which orders copies and fills on
 * one device (a CUDA stream, a Level Zero command list; on the host backend
 * operations complete at once), each device's default queue, and the
 * resolver of every stream= argument. Calls device.c and util.c (module.c
 * lists the floors). A Queue holds a reference to its Device.
 *
 * Queue.from_stream wraps another library's stream (usmipc_queue_from_native:
 * the wrapper does not own it) and holds the Python object that owns the
 * stream, so the stream lives at least as long as the wrapper. The same
 * resolver, pyusmipc_queue_from_stream, reads every stream= argument of the
 * package. It never imports torch or CuPy: their streams are recognized by
 * the module of their type, and read through their attributes. */
#include "queue.h"

#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "device.h"
#include "util.h"

/* A new Queue object on device_obj, its usmipc queue still to be set; NULL
 * with an exception set. */
static pyusmipc_queue_object_t *queue_alloc(pyusmipc_module_state_t *st,
                                            PyObject *device_obj) {
  if (st->QueueType == NULL) {
    pyusmipc_state_cleared();
    return NULL;
  }
  pyusmipc_queue_object_t *self =
      (pyusmipc_queue_object_t *)pyusmipc_object_alloc(st->QueueType);
  if (self != NULL) {
    self->device = Py_NewRef(device_obj);
  }
  return self;
}

PyObject *pyusmipc_queue_new(pyusmipc_module_state_t *st,
                             PyObject *device_obj) {
  pyusmipc_queue_object_t *self = queue_alloc(st, device_obj);
  if (self == NULL) {
    return NULL;
  }
  usmipc_device_t *device = ((pyusmipc_device_object_t *)device_obj)->device;
  usmipc_queue_t *queue = NULL;
  int rc;
  Py_BEGIN_ALLOW_THREADS
  rc = usmipc_queue_create(device, &queue);
  Py_END_ALLOW_THREADS
  if (rc < 0) {
    pyusmipc_raise(st, rc);
    Py_DECREF(self);
    return NULL;
  }
  self->queue = queue;
  return (PyObject *)self;
}

PyObject *pyusmipc_default_queue(pyusmipc_module_state_t *st,
                                 PyObject *device_obj) {
  usmipc_device_t *device = ((pyusmipc_device_object_t *)device_obj)->device;
  pyusmipc_device_slot_t *slot = pyusmipc_device_slot(st, device);
  if (slot != NULL && slot->queue_obj != NULL) {
    return Py_NewRef(slot->queue_obj);
  }
  PyObject *queue = pyusmipc_queue_new(st, device_obj);
  if (queue == NULL) {
    return NULL;
  }
  /* Creating the queue ran Python code at most through allocation, but the
   * slot array may have grown: look the slot up again. */
  slot = pyusmipc_device_slot(st, device);
  if (slot != NULL && slot->queue_obj == NULL) {
    slot->queue_obj = Py_NewRef(queue);
  }
  return queue;
}

static PyObject *queue_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
  static char *kwlist[] = {"device", "sycl_device", NULL};
  PyObject *arg = NULL, *alias = NULL;
  if (!PyArg_ParseTupleAndKeywords(args, kwds, "|O$O:Queue", kwlist, &arg,
                                   &alias)) {
    pyusmipc_retype_parse_error();
    return NULL;
  }
  if (arg != NULL && alias != NULL) {
    pyusmipc_type_error("Queue() takes device or sycl_device, not both");
    return NULL;
  }
  pyusmipc_module_state_t *st = pyusmipc_state_from_type(type);
  if (st == NULL) {
    return NULL;
  }
  PyObject *device_obj = pyusmipc_device_from_arg(st, arg ? arg : alias);
  if (device_obj == NULL) {
    return NULL;
  }
  PyObject *queue = pyusmipc_queue_new(st, device_obj);
  Py_DECREF(device_obj);
  return queue;
}

static int queue_traverse(PyObject *self, visitproc visit, void *arg) {
  Py_VISIT(Py_TYPE(self));
  Py_VISIT(((pyusmipc_queue_object_t *)self)->device);
  Py_VISIT(((pyusmipc_queue_object_t *)self)->stream);
  return 0;
}

/* The stream object is not dropped here: the native queue must outlive the
 * wrapper, which only dealloc destroys (a stream in a cycle with its
 * wrapper is released after it). */
static int queue_clear(PyObject *self) {
  Py_CLEAR(((pyusmipc_queue_object_t *)self)->device);
  return 0;
}

static void queue_dealloc(PyObject *op) {
  pyusmipc_queue_object_t *self = (pyusmipc_queue_object_t *)op;
  PyObject_GC_UnTrack(op);
  PYUSMIPC_DESTROY_WITHOUT_GIL(usmipc_queue_t, self->queue,
                               usmipc_queue_destroy);
  queue_clear(op);
  Py_CLEAR(self->stream); /* after the wrapper is gone */
  pyusmipc_object_free(op);
}

/* ---- wrapping other libraries' streams ----------------------------------- */

PyObject *pyusmipc_queue_wrap(pyusmipc_module_state_t *st, PyObject *device_obj,
                              void *native, PyObject *keep, const char *what) {
  usmipc_device_t *device = ((pyusmipc_device_object_t *)device_obj)->device;
  if (usmipc_device_backend(device) == USMIPC_BACKEND_HOST && native != NULL) {
    return pyusmipc_raise_format(
        st, USMIPC_EINVAL,
        "%s: %s has no native streams (its work completes at once), so the "
        "only stream it accepts is 0, not %p; pass 0, None or a "
        "usmipc.Queue of that device",
        what, usmipc_device_filter_string(device), native);
  }
  pyusmipc_queue_object_t *self = queue_alloc(st, device_obj);
  if (self == NULL) {
    return NULL;
  }
  usmipc_queue_t *queue = NULL;
  int rc = usmipc_queue_from_native(device, native, &queue);
  if (rc < 0) {
    pyusmipc_raise(st, rc);
    Py_DECREF(self);
    return NULL;
  }
  self->queue = queue;
  self->stream = Py_XNewRef(keep);
  return (PyObject *)self;
}

int pyusmipc_type_module_is(PyObject *obj, const char *package) {
  PyObject *module =
      PyObject_GetAttrString((PyObject *)Py_TYPE(obj), "__module__");
  if (module == NULL) {
    PyErr_Clear();
    return 0;
  }
  int r = 0;
  if (PyUnicode_Check(module)) {
    const char *name = PyUnicode_AsUTF8AndSize(module, NULL);
    if (name == NULL) {
      PyErr_Clear();
    } else {
      size_t n = strlen(package);
      r = strncmp(name, package, n) == 0 && (name[n] == '\0' || name[n] == '.');
    }
  }
  Py_DECREF(module);
  return r;
}

/* The current stream of another library's array, for ordering its
 * handoffs: torch.cuda.current_stream(tensor.device) for a torch tensor,
 * cupy.cuda.get_current_stream() for a CuPy array (modules already
 * imported, since the array exists). New reference; Py_None for other
 * arrays; NULL with an exception set. */
PyObject *pyusmipc_foreign_current_stream(PyObject *obj) {
  if (pyusmipc_type_module_is(obj, "torch")) {
    PyObject *device = PyObject_GetAttrString(obj, "device");
    if (device == NULL) {
      return NULL;
    }
    PyObject *kind = PyObject_GetAttrString(device, "type");
    int is_cuda = kind != NULL && PyUnicode_Check(kind) &&
                  PyUnicode_CompareWithASCIIString(kind, "cuda") == 0;
    Py_XDECREF(kind);
    if (!is_cuda) {
      Py_DECREF(device);
      if (PyErr_Occurred()) {
        return NULL;
      }
      Py_RETURN_NONE;
    }
    PyObject *torch = PyImport_ImportModule("torch");
    PyObject *cuda = torch ? PyObject_GetAttrString(torch, "cuda") : NULL;
    PyObject *stream =
        cuda ? PyObject_CallMethod(cuda, "current_stream", "O", device) : NULL;
    Py_XDECREF(cuda);
    Py_XDECREF(torch);
    Py_DECREF(device);
    return stream;
  }
  if (pyusmipc_type_module_is(obj, "cupy")) {
    PyObject *cupy = PyImport_ImportModule("cupy");
    PyObject *cuda = cupy ? PyObject_GetAttrString(cupy, "cuda") : NULL;
    PyObject *get =
        cuda ? PyObject_GetAttrString(cuda, "get_current_stream") : NULL;
    Py_XDECREF(cuda);
    Py_XDECREF(cupy);
    if (get == NULL) {
      return NULL;
    }
    /* The array's device's current stream where CuPy takes a device id. */
    PyObject *stream = NULL;
    PyObject *device = PyObject_GetAttrString(obj, "device");
    PyObject *id = device ? PyObject_GetAttrString(device, "id") : NULL;
    Py_XDECREF(device);
    if (id != NULL) {
      stream = PyObject_CallFunctionObjArgs(get, id, NULL);
      Py_DECREF(id);
      if (stream == NULL && PyErr_ExceptionMatches(PyExc_TypeError)) {
        PyErr_Clear();
      }
    } else {
      PyErr_Clear();
    }
    if (stream == NULL && !PyErr_Occurred()) {
      stream = PyObject_CallNoArgs(get);
    }
    Py_DECREF(get);
    return stream;
  }
  Py_RETURN_NONE;
}

/* A native stream handle given as a Python int (never a bool). 0, or -1
 * with an exception set. */
static int native_from_int(PyObject *value, void **native, const char *what,
                           const char *source) {
  if (!PyLong_Check(value) || PyBool_Check(value)) {
    pyusmipc_type_error(
        "%s: %s must be an int (a native stream handle), not %R", what, source,
        (PyObject *)Py_TYPE(value));
    return -1;
  }
  int overflow = 0;
  long long v = PyLong_AsLongLongAndOverflow(value, &overflow);
  if (v == -1 && PyErr_Occurred()) {
    return -1;
  }
  if (overflow < 0 || (overflow == 0 && v < 0)) {
    pyusmipc_value_error(
        "%s: %s must be a non-negative int (a native stream handle; "
        "0 is the default stream), not %R",
        what, source, value);
    return -1;
  }
  unsigned long long u =
      overflow ? PyLong_AsUnsignedLongLong(value) : (unsigned long long)v;
  if (u == (unsigned long long)-1 && PyErr_Occurred()) {
    return -1;
  }
  if (u > (unsigned long long)UINTPTR_MAX) {
    pyusmipc_value_error("%s: %s %R does not fit in a pointer", what, source,
                         value);
    return -1;
  }
  *native = (void *)(uintptr_t)u;
  return 0;
}

/* The Device of a CUDA stream: device= if given, else cuda:gpu:<ordinal>
 * (ordinal >= 0: the stream names its GPU), else the operation's device,
 * else the first CUDA device. It must be a CUDA device. New reference. */
static PyObject *cuda_stream_device(pyusmipc_module_state_t *st, PyObject *obj,
                                    PyObject *device, long ordinal,
                                    PyObject *fallback, const char *what,
                                    const char *kind) {
  PyObject *dev = NULL;
  if (device != NULL) {
    dev = Py_NewRef(device);
  } else if (ordinal >= 0 || fallback == NULL) {
    char filter[40];
    if (ordinal >= 0) {
      snprintf(filter, sizeof(filter), "cuda:gpu:%ld", ordinal);
    } else {
      snprintf(filter, sizeof(filter), "cuda");
    }
    usmipc_device_t *d = NULL;
    int rc = usmipc_device_select(filter, &d);
    if (rc < 0) {
      char reason[384];
      snprintf(reason, sizeof(reason), "%s", usmipc_last_error());
      return pyusmipc_raise_format(
          st, rc,
          "%s: %R is a CUDA stream (%s), but this process has no CUDA "
          "device%s%s (%s); pass device= or use the stream in a process that "
          "sees its GPU",
          what, (PyObject *)Py_TYPE(obj), kind, ordinal >= 0 ? " " : "",
          ordinal >= 0 ? filter : "", reason);
    }
    dev = pyusmipc_device_object(st, d);
    if (dev == NULL) {
      return NULL;
    }
  } else {
    dev = Py_NewRef(fallback);
  }
  usmipc_device_t *d = ((pyusmipc_device_object_t *)dev)->device;
  if (usmipc_device_backend(d) != USMIPC_BACKEND_CUDA) {
    pyusmipc_raise_format(
        st, USMIPC_EWRONGDEVICE,
        "%s: %R is a CUDA stream (%s), but %s is not a CUDA device; give a "
        "stream of that device's backend (a usmipc.Queue, or 0 for the "
        "default stream), or a CUDA device",
        what, (PyObject *)Py_TYPE(obj), kind, usmipc_device_filter_string(d));
    Py_DECREF(dev);
    return NULL;
  }
  return dev;
}

/* An int attribute of obj as a long, -1 when absent or None. -2 with an
 * exception set on a bad value. */
static long ordinal_attr(PyObject *obj, const char *name) {
  PyObject *value = pyusmipc_optional_attr(obj, name);
  if (value == NULL) {
    return PyErr_Occurred() ? -2 : -1;
  }
  long r = -1;
  if (value != Py_None) {
    r = PyLong_AsLong(value);
    if (r == -1 && PyErr_Occurred()) {
      r = -2;
    } else if (r < 0) {
      r = -1;
    }
  }
  Py_DECREF(value);
  return r;
}

/* Wraps a CUDA stream handle read from a stream object. */
static PyObject *wrap_cuda(pyusmipc_module_state_t *st, PyObject *obj,
                           PyObject *handle, long ordinal, PyObject *device,
                           PyObject *fallback, const char *what,
                           const char *kind) {
  void *native;
  if (native_from_int(handle, &native, what, kind) < 0) {
    return NULL;
  }
  PyObject *dev =
      cuda_stream_device(st, obj, device, ordinal, fallback, what, kind);
  if (dev == NULL) {
    return NULL;
  }
  PyObject *queue = pyusmipc_queue_wrap(st, dev, native, obj, what);
  Py_DECREF(dev);
  return queue;
}

PyObject *pyusmipc_queue_from_stream(pyusmipc_module_state_t *st, PyObject *obj,
                                     PyObject *device, PyObject *fallback,
                                     const char *what) {
  if (PyObject_TypeCheck(obj, st->QueueType)) {
    PyObject *own = ((pyusmipc_queue_object_t *)obj)->device;
    if (device != NULL && own != device) {
      pyusmipc_value_error("%s: the queue is on %R but device %R was given",
                           what, own, device);
      return NULL;
    }
    return Py_NewRef(obj);
  }

  if (PyLong_Check(obj) && !PyBool_Check(obj)) {
    void *native;
    if (native_from_int(obj, &native, what, "stream") < 0) {
      return NULL;
    }
    PyObject *dev = device != NULL     ? Py_NewRef(device)
                    : fallback != NULL ? Py_NewRef(fallback)
                                       : pyusmipc_device_from_arg(st, NULL);
    if (dev == NULL) {
      return NULL;
    }
    PyObject *queue = pyusmipc_queue_wrap(st, dev, native, NULL, what);
    Py_DECREF(dev);
    return queue;
  }

  /* torch.cuda.Stream (and ExternalStream): .cuda_stream, .device.index */
  if (pyusmipc_type_module_is(obj, "torch")) {
    PyObject *handle = pyusmipc_optional_attr(obj, "cuda_stream");
    if (handle != NULL) {
      long ordinal = -1;
      PyObject *dev = pyusmipc_optional_attr(obj, "device");
      if (dev != NULL) {
        ordinal = ordinal_attr(dev, "index");
        Py_DECREF(dev);
      }
      PyObject *queue = ordinal == -2 || PyErr_Occurred()
                            ? NULL
                            : wrap_cuda(st, obj, handle, ordinal, device,
                                        fallback, what, "torch .cuda_stream");
      Py_DECREF(handle);
      return queue;
    }
    if (PyErr_Occurred()) {
      return NULL;
    }
  }

  /* cupy.cuda.Stream (and ExternalStream): .ptr, .device_id */
  if (pyusmipc_type_module_is(obj, "cupy") ||
      pyusmipc_type_module_is(obj, "cupy_backends")) {
    PyObject *handle = pyusmipc_optional_attr(obj, "ptr");
    if (handle != NULL) {
      long ordinal = ordinal_attr(obj, "device_id");
      PyObject *queue = ordinal == -2
                            ? NULL
                            : wrap_cuda(st, obj, handle, ordinal, device,
                                        fallback, what, "CuPy .ptr");
      Py_DECREF(handle);
      return queue;
    }
    if (PyErr_Occurred()) {
      return NULL;
    }
  }

  /* The CUDA stream protocol: __cuda_stream__() -> (version, handle). */
  PyObject *method = pyusmipc_optional_attr(obj, "__cuda_stream__");
  if (method != NULL) {
    PyObject *pair = PyCallable_Check(method) ? PyObject_CallNoArgs(method)
                                              : Py_NewRef(method);
    Py_DECREF(method);
    if (pair == NULL) {
      return NULL;
    }
    PyObject *queue = NULL;
    if (!PyTuple_Check(pair) || PyTuple_Size(pair) != 2) {
      pyusmipc_type_error(
          "%s: %R.__cuda_stream__() must return a tuple (version, "
          "handle), not %R",
          what, (PyObject *)Py_TYPE(obj), pair);
    } else {
      PyObject *version = PyTuple_GetItem(pair, 0);
      long v = PyLong_Check(version) ? PyLong_AsLong(version) : -1;
      if (v == -1 && PyErr_Occurred()) {
        PyErr_Clear();
      }
      if (v != 0) {
        pyusmipc_value_error("%s: %R.__cuda_stream__() gave version %R; usmipc "
                             "reads version 0 of the protocol",
                             what, (PyObject *)Py_TYPE(obj), version);
      } else {
        queue = wrap_cuda(st, obj, PyTuple_GetItem(pair, 1), -1, device,
                          fallback, what, "__cuda_stream__");
      }
    }
    Py_DECREF(pair);
    return queue;
  }
  if (PyErr_Occurred()) {
    return NULL;
  }

  pyusmipc_type_error(
      "%s: stream must be a usmipc.Queue, a torch.cuda.Stream, a "
      "CuPy stream, an object with __cuda_stream__, or an int (a "
      "native stream handle; 0 is the default stream), not %R",
      what, (PyObject *)Py_TYPE(obj));
  return NULL;
}

static PyObject *queue_from_stream(PyObject *cls, PyTypeObject *defining_class,
                                   PyObject *const *args, Py_ssize_t nargs,
                                   PyObject *kwnames) {
  (void)cls;
  static const char *const names[] = {"stream", "device"};
  PyObject *a[2];
  pyusmipc_module_state_t *st = PyType_GetModuleState(defining_class);
  if (pyusmipc_parse_fastcall("from_stream", args, nargs, kwnames, names, 2, 2,
                              a) < 0) {
    return NULL;
  }
  if (a[0] == NULL) {
    pyusmipc_type_error("from_stream() missing required argument 'stream'");
    return NULL;
  }
  PyObject *device;
  if (pyusmipc_optional_device_arg(st, a[1], &device, NULL) < 0) {
    return NULL;
  }
  PyObject *queue =
      pyusmipc_queue_from_stream(st, a[0], device, NULL, "Queue.from_stream()");
  Py_XDECREF(device);
  return queue;
}

static PyObject *queue_get_device(PyObject *self, void *closure) {
  (void)closure;
  PyObject *device = ((pyusmipc_queue_object_t *)self)->device;
  if (device == NULL) {
    Py_RETURN_NONE;
  }
  return Py_NewRef(device);
}

static PyObject *queue_synchronize(PyObject *op, PyObject *Py_UNUSED(ignored)) {
  pyusmipc_queue_object_t *self = (pyusmipc_queue_object_t *)op;
  if (self->queue == NULL || self->device == NULL) {
    pyusmipc_value_error("queue is not initialized");
    return NULL;
  }
  int rc;
  Py_BEGIN_ALLOW_THREADS
  rc = usmipc_queue_synchronize(self->queue);
  Py_END_ALLOW_THREADS
  if (rc < 0) {
    return pyusmipc_raise(pyusmipc_state_from_device(self->device), rc);
  }
  Py_RETURN_NONE;
}

static PyObject *queue_get_native(PyObject *op, void *closure) {
  (void)closure;
  pyusmipc_queue_object_t *self = (pyusmipc_queue_object_t *)op;
  if (self->queue == NULL) {
    pyusmipc_value_error("queue is not initialized");
    return NULL;
  }
  return PyLong_FromVoidPtr(usmipc_queue_native(self->queue));
}

static PyObject *queue_get_stream(PyObject *op, void *closure) {
  (void)closure;
  PyObject *stream = ((pyusmipc_queue_object_t *)op)->stream;
  return Py_NewRef(stream ? stream : Py_None);
}

static PyObject *queue_repr(PyObject *op) {
  pyusmipc_queue_object_t *self = (pyusmipc_queue_object_t *)op;
  if (self->device == NULL) {
    return PyUnicode_FromString("<usmipc.Queue (cleared)>");
  }
  const char *filter = usmipc_device_filter_string(
      ((pyusmipc_device_object_t *)self->device)->device);
  if (self->stream != NULL) {
    return PyUnicode_FromFormat("<usmipc.Queue on [%s] wrapping %R at %p>",
                                filter, self->stream, (void *)self);
  }
  return PyUnicode_FromFormat("<usmipc.Queue on [%s] at %p>", filter,
                              (void *)self);
}

static PyGetSetDef queue_getset[] = {
    {"device", queue_get_device, NULL, "The queue's Device.", NULL},
    {"sycl_device", queue_get_device, NULL, "Alias of device (dpctl's name).",
     NULL},
    {"native", queue_get_native, NULL,
     "The native queue as an int: a CUstream on CUDA (0: the legacy default "
     "stream),\na Level Zero command list; 0 on the host.",
     NULL},
    {"stream", queue_get_stream, NULL,
     "The stream object a Queue.from_stream() wrapper keeps alive (None for "
     "a\nqueue usmipc made, or one wrapping an int).",
     NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

PYUSMIPC_CLASSMETHOD(queue_from_stream_cls, queue_from_stream, QueueType)

static PyMethodDef queue_methods[] = {
    {"synchronize", queue_synchronize, METH_NOARGS,
     "synchronize()\n\nWaits until every operation on the queue has "
     "completed."},
    {"wait", queue_synchronize, METH_NOARGS, "Alias of synchronize()."},
    {"from_stream", PYUSMIPC_CMETHOD(queue_from_stream_cls),
     PYUSMIPC_CLASS_FLAGS,
     "from_stream($cls, /, stream, device=None)\n--\n\n"
     "A Queue over another library's stream, which it does not own (the "
     "Queue\nkeeps the stream object alive). stream: a usmipc.Queue "
     "(returned as is),\na torch.cuda.Stream, a CuPy stream, any object "
     "with __cuda_stream__\n(version 0), or an int, a native handle (a "
     "CUstream on CUDA; 0 is the\nlegacy default stream, 2 the per-thread "
     "one; on the host only 0). A CUDA\nstream object is put on the CUDA "
     "device of its ordinal (cuda:gpu:N), an int\non the default device, "
     "unless device= names another. Raises TypeError for\nother objects, "
     "ValueError for a stream the device cannot take (a CUDA\nstream on "
     "the host, a non-zero int on the host)."},
    {NULL, NULL, 0, NULL},
};

PyDoc_STRVAR(queue_doc, "Queue(device=None, *, sycl_device=None)\n--\n\n"
                        "A queue on device (a Device, a filter string, or "
                        "None for the\ndefault device).");

static PyType_Slot queue_slots[] = {
    {Py_tp_doc, (void *)queue_doc},
    {Py_tp_new, queue_new},
    {Py_tp_dealloc, queue_dealloc},
    {Py_tp_traverse, queue_traverse},
    {Py_tp_clear, queue_clear},
    {Py_tp_repr, queue_repr},
    {Py_tp_getset, queue_getset},
    {Py_tp_methods, queue_methods},
    {0, NULL},
};

static PyType_Spec queue_spec = {
    .name = "usmipc.Queue",
    .basicsize = sizeof(pyusmipc_queue_object_t),
    .itemsize = 0,
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = queue_slots,
};

int pyusmipc_init_queue_type(PyObject *module, pyusmipc_module_state_t *st) {
  st->QueueType =
      (PyTypeObject *)PyType_FromModuleAndSpec(module, &queue_spec, NULL);
  if (st->QueueType == NULL) {
    return -1;
  }
  return PyModule_AddType(module, st->QueueType);
}
