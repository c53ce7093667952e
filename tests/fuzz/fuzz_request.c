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
 * Bytes after the first 82 are also a release's body and a WANT_FDS body
 * (u16 count, entries of u64 buffer id and 16-byte capability). The batch
 * judge runs against a broker that publishes buffer ids 1 to 16, each with
 * its own token: it may serve only a body whose count matches its length
 * and every one of whose entries names a published buffer with that
 * buffer's capability, and a refusal must name the first entry that is
 * wrong. Each body also runs with the capabilities of its known entries
 * recomputed, to reach the accepting path.
 *
 * Build and run like fuzz_handle (tests/fuzz/CMakeLists.txt). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "util/blake2s.h"
#include "objects.h"

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
  FUZZ_CHECK((want >= 1 && want <= 3) || want == USMIPC__WANT_RELEASE ||
                 want == USMIPC__WANT_FDS || want == USMIPC__WANT_FORWARD,
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

/* ---- WANT_FDS bodies ---- */
#define PUBLISHED 16 /* buffer ids 1 to 16 are published */

static void token_of(uint64_t buffer_id, uint8_t out[16]) {
  memcpy(out, TOKEN, 16);
  out[0] ^= (uint8_t)buffer_id;
}

typedef struct lookup_state {
  uint8_t tokens[USMIPC__FDS_PER_REQUEST][16];
  size_t calls, next_index;
  int in_order;
} lookup_state_t;

/* The broker's grant table: published ids only; entries looked up once
 * each, in order. */
static const uint8_t *lookup(void *ctx, uint64_t buffer_id, size_t index) {
  lookup_state_t *st = ctx;
  FUZZ_CHECK(index < USMIPC__FDS_PER_REQUEST, "index %zu", index);
  st->in_order &= index == st->next_index;
  st->next_index = index + 1;
  st->calls++;
  if (buffer_id == 0 || buffer_id > PUBLISHED)
    return NULL;
  token_of(buffer_id, st->tokens[index]);
  return st->tokens[index];
}

/* Whether entry e of a body is one the broker must serve. */
static int entry_good(const uint8_t *req, const uint8_t *e) {
  uint64_t id = usmipc__get64le(e);
  if (id == 0 || id > PUBLISHED)
    return 0;
  uint8_t token[16], cap[16];
  token_of(id, token);
  usmipc__fds_capability(req, token, id, cap);
  return memcmp(cap, e + 8, 16) == 0;
}

static void judge_fds(const uint8_t *req, const uint8_t *body, size_t len) {
  lookup_state_t st = {.in_order = 1};
  size_t count = 12345, failed = 12345;
  uint32_t status =
      usmipc__fds_request_judge(req, body, len, lookup, &st, &count, &failed);
  FUZZ_CHECK(status == 0 || status == 1 || status == 2 || status == 4,
             "status %u", status);
  FUZZ_CHECK(st.in_order, "entries looked up out of order");
  size_t n = len >= 2 ? usmipc__get16le(body) : 0;
  int well_formed = len >= 2 && n >= 1 && n <= USMIPC__FDS_PER_REQUEST &&
                    len == 2 + n * USMIPC__FDS_ENTRY_LEN;
  if (status == 4) {
    FUZZ_CHECK(!well_formed && failed == SIZE_MAX && count == 0 &&
                   st.calls == 0,
               "refused a well-formed body");
    return;
  }
  FUZZ_CHECK(well_formed, "judged a malformed body (status %u)", status);
  /* Every entry before the one refused (all of them, when served) is
   * good; the one refused is not. */
  size_t good = status == 0 ? n : failed;
  FUZZ_CHECK(good <= n, "failed %zu of %zu", failed, n);
  for (size_t i = 0; i < good; i++)
    FUZZ_CHECK(entry_good(req, body + 2 + i * USMIPC__FDS_ENTRY_LEN),
               "served entry %zu, which is not good", i);
  if (status == 0) {
    FUZZ_CHECK(count == n && failed == SIZE_MAX && st.calls == n, "count");
    return;
  }
  const uint8_t *e = body + 2 + failed * USMIPC__FDS_ENTRY_LEN;
  uint64_t id = usmipc__get64le(e);
  int known = id != 0 && id <= PUBLISHED;
  FUZZ_CHECK(count == 0 && st.calls == failed + 1, "refusal");
  FUZZ_CHECK(status == 1 ? !known : known && !entry_good(req, e),
             "status %u for entry %zu", status, failed);
}

static void check_fds(const uint8_t *data, size_t size) {
  if (size < USMIPC__REQUEST_LEN + 2)
    return;
  const uint8_t *body = data + USMIPC__REQUEST_LEN + 2;
  size_t len = size - USMIPC__REQUEST_LEN - 2;
  if (len > USMIPC__FDS_BODY_MAX)
    len = USMIPC__FDS_BODY_MAX;
  judge_fds(data, body, len);
  /* The same body made well formed, with ids folded onto 0 to 19 and the
   * capabilities of known entries recomputed (the fuzzer's bytes 0-3 pick
   * entries to leave as they are): most inputs reach the accepting path.
   * At most 16 entries: the path is the same for 253, and each entry costs
   * three MACs (about 4x fewer executions per second at 253). */
  static uint8_t fixed[2 + 16 * USMIPC__FDS_ENTRY_LEN];
  size_t n = len < 2 ? 0 : (len - 2) / USMIPC__FDS_ENTRY_LEN;
  if (n == 0)
    return;
  if (n > 16)
    n = 16;
  size_t fixed_len = 2 + n * USMIPC__FDS_ENTRY_LEN;
  memcpy(fixed, body, fixed_len);
  usmipc__put16le(fixed, (uint16_t)n);
  uint32_t keep = usmipc__get32le(data);
  for (size_t i = 0; i < n; i++) {
    uint8_t *e = fixed + 2 + i * USMIPC__FDS_ENTRY_LEN;
    uint64_t id = usmipc__get64le(e) % 20;
    usmipc__put64le(e, id);
    if (id != 0 && id <= PUBLISHED && !(i < 32 && (keep >> i) & 1)) {
      uint8_t token[16];
      token_of(id, token);
      usmipc__fds_capability(data, token, id, e + 8);
    }
  }
  judge_fds(data, fixed, fixed_len);
}

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
  uint32_t status = usmipc__release_arrived(data, body, len, 0);
  FUZZ_CHECK(status == 1 || status == 4, "release status %u", status);
  /* The same bytes as a forward: no registry has the id (the one below
   * has a random one), or the body is not one ticket. */
  uint32_t word = 7;
  status = usmipc__release_forward_arrived(data, body, len, 0, &word);
  FUZZ_CHECK((status == 1 || status == 4) && word == 0,
             "forward status %u, ticket %u", status, word);
}

