/* The IPC blob of SYCL programs on Level Zero: what dpctl's
 * IPCMemoryHandle.to_bytes() and sycl::ext::oneapi::experimental::ipc::
 * memory::get() give. It is the Unified Memory Framework's umf_ipc_data_t
 * (unified-memory-framework src/ipc_internal.h, v0.10-v1.1: the same), then
 * the Level Zero provider's data:
 *
 *   0 u64 handle id (a counter of the exporter's exports)
 *   8 u64 base (the provider allocation's address in the exporter)
 *  16 i32 pid (the exporter's), 20 padding
 *  24 u64 base size, 32 u64 offset (the exported pointer minus base)
 *  40 provider data:
 *     108-byte form (UMF <= 1.0, unified-runtime's v1 adapter):
 *        40 i32 pid, 44 ze_ipc_mem_handle_t (64 bytes)
 *     120-byte form (UMF >= 1.1's Level Zero provider, UR's v2 adapter):
 *        40 i32 pid, 44 padding, 48 u64 size, 56 ze_ipc_mem_handle_t
 *
 * The driver's handle inside is the exporter's, in its driver's layout: the
 * dma-buf descriptor (a number in the exporter) at 0, the driver's pool
 * offset at 8, and either the memory type at 16 (IpcMemoryData) or the
 * exporter's pid at 16, the handle type at 20 and the memory type at 21
 * (IpcOpaqueMemoryData). Sources: docs/level-zero.md.
 *
 * Pure, total and fuzzed (tests/fuzz/fuzz_umf.c): any bytes give a blob or
 * a clear error, never a read past len.
 *
 * Floor 2 of the core (wire), fuzzed by tests/fuzz/fuzz_umf.c. */
#include <string.h>

#include "wire/wire.h"

static int bad(const char *why) {
  return usmipc__fail(USMIPC_EBADHANDLE,
                      "not a SYCL/UMF Level Zero IPC handle: %s", why);
}

int usmipc__umf_blob_parse(const void *data, size_t len,
                           usmipc__umf_blob_t *out) {
  const uint8_t *b = data;
  memset(out, 0, sizeof(*out));
  if (b == NULL)
    return bad("no bytes");
  static const uint8_t usmipc_magic[8] = {0x89, 'U', 'S', 'M',
                                          'I',  'P', 'C', '\n'};
  if (len >= 8 && memcmp(b, usmipc_magic, 8) == 0)
    return usmipc__fail(
        USMIPC_EBADHANDLE,
        "these are usmipc handle bytes, not a SYCL/UMF blob: "
        "open them with usmipc_ipc_open (IPCMemoryHandle.open)");
  if (len != 108 && len != 120)
    return usmipc__fail(USMIPC_EBADHANDLE,
                        "not a SYCL/UMF Level Zero IPC handle: it has %zu "
                        "bytes, and those blobs have 108 (UMF 1.0, unified-"
                        "runtime's v1 adapter) or 120 (UMF 1.1+)",
                        len);
  const uint8_t *ze = b + (len == 108 ? 44 : 56);
  int32_t pid = (int32_t)usmipc__get32le(b + 16),
          provider_pid = (int32_t)usmipc__get32le(b + 40);
  out->form = (uint32_t)len;
  out->handle_id = usmipc__get64le(b);
  out->base = usmipc__get64le(b + 8);
  out->base_size = usmipc__get64le(b + 24);
  out->offset = usmipc__get64le(b + 32);
  out->provider_size = len == 120 ? usmipc__get64le(b + 48) : 0;
  memcpy(out->ze_handle, ze, 64);
  if (pid <= 0)
    return bad("it names no exporting process");
  if (provider_pid != pid)
    return bad("its two exporter pids disagree");
  out->pid = (uint32_t)pid;
  if (out->base_size == 0 || out->offset >= out->base_size)
    return bad("its offset lies outside its allocation");
  if (out->base + out->base_size < out->base)
    return bad("its address range wraps around");
  if (len == 120 && out->provider_size == 0)
    return bad("its provider size is 0");
  int32_t fd = (int32_t)usmipc__get32le(ze);
  if (fd < 0 || usmipc__get32le(ze + 4) != 0)
    return bad("its Level Zero handle holds no descriptor number");
  out->fd_number = (uint32_t)fd;
  out->pool_offset = usmipc__get64le(ze + 8);
  if (out->pool_offset > UINT64_MAX - out->base_size)
    return bad("its pool offset is out of range");
  if (usmipc__get32le(ze + 16) == out->pid) {
    /* IpcOpaqueMemoryData: handle type 0 (a descriptor), memory type. */
    out->opaque = true;
    if (ze[20] != 0)
      return bad("its Level Zero handle is not a file descriptor (a Windows "
                 "handle?)");
    out->memory_type = ze[21];
  } else {
    out->memory_type = ze[16];
  }
  if (out->memory_type == 1)
    return usmipc__fail(USMIPC_EMEMKIND,
                        "the SYCL handle shares host memory; usmipc opens "
                        "device memory only");
  if (out->memory_type != 0)
    return bad("its Level Zero memory type is unknown");
  return 0;
}
