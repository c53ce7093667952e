/* Private helpers shared by every .c file of the core (usmipc__ prefix). */
#ifndef USMIPC_COMMON_H
#define USMIPC_COMMON_H

#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "backend/backend.h"
#include "usmipc.h"

#define USMIPC__ARRAY_SIZE(a) (sizeof(a) / sizeof((a)[0]))

#if defined(__GNUC__)
#define USMIPC__PRINTF(f, a) __attribute__((format(printf, f, a)))
#define USMIPC__LIKELY(x) __builtin_expect(!!(x), 1)
#define USMIPC__UNLIKELY(x) __builtin_expect(!!(x), 0)
#else
#define USMIPC__PRINTF(f, a)
#define USMIPC__LIKELY(x) (x)
#define USMIPC__UNLIKELY(x) (x)
#endif

/* ---- little-endian fields -------------------------------------------------
 * Everything usmipc puts in bytes another process reads (handles, broker
 * messages, the export table's header) is written and read field by field,
 * never as a C struct. */
static inline void usmipc__put16le(uint8_t *p, uint16_t v) {
  p[0] = (uint8_t)v;
  p[1] = (uint8_t)(v >> 8);
}
static inline void usmipc__put32le(uint8_t *p, uint32_t v) {
  for (int i = 0; i < 4; i++)
    p[i] = (uint8_t)(v >> (8 * i));
}
static inline void usmipc__put64le(uint8_t *p, uint64_t v) {
  for (int i = 0; i < 8; i++)
    p[i] = (uint8_t)(v >> (8 * i));
}
static inline uint16_t usmipc__get16le(const uint8_t *p) {
  return (uint16_t)(p[0] | p[1] << 8);
}
static inline uint32_t usmipc__get32le(const uint8_t *p) {
  return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 |
         (uint32_t)p[3] << 24;
}
static inline uint64_t usmipc__get64le(const uint8_t *p) {
  return (uint64_t)usmipc__get32le(p) | (uint64_t)usmipc__get32le(p + 4) << 32;
}

/* ---- error.c ------------------------------------------------------------- */

/* Records a message for usmipc_last_error() on this thread and returns code,
 * so that failures read `return usmipc__fail(USMIPC_EINVAL, "...");`. */
int usmipc__fail(int code, const char *fmt, ...) USMIPC__PRINTF(2, 3);
/* The same, keeping the driver's own error code (usmipc_last_native_error). */
int usmipc__fail_native(int code, long native, const char *fmt, ...)
    USMIPC__PRINTF(3, 4);
/* Prefixes the current thread's message with context ("opening handle: "). */
void usmipc__error_prefix(const char *fmt, ...) USMIPC__PRINTF(1, 2);

/* ---- process identity (process.c) ----------------------------------------
 * Who this process is, as recorded in exported handles. The nonce is random
 * per process instance (redrawn in a fork child), so (pid, nonce) never names
 * two processes even when pids are reused. */
typedef struct usmipc__process {
  uint32_t pid;
  uint32_t uid; /* effective uid: what SO_PEERCRED and file owners show */
  uint64_t nonce;
  uint8_t boot_id[16]; /* /proc/sys/kernel/random/boot_id; zero if unreadable */
  /* Proof of identity. key is a secret every handle of this process
   * carries: its export table is tagged with it, and its broker answers
   * with a MAC keyed by it, so a process that holds no handle of ours cannot
   * pass for us (not after pid reuse, not on our socket's name). */
  uint8_t key[16];
  uint64_t start_time; /* /proc/self/stat field 22, clock ticks after boot */
  uint64_t pidfd_ino;  /* inode of a pidfd of this process (pidfs, Linux
                          6.9): unique to the process on this boot; 0 when
                          the kernel has no pidfs */
  uint64_t pid_ns, net_ns, user_ns; /* inodes of /proc/self/ns/{pid,net,user} */
} usmipc__process_t;

const usmipc__process_t *usmipc__self(void);
/* The same without the proof fields (key, start time, pidfd inode,
 * namespaces), which cost a dozen system calls the first time: for paths
 * that need only pid, uid, nonce and boot id. */
const usmipc__process_t *usmipc__self_basic(void);
/* The inode of /proc/<pid or "self">/ns/<name>, 0 when unreadable. */
uint64_t usmipc__ns_inode(const char *pid, const char *name);
struct usmipc__wire;
/* Whether the exporter of w is in this process's PID namespace, where its
 * pid names it (unknown namespaces count as the same). */
