/* The IPC handle's wire format, version 2 (docs/handle-format.md is the
 * specification; this file follows it field by field). Handles arrive from
 * other processes through channels we do not control, so decoding treats the
 * bytes as untrusted: every length, field and the checksum is verified before
 * anything is used, and each defect has its own message.
 *
 * Floor 2 of the core (wire): pure functions of bytes, fuzzed by
 * tests/fuzz/fuzz_handle.c. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "wire/wire.h"

/* "\x89USMIPC\n": the high byte catches 7-bit channels, the newline catches
 * text-mode translation, and no text file starts with it (PNG's trick). */
static const uint8_t wire_magic[8] = {0x89, 'U', 'S', 'M', 'I', 'P', 'C', '\n'};

enum {
  OFF_MAGIC = 0,
  OFF_VERSION = 8,
  OFF_LENGTH = 10,
  OFF_BACKEND = 12,
  OFF_HANDLE_KIND = 13,
  OFF_FLAGS = 14,
  OFF_WRITER_VERSION = 16,
  OFF_UID = 20,
  OFF_PID = 24,
  OFF_FD_NUMBER = 28,
  OFF_DEVICE_UUID = 32,
  OFF_BOOT_ID = 48,
  OFF_NONCE = 64,
  OFF_START_TIME = 72,
  OFF_PIDFD_INO = 80,
  OFF_PID_NS = 88,
  OFF_NET_NS = 96,
  OFF_USER_NS = 104,
  OFF_BUFFER_ID = 112,
  OFF_EXPORTER_BASE = 120,
  OFF_ALLOCATION_SIZE = 128,
  OFF_OFFSET = 136,
  OFF_NBYTES = 144,
  OFF_FD_DEV = 152,
  OFF_FD_INO = 160,
  OFF_KEY = 168,
  OFF_TOKEN = 184,
  OFF_EXPORT_SLOT = 200,
  OFF_TABLE_FD = 204,
  OFF_PAYLOAD_LEN = 208,
  OFF_EXT_LEN = 210,
  OFF_PAYLOAD = USMIPC__WIRE_FIXED_LEN,
};
_Static_assert(OFF_PAYLOAD == 212, "fixed part is 212 bytes");

/* Version 1 (usmipc 0.1) had the same magic and version offset; its handles
 * are refused by name. */
#define WIRE_VERSION_1 1

/* ---- CRC32C (Castagnoli), the checksum iSCSI and ext4 use ---------------- */

static uint32_t crc_table[8][256];
static pthread_once_t crc_once = PTHREAD_ONCE_INIT;

static void crc_init(void) {
  for (uint32_t i = 0; i < 256; i++) {
    uint32_t c = i;
    for (int k = 0; k < 8; k++)
      c = (c >> 1) ^ (0x82F63B78u & (0u - (c & 1)));
    crc_table[0][i] = c;
  }
  for (uint32_t i = 0; i < 256; i++)
    for (int t = 1; t < 8; t++)
      crc_table[t][i] =
          (crc_table[t - 1][i] >> 8) ^ crc_table[0][crc_table[t - 1][i] & 0xff];
}

