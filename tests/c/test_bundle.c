/* Bundles: many arrays in one handoff, opened by an unrelated process (the
 * bundle_reader helper), on the device under test. */
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "objects.h" /* usmipc__crc32c, to forge valid bytes */
#include "task.h"

#define MiB ((size_t)1 << 20)

/* ---- the reader: a process of its own that opens what it is sent --------
 * Requests: u8 op, u32 code, u32 len, len bytes. 'O' opens the bundle and
 * checks every array against pattern seed (index + 1) over its extent, then
 * writes seed 500 over array 0; 'E' expects the open to fail with code; 'C'
 * closes what was opened; 'Q' quits. Release tickets: 'W' opens the bundle,
 * writes seed 700 + index over every array and returns the ticket; 'R' only
 * returns it; both after the work on the reader's queue when code is 1,
 * else from the host, and reply with usmipc_ipc_release's code. Reply: 7
 * u64: status (0 ok, else the usmipc code or -1 wrong data), arrays,
 * allocations, driver imports and descriptors taken so far, nodes, broker
 * round trips so far. */
static void reply(int64_t status, size_t arrays, size_t allocs, size_t nodes) {
  usmipc_stats_t s;
  usmipc_get_stats(&s, sizeof(s));
  uint64_t r[7] = {(uint64_t)status,
                   arrays,
                   allocs,
                   s.driver_imports,
                   s.descriptors_received,
                   nodes,
                   s.transport_exchanges};
  if (write(1, r, sizeof(r)) != (ssize_t)sizeof(r))
    _exit(5);
}

/* The reader's queue for 'W' and 'R' (code 1): NULL where the device has
 * no events, so that the ticket goes back from the host. */
static usmipc_queue_t *reader_queue(void) {
  static usmipc_queue_t *q;
  usmipc_event_t *probe;
  if (q == NULL && usmipc_event_create(test_device(), 0, &probe) == 0) {
    usmipc_event_destroy(probe);
    if (usmipc_queue_create(test_device(), &q) != 0)
      _exit(6);
  }
  return q;
}

HELPER_IMPL(bundle_reader) {
  (void)argc;
  (void)argv;
  usmipc_opened_bundle_t *opened[16];
  int nopen = 0;
  for (;;) {
    uint8_t op;
    uint32_t code, len;
    if (read_full(0, &op, 1) || read_full(0, &code, 4) || read_full(0, &len, 4))
      return 1;
    uint8_t *data = malloc(len ? len : 1);
    if (data == NULL || read_full(0, data, len))
      return 2;
    if (op == 'Q') {
      free(data);
      return 0;
    }
    if (op == 'C') {
      for (int i = 0; i < nopen; i++)
        usmipc_bundle_close(opened[i]);
      nopen = 0;
      reply(0, 0, 0, 0);
    } else if (op == 'R') {
      int r = usmipc_ipc_release(data, len, code ? reader_queue() : NULL);
      PROBE_ERR("reader 'R': usmipc_ipc_release", r);
      fprintf(stderr, "reader: release: %d %s\n", r,
              r ? usmipc_last_error() : "");
      reply(r, 0, 0, 0);
    } else if (op == 'W') {
      usmipc_queue_t *q = code ? reader_queue() : NULL;
      usmipc_opened_bundle_t *ob;
      int r = usmipc_bundle_open(data, len, test_device(), q, 0, &ob);
      size_t narr = 0;
      if (r == 0) {
        const usmipc_bundle_array_t *a = usmipc_opened_bundle_arrays(ob, &narr);
        for (size_t i = 0; i < narr; i++)
          if (a[i].extent > 0) {
            if (q != NULL)
              dev_fill_on(q, a[i].ptr, a[i].extent, 700 + i, 0);
            else
              dev_fill(a[i].ptr, a[i].extent, 700 + i, 0);
          }
        opened[nopen++] = ob;
        r = usmipc_ipc_release(data, len, q);
      }
      if (r != 0) {
        PROBE_ERR("reader 'W': usmipc_bundle_open, usmipc_ipc_release", r);
        fprintf(stderr, "reader: %s\n", usmipc_last_error());
      }
      reply(r, narr, 0, 0);
    } else if (op == 'E') {
      usmipc_opened_bundle_t *ob = NULL;
      int r = usmipc_bundle_open(data, len, test_device(), NULL, 0, &ob);
      if (r == 0)
        usmipc_bundle_close(ob);
      PROBE_ERR("reader 'E': usmipc_bundle_open", r);
      fprintf(stderr, "reader: expected %d, got %d: %s\n", (int)code, r,
              r ? usmipc_last_error() : "");
      reply(r == (int)code ? 0 : (r == 0 ? -2 : r), 0, 0, 0);
    } else {
      usmipc_opened_bundle_t *ob;
      int r = usmipc_bundle_open(data, len, test_device(), NULL, 0, &ob);
      if (r != 0) {
        PROBE_ERR("reader 'O': usmipc_bundle_open", r);
        fprintf(stderr, "reader: %s\n", usmipc_last_error());
        reply(r, 0, 0, 0);
      } else {
        size_t narr, nnode, nseg = 0;
        const usmipc_bundle_array_t *a = usmipc_opened_bundle_arrays(ob, &narr);
        usmipc_opened_bundle_nodes(ob, &nnode);
        usmipc_bundle_inspect(data, len, NULL, &nseg);
        int64_t status = 0;
        for (size_t i = 0; i < narr; i++)
          if (a[i].extent > 0 &&
              dev_check(a[i].ptr, a[i].extent, i + 1, 0) != SIZE_MAX)
            status = -1;
        if (narr > 0 && a[0].extent > 0)
          dev_fill(a[0].ptr, a[0].extent, 500, 0);
        opened[nopen++] = ob;
        reply(status, narr, nseg, nnode);
      }
    }
    free(data);
  }
}

typedef struct reader {
  pid_t pid;
  int to, from;
} reader_t;

static void reader_start_env(reader_t *r, const char *const env[]) {
  r->pid = spawn_helper("bundle_reader", NULL, env, &r->to, &r->from);
}

static void reader_start(reader_t *r) { reader_start_env(r, NULL); }

static void reader_send(reader_t *r, char op, uint32_t code, const void *data,
                        size_t len, uint64_t out[7]) {
  uint32_t l = (uint32_t)len;
  ASSERT_EQ(write(r->to, &op, 1), 1);
  ASSERT_EQ(write(r->to, &code, 4), 4);
  ASSERT_EQ(write(r->to, &l, 4), 4);
  if (len > 0)
    ASSERT_EQ(write(r->to, data, len), (ssize_t)len);
  if (out != NULL)
    ASSERT_EQ(read_full(r->from, out, 7 * sizeof(uint64_t)), 0);
}

static void reader_stop(reader_t *r) {
  reader_send(r, 'Q', 0, NULL, 0, NULL);
  ASSERT_EQ(exit_code_of(wait_pid_timeout(r->pid, 20)), 0);
  close(r->to);
  close(r->from);
}

/* Fills each array's extent with pattern seed (index + 1). */
static void fill_arrays(void *const *ptr, const size_t *extent, size_t n) {
  for (size_t i = 0; i < n; i++)
    if (extent[i] > 0)
      dev_fill(ptr[i], extent[i], i + 1, 0);
}

/* A nested tree over pool blocks and plain allocations:
 *   {"weights": [a0 (f32 16x16), a1 (bf16 strided view 8x4 of 8x8)],
 *    "meta": (a2 (i64, 0-d), a3 (f16 0x5, no memory)),
 *    "": {"ü": a4 (bool 3)}, "big": a5 (u8 in its own allocation)} */
