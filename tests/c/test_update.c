/* Copy plans and usmipc_bundle_update: a handoff copied into the consumer's
 * own arrays in one call. On the host backend the copies are its parallel
 * memcpy; on the Level Zero test driver (no batch of its own) the core's
 * memcpy of each row. */
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "task.h"

#define MiB ((size_t)1 << 20)
/* The large array: past the host backend's 32 MiB threshold for threads;
 * under ThreadSanitizer, whose every byte costs, a smaller one (the 30 s
 * alarm). */
#if defined(__SANITIZE_THREAD__)
#define BIG_MIB 4
#else
#define BIG_MIB 40
#endif

/* A queue where the device has events (so that tickets go back after work
 * on it), else NULL (the host). */
static usmipc_queue_t *event_queue(void) {
  static usmipc_queue_t *q;
  usmipc_event_t *probe;
  if (q == NULL && usmipc_event_create(test_device(), 0, &probe) == 0) {
    usmipc_event_destroy(probe);
    ASSERT_OK(usmipc_queue_create(test_device(), &q));
  }
  return q;
}

/* n bytes of device memory at p, readable on the host (a copy, freed by the
 * caller, or p itself on the host backend: *owned says which). */
static const uint8_t *host_view(const void *p, size_t n, int *owned) {
  *owned = 0;
  if (test_device_is_host() || n == 0)
    return p;
  static usmipc_queue_t *q;
  if (q == NULL)
    ASSERT_OK(usmipc_queue_create(test_device(), &q));
  uint8_t *stage = malloc(n);
  ASSERT_NOT_NULL(stage);
  ASSERT_OK(usmipc_memcpy(q, stage, p, n));
  ASSERT_OK(usmipc_queue_synchronize(q));
  *owned = 1;
  return stage;
}

static size_t itemsize_of(const usmipc_array_desc_t *d) {
  return d->dtype_bits / 8u;
}

/* The bytes an array with these strides spans from its first element. */
static size_t extent_of(const usmipc_array_desc_t *d, const int64_t *strides) {
  size_t last = 0;
  for (int i = 0; i < d->ndim; i++) {
    if (d->shape[i] == 0)
      return 0;
    last += (size_t)(d->shape[i] - 1) * (size_t)strides[i];
  }
  return (last + 1) * itemsize_of(d);
}

/* Whether every element of the destination equals the source's. */
static int same_elements(const usmipc_array_desc_t *sd, const void *src,
                         const int64_t *ds, const void *dst) {
  size_t isz = itemsize_of(sd), se = extent_of(sd, sd->strides),
         de = extent_of(sd, ds);
  if (se == 0)
    return 1;
  int so, dow;
  const uint8_t *s = host_view(src, se, &so), *d = host_view(dst, de, &dow);
  int64_t idx[USMIPC_BUNDLE_MAX_NDIM] = {0};
  int ok = 1;
  bool dense = se == de; /* both C-contiguous: one compare */
  int64_t step = 1;
  for (int i = sd->ndim - 1; dense && i >= 0; i--) {
    dense = sd->strides[i] == step && ds[i] == step;
    step *= sd->shape[i];
  }
  if (dense) {
    ok = memcmp(s, d, se) == 0;
    goto done;
  }
  for (;;) {
    size_t sa = 0, da = 0;
    for (int i = 0; i < sd->ndim; i++) {
      sa += (size_t)idx[i] * (size_t)sd->strides[i];
      da += (size_t)idx[i] * (size_t)ds[i];
    }
    if (memcmp(s + sa * isz, d + da * isz, isz) != 0) {
      ok = 0;
      break;
    }
    int i = sd->ndim - 1;
    for (; i >= 0 && ++idx[i] == sd->shape[i]; i--)
      idx[i] = 0;
    if (i < 0)
      break;
  }
done:
  if (so)
    free((void *)s);
  if (dow)
    free((void *)d);
  return ok;
}

