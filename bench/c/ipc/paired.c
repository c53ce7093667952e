/* usmipc_bench --raw: usmipc's first open and close against the bare
 * driver calls of a peer (peer_cuda.c), paired and interleaved in one
 * importer so that both see the same conditions.
 *
 * Per round the exporter allocates 2K + 2 fresh buffers (each rounded up
 * to a multiple of the peer's block, 2 MiB for CUDA, so that no two share a
 * driver block: cuMemAlloc packs smaller allocations into shared 2 MiB
 * blocks, which the importer's driver maps once; the handle exports the
 * asked size) and exports all of them with usmipc. The importer opens
 * buffer 1 through the peer and buffer 0 through usmipc as an untimed
 * warm-up (open and close), then the K pairs: pair j is buffer 2 + 2j
 * opened with usmipc_ipc_open and buffer 3 + 2j with the peer's path, one
 * right after the other, each timed; then it closes them in the same order,
 * each timed. --order says which call of a pair goes first: abba (default:
 * blocks of two pairs, usmipc raw raw usmipc or raw usmipc usmipc raw at
 * random, from a fixed seed), usmipc-first or raw-first. The position
 * matters: on an H200 one mapping in every 512 MiB mapped costs ~20 us
 * more, whichever path makes it, so with 256 MiB buffers and usmipc-first
 * every raw open paid it and usmipc looked 22% faster than the driver. The
 * paired statistics are per block (sum(usmipc) / sum(raw)), with a 95%
 * bootstrap interval of their median.
 * The importer's import cache is off (usmipc_ipc_set_cache_size(0)) so that
 * usmipc's close unmaps like the raw close does. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <unistd.h>

#include "harness.h"
#include "ipc.h"
#include "usmipc.h"

/* The bare-driver peers of RAW_PEERS (ipc.h), one per backend. */
#define RAW_PEER_ADDRESS(name) &name,
static const raw_peer_t *const peers[] = {RAW_PEERS(RAW_PEER_ADDRESS)};
#define NPEERS (sizeof(peers) / sizeof(peers[0]))

static const raw_peer_t *peer_for(usmipc_backend_t backend) {
  for (size_t i = 0; i < NPEERS; i++)
    if (peers[i]->backend == backend)
      return peers[i];
  return NULL;
}

/* "CUDA" (or "CUDA or Level Zero"): the peers' names, or with hints their
 * --device filters. */
static void peer_list(char *buf, size_t len, int hints) {
  buf[0] = '\0';
  for (size_t i = 0; i < NPEERS; i++) {
    size_t used = strlen(buf);
    snprintf(buf + used, len - used, "%s%s", i ? " or " : "",
             hints ? peers[i]->device_hint : peers[i]->name);
  }
}

static const char *kind_label(const raw_peer_t *peer, unsigned handle_kind) {
  const char *name = handle_kind ? peer->kind_name(handle_kind) : NULL;
  return name ? name : "?";
}

/* Which call of a pair goes first (--order). ABBA is 0: the default of
 * zeroed options. */
enum {
  RAW_ORDER_ABBA = 0,         /* blocks of two pairs, each block randomly
                                 usmipc raw raw usmipc or the reverse */
  RAW_ORDER_USMIPC_FIRST = 1, /* usmipc, raw, usmipc, raw, ... */
  RAW_ORDER_RAW_FIRST = 2,    /* raw, usmipc, raw, usmipc, ... */
};
static const char *const raw_order_names[] = {"abba", "usmipc-first",
                                              "raw-first"};

/* Which call of pair j goes first, for pairs 0..k-1: 1 usmipc, 0 raw. The
 * exporter and the importer compute the same plan from the seed. With abba,
 * each block of two pairs gives each side one call in each position (a cost
 * of the position cancels within the block, whatever side it hits), and the
 * random choice of abba or baab per block makes a cost of a longer period
 * (a GPU showed one every 512 MiB of mappings) hit either side alike. */
