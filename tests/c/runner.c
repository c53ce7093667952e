/* usmipc_tests: the C test runner (libuv's test/runner.c is the model).
 *
 *   usmipc_tests                 run every test, each in its own process
 *                                with a timeout; print "ok N name" /
 *                                "not ok N name" and "N passed, N failed"
 *   usmipc_tests NAME            run one test in this process (CTest runs
 *                                each test this way; good under a debugger)
 *   usmipc_tests --list          print the test names
 *   usmipc_tests --helper NAME [PPID ARGS...]
 *                                run a helper role: the other side of an IPC
 *                                test, started by re-executing this binary
 *
 * A test that passes returns 0; one that cannot run here returns TEST_SKIP
 * (exit status 77, counted as passed); a failed assertion ends the process
 * with status 1. USMIPC_TEST_TIMEOUT sets the per-test limit in seconds. */
#include <errno.h>
#include <execinfo.h>
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "task.h"
#include "test_list.h"

extern char **environ;

#define X(name) TEST_IMPL(name);
TEST_LIST(X)
#undef X
#define X(name) HELPER_IMPL(name);
HELPER_LIST(X)
#undef X

typedef struct test_entry {
  const char *name;
  int (*fn)(void);
} test_entry_t;

typedef struct helper_entry {
  const char *name;
  int (*fn)(int argc, char **argv);
} helper_entry_t;

static const test_entry_t tests[] = {
#define X(name) {#name, test_##name},
    TEST_LIST(X)
#undef X
};

static const helper_entry_t helpers[] = {
#define X(name) {#name, helper_##name},
    HELPER_LIST(X)
#undef X
};

/* Tests that need more than the default limit (CMakeLists.txt gives them a
 * longer CTest TIMEOUT; they raise their own alarm): run_all waits up to
 * SLOW_TEST_TIMEOUT for them. */
#define SLOW_TEST_TIMEOUT 300
static const char *const slow_tests[] = {"trust_fork_storm",
                                         "trust_idle_cache_drop_freed",
                                         "trust_idle_cache_byte_cap"};

static int is_slow(const char *name) {
  for (size_t i = 0; i < sizeof(slow_tests) / sizeof(slow_tests[0]); i++)
    if (strcmp(slow_tests[i], name) == 0)
      return 1;
  return 0;
}

static unsigned timeout_seconds(void) {
  const char *s = getenv("USMIPC_TEST_TIMEOUT");
  long v = s ? strtol(s, NULL, 10) : 0;
  return v > 0 ? (unsigned)v : TEST_DEFAULT_TIMEOUT;
}

static const test_entry_t *find_test(const char *name) {
  for (size_t i = 0; i < sizeof(tests) / sizeof(tests[0]); i++)
    if (strcmp(tests[i].name, name) == 0)
      return &tests[i];
  return NULL;
}

/* A test that crashes prints where (the frames of the crashing thread:
 * exported functions by name, others as library+offset for addr2line),
 * then dies of the same signal. The sanitizers' own reports are better:
 * their handlers stay. */
#if !defined(__SANITIZE_ADDRESS__) && !defined(__SANITIZE_THREAD__)
static void crash_report(int sig) {
  static const char head[] = "usmipc_tests: crashed; backtrace:\n";
  void *frames[64];
  (void)!write(STDERR_FILENO, head, sizeof(head) - 1);
  backtrace_symbols_fd(frames, backtrace(frames, 64), STDERR_FILENO);
  raise(sig); /* SA_RESETHAND: the default action now */
}

static void catch_crashes(void) {
  static char stack[1 << 16];
  stack_t ss = {.ss_sp = stack, .ss_size = sizeof(stack)};
  sigaltstack(&ss, NULL);
  struct sigaction sa = {.sa_handler = crash_report,
                         .sa_flags = SA_RESETHAND | SA_ONSTACK};
  int sigs[] = {SIGSEGV, SIGBUS, SIGILL, SIGFPE};
  for (size_t i = 0; i < sizeof(sigs) / sizeof(sigs[0]); i++)
    sigaction(sigs[i], &sa, NULL);
  void *warm[1];
  backtrace(warm, 1); /* loads libgcc now, not inside the handler */
}
#else
static void catch_crashes(void) {}
#endif

