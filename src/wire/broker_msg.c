/* The broker protocol as pure functions: requests, replies, their MACs and
 * the sockets' names.
 *
 * Wire floor of the core: no I/O and no locks, so that the exporter's
 * broker (linux/broker.c), the importer (linux/fdtake.c) and the fuzz
 * targets (tests/fuzz/fuzz_request.c, fuzz_reply.c) run the same code.
 *
 * Threats: every request comes from a process of any uid that can reach the
 * socket, every answer from whatever listens on the name; each field is
 * checked here before either side acts on it, and the MACs bind each answer
 * to its request (tests/c test_trust.c, test_fdbatch.c). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>

#include "util/blake2s.h"
#include "wire/wire.h"

/* Request, little-endian:
 *   0 u32 magic, 4 u32 version, 8 u32 exporter pid, 12 u32 want,
 *   16 u64 exporter nonce, 24 u64 buffer id, 32 [16] client nonce,
 *   48 [16] proof = MAC(process key, "usmipc-request-2" || bytes[0, 48)),
 *   64 [16] capability = MAC(token, "usmipc-capabil-2" || bytes[0, 48)) with
 *           USMIPC__WANT_FD, else zero.
 * want = USMIPC__WANT_RELEASE, USMIPC__WANT_FDS and USMIPC__WANT_FORWARD
 * (each alone) are followed by u16 body length and the body. A
 * WANT_FORWARD request names the release (its id in the buffer id field)
 * as a WANT_RELEASE one does; its body is u64 ticket and the forwarder's
 * 16-byte nonce, its capability
 * usmipc__forward_capability, and its answer's word 8 the ticket minted. A
 * WANT_FDS request's buffer id and capability fields are zero; its body is u16
 * count (1 to 253), then count entries of u64 buffer id and [16] MAC(that
 * allocation's token, "usmipc-fdbatch-2" || bytes[0, 48) || u64 buffer id).
 * Reply:
 *   0 u32 magic, 4 u32 status, 8 u32 descriptors sent (a refused WANT_FDS
 *   entry: its index), 12 u32 want (echo), 16 [16] client nonce (echo),
 *   32 [16] MAC(process key, "usmipc-reply---2" || bytes[0, 32) || u64 buffer
 *           id), then the descriptors as SCM_RIGHTS: the table first, or a
 *           WANT_FDS request's in the order of its entries. */

#define REQUEST_MAGIC 0x32524655u /* "UFR2" */
#define REPLY_MAGIC 0x32504655u   /* "UFP2" */
#define PROTOCOL_VERSION 2u

static void mac_with_label(uint8_t out[16], const uint8_t key[16],
                           const char label[16], const uint8_t *data,
                           size_t len, uint64_t extra) {
  uint8_t msg[16 + 48 + 8];
  memcpy(msg, label, 16);
  memcpy(msg + 16, data, len);
  usmipc__put64le(msg + 16 + len, extra);
  usmipc__mac(out, key, msg, 16 + len + 8);
}

void usmipc__release_capability(const uint8_t *req, const uint8_t token[16],
                                const uint8_t *body, size_t len,
                                uint8_t out[16]) {
  uint8_t msg[16 + 48 + USMIPC__RELEASE_BODY_MAX];
  memcpy(msg, "usmipc-release-2", 16);
  memcpy(msg + 16, req, 48);
  memcpy(msg + 64, body, len);
  usmipc__mac(out, token, msg, 64 + len);
}

void usmipc__forward_capability(const uint8_t *req, const uint8_t token[16],
                                const uint8_t *body, size_t len,
                                uint8_t out[16]) {
  uint8_t msg[16 + 48 + USMIPC__FORWARD_BODY_LEN];
  if (len > USMIPC__FORWARD_BODY_LEN)
    len = USMIPC__FORWARD_BODY_LEN; /* the judge refuses it before */
  memcpy(msg, "usmipc-forward-2", 16);
  memcpy(msg + 16, req, 48);
  memcpy(msg + 64, body, len);
  usmipc__mac(out, token, msg, 64 + len);
}

void usmipc__forward_token(const uint8_t parent[16], uint64_t release_id,
                           uint64_t ticket, const uint8_t nonce[16],
                           uint8_t out[16]) {
  uint8_t msg[16 + 8 + 8 + 16];
  memcpy(msg, "usmipc-fwdtokn-2", 16);
  usmipc__put64le(msg + 16, release_id);
  usmipc__put64le(msg + 24, ticket);
  memcpy(msg + 32, nonce, 16);
  usmipc__mac(out, parent, msg, sizeof(msg));
}

