/* The util floor's private header: what every file of the core uses.
 *
 * Floor 1 of the core (src/util/): errors, this process's identity and
 * randomness, waits with one deadline, USMIPC_DEBUG and the counters.
 * Includes nothing of the library but the public header. The floors are
 * listed in tools/layering/floors.txt and docs/architecture.md. */
#ifndef USMIPC_UTIL_H
#define USMIPC_UTIL_H

#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

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
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
/* The host's own order: one unaligned load or store each (the byte loops
 * below compiled to a store per byte, 8% of a fresh export's own time). */
#define USMIPC__LE_FIELD(bits)                                                 \
  static inline void usmipc__put##bits##le(uint8_t *p, uint##bits##_t v) {     \
    memcpy(p, &v, sizeof(v));                                                  \
  }                                                                            \
  static inline uint##bits##_t usmipc__get##bits##le(const uint8_t *p) {       \
    uint##bits##_t v;                                                          \
    memcpy(&v, p, sizeof(v));                                                  \
    return v;                                                                  \
  }
USMIPC__LE_FIELD(16)
USMIPC__LE_FIELD(32)
USMIPC__LE_FIELD(64)
#undef USMIPC__LE_FIELD
#else
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
#endif

/* ---- errors (error.c) ---------------------------------------------------- */

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
/* len bytes from the kernel's random source (getrandom(2), drawn ahead in a
 * page a fork child does not inherit: process.c). */
int usmipc__random(void *buf, size_t len);
/* fork.c's hooks: the proof lock, and the child's new identity. */
void usmipc__process_fork_prepare(void);
void usmipc__process_fork_parent(void);
void usmipc__process_fork_child(void);

/* ---- waiting with one deadline (wait.c) ---------------------------------- */

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

/* ---- USMIPC_DEBUG and malformed settings (debug.c) ----------------------- */

bool usmipc__debug_enabled(void);
/* A line on stderr when USMIPC_DEBUG=1: "usmipc[pid]: ..." */
void usmipc__debug(const char *fmt, ...) USMIPC__PRINTF(1, 2);
/* A warning on stderr (always): name's value is malformed, what was
 * expected, and what is used instead. */
void usmipc__env_malformed(const char *name, const char *value,
                           const char *expected, const char *used);

/* ---- numbers from the environment (env.c) --------------------------------
 * The one parser of every USMIPC_* count, size and time: true with *out
 * when name is set to a number from min to max (units: a size, which may
 * end in K, M, G or T, with an optional B or iB); false when it is unset or
 * empty, and when it is malformed or out of range, which also warns on
 * stderr naming the variable, the value, the form expected and
 * used_instead (the caller then uses its default). */
bool usmipc__env_number(const char *name, unsigned long long min,
                        unsigned long long max, bool units,
                        const char *used_instead, unsigned long long *out);

/* ---- counters (stats.c) -------------------------------------------------- */

typedef struct usmipc__stats {
  uint64_t driver_exports, driver_imports, driver_queries;
  uint64_t descriptors_sent, descriptors_received, transport_exchanges;
  uint64_t event_records, event_waits;
} usmipc__stats_t;
extern usmipc__stats_t usmipc__stats;
#define USMIPC__STAT_ADD(field, n)                                             \
  __atomic_fetch_add(&usmipc__stats.field, (uint64_t)(n), __ATOMIC_RELAXED)
#define USMIPC__STAT_GET(field)                                                \
  __atomic_load_n(&usmipc__stats.field, __ATOMIC_RELAXED)

#endif /* USMIPC_UTIL_H */
