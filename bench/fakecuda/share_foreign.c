/* usmipc's own C time to share memory another library allocated, per
 * allocation, under the driver of nothing (fakecuda.c): a bundle of n
 * cuMemAlloc allocations, one array each, made with usmipc_bundle_add_array
 * and usmipc_bundle_finish, every allocation exported before (the last 8
 * bundles are kept, as a weight-update loop keeps the last steps'). Prints
 * the best of reps. No Python, so the figure is the library's alone.
 *
 *   make fakecuda   # builds this too: build/fakecuda/share_foreign
 *   LD_LIBRARY_PATH=build/fakecuda:build build/fakecuda/share_foreign 798 300
 */
#include <cuda.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <usmipc.h>

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static int fail(const char *what) {
  fprintf(stderr, "%s: %s\n", what, usmipc_last_error());
  return 1;
}

int main(int argc, char **argv) {
  int n = argc > 1 ? atoi(argv[1]) : 798, reps = argc > 2 ? atoi(argv[2]) : 300;
  if (n <= 0 || reps <= 0 || cuInit(0) != CUDA_SUCCESS)
    return 2;
  CUdeviceptr *p = calloc((size_t)n, sizeof(*p));
  if (p == NULL)
    return 2;
  for (int i = 0; i < n; i++)
    if (cuMemAlloc(&p[i], 65536) != CUDA_SUCCESS)
      return 2;
  int64_t shape = 32768;
  usmipc_array_desc_t desc = {2, 16, 1, 1, &shape, NULL}; /* float16 */
  usmipc_bundle_t *kept[8] = {0};
  double best = 1e9;
  for (int r = 0; r < reps; r++) {
    double t0 = now();
    usmipc_bundle_t *b;
    if (usmipc_bundle_create(&b) != 0 ||
        usmipc_bundle_add_container(b, USMIPC_BUNDLE_DICT, (uint32_t)n, NULL,
                                    0) != 0)
      return fail("bundle");
    for (int i = 0; i < n; i++) {
      char key[32];
      int len = snprintf(key, sizeof(key), "layer%d.weight", i);
      if (usmipc_bundle_add_array(b, key, (size_t)len, (void *)p[i], &desc))
        return fail("usmipc_bundle_add_array");
    }
    if (usmipc_bundle_finish(b) != 0)
      return fail("usmipc_bundle_finish");
    double dt = now() - t0;
    best = dt < best ? dt : best;
    usmipc_bundle_free(kept[r % 8]);
    kept[r % 8] = b;
  }
  printf("%d allocations: share %.3f us an allocation (best of %d)\n", n,
         best / n * 1e6, reps);
  for (int i = 0; i < 8; i++)
    usmipc_bundle_free(kept[i]);
  return 0;
}