static void request_proof(const uint8_t *req, const uint8_t key[16],
                          uint8_t out[16]) {
  mac_with_label(out, key, "usmipc-request-2", req, 48, 0);
}

static void request_capability(const uint8_t *req, const uint8_t token[16],
                               uint8_t out[16]) {
  mac_with_label(out, token, "usmipc-capabil-2", req, 48, 0);
}

static void reply_mac(const uint8_t *rep, const uint8_t key[16],
                      uint64_t buffer_id, uint8_t out[16]) {
  mac_with_label(out, key, "usmipc-reply---2", rep, 32, buffer_id);
}

void usmipc__fds_capability(const uint8_t *req, const uint8_t token[16],
                            uint64_t buffer_id, uint8_t out[16]) {
  mac_with_label(out, token, "usmipc-fdbatch-2", req, 48, buffer_id);
}

void usmipc__request_build(uint8_t req[USMIPC__REQUEST_LEN],
                           const usmipc__wire_t *w, unsigned want,
                           const uint8_t client_nonce[16]) {
  memset(req, 0, USMIPC__REQUEST_LEN);
  usmipc__put32le(req, REQUEST_MAGIC);
  usmipc__put32le(req + 4, PROTOCOL_VERSION);
  usmipc__put32le(req + 8, w->pid);
  usmipc__put32le(req + 12, want);
  usmipc__put64le(req + 16, w->nonce);
  usmipc__put64le(req + 24, w->buffer_id);
  memcpy(req + 32, client_nonce, 16);
  request_proof(req, w->key, req + 48);
  if (want & USMIPC__WANT_FD)
    request_capability(req, w->token, req + 64);
}

uint32_t usmipc__request_check(const uint8_t *req, size_t len, uint32_t pid,
                               uint64_t nonce, const uint8_t key[16],
                               uint32_t *want, uint64_t *buffer_id) {
  if (len != USMIPC__REQUEST_LEN || usmipc__get32le(req) != REQUEST_MAGIC ||
      usmipc__get32le(req + 4) != PROTOCOL_VERSION)
    return USMIPC__REPLY_BAD_REQUEST;
  uint8_t proof[16];
  request_proof(req, key, proof);
  *want = usmipc__get32le(req + 12);
  *buffer_id = usmipc__get64le(req + 24);
  if (usmipc__get32le(req + 8) != pid || usmipc__get64le(req + 16) != nonce ||
      !usmipc__ct_equal(proof, req + 48, 16) ||
      ((*want & ~(USMIPC__WANT_TABLE | USMIPC__WANT_FD)) != 0 &&
       *want != USMIPC__WANT_RELEASE && *want != USMIPC__WANT_FDS &&
       *want != USMIPC__WANT_FORWARD) ||
      *want == 0)
    return USMIPC__REPLY_BAD_PROOF;
  return USMIPC__REPLY_OK;
}

int usmipc__request_capability_ok(const uint8_t *req, const uint8_t token[16]) {
  uint8_t cap[16];
  request_capability(req, token, cap);
  return usmipc__ct_equal(cap, req + 64, 16);
}

/* A hostile peer of our uid may send any body: a count that disagrees with
 * the length, buffer ids it guessed, capabilities of other allocations or
 * of another request (each MAC covers this request's client nonce). Every
 * entry must name a published allocation and prove that allocation's
 * token, or nothing is served (fuzz_request.c; fdbatch_refusals). */
uint32_t usmipc__fds_request_judge(const uint8_t *req, const uint8_t *body,
                                   size_t len, usmipc__token_lookup_t lookup,
                                   void *ctx, size_t *count, size_t *failed) {
  *count = 0;
  *failed = SIZE_MAX;
  if (len < 2)
    return USMIPC__REPLY_BAD_REQUEST;
  size_t n = usmipc__get16le(body);
  if (n == 0 || n > USMIPC__FDS_PER_REQUEST ||
      len != 2 + n * USMIPC__FDS_ENTRY_LEN)
    return USMIPC__REPLY_BAD_REQUEST;
  for (size_t i = 0; i < n; i++) {
    const uint8_t *e = body + 2 + i * USMIPC__FDS_ENTRY_LEN;
    uint64_t buffer_id = usmipc__get64le(e);
    const uint8_t *token = lookup(ctx, buffer_id, i);
    uint8_t cap[16];
    if (token == NULL) {
      *failed = i;
      return USMIPC__REPLY_UNKNOWN_BUFFER;
    }
    usmipc__fds_capability(req, token, buffer_id, cap);
    if (!usmipc__ct_equal(cap, e + 8, 16)) {
      *failed = i;
      return USMIPC__REPLY_BAD_CAPABILITY;
    }
  }
  *count = n;
  return USMIPC__REPLY_OK;
}

