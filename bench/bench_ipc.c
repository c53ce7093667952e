/* usmipc_bench: what an IPC round trip costs, per call, in microseconds.
 *
 *   usmipc_bench [--device FILTER] [--sizes 4K,1M,64M,256M] [--k 40]
 *                [--rounds 3] [--iters 2000] [--transports socket,pidfd]
 *                [--kind fd|native] [--json FILE]
 *   usmipc_bench --raw --device cuda[:gpu[:N]] [--kind fd|native]
 *                [--sizes ...] [--k 100] [--rounds 3] [--transports pidfd]
 *                [--order abba|usmipc-first|raw-first] [--json FILE]
 *
 * For each size, on one device (default host:cpu):
 *  - export, first: usmipc_ipc_get_handle on a buffer never exported before
 *    (the backend's export and the fd grant), then usmipc_ipc_free_handle;
 *  - export, repeat: usmipc_ipc_get_handle of an already exported buffer;
 *  - first open, per fd transport: this process allocates K fresh buffers
 *    and exports them all; an importer, an unrelated process started by
 *    re-executing this binary with USMIPC_FD_TRANSPORT set, opens each once
 *    and times each open until it holds a usable pointer;
 *  - cached re-open: open + close of a handle the importer already holds
 *    open (the shared, reference-counted mapping), many iterations;
 *  - close: the importer's close of its last reference to a mapping.
 * Each first-open round uses fresh allocations and a fresh importer, so
 * every timed first open really is the first. Medians with p10 and p90 are
 * printed as a Markdown table; --json writes the same numbers.
 * Timing is clock_gettime(CLOCK_MONOTONIC) around each single call.
 *
 * --raw (CUDA only): usmipc's first open and close against the bare driver
 * calls, paired and interleaved in one importer so that both see the same
 * conditions. Per round the exporter allocates 2K + 2 fresh buffers (each
 * rounded up to a multiple of 2 MiB, so that no two share a driver block:
 * cuMemAlloc packs smaller allocations into shared 2 MiB blocks, which the
 * importer's driver maps once; the handle exports the asked size) and
 * exports all of them with usmipc. The importer opens buffer 1 through the
 * driver and buffer 0 through usmipc as an untimed warm-up (open and
 * close), then the K pairs: pair j is buffer 2 + 2j opened with
 * usmipc_ipc_open and buffer 3 + 2j with the raw driver path, one right
 * after the other, each timed; then it closes them in the same order, each
 * timed. --order says which call of a pair goes first: abba (default:
 * blocks of two pairs, usmipc raw raw usmipc or raw usmipc usmipc raw at
 * random, from a fixed seed), usmipc-first or raw-first. The position
 * matters: on an H200 one mapping in every 512 MiB mapped costs ~20 us
 * more, whichever path makes it, so with 256 MiB buffers and usmipc-first
 * every raw open paid it and usmipc looked 22% faster than the driver. The
 * paired statistics are per block (sum(usmipc) / sum(raw)), with a 95%
 * bootstrap interval of their median.
 * The raw path reads usmipc's handle bytes (docs/handle-format.md) and,
 * with the primary context pushed once:
 *  - native handles (kind 1): cuIpcOpenMemHandle_v2(LAZY_ENABLE_PEER_ACCESS)
 *    on the 64 payload bytes; close: cuIpcCloseMemHandle;
 *  - fd handles (kind 2): pidfd_open + pidfd_getfd + close(pidfd) +
 *    cuMemImportFromShareableHandle + cuMemAddressReserve + cuMemMap +
 *    cuMemSetAccess + cuMemRelease + close(fd), timed as one (what usmipc's
 *    fd import does, minus its checks); close: cuMemUnmap + cuMemAddressFree.
 * The importer's import cache is off (usmipc_ipc_set_cache_size(0)) so that
 * usmipc's close unmaps like the raw close does. */
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/utsname.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "c/bench_util.h"
#include "usmipc.h"

extern char **environ;

#define MAX_SIZES 16
#define MAX_TRANSPORTS 4

static void die(const char *what, int rc) {
  fprintf(stderr, "usmipc_bench: %s: %s (%s)\n", what,
          rc ? usmipc_err_name(rc) : strerror(errno),
          rc ? usmipc_last_error() : "");
  exit(1);
}

static int write_full(int fd, const void *buf, size_t len) {
  const char *p = buf;
  while (len > 0) {
    ssize_t n = write(fd, p, len);
    if (n < 0 && errno == EINTR)
      continue;
    if (n <= 0)
      return -1;
    p += n;
    len -= (size_t)n;
  }
  return 0;
}

static int read_full(int fd, void *buf, size_t len) {
  char *p = buf;
  while (len > 0) {
    ssize_t n = read(fd, p, len);
    if (n < 0 && errno == EINTR)
      continue;
    if (n <= 0)
      return -1;
    p += n;
    len -= (size_t)n;
  }
  return 0;
}

/* ---- statistics -----------------------------------------------------------
 */

typedef struct samples {
  double *v;
  size_t n, cap;
} samples_t;

typedef struct summary {
  double median, p10, p90;
  size_t n;
  int valid;
  char note[96]; /* why there are no numbers */
} summary_t;

static void add(samples_t *s, double x) {
  if (s->n == s->cap) {
    s->cap = s->cap ? s->cap * 2 : 256;
    s->v = realloc(s->v, s->cap * sizeof(double));
    if (s->v == NULL)
      die("out of memory", 0);
  }
  s->v[s->n++] = x;
}

static double quantile(const double *sorted, size_t n, double q) {
  double pos = q * (double)(n - 1);
  size_t lo = (size_t)pos;
  size_t hi = lo + 1 < n ? lo + 1 : lo;
  double frac = pos - (double)lo;
  return sorted[lo] * (1 - frac) + sorted[hi] * frac;
}

static summary_t summarize(samples_t *s) {
  summary_t r;
  memset(&r, 0, sizeof(r));
  if (s->n == 0) {
    snprintf(r.note, sizeof(r.note), "no samples");
    return r;
  }
  qsort(s->v, s->n, sizeof(double), cmp_double);
  r.median = quantile(s->v, s->n, 0.5);
  r.p10 = quantile(s->v, s->n, 0.1);
  r.p90 = quantile(s->v, s->n, 0.9);
  r.n = s->n;
  r.valid = 1;
  return r;
}

/* ---- the importer (a separate, unrelated process) --------------------------
 * stdin:  u32 k, u32 iters, u32 verify, then k x (u32 len, bytes)
 * stdout: i32 status, then k doubles (first open), k doubles (close of the
 *         last reference), iters doubles (re-open), iters doubles (close of
 *         a non-last reference); on failure, status < 0 and a 256-byte
 *         message instead. */
static int importer_main(void) {
  uint32_t hdr[3];
  if (read_full(0, hdr, sizeof(hdr)) != 0)
    return 2;
  uint32_t k = hdr[0], iters = hdr[1], verify = hdr[2];
  uint8_t(*handles)[512] = calloc(k, 512);
  uint32_t *lens = calloc(k, sizeof(uint32_t));
  void **ptrs = calloc(k, sizeof(void *));
  size_t ntimes = 2 * (size_t)k + 2 * (size_t)iters;
  double *times = calloc(ntimes, sizeof(double));
  if (!handles || !lens || !ptrs || !times)
    return 2;
  for (uint32_t i = 0; i < k; i++) {
    if (read_full(0, &lens[i], 4) != 0 || lens[i] > 512 ||
        read_full(0, handles[i], lens[i]) != 0)
      return 2;
  }
  int32_t status = 0;
  char msg[256] = {0};
  double *open_first = times, *close_last = times + k;
  double *reopen = times + 2 * k, *reclose = times + 2 * k + iters;

  for (uint32_t i = 0; i < k && status == 0; i++) {
    size_t mapped;
    double t0 = now_us();
    int rc = usmipc_ipc_open(handles[i], lens[i], NULL, 0, &ptrs[i], &mapped);
    double t1 = now_us();
    if (rc != 0) {
      status = rc;
      snprintf(msg, sizeof(msg), "open %u: %s: %s", i, usmipc_err_name(rc),
               usmipc_last_error());
      break;
    }
    open_first[i] = t1 - t0;
    /* Usable: the exporter's marker byte is there (host memory is read
     * directly; other devices are trusted to the driver). */
    if (verify && ((volatile uint8_t *)ptrs[i])[0] != (uint8_t)(i * 7 + 1)) {
      status = USMIPC_EIO;
      snprintf(msg, sizeof(msg), "buffer %u: wrong marker byte", i);
    }
  }
  /* Cached re-open of buffer 0, which stays open meanwhile. */
  for (uint32_t j = 0; j < iters && status == 0; j++) {
    void *p;
    double t0 = now_us();
    int rc = usmipc_ipc_open(handles[0], lens[0], NULL, 0, &p, NULL);
    double t1 = now_us();
    int rc2 = rc == 0 ? usmipc_ipc_close(p) : 0;
    double t2 = now_us();
    if (rc != 0 || rc2 != 0 || p != ptrs[0]) {
      status = rc ? rc : rc2 ? rc2 : USMIPC_EIO;
      snprintf(msg, sizeof(msg), "re-open: %s: %s", usmipc_err_name(status),
               usmipc_last_error());
      break;
    }
    reopen[j] = t1 - t0;
    reclose[j] = t2 - t1;
  }
  for (uint32_t i = 0; i < k && status == 0; i++) {
    double t0 = now_us();
    int rc = usmipc_ipc_close(ptrs[i]);
    double t1 = now_us();
    if (rc != 0) {
      status = rc;
      snprintf(msg, sizeof(msg), "close %u: %s", i, usmipc_last_error());
    }
    close_last[i] = t1 - t0;
  }
  write_full(1, &status, sizeof(status));
  if (status == 0)
    write_full(1, times, ntimes * sizeof(double));
  else
    write_full(1, msg, sizeof(msg));
  return 0;
}