/* ---- the consumer: a process of its own with its own weights -------------
 * Requests: u8 op, u32 len, len bytes. 'U' updates its weights from the
 * bundle (the plan is made at the first: destination i takes the bundle's
 * array narr - 1 - i; a 2-D array goes into a column shard of a wider
 * matrix, rows 3 elements longer), then checks every destination element
 * against the source. 'Q' quits. Reply: 4 u64: status (0, a usmipc code,
 * or -1 for wrong data), driver imports, descriptors taken, round trips. */
typedef struct weights {
  usmipc_copy_plan_t *plan;
  size_t n;
  void **ptr;
  int64_t (*strides)[USMIPC_BUNDLE_MAX_NDIM];
} weights_t;

static int make_weights(weights_t *w, const usmipc_bundle_array_t *a,
                        size_t narr) {
  w->n = narr;
  w->ptr = calloc(narr ? narr : 1, sizeof(void *));
  w->strides = calloc(narr ? narr : 1, sizeof(*w->strides));
  usmipc_copy_dest_t *dests = calloc(narr ? narr : 1, sizeof(*dests));
  char(*names)[32] = calloc(narr ? narr : 1, sizeof(*names));
  if (!w->ptr || !w->strides || !dests || !names)
    return USMIPC_ENOMEM;
  for (size_t i = 0; i < narr; i++) {
    const usmipc_bundle_array_t *src = &a[narr - 1 - i];
    const usmipc_array_desc_t *sd = &src->desc;
    int64_t *st = w->strides[i], step = 1;
    for (int j = sd->ndim - 1; j >= 0; j--) {
      st[j] = step;
      int64_t len = sd->shape[j] > 0 ? sd->shape[j] : 1;
      step *= sd->ndim == 2 && j == 1 ? len + 3 : len;
    }
    size_t bytes = extent_of(sd, st);
    if (bytes > 0) {
      int r = usmipc_malloc(test_device(), USMIPC_MEM_DEVICE, bytes,
                            &w->ptr[i]);
      if (r != 0)
        return r;
      dev_fill(w->ptr[i], bytes, 9000 + i, 0); /* not the source's bytes */
    }
    snprintf(names[i], sizeof(names[i]), "leaf %zu", i);
    dests[i].array = (uint32_t)(narr - 1 - i);
    dests[i].ptr = w->ptr[i];
    dests[i].desc = *sd;
    dests[i].desc.strides = st;
    dests[i].name = names[i];
  }
  int r = usmipc_copy_plan_create(test_device(), dests, narr, 0, &w->plan);
  free(dests);
  free(names);
  return r;
}

static void reply4(int64_t status) {
  usmipc_stats_t s;
  usmipc_get_stats(&s, sizeof(s));
  uint64_t r[4] = {(uint64_t)status, s.driver_imports, s.descriptors_received,
                   s.transport_exchanges};
  if (write(1, r, sizeof(r)) != (ssize_t)sizeof(r))
    _exit(5);
}

HELPER_IMPL(update_consumer) {
  (void)argc;
  (void)argv;
  weights_t w = {0};
  for (;;) {
    uint8_t op;
    uint32_t len;
    if (read_full(0, &op, 1) || read_full(0, &len, 4))
      return 1;
    uint8_t *data = malloc(len ? len : 1);
    if (data == NULL || read_full(0, data, len))
      return 2;
    if (op == 'Q') {
      free(data);
      usmipc_copy_plan_free(w.plan);
      for (size_t i = 0; i < w.n; i++)
        if (w.ptr[i] != NULL)
          usmipc_free(w.ptr[i]);
      free(w.ptr);
      free(w.strides);
      return 0;
    }
    usmipc_opened_bundle_t *ob = NULL;
    /* What the sources are (and, for the check, where): unordered, as the
     * update below is what waits for the producer. */
    int r = usmipc_bundle_open(data, len, test_device(), NULL,
                               USMIPC_OPEN_UNORDERED, &ob);
    size_t narr = 0;
    const usmipc_bundle_array_t *a =
        r == 0 ? usmipc_opened_bundle_arrays(ob, &narr) : NULL;
    if (r == 0 && w.plan == NULL)
      r = make_weights(&w, a, narr);
    usmipc_queue_t *q = event_queue();
    if (r == 0)
      r = usmipc_bundle_update(w.plan, data, len, q, 0);
    if (r == 0 && q != NULL)
      r = usmipc_queue_synchronize(q);
    int64_t status = r;
    if (r != 0)
      fprintf(stderr, "consumer: %s\n", usmipc_last_error());
    for (size_t i = 0; r == 0 && i < narr; i++)
      if (!same_elements(&a[narr - 1 - i].desc, a[narr - 1 - i].ptr,
                         w.strides[i], w.ptr[i])) {
        fprintf(stderr, "consumer: destination %zu differs\n", i);
        status = -1;
      }
    if (ob != NULL)
      usmipc_bundle_close(ob);
    reply4(status);
    free(data);
  }
}

