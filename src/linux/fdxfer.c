/* Moving file descriptors between unrelated processes.
 *
 * Memory shared through a file descriptor (host memfd, CUDA VMM POSIX fds,
 * Level Zero IPC fds) needs that descriptor in the importer. Two ways:
 *
 *  - pidfd_getfd(2) (Linux 5.6): the importer copies the descriptor straight
 *    out of the exporter. Fast (two system calls), but it needs ptrace access
 *    to the exporter, which Yama's ptrace_scope=1 (the Ubuntu default)
 *    denies unless the importer is an ancestor of the exporter. The handle
 *    records the file's (st_dev, st_ino), and the copied descriptor must
 *    match it: a descriptor number reused after a free names another file.
 *
 *  - a per-process broker: a thread, started on the first export, listening
 *    on an abstract Unix socket named after the exporter's pid and nonce. An
 *    importer connects, presents the buffer id and the 16-byte capability
 *    token from the handle, and receives the descriptor with SCM_RIGHTS
 *    (unix(7)). The broker checks the token (a handle is a capability for one
 *    allocation) and the peer's uid from SO_PEERCRED (another user is
 *    refused even with the token). No ptrace rights are needed.
 *
 * USMIPC_FD_TRANSPORT picks: "auto" (default: pidfd, then the broker),
 * "socket" or "pidfd".
 *
 * Abstract socket names live in the network namespace: exporter and importer
 * must share it (containers started with --network=host do).
 */
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/time.h>
#include <sys/un.h>
#include <unistd.h>

#include "../common.h"

#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif
#ifndef SYS_pidfd_getfd
#define SYS_pidfd_getfd 438
#endif

#define REQUEST_MAGIC 0x51524655u /* "UFRQ" */
#define REPLY_MAGIC 0x50524655u   /* "UFRP" */
#define PROTOCOL_VERSION 1u
#define TABLE_REQUEST 0 /* buffer id 0 asks for the export table */
/* How long either side waits for the other before giving up: long enough for
 * a loaded machine, short enough that a wedged peer is reported. */
#define PEER_TIMEOUT_MS 5000

enum reply_status {
  REPLY_OK = 0,
  REPLY_UNKNOWN_BUFFER = 1, /* never published, or withdrawn (freed) */
  REPLY_BAD_TOKEN = 2,
  REPLY_OTHER_USER = 3,
  REPLY_BAD_REQUEST = 4,
};

/* On the wire both messages are little-endian fixed-size structs of
 * naturally aligned fields; peers are the same host, but spell it out. */
typedef struct request {
  uint32_t magic;
  uint32_t version;
  uint64_t buffer_id;
  uint8_t token[16];
} request_t;

typedef struct reply {
  uint32_t magic;
  uint32_t status;
} reply_t;

typedef struct grant_entry {
  uint64_t buffer_id;
  int fd; /* the allocation's own descriptor, borrowed until withdrawn */
  uint8_t token[16];
} grant_entry_t;

static pthread_mutex_t fdx_lock = PTHREAD_MUTEX_INITIALIZER;
static grant_entry_t *grants; /* sorted by buffer_id */
static size_t grant_count, grant_capacity;
static int listen_fd = -1;
static pthread_once_t fdx_once = PTHREAD_ONCE_INIT;

/* Guards the importer's cache of exporters' pidfds (below). */
static pthread_mutex_t pidfd_lock = PTHREAD_MUTEX_INITIALIZER;

void usmipc__fdxfer_fork_prepare(void) {
  pthread_mutex_lock(&fdx_lock);
  pthread_mutex_lock(&pidfd_lock);
}
void usmipc__fdxfer_fork_parent(void) {
  pthread_mutex_unlock(&pidfd_lock);
  pthread_mutex_unlock(&fdx_lock);
}
/* The broker thread does not exist in a fork child, and the parent's grants
 * are the parent's to serve: the child forgets them (and its copy of the
 * listening socket) and starts its own broker on its next export. */
void usmipc__fdxfer_fork_child(void) {
  pthread_mutex_init(&fdx_lock, NULL);
  pthread_mutex_init(&pidfd_lock, NULL);
  grant_count = 0; /* the descriptors belong to the inherited allocations */
  if (listen_fd >= 0)
    close(listen_fd);
  listen_fd = -1;
}

