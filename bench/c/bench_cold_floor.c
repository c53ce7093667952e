/* The CUDA driver's own cold handoff: the floor of issue 23's cold target.
 *
 * A cold weight handoff exports every allocation that holds the state dict
 * and imports (and, for fd memory, maps) each in the consumer; nothing can
 * do it for less than the driver's calls themselves. This program makes
 * fresh allocations of the sizes it is given and times, per round, in an
 * exporter and an importer process and with nothing of usmipc in between:
 *
 *  - native (PyTorch's default caching allocator: cudaMalloc'd segments):
 *    export = cuIpcGetMemHandle per allocation (cuMemAlloc_v2, untimed);
 *    import = cuIpcOpenMemHandle_v2(LAZY_ENABLE_PEER_ACCESS) per handle.
 *  - fd (expandable segments, usmipc's pool: cuMemCreate'd handles, mapped
 *    in the exporter as their allocators map them, untimed): export =
 *    cuMemExportToShareableHandle(POSIX_FILE_DESCRIPTOR) per allocation;
 *    the descriptor moves by pidfd_getfd (timed apart: "transfer", not a
 *    driver call); import = cuMemImportFromShareableHandle +
 *    cuMemAddressReserve + cuMemMap + cuMemSetAccess + cuMemRelease.
 *
 * floor = export + import (the driver's calls), medians over rounds; the
 * allocations are new every round (freed and closed between rounds, both
 * untimed). bench/bench_weights.py runs it with the sizes of each usmipc
 * method's cold handoff and prints its cold target (floor + 2 ms) beside
 * the measured cold handoff.
 *
 *   usmipc_bench_cold_floor --kind native|fd --sizes SIZExCOUNT[,...]
 *                           [--rounds 5] [--device 0] [--json FILE|-]
 *
 * Exit status 77 where there is no CUDA driver or device (nothing timed).
 * The driver comes through dlopen with the backend's declarations of
 * cuda.h (src/backend/cuda_driver.h): no CUDA toolkit is needed to build. */
#include <dlfcn.h>
#include <errno.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include "backend/cuda_driver.h"
#include "harness.h"

