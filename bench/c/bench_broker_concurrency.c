/* usmipc_bench_broker: many importers opening host memory of one exporter at
 * once, against a lone importer (the broker-concurrency target: N
 * importers opening at once each see a median open <= 2x a lone
 * importer's), and the exporter's throughput in opens per second.
 *
 *   usmipc_bench_broker [--importers N] [--opens K] [--size BYTES]
 *                       [--rounds R] [--transport socket|pidfd|both]
 *                       [--json FILE]
 *
 * One exporter process allocates N x (K + 1) buffers of --size bytes
 * ("host:cpu"), fills and exports them, and writes the handles into a
 * MAP_SHARED region set up before any fork. Every importer is a fork of a
 * parent that never calls into usmipc, sets USMIPC_FD_TRANSPORT before its
 * first usmipc call, and opens buffers of its own that no process opened
 * in that run. A run of n importers:
 *
 *  1. every importer selects the host device, then waits at barrier 1;
 *  2. released together, each makes its first contact with the exporter
 *     (proof of identity, the export table, its first buffer): reported
 *     apart as "first contact";
 *  3. each waits at barrier 2; released together, each opens its K other
 *     buffers one after the other (usmipc_ipc_open, first byte touched,
 *     kept open), timing each open with CLOCK_MONOTONIC.
 *
 * Barriers are futexes in the shared region; the parent releases one once
 * all n importers wait at it. Throughput is n x K over the wall time from
 * the release of barrier 2 to the last importer's last open.
 *
 * For each transport, runs of 1 importer (lone) and of N alternate, R
 * rounds each (default 5), after one unreported lone run. Per run: the median
 * and p90 of all n x K warm opens, the median of the worst importer (the
 * largest of the n per-importer medians), the median first contact, opens per
 * second. Per configuration, the median of those over the rounds. The
 * target is judged on the worst importer, since each importer is to see
 * a median <= 2x the lone one: ratio = worst importer's median (N) /
 * median (lone). The ratio of pooled medians is printed beside it.
 *
 * The pidfd transport is measured for context. Importers are the
 * exporter's siblings, not its descendants: the exporter names the parent
 * its ptracer (PR_SET_PTRACER) so that Yama's ptrace_scope=1 lets
 * pidfd_getfd through; where it is still refused, the transport is
 * skipped with a note. */
#include <errno.h>
#include <limits.h>
#include <linux/futex.h>
#include <signal.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "harness.h"
#include "usmipc.h"

#ifndef PR_SET_PTRACER
#define PR_SET_PTRACER 0x59616d61
#endif

#define HANDLE_SLOT 2048 /* a handle is at most 1752 bytes */
#define ERR_LEN 512
#define BARRIER_TIMEOUT_S 60
#define ALIGN64(x) (((x) + 63) & ~(size_t)63)

__attribute__((noreturn)) static void die(const char *what) {
  fprintf(stderr, "usmipc_bench_broker: %s: %s\n", what, strerror(errno));
  exit(1);
}

/* ---- the shared region ---------------------------------------------------
 */

typedef struct handle_slot {
  uint32_t len;
  uint8_t bytes[HANDLE_SLOT - sizeof(uint32_t)];
} handle_slot_t;

typedef struct result {
  _Alignas(64) double first_us; /* the first contact */
  double end_us; /* CLOCK_MONOTONIC when the last open returned */
  int failed;
  char err[ERR_LEN];
} result_t;

typedef struct ctl {
  _Atomic uint32_t exporter_state; /* 0 starting, 1 ready, 2 failed */
  _Atomic uint32_t quit;           /* the exporter exits when set */
  char exporter_err[ERR_LEN];
  _Atomic uint32_t waiting[2]; /* importers waiting at barrier b */
  _Atomic uint32_t gate[2];    /* barrier b released */
  _Atomic uint32_t abort_run;  /* released because the run failed */
} ctl_t;

static ctl_t *ctl;
static handle_slot_t *handles;
static result_t *results;
static double *samples; /* importer i's K opens at [i * K] */

static size_t size = 4096;
static int opens = 200;

static long futex(_Atomic uint32_t *word, int op, uint32_t val,
                  const struct timespec *timeout) {
  return syscall(SYS_futex, (void *)word, op, val, timeout, NULL, 0);
}

