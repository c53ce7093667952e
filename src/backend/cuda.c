/* The CUDA backend, over the driver API loaded with dlopen("libcuda.so.1") at
 * first use: no link-time dependency, no CUDA toolkit needed to build. The
 * few driver types used are declared here with their documented layouts.
 * Without a driver, probe() reports the backend unavailable with the reason.
 *
 * Device memory is shared in one of two forms (docs/cuda.md):
 *  - CUDA_HANDLE_NATIVE: cuMemAlloc + cuIpcGetMemHandle. The 64-byte driver
 *    handle travels in the payload; it names the whole allocation, so the
 *    offset travels in the handle's own fields. Also used for memory that
 *    other libraries allocated (torch, CuPy), resolved through pointer
 *    attributes.
 *  - CUDA_HANDLE_FD: cuMemCreate with POSIX_FILE_DESCRIPTOR handles,
 *    exported with cuMemExportToShareableHandle and moved by the core's fd
 *    transport. The importer's mapping keeps the memory alive after the
 *    exporter frees it or exits. Also used for VMM memory other libraries
 *    mapped chunk by chunk (PyTorch's expandable segments): a run of k
 *    chunks travels as k descriptors, and the importer maps them back to
 *    back into one reserved range (docs/cuda.md).
 *
 * Floor 3 of the core (backends, beside the transport): the core reaches
 * it only through its ops table (backend.h). Its length serves that one
 * concern, the CUDA driver: the two forms of shared memory, runs of VMM
 * chunks, events, and the driver's own error codes read into sentences. */
#include <dlfcn.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "backend/backend.h"
#include "backend/cuda_copy.h"
#include "util/blake2s.h"

#include "cuda_driver.h"

#define CUDA_EVENT_IPC 1 /* event payload: the 64-byte CUipcEventHandle */

/* One list of driver entry points drives the typedefs, the function
 * pointers and the dlsym loop (libfabric's habit). Versioned names are
 * spelled out: cuda.h maps cuMemAlloc to cuMemAlloc_v2 by macro, and dlsym
 * sees no macros. */
