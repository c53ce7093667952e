/* Many descriptors from one exporter in one transport exchange
 * (usmipc__peer_fetch_fds, usmipc__broker_fetch_fds, usmipc__prefetch_fds
 * and usmipc__open_mapping with a prefetched descriptor).
 *
 * The test process exports host allocations (memfds); a fork child takes
 * their descriptors and checks each one is the allocation's own file (its
 * inode, and the bytes read through it), what it cost (transport exchanges,
 * descriptors) and that no descriptor is left open after a refusal. These
 * call internal functions, so the suite links the static library. */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "objects.h" /* usmipc__wire_t and the internal calls under test */
#include "task.h"

#define ALLOC_BYTES 4096
#define MAX_EXPORTS 600

typedef struct exports {
  size_t n;
  void *ptr[MAX_EXPORTS];
  usmipc_ipc_handle_t *handle[MAX_EXPORTS];
  uint8_t *bytes[MAX_EXPORTS];
  size_t len[MAX_EXPORTS];
} exports_t;

/* n host allocations, allocation i filled with pattern seed i + 1, and
 * exported. */
static exports_t *exports_make(size_t n) {
  exports_t *e = calloc(1, sizeof(*e));
  ASSERT_NOT_NULL(e);
  ASSERT(n <= MAX_EXPORTS);
  e->n = n;
  for (size_t i = 0; i < n; i++) {
    ASSERT_OK(usmipc_malloc(host_device(), USMIPC_MEM_DEVICE, ALLOC_BYTES,
                            &e->ptr[i]));
    pattern_fill(e->ptr[i], ALLOC_BYTES, i + 1, 0);
    e->handle[i] = export_copy(e->ptr[i], 0, &e->bytes[i], &e->len[i]);
  }
  return e;
}

static void exports_free(exports_t *e) {
  for (size_t i = 0; i < e->n; i++) {
    ASSERT_OK(usmipc_ipc_free_handle(e->handle[i]));
    free(e->bytes[i]);
    if (e->ptr[i] != NULL)
      ASSERT_OK(usmipc_free(e->ptr[i]));
  }
  free(e);
}

/* The decoded handles, and pointers to them as the calls take them. */
static usmipc__wire_t *decode_all(const exports_t *e,
                                  const usmipc__wire_t **wp) {
  usmipc__wire_t *w = calloc(e->n, sizeof(*w));
  ASSERT_NOT_NULL(w);
  for (size_t i = 0; i < e->n; i++) {
    ASSERT_OK(usmipc__wire_decode(e->bytes[i], e->len[i], &w[i]));
    ASSERT(w[i].flags & USMIPC__WIRE_FLAG_FD);
    wp[i] = &w[i];
  }
  return w;
}

/* Room for the exporter's descriptors and the child's copies of them. */
static int raise_nofile(rlim_t want) {
  struct rlimit rl;
  if (getrlimit(RLIMIT_NOFILE, &rl) != 0)
    return -1;
  if (rl.rlim_cur >= want)
    return 0;
  if (rl.rlim_max != RLIM_INFINITY && rl.rlim_max < want)
    return -1;
  rl.rlim_cur = want;
  return setrlimit(RLIMIT_NOFILE, &rl);
}

/* The peer of the exporter of w, proven; a descriptor the proof brought
 * along (the broker serves the table and the first handle's descriptor in
 * one answer) is closed. */
static usmipc__peer_t *peer_of(const usmipc__wire_t *w) {
  usmipc__peer_t *peer;
  int fd = -1;
  ASSERT_OK(usmipc__peer_get(w, usmipc__deadline_after_timeout(), &peer, &fd));
  if (fd >= 0)
    close(fd);
  return peer;
}

/* Each descriptor is its handle's file, and reads its allocation's bytes. */
static void check_fds(const usmipc__wire_t *const *w, const int *fds, size_t n,
                      const size_t *seed_of) {
  for (size_t i = 0; i < n; i++) {
    struct stat st;
    ASSERT_MSG(fds[i] >= 0, "descriptor %zu missing", i);
    ASSERT_EQ(fstat(fds[i], &st), 0);
    ASSERT_UEQ((uint64_t)st.st_ino, w[i]->fd_ino);
    ASSERT_UEQ((uint64_t)st.st_dev, w[i]->fd_dev);
    void *m = mmap(NULL, ALLOC_BYTES, PROT_READ, MAP_SHARED, fds[i], 0);
    ASSERT(m != MAP_FAILED);
    size_t bad = pattern_check(m, ALLOC_BYTES, seed_of ? seed_of[i] : i + 1, 0);
    ASSERT_MSG(bad == SIZE_MAX, "descriptor %zu: byte %zu differs", i, bad);
    munmap(m, ALLOC_BYTES);
  }
}

