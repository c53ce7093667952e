/* usmipc_bench_pool: what a pool block costs an importer (issue 11).
 *
 * An exporter process (forked before any driver use) makes a pool with N
 * live blocks of 4 KiB (default 10^5) and one block of each size from 4 KiB
 * to 1 GiB, exports them all, and sends the handles. The importer (this
 * process) opens every block once and keeps them all open (one segment
 * mapping per segment, N block references), then measures, median of
 * batches of 100: an open + close of a block in a mapped segment, per size;
 * and round-robin over the N blocks.
 *
 *   usmipc_bench_pool [--device FILTER] [--blocks N] [--json FILE]
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "harness.h"
#include "usmipc.h"

static void die(const char *what) {
  fprintf(stderr, "bench_pool: %s failed: %s\n", what, usmipc_last_error());
  exit(1);
}

static void write_all(int fd, const void *p, size_t n) {
  while (n > 0) {
    ssize_t w = write(fd, p, n);
    if (w <= 0)
      die("write");
    p = (const uint8_t *)p + w;
    n -= (size_t)w;
  }
}

static void read_all(int fd, void *p, size_t n) {
  while (n > 0) {
    ssize_t r = read(fd, p, n);
    if (r <= 0)
      die("read");
    p = (uint8_t *)p + r;
    n -= (size_t)r;
  }
}

static const size_t sizes[] = {4096,     65536,     1 << 20,
                               16 << 20, 256 << 20, (size_t)1 << 30};
#define NSIZES (sizeof(sizes) / sizeof(sizes[0]))

static void send_handle(int fd, const void *p) {
  usmipc_ipc_handle_t *h;
  const void *data;
  size_t len;
  if (usmipc_ipc_get_handle(p, 0, &h) != 0 ||
      usmipc_ipc_handle_data(h, &data, &len) != 0)
    die("export");
  uint32_t l = (uint32_t)len;
  write_all(fd, &l, 4);
  write_all(fd, data, len);
  usmipc_ipc_free_handle(h);
}

static void exporter(const char *filter, int nblocks, int out, int in) {
  usmipc_device_t *dev;
  usmipc_pool_t *pool;
  if (usmipc_device_select(filter, &dev) != 0 ||
      usmipc_pool_create(dev, 0, 0, &pool) != 0)
    die("pool");
  for (size_t i = 0; i < NSIZES; i++) {
    void *p;
    if (usmipc_pool_malloc(pool, sizes[i], 0, &p) != 0)
      die("pool malloc");
    send_handle(out, p);
  }
  for (int i = 0; i < nblocks; i++) {
    void *p;
    if (usmipc_pool_malloc(pool, 4096, 0, &p) != 0)
      die("pool malloc");
    send_handle(out, p);
  }
  char c;
  while (read(in, &c, 1) > 0) {
  }
  _exit(0);
}

typedef struct {
  uint8_t *data;
  size_t len;
} blob_t;

static blob_t read_handle(int fd) {
  uint32_t l;
  read_all(fd, &l, 4);
  blob_t b = {malloc(l), l};
  read_all(fd, b.data, l);
  return b;
}

int main(int argc, char **argv) {
  bench_name = "usmipc_bench_pool";
  const char *filter = "host:cpu", *json = NULL;
  int nblocks = 100000;
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--device") && i + 1 < argc)
      filter = argv[++i];
    else if (!strcmp(argv[i], "--blocks") && i + 1 < argc)
      nblocks = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--json") && i + 1 < argc)
      json = argv[++i];
    else {
      fprintf(stderr, "usage: %s [--device F] [--blocks N] [--json F]\n",
              argv[0]);
      return 2;
    }
  }
  int from, to;
  pid_t pid = fork_with_pipes(&from, &to);
  if (pid == 0)
    exporter(filter, nblocks, to, from);
  blob_t by_size[NSIZES];
  for (size_t i = 0; i < NSIZES; i++)
    by_size[i] = read_handle(from);
  blob_t *blocks = calloc((size_t)nblocks, sizeof(*blocks));
  for (int i = 0; i < nblocks; i++)
    blocks[i] = read_handle(from);

  usmipc_device_t *dev;
  if (usmipc_device_select(filter, &dev) != 0)
    die("device");
  /* Every block opened once and kept open. */
  double t0 = now_us();
  void **held = calloc((size_t)nblocks, sizeof(*held));
  for (int i = 0; i < nblocks; i++)
    if (usmipc_ipc_open(blocks[i].data, blocks[i].len, dev, 0, &held[i],
                        NULL) != 0)
      die("open block");
  double first_all = now_us() - t0;
  void *size_held[NSIZES];
  for (size_t i = 0; i < NSIZES; i++)
    if (usmipc_ipc_open(by_size[i].data, by_size[i].len, dev, 0, &size_held[i],
                        NULL) != 0)
      die("open sized block");

  double per_size[NSIZES];
  for (size_t s = 0; s < NSIZES; s++) {
    double v[200];
    for (int b = 0; b < 200; b++) {
      double t = now_us();
      for (int k = 0; k < 100; k++) {
        void *p;
        if (usmipc_ipc_open(by_size[s].data, by_size[s].len, dev, 0, &p,
                            NULL) != 0)
          die("reopen");
        usmipc_ipc_close(p);
      }
      v[b] = (now_us() - t) / 100;
    }
    per_size[s] = quantile_nearest(v, 200, 0.5);
  }
  double rr[200];
  int at = 0;
  for (int b = 0; b < 200; b++) {
    double t = now_us();
    for (int k = 0; k < 100; k++, at = (at + 7919) % nblocks) {
      void *p;
      if (usmipc_ipc_open(blocks[at].data, blocks[at].len, dev, 0, &p, NULL) !=
          0)
        die("round robin open");
      usmipc_ipc_close(p);
    }
    rr[b] = (now_us() - t) / 100;
  }
  double round_robin = quantile_nearest(rr, 200, 0.5);

  printf("| usmipc_bench_pool on %s, %d live 4 KiB blocks held open | us |\n",
         filter, nblocks);
  printf("|---|---:|\n");
  printf("| first open of all %d blocks (one segment map), per block | %.3f "
         "|\n",
         nblocks, first_all / nblocks);
  for (size_t s = 0; s < NSIZES; s++)
    printf("| open + close of a %zu-byte block in a mapped segment | %.3f |\n",
           sizes[s], per_size[s]);
  printf("| open + close round-robin over the %d blocks | %.3f |\n", nblocks,
         round_robin);
  if (json) {
    FILE *f = fopen(json, "w");
    if (f) {
      fprintf(f,
              "{\"device\": \"%s\", \"blocks\": %d, "
              "\"first_open_per_block_us\": %.4f, \"round_robin_us\": %.4f, "
              "\"by_size_us\": {",
              filter, nblocks, first_all / nblocks, round_robin);
      for (size_t s = 0; s < NSIZES; s++)
        fprintf(f, "%s\"%zu\": %.4f", s ? ", " : "", sizes[s], per_size[s]);
      fprintf(f, "}}\n");
      fclose(f);
    }
  }
  for (int i = 0; i < nblocks; i++)
    usmipc_ipc_close(held[i]);
  close(to);
  waitpid(pid, NULL, 0);
  return 0;
}