static void fdx_init(void) {}

static socklen_t broker_address(uint32_t pid, uint64_t nonce,
                                struct sockaddr_un *addr) {
  memset(addr, 0, sizeof(*addr));
  addr->sun_family = AF_UNIX;
  /* sun_path[0] == '\0' makes the name abstract: no file to clean up, gone
   * when the process exits. */
  int n = snprintf(addr->sun_path + 1, sizeof(addr->sun_path) - 1,
                   "usmipc.%u.%016llx", pid, (unsigned long long)nonce);
  return (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + (size_t)n);
}

static size_t grant_lower_bound(uint64_t buffer_id) {
  size_t lo = 0, hi = grant_count;
  while (lo < hi) {
    size_t mid = lo + (hi - lo) / 2;
    if (grants[mid].buffer_id < buffer_id)
      lo = mid + 1;
    else
      hi = mid;
  }
  return lo;
}

static grant_entry_t *grant_find(uint64_t buffer_id) {
  size_t at = grant_lower_bound(buffer_id);
  return at < grant_count && grants[at].buffer_id == buffer_id ? &grants[at]
                                                               : NULL;
}

static int tokens_equal(const uint8_t *a, const uint8_t *b) {
  uint8_t diff = 0; /* constant time: no early exit to time */
  for (int i = 0; i < 16; i++)
    diff |= a[i] ^ b[i];
  return diff == 0;
}

static void set_timeouts(int fd) {
  struct timeval tv = {.tv_sec = PEER_TIMEOUT_MS / 1000,
                       .tv_usec = (PEER_TIMEOUT_MS % 1000) * 1000};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
}

static void send_reply(int conn, uint32_t status, int fd) {
  reply_t rep = {.magic = REPLY_MAGIC, .status = status};
  struct iovec iov = {.iov_base = &rep, .iov_len = sizeof(rep)};
  union {
    struct cmsghdr align;
    char buf[CMSG_SPACE(sizeof(int))];
  } control;
  struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1};
  if (fd >= 0) {
    memset(&control, 0, sizeof(control));
    msg.msg_control = control.buf;
    msg.msg_controllen = sizeof(control.buf);
    struct cmsghdr *cm = CMSG_FIRSTHDR(&msg);
    cm->cmsg_level = SOL_SOCKET;
    cm->cmsg_type = SCM_RIGHTS;
    cm->cmsg_len = CMSG_LEN(sizeof(int));
    memcpy(CMSG_DATA(cm), &fd, sizeof(int));
  }
  while (sendmsg(conn, &msg, MSG_NOSIGNAL) < 0 && errno == EINTR) {
  }
}

static void serve_one(int conn) {
  struct ucred cred;
  socklen_t cred_len = sizeof(cred);
  request_t req;
  set_timeouts(conn);
  if (getsockopt(conn, SOL_SOCKET, SO_PEERCRED, &cred, &cred_len) != 0)
    return;
  ssize_t n;
  do
    n = recv(conn, &req, sizeof(req), MSG_WAITALL);
  while (n < 0 && errno == EINTR);
  if (n != (ssize_t)sizeof(req) || req.magic != REQUEST_MAGIC ||
      req.version != PROTOCOL_VERSION) {
    send_reply(conn, REPLY_BAD_REQUEST, -1);
    return;
  }
  if (cred.uid != usmipc__self()->uid) {
    send_reply(conn, REPLY_OTHER_USER, -1);
    return;
  }
  if (req.buffer_id == TABLE_REQUEST) {
    /* The export table holds only buffer ids and descriptor numbers: any
     * process of the same user may read it. */
    int table = usmipc__exports_table_fd();
    send_reply(conn, table >= 0 ? REPLY_OK : REPLY_UNKNOWN_BUFFER, table);
    return;
  }
  /* The descriptor is sent while the lock is held so that a concurrent
   * withdraw cannot close it under us; sendmsg on a local socket does not
   * wait for the peer. */
  pthread_mutex_lock(&fdx_lock);
  grant_entry_t *g = grant_find(req.buffer_id);
  if (g == NULL)
    send_reply(conn, REPLY_UNKNOWN_BUFFER, -1);
  else if (!tokens_equal(g->token, req.token))
    send_reply(conn, REPLY_BAD_TOKEN, -1);
  else
    send_reply(conn, REPLY_OK, g->fd);
  pthread_mutex_unlock(&fdx_lock);
}

