/* libFuzzer target for the SYCL/UMF blob parser (src/umf_blob.c), which
 * usmipc_ipc_open_sycl runs on bytes from any channel: any input gives a
 * blob or an error, never a read past its length, and an accepted blob
 * keeps the invariants the open relies on.
 *
 * Build and run like fuzz_handle (tests/fuzz/CMakeLists.txt). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "objects.h"

#define FUZZ_TARGET "fuzz_umf"
#include "fuzz.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  /* An exact-size copy: a read past the end is an ASan report. */
  uint8_t *copy = malloc(size ? size : 1);
  memcpy(copy, data, size);
  usmipc__umf_blob_t b;
  int rc = usmipc__umf_blob_parse(copy, size, &b);
  if (rc == 0) {
    FUZZ_CHECK(size == 108 || size == 120, "accepted %zu bytes", size);
    FUZZ_CHECK(b.form == size, "form %u", b.form);
    FUZZ_CHECK(b.pid > 0 && b.pid <= INT32_MAX, "pid %u", b.pid);
    FUZZ_CHECK(b.base_size > 0 && b.offset < b.base_size, "offset %llu of %llu",
               (unsigned long long)b.offset, (unsigned long long)b.base_size);
    FUZZ_CHECK(b.memory_type == 0, "memory type %u", b.memory_type);
    FUZZ_CHECK(b.fd_number <= INT32_MAX, "fd %u", b.fd_number);
    FUZZ_CHECK(b.pool_offset <= UINT64_MAX - b.base_size, "pool offset");
    FUZZ_CHECK(memcmp(b.ze_handle, copy + (size == 108 ? 44 : 56), 64) == 0,
               "the driver handle was not copied from its place");
  } else {
    FUZZ_CHECK(rc == USMIPC_EBADHANDLE || rc == USMIPC_EMEMKIND, "code %d", rc);
    FUZZ_CHECK(usmipc_last_error()[0] != '\0', "an error without a message");
  }
  free(copy);
  return 0;
}

#ifndef USMIPC_LIBFUZZER
/* The seeds (fuzz_replay_umf --make-corpus DIR): both forms, both driver
 * layouts, host memory, and a blob one byte short. */
void fuzz_write_seed(const char *name, const uint8_t *data, size_t len);
int fuzz_make_corpus(void);

static void put32(uint8_t *p, uint32_t v) { memcpy(p, &v, 4); }
static void put64(uint8_t *p, uint64_t v) { memcpy(p, &v, 8); }

int fuzz_make_corpus(void) {
  for (int form = 108; form <= 120; form += 12) {
    for (int opaque = 0; opaque < 2; opaque++) {
      uint8_t b[120];
      memset(b, 0, sizeof(b));
      put64(b, 1);
      put64(b + 8, 0x7f0000000000ull);
      put32(b + 16, 4242);
      put64(b + 24, 65536);
      put64(b + 32, 64);
      put32(b + 40, 4242);
      size_t ze = form == 108 ? 44 : 56;
      if (form == 120)
        put64(b + 48, 65536);
      put32(b + ze, 7);
      if (opaque)
        put32(b + ze + 16, 4242);
      char name[40];
      snprintf(name, sizeof(name), "blob-%d-%s", form,
               opaque ? "opaque" : "legacy");
      fuzz_write_seed(name, b, (size_t)form);
      b[ze + (opaque ? 21 : 16)] = 1;
      snprintf(name, sizeof(name), "blob-%d-%s-host", form,
               opaque ? "opaque" : "legacy");
      fuzz_write_seed(name, b, (size_t)form);
      if (form == 108 && !opaque)
        fuzz_write_seed("short", b, 107);
    }
  }
  return 0;
}
#endif
