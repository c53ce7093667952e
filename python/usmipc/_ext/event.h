/* Floor 4 of the extension usmipc._usmipc (event.c): usmipc.Event and
 * usmipc.IPCEventHandle. */
#ifndef PYUSMIPC_EVENT_H
#define PYUSMIPC_EVENT_H

#include "util.h"

typedef struct pyusmipc_event_object {
  PyObject_HEAD usmipc_event_t *event;
  PyObject *device; /* usmipc.Device */
  char opened;      /* opened from a handle: waits only, cannot record */
} pyusmipc_event_object_t;

int pyusmipc_init_event_types(PyObject *module, pyusmipc_module_state_t *st);
/* usmipc.set_event_timeout(seconds) (module.c's method table). */
PyObject *pyusmipc_set_event_timeout(PyObject *module, PyObject *arg);

#endif /* PYUSMIPC_EVENT_H */
