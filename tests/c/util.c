/* Helpers shared by the tests: assertions, byte patterns, /proc counters,
 * helper processes and the client side of the agent protocol (task.h). */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <spawn.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "task.h"

extern char **environ;

#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif
#ifndef SYS_pidfd_getfd
#define SYS_pidfd_getfd 438
#endif

/* ---- assertions ---------------------------------------------------------- */

static _Thread_local char sentinel_message[1024];

void test_fail(const char *file, int line, const char *fmt, ...) {
  va_list ap;
  fflush(stdout);
  fprintf(stderr, "FAIL %s:%d [pid %d]: ", file, line, (int)getpid());
  va_start(ap, fmt);
  vfprintf(stderr, fmt, ap);
  va_end(ap);
  fputc('\n', stderr);
  fflush(stderr);
  /* _exit, not exit: a failing test must not run atexit handlers or leak
   * checks that would bury the message. Helpers die with us. */
  _exit(1);
}

void test_check_error(const char *file, int line, const char *what, int r,
                      int c1, int c2, int c3) {
  probe_record(file, line, what, r, r ? usmipc_last_error() : "");
  if (r != c1 && r != c2 && r != c3) {
    if (c1 == c2 && c2 == c3)
      test_fail(file, line, "%s returned %d (%s), expected %s; message: %s",
                what, r, usmipc_err_name(r), usmipc_err_name(c1),
                r ? usmipc_last_error() : "");
    test_fail(file, line,
              "%s returned %d (%s), expected one of %s %s %s; message: %s",
              what, r, usmipc_err_name(r), usmipc_err_name(c1),
              usmipc_err_name(c2), usmipc_err_name(c3),
              r ? usmipc_last_error() : "");
  }
  const char *msg = usmipc_last_error();
  if (msg == NULL || msg[0] == '\0')
    test_fail(file, line, "%s failed with %s but usmipc_last_error() is empty",
              what, usmipc_err_name(r));
  if (sentinel_message[0] && strcmp(msg, sentinel_message) == 0)
    test_fail(file, line,
              "%s failed with %s but left no message of its own "
              "(usmipc_last_error() still says \"%s\")",
              what, usmipc_err_name(r), msg);
}

void test_error_sentinel(void) {
  /* A failure no test asserts on: a fill with no queue. */
  int r = usmipc_memset(NULL, NULL, 0, 1);
  ASSERT_MSG(r != 0, "usmipc_memset(NULL queue) succeeded");
  /* Recorded once per process, not before every check. */
  static int probed;
  if (getenv("USMIPC_TEST_PROBE") != NULL &&
      !__atomic_exchange_n(&probed, 1, __ATOMIC_RELAXED))
    PROBE_ERR("usmipc_memset(NULL, NULL, 0, 1) (the sentinel)", r);
  snprintf(sentinel_message, sizeof(sentinel_message), "%s",
           usmipc_last_error());
}

void test_skip_note(const char *fmt, ...) {
  va_list ap;
  printf("SKIP: ");
  va_start(ap, fmt);
  vprintf(fmt, ap);
  va_end(ap);
  printf("\n");
  fflush(stdout);
}

/* ---- patterns ------------------------------------------------------------ */

