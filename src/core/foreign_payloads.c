/* The driver payloads of memory another library allocated (a torch
 * caching-allocator segment), kept after their export is gone.
 *
 * Core floor, under export.c, which alone calls it, with
 * usmipc__registry_lock held.
 *
 * Why. A foreign export lives only as long as the handles and bundles that
 * hold it (export.c: the library cannot see the memory freed, so a
 * lingering export-table slot would let old handle bytes open whatever the
 * owner put there later). A weight-update loop sends the same segments every
 * step, and its sender drops each step's bundle once the tickets are back:
 * every step asked the driver again (cuIpcGetMemHandle per segment; 8 per
 * step for 64 tensors of 256 KiB, H100, run 49). The driver's payload of an
 * allocation does not change while the allocation lives, and the driver's
 * buffer id never names another allocation in this process, so the payload
 * is kept here by (buffer id, base, size, device) and the next export of
 * that allocation takes it instead of asking the driver. The slot and token
 * are still new: old bytes stay refused.
 *
 * What is kept holds nothing: a payload is bytes (a legacy CUDA IPC handle),
 * no descriptor, no mapping, no reference on the memory. Exports made of
 * descriptors (CUDA VMM chunks) are not kept: their descriptors would pin
 * the physical memory after its owner released it. At most
 * FOREIGN_PAYLOADS_MAX are kept; the oldest goes first. An entry of an
 * allocation since freed is never matched again (its buffer id is not
 * reused) and ages out.
 *
 * fork(): the child inherits the entries, under the registry lock like the
 * rest of the registry. They are the parent's driver state, which a child
 * cannot use (CUDA does not survive fork), and no allocation of the child
 * can have their buffer ids matched with base, size and device, so no reset
 * is needed. */
#include <stdlib.h>
#include <string.h>

#include "core/core.h"

#define FOREIGN_PAYLOADS_MAX 4096u
#define FOREIGN_PAYLOAD_BUCKETS 4096u /* a power of two */

typedef struct foreign_payload {
  uint64_t buffer_id;
  const void *base;
  size_t size;
  const usmipc_device_t *device;
  usmipc__payload_t payload;
  uint32_t next; /* in its bucket's chain, UINT32_MAX at the end */
} foreign_payload_t;

/* The entries in order of arrival, a ring (the oldest at `oldest` once
 * full), and a chained hash on the buffer id over them. */
static foreign_payload_t *entries;
static uint32_t count, oldest;
static uint32_t buckets[FOREIGN_PAYLOAD_BUCKETS];

static uint32_t bucket_of(uint64_t buffer_id) {
  uint64_t h = buffer_id * 0x9E3779B97F4A7C15ull; /* Fibonacci hashing */
  return (uint32_t)(h >> 52) & (FOREIGN_PAYLOAD_BUCKETS - 1);
}

static bool same(const foreign_payload_t *e, uint64_t buffer_id,
                 const void *base, size_t size, const usmipc_device_t *device) {
  return e->buffer_id == buffer_id && e->base == base && e->size == size &&
         e->device == device;
}

bool usmipc__foreign_payload_find(uint64_t buffer_id, const void *base,
                                  size_t size, const usmipc_device_t *device,
                                  usmipc__payload_t *out) {
  if (entries == NULL)
    return false;
  for (uint32_t i = buckets[bucket_of(buffer_id)]; i != UINT32_MAX;
       i = entries[i].next)
    if (same(&entries[i], buffer_id, base, size, device)) {
      *out = entries[i].payload;
      return true;
    }
  return false;
}

/* Takes entry i out of its bucket's chain. */
static void unlink_entry(uint32_t i) {
  uint32_t *link = &buckets[bucket_of(entries[i].buffer_id)];
  while (*link != i)
    link = &entries[*link].next;
  *link = entries[i].next;
}

void usmipc__foreign_payload_keep(uint64_t buffer_id, const void *base,
                                  size_t size, const usmipc_device_t *device,
                                  const usmipc__payload_t *payload) {
  if (entries == NULL) {
    /* Not kept is only slower (the driver is asked again): no error. */
    if ((entries = calloc(FOREIGN_PAYLOADS_MAX, sizeof(*entries))) == NULL)
      return;
    memset(buckets, 0xff, sizeof(buckets));
  }
  uint32_t b = bucket_of(buffer_id);
  for (uint32_t i = buckets[b]; i != UINT32_MAX; i = entries[i].next)
    if (same(&entries[i], buffer_id, base, size, device)) {
      entries[i].payload = *payload;
      return;
    }
  uint32_t i;
  if (count < FOREIGN_PAYLOADS_MAX) {
    i = count++;
  } else {
    i = oldest;
    oldest = (oldest + 1) % FOREIGN_PAYLOADS_MAX;
    unlink_entry(i);
  }
  entries[i] = (foreign_payload_t){.buffer_id = buffer_id,
                                   .base = base,
                                   .size = size,
                                   .device = device,
                                   .payload = *payload,
                                   .next = buckets[b]};
  buckets[b] = i;
}

size_t usmipc__foreign_payloads_count(void) { return count; }
