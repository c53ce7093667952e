/* The exporter's broker: moving file descriptors between unrelated
 * processes, with proof of who is on the other end.
 *
 * Transport floor of the core (linux/). This file is the exporter's side:
 * the grants (which descriptor each capability may take) and the broker
 * thread that serves them. The importer's side is linux/fdtake.c, the
 * messages both sides build and check are wire/broker_msg.c (pure, fuzzed),
 * and a release or forward request is handed to the handler release.c registers
 * (usmipc__broker_on_release): the broker names no object.
 *
 * Memory shared through a file descriptor (host memfd, CUDA VMM POSIX fds,
 * Level Zero IPC fds) needs that descriptor in the importer, and every
 * importer needs the exporter's export table (exports.c). Three ways:
 *
 *  - pidfd_getfd(2) (Linux 5.6): the importer copies the descriptor straight
 *    out of the exporter. Fast, but it needs ptrace access to the exporter,
 *    which Yama's ptrace_scope=1 denies unless the importer is an ancestor.
 *  - /proc/<pid>/fd/<n>: reopens a memfd (not an anonymous inode such as
 *    CUDA's); proc(5) asks only PTRACE_MODE_READ, which Yama allows.
 *  - the exporter's broker: a thread, started on the first export, listening
 *    on an abstract Unix socket named after the exporter's pid and nonce
 *    (and, with USMIPC_SOCKET_DIR, on a socket file there, for importers in
 *    other network namespaces: containers).
 *
 * The broker protocol is one request and one answer, authenticated both
 * ways with MACs (keyed BLAKE2s, util/blake2s.c):
 *  - Before sending anything the importer checks the listener's kernel
 *    credentials: same uid, the exporter's pid where pids are comparable,
 *    and the exporter's pidfd inode (SO_PEERPIDFD, pidfs) where the kernel
 *    has them. A squatter on the name of a dead exporter, of another user,
 *    learns nothing.
 *  - The request carries a fresh client nonce and a proof (a MAC keyed by
 *    the exporter's process key, which every handle carries), and for a
 *    descriptor a capability (a MAC keyed by the allocation's token). No
 *    secret travels: a listener that is not the exporter sees MACs over a
 *    nonce it cannot reuse. A request for many descriptors (WANT_FDS)
 *    carries one capability per allocation, each keyed by its own token.
 *  - The answer carries a MAC over the client nonce keyed by the process
 *    key; the importer uses no descriptor from an answer that fails it.
 *  - The broker checks the peer's uid when it accepts a connection, serves
 *    any number of connections at once from one poll loop, gives each a
 *    deadline, and bounds how many one process may hold, so idle or slow
 *    peers of any uid cannot delay others.
 *
 * USMIPC_FD_TRANSPORT picks: "auto" (default: pidfd, then /proc, then the
 * broker), "socket", "pidfd" or "procfd".
 */
#include <dirent.h>
#include <fcntl.h>
#include <poll.h>
#include <semaphore.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <unistd.h>

#include "linux/transport.h"

/* How long the broker waits for a connected peer's request. */
#define CONN_DEADLINE_MS 1000
/* How long an answered connection may stay idle for the next request. */
#define KEEP_MS 5000
/* Connections served at once, and at most per peer process. */
#define MAX_CONNS 64
#define MAX_CONNS_PER_PEER 8
/* New connections one broker thread accepts per wake-up. */
#define MAX_ACCEPT_PER_WAKE 4

/* ---- grants and the broker --------------------------------------------- */

typedef struct grant_entry {
  uint64_t buffer_id;
  /* The allocation's own descriptors, borrowed until withdrawn: one, or
   * one per chunk of a run of another library's memory, sent together. */
  int *fds;
  uint32_t nfds;
  uint8_t token[16];
} grant_entry_t;

static pthread_mutex_t fdx_lock = PTHREAD_MUTEX_INITIALIZER;
static grant_entry_t *grants; /* sorted by buffer_id */
static size_t grant_count, grant_capacity;
static bool broker_running;
static int listen_fds[2] = {-1, -1}; /* abstract, socket dir */
/* The socket file in USMIPC_SOCKET_DIR: the directory, opened and checked
 * once (socket_dir_open), the file's name and identity in it, and the
 * process that made it. Every later use names the file relative to
 * socket_dir_fd, never by a path. */
static int socket_dir_fd = -1;
static char dir_socket_name[64];
static dev_t dir_socket_dev;
static ino_t dir_socket_ino;
static pid_t dir_socket_owner;

void usmipc__broker_fork_prepare(void) { pthread_mutex_lock(&fdx_lock); }
void usmipc__broker_fork_parent(void) { pthread_mutex_unlock(&fdx_lock); }