TEST_IMPL(bundle_cross_process) {
  usmipc_device_t *dev = test_device();
  usmipc_pool_t *pool;
  ASSERT_OK(usmipc_pool_create(dev, 0, 0, &pool));
  void *ptr[6];
  size_t extent[6] = {16 * 16 * 4, (7 * 8 + 3 * 2 + 1) * 2, 8, 0, 3, MiB};
  ASSERT_OK(usmipc_pool_malloc(pool, extent[0], 0, &ptr[0]));
  ASSERT_OK(usmipc_pool_malloc(pool, 8 * 8 * 2, 0, &ptr[1]));
  ASSERT_OK(usmipc_pool_malloc(pool, 8, 0, &ptr[2]));
  ptr[3] = NULL;
  ASSERT_OK(usmipc_pool_malloc(pool, 3, 0, &ptr[4]));
  ASSERT_OK(usmipc_malloc(dev, USMIPC_MEM_DEVICE, MiB, &ptr[5]));
  fill_arrays(ptr, extent, 6);

  int64_t s0[] = {16, 16}, s1[] = {8, 4}, st1[] = {8, 2}, s3[] = {0, 5},
          s4[] = {3}, s5[] = {(int64_t)MiB};
  usmipc_array_desc_t d0 = {2, 32, 1, 2, s0, NULL}, d1 = {4, 16, 1, 2, s1, st1},
                      d2 = {0, 64, 1, 0, NULL, NULL},
                      d3 = {2, 16, 1, 2, s3, NULL}, d4 = {6, 8, 1, 1, s4, NULL},
                      d5 = {1, 8, 1, 1, s5, NULL};
  usmipc_bundle_t *b;
  ASSERT_OK(usmipc_bundle_create(&b));
  ASSERT_OK(usmipc_bundle_add_container(b, USMIPC_BUNDLE_DICT, 4, NULL, 0));
  ASSERT_OK(
      usmipc_bundle_add_container(b, USMIPC_BUNDLE_LIST, 2, "weights", 7));
  ASSERT_OK(usmipc_bundle_add_array(b, NULL, 0, ptr[0], &d0));
  ASSERT_OK(usmipc_bundle_add_array(b, NULL, 0, ptr[1], &d1));
  ASSERT_OK(usmipc_bundle_add_container(b, USMIPC_BUNDLE_TUPLE, 2, "meta", 4));
  ASSERT_OK(usmipc_bundle_add_array(b, NULL, 0, ptr[2], &d2));
  ASSERT_OK(usmipc_bundle_add_array(b, NULL, 0, ptr[3], &d3));
  ASSERT_OK(usmipc_bundle_add_container(b, USMIPC_BUNDLE_DICT, 1, "", 0));
  ASSERT_OK(usmipc_bundle_add_array(b, "\xc3\xbc", 2, ptr[4], &d4));
  ASSERT_ERR(usmipc_bundle_finish(b), USMIPC_EINVAL); /* one child missing */
  ASSERT_OK(usmipc_bundle_add_array(b, "big", 3, ptr[5], &d5));
  ASSERT_ERR(usmipc_bundle_add_array(b, "more", 4, ptr[5], &d5),
             USMIPC_EINVAL); /* the tree is complete */
  usmipc_bundle_free(b);

  /* Again, cleanly (a failed add poisons a bundle). */
  ASSERT_OK(usmipc_bundle_create(&b));
  ASSERT_OK(usmipc_bundle_add_container(b, USMIPC_BUNDLE_DICT, 4, NULL, 0));
  ASSERT_OK(
      usmipc_bundle_add_container(b, USMIPC_BUNDLE_LIST, 2, "weights", 7));
  ASSERT_OK(usmipc_bundle_add_array(b, NULL, 0, ptr[0], &d0));
  ASSERT_OK(usmipc_bundle_add_array(b, NULL, 0, ptr[1], &d1));
  ASSERT_OK(usmipc_bundle_add_container(b, USMIPC_BUNDLE_TUPLE, 2, "meta", 4));
  ASSERT_OK(usmipc_bundle_add_array(b, NULL, 0, ptr[2], &d2));
  ASSERT_OK(usmipc_bundle_add_array(b, NULL, 0, ptr[3], &d3));
  ASSERT_OK(usmipc_bundle_add_container(b, USMIPC_BUNDLE_DICT, 1, "", 0));
  ASSERT_OK(usmipc_bundle_add_array(b, "\xc3\xbc", 2, ptr[4], &d4));
  ASSERT_OK(usmipc_bundle_add_array(b, "big", 3, ptr[5], &d5));
  ASSERT_OK(usmipc_bundle_finish(b));
  size_t narr, nseg;
  ASSERT_OK(usmipc_bundle_counts(b, &narr, &nseg));
  ASSERT_EQ(narr, 6);
  ASSERT_EQ(nseg, 2); /* the pool's segment and the plain allocation */
  const void *data;
  size_t len;
  ASSERT_OK(usmipc_bundle_data(b, &data, &len));
  size_t i_arr, i_seg;
  ASSERT_OK(usmipc_bundle_inspect(data, len, &i_arr, &i_seg));
  ASSERT_EQ(i_arr, 6);
  ASSERT_EQ(i_seg, 2);

  /* Opened here (an alias of the memory) and described exactly. */
  usmipc_opened_bundle_t *ob;
  ASSERT_OK(usmipc_bundle_open(data, len, dev, NULL, 0, &ob));
  size_t n;
  const usmipc_bundle_node_t *nodes = usmipc_opened_bundle_nodes(ob, &n);
  ASSERT_EQ(n, 10);
  ASSERT_EQ(nodes[0].kind, USMIPC_BUNDLE_DICT);
  ASSERT_EQ(nodes[0].count, 4);
  ASSERT_EQ(nodes[1].kind, USMIPC_BUNDLE_LIST);
  ASSERT_EQ(nodes[1].key_len, 7);
  ASSERT(memcmp(nodes[1].key, "weights", 7) == 0);
  ASSERT_EQ(nodes[7].kind, USMIPC_BUNDLE_DICT);
  ASSERT_NOT_NULL(nodes[7].key);
  ASSERT_EQ(nodes[7].key_len, 0);
  ASSERT_EQ(nodes[8].kind, USMIPC_BUNDLE_ARRAY);
  ASSERT_EQ(nodes[8].count, 4);
  const usmipc_bundle_array_t *a = usmipc_opened_bundle_arrays(ob, &n);
  ASSERT_EQ(n, 6);
  for (size_t i = 0; i < 6; i++) {
    ASSERT_PTR_EQ(a[i].ptr, ptr[i]);
    ASSERT_EQ(a[i].extent, extent[i]);
  }
  ASSERT_EQ(a[1].desc.dtype_code, 4);
  ASSERT_EQ(a[1].desc.strides[0], 8);
  ASSERT_EQ(a[1].desc.strides[1], 2);
  ASSERT_EQ(a[0].desc.strides[0], 16); /* filled in: C-contiguous */
  ASSERT_EQ(a[2].desc.ndim, 0);
  ASSERT_OK(usmipc_bundle_close(ob));

  /* Another process: the data, the tree, one import per allocation; a
   * second open of the same bytes and a re-finished bundle cost nothing. */
  size_t fds0 = count_fds();
  reader_t r;
  reader_start(&r);
  uint64_t out[7];
  reader_send(&r, 'O', 0, data, len, out);
  ASSERT_EQ((int64_t)out[0], 0);
  ASSERT_UEQ(out[1], 6);
  ASSERT_UEQ(out[2], 2);
  ASSERT_UEQ(out[5], 10);
  ASSERT_UEQ(out[3], 2); /* driver imports */
  uint64_t descs = out[4];
  ASSERT_PATTERN(ptr[0], extent[0], 500, 0); /* written back */
  reader_send(&r, 'O', 0, data, len, out);
  ASSERT_EQ((int64_t)out[0], -1); /* array 0 now holds seed 500 */
  ASSERT_UEQ(out[3], 2);
  ASSERT_UEQ(out[4], descs);
  reader_send(&r, 'C', 0, NULL, 0, out);
  fill_arrays(ptr, extent, 1);
  usmipc_bundle_t *b2;
  ASSERT_OK(usmipc_bundle_create(&b2));
  ASSERT_OK(usmipc_bundle_add_container(b2, USMIPC_BUNDLE_LIST, 2, NULL, 0));
  ASSERT_OK(usmipc_bundle_add_array(b2, NULL, 0, ptr[0], &d0));
  ASSERT_OK(usmipc_bundle_add_array(b2, NULL, 0, ptr[1], &d1));
  ASSERT_OK(usmipc_bundle_finish(b2));
  const void *data2;
  size_t len2;
  ASSERT_OK(usmipc_bundle_data(b2, &data2, &len2));
  reader_send(&r, 'O', 0, data2, len2, out);
  ASSERT_EQ((int64_t)out[0], 0);
  ASSERT_UEQ(out[3], 2); /* the segment was mapped (kept in the cache) */
  ASSERT_UEQ(out[4], descs);
  reader_send(&r, 'C', 0, NULL, 0, out);

  /* Freed: the bytes are refused, though the memory still lives. */
  uint8_t *kept = malloc(len2);
  memcpy(kept, data2, len2);
  data2 = kept;
  usmipc_bundle_free(b2);
  reader_send(&r, 'E', USMIPC_EEXPORTERGONE, data2, len2, out);
  ASSERT_EQ((int64_t)out[0], 0);
  reader_send(&r, 'E', USMIPC_EEXPORTERGONE, data2, len2, out);
  ASSERT_EQ((int64_t)out[0], 0);
  reader_stop(&r);
  free(kept);
  ASSERT_EQ(count_fds_settled(fds0), fds0);
  usmipc_bundle_free(b);
  for (int i = 0; i < 6; i++)
    if (ptr[i] != NULL)
      ASSERT_OK(usmipc_free(ptr[i]));
  ASSERT_OK(usmipc_pool_destroy(pool));
  return 0;
}

/* Rewrites the checksum, so that a forgery gets past it to the check it
 * means to test. */
static void reseal(uint8_t *p, size_t len) {
  usmipc__put32le(p + len - 4, usmipc__crc32c(0, p, len - 4));
}

/* Bad input at both ends, each with its own error. */
TEST_IMPL(bundle_refused) {
  usmipc_device_t *dev = test_device();
  void *mem;
  ASSERT_OK(usmipc_malloc(dev, USMIPC_MEM_DEVICE, 4096, &mem));
  int64_t shape[] = {1024};
  usmipc_array_desc_t f32 = {2, 32, 1, 1, shape, NULL};
  usmipc_bundle_t *b;
  /* The producer's mistakes. */
  ASSERT_ERR(usmipc_bundle_create(NULL), USMIPC_EINVAL);
  ASSERT_OK(usmipc_bundle_create(&b));
  ASSERT_ERR(usmipc_bundle_finish(b), USMIPC_EINVAL); /* empty */
  ASSERT_ERR(usmipc_bundle_add_container(b, USMIPC_BUNDLE_ARRAY, 1, NULL, 0),
             USMIPC_EINVAL);
  usmipc_bundle_free(b);
  struct {
    usmipc_array_desc_t d;
    const void *ptr;
    int code;
  } bad[] = {
      {{3, 64, 1, 1, shape, NULL}, mem, USMIPC_EINVAL}, /* opaque handle */
      {{2, 24, 1, 1, shape, NULL}, mem, USMIPC_EINVAL}, /* 24-bit float */
      {{2, 32, 4, 1, shape, NULL}, mem, USMIPC_EINVAL}, /* lanes */
      {{2, 32, 1, 33, shape, NULL}, mem, USMIPC_EINVAL},
      {{2, 32, 1, 1, (int64_t[]){1025}, NULL}, mem, USMIPC_ERANGE},
      {{2, 32, 1, 1, (int64_t[]){2}, (int64_t[]){-1}}, mem, USMIPC_EINVAL},
      {{2, 32, 1, 1, shape, NULL}, (uint8_t *)mem + 8, USMIPC_ERANGE},
      {{2, 32, 1, 1, shape, NULL}, &shape, USMIPC_EUNKNOWNPTR},
  };
  for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
    ASSERT_OK(usmipc_bundle_create(&b));
    ASSERT_ERR(usmipc_bundle_add_array(b, NULL, 0, bad[i].ptr, &bad[i].d),
               bad[i].code);
    ASSERT_ERR(usmipc_bundle_finish(b), bad[i].code); /* poisoned */
    usmipc_bundle_free(b);
  }
  ASSERT_OK(usmipc_bundle_create(&b));
  ASSERT_OK(usmipc_bundle_add_container(b, USMIPC_BUNDLE_LIST, 1, NULL, 0));
  ASSERT_ERR(usmipc_bundle_add_array(b, "k", 1, mem, &f32), USMIPC_EINVAL);
  usmipc_bundle_free(b);
  ASSERT_OK(usmipc_bundle_create(&b));
  ASSERT_OK(usmipc_bundle_add_container(b, USMIPC_BUNDLE_DICT, 1, NULL, 0));
  ASSERT_ERR(usmipc_bundle_add_array(b, "\xff", 1, mem, &f32), USMIPC_EINVAL);
  usmipc_bundle_free(b);
  if (test_device_is_host()) { /* host memory is not device memory */
    void *hostmem;
    ASSERT_OK(usmipc_malloc(dev, USMIPC_MEM_HOST, 4096, &hostmem));
    ASSERT_OK(usmipc_bundle_create(&b));
    ASSERT_ERR(usmipc_bundle_add_array(b, NULL, 0, hostmem, &f32),
               USMIPC_EMEMKIND);
    usmipc_bundle_free(b);
    ASSERT_OK(usmipc_free(hostmem));
  }

  /* The consumer's: forged bytes. A good bundle of {"x": array}. */
  ASSERT_OK(usmipc_bundle_create(&b));
  ASSERT_OK(usmipc_bundle_add_container(b, USMIPC_BUNDLE_DICT, 1, NULL, 0));
  ASSERT_OK(usmipc_bundle_add_array(b, "x", 1, mem, &f32));
  ASSERT_OK(usmipc_bundle_finish(b));
  const void *data;
  size_t len;
  ASSERT_OK(usmipc_bundle_data(b, &data, &len));
  uint8_t *p = malloc(len);
  usmipc_opened_bundle_t *ob;
  for (size_t cut = 0; cut < len; cut += 7) /* truncated */
    ASSERT_ERR(usmipc_bundle_open(data, cut, dev, NULL, 0, &ob),
               USMIPC_EBADHANDLE);
  memcpy(p, data, len);
  p[100] ^= 1; /* corrupted */
  ASSERT_ERR(usmipc_bundle_open(p, len, dev, NULL, 0, &ob), USMIPC_EBADHANDLE);
  ASSERT(strstr(usmipc_last_error(), "checksum") != NULL);
  /* The array's offset beyond its allocation (checksum fixed up): the
   * array record sits after the header and the one allocation's handle. */
  size_t arr_at = 64 + 2 + usmipc__get16le((const uint8_t *)data + 64);
  memcpy(p, data, len);
  usmipc__put64le(p + arr_at + 8, 8);
  reseal(p, len);
  ASSERT_ERR(usmipc_bundle_open(p, len, dev, NULL, 0, &ob), USMIPC_EBADHANDLE);
  ASSERT(strstr(usmipc_last_error(), "overruns") != NULL);
  memcpy(p, data, len);
  usmipc__put32le(p + arr_at, 1); /* allocation 1 of 1 */
  reseal(p, len);
  ASSERT_ERR(usmipc_bundle_open(p, len, dev, NULL, 0, &ob), USMIPC_EBADHANDLE);
  memcpy(p, data, len);
  p[arr_at + 24] = 0xff; /* shape 1024 -> huge */
  reseal(p, len);
  ASSERT_ERR(usmipc_bundle_open(p, len, dev, NULL, 0, &ob), USMIPC_EBADHANDLE);
  memcpy(p, data, len);
  p[8] = 9; /* a later version */
  reseal(p, len);
  ASSERT_ERR(usmipc_bundle_open(p, len, dev, NULL, 0, &ob),
             USMIPC_EHANDLEVERSION);
  memcpy(p, data, len);
  p[len - 4 - 1 - 8] = 3; /* the array node becomes a tuple node */
  reseal(p, len);
  ASSERT_ERR(usmipc_bundle_open(p, len, dev, NULL, 0, &ob), USMIPC_EBADHANDLE);
  /* A token that is not the bundle's: refused by the slot check, in
   * another process as in this one. */
  memcpy(p, data, len);
  p[32] ^= 0x55;
  reseal(p, len);
  ASSERT_ERR(usmipc_bundle_open(p, len, dev, NULL, 0, &ob),
             USMIPC_EEXPORTERGONE);
  reader_t r;
  uint64_t out[7];
  reader_start(&r);
  reader_send(&r, 'E', USMIPC_EEXPORTERGONE, p, len, out);
  ASSERT_EQ((int64_t)out[0], 0);
  reader_send(&r, 'O', 0, data, len, out);
  ASSERT_EQ((int64_t)out[0], -1); /* opens (the data has no pattern) */
  reader_send(&r, 'C', 0, NULL, 0, out);
  reader_stop(&r);
  /* Handle bytes are not bundle bytes, and the other way round. */
  usmipc_ipc_handle_t *h;
  ASSERT_OK(usmipc_ipc_get_handle(mem, 0, &h));
  const void *hd;
  size_t hl;
  ASSERT_OK(usmipc_ipc_handle_data(h, &hd, &hl));
  ASSERT_ERR(usmipc_bundle_open(hd, hl, dev, NULL, 0, &ob), USMIPC_EBADHANDLE);
  ASSERT(strstr(usmipc_last_error(), "usmipc_ipc_open") != NULL);
  void *m;
  ASSERT_ERR(usmipc_ipc_open(data, len, dev, 0, &m, NULL), USMIPC_EBADHANDLE);
  usmipc_ipc_free_handle(h);
  free(p);
  usmipc_bundle_free(b);
  ASSERT_OK(usmipc_free(mem));
  return 0;
}