static void raw_order_plan(unsigned order, uint64_t seed, uint32_t k,
                           uint8_t *usmipc_first) {
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + 0x2545F4914F6CDD1Dull;
  if (x == 0)
    x = 1;
  for (uint32_t j = 0; j < k; j++) {
    if (order == RAW_ORDER_USMIPC_FIRST)
      usmipc_first[j] = 1;
    else if (order == RAW_ORDER_RAW_FIRST)
      usmipc_first[j] = 0;
    else if (j % 2 == 0)
      usmipc_first[j] = (uint8_t)(xorshift64(&x) >> 63);
    else
      usmipc_first[j] = !usmipc_first[j - 1];
  }
}

static int cmp_u64(const void *a, const void *b) {
  uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
  return x < y ? -1 : x > y;
}

/* ---- the importer (--importer-raw) -----------------------------------------
 * stdin:  u32 n (2K + 2), u32 device ordinal, u32 order (RAW_ORDER_*),
 *         u32 seed of the order plan, then n x (u32 len, bytes)
 * stdout: i32 status, u32 number of timed buffers that shared a driver
 *         block with an earlier one, then 4 x K doubles: usmipc first opens,
 *         raw first opens, usmipc closes, raw closes, K each in buffer
 *         order (pair i is buffers 2 + 2i through usmipc and 3 + 2i raw);
 *         on failure, status < 0 and a 256-byte message instead. */
