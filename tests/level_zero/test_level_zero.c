/* The level_zero backend against the real Level Zero loader and the test
 * driver (ze_test_driver.c), across real processes.
 *
 *   test_level_zero              every test, each in a forked process
 *   test_level_zero NAME         one test, in this process
 *   test_level_zero --helper ... a helper role (started by the tests)
 *
 * ZE_ENABLE_ALT_DRIVERS must name the test driver (CTest sets it). Helpers
 * are this binary re-executed, so exporter and importer share nothing but
 * what the handle bytes and the fd transport carry. The last line printed
 * is "N passed, N failed" (", N skipped" when some could not run here).
 */
#include <dirent.h>
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <level_zero/ze_api.h>

#include "usmipc.h"
#include "ze_test_driver.h"

#define USMIPC__FORMAT(f, a) __attribute__((format(printf, f, a)))
#define PASS 0
#define FAIL 1
#define SKIP 77
#define TEST_TIMEOUT_S 60

#define CHECK(cond, ...)                                                       \
  do {                                                                         \
    if (!(cond)) {                                                             \
      fprintf(stderr, "    %s:%d: %s: ", __FILE__, __LINE__, #cond);           \
      fprintf(stderr, __VA_ARGS__);                                            \
      fputc('\n', stderr);                                                     \
      return FAIL;                                                             \
    }                                                                          \
  } while (0)

#define CHECK_OK(call)                                                         \
  do {                                                                         \
    int rc_ = (call);                                                          \
    CHECK(rc_ == 0, "returned %s: %s", usmipc_err_name(rc_),                   \
          usmipc_last_error());                                                \
  } while (0)

#define CHECK_ERR(call, code)                                                  \
  do {                                                                         \
    int rc_ = (call);                                                          \
    CHECK(rc_ == (code), "returned %s, expected %s (%s)",                      \
          usmipc_err_name(rc_), usmipc_err_name(code), usmipc_last_error());   \
    CHECK(strcmp(usmipc_last_error(), "no error recorded on this thread"),    \
          "failed without a message");                                         \
  } while (0)

/* ---- shared helpers ---------------------------------------------------------- */

/* The byte every test expects at offset i of an exported allocation. */
static uint8_t pattern_at(size_t i) { return (uint8_t)(i * 7 + 1); }

static usmipc_device_t *gpu(void) {
  usmipc_device_t *d = NULL;
  if (usmipc_device_select("level_zero:gpu:0", &d) != 0) {
    fprintf(stderr, "    level_zero:gpu:0 unavailable: %s\n",
            usmipc_last_error());
    return NULL;
  }
  return d;
}

static int get_stats(usmipc_ze_test_stats_t *out) {
  const char *path = getenv("ZE_ENABLE_ALT_DRIVERS");
  void *lib = path ? dlopen(path, RTLD_NOW | RTLD_NOLOAD) : NULL;
  usmipc_ze_test_get_stats_fn fn =
      lib ? (usmipc_ze_test_get_stats_fn)dlsym(lib, USMIPC_ZE_TEST_GET_STATS)
          : NULL;
  if (fn == NULL)
    return -1;
  fn(out);
  dlclose(lib);
  return 0;
}

static int count_fds(void) {
  DIR *d = opendir("/proc/self/fd");
  int n = 0;
  if (d == NULL)
    return -1;
  while (readdir(d) != NULL)
    n++;
  closedir(d);
  return n;
}

/* Device memory of nbytes holding pattern_at(i), filled through a queue. */
static int alloc_pattern(usmipc_device_t *dev, size_t nbytes, void **out) {
  uint8_t *host = malloc(nbytes);
  usmipc_queue_t *q = NULL;
  int rc = host ? 0 : USMIPC_ENOMEM;
  for (size_t i = 0; host && i < nbytes; i++)
    host[i] = pattern_at(i);
  if (rc == 0)
    rc = usmipc_malloc(dev, USMIPC_MEM_DEVICE, nbytes, out);
  if (rc == 0)
    rc = usmipc_queue_create(dev, &q);
  if (rc == 0)
    rc = usmipc_memcpy(q, *out, host, nbytes);
  if (rc == 0)
    rc = usmipc_queue_synchronize(q);
  usmipc_queue_destroy(q);
  free(host);
  return rc;
}

/* First offset in [from, from + len) whose byte is not want(i), or -1. */
static long first_mismatch(const uint8_t *p, size_t from, size_t len, int fill) {
  for (size_t i = 0; i < len; i++) {
    uint8_t want = fill >= 0 ? (uint8_t)fill : pattern_at(from + i);
    if (p[i] != want)
      return (long)(from + i);
  }
  return -1;
}

static void to_hex(const void *data, size_t len, char *out) {
  const uint8_t *p = data;
  for (size_t i = 0; i < len; i++)
    sprintf(out + 2 * i, "%02x", p[i]);
  out[2 * len] = '\0';
}

static size_t from_hex(const char *s, uint8_t *out, size_t cap) {
  size_t n = 0;
  unsigned v;
  while (n < cap && sscanf(s + 2 * n, "%2x", &v) == 1)
    out[n++] = (uint8_t)v;
  return n;
}

/* ---- child processes ----------------------------------------------------------- */

typedef struct child {
  pid_t pid;
  FILE *in;  /* to its stdin */
  FILE *out; /* from its stdout */
} child_t;

/* Starts this binary as "--helper args...", with extra environment entries
 * ("NAME=value", or "NAME=" to remove NAME) on top of ours. The environment
 * is built before fork: the child of a threaded process may only exec. */
static int spawn(child_t *c, const char *const *env_extra,
                 const char *const *args) {
  extern char **environ;
  char *argv[16], *envp[256];
  int argc = 0, envc = 0;
  argv[argc++] = "test_level_zero";
  argv[argc++] = "--helper";
  for (int i = 0; args[i] && argc < 15; i++)
    argv[argc++] = (char *)args[i];
  argv[argc] = NULL;
  for (char **e = environ; *e && envc < 200; e++) {
    int overridden = 0;
    for (int i = 0; env_extra && env_extra[i]; i++) {
      size_t n = strcspn(env_extra[i], "=") + 1;
      if (!strncmp(*e, env_extra[i], n))
        overridden = 1;
    }
    if (!overridden)
      envp[envc++] = *e;
  }
  for (int i = 0; env_extra && env_extra[i] && envc < 254; i++)
    if (env_extra[i][strcspn(env_extra[i], "=") + 1] != '\0')
      envp[envc++] = (char *)env_extra[i];
  envp[envc] = NULL;

  int to[2], from[2];
  if (pipe2(to, O_CLOEXEC) != 0 || pipe2(from, O_CLOEXEC) != 0)
    return -1;
  pid_t pid = fork();
  if (pid < 0)
    return -1;
  if (pid == 0) {
    dup2(to[0], 0);
    dup2(from[1], 1);
    execve("/proc/self/exe", argv, envp);
    _exit(127);
  }
  close(to[0]);
  close(from[1]);
  c->pid = pid;
  c->in = fdopen(to[1], "w");
  c->out = fdopen(from[0], "r");
  return c->in && c->out ? 0 : -1;
}

static void child_say(child_t *c, const char *fmt, ...) USMIPC__FORMAT(2, 3);
static void child_say(child_t *c, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vfprintf(c->in, fmt, ap);
  va_end(ap);
  fputc('\n', c->in);
  fflush(c->in);
}

/* The child's next line, without its newline; "" at end of file. */
static const char *child_hear(child_t *c) {
  static char line[4096];
  if (fgets(line, sizeof(line), c->out) == NULL)
    return "";
  line[strcspn(line, "\n")] = '\0';
  return line;
}

/* Closes the pipes and returns the child's exit status (or 128 + signal). */
static int child_end(child_t *c) {
  int status = 0;
  fclose(c->in);
  fclose(c->out);
  while (waitpid(c->pid, &status, 0) < 0 && errno == EINTR)
    ;
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

/* ---- helper roles ----------------------------------------------------------------- */

static int say(const char *fmt, ...) USMIPC__FORMAT(1, 2);
static int say(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vprintf(fmt, ap);
  va_end(ap);
  putchar('\n');
  fflush(stdout);
  return 0;
}

static const char *hear(void) {
  static char line[4096];
  if (fgets(line, sizeof(line), stdin) == NULL)
    return "exit";
  line[strcspn(line, "\n")] = '\0';
  return line;
}

/* export NBYTES OFFSET EXPORT_NBYTES: allocates, fills the pattern, prints
 * "handle HEX" (or "error ERRNAME message"), then serves commands:
 * "check OFF LEN BYTE", "free", "stats", "exit". */
static int helper_export(int argc, char **argv) {
  if (argc < 3)
    return 2;
  size_t nbytes = strtoul(argv[0], NULL, 0), offset = strtoul(argv[1], NULL, 0),
         export_nbytes = strtoul(argv[2], NULL, 0);
  usmipc_device_t *dev = gpu();
  void *p = NULL;
  usmipc_ipc_handle_t *h = NULL;
  const void *data;
  size_t len;
  int rc = dev == NULL ? USMIPC_ENODEV : alloc_pattern(dev, nbytes, &p);
  if (rc == 0)
    rc = usmipc_ipc_get_handle((uint8_t *)p + offset, export_nbytes, &h);
  if (rc == 0)
    rc = usmipc_ipc_handle_data(h, &data, &len);
  if (rc != 0) {
    say("error %s %s", usmipc_err_name(rc), usmipc_last_error());
  } else {
    char hex[1024];
    to_hex(data, len, hex);
    say("handle %s", hex);
    usmipc_ipc_free_handle(h);
  }
  for (;;) {
    const char *cmd = hear();
    size_t off, n;
    int byte;
    if (sscanf(cmd, "check %zu %zu %d", &off, &n, &byte) == 3) {
      long bad = first_mismatch((uint8_t *)p + off, off, n, byte);
      say(bad < 0 ? "ok" : "mismatch at %ld", bad);
    } else if (!strcmp(cmd, "free")) {
      int freed = usmipc_free(p);
      say(freed == 0 ? "freed" : "error %s", usmipc_last_error());
    } else if (!strcmp(cmd, "stats")) {
      usmipc_ze_test_stats_t s;
      if (get_stats(&s) != 0)
        say("error no driver stats");
      else
        say("stats %llu %llu %llu %llu %llu", (unsigned long long)s.ipc_gets,
            (unsigned long long)s.ipc_puts,
            (unsigned long long)s.live_ipc_handles,
            (unsigned long long)s.freed_with_live_handle,
            (unsigned long long)s.fd_queries);
    } else {
      return 0;
    }
  }
}

/* import: reads "handle HEX", opens it on the default device, prints
 * "opened MAPPED OFFSET" (the handle's offset), then serves "verify LEN"
 * (the pattern from the start of the mapping), "write LEN BYTE", "fds"
 * (descriptors open here), "close", "exit". */
static int helper_import(int argc, char **argv) {
  (void)argc;
  (void)argv;
  const char *line = hear();
  uint8_t data[1024];
  if (strncmp(line, "handle ", 7) != 0)
    return 2;
  size_t len = from_hex(line + 7, data, sizeof(data));
  usmipc_ipc_handle_info_t info;
  uint8_t *p = NULL;
  size_t mapped = 0;
  int fds_before = count_fds();
  if (usmipc_ipc_handle_inspect(data, len, &info) != 0 ||
      usmipc_ipc_open(data, len, NULL, 0, (void **)&p, &mapped) != 0) {
    say("error %s %s", usmipc_err_name(usmipc_ipc_open(data, len, NULL, 0,
                                                       (void **)&p, &mapped)),
        usmipc_last_error());
    return 1;
  }
  say("opened %zu %llu %d", mapped, (unsigned long long)info.offset,
      count_fds() - fds_before);
  for (;;) {
    const char *cmd = hear();
    size_t n;
    int byte;
    if (sscanf(cmd, "verify %zu", &n) == 1) {
      long bad = first_mismatch(p, (size_t)info.offset, n, -1);
      say(bad < 0 ? "ok" : "mismatch at %ld", bad);
    } else if (sscanf(cmd, "write %zu %d", &n, &byte) == 2) {
      memset(p, byte, n);
      say("written");
    } else if (!strcmp(cmd, "close")) {
      int rc = usmipc_ipc_close(p);
      usmipc_ipc_set_cache_size(0);
      say(rc == 0 ? "closed %d" : "error %d", count_fds() - fds_before);
    } else {
      return 0;
    }
  }
}

/* status: prints "status ERRNAME REASON" for the level_zero backend. */
static int helper_status(void) {
  const char *reason = NULL;
  int rc = usmipc_backend_status(USMIPC_BACKEND_LEVEL_ZERO, &reason);
  usmipc_device_t *d = NULL;
  int sel = usmipc_device_select("level_zero:gpu", &d);
  say("status %s %s | %s", usmipc_err_name(rc), usmipc_err_name(sel),
      reason ? reason : "");
  return 0;
}

static int helper_main(int argc, char **argv) {
  if (argc < 1)
    return 2;
  if (!strcmp(argv[0], "export"))
    return helper_export(argc - 1, argv + 1);
  if (!strcmp(argv[0], "import"))
    return helper_import(argc - 1, argv + 1);
  if (!strcmp(argv[0], "status"))
    return helper_status();
  return 2;
}

/* ---- tests ------------------------------------------------------------------------- */

static int test_device_listed(void) {
  const char *reason = NULL;
  CHECK_OK(usmipc_backend_status(USMIPC_BACKEND_LEVEL_ZERO, &reason));
  usmipc_device_t *d = gpu(), *again = NULL;
  CHECK(d != NULL, "no level_zero GPU");
  CHECK(!strcmp(usmipc_device_name(d), USMIPC_ZE_TEST_DEVICE_NAME), "name '%s'",
        usmipc_device_name(d));
  CHECK(!strcmp(usmipc_device_filter_string(d), "level_zero:gpu:0"),
        "filter '%s'", usmipc_device_filter_string(d));
  CHECK(usmipc_device_backend(d) == USMIPC_BACKEND_LEVEL_ZERO, "backend");
  CHECK(usmipc_device_type(d) == USMIPC_DEVICE_GPU, "type");
  CHECK(usmipc_device_index(d) == 0, "index %d", usmipc_device_index(d));
  CHECK(usmipc_device_has_ipc(d) == 1, "IPC aspect missing");
  static const uint8_t want[16] = USMIPC_ZE_TEST_DEVICE_UUID;
  uint8_t uuid[16];
  usmipc_device_uuid(d, uuid);
  CHECK(!memcmp(uuid, want, 16), "UUID differs from the driver's");
  CHECK_OK(usmipc_device_select("level_zero:gpu", &again));
  CHECK(again == d, "level_zero:gpu selects another device");
  CHECK_OK(usmipc_device_select("level_zero", &again));
  CHECK(again == d, "level_zero selects another device");
  CHECK_ERR(usmipc_device_select("level_zero:gpu:1", &again), USMIPC_ENODEV);
  return PASS;
}

static int test_alloc_copy_fill(void) {
  usmipc_device_t *d = gpu();
  CHECK(d != NULL, "no device");
  const size_t n = (1 << 20) + 13;
  void *dev = NULL, *host = NULL, *shared = NULL;
  usmipc_queue_t *q = NULL;
  CHECK_OK(usmipc_malloc(d, USMIPC_MEM_DEVICE, n, &dev));
  CHECK_OK(usmipc_malloc(d, USMIPC_MEM_HOST, n, &host));
  CHECK_OK(usmipc_malloc(d, USMIPC_MEM_SHARED, n, &shared));
  CHECK_OK(usmipc_queue_create(d, &q));
  CHECK(usmipc_queue_device(q) == d, "queue device");

  CHECK_OK(usmipc_memset(q, dev, 0x5a, n));
  CHECK_OK(usmipc_memcpy(q, host, dev, n));
  CHECK_OK(usmipc_queue_synchronize(q));
  CHECK(first_mismatch(host, 0, n, 0x5a) < 0, "fill did not reach host memory");

  uint8_t *src = malloc(n), *back = malloc(n);
  CHECK(src && back, "malloc");
  for (size_t i = 0; i < n; i++)
    src[i] = pattern_at(i);
  CHECK_OK(usmipc_memcpy(q, dev, src, n));
  CHECK_OK(usmipc_memcpy(q, shared, dev, n));
  CHECK_OK(usmipc_memcpy(q, back, shared, n));
  CHECK_OK(usmipc_queue_synchronize(q));
  CHECK(first_mismatch(back, 0, n, -1) < 0, "round trip changed the bytes");
  CHECK_OK(usmipc_memset(q, (uint8_t *)dev + 5, 0, 3));
  CHECK_OK(usmipc_memcpy(q, back, dev, 16));
  CHECK(back[4] == pattern_at(4) && back[5] == 0 && back[7] == 0 &&
            back[8] == pattern_at(8),
        "partial fill wrote the wrong bytes");
  free(src);
  free(back);

  /* Each allocation knows its kind and device; an interior pointer its
   * base. */
  usmipc_pointer_info_t info;
  CHECK_OK(usmipc_pointer_query((uint8_t *)dev + 100, &info));
  CHECK(info.kind == USMIPC_MEM_DEVICE && info.device == d &&
            info.base == dev && info.size == n && !info.is_foreign,
        "device pointer info");
  CHECK_OK(usmipc_pointer_query(host, &info));
  CHECK(info.kind == USMIPC_MEM_HOST, "host kind %d", info.kind);
  CHECK_OK(usmipc_pointer_query(shared, &info));
  CHECK(info.kind == USMIPC_MEM_SHARED, "shared kind %d", info.kind);

  usmipc_ze_test_stats_t s;
  CHECK(get_stats(&s) == 0, "no driver stats");
  CHECK(s.live_allocations == 3, "driver holds %llu allocations",
        (unsigned long long)s.live_allocations);
  CHECK_OK(usmipc_queue_destroy(q));
  CHECK_OK(usmipc_free(dev));
  CHECK_OK(usmipc_free(host));
  CHECK_OK(usmipc_free(shared));
  CHECK(get_stats(&s) == 0 && s.live_allocations == 0,
        "driver still holds %llu allocations",
        (unsigned long long)s.live_allocations);
  return PASS;
}

/* Memory that the driver allocated for someone else: the backend describes
 * it through zeMemGetAllocProperties + zeMemGetAddressRange. */
static int test_foreign_pointer(void) {
  usmipc_device_t *d = gpu();
  CHECK(d != NULL, "no device");
  int local = 0;
  usmipc_pointer_info_t info;
  CHECK_ERR(usmipc_pointer_query(&local, &info), USMIPC_EUNKNOWNPTR);
  /* Memory the registry never saw: allocated through the loader directly,
   * as SYCL or PyTorch would (the test links the loader the backend
   * dlopens, so both share one instance). */
  ze_driver_handle_t driver = NULL;
  ze_device_handle_t device = NULL;
  ze_context_handle_t ctx = NULL;
  void *p = NULL;
  uint32_t one = 1;
  ze_context_desc_t cdesc = {.stype = ZE_STRUCTURE_TYPE_CONTEXT_DESC};
  ze_device_mem_alloc_desc_t ddesc = {.stype =
                                          ZE_STRUCTURE_TYPE_DEVICE_MEM_ALLOC_DESC};
  CHECK(zeDriverGet(&one, &driver) == ZE_RESULT_SUCCESS, "zeDriverGet");
  CHECK(zeDeviceGet(driver, &one, &device) == ZE_RESULT_SUCCESS, "zeDeviceGet");
  CHECK(zeContextCreate(driver, &cdesc, &ctx) == ZE_RESULT_SUCCESS,
        "zeContextCreate");
  CHECK(zeMemAllocDevice(ctx, &ddesc, 3 * 4096, 0, device, &p) ==
            ZE_RESULT_SUCCESS,
        "zeMemAllocDevice");
  CHECK_OK(usmipc_pointer_query((uint8_t *)p + 4097, &info));
  CHECK(info.device == d && info.kind == USMIPC_MEM_DEVICE && info.base == p &&
            info.size == 3 * 4096 && info.is_foreign && info.buffer_id != 0,
        "foreign pointer info: device %p kind %d base %p size %zu foreign %d",
        (void *)info.device, info.kind, info.base, info.size, info.is_foreign);
  usmipc_ipc_handle_t *h = NULL;
  CHECK_ERR(usmipc_ipc_get_handle(p, 0, &h), USMIPC_ENOTSUP);
  usmipc_ze_test_stats_t s;
  CHECK(get_stats(&s) == 0 && s.ipc_gets == 0,
        "refusing a foreign export took %llu IPC handles",
        (unsigned long long)s.ipc_gets);
  CHECK(zeMemFree(ctx, p) == ZE_RESULT_SUCCESS, "zeMemFree");
  CHECK(zeContextDestroy(ctx) == ZE_RESULT_SUCCESS, "zeContextDestroy");
  return PASS;
}

static int test_export_refusals(void) {
  usmipc_device_t *d = gpu();
  CHECK(d != NULL, "no device");
  void *host = NULL, *shared = NULL, *dev = NULL;
  usmipc_ipc_handle_t *h = NULL;
  CHECK_OK(usmipc_malloc(d, USMIPC_MEM_HOST, 4096, &host));
  CHECK_OK(usmipc_malloc(d, USMIPC_MEM_SHARED, 4096, &shared));
  CHECK_ERR(usmipc_ipc_get_handle(host, 0, &h), USMIPC_EMEMKIND);
  CHECK_ERR(usmipc_ipc_get_handle(shared, 0, &h), USMIPC_EMEMKIND);
  CHECK(h == NULL, "a handle was returned");

  CHECK_OK(usmipc_malloc(d, USMIPC_MEM_DEVICE, 10000, &dev));
  CHECK_ERR(usmipc_ipc_get_handle(dev, 10001, &h), USMIPC_ERANGE);
  CHECK_ERR(usmipc_ipc_get_handle((uint8_t *)dev + 5000, 5001, &h),
            USMIPC_ERANGE);
  CHECK_OK(usmipc_ipc_get_handle((uint8_t *)dev + 5000, 5000, &h));
  const void *data;
  size_t len;
  void *p = NULL;
  CHECK_OK(usmipc_ipc_handle_data(h, &data, &len));
  CHECK_ERR(usmipc_ipc_open(data, len, NULL, 5001, &p, NULL), USMIPC_ERANGE);
  usmipc_ipc_handle_info_t info;
  CHECK_OK(usmipc_ipc_handle_inspect(data, len, &info));
  CHECK(info.backend == USMIPC_BACKEND_LEVEL_ZERO && info.offset == 5000 &&
            info.nbytes == 5000 && info.allocation_size == 10000 &&
            info.handle_kind == 3,
        "handle info: backend %d offset %llu nbytes %llu kind %u",
        info.backend, (unsigned long long)info.offset,
        (unsigned long long)info.nbytes, info.handle_kind);
  /* Same-process open: the original memory, no driver mapping. */
  CHECK_OK(usmipc_ipc_open(data, len, NULL, 0, &p, NULL));
  CHECK(p == (uint8_t *)dev + 5000, "same-process open returned %p, not %p", p,
        (void *)((uint8_t *)dev + 5000));
  CHECK_OK(usmipc_ipc_close(p));
  CHECK_OK(usmipc_ipc_free_handle(h));

  void *big = NULL;
  CHECK_ERR(usmipc_malloc(d, USMIPC_MEM_DEVICE, USMIPC_ZE_TEST_MAX_ALLOC + 1,
                          &big),
            USMIPC_ENOMEM);
  CHECK(strstr(usmipc_last_error(), "largest allocation") != NULL, "message: %s",
        usmipc_last_error());
  CHECK_OK(usmipc_free(host));
  CHECK_OK(usmipc_free(shared));
  CHECK_OK(usmipc_free(dev));
  usmipc_ze_test_stats_t s;
  CHECK(get_stats(&s) == 0, "no driver stats");
  CHECK(s.ipc_gets == 1 && s.ipc_puts == 1 && s.live_ipc_handles == 0 &&
            s.freed_with_live_handle == 0,
        "gets %llu puts %llu live %llu leaked %llu",
        (unsigned long long)s.ipc_gets, (unsigned long long)s.ipc_puts,
        (unsigned long long)s.live_ipc_handles,
        (unsigned long long)s.freed_with_live_handle);
  return PASS;
}

/* This process exports; a helper imports with the given fd transport. */
static int export_here_import_there(const char *transport) {
  usmipc_device_t *d = gpu();
  CHECK(d != NULL, "no device");
  const size_t n = 4 << 20, offset = (64 << 10) + 3, export_n = 1 << 20;
  uint8_t *p = NULL;
  CHECK_OK(alloc_pattern(d, n, (void **)&p));
  usmipc_ipc_handle_t *h = NULL;
  const void *data;
  size_t len;
  CHECK_OK(usmipc_ipc_get_handle(p + offset, export_n, &h));
  CHECK_OK(usmipc_ipc_handle_data(h, &data, &len));
  char hex[1024], env[64];
  to_hex(data, len, hex);
  snprintf(env, sizeof(env), "USMIPC_FD_TRANSPORT=%s", transport);
  const char *envs[] = {env, NULL};
  const char *args[] = {"import", NULL};
  child_t c;
  CHECK(spawn(&c, envs, args) == 0, "spawn: %s", strerror(errno));
  child_say(&c, "handle %s", hex);
  const char *line = child_hear(&c);
  size_t mapped = 0;
  unsigned long long got_offset = 0;
  int fd_growth = -1;
  CHECK(sscanf(line, "opened %zu %llu %d", &mapped, &got_offset, &fd_growth) ==
            3,
        "importer: '%s'", line);
  CHECK(mapped == export_n && got_offset == offset,
        "mapped %zu at offset %llu", mapped, got_offset);
  /* No descriptor per mapping; at most one per exporter (a pidfd, or the
   * broker connection kept for the next open). */
  CHECK(fd_growth <= 1, "the importer holds %d more descriptors after the open",
        fd_growth);
  child_say(&c, "verify %zu", export_n);
  line = child_hear(&c);
  CHECK(!strcmp(line, "ok"), "importer read: %s", line);
  child_say(&c, "write 4096 195");
  line = child_hear(&c);
  CHECK(!strcmp(line, "written"), "importer: %s", line);
  /* Zero copy: the importer's writes are in this process's memory. */
  CHECK(first_mismatch(p + offset, 0, 4096, 195) < 0,
        "the importer's write is not visible to the exporter");
  CHECK(first_mismatch(p + offset + 4096, offset + 4096, 100, -1) < 0,
        "bytes past the write changed");
  CHECK(p[offset - 1] == pattern_at(offset - 1), "byte before the range");
  child_say(&c, "close");
  line = child_hear(&c);
  /* What stays is at most the one descriptor per exporter seen above. */
  CHECK(!strcmp(line, "closed 0") || !strcmp(line, "closed 1"), "importer: %s",
        line);
  child_say(&c, "exit");
  CHECK(child_end(&c) == 0, "importer failed");
  CHECK_OK(usmipc_ipc_free_handle(h));
  CHECK_OK(usmipc_free(p));
  usmipc_ze_test_stats_t s;
  CHECK(get_stats(&s) == 0, "no driver stats");
  CHECK(s.ipc_gets == 1 && s.ipc_puts == 1 && s.live_ipc_handles == 0 &&
            s.freed_with_live_handle == 0,
        "zeMemPutIpcHandle not called at free: gets %llu puts %llu live %llu "
        "leaked %llu",
        (unsigned long long)s.ipc_gets, (unsigned long long)s.ipc_puts,
        (unsigned long long)s.live_ipc_handles,
        (unsigned long long)s.freed_with_live_handle);
  CHECK(s.fd_queries == 1,
        "zeMemGetFileDescriptorFromIpcHandleExp asked %llu times, not once",
        (unsigned long long)s.fd_queries);
  return PASS;
}

static int test_ipc_socket(void) { return export_here_import_there("socket"); }

/* A helper exports (with env_extra in its environment); this process
 * imports. Returns the child running, after reading its handle. */
static int start_exporter(child_t *c, const char *const *env_extra,
                          const char *nbytes, const char *offset,
                          const char *export_n, uint8_t *data, size_t *len) {
  const char *args[] = {"export", nbytes, offset, export_n, NULL};
  if (spawn(c, env_extra, args) != 0)
    return -1;
  const char *line = child_hear(c);
  if (strncmp(line, "handle ", 7) != 0) {
    fprintf(stderr, "    exporter: '%s'\n", line);
    return -1;
  }
  *len = from_hex(line + 7, data, 1024);
  return 0;
}

/* What the exporter's driver must have seen once the allocation is freed. */
typedef struct expect {
  unsigned long long puts, live, leaked, fd_queries;
} expect_t;
static const expect_t usual = {.puts = 1, .fd_queries = 1};

static int import_from_helper(const char *transport,
                              const char *const *exporter_env,
                              const expect_t *want) {
  if (gpu() == NULL)
    return FAIL;
  setenv("USMIPC_FD_TRANSPORT", transport, 1);
  child_t c;
  uint8_t data[1024];
  size_t len = 0;
  CHECK(start_exporter(&c, exporter_env, "1000000", "4096", "0", data, &len) ==
            0,
        "exporter did not start");
  uint8_t *p = NULL, *again = NULL;
  size_t mapped = 0;
  usmipc_ipc_handle_info_t hinfo;
  CHECK_OK(usmipc_ipc_handle_inspect(data, len, &hinfo));
  /* Kind 3 whatever the driver's layout: no driver bytes cross processes,
   * only the dma-buf and a record of the exporter's driver. */
  CHECK(hinfo.handle_kind == 3, "handle kind %u", hinfo.handle_kind);
  int fds = count_fds();
  int rc = usmipc_ipc_open(data, len, NULL, 0, (void **)&p, &mapped);
  if (rc == USMIPC_EACCES && !strcmp(transport, "pidfd")) {
    fprintf(stderr, "    skipped: %s\n", usmipc_last_error());
    child_say(&c, "exit");
    child_end(&c);
    return SKIP;
  }
  CHECK(rc == 0, "open: %s: %s", usmipc_err_name(rc), usmipc_last_error());
  /* No descriptor is kept per mapping; one per exporter is, for the next
   * open from the same exporter: a pidfd, or the broker connection. */
  int per_exporter = 1;
  CHECK(count_fds() - fds <= per_exporter,
        "the importer holds %d more descriptors (%d allowed)",
        count_fds() - fds, per_exporter);
  CHECK(mapped == 1000000 - 4096, "mapped %zu", mapped);
  CHECK(first_mismatch(p, 4096, mapped, -1) < 0, "pattern differs at %ld",
        first_mismatch(p, 4096, mapped, -1));
  usmipc_pointer_info_t info;
  CHECK_OK(usmipc_pointer_query(p + 10, &info));
  CHECK(info.is_ipc_mapping && info.kind == USMIPC_MEM_DEVICE &&
            info.base == p - 4096 && info.size == 1000000,
        "mapping info: base %p (want %p) size %zu", info.base,
        (void *)(p - 4096), info.size);
  /* The import cache: a second open shares the mapping. */
  usmipc_ze_test_stats_t s;
  CHECK(get_stats(&s) == 0 && s.ipc_opens == 1, "opens %llu",
        (unsigned long long)s.ipc_opens);
  CHECK_OK(usmipc_ipc_open(data, len, NULL, 0, (void **)&again, NULL));
  CHECK(again == p, "second open returned %p, not %p", (void *)again, (void *)p);
  CHECK(get_stats(&s) == 0 && s.ipc_opens == 1, "a cached open reached the "
        "driver (%llu opens)", (unsigned long long)s.ipc_opens);
  memset(p, 0x3c, 512);
  child_say(&c, "check 4096 512 60");
  const char *line = child_hear(&c);
  CHECK(!strcmp(line, "ok"), "exporter sees: %s", line);
  CHECK_OK(usmipc_ipc_close(again));
  CHECK_OK(usmipc_ipc_close(p));
  CHECK_OK(usmipc_ipc_set_cache_size(0));
  CHECK(get_stats(&s) == 0 && s.ipc_closes == 1 && s.live_mappings == 0,
        "closes %llu live mappings %llu", (unsigned long long)s.ipc_closes,
        (unsigned long long)s.live_mappings);
  CHECK(count_fds() - fds <= per_exporter, "descriptors leaked");

  child_say(&c, "free");
  line = child_hear(&c);
  CHECK(!strcmp(line, "freed"), "exporter: %s", line);
  /* A handle of freed memory opens nowhere. */
  CHECK_ERR(usmipc_ipc_open(data, len, NULL, 0, (void **)&p, NULL),
            USMIPC_EEXPORTERGONE);
  child_say(&c, "stats");
  line = child_hear(&c);
  unsigned long long gets, puts, live, leaked, queries;
  CHECK(sscanf(line, "stats %llu %llu %llu %llu %llu", &gets, &puts, &live,
               &leaked, &queries) == 5,
        "exporter: %s", line);
  CHECK(gets == 1 && puts == want->puts && live == want->live &&
            leaked == want->leaked && queries == want->fd_queries,
        "exporter driver: gets %llu puts %llu live %llu leaked %llu fd "
        "queries %llu",
        gets, puts, live, leaked, queries);
  child_say(&c, "exit");
  CHECK(child_end(&c) == 0, "exporter failed");
  return PASS;
}

static int test_ipc_pidfd(void) {
  return import_from_helper("pidfd", NULL, &usual);
}

/* Drivers without zeMemGetFileDescriptorFromIpcHandleExp: the fd is read
 * from the documented layout alone. */
static int test_ipc_layout_only(void) {
  const char *env[] = {"USMIPC_ZE_TEST_NO_FD_EXT=1", NULL};
  const expect_t want = {.puts = 1, .fd_queries = 0};
  return import_from_helper("socket", env, &want);
}

/* API 1.4 drivers, without zeMemPutIpcHandle: the handle lives until
 * zeMemFree, which must still release it. */
static int test_ipc_without_put(void) {
  const char *env[] = {"USMIPC_ZE_TEST_NO_PUT=1", NULL};
  const expect_t want = {.puts = 0, .fd_queries = 1};
  return import_from_helper("socket", env, &want);
}

/* Intel's pidfd layout (IpcOpaqueMemoryData), the default on GPUs whose
 * driver moves descriptors itself: the handle names the exporter's pid, and
 * the importer's driver calls pidfd_getfd on it when the pid is not 0. The
 * backend writes no pid (its handle is a plain local import that no release
 * of Intel's driver sends to its pidfd path or its import cache), so the
 * driver never fetches anything. */
static int test_ipc_pidfd_layout(void) {
  setenv("USMIPC_ZE_TEST_PIDFD_HANDLE", "1", 1); /* this process's driver */
  const char *env[] = {"USMIPC_ZE_TEST_PIDFD_HANDLE=1", NULL};
  const expect_t want = {.puts = 1, .fd_queries = 1};
  int rc = import_from_helper("socket", env, &want);
  if (rc != PASS)
    return rc;
  usmipc_ze_test_stats_t s;
  CHECK(get_stats(&s) == 0 && s.pidfd_self_fetches == 0,
        "the importer's driver fetched the descriptor with pidfd_getfd "
        "(%llu times): the handle named a pid",
        (unsigned long long)s.pidfd_self_fetches);
  return PASS;
}

/* When the loader wraps handles (several drivers, or
 * ZE_ENABLE_LOADER_INTERCEPT=1), a driver's own extension functions cannot
 * be given the application's handles; the loader 1.8 routes neither
 * zeMemPutIpcHandle nor the fd query. IPC still works through the layout;
 * the handle cannot be put back, and the driver sees it freed unput. */
static int test_ipc_loader_intercept(void) {
  const char *env[] = {"ZE_ENABLE_LOADER_INTERCEPT=1", NULL};
  const expect_t want = {.puts = 0, .live = 1, .leaked = 1, .fd_queries = 0};
  return import_from_helper("socket", env, &want);
}

static int test_exporter_killed(void) {
  CHECK(gpu() != NULL, "no device");
  child_t c;
  uint8_t data[1024];
  size_t len = 0;
  const size_t n = 8 << 20;
  CHECK(start_exporter(&c, NULL, "8388608", "0", "0", data, &len) == 0,
        "exporter did not start");
  uint8_t *p = NULL;
  CHECK_OK(usmipc_ipc_open(data, len, NULL, 0, (void **)&p, NULL));
  kill(c.pid, SIGKILL);
  CHECK(child_end(&c) == 128 + SIGKILL, "exporter was not killed");
  CHECK(first_mismatch(p, 0, n, -1) < 0,
        "after the exporter died, byte %ld differs",
        first_mismatch(p, 0, n, -1));
  memset(p + n - 4096, 0x77, 4096);
  CHECK(first_mismatch(p + n - 4096, 0, 4096, 0x77) < 0, "write after death");
  CHECK_OK(usmipc_ipc_close(p));
  CHECK_OK(usmipc_ipc_set_cache_size(0));
  CHECK_ERR(usmipc_ipc_open(data, len, NULL, 0, (void **)&p, NULL),
            USMIPC_EEXPORTERGONE);
  return PASS;
}

/* A driver whose handles do not start with their fd: the export is refused
 * (the importer could not rebuild the handle), with the extension's answer
 * or without it, and the refused handle is put back. */
static int test_unknown_layout_refused(void) {
  const char *cases[][3] = {
      {"USMIPC_ZE_TEST_UNKNOWN_LAYOUT=1", NULL, NULL},
      {"USMIPC_ZE_TEST_UNKNOWN_LAYOUT=1", "USMIPC_ZE_TEST_NO_FD_EXT=1", NULL},
  };
  for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
    const char *args[] = {"export", "65536", "0", "0", NULL};
    child_t c;
    CHECK(spawn(&c, cases[i], args) == 0, "spawn");
    char line[4096];
    snprintf(line, sizeof(line), "%s", child_hear(&c));
    CHECK(!strncmp(line, "error USMIPC_ENOTSUP", 20), "case %zu: %s", i, line);
    fprintf(stderr, "    refused as expected: %s\n", line + 6);
    child_say(&c, "stats");
    snprintf(line, sizeof(line), "%s", child_hear(&c));
    unsigned long long gets, puts, live, leaked, queries;
    CHECK(sscanf(line, "stats %llu %llu %llu %llu %llu", &gets, &puts, &live,
                 &leaked, &queries) == 5,
          "exporter: %s", line);
    CHECK(gets == 1 && puts == 1 && live == 0,
          "case %zu: the refused handle was not put back: gets %llu puts %llu "
          "live %llu",
          i, gets, puts, live);
    child_say(&c, "exit");
    CHECK(child_end(&c) == 0, "exporter failed");
  }
  return PASS;
}

/* Without a loader driver, or with one whose zeInit fails, the backend is
 * unavailable with a reason, and the rest of usmipc works. */
static int test_unavailable(void) {
  const char *cases[][2] = {
      {"ZE_ENABLE_ALT_DRIVERS=/nonexistent/libze_nothing.so", NULL},
      {"USMIPC_ZE_TEST_INIT_FAIL=1", NULL},
  };
  for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
    const char *args[] = {"status", NULL};
    child_t c;
    CHECK(spawn(&c, cases[i], args) == 0, "spawn");
    char line[4096];
    snprintf(line, sizeof(line), "%s", child_hear(&c));
    CHECK(child_end(&c) == 0, "helper failed");
    CHECK(!strncmp(line, "status USMIPC_EUNAVAILABLE USMIPC_ENODEV | zeInit",
                   strlen("status USMIPC_EUNAVAILABLE USMIPC_ENODEV | zeInit")),
          "with %s: %s", cases[i][0], line);
  }
  return PASS;
}

