/* Floor 8 of the extension usmipc._usmipc (torch_rebuild.c): usmipc.torch's
 * per-tensor step on the receiver, in C. */
#ifndef PYUSMIPC_TORCH_REBUILD_H
#define PYUSMIPC_TORCH_REBUILD_H

#include "util.h"

/* _torch_rebuild_setup(config), _torch_rebuild(at, cls, size, stride,
 * offset, dtype, requires_grad) and _torch_storage_or_live(leaf, origin),
 * for module.c's table. */
PyObject *pyusmipc_torch_rebuild_setup(PyObject *module, PyObject *config);
PyObject *pyusmipc_torch_rebuild(PyObject *module, PyObject *const *args,
                                 Py_ssize_t nargs);
PyObject *pyusmipc_torch_storage_or_live(PyObject *module,
                                         PyObject *const *args,
                                         Py_ssize_t nargs);

/* Adds the stats() counts made here since the last call to the counts
 * dict of _torch_rebuild_setup: 0, or -1 with an exception. */
int pyusmipc_torch_rebuild_fold_counts(void);

#endif /* PYUSMIPC_TORCH_REBUILD_H */
