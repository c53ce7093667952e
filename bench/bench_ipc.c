/* usmipc_bench: what an IPC round trip costs, per call, in microseconds.
 *
 *   usmipc_bench [--device FILTER] [--sizes 4K,1M,64M,256M] [--k 40]
 *                [--rounds 3] [--iters 2000] [--transports socket,pidfd]
 *                [--json FILE]
 *
 * For each size, on one device (default host:cpu):
 *  - export, first: usmipc_ipc_get_handle on a buffer never exported before
 *    (the backend's export and the fd grant), then usmipc_ipc_free_handle;
 *  - export, repeat: usmipc_ipc_get_handle of an already exported buffer;
 *  - first open, per fd transport: this process allocates K fresh buffers
 *    and exports them all; an importer, an unrelated process started by
 *    re-executing this binary with USMIPC_FD_TRANSPORT set, opens each once
 *    and times each open until it holds a usable pointer;
 *  - cached re-open: open + close of a handle the importer already holds
 *    open (the shared, reference-counted mapping), many iterations;
 *  - close: the importer's close of its last reference to a mapping.
 * Each first-open round uses fresh allocations and a fresh importer, so
 * every timed first open really is the first. Medians with p10 and p90 are
 * printed as a Markdown table; --json writes the same numbers.
 * Timing is clock_gettime(CLOCK_MONOTONIC) around each single call. */
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/utsname.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "usmipc.h"

extern char **environ;

#define MAX_SIZES 16
#define MAX_TRANSPORTS 4

static double now_us(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec * 1e6 + (double)ts.tv_nsec * 1e-3;
}

static void die(const char *what, int rc) {
  fprintf(stderr, "usmipc_bench: %s: %s (%s)\n", what,
          rc ? usmipc_err_name(rc) : strerror(errno),
          rc ? usmipc_last_error() : "");
  exit(1);
}

static int write_full(int fd, const void *buf, size_t len) {
  const char *p = buf;
  while (len > 0) {
    ssize_t n = write(fd, p, len);
    if (n < 0 && errno == EINTR)
      continue;
    if (n <= 0)
      return -1;
    p += n;
    len -= (size_t)n;
  }
  return 0;
}

static int read_full(int fd, void *buf, size_t len) {
  char *p = buf;
  while (len > 0) {
    ssize_t n = read(fd, p, len);
    if (n < 0 && errno == EINTR)
      continue;
    if (n <= 0)
      return -1;
    p += n;
    len -= (size_t)n;
  }
  return 0;
}

/* ---- statistics ----------------------------------------------------------- */

typedef struct samples {
  double *v;
  size_t n, cap;
} samples_t;

typedef struct summary {
  double median, p10, p90;
  size_t n;
  int valid;
  char note[96]; /* why there are no numbers */
} summary_t;

static void add(samples_t *s, double x) {
  if (s->n == s->cap) {
    s->cap = s->cap ? s->cap * 2 : 256;
    s->v = realloc(s->v, s->cap * sizeof(double));
    if (s->v == NULL)
      die("out of memory", 0);
  }
  s->v[s->n++] = x;
}

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

static double quantile(const double *sorted, size_t n, double q) {
  double pos = q * (double)(n - 1);
  size_t lo = (size_t)pos;
  size_t hi = lo + 1 < n ? lo + 1 : lo;
  double frac = pos - (double)lo;
  return sorted[lo] * (1 - frac) + sorted[hi] * frac;
}

static summary_t summarize(samples_t *s) {
  summary_t r;
  memset(&r, 0, sizeof(r));
  if (s->n == 0) {
    snprintf(r.note, sizeof(r.note), "no samples");
    return r;
  }
  qsort(s->v, s->n, sizeof(double), cmp_double);
  r.median = quantile(s->v, s->n, 0.5);
  r.p10 = quantile(s->v, s->n, 0.1);
  r.p90 = quantile(s->v, s->n, 0.9);
  r.n = s->n;
  r.valid = 1;
  return r;
}

/* ---- the importer (a separate, unrelated process) --------------------------
 * stdin:  u32 k, u32 iters, u32 verify, then k x (u32 len, bytes)
 * stdout: i32 status, then k doubles (first open), k doubles (close of the
 *         last reference), iters doubles (re-open), iters doubles (close of
 *         a non-last reference); on failure, status < 0 and a 256-byte
 *         message instead. */
