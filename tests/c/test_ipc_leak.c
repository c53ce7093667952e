/* Resource accounting of the importer: file descriptors (/proc/self/fd)
 * and mappings (/proc/self/maps) after many open/close cycles on several
 * threads, and the bound on idle cached mappings. The test process is the
 * importer; an agent exports. */
#include <pthread.h>
#include <unistd.h>

#include "task.h"

/* The host backend's memory shows in /proc/self/maps as "/memfd:usmipc".
 * Other backends' mappings are the driver's business (a CUDA mapping is not
 * a line of /proc/self/maps), so only the host backend counts mappings; the
 * descriptor counts hold for every backend. */
#define MEMFD_TAG "memfd:usmipc (deleted)" /* data, not export tables */

/* Sanitizers map their own memory (TSan's shadow, ASan's allocator
 * regions) as the process runs: under them only the library's own mappings
 * (memfd) are counted. */
#if defined(__SANITIZE_THREAD__) || defined(__SANITIZE_ADDRESS__)
#define SANITIZER_MAPS 1
#else
#define SANITIZER_MAPS 0
#endif

#define LEAK_BUFFERS 4
#define LEAK_THREADS 4
#define LEAK_CYCLES 10000
/* A GPU driver's import is far slower than an mmap (cuIpcOpenMemHandle takes
 * milliseconds), and uncached every cycle imports. */
#define LEAK_CYCLES_DEVICE 1000

static uint8_t handle_data[LEAK_BUFFERS][1024];
static size_t handle_len[LEAK_BUFFERS];
static int cycles_per_thread;
static int on_host; /* the device under test is the host: touch directly */

/* Allocates and exports count buffers of size bytes; the first fill_len
 * bytes of each (all of it when 0) hold the pattern of seed0 + b. */
static void export_buffers_filled(agent_t *ex, int count, size_t size,
                                  size_t fill_len, int seed0,
                                  uint8_t (*data)[1024], size_t *len) {
  for (int b = 0; b < count; b++) {
    AGENT_OK(ex, "alloc %d device %zu", b, size);
    if (fill_len)
      AGENT_OK(ex, "fill %d %d 0 %zu", b, seed0 + b, fill_len);
    else
      AGENT_OK(ex, "fill %d %d", b, seed0 + b);
    AGENT_OK(ex, "export %d 0 0", b);
    ssize_t n = hex_decode(ex->reply, data[b], 1024);
    ASSERT_GT(n, 0);
    len[b] = (size_t)n;
  }
}

static void export_buffers(agent_t *ex, int count, size_t size, int seed0,
                           uint8_t (*data)[1024], size_t *len) {
  export_buffers_filled(ex, count, size, 0, seed0, data, len);
}

static pthread_barrier_t start_line;

static void *cycle_thread(void *arg) {
  int t = (int)(intptr_t)arg;
  /* All threads alive at once before any work: glibc gives each thread an
   * arena at its first malloc, reusing those of exited threads, so the
   * warm-up leaves exactly LEAK_THREADS arenas and the measured run maps no
   * new one, however the scheduler interleaves the threads. */
  void *volatile first = malloc(64); /* volatile: no eliding the pair */
  free(first);
  /* Device memory is read through a queue of this thread's own. */
  usmipc_queue_t *q = NULL;
  if (!on_host)
    ASSERT_OK(usmipc_queue_create(test_device(), &q));
  pthread_barrier_wait(&start_line);
  for (int i = 0; i < cycles_per_thread; i++) {
    /* Threads walk the buffers out of step, so the same allocation is
     * often opened by two threads at once (the race in usmipc_ipc_open). */
    int b = (t + i) % LEAK_BUFFERS;
    void *p = NULL;
    size_t mapped = 0;
    ASSERT_OK(
        usmipc_ipc_open(handle_data[b], handle_len[b], NULL, 0, &p, &mapped));
    if (on_host)
      ASSERT_EQ(pattern_check(p, 64, 70 + (uint64_t)b, 0), SIZE_MAX);
    else
      ASSERT_EQ(dev_check_on(q, p, 64, 70 + (uint64_t)b, 0), SIZE_MAX);
    ASSERT_OK(usmipc_ipc_close(p));
  }
  if (q != NULL)
    ASSERT_OK(usmipc_queue_destroy(q));
  return NULL;
}

