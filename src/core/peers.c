/* The importer's view of the processes whose handles it opens.
 *
 * A handle names its exporter by pid, and a pid proves nothing: it may have
 * been reused, it may belong to another PID namespace, and anyone may have
 * written it. So the first open of an exporter's handle proves who the
 * exporter is, once, and keeps the proof: a peer record with the exporter's
 * verified export table (exports.c: sealed, tagged with the process key that
 * the handle carries) and, where the kernel lets us use it, a pidfd bound to
 * that process (its pidfs inode or start time checked against the handle).
 * Every later open of any handle of that exporter, cache hits included,
 * checks the table's slot and the exporter's liveness word with a few loads
 * and no system call.
 *
 * Peers are guarded by usmipc__registry_lock. Regions of origin IMPORTED
 * hold a reference; peers nobody references are kept for a while (so that
 * an importer opening handle after handle of one exporter pays the proof
 * once), at most IDLE_PEERS_MAX of them.
 *
 * Floor 4 of the core (registries), under the registry lock of region.c. */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "core/core.h"

#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif

#define IDLE_PEERS_MAX 64

struct usmipc__peer {
  uint32_t pid;
  uint64_t nonce;
  uint8_t key[16];
  int pidfd;        /* bound to the exporter, pidfd_getfd permitted; or -1 */
  bool same_pid_ns; /* /proc/<pid> names the exporter */
  const uint8_t *table; /* verified, read-only */
  unsigned refs;
  uint64_t last_use;
  usmipc__peer_t *next;
};

static usmipc__peer_t *peers;
static size_t idle_peers;
static uint64_t peer_clock;

static usmipc__peer_t *peer_find(uint32_t pid, uint64_t nonce) {
  for (usmipc__peer_t *p = peers; p; p = p->next)
    if (p->nonce == nonce && p->pid == pid)
      return p;
  return NULL;
}

static void peer_free(usmipc__peer_t *p) {
  if (p->table)
    munmap((void *)p->table, USMIPC__TABLE_BYTES);
  if (p->pidfd >= 0)
    close(p->pidfd);
  free(p);
}

/* Unlinks idle peers beyond the bound, least recently used first; returns
 * them as a list to free once the lock is dropped. Lock held. */
static usmipc__peer_t *evict_idle(void) {
  usmipc__peer_t *evicted = NULL;
  while (idle_peers > IDLE_PEERS_MAX) {
    usmipc__peer_t **lru = NULL;
    for (usmipc__peer_t **pp = &peers; *pp; pp = &(*pp)->next)
      if ((*pp)->refs == 0 &&
          (lru == NULL || (*pp)->last_use < (*lru)->last_use))
        lru = pp;
    if (lru == NULL)
      break;
    usmipc__peer_t *p = *lru;
    *lru = p->next;
    p->next = evicted;
    evicted = p;
    idle_peers--;
  }
  return evicted;
}

void usmipc__peer_ref(usmipc__peer_t *p) {
  if (p->refs++ == 0)
    idle_peers--;
  p->last_use = ++peer_clock;
}

void usmipc__peer_unref(usmipc__peer_t *p) {
  if (--p->refs == 0)
    idle_peers++;
}

void usmipc__peer_put(usmipc__peer_t *p) {
  if (p == NULL)
    return;
  pthread_mutex_lock(&usmipc__registry_lock);
  usmipc__peer_unref(p);
  usmipc__peer_t *evicted = evict_idle();
  pthread_mutex_unlock(&usmipc__registry_lock);
  while (evicted) {
    usmipc__peer_t *next = evicted->next;
    peer_free(evicted);
    evicted = next;
  }
}

/* A pidfd of w's pid that is provably the exporter, or an error
 * (USMIPC_EEXPORTERGONE when it has exited). */
