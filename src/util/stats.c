/* Counters of what IPC costs this process, so that a caller (or a test) can
 * see that a second share of the same buffers moved no descriptor and asked
 * no driver for an export or an import. Relaxed atomics: each counter is
 * exact, a snapshot of all of them is not a single instant.
 *
 * Floor 1 of the core (util). */
#include <string.h>

#include "util/util.h"

usmipc__stats_t usmipc__stats;

int usmipc_get_stats(usmipc_stats_t *out, size_t size) {
  if (out == NULL || size == 0)
    return usmipc__fail(USMIPC_EINVAL, "usmipc_get_stats: NULL or empty");
  usmipc_stats_t s = {
      .driver_exports = USMIPC__STAT_GET(driver_exports),
      .driver_imports = USMIPC__STAT_GET(driver_imports),
      .driver_queries = USMIPC__STAT_GET(driver_queries),
      .descriptors_sent = USMIPC__STAT_GET(descriptors_sent),
      .descriptors_received = USMIPC__STAT_GET(descriptors_received),
      .transport_exchanges = USMIPC__STAT_GET(transport_exchanges),
      .event_records = USMIPC__STAT_GET(event_records),
      .event_waits = USMIPC__STAT_GET(event_waits),
  };
  /* A caller built against an older, shorter struct gets its prefix. */
  memset(out, 0, size);
  memcpy(out, &s, size < sizeof(s) ? size : sizeof(s));
  return 0;
}

void usmipc_reset_stats(void) {
  __atomic_store_n(&usmipc__stats.driver_exports, 0, __ATOMIC_RELAXED);
  __atomic_store_n(&usmipc__stats.driver_imports, 0, __ATOMIC_RELAXED);
  __atomic_store_n(&usmipc__stats.driver_queries, 0, __ATOMIC_RELAXED);
  __atomic_store_n(&usmipc__stats.descriptors_sent, 0, __ATOMIC_RELAXED);
  __atomic_store_n(&usmipc__stats.descriptors_received, 0, __ATOMIC_RELAXED);
  __atomic_store_n(&usmipc__stats.transport_exchanges, 0, __ATOMIC_RELAXED);
  __atomic_store_n(&usmipc__stats.event_records, 0, __ATOMIC_RELAXED);
  __atomic_store_n(&usmipc__stats.event_waits, 0, __ATOMIC_RELAXED);
}
