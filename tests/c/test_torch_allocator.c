/* The PyTorch allocator's entry points (src/torch_allocator.c): the host
 * pools through the internal calls, which run everywhere, and the public
 * CUDA ones where a CUDA device exists. torch itself is tested in
 * tests/gpu/test_gpu_torch_allocator.py. */
#include <pthread.h>

#include "objects.h"
#include "task.h"

#define KiB ((size_t)1 << 10)
#define MiB ((size_t)1 << 20)
#define THREADS 4
#define CYCLES 2500 /* per thread: 10,000 allocations and frees in all */

/* The message of the last failure on this thread must contain each of the
 * (up to two) fragments. */
static void expect_message(const char *file, int line, const char *a,
                           const char *b) {
  const char *m = usmipc_last_error();
  if (strstr(m, a) == NULL || (b != NULL && strstr(m, b) == NULL))
    test_fail(file, line, "message \"%s\" lacks \"%s\"%s%s", m, a,
              b ? " or " : "", b ? b : "");
}
#define EXPECT_MESSAGE(a, b) expect_message(__FILE__, __LINE__, (a), (b))

/* The allocator under test: the public CUDA calls, or the internal ones
 * on any backend's device ordinal. */
typedef struct target {
  bool public_calls;
  usmipc_backend_t backend;
  int ordinal;
} target_t;

typedef struct churn {
  const target_t *target;
  int cycles;
  usmipc_queue_t *queue; /* the thread's stream (a device), or NULL */
  int id;
} churn_t;

static void *torch_malloc(const target_t *t, size_t n, void *stream) {
  return t->public_calls ? usmipc_torch_malloc((ssize_t)n, t->ordinal, stream)
                         : usmipc__torch_malloc_on(t->backend, (ssize_t)n,
                                                   t->ordinal, stream);
}

static void torch_free(const target_t *t, void *p, size_t n, void *stream) {
  if (t->public_calls)
    usmipc_torch_free(p, (ssize_t)n, t->ordinal, stream);
  else
    usmipc__torch_free_on(t->backend, p, t->ordinal, stream);
}

static uint32_t stamp_at(const void *p, size_t off) {
  uint32_t v;
  memcpy(&v, (const uint8_t *)p + off, 4);
  return v;
}

/* Each thread keeps 8 blocks alive at a time, of sizes from 4 bytes to
 * 300 KB, and frees the oldest for each new one. On the host every block
 * carries its owner's stamp at both ends, checked before the free: two
 * live blocks that overlapped would overwrite each other's. On CUDA the
 * thread fills blocks on its own stream and frees them on it, so frees
 * find work pending on their stream. */
static void *churn_thread(void *arg) {
  churn_t *c = arg;
  void *stream = c->queue ? usmipc_queue_native(c->queue) : NULL;
  void *live[8] = {0};
  size_t size[8] = {0};
  uint64_t rng = 0x9e3779b97f4a7c15ull * (uint64_t)(c->id + 1);
  for (int i = 0; i < c->cycles + 8; i++) {
    int k = i % 8;
    if (live[k] != NULL) {
      if (c->queue == NULL) {
        uint32_t want = (uint32_t)(c->id << 24 | (i - 8));
        ASSERT_EQ(stamp_at(live[k], 0), want);
        if (size[k] >= 8)
          ASSERT_EQ(stamp_at(live[k], size[k] - 4), want);
      }
      torch_free(c->target, live[k], size[k], stream);
      live[k] = NULL;
    }
    if (i >= c->cycles)
      continue;
    rng = rng * 6364136223846793005ull + 1442695040888963407ull;
    size_t n = 4 + (size_t)(rng >> 33) % (300 * KiB);
    void *p = torch_malloc(c->target, n, stream);
    ASSERT_MSG(p != NULL, "torch malloc of %zu bytes: %s", n,
               usmipc_last_error());
    ASSERT_EQ((uintptr_t)p % 512, 0);
    if (c->queue == NULL) {
      uint32_t stamp = (uint32_t)(c->id << 24 | i);
      memcpy(p, &stamp, 4);
      if (n >= 8) /* at the end too, where the stamps cannot overlap */
        memcpy((uint8_t *)p + n - 4, &stamp, 4);
    } else {
      ASSERT_OK(usmipc_memset(c->queue, p, c->id, n));
    }
    live[k] = p;
    size[k] = n;
  }
  return NULL;
}

/* 10,000 allocations and frees across 4 threads; at the end the pool holds
 * no block (no leak), in the few segments that the peak needed. */