static int importer_main(void) {
  uint32_t hdr[4];
  if (read_full(0, hdr, sizeof(hdr)) != 0)
    return 2;
  uint32_t n = hdr[0], ordinal = hdr[1], order = hdr[2], seed = hdr[3];
  if (n < 4 || n % 2 != 0)
    return 2;
  uint32_t k = (n - 2) / 2;
  uint8_t(*handles)[BENCH_HANDLE_MAX] = calloc(n, BENCH_HANDLE_MAX);
  uint32_t *lens = calloc(n, sizeof(uint32_t));
  void **ptrs = calloc(n, sizeof(void *));
  raw_mapping_t *maps = calloc(n, sizeof(raw_mapping_t));
  double *times = calloc(4 * (size_t)k, sizeof(double));
  if (!handles || !lens || !ptrs || !maps || !times)
    return 2;
  if (recv_handles(0, n, handles, lens) != 0)
    return 2;
  double *open_u = times, *open_r = times + k;
  double *close_u = times + 2 * k, *close_r = times + 3 * k;
  int32_t status = 0;
  char msg[BENCH_MSG_LEN] = {0};
  const raw_peer_t *peer = NULL;

  /* usmipc's close of the last reference unmaps, like the raw close. */
  usmipc_ipc_set_cache_size(0);

  /* The handles are usmipc's own; check them once, untimed. The peer is
   * the one of the first handle's backend. */
  for (uint32_t i = 0; i < n && status == 0; i++) {
    usmipc_ipc_handle_info_t info;
    int rc = usmipc_ipc_handle_inspect(handles[i], lens[i], &info);
    if (rc != 0) {
      status = rc;
      snprintf(msg, sizeof(msg), "handle %u: %s: %s", i, usmipc_err_name(rc),
               usmipc_last_error());
      break;
    }
    if (peer == NULL && (peer = peer_for(info.backend)) == NULL) {
      status = RAW_STATUS_FAIL;
      snprintf(msg, sizeof(msg),
               "handle %u: no bare-driver peer knows its backend", i);
      break;
    }
    status = peer->check(i, handles[i], &info, msg, sizeof(msg));
  }

  /* The peer's setup, untimed. */
  if (status == 0)
    status = peer->setup(ordinal, msg, sizeof(msg));

  /* Warm-up, untimed: the raw path on buffer 1 first (so that missing
   * ptrace rights are reported as such), then usmipc on buffer 0; each
   * opened and closed once (the first driver IPC call of a process costs
   * extra once). */
  if (status == 0) {
    double ignored;
    status = peer->open(handles[1], &maps[1], &ignored, msg, sizeof(msg));
    if (status == 0)
      status = peer->close(&maps[1], &ignored, msg, sizeof(msg));
  }
  if (status == 0) {
    int rc = usmipc_ipc_open(handles[0], lens[0], NULL, 0, &ptrs[0], NULL);
    if (rc == 0)
      rc = usmipc_ipc_close(ptrs[0]);
    if (rc != 0) {
      status = rc;
      snprintf(msg, sizeof(msg), "warm-up: %s: %s", usmipc_err_name(rc),
               usmipc_last_error());
    }
  }

  /* The order of the timed calls: pair j is buffer 2 + 2j (usmipc) and
   * 3 + 2j (raw), one right after the other; which of the two goes first
   * is the --order option's plan. */
  uint32_t *seq = calloc(n, sizeof(uint32_t));
  uint8_t *usmipc_first = calloc(k, 1);
  if (seq == NULL || usmipc_first == NULL)
    return 2;
  raw_order_plan(order, seed, k, usmipc_first);
  for (uint32_t j = 0; j < k; j++) {
    seq[2 * j] = usmipc_first[j] ? 2 + 2 * j : 3 + 2 * j;
    seq[2 * j + 1] = usmipc_first[j] ? 3 + 2 * j : 2 + 2 * j;
  }

  /* First opens: even buffers usmipc, odd buffers raw. */
  for (uint32_t s_i = 0; s_i < 2 * k && status == 0; s_i++) {
    uint32_t i = seq[s_i];
    uint32_t pair = (i - 2) / 2;
    if (i % 2 == 0) {
      double t0 = now_us();
      int rc = usmipc_ipc_open(handles[i], lens[i], NULL, 0, &ptrs[i], NULL);
      double t1 = now_us();
      if (rc != 0) {
        status = rc;
        snprintf(msg, sizeof(msg), "open %u: %s: %s", i, usmipc_err_name(rc),
                 usmipc_last_error());
      }
      open_u[pair] = t1 - t0;
    } else {
      status =
          peer->open(handles[i], &maps[i], &open_r[pair], msg, sizeof(msg));
    }
  }
  /* How many timed buffers landed in a driver block that another timed
   * buffer maps too: the driver maps such a block once, so the later opens
   * are cheap reference counts, not first opens. The exporter rounds each
   * allocation up to the block so that this stays 0. */
  uint32_t shared = 0;
  if (status == 0) {
    uint64_t *blocks = calloc(n, sizeof(uint64_t));
    if (blocks != NULL) {
      for (uint32_t i = 2; i < n; i++)
        blocks[i - 2] =
            (i % 2 == 0 ? (uint64_t)(uintptr_t)ptrs[i] : (uint64_t)maps[i].p) /
            peer->block;
      qsort(blocks, n - 2, sizeof(uint64_t), cmp_u64);
      for (uint32_t i = 1; i < n - 2; i++)
        shared += blocks[i] == blocks[i - 1];
      free(blocks);
    }
  }
  /* Closes, in the same order. */
  for (uint32_t s_i = 0; s_i < 2 * k && status == 0; s_i++) {
    uint32_t i = seq[s_i];
    uint32_t pair = (i - 2) / 2;
    if (i % 2 == 0) {
      double t0 = now_us();
      int rc = usmipc_ipc_close(ptrs[i]);
      double t1 = now_us();
      if (rc != 0) {
        status = rc;
        snprintf(msg, sizeof(msg), "close %u: %s: %s", i, usmipc_err_name(rc),
                 usmipc_last_error());
      }
      close_u[pair] = t1 - t0;
    } else {
      status = peer->close(&maps[i], &close_r[pair], msg, sizeof(msg));
    }
  }
  reply_status(status, msg, &shared, sizeof(shared));
  if (status == 0)
    write_full(1, times, 4 * (size_t)k * sizeof(double));
  return 0;
}

/* ---- the exporter -----------------------------------------------------------
 */

typedef struct raw_result {
  size_t size;
  unsigned handle_kind; /* the peer's kind_name names it */
  int valid;
  char note[96]; /* why there are no numbers */
  size_t pairs;
  size_t shared_blocks; /* see importer_main; should stay 0 */
  /* Per pair, in buffer order (not sorted), for --json. */
  samples_t open_u, open_r, close_u, close_r;
  samples_t usmipc_first; /* 1: the pair's usmipc call went first */
  summary_t s_open_u, s_open_r, s_close_u, s_close_r;
  /* Per block of pairs (see bench_raw_size): usmipc / raw, and usmipc -
   * raw per call in us. */
  summary_t open_ratio, close_ratio;
  summary_t open_diff, close_diff;
  /* 95% bootstrap confidence intervals of those four medians. */
  double ci[4][2];
} raw_result_t;

