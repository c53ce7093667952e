/* What every benchmark here needs: a monotonic clock in microseconds and
 * order statistics of samples. */
#ifndef USMIPC_BENCH_UTIL_H
#define USMIPC_BENCH_UTIL_H

#include <stdlib.h>
#include <time.h>

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

#endif /* USMIPC_BENCH_UTIL_H */
