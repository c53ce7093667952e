/* The importer's side of moving descriptors: taking an exporter's
 * descriptor by pidfd_getfd(2) or /proc/<pid>/fd, and asking its broker
 * (connect, check the listener, one request and one answer) over
 * connections kept for the next request.
 *
 * Transport floor of the core (linux/), beside the exporter's broker
 * (broker.c) and below the importer's record of each exporter
 * (core/peers.c), which proves the exporter and calls here. The messages
 * are built and checked by wire/broker_msg.c.
 *
 * Threats: the listener may not be the exporter (a squatter on a dead
 * exporter's name, another user): check_listener proves its credentials
 * before anything is sent, and no descriptor of an answer is used before
 * usmipc__reply_check proved it (tests/c test_trust.c). */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <unistd.h>

#include "linux/transport.h"

int usmipc__transport_mode(usmipc__transport_t *mode) {
  const char *env = getenv("USMIPC_FD_TRANSPORT");
  if (env == NULL || *env == '\0' || !strcmp(env, "auto"))
    *mode = USMIPC__TRANSPORT_AUTO;
  else if (!strcmp(env, "socket"))
    *mode = USMIPC__TRANSPORT_SOCKET;
  else if (!strcmp(env, "pidfd"))
    *mode = USMIPC__TRANSPORT_PIDFD;
  else if (!strcmp(env, "procfd"))
    *mode = USMIPC__TRANSPORT_PROCFD;
  else
    return usmipc__fail(USMIPC_EINVAL,
                        "USMIPC_FD_TRANSPORT='%s' is not one of auto, socket, "
                        "pidfd, procfd",
                        env);
  return 0;
}

static int fail_exited(uint32_t pid, int e) {
  return usmipc__fail_native(USMIPC_EEXPORTERGONE, e,
                             "the exporting process %u has exited; mappings "
                             "opened before it exited stay valid, new opens "
                             "are impossible",
                             pid);
}

int usmipc__fail_exporter_exited(const usmipc__wire_t *w, int e) {
  return fail_exited(w->pid, e);
}

int usmipc__pidfd_take(int pidfd, uint32_t pid, uint32_t n, int *out) {
  int fd = (int)syscall(SYS_pidfd_getfd, pidfd, (int)n, 0);
  if (fd >= 0) {
    *out = fd;
    return 0;
  }
  int e = errno;
  if (e == ESRCH)
    return fail_exited(pid, e);
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
  if (e == EMFILE || e == ENFILE)
    return usmipc__fail_native(USMIPC_EMFILE, e,
                               "this process has no free file descriptor "
                               "for the memory of process %u: close some or "
                               "raise the limit (ulimit -n)",
                               pid);
  return usmipc__fail_native(USMIPC_ETRANSPORT, e,
                             "pidfd_getfd(2) failed: %s (needs Linux 5.6; set "
                             "USMIPC_FD_TRANSPORT=socket)",
                             strerror(e));
}

int usmipc__procfd_reopen(const usmipc__wire_t *w, uint32_t n, int flags,
                          int *out) {
  char path[48];
  snprintf(path, sizeof(path), "/proc/%u/fd/%u", w->pid, n);
  /* O_PATH resolves the magic link without opening the file for I/O: no
   * FIFO, socket or device can block us or act on the open. Only a
   * regular file (a memfd) is then reopened for real. */
  int opath = open(path, O_PATH | O_CLOEXEC);
  if (opath < 0) {
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
    if (e == EMFILE || e == ENFILE)
      return usmipc__fail_native(USMIPC_EMFILE, e,
                                 "no free file descriptor to open %s; raise "
                                 "the limit (ulimit -n)",
                                 path);
    return usmipc__fail_native(USMIPC_ETRANSPORT, e, "cannot open %s: %s", path,
                               strerror(e));
  }
  struct stat st;
  if (fstat(opath, &st) != 0 || !S_ISREG(st.st_mode)) {
    close(opath);
    return usmipc__fail(USMIPC_EUNTRUSTED,
                        "%s is not a memory file (forged handle, or the "
                        "descriptor number was reused): refused",
                        path);
  }
  char self_path[48];
  snprintf(self_path, sizeof(self_path), "/proc/self/fd/%d", opath);
  int fd = open(self_path, flags | O_CLOEXEC | O_NONBLOCK);
  int e = errno;
  close(opath);
  if (fd < 0)
    return usmipc__fail_native(usmipc__errno_code(e), e, "cannot reopen %s: %s",
                               path, strerror(e));
  *out = fd;
  return 0;
}