int usmipc__exporter_pidfd(const usmipc__wire_t *w, int *out) {
  int pidfd = (int)syscall(SYS_pidfd_open, (pid_t)w->pid, 0);
  if (pidfd < 0) {
    int e = errno;
    if (e == ESRCH)
      return usmipc__fail_exporter_exited(w, e);
    return usmipc__fail_native(usmipc__errno_code(e), e,
                               "pidfd_open(2) of process %u failed: %s", w->pid,
                               strerror(e));
  }
  bool other;
  struct stat st;
  if (w->pidfd_ino != 0 && fstat(pidfd, &st) == 0) {
    /* The exporter found pidfs on this kernel (it wrote an inode): ours is
     * a pidfs inode too, unique to one process. */
    other = (uint64_t)st.st_ino != w->pidfd_ino;
  } else {
    char pid[16];
    snprintf(pid, sizeof(pid), "%u", w->pid);
    other = w->start_time != 0 && usmipc__start_time(pid) != w->start_time;
  }
  if (other) {
    close(pidfd);
    return usmipc__fail(USMIPC_EEXPORTERGONE,
                        "the exporting process %u has exited (its pid now "
                        "belongs to another process); mappings opened "
                        "before it exited stay valid",
                        w->pid);
  }
  *out = pidfd;
  return 0;
}

int usmipc__pidfd_exited(int pidfd, unsigned wait_ms) {
  /* A pidfd polls readable once its process has exited: after the kernel
   * closed its descriptors (exit_files comes before exit_notify), so after
   * its device contexts were torn down. */
  struct pollfd pfd = {.fd = pidfd, .events = POLLIN};
  int n = poll(&pfd, 1, (int)wait_ms);
  if (n < 0)
    return errno == EINTR ? 0 : -1;
  return n > 0 && (pfd.revents & (POLLIN | POLLHUP | POLLERR)) != 0;
}

static int check_identity(int fd, const usmipc__wire_t *w) {
  struct stat st;
  if (fstat(fd, &st) != 0 || (uint64_t)st.st_dev != w->fd_dev ||
      (uint64_t)st.st_ino != w->fd_ino)
    return usmipc__fail(USMIPC_EEXPORTERGONE,
                        "process %u no longer holds the memory this handle "
                        "names (the allocation was freed)",
                        w->pid);
  return 0;
}

static int map_table_fd(int fd, const usmipc__wire_t *w, usmipc__peer_t *p) {
  int rc = usmipc__table_map(fd, w, &p->table);
  close(fd);
  return rc;
}

/* Proves w's exporter and maps its table into p; *fd may receive w's
 * descriptor when the broker served both at once. */
