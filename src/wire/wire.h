/* The wire floor's private header: the byte formats, written and read
 * field by field as untrusted input; no I/O, no locks.
 *
 * Floor 2 of the core (src/wire/): the handle format v2 and the handle
 * object (handle.c), the bundle format (bundle_wire.c), the broker
 * protocol (broker_msg.c), SYCL/UMF blobs (umf_blob.c). Each has its fuzz
 * target in tests/fuzz/. */
#ifndef USMIPC_WIRE_H
#define USMIPC_WIRE_H

#include <sys/socket.h>

#include "util/util.h"

/* ---- sizes the formats share with the backends --------------------------- */

/* The backend-specific part of a wire handle (docs/handle-format.md). */
#define USMIPC__PAYLOAD_MAX 512
#define USMIPC__PAYLOAD_EXT_MAX 32
typedef struct usmipc__payload {
  uint8_t handle_kind; /* backend-specific sub-kind */
  uint16_t len;
  uint8_t bytes[USMIPC__PAYLOAD_MAX];
  /* The backend's own extension records (docs/handle-format.md: u16 type in
   * its range, u16 length, bytes), at most 32 bytes: written by ipc_export,
   * found again by ipc_import (the core copies them in and out of the
   * handle's extension area). */
  uint16_t ext_len;
  uint8_t ext[USMIPC__PAYLOAD_EXT_MAX];
} usmipc__payload_t;

#define USMIPC__EVENT_PAYLOAD_MAX 128
/* A run of physical chunks of another library's memory, mapped back to back
 * (CUDA VMM: PyTorch's expandable segments map 2 MiB or 20 MiB chunks into
 * one reserved range). At most USMIPC__CHUNKS_MAX chunks, so that their
 * descriptors fit one SCM_RIGHTS message (the kernel's SCM_MAX_FD is 253)
 * with the export table's. */
#define USMIPC__CHUNKS_MAX 250

/* ---- the handle format (handle.c) ---------------------------------------- */

#define USMIPC__WIRE_VERSION 2
#define USMIPC__WIRE_FIXED_LEN 212 /* bytes before the payload */
#define USMIPC__WIRE_EXT_MAX 1024  /* bytes of extension records at most */
#define USMIPC__NO_SLOT                                                        \
  UINT32_MAX /* the allocation has no export-table slot                        \
              */
/* flags */
#define USMIPC__WIRE_FLAG_FD                                                   \
  0x1u /* an fd must be fetched from the exporter                              \
        */
#define USMIPC__WIRE_FLAG_REOPENABLE                                           \
  0x2u /* that fd is a memfd, which /proc/<pid>/fd can reopen */
#define USMIPC__WIRE_FLAG_SOCKET_DIR                                           \
  0x4u /* the exporter also listens in USMIPC_SOCKET_DIR */
#define USMIPC__WIRE_FLAGS_KNOWN 0x7u
/* Extension records: type bit 15 marks a record an importer must
 * understand (critical); others it may skip. */
#define USMIPC__EXT_CRITICAL 0x8000u
/* Events (docs/handle-format.md, "Event handles and ordering"). */
#define USMIPC__HANDLE_KIND_EVENT 128 /* an event handle, of any backend */
#define USMIPC__EXT_EVENT 0x8001u     /* in event handles: the record */
#define USMIPC__EXT_ORDER 0x8002u     /* in memory handles: the event */
#define USMIPC__EXT_RELEASE 0x8003u   /* in memory handles: a release ticket */
#define USMIPC__RELEASE_RECORD_LEN 32
#define USMIPC__EXT_BLOCK 0x8101u /* in memory handles: a pool block */
#define USMIPC__BLOCK_RECORD_LEN 48
/* The buffer id of a pool segment has this bit set, and no other buffer id
 * has (usmipc__new_buffer_id stays below it). The exporter's table states
 * the id, so an edited handle cannot clear the bit and still open: a handle
 * of a pool segment is opened only with a block record (usmipc_ipc_open;
 * bundles, whose own slot is their capability, map segments whole). */
#define USMIPC__POOL_SEGMENT_ID ((uint64_t)1 << 63)
/* A driver's buffer id (any 64-bit value) as usmipc names it: clear of
 * USMIPC__POOL_SEGMENT_ID, which a foreign allocation must never carry (its
 * handles would be refused as bare pool segments), and 0 only when the
 * driver gave 0. */
