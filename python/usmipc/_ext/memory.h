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

#endif /* PYUSMIPC_MEMORY_H */