static void run_cycles(int per_thread) {
  pthread_t th[LEAK_THREADS];
  cycles_per_thread = per_thread;
  ASSERT_EQ(pthread_barrier_init(&start_line, NULL, LEAK_THREADS), 0);
  for (int t = 0; t < LEAK_THREADS; t++)
    ASSERT_EQ(pthread_create(&th[t], NULL, cycle_thread, (void *)(intptr_t)t),
              0);
  for (int t = 0; t < LEAK_THREADS; t++)
    ASSERT_EQ(pthread_join(th[t], NULL), 0);
  pthread_barrier_destroy(&start_line);
}

/* /proc/self/maps as text, to show what changed when a count differs. */
static char *maps_snapshot(void) {
  static char buf[1 << 20];
  FILE *f = fopen("/proc/self/maps", "re");
  ASSERT_NOT_NULL(f);
  size_t n = fread(buf, 1, sizeof(buf) - 1, f);
  fclose(f);
  buf[n] = '\0';
  return strdup(buf);
}

static void print_maps_diff(const char *before, const char *after) {
  const char *sides[2][2] = {{before, after}, {after, before}};
  for (int k = 0; k < 2; k++) {
    const char *line = sides[k][0];
    while (*line) {
      size_t len = strcspn(line, "\n");
      char one[512];
      snprintf(one, sizeof(one), "%.*s\n", (int)(len < 500 ? len : 500), line);
      if (strstr(sides[k][1], one) == NULL)
        printf("%s %s", k == 0 ? "gone:" : "new: ", one);
      line += len + (line[len] == '\n');
    }
  }
}

