/* The import engine: opening decoded handles, and the per-process import
 * cache.
 *
 * Core floor (registries), under the public calls of ipc.c and bundle.c,
 * which decode and check the bytes and come here to map them.
 *
 * Open:    check host, device, size -> same process? alias -> cache hit?
 *          take a reference -> else prove the exporter and fetch the fd
 *          (core/peers.c) and let the backend map the whole allocation;
 *          cache it by exporter identity.
 * Close:   drop a reference; a mapping nobody uses waits in a bounded LRU so
 *          that opening it again is cheap, then is unmapped.
 *
 * The cache key is (exporter pid, exporter nonce, buffer id). Buffer ids are
 * never reused within an exporter, so a stale entry (the exporter freed and
 * reallocated at the same address) can never match a new handle. Everything
 * here is guarded by usmipc__registry_lock (core/region.c), which is never
 * held across a wait on another process. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "core/core.h"

/* Import cache: regions of origin IMPORTED sorted by key, plus the LRU list
 * of those with no open reference (most recently closed at the head). All
 * guarded by usmipc__registry_lock.
 *
 * How long an idle mapping stays. A closed mapping pins memory its exporter
 * may already have freed (device memory, on a GPU), so what is kept must be
 * bounded; but a count or a byte cap also sends a large model cold at every
 * step (a consumer that drops 4,719 tensors between handoffs re-imported
 * 775 of 798 allocations under the old 64-entry, 1 GiB caps). Liveness
 * bounds it instead: the exporter's export table says whether each
 * allocation is still exported, and a mapping of one that is (the exporter
 * holds the memory anyway) costs nothing extra. An idle mapping whose
 * allocation was freed, or whose exporter died, is dropped at the next
 * close (which checks the newest few) or by the sweeper thread within
 * SWEEP_MS, even if this process makes no further call. Mappings whose
 * liveness the cache cannot read (no export-table slot, or drop-on-free
 * switched off: "blind") are bounded by idle_limit and idle_byte_limit; a
 * bound set through usmipc_ipc_set_cache_size/_bytes or the environment
 * (limits_all) bounds every idle mapping. */
static usmipc__region_t **imports;
static size_t import_count, import_capacity;
static usmipc__region_t *idle_head, *idle_tail;
static size_t idle_count, idle_bytes, blind_count, blind_bytes;
static size_t idle_limit = 64;
static size_t idle_byte_limit = (size_t)1 << 30;
static bool limits_all;
static bool drop_freed = true; /* USMIPC_IPC_CACHE_DROP_FREED=0: off */
/* The sweeper: a thread that runs while idle mappings whose liveness it can
 * read exist, and drops those freed or orphaned every SWEEP_MS. */
#define SWEEP_MS 250
/* A close checks this many of the newest idle mappings (its own first): a
 * producer that streams fresh buffers frees the one before, which is then
 * dropped at once rather than at the next sweep. */
#define CLOSE_CHECKS 8
static bool sweeper_running;
static pthread_cond_t sweeper_cond;

static pthread_once_t cache_once = PTHREAD_ONCE_INIT;

/* name's value into *out; whether there was one to take. */
/* USMIPC_IPC_CACHE_SIZE (a count) or _BYTES (a size, 64G and the like). */
static bool env_size(const char *name, bool units, size_t *out) {
  unsigned long long v;
  if (!usmipc__env_number(name, 0, SIZE_MAX, units,
                          "the default (idle mappings kept while their "
                          "exporter exports them)",
                          &v))
    return false;
  *out = (size_t)v;
  return true;
}

static void sweeper_cond_init(void) {
  pthread_condattr_t attr;
  pthread_condattr_init(&attr);
  pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
  pthread_cond_init(&sweeper_cond, &attr);
  pthread_condattr_destroy(&attr);
}

static void cache_init(void) {
  sweeper_cond_init();
  bool entries = env_size("USMIPC_IPC_CACHE_SIZE", false, &idle_limit);
  bool bytes = env_size("USMIPC_IPC_CACHE_BYTES", true, &idle_byte_limit);
  limits_all = entries || bytes;
  const char *env = getenv("USMIPC_IPC_CACHE_DROP_FREED");
  if (env != NULL && strcmp(env, "0") == 0)
    drop_freed = false;
  else if (env != NULL && env[0] != '\0' && strcmp(env, "1") != 0)
    usmipc__env_malformed("USMIPC_IPC_CACHE_DROP_FREED", env, "0 or 1", "1");
}

/* Bytes an idle mapping keeps: what the backend really mapped. */
static size_t mapped_bytes(const usmipc__region_t *r) {
  return r->alloc.reserved > r->alloc.size ? r->alloc.reserved : r->alloc.size;
}

static int key_cmp(const usmipc__import_key_t *a,
                   const usmipc__import_key_t *b) {
  if (a->buffer_id != b->buffer_id)
    return a->buffer_id < b->buffer_id ? -1 : 1;
  if (a->nonce != b->nonce)
    return a->nonce < b->nonce ? -1 : 1;
  if (a->pid != b->pid)
    return a->pid < b->pid ? -1 : 1;
  if (a->device != b->device)
    return (uintptr_t)a->device < (uintptr_t)b->device ? -1 : 1;
  return 0;
}

