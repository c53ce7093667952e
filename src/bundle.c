/* Bundles: many arrays (a model's state dict) in one handoff.
 *
 * Export: each array's allocation is found (usmipc's own, a pool segment,
 *         or another library's) and exported once per bundle, as an
 *         ordinary unordered handle of the whole allocation; an array is an
 *         allocation index, a byte offset, a DLPack dtype, a shape and
 *         strides. The tree is a preorder list of nodes. The bundle takes a
 *         slot of its own in the export table, cleared when it is freed, so
 *         that its bytes are refused from then on (the arrays' memory is
 *         only promised while the bundle lives).
 * Open:   decode and check everything (the bytes are untrusted) -> check
 *         the bundle's slot -> map each allocation once (a cache hit when
 *         mapped already) and take one reference per array -> wait for the
 *         producer's work once -> describe the tree.
 * Handoff: the records an ordered handle appends (an ordering event, a
 *         release ticket) follow the tree, as if appended to allocation 0's
 *         handle, so that a bundle is ordered and released exactly as one
 *         handle is (usmipc_bundle_order_ex; usmipc_ipc_release returns the
 *         ticket of bundle bytes too).
 *
 * The byte format (its constants, the checks both sides make, the decoder)
 * is wire/bundle_wire.c, documented in docs/handle-format.md ("Bundles");
 * tests/fuzz/fuzz_bundle.c fuzzes the decoder.
 *
 * Floor 5 of the core (objects), its highest file: the bundle object calls
 * the handle calls (ipc.c), release tickets, events and the engines below. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "objects.h"

/* ---- the producer's side ------------------------------------------------- */

typedef struct segment_out {
  usmipc_ipc_handle_t *handle; /* of the whole allocation */
  usmipc__allocation_ref_t ref;
} segment_out_t;

typedef struct array_out {
  uint32_t segment;
  uint64_t offset;
  uint8_t code, bits;
  uint16_t lanes;
  uint8_t ndim;
  size_t dims_at; /* shape then strides in dims[] */
} array_out_t;

struct usmipc_bundle {
  segment_out_t *segs;
  size_t nseg, seg_cap;
  uint32_t *by_base; /* segment indices in the order of their bases */
  size_t last_seg;   /* the segment of the last array: likely the next's */
  uint32_t *hash;    /* segment index + 1 by buffer id; 0 empty */
  size_t hash_cap;
  array_out_t *arrays;
  size_t narr, arr_cap;
  int64_t *dims;
  size_t ndims, dims_cap;
  uint8_t *nodes; /* encoded as on the wire */
  size_t nodes_len, nodes_cap;
  uint32_t nnode;
  usmipc__tree_check_t tree;
  int failed; /* the first failed add: finish refuses */
  bool finished;
  uint64_t id;
  uint32_t slot;
  uint8_t token[16];
  uint8_t *bytes; /* base_len bytes + room for the tail and the checksum */
  size_t base_len, len;
  usmipc__release_t *release; /* tickets handed out, or NULL */
  struct usmipc_bundle *next_live;
};

/* Bundles this process exports, for opens in the same process. */
static pthread_mutex_t live_lock = PTHREAD_MUTEX_INITIALIZER;
static usmipc_bundle_t *live;

/* fork() from another thread: the child must not inherit live_lock held
 * (process.c takes it first: it is never held while waiting for another). */
static pthread_mutex_t tmpl_lock = PTHREAD_MUTEX_INITIALIZER;

void usmipc__bundles_fork_prepare(void) {
  pthread_mutex_lock(&live_lock);
  pthread_mutex_lock(&tmpl_lock);
}
void usmipc__bundles_fork_parent(void) {
  pthread_mutex_unlock(&tmpl_lock);
  pthread_mutex_unlock(&live_lock);
}
void usmipc__bundles_fork_child(void) {
  pthread_mutex_unlock(&tmpl_lock);
  pthread_mutex_unlock(&live_lock);
}

/* Grows *p (of *cap elements of elem bytes) to hold need, doubling. The
 * callers' counts are bounded (USMIPC__BUNDLE_MAX_NODES and _MAX_ARRAYS,
 * keys of at most 65535 bytes), so the size cannot wrap through the API;
 * checked here all the same, so that a later caller cannot make it. */
static int grow(void **p, size_t *cap, size_t need, size_t elem) {
  if (need <= *cap)
    return 0;
  size_t n = *cap ? *cap : 16;
  while (n < need && n <= SIZE_MAX / 2)
    n *= 2;
  if (n < need || elem == 0 || n > SIZE_MAX / elem)
    return usmipc__fail(USMIPC_ENOMEM,
                        "a bundle of %zu items of %zu bytes "
                        "is too large to build",
                        need, elem);
  void *q = realloc(*p, n * elem);
  if (q == NULL)
    return usmipc__fail(USMIPC_ENOMEM, "out of memory building a bundle");
  *p = q;
  *cap = n;
  return 0;
}

int usmipc_bundle_create(usmipc_bundle_t **bundle) {
  if (bundle == NULL)
    return usmipc__fail(USMIPC_EINVAL, "usmipc_bundle_create: NULL");
  *bundle = calloc(1, sizeof(**bundle));
  if (*bundle == NULL)
    return usmipc__fail(USMIPC_ENOMEM, "out of memory");
  (*bundle)->slot = USMIPC__BUNDLE_NO_SLOT;
  return 0;
}

static int check_building(usmipc_bundle_t *b, const char *fn) {
  if (b == NULL)
    return usmipc__fail(USMIPC_EINVAL, "%s: NULL bundle", fn);
  if (b->finished)
    return usmipc__fail(USMIPC_EINVAL, "%s: the bundle is finished already",
                        fn);
  if (b->failed)
    return usmipc__fail(b->failed,
                        "%s: an earlier add failed; make a new bundle", fn);
  return 0;
}