static int no_leak(int cached) {
  on_host = test_device_is_host();
  const int cycles = on_host ? LEAK_CYCLES : LEAK_CYCLES_DEVICE;
  agent_t ex;
  agent_start(&ex, NULL);
  export_buffers(&ex, LEAK_BUFFERS, 256 * 1024, 70, handle_data, handle_len);
  {
    /* Before the baseline, the state kept per exporter, not per mapping:
     * the importer's pidfd of the exporter and its export table, and on a
     * GPU the driver's first-use state (a context, with descriptors of its
     * device files). Done uncached, so that no mapping stays. */
    usmipc_queue_t *q = NULL;
    ASSERT_OK(usmipc_queue_create(test_device(), &q));
    ASSERT_OK(usmipc_ipc_set_cache_size(0));
    for (int b = 0; b < LEAK_BUFFERS; b++) {
      void *p = NULL;
      ASSERT_OK(
          usmipc_ipc_open(handle_data[b], handle_len[b], NULL, 0, &p, NULL));
      ASSERT_EQ(dev_check_on(q, p, 64, 70 + (uint64_t)b, 0), SIZE_MAX);
      ASSERT_OK(usmipc_ipc_close(p));
    }
    ASSERT_OK(usmipc_queue_destroy(q));
    if (cached)
      ASSERT_OK(usmipc_ipc_set_cache_size(64)); /* the default */
  }

  size_t fds0 = count_fds();
  size_t memfd0 = 0;
  if (on_host) {
    memfd0 = count_maps_matching(MEMFD_TAG);
    ASSERT_EQ(memfd0, 0);
  }

  /* Warm-up: thread stacks (glibc caches them), malloc arenas, and with the
   * cache on, one idle mapping per buffer. */
  run_cycles(50);
  size_t fds1 = count_fds();
  char *snap1 = NULL;
  size_t maps1 = 0, memfd1 = 0;
  if (on_host) {
    snap1 = maps_snapshot();
    maps1 = count_maps();
    memfd1 = count_maps_matching(MEMFD_TAG);
    ASSERT_EQ(memfd1, cached ? LEAK_BUFFERS : 0);
  }
  /* No descriptor is kept per mapping: usmipc closes the one it fetched
   * once the backend has mapped it. Whether a GPU driver keeps one of its
   * own for an idle mapping is the driver's affair; that it gives it back
   * when the mapping goes is checked below. */
  if (on_host || !cached)
    ASSERT_EQ(fds1, fds0);
  else
    printf("fds with %d idle mappings cached: %zu -> %zu\n", LEAK_BUFFERS, fds0,
           fds1);

  double t0 = now_seconds();
  run_cycles(cycles / LEAK_THREADS);
  double dt = now_seconds() - t0;
  printf("%d open/close cycles on %d threads: %.3f s (%.2f us per cycle)\n",
         cycles, LEAK_THREADS, dt, dt * 1e6 / cycles);

  size_t fds2 = count_fds();
  if (on_host) {
    size_t maps2 = count_maps();
    size_t memfd2 = count_maps_matching(MEMFD_TAG);
    printf("fds %zu -> %zu, maps %zu -> %zu, memfd maps %zu -> %zu\n", fds1,
           fds2, maps1, maps2, memfd1, memfd2);
    if (maps2 != maps1) {
      char *snap2 = maps_snapshot();
      print_maps_diff(snap1, snap2);
      free(snap2);
    }
    free(snap1);
    ASSERT_EQ(fds2, fds1);
    ASSERT_EQ(memfd2, memfd1);
    if (!SANITIZER_MAPS)
      ASSERT_EQ(maps2, maps1);
  } else {
    printf("fds %zu -> %zu (mappings are not counted on %s)\n", fds1, fds2,
           usmipc_backend_name(usmipc_device_backend(test_device())));
    ASSERT_EQ(fds2, fds1);
  }

  if (cached) {
    /* Dropping the cache unmaps the idle mappings: back to the baseline. */
    ASSERT_OK(usmipc_ipc_set_cache_size(0));
    if (on_host) {
      ASSERT_EQ(count_maps_matching(MEMFD_TAG), memfd0);
      if (!SANITIZER_MAPS)
        ASSERT_EQ(count_maps(), maps1 - LEAK_BUFFERS);
    }
    ASSERT_EQ(count_fds(), fds0);
  } else {
    /* Uncached, a mapping exists exactly while it is open. */
    void *p = NULL;
    ASSERT_OK(
        usmipc_ipc_open(handle_data[0], handle_len[0], NULL, 0, &p, NULL));
    if (on_host)
      ASSERT_EQ(count_maps_matching(MEMFD_TAG), memfd0 + 1);
    ASSERT_OK(usmipc_ipc_close(p));
    if (on_host)
      ASSERT_EQ(count_maps_matching(MEMFD_TAG), memfd0);
    ASSERT_EQ(count_fds(), fds0);
  }
  agent_stop_ok(&ex);
  return 0;
}

TEST_IMPL(ipc_no_leak_cached) { return no_leak(1); }
TEST_IMPL(ipc_no_leak_uncached) { return no_leak(0); }

/* ipc_cache_warm_by_liveness: with the defaults, a consumer that closes
 * every mapping between handoffs (as engines drop their tensors) finds
 * them all again at the next round, however many and however large: 150
 * allocations of 8 MiB from three exporters, past the old 64-entry and
 * 1 GiB caps, re-open with no driver import, no descriptor and no broker
 * exchange. And freed means freed: once the exporters free them, the idle
 * mappings go within a second although this process makes no call (the
 * cache's sweeper). */
