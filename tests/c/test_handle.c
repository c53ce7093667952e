/* Bad handles: every class of defect gets its own code and a message, and
 * nothing crashes. Forged handles are made the way an attacker would: decode
 * with usmipc__wire_decode, change fields, re-encode with
 * usmipc__wire_encode (which computes a valid CRC). Defects that only the
 * exporter can detect (token, buffer id, descriptor identity) are opened by
 * an agent, since a same-process open never asks the exporter. */
#include <unistd.h>

#include "objects.h" /* usmipc__wire_t, usmipc__wire_encode/decode, crc32c */
#include "task.h"

/* Byte offsets of the wire format version 1 (docs/handle-format.md) that
 * the tests edit raw; the CRC32C of all preceding bytes ends the handle. */
#define WIRE_OFF_VERSION 8
#define WIRE_OFF_LENGTH 10
#define WIRE_OFF_BACKEND 12
#define WIRE_OFF_WRITER_VERSION 16
#define WIRE_OFF_PAYLOAD_LEN 208
#define WIRE_OFF_EXT_LEN 210

typedef struct exported {
  uint8_t *ptr;
  size_t size;
  usmipc_ipc_handle_t *handle;
  uint8_t *data;
  size_t len;
} exported_t;

static void export_new(exported_t *e, size_t size, uint64_t seed) {
  e->size = size;
  ASSERT_OK(
      usmipc_malloc(test_device(), USMIPC_MEM_DEVICE, size, (void **)&e->ptr));
  dev_fill(e->ptr, size, seed, 0);
  e->handle = export_copy(e->ptr, 0, &e->data, &e->len);
}

static void export_drop(exported_t *e) {
  free(e->data);
  ASSERT_OK(usmipc_ipc_free_handle(e->handle));
  ASSERT_OK(usmipc_free(e->ptr));
}

static void put16le(uint8_t *p, uint16_t v) {
  p[0] = (uint8_t)v;
  p[1] = (uint8_t)(v >> 8);
}

/* Recomputes the trailing CRC after a raw edit. */
static void fix_crc(uint8_t *b, size_t len) {
  uint32_t c = usmipc__crc32c(0, b, len - 4);
  for (int i = 0; i < 4; i++)
    b[len - 4 + (size_t)i] = (uint8_t)(c >> (8 * i));
}

static size_t encode(const usmipc__wire_t *w, uint8_t *out) {
  size_t len = usmipc__wire_len(w);
  ASSERT_LE(len, 1024);
  usmipc__wire_encode(w, out);
  return len;
}

static void decode_ok(const exported_t *e, usmipc__wire_t *w) {
  ASSERT_OK(usmipc__wire_decode(e->data, e->len, w));
}

/* Whether an importer must fetch a descriptor for this handle. Host memory
 * is always a memfd; other backends may share memory through a driver
 * handle in the payload instead (CUDA's cuIpcGetMemHandle: no FD flag, fd
 * number 0xFFFFFFFF, no token). */
static int has_fd(const usmipc__wire_t *w) {
  int fd = (w->flags & USMIPC__WIRE_FLAG_FD) != 0;
  if (usmipc_device_backend(test_device()) == USMIPC_BACKEND_HOST)
    ASSERT_MSG(fd, "a host handle without the FD flag");
  if (!fd)
    ASSERT_UEQ(w->fd_number, UINT32_MAX);
  return fd;
}

/* Opens in this process, expecting one of the codes; a success would be a
 * bug, but its reference is dropped so the failure report stays clean. */
static int open_here(const uint8_t *b, size_t len, usmipc_device_t *dev) {
  void *p = NULL;
  size_t m = 0;
  int r = usmipc_ipc_open(b, len, dev, 0, &p, &m);
  if (r == 0)
    usmipc_ipc_close(p);
  return r;
}

/* The same bytes must fail the same way in open, inspect and decode. */
#define ASSERT_ALL_REFUSE(b, len, code)                                        \
  do {                                                                         \
    usmipc_ipc_handle_info_t info_;                                            \
    usmipc__wire_t w_;                                                         \
    ASSERT_ERR(open_here((b), (len), NULL), (code));                           \
    ASSERT_ERR(usmipc_ipc_handle_inspect((b), (len), &info_), (code));         \
    ASSERT_ERR(usmipc__wire_decode((b), (len), &w_), (code));                  \
  } while (0)

/* The checksum of handles and bundles, against a bit-at-a-time reference,
 * at every length up to 3,000 bytes from every start modulo 8 (the word
 * loop, the 3-stream blocks of 128 and 4,096 bytes and every tail), at
 * lengths around the blocks' edges up to 300 KB, and the check value of
 * the CRC-32C catalogue ("123456789" -> 0xE3069283). */
static uint32_t crc32c_bitwise(const uint8_t *p, size_t n) {
  uint32_t c = 0xFFFFFFFFu;
  while (n--) {
    c ^= *p++;
    for (int k = 0; k < 8; k++)
      c = (c >> 1) ^ (0x82F63B78u & (0u - (c & 1)));
  }
  return ~c;
}

TEST_IMPL(handle_crc32c_streams) {
  ASSERT_UEQ(usmipc__crc32c(0, "123456789", 9), 0xE3069283u);
  const size_t big = 300 * 1024 + 64;
  uint8_t *buf = malloc(big);
  ASSERT_NOT_NULL(buf);
  uint32_t x = 12345;
  for (size_t i = 0; i < big; i++) {
    x = x * 1103515245u + 12345u;
    buf[i] = (uint8_t)(x >> 16);
  }
  for (size_t start = 0; start < 8; start++)
    for (size_t n = 0; n <= 3000; n++)
      ASSERT_MSG(usmipc__crc32c(0, buf + start, n) ==
                     crc32c_bitwise(buf + start, n),
                 "crc32c of %zu bytes from %zu", n, start);
  const size_t edges[] = {3 * 128,      3 * 128 + 1,  3 * 4096 - 1,
                          3 * 4096,     3 * 4096 + 7, 3 * 4096 + 3 * 128,
                          6 * 4096 + 5, 100 * 1000,   big - 8};
  for (size_t e = 0; e < sizeof(edges) / sizeof(edges[0]); e++)
    for (size_t start = 0; start < 8; start += 3)
      ASSERT_MSG(usmipc__crc32c(0, buf + start, edges[e]) ==
                     crc32c_bitwise(buf + start, edges[e]),
                 "crc32c of %zu bytes from %zu", edges[e], start);
  /* Continued: a checksum taken in two calls is the checksum of the whole
   * (the seed is the checksum so far). */
  ASSERT_UEQ(usmipc__crc32c(usmipc__crc32c(0, buf, 5000), buf + 5000, 20000),
             usmipc__crc32c(0, buf, 25000));
  free(buf);
  return 0;
}

TEST_IMPL(handle_truncated) {
  exported_t e;
  export_new(&e, 64 * 1024, 1);
  /* The fixed fields, the backend's payload, its extension records and the
   * CRC: no payload for the host backend; CUDA carries its driver's handle
   * there, Level Zero a record of its exporter's driver. */
  usmipc__wire_t w;
  decode_ok(&e, &w);
  if (test_device_is_host())
    ASSERT_EQ(w.payload.len + w.ext_len, 0);
  ASSERT_EQ(e.len, usmipc__wire_size(w.payload.len) + w.ext_len);
  for (size_t len = 0; len < e.len; len++) {
    /* An exact-size copy, so ASan catches any read past the end. */
    uint8_t *b = malloc(len ? len : 1);
    memcpy(b, e.data, len);
    void *p = NULL;
    int r = usmipc_ipc_open(b, len, NULL, 0, &p, NULL);
    PROBE_ERR("usmipc_ipc_open(b, len, NULL, 0, &p, NULL) (truncated)", r);
    ASSERT_MSG(r == USMIPC_EBADHANDLE || (len == 0 && r == USMIPC_EINVAL),
               "truncated to %zu bytes: %d %s", len, r, usmipc_err_name(r));
    ASSERT_GT(strlen(usmipc_last_error()), 0);
    usmipc_ipc_handle_info_t info;
    r = usmipc_ipc_handle_inspect(b, len, &info);
    PROBE_ERR("usmipc_ipc_handle_inspect(b, len, &info) (truncated)", r);
    ASSERT_MSG(r == USMIPC_EBADHANDLE || (len == 0 && r == USMIPC_EINVAL),
               "inspect of %zu bytes: %d", len, r);
    free(b);
  }
  /* The untruncated handle still opens (as an alias, in this process). */
  void *p = NULL;
  ASSERT_OK(usmipc_ipc_open(e.data, e.len, NULL, 0, &p, NULL));
  ASSERT_PTR_EQ(p, e.ptr);
  ASSERT_OK(usmipc_ipc_close(p));
  export_drop(&e);
  return 0;
}