static int importer_main(void) {
  uint32_t hdr[3];
  if (read_full(0, hdr, sizeof(hdr)) != 0)
    return 2;
  uint32_t k = hdr[0], iters = hdr[1], verify = hdr[2];
  uint8_t(*handles)[512] = calloc(k, 512);
  uint32_t *lens = calloc(k, sizeof(uint32_t));
  void **ptrs = calloc(k, sizeof(void *));
  size_t ntimes = 2 * (size_t)k + 2 * (size_t)iters;
  double *times = calloc(ntimes, sizeof(double));
  if (!handles || !lens || !ptrs || !times)
    return 2;
  for (uint32_t i = 0; i < k; i++) {
    if (read_full(0, &lens[i], 4) != 0 || lens[i] > 512 ||
        read_full(0, handles[i], lens[i]) != 0)
      return 2;
  }
  int32_t status = 0;
  char msg[256] = {0};
  double *open_first = times, *close_last = times + k;
  double *reopen = times + 2 * k, *reclose = times + 2 * k + iters;

  for (uint32_t i = 0; i < k && status == 0; i++) {
    size_t mapped;
    double t0 = now_us();
    int rc = usmipc_ipc_open(handles[i], lens[i], NULL, 0, &ptrs[i], &mapped);
    double t1 = now_us();
    if (rc != 0) {
      status = rc;
      snprintf(msg, sizeof(msg), "open %u: %s: %s", i, usmipc_err_name(rc),
               usmipc_last_error());
      break;
    }
    open_first[i] = t1 - t0;
    /* Usable: the exporter's marker byte is there (host memory is read
     * directly; other devices are trusted to the driver). */
    if (verify && ((volatile uint8_t *)ptrs[i])[0] != (uint8_t)(i * 7 + 1)) {
      status = USMIPC_EIO;
      snprintf(msg, sizeof(msg), "buffer %u: wrong marker byte", i);
    }
  }
  /* Cached re-open of buffer 0, which stays open meanwhile. */
  for (uint32_t j = 0; j < iters && status == 0; j++) {
    void *p;
    double t0 = now_us();
    int rc = usmipc_ipc_open(handles[0], lens[0], NULL, 0, &p, NULL);
    double t1 = now_us();
    int rc2 = rc == 0 ? usmipc_ipc_close(p) : 0;
    double t2 = now_us();
    if (rc != 0 || rc2 != 0 || p != ptrs[0]) {
      status = rc ? rc : rc2 ? rc2 : USMIPC_EIO;
      snprintf(msg, sizeof(msg), "re-open: %s: %s", usmipc_err_name(status),
               usmipc_last_error());
      break;
    }
    reopen[j] = t1 - t0;
    reclose[j] = t2 - t1;
  }
  for (uint32_t i = 0; i < k && status == 0; i++) {
    double t0 = now_us();
    int rc = usmipc_ipc_close(ptrs[i]);
    double t1 = now_us();
    if (rc != 0) {
      status = rc;
      snprintf(msg, sizeof(msg), "close %u: %s", i, usmipc_last_error());
    }
    close_last[i] = t1 - t0;
  }
  write_full(1, &status, sizeof(status));
  if (status == 0)
    write_full(1, times, ntimes * sizeof(double));
  else
    write_full(1, msg, sizeof(msg));
  return 0;
}

/* Starts `/proc/self/exe --importer` with USMIPC_FD_TRANSPORT=transport. */
static pid_t spawn_importer(const char *transport, int *to, int *from) {
  int in[2], out[2];
  if (pipe2(in, O_CLOEXEC) != 0 || pipe2(out, O_CLOEXEC) != 0)
    die("pipe2", 0);
  size_t n = 0;
  while (environ[n])
    n++;
  char **env = calloc(n + 2, sizeof(char *));
  size_t m = 0;
  for (size_t i = 0; i < n; i++)
    if (strncmp(environ[i], "USMIPC_FD_TRANSPORT=", 20) != 0)
      env[m++] = environ[i];
  char setting[64];
  snprintf(setting, sizeof(setting), "USMIPC_FD_TRANSPORT=%s", transport);
  env[m++] = setting;
  env[m] = NULL;
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, in[0], 0);
  posix_spawn_file_actions_adddup2(&fa, out[1], 1);
  char *argv[] = {"/proc/self/exe", "--importer", NULL};
  pid_t pid;
  int err = posix_spawn(&pid, "/proc/self/exe", &fa, NULL, argv, env);
  posix_spawn_file_actions_destroy(&fa);
  free(env);
  if (err != 0) {
    errno = err;
    die("posix_spawn", 0);
  }
  close(in[0]);
  close(out[1]);
  *to = in[1];
  *from = out[0];
  return pid;
}