/* Index of the first import whose key is >= key. */
static size_t import_lower_bound(const usmipc__import_key_t *key) {
  size_t lo = 0, hi = import_count;
  while (lo < hi) {
    size_t mid = lo + (hi - lo) / 2;
    if (key_cmp(&imports[mid]->key, key) < 0)
      lo = mid + 1;
    else
      hi = mid;
  }
  return lo;
}

static usmipc__region_t *import_find(const usmipc__import_key_t *key) {
  size_t at = import_lower_bound(key);
  if (at < import_count && key_cmp(&imports[at]->key, key) == 0)
    return imports[at];
  return NULL;
}

static int import_insert(usmipc__region_t *r) {
  if (import_count == import_capacity) {
    size_t cap = import_capacity ? import_capacity * 2 : 64;
    void *grown = realloc(imports, cap * sizeof(*imports));
    if (grown == NULL)
      return usmipc__fail(USMIPC_ENOMEM, "out of memory growing the cache");
    imports = grown;
    import_capacity = cap;
  }
  size_t at = import_lower_bound(&r->key);
  memmove(&imports[at + 1], &imports[at],
          (import_count - at) * sizeof(*imports));
  imports[at] = r;
  import_count++;
  return 0;
}

static void import_remove(usmipc__region_t *r) {
  size_t at = import_lower_bound(&r->key);
  if (at < import_count && imports[at] == r) {
    memmove(&imports[at], &imports[at + 1],
            (import_count - at - 1) * sizeof(*imports));
    import_count--;
  }
}

/* An idle mapping whose liveness the cache cannot read. */
static bool blind(const usmipc__region_t *r) {
  return r->peer == NULL || !drop_freed;
}

static void idle_unlink(usmipc__region_t *r) {
  if (r->idle_prev)
    r->idle_prev->idle_next = r->idle_next;
  else
    idle_head = r->idle_next;
  if (r->idle_next)
    r->idle_next->idle_prev = r->idle_prev;
  else
    idle_tail = r->idle_prev;
  r->idle_prev = r->idle_next = NULL;
  idle_count--;
  idle_bytes -= mapped_bytes(r);
  if (blind(r)) {
    blind_count--;
    blind_bytes -= mapped_bytes(r);
  }
}

static void idle_push(usmipc__region_t *r) {
  r->idle_prev = NULL;
  r->idle_next = idle_head;
  if (idle_head)
    idle_head->idle_prev = r;
  idle_head = r;
  if (idle_tail == NULL)
    idle_tail = r;
  idle_count++;
  idle_bytes += mapped_bytes(r);
  if (blind(r)) {
    blind_count++;
    blind_bytes += mapped_bytes(r);
  }
}

/* Takes an idle mapping out of the cache and the registry onto a list
 * (linked by idle_next) to unmap once the lock is dropped. */
static void idle_detach(usmipc__region_t *r, usmipc__region_t **list) {
  idle_unlink(r);
  import_remove(r);
  usmipc__region_remove(r);
  r->idle_next = *list;
  *list = r;
}

/* Detaches idle mappings beyond the limits, least recently used first:
 * every idle mapping once a limit was set, else only blind ones. */
static usmipc__region_t *idle_evict_over_limit(void) {
  usmipc__region_t *evicted = NULL;
  if (limits_all) {
    while (idle_count > idle_limit || idle_bytes > idle_byte_limit)
      idle_detach(idle_tail, &evicted);
    return evicted;
  }
  for (usmipc__region_t *r = idle_tail, *prev;
       r != NULL && (blind_count > idle_limit || blind_bytes > idle_byte_limit);
       r = prev) {
    prev = r->idle_prev;
    if (blind(r))
      idle_detach(r, &evicted);
  }
  return evicted;
}

void usmipc__unmap_list(usmipc__region_t *list) {
  if (list != NULL)
    usmipc__debug("cache: unmapping %s (buffer %llu)",
                  list->idle_next ? "idle mappings" : "an idle mapping",
                  (unsigned long long)list->buffer_id);
  while (list) {
    usmipc__region_t *next = list->idle_next;
    list->device->ops->ipc_unmap(list->device->native, &list->alloc);
    usmipc__peer_put(list->peer);
    free(list);
    list = next;
  }
}

/* Drop-on-free: idle mappings whose allocation the exporter freed, or whose
 * exporter died, can never be opened again (every open checks), so they
 * only pin memory: detach them, of the newest `at_most` idle mappings (all
 * of them: SIZE_MAX). A few loads per idle mapping, no system call. Returns
 * them as a list (linked by idle_next). Lock held. */