bool usmipc__same_pid_namespace(const struct usmipc__wire *w);
/* Field 22 of /proc/<pid>/stat (start time in clock ticks), 0 on failure. */
uint64_t usmipc__start_time(const char *pid);
/* st_ino of a pidfd (pidfs), 0 when the kernel has no pidfs. */
uint64_t usmipc__pidfd_inode(int pidfd);
/* The effective uid of the process pidfd refers to (pid, in this PID
 * namespace), read so that a reused pid cannot answer for it: 0, -ESRCH
 * when that process is gone, or another negative errno. */
int usmipc__pidfd_euid(int pidfd, uint32_t pid, uint32_t *euid);
/* A usmipc code for an errno value, so that no raw -errno escapes: EMFILE
 * and ENFILE become USMIPC_EMFILE, ENOMEM USMIPC_ENOMEM, EACCES and EPERM
 * USMIPC_EACCES, the rest USMIPC_EIO (the errno stays the native code). */
int usmipc__errno_code(int e);

/* fork() handlers of each module, run by process.c in lock order: the
 * registry lock is taken first, then the device probe's (a foreign pointer
 * query probes under the registry lock), then the export table's, then the
 * fd transport's (the order in which export nests them). */
void usmipc__bundles_fork_prepare(void);
void usmipc__bundles_fork_parent(void);
void usmipc__bundles_fork_child(void);
void usmipc__devices_fork_prepare(void);
void usmipc__devices_fork_parent(void);
void usmipc__devices_fork_child(void);
void usmipc__registry_fork_prepare(void);
void usmipc__registry_fork_parent(void);
void usmipc__registry_fork_child(void);
void usmipc__pools_fork_prepare(void);
void usmipc__pools_fork_parent(void);
void usmipc__pools_fork_child(void);
void usmipc__torch_fork_prepare(void);
void usmipc__torch_fork_parent(void);
void usmipc__torch_fork_child(void);
void usmipc__exports_fork_prepare(void);
void usmipc__exports_fork_parent(void);
void usmipc__exports_fork_child(void);
void usmipc__fdxfer_fork_prepare(void);
void usmipc__fdxfer_fork_parent(void);
void usmipc__fdxfer_fork_child(void);
int usmipc__random(void *buf, size_t len);

/* A backend's ipc_import: the allocation is mapped by another thread of
 * this process right now (positive: never one of the public codes). */
#define USMIPC__IMPORT_BUSY 1

/* ---- waiting with one deadline (linux/wait.c) ---------------------------- */

uint64_t usmipc__now_ns(void); /* CLOCK_MONOTONIC */
unsigned usmipc__ipc_timeout_ms(void);
/* now + the IPC timeout: the one deadline of an open. */
uint64_t usmipc__deadline_after_timeout(void);
/* Polls fd for events until deadline_ns; 0 when ready, else ETIMEDOUT or
 * EINTR (the interrupt handler said stop) with a message naming what was
 * awaited. */
int usmipc__wait_fd(int fd, short events, uint64_t deadline_ns,
                    const char *waiting_for);
/* Whether the binding's interrupt handler says to abandon a wait. */
int usmipc__interrupted(void);

/* ---- devices (device.c) -------------------------------------------------- */

struct usmipc_device {
  const usmipc__backend_ops_t *ops;
  void *native; /* from the backend's probe */
  usmipc_device_type_t type;
  int index;   /* among devices of the same backend and type */
  int ordinal; /* probe order within the backend */
  int has_ipc;
  uint8_t uuid[16];
  char name[128];  /* empty until ops->device_name fills it, if lazy */
  int name_ready;  /* read with acquire */
  char filter[48]; /* "host:cpu:0" */
};

struct usmipc_queue {
  usmipc_device_t *device;
  void *native;
  bool wrapped; /* usmipc_queue_from_native: the native queue is not ours */
};

int usmipc__devices_init(void);
usmipc_device_t *usmipc__device_by_ordinal(usmipc_backend_t backend,
                                           int ordinal);
usmipc_device_t *usmipc__device_by_uuid(usmipc_backend_t backend,
                                        const uint8_t uuid[16]);
void usmipc__uuid_format(const uint8_t uuid[16], char out[37]);

/* ---- the region registry (memory.c) ---------------------------------------
 * Every allocation usmipc made and every IPC mapping it opened is a region:
 * an address range with its device, kind and identity. One mutex guards the
 * registry and the import cache; it is never held across a driver call that
 * can block on another process. */
typedef enum usmipc__origin {
  USMIPC__LOCAL = 1,         /* usmipc_malloc in this process */
  USMIPC__IMPORTED = 2,      /* usmipc_ipc_open of another process's handle */
  USMIPC__FOREIGN_ALIAS = 3, /* this process's own export of memory another
                                library allocated, opened here as an alias */
  USMIPC__IMPORTED_SYCL = 4, /* usmipc_ipc_open_sycl: unmapped at its last
                                close, never cached */
} usmipc__origin_t;

