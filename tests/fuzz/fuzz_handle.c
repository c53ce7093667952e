/* libFuzzer target for the IPC handle parser (zstd's tests/fuzz habit: one
 * target per parser, plus replay.c to run the corpus without libFuzzer).
 *
 * Handle bytes arrive from other processes through channels usmipc does not
 * control, so usmipc__wire_decode and usmipc_ipc_handle_inspect must accept
 * any input without crashing, and must agree with each other. A handle that
 * decodes must encode back to the very same bytes (the round trip): decoding
 * may not silently drop or normalise anything that a forger could use.
 *
 * Nothing here opens a handle: no mapping, no descriptor, no side effect.
 *
 * Build and run (clang):
 *   cmake -S . -B build-fuzz -G Ninja -DCMAKE_C_COMPILER=clang -DUSMIPC_FUZZ=ON
 *   cmake --build build-fuzz --target fuzz_handle
 *   mkdir -p /tmp/fuzz-corpus
 *   build-fuzz/tests/fuzz/fuzz_handle /tmp/fuzz-corpus tests/fuzz/corpus \
 *       -max_len=512 -max_total_time=600
 * New inputs land in /tmp/fuzz-corpus (the first directory); keep the
 * committed corpus small and replay it with `ctest -R fuzz.replay`. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

#define FUZZ_CHECK(cond, ...)                                                  \
  do {                                                                         \
    if (!(cond)) {                                                             \
      fprintf(stderr, "fuzz_handle: %s:%d: %s: ", __FILE__, __LINE__, #cond);  \
      fprintf(stderr, __VA_ARGS__);                                            \
      fputc('\n', stderr);                                                     \
      abort();                                                                 \
    }                                                                          \
  } while (0)

static void check_one(const uint8_t *data, size_t size) {
  usmipc_ipc_handle_info_t info;
  usmipc__wire_t w;
  int ri = usmipc_ipc_handle_inspect(data, size, &info);
  int rd = usmipc__wire_decode(data, size, &w);
  /* inspect is decode plus a copy of the public fields. */
  FUZZ_CHECK(ri == rd, "inspect %d, decode %d", ri, rd);
  if (rd != 0) {
    FUZZ_CHECK(rd == USMIPC_EBADHANDLE || rd == USMIPC_EHANDLEVERSION ||
                   rd == USMIPC_EINVAL,
               "decode failed with %d (%s)", rd, usmipc_err_name(rd));
    const char *msg = usmipc_last_error();
    FUZZ_CHECK(msg != NULL && msg[0] != '\0', "no message for %d", rd);
    return;
  }

  /* Round trip: the same length, the same bytes. */
  size_t n = usmipc__wire_len(&w);
  FUZZ_CHECK(n == size, "decoded a %zu-byte input as a %zu-byte handle", size,
             n);
  FUZZ_CHECK(w.payload.len <= USMIPC__PAYLOAD_MAX, "payload %u",
             (unsigned)w.payload.len);
  uint8_t *out = malloc(n);
  FUZZ_CHECK(out != NULL, "malloc");
  usmipc__wire_encode(&w, out);
  for (size_t i = 0; i < n; i++)
    FUZZ_CHECK(out[i] == data[i], "re-encoding differs at byte %zu: %02x != %02x",
               i, out[i], data[i]);
  free(out);

  /* What decoding promises about a handle it accepts. */
  FUZZ_CHECK(w.backend == USMIPC_BACKEND_HOST || w.backend == USMIPC_BACKEND_CUDA ||
                 w.backend == USMIPC_BACKEND_LEVEL_ZERO,
             "backend %d", (int)w.backend);
  FUZZ_CHECK(w.nbytes > 0, "zero bytes");
  FUZZ_CHECK(w.allocation_size > 0 && w.offset <= w.allocation_size &&
                 w.nbytes <= w.allocation_size - w.offset,
             "range %llu+%llu of %llu", (unsigned long long)w.offset,
             (unsigned long long)w.nbytes, (unsigned long long)w.allocation_size);
  FUZZ_CHECK(w.pid != 0 && w.nonce != 0, "no exporter");

  /* inspect reports exactly the decoded fields. */
  FUZZ_CHECK(info.backend == w.backend && info.exporter_pid == w.pid &&
                 info.buffer_id == w.buffer_id &&
                 info.allocation_size == w.allocation_size &&
                 info.offset == w.offset && info.nbytes == w.nbytes &&
                 info.handle_kind == w.payload.handle_kind &&
                 memcmp(info.device_uuid, w.device_uuid, 16) == 0,
             "inspect disagrees with decode");
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  check_one(data, size);
  /* The CRC stops almost every mutation at the door. To reach the field
   * checks behind it, run the input a second time with its trailing four
   * bytes replaced by the CRC32C of the rest, as a forger would do. */
  if (size >= 8 && size <= 4096) {
    uint8_t *copy = malloc(size);
    FUZZ_CHECK(copy != NULL, "malloc");
    memcpy(copy, data, size);
    uint32_t crc = usmipc__crc32c(0, copy, size - 4);
    for (int i = 0; i < 4; i++)
      copy[size - 4 + (size_t)i] = (uint8_t)(crc >> (8 * i));
    check_one(copy, size);
    free(copy);
  }
  return 0;
}
