/* Batched copies on CUDA (the backend's copy_batch ops): one launch of the
 * project's own kernel over a table of chunks kept on the device, or, when
 * the kernel cannot be loaded or USMIPC_COPY_BATCH=loop asks for it, one
 * cuMemcpyAsync (cuMemcpy2DAsync for rows) per copy.
 *
 * Floor 3 (backends), below cuda.c, which calls it with the device's
 * context current; it calls nothing of usmipc's but util. Its driver entry
 * points are its own and optional: a driver without them keeps the backend
 * available, and update falls back to the copy loop.
 *
 * Why chunks: a thread block per tensor leaves the GPU idle behind the
 * largest tensors (an MoE's 4,719 tensors range from 4 KiB to 1.5 GiB);
 * cutting every copy into chunks of at most CHUNK bytes gives every block
 * the same work, and the launch costs the same whatever the count. The table
 * is uploaded only when the copies change (a warm update reuses it); before
 * rewriting it the host waits for the launch that last read it. */
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/cuda_copy.h"
#include "backend/kernels/copy_batch_ptx.h"
#include "util/util.h"

typedef struct CUmod_st *CUmodule;
typedef struct CUfunc_st *CUfunction;
typedef struct {
  size_t srcXInBytes, srcY;
  int srcMemoryType;
  const void *srcHost;
  CUdeviceptr srcDevice;
  void *srcArray;
  size_t srcPitch;
  size_t dstXInBytes, dstY;
  int dstMemoryType;
  void *dstHost;
  CUdeviceptr dstDevice;
  void *dstArray;
  size_t dstPitch;
  size_t WidthInBytes, Height;
} CUDA_MEMCPY2D; /* cuda.h's layout */
enum { CU_MEMORYTYPE_UNIFIED = 4 };

/* What the copy loop needs (cuda.c requires the same entry points, so a
 * driver that runs usmipc has them), then what the kernel needs, each
 * optional: without one of those the batch is the loop, and without
 * cuMemcpy2DAsync_v2 rows go one by one. */
#define LOOP_SYMBOLS(X)                                                        \
  X(cuGetErrorName, "cuGetErrorName", (CUresult, const char **))               \
  X(cuMemcpyAsync, "cuMemcpyAsync",                                            \
    (CUdeviceptr, CUdeviceptr, size_t, CUstream))
#define KERNEL_SYMBOLS(X)                                                      \
  X(cuCtxGetCurrent, "cuCtxGetCurrent", (CUcontext *))                         \
  X(cuModuleLoadData, "cuModuleLoadData", (CUmodule *, const void *))          \
  X(cuModuleGetFunction, "cuModuleGetFunction",                                \
    (CUfunction *, CUmodule, const char *))                                    \
  X(cuLaunchKernel, "cuLaunchKernel",                                          \
    (CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,   \
     unsigned, CUstream, void **, void **))                                    \
  X(cuMemAlloc, "cuMemAlloc_v2", (CUdeviceptr *, size_t))                      \
  X(cuMemFree, "cuMemFree_v2", (CUdeviceptr))                                  \
  X(cuMemcpyHtoDAsync, "cuMemcpyHtoDAsync_v2",                                 \
    (CUdeviceptr, const void *, size_t, CUstream))                             \
  X(cuEventCreate, "cuEventCreate", (CUevent *, unsigned))                     \
  X(cuEventDestroy, "cuEventDestroy_v2", (CUevent))                            \
  X(cuEventRecord, "cuEventRecord", (CUevent, CUstream))                       \
  X(cuEventSynchronize, "cuEventSynchronize", (CUevent))

static struct {
#define X(field, symbol, args) CUresult(*field) args;
  LOOP_SYMBOLS(X)
  KERNEL_SYMBOLS(X)
#undef X
  CUresult (*cuMemcpy2DAsync)(const CUDA_MEMCPY2D *, CUstream);
} cu;