TEST_IMPL(handle_oversized) {
  exported_t e;
  export_new(&e, 64 * 1024, 2);
  uint8_t b[2048];
  /* Trailing zeros, trailing noise, the handle twice. */
  memcpy(b, e.data, e.len);
  memset(b + e.len, 0, 64);
  ASSERT_ALL_REFUSE(b, e.len + 1, USMIPC_EBADHANDLE);
  ASSERT_ALL_REFUSE(b, e.len + 64, USMIPC_EBADHANDLE);
  for (int i = 0; i < 64; i++)
    b[e.len + (size_t)i] = (uint8_t)(i * 37 + 11);
  ASSERT_ALL_REFUSE(b, e.len + 16, USMIPC_EBADHANDLE);
  memcpy(b + e.len, e.data, e.len);
  ASSERT_ALL_REFUSE(b, 2 * e.len, USMIPC_EBADHANDLE);

  /* Longer, with the length field and the CRC made to agree: the payload
   * length no longer matches, which decoding must notice after the CRC. */
  memcpy(b, e.data, e.len);
  size_t len = e.len + 4;
  put16le(b + WIRE_OFF_LENGTH, (uint16_t)len);
  fix_crc(b, len);
  ASSERT_ALL_REFUSE(b, len, USMIPC_EBADHANDLE);
  export_drop(&e);
  return 0;
}

TEST_IMPL(handle_bit_flips) {
  exported_t e;
  export_new(&e, 64 * 1024, 3);
  uint8_t *b = malloc(e.len);
  size_t flips = 0;
  for (size_t byte = 0; byte < e.len; byte++) {
    for (int bit = 0; bit < 8; bit++) {
      memcpy(b, e.data, e.len);
      b[byte] ^= (uint8_t)(1u << bit);
      /* A flipped version is reported as a version mismatch (it is checked
       * before the CRC, so that a newer writer gets a useful message);
       * every other flip is caught, at the latest, by the CRC. */
      int expect = (byte == WIRE_OFF_VERSION || byte == WIRE_OFF_VERSION + 1)
                       ? USMIPC_EHANDLEVERSION
                       : USMIPC_EBADHANDLE;
      void *p = NULL;
      int r = usmipc_ipc_open(b, e.len, NULL, 0, &p, NULL);
      PROBE_ERR("usmipc_ipc_open(b, e.len, NULL, 0, &p, NULL) (a bit flipped)",
                r);
      ASSERT_MSG(r == expect, "bit %d of byte %zu flipped: open gave %d (%s)",
                 bit, byte, r, usmipc_err_name(r));
      ASSERT_GT(strlen(usmipc_last_error()), 0);
      usmipc_ipc_handle_info_t info;
      r = usmipc_ipc_handle_inspect(b, e.len, &info);
      ASSERT_MSG(r == expect, "bit %d of byte %zu flipped: inspect gave %d",
                 bit, byte, r);
      flips++;
    }
  }
  ASSERT_EQ(flips, e.len * 8);
  free(b);
  export_drop(&e);
  return 0;
}

TEST_IMPL(handle_version_bumped) {
  exported_t e;
  export_new(&e, 64 * 1024, 4);
  uint8_t b[1024];
  /* First prove the layout assumption: version 2 with a recomputed CRC
   * gives back the exact bytes. */
  memcpy(b, e.data, e.len);
  put16le(b + WIRE_OFF_VERSION, 2);
  fix_crc(b, e.len);
  ASSERT_EQ(memcmp(b, e.data, e.len), 0);

  static const uint16_t versions[] = {0, 1, 3, 0x100, 0xffff};
  for (size_t i = 0; i < sizeof(versions) / sizeof(versions[0]); i++) {
    memcpy(b, e.data, e.len);
    put16le(b + WIRE_OFF_VERSION, versions[i]);
    fix_crc(b, e.len);
    ASSERT_ALL_REFUSE(b, e.len, USMIPC_EHANDLEVERSION);
  }
  /* A version-3 handle may be longer; it is still reported as a version,
   * and the message names both releases. */
  memcpy(b, e.data, e.len);
  memset(b + e.len, 0, 32);
  put16le(b + WIRE_OFF_VERSION, 3);
  b[WIRE_OFF_WRITER_VERSION] = 7; /* usmipc 0.2.7 wrote it */
  put16le(b + WIRE_OFF_LENGTH, (uint16_t)(e.len + 32));
  fix_crc(b, e.len + 32);
  ASSERT_ALL_REFUSE(b, e.len + 32, USMIPC_EHANDLEVERSION);
  test_error_sentinel();
  usmipc_ipc_handle_inspect(b, e.len + 32, NULL);
  ASSERT_MSG(strstr(usmipc_last_error(), "0.2.7") &&
                 strstr(usmipc_last_error(), USMIPC_VERSION_STRING),
             "message names both releases: %s", usmipc_last_error());
  /* A version-1 handle (usmipc 0.1) is refused by name. */
  memcpy(b, e.data, e.len);
  put16le(b + WIRE_OFF_VERSION, 1);
  fix_crc(b, e.len);
  ASSERT_ALL_REFUSE(b, e.len, USMIPC_EHANDLEVERSION);
  ASSERT_MSG(strstr(usmipc_last_error(), "version 1"), "%s",
             usmipc_last_error());
  export_drop(&e);
  return 0;
}

/* Extension records: what later features add to version 2 without a new
 * version. An unknown record is skipped, an unknown critical one refused
 * with a message, and a malformed area is a malformed handle. */