static int prove(const usmipc__wire_t *w, uint64_t deadline, usmipc__peer_t *p,
                 int *fd) {
  const usmipc__process_t *self = usmipc__self();
  usmipc__transport_t mode;
  int rc = usmipc__transport_mode(&mode);
  if (rc != 0)
    return rc;
  if (w->uid != self->uid)
    return usmipc__fail(USMIPC_EACCES,
                        "the handle was exported by uid %u, and this process "
                        "runs as uid %u: IPC memory is shared only between "
                        "processes of the same user",
                        w->uid, self->uid);
  p->same_pid_ns = usmipc__same_pid_namespace(w);
  if (!p->same_pid_ns &&
      (mode == USMIPC__TRANSPORT_PIDFD || mode == USMIPC__TRANSPORT_PROCFD))
    return usmipc__fail(USMIPC_ENAMESPACE,
                        "the exporting process %u is in another PID "
                        "namespace (another container, or unshare -p): its "
                        "pid means nothing here, so USMIPC_FD_TRANSPORT=%s "
                        "cannot reach it; use auto or socket",
                        w->pid, getenv("USMIPC_FD_TRANSPORT"));
  if (p->same_pid_ns && mode != USMIPC__TRANSPORT_SOCKET) {
    int pidfd = -1, tfd = -1;
    if ((rc = usmipc__exporter_pidfd(w, &pidfd)) != 0)
      return rc;
    if (mode != USMIPC__TRANSPORT_PROCFD) {
      rc = usmipc__pidfd_take(pidfd, w->pid, w->table_fd_number, &tfd);
      if (rc == 0) {
        p->pidfd = pidfd;
        return map_table_fd(tfd, w, p);
      }
      if (mode == USMIPC__TRANSPORT_PIDFD || rc == USMIPC_EEXPORTERGONE ||
          rc == USMIPC_EMFILE) {
        close(pidfd);
        return rc;
      }
    }
    close(pidfd); /* pidfd_getfd is not permitted: no use keeping it */
    rc = usmipc__procfd_reopen(w, w->table_fd_number, O_RDONLY, &tfd);
    if (rc == 0)
      return map_table_fd(tfd, w, p);
    if (mode == USMIPC__TRANSPORT_PROCFD || rc == USMIPC_EUNTRUSTED ||
        rc == USMIPC_EEXPORTERGONE || rc == USMIPC_EMFILE)
      return rc;
  }
  /* The broker: the only way across PID namespaces, and where ptrace rules
   * forbid the others. A first open of fd memory gets the table and the
   * descriptor in one round trip (a run of chunks fetches its descriptors
   * afterwards, usmipc__peer_fetch_run_fds). */
  int tfd = -1;
  unsigned want = USMIPC__WANT_TABLE |
                  ((w->flags & USMIPC__WIRE_FLAG_FD) && w->chunk_count == 0
                       ? USMIPC__WANT_FD
                       : 0);
  rc = usmipc__broker_call(w, want, deadline, &tfd,
                           (want & USMIPC__WANT_FD) ? fd : NULL);
  if (rc != 0)
    return rc;
  rc = map_table_fd(tfd, w, p);
  /* The broker serves the allocation's own descriptor; a handle that
   * claims another file is forged. */
  if (rc == 0 && *fd >= 0)
    rc = check_identity(*fd, w);
  if (rc != 0 && *fd >= 0) {
    close(*fd);
    *fd = -1;
  }
  return rc;
}

int usmipc__peer_get(const usmipc__wire_t *w, uint64_t deadline,
                     usmipc__peer_t **out, int *fd) {
  *fd = -1;
  *out = NULL;
  pthread_mutex_lock(&usmipc__registry_lock);
  usmipc__peer_t *p = peer_find(w->pid, w->nonce);
  if (p != NULL) {
    int forged = memcmp(p->key, w->key, 16) != 0;
    if (!forged)
      usmipc__peer_ref(p);
    pthread_mutex_unlock(&usmipc__registry_lock);
    if (forged)
      return usmipc__fail(USMIPC_EUNTRUSTED,
                          "the handle names process %u but carries another "
                          "key than that process proved: forged",
                          w->pid);
    *out = p;
    return 0;
  }
  pthread_mutex_unlock(&usmipc__registry_lock);

  /* The proof can wait on the exporter: made without the lock; if another
   * thread proved the same exporter meanwhile, its record wins. */
  usmipc__peer_t *made = calloc(1, sizeof(*made));
  if (made == NULL)
    return usmipc__fail(USMIPC_ENOMEM, "out of memory");
  made->pid = w->pid;
  made->nonce = w->nonce;
  memcpy(made->key, w->key, 16);
  made->pidfd = -1;
  int rc = prove(w, deadline, made, fd);
  if (rc != 0) {
    peer_free(made);
    return rc;
  }
  pthread_mutex_lock(&usmipc__registry_lock);
  p = peer_find(w->pid, w->nonce);
  if (p == NULL) {
    made->next = peers;
    peers = made;
    made->refs = 1;
    made->last_use = ++peer_clock;
    p = made;
    made = NULL;
  } else {
    usmipc__peer_ref(p); /* same key: both proved it against one table */
  }
  usmipc__peer_t *evicted = evict_idle();
  pthread_mutex_unlock(&usmipc__registry_lock);
  if (made)
    peer_free(made);
  while (evicted) {
    usmipc__peer_t *next = evicted->next;
    peer_free(evicted);
    evicted = next;
  }
  *out = p;
  return 0;
}