/* Each ticket is its own capability (issue 21 #3): against a registry of
 * this process with tickets 1 to 3 handed out, a release naming ticket n
 * (from the input; 4 was never handed out) whose capability is the MAC
 * under ticket k's token (from the input), or raw input bytes, is filed
 * only when k == n: a holder of one ticket's bytes returns no other. */
static usmipc__release_t *registry;
static uint8_t ticket_records[3][4 + USMIPC__RELEASE_RECORD_LEN];

static void check_ticket_capability(const uint8_t *data, size_t size) {
  if (size < 2)
    return;
  if (registry == NULL)
    for (int i = 0; i < 3; i++) {
      size_t len = 0;
      FUZZ_CHECK(usmipc__release_ticket(&registry, ticket_records[i], &len, 1) ==
                     0,
                 "making the ticket registry: %s", usmipc_last_error());
    }
  const uint8_t *rec = ticket_records[0];
  unsigned n = 1 + data[0] % 4, k = 1 + data[1] % 3;
  bool raw = (data[0] & 0x80) != 0 && size >= 2 + 16;
  usmipc__wire_t w;
  memset(&w, 0, sizeof(w));
  w.pid = PID;
  w.nonce = NONCE;
  w.buffer_id = usmipc__get64le(rec + 4); /* the release id */
  memcpy(w.key, KEY, 16);
  static const uint8_t client[16] = {7};
  uint8_t req[USMIPC__REQUEST_LEN], body[10] = {0};
  usmipc__request_build(req, &w, USMIPC__WANT_RELEASE, client);
  usmipc__put64le(body, n);
  if (raw)
    memcpy(req + 64, data + 2, 16);
  else
    usmipc__release_capability(req, ticket_records[k - 1] + 20, body, 10,
                               req + 64);
  uint32_t status = usmipc__release_arrived(req, body, 10, 0);
  if (n == 4)
    FUZZ_CHECK(status == 4, "ticket never handed out: status %u", status);
  else if (!raw)
    FUZZ_CHECK(status == (k == n ? 0u : 2u),
               "ticket %u with ticket %u's token: status %u", n, k, status);
  else
    FUZZ_CHECK(status == 0 || status == 2, "raw capability: status %u", status);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  check_one(data, size);
  check_release(data, size);
  check_ticket_capability(data, size);
  check_fds(data, size);
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
  /* check_ticket_capability: ticket 2 with ticket 1's token, and with its
   * own; ticket 4 (never handed out). */
  static const uint8_t other[2] = {1, 0}, own[2] = {1, 1}, never[2] = {3, 0};
  fuzz_write_seed("ticket-2-token-of-1", other, sizeof(other));
  fuzz_write_seed("ticket-2-own-token", own, sizeof(own));
  fuzz_write_seed("ticket-never-handed-out", never, sizeof(never));
  /* WANT_FDS: request, length, count, entries. */
  static uint8_t fds[USMIPC__REQUEST_LEN + 2 + USMIPC__FDS_BODY_MAX];
  for (int form = 0; form < 6; form++) {
    static const char *const names[] = {
        "fds-valid-3",        "fds-bad-capability", "fds-unknown-buffer",
        "fds-count-mismatch", "fds-valid-253",      "fds-count-0"};
    size_t n = form == 4 ? USMIPC__FDS_PER_REQUEST : form == 5 ? 0 : 3;
    usmipc__wire_t batch = w;
    batch.buffer_id = 0;
    usmipc__request_build(fds, &batch, USMIPC__WANT_FDS, client);
    uint8_t *body = fds + USMIPC__REQUEST_LEN + 2;
    size_t body_len = 2 + n * USMIPC__FDS_ENTRY_LEN;
    usmipc__put16le(fds + USMIPC__REQUEST_LEN, (uint16_t)body_len);
    usmipc__put16le(body, (uint16_t)(form == 3 ? n + 1 : n));
    for (size_t i = 0; i < n; i++) {
      uint8_t *e = body + 2 + i * USMIPC__FDS_ENTRY_LEN, token[16];
      uint64_t id = 1 + i % PUBLISHED;
      if (form == 2 && i == 1)
        id = PUBLISHED + 5;
      token_of(id, token);
      usmipc__put64le(e, id);
      usmipc__fds_capability(fds, token, id, e + 8);
      if (form == 1 && i == 2)
        e[8] ^= 1;
    }
    fuzz_write_seed(names[form], fds, USMIPC__REQUEST_LEN + 2 + body_len);
  }
  return 0;
}
#endif