static void futex_wake_all(_Atomic uint32_t *word) {
  futex(word, FUTEX_WAKE, INT_MAX, NULL);
}

/* ---- the exporter -------------------------------------------------------- */

__attribute__((noreturn)) static void exporter_fail(const char *what) {
  snprintf(ctl->exporter_err, ERR_LEN, "%s: %s", what, usmipc_last_error());
  atomic_store(&ctl->exporter_state, 2);
  futex_wake_all(&ctl->exporter_state);
  _exit(1);
}

static void exporter_main(pid_t parent, int m) {
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (getppid() != parent)
    _exit(1);
  /* For pidfd_getfd under Yama ptrace_scope=1: the parent and its
   * descendants (the importers) may take our descriptors. EINVAL without
   * Yama. */
  prctl(PR_SET_PTRACER, (unsigned long)parent, 0, 0, 0);
  struct rlimit rl;
  if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max) {
    rl.rlim_cur = rl.rlim_max;
    setrlimit(RLIMIT_NOFILE, &rl);
  }
  usmipc_device_t *dev;
  if (usmipc_device_select("host:cpu", &dev) != 0)
    exporter_fail("usmipc_device_select(host:cpu)");
  for (int i = 0; i < m; i++) {
    void *p;
    usmipc_ipc_handle_t *h;
    const void *data;
    size_t len;
    if (usmipc_malloc(dev, USMIPC_MEM_DEVICE, size, &p) != 0)
      exporter_fail("usmipc_malloc");
    memset(p, 1 + i % 255, size);
    if (usmipc_ipc_get_handle(p, 0, &h) != 0 ||
        usmipc_ipc_handle_data(h, &data, &len) != 0)
      exporter_fail("usmipc_ipc_get_handle");
    if (len > sizeof(handles[i].bytes)) {
      errno = EOVERFLOW;
      exporter_fail("handle too long");
    }
    memcpy(handles[i].bytes, data, len);
    handles[i].len = (uint32_t)len;
    /* The bytes stay openable while the memory lives. */
    usmipc_ipc_free_handle(h);
  }
  atomic_store(&ctl->exporter_state, 1);
  futex_wake_all(&ctl->exporter_state);
  while (atomic_load(&ctl->quit) == 0)
    futex(&ctl->quit, FUTEX_WAIT, 0, NULL);
  exit(0); /* the library's exit handlers run */
}

/* ---- an importer --------------------------------------------------------- */

static volatile uint8_t sink;

static void barrier(int b) {
  atomic_fetch_add(&ctl->waiting[b], 1);
  futex(&ctl->waiting[b], FUTEX_WAKE, 1, NULL); /* the parent */
  while (atomic_load(&ctl->gate[b]) == 0)
    futex(&ctl->gate[b], FUTEX_WAIT, 0, NULL);
}

__attribute__((noreturn)) static void importer_fail(result_t *r,
                                                    const char *what) {
  snprintf(r->err, ERR_LEN, "%s: %s", what, usmipc_last_error());
  r->failed = 1;
  _exit(1);
}

static double open_one(result_t *r, int buffer) {
  void *p;
  double t0 = now_us();
  if (usmipc_ipc_open(handles[buffer].bytes, handles[buffer].len, NULL, 0, &p,
                      NULL) != 0)
    importer_fail(r, "usmipc_ipc_open");
  sink ^= *(volatile const uint8_t *)p;
  return now_us() - t0; /* kept open until exit */
}

static void importer_main(pid_t parent, int index, const char *transport) {
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (getppid() != parent)
    _exit(1);
  result_t *r = &results[index];
  setenv("USMIPC_FD_TRANSPORT", transport, 1);
  usmipc_device_t *dev;
  if (usmipc_device_select("host:cpu", &dev) != 0)
    importer_fail(r, "usmipc_device_select(host:cpu)");
  int base = index * (opens + 1);
  barrier(0);
  if (atomic_load(&ctl->abort_run))
    _exit(1);
  r->first_us = open_one(r, base);
  barrier(1);
  if (atomic_load(&ctl->abort_run))
    _exit(1);
  /* Timed into private memory: no shared cache line is written while
   * the importers run. */
  double *mine = malloc(sizeof(double) * (size_t)opens);
  if (!mine)
    _exit(1);
  for (int j = 0; j < opens; j++)
    mine[j] = open_one(r, base + 1 + j);
  r->end_us = now_us();
  memcpy(&samples[(size_t)index * (size_t)opens], mine,
         sizeof(double) * (size_t)opens);
  exit(0);
}

