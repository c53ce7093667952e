/* Floor 2 of the extension: usmipc.Device, one device of one backend
 * ("host:cpu:0", "cuda:gpu:1"), and the per-device cache of Device and
 * default Queue objects. Calls util.c only (module.c lists the floors).
 *
 * usmipc devices live as long as the process, so the module keeps one
 * Device object per device and Device(filter) returns it: equal devices are
 * the same object, and memory objects can reach the module state through
 * their device (the type is final). */
#include "device.h"

#include <string.h>

#include "util.h"

#define DEV(o) (((pyusmipc_device_object_t *)(o))->device)

/* ---- the per-device cache ------------------------------------------------ */

pyusmipc_device_slot_t *pyusmipc_device_slot(pyusmipc_module_state_t *st,
                                             usmipc_device_t *device) {
  for (Py_ssize_t i = 0; i < st->nslots; i++) {
    if (st->slots[i].device == device) {
      return &st->slots[i];
    }
  }
  return NULL;
}

PyObject *pyusmipc_device_object(pyusmipc_module_state_t *st,
                                 usmipc_device_t *device) {
  pyusmipc_device_slot_t *slot = pyusmipc_device_slot(st, device);
  if (slot != NULL) {
    return Py_NewRef(slot->device_obj);
  }
  if (st->DeviceType == NULL) {
    return pyusmipc_state_cleared();
  }
  if (st->nslots == st->slots_capacity) {
    Py_ssize_t capacity = st->slots_capacity ? st->slots_capacity * 2 : 8;
    pyusmipc_device_slot_t *slots =
        PyMem_Realloc(st->slots, (size_t)capacity * sizeof(*slots));
    if (slots == NULL) {
      return PyErr_NoMemory();
    }
    st->slots = slots;
    st->slots_capacity = capacity;
  }
  PyObject *obj = pyusmipc_object_alloc(st->DeviceType);
  if (obj == NULL) {
    return NULL;
  }
  ((pyusmipc_device_object_t *)obj)->device = device;
  slot = &st->slots[st->nslots++];
  slot->device = device;
  slot->device_obj = Py_NewRef(obj);
  slot->queue_obj = NULL;
  slot->has_events = -1;
  return obj;
}

int pyusmipc_device_has_events(pyusmipc_module_state_t *st,
                               PyObject *device_obj) {
  usmipc_device_t *device = ((pyusmipc_device_object_t *)device_obj)->device;
  pyusmipc_device_slot_t *slot = pyusmipc_device_slot(st, device);
  if (slot != NULL && slot->has_events >= 0) {
    return slot->has_events;
  }
  usmipc_event_t *event = NULL;
  int rc;
  Py_BEGIN_ALLOW_THREADS
  rc = usmipc_event_create(device, 0, &event);
  if (rc == 0) {
    usmipc_event_destroy(event);
  }
  Py_END_ALLOW_THREADS
  if (rc < 0 && rc != USMIPC_ENOTSUP) {
    pyusmipc_raise(st, rc);
    return -1;
  }
  int has = rc == 0;
  slot =
      pyusmipc_device_slot(st, device); /* the GIL was released: look again */
  if (slot != NULL) {
    slot->has_events = (signed char)has;
  }
  return has;
}

/* ---- the device a handle names ------------------------------------------- */

int pyusmipc_list_devices(pyusmipc_module_state_t *st,
                          usmipc_device_t *devices[PYUSMIPC_MAX_DEVICES],
                          size_t *count) {
  *count = 0;
  int rc = usmipc_get_devices(devices, PYUSMIPC_MAX_DEVICES, count);
  if (rc < 0) {
    pyusmipc_raise(st, rc);
    return -1;
  }
  if (*count > PYUSMIPC_MAX_DEVICES) {
    *count = PYUSMIPC_MAX_DEVICES;
  }
  return 0;
}

PyObject *pyusmipc_device_of_info(pyusmipc_module_state_t *st,
                                  const usmipc_ipc_handle_info_t *info) {
  usmipc_device_t *devices[PYUSMIPC_MAX_DEVICES];
  size_t count;
  if (pyusmipc_list_devices(st, devices, &count) < 0) {
    return NULL;
  }
  for (size_t i = 0; i < count; i++) {
    uint8_t uuid[16];
    usmipc_device_uuid(devices[i], uuid);
    if (usmipc_device_backend(devices[i]) == info->backend &&
        memcmp(uuid, info->device_uuid, 16) == 0) {
      return pyusmipc_device_object(st, devices[i]);
    }
  }
  Py_RETURN_NONE;
}

/* ---- Device objects from arguments, and the type ------------------------- */