#define CUDA_SYMBOLS(X)                                                        \
  X(cuInit, "cuInit", (unsigned))                                              \
  X(cuGetErrorString, "cuGetErrorString", (CUresult, const char **))           \
  X(cuGetErrorName, "cuGetErrorName", (CUresult, const char **))               \
  X(cuDriverGetVersion, "cuDriverGetVersion", (int *))                         \
  X(cuDeviceGetCount, "cuDeviceGetCount", (int *))                             \
  X(cuDeviceGet, "cuDeviceGet", (CUdevice *, int))                             \
  X(cuDeviceGetName, "cuDeviceGetName", (char *, int, CUdevice))               \
  X(cuDeviceGetUuid, "cuDeviceGetUuid_v2", (CUuuid *, CUdevice))               \
  X(cuDeviceGetAttribute, "cuDeviceGetAttribute", (int *, int, CUdevice))      \
  X(cuDeviceTotalMem, "cuDeviceTotalMem_v2", (size_t *, CUdevice))             \
  X(cuDeviceCanAccessPeer, "cuDeviceCanAccessPeer",                            \
    (int *, CUdevice, CUdevice))                                               \
  X(cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain",                      \
    (CUcontext *, CUdevice))                                                   \
  X(cuCtxPushCurrent, "cuCtxPushCurrent_v2", (CUcontext))                      \
  X(cuCtxPopCurrent, "cuCtxPopCurrent_v2", (CUcontext *))                      \
  X(cuCtxEnablePeerAccess, "cuCtxEnablePeerAccess", (CUcontext, unsigned))     \
  X(cuMemAlloc, "cuMemAlloc_v2", (CUdeviceptr *, size_t))                      \
  X(cuMemFree, "cuMemFree_v2", (CUdeviceptr))                                  \
  X(cuMemHostAlloc, "cuMemHostAlloc", (void **, size_t, unsigned))             \
  X(cuMemFreeHost, "cuMemFreeHost", (void *))                                  \
  X(cuMemAllocManaged, "cuMemAllocManaged", (CUdeviceptr *, size_t, unsigned)) \
  X(cuPointerGetAttributes, "cuPointerGetAttributes",                          \
    (unsigned, int *, void **, CUdeviceptr))                                   \
  X(cuPointerGetAttribute, "cuPointerGetAttribute",                            \
    (void *, int, CUdeviceptr))                                                \
  X(cuMemGetAddressRange, "cuMemGetAddressRange_v2",                           \
    (CUdeviceptr *, size_t *, CUdeviceptr))                                    \
  X(cuStreamCreate, "cuStreamCreate", (CUstream *, unsigned))                  \
  X(cuStreamDestroy, "cuStreamDestroy_v2", (CUstream))                         \
  X(cuStreamSynchronize, "cuStreamSynchronize", (CUstream))                    \
  X(cuStreamQuery, "cuStreamQuery", (CUstream))                                \
  X(cuStreamWaitEvent, "cuStreamWaitEvent", (CUstream, CUevent, unsigned))     \
  X(cuEventCreate, "cuEventCreate", (CUevent *, unsigned))                     \
  X(cuEventDestroy, "cuEventDestroy_v2", (CUevent))                            \
  X(cuEventRecord, "cuEventRecord", (CUevent, CUstream))                       \
  X(cuEventQuery, "cuEventQuery", (CUevent))                                   \
  X(cuIpcGetEventHandle, "cuIpcGetEventHandle", (CUipcEventHandle *, CUevent)) \
  X(cuIpcOpenEventHandle, "cuIpcOpenEventHandle",                              \
    (CUevent *, CUipcEventHandle))                                             \
  X(cuMemcpyAsync, "cuMemcpyAsync",                                            \
    (CUdeviceptr, CUdeviceptr, size_t, CUstream))                              \
  X(cuMemsetD8Async, "cuMemsetD8Async",                                        \
    (CUdeviceptr, unsigned char, size_t, CUstream))                            \
  X(cuIpcGetMemHandle, "cuIpcGetMemHandle", (CUipcMemHandle *, CUdeviceptr))   \
  X(cuIpcOpenMemHandle, "cuIpcOpenMemHandle_v2",                               \
    (CUdeviceptr *, CUipcMemHandle, unsigned))                                 \
  X(cuIpcCloseMemHandle, "cuIpcCloseMemHandle", (CUdeviceptr))                 \
  X(cuMemGetAllocationGranularity, "cuMemGetAllocationGranularity",            \
    (size_t *, const CUmemAllocationProp *, int))                              \
  X(cuMemCreate, "cuMemCreate",                                                \
    (CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *,      \
     unsigned long long))                                                      \
  X(cuMemRelease, "cuMemRelease", (CUmemGenericAllocationHandle))              \
  X(cuMemAddressReserve, "cuMemAddressReserve",                                \
    (CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long))          \
  X(cuMemAddressFree, "cuMemAddressFree", (CUdeviceptr, size_t))               \
  X(cuMemMap, "cuMemMap",                                                      \
    (CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle,                \
     unsigned long long))                                                      \
  X(cuMemUnmap, "cuMemUnmap", (CUdeviceptr, size_t))                           \
  X(cuMemSetAccess, "cuMemSetAccess",                                          \
    (CUdeviceptr, size_t, const CUmemAccessDesc *, size_t))                    \
  X(cuMemExportToShareableHandle, "cuMemExportToShareableHandle",              \
    (void *, CUmemGenericAllocationHandle, int, unsigned long long))           \
  X(cuMemImportFromShareableHandle, "cuMemImportFromShareableHandle",          \
    (CUmemGenericAllocationHandle *, void *, int))                             \
  X(cuMemRetainAllocationHandle, "cuMemRetainAllocationHandle",                \
    (CUmemGenericAllocationHandle *, void *))                                  \
  X(cuMemGetAllocationPropertiesFromHandle,                                    \
    "cuMemGetAllocationPropertiesFromHandle",                                  \
    (CUmemAllocationProp *, CUmemGenericAllocationHandle))

static struct {
#define X(field, symbol, args) CUresult(*field) args;
  CUDA_SYMBOLS(X)
#undef X
} cu;

/* How an allocation or mapping was made (usmipc__allocation_t.how). */
enum {
  HOW_MEM_ALLOC = 1,   /* cuMemAlloc */
  HOW_VMM = 2,         /* cuMemCreate + map; native is the handle */
  HOW_HOST = 3,        /* cuMemHostAlloc */
  HOW_MANAGED = 4,     /* cuMemAllocManaged */
  HOW_IPC_NATIVE = 5,  /* cuIpcOpenMemHandle mapping */
  HOW_IPC_FD = 6,      /* imported VMM mapping */
  HOW_FOREIGN_VMM = 7, /* another library's VMM chunk (pointer_query) */
  HOW_IPC_CHUNKS = 8,  /* imported run of chunks; native: its chunk_sizes_t */
};

/* Handle kinds in the wire payload (docs/handle-format.md). */
enum {
  CUDA_HANDLE_NATIVE = 1, /* 64 bytes: CUipcMemHandle */
  CUDA_HANDLE_FD = 2,     /* 8 bytes: u64 size of the physical allocation */
};

typedef struct cuda_device {
  CUdevice dev;
  int ordinal;
  int fd_ipc;         /* cuMemCreate with POSIX fds works here */
  size_t granularity; /* cuMemCreate's minimum granularity */
  pthread_mutex_t lock;
  CUcontext ctx; /* primary context, retained on first use */
  int ctx_error;
} cuda_device_t;

#define MAX_CUDA_DEVICES 16
static cuda_device_t cuda_devices[MAX_CUDA_DEVICES];
static int cuda_device_count;
static int default_ipc_fd = 1; /* see docs/cuda.md for why fd is the default */

static int cu_fail(CUresult res, const char *what) {
  const char *name = "?", *text = "unknown error";
  if (cu.cuGetErrorName)
    cu.cuGetErrorName(res, &name);
  if (cu.cuGetErrorString)
    cu.cuGetErrorString(res, &text);
  int code = res == CUDA_ERROR_OUT_OF_MEMORY ? USMIPC_ENOMEM : USMIPC_EBACKEND;
  return usmipc__fail_native(code, res, "%s failed: %s (%s, CUDA error %d)",
                             what, text, name, res);
}

/* Makes the device's primary context current for the calling thread until
 * ctx_leave(); the primary context is the one PyTorch, CuPy and the runtime
 * API use, so pointers are shared with them. */
static int ctx_enter(cuda_device_t *d) {
  if (d->ctx == NULL) {
    pthread_mutex_lock(&d->lock);
    if (d->ctx == NULL && d->ctx_error == 0) {
      CUcontext ctx;
      CUresult res = cu.cuDevicePrimaryCtxRetain(&ctx, d->dev);
      if (res == CUDA_SUCCESS)
        __atomic_store_n(&d->ctx, ctx, __ATOMIC_RELEASE);
      else
        d->ctx_error = res;
    }
    pthread_mutex_unlock(&d->lock);
    if (d->ctx == NULL)
      return cu_fail(d->ctx_error, "cuDevicePrimaryCtxRetain");
  }
  CUresult res = cu.cuCtxPushCurrent(d->ctx);
  return res == CUDA_SUCCESS ? 0 : cu_fail(res, "cuCtxPushCurrent");
}

static void ctx_leave(void) {
  CUcontext ignored;
  cu.cuCtxPopCurrent(&ignored);
}

static size_t round_up(size_t n, size_t to) { return (n + to - 1) / to * to; }

/* ---- probe --------------------------------------------------------------- */

static int cuda_probe(usmipc__device_desc_t *devices, int max, char *reason,
                      size_t reason_len) {
  const char *env = getenv("USMIPC_CUDA_IPC");
  if (env && !strcmp(env, "native"))
    default_ipc_fd = 0;
  else if (env && env[0] != '\0' && strcmp(env, "fd") != 0)
    usmipc__env_malformed("USMIPC_CUDA_IPC", env, "fd or native", "fd");
  void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (lib == NULL) {
    snprintf(reason, reason_len, "libcuda.so.1 not found (%s)", dlerror());
    return USMIPC_EUNAVAILABLE;
  }
#define X(field, symbol, args)                                                 \
  *(void **)&cu.field = dlsym(lib, symbol);                                    \
  if (cu.field == NULL) {                                                      \
    snprintf(reason, reason_len,                                               \
             "the CUDA driver lacks %s (driver too old for CUDA 11.2+)",       \
             symbol);                                                          \
    return USMIPC_EUNAVAILABLE;                                                \
  }
  CUDA_SYMBOLS(X)
#undef X
  CUresult res = cu.cuInit(0);
  if (res != CUDA_SUCCESS) {
    const char *text = "unknown error";
    cu.cuGetErrorString(res, &text);
    snprintf(reason, reason_len, "cuInit failed: %s (CUDA error %d)", text,
             res);
    return res == CUDA_ERROR_NO_DEVICE ? 0 : USMIPC_EUNAVAILABLE;
  }
  int count = 0;
  cu.cuDeviceGetCount(&count);
  if (count > MAX_CUDA_DEVICES)
    count = MAX_CUDA_DEVICES;
  if (count > max)
    count = max;
  for (int i = 0; i < count; i++) {
    cuda_device_t *d = &cuda_devices[i];
    usmipc__device_desc_t *desc = &devices[i];
    int uva = 0, vmm = 0, posix_fd = 0;
    cu.cuDeviceGet(&d->dev, i);
    d->ordinal = i;
    pthread_mutex_init(&d->lock, NULL);
    cu.cuDeviceGetName(desc->name, (int)sizeof(desc->name), d->dev);
    CUuuid uuid;
    cu.cuDeviceGetUuid(&uuid, d->dev);
    memcpy(desc->uuid, uuid.bytes, 16);
    cu.cuDeviceGetAttribute(&uva, CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING,
                            d->dev);
    cu.cuDeviceGetAttribute(
        &vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, d->dev);
    cu.cuDeviceGetAttribute(
        &posix_fd,
        CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
        d->dev);
    d->fd_ipc = vmm && posix_fd;
    if (d->fd_ipc) {
      CUmemAllocationProp prop = {
          .type = CU_MEM_ALLOCATION_TYPE_PINNED,
          .requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
          .location = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = d->dev}};
      if (cu.cuMemGetAllocationGranularity(&d->granularity, &prop,
                                           CU_MEM_ALLOC_GRANULARITY_MINIMUM) !=
              CUDA_SUCCESS ||
          d->granularity == 0)
        d->fd_ipc = 0;
    }
    /* Legacy IPC needs unified addressing (Linux, 64-bit); fd IPC needs VMM
     * with POSIX fd handles. Either makes the device IPC-capable. */
    desc->type = USMIPC_DEVICE_GPU;
    desc->supports_ipc = uva || d->fd_ipc;
    desc->native = d;
  }
  cuda_device_count = count;
  if (count == 0)
    snprintf(reason, reason_len, "the CUDA driver reports no devices");
  return count;
}

