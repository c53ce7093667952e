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
 * The format is in docs/handle-format.md ("Bundles"); tests/fuzz/
 * fuzz_bundle.c fuzzes the decoder. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common.h"

static const uint8_t MAGIC[8] = {0x89, 'U', 'S', 'M', 'I', 'P', 'C', 'B'};
#define VERSION 1
enum {
  OFF_VERSION = 8,
  OFF_FLAGS = 10,
  OFF_LENGTH = 12,
  OFF_ID = 16,
  OFF_SLOT = 24,
  OFF_RESERVED = 28,
  OFF_TOKEN = 32,
  OFF_NSEG = 48,
  OFF_NARR = 52,
  OFF_NNODE = 56,
  OFF_TAIL_LEN = 60, /* the handoff records after the tree */
  HDR_LEN = 64,
  ARRAY_FIXED = 24,
  NODE_FIXED = 8,
};
#define MAX_LEN ((size_t)64 << 20)
#define MAX_SEGMENTS 65536u
#define MAX_ARRAYS (1u << 20)
#define MAX_NODES (1u << 21)
#define MAX_DEPTH 64
#define NO_SEGMENT UINT32_MAX
#define NO_SLOT UINT32_MAX
#define MAX_DIM ((int64_t)1 << 62)
/* Room for the handoff records at the end of the bytes: an ordering record
 * and a release ticket. */
#define TAIL_MAX                                                               \
  (4 + USMIPC__ORDER_FIXED_LEN + USMIPC__EVENT_PAYLOAD_MAX + 4 +               \
   USMIPC__RELEASE_RECORD_LEN)

/* ---- checks shared by both sides ---------------------------------------- */

static size_t dtype_itemsize(uint8_t code, uint8_t bits, uint16_t lanes) {
  if (lanes != 1)
    return 0;
  switch (code) {
  case 0: /* int */
  case 1: /* uint */
    return bits == 8 || bits == 16 || bits == 32 || bits == 64 ? bits / 8u : 0;
  case 2: /* float */
    return bits == 16 || bits == 32 || bits == 64 ? bits / 8u : 0;
  case 4: /* bfloat */
    return bits == 16 ? 2 : 0;
  case 5: /* complex */
    return bits == 64 || bits == 128 ? bits / 8u : 0;
  case 6: /* bool */
    return bits == 8 ? 1 : 0;
  default:
    return 0;
  }
}

/* The bytes an array spans from its first element, 0 if it has none, or
 * SIZE_MAX when the shape or strides are out of range. */
static size_t array_extent(const usmipc_array_desc_t *d, size_t itemsize) {
  unsigned __int128 last = 0; /* element offset of the last element */
  bool empty = false;
  for (int i = 0; i < d->ndim; i++) { /* every dimension, also after a 0 */
    if (d->shape[i] < 0 || d->shape[i] > MAX_DIM || d->strides[i] < 0 ||
        d->strides[i] > MAX_DIM)
      return SIZE_MAX;
    empty |= d->shape[i] == 0;
  }
  if (empty)
    return 0;
  for (int i = 0; i < d->ndim; i++) {
    last += (unsigned __int128)(uint64_t)(d->shape[i] - 1) *
            (uint64_t)d->strides[i];
    if (last > (unsigned __int128)MAX_DIM)
      return SIZE_MAX;
  }
  unsigned __int128 bytes = (last + 1) * itemsize;
  return bytes > (unsigned __int128)MAX_DIM ? SIZE_MAX : (size_t)bytes;
}

/* Strict UTF-8: no overlongs, no surrogates, nothing past U+10FFFF. */
static bool utf8_valid(const uint8_t *s, size_t n) {
  size_t i = 0;
  while (i < n) {
    uint8_t c = s[i];
    size_t k;
    uint32_t cp;
    if (c < 0x80) {
      i++;
      continue;
    } else if (c >= 0xC2 && c <= 0xDF) {
      k = 1;
      cp = c & 0x1F;
    } else if (c >= 0xE0 && c <= 0xEF) {
      k = 2;
      cp = c & 0x0F;
    } else if (c >= 0xF0 && c <= 0xF4) {
      k = 3;
      cp = c & 0x07;
    } else {
      return false;
    }
    if (n - i <= k)
      return false;
    for (size_t j = 1; j <= k; j++) {
      if ((s[i + j] & 0xC0) != 0x80)
        return false;
      cp = (cp << 6) | (s[i + j] & 0x3F);
    }
    if ((k == 2 && (cp < 0x800 || (cp >= 0xD800 && cp <= 0xDFFF))) ||
        (k == 3 && (cp < 0x10000 || cp > 0x10FFFF)))
      return false;
    i += k + 1;
  }
  return true;
}

/* The tree's shape, checked node by node in preorder (both sides). */
typedef struct tree_check {
  struct {
    usmipc_bundle_node_kind_t kind;
    uint32_t left;
  } stack[MAX_DEPTH];
  int depth;
  bool rooted;
} tree_check_t;