/* A bundle's own slot (offset 24) past the export table, checksum fixed
 * up: refused as bad bytes by inspect and by an open in another process,
 * which used to read outside its mapping of the producer's table (SIGSEGV
 * for 0xFFFFFFF0). The table reader bounds every slot itself too, so that
 * no caller can forget: the same slots read from this process's own table
 * are refused, not read. */
TEST_IMPL(bundle_slot_out_of_range) {
  usmipc_device_t *dev = test_device();
  void *mem;
  ASSERT_OK(usmipc_malloc(dev, USMIPC_MEM_DEVICE, 4096, &mem));
  int64_t shape[] = {1024};
  usmipc_array_desc_t f32 = {2, 32, 1, 1, shape, NULL};
  usmipc_bundle_t *b;
  ASSERT_OK(usmipc_bundle_create(&b));
  ASSERT_OK(usmipc_bundle_add_array(b, NULL, 0, mem, &f32));
  ASSERT_OK(usmipc_bundle_finish(b));
  const void *data;
  size_t len;
  ASSERT_OK(usmipc_bundle_data(b, &data, &len));
  uint8_t *p = malloc(len);
  const uint32_t slots[] = {USMIPC__TABLE_SLOTS, 0x00100005u, 0xFFFFFFF0u,
                            UINT32_MAX - 1};
  reader_t r;
  uint64_t out[7];
  reader_start(&r);
  for (size_t i = 0; i < sizeof(slots) / sizeof(slots[0]); i++) {
    memcpy(p, data, len);
    usmipc__put32le(p + 24, slots[i]);
    reseal(p, len);
    size_t narr = 9, nseg = 9;
    ASSERT_ERR(usmipc_bundle_inspect(p, len, &narr, &nseg), USMIPC_EBADHANDLE);
    ASSERT(strstr(usmipc_last_error(), "slot") != NULL);
    ASSERT(strstr(usmipc_last_error(), "export table") != NULL);
    usmipc_opened_bundle_t *ob = NULL;
    ASSERT_ERR(usmipc_bundle_open(p, len, dev, NULL, 0, &ob),
               USMIPC_EBADHANDLE);
    ASSERT(ob == NULL);
    reader_send(&r, 'E', USMIPC_EBADHANDLE, p, len, out); /* alive after */
    ASSERT_EQ((int64_t)out[0], 0);
  }
  /* The array node's array index (the node before the checksum): only 0
   * follows, in a bundle of one array. */
  const uint32_t indexes[] = {1, 0x00100005u, 0xFFFFFFF0u};
  for (size_t i = 0; i < sizeof(indexes) / sizeof(indexes[0]); i++) {
    memcpy(p, data, len);
    usmipc__put32le(p + len - 4 - 8 + 4, indexes[i]);
    reseal(p, len);
    ASSERT_ERR(usmipc_bundle_inspect(p, len, NULL, NULL), USMIPC_EBADHANDLE);
    ASSERT(strstr(usmipc_last_error(), "out of order") != NULL);
  }
  reader_send(&r, 'O', 0, data, len, out); /* the honest bytes still open */
  ASSERT_EQ((int64_t)out[0], -1);          /* (no pattern in the memory) */
  reader_send(&r, 'C', 0, NULL, 0, out);
  reader_stop(&r);

  /* The reader itself, on this process's table as an importer maps it. */
  int fd = usmipc__exports_table_fd();
  ASSERT(fd >= 0);
  const uint8_t *table =
      mmap(NULL, USMIPC__TABLE_BYTES, PROT_READ, MAP_SHARED, fd, 0);
  ASSERT(table != MAP_FAILED);
  usmipc__export_slot_t s;
  uint32_t seq = 7;
  ASSERT_OK(usmipc__table_read_slot(table, USMIPC__TABLE_SLOTS - 1, &s, &seq));
  for (size_t i = 0; i < sizeof(slots) / sizeof(slots[0]); i++) {
    ASSERT_ERR(usmipc__table_read_slot(table, slots[i], &s, &seq),
               USMIPC_EBADHANDLE);
    ASSERT(strstr(usmipc_last_error(), "beyond") != NULL);
    ASSERT((usmipc__table_slot_seq(table, slots[i]) & 1) != 0); /* "busy" */
  }
  munmap((void *)table, USMIPC__TABLE_BYTES);
  free(p);
  usmipc_bundle_free(b);
  ASSERT_OK(usmipc_free(mem));
  return 0;
}

/* Bundle bytes naming n allocations of one exporter that is not there (a
 * pid no process has), one 0-d uint8 array in each, under a list: the
 * bytes issue 21 timed (65,536 allocations, 14.3 MB). The buffer ids are
 * multiples of 2^40, so that every low bit a naive hash would index by is
 * 0: they all collide. *len gets the length; free() the bytes. */
static uint8_t *many_allocations(const uint8_t *model, uint32_t n,
                                 size_t *len) {
  const uint8_t *h = model + 64 + 2; /* the model's one allocation */
  size_t hlen = usmipc__get16le(model + 64);
  size_t total = 64 + n * (2 + hlen) + n * 24u + 8 + n * 8u + 4;
  uint8_t *p = calloc(1, total);
  if (p == NULL)
    return NULL;
  memcpy(p, model, 64);
  usmipc__put32le(p + 12, (uint32_t)total);
  usmipc__put32le(p + 48, n);
  usmipc__put32le(p + 52, n);
  usmipc__put32le(p + 56, n + 1);
  usmipc__put32le(p + 60, 0);
  size_t at = 64;
  for (uint32_t i = 0; i < n; i++) {
    usmipc__put16le(p + at, (uint16_t)hlen);
    uint8_t *q = p + at + 2;
    memcpy(q, h, hlen);
    usmipc__put32le(q + 24, 0x3fffff00u); /* pid: no process */
    usmipc__put64le(q + 112, (uint64_t)(i + 1) << 40);
    usmipc__put32le(q + hlen - 4, usmipc__crc32c(0, q, hlen - 4));
    at += 2 + hlen;
  }
  for (uint32_t i = 0; i < n; i++, at += 24) {
    usmipc__put32le(p + at, i); /* allocation i, offset 0 */
    p[at + 4] = 1;              /* uint8, one lane, 0-d */
    p[at + 5] = 8;
    usmipc__put16le(p + at + 6, 1);
  }
  p[at] = USMIPC_BUNDLE_LIST;
  usmipc__put32le(p + at + 4, n);
  at += 8;
  for (uint32_t i = 0; i < n; i++, at += 8) {
    p[at] = USMIPC_BUNDLE_ARRAY;
    usmipc__put32le(p + at + 4, i);
  }
  usmipc__put32le(p + at, usmipc__crc32c(0, p, at));
  *len = total;
  return p;
}

/* This thread's CPU time: the machine is shared, and a call that spans
 * several time slices would otherwise be charged its neighbours' turns. */