void usmipc__broker_fork_child(void) {
  pthread_mutex_unlock(&fdx_lock);
  /* The descriptors belong to the inherited allocations. */
  for (size_t i = 0; i < grant_count; i++)
    free(grants[i].fds);
  grant_count = 0;
  for (int i = 0; i < 2; i++) {
    if (listen_fds[i] >= 0)
      close(listen_fds[i]);
    listen_fds[i] = -1;
  }
  dir_socket_name[0] = '\0';
  if (socket_dir_fd >= 0)
    close(socket_dir_fd);
  socket_dir_fd = -1;
  broker_running = false;
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

typedef struct conn {
  int fd;
  pid_t peer_pid; /* 0 when the peer is in a PID namespace we cannot see */
  uint64_t deadline;
  uint64_t since; /* accepted, or its last request answered */
  bool kept;      /* answered before: an importer keeps it for more */
  size_t got;
  /* A request, or a release: request, u16 body length, body. */
  uint8_t buf[USMIPC__REQUEST_LEN + 2 + USMIPC__RELEASE_BODY_MAX];
  /* A WANT_FDS message, which may not fit in buf: allocated once its
   * length is known, freed once it is answered. */
  uint8_t *big;
} conn_t;

static const uint8_t *conn_bytes(const conn_t *c) {
  return c->big != NULL ? c->big : c->buf;
}

/* How many bytes the message in c has in all, as far as its first bytes
 * tell; 0 for a body of an impossible length. */
static size_t message_len(const conn_t *c) {
  const uint8_t *m = conn_bytes(c);
  if (c->got < USMIPC__REQUEST_LEN)
    return USMIPC__REQUEST_LEN;
  uint32_t want = usmipc__get32le(m + 12);
  if (want != USMIPC__WANT_RELEASE && want != USMIPC__WANT_FDS &&
      want != USMIPC__WANT_FORWARD)
    return USMIPC__REQUEST_LEN;
  if (c->got < USMIPC__REQUEST_LEN + 2)
    return USMIPC__REQUEST_LEN + 2;
  size_t body = usmipc__get16le(m + USMIPC__REQUEST_LEN);
  if (want == USMIPC__WANT_FDS)
    return body < 2 + USMIPC__FDS_ENTRY_LEN || body > USMIPC__FDS_BODY_MAX
               ? 0
               : USMIPC__REQUEST_LEN + 2 + body;
  if (want == USMIPC__WANT_FORWARD)
    return body != USMIPC__FORWARD_BODY_LEN ? 0
                                            : USMIPC__REQUEST_LEN + 2 + body;
  return body < 10 || body > USMIPC__RELEASE_BODY_MAX
             ? 0
             : USMIPC__REQUEST_LEN + 2 + body;
}

/* Where the next bytes of a message of need bytes go: c->buf, or for a
 * larger one c->big (NULL when out of memory). */
static uint8_t *conn_room(conn_t *c, size_t need) {
  if (need <= sizeof(c->buf) || c->big != NULL)
    return c->big != NULL ? c->big : c->buf;
  c->big = malloc(USMIPC__FDS_MESSAGE_MAX);
  if (c->big != NULL)
    memcpy(c->big, c->buf, c->got);
  return c->big;
}

/* An answer; word8 is the count of descriptors sent, or for a refused
 * WANT_FDS entry its index. */
static void send_reply_word(int conn, const uint8_t *req, uint32_t status,
                            uint32_t word8, const int *fds, int nfds) {
  uint8_t rep[USMIPC__REPLY_LEN];
  usmipc__reply_build(rep, req, status, (int)word8, usmipc__self()->key);
  struct iovec iov = {.iov_base = rep, .iov_len = sizeof(rep)};
  union {
    struct cmsghdr align;
    char buf[CMSG_SPACE(sizeof(int) * USMIPC__FDS_PER_MESSAGE_MAX)];
  } control;
  struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1};
  if (nfds > 0) {
    memset(&control, 0, CMSG_SPACE(sizeof(int) * (size_t)nfds));
    msg.msg_control = control.buf;
    msg.msg_controllen = CMSG_SPACE(sizeof(int) * (size_t)nfds);
    struct cmsghdr *cm = CMSG_FIRSTHDR(&msg);
    cm->cmsg_level = SOL_SOCKET;
    cm->cmsg_type = SCM_RIGHTS;
    cm->cmsg_len = CMSG_LEN(sizeof(int) * (size_t)nfds);
    memcpy(CMSG_DATA(cm), fds, sizeof(int) * (size_t)nfds);
  }
  /* Non-blocking: a fresh connection's buffer always has room for one
   * answer; a peer that made it otherwise only loses its own answer. */
  while (sendmsg(conn, &msg, MSG_NOSIGNAL | MSG_DONTWAIT) < 0 &&
         errno == EINTR) {
  }
}

static void send_reply(int conn, const uint8_t *req, uint32_t status,
                       const int *fds, int nfds) {
  send_reply_word(conn, req, status, (uint32_t)nfds, fds, nfds);
}

/* The judge's lookup on the broker: a published allocation's token, and its
 * descriptor noted at the entry's index. A run of chunks (a grant of
 * several descriptors) is served only whole, to its own request (want 2,
 * usmipc__peer_fetch_run_fds): in a batch it counts as not served (status
 * 1), so no entry can take part of a run. fdx_lock held. */
static const uint8_t *grant_token(void *ctx, uint64_t buffer_id, size_t index) {
  grant_entry_t *g = grant_find(buffer_id);
  if (g == NULL || g->nfds != 1)
    return NULL;
  ((int *)ctx)[index] = g->fds[0];
  return g->token;
}

/* Many descriptors in one answer (WANT_FDS). One refused entry refuses the
 * whole request: the answer names it and carries no descriptor. An
 * importer asks at once for what it is about to open together, so a partial
 * answer would only hand it descriptors to close, and all-or-none keeps the
 * importer's cleanup to one path. Sent under fdx_lock, as a single
 * descriptor is, so that no withdraw closes one under us. */