/* ---- the exporter: this process ------------------------------------------- */

typedef struct options {
  const char *device;
  const char *json;
  size_t sizes[MAX_SIZES];
  int nsizes;
  const char *transports[MAX_TRANSPORTS];
  int ntransports;
  unsigned k, rounds, iters;
} options_t;

enum {
  M_EXPORT_FIRST,
  M_EXPORT_REPEAT,
  M_FREE_HANDLE,
  M_OPEN_FIRST, /* one per transport, from here */
  M_REOPEN = M_OPEN_FIRST + MAX_TRANSPORTS,
  M_CLOSE_REF,
  M_CLOSE_LAST,
  M_COUNT
};

typedef struct size_result {
  size_t size;
  summary_t m[M_COUNT];
} size_result_t;

static void fill_marker(usmipc_device_t *dev, usmipc_queue_t *q, void *p,
                        uint8_t v) {
  if (usmipc_device_backend(dev) == USMIPC_BACKEND_HOST) {
    *(volatile uint8_t *)p = v;
    return;
  }
  int rc = usmipc_memset(q, p, v, 1);
  if (rc == 0)
    rc = usmipc_queue_synchronize(q);
  if (rc != 0)
    die("usmipc_memset", rc);
}

/* One round of first opens through `transport`: fresh buffers, a fresh
 * importer. The caller's samples get K first opens, K last closes and, when
 * iters > 0, the cached re-open and close timings. */
static int open_round(const options_t *o, usmipc_device_t *dev,
                      usmipc_queue_t *q, size_t size, const char *transport,
                      unsigned iters, samples_t *open_first,
                      samples_t *close_last, samples_t *reopen,
                      samples_t *close_ref, char *note, size_t note_len) {
  void **bufs = calloc(o->k, sizeof(void *));
  usmipc_ipc_handle_t **hs = calloc(o->k, sizeof(*hs));
  for (unsigned i = 0; i < o->k; i++) {
    int rc = usmipc_malloc(dev, USMIPC_MEM_DEVICE, size, &bufs[i]);
    if (rc != 0)
      die("usmipc_malloc", rc);
    fill_marker(dev, q, bufs[i], (uint8_t)(i * 7 + 1));
    if ((rc = usmipc_ipc_get_handle(bufs[i], 0, &hs[i])) != 0)
      die("usmipc_ipc_get_handle", rc);
  }
  int to, from;
  pid_t pid = spawn_importer(transport, &to, &from);
  uint32_t hdr[3] = {o->k, iters,
                     usmipc_device_backend(dev) == USMIPC_BACKEND_HOST};
  int ok = write_full(to, hdr, sizeof(hdr)) == 0;
  for (unsigned i = 0; i < o->k && ok; i++) {
    const void *data;
    size_t len;
    usmipc_ipc_handle_data(hs[i], &data, &len);
    uint32_t l = (uint32_t)len;
    ok = write_full(to, &l, 4) == 0 && write_full(to, data, len) == 0;
  }
  int32_t status = -1;
  if (ok)
    ok = read_full(from, &status, sizeof(status)) == 0;
  int result = 0;
  if (!ok) {
    snprintf(note, note_len, "importer died");
    result = -1;
  } else if (status != 0) {
    char msg[256];
    if (read_full(from, msg, sizeof(msg)) != 0)
      snprintf(msg, sizeof(msg), "importer failed");
    msg[sizeof(msg) - 1] = '\0';
    snprintf(note, note_len, "%s", usmipc_err_name(status));
    fprintf(stderr, "usmipc_bench: %s importer: %s\n", transport, msg);
    result = -1;
  } else {
    size_t ntimes = 2 * (size_t)o->k + 2 * (size_t)iters;
    double *times = calloc(ntimes, sizeof(double));
    if (read_full(from, times, ntimes * sizeof(double)) != 0) {
      snprintf(note, note_len, "importer died");
      result = -1;
    } else {
      for (unsigned i = 0; i < o->k; i++) {
        add(open_first, times[i]);
        add(close_last, times[o->k + i]);
      }
      for (unsigned j = 0; j < iters; j++) {
        add(reopen, times[2 * o->k + j]);
        add(close_ref, times[2 * o->k + iters + j]);
      }
    }
    free(times);
  }
  close(to);
  close(from);
  int st;
  while (waitpid(pid, &st, 0) < 0 && errno == EINTR) {
  }
  for (unsigned i = 0; i < o->k; i++) {
    usmipc_ipc_free_handle(hs[i]);
    usmipc_free(bufs[i]);
  }
  free(hs);
  free(bufs);
  return result;
}