static usmipc__region_t *idle_drop_dead(usmipc__region_t *evicted,
                                        size_t at_most) {
  if (!drop_freed)
    return evicted;
  size_t seen = 0;
  for (usmipc__region_t *r = idle_head, *next; r && seen < at_most;
       r = next, seen++) {
    next = r->idle_next;
    if (r->peer != NULL && !usmipc__peer_slot_live(r->peer, r->export_slot,
                                                   r->buffer_id, r->slot_tag))
      idle_detach(r, &evicted);
  }
  return evicted;
}

/* The sweeper's loop: every SWEEP_MS, with the registry lock (which the
 * condition's wait gives up meanwhile), every idle mapping's liveness;
 * unmaps outside the lock. Ends when no idle mapping is left to watch. */
static void *sweep_main(void *arg) {
  (void)arg;
  pthread_mutex_lock(&usmipc__registry_lock);
  for (;;) {
    struct timespec ts;
    uint64_t until = usmipc__now_ns() + (uint64_t)SWEEP_MS * 1000000u;
    ts.tv_sec = (time_t)(until / 1000000000u);
    ts.tv_nsec = (long)(until % 1000000000u);
    pthread_cond_timedwait(&sweeper_cond, &usmipc__registry_lock, &ts);
    if (!drop_freed || idle_count == blind_count) {
      sweeper_running = false;
      break;
    }
    usmipc__region_t *evicted = idle_drop_dead(NULL, SIZE_MAX);
    if (evicted != NULL) {
      pthread_mutex_unlock(&usmipc__registry_lock);
      usmipc__unmap_list(evicted);
      pthread_mutex_lock(&usmipc__registry_lock);
    }
  }
  pthread_mutex_unlock(&usmipc__registry_lock);
  return NULL;
}

/* Starts the sweeper if an idle mapping it can watch exists and it is not
 * running. Lock held. A failure to start it leaves the next close's checks
 * (and a later start) to drop freed mappings. */
static void sweeper_ensure(void) {
  if (sweeper_running || !drop_freed || idle_count == blind_count)
    return;
  pthread_attr_t attr;
  pthread_t t;
  pthread_attr_init(&attr);
  pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
  if (pthread_create(&t, &attr, sweep_main, NULL) == 0)
    sweeper_running = true;
  pthread_attr_destroy(&attr);
}

/* fork.c's hook, in the child (the registry lock held): no sweeper runs
 * there; the next close starts one if it has mappings to watch. */
void usmipc__imports_fork_child(void) {
  sweeper_running = false;
  sweeper_cond_init();
}

/* Unmaps every idle mapping, for an import that ran out of room: the cache
 * must never be why an open fails. Returns whether there was any. */
static bool idle_drop_all(void) {
  pthread_mutex_lock(&usmipc__registry_lock);
  usmipc__region_t *evicted = NULL;
  while (idle_tail != NULL)
    idle_detach(idle_tail, &evicted);
  pthread_mutex_unlock(&usmipc__registry_lock);
  usmipc__unmap_list(evicted);
  return evicted != NULL;
}

/* Sets one of the cache's bounds and evicts what no longer fits. */
static int set_cache_limit(size_t *limit, size_t value) {
  pthread_once(&cache_once, cache_init);
  pthread_mutex_lock(&usmipc__registry_lock);
  *limit = value;
  limits_all = true;
  usmipc__region_t *evicted = idle_evict_over_limit();
  pthread_mutex_unlock(&usmipc__registry_lock);
  usmipc__unmap_list(evicted);
  return 0;
}

int usmipc_ipc_set_cache_size(size_t entries) {
  return set_cache_limit(&idle_limit, entries);
}

int usmipc_ipc_set_cache_bytes(size_t bytes) {
  return set_cache_limit(&idle_byte_limit, bytes);
}

/* A handle opened by the process that exported it: the memory is already
 * here, so the open is an alias of the original pointer, counted so that
 * usmipc_free can wait for the last alias. */
