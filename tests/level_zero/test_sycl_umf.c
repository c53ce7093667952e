/* usmipc_ipc_open_sycl on blobs that the Unified Memory Framework itself
 * makes: UMF 1.2.0 from PyPI (the library SYCL and dpctl export IPC handles
 * through), its Level Zero provider over the test driver, in an exporter
 * process; this process opens the blob with usmipc and both sides check the
 * other's writes. libumf is loaded with dlopen from USMIPC_UMF_LIB (CTest
 * points it at .venv/lib, where `pip install umf tcmlib` puts it); without
 * it the test is skipped. */
#include <dlfcn.h>
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

/* The few UMF entry points used, as UMF 1.2.0 headers declare them. */
typedef int umf_result_t;
typedef void *umf_handle_t;
#define UMF_MEMORY_TYPE_DEVICE 2
#define UMF_POOL_CREATE_FLAG_OWN_PROVIDER 1
static struct {
  umf_result_t (*params_create)(umf_handle_t *);
  umf_result_t (*params_set_context)(umf_handle_t, ze_context_handle_t);
  umf_result_t (*params_set_device)(umf_handle_t, ze_device_handle_t);
  umf_result_t (*params_set_memory_type)(umf_handle_t, int);
  const void *(*l0_ops)(void);
  const void *(*proxy_ops)(void);
  umf_result_t (*provider_create)(const void *, const void *, umf_handle_t *);
  umf_result_t (*pool_create)(const void *, umf_handle_t, const void *,
                              unsigned, umf_handle_t *);
  void *(*pool_malloc)(umf_handle_t, size_t);
  umf_result_t (*free)(void *);
  umf_result_t (*get_ipc_handle)(const void *, void **, size_t *);
  umf_result_t (*put_ipc_handle)(void *);
} umf;

static int load_umf(const char *path) {
  void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (lib == NULL)
    return -1;
#define SYM(field, name)                                                       \
  if ((*(void **)&umf.field = dlsym(lib, name)) == NULL)                       \
    return -1;
  SYM(params_create, "umfLevelZeroMemoryProviderParamsCreate")
  SYM(params_set_context, "umfLevelZeroMemoryProviderParamsSetContext")
  SYM(params_set_device, "umfLevelZeroMemoryProviderParamsSetDevice")
  SYM(params_set_memory_type, "umfLevelZeroMemoryProviderParamsSetMemoryType")
  SYM(l0_ops, "umfLevelZeroMemoryProviderOps")
  SYM(proxy_ops, "umfProxyPoolOps")
  SYM(provider_create, "umfMemoryProviderCreate")
  SYM(pool_create, "umfPoolCreate")
  SYM(pool_malloc, "umfPoolMalloc")
  SYM(free, "umfFree")
  SYM(get_ipc_handle, "umfGetIPCHandle")
  SYM(put_ipc_handle, "umfPutIPCHandle")
#undef SYM
  return 0;
}

#define SIZE 65536
#define OFFSET 64
#define FAIL(...)                                                              \
  do {                                                                         \
    fprintf(stderr, "    " __VA_ARGS__);                                       \
    fputc('\n', stderr);                                                       \
    return 1;                                                                  \
  } while (0)

static uint8_t pattern(size_t i) { return (uint8_t)(i * 13 + 5); }

/* The exporter: a UMF pool over the Level Zero provider, one allocation,
 * its IPC blob for ptr + OFFSET down the pipe; then it checks the byte the
 * importer wrote and answers. */
static void exporter(int out, int in) {
  ze_driver_handle_t drv;
  ze_device_handle_t dev;
  ze_context_handle_t ctx;
  uint32_t n = 1;
  ze_context_desc_t cd = {.stype = ZE_STRUCTURE_TYPE_CONTEXT_DESC};
  umf_handle_t params, provider, pool;
  if (zeInit(ZE_INIT_FLAG_GPU_ONLY) || zeDriverGet(&n, &drv) ||
      (n = 1, zeDeviceGet(drv, &n, &dev)) || zeContextCreate(drv, &cd, &ctx))
    _exit(2);
  if (umf.params_create(&params) || umf.params_set_context(params, ctx) ||
      umf.params_set_device(params, dev) ||
      umf.params_set_memory_type(params, UMF_MEMORY_TYPE_DEVICE) ||
      umf.provider_create(umf.l0_ops(), params, &provider) ||
      umf.pool_create(umf.proxy_ops(), provider, NULL,
                      UMF_POOL_CREATE_FLAG_OWN_PROVIDER, &pool))
    _exit(3);
  uint8_t *p = umf.pool_malloc(pool, SIZE);
  if (p == NULL)
    _exit(4);
  for (size_t i = 0; i < SIZE; i++) /* the test device's memory is host's */
    p[i] = pattern(i);
  void *blob;
  size_t len = 0;
  if (umf.get_ipc_handle(p + OFFSET, &blob, &len))
    _exit(5);
  if (write(out, &len, sizeof(len)) != sizeof(len) ||
      write(out, blob, len) != (ssize_t)len)
    _exit(6);
  char c;
  if (read(in, &c, 1) != 1)
    _exit(7);
  char verdict = p[OFFSET + 1] == 0x5a ? 'y' : 'n';
  if (write(out, &verdict, 1) != 1)
    _exit(8);
  umf.put_ipc_handle(blob);
  umf.free(p);
  _exit(0);
}