/* Admits the next node: where it may stand, whether it needs a key. */
static int tree_push(tree_check_t *t, usmipc_bundle_node_kind_t kind,
                     uint32_t count, bool has_key, size_t key_len,
                     const char *what) {
  if (kind < USMIPC_BUNDLE_DICT || kind > USMIPC_BUNDLE_ARRAY)
    return usmipc__fail(USMIPC_EBADHANDLE,
                        "%s: node kind %d is none of dict (1), list (2), "
                        "tuple (3), array (4)",
                        what, (int)kind);
  if (t->rooted && t->depth == 0)
    return usmipc__fail(USMIPC_EBADHANDLE,
                        "%s: a node after the end of the tree (the root and "
                        "its children are complete)",
                        what);
  bool in_dict =
      t->depth > 0 && t->stack[t->depth - 1].kind == USMIPC_BUNDLE_DICT;
  if (in_dict && !has_key)
    return usmipc__fail(USMIPC_EBADHANDLE, "%s: a child of a dict needs a key",
                        what);
  /* One limit, as share() counts it: every node is a level, the root the
   * first, an array or an empty container as much as one with children (an
   * empty 65th level used to pass here: bundle_depth_one_limit). */
  if (t->depth == MAX_DEPTH)
    return usmipc__fail(USMIPC_EBADHANDLE,
                        "%s: the tree is nested deeper than %d levels", what,
                        MAX_DEPTH);
  if (!in_dict && (has_key || key_len != 0))
    return usmipc__fail(USMIPC_EBADHANDLE,
                        "%s: only a child of a dict has a key", what);
  t->rooted = true;
  if (t->depth > 0)
    t->stack[t->depth - 1].left--;
  if (kind != USMIPC_BUNDLE_ARRAY && count > 0) {
    t->stack[t->depth].kind = kind; /* depth < MAX_DEPTH: checked above */
    t->stack[t->depth].left = count;
    t->depth++;
  }
  while (t->depth > 0 && t->stack[t->depth - 1].left == 0)
    t->depth--;
  return 0;
}

static bool tree_complete(const tree_check_t *t) {
  return t->rooted && t->depth == 0;
}

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
  tree_check_t tree;
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
void usmipc__bundles_fork_prepare(void) { pthread_mutex_lock(&live_lock); }
void usmipc__bundles_fork_parent(void) { pthread_mutex_unlock(&live_lock); }
void usmipc__bundles_fork_child(void) { pthread_mutex_unlock(&live_lock); }

