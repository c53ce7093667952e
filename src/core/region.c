/* The region registry: every allocation usmipc made and every IPC mapping
 * it opened, with the lock that guards it, and the allocation and release
 * of usmipc's own memory.
 *
 * Core floor (registries). The registry is an array of regions sorted by
 * base address, searched by bisection: regions never overlap (they are live
 * address ranges of one process), so "which region holds ptr" has one
 * answer. usmipc__registry_lock also guards the import cache
 * (core/import.c), foreign exports (core/export.c) and the importer's peers
 * (core/peers.c): one lock, by design (its place in the lock order:
 * fork.c). */
#include <stdlib.h>
#include <string.h>

#include "core/core.h"

pthread_mutex_t usmipc__registry_lock = PTHREAD_MUTEX_INITIALIZER;

static usmipc__region_t **regions;
static size_t region_count, region_capacity;
static uint64_t next_buffer_id;
static pthread_once_t registry_once = PTHREAD_ONCE_INIT;

/* Fork handlers, called by fork.c in the library's lock order. */
void usmipc__registry_fork_prepare(void) {
  pthread_mutex_lock(&usmipc__registry_lock);
}

void usmipc__registry_fork_parent(void) {
  pthread_mutex_unlock(&usmipc__registry_lock);
}

static void forget_export(usmipc__region_t *r) { r->exported = false; }

void usmipc__registry_fork_child(void) {
  /* The forking thread holds the lock (prepare took it) and is the one
   * thread of the child: it releases it. */
  pthread_mutex_unlock(&usmipc__registry_lock);
  /* The parent's grants name the parent's broker; the child publishes its
   * allocations again, under its own pid, on its next export. */
  usmipc__region_foreach(forget_export);
}

static void registry_init(void) {
  usmipc__self_basic();
  /* Buffer ids start at a random point so that ids of one process are not
   * guessable by another; they are unique within the process, and the
   * (pid, nonce) pair in the handle makes them unique on the host. */
  usmipc__random(&next_buffer_id, sizeof(next_buffer_id));
  /* Below 2^62: never reaches USMIPC__POOL_SEGMENT_ID, the pools' bit. */
  next_buffer_id = (next_buffer_id >> 2) | 1;
}

void usmipc__registry_ensure(void) {
  pthread_once(&registry_once, registry_init);
}

uint64_t usmipc__new_buffer_id(void) {
  usmipc__registry_ensure();
  return __atomic_fetch_add(&next_buffer_id, 1, __ATOMIC_RELAXED);
}

/* Index of the first region whose base is > ptr. */
static size_t upper_bound(const void *ptr) {
  size_t lo = 0, hi = region_count;
  while (lo < hi) {
    size_t mid = lo + (hi - lo) / 2;
    if ((uintptr_t)regions[mid]->alloc.base <= (uintptr_t)ptr)
      lo = mid + 1;
    else
      hi = mid;
  }
  return lo;
}

int usmipc__region_insert(usmipc__region_t *r) {
  if (region_count == region_capacity) {
    size_t cap = region_capacity ? region_capacity * 2 : 64;
    void *grown = realloc(regions, cap * sizeof(*regions));
    if (grown == NULL)
      return usmipc__fail(USMIPC_ENOMEM, "out of memory growing the registry");
    regions = grown;
    region_capacity = cap;
  }
  size_t at = upper_bound(r->alloc.base);
  memmove(&regions[at + 1], &regions[at],
          (region_count - at) * sizeof(*regions));
  regions[at] = r;
  region_count++;
  return 0;
}

void usmipc__region_remove(usmipc__region_t *r) {
  size_t at = upper_bound(r->alloc.base);
  if (at == 0 || regions[at - 1] != r)
    return;
  at--;
  memmove(&regions[at], &regions[at + 1],
          (region_count - at - 1) * sizeof(*regions));
  region_count--;
}

usmipc__region_t *usmipc__region_find(const void *ptr) {
  size_t at = upper_bound(ptr);
  if (at == 0)
    return NULL;
  usmipc__region_t *r = regions[at - 1];
  if ((uintptr_t)ptr - (uintptr_t)r->alloc.base < r->alloc.size)
    return r;
  return NULL;
}

void usmipc__region_foreach(void (*fn)(usmipc__region_t *r)) {
  for (size_t i = 0; i < region_count; i++)
    fn(regions[i]);
}

static const char *kind_name(usmipc_mem_kind_t kind) {
  switch (kind) {
  case USMIPC_MEM_DEVICE:
    return "device";
  case USMIPC_MEM_HOST:
    return "host";
  case USMIPC_MEM_SHARED:
    return "shared";
  default:
    return "unknown";
  }
}

void usmipc__region_release_local(usmipc__region_t *r) {
  r->device->ops->mem_free(r->device->native, &r->alloc);
  free(r->payload);
  free(r);
}