/* exporter_uid: the exporter's (0, or another user's: root's open must then
 * be refused by the uid rule, before the descriptor is taken). */
static int run(const char *layout_env, uid_t exporter_uid) {
  int to[2], from[2];
  if (pipe(to) || pipe(from))
    FAIL("pipe");
  fflush(stdout);
  pid_t pid = fork();
  if (pid == 0) {
    if (layout_env)
      putenv((char *)layout_env);
    if (exporter_uid != 0 &&
        (setgroups(0, NULL) != 0 || setgid(exporter_uid) != 0 ||
         setuid(exporter_uid) != 0))
      _exit(9);
    exporter(from[1], to[0]);
  }
  close(from[1]);
  close(to[0]);
  size_t len = 0;
  uint8_t blob[256];
  if (read(from[0], &len, sizeof(len)) != sizeof(len) || len > sizeof(blob) ||
      read(from[0], blob, len) != (ssize_t)len)
    FAIL("the UMF exporter failed (see its exit status)");
  printf("UMF 1.2.0 blob: %zu bytes\n", len);
  void *p = NULL;
  size_t mapped = 0;
  int rc = usmipc_ipc_open_sycl(blob, len, NULL, 0, &p, &mapped);
  PROBE_ERR("usmipc_ipc_open_sycl (a UMF blob of another uid)", rc);
  if (exporter_uid != 0) {
    printf("root opening the UMF blob of uid %u: %s\n", (unsigned)exporter_uid,
           rc ? usmipc_last_error() : "opened");
    if (rc == 0)
      usmipc_ipc_close(p);
    kill(pid, SIGKILL); /* it waits for a write that will not come */
    waitpid(pid, NULL, 0);
    close(to[1]);
    close(from[0]);
    if (rc != USMIPC_EACCES || !strstr(usmipc_last_error(), "same user"))
      FAIL("want USMIPC_EACCES naming the uid rule, got %s: %s",
           usmipc_err_name(rc), rc ? usmipc_last_error() : "opened");
    return 0;
  }
  if (rc != 0)
    FAIL("usmipc_ipc_open_sycl: %s: %s", usmipc_err_name(rc),
         usmipc_last_error());
  if (mapped != SIZE - OFFSET)
    FAIL("mapped %zu, want %d", mapped, SIZE - OFFSET);
  for (size_t i = 0; i < mapped; i++)
    if (((uint8_t *)p)[i] != pattern(OFFSET + i))
      FAIL("byte %zu of the mapping differs", i);
  ((uint8_t *)p)[1] = 0x5a;
  char verdict = 0;
  if (write(to[1], "c", 1) != 1 || read(from[0], &verdict, 1) != 1 ||
      verdict != 'y')
    FAIL("the exporter did not see the importer's write");
  if (usmipc_ipc_close(p) != 0)
    FAIL("close: %s", usmipc_last_error());
  int status = 0;
  waitpid(pid, &status, 0);
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0)
    FAIL("exporter status %d", status);
  close(to[1]);
  close(from[0]);
  return 0;
}

int main(void) {
  probe_set_test("sycl_umf");
  const char *path = getenv("USMIPC_UMF_LIB");
  if (getenv("ZE_ENABLE_ALT_DRIVERS") == NULL || path == NULL ||
      access(path, R_OK) != 0) {
    printf("skipped: no libumf (pip install umf==1.2.0 tcmlib into .venv; "
           "USMIPC_UMF_LIB=%s)\n",
           path ? path : "unset");
    return 77;
  }
  if (load_umf(path) != 0) {
    printf("skipped: %s is not a UMF with the Level Zero provider: %s\n", path,
           dlerror());
    return 77;
  }
  static const char *const layouts[] = {NULL, "USMIPC_ZE_TEST_PIDFD_HANDLE=1"};
  int failed = 0;
  for (int i = 0; i < 2; i++) {
    int r = run(layouts[i], 0);
    printf("%s sycl_umf %s\n", r ? "FAIL" : "ok",
           layouts[i] ? layouts[i] : "(legacy layout)");
    failed |= r;
  }
  if (geteuid() == 0) {
    int r = run(NULL, 65534);
    printf("%s sycl_umf another uid's exporter\n", r ? "FAIL" : "ok");
    failed |= r;
  } else {
    printf("skipped: sycl_umf another uid's exporter (needs root)\n");
  }
  return failed;
}