static int grow(void **p, size_t *cap, size_t need, size_t elem) {
  if (need <= *cap)
    return 0;
  size_t n = *cap ? *cap : 16;
  while (n < need)
    n *= 2;
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
  (*bundle)->slot = NO_SLOT;
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
  if (key != NULL && !utf8_valid((const uint8_t *)key, key_len))
    return usmipc__fail(USMIPC_EINVAL, "a dict key is not valid UTF-8");
  if (b->nnode == MAX_NODES)
    return usmipc__fail(USMIPC_ENOMEM, "a bundle holds at most %u nodes",
                        MAX_NODES);
  int rc = tree_push(&b->tree, kind, count, key != NULL, key_len, "bundle");
  if (rc == USMIPC_EBADHANDLE) { /* the caller's mistake: EINVAL */
    char why[256]; /* a copy: the message is formatted into its own buffer */
    snprintf(why, sizeof(why), "%s", usmipc_last_error());
    return usmipc__fail(USMIPC_EINVAL, "%s", why);
  }
  if (rc != 0)
    return rc;
  if ((rc = grow((void **)&b->nodes, &b->nodes_cap,
                 b->nodes_len + NODE_FIXED + key_len, 1)) != 0)
    return rc;
  uint8_t *n = b->nodes + b->nodes_len;
  n[0] = (uint8_t)kind;
  n[1] = key != NULL; /* bit 0: has a key */
  usmipc__put16le(n + 2, (uint16_t)key_len);
  usmipc__put32le(n + 4, count);
  if (key_len > 0)
    memcpy(n + NODE_FIXED, key, key_len);
  b->nodes_len += NODE_FIXED + key_len;
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
  if (b->nseg == MAX_SEGMENTS)
    return usmipc__fail(USMIPC_ENOMEM, "a bundle names at most %u allocations",
                        MAX_SEGMENTS);
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
  usmipc__allocation_ref_t exported;
  /* A run of chunks: from the chunk holding ptr to the one holding the
   * array's last byte. */
  size_t nbytes = ref.chunked ? (uintptr_t)ptr + extent - ref.base : 0;
  if ((rc = usmipc__export_allocation((const void *)ref.base, nbytes,
                                      &s->handle, &exported)) != 0)
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
  /* Into the by-base order (insertion: segments are few). */
  size_t pos = b->nseg;
  while (pos > 0 && b->segs[b->by_base[pos - 1]].ref.base > ref.base) {
    b->by_base[pos] = b->by_base[pos - 1];
    pos--;
  }
  b->by_base[pos] = (uint32_t)b->nseg;
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
  size_t itemsize =
      dtype_itemsize(desc->dtype_code, desc->dtype_bits, desc->dtype_lanes);
  if (itemsize == 0)
    return usmipc__fail(USMIPC_EINVAL,
                        "DLPack dtype (code %u, %u bits, %u lanes) cannot "
                        "travel in a bundle: int, uint, float, bfloat16, "
                        "complex and bool of one lane can",
                        desc->dtype_code, desc->dtype_bits, desc->dtype_lanes);
  if (b->narr == MAX_ARRAYS)
    return usmipc__fail(USMIPC_ENOMEM, "a bundle holds at most %u arrays",
                        MAX_ARRAYS);
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
  size_t extent = array_extent(&d, itemsize);
  if (extent == SIZE_MAX)
    return usmipc__fail(USMIPC_EINVAL,
                        "an array's shape or strides are out of range "
                        "(negative strides cannot travel: pass a copy)");
  array_out_t a = {.segment = NO_SEGMENT,
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
  if (!tree_complete(&b->tree))
    return usmipc__fail(
        USMIPC_EINVAL, "usmipc_bundle_finish: the tree is incomplete (%s)",
        b->tree.rooted ? "a container lacks children" : "no node was added");
  size_t len = HDR_LEN;
  for (size_t i = 0; i < b->nseg; i++) {
    const void *data;
    size_t hlen;
    usmipc_ipc_handle_data(b->segs[i].handle, &data, &hlen);
    len += 2 + hlen;
  }
  for (size_t i = 0; i < b->narr; i++)
    len += ARRAY_FIXED + 16u * b->arrays[i].ndim;
  len += b->nodes_len;
  if (len + TAIL_MAX + 4 > MAX_LEN)
    return usmipc__fail(USMIPC_ENOMEM,
                        "the bundle would take %zu bytes, more than the "
                        "%zu a bundle may",
                        len, MAX_LEN);
  if ((b->bytes = malloc(len + TAIL_MAX + 4)) == NULL)
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
  memset(p, 0, HDR_LEN);
  memcpy(p, MAGIC, 8);
  usmipc__put16le(p + OFF_VERSION, VERSION);
  usmipc__put64le(p + OFF_ID, b->id);
  usmipc__put32le(p + OFF_SLOT, b->slot);
  memcpy(p + OFF_TOKEN, b->token, 16);
  usmipc__put32le(p + OFF_NSEG, (uint32_t)b->nseg);
  usmipc__put32le(p + OFF_NARR, (uint32_t)b->narr);
  usmipc__put32le(p + OFF_NNODE, b->nnode);
  size_t at = HDR_LEN;
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
    memset(q, 0, ARRAY_FIXED);
    usmipc__put32le(q, a->segment);
    q[4] = a->code;
    q[5] = a->bits;
    usmipc__put16le(q + 6, a->lanes);
    usmipc__put64le(q + 8, a->offset);
    q[16] = a->ndim;
    for (size_t d = 0; d < 2u * a->ndim; d++)
      usmipc__put64le(q + ARRAY_FIXED + 8 * d,
                      (uint64_t)b->dims[a->dims_at + d]);
    at += ARRAY_FIXED + 16u * a->ndim;
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
int usmipc_bundle_order_ex(usmipc_bundle_t *b, usmipc_queue_t *queue,
                           unsigned flags) {
  if (b == NULL || !b->finished)
    return usmipc__fail(USMIPC_EINVAL, "usmipc_bundle_order: %s",
                        b == NULL ? "NULL bundle" : "finish the bundle first");
  if (flags & ~USMIPC_ORDER_RELEASE)
    return usmipc__fail(USMIPC_EINVAL,
                        "usmipc_bundle_order_ex: unknown flags 0x%x", flags);
  /* Built aside: a failure leaves the bytes of the last handoff intact. */
  uint8_t tail[TAIL_MAX];
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
      (rc = usmipc__release_ticket(&b->release, tail + tail_len, &tail_len)) !=
          0)
    return rc;
  memcpy(b->bytes + b->base_len, tail, tail_len);
  b->len = b->base_len + tail_len + 4;
  usmipc__put32le(b->bytes + OFF_LENGTH, (uint32_t)b->len);
  usmipc__put32le(b->bytes + OFF_TAIL_LEN, (uint32_t)tail_len);
  usmipc__put32le(b->bytes + b->len - 4,
                  usmipc__crc32c(0, b->bytes, b->len - 4));
  return 0;
}

int usmipc_bundle_releases(const usmipc_bundle_t *b, uint64_t *sent,
                           uint64_t *released) {
  if (b == NULL)
    return usmipc__fail(USMIPC_EINVAL, "usmipc_bundle_releases: NULL bundle");
  usmipc__release_counts(&b->release, sent, released);
  return 0;
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
  if (b->slot != NO_SLOT) /* the bytes are refused from now on */
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

/* ---- the consumer's side ------------------------------------------------- */

struct usmipc_opened_bundle {
  uint64_t id;
  uint32_t slot;
  uint8_t token[16];
  size_t nseg, narr, nnode;
  /* The allocations' handles: decoded and checked by decode(), which keeps
   * of each only where its bytes are and its size (12 bytes an allocation,
   * not a 1.9 KB wire); decoded again, all of them, by an open. */
  usmipc__wire_t seg0; /* allocation 0's, which names the exporter */
  uint32_t *seg_at;    /* offset in bytes of each allocation's handle */
  uint64_t *seg_nbytes;
  usmipc__wire_t *segs; /* by usmipc_bundle_open only, while it maps */
  uint32_t *array_seg;
  uint64_t *array_off;
  usmipc_bundle_array_t *arrays;
  int64_t *dims;
  usmipc_bundle_node_t *nodes;
  usmipc__wire_t *handoff;     /* allocation 0's handle with the tail's
                                  records (decoded), or NULL without them */
  usmipc__wire_t *order_event; /* the event to wait for (decoded), or NULL */
  uint8_t *bytes;              /* a copy: the keys point into it */
  bool borrowed;               /* bytes are the caller's (no copy) */
  size_t len;
  usmipc_device_t *device; /* where the arrays are mapped */
};

static void opened_free(usmipc_opened_bundle_t *ob) {
  if (ob == NULL)
    return;
  free(ob->handoff);
  free(ob->order_event);
  free(ob->segs);
  free(ob->seg_at);
  free(ob->seg_nbytes);
  free(ob->array_seg);
  free(ob->array_off);
  free(ob->arrays);
  free(ob->dims);
  free(ob->nodes);
  if (!ob->borrowed)
    free(ob->bytes);
  free(ob);
}

#define BAD(...)                                                               \
  usmipc__fail(USMIPC_EBADHANDLE, "not valid bundle bytes: " __VA_ARGS__)

/* The records after the tree are what a handoff adds to allocation 0's
 * handle, in the order usmipc_ipc_handle_order_ex appends them: an ordering
 * record (0x8002), then a release ticket (0x8003), each optional. Nothing
 * else may ride there: a forger could otherwise attach a record (a pool
 * block, say) that the allocation's own handle was checked without
 * (bundle_release_same_process shows one refused). */
static int check_tail(const uint8_t *r, size_t len) {
  unsigned last = 0;
  for (size_t at = 0; at < len;) {
    if (len - at < 4)
      return BAD("the records after the tree are truncated");
    uint16_t type = usmipc__get16le(r + at), rlen = usmipc__get16le(r + at + 2);
    unsigned rank = type == USMIPC__EXT_ORDER     ? 1
                    : type == USMIPC__EXT_RELEASE ? 2
                                                  : 0;
    if (rank == 0 || rank <= last)
      return BAD("a record of type 0x%04x after the tree: only an ordering "
                 "record (0x8002), then a release ticket (0x8003), may "
                 "follow it, each once",
                 type);
    if (rlen > len - at - 4)
      return BAD("record 0x%04x after the tree overruns the bundle", type);
    last = rank;
    at += 4u + rlen;
  }
  return 0;
}

/* Checks the tail as the handle it extends (allocation 0's, already
 * decoded: the records' own checks are the handle decoder's) and keeps
 * what the open and a release need from it. */
static int decode_tail(usmipc_opened_bundle_t *ob, const uint8_t *tail,
                       uint32_t tail_len) {
  const uint8_t *seg0 = ob->bytes + HDR_LEN + 2;
  size_t seg0_len = usmipc__get16le(ob->bytes + HDR_LEN);
  if (tail_len > TAIL_MAX || seg0_len + tail_len > UINT16_MAX)
    return BAD("%u bytes of records after the tree", tail_len);
  int rc = check_tail(tail, tail_len);
  if (rc != 0)
    return rc;
  uint8_t *buf = malloc(UINT16_MAX + 1);
  ob->handoff = malloc(sizeof(*ob->handoff));
  if (buf == NULL || ob->handoff == NULL) {
    free(buf);
    return usmipc__fail(USMIPC_ENOMEM, "out of memory");
  }
  size_t n = usmipc__wire_reorder(buf, seg0, seg0_len, tail, tail_len);
  rc = usmipc__wire_decode(buf, n, ob->handoff);
  free(buf);
  if (rc != 0) {
    usmipc__error_prefix("the records after the bundle's tree: ");
    return rc;
  }
  if (ob->handoff->order_len > 0) { /* the event the open waits for */
    if ((ob->order_event = malloc(sizeof(*ob->order_event))) == NULL)
      return usmipc__fail(USMIPC_ENOMEM, "out of memory");
    usmipc__wire_order_event(ob->handoff, ob->order_event);
  }
  return 0;
}

/* What makes two allocations the same one: the duplicate check sorts
 * these. */
typedef struct seg_key {
  uint64_t buffer_id;
  uint8_t uuid[16];
  uint32_t backend, index;
} seg_key_t;

static int key_cmp(const seg_key_t *a, const seg_key_t *b) {
  if (a->buffer_id != b->buffer_id)
    return a->buffer_id < b->buffer_id ? -1 : 1;
  if (a->backend != b->backend)
    return a->backend < b->backend ? -1 : 1;
  int c = memcmp(a->uuid, b->uuid, 16);
  if (c != 0)
    return c;
  return a->index < b->index ? -1 : a->index > b->index;
}

/* No allocation twice, in O(S log S) for S allocations whatever the ids:
 * they are the sender's, so comparing every pair (what this was) let 65,536
 * crafted allocations cost 10 s of every consumer's CPU, and an unkeyed hash
 * would be as slow under ids chosen to collide (bundle_decode_linear). A
 * merge sort, bottom up: its worst case is its usual case, unlike the C
 * library's qsort, which may be a quicksort. Reports the pair the old check
 * reported: the first allocation that repeats an earlier one. */
static int check_distinct(seg_key_t *keys, uint32_t n) {
  if (n < 2)
    return 0;
  seg_key_t *tmp = malloc(n * sizeof(*tmp));
  if (tmp == NULL)
    return usmipc__fail(USMIPC_ENOMEM, "out of memory");
  seg_key_t *from = keys, *to = tmp;
  for (size_t width = 1; width < n; width *= 2) {
    for (size_t lo = 0; lo < n; lo += 2 * width) {
      size_t mid = lo + width < n ? lo + width : n;
      size_t hi = lo + 2 * width < n ? lo + 2 * width : n;
      size_t i = lo, j = mid, k = lo;
      while (i < mid && j < hi)
        to[k++] = key_cmp(&from[j], &from[i]) < 0 ? from[j++] : from[i++];
      while (i < mid)
        to[k++] = from[i++];
      while (j < hi)
        to[k++] = from[j++];
    }
    seg_key_t *t = from;
    from = to;
    to = t;
  }
  /* Sorted by index within equal allocations: the first repeat of each is
   * its run's second entry. */
  uint32_t first = 0, again = UINT32_MAX;
  for (uint32_t i = 1, run = 0; i < n; i++) {
    bool same = from[i].buffer_id == from[i - 1].buffer_id &&
                from[i].backend == from[i - 1].backend &&
                memcmp(from[i].uuid, from[i - 1].uuid, 16) == 0;
    if (!same)
      run = i;
    else if (i == run + 1 && from[i].index < again) {
      first = from[run].index;
      again = from[i].index;
    }
  }
  free(tmp);
  if (again != UINT32_MAX)
    return BAD("allocations %u and %u are the same", first, again);
  return 0;
}

/* Every allocation's wire, for the open (decode() checked their bytes). */
static int decode_segments(usmipc_opened_bundle_t *ob) {
  if (ob->nseg == 0)
    return 0;
  if ((ob->segs = malloc(ob->nseg * sizeof(*ob->segs))) == NULL)
    return usmipc__fail(USMIPC_ENOMEM,
                        "out of memory opening a bundle of "
                        "%zu allocations",
                        ob->nseg);
  for (size_t i = 0; i < ob->nseg; i++) {
    const uint8_t *h = ob->bytes + ob->seg_at[i];
    int rc = usmipc__wire_decode(h + 2, usmipc__get16le(h), &ob->segs[i]);
    if (rc != 0)
      return rc;
  }
  return 0;
}

/* Checks everything about the bytes and describes them (pointers unset).
 * Without keep, the description borrows data (no copy: inspect and the
 * ticket's reader free it before they return; a copy of 64 MiB is what
 * their time would go to). */
static int decode(const void *data, size_t len, bool keep,
                  usmipc_opened_bundle_t **out) {
  *out = NULL;
  const uint8_t *p = data;
  if (data == NULL || len < HDR_LEN + 4)
    return BAD("%zu bytes, fewer than a bundle's header", len);
  if (memcmp(p, MAGIC, 8) != 0) {
    if (len >= 8 && memcmp(p, "\x89USMIPC\n", 8) == 0)
      return usmipc__fail(USMIPC_EBADHANDLE,
                          "these are the bytes of an IPC handle, not of a "
                          "bundle; open them with usmipc_ipc_open");
    return BAD("no bundle magic (\\x89USMIPCB) at the start");
  }
  if (usmipc__get16le(p + OFF_VERSION) != VERSION)
    return usmipc__fail(USMIPC_EHANDLEVERSION,
                        "bundle format version %u, but this usmipc (%s) "
                        "reads version %u",
                        usmipc__get16le(p + OFF_VERSION), USMIPC_VERSION_STRING,
                        VERSION);
  if (usmipc__get32le(p + OFF_LENGTH) != len)
    return BAD("the header says %u bytes, but %zu were given (truncated or "
               "padded)",
               usmipc__get32le(p + OFF_LENGTH), len);
  if (len > MAX_LEN)
    return BAD("%zu bytes, more than a bundle may have", len);
  if (usmipc__get32le(p + len - 4) != usmipc__crc32c(0, p, len - 4))
    return BAD("checksum mismatch (corrupted)");
  if (usmipc__get16le(p + OFF_FLAGS) != 0 ||
      usmipc__get32le(p + OFF_RESERVED) != 0)
    return BAD("unknown flags or reserved bits set");
  uint32_t nseg = usmipc__get32le(p + OFF_NSEG),
           narr = usmipc__get32le(p + OFF_NARR),
           nnode = usmipc__get32le(p + OFF_NNODE),
           tail_len = usmipc__get32le(p + OFF_TAIL_LEN);
  if (nseg > MAX_SEGMENTS || narr > MAX_ARRAYS || nnode > MAX_NODES ||
      nnode == 0)
    return BAD("%u allocations, %u arrays, %u nodes: out of range", nseg, narr,
               nnode);
  /* Each takes bytes: counts beyond the length are lies. */
  if ((uint64_t)nseg * 2 + (uint64_t)narr * ARRAY_FIXED +
          (uint64_t)nnode * NODE_FIXED + tail_len >
      len - HDR_LEN - 4)
    return BAD("the counts need more bytes than there are");
  if ((nseg == 0) != (usmipc__get32le(p + OFF_SLOT) == NO_SLOT) ||
      (nseg == 0 && tail_len != 0))
    return BAD("a bundle without allocations has no slot, no order and no "
               "release ticket");
  /* The slot is an index into the producer's export table, which an open
   * reads: a forger's slot past the table's end would read outside the
   * consumer's mapping of it (bundle_slot_out_of_range). */
  if (nseg > 0 && usmipc__get32le(p + OFF_SLOT) >= USMIPC__TABLE_SLOTS)
    return BAD("the bundle's slot %u is beyond the %u slots of an export "
               "table (forged or corrupted bytes; ask the producer for the "
               "bundle again)",
               usmipc__get32le(p + OFF_SLOT), USMIPC__TABLE_SLOTS);
  usmipc_opened_bundle_t *ob = calloc(1, sizeof(*ob));
  if (ob == NULL)
    return usmipc__fail(USMIPC_ENOMEM, "out of memory");
  int rc = 0;
  ob->id = usmipc__get64le(p + OFF_ID);
  ob->slot = usmipc__get32le(p + OFF_SLOT);
  memcpy(ob->token, p + OFF_TOKEN, 16);
  ob->nseg = nseg;
  ob->narr = narr;
  ob->nnode = nnode;
  ob->len = len;
  ob->seg_at = malloc((nseg ? nseg : 1) * sizeof(uint32_t));
  ob->seg_nbytes = malloc((nseg ? nseg : 1) * sizeof(uint64_t));
  ob->array_seg = malloc((narr ? narr : 1) * sizeof(uint32_t));
  ob->array_off = malloc((narr ? narr : 1) * sizeof(uint64_t));
  ob->arrays = calloc(narr ? narr : 1, sizeof(*ob->arrays));
  ob->nodes = calloc(nnode, sizeof(*ob->nodes));
  ob->borrowed = !keep;
  ob->bytes = keep ? malloc(len) : (uint8_t *)(uintptr_t)data;
  uint32_t *seg_uses = calloc(nseg ? nseg : 1, sizeof(uint32_t));
  /* For the duplicate check, freed once it is made; and a wire to decode
   * allocations 1 and on into, one after the other. */
  seg_key_t *keys = malloc((nseg ? nseg : 1) * sizeof(*keys));
  usmipc__wire_t *wire = malloc(sizeof(*wire));
  if (!keys || !wire || !ob->seg_at || !ob->seg_nbytes || !ob->array_seg ||
      !ob->array_off || !ob->arrays || !ob->nodes || !ob->bytes || !seg_uses) {
    rc = usmipc__fail(USMIPC_ENOMEM, "out of memory");
    goto fail;
  }
  if (keep)
    memcpy(ob->bytes, p, len);
  p = ob->bytes;
  size_t at = HDR_LEN, end = len - 4 - tail_len;
  for (uint32_t i = 0; i < nseg; i++) {
    if (end - at < 2) {
      rc = BAD("allocation %u is truncated", i);
      goto fail;
    }
    size_t hlen = usmipc__get16le(p + at);
    if (hlen > end - at - 2) {
      rc = BAD("allocation %u overruns the bundle", i);
      goto fail;
    }
    usmipc__wire_t *w = i == 0 ? &ob->seg0 : wire;
    if ((rc = usmipc__wire_decode(p + at + 2, hlen, w)) != 0) {
      usmipc__error_prefix("bundle allocation %u: ", i);
      goto fail;
    }
    ob->seg_at[i] = (uint32_t)at;
    ob->seg_nbytes[i] = w->nbytes;
    at += 2 + hlen;
    if (w->is_event || w->order_len != 0 || w->has_release || w->has_block ||
        w->offset != 0 || w->nbytes != w->allocation_size) {
      rc = BAD("allocation %u is not a plain handle of a whole allocation", i);
      goto fail;
    }
    const usmipc__wire_t *w0 = &ob->seg0;
    if (w->pid != w0->pid || w->nonce != w0->nonce ||
        memcmp(w->key, w0->key, 16) != 0 ||
        memcmp(w->boot_id, w0->boot_id, 16) != 0) {
      rc = BAD("allocation %u names another exporter than allocation 0", i);
      goto fail;
    }
    keys[i].buffer_id = w->buffer_id;
    memcpy(keys[i].uuid, w->device_uuid, 16);
    keys[i].backend = (uint32_t)w->backend;
    keys[i].index = i;
  }
  if ((rc = check_distinct(keys, nseg)) != 0)
    goto fail;
  free(keys);
  keys = NULL;
  free(wire);
  wire = NULL;
  /* Dimensions: the arrays' shape and strides, counted first. */
  size_t dims_total = 0, arrays_at = at;
  for (uint32_t i = 0; i < narr; i++) {
    if (end - at < ARRAY_FIXED) {
      rc = BAD("array %u is truncated", i);
      goto fail;
    }
    uint8_t nd = p[at + 16];
    if (nd > USMIPC_BUNDLE_MAX_NDIM || end - at - ARRAY_FIXED < 16u * nd) {
      rc = BAD("array %u: %u dimensions %s", i, nd,
               nd > USMIPC_BUNDLE_MAX_NDIM ? "(at most 32)"
                                           : "overrun the bundle");
      goto fail;
    }
    dims_total += 2u * nd;
    at += ARRAY_FIXED + 16u * nd;
  }
  if ((ob->dims = malloc((dims_total ? dims_total : 1) * sizeof(int64_t))) ==
      NULL) {
    rc = usmipc__fail(USMIPC_ENOMEM, "out of memory");
    goto fail;
  }
  at = arrays_at;
  size_t d_at = 0;
  for (uint32_t i = 0; i < narr; i++) {
    const uint8_t *q = p + at;
    usmipc_bundle_array_t *a = &ob->arrays[i];
    uint32_t seg = usmipc__get32le(q);
    a->desc.dtype_code = q[4];
    a->desc.dtype_bits = q[5];
    a->desc.dtype_lanes = usmipc__get16le(q + 6);
    uint64_t off = usmipc__get64le(q + 8);
    a->desc.ndim = q[16];
    for (int k = 17; k < ARRAY_FIXED; k++)
      if (q[k] != 0) {
        rc = BAD("array %u: reserved bytes set", i);
        goto fail;
      }
    int64_t *shape = ob->dims + d_at, *strides = shape + a->desc.ndim;
    for (int k = 0; k < 2 * a->desc.ndim; k++)
      shape[k] = (int64_t)usmipc__get64le(q + ARRAY_FIXED + 8 * k);
    a->desc.shape = shape;
    a->desc.strides = strides;
    d_at += 2u * (size_t)a->desc.ndim;
    at += ARRAY_FIXED + 16u * (size_t)a->desc.ndim;
    size_t itemsize = dtype_itemsize(a->desc.dtype_code, a->desc.dtype_bits,
                                     a->desc.dtype_lanes);
    if (itemsize == 0) {
      rc = BAD("array %u: DLPack dtype (%u, %u bits, %u lanes) is not one "
               "a bundle carries",
               i, a->desc.dtype_code, a->desc.dtype_bits, a->desc.dtype_lanes);
      goto fail;
    }
    size_t extent = array_extent(&a->desc, itemsize);
    if (extent == SIZE_MAX) {
      rc = BAD("array %u: shape or strides out of range", i);
      goto fail;
    }
    a->extent = extent;
    if (extent == 0) {
      if (seg != NO_SEGMENT || off != 0) {
        rc = BAD("array %u has no element but names memory", i);
        goto fail;
      }
    } else if (seg >= nseg) {
      rc = BAD("array %u names allocation %u of %u", i, seg, nseg);
      goto fail;
    } else if (off > ob->seg_nbytes[seg] ||
               extent > ob->seg_nbytes[seg] - off) {
      rc = BAD("array %u (%zu bytes at offset %llu) overruns its %llu-byte "
               "allocation",
               i, extent, (unsigned long long)off,
               (unsigned long long)ob->seg_nbytes[seg]);
      goto fail;
    } else {
      seg_uses[seg]++;
    }
    ob->array_seg[i] = seg;
    ob->array_off[i] = off;
  }
  for (uint32_t i = 0; i < nseg; i++)
    if (seg_uses[i] == 0) {
      rc = BAD("allocation %u is named by no array", i);
      goto fail;
    }
  tree_check_t tree = {0};
  uint32_t next_array = 0;
  for (uint32_t i = 0; i < nnode; i++) {
    if (end - at < NODE_FIXED) {
      rc = BAD("node %u is truncated", i);
      goto fail;
    }
    const uint8_t *q = p + at;
    usmipc_bundle_node_t *n = &ob->nodes[i];
    n->kind = (usmipc_bundle_node_kind_t)q[0];
    uint8_t flags = q[1];
    n->key_len = usmipc__get16le(q + 2);
    n->count = usmipc__get32le(q + 4);
    if (flags > 1 || n->key_len > end - at - NODE_FIXED) {
      rc = BAD("node %u: %s", i,
               flags > 1 ? "unknown flags" : "its key overruns the bundle");
      goto fail;
    }
    n->key = flags ? (const char *)q + NODE_FIXED : NULL;
    if (n->key && !utf8_valid((const uint8_t *)n->key, n->key_len)) {
      rc = BAD("node %u: its key is not valid UTF-8", i);
      goto fail;
    }
    /* A container's children are nodes that follow: no more than remain. */
    if (n->kind != USMIPC_BUNDLE_ARRAY && n->count > nnode - i - 1) {
      rc = BAD("node %u claims %u children, more than the nodes left", i,
               n->count);
      goto fail;
    }
    if (n->kind == USMIPC_BUNDLE_ARRAY && n->count != next_array++) {
      rc = BAD("node %u names array %u out of order", i, n->count);
      goto fail;
    }
    /* The node's number goes into the message on failure only: labels
     * formatted for 2^21 nodes would cost more than the checks. */
    if ((rc = tree_push(&tree, n->kind, n->count, n->key != NULL, n->key_len,
                        "not valid bundle bytes")) != 0) {
      char why[256];
      snprintf(why, sizeof(why), "%s",
               usmipc_last_error() + strlen("not valid bundle bytes: "));
      rc = BAD("node %u: %s", i, why);
      goto fail;
    }
    at += NODE_FIXED + n->key_len;
  }
  if (!tree_complete(&tree) || next_array != narr || at != end) {
    rc = BAD("%s", !tree_complete(&tree) ? "the tree is incomplete"
                   : next_array != narr  ? "arrays not in the tree"
                                         : "bytes left after the tree");
    goto fail;
  }
  if (tail_len > 0 && (rc = decode_tail(ob, p + end, tail_len)) != 0)
    goto fail;
  free(seg_uses);
  *out = ob;
  return 0;
fail:
  free(keys);
  free(wire);
  free(seg_uses);
  opened_free(ob);
  return rc;
}

int usmipc__bundle_decode_check(const void *data, size_t len, size_t *arrays,
                                size_t *allocations,
                                usmipc_opened_bundle_t **kept) {
  usmipc_opened_bundle_t *ob;
  int rc = decode(data, len, kept != NULL, &ob);
  if (rc != 0)
    return rc;
  if (arrays)
    *arrays = ob->narr;
  if (allocations)
    *allocations = ob->nseg;
  if (kept)
    *kept = ob;
  else
    opened_free(ob);
  return 0;
}

bool usmipc__bundle_magic(const void *data, size_t len) {
  return data != NULL && len >= 8 && memcmp(data, MAGIC, 8) == 0;
}

int usmipc__bundle_ticket(const void *data, size_t len, usmipc__wire_t *w,
                          bool *no_memory) {
  usmipc_opened_bundle_t *ob;
  int rc = decode(data, len, false, &ob);
  if (rc != 0)
    return rc;
  *no_memory = ob->nseg == 0;
  if (ob->handoff != NULL && ob->handoff->has_release)
    *w = *ob->handoff;
  else if (!*no_memory)
    rc = usmipc__fail(USMIPC_EINVAL,
                      "usmipc_ipc_release: the bundle carries no release "
                      "ticket (its producer did not order it with "
                      "usmipc_bundle_order_ex(..., USMIPC_ORDER_RELEASE), or "
                      "share(..., release=True) in Python)");
  opened_free(ob);
  return rc;
}

int usmipc_bundle_inspect(const void *data, size_t len, size_t *arrays,
                          size_t *allocations) {
  return usmipc__bundle_decode_check(data, len, arrays, allocations, NULL);
}

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
  int rc = decode(data, len, true, &ob);
  if (rc != 0)
    return rc;
  if (device == NULL && ob->nseg > 0)
    device = usmipc__device_by_uuid(ob->seg0.backend, ob->seg0.device_uuid);
  ob->device = device;
  if (ob->nseg > 0 && (rc = check_live(ob)) != 0) {
    opened_free(ob);
    return rc;
  }
  if ((rc = decode_segments(ob)) != 0) {
    opened_free(ob);
    return rc;
  }
  /* Each allocation mapped once (its first array's reference), then one
   * more reference per further array in it. */
  void **base = calloc(ob->nseg ? ob->nseg : 1, sizeof(void *));
  uint32_t *uses = calloc(ob->nseg ? ob->nseg : 1, sizeof(uint32_t));
  if (base == NULL || uses == NULL) {
    free(base);
    free(uses);
    opened_free(ob);
    return usmipc__fail(USMIPC_ENOMEM, "out of memory");
  }
  for (size_t i = 0; i < ob->narr; i++)
    if (ob->array_seg[i] != NO_SEGMENT)
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
      if (ob->array_seg[i] != NO_SEGMENT)
        ob->arrays[i].ptr =
            (uint8_t *)base[ob->array_seg[i]] + ob->array_off[i];
  }
  free(base);
  free(uses);
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
    opened_free(ob);
    return rc;
  }
  *opened = ob;
  return 0;
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
  opened_free(ob);
  return 0;
}

int usmipc_bundle_release(usmipc_opened_bundle_t *ob) {
  opened_free(ob);
  return 0;
}