/* What loads once per process: the entry points and the switch. */
static pthread_once_t load_once = PTHREAD_ONCE_INIT;
static bool symbols_ok; /* the loop's */
static bool kernel_symbols_ok;
static bool force_loop; /* USMIPC_COPY_BATCH=loop */
static size_t chunk_bytes = (size_t)1 << 20;

static void load(void) {
  void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  symbols_ok = kernel_symbols_ok = lib != NULL;
#define X(field, symbol, args)                                                 \
  if (symbols_ok && (*(void **)&cu.field = dlsym(lib, symbol)) == NULL)        \
    symbols_ok = false;
  LOOP_SYMBOLS(X)
#undef X
#define X(field, symbol, args)                                                 \
  if (kernel_symbols_ok &&                                                     \
      (*(void **)&cu.field = dlsym(lib, symbol)) == NULL) {                    \
    usmipc__debug("cuda copy batch: the driver lacks %s; copies go one by "    \
                  "one",                                                       \
                  symbol);                                                     \
    kernel_symbols_ok = false;                                                 \
  }
  KERNEL_SYMBOLS(X)
#undef X
  if (lib != NULL)
    *(void **)&cu.cuMemcpy2DAsync = dlsym(lib, "cuMemcpy2DAsync_v2");
  const char *env = getenv("USMIPC_COPY_BATCH");
  if (env && !strcmp(env, "loop"))
    force_loop = true;
  else if (env && env[0] != '\0' && strcmp(env, "kernel") != 0)
    usmipc__env_malformed("USMIPC_COPY_BATCH", env, "kernel or loop", "kernel");
  unsigned long long kib;
  if (usmipc__env_number("USMIPC_COPY_CHUNK_KIB", 4, 1u << 20, false, "1024",
                         &kib))
    chunk_bytes = (size_t)kib << 10;
}

static int fail(CUresult res, const char *what) {
  const char *name = "?";
  if (cu.cuGetErrorName)
    cu.cuGetErrorName(res, &name);
  return usmipc__fail_native(res == 2 ? USMIPC_ENOMEM : USMIPC_EBACKEND, res,
                             "the batched copy: %s failed (%s, CUDA error %d)",
                             what, name, res);
}

/* The kernel, loaded once per context (the primary context of each device
 * this process uses): up to 16, as the backend's devices. */
static pthread_mutex_t kernels_lock = PTHREAD_MUTEX_INITIALIZER;
static struct {
  CUcontext ctx;
  CUfunction fn; /* NULL: this context could not load it */
} kernels[16];

static CUfunction kernel_for_current(void) {
  CUcontext ctx = NULL;
  if (cu.cuCtxGetCurrent(&ctx) != CUDA_SUCCESS || ctx == NULL)
    return NULL;
  CUfunction fn = NULL;
  pthread_mutex_lock(&kernels_lock);
  int i = 0;
  for (; i < 16 && kernels[i].ctx != NULL; i++)
    if (kernels[i].ctx == ctx) {
      fn = kernels[i].fn;
      goto out;
    }
  if (i == 16)
    goto out;
  CUmodule mod = NULL;
  CUresult res = cu.cuModuleLoadData(&mod, usmipc__copy_batch_ptx);
  if (res == CUDA_SUCCESS)
    res = cu.cuModuleGetFunction(&fn, mod, "usmipc_copy_chunks");
  if (res != CUDA_SUCCESS) {
    const char *name = "?";
    cu.cuGetErrorName(res, &name);
    usmipc__debug("cuda copy batch: the kernel does not load (%s, CUDA "
                  "error %d); copies go one by one",
                  name, res);
    fn = NULL;
  }
  kernels[i].ctx = ctx;
  kernels[i].fn = fn;
out:
  pthread_mutex_unlock(&kernels_lock);
  return fn;
}

