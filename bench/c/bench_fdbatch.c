/* usmipc_bench_fdbatch: what it costs an importer to take N descriptors of
 * one exporter: one broker exchange each (usmipc__peer_fetch_fd, socket
 * transport), one exchange per 253 (usmipc__peer_fetch_fds, socket), and
 * pidfd_getfd(2) one by one (usmipc__peer_fetch_fds, pidfd: no exchange).
 *
 *   usmipc_bench_fdbatch [--n 600] [--rounds 20]
 *
 * This process exports N host allocations (memfds); a fork child per
 * transport proves the exporter once, then takes all N descriptors and
 * closes them, --rounds times. Medians in milliseconds for all N, and
 * microseconds per descriptor. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include "objects.h"
#include "harness.h"

static size_t n_fds = 600;
static int rounds = 20;

enum how { ONE_BY_ONE, BATCHED };

/* In a fork child: the median time to take and close all n descriptors,
 * written to out (a pipe), or a negative value when the transport fails. */
static void measure(const char *transport, enum how how,
                    const usmipc__wire_t *w, int out) {
  setenv("USMIPC_FD_TRANSPORT", transport, 1);
  const usmipc__wire_t **wp = malloc(n_fds * sizeof(*wp));
  int *fds = malloc(n_fds * sizeof(*fds));
  double *t = malloc((size_t)rounds * sizeof(*t));
  double result = -1;
  usmipc__peer_t *peer = NULL;
  int proof_fd = -1;
  for (size_t i = 0; i < n_fds; i++)
    wp[i] = &w[i];
  uint64_t deadline = UINT64_MAX;
  if (usmipc__peer_get(&w[0], deadline, &peer, &proof_fd) != 0)
    goto out;
  if (proof_fd >= 0)
    close(proof_fd);
  for (int r = 0; r < rounds; r++) {
    double t0 = now_us();
    if (how == BATCHED) {
      if (usmipc__peer_fetch_fds(peer, wp, n_fds, deadline, fds) != 0)
        goto out;
    } else {
      for (size_t i = 0; i < n_fds; i++)
        if (usmipc__peer_fetch_fd(peer, &w[i],
                                  usmipc__slot_tag(w[i].key, w[i].token),
                                  deadline, &fds[i]) != 0)
          goto out;
    }
    t[r] = now_us() - t0;
    for (size_t i = 0; i < n_fds; i++)
      close(fds[i]);
  }
  result = quantile_nearest(t, rounds, 0.5);
out:
  if (result < 0)
    fprintf(stderr, "%s: %s\n", transport, usmipc_last_error());
  if (write(out, &result, sizeof(result)) != sizeof(result))
    _exit(2);
  _exit(0);
}

static double run(const char *transport, enum how how,
                  const usmipc__wire_t *w) {
  int p[2];
  if (pipe(p) != 0)
    return -1;
  pid_t pid = fork();
  if (pid == 0) {
    close(p[0]);
    measure(transport, how, w, p[1]);
  }
  close(p[1]);
  double result = -1;
  if (read(p[0], &result, sizeof(result)) != sizeof(result))
    result = -1;
  close(p[0]);
  waitpid(pid, NULL, 0);
  return result;
}

int main(int argc, char **argv) {
  bench_name = "usmipc_bench_fdbatch";
  for (int i = 1; i + 1 < argc; i += 2) {
    if (strcmp(argv[i], "--n") == 0)
      n_fds = (size_t)strtoul(argv[i + 1], NULL, 10);
    else if (strcmp(argv[i], "--rounds") == 0)
      rounds = atoi(argv[i + 1]);
  }
  if (n_fds == 0 || rounds <= 0) {
    fprintf(stderr, "usage: usmipc_bench_fdbatch [--n N] [--rounds R]\n");
    return 2;
  }
  struct rlimit rl;
  getrlimit(RLIMIT_NOFILE, &rl);
  if (rl.rlim_cur < 3 * n_fds + 256 &&
      (rl.rlim_max == RLIM_INFINITY || rl.rlim_max >= 3 * n_fds + 256)) {
    rl.rlim_cur = 3 * n_fds + 256;
    setrlimit(RLIMIT_NOFILE, &rl);
  }
  usmipc_device_t *host;
  if (usmipc_device_select("host:cpu", &host) != 0) {
    fprintf(stderr, "no host device: %s\n", usmipc_last_error());
    return 1;
  }
  usmipc__wire_t *w = calloc(n_fds, sizeof(*w));
  for (size_t i = 0; i < n_fds; i++) {
    void *p;
    usmipc_ipc_handle_t *h;
    const void *bytes;
    size_t len;
    if (usmipc_malloc(host, USMIPC_MEM_DEVICE, 4096, &p) != 0 ||
        usmipc_ipc_get_handle(p, 0, &h) != 0 ||
        usmipc_ipc_handle_data(h, &bytes, &len) != 0 ||
        usmipc__wire_decode(bytes, len, &w[i]) != 0) {
      fprintf(stderr, "export %zu: %s\n", i, usmipc_last_error());
      return 1;
    }
  }
  static const struct {
    const char *label, *transport;
    enum how how;
  } rows[] = {
      {"broker, one exchange per descriptor", "socket", ONE_BY_ONE},
      {"broker, one exchange per 253 (batched)", "socket", BATCHED},
      {"pidfd_getfd(2) one by one (no exchange)", "pidfd", BATCHED},
  };
  printf("%zu descriptors of one exporter, median of %d rounds\n\n", n_fds,
         rounds);
  printf("| how | ms for all | us per descriptor |\n|---|---:|---:|\n");
  for (size_t r = 0; r < sizeof(rows) / sizeof(rows[0]); r++) {
    double us = run(rows[r].transport, rows[r].how, w);
    if (us < 0)
      printf("| %s | failed | |\n", rows[r].label);
    else
      printf("| %s | %.2f | %.2f |\n", rows[r].label, us / 1e3,
             us / (double)n_fds);
  }
  return 0;
}
