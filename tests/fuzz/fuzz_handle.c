/* libFuzzer target for the IPC handle parser (zstd's tests/fuzz habit: one
 * target per parser, plus replay.c to run the corpus without libFuzzer).
 *
 * Handle bytes arrive from other processes through channels usmipc does not
 * control, so usmipc__wire_decode and usmipc_ipc_handle_inspect must accept
 * any input without crashing, and must agree with each other. A handle that
 * decodes must encode back to the very same bytes (the round trip): decoding
 * may not silently drop or normalise anything that a forger could use.
 *
 * Nothing here opens a handle: no mapping, no descriptor, no side effect.
 *
 * Build and run (clang):
 *   cmake -S . -B build-fuzz -G Ninja -DCMAKE_C_COMPILER=clang -DUSMIPC_FUZZ=ON
 *   cmake --build build-fuzz --target fuzz_handle
 *   mkdir -p /tmp/fuzz-corpus
 *   build-fuzz/tests/fuzz/fuzz_handle /tmp/fuzz-corpus tests/fuzz/corpus \
 *       -max_len=512 -max_total_time=600
 * New inputs land in /tmp/fuzz-corpus (the first directory); keep the
 * committed corpus small and replay it with `ctest -R fuzz.replay`. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "objects.h"

#define FUZZ_TARGET "fuzz_handle"
#include "fuzz.h"

static void check_one(const uint8_t *data, size_t size) {
  usmipc_ipc_handle_info_t info;
  usmipc__wire_t w;
  int ri = usmipc_ipc_handle_inspect(data, size, &info);
  int rd = usmipc__wire_decode(data, size, &w);
  /* inspect is decode plus a copy of the public fields. */
  FUZZ_CHECK(ri == rd, "inspect %d, decode %d", ri, rd);
  if (rd != 0) {
    FUZZ_CHECK(rd == USMIPC_EBADHANDLE || rd == USMIPC_EHANDLEVERSION ||
                   rd == USMIPC_EINVAL,
               "decode failed with %d (%s)", rd, usmipc_err_name(rd));
    const char *msg = usmipc_last_error();
    FUZZ_CHECK(msg != NULL && msg[0] != '\0', "no message for %d", rd);
    return;
  }

  /* Round trip: the same length, the same bytes. */
  size_t n = usmipc__wire_len(&w);
  FUZZ_CHECK(n == size, "decoded a %zu-byte input as a %zu-byte handle", size,
             n);
  FUZZ_CHECK(w.payload.len <= USMIPC__PAYLOAD_MAX, "payload %u",
             (unsigned)w.payload.len);
  uint8_t *out = malloc(n);
  FUZZ_CHECK(out != NULL, "malloc");
  usmipc__wire_encode(&w, out);
  for (size_t i = 0; i < n; i++)
    FUZZ_CHECK(out[i] == data[i],
               "re-encoding differs at byte %zu: %02x != %02x", i, out[i],
               data[i]);
  free(out);

  /* What decoding promises about a handle it accepts. */
  FUZZ_CHECK(w.backend == USMIPC_BACKEND_HOST ||
                 w.backend == USMIPC_BACKEND_CUDA ||
                 w.backend == USMIPC_BACKEND_LEVEL_ZERO,
             "backend %d", (int)w.backend);
  if (w.is_event) {
    /* An event handle names no memory, and its record. */
    FUZZ_CHECK(w.payload.handle_kind == USMIPC__HANDLE_KIND_EVENT &&
                   w.nbytes == 0 && w.allocation_size == 0 && w.offset == 0 &&
                   w.order_len == 0 && w.export_slot < USMIPC__TABLE_SLOTS &&
                   w.buffer_id != 0,
               "event handle fields");
    FUZZ_CHECK((w.event_flags & ~USMIPC__EVENT_FLAGS_KNOWN) == 0,
               "event flags 0x%x", w.event_flags);
  } else {
    FUZZ_CHECK(w.payload.handle_kind != USMIPC__HANDLE_KIND_EVENT,
               "kind 128 without an event record");
    FUZZ_CHECK(w.nbytes > 0, "zero bytes");
    FUZZ_CHECK(w.allocation_size > 0 && w.offset <= w.allocation_size &&
                   w.nbytes <= w.allocation_size - w.offset,
               "range %llu+%llu of %llu", (unsigned long long)w.offset,
               (unsigned long long)w.nbytes,
               (unsigned long long)w.allocation_size);
  }
  if (w.has_block)
    FUZZ_CHECK(w.block_id != 0 && w.block_size != 0 &&
                   w.block_offset <= w.allocation_size &&
                   w.block_size <= w.allocation_size - w.block_offset &&
                   w.offset >= w.block_offset &&
                   w.nbytes <= w.block_size - (w.offset - w.block_offset),
               "block record");
  if (w.chunk_count != 0) {
    /* A run of chunks: bounded, fetched as descriptors, never with a pool
     * block, and its expanded sizes cover exactly the allocation. */
    FUZZ_CHECK(w.chunk_count >= 2 && w.chunk_count <= USMIPC__CHUNKS_MAX &&
                   w.chunk_runs >= 1 &&
                   w.chunk_runs <= USMIPC__CHUNK_RUNS_MAX &&
                   (w.flags & USMIPC__WIRE_FLAG_FD) &&
                   !(w.flags & USMIPC__WIRE_FLAG_REOPENABLE) && !w.has_block &&
                   !w.is_event &&
                   w.chunks_at + (size_t)w.chunk_runs * USMIPC__CHUNK_RUN_LEN <=
                       w.ext_len,
               "chunk record");
    uint64_t sizes[USMIPC__CHUNKS_MAX], total = 0;
    uint32_t k = usmipc__wire_chunk_sizes(&w, sizes);
    FUZZ_CHECK(k == w.chunk_count, "%u chunk sizes of %u", k,
               (unsigned)w.chunk_count);
    for (uint32_t i = 0; i < k; i++) {
      FUZZ_CHECK(sizes[i] != 0 && sizes[i] % 4096 == 0 &&
                     sizes[i] <= w.allocation_size - total,
                 "chunk %u of %llu bytes", i, (unsigned long long)sizes[i]);
      total += sizes[i];
    }
    FUZZ_CHECK(total == w.allocation_size, "chunks cover %llu of %llu",
               (unsigned long long)total,
               (unsigned long long)w.allocation_size);
    /* The writer makes the record the decoder accepted, byte for byte. */
    uint8_t rec[USMIPC__CHUNKS_RECORD_MAX];
    size_t rlen = usmipc__chunks_record(sizes, k, rec);
    FUZZ_CHECK(rlen == 4u + USMIPC__CHUNKS_FIXED_LEN +
                           (size_t)w.chunk_runs * USMIPC__CHUNK_RUN_LEN &&
                   memcmp(rec,
                          w.ext + w.chunks_at - 4 - USMIPC__CHUNKS_FIXED_LEN,
                          rlen) == 0,
               "chunk record not canonical");
  }
  if (w.has_release)
    FUZZ_CHECK(w.release_id != 0 && w.release_ticket != 0 &&
                   w.payload.handle_kind != USMIPC__HANDLE_KIND_EVENT,
               "release record");
  if (w.order_len != 0) {
    /* The ordering record lies inside the area and names an event the
     * importer can rebuild; rebuilding must not read past it. */
    FUZZ_CHECK(w.order_at >= 4 && w.order_at + w.order_len <= w.ext_len,
               "order record at %u+%u of %u", (unsigned)w.order_at,
               (unsigned)w.order_len, (unsigned)w.ext_len);
    usmipc__wire_t ev;
    usmipc__wire_order_event(&w, &ev);
    FUZZ_CHECK(ev.is_event && ev.payload.len <= USMIPC__EVENT_PAYLOAD_MAX &&
                   ev.export_slot < USMIPC__TABLE_SLOTS && ev.buffer_id != 0 &&
                   ev.event_point != 0,
               "rebuilt ordering event");
  }
  FUZZ_CHECK(w.pid != 0 && w.nonce != 0, "no exporter");

  /* Extension records of an accepted handle: well formed, none critical,
   * and each found where the walk says it is. */
  size_t at = 0;
  while (at < w.ext_len) {
    FUZZ_CHECK(w.ext_len - at >= 4, "record header overruns at %zu", at);
    uint16_t type = (uint16_t)(w.ext[at] | w.ext[at + 1] << 8);
    uint16_t rlen = (uint16_t)(w.ext[at + 2] | w.ext[at + 3] << 8);
    FUZZ_CHECK(rlen <= w.ext_len - at - 4, "record overruns at %zu", at);
    FUZZ_CHECK(type != 0 &&
                   (!(type & USMIPC__EXT_CRITICAL) ||
                    type == USMIPC__EXT_EVENT || type == USMIPC__EXT_ORDER ||
                    type == USMIPC__EXT_RELEASE || type == USMIPC__EXT_BLOCK ||
                    type == USMIPC__EXT_CHUNKS),
               "type 0x%04x", type);
    uint16_t flen = 0;
    const uint8_t *rec = usmipc__wire_ext_find(&w, type, &flen);
    FUZZ_CHECK(rec != NULL && rec >= w.ext + 4 &&
                   rec + flen <= w.ext + w.ext_len,
               "ext_find of type 0x%04x out of bounds", type);
    at += 4u + rlen;
  }

  /* inspect reports exactly the decoded fields. */
  FUZZ_CHECK(info.backend == w.backend && info.exporter_pid == w.pid &&
                 info.buffer_id == w.buffer_id &&
                 info.allocation_size == w.allocation_size &&
                 info.offset == w.offset && info.nbytes == w.nbytes &&
                 info.handle_kind == w.payload.handle_kind &&
                 memcmp(info.device_uuid, w.device_uuid, 16) == 0,
             "inspect disagrees with decode");
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  check_one(data, size);
  /* The CRC stops almost every mutation at the door. To reach the field
   * checks behind it, run the input a second time with its trailing four
   * bytes replaced by the CRC32C of the rest, as a forger would do. */
  if (size >= 8 && size <= 4096) {
    uint8_t *copy = malloc(size);
    FUZZ_CHECK(copy != NULL, "malloc");
    memcpy(copy, data, size);
    uint32_t crc = usmipc__crc32c(0, copy, size - 4);
    for (int i = 0; i < 4; i++)
      copy[size - 4 + (size_t)i] = (uint8_t)(crc >> (8 * i));
    check_one(copy, size);
    free(copy);
  }
  return 0;
}