void usmipc__reply_build(uint8_t rep[USMIPC__REPLY_LEN], const uint8_t *req,
                         uint32_t status, int nfds, const uint8_t key[16]) {
  memset(rep, 0, USMIPC__REPLY_LEN);
  usmipc__put32le(rep, REPLY_MAGIC);
  usmipc__put32le(rep + 4, status);
  usmipc__put32le(rep + 8, (uint32_t)nfds);
  usmipc__put32le(rep + 12, req ? usmipc__get32le(req + 12) : 0);
  if (req)
    memcpy(rep + 16, req + 32, 16);
  reply_mac(rep, key, req ? usmipc__get64le(req + 24) : 0, rep + 32);
}

socklen_t usmipc__broker_abstract_address(uint32_t pid, uint64_t nonce,
                                          struct sockaddr_un *addr) {
  memset(addr, 0, sizeof(*addr));
  addr->sun_family = AF_UNIX;
  /* sun_path[0] == '\0' makes the name abstract: no file to clean up, gone
   * when the process exits. Abstract names belong to a network namespace. */
  int n = snprintf(addr->sun_path + 1, sizeof(addr->sun_path) - 1,
                   "usmipc.%u.%016llx", pid, (unsigned long long)nonce);
  return (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + (size_t)n);
}

/* DIR/usmipc.<pid>.<nonce>.sock; 0 when the path does not fit. */
socklen_t usmipc__broker_dir_address(const char *dir, uint32_t pid,
                                     uint64_t nonce, struct sockaddr_un *addr) {
  memset(addr, 0, sizeof(*addr));
  addr->sun_family = AF_UNIX;
  int n = snprintf(addr->sun_path, sizeof(addr->sun_path),
                   "%s/usmipc.%u.%016llx.sock", dir, pid,
                   (unsigned long long)nonce);
  if (n < 0 || (size_t)n >= sizeof(addr->sun_path))
    return 0;
  return (socklen_t)(offsetof(struct sockaddr_un, sun_path) + (size_t)n + 1);
}

const char *usmipc__socket_dir_env(void) {
  const char *dir = getenv("USMIPC_SOCKET_DIR");
  return dir != NULL && *dir != '\0' ? dir : NULL;
}

static int reply_error(const usmipc__wire_t *w, uint32_t status) {
  switch (status) {
  case USMIPC__REPLY_UNKNOWN_BUFFER:
    return usmipc__fail(USMIPC_EEXPORTERGONE,
                        "process %u no longer exports the memory this handle "
                        "names (the allocation was freed)",
                        w->pid);
  case USMIPC__REPLY_BAD_CAPABILITY:
    return usmipc__fail(USMIPC_EACCES,
                        "process %u refused the handle: its capability token "
                        "is wrong (forged or corrupted handle)",
                        w->pid);
  case USMIPC__REPLY_OTHER_USER:
    return usmipc__fail(USMIPC_EACCES,
                        "process %u refused to share memory with this "
                        "process: IPC is allowed only between processes of "
                        "the same user (uid %u here)",
                        w->pid, (unsigned)usmipc__self()->uid);
  case USMIPC__REPLY_BAD_PROOF:
    return usmipc__fail(USMIPC_EUNTRUSTED,
                        "process %u does not recognise the handle's key: the "
                        "handle is forged or names another process",
                        w->pid);
  case USMIPC__REPLY_NO_TABLE:
    return usmipc__fail(USMIPC_EEXPORTERGONE,
                        "process %u exports nothing (it forked, and the "
                        "handle is its parent's?)",
                        w->pid);
  default:
    return usmipc__fail(USMIPC_ETRANSPORT,
                        "the broker of process %u answered status %u", w->pid,
                        status);
  }
}

/* 0 when rep (n bytes) is an answer of the exporter to req: framed, and
 * with its MAC over our client nonce. */
