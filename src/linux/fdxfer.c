/* Moving file descriptors between unrelated processes, with proof of who is
 * on the other end.
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
 * ways with MACs (keyed BLAKE2s, blake2s.c):
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

#include "../blake2s.h"
#include "../common.h"

#ifndef SYS_pidfd_getfd
#define SYS_pidfd_getfd 438
#endif
#ifndef SO_PEERPIDFD
#define SO_PEERPIDFD 77 /* Linux 6.5 */
#endif

#define REQUEST_MAGIC 0x32524655u /* "UFR2" */
#define REPLY_MAGIC 0x32504655u   /* "UFP2" */
#define PROTOCOL_VERSION 2u
#define REQUEST_LEN USMIPC__REQUEST_LEN
#define REPLY_LEN USMIPC__REPLY_LEN
/* The most descriptors one SCM_RIGHTS message carries: SCM_MAX_FD
 * (unix(7)). A WANT_FDS answer carries up to USMIPC__FDS_PER_REQUEST, an
 * answer to a run of chunks the table and USMIPC__CHUNKS_MAX: both fit,
 * and buffers of this size, on either side, hold whichever is larger. */
#define FDS_PER_MESSAGE_MAX 253
_Static_assert(USMIPC__FDS_PER_REQUEST <= FDS_PER_MESSAGE_MAX &&
                   1 + USMIPC__CHUNKS_MAX <= FDS_PER_MESSAGE_MAX,
               "every answer fits one SCM_RIGHTS message");

/* The descriptors of one handle: one, or one per chunk of a run (record
 * 0x8102). */
static int run_length(const usmipc__wire_t *w) {
  return w->chunk_count != 0 ? (int)w->chunk_count : 1;
}
/* How long the broker waits for a connected peer's request. */
#define CONN_DEADLINE_MS 1000
/* How long an answered connection may stay idle for the next request. */
#define KEEP_MS 5000
/* Connections served at once, and at most per peer process. */
#define MAX_CONNS 64
#define MAX_CONNS_PER_PEER 8
/* New connections one broker thread accepts per wake-up. */
#define MAX_ACCEPT_PER_WAKE 4

enum reply_status {
  REPLY_OK = 0,
  REPLY_UNKNOWN_BUFFER = 1, /* never published, or withdrawn (freed) */
  REPLY_BAD_CAPABILITY = 2,
  REPLY_OTHER_USER = 3,
  REPLY_BAD_REQUEST = 4,
  REPLY_BAD_PROOF = 5, /* the request's MAC fails: not a handle of ours */
  REPLY_NO_TABLE = 6,
};

/* Request, little-endian:
 *   0 u32 magic, 4 u32 version, 8 u32 exporter pid, 12 u32 want,
 *   16 u64 exporter nonce, 24 u64 buffer id, 32 [16] client nonce,
 *   48 [16] proof = MAC(process key, "usmipc-request-2" || bytes[0, 48)),
 *   64 [16] capability = MAC(token, "usmipc-capabil-2" || bytes[0, 48)) with
 *           USMIPC__WANT_FD, else zero.
 * want = USMIPC__WANT_RELEASE (alone) and USMIPC__WANT_FDS (alone) are
 * followed by u16 body length and the body. A WANT_FDS request's buffer id
 * and capability fields are zero; its body is u16 count (1 to 253), then
 * count entries of u64 buffer id and
 *   [16] MAC(that allocation's token, "usmipc-fdbatch-2" || bytes[0, 48) ||
 *        u64 buffer id).
 * Reply:
 *   0 u32 magic, 4 u32 status, 8 u32 descriptors sent (a refused WANT_FDS
 *   entry: its index), 12 u32 want (echo), 16 [16] client nonce (echo),
 *   32 [16] MAC(process key, "usmipc-reply---2" || bytes[0, 32) || u64 buffer
 *           id), then the descriptors as SCM_RIGHTS: the table first, or a
 *           WANT_FDS request's in the order of its entries. */