static void serve_fds(int conn, const uint8_t *req, const uint8_t *body,
                      size_t body_len) {
  int fds[USMIPC__FDS_PER_REQUEST];
  size_t count = 0, failed = SIZE_MAX;
  pthread_mutex_lock(&fdx_lock);
  uint32_t status = usmipc__fds_request_judge(req, body, body_len, grant_token,
                                              fds, &count, &failed);
  if (status == USMIPC__REPLY_OK) {
    /* Counted before the send: once the importer has them, a reader of the
     * counters (a test) must see them counted. */
    USMIPC__STAT_ADD(descriptors_sent, count);
    send_reply_word(conn, req, USMIPC__REPLY_OK, (uint32_t)count, fds,
                    (int)count);
  } else {
    send_reply_word(conn, req, status,
                    failed == SIZE_MAX ? 0 : (uint32_t)failed, NULL, 0);
  }
  pthread_mutex_unlock(&fdx_lock);
}

/* Who files release tickets and mints forwarded ones (release.c registers
 * it with its first registry): the broker moves the request and knows
 * nothing of tickets. */
static usmipc__release_handler_t release_handler; /* atomic */

void usmipc__broker_on_release(usmipc__release_handler_t handler) {
  __atomic_store_n(&release_handler, handler, __ATOMIC_RELEASE);
}

/* A release or forward request's answer (*word: word 8 of the reply): the
 * handler's, or before any registry exists the answer it would give (a
 * malformed body, else nothing to release or forward). */
static uint32_t release_status(const uint8_t *req, const uint8_t *body,
                               size_t len, uint32_t peer_pid, uint32_t *word) {
  *word = 0;
  usmipc__release_handler_t handler =
      __atomic_load_n(&release_handler, __ATOMIC_ACQUIRE);
  if (handler != NULL)
    return handler(req, body, len, peer_pid, word);
  if (usmipc__get32le(req + 12) == USMIPC__WANT_FORWARD)
    return len == USMIPC__FORWARD_BODY_LEN ? USMIPC__REPLY_UNKNOWN_BUFFER
                                           : USMIPC__REPLY_BAD_REQUEST;
  uint64_t ticket;
  const uint8_t *ev;
  size_t ev_len;
  usmipc__wire_t w;
  return usmipc__release_body_check(body, len, &ticket, &ev, &ev_len, &w) != 0
             ? USMIPC__REPLY_BAD_REQUEST
             : USMIPC__REPLY_UNKNOWN_BUFFER;
}

/* One complete request: check, answer, done. A release carries its body
 * after the request (body_len bytes). */
static void serve_request(int conn, const uint8_t *req, const uint8_t *body,
                          size_t body_len, uint32_t peer_pid) {
  const usmipc__process_t *self = usmipc__self();
  uint32_t want = 0;
  uint64_t buffer_id = 0;
  uint32_t status =
      usmipc__request_check(req, USMIPC__REQUEST_LEN, self->pid, self->nonce,
                            self->key, &want, &buffer_id);
  if (status != USMIPC__REPLY_OK) {
    send_reply(conn, status == USMIPC__REPLY_BAD_REQUEST ? NULL : req, status,
               NULL, 0);
    return;
  }
  if (want == USMIPC__WANT_RELEASE || want == USMIPC__WANT_FORWARD) {
    uint32_t word;
    status = release_status(req, body, body_len, peer_pid, &word);
    send_reply_word(conn, req, status, word, NULL, 0);
    return;
  }
  if (want == USMIPC__WANT_FDS) {
    serve_fds(conn, req, body, body_len);
    return;
  }
  int fds[1 + USMIPC__CHUNKS_MAX], nfds = 0;
  if (want & USMIPC__WANT_TABLE) {
    int table = usmipc__exports_table_fd();
    if (table < 0) {
      send_reply(conn, req, USMIPC__REPLY_NO_TABLE, NULL, 0);
      return;
    }
    fds[nfds++] = table; /* never closed while the process lives */
  }
  if (!(want & USMIPC__WANT_FD)) {
    send_reply(conn, req, USMIPC__REPLY_OK, fds, nfds);
    return;
  }
  /* The descriptor is sent while the lock is held so that a concurrent
   * withdraw cannot close it under us; the send does not wait. */
  pthread_mutex_lock(&fdx_lock);
  grant_entry_t *g = grant_find(buffer_id);
  if (g == NULL)
    send_reply(conn, req, USMIPC__REPLY_UNKNOWN_BUFFER, NULL, 0);
  else if (!usmipc__request_capability_ok(req, g->token))
    send_reply(conn, req, USMIPC__REPLY_BAD_CAPABILITY, NULL, 0);
  else {
    /* All of the grant's descriptors: one, or a run's chunks in order. */
    memcpy(fds + nfds, g->fds, g->nfds * sizeof(int));
    nfds += (int)g->nfds;
    USMIPC__STAT_ADD(descriptors_sent, g->nfds); /* before: see above */
    send_reply(conn, req, USMIPC__REPLY_OK, fds, nfds);
  }
  pthread_mutex_unlock(&fdx_lock);
}

static void conn_close(conn_t *conns, int *count, int i) {
  close(conns[i].fd);
  free(conns[i].big);
  conns[i] = conns[--*count];
}

/* Which connection gives way to a new one: a kept idle connection before
 * one waiting for its first request (its importer reconnects when it finds
 * it closed), and among those the one idle longest (a legitimate importer
 * sends its request at once, so the oldest is the likeliest to be idle). */