TEST_IMPL(handle_extension_records) {
  exported_t e;
  export_new(&e, 64 * 1024, 4);
  usmipc__wire_t w0, w;
  uint8_t b[4096];
  size_t len;
  decode_ok(&e, &w0);
  /* An unknown, non-critical record: the handle opens as before. */
  w = w0;
  static const uint8_t unknown[] = {0x34, 0x12, 3, 0, 'a', 'b', 'c'};
  memcpy(w.ext, unknown, sizeof(unknown));
  w.ext_len = sizeof(unknown);
  len = encode(&w, b);
  ASSERT_OK(usmipc_ipc_handle_inspect(b, len, NULL));
  usmipc__wire_t back;
  ASSERT_OK(usmipc__wire_decode(b, len, &back));
  uint16_t rlen = 0;
  const uint8_t *rec = usmipc__wire_ext_find(&back, 0x1234, &rlen);
  ASSERT(rec != NULL && rlen == 3 && memcmp(rec, "abc", 3) == 0);
  ASSERT(usmipc__wire_ext_find(&back, 0x1235, &rlen) == NULL);
  void *p = NULL;
  size_t mapped = 0;
  ASSERT_OK(usmipc_ipc_open(b, len, NULL, 0, &p, &mapped));
  ASSERT_OK(usmipc_ipc_close(p));
  /* The same record marked critical: refused, naming the record. */
  w.ext[1] |= 0x80;
  len = encode(&w, b);
  ASSERT_ALL_REFUSE(b, len, USMIPC_EHANDLEVERSION);
  ASSERT_MSG(strstr(usmipc_last_error(), "0x9234"), "%s", usmipc_last_error());
  /* A backend's record marked critical (Level Zero's driver record 0x0201
   * as 0x8201): backend records are never critical, so it is an unknown
   * critical record, whatever the backend (the fuzzer found it accepted). */
  w = w0;
  uint8_t crit[4 + 16] = {0x01, 0x82, 16, 0};
  memcpy(w.ext + w.ext_len, crit, sizeof(crit));
  w.ext_len = (uint16_t)(w.ext_len + sizeof(crit));
  len = encode(&w, b);
  ASSERT_ALL_REFUSE(b, len, USMIPC_EHANDLEVERSION);
  ASSERT_MSG(strstr(usmipc_last_error(), "0x8201"), "%s", usmipc_last_error());
  /* Truncated record headers, overrunning lengths, type 0. */
  static const uint8_t bad1[] = {0x34, 0x12, 9, 0, 'a'};
  static const uint8_t bad2[] = {0x34, 0x12};
  static const uint8_t bad3[] = {0, 0, 0, 0};
  const uint8_t *bads[] = {bad1, bad2, bad3};
  const size_t bad_lens[] = {sizeof(bad1), sizeof(bad2), sizeof(bad3)};
  for (int i = 0; i < 3; i++) {
    w = w0;
    memcpy(w.ext, bads[i], bad_lens[i]);
    w.ext_len = (uint16_t)bad_lens[i];
    len = encode(&w, b);
    ASSERT_ALL_REFUSE(b, len, USMIPC_EBADHANDLE);
  }
  /* An extension area longer than the maximum. */
  memcpy(b, e.data, e.len);
  put16le(b + WIRE_OFF_EXT_LEN, USMIPC__WIRE_EXT_MAX + 1);
  fix_crc(b, e.len);
  ASSERT_ALL_REFUSE(b, e.len, USMIPC_EBADHANDLE);
  export_drop(&e);
  return 0;
}

TEST_IMPL(handle_wrong_backend) {
  exported_t e;
  export_new(&e, 64 * 1024, 5);
  usmipc_device_t *dev = test_device();
  usmipc_device_t *host = host_device();
  usmipc_device_t *devs[64];
  size_t ndevs = 0;
  ASSERT_OK(usmipc_get_devices(devs, 64, &ndevs));
  if (ndevs > 64)
    ndevs = 64;
  usmipc__wire_t w;
  uint8_t b[1024];
  size_t len;
  decode_ok(&e, &w);
  const usmipc_backend_t exported = w.backend;
  ASSERT_EQ(exported, usmipc_device_backend(dev));

  /* The same handle relabelled as every other backend's: well formed, but
   * no device of this process can open it. */
  static const usmipc_backend_t backends[] = {
      USMIPC_BACKEND_HOST, USMIPC_BACKEND_CUDA, USMIPC_BACKEND_LEVEL_ZERO};
  int others = 0;
  for (size_t i = 0; i < sizeof(backends) / sizeof(backends[0]); i++) {
    const usmipc_backend_t other = backends[i];
    if (other == exported)
      continue;
    others++;
    decode_ok(&e, &w);
    w.backend = other;
    len = encode(&w, b);
    usmipc_ipc_handle_info_t info;
    ASSERT_OK(usmipc_ipc_handle_inspect(b, len, &info)); /* well formed */
    ASSERT_EQ(info.backend, other);
    /* On the device under test: the handle is for another backend. */
    ASSERT_ERR2(open_here(b, len, dev), USMIPC_EWRONGDEVICE, USMIPC_EBADHANDLE);
    /* On the host device: another backend's handle, or (relabelled as
     * host) a host handle of a device uuid the host does not have. */
    ASSERT_ERR2(open_here(b, len, host), USMIPC_EWRONGDEVICE,
                USMIPC_EBADHANDLE);
    /* On every other device of this process, whatever its backend. */
    for (size_t k = 0; k < ndevs; k++)
      ASSERT_ERR2(open_here(b, len, devs[k]), USMIPC_EWRONGDEVICE,
                  USMIPC_EBADHANDLE);
    /* On the device the handle names: no such device here. */
    ASSERT_ERR3(open_here(b, len, NULL), USMIPC_EWRONGDEVICE, USMIPC_EBADHANDLE,
                USMIPC_EUNAVAILABLE);
    /* Where the backend has no device at all, the message says so and why,
     * rather than asking for a device of it to be named. */
    const char *why = NULL;
    if (usmipc_backend_status(other, &why) != 0) {
      ASSERT_ERR(open_here(b, len, NULL), USMIPC_EUNAVAILABLE);
      char want[64];
      snprintf(want, sizeof(want), "this process has no %s device",
               usmipc_backend_name(other));
      ASSERT_MSG(strstr(usmipc_last_error(), want) != NULL &&
                     strstr(usmipc_last_error(), why) != NULL,
                 "%s", usmipc_last_error());
      if (other == USMIPC_BACKEND_CUDA)
        ASSERT(strstr(usmipc_last_error(), "CUDA_VISIBLE_DEVICES") != NULL);
    }
  }
  ASSERT_EQ(others, 2);
  /* Backend numbers that do not exist are malformed. */
  static const uint8_t bogus[] = {0, 4, 99, 255};
  for (size_t i = 0; i < sizeof(bogus); i++) {
    memcpy(b, e.data, e.len);
    b[WIRE_OFF_BACKEND] = bogus[i];
    fix_crc(b, e.len);
    ASSERT_ALL_REFUSE(b, e.len, USMIPC_EBADHANDLE);
  }
  /* A device uuid this process does not have. Named a device, a CUDA
   * open goes on as for a GPU that CUDA_VISIBLE_DEVICES hides
   * (docs/distributed.md), but this process exported the handle, and its
   * own allocation's device is not the one the handle names: forged. */
  decode_ok(&e, &w);
  w.device_uuid[0] ^= 0x5a;
  len = encode(&w, b);
  ASSERT_ERR(open_here(b, len, NULL), USMIPC_EWRONGDEVICE);
  ASSERT_ERR(open_here(b, len, dev), USMIPC_EWRONGDEVICE);
  export_drop(&e);
  return 0;
}

TEST_IMPL(handle_other_boot) {
  exported_t e;
  export_new(&e, 64 * 1024, 6);
  usmipc__wire_t w;
  uint8_t b[1024];
  decode_ok(&e, &w);
  w.boot_id[15] ^= 1;
  size_t len = encode(&w, b);
  ASSERT_OK(usmipc_ipc_handle_inspect(b, len, NULL)); /* well formed */
  ASSERT_ERR(open_here(b, len, NULL), USMIPC_EOTHERHOST);
  ASSERT_ERR(open_here(b, len, test_device()), USMIPC_EOTHERHOST);
  memset(w.boot_id, 0, 16);
  len = encode(&w, b);
  ASSERT_ERR(open_here(b, len, NULL), USMIPC_EOTHERHOST);

  /* The same in another process. */
  static char hex[HEX_MAX];
  hex_encode(b, len, hex);
  agent_t im;
  agent_start(&im, NULL);
  AGENT_ERR(&im, USMIPC_EOTHERHOST, "open 0 %s 0", hex);
  agent_stop_ok(&im);
  export_drop(&e);
  return 0;
}