static void *broker_main(void *arg) {
  int fd = (int)(intptr_t)arg;
  for (;;) {
    int conn = accept4(fd, NULL, NULL, SOCK_CLOEXEC);
    if (conn < 0) {
      if (errno == EINTR || errno == ECONNABORTED || errno == EMFILE ||
          errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
        if (errno != EINTR && errno != ECONNABORTED)
          poll(NULL, 0, 10); /* out of descriptors: back off, then retry */
        continue;
      }
      return NULL; /* the socket is gone */
    }
    serve_one(conn);
    close(conn);
  }
}

/* Called with fdx_lock held. */
static int start_broker(void) {
  if (listen_fd >= 0)
    return 0;
  const usmipc__process_t *self = usmipc__self();
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0)
    return usmipc__fail_native(USMIPC_ETRANSPORT, errno,
                               "cannot create the fd broker's socket: %s",
                               strerror(errno));
  struct sockaddr_un addr;
  socklen_t len = broker_address(self->pid, self->nonce, &addr);
  if (bind(fd, (struct sockaddr *)&addr, len) != 0 || listen(fd, 128) != 0) {
    int e = errno;
    close(fd);
    return usmipc__fail_native(USMIPC_ETRANSPORT, e,
                               "cannot start the fd broker on @%s: %s",
                               addr.sun_path + 1, strerror(e));
  }
  /* The broker must never run the application's signal handlers. */
  sigset_t all, old;
  sigfillset(&all);
  pthread_sigmask(SIG_SETMASK, &all, &old);
  pthread_attr_t attr;
  pthread_attr_init(&attr);
  pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
  pthread_attr_setstacksize(&attr, 64 * 1024);
  pthread_t thread;
  int err = pthread_create(&thread, &attr, broker_main, (void *)(intptr_t)fd);
  pthread_attr_destroy(&attr);
  pthread_sigmask(SIG_SETMASK, &old, NULL);
  if (err != 0) {
    close(fd);
    return usmipc__fail_native(USMIPC_ETRANSPORT, err,
                               "cannot start the fd broker thread: %s",
                               strerror(err));
  }
  listen_fd = fd;
  return 0;
}

int usmipc__fdxfer_serve(void) {
  pthread_once(&fdx_once, fdx_init);
  pthread_mutex_lock(&fdx_lock);
  int rc = start_broker();
  pthread_mutex_unlock(&fdx_lock);
  return rc;
}

int usmipc__fdxfer_publish(int fd, uint64_t buffer_id,
                           usmipc__fd_grant_t *grant) {
  pthread_once(&fdx_once, fdx_init);
  uint8_t token[16];
  int rc = usmipc__random(token, sizeof(token));
  if (rc != 0)
    return rc;
  pthread_mutex_lock(&fdx_lock);
  if ((rc = start_broker()) != 0)
    goto out;
  if (grant_find(buffer_id) != NULL) {
    rc = usmipc__fail(USMIPC_EBUSY, "buffer %llu is already published",
                      (unsigned long long)buffer_id);
    goto out;
  }
  if (grant_count == grant_capacity) {
    size_t cap = grant_capacity ? grant_capacity * 2 : 32;
    void *grown = realloc(grants, cap * sizeof(*grants));
    if (grown == NULL) {
      rc = usmipc__fail(USMIPC_ENOMEM, "out of memory");
      goto out;
    }
    grants = grown;
    grant_capacity = cap;
  }
  /* The broker borrows the allocation's descriptor: the core withdraws the
   * grant before it frees the allocation, and a send happens under
   * fdx_lock, so the descriptor is open for as long as it is served. No
   * duplicate: an exported allocation costs one descriptor, not two. */
  struct stat st;
  if (fstat(fd, &st) != 0) {
    int e = errno;
    rc = usmipc__fail_native(-e, e, "cannot fstat the descriptor to share: %s",
                             strerror(e));
    goto out;
  }
  size_t at = grant_lower_bound(buffer_id);
  memmove(&grants[at + 1], &grants[at], (grant_count - at) * sizeof(*grants));
  grants[at].buffer_id = buffer_id;
  grants[at].fd = fd;
  memcpy(grants[at].token, token, 16);
  grant_count++;
  memcpy(grant->token, token, 16);
  grant->fd_number = (uint32_t)fd;
  /* Only a shmem file (memfd) reopens as itself through /proc: a device
   * node would open a new, unrelated file with the same (st_dev, st_ino).
   * F_GET_SEALS succeeds on shmem files alone (fcntl(2)), in one cheap
   * call. */
  grant->reopenable = fcntl(fd, F_GET_SEALS) >= 0;
  grant->dev = (uint64_t)st.st_dev;
  grant->ino = (uint64_t)st.st_ino;
out:
  pthread_mutex_unlock(&fdx_lock);
  return rc;
}

