/* The export engine: the first export of an allocation, and exports of
 * memory another library allocated.
 *
 * Core floor (registries), under the public calls of ipc.c (which adds a
 * pool block's record and makes the handle) and bundle.c.
 *
 * Own memory:     check kind, device, range -> (first time) ask the backend
 *                 for its payload, publish its fd with the broker and take
 *                 an export-table slot; the export lives as long as the
 *                 allocation (or until usmipc_ipc_revoke).
 * Foreign memory: asked of the driver (a torch tensor, a CuPy array), or a
 *                 run of physical chunks (CUDA VMM); the export lives as
 *                 long as its handles, the driver's payload of a whole
 *                 allocation as long as the allocation (foreign_payloads.c).
 *                 Guarded by usmipc__registry_lock. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/core.h"
#include "util/blake2s.h"

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
  /* The handle of the whole allocation, kept from its first whole export
   * (what a bundle asks for at every share()): a later whole export copies
   * it rather than filling and encoding the same bytes again (a fifth of
   * usmipc's own time an allocation, in C). It names this process (whole_nonce:
   * a fork child draws another) and whether importers may reach the broker
   * through the socket directory then (whole_socket_dir). */
  usmipc_ipc_handle_t *whole;
  uint64_t whole_nonce;
  bool whole_socket_dir;
  /* All exports (a revoke matches by range), and the chains of the two
   * indexes below. */
  struct foreign_export *next, *prev;
  struct foreign_export *next_by_buffer, *next_by_id;
} foreign_export_t;

/* The foreign exports, and two chained hashes over them: on the buffer id
 * (the lookup of every export: once per allocation per share()) and on the
 * id (a handle's release). A walk of the list for each, as there was, made
 * a share() of n allocations cost n^2/2 steps and again at the bundle's
 * release: 2.6 us an allocation at 127 allocations, 6.1 at 798 and 15.5 at
 * 3,000 with a driver of nothing (bench/bench_foreign_share.py). Buckets
 * double when the exports outnumber them. */
static foreign_export_t *foreign_exports;
static foreign_export_t **by_buffer, **by_id;
static size_t index_bits, export_count;
static uint64_t next_foreign_id = 1;

static size_t index_bucket(uint64_t key) {
  return (size_t)((key * 0x9E3779B97F4A7C15ull) >> (64 - index_bits));
}

static void index_link(foreign_export_t *e) {
  size_t b = index_bucket(e->buffer_id);
  e->next_by_buffer = by_buffer[b];
  by_buffer[b] = e;
  b = index_bucket(e->id);
  e->next_by_id = by_id[b];
  by_id[b] = e;
}

/* Room in the indexes for one more export; lock held. */
static int index_reserve(void) {
  if (by_buffer != NULL && export_count < ((size_t)1 << index_bits))
    return 0;
  size_t bits = by_buffer == NULL ? 6 : index_bits + 1;
  foreign_export_t **nb = calloc((size_t)1 << bits, sizeof(*nb));
  foreign_export_t **ni = calloc((size_t)1 << bits, sizeof(*ni));
  if (nb == NULL || ni == NULL) {
    free(nb);
    free(ni);
    return usmipc__fail(USMIPC_ENOMEM, "out of memory");
  }
  free(by_buffer);
  free(by_id);
  by_buffer = nb;
  by_id = ni;
  index_bits = bits;
  for (foreign_export_t *e = foreign_exports; e; e = e->next)
    index_link(e);
  return 0;
}

/* Adds a made export to the list and the indexes (index_reserve first);
 * lock held. */
static void export_insert(foreign_export_t *e) {
  e->prev = NULL;
  e->next = foreign_exports;
  if (foreign_exports != NULL)
    foreign_exports->prev = e;
  foreign_exports = e;
  index_link(e);
  export_count++;
}

static void export_unlink(foreign_export_t *e) {
  if (e->prev != NULL)
    e->prev->next = e->next;
  else
    foreign_exports = e->next;
  if (e->next != NULL)
    e->next->prev = e->prev;
  foreign_export_t **l = &by_buffer[index_bucket(e->buffer_id)];
  while (*l != e)
    l = &(*l)->next_by_buffer;
  *l = e->next_by_buffer;
  for (l = &by_id[index_bucket(e->id)]; *l != e; l = &(*l)->next_by_id)
    ;
  *l = e->next_by_id;
  export_count--;
}

static foreign_export_t *export_by_buffer(uint64_t buffer_id, const void *base,
                                          size_t size,
                                          const usmipc_device_t *device) {
  if (by_buffer == NULL)
    return NULL;
  foreign_export_t *e = by_buffer[index_bucket(buffer_id)];
  while (e && !(e->buffer_id == buffer_id && e->base == base &&
                e->size == size && e->device == device))
    e = e->next_by_buffer;
  return e;
}

/* First export of a region: the backend's payload and, for fd-backed memory,
 * a grant from the transport. Later exports reuse both, so an export after
 * the first is only an encode. Called with the registry lock held. */
