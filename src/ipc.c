/* IPC: the four calls of the seed (get a handle, open it, close the mapping,
 * free the handle data) and the per-process import cache.
 *
 * Export:  find the region -> check kind, device, range -> (first time) ask
 *          the backend for its payload and publish its fd -> encode.
 * Open:    decode -> check host, device, size -> same process? alias ->
 *          cache hit? take a reference -> else fetch the fd and let the
 *          backend map the whole allocation; cache it by exporter identity.
 * Close:   drop a reference; a mapping nobody uses waits in a bounded LRU so
 *          that opening it again is cheap, then is unmapped.
 *
 * The cache key is (exporter pid, exporter nonce, buffer id). Buffer ids are
 * never reused within an exporter, so a stale entry (the exporter freed and
 * reallocated at the same address) can never match a new handle. */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "blake2s.h"
#include "common.h"

#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif

/* A handle's bytes are data[0, len). An ordered handle's bytes are its base
 * bytes (kept at base, base_len) with an ordering record (and a release
 * ticket) appended, redone at every usmipc_ipc_handle_order; data has room
 * for the largest. */
#define ORDER_RECORD_MAX                                                       \
  (4 + USMIPC__ORDER_FIXED_LEN + USMIPC__EVENT_PAYLOAD_MAX + 4 +               \
   USMIPC__RELEASE_RECORD_LEN)
struct usmipc_ipc_handle {
  uint64_t foreign_id; /* the foreign export this handle holds, or 0 */
  usmipc_backend_t backend;
  bool is_event;
  usmipc__release_t *release; /* tickets handed out, or NULL */
  size_t len, base_len;
  uint8_t *base;
  uint8_t data[];
};

/* Memory of another library (a torch tensor, a CuPy array) exported by
 * pointer. The library cannot see that memory freed, so an export is not
 * tied to an allocation's life but to its holders: every handle made for
 * it holds one owner count (an IPCMemoryHandle in Python, a bundle or a
 * pickled handle in flight later), and the export-table slot is cleared
 * when the last one goes, or on usmipc_ipc_revoke. Importers then refuse
 * the old bytes even after the owner reuses the memory for another tensor.
 * Guarded by usmipc__registry_lock. */
typedef struct foreign_export {
  uint64_t id; /* never reused: a handle names its export by it */
  uint64_t buffer_id;
  const void *base;
  size_t size;
  usmipc_device_t *device;
  uint32_t slot, table_fd_number;
  uint8_t token[16];
  usmipc__payload_t payload;
  /* Memory made of physical chunks (CUDA VMM, docs/cuda.md): a descriptor
   * per chunk, which the transport hands out under one grant (token above)
   * and which are closed when the export dies; the first one's number and
   * file identity for the handle; for more than one chunk, record 0x8102. */
  int *fds;
  uint32_t nfds;
  uint32_t fd_number;
  uint64_t fd_dev, fd_ino;
  uint8_t *chunks_rec;
  uint16_t chunks_len;
  unsigned owners;
  struct foreign_export *next;
} foreign_export_t;

static foreign_export_t *foreign_exports;
static uint64_t next_foreign_id = 1;

/* Import cache: regions of origin IMPORTED sorted by key, plus the LRU list
 * of those with no open reference (most recently closed at the head). All
 * guarded by usmipc__registry_lock. */
static usmipc__region_t **imports;
static size_t import_count, import_capacity;
static usmipc__region_t *idle_head, *idle_tail;
static size_t idle_count, idle_bytes;
static size_t idle_limit = 64;
/* A closed mapping pins memory its exporter may already have freed (device
 * memory, on a GPU): the bytes kept idle are bounded too. */
static size_t idle_byte_limit = (size_t)1 << 30;
static bool drop_freed = true; /* USMIPC_IPC_CACHE_DROP_FREED=0: off */
static pthread_once_t cache_once = PTHREAD_ONCE_INIT;

static void env_size(const char *name, size_t *out) {
  const char *env = getenv(name);
  if (env != NULL && *env != '\0') {
    char *end;
    unsigned long long v = strtoull(env, &end, 10);
    if (*end == '\0' && env[0] != '-')
      *out = (size_t)v;
    else
      usmipc__env_malformed(name, env, "a count", "the default");
  }
}

