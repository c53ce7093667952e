/* libFuzzer target for the broker's request parser.
 *
 * A broker reads 80 bytes from any process of its user that connects (and
 * answers others a refusal without reading): usmipc__request_check must
 * take any bytes, of any length, without crashing, and may accept a request
 * only when its framing, its exporter (pid, nonce) and its proof (a MAC
 * keyed by the process key) are right; the capability check must accept
 * only the MAC of the export's token. Most random inputs fail the proof, so
 * each input is also run with a valid proof recomputed over it, as a
 * process holding a handle would write it, to reach the checks behind.
 *
 * Build and run like fuzz_handle (tests/fuzz/CMakeLists.txt). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "blake2s.h"
#include "common.h"

#define FUZZ_TARGET "fuzz_request"
#include "fuzz.h"

/* The broker under test: a fixed identity. */
static const uint8_t KEY[16] = {1, 2,  3,  4,  5,  6,  7,  8,
                                9, 10, 11, 12, 13, 14, 15, 16};
static const uint8_t TOKEN[16] = {0xa0, 0xa1, 0xa2, 0xa3, 0xa4, 0xa5,
                                  0xa6, 0xa7, 0xa8, 0xa9, 0xaa, 0xab,
                                  0xac, 0xad, 0xae, 0xaf};
#define PID 4242u
#define NONCE 0x1122334455667788ull

static uint32_t le32(const uint8_t *p) {
  return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 |
         (uint32_t)p[3] << 24;
}

static void check_one(const uint8_t *req, size_t len) {
  uint32_t want = 0xdead;
  uint64_t buffer_id = 0;
  uint32_t status =
      usmipc__request_check(req, len, PID, NONCE, KEY, &want, &buffer_id);
  FUZZ_CHECK(status <= 6, "status %u", status);
  if (status != 0)
    return;
  /* Accepted: every promise holds. */
  FUZZ_CHECK(len == USMIPC__REQUEST_LEN, "accepted %zu bytes", len);
  FUZZ_CHECK((want >= 1 && want <= 3) || want == USMIPC__WANT_RELEASE,
             "want %u", want);
  FUZZ_CHECK(le32(req + 8) == PID, "pid");
  /* A rebuilt request from the same fields and nonce is byte-identical in
   * its first 64 bytes: the proof covers exactly what the broker uses. */
  usmipc__wire_t w;
  memset(&w, 0, sizeof(w));
  w.pid = PID;
  w.nonce = NONCE;
  memcpy(&w.buffer_id, req + 24, 8);
  memcpy(w.key, KEY, 16);
  memcpy(w.token, TOKEN, 16);
  uint8_t again[USMIPC__REQUEST_LEN];
  usmipc__request_build(again, &w, want, req + 32);
  FUZZ_CHECK(memcmp(again, req, 64) == 0, "proof covers other bytes");
  /* The capability: the token's MAC and nothing else. */
  uint8_t msg[16 + 48 + 8], expect[16];
  memcpy(msg, "usmipc-capabil-2", 16);
  memcpy(msg + 16, req, 48);
  memset(msg + 64, 0, 8);
  usmipc__mac(expect, TOKEN, msg, sizeof(msg));
  int cap = usmipc__request_capability_ok(req, TOKEN);
  FUZZ_CHECK(cap == (memcmp(expect, req + 64, 16) == 0), "capability");
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* A release's body (after the 80-byte request and a u16 length): the parse
 * accepts only what it promises, and the broker's filing of it (no release
 * is registered here, so after the body and the consumer's event handle are
 * checked it answers "unknown") takes any bytes. */
static void check_release(const uint8_t *data, size_t size) {
  if (size < USMIPC__REQUEST_LEN + 2)
    return;
  const uint8_t *body = data + USMIPC__REQUEST_LEN + 2;
  size_t len = size - USMIPC__REQUEST_LEN - 2;
  if (len > USMIPC__RELEASE_BODY_MAX)
    len = USMIPC__RELEASE_BODY_MAX;
  uint64_t ticket = 0;
  const uint8_t *ev = NULL;
  size_t ev_len = 0;
  if (usmipc__release_body_parse(body, len, &ticket, &ev, &ev_len) == 0) {
    FUZZ_CHECK(ticket != 0 && ev_len == len - 10 &&
                   (ev_len == 0) == (ev == NULL),
               "release body");
  }
  uint32_t status = usmipc__release_arrived(data, body, len);
  FUZZ_CHECK(status == 1 || status == 4, "release status %u", status);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  check_one(data, size);
  check_release(data, size);
  if (size >= 48) {
    /* The same bytes with a valid proof (and, from the fuzzer's first
     * byte, a valid capability or not): the checks behind the MAC. */
    uint8_t req[USMIPC__REQUEST_LEN] = {0};
    memcpy(req, data, size < sizeof(req) ? size : sizeof(req));
    uint8_t msg[16 + 48 + 8];
    memcpy(msg, "usmipc-request-2", 16);
    memcpy(msg + 16, req, 48);
    memset(msg + 64, 0, 8);
    usmipc__mac(req + 48, KEY, msg, sizeof(msg));
    if (data[0] & 1) {
      memcpy(msg, "usmipc-capabil-2", 16);
      usmipc__mac(req + 64, TOKEN, msg, sizeof(msg));
    }
    check_one(req, sizeof(req));
  }
  return 0;
}

#ifndef USMIPC_LIBFUZZER
void fuzz_write_seed(const char *name, const uint8_t *data, size_t len);
int fuzz_make_corpus(void);

int fuzz_make_corpus(void) {
  usmipc__wire_t w;
  memset(&w, 0, sizeof(w));
  w.pid = PID;
  w.nonce = NONCE;
  w.buffer_id = 77;
  memcpy(w.key, KEY, 16);
  memcpy(w.token, TOKEN, 16);
  static const uint8_t client[16] = {9, 9, 9, 9, 9, 9, 9, 9,
                                     9, 9, 9, 9, 9, 9, 9, 9};
  uint8_t req[USMIPC__REQUEST_LEN];
  for (unsigned want = 0; want <= 4; want++) {
    char name[32];
    usmipc__request_build(req, &w, want, client);
    snprintf(name, sizeof(name), "valid-want-%u", want);
    fuzz_write_seed(name, req, sizeof(req));
  }
  usmipc__request_build(req, &w, 3, client);
  fuzz_write_seed("truncated-47", req, 47);
  fuzz_write_seed("empty", req, 0);
  req[4] = 1; /* version 1 */
  fuzz_write_seed("version-1", req, sizeof(req));
  usmipc__request_build(req, &w, 3, client);
  req[50] ^= 1; /* a proof off by a bit */
  fuzz_write_seed("bad-proof", req, sizeof(req));
  w.pid = PID + 1; /* a request for another process */
  usmipc__request_build(req, &w, 3, client);
  fuzz_write_seed("other-pid", req, sizeof(req));
  /* A release: request, length, body (ticket, an empty event). */
  w.pid = PID;
  uint8_t rel[USMIPC__REQUEST_LEN + 2 + 10];
  usmipc__request_build(rel, &w, USMIPC__WANT_RELEASE, client);
  rel[USMIPC__REQUEST_LEN] = 10;
  rel[USMIPC__REQUEST_LEN + 1] = 0;
  memset(rel + USMIPC__REQUEST_LEN + 2, 0, 10);
  rel[USMIPC__REQUEST_LEN + 2] = 1; /* ticket 1 */
  fuzz_write_seed("release-empty-event", rel, sizeof(rel));
  return 0;
}
#endif