void usmipc__fdxfer_withdraw(uint64_t buffer_id) {
  pthread_mutex_lock(&fdx_lock);
  size_t at = grant_lower_bound(buffer_id);
  if (at < grant_count && grants[at].buffer_id == buffer_id) {
    memmove(&grants[at], &grants[at + 1],
            (grant_count - at - 1) * sizeof(*grants));
    grant_count--;
  }
  pthread_mutex_unlock(&fdx_lock);
}

/* ---- the importer's side --------------------------------------------------
 */

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

/* pidfds of recent exporters, so that a process opening many handles of one
 * exporter pays pidfd_open(2) once. Keyed by (pid, nonce): a pidfd names one
 * process for good, even once its pid is reused. pidfd_getfd runs under the
 * lock, so an entry is never closed while in use. */
#define PIDFD_CACHE_SIZE 16
static struct {
  uint32_t pid;
  uint64_t nonce; /* 0: the entry is free */
  int pidfd;
  uint64_t last_use;
} pidfds[PIDFD_CACHE_SIZE];
static uint64_t pidfd_clock;

/* Called with pidfd_lock held: the cached pidfd of (pid, nonce), opened on
 * first use, or -1 with errno set. */
static int pidfd_of(uint32_t pid, uint64_t nonce, int *slot) {
  int lru = 0;
  for (int i = 0; i < PIDFD_CACHE_SIZE; i++) {
    if (pidfds[i].nonce == nonce && pidfds[i].pid == pid) {
      pidfds[i].last_use = ++pidfd_clock;
      *slot = i;
      return pidfds[i].pidfd;
    }
    if (pidfds[i].nonce == 0 ||
        (pidfds[lru].nonce != 0 && pidfds[i].last_use < pidfds[lru].last_use))
      lru = i;
  }
  int pidfd = (int)syscall(SYS_pidfd_open, (pid_t)pid, 0);
  if (pidfd < 0)
    return -1;
  if (pidfds[lru].nonce != 0)
    close(pidfds[lru].pidfd);
  pidfds[lru].pid = pid;
  pidfds[lru].nonce = nonce;
  pidfds[lru].pidfd = pidfd;
  pidfds[lru].last_use = ++pidfd_clock;
  *slot = lru;
  return pidfd;
}

/* pidfd_getfd(2): a copy of descriptor fd_number of the exporter, or an
 * error saying why not. The caller checks what it got. */
static int pidfd_take(uint32_t pid, uint64_t nonce, uint32_t fd_number,
                      int *out) {
  pthread_mutex_lock(&pidfd_lock);
  int slot = -1;
  int pidfd = pidfd_of(pid, nonce, &slot);
  int fd = -1, e = errno;
  if (pidfd >= 0) {
    fd = (int)syscall(SYS_pidfd_getfd, pidfd, (int)fd_number, 0);
    e = errno;
    if (fd < 0 && e == ESRCH) { /* it exited: forget it */
      close(pidfd);
      pidfds[slot].nonce = 0;
    }
  }
  pthread_mutex_unlock(&pidfd_lock);
  if (fd >= 0) {
    *out = fd;
    return 0;
  }
  if (e == ESRCH)
    return usmipc__fail_native(USMIPC_EEXPORTERGONE, e,
                               "the exporting process %u has exited; "
                               "mappings opened before it exited stay valid, "
                               "new opens are impossible",
                               pid);
  if (pidfd < 0)
    return usmipc__fail_native(USMIPC_ETRANSPORT, e,
                               "pidfd_open(2) failed: %s (needs Linux 5.3; "
                               "set USMIPC_FD_TRANSPORT=socket)",
                               strerror(e));
  if (e == EPERM || e == EACCES)
    return usmipc__fail_native(USMIPC_EACCES, e,
                               "pidfd_getfd(2) may not take descriptors from "
                               "process %u: it needs ptrace access (Yama "
                               "ptrace_scope, containers); use "
                               "USMIPC_FD_TRANSPORT=socket or auto",
                               pid);
  if (e == EBADF)
    return usmipc__fail_native(USMIPC_EEXPORTERGONE, e,
                               "process %u no longer holds the memory this "
                               "handle names (the allocation was freed)",
                               pid);
  return usmipc__fail_native(USMIPC_ETRANSPORT, e,
                             "pidfd_getfd(2) failed: %s (needs Linux 5.6; set "
                             "USMIPC_FD_TRANSPORT=socket)",
                             strerror(e));
}

