/* libFuzzer target for the bundle decoder (usmipc_bundle_inspect, the
 * checks usmipc_bundle_open runs before it maps anything).
 *
 * Bundle bytes cross the same untrusted channels as handle bytes: any input
 * must be refused with a message or described consistently. What a decoded
 * bundle promises, checked here: every array of memory lies inside the
 * allocation it names, arrays of no element name none, every allocation is
 * named by some array, the tree is a well-formed preorder walk that holds
 * every array once, in order, and its keys are UTF-8; the records after the
 * tree (ordering, release ticket) are what usmipc_ipc_release reads too, and
 * it judges the bytes as the decoder does. The bundle's own slot (offset 24)
 * is an index into the producer's export table: a decoded bundle's slot lies
 * inside the table, and the table reader, given the slot of any input,
 * refuses one beyond the table instead of reading it (an overflow of the
 * table's mapping under AddressSanitizer); every input is also tried with
 * its slot moved past the table.
 *
 * Nothing here opens a bundle: no mapping, no descriptor, no side effect.
 *   cmake --build build-fuzz --target fuzz_bundle
 *   build-fuzz/tests/fuzz/fuzz_bundle /tmp/fuzz-bundle tests/fuzz/corpus-bundle
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "objects.h"

#define FUZZ_TARGET "fuzz_bundle"
#include "fuzz.h"

/* An export table as an importer maps it: all slots free, so reading one
 * has no effect but the read (USMIPC__TABLE_BYTES of zero pages, once). */
static const uint8_t *fake_table(void) {
  static uint8_t *t;
  if (t == NULL) {
    t = calloc(1, USMIPC__TABLE_BYTES);
    FUZZ_CHECK(t != NULL, "calloc of a table");
    usmipc__put64le(t + USMIPC__HDR_SLOTS, USMIPC__TABLE_SLOTS);
  }
  return t;
}

static void check_slot(const uint8_t *data, size_t size, int rd,
                       size_t nseg) {
  if (size < 28)
    return;
  uint32_t slot = usmipc__get32le(data + 24);
  if (rd == 0)
    FUZZ_CHECK(nseg == 0 ? slot == UINT32_MAX : slot < USMIPC__TABLE_SLOTS,
               "decoded bundle of %zu allocations with slot %u", nseg, slot);
  usmipc__export_slot_t s;
  int rs = usmipc__table_read_slot(fake_table(), slot, &s, NULL);
  FUZZ_CHECK(rs == (slot < USMIPC__TABLE_SLOTS ? 0 : USMIPC_EBADHANDLE),
             "table read of slot %u: %d", slot, rs);
  FUZZ_CHECK(rs != 0 || (s.buffer_id == 0 && s.tag == 0), "slot %u", slot);
}