/* ---- one run ------------------------------------------------------------- */

static double median_of(const double *v, int n) {
  double *c = malloc(sizeof(double) * (size_t)n);
  memcpy(c, v, sizeof(double) * (size_t)n);
  double m = quantile_nearest(c, n, 0.5);
  free(c);
  return m;
}

typedef struct run_stats {
  double median_us, p90_us, worst_median_us, first_median_us, opens_per_s,
      wall_s;
  double *samples;  /* n x K, importer after importer */
  double *first_us; /* n */
} run_stats_t;

/* Records why the run failed: the first importer's message, else what. */
static void run_error(int n, const char *what, char *err) {
  for (int i = 0; i < n; i++)
    if (results[i].failed) {
      snprintf(err, ERR_LEN, "importer %d: %.480s", i, results[i].err);
      return;
    }
  snprintf(err, ERR_LEN, "%s", what);
}

static pid_t *pids; /* the importers of the run, --importers of them */
static int *alive;

/* Waits until all n importers wait at barrier b; nonzero when one exited
 * (its message in its result) or after BARRIER_TIMEOUT_S. */
static int wait_at(int b, int n) {
  double deadline = now_us() + BARRIER_TIMEOUT_S * 1e6;
  for (;;) {
    uint32_t w = atomic_load(&ctl->waiting[b]);
    if (w >= (uint32_t)n)
      return 0;
    struct timespec ts = {.tv_sec = 0, .tv_nsec = 10 * 1000 * 1000};
    futex(&ctl->waiting[b], FUTEX_WAIT, w, &ts);
    for (int i = 0; i < n; i++) {
      int st;
      if (alive[i] && waitpid(pids[i], &st, WNOHANG) == pids[i]) {
        alive[i] = 0;
        return -1;
      }
    }
    if (now_us() > deadline)
      return -1;
  }
}

static void release(int b) {
  atomic_store(&ctl->gate[b], 1);
  futex_wake_all(&ctl->gate[b]);
}

static int run_once(int n, const char *transport, run_stats_t *s, char *err) {
  memset(results, 0, sizeof(*results) * (size_t)n);
  for (int b = 0; b < 2; b++) {
    atomic_store(&ctl->waiting[b], 0);
    atomic_store(&ctl->gate[b], 0);
  }
  atomic_store(&ctl->abort_run, 0);
  fflush(NULL);
  pid_t parent = getpid();
  for (int i = 0; i < n; i++) {
    pids[i] = fork();
    if (pids[i] < 0)
      die("fork");
    if (pids[i] == 0)
      importer_main(parent, i, transport);
    alive[i] = 1;
  }
  int rc = 0;
  double released = 0;
  for (int b = 0; b < 2 && rc == 0; b++) {
    if (wait_at(b, n) != 0) {
      rc = -1;
      break;
    }
    released = now_us();
    release(b);
  }
  if (rc != 0) { /* the run is void: let nobody wait or go on */
    atomic_store(&ctl->abort_run, 1);
    release(0);
    release(1);
    for (int i = 0; i < n; i++)
      if (alive[i])
        kill(pids[i], SIGKILL);
  }
  for (int i = 0; i < n; i++) {
    int st = 0;
    if (alive[i] && waitpid(pids[i], &st, 0) == pids[i])
      alive[i] = 0;
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0)
      rc = -1;
  }
  if (rc != 0) {
    run_error(n, "an importer exited early or a barrier timed out", err);
    return rc;
  }

  size_t total = (size_t)n * (size_t)opens;
  s->samples = malloc(sizeof(double) * total);
  memcpy(s->samples, samples, sizeof(double) * total);
  s->first_us = malloc(sizeof(double) * (size_t)n);
  double last = released, *per = malloc(sizeof(double) * (size_t)n);
  for (int i = 0; i < n; i++) {
    s->first_us[i] = results[i].first_us;
    if (results[i].end_us > last)
      last = results[i].end_us;
    per[i] = median_of(&s->samples[(size_t)i * (size_t)opens], opens);
  }
  double *all = malloc(sizeof(double) * total);
  memcpy(all, s->samples, sizeof(double) * total);
  s->median_us = quantile_nearest(all, (int)total, 0.5);
  s->p90_us = quantile_nearest(all, (int)total, 0.9);
  s->worst_median_us = quantile_nearest(per, n, 1.0);
  s->first_median_us = median_of(s->first_us, n);
  s->wall_s = (last - released) / 1e6;
  s->opens_per_s = (double)total / s->wall_s;
  free(all);
  free(per);
  return 0;
}