static int fetch_pidfd(const usmipc__wire_t *w, uint32_t seq, int *out) {
  /* A descriptor number names whatever the exporter has open under it now:
   * the export table said it was the allocation's before the copy (the
   * caller checked), and must still say so after it (the exporter clears
   * the slot before closing). */
  int rc, fd = -1;
  if ((rc = pidfd_take(w->pid, w->nonce, w->fd_number, &fd)) != 0)
    return rc;
  if ((rc = usmipc__exports_recheck(w, seq)) != 0 ||
      (rc = check_identity(fd, w)) != 0) {
    close(fd);
    return rc;
  }
  *out = fd;
  return 0;
}

/* Reopens the exporter's descriptor through /proc/<pid>/fd/<n>. proc(5)
 * allows that with PTRACE_MODE_READ access, which Yama's ptrace_scope=1
 * does not restrict (it restricts attaching), so between processes of one
 * user this works where pidfd_getfd does not. It reopens the file rather
 * than copying the descriptor, so it works for files that can be opened
 * again (memfd) and not for anonymous inodes (CUDA's descriptors). The
 * export table and the file identity are checked as for pidfd. */
static int fetch_procfd(const usmipc__wire_t *w, uint32_t seq, int *out) {
  if (!(w->flags & USMIPC__WIRE_FLAG_REOPENABLE))
    return usmipc__fail(USMIPC_ETRANSPORT,
                        "this memory's descriptor cannot be reopened through "
                        "/proc (it is not a memfd); use "
                        "USMIPC_FD_TRANSPORT=socket or pidfd");
  char path[48];
  snprintf(path, sizeof(path), "/proc/%u/fd/%u", w->pid, w->fd_number);
  int fd = open(path, O_RDWR | O_CLOEXEC);
  if (fd < 0) {
    int e = errno;
    if (e == ENOENT)
      return usmipc__fail_native(USMIPC_EEXPORTERGONE, e,
                                 "process %u no longer holds the memory this "
                                 "handle names (it exited or freed it)",
                                 w->pid);
    if (e == EACCES || e == EPERM)
      return usmipc__fail_native(USMIPC_EACCES, e,
                                 "%s may not be opened by this process "
                                 "(another user, or a non-dumpable "
                                 "exporter); use USMIPC_FD_TRANSPORT=socket",
                                 path);
    return usmipc__fail_native(USMIPC_ETRANSPORT, e,
                               "%s cannot be reopened (%s): this memory can "
                               "only move by descriptor passing; use "
                               "USMIPC_FD_TRANSPORT=socket or pidfd",
                               path, strerror(e));
  }
  int rc;
  if ((rc = usmipc__exports_recheck(w, seq)) != 0 ||
      (rc = check_identity(fd, w)) != 0) {
    close(fd);
    return rc;
  }
  *out = fd;
  return 0;
}

/* Asks the exporter's broker for the descriptor of buffer_id (or for the
 * export table, TABLE_REQUEST), presenting the handle's token. */