typedef struct usmipc__import_key {
  uint64_t nonce;
  uint64_t buffer_id;
  uint32_t pid;
  usmipc_device_t *device; /* where it is mapped: one mapping per device */
} usmipc__import_key_t;

typedef struct usmipc__region {
  usmipc__allocation_t alloc;
  usmipc_device_t *device;
  usmipc__origin_t origin;
  uint64_t buffer_id; /* LOCAL: drawn at allocation; IMPORTED: the exporter's */

  /* LOCAL and FOREIGN_ALIAS */
  uint64_t alias_refs;        /* same-process opens not yet closed (64
                                  bits: a bundle takes one per array) */
  bool user_freed;            /* usmipc_free called while aliases were open */
  bool exported;              /* payload and fd grant below are valid */
  usmipc__payload_t *payload; /* allocated at the first export: imports never
                                 need one */
  uint8_t token[16];  /* LOCAL: capability importers present to the broker;
                         IMPORTED: the token of the handle first opened,
                         which later opens of the same allocation match */
  uint32_t fd_number; /* the published descriptor, for pidfd_getfd */
  uint64_t fd_dev, fd_ino;
  uint32_t export_slot; /* this allocation's slot in the export table */
  uint32_t table_fd_number;
  bool fd_reopenable;
  void *pool_segment; /* LOCAL: the pool segment this allocation is, or NULL */

  /* IMPORTED */
  usmipc__import_key_t key;
  struct usmipc__peer *peer; /* the exporter's proof and table; NULL for
                                memory of another library (no slot) */
  uint8_t process_key[16];   /* the exporter's key, as the handle said */
  uint64_t slot_tag;         /* usmipc__slot_tag(process_key, token) */
  uint64_t open_refs;        /* usmipc_ipc_open calls not yet closed, and a
                                bundle's one per array: 64 bits, since 4,096
                                opens of 2^20 arrays wrapped 32 */
  struct usmipc__region *idle_prev, *idle_next; /* LRU of closed mappings */
} usmipc__region_t;

extern pthread_mutex_t usmipc__registry_lock;

/* All below: call with usmipc__registry_lock held. */
int usmipc__region_insert(usmipc__region_t *r);
void usmipc__region_remove(usmipc__region_t *r);
usmipc__region_t *usmipc__region_find(const void *ptr);
/* Visits every region (used after fork). */
void usmipc__region_foreach(void (*fn)(usmipc__region_t *r));
uint64_t usmipc__new_buffer_id(void);
/* Drops a LOCAL region from the registry and releases it; lock NOT held. */
void usmipc__region_release_local(usmipc__region_t *r);
/* Asks each backend about a pointer usmipc did not allocate; lock held. */
int usmipc__foreign_query(const void *ptr, usmipc__allocation_t *alloc,
                          uint64_t *buffer_id, usmipc_device_t **device);
/* The same without the lock held, refusing the slack past the end of one of
 * usmipc's own allocations, with a message. */
int usmipc__foreign_query_unlocked(const void *ptr, usmipc__allocation_t *alloc,
                                   uint64_t *buffer_id,
                                   usmipc_device_t **device);

/* ---- exports and opens for bundles (ipc.c) ------------------------------ */

/* The allocation a pointer lies in: usmipc's own (a pool's segment, not the
 * block) or another library's (asked of the driver). */
typedef struct usmipc__allocation_ref {
  uint64_t buffer_id;
  uintptr_t base;
  size_t size;
  usmipc_device_t *device;
  bool chunked; /* one physical chunk of CUDA VMM memory (docs/cuda.md) */
} usmipc__allocation_ref_t;
int usmipc__allocation_of(const void *ptr, usmipc__allocation_ref_t *ref);
/* An unordered handle of the whole allocation at base (a pool segment as
 * a whole, without a block record); for memory in chunks, of the whole run
 * of chunks under [base, base + nbytes). Fills ref's id, base and size
 * from the handle. */
int usmipc__export_allocation(const void *base, size_t nbytes,
                              usmipc_ipc_handle_t **handle,
                              usmipc__allocation_ref_t *ref);
/* usmipc_ipc_open of a decoded memory handle, all of it, unordered. */
int usmipc__open_wire(const struct usmipc__wire *w, usmipc_device_t *device,
                      void **ptr);
/* Whether w's exporter (proven, as for an open) still holds its export-table
 * slot for (id, the tag of token, and *size unless size is NULL): *state 1
 * yes, 0 cleared (freed, or forged), -1 the exporter exited. Returns 0, or
 * the error of proving the exporter. Pool blocks and bundles check their
 * own slots so. */