static size_t alloc_size(const raw_peer_t *peer, size_t size) {
  return (size + peer->block - 1) / peer->block * peer->block;
}

/* The seed of a round's order plan: fixed, so that a run can be repeated. */
static uint32_t raw_seed(size_t size, unsigned round) {
  uint64_t h = (uint64_t)size * 0x100000001B3ull ^ (uint64_t)(round + 1);
  return (uint32_t)(h ^ (h >> 32));
}

/* One round: 2K + 2 fresh buffers exported with usmipc, one importer that
 * opens them alternately through usmipc and the peer. */
static int raw_round(const options_t *o, const raw_peer_t *peer,
                     usmipc_device_t *dev, size_t size, unsigned round,
                     raw_result_t *res) {
  unsigned n = 2 * o->k + 2;
  void **bufs = calloc(n, sizeof(void *));
  usmipc_ipc_handle_t **hs = calloc(n, sizeof(*hs));
  if (bufs == NULL || hs == NULL)
    bench_die("out of memory", 0);
  /* The driver maps a block once per importer: the later opens of buffers
   * in it would be reference counts, and which side pays for the block
   * would depend on the order. Each buffer therefore gets its own blocks
   * (the allocation rounded up to the peer's block), and the handle exports
   * `size` bytes of it. */
  size_t asize = alloc_size(peer, size);
  int result = 0;
  unsigned made = 0;
  for (; made < n; made++) {
    int rc = bench_malloc(o, dev, asize, &bufs[made]);
    if (rc != 0) {
      fprintf(stderr,
              "usmipc_bench: --raw needs 2K + 2 = %u buffers of %zu bytes "
              "at once: buffer %u: %s: %s\n",
              n, asize, made, usmipc_err_name(rc), usmipc_last_error());
      snprintf(res->note, sizeof(res->note), "usmipc_malloc: %s (%u buffers)",
               usmipc_err_name(rc), n);
      result = -1;
      break;
    }
    if ((rc = usmipc_ipc_get_handle(bufs[made], size, &hs[made])) != 0) {
      usmipc_free(bufs[made]);
      fprintf(stderr, "usmipc_bench: usmipc_ipc_get_handle: %s: %s\n",
              usmipc_err_name(rc), usmipc_last_error());
      snprintf(res->note, sizeof(res->note), "usmipc_ipc_get_handle: %s",
               usmipc_err_name(rc));
      result = -1;
      break;
    }
  }
  if (result == 0) {
    const void *data;
    size_t len;
    usmipc_ipc_handle_info_t info;
    usmipc_ipc_handle_data(hs[0], &data, &len);
    if (usmipc_ipc_handle_inspect(data, len, &info) != 0 ||
        peer->kind_name(info.handle_kind) == NULL) {
      snprintf(res->note, sizeof(res->note), "unknown %s handle kind",
               peer->name);
      result = -1;
    } else {
      res->handle_kind = info.handle_kind;
    }
  }
  if (result != 0) {
    for (unsigned i = 0; i < made; i++) {
      usmipc_ipc_free_handle(hs[i]);
      usmipc_free(bufs[i]);
    }
    free(hs);
    free(bufs);
    return -1;
  }

  int to, from;
  pid_t pid = spawn_self(mode_paired.importer_role, "USMIPC_FD_TRANSPORT",
                         o->transports[0], &to, &from);
#ifdef PR_SET_PTRACER
  /* Under Yama ptrace_scope 1 a child may not take its parent's
   * descriptors with pidfd_getfd(2) unless the parent names it; the raw fd
   * path (and usmipc's pidfd transport) need that. Harmless without Yama. */
  prctl(PR_SET_PTRACER, (unsigned long)pid, 0, 0, 0);
#endif
  uint32_t seed = raw_seed(size, round);
  uint32_t hdr[4] = {n, (uint32_t)usmipc_device_index(dev), o->order, seed};
  int ok =
      write_full(to, hdr, sizeof(hdr)) == 0 && send_handles(to, hs, n) == 0;
  int32_t status = -1;
  char msg[BENCH_MSG_LEN];
  if (ok)
    ok = read_status(from, &status, msg) == 0;
  if (!ok) {
    snprintf(res->note, sizeof(res->note), "importer died");
    result = -1;
  } else if (status != 0) {
    fprintf(stderr, "usmipc_bench: raw importer: %s\n", msg);
    if (status == RAW_STATUS_EPERM)
      snprintf(res->note, sizeof(res->note),
               "raw fd baseline needs ptrace rights (pidfd_getfd: EPERM)");
    else if (status == RAW_STATUS_FAIL)
      snprintf(res->note, sizeof(res->note), "raw driver path failed");
    else
      snprintf(res->note, sizeof(res->note), "%s", usmipc_err_name(status));
    result = -1;
  } else {
    size_t k = o->k;
    uint32_t shared = 0;
    double *times = calloc(4 * k, sizeof(double));
    if (times == NULL)
      bench_die("out of memory", 0);
    if (read_full(from, &shared, sizeof(shared)) != 0 ||
        read_full(from, times, 4 * k * sizeof(double)) != 0) {
      snprintf(res->note, sizeof(res->note), "importer died");
      result = -1;
    } else {
      res->shared_blocks += shared;
      if (shared > 0) {
        char block[32];
        size_label(peer->block, block, sizeof(block));
        fprintf(stderr,
                "usmipc_bench: warning: %u of %zu timed %zu-byte buffers "
                "shared a %s driver block with another one: their opens "
                "were not all first opens\n",
                shared, 2 * k, size, block);
      }
      uint8_t *plan = calloc(k, 1);
      if (plan == NULL)
        bench_die("out of memory", 0);
      raw_order_plan(o->order, seed, (uint32_t)k, plan);
      for (size_t i = 0; i < k; i++)
        samples_add(&res->usmipc_first, plan[i]);
      free(plan);
      for (size_t i = 0; i < k; i++) {
        samples_add(&res->open_u, times[i]);
        samples_add(&res->open_r, times[k + i]);
        samples_add(&res->close_u, times[2 * k + i]);
        samples_add(&res->close_r, times[3 * k + i]);
      }
    }
    free(times);
  }
  close(to);
  close(from);
  wait_child(pid);
#ifdef PR_SET_PTRACER
  prctl(PR_SET_PTRACER, 0UL, 0, 0, 0);
#endif
  for (unsigned i = 0; i < n; i++) {
    usmipc_ipc_free_handle(hs[i]);
    usmipc_free(bufs[i]);
  }
  free(hs);
  free(bufs);
  return result;
}