static uint64_t mix64(uint64_t x) { /* splitmix64's finalizer */
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

static uint64_t pattern_word(uint64_t seed, uint64_t w) {
  return mix64(seed * 0x100000001b3ull ^ w);
}

uint8_t pattern_byte(uint64_t seed, uint64_t j) {
  return (uint8_t)(pattern_word(seed, j >> 3) >> ((j & 7) * 8));
}

void pattern_fill(void *p, size_t n, uint64_t seed, uint64_t origin) {
  uint8_t *b = p;
  size_t i = 0;
  while (i < n && ((origin + i) & 7) != 0) {
    b[i] = pattern_byte(seed, origin + i);
    i++;
  }
  for (; i + 8 <= n; i += 8) {
    uint64_t w = pattern_word(seed, (origin + i) >> 3);
    for (int k = 0; k < 8; k++)
      b[i + k] = (uint8_t)(w >> (k * 8));
  }
  for (; i < n; i++)
    b[i] = pattern_byte(seed, origin + i);
}

size_t pattern_check(const void *p, size_t n, uint64_t seed, uint64_t origin) {
  const uint8_t *b = p;
  size_t i = 0;
  while (i < n && ((origin + i) & 7) != 0) {
    if (b[i] != pattern_byte(seed, origin + i))
      return i;
    i++;
  }
  for (; i + 8 <= n; i += 8) {
    uint64_t w = pattern_word(seed, (origin + i) >> 3);
    for (int k = 0; k < 8; k++)
      if (b[i + k] != (uint8_t)(w >> (k * 8)))
        return i + (size_t)k;
  }
  for (; i < n; i++)
    if (b[i] != pattern_byte(seed, origin + i))
      return i;
  return SIZE_MAX;
}

static usmipc_queue_t *staging_queue(void) {
  static usmipc_queue_t *q;
  if (q == NULL)
    ASSERT_OK(usmipc_queue_create(test_device(), &q));
  return q;
}

void dev_fill_on(usmipc_queue_t *q, void *p, size_t n, uint64_t seed,
                 uint64_t origin) {
  if (test_device_is_host()) {
    pattern_fill(p, n, seed, origin);
    return;
  }
  ASSERT_NOT_NULL(q);
  uint8_t *stage = malloc(n ? n : 1);
  ASSERT_NOT_NULL(stage);
  pattern_fill(stage, n, seed, origin);
  ASSERT_OK(usmipc_memcpy(q, p, stage, n));
  ASSERT_OK(usmipc_queue_synchronize(q));
  free(stage);
}

size_t dev_check_on(usmipc_queue_t *q, const void *p, size_t n, uint64_t seed,
                    uint64_t origin) {
  if (test_device_is_host())
    return pattern_check(p, n, seed, origin);
  ASSERT_NOT_NULL(q);
  uint8_t *stage = malloc(n ? n : 1);
  ASSERT_NOT_NULL(stage);
  ASSERT_OK(usmipc_memcpy(q, stage, p, n));
  ASSERT_OK(usmipc_queue_synchronize(q));
  size_t bad = pattern_check(stage, n, seed, origin);
  free(stage);
  return bad;
}

void dev_fill(void *p, size_t n, uint64_t seed, uint64_t origin) {
  dev_fill_on(test_device_is_host() ? NULL : staging_queue(), p, n, seed,
              origin);
}

size_t dev_check(const void *p, size_t n, uint64_t seed, uint64_t origin) {
  return dev_check_on(test_device_is_host() ? NULL : staging_queue(), p, n,
                      seed, origin);
}

/* ---- utilities ----------------------------------------------------------- */

const char *test_device_filter(void) {
  const char *f = getenv("USMIPC_TEST_DEVICE");
  return f && f[0] ? f : "host:cpu";
}

usmipc_device_t *test_device(void) {
  usmipc_device_t *dev = NULL;
  int r = usmipc_device_select(test_device_filter(), &dev);
  ASSERT_MSG(r == 0, "usmipc_device_select(\"%s\"): %s: %s",
             test_device_filter(), usmipc_err_name(r), usmipc_last_error());
  ASSERT_NOT_NULL(dev);
  return dev;
}

int test_device_is_host(void) {
  return usmipc_device_backend(test_device()) == USMIPC_BACKEND_HOST;
}

usmipc_device_t *host_device(void) {
  usmipc_device_t *dev = NULL;
  int r = usmipc_device_select("host:cpu", &dev);
  ASSERT_MSG(r == 0, "usmipc_device_select(\"host:cpu\"): %s: %s",
             usmipc_err_name(r), usmipc_last_error());
  ASSERT_NOT_NULL(dev);
  return dev;
}

void hex_encode(const void *data, size_t len, char *out) {
  static const char digits[] = "0123456789abcdef";
  const uint8_t *b = data;
  for (size_t i = 0; i < len; i++) {
    out[2 * i] = digits[b[i] >> 4];
    out[2 * i + 1] = digits[b[i] & 15];
  }
  out[2 * len] = '\0';
}

static int hex_digit(char c) {
  if (c >= '0' && c <= '9')
    return c - '0';
  if (c >= 'a' && c <= 'f')
    return c - 'a' + 10;
  if (c >= 'A' && c <= 'F')
    return c - 'A' + 10;
  return -1;
}

ssize_t hex_decode(const char *hex, void *out, size_t cap) {
  size_t n = strcspn(hex, " \n");
  if (n % 2 != 0 || n / 2 > cap)
    return -1;
  uint8_t *b = out;
  for (size_t i = 0; i < n / 2; i++) {
    int hi = hex_digit(hex[2 * i]), lo = hex_digit(hex[2 * i + 1]);
    if (hi < 0 || lo < 0)
      return -1;
    b[i] = (uint8_t)(hi << 4 | lo);
  }
  return (ssize_t)(n / 2);
}

size_t count_fds(void) {
  DIR *d = opendir("/proc/self/fd");
  ASSERT_NOT_NULL(d);
  size_t n = 0;
  struct dirent *e;
  while ((e = readdir(d)) != NULL)
    if (e->d_name[0] != '.')
      n++;
  closedir(d);
  return n - 1; /* the directory's own descriptor */
}

size_t count_fds_settled(size_t want) {
  size_t n = count_fds();
  for (int i = 0; i < 300 && n != want; i++) {
    usleep(10000);
    n = count_fds();
  }
  return n;
}

size_t count_fds_except_sockets(void) {
  DIR *d = opendir("/proc/self/fd");
  ASSERT_NOT_NULL(d);
  size_t n = 0;
  struct dirent *e;
  while ((e = readdir(d)) != NULL) {
    if (e->d_name[0] == '.' || atoi(e->d_name) == dirfd(d))
      continue;
    char target[64];
    ssize_t len = readlinkat(dirfd(d), e->d_name, target, sizeof(target) - 1);
    if (len < 0) /* closed meanwhile (another thread) */
      continue;
    target[len] = '\0';
    if (strncmp(target, "socket:", 7) != 0)
      n++;
  }
  closedir(d);
  return n;
}

size_t count_maps_matching(const char *needle) {
  /* Read with read(2) into one buffer: stdio would allocate (and, under
   * ASan, map) while we count. */
  static char buf[1 << 22];
  int fd = open("/proc/self/maps", O_RDONLY | O_CLOEXEC);
  ASSERT(fd >= 0);
  size_t len = 0;
  ssize_t n;
  while (len < sizeof(buf) - 1 &&
         (n = read(fd, buf + len, sizeof(buf) - 1 - len)) > 0)
    len += (size_t)n;
  close(fd);
  ASSERT_MSG(len < sizeof(buf) - 1, "/proc/self/maps larger than 4 MiB");
  buf[len] = '\0';
  size_t count = 0;
  char *line = buf;
  while (*line) {
    char *end = strchr(line, '\n');
    if (end)
      *end = '\0';
    if (needle == NULL || strstr(line, needle) != NULL)
      count++;
    if (!end)
      break;
    line = end + 1;
  }
  return count;
}

size_t count_maps(void) { return count_maps_matching(NULL); }

int address_mapped(const void *p) {
  static char buf[1 << 22];
  int fd = open("/proc/self/maps", O_RDONLY | O_CLOEXEC);
  ASSERT(fd >= 0);
  size_t len = 0;
  ssize_t n;
  while (len < sizeof(buf) - 1 &&
         (n = read(fd, buf + len, sizeof(buf) - 1 - len)) > 0)
    len += (size_t)n;
  close(fd);
  buf[len] = '\0';
  uintptr_t a = (uintptr_t)p;
  for (char *line = buf; line && *line;) {
    char *end;
    uintptr_t lo = (uintptr_t)strtoull(line, &end, 16);
    uintptr_t hi = (uintptr_t)strtoull(end + 1, NULL, 16);
    if (a >= lo && a < hi)
      return 1;
    line = strchr(line, '\n');
    if (line)
      line++;
  }
  return 0;
}

int running_as_root(void) { return geteuid() == 0; }

int pidfd_supported(void) {
  /* Yama (Documentation/admin-guide/LSM/Yama.rst): scope 1 lets a process
   * ptrace only its descendants, and the agents are siblings; root keeps
   * CAP_SYS_PTRACE up to scope 2; scope 3 forbids ptrace altogether. */
  int fd = open("/proc/sys/kernel/yama/ptrace_scope", O_RDONLY | O_CLOEXEC);
  if (fd >= 0) {
    char c = '0';
    if (read(fd, &c, 1) != 1)
      c = '0';
    close(fd);
    if (c == '3' || (c >= '1' && geteuid() != 0))
      return 0;
  }
  int pfd = (int)syscall(SYS_pidfd_open, getpid(), 0);
  if (pfd < 0)
    return 0;
  fd = (int)syscall(SYS_pidfd_getfd, pfd, 0, 0);
  int e = errno;
  close(pfd);
  if (fd >= 0) {
    close(fd);
    return 1;
  }
  /* EBADF (no fd 0) still proves the call exists and is allowed. */
  return e != ENOSYS && e != EPERM;
}

double now_seconds(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

void sleep_ms(unsigned ms) {
  struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
  while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
  }
}

usmipc_ipc_handle_t *export_copy(const void *ptr, size_t nbytes, uint8_t **data,
                                 size_t *len) {
  usmipc_ipc_handle_t *h = NULL;
  const void *d = NULL;
  ASSERT_OK(usmipc_ipc_get_handle(ptr, nbytes, &h));
  ASSERT_OK(usmipc_ipc_handle_data(h, &d, len));
  ASSERT_GT(*len, 0);
  *data = malloc(*len);
  ASSERT_NOT_NULL(*data);
  memcpy(*data, d, *len);
  return h;
}

/* ---- processes ----------------------------------------------------------- */

static char **build_env(const char *const overrides[]) {
  size_t n = 0, k = 0;
  while (environ[n])
    n++;
  while (overrides && overrides[k])
    k++;
  char **env = calloc(n + k + 1, sizeof(char *));
  ASSERT_NOT_NULL(env);
  size_t m = 0;
  for (size_t i = 0; i < n; i++) {
    int replaced = 0;
    for (size_t j = 0; j < k; j++) {
      size_t name_len = strcspn(overrides[j], "=");
      if (strncmp(environ[i], overrides[j], name_len) == 0 &&
          environ[i][name_len] == '=')
        replaced = 1;
    }
    if (!replaced)
      env[m++] = environ[i];
  }
  for (size_t j = 0; j < k; j++)
    if (strchr(overrides[j], '=') != NULL)
      env[m++] = (char *)overrides[j];
  env[m] = NULL;
  return env;
}

pid_t spawn_helper(const char *name, char *const extra_args[],
                   const char *const env_overrides[], int *to_child,
                   int *from_child) {
  int in[2] = {-1, -1}, out[2] = {-1, -1};
  /* O_CLOEXEC: a second helper must not inherit the first one's pipe ends,
   * or the first would never see EOF. dup2 onto 0/1 clears the flag. */
  if (to_child)
    ASSERT_EQ(pipe2(in, O_CLOEXEC), 0);
  if (from_child)
    ASSERT_EQ(pipe2(out, O_CLOEXEC), 0);

  char ppid[32];
  snprintf(ppid, sizeof(ppid), "%d", (int)getpid());
  char *argv[32];
  int argc = 0;
  argv[argc++] = "/proc/self/exe";
  argv[argc++] = "--helper";
  argv[argc++] = (char *)name;
  argv[argc++] = ppid;
  for (int i = 0; extra_args && extra_args[i] && argc < 31; i++)
    argv[argc++] = extra_args[i];
  argv[argc] = NULL;

  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  if (to_child)
    posix_spawn_file_actions_adddup2(&fa, in[0], 0);
  if (from_child)
    posix_spawn_file_actions_adddup2(&fa, out[1], 1);
  char **env = build_env(env_overrides);
  pid_t pid;
  int err = posix_spawn(&pid, "/proc/self/exe", &fa, NULL, argv, env);
  posix_spawn_file_actions_destroy(&fa);
  free(env);
  ASSERT_MSG(err == 0, "posix_spawn helper %s: %s", name, strerror(err));
  if (to_child) {
    close(in[0]);
    *to_child = in[1];
  }
  if (from_child) {
    close(out[1]);
    *from_child = out[0];
  }
  return pid;
}

typedef struct stepper {
  void (*step)(void *);
  void *arg;
  int stop;
} stepper_t;

static void *step_until_stopped(void *p) {
  stepper_t *s = p;
  while (!__atomic_load_n(&s->stop, __ATOMIC_ACQUIRE))
    s->step(s->arg);
  return NULL;
}

void fork_beside_thread(void (*step)(void *), void *arg, int forks,
                        int (*child)(void *), void *child_arg) {
  stepper_t s = {step, arg, 0};
  pthread_t t;
  ASSERT_EQ(pthread_create(&t, NULL, step_until_stopped, &s), 0);
  for (int i = 0; i < forks; i++) {
    pid_t pid = fork();
    if (pid == 0)
      _exit(child(child_arg) == 0 ? 0 : 1);
    ASSERT_GT(pid, 0);
    ASSERT_EQ(exit_code_of(wait_pid_timeout(pid, 10)), 0);
  }
  __atomic_store_n(&s.stop, 1, __ATOMIC_RELEASE);
  pthread_join(t, NULL);
}

int read_full(int fd, void *p, size_t n) {
  while (n > 0) {
    ssize_t r = read(fd, p, n);
    if (r <= 0)
      return -1;
    p = (uint8_t *)p + r;
    n -= (size_t)r;
  }
  return 0;
}

int wait_pid_timeout(pid_t pid, double timeout_s) {
  double deadline = now_seconds() + timeout_s;
  unsigned delay = 1;
  for (;;) {
    int status;
    pid_t r = waitpid(pid, &status, WNOHANG);
    if (r == pid)
      return status;
    if (r < 0 && errno != EINTR)
      return -2;
    if (now_seconds() > deadline) {
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
      return -1;
    }
    sleep_ms(delay);
    if (delay < 20)
      delay *= 2;
  }
}

int exit_code_of(int status) {
  if (status < 0)
    return -1;
  if (WIFEXITED(status))
    return WEXITSTATUS(status);
  return 128 + WTERMSIG(status);
}

/* ---- agent client -------------------------------------------------------- */

void agent_start(agent_t *a, const char *transport) {
  char setting[64];
  const char *env[2] = {NULL, NULL};
  if (transport != NULL) {
    if (strcmp(transport, "auto") == 0) {
      env[0] = "USMIPC_FD_TRANSPORT"; /* unset: the library's default */
    } else {
      snprintf(setting, sizeof(setting), "USMIPC_FD_TRANSPORT=%s", transport);
      env[0] = setting;
    }
  }
  int from;
  memset(a, 0, sizeof(*a));
  a->pid = spawn_helper("agent", NULL, env, &a->to_fd, &from);
  a->from = fdopen(from, "r");
  ASSERT_NOT_NULL(a->from);
}

int agent_call(agent_t *a, const char *fmt, ...) {
  char cmd[8192];
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(cmd, sizeof(cmd) - 1, fmt, ap);
  va_end(ap);
  ASSERT(n > 0 && (size_t)n < sizeof(cmd) - 1);
  cmd[n++] = '\n';
  for (int off = 0; off < n;) {
    ssize_t w = write(a->to_fd, cmd + off, (size_t)(n - off));
    if (w < 0 && errno == EINTR)
      continue;
    ASSERT_MSG(w > 0, "agent %d is gone (write: %s) before \"%.*s\"",
               (int)a->pid, strerror(errno), n - 1, cmd);
    off += (int)w;
  }
  if (fgets(a->reply, sizeof(a->reply), a->from) == NULL) {
    int status = wait_pid_timeout(a->pid, 5);
    test_fail(__FILE__, __LINE__,
              "agent %d died (status %d) without answering \"%.*s\"",
              (int)a->pid, exit_code_of(status), n - 1, cmd);
  }
  cmd[n - 1] = '\0';
  return agent_parse_reply(a, cmd);
}

int agent_parse_reply(agent_t *a, const char *cmd) {
  a->reply[strcspn(a->reply, "\n")] = '\0';
  if (strncmp(a->reply, "ok", 2) == 0 &&
      (a->reply[2] == '\0' || a->reply[2] == ' ')) {
    size_t skip = a->reply[2] ? 3 : 2;
    memmove(a->reply, a->reply + skip, strlen(a->reply + skip) + 1);
    return 0;
  }
  if (strncmp(a->reply, "err ", 4) == 0) {
    memmove(a->reply, a->reply + 4, strlen(a->reply + 4) + 1);
    int code = (int)strtol(a->reply, NULL, 10);
    return code != 0 ? code : -1;
  }
  test_fail(__FILE__, __LINE__, "agent %d: bad reply \"%s\" to \"%s\"",
            (int)a->pid, a->reply, cmd);
}

void agent_check_error(const char *file, int line, const agent_t *a,
                       const char *what, int r, int c1, int c2, int c3) {
  if (getenv("USMIPC_TEST_PROBE") != NULL) {
    /* The reply is "CODE NAME message": the probe keeps the message. */
    const char *m = strchr(a->reply, ' ');
    m = m ? strchr(m + 1, ' ') : NULL;
    char agent_what[1024];
    snprintf(agent_what, sizeof(agent_what), "agent %s", what);
    probe_record(file, line, agent_what, r, m ? m + 1 : a->reply);
  }
  if (r != c1 && r != c2 && r != c3)
    test_fail(file, line, "agent %d: got %d (%s), expected %s/%s/%s; reply: %s",
              (int)a->pid, r, r ? usmipc_err_name(r) : "success",
              usmipc_err_name(c1), usmipc_err_name(c2), usmipc_err_name(c3),
              a->reply);
  /* reply: "CODE NAME message..." */
  const char *s = strchr(a->reply, ' ');
  s = s ? strchr(s + 1, ' ') : NULL;
  while (s && *s == ' ')
    s++;
  if (s == NULL || *s == '\0')
    test_fail(file, line, "agent %d: %s came with an empty message",
              (int)a->pid, usmipc_err_name(r));
}

int agent_stop(agent_t *a) {
  static const char cmd[] = "exit\n";
  if (write(a->to_fd, cmd, sizeof(cmd) - 1) < 0) {
    /* already gone; reap below */
  }
  close(a->to_fd);
  fclose(a->from);
  int status = wait_pid_timeout(a->pid, 10);
  a->pid = 0;
  return status;
}

void agent_stop_ok(agent_t *a) {
  pid_t pid = a->pid;
  int status = agent_stop(a);
  ASSERT_MSG(exit_code_of(status) == 0, "agent %d exited with status %d",
             (int)pid, exit_code_of(status));
}

void agent_kill(agent_t *a) {
  kill(a->pid, SIGKILL);
  int status;
  while (waitpid(a->pid, &status, 0) < 0 && errno == EINTR) {
  }
  close(a->to_fd);
  fclose(a->from);
  a->pid = 0;
}

void *agent_reply_ptr(const agent_t *a) {
  return (void *)(uintptr_t)strtoull(a->reply, NULL, 16);
}