TEST_IMPL(handle_forged_token) {
  exported_t e;
  export_new(&e, 256 * 1024, 7);
  usmipc__wire_t w;
  uint8_t b[1024];
  static char hex[HEX_MAX];
  agent_t im;
  decode_ok(&e, &w);
  if (!has_fd(&w)) {
    export_drop(&e);
    RETURN_SKIP("%s handles of this kind carry no descriptor and no token: "
                "the driver's handle in the payload is the capability (a "
                "bearer token), so there is no token to forge",
                usmipc_backend_name(w.backend));
  }
  agent_start(&im, "socket");

  /* Control: the genuine handle opens over the socket. */
  hex_encode(e.data, e.len, hex);
  AGENT_OK(&im, "open 0 %s 0", hex);
  AGENT_OK(&im, "check 0 7");
  AGENT_OK(&im, "close 0");
  AGENT_OK(&im, "cache 0"); /* forget it, so the next opens ask the broker */

  decode_ok(&e, &w);
  /* The export table's slot tag (a MAC of the token) refuses it before the
   * broker would. */
  w.token[3] ^= 0x10;
  size_t len = encode(&w, b);
  hex_encode(b, len, hex);
  AGENT_ERR2(&im, USMIPC_EACCES, USMIPC_EEXPORTERGONE, "open 1 %s 0", hex);

  memset(w.token, 0, 16);
  len = encode(&w, b);
  hex_encode(b, len, hex);
  AGENT_ERR2(&im, USMIPC_EACCES, USMIPC_EEXPORTERGONE, "open 1 %s 0", hex);
  agent_stop_ok(&im);
  export_drop(&e);
  return 0;
}

TEST_IMPL(handle_forged_buffer_id) {
  exported_t a, c;
  export_new(&a, 64 * 1024, 8);
  export_new(&c, 64 * 1024, 9);
  usmipc__wire_t wa, wc;
  decode_ok(&a, &wa);
  decode_ok(&c, &wc);
  uint8_t b[1024];
  static char hex[HEX_MAX];
  agent_t im;
  agent_start(&im, "socket");

  /* An id this exporter never issued. */
  usmipc__wire_t w = wa;
  w.buffer_id = wa.buffer_id ^ 0x8000000000000000ull;
  size_t len = encode(&w, b);
  hex_encode(b, len, hex);
  AGENT_ERR2(&im, USMIPC_EEXPORTERGONE, USMIPC_EACCES, "open 0 %s 0", hex);

  /* Another live allocation's id with this one's token: the token is bound
   * to its buffer. */
  w = wa;
  w.buffer_id = wc.buffer_id;
  len = encode(&w, b);
  hex_encode(b, len, hex);
  AGENT_ERR2(&im, USMIPC_EACCES, USMIPC_EEXPORTERGONE, "open 0 %s 0", hex);

  /* Neither attempt broke the genuine handles. */
  hex_encode(c.data, c.len, hex);
  AGENT_OK(&im, "open 1 %s 0", hex);
  AGENT_OK(&im, "check 1 9");
  AGENT_OK(&im, "close 1");
  agent_stop_ok(&im);
  export_drop(&a);
  export_drop(&c);
  return 0;
}

TEST_IMPL(handle_forged_fd_identity) {
  /* Handles that point the importer at the wrong descriptor or claim more
   * memory than the descriptor holds; the importer must notice before it
   * maps anything. */
  exported_t a, c;
  export_new(&a, 64 * 1024, 10);
  export_new(&c, 64 * 1024, 11);
  usmipc__wire_t wa, wc, w;
  decode_ok(&a, &wa);
  decode_ok(&c, &wc);
  if (!has_fd(&wa)) {
    export_drop(&a);
    export_drop(&c);
    RETURN_SKIP("%s handles of this kind carry no descriptor (no FD flag, "
                "fd number 0xFFFFFFFF): there is no descriptor to forge",
                usmipc_backend_name(wa.backend));
  }
  ASSERT(has_fd(&wc));
  ASSERT_NE(wa.fd_number, wc.fd_number);
  /* Whether the two allocations' descriptors are distinguishable files.
   * Memfds always are; a driver may export every allocation through one
   * anonymous inode (CUDA's descriptors share one), and then (st_dev,
   * st_ino) cannot tell a's descriptor from c's: the export table guards
   * the pidfd path instead, and the broker's token the socket path. */
  const int distinct = wa.fd_dev != wc.fd_dev || wa.fd_ino != wc.fd_ino;
  if (test_device_is_host())
    ASSERT_MSG(distinct, "two memfds with the same st_dev and st_ino");
  uint8_t b[1024];
  size_t len;
  static char hex[HEX_MAX];
  agent_t im;

  if (pidfd_supported()) {
    /* pidfd_getfd would copy c's descriptor: a's export-table slot names
     * another descriptor number, and (memfds) the recorded identity
     * another file. */
    agent_start(&im, "pidfd");
    w = wa;
    w.fd_number = wc.fd_number;
    len = encode(&w, b);
    hex_encode(b, len, hex);
    AGENT_ERR2(&im, USMIPC_EEXPORTERGONE, USMIPC_EACCES, "open 0 %s 0", hex);
    /* A descriptor number that is not open at all. */
    w.fd_number = 1000000;
    len = encode(&w, b);
    hex_encode(b, len, hex);
    AGENT_ERR2(&im, USMIPC_EEXPORTERGONE, USMIPC_EACCES, "open 0 %s 0", hex);
    agent_stop_ok(&im);
  }

  agent_start(&im, "socket");
  /* The broker sends a's descriptor; the handle claims another file: c's
   * (when it is another file), and one that no allocation has. */
  if (distinct) {
    w = wa;
    w.fd_dev = wc.fd_dev;
    w.fd_ino = wc.fd_ino;
    len = encode(&w, b);
    hex_encode(b, len, hex);
    AGENT_ERR2(&im, USMIPC_EEXPORTERGONE, USMIPC_EACCES, "open 0 %s 0", hex);
  } else {
    printf("note: %s descriptors of two allocations share one inode "
           "(st_dev %" PRIu64 ", st_ino %" PRIu64 "): a handle claiming the "
           "other allocation's file claims this one's, so that case is not "
           "tried\n",
           usmipc_backend_name(wa.backend), wa.fd_dev, wa.fd_ino);
  }
  w = wa;
  w.fd_ino = wa.fd_ino ^ 0x5a5a5a5aull;
  len = encode(&w, b);
  hex_encode(b, len, hex);
  AGENT_ERR2(&im, USMIPC_EEXPORTERGONE, USMIPC_EACCES, "open 0 %s 0", hex);

  /* More memory than the exporter's file holds (a SIGBUS on first touch if
   * it were mapped). A memfd holds the allocation rounded up to pages, so
   * on the host even 4 times the allocation is too much; other backends
   * may round further (CUDA's fd memory to 2 MiB granules, which a mapping
   * may then cover), so every backend gets a claim past any rounding. */
  if (test_device_is_host()) {
    w = wa;
    w.allocation_size = wa.allocation_size * 4;
    w.offset = wa.allocation_size * 2;
    w.nbytes = 4096;
    len = encode(&w, b);
    hex_encode(b, len, hex);
    AGENT_ERR(&im, USMIPC_EBADHANDLE, "open 0 %s 0", hex);
  }
  w = wa;
  w.allocation_size = 1ull << 40;
  w.offset = 1ull << 39;
  w.nbytes = 4096;
  len = encode(&w, b);
  hex_encode(b, len, hex);
  AGENT_ERR(&im, USMIPC_EBADHANDLE, "open 0 %s 0", hex);

  /* A handle of a kind the backend does not have, with a payload of a
   * length its kind never has (a host handle has none), or with the
   * payload's bytes garbled. */
  w = wa;
  w.payload.handle_kind = 77;
  len = encode(&w, b);
  hex_encode(b, len, hex);
  AGENT_ERR(&im, USMIPC_EBADHANDLE, "open 0 %s 0", hex);
  w = wa;
  w.payload.len = wa.payload.len != 8 ? 8 : 16;
  memset(w.payload.bytes, 0xab, w.payload.len);
  len = encode(&w, b);
  hex_encode(b, len, hex);
  AGENT_ERR(&im, USMIPC_EBADHANDLE, "open 0 %s 0", hex);
  if (wa.payload.len > 0) {
    w = wa;
    memset(w.payload.bytes, 0xab, w.payload.len);
    len = encode(&w, b);
    hex_encode(b, len, hex);
    AGENT_ERR(&im, USMIPC_EBADHANDLE, "open 0 %s 0", hex);
  }
  /* Memory behind a descriptor, with the descriptor flag cleared. */
  w = wa;
  w.flags = 0;
  len = encode(&w, b);
  hex_encode(b, len, hex);
  AGENT_ERR(&im, USMIPC_EBADHANDLE, "open 0 %s 0", hex);

  /* And the genuine one still works. */
  hex_encode(a.data, a.len, hex);
  AGENT_OK(&im, "open 0 %s 0", hex);
  AGENT_OK(&im, "check 0 10");
  AGENT_OK(&im, "close 0");
  agent_stop_ok(&im);
  export_drop(&a);
  export_drop(&c);
  return 0;
}