static int reply_authentic(const uint8_t *rep, size_t n, const uint8_t *req,
                           const usmipc__wire_t *w, const char *name) {
  uint8_t mac[16];
  if (n == 0)
    return usmipc__fail(USMIPC_EEXPORTERGONE,
                        "the broker of process %u closed the connection "
                        "without answering (it is exiting?)",
                        w->pid);
  if (n != USMIPC__REPLY_LEN || usmipc__get32le(rep) != REPLY_MAGIC)
    return usmipc__fail(USMIPC_EUNTRUSTED,
                        "malformed answer from %s: not a usmipc broker", name);
  if (usmipc__get32le(rep + 4) == USMIPC__REPLY_OTHER_USER)
    return reply_error(w,
                       USMIPC__REPLY_OTHER_USER); /* said before any request */
  reply_mac(rep, w->key, usmipc__get64le(req + 24), mac);
  if (memcmp(rep + 16, req + 32, 16) != 0 ||
      !usmipc__ct_equal(mac, rep + 32, 16))
    return usmipc__fail(USMIPC_EUNTRUSTED,
                        "the answer from %s does not prove the exporter's key: "
                        "it is not the exporter (or the handle is forged); "
                        "nothing it sent is used",
                        name);
  return 0;
}

/* MSG_CTRUNC with fewer descriptors than the answer carries: the receive
 * buffer holds SCM_MAX_FD, so the kernel could not install them all here
 * (recvmsg(2): out of file descriptors), and dropped the others. */
static int fail_truncated(const usmipc__wire_t *w, int nfds, size_t expect) {
  return usmipc__fail(USMIPC_EMFILE,
                      "this process received %d of the %zu descriptors "
                      "process %u sent (the kernel dropped the others: out "
                      "of file descriptors?); close some or raise the "
                      "limit (ulimit -n)",
                      nfds, expect, w->pid);
}

int usmipc__reply_check(const uint8_t *rep, size_t n, const uint8_t *req,
                        const usmipc__wire_t *w, unsigned want, int nfds,
                        bool truncated, const char *name) {
  /* A handle of a run of chunks gets one descriptor per chunk. */
  int expect = ((want & USMIPC__WANT_TABLE) ? 1 : 0) +
               ((want & USMIPC__WANT_FD) ? usmipc__wire_run_length(w) : 0);
  int rc = reply_authentic(rep, n, req, w, name);
  if (rc != 0)
    return rc;
  uint32_t status = usmipc__get32le(rep + 4);
  if (status != USMIPC__REPLY_OK && want == USMIPC__WANT_RELEASE) {
    if (status == USMIPC__REPLY_UNKNOWN_BUFFER)
      return usmipc__fail(USMIPC_EEXPORTERGONE,
                          "process %u no longer waits for this release (the "
                          "producer freed its handle or bundle)",
                          w->pid);
    if (status == USMIPC__REPLY_BAD_CAPABILITY)
      return usmipc__fail(USMIPC_EACCES,
                          "process %u refused the release ticket: its token "
                          "is wrong for its ticket number (forged, edited or "
                          "corrupted bytes: each handoff's bytes return only "
                          "their own ticket)",
                          w->pid);
    if (status == USMIPC__REPLY_BAD_REQUEST)
      return usmipc__fail(USMIPC_EBADHANDLE,
                          "process %u refused the release: its ticket was "
                          "never handed out (forged), or the consumer's "
                          "event handle is malformed",
                          w->pid);
  }
  if (status != USMIPC__REPLY_OK)
    return reply_error(w, status);
  if (truncated && nfds >= 0 && nfds < expect)
    return fail_truncated(w, nfds, (size_t)expect);
  if (nfds != expect || usmipc__get32le(rep + 8) != (uint32_t)expect ||
      truncated || usmipc__get32le(rep + 12) != want)
    return usmipc__fail(USMIPC_ETRANSPORT,
                        "the broker of process %u sent %d descriptors, not %d",
                        w->pid, nfds, expect);
  return 0;
}

/* What a listener that passed check_listener may still send wrongly (a bug,
 * or a process of our uid that holds the key): a refusal naming an entry
 * the request does not have, more or fewer descriptors than entries, an OK
 * to another request. Nothing from such an answer is used, and the caller
 * closes every descriptor that came with it (fuzz_reply.c). */
