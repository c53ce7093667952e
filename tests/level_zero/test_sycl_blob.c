/* usmipc_ipc_open_sycl against blobs laid out exactly as SYCL's (the
 * Unified Memory Framework's umf_ipc_data_t and its Level Zero provider's
 * data, src/umf_blob.c), around real Level Zero IPC handles of the test
 * driver: an exporter process allocates through the loader as a SYCL
 * runtime would, builds the 108- and 120-byte blobs, and this process opens
 * them with usmipc. Run with ZE_ENABLE_ALT_DRIVERS naming the test driver
 * (CTest: level_zero.sycl_blob). */
#include <dlfcn.h>
#include <errno.h>
#include <grp.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <level_zero/ze_api.h>

#include "../c/probe.h" /* the behaviour probe's records */
#include "usmipc.h"
#include "ze_test_driver.h"

static int failures;
#define CHECK(cond, ...)                                                       \
  do {                                                                         \
    if (!(cond)) {                                                             \
      fprintf(stderr, "    %s:%d: %s: ", __FILE__, __LINE__, #cond);           \
      fprintf(stderr, __VA_ARGS__);                                            \
      fputc('\n', stderr);                                                     \
      failures++;                                                              \
      return 1;                                                                \
    }                                                                          \
  } while (0)

#define SIZE (256 * 1024)
#define OFFSET (4096 + 3)

static uint8_t pattern(size_t i) { return (uint8_t)(i * 7 + 11); }

static void put32(uint8_t *p, uint32_t v) { memcpy(p, &v, 4); }
static void put64(uint8_t *p, uint64_t v) { memcpy(p, &v, 8); }

/* The blob SYCL would make for ptr = base + offset (form 108 or 120). */
static size_t make_blob(uint8_t *out, int form, uint64_t handle_id,
                        const void *base, uint64_t size, uint64_t offset,
                        const ze_ipc_mem_handle_t *h) {
  memset(out, 0xee, 120); /* padding is whatever memory held */
  put64(out, handle_id);
  put64(out + 8, (uint64_t)(uintptr_t)base);
  put32(out + 16, (uint32_t)getpid());
  put64(out + 24, size);
  put64(out + 32, offset);
  put32(out + 40, (uint32_t)getpid());
  if (form == 108) {
    memcpy(out + 44, h->data, 64);
    return 108;
  }
  put64(out + 48, size);
  memcpy(out + 56, h->data, 64);
  return 120;
}

/* The exporter: allocates and fills through the loader, writes the blobs
 * (hex, one per line: 120, 108, a host-memory one), then serves "free"
 * (frees the allocation) and "exit" on its stdin. */
static void exporter(int out, int in) {
  ze_driver_handle_t drv;
  ze_device_handle_t dev;
  ze_context_handle_t ctx;
  uint32_t n = 1;
  if (zeInit(ZE_INIT_FLAG_GPU_ONLY) || zeDriverGet(&n, &drv) ||
      (n = 1, zeDeviceGet(drv, &n, &dev)))
    _exit(2);
  ze_context_desc_t cd = {.stype = ZE_STRUCTURE_TYPE_CONTEXT_DESC};
  ze_device_mem_alloc_desc_t dd = {.stype =
                                       ZE_STRUCTURE_TYPE_DEVICE_MEM_ALLOC_DESC};
  void *p = NULL, *neighbour = NULL;
  /* A neighbour first: where the driver pools small allocations (cr-26.09
   * and later profiles), p then sits at a non-zero offset of its pool, as
   * SYCL's memory may (SYCL allocates without an export desc). */
  if (zeContextCreate(drv, &cd, &ctx) ||
      zeMemAllocDevice(ctx, &dd, 65536, 0, dev, &neighbour) ||
      zeMemAllocDevice(ctx, &dd, SIZE, 0, dev, &p))
    _exit(3);
  for (size_t i = 0; i < SIZE; i++) /* the test device's memory is host's */
    ((uint8_t *)p)[i] = pattern(i);
  ze_ipc_mem_handle_t h;
  memset(&h, 0, sizeof(h));
  if (zeMemGetIpcHandle(ctx, p, &h))
    _exit(4);
  FILE *f = fdopen(out, "w");
  uint8_t blob[120];
  for (int k = 0; k < 3; k++) {
    size_t len = make_blob(blob, k == 1 ? 108 : 120, 7 + (uint64_t)k, p, SIZE,
                           OFFSET, &h);
    if (k == 2) /* host memory: the memory-type byte of the layout */
      blob[56 + (h.data[16] == 0 && blob[56 + 16] == 0 ? 16 : 21)] = 1;
    for (size_t i = 0; i < len; i++)
      fprintf(f, "%02x", blob[i]);
    fputc('\n', f);
  }
  fflush(f);
  FILE *g = fdopen(in, "r");
  char line[64];
  while (fgets(line, sizeof(line), g) != NULL) {
    if (!strncmp(line, "free", 4)) {
      zeMemFree(ctx, p);
      fputs("freed\n", f);
      fflush(f);
    } else {
      break;
    }
  }
  _exit(0);
}

static size_t unhex(const char *s, uint8_t *out, size_t cap) {
  size_t n = 0;
  while (n < cap && s[2 * n] && s[2 * n] != '\n') {
    unsigned v;
    sscanf(s + 2 * n, "%2x", &v);
    out[n++] = (uint8_t)v;
  }
  return n;
}

static usmipc_ze_test_stats_t stats(void) {
  usmipc_ze_test_stats_t s;
  memset(&s, 0, sizeof(s));
  void *lib = dlopen(getenv("ZE_ENABLE_ALT_DRIVERS"), RTLD_NOW | RTLD_NOLOAD);
  usmipc_ze_test_get_stats_fn get =
      lib ? (usmipc_ze_test_get_stats_fn)dlsym(lib, USMIPC_ZE_TEST_GET_STATS)
          : NULL;
  if (get)
    get(&s);
  return s;
}

static int expect_error(const uint8_t *b, size_t len, usmipc_device_t *dev,
                        size_t nbytes, int code, const char *words) {
  void *p = NULL;
  int rc = usmipc_ipc_open_sycl(b, len, dev, nbytes, &p, NULL);
  probe_record(__FILE__, __LINE__, words ? words : "usmipc_ipc_open_sycl", rc,
               usmipc_last_error());
  CHECK(rc == code, "got %s (%s), want %s", usmipc_err_name(rc),
        usmipc_last_error(), usmipc_err_name(code));
  CHECK(p == NULL, "a failed open left a pointer");
  CHECK(words == NULL || strstr(usmipc_last_error(), words) != NULL,
        "message lacks \"%s\": %s", words, usmipc_last_error());
  return 0;
}

static int run(const char *layout_env) {
  int to[2], from[2];
  if (pipe(to) || pipe(from))
    return 1;
  fflush(stdout);
  pid_t pid = fork();
  if (pid == 0) {
    if (layout_env)
      putenv((char *)layout_env);
    /* Without zeMemPutIpcHandle the test driver closes the handle's
     * descriptor at zeMemFree, as Intel's does (else it leaks it). */
    putenv((char *)"USMIPC_ZE_TEST_NO_PUT=1");
    close(to[1]);
    close(from[0]);
    exporter(from[1], to[0]);
  }
  close(to[0]);
  close(from[1]);
  FILE *f = fdopen(from[0], "r");
  static char line[3][512];
  uint8_t blob[3][128];
  size_t len[3];
  for (int k = 0; k < 3; k++) {
    CHECK(fgets(line[k], sizeof(line[k]), f) != NULL, "exporter died");
    len[k] = unhex(line[k], blob[k], sizeof(blob[k]));
  }
  /* Under the profiles that pool (cr-26.09 and later), the allocation sits
   * past its neighbour in a pool: the driver's pool offset is not 0. */
  const char *profile = getenv("USMIPC_ZE_TEST_PROFILE");
  uint64_t pool_offset;
  memcpy(&pool_offset, blob[1] + 44 + 8, 8);
  if (profile != NULL &&
      (strstr(profile, "26.09") || strstr(profile, "26.14") ||
       strstr(profile, "26.18") || strstr(profile, "26.31") ||
       strstr(profile, "sockets")))
    CHECK(pool_offset != 0, "the allocation is not pooled under %s", profile);
  usmipc_device_t *dev;
  CHECK(usmipc_device_select("level_zero:gpu:0", &dev) == 0, "%s",
        usmipc_last_error());
  usmipc_ze_test_stats_t s0 = stats();
  /* Both forms, from the exported pointer to the end of the allocation. */
  void *p[2] = {NULL, NULL};
  for (int k = 0; k < 2; k++) {
    size_t mapped = 0;
    int rc = usmipc_ipc_open_sycl(blob[k], len[k], k ? NULL : dev, 0, &p[k],
                                  &mapped);
    CHECK(rc == 0, "open of the %zu-byte blob: %s", len[k],
          usmipc_last_error());
    CHECK(mapped == SIZE - OFFSET, "mapped %zu", mapped);
    for (size_t i = 0; i < mapped; i += 997)
      CHECK(((uint8_t *)p[k])[i] == pattern(OFFSET + i),
            "byte %zu of the %zu-byte blob's mapping", i, len[k]);
    CHECK(((uint8_t *)p[k])[mapped - 1] == pattern(SIZE - 1), "last byte");
  }
  /* Writes reach the exporter's memory: the other mapping sees them. */
  ((uint8_t *)p[0])[5] = 0xa5;
  CHECK(((uint8_t *)p[1])[5] == 0xa5, "the two mappings are not one memory");
  usmipc_ze_test_stats_t s1 = stats();
  CHECK(s1.live_mappings == s0.live_mappings + 2, "live mappings %llu",
        (unsigned long long)s1.live_mappings);
  CHECK(usmipc_ipc_close(p[0]) == 0 && usmipc_ipc_close(p[1]) == 0, "%s",
        usmipc_last_error());
  int twice = usmipc_ipc_close(p[0]);
  PROBE_ERR("usmipc_ipc_close(p[0]) (closed twice)", twice);
  CHECK(twice == USMIPC_ENOTMAPPED, "closed twice");
  CHECK(stats().live_mappings == s0.live_mappings, "a mapping outlived close");

  /* What is refused, and how. */
  uint8_t bad[128];
  if (expect_error(blob[0], 107, dev, 0, USMIPC_EBADHANDLE, "108"))
    return 1;
  memcpy(bad, blob[0], 120);
  put32(bad + 40, (uint32_t)pid + 1);
  if (expect_error(bad, 120, dev, 0, USMIPC_EBADHANDLE, "pids disagree"))
    return 1;
  memcpy(bad, blob[0], 120);
  put64(bad + 32, SIZE);
  if (expect_error(bad, 120, dev, 0, USMIPC_EBADHANDLE, "offset"))
    return 1;
  if (expect_error(blob[2], len[2], dev, 0, USMIPC_EMEMKIND, "host memory"))
    return 1;
  if (expect_error(blob[0], len[0], dev, SIZE - OFFSET + 1, USMIPC_ERANGE,
                   NULL))
    return 1;
  usmipc_device_t *host;
  CHECK(usmipc_device_select("host:cpu", &host) == 0, "host");
  if (expect_error(blob[0], len[0], host, 0, USMIPC_EWRONGDEVICE, "level_zero"))
    return 1;
  /* A usmipc handle is not a SYCL blob. */
  void *mine;
  usmipc_ipc_handle_t *h;
  const void *hd;
  size_t hl;
  CHECK(usmipc_malloc(dev, USMIPC_MEM_DEVICE, 4096, &mine) == 0 &&
            usmipc_ipc_get_handle(mine, 0, &h) == 0 &&
            usmipc_ipc_handle_data(h, &hd, &hl) == 0,
        "%s", usmipc_last_error());
  if (expect_error(hd, hl, dev, 0, USMIPC_EBADHANDLE, "usmipc_ipc_open"))
    return 1;
  usmipc_ipc_free_handle(h);
  usmipc_free(mine);
  /* Freed by the exporter: its descriptor is gone. */
  if (write(to[1], "free\n", 5) != 5)
    return 1;
  char ack[64];
  CHECK(fgets(ack, sizeof(ack), f) != NULL && !strncmp(ack, "freed", 5),
        "exporter did not free");
  if (expect_error(blob[0], len[0], dev, 0, USMIPC_EEXPORTERGONE, "freed"))
    return 1;
  close(to[1]);
  fclose(f);
  int status;
  waitpid(pid, &status, 0);
  CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0, "exporter status %d",
        status);
  /* The exporter is gone: no such process. */
  if (expect_error(blob[0], len[0], dev, 0, USMIPC_EEXPORTERGONE, NULL))
    return 1;
  return 0;
}

