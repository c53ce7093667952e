/* The bare CUDA driver calls that --raw pairs usmipc with (paired.c).
 *
 * The path reads usmipc's handle bytes (docs/handle-format.md) and, with
 * the primary context pushed once:
 *  - native handles (kind 1): cuIpcOpenMemHandle_v2(LAZY_ENABLE_PEER_ACCESS)
 *    on the 64 payload bytes; close: cuIpcCloseMemHandle;
 *  - fd handles (kind 2): pidfd_open + pidfd_getfd + close(pidfd) +
 *    cuMemImportFromShareableHandle + cuMemAddressReserve + cuMemMap +
 *    cuMemSetAccess + cuMemRelease + close(fd), timed as one (what usmipc's
 *    fd import does, minus its checks); close: cuMemUnmap + cuMemAddressFree.
 *
 * The CUDA driver comes through dlopen, like src/backend/cuda.c, with the
 * backend's declarations of cuda.h's types (src/backend/cuda_driver.h), so
 * that the benchmark builds without the CUDA toolkit. */
#include <dlfcn.h>
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "harness.h"
#include "ipc.h"
#include "usmipc.h"

/* The driver types and constants, shared with the backend. */
#include "backend/cuda_driver.h"

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

/* Handle kinds and offsets of docs/handle-format.md, wire version 2
 * (cuda_check refuses another version, and a pid that is not where it
 * should be, so that a format change cannot go unnoticed again: the
 * offsets of version 1 stayed here after version 2 moved them). */
enum {
  WIRE_VERSION = 2,
  WIRE_BACKEND = 12,
  WIRE_KIND = 13,
  WIRE_FLAGS = 14,
  WIRE_PID = 24,
  WIRE_FD_NUMBER = 28,
  WIRE_PAYLOAD_LEN = 208,
  WIRE_PAYLOAD = 212,
  WIRE_BACKEND_CUDA = 2,
  CUDA_KIND_NATIVE = 1,
  CUDA_KIND_FD = 2,
};

/* The importer's state, set by check and setup. */
static unsigned kind;      /* CUDA_KIND_*: every handle's */
static CUdevice dev;       /* the device of setup's ordinal */
static size_t granularity; /* fd handles: cuMemCreate's minimum granularity */

static uint32_t le32(const uint8_t *p) {
  return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 |
         (uint32_t)p[3] << 24;
}

static uint64_t le64(const uint8_t *p) {
  return (uint64_t)le32(p) | (uint64_t)le32(p + 4) << 32;
}

static const char *cu_name(CUresult res) {
  const char *name = NULL;
  if (rawcu.cuGetErrorName == NULL || rawcu.cuGetErrorName(res, &name) != 0 ||
      name == NULL)
    return "?";
  return name;
}

static const char *cuda_kind_name(unsigned handle_kind) {
  return handle_kind == CUDA_KIND_NATIVE ? "native"
         : handle_kind == CUDA_KIND_FD   ? "fd"
                                         : NULL;
}

static int cuda_check(uint32_t i, const uint8_t *h,
                      const usmipc_ipc_handle_info_t *info, char *msg,
                      size_t len) {
  if (info->wire_version != WIRE_VERSION ||
      le32(h + WIRE_PID) != info->exporter_pid) {
    snprintf(msg, len,
             "handle %u: wire version %u (exporter pid %u, %u at byte %d): "
             "the raw path reads version %d (docs/handle-format.md); "
             "update its offsets",
             i, info->wire_version, info->exporter_pid, le32(h + WIRE_PID),
             (int)WIRE_PID, (int)WIRE_VERSION);
    return RAW_STATUS_FAIL;
  }
  if (info->backend != USMIPC_BACKEND_CUDA ||
      h[WIRE_BACKEND] != WIRE_BACKEND_CUDA ||
      h[WIRE_KIND] != info->handle_kind ||
      (i > 0 && info->handle_kind != kind)) {
    snprintf(msg, len, "handle %u: not a CUDA handle of kind %u", i, kind);
    return RAW_STATUS_FAIL;
  }
  kind = info->handle_kind;
  unsigned plen = h[WIRE_PAYLOAD_LEN] | (unsigned)h[WIRE_PAYLOAD_LEN + 1] << 8;
  unsigned fd_flag = h[WIRE_FLAGS] & 1u;
  if (!(kind == CUDA_KIND_NATIVE && plen == 64 && !fd_flag) &&
      !(kind == CUDA_KIND_FD && plen == 8 && fd_flag)) {
    snprintf(msg, len,
             "handle %u: CUDA handle kind %u with a %u-byte payload and "
             "FD flag %u: not what the raw path knows",
             i, kind, plen, fd_flag);
    return RAW_STATUS_FAIL;
  }
  return 0;
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

/* The driver, the device and its primary context (the one usmipc uses too)
 * made current once. */
static int cuda_setup(uint32_t ordinal, char *msg, size_t len) {
  int status = raw_cuda_load(msg, len);
  if (status != 0)
    return status;
  CUcontext ctx = NULL;
  const char *what = "cuInit";
  CUresult res = rawcu.cuInit(0);
  if (res == CUDA_SUCCESS) {
    what = "cuDeviceGet";
    res = rawcu.cuDeviceGet(&dev, (int)ordinal);
  }
  if (res == CUDA_SUCCESS) {
    what = "cuDevicePrimaryCtxRetain";
    res = rawcu.cuDevicePrimaryCtxRetain(&ctx, dev);
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
    prop.location.id = dev;
    what = "cuMemGetAllocationGranularity";
    res = rawcu.cuMemGetAllocationGranularity(&granularity, &prop,
                                              CU_MEM_ALLOC_GRANULARITY_MINIMUM);
    if (res == CUDA_SUCCESS && granularity == 0)
      granularity = 2u << 20;
  }
  if (res != CUDA_SUCCESS) {
    snprintf(msg, len, "raw: %s failed: %s (CUDA error %d)", what, cu_name(res),
             res);
    return RAW_STATUS_FAIL;
  }
  return 0;
}

/* Opens handle h (already validated by usmipc_ipc_handle_inspect and
 * cuda_check) through the bare driver calls; *us gets the time of the
 * timed part. */
static int cuda_open(const uint8_t *h, raw_mapping_t *m, double *us, char *msg,
                     size_t len) {
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
      .location = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = dev},
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
      res = rawcu.cuMemAddressReserve(&p, size, granularity, 0, 0);
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

static int cuda_close(const raw_mapping_t *m, double *us, char *msg,
                      size_t len) {
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

const raw_peer_t raw_peer_cuda = {
    .name = "CUDA",
    .backend = USMIPC_BACKEND_CUDA,
    .device_hint = "cuda[:gpu[:N]]",
    /* cuMemAlloc packs allocations below 2 MiB into shared 2 MiB blocks;
     * cuMemCreate rounds up to 2 MiB anyway. */
    .block = (size_t)2 << 20,
    .kind_name = cuda_kind_name,
    .check = cuda_check,
    .setup = cuda_setup,
    .open = cuda_open,
    .close = cuda_close,
};