typedef struct consumer {
  pid_t pid;
  int to, from;
} consumer_t;

static void consumer_send(consumer_t *c, char op, const void *data, size_t len,
                          uint64_t out[4]) {
  uint32_t l = (uint32_t)len;
  ASSERT_EQ(write(c->to, &op, 1), 1);
  ASSERT_EQ(write(c->to, &l, 4), 4);
  if (len > 0)
    ASSERT_EQ(write(c->to, data, len), (ssize_t)len);
  if (out != NULL)
    ASSERT_EQ(read_full(c->from, out, 4 * sizeof(uint64_t)), 0);
}

/* The producer's arrays: pool blocks and plain allocations, in a tree
 *   {"w": [a0 f32 64x64, a1 bf16 16x8 view of 16x16], "meta": (a2 i64 0-d,
 *    a3 f16 0x5), "x": a4 u8 3, "big": a5 u8 40 MiB, "t": a6 f32 4x6x10}
 * (40 MiB: past the host backend's 32 MiB threshold for threads). */
enum { ARRAYS = 7 };
typedef struct producer {
  usmipc_pool_t *pool;
  void *ptr[ARRAYS];
  size_t extent[ARRAYS];
  usmipc_bundle_t *bundle;
} producer_t;

static void producer_make(producer_t *p, const char *big_key) {
  usmipc_device_t *dev = test_device();
  ASSERT_OK(usmipc_pool_create(dev, 0, 0, &p->pool));
  size_t ext[ARRAYS] = {64 * 64 * 4, (15 * 16 + 8) * 2, 8, 0, 3, BIG_MIB * MiB,
                        4 * 6 * 10 * 4};
  memcpy(p->extent, ext, sizeof(ext));
  ASSERT_OK(usmipc_pool_malloc(p->pool, ext[0], 0, &p->ptr[0]));
  ASSERT_OK(usmipc_pool_malloc(p->pool, 16 * 16 * 2, 0, &p->ptr[1]));
  ASSERT_OK(usmipc_pool_malloc(p->pool, 8, 0, &p->ptr[2]));
  p->ptr[3] = NULL;
  ASSERT_OK(usmipc_pool_malloc(p->pool, 3, 0, &p->ptr[4]));
  ASSERT_OK(usmipc_malloc(dev, USMIPC_MEM_DEVICE, ext[5], &p->ptr[5]));
  ASSERT_OK(usmipc_malloc(dev, USMIPC_MEM_DEVICE, ext[6], &p->ptr[6]));
  static int64_t s0[] = {64, 64}, s1[] = {16, 8}, st1[] = {16, 1},
                 s3[] = {0, 5}, s4[] = {3}, s5[] = {BIG_MIB << 20},
                 s6[] = {4, 6, 10};
  usmipc_array_desc_t d0 = {2, 32, 1, 2, s0, NULL}, d1 = {4, 16, 1, 2, s1, st1},
                      d2 = {0, 64, 1, 0, NULL, NULL},
                      d3 = {2, 16, 1, 2, s3, NULL}, d4 = {1, 8, 1, 1, s4, NULL},
                      d5 = {1, 8, 1, 1, s5, NULL}, d6 = {2, 32, 1, 3, s6, NULL};
  usmipc_bundle_t *b;
  ASSERT_OK(usmipc_bundle_create(&b));
  ASSERT_OK(usmipc_bundle_add_container(b, USMIPC_BUNDLE_DICT, 5, NULL, 0));
  ASSERT_OK(usmipc_bundle_add_container(b, USMIPC_BUNDLE_LIST, 2, "w", 1));
  ASSERT_OK(usmipc_bundle_add_array(b, NULL, 0, p->ptr[0], &d0));
  ASSERT_OK(usmipc_bundle_add_array(b, NULL, 0, p->ptr[1], &d1));
  ASSERT_OK(usmipc_bundle_add_container(b, USMIPC_BUNDLE_TUPLE, 2, "meta", 4));
  ASSERT_OK(usmipc_bundle_add_array(b, NULL, 0, p->ptr[2], &d2));
  ASSERT_OK(usmipc_bundle_add_array(b, NULL, 0, p->ptr[3], &d3));
  ASSERT_OK(usmipc_bundle_add_array(b, "x", 1, p->ptr[4], &d4));
  ASSERT_OK(
      usmipc_bundle_add_array(b, big_key, strlen(big_key), p->ptr[5], &d5));
  ASSERT_OK(usmipc_bundle_add_array(b, "t", 1, p->ptr[6], &d6));
  ASSERT_OK(usmipc_bundle_finish(b));
  p->bundle = b;
}

