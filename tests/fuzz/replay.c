/* Runs LLVMFuzzerTestOneInput over files, so the corpus is replayed in every
 * build without libFuzzer (zstd's regression driver does the same).
 *
 *   fuzz_replay PATH...           each PATH a file or a directory of inputs
 *   fuzz_replay --make-corpus DIR write the seed corpus: real host handles
 *                                 of several offsets and sizes, plus
 *                                 truncated, mutated and forged ones
 *
 * The exit status is 0 when every input passed (a failing input aborts), 1
 * when no input was found at all, so an empty corpus cannot pass quietly. */
#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "common.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static size_t replayed;

static int replay_file(const char *path) {
  FILE *f = fopen(path, "rb");
  if (f == NULL) {
    fprintf(stderr, "fuzz_replay: %s: %s\n", path, strerror(errno));
    return -1;
  }
  uint8_t *buf = NULL;
  size_t len = 0, cap = 0;
  for (;;) {
    if (len == cap) {
      cap = cap ? cap * 2 : 4096;
      uint8_t *grown = realloc(buf, cap);
      if (grown == NULL) {
        fprintf(stderr, "fuzz_replay: out of memory\n");
        exit(2);
      }
      buf = grown;
    }
    size_t n = fread(buf + len, 1, cap - len, f);
    len += n;
    if (n == 0)
      break;
  }
  fclose(f);
  /* An exact-size copy, so ASan sees a read one past the end. */
  uint8_t *exact = malloc(len ? len : 1);
  memcpy(exact, buf, len);
  free(buf);
  LLVMFuzzerTestOneInput(exact, len);
  free(exact);
  replayed++;
  return 0;
}

static int replay_path(const char *path) {
  struct stat st;
  if (stat(path, &st) != 0) {
    fprintf(stderr, "fuzz_replay: %s: %s\n", path, strerror(errno));
    return -1;
  }
  if (!S_ISDIR(st.st_mode))
    return replay_file(path);
  struct dirent **names;
  int n = scandir(path, &names, NULL, alphasort);
  if (n < 0) {
    fprintf(stderr, "fuzz_replay: %s: %s\n", path, strerror(errno));
    return -1;
  }
  int rc = 0;
  for (int i = 0; i < n; i++) {
    if (names[i]->d_name[0] != '.') {
      char full[4096];
      snprintf(full, sizeof(full), "%s/%s", path, names[i]->d_name);
      struct stat fst;
      if (stat(full, &fst) == 0 && S_ISREG(fst.st_mode) &&
          replay_file(full) != 0)
        rc = -1;
    }
    free(names[i]);
  }
  free(names);
  return rc;
}

/* ---- --make-corpus --------------------------------------------------------
 */

static const char *corpus_dir;
static int written;

static void write_seed(const char *name, const uint8_t *data, size_t len) {
  char path[4096];
  snprintf(path, sizeof(path), "%s/%s", corpus_dir, name);
  FILE *f = fopen(path, "wb");
  if (f == NULL || fwrite(data, 1, len, f) != len) {
    fprintf(stderr, "fuzz_replay: cannot write %s: %s\n", path,
            strerror(errno));
    exit(2);
  }
  fclose(f);
  written++;
}

static void fix_crc(uint8_t *b, size_t len) {
  uint32_t c = usmipc__crc32c(0, b, len - 4);
  for (int i = 0; i < 4; i++)
    b[len - 4 + (size_t)i] = (uint8_t)(c >> (8 * i));
}

static void write_forged(const char *name, const usmipc__wire_t *w) {
  uint8_t out[2048];
  usmipc__wire_encode(w, out);
  write_seed(name, out, usmipc__wire_len(w));
}

