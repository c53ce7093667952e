/* Attack and heavy-user reproducers for the transport-trust work.
 *
 * Each test states what the fixed library does; on the library before that
 * work most of them fail, hang until a watchdog or the runner's alarm, or
 * crash: they are the tests that fail first, one per defect.
 *
 *   fork storm ............ trust_fork_storm
 *   broker squatting ...... trust_squatter_after_exit, _after_sigkill
 *   uid policy ............ trust_other_uid_exporter
 *   broker stalls ......... trust_broker_stall
 *   deadlines, signals .... trust_signal_deadline, trust_interrupt_handler
 *   stale cache hits ...... trust_cache_reopen_after_free, _after_sigkill,
 *                           trust_open_again_while_mapped_after_free
 *   /proc reopen of FIFOs . trust_procfd_fifo, trust_procfd_fifo_data
 *   namespaces ............ trust_netns_message, trust_pidns_message,
 *                           trust_container_socket_dir (+ _machine_id,
 *                           _userns)
 *   descriptor limits ..... trust_fd_limit_code
 *   idle cache growth ..... trust_idle_cache_drop_freed, _byte_cap
 *   memfd seals ........... trust_sealed_memfd
 *
 * All run on the host backend (memfd memory); most need root (they play
 * another user with setuid, or make namespaces). */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stddef.h>
#include <sys/inotify.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include "objects.h" /* usmipc__wire_t, usmipc__wire_decode: one function */
#include "task.h"

#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif

#define MiB ((size_t)1 << 20)
#define NOBODY 65534

/* ---- the one use of the internal wire struct ----------------------------- */

int trust_handle_fields(const void *data, size_t len,
                        trust_handle_fields_t *f) {
  usmipc__wire_t w;
  int r = usmipc__wire_decode(data, len, &w);
  if (r != 0)
    return r;
  memset(f, 0, sizeof(*f));
  f->pid = w.pid;
  f->nonce = w.nonce;
  f->buffer_id = w.buffer_id;
  f->allocation_size = w.allocation_size;
  f->fd_number = w.fd_number;
  f->table_fd_number = w.table_fd_number;
  f->export_slot = w.export_slot;
  return 0;
}

/* ---- helpers --------------------------------------------------------------
 */

#define REQUIRE_HOST()                                                         \
  do {                                                                         \
    if (!test_device_is_host())                                                \
      RETURN_SKIP("the trust tests exercise the host backend's memfd "         \
                  "memory; the device under test is %s",                       \
                  test_device_filter());                                       \
  } while (0)

#define REQUIRE_ROOT(why)                                                      \
  do {                                                                         \
    if (!running_as_root())                                                    \
      RETURN_SKIP("needs root %s", why);                                       \
  } while (0)

/* Raises this test's alarm (and its agents', which get twice the
 * USMIPC_TEST_TIMEOUT they inherit) for the tests that run longer than the
 * runner's default; CTest's TIMEOUT for them is set in CMakeLists.txt. */
static void extend_timeout(unsigned seconds) {
  const char *s = getenv("USMIPC_TEST_TIMEOUT");
  long have = s ? strtol(s, NULL, 10) : 0;
  if (have < (long)seconds) {
    char v[24];
    snprintf(v, sizeof(v), "%u", seconds);
    setenv("USMIPC_TEST_TIMEOUT", v, 1);
  } else {
    seconds = (unsigned)have;
  }
  alarm(seconds);
}

/* Handle bytes from an agent's "ok HEX" reply (or any hex string). */
static size_t hex_bytes(const char *hex, uint8_t *out, size_t cap) {
  ssize_t n = hex_decode(hex, out, cap);
  ASSERT_MSG(n > 0, "bad handle hex: %.80s", hex);
  return (size_t)n;
}

/* The message of an agent's "err CODE NAME message" reply. */
static const char *reply_message(const agent_t *a) {
  const char *s = strchr(a->reply, ' ');
  s = s ? strchr(s + 1, ' ') : NULL;
  return s ? s + 1 : "";
}

/* The NAME of an agent's "err CODE NAME message" reply, in out. */
static void reply_name(const agent_t *a, char *out, size_t cap) {
  const char *s = strchr(a->reply, ' ');
  s = s ? s + 1 : "";
  size_t n = strcspn(s, " ");
  snprintf(out, cap, "%.*s", (int)(n < cap ? n : cap - 1), s);
}

/* Opens in this process, expecting failure; a success is closed again so
 * the failure report stays about the code. */
static int open_here(const uint8_t *b, size_t len) {
  void *p = NULL;
  int r = usmipc_ipc_open(b, len, NULL, 0, &p, NULL);
  if (r == 0)
    usmipc_ipc_close(p);
  return r;
}

/* An exporter agent with a filled, exported allocation in slot 0; the
 * handle's hex is copied to hex. */
static void agent_export(agent_t *ex, size_t n, unsigned seed, char *hex,
                         size_t hex_cap) {
  AGENT_OK(ex, "alloc 0 device %zu", n);
  AGENT_OK(ex, "fill 0 %u", seed);
  AGENT_OK(ex, "export 0 0 0");
  snprintf(hex, hex_cap, "%s", ex->reply);
}

/* Like agent_start, with environment overrides ("NAME=VALUE", or "NAME" to
 * remove it) and an optional wrapper command (an unshare(1) line) that
 * execs the agent: the agent is then `wrapper... EXE --helper agent 0`,
 * and a->pid is the wrapper's pid. The wrapper gets PR_SET_PDEATHSIG, and
 * unshare's --kill-child passes it on, so nothing outlives the test. */
static void agent_spawn(agent_t *a, const char *const env[],
                        const char *const wrapper[]) {
  memset(a, 0, sizeof(*a));
  if (wrapper == NULL) {
    int from;
    a->pid = spawn_helper("agent", NULL, env, &a->to_fd, &from);
    a->from = fdopen(from, "r");
    ASSERT_NOT_NULL(a->from);
    return;
  }
  static char exe[4096];
  ssize_t n = readlink("/proc/self/exe", exe, sizeof(exe) - 1);
  ASSERT(n > 0);
  exe[n] = '\0';
  const char *argv[48];
  int argc = 0;
  for (int i = 0; wrapper[i] != NULL && argc < 40; i++)
    argv[argc++] = wrapper[i];
  argv[argc++] = exe;
  argv[argc++] = "--helper";
  argv[argc++] = "agent";
  argv[argc++] = "0"; /* no parent check: the parent is the wrapper */
  argv[argc] = NULL;
  int in[2], out[2];
  ASSERT_EQ(pipe2(in, O_CLOEXEC), 0);
  ASSERT_EQ(pipe2(out, O_CLOEXEC), 0);
  fflush(stdout);
  fflush(stderr);
  pid_t pid = fork();
  ASSERT(pid >= 0);
  if (pid == 0) {
    for (int i = 0; env != NULL && env[i] != NULL; i++) {
      char name[256];
      const char *eq = strchr(env[i], '=');
      if (eq == NULL) {
        unsetenv(env[i]);
        continue;
      }
      snprintf(name, sizeof(name), "%.*s", (int)(eq - env[i]), env[i]);
      setenv(name, eq + 1, 1);
    }
    dup2(in[0], 0);
    dup2(out[1], 1);
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    execvp(argv[0], (char *const *)argv);
    _exit(127);
  }
  close(in[0]);
  close(out[1]);
  a->pid = pid;
  a->to_fd = in[1];
  a->from = fdopen(out[0], "r");
  ASSERT_NOT_NULL(a->from);
}

/* 1 when `wrapper... true` runs and exits 0 here (unshare permitted). */
static int wrapper_works(const char *const wrapper[]) {
  const char *argv[48];
  int argc = 0;
  for (int i = 0; wrapper[i] != NULL && argc < 46; i++)
    argv[argc++] = wrapper[i];
  argv[argc++] = "true";
  argv[argc] = NULL;
  fflush(stdout);
  fflush(stderr);
  pid_t pid = fork();
  ASSERT(pid >= 0);
  if (pid == 0) {
    int null = open("/dev/null", O_RDWR);
    dup2(null, 1);
    dup2(null, 2);
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    execvp(argv[0], (char *const *)argv);
    _exit(127);
  }
  return exit_code_of(wait_pid_timeout(pid, 20)) == 0;
}

/* agent_call with a deadline. Returns 1 when no reply came within seconds
 * (the agent is then SIGKILLed and reaped, a->pid is 0), else 0 with the
 * agent_call result in *rc. */