static inline uint64_t usmipc__foreign_buffer_id(uint64_t raw) {
  uint64_t id = raw & ~USMIPC__POOL_SEGMENT_ID;
  return id != 0 || raw == 0 ? id : 1;
}
/* In memory handles: the allocation is a run of physical chunks (another
 * library's CUDA VMM memory), each shared as its own descriptor. u16 chunk
 * count, u16 run count, u32 0, then per run of equal chunks u64 chunk size,
 * u32 chunks in the run, u32 0. */
#define USMIPC__EXT_CHUNKS 0x8102u
#define USMIPC__CHUNKS_FIXED_LEN 8
#define USMIPC__CHUNK_RUN_LEN 16
/* Runs of equal chunk sizes one record may hold: with an ordering and a
 * release record the extension area still has room (8 + 48 * 16 bytes). */
#define USMIPC__CHUNK_RUNS_MAX 48
#define USMIPC__CHUNKS_RECORD_MAX                                              \
  (4 + USMIPC__CHUNKS_FIXED_LEN +                                              \
   USMIPC__CHUNK_RUNS_MAX * USMIPC__CHUNK_RUN_LEN)
#define USMIPC__EVENT_RECORD_LEN 16
#define USMIPC__ORDER_FIXED_LEN 68
/* Event flags (both records). */
#define USMIPC__EVENT_FLAG_RING                                                \
  0x1u /* re-recorded only after its previous record completed */
#define USMIPC__EVENT_FLAG_HOST                                                \
  0x2u /* no device event: a record is complete when it is made */
#define USMIPC__EVENT_FLAGS_KNOWN 0x3u
typedef struct usmipc__wire {
  usmipc_backend_t backend;
  uint16_t flags;
  uint32_t writer_version; /* USMIPC_VERSION_HEX of the exporter's library */
  uint32_t uid;            /* the exporter's effective uid */
  uint32_t pid;            /* in the exporter's PID namespace */
  uint32_t fd_number;
  uint8_t device_uuid[16];
  uint8_t boot_id[16];
  uint64_t nonce;
  uint64_t start_time;
  uint64_t pidfd_ino;
  uint64_t pid_ns, net_ns, user_ns;
  uint64_t buffer_id;
  uint64_t exporter_base;
  uint64_t allocation_size;
  uint64_t offset;
  uint64_t nbytes;
  uint64_t fd_dev;
  uint64_t fd_ino;
  uint8_t key[16];          /* the exporter's process key (identity proofs) */
  uint8_t token[16];        /* the allocation's capability at the broker */
  uint32_t export_slot;     /* slot in the exporter's export table */
  uint32_t table_fd_number; /* the table's descriptor in the exporter */
  usmipc__payload_t payload;
  uint16_t ext_len; /* extension records, as on the wire */
  uint8_t ext[USMIPC__WIRE_EXT_MAX];
  /* Events, from records 0x8001 / 0x8002 (checked by the decoder). */
  bool is_event;        /* handle kind 128 */
  uint64_t event_point; /* the record named (event handles and orders) */
  uint32_t event_flags;
  uint8_t event_kind; /* the backend's event sub-kind (event handles) */
  uint16_t order_at;  /* offset in ext of the 0x8002 record's body, */
  uint16_t order_len; /* and its length; 0 when not ordered */
  /* Record 0x8003: the producer asks for a release signal. */
  bool has_release;
  uint64_t release_id, release_ticket;
  uint8_t release_token[16];
  /* Record 0x8101: the handle names a block of a pool segment. */
  bool has_block;
  uint64_t block_id, block_offset, block_size;
  uint32_t block_slot;
  uint8_t block_token[16];
  /* Record 0x8102: the allocation is chunk_count chunks back to back, in
   * chunk_runs runs of equal sizes; 0 when it is one piece. */
  uint16_t chunk_count, chunk_runs;
  uint16_t chunks_at; /* offset in ext of the record's first run */
} usmipc__wire_t;
/* The chunk sizes of w's record 0x8102, in order, into sizes (room for
 * USMIPC__CHUNKS_MAX); returns their number (0 without the record). */
uint32_t usmipc__wire_chunk_sizes(const usmipc__wire_t *w, uint64_t *sizes);
/* Writes record 0x8102 for count chunks of the given sizes into out (room
 * for USMIPC__CHUNKS_RECORD_MAX bytes): its length, or 0 when the sizes
 * take more than USMIPC__CHUNK_RUNS_MAX runs. */
size_t usmipc__chunks_record(const uint64_t *sizes, uint32_t count,
                             uint8_t *out);