int usmipc__peer_check(const usmipc__peer_t *p, const usmipc__wire_t *w,
                       uint64_t tag, uint32_t *seq) {
  if (w->export_slot >= USMIPC__TABLE_SLOTS)
    return usmipc__fail(USMIPC_EBADHANDLE,
                        "not a valid usmipc IPC handle: export slot %u is out "
                        "of range",
                        w->export_slot);
  if (!usmipc__table_alive(p->table))
    return usmipc__fail_exporter_exited(w, 0);
  usmipc__export_slot_t s;
  if (usmipc__table_read_slot(p->table, w->export_slot, &s, seq) != 0)
    return usmipc__fail(USMIPC_EEXPORTERGONE,
                        "process %u's export table is stuck mid-update; the "
                        "exporter probably died",
                        w->pid);
  /* What the slot holds, from its tag's kind bits (0: nothing). */
  unsigned kind = (unsigned)(s.tag & USMIPC__SLOT_KIND_MASK);
  const char *holds = kind == USMIPC__SLOT_KIND_EVENT ? "an event"
                      : kind == 0                     ? "nothing"
                                  : "a memory allocation (or a bundle or "
                                    "pool block)";
  /* The export the handle names, but of another kind: only a forger, who
   * copied a memory handle's slot, buffer id and token into an event
   * handle (or the other way round), names it so. */
  if (s.buffer_id == w->buffer_id &&
      kind != (unsigned)(tag & USMIPC__SLOT_KIND_MASK))
    return usmipc__fail(USMIPC_EBADHANDLE,
                        "not a valid usmipc %s handle: export slot %u of "
                        "process %u holds %s, not %s (forged)",
                        w->is_event ? "event" : "IPC", w->export_slot, w->pid,
                        holds, w->is_event ? "an event" : "memory");
  bool gone =
      s.buffer_id != w->buffer_id ||
      ((w->flags & USMIPC__WIRE_FLAG_FD) && s.fd_number != w->fd_number);
  if (gone && w->is_event)
    return usmipc__fail(USMIPC_EEXPORTERGONE,
                        "process %u no longer exports the event this handle "
                        "names (it was destroyed): its export slot %u now "
                        "holds %s",
                        w->pid, w->export_slot, holds);
  if (gone)
    return usmipc__fail(USMIPC_EEXPORTERGONE,
                        "process %u no longer exports the memory this handle "
                        "names (the allocation was freed)",
                        w->pid);
  if (s.tag != tag)
    return usmipc__fail(USMIPC_EEXPORTERGONE,
                        "process %u does not export the allocation under this "
                        "handle: it was revoked (usmipc_ipc_revoke, or the "
                        "last handle of another library's memory died), or "
                        "its token is forged; ask the exporter for a current "
                        "handle",
                        w->pid);
  if (!w->is_event && s.size != w->allocation_size)
    return usmipc__fail(USMIPC_EBADHANDLE,
                        "not a valid usmipc IPC handle: it claims a %llu-byte "
                        "allocation, but process %u exported %llu bytes",
                        (unsigned long long)w->allocation_size, w->pid,
                        (unsigned long long)s.size);
  return 0;
}

const uint8_t *usmipc__peer_table(const usmipc__peer_t *p) { return p->table; }

int usmipc__peer_slot_live(const usmipc__peer_t *p, uint32_t slot,
                           uint64_t buffer_id, uint64_t tag) {
  usmipc__export_slot_t s;
  return usmipc__table_alive(p->table) &&
         usmipc__table_read_slot(p->table, slot, &s, NULL) == 0 &&
         s.buffer_id == buffer_id && s.tag == tag;
}

/* The descriptor number named the allocation's descriptor before the copy
 * (checked by the caller) and still does after it (the exporter clears the
 * slot before closing): then the copy is the allocation's. A copy through
 * pidfd_getfd needs nothing more (and for CUDA's descriptors, which share
 * one inode, nothing more could help); a reopen through /proc opens a file
 * by name, which must also be the handle's file. Closes fd on failure. */