static int add_node(usmipc_bundle_t *b, usmipc_bundle_node_kind_t kind,
                    uint32_t count, const char *key, size_t key_len) {
  if (key_len > UINT16_MAX)
    return usmipc__fail(USMIPC_EINVAL,
                        "a dict key of %zu bytes: at most 65535 can travel",
                        key_len);
  if (key != NULL && !usmipc__utf8_valid((const uint8_t *)key, key_len))
    return usmipc__fail(USMIPC_EINVAL, "a dict key is not valid UTF-8");
  if (b->nnode == USMIPC__BUNDLE_MAX_NODES)
    return usmipc__fail(USMIPC_ENOMEM, "a bundle holds at most %u nodes",
                        USMIPC__BUNDLE_MAX_NODES);
  int rc =
      usmipc__tree_push(&b->tree, kind, count, key != NULL, key_len, "bundle");
  if (rc == USMIPC_EBADHANDLE) { /* the caller's mistake: EINVAL */
    char why[256]; /* a copy: the message is formatted into its own buffer */
    snprintf(why, sizeof(why), "%s", usmipc_last_error());
    return usmipc__fail(USMIPC_EINVAL, "%s", why);
  }
  if (rc != 0)
    return rc;
  if ((rc = grow((void **)&b->nodes, &b->nodes_cap,
                 b->nodes_len + USMIPC__BUNDLE_NODE_FIXED + key_len, 1)) != 0)
    return rc;
  uint8_t *n = b->nodes + b->nodes_len;
  n[0] = (uint8_t)kind;
  n[1] = key != NULL; /* bit 0: has a key */
  usmipc__put16le(n + 2, (uint16_t)key_len);
  usmipc__put32le(n + 4, count);
  if (key_len > 0)
    memcpy(n + USMIPC__BUNDLE_NODE_FIXED, key, key_len);
  b->nodes_len += USMIPC__BUNDLE_NODE_FIXED + key_len;
  b->nnode++;
  return 0;
}

int usmipc_bundle_add_container(usmipc_bundle_t *b,
                                usmipc_bundle_node_kind_t kind, uint32_t count,
                                const char *key, size_t key_len) {
  int rc = check_building(b, "usmipc_bundle_add_container");
  if (rc != 0)
    return rc;
  if (kind != USMIPC_BUNDLE_DICT && kind != USMIPC_BUNDLE_LIST &&
      kind != USMIPC_BUNDLE_TUPLE)
    return usmipc__fail(USMIPC_EINVAL,
                        "usmipc_bundle_add_container: kind %d is not a dict, "
                        "list or tuple",
                        (int)kind);
  if ((rc = add_node(b, kind, count, key, key_len)) != 0)
    b->failed = rc;
  return rc;
}

/* The segment of the allocation ptr lies in: found in the bundle, or
 * exported now. */
/* The index of the bundle's segment holding ptr, or -1: the arrays added
 * so far are promised to stay allocated while the bundle lives, so an
 * address inside one of its segments is in that allocation, and another
 * library's array needs no driver query when its segment is known. */
static bool segment_holds(const segment_out_t *s, uintptr_t p, size_t n) {
  return p - s->ref.base < s->ref.size && n <= s->ref.size - (p - s->ref.base);
}

static long segment_by_range(const usmipc_bundle_t *b, uintptr_t p,
                             size_t extent) {
  if (b->last_seg < b->nseg && segment_holds(&b->segs[b->last_seg], p, extent))
    return (long)b->last_seg;
  size_t lo = 0, hi = b->nseg; /* by_base: segment indices sorted by base */
  while (lo < hi) {
    size_t mid = lo + (hi - lo) / 2;
    if (b->segs[b->by_base[mid]].ref.base <= p)
      lo = mid + 1;
    else
      hi = mid;
  }
  if (lo == 0)
    return -1;
  const segment_out_t *s = &b->segs[b->by_base[lo - 1]];
  return segment_holds(s, p, extent) ? (long)b->by_base[lo - 1] : -1;
}

static long segment_by_id(const usmipc_bundle_t *b,
                          const usmipc__allocation_ref_t *ref) {
  if (b->hash_cap == 0)
    return -1;
  for (size_t h =
           (size_t)(ref->buffer_id * 0x9E3779B97F4A7C15ull) & (b->hash_cap - 1);
       b->hash[h] != 0; h = (h + 1) & (b->hash_cap - 1)) {
    const segment_out_t *s = &b->segs[b->hash[h] - 1];
    if (s->ref.buffer_id == ref->buffer_id && s->ref.base == ref->base &&
        s->ref.device == ref->device)
      return (long)b->hash[h] - 1;
  }
  return -1;
}

static int segment_new(usmipc_bundle_t *b, const void *ptr, size_t extent,
                       usmipc__allocation_ref_t *want, uint32_t *index);

/* The segment of the allocation holding [ptr, ptr + extent): found in the
 * bundle, or exported now. Memory in physical chunks (CUDA VMM: PyTorch's
 * expandable segments) has no allocation beyond its chunks: its segment is
 * the run of whole chunks under the array, so arrays over other chunks of
 * the same reservation make segments of their own (which may share
 * chunks). */
static int segment_for(usmipc_bundle_t *b, const void *ptr, size_t extent,
                       uint32_t *index) {
  long known = segment_by_range(b, (uintptr_t)ptr, extent);
  if (known < 0) {
    usmipc__allocation_ref_t ref;
    int rc = usmipc__allocation_of(ptr, &ref);
    if (rc != 0)
      return rc;
    if (!ref.chunked)
      known = segment_by_id(b, &ref);
    if (known < 0)
      return segment_new(b, ptr, extent, &ref, index);
  }
  *index = (uint32_t)known;
  b->last_seg = (size_t)known;
  return 0;
}