/* Starts `/proc/self/exe ROLE` (--importer or --importer-raw) with
 * USMIPC_FD_TRANSPORT=transport. */
static pid_t spawn_importer(const char *role, const char *transport, int *to,
                            int *from) {
  int in[2], out[2];
  if (pipe2(in, O_CLOEXEC) != 0 || pipe2(out, O_CLOEXEC) != 0)
    die("pipe2", 0);
  size_t n = 0;
  while (environ[n])
    n++;
  char **env = calloc(n + 2, sizeof(char *));
  size_t m = 0;
  for (size_t i = 0; i < n; i++)
    if (strncmp(environ[i], "USMIPC_FD_TRANSPORT=", 20) != 0)
      env[m++] = environ[i];
  char setting[64];
  snprintf(setting, sizeof(setting), "USMIPC_FD_TRANSPORT=%s", transport);
  env[m++] = setting;
  env[m] = NULL;
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, in[0], 0);
  posix_spawn_file_actions_adddup2(&fa, out[1], 1);
  char *argv[] = {"/proc/self/exe", (char *)role, NULL};
  pid_t pid;
  int err = posix_spawn(&pid, "/proc/self/exe", &fa, NULL, argv, env);
  posix_spawn_file_actions_destroy(&fa);
  free(env);
  if (err != 0) {
    errno = err;
    die("posix_spawn", 0);
  }
  close(in[0]);
  close(out[1]);
  *to = in[1];
  *from = out[0];
  return pid;
}

/* ---- the raw-driver baseline's importer (--importer-raw) -------------------
 * The CUDA driver through dlopen, like src/backend/cuda.c: the few types it
 * needs are declared here with cuda.h's layouts, so that the benchmark builds
 * without the CUDA toolkit. */

typedef int CUresult;
typedef int CUdevice;
typedef struct CUctx_st *CUcontext;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long CUmemGenericAllocationHandle;
typedef struct {
  char reserved[64];
} CUipcMemHandle;
typedef struct {
  int type; /* CUmemLocationType */
  int id;
} CUmemLocation;
typedef struct {
  int type;                 /* CUmemAllocationType */
  int requestedHandleTypes; /* CUmemAllocationHandleType */
  CUmemLocation location;
  void *win32HandleMetaData;
  struct {
    unsigned char compressionType;
    unsigned char gpuDirectRDMACapable;
    unsigned short usage;
    unsigned char reserved[4];
  } allocFlags;
} CUmemAllocationProp;
typedef struct {
  CUmemLocation location;
  int flags; /* CUmemAccess_flags */
} CUmemAccessDesc;

enum {
  CUDA_SUCCESS = 0,
  CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 1,
  CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 1,
  CU_MEM_ALLOCATION_TYPE_PINNED = 1,
  CU_MEM_LOCATION_TYPE_DEVICE = 1,
  CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3,
  CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0,
};