static void churn(const target_t *target, usmipc_device_t *dev, int cycles) {
  pthread_t t[THREADS];
  churn_t c[THREADS];
  for (int i = 0; i < THREADS; i++) {
    c[i].target = target;
    c[i].cycles = cycles;
    c[i].id = i + 1;
    c[i].queue = NULL;
    if (target->backend != USMIPC_BACKEND_HOST)
      ASSERT_OK(usmipc_queue_create(dev, &c[i].queue));
    ASSERT_EQ(pthread_create(&t[i], NULL, churn_thread, &c[i]), 0);
  }
  for (int i = 0; i < THREADS; i++)
    pthread_join(t[i], NULL);
  usmipc_pool_t *pool;
  if (target->public_calls) {
    ASSERT_OK(usmipc_torch_pool(target->ordinal, &pool));
    ASSERT_OK(usmipc_torch_synchronize(target->ordinal));
  } else {
    ASSERT_OK(usmipc__torch_pool_for(target->backend, target->ordinal, &pool));
    ASSERT_OK(usmipc__torch_synchronize_on(target->backend, target->ordinal));
  }
  usmipc_pool_info_t info;
  ASSERT_OK(usmipc_pool_get_info(pool, &info, sizeof(info)));
  ASSERT_UEQ(info.blocks, 0);
  ASSERT_UEQ(info.block_bytes, 0);
  /* At most 32 live blocks of 300 KB (10 MB) at once: a few segments. */
  ASSERT_LE(info.segments, 6);
  for (int i = 0; i < THREADS; i++)
    if (c[i].queue != NULL)
      ASSERT_OK(usmipc_queue_destroy(c[i].queue));
}

TEST_IMPL(torch_alloc_host_threads) {
  ASSERT_OK(usmipc_torch_set_segment_size(1 * MiB)); /* so the pool grows */
  target_t host = {false, USMIPC_BACKEND_HOST, 0};
  churn(&host, host_device(), CYCLES);
  return 0;
}

/* The same on the device under test (USMIPC_TEST_DEVICE: the Level Zero
 * test driver in CTest's level_zero.c.*, a GPU on the device machine),
 * through the internal calls: frees record events on the threads' queues
 * and their blocks come back once the events completed. */
TEST_IMPL(torch_alloc_device_threads) {
  usmipc_device_t *dev = test_device();
  if (test_device_is_host())
    RETURN_SKIP("the device under test is the host (USMIPC_TEST_DEVICE)");
  ASSERT_OK(usmipc_torch_set_segment_size(4 * MiB));
  target_t t = {false, usmipc_device_backend(dev), dev->ordinal};
  churn(&t, dev, CYCLES / 25); /* the test driver's queues are slow */
  return 0;
}

/* Sizes 0, negative and huge; device ordinals that do not exist; the
 * segment size from the environment; a block is a pool block that shares
 * as one. */