TEST_IMPL(handle_forged_range_known) {
  /* A forged range on an allocation the opener already holds: as a
   * same-process alias, and as a cached mapping of another process's
   * allocation. Neither path asks the exporter or the backend again, so
   * the range must be checked against the real allocation there too:
   * otherwise open returns a pointer past the end of the memory. Both cases
   * are tried before the verdict, so one report names every hole. */
  char problems[1024] = "";
  exported_t e;
  export_new(&e, 64 * 1024, 12);
  usmipc__wire_t w;
  uint8_t b[1024];
  decode_ok(&e, &w);
  w.allocation_size = e.size * 4;
  w.offset = e.size * 2;
  w.nbytes = 4096;
  size_t len = encode(&w, b);
  void *p = NULL;
  int r = usmipc_ipc_open(b, len, NULL, 0, &p, NULL);
  if (r == 0) {
    snprintf(problems + strlen(problems), sizeof(problems) - strlen(problems),
             "\n  same process: a handle claiming offset %zu of the %zu-byte "
             "allocation %p opened, returning %p, %zu bytes past its end",
             e.size * 2, e.size, (void *)e.ptr, p,
             (size_t)((uint8_t *)p - (e.ptr + e.size)));
    usmipc_ipc_close(p);
  } else {
    test_check_error(__FILE__, __LINE__, "forged open (same process)", r,
                     USMIPC_EBADHANDLE, USMIPC_ERANGE, USMIPC_ERANGE);
  }
  export_drop(&e);

  /* Another process's allocation, already mapped here. */
  agent_t ex;
  agent_start(&ex, NULL);
  AGENT_OK(&ex, "alloc 0 device 65536");
  AGENT_OK(&ex, "fill 0 13");
  AGENT_OK(&ex, "export 0 0 0");
  uint8_t good[1024];
  ssize_t glen = hex_decode(ex.reply, good, sizeof(good));
  ASSERT_GT(glen, 0);
  void *m = NULL;
  ASSERT_OK(usmipc_ipc_open(good, (size_t)glen, NULL, 0, &m, NULL));
  ASSERT_OK(usmipc__wire_decode(good, (size_t)glen, &w));
  w.allocation_size = 65536 * 4;
  w.offset = 65536 * 2;
  w.nbytes = 4096;
  len = encode(&w, b);
  p = NULL;
  r = usmipc_ipc_open(b, len, NULL, 0, &p, NULL);
  if (r == 0) {
    snprintf(problems + strlen(problems), sizeof(problems) - strlen(problems),
             "\n  cache hit: a handle claiming offset %d of a 65536-byte "
             "allocation mapped at %p opened, returning %p",
             65536 * 2, m, p);
    usmipc_ipc_close(p);
  } else {
    test_check_error(__FILE__, __LINE__, "forged open (cache hit)", r,
                     USMIPC_EBADHANDLE, USMIPC_ERANGE, USMIPC_ERANGE);
  }
  ASSERT_PATTERN(m, 65536, 13, 0); /* device memory: not touched directly */
  ASSERT_OK(usmipc_ipc_close(m));
  agent_stop_ok(&ex);
  ASSERT_MSG(problems[0] == '\0',
             "forged ranges were not checked against the real allocation:%s",
             problems);
  return 0;
}

TEST_IMPL(handle_range_overflow) {
  exported_t e;
  export_new(&e, 64 * 1024, 14);
  usmipc__wire_t w0, w;
  uint8_t b[1024];
  size_t len;
  decode_ok(&e, &w0);
  const uint64_t size = w0.allocation_size;

  struct {
    uint64_t alloc, off, nbytes;
  } ranges[] = {
      {size, size, 1},           /* starts at the end */
      {size, 0, size + 1},       /* one byte too many */
      {size, size - 10, 11},     /* ends one past */
      {size, UINT64_MAX - 1, 4}, /* offset + nbytes wraps */
      {size, 8, UINT64_MAX - 4}, /* nbytes wraps */
      {0, 0, 1},                 /* empty allocation */
      {size, 0, 0},              /* zero bytes */
  };
  for (size_t i = 0; i < sizeof(ranges) / sizeof(ranges[0]); i++) {
    w = w0;
    w.allocation_size = ranges[i].alloc;
    w.offset = ranges[i].off;
    w.nbytes = ranges[i].nbytes;
    len = encode(&w, b);
    ASSERT_ALL_REFUSE(b, len, USMIPC_EBADHANDLE);
  }

  /* The other fields decoding checks after the CRC. */
  w = w0;
  w.exporter_base = UINT64_MAX - 100; /* base + size wraps */
  len = encode(&w, b);
  ASSERT_ALL_REFUSE(b, len, USMIPC_EBADHANDLE);
  w = w0;
  w.flags |= 0x8000; /* unknown flag */
  len = encode(&w, b);
  ASSERT_ALL_REFUSE(b, len, USMIPC_EBADHANDLE);
  w = w0;
  w.pid = 0;
  len = encode(&w, b);
  ASSERT_ALL_REFUSE(b, len, USMIPC_EBADHANDLE);
  w = w0;
  w.nonce = 0;
  len = encode(&w, b);
  ASSERT_ALL_REFUSE(b, len, USMIPC_EBADHANDLE);
  /* A descriptor number past INT32_MAX, on a handle that has a descriptor
   * (set FD: a handle without one, such as CUDA's native kind, ignores the
   * number). */
  w = w0;
  w.flags |= USMIPC__WIRE_FLAG_FD;
  w.fd_number = 0x80000000u;
  len = encode(&w, b);
  ASSERT_ALL_REFUSE(b, len, USMIPC_EBADHANDLE);
  /* The same for the export table's descriptor, on a handle with a slot. */
  w = w0;
  if (w.export_slot == USMIPC__NO_SLOT)
    w.export_slot = 0;
  w.table_fd_number = 0x80000000u;
  len = encode(&w, b);
  ASSERT_ALL_REFUSE(b, len, USMIPC_EBADHANDLE);

  memcpy(b, e.data, e.len);
  put16le(b + WIRE_OFF_EXT_LEN, 1); /* disagrees with the length */
  fix_crc(b, e.len);
  ASSERT_ALL_REFUSE(b, e.len, USMIPC_EBADHANDLE);
  memcpy(b, e.data, e.len);
  put16le(b + WIRE_OFF_PAYLOAD_LEN, USMIPC__PAYLOAD_MAX + 1); /* too long */
  fix_crc(b, e.len);
  ASSERT_ALL_REFUSE(b, e.len, USMIPC_EBADHANDLE);
  memcpy(b, e.data, e.len);
  put16le(b + WIRE_OFF_PAYLOAD_LEN, 0xffff);
  fix_crc(b, e.len);
  ASSERT_ALL_REFUSE(b, e.len, USMIPC_EBADHANDLE);
  export_drop(&e);
  return 0;
}