/* Open descriptors of memfds (allocations). A refused request also closes
 * the connection it went over, so the leak checks count these, not all
 * descriptors. */
static size_t count_memfds(void) {
  DIR *d = opendir("/proc/self/fd");
  ASSERT_NOT_NULL(d);
  size_t n = 0;
  struct dirent *ent;
  while ((ent = readdir(d)) != NULL) {
    char path[300], target[64];
    snprintf(path, sizeof(path), "/proc/self/fd/%s", ent->d_name);
    ssize_t len = readlink(path, target, sizeof(target) - 1);
    if (len > 0) {
      target[len] = '\0';
      n += strncmp(target, "/memfd:", 7) == 0;
    }
  }
  closedir(d);
  return n;
}

static void close_all(int *fds, size_t n) {
  for (size_t i = 0; i < n; i++) {
    if (fds[i] >= 0)
      close(fds[i]);
    fds[i] = -1;
  }
}

static void assert_none(const int *fds, size_t n) {
  for (size_t i = 0; i < n; i++)
    ASSERT_MSG(fds[i] == -1, "descriptor %zu left as %d after a failure", i,
               fds[i]);
}

static void assert_message_has(const char *needle) {
  ASSERT_MSG(strstr(usmipc_last_error(), needle) != NULL,
             "message \"%s\" does not say \"%s\"", usmipc_last_error(), needle);
}

static int run_child(pid_t pid) {
  int status = wait_pid_timeout(pid, 30);
  ASSERT_MSG(status != -1, "the importer timed out");
  if (WIFEXITED(status) && WEXITSTATUS(status) == TEST_SKIP)
    return TEST_SKIP;
  ASSERT_EQ(exit_code_of(status), 0);
  return 0;
}

/* 600 descriptors through the broker: three exchanges of at most 253, each
 * descriptor the allocation's own file; closing them leaves as many
 * descriptors open as before. The broker counts each one it sent. */
TEST_IMPL(fdbatch_socket_600) {
  enum { N = 600 };
  if (raise_nofile(3 * N + 256) != 0)
    RETURN_SKIP("RLIMIT_NOFILE cannot hold %d descriptors", 3 * N + 256);
  exports_t *e = exports_make(N);
  usmipc_stats_t s0, s1;
  ASSERT_OK(usmipc_get_stats(&s0, sizeof(s0)));
  pid_t pid = fork();
  ASSERT_NE(pid, -1);
  if (pid == 0) {
    setenv("USMIPC_FD_TRANSPORT", "socket", 1);
    static const usmipc__wire_t *wp[N];
    static int fds[N];
    usmipc__wire_t *w = decode_all(e, wp);
    usmipc__peer_t *peer = peer_of(wp[0]);
    size_t fds0 = count_fds();
    usmipc_stats_t a, b;
    ASSERT_OK(usmipc_get_stats(&a, sizeof(a)));
    double t0 = now_seconds();
    ASSERT_OK(usmipc__peer_fetch_fds(peer, wp, N,
                                     usmipc__deadline_after_timeout(), fds));
    double t1 = now_seconds();
    ASSERT_OK(usmipc_get_stats(&b, sizeof(b)));
    ASSERT_UEQ(b.transport_exchanges - a.transport_exchanges, 3);
    ASSERT_UEQ(b.descriptors_received - a.descriptors_received, N);
    ASSERT_EQ(count_fds(), fds0 + N);
    check_fds(wp, fds, N, NULL);
    close_all(fds, N);
    ASSERT_EQ(count_fds(), fds0);
    printf("# %d descriptors in 3 exchanges: %.2f ms\n", N, (t1 - t0) * 1e3);
    usmipc__peer_put(peer);
    free(w);
    _exit(0);
  }
  int rc = run_child(pid);
  ASSERT_OK(usmipc_get_stats(&s1, sizeof(s1)));
  /* The proof's descriptor, then the batch. */
  ASSERT_UEQ(s1.descriptors_sent - s0.descriptors_sent, N + 1);
  exports_free(e);
  return rc;
}