static int segment_new(usmipc_bundle_t *b, const void *ptr, size_t extent,
                       usmipc__allocation_ref_t *want, uint32_t *index) {
  usmipc__allocation_ref_t ref = *want;
  int rc;
  if (b->nseg > 0 &&
      ref.device->ops->backend != b->segs[0].ref.device->ops->backend)
    return usmipc__fail(USMIPC_EWRONGDEVICE,
                        "%p is memory of %s, but the bundle already holds "
                        "memory of %s: a bundle holds one backend's memory",
                        ptr, ref.device->filter, b->segs[0].ref.device->filter);
  if (b->nseg == USMIPC__BUNDLE_MAX_SEGMENTS)
    return usmipc__fail(USMIPC_ENOMEM, "a bundle names at most %u allocations",
                        USMIPC__BUNDLE_MAX_SEGMENTS);
  size_t seg_cap = b->seg_cap;
  if ((rc = grow((void **)&b->segs, &b->seg_cap, b->nseg + 1,
                 sizeof(*b->segs))) != 0 ||
      (rc = grow((void **)&b->by_base, &seg_cap, b->nseg + 1,
                 sizeof(*b->by_base))) != 0)
    return rc;
  if (b->nseg + 1 > b->hash_cap / 2) { /* rehash at half full */
    size_t cap = b->hash_cap ? b->hash_cap * 2 : 64;
    uint32_t *h = calloc(cap, sizeof(*h));
    if (h == NULL)
      return usmipc__fail(USMIPC_ENOMEM, "out of memory");
    for (size_t i = 0; i < b->nseg; i++) {
      size_t at = (size_t)(b->segs[i].ref.buffer_id * 0x9E3779B97F4A7C15ull) &
                  (cap - 1);
      while (h[at] != 0)
        at = (at + 1) & (cap - 1);
      h[at] = (uint32_t)i + 1;
    }
    free(b->hash);
    b->hash = h;
    b->hash_cap = cap;
  }
  segment_out_t *s = &b->segs[b->nseg];
  usmipc__allocation_ref_t exported = {0};
  /* A run of chunks: from the chunk holding ptr to the one holding the
   * array's last byte. */
  size_t nbytes = ref.chunked ? (uintptr_t)ptr + extent - ref.base : 0;
  if ((rc = usmipc__export_allocation((const void *)ref.base, nbytes,
                                      ref.chunked ? NULL : &ref, &s->handle,
                                      &exported)) != 0)
    return rc;
  if (ref.chunked) {
    exported.device = ref.device;
    exported.chunked = true;
    long same = segment_by_id(b, &exported); /* the same run again */
    if (same >= 0) {
      usmipc_ipc_free_handle(s->handle);
      *index = (uint32_t)same;
      return 0;
    }
    ref = exported;
  } else if (exported.buffer_id != ref.buffer_id || exported.base != ref.base) {
    usmipc_ipc_free_handle(s->handle);
    return usmipc__fail(USMIPC_EUNKNOWNPTR,
                        "the allocation at %p changed while it was exported "
                        "(freed by another thread?)",
                        (const void *)ref.base);
  }
  s->ref = ref;
  size_t at =
      (size_t)(ref.buffer_id * 0x9E3779B97F4A7C15ull) & (b->hash_cap - 1);
  while (b->hash[at] != 0)
    at = (at + 1) & (b->hash_cap - 1);
  b->hash[at] = (uint32_t)b->nseg + 1;
  /* Into the by-base order: found by bisection, the rest moved up in one
   * memmove. Allocations often come in descending address order (mmap
   * places each new mapping below the last: host memory, pools), where a
   * step-by-step insertion made a bundle of n allocations O(n^2) compares
   * through segs (a twentieth of share() for 338 host tensors). */
  size_t lo = 0, hi = b->nseg;
  while (lo < hi) {
    size_t mid = lo + (hi - lo) / 2;
    if (b->segs[b->by_base[mid]].ref.base > ref.base)
      hi = mid;
    else
      lo = mid + 1;
  }
  memmove(b->by_base + lo + 1, b->by_base + lo,
          (b->nseg - lo) * sizeof(*b->by_base));
  b->by_base[lo] = (uint32_t)b->nseg;
  b->last_seg = b->nseg;
  *index = (uint32_t)b->nseg++;
  return 0;
}