static void mac_with_label(uint8_t out[16], const uint8_t key[16],
                           const char label[16], const uint8_t *data,
                           size_t len, uint64_t extra) {
  uint8_t msg[16 + 48 + 8];
  memcpy(msg, label, 16);
  memcpy(msg + 16, data, len);
  usmipc__put64le(msg + 16 + len, extra);
  usmipc__mac(out, key, msg, 16 + len + 8);
}

void usmipc__release_capability(const uint8_t *req, const uint8_t token[16],
                                const uint8_t *body, size_t len,
                                uint8_t out[16]) {
  uint8_t msg[16 + 48 + USMIPC__RELEASE_BODY_MAX];
  memcpy(msg, "usmipc-release-2", 16);
  memcpy(msg + 16, req, 48);
  memcpy(msg + 64, body, len);
  usmipc__mac(out, token, msg, 64 + len);
}

static void request_proof(const uint8_t *req, const uint8_t key[16],
                          uint8_t out[16]) {
  mac_with_label(out, key, "usmipc-request-2", req, 48, 0);
}
static void request_capability(const uint8_t *req, const uint8_t token[16],
                               uint8_t out[16]) {
  mac_with_label(out, token, "usmipc-capabil-2", req, 48, 0);
}
static void reply_mac(const uint8_t *rep, const uint8_t key[16],
                      uint64_t buffer_id, uint8_t out[16]) {
  mac_with_label(out, key, "usmipc-reply---2", rep, 32, buffer_id);
}

void usmipc__fds_capability(const uint8_t *req, const uint8_t token[16],
                            uint64_t buffer_id, uint8_t out[16]) {
  mac_with_label(out, token, "usmipc-fdbatch-2", req, 48, buffer_id);
}

/* ---- the protocol as pure functions (fuzzed: tests/fuzz/fuzz_broker.c) --- */

void usmipc__request_build(uint8_t req[USMIPC__REQUEST_LEN],
                           const usmipc__wire_t *w, unsigned want,
                           const uint8_t client_nonce[16]) {
  memset(req, 0, USMIPC__REQUEST_LEN);
  usmipc__put32le(req, REQUEST_MAGIC);
  usmipc__put32le(req + 4, PROTOCOL_VERSION);
  usmipc__put32le(req + 8, w->pid);
  usmipc__put32le(req + 12, want);
  usmipc__put64le(req + 16, w->nonce);
  usmipc__put64le(req + 24, w->buffer_id);
  memcpy(req + 32, client_nonce, 16);
  request_proof(req, w->key, req + 48);
  if (want & USMIPC__WANT_FD)
    request_capability(req, w->token, req + 64);
}

uint32_t usmipc__request_check(const uint8_t *req, size_t len, uint32_t pid,
                               uint64_t nonce, const uint8_t key[16],
                               uint32_t *want, uint64_t *buffer_id) {
  if (len != USMIPC__REQUEST_LEN || usmipc__get32le(req) != REQUEST_MAGIC ||
      usmipc__get32le(req + 4) != PROTOCOL_VERSION)
    return REPLY_BAD_REQUEST;
  uint8_t proof[16];
  request_proof(req, key, proof);
  *want = usmipc__get32le(req + 12);
  *buffer_id = usmipc__get64le(req + 24);
  if (usmipc__get32le(req + 8) != pid || usmipc__get64le(req + 16) != nonce ||
      !usmipc__ct_equal(proof, req + 48, 16) ||
      ((*want & ~(USMIPC__WANT_TABLE | USMIPC__WANT_FD)) != 0 &&
       *want != USMIPC__WANT_RELEASE && *want != USMIPC__WANT_FDS) ||
      *want == 0)
    return REPLY_BAD_PROOF;
  return REPLY_OK;
}

int usmipc__request_capability_ok(const uint8_t *req, const uint8_t token[16]) {
  uint8_t cap[16];
  request_capability(req, token, cap);
  return usmipc__ct_equal(cap, req + 64, 16);
}

/* A hostile peer of our uid may send any body: a count that disagrees with
 * the length, buffer ids it guessed, capabilities of other allocations or
 * of another request (each MAC covers this request's client nonce). Every
 * entry must name a published allocation and prove that allocation's
 * token, or nothing is served (fuzz_request.c; fdbatch_refusals). */
