/* A CUDA driver of nothing, for profiling usmipc's own time on a machine
 * without a GPU: every call returns at once, "device memory" is host
 * memory, handles are the pointer. It is NOT a backend and tests nothing:
 * a profile under it shows what usmipc's C and Python layers cost around
 * the driver calls (the driver's own share is measured on a GPU, beside
 * it: tests/gpu/export_bench.py). Only the exporter's side works: an
 * import (cuIpcOpenMemHandle) is refused.
 *
 *   make fakecuda        # build/fakecuda/libcuda.so.1
 *   LD_LIBRARY_PATH=build/fakecuda perf record -g python3 bench/...
 *
 * One device, legacy IPC only (no VMM: USMIPC_CUDA_IPC=native is then
 * what the backend uses for its own allocations). */
#include <cuda.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define API __attribute__((visibility("default")))

/* The allocations, for the pointer queries of foreign memory. */
#define MAX_ALLOCS 65536
static struct {
  uintptr_t base;
  size_t size;
  unsigned long long id;
} allocs[MAX_ALLOCS];
static unsigned long long next_id = 1;
static int fake_ctx_storage, fake_stream_storage[1024], fake_event_storage;
static int stream_next;

/* Exact base pointers are found by hash (the driver's own lookups should
 * cost next to nothing here), interior pointers by a scan. */
#define HASH_SIZE (2 * MAX_ALLOCS)
static int by_base[HASH_SIZE]; /* index + 1; 0 empty, -1 deleted */

static unsigned hash_of(uintptr_t p) {
  return (unsigned)((p >> 9) * 0x9E3779B1u) % HASH_SIZE;
}

static void hash_put(uintptr_t p, int i) {
  unsigned h = hash_of(p);
  while (by_base[h] > 0)
    h = (h + 1) % HASH_SIZE;
  by_base[h] = i + 1;
}

static int find(uintptr_t p) {
  for (unsigned h = hash_of(p), n = 0; by_base[h] != 0 && n < HASH_SIZE;
       h = (h + 1) % HASH_SIZE, n++)
    if (by_base[h] > 0 && allocs[by_base[h] - 1].base == p)
      return by_base[h] - 1;
  for (int i = 0; i < MAX_ALLOCS; i++)
    if (allocs[i].base && p >= allocs[i].base &&
        p < allocs[i].base + allocs[i].size)
      return i;
  return -1;
}

static void hash_remove(uintptr_t p) {
  for (unsigned h = hash_of(p); by_base[h] != 0; h = (h + 1) % HASH_SIZE)
    if (by_base[h] > 0 && allocs[by_base[h] - 1].base == p) {
      by_base[h] = -1;
      return;
    }
}