static int agent_call_within(agent_t *a, double seconds, int *rc,
                             const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static int agent_call_within(agent_t *a, double seconds, int *rc,
                             const char *fmt, ...) {
  char cmd[8192];
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(cmd, sizeof(cmd) - 1, fmt, ap);
  va_end(ap);
  ASSERT(n > 0 && (size_t)n < sizeof(cmd) - 1);
  cmd[n] = '\n';
  for (int off = 0; off < n + 1;) {
    ssize_t w = write(a->to_fd, cmd + off, (size_t)(n + 1 - off));
    if (w < 0 && errno == EINTR)
      continue;
    ASSERT_MSG(w > 0, "agent %d is gone (write: %s)", (int)a->pid,
               strerror(errno));
    off += (int)w;
  }
  cmd[n] = '\0';
  struct pollfd p = {.fd = fileno(a->from), .events = POLLIN};
  double deadline = now_seconds() + seconds;
  int ready;
  do {
    double left = deadline - now_seconds();
    ready = left > 0 ? poll(&p, 1, (int)(left * 1000) + 1) : 0;
  } while (ready < 0 && errno == EINTR);
  if (ready == 0) {
    agent_kill(a);
    return 1;
  }
  if (fgets(a->reply, sizeof(a->reply), a->from) == NULL) {
    int status = wait_pid_timeout(a->pid, 5);
    test_fail(__FILE__, __LINE__,
              "agent %d died (status %d) without answering \"%s\"", (int)a->pid,
              exit_code_of(status), cmd);
  }
  *rc = agent_parse_reply(a, cmd);
  return 0;
}

/* "topen" on an importer agent: the code, and the open's duration in
 * microseconds as the agent measured it (-1 if the reply has none). */
static int agent_topen(agent_t *a, const char *hex, long long *usec) {
  int rc = agent_call(a, "topen 0 %s 0", hex);
  *usec = -1;
  if (rc == 0) {
    unsigned long long ptr;
    size_t mapped;
    long long us;
    if (sscanf(a->reply, "%llx %zu %lld", &ptr, &mapped, &us) == 3)
      *usec = us;
  } else {
    const char *s = strstr(a->reply, "[after ");
    if (s != NULL)
      *usec = strtoll(s + 7, NULL, 10);
  }
  return rc;
}

/* Waits for a child with a deadline, precisely (a pidfd, where there is
 * one): its wait status, or -1 after killing it at the deadline. */
static int wait_child(pid_t pid, double timeout_s) {
  int pfd = (int)syscall(SYS_pidfd_open, pid, 0);
  if (pfd < 0)
    return wait_pid_timeout(pid, timeout_s);
  struct pollfd p = {.fd = pfd, .events = POLLIN};
  double deadline = now_seconds() + timeout_s;
  int n;
  do {
    double left = deadline - now_seconds();
    n = left > 0 ? poll(&p, 1, (int)(left * 1000) + 1) : 0;
  } while (n < 0 && errno == EINTR);
  close(pfd);
  int status;
  if (n == 0)
    kill(pid, SIGKILL);
  while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  return n == 0 ? -1 : status;
}

/* Reads one line from fd within seconds into out; 0 on success. */
static int read_line_within(int fd, double seconds, char *out, size_t cap) {
  size_t len = 0;
  double deadline = now_seconds() + seconds;
  while (len + 1 < cap) {
    struct pollfd p = {.fd = fd, .events = POLLIN};
    double left = deadline - now_seconds();
    int n = left > 0 ? poll(&p, 1, (int)(left * 1000) + 1) : 0;
    if (n < 0 && errno == EINTR)
      continue;
    if (n <= 0)
      break;
    ssize_t r = read(fd, out + len, 1);
    if (r <= 0)
      break;
    if (out[len] == '\n') {
      out[len] = '\0';
      return 0;
    }
    len++;
  }
  out[len] = '\0';
  return -1;
}

/* ---- sockets as an attacker sees them ------------------------------------ */

typedef char sock_name_t[108];

/* Names (without the '@') of the listening abstract Unix sockets of the
 * broker of process pid: the lines of /proc/net/unix, readable by anyone,
 * whose path starts "@usmipc.<pid>." and whose flags say listening
 * (__SO_ACCEPTCON). Returns how many, at most max. */
static int broker_names(pid_t pid, sock_name_t *names, int max) {
  FILE *f = fopen("/proc/net/unix", "re");
  ASSERT_NOT_NULL(f);
  char line[512], prefix[40];
  snprintf(prefix, sizeof(prefix), "@usmipc.%d.", (int)pid);
  int count = 0;
  while (fgets(line, sizeof(line), f) != NULL && count < max) {
    unsigned flags, type, st;
    unsigned long inode;
    char path[256];
    if (sscanf(line, "%*s %*x %*x %x %x %x %lu %255s", &flags, &type, &st,
               &inode, path) != 5)
      continue;
    size_t n = strlen(path);
    if ((flags & 0x10000) && strncmp(path, prefix, strlen(prefix)) == 0 &&
        n < sizeof(sock_name_t)) {
      memcpy(names[count], path + 1, n); /* with the terminator */
      count++;
    }
  }
  fclose(f);
  return count;
}

static socklen_t abstract_address(const char *name, struct sockaddr_un *addr) {
  memset(addr, 0, sizeof(*addr));
  addr->sun_family = AF_UNIX;
  size_t n = strlen(name);
  memcpy(addr->sun_path + 1, name, n);
  return (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + n);
}

static int drop_to(uid_t uid) {
  if (setgroups(0, NULL) != 0 || setgid(uid) != 0 || setuid(uid) != 0)
    return -1;
  prctl(PR_SET_PDEATHSIG, SIGKILL); /* cleared by the credential change */
  return 0;
}

/* ---- trust_fork_storm ------------------------------------------------------
 * fork() from one thread while another exports fresh buffers (a first
 * export takes the export-table and broker locks, the same locks the atfork
 * handlers take): neither side may deadlock, and every child can use the
 * library: allocate, export, open its own export (an alias), and import a
 * handle of the parent's. */

/* Under AddressSanitizer each fork costs ~20 ms on the 2-core CI machines
 * (a storm of 10,000 took 190-290 s, at its limit): 4,000 under TSan, still
 * millions of exports racing the forks; 2,000 under ASan, whose forks also
 * wait for the worker's iteration (below: 4,000 took 180 s). */
#if defined(__SANITIZE_ADDRESS__)
#define STORM_FORKS 2000
#elif defined(__SANITIZE_THREAD__)
#define STORM_FORKS 4000
#else
#define STORM_FORKS 10000
#endif

/* ASan's allocator takes no lock at fork: a child forked while the worker
 * is inside malloc can inherit a size class's lock held and hang in its
 * first malloc of that class (seen: its broker thread's start). Under ASan
 * the worker therefore holds storm_lock for each iteration and the forks
 * fall between iterations; the plain and TSan builds fork at any moment. */
#if defined(__SANITIZE_ADDRESS__)
#define STORM_FORK_BETWEEN_ITERATIONS 1
#else
#define STORM_FORK_BETWEEN_ITERATIONS 0
#endif
static pthread_mutex_t storm_lock = PTHREAD_MUTEX_INITIALIZER;
#define STORM_STALL_S 20.0

static struct {
  usmipc_device_t *dev;
  uint8_t *parent_handle;
  size_t parent_len, parent_n;
  int stop;
  unsigned long forks, exports;
  int worker_rc;
  int watchdog_started;
  char worker_msg[512];
} storm;

static void *storm_worker(void *arg) {
  (void)arg;
  while (!__atomic_load_n(&storm.stop, __ATOMIC_ACQUIRE)) {
    void *p = NULL;
    usmipc_ipc_handle_t *h = NULL;
    if (STORM_FORK_BETWEEN_ITERATIONS)
      pthread_mutex_lock(&storm_lock);
    int r = usmipc_malloc(storm.dev, USMIPC_MEM_DEVICE, 4096, &p);
    if (r == 0) {
      r = usmipc_ipc_get_handle(p, 0, &h);
      usmipc_ipc_free_handle(h);
      int r2 = usmipc_free(p);
      if (r == 0)
        r = r2;
    }
    if (STORM_FORK_BETWEEN_ITERATIONS)
      pthread_mutex_unlock(&storm_lock);
    if (r != 0) {
      snprintf(storm.worker_msg, sizeof(storm.worker_msg), "%s: %s",
               usmipc_err_name(r), usmipc_last_error());
      __atomic_store_n(&storm.worker_rc, r, __ATOMIC_RELEASE);
      break;
    }
    __atomic_add_fetch(&storm.exports, 1, __ATOMIC_RELAXED);
  }
  return NULL;
}

static void *storm_watchdog(void *arg) {
  (void)arg;
  __atomic_store_n(&storm.watchdog_started, 1, __ATOMIC_RELEASE);
  unsigned long last_f = 0, last_e = 0;
  double f_at = now_seconds(), e_at = f_at;
  while (!__atomic_load_n(&storm.stop, __ATOMIC_ACQUIRE)) {
    sleep_ms(200);
    double now = now_seconds();
    unsigned long f = __atomic_load_n(&storm.forks, __ATOMIC_RELAXED);
    unsigned long e = __atomic_load_n(&storm.exports, __ATOMIC_RELAXED);
    if (f != last_f)
      last_f = f, f_at = now;
    if (e != last_e || __atomic_load_n(&storm.worker_rc, __ATOMIC_ACQUIRE))
      last_e = e, e_at = now;
    if (now - f_at > STORM_STALL_S || now - e_at > STORM_STALL_S)
      test_fail(__FILE__, __LINE__,
                "deadlock in the parent: after %lu forks and %lu exports, "
                "%s made no progress for %.0f s (fork() and the export path "
                "wait on each other's locks)",
                f, e,
                now - f_at > STORM_STALL_S ? "the forking thread"
                                           : "the exporting thread",
                STORM_STALL_S);
  }
  return NULL;
}

static void storm_child_fail(unsigned i, const char *what, int r) {
  char buf[900];
  int n = snprintf(buf, sizeof(buf), "fork child #%u (pid %d): %s: %d %s: %s\n",
                   i, (int)getpid(), what, r, usmipc_err_name(r),
                   r ? usmipc_last_error() : "");
  if (write(2, buf, (size_t)n) < 0) {
    /* nothing more to do */
  }
  _exit(1);
}

static void storm_child(unsigned i) {
  /* Each transport in turn; auto is pidfd_getfd on this machine. */
  static const char *const transports[] = {"auto", "socket", "procfd"};
  setenv("USMIPC_FD_TRANSPORT", transports[i % 3], 1);
  void *q = NULL, *pp = NULL, *alias = NULL;
  usmipc_ipc_handle_t *h = NULL;
  const void *d;
  size_t l, m = 0;
  int r = usmipc_malloc(storm.dev, USMIPC_MEM_DEVICE, 4096, &q);
  if (r != 0)
    storm_child_fail(i, "usmipc_malloc", r);
  pattern_fill(q, 4096, 1000 + i, 0);
  if ((r = usmipc_ipc_get_handle(q, 0, &h)) != 0 ||
      (r = usmipc_ipc_handle_data(h, &d, &l)) != 0)
    storm_child_fail(i, "exporting its own allocation", r);
  r = usmipc_ipc_open(storm.parent_handle, storm.parent_len, NULL, 0, &pp, &m);
  if (r != 0)
    storm_child_fail(i, "opening the parent's handle", r);
  if (m != storm.parent_n || pattern_check(pp, m, 1, 0) != SIZE_MAX)
    storm_child_fail(i, "the parent's bytes differ", 0);
  if ((r = usmipc_ipc_close(pp)) != 0)
    storm_child_fail(i, "closing the parent's mapping", r);
  if ((r = usmipc_ipc_open(d, l, NULL, 0, &alias, NULL)) != 0)
    storm_child_fail(i, "opening its own export", r);
  if (alias != q || pattern_check(alias, 4096, 1000 + i, 0) != SIZE_MAX)
    storm_child_fail(i, "its own export is not an alias of the allocation", 0);
  if ((r = usmipc_ipc_close(alias)) != 0)
    storm_child_fail(i, "closing the alias", r);
  usmipc_ipc_free_handle(h);
  if ((r = usmipc_free(q)) != 0)
    storm_child_fail(i, "usmipc_free", r);
  _exit(0);
}

TEST_IMPL(trust_fork_storm) {
  REQUIRE_HOST();
  extend_timeout(290);
  memset(&storm, 0, sizeof(storm));
  storm.dev = host_device();
  storm.parent_n = 64 * 1024;
  uint8_t *p = NULL;
  ASSERT_OK(
      usmipc_malloc(storm.dev, USMIPC_MEM_DEVICE, storm.parent_n, (void **)&p));
  pattern_fill(p, storm.parent_n, 1, 0);
  usmipc_ipc_handle_t *ph =
      export_copy(p, 0, &storm.parent_handle, &storm.parent_len);

  pthread_t worker, watchdog;
  ASSERT_EQ(pthread_create(&worker, NULL, storm_worker, NULL), 0);
  ASSERT_EQ(pthread_create(&watchdog, NULL, storm_watchdog, NULL), 0);
  /* Both threads running before the first fork: a thread still starting
   * is inside the C runtime's own set-up, and under ASan that set-up
   * allocates (pthread_getattr_np's calloc) with ASan's allocator, which
   * takes no lock at fork: child #0 inherited that size class's lock held
   * and hung in its own broker thread's start (about 1 run in 4 under ASan
   * on the 2-core machines; not the library's locks). */
  while ((__atomic_load_n(&storm.exports, __ATOMIC_RELAXED) == 0 ||
          !__atomic_load_n(&storm.watchdog_started, __ATOMIC_ACQUIRE)) &&
         __atomic_load_n(&storm.worker_rc, __ATOMIC_ACQUIRE) == 0)
    sleep_ms(1);

  double t0 = now_seconds();
  fflush(stdout);
  fflush(stderr);
  for (unsigned i = 0; i < STORM_FORKS; i++) {
    if (STORM_FORK_BETWEEN_ITERATIONS)
      pthread_mutex_lock(&storm_lock);
    pid_t pid = fork();
    if (pid == 0)
      storm_child(i); /* storm_lock is not used here */
    if (STORM_FORK_BETWEEN_ITERATIONS)
      pthread_mutex_unlock(&storm_lock);
    ASSERT_MSG(pid > 0, "fork #%u: %s", i, strerror(errno));
    __atomic_add_fetch(&storm.forks, 1, __ATOMIC_RELAXED);
    int status = wait_child(pid, 10.0);
    ASSERT_MSG(status != -1,
               "deadlock in a fork child: child #%u (pid %d) did not finish "
               "within 10 s (it was killed)",
               i, (int)pid);
    ASSERT_MSG(exit_code_of(status) == 0,
               "fork child #%u (pid %d) failed with status %d (its message "
               "is above)",
               i, (int)pid, exit_code_of(status));
    int wrc = __atomic_load_n(&storm.worker_rc, __ATOMIC_ACQUIRE);
    ASSERT_MSG(wrc == 0, "the exporting thread failed after %u forks: %s", i,
               storm.worker_msg);
  }
  __atomic_store_n(&storm.stop, 1, __ATOMIC_RELEASE);
  pthread_join(worker, NULL);
  pthread_join(watchdog, NULL);
  printf("%d forks and %lu first exports in %.1f s\n", STORM_FORKS,
         storm.exports, now_seconds() - t0);
  ASSERT_MSG(storm.worker_rc == 0, "the exporting thread failed: %s",
             storm.worker_msg);
  free(storm.parent_handle);
  ASSERT_OK(usmipc_ipc_free_handle(ph));
  ASSERT_OK(usmipc_free(p));
  return 0;
}

/* ---- trust_squatter_after_exit / _after_sigkill ----------------------------
 * Once the exporter is gone, anyone (here: nobody, uid 65534) can bind its
 * abstract broker name, read from /proc/net/unix. The squatter answers like
 * a broker with a memfd of the handle's size and then truncates it. The
 * importer must refuse the listener before it sends anything (so the
 * squatter learns no token), and must never map the squatter's file (a
 * truncated mapping is a SIGBUS on first touch). */

typedef struct squatter {
  pid_t pid;
  int stop_w;   /* closing it tells the squatter to report and exit */
  int report_r; /* "R" when listening; "D CONNECTIONS BYTES" at the end */
} squatter_t;

static void squatter_serve(int conn, size_t size, long *bytes) {
  /* Whatever the peer sends, until it closes or is silent for 300 ms. */
  for (;;) {
    char buf[4096];
    struct pollfd c = {.fd = conn, .events = POLLIN};
    if (poll(&c, 1, 300) <= 0)
      break;
    ssize_t n = recv(conn, buf, sizeof(buf), MSG_DONTWAIT);
    if (n <= 0)
      break;
    *bytes += n;
  }
  /* A version-1 broker's "ok" with a descriptor of the handle's size. */
  int mfd = memfd_create("squatter", MFD_CLOEXEC);
  if (mfd < 0 || ftruncate(mfd, (off_t)size) != 0)
    _exit(4);
  uint32_t rep[2] = {0x50524655u, 0};
  struct iovec iov = {.iov_base = rep, .iov_len = sizeof(rep)};
  union {
    struct cmsghdr align;
    char buf[CMSG_SPACE(sizeof(int))];
  } control;
  memset(&control, 0, sizeof(control));
  struct msghdr msg = {.msg_iov = &iov,
                       .msg_iovlen = 1,
                       .msg_control = control.buf,
                       .msg_controllen = sizeof(control.buf)};
  struct cmsghdr *cm = CMSG_FIRSTHDR(&msg);
  cm->cmsg_level = SOL_SOCKET;
  cm->cmsg_type = SCM_RIGHTS;
  cm->cmsg_len = CMSG_LEN(sizeof(int));
  memcpy(CMSG_DATA(cm), &mfd, sizeof(int));
  if (sendmsg(conn, &msg, MSG_NOSIGNAL) < 0) {
    /* the importer hung up: fine */
  }
  if (ftruncate(mfd, 0) != 0)
    _exit(5);
  close(mfd);
}

static void squatter_start(squatter_t *s, const sock_name_t *names, int count,
                           size_t size) {
  int stop[2], report[2];
  ASSERT_EQ(pipe2(stop, O_CLOEXEC), 0);
  ASSERT_EQ(pipe2(report, O_CLOEXEC), 0);
  fflush(stdout);
  fflush(stderr);
  pid_t pid = fork();
  ASSERT(pid >= 0);
  if (pid == 0) {
    close(stop[1]);
    close(report[0]);
    if (drop_to(NOBODY) != 0) {
      dprintf(report[1], "E setuid: %s\n", strerror(errno));
      _exit(2);
    }
    struct pollfd p[5] = {{.fd = stop[0], .events = POLLIN}};
    for (int i = 0; i < count && i < 4; i++) {
      struct sockaddr_un addr;
      socklen_t len = abstract_address(names[i], &addr);
      int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
      int ok = -1;
      /* The name is free once the exporter's socket is closed. */
      for (int tries = 0; tries < 200 && ok != 0; tries++) {
        ok = bind(fd, (struct sockaddr *)&addr, len);
        if (ok != 0 && errno != EADDRINUSE)
          break;
        if (ok != 0)
          sleep_ms(10);
      }
      if (ok != 0 || listen(fd, 16) != 0) {
        dprintf(report[1], "E bind @%s: %s\n", names[i], strerror(errno));
        _exit(3);
      }
      p[i + 1].fd = fd;
      p[i + 1].events = POLLIN;
    }
    dprintf(report[1], "R\n");
    long bytes = 0;
    int conns = 0;
    for (;;) {
      if (poll(p, (nfds_t)(count + 1), -1) < 0) {
        if (errno == EINTR)
          continue;
        break;
      }
      if (p[0].revents)
        break;
      for (int i = 1; i <= count; i++) {
        if (!(p[i].revents & POLLIN))
          continue;
        int conn = accept4(p[i].fd, NULL, NULL, SOCK_CLOEXEC);
        if (conn < 0)
          continue;
        conns++;
        squatter_serve(conn, size, &bytes);
        close(conn);
      }
    }
    dprintf(report[1], "D %d %ld\n", conns, bytes);
    _exit(0);
  }
  close(stop[0]);
  close(report[1]);
  s->pid = pid;
  s->stop_w = stop[1];
  s->report_r = report[0];
  char line[256];
  ASSERT_MSG(read_line_within(s->report_r, 10, line, sizeof(line)) == 0 &&
                 strcmp(line, "R") == 0,
             "the squatter did not start: %s", line);
}

static void squatter_stop(squatter_t *s, int *conns, long *bytes) {
  close(s->stop_w);
  char line[256];
  int ok = read_line_within(s->report_r, 10, line, sizeof(line)) == 0 &&
           sscanf(line, "D %d %ld", conns, bytes) == 2;
  close(s->report_r);
  int status = wait_child(s->pid, 5);
  ASSERT_MSG(ok && exit_code_of(status) == 0,
             "the squatter failed (status %d): %s", exit_code_of(status), line);
}

/* The outcome of an open in a fork child of the test: its code and message,
 * or the signal that ended it (-1: still running after the deadline). */
typedef struct child_open {
  int rc;
  int signal;
  char msg[600];
} child_open_t;

/* Opens the handle in a fork child with USMIPC_FD_TRANSPORT=transport and,
 * if that succeeds, reads every byte of the mapping, so that a mapping of a
 * truncated file shows as a SIGBUS death. */
static void open_in_child(const uint8_t *data, size_t len,
                          const char *transport, double timeout_s,
                          child_open_t *out) {
  int res[2];
  ASSERT_EQ(pipe2(res, O_CLOEXEC), 0);
  fflush(stdout);
  fflush(stderr);
  pid_t pid = fork();
  ASSERT(pid >= 0);
  if (pid == 0) {
    close(res[0]);
    setenv("USMIPC_FD_TRANSPORT", transport, 1);
    void *p = NULL;
    size_t m = 0;
    int r = usmipc_ipc_open(data, len, NULL, 0, &p, &m);
    PROBE_ERR("usmipc_ipc_open(data, len, NULL, 0, &p, &m) in a fork child", r);
    if (r == 0) {
      volatile const uint8_t *b = p;
      unsigned sum = 0;
      for (size_t i = 0; i < m; i += 512)
        sum += b[i];
      (void)sum;
    }
    dprintf(res[1], "%d %s\n", r, r ? usmipc_last_error() : "opened");
    _exit(0);
  }
  close(res[1]);
  char line[700] = "";
  int got = read_line_within(res[0], timeout_s, line, sizeof(line));
  close(res[0]);
  int status = wait_child(pid, got == 0 ? 5 : 2);
  memset(out, 0, sizeof(*out));
  if (status == -1) {
    out->signal = -1;
  } else if (WIFSIGNALED(status)) {
    out->signal = WTERMSIG(status);
  } else {
    char *sp = strchr(line, ' ');
    out->rc = (int)strtol(line, NULL, 10);
    snprintf(out->msg, sizeof(out->msg), "%s", sp ? sp + 1 : line);
  }
}

static int squatter_test(int sigkill) {
  REQUIRE_HOST();
  REQUIRE_ROOT("to run the squatter as another user (nobody)");
  static char hex[HEX_MAX];
  agent_t ex;
  agent_start(&ex, NULL);
  agent_export(&ex, MiB, 201, hex, sizeof(hex));
  uint8_t data[1024];
  size_t len = hex_bytes(hex, data, sizeof(data));
  trust_handle_fields_t f;
  ASSERT_OK(trust_handle_fields(data, len, &f));

  sock_name_t names[4];
  int count = broker_names(ex.pid, names, 4);
  ASSERT_MSG(count >= 1,
             "no listening socket @usmipc.%d.* in /proc/net/unix after an "
             "export",
             (int)ex.pid);
  for (int i = 0; i < count; i++)
    printf("exporter %d listens on @%s\n", (int)ex.pid, names[i]);
  if (sigkill)
    agent_kill(&ex);
  else
    agent_stop_ok(&ex);

  squatter_t sq;
  size_t size = (f.allocation_size + 4095) & ~(size_t)4095;
  squatter_start(&sq, names, count, size);

  static const char *const transports[] = {"socket", "auto"};
  child_open_t res[2];
  for (int t = 0; t < 2; t++)
    open_in_child(data, len, transports[t], 20, &res[t]);
  int conns = 0;
  long bytes = 0;
  squatter_stop(&sq, &conns, &bytes);

  for (int t = 0; t < 2; t++) {
    if (res[t].signal)
      printf("importer (%s): killed by signal %d (%s)\n", transports[t],
             res[t].signal,
             res[t].signal > 0 ? strsignal(res[t].signal) : "hung");
    else
      printf("importer (%s): %d %s: %s\n", transports[t], res[t].rc,
             usmipc_err_name(res[t].rc), res[t].msg);
  }
  printf("squatter: %d connections, %ld bytes received\n", conns, bytes);
  for (int t = 0; t < 2; t++) {
    ASSERT_MSG(res[t].signal == 0,
               "importer (%s) died of signal %d: it mapped the squatter's "
               "truncated file (SIGBUS=%d) or hung (-1)",
               transports[t], res[t].signal, SIGBUS);
    ASSERT_MSG(res[t].rc == USMIPC_EEXPORTERGONE ||
                   res[t].rc == USMIPC_EUNTRUSTED || res[t].rc == USMIPC_EACCES,
               "importer (%s): %s (%d), expected EEXPORTERGONE, EUNTRUSTED "
               "or EACCES: %s",
               transports[t], usmipc_err_name(res[t].rc), res[t].rc,
               res[t].msg);
  }
  ASSERT_MSG(bytes == 0,
             "the squatter received %ld bytes (the request, with the "
             "handle's capability token): the importer must check who "
             "listens before it sends anything",
             bytes);
  return 0;
}

TEST_IMPL(trust_squatter_after_exit) { return squatter_test(0); }
TEST_IMPL(trust_squatter_after_sigkill) { return squatter_test(1); }

/* ---- trust_other_uid_exporter ----------------------------------------------
 * Policy: IPC only between processes of one uid, root included. Root can
 * take another user's descriptors (pidfd_getfd, /proc), but must not. */

TEST_IMPL(trust_other_uid_exporter) {
  REQUIRE_HOST();
  REQUIRE_ROOT("to run the exporter as another user (nobody)");
  static char hex[HEX_MAX];
  static const char *const transports[] = {"auto", "socket", "pidfd", "procfd"};
  agent_t ex;
  agent_start(&ex, NULL);
  AGENT_OK(&ex, "setuid %d", NOBODY);
  agent_export(&ex, MiB, 301, hex, sizeof(hex));
  int wrong = 0;
  for (int t = 0; t < 4; t++) {
    agent_t im;
    agent_start(&im, transports[t]);
    int r = agent_call(&im, "open 0 %s 0", hex);
    if (r == 0) {
      printf("%s: root OPENED uid %d's memory\n", transports[t], NOBODY);
      AGENT_OK(&im, "close 0");
    } else {
      printf("%s: %s\n", transports[t], im.reply);
    }
    if (r != USMIPC_EACCES || (r != 0 && reply_message(&im)[0] == '\0'))
      wrong++;
    agent_stop_ok(&im);
  }
  agent_stop_ok(&ex);
  ASSERT_MSG(wrong == 0,
             "%d of 4 transports did not refuse another user's exporter "
             "with USMIPC_EACCES (above)",
             wrong);
  return 0;
}

/* ---- trust_broker_stall ----------------------------------------------------
 * Connections that send nothing, from another user and from the same one,
 * must not hold up an importer: the broker serves it at once. */

#define STALLERS 10

static void stall_phase(const char *hex, const char *name, uid_t uid, int *rc,
                        long long *usec, char *msg, size_t msg_cap) {
  int ready[2], hold[2];
  ASSERT_EQ(pipe2(ready, O_CLOEXEC), 0);
  ASSERT_EQ(pipe2(hold, O_CLOEXEC), 0);
  pid_t pids[STALLERS];
  fflush(stdout);
  fflush(stderr);
  for (int i = 0; i < STALLERS; i++) {
    pids[i] = fork();
    ASSERT(pids[i] >= 0);
    if (pids[i] == 0) {
      close(hold[1]);
      close(ready[0]);
      if (uid != 0 && drop_to(uid) != 0)
        _exit(2);
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      struct sockaddr_un addr;
      socklen_t len = abstract_address(name, &addr);
      int s = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
      char c = connect(s, (struct sockaddr *)&addr, len) == 0 ? 'c' : 'x';
      if (write(ready[1], &c, 1) != 1)
        _exit(3);
      while (read(hold[0], &c, 1) > 0) { /* idle until the test hangs up */
      }
      _exit(0);
    }
  }
  close(ready[1]);
  close(hold[0]);
  for (int i = 0; i < STALLERS; i++) {
    struct pollfd p = {.fd = ready[0], .events = POLLIN};
    char c = 0;
    ASSERT_MSG(poll(&p, 1, 10000) == 1 && read(ready[0], &c, 1) == 1,
               "idle client %d did not report", i);
    ASSERT_MSG(c == 'c', "idle client %d (uid %d) could not connect to @%s", i,
               (int)uid, name);
  }
  close(ready[0]);

  agent_t im;
  agent_start(&im, "socket");
  /* Probe the devices first (on a GPU machine the first call of a process
   * loads the drivers, tens of milliseconds): only the open is timed. */
  AGENT_OK(&im, "alloc 9 host 4096");
  *rc = agent_topen(&im, hex, usec);
  snprintf(msg, msg_cap, "%.900s", *rc ? im.reply : "opened");
  if (*rc == 0)
    AGENT_OK(&im, "check 0 401");
  agent_stop_ok(&im);

  close(hold[1]);
  for (int i = 0; i < STALLERS; i++)
    ASSERT_NE(wait_child(pids[i], 5), -1);
}

TEST_IMPL(trust_broker_stall) {
  REQUIRE_HOST();
  REQUIRE_ROOT("to run idle clients as another user (nobody)");
  static char hex[HEX_MAX];
  agent_t ex;
  agent_start(&ex, NULL);
  agent_export(&ex, MiB, 401, hex, sizeof(hex));
  sock_name_t names[4];
  ASSERT_MSG(broker_names(ex.pid, names, 4) >= 1,
             "no listening socket @usmipc.%d.* in /proc/net/unix", (int)ex.pid);

  static const uid_t uids[2] = {NOBODY, 0};
  int rc[2];
  long long usec[2];
  char msg[2][1024];
  for (int ph = 0; ph < 2; ph++) {
    stall_phase(hex, names[0], uids[ph], &rc[ph], &usec[ph], msg[ph],
                sizeof(msg[ph]));
    printf("%d idle connections of uid %d: the open took %lld us: %s\n",
           STALLERS, (int)uids[ph], usec[ph], msg[ph]);
  }
  agent_stop_ok(&ex);
  for (int ph = 0; ph < 2; ph++) {
    ASSERT_MSG(rc[ph] == 0,
               "with %d idle connections of uid %d the open "
               "failed: %s",
               STALLERS, (int)uids[ph], msg[ph]);
    ASSERT_MSG(usec[ph] >= 0 && usec[ph] < 50000,
               "with %d idle connections of uid %d the open took %lld us "
               "(limit 50 ms)",
               STALLERS, (int)uids[ph], usec[ph]);
  }
  return 0;
}

/* ---- trust_signal_deadline / trust_interrupt_handler -----------------------
 * The exporter is stopped (SIGSTOP): its socket still accepts connections,
 * but nobody answers. One deadline bounds the open whatever signals arrive;
 * an interrupt handler can abandon it. */

static volatile sig_atomic_t usr1_seen;
static void on_usr1(int sig) {
  (void)sig;
  usr1_seen = 1;
}

static int usr1_interrupts(void *arg) {
  (void)arg;
  return usr1_seen != 0;
}

static struct {
  pthread_t target;
  int periodic; /* every 100 ms, else once after 300 ms */
  int done;
  double sent_at; /* of the single signal */
  int sent;
} sig_plan;

static void *signal_thread(void *arg) {
  (void)arg;
  double start = now_seconds();
  if (!sig_plan.periodic) {
    sleep_ms(300);
    if (!__atomic_load_n(&sig_plan.done, __ATOMIC_ACQUIRE)) {
      sig_plan.sent_at = now_seconds();
      pthread_kill(sig_plan.target, SIGUSR1);
      sig_plan.sent = 1;
    }
    return NULL;
  }
  /* At most 8 s of signals, so a library that restarts its wait after each
   * one still returns, and the test reports how late. */
  while (!__atomic_load_n(&sig_plan.done, __ATOMIC_ACQUIRE) &&
         now_seconds() - start < 8.0) {
    sleep_ms(100);
    if (!__atomic_load_n(&sig_plan.done, __ATOMIC_ACQUIRE)) {
      pthread_kill(sig_plan.target, SIGUSR1);
      sig_plan.sent++;
    }
  }
  return NULL;
}

/* Exports from an agent, stops it, and opens the handle here over the
 * socket while signal_thread runs; returns the code, *elapsed the open's
 * duration. */
static int open_stopped_exporter(int periodic, double *elapsed,
                                 double *signal_to_return) {
  static char hex[HEX_MAX];
  agent_t ex;
  agent_start(&ex, NULL);
  agent_export(&ex, MiB, 501, hex, sizeof(hex));
  uint8_t data[1024];
  size_t len = hex_bytes(hex, data, sizeof(data));
  ASSERT_EQ(kill(ex.pid, SIGSTOP), 0);
  int status;
  ASSERT_EQ(waitpid(ex.pid, &status, WUNTRACED), ex.pid);
  ASSERT(WIFSTOPPED(status));

  setenv("USMIPC_FD_TRANSPORT", "socket", 1);
  struct sigaction sa;
  memset(&sa, 0, sizeof(sa));
  sa.sa_handler = on_usr1; /* no SA_RESTART */
  sigemptyset(&sa.sa_mask);
  ASSERT_EQ(sigaction(SIGUSR1, &sa, NULL), 0);
  usr1_seen = 0;
  memset(&sig_plan, 0, sizeof(sig_plan));
  sig_plan.target = pthread_self();
  sig_plan.periodic = periodic;
  pthread_t th;
  ASSERT_EQ(pthread_create(&th, NULL, signal_thread, NULL), 0);
  test_error_sentinel();
  void *p = NULL;
  double t0 = now_seconds();
  int r = usmipc_ipc_open(data, len, NULL, 0, &p, NULL);
  double t1 = now_seconds();
  __atomic_store_n(&sig_plan.done, 1, __ATOMIC_RELEASE);
  pthread_join(th, NULL);
  *elapsed = t1 - t0;
  *signal_to_return = sig_plan.sent_at > 0 ? t1 - sig_plan.sent_at : -1;
  printf("open: %s after %.3f s (%d signals): %s\n", usmipc_err_name(r),
         *elapsed, sig_plan.sent, r ? usmipc_last_error() : "");
  if (r == 0)
    usmipc_ipc_close(p);
  else
    test_check_error(__FILE__, __LINE__, "usmipc_ipc_open", r, r, r, r);
  kill(ex.pid, SIGCONT);
  agent_kill(&ex);
  return r;
}

TEST_IMPL(trust_signal_deadline) {
  REQUIRE_HOST();
  ASSERT_OK(usmipc_ipc_set_timeout(1000));
  double elapsed, unused;
  int r = open_stopped_exporter(1, &elapsed, &unused);
  ASSERT_MSG(r == USMIPC_ETIMEDOUT,
             "an open of a stopped exporter's handle under SIGUSR1 every "
             "100 ms returned %s after %.3f s; expected USMIPC_ETIMEDOUT",
             usmipc_err_name(r), elapsed);
  ASSERT_MSG(elapsed >= 0.9 && elapsed <= 2.0,
             "ETIMEDOUT after %.3f s with a 1000 ms timeout (allowed "
             "0.9-2.0 s)",
             elapsed);
  return 0;
}

TEST_IMPL(trust_interrupt_handler) {
  REQUIRE_HOST();
  ASSERT_OK(usmipc_ipc_set_timeout(4000));
  usmipc_set_interrupt_handler(usr1_interrupts, NULL);
  double elapsed, after_signal;
  int r = open_stopped_exporter(0, &elapsed, &after_signal);
  usmipc_set_interrupt_handler(NULL, NULL);
  ASSERT_MSG(r == USMIPC_EINTR,
             "the interrupt handler said stop 300 ms into the open, which "
             "returned %s after %.3f s; expected USMIPC_EINTR",
             usmipc_err_name(r), elapsed);
  ASSERT_MSG(after_signal >= 0 && after_signal < 0.150,
             "EINTR came %.3f s after the signal (limit 150 ms)", after_signal);
  return 0;
}

/* ---- stale cache hits ------------------------------------------------------
 * A cached mapping (idle, or still open) of an allocation its exporter has
 * freed, or whose exporter is gone, must not satisfy a new open: a new
 * open of a dead allocation fails the same way with and without a cache. */

static int reopen_after(int how) { /* 0: free, 1: SIGKILL, 2: free, kept */
  REQUIRE_HOST();
  static char hex[HEX_MAX];
  const size_t n = MiB;
  agent_t ex;
  agent_start(&ex, NULL);
  agent_export(&ex, n, 601, hex, sizeof(hex));
  uint8_t data[1024];
  size_t len = hex_bytes(hex, data, sizeof(data));
  void *p = NULL;
  ASSERT_OK(usmipc_ipc_open(data, len, NULL, 0, &p, NULL));
  ASSERT_PATTERN(p, n, 601, 0);
  if (how != 2)
    ASSERT_OK(usmipc_ipc_close(p)); /* idle in the cache */
  if (how == 1)
    agent_kill(&ex);
  else
    AGENT_OK(&ex, "free 0");
  ASSERT_ERR(open_here(data, len), USMIPC_EEXPORTERGONE);
  if (how == 2) {
    ASSERT_PATTERN(p, n, 601, 0); /* the first mapping lives on */
    ASSERT_OK(usmipc_ipc_close(p));
  }
  if (how != 1)
    agent_stop_ok(&ex);
  return 0;
}

TEST_IMPL(trust_cache_reopen_after_free) { return reopen_after(0); }
TEST_IMPL(trust_cache_reopen_after_sigkill) { return reopen_after(1); }
TEST_IMPL(trust_open_again_while_mapped_after_free) { return reopen_after(2); }

/* ---- trust_procfd_fifo / _data ---------------------------------------------
 * The descriptor number a handle names is the exporter's to reuse; what is
 * there may be a FIFO. Reopening it through /proc must neither block (an
 * O_RDONLY open of a FIFO without a writer waits for one forever) nor map
 * it. The exporter holds the FIFO O_RDONLY (no writer: a blocking open
 * would wait) and, in a second round, O_RDWR. */

static int procfd_fifo(const char *which) {
  REQUIRE_HOST();
  static const char *const modes[] = {"rd", "rdwr"};
  static char hex[HEX_MAX];
  int wrong = 0;
  for (int m = 0; m < 2; m++) {
    agent_t ex, im;
    agent_start(&ex, NULL);
    agent_export(&ex, 64 * 1024, 701, hex, sizeof(hex));
    AGENT_OK(&ex, "fifo 0 %s %s", which, modes[m]);
    agent_start(&im, "procfd");
    int rc = 0;
    double t0 = now_seconds();
    if (agent_call_within(&im, 5.0, &rc, "topen 0 %s 0", hex)) {
      printf("%s descriptor a FIFO (%s): the open blocked for %.1f s (the "
             "importer was killed)\n",
             which, modes[m], now_seconds() - t0);
      wrong++;
    } else {
      const char *s = strstr(im.reply, "[after ");
      long long usec = s ? strtoll(s + 7, NULL, 10) : -1;
      if (rc == 0) {
        unsigned long long ptr;
        size_t mapped;
        if (sscanf(im.reply, "%llx %zu %lld", &ptr, &mapped, &usec) != 3)
          usec = -1;
      }
      printf("%s descriptor a FIFO (%s): %s after %lld us: %s\n", which,
             modes[m], rc ? "refused" : "OPENED", usec,
             rc ? im.reply : "the FIFO was accepted");
      if (rc == 0 || usec < 0 || usec > 2000000)
        wrong++;
      agent_stop_ok(&im);
    }
    agent_kill(&ex);
  }
  ASSERT_MSG(wrong == 0,
             "%d of 2 opens through /proc of a FIFO in place of the %s "
             "descriptor did not fail within 2 s (above)",
             wrong, which);
  return 0;
}

TEST_IMPL(trust_procfd_fifo) { return procfd_fifo("table"); }
TEST_IMPL(trust_procfd_fifo_data) { return procfd_fifo("data"); }

/* ---- namespaces ------------------------------------------------------------
 * An importer that cannot reach the exporter because it is in another
 * network or PID namespace is told so (USMIPC_ENAMESPACE), not that the
 * exporter is gone. With USMIPC_SOCKET_DIR, a directory both sides see,
 * the exporter also listens on a socket file there, and a containerised
 * importer (other PID, network, user and mount namespaces, another
 * /etc/machine-id) opens the memory. */

static const char *const no_socket_dir[] = {"USMIPC_FD_TRANSPORT",
                                            "USMIPC_SOCKET_DIR", NULL};

TEST_IMPL(trust_netns_message) {
  REQUIRE_HOST();
  static char hex[HEX_MAX];
  agent_t ex, im;
  agent_spawn(&ex, no_socket_dir, NULL);
  agent_export(&ex, MiB, 801, hex, sizeof(hex));
  agent_start(&im, "socket");
  int r = agent_call(&im, "unshare net");
  if (r != 0) {
    agent_stop(&im);
    agent_stop(&ex);
    RETURN_SKIP("unshare(CLONE_NEWNET) is not permitted here: %s", im.reply);
  }
  r = agent_call(&im, "open 0 %s 0", hex);
  printf("importer in another network namespace: %s\n",
         r ? im.reply : "opened");
  ASSERT_MSG(r == USMIPC_ENAMESPACE, "expected USMIPC_ENAMESPACE, got %d: %s",
             r, r ? im.reply : "opened");
  ASSERT_MSG(strcasestr(reply_message(&im), "network namespace") != NULL,
             "the message does not say \"network namespace\": %s", im.reply);
  agent_stop_ok(&im);
  agent_stop_ok(&ex);
  return 0;
}

TEST_IMPL(trust_pidns_message) {
  /* An importer in another PID namespace but the same network namespace
   * (a container started with --network=host) reaches the exporter's
   * abstract socket: the open works, the pidfd and /proc paths are not
   * tried (a pid of another namespace names nothing here), and forcing
   * them says why. In other PID and network namespaces without
   * USMIPC_SOCKET_DIR the importer is told which namespaces differ. */
  REQUIRE_HOST();
  static const char *const pidns[] = {"unshare",      "-p",           "-f",
                                      "--mount-proc", "--kill-child", NULL};
  static const char *const pidnetns[] = {
      "unshare", "-p", "-n", "-f", "--mount-proc", "--kill-child", NULL};
  if (!wrapper_works(pidns) || !wrapper_works(pidnetns))
    RETURN_SKIP("`unshare -p -n -f --mount-proc` is not permitted here");
  static char hex[HEX_MAX];
  agent_t ex, im;
  agent_spawn(&ex, no_socket_dir, NULL);
  agent_export(&ex, MiB, 811, hex, sizeof(hex));

  agent_spawn(&im, no_socket_dir, pidns); /* auto, no socket directory */
  AGENT_OK(&im, "open 0 %s 0", hex);
  AGENT_OK(&im, "check 0 811");
  AGENT_OK(&im, "close 0");
  agent_stop_ok(&im);

  static const char *const pidfd_env[] = {"USMIPC_FD_TRANSPORT=pidfd",
                                          "USMIPC_SOCKET_DIR=", NULL};
  agent_spawn(&im, pidfd_env, pidns);
  int r = agent_call(&im, "open 0 %s 0", hex);
  ASSERT_MSG(r == USMIPC_ENAMESPACE, "expected USMIPC_ENAMESPACE, got %d: %s",
             r, r ? im.reply : "opened");
  ASSERT_MSG(strcasestr(reply_message(&im), "PID namespace") != NULL,
             "the message does not say \"PID namespace\": %s", im.reply);
  agent_stop_ok(&im);

  agent_spawn(&im, no_socket_dir, pidnetns);
  r = agent_call(&im, "open 0 %s 0", hex);
  printf("importer in other PID and network namespaces: %s\n",
         r ? im.reply : "opened");
  ASSERT_MSG(r == USMIPC_ENAMESPACE, "expected USMIPC_ENAMESPACE, got %d: %s",
             r, r ? im.reply : "opened");
  ASSERT_MSG(strcasestr(reply_message(&im), "PID namespace") != NULL &&
                 strcasestr(reply_message(&im), "network namespace") != NULL,
             "the message does not name both namespaces: %s", im.reply);
  agent_stop_ok(&im);
  agent_stop_ok(&ex);
  return 0;
}

/* A killed exporter leaves its socket file in USMIPC_SOCKET_DIR; the next
 * exporter of the same user that starts a broker there removes it, and
 * keeps the files of exporters that still listen. */
static void remove_dir(const char *dir);

static int count_sockets(const char *dir, const char *needle) {
  DIR *d = opendir(dir);
  ASSERT_NOT_NULL(d);
  int n = 0;
  struct dirent *e;
  while ((e = readdir(d)) != NULL)
    if (strstr(e->d_name, ".sock") && (!needle || strstr(e->d_name, needle)))
      n++;
  closedir(d);
  return n;
}

TEST_IMPL(trust_socket_dir_stale_files) {
  REQUIRE_HOST();
  static char dir[] = "/tmp/usmipc-stale-XXXXXX";
  ASSERT_NOT_NULL(mkdtemp(dir));
  static char env_dir[256];
  snprintf(env_dir, sizeof(env_dir), "USMIPC_SOCKET_DIR=%s", dir);
  const char *const env[] = {env_dir, NULL};
  static char hex[HEX_MAX];
  agent_t a, b, c;
  agent_spawn(&a, env, NULL);
  agent_spawn(&b, env, NULL);
  agent_export(&a, MiB, 1, hex, sizeof(hex));
  agent_export(&b, MiB, 2, hex, sizeof(hex));
  char pid_a[32], pid_b[32];
  snprintf(pid_a, sizeof(pid_a), "usmipc.%d.", (int)a.pid);
  snprintf(pid_b, sizeof(pid_b), "usmipc.%d.", (int)b.pid);
  ASSERT_EQ(count_sockets(dir, pid_a), 1);
  ASSERT_EQ(count_sockets(dir, pid_b), 1);
  agent_kill(&a); /* no atexit: the file stays */
  ASSERT_EQ(count_sockets(dir, pid_a), 1);
  agent_spawn(&c, env, NULL);
  agent_export(&c, MiB, 3, hex, sizeof(hex));
  ASSERT_EQ(count_sockets(dir, pid_a), 0); /* stale: removed */
  ASSERT_EQ(count_sockets(dir, pid_b), 1); /* alive: kept */
  agent_stop_ok(&b); /* a normal exit removes its own file */
  ASSERT_EQ(count_sockets(dir, pid_b), 0);
  /* c's own file, and c still serves through it. */
  ASSERT_EQ(count_sockets(dir, NULL), 1);
  agent_stop_ok(&c);
  ASSERT_EQ(count_sockets(dir, NULL), 0);
  remove_dir(dir);
  return 0;
}

/* ---- USMIPC_SOCKET_DIR: who may write the directory ------------------------
 * A root exporter binds its socket file in USMIPC_SOCKET_DIR. A user who can
 * write that directory could swap the file for a symlink between bind and
 * any later call that names it by path, and make root change the file the
 * link points to (trust_socket_dir_symlink_swap, the window widened with
 * usmipc__test_socket_bind_delay_ms), squat the name first
 * (trust_socket_dir_squatted_name), or plant links for the stale-file sweep.
 * The library refuses such a directory (ssh's StrictModes rule: owned by
 * this uid or root, writable by nobody else unless sticky) and names no file
 * by path there (trust_socket_dir_modes); /dev/shm, /tmp, a directory of
 * one's own and, inside a user namespace, /dev/shm owned by the overflow uid
 * keep working (trust_socket_dir_userns_overflow). */

/* An exporter agent with USMIPC_SOCKET_DIR=dir (and the environment's
 * transport) exports; returns the export's code, the agent's reply in
 * reply and, when it exported, the mode of its socket file (else 0). */
static int socket_dir_export(const char *dir, char *reply, size_t cap,
                             unsigned *sock_mode, const char *const wrapper[]) {
  char setting[300];
  snprintf(setting, sizeof(setting), "USMIPC_SOCKET_DIR=%s", dir);
  const char *const env[] = {setting, NULL};
  agent_t ex;
  agent_spawn(&ex, env, wrapper);
  AGENT_OK(&ex, "alloc 0 device 4096");
  int r = agent_call(&ex, "export 0 0 0");
  snprintf(reply, cap, "%.1000s", ex.reply);
  *sock_mode = 0;
  if (r == 0 && wrapper == NULL) {
    char prefix[48];
    snprintf(prefix, sizeof(prefix), "usmipc.%d.", (int)ex.pid);
    DIR *d = opendir(dir);
    ASSERT_NOT_NULL(d);
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
      struct stat st;
      if (strncmp(e->d_name, prefix, strlen(prefix)) == 0 &&
          fstatat(dirfd(d), e->d_name, &st, AT_SYMLINK_NOFOLLOW) == 0 &&
          S_ISSOCK(st.st_mode))
        *sock_mode = st.st_mode & 07777;
    }
    closedir(d);
  }
  agent_stop_ok(&ex);
  return r;
}