/* In-process: the test's own process, under an alarm so that a hang ends it
 * even when no runner watches (helpers die with it: PR_SET_PDEATHSIG). */
static int run_one(const char *name) {
  const test_entry_t *t = find_test(name);
  if (t == NULL) {
    fprintf(stderr, "usmipc_tests: no test named \"%s\" (try --list)\n", name);
    return 2;
  }
  /* A helper that died must not kill the test through a write to its pipe:
   * the write fails with EPIPE and the test reports it. */
  signal(SIGPIPE, SIG_IGN);
  setvbuf(stdout, NULL, _IOLBF, 0);
  catch_crashes();
  alarm(timeout_seconds());
  /* The behaviour probe's records name the test; its helpers learn it
   * from the environment they inherit. */
  probe_set_test(t->name);
  if (getenv("USMIPC_TEST_PROBE") != NULL)
    setenv("USMIPC_TEST_PROBE_TEST", t->name, 1);
  int r = t->fn();
  fflush(stdout);
  fflush(stderr);
  if (r == TEST_SKIP)
    return TEST_SKIP;
  return r == 0 ? 0 : 1;
}

static int run_helper(int argc, char **argv) {
  /* argv: NAME PPID ARGS... The helper dies with the process that started
   * it, so a failed or timed-out test leaves no orphans. */
  if (argc < 1) {
    fprintf(stderr, "usmipc_tests --helper NAME [PPID ARGS...]\n");
    return 2;
  }
  const char *name = argv[0];
  static char probe_name[256];
  const char *of_test = getenv("USMIPC_TEST_PROBE_TEST");
  snprintf(probe_name, sizeof(probe_name), "%s/%s", of_test ? of_test : "?",
           name);
  probe_set_test(probe_name);
  if (argc >= 2) {
    pid_t ppid = (pid_t)strtol(argv[1], NULL, 10);
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (ppid > 0 && getppid() != ppid)
      return 3; /* the parent died before we could watch it */
  }
  signal(SIGPIPE, SIG_IGN);
  alarm(timeout_seconds() * 2);
  for (size_t i = 0; i < sizeof(helpers) / sizeof(helpers[0]); i++)
    if (strcmp(helpers[i].name, name) == 0)
      return helpers[i].fn(argc > 2 ? argc - 2 : 0,
                           argc > 2 ? argv + 2 : argv + argc);
  fprintf(stderr, "usmipc_tests: no helper named \"%s\"\n", name);
  return 2;
}

/* Prints the captured output of a test, each line as a TAP comment. */
static void print_output(int fd) {
  char buf[4096];
  ssize_t n;
  int at_line_start = 1;
  lseek(fd, 0, SEEK_SET);
  while ((n = read(fd, buf, sizeof(buf))) > 0) {
    for (ssize_t i = 0; i < n; i++) {
      if (at_line_start)
        fputs("# ", stdout);
      putchar(buf[i]);
      at_line_start = buf[i] == '\n';
    }
  }
  if (!at_line_start)
    putchar('\n');
}

/* Looks for the "SKIP: reason" line a skipped test printed. */
static void skip_reason(int fd, char *out, size_t cap) {
  char buf[8192];
  ssize_t n = pread(fd, buf, sizeof(buf) - 1, 0);
  out[0] = '\0';
  if (n <= 0)
    return;
  buf[n] = '\0';
  char *s = strstr(buf, "SKIP: ");
  if (s == NULL)
    return;
  s += 6;
  size_t len = strcspn(s, "\n");
  if (len >= cap)
    len = cap - 1;
  memcpy(out, s, len);
  out[len] = '\0';
}

/* Runs `/proc/self/exe NAME` in a new process group with a timeout; the
 * whole group (the test and any helper it left) is killed afterwards. */