TEST_IMPL(ipc_cache_warm_by_liveness) {
  const int host = test_device_is_host();
  enum { AGENTS = 3, PER = 50 };
  const size_t size = (size_t)8 << 20;
  static uint8_t data[AGENTS][PER][1024];
  static size_t len[AGENTS][PER];
  static void *ptr[AGENTS][PER];
  agent_t ex[AGENTS];
  size_t base = host ? count_maps_matching(MEMFD_TAG) : 0;
  for (int a = 0; a < AGENTS; a++) {
    agent_start(&ex[a], NULL);
    /* Only the first page is checked, so only it is written: filling
     * 1.2 GB through the agent takes minutes under ThreadSanitizer. */
    export_buffers_filled(&ex[a], PER, size, 4096, 300 + a * PER, data[a],
                          len[a]);
  }
  for (int round = 0; round < 2; round++) {
    usmipc_stats_t before, after;
    ASSERT_OK(usmipc_get_stats(&before, sizeof(before)));
    for (int a = 0; a < AGENTS; a++)
      for (int b = 0; b < PER; b++) {
        void *p = NULL;
        ASSERT_OK(usmipc_ipc_open(data[a][b], len[a][b], NULL, 0, &p, NULL));
        if (round == 0)
          ptr[a][b] = p;
        ASSERT_PTR_EQ(p, ptr[a][b]); /* the same mapping, kept */
        ASSERT_PATTERN(p, 4096, 300 + (uint64_t)(a * PER + b), 0);
      }
    for (int a = 0; a < AGENTS; a++)
      for (int b = 0; b < PER; b++)
        ASSERT_OK(usmipc_ipc_close(ptr[a][b]));
    ASSERT_OK(usmipc_get_stats(&after, sizeof(after)));
    if (round == 1) {
      ASSERT_UEQ(after.driver_imports - before.driver_imports, 0);
      ASSERT_UEQ(after.descriptors_received - before.descriptors_received, 0);
      ASSERT_UEQ(after.transport_exchanges - before.transport_exchanges, 0);
    }
    if (host)
      ASSERT_EQ(count_maps_matching(MEMFD_TAG) - base, AGENTS * PER);
  }
  /* The exporters free everything; this process makes no call. */
  for (int a = 0; a < AGENTS; a++)
    for (int b = 0; b < PER; b++)
      AGENT_OK(&ex[a], "free %d", b);
  double t0 = now_seconds();
  if (host) {
    while (count_maps_matching(MEMFD_TAG) > base && now_seconds() - t0 < 1.0)
      usleep(20000);
    ASSERT_MSG(count_maps_matching(MEMFD_TAG) == base,
               "%zu idle mappings of freed allocations still mapped 1 s "
               "after their exporters freed them",
               count_maps_matching(MEMFD_TAG) - base);
    printf("freed mappings gone after %.0f ms\n", (now_seconds() - t0) * 1000);
  }
  for (int a = 0; a < AGENTS; a++)
    agent_stop_ok(&ex[a]);
  return 0;
}

TEST_IMPL(ipc_cache_limit) {
  /* Which mappings exist is visible on the host backend only (memfd lines
   * of /proc/self/maps); on every backend a cached mapping is re-opened at
   * the very same address and an evicted one maps anew with the right
   * bytes. */
  const int host = test_device_is_host();
  enum { N = 20, LIMIT = 4 };
  static uint8_t data[N][1024];
  size_t len[N];
  void *ptr[N];
  agent_t ex;
  agent_start(&ex, NULL);
  export_buffers(&ex, N, 64 * 1024, 80, data, len);
  ASSERT_OK(usmipc_ipc_set_cache_size(LIMIT));
  size_t base = host ? count_maps_matching(MEMFD_TAG) : 0;

  for (int i = 0; i < N; i++) {
    ASSERT_OK(usmipc_ipc_open(data[i], len[i], NULL, 0, &ptr[i], NULL));
    ASSERT_PATTERN(ptr[i], 64 * 1024, 80 + (uint64_t)i, 0);
    ASSERT_OK(usmipc_ipc_close(ptr[i]));
    if (host) {
      size_t idle = count_maps_matching(MEMFD_TAG) - base;
      ASSERT_LE(idle, LIMIT);
      ASSERT_EQ(idle, (size_t)(i + 1 < LIMIT ? i + 1 : LIMIT));
    }
  }
  /* The most recently closed are the ones kept: re-opening them returns
   * the very same mapping and maps nothing new. */
  for (int i = N - LIMIT; i < N; i++) {
    void *p = NULL;
    ASSERT_OK(usmipc_ipc_open(data[i], len[i], NULL, 0, &p, NULL));
    ASSERT_PTR_EQ(p, ptr[i]);
    if (host)
      ASSERT_EQ(count_maps_matching(MEMFD_TAG) - base, LIMIT);
    ASSERT_OK(usmipc_ipc_close(p));
  }
  /* An evicted one maps anew, with the right bytes. */
  void *p0 = NULL;
  ASSERT_OK(usmipc_ipc_open(data[0], len[0], NULL, 0, &p0, NULL));
  if (host)
    ASSERT_EQ(count_maps_matching(MEMFD_TAG) - base, LIMIT + 1);
  ASSERT_PATTERN(p0, 64 * 1024, 80, 0);
  ASSERT_OK(usmipc_ipc_close(p0));
  if (host)
    ASSERT_EQ(count_maps_matching(MEMFD_TAG) - base, LIMIT);

  /* Shrinking the cache unmaps at once; an open mapping is never evicted. */
  void *held = NULL;
  ASSERT_OK(usmipc_ipc_open(data[5], len[5], NULL, 0, &held, NULL));
  ASSERT_OK(usmipc_ipc_set_cache_size(0));
  if (host)
    ASSERT_EQ(count_maps_matching(MEMFD_TAG), base + 1);
  ASSERT_PATTERN(held, 64 * 1024, 85, 0);
  ASSERT_OK(usmipc_ipc_close(held));
  if (host)
    ASSERT_EQ(count_maps_matching(MEMFD_TAG), base);
  agent_stop_ok(&ex);
  return 0;
}

