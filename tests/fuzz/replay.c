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

#include "objects.h"

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

/* ---- --make-corpus: each target writes its own seeds ------------------- */

static const char *corpus_dir;
static int written;

void fuzz_write_seed(const char *name, const uint8_t *data, size_t len) {
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

int fuzz_make_corpus(void);

static int make_corpus(const char *dir) {
  corpus_dir = dir;
  mkdir(dir, 0755);
  int rc = fuzz_make_corpus();
  if (rc == 0)
    printf("wrote %d seeds to %s\n", written, dir);
  return rc;
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