static void bench_raw_size(const options_t *o, const raw_peer_t *peer,
                           usmipc_device_t *dev, size_t size,
                           raw_result_t *res) {
  memset(res, 0, sizeof(*res));
  res->size = size;
  int failed = 0;
  for (unsigned round = 0; round < o->rounds && !failed; round++)
    failed = raw_round(o, peer, dev, size, round, res) != 0;
  res->valid = !failed;
  if (failed)
    return;
  /* Paired statistics per block of consecutive pairs of one round: a
   * single pair for usmipc-first and raw-first, two pairs (usmipc, raw,
   * raw, usmipc) for abba, where each side has one call in each position,
   * so that an effect of the position cancels: ratio of the block's sums
   * (usmipc / raw) and the mean difference. */
  samples_t ro = {NULL, 0, 0}, rc = {NULL, 0, 0}, dop = {NULL, 0, 0},
            dcl = {NULL, 0, 0};
  size_t b = o->order == RAW_ORDER_ABBA ? 2 : 1;
  res->pairs = res->open_u.n;
  for (size_t base = 0; base + o->k <= res->pairs; base += o->k) {
    for (size_t q = 0; q + b <= o->k; q += b) {
      double ou = 0, orw = 0, cu = 0, cr = 0;
      for (size_t i = base + q; i < base + q + b; i++) {
        ou += res->open_u.v[i];
        orw += res->open_r.v[i];
        cu += res->close_u.v[i];
        cr += res->close_r.v[i];
      }
      if (orw > 0)
        samples_add(&ro, ou / orw);
      if (cr > 0)
        samples_add(&rc, cu / cr);
      samples_add(&dop, (ou - orw) / (double)b);
      samples_add(&dcl, (cu - cr) / (double)b);
    }
  }
  res->s_open_u = summarize_copy(&res->open_u);
  res->s_open_r = summarize_copy(&res->open_r);
  res->s_close_u = summarize_copy(&res->close_u);
  res->s_close_r = summarize_copy(&res->close_r);
  res->open_ratio = summarize(&ro);
  res->close_ratio = summarize(&rc);
  res->open_diff = summarize(&dop);
  res->close_diff = summarize(&dcl);
  bootstrap_median_ci(&ro, res->ci[0]);
  bootstrap_median_ci(&rc, res->ci[1]);
  bootstrap_median_ci(&dop, res->ci[2]);
  bootstrap_median_ci(&dcl, res->ci[3]);
  free(ro.v);
  free(rc.v);
  free(dop.v);
  free(dcl.v);
}