/* Clears w and fills in who exports it: this process on device (every
 * handle of memory or events starts so). */
void usmipc__wire_identity(usmipc__wire_t *w, usmipc_backend_t backend,
                           const uint8_t device_uuid[16]);
/* The wire of the event an ordered memory handle carries (identity from
 * the memory handle, the rest from its 0x8002 record). */
void usmipc__wire_order_event(const usmipc__wire_t *mem, usmipc__wire_t *ev);
/* Writes record 0x8002 naming event ev (an event wire) at its point into
 * out, which holds at least 4 + USMIPC__ORDER_FIXED_LEN +
 * USMIPC__EVENT_PAYLOAD_MAX bytes; returns the record's length. */
size_t usmipc__order_record(const usmipc__wire_t *ev, uint8_t *out);
/* Replaces the 0x8002 record of encoded handle bytes buf (len bytes, of
 * which base_len are the handle without one) by record (rec_len bytes, or
 * none): fixes the lengths and the checksum. Returns the new length. */
size_t usmipc__wire_reorder(uint8_t *out, const uint8_t *base, size_t base_len,
                            const uint8_t *rec, size_t rec_len);
/* Encoded length of w (fixed part, payload, extension records, checksum). */
size_t usmipc__wire_len(const usmipc__wire_t *w);
/* Encoded length for a payload of payload_len bytes and no extension. */
size_t usmipc__wire_size(size_t payload_len);
/* Writes exactly usmipc__wire_len(w) bytes to out. */
void usmipc__wire_encode(const usmipc__wire_t *w, uint8_t *out);
/* Decodes untrusted bytes; every failure is EBADHANDLE or EHANDLEVERSION
 * with a message naming the defect. */
int usmipc__wire_decode(const void *data, size_t len, usmipc__wire_t *w);
/* What bytes this library just encoded export: the allocation (its buffer
 * id, exporter base and size) and the range in it. No checks: for handles
 * of our own making only, where a full decode would be wasted. */
typedef struct usmipc__wire_extent {
  uint64_t buffer_id, base, allocation_size, offset, nbytes;
} usmipc__wire_extent_t;
void usmipc__wire_extent(const uint8_t *encoded, usmipc__wire_extent_t *out);
/* The extension record of type type in w: its bytes and length, or NULL. */
/* The same in a bare area of records (a payload's ext). */
const uint8_t *usmipc__ext_find(const uint8_t *ext, size_t ext_len,
                                uint16_t type, uint16_t *len);
/* Sets w's payload and appends the backend's records to w's extension area. */
int usmipc__wire_set_payload(usmipc__wire_t *w,
                             const usmipc__payload_t *payload);
const uint8_t *usmipc__wire_ext_find(const usmipc__wire_t *w, uint16_t type,
                                     uint16_t *len);
uint32_t usmipc__crc32c(uint32_t crc, const void *data, size_t len);
/* Whether the exporter of w is in this process's PID namespace, where its
 * pid names it (unknown namespaces count as the same). */
bool usmipc__same_pid_namespace(const usmipc__wire_t *w);

/* ---- the handle object (handle.c) ---------------------------------------- */

/* ---- the handle object (wire/handle.c) ---------------------------------- */
typedef struct usmipc__release usmipc__release_t;
/* A handle's bytes are data[0, len). An ordered handle's bytes are its base
 * bytes (kept at base, base_len) with an ordering record (and a release
 * ticket) appended, redone at every usmipc_ipc_handle_order; data has room
 * for the largest. */
#define USMIPC__ORDER_RECORD_MAX                                               \
  (4 + USMIPC__ORDER_FIXED_LEN + USMIPC__EVENT_PAYLOAD_MAX + 4 +               \
   USMIPC__RELEASE_RECORD_LEN)
struct usmipc_ipc_handle {
  uint64_t foreign_id; /* the foreign export this handle holds, or 0 */
  usmipc_backend_t backend;
  bool is_event;
  usmipc__release_t *release; /* tickets handed out, or NULL */
  size_t len, base_len;
  uint8_t *base;
  usmipc_ipc_handle_info_t info; /* of the base bytes */
  uint8_t data[];
};
/* A handle holding the encoding of w, with room to reorder it. */
int usmipc__handle_from_wire(const usmipc__wire_t *w,
                             usmipc_ipc_handle_t **handle);
/* A copy of a handle as usmipc__handle_from_wire made it (its bytes not
 * reordered since), holding no ticket and no foreign export. */