PyObject *pyusmipc_device_from_arg(pyusmipc_module_state_t *st, PyObject *arg) {
  const char *filter = NULL;
  if (arg != NULL && arg != Py_None) {
    if (Py_IS_TYPE(arg, st->DeviceType)) {
      return Py_NewRef(arg);
    }
    if (PyObject_TypeCheck(arg, st->QueueType)) {
      return Py_NewRef(((pyusmipc_queue_object_t *)arg)->device);
    }
    if (!PyUnicode_Check(arg)) {
      pyusmipc_type_error(
          "expected a usmipc.Device, a usmipc.Queue, a filter string "
          "such as 'host:cpu' or None, not %R",
          (PyObject *)Py_TYPE(arg));
      return NULL;
    }
    Py_ssize_t len;
    filter = PyUnicode_AsUTF8AndSize(arg, &len);
    if (filter == NULL) {
      return NULL;
    }
    if ((Py_ssize_t)strlen(filter) != len) {
      pyusmipc_value_error("filter string contains a NUL byte");
      return NULL;
    }
  }
  usmipc_device_t *device = NULL;
  int rc = usmipc_device_select(filter, &device);
  if (rc < 0) {
    return pyusmipc_raise_as(st, st->DeviceCreationError, rc);
  }
  return pyusmipc_device_object(st, device);
}

int pyusmipc_optional_device_arg(pyusmipc_module_state_t *st, PyObject *arg,
                                 PyObject **device_obj,
                                 usmipc_device_t **device) {
  *device_obj = NULL;
  if (device != NULL) {
    *device = NULL;
  }
  if (arg == NULL || arg == Py_None) {
    return 0;
  }
  *device_obj = pyusmipc_device_from_arg(st, arg);
  if (*device_obj == NULL) {
    return -1;
  }
  if (device != NULL) {
    *device = DEV(*device_obj);
  }
  return 0;
}

static PyObject *device_new(PyTypeObject *type, PyObject *args,
                            PyObject *kwds) {
  static char *kwlist[] = {"filter", NULL};
  PyObject *arg = NULL;
  if (!PyArg_ParseTupleAndKeywords(args, kwds, "|O:Device", kwlist, &arg)) {
    pyusmipc_retype_parse_error();
    return NULL;
  }
  pyusmipc_module_state_t *st = pyusmipc_state_from_type(type);
  if (st == NULL) {
    return NULL;
  }
  return pyusmipc_device_from_arg(st, arg);
}

static void device_dealloc(PyObject *self) { pyusmipc_object_free(self); }

static PyObject *device_get_name(PyObject *self, void *closure) {
  (void)closure;
  const char *name = usmipc_device_name(DEV(self));
  return PyUnicode_DecodeUTF8(name, (Py_ssize_t)strlen(name), "replace");
}

static PyObject *device_get_backend(PyObject *self, void *closure) {
  (void)closure;
  return PyUnicode_FromString(
      usmipc_backend_name(usmipc_device_backend(DEV(self))));
}

static const char *device_type_name(usmipc_device_type_t type) {
  switch (type) {
  case USMIPC_DEVICE_CPU:
    return "cpu";
  case USMIPC_DEVICE_GPU:
    return "gpu";
  }
  return "unknown";
}

static PyObject *device_get_device_type(PyObject *self, void *closure) {
  (void)closure;
  return PyUnicode_FromString(device_type_name(usmipc_device_type(DEV(self))));
}

static PyObject *device_get_uuid(PyObject *self, void *closure) {
  (void)closure;
  uint8_t uuid[16];
  usmipc_device_uuid(DEV(self), uuid);
  return PyBytes_FromStringAndSize((const char *)uuid, 16);
}

static PyObject *device_get_filter_string(PyObject *self, void *closure) {
  (void)closure;
  return PyUnicode_FromString(usmipc_device_filter_string(DEV(self)));
}

static PyObject *device_get_index(PyObject *self, void *closure) {
  (void)closure;
  return PyLong_FromLong(usmipc_device_index(DEV(self)));
}

static PyObject *device_get_has_ipc(PyObject *self, void *closure) {
  (void)closure;
  return PyBool_FromLong(usmipc_device_has_ipc(DEV(self)));
}

static PyObject *device_get_filter_string_method(PyObject *self,
                                                 PyObject *Py_UNUSED(ignored)) {
  return device_get_filter_string(self, NULL);
}

static PyObject *device_reduce(PyObject *self, PyObject *Py_UNUSED(ignored)) {
  return Py_BuildValue("(O(s))", (PyObject *)Py_TYPE(self),
                       usmipc_device_filter_string(DEV(self)));
}