/* ---- memory -------------------------------------------------------------- */

/* Reserves address space for a physical allocation, maps it and makes it
 * readable and writable from device dev; undoes what it did on failure.
 * *what names the call that failed. */
static CUresult vmm_map(CUmemGenericAllocationHandle handle, size_t size,
                        size_t alignment, CUdevice dev, CUdeviceptr *out,
                        const char **what) {
  CUdeviceptr p = 0;
  *what = "cuMemAddressReserve";
  CUresult res = cu.cuMemAddressReserve(&p, size, alignment, 0, 0);
  if (res != CUDA_SUCCESS)
    return res;
  *what = "cuMemMap";
  res = cu.cuMemMap(p, size, 0, handle, 0);
  if (res == CUDA_SUCCESS) {
    CUmemAccessDesc access = {
        .location = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = dev},
        .flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
    *what = "cuMemSetAccess";
    res = cu.cuMemSetAccess(p, size, &access, 1);
    if (res != CUDA_SUCCESS)
      cu.cuMemUnmap(p, size);
  }
  if (res != CUDA_SUCCESS) {
    cu.cuMemAddressFree(p, size);
    return res;
  }
  *out = p;
  return CUDA_SUCCESS;
}

static int vmm_alloc(cuda_device_t *d, size_t nbytes,
                     usmipc__allocation_t *out) {
  CUmemAllocationProp prop = {
      .type = CU_MEM_ALLOCATION_TYPE_PINNED,
      .requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
      .location = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = d->dev}};
  if (nbytes > SIZE_MAX - d->granularity)
    return usmipc__fail(USMIPC_ENOMEM, "%zu bytes is more than any GPU has",
                        nbytes);
  size_t size = round_up(nbytes, d->granularity);
  CUmemGenericAllocationHandle handle;
  CUdeviceptr p = 0;
  CUresult res = cu.cuMemCreate(&handle, size, &prop, 0);
  if (res != CUDA_SUCCESS)
    return cu_fail(res, "cuMemCreate");
  const char *what = "";
  res = vmm_map(handle, size, d->granularity, d->dev, &p, &what);
  if (res != CUDA_SUCCESS) {
    cu.cuMemRelease(handle);
    return cu_fail(res, what);
  }
  out->base = (void *)(uintptr_t)p;
  out->size = nbytes;
  out->reserved = size;
  out->how = HOW_VMM;
  out->native = handle;
  return 0;
}

static int cuda_mem_alloc(void *dev, usmipc_mem_kind_t kind, size_t nbytes,
                          unsigned flags, usmipc__allocation_t *out) {
  cuda_device_t *d = dev;
  int rc = ctx_enter(d);
  if (rc != 0)
    return rc;
  CUresult res = CUDA_SUCCESS;
  const char *what = "";
  if (kind == USMIPC_MEM_DEVICE) {
    int fd = (flags & USMIPC_ALLOC_IPC_FD) ||
             (!(flags & USMIPC_ALLOC_IPC_NATIVE) && default_ipc_fd);
    if (fd && !d->fd_ipc && (flags & USMIPC_ALLOC_IPC_FD)) {
      ctx_leave();
      return usmipc__fail(USMIPC_ENOTSUP,
                          "this GPU or driver cannot export memory as POSIX "
                          "file descriptors; allocate with "
                          "USMIPC_ALLOC_IPC_NATIVE");
    }
    if (fd && d->fd_ipc) {
      rc = vmm_alloc(d, nbytes, out);
      ctx_leave();
      return rc;
    }
    CUdeviceptr p;
    what = "cuMemAlloc";
    res = cu.cuMemAlloc(&p, nbytes);
    out->base = (void *)(uintptr_t)p;
    out->how = HOW_MEM_ALLOC;
  } else if (kind == USMIPC_MEM_HOST) {
    what = "cuMemHostAlloc";
    res = cu.cuMemHostAlloc(&out->base, nbytes, CU_MEMHOSTALLOC_PORTABLE);
    out->how = HOW_HOST;
  } else {
    CUdeviceptr p;
    what = "cuMemAllocManaged";
    res = cu.cuMemAllocManaged(&p, nbytes, CU_MEM_ATTACH_GLOBAL);
    out->base = (void *)(uintptr_t)p;
    out->how = HOW_MANAGED;
  }
  ctx_leave();
  if (res != CUDA_SUCCESS)
    return cu_fail(res, what);
  out->size = nbytes;
  out->reserved = nbytes;
  return 0;
}

static int cuda_mem_free(void *dev, usmipc__allocation_t *a) {
  cuda_device_t *d = dev;
  int rc = ctx_enter(d);
  if (rc != 0)
    return rc;
  CUresult res = CUDA_SUCCESS;
  CUdeviceptr p = (CUdeviceptr)(uintptr_t)a->base;
  switch (a->how) {
  case HOW_VMM:
    cu.cuMemUnmap(p, a->reserved);
    cu.cuMemAddressFree(p, a->reserved);
    res = cu.cuMemRelease((CUmemGenericAllocationHandle)a->native);
    break;
  case HOW_HOST:
    res = cu.cuMemFreeHost(a->base);
    break;
  default:
    res = cu.cuMemFree(p);
  }
  ctx_leave();
  if (a->fd >= 0)
    close(a->fd);
  a->fd = -1;
  return res == CUDA_SUCCESS ? 0 : cu_fail(res, "freeing CUDA memory");
}

/* ---- memory of other libraries ------------------------------------------
 * cudaMalloc memory (torch's default allocator, CuPy's) is one driver
 * allocation around any pointer, shared with cuIpcGetMemHandle. VMM memory
 * (cuMemCreate + cuMemMap: PyTorch's expandable segments, cuda.core's VMM
 * resources) is physical chunks mapped into a reserved range; for it
 * cuPointerGetAttributes' RANGE_START_ADDR / RANGE_SIZE describe the whole
 * reservation (cuda.h: "not necessarily the address of the mapped region"),
 * cuIpcGetMemHandle refuses it, and each chunk is shared on its own, as a
 * descriptor, if its allocator asked for a shareable handle type. */

/* One physical chunk of another library's VMM memory, as mapped here. */
typedef struct vmm_chunk {
  CUdeviceptr base;
  size_t size;
  uint64_t id;
  int handle_types; /* the CUmemAllocationHandleType bits it was made with */
  int location_type, location_id;
} vmm_chunk_t;

/* A chunk's identity in handles and import caches, never reused: the
 * driver's buffer id of the mapping (unique over the process's life,
 * cuda.h), mixed with the physical allocation's block id where the driver
 * knows it, the mapping's range and the allocation handle. The mix guards
 * against a driver whose buffer ids turned out to name the reservation,
 * which would make every chunk of a segment look alike. */
static uint64_t vmm_chunk_id(unsigned long long buffer_id,
                             unsigned long long block_id, CUdeviceptr base,
                             size_t size, CUmemGenericAllocationHandle h) {
  uint8_t msg[16 + 5 * 8];
  memcpy(msg, "usmipc-vmmchunk1", 16);
  usmipc__put64le(msg + 16, buffer_id);
  usmipc__put64le(msg + 24, block_id);
  usmipc__put64le(msg + 32, base);
  usmipc__put64le(msg + 40, size);
  usmipc__put64le(msg + 48, h);
  uint8_t out[8];
  usmipc__blake2s_t st;
  usmipc__blake2s_init(&st, sizeof(out), NULL, 0);
  usmipc__blake2s_update(&st, msg, sizeof(msg));
  usmipc__blake2s_final(&st, out);
  uint64_t id = 0;
  for (int i = 7; i >= 0; i--)
    id = id << 8 | out[i];
  return id != 0 ? id : 1;
}