uint32_t usmipc__fds_request_judge(const uint8_t *req, const uint8_t *body,
                                   size_t len, usmipc__token_lookup_t lookup,
                                   void *ctx, size_t *count, size_t *failed) {
  *count = 0;
  *failed = SIZE_MAX;
  if (len < 2)
    return REPLY_BAD_REQUEST;
  size_t n = usmipc__get16le(body);
  if (n == 0 || n > USMIPC__FDS_PER_REQUEST ||
      len != 2 + n * USMIPC__FDS_ENTRY_LEN)
    return REPLY_BAD_REQUEST;
  for (size_t i = 0; i < n; i++) {
    const uint8_t *e = body + 2 + i * USMIPC__FDS_ENTRY_LEN;
    uint64_t buffer_id = usmipc__get64le(e);
    const uint8_t *token = lookup(ctx, buffer_id, i);
    uint8_t cap[16];
    if (token == NULL) {
      *failed = i;
      return REPLY_UNKNOWN_BUFFER;
    }
    usmipc__fds_capability(req, token, buffer_id, cap);
    if (!usmipc__ct_equal(cap, e + 8, 16)) {
      *failed = i;
      return REPLY_BAD_CAPABILITY;
    }
  }
  *count = n;
  return REPLY_OK;
}

void usmipc__reply_build(uint8_t rep[USMIPC__REPLY_LEN], const uint8_t *req,
                         uint32_t status, int nfds, const uint8_t key[16]) {
  memset(rep, 0, USMIPC__REPLY_LEN);
  usmipc__put32le(rep, REPLY_MAGIC);
  usmipc__put32le(rep + 4, status);
  usmipc__put32le(rep + 8, (uint32_t)nfds);
  usmipc__put32le(rep + 12, req ? usmipc__get32le(req + 12) : 0);
  if (req)
    memcpy(rep + 16, req + 32, 16);
  reply_mac(rep, key, req ? usmipc__get64le(req + 24) : 0, rep + 32);
}

static socklen_t abstract_address(uint32_t pid, uint64_t nonce,
                                  struct sockaddr_un *addr) {
  memset(addr, 0, sizeof(*addr));
  addr->sun_family = AF_UNIX;
  /* sun_path[0] == '\0' makes the name abstract: no file to clean up, gone
   * when the process exits. Abstract names belong to a network namespace. */
  int n = snprintf(addr->sun_path + 1, sizeof(addr->sun_path) - 1,
                   "usmipc.%u.%016llx", pid, (unsigned long long)nonce);
  return (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + (size_t)n);
}

/* DIR/usmipc.<pid>.<nonce>.sock; 0 when the path does not fit. */
static socklen_t dir_address(const char *dir, uint32_t pid, uint64_t nonce,
                             struct sockaddr_un *addr) {
  memset(addr, 0, sizeof(*addr));
  addr->sun_family = AF_UNIX;
  int n = snprintf(addr->sun_path, sizeof(addr->sun_path),
                   "%s/usmipc.%u.%016llx.sock", dir, pid,
                   (unsigned long long)nonce);
  if (n < 0 || (size_t)n >= sizeof(addr->sun_path))
    return 0;
  return (socklen_t)(offsetof(struct sockaddr_un, sun_path) + (size_t)n + 1);
}

static const char *socket_dir_env(void) {
  const char *dir = getenv("USMIPC_SOCKET_DIR");
  return dir != NULL && *dir != '\0' ? dir : NULL;
}

/* ==== the exporter's side: grants and the broker ========================== */

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

void usmipc__fdxfer_fork_prepare(void) { pthread_mutex_lock(&fdx_lock); }
void usmipc__fdxfer_fork_parent(void) { pthread_mutex_unlock(&fdx_lock); }
/* The broker thread does not exist in a fork child, and the parent's grants
 * are the parent's to serve: the child forgets them (and its copies of the
 * listening sockets; the socket file stays the parent's) and starts its own
 * broker on its next export. */