static PyObject *device_repr(PyObject *self) {
  return PyUnicode_FromFormat("<usmipc.Device [%s] '%s'>",
                              usmipc_device_filter_string(DEV(self)),
                              usmipc_device_name(DEV(self)));
}

static PyObject *device_richcompare(PyObject *self, PyObject *other, int op) {
  if ((op != Py_EQ && op != Py_NE) || !Py_IS_TYPE(other, Py_TYPE(self))) {
    Py_RETURN_NOTIMPLEMENTED;
  }
  int equal = strcmp(usmipc_device_filter_string(DEV(self)),
                     usmipc_device_filter_string(DEV(other))) == 0;
  return PyBool_FromLong(op == Py_EQ ? equal : !equal);
}

static Py_hash_t device_hash(PyObject *self) {
  PyObject *filter = device_get_filter_string(self, NULL);
  if (filter == NULL) {
    return -1;
  }
  Py_hash_t h = PyObject_Hash(filter);
  Py_DECREF(filter);
  return h;
}

static usmipc_device_t *dev_of(PyObject *self) {
  return ((pyusmipc_device_object_t *)self)->device;
}

static PyObject *device_get_is_gpu(PyObject *self, void *closure) {
  (void)closure;
  return PyBool_FromLong(usmipc_device_type(dev_of(self)) == USMIPC_DEVICE_GPU);
}

static PyObject *device_get_is_cpu(PyObject *self, void *closure) {
  (void)closure;
  return PyBool_FromLong(usmipc_device_type(dev_of(self)) == USMIPC_DEVICE_CPU);
}

/* The maker of the driver's devices (dpctl's vendor): the backend tells. */
static const char *vendor_of(usmipc_device_t *d) {
  switch (usmipc_device_backend(d)) {
  case USMIPC_BACKEND_CUDA:
    return "NVIDIA Corporation";
  case USMIPC_BACKEND_LEVEL_ZERO:
    return "Intel(R) Corporation";
  default:
    return "usmipc (host memory)";
  }
}

static PyObject *device_get_vendor(PyObject *self, void *closure) {
  (void)closure;
  return PyUnicode_FromString(vendor_of(dev_of(self)));
}

/* What the driver says now (usmipc_device_get_info): 0, or -1 with the
 * exception set. */
static int device_info(PyObject *self, usmipc_device_info_t *info) {
  usmipc_device_t *d = dev_of(self);
  int rc;
  Py_BEGIN_ALLOW_THREADS
  rc = usmipc_device_get_info(d, info, sizeof(*info));
  Py_END_ALLOW_THREADS
  if (rc < 0) {
    pyusmipc_raise(pyusmipc_state_from_device(self), rc);
    return -1;
  }
  return 0;
}

static PyObject *device_get_driver_version(PyObject *self, void *closure) {
  (void)closure;
  usmipc_device_info_t info;
  if (device_info(self, &info) < 0)
    return NULL;
  return PyUnicode_DecodeUTF8(
      info.driver_version, (Py_ssize_t)strlen(info.driver_version), "replace");
}

static PyObject *device_get_global_mem_size(PyObject *self, void *closure) {
  (void)closure;
  usmipc_device_info_t info;
  if (device_info(self, &info) < 0)
    return NULL;
  return PyLong_FromUnsignedLongLong(info.global_mem_size);
}

static PyObject *device_get_max_mem_alloc_size(PyObject *self, void *closure) {
  (void)closure;
  usmipc_device_info_t info;
  if (device_info(self, &info) < 0)
    return NULL;
  return PyLong_FromUnsignedLongLong(info.max_mem_alloc_size);
}

static PyObject *device_print_info(PyObject *self, PyObject *Py_UNUSED(x)) {
  usmipc_device_t *d = dev_of(self);
  usmipc_device_info_t info;
  if (device_info(self, &info) < 0)
    return NULL;
  PyObject *name = PyObject_GetAttrString(self, "name");
  if (name == NULL)
    return NULL;
  /* Sizes in MiB as well as bytes: what a reader compares at a glance. */
  PyObject *text = PyUnicode_FromFormat(
      "    Name            %U\n"
      "    Vendor          %s\n"
      "    Driver version  %s\n"
      "    Backend         %s\n"
      "    Device type     %s\n"
      "    Filter string   %s\n"
      "    Global memory   %llu bytes (%llu MiB)\n"
      "    Max allocation  %llu bytes (%llu MiB)\n"
      "    IPC memory      %s\n",
      name, vendor_of(d), info.driver_version,
      usmipc_backend_name(usmipc_device_backend(d)),
      usmipc_device_type(d) == USMIPC_DEVICE_GPU ? "gpu" : "cpu",
      usmipc_device_filter_string(d), (unsigned long long)info.global_mem_size,
      (unsigned long long)(info.global_mem_size >> 20),
      (unsigned long long)info.max_mem_alloc_size,
      (unsigned long long)(info.max_mem_alloc_size >> 20),
      usmipc_device_has_ipc(d) ? "supported" : "not supported");
  Py_DECREF(name);
  if (text == NULL)
    return NULL;
  PyObject *builtins = PyImport_ImportModule("builtins");
  PyObject *r =
      builtins ? PyObject_CallMethod(builtins, "print", "Os", text, "") : NULL;
  Py_XDECREF(builtins);
  Py_DECREF(text);
  if (r == NULL)
    return NULL;
  Py_DECREF(r);
  Py_RETURN_NONE;
}

