/* The public handle calls: the four calls of the seed (get a handle, open
 * it, close the mapping, free the handle data) and ordering.
 *
 * Objects floor of the core, above the export and import engines
 * (core/export.c, core/import.c), pools and release tickets.
 *
 * Export:  find the region -> a pool block's record (pool.c) -> the export
 *          engine's first export -> encode into a handle object
 *          (wire/handle.c). usmipc_ipc_handle_order appends an ordering
 *          event (event.c) and a release ticket (release.c).
 * Open:    decode -> a pool block's or segment's checks -> the import
 *          engine's open -> wait for the handle's ordering event.
 * Close:   core/import.c (usmipc_ipc_close). */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "objects.h"
#include "util/blake2s.h"

#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif

/* ---- export ------------------------------------------------------------- */

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
  uint8_t rec[USMIPC__ORDER_RECORD_MAX];
  size_t rec_len = 0;
  int rc;
  if (queue != NULL && (rc = usmipc__event_order(queue, rec, &rec_len)) != 0)
    return rc;
  if ((flags & USMIPC_ORDER_RELEASE) &&
      (rc = usmipc__release_ticket(&handle->release, rec + rec_len, &rec_len,
                                   1)) != 0)
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

uint64_t usmipc_ipc_handle_release_key(const usmipc_ipc_handle_t *handle) {
  return handle != NULL ? usmipc__release_key(&handle->release) : 0;
}

int usmipc_ipc_handle_wait_released(usmipc_ipc_handle_t *handle,
                                    usmipc_queue_t *queue) {
  if (handle == NULL)
    return usmipc__fail(USMIPC_EINVAL,
                        "usmipc_ipc_handle_wait_released: NULL handle");
  return usmipc__release_wait(&handle->release, queue);
}

static int get_handle(const void *ptr, size_t nbytes, bool whole,
                      const usmipc__allocation_ref_t *known,
                      usmipc_ipc_handle_t **handle);

int usmipc_ipc_get_handle(const void *ptr, size_t nbytes,
                          usmipc_ipc_handle_t **handle) {
  return get_handle(ptr, nbytes, false, NULL, handle);
}

int usmipc__export_allocation(const void *base, size_t nbytes,
                              const usmipc__allocation_ref_t *known,
                              usmipc_ipc_handle_t **handle,
                              usmipc__allocation_ref_t *ref) {
  /* Another library's allocation, described a moment ago by
   * usmipc__allocation_of (which looked in the registry first): exported
   * as such without looking again. */
  int rc = known != NULL && known->foreign
               ? usmipc__export_foreign(base, nbytes, known, handle)
               : get_handle(base, nbytes, true, known, handle);
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
    rc = get_handle((const void *)ref->base, ref->size, true, NULL, handle);
    usmipc_ipc_free_handle(first);
  }
  return rc;
}

static int get_handle(const void *ptr, size_t nbytes, bool whole,
                      const usmipc__allocation_ref_t *known,
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
    return usmipc__export_foreign(ptr, nbytes, known, handle);
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
  else if ((rc = usmipc__check_export(ptr, r->device, &r->alloc, &offset,
                                      &nbytes)) == 0 &&
           !r->exported && (rc = usmipc__export_region(r)) != 0)
    usmipc__error_prefix("exporting %p: ", ptr);
  if (rc != 0) {
    pthread_mutex_unlock(&usmipc__registry_lock);
    return rc;
  }
  usmipc__wire_t w;
  usmipc__export_wire_fill(&w, r->device, &r->alloc, r->buffer_id, offset,
                           nbytes);
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
  if (usmipc__broker_socket_dir())
    w.flags |= USMIPC__WIRE_FLAG_SOCKET_DIR;
  memcpy(w.ext, block_rec, block_len); /* a pool block's record, or none */
  w.ext_len = (uint16_t)block_len;
  rc = usmipc__wire_set_payload(&w, r->payload);
  pthread_mutex_unlock(&usmipc__registry_lock);
  return rc != 0 ? rc : usmipc__handle_from_wire(&w, handle);
}

int usmipc_ipc_free_handle(usmipc_ipc_handle_t *handle) {
  /* The export of usmipc's own memory belongs to the allocation, not to the
   * handle: bytes already sent stay openable until the allocation is freed
   * (or revoked). A foreign export belongs to its handles: the last one
   * revokes it. */
  if (handle != NULL)
    usmipc__release_free(handle->release);
  if (handle != NULL && handle->foreign_id != 0)
    usmipc__foreign_export_put(handle->foreign_id);
  free(handle);
  return 0;
}

/* ---- open --------------------------------------------------------------- */

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
    usmipc__unmap_list(r);
    return rc;
  }
  *ptr = (uint8_t *)r->alloc.base + b.offset;
  if (mapped_nbytes != NULL)
    *mapped_nbytes = nbytes;
  return 0;
}
