/* Shared declarations of the C test suite: assertion macros, byte patterns,
 * process and /proc helpers, and the "agent" helper protocol.
 *
 * Modelled on libuv's test/task.h: a test is `TEST_IMPL(name)` returning 0
 * (passed) or TEST_SKIP; a failed ASSERT prints where and why and ends the
 * test's process, which the runner reports as "not ok". */
#ifndef USMIPC_TEST_TASK_H
#define USMIPC_TEST_TASK_H

#include <inttypes.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>

#include "probe.h"
#include "usmipc.h"

/* Exit status of a skipped test (also CTest's SKIP_RETURN_CODE). */
#define TEST_SKIP 77
/* Seconds a test may run before the runner (or its own alarm) kills it;
 * USMIPC_TEST_TIMEOUT overrides. */
#define TEST_DEFAULT_TIMEOUT 30

#define TEST_IMPL(name) int test_##name(void)
#define HELPER_IMPL(name) int helper_##name(int argc, char **argv)

/* ---- assertions ---------------------------------------------------------- */

void test_fail(const char *file, int line, const char *fmt, ...)
    __attribute__((noreturn, format(printf, 3, 4)));

#define ASSERT(expr)                                                           \
  do {                                                                         \
    if (!(expr))                                                               \
      test_fail(__FILE__, __LINE__, "assertion failed: %s", #expr);            \
  } while (0)

#define ASSERT_MSG(expr, ...)                                                  \
  do {                                                                         \
    if (!(expr))                                                               \
      test_fail(__FILE__, __LINE__, __VA_ARGS__);                              \
  } while (0)

#define ASSERT_CMP_(a, op, b, type, fmt)                                       \
  do {                                                                         \
    type a_ = (type)(a);                                                       \
    type b_ = (type)(b);                                                       \
    if (!(a_ op b_))                                                           \
      test_fail(__FILE__, __LINE__, "%s %s %s: %" fmt " %s %" fmt, #a, #op,    \
                #b, a_, #op, b_);                                              \
  } while (0)

#define ASSERT_EQ(a, b) ASSERT_CMP_(a, ==, b, int64_t, PRId64)
#define ASSERT_NE(a, b) ASSERT_CMP_(a, !=, b, int64_t, PRId64)
#define ASSERT_LT(a, b) ASSERT_CMP_(a, <, b, int64_t, PRId64)
#define ASSERT_LE(a, b) ASSERT_CMP_(a, <=, b, int64_t, PRId64)
#define ASSERT_GT(a, b) ASSERT_CMP_(a, >, b, int64_t, PRId64)
#define ASSERT_GE(a, b) ASSERT_CMP_(a, >=, b, int64_t, PRId64)
#define ASSERT_UEQ(a, b) ASSERT_CMP_(a, ==, b, uint64_t, PRIu64)
#define ASSERT_UNE(a, b) ASSERT_CMP_(a, !=, b, uint64_t, PRIu64)
#define ASSERT_PTR_EQ(a, b) ASSERT_CMP_(a, ==, b, const void *, "p")
#define ASSERT_PTR_NE(a, b) ASSERT_CMP_(a, !=, b, const void *, "p")
#define ASSERT_NOT_NULL(a) ASSERT_MSG((a) != NULL, "%s is NULL", #a)
#define ASSERT_STR_EQ(a, b)                                                    \
  do {                                                                         \
    const char *a_ = (a), *b_ = (b);                                           \
    if (a_ == NULL || b_ == NULL || strcmp(a_, b_) != 0)                       \
      test_fail(__FILE__, __LINE__, "%s == %s: \"%s\" != \"%s\"", #a, #b,      \
                a_ ? a_ : "(null)", b_ ? b_ : "(null)");                       \
  } while (0)

/* A usmipc call that must succeed. */
#define ASSERT_OK(call)                                                        \
  do {                                                                         \
    int r_ = (call);                                                           \
    if (r_ != 0)                                                               \
      test_fail(__FILE__, __LINE__, "%s failed: %d %s: %s", #call, r_,         \
                usmipc_err_name(r_), usmipc_last_error());                     \
  } while (0)

/* A usmipc call that must fail with exactly `code` and leave a message. */
#define ASSERT_ERR(call, code) ASSERT_ERR_ONEOF_(call, code, code, code)
/* ... with either of two codes. */
#define ASSERT_ERR2(call, c1, c2) ASSERT_ERR_ONEOF_(call, c1, c2, c2)
#define ASSERT_ERR3(call, c1, c2, c3) ASSERT_ERR_ONEOF_(call, c1, c2, c3)
#define ASSERT_ERR_ONEOF_(call, c1, c2, c3)                                    \
  do {                                                                         \
    test_error_sentinel();                                                     \
    int r_ = (call);                                                           \
    test_check_error(__FILE__, __LINE__, #call, r_, (c1), (c2), (c3));         \
  } while (0)

/* The thread's message is never cleared, so before a call that must fail
 * the test records a known message (a sentinel failure); test_check_error
 * then knows the failing call wrote its own. */
void test_error_sentinel(void);
/* Checks r is one of c1..c3 and that the call left a message of its own. */
void test_check_error(const char *file, int line, const char *what, int r,
                      int c1, int c2, int c3);

#define RETURN_SKIP(...)                                                       \
  do {                                                                         \
    test_skip_note(__VA_ARGS__);                                               \
    return TEST_SKIP;                                                          \
  } while (0)
void test_skip_note(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

/* ---- byte patterns -------------------------------------------------------
 * Byte j of an allocation filled with seed s is a hash of (s, j / 8), so an
 * importer that maps the wrong offset, even a page-aligned one, or a stale
 * allocation reads different bytes. `origin` is the allocation offset of
 * p[0] (the exported offset for an IPC mapping). */
uint8_t pattern_byte(uint64_t seed, uint64_t j);
void pattern_fill(void *p, size_t n, uint64_t seed, uint64_t origin);
/* Index of the first wrong byte, or SIZE_MAX when all n match. */
size_t pattern_check(const void *p, size_t n, uint64_t seed, uint64_t origin);

/* The same on memory of the device under test: direct access on the host
 * backend (the strongest evidence of sharing), a staging copy through a
 * queue elsewhere. dev_check returns SIZE_MAX when all bytes match. */
void dev_fill(void *p, size_t n, uint64_t seed, uint64_t origin);
size_t dev_check(const void *p, size_t n, uint64_t seed, uint64_t origin);
/* The same through a queue of the caller's (dev_fill and dev_check share one
 * queue and belong to the test's main thread; a thread that touches device
 * memory makes its own with usmipc_queue_create). q may be NULL on the host
 * backend, which needs no queue. */
void dev_fill_on(usmipc_queue_t *q, void *p, size_t n, uint64_t seed,
                 uint64_t origin);
size_t dev_check_on(usmipc_queue_t *q, const void *p, size_t n, uint64_t seed,
                    uint64_t origin);
#define ASSERT_PATTERN(p, n, seed, origin)                                     \
  do {                                                                         \
    size_t bad_ = dev_check((p), (n), (seed), (origin));                       \
    if (bad_ != SIZE_MAX)                                                      \
      test_fail(__FILE__, __LINE__,                                            \
                "%s: byte %zu of %zu differs from pattern seed %llu", #p,      \
                bad_, (size_t)(n), (unsigned long long)(seed));                \
  } while (0)

/* ---- utilities ----------------------------------------------------------- */

/* The device under test: USMIPC_TEST_DEVICE, default "host:cpu". */
usmipc_device_t *test_device(void);
int test_device_is_host(void);
const char *test_device_filter(void);
/* The host device ("host:cpu"), which every process has; the device under
 * test when USMIPC_TEST_DEVICE is unset. */
usmipc_device_t *host_device(void);

void hex_encode(const void *data, size_t len, char *out); /* 2*len+1 bytes */
/* Returns the number of bytes decoded, or -1 on a malformed string. */
ssize_t hex_decode(const char *hex, void *out, size_t cap);

size_t count_fds(void); /* entries of /proc/self/fd */
/* The same without sockets, whose number a broker changes on its own (it
 * closes idle connections after a while). */
size_t count_fds_except_sockets(void);
/* count_fds() once it equals want, or after 3 s: the broker closes its end
 * of a connection when it sees the peer's exit, a moment after the peer's
 * wait returned, so an fd count taken at once can be one socket high. */
size_t count_fds_settled(size_t want);
size_t count_maps(void); /* lines of /proc/self/maps */
/* Lines of /proc/self/maps whose text contains needle. */
size_t count_maps_matching(const char *needle);
/* 1 when some line of /proc/self/maps covers address p. */
int address_mapped(const void *p);
int running_as_root(void);
/* 1 when pidfd_open(2) and pidfd_getfd(2) (Linux 5.6) work here. */
int pidfd_supported(void);
double now_seconds(void);
void sleep_ms(unsigned ms);

/* Exports ptr and copies the handle bytes into a malloc'd buffer of exactly
 * *len bytes (so ASan sees any over-read). The handle is returned so the
 * caller keeps the export alive while importers open it; free *data with
 * free() and the handle with usmipc_ipc_free_handle. */
usmipc_ipc_handle_t *export_copy(const void *ptr, size_t nbytes, uint8_t **data,
                                 size_t *len);

/* ---- processes -----------------------------------------------------------
 * Helpers are started by re-executing /proc/self/exe with "--helper NAME",
 * so they are unrelated processes that share nothing with the test but the
 * pipes it gives them. env_overrides is a NULL-terminated list of
 * "NAME=VALUE" strings (NAME= alone removes NAME). */
pid_t spawn_helper(const char *name, char *const extra_args[],
                   const char *const env_overrides[], int *to_child,
                   int *from_child);
/* Waits up to timeout_s for pid; returns its wait status, or -1 on timeout
 * (after which the process has been killed). */
int wait_pid_timeout(pid_t pid, double timeout_s);
/* Reads exactly n bytes from fd: 0, or -1 at end of file or an error. */
int read_full(int fd, void *p, size_t n);
/* 0 when the status is a normal exit with code 0. */
int exit_code_of(int status);
/* fork() `forks` times while another thread calls step(arg) over and over:
 * each child runs child(child_arg) and exits with 0 when it returned 0; every
 * child must exit 0 within 10 s (one that inherited a lock held by the
 * stepping thread hangs instead). The test of fork-safety from any thread. */
void fork_beside_thread(void (*step)(void *), void *arg, int forks,
                        int (*child)(void *), void *child_arg);
/* Where fork_beside_thread cannot test the library: a device the child
 * cannot use after fork (the GPU drivers), and ASan, whose allocator takes
 * no lock at fork (a child forked while the stepping thread is inside
 * malloc inherits its size-class lock held and hangs in its first malloc
 * of that class; glibc's malloc is fork-safe). */
#if defined(__SANITIZE_ADDRESS__)
#define RETURN_SKIP_UNLESS_FORK_BESIDE_THREAD_TESTS()                          \
  RETURN_SKIP("ASan's allocator is not fork-safe with a thread in malloc")
#else
#define RETURN_SKIP_UNLESS_FORK_BESIDE_THREAD_TESTS()                          \
  do {                                                                         \
    if (!test_device_is_host())                                                \
      RETURN_SKIP("the fork child needs a device that survives fork");         \
  } while (0)
#endif

/* ---- the agent helper ----------------------------------------------------
 * An agent is a helper process that runs usmipc calls on command, one line
 * in, one line out, so a test can script an exporter and an importer that
 * are unrelated processes. Slots name the agent's allocations and mappings.
 *
 *   alloc S KIND SIZE       -> ok PTR              (KIND device|host|shared)
 *   fill S SEED [OFF LEN]   -> ok                  (pattern over the range)
 *   check S SEED [OFF LEN]  -> ok | bad INDEX
 *   export S OFF NBYTES     -> ok HEX              (slot keeps the handle)
 *   freehandle S            -> ok
 *   open S HEX NBYTES       -> ok PTR MAPPED
 *   close S | free S        -> ok
 *   revoke S                -> ok                  (usmipc_ipc_revoke)
 *   closeptr PTR            -> ok                  (usmipc_ipc_close(PTR))
 *   query S                 -> ok BASE SIZE BUFFER_ID IS_IPC
 *   cache N                 -> ok
 *   setuid UID              -> ok                  (drops root: gid, uid)
 *   pid                     -> ok PID
 *   fds                     -> ok N                (entries of /proc/self/fd
 *                                                   that are not sockets)
 *   exit                    -> (exits 0)
 * Commands of the trust tests (test_trust.c):
 *   topen S HEX NBYTES      -> ok PTR MAPPED USEC  (open, timed in the agent;
 *                              a failure's message ends "[after USEC us]")
 *   memset S BYTE           -> ok                  (the whole slot: every
 *                                                   page really allocated)
 *   truncate S LEN          -> ok FD | err -ERRNO  (ftruncate(2) of the
 *                              slot's own allocation descriptor, the fd
 *                              number its first handle names)
 *   fifo S table|data rd|rdwr -> ok FD             (dup2 a FIFO, opened
 *                              O_RDONLY or O_RDWR with O_NONBLOCK, onto the
 *                              export table's or the allocation's fd number
 *                              of the slot's first handle)
 *   nofile N | nofile +K    -> ok LIMIT OPEN       (soft RLIMIT_NOFILE to N,
 *                              or to the open descriptors + K)
 *   aslimit +MIB | off      -> ok LIMIT            (soft RLIMIT_AS to the
 *                              address space in use + MIB MiB, or the hard)
 *   unshare net             -> ok                  (unshare(CLONE_NEWNET))
 * Any failure of a usmipc call replies "err CODE NAME message". */
/* Room for one reply line, and for a handle as hex. */
#define AGENT_REPLY_MAX 8192
#define HEX_MAX AGENT_REPLY_MAX

typedef struct agent {
  pid_t pid;
  int to_fd;
  FILE *from;
  char reply[AGENT_REPLY_MAX];
} agent_t;

/* Starts an agent; transport is NULL (inherit), "auto", "socket" or "pidfd"
 * and sets USMIPC_FD_TRANSPORT for it. */
void agent_start(agent_t *a, const char *transport);
/* Sends one command and reads the reply line into a->reply (without
 * "ok "/"err "). Returns 0 for ok, the negative code for err; a dead agent
 * fails the test. */
int agent_call(agent_t *a, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
/* Parses the reply line in a->reply to command cmd (as agent_call does):
 * 0 for ok, the code for err; a malformed reply fails the test. */
int agent_parse_reply(agent_t *a, const char *cmd);
/* agent_call that must succeed. */
#define AGENT_OK(a, ...)                                                       \
  do {                                                                         \
    int r_ = agent_call((a), __VA_ARGS__);                                     \
    if (r_ != 0)                                                               \
      test_fail(__FILE__, __LINE__, "agent %d: \"%s\" failed: %s",             \
                (int)(a)->pid, #__VA_ARGS__, (a)->reply);                      \
  } while (0)
/* agent_call that must fail with one of the codes and carry a message. */
#define AGENT_ERR(a, code, ...) AGENT_ERR3(a, code, code, code, __VA_ARGS__)
#define AGENT_ERR2(a, c1, c2, ...) AGENT_ERR3(a, c1, c2, c2, __VA_ARGS__)
#define AGENT_ERR3(a, c1, c2, c3, ...)                                         \
  do {                                                                         \
    int r_ = agent_call((a), __VA_ARGS__);                                     \
    agent_check_error(__FILE__, __LINE__, (a), #__VA_ARGS__, r_, (c1), (c2),   \
                      (c3));                                                   \
  } while (0)
/* what: the command's source text, for the behaviour probe (probe.h). */
void agent_check_error(const char *file, int line, const agent_t *a,
                       const char *what, int r, int c1, int c2, int c3);
/* Tells the agent to exit and returns its wait status. */
int agent_stop(agent_t *a);
/* agent_stop, and the agent must have exited with status 0 (under ASan
 * that includes LeakSanitizer's verdict on the agent). */
void agent_stop_ok(agent_t *a);
/* SIGKILLs the agent and reaps it. */
void agent_kill(agent_t *a);
/* Parses the hex pointer at the start of a->reply. */
void *agent_reply_ptr(const agent_t *a);

/* ---- handle fields (test_trust.c) ------------------------------------------
 * What the trust tests and the agent's trust commands read from handle
 * bytes. trust_handle_fields is the one function of the suite outside
 * test_handle.c that touches the library's internal wire struct. */
typedef struct trust_handle_fields {
  uint32_t pid;
  uint64_t nonce;
  uint64_t buffer_id;
  uint64_t allocation_size;
  uint32_t fd_number;       /* the allocation's descriptor in the exporter */
  uint32_t table_fd_number; /* the export table's descriptor there */
  uint32_t export_slot;
} trust_handle_fields_t;
/* 0, or the decoder's code. */
int trust_handle_fields(const void *data, size_t len, trust_handle_fields_t *f);

#endif /* USMIPC_TEST_TASK_H */
