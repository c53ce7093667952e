/* The backends usmipc knows, in probe order. Adding a backend means adding
 * its ops table here; nothing else in the core changes.
 *
 * Floor 3 of the core (backends): above the three backends it lists. */
#include "backend/backend.h"

const usmipc__backend_ops_t *const usmipc__backends[] = {
    &usmipc__host_backend,
    &usmipc__cuda_backend,
    &usmipc__level_zero_backend,
};
const size_t usmipc__backend_count =
    sizeof(usmipc__backends) / sizeof(usmipc__backends[0]);
