/* Allocation, copies and fills, pointer queries, buffer ids, frees. */
#include <pthread.h>

#include "task.h"

static const usmipc_mem_kind_t kinds[] = {USMIPC_MEM_DEVICE, USMIPC_MEM_HOST,
                                          USMIPC_MEM_SHARED};

TEST_IMPL(memory_malloc_kinds) {
  usmipc_device_t *dev = test_device();
  const size_t n = 3 * 4096 + 17;
  for (size_t k = 0; k < 3; k++) {
    void *p = NULL;
    ASSERT_OK(usmipc_malloc(dev, kinds[k], n, &p));
    ASSERT_NOT_NULL(p);
    usmipc_pointer_info_t info;
    memset(&info, 0xff, sizeof(info));
    ASSERT_OK(usmipc_pointer_query(p, &info));
    ASSERT_PTR_EQ(info.device, dev);
    ASSERT_EQ(info.kind, kinds[k]);
    ASSERT_PTR_EQ(info.base, p);
    ASSERT_EQ(info.size, n); /* the size asked for, not a rounded one */
    ASSERT_EQ(info.is_ipc_mapping, 0);
    ASSERT_EQ(info.is_foreign, 0);
    dev_fill(p, n, 100 + k, 0);
    ASSERT_PATTERN(p, n, 100 + k, 0);
    ASSERT_OK(usmipc_free(p));
    ASSERT_ERR(usmipc_pointer_query(p, &info), USMIPC_EUNKNOWNPTR);
  }
  return 0;
}

TEST_IMPL(memory_memcpy_memset) {
  usmipc_device_t *dev = test_device();
  usmipc_queue_t *q = NULL;
  ASSERT_OK(usmipc_queue_create(dev, &q));
  const size_t n = 64 * 1024 + 5;
  void *d = NULL, *h = NULL;
  ASSERT_OK(usmipc_malloc(dev, USMIPC_MEM_DEVICE, n, &d));
  ASSERT_OK(usmipc_malloc(dev, USMIPC_MEM_HOST, n, &h));
  uint8_t *m = malloc(n);
  ASSERT_NOT_NULL(m);

  /* memset on the device, read back through a host-kind buffer. */
  ASSERT_OK(usmipc_memset(q, d, 0xAB, n));
  ASSERT_OK(usmipc_memcpy(q, h, d, n));
  ASSERT_OK(usmipc_queue_synchronize(q));
  for (size_t i = 0; i < n; i++)
    ASSERT_MSG(((uint8_t *)h)[i] == 0xAB, "byte %zu is 0x%02x", i,
               ((uint8_t *)h)[i]);

  /* Only the low byte of value counts, as with memset(3). */
  ASSERT_OK(usmipc_memset(q, d, 0x1234, 100));
  ASSERT_OK(usmipc_memcpy(q, m, d, 101));
  ASSERT_OK(usmipc_queue_synchronize(q));
  ASSERT_EQ(m[0], 0x34);
  ASSERT_EQ(m[99], 0x34);
  ASSERT_EQ(m[100], 0xAB);

  /* Host -> device -> host-kind -> plain host, with odd offsets. */
  pattern_fill(m, n, 7, 0);
  ASSERT_OK(usmipc_memcpy(q, d, m, n));
  ASSERT_OK(usmipc_memcpy(q, h, d, n));
  ASSERT_OK(usmipc_queue_synchronize(q));
  ASSERT_EQ(pattern_check(h, n, 7, 0), SIZE_MAX);
  memset(m, 0, n);
  ASSERT_OK(usmipc_memcpy(q, m + 3, (uint8_t *)d + 1001, 5000));
  ASSERT_OK(usmipc_queue_synchronize(q));
  ASSERT_EQ(pattern_check(m + 3, 5000, 7, 1001), SIZE_MAX);
  ASSERT_EQ(m[2], 0);
  ASSERT_EQ(m[5003], 0);

  /* Zero bytes is a no-op, not an error. */
  ASSERT_OK(usmipc_memcpy(q, d, m, 0));
  ASSERT_OK(usmipc_memset(q, d, 0, 0));
  ASSERT_ERR(usmipc_memcpy(NULL, d, m, 10), USMIPC_EINVAL);
  ASSERT_ERR(usmipc_memcpy(q, NULL, m, 10), USMIPC_EINVAL);
  ASSERT_ERR(usmipc_queue_synchronize(NULL), USMIPC_EINVAL);

  free(m);
  ASSERT_OK(usmipc_free(d));
  ASSERT_OK(usmipc_free(h));
  ASSERT_OK(usmipc_queue_destroy(q));
  return 0;
}