static int open_same_process(const usmipc__wire_t *w, void **ptr) {
  const void *base = (const void *)(uintptr_t)w->exporter_base;
  pthread_mutex_lock(&usmipc__registry_lock);
  usmipc__region_t *r = usmipc__region_find(base);
  if (r == NULL) {
    /* Perhaps memory of another library that this process exported. */
    usmipc__allocation_t a = {0};
    uint64_t id;
    usmipc_device_t *device;
    if (usmipc__foreign_query(base, &a, &id, &device) == 0 &&
        id == w->buffer_id && a.base == base && a.size == w->allocation_size &&
        (r = calloc(1, sizeof(*r))) != NULL) {
      r->alloc = a;
      r->device = device;
      r->origin = USMIPC__FOREIGN_ALIAS;
      r->buffer_id = id;
      if (usmipc__region_insert(r) != 0) {
        free(r);
        r = NULL;
      }
    }
  }
  if (r == NULL || r->origin == USMIPC__IMPORTED ||
      r->buffer_id != w->buffer_id || r->user_freed || r->alloc.base != base) {
    pthread_mutex_unlock(&usmipc__registry_lock);
    return usmipc__fail(USMIPC_EEXPORTERGONE,
                        "the handle was exported by this process, but the "
                        "allocation it names has been freed");
  }
  if (r->device->ops->backend != w->backend ||
      memcmp(r->device->uuid, w->device_uuid, 16) != 0) {
    pthread_mutex_unlock(&usmipc__registry_lock);
    return usmipc__fail(USMIPC_EWRONGDEVICE,
                        "the handle names %s memory of another device than "
                        "the allocation it points at (%s): forged or corrupted",
                        usmipc_backend_name(w->backend), r->device->filter);
  }
  if (r->alloc.size != w->allocation_size) {
    pthread_mutex_unlock(&usmipc__registry_lock);
    return usmipc__fail(USMIPC_EBADHANDLE,
                        "not a valid usmipc IPC handle: it claims a %llu-byte "
                        "allocation, but the allocation it names has %zu bytes",
                        (unsigned long long)w->allocation_size, r->alloc.size);
  }
  /* The handle must be of the current export: not revoked since. */
  bool current = false;
  if (r->origin == USMIPC__LOCAL)
    current = r->exported && r->export_slot == w->export_slot &&
              memcmp(r->token, w->token, 16) == 0;
  if (!current && r->origin == USMIPC__FOREIGN_ALIAS)
    current = usmipc__foreign_export_current(w->buffer_id, base, w->export_slot,
                                             w->token);
  if (!current && w->export_slot != USMIPC__NO_SLOT) {
    if (r->origin == USMIPC__FOREIGN_ALIAS && r->alias_refs == 0) {
      usmipc__region_remove(r);
      free(r);
    }
    pthread_mutex_unlock(&usmipc__registry_lock);
    return usmipc__fail(USMIPC_EEXPORTERGONE,
                        "the handle was exported by this process and has "
                        "been revoked since (usmipc_ipc_revoke, or the last "
                        "handle of memory of another library died)");
  }
  r->alias_refs++;
  *ptr = (uint8_t *)r->alloc.base + w->offset;
  pthread_mutex_unlock(&usmipc__registry_lock);
  return 0;
}

/* Takes a reference on a cached mapping; registry lock held. The handle
 * must agree with what was mapped: a forged size or token that names a
 * known allocation gets no further than one that names an unknown one. */
static int cache_take(usmipc__region_t *r, const usmipc__wire_t *w,
                      void **ptr) {
  if (r->alloc.size != w->allocation_size)
    return usmipc__fail(USMIPC_EBADHANDLE,
                        "not a valid usmipc IPC handle: it claims a %llu-byte "
                        "allocation, but the allocation it names has %zu bytes",
                        (unsigned long long)w->allocation_size, r->alloc.size);
  int rc;
  if (memcmp(r->process_key, w->key, 16) != 0 ||
      (r->peer == NULL && memcmp(r->token, w->token, 16) != 0))
    return usmipc__fail(USMIPC_EACCES,
                        "process %u's handle carries the wrong capability "
                        "token for this allocation (forged or corrupted)",
                        w->pid);
  if (memcmp(r->token, w->token, 16) != 0) {
    /* Another export of the same allocation (it was revoked and exported
     * again): the mapping is the same memory, and the exporter's table says
     * which export is current. */
    uint64_t tag = usmipc__slot_tag(w->key, w->token);
    if ((rc = usmipc__peer_check(r->peer, w, tag, NULL)) != 0)
      return rc;
    memcpy(r->token, w->token, 16);
    r->slot_tag = tag;
    r->export_slot = w->export_slot;
  }
  /* A hit is checked like a miss: the allocation must still be exported
   * by a living exporter (two reads of its table). */
  if (r->peer != NULL &&
      (rc = usmipc__peer_check(r->peer, w, r->slot_tag, NULL)) != 0)
    return rc;
  if (r->open_refs++ == 0)
    idle_unlink(r);
  *ptr = (uint8_t *)r->alloc.base + w->offset;
  return 0;
}

static int open_mapping(const usmipc__wire_t *w, usmipc_device_t *device,
                        size_t nbytes, int *prefetched_fd, void **ptr,
                        size_t *mapped_nbytes);

/* *prefetched_fd (or -1) is w's descriptor, taken beforehand; set to -1 once
 * the import takes it over, else the caller closes it. */
