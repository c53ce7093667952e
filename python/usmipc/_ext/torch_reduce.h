/* Floor 8 of the extension usmipc._usmipc (torch_reduce.c): usmipc.torch's
 * per-tensor step in C. */
#ifndef PYUSMIPC_TORCH_REDUCE_H
#define PYUSMIPC_TORCH_REDUCE_H

#include "util.h"

/* The type _TorchMessage, added to module. */
int pyusmipc_init_torch_message_type(PyObject *module);
/* _torch_setup(config), _torch_push(message), _torch_pop(),
 * _torch_reduce_tensor(tensor), for module.c's table. */
PyObject *pyusmipc_torch_setup(PyObject *module, PyObject *config);
PyObject *pyusmipc_torch_push(PyObject *module, PyObject *msg);
PyObject *pyusmipc_torch_pop(PyObject *module, PyObject *ignored);
PyObject *pyusmipc_torch_reduce_tensor(PyObject *module, PyObject *tensor);
/* _torch_lone(tensor, put_event, protocol): the pickle of a message of one
 * tensor, or None where usmipc.torch's _lone_message decides. */
PyObject *pyusmipc_torch_lone(PyObject *module, PyObject *const *args,
                              Py_ssize_t nargs);

/* Adds the stats() counts made here since the last call to the counts
 * dict of _torch_setup: 0, or -1 with an exception. */
int pyusmipc_torch_reduce_fold_counts(void);

#endif /* PYUSMIPC_TORCH_REDUCE_H */