TEST_IMPL(handle_null_and_empty) {
  exported_t e;
  export_new(&e, 64 * 1024, 15);
  void *p = NULL;
  usmipc_ipc_handle_info_t info;
  usmipc__wire_t w;
  ASSERT_ERR2(usmipc_ipc_open(NULL, 0, NULL, 0, &p, NULL), USMIPC_EINVAL,
              USMIPC_EBADHANDLE);
  ASSERT_ERR(usmipc_ipc_open(NULL, e.len, NULL, 0, &p, NULL), USMIPC_EINVAL);
  ASSERT_ERR2(usmipc_ipc_open("", 0, NULL, 0, &p, NULL), USMIPC_EINVAL,
              USMIPC_EBADHANDLE);
  ASSERT_ERR(usmipc_ipc_open(e.data, e.len, NULL, 0, NULL, NULL),
             USMIPC_EINVAL);
  ASSERT_ERR2(usmipc_ipc_handle_inspect(NULL, 0, &info), USMIPC_EINVAL,
              USMIPC_EBADHANDLE);
  ASSERT_ERR(usmipc_ipc_handle_inspect(NULL, 10, &info), USMIPC_EINVAL);
  ASSERT_ERR2(usmipc__wire_decode(NULL, 0, &w), USMIPC_EINVAL,
              USMIPC_EBADHANDLE);

  /* Things people pass by mistake: text, the handle as hex, zeros. */
  static const char text[] = "this is not a handle, it is a sentence";
  ASSERT_ALL_REFUSE((const uint8_t *)text, sizeof(text), USMIPC_EBADHANDLE);
  static char hex[HEX_MAX];
  hex_encode(e.data, e.len, hex);
  ASSERT_ALL_REFUSE((const uint8_t *)hex, strlen(hex), USMIPC_EBADHANDLE);
  uint8_t zeros[256] = {0};
  ASSERT_ALL_REFUSE(zeros, e.len, USMIPC_EBADHANDLE);
  ASSERT_ALL_REFUSE(zeros, sizeof(zeros), USMIPC_EBADHANDLE);
  export_drop(&e);
  return 0;
}

/* ---- record 0x8102: memory in chunks --------------------------------------
 * A handle of another library's CUDA VMM memory names a run of physical
 * chunks; the importer maps exactly the pieces the record lists, so a
 * forged layout must be refused before anything is mapped. These handles
 * are forged from one of usmipc's own (a 64 KiB allocation): the decoder
 * is the same for every backend. */

/* Appends record 0x8102 with count chunks in the given runs. */
static void put_chunks(usmipc__wire_t *w, uint16_t count, uint16_t runs,
                       const uint64_t *sizes, const uint32_t *ns) {
  uint8_t *r = w->ext + w->ext_len;
  uint16_t rlen = (uint16_t)(8 + 16 * runs);
  put16le(r, 0x8102);
  put16le(r + 2, rlen);
  memset(r + 4, 0, rlen);
  put16le(r + 4, count);
  put16le(r + 6, runs);
  for (uint16_t i = 0; i < runs; i++) {
    uint8_t *run = r + 4 + 8 + 16 * i;
    for (int b = 0; b < 8; b++)
      run[b] = (uint8_t)(sizes[i] >> (8 * b));
    for (int b = 0; b < 4; b++)
      run[8 + b] = (uint8_t)(ns[i] >> (8 * b));
  }
  w->ext_len = (uint16_t)(w->ext_len + 4 + rlen);
}

/* The wire of e's handle, made fit to carry chunks: descriptors to fetch
 * (FD), not reopenable, an export slot (every export has one). */
static void chunkable(const exported_t *e, usmipc__wire_t *w) {
  decode_ok(e, w);
  w->flags = (uint16_t)((w->flags & ~USMIPC__WIRE_FLAG_REOPENABLE) |
                        USMIPC__WIRE_FLAG_FD);
  if (w->fd_number > INT32_MAX)
    w->fd_number = 3;
  ASSERT(w->export_slot != USMIPC__NO_SLOT);
  ASSERT_UEQ(w->allocation_size, 64 * 1024);
  w->offset = 12345;
  w->nbytes = 40000;
}

/* Chunk records make long handles (a Level Zero handle has its own record
 * too): room for the largest. */
static size_t encode_long(const usmipc__wire_t *w, uint8_t *out) {
  size_t len = usmipc__wire_len(w);
  ASSERT_LE(len, 2048);
  usmipc__wire_encode(w, out);
  return len;
}

#define ASSERT_CHUNKS_REFUSED(w, words)                                        \
  do {                                                                         \
    uint8_t b_[2048];                                                          \
    size_t len_ = encode_long((w), b_);                                        \
    ASSERT_ALL_REFUSE(b_, len_, USMIPC_EBADHANDLE);                            \
    ASSERT_MSG(strstr(usmipc_last_error(), (words)) != NULL,                   \
               "expected \"%s\" in: %s", (words), usmipc_last_error());        \
  } while (0)