/* ---- runner ------------------------------------------------------------------------- */

static const struct {
  const char *name;
  int (*fn)(void);
} tests[] = {
    {"device_listed", test_device_listed},
    {"alloc_copy_fill", test_alloc_copy_fill},
    {"foreign_pointer", test_foreign_pointer},
    {"export_refusals", test_export_refusals},
    {"ipc_socket", test_ipc_socket},
    {"ipc_pidfd", test_ipc_pidfd},
    {"ipc_layout_only", test_ipc_layout_only},
    {"ipc_without_put", test_ipc_without_put},
    {"ipc_pidfd_layout", test_ipc_pidfd_layout},
    {"ipc_loader_intercept", test_ipc_loader_intercept},
    {"exporter_killed", test_exporter_killed},
    {"unknown_layout_refused", test_unknown_layout_refused},
    {"unavailable", test_unavailable},
};
#define NTESTS (sizeof(tests) / sizeof(tests[0]))

int main(int argc, char **argv) {
  if (argc > 1 && !strcmp(argv[1], "--helper"))
    return helper_main(argc - 2, argv + 2);
  if (getenv("ZE_ENABLE_ALT_DRIVERS") == NULL) {
    fprintf(stderr, "set ZE_ENABLE_ALT_DRIVERS to the test driver's path\n");
    return 2;
  }
  if (argc > 1) {
    for (size_t i = 0; i < NTESTS; i++)
      if (!strcmp(argv[1], tests[i].name))
        return tests[i].fn();
    fprintf(stderr, "no test named %s\n", argv[1]);
    return 2;
  }
  /* Each test in its own process, forked before this process touches
   * usmipc, so that no state (devices, caches, the broker) is shared. */
  int passed = 0, failed = 0, skipped = 0;
  for (size_t i = 0; i < NTESTS; i++) {
    fflush(stdout);
    pid_t pid = fork();
    if (pid == 0) {
      alarm(TEST_TIMEOUT_S);
      _exit(tests[i].fn());
    }
    int status = 0;
    waitpid(pid, &status, 0);
    int rc = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    const char *verdict = rc == PASS ? "ok" : rc == SKIP ? "skip" : "FAIL";
    if (rc == PASS)
      passed++;
    else if (rc == SKIP)
      skipped++;
    else
      failed++;
    if (WIFSIGNALED(status))
      printf("%-4s %s (killed by signal %d%s)\n", verdict, tests[i].name,
             WTERMSIG(status),
             WTERMSIG(status) == SIGALRM ? ": timed out" : "");
    else
      printf("%-4s %s\n", verdict, tests[i].name);
  }
  if (skipped)
    printf("%d passed, %d failed, %d skipped\n", passed, failed, skipped);
  else
    printf("%d passed, %d failed\n", passed, failed);
  return failed ? 1 : 0;
}
