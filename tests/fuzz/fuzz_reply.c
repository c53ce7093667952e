/* libFuzzer target for the importer's handling of a broker's answer.
 *
 * An importer reads 48 bytes and up to four descriptors from whatever
 * listens on the exporter's socket: usmipc__reply_check must take any bytes
 * and descriptor counts without crashing, and may accept an answer only
 * when it is an authentic OK (the MAC over the importer's own nonce, keyed
 * by the handle's process key) carrying exactly the descriptors asked for.
 * Each input also runs with a valid MAC recomputed over it, to reach the
 * status and descriptor checks behind.
 *
 * Input: byte 0 = want (low 2 bits), truncation (bit 2) and a handle of
 * a run of 5 chunks (bit 3: the descriptor is 5), byte 1 = descriptors
 * received (low 3 bits), then the answer's bytes. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "blake2s.h"
#include "common.h"

#define FUZZ_TARGET "fuzz_reply"
#include "fuzz.h"

static const uint8_t KEY[16] = {1, 2,  3,  4,  5,  6,  7,  8,
                                9, 10, 11, 12, 13, 14, 15, 16};
static const uint8_t CLIENT[16] = {7, 7, 7, 7, 7, 7, 7, 7,
                                   7, 7, 7, 7, 7, 7, 7, 7};

static uint32_t le32(const uint8_t *p) {
  return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 |
         (uint32_t)p[3] << 24;
}

static void check_one(const uint8_t *rep, size_t n, unsigned want, int nfds,
                      bool truncated, uint16_t chunks) {
  usmipc__wire_t w;
  memset(&w, 0, sizeof(w));
  w.chunk_count = chunks;
  w.pid = 4242;
  w.nonce = 0x1122334455667788ull;
  w.buffer_id = 77;
  memcpy(w.key, KEY, 16);
  uint8_t req[USMIPC__REQUEST_LEN];
  usmipc__request_build(req, &w, want, CLIENT);
  int rc = usmipc__reply_check(rep, n, req, &w, want, nfds, truncated, "fuzz");
  if (rc != 0) {
    FUZZ_CHECK(rc == USMIPC_EEXPORTERGONE || rc == USMIPC_EUNTRUSTED ||
                   rc == USMIPC_EACCES || rc == USMIPC_ETRANSPORT,
               "code %d", rc);
    FUZZ_CHECK(usmipc_last_error()[0] != '\0', "no message");
    return;
  }
  /* Accepted: an authentic OK with exactly what was asked. */
  int expect = ((want & 1) ? 1 : 0) + ((want & 2) ? (chunks ? chunks : 1) : 0);
  FUZZ_CHECK(n == USMIPC__REPLY_LEN && le32(rep + 4) == 0, "not ok");
  FUZZ_CHECK(nfds == expect && !truncated, "descriptors %d of %d", nfds,
             expect);
  uint8_t good[USMIPC__REPLY_LEN];
  usmipc__reply_build(good, req, 0, expect, KEY);
  FUZZ_CHECK(memcmp(good, rep, USMIPC__REPLY_LEN) == 0,
             "accepted an answer the exporter did not write");
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size < 2)
    return 0;
  unsigned want = data[0] & 3;
  bool truncated = (data[0] & 4) != 0;
  uint16_t chunks = (data[0] & 8) ? 5 : 0;
  int nfds = data[1] & 7;
  const uint8_t *rep = data + 2;
  size_t n = size - 2;
  check_one(rep, n, want, nfds, truncated, chunks);
  if (n >= 32) {
    /* The same answer with a valid MAC and echo, as the exporter signs. */
    uint8_t fixed[USMIPC__REPLY_LEN] = {0};
    memcpy(fixed, rep, n < sizeof(fixed) ? n : sizeof(fixed));
    memcpy(fixed + 16, CLIENT, 16);
    uint8_t msg[16 + 32 + 8];
    memcpy(msg, "usmipc-reply---2", 16);
    memcpy(msg + 16, fixed, 32);
    uint64_t id = 77;
    for (int i = 0; i < 8; i++)
      msg[48 + i] = (uint8_t)(id >> (8 * i));
    usmipc__mac(fixed + 32, KEY, msg, sizeof(msg));
    check_one(fixed, sizeof(fixed), want, nfds, truncated, chunks);
  }
  return 0;
}

#ifndef USMIPC_LIBFUZZER
void fuzz_write_seed(const char *name, const uint8_t *data, size_t len);
int fuzz_make_corpus(void);

int fuzz_make_corpus(void) {
  usmipc__wire_t w;
  memset(&w, 0, sizeof(w));
  w.pid = 4242;
  w.nonce = 0x1122334455667788ull;
  w.buffer_id = 77;
  memcpy(w.key, KEY, 16);
  uint8_t in[2 + USMIPC__REPLY_LEN];
  for (unsigned want = 1; want <= 3; want++) {
    for (uint32_t status = 0; status <= 7; status++) {
      uint8_t req[USMIPC__REQUEST_LEN];
      usmipc__request_build(req, &w, want, CLIENT);
      int nfds = status ? 0 : ((want & 1) != 0) + ((want & 2) != 0);
      in[0] = (uint8_t)want;
      in[1] = (uint8_t)nfds;
      usmipc__reply_build(in + 2, req, status, nfds, KEY);
      char name[48];
      snprintf(name, sizeof(name), "want-%u-status-%u", want, status);
      fuzz_write_seed(name, in, sizeof(in));
    }
  }
  in[1] = 4; /* more descriptors than asked */
  fuzz_write_seed("too-many-fds", in, sizeof(in));
  /* A run of 5 chunks: the table and 5 descriptors, or too few. */
  uint8_t req[USMIPC__REQUEST_LEN];
  usmipc__request_build(req, &w, 3, CLIENT);
  in[0] = 3 | 8;
  in[1] = 6;
  usmipc__reply_build(in + 2, req, 0, 6, KEY);
  fuzz_write_seed("chunks-ok", in, sizeof(in));
  in[1] = 2;
  usmipc__reply_build(in + 2, req, 0, 2, KEY);
  fuzz_write_seed("chunks-too-few", in, sizeof(in));
  fuzz_write_seed("short", in, 20);
  return 0;
}
#endif