int usmipc__export_region(usmipc__region_t *r) {
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
    rc = usmipc__broker_publish(fd, r->buffer_id, !r->alloc.fd_is_device_buffer,
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
                 (rc = usmipc__broker_serve()) != 0))
    return rc;
  rc = usmipc__exports_add(r->buffer_id, r->fd_number, r->alloc.size,
                           usmipc__slot_tag(usmipc__self()->key, r->token),
                           &r->export_slot, &r->table_fd_number);
  if (rc != 0) {
    if (fd >= 0)
      usmipc__broker_withdraw(r->buffer_id);
    return rc;
  }
  r->exported = true;
  return 0;
}

/* Checks an export request against the allocation and resolves nbytes == 0;
 * shared by usmipc's own and foreign allocations. */
int usmipc__check_export(const void *ptr, usmipc_device_t *device,
                         const usmipc__allocation_t *a, size_t *offset,
                         size_t *nbytes) {
  if (a->kind != USMIPC_MEM_DEVICE)
    return usmipc__fail(USMIPC_EMEMKIND,
                        "cannot export %p: only device memory can be shared "
                        "between processes, and this is %s memory",
                        ptr, a->kind == USMIPC_MEM_HOST ? "host" : "shared");
  if (!usmipc__device_ipc_aspect(device))
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
void usmipc__export_wire_fill(usmipc__wire_t *w, usmipc_device_t *device,
                              const usmipc__allocation_t *a, uint64_t buffer_id,
                              size_t offset, size_t nbytes) {
  usmipc__wire_identity(w, device->ops->backend, device->uuid);
  w->fd_number = UINT32_MAX;
  w->export_slot = USMIPC__NO_SLOT;
  w->buffer_id = buffer_id;
  w->exporter_base = (uint64_t)(uintptr_t)a->base;
  w->allocation_size = a->size;
  w->offset = offset;
  w->nbytes = nbytes;
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
  if (rc == 0 && (rc = usmipc__broker_publish_fds(
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
    usmipc__broker_withdraw(e->buffer_id);
  for (uint32_t i = 0; i < e->nfds; i++)
    close(e->fds[i]);
  free(e->fds);
  free(e->chunks_rec);
  free(e->whole); /* a copy holding no ticket and no export: plain memory */
  free(e);
}

/* The driver's payload of a foreign allocation exported whole (not in
 * chunks): the one kept from an earlier export of it (foreign_payloads.c),
 * else the driver's, then kept. Lock held. */
static int foreign_payload(const void *ptr, usmipc_device_t *device,
                           usmipc__allocation_t *a, uint64_t buffer_id,
                           usmipc__payload_t *payload) {
  if (usmipc__foreign_payload_find(buffer_id, a->base, a->size, device,
                                   payload))
    return 0;
  int fd = -1;
  int rc = device->ops->ipc_export(device->native, a, payload, &fd);
  if (rc != 0)
    return rc;
  USMIPC__STAT_ADD(driver_exports, 1);
  if (fd >= 0) {
    close(fd);
    return usmipc__fail(USMIPC_ENOTSUP,
                        "cannot export %p: memory of another library shared "
                        "through a descriptor is not supported",
                        ptr);
  }
  usmipc__foreign_payload_keep(buffer_id, a->base, a->size, device, payload);
  return 0;
}

/* Memory another library allocated: the driver names its allocation and
 * buffer id; the export lives as long as handles hold it (see
 * foreign_export_t). */
int usmipc__export_foreign(const void *ptr, size_t nbytes,
                           const usmipc__allocation_ref_t *known,
                           usmipc_ipc_handle_t **handle) {
  usmipc__allocation_t a = {0};
  uint64_t buffer_id;
  usmipc_device_t *device;
  size_t offset;
  usmipc__chunk_run_t *run = NULL;
  int rc = 0;
  if (known != NULL && known->foreign &&
      (uintptr_t)ptr - (uintptr_t)known->alloc.base < known->alloc.size) {
    /* Asked of the driver a moment ago (a bundle's share: one query per
     * allocation); its buffer id is what proves it is still that
     * allocation, as the registry of foreign exports matches below. */
    a = known->alloc;
    buffer_id = known->buffer_id;
    device = known->device;
  } else if ((rc = usmipc__foreign_query_unlocked(ptr, &a, &buffer_id,
                                                  &device)) != 0) {
    usmipc__error_prefix("cannot export: ");
    return rc;
  }
  /* Chunks are looked up without the lock: the driver calls are many. */
  if (a.chunked &&
      (rc = describe_chunks(ptr, nbytes, device, &a, &buffer_id, &run)) != 0)
    return rc;
  rc = usmipc__check_export(ptr, device, &a, &offset, &nbytes);
  if (rc != 0) {
    free(run);
    return rc;
  }
  pthread_mutex_lock(&usmipc__registry_lock);
  foreign_export_t *e = export_by_buffer(buffer_id, a.base, a.size, device);
  if (e == NULL && (rc = index_reserve()) != 0) {
    pthread_mutex_unlock(&usmipc__registry_lock);
    free(run);
    return rc;
  }
  if (e == NULL) {
    e = calloc(1, sizeof(*e));
    if (e == NULL)
      rc = usmipc__fail(USMIPC_ENOMEM, "out of memory");
    else if (run != NULL)
      rc = export_chunks(device, run, buffer_id, e);
    else
      rc = foreign_payload(ptr, device, &a, buffer_id, &e->payload);
    if (rc == 0 && run == NULL && (rc = usmipc__random(e->token, 16)) == 0)
      rc = usmipc__broker_serve();
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
    export_insert(e);
  }
  free(run);
  bool whole = offset == 0 && nbytes == a.size;
  bool socket_dir = usmipc__broker_socket_dir();
  uint64_t nonce = usmipc__self()->nonce;
  if (whole && e->whole != NULL && e->whole_nonce == nonce &&
      e->whole_socket_dir == socket_dir) {
    rc = usmipc__handle_copy(e->whole, handle);
  } else {
    usmipc__wire_t w;
    usmipc__export_wire_fill(&w, device, &a, buffer_id, offset, nbytes);
    w.export_slot = e->slot;
    w.table_fd_number = e->table_fd_number;
    memcpy(w.token, e->token, 16);
    if (e->nfds > 0) {
      w.flags = USMIPC__WIRE_FLAG_FD;
      w.fd_number = e->fd_number;
      w.fd_dev = e->fd_dev;
      w.fd_ino = e->fd_ino;
    }
    if (socket_dir)
      w.flags |= USMIPC__WIRE_FLAG_SOCKET_DIR;
    if (e->chunks_len > 0) /* a run's record */
      memcpy(w.ext, e->chunks_rec, e->chunks_len);
    w.ext_len = e->chunks_len;
    rc = usmipc__wire_set_payload(&w, &e->payload);
    if (rc == 0)
      rc = usmipc__handle_from_wire(&w, handle);
    /* Kept for the next whole export; not kept is only slower. */
    if (rc == 0 && whole) {
      usmipc_ipc_handle_t *keep = NULL;
      if (usmipc__handle_copy(*handle, &keep) == 0) {
        free(e->whole); /* as in foreign_release */
        e->whole = keep;
        e->whole_nonce = nonce;
        e->whole_socket_dir = socket_dir;
      }
    }
  }
  if (rc == 0) {
    e->owners++;
    (*handle)->foreign_id = e->id;
  }
  pthread_mutex_unlock(&usmipc__registry_lock);
  return rc;
}

/* Unlinks a foreign export and releases it; lock held. */
static void foreign_revoke(foreign_export_t *e) {
  export_unlink(e);
  foreign_release(e, true);
}

int usmipc__allocation_of(const void *ptr, usmipc__allocation_ref_t *ref) {
  pthread_mutex_lock(&usmipc__registry_lock);
  usmipc__region_t *r = usmipc__region_find(ptr);
  if (r != NULL && r->origin == USMIPC__LOCAL && !r->user_freed) {
    ref->chunked = false;
    ref->foreign = false;
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
  ref->foreign = true;
  ref->alloc = a;
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
  for (foreign_export_t *e = foreign_exports, *next; e; e = next) {
    next = e->next;
    if ((uintptr_t)ptr - (uintptr_t)e->base < e->size) {
      foreign_revoke(e);
      revoked = 1;
    }
  }
  if (withdraw != 0) /* under the lock: a re-export must not race it */
    usmipc__broker_withdraw(withdraw);
  pthread_mutex_unlock(&usmipc__registry_lock);
  if (!revoked)
    return usmipc__fail(USMIPC_EUNKNOWNPTR,
                        "usmipc_ipc_revoke: nothing is exported at %p", ptr);
  return 0;
}

void usmipc__foreign_export_put(uint64_t foreign_id) {
  pthread_mutex_lock(&usmipc__registry_lock);
  foreign_export_t *e = by_id != NULL ? by_id[index_bucket(foreign_id)] : NULL;
  while (e != NULL && e->id != foreign_id)
    e = e->next_by_id;
  if (e != NULL && --e->owners == 0)
    foreign_revoke(e);
  pthread_mutex_unlock(&usmipc__registry_lock);
}

bool usmipc__foreign_export_current(uint64_t buffer_id, const void *base,
                                    uint32_t slot, const uint8_t token[16]) {
  if (by_buffer == NULL)
    return false;
  for (foreign_export_t *e = by_buffer[index_bucket(buffer_id)]; e;
       e = e->next_by_buffer)
    if (e->buffer_id == buffer_id && e->base == base && e->slot == slot &&
        memcmp(e->token, token, 16) == 0)
      return true;
  return false;
}
