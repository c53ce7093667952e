/* A probe of the CUDA driver, not of usmipc: what cuIpcOpenMemHandle and
 * cuIpcCloseMemHandle do when threads of one process open and close the same
 * legacy handle at once, with no lock of ours around them.
 *
 * usmipc serialises its legacy opens and closes (native_ipc_lock in
 * src/backend/cuda.c) since a rare SIGSEGV in ipc_no_leak_uncached, whose
 * stack was never caught. This probe asks the driver directly, so that the
 * lock rests on an observation: run it unlocked and locked, several times,
 * and compare the exit statuses (139 = SIGSEGV) and the result codes.
 *
 *   probe_native_open_close [unlocked|locked] [THREADS] [ITERS] [distinct]
 *
 * With "distinct" each thread opens and closes a handle of its own (one
 * allocation each) instead of all sharing one: the wall time, locked against
 * unlocked, is what the lock costs concurrent first opens of different
 * handles (if the driver serialises them anyway, nothing).
 *
 * It also prints, once, what a second open of a handle already open in this
 * process returns (docs/cuda.md relies on CUDA_ERROR_ALREADY_MAPPED). Built
 * with the backend's declarations of cuda.h (src/backend/cuda_driver.h). */
#include <dlfcn.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "backend/cuda_driver.h"