TEST_IMPL(handle_chunk_records) {
  exported_t e;
  export_new(&e, 64 * 1024, 11);
  usmipc__wire_t w0, w, back;
  uint8_t b[2048];
  size_t len;
  chunkable(&e, &w0);
  const uint64_t page = 4096;

  /* Valid: four 16 KiB chunks, and 8 + 8 + 16 + 32 KiB in three runs. */
  w = w0;
  put_chunks(&w, 4, 1, (uint64_t[]){4 * page}, (uint32_t[]){4});
  len = encode_long(&w, b);
  ASSERT_OK(usmipc__wire_decode(b, len, &back));
  ASSERT_EQ(back.chunk_count, 4);
  uint64_t sizes[USMIPC__CHUNKS_MAX];
  ASSERT_EQ(usmipc__wire_chunk_sizes(&back, sizes), 4);
  for (int i = 0; i < 4; i++)
    ASSERT_UEQ(sizes[i], 4 * page);
  ASSERT_OK(usmipc_ipc_handle_inspect(b, len, NULL));
  /* The writer makes exactly these bytes. */
  uint8_t rec[USMIPC__CHUNKS_RECORD_MAX];
  ASSERT_EQ(usmipc__chunks_record(sizes, 4, rec), 4 + 8 + 16);
  ASSERT(memcmp(rec, back.ext + back.chunks_at - 12, 4 + 8 + 16) == 0);
  /* Opening it here fails cleanly: the host backend has no chunks, and on
   * a GPU the exporter's grant holds one descriptor, not four. */
  ASSERT(open_here(b, len, NULL) != 0);
  if (test_device_is_host())
    ASSERT_ERR(open_here(b, len, NULL), USMIPC_EBADHANDLE);

  w = w0;
  put_chunks(&w, 4, 3, (uint64_t[]){2 * page, 4 * page, 8 * page},
             (uint32_t[]){2, 1, 1});
  len = encode_long(&w, b);
  ASSERT_OK(usmipc__wire_decode(b, len, &back));
  ASSERT_EQ(usmipc__wire_chunk_sizes(&back, sizes), 4);
  ASSERT_UEQ(sizes[0] + sizes[1] + sizes[2] + sizes[3], 64 * 1024);
  ASSERT_UEQ(sizes[1], 2 * page);
  ASSERT_UEQ(sizes[2], 4 * page);

  /* Layouts that do not cover exactly the allocation. */
  w = w0;
  put_chunks(&w, 3, 1, (uint64_t[]){4 * page}, (uint32_t[]){3});
  ASSERT_CHUNKS_REFUSED(&w, "do not cover exactly the allocation");
  w = w0;
  put_chunks(&w, 5, 1, (uint64_t[]){4 * page}, (uint32_t[]){5});
  ASSERT_CHUNKS_REFUSED(&w, "extend past the allocation");
  w = w0; /* sizes whose product wraps around 2^64 */
  put_chunks(&w, 2, 1, (uint64_t[]){UINT64_C(1) << 63}, (uint32_t[]){2});
  ASSERT_CHUNKS_REFUSED(&w, "extend past the allocation");
  w = w0;
  put_chunks(&w, 2, 2, (uint64_t[]){page, 14 * page}, (uint32_t[]){1, 1});
  ASSERT_CHUNKS_REFUSED(&w, "do not cover exactly");

  /* Counts. */
  w = w0;
  put_chunks(&w, 1, 1, (uint64_t[]){16 * page}, (uint32_t[]){1});
  ASSERT_CHUNKS_REFUSED(&w, "fewer than 2 or more than 250 chunks");
  w = w0;
  put_chunks(&w, 251, 1, (uint64_t[]){page}, (uint32_t[]){251});
  ASSERT_CHUNKS_REFUSED(&w, "fewer than 2 or more than 250 chunks");
  w = w0;
  put_chunks(&w, 4, 2, (uint64_t[]){4 * page, 8 * page}, (uint32_t[]){4, 1});
  ASSERT_CHUNKS_REFUSED(&w, "hold more chunks than it counts");
  w = w0;
  put_chunks(&w, 5, 1, (uint64_t[]){4 * page}, (uint32_t[]){4});
  ASSERT_CHUNKS_REFUSED(&w, "do not cover exactly");

  /* Runs: empty, of zero or partial pages, split, too many, miscounted. */
  w = w0;
  put_chunks(&w, 4, 2, (uint64_t[]){4 * page, 8 * page}, (uint32_t[]){4, 0});
  ASSERT_CHUNKS_REFUSED(&w, "empty run");
  w = w0;
  put_chunks(&w, 2, 2, (uint64_t[]){0, 16 * page}, (uint32_t[]){1, 1});
  ASSERT_CHUNKS_REFUSED(&w, "empty run");
  w = w0;
  put_chunks(&w, 2, 2, (uint64_t[]){1000, 65536 - 1000}, (uint32_t[]){1, 1});
  ASSERT_CHUNKS_REFUSED(&w, "whole pages");
  w = w0;
  put_chunks(&w, 4, 2, (uint64_t[]){4 * page, 4 * page}, (uint32_t[]){2, 2});
  ASSERT_CHUNKS_REFUSED(&w, "splits a run of equal chunks");
  w = w0;
  uint64_t many_sizes[49];
  uint32_t many_ns[49];
  for (int i = 0; i < 49; i++) {
    many_sizes[i] = (uint64_t)(i % 2 + 1) * page;
    many_ns[i] = 1;
  }
  put_chunks(&w, 49, 49, many_sizes, many_ns);
  ASSERT_CHUNKS_REFUSED(&w, "exceeds 48");
  /* Raw edits of the record, which follows the backend's own (Level Zero
   * handles carry one). */
  const size_t at = w0.ext_len;
  w = w0; /* the header says 2 runs, the length holds 1 */
  put_chunks(&w, 4, 1, (uint64_t[]){4 * page}, (uint32_t[]){4});
  put16le(w.ext + at + 4 + 2, 2);
  ASSERT_CHUNKS_REFUSED(&w, "run count disagrees with its length");
  w = w0; /* a length that is not 8 + 16 r */
  put_chunks(&w, 4, 1, (uint64_t[]){4 * page}, (uint32_t[]){4});
  put16le(w.ext + at + 2, 8 + 15);
  w.ext_len = (uint16_t)(w.ext_len - 1);
  ASSERT_CHUNKS_REFUSED(&w, "malformed length");
  w = w0; /* reserved bytes, in the header and in a run */
  put_chunks(&w, 4, 1, (uint64_t[]){4 * page}, (uint32_t[]){4});
  w.ext[at + 4 + 7] = 1;
  ASSERT_CHUNKS_REFUSED(&w, "reserved bytes");
  w = w0;
  put_chunks(&w, 4, 1, (uint64_t[]){4 * page}, (uint32_t[]){4});
  w.ext[at + 4 + 8 + 15] = 1;
  ASSERT_CHUNKS_REFUSED(&w, "reserved bytes set");

  /* Descriptors: a run travels as descriptors, never reopenable ones. */
  w = w0;
  w.flags = (uint16_t)(w.flags & ~USMIPC__WIRE_FLAG_FD);
  w.fd_number = UINT32_MAX;
  put_chunks(&w, 4, 1, (uint64_t[]){4 * page}, (uint32_t[]){4});
  ASSERT_CHUNKS_REFUSED(&w, "without descriptors to fetch");
  w = w0;
  w.flags |= USMIPC__WIRE_FLAG_REOPENABLE;
  put_chunks(&w, 4, 1, (uint64_t[]){4 * page}, (uint32_t[]){4});
  ASSERT_CHUNKS_REFUSED(&w, "reopenable");

  /* Twice, or with a pool block record. */
  w = w0;
  put_chunks(&w, 4, 1, (uint64_t[]){4 * page}, (uint32_t[]){4});
  put_chunks(&w, 4, 1, (uint64_t[]){4 * page}, (uint32_t[]){4});
  ASSERT_CHUNKS_REFUSED(&w, "two chunk records");
  w = w0;
  uint8_t *blk = w.ext + w.ext_len;
  put16le(blk, 0x8101);
  put16le(blk + 2, 48);
  memset(blk + 4, 0, 48);
  blk[4] = 1;                 /* block id */
  for (int i = 0; i < 8; i++) /* block size: the allocation */
    blk[4 + 40 + i] = (uint8_t)((uint64_t)(64 * 1024) >> (8 * i));
  w.ext_len = (uint16_t)(w.ext_len + 52);
  put_chunks(&w, 4, 1, (uint64_t[]){4 * page}, (uint32_t[]){4});
  ASSERT_CHUNKS_REFUSED(&w, "pool block of a run of chunks");

  /* In an event handle. */
  usmipc_queue_t *q;
  usmipc_event_t *ev;
  usmipc_ipc_handle_t *eh;
  const void *edata;
  size_t elen;
  ASSERT_OK(usmipc_queue_create(test_device(), &q));
  ASSERT_OK(usmipc_event_create(test_device(), 0, &ev));
  ASSERT_OK(usmipc_event_record(ev, q));
  ASSERT_OK(usmipc_ipc_get_event_handle(ev, &eh));
  ASSERT_OK(usmipc_ipc_handle_data(eh, &edata, &elen));
  ASSERT_OK(usmipc__wire_decode(edata, elen, &w));
  put_chunks(&w, 4, 1, (uint64_t[]){4 * page}, (uint32_t[]){4});
  len = encode_long(&w, b);
  ASSERT_ERR(usmipc__wire_decode(b, len, &back), USMIPC_EBADHANDLE);
  ASSERT_MSG(strstr(usmipc_last_error(), "event handle carries a chunk"), "%s",
             usmipc_last_error());
  ASSERT_OK(usmipc_ipc_free_handle(eh));
  ASSERT_OK(usmipc_event_destroy(ev));
  ASSERT_OK(usmipc_queue_destroy(q));

  /* The writer: one run per change of size, at most 48 of them. */
  uint64_t alt[USMIPC__CHUNKS_MAX];
  for (int i = 0; i < USMIPC__CHUNKS_MAX; i++)
    alt[i] = (uint64_t)(i / 5 % 2 + 1) << 21; /* 2 or 4 MiB, five at a time */
  ASSERT_EQ(usmipc__chunks_record(alt, 240, rec), 4 + 8 + 16 * 48);
  ASSERT_EQ(usmipc__chunks_record(alt, 245, rec), 0);
  ASSERT_EQ(usmipc__chunks_record(alt, 2, rec), 4 + 8 + 16);
  export_drop(&e);
  return 0;
}

/* Every slot and descriptor index a handle carries, set past its range
 * (0x00100005 and 0xFFFFFFF0, checksum recomputed), is refused with
 * USMIPC_EBADHANDLE and a message naming it: the allocation's export slot
 * (decoded as is, since only another process's open reads the exporter's
 * table with it, and refuses it there), an event handle's slot, an ordering
 * record's event slot, a pool block record's slot, and the descriptor
 * numbers of the allocation and of the export table. */