TEST_IMPL(memory_pointer_query_interior) {
  usmipc_device_t *dev = test_device();
  const size_t n = 1024 * 1024 + 100;
  uint8_t *p = NULL;
  ASSERT_OK(usmipc_malloc(dev, USMIPC_MEM_DEVICE, n, (void **)&p));
  usmipc_pointer_info_t base;
  ASSERT_OK(usmipc_pointer_query(p, &base));
  ASSERT_NE(base.buffer_id, 0);
  const size_t offsets[] = {1, 4095, 4096, n / 2, n - 1};
  for (size_t i = 0; i < sizeof(offsets) / sizeof(offsets[0]); i++) {
    usmipc_pointer_info_t info;
    ASSERT_OK(usmipc_pointer_query(p + offsets[i], &info));
    ASSERT_PTR_EQ(info.base, p);
    ASSERT_EQ(info.size, n);
    ASSERT_UEQ(info.buffer_id, base.buffer_id);
    ASSERT_EQ(info.kind, USMIPC_MEM_DEVICE);
    ASSERT_PTR_EQ(info.device, dev);
  }
  /* One past the end belongs to no allocation, or to another one. */
  usmipc_pointer_info_t past;
  int r = usmipc_pointer_query(p + n, &past);
  PROBE_ERR("usmipc_pointer_query(p + n, &past)", r);
  if (r == 0)
    ASSERT_PTR_NE(past.base, p);
  else
    ASSERT_EQ(r, USMIPC_EUNKNOWNPTR);
  ASSERT_OK(usmipc_free(p));
  return 0;
}

TEST_IMPL(memory_pointer_query_unknown) {
  int on_stack = 0;
  void *on_heap = malloc(64);
  usmipc_pointer_info_t info;
  ASSERT_ERR(usmipc_pointer_query(&on_stack, &info), USMIPC_EUNKNOWNPTR);
  ASSERT_ERR(usmipc_pointer_query(on_heap, &info), USMIPC_EUNKNOWNPTR);
  ASSERT_ERR2(usmipc_pointer_query(NULL, &info), USMIPC_EUNKNOWNPTR,
              USMIPC_EINVAL);
  ASSERT_ERR(usmipc_pointer_query(on_heap, NULL), USMIPC_EINVAL);
  free(on_heap);
  return 0;
}

TEST_IMPL(memory_buffer_id_unique) {
  usmipc_device_t *dev = test_device();
  enum { N = 48 };
  void *p[N];
  uint64_t id[N];
  for (int i = 0; i < N; i++) {
    usmipc_mem_kind_t kind = kinds[i % 3];
    ASSERT_OK(usmipc_malloc(dev, kind, (size_t)(1 + i * 777), &p[i]));
    usmipc_pointer_info_t info;
    ASSERT_OK(usmipc_pointer_query(p[i], &info));
    id[i] = info.buffer_id;
    ASSERT_NE(id[i], 0);
    for (int j = 0; j < i; j++) {
      ASSERT_UNE(id[i], id[j]);
      ASSERT_PTR_NE(p[i], p[j]);
    }
  }
  for (int i = 0; i < N; i++)
    ASSERT_OK(usmipc_free(p[i]));
  return 0;
}