/* Refusals leave nothing open: a forged capability (the broker refuses
 * that entry, names it, sends nothing), a forged token or a freed
 * allocation in the second chunk (the table refuses it after the first
 * chunk's 253 descriptors arrived: those are closed), handles of two
 * exporters or without a descriptor (EINVAL). The broker sends nothing for
 * a refused request. */
TEST_IMPL(fdbatch_refusals) {
  enum { N = 300, FORGED = 270, FREED = 280 };
  if (raise_nofile(3 * N + 256) != 0)
    RETURN_SKIP("RLIMIT_NOFILE cannot hold %d descriptors", 3 * N + 256);
  exports_t *e = exports_make(N);
  ASSERT_OK(usmipc_free(e->ptr[FREED]));
  e->ptr[FREED] = NULL;
  usmipc_stats_t s0, s1;
  ASSERT_OK(usmipc_get_stats(&s0, sizeof(s0)));
  pid_t pid = fork();
  ASSERT_NE(pid, -1);
  if (pid == 0) {
    setenv("USMIPC_FD_TRANSPORT", "socket", 1);
    static const usmipc__wire_t *wp[N + 1];
    static int fds[N + 1];
    usmipc__wire_t *w = decode_all(e, wp);
    usmipc__peer_t *peer = peer_of(wp[0]);
    uint64_t deadline = usmipc__deadline_after_timeout();
    size_t fds0 = count_memfds(), failed = 0;
    usmipc_stats_t a, b;

    /* The broker itself: entry 5's capability is of another token. */
    usmipc__wire_t forged = w[5];
    forged.token[0] ^= 1;
    const usmipc__wire_t *batch[11];
    for (int i = 0; i < 10; i++)
      batch[i] = &w[i];
    batch[5] = &forged;
    ASSERT_ERR(usmipc__broker_fetch_fds(batch, 10, deadline, fds, &failed),
               USMIPC_EACCES);
    ASSERT_UEQ(failed, 5);
    assert_message_has("capability token is wrong");
    assert_none(fds, 10);
    ASSERT_EQ(count_memfds(), fds0);
    /* ... and a freed allocation after ten good ones. */
    batch[5] = &w[5];
    batch[10] = &w[FREED];
    ASSERT_ERR(usmipc__broker_fetch_fds(batch, 11, deadline, fds, &failed),
               USMIPC_EEXPORTERGONE);
    ASSERT_UEQ(failed, 10);
    assert_none(fds, 11);
    ASSERT_EQ(count_memfds(), fds0);

    /* Through the peer: a forged token in the second chunk. The first
     * chunk's exchange is made (253 descriptors arrive), then the table
     * refuses the forged handle, and all 253 are closed. */
    usmipc__wire_t *wf = malloc(N * sizeof(*wf));
    const usmipc__wire_t *wfp[N];
    ASSERT_NOT_NULL(wf);
    memcpy(wf, w, N * sizeof(*wf));
    wf[FORGED].token[3] ^= 0x40;
    for (int i = 0; i < N; i++)
      wfp[i] = i == FREED ? &w[0] : &wf[i];
    ASSERT_OK(usmipc_get_stats(&a, sizeof(a)));
    ASSERT_ERR(usmipc__peer_fetch_fds(peer, wfp, N, deadline, fds),
               USMIPC_EEXPORTERGONE);
    ASSERT_OK(usmipc_get_stats(&b, sizeof(b)));
    ASSERT_UEQ(b.transport_exchanges - a.transport_exchanges, 1);
    assert_message_has("handle 270 of 300");
    assert_none(fds, N);
    ASSERT_EQ(count_memfds(), fds0);

    /* A freed allocation in the second chunk. */
    ASSERT_ERR(usmipc__peer_fetch_fds(peer, wp, N, deadline, fds),
               USMIPC_EEXPORTERGONE);
    assert_message_has("handle 280 of 300");
    assert_message_has("freed");
    assert_none(fds, N);
    ASSERT_EQ(count_memfds(), fds0);

    /* Handles of two exporters (this child exports one of its own), or
     * without a descriptor: refused before anything is asked. */
    void *own;
    uint8_t *own_bytes;
    size_t own_len;
    usmipc__wire_t own_w;
    ASSERT_OK(
        usmipc_malloc(host_device(), USMIPC_MEM_DEVICE, ALLOC_BYTES, &own));
    usmipc_ipc_handle_t *own_h = export_copy(own, 0, &own_bytes, &own_len);
    ASSERT_OK(usmipc__wire_decode(own_bytes, own_len, &own_w));
    fds0 = count_memfds();
    const usmipc__wire_t *mixed[2] = {&w[0], &own_w};
    ASSERT_ERR(usmipc__peer_fetch_fds(peer, mixed, 2, deadline, fds),
               USMIPC_EINVAL);
    ASSERT_ERR(usmipc__broker_fetch_fds(mixed, 2, deadline, fds, &failed),
               USMIPC_EINVAL);
    usmipc__wire_t no_fd = w[1];
    no_fd.flags &= (uint16_t)~USMIPC__WIRE_FLAG_FD;
    const usmipc__wire_t *plain[2] = {&w[0], &no_fd};
    ASSERT_ERR(usmipc__peer_fetch_fds(peer, plain, 2, deadline, fds),
               USMIPC_EINVAL);
    assert_none(fds, 2);
    ASSERT_EQ(count_memfds(), fds0);

    /* The connection and the peer still serve a good batch. */
    ASSERT_OK(usmipc__peer_fetch_fds(peer, wp, 10, deadline, fds));
    check_fds(wp, fds, 10, NULL);
    close_all(fds, 10);
    ASSERT_EQ(count_memfds(), fds0);
    ASSERT_OK(usmipc_ipc_free_handle(own_h));
    ASSERT_OK(usmipc_free(own));
    free(own_bytes);
    free(wf);
    usmipc__peer_put(peer);
    free(w);
    _exit(0);
  }
  int rc = run_child(pid);
  ASSERT_OK(usmipc_get_stats(&s1, sizeof(s1)));
  /* The proof's descriptor, the first chunk twice, the good batch: none of
   * a refused request. */
  ASSERT_UEQ(s1.descriptors_sent - s0.descriptors_sent, 1 + 253 + 253 + 10);
  exports_free(e);
  return rc;
}