int usmipc__handle_copy(const usmipc_ipc_handle_t *h,
                        usmipc_ipc_handle_t **out);

/* The largest standalone event handle (kind 128): a ring event's, which a
 * release request's body carries. */
#define USMIPC__EVENT_HANDLE_MAX                                               \
  (USMIPC__WIRE_FIXED_LEN + USMIPC__EVENT_PAYLOAD_MAX + 4 +                    \
   USMIPC__EVENT_RECORD_LEN + 4)

/* ---- the bundle byte format (wire/bundle_wire.c) -------------------------
 * docs/handle-format.md ("Bundles"). The producer (bundle.c) writes these
 * fields; the decoder checks all of them, since the bytes are untrusted. */
#define USMIPC__BUNDLE_MAGIC "\x89USMIPCB" /* 8 bytes, no NUL on the wire */
#define USMIPC__BUNDLE_VERSION 1
enum {
  USMIPC__BUNDLE_OFF_VERSION = 8,
  USMIPC__BUNDLE_OFF_FLAGS = 10,
  USMIPC__BUNDLE_OFF_LENGTH = 12,
  USMIPC__BUNDLE_OFF_ID = 16,
  USMIPC__BUNDLE_OFF_SLOT = 24,
  USMIPC__BUNDLE_OFF_RESERVED = 28,
  USMIPC__BUNDLE_OFF_TOKEN = 32,
  USMIPC__BUNDLE_OFF_NSEG = 48,
  USMIPC__BUNDLE_OFF_NARR = 52,
  USMIPC__BUNDLE_OFF_NNODE = 56,
  USMIPC__BUNDLE_OFF_TAIL_LEN = 60, /* the handoff records after the tree */
  USMIPC__BUNDLE_HDR_LEN = 64,
  USMIPC__BUNDLE_ARRAY_FIXED = 24,
  USMIPC__BUNDLE_NODE_FIXED = 8,
};
#define USMIPC__BUNDLE_MAX_LEN ((size_t)64 << 20)
#define USMIPC__BUNDLE_MAX_SEGMENTS 65536u
#define USMIPC__BUNDLE_MAX_ARRAYS (1u << 20)
#define USMIPC__BUNDLE_MAX_NODES (1u << 21)
#define USMIPC__BUNDLE_MAX_DEPTH 64
#define USMIPC__BUNDLE_NO_SEGMENT UINT32_MAX
#define USMIPC__BUNDLE_NO_SLOT UINT32_MAX
#define USMIPC__BUNDLE_MAX_DIM ((int64_t)1 << 62)
/* Room for the handoff records at the end of the bytes: an ordering record
 * and a release ticket. */
#define USMIPC__BUNDLE_TAIL_MAX                                                \
  (4 + USMIPC__ORDER_FIXED_LEN + USMIPC__EVENT_PAYLOAD_MAX + 4 +               \
   USMIPC__RELEASE_RECORD_LEN)
/* The tree's shape, checked node by node in preorder (both sides). */
typedef struct usmipc__tree_check {
  struct {
    usmipc_bundle_node_kind_t kind;
    uint32_t left;
  } stack[USMIPC__BUNDLE_MAX_DEPTH];
  int depth;
  bool rooted;
} usmipc__tree_check_t;
/* Admits the next node: where it may stand, whether it needs a key; a
 * failure's message starts with what. */
int usmipc__tree_push(usmipc__tree_check_t *t, usmipc_bundle_node_kind_t kind,
                      uint32_t count, bool has_key, size_t key_len,
                      const char *what);
bool usmipc__tree_complete(const usmipc__tree_check_t *t);
/* The size of one element of a DLPack dtype, 0 when usmipc does not take
 * it. */
size_t usmipc__bundle_itemsize(uint8_t code, uint8_t bits, uint16_t lanes);
/* The bytes an array spans from its first element, 0 if it has none, or
 * SIZE_MAX when the shape or strides are out of range. */