/* Threads that open the same handle at the same moment, for the first time,
 * and keep it open: every open succeeds at the one address of the mapping.
 * CUDA maps a legacy (native) handle once per process: the threads that
 * lose the race get CUDA_ERROR_ALREADY_MAPPED from the driver, and the core
 * must hand them the winner's mapping (they failed after 20 ms before). */
#define SAME_THREADS 8

static pthread_barrier_t same_line;
static void *same_ptr[SAME_THREADS];

static void *open_same_thread(void *arg) {
  int t = (int)(intptr_t)arg;
  pthread_barrier_wait(&same_line);
  ASSERT_OK(usmipc_ipc_open(handle_data[0], handle_len[0], NULL, 0,
                            &same_ptr[t], NULL));
  return NULL;
}

TEST_IMPL(ipc_open_same_handle_threads) {
  on_host = test_device_is_host();
  agent_t ex;
  agent_start(&ex, NULL);
  export_buffers(&ex, 1, 256 * 1024, 90, handle_data, handle_len);
  ASSERT_OK(usmipc_ipc_set_cache_size(0));
  usmipc_queue_t *q = NULL;
  if (!on_host)
    ASSERT_OK(usmipc_queue_create(test_device(), &q));
  for (int round = 0; round < 20; round++) {
    pthread_t th[SAME_THREADS];
    ASSERT_EQ(pthread_barrier_init(&same_line, NULL, SAME_THREADS), 0);
    for (int t = 0; t < SAME_THREADS; t++)
      ASSERT_EQ(
          pthread_create(&th[t], NULL, open_same_thread, (void *)(intptr_t)t),
          0);
    for (int t = 0; t < SAME_THREADS; t++)
      ASSERT_EQ(pthread_join(th[t], NULL), 0);
    pthread_barrier_destroy(&same_line);
    for (int t = 1; t < SAME_THREADS; t++)
      ASSERT_PTR_EQ(same_ptr[t], same_ptr[0]);
    if (on_host)
      ASSERT_EQ(pattern_check(same_ptr[0], 64, 90, 0), SIZE_MAX);
    else
      ASSERT_EQ(dev_check_on(q, same_ptr[0], 64, 90, 0), SIZE_MAX);
    for (int t = 0; t < SAME_THREADS; t++)
      ASSERT_OK(usmipc_ipc_close(same_ptr[t]));
  }
  if (q != NULL)
    ASSERT_OK(usmipc_queue_destroy(q));
  ASSERT_OK(usmipc_ipc_set_cache_size(64));
  agent_stop_ok(&ex);
  return 0;
}