static int broker_request(const usmipc__wire_t *w, uint64_t buffer_id,
                          int *out) {
  struct sockaddr_un addr;
  socklen_t len = broker_address(w->pid, w->nonce, &addr);
  int s = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (s < 0)
    return usmipc__fail_native(USMIPC_ETRANSPORT, errno,
                               "cannot create a socket: %s", strerror(errno));
  set_timeouts(s);
  int rc;
  if (connect(s, (struct sockaddr *)&addr, len) != 0) {
    int e = errno;
    close(s);
    if (e == ECONNREFUSED || e == ENOENT)
      return usmipc__fail_native(USMIPC_EEXPORTERGONE, e,
                                 "the exporting process %u is gone (its fd "
                                 "broker @%s does not answer); mappings "
                                 "opened before it exited stay valid",
                                 w->pid, addr.sun_path + 1);
    return usmipc__fail_native(USMIPC_ETRANSPORT, e,
                               "cannot reach the fd broker of process %u: %s",
                               w->pid, strerror(e));
  }
  request_t req = {.magic = REQUEST_MAGIC,
                   .version = PROTOCOL_VERSION,
                   .buffer_id = buffer_id};
  memcpy(req.token, w->token, 16);
  if (send(s, &req, sizeof(req), MSG_NOSIGNAL) != (ssize_t)sizeof(req)) {
    int e = errno;
    close(s);
    return usmipc__fail_native(USMIPC_ETRANSPORT, e,
                               "sending the request to process %u failed: %s",
                               w->pid, strerror(e));
  }
  reply_t rep;
  struct iovec iov = {.iov_base = &rep, .iov_len = sizeof(rep)};
  union {
    struct cmsghdr align;
    char buf[CMSG_SPACE(sizeof(int) * 4)];
  } control;
  struct msghdr msg = {.msg_iov = &iov,
                       .msg_iovlen = 1,
                       .msg_control = control.buf,
                       .msg_controllen = sizeof(control.buf)};
  ssize_t n;
  do
    n = recvmsg(s, &msg, MSG_CMSG_CLOEXEC | MSG_WAITALL);
  while (n < 0 && errno == EINTR);
  int e = errno;
  close(s);

  /* Collect whatever descriptors arrived, so none leaks on any path. */
  int fds[4], nfds = 0;
  for (struct cmsghdr *cm = CMSG_FIRSTHDR(&msg); n > 0 && cm;
       cm = CMSG_NXTHDR(&msg, cm)) {
    if (cm->cmsg_level != SOL_SOCKET || cm->cmsg_type != SCM_RIGHTS)
      continue;
    size_t count = (cm->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    for (size_t i = 0; i < count && nfds < 4; i++)
      memcpy(&fds[nfds++], CMSG_DATA(cm) + i * sizeof(int), sizeof(int));
  }
  int fd = -1;
  if (n < 0)
    rc = usmipc__fail_native(USMIPC_ETRANSPORT, e,
                             "no answer from the fd broker of process %u: %s",
                             w->pid, strerror(e));
  else if (n != (ssize_t)sizeof(rep) || rep.magic != REPLY_MAGIC)
    rc = usmipc__fail(USMIPC_ETRANSPORT,
                      "malformed answer from the fd broker of process %u",
                      w->pid);
  else if (rep.status == REPLY_UNKNOWN_BUFFER)
    rc = usmipc__fail(USMIPC_EEXPORTERGONE,
                      "process %u no longer exports the memory this handle "
                      "names (the allocation was freed)",
                      w->pid);
  else if (rep.status == REPLY_BAD_TOKEN)
    rc = usmipc__fail(USMIPC_EACCES,
                      "process %u refused the handle: its capability token is "
                      "wrong (forged or corrupted handle)",
                      w->pid);
  else if (rep.status == REPLY_OTHER_USER)
    rc = usmipc__fail(USMIPC_EACCES,
                      "process %u refused to share memory with this process: "
                      "IPC is allowed only between processes of the same user "
                      "(uid %u here)",
                      w->pid, (unsigned)getuid());
  else if (rep.status != REPLY_OK || nfds != 1 || (msg.msg_flags & MSG_CTRUNC))
    rc = usmipc__fail(USMIPC_ETRANSPORT,
                      "the fd broker of process %u answered status %u with "
                      "%d descriptors",
                      w->pid, rep.status, nfds);
  else {
    rc = 0;
    fd = fds[0];
  }
  for (int i = 0; i < nfds; i++)
    if (fds[i] != fd)
      close(fds[i]);
  if (rc == 0)
    *out = fd;
  return rc;
}

static int fetch_socket(const usmipc__wire_t *w, int *out) {
  int fd = -1;
  int rc = broker_request(w, w->buffer_id, &fd);
  if (rc == 0 && (rc = check_identity(fd, w)) != 0)
    close(fd);
  if (rc == 0)
    *out = fd;
  return rc;
}

typedef enum transport { AUTO, SOCKET, PIDFD, PROCFD, BAD } transport_t;

static transport_t transport_mode(void) {
  const char *mode = getenv("USMIPC_FD_TRANSPORT");
  if (mode == NULL || *mode == '\0' || !strcmp(mode, "auto"))
    return AUTO;
  if (!strcmp(mode, "socket"))
    return SOCKET;
  if (!strcmp(mode, "pidfd"))
    return PIDFD;
  if (!strcmp(mode, "procfd"))
    return PROCFD;
  usmipc__fail(USMIPC_EINVAL,
               "USMIPC_FD_TRANSPORT='%s' is not one of auto, socket, pidfd, "
               "procfd",
               mode);
  return BAD;
}

int usmipc__fdxfer_fetch(const usmipc__wire_t *w, uint32_t seq, int *fd) {
  switch (transport_mode()) {
  case AUTO:
    /* The cheap paths first, each a few system calls; any refusal falls
     * back to the broker, which decides with the token and the uid and
     * costs two thread wake-ups. */
    if (fetch_pidfd(w, seq, fd) == 0 || fetch_procfd(w, seq, fd) == 0)
      return 0;
    return fetch_socket(w, fd);
  case SOCKET:
    return fetch_socket(w, fd);
  case PIDFD:
    return fetch_pidfd(w, seq, fd);
  case PROCFD:
    return fetch_procfd(w, seq, fd);
  default:
    return USMIPC_EINVAL;
  }
}

/* A table descriptor, however it was obtained, is the exporter's only if it
 * is the memfd named after the exporter's pid and nonce: a recycled pid or a
 * reused descriptor number cannot pass. Closes fd when it is not. */
static int check_table(int fd, const usmipc__wire_t *w) {
  char expect[96], name[64], link[128], path[40];
  usmipc__exports_table_name(w->pid, w->nonce, name, sizeof(name));
  snprintf(expect, sizeof(expect), "/memfd:%s (deleted)", name);
  snprintf(path, sizeof(path), "/proc/self/fd/%d", fd);
  ssize_t n = readlink(path, link, sizeof(link) - 1);
  if (n >= 0 && (size_t)n == strlen(expect) && !memcmp(link, expect, (size_t)n))
    return 0;
  close(fd);
  return usmipc__fail(USMIPC_EEXPORTERGONE,
                      "process %u is not the process that exported this "
                      "handle (its export table is missing: it exited)",
                      w->pid);
}

static int fetch_table_pidfd(const usmipc__wire_t *w, int *out) {
  int fd = -1;
  int rc = pidfd_take(w->pid, w->nonce, w->table_fd_number, &fd);
  if (rc == 0 && (rc = check_table(fd, w)) == 0)
    *out = fd;
  return rc;
}

/* The table through /proc/<pid>/fd, read-only (see fetch_procfd). */
static int fetch_table_procfd(const usmipc__wire_t *w, int *out) {
  char path[48];
  snprintf(path, sizeof(path), "/proc/%u/fd/%u", w->pid, w->table_fd_number);
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    int e = errno;
    if (e == EACCES || e == EPERM)
      return usmipc__fail_native(USMIPC_EACCES, e,
                                 "%s may not be opened by this process "
                                 "(another user); use "
                                 "USMIPC_FD_TRANSPORT=socket",
                                 path);
    return usmipc__fail_native(USMIPC_EEXPORTERGONE, e,
                               "cannot open %s (%s): the exporter exited", path,
                               strerror(e));
  }
  int rc = check_table(fd, w);
  if (rc == 0)
    *out = fd;
  return rc;
}

int usmipc__fdxfer_fetch_table(const usmipc__wire_t *w, int *fd) {
  switch (transport_mode()) {
  case AUTO:
    if (fetch_table_pidfd(w, fd) == 0 || fetch_table_procfd(w, fd) == 0)
      return 0;
    return broker_request(w, TABLE_REQUEST, fd);
  case PROCFD:
    return fetch_table_procfd(w, fd);
  case SOCKET:
    return broker_request(w, TABLE_REQUEST, fd);
  case PIDFD:
    return fetch_table_pidfd(w, fd);
  default:
    return USMIPC_EINVAL;
  }
}