size_t usmipc__bundle_extent(const usmipc_array_desc_t *d, size_t itemsize);
/* Strict UTF-8: no overlongs, no surrogates, nothing past U+10FFFF. */
bool usmipc__utf8_valid(const uint8_t *s, size_t n);
/* What decoding bundle bytes gives (the open fills in the pointers). */
struct usmipc_opened_bundle {
  uint64_t id;
  uint32_t slot;
  uint8_t token[16];
  size_t nseg, narr, nnode;
  /* The allocations' handles: decoded and checked by usmipc__bundle_decode(),
   * which keeps of each only where its bytes are and its size (12 bytes an
   * allocation, not a 1.9 KB wire); decoded again, all of them, by an open. */
  usmipc__wire_t seg0; /* allocation 0's, which names the exporter */
  uint32_t *seg_at;    /* offset in bytes of each allocation's handle */
  uint64_t *seg_nbytes;
  usmipc__wire_t *segs; /* by usmipc_bundle_open only, while it maps */
  uint32_t *array_seg;
  uint64_t *array_off;
  usmipc_bundle_array_t *arrays;
  int64_t *dims;
  usmipc_bundle_node_t *nodes;
  usmipc__wire_t *handoff;     /* allocation 0's handle with the tail's
                                  records (decoded), or NULL without them */
  usmipc__wire_t *order_event; /* the event to wait for (decoded), or NULL */
  uint8_t *bytes;              /* a copy: the keys point into it */
  bool borrowed;               /* bytes are the caller's (no copy) */
  size_t len;
  usmipc_device_t *device; /* where the arrays are mapped */
  /* Where the arrays and the nodes are in bytes: the part that stays the
   * same from one handoff of a kept bundle to the next (update.c). */
  size_t meta_at, meta_len;
  /* An open made from a template (usmipc__bundle_from_template): seg_at,
   * seg_nbytes, segs, array_seg, array_off, dims, nodes and the keys the
   * nodes point to are the template's, shared and never written; arrays,
   * bytes and the records are the open's own. NULL otherwise. */
  usmipc_opened_bundle_t *tmpl;
  unsigned tmpl_refs; /* of a template: its holders (atomic) */
};
/* Checks everything about the bytes and describes them (pointers unset).
 * Without keep, the description borrows data (no copy). */
int usmipc__bundle_decode(const void *data, size_t len, bool keep,
                          usmipc_opened_bundle_t **out);
/* Every allocation's wire into ob->segs, for the open (nothing to do when
 * ob shares a template's). */
int usmipc__bundle_decode_segments(usmipc_opened_bundle_t *ob);
/* Templates: an engine opens the same tree every step, and decoding it
 * again (every allocation's handle twice, every key checked) was half of a
 * warm open. usmipc__bundle_from_template makes an open of data from
 * template t without decoding the tree: 1 when data is another handoff of
 * t's tree (the same bytes up to the records after the tree, a good
 * checksum, and records that decode), with *out sharing t's decoded parts
 * (a reference on t); 0 when it is not; a negative code for malformed
 * records. */
int usmipc__bundle_from_template(usmipc_opened_bundle_t *t, const void *data,
                                 size_t len, usmipc_opened_bundle_t **out);
/* ob, just decoded with its allocations' handles (usmipc__bundle_decode with
 * keep, usmipc__bundle_decode_segments), becomes an open of a new template
 * that takes its decoded parts: *t holds two references (the caller's and
 * ob's). 0, or USMIPC_ENOMEM (USMIPC_EINVAL for a decode without keep)
 * with ob unchanged. */
int usmipc__bundle_adopt_template(usmipc_opened_bundle_t *ob,
                                  usmipc_opened_bundle_t **t);
void usmipc__bundle_template_get(usmipc_opened_bundle_t *t);
void usmipc__bundle_template_put(usmipc_opened_bundle_t *t);
void usmipc__opened_bundle_free(usmipc_opened_bundle_t *ob);
/* Decodes and checks bundle bytes (bundle_wire.c); the fuzzer's entry point.
 * *kept (if not NULL) receives the description, freed by
 * usmipc_bundle_release. */
int usmipc__bundle_decode_check(const void *data, size_t len, size_t *arrays,
                                size_t *allocations,
                                usmipc_opened_bundle_t **kept);
/* Whether data is another handoff of the bundle ob was decoded from (with
 * keep): every byte before the records after the tree the same (header,
 * allocations, arrays, nodes). 1 with the new records decoded and checked
 * into *handoff and *order_event (malloc'd, NULL when absent), 0 when not
 * the same, or an error code for malformed records. The checksum is not
 * recomputed: it would vouch for the bytes already checked in ob, and the
 * records are checked as the decoder checks them. */
int usmipc__bundle_same_tree(const usmipc_opened_bundle_t *ob, const void *data,
                             size_t len, usmipc__wire_t **handoff,
                             usmipc__wire_t **order_event);