static void check_one(const uint8_t *data, size_t size) {
  size_t narr = 0, nseg = 0;
  usmipc_opened_bundle_t *ob = NULL;
  int ri = usmipc_bundle_inspect(data, size, &narr, &nseg);
  int rd = usmipc__bundle_decode_check(data, size, NULL, NULL, &ob);
  FUZZ_CHECK(ri == rd, "inspect %d, decode %d", ri, rd);
  /* The ticket's reader (usmipc_ipc_release of bundle bytes): refuses what
   * the decoder refuses; of good bytes it finds a ticket, or says that
   * there is none (EINVAL) or that the bundle lends no memory. */
  usmipc__wire_t w;
  bool no_memory = false;
  int rt = usmipc__bundle_ticket(data, size, "fuzz", &w, &no_memory);
  if (rd != 0)
    FUZZ_CHECK(rt == rd, "ticket %d, decode %d", rt, rd);
  else if (rt == 0 && !no_memory)
    FUZZ_CHECK(w.has_release && w.release_id != 0 && w.release_ticket != 0,
               "a ticket without its record");
  else
    FUZZ_CHECK(rt == USMIPC_EINVAL || (rt == 0 && no_memory && nseg == 0),
               "ticket %d (no memory %d) of good bytes", rt, (int)no_memory);
  check_slot(data, size, rd, nseg);
  if (rd != 0) {
    FUZZ_CHECK(rd == USMIPC_EBADHANDLE || rd == USMIPC_EHANDLEVERSION,
               "decode failed with %d (%s)", rd, usmipc_err_name(rd));
    const char *msg = usmipc_last_error();
    FUZZ_CHECK(msg != NULL && msg[0] != '\0', "no message for %d", rd);
    return;
  }
  size_t na, nn;
  const usmipc_bundle_array_t *a = usmipc_opened_bundle_arrays(ob, &na);
  const usmipc_bundle_node_t *n = usmipc_opened_bundle_nodes(ob, &nn);
  FUZZ_CHECK(na == narr, "%zu arrays, inspect said %zu", na, narr);
  FUZZ_CHECK(nn >= 1 && nn >= na, "%zu nodes for %zu arrays", nn, na);
  for (size_t i = 0; i < na; i++) {
    FUZZ_CHECK(a[i].ptr == NULL, "array %zu has a pointer before open", i);
    FUZZ_CHECK(a[i].desc.ndim >= 0 && a[i].desc.ndim <= USMIPC_BUNDLE_MAX_NDIM,
               "ndim %d", a[i].desc.ndim);
    FUZZ_CHECK(a[i].desc.dtype_lanes == 1, "lanes %u", a[i].desc.dtype_lanes);
    int empty = 0;
    for (int d = 0; d < a[i].desc.ndim; d++) {
      FUZZ_CHECK(a[i].desc.shape[d] >= 0 && a[i].desc.strides[d] >= 0,
                 "array %zu dim %d negative", i, d);
      empty |= a[i].desc.shape[d] == 0;
    }
    FUZZ_CHECK(empty == (a[i].extent == 0), "array %zu extent %zu", i,
               a[i].extent);
  }
  /* The tree: a preorder walk that ends exactly with the last node. */
  long need = 1;
  size_t next_array = 0;
  for (size_t i = 0; i < nn; i++) {
    FUZZ_CHECK(need > 0, "node %zu after the tree ended", i);
    need--;
    if (n[i].kind == USMIPC_BUNDLE_ARRAY)
      FUZZ_CHECK(n[i].count == next_array++, "array node %zu", i);
    else
      need += n[i].count;
  }
  FUZZ_CHECK(need == 0 && next_array == na, "tree ends with %ld open", need);
  usmipc_bundle_release(ob);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  check_one(data, size);
  /* Past the checksum, as a forger would (see fuzz_handle.c). */
  if (size >= 68 && size <= (1u << 20)) {
    uint8_t *copy = malloc(size);
    FUZZ_CHECK(copy != NULL, "malloc");
    memcpy(copy, data, size);
    /* The length too: most mutations change it. */
    usmipc__put32le(copy + 12, (uint32_t)size);
    usmipc__put32le(copy + size - 4, usmipc__crc32c(0, copy, size - 4));
    check_one(copy, size);
    /* The slot moved past the table (bit 20 set: at least 2^20), as in
     * issue 21's 0x00100005 and 0xFFFFFFF0: never decoded but for the
     * no-slot value of a bundle without memory (check_slot). */
    usmipc__put32le(copy + 24,
                    usmipc__get32le(data + size - 8) | USMIPC__TABLE_SLOTS);
    usmipc__put32le(copy + size - 4, usmipc__crc32c(0, copy, size - 4));
    check_one(copy, size);
    free(copy);
  }
  return 0;
}

/* ---- seeds (fuzz_replay_bundle --make-corpus DIR): real host bundles and
 * cut, mutated and forged ones ------------------------------------------ */
#ifndef USMIPC_LIBFUZZER
void fuzz_write_seed(const char *name, const uint8_t *data, size_t len);
int fuzz_make_corpus(void);