/* ---- output -----------------------------------------------------------------
 */

static int read_yama(char *buf, size_t len) {
  snprintf(buf, len, "absent");
  FILE *f = fopen("/proc/sys/kernel/yama/ptrace_scope", "r");
  if (f == NULL)
    return -1;
  if (fgets(buf, (int)len, f) == NULL)
    snprintf(buf, len, "unreadable");
  buf[strcspn(buf, "\n")] = '\0';
  fclose(f);
  return 0;
}

static void ratio_cell(const summary_t *a, const summary_t *b) {
  if (a->valid && b->valid && b->median > 0)
    printf(" %.3f |", a->median / b->median);
  else
    printf(" n/a |");
}

/* The median and its 95% confidence interval in brackets. */
static void paired_cell(const summary_t *s, const double ci[2],
                        const char *fmt) {
  if (!s->valid) {
    printf(" n/a |");
    return;
  }
  printf(" ");
  printf(fmt, s->median);
  printf(" [");
  printf(fmt, ci[0]);
  printf(", ");
  printf(fmt, ci[1]);
  printf("] |");
}

static void print_raw_table(const options_t *o, const raw_peer_t *peer,
                            const raw_result_t *res) {
  printf("| size | kind | pairs | first open, usmipc | first open, raw | "
         "ratio | paired ratio | paired Δ | close, usmipc | close, raw | "
         "ratio | paired ratio | paired Δ |\n");
  printf("|---|---|---:|---|---|---:|---|---|---|---|---:|---|---|\n");
  for (int i = 0; i < o->nsizes; i++) {
    const raw_result_t *r = &res[i];
    char label[32];
    size_label(r->size, label, sizeof(label));
    if (!r->valid) {
      printf("| %s | %s | 0 | n/a (%s) | n/a | n/a | n/a | n/a | n/a | n/a | "
             "n/a | n/a | n/a |\n",
             label, kind_label(peer, r->handle_kind),
             r->note[0] ? r->note : "not measured");
      continue;
    }
    printf("| %s | %s | %zu |", label, kind_label(peer, r->handle_kind),
           r->pairs);
    md_cell(&r->s_open_u);
    md_cell(&r->s_open_r);
    ratio_cell(&r->s_open_u, &r->s_open_r);
    paired_cell(&r->open_ratio, r->ci[0], "%.3f");
    paired_cell(&r->open_diff, r->ci[2], "%+.2f");
    md_cell(&r->s_close_u);
    md_cell(&r->s_close_r);
    ratio_cell(&r->s_close_u, &r->s_close_r);
    paired_cell(&r->close_ratio, r->ci[1], "%.3f");
    paired_cell(&r->close_diff, r->ci[3], "%+.2f");
    printf("\n");
  }
  printf("\nTimes in microseconds: median (p10–p90). ratio: usmipc median / "
         "raw median. paired ratio and paired Δ: median [95%% bootstrap "
         "confidence interval] over blocks of consecutive pairs (a pair: one "
         "usmipc and one raw call, "
         "one right after the other in the same importer; a block: %s) of "
         "sum(usmipc) / sum(raw) and of (sum(usmipc) − sum(raw)) / pairs, in "
         "us. 1.05 means usmipc takes 5%% longer.\n",
         o->order == RAW_ORDER_ABBA
             ? "2 pairs, usmipc raw raw usmipc or the reverse, at random, "
               "so that a cost of the position cancels"
             : "1 pair");
  char block[32];
  size_label(peer->block, block, sizeof(block));
  for (int i = 0; i < o->nsizes; i++)
    if (res[i].valid && res[i].shared_blocks > 0)
      printf("\nWarning: at %zu bytes, %zu timed buffers shared a %s "
             "driver block with another one; their opens were partly "
             "reference counts, not first opens.\n",
             res[i].size, res[i].shared_blocks, block);
}