/* Whether data starts as bundle bytes do (bundle_wire.c). */
bool usmipc__bundle_magic(const void *data, size_t len);
/* For usmipc_ipc_release and usmipc_ipc_forward (fn, named in the message)
 * of bundle bytes (bundle_wire.c), decoded in full: *w
 * becomes allocation 0's handle with the records that follow the tree,
 * which name the producer and carry the ticket. *no_memory: the bundle
 * names no allocation, so it has no ticket and needs none. USMIPC_EINVAL
 * when the producer asked for no release. */
int usmipc__bundle_ticket(const void *data, size_t len, const char *fn,
                          struct usmipc__wire *w, bool *no_memory);

/* ---- the export table's layout (linux/exports.c writes and maps it) -----
 * Which allocations a process still exports, shared read-only with
 * importers (linux/exports.c's comment has the protocol). */
#define USMIPC__TABLE_MAGIC "USMIPCT2"
#define USMIPC__TABLE_SLOTS (1u << 20)
#define USMIPC__TABLE_HEADER_BYTES 4096u
#define USMIPC__TABLE_BYTES                                                    \
  ((size_t)USMIPC__TABLE_HEADER_BYTES +                                        \
   (size_t)USMIPC__TABLE_SLOTS * sizeof(usmipc__export_slot_t))
/* Header fields: little-endian, but for the liveness offset and word (atomic
 * words in the host's order; exporter and importer share a host). */
enum {
  USMIPC__HDR_MAGIC = 0,
  USMIPC__HDR_VERSION = 8,
  USMIPC__HDR_PID = 12,
  USMIPC__HDR_UID = 16,
  USMIPC__HDR_NONCE = 24,
  USMIPC__HDR_START_TIME = 32,
  USMIPC__HDR_BOOT_ID = 40,
  USMIPC__HDR_SLOTS = 56,
  USMIPC__HDR_TAG = 64, /* MAC of bytes [0, 64) keyed by the process key */
  USMIPC__HDR_ALIVE_OFFSET = 80, /* where the liveness futex word is */
  USMIPC__HDR_MUTEX = 128,
  USMIPC__HDR_MUTEX_BYTES = 64,
};
typedef struct usmipc__export_slot {
  uint32_t seq;
  uint32_t fd_number;
  uint64_t buffer_id; /* 0: free */
  uint64_t size;      /* the allocation's size, which a handle must state */
  uint64_t tag;       /* usmipc__slot_tag of the export's token: which
                         export of the allocation (a revoked one, whose
                         slot was reused, does not match) */
} usmipc__export_slot_t;
_Static_assert(sizeof(usmipc__export_slot_t) == 32, "slots are 32 bytes");
/* Its low two bits are the slot's kind: memory (an allocation, a bundle, a
 * pool block: usmipc__slot_tag) or an event (usmipc__event_slot_tag). */
#define USMIPC__SLOT_KIND_MASK 3u
#define USMIPC__SLOT_KIND_MEMORY 1u
#define USMIPC__SLOT_KIND_EVENT 2u

/* ---- the broker protocol (broker_msg.c) ---------------------------------- */

/* A broker reply's status (wire/broker_msg.c). */
enum usmipc__reply_status {
  USMIPC__REPLY_OK = 0,
  USMIPC__REPLY_UNKNOWN_BUFFER = 1, /* never published, or withdrawn (freed) */
  USMIPC__REPLY_BAD_CAPABILITY = 2,
  USMIPC__REPLY_OTHER_USER = 3,
  USMIPC__REPLY_BAD_REQUEST = 4,
  USMIPC__REPLY_BAD_PROOF =
      5, /* the request's MAC fails: not a handle of ours */
  USMIPC__REPLY_NO_TABLE = 6,
  /* WANT_FORWARD: the ticket named came back already (from the asking
   * process, or from all of a fan-out's): too late to hand it on. */
  USMIPC__REPLY_RELEASED = 7,
  /* WANT_FORWARD: the producer holds USMIPC__FORWARDS_MAX forwarded
   * tickets of that handoff not yet returned. */
  USMIPC__REPLY_TOO_MANY = 8,
};
/* The most descriptors one SCM_RIGHTS message carries: SCM_MAX_FD
 * (unix(7)). A WANT_FDS answer carries up to USMIPC__FDS_PER_REQUEST, an
 * answer to a run of chunks the table and USMIPC__CHUNKS_MAX: both fit,
 * and buffers of this size, on either side, hold whichever is larger. */
#define USMIPC__FDS_PER_MESSAGE_MAX 253
/* The descriptors of one handle: one, or one per chunk of a run (record
 * 0x8102). */