static int add_array(usmipc_bundle_t *b, const char *key, size_t key_len,
                     const void *ptr, const usmipc_array_desc_t *desc) {
  if (desc == NULL || desc->ndim < 0 || desc->ndim > USMIPC_BUNDLE_MAX_NDIM ||
      (desc->ndim > 0 && desc->shape == NULL))
    return usmipc__fail(USMIPC_EINVAL,
                        "an array needs a description with 0 to %d "
                        "dimensions and its shape",
                        USMIPC_BUNDLE_MAX_NDIM);
  size_t itemsize = usmipc__bundle_itemsize(desc->dtype_code, desc->dtype_bits,
                                            desc->dtype_lanes);
  if (itemsize == 0)
    return usmipc__fail(USMIPC_EINVAL,
                        "DLPack dtype (code %u, %u bits, %u lanes) cannot "
                        "travel in a bundle: int, uint, float, bfloat16, "
                        "complex and bool of one lane can",
                        desc->dtype_code, desc->dtype_bits, desc->dtype_lanes);
  if (b->narr == USMIPC__BUNDLE_MAX_ARRAYS)
    return usmipc__fail(USMIPC_ENOMEM, "a bundle holds at most %u arrays",
                        USMIPC__BUNDLE_MAX_ARRAYS);
  int rc;
  size_t nd = (size_t)desc->ndim;
  if ((rc = grow((void **)&b->dims, &b->dims_cap, b->ndims + 2 * nd + 1,
                 sizeof(int64_t))) != 0 ||
      (rc = grow((void **)&b->arrays, &b->arr_cap, b->narr + 1,
                 sizeof(*b->arrays))) != 0)
    return rc;
  int64_t *shape = b->dims + b->ndims, *strides = shape + nd;
  if (nd > 0)
    memcpy(shape, desc->shape, nd * sizeof(int64_t));
  if (desc->strides != NULL && nd > 0) {
    memcpy(strides, desc->strides, nd * sizeof(int64_t));
  } else { /* C-contiguous */
    int64_t step = 1;
    for (size_t i = nd; i-- > 0;) {
      strides[i] = step;
      if (shape[i] > 1)
        step = (int64_t)((uint64_t)step * (uint64_t)shape[i]);
    }
  }
  usmipc_array_desc_t d = *desc;
  d.shape = shape;
  d.strides = strides;
  size_t extent = usmipc__bundle_extent(&d, itemsize);
  if (extent == SIZE_MAX)
    return usmipc__fail(USMIPC_EINVAL,
                        "an array's shape or strides are out of range "
                        "(negative strides cannot travel: pass a copy)");
  array_out_t a = {.segment = USMIPC__BUNDLE_NO_SEGMENT,
                   .code = desc->dtype_code,
                   .bits = desc->dtype_bits,
                   .lanes = desc->dtype_lanes,
                   .ndim = (uint8_t)nd,
                   .dims_at = b->ndims};
  if (extent > 0) {
    if ((rc = segment_for(b, ptr, extent, &a.segment)) != 0)
      return rc;
    const segment_out_t *s = &b->segs[a.segment];
    a.offset = (uint64_t)((uintptr_t)ptr - s->ref.base);
    if (a.offset > s->ref.size || extent > s->ref.size - a.offset)
      return usmipc__fail(USMIPC_ERANGE,
                          "an array of %zu bytes at %p overruns its "
                          "%zu-byte allocation at %p",
                          extent, ptr, s->ref.size, (const void *)s->ref.base);
  }
  if ((rc = add_node(b, USMIPC_BUNDLE_ARRAY, (uint32_t)b->narr, key,
                     key_len)) != 0)
    return rc;
  b->ndims += 2 * nd;
  b->arrays[b->narr++] = a;
  return 0;
}

int usmipc_bundle_add_array(usmipc_bundle_t *b, const char *key, size_t key_len,
                            const void *ptr, const usmipc_array_desc_t *desc) {
  int rc = check_building(b, "usmipc_bundle_add_array");
  if (rc != 0)
    return rc;
  if ((rc = add_array(b, key, key_len, ptr, desc)) != 0)
    b->failed = rc;
  return rc;
}

int usmipc_bundle_finish(usmipc_bundle_t *b) {
  int rc = check_building(b, "usmipc_bundle_finish");
  if (rc != 0)
    return rc;
  if (!usmipc__tree_complete(&b->tree))
    return usmipc__fail(
        USMIPC_EINVAL, "usmipc_bundle_finish: the tree is incomplete (%s)",
        b->tree.rooted ? "a container lacks children" : "no node was added");
  size_t len = USMIPC__BUNDLE_HDR_LEN;
  for (size_t i = 0; i < b->nseg; i++) {
    const void *data;
    size_t hlen;
    usmipc_ipc_handle_data(b->segs[i].handle, &data, &hlen);
    len += 2 + hlen;
  }
  for (size_t i = 0; i < b->narr; i++)
    len += USMIPC__BUNDLE_ARRAY_FIXED + 16u * b->arrays[i].ndim;
  len += b->nodes_len;
  if (len + USMIPC__BUNDLE_TAIL_MAX + 4 > USMIPC__BUNDLE_MAX_LEN)
    return usmipc__fail(USMIPC_ENOMEM,
                        "the bundle would take %zu bytes, more than the "
                        "%zu a bundle may",
                        len, USMIPC__BUNDLE_MAX_LEN);
  if ((b->bytes = malloc(len + USMIPC__BUNDLE_TAIL_MAX + 4)) == NULL)
    return usmipc__fail(USMIPC_ENOMEM, "out of memory");
  /* The bundle's own slot: its bytes are good while it lives. */
  if (b->nseg > 0) {
    uint32_t table_fd;
    b->id = usmipc__new_buffer_id();
    if ((rc = usmipc__random(b->token, 16)) != 0 ||
        (rc = usmipc__exports_add(
             b->id, UINT32_MAX, 0,
             usmipc__slot_tag(usmipc__self()->key, b->token), &b->slot,
             &table_fd)) != 0) {
      free(b->bytes);
      b->bytes = NULL;
      return rc;
    }
  }
  uint8_t *p = b->bytes;
  memset(p, 0, USMIPC__BUNDLE_HDR_LEN);
  memcpy(p, USMIPC__BUNDLE_MAGIC, 8);
  usmipc__put16le(p + USMIPC__BUNDLE_OFF_VERSION, USMIPC__BUNDLE_VERSION);
  usmipc__put64le(p + USMIPC__BUNDLE_OFF_ID, b->id);
  usmipc__put32le(p + USMIPC__BUNDLE_OFF_SLOT, b->slot);
  memcpy(p + USMIPC__BUNDLE_OFF_TOKEN, b->token, 16);
  usmipc__put32le(p + USMIPC__BUNDLE_OFF_NSEG, (uint32_t)b->nseg);
  usmipc__put32le(p + USMIPC__BUNDLE_OFF_NARR, (uint32_t)b->narr);
  usmipc__put32le(p + USMIPC__BUNDLE_OFF_NNODE, b->nnode);
  size_t at = USMIPC__BUNDLE_HDR_LEN;
  for (size_t i = 0; i < b->nseg; i++) {
    const void *data;
    size_t hlen;
    usmipc_ipc_handle_data(b->segs[i].handle, &data, &hlen);
    usmipc__put16le(p + at, (uint16_t)hlen);
    memcpy(p + at + 2, data, hlen);
    at += 2 + hlen;
  }
  for (size_t i = 0; i < b->narr; i++) {
    const array_out_t *a = &b->arrays[i];
    uint8_t *q = p + at;
    memset(q, 0, USMIPC__BUNDLE_ARRAY_FIXED);
    usmipc__put32le(q, a->segment);
    q[4] = a->code;
    q[5] = a->bits;
    usmipc__put16le(q + 6, a->lanes);
    usmipc__put64le(q + 8, a->offset);
    q[16] = a->ndim;
    for (size_t d = 0; d < 2u * a->ndim; d++)
      usmipc__put64le(q + USMIPC__BUNDLE_ARRAY_FIXED + 8 * d,
                      (uint64_t)b->dims[a->dims_at + d]);
    at += USMIPC__BUNDLE_ARRAY_FIXED + 16u * a->ndim;
  }
  memcpy(p + at, b->nodes, b->nodes_len);
  at += b->nodes_len;
  b->base_len = at;
  b->finished = true;
  pthread_mutex_lock(&live_lock);
  b->next_live = live;
  live = b;
  pthread_mutex_unlock(&live_lock);
  return usmipc_bundle_order(b, NULL);
}