TEST_IMPL(memory_buffer_id_after_reuse) {
  /* A new allocation at a freed one's address must get a new buffer id:
   * import caches key on it to detect address reuse. */
  usmipc_device_t *dev = test_device();
  const size_t n = 256 * 1024;
  uint64_t seen[64];
  int nseen = 0, reused = 0;
  void *prev = NULL;
  ASSERT_OK(usmipc_malloc(dev, USMIPC_MEM_DEVICE, n, &prev));
  usmipc_pointer_info_t info;
  ASSERT_OK(usmipc_pointer_query(prev, &info));
  seen[nseen++] = info.buffer_id;
  for (int round = 0; round < 32; round++) {
    ASSERT_OK(usmipc_free(prev));
    void *p = NULL;
    ASSERT_OK(usmipc_malloc(dev, USMIPC_MEM_DEVICE, n, &p));
    ASSERT_OK(usmipc_pointer_query(p, &info));
    for (int j = 0; j < nseen; j++)
      ASSERT_UNE(info.buffer_id, seen[j]);
    seen[nseen++] = info.buffer_id;
    if (p == prev)
      reused++;
    prev = p;
  }
  ASSERT_OK(usmipc_free(prev));
  printf("address reused in %d of 32 rounds\n", reused);
  return 0;
}

TEST_IMPL(memory_free_bad_pointers) {
  usmipc_device_t *dev = test_device();
  const size_t n = 8192;
  uint8_t *p = NULL;
  ASSERT_OK(usmipc_malloc(dev, USMIPC_MEM_DEVICE, n, (void **)&p));
  dev_fill(p, n, 9, 0);

  /* An interior pointer is refused, and the allocation survives it. */
  ASSERT_ERR2(usmipc_free(p + 1), USMIPC_EINVAL, USMIPC_EUNKNOWNPTR);
  ASSERT_ERR2(usmipc_free(p + n - 1), USMIPC_EINVAL, USMIPC_EUNKNOWNPTR);
  usmipc_pointer_info_t info;
  ASSERT_OK(usmipc_pointer_query(p, &info));
  ASSERT_PATTERN(p, n, 9, 0);

  /* Memory usmipc never allocated. */
  int on_stack;
  void *on_heap = malloc(32);
  ASSERT_ERR(usmipc_free(&on_stack), USMIPC_EUNKNOWNPTR);
  ASSERT_ERR(usmipc_free(on_heap), USMIPC_EUNKNOWNPTR);
  free(on_heap);

  /* free(NULL) is a no-op, as with free(3). */
  ASSERT_OK(usmipc_free(NULL));

  ASSERT_OK(usmipc_free(p));
  /* Double free. */
  ASSERT_ERR2(usmipc_free(p), USMIPC_EUNKNOWNPTR, USMIPC_EINVAL);
  return 0;
}

TEST_IMPL(memory_malloc_bad_args) {
  usmipc_device_t *dev = test_device();
  void *p = (void *)1;
  ASSERT_ERR(usmipc_malloc(dev, USMIPC_MEM_DEVICE, 0, &p), USMIPC_EINVAL);
  ASSERT_PTR_EQ(p, NULL); /* *ptr is cleared on failure */
  ASSERT_ERR(usmipc_malloc(dev, USMIPC_MEM_HOST, 0, &p), USMIPC_EINVAL);
  ASSERT_ERR(usmipc_malloc(dev, USMIPC_MEM_DEVICE, 16, NULL), USMIPC_EINVAL);
  ASSERT_ERR(usmipc_malloc(NULL, USMIPC_MEM_DEVICE, 16, &p), USMIPC_EINVAL);
  ASSERT_ERR(usmipc_malloc(dev, USMIPC_MEM_UNKNOWN, 16, &p), USMIPC_EINVAL);
  ASSERT_ERR(usmipc_malloc(dev, (usmipc_mem_kind_t)99, 16, &p), USMIPC_EINVAL);
  ASSERT_ERR3(usmipc_malloc(dev, USMIPC_MEM_DEVICE, SIZE_MAX, &p),
              USMIPC_ENOMEM, USMIPC_EINVAL, USMIPC_ERANGE);
  ASSERT_ERR3(usmipc_malloc(dev, USMIPC_MEM_HOST, SIZE_MAX / 2, &p),
              USMIPC_ENOMEM, USMIPC_EINVAL, USMIPC_ERANGE);
  ASSERT_ERR(usmipc_malloc_flags(dev, USMIPC_MEM_DEVICE, 16, 0x80, &p),
             USMIPC_EINVAL);
  ASSERT_ERR(usmipc_malloc_flags(dev, USMIPC_MEM_DEVICE, 16,
                                 USMIPC_ALLOC_IPC_FD | USMIPC_ALLOC_IPC_NATIVE,
                                 &p),
             USMIPC_EINVAL);
  /* Flags a backend has no choice for are accepted and ignored; CUDA
   * honours them, and refuses USMIPC_ALLOC_IPC_FD on a GPU or driver that
   * cannot export memory as POSIX descriptors. */
  static const unsigned ipc_flags[] = {USMIPC_ALLOC_IPC_FD,
                                       USMIPC_ALLOC_IPC_NATIVE};
  for (size_t i = 0; i < 2; i++) {
    p = NULL;
    test_error_sentinel();
    int r = usmipc_malloc_flags(dev, USMIPC_MEM_DEVICE, 16, ipc_flags[i], &p);
    if (r == USMIPC_ENOTSUP && ipc_flags[i] == USMIPC_ALLOC_IPC_FD &&
        usmipc_device_backend(dev) == USMIPC_BACKEND_CUDA) {
      test_check_error(__FILE__, __LINE__, "usmipc_malloc_flags(IPC_FD)", r,
                       USMIPC_ENOTSUP, USMIPC_ENOTSUP, USMIPC_ENOTSUP);
      continue;
    }
    ASSERT_MSG(r == 0, "usmipc_malloc_flags(0x%x): %s: %s", ipc_flags[i],
               usmipc_err_name(r), usmipc_last_error());
    ASSERT_OK(usmipc_free(p));
  }
  return 0;
}

