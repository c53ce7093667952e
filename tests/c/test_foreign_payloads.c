/* The payloads of foreign exports kept across exports
 * (src/core/foreign_payloads.c). The whole path, a torch caching-allocator
 * segment sent every round with one driver export, runs on a GPU
 * (tests/gpu/test_gpu_torch_reducers.py, test_repeated_sends_hit_the_caches);
 * here the cache itself: found only by the same buffer id, base, size and
 * device; a later payload of the same allocation replaces the earlier; at
 * most 4096 kept, the oldest dropped first, and what stays is found. */
#include <pthread.h>

#include "objects.h"
#include "task.h"

static usmipc__payload_t payload_of(uint64_t n) {
  usmipc__payload_t p = {0};
  p.len = 8;
  usmipc__put64le(p.bytes, n);
  return p;
}

TEST_IMPL(export_foreign_payloads_kept) {
  /* Fake devices and bases: the cache compares them, never follows them. */
  const usmipc_device_t *d0 = (const void *)0x1000, *d1 = (const void *)0x2000;
  const char *base = (const char *)0x7f0000000000;
  usmipc__payload_t got;
  pthread_mutex_lock(&usmipc__registry_lock);
  size_t before = usmipc__foreign_payloads_count();
  ASSERT_UEQ(before, 0);
  ASSERT_MSG(!usmipc__foreign_payload_find(7, base, 4096, d0, &got),
             "found in an empty cache");
  usmipc__payload_t p7 = payload_of(7);
  usmipc__foreign_payload_keep(7, base, 4096, d0, &p7);
  ASSERT_MSG(usmipc__foreign_payload_find(7, base, 4096, d0, &got) &&
                 got.len == 8 && usmipc__get64le(got.bytes) == 7,
             "the kept payload is not found");
  /* Another allocation at the same place, of another size, on another
   * device: each is not the one kept. */
  ASSERT_MSG(!usmipc__foreign_payload_find(8, base, 4096, d0, &got),
             "found by base alone");
  ASSERT_MSG(!usmipc__foreign_payload_find(7, base + 4096, 4096, d0, &got),
             "found at another base");
  ASSERT_MSG(!usmipc__foreign_payload_find(7, base, 8192, d0, &got),
             "found with another size");
  ASSERT_MSG(!usmipc__foreign_payload_find(7, base, 4096, d1, &got),
             "found on another device");
  /* Kept again: replaced, not added. */
  usmipc__payload_t p70 = payload_of(70);
  usmipc__foreign_payload_keep(7, base, 4096, d0, &p70);
  ASSERT_UEQ(usmipc__foreign_payloads_count(), 1);
  ASSERT_MSG(usmipc__foreign_payload_find(7, base, 4096, d0, &got) &&
                 usmipc__get64le(got.bytes) == 70,
             "not replaced");
  /* 5000 more: the count stops at 4096, the oldest (7 and the first 904 of
   * the new ones) are gone, the newest 4096 are found. */
  for (uint64_t id = 100; id < 5100; id++) {
    usmipc__payload_t p = payload_of(id);
    usmipc__foreign_payload_keep(id, base + id * 4096, 4096, d0, &p);
  }
  ASSERT_UEQ(usmipc__foreign_payloads_count(), 4096);
  ASSERT_MSG(!usmipc__foreign_payload_find(7, base, 4096, d0, &got),
             "the oldest was not dropped");
  for (uint64_t id = 100; id < 5100; id++) {
    bool found =
        usmipc__foreign_payload_find(id, base + id * 4096, 4096, d0, &got);
    ASSERT_MSG(found == (id >= 5100 - 4096),
               "buffer id %llu: found %d, kept %d", (unsigned long long)id,
               found, id >= 5100 - 4096);
    if (found)
      ASSERT_UEQ(usmipc__get64le(got.bytes), id);
  }
  pthread_mutex_unlock(&usmipc__registry_lock);
  return 0;
}