int usmipc__peer_slot_state(const struct usmipc__wire *w, uint32_t slot,
                            uint64_t id, const uint8_t token[16],
                            const uint64_t *size, int *state);
/* Takes n more open references on the mapping (or same-process alias) at
 * ptr, each to be dropped by usmipc_ipc_close. */
int usmipc__mapping_addref(void *ptr, unsigned n);
/* Tests only (tests/c bundle_mapping_refs_do_not_wrap): reads (get) and
 * sets (set) the reference count of the open mapping at ptr, to start it
 * near a limit. */
int usmipc__mapping_refs_for_test(void *ptr, const uint64_t *set,
                                  uint64_t *get);

/* Decodes and checks bundle bytes (bundle.c); the fuzzer's entry point.
 * *kept (if not NULL) receives the description, freed by
 * usmipc_bundle_release. */
int usmipc__bundle_decode_check(const void *data, size_t len, size_t *arrays,
                                size_t *allocations,
                                usmipc_opened_bundle_t **kept);

/* Whether data starts as bundle bytes do (bundle.c). */
bool usmipc__bundle_magic(const void *data, size_t len);
/* For usmipc_ipc_release of bundle bytes (bundle.c), decoded in full: *w
 * becomes allocation 0's handle with the records that follow the tree,
 * which name the producer and carry the ticket. *no_memory: the bundle
 * names no allocation, so it has no ticket and needs none. USMIPC_EINVAL
 * when the producer asked for no release. */
int usmipc__bundle_ticket(const void *data, size_t len, struct usmipc__wire *w,
                          bool *no_memory);

/* ---- USMIPC_DEBUG and malformed settings (debug.c) ----------------------- */

bool usmipc__debug_enabled(void);
/* A line on stderr when USMIPC_DEBUG=1: "usmipc[pid]: ..." */
void usmipc__debug(const char *fmt, ...) USMIPC__PRINTF(1, 2);
/* A warning on stderr (always): name's value is malformed, what was
 * expected, and what is used instead. */
void usmipc__env_malformed(const char *name, const char *value,
                           const char *expected, const char *used);

/* ---- counters (stats.c) -------------------------------------------------- */

typedef struct usmipc__stats {
  uint64_t driver_exports, driver_imports, driver_queries;
  uint64_t descriptors_sent, descriptors_received, transport_exchanges;
} usmipc__stats_t;
extern usmipc__stats_t usmipc__stats;
#define USMIPC__STAT_ADD(field, n)                                             \
  __atomic_fetch_add(&usmipc__stats.field, (uint64_t)(n), __ATOMIC_RELAXED)
#define USMIPC__STAT_GET(field)                                                \
  __atomic_load_n(&usmipc__stats.field, __ATOMIC_RELAXED)

/* ---- the wire format (handle.c) ------------------------------------------ */

#define USMIPC__WIRE_VERSION 2
#define USMIPC__WIRE_FIXED_LEN 212 /* bytes before the payload */
#define USMIPC__WIRE_EXT_MAX 1024  /* bytes of extension records at most */
/* the allocation has no export-table slot */
#define USMIPC__NO_SLOT UINT32_MAX
/* flags */
/* an fd must be fetched from the exporter */
#define USMIPC__WIRE_FLAG_FD 0x1u
/* that fd is a memfd, which /proc/<pid>/fd can reopen */
#define USMIPC__WIRE_FLAG_REOPENABLE 0x2u
/* the exporter also listens in USMIPC_SOCKET_DIR */
#define USMIPC__WIRE_FLAG_SOCKET_DIR 0x4u
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
/* re-recorded only after its previous record completed */
#define USMIPC__EVENT_FLAG_RING 0x1u
/* no device event: a record is complete when it is made */
#define USMIPC__EVENT_FLAG_HOST 0x2u
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
void usmipc__wire_identity(usmipc__wire_t *w, usmipc_device_t *device);
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

/* ---- events (event.c) ---------------------------------------------------- */
/* A handle holding the encoding of w (ipc.c). */
int usmipc__handle_from_wire(const usmipc__wire_t *w,
                             usmipc_ipc_handle_t **handle);
/* Waits (on queue's device, or the host when queue is NULL) for the record
 * that event wire ew names, opening the event on device (cached). */
int usmipc__event_wait_wire(const usmipc__wire_t *ew, usmipc_device_t *device,
                            usmipc_queue_t *queue);
/* Records a fresh ring event of queue's device on queue and writes the
 * ordering record (0x8002) naming it into out (see usmipc__order_record);
 * returns its length in *len. */
int usmipc__event_order(usmipc_queue_t *queue, uint8_t *out, size_t *len);
/* A standalone event handle's bytes (kind 128) of a fresh ring event of
 * queue's device recorded on queue; *len is at most USMIPC__EVENT_HANDLE_MAX.
 */