/* ---- the uid rule ----------------------------------------------------------
 * A blob names its exporter by pid only. A root importer must not map the
 * memory of another user's process (that user could truncate it under
 * root: SIGBUS), and an importer given a blob of another user's live
 * process is told so (the uid rule), not that no process is there. */

static int drop_to(uid_t uid) {
  return setgroups(0, NULL) == 0 && setgid(uid) == 0 && setuid(uid) == 0 ? 0
                                                                         : -1;
}

/* An exporter (this program, --export) running as uid; its first blob (the
 * 120-byte one) into blob. Returns its pid; *to is its stdin. */
static pid_t spawn_exporter(uid_t uid, uint8_t *blob, size_t *len, int *to,
                            FILE **from) {
  int in[2], out[2];
  if (pipe(in) || pipe(out))
    return -1;
  fflush(stdout);
  pid_t pid = fork();
  if (pid == 0) {
    dup2(in[0], 0);
    dup2(out[1], 1);
    close(in[1]);
    close(out[0]);
    putenv((char *)"USMIPC_ZE_TEST_NO_PUT=1");
    if (uid != 0 && drop_to(uid) != 0)
      _exit(9);
    execl("/proc/self/exe", "test_sycl_blob", "--export", (char *)NULL);
    _exit(10);
  }
  close(in[0]);
  close(out[1]);
  *to = in[1];
  *from = fdopen(out[0], "r");
  char line[512];
  if (*from == NULL || fgets(line, sizeof(line), *from) == NULL)
    return -1;
  *len = unhex(line, blob, 128);
  return pid;
}