static void bench_size(const options_t *o, usmipc_device_t *dev,
                       usmipc_queue_t *q, size_t size, size_result_t *res) {
  samples_t s[M_COUNT];
  memset(s, 0, sizeof(s));
  memset(res, 0, sizeof(*res));
  res->size = size;

  /* Export: K fresh buffers, K rounds' worth of first exports. */
  for (unsigned round = 0; round < o->rounds; round++) {
    void **bufs = calloc(o->k, sizeof(void *));
    for (unsigned i = 0; i < o->k; i++) {
      int rc = usmipc_malloc(dev, USMIPC_MEM_DEVICE, size, &bufs[i]);
      if (rc != 0)
        die("usmipc_malloc", rc);
    }
    for (unsigned i = 0; i < o->k; i++) {
      usmipc_ipc_handle_t *h;
      double t0 = now_us();
      int rc = usmipc_ipc_get_handle(bufs[i], 0, &h);
      double t1 = now_us();
      usmipc_ipc_free_handle(h);
      double t2 = now_us();
      if (rc != 0)
        die("usmipc_ipc_get_handle", rc);
      add(&s[M_EXPORT_FIRST], t1 - t0);
      add(&s[M_FREE_HANDLE], t2 - t1);
    }
    if (round == 0) {
      for (unsigned j = 0; j < o->iters; j++) {
        usmipc_ipc_handle_t *h;
        double t0 = now_us();
        int rc = usmipc_ipc_get_handle(bufs[j % o->k], 0, &h);
        double t1 = now_us();
        usmipc_ipc_free_handle(h);
        double t2 = now_us();
        if (rc != 0)
          die("usmipc_ipc_get_handle (repeat)", rc);
        add(&s[M_EXPORT_REPEAT], t1 - t0);
        add(&s[M_FREE_HANDLE], t2 - t1);
      }
    }
    for (unsigned i = 0; i < o->k; i++)
      usmipc_free(bufs[i]);
    free(bufs);
  }

  /* First opens per transport; the first transport's importer also times
   * cached re-opens in its first round. */
  for (int t = 0; t < o->ntransports; t++) {
    char note[96] = "";
    int failed = 0;
    for (unsigned round = 0; round < o->rounds && !failed; round++) {
      unsigned iters = (t == 0 && round == 0) ? o->iters : 0;
      if (open_round(o, dev, q, size, o->transports[t], iters,
                     &s[M_OPEN_FIRST + t], &s[M_CLOSE_LAST], &s[M_REOPEN],
                     &s[M_CLOSE_REF], note, sizeof(note)) != 0)
        failed = 1;
    }
    res->m[M_OPEN_FIRST + t] = summarize(&s[M_OPEN_FIRST + t]);
    if (failed) {
      res->m[M_OPEN_FIRST + t].valid = 0;
      snprintf(res->m[M_OPEN_FIRST + t].note,
               sizeof(res->m[M_OPEN_FIRST + t].note), "%s", note);
    }
  }
  for (int m = 0; m < M_COUNT; m++) {
    if (m >= M_OPEN_FIRST && m < M_OPEN_FIRST + MAX_TRANSPORTS)
      continue;
    res->m[m] = summarize(&s[m]);
  }
  for (int m = 0; m < M_COUNT; m++)
    free(s[m].v);
}

/* ---- output --------------------------------------------------------------- */

static void size_label(size_t size, char *out, size_t len) {
  if (size >= (1u << 30) && size % (1u << 30) == 0)
    snprintf(out, len, "%zu GiB", size >> 30);
  else if (size >= (1u << 20) && size % (1u << 20) == 0)
    snprintf(out, len, "%zu MiB", size >> 20);
  else if (size >= 1024 && size % 1024 == 0)
    snprintf(out, len, "%zu KiB", size >> 10);
  else
    snprintf(out, len, "%zu B", size);
}

static void cell(const summary_t *s) {
  if (!s->valid)
    printf(" n/a (%s) |", s->note[0] ? s->note : "not measured");
  else
    printf(" %.2f (%.2f–%.2f) |", s->median, s->p10, s->p90);
}