API CUresult cuInit(unsigned flags) {
  (void)flags;
  return CUDA_SUCCESS;
}
API CUresult cuGetErrorString(CUresult e, const char **s) {
  (void)e;
  *s = "fake driver error";
  return CUDA_SUCCESS;
}
API CUresult cuGetErrorName(CUresult e, const char **s) {
  (void)e;
  *s = "CUDA_ERROR_FAKE";
  return CUDA_SUCCESS;
}
API CUresult cuDriverGetVersion(int *v) {
  *v = 13000;
  return CUDA_SUCCESS;
}
API CUresult cuDeviceGetCount(int *n) {
  *n = 1;
  return CUDA_SUCCESS;
}
API CUresult cuDeviceGet(CUdevice *d, int i) {
  *d = i;
  return i == 0 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_DEVICE;
}
API CUresult cuDeviceGetName(char *name, int len, CUdevice d) {
  (void)d;
  strncpy(name, "fakecuda (profiling only)", (size_t)len - 1);
  name[len - 1] = 0;
  return CUDA_SUCCESS;
}
API CUresult cuDeviceGetUuid_v2(CUuuid *u, CUdevice d) {
  (void)d;
  memset(u->bytes, 0x5a, 16);
  return CUDA_SUCCESS;
}
API CUresult cuDeviceGetAttribute(int *v, CUdevice_attribute a, CUdevice d) {
  (void)d;
  *v = a == CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING ? 1 : 0;
  return CUDA_SUCCESS;
}
API CUresult cuDeviceTotalMem_v2(size_t *n, CUdevice d) {
  (void)d;
  *n = (size_t)80 << 30;
  return CUDA_SUCCESS;
}
API CUresult cuDeviceCanAccessPeer(int *v, CUdevice a, CUdevice b) {
  *v = a == b;
  return CUDA_SUCCESS;
}
API CUresult cuDevicePrimaryCtxRetain(CUcontext *c, CUdevice d) {
  (void)d;
  *c = (CUcontext)&fake_ctx_storage;
  return CUDA_SUCCESS;
}
static __thread CUcontext current;
API CUresult cuCtxPushCurrent_v2(CUcontext c) {
  current = c;
  return CUDA_SUCCESS;
}
API CUresult cuCtxPopCurrent_v2(CUcontext *c) {
  if (c)
    *c = current;
  return CUDA_SUCCESS;
}
API CUresult cuCtxGetCurrent(CUcontext *c) {
  *c = current;
  return CUDA_SUCCESS;
}
API CUresult cuCtxSetCurrent(CUcontext c) {
  current = c;
  return CUDA_SUCCESS;
}
API CUresult cuCtxEnablePeerAccess(CUcontext c, unsigned f) {
  (void)c, (void)f;
  return CUDA_SUCCESS;
}
API CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t n) {
  void *m = aligned_alloc(512, (n + 511) / 512 * 512);
  if (m == NULL)
    return CUDA_ERROR_OUT_OF_MEMORY;
  for (int i = 0; i < MAX_ALLOCS; i++)
    if (allocs[i].base == 0) {
      allocs[i].base = (uintptr_t)m;
      allocs[i].size = n;
      allocs[i].id = next_id++;
      hash_put((uintptr_t)m, i);
      *p = (CUdeviceptr)(uintptr_t)m;
      return CUDA_SUCCESS;
    }
  free(m);
  return CUDA_ERROR_OUT_OF_MEMORY;
}
API CUresult cuMemFree_v2(CUdeviceptr p) {
  int i = find((uintptr_t)p);
  if (i < 0 || allocs[i].base != (uintptr_t)p)
    return CUDA_ERROR_INVALID_VALUE;
  hash_remove(allocs[i].base);
  free((void *)allocs[i].base);
  allocs[i].base = 0;
  return CUDA_SUCCESS;
}
API CUresult cuMemHostAlloc(void **p, size_t n, unsigned f) {
  (void)f;
  *p = malloc(n);
  return *p ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
}
API CUresult cuMemFreeHost(void *p) {
  free(p);
  return CUDA_SUCCESS;
}
API CUresult cuMemAllocManaged(CUdeviceptr *p, size_t n, unsigned f) {
  (void)p, (void)n, (void)f;
  return CUDA_ERROR_NOT_SUPPORTED;
}
static CUresult attr(CUpointer_attribute a, void *out, int i) {
  switch (a) {
  case CU_POINTER_ATTRIBUTE_CONTEXT:
    *(CUcontext *)out = (CUcontext)&fake_ctx_storage;
    break;
  case CU_POINTER_ATTRIBUTE_MEMORY_TYPE:
    *(unsigned *)out = CU_MEMORYTYPE_DEVICE;
    break;
  case CU_POINTER_ATTRIBUTE_DEVICE_POINTER:
    *(CUdeviceptr *)out = allocs[i].base;
    break;
  case CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL:
    *(int *)out = 0;
    break;
  case CU_POINTER_ATTRIBUTE_RANGE_START_ADDR:
    *(CUdeviceptr *)out = allocs[i].base;
    break;
  case CU_POINTER_ATTRIBUTE_RANGE_SIZE:
    *(size_t *)out = allocs[i].size;
    break;
  case CU_POINTER_ATTRIBUTE_BUFFER_ID:
  case CU_POINTER_ATTRIBUTE_MEMORY_BLOCK_ID:
    *(unsigned long long *)out = allocs[i].id;
    break;
  case CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE:
    *(int *)out = 1;
    break;
  case CU_POINTER_ATTRIBUTE_MAPPED:
    *(int *)out = 1;
    break;
  default:
    memset(out, 0, sizeof(int));
    break;
  }
  return CUDA_SUCCESS;
}
API CUresult cuPointerGetAttributes(unsigned n, CUpointer_attribute *a,
                                    void **data, CUdeviceptr p) {
  int i = find((uintptr_t)p);
  if (i < 0)
    return CUDA_ERROR_INVALID_VALUE;
  for (unsigned k = 0; k < n; k++)
    attr(a[k], data[k], i);
  return CUDA_SUCCESS;
}
API CUresult cuPointerGetAttribute(void *out, CUpointer_attribute a,
                                   CUdeviceptr p) {
  int i = find((uintptr_t)p);
  return i < 0 ? CUDA_ERROR_INVALID_VALUE : attr(a, out, i);
}
API CUresult cuMemGetAddressRange_v2(CUdeviceptr *base, size_t *size,
                                     CUdeviceptr p) {
  int i = find((uintptr_t)p);
  if (i < 0)
    return CUDA_ERROR_INVALID_VALUE;
  if (base)
    *base = allocs[i].base;
  if (size)
    *size = allocs[i].size;
  return CUDA_SUCCESS;
}
API CUresult cuStreamCreate(CUstream *s, unsigned f) {
  (void)f;
  *s = (CUstream)&fake_stream_storage[stream_next++ % 1024];
  return CUDA_SUCCESS;
}
API CUresult cuStreamDestroy_v2(CUstream s) {
  (void)s;
  return CUDA_SUCCESS;
}
API CUresult cuStreamSynchronize(CUstream s) {
  (void)s;
  return CUDA_SUCCESS;
}
API CUresult cuStreamQuery(CUstream s) {
  (void)s;
  return CUDA_SUCCESS;
}
API CUresult cuStreamWaitEvent(CUstream s, CUevent e, unsigned f) {
  (void)s, (void)e, (void)f;
  return CUDA_SUCCESS;
}
API CUresult cuEventCreate(CUevent *e, unsigned f) {
  (void)f;
  *e = (CUevent)&fake_event_storage;
  return CUDA_SUCCESS;
}
API CUresult cuEventDestroy_v2(CUevent e) {
  (void)e;
  return CUDA_SUCCESS;
}
API CUresult cuEventRecord(CUevent e, CUstream s) {
  (void)e, (void)s;
  return CUDA_SUCCESS;
}
API CUresult cuEventQuery(CUevent e) {
  (void)e;
  return CUDA_SUCCESS;
}
API CUresult cuEventSynchronize(CUevent e) {
  (void)e;
  return CUDA_SUCCESS;
}
API CUresult cuIpcGetEventHandle(CUipcEventHandle *h, CUevent e) {
  memset(h, 0, sizeof(*h));
  memcpy(h->reserved, &e, sizeof(e));
  return CUDA_SUCCESS;
}
API CUresult cuIpcOpenEventHandle(CUevent *e, CUipcEventHandle h) {
  (void)e, (void)h;
  return CUDA_ERROR_NOT_SUPPORTED;
}
API CUresult cuMemcpyAsync(CUdeviceptr d, CUdeviceptr s, size_t n,
                           CUstream st) {
  (void)st;
  memcpy((void *)(uintptr_t)d, (const void *)(uintptr_t)s, n);
  return CUDA_SUCCESS;
}
API CUresult cuMemsetD8Async(CUdeviceptr d, unsigned char v, size_t n,
                             CUstream st) {
  (void)st;
  memset((void *)(uintptr_t)d, v, n);
  return CUDA_SUCCESS;
}
API CUresult cuIpcGetMemHandle(CUipcMemHandle *h, CUdeviceptr p) {
  int i = find((uintptr_t)p);
  if (i < 0)
    return CUDA_ERROR_INVALID_VALUE;
  memset(h, 0, sizeof(*h));
  memcpy(h->reserved, &allocs[i].base, sizeof(uintptr_t));
  memcpy(h->reserved + 8, &allocs[i].id, 8);
  return CUDA_SUCCESS;
}
API CUresult cuIpcOpenMemHandle_v2(CUdeviceptr *p, CUipcMemHandle h,
                                   unsigned f) {
  (void)p, (void)h, (void)f;
  return CUDA_ERROR_NOT_SUPPORTED;
}
API CUresult cuIpcCloseMemHandle(CUdeviceptr p) {
  (void)p;
  return CUDA_ERROR_INVALID_VALUE;
}

