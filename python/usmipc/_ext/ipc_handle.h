/* Floor 7 of the extension usmipc._usmipc (ipc_handle.c):
 * usmipc.memory.IPCMemoryHandle. */
#ifndef PYUSMIPC_IPC_HANDLE_H
#define PYUSMIPC_IPC_HANDLE_H

#include "util.h"

int pyusmipc_init_ipc_handle_type(PyObject *module,
                                  pyusmipc_module_state_t *st);
/* usmipc.set_ipc_cache_size(entries), which
 * IPCMemoryHandle.set_cache_size(entries) is too. */
PyObject *pyusmipc_set_ipc_cache_size(pyusmipc_module_state_t *st,
                                      PyObject *arg);

#endif /* PYUSMIPC_IPC_HANDLE_H */