static void producer_fill(producer_t *p, uint64_t seed0) {
  for (int i = 0; i < ARRAYS; i++)
    if (p->extent[i] > 0)
      dev_fill(p->ptr[i], p->extent[i], seed0 + (uint64_t)i, 0);
}

static void producer_free(producer_t *p) {
  usmipc_bundle_free(p->bundle);
  for (int i = 0; i < ARRAYS; i++)
    if (p->ptr[i] != NULL)
      usmipc_free(p->ptr[i]); /* a pool block goes back to its pool */
  ASSERT_OK(usmipc_pool_destroy(p->pool));
}

/* update_cross_process: three handoffs of one kept bundle into another
 * process's weights (a column shard, a reversed order of leaves, an empty
 * and a 0-d array, 40 MiB): every element arrives each time; from the
 * second on, no driver import and no descriptor; each handoff's ticket comes
 * back from the update itself, so the producer's wait ends. */
TEST_IMPL(update_cross_process) {
  producer_t p;
  producer_make(&p, "big");
  usmipc_queue_t *q = event_queue();
  consumer_t c;
  c.pid = spawn_helper("update_consumer", NULL, NULL, &c.to, &c.from);
  uint64_t out[4], imports = 0, descs = 0;
  for (int round = 0; round < 3; round++) {
    producer_fill(&p, 100 * (uint64_t)(round + 1));
    ASSERT_OK(usmipc_bundle_order_ex(p.bundle, q, USMIPC_ORDER_RELEASE));
    const void *data;
    size_t len;
    ASSERT_OK(usmipc_bundle_data(p.bundle, &data, &len));
    consumer_send(&c, 'U', data, len, out);
    ASSERT_EQ((int64_t)out[0], 0);
    if (round > 0) {
      ASSERT_UEQ(out[1], imports); /* warm: nothing mapped anew */
      ASSERT_UEQ(out[2], descs);
    }
    imports = out[1];
    descs = out[2];
    uint64_t sent, back;
    ASSERT_OK(usmipc_bundle_wait_released(p.bundle, NULL));
    ASSERT_OK(usmipc_bundle_releases(p.bundle, &sent, &back));
    ASSERT_UEQ(sent, (uint64_t)round + 1);
    ASSERT_UEQ(back, (uint64_t)round + 1);
  }
  /* The producer makes everything anew (the same tree, other memory): the
   * plan's arrays and nodes are byte for byte the same, so only the
   * sources' moves tell it what to copy from. */
  producer_free(&p);
  producer_make(&p, "big");
  producer_fill(&p, 4000);
  ASSERT_OK(usmipc_bundle_order_ex(p.bundle, q, USMIPC_ORDER_RELEASE));
  const void *data;
  size_t len;
  ASSERT_OK(usmipc_bundle_data(p.bundle, &data, &len));
  consumer_send(&c, 'U', data, len, out);
  ASSERT_EQ((int64_t)out[0], 0);
  ASSERT_OK(usmipc_bundle_wait_released(p.bundle, NULL));
  consumer_send(&c, 'Q', NULL, 0, NULL);
  ASSERT_EQ(exit_code_of(wait_pid_timeout(c.pid, 20)), 0);
  close(c.to);
  close(c.from);
  producer_free(&p);
  return 0;
}