static void cache_init(void) {
  env_size("USMIPC_IPC_CACHE_SIZE", &idle_limit);
  env_size("USMIPC_IPC_CACHE_BYTES", &idle_byte_limit);
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

/* Detaches idle mappings beyond the limits, least recently used first. */
static usmipc__region_t *idle_evict_over_limit(void) {
  usmipc__region_t *evicted = NULL;
  while (idle_count > idle_limit || idle_bytes > idle_byte_limit)
    idle_detach(idle_tail, &evicted);
  return evicted;
}

static void unmap_list(usmipc__region_t *list) {
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
 * only pin memory: detach them. A few loads per idle mapping, no system
 * call. Returns them as a list (linked by idle_next). Lock held. */
static usmipc__region_t *idle_drop_dead(usmipc__region_t *evicted) {
  if (!drop_freed)
    return evicted;
  for (usmipc__region_t *r = idle_head, *next; r; r = next) {
    next = r->idle_next;
    if (r->peer != NULL && !usmipc__peer_slot_live(r->peer, r->export_slot,
                                                   r->buffer_id, r->slot_tag))
      idle_detach(r, &evicted);
  }
  return evicted;
}

/* Unmaps every idle mapping, for an import that ran out of room: the cache
 * must never be why an open fails. Returns whether there was any. */
static bool idle_drop_all(void) {
  pthread_mutex_lock(&usmipc__registry_lock);
  usmipc__region_t *evicted = NULL;
  while (idle_tail != NULL)
    idle_detach(idle_tail, &evicted);
  pthread_mutex_unlock(&usmipc__registry_lock);
  unmap_list(evicted);
  return evicted != NULL;
}

/* Sets one of the cache's bounds and evicts what no longer fits. */
static int set_cache_limit(size_t *limit, size_t value) {
  pthread_once(&cache_once, cache_init);
  pthread_mutex_lock(&usmipc__registry_lock);
  *limit = value;
  usmipc__region_t *evicted = idle_evict_over_limit();
  pthread_mutex_unlock(&usmipc__registry_lock);
  unmap_list(evicted);
  return 0;
}

int usmipc_ipc_set_cache_size(size_t entries) {
  return set_cache_limit(&idle_limit, entries);
}

int usmipc_ipc_set_cache_bytes(size_t bytes) {
  return set_cache_limit(&idle_byte_limit, bytes);
}

/* ---- export -------------------------------------------------------------- */

/* First export of a region: the backend's payload and, for fd-backed memory,
 * a grant from the transport. Later exports reuse both, so an export after
 * the first is only an encode. Called with the registry lock held. */
static int export_region(usmipc__region_t *r) {
  int fd = -1;
  if (r->payload == NULL &&
      (r->payload = calloc(1, sizeof(*r->payload))) == NULL)
    return usmipc__fail(USMIPC_ENOMEM, "out of memory");
  int rc =
      r->device->ops->ipc_export(r->device->native, &r->alloc, r->payload, &fd);
  if (rc != 0)
    return rc;
  USMIPC__STAT_ADD(driver_exports, 1);
  r->fd_number = UINT32_MAX;
  if (fd >= 0) {
    usmipc__fd_grant_t grant;
    rc = usmipc__fdxfer_publish(fd, r->buffer_id, !r->alloc.fd_is_device_buffer,
                                &grant);
    if (rc != 0)
      return rc;
    memcpy(r->token, grant.token, 16);
    r->fd_number = grant.fd_number;
    r->fd_dev = grant.dev;
    r->fd_ino = grant.ino;
    r->fd_reopenable = grant.reopenable;
  }
  /* The export table lets importers refuse a handle of a freed allocation
   * without a round trip to this process; the broker hands it to importers
   * that cannot take it themselves. */
  if (fd < 0 && ((rc = usmipc__random(r->token, 16)) != 0 ||
                 (rc = usmipc__fdxfer_serve()) != 0))
    return rc;
  rc = usmipc__exports_add(r->buffer_id, r->fd_number, r->alloc.size,
                           usmipc__slot_tag(usmipc__self()->key, r->token),
                           &r->export_slot, &r->table_fd_number);
  if (rc != 0) {
    if (fd >= 0)
      usmipc__fdxfer_withdraw(r->buffer_id);
    return rc;
  }
  r->exported = true;
  return 0;
}

/* Checks an export request against the allocation and resolves nbytes == 0;
 * shared by usmipc's own and foreign allocations. */
static int check_export(const void *ptr, usmipc_device_t *device,
                        const usmipc__allocation_t *a, size_t *offset,
                        size_t *nbytes) {
  if (a->kind != USMIPC_MEM_DEVICE)
    return usmipc__fail(USMIPC_EMEMKIND,
                        "cannot export %p: only device memory can be shared "
                        "between processes, and this is %s memory",
                        ptr, a->kind == USMIPC_MEM_HOST ? "host" : "shared");
  if (!device->has_ipc)
    return usmipc__fail(USMIPC_ENOTSUP,
                        "cannot export %p: device %s does not support IPC "
                        "memory (check usmipc_device_has_ipc first)",
                        ptr, device->filter);
  *offset = (size_t)((uintptr_t)ptr - (uintptr_t)a->base);
  if (*nbytes == 0)
    *nbytes = a->size - *offset;
  if (*nbytes > a->size - *offset)
    return usmipc__fail(USMIPC_ERANGE,
                        "cannot export %zu bytes at offset %zu: the "
                        "allocation has only %zu bytes",
                        *nbytes, *offset, a->size);
  return 0;
}

/* Fills the fields every handle has, from this process and the allocation. */
static void wire_fill(usmipc__wire_t *w, usmipc_device_t *device,
                      const usmipc__allocation_t *a, uint64_t buffer_id,
                      size_t offset, size_t nbytes) {
  usmipc__wire_identity(w, device);
  w->fd_number = UINT32_MAX;
  w->export_slot = USMIPC__NO_SLOT;
  w->buffer_id = buffer_id;
  w->exporter_base = (uint64_t)(uintptr_t)a->base;
  w->allocation_size = a->size;
  w->offset = offset;
  w->nbytes = nbytes;
}

static int handle_new(const usmipc__wire_t *w, usmipc_ipc_handle_t **handle) {
  size_t len = usmipc__wire_len(w);
  size_t room = w->is_event ? len : len + ORDER_RECORD_MAX;
  usmipc_ipc_handle_t *h = malloc(sizeof(*h) + room + len);
  if (h == NULL)
    return usmipc__fail(USMIPC_ENOMEM, "out of memory");
  h->foreign_id = 0;
  h->release = NULL;
  h->backend = w->backend;
  h->is_event = w->is_event;
  h->len = h->base_len = len;
  h->base = h->data + room;
  usmipc__wire_encode(w, h->data);
  memcpy(h->base, h->data, len);
  *handle = h;
  return 0;
}

int usmipc__handle_from_wire(const usmipc__wire_t *w,
                             usmipc_ipc_handle_t **handle) {
  return handle_new(w, handle);
}

int usmipc_ipc_handle_order(usmipc_ipc_handle_t *handle,
                            usmipc_queue_t *queue) {
  return usmipc_ipc_handle_order_ex(handle, queue, 0);
}

int usmipc_ipc_handle_order_ex(usmipc_ipc_handle_t *handle,
                               usmipc_queue_t *queue, unsigned flags) {
  if (handle == NULL)
    return usmipc__fail(USMIPC_EINVAL, "usmipc_ipc_handle_order: NULL handle");
  if (flags & ~USMIPC_ORDER_RELEASE)
    return usmipc__fail(
        USMIPC_EINVAL, "usmipc_ipc_handle_order_ex: unknown flags 0x%x", flags);
  if (handle->is_event)
    return usmipc__fail(USMIPC_EINVAL,
                        "usmipc_ipc_handle_order: an event handle cannot be "
                        "ordered");
  if (queue != NULL && queue->device->ops->backend != handle->backend)
    return usmipc__fail(USMIPC_EWRONGDEVICE,
                        "usmipc_ipc_handle_order: the handle is of %s memory "
                        "but the queue is on %s",
                        usmipc_backend_name(handle->backend),
                        queue->device->filter);
  uint8_t rec[ORDER_RECORD_MAX];
  size_t rec_len = 0;
  int rc;
  if (queue != NULL && (rc = usmipc__event_order(queue, rec, &rec_len)) != 0)
    return rc;
  if ((flags & USMIPC_ORDER_RELEASE) &&
      (rc = usmipc__release_ticket(&handle->release, rec + rec_len,
                                   &rec_len)) != 0)
    return rc;
  handle->len = usmipc__wire_reorder(handle->data, handle->base,
                                     handle->base_len, rec, rec_len);
  return 0;
}

int usmipc_ipc_handle_releases(const usmipc_ipc_handle_t *handle,
                               uint64_t *sent, uint64_t *released) {
  if (handle == NULL)
    return usmipc__fail(USMIPC_EINVAL,
                        "usmipc_ipc_handle_releases: NULL handle");
  usmipc__release_counts(&handle->release, sent, released);
  return 0;
}

int usmipc_ipc_handle_wait_released(usmipc_ipc_handle_t *handle,
                                    usmipc_queue_t *queue) {
  if (handle == NULL)
    return usmipc__fail(USMIPC_EINVAL,
                        "usmipc_ipc_handle_wait_released: NULL handle");
  return usmipc__release_wait(&handle->release, queue);
}

int usmipc_ipc_release(const void *data, size_t len, usmipc_queue_t *queue) {
  usmipc__wire_t w;
  int rc;
  if (usmipc__bundle_magic(data, len)) {
    /* Bundle bytes: their ticket rides after the tree as if appended to
     * allocation 0's handle, which names the producer; from here on a
     * bundle's ticket goes back exactly as a handle's does. */
    bool no_memory = false;
    if ((rc = usmipc__bundle_ticket(data, len, &w, &no_memory)) != 0)
      return rc;
    if (no_memory)
      return 0; /* a bundle of no memory: nothing was lent */
  } else {
    if ((rc = usmipc__wire_decode(data, len, &w)) != 0)
      return rc;
    if (!w.has_release)
      return usmipc__fail(USMIPC_EINVAL,
                          "usmipc_ipc_release: the handle asks for no release "
                          "(its producer did not order it with "
                          "USMIPC_ORDER_RELEASE)");
  }
  const usmipc__process_t *self = usmipc__self_basic();
  if (memcmp(w.boot_id, self->boot_id, 16) != 0)
    return usmipc__fail(USMIPC_EOTHERHOST,
                        "the handle was exported on another machine or boot");
  /* The body: the ticket and, when the consumer's work is on a device
   * queue, the handle of an event recorded after it. */
  uint8_t body[USMIPC__RELEASE_BODY_MAX];
  size_t ev_len = 0;
  usmipc__put64le(body, w.release_ticket);
  if (queue != NULL && queue->device->ops->event_create != NULL &&
      (rc = usmipc__event_ring_handle(queue, body + 10, &ev_len)) != 0)
    return rc;
  usmipc__put16le(body + 8, (uint16_t)ev_len);
  if (w.nonce == self->nonce && w.pid == self->pid) {
    /* Our own handoff: file the ticket directly, as the broker would. */
    uint8_t req[USMIPC__REQUEST_LEN], nonce[16] = {0};
    usmipc__wire_t named = w;
    named.buffer_id = w.release_id;
    usmipc__request_build(req, &named, USMIPC__WANT_RELEASE, nonce);
    usmipc__release_capability(req, w.release_token, body, 10 + ev_len,
                               req + 64);
    uint32_t status = usmipc__release_arrived(req, body, 10 + ev_len);
    /* The codes and reasons of the broker's answer (usmipc__reply_check). */
    if (status == 0)
      return 0;
    if (status == 1)
      return usmipc__fail(USMIPC_EEXPORTERGONE,
                          "usmipc_ipc_release: this process no longer waits "
                          "for that release (its handle or bundle was "
                          "freed)");
    if (status == 2)
      return usmipc__fail(USMIPC_EACCES,
                          "usmipc_ipc_release: the release ticket's token is "
                          "wrong for its ticket number (forged, edited or "
                          "corrupted bytes: each handoff's bytes return only "
                          "their own ticket)");
    return usmipc__fail(USMIPC_EBADHANDLE,
                        "usmipc_ipc_release: the ticket was never handed out "
                        "(forged), or the consumer's event handle is "
                        "malformed");
  }
  rc = usmipc__broker_release(&w, body, 10 + ev_len,
                              usmipc__deadline_after_timeout());
  if (rc != 0)
    usmipc__error_prefix("returning a release ticket to process %u: ", w.pid);
  return rc;
}

/* The identity of a run of chunks in handles and import caches: one chunk
 * is its own identity; several, a digest of theirs in order (chunk ids are
 * never reused, so neither is a run's, and a run of the same chunks has the
 * same id whenever it is exported, which lets importers keep its mapping). */
static uint64_t run_id(const usmipc__chunk_run_t *run) {
  if (run->count == 1)
    return usmipc__foreign_buffer_id(run->ids[0]);
  uint8_t label[16 + 4] = "usmipc-vmm-run-1";
  usmipc__put32le(label + 16, run->count);
  usmipc__blake2s_t st;
  uint8_t out[8];
  usmipc__blake2s_init(&st, sizeof(out), NULL, 0);
  usmipc__blake2s_update(&st, label, sizeof(label));
  for (uint32_t i = 0; i < run->count; i++) {
    uint8_t id[8];
    usmipc__put64le(id, run->ids[i]);
    usmipc__blake2s_update(&st, id, sizeof(id));
  }
  usmipc__blake2s_final(&st, out);
  uint64_t v = usmipc__foreign_buffer_id(usmipc__get64le(out));
  return v != 0 ? v : 1;
}

/* Memory in chunks: the run of whole chunks under [ptr, ptr + nbytes)
 * (nbytes 0: to the end of the chunk holding ptr) becomes the allocation
 * the handle names. *run is malloc'd. */
static int describe_chunks(const void *ptr, size_t nbytes,
                           usmipc_device_t *device, usmipc__allocation_t *a,
                           uint64_t *buffer_id, usmipc__chunk_run_t **run) {
  const usmipc__backend_ops_t *ops = device->ops;
  if (ops->foreign_chunks == NULL || ops->chunks_export == NULL ||
      ops->ipc_import_chunks == NULL)
    return usmipc__fail(USMIPC_ENOTSUP,
                        "cannot export %p: %s cannot share memory in chunks",
                        ptr, device->filter);
  if (nbytes == 0)
    nbytes = a->size - (size_t)((uintptr_t)ptr - (uintptr_t)a->base);
  if ((uintptr_t)ptr + nbytes < (uintptr_t)ptr)
    return usmipc__fail(USMIPC_ERANGE, "cannot export %zu bytes at %p", nbytes,
                        ptr);
  if ((*run = malloc(sizeof(**run))) == NULL)
    return usmipc__fail(USMIPC_ENOMEM, "out of memory");
  int rc = ops->foreign_chunks(device->native, ptr, nbytes, *run);
  if (rc != 0) {
    free(*run);
    *run = NULL;
    return rc;
  }
  a->base = (*run)->base;
  a->size = (size_t)(*run)->size;
  *buffer_id = run_id(*run);
  return 0;
}

/* A new export of a run of chunks: a descriptor per chunk, all published
 * under one grant (one token: the capability the broker checks), and the
 * chunk record for more than one. Lock held. */
static int export_chunks(usmipc_device_t *device, usmipc__chunk_run_t *run,
                         uint64_t buffer_id, foreign_export_t *e) {
  int rc = device->ops->chunks_export(device->native, run, &e->payload);
  if (rc != 0)
    return rc;
  USMIPC__STAT_ADD(driver_exports, run->count);
  if ((e->fds = malloc(run->count * sizeof(int))) == NULL) {
    rc = usmipc__fail(USMIPC_ENOMEM, "out of memory");
  } else if (run->count > 1) {
    uint8_t rec[USMIPC__CHUNKS_RECORD_MAX];
    size_t len = usmipc__chunks_record(run->sizes, run->count, rec);
    if (len == 0)
      rc = usmipc__fail(USMIPC_ENOTSUP,
                        "cannot export %p: its %u chunks come in more than %d "
                        "different sizes in a row, more than one handle "
                        "describes; export it in parts",
                        run->base, run->count, USMIPC__CHUNK_RUNS_MAX);
    else if ((e->chunks_rec = malloc(len)) == NULL)
      rc = usmipc__fail(USMIPC_ENOMEM, "out of memory");
    else {
      memcpy(e->chunks_rec, rec, len);
      e->chunks_len = (uint16_t)len;
    }
  }
  usmipc__fd_grant_t grant;
  if (rc == 0 && (rc = usmipc__fdxfer_publish_fds(
                      run->fds, run->count, buffer_id, false, &grant)) == 0) {
    memcpy(e->fds, run->fds, run->count * sizeof(int));
    e->nfds = run->count;
    memcpy(e->token, grant.token, 16);
    e->fd_number = grant.fd_number;
    e->fd_dev = grant.dev;
    e->fd_ino = grant.ino;
    return 0;
  }
  for (uint32_t i = 0; i < run->count; i++)
    close(run->fds[i]);
  free(e->fds);
  e->fds = NULL;
  free(e->chunks_rec);
  e->chunks_rec = NULL;
  return rc;
}

/* Releases what an export holds: the slot first (importers refuse from now
 * on), then the grant, then its descriptors (linux/exports.c: a slot is
 * cleared before its descriptor is closed). Lock held. */
static void foreign_release(foreign_export_t *e, bool slotted) {
  if (slotted)
    usmipc__exports_remove(e->slot);
  if (e->nfds > 0)
    usmipc__fdxfer_withdraw(e->buffer_id);
  for (uint32_t i = 0; i < e->nfds; i++)
    close(e->fds[i]);
  free(e->fds);
  free(e->chunks_rec);
  free(e);
}

/* Memory another library allocated: the driver names its allocation and
 * buffer id; the export lives as long as handles hold it (see
 * foreign_export_t). */
static int export_foreign(const void *ptr, size_t nbytes,
                          usmipc_ipc_handle_t **handle) {
  usmipc__allocation_t a = {0};
  uint64_t buffer_id;
  usmipc_device_t *device;
  size_t offset;
  usmipc__chunk_run_t *run = NULL;
  int rc = usmipc__foreign_query_unlocked(ptr, &a, &buffer_id, &device);
  if (rc != 0) {
    usmipc__error_prefix("cannot export: ");
    return rc;
  }
  /* Chunks are looked up without the lock: the driver calls are many. */
  if (a.chunked &&
      (rc = describe_chunks(ptr, nbytes, device, &a, &buffer_id, &run)) != 0)
    return rc;
  rc = check_export(ptr, device, &a, &offset, &nbytes);
  if (rc != 0) {
    free(run);
    return rc;
  }
  usmipc__wire_t w;
  wire_fill(&w, device, &a, buffer_id, offset, nbytes);
  pthread_mutex_lock(&usmipc__registry_lock);
  foreign_export_t *e = foreign_exports;
  while (e && !(e->buffer_id == buffer_id && e->base == a.base &&
                e->size == a.size && e->device == device))
    e = e->next;
  if (e == NULL) {
    int fd = -1;
    e = calloc(1, sizeof(*e));
    if (e == NULL)
      rc = usmipc__fail(USMIPC_ENOMEM, "out of memory");
    else if (run != NULL)
      rc = export_chunks(device, run, buffer_id, e);
    else if ((rc = device->ops->ipc_export(device->native, &a, &e->payload,
                                           &fd)) == 0 &&
             (USMIPC__STAT_ADD(driver_exports, 1), fd >= 0))
      rc = usmipc__fail(USMIPC_ENOTSUP,
                        "cannot export %p: memory of another library shared "
                        "through a descriptor is not supported",
                        ptr);
    if (rc == 0 && run == NULL && (rc = usmipc__random(e->token, 16)) == 0)
      rc = usmipc__fdxfer_serve();
    if (rc == 0)
      rc = usmipc__exports_add(buffer_id,
                               e->nfds > 0 ? e->fd_number : UINT32_MAX, a.size,
                               usmipc__slot_tag(usmipc__self()->key, e->token),
                               &e->slot, &e->table_fd_number);
    if (rc != 0) {
      if (e != NULL) {
        e->buffer_id = buffer_id; /* the grant foreign_release withdraws */
        foreign_release(e, false);
      }
      pthread_mutex_unlock(&usmipc__registry_lock);
      free(run);
      return rc;
    }
    e->id = next_foreign_id++;
    e->buffer_id = buffer_id;
    e->base = a.base;
    e->size = a.size;
    e->device = device;
    e->next = foreign_exports;
    foreign_exports = e;
  }
  free(run);
  w.export_slot = e->slot;
  w.table_fd_number = e->table_fd_number;
  memcpy(w.token, e->token, 16);
  if (e->nfds > 0) {
    w.flags = USMIPC__WIRE_FLAG_FD;
    w.fd_number = e->fd_number;
    w.fd_dev = e->fd_dev;
    w.fd_ino = e->fd_ino;
  }
  if (usmipc__fdxfer_socket_dir())
    w.flags |= USMIPC__WIRE_FLAG_SOCKET_DIR;
  if (e->chunks_len > 0) /* a run's record */
    memcpy(w.ext, e->chunks_rec, e->chunks_len);
  w.ext_len = e->chunks_len;
  rc = usmipc__wire_set_payload(&w, &e->payload);
  if (rc == 0)
    rc = handle_new(&w, handle);
  if (rc == 0) {
    e->owners++;
    (*handle)->foreign_id = e->id;
  }
  pthread_mutex_unlock(&usmipc__registry_lock);
  return rc;
}

/* Unlinks a foreign export and releases it; lock held. */
static void foreign_revoke(foreign_export_t **link) {
  foreign_export_t *e = *link;
  *link = e->next;
  foreign_release(e, true);
}

static int get_handle(const void *ptr, size_t nbytes, bool whole,
                      usmipc_ipc_handle_t **handle);

int usmipc_ipc_get_handle(const void *ptr, size_t nbytes,
                          usmipc_ipc_handle_t **handle) {
  return get_handle(ptr, nbytes, false, handle);
}

int usmipc__export_allocation(const void *base, size_t nbytes,
                              usmipc_ipc_handle_t **handle,
                              usmipc__allocation_ref_t *ref) {
  int rc = get_handle(base, nbytes, true, handle);
  for (int again = 0; rc == 0; again++) {
    /* The handle says what it exports: its fixed fields (handle.c). */
    usmipc__wire_extent_t x;
    usmipc__wire_extent((*handle)->data, &x);
    ref->buffer_id = x.buffer_id;
    ref->base = (uintptr_t)x.base;
    ref->size = x.allocation_size;
    if (x.offset == 0 && x.nbytes == x.allocation_size)
      return 0;
    /* A run of chunks ends with a whole chunk: export it whole (the same
     * export, found while the first handle still holds it: no new driver
     * call). */
    usmipc_ipc_handle_t *first = *handle;
    *handle = NULL;
    if (again) {
      usmipc_ipc_free_handle(first);
      return usmipc__fail(USMIPC_EBACKEND,
                          "exporting %p: the whole allocation could not be "
                          "exported as one",
                          base);
    }
    rc = get_handle((const void *)ref->base, ref->size, true, handle);
    usmipc_ipc_free_handle(first);
  }
  return rc;
}

int usmipc__allocation_of(const void *ptr, usmipc__allocation_ref_t *ref) {
  pthread_mutex_lock(&usmipc__registry_lock);
  usmipc__region_t *r = usmipc__region_find(ptr);
  if (r != NULL && r->origin == USMIPC__LOCAL && !r->user_freed) {
    ref->chunked = false;
    ref->buffer_id = r->buffer_id;
    ref->base = (uintptr_t)r->alloc.base;
    ref->size = r->alloc.size;
    ref->device = r->device;
    pthread_mutex_unlock(&usmipc__registry_lock);
    return 0;
  }
  bool imported = r != NULL && (r->origin == USMIPC__IMPORTED ||
                                r->origin == USMIPC__IMPORTED_SYCL);
  pthread_mutex_unlock(&usmipc__registry_lock);
  if (imported)
    return usmipc__fail(USMIPC_ENOTSUP,
                        "cannot export %p: it is an IPC mapping of another "
                        "process's memory; forward the original handle bytes",
                        ptr);
  usmipc__allocation_t a = {0};
  int rc =
      usmipc__foreign_query_unlocked(ptr, &a, &ref->buffer_id, &ref->device);
  if (rc != 0)
    return rc;
  ref->base = (uintptr_t)a.base;
  ref->size = a.size;
  ref->chunked = a.chunked;
  return 0;
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

static int get_handle(const void *ptr, size_t nbytes, bool whole,
                      usmipc_ipc_handle_t **handle) {
  if (handle == NULL)
    return usmipc__fail(USMIPC_EINVAL, "usmipc_ipc_get_handle: handle is NULL");
  *handle = NULL;
  pthread_mutex_lock(&usmipc__registry_lock);
  usmipc__region_t *r = usmipc__region_find(ptr);
  if (r != NULL && r->origin == USMIPC__LOCAL && !r->exported &&
      r->device->ops->ipc_check != NULL) {
    /* A first export asks the backend whether its IPC may be used (Level
     * Zero's self-test runs then: it spawns a process and opens its
     * memory, so never under the registry lock). Later exports skip this. */
    usmipc_device_t *dev = r->device;
    pthread_mutex_unlock(&usmipc__registry_lock);
    int rc = dev->ops->ipc_check(dev->native);
    if (rc != 0)
      return rc;
    pthread_mutex_lock(&usmipc__registry_lock);
    r = usmipc__region_find(ptr);
  }
  if (r == NULL || r->origin == USMIPC__FOREIGN_ALIAS) {
    pthread_mutex_unlock(&usmipc__registry_lock);
    return export_foreign(ptr, nbytes, handle);
  }
  size_t offset;
  int rc = 0;
  uint8_t block_rec[4 + USMIPC__BLOCK_RECORD_LEN];
  size_t block_len = 0;
  if (r->origin == USMIPC__IMPORTED)
    rc = usmipc__fail(USMIPC_ENOTSUP,
                      "cannot export %p: it is an IPC mapping of another "
                      "process's memory; forward the original handle bytes",
                      ptr);
  else if (r->user_freed)
    rc =
        usmipc__fail(USMIPC_EUNKNOWNPTR, "cannot export %p: it was freed", ptr);
  else if (r->pool_segment != NULL && !whole &&
           (rc = usmipc__pool_export(r->pool_segment, ptr, &nbytes, block_rec,
                                     &block_len)) != 0)
    usmipc__error_prefix("exporting %p: ", ptr);
  else if ((rc = check_export(ptr, r->device, &r->alloc, &offset, &nbytes)) ==
               0 &&
           !r->exported && (rc = export_region(r)) != 0)
    usmipc__error_prefix("exporting %p: ", ptr);
  if (rc != 0) {
    pthread_mutex_unlock(&usmipc__registry_lock);
    return rc;
  }
  usmipc__wire_t w;
  wire_fill(&w, r->device, &r->alloc, r->buffer_id, offset, nbytes);
  w.export_slot = r->export_slot;
  w.table_fd_number = r->table_fd_number;
  if (r->alloc.fd >= 0) {
    w.flags = USMIPC__WIRE_FLAG_FD |
              (r->fd_reopenable ? USMIPC__WIRE_FLAG_REOPENABLE : 0);
    w.fd_number = r->fd_number;
    w.fd_dev = r->fd_dev;
    w.fd_ino = r->fd_ino;
  }
  memcpy(w.token, r->token, 16); /* every export has one (its slot's tag) */
  if (usmipc__fdxfer_socket_dir())
    w.flags |= USMIPC__WIRE_FLAG_SOCKET_DIR;
  memcpy(w.ext, block_rec, block_len); /* a pool block's record, or none */
  w.ext_len = (uint16_t)block_len;
  rc = usmipc__wire_set_payload(&w, r->payload);
  pthread_mutex_unlock(&usmipc__registry_lock);
  return rc != 0 ? rc : handle_new(&w, handle);
}

int usmipc_ipc_handle_data(const usmipc_ipc_handle_t *handle, const void **data,
                           size_t *len) {
  if (handle == NULL || data == NULL || len == NULL)
    return usmipc__fail(USMIPC_EINVAL, "usmipc_ipc_handle_data: NULL argument");
  *data = handle->data;
  *len = handle->len;
  return 0;
}

int usmipc_ipc_free_handle(usmipc_ipc_handle_t *handle) {
  /* The export of usmipc's own memory belongs to the allocation, not to the
   * handle: bytes already sent stay openable until the allocation is freed
   * (or revoked). A foreign export belongs to its handles: the last one
   * revokes it. */
  if (handle != NULL)
    usmipc__release_free(handle->release);
  if (handle != NULL && handle->foreign_id != 0) {
    pthread_mutex_lock(&usmipc__registry_lock);
    for (foreign_export_t **e = &foreign_exports; *e; e = &(*e)->next)
      if ((*e)->id == handle->foreign_id) {
        if (--(*e)->owners == 0)
          foreign_revoke(e);
        break;
      }
    pthread_mutex_unlock(&usmipc__registry_lock);
  }
  free(handle);
  return 0;
}

int usmipc_ipc_revoke(const void *ptr) {
  int revoked = 0;
  uint64_t withdraw = 0;
  pthread_mutex_lock(&usmipc__registry_lock);
  usmipc__region_t *r = usmipc__region_find(ptr);
  if (r != NULL && r->origin == USMIPC__LOCAL && r->exported) {
    /* The slot first (importers refuse from now on), then the grant; the
     * next export draws a new token, so its handles differ. */
    usmipc__exports_remove(r->export_slot);
    if (r->alloc.fd >= 0)
      withdraw = r->buffer_id;
    r->exported = false;
    revoked = 1;
  }
  for (foreign_export_t **e = &foreign_exports; *e;) {
    if ((uintptr_t)ptr - (uintptr_t)(*e)->base < (*e)->size) {
      foreign_revoke(e);
      revoked = 1;
    } else {
      e = &(*e)->next;
    }
  }
  if (withdraw != 0) /* under the lock: a re-export must not race it */
    usmipc__fdxfer_withdraw(withdraw);
  pthread_mutex_unlock(&usmipc__registry_lock);
  if (!revoked)
    return usmipc__fail(USMIPC_EUNKNOWNPTR,
                        "usmipc_ipc_revoke: nothing is exported at %p", ptr);
  return 0;
}

/* ---- open and close ------------------------------------------------------ */

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
  for (foreign_export_t *e = foreign_exports; e && !current; e = e->next)
    current = r->origin == USMIPC__FOREIGN_ALIAS && e->base == base &&
              e->slot == w->export_slot && memcmp(e->token, w->token, 16) == 0;
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

int usmipc__peer_slot_state(const usmipc__wire_t *w, uint32_t slot, uint64_t id,
                            const uint8_t token[16], const uint64_t *size,
                            int *state) {
  usmipc__peer_t *peer;
  int fd = -1;
  int rc = usmipc__peer_get(w, usmipc__deadline_after_timeout(), &peer, &fd);
  if (rc != 0)
    return rc;
  if (fd >= 0)
    close(fd);
  usmipc__export_slot_t s;
  const uint8_t *table = usmipc__peer_table(peer);
  int read = usmipc__table_read_slot(table, slot, &s, NULL);
  if (read == USMIPC_EBADHANDLE) { /* a slot beyond the table: forged */
    usmipc__peer_put(peer);
    return read;
  }
  *state = read == 0 && s.buffer_id == id &&
                   s.tag == usmipc__slot_tag(w->key, token) &&
                   (size == NULL || s.size == *size)
               ? 1
           : usmipc__table_alive(table) ? 0
                                        : -1;
  usmipc__peer_put(peer);
  return 0;
}

/* A pool block's handle: the block must still be allocated (its own slot
 * in the exporter's table), although its segment is mapped or mappable. */
static int check_block(const usmipc__wire_t *w) {
  const usmipc__process_t *self = usmipc__self_basic();
  if (w->nonce == self->nonce && w->pid == self->pid) {
    pthread_mutex_lock(&usmipc__registry_lock);
    usmipc__region_t *r =
        usmipc__region_find((const void *)(uintptr_t)w->exporter_base);
    void *segment =
        r && r->origin == USMIPC__LOCAL && r->buffer_id == w->buffer_id
            ? r->pool_segment
            : NULL;
    /* Under the registry lock: the segment cannot go away meanwhile. */
    int live = segment != NULL && usmipc__pool_block_live(segment, w);
    pthread_mutex_unlock(&usmipc__registry_lock);
    if (live)
      return 0;
    return usmipc__fail(USMIPC_EEXPORTERGONE,
                        "the pool block this handle names has been freed "
                        "(this process exported it)");
  }
  /* The slot's tag binds the record to the segment, offset and size it was
   * issued for: a record moved to another segment or block is refused. */
  uint8_t bound[16];
  usmipc__pool_block_slot_token(w->block_token, w->buffer_id, w->block_offset,
                                w->block_size, bound);
  int state;
  int rc = usmipc__peer_slot_state(w, w->block_slot, w->block_id, bound,
                                   &w->block_size, &state);
  if (rc != 0 || state > 0)
    return rc;
  return usmipc__fail(USMIPC_EEXPORTERGONE,
                      state == 0
                          ? "process %u freed the pool block this handle "
                            "names (or the handle's block record is forged)"
                          : "process %u, which exported the pool block, has "
                            "exited",
                      w->pid);
}

/* A pool segment opens only through a live block: its bare handle (the
 * block record cut off, the checksum recomputed) would map the whole
 * segment for as long as the segment lives, whatever was freed and reused
 * in it. Segment ids carry USMIPC__POOL_SEGMENT_ID, and the exporter's
 * table states the id, so clearing the bit makes the handle name nothing;
 * an id with the bit that the exporter does not export is reported as
 * such. Bundles map segments whole through usmipc__open_mapping: their own
 * slot is their capability. (test: pool_block_record_forged) */
static int refuse_bare_segment(const usmipc__wire_t *w) {
  const usmipc__process_t *self = usmipc__self_basic();
  int state = 1;
  if (w->nonce == self->nonce && w->pid == self->pid) {
    pthread_mutex_lock(&usmipc__registry_lock);
    usmipc__region_t *r =
        usmipc__region_find((const void *)(uintptr_t)w->exporter_base);
    state = r != NULL && r->origin == USMIPC__LOCAL &&
            r->buffer_id == w->buffer_id && r->pool_segment != NULL;
    pthread_mutex_unlock(&usmipc__registry_lock);
  } else if (w->export_slot >= USMIPC__TABLE_SLOTS) {
    state = 0;
  } else {
    uint64_t size = w->allocation_size;
    int rc = usmipc__peer_slot_state(w, w->export_slot, w->buffer_id, w->token,
                                     &size, &state);
    if (rc != 0)
      return rc;
  }
  if (state < 0)
    return usmipc__fail_exporter_exited(w, 0);
  if (state == 0)
    return usmipc__fail(USMIPC_EEXPORTERGONE,
                        "process %u does not export the memory this handle "
                        "names (freed, revoked, or the handle is forged)",
                        w->pid);
  return usmipc__fail(USMIPC_EBADHANDLE,
                      "not a valid usmipc IPC handle: it names a pool segment "
                      "of process %u but carries no pool block record "
                      "(0x8101); open the handle of a block, as the exporter "
                      "made it",
                      w->pid);
}

int usmipc__open_wire(const usmipc__wire_t *w, usmipc_device_t *device,
                      void **ptr) {
  return usmipc__open_mapping(w, device, 0, -1, ptr, NULL);
}

int usmipc_ipc_open(const void *data, size_t len, usmipc_device_t *device,
                    size_t nbytes, void **ptr, size_t *mapped_nbytes) {
  return usmipc_ipc_open_ex(data, len, device, nbytes, NULL, 0, ptr,
                            mapped_nbytes);
}

int usmipc_ipc_open_ex(const void *data, size_t len, usmipc_device_t *device,
                       size_t nbytes, usmipc_queue_t *queue, unsigned flags,
                       void **ptr, size_t *mapped_nbytes) {
  if (ptr == NULL)
    return usmipc__fail(USMIPC_EINVAL, "usmipc_ipc_open: ptr is NULL");
  *ptr = NULL;
  if (flags & ~USMIPC_OPEN_UNORDERED)
    return usmipc__fail(USMIPC_EINVAL, "usmipc_ipc_open_ex: unknown flags 0x%x",
                        flags);
  usmipc__wire_t w;
  int rc = usmipc__wire_decode(data, len, &w);
  if (rc != 0)
    return rc;
  if (w.is_event)
    return usmipc__fail(USMIPC_EINVAL,
                        "these are the bytes of an event handle, not of "
                        "memory; open them with usmipc_ipc_open_event");
  if (queue != NULL && device != NULL && queue->device != device)
    return usmipc__fail(USMIPC_EINVAL,
                        "usmipc_ipc_open_ex: the queue is on %s, not on the "
                        "target device %s",
                        queue->device->filter, device->filter);
  if (device == NULL && queue != NULL)
    device = queue->device;
  if ((w.buffer_id & USMIPC__POOL_SEGMENT_ID) && !w.has_block)
    return refuse_bare_segment(&w);
  if (w.has_block && (rc = check_block(&w)) != 0)
    return rc;
  if ((rc = usmipc__open_mapping(&w, device, nbytes, -1, ptr, mapped_nbytes)) !=
          0 ||
      w.order_len == 0 || (flags & USMIPC_OPEN_UNORDERED))
    return rc;
  /* Ordered: the consumer's work (or the host) waits for the producer's.
   * The mapping is made first, so that a slow producer overlaps it. */
  usmipc__wire_t ev;
  usmipc__wire_order_event(&w, &ev);
  rc = usmipc__event_wait_wire(&ev, device, queue);
  if (rc != 0) {
    usmipc__error_prefix("waiting for the producer's work: ");
    usmipc_ipc_close(*ptr);
    *ptr = NULL;
  }
  return rc;
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
    unmap_list(r);
    return rc;
  }
  rc = usmipc__region_insert(r);
  if (rc == 0 && (rc = import_insert(r)) != 0)
    usmipc__region_remove(r);
  pthread_mutex_unlock(&usmipc__registry_lock);
  if (rc != 0) {
    r->idle_next = NULL;
    unmap_list(r);
    return rc;
  }
  *ptr = (uint8_t *)r->alloc.base + w->offset;
  return 0;
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
      evicted = idle_drop_dead(idle_evict_over_limit());
    }
  } else {
    rc = usmipc__fail(USMIPC_ENOTMAPPED,
                      "usmipc_ipc_close: %p is not an open IPC mapping (never "
                      "opened, or already closed as often as it was opened)",
                      ptr);
  }
  pthread_mutex_unlock(&usmipc__registry_lock);
  unmap_list(evicted);
  if (release)
    usmipc__region_release_local(release);
  return rc;
}

