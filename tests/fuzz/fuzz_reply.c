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
 * received (low 3 bits), then the answer's bytes.
 *
 * Each input is also the answer to a WANT_FDS request of 1 + byte 1 % 253
 * entries, with as many descriptors received as byte 0's bits 4-5 say
 * (exactly, one fewer, one more, or byte 1's low bits): usmipc__reply_check_fds
 * may accept only the exporter's OK carrying exactly that many, and may
 * name a refused entry only from an authentic refusal, within the request.
 * (Handles of a run of chunks are never batched: the batch's answers are
 * judged for single descriptors only.) Each input is also the answer to a
 * forward (usmipc__reply_check_forward), with no descriptor or one. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "util/blake2s.h"
#include "objects.h"

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
  int expect = ((want & 1) ? 1 : 0) + ((want & 2) ? (chunks ? chunks : 1) : 0);
  if (rc != 0) {
    FUZZ_CHECK(rc == USMIPC_EEXPORTERGONE || rc == USMIPC_EUNTRUSTED ||
                   rc == USMIPC_EACCES || rc == USMIPC_ETRANSPORT ||
                   rc == USMIPC_EMFILE,
               "code %d", rc);
    /* Out of descriptors only when the kernel said it dropped some. */
    FUZZ_CHECK(rc != USMIPC_EMFILE || (truncated && nfds < expect),
               "EMFILE for %d of %d descriptors", nfds, expect);
    FUZZ_CHECK(usmipc_last_error()[0] != '\0', "no message");
    return;
  }
  /* Accepted: an authentic OK with exactly what was asked. */
  FUZZ_CHECK(n == USMIPC__REPLY_LEN && le32(rep + 4) == 0, "not ok");
  FUZZ_CHECK(nfds == expect && !truncated, "descriptors %d of %d", nfds,
             expect);
  uint8_t good[USMIPC__REPLY_LEN];
  usmipc__reply_build(good, req, 0, expect, KEY);
  FUZZ_CHECK(memcmp(good, rep, USMIPC__REPLY_LEN) == 0,
             "accepted an answer the exporter did not write");
}

/* The answer rep (n bytes) with the exporter's echo and MAC for a request
 * of buffer id field id. */
static void sign(uint8_t fixed[USMIPC__REPLY_LEN], const uint8_t *rep, size_t n,
                 uint64_t id) {
  memset(fixed, 0, USMIPC__REPLY_LEN);
  memcpy(fixed, rep, n < USMIPC__REPLY_LEN ? n : USMIPC__REPLY_LEN);
  memcpy(fixed + 16, CLIENT, 16);
  uint8_t msg[16 + 32 + 8];
  memcpy(msg, "usmipc-reply---2", 16);
  memcpy(msg + 16, fixed, 32);
  for (int i = 0; i < 8; i++)
    msg[48 + i] = (uint8_t)(id >> (8 * i));
  usmipc__mac(fixed + 32, KEY, msg, sizeof(msg));
}

static void check_fds(const uint8_t *rep, size_t n, size_t count, int nfds,
                      bool truncated) {
  usmipc__wire_t w;
  memset(&w, 0, sizeof(w));
  w.pid = 4242;
  w.nonce = 0x1122334455667788ull;
  memcpy(w.key, KEY, 16);
  uint8_t req[USMIPC__REQUEST_LEN];
  usmipc__request_build(req, &w, USMIPC__WANT_FDS, CLIENT);
  size_t failed = 12345;
  int rc = usmipc__reply_check_fds(rep, n, req, &w, count, nfds, truncated,
                                   "fuzz", &failed);
  if (rc != 0) {
    FUZZ_CHECK(rc == USMIPC_EEXPORTERGONE || rc == USMIPC_EUNTRUSTED ||
                   rc == USMIPC_EACCES || rc == USMIPC_ETRANSPORT ||
                   rc == USMIPC_EMFILE,
               "code %d", rc);
    FUZZ_CHECK(rc != USMIPC_EMFILE ||
                   (truncated && nfds >= 0 && (size_t)nfds < count),
               "EMFILE for %d of %zu descriptors", nfds, count);
    FUZZ_CHECK(usmipc_last_error()[0] != '\0', "no message");
    if (failed != SIZE_MAX) {
      /* Named only by an authentic refusal (the exporter's MAC over our
       * nonce) of an entry of the request. */
      uint32_t status = n >= 12 ? le32(rep + 4) : 0;
      uint8_t signed_by_exporter[USMIPC__REPLY_LEN];
      sign(signed_by_exporter, rep, n, 0);
      FUZZ_CHECK(failed < count && (status == 1 || status == 2) &&
                     n == USMIPC__REPLY_LEN && le32(rep + 8) == failed &&
                     memcmp(signed_by_exporter, rep, USMIPC__REPLY_LEN) == 0,
                 "named entry %zu of %zu", failed, count);
    }
    return;
  }
  FUZZ_CHECK(failed == SIZE_MAX, "accepted and named an entry");
  FUZZ_CHECK(n == USMIPC__REPLY_LEN && le32(rep + 4) == 0, "not ok");
  FUZZ_CHECK(nfds >= 0 && (size_t)nfds == count && !truncated,
             "descriptors %d of %zu", nfds, count);
  uint8_t good[USMIPC__REPLY_LEN];
  usmipc__reply_build(good, req, 0, (int)count, KEY);
  FUZZ_CHECK(memcmp(good, rep, USMIPC__REPLY_LEN) == 0,
             "accepted an answer the exporter did not write");
}