TEST_IMPL(trust_socket_dir_modes) {
  REQUIRE_HOST();
  REQUIRE_ROOT("to give the socket directory to another uid (chown)");
  static const struct {
    mode_t mode;
    uid_t owner;
    const char *words; /* what the refusal names */
  } refused[] = {
      {0777, 0, "writable by others"},
      {0770, 0, "writable by its group"},
      {0755, NOBODY, "owned by uid 65534"},
      {01777, NOBODY, "owned by uid 65534"},
  };
  char reply[1024];
  unsigned mode;
  for (size_t i = 0; i < sizeof(refused) / sizeof(refused[0]); i++) {
    char dir[] = "/tmp/usmipc-mode-XXXXXX";
    ASSERT_NOT_NULL(mkdtemp(dir));
    ASSERT_EQ(chown(dir, refused[i].owner, refused[i].owner), 0);
    ASSERT_EQ(chmod(dir, refused[i].mode), 0);
    int r = socket_dir_export(dir, reply, sizeof(reply), &mode, NULL);
    int files = count_sockets(dir, NULL);
    remove_dir(dir);
    printf("directory %04o of uid %u: %s\n", (unsigned)refused[i].mode,
           (unsigned)refused[i].owner, r ? reply : "exported");
    ASSERT_MSG(r == USMIPC_EACCES,
               "a socket directory %04o of uid %u was used (expected "
               "USMIPC_EACCES, got %d: %s)",
               (unsigned)refused[i].mode, (unsigned)refused[i].owner, r, reply);
    ASSERT_MSG(strstr(reply, refused[i].words) != NULL &&
                   strstr(reply, "USMIPC_SOCKET_DIR") != NULL,
               "the refusal does not say \"%s\" and name USMIPC_SOCKET_DIR: %s",
               refused[i].words, reply);
    ASSERT_EQ(files, 0);
  }
  /* A symbolic link as the directory: its target is not what was checked. */
  char dir[] = "/tmp/usmipc-mode-XXXXXX";
  ASSERT_NOT_NULL(mkdtemp(dir));
  char link_path[64];
  snprintf(link_path, sizeof(link_path), "%s.link", dir);
  ASSERT_EQ(symlink(dir, link_path), 0);
  int r = socket_dir_export(link_path, reply, sizeof(reply), &mode, NULL);
  unlink(link_path);
  printf("a symbolic link as the directory: %s\n", r ? reply : "exported");
  ASSERT_MSG(r == USMIPC_EACCES && strstr(reply, "symbolic link") != NULL,
             "a symbolic link as USMIPC_SOCKET_DIR: expected USMIPC_EACCES "
             "saying \"symbolic link\", got %d: %s",
             r, reply);
  /* What keeps working: the socket file is 0600 in each. */
  const char *const fine[] = {"/dev/shm", "/tmp", dir};
  for (size_t i = 0; i < sizeof(fine) / sizeof(fine[0]); i++) {
    r = socket_dir_export(fine[i], reply, sizeof(reply), &mode, NULL);
    printf("%s: %s, socket file %04o\n", fine[i], r ? reply : "exported", mode);
    ASSERT_MSG(r == 0, "exporting with USMIPC_SOCKET_DIR=%s failed: %s",
               fine[i], reply);
    ASSERT_MSG(mode == 0600, "the socket file in %s has mode %04o, not 0600",
               fine[i], mode);
  }
  ASSERT_EQ(count_sockets(dir, NULL), 0); /* the exit removed it */
  remove_dir(dir);
  return 0;
}