/* ---- memory a SYCL program exported ---------------------------------------
 * The blob names the exporter by pid only; its dma-buf is taken with
 * pidfd_getfd by its number there. What can be checked is: the pid's
 * process runs as this process's uid (the uid rule of every other path: a
 * root importer must not map another user's buffer, which that user could
 * truncate under it, SIGBUS), the pid is in this PID namespace (else it
 * names another process), the descriptor is a dma-buf large enough for the
 * allocation (the backend checks), the memory is device memory. The uid is
 * read before the descriptor is taken, through a pidfd opened first, so a
 * pid reused in between cannot answer for the process the descriptor comes
 * from (usmipc__pidfd_euid). Tests: level_zero.sycl_blob (other uids). */
static int sycl_exporter_gone(uint32_t pid) {
  return usmipc__fail(USMIPC_EEXPORTERGONE,
                      "no process %u here: the SYCL exporter exited, or it "
                      "runs in another PID namespace (a container), where "
                      "its pid names another process",
                      pid);
}

static int sycl_take_fd(const usmipc__umf_blob_t *b, int *out) {
  *out = -1;
  if (b->pid == (uint32_t)getpid()) {
    int fd = fcntl((int)b->fd_number, F_DUPFD_CLOEXEC, 3);
    if (fd < 0)
      return usmipc__fail_native(USMIPC_EEXPORTERGONE, errno,
                                 "this process holds no descriptor %u: the "
                                 "SYCL allocation was freed",
                                 b->fd_number);
    *out = fd;
    return 0;
  }
  int pidfd = (int)syscall(SYS_pidfd_open, (pid_t)b->pid, 0);
  if (pidfd < 0) {
    if (errno == ESRCH)
      return sycl_exporter_gone(b->pid);
    return usmipc__fail_native(USMIPC_ETRANSPORT, errno,
                               "pidfd_open(%u) failed: %s", b->pid,
                               strerror(errno));
  }
  /* The uid first: another user's /proc/<pid>/ns/pid is unreadable, which
   * the namespace check below would report as no process at all. This
   * process's own euid now, not as first seen: a program may drop
   * privileges after its first call. */
  uint32_t uid, me = (uint32_t)geteuid();
  int e = usmipc__pidfd_euid(pidfd, b->pid, &uid);
  if (e != 0) {
    close(pidfd);
    if (e == -ESRCH)
      return sycl_exporter_gone(b->pid);
    return usmipc__fail_native(USMIPC_ETRANSPORT, -e,
                               "cannot read the uid of process %u: %s", b->pid,
                               strerror(-e));
  }
  if (uid != me) {
    close(pidfd);
    return usmipc__fail(
        USMIPC_EACCES,
        "the SYCL handle names process %u, which runs as uid %u, and this "
        "process runs as uid %u: IPC memory is shared only between processes "
        "of the same user, root included (if the exporter runs in another "
        "PID namespace, its pid names another process here)",
        b->pid, uid, me);
  }
  char pid[16];
  snprintf(pid, sizeof(pid), "%u", b->pid);
  uint64_t theirs = usmipc__ns_inode(pid, "pid"),
           mine = usmipc__ns_inode("self", "pid");
  if (theirs == 0) {
    close(pidfd);
    return sycl_exporter_gone(b->pid);
  }
  if (mine == 0 || theirs != mine) {
    close(pidfd);
    return usmipc__fail(USMIPC_ENAMESPACE,
                        "process %u is in another PID namespace than this "
                        "process: the pid in a SYCL handle is the exporter's "
                        "own, which this process cannot trust to name it; "
                        "run both in one PID namespace",
                        b->pid);
  }
  int rc = usmipc__pidfd_take(pidfd, b->pid, b->fd_number, out);
  close(pidfd);
  if (rc == USMIPC_EACCES) /* the transport's advice does not apply here */
    return usmipc__fail(
        USMIPC_EACCES,
        "pidfd_getfd(2) may not take the descriptor from the SYCL exporter %u: "
        "it needs ptrace rights, which Intel's driver grants every process of "
        "the user (PR_SET_PTRACER_ANY) only from compute-runtime 26.09 (Xe2) "
        "or 26.31; under Yama ptrace_scope=1 the exporter must allow it",
        b->pid);
  return rc;
}