/* Runs of chunks (record 0x8102: one grant of k descriptors) are never
 * batched. The batch calls refuse a handle of a run (EINVAL), and the
 * broker refuses an entry that names a run's grant, for an importer that
 * does not say the handle is a run (status 1, the entry named, nothing
 * sent): no request takes part of a run. A prefetch leaves a run out. The
 * run still comes whole from its own request, and only as exactly k
 * descriptors. Three memfds
 * published under one grant play the run, as the CUDA backend publishes a
 * run's chunks (the chunk path itself runs on a GPU: cuda_vmm_*). */
TEST_IMPL(fdbatch_runs_apart) {
  enum { K = 3 };
  exports_t *e = exports_make(2);
  int run[K];
  uint64_t run_ino[K];
  for (int i = 0; i < K; i++) {
    struct stat st;
    run[i] = memfd_create("usmipc-test-run", MFD_CLOEXEC);
    ASSERT(run[i] >= 0);
    ASSERT_EQ(fstat(run[i], &st), 0);
    run_ino[i] = (uint64_t)st.st_ino;
  }
  const uint64_t run_id = usmipc__new_buffer_id();
  usmipc__fd_grant_t grant;
  ASSERT_OK(usmipc__broker_publish_fds(run, K, run_id, false, &grant));
  ASSERT(!grant.reopenable);
  usmipc_stats_t s0, s1;
  ASSERT_OK(usmipc_get_stats(&s0, sizeof(s0)));
  pid_t pid = fork();
  ASSERT_NE(pid, -1);
  if (pid == 0) {
    setenv("USMIPC_FD_TRANSPORT", "socket", 1);
    const usmipc__wire_t *wp[2];
    usmipc__wire_t *w = decode_all(e, wp);
    usmipc__peer_t *peer = peer_of(wp[0]);
    uint64_t deadline = usmipc__deadline_after_timeout();
    int fds[K];
    size_t failed = 0;
    void *ptr = NULL;
    /* The run's handle, as its exporter writes one: the first chunk's
     * identity, the grant's token, no reopening. */
    usmipc__wire_t rw = w[0];
    rw.buffer_id = run_id;
    memcpy(rw.token, grant.token, 16);
    rw.fd_number = grant.fd_number;
    rw.fd_dev = grant.dev;
    rw.fd_ino = grant.ino;
    rw.flags = (uint16_t)(rw.flags & ~USMIPC__WIRE_FLAG_REOPENABLE);
    rw.chunk_count = K;
    for (int i = 0; i < K; i++) /* the child's copies of the parent's */
      close(run[i]);
    size_t fds0 = count_memfds();

    /* Whole, from its own request: exactly K, in chunk order. */
    ASSERT_OK(usmipc__broker_call(&rw, USMIPC__WANT_FD, deadline, NULL, fds));
    for (int i = 0; i < K; i++) {
      struct stat st;
      ASSERT_EQ(fstat(fds[i], &st), 0);
      ASSERT_UEQ((uint64_t)st.st_ino, run_ino[i]);
    }
    close_all(fds, K);
    /* A handle that counts fewer chunks than the grant holds gets none. */
    rw.chunk_count = K - 1;
    ASSERT_ERR(usmipc__broker_call(&rw, USMIPC__WANT_FD, deadline, NULL, fds),
               USMIPC_ETRANSPORT);
    assert_none(fds, K - 1);
    ASSERT_EQ(count_memfds(), fds0);

    /* Never in a batch: refused before anything is asked... */
    rw.chunk_count = K;
    const usmipc__wire_t *batch[3] = {&w[0], &rw, &w[1]};
    ASSERT_ERR(usmipc__peer_fetch_fds(peer, batch, 3, deadline, fds),
               USMIPC_EINVAL);
    assert_message_has("handle 1 of 3 names memory in 3 chunks");
    assert_none(fds, 3);
    ASSERT_ERR(usmipc__broker_fetch_fds(batch, 3, deadline, fds, &failed),
               USMIPC_EINVAL);
    assert_none(fds, 3);
    /* ... and by the broker, when the importer does not say it is a run. */
    rw.chunk_count = 0;
    ASSERT_ERR(usmipc__broker_fetch_fds(batch, 3, deadline, fds, &failed),
               USMIPC_EEXPORTERGONE);
    ASSERT_UEQ(failed, 1);
    assert_none(fds, 3);
    ASSERT_EQ(count_memfds(), fds0);

    /* The two others still come in one exchange. */
    const usmipc__wire_t *good[2] = {&w[0], &w[1]};
    ASSERT_OK(usmipc__peer_fetch_fds(peer, good, 2, deadline, fds));
    check_fds(good, fds, 2, NULL);
    close_all(fds, 2);
    ASSERT_EQ(count_memfds(), fds0);

    /* A prefetch leaves the run out (-1: its open fetches it whole) and
     * takes the two others in one exchange. */
    rw.chunk_count = K;
    usmipc_stats_t a, b;
    ASSERT_OK(usmipc_get_stats(&a, sizeof(a)));
    ASSERT_OK(usmipc__prefetch_fds(batch, 3, deadline, fds));
    ASSERT_OK(usmipc_get_stats(&b, sizeof(b)));
    ASSERT_EQ(fds[1], -1);
    ASSERT_UEQ(b.transport_exchanges - a.transport_exchanges, 1);
    ASSERT_UEQ(b.descriptors_received - a.descriptors_received, 2);
    const usmipc__wire_t *got[2] = {&w[0], &w[1]};
    int pair[2] = {fds[0], fds[2]};
    check_fds(got, pair, 2, NULL);
    close(pair[1]);
    /* A descriptor given to the open of a run is closed unused (the host
     * backend maps no chunks: the open fails before it fetches any). */
    ASSERT_ERR(usmipc__open_mapping(&rw, NULL, 0, pair[0], &ptr, NULL),
               USMIPC_EBADHANDLE);
    ASSERT_EQ(count_memfds(), fds0);
    usmipc__peer_put(peer);
    free(w);
    _exit(0);
  }
  int rc = run_child(pid);
  ASSERT_OK(usmipc_get_stats(&s1, sizeof(s1)));
  /* The proof's descriptor, the run twice (the second refused by the
   * importer: it counted fewer), the last batch and the prefetch: none for
   * the entry that named the run. */
  ASSERT_UEQ(s1.descriptors_sent - s0.descriptors_sent, 1 + K + K + 2 + 2);
  usmipc__broker_withdraw(run_id);
  for (int i = 0; i < K; i++)
    close(run[i]);
  exports_free(e);
  return rc;
}