static inline int usmipc__wire_run_length(const usmipc__wire_t *w) {
  return w->chunk_count != 0 ? (int)w->chunk_count : 1;
}
#define USMIPC__WANT_TABLE 0x1u
#define USMIPC__WANT_FD 0x2u
#define USMIPC__WANT_RELEASE 0x4u /* alone: a release signal, with a body */
#define USMIPC__WANT_FDS 0x8u     /* alone: many descriptors, with a body */
/* Alone, with a body of u64 ticket and the forwarder's 16-byte random
 * nonce: one more consumer for a handoff's release ticket (release.c,
 * "Forwarding"); the answer's word 8 is the ticket minted for it. */
#define USMIPC__WANT_FORWARD 0x10u
#define USMIPC__FORWARD_BODY_LEN 24u
/* Forwarded tickets of one handoff registry not yet returned. */
#define USMIPC__FORWARDS_MAX 65536u
/* A WANT_FDS request names at most this many allocations: one SCM_RIGHTS
 * message carries at most SCM_MAX_FD (253) descriptors (unix(7)). */
#define USMIPC__FDS_PER_REQUEST 253u
#define USMIPC__FDS_ENTRY_LEN 24u /* u64 buffer id, 16-byte capability */
#define USMIPC__FDS_BODY_MAX                                                   \
  (2u + USMIPC__FDS_PER_REQUEST * USMIPC__FDS_ENTRY_LEN)
_Static_assert(USMIPC__FDS_PER_REQUEST <= USMIPC__FDS_PER_MESSAGE_MAX &&
                   1 + USMIPC__CHUNKS_MAX <= USMIPC__FDS_PER_MESSAGE_MAX,
               "every answer fits one SCM_RIGHTS message");
#define USMIPC__FDS_MESSAGE_MAX (USMIPC__REQUEST_LEN + 2 + USMIPC__FDS_BODY_MAX)
/* An entry's capability in a WANT_FDS request:
 * MAC(token, "usmipc-fdbatch-2" || req[0,48) || u64 buffer id). */
void usmipc__fds_capability(const uint8_t *req, const uint8_t token[16],
                            uint64_t buffer_id, uint8_t out[16]);
/* The broker's judgement of a WANT_FDS body (len bytes after the request
 * header req and its u16 length): 0 (ok) with *count entries, each naming a
 * buffer id that lookup knows (it returns that export's token, or NULL) with
 * the capability of that token; else the reply status, and for a refused
 * entry (status 1 unknown buffer, 2 bad capability) its index in *failed
 * (SIZE_MAX otherwise). lookup is also told the entry's index. */
typedef const uint8_t *(*usmipc__token_lookup_t)(void *ctx, uint64_t buffer_id,
                                                 size_t index);
uint32_t usmipc__fds_request_judge(const uint8_t *req, const uint8_t *body,
                                   size_t len, usmipc__token_lookup_t lookup,
                                   void *ctx, size_t *count, size_t *failed);
/* The release request's capability: MAC(token, label || req[0,48) || body). */
void usmipc__release_capability(const uint8_t *req, const uint8_t token[16],
                                const uint8_t *body, size_t len,
                                uint8_t out[16]);
/* The broker protocol as pure functions, for the broker, the importer and
 * the fuzz targets (tests/fuzz/fuzz_request.c, fuzz_reply.c). */
#define USMIPC__REQUEST_LEN 80
#define USMIPC__REPLY_LEN 48
void usmipc__request_build(uint8_t req[USMIPC__REQUEST_LEN],
                           const usmipc__wire_t *w, unsigned want,
                           const uint8_t client_nonce[16]);
/* The broker's judgement of a request for the process (pid, nonce, key):
 * 0 (ok) with *want and *buffer_id, or the reply status that refuses it. */
uint32_t usmipc__request_check(const uint8_t *req, size_t len, uint32_t pid,
                               uint64_t nonce, const uint8_t key[16],
                               uint32_t *want, uint64_t *buffer_id);
int usmipc__request_capability_ok(const uint8_t *req, const uint8_t token[16]);
/* nfds: the descriptors sent with it, or for a refused WANT_FDS entry its
 * index. */
void usmipc__reply_build(uint8_t rep[USMIPC__REPLY_LEN], const uint8_t *req,
                         uint32_t status, int nfds, const uint8_t key[16]);