/* The answer to a forward (WANT_FORWARD, release id 55 in the buffer id
 * field): accepted only as the exporter's OK with no descriptor and a
 * ticket, which is then the answer's word 8. */
static void check_forward(const uint8_t *rep, size_t n, int nfds) {
  usmipc__wire_t w;
  memset(&w, 0, sizeof(w));
  w.pid = 4242;
  w.nonce = 0x1122334455667788ull;
  w.buffer_id = 55;
  memcpy(w.key, KEY, 16);
  uint8_t req[USMIPC__REQUEST_LEN];
  usmipc__request_build(req, &w, USMIPC__WANT_FORWARD, CLIENT);
  uint64_t ticket = 12345;
  int rc = usmipc__reply_check_forward(rep, n, req, &w, nfds, "fuzz", &ticket);
  if (rc != 0) {
    FUZZ_CHECK(ticket == 0, "refused with ticket %llu",
               (unsigned long long)ticket);
    FUZZ_CHECK(rc == USMIPC_EEXPORTERGONE || rc == USMIPC_EUNTRUSTED ||
                   rc == USMIPC_EACCES || rc == USMIPC_ETRANSPORT ||
                   rc == USMIPC_EBADHANDLE || rc == USMIPC_EINVAL ||
                   rc == USMIPC_EBUSY,
               "code %d", rc);
    FUZZ_CHECK(usmipc_last_error()[0] != '\0', "no message");
    return;
  }
  FUZZ_CHECK(n == USMIPC__REPLY_LEN && le32(rep + 4) == 0 && nfds == 0,
             "not ok");
  FUZZ_CHECK(ticket != 0 && ticket == le32(rep + 8), "ticket %llu",
             (unsigned long long)ticket);
  uint8_t good[USMIPC__REPLY_LEN];
  usmipc__reply_build(good, req, 0, (int)ticket, KEY);
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
  size_t count = 1 + data[1] % USMIPC__FDS_PER_REQUEST;
  unsigned how = (data[0] >> 4) & 3;
  int batch_nfds = how == 0   ? (int)count
                   : how == 1 ? (int)count - 1
                   : how == 2 ? (int)count + 1
                              : nfds;
  check_fds(rep, n, count, batch_nfds, truncated);
  check_forward(rep, n, nfds & 1);
  if (n >= 32) {
    /* The same answer with a valid MAC and echo, as the exporter signs
     * (a WANT_FDS request's buffer id field is zero). */
    uint8_t fixed[USMIPC__REPLY_LEN];
    sign(fixed, rep, n, 77);
    check_one(fixed, sizeof(fixed), want, nfds, truncated, chunks);
    sign(fixed, rep, n, 0);
    check_fds(fixed, sizeof(fixed), count, batch_nfds, truncated);
    sign(fixed, rep, n, 55);
    check_forward(fixed, sizeof(fixed), nfds & 1);
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
  in[0] = 3 | 8 | 4; /* 6 sent, 3 installed: the kernel dropped the rest */
  in[1] = 3;
  usmipc__reply_build(in + 2, req, 0, 6, KEY);
  fuzz_write_seed("chunks-truncated", in, sizeof(in));
  in[0] = 3 | 8;
  in[1] = 2;
  usmipc__reply_build(in + 2, req, 0, 2, KEY);
  fuzz_write_seed("short", in, 20);
  /* Answers to a WANT_FDS request of 1 + byte 1 entries: served, refused
   * at entry 2 (unknown, bad capability), an entry out of range. */
  usmipc__wire_t batch = w;
  batch.buffer_id = 0;
  uint8_t batch_req[USMIPC__REQUEST_LEN];
  usmipc__request_build(batch_req, &batch, USMIPC__WANT_FDS, CLIENT);
  static const struct {
    const char *name;
    uint32_t status, word8;
    uint8_t byte1;
  } fds_seeds[] = {{"fds-ok-10", 0, 10, 9},
                   {"fds-ok-253", 0, 253, 252},
                   {"fds-unknown-entry-2", 1, 2, 9},
                   {"fds-bad-capability-entry-2", 2, 2, 9},
                   {"fds-entry-out-of-range", 1, 10, 9}};
  for (size_t i = 0; i < sizeof(fds_seeds) / sizeof(fds_seeds[0]); i++) {
    in[0] = 0;
    in[1] = fds_seeds[i].byte1;
    usmipc__reply_build(in + 2, batch_req, fds_seeds[i].status,
                        (int)fds_seeds[i].word8, KEY);
    fuzz_write_seed(fds_seeds[i].name, in, sizeof(in));
  }
  return 0;
}
#endif