static int open_mapping(const usmipc__wire_t *w, usmipc_device_t *device,
                        size_t nbytes, int *prefetched_fd, void **ptr,
                        size_t *mapped_nbytes) {
  pthread_once(&cache_once, cache_init);
  int rc;

  const usmipc__process_t *self = usmipc__self_basic();
  if (memcmp(w->boot_id, self->boot_id, 16) != 0)
    return usmipc__fail(USMIPC_EOTHERHOST,
                        "the handle was exported on another machine or before "
                        "this machine rebooted (boot id differs); IPC handles "
                        "only work between processes of one running host");
  /* The device that exported the memory, as this process sees it. */
  usmipc_device_t *owner = usmipc__device_by_uuid(w->backend, w->device_uuid);
  if (device != NULL && device->ops->backend != w->backend)
    return usmipc__fail(USMIPC_EWRONGDEVICE,
                        "the handle holds %s memory but the target device %s "
                        "is a %s device; open it on a %s device",
                        usmipc_backend_name(w->backend), device->filter,
                        device->ops->name, usmipc_backend_name(w->backend));
  const char *no_backend = NULL;
  if (owner == NULL && device == NULL &&
      usmipc_backend_status(w->backend, &no_backend) != 0) {
    /* Not one device of the handle's backend here: no device to name. */
    char uuid[37];
    usmipc__uuid_format(w->device_uuid, uuid);
    return usmipc__fail(
        USMIPC_EUNAVAILABLE,
        "the handle holds memory of %s device %s, but this process has no %s "
        "device to map it on (%s)%s",
        usmipc_backend_name(w->backend), uuid, usmipc_backend_name(w->backend),
        no_backend,
        w->backend == USMIPC_BACKEND_CUDA
            ? "; CUDA_VISIBLE_DEVICES may hide every GPU from this process"
            : "");
  }
  if (owner == NULL &&
      (device == NULL || !device->ops->ipc_import_hidden_owner)) {
    /* A device hidden from this process (CUDA_VISIBLE_DEVICES): a backend
     * whose driver maps such memory onto a device we can see does so when
     * told which one (docs/distributed.md); the others cannot. */
    char uuid[37];
    usmipc__uuid_format(w->device_uuid, uuid);
    if (device == NULL && w->backend == USMIPC_BACKEND_CUDA)
      return usmipc__fail(USMIPC_EWRONGDEVICE,
                          "the handle was exported on cuda device %s, which "
                          "this process cannot see (CUDA_VISIBLE_DEVICES "
                          "hides it); name one of this process's GPUs as the "
                          "device to open it on, and the memory is mapped "
                          "there through peer access",
                          uuid);
    return usmipc__fail(USMIPC_EWRONGDEVICE,
                        "the handle was exported on %s device %s, which this "
                        "process cannot see (check CUDA_VISIBLE_DEVICES / "
                        "ZE_AFFINITY_MASK)%s",
                        usmipc_backend_name(w->backend), uuid,
                        device != NULL ? "; its backend cannot map memory of "
                                         "a device this process cannot see"
                                       : "");
  }
  if (device == NULL)
    device = owner;
  if (device->ops->ipc_check != NULL &&
      (rc = device->ops->ipc_check(device->native)) != 0)
    return rc;
  if (nbytes == 0)
    nbytes = w->nbytes;
  else if (nbytes > w->nbytes)
    return usmipc__fail(USMIPC_ERANGE,
                        "cannot open %zu bytes: the handle exports only %llu",
                        nbytes, (unsigned long long)w->nbytes);
  if (mapped_nbytes != NULL)
    *mapped_nbytes = nbytes;

  /* A run of chunks has no single allocation here to alias: its exporter
   * maps it again, as another process would (k driver imports). */
  if (w->nonce == self->nonce && w->pid == self->pid && w->chunk_count == 0)
    return open_same_process(w, ptr);

  usmipc__import_key_t key = {.nonce = w->nonce,
                              .buffer_id = w->buffer_id,
                              .pid = w->pid,
                              .device = device};
  pthread_mutex_lock(&usmipc__registry_lock);
  usmipc__region_t *hit = import_find(&key);
  if (hit != NULL) {
    rc = cache_take(hit, w, ptr);
    pthread_mutex_unlock(&usmipc__registry_lock);
    usmipc__debug("open: cache hit, buffer %llu of process %u%s",
                  (unsigned long long)w->buffer_id, w->pid,
                  rc == 0 ? "" : " (refused)");
    return rc;
  }
  pthread_mutex_unlock(&usmipc__registry_lock);
  usmipc__debug("open: cache miss, buffer %llu of process %u: mapping it",
                (unsigned long long)w->buffer_id, w->pid);

  /* Miss: check, fetch and map without the lock, since all three can wait
   * on the exporter; another thread may map the same allocation meanwhile,
   * and the loser unmaps its copy below. The exporter's export table says
   * whether the allocation is still exported and how large it is: a driver
   * handle (a bearer token) may be accepted by the driver after a free, and
   * the sizes in the handle are only as true as whoever wrote it. */
  uint64_t deadline = usmipc__deadline_after_timeout();
  uint64_t tag = usmipc__slot_tag(w->key, w->token);
  usmipc__peer_t *peer = NULL;
  int fd = -1;
  /* A run of chunks: a descriptor per chunk (the decoder bounded k). */
  int chunk_fds[USMIPC__CHUNKS_MAX];
  uint32_t nchunks = w->chunk_count;
  for (uint32_t i = 0; i < nchunks; i++)
    chunk_fds[i] = -1;
  if (nchunks > 0 && device->ops->ipc_import_chunks == NULL)
    return usmipc__fail(USMIPC_EBADHANDLE,
                        "not a valid usmipc IPC handle: it names %s memory "
                        "in chunks, which that backend never exports",
                        usmipc_backend_name(w->backend));
  if (w->export_slot != USMIPC__NO_SLOT) {
    /* The exporter, proven once per exporter; then the slot; then the
     * descriptor (prefetched, or handed over by the broker with the proof,
     * or fetched now), or a run's descriptors (always fetched now: a run
     * is never prefetched nor served with the proof). A prefetched one was
     * checked when it was taken, and the slot check below says the
     * allocation is still the one exported. */
    int prefetched = -1;
    if ((w->flags & USMIPC__WIRE_FLAG_FD) && nchunks == 0) {
      prefetched = *prefetched_fd; /* else the caller closes it */
      *prefetched_fd = -1;
    }
    if ((rc = usmipc__peer_get(w, deadline, &peer, &fd)) != 0) {
      if (prefetched >= 0)
        close(prefetched);
      return rc;
    }
    if (fd >= 0)
      USMIPC__STAT_ADD(descriptors_received, 1);
    if (prefetched >= 0) {
      if (fd >= 0)
        close(fd); /* the same file, proven twice: one is enough */
      fd = prefetched;
    }
    if (nchunks > 0) {
      rc = usmipc__peer_fetch_run_fds(peer, w, tag, deadline, chunk_fds);
      if (rc == 0)
        USMIPC__STAT_ADD(descriptors_received, nchunks);
    } else if (fd < 0 && (w->flags & USMIPC__WIRE_FLAG_FD)) {
      rc = usmipc__peer_fetch_fd(peer, w, tag, deadline, &fd);
      if (rc == 0)
        USMIPC__STAT_ADD(descriptors_received, 1);
    } else {
      rc = usmipc__peer_check(peer, w, tag, NULL);
    }
    if (rc != 0) {
      if (fd >= 0)
        close(fd);
      usmipc__peer_put(peer);
      return rc;
    }
  }
  usmipc__region_t *r = calloc(1, sizeof(*r));
  if (r == NULL) {
    if (fd >= 0)
      close(fd);
    for (uint32_t i = 0; i < nchunks; i++)
      close(chunk_fds[i]);
    usmipc__peer_put(peer);
    return usmipc__fail(USMIPC_ENOMEM, "out of memory");
  }
  r->alloc.fd = -1;
  if (nchunks > 0) {
    uint64_t sizes[USMIPC__CHUNKS_MAX];
    usmipc__wire_chunk_sizes(w, sizes);
    rc = device->ops->ipc_import_chunks(
        device->native, owner != NULL ? owner->native : NULL, &w->payload,
        chunk_fds, sizes, nchunks, w->allocation_size, &r->alloc);
    USMIPC__STAT_ADD(driver_imports, nchunks);
    for (uint32_t i = 0; i < nchunks; i++)
      close(chunk_fds[i]);
  } else {
    bool cache_dropped = false;
    for (;;) {
      rc = device->ops->ipc_import(
          device->native, owner != NULL ? owner->native : NULL, &w->payload, fd,
          w->allocation_size, &r->alloc);
      /* Out of room (address space, device memory for a mapping): idle
       * mappings of this cache may be what fills it. Drop them, once. */
      if (rc == USMIPC_ENOMEM && !cache_dropped) {
        cache_dropped = true;
        if (idle_drop_all()) {
          usmipc__debug("open: out of room; dropped the idle mappings and "
                        "trying again");
          continue;
        }
      }
      if (rc != USMIPC__IMPORT_BUSY) {
        USMIPC__STAT_ADD(driver_imports, 1);
        break;
      }
      /* Another thread of ours holds the driver's one mapping of this
       * allocation: take it from the registry once it is there, or map
       * again once that thread has unmapped it. */
      pthread_mutex_lock(&usmipc__registry_lock);
      hit = import_find(&key);
      if (hit != NULL) {
        rc = cache_take(hit, w, ptr);
        pthread_mutex_unlock(&usmipc__registry_lock);
        if (fd >= 0)
          close(fd);
        free(r);
        usmipc__peer_put(peer);
        return rc;
      }
      pthread_mutex_unlock(&usmipc__registry_lock);
      if (usmipc__now_ns() > deadline) {
        rc = usmipc__fail(USMIPC_ETIMEDOUT,
                          "the driver says this process maps the allocation "
                          "already, but no mapping of it appeared within the "
                          "IPC timeout (USMIPC_IPC_TIMEOUT_MS)");
        break;
      }
      usleep(50);
    }
  }
  if (fd >= 0)
    close(fd);
  if (rc != 0) {
    free(r);
    usmipc__peer_put(peer);
    usmipc__error_prefix("opening the handle of process %u: ", w->pid);
    return rc;
  }
  r->device = device;
  r->origin = USMIPC__IMPORTED;
  r->buffer_id = w->buffer_id;
  r->key = key;
  r->open_refs = 1;
  r->peer = peer;
  r->export_slot = w->export_slot;
  memcpy(r->token, w->token, 16);
  memcpy(r->process_key, w->key, 16);
  r->slot_tag = tag;

  pthread_mutex_lock(&usmipc__registry_lock);
  hit = import_find(&key);
  if (hit != NULL) {
    rc = cache_take(hit, w, ptr);
    pthread_mutex_unlock(&usmipc__registry_lock);
    r->idle_next = NULL;
    usmipc__unmap_list(r);
    return rc;
  }
  rc = usmipc__region_insert(r);
  if (rc == 0 && (rc = import_insert(r)) != 0)
    usmipc__region_remove(r);
  pthread_mutex_unlock(&usmipc__registry_lock);
  if (rc != 0) {
    r->idle_next = NULL;
    usmipc__unmap_list(r);
    return rc;
  }
  *ptr = (uint8_t *)r->alloc.base + w->offset;
  return 0;
}

