/* Floor 2 of the extension usmipc._usmipc (device.c): Device objects, the
 * per-device cache of Device and default Queue objects, and the device a
 * handle names. Above util.h only. */
#ifndef PYUSMIPC_DEVICE_H
#define PYUSMIPC_DEVICE_H

#include "util.h"

typedef struct pyusmipc_device_object {
  PyObject_HEAD usmipc_device_t *device;
} pyusmipc_device_object_t;

/* The layout of a Queue object (queue.c owns the type): here, one floor
 * below it, because Device(arg) also takes a Queue and reads its device. */
typedef struct pyusmipc_queue_object {
  PyObject_HEAD usmipc_queue_t *queue;
  PyObject *device; /* usmipc.Device */
  /* For a queue wrapping another library's stream (Queue.from_stream): the
   * Python object owning that stream, kept alive as long as the wrapper
   * (the wrapper does not own the native stream). NULL otherwise. */
  PyObject *stream;
} pyusmipc_queue_object_t;

int pyusmipc_init_device_type(PyObject *module, pyusmipc_module_state_t *st);

/* One entry per usmipc_device_t seen by this module: its Python Device
 * object (devices live as long as the process, so one object per device)
 * and the device's default Queue, created on first use. */
typedef struct pyusmipc_device_slot {
  usmipc_device_t *device;
  PyObject *device_obj;   /* strong: usmipc.Device */
  PyObject *queue_obj;    /* strong or NULL: usmipc.Queue, the default queue */
  signed char has_events; /* -1 not probed yet, else 0 or 1 */
} pyusmipc_device_slot_t;

/* The cache's entry of device, or NULL if no Device object was made for it
 * yet. The array may move when a Device object is made: look the entry up
 * again after anything that may run Python code. */
pyusmipc_device_slot_t *pyusmipc_device_slot(pyusmipc_module_state_t *st,
                                             usmipc_device_t *device);
/* The Device object for device (new reference). */
PyObject *pyusmipc_device_object(pyusmipc_module_state_t *st,
                                 usmipc_device_t *device);
/* 1 if the device's backend has events (so memory handles can be ordered),
 * 0 if not (USMIPC_ENOTSUP: a backend without events), -1 with an
 * exception set. Probed once per device with an event created and
 * destroyed. */
int pyusmipc_device_has_events(pyusmipc_module_state_t *st,
                               PyObject *device_obj);

/* The devices of every available backend, the first PYUSMIPC_MAX_DEVICES
 * of them, into devices: 0 with *count set, or -1 with the library's error
 * raised. */
#define PYUSMIPC_MAX_DEVICES 64
int pyusmipc_list_devices(pyusmipc_module_state_t *st,
                          usmipc_device_t *devices[PYUSMIPC_MAX_DEVICES],
                          size_t *count);
/* The Device object a handle's info names, if this process has it (new
 * reference); Py_None (new reference) if not; NULL with an exception. */
PyObject *pyusmipc_device_of_info(pyusmipc_module_state_t *st,
                                  const usmipc_ipc_handle_info_t *info);
/* The module state, reached through a Device object (its type is final and
 * was created by this module, so this never fails). */
static inline pyusmipc_module_state_t *
pyusmipc_state_from_device(PyObject *dev) {
  return (pyusmipc_module_state_t *)PyType_GetModuleState(Py_TYPE(dev));
}
/* Converts None (the default device), a Device, a Queue (its device) or a
 * filter string into a Device object (new reference). */
PyObject *pyusmipc_device_from_arg(pyusmipc_module_state_t *st, PyObject *arg);
/* The same for a device= whose None (or absence: arg NULL) means no device
 * given: 0 with *device_obj NULL, or a new reference (and *device, unless
 * device is NULL, its usmipc device); -1 with an exception set. */
int pyusmipc_optional_device_arg(pyusmipc_module_state_t *st, PyObject *arg,
                                 PyObject **device_obj,
                                 usmipc_device_t **device);

#endif /* PYUSMIPC_DEVICE_H */
