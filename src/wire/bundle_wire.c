/* The bundle byte format: the checks both sides make, and the decoder.
 *
 * Wire floor of the core: pure functions of bytes (no I/O, no locks), so
 * that tests/fuzz/fuzz_bundle.c can run them alone. The producer's object
 * and the open live in bundle.c; the format is in docs/handle-format.md
 * ("Bundles"). Each allocation in a bundle is an ordinary handle, decoded
 * by handle.c.
 *
 * Threats: every count, index, length and offset below comes from another
 * process and is bounded where it is read (docs/security.md lists each
 * field with its test). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "wire/wire.h"

/* ---- checks shared by both sides ---------------------------------------- */

size_t usmipc__bundle_itemsize(uint8_t code, uint8_t bits, uint16_t lanes) {
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
size_t usmipc__bundle_extent(const usmipc_array_desc_t *d, size_t itemsize) {
  unsigned __int128 last = 0; /* element offset of the last element */
  bool empty = false;
  for (int i = 0; i < d->ndim; i++) { /* every dimension, also after a 0 */
    if (d->shape[i] < 0 || d->shape[i] > USMIPC__BUNDLE_MAX_DIM ||
        d->strides[i] < 0 || d->strides[i] > USMIPC__BUNDLE_MAX_DIM)
      return SIZE_MAX;
    empty |= d->shape[i] == 0;
  }
  if (empty)
    return 0;
  for (int i = 0; i < d->ndim; i++) {
    last += (unsigned __int128)(uint64_t)(d->shape[i] - 1) *
            (uint64_t)d->strides[i];
    if (last > (unsigned __int128)USMIPC__BUNDLE_MAX_DIM)
      return SIZE_MAX;
  }
  unsigned __int128 bytes = (last + 1) * itemsize;
  return bytes > (unsigned __int128)USMIPC__BUNDLE_MAX_DIM ? SIZE_MAX
                                                           : (size_t)bytes;
}

/* Strict UTF-8: no overlongs, no surrogates, nothing past U+10FFFF. */
bool usmipc__utf8_valid(const uint8_t *s, size_t n) {
  size_t i = 0;
  while (i < n) {
    /* Keys are ASCII as a rule: eight bytes at a time while they are (a
     * 338-tensor state dict's keys are 10 KB, read at every open). */
    while (n - i >= 8) {
      uint64_t w;
      memcpy(&w, s + i, 8);
      if (w & 0x8080808080808080ull)
        break;
      i += 8;
    }
    if (i >= n)
      break;
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

/* Admits the next node: where it may stand, whether it needs a key. */
int usmipc__tree_push(usmipc__tree_check_t *t, usmipc_bundle_node_kind_t kind,
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
  if (t->depth == USMIPC__BUNDLE_MAX_DEPTH)
    return usmipc__fail(USMIPC_EBADHANDLE,
                        "%s: the tree is nested deeper than %d levels", what,
                        USMIPC__BUNDLE_MAX_DEPTH);
  if (!in_dict && (has_key || key_len != 0))
    return usmipc__fail(USMIPC_EBADHANDLE,
                        "%s: only a child of a dict has a key", what);
  t->rooted = true;
  if (t->depth > 0)
    t->stack[t->depth - 1].left--;
  if (kind != USMIPC_BUNDLE_ARRAY && count > 0) {
    t->stack[t->depth].kind =
        kind; /* depth < USMIPC__BUNDLE_MAX_DEPTH: checked above */
    t->stack[t->depth].left = count;
    t->depth++;
  }
  while (t->depth > 0 && t->stack[t->depth - 1].left == 0)
    t->depth--;
  return 0;
}

bool usmipc__tree_complete(const usmipc__tree_check_t *t) {
  return t->rooted && t->depth == 0;
}

/* ---- decoding ------------------------------------------------------------ */

void usmipc__opened_bundle_free(usmipc_opened_bundle_t *ob) {
  if (ob == NULL)
    return;
  if (ob->tmpl != NULL) { /* the rest is the template's */
    free(ob->handoff);
    free(ob->order_event);
    free(ob->arrays);
    free(ob->bytes);
    usmipc__bundle_template_put(ob->tmpl);
    free(ob);
    return;
  }
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
  const uint8_t *seg0 = ob->bytes + USMIPC__BUNDLE_HDR_LEN + 2;
  size_t seg0_len = usmipc__get16le(ob->bytes + USMIPC__BUNDLE_HDR_LEN);
  if (tail_len > USMIPC__BUNDLE_TAIL_MAX || seg0_len + tail_len > UINT16_MAX)
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

/* Every allocation's wire, for the open (usmipc__bundle_decode() checked their
 * bytes). */
int usmipc__bundle_decode_segments(usmipc_opened_bundle_t *ob) {
  if (ob->nseg == 0 || ob->segs != NULL)
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
int usmipc__bundle_decode(const void *data, size_t len, bool keep,
                          usmipc_opened_bundle_t **out) {
  *out = NULL;
  const uint8_t *p = data;
  if (data == NULL || len < USMIPC__BUNDLE_HDR_LEN + 4)
    return BAD("%zu bytes, fewer than a bundle's header", len);
  if (memcmp(p, USMIPC__BUNDLE_MAGIC, 8) != 0) {
    if (len >= 8 && memcmp(p, "\x89USMIPC\n", 8) == 0)
      return usmipc__fail(USMIPC_EBADHANDLE,
                          "these are the bytes of an IPC handle, not of a "
                          "bundle; open them with usmipc_ipc_open");
    return BAD("no bundle magic (\\x89USMIPCB) at the start");
  }
  if (usmipc__get16le(p + USMIPC__BUNDLE_OFF_VERSION) != USMIPC__BUNDLE_VERSION)
    return usmipc__fail(USMIPC_EHANDLEVERSION,
                        "bundle format version %u, but this usmipc (%s) "
                        "reads version %u",
                        usmipc__get16le(p + USMIPC__BUNDLE_OFF_VERSION),
                        USMIPC_VERSION_STRING, USMIPC__BUNDLE_VERSION);
  if (usmipc__get32le(p + USMIPC__BUNDLE_OFF_LENGTH) != len)
    return BAD("the header says %u bytes, but %zu were given (truncated or "
               "padded)",
               usmipc__get32le(p + USMIPC__BUNDLE_OFF_LENGTH), len);
  if (len > USMIPC__BUNDLE_MAX_LEN)
    return BAD("%zu bytes, more than a bundle may have", len);
  if (usmipc__get32le(p + len - 4) != usmipc__crc32c(0, p, len - 4))
    return BAD("checksum mismatch (corrupted)");
  if (usmipc__get16le(p + USMIPC__BUNDLE_OFF_FLAGS) != 0 ||
      usmipc__get32le(p + USMIPC__BUNDLE_OFF_RESERVED) != 0)
    return BAD("unknown flags or reserved bits set");
  uint32_t nseg = usmipc__get32le(p + USMIPC__BUNDLE_OFF_NSEG),
           narr = usmipc__get32le(p + USMIPC__BUNDLE_OFF_NARR),
           nnode = usmipc__get32le(p + USMIPC__BUNDLE_OFF_NNODE),
           tail_len = usmipc__get32le(p + USMIPC__BUNDLE_OFF_TAIL_LEN);
  if (nseg > USMIPC__BUNDLE_MAX_SEGMENTS || narr > USMIPC__BUNDLE_MAX_ARRAYS ||
      nnode > USMIPC__BUNDLE_MAX_NODES || nnode == 0)
    return BAD("%u allocations, %u arrays, %u nodes: out of range", nseg, narr,
               nnode);
  /* Each takes bytes: counts beyond the length are lies. */
  if ((uint64_t)nseg * 2 + (uint64_t)narr * USMIPC__BUNDLE_ARRAY_FIXED +
          (uint64_t)nnode * USMIPC__BUNDLE_NODE_FIXED + tail_len >
      len - USMIPC__BUNDLE_HDR_LEN - 4)
    return BAD("the counts need more bytes than there are");
  if ((nseg == 0) != (usmipc__get32le(p + USMIPC__BUNDLE_OFF_SLOT) ==
                      USMIPC__BUNDLE_NO_SLOT) ||
      (nseg == 0 && tail_len != 0))
    return BAD("a bundle without allocations has no slot, no order and no "
               "release ticket");
  /* The slot is an index into the producer's export table, which an open
   * reads: a forger's slot past the table's end would read outside the
   * consumer's mapping of it (bundle_slot_out_of_range). */
  if (nseg > 0 &&
      usmipc__get32le(p + USMIPC__BUNDLE_OFF_SLOT) >= USMIPC__TABLE_SLOTS)
    return BAD("the bundle's slot %u is beyond the %u slots of an export "
               "table (forged or corrupted bytes; ask the producer for the "
               "bundle again)",
               usmipc__get32le(p + USMIPC__BUNDLE_OFF_SLOT),
               USMIPC__TABLE_SLOTS);
  usmipc_opened_bundle_t *ob = calloc(1, sizeof(*ob));
  if (ob == NULL)
    return usmipc__fail(USMIPC_ENOMEM, "out of memory");
  int rc = 0;
  ob->id = usmipc__get64le(p + USMIPC__BUNDLE_OFF_ID);
  ob->slot = usmipc__get32le(p + USMIPC__BUNDLE_OFF_SLOT);
  memcpy(ob->token, p + USMIPC__BUNDLE_OFF_TOKEN, 16);
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
  size_t at = USMIPC__BUNDLE_HDR_LEN, end = len - 4 - tail_len;
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
  ob->meta_at = at; /* the arrays and the nodes: what a handoff keeps */
  ob->meta_len = end - at;
  for (uint32_t i = 0; i < narr; i++) {
    if (end - at < USMIPC__BUNDLE_ARRAY_FIXED) {
      rc = BAD("array %u is truncated", i);
      goto fail;
    }
    uint8_t nd = p[at + 16];
    if (nd > USMIPC_BUNDLE_MAX_NDIM ||
        end - at - USMIPC__BUNDLE_ARRAY_FIXED < 16u * nd) {
      rc = BAD("array %u: %u dimensions %s", i, nd,
               nd > USMIPC_BUNDLE_MAX_NDIM ? "(at most 32)"
                                           : "overrun the bundle");
      goto fail;
    }
    dims_total += 2u * nd;
    at += USMIPC__BUNDLE_ARRAY_FIXED + 16u * nd;
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
    for (int k = 17; k < USMIPC__BUNDLE_ARRAY_FIXED; k++)
      if (q[k] != 0) {
        rc = BAD("array %u: reserved bytes set", i);
        goto fail;
      }
    int64_t *shape = ob->dims + d_at, *strides = shape + a->desc.ndim;
    for (int k = 0; k < 2 * a->desc.ndim; k++)
      shape[k] =
          (int64_t)usmipc__get64le(q + USMIPC__BUNDLE_ARRAY_FIXED + 8 * k);
    a->desc.shape = shape;
    a->desc.strides = strides;
    d_at += 2u * (size_t)a->desc.ndim;
    at += USMIPC__BUNDLE_ARRAY_FIXED + 16u * (size_t)a->desc.ndim;
    size_t itemsize = usmipc__bundle_itemsize(
        a->desc.dtype_code, a->desc.dtype_bits, a->desc.dtype_lanes);
    if (itemsize == 0) {
      rc = BAD("array %u: DLPack dtype (%u, %u bits, %u lanes) is not one "
               "a bundle carries",
               i, a->desc.dtype_code, a->desc.dtype_bits, a->desc.dtype_lanes);
      goto fail;
    }
    size_t extent = usmipc__bundle_extent(&a->desc, itemsize);
    if (extent == SIZE_MAX) {
      rc = BAD("array %u: shape or strides out of range", i);
      goto fail;
    }
    a->extent = extent;
    if (extent == 0) {
      if (seg != USMIPC__BUNDLE_NO_SEGMENT || off != 0) {
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
  usmipc__tree_check_t tree = {0};
  uint32_t next_array = 0;
  for (uint32_t i = 0; i < nnode; i++) {
    if (end - at < USMIPC__BUNDLE_NODE_FIXED) {
      rc = BAD("node %u is truncated", i);
      goto fail;
    }
    const uint8_t *q = p + at;
    usmipc_bundle_node_t *n = &ob->nodes[i];
    n->kind = (usmipc_bundle_node_kind_t)q[0];
    uint8_t flags = q[1];
    n->key_len = usmipc__get16le(q + 2);
    n->count = usmipc__get32le(q + 4);
    if (flags > 1 || n->key_len > end - at - USMIPC__BUNDLE_NODE_FIXED) {
      rc = BAD("node %u: %s", i,
               flags > 1 ? "unknown flags" : "its key overruns the bundle");
      goto fail;
    }
    n->key = flags ? (const char *)q + USMIPC__BUNDLE_NODE_FIXED : NULL;
    if (n->key && !usmipc__utf8_valid((const uint8_t *)n->key, n->key_len)) {
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
    if ((rc = usmipc__tree_push(&tree, n->kind, n->count, n->key != NULL,
                                n->key_len, "not valid bundle bytes")) != 0) {
      char why[256];
      snprintf(why, sizeof(why), "%s",
               usmipc_last_error() + strlen("not valid bundle bytes: "));
      rc = BAD("node %u: %s", i, why);
      goto fail;
    }
    at += USMIPC__BUNDLE_NODE_FIXED + n->key_len;
  }
  if (!usmipc__tree_complete(&tree) || next_array != narr || at != end) {
    rc = BAD("%s", !usmipc__tree_complete(&tree) ? "the tree is incomplete"
                   : next_array != narr          ? "arrays not in the tree"
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
  usmipc__opened_bundle_free(ob);
  return rc;
}

int usmipc__bundle_decode_check(const void *data, size_t len, size_t *arrays,
                                size_t *allocations,
                                usmipc_opened_bundle_t **kept) {
  usmipc_opened_bundle_t *ob;
  int rc = usmipc__bundle_decode(data, len, kept != NULL, &ob);
  if (rc != 0)
    return rc;
  if (arrays)
    *arrays = ob->narr;
  if (allocations)
    *allocations = ob->nseg;
  if (kept)
    *kept = ob;
  else
    usmipc__opened_bundle_free(ob);
  return 0;
}

int usmipc__bundle_same_tree(const usmipc_opened_bundle_t *ob, const void *data,
                             size_t len, usmipc__wire_t **handoff,
                             usmipc__wire_t **order_event) {
  *handoff = *order_event = NULL;
  if (data == NULL || len != ob->len || len < USMIPC__BUNDLE_HDR_LEN + 4)
    return 0;
  const uint8_t *p = data;
  uint32_t tail_len = usmipc__get32le(ob->bytes + USMIPC__BUNDLE_OFF_TAIL_LEN);
  size_t prefix = len - 4 - tail_len;
  /* The header is in the prefix: equal prefixes have equal tail lengths. */
  if (memcmp(p, ob->bytes, prefix) != 0)
    return 0;
  usmipc_opened_bundle_t tmp;
  memset(&tmp, 0, sizeof(tmp));
  tmp.bytes = ob->bytes; /* allocation 0's handle, which the tail extends */
  int rc = tail_len > 0 ? decode_tail(&tmp, p + prefix, tail_len) : 0;
  if (rc != 0) {
    free(tmp.handoff);
    free(tmp.order_event);
    return rc;
  }
  *handoff = tmp.handoff;
  *order_event = tmp.order_event;
  return 1;
}

/* An open's own copies of t's arrays (its pointers are written per open)
 * and of the bytes data (the records are rewritten per handoff). */
static int open_copies(const usmipc_opened_bundle_t *t, const void *data,
                       size_t len, usmipc_bundle_array_t **arrays,
                       uint8_t **bytes) {
  *arrays = malloc((t->narr ? t->narr : 1) * sizeof(**arrays));
  *bytes = malloc(len);
  if (*arrays == NULL || *bytes == NULL) {
    free(*arrays);
    free(*bytes);
    return usmipc__fail(USMIPC_ENOMEM, "out of memory");
  }
  memcpy(*arrays, t->arrays, t->narr * sizeof(**arrays));
  memcpy(*bytes, data, len);
  return 0;
}

int usmipc__bundle_adopt_template(usmipc_opened_bundle_t *ob,
                                  usmipc_opened_bundle_t **out) {
  if (ob->borrowed) /* the template would outlive the caller's bytes */
    return usmipc__fail(USMIPC_EINVAL,
                        "a template needs a decode that kept its bytes");
  usmipc_bundle_array_t *arrays;
  uint8_t *bytes;
  usmipc_opened_bundle_t *t = malloc(sizeof(*t));
  if (t == NULL)
    return usmipc__fail(USMIPC_ENOMEM, "out of memory");
  int rc = open_copies(ob, ob->bytes, ob->len, &arrays, &bytes);
  if (rc != 0) {
    free(t);
    return rc;
  }
  /* The template keeps the decoded parts and the bytes the keys point
   * into; the open gets copies of what it writes. */
  *t = *ob;
  t->handoff = t->order_event = NULL;
  t->device = NULL;
  t->tmpl = NULL;
  t->tmpl_refs = 2;
  ob->arrays = arrays;
  ob->bytes = bytes;
  ob->tmpl = t;
  *out = t;
  return 0;
}

void usmipc__bundle_template_get(usmipc_opened_bundle_t *t) {
  __atomic_add_fetch(&t->tmpl_refs, 1, __ATOMIC_RELAXED);
}

void usmipc__bundle_template_put(usmipc_opened_bundle_t *t) {
  if (t != NULL && __atomic_sub_fetch(&t->tmpl_refs, 1, __ATOMIC_ACQ_REL) == 0)
    usmipc__opened_bundle_free(t);
}

int usmipc__bundle_from_template(usmipc_opened_bundle_t *t, const void *data,
                                 size_t len, usmipc_opened_bundle_t **out) {
  *out = NULL;
  const uint8_t *p = data;
  /* Another bundle's bytes differ in the header (its id and token): told
   * apart there, before the checksum over all of them. The checksum then,
   * as a decode checks it: bytes that fail it are left to the decoder,
   * which says what is wrong with them. */
  if (data == NULL || len != t->len ||
      memcmp(p, t->bytes, USMIPC__BUNDLE_HDR_LEN) != 0 ||
      usmipc__get32le(p + len - 4) != usmipc__crc32c(0, p, len - 4))
    return 0;
  usmipc__wire_t *handoff, *order_event;
  int same = usmipc__bundle_same_tree(t, data, len, &handoff, &order_event);
  if (same <= 0)
    return same;
  usmipc_bundle_array_t *arrays;
  uint8_t *bytes;
  usmipc_opened_bundle_t *ob = malloc(sizeof(*ob));
  int rc = ob == NULL ? usmipc__fail(USMIPC_ENOMEM, "out of memory")
                      : open_copies(t, data, len, &arrays, &bytes);
  if (rc != 0) {
    free(ob);
    free(handoff);
    free(order_event);
    return rc;
  }
  *ob = *t;
  ob->arrays = arrays;
  ob->bytes = bytes;
  ob->borrowed = false;
  ob->handoff = handoff;
  ob->order_event = order_event;
  ob->device = NULL;
  ob->tmpl = t;
  ob->tmpl_refs = 0;
  usmipc__bundle_template_get(t);
  *out = ob;
  return 1;
}

bool usmipc__bundle_magic(const void *data, size_t len) {
  return data != NULL && len >= 8 && memcmp(data, USMIPC__BUNDLE_MAGIC, 8) == 0;
}

int usmipc__bundle_ticket(const void *data, size_t len, const char *fn,
                          usmipc__wire_t *w, bool *no_memory) {
  usmipc_opened_bundle_t *ob;
  int rc = usmipc__bundle_decode(data, len, false, &ob);
  if (rc != 0)
    return rc;
  *no_memory = ob->nseg == 0;
  if (ob->handoff != NULL && ob->handoff->has_release)
    *w = *ob->handoff;
  else if (!*no_memory)
    rc = usmipc__fail(USMIPC_EINVAL,
                      "%s: the bundle carries no release "
                      "ticket (its producer did not order it with "
                      "usmipc_bundle_order_ex(..., USMIPC_ORDER_RELEASE), or "
                      "share(..., release=True) in Python)",
                      fn);
  usmipc__opened_bundle_free(ob);
  return rc;
}

int usmipc_bundle_inspect(const void *data, size_t len, size_t *arrays,
                          size_t *allocations) {
  return usmipc__bundle_decode_check(data, len, arrays, allocations, NULL);
}