int usmipc_bundle_order(usmipc_bundle_t *b, usmipc_queue_t *queue) {
  return usmipc_bundle_order_ex(b, queue, 0);
}

/* The tail is rebuilt at every handoff, as usmipc_ipc_handle_order_ex
 * rebuilds a handle's records: the bytes before it never change. A bundle
 * of no memory carries neither record: there is nothing to wait for or to
 * give back, and no allocation names the producer to a consumer. */
/* A handoff: the event on queue, and a ticket that `consumers` processes
 * return (with USMIPC_ORDER_RELEASE). */
static int order(usmipc_bundle_t *b, usmipc_queue_t *queue, unsigned flags,
                 unsigned consumers) {
  if (b == NULL || !b->finished)
    return usmipc__fail(USMIPC_EINVAL, "usmipc_bundle_order: %s",
                        b == NULL ? "NULL bundle" : "finish the bundle first");
  if (flags & ~USMIPC_ORDER_RELEASE)
    return usmipc__fail(USMIPC_EINVAL,
                        "usmipc_bundle_order_ex: unknown flags 0x%x", flags);
  /* Built aside: a failure leaves the bytes of the last handoff intact. */
  uint8_t tail[USMIPC__BUNDLE_TAIL_MAX];
  size_t tail_len = 0;
  int rc;
  if (queue != NULL && b->nseg > 0) {
    if (queue->device->ops->backend != b->segs[0].ref.device->ops->backend)
      return usmipc__fail(USMIPC_EWRONGDEVICE,
                          "usmipc_bundle_order: the bundle holds %s memory "
                          "but the queue is on %s",
                          b->segs[0].ref.device->filter, queue->device->filter);
    if ((rc = usmipc__event_order(queue, tail, &tail_len)) != 0)
      return rc;
  }
  if ((flags & USMIPC_ORDER_RELEASE) && b->nseg > 0 &&
      (rc = usmipc__release_ticket(&b->release, tail + tail_len, &tail_len,
                                   consumers)) != 0)
    return rc;
  memcpy(b->bytes + b->base_len, tail, tail_len);
  b->len = b->base_len + tail_len + 4;
  usmipc__put32le(b->bytes + USMIPC__BUNDLE_OFF_LENGTH, (uint32_t)b->len);
  usmipc__put32le(b->bytes + USMIPC__BUNDLE_OFF_TAIL_LEN, (uint32_t)tail_len);
  usmipc__put32le(b->bytes + b->len - 4,
                  usmipc__crc32c(0, b->bytes, b->len - 4));
  return 0;
}

int usmipc_bundle_order_ex(usmipc_bundle_t *b, usmipc_queue_t *queue,
                           unsigned flags) {
  return order(b, queue, flags, 1);
}

int usmipc_bundle_order_fanout(usmipc_bundle_t *b, usmipc_queue_t *queue,
                               unsigned consumers) {
  if (consumers == 0)
    return usmipc__fail(USMIPC_EINVAL,
                        "usmipc_bundle_order_fanout: 0 consumers (a handoff "
                        "goes to at least one process)");
  return order(b, queue, USMIPC_ORDER_RELEASE, consumers);
}

int usmipc_bundle_releases(const usmipc_bundle_t *b, uint64_t *sent,
                           uint64_t *released) {
  if (b == NULL)
    return usmipc__fail(USMIPC_EINVAL, "usmipc_bundle_releases: NULL bundle");
  usmipc__release_counts(&b->release, sent, released);
  return 0;
}

uint64_t usmipc_bundle_release_key(const usmipc_bundle_t *b) {
  return b != NULL ? usmipc__release_key(&b->release) : 0;
}

int usmipc_bundle_wait_released(usmipc_bundle_t *b, usmipc_queue_t *queue) {
  if (b == NULL)
    return usmipc__fail(USMIPC_EINVAL,
                        "usmipc_bundle_wait_released: NULL bundle");
  return usmipc__release_wait(&b->release, queue);
}

int usmipc_bundle_data(const usmipc_bundle_t *b, const void **data,
                       size_t *len) {
  if (b == NULL || data == NULL || len == NULL)
    return usmipc__fail(USMIPC_EINVAL, "usmipc_bundle_data: NULL argument");
  if (!b->finished)
    return usmipc__fail(USMIPC_EINVAL,
                        "usmipc_bundle_data: finish the bundle first");
  *data = b->bytes;
  *len = b->len;
  return 0;
}

int usmipc_bundle_counts(const usmipc_bundle_t *b, size_t *arrays,
                         size_t *allocations) {
  if (b == NULL)
    return usmipc__fail(USMIPC_EINVAL, "usmipc_bundle_counts: NULL bundle");
  if (arrays)
    *arrays = b->narr;
  if (allocations)
    *allocations = b->nseg;
  return 0;
}