TEST_IMPL(trust_socket_dir_userns_overflow) {
  /* An unprivileged user's container (unshare -U --map-root-user): root's
   * /dev/shm shows as the overflow uid's, sticky; it counts as root's. */
  REQUIRE_HOST();
  REQUIRE_ROOT("to run the container as another user (setpriv)");
  static const char *const wrapper[] = {"setpriv",         "--reuid=65534",
                                        "--regid=65534",   "--clear-groups",
                                        "unshare",         "-U",
                                        "--map-root-user", NULL};
  if (!wrapper_works(wrapper))
    RETURN_SKIP("`setpriv ... unshare -U --map-root-user` is not permitted "
                "here");
  char reply[1024];
  unsigned mode;
  int r = socket_dir_export("/dev/shm", reply, sizeof(reply), &mode, wrapper);
  printf("in a user namespace of uid %d, USMIPC_SOCKET_DIR=/dev/shm: %s\n",
         NOBODY, r ? reply : "exported");
  ASSERT_MSG(r == 0, "the export failed: %s", reply);
  return 0;
}

/* A socket bound at path and closed: a stale socket file (connect refused).
 * As uid when uid != 0, in a child. */
static void stale_socket_as(const char *path, uid_t uid) {
  fflush(stdout);
  pid_t pid = fork();
  ASSERT(pid >= 0);
  if (pid == 0) {
    if (uid != 0 && drop_to(uid) != 0)
      _exit(2);
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    snprintf(addr.sun_path, sizeof(addr.sun_path), "%s", path);
    int s = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    _exit(s >= 0 && bind(s, (struct sockaddr *)&addr, sizeof(addr)) == 0 ? 0
                                                                         : 3);
  }
  ASSERT_EQ(exit_code_of(wait_pid_timeout(pid, 10)), 0);
}