/* Describes the chunk mapped at p (its device's context current): 1 when p is
 * not VMM memory (the driver has no allocation handle for it), 0 with *c, or a
 * failure. With verify, the range cuMemGetAddressRange reports must be one
 * mapping of the allocation behind p: the driver documents that call for
 * cuMemAlloc memory only (for VMM memory it reports the mapping, which is
 * what UCX's cuda_ipc relies on too), and a run built from a wrong range
 * would map the wrong bytes in the importer. */
static int vmm_chunk_at(CUdeviceptr p, bool verify, vmm_chunk_t *c) {
  CUmemGenericAllocationHandle h = 0;
  /* Retaining adds a reference to the allocation (cuda.h): every success
   * below is paired with a cuMemRelease. */
  if (cu.cuMemRetainAllocationHandle(&h, (void *)(uintptr_t)p) != CUDA_SUCCESS)
    return 1;
  CUmemAllocationProp prop;
  memset(&prop, 0, sizeof(prop));
  CUdeviceptr base = 0;
  size_t size = 0;
  unsigned long long buffer_id = 0, block_id = 0;
  const char *what = "cuMemGetAllocationPropertiesFromHandle";
  CUresult res = cu.cuMemGetAllocationPropertiesFromHandle(&prop, h);
  if (res == CUDA_SUCCESS) {
    what = "cuMemGetAddressRange";
    res = cu.cuMemGetAddressRange(&base, &size, p);
  }
  if (res == CUDA_SUCCESS) {
    what = "cuPointerGetAttribute(BUFFER_ID)";
    res = cu.cuPointerGetAttribute(&buffer_id, CU_POINTER_ATTRIBUTE_BUFFER_ID,
                                   base);
  }
  /* Optional: an older driver may not know the attribute. */
  if (res == CUDA_SUCCESS &&
      cu.cuPointerGetAttribute(&block_id, CU_POINTER_ATTRIBUTE_MEMORY_BLOCK_ID,
                               base) != CUDA_SUCCESS)
    block_id = 0;
  bool one_mapping =
      res == CUDA_SUCCESS && size > 0 && p >= base && p - base < size;
  for (int end = 0; verify && one_mapping && end < 2; end++) {
    CUmemGenericAllocationHandle other = 0;
    CUdeviceptr at = end ? base + size - 1 : base;
    if (cu.cuMemRetainAllocationHandle(&other, (void *)(uintptr_t)at) !=
        CUDA_SUCCESS) {
      one_mapping = false;
      break;
    }
    one_mapping = other == h;
    cu.cuMemRelease(other);
  }
  cu.cuMemRelease(h);
  if (res != CUDA_SUCCESS)
    return cu_fail(res, what);
  if (!one_mapping)
    return usmipc__fail(USMIPC_ENOTSUP,
                        "cannot tell the physical chunk of CUDA virtual "
                        "memory at %p: the driver reports the range %p + %zu "
                        "bytes, which is not one mapping of the allocation "
                        "there; share a copy in memory usmipc allocates",
                        (void *)(uintptr_t)p, (void *)(uintptr_t)base, size);
  c->base = base;
  c->size = size;
  c->handle_types = prop.requestedHandleTypes;
  c->location_type = prop.location.type;
  c->location_id = prop.location.id;
  c->id = vmm_chunk_id(buffer_id, block_id, base, size, h);
  return 0;
}

/* Pointers from other libraries: the driver knows the allocation around any
 * device pointer, and its buffer id, which changes when an address is
 * reused. VMM memory (not legacy-IPC capable, with an allocation handle)
 * is described by the chunk that holds the pointer. */
static int cuda_pointer_query(const void *ptr, usmipc__allocation_t *out,
                              uint64_t *buffer_id, int *device_index) {
  if (cuda_device_count == 0)
    return USMIPC_EUNKNOWNPTR;
  unsigned memtype = 0, managed = 0, legacy = 0;
  int ordinal = -1;
  unsigned long long id = 0;
  CUdeviceptr start = 0;
  size_t size = 0;
  int attrs[] = {CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
                 CU_POINTER_ATTRIBUTE_IS_MANAGED,
                 CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                 CU_POINTER_ATTRIBUTE_BUFFER_ID,
                 CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
                 CU_POINTER_ATTRIBUTE_RANGE_SIZE,
                 CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE};
  void *data[] = {&memtype, &managed, &ordinal, &id, &start, &size, &legacy};
  if (cu.cuPointerGetAttributes(7, attrs, data, (CUdeviceptr)(uintptr_t)ptr) !=
          CUDA_SUCCESS ||
      memtype == 0 || ordinal < 0 || size == 0)
    return USMIPC_EUNKNOWNPTR;
  out->fd = -1;
  out->chunked = false;
  if (memtype == CU_MEMORYTYPE_DEVICE && !managed && !legacy &&
      ordinal < cuda_device_count && ctx_enter(&cuda_devices[ordinal]) == 0) {
    vmm_chunk_t c = {0};
    int rc = vmm_chunk_at((CUdeviceptr)(uintptr_t)ptr, false, &c);
    ctx_leave();
    if (rc == 0) {
      out->base = (void *)(uintptr_t)c.base;
      out->size = c.size;
      out->reserved = c.size;
      out->how = HOW_FOREIGN_VMM;
      out->kind = USMIPC_MEM_DEVICE;
      out->chunked = true;
      *buffer_id = c.id;
      *device_index = ordinal;
      return 0;
    }
    /* Not VMM memory (a stream-ordered pool's, say): described as the
     * driver's range, and refused at export by cuIpcGetMemHandle. */
  }
  out->base = (void *)(uintptr_t)start;
  out->size = size;
  out->reserved = size;
  out->how = managed                         ? HOW_MANAGED
             : memtype == CU_MEMORYTYPE_HOST ? HOW_HOST
                                             : HOW_MEM_ALLOC;
  out->kind = managed                         ? USMIPC_MEM_SHARED
              : memtype == CU_MEMORYTYPE_HOST ? USMIPC_MEM_HOST
                                              : USMIPC_MEM_DEVICE;
  *buffer_id = id;
  *device_index = ordinal;
  return 0;
}

/* Why a chunk's allocator made it unshareable, and what to do (in one
 * message of at most 511 bytes). */
static int refuse_unshareable(const void *ptr, int types) {
  const char *why = (types & CU_MEM_HANDLE_TYPE_FABRIC)
                        ? "fabric handles only, which usmipc does not carry"
                        : "no shareable handle type";
  return usmipc__fail(
      USMIPC_ENOTSUP,
      "cannot export %p: it is CUDA virtual memory (cuMemCreate) made with "
      "%s (requestedHandleTypes 0x%x), which cannot travel as a file "
      "descriptor; have its allocator request "
      "CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR (PyTorch 2.5+ does for "
      "expandable segments unless fabric handles work), set "
      "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False, or share a copy in "
      "a usmipc pool (MemoryPool, usmipc_pool_malloc)",
      ptr, why, (unsigned)types);
}