/* pidfd_getfd and /proc take descriptors without any exchange, one system
 * call each, with the same checks. */
static void fetch_without_exchange(const char *transport, exports_t *e) {
  pid_t pid = fork();
  ASSERT_NE(pid, -1);
  if (pid == 0) {
    setenv("USMIPC_FD_TRANSPORT", transport, 1);
    static const usmipc__wire_t *wp[MAX_EXPORTS];
    static int fds[MAX_EXPORTS];
    usmipc__wire_t *w = decode_all(e, wp);
    usmipc_stats_t a, b;
    ASSERT_OK(usmipc_get_stats(&a, sizeof(a)));
    usmipc__peer_t *peer = peer_of(wp[0]);
    size_t fds0 = count_fds();
    ASSERT_OK(usmipc__peer_fetch_fds(peer, wp, e->n,
                                     usmipc__deadline_after_timeout(), fds));
    ASSERT_OK(usmipc_get_stats(&b, sizeof(b)));
    ASSERT_UEQ(b.transport_exchanges - a.transport_exchanges, 0);
    ASSERT_UEQ(b.descriptors_received - a.descriptors_received, e->n);
    check_fds(wp, fds, e->n, NULL);
    close_all(fds, e->n);
    ASSERT_EQ(count_fds(), fds0);
    usmipc__peer_put(peer);
    free(w);
    _exit(0);
  }
  ASSERT_EQ(run_child(pid), 0);
}