int usmipc__open_mapping(const usmipc__wire_t *w, usmipc_device_t *device,
                         size_t nbytes, int prefetched_fd, void **ptr,
                         size_t *mapped_nbytes) {
  int rc = open_mapping(w, device, nbytes, &prefetched_fd, ptr, mapped_nbytes);
  /* Not taken for the mapping: a cache hit, this process's own memory, a
   * handle that takes no single descriptor (none, or a run's several), or
   * a failure before the import. */
  if (prefetched_fd >= 0)
    close(prefetched_fd);
  return rc;
}

int usmipc__open_wire(const usmipc__wire_t *w, usmipc_device_t *device,
                      void **ptr) {
  return usmipc__open_mapping(w, device, 0, -1, ptr, NULL);
}

bool usmipc__import_cached(const usmipc__wire_t *w, usmipc_device_t *device) {
  if (device == NULL)
    device = usmipc__device_by_uuid(w->backend, w->device_uuid);
  if (device == NULL)
    return false;
  usmipc__import_key_t key = {.nonce = w->nonce,
                              .buffer_id = w->buffer_id,
                              .pid = w->pid,
                              .device = device};
  pthread_mutex_lock(&usmipc__registry_lock);
  bool hit = import_find(&key) != NULL;
  pthread_mutex_unlock(&usmipc__registry_lock);
  return hit;
}