/* ---- configurations, rounds and the report -------------------------------
 */

typedef struct config {
  int n;
  int rounds;
  run_stats_t *runs;
  /* medians over the rounds */
  double median_us, p90_us, worst_median_us, first_median_us, opens_per_s;
} config_t;

typedef struct transport_result {
  const char *name;
  int skipped;
  char note[ERR_LEN];
  config_t lone, many;
} transport_result_t;

static double over_rounds(const config_t *c, size_t field) {
  double *v = malloc(sizeof(double) * (size_t)c->rounds);
  for (int r = 0; r < c->rounds; r++)
    v[r] = *(const double *)((const char *)&c->runs[r] + field);
  double m = median_of(v, c->rounds);
  free(v);
  return m;
}

static void summarise(config_t *c) {
  c->median_us = over_rounds(c, offsetof(run_stats_t, median_us));
  c->p90_us = over_rounds(c, offsetof(run_stats_t, p90_us));
  c->worst_median_us = over_rounds(c, offsetof(run_stats_t, worst_median_us));
  c->first_median_us = over_rounds(c, offsetof(run_stats_t, first_median_us));
  c->opens_per_s = over_rounds(c, offsetof(run_stats_t, opens_per_s));
}

static void measure(transport_result_t *t, int n, int rounds) {
  char err[ERR_LEN];
  run_stats_t warmup;
  t->lone = (config_t){.n = 1, .rounds = rounds};
  t->many = (config_t){.n = n, .rounds = rounds};
  t->lone.runs = calloc((size_t)rounds, sizeof(run_stats_t));
  t->many.runs = calloc((size_t)rounds, sizeof(run_stats_t));
  if (run_once(1, t->name, &warmup, err) != 0)
    goto skip;
  free(warmup.samples);
  free(warmup.first_us);
  for (int r = 0; r < rounds; r++) {
    if (run_once(1, t->name, &t->lone.runs[r], err) != 0 ||
        run_once(n, t->name, &t->many.runs[r], err) != 0)
      goto skip;
  }
  summarise(&t->lone);
  summarise(&t->many);
  return;
skip:
  t->skipped = 1;
  snprintf(t->note, ERR_LEN, "%s", err);
}

static void free_config(config_t *c) {
  for (int r = 0; c->runs && r < c->rounds; r++) {
    free(c->runs[r].samples);
    free(c->runs[r].first_us);
  }
  free(c->runs);
}

static void json_array(FILE *f, const double *v, size_t n) {
  fputc('[', f);
  for (size_t i = 0; i < n; i++)
    fprintf(f, "%s%.3f", i ? "," : "", v[i]);
  fputc(']', f);
}

static void json_config(FILE *f, const config_t *c) {
  fprintf(f,
          "{\"importers\": %d, \"median_us\": %.3f, \"p90_us\": %.3f, "
          "\"worst_importer_median_us\": %.3f, \"first_contact_median_us\": "
          "%.3f, \"opens_per_s\": %.1f,\n      \"rounds\": [",
          c->n, c->median_us, c->p90_us, c->worst_median_us, c->first_median_us,
          c->opens_per_s);
  for (int r = 0; r < c->rounds; r++) {
    const run_stats_t *s = &c->runs[r];
    fprintf(f,
            "%s\n        {\"median_us\": %.3f, \"p90_us\": %.3f, "
            "\"worst_importer_median_us\": %.3f, "
            "\"first_contact_median_us\": %.3f, \"opens_per_s\": %.1f, "
            "\"wall_s\": %.6f, \"first_contact_us\": ",
            r ? "," : "", s->median_us, s->p90_us, s->worst_median_us,
            s->first_median_us, s->opens_per_s, s->wall_s);
    json_array(f, s->first_us, (size_t)c->n);
    fprintf(f, ", \"samples_us\": ");
    json_array(f, s->samples, (size_t)c->n * (size_t)opens);
    fputc('}', f);
  }
  fprintf(f, "]}");
}

