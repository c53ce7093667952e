/* Floor 7 of the extension usmipc._usmipc (shared_array.c): bundles, the
 * consumer's side (open_shared(), SharedArray, close_shared(),
 * release_shared()). */
#ifndef PYUSMIPC_SHARED_ARRAY_H
#define PYUSMIPC_SHARED_ARRAY_H

#include "util.h"

/* The type SharedArray. */
int pyusmipc_init_shared_array_type(PyObject *module,
                                    pyusmipc_module_state_t *st);
/* usmipc.open_shared, close_shared and release_shared, for module.c's
 * table. */
PyObject *pyusmipc_open_shared(PyObject *module, PyObject *const *args,
                               Py_ssize_t nargs, PyObject *kwnames);
PyObject *pyusmipc_close_shared(PyObject *module, PyObject *const *args,
                                Py_ssize_t nargs, PyObject *kwnames);
PyObject *pyusmipc_forward_shared(PyObject *module, PyObject *obj);
PyObject *pyusmipc_return_tickets_at_exit(PyObject *module,
                                          PyObject *Py_UNUSED(ignored));
PyObject *pyusmipc_release_shared(PyObject *module, PyObject *const *args,
                                  Py_ssize_t nargs, PyObject *kwnames);

#endif /* PYUSMIPC_SHARED_ARRAY_H */