static int cuda_foreign_chunks(void *dev, const void *ptr, size_t nbytes,
                               usmipc__chunk_run_t *run) {
  cuda_device_t *d = dev;
  CUdeviceptr pos = (CUdeviceptr)(uintptr_t)ptr, end = pos + nbytes;
  run->count = 0;
  run->size = 0;
  int rc = ctx_enter(d);
  if (rc != 0)
    return rc;
  while (rc == 0 && pos < end) {
    vmm_chunk_t c = {0};
    if (run->count == USMIPC__CHUNKS_MAX) {
      rc = usmipc__fail(
          USMIPC_ENOTSUP,
          "cannot export %zu bytes at %p: they span more than "
          "%d physical chunks of CUDA virtual memory (%llu "
          "bytes each here), the most one handle carries; "
          "export them in parts of at most %llu bytes, or "
          "copy them into memory usmipc allocates",
          nbytes, ptr, USMIPC__CHUNKS_MAX, (unsigned long long)run->sizes[0],
          (unsigned long long)run->sizes[0] * (USMIPC__CHUNKS_MAX - 1));
      break;
    }
    rc = vmm_chunk_at(pos, true, &c);
    if (rc == 1)
      rc = usmipc__fail(USMIPC_ERANGE,
                        "cannot export %zu bytes at %p: the CUDA virtual "
                        "memory there is mapped only up to %p",
                        nbytes, ptr, (void *)(uintptr_t)pos);
    else if (rc == 0 && run->count > 0 && c.base != pos)
      rc = usmipc__fail(USMIPC_EBACKEND,
                        "the driver reports a chunk of CUDA virtual memory "
                        "at %p that starts inside the previous one",
                        (void *)(uintptr_t)c.base);
    else if (rc == 0 &&
             !(c.handle_types & CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR))
      rc = refuse_unshareable(ptr, c.handle_types);
    else if (rc == 0 && (c.location_type != CU_MEM_LOCATION_TYPE_DEVICE ||
                         c.location_id != d->ordinal))
      rc = usmipc__fail(USMIPC_ENOTSUP,
                        "cannot export %p: a chunk of its CUDA virtual "
                        "memory lives on another device than GPU %d (location "
                        "type %d, id %d)",
                        ptr, d->ordinal, c.location_type, c.location_id);
    if (rc != 0)
      break;
    if (run->count == 0)
      run->base = (void *)(uintptr_t)c.base;
    run->sizes[run->count] = c.size;
    run->ids[run->count] = c.id;
    run->fds[run->count] = -1;
    run->count++;
    run->size += c.size;
    pos = c.base + c.size;
  }
  ctx_leave();
  return rc;
}

/* ---- queues -------------------------------------------------------------- */

static int cuda_queue_create(void *dev, void **queue) {
  int rc = ctx_enter(dev);
  if (rc != 0)
    return rc;
  CUstream s;
  CUresult res = cu.cuStreamCreate(&s, CU_STREAM_NON_BLOCKING);
  ctx_leave();
  if (res != CUDA_SUCCESS)
    return cu_fail(res, "cuStreamCreate");
  *queue = s;
  return 0;
}

static int cuda_queue_destroy(void *dev, void *queue) {
  int rc = ctx_enter(dev);
  if (rc != 0)
    return rc;
  CUresult res = cu.cuStreamDestroy(queue);
  ctx_leave();
  return res == CUDA_SUCCESS ? 0 : cu_fail(res, "cuStreamDestroy");
}

static int cuda_queue_synchronize(void *dev, void *queue) {
  int rc = ctx_enter(dev);
  if (rc != 0)
    return rc;
  CUresult res = cu.cuStreamSynchronize(queue);
  ctx_leave();
  return res == CUDA_SUCCESS ? 0 : cu_fail(res, "cuStreamSynchronize");
}

/* The current context matters for the legacy NULL stream (torch's default
 * stream), which is the context's own. */
static int cuda_queue_idle(void *dev, void *queue) {
  int rc = ctx_enter(dev);
  if (rc != 0)
    return rc;
  CUresult res = cu.cuStreamQuery(queue);
  ctx_leave();
  if (res == CUDA_SUCCESS)
    return 1;
  return res == CUDA_ERROR_NOT_READY ? 0 : cu_fail(res, "cuStreamQuery");
}

static int cuda_memcpy(void *dev, void *queue, void *dst, const void *src,
                       size_t n) {
  int rc = ctx_enter(dev);
  if (rc != 0)
    return rc;
  /* With unified addressing the driver infers the direction. */
  CUresult res = cu.cuMemcpyAsync((CUdeviceptr)(uintptr_t)dst,
                                  (CUdeviceptr)(uintptr_t)src, n, queue);
  ctx_leave();
  return res == CUDA_SUCCESS ? 0 : cu_fail(res, "cuMemcpyAsync");
}

static int cuda_memset(void *dev, void *queue, void *dst, int value, size_t n) {
  int rc = ctx_enter(dev);
  if (rc != 0)
    return rc;
  CUresult res = cu.cuMemsetD8Async((CUdeviceptr)(uintptr_t)dst,
                                    (unsigned char)value, n, queue);
  ctx_leave();
  return res == CUDA_SUCCESS ? 0 : cu_fail(res, "cuMemsetD8Async");
}

/* ---- batched copies (cuda_copy.c) ------------------------------------------
 * With the device's context current, as every call of this file. */

static int cuda_copy_batch_create(void *dev, void **batch) {
  (void)dev;
  return usmipc__cuda_copy_create((usmipc__cuda_copy_t **)batch);
}

static int cuda_copy_batch_run(void *dev, void *batch, void *queue,
                               const usmipc__copy_t *copies, size_t count,
                               bool same) {
  int rc = ctx_enter(dev);
  if (rc != 0)
    return rc;
  rc = usmipc__cuda_copy_run(batch, queue, copies, count, same);
  ctx_leave();
  return rc;
}

static int cuda_copy_batch_destroy(void *dev, void *batch) {
  int rc = ctx_enter(dev);
  if (rc != 0)
    return rc;
  usmipc__cuda_copy_destroy(batch);
  ctx_leave();
  return 0;
}

/* ---- events ---------------------------------------------------------------
 * Interprocess events (CU_EVENT_INTERPROCESS needs DISABLE_TIMING). An
 * imported event is a CUevent like a local one: cuEventDestroy closes it.
 * The stream of a wrapped queue is whatever the caller passed (NULL is the
 * legacy default stream). */

static int cuda_event_create(void *dev, void **event) {
  int rc = ctx_enter(dev);
  if (rc != 0)
    return rc;
  CUevent ev;
  CUresult res =
      cu.cuEventCreate(&ev, CU_EVENT_DISABLE_TIMING | CU_EVENT_INTERPROCESS);
  ctx_leave();
  if (res != CUDA_SUCCESS)
    return cu_fail(res, "cuEventCreate");
  *event = ev;
  return 0;
}

static int cuda_event_destroy(void *dev, void *event) {
  int rc = ctx_enter(dev);
  if (rc != 0)
    return rc;
  CUresult res = cu.cuEventDestroy(event);
  ctx_leave();
  return res == CUDA_SUCCESS ? 0 : cu_fail(res, "cuEventDestroy");
}

static int cuda_event_record(void *dev, void *event, void *queue) {
  int rc = ctx_enter(dev);
  if (rc != 0)
    return rc;
  CUresult res = cu.cuEventRecord(event, queue);
  ctx_leave();
  return res == CUDA_SUCCESS ? 0 : cu_fail(res, "cuEventRecord");
}

static int cuda_event_query(void *dev, void *event) {
  (void)dev; /* cuEventQuery needs no current context */
  CUresult res = cu.cuEventQuery(event);
  if (res == CUDA_SUCCESS)
    return 1;
  return res == CUDA_ERROR_NOT_READY ? 0 : cu_fail(res, "cuEventQuery");
}