int usmipc__reply_check_fds(const uint8_t *rep, size_t n, const uint8_t *req,
                            const usmipc__wire_t *w, size_t count, int nfds,
                            bool truncated, const char *name, size_t *failed) {
  *failed = SIZE_MAX;
  int rc = reply_authentic(rep, n, req, w, name);
  if (rc != 0)
    return rc;
  uint32_t status = usmipc__get32le(rep + 4);
  uint32_t word8 = usmipc__get32le(rep + 8);
  if (status == USMIPC__REPLY_UNKNOWN_BUFFER ||
      status == USMIPC__REPLY_BAD_CAPABILITY) {
    if (word8 >= count)
      return usmipc__fail(USMIPC_ETRANSPORT,
                          "the broker of process %u refused entry %u of a "
                          "request of %zu (status %u)",
                          w->pid, word8, count, status);
    *failed = word8;
  }
  if (status != USMIPC__REPLY_OK)
    return reply_error(w, status);
  if (truncated && nfds >= 0 && (size_t)nfds < count)
    return fail_truncated(w, nfds, count);
  if (nfds < 0 || (size_t)nfds != count || word8 != count || truncated ||
      usmipc__get32le(rep + 12) != USMIPC__WANT_FDS)
    return usmipc__fail(USMIPC_ETRANSPORT,
                        "the broker of process %u sent %d descriptors%s, not "
                        "%zu",
                        w->pid, nfds, truncated ? " (truncated)" : "", count);
  return 0;
}

/* The producer's answer to a forward: a refusal in words the forwarder can
 * act on, or the ticket minted (never 0; fuzz_reply.c). */
int usmipc__reply_check_forward(const uint8_t *rep, size_t n,
                                const uint8_t *req, const usmipc__wire_t *w,
                                int nfds, const char *name, uint64_t *ticket) {
  *ticket = 0;
  int rc = reply_authentic(rep, n, req, w, name);
  if (rc != 0)
    return rc;
  uint32_t status = usmipc__get32le(rep + 4);
  switch (status) {
  case USMIPC__REPLY_OK:
    break;
  case USMIPC__REPLY_UNKNOWN_BUFFER:
    return usmipc__fail(USMIPC_EEXPORTERGONE,
                        "process %u no longer waits for releases of this "
                        "handoff (the producer freed its handle or bundle): "
                        "there is nothing left to hand on",
                        w->pid);
  case USMIPC__REPLY_BAD_CAPABILITY:
    return usmipc__fail(USMIPC_EACCES,
                        "process %u refused to hand the handoff on: the "
                        "release ticket's token is wrong for its number "
                        "(forged, edited or corrupted bytes)",
                        w->pid);
  case USMIPC__REPLY_BAD_REQUEST:
    return usmipc__fail(USMIPC_EBADHANDLE,
                        "process %u refused to hand the handoff on: its "
                        "ticket was never handed out (forged bytes)",
                        w->pid);
  case USMIPC__REPLY_RELEASED:
    return usmipc__fail(USMIPC_EINVAL,
                        "process %u already has this handoff's release "
                        "ticket back from this process (or from all its "
                        "consumers), so its memory may be reused: hand it "
                        "on before releasing what was opened from it",
                        w->pid);
  case USMIPC__REPLY_TOO_MANY:
    return usmipc__fail(USMIPC_EBUSY,
                        "process %u holds %u forwarded tickets of this "
                        "handoff that have not come back: release some "
                        "before handing it on again",
                        w->pid, USMIPC__FORWARDS_MAX);
  default:
    return reply_error(w, status);
  }
  uint32_t minted = usmipc__get32le(rep + 8);
  if (nfds != 0 || minted == 0 ||
      usmipc__get32le(rep + 12) != USMIPC__WANT_FORWARD)
    return usmipc__fail(USMIPC_ETRANSPORT,
                        "the broker of process %u answered a forward with "
                        "%d descriptors and ticket %u",
                        w->pid, nfds, minted);
  *ticket = minted;
  return 0;
}

int usmipc__release_body_parse(const uint8_t *body, size_t len,
                               uint64_t *ticket, const uint8_t **event,
                               size_t *event_len) {
  if (len < 10 || len > USMIPC__RELEASE_BODY_MAX)
    return -1;
  *ticket = usmipc__get64le(body);
  *event_len = usmipc__get16le(body + 8);
  *event = *event_len ? body + 10 : NULL;
  return *ticket != 0 && *event_len == len - 10 ? 0 : -1;
}

int usmipc__release_body_check(const uint8_t *body, size_t len,
                               uint64_t *ticket, const uint8_t **event,
                               size_t *event_len, usmipc__wire_t *w) {
  if (usmipc__release_body_parse(body, len, ticket, event, event_len) != 0)
    return -1;
  /* The consumer's event handle is checked when the producer opens it (its
   * identity is proven then); here only that it is one. */
  if (*event != NULL &&
      (usmipc__wire_decode(*event, *event_len, w) != 0 || !w->is_event))
    return -1;
  return 0;
}
