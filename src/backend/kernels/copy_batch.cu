/* The batched copy of usmipc_bundle_update on CUDA: one launch copies every
 * chunk of a table that lives on the device, one thread block a chunk.
 *
 * This file is not compiled when usmipc is built: `make ptx` turns it into
 * PTX (src/backend/kernels/copy_batch_ptx.h, committed), which the backend
 * hands to cuModuleLoadData, so that building needs no CUDA toolkit and any
 * driver able to run usmipc JITs it for its GPU. `make ptx-check` (CI)
 * regenerates it and fails if the committed header differs.
 *
 * Why a kernel of our own: for 4,719 tensors a cuMemcpyAsync loop spends
 * about 7 us of host time per copy and cuMemcpyBatchAsync about 5 us;
 * one launch over a table costs the same for 10 tensors or 10,000, and
 * copies at the device's copy bandwidth when every block has enough bytes
 * (backend/cuda_copy.c cuts large copies into chunks). */

/* One chunk: rows of row_bytes; row r from src + r * src_pitch to
 * dst + r * dst_pitch. The layout is usmipc__copy_t's (backend.h). */
struct usmipc_chunk {
  unsigned long long src, dst;
  unsigned long long row_bytes, rows;
  unsigned long long src_pitch, dst_pitch;
};

/* The block copies n bytes from s to d. 16-byte loads and stores where the
 * two addresses agree modulo 16 (every tensor of PyTorch's allocators does),
 * with streaming cache hints: the bytes are read and written once. */
static __device__ __forceinline__ void copy_row(char *__restrict__ d,
                                                const char *__restrict__ s,
                                                unsigned long long n) {
  const unsigned long long t = threadIdx.x, step = blockDim.x;
  const unsigned long long sa = (unsigned long long)s,
                           da = (unsigned long long)d;
  if (((sa ^ da) & 15) == 0) {
    unsigned long long head = (16 - (sa & 15)) & 15;
    if (head > n)
      head = n;
    for (unsigned long long i = t; i < head; i += step)
      d[i] = s[i];
    s += head;
    d += head;
    n -= head;
    const uint4 *__restrict__ s4 = (const uint4 *)s;
    uint4 *__restrict__ d4 = (uint4 *)d;
    const unsigned long long n4 = n >> 4;
    unsigned long long i = t;
    for (; i + 3 * step < n4; i += 4 * step) {
      uint4 a = __ldcs(s4 + i), b = __ldcs(s4 + i + step),
            c = __ldcs(s4 + i + 2 * step), e = __ldcs(s4 + i + 3 * step);
      __stcs(d4 + i, a);
      __stcs(d4 + i + step, b);
      __stcs(d4 + i + 2 * step, c);
      __stcs(d4 + i + 3 * step, e);
    }
    for (; i < n4; i += step)
      __stcs(d4 + i, __ldcs(s4 + i));
    for (unsigned long long k = (n4 << 4) + t; k < n; k += step)
      d[k] = s[k];
  } else if (((sa ^ da) & 3) == 0) {
    unsigned long long head = (4 - (sa & 3)) & 3;
    if (head > n)
      head = n;
    for (unsigned long long i = t; i < head; i += step)
      d[i] = s[i];
    s += head;
    d += head;
    n -= head;
    const unsigned *__restrict__ s1 = (const unsigned *)s;
    unsigned *__restrict__ d1 = (unsigned *)d;
    const unsigned long long n1 = n >> 2;
    for (unsigned long long i = t; i < n1; i += step)
      d1[i] = s1[i];
    for (unsigned long long k = (n1 << 2) + t; k < n; k += step)
      d[k] = s[k];
  } else {
    for (unsigned long long i = t; i < n; i += step)
      d[i] = s[i];
  }
}

extern "C" __global__ void usmipc_copy_chunks(const usmipc_chunk *chunks) {
  const usmipc_chunk c = chunks[blockIdx.x];
  for (unsigned long long r = 0; r < c.rows; r++)
    copy_row((char *)(c.dst + r * c.dst_pitch),
             (const char *)(c.src + r * c.src_pitch), c.row_bytes);
}