int usmipc_ipc_open_sycl(const void *data, size_t len, usmipc_device_t *device,
                         size_t nbytes, void **ptr, size_t *mapped_nbytes) {
  if (ptr == NULL)
    return usmipc__fail(USMIPC_EINVAL, "usmipc_ipc_open_sycl: ptr is NULL");
  *ptr = NULL;
  usmipc__umf_blob_t b;
  int rc = usmipc__umf_blob_parse(data, len, &b);
  if (rc != 0)
    return rc;
  if (device == NULL &&
      (rc = usmipc_device_select("level_zero:gpu:0", &device)) != 0) {
    usmipc__error_prefix("opening a SYCL handle: ");
    return rc;
  }
  if (device->ops->ipc_import_sycl == NULL)
    return usmipc__fail(USMIPC_EWRONGDEVICE,
                        "a SYCL handle holds Level Zero memory; open it on a "
                        "level_zero device, not on %s",
                        device->filter);
  if (device->ops->ipc_check != NULL &&
      (rc = device->ops->ipc_check(device->native)) != 0)
    return rc;
  uint64_t avail = b.base_size - b.offset;
  if (nbytes == 0)
    nbytes = (size_t)avail;
  else if (nbytes > avail)
    return usmipc__fail(USMIPC_ERANGE,
                        "cannot open %zu bytes: the SYCL allocation has %llu "
                        "bytes from the exported pointer on",
                        nbytes, (unsigned long long)avail);
  int fd;
  if ((rc = sycl_take_fd(&b, &fd)) != 0)
    return rc;
  usmipc__region_t *r = calloc(1, sizeof(*r));
  if (r == NULL) {
    close(fd);
    return usmipc__fail(USMIPC_ENOMEM, "out of memory");
  }
  r->alloc.fd = -1;
  rc = device->ops->ipc_import_sycl(device->native, &b, fd, &r->alloc);
  USMIPC__STAT_ADD(driver_imports, 1);
  close(fd);
  if (rc != 0) {
    free(r);
    usmipc__error_prefix("opening the SYCL handle of process %u: ", b.pid);
    return rc;
  }
  r->device = device;
  r->origin = USMIPC__IMPORTED_SYCL;
  r->buffer_id = b.handle_id;
  r->open_refs = 1;
  pthread_mutex_lock(&usmipc__registry_lock);
  rc = usmipc__region_insert(r);
  pthread_mutex_unlock(&usmipc__registry_lock);
  if (rc != 0) {
    r->idle_next = NULL;
    unmap_list(r);
    return rc;
  }
  *ptr = (uint8_t *)r->alloc.base + b.offset;
  if (mapped_nbytes != NULL)
    *mapped_nbytes = nbytes;
  return 0;
}
