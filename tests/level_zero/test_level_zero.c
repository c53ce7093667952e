/* The level_zero backend against the real Level Zero loader and the test
 * driver (ze_test_driver.c), across real processes.
 *
 *   test_level_zero              every test, each in a forked process
 *   test_level_zero --base       the tests of the backend as a whole, under
 *                                the profile of USMIPC_ZE_TEST_PROFILE
 *   test_level_zero --cr         the tests of Intel's releases (cr_*), each
 *                                under the profiles it names
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
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <level_zero/ze_api.h>

#include "../c/probe.h" /* the behaviour probe's records */
#include "objects.h"    /* usmipc__wire_t, the backend ops (event payloads) */
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
    probe_record(__FILE__, __LINE__, #call, rc_, usmipc_last_error());         \
    CHECK(rc_ == (code), "returned %s, expected %s (%s)",                      \
          usmipc_err_name(rc_), usmipc_err_name(code), usmipc_last_error());   \
    CHECK(strcmp(usmipc_last_error(), "no error recorded on this thread"),     \
          "failed without a message");                                         \
  } while (0)

/* ---- shared helpers
 * ---------------------------------------------------------- */

/* The byte every test expects at offset i of an exported allocation, and
 * of allocation number `seed` where a test exports several. */
static uint8_t pattern_seed(size_t i, unsigned seed) {
  return (uint8_t)(i * 7 + 1 + seed * 53);
}
static uint8_t pattern_at(size_t i) { return pattern_seed(i, 0); }

/* The driver profile this process runs under (ze_test_driver.h). */
static const char *profile_name(void) {
  const char *p = getenv("USMIPC_ZE_TEST_PROFILE");
  return p != NULL && p[0] != '\0' ? p : "ideal";
}

/* True under a profile of Intel's releases (cr-*): no zeMemPutIpcHandle
 * (CR serves it through no path the loader 1.8 reaches), zeMemFree closes
 * the exported descriptor, handles in Intel's layouts of that release. */
static bool cr_profile(void) { return !strncmp(profile_name(), "cr-", 3); }

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

/* Device memory of nbytes holding pattern_seed(i, seed), filled through a
 * queue. */