/* Whether opening w needs a descriptor from its exporter that a prefetch
 * takes (usmipc_ipc_open would fail before it asks for one on another
 * host's handle). A run of chunks is left out: its k descriptors travel
 * whole, in a request of their own, which its open makes
 * (usmipc__peer_fetch_run_fds); a batch entry could take none of them. */
static bool needs_descriptor(const usmipc__wire_t *w,
                             const usmipc__process_t *self) {
  return (w->flags & USMIPC__WIRE_FLAG_FD) && w->chunk_count == 0 &&
         w->export_slot != USMIPC__NO_SLOT &&
         !(w->pid == self->pid && w->nonce == self->nonce) &&
         memcmp(w->boot_id, self->boot_id, 16) == 0;
}

/* Fails the prefetch of the m handles of w[at]'s exporter: closes every
 * descriptor taken so far, of any exporter. */
static int prefetch_fail(const usmipc__wire_t *const *w, size_t n, int *fds,
                         size_t at, size_t m, int rc) {
  for (size_t i = 0; i < n; i++) {
    if (fds[i] >= 0)
      close(fds[i]);
    fds[i] = -1;
  }
  usmipc__error_prefix("prefetching the descriptors of %zu handles of "
                       "process %u (from handle %zu of %zu): ",
                       m, w[at]->pid, at, n);
  return rc;
}

int usmipc__prefetch_fds(const usmipc__wire_t *const *w, size_t n,
                         uint64_t deadline, int *fds) {
  for (size_t i = 0; i < n; i++)
    fds[i] = -1;
  if (n == 0)
    return 0;
  const usmipc__process_t *self = usmipc__self_basic();
  const usmipc__wire_t **group = malloc(n * sizeof(*group));
  size_t *at = malloc(n * sizeof(*at));
  int *got = malloc(n * sizeof(*got));
  bool *done = calloc(n, sizeof(*done));
  int rc = 0;
  if (group == NULL || at == NULL || got == NULL || done == NULL) {
    rc = usmipc__fail(USMIPC_ENOMEM, "out of memory");
    goto out;
  }
  /* One exporter at a time: its handles in the order given. */
  for (size_t i = 0; i < n && rc == 0; i++) {
    if (done[i] || !needs_descriptor(w[i], self))
      continue;
    size_t m = 0;
    for (size_t j = i; j < n; j++) {
      if (!done[j] && needs_descriptor(w[j], self) && w[j]->pid == w[i]->pid &&
          w[j]->nonce == w[i]->nonce) {
        done[j] = true;
        group[m] = w[j];
        at[m++] = j;
      }
    }
    usmipc__peer_t *peer;
    int proof_fd = -1;
    size_t first = 0;
    if ((rc = usmipc__peer_get(w[i], deadline, &peer, &proof_fd)) != 0) {
      rc = prefetch_fail(w, n, fds, i, m, rc);
      break;
    }
    if (proof_fd >= 0) {
      /* The broker handed over w[i]'s descriptor with the proof. */
      USMIPC__STAT_ADD(descriptors_received, 1);
      fds[i] = proof_fd;
      first = 1;
      rc = usmipc__peer_check(peer, w[i],
                              usmipc__slot_tag(w[i]->key, w[i]->token), NULL);
    }
    if (rc == 0 && m > first &&
        (rc = usmipc__peer_fetch_fds(peer, group + first, m - first, deadline,
                                     got)) == 0) {
      for (size_t k = first; k < m; k++)
        fds[at[k]] = got[k - first];
    }
    usmipc__peer_put(peer);
    if (rc != 0)
      rc = prefetch_fail(w, n, fds, i, m, rc);
  }
out:
  free(group);
  free(at);
  free(got);
  free(done);
  return rc;
}