/* Connects to the exporter's broker, waiting at most until deadline while
 * its backlog is full. */
static int broker_connect(const usmipc__wire_t *w, uint64_t deadline, int *out,
                          char *name, size_t name_len) {
  uint64_t my_net = usmipc__ns_inode("self", "net");
  bool same_net = w->net_ns == 0 || my_net == 0 || w->net_ns == my_net;
  bool same_pid = usmipc__same_pid_namespace(w);
  const char *dir = usmipc__socket_dir_env();
  struct sockaddr_un addr;
  socklen_t len;
  if (same_net) {
    len = usmipc__broker_abstract_address(w->pid, w->nonce, &addr);
    snprintf(name, name_len, "@%s", addr.sun_path + 1);
  } else if ((w->flags & USMIPC__WIRE_FLAG_SOCKET_DIR) && dir != NULL &&
             (len = usmipc__broker_dir_address(dir, w->pid, w->nonce, &addr)) !=
                 0) {
    snprintf(name, name_len, "%s", addr.sun_path);
  } else {
    return usmipc__fail(
        USMIPC_ENAMESPACE,
        "the exporting process %u is in another %s than this process "
        "(another container, or unshare), from where its socket cannot be "
        "reached: %s",
        w->pid,
        same_pid ? "network namespace"
                 : "network namespace and another PID namespace",
        (w->flags & USMIPC__WIRE_FLAG_SOCKET_DIR)
            ? "set USMIPC_SOCKET_DIR here to the directory the exporter "
              "listens in (as this process sees it)"
            : "start the exporter with USMIPC_SOCKET_DIR set to a directory "
              "both processes see, and set it here too, or run both in one "
              "network namespace (--network=host)");
  }
  for (;;) {
    int s = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (s < 0)
      return usmipc__fail_native(usmipc__errno_code(errno), errno,
                                 "cannot create a socket: %s", strerror(errno));
    if (connect(s, (struct sockaddr *)&addr, len) == 0) {
      *out = s;
      return 0;
    }
    int e = errno;
    close(s);
    if (e == EAGAIN && usmipc__now_ns() < deadline) {
      poll(NULL, 0, 1); /* the backlog is full: the broker is draining it */
      continue;
    }
    if (e == ECONNREFUSED || e == ENOENT) {
      if (!same_pid && dir == NULL)
        return usmipc__fail_native(
            USMIPC_ENAMESPACE, e,
            "the exporting process %u is in another PID namespace, and "
            "nothing listens on %s: it exited, or it listens elsewhere "
            "(set USMIPC_SOCKET_DIR in both processes)",
            w->pid, name);
      return usmipc__fail_native(USMIPC_EEXPORTERGONE, e,
                                 "the exporting process %u is gone (nothing "
                                 "listens on %s); mappings opened before it "
                                 "exited stay valid",
                                 w->pid, name);
    }
    if (e == EAGAIN)
      return usmipc__fail(USMIPC_ETIMEDOUT,
                          "timed out after %u ms: the broker of process %u "
                          "accepts no connection",
                          usmipc__ipc_timeout_ms(), w->pid);
    return usmipc__fail_native(usmipc__errno_code(e), e,
                               "cannot reach the broker of process %u at %s: "
                               "%s",
                               w->pid, name, strerror(e));
  }
}