static int other_uid(void) {
  const uid_t nobody = 65534;
  uint8_t blob[128];
  size_t len = 0;
  int to;
  FILE *from;
  pid_t ex = spawn_exporter(nobody, blob, &len, &to, &from);
  CHECK(ex > 0, "the exporter of uid %u failed", (unsigned)nobody);
  /* Root opens the blob of uid 65534's process: refused. */
  void *p = NULL;
  int rc = usmipc_ipc_open_sycl(blob, len, NULL, 0, &p, NULL);
  PROBE_ERR("usmipc_ipc_open_sycl (a blob of uid 65534's)", rc);
  printf("root opening a blob of uid %u: %s\n", (unsigned)nobody,
         rc ? usmipc_last_error() : "opened");
  if (rc == 0)
    usmipc_ipc_close(p);
  close(to);
  fclose(from);
  waitpid(ex, NULL, 0);
  CHECK(rc == USMIPC_EACCES, "got %s (%s), want USMIPC_EACCES",
        usmipc_err_name(rc), rc ? usmipc_last_error() : "opened");
  CHECK(strstr(usmipc_last_error(), "uid 65534") != NULL &&
            strstr(usmipc_last_error(), "same user") != NULL,
        "the message does not name the uid rule: %s", usmipc_last_error());

  /* uid 65534 opens a blob of root's live process: EACCES, not "no process
   * here" (its /proc/<pid>/ns/pid is unreadable across uids). */
  ex = spawn_exporter(0, blob, &len, &to, &from);
  CHECK(ex > 0, "the exporter of uid 0 failed");
  int report[2];
  CHECK(pipe(report) == 0, "pipe");
  fflush(stdout);
  pid_t im = fork();
  if (im == 0) {
    close(report[0]);
    if (drop_to(nobody) != 0)
      _exit(9);
    void *q = NULL;
    int r = usmipc_ipc_open_sycl(blob, len, NULL, 0, &q, NULL);
    PROBE_ERR("usmipc_ipc_open_sycl as uid 65534 (a blob of root's)", r);
    dprintf(report[1], "%d %s", r, r ? usmipc_last_error() : "opened");
    _exit(0);
  }
  close(report[1]);
  static char got[1024];
  ssize_t n = read(report[0], got, sizeof(got) - 1);
  got[n > 0 ? n : 0] = '\0';
  close(report[0]);
  waitpid(im, NULL, 0);
  close(to);
  fclose(from);
  waitpid(ex, NULL, 0);
  printf("uid %u opening a blob of root's live process: %s\n", (unsigned)nobody,
         got);
  CHECK(atoi(got) == USMIPC_EACCES && strstr(got, "uid 0") != NULL &&
            strstr(got, "no process") == NULL,
        "want USMIPC_EACCES naming uid 0, got: %s", got);
  return 0;
}

int main(int argc, char **argv) {
  probe_set_test("sycl_blob");
  /* --export: be the exporter on stdin and stdout (tests/python drives it:
   * three blobs in hex, 120-byte, 108-byte, host memory; then "free"). */
  if (argc == 2 && strcmp(argv[1], "--export") == 0)
    exporter(1, 0);
  if (getenv("ZE_ENABLE_ALT_DRIVERS") == NULL) {
    printf("skipped: ZE_ENABLE_ALT_DRIVERS does not name the test driver\n");
    return 77;
  }
  static const char *const layouts[] = {NULL, "USMIPC_ZE_TEST_PIDFD_HANDLE=1"};
  for (int i = 0; i < 2; i++) {
    int r = run(layouts[i]);
    printf("%s sycl_blob %s\n", r ? "FAIL" : "ok",
           layouts[i] ? layouts[i] : "(legacy layout)");
  }
  if (geteuid() == 0) {
    int r = other_uid();
    printf("%s sycl_blob other uids\n", r ? "FAIL" : "ok");
  } else {
    printf("skipped: sycl_blob other uids (needs root, to play another "
           "user)\n");
  }
  return failures ? 1 : 0;
}
