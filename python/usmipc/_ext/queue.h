/* Floor 3 of the extension usmipc._usmipc (queue.c): Queue objects, each
 * device's default queue, and the resolver of every stream= argument. The
 * Queue object's layout is device.h's. */
#ifndef PYUSMIPC_QUEUE_H
#define PYUSMIPC_QUEUE_H

#include "util.h"

int pyusmipc_init_queue_type(PyObject *module, pyusmipc_module_state_t *st);
/* The default Queue of a Device object, created on first use (new ref). */
PyObject *pyusmipc_default_queue(pyusmipc_module_state_t *st,
                                 PyObject *device_obj);
/* The stream another library's array is used on now, for ordering its
 * handoffs: torch.cuda.current_stream(tensor.device), CuPy's current
 * stream; Py_None for other arrays. New reference, or NULL. */
PyObject *pyusmipc_foreign_current_stream(PyObject *obj);
/* A new Queue on a Device object. */
PyObject *pyusmipc_queue_new(pyusmipc_module_state_t *st, PyObject *device_obj);
/* The one resolver behind every stream= argument and Queue.from_stream:
 * obj is a usmipc.Queue (returned as is), a torch.cuda.Stream, a CuPy
 * stream, an object with __cuda_stream__, or an int (a native stream
 * handle: a CUstream on CUDA, 0 the legacy default stream). device (a
 * Device object, or NULL) is the device= the caller gave: it overrides the
 * CUDA ordinal a stream object names. fallback (a Device object, or NULL)
 * is the device of the operation (the event, the memory), used for ints
 * and for stream objects that do not name their GPU. what names the
 * caller in messages ("Event.record()"). A new reference, or NULL with an
 * exception set. Imports nothing: torch and CuPy objects are recognized
 * by their type's module. */
PyObject *pyusmipc_queue_from_stream(pyusmipc_module_state_t *st, PyObject *obj,
                                     PyObject *device, PyObject *fallback,
                                     const char *what);
/* 1 if the module of obj's type is package or one of its submodules
 * ("torch" for torch.cuda.streams.Stream); never imports anything. */
int pyusmipc_type_module_is(PyObject *obj, const char *package);
/* A Queue wrapping the native stream handle native on device_obj, keeping
 * keep (or NULL) alive; ValueError for a non-zero handle on the host. */
PyObject *pyusmipc_queue_wrap(pyusmipc_module_state_t *st, PyObject *device_obj,
                              void *native, PyObject *keep, const char *what);

#endif /* PYUSMIPC_QUEUE_H */