/* ---- seeds (fuzz_replay --make-corpus DIR): real host handles of several
 * offsets and sizes, plus truncated, mutated and forged ones ------------- */
#ifndef USMIPC_LIBFUZZER
void fuzz_write_seed(const char *name, const uint8_t *data, size_t len);
int fuzz_make_corpus(void);

static void fix_crc(uint8_t *b, size_t len) {
  uint32_t c = usmipc__crc32c(0, b, len - 4);
  for (int i = 0; i < 4; i++)
    b[len - 4 + (size_t)i] = (uint8_t)(c >> (8 * i));
}

static void write_forged(const char *name, const usmipc__wire_t *w) {
  uint8_t out[2048];
  usmipc__wire_encode(w, out);
  fuzz_write_seed(name, out, usmipc__wire_len(w));
}

int fuzz_make_corpus(void) {
  usmipc_device_t *dev;
  int rc = usmipc_device_select("host:cpu", &dev);
  if (rc != 0) {
    fprintf(stderr, "fuzz_replay: %s\n", usmipc_last_error());
    return 2;
  }
  struct {
    size_t size, offset, nbytes;
  } shapes[] = {{4096, 0, 0},
                {65536, 4096, 8192},
                {300000, 12345, 0},
                {1 << 20, (1 << 20) - 1, 1}};
  uint8_t first[2048];
  size_t first_len = 0;
  void *ptrs[4];
  usmipc_ipc_handle_t *handles[4];
  for (int i = 0; i < 4; i++) {
    const void *data;
    size_t len;
    if ((rc = usmipc_malloc(dev, USMIPC_MEM_DEVICE, shapes[i].size,
                            &ptrs[i])) != 0 ||
        (rc = usmipc_ipc_get_handle((uint8_t *)ptrs[i] + shapes[i].offset,
                                    shapes[i].nbytes, &handles[i])) != 0 ||
        (rc = usmipc_ipc_handle_data(handles[i], &data, &len)) != 0) {
      fprintf(stderr, "fuzz_replay: export failed: %s\n", usmipc_last_error());
      return 2;
    }
    char name[64];
    snprintf(name, sizeof(name), "valid-%zu-at-%zu", shapes[i].size,
             shapes[i].offset);
    fuzz_write_seed(name, data, len);
    if (i == 0) {
      memcpy(first, data, len);
      first_len = len;
    }
  }

  /* Truncations and extensions. */
  static const size_t cuts[] = {0, 1, 8, 11, 12, 70, 167, 208, 211, 212};
  for (size_t i = 0; i < sizeof(cuts) / sizeof(cuts[0]); i++) {
    char name[64];
    snprintf(name, sizeof(name), "truncated-%zu", cuts[i]);
    fuzz_write_seed(name, first, cuts[i]);
  }
  uint8_t b[1024];
  memcpy(b, first, first_len);
  memset(b + first_len, 0, 16);
  fuzz_write_seed("trailing-zeros", b, first_len + 16);

  /* Single bit flips in each region of the fixed part. */
  static const size_t flips[] = {0,   8,   10,  12,  14,  16,  20,  24,  28,
                                 40,  56,  64,  72,  80,  88,  96,  104, 112,
                                 128, 144, 170, 190, 201, 205, 208, 210, 213};
  for (size_t i = 0; i < sizeof(flips) / sizeof(flips[0]); i++) {
    memcpy(b, first, first_len);
    b[flips[i]] ^= 0x04;
    char name[64];
    snprintf(name, sizeof(name), "bitflip-byte-%zu", flips[i]);
    fuzz_write_seed(name, b, first_len);
  }

  /* Well-formed (valid CRC) but wrong: what a forger writes. */
  memcpy(b, first, first_len);
  b[8] = 3; /* version */
  fix_crc(b, first_len);
  fuzz_write_seed("forged-version-3", b, first_len);
  memcpy(b, first, first_len);
  b[8] = 1; /* version 1: usmipc 0.1 */
  fix_crc(b, first_len);
  fuzz_write_seed("forged-version-1", b, first_len);
  memcpy(b, first, first_len);
  b[210] = 1; /* extension length that the total length does not hold */
  fix_crc(b, first_len);
  fuzz_write_seed("forged-ext-len", b, first_len);

  usmipc__wire_t w0, w;
  if (usmipc__wire_decode(first, first_len, &w0) != 0) {
    fprintf(stderr, "fuzz_replay: own handle does not decode: %s\n",
            usmipc_last_error());
    return 2;
  }
  w = w0;
  w.backend = USMIPC_BACKEND_CUDA;
  w.payload.handle_kind = 2;
  w.payload.len = 64;
  for (int i = 0; i < 64; i++)
    w.payload.bytes[i] = (uint8_t)(i * 7);
  write_forged("forged-cuda-payload", &w); /* decodes: a round-trip seed */
  w = w0;
  w.backend = (usmipc_backend_t)9;
  write_forged("forged-backend-9", &w);
  w = w0;
  w.offset = w.allocation_size;
  w.nbytes = 1;
  write_forged("forged-offset-at-end", &w);
  w = w0;
  w.offset = UINT64_MAX - 1;
  w.nbytes = 4;
  write_forged("forged-offset-wraps", &w);
  w = w0;
  w.nbytes = 0;
  write_forged("forged-zero-bytes", &w);
  w = w0;
  w.flags = 0x8001;
  write_forged("forged-unknown-flag", &w);
  w = w0;
  w.pid = 0;
  write_forged("forged-pid-0", &w);
  w = w0;
  w.exporter_base = UINT64_MAX - 16;
  write_forged("forged-base-wraps", &w);
  w = w0;
  w.payload.len = USMIPC__PAYLOAD_MAX;
  memset(w.payload.bytes, 0xff, USMIPC__PAYLOAD_MAX);
  write_forged("forged-max-payload", &w);
  /* Extension records: skipped, critical, truncated, overrunning, many. */
  static const uint8_t ext_ok[] = {0x01, 0x02, 2, 0, 0xaa, 0xbb};
  static const uint8_t ext_critical[] = {0x01, 0x82, 0, 0};
  static const uint8_t ext_short[] = {0x01, 0x02, 1};
  static const uint8_t ext_over[] = {0x01, 0x02, 0xff, 0, 1, 2};
  static const uint8_t ext_type0[] = {0, 0, 1, 0, 9};
  const struct {
    const char *name;
    const uint8_t *bytes;
    size_t len;
  } exts[] = {{"ext-skipped", ext_ok, sizeof(ext_ok)},
              {"ext-critical", ext_critical, sizeof(ext_critical)},
              {"ext-short", ext_short, sizeof(ext_short)},
              {"ext-overrun", ext_over, sizeof(ext_over)},
              {"ext-type-0", ext_type0, sizeof(ext_type0)}};
  for (size_t i = 0; i < sizeof(exts) / sizeof(exts[0]); i++) {
    w = w0;
    memcpy(w.ext, exts[i].bytes, exts[i].len);
    w.ext_len = (uint16_t)exts[i].len;
    write_forged(exts[i].name, &w);
  }
  w = w0;
  for (w.ext_len = 0; w.ext_len + 6 <= 240; w.ext_len += 6)
    memcpy(w.ext + w.ext_len, ext_ok, sizeof(ext_ok));
  write_forged("ext-many", &w);

  /* Events: an event handle and an ordered memory handle, valid, then with
   * the critical records broken. */
  usmipc_queue_t *q;
  usmipc_event_t *ev;
  usmipc_ipc_handle_t *eh;
  const void *edata;
  size_t elen;
  if (usmipc_queue_create(dev, &q) != 0 ||
      usmipc_event_create(dev, 0, &ev) != 0 ||
      usmipc_event_record(ev, q) != 0 ||
      usmipc_ipc_get_event_handle(ev, &eh) != 0 ||
      usmipc_ipc_handle_data(eh, &edata, &elen) != 0 ||
      usmipc_ipc_handle_order(handles[1], q) != 0) {
    fprintf(stderr, "fuzz_replay: events failed: %s\n", usmipc_last_error());
    return 2;
  }
  fuzz_write_seed("valid-event", edata, elen);
  const void *odata;
  size_t olen;
  usmipc_ipc_handle_data(handles[1], &odata, &olen);
  fuzz_write_seed("valid-ordered", odata, olen);
  if (usmipc_ipc_handle_order_ex(handles[2], q, USMIPC_ORDER_RELEASE) != 0)
    return 2;
  const void *rdata;
  size_t rlen;
  usmipc_ipc_handle_data(handles[2], &rdata, &rlen);
  fuzz_write_seed("valid-release", rdata, rlen);
  usmipc_pool_t *pool;
  void *block;
  usmipc_ipc_handle_t *bh;
  const void *bdata;
  size_t blen;
  if (usmipc_pool_create(dev, 1 << 20, 0, &pool) != 0 ||
      usmipc_pool_malloc(pool, 5000, 0, &block) != 0 ||
      usmipc_ipc_get_handle((uint8_t *)block + 100, 0, &bh) != 0 ||
      usmipc_ipc_handle_data(bh, &bdata, &blen) != 0)
    return 2;
  fuzz_write_seed("valid-pool-block", bdata, blen);
  usmipc_ipc_free_handle(bh);
  usmipc_free(block);
  usmipc_pool_destroy(pool);
  usmipc__wire_t we, wo;
  if (usmipc__wire_decode(edata, elen, &we) != 0 ||
      usmipc__wire_decode(odata, olen, &wo) != 0)
    return 2;
  w = we;
  w.nbytes = w.allocation_size = 4096;
  write_forged("event-names-memory", &w);
  w = we;
  w.ext[4 + 8] = 0x80; /* unknown event flag */
  write_forged("event-flag-unknown", &w);
  w = we;
  w.ext_len = 0; /* kind 128 without its record */
  write_forged("event-no-record", &w);
  w = wo;
  w.ext[w.order_at + 64] = 0xff; /* payload length beyond the record */
  write_forged("order-payload-len", &w);
  w = wo;
  memset(w.ext + w.order_at, 0, 16); /* no event, no point */
  write_forged("order-no-event", &w);
  w = wo;
  w.payload.handle_kind = USMIPC__HANDLE_KIND_EVENT; /* order in an event */
  write_forged("order-in-event-handle", &w);
  usmipc_ipc_free_handle(eh);
  usmipc_event_destroy(ev);
  usmipc_queue_destroy(q);

  /* Chunks (record 0x8102, another library's CUDA VMM memory): a valid
   * layout on a 1 MiB allocation, then forged ones. */
  usmipc__wire_t wc;
  const void *cdata;
  size_t clen;
  usmipc_ipc_handle_data(handles[3], &cdata, &clen);
  if (usmipc__wire_decode(cdata, clen, &wc) != 0)
    return 2;
  wc.flags = (uint16_t)(wc.flags & ~USMIPC__WIRE_FLAG_REOPENABLE);
  uint64_t csizes[8] = {1 << 18, 1 << 18, 1 << 17, 1 << 17,
                        1 << 16, 1 << 16, 1 << 16, 1 << 16};
  w = wc;
  w.ext_len = (uint16_t)usmipc__chunks_record(csizes, 8, w.ext);
  write_forged("valid-chunks", &w); /* decodes: 1 MiB in 3 runs */
  w = wc;
  csizes[7] = 1 << 15; /* 32 KiB short */
  w.ext_len = (uint16_t)usmipc__chunks_record(csizes, 8, w.ext);
  write_forged("chunks-short", &w);
  w = wc;
  csizes[7] = 1 << 16;
  w.ext_len = (uint16_t)usmipc__chunks_record(csizes, 8, w.ext);
  w.ext[4 + 8 + 16 + 8] = 1; /* the second run's count: 1 of 2 */
  write_forged("chunks-miscounted", &w);
  w = wc;
  w.ext_len = (uint16_t)usmipc__chunks_record(csizes, 2, w.ext);
  w.ext[4] = 1; /* one chunk */
  write_forged("chunks-one", &w);
  w = wc;
  w.ext_len = (uint16_t)usmipc__chunks_record(csizes, 8, w.ext);
  w.flags = 0; /* no descriptors */
  w.fd_number = UINT32_MAX;
  write_forged("chunks-no-fd", &w);

  for (int i = 0; i < 4; i++) {
    usmipc_ipc_free_handle(handles[i]);
    usmipc_free(ptrs[i]);
  }
  return 0;
}
#endif