usmipc_device_t *usmipc_bundle_device(const usmipc_bundle_t *b) {
  return b != NULL && b->nseg > 0 ? b->segs[0].ref.device : NULL;
}

int usmipc_bundle_free(usmipc_bundle_t *b) {
  if (b == NULL)
    return 0;
  if (b->finished) {
    pthread_mutex_lock(&live_lock);
    for (usmipc_bundle_t **l = &live; *l; l = &(*l)->next_live)
      if (*l == b) {
        *l = b->next_live;
        break;
      }
    pthread_mutex_unlock(&live_lock);
  }
  if (b->slot != USMIPC__BUNDLE_NO_SLOT) /* the bytes are refused from now on */
    usmipc__exports_remove(b->slot);
  /* Tickets still out are refused from now on: USMIPC_EEXPORTERGONE. */
  usmipc__release_free(b->release);
  for (size_t i = 0; i < b->nseg; i++)
    usmipc_ipc_free_handle(b->segs[i].handle);
  free(b->segs);
  free(b->by_base);
  free(b->hash);
  free(b->arrays);
  free(b->dims);
  free(b->nodes);
  free(b->bytes);
  free(b);
  return 0;
}

/* ---- the consumer's side (the bytes are decoded in wire/bundle_wire.c) -- */

/* The producer still holds the bundle: its slot (another process) or its
 * place in the live list (this process). */
static int check_live(const usmipc_opened_bundle_t *ob) {
  const usmipc__wire_t *w = &ob->seg0;
  const usmipc__process_t *self = usmipc__self_basic();
  if (w->nonce == self->nonce && w->pid == self->pid) {
    bool found = false;
    pthread_mutex_lock(&live_lock);
    for (usmipc_bundle_t *b = live; b && !found; b = b->next_live)
      found = b->id == ob->id && memcmp(b->token, ob->token, 16) == 0;
    pthread_mutex_unlock(&live_lock);
    return found ? 0
                 : usmipc__fail(USMIPC_EEXPORTERGONE,
                                "this process exported the bundle and has "
                                "freed it since");
  }
  if (memcmp(w->boot_id, self->boot_id, 16) != 0)
    return usmipc__fail(USMIPC_EOTHERHOST,
                        "the bundle was exported on another machine or boot");
  int state;
  int rc =
      usmipc__peer_slot_state(w, ob->slot, ob->id, ob->token, NULL, &state);
  if (rc != 0 || state > 0)
    return rc;
  return usmipc__fail(USMIPC_EEXPORTERGONE,
                      state == 0
                          ? "process %u no longer shares this bundle (it "
                            "freed the bundle, or the bytes are forged)"
                          : "process %u, which shared the bundle, has exited",
                      w->pid);
}

static void close_arrays(usmipc_opened_bundle_t *ob, size_t upto) {
  for (size_t i = 0; i < upto; i++)
    if (ob->arrays[i].ptr != NULL) {
      usmipc_ipc_close(ob->arrays[i].ptr);
      ob->arrays[i].ptr = NULL;
    }
}

/* ---- the trees opened last --------------------------------------------
 *
 * An engine opens the same tree every step (a kept bundle's handoffs differ
 * only in the records after the tree). The opens keep the decoded trees of
 * the last TEMPLATES bundles (usmipc__bundle_from_template, wire.h): an
 * open of the same tree again shares the decoded nodes, arrays and
 * allocations' handles instead of decoding them (half of a warm open of a
 * 338-array bundle on the host). A template is only the decode of bytes
 * already checked, never a mapping: what an open checks of the exporter and
 * maps goes on as before. The memory is bounded by what the templates
 * hold (template_bytes: the bytes, the decoded handles at about 1.9 KB an
 * allocation, the arrays and the nodes): at most TEMPLATE_MAX_BYTES for
 * one (a larger tree is decoded at each open) and TEMPLATES_MAX_BYTES for
 * all, the oldest dropped first. tmpl_lock guards the list, taken alone
 * (fork.c). */
enum { TEMPLATES = 4 };
#define TEMPLATE_MAX_BYTES ((size_t)16 << 20)
#define TEMPLATES_MAX_BYTES ((size_t)48 << 20)
static usmipc_opened_bundle_t *templates[TEMPLATES]; /* most recent first */

static size_t template_bytes(const usmipc_opened_bundle_t *t) {
  return t->len + t->nseg * (sizeof(usmipc__wire_t) + 12) +
         t->narr * (sizeof(usmipc_bundle_array_t) + 12) +
         t->nnode * sizeof(usmipc_bundle_node_t);
}

static void template_first(usmipc_opened_bundle_t *t) {
  usmipc_opened_bundle_t *evicted[TEMPLATES] = {NULL};
  pthread_mutex_lock(&tmpl_lock);
  size_t at = 0;
  while (at < TEMPLATES && templates[at] != t)
    at++;
  if (at == TEMPLATES) { /* new: the oldest goes */
    at = TEMPLATES - 1;
    evicted[0] = templates[at];
    usmipc__bundle_template_get(t);
  }
  for (; at > 0; at--)
    templates[at] = templates[at - 1];
  templates[0] = t;
  /* Then the oldest while all of them hold too much (the newest stays:
   * template_keep admits none above TEMPLATE_MAX_BYTES). */
  size_t total = 0, n = 1;
  for (size_t i = 0; i < TEMPLATES; i++) {
    if (templates[i] == NULL)
      continue;
    total += template_bytes(templates[i]);
    if (i > 0 && total > TEMPLATES_MAX_BYTES) {
      evicted[n++] = templates[i];
      templates[i] = NULL;
    }
  }
  pthread_mutex_unlock(&tmpl_lock);
  for (size_t i = 0; i < n; i++)
    usmipc__bundle_template_put(evicted[i]);
}