static int run_isolated(const test_entry_t *t, int number, unsigned timeout) {
  int out = memfd_create("usmipc-test-output", MFD_CLOEXEC);
  if (out < 0) {
    perror("memfd_create");
    return 1;
  }
  posix_spawn_file_actions_t fa;
  posix_spawnattr_t attr;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 0, "/dev/null", O_RDONLY, 0);
  posix_spawn_file_actions_adddup2(&fa, out, 1);
  posix_spawn_file_actions_adddup2(&fa, out, 2);
  posix_spawnattr_init(&attr);
  posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETPGROUP);
  posix_spawnattr_setpgroup(&attr, 0);
  char *argv[] = {"/proc/self/exe", (char *)t->name, NULL};
  pid_t pid;
  double start = now_seconds();
  int err = posix_spawn(&pid, "/proc/self/exe", &fa, &attr, argv, environ);
  posix_spawn_file_actions_destroy(&fa);
  posix_spawnattr_destroy(&attr);
  if (err != 0) {
    printf("not ok %d %s (spawn: %s)\n", number, t->name, strerror(err));
    close(out);
    return 1;
  }
  int status = wait_pid_timeout(pid, timeout);
  double elapsed = now_seconds() - start;
  kill(-pid, SIGKILL); /* stray helpers of this test; ESRCH when none */

  int failed = 1;
  char why[256];
  if (status == -1 || (WIFSIGNALED(status) && WTERMSIG(status) == SIGALRM)) {
    /* The runner's deadline, or the test's own alarm (run_one) just before. */
    snprintf(why, sizeof(why), "timed out after %u s", timeout);
  } else if (WIFSIGNALED(status)) {
    snprintf(why, sizeof(why), "killed by signal %d (%s)", WTERMSIG(status),
             strsignal(WTERMSIG(status)));
  } else if (WEXITSTATUS(status) == TEST_SKIP) {
    char reason[200];
    skip_reason(out, reason, sizeof(reason));
    printf("ok %d %s # SKIP %s\n", number, t->name, reason);
    failed = 0;
  } else if (WEXITSTATUS(status) != 0) {
    snprintf(why, sizeof(why), "exit status %d", WEXITSTATUS(status));
  } else {
    printf("ok %d %s\n", number, t->name);
    failed = 0;
  }
  if (elapsed > 5.0)
    printf("# %s took %.1f s\n", t->name, elapsed);
  if (failed) {
    printf("not ok %d %s (%s)\n", number, t->name, why);
    print_output(out);
  }
  fflush(stdout);
  close(out);
  return failed;
}

static int run_all(void) {
  size_t n = sizeof(tests) / sizeof(tests[0]);
  unsigned timeout = timeout_seconds();
  int passed = 0, failed = 0;
  setvbuf(stdout, NULL, _IOLBF, 0);
  double start = now_seconds();
  printf("1..%zu\n", n);
  for (size_t i = 0; i < n; i++) {
    unsigned limit = timeout;
    if (is_slow(tests[i].name) && limit < SLOW_TEST_TIMEOUT)
      limit = SLOW_TEST_TIMEOUT;
    if (run_isolated(&tests[i], (int)i + 1, limit))
      failed++;
    else
      passed++;
  }
  printf("# %zu tests in %.2f s\n", n, now_seconds() - start);
  printf("%d passed, %d failed\n", passed, failed);
  return failed ? 1 : 0;
}

int main(int argc, char **argv) {
  if (argc >= 2 && strcmp(argv[1], "--helper") == 0)
    return run_helper(argc - 2, argv + 2);
  if (argc >= 2 && strcmp(argv[1], "--list") == 0) {
    for (size_t i = 0; i < sizeof(tests) / sizeof(tests[0]); i++)
      printf("%s\n", tests[i].name);
    return 0;
  }
  if (argc >= 2 &&
      (strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0)) {
    printf("usage: usmipc_tests [--list | NAME | --helper NAME ...]\n");
    return 0;
  }
  if (argc >= 2)
    return run_one(argv[1]);
  return run_all();
}
