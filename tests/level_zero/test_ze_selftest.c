/* The Level Zero self-test on first IPC use (src/backend/level_zero.c, "the
 * self-test"), forced on the test driver with USMIPC_ZE_SELFTEST=1: it
 * passes on a working driver and leaves its verdict for later processes; a
 * driver that maps the wrong memory (USMIPC_ZE_TEST_BROKEN_OPEN=1 in the
 * importing process) fails it, and IPC is then unavailable with the reason;
 * a missing helper makes IPC unavailable with what to do. Each case runs in
 * a fresh process, since the verdict is kept per process. CTest:
 * level_zero.selftest (needs USMIPC_HELPER = build/usmipc-helper). */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "../c/probe.h" /* the behaviour probe's records */
#include "usmipc.h"

#define CHECK(cond, ...)                                                       \
  do {                                                                         \
    if (!(cond)) {                                                             \
      fprintf(stderr, "    %s:%d: %s: ", __FILE__, __LINE__, #cond);           \
      fprintf(stderr, __VA_ARGS__);                                            \
      fputc('\n', stderr);                                                     \
      _exit(1);                                                                \
    }                                                                          \
  } while (0)

static char cache_dir[64];

/* The verdict file the self-test left in cache_dir ("" if none). */
static void verdict(char *out, size_t len) {
  out[0] = '\0';
  char cmd[160];
  snprintf(cmd, sizeof(cmd), "cat %s/usmipc-ze-selftest-* 2>/dev/null",
           cache_dir);
  FILE *f = popen(cmd, "r");
  if (f && fgets(out, (int)len, f) == NULL)
    out[0] = '\0';
  if (f)
    pclose(f);
  out[strcspn(out, "\n")] = '\0';
}

static usmipc_device_t *gpu(void) {
  usmipc_device_t *d = NULL;
  CHECK(usmipc_device_select("level_zero:gpu:0", &d) == 0, "%s",
        usmipc_last_error());
  return d;
}

/* A working driver: the aspect holds, export works, "ok" is remembered. */
static void case_pass(void) {
  usmipc_device_t *d = gpu();
  CHECK(usmipc_device_has_ipc(d) == 1, "the self-test failed: %s",
        usmipc_last_error());
  char v[600];
  verdict(v, sizeof(v));
  CHECK(strcmp(v, "ok") == 0, "verdict file: '%s'", v);
  void *p;
  usmipc_ipc_handle_t *h;
  CHECK(usmipc_malloc(d, USMIPC_MEM_DEVICE, 4096, &p) == 0 &&
            usmipc_ipc_get_handle(p, 0, &h) == 0,
        "export after the self-test: %s", usmipc_last_error());
  usmipc_ipc_free_handle(h);
  usmipc_free(p);
}

/* A later process reads the verdict: no helper needed. */
static void case_cached(void) {
  setenv("USMIPC_HELPER", "/nonexistent/usmipc-helper", 1);
  CHECK(usmipc_device_has_ipc(gpu()) == 1,
        "the remembered verdict was not used: %s", usmipc_last_error());
}

/* A driver whose IPC maps other memory: unavailable, with the reason. */
static void case_broken(void) {
  setenv("USMIPC_ZE_TEST_BROKEN_OPEN", "1", 1);
  usmipc_device_t *d = gpu();
  CHECK(usmipc_device_has_ipc(d) == 0, "a broken driver passed");
  void *p;
  usmipc_ipc_handle_t *h;
  CHECK(usmipc_malloc(d, USMIPC_MEM_DEVICE, 4096, &p) == 0, "malloc");
  int rc = usmipc_ipc_get_handle(p, 0, &h);
  PROBE_ERR("usmipc_ipc_get_handle(p, 0, &h) (a broken driver)", rc);
  CHECK(rc == USMIPC_ENOTSUP, "export: %s", usmipc_err_name(rc));
  CHECK(strstr(usmipc_last_error(), "self-test failed") != NULL &&
            strstr(usmipc_last_error(), "read back wrong") != NULL,
        "message: %s", usmipc_last_error());
  printf("    %s\n", usmipc_last_error());
  usmipc_free(p);
  char v[600];
  verdict(v, sizeof(v));
  CHECK(strncmp(v, "fail ", 5) == 0, "verdict file: '%s'", v);
}

/* No helper and no verdict: unavailable, saying what to do. */
static void case_no_helper(void) {
  setenv("USMIPC_HELPER", "/nonexistent/usmipc-helper", 1);
  CHECK(usmipc_device_has_ipc(gpu()) == 0, "passed without a helper");
  void *p;
  usmipc_ipc_handle_t *h;
  CHECK(usmipc_malloc(gpu(), USMIPC_MEM_DEVICE, 4096, &p) == 0, "malloc");
  int rc = usmipc_ipc_get_handle(p, 0, &h);
  PROBE_ERR("usmipc_ipc_get_handle(p, 0, &h) (no helper)", rc);
  CHECK(rc == USMIPC_ENOTSUP &&
            strstr(usmipc_last_error(), "USMIPC_ZE_SELFTEST=0") != NULL,
        "message: %s", usmipc_last_error());
  usmipc_free(p);
  /* Not a verdict on the driver: nothing is remembered. */
  char v[600];
  verdict(v, sizeof(v));
  CHECK(v[0] == '\0', "a failure to run the test was remembered: '%s'", v);
}

/* Skipped when asked: no helper, no verdict file, IPC works. */
static void case_off(void) {
  setenv("USMIPC_ZE_SELFTEST", "0", 1);
  setenv("USMIPC_HELPER", "/nonexistent/usmipc-helper", 1);
  CHECK(usmipc_device_has_ipc(gpu()) == 1, "%s", usmipc_last_error());
  char v[600];
  verdict(v, sizeof(v));
  CHECK(v[0] == '\0', "a verdict was written: '%s'", v);
}

static int run(const char *name, void (*fn)(void), int fresh) {
  if (fresh) {
    char cmd[128];
    snprintf(cmd, sizeof(cmd), "rm -f %s/usmipc-ze-selftest-*", cache_dir);
    if (system(cmd) != 0)
      return 1;
  }
  fflush(stdout);
  pid_t pid = fork();
  if (pid == 0) {
    setenv("USMIPC_ZE_SELFTEST", "1", 1);
    setenv("XDG_RUNTIME_DIR", cache_dir, 1);
    fn();
    _exit(0);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  int ok = WIFEXITED(status) && WEXITSTATUS(status) == 0;
  printf("%s %s\n", ok ? "ok" : "FAIL", name);
  return ok ? 0 : 1;
}

int main(void) {
  probe_set_test("ze_selftest");
  if (getenv("ZE_ENABLE_ALT_DRIVERS") == NULL ||
      getenv("USMIPC_HELPER") == NULL) {
    printf("skipped: ZE_ENABLE_ALT_DRIVERS and USMIPC_HELPER must be set\n");
    return 77;
  }
  snprintf(cache_dir, sizeof(cache_dir), "/tmp/usmipc-selftest-XXXXXX");
  if (mkdtemp(cache_dir) == NULL)
    return 1;
  int failed = 0;
  failed |= run("pass", case_pass, 1);
  failed |= run("cached", case_cached, 0);
  failed |= run("broken", case_broken, 1);
  failed |= run("no_helper", case_no_helper, 1);
  failed |= run("off", case_off, 1);
  char cmd[128];
  snprintf(cmd, sizeof(cmd), "rm -rf %s", cache_dir);
  if (system(cmd) != 0)
    failed = 1;
  return failed;
}