static int cuda_event_wait(void *dev, void *event, void *queue) {
  int rc = ctx_enter(dev);
  if (rc != 0)
    return rc;
  CUresult res = cu.cuStreamWaitEvent(queue, event, 0);
  ctx_leave();
  return res == CUDA_SUCCESS ? 0 : cu_fail(res, "cuStreamWaitEvent");
}

static int cuda_event_export(void *dev, void *event, usmipc__payload_t *payload,
                             int *fd_to_share) {
  *fd_to_share = -1;
  int rc = ctx_enter(dev);
  if (rc != 0)
    return rc;
  CUipcEventHandle h;
  CUresult res = cu.cuIpcGetEventHandle(&h, event);
  ctx_leave();
  if (res != CUDA_SUCCESS)
    return cu_fail(res, "cuIpcGetEventHandle");
  payload->handle_kind = CUDA_EVENT_IPC;
  payload->len = sizeof(h);
  memcpy(payload->bytes, &h, sizeof(h));
  return 0;
}

static int cuda_event_import(void *dev, void *owner,
                             const usmipc__payload_t *payload, int fd,
                             void **event) {
  (void)owner; /* the event opens in the waiting device's context */
  (void)fd;
  if (payload->len != sizeof(CUipcEventHandle))
    return usmipc__fail(USMIPC_EBADHANDLE,
                        "not a valid usmipc event handle: a CUDA event "
                        "payload has 64 bytes, this one %u",
                        (unsigned)payload->len);
  int rc = ctx_enter(dev);
  if (rc != 0)
    return rc;
  CUipcEventHandle h;
  memcpy(&h, payload->bytes, sizeof(h));
  CUevent ev;
  CUresult res = cu.cuIpcOpenEventHandle(&ev, h);
  ctx_leave();
  if (res != CUDA_SUCCESS)
    return cu_fail(res, "cuIpcOpenEventHandle");
  *event = ev;
  return 0;
}

/* A wrapped stream is the CUstream itself: nothing to make or release. */
static int cuda_queue_wrap(void *dev, void *native, void **queue) {
  (void)dev;
  *queue = native;
  return 0;
}

static int cuda_queue_unwrap(void *dev, void *queue) {
  (void)dev;
  (void)queue;
  return 0;
}

/* ---- IPC ----------------------------------------------------------------- */

static void put_u64(uint8_t *p, uint64_t v) {
  for (int i = 0; i < 8; i++)
    p[i] = (uint8_t)(v >> (8 * i));
}
static uint64_t get_u64(const uint8_t *p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; i--)
    v = v << 8 | p[i];
  return v;
}