static const char *metric_key(const options_t *o, int m, char *buf,
                              size_t len) {
  switch (m) {
  case M_EXPORT_FIRST:
    return "export_first";
  case M_EXPORT_REPEAT:
    return "export_repeat";
  case M_FREE_HANDLE:
    return "free_handle";
  case M_REOPEN:
    return "reopen_cached";
  case M_CLOSE_REF:
    return "close_ref";
  case M_CLOSE_LAST:
    return "close_last";
  default:
    if (m - M_OPEN_FIRST < o->ntransports) {
      snprintf(buf, len, "open_first_%s", o->transports[m - M_OPEN_FIRST]);
      return buf;
    }
    return NULL;
  }
}

static void print_table(const options_t *o, const size_result_t *res) {
  printf("| size | export, first | export, repeat | free_handle |");
  for (int t = 0; t < o->ntransports; t++)
    printf(" first open (%s) |", o->transports[t]);
  printf(" re-open (cached) | close (not last) | close (last) |\n");
  printf("|---|---|---|---|");
  for (int t = 0; t < o->ntransports; t++)
    printf("---|");
  printf("---|---|---|\n");
  for (int i = 0; i < o->nsizes; i++) {
    char label[32];
    size_label(res[i].size, label, sizeof(label));
    printf("| %s |", label);
    cell(&res[i].m[M_EXPORT_FIRST]);
    cell(&res[i].m[M_EXPORT_REPEAT]);
    cell(&res[i].m[M_FREE_HANDLE]);
    for (int t = 0; t < o->ntransports; t++)
      cell(&res[i].m[M_OPEN_FIRST + t]);
    cell(&res[i].m[M_REOPEN]);
    cell(&res[i].m[M_CLOSE_REF]);
    cell(&res[i].m[M_CLOSE_LAST]);
    printf("\n");
  }
  printf("\nMedians in microseconds, (p10–p90) in parentheses.\n");
}

static void write_json(const options_t *o, usmipc_device_t *dev,
                       const size_result_t *res) {
  FILE *f = fopen(o->json, "w");
  if (f == NULL) {
    fprintf(stderr, "usmipc_bench: %s: %s\n", o->json, strerror(errno));
    exit(1);
  }
  struct utsname u;
  uname(&u);
  fprintf(f, "{\n  \"tool\": \"usmipc_bench\",\n  \"usmipc_version\": \"%s\",\n",
          usmipc_version_string());
  fprintf(f, "  \"device\": \"%s\",\n  \"device_name\": \"%s\",\n",
          usmipc_device_filter_string(dev), usmipc_device_name(dev));
  fprintf(f, "  \"kernel\": \"%s\",\n  \"unit\": \"us\",\n", u.release);
  fprintf(f, "  \"k\": %u,\n  \"rounds\": %u,\n  \"iters\": %u,\n", o->k,
          o->rounds, o->iters);
  fprintf(f, "  \"results\": [\n");
  for (int i = 0; i < o->nsizes; i++) {
    fprintf(f, "    {\"size\": %zu", res[i].size);
    for (int m = 0; m < M_COUNT; m++) {
      char buf[64];
      const char *key = metric_key(o, m, buf, sizeof(buf));
      if (key == NULL)
        continue;
      const summary_t *s = &res[i].m[m];
      if (s->valid)
        fprintf(f,
                ",\n      \"%s\": {\"median\": %.3f, \"p10\": %.3f, "
                "\"p90\": %.3f, \"n\": %zu}",
                key, s->median, s->p10, s->p90, s->n);
      else
        fprintf(f, ",\n      \"%s\": {\"error\": \"%s\"}", key,
                s->note[0] ? s->note : "not measured");
    }
    fprintf(f, "}%s\n", i + 1 < o->nsizes ? "," : "");
  }
  fprintf(f, "  ]\n}\n");
  fclose(f);
}

/* ---- arguments ------------------------------------------------------------ */

static size_t parse_size(const char *s) {
  char *end;
  unsigned long long v = strtoull(s, &end, 10);
  switch (*end) {
  case 'k': case 'K': v <<= 10; break;
  case 'm': case 'M': v <<= 20; break;
  case 'g': case 'G': v <<= 30; break;
  default: break;
  }
  return (size_t)v;
}