/* VMM: not offered (the device attribute says so), present for dlsym. */
#define NOT_SUPPORTED(name, args)                                              \
  API CUresult name args { return CUDA_ERROR_NOT_SUPPORTED; }
NOT_SUPPORTED(cuMemGetAllocationGranularity,
              (size_t * g, const CUmemAllocationProp *p,
               CUmemAllocationGranularity_flags o))
NOT_SUPPORTED(cuMemCreate, (CUmemGenericAllocationHandle * h, size_t n,
                            const CUmemAllocationProp *p, unsigned long long f))
NOT_SUPPORTED(cuMemRelease, (CUmemGenericAllocationHandle h))
NOT_SUPPORTED(cuMemAddressReserve, (CUdeviceptr * p, size_t n, size_t a,
                                    CUdeviceptr at, unsigned long long f))
NOT_SUPPORTED(cuMemAddressFree, (CUdeviceptr p, size_t n))
NOT_SUPPORTED(cuMemMap, (CUdeviceptr p, size_t n, size_t o,
                         CUmemGenericAllocationHandle h, unsigned long long f))
NOT_SUPPORTED(cuMemUnmap, (CUdeviceptr p, size_t n))
NOT_SUPPORTED(cuMemSetAccess,
              (CUdeviceptr p, size_t n, const CUmemAccessDesc *d, size_t c))
NOT_SUPPORTED(cuMemExportToShareableHandle,
              (void *s, CUmemGenericAllocationHandle h,
               CUmemAllocationHandleType t, unsigned long long f))
NOT_SUPPORTED(cuMemImportFromShareableHandle,
              (CUmemGenericAllocationHandle * h, void *s,
               CUmemAllocationHandleType t))
NOT_SUPPORTED(cuMemRetainAllocationHandle,
              (CUmemGenericAllocationHandle * h, void *a))
NOT_SUPPORTED(cuMemGetAllocationPropertiesFromHandle,
              (CUmemAllocationProp * p, CUmemGenericAllocationHandle h))
NOT_SUPPORTED(cuModuleLoadData, (CUmodule * m, const void *image))
NOT_SUPPORTED(cuModuleGetFunction, (CUfunction * f, CUmodule m, const char *n))
NOT_SUPPORTED(cuLaunchKernel,
              (CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
               unsigned by, unsigned bz, unsigned sh, CUstream s, void **params,
               void **extra))
NOT_SUPPORTED(cuMemcpy2DAsync_v2, (const CUDA_MEMCPY2D *c, CUstream s))
NOT_SUPPORTED(cuMemcpyHtoDAsync_v2,
              (CUdeviceptr d, const void *s, size_t n, CUstream st))