static bool evict_before(const conn_t *a, const conn_t *b) {
  bool a_idle = a->kept && a->got == 0, b_idle = b->kept && b->got == 0;
  if (a_idle != b_idle)
    return a_idle;
  return a->since < b->since;
}

/* A new connection: refused at once unless it is our user's; admitted
 * within the bounds (one of the same peer, or of all, makes room). */
static void admit(conn_t *conns, int *count, int fd) {
  struct ucred cred;
  socklen_t len = sizeof(cred);
  if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0 ||
      cred.uid != usmipc__self()->uid) {
    send_reply(fd, NULL, USMIPC__REPLY_OTHER_USER, NULL, 0);
    close(fd);
    return;
  }
  int same = 0, victim_same = -1, victim = -1;
  for (int i = 0; i < *count; i++) {
    if (victim < 0 || evict_before(&conns[i], &conns[victim]))
      victim = i;
    if (conns[i].peer_pid == cred.pid) {
      same++;
      if (victim_same < 0 || evict_before(&conns[i], &conns[victim_same]))
        victim_same = i;
    }
  }
  if (same >= MAX_CONNS_PER_PEER)
    conn_close(conns, count, victim_same);
  else if (*count >= MAX_CONNS)
    conn_close(conns, count, victim);
  conn_t *c = &conns[(*count)++];
  c->fd = fd;
  c->peer_pid = cred.pid;
  c->since = usmipc__now_ns();
  c->deadline = c->since + (uint64_t)CONN_DEADLINE_MS * 1000000u;
  c->kept = false;
  c->got = 0;
  c->big = NULL;
}

typedef struct broker_start {
  pthread_mutex_t *alive;
  sem_t ready;
  int status;
} broker_start_t;

/* One poll loop over the listening sockets and the connections this thread
 * accepted. Every broker thread runs one; the bounds (MAX_CONNS,
 * MAX_CONNS_PER_PEER) hold per thread. */
static void *broker_loop(void *arg) {
  (void)arg;
  /* Named, so that ps, top and gdb tell usmipc's threads apart. */
  pthread_setname_np(pthread_self(), "usmipc-broker");
  conn_t conns[MAX_CONNS];
  int count = 0;
  bool backoff = false;
  for (;;) {
    struct pollfd pfd[2 + MAX_CONNS];
    int n = 0, listeners = 0;
    pthread_mutex_lock(&fdx_lock);
    for (int i = 0; i < 2; i++)
      if (listen_fds[i] >= 0 && !backoff)
        pfd[n++] = (struct pollfd){.fd = listen_fds[i], .events = POLLIN};
    pthread_mutex_unlock(&fdx_lock);
    listeners = n;
    uint64_t now = usmipc__now_ns(), next = UINT64_MAX;
    for (int i = 0; i < count; i++) {
      pfd[n++] = (struct pollfd){.fd = conns[i].fd, .events = POLLIN};
      if (conns[i].deadline < next)
        next = conns[i].deadline;
    }
    int timeout = -1;
    if (backoff)
      timeout = 10; /* out of descriptors: let some close, then accept */
    else if (next != UINT64_MAX)
      timeout = next <= now ? 0 : (int)((next - now) / 1000000u + 1);
    backoff = false;
    if (poll(pfd, (nfds_t)n, timeout) < 0 && errno != EINTR)
      poll(NULL, 0, 10);
    /* Connections first (their indices shift as they close). */
    now = usmipc__now_ns();
    for (int i = n - 1; i >= listeners; i--) {
      int c = i - listeners;
      if (pfd[i].revents) {
        conn_t *k = &conns[c];
        size_t need = message_len(k);
        uint8_t *into = need == 0 ? NULL : conn_room(k, need);
        ssize_t got = into == NULL ? -1
                                   : recv(k->fd, into + k->got, need - k->got,
                                          MSG_DONTWAIT);
        if (got > 0) {
          k->got += (size_t)got;
          need = message_len(k); /* a body's length is known now */
        }
        if (need == 0 || into == NULL) {
          /* A body too long (or no memory for it). */
          conn_close(conns, &count, c);
        } else if (k->got == need && need != USMIPC__REQUEST_LEN + 2) {
          /* Answered, the connection stays for the importer's next open
           * (it keeps it while it has more to ask), until KEEP_MS idle. */
          const uint8_t *m = conn_bytes(k);
          serve_request(
              k->fd, m, m + USMIPC__REQUEST_LEN + 2,
              need > USMIPC__REQUEST_LEN ? need - USMIPC__REQUEST_LEN - 2 : 0,
              (uint32_t)k->peer_pid);
          free(k->big);
          k->big = NULL;
          conns[c].got = 0;
          conns[c].kept = true;
          conns[c].since = usmipc__now_ns();
          conns[c].deadline = conns[c].since + (uint64_t)KEEP_MS * 1000000u;
        } else if (got == 0 || (got < 0 && errno != EAGAIN && errno != EINTR)) {
          conn_close(conns, &count, c);
        }
      } else if (conns[c].deadline <= now) {
        conn_close(conns, &count, c); /* idle too long */
      }
    }
    for (int i = 0; i < listeners; i++) {
      if (!pfd[i].revents)
        continue;
      /* Every broker thread wakes for a new connection; each takes a few
       * (the first awake does not take them all), so importers that arrive
       * together are spread over the threads, and each importer's kept
       * connection stays with the thread that accepted it. */
      for (int k = 0; k < MAX_ACCEPT_PER_WAKE; k++) {
        int fd = accept4(pfd[i].fd, NULL, NULL, SOCK_CLOEXEC | SOCK_NONBLOCK);
        if (fd < 0) {
          if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS ||
              errno == ENOMEM)
            backoff = true;
          else if (errno == EBADF || errno == EINVAL)
            return NULL; /* the socket is gone */
          break;
        }
        admit(conns, &count, fd);
      }
    }
  }
}

