/* The harness the C benchmarks share: a monotonic clock in microseconds,
 * samples and their order statistics, the child process and pipes an
 * exporter and its importer talk through, Markdown cells and JSON. What a
 * benchmark measures lives in its own file; what measuring needs, here
 * (harness.c). */
#ifndef USMIPC_BENCH_HARNESS_H
#define USMIPC_BENCH_HARNESS_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <time.h>

#include "usmipc.h"

/* ---- clock and order statistics (inline: every benchmark uses them) ---- */

static inline double now_us(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec * 1e6 + (double)t.tv_nsec / 1e3;
}

static inline int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

/* The q-quantile of v[0, n) by nearest rank, sorting v. */
static inline double quantile_nearest(double *v, int n, double q) {
  qsort(v, (size_t)n, sizeof(*v), cmp_double);
  return v[(int)(q * (n - 1) + 0.5)];
}

/* pidfd_open(2) (Linux 5.3) and pidfd_getfd(2) (Linux 5.6), for the raw
 * baselines, where the C library's headers lack the numbers. */
#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif
#ifndef SYS_pidfd_getfd
#define SYS_pidfd_getfd 438
#endif

/* ---- errors ---- */

/* The program's name at the start of bench_die's message; a program sets it
 * first thing in main. */
extern const char *bench_name;

/* Prints "NAME: what: CODE (message)" for a usmipc error code rc, or
 * "NAME: what: strerror(errno) ()" for rc == 0, and exits with status 1. */
void bench_die(const char *what, int rc);

/* ---- samples and summaries ---- */

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

void samples_add(samples_t *s, double x);
/* The q-quantile of sorted[0, n), interpolated linearly between ranks. */
double quantile_linear(const double *sorted, size_t n, double q);
/* Median, p10 and p90 of s, sorting s; invalid ("no samples") when empty. */
summary_t summarize(samples_t *s);
/* The same of a copy: s keeps its order. */
summary_t summarize_copy(const samples_t *s);
/* The 95% percentile-bootstrap interval of the median of s (2000
 * resamples, a fixed seed); [0, 0] below two samples. */
void bootstrap_median_ci(const samples_t *s, double ci[2]);
uint64_t xorshift64(uint64_t *x);

/* ---- an importer: this program again, in another process ---- */

/* The largest handle the importers read from their pipe. */
#define BENCH_HANDLE_MAX 512

/* write(2) and read(2) of exactly len bytes, through EINTR; 0 or -1. */
int write_full(int fd, const void *buf, size_t len);
int read_full(int fd, void *buf, size_t len);

/* Starts `/proc/self/exe ROLE` with env_name=env_value in its environment
 * (replacing any such setting): an unrelated process, not a fork. *to is
 * its stdin, *from its stdout. */
pid_t spawn_self(const char *role, const char *env_name, const char *env_value,
                 int *to, int *from);
/* fork(2) with a pipe each way, for an exporter child: in the parent it
 * returns the child's pid, *from reading what the child writes and *to
 * writing to the child; in the child it returns 0, *to being the child's
 * write end and *from its read end. The ends the other side uses are closed
 * on each side. Exits when a pipe or the fork fails. */
pid_t fork_with_pipes(int *from, int *to);
/* Reaps child pid, through EINTR. */
void wait_child(pid_t pid);

/* Handles on a pipe: each as u32 length, then its bytes. send_handles
 * writes hs[0, n) and returns 0 or -1; recv_handles reads n of them
 * (each at most BENCH_HANDLE_MAX bytes) and returns 0 or -1. */
int send_handles(int fd, usmipc_ipc_handle_t *const *hs, uint32_t n);
int recv_handles(int fd, uint32_t n, uint8_t (*handles)[BENCH_HANDLE_MAX],
                 uint32_t *lens);

/* An importer's answer: i32 status, then on success its results, on
 * failure (status != 0) a 256-byte message. */
#define BENCH_MSG_LEN 256
/* The importer's side: writes status, then len bytes of results or msg. */
void reply_status(int32_t status, const char *msg, const void *results,
                  size_t len);
/* The exporter's side: reads the status, and msg when it is not 0.
 * Returns 0, or -1 when the importer died without answering. */
int read_status(int fd, int32_t *status, char msg[BENCH_MSG_LEN]);

/* ---- sizes ---- */

/* "4096", "4K", "1M", "1G" -> bytes (0 for nonsense). */
size_t parse_size(const char *s);
/* "4 KiB", "256 MiB", "1 GiB", "1000 B". */
void size_label(size_t size, char *out, size_t len);

/* ---- output ---- */

/* A Markdown table cell: " median (p10–p90) |", or " n/a (why) |". */
void md_cell(const summary_t *s);
/* Opens path and writes the head every result file of bench_name starts
 * with: tool, mode (when not NULL), version, device, kernel, unit. Exits
 * when the file cannot be written. */
FILE *json_open(const char *path, const char *mode, usmipc_device_t *dev);
/* ",\n      \"key\": {median, p10, p90, n[, median_ci95]}" (4 decimals), or
 * null when s is not valid. */
void json_summary_ci(FILE *f, const char *key, const summary_t *s,
                     const double *ci);
void json_summary(FILE *f, const char *key, const summary_t *s);
/* ",\n        \"key\": [v0, v1, ...]" of s in its order. */
void json_samples(FILE *f, const char *key, const samples_t *s, int decimals);

#endif /* USMIPC_BENCH_HARNESS_H */
