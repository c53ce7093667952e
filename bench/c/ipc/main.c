/* usmipc_bench: what an IPC round trip costs, per call, in microseconds.
 *
 *   usmipc_bench [--device FILTER] [--sizes 4K,1M,64M,256M] [--k 40]
 *                [--rounds 3] [--iters 2000] [--transports socket,pidfd]
 *                [--kind fd|native] [--json FILE]
 *   usmipc_bench --raw --device cuda[:gpu[:N]] [--kind fd|native]
 *                [--sizes ...] [--k 100] [--rounds 3] [--transports pidfd]
 *                [--order abba|usmipc-first|raw-first] [--json FILE]
 *
 * This file parses the options, selects the device and runs one of the
 * measurements, each in its own file:
 *   alone.c   (default) usmipc alone: export, first open per fd transport,
 *             cached re-open, close;
 *   paired.c  (--raw) usmipc's first open and close against a peer's bare
 *             driver calls (peer_cuda.c), paired in one importer.
 * Timing is clock_gettime(CLOCK_MONOTONIC) around each single call. */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"
#include "ipc.h"
#include "usmipc.h"

/* The measurements of BENCH_MODES (ipc.h); the first is the default. */
#define BENCH_ADDRESS(name) &name,
static const bench_mode_t *const modes[] = {BENCH_MODES(BENCH_ADDRESS)};
#define NMODES (sizeof(modes) / sizeof(modes[0]))

static void usage(void) {
  for (size_t m = 0; m < NMODES; m++)
    fprintf(stderr, "%s%s", m == 0 ? "usage: " : "       ", modes[m]->synopsis);
  for (size_t m = 0; m < NMODES; m++)
    if (modes[m]->options_help)
      fputs(modes[m]->options_help, stderr);
  fputs("  --kind  how CUDA memory is allocated and shared: fd (cuMemCreate,\n"
        "          POSIX fd) or native (cuMemAlloc + cuIpcGetMemHandle);\n"
        "          default: the backend's, which USMIPC_CUDA_IPC changes\n",
        stderr);
  exit(2);
}

static const bench_mode_t *mode_of_flag(const char *a) {
  for (size_t m = 0; m < NMODES; m++)
    if (modes[m]->flag != NULL && strcmp(a, modes[m]->flag) == 0)
      return modes[m];
  return NULL;
}

/* An option of one of the measurements: 1 taken, 0 no one's, or the exit
 * status of a bad value. */
static int parse_mode_option(options_t *o, const char *a, const char *v) {
  for (size_t m = 0; m < NMODES; m++) {
    int taken = modes[m]->parse_option ? modes[m]->parse_option(o, a, v) : 0;
    if (taken != 0)
      return taken;
  }
  return 0;
}

int main(int argc, char **argv) {
  bench_name = "usmipc_bench";
  for (size_t m = 0; m < NMODES; m++)
    if (argc == 2 && strcmp(argv[1], modes[m]->importer_role) == 0)
      return modes[m]->importer_main();
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
  o.mode = modes[0];
  int k_set = 0, transports_set = 0;
  static char sizes_buf[256], transports_buf[128];

  for (int i = 1; i < argc; i++) {
    const char *a = argv[i];
    if (strcmp(a, "-h") == 0 || strcmp(a, "--help") == 0)
      usage();
    const bench_mode_t *mode = mode_of_flag(a);
    if (mode != NULL) {
      o.mode = mode;
      continue;
    }
    const char *v = i + 1 < argc ? argv[i + 1] : NULL;
    if (v == NULL)
      usage();
    i++;
    if (strcmp(a, "--device") == 0) {
      o.device = v;
    } else if (strcmp(a, "--json") == 0) {
      o.json = v;
    } else if (strcmp(a, "--k") == 0) {
      o.k = (unsigned)strtoul(v, NULL, 10);
      k_set = 1;
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
      transports_set = 1;
    } else if (strcmp(a, "--kind") == 0) {
      if (strcmp(v, "fd") == 0) {
        o.alloc_flags = USMIPC_ALLOC_IPC_FD;
      } else if (strcmp(v, "native") == 0) {
        o.alloc_flags = USMIPC_ALLOC_IPC_NATIVE;
      } else if (strcmp(v, "default") == 0) {
        o.alloc_flags = 0;
        v = NULL;
      } else {
        fprintf(stderr,
                "usmipc_bench: --kind takes fd, native or default, "
                "not '%s'\n",
                v);
        return 2;
      }
      o.kind = v;
    } else {
      int taken = parse_mode_option(&o, a, v);
      if (taken > 1)
        return taken;
      if (!taken)
        usage();
    }
  }
  if (o.mode->configure) {
    int rc = o.mode->configure(&o, k_set, transports_set);
    if (rc != 0)
      return rc;
  }
  if (o.k == 0 || o.rounds == 0 || o.nsizes == 0 || o.ntransports == 0)
    usage();
  for (int i = 0; i < o.nsizes; i++)
    if (o.sizes[i] == 0)
      usage();

  usmipc_device_t *dev = NULL;
  int rc = usmipc_device_select(o.device, &dev);
  if (o.mode->check_device) {
    int status = o.mode->check_device(&o, rc, dev);
    if (status != 0)
      return status;
  }
  if (rc != 0)
    bench_die(o.device, rc);
  if (!usmipc_device_has_ipc(dev)) {
    fprintf(stderr, "usmipc_bench: %s does not support IPC memory\n", o.device);
    return 1;
  }
  usmipc_queue_t *q;
  if ((rc = usmipc_queue_create(dev, &q)) != 0)
    bench_die("usmipc_queue_create", rc);

  /* Warm-up: the first export of the process starts the fd broker, a
   * one-time cost that belongs to no single export. */
  void *warm = NULL;
  usmipc_ipc_handle_t *wh = NULL;
  if ((rc = bench_malloc(&o, dev, 4096, &warm)) != 0 ||
      (rc = usmipc_ipc_get_handle(warm, 0, &wh)) != 0)
    bench_die("warm-up export", rc);
  usmipc_ipc_free_handle(wh);
  usmipc_free(warm);

  printf("# usmipc_bench %s on %s (%s)\n\n", usmipc_version_string(),
         usmipc_device_filter_string(dev), usmipc_device_name(dev));
  int status = o.mode->run(&o, dev, q);
  usmipc_queue_destroy(q);
  return status;
}