static int make_corpus(const char *dir) {
  corpus_dir = dir;
  mkdir(dir, 0755);
  usmipc_device_t *dev;
  int rc = usmipc_device_select("host:cpu", &dev);
  if (rc != 0) {
    fprintf(stderr, "fuzz_replay: %s\n", usmipc_last_error());
    return 2;
  }
  struct {
    size_t size, offset, nbytes;
  } shapes[] = {{4096, 0, 0},
                {65536, 4096, 8192},
                {300000, 12345, 0},
                {1 << 20, (1 << 20) - 1, 1}};
  uint8_t first[2048];
  size_t first_len = 0;
  void *ptrs[4];
  usmipc_ipc_handle_t *handles[4];
  for (int i = 0; i < 4; i++) {
    const void *data;
    size_t len;
    if ((rc = usmipc_malloc(dev, USMIPC_MEM_DEVICE, shapes[i].size,
                            &ptrs[i])) != 0 ||
        (rc = usmipc_ipc_get_handle((uint8_t *)ptrs[i] + shapes[i].offset,
                                    shapes[i].nbytes, &handles[i])) != 0 ||
        (rc = usmipc_ipc_handle_data(handles[i], &data, &len)) != 0) {
      fprintf(stderr, "fuzz_replay: export failed: %s\n", usmipc_last_error());
      return 2;
    }
    char name[64];
    snprintf(name, sizeof(name), "valid-%zu-at-%zu", shapes[i].size,
             shapes[i].offset);
    write_seed(name, data, len);
    if (i == 0) {
      memcpy(first, data, len);
      first_len = len;
    }
  }

  /* Truncations and extensions. */
  static const size_t cuts[] = {0, 1, 8, 11, 12, 70, 167, 208, 211, 212};
  for (size_t i = 0; i < sizeof(cuts) / sizeof(cuts[0]); i++) {
    char name[64];
    snprintf(name, sizeof(name), "truncated-%zu", cuts[i]);
    write_seed(name, first, cuts[i]);
  }
  uint8_t b[1024];
  memcpy(b, first, first_len);
  memset(b + first_len, 0, 16);
  write_seed("trailing-zeros", b, first_len + 16);

  /* Single bit flips in each region of the fixed part. */
  static const size_t flips[] = {0,   8,   10,  12,  14,  16,  20,  24,  28,
                                 40,  56,  64,  72,  80,  88,  96,  104, 112,
                                 128, 144, 170, 190, 201, 205, 208, 210, 213};
  for (size_t i = 0; i < sizeof(flips) / sizeof(flips[0]); i++) {
    memcpy(b, first, first_len);
    b[flips[i]] ^= 0x04;
    char name[64];
    snprintf(name, sizeof(name), "bitflip-byte-%zu", flips[i]);
    write_seed(name, b, first_len);
  }

  /* Well-formed (valid CRC) but wrong: what a forger writes. */
  memcpy(b, first, first_len);
  b[8] = 3; /* version */
  fix_crc(b, first_len);
  write_seed("forged-version-3", b, first_len);
  memcpy(b, first, first_len);
  b[8] = 1; /* version 1: usmipc 0.1 */
  fix_crc(b, first_len);
  write_seed("forged-version-1", b, first_len);
  memcpy(b, first, first_len);
  b[210] = 1; /* extension length that the total length does not hold */
  fix_crc(b, first_len);
  write_seed("forged-ext-len", b, first_len);

  usmipc__wire_t w0, w;
  if (usmipc__wire_decode(first, first_len, &w0) != 0) {
    fprintf(stderr, "fuzz_replay: own handle does not decode: %s\n",
            usmipc_last_error());
    return 2;
  }
  w = w0;
  w.backend = USMIPC_BACKEND_CUDA;
  w.payload.handle_kind = 2;
  w.payload.len = 64;
  for (int i = 0; i < 64; i++)
    w.payload.bytes[i] = (uint8_t)(i * 7);
  write_forged("forged-cuda-payload", &w); /* decodes: a round-trip seed */
  w = w0;
  w.backend = (usmipc_backend_t)9;
  write_forged("forged-backend-9", &w);
  w = w0;
  w.offset = w.allocation_size;
  w.nbytes = 1;
  write_forged("forged-offset-at-end", &w);
  w = w0;
  w.offset = UINT64_MAX - 1;
  w.nbytes = 4;
  write_forged("forged-offset-wraps", &w);
  w = w0;
  w.nbytes = 0;
  write_forged("forged-zero-bytes", &w);
  w = w0;
  w.flags = 0x8001;
  write_forged("forged-unknown-flag", &w);
  w = w0;
  w.pid = 0;
  write_forged("forged-pid-0", &w);
  w = w0;
  w.exporter_base = UINT64_MAX - 16;
  write_forged("forged-base-wraps", &w);
  w = w0;
  w.payload.len = USMIPC__PAYLOAD_MAX;
  memset(w.payload.bytes, 0xff, USMIPC__PAYLOAD_MAX);
  write_forged("forged-max-payload", &w);
  /* Extension records: skipped, critical, truncated, overrunning, many. */
  static const uint8_t ext_ok[] = {0x01, 0x02, 2, 0, 0xaa, 0xbb};
  static const uint8_t ext_critical[] = {0x01, 0x82, 0, 0};
  static const uint8_t ext_short[] = {0x01, 0x02, 1};
  static const uint8_t ext_over[] = {0x01, 0x02, 0xff, 0, 1, 2};
  static const uint8_t ext_type0[] = {0, 0, 1, 0, 9};
  const struct {
    const char *name;
    const uint8_t *bytes;
    size_t len;
  } exts[] = {{"ext-skipped", ext_ok, sizeof(ext_ok)},
              {"ext-critical", ext_critical, sizeof(ext_critical)},
              {"ext-short", ext_short, sizeof(ext_short)},
              {"ext-overrun", ext_over, sizeof(ext_over)},
              {"ext-type-0", ext_type0, sizeof(ext_type0)}};
  for (size_t i = 0; i < sizeof(exts) / sizeof(exts[0]); i++) {
    w = w0;
    memcpy(w.ext, exts[i].bytes, exts[i].len);
    w.ext_len = (uint16_t)exts[i].len;
    write_forged(exts[i].name, &w);
  }
  w = w0;
  for (w.ext_len = 0; w.ext_len + 6 <= 240; w.ext_len += 6)
    memcpy(w.ext + w.ext_len, ext_ok, sizeof(ext_ok));
  write_forged("ext-many", &w);

  for (int i = 0; i < 4; i++) {
    usmipc_ipc_free_handle(handles[i]);
    usmipc_free(ptrs[i]);
  }
  printf("wrote %d seeds to %s\n", written, dir);
  return 0;
}

int main(int argc, char **argv) {
  if (argc == 3 && strcmp(argv[1], "--make-corpus") == 0)
    return make_corpus(argv[2]);
  if (argc < 2) {
    fprintf(stderr, "usage: fuzz_replay PATH... | --make-corpus DIR\n");
    return 2;
  }
  int failed = 0;
  for (int i = 1; i < argc; i++)
    if (replay_path(argv[i]) != 0)
      failed = 1;
  printf("replayed %zu inputs\n", replayed);
  if (failed)
    return 2;
  return replayed > 0 ? 0 : 1;
}