int usmipc__foreign_query_unlocked(const void *ptr, usmipc__allocation_t *alloc,
                                   uint64_t *buffer_id,
                                   usmipc_device_t **device) {
  if (usmipc__foreign_query(ptr, alloc, buffer_id, device) != 0)
    return usmipc__fail(USMIPC_EUNKNOWNPTR,
                        "pointer %p belongs to no usmipc allocation or "
                        "mapping, and no driver recognises it",
                        ptr);
  /* The driver's range can be larger than the allocation usmipc handed out
   * (CUDA rounds fd-shareable memory up to 2 MiB): a pointer in that slack
   * is past the end of ours, not another library's memory. */
  pthread_mutex_lock(&usmipc__registry_lock);
  usmipc__region_t *r = usmipc__region_find(alloc->base);
  pthread_mutex_unlock(&usmipc__registry_lock);
  if (r != NULL)
    return usmipc__fail(USMIPC_EUNKNOWNPTR,
                        "pointer %p lies past the end of the %zu-byte "
                        "allocation at %p",
                        ptr, r->alloc.size, r->alloc.base);
  return 0;
}

int usmipc__foreign_query(const void *ptr, usmipc__allocation_t *alloc,
                          uint64_t *buffer_id, usmipc_device_t **device) {
  usmipc__devices_init();
  for (size_t b = 0; b < usmipc__backend_count; b++) {
    const usmipc__backend_ops_t *ops = usmipc__backends[b];
    int ordinal = 0;
    memset(alloc, 0, sizeof(*alloc));
    alloc->fd = -1;
    if (ops->pointer_query == NULL)
      continue;
    USMIPC__STAT_ADD(driver_queries, 1);
    if (ops->pointer_query(ptr, alloc, buffer_id, &ordinal) != 0)
      continue;
    *device = usmipc__device_by_ordinal(ops->backend, ordinal);
    if (*device != NULL) {
      *buffer_id = usmipc__foreign_buffer_id(*buffer_id);
      return 0;
    }
  }
  return USMIPC_EUNKNOWNPTR;
}

int usmipc__local_alloc(usmipc_device_t *device, usmipc_mem_kind_t kind,
                        size_t nbytes, unsigned flags, void **ptr) {
  usmipc__registry_ensure();
  usmipc__region_t *r = calloc(1, sizeof(*r));
  if (r == NULL)
    return usmipc__fail(USMIPC_ENOMEM, "out of memory");
  r->alloc.fd = -1;
  int rc =
      device->ops->mem_alloc(device->native, kind, nbytes, flags, &r->alloc);
  if (rc != 0) {
    free(r);
    usmipc__error_prefix("allocating %zu bytes of %s memory on %s: ", nbytes,
                         kind_name(kind), device->filter);
    return rc;
  }
  r->device = device;
  r->origin = USMIPC__LOCAL;
  r->alloc.kind = kind;
  r->buffer_id = usmipc__new_buffer_id();
  pthread_mutex_lock(&usmipc__registry_lock);
  rc = usmipc__region_insert(r);
  pthread_mutex_unlock(&usmipc__registry_lock);
  if (rc != 0) {
    device->ops->mem_free(device->native, &r->alloc);
    free(r);
    return rc;
  }
  *ptr = r->alloc.base;
  return 0;
}

int usmipc__local_free(void *ptr) {
  usmipc__registry_ensure();
  pthread_mutex_lock(&usmipc__registry_lock);
  usmipc__region_t *r = usmipc__region_find(ptr);
  int rc = 0;
  if (r == NULL)
    rc = usmipc__fail(USMIPC_EUNKNOWNPTR,
                      "usmipc_free: %p was not allocated by usmipc_malloc "
                      "(or was already freed)",
                      ptr);
  else if (r->origin != USMIPC__LOCAL)
    rc = usmipc__fail(USMIPC_EINVAL,
                      "usmipc_free: %p is an IPC mapping; close it with "
                      "usmipc_ipc_close instead",
                      ptr);
  else if (r->alloc.base != ptr)
    rc = usmipc__fail(USMIPC_EINVAL,
                      "usmipc_free: %p points inside the allocation at %p; "
                      "free the base pointer",
                      ptr, r->alloc.base);
  else if (r->user_freed)
    rc = usmipc__fail(USMIPC_EINVAL, "usmipc_free: %p was already freed", ptr);
  if (rc != 0) {
    pthread_mutex_unlock(&usmipc__registry_lock);
    return rc;
  }
  r->user_freed = true;
  bool release_now = r->alias_refs == 0;
  if (release_now)
    usmipc__region_remove(r);
  /* Release outside the lock, since a driver free can wait for the device. */
  bool exported = r->exported;
  pthread_mutex_unlock(&usmipc__registry_lock);
  /* From now on no new importer can open the allocation: its export-table
   * slot is cleared first, then its descriptor withdrawn (in that order, see
   * linux/exports.c). Importers that hold it keep their mappings. */
  if (exported) {
    usmipc__exports_remove(r->export_slot);
    if (r->alloc.fd >= 0)
      usmipc__broker_withdraw(r->buffer_id);
  }
  if (release_now)
    usmipc__region_release_local(r);
  return 0;
}