/* The first broker thread: holds the export table's liveness mutex for the
 * life of the process (importers learn of our death from the kernel marking
 * it), then serves like the others. */
static void *broker_main(void *arg) {
  broker_start_t *start = arg;
  start->status =
      usmipc__exports_hold_alive(start->alive, (uint32_t)syscall(SYS_gettid));
  int ok = start->status == 0;
  sem_post(&start->ready); /* start is gone after this */
  if (!ok)
    return NULL;
  return broker_loop(NULL);
}

/* How many threads serve the broker: one per 4 CPUs, at most 4
 * (USMIPC_BROKER_THREADS overrides, 1-16). One thread answers ~200k
 * requests/s; with 16 importers at once on 16 cores a single thread queued
 * each request behind ~15 others (4.6x a lone importer's open). */
static int broker_thread_count(void) {
  unsigned long long v;
  if (usmipc__env_number("USMIPC_BROKER_THREADS", 1, 16, false,
                         "the default (one per 4 CPUs, at most 4)", &v))
    return (int)v;
  long cpus = sysconf(_SC_NPROCESSORS_ONLN);
  int n = cpus < 8 ? 1 : (int)(cpus / 4);
  return n > 4 ? 4 : n;
}

static int listen_on(const struct sockaddr_un *addr, socklen_t len, int *out) {
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0)
    return -errno;
  if (bind(fd, (const struct sockaddr *)addr, len) != 0 ||
      listen(fd, 256) != 0) {
    int e = errno;
    close(fd);
    return -e;
  }
  *out = fd;
  return 0;
}

/* ---- USMIPC_SOCKET_DIR ------------------------------------------------------
 * The threat: the exporter (often root) creates and removes files in a
 * directory the user named. Whoever else can write that directory can
 * replace a file between two calls that name it by path (a symlink swapped
 * in after bind made a root exporter's chmod change a file of the
 * attacker's choosing), take the socket's name first (it is visible in
 * /proc/net/unix as soon as the abstract socket listens), or plant links
 * for the stale-file sweep. So:
 *  - the directory must pass ssh's StrictModes rule (socket_dir_open):
 *    owned by this uid or root, writable by no one else unless sticky
 *    (where no one can remove or rename another user's file); in a user
 *    namespace root's directories show as the overflow uid's, and a sticky
 *    one of those (/dev/shm, /tmp of an unprivileged container) counts as
 *    root's. A symbolic link as the directory is refused: its target is
 *    not the directory that was checked;
 *  - the directory is opened once (O_NOFOLLOW) and checked through that
 *    descriptor, and every later call names a file relative to it: bind
 *    and connect through /proc/self/fd/<dir>/<name> (a path that resolves
 *    through the open directory, whatever happens to the path above it),
 *    fstatat and unlinkat with AT_SYMLINK_NOFOLLOW semantics;
 *  - the socket file gets mode 0600 at its creation, not by a chmod after
 *    it: on Linux bind(2) creates the file with the socket inode's own mode
 *    less the umask (net/unix/af_unix.c, unix_bind_bsd), and fchmod(2) on
 *    the unbound socket sets that mode. umask(2) around bind would do the
 *    same but is process-wide (another thread's files would get it too); a
 *    private 0700 subdirectory per process would change the path importers
 *    compute. The mode is defence in depth anyway: the broker checks every
 *    peer's uid (SO_PEERCRED) when it accepts.
 * Tests: trust_socket_dir_modes, _symlink_swap (+ _sticky), _squatted_name,
 * _sweep_links, _userns_overflow, _stale_files. */
unsigned usmipc__test_socket_bind_delay_ms;

static bool in_user_namespace(void) {
  /* The initial user namespace maps every uid to itself, in one line. */
  char map[256];
  int fd = open("/proc/self/uid_map", O_RDONLY | O_CLOEXEC);
  if (fd < 0)
    return false;
  ssize_t n = read(fd, map, sizeof(map) - 1);
  close(fd);
  if (n <= 0)
    return false;
  map[n] = '\0';
  unsigned long inside, outside, count;
  int used = 0;
  return !(sscanf(map, " %lu %lu %lu %n", &inside, &outside, &count, &used) ==
               3 &&
           inside == 0 && outside == 0 && count == 4294967295ul &&
           map[used] == '\0');
}

static uint32_t overflow_uid(void) {
  char text[32];
  int fd = open("/proc/sys/kernel/overflowuid", O_RDONLY | O_CLOEXEC);
  ssize_t n = fd >= 0 ? read(fd, text, sizeof(text) - 1) : -1;
  if (fd >= 0)
    close(fd);
  if (n <= 0)
    return 65534; /* the kernel's default */
  text[n] = '\0';
  return (uint32_t)strtoul(text, NULL, 10);
}

