/* usmipc_bench_event: what events cost, in C (issue 10's targets).
 *
 * An exporter process (forked before anything touches a driver) measures
 * its own side: usmipc_ipc_handle_order (a ring event recorded on a queue
 * and put in a memory handle), usmipc_ipc_get_event_handle of an event
 * already exported, usmipc_event_record. The importer (this process)
 * measures: the first usmipc_ipc_open_event of K distinct events against
 * the bare cuIpcOpenEventHandle of K others (CUDA only: the raw handle is
 * the 64-byte payload), a cached re-open (open + destroy of an event it
 * opened before), usmipc_event_wait on a queue, and an ordered cached
 * re-open of memory (usmipc_ipc_open_ex with a queue, then close).
 *
 *   usmipc_bench_event [--device FILTER] [--k 200] [--iters 20000]
 *                      [--json FILE]
 */
#include <dlfcn.h>
#include <inttypes.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "harness.h"
#include "usmipc.h"

#define HANDLE_MAX 1024

static const char *device_filter = "host:cpu";
static int k = 200, iters = 20000;

static void die(const char *what) {
  fprintf(stderr, "bench_event: %s failed: %s\n", what, usmipc_last_error());
  exit(1);
}

static void put_hex(FILE *f, const void *data, size_t len) {
  for (size_t i = 0; i < len; i++)
    fprintf(f, "%02x", ((const uint8_t *)data)[i]);
  fputc('\n', f);
}

static size_t get_hex(FILE *f, uint8_t *out) {
  static char line[2 * HANDLE_MAX + 2];
  if (!fgets(line, sizeof(line), f))
    die("reading a handle");
  size_t n = strcspn(line, "\n") / 2;
  for (size_t i = 0; i < n; i++) {
    unsigned v;
    sscanf(line + 2 * i, "%2x", &v);
    out[i] = (uint8_t)v;
  }
  return n;
}

/* Median of the per-call time of fn over iters calls, in batches of 100. */
#define TIME_MEDIAN(result, body)                                              \
  do {                                                                         \
    int batches_ = iters / 100 > 0 ? iters / 100 : 1;                          \
    double *v_ = malloc(sizeof(double) * (size_t)batches_);                    \
    for (int b_ = 0; b_ < batches_; b_++) {                                    \
      double t0_ = now_us();                                                   \
      for (int i_ = 0; i_ < 100; i_++) {                                       \
        body;                                                                  \
      }                                                                        \
      v_[b_] = (now_us() - t0_) / 100;                                         \
    }                                                                          \
    result = quantile_nearest(v_, batches_, 0.5);                              \
    free(v_);                                                                  \
  } while (0)

static void exporter_main(FILE *out, int in) {
  usmipc_device_t *dev;
  usmipc_queue_t *q;
  if (usmipc_device_select(device_filter, &dev) != 0 ||
      usmipc_queue_create(dev, &q) != 0)
    die("exporter device");
  usmipc_event_t **evs = calloc((size_t)k, sizeof(*evs));
  for (int i = 0; i < k; i++) {
    usmipc_ipc_handle_t *h;
    const void *data;
    size_t len;
    if (usmipc_event_create(dev, 0, &evs[i]) != 0 ||
        usmipc_event_record(evs[i], q) != 0 ||
        usmipc_ipc_get_event_handle(evs[i], &h) != 0 ||
        usmipc_ipc_handle_data(h, &data, &len) != 0)
      die("exporting an event");
    put_hex(out, data, len);
    usmipc_ipc_free_handle(h);
  }
  void *p;
  usmipc_ipc_handle_t *mh;
  const void *data;
  size_t len;
  if (usmipc_malloc(dev, USMIPC_MEM_DEVICE, 4096, &p) != 0 ||
      usmipc_ipc_get_handle(p, 0, &mh) != 0 ||
      usmipc_ipc_handle_order(mh, q) != 0 ||
      usmipc_ipc_handle_data(mh, &data, &len) != 0)
    die("ordered export");
  put_hex(out, data, len);
  usmipc_queue_synchronize(q);

  double t_order, t_handle, t_record;
  usmipc_ipc_handle_t *mh2;
  if (usmipc_ipc_get_handle(p, 0, &mh2) != 0)
    die("export");
  TIME_MEDIAN(t_order, {
    if (usmipc_ipc_handle_order(mh2, q) != 0)
      die("order");
  });
  usmipc_queue_synchronize(q);
  TIME_MEDIAN(t_handle, {
    usmipc_ipc_handle_t *h;
    if (usmipc_ipc_get_event_handle(evs[0], &h) != 0)
      die("event handle");
    usmipc_ipc_free_handle(h);
  });
  usmipc_event_t *spare;
  if (usmipc_event_create(dev, 0, &spare) != 0)
    die("event");
  TIME_MEDIAN(t_record, {
    if (usmipc_event_record(spare, q) != 0)
      die("record");
  });
  usmipc_queue_synchronize(q);
  fprintf(out, "%.4f %.4f %.4f\n", t_order, t_handle, t_record);
  fflush(out);
  char c;
  while (read(in, &c, 1) > 0) {
  }
  _exit(0);
}