/* Versioned names spelled out: cuda.h maps some names by macro. */
#define RAW_CUDA_SYMBOLS(X)                                                    \
  X(cuInit, "cuInit", (unsigned))                                              \
  X(cuDeviceGet, "cuDeviceGet", (CUdevice *, int))                             \
  X(cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain",                      \
    (CUcontext *, CUdevice))                                                   \
  X(cuCtxPushCurrent, "cuCtxPushCurrent_v2", (CUcontext))                      \
  X(cuIpcOpenMemHandle, "cuIpcOpenMemHandle_v2",                               \
    (CUdeviceptr *, CUipcMemHandle, unsigned))                                 \
  X(cuIpcCloseMemHandle, "cuIpcCloseMemHandle", (CUdeviceptr))                 \
  X(cuMemImportFromShareableHandle, "cuMemImportFromShareableHandle",          \
    (CUmemGenericAllocationHandle *, void *, int))                             \
  X(cuMemAddressReserve, "cuMemAddressReserve",                                \
    (CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long))          \
  X(cuMemMap, "cuMemMap",                                                      \
    (CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle,                \
     unsigned long long))                                                      \
  X(cuMemRelease, "cuMemRelease", (CUmemGenericAllocationHandle))              \
  X(cuMemSetAccess, "cuMemSetAccess",                                          \
    (CUdeviceptr, size_t, const CUmemAccessDesc *, size_t))                    \
  X(cuMemUnmap, "cuMemUnmap", (CUdeviceptr, size_t))                           \
  X(cuMemAddressFree, "cuMemAddressFree", (CUdeviceptr, size_t))               \
  X(cuMemGetAllocationGranularity, "cuMemGetAllocationGranularity",            \
    (size_t *, const CUmemAllocationProp *, int))

static struct {
#define X(field, symbol, args) CUresult(*field) args;
  RAW_CUDA_SYMBOLS(X)
#undef X
  CUresult (*cuGetErrorName)(CUresult, const char **); /* optional */
} rawcu;

#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif
#ifndef SYS_pidfd_getfd
#define SYS_pidfd_getfd 438
#endif

/* Importer status codes of the raw path (usmipc's own codes are small
 * negative numbers). */
#define RAW_STATUS_FAIL (-100000)
/* Which call of a pair goes first (--order). */
enum {
  RAW_ORDER_USMIPC_FIRST = 0, /* usmipc, raw, usmipc, raw, ... */
  RAW_ORDER_RAW_FIRST = 1,    /* raw, usmipc, raw, usmipc, ... */
  RAW_ORDER_ABBA = 2,         /* blocks of two pairs, each block randomly
                                 usmipc raw raw usmipc or the reverse */
};
static const char *const raw_order_names[] = {"usmipc-first", "raw-first",
                                              "abba"};

static uint64_t xorshift64(uint64_t *x) {
  *x ^= *x << 13;
  *x ^= *x >> 7;
  *x ^= *x << 17;
  return *x;
}

/* Which call of pair j goes first, for pairs 0..k-1: 1 usmipc, 0 raw. The
 * exporter and the importer compute the same plan from the seed. With abba,
 * each block of two pairs gives each side one call in each position (a cost
 * of the position cancels within the block, whatever side it hits), and the
 * random choice of abba or baab per block makes a cost of a longer period
 * (a GPU showed one every 512 MiB of mappings) hit either side alike. */
static void raw_order_plan(unsigned order, uint64_t seed, uint32_t k,
                           uint8_t *usmipc_first) {
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + 0x2545F4914F6CDD1Dull;
  if (x == 0)
    x = 1;
  for (uint32_t j = 0; j < k; j++) {
    if (order == RAW_ORDER_USMIPC_FIRST)
      usmipc_first[j] = 1;
    else if (order == RAW_ORDER_RAW_FIRST)
      usmipc_first[j] = 0;
    else if (j % 2 == 0)
      usmipc_first[j] = (uint8_t)(xorshift64(&x) >> 63);
    else
      usmipc_first[j] = !usmipc_first[j - 1];
  }
}
#define RAW_STATUS_EPERM (-100001)

/* Handle kinds and offsets of docs/handle-format.md. */
enum {
  WIRE_BACKEND = 12,
  WIRE_KIND = 13,
  WIRE_FLAGS = 14,
  WIRE_PID = 48,
  WIRE_FD_NUMBER = 52,
  WIRE_PAYLOAD_LEN = 144,
  WIRE_PAYLOAD = 148,
  WIRE_BACKEND_CUDA = 2,
  CUDA_KIND_NATIVE = 1,
  CUDA_KIND_FD = 2,
};

static uint32_t le32(const uint8_t *p) {
  return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 |
         (uint32_t)p[3] << 24;
}

static uint64_t le64(const uint8_t *p) {
  return (uint64_t)le32(p) | (uint64_t)le32(p + 4) << 32;
}

static int cmp_u64(const void *a, const void *b) {
  uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
  return x < y ? -1 : x > y;
}

static const char *cu_name(CUresult res) {
  const char *name = NULL;
  if (rawcu.cuGetErrorName == NULL || rawcu.cuGetErrorName(res, &name) != 0 ||
      name == NULL)
    return "?";
  return name;
}

static int raw_cuda_load(char *msg, size_t len) {
  void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (lib == NULL) {
    snprintf(msg, len, "raw: dlopen(libcuda.so.1): %s", dlerror());
    return RAW_STATUS_FAIL;
  }
#define X(field, symbol, args)                                                 \
  *(void **)&rawcu.field = dlsym(lib, symbol);                                 \
  if (rawcu.field == NULL) {                                                   \
    snprintf(msg, len, "raw: the CUDA driver lacks %s", symbol);               \
    return RAW_STATUS_FAIL;                                                    \
  }
  RAW_CUDA_SYMBOLS(X)
#undef X
  *(void **)&rawcu.cuGetErrorName = dlsym(lib, "cuGetErrorName");
  return 0;
}

/* One buffer opened through the raw driver path. */
typedef struct raw_mapping {
  CUdeviceptr p;
  size_t size; /* reserved range (fd handles) */
} raw_mapping_t;

typedef struct raw_ctx {
  CUdevice dev;
  size_t granularity; /* fd handles: cuMemCreate's minimum granularity */
} raw_ctx_t;

/* Opens handle h (already validated by usmipc_ipc_handle_inspect) through
 * the bare driver calls; *us gets the time of the timed part. */
static int raw_open(const raw_ctx_t *c, const uint8_t *h, unsigned kind,
                    raw_mapping_t *m, double *us, char *msg, size_t len) {
  if (kind == CUDA_KIND_NATIVE) {
    CUipcMemHandle ih;
    memcpy(&ih, h + WIRE_PAYLOAD, sizeof(ih));
    CUdeviceptr p = 0;
    double t0 = now_us();
    CUresult res =
        rawcu.cuIpcOpenMemHandle(&p, ih, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS);
    double t1 = now_us();
    if (res != CUDA_SUCCESS) {
      snprintf(msg, len,
               "raw: cuIpcOpenMemHandle_v2 failed: %s (CUDA error %d)",
               cu_name(res), res);
      return RAW_STATUS_FAIL;
    }
    m->p = p;
    m->size = 0;
    *us = t1 - t0;
    return 0;
  }
  /* CUDA_KIND_FD */
  pid_t pid = (pid_t)le32(h + WIRE_PID);
  int fd_number = (int)le32(h + WIRE_FD_NUMBER);
  size_t size = (size_t)le64(h + WIRE_PAYLOAD);
  CUmemAccessDesc access = {
      .location = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = c->dev},
      .flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
  CUmemGenericAllocationHandle ah = 0;
  CUdeviceptr p = 0;
  const char *what = "pidfd_open";
  CUresult res = CUDA_SUCCESS;
  int err = 0, fd = -1;

  double t0 = now_us();
  int pidfd = (int)syscall(SYS_pidfd_open, pid, 0);
  if (pidfd >= 0) {
    what = "pidfd_getfd";
    fd = (int)syscall(SYS_pidfd_getfd, pidfd, fd_number, 0);
    err = errno;
    close(pidfd);
  } else {
    err = errno;
  }
  if (fd >= 0) {
    what = "cuMemImportFromShareableHandle";
    res = rawcu.cuMemImportFromShareableHandle(
        &ah, (void *)(intptr_t)fd, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    if (res == CUDA_SUCCESS) {
      what = "cuMemAddressReserve";
      res = rawcu.cuMemAddressReserve(&p, size, c->granularity, 0, 0);
      if (res == CUDA_SUCCESS) {
        what = "cuMemMap";
        res = rawcu.cuMemMap(p, size, 0, ah, 0);
        if (res == CUDA_SUCCESS) {
          what = "cuMemSetAccess";
          res = rawcu.cuMemSetAccess(p, size, &access, 1);
        }
      }
      rawcu.cuMemRelease(ah); /* the mapping holds its own reference */
    }
    close(fd);
  }
  double t1 = now_us();

  if (fd < 0 && (err == EPERM || err == EACCES)) {
    snprintf(msg, len,
             "the raw fd baseline needs ptrace rights over the exporter: "
             "%s(2) of process %d failed with %s (Yama ptrace_scope, "
             "containers; run as root or with CAP_SYS_PTRACE)",
             what, (int)pid, strerror(err));
    return RAW_STATUS_EPERM;
  }
  if (fd < 0) {
    snprintf(msg, len, "raw: %s(2) failed: %s", what, strerror(err));
    return RAW_STATUS_FAIL;
  }
  if (res != CUDA_SUCCESS) {
    snprintf(msg, len, "raw: %s failed: %s (CUDA error %d)", what, cu_name(res),
             res);
    return RAW_STATUS_FAIL;
  }
  m->p = p;
  m->size = size;
  *us = t1 - t0;
  return 0;
}

static int raw_close(unsigned kind, const raw_mapping_t *m, double *us,
                     char *msg, size_t len) {
  CUresult res;
  double t0 = now_us();
  if (kind == CUDA_KIND_NATIVE) {
    res = rawcu.cuIpcCloseMemHandle(m->p);
  } else {
    res = rawcu.cuMemUnmap(m->p, m->size);
    if (res == CUDA_SUCCESS)
      res = rawcu.cuMemAddressFree(m->p, m->size);
  }
  double t1 = now_us();
  if (res != CUDA_SUCCESS) {
    snprintf(msg, len, "raw: closing failed: %s (CUDA error %d)", cu_name(res),
             res);
    return RAW_STATUS_FAIL;
  }
  *us = t1 - t0;
  return 0;
}

/* stdin:  u32 n (2K + 2), u32 CUDA device ordinal, u32 order (RAW_ORDER_*),
 *         u32 seed of the order plan, then n x (u32 len, bytes)
 * stdout: i32 status, u32 number of timed buffers that shared a 2 MiB
 *         block with an earlier one, then 4 x K doubles: usmipc first opens,
 * raw first opens, usmipc closes, raw closes, K each in buffer order (pair i is
 *         buffers 2 + 2i through usmipc and 3 + 2i raw); on failure, status
 *         < 0 and a 256-byte message instead. */
static int raw_importer_main(void) {
  uint32_t hdr[4];
  if (read_full(0, hdr, sizeof(hdr)) != 0)
    return 2;
  uint32_t n = hdr[0], ordinal = hdr[1], order = hdr[2], seed = hdr[3];
  if (n < 4 || n % 2 != 0)
    return 2;
  uint32_t k = (n - 2) / 2;
  uint8_t(*handles)[512] = calloc(n, 512);
  uint32_t *lens = calloc(n, sizeof(uint32_t));
  void **ptrs = calloc(n, sizeof(void *));
  raw_mapping_t *maps = calloc(n, sizeof(raw_mapping_t));
  double *times = calloc(4 * (size_t)k, sizeof(double));
  if (!handles || !lens || !ptrs || !maps || !times)
    return 2;
  for (uint32_t i = 0; i < n; i++) {
    if (read_full(0, &lens[i], 4) != 0 || lens[i] > 512 ||
        read_full(0, handles[i], lens[i]) != 0)
      return 2;
  }
  double *open_u = times, *open_r = times + k;
  double *close_u = times + 2 * k, *close_r = times + 3 * k;
  int32_t status = 0;
  char msg[256] = {0};
  unsigned kind = 0;

  /* usmipc's close of the last reference unmaps, like the raw close. */
  usmipc_ipc_set_cache_size(0);

  /* The handles are usmipc's own; check them once, untimed. */
  for (uint32_t i = 0; i < n && status == 0; i++) {
    usmipc_ipc_handle_info_t info;
    int rc = usmipc_ipc_handle_inspect(handles[i], lens[i], &info);
    if (rc != 0) {
      status = rc;
      snprintf(msg, sizeof(msg), "handle %u: %s: %s", i, usmipc_err_name(rc),
               usmipc_last_error());
    } else if (info.backend != USMIPC_BACKEND_CUDA ||
               handles[i][WIRE_BACKEND] != WIRE_BACKEND_CUDA ||
               handles[i][WIRE_KIND] != info.handle_kind ||
               (i > 0 && info.handle_kind != kind)) {
      status = RAW_STATUS_FAIL;
      snprintf(msg, sizeof(msg), "handle %u: not a CUDA handle of kind %u", i,
               kind);
    } else {
      kind = info.handle_kind;
      unsigned plen = handles[i][WIRE_PAYLOAD_LEN] |
                      (unsigned)handles[i][WIRE_PAYLOAD_LEN + 1] << 8;
      unsigned fd_flag = handles[i][WIRE_FLAGS] & 1u;
      if (!(kind == CUDA_KIND_NATIVE && plen == 64 && !fd_flag) &&
          !(kind == CUDA_KIND_FD && plen == 8 && fd_flag)) {
        status = RAW_STATUS_FAIL;
        snprintf(msg, sizeof(msg),
                 "handle %u: CUDA handle kind %u with a %u-byte payload and "
                 "FD flag %u: not what the raw path knows",
                 i, kind, plen, fd_flag);
      }
    }
  }

  /* The raw path's setup, untimed: driver, device, primary context (the
   * one usmipc uses too) made current once. */
  raw_ctx_t c;
  memset(&c, 0, sizeof(c));
  if (status == 0)
    status = raw_cuda_load(msg, sizeof(msg));
  if (status == 0) {
    CUcontext ctx = NULL;
    const char *what = "cuInit";
    CUresult res = rawcu.cuInit(0);
    if (res == CUDA_SUCCESS) {
      what = "cuDeviceGet";
      res = rawcu.cuDeviceGet(&c.dev, (int)ordinal);
    }
    if (res == CUDA_SUCCESS) {
      what = "cuDevicePrimaryCtxRetain";
      res = rawcu.cuDevicePrimaryCtxRetain(&ctx, c.dev);
    }
    if (res == CUDA_SUCCESS) {
      what = "cuCtxPushCurrent_v2";
      res = rawcu.cuCtxPushCurrent(ctx);
    }
    if (res == CUDA_SUCCESS && kind == CUDA_KIND_FD) {
      CUmemAllocationProp prop;
      memset(&prop, 0, sizeof(prop));
      prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
      prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
      prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
      prop.location.id = c.dev;
      what = "cuMemGetAllocationGranularity";
      res = rawcu.cuMemGetAllocationGranularity(
          &c.granularity, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
      if (res == CUDA_SUCCESS && c.granularity == 0)
        c.granularity = 2u << 20;
    }
    if (res != CUDA_SUCCESS) {
      status = RAW_STATUS_FAIL;
      snprintf(msg, sizeof(msg), "raw: %s failed: %s (CUDA error %d)", what,
               cu_name(res), res);
    }
  }

  /* Warm-up, untimed: the raw path on buffer 1 first (so that missing
   * ptrace rights are reported as such), then usmipc on buffer 0; each
   * opened and closed once (the first driver IPC call of a process costs
   * extra once). */
  if (status == 0) {
    double ignored;
    status =
        raw_open(&c, handles[1], kind, &maps[1], &ignored, msg, sizeof(msg));
    if (status == 0)
      status = raw_close(kind, &maps[1], &ignored, msg, sizeof(msg));
  }
  if (status == 0) {
    int rc = usmipc_ipc_open(handles[0], lens[0], NULL, 0, &ptrs[0], NULL);
    if (rc == 0)
      rc = usmipc_ipc_close(ptrs[0]);
    if (rc != 0) {
      status = rc;
      snprintf(msg, sizeof(msg), "warm-up: %s: %s", usmipc_err_name(rc),
               usmipc_last_error());
    }
  }

  /* The order of the timed calls: pair j is buffer 2 + 2j (usmipc) and
   * 3 + 2j (raw), one right after the other; which of the two goes first
   * is the --order option's plan. */
  uint32_t *seq = calloc(n, sizeof(uint32_t));
  uint8_t *usmipc_first = calloc(k, 1);
  if (seq == NULL || usmipc_first == NULL)
    return 2;
  raw_order_plan(order, seed, k, usmipc_first);
  for (uint32_t j = 0; j < k; j++) {
    seq[2 * j] = usmipc_first[j] ? 2 + 2 * j : 3 + 2 * j;
    seq[2 * j + 1] = usmipc_first[j] ? 3 + 2 * j : 2 + 2 * j;
  }

  /* First opens: even buffers usmipc, odd buffers raw. */
  for (uint32_t s_i = 0; s_i < 2 * k && status == 0; s_i++) {
    uint32_t i = seq[s_i];
    uint32_t pair = (i - 2) / 2;
    if (i % 2 == 0) {
      double t0 = now_us();
      int rc = usmipc_ipc_open(handles[i], lens[i], NULL, 0, &ptrs[i], NULL);
      double t1 = now_us();
      if (rc != 0) {
        status = rc;
        snprintf(msg, sizeof(msg), "open %u: %s: %s", i, usmipc_err_name(rc),
                 usmipc_last_error());
      }
      open_u[pair] = t1 - t0;
    } else {
      status = raw_open(&c, handles[i], kind, &maps[i], &open_r[pair], msg,
                        sizeof(msg));
    }
  }
  /* How many timed buffers landed in a 2 MiB block that another timed
   * buffer maps too: the driver maps such a block once, so the later opens
   * are cheap reference counts, not first opens. The exporter rounds each
   * allocation up to 2 MiB so that this stays 0. */
  uint32_t shared = 0;
  if (status == 0) {
    uint64_t *blocks = calloc(n, sizeof(uint64_t));
    if (blocks != NULL) {
      for (uint32_t i = 2; i < n; i++)
        blocks[i - 2] =
            (i % 2 == 0 ? (uint64_t)(uintptr_t)ptrs[i] : (uint64_t)maps[i].p) >>
            21;
      qsort(blocks, n - 2, sizeof(uint64_t), cmp_u64);
      for (uint32_t i = 1; i < n - 2; i++)
        shared += blocks[i] == blocks[i - 1];
      free(blocks);
    }
  }
  /* Closes, in the same order. */
  for (uint32_t s_i = 0; s_i < 2 * k && status == 0; s_i++) {
    uint32_t i = seq[s_i];
    uint32_t pair = (i - 2) / 2;
    if (i % 2 == 0) {
      double t0 = now_us();
      int rc = usmipc_ipc_close(ptrs[i]);
      double t1 = now_us();
      if (rc != 0) {
        status = rc;
        snprintf(msg, sizeof(msg), "close %u: %s: %s", i, usmipc_err_name(rc),
                 usmipc_last_error());
      }
      close_u[pair] = t1 - t0;
    } else {
      status = raw_close(kind, &maps[i], &close_r[pair], msg, sizeof(msg));
    }
  }
  write_full(1, &status, sizeof(status));
  if (status == 0) {
    write_full(1, &shared, sizeof(shared));
    write_full(1, times, 4 * (size_t)k * sizeof(double));
  } else
    write_full(1, msg, sizeof(msg));
  return 0;
}

/* ---- the exporter: this process -------------------------------------------
 */

typedef struct options {
  const char *device;
  const char *json;
  size_t sizes[MAX_SIZES];
  int nsizes;
  const char *transports[MAX_TRANSPORTS];
  int ntransports;
  unsigned k, rounds, iters;
  int raw;              /* --raw: the raw-driver baseline instead */
  unsigned order;       /* --order: RAW_ORDER_* */
  unsigned alloc_flags; /* --kind: USMIPC_ALLOC_IPC_FD / _NATIVE, or 0 */
  const char *kind;     /* "fd", "native" or NULL (the backend's default) */
} options_t;

/* Device memory of the kind --kind asks for (0: the backend's default,
 * which USMIPC_CUDA_IPC=fd|native changes). */
static int bench_malloc(const options_t *o, usmipc_device_t *dev, size_t size,
                        void **p) {
  return usmipc_malloc_flags(dev, USMIPC_MEM_DEVICE, size, o->alloc_flags, p);
}

enum {
  M_EXPORT_FIRST,
  M_EXPORT_REPEAT,
  M_FREE_HANDLE,
  M_OPEN_FIRST, /* one per transport, from here */
  M_REOPEN = M_OPEN_FIRST + MAX_TRANSPORTS,
  M_CLOSE_REF,
  M_CLOSE_LAST,
  M_COUNT
};

typedef struct size_result {
  size_t size;
  summary_t m[M_COUNT];
} size_result_t;

static void fill_marker(usmipc_device_t *dev, usmipc_queue_t *q, void *p,
                        uint8_t v) {
  if (usmipc_device_backend(dev) == USMIPC_BACKEND_HOST) {
    *(volatile uint8_t *)p = v;
    return;
  }
  int rc = usmipc_memset(q, p, v, 1);
  if (rc == 0)
    rc = usmipc_queue_synchronize(q);
  if (rc != 0)
    die("usmipc_memset", rc);
}

/* One round of first opens through `transport`: fresh buffers, a fresh
 * importer. The caller's samples get K first opens, K last closes and, when
 * iters > 0, the cached re-open and close timings. */
static int open_round(const options_t *o, usmipc_device_t *dev,
                      usmipc_queue_t *q, size_t size, const char *transport,
                      unsigned iters, samples_t *open_first,
                      samples_t *close_last, samples_t *reopen,
                      samples_t *close_ref, char *note, size_t note_len) {
  void **bufs = calloc(o->k, sizeof(void *));
  usmipc_ipc_handle_t **hs = calloc(o->k, sizeof(*hs));
  for (unsigned i = 0; i < o->k; i++) {
    int rc = bench_malloc(o, dev, size, &bufs[i]);
    if (rc != 0)
      die("usmipc_malloc", rc);
    fill_marker(dev, q, bufs[i], (uint8_t)(i * 7 + 1));
    if ((rc = usmipc_ipc_get_handle(bufs[i], 0, &hs[i])) != 0)
      die("usmipc_ipc_get_handle", rc);
  }
  int to, from;
  pid_t pid = spawn_importer("--importer", transport, &to, &from);
  uint32_t hdr[3] = {o->k, iters,
                     usmipc_device_backend(dev) == USMIPC_BACKEND_HOST};
  int ok = write_full(to, hdr, sizeof(hdr)) == 0;
  for (unsigned i = 0; i < o->k && ok; i++) {
    const void *data;
    size_t len;
    usmipc_ipc_handle_data(hs[i], &data, &len);
    uint32_t l = (uint32_t)len;
    ok = write_full(to, &l, 4) == 0 && write_full(to, data, len) == 0;
  }
  int32_t status = -1;
  if (ok)
    ok = read_full(from, &status, sizeof(status)) == 0;
  int result = 0;
  if (!ok) {
    snprintf(note, note_len, "importer died");
    result = -1;
  } else if (status != 0) {
    char msg[256];
    if (read_full(from, msg, sizeof(msg)) != 0)
      snprintf(msg, sizeof(msg), "importer failed");
    msg[sizeof(msg) - 1] = '\0';
    snprintf(note, note_len, "%s", usmipc_err_name(status));
    fprintf(stderr, "usmipc_bench: %s importer: %s\n", transport, msg);
    result = -1;
  } else {
    size_t ntimes = 2 * (size_t)o->k + 2 * (size_t)iters;
    double *times = calloc(ntimes, sizeof(double));
    if (read_full(from, times, ntimes * sizeof(double)) != 0) {
      snprintf(note, note_len, "importer died");
      result = -1;
    } else {
      for (unsigned i = 0; i < o->k; i++) {
        add(open_first, times[i]);
        add(close_last, times[o->k + i]);
      }
      for (unsigned j = 0; j < iters; j++) {
        add(reopen, times[2 * o->k + j]);
        add(close_ref, times[2 * o->k + iters + j]);
      }
    }
    free(times);
  }
  close(to);
  close(from);
  int st;
  while (waitpid(pid, &st, 0) < 0 && errno == EINTR) {
  }
  for (unsigned i = 0; i < o->k; i++) {
    usmipc_ipc_free_handle(hs[i]);
    usmipc_free(bufs[i]);
  }
  free(hs);
  free(bufs);
  return result;
}

static void bench_size(const options_t *o, usmipc_device_t *dev,
                       usmipc_queue_t *q, size_t size, size_result_t *res) {
  samples_t s[M_COUNT];
  memset(s, 0, sizeof(s));
  memset(res, 0, sizeof(*res));
  res->size = size;

  /* Export: K fresh buffers, K rounds' worth of first exports. */
  for (unsigned round = 0; round < o->rounds; round++) {
    void **bufs = calloc(o->k, sizeof(void *));
    for (unsigned i = 0; i < o->k; i++) {
      int rc = bench_malloc(o, dev, size, &bufs[i]);
      if (rc != 0)
        die("usmipc_malloc", rc);
    }
    for (unsigned i = 0; i < o->k; i++) {
      usmipc_ipc_handle_t *h;
      double t0 = now_us();
      int rc = usmipc_ipc_get_handle(bufs[i], 0, &h);
      double t1 = now_us();
      usmipc_ipc_free_handle(h);
      double t2 = now_us();
      if (rc != 0)
        die("usmipc_ipc_get_handle", rc);
      add(&s[M_EXPORT_FIRST], t1 - t0);
      add(&s[M_FREE_HANDLE], t2 - t1);
    }
    if (round == 0) {
      for (unsigned j = 0; j < o->iters; j++) {
        usmipc_ipc_handle_t *h;
        double t0 = now_us();
        int rc = usmipc_ipc_get_handle(bufs[j % o->k], 0, &h);
        double t1 = now_us();
        usmipc_ipc_free_handle(h);
        double t2 = now_us();
        if (rc != 0)
          die("usmipc_ipc_get_handle (repeat)", rc);
        add(&s[M_EXPORT_REPEAT], t1 - t0);
        add(&s[M_FREE_HANDLE], t2 - t1);
      }
    }
    for (unsigned i = 0; i < o->k; i++)
      usmipc_free(bufs[i]);
    free(bufs);
  }

  /* First opens per transport; the first transport's importer also times
   * cached re-opens in its first round. */
  for (int t = 0; t < o->ntransports; t++) {
    char note[96] = "";
    int failed = 0;
    for (unsigned round = 0; round < o->rounds && !failed; round++) {
      unsigned iters = (t == 0 && round == 0) ? o->iters : 0;
      if (open_round(o, dev, q, size, o->transports[t], iters,
                     &s[M_OPEN_FIRST + t], &s[M_CLOSE_LAST], &s[M_REOPEN],
                     &s[M_CLOSE_REF], note, sizeof(note)) != 0)
        failed = 1;
    }
    res->m[M_OPEN_FIRST + t] = summarize(&s[M_OPEN_FIRST + t]);
    if (failed) {
      res->m[M_OPEN_FIRST + t].valid = 0;
      snprintf(res->m[M_OPEN_FIRST + t].note,
               sizeof(res->m[M_OPEN_FIRST + t].note), "%s", note);
    }
  }
  for (int m = 0; m < M_COUNT; m++) {
    if (m >= M_OPEN_FIRST && m < M_OPEN_FIRST + MAX_TRANSPORTS)
      continue;
    res->m[m] = summarize(&s[m]);
  }
  for (int m = 0; m < M_COUNT; m++)
    free(s[m].v);
}

/* ---- the raw-driver baseline's exporter -----------------------------------
 */

#define RAW_BLOCK ((size_t)2 << 20)

typedef struct raw_result {
  size_t size;
  unsigned handle_kind; /* CUDA_KIND_NATIVE or CUDA_KIND_FD */
  int valid;
  char note[96]; /* why there are no numbers */
  size_t pairs;
  size_t shared_blocks; /* see raw_importer_main; should stay 0 */
  /* Per pair, in buffer order (not sorted), for --json. */
  samples_t open_u, open_r, close_u, close_r;
  samples_t usmipc_first; /* 1: the pair's usmipc call went first */
  summary_t s_open_u, s_open_r, s_close_u, s_close_r;
  /* Per block of pairs (see bench_raw_size): usmipc / raw, and usmipc -
   * raw per call in us. */
  summary_t open_ratio, close_ratio;
  summary_t open_diff, close_diff;
  /* 95% bootstrap confidence intervals of those four medians. */
  double ci[4][2];
} raw_result_t;

static const char *cuda_kind_name(unsigned kind) {
  return kind == CUDA_KIND_NATIVE ? "native"
         : kind == CUDA_KIND_FD   ? "fd"
                                  : "?";
}

static summary_t summarize_copy(const samples_t *s) {
  samples_t c = {NULL, 0, 0};
  for (size_t i = 0; i < s->n; i++)
    add(&c, s->v[i]);
  summary_t r = summarize(&c);
  free(c.v);
  return r;
}

/* One round: 2K + 2 fresh buffers exported with usmipc, one importer that
 * opens them alternately through usmipc and the bare driver. */
/* The seed of a round's order plan: fixed, so that a run can be repeated. */
static uint32_t raw_seed(size_t size, unsigned round) {
  uint64_t h = (uint64_t)size * 0x100000001B3ull ^ (uint64_t)(round + 1);
  return (uint32_t)(h ^ (h >> 32));
}

static int raw_round(const options_t *o, usmipc_device_t *dev, size_t size,
                     unsigned round, raw_result_t *res) {
  unsigned n = 2 * o->k + 2;
  void **bufs = calloc(n, sizeof(void *));
  usmipc_ipc_handle_t **hs = calloc(n, sizeof(*hs));
  if (bufs == NULL || hs == NULL)
    die("out of memory", 0);
  /* cuMemAlloc packs allocations below 2 MiB into shared 2 MiB blocks, and
   * the driver maps a block once per importer: the later opens of buffers
   * in it are reference counts, and which side pays for the block would
   * depend on the order. Each buffer therefore gets its own blocks (the
   * allocation rounded up to 2 MiB, which cuMemCreate does anyway), and
   * the handle exports `size` bytes of it. */
  size_t alloc_size = (size + RAW_BLOCK - 1) / RAW_BLOCK * RAW_BLOCK;
  int result = 0;
  unsigned made = 0;
  for (; made < n; made++) {
    int rc = bench_malloc(o, dev, alloc_size, &bufs[made]);
    if (rc != 0) {
      fprintf(stderr,
              "usmipc_bench: --raw needs 2K + 2 = %u buffers of %zu bytes "
              "at once: buffer %u: %s: %s\n",
              n, alloc_size, made, usmipc_err_name(rc), usmipc_last_error());
      snprintf(res->note, sizeof(res->note), "usmipc_malloc: %s (%u buffers)",
               usmipc_err_name(rc), n);
      result = -1;
      break;
    }
    if ((rc = usmipc_ipc_get_handle(bufs[made], size, &hs[made])) != 0) {
      usmipc_free(bufs[made]);
      fprintf(stderr, "usmipc_bench: usmipc_ipc_get_handle: %s: %s\n",
              usmipc_err_name(rc), usmipc_last_error());
      snprintf(res->note, sizeof(res->note), "usmipc_ipc_get_handle: %s",
               usmipc_err_name(rc));
      result = -1;
      break;
    }
  }
  if (result == 0) {
    const void *data;
    size_t len;
    usmipc_ipc_handle_info_t info;
    usmipc_ipc_handle_data(hs[0], &data, &len);
    if (usmipc_ipc_handle_inspect(data, len, &info) != 0 ||
        (info.handle_kind != CUDA_KIND_NATIVE &&
         info.handle_kind != CUDA_KIND_FD)) {
      snprintf(res->note, sizeof(res->note), "unknown CUDA handle kind");
      result = -1;
    } else {
      res->handle_kind = info.handle_kind;
    }
  }
  if (result != 0) {
    for (unsigned i = 0; i < made; i++) {
      usmipc_ipc_free_handle(hs[i]);
      usmipc_free(bufs[i]);
    }
    free(hs);
    free(bufs);
    return -1;
  }

  int to, from;
  pid_t pid = spawn_importer("--importer-raw", o->transports[0], &to, &from);
#ifdef PR_SET_PTRACER
  /* Under Yama ptrace_scope 1 a child may not take its parent's
   * descriptors with pidfd_getfd(2) unless the parent names it; the raw fd
   * path (and usmipc's pidfd transport) need that. Harmless without Yama. */
  prctl(PR_SET_PTRACER, (unsigned long)pid, 0, 0, 0);
#endif
  uint32_t seed = raw_seed(size, round);
  uint32_t hdr[4] = {n, (uint32_t)usmipc_device_index(dev), o->order, seed};
  int ok = write_full(to, hdr, sizeof(hdr)) == 0;
  for (unsigned i = 0; i < n && ok; i++) {
    const void *data;
    size_t len;
    usmipc_ipc_handle_data(hs[i], &data, &len);
    uint32_t l = (uint32_t)len;
    ok = write_full(to, &l, 4) == 0 && write_full(to, data, len) == 0;
  }
  int32_t status = -1;
  if (ok)
    ok = read_full(from, &status, sizeof(status)) == 0;
  if (!ok) {
    snprintf(res->note, sizeof(res->note), "importer died");
    result = -1;
  } else if (status != 0) {
    char msg[256];
    if (read_full(from, msg, sizeof(msg)) != 0)
      snprintf(msg, sizeof(msg), "importer failed");
    msg[sizeof(msg) - 1] = '\0';
    fprintf(stderr, "usmipc_bench: raw importer: %s\n", msg);
    if (status == RAW_STATUS_EPERM)
      snprintf(res->note, sizeof(res->note),
               "raw fd baseline needs ptrace rights (pidfd_getfd: EPERM)");
    else if (status == RAW_STATUS_FAIL)
      snprintf(res->note, sizeof(res->note), "raw driver path failed");
    else
      snprintf(res->note, sizeof(res->note), "%s", usmipc_err_name(status));
    result = -1;
  } else {
    size_t k = o->k;
    uint32_t shared = 0;
    double *times = calloc(4 * k, sizeof(double));
    if (times == NULL)
      die("out of memory", 0);
    if (read_full(from, &shared, sizeof(shared)) != 0 ||
        read_full(from, times, 4 * k * sizeof(double)) != 0) {
      snprintf(res->note, sizeof(res->note), "importer died");
      result = -1;
    } else {
      res->shared_blocks += shared;
      if (shared > 0)
        fprintf(stderr,
                "usmipc_bench: warning: %u of %zu timed %zu-byte buffers "
                "shared a 2 MiB driver block with another one: their opens "
                "were not all first opens\n",
                shared, 2 * k, size);
      uint8_t *plan = calloc(k, 1);
      if (plan == NULL)
        die("out of memory", 0);
      raw_order_plan(o->order, seed, (uint32_t)k, plan);
      for (size_t i = 0; i < k; i++)
        add(&res->usmipc_first, plan[i]);
      free(plan);
      for (size_t i = 0; i < k; i++) {
        add(&res->open_u, times[i]);
        add(&res->open_r, times[k + i]);
        add(&res->close_u, times[2 * k + i]);
        add(&res->close_r, times[3 * k + i]);
      }
    }
    free(times);
  }
  close(to);
  close(from);
  int st;
  while (waitpid(pid, &st, 0) < 0 && errno == EINTR) {
  }
#ifdef PR_SET_PTRACER
  prctl(PR_SET_PTRACER, 0UL, 0, 0, 0);
#endif
  for (unsigned i = 0; i < n; i++) {
    usmipc_ipc_free_handle(hs[i]);
    usmipc_free(bufs[i]);
  }
  free(hs);
  free(bufs);
  return result;
}

/* Percentile bootstrap of the median: 95% interval, fixed seed. */
static void bootstrap_median_ci(const samples_t *s, double ci[2]) {
  ci[0] = ci[1] = 0;
  if (s->n < 2)
    return;
  enum { B = 2000 };
  double *meds = calloc(B, sizeof(double));
  double *tmp = calloc(s->n, sizeof(double));
  if (meds == NULL || tmp == NULL)
    die("out of memory", 0);
  uint64_t x = 0x853C49E6748FEA9Bull;
  for (int b = 0; b < B; b++) {
    for (size_t i = 0; i < s->n; i++)
      tmp[i] = s->v[xorshift64(&x) % s->n];
    qsort(tmp, s->n, sizeof(double), cmp_double);
    meds[b] = quantile(tmp, s->n, 0.5);
  }
  qsort(meds, B, sizeof(double), cmp_double);
  ci[0] = quantile(meds, B, 0.025);
  ci[1] = quantile(meds, B, 0.975);
  free(meds);
  free(tmp);
}

static void bench_raw_size(const options_t *o, usmipc_device_t *dev,
                           size_t size, raw_result_t *res) {
  memset(res, 0, sizeof(*res));
  res->size = size;
  int failed = 0;
  for (unsigned round = 0; round < o->rounds && !failed; round++)
    failed = raw_round(o, dev, size, round, res) != 0;
  res->valid = !failed;
  if (failed)
    return;
  /* Paired statistics per block of consecutive pairs of one round: a
   * single pair for usmipc-first and raw-first, two pairs (usmipc, raw,
   * raw, usmipc) for abba, where each side has one call in each position,
   * so that an effect of the position cancels: ratio of the block's sums
   * (usmipc / raw) and the mean difference. */
  samples_t ro = {NULL, 0, 0}, rc = {NULL, 0, 0}, dop = {NULL, 0, 0},
            dcl = {NULL, 0, 0};
  size_t b = o->order == RAW_ORDER_ABBA ? 2 : 1;
  res->pairs = res->open_u.n;
  for (size_t base = 0; base + o->k <= res->pairs; base += o->k) {
    for (size_t q = 0; q + b <= o->k; q += b) {
      double ou = 0, orw = 0, cu = 0, cr = 0;
      for (size_t i = base + q; i < base + q + b; i++) {
        ou += res->open_u.v[i];
        orw += res->open_r.v[i];
        cu += res->close_u.v[i];
        cr += res->close_r.v[i];
      }
      if (orw > 0)
        add(&ro, ou / orw);
      if (cr > 0)
        add(&rc, cu / cr);
      add(&dop, (ou - orw) / (double)b);
      add(&dcl, (cu - cr) / (double)b);
    }
  }
  res->s_open_u = summarize_copy(&res->open_u);
  res->s_open_r = summarize_copy(&res->open_r);
  res->s_close_u = summarize_copy(&res->close_u);
  res->s_close_r = summarize_copy(&res->close_r);
  res->open_ratio = summarize(&ro);
  res->close_ratio = summarize(&rc);
  res->open_diff = summarize(&dop);
  res->close_diff = summarize(&dcl);
  bootstrap_median_ci(&ro, res->ci[0]);
  bootstrap_median_ci(&rc, res->ci[1]);
  bootstrap_median_ci(&dop, res->ci[2]);
  bootstrap_median_ci(&dcl, res->ci[3]);
  free(ro.v);
  free(rc.v);
  free(dop.v);
  free(dcl.v);
}

/* ---- output ---------------------------------------------------------------
 */

static void size_label(size_t size, char *out, size_t len) {
  if (size >= (1u << 30) && size % (1u << 30) == 0)
    snprintf(out, len, "%zu GiB", size >> 30);
  else if (size >= (1u << 20) && size % (1u << 20) == 0)
    snprintf(out, len, "%zu MiB", size >> 20);
  else if (size >= 1024 && size % 1024 == 0)
    snprintf(out, len, "%zu KiB", size >> 10);
  else
    snprintf(out, len, "%zu B", size);
}

static void cell(const summary_t *s) {
  if (!s->valid)
    printf(" n/a (%s) |", s->note[0] ? s->note : "not measured");
  else
    printf(" %.2f (%.2f–%.2f) |", s->median, s->p10, s->p90);
}

static const char *metric_key(const options_t *o, int m, char *buf,
                              size_t len) {
  switch (m) {
  case M_EXPORT_FIRST:
    return "export_first";
  case M_EXPORT_REPEAT:
    return "export_repeat";
  case M_FREE_HANDLE:
    return "free_handle";
  case M_REOPEN:
    return "reopen_cached";
  case M_CLOSE_REF:
    return "close_ref";
  case M_CLOSE_LAST:
    return "close_last";
  default:
    if (m - M_OPEN_FIRST < o->ntransports) {
      snprintf(buf, len, "open_first_%s", o->transports[m - M_OPEN_FIRST]);
      return buf;
    }
    return NULL;
  }
}

static void print_table(const options_t *o, const size_result_t *res) {
  printf("| size | export, first | export, repeat | free_handle |");
  for (int t = 0; t < o->ntransports; t++)
    printf(" first open (%s) |", o->transports[t]);
  printf(" re-open (cached) | close (not last) | close (last) |\n");
  printf("|---|---|---|---|");
  for (int t = 0; t < o->ntransports; t++)
    printf("---|");
  printf("---|---|---|\n");
  for (int i = 0; i < o->nsizes; i++) {
    char label[32];
    size_label(res[i].size, label, sizeof(label));
    printf("| %s |", label);
    cell(&res[i].m[M_EXPORT_FIRST]);
    cell(&res[i].m[M_EXPORT_REPEAT]);
    cell(&res[i].m[M_FREE_HANDLE]);
    for (int t = 0; t < o->ntransports; t++)
      cell(&res[i].m[M_OPEN_FIRST + t]);
    cell(&res[i].m[M_REOPEN]);
    cell(&res[i].m[M_CLOSE_REF]);
    cell(&res[i].m[M_CLOSE_LAST]);
    printf("\n");
  }
  printf("\nMedians in microseconds, (p10–p90) in parentheses.\n");
}

static void write_json(const options_t *o, usmipc_device_t *dev,
                       const size_result_t *res) {
  FILE *f = fopen(o->json, "w");
  if (f == NULL) {
    fprintf(stderr, "usmipc_bench: %s: %s\n", o->json, strerror(errno));
    exit(1);
  }
  struct utsname u;
  uname(&u);
  fprintf(f,
          "{\n  \"tool\": \"usmipc_bench\",\n  \"usmipc_version\": \"%s\",\n",
          usmipc_version_string());
  fprintf(f, "  \"device\": \"%s\",\n  \"device_name\": \"%s\",\n",
          usmipc_device_filter_string(dev), usmipc_device_name(dev));
  fprintf(f, "  \"kernel\": \"%s\",\n  \"unit\": \"us\",\n", u.release);
  fprintf(f, "  \"k\": %u,\n  \"rounds\": %u,\n  \"iters\": %u,\n", o->k,
          o->rounds, o->iters);
  fprintf(f, "  \"results\": [\n");
  for (int i = 0; i < o->nsizes; i++) {
    fprintf(f, "    {\"size\": %zu", res[i].size);
    for (int m = 0; m < M_COUNT; m++) {
      char buf[64];
      const char *key = metric_key(o, m, buf, sizeof(buf));
      if (key == NULL)
        continue;
      const summary_t *s = &res[i].m[m];
      if (s->valid)
        fprintf(f,
                ",\n      \"%s\": {\"median\": %.3f, \"p10\": %.3f, "
                "\"p90\": %.3f, \"n\": %zu}",
                key, s->median, s->p10, s->p90, s->n);
      else
        fprintf(f, ",\n      \"%s\": {\"error\": \"%s\"}", key,
                s->note[0] ? s->note : "not measured");
    }
    fprintf(f, "}%s\n", i + 1 < o->nsizes ? "," : "");
  }
  fprintf(f, "  ]\n}\n");
  fclose(f);
}

/* ---- output of --raw ------------------------------------------------------
 */

static int read_yama(char *buf, size_t len) {
  snprintf(buf, len, "absent");
  FILE *f = fopen("/proc/sys/kernel/yama/ptrace_scope", "r");
  if (f == NULL)
    return -1;
  if (fgets(buf, (int)len, f) == NULL)
    snprintf(buf, len, "unreadable");
  buf[strcspn(buf, "\n")] = '\0';
  fclose(f);
  return 0;
}

static void ratio_cell(const summary_t *a, const summary_t *b) {
  if (a->valid && b->valid && b->median > 0)
    printf(" %.3f |", a->median / b->median);
  else
    printf(" n/a |");
}

/* The median and its 95% confidence interval in brackets. */
static void paired_cell(const summary_t *s, const double ci[2],
                        const char *fmt) {
  if (!s->valid) {
    printf(" n/a |");
    return;
  }
  printf(" ");
  printf(fmt, s->median);
  printf(" [");
  printf(fmt, ci[0]);
  printf(", ");
  printf(fmt, ci[1]);
  printf("] |");
}

static void print_raw_table(const options_t *o, const raw_result_t *res) {
  printf("| size | kind | pairs | first open, usmipc | first open, raw | "
         "ratio | paired ratio | paired Δ | close, usmipc | close, raw | "
         "ratio | paired ratio | paired Δ |\n");
  printf("|---|---|---:|---|---|---:|---|---|---|---|---:|---|---|\n");
  for (int i = 0; i < o->nsizes; i++) {
    const raw_result_t *r = &res[i];
    char label[32];
    size_label(r->size, label, sizeof(label));
    if (!r->valid) {
      printf("| %s | %s | 0 | n/a (%s) | n/a | n/a | n/a | n/a | n/a | n/a | "
             "n/a | n/a | n/a |\n",
             label, r->handle_kind ? cuda_kind_name(r->handle_kind) : "?",
             r->note[0] ? r->note : "not measured");
      continue;
    }
    printf("| %s | %s | %zu |", label, cuda_kind_name(r->handle_kind),
           r->pairs);
    cell(&r->s_open_u);
    cell(&r->s_open_r);
    ratio_cell(&r->s_open_u, &r->s_open_r);
    paired_cell(&r->open_ratio, r->ci[0], "%.3f");
    paired_cell(&r->open_diff, r->ci[2], "%+.2f");
    cell(&r->s_close_u);
    cell(&r->s_close_r);
    ratio_cell(&r->s_close_u, &r->s_close_r);
    paired_cell(&r->close_ratio, r->ci[1], "%.3f");
    paired_cell(&r->close_diff, r->ci[3], "%+.2f");
    printf("\n");
  }
  printf("\nTimes in microseconds: median (p10–p90). ratio: usmipc median / "
         "raw median. paired ratio and paired Δ: median [95%% bootstrap "
         "confidence interval] over blocks of consecutive pairs (a pair: one "
         "usmipc and one raw call, "
         "one right after the other in the same importer; a block: %s) of "
         "sum(usmipc) / sum(raw) and of (sum(usmipc) − sum(raw)) / pairs, in "
         "us. 1.05 means usmipc takes 5%% longer.\n",
         o->order == RAW_ORDER_ABBA
             ? "2 pairs, usmipc raw raw usmipc or the reverse, at random, "
               "so that a cost of the position cancels"
             : "1 pair");
  for (int i = 0; i < o->nsizes; i++)
    if (res[i].valid && res[i].shared_blocks > 0)
      printf("\nWarning: at %zu bytes, %zu timed buffers shared a 2 MiB "
             "driver block with another one; their opens were partly "
             "reference counts, not first opens.\n",
             res[i].size, res[i].shared_blocks);
}

static void json_summary_ci(FILE *f, const char *key, const summary_t *s,
                            const double *ci) {
  if (!s->valid) {
    fprintf(f, ",\n      \"%s\": null", key);
    return;
  }
  fprintf(f,
          ",\n      \"%s\": {\"median\": %.4f, \"p10\": %.4f, "
          "\"p90\": %.4f, \"n\": %zu",
          key, s->median, s->p10, s->p90, s->n);
  if (ci)
    fprintf(f, ", \"median_ci95\": [%.4f, %.4f]", ci[0], ci[1]);
  fprintf(f, "}");
}

static void json_summary(FILE *f, const char *key, const summary_t *s) {
  json_summary_ci(f, key, s, NULL);
}

static void json_array(FILE *f, const char *key, const samples_t *s,
                       int decimals) {
  fprintf(f, ",\n        \"%s\": [", key);
  for (size_t i = 0; i < s->n; i++)
    fprintf(f, "%s%.*f", i ? ", " : "", decimals, s->v[i]);
  fprintf(f, "]");
}

static void write_json_raw(const options_t *o, usmipc_device_t *dev,
                           const raw_result_t *res) {
  FILE *f = fopen(o->json, "w");
  if (f == NULL) {
    fprintf(stderr, "usmipc_bench: %s: %s\n", o->json, strerror(errno));
    exit(1);
  }
  struct utsname u;
  uname(&u);
  char yama[32];
  read_yama(yama, sizeof(yama));
  fprintf(f, "{\n  \"tool\": \"usmipc_bench\",\n  \"mode\": \"raw\",\n");
  fprintf(f, "  \"usmipc_version\": \"%s\",\n", usmipc_version_string());
  fprintf(f, "  \"device\": \"%s\",\n  \"device_name\": \"%s\",\n",
          usmipc_device_filter_string(dev), usmipc_device_name(dev));
  fprintf(f, "  \"kernel\": \"%s\",\n  \"unit\": \"us\",\n", u.release);
  fprintf(f, "  \"k\": %u,\n  \"rounds\": %u,\n", o->k, o->rounds);
  fprintf(f, "  \"kind_requested\": \"%s\",\n", o->kind ? o->kind : "default");
  fprintf(f, "  \"fd_transport\": \"%s\",\n", o->transports[0]);
  fprintf(f, "  \"order\": \"%s\",\n", raw_order_names[o->order]);
  fprintf(f, "  \"import_cache_size\": 0,\n");
  fprintf(f, "  \"yama_ptrace_scope\": \"%s\",\n", yama);
  fprintf(f, "  \"results\": [\n");
  for (int i = 0; i < o->nsizes; i++) {
    const raw_result_t *r = &res[i];
    fprintf(f, "    {\"size\": %zu", r->size);
    if (r->handle_kind)
      fprintf(f, ",\n      \"handle_kind\": \"%s\"",
              cuda_kind_name(r->handle_kind));
    if (!r->valid) {
      fprintf(f, ",\n      \"error\": \"%s\"}%s\n",
              r->note[0] ? r->note : "not measured",
              i + 1 < o->nsizes ? "," : "");
      continue;
    }
    fprintf(f, ",\n      \"pairs\": %zu", r->pairs);
    fprintf(f, ",\n      \"allocation_size\": %zu",
            (r->size + RAW_BLOCK - 1) / RAW_BLOCK * RAW_BLOCK);
    fprintf(f, ",\n      \"shared_block_buffers\": %zu", r->shared_blocks);
    json_summary(f, "open_first_usmipc", &r->s_open_u);
    json_summary(f, "open_first_raw", &r->s_open_r);
    fprintf(f, ",\n      \"open_ratio_of_medians\": %.4f",
            r->s_open_u.median / r->s_open_r.median);
    json_summary_ci(f, "open_paired_ratio", &r->open_ratio, r->ci[0]);
    json_summary_ci(f, "open_paired_diff", &r->open_diff, r->ci[2]);
    json_summary(f, "close_usmipc", &r->s_close_u);
    json_summary(f, "close_raw", &r->s_close_r);
    fprintf(f, ",\n      \"close_ratio_of_medians\": %.4f",
            r->s_close_u.median / r->s_close_r.median);
    json_summary_ci(f, "close_paired_ratio", &r->close_ratio, r->ci[1]);
    json_summary_ci(f, "close_paired_diff", &r->close_diff, r->ci[3]);
    fprintf(f, ",\n      \"samples\": {\"index\": \"round * k + pair\"");
    json_array(f, "open_usmipc", &r->open_u, 3);
    json_array(f, "open_raw", &r->open_r, 3);
    json_array(f, "close_usmipc", &r->close_u, 3);
    json_array(f, "close_raw", &r->close_r, 3);
    json_array(f, "usmipc_first", &r->usmipc_first, 0);
    fprintf(f, "}}%s\n", i + 1 < o->nsizes ? "," : "");
  }
  fprintf(f, "  ]\n}\n");
  fclose(f);
}

/* ---- arguments ------------------------------------------------------------
 */

static size_t parse_size(const char *s) {
  char *end;
  unsigned long long v = strtoull(s, &end, 10);
  switch (*end) {
  case 'k':
  case 'K':
    v <<= 10;
    break;
  case 'm':
  case 'M':
    v <<= 20;
    break;
  case 'g':
  case 'G':
    v <<= 30;
    break;
  default:
    break;
  }
  return (size_t)v;
}

static void usage(void) {
  fprintf(
      stderr,
      "usage: usmipc_bench [--device FILTER] [--sizes 4K,1M,64M,256M]\n"
      "                    [--k 40] [--rounds 3] [--iters 2000]\n"
      "                    [--transports socket,pidfd] [--kind fd|native]\n"
      "                    [--json FILE]\n"
      "       usmipc_bench --raw --device cuda[:gpu[:N]] [--kind fd|native]\n"
      "                    [--sizes 4K,1M,64M,256M] [--k 100] [--rounds 3]\n"
      "                    [--transports pidfd] [--order abba] [--json FILE]\n"
      "  --raw   usmipc's first open and close against the bare CUDA\n"
      "          driver calls, paired and interleaved in one importer\n"
      "          (2K + 2 buffers of each size at once)\n"
      "  --order which call of a --raw pair goes first: abba (default:\n"
      "          blocks usmipc raw raw usmipc or the reverse, at random),\n"
      "          usmipc-first or raw-first\n"
      "  --kind  how CUDA memory is allocated and shared: fd (cuMemCreate,\n"
      "          POSIX fd) or native (cuMemAlloc + cuIpcGetMemHandle);\n"
      "          default: the backend's, which USMIPC_CUDA_IPC changes\n");
  exit(2);
}

int main(int argc, char **argv) {
  if (argc == 2 && strcmp(argv[1], "--importer") == 0)
    return importer_main();
  if (argc == 2 && strcmp(argv[1], "--importer-raw") == 0)
    return raw_importer_main();
  signal(SIGPIPE, SIG_IGN);

  options_t o;
  memset(&o, 0, sizeof(o));
  o.device = "host:cpu";
  o.k = 40;
  o.rounds = 3;
  o.iters = 2000;
  static const size_t default_sizes[] = {4 << 10, 1 << 20, 64 << 20, 256 << 20};
  for (int i = 0; i < 4; i++)
    o.sizes[o.nsizes++] = default_sizes[i];
  o.transports[0] = "socket";
  o.transports[1] = "pidfd";
  o.ntransports = 2;
  o.order = RAW_ORDER_ABBA;
  int k_set = 0, transports_set = 0;
  static char sizes_buf[256], transports_buf[128];

  for (int i = 1; i < argc; i++) {
    const char *a = argv[i];
    if (strcmp(a, "-h") == 0 || strcmp(a, "--help") == 0)
      usage();
    if (strcmp(a, "--raw") == 0) {
      o.raw = 1;
      continue;
    }
    const char *v = i + 1 < argc ? argv[i + 1] : NULL;
    if (v == NULL)
      usage();
    i++;
    if (strcmp(a, "--device") == 0) {
      o.device = v;
    } else if (strcmp(a, "--json") == 0) {
      o.json = v;
    } else if (strcmp(a, "--k") == 0) {
      o.k = (unsigned)strtoul(v, NULL, 10);
      k_set = 1;
    } else if (strcmp(a, "--rounds") == 0) {
      o.rounds = (unsigned)strtoul(v, NULL, 10);
    } else if (strcmp(a, "--iters") == 0) {
      o.iters = (unsigned)strtoul(v, NULL, 10);
    } else if (strcmp(a, "--sizes") == 0) {
      snprintf(sizes_buf, sizeof(sizes_buf), "%s", v);
      o.nsizes = 0;
      for (char *tok = strtok(sizes_buf, ","); tok && o.nsizes < MAX_SIZES;
           tok = strtok(NULL, ","))
        o.sizes[o.nsizes++] = parse_size(tok);
    } else if (strcmp(a, "--transports") == 0) {
      snprintf(transports_buf, sizeof(transports_buf), "%s", v);
      o.ntransports = 0;
      for (char *tok = strtok(transports_buf, ",");
           tok && o.ntransports < MAX_TRANSPORTS; tok = strtok(NULL, ","))
        o.transports[o.ntransports++] = tok;
      transports_set = 1;
    } else if (strcmp(a, "--order") == 0) {
      unsigned m = 0;
      while (m < 3 && strcmp(v, raw_order_names[m]) != 0)
        m++;
      if (m == 3) {
        fprintf(stderr,
                "usmipc_bench: --order takes usmipc-first, raw-first "
                "or abba, not '%s'\n",
                v);
        return 2;
      }
      o.order = m;
    } else if (strcmp(a, "--kind") == 0) {
      if (strcmp(v, "fd") == 0) {
        o.alloc_flags = USMIPC_ALLOC_IPC_FD;
      } else if (strcmp(v, "native") == 0) {
        o.alloc_flags = USMIPC_ALLOC_IPC_NATIVE;
      } else if (strcmp(v, "default") == 0) {
        o.alloc_flags = 0;
        v = NULL;
      } else {
        fprintf(stderr,
                "usmipc_bench: --kind takes fd, native or default, "
                "not '%s'\n",
                v);
        return 2;
      }
      o.kind = v;
    } else {
      usage();
    }
  }
  if (o.raw) {
    /* 2K + 2 buffers per round: K pairs and the two warm-up buffers. */
    if (!k_set)
      o.k = 100;
    /* Both sides take descriptors the same way by default: the raw fd path
     * uses pidfd_getfd(2), so usmipc does too. */
    if (!transports_set) {
      o.transports[0] = "pidfd";
      o.ntransports = 1;
    }
    if (o.ntransports > 1) {
      fprintf(stderr, "usmipc_bench: --raw takes one fd transport for usmipc's "
                      "side (--transports pidfd, socket or auto)\n");
      return 2;
    }
  }
  if (o.k == 0 || o.rounds == 0 || o.nsizes == 0 || o.ntransports == 0)
    usage();
  for (int i = 0; i < o.nsizes; i++)
    if (o.sizes[i] == 0)
      usage();

  usmipc_device_t *dev;
  int rc = usmipc_device_select(o.device, &dev);
  if (rc != 0 && o.raw) {
    fprintf(stderr,
            "usmipc_bench: --raw needs a CUDA device, and '%s' gives none: "
            "%s (%s)\n",
            o.device, usmipc_err_name(rc), usmipc_last_error());
    return 1;
  }
  if (rc != 0)
    die(o.device, rc);
  if (o.raw && usmipc_device_backend(dev) != USMIPC_BACKEND_CUDA) {
    fprintf(stderr,
            "usmipc_bench: --raw needs a CUDA device (it compares usmipc with "
            "the bare CUDA driver calls): pass --device cuda[:gpu[:N]], not "
            "%s\n",
            usmipc_device_filter_string(dev));
    return 1;
  }
  if (!usmipc_device_has_ipc(dev)) {
    fprintf(stderr, "usmipc_bench: %s does not support IPC memory\n", o.device);
    return 1;
  }
  usmipc_queue_t *q;
  if ((rc = usmipc_queue_create(dev, &q)) != 0)
    die("usmipc_queue_create", rc);

  /* Warm-up: the first export of the process starts the fd broker, a
   * one-time cost that belongs to no single export. */
  void *warm = NULL;
  usmipc_ipc_handle_t *wh = NULL;
  if ((rc = bench_malloc(&o, dev, 4096, &warm)) != 0 ||
      (rc = usmipc_ipc_get_handle(warm, 0, &wh)) != 0)
    die("warm-up export", rc);
  usmipc_ipc_free_handle(wh);
  usmipc_free(warm);

  printf("# usmipc_bench %s on %s (%s)\n\n", usmipc_version_string(),
         usmipc_device_filter_string(dev), usmipc_device_name(dev));
  if (o.raw) {
    char yama[32];
    read_yama(yama, sizeof(yama));
    printf("Raw-driver baseline: per round 2K + 2 = %u fresh buffers of each "
           "size (memory kind: %s; each allocation rounded up to 2 MiB so "
           "that no two share a driver block), all exported with usmipc; "
           "one importer "
           "opens buffer 2i with usmipc_ipc_open and buffer 2i+1 with the "
           "bare driver calls, alternately, after one untimed warm-up of "
           "each. K = %u pairs per round, %u rounds; order within a pair: "
           "%s; usmipc's fd transport: %s; importer cache size 0 (close "
           "unmaps); Yama ptrace_scope: %s.\n\n",
           2 * o.k + 2, o.kind ? o.kind : "backend default", o.k, o.rounds,
           raw_order_names[o.order], o.transports[0], yama);
    fflush(stdout);
    raw_result_t *res = calloc((size_t)o.nsizes, sizeof(raw_result_t));
    if (res == NULL)
      die("out of memory", 0);
    int any_ok = 0;
    for (int i = 0; i < o.nsizes; i++) {
      bench_raw_size(&o, dev, o.sizes[i], &res[i]);
      any_ok |= res[i].valid;
    }
    print_raw_table(&o, res);
    if (o.json)
      write_json_raw(&o, dev, res);
    for (int i = 0; i < o.nsizes; i++) {
      free(res[i].open_u.v);
      free(res[i].open_r.v);
      free(res[i].close_u.v);
      free(res[i].close_r.v);
      free(res[i].usmipc_first.v);
    }
    free(res);
    usmipc_queue_destroy(q);
    return any_ok ? 0 : 1;
  }
  printf("K = %u fresh buffers per first-open round, %u rounds, %u "
         "iterations for repeat export and cached re-open.\n\n",
         o.k, o.rounds, o.iters);
  fflush(stdout);

  size_result_t res[MAX_SIZES];
  for (int i = 0; i < o.nsizes; i++)
    bench_size(&o, dev, q, o.sizes[i], &res[i]);
  print_table(&o, res);
  if (o.json)
    write_json(&o, dev, res);
  usmipc_queue_destroy(q);
  return 0;
}