struct usmipc__cuda_copy {
  usmipc__copy_t *chunks; /* the table, on the host */
  size_t nchunks, cap;
  CUdeviceptr table; /* and on the device: dev_cap chunks */
  size_t dev_cap;
  CUevent read; /* recorded after the launch that last read the table */
  bool launched;
  CUfunction fn; /* NULL: the loop */
  bool decided;
};

int usmipc__cuda_copy_create(usmipc__cuda_copy_t **out) {
  pthread_once(&load_once, load);
  *out = calloc(1, sizeof(**out));
  return *out ? 0 : usmipc__fail(USMIPC_ENOMEM, "out of memory");
}

void usmipc__cuda_copy_destroy(usmipc__cuda_copy_t *b) {
  if (b == NULL)
    return;
  if (b->launched)
    cu.cuEventSynchronize(b->read);
  if (b->read)
    cu.cuEventDestroy(b->read);
  if (b->table)
    cu.cuMemFree(b->table);
  free(b->chunks);
  free(b);
}

/* Cuts the copies into chunks of at most chunk_bytes (whole rows, or one
 * piece of a single row); offsets stay multiples of 16, so that a chunk's
 * addresses agree modulo 16 exactly when its copy's do. */
static int cut(usmipc__cuda_copy_t *b, const usmipc__copy_t *c, size_t n) {
  b->nchunks = 0;
  for (size_t i = 0; i < n; i++) {
    const usmipc__copy_t *k = &c[i];
    if (k->row_bytes == 0 || k->rows == 0)
      continue;
    uint64_t per =
        k->rows == 1 ? (k->row_bytes + chunk_bytes - 1) / chunk_bytes : 0;
    uint64_t rows_per = k->rows == 1 ? 1
                        : k->row_bytes >= chunk_bytes
                            ? 1
                            : chunk_bytes / k->row_bytes;
    uint64_t pieces = k->rows == 1 ? per : (k->rows + rows_per - 1) / rows_per;
    if (b->nchunks + pieces > b->cap) {
      size_t cap = b->cap ? b->cap : 1024;
      while (cap < b->nchunks + pieces)
        cap *= 2;
      usmipc__copy_t *grown = realloc(b->chunks, cap * sizeof(*grown));
      if (grown == NULL)
        return usmipc__fail(USMIPC_ENOMEM, "out of memory");
      b->chunks = grown;
      b->cap = cap;
    }
    for (uint64_t p = 0; p < pieces; p++) {
      usmipc__copy_t *o = &b->chunks[b->nchunks++];
      *o = *k;
      if (k->rows == 1) {
        uint64_t at = p * chunk_bytes;
        o->src += at;
        o->dst += at;
        o->row_bytes =
            k->row_bytes - at < chunk_bytes ? k->row_bytes - at : chunk_bytes;
      } else {
        uint64_t r0 = p * rows_per;
        o->src += r0 * k->src_pitch;
        o->dst += r0 * k->dst_pitch;
        o->rows = k->rows - r0 < rows_per ? k->rows - r0 : rows_per;
      }
    }
  }
  return 0;
}

static int run_loop(CUstream stream, const usmipc__copy_t *c, size_t n) {
  for (size_t i = 0; i < n; i++) {
    const usmipc__copy_t *k = &c[i];
    if (k->row_bytes == 0 || k->rows == 0)
      continue;
    CUresult res;
    if (k->rows == 1) {
      res = cu.cuMemcpyAsync(k->dst, k->src, k->row_bytes, stream);
      if (res != CUDA_SUCCESS)
        return fail(res, "cuMemcpyAsync");
      continue;
    }
    CUDA_MEMCPY2D m = {0};
    m.srcMemoryType = m.dstMemoryType = CU_MEMORYTYPE_UNIFIED;
    m.srcDevice = k->src;
    m.dstDevice = k->dst;
    m.srcPitch = k->src_pitch;
    m.dstPitch = k->dst_pitch;
    m.WidthInBytes = k->row_bytes;
    m.Height = k->rows;
    res = cu.cuMemcpy2DAsync ? cu.cuMemcpy2DAsync(&m, stream)
                             : CUDA_ERROR_NOT_SUPPORTED;
    for (uint64_t r = 0; res != CUDA_SUCCESS && r < k->rows; r++) {
      /* Pitches past the 2-D copy's limits: row by row. */
      CUresult one =
          cu.cuMemcpyAsync(k->dst + r * k->dst_pitch, k->src + r * k->src_pitch,
                           k->row_bytes, stream);
      if (one != CUDA_SUCCESS)
        return fail(one, "cuMemcpyAsync");
      if (r + 1 == k->rows)
        res = CUDA_SUCCESS;
    }
  }
  return 0;
}