static void usage(void) {
  fprintf(stderr,
          "usage: usmipc_bench [--device FILTER] [--sizes 4K,1M,64M,256M]\n"
          "                    [--k 40] [--rounds 3] [--iters 2000]\n"
          "                    [--transports socket,pidfd] [--json FILE]\n");
  exit(2);
}

int main(int argc, char **argv) {
  if (argc == 2 && strcmp(argv[1], "--importer") == 0)
    return importer_main();
  signal(SIGPIPE, SIG_IGN);

  options_t o;
  memset(&o, 0, sizeof(o));
  o.device = "host:cpu";
  o.k = 40;
  o.rounds = 3;
  o.iters = 2000;
  static const size_t default_sizes[] = {4 << 10, 1 << 20, 64 << 20, 256 << 20};
  for (int i = 0; i < 4; i++)
    o.sizes[o.nsizes++] = default_sizes[i];
  o.transports[0] = "socket";
  o.transports[1] = "pidfd";
  o.ntransports = 2;
  static char sizes_buf[256], transports_buf[128];

  for (int i = 1; i < argc; i++) {
    const char *a = argv[i];
    const char *v = i + 1 < argc ? argv[i + 1] : NULL;
    if (strcmp(a, "-h") == 0 || strcmp(a, "--help") == 0)
      usage();
    if (v == NULL)
      usage();
    i++;
    if (strcmp(a, "--device") == 0) {
      o.device = v;
    } else if (strcmp(a, "--json") == 0) {
      o.json = v;
    } else if (strcmp(a, "--k") == 0) {
      o.k = (unsigned)strtoul(v, NULL, 10);
    } else if (strcmp(a, "--rounds") == 0) {
      o.rounds = (unsigned)strtoul(v, NULL, 10);
    } else if (strcmp(a, "--iters") == 0) {
      o.iters = (unsigned)strtoul(v, NULL, 10);
    } else if (strcmp(a, "--sizes") == 0) {
      snprintf(sizes_buf, sizeof(sizes_buf), "%s", v);
      o.nsizes = 0;
      for (char *tok = strtok(sizes_buf, ","); tok && o.nsizes < MAX_SIZES;
           tok = strtok(NULL, ","))
        o.sizes[o.nsizes++] = parse_size(tok);
    } else if (strcmp(a, "--transports") == 0) {
      snprintf(transports_buf, sizeof(transports_buf), "%s", v);
      o.ntransports = 0;
      for (char *tok = strtok(transports_buf, ",");
           tok && o.ntransports < MAX_TRANSPORTS; tok = strtok(NULL, ","))
        o.transports[o.ntransports++] = tok;
    } else {
      usage();
    }
  }
  if (o.k == 0 || o.rounds == 0 || o.nsizes == 0 || o.ntransports == 0)
    usage();
  for (int i = 0; i < o.nsizes; i++)
    if (o.sizes[i] == 0)
      usage();

  usmipc_device_t *dev;
  int rc = usmipc_device_select(o.device, &dev);
  if (rc != 0)
    die(o.device, rc);
  if (!usmipc_device_has_ipc(dev)) {
    fprintf(stderr, "usmipc_bench: %s does not support IPC memory\n", o.device);
    return 1;
  }
  usmipc_queue_t *q;
  if ((rc = usmipc_queue_create(dev, &q)) != 0)
    die("usmipc_queue_create", rc);

  /* Warm-up: the first export of the process starts the fd broker, a
   * one-time cost that belongs to no single export. */
  void *warm = NULL;
  usmipc_ipc_handle_t *wh = NULL;
  if ((rc = usmipc_malloc(dev, USMIPC_MEM_DEVICE, 4096, &warm)) != 0 ||
      (rc = usmipc_ipc_get_handle(warm, 0, &wh)) != 0)
    die("warm-up export", rc);
  usmipc_ipc_free_handle(wh);
  usmipc_free(warm);

  printf("# usmipc_bench %s on %s (%s)\n\n", usmipc_version_string(),
         usmipc_device_filter_string(dev), usmipc_device_name(dev));
  printf("K = %u fresh buffers per first-open round, %u rounds, %u "
         "iterations for repeat export and cached re-open.\n\n",
         o.k, o.rounds, o.iters);
  fflush(stdout);

  size_result_t res[MAX_SIZES];
  for (int i = 0; i < o.nsizes; i++)
    bench_size(&o, dev, q, o.sizes[i], &res[i]);
  print_table(&o, res);
  if (o.json)
    write_json(&o, dev, res);
  usmipc_queue_destroy(q);
  return 0;
}