/* update_refused: a plan that does not fit the bundle is refused before
 * anything is copied, naming the destination and what differs; a tree
 * change is refused by a pinned plan and rebound by an unpinned one. */
TEST_IMPL(update_refused) {
  producer_t p;
  producer_make(&p, "big");
  producer_fill(&p, 7);
  const void *data;
  size_t len;
  ASSERT_OK(usmipc_bundle_data(p.bundle, &data, &len));
  usmipc_device_t *dev = test_device();
  void *d0, *d1;
  ASSERT_OK(usmipc_malloc(dev, USMIPC_MEM_DEVICE, 64 * 64 * 4, &d0));
  ASSERT_OK(usmipc_malloc(dev, USMIPC_MEM_DEVICE, 64 * 64 * 4, &d1));
  int64_t s0[] = {64, 64}, bad_shape[] = {64, 63}, s6[] = {4, 6, 10},
          transposed[] = {1, 4, 24};
  usmipc_copy_dest_t dests[2] = {
      {0, d0, {2, 32, 1, 2, s0, NULL}, "model.w0"},
      {6, d1, {2, 32, 1, 3, s6, NULL}, "model.t"},
  };
  usmipc_copy_plan_t *plan;
  struct {
    uint32_t array;
    usmipc_array_desc_t desc;
    int code;
    const char *says;
  } cases[] = {
      {6, {2, 32, 1, 2, bad_shape, NULL}, USMIPC_EINVAL, "shape (64, 63)"},
      {6, {2, 16, 1, 3, s6, NULL}, USMIPC_EINVAL, "dtype code 2 of 16 bits"},
      {9, {2, 32, 1, 3, s6, NULL}, USMIPC_EINVAL, "has 7 arrays"},
      {6, {2, 32, 1, 3, s6, transposed}, USMIPC_ENOTSUP, "not rows"},
  };
  for (size_t k = 0; k < sizeof(cases) / sizeof(cases[0]); k++) {
    dev_fill(d0, 64 * 64 * 4, 555, 0);
    dests[1].array = cases[k].array;
    dests[1].desc = cases[k].desc;
    ASSERT_OK(usmipc_copy_plan_create(dev, dests, 2, 0, &plan));
    ASSERT_ERR(usmipc_bundle_update(plan, data, len, NULL, 0), cases[k].code);
    ASSERT_MSG(strstr(usmipc_last_error(), "destination 1 (model.t)") &&
                   strstr(usmipc_last_error(), cases[k].says),
               "case %zu: %s", k, usmipc_last_error());
    /* Nothing was copied, not even the destination that fits. */
    ASSERT_EQ(dev_check(d0, 64 * 64 * 4, 555, 0), SIZE_MAX);
    ASSERT_OK(usmipc_copy_plan_free(plan));
  }
  /* Bad arguments. */
  ASSERT_ERR(usmipc_bundle_update(NULL, data, len, NULL, 0), USMIPC_EINVAL);
  int64_t neg[] = {-1};
  usmipc_copy_dest_t bad = {0, d0, {2, 32, 1, 1, neg, NULL}, NULL};
  ASSERT_ERR(usmipc_copy_plan_create(dev, &bad, 1, 0, &plan), USMIPC_EINVAL);
  bad.desc = (usmipc_array_desc_t){3, 32, 1, 2, s0, NULL};
  ASSERT_ERR(usmipc_copy_plan_create(dev, &bad, 1, 0, &plan), USMIPC_EINVAL);
  ASSERT_ERR(usmipc_copy_plan_create(dev, dests, 1, 0x80, &plan),
             USMIPC_EINVAL);

  /* A plan that fits copies; a pinned one refuses a changed tree (another
   * key), an unpinned one binds to it. */
  dests[1].array = 6;
  dests[1].desc = (usmipc_array_desc_t){2, 32, 1, 3, s6, NULL};
  usmipc_copy_plan_t *pinned;
  ASSERT_OK(usmipc_copy_plan_create(dev, dests, 2, USMIPC_PLAN_PIN_TREE,
                                    &pinned));
  ASSERT_OK(usmipc_copy_plan_create(dev, dests, 2, 0, &plan));
  ASSERT_OK(usmipc_bundle_update(pinned, data, len, NULL, 0));
  ASSERT_OK(usmipc_bundle_update(plan, data, len, NULL, 0));
  ASSERT_EQ(dev_check(d0, 64 * 64 * 4, 7, 0), SIZE_MAX);
  ASSERT_EQ(dev_check(d1, 4 * 6 * 10 * 4, 7 + 6, 0), SIZE_MAX);
  producer_t other;
  producer_make(&other, "BIG");
  producer_fill(&other, 70);
  const void *data2;
  size_t len2;
  ASSERT_OK(usmipc_bundle_data(other.bundle, &data2, &len2));
  ASSERT_ERR(usmipc_bundle_update(pinned, data2, len2, NULL, 0), USMIPC_EINVAL);
  ASSERT_MSG(strstr(usmipc_last_error(), "tree"), "%s", usmipc_last_error());
  ASSERT_EQ(dev_check(d0, 64 * 64 * 4, 7, 0), SIZE_MAX);
  ASSERT_OK(usmipc_bundle_update(plan, data2, len2, NULL, 0));
  ASSERT_EQ(dev_check(d0, 64 * 64 * 4, 70, 0), SIZE_MAX);
  ASSERT_EQ(dev_check(d1, 4 * 6 * 10 * 4, 70 + 6, 0), SIZE_MAX);
  /* A warm update (the same bundle's next handoff) still checks the
   * records after the tree: a forged record type is refused, nothing is
   * copied, and the plan goes on with honest bytes. */
  ASSERT_OK(usmipc_bundle_order_ex(other.bundle, NULL, USMIPC_ORDER_RELEASE));
  ASSERT_OK(usmipc_bundle_data(other.bundle, &data2, &len2));
  ASSERT_OK(usmipc_bundle_update(plan, data2, len2, NULL, 0));
  uint8_t *forged = malloc(len2);
  ASSERT_NOT_NULL(forged);
  memcpy(forged, data2, len2);
  uint32_t tail_len;
  memcpy(&tail_len, forged + 60, 4); /* header: the tail's length */
  ASSERT_GT(tail_len, 0);
  forged[len2 - 4 - tail_len] = 0x01; /* record 0x8003 -> 0x8001 */
  producer_fill(&other, 71);
  ASSERT_ERR(usmipc_bundle_update(plan, forged, len2, NULL, 0),
             USMIPC_EBADHANDLE);
  ASSERT_MSG(strstr(usmipc_last_error(), "0x8001"), "%s", usmipc_last_error());
  ASSERT_EQ(dev_check(d0, 64 * 64 * 4, 70, 0), SIZE_MAX);
  free(forged);
  ASSERT_OK(usmipc_bundle_order_ex(other.bundle, NULL, USMIPC_ORDER_RELEASE));
  ASSERT_OK(usmipc_bundle_data(other.bundle, &data2, &len2));
  ASSERT_OK(usmipc_bundle_update(plan, data2, len2, NULL, 0));
  ASSERT_EQ(dev_check(d0, 64 * 64 * 4, 71, 0), SIZE_MAX);
  ASSERT_OK(usmipc_copy_plan_free(pinned));
  ASSERT_OK(usmipc_copy_plan_free(plan));
  ASSERT_OK(usmipc_copy_plan_free(NULL));
  producer_free(&other);
  producer_free(&p);
  usmipc_free(d0);
  usmipc_free(d1);
  return 0;
}