TEST_IMPL(trust_socket_dir_sweep_links) {
  /* The stale-file sweep of a root exporter in a sticky directory removes
   * root's dead sockets only: not another user's, not a link another user
   * planted there, nor what the link points to. */
  REQUIRE_HOST();
  REQUIRE_ROOT("to plant files as another user (setuid)");
  static char dir[] = "/tmp/usmipc-sweep-XXXXXX";
  static char away[] = "/tmp/usmipc-away-XXXXXX";
  ASSERT_NOT_NULL(mkdtemp(dir));
  ASSERT_NOT_NULL(mkdtemp(away));
  ASSERT_EQ(chmod(dir, 01777), 0);
  char theirs[128], victim[128], link_path[128], mine[128];
  snprintf(theirs, sizeof(theirs), "%s/usmipc.1.0000000000000001.sock", dir);
  snprintf(victim, sizeof(victim), "%s/usmipc.2.0000000000000002.sock", away);
  snprintf(link_path, sizeof(link_path), "%s/usmipc.3.0000000000000003.sock",
           dir);
  snprintf(mine, sizeof(mine), "%s/usmipc.4.0000000000000004.sock", dir);
  stale_socket_as(theirs, NOBODY);
  stale_socket_as(victim, 0);
  stale_socket_as(mine, 0);
  fflush(stdout);
  pid_t planter = fork();
  ASSERT(planter >= 0);
  if (planter == 0)
    _exit(drop_to(NOBODY) == 0 && symlink(victim, link_path) == 0 ? 0 : 2);
  ASSERT_EQ(exit_code_of(wait_pid_timeout(planter, 10)), 0);
  char reply[1024];
  unsigned mode;
  int r = socket_dir_export(dir, reply, sizeof(reply), &mode, NULL);
  struct stat st;
  int theirs_kept = lstat(theirs, &st) == 0 && S_ISSOCK(st.st_mode);
  int link_kept = lstat(link_path, &st) == 0 && S_ISLNK(st.st_mode);
  int victim_kept = lstat(victim, &st) == 0 && S_ISSOCK(st.st_mode);
  int mine_gone = lstat(mine, &st) != 0;
  remove_dir(dir);
  remove_dir(away);
  ASSERT_MSG(r == 0, "the export failed: %s", reply);
  ASSERT_MSG(theirs_kept, "the sweep removed uid %d's socket file", NOBODY);
  ASSERT_MSG(link_kept, "the sweep removed uid %d's link", NOBODY);
  ASSERT_MSG(victim_kept, "the sweep removed the socket a link points to");
  ASSERT_MSG(mine_gone, "the sweep kept root's own stale socket file");
  return 0;
}

/* The attacker: uid 65534, owner of dir, swaps every socket file created
 * there for a symlink to target as soon as it appears. */
static void swap_in_symlinks(const char *dir, const char *target, int ready) {
  if (drop_to(NOBODY) != 0)
    _exit(2);
  int in = inotify_init1(IN_CLOEXEC);
  if (in < 0 || inotify_add_watch(in, dir, IN_CREATE) < 0)
    _exit(3);
  if (write(ready, "r", 1) != 1)
    _exit(4);
  for (;;) {
    char buf[4096] __attribute__((aligned(8)));
    ssize_t n = read(in, buf, sizeof(buf));
    if (n <= 0)
      _exit(5);
    for (char *p = buf; p < buf + n;) {
      struct inotify_event *ev = (struct inotify_event *)p;
      p += sizeof(*ev) + ev->len;
      if (ev->len == 0 || strncmp(ev->name, "usmipc.", 7) != 0)
        continue;
      char path[512];
      snprintf(path, sizeof(path), "%s/%s", dir, ev->name);
      if (unlink(path) == 0 && symlink(target, path) == 0)
        _exit(0);
    }
  }
}

/* sticky 0: the directory is uid 65534's own (refused now; before, root
 * chmod()ed the link's target). sticky 1: root's, 1777, as /tmp: used, and
 * the attacker cannot replace root's file there. */
static int symlink_swap(int sticky) {
  REQUIRE_HOST();
  REQUIRE_ROOT("to play the user who can write the socket directory "
               "(setuid)");
  static char dir[] = "/tmp/usmipc-swap-XXXXXX";
  static char target[] = "/tmp/usmipc-target-XXXXXX";
  ASSERT_NOT_NULL(mkdtemp(dir));
  if (sticky)
    ASSERT_EQ(chmod(dir, 01777), 0);
  else
    ASSERT_EQ(chown(dir, NOBODY, NOBODY), 0);
  int t = mkstemp(target);
  ASSERT(t >= 0);
  ASSERT_EQ(fchmod(t, 0644), 0);
  close(t);
  int ready[2];
  ASSERT_EQ(pipe2(ready, O_CLOEXEC), 0);
  fflush(stdout);
  pid_t attacker = fork();
  ASSERT(attacker >= 0);
  if (attacker == 0)
    swap_in_symlinks(dir, target, ready[1]);
  char c;
  ASSERT_EQ(read(ready[0], &c, 1), 1);
  close(ready[0]);
  close(ready[1]);
  setenv("USMIPC_SOCKET_DIR", dir, 1);
  usmipc__test_socket_bind_delay_ms = 300;
  void *p = NULL;
  usmipc_ipc_handle_t *h = NULL;
  ASSERT_OK(usmipc_malloc(host_device(), USMIPC_MEM_DEVICE, 4096, &p));
  int r = usmipc_ipc_get_handle(p, 0, &h);
  PROBE_ERR("usmipc_ipc_get_handle(p, 0, &h)", r);
  printf("export with USMIPC_SOCKET_DIR=%s (%s): %s\n", dir,
         sticky ? "root's, 1777" : "uid 65534's",
         r ? usmipc_last_error() : "exported");
  if (h != NULL)
    usmipc_ipc_free_handle(h);
  usmipc_free(p);
  kill(attacker, SIGKILL);
  int status = wait_pid_timeout(attacker, 10);
  /* Root's own socket file, 0600, still there in the sticky directory. */
  char name[64];
  snprintf(name, sizeof(name), "usmipc.%u.%016llx.sock", usmipc__self()->pid,
           (unsigned long long)usmipc__self()->nonce);
  struct stat st;
  int own = 0;
  int d = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (d >= 0 && fstatat(d, name, &st, AT_SYMLINK_NOFOLLOW) == 0)
    own =
        S_ISSOCK(st.st_mode) && st.st_uid == 0 && (st.st_mode & 07777) == 0600;
  if (d >= 0)
    close(d);
  ASSERT_EQ(stat(target, &st), 0);
  unlink(target);
  remove_dir(dir);
  printf("the attacker %s; %s has mode %04o\n",
         WIFEXITED(status) && WEXITSTATUS(status) == 0 ? "swapped a symlink in"
                                                       : "swapped nothing in",
         target, (unsigned)(st.st_mode & 07777));
  ASSERT_MSG((st.st_mode & 07777) == 0644,
             "root changed the mode of %s (0644) to %04o through the symlink "
             "swapped in for its socket file",
             target, (unsigned)(st.st_mode & 07777));
  if (sticky) {
    ASSERT_MSG(r == 0, "exporting in a sticky directory of root failed: %d", r);
    ASSERT_MSG(own, "root's socket file %s/%s is not its 0600 socket", dir,
               name);
  } else {
    ASSERT_MSG(r == USMIPC_EACCES,
               "a socket directory of uid %d was used (expected "
               "USMIPC_EACCES, got %d)",
               NOBODY, r);
  }
  return 0;
}