TEST_IMPL(torch_alloc_host_edges) {
  const usmipc_backend_t H = USMIPC_BACKEND_HOST;
  /* The first segment's size from the environment (its parser, and a
   * malformed value's warning: env_numbers). */
  ASSERT_EQ(setenv("USMIPC_TORCH_POOL_SEGMENT", "2MiB", 1), 0);
  void *p = usmipc__torch_malloc_on(H, 100, 0, NULL);
  ASSERT_NOT_NULL(p);
  ASSERT_EQ((uintptr_t)p % 512, 0);
  usmipc_pool_t *pool, *again;
  ASSERT_OK(usmipc__torch_pool_for(H, 0, &pool));
  ASSERT_OK(usmipc__torch_pool_for(H, 0, &again));
  ASSERT_PTR_EQ(again, pool);
  usmipc_pool_info_t info;
  ASSERT_OK(usmipc_pool_get_info(pool, &info, sizeof(info)));
  ASSERT_UEQ(info.segments, 1);
  ASSERT_UEQ(info.segment_bytes, 2 * MiB);
  ASSERT_UEQ(info.blocks, 1);
  ASSERT_UEQ(info.block_bytes, 512); /* sizes in multiples of 512 */
  /* A pool block: queried and exported as one. */
  usmipc_pointer_info_t pi;
  ASSERT_OK(usmipc_pointer_query((uint8_t *)p + 10, &pi));
  ASSERT_PTR_EQ(pi.base, p);
  ASSERT_UEQ(pi.size, 512);
  usmipc_ipc_handle_t *h;
  const void *data;
  size_t len;
  usmipc_ipc_handle_info_t hi;
  ASSERT_OK(usmipc_ipc_get_handle(p, 100, &h));
  ASSERT_OK(usmipc_ipc_handle_data(h, &data, &len));
  ASSERT_OK(usmipc_ipc_handle_inspect(data, len, &hi));
  ASSERT_UEQ(hi.nbytes, 100);
  ASSERT_OK(usmipc_ipc_free_handle(h));

  /* Size 0 gives NULL, as torch's own allocator does; freeing NULL is a
   * no-op. */
  ASSERT_PTR_EQ(usmipc__torch_malloc_on(H, 0, 0, NULL), NULL);
  usmipc__torch_free_on(H, NULL, 0, NULL);
  usmipc_torch_free(NULL, 0, 0, NULL);
  test_error_sentinel();
  ASSERT_PTR_EQ(usmipc__torch_malloc_on(H, -5, 0, NULL), NULL);
  EXPECT_MESSAGE("negative", NULL);
  test_error_sentinel();
  ASSERT_PTR_EQ(usmipc__torch_malloc_on(H, (ssize_t)1 << 47, 0, NULL), NULL);
  EXPECT_MESSAGE("usmipc_torch_malloc(140737488355328 bytes, host device 0)",
                 "more than any device holds");
  test_error_sentinel();
  ASSERT_PTR_EQ(usmipc__torch_malloc_on(H, 100, 1, NULL), NULL);
  EXPECT_MESSAGE("no host device 1", NULL);
  test_error_sentinel();
  ASSERT_PTR_EQ(usmipc__torch_malloc_on(H, 100, 99, NULL), NULL);
  EXPECT_MESSAGE("no host device 99", NULL);
  test_error_sentinel();
  ASSERT_PTR_EQ(usmipc__torch_malloc_on(H, 100, -1, NULL), NULL);
  EXPECT_MESSAGE("no host device -1", NULL);
  ASSERT_ERR(usmipc__torch_pool_for(H, 3, &again), USMIPC_ENODEV);
  ASSERT_PTR_EQ(again, NULL);
  ASSERT_ERR(usmipc_torch_set_segment_size((size_t)1 << 47), USMIPC_EINVAL);

  /* A block bigger than the segment gets one of its own. */
  void *big = usmipc__torch_malloc_on(H, (ssize_t)(5 * MiB), 0, NULL);
  ASSERT_NOT_NULL(big);
  usmipc__torch_free_on(H, p, 0, NULL);
  usmipc__torch_free_on(H, big, 0, NULL);
  ASSERT_OK(usmipc_pool_get_info(pool, &info, sizeof(info)));
  ASSERT_UEQ(info.segments, 2);
  ASSERT_UEQ(info.blocks, 0);
  ASSERT_OK(usmipc__torch_synchronize_on(H, 0));
  ASSERT_OK(usmipc__torch_synchronize_on(H, 5)); /* no pool: nothing to do */
  return 0;
}

/* The public entry points, on CUDA device 0: the same churn, each thread
 * filling its blocks on its own stream and freeing them on it; then the
 * failures torch can meet. */
TEST_IMPL(torch_alloc_cuda) {
  const char *reason = NULL;
  if (usmipc_backend_status(USMIPC_BACKEND_CUDA, &reason) != 0)
    RETURN_SKIP("no CUDA device: %s", reason ? reason : "?");
  usmipc_device_t *dev;
  ASSERT_OK(usmipc_device_select("cuda:gpu:0", &dev));
  target_t cuda = {true, USMIPC_BACKEND_CUDA, 0};
  churn(&cuda, dev, CYCLES);
  ASSERT_PTR_EQ(usmipc_torch_malloc(0, 0, NULL), NULL);
  test_error_sentinel();
  ASSERT_PTR_EQ(usmipc_torch_malloc((ssize_t)1 << 47, 0, NULL), NULL);
  EXPECT_MESSAGE("usmipc_torch_malloc(", "more than any device holds");
  /* 32 TiB: the driver refuses the segment. */
  test_error_sentinel();
  ASSERT_PTR_EQ(usmipc_torch_malloc((ssize_t)1 << 45, 0, NULL), NULL);
  EXPECT_MESSAGE("usmipc_torch_malloc(35184372088832 bytes, cuda device 0)",
                 "segment");
  test_error_sentinel();
  ASSERT_PTR_EQ(usmipc_torch_malloc(100, 15, NULL), NULL);
  EXPECT_MESSAGE("no cuda device 15", NULL);
  /* A block after all that still works, on the legacy default stream. */
  void *p = usmipc_torch_malloc(1000, 0, NULL);
  ASSERT_NOT_NULL(p);
  usmipc_queue_t *q;
  ASSERT_OK(usmipc_queue_from_native(dev, NULL, &q));
  ASSERT_OK(usmipc_memset(q, p, 7, 1000));
  usmipc_torch_free(p, 1000, 0, NULL);
  ASSERT_OK(usmipc_torch_synchronize(0));
  usmipc_pool_info_t info;
  usmipc_pool_t *pool;
  ASSERT_OK(usmipc_torch_pool(0, &pool));
  ASSERT_OK(usmipc_pool_get_info(pool, &info, sizeof(info)));
  ASSERT_UEQ(info.blocks, 0);
  ASSERT_OK(usmipc_queue_destroy(q));
  return 0;
}