static int cuda_ipc_export(void *dev, usmipc__allocation_t *a,
                           usmipc__payload_t *payload, int *fd_to_share) {
  cuda_device_t *d = dev;
  *fd_to_share = -1;
  if (a->how == HOW_VMM) {
    if (a->fd < 0) {
      int fd = -1;
      CUresult res = cu.cuMemExportToShareableHandle(
          &fd, (CUmemGenericAllocationHandle)a->native,
          CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
      if (res != CUDA_SUCCESS)
        return cu_fail(res, "cuMemExportToShareableHandle");
      a->fd = fd;
    }
    payload->handle_kind = CUDA_HANDLE_FD;
    payload->len = 8;
    put_u64(payload->bytes, a->reserved);
    *fd_to_share = a->fd;
    return 0;
  }
  if (a->how != HOW_MEM_ALLOC)
    return usmipc__fail(USMIPC_EMEMKIND,
                        "only device memory can be exported, not pinned host "
                        "or managed memory");
  int rc = ctx_enter(d);
  if (rc != 0)
    return rc;
  CUipcMemHandle h;
  CUresult res = cu.cuIpcGetMemHandle(&h, (CUdeviceptr)(uintptr_t)a->base);
  ctx_leave();
  if (res != CUDA_SUCCESS)
    return cu_fail(res, "cuIpcGetMemHandle (memory from a stream-ordered pool "
                        "such as cudaMallocAsync cannot be exported this way)");
  payload->handle_kind = CUDA_HANDLE_NATIVE;
  payload->len = sizeof(h);
  memcpy(payload->bytes, &h, sizeof(h));
  return 0;
}

/* A descriptor for each chunk of a run foreign_chunks described. Each
 * chunk is looked up again first: if its allocator unmapped it and mapped
 * another at the same address meanwhile, its identity changed, and the run
 * no longer describes the memory the caller meant. */
static int cuda_chunks_export(void *dev, usmipc__chunk_run_t *run,
                              usmipc__payload_t *payload) {
  int rc = ctx_enter(dev);
  if (rc != 0)
    return rc;
  CUdeviceptr at = (CUdeviceptr)(uintptr_t)run->base;
  uint32_t i;
  for (i = 0; i < run->count && rc == 0; at += run->sizes[i], i++) {
    vmm_chunk_t c = {0};
    CUmemGenericAllocationHandle h = 0;
    int fd = -1;
    rc = vmm_chunk_at(at, false, &c);
    if (rc == 1 || (rc == 0 && (c.id != run->ids[i] || c.base != at ||
                                c.size != run->sizes[i]))) {
      rc = usmipc__fail(USMIPC_EUNKNOWNPTR,
                        "the CUDA virtual memory at %p changed while it was "
                        "being exported (its allocator unmapped it: was the "
                        "tensor freed?)",
                        (void *)(uintptr_t)at);
      break;
    }
    if (rc != 0)
      break;
    CUresult res = cu.cuMemRetainAllocationHandle(&h, (void *)(uintptr_t)at);
    if (res == CUDA_SUCCESS) {
      res = cu.cuMemExportToShareableHandle(
          &fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
      cu.cuMemRelease(h);
    }
    if (res != CUDA_SUCCESS) {
      rc = cu_fail(res, "cuMemExportToShareableHandle");
      break;
    }
    /* Ours alone: no child of an exec inherits it. */
    fcntl(fd, F_SETFD, FD_CLOEXEC);
    run->fds[i] = fd;
  }
  ctx_leave();
  if (rc != 0) {
    for (uint32_t j = 0; j < run->count; j++) {
      if (run->fds[j] >= 0)
        close(run->fds[j]);
      run->fds[j] = -1;
    }
    return rc;
  }
  /* The payload of an fd handle: the size of what to map. One chunk is an
   * ordinary fd handle; a run adds the chunk record (the core's). */
  payload->handle_kind = CUDA_HANDLE_FD;
  payload->len = 8;
  payload->ext_len = 0;
  put_u64(payload->bytes, run->size);
  return 0;
}

/* owner NULL: the exporting GPU is hidden from this process
 * (CUDA_VISIBLE_DEVICES), so cuDeviceCanAccessPeer cannot be asked; the
 * driver maps such memory for d all the same where the two GPUs have peer
 * access (documented for cuIpcOpenMemHandle; cuMemImportFromShareableHandle
 * and cuMemSetAccess for d do the same, as NCCL's P2P transport relies on),
 * and its refusal is worded by hidden_fail below. */
static int check_peer(cuda_device_t *d, cuda_device_t *owner) {
  if (d == owner || owner == NULL)
    return 0;
  int can = 0;
  cu.cuDeviceCanAccessPeer(&can, d->dev, owner->dev);
  if (!can)
    return usmipc__fail(USMIPC_ENOTSUP,
                        "GPU %d cannot access the memory of GPU %d (no peer "
                        "access between them); open the handle on GPU %d",
                        d->ordinal, owner->ordinal, owner->ordinal);
  return 0;
}

/* A driver failure mapping memory of a GPU this process cannot see. */
static int hidden_fail(const cuda_device_t *d, CUresult res, const char *what) {
  int rc = cu_fail(res, what);
  usmipc__error_prefix("the exporting GPU is hidden from this process "
                       "(CUDA_VISIBLE_DEVICES) and the driver could not map "
                       "its memory for GPU %d (no peer access between them?): ",
                       d->ordinal);
  return rc;
}

/* The granularity of an allocation's GPU: the owner's, or for a hidden
 * owner this GPU's (2 MiB on every GPU with VMM so far; a multiple of the
 * larger of two power-of-two granularities is one of the smaller). */
static size_t owner_granularity(const cuda_device_t *d,
                                const cuda_device_t *owner) {
  return owner != NULL ? owner->granularity : d->granularity;
}

/* Legacy opens and closes of one allocation go one at a time: an open
 * racing a close of the same allocation on another thread is where
 * ipc_no_leak_uncached crashed (SIGSEGV, rarely, on the H200; its stack was
 * never caught, and tests/gpu/probe_native_open_close.c, which races the
 * driver's calls alone, saw no crash in 96,000 of them). The locks are
 * striped by the driver handle's bytes, which name the allocation: opens of
 * different allocations run side by side, which the driver takes
 * faster than one at a time (2.3-5.1x in the probe, 8 threads, driver 580). A
 * mapping keeps its stripe in `native` for its close. */
enum { NATIVE_IPC_STRIPES = 64 };
static pthread_mutex_t native_ipc_locks[NATIVE_IPC_STRIPES] = {
    [0 ... NATIVE_IPC_STRIPES - 1] = PTHREAD_MUTEX_INITIALIZER};

static unsigned native_ipc_stripe(const CUipcMemHandle *h) {
  uint32_t x = 2166136261u; /* FNV-1a */
  for (size_t i = 0; i < sizeof(h->reserved); i++)
    x = (x ^ (uint8_t)h->reserved[i]) * 16777619u;
  return x % NATIVE_IPC_STRIPES;
}

static int cuda_ipc_import(void *dev, void *owner_dev,
                           const usmipc__payload_t *payload, int fd,
                           uint64_t allocation_size,
                           usmipc__allocation_t *out) {
  cuda_device_t *d = dev, *owner = owner_dev;
  int rc = check_peer(d, owner);
  if (rc != 0)
    return rc;
  if (payload->handle_kind == CUDA_HANDLE_NATIVE) {
    if (payload->len != sizeof(CUipcMemHandle))
      return usmipc__fail(USMIPC_EBADHANDLE, "CUDA handle payload of %u bytes",
                          payload->len);
    CUipcMemHandle h;
    memcpy(&h, payload->bytes, sizeof(h));
    if ((rc = ctx_enter(d)) != 0)
      return rc;
    CUdeviceptr p = 0;
    const unsigned stripe = native_ipc_stripe(&h);
    pthread_mutex_lock(&native_ipc_locks[stripe]);
    CUresult res =
        cu.cuIpcOpenMemHandle(&p, h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS);
    size_t mapped = 0;
    if (res == CUDA_SUCCESS) {
      /* The driver handle names a whole allocation, but the size comes from
       * our own fields, which a forger controls: the mapping must cover it. */
      int attr = CU_POINTER_ATTRIBUTE_RANGE_SIZE;
      void *data = &mapped;
      if (cu.cuPointerGetAttributes(1, &attr, &data, p) != CUDA_SUCCESS ||
          mapped < allocation_size) {
        cu.cuIpcCloseMemHandle(p);
        pthread_mutex_unlock(&native_ipc_locks[stripe]);
        ctx_leave();
        return usmipc__fail(USMIPC_EBADHANDLE,
                            "not a valid usmipc IPC handle: it claims a "
                            "%llu-byte allocation but the driver mapped %zu "
                            "bytes",
                            (unsigned long long)allocation_size, mapped);
      }
    }
    pthread_mutex_unlock(&native_ipc_locks[stripe]);
    ctx_leave();
    /* Another thread of ours maps this allocation now (it opened it first,
     * or is closing it: the core drops a mapping from its registry under
     * its lock and unmaps it just after). The core takes that mapping, or
     * tries again once it is gone. */
    if (res == CUDA_ERROR_ALREADY_MAPPED)
      return USMIPC__IMPORT_BUSY;
    if (res == CUDA_ERROR_INVALID_HANDLE)
      return usmipc__fail_native(USMIPC_EEXPORTERGONE, res,
                                 "cuIpcOpenMemHandle refused the handle "
                                 "(CUDA error 400): the exporter has exited or "
                                 "freed the allocation");
    if (res != CUDA_SUCCESS)
      return owner == NULL ? hidden_fail(d, res, "cuIpcOpenMemHandle")
                           : cu_fail(res, "cuIpcOpenMemHandle");
    out->base = (void *)(uintptr_t)p;
    out->size = (size_t)allocation_size;
    out->reserved = (size_t)allocation_size;
    out->how = HOW_IPC_NATIVE;
    out->native = stripe; /* for the close */
    out->kind = USMIPC_MEM_DEVICE;
    return 0;
  }
  if (payload->handle_kind != CUDA_HANDLE_FD || payload->len != 8 || fd < 0)
    return usmipc__fail(USMIPC_EBADHANDLE, "CUDA handle of unknown kind %u",
                        payload->handle_kind);
  size_t size = (size_t)get_u64(payload->bytes);
  size_t granularity = owner_granularity(d, owner);
  if (size < allocation_size || size % granularity != 0)
    return usmipc__fail(USMIPC_EBADHANDLE,
                        "CUDA fd handle maps %zu bytes, not a granule multiple "
                        "covering %llu",
                        size, (unsigned long long)allocation_size);
  if ((rc = ctx_enter(d)) != 0)
    return rc;
  CUmemGenericAllocationHandle handle;
  CUdeviceptr p = 0;
  const char *what = "cuMemImportFromShareableHandle";
  CUresult res = cu.cuMemImportFromShareableHandle(
      &handle, (void *)(intptr_t)fd, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
  if (res == CUDA_SUCCESS) {
    /* Mapped for the target device d: for memory of another GPU that is
     * the peer mapping. */
    res = vmm_map(handle, size, granularity, d->dev, &p, &what);
    /* The mapping holds its own reference to the physical memory. */
    cu.cuMemRelease(handle);
  }
  ctx_leave();
  if (res != CUDA_SUCCESS)
    return owner == NULL ? hidden_fail(d, res, what) : cu_fail(res, what);
  out->base = (void *)(uintptr_t)p;
  out->size = (size_t)allocation_size;
  out->reserved = size;
  out->how = HOW_IPC_FD;
  out->kind = USMIPC_MEM_DEVICE;
  return 0;
}

/* What an imported run keeps for its unmap: each chunk is unmapped on its
 * own (cuMemUnmap takes whole mappings, cuda.h). */
typedef struct chunk_sizes {
  uint32_t count;
  uint64_t sizes[];
} chunk_sizes_t;

static void unmap_chunks(CUdeviceptr p, const uint64_t *sizes, uint32_t n) {
  for (uint32_t i = 0; i < n; p += sizes[i], i++)
    cu.cuMemUnmap(p, sizes[i]);
}

/* A run of chunks another process exported: one reservation, each chunk
 * imported and mapped at its offset, then one cuMemSetAccess over the whole
 * range (which may span several mappings: PyTorch's expandable segments
 * set access the same way). */
static int cuda_ipc_import_chunks(void *dev, void *owner_dev,
                                  const usmipc__payload_t *payload,
                                  const int *fds, const uint64_t *sizes,
                                  uint32_t count, uint64_t allocation_size,
                                  usmipc__allocation_t *out) {
  cuda_device_t *d = dev, *owner = owner_dev;
  int rc = check_peer(d, owner);
  if (rc != 0)
    return rc;
  size_t granularity = owner_granularity(d, owner);
  uint64_t total = 0;
  for (uint32_t i = 0; i < count; i++) {
    if (sizes[i] == 0 || sizes[i] % granularity != 0)
      return usmipc__fail(USMIPC_EBADHANDLE,
                          "not a valid usmipc IPC handle: chunk %u of %llu "
                          "bytes is not a multiple of the GPU's %zu-byte "
                          "granularity",
                          i, (unsigned long long)sizes[i], granularity);
    total += sizes[i]; /* the decoder bounded the sum by the allocation */
  }
  if (payload->handle_kind != CUDA_HANDLE_FD || payload->len != 8 ||
      get_u64(payload->bytes) != total || total != allocation_size || count < 2)
    return usmipc__fail(USMIPC_EBADHANDLE,
                        "not a valid usmipc IPC handle: a CUDA handle of %u "
                        "chunks (%llu bytes) whose payload disagrees",
                        count, (unsigned long long)total);
  chunk_sizes_t *keep = malloc(sizeof(*keep) + count * sizeof(uint64_t));
  if (keep == NULL)
    return usmipc__fail(USMIPC_ENOMEM, "out of memory");
  keep->count = count;
  memcpy(keep->sizes, sizes, count * sizeof(uint64_t));
  if ((rc = ctx_enter(d)) != 0) {
    free(keep);
    return rc;
  }
  CUdeviceptr p = 0;
  const char *what = "cuMemAddressReserve";
  CUresult res = cu.cuMemAddressReserve(&p, (size_t)total, granularity, 0, 0);
  uint32_t mapped = 0;
  uint64_t at = 0;
  while (res == CUDA_SUCCESS && mapped < count) {
    CUmemGenericAllocationHandle h;
    what = "cuMemImportFromShareableHandle";
    res = cu.cuMemImportFromShareableHandle(
        &h, (void *)(intptr_t)fds[mapped],
        CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    if (res != CUDA_SUCCESS)
      break;
    what = "cuMemMap";
    res = cu.cuMemMap(p + at, (size_t)sizes[mapped], 0, h, 0);
    /* The mapping holds its own reference to the physical memory. */
    cu.cuMemRelease(h);
    if (res == CUDA_SUCCESS)
      at += sizes[mapped++];
  }
  if (res == CUDA_SUCCESS) {
    /* Mapped for the target device d: for memory of another GPU that is
     * the peer mapping. */
    CUmemAccessDesc access = {
        .location = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = d->dev},
        .flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
    what = "cuMemSetAccess";
    res = cu.cuMemSetAccess(p, (size_t)total, &access, 1);
  }
  if (res != CUDA_SUCCESS && p != 0) {
    unmap_chunks(p, sizes, mapped);
    cu.cuMemAddressFree(p, (size_t)total);
  }
  ctx_leave();
  if (res != CUDA_SUCCESS) {
    free(keep);
    return owner == NULL ? hidden_fail(d, res, what) : cu_fail(res, what);
  }
  out->base = (void *)(uintptr_t)p;
  out->size = (size_t)allocation_size;
  out->reserved = (size_t)total;
  out->how = HOW_IPC_CHUNKS;
  out->kind = USMIPC_MEM_DEVICE;
  out->native = (uint64_t)(uintptr_t)keep;
  return 0;
}

static int cuda_ipc_unmap(void *dev, usmipc__allocation_t *m) {
  int rc = ctx_enter(dev);
  if (rc != 0)
    return rc;
  CUdeviceptr p = (CUdeviceptr)(uintptr_t)m->base;
  CUresult res;
  if (m->how == HOW_IPC_NATIVE) {
    pthread_mutex_t *lock = &native_ipc_locks[m->native % NATIVE_IPC_STRIPES];
    pthread_mutex_lock(lock);
    res = cu.cuIpcCloseMemHandle(p);
    pthread_mutex_unlock(lock);
  } else if (m->how == HOW_IPC_CHUNKS) {
    chunk_sizes_t *keep = (chunk_sizes_t *)(uintptr_t)m->native;
    unmap_chunks(p, keep->sizes, keep->count);
    res = cu.cuMemAddressFree(p, m->reserved);
    free(keep);
    m->native = 0;
  } else {
    cu.cuMemUnmap(p, m->reserved);
    res = cu.cuMemAddressFree(p, m->reserved);
  }
  ctx_leave();
  return res == CUDA_SUCCESS ? 0 : cu_fail(res, "unmapping CUDA IPC memory");
}

/* As SYCL's CUDA adapter prints it: "CUDA 12.4" (cuDriverGetVersion gives
 * 1000 * major + 10 * minor, the newest CUDA the driver supports). One
 * allocation may take the whole memory: CUDA has no lower limit. Neither
 * call needs a context. */
static int cuda_device_info(void *dev, usmipc_device_info_t *info) {
  cuda_device_t *d = dev;
  int version = 0;
  CUresult res = cu.cuDriverGetVersion(&version);
  if (res != CUDA_SUCCESS)
    return cu_fail(res, "cuDriverGetVersion");
  snprintf(info->driver_version, sizeof(info->driver_version), "CUDA %d.%d",
           version / 1000, version % 1000 / 10);
  size_t total = 0;
  res = cu.cuDeviceTotalMem(&total, d->dev);
  if (res != CUDA_SUCCESS)
    return cu_fail(res, "cuDeviceTotalMem");
  info->global_mem_size = total;
  info->max_mem_alloc_size = total;
  return 0;
}

const usmipc__backend_ops_t usmipc__cuda_backend = {
    .struct_size = sizeof(usmipc__backend_ops_t),
    .backend = USMIPC_BACKEND_CUDA,
    .name = "cuda",
    .probe = cuda_probe,
    .mem_alloc = cuda_mem_alloc,
    .mem_free = cuda_mem_free,
    .pointer_query = cuda_pointer_query,
    .queue_create = cuda_queue_create,
    .queue_destroy = cuda_queue_destroy,
    .queue_synchronize = cuda_queue_synchronize,
    .queue_idle = cuda_queue_idle,
    .memcpy = cuda_memcpy,
    .memset = cuda_memset,
    .copy_batch_create = cuda_copy_batch_create,
    .copy_batch_run = cuda_copy_batch_run,
    .copy_batch_destroy = cuda_copy_batch_destroy,
    .ipc_export = cuda_ipc_export,
    .ipc_import = cuda_ipc_import,
    .ipc_unmap = cuda_ipc_unmap,
    .event_create = cuda_event_create,
    .event_destroy = cuda_event_destroy,
    .event_record = cuda_event_record,
    .event_query = cuda_event_query,
    .event_wait = cuda_event_wait,
    .event_export = cuda_event_export,
    .event_import = cuda_event_import,
    .event_close = cuda_event_destroy,
    .queue_wrap = cuda_queue_wrap,
    .queue_unwrap = cuda_queue_unwrap,
    .foreign_chunks = cuda_foreign_chunks,
    .chunks_export = cuda_chunks_export,
    .ipc_import_chunks = cuda_ipc_import_chunks,
    .device_info = cuda_device_info,
    .ipc_import_hidden_owner = true,
};
