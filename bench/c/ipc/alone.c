/* usmipc_bench's default measurement: usmipc alone, per call.
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
 * printed as a Markdown table; --json writes the same numbers. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "harness.h"
#include "ipc.h"
#include "usmipc.h"

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
  uint8_t(*handles)[BENCH_HANDLE_MAX] = calloc(k, BENCH_HANDLE_MAX);
  uint32_t *lens = calloc(k, sizeof(uint32_t));
  void **ptrs = calloc(k, sizeof(void *));
  size_t ntimes = 2 * (size_t)k + 2 * (size_t)iters;
  double *times = calloc(ntimes, sizeof(double));
  if (!handles || !lens || !ptrs || !times)
    return 2;
  if (recv_handles(0, k, handles, lens) != 0)
    return 2;
  int32_t status = 0;
  char msg[BENCH_MSG_LEN] = {0};
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
  reply_status(status, msg, times, ntimes * sizeof(double));
  return 0;
}

/* ---- the exporter: this process -------------------------------------------
 */

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
    bench_die("usmipc_memset", rc);
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
    int rc = bench_malloc(o, dev, size, &bufs[i]);
    if (rc != 0)
      bench_die("usmipc_malloc", rc);
    fill_marker(dev, q, bufs[i], (uint8_t)(i * 7 + 1));
    if ((rc = usmipc_ipc_get_handle(bufs[i], 0, &hs[i])) != 0)
      bench_die("usmipc_ipc_get_handle", rc);
  }
  int to, from;
  pid_t pid = spawn_self(mode_alone.importer_role, "USMIPC_FD_TRANSPORT",
                         transport, &to, &from);
  uint32_t hdr[3] = {o->k, iters,
                     usmipc_device_backend(dev) == USMIPC_BACKEND_HOST};
  int ok =
      write_full(to, hdr, sizeof(hdr)) == 0 && send_handles(to, hs, o->k) == 0;
  int32_t status = -1;
  char msg[BENCH_MSG_LEN];
  if (ok)
    ok = read_status(from, &status, msg) == 0;
  int result = 0;
  if (!ok) {
    snprintf(note, note_len, "importer died");
    result = -1;
  } else if (status != 0) {
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
        samples_add(open_first, times[i]);
        samples_add(close_last, times[o->k + i]);
      }
      for (unsigned j = 0; j < iters; j++) {
        samples_add(reopen, times[2 * o->k + j]);
        samples_add(close_ref, times[2 * o->k + iters + j]);
      }
    }
    free(times);
  }
  close(to);
  close(from);
  wait_child(pid);
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
      int rc = bench_malloc(o, dev, size, &bufs[i]);
      if (rc != 0)
        bench_die("usmipc_malloc", rc);
    }
    for (unsigned i = 0; i < o->k; i++) {
      usmipc_ipc_handle_t *h;
      double t0 = now_us();
      int rc = usmipc_ipc_get_handle(bufs[i], 0, &h);
      double t1 = now_us();
      usmipc_ipc_free_handle(h);
      double t2 = now_us();
      if (rc != 0)
        bench_die("usmipc_ipc_get_handle", rc);
      samples_add(&s[M_EXPORT_FIRST], t1 - t0);
      samples_add(&s[M_FREE_HANDLE], t2 - t1);
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
          bench_die("usmipc_ipc_get_handle (repeat)", rc);
        samples_add(&s[M_EXPORT_REPEAT], t1 - t0);
        samples_add(&s[M_FREE_HANDLE], t2 - t1);
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

/* ---- output ---------------------------------------------------------------
 */

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
    md_cell(&res[i].m[M_EXPORT_FIRST]);
    md_cell(&res[i].m[M_EXPORT_REPEAT]);
    md_cell(&res[i].m[M_FREE_HANDLE]);
    for (int t = 0; t < o->ntransports; t++)
      md_cell(&res[i].m[M_OPEN_FIRST + t]);
    md_cell(&res[i].m[M_REOPEN]);
    md_cell(&res[i].m[M_CLOSE_REF]);
    md_cell(&res[i].m[M_CLOSE_LAST]);
    printf("\n");
  }
  printf("\nMedians in microseconds, (p10–p90) in parentheses.\n");
}

static void write_json(const options_t *o, usmipc_device_t *dev,
                       const size_result_t *res) {
  FILE *f = json_open(o->json, NULL, dev);
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

static int run(const options_t *o, usmipc_device_t *dev, usmipc_queue_t *q) {
  printf("K = %u fresh buffers per first-open round, %u rounds, %u "
         "iterations for repeat export and cached re-open.\n\n",
         o->k, o->rounds, o->iters);
  fflush(stdout);

  size_result_t res[MAX_SIZES];
  for (int i = 0; i < o->nsizes; i++)
    bench_size(o, dev, q, o->sizes[i], &res[i]);
  print_table(o, res);
  if (o->json)
    write_json(o, dev, res);
  return 0;
}

const bench_mode_t mode_alone = {
    .flag = NULL,
    .importer_role = "--importer",
    .importer_main = importer_main,
    .synopsis = "usmipc_bench [--device FILTER] [--sizes 4K,1M,64M,256M]\n"
                "                    [--k 40] [--rounds 3] [--iters 2000]\n"
                "                    [--transports socket,pidfd] [--kind "
                "fd|native]\n"
                "                    [--json FILE]\n",
    .run = run,
};