static int recheck(const usmipc__peer_t *p, const usmipc__wire_t *w,
                   uint32_t seq, int fd, bool reopened) {
  int rc = 0;
  if (usmipc__table_slot_seq(p->table, w->export_slot) != seq)
    rc = usmipc__fail(USMIPC_EEXPORTERGONE,
                      "process %u freed the memory this handle names while "
                      "it was being opened",
                      w->pid);
  else if (reopened)
    rc = check_identity(fd, w);
  if (rc != 0)
    close(fd);
  return rc;
}

int usmipc__peer_fetch_fd(usmipc__peer_t *p, const usmipc__wire_t *w,
                          uint64_t tag, uint64_t deadline, int *out) {
  usmipc__transport_t mode;
  uint32_t seq = 0;
  int fd = -1;
  int rc = usmipc__transport_mode(&mode);
  if (rc != 0 || (rc = usmipc__peer_check(p, w, tag, &seq)) != 0)
    return rc;
  if (p->pidfd >= 0 && mode != USMIPC__TRANSPORT_SOCKET &&
      mode != USMIPC__TRANSPORT_PROCFD) {
    if ((rc = usmipc__pidfd_take(p->pidfd, w->pid, w->fd_number, &fd)) != 0 ||
        (rc = recheck(p, w, seq, fd, false)) != 0)
      return rc;
    usmipc__debug("descriptor of buffer %llu taken from process %u with "
                  "pidfd_getfd",
                  (unsigned long long)w->buffer_id, w->pid);
    *out = fd;
    return 0;
  }
  if (mode == USMIPC__TRANSPORT_PIDFD)
    return usmipc__fail(USMIPC_EACCES,
                        "pidfd_getfd(2) may not take descriptors from process "
                        "%u; use USMIPC_FD_TRANSPORT=socket or auto",
                        w->pid);
  if (p->same_pid_ns && (w->flags & USMIPC__WIRE_FLAG_REOPENABLE) &&
      mode != USMIPC__TRANSPORT_SOCKET) {
    rc = usmipc__procfd_reopen(w, w->fd_number, O_RDWR, &fd);
    if (rc == 0 && (rc = recheck(p, w, seq, fd, true)) == 0) {
      usmipc__debug("descriptor of buffer %llu of process %u reopened "
                    "through /proc",
                    (unsigned long long)w->buffer_id, w->pid);
      *out = fd;
      return 0;
    }
    if (mode == USMIPC__TRANSPORT_PROCFD || rc == USMIPC_EEXPORTERGONE ||
        rc == USMIPC_EUNTRUSTED || rc == USMIPC_EMFILE)
      return rc;
  } else if (mode == USMIPC__TRANSPORT_PROCFD) {
    return usmipc__fail(USMIPC_ETRANSPORT,
                        "this memory's descriptor cannot be reopened through "
                        "/proc (it is not a memfd, or the exporter is in "
                        "another PID namespace); use "
                        "USMIPC_FD_TRANSPORT=socket or pidfd");
  }
  if ((rc = usmipc__broker_call(w, USMIPC__WANT_FD, deadline, NULL, &fd)) != 0)
    return rc;
  if ((rc = check_identity(fd, w)) != 0) {
    close(fd);
    return rc;
  }
  usmipc__debug("descriptor of buffer %llu sent by the broker of process %u",
                (unsigned long long)w->buffer_id, w->pid);
  *out = fd;
  return 0;
}