static void kept_forget_all(void);

void usmipc__fdxfer_fork_child(void) {
  pthread_mutex_unlock(&fdx_lock);
  kept_forget_all(); /* the parent's: a request here would cross its own */
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
  uint8_t buf[REQUEST_LEN + 2 + USMIPC__RELEASE_BODY_MAX];
  /* A WANT_FDS message, which may not fit in buf: allocated once its
   * length is known, freed once it is answered. */
  uint8_t *big;
} conn_t;

#define FDS_MESSAGE_MAX (REQUEST_LEN + 2 + USMIPC__FDS_BODY_MAX)

static const uint8_t *conn_bytes(const conn_t *c) {
  return c->big != NULL ? c->big : c->buf;
}

/* How many bytes the message in c has in all, as far as its first bytes
 * tell; 0 for a body of an impossible length. */
static size_t message_len(const conn_t *c) {
  const uint8_t *m = conn_bytes(c);
  if (c->got < REQUEST_LEN)
    return REQUEST_LEN;
  uint32_t want = usmipc__get32le(m + 12);
  if (want != USMIPC__WANT_RELEASE && want != USMIPC__WANT_FDS)
    return REQUEST_LEN;
  if (c->got < REQUEST_LEN + 2)
    return REQUEST_LEN + 2;
  size_t body = usmipc__get16le(m + REQUEST_LEN);
  if (want == USMIPC__WANT_FDS)
    return body < 2 + USMIPC__FDS_ENTRY_LEN || body > USMIPC__FDS_BODY_MAX
               ? 0
               : REQUEST_LEN + 2 + body;
  return body < 10 || body > USMIPC__RELEASE_BODY_MAX ? 0
                                                      : REQUEST_LEN + 2 + body;
}

/* Where the next bytes of a message of need bytes go: c->buf, or for a
 * larger one c->big (NULL when out of memory). */
static uint8_t *conn_room(conn_t *c, size_t need) {
  if (need <= sizeof(c->buf) || c->big != NULL)
    return c->big != NULL ? c->big : c->buf;
  c->big = malloc(FDS_MESSAGE_MAX);
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
    char buf[CMSG_SPACE(sizeof(int) * FDS_PER_MESSAGE_MAX)];
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
  if (status == REPLY_OK) {
    /* Counted before the send: once the importer has them, a reader of the
     * counters (a test) must see them counted. */
    USMIPC__STAT_ADD(descriptors_sent, count);
    send_reply_word(conn, req, REPLY_OK, (uint32_t)count, fds, (int)count);
  } else {
    send_reply_word(conn, req, status,
                    failed == SIZE_MAX ? 0 : (uint32_t)failed, NULL, 0);
  }
  pthread_mutex_unlock(&fdx_lock);
}

/* One complete request: check, answer, done. A release carries its body
 * after the request (body_len bytes). */