/* A count that wrapped would unmap memory still in use at a later close:
 * refused at the limit instead (64 bits, so only the test hook gets there:
 * bundle_mapping_refs_do_not_wrap). */
static int add_refs(uint64_t *refs, unsigned n, const void *ptr) {
  if (n > UINT64_MAX - *refs)
    return usmipc__fail(USMIPC_EBUSY,
                        "the mapping at %p already holds %llu references, "
                        "the most it can count; close some of its opens "
                        "first",
                        ptr, (unsigned long long)*refs);
  *refs += n;
  return 0;
}

int usmipc__mapping_addref(void *ptr, unsigned n) {
  pthread_mutex_lock(&usmipc__registry_lock);
  usmipc__region_t *r = usmipc__region_find(ptr);
  int rc = 0;
  if (r != NULL &&
      (r->origin == USMIPC__LOCAL || r->origin == USMIPC__FOREIGN_ALIAS) &&
      r->alias_refs > 0)
    rc = add_refs(&r->alias_refs, n, ptr);
  else if (r != NULL && r->origin == USMIPC__IMPORTED && r->open_refs > 0)
    rc = add_refs(&r->open_refs, n, ptr);
  else
    rc = usmipc__fail(USMIPC_ENOTMAPPED, "%p is not an open IPC mapping", ptr);
  pthread_mutex_unlock(&usmipc__registry_lock);
  return rc;
}

int usmipc__mapping_refs_for_test(void *ptr, const uint64_t *set,
                                  uint64_t *get) {
  pthread_mutex_lock(&usmipc__registry_lock);
  usmipc__region_t *r = usmipc__region_find(ptr);
  int rc = 0;
  if (r != NULL &&
      (r->origin == USMIPC__LOCAL || r->origin == USMIPC__FOREIGN_ALIAS) &&
      r->alias_refs > 0) {
    if (get)
      *get = r->alias_refs;
    if (set)
      r->alias_refs = *set;
  } else if (r != NULL && r->origin == USMIPC__IMPORTED && r->open_refs > 0) {
    if (get)
      *get = r->open_refs;
    if (set)
      r->open_refs = *set;
  } else {
    rc = usmipc__fail(USMIPC_ENOTMAPPED, "%p is not an open IPC mapping", ptr);
  }
  pthread_mutex_unlock(&usmipc__registry_lock);
  return rc;
}

int usmipc_ipc_close(void *ptr) {
  pthread_once(&cache_once, cache_init);
  pthread_mutex_lock(&usmipc__registry_lock);
  usmipc__region_t *r = usmipc__region_find(ptr);
  usmipc__region_t *evicted = NULL, *release = NULL;
  int rc = 0;
  if (r != NULL && r->origin == USMIPC__LOCAL && r->alias_refs > 0) {
    /* A same-process alias: the allocation is released here if the user
     * freed it while the alias was open. */
    if (--r->alias_refs == 0 && r->user_freed) {
      usmipc__region_remove(r);
      release = r;
    }
  } else if (r != NULL && r->origin == USMIPC__FOREIGN_ALIAS) {
    if (--r->alias_refs == 0) {
      usmipc__region_remove(r);
      free(r); /* the memory belongs to another library */
    }
  } else if (r != NULL && r->origin == USMIPC__IMPORTED_SYCL) {
    if (--r->open_refs == 0) {
      usmipc__region_remove(r);
      r->idle_next = NULL;
      evicted = r; /* unmapped below, once the lock is dropped */
    }
  } else if (r != NULL && r->origin == USMIPC__IMPORTED && r->open_refs > 0) {
    if (--r->open_refs == 0) {
      idle_push(r);
      evicted = idle_drop_dead(idle_evict_over_limit(), CLOSE_CHECKS);
      sweeper_ensure();
    }
  } else {
    rc = usmipc__fail(USMIPC_ENOTMAPPED,
                      "usmipc_ipc_close: %p is not an open IPC mapping (never "
                      "opened, or already closed as often as it was opened)",
                      ptr);
  }
  pthread_mutex_unlock(&usmipc__registry_lock);
  usmipc__unmap_list(evicted);
  if (release)
    usmipc__region_release_local(release);
  return rc;
}