/* Opens dir into socket_dir_fd, refusing (USMIPC_EACCES) a directory that
 * someone other than this user and root could change. */
static int socket_dir_open(const char *dir) {
  int fd = open(dir, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) {
    int e = errno;
    struct stat link;
    /* O_DIRECTORY | O_NOFOLLOW on a link: ENOTDIR (ELOOP without it). */
    if (e == ELOOP ||
        (e == ENOTDIR && lstat(dir, &link) == 0 && S_ISLNK(link.st_mode)))
      return usmipc__fail(USMIPC_EACCES,
                          "USMIPC_SOCKET_DIR=%s is a symbolic link, which "
                          "could be pointed elsewhere once checked: set it "
                          "to the directory itself",
                          dir);
    return usmipc__fail_native(
        e == EACCES || e == EPERM ? USMIPC_EACCES : USMIPC_ETRANSPORT, e,
        "cannot open USMIPC_SOCKET_DIR=%s: %s (it "
        "must be an existing directory)",
        dir, strerror(e));
  }
  struct stat st;
  if (fstat(fd, &st) != 0) {
    int e = errno;
    close(fd);
    return usmipc__fail_native(usmipc__errno_code(e), e,
                               "cannot stat USMIPC_SOCKET_DIR=%s: %s", dir,
                               strerror(e));
  }
  uint32_t me = usmipc__self()->uid;
  bool sticky = (st.st_mode & S_ISVTX) != 0;
  bool owner_ok =
      st.st_uid == me || st.st_uid == 0 ||
      (sticky && st.st_uid == overflow_uid() && in_user_namespace());
  if (!owner_ok) {
    close(fd);
    return usmipc__fail(USMIPC_EACCES,
                        "USMIPC_SOCKET_DIR=%s is owned by uid %u, who could "
                        "replace the socket files in it: use a directory "
                        "owned by this user (uid %u) or by root, such as "
                        "/dev/shm or /tmp",
                        dir, (unsigned)st.st_uid, me);
  }
  if (!sticky && (st.st_mode & (S_IWGRP | S_IWOTH)) != 0) {
    close(fd);
    return usmipc__fail(USMIPC_EACCES,
                        "USMIPC_SOCKET_DIR=%s is writable by %s without the "
                        "sticky bit, so they could replace the socket files "
                        "in it: chmod go-w it, chmod +t it (as /tmp is), or "
                        "use a directory only this user can write",
                        dir, (st.st_mode & S_IWOTH) ? "others" : "its group");
  }
  socket_dir_fd = fd;
  return 0;
}

/* name in the socket directory, as a path through its open descriptor;
 * 0 when it does not fit. */
static socklen_t in_dir_address(const char *name, struct sockaddr_un *addr) {
  memset(addr, 0, sizeof(*addr));
  addr->sun_family = AF_UNIX;
  int n = snprintf(addr->sun_path, sizeof(addr->sun_path),
                   "/proc/self/fd/%d/%s", socket_dir_fd, name);
  if (n < 0 || (size_t)n >= sizeof(addr->sun_path))
    return 0;
  return (socklen_t)(offsetof(struct sockaddr_un, sun_path) + (size_t)n + 1);
}

/* Listens on dir_socket_name in the (checked, open) socket directory dir. */
static int listen_in_dir(const char *dir, int *out) {
  struct sockaddr_un addr;
  socklen_t len = in_dir_address(dir_socket_name, &addr);
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0)
    return usmipc__fail_native(usmipc__errno_code(errno), errno,
                               "cannot create a socket: %s", strerror(errno));
  int r = len == 0 || fchmod(fd, 0600) != 0
              ? -1
              : bind(fd, (const struct sockaddr *)&addr, len);
  int e = errno;
  if (r != 0 && e == ENOENT && access("/proc/self/fd", F_OK) != 0 &&
      usmipc__broker_dir_address(dir, usmipc__self()->pid,
                                 usmipc__self()->nonce, &addr)) {
    /* No /proc (a bare chroot): the checked directory by its path. Only a
     * directory above it changed since the check could move the file, and
     * nothing names the file by this path again. */
    r = bind(fd, (const struct sockaddr *)&addr, SUN_LEN(&addr));
    e = errno;
  }
  struct stat st;
  if (r != 0 && e == EADDRINUSE &&
      fstatat(socket_dir_fd, dir_socket_name, &st, AT_SYMLINK_NOFOLLOW) == 0 &&
      st.st_uid != usmipc__self()->uid) {
    close(fd);
    return usmipc__fail(USMIPC_EACCES,
                        "uid %u made a file named %s in USMIPC_SOCKET_DIR=%s "
                        "before this process could listen there (someone "
                        "standing in for it?); it was left alone: remove it, "
                        "or use a directory only this user can write",
                        (unsigned)st.st_uid, dir_socket_name, dir);
  }
  if (r == 0 && usmipc__test_socket_bind_delay_ms)
    poll(NULL, 0, (int)usmipc__test_socket_bind_delay_ms);
  /* Its identity, for the unlink at exit. In a checked directory no one
   * else can replace the file, so this is the socket just bound. */
  if (r == 0 &&
      (fstatat(socket_dir_fd, dir_socket_name, &st, AT_SYMLINK_NOFOLLOW) != 0 ||
       !S_ISSOCK(st.st_mode))) {
    r = -1;
    e = EEXIST; /* not the socket just bound: nothing to listen on */
  }
  if (r != 0 || listen(fd, 256) != 0) {
    if (r == 0)
      e = errno;
    close(fd);
    return usmipc__fail_native(
        USMIPC_ETRANSPORT, e,
        "cannot listen in USMIPC_SOCKET_DIR=%s: %s (it must be a directory "
        "this process can write, with a short path)",
        dir, len == 0 ? strerror(ENAMETOOLONG) : strerror(e));
  }
  dir_socket_dev = st.st_dev;
  dir_socket_ino = st.st_ino;
  *out = fd;
  return 0;
}

