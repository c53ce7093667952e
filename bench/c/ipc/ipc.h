/* usmipc_bench's parts: its options, its measurements and the bare-driver
 * peers its --raw measurement pairs usmipc with, one file each, registered
 * in the lists BENCH_MODES and RAW_PEERS below. */
#ifndef USMIPC_BENCH_IPC_H
#define USMIPC_BENCH_IPC_H

#include <stddef.h>
#include <stdint.h>

#include "harness.h"
#include "usmipc.h"

#define MAX_SIZES 16
#define MAX_TRANSPORTS 4

typedef struct bench_mode bench_mode_t;

typedef struct options {
  const char *device;
  const char *json;
  size_t sizes[MAX_SIZES];
  int nsizes;
  const char *transports[MAX_TRANSPORTS];
  int ntransports;
  unsigned k, rounds, iters;
  const bench_mode_t *mode; /* the measurement its flag chose */
  unsigned order;           /* --order: RAW_ORDER_* */
  unsigned alloc_flags;     /* --kind: USMIPC_ALLOC_IPC_FD / _NATIVE, or 0 */
  const char *kind;         /* "fd", "native" or NULL (the backend's default) */
} options_t;

/* Device memory of the kind --kind asks for (0: the backend's default,
 * which USMIPC_CUDA_IPC=fd|native changes). */
static inline int bench_malloc(const options_t *o, usmipc_device_t *dev,
                               size_t size, void **p) {
  return usmipc_malloc_flags(dev, USMIPC_MEM_DEVICE, size, o->alloc_flags, p);
}

/* ---- a measurement ---------------------------------------------------------
 * main.c parses the options every measurement shares, selects the device,
 * makes a queue and warms the export path up, then runs the measurement
 * whose flag was given (the one without a flag by default). Its importer
 * runs as `usmipc_bench ROLE` in a process the measurement starts. Every
 * hook but run may be NULL. */
struct bench_mode {
  const char *flag;          /* "--raw"; NULL: the default measurement */
  const char *importer_role; /* argv[1] of its importer process */
  int (*importer_main)(void);
  /* Its lines of the usage text: the synopsis, and what its options mean. */
  const char *synopsis;
  const char *options_help;
  /* An option of its own (a with value v): 1 taken, 0 not its own, or an
   * exit status > 1 after saying what was wrong. */
  int (*parse_option)(options_t *o, const char *a, const char *v);
  /* Its defaults and checks, after parsing (k_set, transports_set: given on
   * the command line): 0, or an exit status after saying what was wrong. */
  int (*configure)(options_t *o, int k_set, int transports_set);
  /* Its checks of the device, right after usmipc_device_select returned
   * select_rc: 0, or an exit status after saying what was wrong. */
  int (*check_device)(const options_t *o, int select_rc, usmipc_device_t *dev);
  /* Measures, prints its table, writes --json; returns the exit status. */
  int (*run)(const options_t *o, usmipc_device_t *dev, usmipc_queue_t *q);
};

/* The measurements, one file each: adding one is its file and a line here.
 * The first is the default. */
#define BENCH_MODES(X)                                                         \
  X(mode_alone)  /* alone.c: usmipc alone */                                   \
  X(mode_paired) /* paired.c: --raw */

#define BENCH_DECLARE(name) extern const bench_mode_t name;
BENCH_MODES(BENCH_DECLARE)

/* ---- a bare-driver peer of --raw -------------------------------------------
 * The importer opens and closes every other buffer through the bare driver
 * calls of the buffers' backend instead of usmipc. The peer reads usmipc's
 * handle bytes (docs/handle-format.md); its hooks run in the importer,
 * untimed but for what open and close time. On failure they write a
 * sentence to msg and return RAW_STATUS_*. */

/* Importer status codes of the raw path (usmipc's own codes are small
 * negative numbers). */
#define RAW_STATUS_FAIL (-100000)
#define RAW_STATUS_EPERM (-100001)

/* One buffer opened through a peer. */
typedef struct raw_mapping {
  unsigned long long p; /* the address */
  size_t size;          /* what the peer reserved, for its close */
} raw_mapping_t;

typedef struct raw_peer {
  const char *name; /* "CUDA" */
  usmipc_backend_t backend;
  const char *device_hint; /* a --device filter for it: "cuda[:gpu[:N]]" */
  /* The driver packs smaller allocations into blocks of this size and maps
   * a block once per importer: every buffer is rounded up to it, so that
   * each first open maps its own. */
  size_t block;
  /* The name of a handle kind of usmipc_ipc_handle_info_t, or NULL for one
   * the peer cannot open. */
  const char *(*kind_name)(unsigned handle_kind);
  /* Checks handle i (usmipc_ipc_handle_inspect accepted it as info). */
  int (*check)(uint32_t i, const uint8_t *h,
               const usmipc_ipc_handle_info_t *info, char *msg, size_t len);
  /* Loads the driver and makes device `ordinal` ready, once. */
  int (*setup)(uint32_t ordinal, char *msg, size_t len);
  /* Opens handle h; *us gets the time of the timed part. */
  int (*open)(const uint8_t *h, raw_mapping_t *m, double *us, char *msg,
              size_t len);
  int (*close)(const raw_mapping_t *m, double *us, char *msg, size_t len);
} raw_peer_t;

/* The bare-driver peers, one file each and one per backend: adding one is
 * its file and a line here. */
#define RAW_PEERS(X) X(raw_peer_cuda) /* peer_cuda.c */

#define RAW_PEER_DECLARE(name) extern const raw_peer_t name;
RAW_PEERS(RAW_PEER_DECLARE)

#endif /* USMIPC_BENCH_IPC_H */