static double seconds_now(void) {
  struct timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

/* The best of 5 runs of one call on the bytes, in CPU time (the best run
 * is the call's cost; the others also pay for cache misses the neighbours
 * caused); stops early once a run is hopeless. Each run starts with the caches
 * cold, as for bytes just received: else a small bundle, read from the cache,
 * would look cheaper per allocation than a large one read from memory. */
static double best_seconds(int which, const uint8_t *p, size_t len,
                           int *codes) {
  static uint8_t *evict;
  const size_t evict_len = 64 * MiB;
  if (evict == NULL && (evict = malloc(evict_len)) == NULL)
    return 1e9;
  double best = 1e9;
  for (int run = 0; run < 5; run++) {
    memset(evict, run, evict_len);
    usmipc_opened_bundle_t *ob = NULL;
    double t0 = seconds_now();
    int rc = which == 0   ? usmipc_bundle_inspect(p, len, NULL, NULL)
             : which == 1 ? usmipc_bundle_open(p, len, NULL, NULL, 0, &ob)
                          : usmipc_ipc_release(p, len, NULL);
    double t = seconds_now() - t0;
    if (ob != NULL)
      usmipc_bundle_close(ob);
    codes[which] = rc;
    best = t < best ? t : best;
    if (t > 2.0)
      break;
  }
  return best;
}

/* Decoding is O(S log S) in the allocations S: the duplicate check used to
 * compare every pair (9-10 s for 65,536 allocations in each of inspect,
 * open and release). Now each of them decodes or refuses those bytes in
 * under 100 ms, and the time per allocation at 65,536 is within 3x of that
 * at 4,096. A quadratic check is 16x there; log S alone is 1.33x, and the
 * 14 MB of the large bytes miss the caches that the 230 KB of the small
 * ones fit in, which measured 1.5-2.0x on a busy CI machine (2.02x once, in
 * open: 101 against 204 ns), so 2x was a bound on the machine's load. */
TEST_IMPL(bundle_decode_linear) {
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  RETURN_SKIP("a timing test: the sanitizers' cost is not the decoder's");
#endif
  usmipc_device_t *dev = test_device();
  void *mem;
  ASSERT_OK(usmipc_malloc(dev, USMIPC_MEM_DEVICE, 4096, &mem));
  usmipc_array_desc_t u8 = {1, 8, 1, 0, NULL, NULL};
  usmipc_bundle_t *b;
  ASSERT_OK(usmipc_bundle_create(&b));
  ASSERT_OK(usmipc_bundle_add_array(b, NULL, 0, mem, &u8));
  ASSERT_OK(usmipc_bundle_finish(b));
  const void *model;
  size_t model_len;
  ASSERT_OK(usmipc_bundle_data(b, &model, &model_len));
  const char *what[3] = {"inspect", "open", "release"};
  double per[2][3];
  const uint32_t sizes[2] = {4096, 65536};
  for (int k = 0; k < 2; k++) {
    size_t len;
    uint8_t *p = many_allocations(model, sizes[k], &len);
    ASSERT_NOT_NULL(p);
    if (k == 1)
      ASSERT_MSG(len > 14000000, "%zu bytes", len); /* issue 21: 14.3 MB */
    int codes[3] = {1, 1, 1};
    for (int which = 0; which < 3; which++) {
      double t = best_seconds(which, p, len, codes);
      per[k][which] = t / sizes[k];
      fprintf(stderr, "%s of %u allocations: %.1f ms (%d %s)\n", what[which],
              sizes[k], t * 1e3, codes[which], usmipc_err_name(codes[which]));
      if (k == 1)
        ASSERT(t < 0.100);
    }
    ASSERT_EQ(codes[0], 0);                    /* good bytes */
    ASSERT_EQ(codes[1], USMIPC_EEXPORTERGONE); /* of no process */
    ASSERT_EQ(codes[2], USMIPC_EINVAL);        /* no ticket in them */
    if (k == 0) { /* the duplicate check still finds the first repeat */
      size_t hlen = usmipc__get16le(p + 64);
      uint8_t *h[4];
      for (int j = 0; j < 4; j++) /* allocations 3, 9, 7 and 4000 */
        h[j] = p + 64 + (size_t)(uint32_t[]){3, 9, 7, 4000}[j] * (2 + hlen) + 2;
      for (int j = 1; j < 4; j++) {
        memcpy(h[j] + 112, h[0] + 112, 8); /* allocation 3's buffer id */
        if (j == 3)
          h[j][32] ^= 1; /* on another device: another allocation */
        usmipc__put32le(h[j] + hlen - 4, usmipc__crc32c(0, h[j], hlen - 4));
      }
      reseal(p, len);
      ASSERT_ERR(usmipc_bundle_inspect(p, len, NULL, NULL), USMIPC_EBADHANDLE);
      ASSERT_MSG(strstr(usmipc_last_error(), "allocations 3 and 7 are the "
                                             "same") != NULL,
                 "%s", usmipc_last_error());
    }
    free(p);
  }
  for (int which = 0; which < 3; which++) {
    fprintf(stderr, "%s: %.0f ns per allocation at 4096, %.0f at 65536\n",
            what[which], per[0][which] * 1e9, per[1][which] * 1e9);
    ASSERT(per[1][which] < 3 * per[0][which]);
  }
  usmipc_bundle_free(b);
  ASSERT_OK(usmipc_free(mem));
  return 0;
}

/* A mapping's reference count does not wrap: a bundle takes one reference
 * per array on its allocations' mappings (usmipc__mapping_addref), so about
 * 4,096 opens of a bundle of 2^20 arrays in one allocation used to wrap its
 * 32-bit count, and the next close unmapped memory still in use. The test
 * hook starts the count of another process's allocation mapped here at
 * 2^32 - 1 (those 4,096 opens), and at the 64-bit limit, where a further
 * reference is refused with a message. */
TEST_IMPL(bundle_mapping_refs_do_not_wrap) {
  agent_t ex;
  agent_start(&ex, NULL);
  AGENT_OK(&ex, "alloc 0 device 65536");
  AGENT_OK(&ex, "fill 0 13");
  AGENT_OK(&ex, "export 0 0 0");
  uint8_t h[1024];
  ssize_t hlen = hex_decode(ex.reply, h, sizeof(h));
  ASSERT_GT(hlen, 0);
  ASSERT_OK(usmipc_ipc_set_cache_size(0)); /* unmapped when unused */
  void *m = NULL;
  ASSERT_OK(usmipc_ipc_open(h, (size_t)hlen, test_device(), 0, &m, NULL));
  uint64_t refs = 0, set = UINT32_MAX;
  ASSERT_OK(usmipc__mapping_refs_for_test(m, &set, NULL));
  ASSERT_OK(usmipc__mapping_addref(m, 2)); /* two more arrays */
  ASSERT_OK(usmipc__mapping_refs_for_test(m, NULL, &refs));
  ASSERT_MSG(refs == ((uint64_t)1 << 32) + 1, "the count wrapped to %llu",
             (unsigned long long)refs);
  ASSERT_OK(usmipc_ipc_close(m)); /* one of 2^32 + 1 */
  ASSERT_OK(usmipc__mapping_refs_for_test(m, NULL, &refs));
  ASSERT(refs == (uint64_t)1 << 32);
  ASSERT_PATTERN(m, 65536, 13, 0); /* still mapped, the exporter's bytes */

  /* At the limit of the count: refused, and the count is kept. */
  set = UINT64_MAX - 1;
  ASSERT_OK(usmipc__mapping_refs_for_test(m, &set, NULL));
  ASSERT_ERR(usmipc__mapping_addref(m, 2), USMIPC_EBUSY);
  ASSERT(strstr(usmipc_last_error(), "references") != NULL);
  ASSERT_OK(usmipc__mapping_refs_for_test(m, NULL, &refs));
  ASSERT(refs == UINT64_MAX - 1);
  ASSERT_OK(usmipc__mapping_addref(m, 1));

  set = 1; /* the one close left unmaps it */
  ASSERT_OK(usmipc__mapping_refs_for_test(m, &set, NULL));
  ASSERT_OK(usmipc_ipc_close(m));
  ASSERT_ERR(usmipc__mapping_refs_for_test(m, NULL, &refs), USMIPC_ENOTMAPPED);
  ASSERT_ERR(usmipc_ipc_close(m), USMIPC_ENOTMAPPED);
  agent_stop_ok(&ex);
  return 0;
}

/* Bundle bytes of no memory: `levels` nested lists, the innermost empty. */
static size_t nested_lists(uint8_t *p, uint32_t levels) {
  size_t len = 64 + 8u * levels + 4;
  memset(p, 0, len);
  memcpy(p, "\x89USMIPCB", 8);
  usmipc__put16le(p + 8, 1);
  usmipc__put32le(p + 12, (uint32_t)len);
  usmipc__put32le(p + 24, UINT32_MAX); /* no slot */
  usmipc__put32le(p + 56, levels);
  for (uint32_t i = 0; i < levels; i++) {
    p[64 + 8 * i] = USMIPC_BUNDLE_LIST;
    usmipc__put32le(p + 64 + 8 * i + 4, i + 1 < levels ? 1 : 0);
  }
  reseal(p, len);
  return len;
}

/* Adds `containers` nested lists, then an array (or, with mem NULL, an
 * empty list) inside the innermost. */
static int nest(uint32_t containers, void *mem, usmipc_bundle_t **out) {
  usmipc_array_desc_t u8 = {1, 8, 1, 0, NULL, NULL};
  int rc = usmipc_bundle_create(out);
  for (uint32_t i = 0; rc == 0 && i < containers; i++)
    rc = usmipc_bundle_add_container(*out, USMIPC_BUNDLE_LIST, 1, NULL, 0);
  if (rc == 0)
    rc = mem != NULL ? usmipc_bundle_add_array(*out, NULL, 0, mem, &u8)
                     : usmipc_bundle_add_container(*out, USMIPC_BUNDLE_LIST, 0,
                                                   NULL, 0);
  return rc == 0 ? usmipc_bundle_finish(*out) : rc;
}

/* One depth limit with one meaning on both sides, as share() has it: a
 * tree is at most 64 levels deep, the root at level 1, an array or an empty
 * container counting as a level like any node. The decoder used to accept
 * 65 levels when the innermost container was empty, and the C producer a
 * 65th level of an array inside 64 containers. */
/* Keys are checked eight ASCII bytes at a time: every kind of non-ASCII
 * byte, at every place around the word edges, is still judged alone. */
TEST_IMPL(bundle_key_utf8) {
  static const struct {
    const char *seq;
    bool ok;
  } cases[] = {
      {"\xc3\xa9", true},          /* U+00E9 */
      {"\xe2\x82\xac", true},      /* U+20AC */
      {"\xf0\x9f\x98\x80", true},  /* U+1F600 */
      {"\xff", false},             /* never in UTF-8 */
      {"\x80", false},             /* a lone continuation byte */
      {"\xc0\xaf", false},         /* overlong '/' */
      {"\xed\xa0\x80", false},     /* a surrogate */
      {"\xf4\x90\x80\x80", false}, /* past U+10FFFF */
      {"\xc3", false},             /* cut short */
      {"\xe2\x82", false},         /* cut short */
  };
  uint8_t buf[40];
  for (size_t len = 0; len <= 24; len++) { /* ASCII alone, any length */
    memset(buf, 'a', len);
    ASSERT_MSG(usmipc__utf8_valid(buf, len), "%zu ASCII bytes", len);
  }
  for (size_t c = 0; c < sizeof(cases) / sizeof(cases[0]); c++) {
    size_t k = strlen(cases[c].seq);
    for (size_t at = 0; at <= 18; at++)
      for (size_t tail = 0; tail <= 9; tail++) {
        memset(buf, 'k', sizeof(buf));
        memcpy(buf + at, cases[c].seq, k);
        size_t len = at + k + tail;
        bool want = cases[c].ok;
        ASSERT_MSG(usmipc__utf8_valid(buf, len) == want,
                   "case %zu at %zu with %zu bytes after: want %d", c, at, tail,
                   (int)want);
        /* cut inside the sequence: never valid (for k > 1) */
        if (k > 1)
          ASSERT_MSG(!usmipc__utf8_valid(buf, at + k - 1),
                     "case %zu cut at %zu", c, at + k - 1);
      }
  }
  return 0;
}

TEST_IMPL(bundle_depth_one_limit) {
  void *mem;
  ASSERT_OK(usmipc_malloc(test_device(), USMIPC_MEM_DEVICE, 4096, &mem));
  usmipc_bundle_t *b;
  for (int leaf = 0; leaf < 2; leaf++) {
    void *m = leaf ? mem : NULL;
    ASSERT_OK(nest(63, m, &b)); /* 64 levels */
    const void *data;
    size_t len;
    ASSERT_OK(usmipc_bundle_data(b, &data, &len));
    ASSERT_OK(usmipc_bundle_inspect(data, len, NULL, NULL));
    usmipc_bundle_free(b);
    ASSERT_ERR(nest(64, m, &b), USMIPC_EINVAL); /* 65 */
    ASSERT_MSG(strstr(usmipc_last_error(), "deeper than 64 levels") != NULL,
               "%s", usmipc_last_error());
    usmipc_bundle_free(b);
  }
  uint8_t p[64 + 8 * 80 + 4];
  size_t len = nested_lists(p, 64);
  usmipc_opened_bundle_t *ob;
  ASSERT_OK(usmipc_bundle_open(p, len, NULL, NULL, 0, &ob));
  size_t n;
  usmipc_opened_bundle_nodes(ob, &n);
  ASSERT_EQ(n, 64);
  usmipc_bundle_close(ob);
  /* A container claiming more children than nodes follow it. */
  len = nested_lists(p, 3);
  usmipc__put32le(p + 64 + 4, 5);
  reseal(p, len);
  ASSERT_ERR(usmipc_bundle_inspect(p, len, NULL, NULL), USMIPC_EBADHANDLE);
  ASSERT_MSG(strstr(usmipc_last_error(), "node 0 claims 5 children, more "
                                         "than the nodes left") != NULL,
             "%s", usmipc_last_error());
  for (uint32_t levels = 65; levels <= 80; levels += 15) {
    len = nested_lists(p, levels);
    ASSERT_ERR(usmipc_bundle_inspect(p, len, NULL, NULL), USMIPC_EBADHANDLE);
    ASSERT_MSG(strstr(usmipc_last_error(), "node 64: the tree is nested "
                                           "deeper than 64 levels") != NULL,
               "%s", usmipc_last_error());
  }
  ASSERT_OK(usmipc_free(mem));
  return 0;
}

/* Many arrays over few allocations: 10,000 pool blocks in one bundle open
 * with one import per segment. */
TEST_IMPL(bundle_ten_thousand_arrays) {
  usmipc_device_t *dev = test_device();
  usmipc_pool_t *pool;
  ASSERT_OK(usmipc_pool_create(dev, 0, 0, &pool));
  enum { N = 10000 };
  void **ptr = calloc(N, sizeof(void *));
  size_t *extent = calloc(N, sizeof(size_t));
  usmipc_bundle_t *b;
  ASSERT_OK(usmipc_bundle_create(&b));
  ASSERT_OK(usmipc_bundle_add_container(b, USMIPC_BUNDLE_DICT, N, NULL, 0));
  for (int i = 0; i < N; i++) {
    int64_t shape[1] = {1 + i % 300};
    usmipc_array_desc_t d = {1, 8, 1, 1, shape, NULL};
    extent[i] = (size_t)shape[0];
    ASSERT_OK(usmipc_pool_malloc(pool, extent[i], 0, &ptr[i]));
    char key[32];
    int kl = snprintf(key, sizeof(key), "layers.%d.weight", i);
    ASSERT_OK(usmipc_bundle_add_array(b, key, (size_t)kl, ptr[i], &d));
  }
  fill_arrays(ptr, extent, N);
  ASSERT_OK(usmipc_bundle_finish(b));
  size_t nseg;
  ASSERT_OK(usmipc_bundle_counts(b, NULL, &nseg));
  ASSERT_EQ(nseg, 1);
  const void *data;
  size_t len;
  ASSERT_OK(usmipc_bundle_data(b, &data, &len));
  reader_t r;
  uint64_t out[7];
  reader_start(&r);
  double t0 = now_seconds();
  reader_send(&r, 'O', 0, data, len, out);
  double took = now_seconds() - t0;
  ASSERT_EQ((int64_t)out[0], 0);
  ASSERT_UEQ(out[1], N);
  ASSERT_UEQ(out[3], 1);
  reader_send(&r, 'C', 0, NULL, 0, out);
  reader_stop(&r);
  fprintf(stderr, "10,000 arrays, %zu bytes: opened and checked in %.1f ms\n",
          len, took * 1e3);
  usmipc_bundle_free(b);
  for (int i = 0; i < N; i++)
    ASSERT_OK(usmipc_free(ptr[i]));
  free(ptr);
  free(extent);
  ASSERT_OK(usmipc_pool_destroy(pool));
  return 0;
}

/* Allocations in any address order: each array lands in its own
 * allocation's segment, and arrays added again over them (interior ranges,
 * another order) find those segments instead of adding new ones. The
 * by-base order is kept by bisection and one memmove per new allocation
 * (descending order, as mmap places each new mapping below the last, was
 * quadratic step by step). */
TEST_IMPL(bundle_allocation_order) {
  usmipc_device_t *dev = test_device();
  enum { N = 200, CHUNK = 4096 };
  void *ptr[N];
  for (int i = 0; i < N; i++)
    ASSERT_OK(usmipc_malloc(dev, USMIPC_MEM_DEVICE, CHUNK, &ptr[i]));
  /* By address, ascending; then each order is a permutation of it. */
  for (int i = 1; i < N; i++)
    for (int j = i; j > 0 && (uintptr_t)ptr[j - 1] > (uintptr_t)ptr[j]; j--) {
      void *t = ptr[j];
      ptr[j] = ptr[j - 1];
      ptr[j - 1] = t;
    }
  int order[3][N];
  uint32_t x = 12345;
  for (int i = 0; i < N; i++) {
    order[0][i] = i;         /* ascending */
    order[1][i] = N - 1 - i; /* descending */
    order[2][i] = i;
  }
  for (int i = N - 1; i > 0; i--) { /* shuffled */
    x = x * 1103515245u + 12345u;
    int j = (int)(x % (uint32_t)(i + 1)), t = order[2][i];
    order[2][i] = order[2][j];
    order[2][j] = t;
  }
  for (int o = 0; o < 3; o++) {
    usmipc_bundle_t *b;
    ASSERT_OK(usmipc_bundle_create(&b));
    ASSERT_OK(
        usmipc_bundle_add_container(b, USMIPC_BUNDLE_LIST, 2 * N, NULL, 0));
    int64_t whole[1] = {CHUNK}, part[1] = {CHUNK / 4};
    usmipc_array_desc_t dw = {1, 8, 1, 1, whole, NULL},
                        dp = {1, 8, 1, 1, part, NULL};
    for (int i = 0; i < N; i++)
      ASSERT_OK(usmipc_bundle_add_array(b, NULL, 0, ptr[order[o][i]], &dw));
    /* Again, interior ranges, in the reverse of this order. */
    for (int i = N - 1; i >= 0; i--)
      ASSERT_OK(usmipc_bundle_add_array(
          b, NULL, 0, (uint8_t *)ptr[order[o][i]] + CHUNK / 2, &dp));
    ASSERT_OK(usmipc_bundle_finish(b));
    size_t narr, nseg;
    ASSERT_OK(usmipc_bundle_counts(b, &narr, &nseg));
    ASSERT_EQ(narr, 2 * N);
    ASSERT_EQ(nseg, N);
    const void *data;
    size_t len;
    ASSERT_OK(usmipc_bundle_data(b, &data, &len));
    usmipc_opened_bundle_t *ob;
    ASSERT_OK(usmipc_bundle_open(data, len, dev, NULL, 0, &ob));
    size_t n;
    const usmipc_bundle_array_t *a = usmipc_opened_bundle_arrays(ob, &n);
    ASSERT_EQ(n, 2 * N);
    for (int i = 0; i < N; i++) {
      ASSERT_PTR_EQ(a[i].ptr, ptr[order[o][i]]);
      ASSERT_PTR_EQ(a[2 * N - 1 - i].ptr,
                    (uint8_t *)ptr[order[o][i]] + CHUNK / 2);
    }
    ASSERT_OK(usmipc_bundle_close(ob));
    usmipc_bundle_free(b);
  }
  for (int i = 0; i < N; i++)
    ASSERT_OK(usmipc_free(ptr[i]));
  return 0;
}

/* The descriptors of all allocations move in one exchange with the
 * exporter's broker (the socket transport, where each would otherwise take
 * a round trip of its own): 300 allocations, one bundle. */
TEST_IMPL(bundle_one_exchange) {
  usmipc_device_t *dev = test_device();
  enum { N = 300 };
  void *ptr[N];
  size_t extent[N];
  usmipc_bundle_t *b;
  ASSERT_OK(usmipc_bundle_create(&b));
  ASSERT_OK(usmipc_bundle_add_container(b, USMIPC_BUNDLE_LIST, N, NULL, 0));
  for (int i = 0; i < N; i++) {
    int64_t shape[1] = {4096};
    usmipc_array_desc_t d = {1, 8, 1, 1, shape, NULL};
    extent[i] = 4096;
    ASSERT_OK(usmipc_malloc(dev, USMIPC_MEM_DEVICE, 4096, &ptr[i]));
    ASSERT_OK(usmipc_bundle_add_array(b, NULL, 0, ptr[i], &d));
  }
  fill_arrays(ptr, extent, N);
  ASSERT_OK(usmipc_bundle_finish(b));
  const void *data;
  size_t len;
  ASSERT_OK(usmipc_bundle_data(b, &data, &len));
  size_t fds0 = count_fds();
  reader_t r;
  uint64_t out[7];
  const char *env[] = {"USMIPC_FD_TRANSPORT=socket", NULL};
  reader_start_env(&r, env);
  reader_send(&r, 'O', 0, data, len, out);
  ASSERT_EQ((int64_t)out[0], 0);
  if (out[4] > 0) { /* fd memory (the host's memfds, CUDA fd memory) */
    ASSERT_UEQ(out[4], N);
    /* The proof of the exporter (first contact) and the 300 descriptors
     * in two requests: 253 + 47. */
    ASSERT_LE(out[6], 3);
  }
  uint64_t exchanges = out[6];
  fprintf(stderr,
          "%d allocations: %llu descriptors in %llu broker round trips\n", N,
          (unsigned long long)out[4], (unsigned long long)exchanges);
  reader_send(&r, 'O', 0, data, len, out); /* cached: nothing moves */
  ASSERT_EQ((int64_t)out[0], -1); /* array 0 holds the write-back now */
  ASSERT_UEQ(out[6], exchanges);
  reader_send(&r, 'C', 0, NULL, 0, out);
  reader_stop(&r);
  ASSERT_EQ(count_fds_settled(fds0), fds0);
  usmipc_bundle_free(b);
  for (int i = 0; i < N; i++)
    ASSERT_OK(usmipc_free(ptr[i]));
  return 0;
}

/* One bundle of one array of `elements` 8-byte elements of mem: made,
 * opened, closed, freed. */
static int bundle_cycle(void *mem, int64_t elements) {
  int64_t shape[1] = {elements};
  usmipc_array_desc_t d = {1, 8, 1, 1, shape, NULL};
  usmipc_bundle_t *b;
  const void *data;
  size_t len;
  usmipc_opened_bundle_t *ob;
  int rc = usmipc_bundle_create(&b);
  if (rc != 0)
    return rc;
  if ((rc = usmipc_bundle_add_array(b, NULL, 0, mem, &d)) == 0 &&
      (rc = usmipc_bundle_finish(b)) == 0 &&
      (rc = usmipc_bundle_data(b, &data, &len)) == 0 &&
      (rc = usmipc_bundle_open(data, len, NULL, NULL, 0, &ob)) == 0)
    rc = usmipc_bundle_close(ob);
  int freed = usmipc_bundle_free(b);
  return rc != 0 ? rc : freed;
}

static void bundle_fork_step(void *mem) { (void)bundle_cycle(mem, 64); }

/* The child makes, opens and frees a bundle of memory of its own. */
static int bundle_fork_child(void *dev) {
  void *own;
  int rc = usmipc_malloc(dev, USMIPC_MEM_DEVICE, 4096, &own);
  return rc != 0 ? rc : bundle_cycle(own, 16);
}

/* fork() while another thread makes and frees bundles: every child can make,
 * open and free a bundle of its own (none inherits a lock held). */
TEST_IMPL(bundle_fork_from_thread) {
  RETURN_SKIP_UNLESS_FORK_BESIDE_THREAD_TESTS();
  usmipc_device_t *dev = test_device();
  void *mem;
  ASSERT_OK(usmipc_malloc(dev, USMIPC_MEM_DEVICE, 4096, &mem));
  fork_beside_thread(bundle_fork_step, mem, 200, bundle_fork_child, dev);
  ASSERT_OK(usmipc_free(mem));
  return 0;
}

/* ---- release tickets ------------------------------------------------------
 * A bundle ordered with USMIPC_ORDER_RELEASE ends with its ticket record
 * (0x8003: u64 release id, u64 ticket, 16-byte token) right before the
 * checksum, so a forgery flips bytes counted from the end. */
#define TICKET_AT(len) ((len)-4 - 4 - USMIPC__RELEASE_RECORD_LEN)
#define TICKET_NUMBER_AT(len) (TICKET_AT(len) + 4 + 8)
#define TICKET_TOKEN_AT(len) (TICKET_AT(len) + 4 + 16)

/* A queue of the device under test where it has events (handoffs are then
 * ordered and tickets carry the consumer's event), else NULL. */
static usmipc_queue_t *events_queue(void) {
  usmipc_event_t *probe;
  usmipc_queue_t *q = NULL;
  int rc = usmipc_event_create(test_device(), 0, &probe);
  if (rc == USMIPC_ENOTSUP)
    return NULL;
  ASSERT_OK(rc);
  usmipc_event_destroy(probe);
  ASSERT_OK(usmipc_queue_create(test_device(), &q));
  return q;
}

/* The bytes of the bundle's next handoff, copied (the bundle rewrites its
 * own at every order). */
static uint8_t *handoff(usmipc_bundle_t *b, usmipc_queue_t *q, unsigned flags,
                        size_t *len) {
  const void *data;
  ASSERT_OK(usmipc_bundle_order_ex(b, q, flags));
  ASSERT_OK(usmipc_bundle_data(b, &data, len));
  uint8_t *copy = malloc(*len);
  ASSERT_NOT_NULL(copy);
  memcpy(copy, data, *len);
  return copy;
}

#define ASSERT_RELEASES(b, s, r)                                               \
  do {                                                                         \
    uint64_t sent_, back_;                                                     \
    ASSERT_OK(usmipc_bundle_releases((b), &sent_, &back_));                    \
    ASSERT_UEQ(sent_, (s));                                                    \
    ASSERT_UEQ(back_, (r));                                                    \
  } while (0)

typedef struct waiter {
  usmipc_bundle_t *b;
  usmipc_queue_t *q;
  int rc;
  int done; /* atomic */
} waiter_t;

static void *wait_released_thread(void *arg) {
  waiter_t *w = arg;
  w->rc = usmipc_bundle_wait_released(w->b, w->q);
  __atomic_store_n(&w->done, 1, __ATOMIC_RELEASE);
  return NULL;
}

/* Three arrays over two allocations, {"a", "b", "c"}, each filled with
 * pattern seed index + 1. */
static usmipc_bundle_t *three_arrays(void *ptr[3], size_t extent[3]) {
  usmipc_device_t *dev = test_device();
  ASSERT_OK(usmipc_malloc(dev, USMIPC_MEM_DEVICE, 8192, &ptr[0]));
  ASSERT_OK(usmipc_malloc(dev, USMIPC_MEM_DEVICE, 4096, &ptr[2]));
  ptr[1] = (uint8_t *)ptr[0] + 4096;
  int64_t shape[] = {1024};
  usmipc_array_desc_t f32 = {2, 32, 1, 1, shape, NULL};
  usmipc_bundle_t *b;
  ASSERT_OK(usmipc_bundle_create(&b));
  ASSERT_OK(usmipc_bundle_add_container(b, USMIPC_BUNDLE_DICT, 3, NULL, 0));
  for (int i = 0; i < 3; i++) {
    extent[i] = 4096;
    ASSERT_OK(usmipc_bundle_add_array(b, &"abc"[i], 1, ptr[i], &f32));
  }
  fill_arrays(ptr, extent, 3);
  ASSERT_OK(usmipc_bundle_finish(b));
  return b;
}

/* Frees what three_arrays allocated, and the events queue. */
static void three_arrays_free(void *ptr[3], usmipc_queue_t *q) {
  ASSERT_OK(usmipc_free(ptr[0]));
  ASSERT_OK(usmipc_free(ptr[2]));
  if (q != NULL)
    ASSERT_OK(usmipc_queue_destroy(q));
}

/* A consumer in another process writes into every array and returns the
 * ticket; the producer's wait ends only then, and sees the writes. Tickets
 * come back once each; forged, unasked-for and late ones are refused. */
/* The opens keep the decoded trees of the last bundles (templates,
 * bundle.c): another handoff of the same tree opens from one, and is still
 * checked wherever it differs, as a decode checks it. In another process:
 * handoffs of one bundle, opened and written in turn with those of a
 * second bundle of the same keys (the list holds both), each writing where
 * its own arrays are; between them, bytes of a handoff whose records are
 * corrupted (checksum), forged (resealed: the records' check) or whose
 * tree is edited (resealed: the decoder), each refused, after which the
 * honest bytes still open. */
TEST_IMPL(bundle_template_opens) {
  usmipc_queue_t *q = events_queue();
  void *pa[3], *pb[3];
  size_t ea[3], eb[3];
  usmipc_bundle_t *a = three_arrays(pa, ea), *b = three_arrays(pb, eb);
  reader_t r;
  uint64_t out[7];
  reader_start(&r);
  for (int round = 0; round < 4; round++) {
    for (int which = 0; which < 2; which++) {
      usmipc_bundle_t *bb = which ? b : a;
      void **p = which ? pb : pa;
      size_t *e = which ? eb : ea;
      for (int i = 0; i < 3; i++)
        dev_fill(p[i], e[i], 1, 0);
      size_t len;
      uint8_t *h = handoff(bb, q, USMIPC_ORDER_RELEASE, &len);
      if (round > 0 && which == 0) {
        uint8_t *f = malloc(len);
        ASSERT_NOT_NULL(f);
        memcpy(f, h, len);
        f[TICKET_TOKEN_AT(len)] ^= 1; /* a record corrupted */
        reader_send(&r, 'E', USMIPC_EBADHANDLE, f, len, out);
        ASSERT_EQ((int64_t)out[0], 0);
        memcpy(f, h, len);
        f[TICKET_AT(len)] = 0x77; /* a record of no known type */
        reseal(f, len);
        reader_send(&r, 'E', USMIPC_EBADHANDLE, f, len, out);
        ASSERT_EQ((int64_t)out[0], 0);
        size_t arr_at = 64 + 2 + usmipc__get16le(h + 64) + 2 +
                        usmipc__get16le(h + 64 + 2 + usmipc__get16le(h + 64));
        memcpy(f, h, len);
        f[arr_at + 30] = 0xff; /* the first array's shape: huge */
        reseal(f, len);
        reader_send(&r, 'E', USMIPC_EBADHANDLE, f, len, out);
        ASSERT_EQ((int64_t)out[0], 0);
        free(f);
      }
      reader_send(&r, 'W', q != NULL, h, len, out);
      ASSERT_EQ((int64_t)out[0], 0);
      ASSERT_UEQ(out[1], 3);
      ASSERT_OK(usmipc_bundle_wait_released(bb, q));
      if (q != NULL)
        ASSERT_OK(usmipc_queue_synchronize(q));
      for (int i = 0; i < 3; i++)
        ASSERT_PATTERN(p[i], e[i], 700 + i, 0);
      free(h);
    }
    reader_send(&r, 'C', 0, NULL, 0, out);
  }
  reader_stop(&r);
  usmipc_bundle_free(a);
  usmipc_bundle_free(b);
  three_arrays_free(pa, NULL);
  three_arrays_free(pb, q);
  return 0;
}

/* The decoded trees the opens keep: only of a bundle opened before (a
 * bundle opened once is never kept), at most 4, and a tree whose decode
 * holds more than 16 MiB (here 200,000 arrays over one allocation) is
 * decoded at each open instead of kept, leaving the others in place. */
TEST_IMPL(bundle_templates_bounded) {
  usmipc_device_t *dev = test_device();
  void *mem;
  ASSERT_OK(usmipc_malloc(dev, USMIPC_MEM_DEVICE, 4096, &mem));
  int64_t one[] = {1};
  usmipc_array_desc_t u8 = {1, 8, 1, 1, one, NULL};
  size_t before = usmipc__bundle_templates_for_test(NULL);
  for (int i = 0; i < 6; i++) { /* distinct trees: keys differ */
    usmipc_bundle_t *b;
    ASSERT_OK(usmipc_bundle_create(&b));
    ASSERT_OK(usmipc_bundle_add_container(b, USMIPC_BUNDLE_DICT, 1, NULL, 0));
    char key[8];
    snprintf(key, sizeof(key), "k%d", i);
    ASSERT_OK(usmipc_bundle_add_array(b, key, strlen(key), mem, &u8));
    ASSERT_OK(usmipc_bundle_finish(b));
    const void *data;
    size_t len;
    ASSERT_OK(usmipc_bundle_data(b, &data, &len));
    usmipc_opened_bundle_t *ob;
    size_t was = usmipc__bundle_templates_for_test(NULL);
    ASSERT_OK(usmipc_bundle_open(data, len, dev, NULL, 0, &ob));
    ASSERT_OK(usmipc_bundle_close(ob));
    /* Opened once: a bundle made per message is never kept. */
    ASSERT_UEQ(usmipc__bundle_templates_for_test(NULL), was);
    ASSERT_OK(usmipc_bundle_open(data, len, dev, NULL, 0, &ob));
    ASSERT_OK(usmipc_bundle_close(ob));
    size_t held = usmipc__bundle_templates_for_test(NULL);
    ASSERT_UEQ(held, before + i + 1 < 4 ? before + i + 1 : 4);
    usmipc_bundle_free(b);
  }
  size_t bytes_before;
  ASSERT_UEQ(usmipc__bundle_templates_for_test(&bytes_before), 4);
  usmipc_bundle_t *big;
  ASSERT_OK(usmipc_bundle_create(&big));
  const uint32_t n = 200000;
  ASSERT_OK(usmipc_bundle_add_container(big, USMIPC_BUNDLE_LIST, n, NULL, 0));
  for (uint32_t i = 0; i < n; i++)
    ASSERT_OK(
        usmipc_bundle_add_array(big, NULL, 0, (uint8_t *)mem + i % 4096, &u8));
  ASSERT_OK(usmipc_bundle_finish(big));
  const void *data;
  size_t len;
  ASSERT_OK(usmipc_bundle_data(big, &data, &len));
  for (int k = 0; k < 2; k++) {
    usmipc_opened_bundle_t *ob;
    ASSERT_OK(usmipc_bundle_open(data, len, dev, NULL, 0, &ob));
    size_t narr;
    const usmipc_bundle_array_t *a = usmipc_opened_bundle_arrays(ob, &narr);
    ASSERT_UEQ(narr, n);
    ASSERT(a[n - 1].ptr == (uint8_t *)a[0].ptr + (n - 1) % 4096);
    ASSERT_OK(usmipc_bundle_close(ob));
    size_t bytes;
    ASSERT_UEQ(usmipc__bundle_templates_for_test(&bytes), 4);
    ASSERT_UEQ(bytes, bytes_before); /* not kept; the others stay */
  }
  usmipc_bundle_free(big);
  ASSERT_OK(usmipc_free(mem));
  return 0;
}

TEST_IMPL(bundle_release_cross_process) {
  usmipc_queue_t *q = events_queue();
  void *ptr[3];
  size_t extent[3];
  usmipc_bundle_t *b = three_arrays(ptr, extent);
  size_t len_a;
  uint8_t *a = handoff(b, q, USMIPC_ORDER_RELEASE, &len_a);
  ASSERT_RELEASES(b, 1, 0);
  /* Out and not back: a short event timeout ends the wait, saying so. */
  ASSERT_OK(usmipc_event_set_timeout(300));
  ASSERT_ERR(usmipc_bundle_wait_released(b, NULL), USMIPC_ETIMEDOUT);
  ASSERT_MSG(strstr(usmipc_last_error(), "0 of 1") != NULL, "%s",
             usmipc_last_error());

  /* The wait (without limit) is still waiting while the consumer has not
   * returned the ticket, and ends once it has. */
  ASSERT_OK(usmipc_event_set_timeout(0));
  reader_t r;
  uint64_t out[7];
  reader_start(&r);
  waiter_t w = {.b = b, .q = q};
  pthread_t t;
  ASSERT_EQ(pthread_create(&t, NULL, wait_released_thread, &w), 0);
  usleep(200 * 1000);
  ASSERT_EQ(__atomic_load_n(&w.done, __ATOMIC_ACQUIRE), 0);
  reader_send(&r, 'W', 1, a, len_a, out);
  ASSERT_EQ((int64_t)out[0], 0);
  ASSERT_UEQ(out[1], 3);
  pthread_join(t, NULL);
  ASSERT_OK(w.rc);
  if (q != NULL)
    ASSERT_OK(usmipc_queue_synchronize(q));
  for (int i = 0; i < 3; i++)
    ASSERT_PATTERN(ptr[i], extent[i], 700 + i, 0);
  ASSERT_RELEASES(b, 1, 1);
  /* Returning it again counts once. */
  reader_send(&r, 'R', 1, a, len_a, out);
  ASSERT_EQ((int64_t)out[0], 0);
  ASSERT_RELEASES(b, 1, 1);
  ASSERT_OK(usmipc_bundle_wait_released(b, q));

  /* Three handoffs out, two back (one twice): the wait names the count. */
  size_t len_b, len_c;
  uint8_t *hb = handoff(b, q, USMIPC_ORDER_RELEASE, &len_b);
  uint8_t *hc = handoff(b, NULL, USMIPC_ORDER_RELEASE, &len_c);
  ASSERT_RELEASES(b, 3, 1);
  reader_send(&r, 'R', 0, hb, len_b, out);
  ASSERT_EQ((int64_t)out[0], 0);
  reader_send(&r, 'R', 1, hb, len_b, out);
  ASSERT_EQ((int64_t)out[0], 0);
  ASSERT_RELEASES(b, 3, 2);
  ASSERT_OK(usmipc_event_set_timeout(300));
  ASSERT_ERR(usmipc_bundle_wait_released(b, q), USMIPC_ETIMEDOUT);
  ASSERT_MSG(strstr(usmipc_last_error(), "2 of 3") != NULL, "%s",
             usmipc_last_error());

  /* Forged: a wrong token, a ticket never handed out. */
  uint8_t *f = malloc(len_c);
  memcpy(f, hc, len_c);
  f[TICKET_TOKEN_AT(len_c)] ^= 1;
  reseal(f, len_c);
  reader_send(&r, 'R', 0, f, len_c, out);
  ASSERT_EQ((int64_t)out[0], USMIPC_EACCES);
  memcpy(f, hc, len_c);
  usmipc__put64le(f + TICKET_NUMBER_AT(len_c), 99);
  reseal(f, len_c);
  reader_send(&r, 'R', 0, f, len_c, out);
  ASSERT_EQ((int64_t)out[0], USMIPC_EBADHANDLE);
  ASSERT_RELEASES(b, 3, 2);
  reader_send(&r, 'R', 0, hc, len_c, out);
  ASSERT_EQ((int64_t)out[0], 0);
  ASSERT_OK(usmipc_bundle_wait_released(b, q));
  ASSERT_RELEASES(b, 3, 3);

  /* Bytes that ask for no release. */
  size_t len_d;
  uint8_t *hd = handoff(b, q, 0, &len_d);
  reader_send(&r, 'R', 0, hd, len_d, out);
  ASSERT_EQ((int64_t)out[0], USMIPC_EINVAL);
  ASSERT_RELEASES(b, 3, 3);

  /* The producer freed the bundle: nobody waits for its tickets. */
  ASSERT_OK(usmipc_bundle_free(b));
  reader_send(&r, 'R', 1, a, len_a, out);
  ASSERT_EQ((int64_t)out[0], USMIPC_EEXPORTERGONE);
  reader_send(&r, 'C', 0, NULL, 0, out);
  reader_stop(&r);
  ASSERT_OK(usmipc_event_set_timeout(0));
  free(a);
  free(hb);
  free(hc);
  free(hd);
  free(f);
  three_arrays_free(ptr, q);
  return 0;
}

/* A consumer that dies never returns its ticket: the producer's wait ends
 * with USMIPC_ETIMEDOUT after the event timeout, not sooner. */
TEST_IMPL(bundle_release_consumer_dies) {
  usmipc_queue_t *q = events_queue();
  void *ptr[3];
  size_t extent[3];
  usmipc_bundle_t *b = three_arrays(ptr, extent);
  size_t len;
  uint8_t *data = handoff(b, q, USMIPC_ORDER_RELEASE, &len);
  reader_t r;
  uint64_t out[7];
  reader_start(&r);
  reader_send(&r, 'O', 0, data, len, out);
  ASSERT_EQ((int64_t)out[0], 0);
  ASSERT_EQ(kill(r.pid, SIGKILL), 0);
  int status = wait_pid_timeout(r.pid, 10);
  ASSERT(WIFSIGNALED(status));
  close(r.to);
  close(r.from);
  ASSERT_OK(usmipc_event_set_timeout(400));
  double t0 = now_seconds();
  ASSERT_ERR(usmipc_bundle_wait_released(b, q), USMIPC_ETIMEDOUT);
  double took = now_seconds() - t0;
  ASSERT_MSG(took >= 0.35, "the wait ended after %.3f s", took);
  ASSERT_MSG(strstr(usmipc_last_error(), "0 of 1") != NULL, "%s",
             usmipc_last_error());
  ASSERT_RELEASES(b, 1, 0);
  ASSERT_OK(usmipc_event_set_timeout(0));
  ASSERT_OK(usmipc_bundle_free(b));
  free(data);
  three_arrays_free(ptr, q);
  return 0;
}

/* Two consumers write into the arrays and return their tickets after
 * their queues; one exits normally, the other is killed. Their work is
 * done or died with them: every call of the wait returns 0, on the host and
 * with a queue. Before, on a device with events, the first call failed with
 * EEXPORTERGONE (opening the exited consumer's event) and the next
 * returned 0. */
TEST_IMPL(bundle_release_consumer_exits) {
  usmipc_queue_t *q = events_queue();
  void *ptr[3];
  size_t extent[3];
  usmipc_bundle_t *b = three_arrays(ptr, extent);
  size_t len_a, len_b;
  uint8_t *a = handoff(b, q, USMIPC_ORDER_RELEASE, &len_a);
  uint8_t *hb = handoff(b, q, USMIPC_ORDER_RELEASE, &len_b);
  reader_t ra, rb;
  uint64_t out[7];
  reader_start(&ra);
  reader_start(&rb);
  reader_send(&ra, 'W', 1, a, len_a, out);
  ASSERT_EQ((int64_t)out[0], 0);
  reader_send(&rb, 'W', 1, hb, len_b, out);
  ASSERT_EQ((int64_t)out[0], 0);
  reader_send(&ra, 'C', 0, NULL, 0, out);
  reader_stop(&ra);
  ASSERT_EQ(kill(rb.pid, SIGKILL), 0);
  ASSERT(WIFSIGNALED(wait_pid_timeout(rb.pid, 10)));
  close(rb.to);
  close(rb.from);
  ASSERT_RELEASES(b, 2, 2);
  ASSERT_OK(usmipc_event_set_timeout(2000));
  for (int call = 0; call < 3; call++)
    ASSERT_OK(usmipc_bundle_wait_released(b, call == 1 ? q : NULL));
  ASSERT_OK(usmipc_event_set_timeout(0));
  if (q != NULL)
    ASSERT_OK(usmipc_queue_synchronize(q));
  ASSERT_OK(usmipc_bundle_free(b));
  free(a);
  free(hb);
  three_arrays_free(ptr, q);
  return 0;
}

/* In one process (the ticket is filed without the broker), and the
 * producer's and the bytes' edge cases, each with its own error. */
TEST_IMPL(bundle_release_same_process) {
  usmipc_device_t *dev = test_device();
  usmipc_queue_t *q = events_queue();
  void *ptr[3];
  size_t extent[3];
  usmipc_bundle_t *b = three_arrays(ptr, extent);
  ASSERT_RELEASES(b, 0, 0);
  ASSERT_OK(usmipc_bundle_wait_released(b, q)); /* nothing handed out */
  ASSERT_ERR(usmipc_bundle_order_ex(b, q, 0x40), USMIPC_EINVAL);
  ASSERT_ERR(usmipc_bundle_releases(NULL, NULL, NULL), USMIPC_EINVAL);
  ASSERT_ERR(usmipc_bundle_wait_released(NULL, NULL), USMIPC_EINVAL);
  usmipc_bundle_t *unfinished;
  ASSERT_OK(usmipc_bundle_create(&unfinished));
  ASSERT_ERR(usmipc_bundle_order_ex(unfinished, q, USMIPC_ORDER_RELEASE),
             USMIPC_EINVAL);
  ASSERT_OK(usmipc_bundle_free(unfinished));

  /* Ordered with a ticket: opened (waiting for the producer), written,
   * returned after the consumer's queue. */
  size_t len;
  uint8_t *data = handoff(b, q, USMIPC_ORDER_RELEASE, &len);
  size_t narr;
  ASSERT_OK(usmipc_bundle_inspect(data, len, &narr, NULL));
  ASSERT_EQ(narr, 3);
  usmipc_opened_bundle_t *ob;
  ASSERT_OK(usmipc_bundle_open(data, len, dev, q, 0, &ob));
  ASSERT_UEQ(usmipc_opened_bundle_ticket(ob), 1);
  ASSERT_OK(usmipc_ipc_release(data, len, q));
  ASSERT_OK(usmipc_bundle_close(ob));
  ASSERT_RELEASES(b, 1, 1);
  ASSERT_OK(usmipc_bundle_wait_released(b, q));
  ASSERT_OK(usmipc_bundle_wait_released(b, NULL));
  free(data);

  /* A ticket without ordering (a host-only producer): opens without a
   * wait, and goes back from the host. */
  data = handoff(b, NULL, USMIPC_ORDER_RELEASE, &len);
  ASSERT_OK(usmipc_bundle_open(data, len, dev, NULL, 0, &ob));
  ASSERT_UEQ(usmipc_opened_bundle_ticket(ob), 2);
  ASSERT_OK(usmipc_bundle_close(ob));
  uint8_t *f = malloc(len);
  /* Forged: a wrong token, a ticket never handed out. */
  memcpy(f, data, len);
  f[TICKET_TOKEN_AT(len)] ^= 1;
  reseal(f, len);
  ASSERT_ERR(usmipc_ipc_release(f, len, NULL), USMIPC_EACCES);
  ASSERT_MSG(strstr(usmipc_last_error(), "token") != NULL, "%s",
             usmipc_last_error());
  memcpy(f, data, len);
  usmipc__put64le(f + TICKET_NUMBER_AT(len), 99);
  reseal(f, len);
  ASSERT_ERR(usmipc_ipc_release(f, len, NULL), USMIPC_EBADHANDLE);
  ASSERT_MSG(strstr(usmipc_last_error(), "never handed out") != NULL, "%s",
             usmipc_last_error());
  /* Ticket 1's bytes edited to name ticket 2 (out, not back): each ticket
   * is its own capability, so they return nothing. */
  memcpy(f, data, len);
  usmipc__put64le(f + TICKET_NUMBER_AT(len), 1);
  reseal(f, len);
  ASSERT_ERR(usmipc_ipc_release(f, len, NULL), USMIPC_EACCES);
  ASSERT_RELEASES(b, 2, 1);
  /* Only an ordering record and then a ticket may follow the tree. */
  memcpy(f, data, len);
  usmipc__put16le(f + TICKET_AT(len), 0x8101); /* a pool block record */
  reseal(f, len);
  ASSERT_ERR(usmipc_bundle_open(f, len, dev, NULL, 0, &ob), USMIPC_EBADHANDLE);
  ASSERT_MSG(strstr(usmipc_last_error(), "after the tree") != NULL, "%s",
             usmipc_last_error());
  ASSERT_ERR(usmipc_ipc_release(f, len, NULL), USMIPC_EBADHANDLE);
  ASSERT_RELEASES(b, 2, 1);
  ASSERT_OK(usmipc_ipc_release(data, len, NULL));
  ASSERT_OK(usmipc_ipc_release(data, len, NULL)); /* counts once */
  ASSERT_RELEASES(b, 2, 2);
  ASSERT_OK(usmipc_bundle_wait_released(b, NULL));

  /* Bytes without a ticket: ordered only, and unordered. */
  size_t len_u;
  uint8_t *u = handoff(b, q, 0, &len_u);
  ASSERT_OK(usmipc_bundle_open(u, len_u, dev, q, 0, &ob));
  ASSERT_UEQ(usmipc_opened_bundle_ticket(ob), 0);
  ASSERT_OK(usmipc_bundle_close(ob));
  ASSERT_ERR(usmipc_ipc_release(u, len_u, q), USMIPC_EINVAL);
  ASSERT_MSG(strstr(usmipc_last_error(), "usmipc_bundle_order_ex") != NULL,
             "%s", usmipc_last_error());
  free(u);
  u = handoff(b, NULL, 0, &len_u);
  ASSERT_ERR(usmipc_ipc_release(u, len_u, NULL), USMIPC_EINVAL);
  free(u);
  ASSERT_RELEASES(b, 2, 2);

  /* Freed: a late ticket finds nobody waiting. */
  ASSERT_OK(usmipc_bundle_free(b));
  ASSERT_ERR(usmipc_ipc_release(data, len, NULL), USMIPC_EEXPORTERGONE);
  free(data);
  free(f);

  /* A bundle of no memory lends nothing: no ticket, none to wait for, and
   * returning its bytes is no error. */
  int64_t zero[] = {0};
  usmipc_array_desc_t empty = {2, 32, 1, 1, zero, NULL};
  ASSERT_OK(usmipc_bundle_create(&b));
  ASSERT_OK(usmipc_bundle_add_array(b, NULL, 0, NULL, &empty));
  ASSERT_OK(usmipc_bundle_finish(b));
  data = handoff(b, q, USMIPC_ORDER_RELEASE, &len);
  ASSERT_RELEASES(b, 0, 0);
  ASSERT_OK(usmipc_ipc_release(data, len, q));
  ASSERT_OK(usmipc_bundle_wait_released(b, q));
  ASSERT_OK(usmipc_bundle_free(b));
  free(data);
  three_arrays_free(ptr, q);
  return 0;
}

/* Tickets returned from an idle queue name a completed event record
 * instead of recording one each, as ordered handoffs do (event.c,
 * order_take): 20 handoffs opened and returned in one process make at most
 * one record beyond the first handoff's, the producer's waits for them
 * put no wait on its queue, and every ticket still comes back. On the
 * host and usmipc's own Level Zero lists the queue is idle at once, on
 * CUDA once synchronized after the first record. */
TEST_IMPL(bundle_release_idle_queue_reuses_record) {
  usmipc_device_t *dev = test_device();
  usmipc_queue_t *q = events_queue();
  if (q == NULL)
    RETURN_SKIP("the test device has no events");
  void *ptr[3];
  size_t extent[3], len;
  usmipc_bundle_t *b = three_arrays(ptr, extent);
  usmipc_stats_t s0, s1;
  ASSERT_OK(usmipc_get_stats(&s0, sizeof(s0)));
  for (int i = 0; i < 20; i++) {
    uint8_t *data = handoff(b, q, USMIPC_ORDER_RELEASE, &len);
    usmipc_opened_bundle_t *ob;
    ASSERT_OK(usmipc_bundle_open(data, len, dev, q, 0, &ob));
    ASSERT_OK(usmipc_ipc_release(data, len, q));
    ASSERT_OK(usmipc_bundle_close(ob));
    ASSERT_OK(usmipc_bundle_wait_released(b, q));
    if (i == 0) /* the first record is itself work on the queue */
      ASSERT_OK(usmipc_queue_synchronize(q));
    free(data);
  }
  ASSERT_OK(usmipc_get_stats(&s1, sizeof(s1)));
  ASSERT_RELEASES(b, 20, 20);
  ASSERT_MSG(s1.event_records - s0.event_records <= 2, "%llu records",
             s1.event_records - s0.event_records);
  ASSERT_MSG(s1.event_waits - s0.event_waits <= 2, "%llu waits",
             s1.event_waits - s0.event_waits);
  ASSERT_OK(usmipc_bundle_free(b));
  three_arrays_free(ptr, q);
  return 0;
}

/* bundle_release_forward: a fan-out ticket handed on by a consumer that
 * still holds it (here the producer's own process, the same path as the
 * broker's): the forwarded bytes differ only in their ticket, a reader
 * opens and writes through them, and the wait waits for it as well. Once
 * the fan-out's returns are all in, forwarding it is refused. */
TEST_IMPL(bundle_release_forward) {
  usmipc_queue_t *q = events_queue();
  void *ptr[3];
  size_t extent[3];
  usmipc_bundle_t *b = three_arrays(ptr, extent);
  const void *data;
  size_t len;
  ASSERT_OK(usmipc_bundle_order_fanout(b, q, 2));
  ASSERT_OK(usmipc_bundle_data(b, &data, &len));
  uint8_t *a = malloc(len), *f = malloc(len);
  ASSERT_NOT_NULL(a);
  ASSERT_NOT_NULL(f);
  memcpy(a, data, len);
  ASSERT_ERR(usmipc_ipc_forward(a, len, NULL), USMIPC_EINVAL);
  ASSERT_OK(usmipc_ipc_forward(a, len, f));
  ASSERT_RELEASES(b, 3, 0);
  ASSERT_OK(usmipc_bundle_inspect(f, len, NULL, NULL));
  /* Only the ticket's number and token (and the checksum) differ. */
  ASSERT_EQ(memcmp(a, f, len - 28), 0);
  ASSERT_MSG(memcmp(a + len - 28, f + len - 28, 24) != 0, "same ticket");
  reader_t r[2];
  uint64_t out[7];
  for (int i = 0; i < 2; i++)
    reader_start(&r[i]);
  reader_send(&r[0], 'W', 1, f, len, out); /* opens, writes, returns */
  ASSERT_EQ((int64_t)out[0], 0);
  ASSERT_RELEASES(b, 3, 1);
  reader_send(&r[0], 'R', 0, f, len, out); /* again: counts for nothing */
  ASSERT_EQ((int64_t)out[0], 0);
  ASSERT_RELEASES(b, 3, 1);
  reader_send(&r[0], 'R', 0, a, len, out);
  ASSERT_EQ((int64_t)out[0], 0);
  reader_send(&r[1], 'R', 0, a, len, out);
  ASSERT_EQ((int64_t)out[0], 0);
  ASSERT_RELEASES(b, 3, 3);
  ASSERT_ERR(usmipc_ipc_forward(a, len, f), USMIPC_EINVAL);
  ASSERT_OK(usmipc_bundle_wait_released(b, q));
  if (q != NULL)
    ASSERT_OK(usmipc_queue_synchronize(q));
  ASSERT_PATTERN(ptr[0], extent[0], 700, 0); /* written through f */
  /* Bytes with no ticket: nothing to hand on. */
  ASSERT_OK(usmipc_bundle_order(b, NULL));
  ASSERT_OK(usmipc_bundle_data(b, &data, &len));
  ASSERT_ERR(usmipc_ipc_forward(data, len, f), USMIPC_EINVAL);
  for (int i = 0; i < 2; i++) {
    reader_send(&r[i], 'C', 0, NULL, 0, out);
    reader_stop(&r[i]);
  }
  free(a);
  free(f);
  usmipc_bundle_free(b);
  three_arrays_free(ptr, q);
  return 0;
}

/* bundle_release_fanout: one handoff's bytes to three consumer processes
 * (as tensor-parallel ranks get them): one event, one ticket, the same
 * bytes; the wait waits for all three, a process's second return counts
 * for nothing (nor does returning it from the same process twice), and the
 * next plain handoff counts as before. */
TEST_IMPL(bundle_release_fanout) {
  usmipc_queue_t *q = events_queue();
  void *ptr[3];
  size_t extent[3];
  usmipc_bundle_t *b = three_arrays(ptr, extent);
  ASSERT_ERR(usmipc_bundle_order_fanout(b, q, 0), USMIPC_EINVAL);
  ASSERT_ERR(usmipc_bundle_order_fanout(b, q, 5000), USMIPC_EINVAL);
  ASSERT_RELEASES(b, 0, 0);
  const void *data;
  size_t len;
  ASSERT_OK(usmipc_bundle_order_fanout(b, q, 3));
  ASSERT_OK(usmipc_bundle_data(b, &data, &len));
  uint8_t *a = malloc(len);
  ASSERT_NOT_NULL(a);
  memcpy(a, data, len);
  ASSERT_RELEASES(b, 3, 0);
  reader_t r[3];
  uint64_t out[7];
  for (int i = 0; i < 3; i++)
    reader_start(&r[i]);
  reader_send(&r[0], 'W', 1, a, len, out); /* opens, writes, returns */
  ASSERT_EQ((int64_t)out[0], 0);
  reader_send(&r[0], 'R', 0, a, len, out); /* again: counts for nothing */
  ASSERT_EQ((int64_t)out[0], 0);
  ASSERT_RELEASES(b, 3, 1);
  reader_send(&r[1], 'R', 1, a, len, out);
  ASSERT_EQ((int64_t)out[0], 0);
  ASSERT_RELEASES(b, 3, 2);
  ASSERT_OK(usmipc_event_set_timeout(300));
  ASSERT_ERR(usmipc_bundle_wait_released(b, q), USMIPC_ETIMEDOUT);
  ASSERT_MSG(strstr(usmipc_last_error(), "2 of 3") != NULL, "%s",
             usmipc_last_error());
  reader_send(&r[2], 'R', 0, a, len, out);
  ASSERT_EQ((int64_t)out[0], 0);
  ASSERT_RELEASES(b, 3, 3);
  ASSERT_OK(usmipc_event_set_timeout(0));
  ASSERT_OK(usmipc_bundle_wait_released(b, q));
  if (q != NULL)
    ASSERT_OK(usmipc_queue_synchronize(q));
  ASSERT_PATTERN(ptr[0], extent[0], 700, 0); /* the first consumer's work */
  /* All three in: a fourth return of the done ticket counts for nothing. */
  reader_send(&r[1], 'R', 0, a, len, out);
  ASSERT_EQ((int64_t)out[0], 0);
  ASSERT_RELEASES(b, 3, 3);
  /* A fan-out of two returned from this process twice and one reader. */
  ASSERT_OK(usmipc_bundle_order_fanout(b, NULL, 2));
  ASSERT_OK(usmipc_bundle_data(b, &data, &len));
  memcpy(a, data, len);
  ASSERT_OK(usmipc_ipc_release(a, len, NULL));
  ASSERT_OK(usmipc_ipc_release(a, len, NULL));
  ASSERT_RELEASES(b, 5, 4);
  reader_send(&r[2], 'R', 0, a, len, out);
  ASSERT_EQ((int64_t)out[0], 0);
  ASSERT_RELEASES(b, 5, 5);
  /* A plain handoff after them counts as before. */
  ASSERT_OK(usmipc_bundle_order_ex(b, NULL, USMIPC_ORDER_RELEASE));
  ASSERT_OK(usmipc_bundle_data(b, &data, &len));
  memcpy(a, data, len);
  reader_send(&r[0], 'R', 0, a, len, out);
  ASSERT_EQ((int64_t)out[0], 0);
  ASSERT_RELEASES(b, 6, 6);
  ASSERT_OK(usmipc_bundle_wait_released(b, NULL));
  for (int i = 0; i < 3; i++) {
    reader_send(&r[i], 'C', 0, NULL, 0, out); /* what 'W' opened */
    reader_stop(&r[i]);
  }
  free(a);
  usmipc_bundle_free(b);
  three_arrays_free(ptr, q);
  return 0;
}