#define COLD_SYMBOLS(X)                                                        \
  X(cuInit, "cuInit", (unsigned))                                              \
  X(cuDeviceGet, "cuDeviceGet", (CUdevice *, int))                             \
  X(cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain",                      \
    (CUcontext *, CUdevice))                                                   \
  X(cuCtxSetCurrent, "cuCtxSetCurrent", (CUcontext))                           \
  X(cuMemAlloc, "cuMemAlloc_v2", (CUdeviceptr *, size_t))                      \
  X(cuMemFree, "cuMemFree_v2", (CUdeviceptr))                                  \
  X(cuIpcGetMemHandle, "cuIpcGetMemHandle", (CUipcMemHandle *, CUdeviceptr))   \
  X(cuIpcOpenMemHandle, "cuIpcOpenMemHandle_v2",                               \
    (CUdeviceptr *, CUipcMemHandle, unsigned))                                 \
  X(cuIpcCloseMemHandle, "cuIpcCloseMemHandle", (CUdeviceptr))                 \
  X(cuMemCreate, "cuMemCreate",                                                \
    (CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *,      \
     unsigned long long))                                                      \
  X(cuMemExportToShareableHandle, "cuMemExportToShareableHandle",              \
    (void *, CUmemGenericAllocationHandle, int, unsigned long long))           \
  X(cuMemImportFromShareableHandle, "cuMemImportFromShareableHandle",          \
    (CUmemGenericAllocationHandle *, void *, int))                             \
  X(cuMemAddressReserve, "cuMemAddressReserve",                                \
    (CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long))          \
  X(cuMemAddressFree, "cuMemAddressFree", (CUdeviceptr, size_t))               \
  X(cuMemMap, "cuMemMap",                                                      \
    (CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle,                \
     unsigned long long))                                                      \
  X(cuMemUnmap, "cuMemUnmap", (CUdeviceptr, size_t))                           \
  X(cuMemRelease, "cuMemRelease", (CUmemGenericAllocationHandle))              \
  X(cuMemSetAccess, "cuMemSetAccess",                                          \
    (CUdeviceptr, size_t, const CUmemAccessDesc *, size_t))                    \
  X(cuMemGetAllocationGranularity, "cuMemGetAllocationGranularity",            \
    (size_t *, const CUmemAllocationProp *, int))

static struct {
#define X(field, symbol, args) CUresult(*field) args;
  COLD_SYMBOLS(X)
#undef X
  CUresult (*cuGetErrorName)(CUresult, const char **); /* optional */
} cu;

enum { KIND_NATIVE = 1, KIND_FD = 2, SKIP = 77 };

/* One allocation of a round: the exporter's side and the importer's. */
typedef struct alloc {
  size_t size; /* as asked; fd: rounded up to the granularity */
  CUdeviceptr p;
  CUmemGenericAllocationHandle h; /* fd: the exporter's handle */
  int fd;                         /* fd: the exported descriptor */
  CUipcMemHandle ipc;             /* native: the exported handle */
} alloc_t;

/* What the exporter writes to the importer per allocation. */
typedef struct wire {
  uint64_t size;
  int32_t fd;
  char ipc[64];
} wire_t;

static int kind = KIND_NATIVE;
static CUdevice dev;
static size_t granularity = 2u << 20;

static const char *cu_name(CUresult res) {
  const char *name = NULL;
  if (cu.cuGetErrorName == NULL || cu.cuGetErrorName(res, &name) != 0 ||
      name == NULL)
    return "?";
  return name;
}

static void check(CUresult res, const char *what) {
  if (res != CUDA_SUCCESS) {
    fprintf(stderr, "%s: %s failed: %s (CUDA error %d)\n", bench_name, what,
            cu_name(res), res);
    exit(res == CUDA_ERROR_NO_DEVICE ? SKIP : 1);
  }
}

/* The driver's symbols: loaded before the fork (dlopen initializes
 * nothing), so that a machine without a driver says so once. */
static void load(void) {
  void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (lib == NULL) {
    fprintf(stderr, "%s: no CUDA driver (dlopen libcuda.so.1: %s)\n",
            bench_name, dlerror());
    exit(SKIP);
  }
#define X(field, symbol, args)                                                 \
  *(void **)&cu.field = dlsym(lib, symbol);                                    \
  if (cu.field == NULL) {                                                      \
    fprintf(stderr, "%s: the CUDA driver lacks %s\n", bench_name, symbol);     \
    exit(SKIP);                                                                \
  }
  COLD_SYMBOLS(X)
#undef X
  *(void **)&cu.cuGetErrorName = dlsym(lib, "cuGetErrorName");
}

/* What cuMemCreate makes here: device memory of dev that exports as a
 * POSIX file descriptor, as expandable segments and usmipc's pool ask. */
static CUmemAllocationProp fd_prop(void) {
  CUmemAllocationProp prop;
  memset(&prop, 0, sizeof(prop));
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = dev;
  return prop;
}

/* The device and its primary context, made current (after the fork: each
 * process its own driver state). */
static void setup(int ordinal) {
  check(cu.cuInit(0), "cuInit");
  check(cu.cuDeviceGet(&dev, ordinal), "cuDeviceGet");
  CUcontext ctx;
  check(cu.cuDevicePrimaryCtxRetain(&ctx, dev), "cuDevicePrimaryCtxRetain");
  check(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent");
  if (kind == KIND_FD) {
    CUmemAllocationProp prop = fd_prop();
    check(cu.cuMemGetAllocationGranularity(&granularity, &prop,
                                           CU_MEM_ALLOC_GRANULARITY_MINIMUM),
          "cuMemGetAllocationGranularity");
    if (granularity == 0)
      granularity = 2u << 20;
  }
}

static CUmemAccessDesc access_desc(void) {
  CUmemAccessDesc a = {
      .location = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = dev},
      .flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
  return a;
}

static void write_all(int fd, const void *buf, size_t n) {
  const char *p = buf;
  while (n > 0) {
    ssize_t w = write(fd, p, n);
    if (w < 0 && errno == EINTR)
      continue;
    if (w <= 0)
      bench_die("write to the other process", 0);
    p += w;
    n -= (size_t)w;
  }
}

static int read_all(int fd, void *buf, size_t n) {
  char *p = buf;
  while (n > 0) {
    ssize_t r = read(fd, p, n);
    if (r < 0 && errno == EINTR)
      continue;
    if (r <= 0)
      return -1;
    p += r;
    n -= (size_t)r;
  }
  return 0;
}

/* ---- the importer (the child) ---- */

/* Per round: reads n and n wire records, imports each (timed), closes them
 * all (untimed), answers {transfer_us, import_us}. n == 0 ends it. */
static int importer(int sock, int ordinal, pid_t exporter) {
  setup(ordinal);
  CUmemAccessDesc acc = access_desc();
  for (;;) {
    uint32_t n;
    if (read_all(sock, &n, sizeof(n)) != 0 || n == 0)
      return 0;
    wire_t *w = calloc(n, sizeof(*w));
    CUdeviceptr *p = calloc(n, sizeof(*p));
    int *fds = calloc(n, sizeof(*fds));
    if (w == NULL || p == NULL || fds == NULL ||
        read_all(sock, w, n * sizeof(*w)) != 0)
      bench_die("importer: reading the round", 0);
    double transfer = 0, import = 0;
    if (kind == KIND_FD) {
      double t0 = now_us();
      int pidfd = (int)syscall(SYS_pidfd_open, exporter, 0);
      if (pidfd < 0)
        bench_die("importer: pidfd_open of the exporter", 0);
      for (uint32_t i = 0; i < n; i++) {
        fds[i] = (int)syscall(SYS_pidfd_getfd, pidfd, w[i].fd, 0);
        if (fds[i] < 0)
          bench_die("importer: pidfd_getfd (needs ptrace rights over the "
                    "exporter: root or CAP_SYS_PTRACE)",
                    0);
      }
      close(pidfd);
      transfer = now_us() - t0;
    }
    double t0 = now_us();
    for (uint32_t i = 0; i < n; i++) {
      if (kind == KIND_NATIVE) {
        CUipcMemHandle h;
        memcpy(&h, w[i].ipc, sizeof(h));
        check(cu.cuIpcOpenMemHandle(&p[i], h,
                                    CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS),
              "cuIpcOpenMemHandle_v2");
        continue;
      }
      CUmemGenericAllocationHandle h;
      check(cu.cuMemImportFromShareableHandle(
                &h, (void *)(intptr_t)fds[i],
                CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
            "cuMemImportFromShareableHandle");
      check(cu.cuMemAddressReserve(&p[i], w[i].size, granularity, 0, 0),
            "cuMemAddressReserve");
      check(cu.cuMemMap(p[i], w[i].size, 0, h, 0), "cuMemMap");
      check(cu.cuMemSetAccess(p[i], w[i].size, &acc, 1), "cuMemSetAccess");
      check(cu.cuMemRelease(h), "cuMemRelease");
    }
    import = now_us() - t0;
    for (uint32_t i = 0; i < n; i++) { /* untimed: the next round is cold */
      if (kind == KIND_NATIVE) {
        check(cu.cuIpcCloseMemHandle(p[i]), "cuIpcCloseMemHandle");
      } else {
        check(cu.cuMemUnmap(p[i], w[i].size), "cuMemUnmap");
        check(cu.cuMemAddressFree(p[i], w[i].size), "cuMemAddressFree");
        close(fds[i]);
      }
    }
    double answer[2] = {transfer, import};
    write_all(sock, answer, sizeof(answer));
    free(w);
    free(p);
    free(fds);
  }
}

/* ---- the exporter (the parent) ---- */

static void allocate(alloc_t *a) {
  if (kind == KIND_NATIVE) {
    check(cu.cuMemAlloc(&a->p, a->size), "cuMemAlloc_v2");
    return;
  }
  CUmemAllocationProp prop = fd_prop();
  CUmemAccessDesc acc = access_desc();
  check(cu.cuMemCreate(&a->h, a->size, &prop, 0), "cuMemCreate");
  check(cu.cuMemAddressReserve(&a->p, a->size, granularity, 0, 0),
        "cuMemAddressReserve");
  check(cu.cuMemMap(a->p, a->size, 0, a->h, 0), "cuMemMap");
  check(cu.cuMemSetAccess(a->p, a->size, &acc, 1), "cuMemSetAccess");
}

static void release(alloc_t *a) {
  if (kind == KIND_NATIVE) {
    check(cu.cuMemFree(a->p), "cuMemFree_v2");
    return;
  }
  close(a->fd);
  check(cu.cuMemUnmap(a->p, a->size), "cuMemUnmap");
  check(cu.cuMemAddressFree(a->p, a->size), "cuMemAddressFree");
  check(cu.cuMemRelease(a->h), "cuMemRelease");
}

/* Parses "SIZExCOUNT[,SIZExCOUNT...]" (SIZE in bytes; xCOUNT optional)
 * into a[]; returns the count, or -1 on a malformed list. */
static long parse_sizes(const char *s, size_t **out) {
  size_t cap = 64, n = 0;
  size_t *v = malloc(cap * sizeof(*v));
  if (v == NULL)
    return -1;
  while (*s != '\0') {
    char *end;
    errno = 0;
    unsigned long long size = strtoull(s, &end, 10);
    unsigned long long count = 1;
    if (errno != 0 || end == s || size == 0)
      goto bad;
    if (*end == 'x') {
      s = end + 1;
      count = strtoull(s, &end, 10);
      if (errno != 0 || end == s || count == 0 || count > 1000000)
        goto bad;
    }
    for (unsigned long long k = 0; k < count; k++) {
      if (n == cap) {
        size_t *g = realloc(v, (cap *= 2) * sizeof(*v));
        if (g == NULL)
          goto bad;
        v = g;
      }
      v[n++] = (size_t)size;
    }
    s = end;
    if (*s == ',')
      s++;
    else if (*s != '\0')
      goto bad;
  }
  *out = v;
  return (long)n;
bad:
  free(v);
  return -1;
}

static void usage(void) {
  fprintf(stderr,
          "usage: %s --kind native|fd --sizes SIZExCOUNT[,...] "
          "[--rounds 5] [--device 0] [--json FILE|-]\n"
          "  SIZE in bytes; e.g. --sizes 20971520x12,2097152x3\n",
          bench_name);
  exit(2);
}

int main(int argc, char **argv) {
  bench_name = "usmipc_bench_cold_floor";
  const char *sizes_arg = NULL, *json = NULL;
  int rounds = 5, ordinal = 0;
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
    if (v == NULL)
      usage();
    if (strcmp(a, "--kind") == 0 && strcmp(v, "native") == 0)
      kind = KIND_NATIVE;
    else if (strcmp(a, "--kind") == 0 && strcmp(v, "fd") == 0)
      kind = KIND_FD;
    else if (strcmp(a, "--sizes") == 0)
      sizes_arg = v;
    else if (strcmp(a, "--rounds") == 0 && (rounds = atoi(v)) > 0)
      ;
    else if (strcmp(a, "--device") == 0 && (ordinal = atoi(v)) >= 0)
      ;
    else if (strcmp(a, "--json") == 0)
      json = v;
    else
      usage();
    i++;
  }
  size_t *sizes = NULL;
  long n = sizes_arg ? parse_sizes(sizes_arg, &sizes) : -1;
  if (n <= 0) {
    fprintf(stderr, "%s: --sizes must be SIZE[xCOUNT] items, comma "
                    "separated, every SIZE and COUNT above 0\n",
            bench_name);
    usage();
  }
  int sv[2];
  if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0)
    bench_die("socketpair", 0);
  load();
  pid_t exporter = getpid();
  pid_t child = fork(); /* before cuInit: each process its own driver state */
  if (child < 0)
    bench_die("fork", 0);
  if (child == 0) {
    close(sv[0]);
    _exit(importer(sv[1], ordinal, exporter));
  }
  close(sv[1]);
  int sock = sv[0];
  signal(SIGPIPE, SIG_IGN); /* an importer that died: said by read_all */
  setup(ordinal);

  alloc_t *a = calloc((size_t)n, sizeof(*a));
  wire_t *w = calloc((size_t)n, sizeof(*w));
  double *exp_us = calloc((size_t)rounds, sizeof(double));
  double *xfer_us = calloc((size_t)rounds, sizeof(double));
  double *imp_us = calloc((size_t)rounds, sizeof(double));
  if (a == NULL || w == NULL || exp_us == NULL || xfer_us == NULL ||
      imp_us == NULL)
    bench_die("calloc", 0);
  size_t total = 0;
  for (long i = 0; i < n; i++) {
    a[i].size = sizes[i];
    if (kind == KIND_FD) /* what cuMemCreate takes: whole granules */
      a[i].size = (a[i].size + granularity - 1) / granularity * granularity;
    total += a[i].size;
  }
  for (int r = 0; r < rounds; r++) {
    for (long i = 0; i < n; i++) /* fresh allocations, untimed */
      allocate(&a[i]);
    double t0 = now_us();
    for (long i = 0; i < n; i++) {
      if (kind == KIND_NATIVE)
        check(cu.cuIpcGetMemHandle(&a[i].ipc, a[i].p), "cuIpcGetMemHandle");
      else
        check(cu.cuMemExportToShareableHandle(
                  &a[i].fd, a[i].h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                  0),
              "cuMemExportToShareableHandle");
    }
    exp_us[r] = now_us() - t0;
    for (long i = 0; i < n; i++) {
      w[i].size = a[i].size;
      w[i].fd = kind == KIND_FD ? a[i].fd : -1;
      memcpy(w[i].ipc, &a[i].ipc, sizeof(w[i].ipc));
    }
    uint32_t count = (uint32_t)n;
    write_all(sock, &count, sizeof(count));
    write_all(sock, w, (size_t)n * sizeof(*w));
    double answer[2];
    if (read_all(sock, answer, sizeof(answer)) != 0) {
      fprintf(stderr, "%s: the importer ended mid-round (its error above)\n",
              bench_name);
      return 1;
    }
    xfer_us[r] = answer[0];
    imp_us[r] = answer[1];
    for (long i = 0; i < n; i++)
      release(&a[i]);
  }
  uint32_t stop = 0;
  write_all(sock, &stop, sizeof(stop));
  int status = 0;
  waitpid(child, &status, 0);

  double e = quantile_nearest(exp_us, rounds, 0.5);
  double x = quantile_nearest(xfer_us, rounds, 0.5);
  double m = quantile_nearest(imp_us, rounds, 0.5);
  const char *kname = kind == KIND_NATIVE ? "native" : "fd";
  printf("| %s | %ld | %.1f MiB | %.3f | %.3f | %.3f | %.3f | %.1f |\n", kname,
         n, (double)total / (1 << 20), e / 1e3, x / 1e3, m / 1e3,
         (e + m) / 1e3, (e + m) / (double)n);
  if (json != NULL) {
    FILE *f = strcmp(json, "-") == 0 ? stdout : fopen(json, "w");
    if (f == NULL)
      bench_die("opening the JSON file", 0);
    fprintf(f,
            "{\"kind\": \"%s\", \"allocations\": %ld, \"bytes\": %zu, "
            "\"rounds\": %d, \"export_ms\": %.4f, \"transfer_ms\": %.4f, "
            "\"import_ms\": %.4f, \"floor_ms\": %.4f, "
            "\"per_allocation_us\": %.2f, \"importer_status\": %d}\n",
            kname, n, total, rounds, e / 1e3, x / 1e3, m / 1e3, (e + m) / 1e3,
            (e + m) / (double)n, WIFEXITED(status) ? WEXITSTATUS(status) : -1);
    if (f != stdout)
      fclose(f);
  }
  free(sizes);
  free(a);
  free(w);
  free(exp_us);
  free(xfer_us);
  free(imp_us);
  return WIFEXITED(status) && WEXITSTATUS(status) == 0 ? 0 : 1;
}