static uint32_t crc32c_portable(uint32_t crc, const uint8_t *p, size_t n) {
  pthread_once(&crc_once, crc_init);
  while (n >= 8) { /* slicing-by-8 */
    uint32_t lo = (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 |
                  (uint32_t)p[3] << 24;
    lo ^= crc;
    crc = crc_table[7][lo & 0xff] ^ crc_table[6][(lo >> 8) & 0xff] ^
          crc_table[5][(lo >> 16) & 0xff] ^ crc_table[4][lo >> 24] ^
          crc_table[3][p[4]] ^ crc_table[2][p[5]] ^ crc_table[1][p[6]] ^
          crc_table[0][p[7]];
    p += 8;
    n -= 8;
  }
  while (n--)
    crc = (crc >> 8) ^ crc_table[0][(crc ^ *p++) & 0xff];
  return crc;
}

#if defined(__x86_64__) && defined(__GNUC__)
/* SSE4.2 has a CRC32C instruction: 144 bytes in ~20 ns, which keeps decoding
 * out of the cached re-open's budget. Newer clang (zig cc, which builds the
 * release wheels) keeps the instruction under its own feature, crc32, that
 * sse4.2 no longer implies; gcc accepts the name too.
 *
 * One instruction takes 3 cycles to give its result and the next waits for
 * it, so a long buffer runs as three streams over three adjacent blocks,
 * one instruction of each in flight at once (a bundle of 4,719 arrays is
 * 516 KB, checked at every open: ~65 us in one stream). The register after
 * block A then block B is the register after A moved past |B| zero bytes,
 * xor the register of B alone: CRCs are linear over GF(2). Moving past n
 * zero bytes is a fixed 32x32 bit matrix, applied here by four 256-entry
 * tables per block length (zeros_long, zeros_short). */
#define CRC_LONG 4096
#define CRC_SHORT 128
static uint32_t zeros_long[4][256], zeros_short[4][256];
static pthread_once_t zeros_once = PTHREAD_ONCE_INIT;

/* The image of the vector vec under the matrix mat (a column per bit). */
static uint32_t gf2_times(const uint32_t mat[32], uint32_t vec) {
  uint32_t sum = 0;
  for (int i = 0; vec != 0; i++, vec >>= 1)
    if (vec & 1)
      sum ^= mat[i];
  return sum;
}

static void gf2_square(uint32_t out[32], const uint32_t mat[32]) {
  for (int i = 0; i < 32; i++)
    out[i] = gf2_times(mat, mat[i]);
}

/* The tables that move a register past len zero bytes (len a power of 2). */
static void zeros_tables(uint32_t table[4][256], size_t len) {
  uint32_t op[32], sq[32];
  /* One zero bit: a shift right, the polynomial folded in from bit 0. */
  op[0] = 0x82F63B78u;
  for (int i = 1; i < 32; i++)
    op[i] = 1u << (i - 1);
  for (size_t bits = 1; bits < 8 * len; bits *= 2) {
    gf2_square(sq, op);
    memcpy(op, sq, sizeof(op));
  }
  for (uint32_t n = 0; n < 256; n++)
    for (int k = 0; k < 4; k++)
      table[k][n] = gf2_times(op, n << (8 * k));
}

static void zeros_init(void) {
  zeros_tables(zeros_long, CRC_LONG);
  zeros_tables(zeros_short, CRC_SHORT);
}

static uint32_t zeros_apply(uint32_t table[4][256], uint32_t crc) {
  return table[0][crc & 0xff] ^ table[1][(crc >> 8) & 0xff] ^
         table[2][(crc >> 16) & 0xff] ^ table[3][crc >> 24];
}

__attribute__((target("sse4.2,crc32"))) static uint64_t
crc32c_words(uint64_t c, const uint8_t *p, size_t words) {
  for (; words > 0; words--, p += 8) {
    uint64_t v;
    memcpy(&v, p, 8);
    c = __builtin_ia32_crc32di(c, v);
  }
  return c;
}

/* Three streams over blocks of len bytes, as long as 3 * len remain. */
__attribute__((target("sse4.2,crc32"))) static uint64_t
crc32c_3way(uint64_t c0, const uint8_t **pp, size_t *np, size_t len,
            uint32_t table[4][256]) {
  const uint8_t *p = *pp;
  size_t n = *np;
  while (n >= 3 * len) {
    uint64_t c1 = 0, c2 = 0;
    for (size_t i = 0; i < len; i += 8) {
      uint64_t a, b, d;
      memcpy(&a, p + i, 8);
      memcpy(&b, p + len + i, 8);
      memcpy(&d, p + 2 * len + i, 8);
      c0 = __builtin_ia32_crc32di(c0, a);
      c1 = __builtin_ia32_crc32di(c1, b);
      c2 = __builtin_ia32_crc32di(c2, d);
    }
    c0 = zeros_apply(table, (uint32_t)c0) ^ (uint32_t)c1;
    c0 = zeros_apply(table, (uint32_t)c0) ^ (uint32_t)c2;
    p += 3 * len;
    n -= 3 * len;
  }
  *pp = p;
  *np = n;
  return c0;
}

__attribute__((target("sse4.2,crc32"))) static uint32_t
crc32c_sse42(uint32_t crc, const uint8_t *p, size_t n) {
  uint64_t c = crc;
  if (n >= 3 * CRC_SHORT) {
    pthread_once(&zeros_once, zeros_init);
    c = crc32c_3way(c, &p, &n, CRC_LONG, zeros_long);
    c = crc32c_3way(c, &p, &n, CRC_SHORT, zeros_short);
  }
  c = crc32c_words(c, p, n / 8);
  p += n / 8 * 8;
  n %= 8;
  uint32_t c32 = (uint32_t)c;
  while (n--)
    c32 = __builtin_ia32_crc32qi(c32, *p++);
  return c32;
}
#endif

uint32_t usmipc__crc32c(uint32_t crc, const void *data, size_t len) {
  crc = ~crc;
#if defined(__x86_64__) && defined(__GNUC__)
  /* Several threads may decode at once: the flag is read and written with
   * atomics (every writer stores the same value, so a race is harmless, but
   * it must not be a data race). */
  static int have_sse42 = -1;
  int have = __atomic_load_n(&have_sse42, __ATOMIC_RELAXED);
  if (have < 0) {
    have = __builtin_cpu_supports("sse4.2") ? 1 : 0;
    __atomic_store_n(&have_sse42, have, __ATOMIC_RELAXED);
  }
  if (have)
    return ~crc32c_sse42(crc, data, len);
#endif
  return ~crc32c_portable(crc, data, len);
}

size_t usmipc__wire_size(size_t payload_len) {
  return USMIPC__WIRE_FIXED_LEN + payload_len + 4;
}

size_t usmipc__wire_len(const usmipc__wire_t *w) {
  return USMIPC__WIRE_FIXED_LEN + w->payload.len + w->ext_len + 4;
}

void usmipc__wire_encode(const usmipc__wire_t *w, uint8_t *out) {
  size_t total = usmipc__wire_len(w);
  memset(out, 0, total);
  memcpy(out + OFF_MAGIC, wire_magic, sizeof(wire_magic));
  usmipc__put16le(out + OFF_VERSION, USMIPC__WIRE_VERSION);
  usmipc__put16le(out + OFF_LENGTH, (uint16_t)total);
  out[OFF_BACKEND] = (uint8_t)w->backend;
  out[OFF_HANDLE_KIND] = w->payload.handle_kind;
  usmipc__put16le(out + OFF_FLAGS, w->flags);
  usmipc__put32le(out + OFF_WRITER_VERSION, w->writer_version);
  usmipc__put32le(out + OFF_UID, w->uid);
  usmipc__put32le(out + OFF_PID, w->pid);
  usmipc__put32le(out + OFF_FD_NUMBER, w->fd_number);
  memcpy(out + OFF_DEVICE_UUID, w->device_uuid, 16);
  memcpy(out + OFF_BOOT_ID, w->boot_id, 16);
  usmipc__put64le(out + OFF_NONCE, w->nonce);
  usmipc__put64le(out + OFF_START_TIME, w->start_time);
  usmipc__put64le(out + OFF_PIDFD_INO, w->pidfd_ino);
  usmipc__put64le(out + OFF_PID_NS, w->pid_ns);
  usmipc__put64le(out + OFF_NET_NS, w->net_ns);
  usmipc__put64le(out + OFF_USER_NS, w->user_ns);
  usmipc__put64le(out + OFF_BUFFER_ID, w->buffer_id);
  usmipc__put64le(out + OFF_EXPORTER_BASE, w->exporter_base);
  usmipc__put64le(out + OFF_ALLOCATION_SIZE, w->allocation_size);
  usmipc__put64le(out + OFF_OFFSET, w->offset);
  usmipc__put64le(out + OFF_NBYTES, w->nbytes);
  usmipc__put64le(out + OFF_FD_DEV, w->fd_dev);
  usmipc__put64le(out + OFF_FD_INO, w->fd_ino);
  memcpy(out + OFF_KEY, w->key, 16);
  memcpy(out + OFF_TOKEN, w->token, 16);
  usmipc__put32le(out + OFF_EXPORT_SLOT, w->export_slot);
  usmipc__put32le(out + OFF_TABLE_FD, w->table_fd_number);
  usmipc__put16le(out + OFF_PAYLOAD_LEN, w->payload.len);
  usmipc__put16le(out + OFF_EXT_LEN, w->ext_len);
  memcpy(out + OFF_PAYLOAD, w->payload.bytes, w->payload.len);
  memcpy(out + OFF_PAYLOAD + w->payload.len, w->ext, w->ext_len);
  usmipc__put32le(out + total - 4, usmipc__crc32c(0, out, total - 4));
}

static int bad(const char *what) {
  return usmipc__fail(USMIPC_EBADHANDLE,
                      "not a valid usmipc IPC handle: %s; pass the exact "
                      "bytes that IPCMemoryHandle.to_bytes() / "
                      "usmipc_ipc_handle_data() produced",
                      what);
}

static void version_text(uint32_t hex, char *out, size_t len) {
  snprintf(out, len, "%u.%u.%u", (unsigned)(hex >> 16) & 0xff,
           (unsigned)(hex >> 8) & 0xff, (unsigned)hex & 0xff);
}

/* Other versions are refused with both versions named, and what to do.
 * Compatibility within version 2 comes from extension records instead of
 * new versions: an importer skips records it does not know unless they are
 * marked critical. */
static int wrong_version(const uint8_t *p, size_t len, uint16_t version) {
  char mine[16];
  version_text(USMIPC_VERSION_HEX, mine, sizeof(mine));
  if (version == WIRE_VERSION_1)
    return usmipc__fail(USMIPC_EHANDLEVERSION,
                        "the handle uses wire format version 1, written by "
                        "usmipc 0.1; this usmipc (%s) reads version %u: "
                        "upgrade the exporting process to the same release",
                        mine, USMIPC__WIRE_VERSION);
  char theirs[32] = "an unknown release";
  if (version > USMIPC__WIRE_VERSION && len >= OFF_WRITER_VERSION + 4)
    version_text(usmipc__get32le(p + OFF_WRITER_VERSION), theirs,
                 sizeof(theirs));
  return usmipc__fail(USMIPC_EHANDLEVERSION,
                      "the handle uses wire format version %u (written by "
                      "usmipc %s) but this usmipc (%s) reads version %u; use "
                      "the same usmipc release in the exporting and importing "
                      "processes",
                      version, theirs, mine, USMIPC__WIRE_VERSION);
}

/* The range of record types a backend owns (docs/handle-format.md); its
 * records are handed to the backend in the payload. They are never
 * critical: a backend that needs an importer to understand something uses
 * a handle kind of its own, which older importers refuse. A critical
 * record of that range is an unknown critical record like any other. */
static bool backend_record(const usmipc__wire_t *w, uint16_t type) {
  return w->backend == USMIPC_BACKEND_LEVEL_ZERO && type >= 0x0200 &&
         type <= 0x02ff;
}

/* Record 0x8001 (event handles): u64 point, u32 flags, u8 the backend's
 * event kind, 3 zero bytes. */
static int check_event_record(usmipc__wire_t *w, const uint8_t *r,
                              uint16_t rlen) {
  if (w->payload.handle_kind != USMIPC__HANDLE_KIND_EVENT)
    return bad("a memory handle carries an event record (0x8001)");
  if (rlen != USMIPC__EVENT_RECORD_LEN || w->is_event)
    return bad("its event record (0x8001) is malformed or repeated");
  w->event_point = usmipc__get64le(r);
  w->event_flags = usmipc__get32le(r + 8);
  w->event_kind = r[12];
  if ((w->event_flags & ~USMIPC__EVENT_FLAGS_KNOWN) || r[13] || r[14] || r[15])
    return bad("its event record (0x8001) sets unknown flags");
  w->is_event = true;
  return 0;
}

/* Record 0x8002 (ordered memory handles), USMIPC__ORDER_FIXED_LEN bytes and
 * the event's payload:
 *   0 u64 event id     8 u64 point        16 u32 slot     20 u32 flags
 *  24 16 token        40 u32 fd number    44 u16 wire flags of its fd
 *  46 u8 event kind   47 u8 0             48 u64 fd st_dev 56 u64 fd st_ino
 *  64 u16 payload length  66 u16 0        68 payload */
static int check_order_record(usmipc__wire_t *w, const uint8_t *r,
                              uint16_t rlen, size_t at) {
  if (w->payload.handle_kind == USMIPC__HANDLE_KIND_EVENT)
    return bad("an event handle carries an ordering record (0x8002)");
  if (w->order_len != 0)
    return bad("it carries two ordering records (0x8002)");
  if (rlen < USMIPC__ORDER_FIXED_LEN)
    return bad("its ordering record (0x8002) is truncated");
  uint16_t plen = usmipc__get16le(r + 64);
  uint16_t eflags = usmipc__get16le(r + 44);
  uint32_t flags = usmipc__get32le(r + 20);
  if (plen > USMIPC__EVENT_PAYLOAD_MAX ||
      rlen != USMIPC__ORDER_FIXED_LEN + plen)
    return bad("its ordering record's payload length is wrong");
  if (usmipc__get64le(r) == 0 || usmipc__get64le(r + 8) == 0)
    return bad("its ordering record names no event or no record");
  if ((flags & ~USMIPC__EVENT_FLAGS_KNOWN) || r[47] != 0 ||
      usmipc__get16le(r + 66) != 0 ||
      (eflags & ~(USMIPC__WIRE_FLAG_FD | USMIPC__WIRE_FLAG_REOPENABLE)))
    return bad("its ordering record (0x8002) sets unknown flags");
  if ((eflags & USMIPC__WIRE_FLAG_REOPENABLE) &&
      !(eflags & USMIPC__WIRE_FLAG_FD))
    return bad("its ordering record marks a descriptor reopenable but "
               "shares none");
  if (usmipc__get32le(r + 16) >= USMIPC__TABLE_SLOTS)
    return bad("its ordering record's export slot is out of range");
  if ((eflags & USMIPC__WIRE_FLAG_FD) && usmipc__get32le(r + 40) > INT32_MAX)
    return bad("its ordering record's descriptor number is out of range");
  if (w->export_slot == USMIPC__NO_SLOT || w->table_fd_number > INT32_MAX)
    return bad("it is ordered but names no export table");
  w->order_at = (uint16_t)(at + 4);
  w->order_len = rlen;
  w->event_point = usmipc__get64le(r + 8);
  w->event_flags = flags;
  return 0;
}

/* Record 0x8003 (memory handles): u64 release id, u64 ticket, 16 token. */
static int check_release_record(usmipc__wire_t *w, const uint8_t *r,
                                uint16_t rlen) {
  if (w->payload.handle_kind == USMIPC__HANDLE_KIND_EVENT)
    return bad("an event handle carries a release record (0x8003)");
  if (rlen != USMIPC__RELEASE_RECORD_LEN || w->has_release)
    return bad("its release record (0x8003) is malformed or repeated");
  w->release_id = usmipc__get64le(r);
  w->release_ticket = usmipc__get64le(r + 8);
  memcpy(w->release_token, r + 16, 16);
  if (w->release_id == 0 || w->release_ticket == 0)
    return bad("its release record names no release or no ticket");
  if (w->export_slot == USMIPC__NO_SLOT)
    return bad("it asks for a release but names no export table");
  w->has_release = true;
  return 0;
}

/* Record 0x8101 (memory handles): u64 block id, u32 slot, u32 0, 16 token,
 * u64 block offset in the allocation (the segment), u64 block size. The
 * exported range must lie in the block, the block in the allocation. */
static int check_block_record(usmipc__wire_t *w, const uint8_t *r,
                              uint16_t rlen) {
  if (w->payload.handle_kind == USMIPC__HANDLE_KIND_EVENT)
    return bad("an event handle carries a pool block record (0x8101)");
  if (rlen != USMIPC__BLOCK_RECORD_LEN || w->has_block)
    return bad("its pool block record (0x8101) is malformed or repeated");
  w->block_id = usmipc__get64le(r);
  w->block_slot = usmipc__get32le(r + 8);
  memcpy(w->block_token, r + 16, 16);
  w->block_offset = usmipc__get64le(r + 32);
  w->block_size = usmipc__get64le(r + 40);
  if (w->block_id == 0 || w->block_size == 0 || usmipc__get32le(r + 12) != 0)
    return bad("its pool block record names no block");
  if (w->block_slot >= USMIPC__TABLE_SLOTS || w->export_slot == USMIPC__NO_SLOT)
    return bad("its pool block record's export slot is out of range");
  if (w->block_offset > w->allocation_size ||
      w->block_size > w->allocation_size - w->block_offset)
    return bad("its pool block lies outside the allocation");
  if (w->offset < w->block_offset ||
      w->offset - w->block_offset > w->block_size ||
      w->nbytes > w->block_size - (w->offset - w->block_offset))
    return bad("its exported range lies outside its pool block");
  w->has_block = true;
  return 0;
}

/* Record 0x8102 (memory handles): u16 chunk count k, u16 run count r, u32
 * 0, then r runs of u64 chunk size, u32 chunks, u32 0. The chunks lie back
 * to back from the allocation's start, so their offsets follow from the
 * sizes: sorted and contiguous by construction. Checked strictly, since
 * the importer maps exactly these pieces: 2 <= k <= USMIPC__CHUNKS_MAX,
 * 1 <= r <= USMIPC__CHUNK_RUNS_MAX, sizes non-zero whole 4 KiB pages (the
 * backend checks its own granularity), adjacent runs of different sizes
 * (one encoding per layout), counts that add up to k, and sizes that add
 * up to the allocation size exactly. The descriptors travel through the
 * transport (FD, never reopenable). */
static int check_chunks_record(usmipc__wire_t *w, const uint8_t *r,
                               uint16_t rlen, size_t at) {
  if (w->payload.handle_kind == USMIPC__HANDLE_KIND_EVENT)
    return bad("an event handle carries a chunk record (0x8102)");
  if (w->chunk_count != 0)
    return bad("it carries two chunk records (0x8102)");
  if (rlen < USMIPC__CHUNKS_FIXED_LEN ||
      (rlen - USMIPC__CHUNKS_FIXED_LEN) % USMIPC__CHUNK_RUN_LEN != 0)
    return bad("its chunk record (0x8102) has a malformed length");
  uint16_t count = usmipc__get16le(r), runs = usmipc__get16le(r + 2);
  if (usmipc__get32le(r + 4) != 0)
    return bad("its chunk record (0x8102) sets reserved bytes");
  if (runs == 0 || runs > USMIPC__CHUNK_RUNS_MAX ||
      rlen != USMIPC__CHUNKS_FIXED_LEN + runs * USMIPC__CHUNK_RUN_LEN)
    return bad("its chunk record's run count disagrees with its length or "
               "exceeds 48");
  if (count < 2 || count > USMIPC__CHUNKS_MAX)
    return bad("its chunk record names fewer than 2 or more than 250 chunks");
  if (!(w->flags & USMIPC__WIRE_FLAG_FD) ||
      (w->flags & USMIPC__WIRE_FLAG_REOPENABLE))
    return bad("its chunk record comes without descriptors to fetch (FD) or "
               "with reopenable ones");
  uint64_t total = 0, prev = 0;
  uint32_t chunks = 0;
  for (uint16_t i = 0; i < runs; i++) {
    const uint8_t *run =
        r + USMIPC__CHUNKS_FIXED_LEN + i * USMIPC__CHUNK_RUN_LEN;
    uint64_t size = usmipc__get64le(run);
    uint32_t n = usmipc__get32le(run + 8);
    if (size == 0 || size % 4096 != 0 || n == 0 ||
        usmipc__get32le(run + 12) != 0)
      return bad("its chunk record has an empty run, a chunk that is not "
                 "whole pages, or reserved bytes set");
    if (size == prev)
      return bad("its chunk record splits a run of equal chunks");
    if (n > count - chunks)
      return bad("its chunk record's runs hold more chunks than it counts");
    chunks += n;
    if (size > (w->allocation_size - total) / n)
      return bad("its chunks extend past the allocation");
    total += size * n;
    prev = size;
  }
  if (chunks != count || total != w->allocation_size)
    return bad("its chunks do not cover exactly the allocation");
  w->chunk_count = count;
  w->chunk_runs = runs;
  w->chunks_at = (uint16_t)(at + 4 + USMIPC__CHUNKS_FIXED_LEN);
  return 0;
}

uint32_t usmipc__wire_chunk_sizes(const usmipc__wire_t *w, uint64_t *sizes) {
  uint32_t k = 0;
  for (uint16_t i = 0; i < w->chunk_runs; i++) {
    const uint8_t *run = w->ext + w->chunks_at + i * USMIPC__CHUNK_RUN_LEN;
    uint64_t size = usmipc__get64le(run);
    for (uint32_t n = usmipc__get32le(run + 8); n > 0 && k < w->chunk_count;
         n--)
      sizes[k++] = size;
  }
  return k;
}

size_t usmipc__chunks_record(const uint64_t *sizes, uint32_t count,
                             uint8_t *out) {
  uint8_t *r = out + 4;
  uint16_t runs = 0;
  uint8_t *run = NULL; /* the last run written */
  for (uint32_t i = 0; i < count; i++) {
    if (run != NULL && usmipc__get64le(run) == sizes[i]) {
      usmipc__put32le(run + 8, usmipc__get32le(run + 8) + 1);
      continue;
    }
    if (runs == USMIPC__CHUNK_RUNS_MAX)
      return 0;
    run = r + USMIPC__CHUNKS_FIXED_LEN + (size_t)runs * USMIPC__CHUNK_RUN_LEN;
    usmipc__put64le(run, sizes[i]);
    usmipc__put32le(run + 8, 1);
    usmipc__put32le(run + 12, 0);
    runs++;
  }
  usmipc__put16le(r, (uint16_t)count);
  usmipc__put16le(r + 2, runs);
  usmipc__put32le(r + 4, 0);
  size_t rlen = USMIPC__CHUNKS_FIXED_LEN + (size_t)runs * USMIPC__CHUNK_RUN_LEN;
  usmipc__put16le(out, USMIPC__EXT_CHUNKS);
  usmipc__put16le(out + 2, (uint16_t)rlen);
  return 4 + rlen;
}

/* Walks the extension records: each is u16 type, u16 length, then length
 * bytes. Unknown critical records refuse the handle (this library cannot
 * honour what the exporter required); other unknown records are skipped.
 * The backend's own records are copied to w->payload.ext. */
static int check_extensions(usmipc__wire_t *w) {
  w->payload.ext_len = 0;
  size_t at = 0;
  while (at < w->ext_len) {
    if (w->ext_len - at < 4)
      return bad("an extension record is truncated");
    uint16_t type = usmipc__get16le(w->ext + at),
             rlen = usmipc__get16le(w->ext + at + 2);
    if (rlen > w->ext_len - at - 4)
      return bad("an extension record overruns the extension area");
    if (type == 0)
      return bad("an extension record has type 0");
    int rc = 0;
    if (type == USMIPC__EXT_EVENT)
      rc = check_event_record(w, w->ext + at + 4, rlen);
    else if (type == USMIPC__EXT_ORDER)
      rc = check_order_record(w, w->ext + at + 4, rlen, at);
    else if (type == USMIPC__EXT_RELEASE)
      rc = check_release_record(w, w->ext + at + 4, rlen);
    else if (type == USMIPC__EXT_BLOCK)
      rc = check_block_record(w, w->ext + at + 4, rlen);
    else if (type == USMIPC__EXT_CHUNKS)
      rc = check_chunks_record(w, w->ext + at + 4, rlen, at);
    else if (backend_record(w, type)) {
      if (4u + rlen > (unsigned)(USMIPC__PAYLOAD_EXT_MAX - w->payload.ext_len))
        return bad("its backend's extension records are too long");
      memcpy(w->payload.ext + w->payload.ext_len, w->ext + at, 4u + rlen);
      w->payload.ext_len = (uint16_t)(w->payload.ext_len + 4u + rlen);
    } else if (type & USMIPC__EXT_CRITICAL) {
      char mine[16];
      version_text(USMIPC_VERSION_HEX, mine, sizeof(mine));
      return usmipc__fail(USMIPC_EHANDLEVERSION,
                          "the handle needs feature record 0x%04x, which "
                          "this usmipc (%s) does not know; upgrade the "
                          "importing process",
                          type, mine);
    }
    if (rc != 0)
      return rc;
    at += 4u + rlen;
  }
  if (w->payload.handle_kind == USMIPC__HANDLE_KIND_EVENT && !w->is_event)
    return bad("it is an event handle without its event record (0x8001)");
  if (w->has_block && w->chunk_count != 0)
    return bad("it names a pool block of a run of chunks (0x8101 with "
               "0x8102)");
  return 0;
}

void usmipc__wire_identity(usmipc__wire_t *w, usmipc_backend_t backend,
                           const uint8_t device_uuid[16]) {
  /* Everything but the extension area's bytes, which ext_len bounds. */
  memset(w, 0, offsetof(usmipc__wire_t, ext));
  w->ext_len = 0;
  memset(&w->is_event, 0, sizeof(*w) - offsetof(usmipc__wire_t, is_event));
  const usmipc__process_t *self = usmipc__self();
  w->backend = backend;
  memcpy(w->device_uuid, device_uuid, 16);
  memcpy(w->boot_id, self->boot_id, 16);
  w->writer_version = USMIPC_VERSION_HEX;
  w->uid = self->uid;
  w->pid = self->pid;
  w->nonce = self->nonce;
  w->start_time = self->start_time;
  w->pidfd_ino = self->pidfd_ino;
  w->pid_ns = self->pid_ns;
  w->net_ns = self->net_ns;
  w->user_ns = self->user_ns;
  memcpy(w->key, self->key, 16);
}

void usmipc__wire_order_event(const usmipc__wire_t *mem, usmipc__wire_t *ev) {
  const uint8_t *r = mem->ext + mem->order_at;
  /* Everything but the extension area: the event's identity is the
   * memory's exporter. */
  memcpy(ev, mem, offsetof(usmipc__wire_t, ext));
  ev->ext_len = 0;
  ev->payload.ext_len = 0;
  ev->payload.handle_kind = USMIPC__HANDLE_KIND_EVENT;
  ev->buffer_id = usmipc__get64le(r);
  ev->event_point = usmipc__get64le(r + 8);
  ev->export_slot = usmipc__get32le(r + 16);
  ev->event_flags = usmipc__get32le(r + 20);
  memcpy(ev->token, r + 24, 16);
  ev->fd_number = usmipc__get32le(r + 40);
  ev->flags = (uint16_t)((mem->flags & USMIPC__WIRE_FLAG_SOCKET_DIR) |
                         usmipc__get16le(r + 44));
  ev->event_kind = r[46];
  ev->fd_dev = usmipc__get64le(r + 48);
  ev->fd_ino = usmipc__get64le(r + 56);
  ev->payload.len = usmipc__get16le(r + 64);
  memcpy(ev->payload.bytes, r + USMIPC__ORDER_FIXED_LEN, ev->payload.len);
  ev->exporter_base = ev->allocation_size = ev->offset = ev->nbytes = 0;
  ev->is_event = true;
  ev->order_at = ev->order_len = 0;
  ev->has_release = false;
  ev->has_block = false;
  ev->chunk_count = ev->chunk_runs = ev->chunks_at = 0;
}

size_t usmipc__order_record(const usmipc__wire_t *ev, uint8_t *out) {
  uint8_t *r = out + 4;
  memset(r, 0, USMIPC__ORDER_FIXED_LEN);
  usmipc__put64le(r, ev->buffer_id);
  usmipc__put64le(r + 8, ev->event_point);
  usmipc__put32le(r + 16, ev->export_slot);
  usmipc__put32le(r + 20, ev->event_flags);
  memcpy(r + 24, ev->token, 16);
  usmipc__put32le(r + 40, ev->fd_number);
  usmipc__put16le(r + 44,
                  (uint16_t)(ev->flags & (USMIPC__WIRE_FLAG_FD |
                                          USMIPC__WIRE_FLAG_REOPENABLE)));
  r[46] = ev->event_kind;
  usmipc__put64le(r + 48, ev->fd_dev);
  usmipc__put64le(r + 56, ev->fd_ino);
  usmipc__put16le(r + 64, ev->payload.len);
  memcpy(r + USMIPC__ORDER_FIXED_LEN, ev->payload.bytes, ev->payload.len);
  size_t rlen = USMIPC__ORDER_FIXED_LEN + ev->payload.len;
  usmipc__put16le(out, USMIPC__EXT_ORDER);
  usmipc__put16le(out + 2, (uint16_t)rlen);
  return 4 + rlen;
}

size_t usmipc__wire_reorder(uint8_t *buf, const uint8_t *base, size_t base_len,
                            const uint8_t *rec, size_t rec_len) {
  /* The base handle's records end right before its checksum; the ordering
   * record goes last. */
  size_t body = base_len - 4;
  memcpy(buf, base, body);
  if (rec_len > 0)
    memcpy(buf + body, rec, rec_len);
  size_t len = body + rec_len + 4;
  usmipc__put16le(buf + OFF_LENGTH, (uint16_t)len);
  usmipc__put16le(buf + OFF_EXT_LEN,
                  (uint16_t)(usmipc__get16le(buf + OFF_EXT_LEN) + rec_len));
  usmipc__put32le(buf + len - 4, usmipc__crc32c(0, buf, len - 4));
  return len;
}

const uint8_t *usmipc__ext_find(const uint8_t *ext, size_t ext_len,
                                uint16_t type, uint16_t *len) {
  size_t at = 0;
  while (at + 4 <= ext_len) {
    uint16_t t = usmipc__get16le(ext + at),
             rlen = usmipc__get16le(ext + at + 2);
    if (rlen > ext_len - at - 4)
      return NULL;
    if (t == type) {
      *len = rlen;
      return ext + at + 4;
    }
    at += 4u + rlen;
  }
  return NULL;
}

const uint8_t *usmipc__wire_ext_find(const usmipc__wire_t *w, uint16_t type,
                                     uint16_t *len) {
  return usmipc__ext_find(w->ext, w->ext_len, type, len);
}

int usmipc__wire_set_payload(usmipc__wire_t *w,
                             const usmipc__payload_t *payload) {
  w->payload = *payload;
  if (payload->ext_len > USMIPC__WIRE_EXT_MAX - w->ext_len)
    return usmipc__fail(USMIPC_EINVAL, "too many extension records");
  memcpy(w->ext + w->ext_len, payload->ext, payload->ext_len);
  w->ext_len = (uint16_t)(w->ext_len + payload->ext_len);
  return 0;
}

void usmipc__wire_extent(const uint8_t *encoded, usmipc__wire_extent_t *out) {
  out->buffer_id = usmipc__get64le(encoded + OFF_BUFFER_ID);
  out->base = usmipc__get64le(encoded + OFF_EXPORTER_BASE);
  out->allocation_size = usmipc__get64le(encoded + OFF_ALLOCATION_SIZE);
  out->offset = usmipc__get64le(encoded + OFF_OFFSET);
  out->nbytes = usmipc__get64le(encoded + OFF_NBYTES);
}

int usmipc__wire_decode(const void *data, size_t len, usmipc__wire_t *w) {
  const uint8_t *p = data;
  if (data == NULL && len != 0)
    return usmipc__fail(USMIPC_EINVAL, "handle data is NULL");
  if (len < OFF_LENGTH + 2) {
    if (len >= 8 && memcmp(p, wire_magic, 8) != 0)
      return bad("it does not start with the usmipc magic");
    return bad(len == 0 ? "it is empty" : "it is truncated");
  }
  if (memcmp(p, wire_magic, sizeof(wire_magic)) != 0)
    return bad("it does not start with the usmipc magic \\x89USMIPC\\n");
  uint16_t version = usmipc__get16le(p + OFF_VERSION);
  if (version != USMIPC__WIRE_VERSION)
    return wrong_version(p, len, version);
  uint16_t declared = usmipc__get16le(p + OFF_LENGTH);
  if (len < declared)
    return bad("it is truncated (fewer bytes than its length field)");
  if (len > declared)
    return bad("it has trailing bytes beyond its length field");
  if (len < usmipc__wire_size(0))
    return bad("its length field is too small for the fixed fields");
  uint32_t crc = usmipc__get32le(p + len - 4);
  if (usmipc__crc32c(0, p, len - 4) != crc)
    return bad("its checksum does not match (the bytes were corrupted)");

  /* The checksum only proves the bytes are as some writer made them; a
   * forger can compute it too, so the fields are still checked one by one. */
  w->backend = (usmipc_backend_t)p[OFF_BACKEND];
  if (w->backend != USMIPC_BACKEND_HOST && w->backend != USMIPC_BACKEND_CUDA &&
      w->backend != USMIPC_BACKEND_LEVEL_ZERO)
    return bad("its backend field names no known backend");
  w->payload.handle_kind = p[OFF_HANDLE_KIND];
  w->flags = usmipc__get16le(p + OFF_FLAGS);
  if (w->flags & ~USMIPC__WIRE_FLAGS_KNOWN)
    return bad("it sets unknown flags");
  if ((w->flags & USMIPC__WIRE_FLAG_REOPENABLE) &&
      !(w->flags & USMIPC__WIRE_FLAG_FD))
    return bad("it marks a descriptor reopenable but shares none");
  w->writer_version = usmipc__get32le(p + OFF_WRITER_VERSION);
  w->uid = usmipc__get32le(p + OFF_UID);
  w->pid = usmipc__get32le(p + OFF_PID);
  w->fd_number = usmipc__get32le(p + OFF_FD_NUMBER);
  memcpy(w->device_uuid, p + OFF_DEVICE_UUID, 16);
  memcpy(w->boot_id, p + OFF_BOOT_ID, 16);
  w->nonce = usmipc__get64le(p + OFF_NONCE);
  w->start_time = usmipc__get64le(p + OFF_START_TIME);
  w->pidfd_ino = usmipc__get64le(p + OFF_PIDFD_INO);
  w->pid_ns = usmipc__get64le(p + OFF_PID_NS);
  w->net_ns = usmipc__get64le(p + OFF_NET_NS);
  w->user_ns = usmipc__get64le(p + OFF_USER_NS);
  w->buffer_id = usmipc__get64le(p + OFF_BUFFER_ID);
  w->exporter_base = usmipc__get64le(p + OFF_EXPORTER_BASE);
  w->allocation_size = usmipc__get64le(p + OFF_ALLOCATION_SIZE);
  w->offset = usmipc__get64le(p + OFF_OFFSET);
  w->nbytes = usmipc__get64le(p + OFF_NBYTES);
  w->fd_dev = usmipc__get64le(p + OFF_FD_DEV);
  w->fd_ino = usmipc__get64le(p + OFF_FD_INO);
  memcpy(w->key, p + OFF_KEY, 16);
  memcpy(w->token, p + OFF_TOKEN, 16);
  w->export_slot = usmipc__get32le(p + OFF_EXPORT_SLOT);
  w->table_fd_number = usmipc__get32le(p + OFF_TABLE_FD);
  w->payload.len = usmipc__get16le(p + OFF_PAYLOAD_LEN);
  w->ext_len = usmipc__get16le(p + OFF_EXT_LEN);
  if (w->payload.len > USMIPC__PAYLOAD_MAX)
    return bad("its payload is longer than any backend's");
  if (w->ext_len > USMIPC__WIRE_EXT_MAX)
    return bad("its extension area is too long");
  if (usmipc__wire_len(w) != len)
    return bad("its payload and extension lengths disagree with its total "
               "length");
  memcpy(w->payload.bytes, p + OFF_PAYLOAD, w->payload.len);
  memcpy(w->ext, p + OFF_PAYLOAD + w->payload.len, w->ext_len);
  if (w->pid == 0 || w->nonce == 0)
    return bad("it names no exporting process");
  w->is_event = false;
  w->event_point = 0;
  w->event_flags = 0;
  w->event_kind = 0;
  w->order_at = w->order_len = 0;
  w->has_release = false;
  w->release_id = w->release_ticket = 0;
  w->has_block = false;
  w->block_id = w->block_offset = w->block_size = 0;
  w->block_slot = 0;
  w->chunk_count = w->chunk_runs = w->chunks_at = 0;
  if (w->payload.handle_kind == USMIPC__HANDLE_KIND_EVENT) {
    /* An event handle names no memory. */
    if (w->nbytes != 0 || w->allocation_size != 0 || w->offset != 0 ||
        w->exporter_base != 0)
      return bad("it is an event handle but names memory");
    if (w->export_slot == USMIPC__NO_SLOT ||
        w->export_slot >= USMIPC__TABLE_SLOTS)
      return bad("it is an event handle without an export-table slot");
    if (w->buffer_id == 0)
      return bad("it is an event handle that names no event");
  } else if (w->nbytes == 0) {
    return bad("it exports zero bytes");
  } else if (w->allocation_size == 0 || w->offset > w->allocation_size ||
             w->nbytes > w->allocation_size - w->offset) {
    return bad("its offset and size lie outside the exported allocation");
  }
  if (w->exporter_base + w->allocation_size < w->exporter_base)
    return bad("its exporter address range wraps around");
  if ((w->flags & USMIPC__WIRE_FLAG_FD) && w->fd_number > INT32_MAX)
    return bad("its file descriptor number is out of range");
  if (w->export_slot != USMIPC__NO_SLOT && w->table_fd_number > INT32_MAX)
    return bad("its export table descriptor number is out of range");
  if ((w->flags & USMIPC__WIRE_FLAG_FD) && w->export_slot == USMIPC__NO_SLOT)
    return bad("it shares a descriptor but names no export-table slot");
  return check_extensions(w);
}

/* What a handle's bytes say, from their decoded (or about to be encoded)
 * fields. */
static void info_of_wire(const usmipc__wire_t *w,
                         usmipc_ipc_handle_info_t *info) {
  memset(info, 0, sizeof(*info));
  info->backend = w->backend;
  memcpy(info->device_uuid, w->device_uuid, 16);
  info->exporter_pid = w->pid;
  info->buffer_id = w->buffer_id;
  info->allocation_size = w->allocation_size;
  info->offset = w->offset;
  info->nbytes = w->nbytes;
  info->handle_kind = w->payload.handle_kind;
  info->exporter_uid = w->uid;
  info->exporter_nonce = w->nonce;
  info->wire_version = USMIPC__WIRE_VERSION;
  info->writer_version = w->writer_version;
  info->is_event = w->is_event;
  info->is_ordered = w->order_len != 0;
  info->event_point = w->event_point;
  info->release_ticket = w->has_release ? w->release_ticket : 0;
}

int usmipc_ipc_handle_inspect(const void *data, size_t len,
                              usmipc_ipc_handle_info_t *info) {
  usmipc__wire_t w;
  int rc = usmipc__wire_decode(data, len, &w);
  if (rc != 0)
    return rc;
  if (info != NULL)
    info_of_wire(&w, info);
  return 0;
}

int usmipc_ipc_handle_get_info(const usmipc_ipc_handle_t *handle,
                               usmipc_ipc_handle_info_t *info) {
  if (handle == NULL || info == NULL)
    return usmipc__fail(USMIPC_EINVAL,
                        "usmipc_ipc_handle_get_info: NULL argument");
  *info = handle->info;
  return 0;
}

/* ---- the handle object: bytes, and room to reorder them ---------------- */

int usmipc__handle_from_wire(const usmipc__wire_t *w,
                             usmipc_ipc_handle_t **handle) {
  size_t len = usmipc__wire_len(w);
  size_t room = w->is_event ? len : len + USMIPC__ORDER_RECORD_MAX;
  usmipc_ipc_handle_t *h = malloc(sizeof(*h) + room + len);
  if (h == NULL)
    return usmipc__fail(USMIPC_ENOMEM, "out of memory");
  h->foreign_id = 0;
  h->release = NULL;
  h->backend = w->backend;
  h->is_event = w->is_event;
  h->len = h->base_len = len;
  h->base = h->data + room;
  usmipc__wire_encode(w, h->data);
  memcpy(h->base, h->data, len);
  /* The fields an inspect of these bytes would decode: w holds no record
   * that decoding derives a field from (ordering and tickets are added by
   * the handoffs, to the copies they give out). */
  info_of_wire(w, &h->info);
  *handle = h;
  return 0;
}

int usmipc__handle_copy(const usmipc_ipc_handle_t *h,
                        usmipc_ipc_handle_t **out) {
  size_t room = (size_t)(h->base - h->data);
  size_t bytes = sizeof(*h) + room + h->base_len;
  usmipc_ipc_handle_t *c = malloc(bytes);
  if (c == NULL)
    return usmipc__fail(USMIPC_ENOMEM, "out of memory");
  memcpy(c, h, bytes);
  c->base = c->data + room;
  c->release = NULL;
  c->foreign_id = 0;
  *out = c;
  return 0;
}

int usmipc_ipc_handle_data(const usmipc_ipc_handle_t *handle, const void **data,
                           size_t *len) {
  if (handle == NULL || data == NULL || len == NULL)
    return usmipc__fail(USMIPC_EINVAL, "usmipc_ipc_handle_data: NULL argument");
  *data = handle->data;
  *len = handle->len;
  return 0;
}

bool usmipc__same_pid_namespace(const usmipc__wire_t *w) {
  uint64_t mine = usmipc__self()->pid_ns;
  return w->pid_ns == 0 || mine == 0 || w->pid_ns == mine;
}