static int alloc_pattern_seed(usmipc_device_t *dev, size_t nbytes,
                              unsigned seed, void **out) {
  uint8_t *host = malloc(nbytes);
  usmipc_queue_t *q = NULL;
  int rc = host ? 0 : USMIPC_ENOMEM;
  for (size_t i = 0; host && i < nbytes; i++)
    host[i] = pattern_seed(i, seed);
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

/* Device memory of nbytes holding pattern_at(i). */
static int alloc_pattern(usmipc_device_t *dev, size_t nbytes, void **out) {
  return alloc_pattern_seed(dev, nbytes, 0, out);
}

/* First offset in [from, from + len) whose byte is not want(i), or -1. */
static long first_mismatch(const uint8_t *p, size_t from, size_t len,
                           int fill) {
  for (size_t i = 0; i < len; i++) {
    uint8_t want = fill >= 0 ? (uint8_t)fill : pattern_at(from + i);
    if (p[i] != want)
      return (long)(from + i);
  }
  return -1;
}

/* The same for pattern_seed(i, seed). */
static long first_mismatch_seed(const uint8_t *p, size_t from, size_t len,
                                unsigned seed) {
  for (size_t i = 0; i < len; i++)
    if (p[i] != pattern_seed(from + i, seed))
      return (long)(from + i);
  return -1;
}

/* The driver's counters as "stats name=value ..." (every field), for
 * helpers to report, and one of them back out of such a line. */
#define STAT_FIELD(name)                                                       \
  { #name, offsetof(usmipc_ze_test_stats_t, name) }
static const struct {
  const char *name;
  size_t offset;
} stat_fields[] = {
    STAT_FIELD(ipc_gets),
    STAT_FIELD(ipc_puts),
    STAT_FIELD(ipc_opens),
    STAT_FIELD(ipc_closes),
    STAT_FIELD(live_ipc_handles),
    STAT_FIELD(freed_with_live_handle),
    STAT_FIELD(live_allocations),
    STAT_FIELD(live_mappings),
    STAT_FIELD(fd_queries),
    STAT_FIELD(pidfd_self_fetches),
    STAT_FIELD(profile),
    STAT_FIELD(exported_fd_closed_by_free),
    STAT_FIELD(pooled_allocations),
    STAT_FIELD(pool_refs_dropped_by_unexported_free),
    STAT_FIELD(pool_fd_closed_while_exported),
    STAT_FIELD(opaque_opens),
    STAT_FIELD(legacy_opens),
    STAT_FIELD(pidfd_fetches),
    STAT_FIELD(socket_fetches),
    STAT_FIELD(raw_fallbacks),
    STAT_FIELD(import_cache_hits),
    STAT_FIELD(import_cache_stale_hits),
    STAT_FIELD(import_fds_kept),
    STAT_FIELD(ptracer_any_set),
    STAT_FIELD(zex_get_ipc_handles),
    STAT_FIELD(uninitialized_stub_calls),
    STAT_FIELD(socket_requests_served),
    STAT_FIELD(event_pools_created),
    STAT_FIELD(live_event_pools),
    STAT_FIELD(live_events),
    STAT_FIELD(event_pool_ipc_gets),
    STAT_FIELD(event_pool_opens),
    STAT_FIELD(event_pool_closes),
    STAT_FIELD(event_pool_open_failures),
    STAT_FIELD(event_pool_opaque_opens),
    STAT_FIELD(event_pool_cache_hits),
    STAT_FIELD(event_pool_stale_hits),
    STAT_FIELD(event_fds_taken),
    STAT_FIELD(exported_event_fds_leaked),
    STAT_FIELD(event_signals),
    STAT_FIELD(event_resets),
    STAT_FIELD(event_waits),
    STAT_FIELD(wait_timeouts),
    STAT_FIELD(delays),
    STAT_FIELD(async_commands),
};

static void format_stats(const usmipc_ze_test_stats_t *s, char *out,
                         size_t cap) {
  size_t n = (size_t)snprintf(out, cap, "stats");
  for (size_t i = 0; i < sizeof(stat_fields) / sizeof(stat_fields[0]); i++) {
    uint64_t v;
    memcpy(&v, (const char *)s + stat_fields[i].offset, sizeof(v));
    if (n < cap)
      n += (size_t)snprintf(out + n, cap - n, " %s=%llu", stat_fields[i].name,
                            (unsigned long long)v);
  }
}

/* The value of name in a "stats ..." line, or ~0 when it is not there. */
static unsigned long long stat_of(const char *line, const char *name) {
  size_t len = strlen(name);
  for (const char *at = strstr(line, name); at != NULL;
       at = strstr(at + 1, name))
    if (at[-1] == ' ' && at[len] == '=')
      return strtoull(at + len + 1, NULL, 10);
  return ~0ull;
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

/* ---- child processes
 * ----------------------------------------------------------- */

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

/* ---- helper roles
 * ----------------------------------------------------------------- */

static int say(const char *fmt, ...) USMIPC__FORMAT(1, 2);
static int say(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  if (getenv("USMIPC_TEST_PROBE") != NULL) {
    /* A helper's failures reach its test as lines: the probe keeps those
     * that report one ("error NAME message", "status NAME NAME | reason"). */
    char line[4096];
    va_list copy;
    va_copy(copy, ap);
    vsnprintf(line, sizeof(line), fmt, copy);
    va_end(copy);
    if (!strncmp(line, "error", 5) || !strncmp(line, "status ", 7) ||
        strstr(line, "USMIPC_E") != NULL)
      probe_record_named(__FILE__, __LINE__, "a helper's line", "-", line);
  }
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
    say("error %s %s",
        usmipc_err_name(
            usmipc_ipc_open(data, len, NULL, 0, (void **)&p, &mapped)),
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

/* exporter: exports several allocations, for the cr_* tests. Serves
 * "alloc NBYTES SEED" -> "id K" (device memory holding pattern_seed(i,
 * SEED)), "export K" -> "handle HEX" (the whole allocation) or "error
 * ERRNAME message", "check K OFF LEN BYTE" -> "ok" or "mismatch at OFF",
 * "free K" -> "freed", "stats" -> "stats name=value ...", "exit". */
#define MAX_HELPER_ALLOCS 256
static int helper_exporter(void) {
  usmipc_device_t *dev = gpu();
  void *p[MAX_HELPER_ALLOCS];
  int count = 0;
  for (;;) {
    const char *cmd = hear();
    size_t nbytes, off, n;
    unsigned seed;
    int k, byte;
    if (sscanf(cmd, "alloc %zu %u", &nbytes, &seed) == 2) {
      int rc = dev == NULL ? USMIPC_ENODEV
               : count == MAX_HELPER_ALLOCS
                   ? USMIPC_ENOMEM
                   : alloc_pattern_seed(dev, nbytes, seed, &p[count]);
      if (rc != 0)
        say("error %s %s", usmipc_err_name(rc), usmipc_last_error());
      else
        say("id %d", count++);
    } else if (sscanf(cmd, "export %d", &k) == 1 && k >= 0 && k < count) {
      usmipc_ipc_handle_t *h = NULL;
      const void *data;
      size_t len;
      int rc = usmipc_ipc_get_handle(p[k], 0, &h);
      if (rc == 0)
        rc = usmipc_ipc_handle_data(h, &data, &len);
      if (rc != 0) {
        say("error %s %s", usmipc_err_name(rc), usmipc_last_error());
      } else {
        char hex[1024];
        to_hex(data, len, hex);
        say("handle %s", hex);
      }
      usmipc_ipc_free_handle(h);
    } else if (sscanf(cmd, "check %d %zu %zu %d", &k, &off, &n, &byte) == 4 &&
               k >= 0 && k < count) {
      long bad = first_mismatch((uint8_t *)p[k] + off, off, n, byte);
      say(bad < 0 ? "ok" : "mismatch at %ld", bad);
    } else if (sscanf(cmd, "free %d", &k) == 1 && k >= 0 && k < count) {
      int rc = usmipc_free(p[k]);
      say(rc == 0 ? "freed" : "error %s", usmipc_last_error());
    } else if (!strcmp(cmd, "stats")) {
      usmipc_ze_test_stats_t st;
      char line[2048];
      if (get_stats(&st) != 0) {
        say("error no driver stats");
      } else {
        format_stats(&st, line, sizeof(line));
        say("%s", line);
      }
    } else {
      return 0;
    }
  }
}

/* importer: opens handles one after another, for the cr_* tests. Serves
 * "open SEED HEX" -> "ok" (the mapping holds pattern_seed(i, SEED) over
 * all its bytes), "mismatch at OFF: got G, want W (pattern of SEED2)" or
 * "error ERRNAME message"; "write LEN BYTE" (to the newest mapping) ->
 * "written"; "close" (the newest mapping) -> "closed"; "fds" -> "fds N";
 * "stats"; "exit". */
static int helper_importer(void) {
  uint8_t *maps[MAX_HELPER_ALLOCS];
  int count = 0;
  for (;;) {
    const char *cmd = hear();
    unsigned seed;
    size_t n;
    int byte, used = 0;
    if (sscanf(cmd, "open %u %n", &seed, &used) == 1 && used > 0) {
      uint8_t data[1024];
      size_t len = from_hex(cmd + used, data, sizeof(data)), mapped = 0;
      usmipc_ipc_handle_info_t info;
      uint8_t *p = NULL;
      int rc = usmipc_ipc_handle_inspect(data, len, &info);
      if (rc == 0 && count == MAX_HELPER_ALLOCS)
        rc = USMIPC_ENOMEM;
      if (rc == 0)
        rc = usmipc_ipc_open(data, len, NULL, 0, (void **)&p, &mapped);
      if (rc != 0) {
        say("error %s %s", usmipc_err_name(rc), usmipc_last_error());
        continue;
      }
      maps[count++] = p;
      long bad = first_mismatch_seed(p, (size_t)info.offset, mapped, seed);
      if (bad < 0) {
        say("ok");
        continue;
      }
      /* Whose data is it? The tests' seeds are small. */
      unsigned other = 0;
      while (other < 1000 &&
             first_mismatch_seed(p, (size_t)info.offset, 64, other) >= 0)
        other++;
      char whose[64] = "no test pattern";
      if (other < 1000)
        snprintf(whose, sizeof(whose), "the pattern of allocation %u", other);
      say("mismatch at %ld: got 0x%02x, want 0x%02x (%s)", bad,
          p[bad - (long)info.offset], pattern_seed((size_t)bad, seed), whose);
    } else if (sscanf(cmd, "write %zu %d", &n, &byte) == 2 && count > 0) {
      memset(maps[count - 1], byte, n);
      say("written");
    } else if (!strcmp(cmd, "close") && count > 0) {
      int rc = usmipc_ipc_close(maps[--count]);
      say(rc == 0 ? "closed" : "error %s", usmipc_last_error());
    } else if (!strcmp(cmd, "fds")) {
      say("fds %d", count_fds());
    } else if (!strcmp(cmd, "stats")) {
      usmipc_ze_test_stats_t st;
      char line[2048];
      if (get_stats(&st) != 0) {
        say("error no driver stats");
      } else {
        format_stats(&st, line, sizeof(line));
        say("%s", line);
      }
    } else {
      return 0;
    }
  }
}

/* zeprobe: the test driver through the loader alone, no usmipc, for
 * cr_driver_profiles. Prints "facts VERSION EXTENSION PUT FD FROMFD ZEX"
 * (driverVersion, the first extension's name, the result of looking up
 * zeMemPutIpcHandle, zeMemGetFileDescriptorFromIpcHandleExp,
 * zeMemGetIpcHandleFromFileDescriptorExp and zexMemGetIpcHandles), then
 * serves "export" (two 64 KiB device allocations filled with 0x5a, the
 * second's raw ze_ipc_mem_handle_t: "handle HEX COUNT", COUNT from
 * zexMemGetIpcHandles or -1), "open HEX" (zeMemOpenIpcHandle of raw bytes:
 * "opened RESULT FIRSTBYTE"), "stats", "exit". */
static int helper_zeprobe(void) {
  ze_driver_handle_t driver = NULL;
  ze_device_handle_t device = NULL;
  ze_context_handle_t ctx = NULL;
  uint32_t one = 1;
  ze_context_desc_t cdesc = {.stype = ZE_STRUCTURE_TYPE_CONTEXT_DESC};
  if (zeInit(ZE_INIT_FLAG_GPU_ONLY) != ZE_RESULT_SUCCESS ||
      zeDriverGet(&one, &driver) != ZE_RESULT_SUCCESS ||
      zeDeviceGet(driver, &one, &device) != ZE_RESULT_SUCCESS ||
      zeContextCreate(driver, &cdesc, &ctx) != ZE_RESULT_SUCCESS) {
    say("error no driver");
    return 1;
  }
  ze_driver_properties_t props = {.stype = ZE_STRUCTURE_TYPE_DRIVER_PROPERTIES};
  ze_driver_extension_properties_t ext[4];
  uint32_t next = 4;
  memset(ext, 0, sizeof(ext));
  zeDriverGetProperties(driver, &props);
  if (zeDriverGetExtensionProperties(driver, &next, ext) != ZE_RESULT_SUCCESS)
    next = 0;
  static const char *const names[] = {
      "zeMemPutIpcHandle", "zeMemGetFileDescriptorFromIpcHandleExp",
      "zeMemGetIpcHandleFromFileDescriptorExp", "zexMemGetIpcHandles"};
  ze_result_t found[4];
  void *zex = NULL;
  for (int i = 0; i < 4; i++) {
    void *fn = NULL;
    found[i] = zeDriverGetExtensionFunctionAddress(driver, names[i], &fn);
    if (i == 3 && found[i] == ZE_RESULT_SUCCESS)
      zex = fn;
  }
  say("facts 0x%x %s 0x%x 0x%x 0x%x 0x%x", props.driverVersion,
      next ? ext[0].name : "-", found[0], found[1], found[2], found[3]);
  typedef ze_result_t (*zex_fn)(ze_context_handle_t, const void *, uint32_t *,
                                ze_ipc_mem_handle_t *);
  for (;;) {
    const char *cmd = hear();
    if (!strcmp(cmd, "export")) {
      ze_device_mem_alloc_desc_t dd = {
          .stype = ZE_STRUCTURE_TYPE_DEVICE_MEM_ALLOC_DESC};
      void *p[2] = {NULL, NULL};
      ze_ipc_mem_handle_t h;
      memset(&h, 0, sizeof(h));
      uint32_t count = 0;
      int rc = 0;
      for (int i = 0; i < 2 && rc == 0; i++)
        rc = zeMemAllocDevice(ctx, &dd, 65536, 0, device, &p[i]);
      if (rc == 0) {
        memset(p[0], 0x11, 65536);
        memset(p[1], 0x5a, 65536);
        rc = zeMemGetIpcHandle(ctx, p[1], &h);
      }
      if (rc == 0 && zex != NULL &&
          ((zex_fn)zex)(ctx, p[1], &count, NULL) != ZE_RESULT_SUCCESS)
        count = 0;
      char hex[2 * ZE_MAX_IPC_HANDLE_SIZE + 1];
      to_hex(h.data, sizeof(h.data), hex);
      if (rc != 0)
        say("error 0x%x", (unsigned)rc);
      else
        say("handle %s %d", hex, zex != NULL ? (int)count : -1);
    } else if (!strncmp(cmd, "open ", 5)) {
      ze_ipc_mem_handle_t h;
      memset(&h, 0, sizeof(h));
      from_hex(cmd + 5, (uint8_t *)h.data, sizeof(h.data));
      void *p = NULL;
      ze_result_t rc = zeMemOpenIpcHandle(ctx, device, h, 0, &p);
      say("opened 0x%x 0x%02x", (unsigned)rc,
          rc == ZE_RESULT_SUCCESS ? *(uint8_t *)p : 0);
    } else if (!strcmp(cmd, "stats")) {
      usmipc_ze_test_stats_t st;
      char line[2048];
      if (get_stats(&st) != 0) {
        say("error no driver stats");
      } else {
        format_stats(&st, line, sizeof(line));
        say("%s", line);
      }
    } else {
      return 0;
    }
  }
}

/* ---- events: the helper ----------------------------------------------------
 */

/* A command list made through the loader directly, as SYCL or PyTorch XPU
 * make theirs: an asynchronous immediate list, whose commands the test
 * driver runs in order on a thread of its own. (It belongs to a context of
 * the caller's, not usmipc's; the test driver does not mind.) */
typedef struct foreign_list {
  ze_context_handle_t ctx;
  ze_command_list_handle_t list;
} foreign_list_t;

static int foreign_list_create(foreign_list_t *f) {
  ze_driver_handle_t driver = NULL;
  ze_device_handle_t device = NULL;
  uint32_t one = 1;
  ze_context_desc_t cdesc = {.stype = ZE_STRUCTURE_TYPE_CONTEXT_DESC};
  ze_command_queue_desc_t qdesc = {.stype =
                                       ZE_STRUCTURE_TYPE_COMMAND_QUEUE_DESC,
                                   .mode = ZE_COMMAND_QUEUE_MODE_ASYNCHRONOUS};
  memset(f, 0, sizeof(*f));
  if (zeDriverGet(&one, &driver) != ZE_RESULT_SUCCESS ||
      zeDeviceGet(driver, &one, &device) != ZE_RESULT_SUCCESS ||
      zeContextCreate(driver, &cdesc, &f->ctx) != ZE_RESULT_SUCCESS ||
      zeCommandListCreateImmediate(f->ctx, device, &qdesc, &f->list) !=
          ZE_RESULT_SUCCESS)
    return -1;
  return 0;
}

static void foreign_list_destroy(foreign_list_t *f) {
  if (f->list != NULL)
    zeCommandListDestroy(f->list); /* finishes what is queued first */
  if (f->ctx != NULL)
    zeContextDestroy(f->ctx);
  memset(f, 0, sizeof(*f));
}

/* usmipcZeTestDriverAppendDelay: a command of ms milliseconds on list. */
static int append_delay(ze_command_list_handle_t list, unsigned ms) {
  const char *path = getenv("ZE_ENABLE_ALT_DRIVERS");
  void *lib = path ? dlopen(path, RTLD_NOW | RTLD_NOLOAD) : NULL;
  usmipc_ze_test_append_delay_fn fn =
      lib ? (usmipc_ze_test_append_delay_fn)dlsym(lib,
                                                  USMIPC_ZE_TEST_APPEND_DELAY)
          : NULL;
  int rc = fn ? fn(list, ms) : -1;
  if (lib)
    dlclose(lib);
  return rc;
}

static uint64_t mono_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

static void say_handle(int rc, const usmipc_ipc_handle_t *h) {
  const void *data;
  size_t len;
  if (rc == 0)
    rc = usmipc_ipc_handle_data(h, &data, &len);
  if (rc != 0) {
    say("error %s %s", usmipc_err_name(rc), usmipc_last_error());
    return;
  }
  static char hex[4096];
  to_hex(data, len, hex);
  say("handle %s", hex);
}

static void say_rc(int rc) {
  if (rc == 0)
    say("ok");
  else
    say("error %s %s", usmipc_err_name(rc), usmipc_last_error());
}

/* evagent: a producer or consumer of events, for the event_* tests. Its
 * queue is the asynchronous foreign list once "asyncq" made it, else a
 * queue of its own (a synchronous list). Answers "ok", "handle HEX" or
 * "error ERRNAME message" to:
 *   alloc N BYTE      device memory of N bytes holding BYTE
 *   asyncq            the asynchronous foreign list, wrapped
 *   delay MS          usmipcZeTestDriverAppendDelay on it
 *   fill BYTE         usmipc_memset of the memory on the queue
 *   export            a handle of the memory (kept for order)
 *   order             usmipc_ipc_handle_order of it on the queue -> handle
 *   evcreate K, evrecord K, evhandle K, evdestroy K    local events
 *   evopen K HEX, evsync K, evquery K, evwait K        opened events
 *   sync              usmipc_queue_synchronize of the queue -> "ok MS"
 *   release HEX       usmipc_ipc_release of handle bytes after the queue
 *   check BYTE        the memory copied to the host holds BYTE
 *   fds               "fds N"
 *   stats             the driver's counters
 *   exit */
#define EVAGENT_EVENTS 8
static int helper_evagent(void) {
  usmipc_device_t *dev = gpu();
  usmipc_queue_t *own = NULL, *wrapped = NULL;
  foreign_list_t fl = {0};
  usmipc_event_t *ev[EVAGENT_EVENTS] = {0};
  usmipc_ipc_handle_t *h = NULL;
  void *p = NULL;
  size_t n = 0;
  if (dev == NULL || usmipc_queue_create(dev, &own) != 0) {
    say("error no device");
    return 1;
  }
  for (;;) {
    const char *cmd = hear();
    int byte, k, used = 0;
    unsigned ms;
    usmipc_queue_t *q = wrapped ? wrapped : own;
    if (sscanf(cmd, "alloc %zu %d", &n, &byte) == 2) {
      int rc = usmipc_malloc(dev, USMIPC_MEM_DEVICE, n, &p);
      if (rc == 0)
        rc = usmipc_memset(own, p, byte, n);
      say_rc(rc);
    } else if (!strcmp(cmd, "asyncq")) {
      int rc = foreign_list_create(&fl) != 0
                   ? USMIPC_EBACKEND
                   : usmipc_queue_from_native(dev, fl.list, &wrapped);
      if (rc == 0 && usmipc_queue_native(wrapped) != (void *)fl.list)
        rc = USMIPC_EINVAL;
      say_rc(rc);
    } else if (sscanf(cmd, "delay %u", &ms) == 1) {
      say(fl.list && append_delay(fl.list, ms) == 0 ? "ok" : "error delay");
    } else if (sscanf(cmd, "fill %d", &byte) == 1) {
      say_rc(usmipc_memset(q, p, byte, n));
    } else if (!strcmp(cmd, "export")) {
      int rc = usmipc_ipc_get_handle(p, 0, &h);
      say_handle(rc, h);
    } else if (!strcmp(cmd, "order")) {
      int rc = usmipc_ipc_handle_order(h, q);
      say_handle(rc, h);
    } else if (sscanf(cmd, "evcreate %d", &k) == 1 && k >= 0 &&
               k < EVAGENT_EVENTS) {
      say_rc(usmipc_event_create(dev, 0, &ev[k]));
    } else if (sscanf(cmd, "evrecord %d", &k) == 1 && k >= 0 &&
               k < EVAGENT_EVENTS) {
      say_rc(usmipc_event_record(ev[k], q));
    } else if (sscanf(cmd, "evhandle %d", &k) == 1 && k >= 0 &&
               k < EVAGENT_EVENTS) {
      usmipc_ipc_handle_t *eh = NULL;
      int rc = usmipc_ipc_get_event_handle(ev[k], &eh);
      say_handle(rc, eh);
      usmipc_ipc_free_handle(eh);
    } else if (sscanf(cmd, "evdestroy %d", &k) == 1 && k >= 0 &&
               k < EVAGENT_EVENTS) {
      say_rc(usmipc_event_destroy(ev[k]));
      ev[k] = NULL;
    } else if (sscanf(cmd, "evopen %d %n", &k, &used) == 1 && used > 0 &&
               k >= 0 && k < EVAGENT_EVENTS) {
      uint8_t b[2048];
      size_t len = from_hex(cmd + used, b, sizeof(b));
      say_rc(usmipc_ipc_open_event(b, len, NULL, &ev[k]));
    } else if (sscanf(cmd, "evsync %d", &k) == 1 && k >= 0 &&
               k < EVAGENT_EVENTS) {
      say_rc(usmipc_event_synchronize(ev[k]));
    } else if (sscanf(cmd, "evquery %d", &k) == 1 && k >= 0 &&
               k < EVAGENT_EVENTS) {
      say_rc(usmipc_event_query(ev[k]));
    } else if (sscanf(cmd, "evwait %d", &k) == 1 && k >= 0 &&
               k < EVAGENT_EVENTS) {
      say_rc(usmipc_event_wait(ev[k], q));
    } else if (sscanf(cmd, "release %n", &used) == 0 && used > 0) {
      uint8_t b[2048];
      size_t len = from_hex(cmd + used, b, sizeof(b));
      say_rc(usmipc_ipc_release(b, len, q));
    } else if (!strcmp(cmd, "sync")) {
      uint64_t t0 = mono_ms();
      int rc = usmipc_queue_synchronize(q);
      if (rc == 0)
        say("ok %llu", (unsigned long long)(mono_ms() - t0));
      else
        say_rc(rc);
    } else if (sscanf(cmd, "check %d", &byte) == 1) {
      uint8_t *host = malloc(n);
      int rc = host ? usmipc_memcpy(own, host, p, n) : USMIPC_ENOMEM;
      long bad = rc == 0 ? first_mismatch(host, 0, n, byte) : -2;
      if (rc != 0)
        say_rc(rc);
      else
        say(bad < 0 ? "ok" : "mismatch at %ld: 0x%02x", bad,
            bad < 0 ? 0 : host[bad]);
      free(host);
    } else if (!strcmp(cmd, "fds")) {
      say("fds %d", count_fds());
    } else if (!strcmp(cmd, "stats")) {
      usmipc_ze_test_stats_t st;
      char line[4096];
      if (get_stats(&st) != 0) {
        say("error no driver stats");
      } else {
        format_stats(&st, line, sizeof(line));
        say("%s", line);
      }
    } else {
      break;
    }
  }
  if (wrapped != NULL) {
    usmipc_queue_synchronize(wrapped);
    usmipc_queue_destroy(wrapped);
  }
  for (int k = 0; k < EVAGENT_EVENTS; k++)
    usmipc_event_destroy(ev[k]);
  usmipc_ipc_free_handle(h);
  if (p != NULL)
    usmipc_free(p);
  foreign_list_destroy(&fl);
  usmipc_queue_destroy(own);
  return 0;
}

/* evprobe: event pools through the loader alone, for
 * cr_event_pool_cache_2618. "pool K" makes IPC pool K with one event,
 * "raw K" prints its zeEventPoolGetIpcHandle bytes ("handle HEX"), "signal
 * K" signals it on the host, "open K HEX" opens raw bytes as pool K
 * ("opened RESULT"), "query K" prints "status RESULT", "stats", "exit". */
static int helper_evprobe(void) {
  ze_driver_handle_t driver = NULL;
  ze_device_handle_t device = NULL;
  ze_context_handle_t ctx = NULL;
  uint32_t one = 1;
  ze_context_desc_t cdesc = {.stype = ZE_STRUCTURE_TYPE_CONTEXT_DESC};
  if (zeInit(ZE_INIT_FLAG_GPU_ONLY) != ZE_RESULT_SUCCESS ||
      zeDriverGet(&one, &driver) != ZE_RESULT_SUCCESS ||
      zeDeviceGet(driver, &one, &device) != ZE_RESULT_SUCCESS ||
      zeContextCreate(driver, &cdesc, &ctx) != ZE_RESULT_SUCCESS) {
    say("error no driver");
    return 1;
  }
  ze_event_pool_handle_t pools[4] = {0};
  ze_event_handle_t events[4] = {0};
  bool opened[4] = {false};
  ze_event_desc_t edesc = {.stype = ZE_STRUCTURE_TYPE_EVENT_DESC,
                           .signal = ZE_EVENT_SCOPE_FLAG_HOST,
                           .wait = ZE_EVENT_SCOPE_FLAG_HOST};
  for (;;) {
    const char *cmd = hear();
    int k, used = 0;
    if (sscanf(cmd, "pool %d", &k) == 1 && k >= 0 && k < 4) {
      ze_event_pool_desc_t pdesc = {.stype = ZE_STRUCTURE_TYPE_EVENT_POOL_DESC,
                                    .flags = ZE_EVENT_POOL_FLAG_HOST_VISIBLE |
                                             ZE_EVENT_POOL_FLAG_IPC,
                                    .count = 1};
      ze_result_t r = zeEventPoolCreate(ctx, &pdesc, 1, &device, &pools[k]);
      if (r == ZE_RESULT_SUCCESS)
        r = zeEventCreate(pools[k], &edesc, &events[k]);
      say("pool 0x%x", (unsigned)r);
    } else if (sscanf(cmd, "raw %d", &k) == 1 && k >= 0 && k < 4) {
      ze_ipc_event_pool_handle_t h;
      memset(&h, 0, sizeof(h));
      ze_result_t r = zeEventPoolGetIpcHandle(pools[k], &h);
      char hex[200];
      to_hex(h.data, sizeof(h.data), hex);
      say(r == ZE_RESULT_SUCCESS ? "handle %s" : "error %s", hex);
    } else if (sscanf(cmd, "signal %d", &k) == 1 && k >= 0 && k < 4) {
      say("signal 0x%x", (unsigned)zeEventHostSignal(events[k]));
    } else if (sscanf(cmd, "open %d %n", &k, &used) == 1 && used > 0 &&
               k >= 0 && k < 4) {
      ze_ipc_event_pool_handle_t h;
      memset(&h, 0, sizeof(h));
      from_hex(cmd + used, (uint8_t *)h.data, sizeof(h.data));
      ze_result_t r = zeEventPoolOpenIpcHandle(ctx, h, &pools[k]);
      opened[k] = r == ZE_RESULT_SUCCESS;
      if (r == ZE_RESULT_SUCCESS)
        r = zeEventCreate(pools[k], &edesc, &events[k]);
      say("opened 0x%x", (unsigned)r);
    } else if (sscanf(cmd, "query %d", &k) == 1 && k >= 0 && k < 4) {
      say("status 0x%x", (unsigned)zeEventQueryStatus(events[k]));
    } else if (!strcmp(cmd, "stats")) {
      usmipc_ze_test_stats_t st;
      char line[4096];
      get_stats(&st);
      format_stats(&st, line, sizeof(line));
      say("%s", line);
    } else {
      break;
    }
  }
  for (int k = 0; k < 4; k++) {
    if (events[k] != NULL)
      zeEventDestroy(events[k]);
    if (pools[k] != NULL && opened[k])
      zeEventPoolCloseIpcHandle(pools[k]);
    else if (pools[k] != NULL)
      zeEventPoolDestroy(pools[k]);
  }
  zeContextDestroy(ctx);
  return 0;
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
  static char probe_name[256];
  const char *of_test = getenv("USMIPC_TEST_PROBE_TEST");
  snprintf(probe_name, sizeof(probe_name), "%s/%s", of_test ? of_test : "?",
           argv[0]);
  probe_set_test(probe_name);
  if (!strcmp(argv[0], "export"))
    return helper_export(argc - 1, argv + 1);
  if (!strcmp(argv[0], "import"))
    return helper_import(argc - 1, argv + 1);
  if (!strcmp(argv[0], "status"))
    return helper_status();
  if (!strcmp(argv[0], "exporter"))
    return helper_exporter();
  if (!strcmp(argv[0], "importer"))
    return helper_importer();
  if (!strcmp(argv[0], "zeprobe"))
    return helper_zeprobe();
  if (!strcmp(argv[0], "evagent"))
    return helper_evagent();
  if (!strcmp(argv[0], "evprobe"))
    return helper_evprobe();
  return 2;
}

/* ---- tests
 * ------------------------------------------------------------------------- */

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

/* driver_version as SYCL's adapter prints the driver's driverVersion
 * (major.minor.build, whatever the profile), the device's memories summed,
 * its maxMemAllocSize. */
static int test_device_info(void) {
  usmipc_device_t *d = gpu();
  CHECK(d != NULL, "no device");
  ze_driver_handle_t driver = NULL;
  uint32_t one = 1;
  CHECK(zeDriverGet(&one, &driver) == ZE_RESULT_SUCCESS, "zeDriverGet");
  ze_driver_properties_t props = {.stype = ZE_STRUCTURE_TYPE_DRIVER_PROPERTIES};
  CHECK(zeDriverGetProperties(driver, &props) == ZE_RESULT_SUCCESS,
        "zeDriverGetProperties");
  char want[64];
  snprintf(want, sizeof(want), "%u.%u.%u", props.driverVersion >> 24,
           (props.driverVersion >> 16) & 0xff, props.driverVersion & 0xffff);
  usmipc_device_info_t info;
  memset(&info, 0xee, sizeof(info));
  CHECK_OK(usmipc_device_get_info(d, &info, sizeof(info)));
  CHECK(!strcmp(info.driver_version, want), "driver_version '%s', want '%s'",
        info.driver_version, want);
  CHECK(info.global_mem_size ==
            USMIPC_ZE_TEST_MEMORIES * USMIPC_ZE_TEST_MEMORY_BYTES,
        "global_mem_size %llu: not the sum of the device's memories",
        (unsigned long long)info.global_mem_size);
  CHECK(info.max_mem_alloc_size == USMIPC_ZE_TEST_MAX_ALLOC,
        "max_mem_alloc_size %llu", (unsigned long long)info.max_mem_alloc_size);
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
  ze_device_mem_alloc_desc_t ddesc = {
      .stype = ZE_STRUCTURE_TYPE_DEVICE_MEM_ALLOC_DESC};
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
  /* Kind 3 under every driver and profile: no driver bytes in the handle. */
  CHECK(info.backend == USMIPC_BACKEND_LEVEL_ZERO && info.offset == 5000 &&
            info.nbytes == 5000 && info.allocation_size == 10000 &&
            info.handle_kind == 3,
        "handle info: backend %d offset %llu nbytes %llu kind %u", info.backend,
        (unsigned long long)info.offset, (unsigned long long)info.nbytes,
        info.handle_kind);
  /* Same-process open: the original memory, no driver mapping. */
  CHECK_OK(usmipc_ipc_open(data, len, NULL, 0, &p, NULL));
  CHECK(p == (uint8_t *)dev + 5000, "same-process open returned %p, not %p", p,
        (void *)((uint8_t *)dev + 5000));
  CHECK_OK(usmipc_ipc_close(p));
  CHECK_OK(usmipc_ipc_free_handle(h));

  void *big = NULL;
  CHECK_ERR(
      usmipc_malloc(d, USMIPC_MEM_DEVICE, USMIPC_ZE_TEST_MAX_ALLOC + 1, &big),
      USMIPC_ENOMEM);
  CHECK(strstr(usmipc_last_error(), "largest allocation") != NULL,
        "message: %s", usmipc_last_error());
  CHECK_OK(usmipc_free(host));
  CHECK_OK(usmipc_free(shared));
  CHECK_OK(usmipc_free(dev));
  usmipc_ze_test_stats_t s;
  CHECK(get_stats(&s) == 0, "no driver stats");
  /* Under cr-* nothing can put the handle back (CR's zeMemPutIpcHandle is a
   * DDI entry the loader 1.8 does not route, and CR's extension lookup
   * refuses it): zeMemFree closes the exported descriptor, as CR's does. */
  if (cr_profile())
    CHECK(s.ipc_gets == 1 && s.ipc_puts == 0 && s.live_ipc_handles == 0 &&
              s.freed_with_live_handle == 1 &&
              s.exported_fd_closed_by_free == 1,
          "cr: gets %llu puts %llu live %llu freed with the handle %llu",
          (unsigned long long)s.ipc_gets, (unsigned long long)s.ipc_puts,
          (unsigned long long)s.live_ipc_handles,
          (unsigned long long)s.freed_with_live_handle);
  else
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
  CHECK(mapped == export_n && got_offset == offset, "mapped %zu at offset %llu",
        mapped, got_offset);
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
  /* cr-*: no put and no fd query reach the driver (export_refusals);
   * zeMemFree closed the descriptor. */
  if (cr_profile())
    CHECK(s.ipc_gets == 1 && s.ipc_puts == 0 && s.live_ipc_handles == 0 &&
              s.freed_with_live_handle == 1 && s.fd_queries == 0,
          "cr: gets %llu puts %llu live %llu freed with the handle %llu fd "
          "queries %llu",
          (unsigned long long)s.ipc_gets, (unsigned long long)s.ipc_puts,
          (unsigned long long)s.live_ipc_handles,
          (unsigned long long)s.freed_with_live_handle,
          (unsigned long long)s.fd_queries);
  if (cr_profile())
    return PASS;
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
  /* cr-*: whatever the knobs (they are the ideal driver's), the exporter's
   * driver sees no put and no fd query, and zeMemFree closes the handle's
   * descriptor (export_refusals). */
  static const expect_t cr_want = {.leaked = 1};
  if (cr_profile())
    want = &cr_want;
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
  CHECK(again == p, "second open returned %p, not %p", (void *)again,
        (void *)p);
  CHECK(get_stats(&s) == 0 && s.ipc_opens == 1,
        "a cached open reached the "
        "driver (%llu opens)",
        (unsigned long long)s.ipc_opens);
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
  /* The knob is the ideal driver's imitation of the layout; the cr-*
   * profiles have Intel's own (the cr_* tests), so this test pins ideal. */
  setenv("USMIPC_ZE_TEST_PROFILE", "ideal", 1);
  setenv("USMIPC_ZE_TEST_PIDFD_HANDLE", "1", 1); /* this process's driver */
  const char *env[] = {"USMIPC_ZE_TEST_PIDFD_HANDLE=1",
                       "USMIPC_ZE_TEST_PROFILE=ideal", NULL};
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
  /* A layout of the ideal driver's knobs (no Intel release has it), and
   * its put-back needs zeMemPutIpcHandle, which cr-* lack: pinned to
   * ideal. */
  const char *cases[][4] = {
      {"USMIPC_ZE_TEST_UNKNOWN_LAYOUT=1", "USMIPC_ZE_TEST_PROFILE=ideal", NULL,
       NULL},
      {"USMIPC_ZE_TEST_UNKNOWN_LAYOUT=1", "USMIPC_ZE_TEST_NO_FD_EXT=1",
       "USMIPC_ZE_TEST_PROFILE=ideal", NULL},
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

/* ---- Intel's releases (cr_*) --------------------------------------------- */

/* Each test below runs its helpers under the driver profiles that have the
 * behaviour it is about (ze_test_driver.h, whose source cites CR's),
 * whatever profile this process runs under, and asserts what an application
 * would see: the bytes it reads, the descriptors it holds, the error it
 * gets. Several fail against a backend that does not handle those releases
 * yet: they document its defects. */

/* The environment of a helper: the profile ("USMIPC_ZE_TEST_PROFILE=..."),
 * the knobs given after it, and none of the other knobs this process may
 * have been started with. (A name given twice reaches the helper twice,
 * and getenv reads the first: a profile known only at run time goes in
 * with CR_ENV_WITH.) */
/* clang-format off */
#define CR_ENV(profile, ...)                                                   \
  CR_ENV_WITH("USMIPC_ZE_TEST_PROFILE=" profile, __VA_ARGS__)
#define CR_ENV_WITH(profile_entry, ...)                                        \
  {profile_entry,                                                              \
   "USMIPC_ZE_TEST_NEWER_LOADER=",                                             \
   "USMIPC_ZE_TEST_MULTI_BO=",                                                 \
   "USMIPC_ZE_TEST_HANDLE_FD=",                                                \
   "USMIPC_IPC_CACHE_BYTES=",                                                  \
   __VA_ARGS__,                                                                \
   NULL}
/* clang-format on */

/* Sends one command to a helper and returns its answer (valid until the
 * next one). */
static const char *ask(child_t *c, const char *fmt, ...) USMIPC__FORMAT(2, 3);
static const char *ask(child_t *c, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vfprintf(c->in, fmt, ap);
  va_end(ap);
  fputc('\n', c->in);
  fflush(c->in);
  return child_hear(c);
}

static int start_helper(child_t *c, const char *role, const char *const *env) {
  const char *args[] = {role, NULL};
  return spawn(c, env, args);
}

/* Allocates nbytes holding pattern_seed(i, seed) in the exporter helper and
 * exports it: its id, with the handle in hex (or the exporter's answer,
 * "error ...") in out; -1 when the allocation failed. */
static int export_one(child_t *ex, size_t nbytes, unsigned seed, char *out,
                      size_t cap) {
  int id = -1;
  const char *line = ask(ex, "alloc %zu %u", nbytes, seed);
  if (sscanf(line, "id %d", &id) != 1) {
    snprintf(out, cap, "%s", line);
    return -1;
  }
  line = ask(ex, "export %d", id);
  snprintf(out, cap, "%s", !strncmp(line, "handle ", 7) ? line + 7 : line);
  return id;
}

static bool is_hex_handle(const char *s) {
  return strncmp(s, "error", 5) != 0 && s[0] != '\0';
}

/* One helper's driver counters, as a line (for failure messages). */
static void helper_stats(child_t *c, char *out, size_t cap) {
  snprintf(out, cap, "%s", ask(c, "stats"));
}

/* stale_cache_2609: CR 26.09's import cache keys a descriptor by (fd
 * number, pool offset, pid, ...) and keeps it after zeMemCloseIpcHandle
 * (research §2). Exporter and importer on 26.09; the importer opens A,
 * checks and closes it, then opens B, and must read B. With usmipc's own
 * import cache on, and off (USMIPC_IPC_CACHE_BYTES=0) so that it cannot
 * hide what the driver does. */
static int test_cr_stale_cache_2609(void) {
  char failures[2][1400] = {"", ""};
  for (int variant = 0; variant < 2; variant++) {
    const char *ex_env[] = CR_ENV("cr-26.09", NULL);
    const char *im_env[] =
        CR_ENV("cr-26.09", variant ? "USMIPC_IPC_CACHE_BYTES=0" : NULL);
    const char *what = variant ? "USMIPC_IPC_CACHE_BYTES=0" : "default cache";
    child_t ex, im;
    char a[1024], b[1024], st[2048];
    CHECK(start_helper(&ex, "exporter", ex_env) == 0 &&
              start_helper(&im, "importer", im_env) == 0,
          "spawn");
    /* 2 MiB each: outside the pools, so both have pool offset 0. */
    CHECK(export_one(&ex, 2 << 20, 1, a, sizeof(a)) >= 0 && is_hex_handle(a),
          "%s: export A: %s", what, a);
    CHECK(export_one(&ex, 2 << 20, 2, b, sizeof(b)) >= 0 && is_hex_handle(b),
          "%s: export B: %s", what, b);
    const char *line = ask(&im, "open 1 %s", a);
    CHECK(!strcmp(line, "ok"), "%s: open A: %s", what, line);
    line = ask(&im, "close");
    CHECK(!strcmp(line, "closed"), "%s: close A: %s", what, line);
    char got[1024];
    snprintf(got, sizeof(got), "%s", ask(&im, "open 2 %s", b));
    helper_stats(&im, st, sizeof(st));
    if (strcmp(got, "ok") != 0)
      snprintf(failures[variant], sizeof(failures[variant]),
               "%s: opening B after A read: %s [importer's driver: %llu "
               "cache hits, %llu stale]",
               what, got, stat_of(st, "import_cache_hits"),
               stat_of(st, "import_cache_stale_hits"));
    child_say(&im, "exit");
    child_say(&ex, "exit");
    CHECK(child_end(&im) == 0 && child_end(&ex) == 0, "a helper failed");
  }
  CHECK(!failures[0][0] && !failures[1][0], "%s%s%s", failures[0],
        failures[0][0] && failures[1][0] ? "; " : "", failures[1]);
  return PASS;
}

/* pool_free_neighbour: CR 26.09 carves device allocations of up to 1 MiB
 * from 2 MiB pools; a handle names the pool's descriptor, whose count
 * zeMemFree of any allocation of the pool decrements, closing it at 0
 * (research §3). The exporter allocates A and B (64 KiB each), exports
 * only B and frees A; B must still open elsewhere, both ways. */
static int test_cr_pool_free_neighbour(void) {
  const char *env[] = CR_ENV("cr-26.09", NULL);
  child_t ex, im;
  char b[1024], st[2048];
  CHECK(start_helper(&ex, "exporter", env) == 0 &&
            start_helper(&im, "importer", env) == 0,
        "spawn");
  const char *line = ask(&ex, "alloc 65536 1");
  CHECK(!strcmp(line, "id 0"), "alloc A: %s", line);
  CHECK(export_one(&ex, 65536, 2, b, sizeof(b)) == 1 && is_hex_handle(b),
        "export B: %s", b);
  line = ask(&ex, "free 0");
  CHECK(!strcmp(line, "freed"), "free A: %s", line);
  char got[1024];
  snprintf(got, sizeof(got), "%s", ask(&im, "open 2 %s", b));
  helper_stats(&ex, st, sizeof(st));
  CHECK(!strcmp(got, "ok"),
        "opening B after the exporter freed A: %s [exporter's driver: pooled "
        "%llu, pool descriptor closed while exported %llu]",
        got, stat_of(st, "pooled_allocations"),
        stat_of(st, "pool_fd_closed_while_exported"));
  line = ask(&im, "write 4096 107");
  CHECK(!strcmp(line, "written"), "importer: %s", line);
  line = ask(&ex, "check 1 0 4096 107");
  CHECK(!strcmp(line, "ok"), "the exporter does not see the write: %s", line);
  child_say(&im, "exit");
  child_say(&ex, "exit");
  CHECK(child_end(&im) == 0 && child_end(&ex) == 0, "a helper failed");
  return PASS;
}

/* Exports nbytes (seed) under ex_env and opens it under im_env; the data
 * is checked both ways. */
static int export_and_open(const char *const *ex_env, const char *const *im_env,
                           size_t nbytes, const char *what) {
  child_t ex, im;
  char h[1024], st[2048];
  CHECK(start_helper(&ex, "exporter", ex_env) == 0 &&
            start_helper(&im, "importer", im_env) == 0,
        "spawn");
  /* A first allocation, so that a pooled one sits at a non-zero offset. */
  const char *line = ask(&ex, "alloc 65536 4");
  CHECK(!strcmp(line, "id 0"), "%s: alloc: %s", what, line);
  CHECK(export_one(&ex, nbytes, 5, h, sizeof(h)) == 1 && is_hex_handle(h),
        "%s: export: %s", what, h);
  char got[1024];
  snprintf(got, sizeof(got), "%s", ask(&im, "open 5 %s", h));
  helper_stats(&im, st, sizeof(st));
  CHECK(!strcmp(got, "ok"),
        "%s: open: %s [importer's driver: %llu opaque opens, %llu legacy]",
        what, got, stat_of(st, "opaque_opens"), stat_of(st, "legacy_opens"));
  line = ask(&im, "write 4096 92");
  CHECK(!strcmp(line, "written"), "%s: importer: %s", what, line);
  line = ask(&ex, "check 1 0 4096 92");
  CHECK(!strcmp(line, "ok"),
        "%s: the exporter does not see the importer's write: %s", what, line);
  child_say(&im, "exit");
  child_say(&ex, "exit");
  CHECK(child_end(&im) == 0 && child_end(&ex) == 0, "%s: a helper failed",
        what);
  return PASS;
}

/* newer_loader_uninitialized: a loader >= 1.10 whose intercept layer
 * answers ZE_RESULT_ERROR_UNINITIALIZED for zeMemPutIpcHandle and
 * zeMemGetFileDescriptorFromIpcHandleExp, which CR 26.18 does not provide
 * (research §4): export and cross-process open must still work. */
static int test_cr_newer_loader_uninitialized(void) {
  const char *env[] =
      CR_ENV("cr-26.18", "USMIPC_ZE_TEST_NEWER_LOADER=uninitialized");
  return export_and_open(env, env, 256 << 10,
                         "cr-26.18, NEWER_LOADER=uninitialized");
}

/* handle_fd_devnode: a driver whose handle carries, where Intel's layouts
 * have the dma-buf, a descriptor of another kind (here /dev/null): the
 * export must be refused, saying it is not a dma-buf, instead of
 * publishing that descriptor. */
static int test_cr_handle_fd_devnode(void) {
  const char *env[] = CR_ENV("cr-26.31", "USMIPC_ZE_TEST_HANDLE_FD=devnode");
  child_t ex;
  char h[1024];
  CHECK(start_helper(&ex, "exporter", env) == 0, "spawn");
  int id = export_one(&ex, 256 << 10, 6, h, sizeof(h));
  child_say(&ex, "exit");
  CHECK(child_end(&ex) == 0, "exporter failed");
  CHECK(id == 0, "alloc: %s", h);
  CHECK(!strncmp(h, "error USMIPC_ENOTSUP", 20) && strstr(h, "dma-buf"),
        "export of a handle naming /dev/null: %s",
        is_hex_handle(h) ? "succeeded (published /dev/null)" : h);
  fprintf(stderr, "    refused as expected: %s\n", h + 6);
  return PASS;
}

/* multi_bo_refused: an allocation split over two buffer objects
 * (zexMemGetIpcHandles reports 2; zeMemGetIpcHandle names the first only,
 * research §6) cannot be shared with one handle: refused; one with a
 * single buffer object still exports and opens. PVC, where such
 * allocations exist, keeps the legacy layout and no pools: cr-25.35. */
static int test_cr_multi_bo_refused(void) {
  const char *env[] = CR_ENV("cr-25.35", "USMIPC_ZE_TEST_MULTI_BO=1");
  int rc = export_and_open(env, env, 64 << 10, "64 KiB, MULTI_BO=1");
  if (rc != PASS)
    return rc;
  child_t ex;
  char h[1024];
  CHECK(start_helper(&ex, "exporter", env) == 0, "spawn");
  int id = export_one(&ex, 4 << 20, 7, h, sizeof(h));
  child_say(&ex, "exit");
  CHECK(child_end(&ex) == 0, "exporter failed");
  CHECK(id == 0, "alloc: %s", h);
  CHECK(!strncmp(h, "error USMIPC_ENOTSUP", 20),
        "export of a 4 MiB allocation of two buffer objects: %s",
        is_hex_handle(h) ? "succeeded (its handle names half the memory)" : h);
  fprintf(stderr, "    refused as expected: %s\n", h + 6);
  return PASS;
}

/* mixed_*: exporter and importer on different releases (each parses the
 * handle by its own layout, research §1.2). */
static int mixed_pair(const char *ex_profile, const char *im_profile) {
  char ex_p[64], im_p[64], what[128];
  snprintf(ex_p, sizeof(ex_p), "USMIPC_ZE_TEST_PROFILE=%s", ex_profile);
  snprintf(im_p, sizeof(im_p), "USMIPC_ZE_TEST_PROFILE=%s", im_profile);
  snprintf(what, sizeof(what), "%s -> %s", ex_profile, im_profile);
  const char *ex_env[] = CR_ENV_WITH(ex_p, NULL);
  const char *im_env[] = CR_ENV_WITH(im_p, NULL);
  /* 256 KiB: pooled (at offset 64 KiB) where the exporter pools. */
  return export_and_open(ex_env, im_env, 256 << 10, what);
}

static int test_cr_mixed_2609_to_2535(void) {
  return mixed_pair("cr-26.09", "cr-25.35");
}
static int test_cr_mixed_2535_to_2618(void) {
  return mixed_pair("cr-25.35", "cr-26.18");
}
static int test_cr_mixed_2618_to_2609(void) {
  return mixed_pair("cr-26.18", "cr-26.09");
}
static int test_cr_mixed_2605o_to_2618(void) {
  return mixed_pair("cr-26.05-opaque", "cr-26.18");
}

/* importer_fd_leak: CR's opaque path takes a descriptor (pidfd_getfd, a
 * cache dup) for every import and never closes it (intel/compute-runtime
 * #974, research §2). The importer opens and closes 50 different exported
 * buffers, usmipc's cache off: its descriptor count may grow by 2 at most
 * (what usmipc keeps per exporter). */
static int importer_fd_leak(const char *profile) {
  char p[64];
  snprintf(p, sizeof(p), "USMIPC_ZE_TEST_PROFILE=%s", profile);
  const char *ex_env[] = CR_ENV_WITH(p, NULL);
  const char *im_env[] = CR_ENV_WITH(p, "USMIPC_IPC_CACHE_BYTES=0");
  enum { N = 50 };
  static char handles[N][1024];
  child_t ex, im;
  CHECK(start_helper(&ex, "exporter", ex_env) == 0 &&
            start_helper(&im, "importer", im_env) == 0,
        "spawn");
  for (int i = 0; i < N; i++)
    CHECK(export_one(&ex, 64 << 10, (unsigned)i + 1, handles[i],
                     sizeof(handles[i])) == i &&
              is_hex_handle(handles[i]),
          "%s: export %d: %s", profile, i, handles[i]);
  int before = -1, after = -1, bad = 0;
  char first_bad[1024] = "";
  CHECK(sscanf(ask(&im, "fds"), "fds %d", &before) == 1, "importer fds");
  for (int i = 0; i < N; i++) {
    const char *line = ask(&im, "open %d %s", i + 1, handles[i]);
    if (strcmp(line, "ok") != 0) {
      if (bad++ == 0)
        snprintf(first_bad, sizeof(first_bad), "open %d: %s", i, line);
      if (strncmp(line, "mismatch", 8) != 0)
        continue; /* not opened: nothing to close */
    }
    line = ask(&im, "close");
    CHECK(!strcmp(line, "closed"), "%s: close %d: %s", profile, i, line);
  }
  CHECK(sscanf(ask(&im, "fds"), "fds %d", &after) == 1, "importer fds");
  char st[2048];
  helper_stats(&im, st, sizeof(st));
  CHECK(after - before <= 2 && bad == 0,
        "%s: after %d opens and closes the importer holds %d more "
        "descriptors (2 allowed); %d opens failed or read other data%s%s "
        "[importer's driver: %llu descriptors kept, %llu cache hits, %llu "
        "stale]",
        profile, N, after - before, bad, bad ? ", first: " : "", first_bad,
        stat_of(st, "import_fds_kept"), stat_of(st, "import_cache_hits"),
        stat_of(st, "import_cache_stale_hits"));
  child_say(&im, "exit");
  child_say(&ex, "exit");
  CHECK(child_end(&im) == 0 && child_end(&ex) == 0, "a helper failed");
  return PASS;
}

static int test_cr_importer_fd_leak(void) {
  int rc = importer_fd_leak("cr-26.09");
  int rc2 = importer_fd_leak("cr-26.18");
  return rc != PASS ? rc : rc2;
}

/* cr_driver_profiles: the test driver itself, through the loader alone,
 * keeps the contract that ze_test_driver.h states for each profile: its
 * driverVersion and extension, which extension functions it serves, the
 * bytes of its handles (layout, pid, opaqueHandle copy, pool offset), and
 * what an unmodified handle does in another process of the same profile
 * (opaque releases fetch the descriptor themselves, from the cache on the
 * second open; the legacy layout names a descriptor of the exporter). */
static int test_cr_driver_profiles(void) {
  static const struct {
    const char *name;
    unsigned version;
    unsigned layout; /* bytes the driver writes: 0 ideal */
    bool pooled, opaque, socket;
    unsigned second_open_hits;
  } profiles[] = {
      {"ideal", 1, 0, false, false, false, 0},
      {"cr-25.35", 0x19238918, 17, false, false, false, 0},
      {"cr-26.05-opaque", 0x1a05909c, 22, false, true, false, 0},
      {"cr-26.09", 0x1a09923b, 55, true, true, false, 1},
      {"cr-26.14", 0x1a0e93c9, 55, true, true, false, 1},
      {"cr-26.18", 0x1a1295a4, 63, true, true, false, 1},
      {"cr-26.31", 0x1a1f99e3, 63, true, true, false, 1},
      {"cr-sockets", 0x1a1f99e3, 63, true, true, true, 1},
  };
  for (size_t i = 0; i < sizeof(profiles) / sizeof(profiles[0]); i++) {
    const char *name = profiles[i].name;
    bool cr = profiles[i].layout != 0;
    char p[64];
    snprintf(p, sizeof(p), "USMIPC_ZE_TEST_PROFILE=%s", name);
    const char *env[] = CR_ENV_WITH(p, NULL);
    child_t a, b;
    CHECK(start_helper(&a, "zeprobe", env) == 0 &&
              start_helper(&b, "zeprobe", env) == 0,
          "spawn");
    unsigned version, put, fd, fromfd, zex;
    char ext[256];
    const char *line = child_hear(&a);
    CHECK(sscanf(line, "facts %x %255s %x %x %x %x", &version, ext, &put, &fd,
                 &fromfd, &zex) == 6,
          "%s: %s", name, line);
    child_hear(&b);
    CHECK(version == profiles[i].version, "%s: driverVersion 0x%x", name,
          version);
    CHECK(!strcmp(ext, USMIPC_ZE_TEST_EXTENSION_NAME), "%s: extension %s", name,
          ext);
    /* CR serves none of the three API 1.6 IPC entries and does serve
     * zexMemGetIpcHandles; ideal the other way round (research §4). */
    const unsigned ia = ZE_RESULT_ERROR_INVALID_ARGUMENT;
    CHECK(cr ? put == ia && fd == ia && fromfd == ia && zex == 0
             : put == 0 && fd == 0 && fromfd == ia && zex == ia,
          "%s: lookups put 0x%x fd 0x%x fromfd 0x%x zex 0x%x", name, put, fd,
          fromfd, zex);
    char hex[256];
    int count = 0;
    line = ask(&a, "export");
    CHECK(sscanf(line, "handle %255s %d", hex, &count) == 2, "%s: %s", name,
          line);
    uint8_t h[64];
    CHECK(from_hex(hex, h, sizeof(h)) == 64, "%s: handle %s", name, hex);
    CHECK(count == (cr ? 1 : -1), "%s: zexMemGetIpcHandles counts %d", name,
          count);
    int32_t fd0, copy;
    uint64_t wide, offset;
    uint32_t pid;
    memcpy(&fd0, h, 4);
    memcpy(&wide, h, 8);
    memcpy(&offset, h + 8, 8);
    memcpy(&pid, h + 16, 4);
    memcpy(&copy, h + 22, 4);
    CHECK(offset == (profiles[i].pooled ? 65536 : 0), "%s: pool offset %llu",
          name, (unsigned long long)offset);
    CHECK(fd0 > 2 && wide == (uint64_t)fd0, "%s: fd 0x%llx", name,
          (unsigned long long)wide);
    if (profiles[i].layout == 17)
      CHECK(h[16] == 0 && pid == 0, "%s: legacy type byte %u", name, h[16]);
    if (profiles[i].layout > 17)
      CHECK(pid == (uint32_t)a.pid && h[20] == 0 && h[21] == 0,
            "%s: pid %u (exporter %d), handle type %u, memory type %u", name,
            pid, (int)a.pid, h[20], h[21]);
    if (profiles[i].layout == 63)
      CHECK(copy == fd0, "%s: opaqueHandle %d, fd %d", name, copy, fd0);
    for (unsigned k = profiles[i].layout == 63 ? 26 : 22;
         cr && k < profiles[i].layout; k++)
      CHECK(h[k] == 0, "%s: byte %u is 0x%02x", name, k, h[k]);
    for (int k = 0; k < 2; k++) {
      unsigned rc, byte;
      line = ask(&b, "open %s", hex);
      CHECK(sscanf(line, "opened %x %x", &rc, &byte) == 2, "%s: %s", name,
            line);
      if (profiles[i].opaque)
        CHECK(rc == 0 && byte == 0x5a, "%s: open %d: 0x%x, byte 0x%02x", name,
              k, rc, byte);
      else
        CHECK(rc == ia, "%s: open %d of an unmoved descriptor: 0x%x", name, k,
              rc);
    }
    char st[2048];
    helper_stats(&b, st, sizeof(st));
    if (profiles[i].opaque)
      CHECK(stat_of(st,
                    profiles[i].socket ? "socket_fetches" : "pidfd_fetches") ==
                    2 - profiles[i].second_open_hits &&
                stat_of(st, "import_cache_hits") ==
                    profiles[i].second_open_hits &&
                stat_of(st, "opaque_opens") == 2,
            "%s: importer's driver: %s", name, st);
    child_say(&a, "exit");
    child_say(&b, "exit");
    CHECK(child_end(&a) == 0 && child_end(&b) == 0, "%s: a helper failed",
          name);
  }
  return PASS;
}

/* ---- events
 * ------------------------------------------------------------------ */

/* The bytes of a "handle HEX" answer into out; 0 when it is not one. */
static size_t handle_of(const char *line, uint8_t *out, size_t cap) {
  if (strncmp(line, "handle ", 7) != 0)
    return 0;
  return from_hex(line + 7, out, cap);
}

#define ASK_OK(c, ...)                                                         \
  do {                                                                         \
    const char *a_ = ask((c), __VA_ARGS__);                                    \
    CHECK(!strncmp(a_, "ok", 2), "helper answered '%s'", a_);                  \
  } while (0)

/* The stats of a helper as one line, and this process's own. */
static unsigned long long own_stat(const char *name) {
  usmipc_ze_test_stats_t s;
  char line[4096];
  if (get_stats(&s) != 0)
    return ~0ull;
  format_stats(&s, line, sizeof(line));
  return stat_of(line, name);
}

/* event_wait_orders: a consumer's wait on the device really orders its
 * later work after a producer's, across processes. The producer's queue is
 * an asynchronous list (another library's, wrapped) on which a command of 2
 * s (the test driver's stand-in for a long kernel) runs before a fill of
 * the exported memory and the ordering record: so the fill lands 2 s after
 * the handle was sent. An unordered open and copy in this process reads the
 * old bytes (proof that the fill is still pending); an ordered open on a
 * queue appends a wait there, and the copy that follows reads the new
 * bytes, at least 1.5 s later. Then the same with the host waiting. */
static int test_event_wait_orders(void) {
  usmipc_device_t *d = gpu();
  CHECK(d != NULL, "no device");
  const size_t n = 1 << 20;
  child_t p;
  CHECK(start_helper(&p, "evagent", NULL) == 0, "spawn");
  ASK_OK(&p, "alloc %zu 17", n);
  ASK_OK(&p, "asyncq");
  uint8_t b[4096], b2[4096];
  CHECK(handle_of(ask(&p, "export"), b, sizeof(b)) > 0, "export");
  ASK_OK(&p, "delay 2000");
  ASK_OK(&p, "fill 34");
  uint64_t t0 = mono_ms();
  size_t len = handle_of(ask(&p, "order"), b, sizeof(b));
  CHECK(len > 0, "order");
  CHECK(mono_ms() - t0 < 1000, "ordering blocked the producer for %llu ms",
        (unsigned long long)(mono_ms() - t0));
  usmipc_queue_t *q = NULL;
  uint8_t *host = malloc(n), *m = NULL;
  CHECK(host != NULL, "malloc");
  CHECK_OK(usmipc_queue_create(d, &q));
  /* The control: without the wait, the copy reads what was there. */
  CHECK_OK(usmipc_ipc_open_ex(b, len, NULL, 0, q, USMIPC_OPEN_UNORDERED,
                              (void **)&m, NULL));
  CHECK_OK(usmipc_memcpy(q, host, m, n));
  CHECK_OK(usmipc_queue_synchronize(q));
  CHECK(first_mismatch(host, 0, n, 17) < 0,
        "the producer's fill ran before anyone waited (byte 0 is 0x%02x): "
        "the delay did not hold it, so this test proves nothing",
        host[0]);
  CHECK_OK(usmipc_ipc_close(m));
  /* Ordered on q: the copy runs after the producer's fill. */
  CHECK_OK(usmipc_ipc_open_ex(b, len, NULL, 0, q, 0, (void **)&m, NULL));
  CHECK_OK(usmipc_memcpy(q, host, m, n));
  CHECK_OK(usmipc_queue_synchronize(q));
  uint64_t waited = mono_ms() - t0;
  long bad = first_mismatch(host, 0, n, 34);
  CHECK(bad < 0,
        "the consumer's copy read 0x%02x at %ld: it ran before the "
        "producer's fill, which it should have waited for",
        bad >= 0 ? host[bad] : 0, bad);
  CHECK(waited >= 1500,
        "the ordered copy was done after %llu ms, before "
        "the producer's 2 s command could have finished",
        (unsigned long long)waited);
  CHECK_OK(usmipc_ipc_close(m));
  CHECK(own_stat("event_waits") >= 1 && own_stat("wait_timeouts") == 0,
        "the consumer's driver ran %llu appended waits (%llu timed out)",
        own_stat("event_waits"), own_stat("wait_timeouts"));
  /* Again, the host waiting (queue NULL); the ring event is reused (its
   * record completed) and opened from this process's cache. */
  ASK_OK(&p, "delay 1000");
  ASK_OK(&p, "fill 51");
  t0 = mono_ms();
  size_t len2 = handle_of(ask(&p, "order"), b2, sizeof(b2));
  CHECK(len2 > 0, "order");
  CHECK_OK(usmipc_ipc_open_ex(b2, len2, NULL, 0, NULL, 0, (void **)&m, NULL));
  waited = mono_ms() - t0;
  CHECK_OK(usmipc_memcpy(q, host, m, n));
  CHECK_OK(usmipc_queue_synchronize(q));
  CHECK(first_mismatch(host, 0, n, 51) < 0 && waited >= 700,
        "after a host wait of %llu ms the consumer read 0x%02x, not 0x33",
        (unsigned long long)waited, host[0]);
  CHECK_OK(usmipc_ipc_close(m));
  CHECK(own_stat("event_pool_opens") == 1 && own_stat("live_event_pools") == 1,
        "the consumer's driver opened %llu event pools (%llu live): the ring "
        "event should have been opened once",
        own_stat("event_pool_opens"), own_stat("live_event_pools"));
  /* The producer's queue synchronizes (a barrier and a host wait on the
   * foreign list) and holds what was written. */
  ASK_OK(&p, "sync");
  ASK_OK(&p, "check 51");
  char st[4096];
  helper_stats(&p, st, sizeof(st));
  CHECK(stat_of(st, "delays") == 2 && stat_of(st, "async_commands") >= 6 &&
            stat_of(st, "event_pool_ipc_gets") == 1,
        "producer: %s", st);
  child_say(&p, "exit");
  CHECK(child_end(&p) == 0, "producer failed");
  usmipc_queue_destroy(q);
  free(host);
  return PASS;
}

/* One forged variant of an event handle's Level Zero payload. */
typedef struct forgery {
  const char *what;
  int code;
  int at;       /* payload byte to change (-1: none) */
  int value;    /* its new value */
  int len;      /* new payload length (-1: unchanged) */
  int kind;     /* new event kind (-1: unchanged) */
  int64_t size; /* new pool size field (-1: unchanged) */
} forgery_t;

/* event_payload_forged: an importer given an event handle whose Level Zero
 * payload was tampered with (the exporter's identity and capability are
 * genuine, only the payload lies) refuses it with USMIPC_EBADHANDLE and
 * says why, before its driver sees anything; a payload of another GPU's
 * event layout is USMIPC_ENOTSUP. The genuine handle then opens. */
static int test_event_payload_forged(void) {
  CHECK(gpu() != NULL, "no device");
  child_t p;
  CHECK(start_helper(&p, "evagent", NULL) == 0, "spawn");
  ASK_OK(&p, "evcreate 0");
  ASK_OK(&p, "evrecord 0");
  uint8_t b[4096], f[4096];
  size_t len = handle_of(ask(&p, "evhandle 0"), b, sizeof(b));
  CHECK(len > 0, "evhandle");
  usmipc__wire_t w;
  CHECK_OK(usmipc__wire_decode(b, len, &w));
  CHECK(w.is_event && w.event_kind == 1 && w.payload.len == 32 &&
            w.payload.bytes[0] == 1 && (w.flags & USMIPC__WIRE_FLAG_FD),
        "the event handle's payload: kind %u, %u bytes", w.event_kind,
        w.payload.len);
  uint64_t size = usmipc__get64le(w.payload.bytes + 24);
  CHECK(size >= 65536 && size % 65536 == 0, "pool size %llu",
        (unsigned long long)size);
  const forgery_t cases[] = {
      {"truncated payload", USMIPC_EBADHANDLE, -1, 0, 31, -1, -1},
      {"no payload", USMIPC_EBADHANDLE, -1, 0, 0, -1, -1},
      {"a payload byte too many", USMIPC_EBADHANDLE, -1, 0, 33, -1, -1},
      {"another event kind", USMIPC_EBADHANDLE, -1, 0, -1, 2, -1},
      {"payload version 2", USMIPC_EBADHANDLE, 0, 2, -1, -1, -1},
      {"unknown layout", USMIPC_EBADHANDLE, 1, 9, -1, -1, -1},
      {"not host-visible", USMIPC_EBADHANDLE, 2, 0, -1, -1, -1},
      {"timestamp pool", USMIPC_EBADHANDLE, 2, 0x12, -1, -1, -1},
      {"unknown flag", USMIPC_EBADHANDLE, 2, 0x22, -1, -1, -1},
      {"reserved byte 3", USMIPC_EBADHANDLE, 3, 1, -1, -1, -1},
      {"two events", USMIPC_EBADHANDLE, 8, 2, -1, -1, -1},
      {"event index 1", USMIPC_EBADHANDLE, 16, 1, -1, -1, -1},
      {"reserved byte 20", USMIPC_EBADHANDLE, 20, 1, -1, -1, -1},
      {"no packets", USMIPC_EBADHANDLE, 12, 0, -1, -1, -1},
      {"a larger pool than the descriptor", USMIPC_EBADHANDLE, -1, 0, -1, -1,
       (int64_t)size + 65536},
      {"a zero-byte pool", USMIPC_EBADHANDLE, -1, 0, -1, -1, 0},
      {"another GPU's packet count", USMIPC_ENOTSUP, 12, 17, -1, -1, -1},
  };
  for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
    const forgery_t *c = &cases[i];
    usmipc__wire_t x = w;
    if (c->at >= 0)
      x.payload.bytes[c->at] = (uint8_t)c->value;
    if (c->len >= 0) {
      memset(x.payload.bytes + w.payload.len, 0,
             sizeof(x.payload.bytes) - w.payload.len);
      x.payload.len = (uint16_t)c->len;
    }
    if (c->size >= 0)
      usmipc__put64le(x.payload.bytes + 24, (uint64_t)c->size);
    if (c->kind >= 0) {
      uint16_t rlen;
      uint8_t *r = (uint8_t *)usmipc__ext_find(x.ext, x.ext_len,
                                               USMIPC__EXT_EVENT, &rlen);
      CHECK(r != NULL, "no event record");
      r[12] = (uint8_t)c->kind;
    }
    size_t flen = usmipc__wire_len(&x);
    usmipc__wire_encode(&x, f);
    usmipc_event_t *ev = NULL;
    int rc = usmipc_ipc_open_event(f, flen, NULL, &ev);
    probe_record(__FILE__, __LINE__, c->what, rc, usmipc_last_error());
    CHECK(rc == c->code, "%s: %s, expected %s (%s)", c->what,
          usmipc_err_name(rc), usmipc_err_name(c->code), usmipc_last_error());
    const char *msg = usmipc_last_error();
    CHECK(c->code != USMIPC_EBADHANDLE || strstr(msg, "forged") ||
              strstr(msg, "version"),
          "%s: the message does not say the handle is wrong: %s", c->what, msg);
    fprintf(stderr, "    %s: %s\n", c->what, msg);
  }
  CHECK(own_stat("event_pool_opens") == 0 &&
            own_stat("event_pool_open_failures") == 0,
        "a forged payload reached the driver (%llu opens, %llu refusals)",
        own_stat("event_pool_opens"), own_stat("event_pool_open_failures"));
  usmipc_event_t *ev = NULL;
  CHECK_OK(usmipc_ipc_open_event(b, len, NULL, &ev));
  CHECK_OK(usmipc_event_synchronize(ev));
  CHECK(own_stat("event_pool_opens") == 1, "the genuine handle: %llu opens",
        own_stat("event_pool_opens"));
  CHECK_OK(usmipc_event_destroy(ev));
  child_say(&p, "exit");
  CHECK(child_end(&p) == 0, "producer failed");
  return PASS;
}

/* event_descriptor_refused: the backend's event_import, given a genuine
 * payload with a descriptor that is not the event pool's dma-buf (none, a
 * pipe, /dev/null, a memfd of nobody's, another dma-buf of the driver: a
 * memory allocation), refuses it with USMIPC_EBADHANDLE before its driver
 * sees it; the pool's own descriptor opens. */
static int test_event_descriptor_refused(void) {
  usmipc_device_t *d = gpu();
  CHECK(d != NULL, "no device");
  usmipc_queue_t *q = NULL;
  usmipc_event_t *ev = NULL;
  usmipc_ipc_handle_t *eh = NULL, *mh = NULL;
  const void *data;
  size_t len;
  void *mem = NULL;
  CHECK_OK(usmipc_queue_create(d, &q));
  CHECK_OK(usmipc_event_create(d, 0, &ev));
  CHECK_OK(usmipc_event_record(ev, q));
  CHECK_OK(usmipc_ipc_get_event_handle(ev, &eh));
  CHECK_OK(usmipc_ipc_handle_data(eh, &data, &len));
  usmipc__wire_t w, mw;
  CHECK_OK(usmipc__wire_decode(data, len, &w));
  usmipc__payload_t payload = w.payload;
  payload.handle_kind = w.event_kind;
  /* A dma-buf of the driver that is memory, not an event pool. */
  CHECK_OK(usmipc_malloc(d, USMIPC_MEM_DEVICE, 4096, &mem));
  CHECK_OK(usmipc_ipc_get_handle(mem, 0, &mh));
  CHECK_OK(usmipc_ipc_handle_data(mh, &data, &len));
  CHECK_OK(usmipc__wire_decode(data, len, &mw));
  int pipefd[2];
  CHECK(pipe(pipefd) == 0, "pipe");
  int devnull = open("/dev/null", O_RDWR | O_CLOEXEC);
  int other = memfd_create("not-a-dma-buf", MFD_CLOEXEC);
  CHECK(devnull >= 0 && other >= 0 && ftruncate(other, 65536) == 0, "fds");
  const struct {
    const char *what;
    int fd;
  } cases[] = {
      {"no descriptor", -1},
      {"a pipe", pipefd[0]},
      {"/dev/null", devnull},
      {"a memfd of nobody's", other},
      {"the driver's memory dma-buf", (int)mw.fd_number},
  };
  const usmipc__backend_ops_t *ops = d->ops;
  for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
    void *native = NULL;
    int rc =
        ops->event_import(d->native, d->native, &payload, cases[i].fd, &native);
    probe_record(__FILE__, __LINE__, cases[i].what, rc, usmipc_last_error());
    CHECK(rc == USMIPC_EBADHANDLE, "%s: %s (%s)", cases[i].what,
          usmipc_err_name(rc), usmipc_last_error());
    fprintf(stderr, "    %s: %s\n", cases[i].what, usmipc_last_error());
  }
  CHECK(own_stat("event_pool_opens") == 0 &&
            own_stat("event_pool_open_failures") == 0,
        "a wrong descriptor reached the driver");
  /* The pool's own descriptor (the one this process published). */
  void *native = NULL;
  CHECK(ops->event_import(d->native, d->native, &payload, (int)w.fd_number,
                          &native) == 0,
        "the genuine descriptor: %s", usmipc_last_error());
  CHECK(ops->event_query(d->native, native) == 1,
        "the opened event is not complete");
  CHECK(ops->event_close(d->native, native) == 0, "close");
  CHECK(own_stat("event_pool_opens") == 1 && own_stat("event_pool_closes") == 1,
        "genuine open: %llu opens, %llu closes", own_stat("event_pool_opens"),
        own_stat("event_pool_closes"));
  close(pipefd[0]);
  close(pipefd[1]);
  close(devnull);
  close(other);
  usmipc_ipc_free_handle(mh);
  usmipc_free(mem);
  usmipc_ipc_free_handle(eh);
  usmipc_event_destroy(ev);
  usmipc_queue_destroy(q);
  return PASS;
}

/* event_reopen_cached: a ring event is opened once per importer: 1000
 * re-opens of an ordered handle (and 1000 opens of the event it carries)
 * leave the importer's descriptor count and its driver's pool count where
 * the first open left them; 200 fresh handoffs open each ring event once. */
static int test_event_reopen_cached(void) {
  usmipc_device_t *d = gpu();
  CHECK(d != NULL, "no device");
  child_t p;
  CHECK(start_helper(&p, "evagent", NULL) == 0, "spawn");
  ASK_OK(&p, "alloc 65536 7");
  uint8_t b[4096];
  CHECK(handle_of(ask(&p, "export"), b, sizeof(b)) > 0, "export");
  size_t len = handle_of(ask(&p, "order"), b, sizeof(b));
  CHECK(len > 0, "order");
  usmipc_queue_t *q = NULL;
  CHECK_OK(usmipc_queue_create(d, &q));
  void *m = NULL;
  int fds = -1;
  for (int i = 0; i < 1000; i++) {
    CHECK_OK(usmipc_ipc_open_ex(b, len, NULL, 0, q, 0, &m, NULL));
    CHECK_OK(usmipc_ipc_close(m));
    usmipc_event_t *ev = NULL;
    CHECK_OK(usmipc_ipc_open_handle_event(b, len, NULL, &ev));
    CHECK(ev != NULL, "no event carried");
    CHECK_OK(usmipc_event_wait(ev, q));
    CHECK_OK(usmipc_event_destroy(ev));
    if (i == 0)
      fds = count_fds();
    CHECK(count_fds() == fds, "open %d: %d descriptors, %d after the first", i,
          count_fds(), fds);
  }
  CHECK(own_stat("event_pool_opens") == 1 && own_stat("live_event_pools") == 1,
        "1000 re-opens: the driver opened %llu pools (%llu live)",
        own_stat("event_pool_opens"), own_stat("live_event_pools"));
  for (int i = 0; i < 200; i++) {
    CHECK(ask(&p, "fill %d", i & 0xff)[0] == 'o', "fill");
    len = handle_of(ask(&p, "order"), b, sizeof(b));
    CHECK(len > 0, "order %d", i);
    CHECK_OK(usmipc_ipc_open_ex(b, len, NULL, 0, q, 0, &m, NULL));
    CHECK_OK(usmipc_ipc_close(m));
  }
  char st[4096];
  helper_stats(&p, st, sizeof(st));
  unsigned long long exported = stat_of(st, "event_pool_ipc_gets");
  CHECK(exported >= 1 && own_stat("event_pool_opens") == exported &&
            count_fds() <= fds + (int)exported,
        "200 handoffs of %llu ring events: %llu pools opened, %d descriptors "
        "(%d before)",
        exported, own_stat("event_pool_opens"), count_fds(), fds);
  child_say(&p, "exit");
  CHECK(child_end(&p) == 0, "producer failed");
  usmipc_queue_destroy(q);
  return PASS;
}

/* event_exporter_killed: the producer dies with its record pending (behind
 * a 10 s command). An importer waiting on the host learns it within a
 * second or two, not after 10 s or never; a device wait and a new open are
 * refused at once; no wait of the driver timed out. */
static int test_event_exporter_killed(void) {
  usmipc_device_t *d = gpu();
  CHECK(d != NULL, "no device");
  child_t p;
  CHECK(start_helper(&p, "evagent", NULL) == 0, "spawn");
  ASK_OK(&p, "asyncq");
  ASK_OK(&p, "evcreate 0");
  ASK_OK(&p, "delay 10000");
  ASK_OK(&p, "evrecord 0");
  uint8_t b[4096];
  size_t len = handle_of(ask(&p, "evhandle 0"), b, sizeof(b));
  CHECK(len > 0, "evhandle");
  usmipc_event_t *ev = NULL;
  CHECK_OK(usmipc_ipc_open_event(b, len, NULL, &ev));
  CHECK(usmipc_event_query(ev) == USMIPC_ENOTREADY, "pending record complete");
  kill(p.pid, SIGKILL);
  CHECK(child_end(&p) == 128 + SIGKILL, "producer was not killed");
  uint64_t t0 = mono_ms();
  CHECK_ERR(usmipc_event_synchronize(ev), USMIPC_EEXPORTERGONE);
  CHECK(mono_ms() - t0 < 3000, "the host wait noticed the death after %llu ms",
        (unsigned long long)(mono_ms() - t0));
  usmipc_queue_t *q = NULL;
  CHECK_OK(usmipc_queue_create(d, &q));
  t0 = mono_ms();
  CHECK_ERR(usmipc_event_wait(ev, q), USMIPC_EEXPORTERGONE);
  CHECK(mono_ms() - t0 < 1000, "the device wait took %llu ms",
        (unsigned long long)(mono_ms() - t0));
  usmipc_event_t *again = NULL;
  CHECK_ERR(usmipc_ipc_open_event(b, len, NULL, &again), USMIPC_EEXPORTERGONE);
  CHECK(own_stat("wait_timeouts") == 0 && own_stat("event_waits") == 0,
        "the driver was asked to wait (%llu waits, %llu timed out)",
        own_stat("event_waits"), own_stat("wait_timeouts"));
  CHECK_OK(usmipc_event_destroy(ev));
  usmipc_queue_destroy(q);
  return PASS;
}

/* ---- release tickets whose consumers exit ---------------------------------
 * A consumer returns its ticket with the handle of an event recorded after
 * its work; the producer's wait_released waits for that event. A consumer
 * that exits afterwards (cleanly, or killed) must neither turn the wait
 * into an error nor make the producer forget the other consumers' events:
 * before, the wait failed with EEXPORTERGONE opening the exited consumer's
 * event and had dropped every pending event, so a second call returned 0
 * at once while another consumer's work still ran. */

/* One ticketed handoff of p (no ordering event) as hex into out. */
static int ticket_hex(usmipc_ipc_handle_t *h, char *out) {
  const void *data;
  size_t len;
  int rc = usmipc_ipc_handle_order_ex(h, NULL, USMIPC_ORDER_RELEASE);
  if (rc == 0)
    rc = usmipc_ipc_handle_data(h, &data, &len);
  if (rc == 0)
    to_hex(data, len, out);
  return rc;
}

typedef struct release_waiter {
  usmipc_ipc_handle_t *h;
  int rc;
  uint64_t ended_ms;
  int done; /* atomic */
} release_waiter_t;

static void *release_wait_thread(void *arg) {
  release_waiter_t *w = arg;
  w->rc = usmipc_ipc_handle_wait_released(w->h, NULL);
  w->ended_ms = mono_ms();
  __atomic_store_n(&w->done, 1, __ATOMIC_RELEASE);
  return NULL;
}

/* release_consumer_exits: A returns its ticket and exits normally; B
 * returns its ticket with 2 s of work still queued. Every call waits for
 * B's work: a short timeout times out each time, a full wait ends only
 * once B's work is done. */
static int test_release_consumer_exits(void) {
  usmipc_device_t *d = gpu();
  CHECK(d != NULL, "no device");
  void *p = NULL;
  usmipc_ipc_handle_t *h = NULL;
  static char ta[4096], tb[4096];
  CHECK_OK(usmipc_malloc(d, USMIPC_MEM_DEVICE, 4096, &p));
  CHECK_OK(usmipc_ipc_get_handle(p, 0, &h));
  CHECK_OK(ticket_hex(h, ta));
  CHECK_OK(ticket_hex(h, tb));
  child_t a, b;
  CHECK(start_helper(&a, "evagent", NULL) == 0, "spawn A");
  CHECK(start_helper(&b, "evagent", NULL) == 0, "spawn B");
  ASK_OK(&a, "asyncq");
  ASK_OK(&a, "release %s", ta);
  ASK_OK(&a, "sync");
  ask(&a, "exit");
  CHECK(child_end(&a) == 0, "consumer A did not exit cleanly");
  ASK_OK(&b, "asyncq");
  ASK_OK(&b, "delay 2000");
  uint64_t t0 = mono_ms();
  ASK_OK(&b, "release %s", tb);
  CHECK_OK(usmipc_event_set_timeout(200));
  for (int call = 0; call < 3; call++) {
    int rc = usmipc_ipc_handle_wait_released(h, NULL);
    PROBE_ERR("usmipc_ipc_handle_wait_released(h, NULL)", rc);
    CHECK(rc == USMIPC_ETIMEDOUT,
          "call %d of the wait returned %s (%s) while consumer B's work "
          "still ran (%llu ms after its release)",
          call + 1, usmipc_err_name(rc), usmipc_last_error(),
          (unsigned long long)(mono_ms() - t0));
  }
  CHECK_OK(usmipc_event_set_timeout(0));
  CHECK_OK(usmipc_ipc_handle_wait_released(h, NULL));
  uint64_t took = mono_ms() - t0;
  CHECK(took >= 1800,
        "the wait ended %llu ms after B's release, before its 2 s of work",
        (unsigned long long)took);
  /* Done now, and the same on every later call, with a queue too. */
  CHECK_OK(usmipc_ipc_handle_wait_released(h, NULL));
  usmipc_queue_t *q = NULL;
  CHECK_OK(usmipc_queue_create(d, &q));
  CHECK_OK(usmipc_ipc_handle_wait_released(h, q));
  CHECK_OK(usmipc_queue_synchronize(q));
  ask(&b, "exit");
  CHECK(child_end(&b) == 0, "consumer B did not exit cleanly");
  CHECK_OK(usmipc_ipc_handle_wait_released(h, q));
  CHECK_OK(usmipc_queue_destroy(q));
  CHECK_OK(usmipc_ipc_free_handle(h));
  CHECK_OK(usmipc_free(p));
  return PASS;
}

/* release_lone_consumer_exits: one consumer returns its ticket after its
 * work, synchronizes and exits. Its work is done: the wait returns 0, on
 * the host and with a queue, the same on every call. */
static int test_release_lone_consumer_exits(void) {
  usmipc_device_t *d = gpu();
  CHECK(d != NULL, "no device");
  void *p = NULL;
  usmipc_ipc_handle_t *h = NULL;
  static char t[4096];
  CHECK_OK(usmipc_malloc(d, USMIPC_MEM_DEVICE, 4096, &p));
  CHECK_OK(usmipc_ipc_get_handle(p, 0, &h));
  CHECK_OK(ticket_hex(h, t));
  child_t a;
  CHECK(start_helper(&a, "evagent", NULL) == 0, "spawn");
  ASK_OK(&a, "asyncq");
  ASK_OK(&a, "delay 200");
  ASK_OK(&a, "release %s", t);
  ASK_OK(&a, "sync");
  ask(&a, "exit");
  CHECK(child_end(&a) == 0, "the consumer did not exit cleanly");
  CHECK_OK(usmipc_event_set_timeout(2000));
  usmipc_queue_t *q = NULL;
  CHECK_OK(usmipc_queue_create(d, &q));
  for (int call = 0; call < 3; call++) {
    int rc = usmipc_ipc_handle_wait_released(h, call == 1 ? q : NULL);
    CHECK(rc == 0, "call %d of the wait returned %s: %s", call + 1,
          usmipc_err_name(rc), usmipc_last_error());
  }
  CHECK_OK(usmipc_queue_synchronize(q));
  CHECK_OK(usmipc_queue_destroy(q));
  CHECK_OK(usmipc_event_set_timeout(0));
  CHECK_OK(usmipc_ipc_handle_wait_released(h, NULL));
  CHECK_OK(usmipc_ipc_free_handle(h));
  CHECK_OK(usmipc_free(p));
  return PASS;
}

/* release_consumer_killed: a consumer returns its ticket behind 10 s of
 * work and is killed while the producer waits for that work. Its work
 * died with it (the driver tears its context down), so the wait ends soon
 * after the kill, with 0, and the same on the next call; so does a wait
 * that begins after the death. */
static int test_release_consumer_killed(void) {
  usmipc_device_t *d = gpu();
  CHECK(d != NULL, "no device");
  void *p = NULL;
  usmipc_ipc_handle_t *h = NULL;
  static char t1[4096], t2[4096];
  CHECK_OK(usmipc_malloc(d, USMIPC_MEM_DEVICE, 4096, &p));
  CHECK_OK(usmipc_ipc_get_handle(p, 0, &h));
  CHECK_OK(ticket_hex(h, t1));
  child_t a;
  CHECK(start_helper(&a, "evagent", NULL) == 0, "spawn");
  ASK_OK(&a, "asyncq");
  ASK_OK(&a, "delay 10000");
  ASK_OK(&a, "release %s", t1);
  release_waiter_t w = {.h = h};
  pthread_t thread;
  CHECK(pthread_create(&thread, NULL, release_wait_thread, &w) == 0, "thread");
  usleep(300 * 1000);
  CHECK(__atomic_load_n(&w.done, __ATOMIC_ACQUIRE) == 0,
        "the wait ended (%s) while the consumer's work ran",
        usmipc_err_name(w.rc));
  uint64_t killed = mono_ms();
  kill(a.pid, SIGKILL);
  CHECK(child_end(&a) == 128 + SIGKILL, "the consumer was not killed");
  pthread_join(thread, NULL);
  CHECK(w.rc == 0, "the wait returned %s after the consumer was killed",
        usmipc_err_name(w.rc));
  CHECK(w.ended_ms - killed < 3000, "the wait ended %llu ms after the kill",
        (unsigned long long)(w.ended_ms - killed));
  CHECK_OK(usmipc_ipc_handle_wait_released(h, NULL));

  /* Killed before the producer waits: nothing left to wait for. */
  CHECK_OK(ticket_hex(h, t2));
  CHECK(start_helper(&a, "evagent", NULL) == 0, "spawn");
  ASK_OK(&a, "asyncq");
  ASK_OK(&a, "delay 10000");
  ASK_OK(&a, "release %s", t2);
  kill(a.pid, SIGKILL);
  CHECK(child_end(&a) == 128 + SIGKILL, "the consumer was not killed");
  usmipc_queue_t *q = NULL;
  CHECK_OK(usmipc_queue_create(d, &q));
  uint64_t t0 = mono_ms();
  CHECK_OK(usmipc_ipc_handle_wait_released(h, q));
  CHECK_OK(usmipc_ipc_handle_wait_released(h, NULL));
  CHECK(mono_ms() - t0 < 3000, "the waits took %llu ms",
        (unsigned long long)(mono_ms() - t0));
  CHECK_OK(usmipc_queue_destroy(q));
  CHECK_OK(usmipc_ipc_free_handle(h));
  CHECK_OK(usmipc_free(p));
  return PASS;
}

/* event_rerecord_never_early: a user's event recorded on an asynchronous
 * list behind a 1 s command, then recorded again on another asynchronous
 * list with nothing pending, must not look complete until the first
 * record's work is done: the old record's signal may land after the new
 * record's reset (a plain host reset and signal would report completion at
 * once). */
static int test_event_rerecord_never_early(void) {
  usmipc_device_t *d = gpu();
  CHECK(d != NULL, "no device");
  foreign_list_t la, lb;
  CHECK(foreign_list_create(&la) == 0 && foreign_list_create(&lb) == 0,
        "lists");
  usmipc_queue_t *qa = NULL, *qb = NULL;
  CHECK_OK(usmipc_queue_from_native(d, la.list, &qa));
  CHECK_OK(usmipc_queue_from_native(d, lb.list, &qb));
  usmipc_event_t *ev = NULL;
  CHECK_OK(usmipc_event_create(d, 0, &ev));
  CHECK(append_delay(la.list, 1000) == 0, "delay");
  uint64_t t0 = mono_ms();
  CHECK_OK(usmipc_event_record(ev, qa));
  CHECK(usmipc_event_query(ev) == USMIPC_ENOTREADY,
        "a record behind a 1 s command is complete at once");
  CHECK_OK(usmipc_event_record(ev, qb));
  CHECK(mono_ms() - t0 < 500, "recording blocked for %llu ms",
        (unsigned long long)(mono_ms() - t0));
  CHECK(usmipc_event_query(ev) == USMIPC_ENOTREADY,
        "recorded again on an idle list, the event looks complete while its "
        "previous record's work still runs");
  CHECK_OK(usmipc_event_synchronize(ev));
  CHECK(mono_ms() - t0 >= 900,
        "the second record completed %llu ms after the first was made, "
        "before the first one's 1 s command",
        (unsigned long long)(mono_ms() - t0));
  CHECK_OK(usmipc_queue_synchronize(qa));
  CHECK_OK(usmipc_queue_synchronize(qb));
  CHECK_OK(usmipc_event_destroy(ev));
  CHECK_OK(usmipc_queue_destroy(qa));
  CHECK_OK(usmipc_queue_destroy(qb));
  /* The wrappers are gone, the lists not. */
  CHECK(zeCommandListAppendBarrier(la.list, NULL, 0, NULL) == ZE_RESULT_SUCCESS,
        "the foreign list was destroyed with its wrapper");
  foreign_list_destroy(&la);
  foreign_list_destroy(&lb);
  CHECK(own_stat("live_events") == 0 && own_stat("live_event_pools") == 0,
        "%llu events and %llu pools left", own_stat("live_events"),
        own_stat("live_event_pools"));
  return PASS;
}

/* event_ring_full: more ordered handoffs in flight than the ring holds
 * (1,024 events per device): the next handoff waits for the oldest record,
 * as long as the event wait limit allows, and then goes on. The wait must
 * not hold the events' lock: it reads the wait limit (which takes that lock:
 * the process deadlocked with itself) and asks the interrupt hook (which
 * may take a binding's lock). */
static int test_event_ring_full(void) {
  usmipc_device_t *d = gpu();
  CHECK(d != NULL, "no device");
  foreign_list_t fl;
  CHECK(foreign_list_create(&fl) == 0, "list");
  usmipc_queue_t *q = NULL;
  CHECK_OK(usmipc_queue_from_native(d, fl.list, &q));
  void *p = NULL;
  usmipc_ipc_handle_t *h = NULL;
  CHECK_OK(usmipc_malloc(d, USMIPC_MEM_DEVICE, 4096, &p));
  CHECK_OK(usmipc_ipc_get_handle(p, 0, &h));
  CHECK(append_delay(fl.list, 3000) == 0, "delay");
  uint64_t t0 = mono_ms();
  /* Every record waits behind the 3 s command: the ring grows to its
   * 1,024 events, all busy. */
  for (int i = 0; i < 1024; i++)
    CHECK_OK(usmipc_ipc_handle_order(h, q));
  CHECK(mono_ms() - t0 < 2500, "1,024 handoffs took %llu ms",
        (unsigned long long)(mono_ms() - t0));
  /* The next one waits for the oldest, within the event wait limit. */
  CHECK_OK(usmipc_event_set_timeout(200));
  CHECK_ERR(usmipc_ipc_handle_order(h, q), USMIPC_ETIMEDOUT);
  CHECK(mono_ms() - t0 < 2900,
        "the handoff past a full ring timed out after %llu ms, not within "
        "its 200 ms limit",
        (unsigned long long)(mono_ms() - t0));
  /* Without a limit it waits for the oldest record, then goes on. */
  CHECK_OK(usmipc_event_set_timeout(0));
  CHECK_OK(usmipc_ipc_handle_order(h, q));
  CHECK(mono_ms() - t0 >= 2900,
        "the handoff past a full ring went on after %llu ms, before the "
        "oldest record's 3 s command was done",
        (unsigned long long)(mono_ms() - t0));
  CHECK_OK(usmipc_ipc_handle_order(h, q));
  CHECK_OK(usmipc_queue_synchronize(q));
  CHECK_OK(usmipc_ipc_free_handle(h));
  CHECK_OK(usmipc_free(p));
  CHECK_OK(usmipc_queue_destroy(q));
  foreign_list_destroy(&fl);
  return PASS;
}

/* event_refusals: drivers usmipc cannot share events with say so
 * (USMIPC_ENOTSUP with the reason), on either side: an exporter whose
 * event pool handles have a layout no release has, a driver without
 * ZE_IPC_PROPERTY_FLAG_EVENT_POOL, an importer whose driver lays pools out
 * with another packet count or writes an unknown layout. Knobs of the
 * ideal driver, so pinned to it. */
static int test_event_refusals(void) {
  const char *ideal = "USMIPC_ZE_TEST_PROFILE=ideal";
  const char *const exporters[][3] = {
      {ideal, "USMIPC_ZE_TEST_EVENT_LAYOUT=unknown", NULL},
      {ideal, "USMIPC_ZE_TEST_NO_IPC_EVENTS=1", NULL},
  };
  for (size_t i = 0; i < 2; i++) {
    child_t p;
    CHECK(spawn(&p, exporters[i], (const char *const[]){"evagent", NULL}) == 0,
          "spawn");
    ASK_OK(&p, "evcreate 0");
    ASK_OK(&p, "evrecord 0");
    const char *line = ask(&p, "evhandle 0");
    CHECK(!strncmp(line, "error USMIPC_ENOTSUP", 20), "%s: %s", exporters[i][1],
          line);
    fprintf(stderr, "    %s\n", line);
    child_say(&p, "exit");
    CHECK(child_end(&p) == 0, "exporter failed");
  }
  const char *const importers[][3] = {
      {ideal, "USMIPC_ZE_TEST_EVENT_PACKETS=32", NULL},
      {ideal, "USMIPC_ZE_TEST_EVENT_LAYOUT=unknown", NULL},
  };
  const char *const ex_env[] = {ideal, NULL};
  child_t p;
  CHECK(spawn(&p, ex_env, (const char *const[]){"evagent", NULL}) == 0,
        "spawn");
  ASK_OK(&p, "evcreate 0");
  ASK_OK(&p, "evrecord 0");
  char hex[4096];
  snprintf(hex, sizeof(hex), "%s", ask(&p, "evhandle 0"));
  CHECK(!strncmp(hex, "handle ", 7), "%s", hex);
  for (size_t i = 0; i < 2; i++) {
    child_t c;
    CHECK(spawn(&c, importers[i], (const char *const[]){"evagent", NULL}) == 0,
          "spawn");
    const char *line = ask(&c, "evopen 0 %s", hex + 7);
    CHECK(!strncmp(line, "error USMIPC_ENOTSUP", 20), "%s: %s", importers[i][1],
          line);
    fprintf(stderr, "    %s\n", line);
    char st[4096];
    helper_stats(&c, st, sizeof(st));
    CHECK(stat_of(st, "event_pool_opens") == 0 &&
              stat_of(st, "event_pool_open_failures") == 0,
          "%s: the importer's driver was asked to open: %s", importers[i][1],
          st);
    child_say(&c, "exit");
    CHECK(child_end(&c) == 0, "importer failed");
  }
  child_say(&p, "exit");
  CHECK(child_end(&p) == 0, "exporter failed");
  return PASS;
}

/* Producer (ex_env) and consumer (im_env) helpers share an event: a record
 * pending behind a 500 ms command is not complete for the consumer, then
 * is; a second record opens from the consumer's cache. The consumer's
 * driver never took the opaque path. */
static int event_pair(const char *const *ex_env, const char *const *im_env,
                      const char *what) {
  child_t p, c;
  CHECK(spawn(&p, ex_env, (const char *const[]){"evagent", NULL}) == 0 &&
            spawn(&c, im_env, (const char *const[]){"evagent", NULL}) == 0,
        "spawn");
  ASK_OK(&p, "asyncq");
  ASK_OK(&p, "evcreate 0");
  ASK_OK(&p, "delay 500");
  ASK_OK(&p, "evrecord 0");
  char hex[4096];
  snprintf(hex, sizeof(hex), "%s", ask(&p, "evhandle 0"));
  CHECK(!strncmp(hex, "handle ", 7), "%s: %s", what, hex);
  const char *line = ask(&c, "evopen 0 %s", hex + 7);
  CHECK(!strcmp(line, "ok"), "%s: open: %s", what, line);
  line = ask(&c, "evquery 0");
  CHECK(!strncmp(line, "error USMIPC_ENOTREADY", 22),
        "%s: a record pending behind 500 ms: %s", what, line);
  ASK_OK(&c, "evsync 0");
  ASK_OK(&c, "evwait 0");
  ASK_OK(&p, "evrecord 0");
  snprintf(hex, sizeof(hex), "%s", ask(&p, "evhandle 0"));
  line = ask(&c, "evopen 1 %s", hex + 7);
  CHECK(!strcmp(line, "ok"), "%s: second open: %s", what, line);
  ASK_OK(&c, "evsync 1");
  char st[4096];
  helper_stats(&c, st, sizeof(st));
  CHECK(stat_of(st, "event_pool_opens") == 1 &&
            stat_of(st, "event_pool_opaque_opens") == 0 &&
            stat_of(st, "event_pool_cache_hits") == 0,
        "%s: consumer: %s", what, st);
  child_say(&c, "exit");
  child_say(&p, "exit");
  CHECK(child_end(&c) == 0 && child_end(&p) == 0, "%s: a helper failed", what);
  return PASS;
}

/* cr_event_mixed_releases: events shared between processes of different
 * releases (and modes): each side reads and writes only its own driver's
 * event pool handle layout (33, 32 or 40 bytes, the post-26.31 one). */
static int test_cr_event_mixed_releases(void) {
  static const char *const pairs[][2] = {
      {"cr-25.35", "cr-26.31"},   {"cr-26.31", "cr-25.35"},
      {"cr-26.09", "cr-26.18"},   {"cr-26.18", "cr-26.05-opaque"},
      {"cr-sockets", "cr-26.14"}, {"ideal", "cr-26.31"},
      {"cr-26.31", "ideal"},
  };
  for (size_t i = 0; i < sizeof(pairs) / sizeof(pairs[0]); i++) {
    char pe[64], pi[64], what[128];
    snprintf(pe, sizeof(pe), "USMIPC_ZE_TEST_PROFILE=%s", pairs[i][0]);
    snprintf(pi, sizeof(pi), "USMIPC_ZE_TEST_PROFILE=%s", pairs[i][1]);
    snprintf(what, sizeof(what), "%s -> %s", pairs[i][0], pairs[i][1]);
    const char *ex_env[] = CR_ENV_WITH(pe, NULL);
    const char *im_env[] = CR_ENV_WITH(pi, NULL);
    if (event_pair(ex_env, im_env, what) != PASS)
      return FAIL;
  }
  /* The post-26.31 layout (master, unreleased), both ways. */
  const char *post[] = {"USMIPC_ZE_TEST_PROFILE=ideal",
                        "USMIPC_ZE_TEST_EVENT_LAYOUT=post-26.31", NULL};
  const char *c2631[] = CR_ENV("cr-26.31", NULL);
  if (event_pair(post, c2631, "post-26.31 -> cr-26.31") != PASS ||
      event_pair(c2631, post, "cr-26.31 -> post-26.31") != PASS ||
      event_pair(post, post, "post-26.31 -> post-26.31") != PASS)
    return FAIL;
  return PASS;
}

/* cr_event_pool_cache_2618: why the importer cannot hand its driver the
 * exporter's event pool handle. On 26.18-26.31 a handle whose descriptor
 * equals its opaqueHandle takes the opaque path, whose import cache key is
 * 0 for every event pool: the second pool an importer opens from raw bytes
 * is the first one (research of CR@26.18.38308.4:.../event/event.cpp:
 * 771-786). Raw bytes between two processes of the profile: B, signalled,
 * reads as not signalled (it is A), one stale cache hit. The same two
 * events shared by usmipc: both right, no opaque open. */
static int test_cr_event_pool_cache_2618(void) {
  static const char *const profiles[] = {"cr-26.18", "cr-26.31"};
  for (size_t i = 0; i < 2; i++) {
    char pe[64];
    snprintf(pe, sizeof(pe), "USMIPC_ZE_TEST_PROFILE=%s", profiles[i]);
    const char *env[] = CR_ENV_WITH(pe, NULL);
    child_t ex, im;
    CHECK(spawn(&ex, env, (const char *const[]){"evprobe", NULL}) == 0 &&
              spawn(&im, env, (const char *const[]){"evprobe", NULL}) == 0,
          "spawn");
    char a[200], b[200];
    CHECK(!strcmp(ask(&ex, "pool 0"), "pool 0x0") &&
              !strcmp(ask(&ex, "pool 1"), "pool 0x0"),
          "pools");
    snprintf(a, sizeof(a), "%s", ask(&ex, "raw 0"));
    snprintf(b, sizeof(b), "%s", ask(&ex, "raw 1"));
    CHECK(!strncmp(a, "handle ", 7) && !strncmp(b, "handle ", 7), "%s %s", a,
          b);
    CHECK(!strcmp(ask(&ex, "signal 1"), "signal 0x0"), "signal");
    const char *line = ask(&im, "open 0 %s", a + 7);
    CHECK(!strcmp(line, "opened 0x0"), "%s: open A: %s", profiles[i], line);
    line = ask(&im, "open 1 %s", b + 7);
    CHECK(!strcmp(line, "opened 0x0"), "%s: open B: %s", profiles[i], line);
    line = ask(&im, "query 1");
    CHECK(!strcmp(line, "status 0x1"),
          "%s: B (signalled) read through the driver's cache: %s (the driver "
          "model lost CR's cache-key-0 behaviour)",
          profiles[i], line);
    char st[4096];
    helper_stats(&im, st, sizeof(st));
    CHECK(stat_of(st, "event_pool_opaque_opens") == 2 &&
              stat_of(st, "event_pool_cache_hits") == 1 &&
              stat_of(st, "event_pool_stale_hits") == 1,
          "%s: raw importer: %s", profiles[i], st);
    child_say(&ex, "exit");
    child_say(&im, "exit");
    CHECK(child_end(&ex) == 0 && child_end(&im) == 0, "evprobe failed");

    /* usmipc: the same shape, right. */
    child_t p, c;
    CHECK(spawn(&p, env, (const char *const[]){"evagent", NULL}) == 0 &&
              spawn(&c, env, (const char *const[]){"evagent", NULL}) == 0,
          "spawn");
    /* Event 1 recorded on the helper's own (synchronous) queue: complete;
     * event 0 then on its asynchronous list behind a minute's command. */
    ASK_OK(&p, "evcreate 0");
    ASK_OK(&p, "evcreate 1");
    ASK_OK(&p, "evrecord 1");
    ASK_OK(&p, "asyncq");
    ASK_OK(&p, "delay 60000");
    ASK_OK(&p, "evrecord 0");
    char ha[4096], hb[4096];
    snprintf(ha, sizeof(ha), "%s", ask(&p, "evhandle 0"));
    snprintf(hb, sizeof(hb), "%s", ask(&p, "evhandle 1"));
    CHECK(!strncmp(ha, "handle ", 7) && !strncmp(hb, "handle ", 7), "%s %s", ha,
          hb);
    CHECK(!strcmp(ask(&c, "evopen 0 %s", ha + 7), "ok"), "usmipc open A");
    CHECK(!strcmp(ask(&c, "evopen 1 %s", hb + 7), "ok"), "usmipc open B");
    line = ask(&c, "evquery 0");
    CHECK(!strncmp(line, "error USMIPC_ENOTREADY", 22), "%s: usmipc A: %s",
          profiles[i], line);
    line = ask(&c, "evquery 1");
    CHECK(!strcmp(line, "ok"), "%s: usmipc B (recorded, complete): %s",
          profiles[i], line);
    helper_stats(&c, st, sizeof(st));
    CHECK(stat_of(st, "event_pool_opens") == 2 &&
              stat_of(st, "event_pool_opaque_opens") == 0 &&
              stat_of(st, "event_pool_cache_hits") == 0,
          "%s: usmipc importer: %s", profiles[i], st);
    child_say(&c, "exit");
    CHECK(child_end(&c) == 0, "consumer failed");
    kill(p.pid, SIGKILL); /* its list still has most of a minute to run */
    child_end(&p);
  }
  return PASS;
}

/* ---- runner
 * ------------------------------------------------------------------------- */

static const struct {
  const char *name;
  int (*fn)(void);
  bool cr; /* a test of Intel's releases (--cr), else of the backend (--base) */
} tests[] = {
    {"device_listed", test_device_listed, false},
    {"device_info", test_device_info, false},
    {"alloc_copy_fill", test_alloc_copy_fill, false},
    {"foreign_pointer", test_foreign_pointer, false},
    {"export_refusals", test_export_refusals, false},
    {"ipc_socket", test_ipc_socket, false},
    {"ipc_pidfd", test_ipc_pidfd, false},
    {"ipc_layout_only", test_ipc_layout_only, false},
    {"ipc_without_put", test_ipc_without_put, false},
    {"ipc_pidfd_layout", test_ipc_pidfd_layout, false},
    {"ipc_loader_intercept", test_ipc_loader_intercept, false},
    {"exporter_killed", test_exporter_killed, false},
    {"unknown_layout_refused", test_unknown_layout_refused, false},
    {"unavailable", test_unavailable, false},
    {"event_wait_orders", test_event_wait_orders, false},
    {"event_payload_forged", test_event_payload_forged, false},
    {"event_descriptor_refused", test_event_descriptor_refused, false},
    {"event_reopen_cached", test_event_reopen_cached, false},
    {"event_exporter_killed", test_event_exporter_killed, false},
    {"event_rerecord_never_early", test_event_rerecord_never_early, false},
    {"event_refusals", test_event_refusals, false},
    {"event_ring_full", test_event_ring_full, false},
    {"release_consumer_exits", test_release_consumer_exits, false},
    {"release_lone_consumer_exits", test_release_lone_consumer_exits, false},
    {"release_consumer_killed", test_release_consumer_killed, false},
    {"cr_stale_cache_2609", test_cr_stale_cache_2609, true},
    {"cr_pool_free_neighbour", test_cr_pool_free_neighbour, true},
    {"cr_newer_loader_uninitialized", test_cr_newer_loader_uninitialized, true},
    {"cr_handle_fd_devnode", test_cr_handle_fd_devnode, true},
    {"cr_multi_bo_refused", test_cr_multi_bo_refused, true},
    {"cr_mixed_2609_to_2535", test_cr_mixed_2609_to_2535, true},
    {"cr_mixed_2535_to_2618", test_cr_mixed_2535_to_2618, true},
    {"cr_mixed_2618_to_2609", test_cr_mixed_2618_to_2609, true},
    {"cr_mixed_2605o_to_2618", test_cr_mixed_2605o_to_2618, true},
    {"cr_importer_fd_leak", test_cr_importer_fd_leak, true},
    {"cr_driver_profiles", test_cr_driver_profiles, true},
    {"cr_event_mixed_releases", test_cr_event_mixed_releases, true},
    {"cr_event_pool_cache_2618", test_cr_event_pool_cache_2618, true},
};
#define NTESTS (sizeof(tests) / sizeof(tests[0]))

/* Test i, its name given to the behaviour probe's records (and through the
 * environment to its helpers'). */
static int run_test(size_t i) {
  probe_set_test(tests[i].name);
  if (getenv("USMIPC_TEST_PROBE") != NULL)
    setenv("USMIPC_TEST_PROBE_TEST", tests[i].name, 1);
  return tests[i].fn();
}

int main(int argc, char **argv) {
  if (argc > 1 && !strcmp(argv[1], "--helper"))
    return helper_main(argc - 2, argv + 2);
  if (getenv("ZE_ENABLE_ALT_DRIVERS") == NULL) {
    fprintf(stderr, "set ZE_ENABLE_ALT_DRIVERS to the test driver's path\n");
    return 2;
  }
  /* --base / --cr: one group; no argument: both. */
  int group = -1;
  if (argc > 1 && (!strcmp(argv[1], "--base") || !strcmp(argv[1], "--cr"))) {
    group = !strcmp(argv[1], "--cr");
    argc = 1;
  }
  if (argc > 1) {
    for (size_t i = 0; i < NTESTS; i++)
      if (!strcmp(argv[1], tests[i].name))
        return run_test(i);
    fprintf(stderr, "no test named %s\n", argv[1]);
    return 2;
  }
  /* Each test in its own process, forked before this process touches
   * usmipc, so that no state (devices, caches, the broker) is shared. */
  int passed = 0, failed = 0, skipped = 0;
  for (size_t i = 0; i < NTESTS; i++) {
    if (group >= 0 && tests[i].cr != (group == 1))
      continue;
    fflush(stdout);
    pid_t pid = fork();
    if (pid == 0) {
      alarm(TEST_TIMEOUT_S);
      _exit(run_test(i));
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