TEST_IMPL(trust_socket_dir_symlink_swap) { return symlink_swap(0); }
TEST_IMPL(trust_socket_dir_symlink_swap_sticky) { return symlink_swap(1); }

TEST_IMPL(trust_socket_dir_squatted_name) {
  /* Another user makes this process's socket file name first in a sticky
   * directory (the name is in /proc/net/unix as soon as the abstract socket
   * listens): refused as what it is, and the file left alone. */
  REQUIRE_HOST();
  REQUIRE_ROOT("to play the squatter (setuid)");
  static char dir[] = "/tmp/usmipc-squat-XXXXXX";
  ASSERT_NOT_NULL(mkdtemp(dir));
  ASSERT_EQ(chmod(dir, 01777), 0);
  const usmipc__process_t *self = usmipc__self();
  char path[256];
  snprintf(path, sizeof(path), "%s/usmipc.%u.%016llx.sock", dir, self->pid,
           (unsigned long long)self->nonce);
  fflush(stdout);
  pid_t squatter = fork();
  ASSERT(squatter >= 0);
  if (squatter == 0) {
    if (drop_to(NOBODY) != 0)
      _exit(2);
    int fd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    _exit(fd >= 0 && write(fd, "x", 1) == 1 ? 0 : 3);
  }
  ASSERT_EQ(exit_code_of(wait_pid_timeout(squatter, 10)), 0);
  setenv("USMIPC_SOCKET_DIR", dir, 1);
  void *p = NULL;
  usmipc_ipc_handle_t *h = NULL;
  ASSERT_OK(usmipc_malloc(host_device(), USMIPC_MEM_DEVICE, 4096, &p));
  test_error_sentinel();
  int r = usmipc_ipc_get_handle(p, 0, &h);
  PROBE_ERR("usmipc_ipc_get_handle(p, 0, &h)", r);
  char message[1024];
  snprintf(message, sizeof(message), "%s", r ? usmipc_last_error() : "");
  printf("the name taken by uid %d first: %s\n", NOBODY,
         r ? message : "exported");
  if (h != NULL)
    usmipc_ipc_free_handle(h);
  usmipc_free(p);
  struct stat st;
  int kept = lstat(path, &st) == 0 && S_ISREG(st.st_mode) &&
             st.st_uid == NOBODY && st.st_size == 1;
  remove_dir(dir);
  ASSERT_MSG(kept, "the squatter's file %s was changed or removed", path);
  ASSERT_MSG(r == USMIPC_EACCES && strstr(message, "uid 65534") != NULL,
             "expected USMIPC_EACCES naming uid 65534, got %d: %s", r, message);
  return 0;
}

/* ---- trust_pid_reuse -----------------------------------------------------
 * The exporter dies and its pid goes to another process of the same user
 * that uses usmipc too: it has an export table and memfds, perhaps at the
 * very descriptor numbers the old handle names. Opening the old handle must
 * be refused on every path (the pidfd's inode, or start time, and the
 * table's tag keyed by the handle's process key tell the processes apart),
 * never map the impostor's memory. The next pid is steered with
 * /proc/sys/kernel/ns_last_pid (root). */

TEST_IMPL(trust_pid_reuse) {
  REQUIRE_HOST();
  REQUIRE_ROOT("to steer the next pid through /proc/sys/kernel/ns_last_pid");
  static char hex[HEX_MAX], own[HEX_MAX];
  agent_t ex, imp;
  agent_start(&ex, NULL);
  agent_export(&ex, MiB, 901, hex, sizeof(hex));
  pid_t victim = ex.pid;
  agent_kill(&ex);
  int got = 0;
  for (int attempt = 0; attempt < 50 && !got; attempt++) {
    int fd = open("/proc/sys/kernel/ns_last_pid", O_WRONLY | O_CLOEXEC);
    if (fd < 0)
      RETURN_SKIP("cannot open ns_last_pid: %s", strerror(errno));
    char buf[32];
    int n = snprintf(buf, sizeof(buf), "%d", (int)victim - 1);
    ssize_t w = write(fd, buf, (size_t)n);
    int e = errno;
    close(fd);
    if (w != n)
      RETURN_SKIP("cannot write ns_last_pid: %s", strerror(e));
    agent_start(&imp, NULL);
    if (imp.pid == victim)
      got = 1;
    else
      agent_stop_ok(&imp);
  }
  if (!got)
    RETURN_SKIP("pid %d was not handed out again (a busy machine)",
                (int)victim);
  /* The impostor exports memory of its own, the same way. */
  agent_export(&imp, MiB, 902, own, sizeof(own));
  static uint8_t b[4096], mine[4096];
  size_t len = hex_bytes(hex, b, sizeof(b));
  size_t own_len = hex_bytes(own, mine, sizeof(mine));
  usmipc_ipc_handle_info_t old_info, new_info;
  ASSERT_OK(usmipc_ipc_handle_inspect(b, len, &old_info));
  ASSERT_OK(usmipc_ipc_handle_inspect(mine, own_len, &new_info));
  ASSERT_EQ(old_info.exporter_pid, new_info.exporter_pid);
  static const char *const transports[] = {"auto", "pidfd", "procfd", "socket"};
  for (size_t t = 0; t < sizeof(transports) / sizeof(transports[0]); t++) {
    setenv("USMIPC_FD_TRANSPORT", transports[t], 1);
    test_error_sentinel();
    int r = open_here(b, len);
    PROBE_ERR("open_here(b, len)", r);
    printf("%s: %d %s\n", transports[t], r, r ? usmipc_last_error() : "");
    ASSERT_MSG(r == USMIPC_EEXPORTERGONE || r == USMIPC_EUNTRUSTED,
               "%s: the old handle of pid %d opened (or failed oddly: %d) "
               "after the pid went to another process",
               transports[t], (int)victim, r);
    /* The impostor's own handle opens: the path works, only the old
     * handle is refused. */
    void *p = NULL;
    ASSERT_OK(usmipc_ipc_open(mine, own_len, NULL, 0, &p, NULL));
    ASSERT_PATTERN(p, MiB, 902, 0);
    ASSERT_OK(usmipc_ipc_close(p));
  }
  unsetenv("USMIPC_FD_TRANSPORT");
  agent_stop_ok(&imp);
  return 0;
}

static void remove_dir(const char *dir) {
  DIR *d = opendir(dir);
  if (d != NULL) {
    struct dirent *e;
    char path[512];
    while ((e = readdir(d)) != NULL) {
      if (e->d_name[0] == '.' &&
          (e->d_name[1] == '\0' || (e->d_name[1] == '.' && !e->d_name[2])))
        continue;
      snprintf(path, sizeof(path), "%s/%s", dir, e->d_name);
      unlink(path);
    }
    closedir(d);
  }
  rmdir(dir);
}

/* Another machine id: every hex digit of this one's moved by one. */
static void other_machine_id(char out[33]) {
  char real[64] = "0123456789abcdef0123456789abcdef";
  int fd = open("/etc/machine-id", O_RDONLY | O_CLOEXEC);
  if (fd >= 0) {
    ssize_t n = read(fd, real, sizeof(real) - 1);
    (void)n;
    close(fd);
  }
  static const char digits[] = "0123456789abcdef";
  for (int i = 0; i < 32; i++) {
    const char *at = strchr(digits, real[i] ? real[i] : '0');
    int v = at && *at ? (int)(at - digits) : 0;
    out[i] = digits[(v + 1) % 16];
  }
  out[32] = '\0';
}

static int container_socket_dir(int variant) { /* 0 plain, 1 id, 2 userns */
  REQUIRE_HOST();
  static char dir[] = "/tmp/usmipc-sockdir-XXXXXX";
  static char idfile[] = "/tmp/usmipc-machine-id-XXXXXX";
  static const char *const plain[] = {
      "unshare", "-p", "-n", "--fork", "--mount-proc", "--kill-child", NULL};
  static const char *const userns[] = {
      "unshare", "-U",           "--map-root-user", "-p", "-n",
      "--fork",  "--mount-proc", "--kill-child",    NULL};
  const char *with_id[16];
  const char *const *wrapper = variant == 2 ? userns : plain;
  if (variant == 1) {
    if (access("/etc/machine-id", F_OK) != 0)
      RETURN_SKIP("no /etc/machine-id to bind another one over");
    int fd = mkstemp(idfile);
    ASSERT(fd >= 0);
    char id[34];
    other_machine_id(id);
    id[32] = '\n';
    ASSERT_EQ(write(fd, id, 33), 33);
    fchmod(fd, 0644);
    close(fd);
    int k = 0;
    for (int i = 0; plain[i] != NULL; i++)
      with_id[k++] = plain[i];
    with_id[k++] = "sh";
    with_id[k++] = "-c";
    with_id[k++] = "mount --bind \"$0\" /etc/machine-id && exec \"$@\"";
    with_id[k++] = idfile;
    with_id[k] = NULL;
    wrapper = with_id;
  }
  if (!wrapper_works(wrapper)) {
    if (variant == 1)
      unlink(idfile);
    RETURN_SKIP("the namespaces of this test are not permitted here (%s)",
                variant == 2 ? "unshare -U --map-root-user -p -n"
                             : "unshare -p -n --mount-proc");
  }
  ASSERT_NOT_NULL(mkdtemp(dir));
  char setting[128];
  snprintf(setting, sizeof(setting), "USMIPC_SOCKET_DIR=%s", dir);
  const char *env[] = {setting, "USMIPC_FD_TRANSPORT", NULL};

  static char hex[HEX_MAX];
  agent_t ex, im;
  agent_spawn(&ex, env, NULL);
  agent_export(&ex, MiB, 901, hex, sizeof(hex));
  agent_spawn(&im, env, wrapper);
  int r = agent_call(&im, "open 0 %s 0", hex);
  printf("importer in other namespaces%s, USMIPC_SOCKET_DIR=%s: %s\n",
         variant == 1   ? " with another machine id"
         : variant == 2 ? " and a user namespace"
                        : "",
         dir, r ? im.reply : "opened");
  if (r != 0) {
    agent_stop(&im);
    agent_stop(&ex);
    remove_dir(dir);
    if (variant == 1)
      unlink(idfile);
    test_fail(__FILE__, __LINE__, "the open failed: %s", im.reply);
  }
  AGENT_OK(&im, "check 0 901");
  AGENT_OK(&im, "fill 0 902");
  AGENT_OK(&ex, "check 0 902");
  AGENT_OK(&im, "close 0");
  agent_stop_ok(&im);
  agent_stop_ok(&ex);
  remove_dir(dir);
  if (variant == 1)
    unlink(idfile);
  return 0;
}

TEST_IMPL(trust_container_socket_dir) { return container_socket_dir(0); }
TEST_IMPL(trust_container_socket_dir_machine_id) {
  return container_socket_dir(1);
}
TEST_IMPL(trust_container_socket_dir_userns) { return container_socket_dir(2); }

/* ---- trust_fd_limit_code ---------------------------------------------------
 * Running out of descriptors is USMIPC_EMFILE, with a message that says
 * so, not a raw errno. */

TEST_IMPL(trust_fd_limit_code) {
  REQUIRE_HOST();
  agent_t ag;
  agent_start(&ag, NULL);
  AGENT_OK(&ag, "alloc 0 device 4096"); /* devices probed, before the limit */
  AGENT_OK(&ag, "nofile +8");
  printf("RLIMIT_NOFILE, open descriptors: %s\n", ag.reply);
  int r = 0, i;
  for (i = 1; i < 60 && r == 0; i++)
    r = agent_call(&ag, "alloc %d device 4096", i);
  ASSERT_MSG(r != 0, "59 allocations succeeded under a limit of 8 spare "
                     "descriptors");
  printf("allocation %d failed: %s\n", i - 1, ag.reply);
  char name[64];
  reply_name(&ag, name, sizeof(name));
  ASSERT_MSG(r == USMIPC_EMFILE && strcmp(name, "USMIPC_EMFILE") == 0,
             "out of descriptors: got %d %s, expected %d USMIPC_EMFILE", r,
             name, USMIPC_EMFILE);
  ASSERT_MSG(strcasestr(reply_message(&ag), "descriptor") != NULL,
             "the message does not mention descriptors: %s",
             reply_message(&ag));
  /* It names the ways out, the pool being the one for many small buffers. */
  ASSERT_MSG(strstr(reply_message(&ag), "ulimit -n") != NULL &&
                 strstr(reply_message(&ag), "pool") != NULL,
             "the message names neither ulimit -n nor pools: %s",
             reply_message(&ag));
  /* Nothing was lost: with one freed, the next allocation fits again. */
  AGENT_OK(&ag, "free %d", i - 2);
  AGENT_OK(&ag, "alloc %d device 4096", i - 2);
  /* Back to a normal limit: LeakSanitizer needs descriptors at exit. */
  AGENT_OK(&ag, "nofile 1024");
  agent_stop_ok(&ag);
  return 0;
}

/* ---- trust_importer_out_of_address_space ----------------------------------
 * An importer that cannot map (RLIMIT_AS, as under a memory cap): the open
 * fails with USMIPC_ENOMEM and a message that says how much it tried to map,
 * keeps no descriptor it fetched, and the same handle opens with the right
 * bytes once the importer has room again. Idle mappings of the import cache
 * never cause the failure: an open out of room drops them and tries again.
 * The exporter is not disturbed. */