static void print_row(const transport_result_t *t, const config_t *c,
                      int lone) {
  double worst_ratio = c->worst_median_us / t->lone.median_us;
  double pooled_ratio = c->median_us / t->lone.median_us;
  printf("| %s | %d | %.2f | %.2f (p90 %.2f) | %.2f | %.2fx | %.2fx | %.0f | "
         "%s |\n",
         t->name, c->n, c->first_median_us, c->median_us, c->p90_us,
         c->worst_median_us, pooled_ratio, worst_ratio, c->opens_per_s,
         lone                  ? "lone"
         : worst_ratio <= 2.00 ? "<= 2.00x: met"
                               : "<= 2.00x: NOT met");
}

static void usage(void) {
  fprintf(stderr, "usage: usmipc_bench_broker [--importers N] [--opens K] "
                  "[--size BYTES] [--rounds R]\n"
                  "                           [--transport socket|pidfd|both] "
                  "[--json FILE]\n");
  exit(2);
}

int main(int argc, char **argv) {
  bench_name = "usmipc_bench_broker";
  long cpus = sysconf(_SC_NPROCESSORS_ONLN);
  int n = cpus < 2 ? 2 : (int)cpus, rounds = 5;
  const char *json_path = NULL, *which = "both";
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--importers") && i + 1 < argc)
      n = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--opens") && i + 1 < argc)
      opens = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--rounds") && i + 1 < argc)
      rounds = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--size") && i + 1 < argc)
      size = parse_size(argv[++i]);
    else if (!strcmp(argv[i], "--transport") && i + 1 < argc)
      which = argv[++i];
    else if (!strcmp(argv[i], "--json") && i + 1 < argc)
      json_path = argv[++i];
    else
      usage();
  }
  if (n < 2) {
    fprintf(stderr, "usmipc_bench_broker: --importers must be at least 2 "
                    "(1 is the lone baseline, always measured)\n");
    return 2;
  }
  if (opens < 1 || rounds < 1 || size == 0 ||
      (strcmp(which, "socket") && strcmp(which, "pidfd") &&
       strcmp(which, "both")))
    usage();
  /* The exporter holds a descriptor per buffer. */
  long m = (long)n * (opens + 1);
  struct rlimit rl;
  if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_max != RLIM_INFINITY &&
      (rlim_t)m + 256 > rl.rlim_max) {
    fprintf(stderr,
            "usmipc_bench_broker: %d importers x (%d + 1) opens need %ld "
            "buffers, and the exporter may hold only %llu descriptors "
            "(ulimit -Hn): lower --opens or --importers\n",
            n, opens, m, (unsigned long long)rl.rlim_max);
    return 2;
  }
  signal(SIGPIPE, SIG_IGN);

  /* Everything shared is mapped before the first fork. */
  size_t at_handles = ALIGN64(sizeof(ctl_t));
  size_t at_results = at_handles + ALIGN64(sizeof(handle_slot_t) * (size_t)m);
  size_t at_samples = at_results + ALIGN64(sizeof(result_t) * (size_t)n);
  size_t bytes = at_samples + sizeof(double) * (size_t)n * (size_t)opens;
  uint8_t *region = mmap(NULL, bytes, PROT_READ | PROT_WRITE,
                         MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (region == MAP_FAILED)
    die("mmap of the shared region");
  ctl = (ctl_t *)region;
  handles = (handle_slot_t *)(region + at_handles);
  results = (result_t *)(region + at_results);
  samples = (double *)(region + at_samples);
  pids = calloc((size_t)n, sizeof(pid_t));
  alive = calloc((size_t)n, sizeof(int));

  /* This process never calls into usmipc: every fork starts fresh. */
  fflush(NULL);
  pid_t parent = getpid();
  pid_t exporter = fork();
  if (exporter < 0)
    die("fork");
  if (exporter == 0)
    exporter_main(parent, (int)m);
  uint32_t st;
  while ((st = atomic_load(&ctl->exporter_state)) == 0) {
    struct timespec ts = {.tv_sec = 0, .tv_nsec = 50 * 1000 * 1000};
    futex(&ctl->exporter_state, FUTEX_WAIT, 0, &ts);
    int ws;
    if (waitpid(exporter, &ws, WNOHANG) == exporter) {
      if (atomic_load(&ctl->exporter_state) == 0)
        snprintf(ctl->exporter_err, ERR_LEN, "it exited early");
      st = 2;
      exporter = -1;
      break;
    }
  }
  if (st != 1) {
    fprintf(stderr, "usmipc_bench_broker: the exporter failed: %s\n",
            ctl->exporter_err);
    if (exporter > 0)
      waitpid(exporter, NULL, 0);
    return 1;
  }

  transport_result_t ts[2] = {{.name = "socket"}, {.name = "pidfd"}};
  int first = strcmp(which, "pidfd") ? 0 : 1;
  int last = strcmp(which, "socket") ? 1 : 0;
  for (int t = first; t <= last; t++)
    measure(&ts[t], n, rounds);

  atomic_store(&ctl->quit, 1);
  futex_wake_all(&ctl->quit);
  int ws = 0;
  waitpid(exporter, &ws, 0);

  printf("# usmipc_bench_broker %s: %d importers at once against 1, %d warm "
         "opens each of fresh %zu-byte host buffers, %d online CPUs, median "
         "of %d rounds; times in us\n\n",
         USMIPC_VERSION_STRING, n, opens, size, (int)cpus, rounds);
  printf("| transport | importers | first contact | warm open median (p90) | "
         "worst importer's median | pooled ratio | worst ratio | opens/s | "
         "target |\n");
  printf("|---|---|---|---|---|---|---|---|---|\n");
  int ok = 1;
  for (int t = first; t <= last; t++) {
    if (ts[t].skipped) {
      printf("| %s | - | - | - | - | - | - | - | %s: %s |\n", ts[t].name,
             t == 0 ? "FAILED" : "skipped", ts[t].note);
      if (t == 0)
        ok = 0; /* the socket transport is what this bench is for */
      continue;
    }
    print_row(&ts[t], &ts[t].lone, 1);
    print_row(&ts[t], &ts[t].many, 0);
  }
  printf("\nworst ratio: the largest per-importer median with %d importers "
         "over the lone median (the target: each importer <= 2.00x); opens/s: "
         "all warm opens over the time from the start barrier to the last "
         "importer's finish (for pidfd no broker is involved: the importers' "
         "own rate); first contact (not in the ratios): each "
         "importer's first open of the exporter, all at once.\n",
         n);
  if (!WIFEXITED(ws) || WEXITSTATUS(ws) != 0) {
    fprintf(stderr,
            "usmipc_bench_broker: the exporter exited with status "
            "%d\n",
            ws);
    ok = 0;
  }

  if (json_path) {
    FILE *f = fopen(json_path, "w");
    if (!f)
      die(json_path);
    fprintf(f,
            "{\n  \"bench\": \"usmipc_bench_broker\", \"version\": \"%s\", "
            "\"size\": %zu, \"opens\": %d, \"importers\": %d, \"rounds\": "
            "%d, \"online_cpus\": %ld, \"target\": 2.0,\n  \"transports\": {",
            USMIPC_VERSION_STRING, size, opens, n, rounds, cpus);
    int comma = 0;
    for (int t = first; t <= last; t++) {
      fprintf(f, "%s\n  \"%s\": ", comma++ ? "," : "", ts[t].name);
      if (ts[t].skipped) {
        fprintf(f, "{\"skipped\": \"");
        for (const char *c = ts[t].note; *c; c++)
          fprintf(f, *c == '"' || *c == '\\' ? "\\%c" : "%c", *c);
        fprintf(f, "\"}");
        continue;
      }
      double worst = ts[t].many.worst_median_us / ts[t].lone.median_us;
      fprintf(f,
              "{\"median_ratio\": %.4f, \"worst_importer_ratio\": %.4f, "
              "\"met\": %s,\n    \"lone\": ",
              ts[t].many.median_us / ts[t].lone.median_us, worst,
              worst <= 2.0 ? "true" : "false");
      json_config(f, &ts[t].lone);
      fprintf(f, ",\n    \"concurrent\": ");
      json_config(f, &ts[t].many);
      fprintf(f, "}");
    }
    fprintf(f, "\n  }\n}\n");
    fclose(f);
  }
  for (int t = first; t <= last; t++) {
    free_config(&ts[t].lone);
    free_config(&ts[t].many);
  }
  free(pids);
  free(alive);
  munmap(region, bytes);
  return ok ? 0 : 1;
}