#define THREADS 4
#define ROUNDS 200

static uint64_t thread_ids[THREADS][ROUNDS];

static int threads_on_host;

static void *alloc_thread(void *arg) {
  int t = (int)(intptr_t)arg;
  usmipc_device_t *dev = test_device();
  /* Elsewhere than on the host, device memory is written through a queue
   * (this thread's own); host memory is the CPU's on every backend. */
  usmipc_queue_t *q = NULL;
  if (!threads_on_host)
    ASSERT_OK(usmipc_queue_create(dev, &q));
  for (int i = 0; i < ROUNDS; i++) {
    void *p = NULL;
    size_t n = 4096 * (size_t)(1 + (i + t) % 5);
    usmipc_mem_kind_t kind = kinds[i % 3];
    ASSERT_OK(usmipc_malloc(dev, kind, n, &p));
    usmipc_pointer_info_t info;
    ASSERT_OK(usmipc_pointer_query((uint8_t *)p + n - 1, &info));
    ASSERT_PTR_EQ(info.base, p);
    ASSERT_EQ(info.size, n);
    ASSERT_EQ(info.kind, kind);
    thread_ids[t][i] = info.buffer_id;
    if (threads_on_host || kind == USMIPC_MEM_HOST) {
      ((uint8_t *)p)[0] = (uint8_t)t; /* plain access */
    } else {
      ASSERT_OK(usmipc_memset(q, p, t, 1));
      ASSERT_OK(usmipc_queue_synchronize(q));
    }
    ASSERT_OK(usmipc_free(p));
  }
  if (q != NULL)
    ASSERT_OK(usmipc_queue_destroy(q));
  return NULL;
}

TEST_IMPL(memory_threads) {
  threads_on_host = test_device_is_host();
  pthread_t th[THREADS];
  for (int t = 0; t < THREADS; t++)
    ASSERT_EQ(pthread_create(&th[t], NULL, alloc_thread, (void *)(intptr_t)t),
              0);
  for (int t = 0; t < THREADS; t++)
    ASSERT_EQ(pthread_join(th[t], NULL), 0);
  /* Every id unique across threads: sort and look for neighbours. */
  static uint64_t all[THREADS * ROUNDS];
  memcpy(all, thread_ids, sizeof(all));
  for (size_t i = 1; i < THREADS * ROUNDS; i++) { /* insertion sort, 800 */
    uint64_t v = all[i];
    size_t j = i;
    while (j > 0 && all[j - 1] > v) {
      all[j] = all[j - 1];
      j--;
    }
    all[j] = v;
  }
  for (size_t i = 1; i < THREADS * ROUNDS; i++)
    ASSERT_UNE(all[i], all[i - 1]);
  return 0;
}