int fuzz_make_corpus(void) {
  usmipc_device_t *dev;
  usmipc_queue_t *q;
  void *mem, *mem2;
  if (usmipc_device_select("host:cpu", &dev) != 0 ||
      usmipc_malloc(dev, USMIPC_MEM_DEVICE, 1 << 16, &mem) != 0 ||
      usmipc_malloc(dev, USMIPC_MEM_DEVICE, 4096, &mem2) != 0 ||
      usmipc_queue_create(dev, &q) != 0) {
    fprintf(stderr, "fuzz_bundle: %s\n", usmipc_last_error());
    return 1;
  }
  int64_t s2[] = {16, 8}, st2[] = {16, 1}, s0[] = {0, 3}, s1[] = {100};
  usmipc_array_desc_t f32 = {2, 32, 1, 2, s2, NULL},
                      bf16 = {4, 16, 1, 2, s2, st2},
                      empty = {2, 16, 1, 2, s0, NULL},
                      scalar = {0, 64, 1, 0, NULL, NULL},
                      bytes = {1, 8, 1, 1, s1, NULL};
  for (int variant = 0; variant < 3; variant++) {
    usmipc_bundle_t *b;
    usmipc_bundle_create(&b);
    usmipc_bundle_add_container(b, USMIPC_BUNDLE_DICT, 3, NULL, 0);
    usmipc_bundle_add_array(b, "w", 1, mem, &f32);
    usmipc_bundle_add_container(b, USMIPC_BUNDLE_LIST, 3, "layers", 6);
    usmipc_bundle_add_array(b, NULL, 0, (uint8_t *)mem + 1024, &bf16);
    usmipc_bundle_add_array(b, NULL, 0, NULL, &empty);
    usmipc_bundle_add_container(b, USMIPC_BUNDLE_TUPLE, 2, NULL, 0);
    usmipc_bundle_add_array(b, NULL, 0, mem2, &scalar);
    usmipc_bundle_add_array(b, NULL, 0, (uint8_t *)mem2 + 8, &bytes);
    usmipc_bundle_add_array(b, "\xc3\xa9t\xc3\xa9", 5, (uint8_t *)mem + 4096,
                            &bytes);
    if (usmipc_bundle_finish(b) != 0 ||
        (variant == 1 && usmipc_bundle_order(b, q) != 0)) {
      fprintf(stderr, "fuzz_bundle: %s\n", usmipc_last_error());
      return 1;
    }
    const void *d;
    size_t len;
    usmipc_bundle_data(b, &d, &len);
    const uint8_t *data = d;
    if (variant < 2) {
      fuzz_write_seed(variant ? "valid-ordered" : "valid-nested", data, len);
    } else {
      uint8_t *c = malloc(len);
      size_t cuts[] = {0, 8, 63, 64, 66, len / 2, len - 5, len - 1};
      for (size_t i = 0; i < sizeof(cuts) / sizeof(cuts[0]); i++) {
        char name[32];
        snprintf(name, sizeof(name), "cut-%zu", cuts[i]);
        fuzz_write_seed(name, data, cuts[i]);
      }
      /* The bundle's slot past the export table (issue 21). */
      uint32_t slots[] = {USMIPC__TABLE_SLOTS, 0x00100005u, 0xFFFFFFF0u};
      for (size_t i = 0; i < sizeof(slots) / sizeof(slots[0]); i++) {
        char name[32];
        memcpy(c, data, len);
        usmipc__put32le(c + 24, slots[i]);
        usmipc__put32le(c + len - 4, usmipc__crc32c(0, c, len - 4));
        snprintf(name, sizeof(name), "forged-slot-%08x", slots[i]);
        fuzz_write_seed(name, c, len);
      }
      size_t flips[] = {9, 12, 48, 52, 56, 60, 66, len - 20, len - 9};
      for (size_t i = 0; i < sizeof(flips) / sizeof(flips[0]); i++) {
        char name[32];
        memcpy(c, data, len);
        c[flips[i]] ^= 0x41;
        usmipc__put32le(c + len - 4, usmipc__crc32c(0, c, len - 4));
        snprintf(name, sizeof(name), "forged-byte-%zu", flips[i]);
        fuzz_write_seed(name, c, len);
      }
      free(c);
    }
    usmipc_bundle_free(b);
  }
  /* Release tickets: ordered with a ticket, a ticket alone, and a tail
   * record that may not follow the tree (a pool block's type). */
  for (int variant = 0; variant < 3; variant++) {
    usmipc_bundle_t *b;
    usmipc_bundle_create(&b);
    usmipc_bundle_add_container(b, USMIPC_BUNDLE_LIST, 2, NULL, 0);
    usmipc_bundle_add_array(b, NULL, 0, mem, &f32);
    usmipc_bundle_add_array(b, NULL, 0, mem2, &bytes);
    if (usmipc_bundle_finish(b) != 0 ||
        usmipc_bundle_order_ex(b, variant == 1 ? NULL : q,
                               USMIPC_ORDER_RELEASE) != 0) {
      fprintf(stderr, "fuzz_bundle: %s\n", usmipc_last_error());
      return 1;
    }
    const void *d;
    size_t len;
    usmipc_bundle_data(b, &d, &len);
    uint8_t *c = malloc(len);
    memcpy(c, d, len);
    if (variant == 2) {
      usmipc__put16le(c + len - 4 - 4 - USMIPC__RELEASE_RECORD_LEN,
                      USMIPC__EXT_BLOCK);
      usmipc__put32le(c + len - 4, usmipc__crc32c(0, c, len - 4));
    }
    fuzz_write_seed(variant == 0   ? "valid-ticket"
                    : variant == 1 ? "valid-ticket-only"
                                   : "forged-tail-record",
                    c, len);
    free(c);
    usmipc_bundle_free(b);
  }
  /* A bundle of nothing but a zero-size array: no allocation, no slot. */
  usmipc_bundle_t *b;
  usmipc_bundle_create(&b);
  usmipc_bundle_add_array(b, NULL, 0, NULL, &empty);
  usmipc_bundle_finish(b);
  const void *d;
  size_t len;
  usmipc_bundle_data(b, &d, &len);
  fuzz_write_seed("valid-empty", d, len);
  usmipc_bundle_free(b);
  usmipc_queue_destroy(q);
  usmipc_free(mem);
  usmipc_free(mem2);
  return 0;
}
#endif