static void write_json_raw(const options_t *o, const raw_peer_t *peer,
                           usmipc_device_t *dev, const raw_result_t *res) {
  char yama[32];
  read_yama(yama, sizeof(yama));
  FILE *f = json_open(o->json, "raw", dev);
  fprintf(f, "  \"k\": %u,\n  \"rounds\": %u,\n", o->k, o->rounds);
  fprintf(f, "  \"kind_requested\": \"%s\",\n", o->kind ? o->kind : "default");
  fprintf(f, "  \"fd_transport\": \"%s\",\n", o->transports[0]);
  fprintf(f, "  \"order\": \"%s\",\n", raw_order_names[o->order]);
  fprintf(f, "  \"import_cache_size\": 0,\n");
  fprintf(f, "  \"yama_ptrace_scope\": \"%s\",\n", yama);
  fprintf(f, "  \"results\": [\n");
  for (int i = 0; i < o->nsizes; i++) {
    const raw_result_t *r = &res[i];
    fprintf(f, "    {\"size\": %zu", r->size);
    if (r->handle_kind)
      fprintf(f, ",\n      \"handle_kind\": \"%s\"",
              kind_label(peer, r->handle_kind));
    if (!r->valid) {
      fprintf(f, ",\n      \"error\": \"%s\"}%s\n",
              r->note[0] ? r->note : "not measured",
              i + 1 < o->nsizes ? "," : "");
      continue;
    }
    fprintf(f, ",\n      \"pairs\": %zu", r->pairs);
    fprintf(f, ",\n      \"allocation_size\": %zu", alloc_size(peer, r->size));
    fprintf(f, ",\n      \"shared_block_buffers\": %zu", r->shared_blocks);
    json_summary(f, "open_first_usmipc", &r->s_open_u);
    json_summary(f, "open_first_raw", &r->s_open_r);
    fprintf(f, ",\n      \"open_ratio_of_medians\": %.4f",
            r->s_open_u.median / r->s_open_r.median);
    json_summary_ci(f, "open_paired_ratio", &r->open_ratio, r->ci[0]);
    json_summary_ci(f, "open_paired_diff", &r->open_diff, r->ci[2]);
    json_summary(f, "close_usmipc", &r->s_close_u);
    json_summary(f, "close_raw", &r->s_close_r);
    fprintf(f, ",\n      \"close_ratio_of_medians\": %.4f",
            r->s_close_u.median / r->s_close_r.median);
    json_summary_ci(f, "close_paired_ratio", &r->close_ratio, r->ci[1]);
    json_summary_ci(f, "close_paired_diff", &r->close_diff, r->ci[3]);
    fprintf(f, ",\n      \"samples\": {\"index\": \"round * k + pair\"");
    json_samples(f, "open_usmipc", &r->open_u, 3);
    json_samples(f, "open_raw", &r->open_r, 3);
    json_samples(f, "close_usmipc", &r->close_u, 3);
    json_samples(f, "close_raw", &r->close_r, 3);
    json_samples(f, "usmipc_first", &r->usmipc_first, 0);
    fprintf(f, "}}%s\n", i + 1 < o->nsizes ? "," : "");
  }
  fprintf(f, "  ]\n}\n");
  fclose(f);
}

/* ---- the measurement --------------------------------------------------------
 */

static int parse_option(options_t *o, const char *a, const char *v) {
  if (strcmp(a, "--order") != 0)
    return 0;
  unsigned m = 0;
  while (m < 3 && strcmp(v, raw_order_names[m]) != 0)
    m++;
  if (m == 3) {
    fprintf(stderr,
            "usmipc_bench: --order takes usmipc-first, raw-first "
            "or abba, not '%s'\n",
            v);
    return 2;
  }
  o->order = m;
  return 1;
}