/* Who listens: the kernel's word, before a byte is sent. */
static int check_listener(int s, const usmipc__wire_t *w, const char *name) {
  const usmipc__process_t *self = usmipc__self();
  struct ucred cred;
  socklen_t len = sizeof(cred);
  if (getsockopt(s, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0)
    return usmipc__fail_native(USMIPC_ETRANSPORT, errno,
                               "cannot read the credentials of %s: %s", name,
                               strerror(errno));
  if (cred.uid != self->uid)
    return usmipc__fail(USMIPC_EACCES,
                        "the process listening on %s runs as uid %u, not as "
                        "this process's uid %u: it is not the exporter (did "
                        "the exporter exit and another user take its "
                        "socket's name?); refused before sending anything",
                        name, (unsigned)cred.uid, (unsigned)self->uid);
  bool same_pid = usmipc__same_pid_namespace(w);
  if (same_pid && cred.pid != 0 && (uint32_t)cred.pid != w->pid)
    return usmipc__fail(USMIPC_EUNTRUSTED,
                        "process %d listens on %s, not the exporter %u: "
                        "refused before sending anything",
                        (int)cred.pid, name, w->pid);
  if (w->pidfd_ino != 0) {
    int pidfd = -1;
    len = sizeof(pidfd);
    if (getsockopt(s, SOL_SOCKET, SO_PEERPIDFD, &pidfd, &len) == 0 &&
        pidfd >= 0) {
      uint64_t ino = usmipc__pidfd_inode(pidfd);
      close(pidfd);
      if (ino != 0 && ino != w->pidfd_ino)
        return usmipc__fail(USMIPC_EUNTRUSTED,
                            "the process listening on %s is not the exporter "
                            "(its pidfd differs): refused before sending "
                            "anything",
                            name);
      return 0;
    }
  }
  /* No pidfs: the start time tells a reused pid apart, where pids mean the
   * same to both of us. */
  if (same_pid && cred.pid != 0 && w->start_time != 0) {
    char pid[16];
    snprintf(pid, sizeof(pid), "%d", (int)cred.pid);
    if (usmipc__start_time(pid) != w->start_time)
      return usmipc__fail(USMIPC_EUNTRUSTED,
                          "process %d listening on %s started at another "
                          "time than the exporter: refused",
                          (int)cred.pid, name);
  }
  return 0;
}

/* ---- connections kept open to brokers already met ------------------------
 * A connection whose listener passed check_listener stays the exporter's
 * for its whole life (the kernel fixes a connected socket's peer; if the
 * exporter dies, the next read sees the end). So after an answer the
 * importer keeps it, and its next open from that exporter is one request and
 * one answer: no connect, no credential checks. Each connection serves one
 * thread at a time (taken out of the list while in use); the broker closes
 * one idle for KEEP_MS, or to make room, and the importer then reconnects. */
#define KEPT_MAX 16         /* in all */
#define KEPT_MAX_PER_PEER 4 /* to one exporter */

typedef struct kept_conn {
  uint32_t pid;
  uint64_t nonce;
  int fd;
} kept_conn_t;

/* kept_lock guards these: a leaf of the lock order (fork.c), taken only
 * to take a connection out of the list or put one back. */
static pthread_mutex_t kept_lock = PTHREAD_MUTEX_INITIALIZER;
static kept_conn_t kept[KEPT_MAX]; /* oldest first */

static int kept_count;

/* The broker thread does not exist in a fork child, and the parent's grants
 * are the parent's to serve: the child forgets them (and its copies of the
 * listening sockets; the socket file stays the parent's) and starts its own
 * broker on its next export. */
static void kept_forget_all(void) {
  for (int i = 0; i < kept_count; i++)
    close(kept[i].fd);
  kept_count = 0;
}

void usmipc__fdtake_fork_prepare(void) { pthread_mutex_lock(&kept_lock); }
void usmipc__fdtake_fork_parent(void) { pthread_mutex_unlock(&kept_lock); }
/* A fork child forgets its parent's connections: a request on one would
 * cross the parent's own (their answers would interleave). */
void usmipc__fdtake_fork_child(void) {
  pthread_mutex_unlock(&kept_lock);
  kept_forget_all();
}

static int kept_take(const usmipc__wire_t *w) {
  int fd = -1;
  pthread_mutex_lock(&kept_lock);
  for (int i = kept_count - 1; i >= 0; i--) {
    if (kept[i].pid == w->pid && kept[i].nonce == w->nonce) {
      fd = kept[i].fd;
      memmove(&kept[i], &kept[i + 1],
              sizeof(kept[0]) * (size_t)(kept_count - i - 1));
      kept_count--;
      break;
    }
  }
  pthread_mutex_unlock(&kept_lock);
  return fd;
}

static void kept_put(const usmipc__wire_t *w, int fd) {
  int dropped = -1, same = 0;
  pthread_mutex_lock(&kept_lock);
  for (int i = 0; i < kept_count; i++)
    same += kept[i].pid == w->pid && kept[i].nonce == w->nonce;
  if (same >= KEPT_MAX_PER_PEER) {
    dropped = fd;
  } else {
    if (kept_count == KEPT_MAX) { /* the least recently used goes */
      dropped = kept[0].fd;
      memmove(&kept[0], &kept[1], sizeof(kept[0]) * (KEPT_MAX - 1));
      kept_count--;
    }
    kept[kept_count++] =
        (kept_conn_t){.pid = w->pid, .nonce = w->nonce, .fd = fd};
  }
  pthread_mutex_unlock(&kept_lock);
  if (dropped >= 0)
    close(dropped);
}

/* What one exchange asks and where its answer goes. */
typedef struct call_args {
  unsigned want;
  const uint8_t *body; /* WANT_RELEASE: the body */
  size_t body_len;
  const usmipc__wire_t *const *batch; /* WANT_FDS: the allocations */
  size_t batch_n;
  int *table_fd;    /* WANT_TABLE */
  int *data_fd;     /* WANT_FD: one, or a run's chunk_count, in chunk order */
  int *fds;         /* WANT_FDS: batch_n descriptors */
  size_t *failed;   /* WANT_FDS: the entry the broker refused */
  uint64_t *minted; /* WANT_FORWARD: the ticket the broker minted */
  const uint8_t *forward_nonce; /* WANT_FORWARD: the forwarder's */
} call_args_t;

/* Writes the message a asks for into out (request, and a body where there
 * is one); returns its length. */
static size_t message_build(uint8_t *out, const usmipc__wire_t *w,
                            const call_args_t *a,
                            const uint8_t client_nonce[16]) {
  uint8_t *req = out;
  if (a->want == USMIPC__WANT_RELEASE) {
    /* A release names the release (its id in the buffer id field) and
     * proves its token over the header and the body. */
    usmipc__wire_t named = *w;
    named.buffer_id = w->release_id;
    usmipc__request_build(req, &named, a->want, client_nonce);
    usmipc__release_capability(req, w->release_token, a->body, a->body_len,
                               req + 64);
    usmipc__put16le(out + USMIPC__REQUEST_LEN, (uint16_t)a->body_len);
    memcpy(out + USMIPC__REQUEST_LEN + 2, a->body, a->body_len);
    return USMIPC__REQUEST_LEN + 2 + a->body_len;
  }
  if (a->want == USMIPC__WANT_FORWARD) {
    /* As a release: the release named, its ticket's token proven over the
     * header and the body (the ticket), under another label. */
    usmipc__wire_t named = *w;
    named.buffer_id = w->release_id;
    usmipc__request_build(req, &named, a->want, client_nonce);
    uint8_t *body = out + USMIPC__REQUEST_LEN + 2;
    usmipc__put16le(out + USMIPC__REQUEST_LEN, USMIPC__FORWARD_BODY_LEN);
    usmipc__put64le(body, w->release_ticket);
    memcpy(body + 8, a->forward_nonce, 16);
    usmipc__forward_capability(req, w->release_token, body,
                               USMIPC__FORWARD_BODY_LEN, req + 64);
    return USMIPC__REQUEST_LEN + 2 + USMIPC__FORWARD_BODY_LEN;
  }
  if (a->want == USMIPC__WANT_FDS) {
    /* The header names no allocation; each entry names one and proves its
     * token over the header (so over this request's client nonce). */
    usmipc__wire_t named = *w;
    named.buffer_id = 0;
    usmipc__request_build(req, &named, a->want, client_nonce);
    size_t body_len = 2 + a->batch_n * USMIPC__FDS_ENTRY_LEN;
    usmipc__put16le(out + USMIPC__REQUEST_LEN, (uint16_t)body_len);
    uint8_t *body = out + USMIPC__REQUEST_LEN + 2;
    usmipc__put16le(body, (uint16_t)a->batch_n);
    for (size_t i = 0; i < a->batch_n; i++) {
      uint8_t *e = body + 2 + i * USMIPC__FDS_ENTRY_LEN;
      const usmipc__wire_t *x = a->batch[i];
      usmipc__put64le(e, x->buffer_id);
      usmipc__fds_capability(req, x->token, x->buffer_id, e + 8);
    }
    return USMIPC__REQUEST_LEN + 2 + body_len;
  }
  usmipc__request_build(req, w, a->want, client_nonce);
  return USMIPC__REQUEST_LEN;
}

/* One request and its answer on connection s. *dropped is set when the
 * broker had closed the connection before answering (a kept connection that
 * went idle too long): nothing was served, and a new connection may retry. */
static int exchange(int s, const usmipc__wire_t *w, const call_args_t *a,
                    uint64_t deadline, const char *name, bool *dropped) {
  uint8_t msg_out[USMIPC__FDS_MESSAGE_MAX >
                          USMIPC__REQUEST_LEN + 2 + USMIPC__RELEASE_BODY_MAX
                      ? USMIPC__FDS_MESSAGE_MAX
                      : USMIPC__REQUEST_LEN + 2 + USMIPC__RELEASE_BODY_MAX];
  uint8_t client_nonce[16];
  const uint8_t *req = msg_out;
  int rc = usmipc__random(client_nonce, 16);
  if (rc != 0)
    return rc;
  size_t msg_len = message_build(msg_out, w, a, client_nonce);
  USMIPC__STAT_ADD(transport_exchanges, 1);
  /* An idle connection's buffer takes the message at once. */
  ssize_t n = send(s, msg_out, msg_len, MSG_NOSIGNAL | MSG_DONTWAIT);
  if (n != (ssize_t)msg_len) {
    int e = errno;
    *dropped = n < 0 && (e == EPIPE || e == ECONNRESET);
    return usmipc__fail_native(USMIPC_ETRANSPORT, e,
                               "sending the request to process %u failed: %s",
                               w->pid, n < 0 ? strerror(e) : "short write");
  }
  char what[160];
  snprintf(what, sizeof(what), "the broker of process %u (%s)", w->pid, name);
  if ((rc = usmipc__wait_fd(s, POLLIN, deadline, what)) != 0)
    return rc;
  uint8_t rep[USMIPC__REPLY_LEN];
  struct iovec iov = {.iov_base = rep, .iov_len = sizeof(rep)};
  /* Room for a full SCM_RIGHTS message (SCM_MAX_FD): a broker that sends
   * more than was asked (for a single descriptor, a run's chunks or a
   * batch) still has each descriptor it sent closed here, rather than left
   * to MSG_CTRUNC's silent drop; MSG_CTRUNC then only means that this
   * process could not take them all (out of descriptors). */
  union {
    struct cmsghdr align;
    char buf[CMSG_SPACE(sizeof(int) * USMIPC__FDS_PER_MESSAGE_MAX)];
  } control;
  struct msghdr msg = {.msg_iov = &iov,
                       .msg_iovlen = 1,
                       .msg_control = control.buf,
                       .msg_controllen = sizeof(control.buf)};
  do
    n = recvmsg(s, &msg, MSG_CMSG_CLOEXEC | MSG_DONTWAIT);
  while (n < 0 && errno == EINTR);
  int e = errno;
  *dropped = n == 0 || (n < 0 && e == ECONNRESET);

  /* Collect whatever descriptors arrived, so none leaks on any path; any
   * beyond what fits is closed at once (and fails the count check). */
  int fds[USMIPC__FDS_PER_MESSAGE_MAX];
  int nfds = 0, kept_fds = 0;
  for (struct cmsghdr *cm = n > 0 ? CMSG_FIRSTHDR(&msg) : NULL; cm;
       cm = CMSG_NXTHDR(&msg, cm)) {
    if (cm->cmsg_level != SOL_SOCKET || cm->cmsg_type != SCM_RIGHTS)
      continue;
    size_t count = (cm->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    for (size_t i = 0; i < count; i++, nfds++) {
      int fd;
      memcpy(&fd, CMSG_DATA(cm) + i * sizeof(int), sizeof(int));
      if (kept_fds < (int)USMIPC__ARRAY_SIZE(fds))
        fds[kept_fds++] = fd;
      else
        close(fd);
    }
  }
  bool truncated = (msg.msg_flags & MSG_CTRUNC) != 0;
  if (n < 0)
    rc = usmipc__fail_native(USMIPC_ETRANSPORT, e,
                             "no answer from the broker of process %u: %s",
                             w->pid, strerror(e));
  else if (a->want == USMIPC__WANT_FORWARD)
    rc = usmipc__reply_check_forward(rep, (size_t)n, req, w, nfds, name,
                                     a->minted);
  else if (a->want == USMIPC__WANT_FDS)
    rc = usmipc__reply_check_fds(rep, (size_t)n, req, w, a->batch_n, nfds,
                                 truncated, name, a->failed);
  else
    rc = usmipc__reply_check(rep, (size_t)n, req, w, a->want, nfds, truncated,
                             name);
  int k = 0;
  if (rc == 0 && a->want == USMIPC__WANT_FDS) {
    memcpy(a->fds, fds, sizeof(int) * a->batch_n);
    k = (int)a->batch_n;
  }
  if (rc == 0 && (a->want & USMIPC__WANT_TABLE))
    *a->table_fd = fds[k++];
  /* One descriptor, or a run's, in chunk order. */
  for (int i = 0;
       rc == 0 && (a->want & USMIPC__WANT_FD) && i < usmipc__wire_run_length(w);
       i++)
    a->data_fd[i] = fds[k++];
  for (int i = k; i < kept_fds; i++)
    close(fds[i]);
  return rc;
}

/* One exchange with w's exporter's broker: on a kept connection, or a new
 * one whose listener check_listener proved. */
static int call(const usmipc__wire_t *w, const call_args_t *a,
                uint64_t deadline) {
  char name[120];
  snprintf(name, sizeof(name), "the broker socket of process %u", w->pid);
  int rc, s = kept_take(w);
  if (s >= 0) {
    bool dropped = false;
    rc = exchange(s, w, a, deadline, name, &dropped);
    if (rc == 0) {
      kept_put(w, s);
      return 0;
    }
    close(s);
    if (!dropped)
      return rc;
  }
  if ((rc = broker_connect(w, deadline, &s, name, sizeof(name))) != 0)
    return rc;
  if ((rc = check_listener(s, w, name)) != 0) {
    close(s);
    return rc;
  }
  bool dropped = false;
  rc = exchange(s, w, a, deadline, name, &dropped);
  if (rc == 0)
    kept_put(w, s);
  else
    close(s);
  return rc;
}

int usmipc__broker_call(const usmipc__wire_t *w, unsigned want,
                        uint64_t deadline, int *table_fd, int *data_fd) {
  if (table_fd)
    *table_fd = -1;
  for (int i = 0; data_fd && i < usmipc__wire_run_length(w); i++)
    data_fd[i] = -1;
  call_args_t a = {.want = want, .table_fd = table_fd, .data_fd = data_fd};
  return call(w, &a, deadline);
}

int usmipc__broker_release(const usmipc__wire_t *w, const uint8_t *body,
                           size_t len, uint64_t deadline) {
  call_args_t a = {.want = USMIPC__WANT_RELEASE, .body = body, .body_len = len};
  return call(w, &a, deadline);
}

int usmipc__broker_forward(const usmipc__wire_t *w, const uint8_t nonce[16],
                           uint64_t deadline, uint64_t *ticket) {
  *ticket = 0;
  call_args_t a = {
      .want = USMIPC__WANT_FORWARD, .minted = ticket, .forward_nonce = nonce};
  return call(w, &a, deadline);
}

int usmipc__broker_fetch_fds(const usmipc__wire_t *const *w, size_t n,
                             uint64_t deadline, int *fds, size_t *failed) {
  *failed = SIZE_MAX;
  for (size_t i = 0; i < n; i++)
    fds[i] = -1;
  if (n == 0 || n > USMIPC__FDS_PER_REQUEST)
    return usmipc__fail(USMIPC_EINVAL,
                        "one request names 1 to %u allocations, not %zu",
                        USMIPC__FDS_PER_REQUEST, n);
  for (size_t i = 0; i < n; i++)
    if (w[i]->pid != w[0]->pid || w[i]->nonce != w[0]->nonce ||
        memcmp(w[i]->key, w[0]->key, 16) != 0 ||
        !(w[i]->flags & USMIPC__WIRE_FLAG_FD) || w[i]->chunk_count != 0)
      return usmipc__fail(USMIPC_EINVAL,
                          "handle %zu of a request to process %u names "
                          "another exporter, shares no descriptor, or names "
                          "a run of chunks (whose descriptors travel only "
                          "together)",
                          i, w[0]->pid);
  call_args_t a = {.want = USMIPC__WANT_FDS,
                   .batch = w,
                   .batch_n = n,
                   .fds = fds,
                   .failed = failed};
  return call(w[0], &a, deadline);
}