/* The importer's judgement of an answer of n bytes to req that came with
 * nfds descriptors: 0 only for an authentic OK with what was asked (for a
 * run of chunks, exactly w->chunk_count descriptors after the table);
 * truncated (MSG_CTRUNC) with fewer is USMIPC_EMFILE. */
int usmipc__reply_check(const uint8_t *rep, size_t n, const uint8_t *req,
                        const usmipc__wire_t *w, unsigned want, int nfds,
                        bool truncated, const char *name);
/* The same for the answer to a WANT_FDS request of count entries: 0 only
 * for an authentic OK carrying count descriptors; for a refusal that names
 * an entry, its index in *failed (else SIZE_MAX). */
int usmipc__reply_check_fds(const uint8_t *rep, size_t n, const uint8_t *req,
                            const usmipc__wire_t *w, size_t count, int nfds,
                            bool truncated, const char *name, size_t *failed);
/* A release request's body: u64 ticket, u16 length, an event handle of that
 * length (or none). 0 when well formed, with the parts (wire/broker_msg.c). */
int usmipc__release_body_parse(const uint8_t *body, size_t len,
                               uint64_t *ticket, const uint8_t **event,
                               size_t *event_len);
/* The same, and the event handle (if any) decoded into *w: 0 when it is
 * one (its identity is proven only when the producer opens it). */
int usmipc__release_body_check(const uint8_t *body, size_t len,
                               uint64_t *ticket, const uint8_t **event,
                               size_t *event_len, usmipc__wire_t *w);
#define USMIPC__RELEASE_BODY_MAX (10 + USMIPC__EVENT_HANDLE_MAX)
/* A forward request's capability: MAC(token of the ticket it names,
 * "usmipc-forward-2" || req[0,48) || body). */
void usmipc__forward_capability(const uint8_t *req, const uint8_t token[16],
                                const uint8_t *body, size_t len,
                                uint8_t out[16]);
/* The token of ticket `ticket` minted by a forward of a ticket whose token
 * is parent: MAC(parent, "usmipc-fwdtokn-2" || u64 release id || u64
 * ticket || the forwarder's nonce). The forwarder computes it from what it
 * holds and its nonce, which only its request carried (so another holder
 * of the parent's bytes, a fan-out's sibling, cannot); the producer keeps
 * it to check the ticket's return. */
void usmipc__forward_token(const uint8_t parent[16], uint64_t release_id,
                           uint64_t ticket, const uint8_t nonce[16],
                           uint8_t out[16]);
/* The importer's judgement of the answer to a WANT_FORWARD request: 0 only
 * for an authentic OK with no descriptor and a minted ticket (word 8, not
 * 0) in *ticket. */
int usmipc__reply_check_forward(const uint8_t *rep, size_t n,
                                const uint8_t *req, const usmipc__wire_t *w,
                                int nfds, const char *name, uint64_t *ticket);
/* The broker's socket names: the abstract one, and the file DIR/usmipc.
 * <pid>.<nonce>.sock (0 when the path does not fit); USMIPC_SOCKET_DIR or
 * NULL. */
struct sockaddr_un;
socklen_t usmipc__broker_abstract_address(uint32_t pid, uint64_t nonce,
                                          struct sockaddr_un *addr);
socklen_t usmipc__broker_dir_address(const char *dir, uint32_t pid,
                                     uint64_t nonce, struct sockaddr_un *addr);
const char *usmipc__socket_dir_env(void);

/* ---- SYCL/UMF IPC blobs (umf_blob.c) ------------------------------------- */

/* ---- SYCL/UMF IPC blobs (umf_blob.c) ---------------------------------- */
typedef struct usmipc__umf_blob {
  uint32_t form; /* 108 or 120: its length */
  uint32_t pid;  /* the exporter's, in its PID namespace */
  uint64_t handle_id, base, base_size, offset;
  uint64_t provider_size; /* the 120-byte form's, else 0 */
  uint8_t ze_handle[64];  /* the exporter's driver handle */
  uint32_t fd_number;     /* the dma-buf's number in the exporter */
  uint64_t pool_offset;   /* the driver's, from the handle */
  bool opaque;            /* IpcOpaqueMemoryData (the exporter's pid at 16) */
  uint8_t memory_type;    /* 0: device */
} usmipc__umf_blob_t;
/* Parses a blob: 0, or USMIPC_EBADHANDLE / USMIPC_EMEMKIND with a message. */
int usmipc__umf_blob_parse(const void *data, size_t len,
                           usmipc__umf_blob_t *out);

#endif /* USMIPC_WIRE_H */