#define SYMBOLS(X)                                                             \
  X(cuInit, "cuInit", (unsigned))                                              \
  X(cuDeviceGet, "cuDeviceGet", (CUdevice *, int))                             \
  X(cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain",                      \
    (CUcontext *, CUdevice))                                                   \
  X(cuCtxSetCurrent, "cuCtxSetCurrent", (CUcontext))                           \
  X(cuMemAlloc, "cuMemAlloc_v2", (CUdeviceptr *, size_t))                      \
  X(cuIpcGetMemHandle, "cuIpcGetMemHandle", (CUipcMemHandle *, CUdeviceptr))   \
  X(cuIpcOpenMemHandle, "cuIpcOpenMemHandle_v2",                               \
    (CUdeviceptr *, CUipcMemHandle, unsigned))                                 \
  X(cuIpcCloseMemHandle, "cuIpcCloseMemHandle", (CUdeviceptr))                 \
  X(cuGetErrorName, "cuGetErrorName", (CUresult, const char **))

static struct {
#define X(field, symbol, args) CUresult(*field) args;
  SYMBOLS(X)
#undef X
} cu;

static void load(void) {
  void *lib = dlopen("libcuda.so.1", RTLD_NOW);
  if (lib == NULL) {
    fprintf(stderr, "probe: no CUDA driver: %s\n", dlerror());
    exit(77);
  }
#define X(field, symbol, args)                                                 \
  *(void **)&cu.field = dlsym(lib, symbol);                                    \
  if (cu.field == NULL) {                                                      \
    fprintf(stderr, "probe: no %s in the driver\n", symbol);                   \
    exit(77);                                                                  \
  }
  SYMBOLS(X)
#undef X
}

static const char *name(CUresult rc) {
  const char *s = "?";
  cu.cuGetErrorName(rc, &s);
  return s;
}

static CUcontext context(void) {
  CUdevice dev;
  CUcontext ctx;
  CUresult rc;
  if ((rc = cu.cuInit(0)) != CUDA_SUCCESS ||
      (rc = cu.cuDeviceGet(&dev, 0)) != CUDA_SUCCESS ||
      (rc = cu.cuDevicePrimaryCtxRetain(&ctx, dev)) != CUDA_SUCCESS ||
      (rc = cu.cuCtxSetCurrent(ctx)) != CUDA_SUCCESS) {
    fprintf(stderr, "probe: context: %s\n", name(rc));
    exit(1);
  }
  return ctx;
}

/* ---- the importer's threads ---- */

enum { MAX_CODES = 1024 };
static CUipcMemHandle handles[256];
static int distinct;
static CUcontext ctx;
static int locked, iters;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static atomic_long open_codes[MAX_CODES], close_codes[MAX_CODES];
static atomic_long other_codes; /* codes >= MAX_CODES */

static void count(atomic_long *codes, CUresult rc) {
  if (rc >= 0 && rc < MAX_CODES)
    atomic_fetch_add(&codes[rc], 1);
  else
    atomic_fetch_add(&other_codes, 1);
}

static void *worker(void *arg) {
  CUipcMemHandle handle = handles[distinct ? (int)(intptr_t)arg : 0];
  cu.cuCtxSetCurrent(ctx);
  for (int i = 0; i < iters; i++) {
    CUdeviceptr p = 0;
    if (locked)
      pthread_mutex_lock(&lock);
    CUresult rc =
        cu.cuIpcOpenMemHandle(&p, handle, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS);
    if (locked)
      pthread_mutex_unlock(&lock);
    count(open_codes, rc);
    if (rc != CUDA_SUCCESS)
      continue;
    if (locked)
      pthread_mutex_lock(&lock);
    count(close_codes, cu.cuIpcCloseMemHandle(p));
    if (locked)
      pthread_mutex_unlock(&lock);
  }
  return NULL;
}

static void print_codes(const char *what, atomic_long *codes) {
  printf("  %s:", what);
  for (int c = 0; c < MAX_CODES; c++)
    if (atomic_load(&codes[c]) != 0)
      printf(" %s=%ld", name((CUresult)c), atomic_load(&codes[c]));
  printf("\n");
}

int main(int argc, char **argv) {
  locked = argc > 1 && strcmp(argv[1], "locked") == 0;
  int threads = argc > 2 ? atoi(argv[2]) : 8;
  iters = argc > 3 ? atoi(argv[3]) : 2000;
  distinct = argc > 4 && strcmp(argv[4], "distinct") == 0;
  if (threads < 1 || threads > 256 || iters < 1) {
    fprintf(stderr, "usage: probe_native_open_close [unlocked|locked] "
                    "[THREADS 1-256] [ITERS] [distinct]\n");
    return 2;
  }
  /* The exporter: a child (forked before the parent loads the driver) that
   * allocates, sends the handle and lives until the parent hangs up. */
  int up[2], down[2];
  if (pipe(up) != 0 || pipe(down) != 0)
    return 1;
  pid_t pid = fork();
  if (pid == 0) {
    close(up[0]);
    close(down[1]);
    load();
    context();
    for (int i = 0; i < threads; i++) {
      CUdeviceptr d;
      CUipcMemHandle h;
      CUresult rc;
      if ((rc = cu.cuMemAlloc(&d, 1 << 20)) != CUDA_SUCCESS ||
          (rc = cu.cuIpcGetMemHandle(&h, d)) != CUDA_SUCCESS) {
        fprintf(stderr, "probe exporter: %s\n", name(rc));
        _exit(1);
      }
      if (write(up[1], &h, sizeof(h)) != (ssize_t)sizeof(h))
        _exit(1);
    }
    char c;
    while (read(down[0], &c, 1) > 0) {
    }
    _exit(0);
  }
  close(up[1]);
  close(down[0]);
  /* The exporter writes a handle at a time: read each until it has come. */
  size_t want = sizeof(handles[0]) * (size_t)threads, got = 0;
  for (int i = 0; i < threads; i++) {
    size_t have = 0;
    ssize_t n = 1;
    while (have < sizeof(handles[i]) && n > 0)
      if ((n = read(up[0], handles[i].reserved + have,
                    sizeof(handles[i]) - have)) > 0)
        have += (size_t)n;
    got += have;
    if (have < sizeof(handles[i]))
      break;
  }
  if (got != want) {
    int status = 0;
    waitpid(pid, &status, 0);
    fprintf(stderr,
            "probe: the exporter sent %zu of %zu handle bytes and ended "
            "with %s %d\n",
            got, want, WIFSIGNALED(status) ? "signal" : "exit status",
            WIFSIGNALED(status) ? WTERMSIG(status) : WEXITSTATUS(status));
    return 1;
  }
  load();
  ctx = context();

  /* Once: a second open of a handle this process has open. */
  CUdeviceptr a = 0, b = 0;
  CUresult r1 =
      cu.cuIpcOpenMemHandle(&a, handles[0], CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS);
  CUresult r2 =
      cu.cuIpcOpenMemHandle(&b, handles[0], CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS);
  printf("second open of an open handle: first %s, second %s%s\n", name(r1),
         name(r2),
         r2 == CUDA_SUCCESS ? (a == b ? " (same address)" : " (new address)")
                            : "");
  if (r2 == CUDA_SUCCESS)
    printf("  close of the second: %s\n", name(cu.cuIpcCloseMemHandle(b)));
  if (r1 == CUDA_SUCCESS)
    printf("  close of the first: %s\n", name(cu.cuIpcCloseMemHandle(a)));
  if (r1 == CUDA_SUCCESS)
    printf("  close once more: %s\n", name(cu.cuIpcCloseMemHandle(a)));

  pthread_t t[256];
  struct timespec t0, t1;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  for (int i = 0; i < threads; i++)
    pthread_create(&t[i], NULL, worker, (void *)(intptr_t)i);
  for (int i = 0; i < threads; i++)
    pthread_join(t[i], NULL);
  clock_gettime(CLOCK_MONOTONIC, &t1);
  double us = (double)(t1.tv_sec - t0.tv_sec) * 1e6 +
              (double)(t1.tv_nsec - t0.tv_nsec) / 1e3;
  printf("%s, %d threads x %d open/close of %s: %.0f ms, %.2f us per "
         "open+close\n",
         locked ? "locked" : "unlocked", threads, iters,
         distinct ? "a handle each" : "one handle", us / 1e3,
         us / ((double)threads * iters));
  print_codes("open", open_codes);
  print_codes("close", close_codes);
  if (atomic_load(&other_codes))
    printf("  codes out of range: %ld\n", atomic_load(&other_codes));
  close(down[1]);
  waitpid(pid, NULL, 0);
  return 0;
}