/* The pattern of a 256 MiB slot checked at its start, middle and end, 1 MiB
 * each: what the test needs to see is that the mapping holds the
 * exporter's bytes, and a whole check costs ~10 s under ThreadSanitizer. */
static void check_big_windows(agent_t *a, int slot, int seed) {
  const size_t w = MiB, size = (size_t)256 * MiB;
  AGENT_OK(a, "check %d %d 0 %zu", slot, seed, w);
  AGENT_OK(a, "check %d %d %zu %zu", slot, seed, size / 2 - w / 2, w);
  AGENT_OK(a, "check %d %d %zu %zu", slot, seed, size - w, w);
}

TEST_IMPL(trust_importer_out_of_address_space) {
  REQUIRE_HOST();
#if defined(__SANITIZE_ADDRESS__)
  /* ASan's allocator maps memory for the agent's own mallocs as it goes: a
   * tight RLIMIT_AS would end the agent in ASan's out-of-memory abort. */
  RETURN_SKIP("ASan maps its allocator's memory under the limit too");
#endif
  static char small[HEX_MAX], big[HEX_MAX];
  agent_t ex, im;
  agent_start(&ex, NULL);
  agent_start(&im, NULL);
  agent_export(&ex, 4096, 1301, small, sizeof(small));
  AGENT_OK(&ex, "alloc 1 device %zu", (size_t)256 * MiB);
  AGENT_OK(&ex, "fill 1 1302");
  AGENT_OK(&ex, "export 1 0 0");
  snprintf(big, sizeof(big), "%s", ex.reply);
  /* First contact made, so that only the mapping is left to fail. */
  AGENT_OK(&im, "cache 0");
  AGENT_OK(&im, "open 0 %s 0", small);
  AGENT_OK(&im, "close 0");
  AGENT_OK(&im, "fds");
  const size_t fds0 = strtoull(im.reply, NULL, 10);
  AGENT_OK(&im, "aslimit +64");
  int r = agent_call(&im, "open 1 %s 0", big);
  printf("open under RLIMIT_AS: %s\n", im.reply);
  ASSERT_MSG(r == USMIPC_ENOMEM, "got %d: %s", r, im.reply);
  ASSERT_MSG(strstr(reply_message(&im), "268435456") != NULL ||
                 strstr(reply_message(&im), "256 MiB") != NULL,
             "the message does not say what it tried to map: %s",
             reply_message(&im));
  AGENT_OK(&im, "aslimit off");
  AGENT_OK(&im, "fds");
  ASSERT_EQ(strtoull(im.reply, NULL, 10), fds0);
  AGENT_OK(&im, "open 1 %s 0", big);
  check_big_windows(&im, 1, 1302);
  AGENT_OK(&im, "close 1");
  check_big_windows(&ex, 1, 1302);

  /* 4 x 64 MiB kept idle by the cache, then room for 64 MiB more: the big
   * buffer fits only if the open drops the idle mappings. */
  static char mid[4][HEX_MAX];
  for (int i = 0; i < 4; i++) {
    AGENT_OK(&ex, "alloc %d device %zu", 2 + i, 64 * MiB);
    AGENT_OK(&ex, "export %d 0 0", 2 + i);
    snprintf(mid[i], sizeof(mid[i]), "%s", ex.reply);
  }
  AGENT_OK(&im, "cache 64");
  for (int i = 0; i < 4; i++) {
    AGENT_OK(&im, "open %d %s 0", 2 + i, mid[i]);
    AGENT_OK(&im, "close %d", 2 + i);
  }
  AGENT_OK(&im, "aslimit +64");
  AGENT_OK(&im, "open 1 %s 0", big);
  check_big_windows(&im, 1, 1302);
  AGENT_OK(&im, "close 1");
  AGENT_OK(&im, "aslimit off");
  agent_stop_ok(&im);
  agent_stop_ok(&ex);
  return 0;
}

/* ---- trust_idle_cache_drop_freed / _byte_cap -------------------------------
 * A producer streams fresh 256 MiB buffers (each filled, so its pages
 * exist); the importer opens each, reads a few bytes, closes; the producer
 * frees it. Idle mappings must not pin the freed buffers: shared memory
 * (Shmem in /proc/meminfo) and the importer's buffer-sized memfd mappings
 * stay within 2 buffers of where they started. A: no cap holds the stream
 * (the byte cap and the entry cap are above its total), only dropping idle
 * mappings of freed allocations. B: dropping turned off, a 256 MiB cap (one
 * idle buffer: with the next buffer being filled that is 2). */

#define STREAM_BUFFERS 100
#define STREAM_SIZE ((size_t)256 << 20)
/* Shmem is system-wide: room for what other processes do meanwhile. */
#define SHMEM_SLACK_KB (128ll << 10)

static long long meminfo_kb(const char *key) {
  FILE *f = fopen("/proc/meminfo", "re");
  ASSERT_NOT_NULL(f);
  char line[256];
  long long v = -1;
  size_t klen = strlen(key);
  while (fgets(line, sizeof(line), f) != NULL)
    if (strncmp(line, key, klen) == 0 && line[klen] == ':')
      v = strtoll(line + klen + 1, NULL, 10);
  fclose(f);
  ASSERT_MSG(v >= 0, "no %s in /proc/meminfo", key);
  return v;
}

/* Mappings of usmipc memfds at least one buffer long (the export tables of
 * exporters, 32 MiB, are not counted). */
static size_t buffer_mappings(void) {
  FILE *f = fopen("/proc/self/maps", "re");
  ASSERT_NOT_NULL(f);
  char line[1024];
  size_t n = 0;
  while (fgets(line, sizeof(line), f) != NULL) {
    unsigned long long lo, hi;
    if (strstr(line, "/memfd:usmipc") != NULL &&
        sscanf(line, "%llx-%llx", &lo, &hi) == 2 && hi - lo >= STREAM_SIZE)
      n++;
  }
  fclose(f);
  return n;
}

static void stream_check(long long shmem0, size_t maps0, int i,
                         const char *step) {
  long long shmem = meminfo_kb("Shmem");
  size_t maps = buffer_mappings();
  long long limit = 2 * (long long)(STREAM_SIZE >> 10) + SHMEM_SLACK_KB;
  ASSERT_MSG(shmem - shmem0 <= limit,
             "buffer %d, after %s: Shmem grew by %lld MiB (limit 2 buffers, "
             "%lld MiB with slack): idle mappings pin freed buffers",
             i, step, (shmem - shmem0) >> 10, limit >> 10);
  ASSERT_MSG(maps <= maps0 + 2,
             "buffer %d, after %s: %zu buffer mappings of /memfd:usmipc "
             "(started with %zu, limit +2)",
             i, step, maps, maps0);
}

static int idle_cache_stream(int drop_freed) {
#if defined(__SANITIZE_THREAD__)
  /* 25 GB of memset through ThreadSanitizer's interceptor takes minutes,
   * and the test has no threads to race: it runs in the other builds. */
  RETURN_SKIP("a memory-volume test, run without ThreadSanitizer");
#endif
  /* Before any usmipc call: the library reads it once. */
  if (drop_freed)
    unsetenv("USMIPC_IPC_CACHE_DROP_FREED");
  else
    setenv("USMIPC_IPC_CACHE_DROP_FREED", "0", 1);
  unsetenv("USMIPC_IPC_CACHE_BYTES");
  unsetenv("USMIPC_IPC_CACHE_SIZE");
  REQUIRE_HOST();
  if (meminfo_kb("MemAvailable") < (4ll << 20))
    RETURN_SKIP("needs 4 GiB of available memory");
  extend_timeout(290);
  if (drop_freed) {
    ASSERT_OK(usmipc_ipc_set_cache_bytes((size_t)1 << 40));
    ASSERT_OK(usmipc_ipc_set_cache_size(1000));
  } else {
    ASSERT_OK(usmipc_ipc_set_cache_bytes(STREAM_SIZE));
  }
  agent_t pr;
  agent_start(&pr, NULL);
  long long shmem0 = meminfo_kb("Shmem");
  size_t maps0 = buffer_mappings();
  double t0 = now_seconds();
  for (int i = 0; i < STREAM_BUFFERS; i++) {
    unsigned byte = (unsigned)(i % 250) + 1;
    AGENT_OK(&pr, "alloc 0 device %zu", STREAM_SIZE);
    AGENT_OK(&pr, "memset 0 %u", byte);
    stream_check(shmem0, maps0, i, "the producer filled it");
    AGENT_OK(&pr, "export 0 0 0");
    uint8_t data[1024];
    size_t len = hex_bytes(pr.reply, data, sizeof(data));
    uint8_t *p = NULL;
    size_t mapped = 0;
    ASSERT_OK(usmipc_ipc_open(data, len, NULL, 0, (void **)&p, &mapped));
    ASSERT_EQ(mapped, STREAM_SIZE);
    ASSERT_EQ(p[0], byte);
    ASSERT_EQ(p[STREAM_SIZE / 2], byte);
    ASSERT_EQ(p[STREAM_SIZE - 1], byte);
    stream_check(shmem0, maps0, i, "the importer opened it");
    ASSERT_OK(usmipc_ipc_close(p));
    stream_check(shmem0, maps0, i, "the importer closed it");
    AGENT_OK(&pr, "free 0");
    stream_check(shmem0, maps0, i, "the producer freed it");
  }
  printf("%d buffers of %zu MiB in %.1f s; Shmem %+lld MiB, %zu buffer "
         "mappings\n",
         STREAM_BUFFERS, STREAM_SIZE >> 20, now_seconds() - t0,
         (meminfo_kb("Shmem") - shmem0) >> 10, buffer_mappings());
  agent_stop_ok(&pr);
  return 0;
}

TEST_IMPL(trust_idle_cache_drop_freed) { return idle_cache_stream(1); }
TEST_IMPL(trust_idle_cache_byte_cap) { return idle_cache_stream(0); }

/* ---- trust_sealed_memfd ----------------------------------------------------
 * Host memory is a memfd that importers map: if its size could change, an
 * exporter (buggy or hostile) could turn every importer's next touch into a
 * SIGBUS. The library seals it (F_SEAL_SHRINK | F_SEAL_GROW). */

TEST_IMPL(trust_sealed_memfd) {
  REQUIRE_HOST();
  static char hex[HEX_MAX];
  agent_t ex, im;
  agent_start(&ex, NULL);
  agent_export(&ex, MiB, 1201, hex, sizeof(hex));
  agent_start(&im, NULL);
  AGENT_OK(&im, "open 0 %s 0", hex);
  AGENT_OK(&im, "check 0 1201");
  int r = agent_call(&ex, "truncate 0 0");
  ASSERT_MSG(r != 0,
             "ftruncate(%s, 0) of the exported allocation's memfd "
             "succeeded: it is not sealed against shrinking",
             ex.reply);
  printf("shrink refused: %s\n", ex.reply);
  r = agent_call(&ex, "truncate 0 %zu", 4 * MiB);
  ASSERT_MSG(r != 0,
             "ftruncate(%s, 4 MiB) of the exported allocation's memfd "
             "succeeded: it is not sealed against growing",
             ex.reply);
  printf("grow refused: %s\n", ex.reply);
  AGENT_OK(&im, "check 0 1201"); /* no SIGBUS, the same bytes */
  AGENT_OK(&im, "close 0");
  agent_stop_ok(&im);
  AGENT_OK(&ex, "free 0");
  agent_stop_ok(&ex);
  return 0;
}

/* ---- trust_kept_connection / trust_kept_connection_fork --------------------
 * An importer keeps its broker connection for the next open from the same
 * exporter. It must survive the broker closing it (here: a flood of other
 * connections makes the broker evict it), and a fork child must never use
 * its parent's (their requests and answers would interleave). */

/* The inodes of the sockets process pid holds ("socket:[N]" links). */
static int socket_inodes(pid_t pid, unsigned long *inodes, int max) {
  char dir_path[64];
  snprintf(dir_path, sizeof(dir_path), "/proc/%d/fd", (int)pid);
  DIR *d = opendir(dir_path);
  ASSERT_NOT_NULL(d);
  int n = 0;
  struct dirent *e;
  while ((e = readdir(d)) != NULL && n < max) {
    char path[320], link[64];
    snprintf(path, sizeof(path), "%s/%s", dir_path, e->d_name);
    ssize_t k = readlink(path, link, sizeof(link) - 1);
    if (k <= 0)
      continue;
    link[k] = '\0';
    if (sscanf(link, "socket:[%lu]", &inodes[n]) == 1)
      n++;
  }
  closedir(d);
  return n;
}

/* The one socket the importer agent holds (it talks to the test through
 * pipes, so any socket is a broker connection). */
static unsigned long only_socket(const agent_t *a) {
  unsigned long inodes[8];
  int n = socket_inodes(a->pid, inodes, 8);
  ASSERT_MSG(n == 1, "the importer holds %d sockets, not 1", n);
  return inodes[0];
}