static int configure(options_t *o, int k_set, int transports_set) {
  /* 2K + 2 buffers per round: K pairs and the two warm-up buffers. */
  if (!k_set)
    o->k = 100;
  /* Both sides take descriptors the same way by default: the raw fd path
   * uses pidfd_getfd(2), so usmipc does too. */
  if (!transports_set) {
    o->transports[0] = "pidfd";
    o->ntransports = 1;
  }
  if (o->ntransports > 1) {
    fprintf(stderr, "usmipc_bench: --raw takes one fd transport for usmipc's "
                    "side (--transports pidfd, socket or auto)\n");
    return 2;
  }
  return 0;
}

static int check_device(const options_t *o, int select_rc,
                        usmipc_device_t *dev) {
  char names[128], hints[256];
  peer_list(names, sizeof(names), 0);
  peer_list(hints, sizeof(hints), 1);
  if (select_rc != 0) {
    fprintf(stderr,
            "usmipc_bench: --raw needs a %s device, and '%s' gives none: "
            "%s (%s)\n",
            names, o->device, usmipc_err_name(select_rc), usmipc_last_error());
    return 1;
  }
  if (peer_for(usmipc_device_backend(dev)) == NULL) {
    fprintf(stderr,
            "usmipc_bench: --raw needs a %s device (it compares usmipc with "
            "the bare %s driver calls): pass --device %s, not %s\n",
            names, names, hints, usmipc_device_filter_string(dev));
    return 1;
  }
  return 0;
}

static int run(const options_t *o, usmipc_device_t *dev, usmipc_queue_t *q) {
  (void)q;
  const raw_peer_t *peer = peer_for(usmipc_device_backend(dev));
  char yama[32], block[32];
  read_yama(yama, sizeof(yama));
  size_label(peer->block, block, sizeof(block));
  printf("Raw-driver baseline: per round 2K + 2 = %u fresh buffers of each "
         "size (memory kind: %s; each allocation rounded up to %s so "
         "that no two share a driver block), all exported with usmipc; "
         "one importer "
         "opens buffer 2i with usmipc_ipc_open and buffer 2i+1 with the "
         "bare driver calls, alternately, after one untimed warm-up of "
         "each. K = %u pairs per round, %u rounds; order within a pair: "
         "%s; usmipc's fd transport: %s; importer cache size 0 (close "
         "unmaps); Yama ptrace_scope: %s.\n\n",
         2 * o->k + 2, o->kind ? o->kind : "backend default", block, o->k,
         o->rounds, raw_order_names[o->order], o->transports[0], yama);
  fflush(stdout);
  raw_result_t *res = calloc((size_t)o->nsizes, sizeof(raw_result_t));
  if (res == NULL)
    bench_die("out of memory", 0);
  int any_ok = 0;
  for (int i = 0; i < o->nsizes; i++) {
    bench_raw_size(o, peer, dev, o->sizes[i], &res[i]);
    any_ok |= res[i].valid;
  }
  print_raw_table(o, peer, res);
  if (o->json)
    write_json_raw(o, peer, dev, res);
  for (int i = 0; i < o->nsizes; i++) {
    free(res[i].open_u.v);
    free(res[i].open_r.v);
    free(res[i].close_u.v);
    free(res[i].close_r.v);
    free(res[i].usmipc_first.v);
  }
  free(res);
  return any_ok ? 0 : 1;
}

const bench_mode_t mode_paired = {
    .flag = "--raw",
    .importer_role = "--importer-raw",
    .importer_main = importer_main,
    .synopsis =
        "usmipc_bench --raw --device cuda[:gpu[:N]] [--kind fd|native]\n"
        "                    [--sizes 4K,1M,64M,256M] [--k 100] [--rounds 3]\n"
        "                    [--transports pidfd] [--order abba] [--json "
        "FILE]\n",
    .options_help =
        "  --raw   usmipc's first open and close against the bare CUDA\n"
        "          driver calls, paired and interleaved in one importer\n"
        "          (2K + 2 buffers of each size at once)\n"
        "  --order which call of a --raw pair goes first: abba (default:\n"
        "          blocks usmipc raw raw usmipc or the reverse, at random),\n"
        "          usmipc-first or raw-first\n",
    .parse_option = parse_option,
    .configure = configure,
    .check_device = check_device,
    .run = run,
};
