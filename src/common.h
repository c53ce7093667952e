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
  uint32_t uid;
  uint64_t nonce;
  uint8_t boot_id[16]; /* /proc/sys/kernel/random/boot_id; zero if unreadable */
} usmipc__process_t;

const usmipc__process_t *usmipc__self(void);

/* fork() handlers of each module, run by process.c in lock order: the
 * registry lock is taken first, then the export table's, then the fd
 * transport's (the order in which export nests them). */
void usmipc__registry_fork_prepare(void);
void usmipc__registry_fork_parent(void);
void usmipc__registry_fork_child(void);
void usmipc__exports_fork_prepare(void);
void usmipc__exports_fork_parent(void);
void usmipc__exports_fork_child(void);
void usmipc__fdxfer_fork_prepare(void);
void usmipc__fdxfer_fork_parent(void);
void usmipc__fdxfer_fork_child(void);
int usmipc__random(void *buf, size_t len);

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

/* ---- devices (device.c) -------------------------------------------------- */

struct usmipc_device {
  const usmipc__backend_ops_t *ops;
  void *native; /* from the backend's probe */
  usmipc_device_type_t type;
  int index;   /* among devices of the same backend and type */
  int ordinal; /* probe order within the backend */
  int has_ipc;
  uint8_t uuid[16];
  char name[128];
  char filter[48]; /* "host:cpu:0" */
};

struct usmipc_queue {
  usmipc_device_t *device;
  void *native;
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
  unsigned alias_refs; /* same-process opens not yet closed */
  bool user_freed;     /* usmipc_free called while aliases were open */
  bool exported;       /* payload and fd grant below are valid */
  usmipc__payload_t payload;
  uint8_t token[16];  /* LOCAL: capability importers present to the broker;
                         IMPORTED: the token of the handle first opened,
                         which later opens of the same allocation match */
  uint32_t fd_number; /* the published descriptor, for pidfd_getfd */
  uint64_t fd_dev, fd_ino;
  uint32_t export_slot; /* this allocation's slot in the export table */
  uint32_t table_fd_number;
  bool fd_reopenable;

  /* IMPORTED */
  usmipc__import_key_t key;
  unsigned open_refs; /* usmipc_ipc_open calls not yet closed */
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

/* ---- the wire format (handle.c) ------------------------------------------ */

#define USMIPC__WIRE_VERSION 1
#define USMIPC__WIRE_FIXED_LEN 148 /* bytes before the payload */
#define USMIPC__NO_SLOT UINT32_MAX /* the allocation has no export-table slot  \
                                    */
#define USMIPC__WIRE_FLAG_FD 0x1u  /* an fd must be fetched from the exporter  \
                                    */
#define USMIPC__WIRE_FLAG_REOPENABLE                                           \
  0x2u /* that fd is a memfd, which                                            \
          /proc/<pid>/fd can reopen */

typedef struct usmipc__wire {
  usmipc_backend_t backend;
  uint16_t flags;
  uint8_t device_uuid[16];
  uint8_t boot_id[16];
  uint32_t pid;
  uint32_t fd_number;
  uint64_t nonce;
  uint64_t buffer_id;
  uint64_t exporter_base;
  uint64_t allocation_size;
  uint64_t offset;
  uint64_t nbytes;
  uint64_t fd_dev;
  uint64_t fd_ino;
  uint8_t token[16];
  uint32_t export_slot;     /* slot in the exporter's export table */
  uint32_t table_fd_number; /* the table's descriptor in the exporter */
  usmipc__payload_t payload;
} usmipc__wire_t;

/* Encoded length for a payload of payload_len bytes. */
size_t usmipc__wire_size(size_t payload_len);
/* Writes exactly usmipc__wire_size(w->payload.len) bytes to out. */
void usmipc__wire_encode(const usmipc__wire_t *w, uint8_t *out);
/* Decodes untrusted bytes; every failure is EBADHANDLE or EHANDLEVERSION
 * with a message naming the defect. */
int usmipc__wire_decode(const void *data, size_t len, usmipc__wire_t *w);
uint32_t usmipc__crc32c(uint32_t crc, const void *data, size_t len);

/* ---- file descriptor transport (linux/fdxfer.c) ---------------------------
 */

typedef struct usmipc__fd_grant {
  uint8_t token[16];
  uint32_t fd_number;
  uint64_t dev, ino;
  bool
      reopenable; /* a memfd: opening /proc/<pid>/fd/<n> yields the same file */
} usmipc__fd_grant_t;

/* Starts this process's broker if it is not running: it serves the export
 * table to importers that may not take it with pidfd_getfd or /proc, also
 * when no allocation is shared through a descriptor. */
int usmipc__fdxfer_serve(void);
/* Makes fd fetchable by importers that present the returned token; starts
 * the broker lazily. fd is borrowed: the caller keeps it open until it has
 * called usmipc__fdxfer_withdraw. */
int usmipc__fdxfer_publish(int fd, uint64_t buffer_id,
                           usmipc__fd_grant_t *grant);
/* Stops serving buffer_id (on return the descriptor is no longer used);
 * importers that already hold the fd keep it. */
void usmipc__fdxfer_withdraw(uint64_t buffer_id);
/* Obtains the exporter's descriptor for a decoded handle already checked
 * against the export table (seq from usmipc__exports_check): pidfd_getfd(2)
 * where permitted (then checked again against the table, and against the
 * recorded file identity), else the exporter's broker over a Unix socket.
 * USMIPC_FD_TRANSPORT forces one. */
int usmipc__fdxfer_fetch(const usmipc__wire_t *w, uint32_t seq, int *fd);
/* Obtains the exporter's export table descriptor, the same two ways. */
int usmipc__fdxfer_fetch_table(const usmipc__wire_t *w, int *fd);

/* ---- the export table (linux/exports.c) -----------------------------------
 * Which allocations this process still exports, shared read-only with
 * importers so that a stale handle is refused without asking the exporter. */
int usmipc__exports_add(uint64_t buffer_id, uint32_t fd_number, uint64_t size,
                        uint32_t *slot, uint32_t *table_fd_number);
void usmipc__exports_remove(uint32_t slot);
int usmipc__exports_table_fd(void);
void usmipc__exports_table_name(uint32_t pid, uint64_t nonce, char *out,
                                size_t len);
/* Importer: 0 if the handle's allocation is still exported, with the slot's
 * sequence number in *seq; recheck says whether it is unchanged since. */
int usmipc__exports_check(const usmipc__wire_t *w, uint32_t *seq);
int usmipc__exports_recheck(const usmipc__wire_t *w, uint32_t seq);

#endif /* USMIPC_COMMON_H */