int usmipc__peer_fetch_run_fds(usmipc__peer_t *p, const usmipc__wire_t *w,
                               uint64_t tag, uint64_t deadline, int *fds) {
  usmipc__transport_t mode;
  int rc = usmipc__transport_mode(&mode);
  if (rc != 0 || (rc = usmipc__peer_check(p, w, tag, NULL)) != 0)
    return rc;
  if (mode == USMIPC__TRANSPORT_PIDFD || mode == USMIPC__TRANSPORT_PROCFD)
    return usmipc__fail(USMIPC_ETRANSPORT,
                        "this handle names memory in %u chunks, whose "
                        "descriptors only the exporter's broker hands out "
                        "(the handle holds the number of the first alone); "
                        "USMIPC_FD_TRANSPORT=%s cannot take them: use auto or "
                        "socket",
                        (unsigned)w->chunk_count,
                        getenv("USMIPC_FD_TRANSPORT"));
  /* The broker sends the grant's own descriptors, against the export's
   * token, under its lock: a withdrawn grant (a revoked export) sends
   * none, so no seqlock recheck is needed. The first must be the file the
   * handle names (CUDA's descriptors share one inode: this is the
   * forged-handle check the single-descriptor path makes too). */
  if ((rc = usmipc__broker_call(w, USMIPC__WANT_FD, deadline, NULL, fds)) != 0)
    return rc;
  if ((rc = check_identity(fds[0], w)) != 0) {
    for (uint16_t i = 0; i < w->chunk_count; i++) {
      close(fds[i]);
      fds[i] = -1;
    }
    return rc;
  }
  return 0;
}

/* Fails the batch: closes every descriptor taken so far. at names the handle
 * that failed (SIZE_MAX: none in particular). */
static int fetch_fds_fail(const usmipc__wire_t *const *w, size_t n, int *fds,
                          size_t at, int rc) {
  for (size_t i = 0; i < n; i++) {
    if (fds[i] >= 0)
      close(fds[i]);
    fds[i] = -1;
  }
  if (at < n)
    usmipc__error_prefix("taking the descriptor of handle %zu of %zu (buffer "
                         "%llu of process %u): ",
                         at, n, (unsigned long long)w[at]->buffer_id,
                         w[at]->pid);
  else
    usmipc__error_prefix("taking %zu descriptors from process %u: ", n,
                         w[0]->pid);
  return rc;
}