int usmipc__cuda_copy_run(usmipc__cuda_copy_t *b, CUstream stream,
                          const usmipc__copy_t *copies, size_t count,
                          bool same) {
  if (!symbols_ok)
    return usmipc__fail(USMIPC_ENOTSUP,
                        "the batched copy needs cuMemcpyAsync, which this "
                        "CUDA driver lacks");
  if (!b->decided) {
    b->fn = force_loop || !kernel_symbols_ok ? NULL : kernel_for_current();
    b->decided = true;
  }
  if (b->fn == NULL)
    return run_loop(stream, copies, count);
  CUresult res;
  if (!same || !b->launched) {
    int rc = cut(b, copies, count);
    if (rc != 0)
      return rc;
    if (b->nchunks == 0)
      return 0;
    /* The launch before may still read the table: wait for it first (only
     * when the copies change, which a warm update does not). */
    if (b->launched && (res = cu.cuEventSynchronize(b->read)) != CUDA_SUCCESS)
      return fail(res, "cuEventSynchronize");
    b->launched = false;
    if (b->nchunks > b->dev_cap) {
      if (b->table)
        cu.cuMemFree(b->table);
      b->table = 0;
      b->dev_cap = 0;
      size_t cap = b->nchunks + b->nchunks / 4;
      if ((res = cu.cuMemAlloc(&b->table, cap * sizeof(usmipc__copy_t))) !=
          CUDA_SUCCESS)
        return fail(res, "cuMemAlloc of the copy table");
      b->dev_cap = cap;
    }
    if (b->read == NULL &&
        (res = cu.cuEventCreate(&b->read, CU_EVENT_DISABLE_TIMING)) !=
            CUDA_SUCCESS)
      return fail(res, "cuEventCreate");
    /* From pageable memory: the driver stages the bytes before it returns,
     * so b->chunks may change afterwards. */
    if ((res = cu.cuMemcpyHtoDAsync(b->table, b->chunks,
                                    b->nchunks * sizeof(usmipc__copy_t),
                                    stream)) != CUDA_SUCCESS)
      return fail(res, "cuMemcpyHtoDAsync of the copy table");
  }
  if (b->nchunks == 0)
    return 0;
  void *args[] = {&b->table};
  for (size_t first = 0; first < b->nchunks;) {
    /* A grid of at most 2^31 - 1 blocks: more chunks launch again on the
     * table's next part. */
    size_t blocks = b->nchunks - first;
    if (blocks > 0x7fffffffu)
      blocks = 0x7fffffffu;
    CUdeviceptr part = b->table + first * sizeof(usmipc__copy_t);
    args[0] = &part;
    res = cu.cuLaunchKernel(b->fn, (unsigned)blocks, 1, 1, 512, 1, 1, 0, stream,
                            args, NULL);
    if (res != CUDA_SUCCESS)
      return fail(res, "cuLaunchKernel");
    first += blocks;
  }
  if ((res = cu.cuEventRecord(b->read, stream)) != CUDA_SUCCESS)
    return fail(res, "cuEventRecord");
  b->launched = true;
  return 0;
}