/* The bare driver call's handle, for the CUDA baseline. */
typedef struct {
  char b[64];
} raw_event_handle_t;

int main(int argc, char **argv) {
  bench_name = "usmipc_bench_event";
  const char *json = NULL;
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--device") && i + 1 < argc)
      device_filter = argv[++i];
    else if (!strcmp(argv[i], "--k") && i + 1 < argc)
      k = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--iters") && i + 1 < argc)
      iters = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--json") && i + 1 < argc)
      json = argv[++i];
    else {
      fprintf(stderr, "usage: %s [--device F] [--k N] [--iters N] [--json F]\n",
              argv[0]);
      return 2;
    }
  }
  if (k < 4)
    k = 4;
  /* Fork first: no driver may be initialised in the parent yet. */
  int from_fd, to_fd;
  pid_t pid = fork_with_pipes(&from_fd, &to_fd);
  if (pid == 0)
    exporter_main(fdopen(to_fd, "w"), from_fd);
  FILE *from = fdopen(from_fd, "r");
  uint8_t(*handles)[HANDLE_MAX] = calloc((size_t)k, HANDLE_MAX);
  size_t *lens = calloc((size_t)k, sizeof(size_t));
  for (int i = 0; i < k; i++)
    lens[i] = get_hex(from, handles[i]);
  static uint8_t mem[HANDLE_MAX];
  size_t mem_len = get_hex(from, mem);
  double t_order, t_handle, t_record;
  if (fscanf(from, "%lf %lf %lf", &t_order, &t_handle, &t_record) != 3)
    die("exporter results");

  usmipc_device_t *dev;
  usmipc_queue_t *q;
  if (usmipc_device_select(device_filter, &dev) != 0 ||
      usmipc_queue_create(dev, &q) != 0)
    die("importer device");
  int cuda = usmipc_device_backend(dev) == USMIPC_BACKEND_CUDA;

  /* First opens: usmipc on the first half, the bare driver on the second
   * (CUDA), alternating so that drift hits both alike. */
  int half = k / 2;
  double *first = calloc((size_t)half, sizeof(double));
  double *raw = calloc((size_t)half, sizeof(double));
  int nraw = 0;
  int (*open_raw)(void **, raw_event_handle_t) = NULL;
  if (cuda) {
    /* The bare call needs a current context: the primary one, as usmipc's
     * (which pushes and pops its own around each call). */
    void *lib = dlopen("libcuda.so.1", RTLD_NOW);
    int (*get)(int *, int) =
        lib ? (int (*)(int *, int))dlsym(lib, "cuDeviceGet") : NULL;
    int (*retain)(void **, int) =
        lib ? (int (*)(void **, int))dlsym(lib, "cuDevicePrimaryCtxRetain")
            : NULL;
    int (*set)(void *) =
        lib ? (int (*)(void *))dlsym(lib, "cuCtxSetCurrent") : NULL;
    int cu_dev;
    void *ctx;
    if (get && retain && set && get(&cu_dev, usmipc_device_index(dev)) == 0 &&
        retain(&ctx, cu_dev) == 0 && set(ctx) == 0)
      open_raw = (int (*)(void **, raw_event_handle_t))dlsym(
          lib, "cuIpcOpenEventHandle");
  }
  usmipc_event_t **opened = calloc((size_t)half, sizeof(*opened));
  for (int i = 0; i < half; i++) {
    double t0 = now_us();
    if (usmipc_ipc_open_event(handles[i], lens[i], dev, &opened[i]) != 0)
      die("first open");
    first[i] = now_us() - t0;
    if (open_raw != NULL) {
      /* The payload (the CUipcEventHandle) follows the 212 fixed bytes. */
      raw_event_handle_t h;
      memcpy(&h, handles[half + i] + 212, 64);
      void *ev;
      t0 = now_us();
      int r = open_raw(&ev, h);
      double t = now_us() - t0;
      if (r == 0)
        raw[nraw++] = t;
    }
  }
  double first_med = quantile_nearest(first, half, 0.5);
  double raw_med = nraw ? quantile_nearest(raw, nraw, 0.5) : 0;

  double t_cached, t_wait, t_ordered;
  TIME_MEDIAN(t_cached, {
    usmipc_event_t *e;
    if (usmipc_ipc_open_event(handles[0], lens[0], dev, &e) != 0)
      die("cached open");
    usmipc_event_destroy(e);
  });
  TIME_MEDIAN(t_wait, {
    if (usmipc_event_wait(opened[0], q) != 0)
      die("wait");
  });
  usmipc_queue_synchronize(q);
  TIME_MEDIAN(t_ordered, {
    void *p;
    if (usmipc_ipc_open_ex(mem, mem_len, dev, 0, q, 0, &p, NULL) != 0)
      die("ordered open");
    usmipc_ipc_close(p);
  });
  usmipc_queue_synchronize(q);

  printf("| usmipc_bench_event on %s | us |\n|---|---:|\n", device_filter);
  printf("| usmipc_ipc_handle_order (ring event recorded + encoded) | %.3f |\n",
         t_order);
  printf("| usmipc_ipc_get_event_handle (exported before) | %.3f |\n",
         t_handle);
  printf("| usmipc_event_record | %.3f |\n", t_record);
  printf("| first usmipc_ipc_open_event (median of %d) | %.2f |\n", half,
         first_med);
  if (nraw)
    printf("| first bare cuIpcOpenEventHandle (median of %d) | %.2f |\n", nraw,
           raw_med);
  printf("| cached usmipc_ipc_open_event + destroy | %.3f |\n", t_cached);
  printf("| usmipc_event_wait on a queue | %.3f |\n", t_wait);
  printf("| ordered cached re-open (open_ex with a queue + close) | %.3f |\n",
         t_ordered);
  if (nraw)
    printf("first open / bare driver: %.3fx\n", first_med / raw_med);
  if (json) {
    FILE *f = fopen(json, "w");
    if (f) {
      fprintf(f,
              "{\"device\": \"%s\", \"k\": %d, \"iters\": %d, "
              "\"order_us\": %.4f, \"get_event_handle_us\": %.4f, "
              "\"record_us\": %.4f, \"first_open_us\": %.3f, "
              "\"raw_first_open_us\": %.3f, \"cached_open_us\": %.4f, "
              "\"wait_us\": %.4f, \"ordered_reopen_us\": %.4f}\n",
              device_filter, k, iters, t_order, t_handle, t_record, first_med,
              raw_med, t_cached, t_wait, t_ordered);
      fclose(f);
    }
  }
  for (int i = 0; i < half; i++)
    usmipc_event_destroy(opened[i]);
  close(to_fd);
  waitpid(pid, NULL, 0);
  return 0;
}