size_t usmipc__bundle_templates_for_test(size_t *bytes) {
  size_t n = 0, total = 0;
  pthread_mutex_lock(&tmpl_lock);
  for (size_t i = 0; i < TEMPLATES; i++)
    if (templates[i] != NULL) {
      n++;
      total += template_bytes(templates[i]);
    }
  pthread_mutex_unlock(&tmpl_lock);
  if (bytes != NULL)
    *bytes = total;
  return n;
}

/* The open's decode of data: from a template of the same tree (its
 * allocations' handles decoded, ob->segs), or decoded (without them: an
 * open that fails its checks of the exporter decodes no more). */
static int open_decode(const void *data, size_t len,
                       usmipc_opened_bundle_t **out) {
  usmipc_opened_bundle_t *held[TEMPLATES] = {NULL};
  pthread_mutex_lock(&tmpl_lock);
  for (size_t i = 0; i < TEMPLATES; i++)
    if (templates[i] != NULL && templates[i]->len == len) {
      held[i] = templates[i];
      usmipc__bundle_template_get(held[i]);
    }
  pthread_mutex_unlock(&tmpl_lock);
  int rc = 0;
  usmipc_opened_bundle_t *hit = NULL;
  for (size_t i = 0; i < TEMPLATES; i++) {
    if (held[i] != NULL && hit == NULL && rc == 0) {
      int same = usmipc__bundle_from_template(held[i], data, len, out);
      if (same > 0)
        hit = held[i];
      else if (same < 0)
        rc = same;
    }
  }
  if (hit != NULL)
    template_first(hit);
  for (size_t i = 0; i < TEMPLATES; i++)
    usmipc__bundle_template_put(held[i]);
  if (hit != NULL || rc != 0)
    return rc;
  return usmipc__bundle_decode(data, len, true, out);
}

/* ob, decoded in full for an open that passed its checks, kept as the
 * template of its tree (best effort: without memory it stays as it is). */
/* Only a bundle opened before gets a template: a producer that makes a new
 * bundle for every message (usmipc.torch's reducers, share() every step)
 * never opens one tree twice, and a template per open (made, then pushed
 * out by the next) cost it more than the decodes it never saved (its state
 * dict's handoff on an H100, run 65). The bundles seen last, by their id
 * and token (a kept bundle's handoffs share both), under tmpl_lock. */
enum { SEEN = 16 };
static struct {
  uint64_t id;
  uint8_t token[16];
} seen[SEEN];
static size_t seen_next;

static bool seen_before(const usmipc_opened_bundle_t *ob) {
  bool found = false;
  pthread_mutex_lock(&tmpl_lock);
  for (size_t i = 0; i < SEEN && !found; i++)
    found = seen[i].id == ob->id && memcmp(seen[i].token, ob->token, 16) == 0;
  if (!found) {
    seen[seen_next].id = ob->id;
    memcpy(seen[seen_next].token, ob->token, 16);
    seen_next = (seen_next + 1) % SEEN;
  }
  pthread_mutex_unlock(&tmpl_lock);
  return found;
}

static void template_keep(usmipc_opened_bundle_t *ob) {
  usmipc_opened_bundle_t *t;
  if (ob->tmpl != NULL || ob->nseg == 0 ||
      template_bytes(ob) > TEMPLATE_MAX_BYTES || !seen_before(ob) ||
      usmipc__bundle_adopt_template(ob, &t) != 0)
    return;
  template_first(t);
  usmipc__bundle_template_put(t); /* the list and ob hold it */
}