#define USMIPC__EVENT_HANDLE_MAX                                               \
  (USMIPC__WIRE_FIXED_LEN + USMIPC__EVENT_PAYLOAD_MAX + 4 +                    \
   USMIPC__EVENT_RECORD_LEN + 4)
int usmipc__event_ring_handle(usmipc_queue_t *queue, uint8_t *out, size_t *len);

/* Release signals (event.c): a producer's handle hands out tickets (record
 * 0x8003); consumers return them through the producer's broker with an
 * event of their own, which the producer waits for. */
typedef struct usmipc__release usmipc__release_t;
/* The owner (a handle, a bundle) keeps a usmipc__release_t * field, NULL
 * until its first ticket, and passes its address: the registry is made on
 * the first ticket and published whole, so that the counts and the wait may
 * run on other threads meanwhile (they see none, or all of it). */
void usmipc__release_free(usmipc__release_t *rel);
/* A new ticket of *slot's registry (made on the first): writes record
 * 0x8003 (4 + 32 bytes) at out and adds its length to *len. */
int usmipc__release_ticket(usmipc__release_t **slot, uint8_t *out, size_t *len);
/* Tickets handed out and come back (0 and 0 before the first). */
void usmipc__release_counts(usmipc__release_t *const *slot, uint64_t *sent,
                            uint64_t *released);
/* Waits for every ticket handed out so far (none: returns 0 at once). */
int usmipc__release_wait(usmipc__release_t *const *slot, usmipc_queue_t *queue);
/* The broker's side: a release request (header req, body of len bytes)
 * for this process; returns the reply status (0 accepted). */
uint32_t usmipc__release_arrived(const uint8_t *req, const uint8_t *body,
                                 size_t len);
/* A release request's body: u64 ticket, u16 length, an event handle of that
 * length (or none). 0 when well formed, with the parts. */
int usmipc__release_body_parse(const uint8_t *body, size_t len,
                               uint64_t *ticket, const uint8_t **event,
                               size_t *event_len);
#define USMIPC__RELEASE_BODY_MAX (10 + USMIPC__EVENT_HANDLE_MAX)
/* ---- pools (pool.c) ------------------------------------------------------ */
/* usmipc_free of a pointer in a pool segment (region->pool_segment). */
int usmipc__pool_free(void *segment, void *ptr);
/* The block record (0x8101, 4 + 48 bytes into rec) of the block holding ptr,
 * exporting the block's slot the first time; resolves *nbytes == 0 to the
 * rest of the block and checks the range. */
int usmipc__pool_export(void *segment, const void *ptr, size_t *nbytes,
                        uint8_t *rec, size_t *rec_len);
/* Describes the block holding ptr (base, size, buffer id): 0, or
 * USMIPC_EUNKNOWNPTR for a pointer in no live block of the segment. */
int usmipc__pool_query(void *segment, const void *ptr,
                       usmipc_pointer_info_t *info);
/* 1 while the block w's record names is allocated (same process). */
int usmipc__pool_block_live(void *segment, const usmipc__wire_t *w);
/* The token whose usmipc__slot_tag a block's export slot holds: the block
 * record's token bound to the segment (its buffer id), the block's offset
 * and size, so that a record opens only the block it was issued for. */
void usmipc__pool_block_slot_token(const uint8_t token[16], uint64_t segment_id,
                                   uint64_t offset, uint64_t size,
                                   uint8_t out[16]);
/* The pool's free space: bytes and ranges (a test hook: after every block
 * is freed, one range per segment holding all its bytes). */
void usmipc__pool_free_space(usmipc_pool_t *pool, size_t *bytes,
                             size_t *ranges);
/* ---- the PyTorch allocator (torch_allocator.c) ----------------------------
 * usmipc_torch_* on any backend's device ordinal (the public calls are the
 * CUDA ones): the C tests drive the host's pools with these. */
void *usmipc__torch_malloc_on(usmipc_backend_t backend, ssize_t size,
                              int ordinal, void *stream);
void usmipc__torch_free_on(usmipc_backend_t backend, void *ptr, int ordinal,
                           void *stream);
int usmipc__torch_pool_for(usmipc_backend_t backend, int ordinal,
                           usmipc_pool_t **pool);
int usmipc__torch_synchronize_on(usmipc_backend_t backend, int ordinal);

void usmipc__events_fork_prepare(void);
void usmipc__events_fork_parent(void);
void usmipc__events_fork_child(void);

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
/* ---- the export table (linux/exports.c) -----------------------------------
 * Which allocations this process still exports, shared read-only with
 * importers (see the file's comment for the layout and the protocol). */
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