static void serve_request(int conn, const uint8_t *req, const uint8_t *body,
                          size_t body_len) {
  const usmipc__process_t *self = usmipc__self();
  uint32_t want = 0;
  uint64_t buffer_id = 0;
  uint32_t status = usmipc__request_check(
      req, REQUEST_LEN, self->pid, self->nonce, self->key, &want, &buffer_id);
  if (status != REPLY_OK) {
    send_reply(conn, status == REPLY_BAD_REQUEST ? NULL : req, status, NULL, 0);
    return;
  }
  if (want == USMIPC__WANT_RELEASE) {
    send_reply(conn, req, usmipc__release_arrived(req, body, body_len), NULL,
               0);
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
      send_reply(conn, req, REPLY_NO_TABLE, NULL, 0);
      return;
    }
    fds[nfds++] = table; /* never closed while the process lives */
  }
  if (!(want & USMIPC__WANT_FD)) {
    send_reply(conn, req, REPLY_OK, fds, nfds);
    return;
  }
  /* The descriptor is sent while the lock is held so that a concurrent
   * withdraw cannot close it under us; the send does not wait. */
  pthread_mutex_lock(&fdx_lock);
  grant_entry_t *g = grant_find(buffer_id);
  if (g == NULL)
    send_reply(conn, req, REPLY_UNKNOWN_BUFFER, NULL, 0);
  else if (!usmipc__request_capability_ok(req, g->token))
    send_reply(conn, req, REPLY_BAD_CAPABILITY, NULL, 0);
  else {
    /* All of the grant's descriptors: one, or a run's chunks in order. */
    memcpy(fds + nfds, g->fds, g->nfds * sizeof(int));
    nfds += (int)g->nfds;
    USMIPC__STAT_ADD(descriptors_sent, g->nfds); /* before: see above */
    send_reply(conn, req, REPLY_OK, fds, nfds);
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
    send_reply(fd, NULL, REPLY_OTHER_USER, NULL, 0);
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
        } else if (k->got == need && need != REQUEST_LEN + 2) {
          /* Answered, the connection stays for the importer's next open
           * (it keeps it while it has more to ask), until KEEP_MS idle. */
          const uint8_t *m = conn_bytes(k);
          serve_request(k->fd, m, m + REQUEST_LEN + 2,
                        need > REQUEST_LEN ? need - REQUEST_LEN - 2 : 0);
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
  const char *env = getenv("USMIPC_BROKER_THREADS");
  if (env != NULL && *env != '\0') {
    char *end;
    long v = strtol(env, &end, 10);
    if (*end == '\0')
      return v < 1 ? 1 : v > 16 ? 16 : (int)v;
    usmipc__env_malformed("USMIPC_BROKER_THREADS", env, "1 to 16",
                          "the default");
  }
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
      dir_address(dir, usmipc__self()->pid, usmipc__self()->nonce, &addr)) {
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
  socklen_t len = abstract_address(self->pid, self->nonce, &addr);
  int fds[2] = {-1, -1};
  int e = listen_on(&addr, len, &fds[0]);
  if (e != 0)
    return usmipc__fail_native(usmipc__errno_code(-e), -e,
                               "cannot start the fd broker on @%s: %s",
                               addr.sun_path + 1, strerror(-e));
  const char *dir = socket_dir_env();
  if (dir != NULL) {
    /* Importers name the file by its path in dir: that must fit too. */
    if (dir_address(dir, self->pid, self->nonce, &addr) == 0) {
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

int usmipc__fdxfer_serve(void) {
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

bool usmipc__fdxfer_socket_dir(void) {
  pthread_mutex_lock(&fdx_lock);
  bool on = listen_fds[1] >= 0;
  pthread_mutex_unlock(&fdx_lock);
  return on;
}

int usmipc__fdxfer_publish(int fd, uint64_t buffer_id, bool may_reopen,
                           usmipc__fd_grant_t *grant) {
  return usmipc__fdxfer_publish_fds(&fd, 1, buffer_id, may_reopen, grant);
}

int usmipc__fdxfer_publish_fds(const int *fds, uint32_t nfds,
                               uint64_t buffer_id, bool may_reopen,
                               usmipc__fd_grant_t *grant) {
  if (nfds == 0 || nfds > USMIPC__CHUNKS_MAX)
    return usmipc__fail(USMIPC_EINVAL, "cannot publish %u descriptors at once",
                        nfds);
  uint8_t token[16];
  int rc = usmipc__random(token, sizeof(token));
  if (rc != 0 || (rc = usmipc__fdxfer_serve()) != 0)
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

void usmipc__fdxfer_withdraw(uint64_t buffer_id) {
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

/* ==== the importer's side ================================================= */

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
  const char *dir = socket_dir_env();
  struct sockaddr_un addr;
  socklen_t len;
  if (same_net) {
    len = abstract_address(w->pid, w->nonce, &addr);
    snprintf(name, name_len, "@%s", addr.sun_path + 1);
  } else if ((w->flags & USMIPC__WIRE_FLAG_SOCKET_DIR) && dir != NULL &&
             (len = dir_address(dir, w->pid, w->nonce, &addr)) != 0) {
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

static int reply_error(const usmipc__wire_t *w, uint32_t status) {
  switch (status) {
  case REPLY_UNKNOWN_BUFFER:
    return usmipc__fail(USMIPC_EEXPORTERGONE,
                        "process %u no longer exports the memory this handle "
                        "names (the allocation was freed)",
                        w->pid);
  case REPLY_BAD_CAPABILITY:
    return usmipc__fail(USMIPC_EACCES,
                        "process %u refused the handle: its capability token "
                        "is wrong (forged or corrupted handle)",
                        w->pid);
  case REPLY_OTHER_USER:
    return usmipc__fail(USMIPC_EACCES,
                        "process %u refused to share memory with this "
                        "process: IPC is allowed only between processes of "
                        "the same user (uid %u here)",
                        w->pid, (unsigned)usmipc__self()->uid);
  case REPLY_BAD_PROOF:
    return usmipc__fail(USMIPC_EUNTRUSTED,
                        "process %u does not recognise the handle's key: the "
                        "handle is forged or names another process",
                        w->pid);
  case REPLY_NO_TABLE:
    return usmipc__fail(USMIPC_EEXPORTERGONE,
                        "process %u exports nothing (it forked, and the "
                        "handle is its parent's?)",
                        w->pid);
  default:
    return usmipc__fail(USMIPC_ETRANSPORT,
                        "the broker of process %u answered status %u", w->pid,
                        status);
  }
}

/* 0 when rep (n bytes) is an answer of the exporter to req: framed, and
 * with its MAC over our client nonce. */
static int reply_authentic(const uint8_t *rep, size_t n, const uint8_t *req,
                           const usmipc__wire_t *w, const char *name) {
  uint8_t mac[16];
  if (n == 0)
    return usmipc__fail(USMIPC_EEXPORTERGONE,
                        "the broker of process %u closed the connection "
                        "without answering (it is exiting?)",
                        w->pid);
  if (n != REPLY_LEN || usmipc__get32le(rep) != REPLY_MAGIC)
    return usmipc__fail(USMIPC_EUNTRUSTED,
                        "malformed answer from %s: not a usmipc broker", name);
  if (usmipc__get32le(rep + 4) == REPLY_OTHER_USER)
    return reply_error(w, REPLY_OTHER_USER); /* said before any request */
  reply_mac(rep, w->key, usmipc__get64le(req + 24), mac);
  if (memcmp(rep + 16, req + 32, 16) != 0 ||
      !usmipc__ct_equal(mac, rep + 32, 16))
    return usmipc__fail(USMIPC_EUNTRUSTED,
                        "the answer from %s does not prove the exporter's key: "
                        "it is not the exporter (or the handle is forged); "
                        "nothing it sent is used",
                        name);
  return 0;
}

/* MSG_CTRUNC with fewer descriptors than the answer carries: the receive
 * buffer holds SCM_MAX_FD, so the kernel could not install them all here
 * (recvmsg(2): out of file descriptors), and dropped the others. */
static int fail_truncated(const usmipc__wire_t *w, int nfds, size_t expect) {
  return usmipc__fail(USMIPC_EMFILE,
                      "this process received %d of the %zu descriptors "
                      "process %u sent (the kernel dropped the others: out "
                      "of file descriptors?); close some or raise the "
                      "limit (ulimit -n)",
                      nfds, expect, w->pid);
}

int usmipc__reply_check(const uint8_t *rep, size_t n, const uint8_t *req,
                        const usmipc__wire_t *w, unsigned want, int nfds,
                        bool truncated, const char *name) {
  /* A handle of a run of chunks gets one descriptor per chunk. */
  int expect = ((want & USMIPC__WANT_TABLE) ? 1 : 0) +
               ((want & USMIPC__WANT_FD) ? run_length(w) : 0);
  int rc = reply_authentic(rep, n, req, w, name);
  if (rc != 0)
    return rc;
  uint32_t status = usmipc__get32le(rep + 4);
  if (status != REPLY_OK && want == USMIPC__WANT_RELEASE) {
    if (status == REPLY_UNKNOWN_BUFFER)
      return usmipc__fail(USMIPC_EEXPORTERGONE,
                          "process %u no longer waits for this release (the "
                          "producer freed its handle or bundle)",
                          w->pid);
    if (status == REPLY_BAD_CAPABILITY)
      return usmipc__fail(USMIPC_EACCES,
                          "process %u refused the release ticket: its token "
                          "is wrong for its ticket number (forged, edited or "
                          "corrupted bytes: each handoff's bytes return only "
                          "their own ticket)",
                          w->pid);
    if (status == REPLY_BAD_REQUEST)
      return usmipc__fail(USMIPC_EBADHANDLE,
                          "process %u refused the release: its ticket was "
                          "never handed out (forged), or the consumer's "
                          "event handle is malformed",
                          w->pid);
  }
  if (status != REPLY_OK)
    return reply_error(w, status);
  if (truncated && nfds >= 0 && nfds < expect)
    return fail_truncated(w, nfds, (size_t)expect);
  if (nfds != expect || usmipc__get32le(rep + 8) != (uint32_t)expect ||
      truncated || usmipc__get32le(rep + 12) != want)
    return usmipc__fail(USMIPC_ETRANSPORT,
                        "the broker of process %u sent %d descriptors, not %d",
                        w->pid, nfds, expect);
  return 0;
}

/* What a listener that passed check_listener may still send wrongly (a bug,
 * or a process of our uid that holds the key): a refusal naming an entry
 * the request does not have, more or fewer descriptors than entries, an OK
 * to another request. Nothing from such an answer is used, and the caller
 * closes every descriptor that came with it (fuzz_reply.c). */
int usmipc__reply_check_fds(const uint8_t *rep, size_t n, const uint8_t *req,
                            const usmipc__wire_t *w, size_t count, int nfds,
                            bool truncated, const char *name, size_t *failed) {
  *failed = SIZE_MAX;
  int rc = reply_authentic(rep, n, req, w, name);
  if (rc != 0)
    return rc;
  uint32_t status = usmipc__get32le(rep + 4);
  uint32_t word8 = usmipc__get32le(rep + 8);
  if (status == REPLY_UNKNOWN_BUFFER || status == REPLY_BAD_CAPABILITY) {
    if (word8 >= count)
      return usmipc__fail(USMIPC_ETRANSPORT,
                          "the broker of process %u refused entry %u of a "
                          "request of %zu (status %u)",
                          w->pid, word8, count, status);
    *failed = word8;
  }
  if (status != REPLY_OK)
    return reply_error(w, status);
  if (truncated && nfds >= 0 && (size_t)nfds < count)
    return fail_truncated(w, nfds, count);
  if (nfds < 0 || (size_t)nfds != count || word8 != count || truncated ||
      usmipc__get32le(rep + 12) != USMIPC__WANT_FDS)
    return usmipc__fail(USMIPC_ETRANSPORT,
                        "the broker of process %u sent %d descriptors%s, not "
                        "%zu",
                        w->pid, nfds, truncated ? " (truncated)" : "", count);
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

static kept_conn_t kept[KEPT_MAX]; /* oldest first; guarded by fdx_lock */
static int kept_count;

static void kept_forget_all(void) {
  for (int i = 0; i < kept_count; i++)
    close(kept[i].fd);
  kept_count = 0;
}

static int kept_take(const usmipc__wire_t *w) {
  int fd = -1;
  pthread_mutex_lock(&fdx_lock);
  for (int i = kept_count - 1; i >= 0; i--) {
    if (kept[i].pid == w->pid && kept[i].nonce == w->nonce) {
      fd = kept[i].fd;
      memmove(&kept[i], &kept[i + 1],
              sizeof(kept[0]) * (size_t)(kept_count - i - 1));
      kept_count--;
      break;
    }
  }
  pthread_mutex_unlock(&fdx_lock);
  return fd;
}

static void kept_put(const usmipc__wire_t *w, int fd) {
  int dropped = -1, same = 0;
  pthread_mutex_lock(&fdx_lock);
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
  pthread_mutex_unlock(&fdx_lock);
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
  int *table_fd;  /* WANT_TABLE */
  int *data_fd;   /* WANT_FD: one, or a run's chunk_count, in chunk order */
  int *fds;       /* WANT_FDS: batch_n descriptors */
  size_t *failed; /* WANT_FDS: the entry the broker refused */
} call_args_t;

/* One request and its answer on connection s. *dropped is set when the
 * broker had closed the connection before answering (a kept connection that
 * went idle too long): nothing was served, and a new connection may retry. */
static int exchange(int s, const usmipc__wire_t *w, const call_args_t *a,
                    uint64_t deadline, const char *name, bool *dropped);

static int call(const usmipc__wire_t *w, const call_args_t *a,
                uint64_t deadline);

int usmipc__broker_call(const usmipc__wire_t *w, unsigned want,
                        uint64_t deadline, int *table_fd, int *data_fd) {
  if (table_fd)
    *table_fd = -1;
  for (int i = 0; data_fd && i < run_length(w); i++)
    data_fd[i] = -1;
  call_args_t a = {.want = want, .table_fd = table_fd, .data_fd = data_fd};
  return call(w, &a, deadline);
}

int usmipc__broker_release(const usmipc__wire_t *w, const uint8_t *body,
                           size_t len, uint64_t deadline) {
  call_args_t a = {.want = USMIPC__WANT_RELEASE, .body = body, .body_len = len};
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
    usmipc__put16le(out + REQUEST_LEN, (uint16_t)a->body_len);
    memcpy(out + REQUEST_LEN + 2, a->body, a->body_len);
    return REQUEST_LEN + 2 + a->body_len;
  }
  if (a->want == USMIPC__WANT_FDS) {
    /* The header names no allocation; each entry names one and proves its
     * token over the header (so over this request's client nonce). */
    usmipc__wire_t named = *w;
    named.buffer_id = 0;
    usmipc__request_build(req, &named, a->want, client_nonce);
    size_t body_len = 2 + a->batch_n * USMIPC__FDS_ENTRY_LEN;
    usmipc__put16le(out + REQUEST_LEN, (uint16_t)body_len);
    uint8_t *body = out + REQUEST_LEN + 2;
    usmipc__put16le(body, (uint16_t)a->batch_n);
    for (size_t i = 0; i < a->batch_n; i++) {
      uint8_t *e = body + 2 + i * USMIPC__FDS_ENTRY_LEN;
      const usmipc__wire_t *x = a->batch[i];
      usmipc__put64le(e, x->buffer_id);
      usmipc__fds_capability(req, x->token, x->buffer_id, e + 8);
    }
    return REQUEST_LEN + 2 + body_len;
  }
  usmipc__request_build(req, w, a->want, client_nonce);
  return REQUEST_LEN;
}

static int exchange(int s, const usmipc__wire_t *w, const call_args_t *a,
                    uint64_t deadline, const char *name, bool *dropped) {
  uint8_t msg_out[FDS_MESSAGE_MAX > REQUEST_LEN + 2 + USMIPC__RELEASE_BODY_MAX
                      ? FDS_MESSAGE_MAX
                      : REQUEST_LEN + 2 + USMIPC__RELEASE_BODY_MAX];
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
  uint8_t rep[REPLY_LEN];
  struct iovec iov = {.iov_base = rep, .iov_len = sizeof(rep)};
  /* Room for a full SCM_RIGHTS message (SCM_MAX_FD): a broker that sends
   * more than was asked (for a single descriptor, a run's chunks or a
   * batch) still has each descriptor it sent closed here, rather than left
   * to MSG_CTRUNC's silent drop; MSG_CTRUNC then only means that this
   * process could not take them all (out of descriptors). */
  union {
    struct cmsghdr align;
    char buf[CMSG_SPACE(sizeof(int) * FDS_PER_MESSAGE_MAX)];
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
  int fds[FDS_PER_MESSAGE_MAX];
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
  for (int i = 0; rc == 0 && (a->want & USMIPC__WANT_FD) && i < run_length(w);
       i++)
    a->data_fd[i] = fds[k++];
  for (int i = k; i < kept_fds; i++)
    close(fds[i]);
  return rc;
}