TEST_IMPL(trust_kept_connection) {
  REQUIRE_HOST();
  enum { N = 12 };
  static char hex[N][HEX_MAX];
  agent_t ex, im;
  /* One broker thread: its 64 places are what the flood below fills (each
   * thread has its own). */
  static const char *const one_thread[] = {"USMIPC_BROKER_THREADS=1", NULL};
  agent_spawn(&ex, one_thread, NULL);
  for (int i = 0; i < N; i++) {
    AGENT_OK(&ex, "alloc %d device 65536", i);
    AGENT_OK(&ex, "fill %d %d", i, 500 + i);
    AGENT_OK(&ex, "export %d 0 0", i);
    snprintf(hex[i], sizeof(hex[i]), "%s", ex.reply);
  }
  sock_name_t names[4];
  ASSERT_MSG(broker_names(ex.pid, names, 4) >= 1,
             "no listening socket @usmipc.%d.* in /proc/net/unix", (int)ex.pid);
  agent_start(&im, "socket");
  AGENT_OK(&im, "open 0 %s", hex[0]);
  AGENT_OK(&im, "check 0 500");
  unsigned long first = only_socket(&im);
  /* Later opens reuse it: still one socket, the same one. */
  for (int i = 1; i < N / 2; i++) {
    AGENT_OK(&im, "open %d %s", i, hex[i]);
    AGENT_OK(&im, "check %d %d", i, 500 + i);
  }
  ASSERT_MSG(only_socket(&im) == first,
             "the importer connected again instead of keeping its connection");

  /* 8 processes x 8 idle connections: the broker's 64 places fill up, and
   * it makes room by closing the idle kept connection first. */
  int hold[2], ready[2];
  ASSERT_EQ(pipe2(hold, O_CLOEXEC), 0);
  ASSERT_EQ(pipe2(ready, O_CLOEXEC), 0);
  pid_t pids[8];
  fflush(stdout);
  fflush(stderr);
  for (int i = 0; i < 8; i++) {
    pids[i] = fork();
    ASSERT(pids[i] >= 0);
    if (pids[i] == 0) {
      close(hold[1]);
      close(ready[0]);
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      char c = 'c';
      for (int k = 0; k < 8; k++) {
        struct sockaddr_un addr;
        socklen_t len = abstract_address(names[0], &addr);
        int s = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
        if (connect(s, (struct sockaddr *)&addr, len) != 0)
          c = 'x';
      }
      if (write(ready[1], &c, 1) != 1)
        _exit(3);
      while (read(hold[0], &c, 1) > 0) {
      }
      _exit(0);
    }
  }
  close(hold[0]);
  close(ready[1]);
  for (int i = 0; i < 8; i++) {
    struct pollfd p = {.fd = ready[0], .events = POLLIN};
    char c = 0;
    ASSERT_MSG(poll(&p, 1, 10000) == 1 && read(ready[0], &c, 1) == 1,
               "flooding process %d did not report", i);
    ASSERT_MSG(c == 'c', "flooding process %d could not connect", i);
  }
  /* The broker handles the flood in its own time: wait until the kept
   * connection's far end is gone (the importer sees it on its next send). */
  double t0 = now_seconds();
  for (;;) {
    FILE *f = fopen("/proc/net/unix", "re");
    ASSERT_NOT_NULL(f);
    char line[512];
    bool still = false;
    unsigned long ino;
    while (fgets(line, sizeof(line), f) != NULL)
      if (sscanf(line, "%*s %*x %*x %*x %*x %*x %lu", &ino) == 1 &&
          ino == first && strstr(line, " 03 ") != NULL)
        still = true; /* SS_CONNECTED */
    fclose(f);
    if (!still || now_seconds() - t0 > 5)
      break;
    poll(NULL, 0, 5);
  }
  /* The next open finds its connection closed, connects again, succeeds. */
  for (int i = N / 2; i < N; i++) {
    AGENT_OK(&im, "open %d %s", i, hex[i]);
    AGENT_OK(&im, "check %d %d", i, 500 + i);
  }
  unsigned long second = only_socket(&im);
  close(hold[1]);
  close(ready[0]);
  for (int i = 0; i < 8; i++)
    ASSERT_NE(wait_child(pids[i], 5), -1);
  printf("kept connection %lu, after the flood %lu\n", first, second);
  ASSERT_MSG(second != first,
             "the kept connection was not closed by the flood: the test "
             "proved nothing about reconnecting");
  agent_stop_ok(&im);
  agent_stop_ok(&ex);
  return 0;
}

TEST_IMPL(trust_kept_connection_fork) {
  REQUIRE_HOST();
  static char hex[3][HEX_MAX];
  agent_t ex;
  agent_start(&ex, NULL);
  for (int i = 0; i < 3; i++) {
    AGENT_OK(&ex, "alloc %d device 65536", i);
    AGENT_OK(&ex, "fill %d %d", i, 600 + i);
    AGENT_OK(&ex, "export %d 0 0", i);
    snprintf(hex[i], sizeof(hex[i]), "%s", ex.reply);
  }
  setenv("USMIPC_FD_TRANSPORT", "socket", 1);
  uint8_t b[3][HEX_MAX / 2];
  size_t len[3];
  for (int i = 0; i < 3; i++)
    len[i] = hex_bytes(hex[i], b[i], sizeof(b[i]));
  unsigned long before[64], after[64];
  int n_before = socket_inodes(getpid(), before, 64);
  void *p0 = NULL;
  ASSERT_EQ(usmipc_ipc_open(b[0], len[0], NULL, 0, &p0, NULL), 0);
  int n_after = socket_inodes(getpid(), after, 64);
  ASSERT_EQ(n_after, n_before + 1);
  /* The kept connection's descriptor number. */
  int kept_fd = -1;
  DIR *d = opendir("/proc/self/fd");
  ASSERT_NOT_NULL(d);
  for (struct dirent *e; (e = readdir(d)) != NULL;) {
    char path[300], link[64];
    snprintf(path, sizeof(path), "/proc/self/fd/%s", e->d_name);
    ssize_t k = readlink(path, link, sizeof(link) - 1);
    unsigned long ino;
    if (k <= 0)
      continue;
    link[k] = '\0';
    if (sscanf(link, "socket:[%lu]", &ino) != 1)
      continue;
    bool old = false;
    for (int i = 0; i < n_before; i++)
      old |= before[i] == ino;
    if (!old)
      kept_fd = atoi(e->d_name);
  }
  closedir(d);
  ASSERT_MSG(kept_fd >= 0, "no new socket after an open through the broker");

  fflush(stdout);
  fflush(stderr);
  pid_t pid = fork();
  ASSERT(pid >= 0);
  if (pid == 0) {
    /* Closed here at fork; the child connects for itself. */
    if (fcntl(kept_fd, F_GETFD) != -1 || errno != EBADF)
      _exit(10);
    void *p1 = NULL;
    if (usmipc_ipc_open(b[1], len[1], NULL, 0, &p1, NULL) != 0)
      _exit(11);
    if (((uint8_t *)p1)[0] != pattern_byte(600 + 1, 0))
      _exit(12);
    _exit(0);
  }
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  ASSERT_MSG(WIFEXITED(status) && WEXITSTATUS(status) == 0,
             "fork child: status %d (10: the parent's kept connection is "
             "open in the child; 11: the open failed; 12: wrong bytes)",
             status);
  /* The parent's connection still works. */
  void *p2 = NULL;
  ASSERT_EQ(usmipc_ipc_open(b[2], len[2], NULL, 0, &p2, NULL), 0);
  ASSERT_EQ(((uint8_t *)p2)[0], pattern_byte(600 + 2, 0));
  ASSERT_EQ(fcntl(kept_fd, F_GETFD) >= 0, 1);
  ASSERT_EQ(usmipc_ipc_close(p0), 0);
  ASSERT_EQ(usmipc_ipc_close(p2), 0);
  agent_stop_ok(&ex);
  return 0;
}

/* ---- trust_broker_threads --------------------------------------------------
 * Several broker threads (USMIPC_BROKER_THREADS, the default on machines of
 * 8 CPUs and more) serve importers arriving together: every importer gets
 * the right bytes, and the exporter runs the threads asked for. */
/* Threads of process pid named name (/proc/<pid>/task/<tid>/comm). */
static int named_threads(pid_t pid, const char *name) {
  char path[64];
  snprintf(path, sizeof(path), "/proc/%d/task", (int)pid);
  DIR *d = opendir(path);
  ASSERT_NOT_NULL(d);
  int n = 0;
  for (struct dirent *e; (e = readdir(d)) != NULL;) {
    if (e->d_name[0] == '.')
      continue;
    char comm_path[400], comm[32] = "";
    snprintf(comm_path, sizeof(comm_path), "%s/%s/comm", path, e->d_name);
    FILE *f = fopen(comm_path, "re");
    if (f != NULL) {
      if (fgets(comm, sizeof(comm), f) != NULL)
        comm[strcspn(comm, "\n")] = '\0';
      fclose(f);
    }
    n += strcmp(comm, name) == 0;
  }
  closedir(d);
  return n;
}

TEST_IMPL(trust_broker_threads) {
  REQUIRE_HOST();
  enum { BUFFERS = 6, IMPORTERS = 3 };
  static char hex[BUFFERS][HEX_MAX];
  static const char *const four[] = {"USMIPC_BROKER_THREADS=4", NULL};
  agent_t ex, im[IMPORTERS];
  agent_spawn(&ex, four, NULL);
  ASSERT_EQ(named_threads(ex.pid, "usmipc-broker"), 0);
  for (int i = 0; i < BUFFERS; i++) {
    AGENT_OK(&ex, "alloc %d device 65536", i);
    AGENT_OK(&ex, "fill %d %d", i, 700 + i);
    AGENT_OK(&ex, "export %d 0 0", i);
    snprintf(hex[i], sizeof(hex[i]), "%s", ex.reply);
  }
  ASSERT_MSG(named_threads(ex.pid, "usmipc-broker") == 4,
             "the exporter runs %d broker threads after its first export (4 "
             "asked for)",
             named_threads(ex.pid, "usmipc-broker"));
  for (int k = 0; k < IMPORTERS; k++)
    agent_start(&im[k], "socket");
  /* Interleaved: each importer's requests go to its own kept connection,
   * on whichever thread accepted it. */
  for (int i = 0; i < BUFFERS; i++)
    for (int k = 0; k < IMPORTERS; k++) {
      AGENT_OK(&im[k], "open %d %s", i, hex[i]);
      AGENT_OK(&im[k], "check %d %d", i, 700 + i);
    }
  for (int k = 0; k < IMPORTERS; k++)
    agent_stop_ok(&im[k]);
  agent_stop_ok(&ex);
  return 0;
}

/* ---- trust_importers_killed_mid_open ---------------------------------------
 * Importers SIGKILLed at random moments while they open and close (over the
 * broker's socket, and by pidfd): the exporter must not keep a descriptor or
 * a thread for any of them, and must serve the next importer at once with
 * the right bytes. */

/* Entries of /proc/<pid>/<what> (fd or task). */
static size_t proc_entries(pid_t pid, const char *what) {
  char path[64];
  snprintf(path, sizeof(path), "/proc/%d/%s", (int)pid, what);
  DIR *d = opendir(path);
  ASSERT_NOT_NULL(d);
  size_t n = 0;
  for (struct dirent *e; (e = readdir(d)) != NULL;)
    n += e->d_name[0] != '.';
  closedir(d);
  return n;
}

enum { KILLED_BUFFERS = 8, KILLED_ROUNDS = 80 };
static uint8_t killed_handles[KILLED_BUFFERS][1024];
static size_t killed_lens[KILLED_BUFFERS];

/* The importer: opens, reads and closes every buffer, rounds times (0:
 * until killed); exits 0 when every byte read was right. */
static void killed_importer(const char *transport, int rounds) {
  setenv("USMIPC_FD_TRANSPORT", transport, 1);
  usmipc_ipc_set_cache_size(0);
  for (int r = 0; rounds == 0 || r < rounds; r++)
    for (int b = 0; b < KILLED_BUFFERS; b++) {
      void *p = NULL;
      if (usmipc_ipc_open(killed_handles[b], killed_lens[b], NULL, 0, &p,
                          NULL) != 0 ||
          pattern_check(p, 4096, 1400 + (uint64_t)b, 0) != SIZE_MAX ||
          usmipc_ipc_close(p) != 0)
        _exit(1);
    }
  _exit(0);
}

TEST_IMPL(trust_importers_killed_mid_open) {
  REQUIRE_HOST();
  agent_t ex;
  agent_start(&ex, NULL);
  for (int b = 0; b < KILLED_BUFFERS; b++) {
    AGENT_OK(&ex, "alloc %d device 262144", b);
    AGENT_OK(&ex, "fill %d %d", b, 1400 + b);
    AGENT_OK(&ex, "export %d 0 0", b);
    killed_lens[b] = hex_bytes(ex.reply, killed_handles[b], 1024);
  }
  static const char *const transports[] = {"socket", "pidfd"};
  /* The baseline: after one importer of each transport came and went. */
  for (int t = 0; t < 2; t++) {
    pid_t pid = fork();
    if (pid == 0)
      killed_importer(transports[t], 1);
    ASSERT_EQ(exit_code_of(wait_pid_timeout(pid, 20)), 0);
  }
  const size_t fds0 = proc_entries(ex.pid, "fd");
  const size_t threads0 = proc_entries(ex.pid, "task");
  uint64_t seed = 0x9e3779b97f4a7c15ull;
  for (int r = 0; r < KILLED_ROUNDS; r++) {
    pid_t pid = fork();
    if (pid == 0)
      killed_importer(transports[r % 2], 0);
    seed ^= seed << 13, seed ^= seed >> 7, seed ^= seed << 17;
    usleep(100 + (useconds_t)(seed % 3000));
    kill(pid, SIGKILL);
    int status = wait_pid_timeout(pid, 20);
    ASSERT_MSG(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL,
               "importer %d ended before it was killed (status %#x)", r,
               status);
  }
  /* The broker notices a dead peer's socket at once: allow it a moment. */
  size_t fds = 0, threads = 0;
  for (int i = 0; i < 300; i++) {
    fds = proc_entries(ex.pid, "fd");
    threads = proc_entries(ex.pid, "task");
    if (fds == fds0 && threads == threads0)
      break;
    usleep(10000);
  }
  printf("exporter after %d killed importers: fds %zu -> %zu, threads %zu -> "
         "%zu\n",
         KILLED_ROUNDS, fds0, fds, threads0, threads);
  ASSERT_EQ(fds, fds0);
  ASSERT_EQ(threads, threads0);
  /* The next importer is served at once, with the right bytes. */
  for (int t = 0; t < 2; t++) {
    double t0 = now_seconds();
    pid_t pid = fork();
    if (pid == 0)
      killed_importer(transports[t], 3);
    ASSERT_EQ(exit_code_of(wait_pid_timeout(pid, 20)), 0);
    ASSERT_LT(now_seconds() - t0, 2.0);
  }
  for (int b = 0; b < KILLED_BUFFERS; b++)
    AGENT_OK(&ex, "check %d %d", b, 1400 + b);
  agent_stop_ok(&ex);
  return 0;
}