/* A slot's tag: the first 8 bytes of MAC(process key, token). Importers
 * that hold the handle compute it; the table does not reveal the token. */
uint64_t usmipc__slot_tag(const uint8_t key[16], const uint8_t token[16]);
/* Its low two bits are the slot's kind: memory (an allocation, a bundle, a
 * pool block: usmipc__slot_tag) or an event (usmipc__event_slot_tag). */
#define USMIPC__SLOT_KIND_MASK 3u
#define USMIPC__SLOT_KIND_MEMORY 1u
#define USMIPC__SLOT_KIND_EVENT 2u
uint64_t usmipc__event_slot_tag(const uint8_t key[16], const uint8_t token[16]);
/* Exporter. */
int usmipc__exports_add(uint64_t buffer_id, uint32_t fd_number, uint64_t size,
                        uint64_t tag, uint32_t *slot,
                        uint32_t *table_fd_number);
void usmipc__exports_remove(uint32_t slot);
/* Rewrites a slot's size field: an event's slot counts its records there. */
void usmipc__exports_set_size(uint32_t slot, uint64_t size);
int usmipc__exports_table_fd(void);
/* The table's liveness mutex (the table is created if need be), which the
 * broker thread locks for the life of the process. */
pthread_mutex_t *usmipc__exports_alive_mutex(void);
/* Locks it from the calling thread, whose kernel tid is tid, and publishes
 * where its futex word is. */
int usmipc__exports_hold_alive(pthread_mutex_t *m, uint32_t tid);

/* Importer: maps a table descriptor read-only after checking that it is a
 * sealed table of the right size, owned by this uid, whose header names the
 * handle's exporter and carries a valid tag for the handle's key. */
int usmipc__table_map(int fd, const usmipc__wire_t *w, const uint8_t **hdr);
/* 1 while the exporter lives (its liveness word is held, not owner-died). */
int usmipc__table_alive(const uint8_t *hdr);
/* A consistent copy of a slot (seqlock); -1 if it stays mid-update,
 * USMIPC_EBADHANDLE (with a message) for a slot beyond the table. */
int usmipc__table_read_slot(const uint8_t *hdr, uint32_t slot,
                            usmipc__export_slot_t *out, uint32_t *seq);
uint32_t usmipc__table_slot_seq(const uint8_t *hdr, uint32_t slot);

/* ---- the fd transport (linux/fdxfer.c) -------------------------------------
 * The exporter's broker (a thread serving the export table and published
 * descriptors over a Unix socket, with authentication) and the primitives
 * an importer uses to take descriptors: pidfd_getfd(2), /proc/<pid>/fd and
 * a request to the broker. */
typedef struct usmipc__fd_grant {
  uint8_t token[16];
  uint32_t fd_number;
  uint64_t dev, ino;
  bool
      reopenable; /* a memfd: opening /proc/<pid>/fd/<n> yields the same file */
} usmipc__fd_grant_t;

/* Starts this process's broker if it is not running (it also holds the
 * export table's liveness mutex, so it starts on every first export). */
int usmipc__fdxfer_serve(void);
/* Makes fd fetchable by importers that present a capability derived from
 * token (drawn here, returned in grant). fd is borrowed: the caller keeps
 * it open until it has called usmipc__fdxfer_withdraw. may_reopen false
 * keeps importers off /proc/<pid>/fd even for a memfd (a backend whose
 * descriptors are dma-bufs, which do not reopen as themselves). */
int usmipc__fdxfer_publish(int fd, uint64_t buffer_id, bool may_reopen,
                           usmipc__fd_grant_t *grant);
/* The same for nfds descriptors (at most USMIPC__CHUNKS_MAX: a run of
 * chunks) served together, in order, under one token; the grant names the
 * first. They are never reopenable. */
int usmipc__fdxfer_publish_fds(const int *fds, uint32_t nfds,
                               uint64_t buffer_id, bool may_reopen,
                               usmipc__fd_grant_t *grant);
/* Stops serving buffer_id (on return the descriptor is no longer used). */
void usmipc__fdxfer_withdraw(uint64_t buffer_id);
/* 1 when the exporter also listens in USMIPC_SOCKET_DIR. */
bool usmipc__fdxfer_socket_dir(void);
/* Tests only: how long the broker waits between binding its socket file in
 * USMIPC_SOCKET_DIR and using it (0, the default: not at all), to widen the
 * window an attacker who can write the directory would race. */
extern unsigned usmipc__test_socket_bind_delay_ms;

typedef enum usmipc__transport {
  USMIPC__TRANSPORT_AUTO,
  USMIPC__TRANSPORT_SOCKET,
  USMIPC__TRANSPORT_PIDFD,
  USMIPC__TRANSPORT_PROCFD,
} usmipc__transport_t;
/* USMIPC_FD_TRANSPORT, or EINVAL with a message. */
int usmipc__transport_mode(usmipc__transport_t *mode);