TEST_IMPL(fdbatch_pidfd_procfd) {
  enum { N = 600 };
  if (raise_nofile(3 * N + 256) != 0)
    RETURN_SKIP("RLIMIT_NOFILE cannot hold %d descriptors", 3 * N + 256);
  exports_t *e = exports_make(N);
  fetch_without_exchange("procfd", e);
  int pidfd = pidfd_supported();
  if (pidfd)
    fetch_without_exchange("pidfd", e);
  exports_free(e);
  if (!pidfd)
    RETURN_SKIP("procfd passed; pidfd_getfd(2) is not permitted here");
  return 0;
}

/* The open path: handles of two exporters (this process, 300, and an agent,
 * 3) and one of the importer's own, prefetched with one peer fetch per
 * exporter, then opened with their descriptors; cached handles need none,
 * and a descriptor given for a cache hit, or to an open that fails, is
 * closed. */
TEST_IMPL(fdbatch_prefetch_open) {
  enum { N = 300, AGENT = 3, ALL = N + AGENT + 1 };
  if (!test_device_is_host())
    RETURN_SKIP("the agent exports memory of the device under test");
  if (raise_nofile(3 * ALL + 256) != 0)
    RETURN_SKIP("RLIMIT_NOFILE cannot hold %d descriptors", 3 * ALL + 256);
  exports_t *e = exports_make(N);
  agent_t ag;
  agent_start(&ag, "socket");
  static uint8_t agent_bytes[AGENT][HEX_MAX / 2];
  size_t agent_len[AGENT];
  for (int k = 0; k < AGENT; k++) {
    AGENT_OK(&ag, "alloc %d device %d", k, ALLOC_BYTES);
    AGENT_OK(&ag, "fill %d %d", k, 1000 + k);
    AGENT_OK(&ag, "export %d 0 0", k);
    ssize_t len = hex_decode(ag.reply, agent_bytes[k], sizeof(agent_bytes[k]));
    ASSERT_GT(len, 0);
    agent_len[k] = (size_t)len;
  }
  pid_t pid = fork();
  ASSERT_NE(pid, -1);
  if (pid == 0) {
    setenv("USMIPC_FD_TRANSPORT", "socket", 1);
    static usmipc__wire_t w[ALL];
    static const usmipc__wire_t *wp[ALL];
    static int fds[ALL];
    static void *ptr[ALL];
    static size_t seed[ALL];
    /* The agent's handles at 0, 150 and 302, the child's own at 10, this
     * process's in order around them. */
    void *own;
    uint8_t *own_bytes;
    size_t own_len, next = 0;
    ASSERT_OK(
        usmipc_malloc(host_device(), USMIPC_MEM_DEVICE, ALLOC_BYTES, &own));
    pattern_fill(own, ALLOC_BYTES, 4242, 0);
    usmipc_ipc_handle_t *own_h = export_copy(own, 0, &own_bytes, &own_len);
    for (size_t i = 0; i < ALL; i++) {
      const uint8_t *bytes;
      size_t len;
      int k = i == 0 ? 0 : i == 150 ? 1 : i == 302 ? 2 : -1;
      if (k >= 0) {
        bytes = agent_bytes[k];
        len = agent_len[k];
        seed[i] = 1000 + (size_t)k;
      } else if (i == 10) {
        bytes = own_bytes;
        len = own_len;
        seed[i] = 4242;
      } else {
        bytes = e->bytes[next];
        len = e->len[next];
        seed[i] = ++next;
      }
      ASSERT_OK(usmipc__wire_decode(bytes, len, &w[i]));
      wp[i] = &w[i];
      ASSERT(!usmipc__import_cached(&w[i], NULL));
    }
    ASSERT_UEQ(next, N);
    size_t fds0 = count_memfds();
    usmipc_stats_t a, b;
    uint64_t deadline = usmipc__deadline_after_timeout();
    ASSERT_OK(usmipc_get_stats(&a, sizeof(a)));
    ASSERT_OK(usmipc__prefetch_fds(wp, ALL, deadline, fds));
    ASSERT_OK(usmipc_get_stats(&b, sizeof(b)));
    /* Per exporter, its proof (which brings its first handle's descriptor)
     * and then one exchange per 253 more: 1 + 2 for this process's 300, 1 +
     * 1 for the agent's 3. */
    ASSERT_UEQ(b.transport_exchanges - a.transport_exchanges, 5);
    ASSERT_UEQ(b.descriptors_received - a.descriptors_received, ALL - 1);
    ASSERT_EQ(fds[10], -1);
    ASSERT_EQ(count_memfds(), fds0 + ALL - 1);
    for (size_t i = 0; i < ALL; i++) {
      ASSERT_OK(usmipc__open_mapping(&w[i], NULL, 0, fds[i], &ptr[i], NULL));
      fds[i] = -1; /* the open owns it */
      ASSERT_MSG(pattern_check(ptr[i], ALLOC_BYTES, seed[i], 0) == SIZE_MAX,
                 "handle %zu maps other bytes", i);
    }
    ASSERT_UEQ(count_memfds(), fds0);
    ASSERT_OK(usmipc_get_stats(&a, sizeof(a)));
    ASSERT_UEQ(a.descriptors_received, b.descriptors_received);
    ASSERT_UEQ(a.driver_imports - b.driver_imports, ALL - 1);
    for (size_t i = 0; i < ALL; i++)
      ASSERT_EQ(usmipc__import_cached(&w[i], NULL), i != 10);

    /* A descriptor given for a cache hit is closed; so is one given to an
     * open that fails. */
    int fd;
    ASSERT_OK(usmipc__prefetch_fds(&wp[1], 1, deadline, &fd));
    ASSERT_EQ(count_memfds(), fds0 + 1);
    void *again;
    ASSERT_OK(usmipc__open_mapping(&w[1], NULL, 0, fd, &again, NULL));
    ASSERT_PTR_EQ(again, ptr[1]);
    ASSERT_EQ(count_memfds(), fds0);
    ASSERT_OK(usmipc_ipc_close(again));
    ASSERT_OK(usmipc__prefetch_fds(&wp[2], 1, deadline, &fd));
    ASSERT_ERR(
        usmipc__open_mapping(&w[2], NULL, 2 * ALLOC_BYTES, fd, &again, NULL),
        USMIPC_ERANGE);
    ASSERT_EQ(count_memfds(), fds0);

    for (size_t i = 0; i < ALL; i++)
      ASSERT_OK(usmipc_ipc_close(ptr[i]));
    ASSERT_OK(usmipc_ipc_free_handle(own_h));
    ASSERT_OK(usmipc_free(own));
    free(own_bytes);
    _exit(0);
  }
  int rc = run_child(pid);
  agent_stop_ok(&ag);
  exports_free(e);
  return rc;
}