TEST_IMPL(handle_slots_out_of_range) {
  const uint32_t bad[] = {0x00100005u, 0xFFFFFFF0u};
  uint8_t b[1024], h[1024];
  usmipc__wire_t w;
  size_t len;
#define ASSERT_REFUSED_SAYING(words)                                           \
  do {                                                                         \
    ASSERT_ERR(usmipc_ipc_handle_inspect(b, len, NULL), USMIPC_EBADHANDLE);    \
    ASSERT_MSG(strstr(usmipc_last_error(), (words)) != NULL,                   \
               "expected \"%s\" in: %s", (words), usmipc_last_error());        \
  } while (0)

  agent_t ex;
  agent_start(&ex, NULL);
  AGENT_OK(&ex, "alloc 0 device 4096");
  AGENT_OK(&ex, "export 0 0 0");
  ssize_t hlen = hex_decode(ex.reply, h, sizeof(h));
  ASSERT_GT(hlen, 0);
  for (int i = 0; i < 2; i++) {
    ASSERT_OK(usmipc__wire_decode(h, (size_t)hlen, &w));
    w.export_slot = bad[i];
    len = encode(&w, b);
    ASSERT_ERR(open_here(b, len, NULL), USMIPC_EBADHANDLE);
    ASSERT_MSG(strstr(usmipc_last_error(), "export slot") != NULL &&
                   strstr(usmipc_last_error(), "out of range") != NULL,
               "%s", usmipc_last_error());
    if (has_fd(&w)) {
      ASSERT_OK(usmipc__wire_decode(h, (size_t)hlen, &w));
      w.fd_number = bad[i] | 0x80000000u;
      len = encode(&w, b);
      ASSERT_REFUSED_SAYING("file descriptor number is out of range");
    }
    ASSERT_OK(usmipc__wire_decode(h, (size_t)hlen, &w));
    w.table_fd_number = bad[i] | 0x80000000u;
    len = encode(&w, b);
    ASSERT_REFUSED_SAYING("export table descriptor number is out of range");
  }
  ASSERT_OK(open_here(h, (size_t)hlen, NULL)); /* the honest bytes open */
  agent_stop_ok(&ex);

  /* A pool block's own slot. */
  usmipc_pool_t *pool;
  void *blk;
  usmipc_ipc_handle_t *bh;
  const void *data;
  ASSERT_OK(usmipc_pool_create(test_device(), 0, 0, &pool));
  ASSERT_OK(usmipc_pool_malloc(pool, 256, 0, &blk));
  ASSERT_OK(usmipc_ipc_get_handle(blk, 0, &bh));
  ASSERT_OK(usmipc_ipc_handle_data(bh, &data, &len));
  memcpy(h, data, len);
  hlen = (ssize_t)len;
  for (int i = 0; i < 2; i++) {
    ASSERT_OK(usmipc__wire_decode(h, (size_t)hlen, &w));
    uint16_t rlen;
    uint8_t *rec =
        (uint8_t *)usmipc__wire_ext_find(&w, USMIPC__EXT_BLOCK, &rlen);
    ASSERT_NOT_NULL(rec);
    usmipc__put32le(rec + 8, bad[i]);
    len = encode(&w, b);
    ASSERT_REFUSED_SAYING("pool block record's export slot is out of range");
    /* The block's offset in its segment, past the segment. */
    ASSERT_OK(usmipc__wire_decode(h, (size_t)hlen, &w));
    rec = (uint8_t *)usmipc__wire_ext_find(&w, USMIPC__EXT_BLOCK, &rlen);
    usmipc__put64le(rec + 32, w.allocation_size + (i ? UINT64_MAX / 2 : 1));
    len = encode(&w, b);
    ASSERT_REFUSED_SAYING("pool block lies outside the allocation");
  }
  ASSERT_OK(usmipc_ipc_free_handle(bh));
  ASSERT_OK(usmipc_free(blk));
  ASSERT_OK(usmipc_pool_destroy(pool));

  /* An event handle's slot, and an ordering record's. */
  usmipc_event_t *ev;
  int rc = usmipc_event_create(test_device(), 0, &ev);
  if (rc == USMIPC_ENOTSUP)
    return 0; /* no events on this device */
  ASSERT_OK(rc);
  usmipc_queue_t *q;
  usmipc_ipc_handle_t *eh, *mh;
  void *mem;
  ASSERT_OK(usmipc_queue_create(test_device(), &q));
  ASSERT_OK(usmipc_event_record(ev, q));
  ASSERT_OK(usmipc_ipc_get_event_handle(ev, &eh));
  ASSERT_OK(usmipc_ipc_handle_data(eh, &data, &len));
  memcpy(h, data, len);
  hlen = (ssize_t)len;
  for (int i = 0; i < 2; i++) {
    ASSERT_OK(usmipc__wire_decode(h, (size_t)hlen, &w));
    w.export_slot = bad[i];
    len = encode(&w, b);
    ASSERT_REFUSED_SAYING("event handle without an export-table slot");
  }
  ASSERT_OK(usmipc_malloc(test_device(), USMIPC_MEM_DEVICE, 4096, &mem));
  ASSERT_OK(usmipc_ipc_get_handle(mem, 0, &mh));
  ASSERT_OK(usmipc_ipc_handle_order(mh, q));
  ASSERT_OK(usmipc_ipc_handle_data(mh, &data, &len));
  memcpy(h, data, len);
  hlen = (ssize_t)len;
  for (int i = 0; i < 2; i++) {
    ASSERT_OK(usmipc__wire_decode(h, (size_t)hlen, &w));
    ASSERT(w.order_len > 0);
    usmipc__put32le(w.ext + w.order_at + 16, bad[i]);
    len = encode(&w, b);
    ASSERT_REFUSED_SAYING("ordering record's export slot is out of range");
  }
#undef ASSERT_REFUSED_SAYING
  ASSERT_OK(usmipc_ipc_free_handle(mh));
  ASSERT_OK(usmipc_free(mem));
  ASSERT_OK(usmipc_ipc_free_handle(eh));
  ASSERT_OK(usmipc_event_destroy(ev));
  ASSERT_OK(usmipc_queue_destroy(q));
  return 0;
}

/* The export table's own indexes, read by every importer on every open:
 * the liveness word's offset in the header, which the exporter publishes
 * after an importer may have mapped (and checked) the table, and the slot
 * index. Out of range, neither is followed: the exporter counts as gone,
 * the slot as forged. A table as an importer sees it (zero pages). */
TEST_IMPL(handle_table_indexes_bounded) {
  uint8_t *t = calloc(1, USMIPC__TABLE_BYTES);
  ASSERT_NOT_NULL(t);
  usmipc__put64le(t + USMIPC__HDR_SLOTS, USMIPC__TABLE_SLOTS);
  const uint32_t offsets[] = {0xFFFFFFF0u,
                              0xFFFFFFFCu,
                              0x00100005u,
                              USMIPC__HDR_MUTEX - 4,
                              USMIPC__HDR_MUTEX + USMIPC__HDR_MUTEX_BYTES - 2,
                              USMIPC__HDR_MUTEX + 2};
  for (size_t i = 0; i < sizeof(offsets) / sizeof(offsets[0]); i++) {
    __atomic_store_n((uint32_t *)(t + USMIPC__HDR_ALIVE_OFFSET), offsets[i],
                     __ATOMIC_RELEASE);
    ASSERT_EQ(usmipc__table_alive(t), 0);
  }
  /* In range, the word is read: a holder's tid, not owner-died. */
  __atomic_store_n((uint32_t *)(t + USMIPC__HDR_ALIVE_OFFSET),
                   USMIPC__HDR_MUTEX, __ATOMIC_RELEASE);
  usmipc__put32le(t + USMIPC__HDR_MUTEX, 1234);
  ASSERT_EQ(usmipc__table_alive(t), 1);
  usmipc__export_slot_t s;
  ASSERT_ERR(usmipc__table_read_slot(t, 0xFFFFFFF0u, &s, NULL),
             USMIPC_EBADHANDLE);
  ASSERT_OK(usmipc__table_read_slot(t, USMIPC__TABLE_SLOTS - 1, &s, NULL));
  free(t);
  return 0;
}