#define USMIPC__WANT_TABLE 0x1u
#define USMIPC__WANT_FD 0x2u
#define USMIPC__WANT_RELEASE 0x4u /* alone: a release signal, with a body */
#define USMIPC__WANT_FDS 0x8u     /* alone: many descriptors, with a body */
/* A WANT_FDS request names at most this many allocations: one SCM_RIGHTS
 * message carries at most SCM_MAX_FD (253) descriptors (unix(7)). */
#define USMIPC__FDS_PER_REQUEST 253u
#define USMIPC__FDS_ENTRY_LEN 24u /* u64 buffer id, 16-byte capability */
#define USMIPC__FDS_BODY_MAX                                                   \
  (2u + USMIPC__FDS_PER_REQUEST * USMIPC__FDS_ENTRY_LEN)
/* Asks the exporter's broker for its table and/or the handle's descriptor,
 * after checking that the listener is the exporter (its credentials, its
 * pidfd) and before trusting an answer, that it proved the handle's key.
 * Received descriptors land in *table_fd / *data_fd (-1 when not asked);
 * for a handle of a run of chunks (w->chunk_count) data_fd is an array of
 * that many, filled in chunk order. */
int usmipc__broker_call(const usmipc__wire_t *w, unsigned want,
                        uint64_t deadline, int *table_fd, int *data_fd);
/* Sends a release signal (body: see usmipc__release_body_parse) to the
 * broker of w's exporter for w's release record, and awaits its answer. */
int usmipc__broker_release(const usmipc__wire_t *w, const uint8_t *body,
                           size_t len, uint64_t deadline);
/* Asks the broker of the exporter of w[0] for the descriptors of w[0..n)
 * (1 <= n <= USMIPC__FDS_PER_REQUEST, all of that exporter, each with
 * USMIPC__WIRE_FLAG_FD and of one piece: a run of chunks, whose descriptors
 * travel only together, is EINVAL here and refused by the broker) in one
 * request and one answer; fds[i] receives
 * w[i]'s descriptor. The broker serves all or none: on failure no
 * descriptor is left open, fds[] holds -1 and *failed names the entry the
 * broker refused (SIZE_MAX when the failure names none). The descriptors
 * are the broker's word only: the caller checks each one's identity. */
int usmipc__broker_fetch_fds(const usmipc__wire_t *const *w, size_t n,
                             uint64_t deadline, int *fds, size_t *failed);
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
/* EEXPORTERGONE for an exporter that has exited (errno e, or 0). */
int usmipc__fail_exporter_exited(const usmipc__wire_t *w, int e);
/* A pidfd of w's pid, proven to be w's exporter (its pidfs inode or start
 * time); USMIPC_EEXPORTERGONE when that process has exited (peers.c). Only
 * for a w of this PID namespace (usmipc__same_pid_namespace). */
int usmipc__exporter_pidfd(const usmipc__wire_t *w, int *out);
/* Whether the process of pidfd has exited, waiting up to wait_ms for it: 1
 * exited, 0 not (yet), -1 the poll failed. */
int usmipc__pidfd_exited(int pidfd, unsigned wait_ms);
/* pidfd_getfd(2) of descriptor number n from the process of pidfd. */
int usmipc__pidfd_take(int pidfd, uint32_t pid, uint32_t n, int *out);
/* Reopens /proc/<pid>/fd/<n> without blocking on what it finds: opened
 * O_PATH, required to be a regular file, then reopened with flags. */
int usmipc__procfd_reopen(const usmipc__wire_t *w, uint32_t n, int flags,
                          int *out);

/* ---- the importer's view of exporters (linux/peers.c) ----------------------
 * One record per exporting process this process opened handles of: its
 * verified export table and, where usable, its pidfd. Regions of origin
 * IMPORTED hold a reference. Guarded by usmipc__registry_lock. */
typedef struct usmipc__peer usmipc__peer_t;

/* Finds or makes the peer of w's exporter, proves its identity and maps its
 * table (once per exporter), and returns a reference. When the proof went
 * through the broker and w shares a descriptor, that descriptor may come
 * back too in *fd (else -1). Lock NOT held. */
int usmipc__peer_get(const usmipc__wire_t *w, uint64_t deadline,
                     usmipc__peer_t **peer, int *fd);
/* Takes w's descriptor from the verified exporter, checked against the
 * export table before and after. Lock NOT held. */
int usmipc__peer_fetch_fd(usmipc__peer_t *peer, const usmipc__wire_t *w,
                          uint64_t tag, uint64_t deadline, int *fd);
