/* usmipc.Queue: orders copies and fills on one device (a CUDA stream, a
 * Level Zero command list; on the host backend operations complete at once).
 * A Queue holds a reference to its Device. */
#include "ext.h"

PyObject *usmipc_queue_new(usmipc_module_state_t *st, PyObject *device_obj) {
  if (st->QueueType == NULL) {
    return usmipc_state_cleared();
  }
  allocfunc alloc = (allocfunc)PyType_GetSlot(st->QueueType, Py_tp_alloc);
  usmipc_queue_object_t *self =
      (usmipc_queue_object_t *)alloc(st->QueueType, 0);
  if (self == NULL) {
    return NULL;
  }
  self->device = Py_NewRef(device_obj);
  usmipc_device_t *device = ((usmipc_device_object_t *)device_obj)->device;
  usmipc_queue_t *queue = NULL;
  int rc;
  Py_BEGIN_ALLOW_THREADS
  rc = usmipc_queue_create(device, &queue);
  Py_END_ALLOW_THREADS
  if (rc < 0) {
    usmipc_raise(st, rc);
    Py_DECREF(self);
    return NULL;
  }
  self->queue = queue;
  return (PyObject *)self;
}

static PyObject *queue_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
  static char *kwlist[] = {"device", "sycl_device", NULL};
  PyObject *arg = NULL, *alias = NULL;
  if (!PyArg_ParseTupleAndKeywords(args, kwds, "|O$O:Queue", kwlist, &arg,
                                   &alias)) {
    return NULL;
  }
  if (arg != NULL && alias != NULL) {
    PyErr_SetString(PyExc_TypeError,
                    "Queue() takes device or sycl_device, not both");
    return NULL;
  }
  usmipc_module_state_t *st = usmipc_state_from_type(type);
  if (st == NULL) {
    return NULL;
  }
  PyObject *device_obj = usmipc_device_from_arg(st, arg ? arg : alias);
  if (device_obj == NULL) {
    return NULL;
  }
  PyObject *queue = usmipc_queue_new(st, device_obj);
  Py_DECREF(device_obj);
  return queue;
}

static int queue_traverse(PyObject *self, visitproc visit, void *arg) {
  Py_VISIT(Py_TYPE(self));
  Py_VISIT(((usmipc_queue_object_t *)self)->device);
  return 0;
}

static int queue_clear(PyObject *self) {
  Py_CLEAR(((usmipc_queue_object_t *)self)->device);
  return 0;
}

static void queue_dealloc(PyObject *op) {
  usmipc_queue_object_t *self = (usmipc_queue_object_t *)op;
  PyTypeObject *tp = Py_TYPE(op);
  PyObject_GC_UnTrack(op);
  if (self->queue != NULL) {
    usmipc_queue_t *queue = self->queue;
    self->queue = NULL;
    Py_BEGIN_ALLOW_THREADS
    usmipc_queue_destroy(queue);
    Py_END_ALLOW_THREADS
  }
  queue_clear(op);
  freefunc tp_free = (freefunc)PyType_GetSlot(tp, Py_tp_free);
  tp_free(op);
  Py_DECREF(tp);
}

static PyObject *queue_get_device(PyObject *self, void *closure) {
  (void)closure;
  PyObject *device = ((usmipc_queue_object_t *)self)->device;
  if (device == NULL) {
    Py_RETURN_NONE;
  }
  return Py_NewRef(device);
}

static PyObject *queue_synchronize(PyObject *op, PyObject *Py_UNUSED(ignored)) {
  usmipc_queue_object_t *self = (usmipc_queue_object_t *)op;
  if (self->queue == NULL || self->device == NULL) {
    PyErr_SetString(PyExc_ValueError, "queue is not initialized");
    return NULL;
  }
  int rc;
  Py_BEGIN_ALLOW_THREADS
  rc = usmipc_queue_synchronize(self->queue);
  Py_END_ALLOW_THREADS
  if (rc < 0) {
    return usmipc_raise(usmipc_state_from_device(self->device), rc);
  }
  Py_RETURN_NONE;
}

static PyObject *queue_repr(PyObject *op) {
  usmipc_queue_object_t *self = (usmipc_queue_object_t *)op;
  if (self->device == NULL) {
    return PyUnicode_FromString("<usmipc.Queue (cleared)>");
  }
  return PyUnicode_FromFormat(
      "<usmipc.Queue on [%s] at %p>",
      usmipc_device_filter_string(
          ((usmipc_device_object_t *)self->device)->device),
      (void *)self);
}

static PyGetSetDef queue_getset[] = {
    {"device", queue_get_device, NULL, "The queue's Device.", NULL},
    {"sycl_device", queue_get_device, NULL, "Alias of device (dpctl's name).",
     NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMethodDef queue_methods[] = {
    {"synchronize", queue_synchronize, METH_NOARGS,
     "synchronize()\n\nWaits until every operation on the queue has "
     "completed."},
    {"wait", queue_synchronize, METH_NOARGS, "Alias of synchronize()."},
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
    .basicsize = sizeof(usmipc_queue_object_t),
    .itemsize = 0,
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = queue_slots,
};

int usmipc_init_queue_type(PyObject *module, usmipc_module_state_t *st) {
  st->QueueType =
      (PyTypeObject *)PyType_FromModuleAndSpec(module, &queue_spec, NULL);
  if (st->QueueType == NULL) {
    return -1;
  }
  return PyModule_AddType(module, st->QueueType);
}
