/* Floor 7 of the extension usmipc._usmipc (update.c): updates, the
 * consumer's one call over the C library's copy plans. */
#ifndef PYUSMIPC_UPDATE_H
#define PYUSMIPC_UPDATE_H

#include "util.h"

/* The type _CopyPlan. */
int pyusmipc_init_copy_plan_type(PyObject *module, pyusmipc_module_state_t *st);
/* _copy_plan(device, dests, pin) and _bundle_paths(data), for module.c's
 * table. */
PyObject *pyusmipc_copy_plan(PyObject *module, PyObject *const *args,
                             Py_ssize_t nargs);
PyObject *pyusmipc_bundle_paths(PyObject *module, PyObject *arg);

#endif /* PYUSMIPC_UPDATE_H */