/* The same for a handle of a run of chunks: its w->chunk_count descriptors,
 * in order, from the exporter's broker (the handle names only the first's
 * number, so pidfd_getfd cannot take the others). Lock NOT held. */
int usmipc__peer_fetch_run_fds(usmipc__peer_t *peer, const usmipc__wire_t *w,
                               uint64_t tag, uint64_t deadline, int *fds);
/* Takes the descriptors of w[0..n), all handles of peer's exporter with
 * USMIPC__WIRE_FLAG_FD, each of one descriptor (EINVAL otherwise: a run of
 * chunks is taken whole by usmipc__peer_fetch_run_fds), into fds[0..n),
 * with the checks of usmipc__peer_fetch_fd for each. pidfd and /proc take them
 * one by one (system calls, no exchange); the broker serves them in one
 * exchange per USMIPC__FDS_PER_REQUEST. All or nothing: on failure every
 * descriptor already taken is closed, fds[] holds -1, and the message names the
 * allocation that failed and why. Lock NOT held. */
int usmipc__peer_fetch_fds(usmipc__peer_t *peer, const usmipc__wire_t *const *w,
                           size_t n, uint64_t deadline, int *fds);
/* 0 when w's allocation is still exported by a living exporter, else
 * EEXPORTERGONE (or EBADHANDLE for a forged size) with a message. Reads
 * shared memory only: the cache-hit path calls it. */
int usmipc__peer_check(const usmipc__peer_t *peer, const usmipc__wire_t *w,
                       uint64_t tag, uint32_t *seq);
/* The same, quietly, for an idle mapping: 1 while its allocation is live. */
int usmipc__peer_slot_live(const usmipc__peer_t *peer, uint32_t slot,
                           uint64_t buffer_id, uint64_t tag);
/* The verified export table of the peer (valid while a reference is held). */
const uint8_t *usmipc__peer_table(const usmipc__peer_t *peer);
/* Registry lock held. */
void usmipc__peer_ref(usmipc__peer_t *peer);
void usmipc__peer_unref(usmipc__peer_t *peer);
/* Lock NOT held. */
void usmipc__peer_put(usmipc__peer_t *peer);

/* ---- opening handles (ipc.c) ---------------------------------------------
 * The steps of usmipc_ipc_open, for callers that open many handles at once
 * and fetch their descriptors together first (usmipc__open_wire above is
 * usmipc__open_mapping without a prefetched descriptor). */

/* Maps w (a decoded memory handle) on device (NULL: the exporting device)
 * as usmipc_ipc_open does, without the ordering wait. prefetched_fd is -1
 * (the descriptor is fetched here when needed) or w's descriptor, taken
 * beforehand (usmipc__prefetch_fds); it is owned by the call: used for the
 * mapping, or closed (a cache hit, a same-process handle, any failure).
 * A handle of a run of chunks is never prefetched: its open fetches the
 * run's k descriptors itself, and closes a descriptor given unused. */
int usmipc__open_mapping(const usmipc__wire_t *w, usmipc_device_t *device,
                         size_t nbytes, int prefetched_fd, void **ptr,
                         size_t *mapped_nbytes);
/* 1 when w's allocation is mapped on device (NULL: the exporting device) in
 * this process's import cache, open or idle: an open then needs no
 * descriptor. A hint: the mapping may be dropped before the open. */
bool usmipc__import_cached(const usmipc__wire_t *w, usmipc_device_t *device);
/* Takes the descriptors that opening w[0..n) needs, w[i] of any exporter,
 * with one usmipc__peer_fetch_fds per exporter (so one broker exchange per
 * exporter and USMIPC__FDS_PER_REQUEST descriptors). fds[i] is -1 for a
 * handle that needs none (no USMIPC__WIRE_FLAG_FD, no export slot, or this
 * process's own) and for a handle of a run of chunks (chunk_count != 0),
 * which is not batched: usmipc__open_mapping fetches its run whole, in one
 * exchange of its own, as usmipc_ipc_open does. All or nothing: on failure
 * no descriptor is left open and the message names the handle that
 * failed. */
int usmipc__prefetch_fds(const usmipc__wire_t *const *w, size_t n,
                         uint64_t deadline, int *fds);

/* ---- dma-buf descriptors (linux/dmabuf.c) ------------------------------- */
/* The size of the dma-buf behind fd: 0, or -EBADFD when fd is not a dma-buf,
 * or another negative errno. */
int usmipc__dmabuf_size(int fd, uint64_t *size);
/* 0 when fd is a dma-buf of at least min_size bytes; otherwise fails with
 * code and a message that starts with what. */
int usmipc__dmabuf_check(int fd, uint64_t min_size, int code, const char *what);

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

#endif /* USMIPC_COMMON_H */
