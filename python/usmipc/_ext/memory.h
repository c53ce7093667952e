/* Floor 6 of the extension usmipc._usmipc (memory.c): the memory types of
 * usmipc.memory, and the mappings IPCMemoryHandle.open returns. */
#ifndef PYUSMIPC_MEMORY_H
#define PYUSMIPC_MEMORY_H

#include "memory_core.h"

int pyusmipc_init_memory_types(PyObject *module, pyusmipc_module_state_t *st);
/* Wraps an open IPC mapping in a new MemoryIPCDevice (steals nothing; on
 * failure the caller still owns the mapping). */
PyObject *pyusmipc_mapping_new(pyusmipc_module_state_t *st,
                               PyObject *device_obj, void *ptr, size_t nbytes);
/* Closes a MemoryIPCDevice (idempotent); the unmap waits for the last
 * buffer export. Returns 0, or -1 with an exception set. */
int pyusmipc_mapping_close(pyusmipc_module_state_t *st,
                           pyusmipc_memory_object_t *mem);
/* Returns a mapping's release ticket, if it has one not returned yet, after
 * the work submitted to queue (NULL: now). A producer that no longer waits
 * (gone, or its handle freed) is not an error. 0, or -1 with an exception
 * set. */
int pyusmipc_mapping_release(pyusmipc_module_state_t *st,
                             pyusmipc_memory_object_t *m,
                             usmipc_queue_t *queue);
/* Lists a mapping whose release_handle was just set, so that its ticket
 * goes back as the process exits if nothing returned it before. */
void pyusmipc_mapping_ticket_list(pyusmipc_memory_object_t *m);
/* Returns the ticket of every listed mapping now, from the host (the
 * process is ending: _return_tickets_at_exit). How many; errors are
 * dropped (the producer then keeps the memory until it exits). */
long pyusmipc_mapping_tickets_return_all(pyusmipc_module_state_t *st);

#endif /* PYUSMIPC_MEMORY_H */