int usmipc__peer_fetch_fds(usmipc__peer_t *p, const usmipc__wire_t *const *w,
                           size_t n, uint64_t deadline, int *fds) {
  for (size_t i = 0; i < n; i++)
    fds[i] = -1;
  for (size_t i = 0; i < n; i++) {
    if (w[i]->pid != p->pid || w[i]->nonce != p->nonce)
      return usmipc__fail(USMIPC_EINVAL,
                          "handle %zu of %zu was exported by process %u, not "
                          "by process %u whose descriptors are being taken",
                          i, n, w[i]->pid, p->pid);
    if (memcmp(w[i]->key, p->key, 16) != 0)
      return usmipc__fail(USMIPC_EUNTRUSTED,
                          "handle %zu of %zu names process %u but carries "
                          "another key than that process proved: forged",
                          i, n, w[i]->pid);
    if (!(w[i]->flags & USMIPC__WIRE_FLAG_FD))
      return usmipc__fail(USMIPC_EINVAL,
                          "handle %zu of %zu shares no descriptor (its memory "
                          "is opened through the driver's handle)",
                          i, n);
    /* A run's descriptors travel together, from the broker alone
     * (usmipc__peer_fetch_run_fds): the handle names only the first, so
     * neither pidfd_getfd nor a batch entry could take the others. */
    if (w[i]->chunk_count != 0)
      return usmipc__fail(USMIPC_EINVAL,
                          "handle %zu of %zu names memory in %u chunks, whose "
                          "descriptors are not taken in a batch",
                          i, n, (unsigned)w[i]->chunk_count);
  }
  usmipc__transport_t mode;
  int rc = usmipc__transport_mode(&mode);
  if (rc != 0 || n == 0)
    return rc;
  /* pidfd_getfd and /proc are system calls of ours, one per descriptor,
   * with the checks of usmipc__peer_fetch_fd; what they cannot take goes to
   * the broker, in as few exchanges as SCM_RIGHTS allows. */
  size_t *via_broker = malloc(n * sizeof(*via_broker));
  if (via_broker == NULL)
    return usmipc__fail(USMIPC_ENOMEM, "out of memory");
  size_t nb = 0;
  for (size_t i = 0; i < n; i++) {
    const usmipc__wire_t *x = w[i];
    uint64_t tag = usmipc__slot_tag(x->key, x->token);
    uint32_t seq = 0;
    if (p->pidfd >= 0 && mode != USMIPC__TRANSPORT_SOCKET &&
        mode != USMIPC__TRANSPORT_PROCFD) {
      if ((rc = usmipc__peer_check(p, x, tag, &seq)) != 0 ||
          (rc = usmipc__pidfd_take(p->pidfd, x->pid, x->fd_number, &fds[i])) !=
              0 ||
          (rc = recheck(p, x, seq, fds[i], false)) != 0) {
        fds[i] = -1; /* recheck closed it */
        goto fail_at_i;
      }
      continue;
    }
    if (mode == USMIPC__TRANSPORT_PIDFD) {
      rc = usmipc__fail(USMIPC_EACCES,
                        "pidfd_getfd(2) may not take descriptors from process "
                        "%u; use USMIPC_FD_TRANSPORT=socket or auto",
                        x->pid);
      goto fail_at_i;
    }
    if (p->same_pid_ns && (x->flags & USMIPC__WIRE_FLAG_REOPENABLE) &&
        mode != USMIPC__TRANSPORT_SOCKET) {
      int fd = -1;
      if ((rc = usmipc__peer_check(p, x, tag, &seq)) != 0)
        goto fail_at_i;
      rc = usmipc__procfd_reopen(x, x->fd_number, O_RDWR, &fd);
      if (rc == 0 && (rc = recheck(p, x, seq, fd, true)) == 0) {
        fds[i] = fd;
        continue;
      }
      if (mode == USMIPC__TRANSPORT_PROCFD || rc == USMIPC_EEXPORTERGONE ||
          rc == USMIPC_EUNTRUSTED || rc == USMIPC_EMFILE)
        goto fail_at_i;
    } else if (mode == USMIPC__TRANSPORT_PROCFD) {
      rc = usmipc__fail(USMIPC_ETRANSPORT,
                        "this memory's descriptor cannot be reopened through "
                        "/proc (it is not a memfd, or the exporter is in "
                        "another PID namespace); use "
                        "USMIPC_FD_TRANSPORT=socket or pidfd");
      goto fail_at_i;
    }
    via_broker[nb++] = i;
    continue;
  fail_at_i:
    free(via_broker);
    return fetch_fds_fail(w, n, fds, i, rc);
  }
  /* The broker: one exchange per USMIPC__FDS_PER_REQUEST descriptors. Each
   * chunk's slots are checked just before its exchange, and each
   * descriptor received must be its handle's file (the broker serves the
   * allocation's own descriptor; a handle that claims another is forged). */
  for (size_t start = 0; start < nb; start += USMIPC__FDS_PER_REQUEST) {
    const usmipc__wire_t *chunk[USMIPC__FDS_PER_REQUEST];
    int got[USMIPC__FDS_PER_REQUEST];
    size_t m = nb - start < USMIPC__FDS_PER_REQUEST ? nb - start
                                                    : USMIPC__FDS_PER_REQUEST;
    size_t failed = SIZE_MAX;
    for (size_t k = 0; k < m; k++) {
      size_t i = via_broker[start + k];
      chunk[k] = w[i];
      rc = usmipc__peer_check(p, w[i], usmipc__slot_tag(w[i]->key, w[i]->token),
                              NULL);
      if (rc != 0) {
        failed = i;
        goto fail_broker;
      }
    }
    rc = usmipc__broker_fetch_fds(chunk, m, deadline, got, &failed);
    if (rc != 0) {
      failed = failed < m ? via_broker[start + failed] : SIZE_MAX;
      goto fail_broker;
    }
    for (size_t k = 0; k < m; k++)
      fds[via_broker[start + k]] = got[k];
    for (size_t k = 0; k < m; k++) {
      size_t i = via_broker[start + k];
      if ((rc = check_identity(fds[i], w[i])) != 0) {
        failed = i;
        goto fail_broker;
      }
    }
    continue;
  fail_broker:
    free(via_broker);
    return fetch_fds_fail(w, n, fds, failed, rc);
  }
  free(via_broker);
  USMIPC__STAT_ADD(descriptors_received, n);
  return 0;
}

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