static PyGetSetDef device_getset[] = {
    {"vendor", device_get_vendor, NULL,
     "The maker of the device's driver ('NVIDIA Corporation', ...).", NULL},
    {"driver_version", device_get_driver_version, NULL,
     "The driver's version as SYCL prints it: 'CUDA 12.4', Level Zero's\n"
     "'major.minor.build', the kernel release for the host.",
     NULL},
    {"global_mem_size", device_get_global_mem_size, NULL,
     "The device's memory in bytes (the host: physical RAM).", NULL},
    {"max_mem_alloc_size", device_get_max_mem_alloc_size, NULL,
     "The largest single allocation the driver accepts, in bytes.", NULL},
    {"has_aspect_gpu", device_get_is_gpu, NULL, "True for a GPU.", NULL},
    {"has_aspect_cpu", device_get_is_cpu, NULL, "True for the host device.",
     NULL},
    {"name", device_get_name, NULL, "The device's name.", NULL},
    {"backend", device_get_backend, NULL,
     "The backend: 'host', 'cuda' or 'level_zero'.", NULL},
    {"device_type", device_get_device_type, NULL, "'cpu' or 'gpu'.", NULL},
    {"uuid", device_get_uuid, NULL, "The device's UUID (16 bytes).", NULL},
    {"filter_string", device_get_filter_string, NULL,
     "The canonical filter string, 'backend:type:index'.", NULL},
    {"index", device_get_index, NULL,
     "Index among the devices of the same backend and type.", NULL},
    {"has_aspect_ipc_memory", device_get_has_ipc, NULL,
     "True if memory of this device can be shared with IPCMemoryHandle.", NULL},
    {"has_aspect_ext_oneapi_ipc_memory", device_get_has_ipc, NULL,
     "Alias of has_aspect_ipc_memory (the SYCL aspect's name).", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMethodDef device_methods[] = {
    {"get_filter_string", device_get_filter_string_method, METH_NOARGS,
     "get_filter_string() -> str: the canonical filter string."},
    {"__reduce__", device_reduce, METH_NOARGS, NULL},
    {"print_device_info", device_print_info, METH_NOARGS,
     "print_device_info()\n--\n\nPrints the device's name, vendor, "
     "driver version, backend, type, filter string, memory, largest "
     "allocation and IPC support (dpctl's method)."},
    {NULL, NULL, 0, NULL},
};

PyDoc_STRVAR(device_doc,
             "Device(filter=None)\n--\n\n"
             "A device selected by a filter string 'backend[:type[:index]]'\n"
             "('host:cpu', 'cuda:gpu:1', 'level_zero', 'gpu'). None or '' "
             "selects\n"
             "the default device: the first GPU, else the host. Raises "
             "ValueError\n"
             "for a malformed filter.");

static PyType_Slot device_slots[] = {
    {Py_tp_doc, (void *)device_doc},
    {Py_tp_new, device_new},
    {Py_tp_dealloc, device_dealloc},
    {Py_tp_repr, device_repr},
    {Py_tp_richcompare, device_richcompare},
    {Py_tp_hash, device_hash},
    {Py_tp_getset, device_getset},
    {Py_tp_methods, device_methods},
    {0, NULL},
};

static PyType_Spec device_spec = {
    .name = "usmipc.Device",
    .basicsize = sizeof(pyusmipc_device_object_t),
    .itemsize = 0,
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = device_slots,
};

int pyusmipc_init_device_type(PyObject *module, pyusmipc_module_state_t *st) {
  st->DeviceType =
      (PyTypeObject *)PyType_FromModuleAndSpec(module, &device_spec, NULL);
  if (st->DeviceType == NULL) {
    return -1;
  }
  return PyModule_AddType(module, st->DeviceType);
}