/* The socket file outlives a process that is killed; one that exits
 * removes it (only the process that made it: not a fork child), if the
 * name still holds that file. */
static void unlink_dir_socket(void) {
  struct stat st;
  if (socket_dir_fd >= 0 && dir_socket_name[0] != '\0' &&
      dir_socket_owner == getpid() &&
      fstatat(socket_dir_fd, dir_socket_name, &st, AT_SYMLINK_NOFOLLOW) == 0 &&
      st.st_dev == dir_socket_dev && st.st_ino == dir_socket_ino)
    unlinkat(socket_dir_fd, dir_socket_name, 0);
}
static void register_unlink_at_exit(void) { atexit(unlink_dir_socket); }

/* A killed exporter leaves its socket file behind. Each new broker removes
 * the ones of its user that nothing listens on any more (connect refused):
 * the directory holds about as many files as live exporters. Only sockets
 * of this uid, never followed through a link, in the checked directory,
 * where no other user can swap them between the check and the unlink. */
static void remove_stale_sockets(void) {
  int fd = openat(socket_dir_fd, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  DIR *d = fd >= 0 ? fdopendir(fd) : NULL;
  if (d == NULL) {
    if (fd >= 0)
      close(fd);
    return;
  }
  struct dirent *e;
  while ((e = readdir(d)) != NULL) {
    size_t n = strlen(e->d_name);
    if (strncmp(e->d_name, "usmipc.", 7) != 0 || n < 12 ||
        strcmp(e->d_name + n - 5, ".sock") != 0 ||
        strcmp(e->d_name, dir_socket_name) == 0)
      continue;
    struct sockaddr_un addr;
    socklen_t len = in_dir_address(e->d_name, &addr);
    struct stat st;
    if (len == 0 ||
        fstatat(socket_dir_fd, e->d_name, &st, AT_SYMLINK_NOFOLLOW) != 0 ||
        !S_ISSOCK(st.st_mode) || st.st_uid != usmipc__self()->uid)
      continue;
    int s = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (s < 0)
      break;
    if (connect(s, (struct sockaddr *)&addr, len) != 0 && errno == ECONNREFUSED)
      unlinkat(socket_dir_fd, e->d_name, 0);
    close(s);
  }
  closedir(d);
}

/* Called with fdx_lock held and the table's liveness mutex in hand. */
static int start_broker(pthread_mutex_t *alive) {
  const usmipc__process_t *self = usmipc__self();
  struct sockaddr_un addr;
  socklen_t len =
      usmipc__broker_abstract_address(self->pid, self->nonce, &addr);
  int fds[2] = {-1, -1};
  int e = listen_on(&addr, len, &fds[0]);
  if (e != 0)
    return usmipc__fail_native(usmipc__errno_code(-e), -e,
                               "cannot start the fd broker on @%s: %s",
                               addr.sun_path + 1, strerror(-e));
  const char *dir = usmipc__socket_dir_env();
  if (dir != NULL) {
    /* Importers name the file by its path in dir: that must fit too. */
    if (usmipc__broker_dir_address(dir, self->pid, self->nonce, &addr) == 0) {
      close(fds[0]);
      return usmipc__fail(USMIPC_ETRANSPORT,
                          "cannot listen in USMIPC_SOCKET_DIR=%s: its path is "
                          "too long for a socket address (use a shorter one)",
                          dir);
    }
    snprintf(dir_socket_name, sizeof(dir_socket_name), "usmipc.%u.%016llx.sock",
             self->pid, (unsigned long long)self->nonce);
    int rc = socket_dir_open(dir);
    if (rc == 0 && (rc = listen_in_dir(dir, &fds[1])) != 0) {
      close(socket_dir_fd);
      socket_dir_fd = -1;
    }
    if (rc != 0) {
      dir_socket_name[0] = '\0';
      close(fds[0]);
      return rc;
    }
    dir_socket_owner = getpid();
    remove_stale_sockets();
    static pthread_once_t atexit_once = PTHREAD_ONCE_INIT;
    pthread_once(&atexit_once, register_unlink_at_exit);
  }
  broker_start_t start = {.alive = alive};
  sem_init(&start.ready, 0, 0);
  /* The broker must never run the application's signal handlers. */
  sigset_t all, old;
  sigfillset(&all);
  pthread_sigmask(SIG_SETMASK, &all, &old);
  pthread_attr_t attr;
  pthread_attr_init(&attr);
  pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
  pthread_attr_setstacksize(&attr, 256 * 1024);
  pthread_t thread;
  listen_fds[0] = fds[0];
  listen_fds[1] = fds[1];
  int err = pthread_create(&thread, &attr, broker_main, &start);
  if (err == 0) /* named here too, so it is named when the export returns */
    pthread_setname_np(thread, "usmipc-broker");
  pthread_attr_destroy(&attr);
  pthread_sigmask(SIG_SETMASK, &old, NULL);
  if (err == 0) {
    while (sem_wait(&start.ready) != 0 && errno == EINTR) {
    }
  }
  sem_destroy(&start.ready);
  if (err != 0 || start.status != 0) {
    /* Without the liveness mutex held importers would take us for dead: no
     * broker rather than a half one (the thread, if any, has returned). */
    for (int i = 0; i < 2; i++) {
      if (listen_fds[i] >= 0)
        close(listen_fds[i]);
      listen_fds[i] = -1;
    }
    unlink_dir_socket();
    dir_socket_name[0] = '\0';
    if (socket_dir_fd >= 0)
      close(socket_dir_fd);
    socket_dir_fd = -1;
    return usmipc__fail_native(USMIPC_ETRANSPORT, err ? err : start.status,
                               "cannot start the fd broker thread: %s",
                               strerror(err ? err : start.status));
  }
  /* More threads, once the first holds the liveness mutex. One that fails
   * to start only costs throughput. */
  int threads = broker_thread_count();
  for (int i = 1; i < threads; i++) {
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    pthread_attr_setstacksize(&attr, 256 * 1024);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    if (pthread_create(&thread, &attr, broker_loop, NULL) == 0)
      pthread_setname_np(thread, "usmipc-broker");
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    pthread_attr_destroy(&attr);
  }
  broker_running = true;
  return 0;
}

int usmipc__broker_serve(void) {
  pthread_mutex_lock(&fdx_lock);
  bool running = broker_running;
  pthread_mutex_unlock(&fdx_lock);
  if (running)
    return 0;
  /* The table (and its mutex) is made before fdx_lock is taken: the
   * library never holds the transport's lock while taking the table's
   * (process.c takes them in one order around fork). */
  pthread_mutex_t *alive = usmipc__exports_alive_mutex();
  if (alive == NULL)
    return usmipc__fail(USMIPC_ETRANSPORT, "cannot create the export table");
  pthread_mutex_lock(&fdx_lock);
  int rc = broker_running ? 0 : start_broker(alive);
  pthread_mutex_unlock(&fdx_lock);
  return rc;
}

bool usmipc__broker_socket_dir(void) {
  pthread_mutex_lock(&fdx_lock);
  bool on = listen_fds[1] >= 0;
  pthread_mutex_unlock(&fdx_lock);
  return on;
}

int usmipc__broker_publish(int fd, uint64_t buffer_id, bool may_reopen,
                           usmipc__fd_grant_t *grant) {
  return usmipc__broker_publish_fds(&fd, 1, buffer_id, may_reopen, grant);
}

int usmipc__broker_publish_fds(const int *fds, uint32_t nfds,
                               uint64_t buffer_id, bool may_reopen,
                               usmipc__fd_grant_t *grant) {
  if (nfds == 0 || nfds > USMIPC__CHUNKS_MAX)
    return usmipc__fail(USMIPC_EINVAL, "cannot publish %u descriptors at once",
                        nfds);
  uint8_t token[16];
  int rc = usmipc__random(token, sizeof(token));
  if (rc != 0 || (rc = usmipc__broker_serve()) != 0)
    return rc;
  /* Only a shmem file (memfd) reopens as itself through /proc: a device
   * node would open a new, unrelated file with the same (st_dev, st_ino).
   * F_GET_SEALS succeeds on shmem files alone (fcntl(2)). The first
   * descriptor names the grant in handles. */
  struct stat st;
  if (fstat(fds[0], &st) != 0)
    return usmipc__fail_native(usmipc__errno_code(errno), errno,
                               "cannot fstat the descriptor to share: %s",
                               strerror(errno));
  int *copy = malloc(nfds * sizeof(int));
  if (copy == NULL)
    return usmipc__fail(USMIPC_ENOMEM, "out of memory");
  memcpy(copy, fds, nfds * sizeof(int));
  pthread_mutex_lock(&fdx_lock);
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
  /* The broker borrows the allocation's descriptors: the core withdraws the
   * grant before it closes them, and a send happens under fdx_lock, so they
   * are open for as long as they are served. */
  size_t at = grant_lower_bound(buffer_id);
  memmove(&grants[at + 1], &grants[at], (grant_count - at) * sizeof(*grants));
  grants[at].buffer_id = buffer_id;
  grants[at].fds = copy;
  grants[at].nfds = nfds;
  copy = NULL;
  memcpy(grants[at].token, token, 16);
  grant_count++;
  memcpy(grant->token, token, 16);
  grant->fd_number = (uint32_t)fds[0];
  grant->reopenable =
      nfds == 1 && may_reopen && fcntl(fds[0], F_GET_SEALS) >= 0;
  grant->dev = (uint64_t)st.st_dev;
  grant->ino = (uint64_t)st.st_ino;
out:
  pthread_mutex_unlock(&fdx_lock);
  free(copy);
  return rc;
}

void usmipc__broker_withdraw(uint64_t buffer_id) {
  pthread_mutex_lock(&fdx_lock);
  size_t at = grant_lower_bound(buffer_id);
  if (at < grant_count && grants[at].buffer_id == buffer_id) {
    free(grants[at].fds);
    memmove(&grants[at], &grants[at + 1],
            (grant_count - at - 1) * sizeof(*grants));
    grant_count--;
  }
  pthread_mutex_unlock(&fdx_lock);
}