int usmipc_bundle_open(const void *data, size_t len, usmipc_device_t *device,
                       usmipc_queue_t *queue, unsigned flags,
                       usmipc_opened_bundle_t **opened) {
  if (opened == NULL)
    return usmipc__fail(USMIPC_EINVAL, "usmipc_bundle_open: opened is NULL");
  *opened = NULL;
  if (flags & ~USMIPC_OPEN_UNORDERED)
    return usmipc__fail(USMIPC_EINVAL, "usmipc_bundle_open: unknown flags 0x%x",
                        flags);
  if (queue != NULL && device != NULL && queue->device != device)
    return usmipc__fail(USMIPC_EINVAL,
                        "usmipc_bundle_open: the queue is on %s, not on the "
                        "target device %s",
                        queue->device->filter, device->filter);
  if (device == NULL && queue != NULL)
    device = queue->device;
  usmipc_opened_bundle_t *ob;
  int rc = open_decode(data, len, &ob);
  if (rc != 0)
    return rc;
  if (device == NULL && ob->nseg > 0)
    device = usmipc__device_by_uuid(ob->seg0.backend, ob->seg0.device_uuid);
  ob->device = device;
  if (ob->nseg > 0 && (rc = check_live(ob)) != 0) {
    usmipc__opened_bundle_free(ob);
    return rc;
  }
  if ((rc = usmipc__bundle_decode_segments(ob)) != 0) {
    usmipc__opened_bundle_free(ob);
    return rc;
  }
  template_keep(ob);
  /* Each allocation mapped once (its first array's reference), then one
   * more reference per further array in it. */
  void **base = calloc(ob->nseg ? ob->nseg : 1, sizeof(void *));
  uint32_t *uses = calloc(ob->nseg ? ob->nseg : 1, sizeof(uint32_t));
  if (base == NULL || uses == NULL) {
    free(base);
    free(uses);
    usmipc__opened_bundle_free(ob);
    return usmipc__fail(USMIPC_ENOMEM, "out of memory");
  }
  for (size_t i = 0; i < ob->narr; i++)
    if (ob->array_seg[i] != USMIPC__BUNDLE_NO_SEGMENT)
      uses[ob->array_seg[i]]++;
  /* The descriptors of every allocation not mapped yet, in one exchange
   * with the exporter (per 253; pidfd_getfd and /proc take them without
   * one), before anything is mapped. */
  const usmipc__wire_t **need = calloc(ob->nseg ? ob->nseg : 1, sizeof(*need));
  int *fds = malloc((ob->nseg ? ob->nseg : 1) * sizeof(int));
  size_t *need_at = calloc(ob->nseg ? ob->nseg : 1, sizeof(size_t));
  size_t nneed = 0;
  if (need == NULL || fds == NULL || need_at == NULL)
    rc = usmipc__fail(USMIPC_ENOMEM, "out of memory");
  for (size_t i = 0; rc == 0 && i < ob->nseg; i++) {
    fds[i] = -1;
    if ((ob->segs[i].flags & USMIPC__WIRE_FLAG_FD) &&
        !usmipc__import_cached(&ob->segs[i], device)) {
      need_at[nneed] = i;
      need[nneed++] = &ob->segs[i];
    }
  }
  if (rc == 0 && nneed > 0) {
    int *got = malloc(nneed * sizeof(int));
    if (got == NULL)
      rc = usmipc__fail(USMIPC_ENOMEM, "out of memory");
    else if ((rc = usmipc__prefetch_fds(
                  need, nneed, usmipc__deadline_after_timeout(), got)) != 0)
      usmipc__error_prefix("opening a bundle: ");
    for (size_t k = 0; rc == 0 && k < nneed; k++)
      fds[need_at[k]] = got[k];
    free(got);
  }
  free(need);
  free(need_at);
  size_t s = 0;
  for (; s < ob->nseg && rc == 0; s++) {
    int fd = fds[s];
    fds[s] = -1; /* the open owns it now */
    if ((rc = usmipc__open_mapping(&ob->segs[s], device, 0, fd, &base[s],
                                   NULL)) != 0) {
      usmipc__error_prefix("opening allocation %zu of %zu of the bundle: ", s,
                           ob->nseg);
      break;
    }
    if (uses[s] > 1 &&
        (rc = usmipc__mapping_addref(base[s], uses[s] - 1)) != 0) {
      usmipc_ipc_close(base[s]); /* its one reference; s is not dropped below */
      break;
    }
  }
  for (size_t k = s; fds != NULL && k < ob->nseg; k++)
    if (fds[k] >= 0) /* fetched for allocations not reached */
      close(fds[k]);
  free(fds);
  if (rc != 0) { /* drop what was taken: every reference of every mapping */
    for (size_t k = 0; k < s; k++)
      for (uint32_t u = 0; u < uses[k]; u++)
        usmipc_ipc_close(base[k]);
  } else {
    for (size_t i = 0; i < ob->narr; i++)
      if (ob->array_seg[i] != USMIPC__BUNDLE_NO_SEGMENT)
        ob->arrays[i].ptr =
            (uint8_t *)base[ob->array_seg[i]] + ob->array_off[i];
  }
  free(base);
  free(uses);
  if (ob->tmpl == NULL) /* a template's are the template's */
    free(ob->segs); /* mapped: an opened bundle keeps 12 bytes an allocation */
  ob->segs = NULL;
  if (rc == 0 && ob->order_event != NULL && !(flags & USMIPC_OPEN_UNORDERED)) {
    /* One wait for every array: the producer recorded one event. */
    if ((rc = usmipc__event_wait_wire(ob->order_event, device, queue)) != 0)
      usmipc__error_prefix("waiting for the producer's work: ");
    if (rc != 0)
      close_arrays(ob, ob->narr);
  }
  if (rc != 0) {
    usmipc__opened_bundle_free(ob);
    return rc;
  }
  *opened = ob;
  return 0;
}

int usmipc__bundle_reuse(usmipc_opened_bundle_t *ob, const void *data,
                         size_t len, usmipc_queue_t *queue, unsigned flags) {
  usmipc__wire_t *handoff, *order_event;
  int same = usmipc__bundle_same_tree(ob, data, len, &handoff, &order_event);
  if (same <= 0)
    return same;
  int rc = ob->nseg > 0 ? check_live(ob) : 0;
  if (rc == 0 && order_event != NULL && !(flags & USMIPC_OPEN_UNORDERED) &&
      (rc = usmipc__event_wait_wire(order_event, ob->device, queue)) != 0)
    usmipc__error_prefix("waiting for the producer's work: ");
  if (rc != 0) {
    free(handoff);
    free(order_event);
    return rc;
  }
  free(ob->handoff);
  free(ob->order_event);
  ob->handoff = handoff;
  ob->order_event = order_event;
  size_t prefix = ob->meta_at + ob->meta_len;
  memcpy(ob->bytes + prefix, (const uint8_t *)data + prefix, len - prefix);
  return 1;
}

const usmipc_bundle_node_t *
usmipc_opened_bundle_nodes(const usmipc_opened_bundle_t *ob, size_t *count) {
  if (count)
    *count = ob ? ob->nnode : 0;
  return ob ? ob->nodes : NULL;
}

const usmipc_bundle_array_t *
usmipc_opened_bundle_arrays(const usmipc_opened_bundle_t *ob, size_t *count) {
  if (count)
    *count = ob ? ob->narr : 0;
  return ob ? ob->arrays : NULL;
}

usmipc_device_t *usmipc_opened_bundle_device(const usmipc_opened_bundle_t *ob) {
  return ob ? ob->device : NULL;
}

uint64_t usmipc_opened_bundle_ticket(const usmipc_opened_bundle_t *ob) {
  return ob && ob->handoff && ob->handoff->has_release
             ? ob->handoff->release_ticket
             : 0;
}

int usmipc_bundle_close(usmipc_opened_bundle_t *ob) {
  if (ob == NULL)
    return 0;
  close_arrays(ob, ob->narr);
  usmipc__opened_bundle_free(ob);
  return 0;
}

int usmipc_bundle_release(usmipc_opened_bundle_t *ob) {
  usmipc__opened_bundle_free(ob);
  return 0;
}
