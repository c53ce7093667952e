/* CUDA VMM memory of another library (docs/cuda.md, "Memory of PyTorch's
 * expandable segments"): the test plays that library with the driver API
 * (dlopen, as the backend does), reserving a range and mapping physical
 * chunks back to back into it, as PyTorch's expandable segments do, then
 * shares ranges of it through usmipc with an agent process.
 *
 * Runs on a CUDA test device only (USMIPC_TEST_DEVICE=cuda:gpu:0, as
 * tests/gpu/run.sh sets); skipped elsewhere. */
#include <dlfcn.h>
#include <unistd.h>

#include "task.h"

/* The driver API, the entry points used here (cuda.h, CUDA 12/13). */
typedef struct {
  int type;
  int requested_handle_types;
  struct {
    int type;
    int id;
  } location;
  void *win32_metadata;
  unsigned char alloc_flags[8];
} cu_prop_t;
typedef struct {
  struct {
    int type;
    int id;
  } location;
  int flags;
} cu_access_t;

static struct {
  int (*init)(unsigned);
  int (*device_get)(int *, int);
  int (*primary_retain)(void **, int);
  int (*ctx_set)(void *);
  int (*granularity)(size_t *, const cu_prop_t *, int);
  int (*create)(unsigned long long *, size_t, const cu_prop_t *,
                unsigned long long);
  int (*release)(unsigned long long);
  int (*reserve)(unsigned long long *, size_t, size_t, unsigned long long,
                 unsigned long long);
  int (*address_free)(unsigned long long, size_t);
  int (*map)(unsigned long long, size_t, size_t, unsigned long long,
             unsigned long long);
  int (*unmap)(unsigned long long, size_t);
  int (*set_access)(unsigned long long, size_t, const cu_access_t *, size_t);
} cu;

#define CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR 1
#define CU_MEM_ALLOCATION_TYPE_PINNED 1
#define CU_MEM_LOCATION_TYPE_DEVICE 1
#define CU_MEM_ACCESS_FLAGS_PROT_READWRITE 3

static int cudev;

/* Loads the driver and makes the test device's primary context current
 * (the one usmipc uses); 0, or skips. */
static int cu_load(void) {
  usmipc_device_t *dev = test_device();
  if (usmipc_device_backend(dev) != USMIPC_BACKEND_CUDA)
    return TEST_SKIP;
  void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  ASSERT_NOT_NULL(lib);
#define SYM(field, name) *(void **)&cu.field = dlsym(lib, name)
  SYM(init, "cuInit");
  SYM(device_get, "cuDeviceGet");
  SYM(primary_retain, "cuDevicePrimaryCtxRetain");
  SYM(ctx_set, "cuCtxSetCurrent");
  SYM(granularity, "cuMemGetAllocationGranularity");
  SYM(create, "cuMemCreate");
  SYM(release, "cuMemRelease");
  SYM(reserve, "cuMemAddressReserve");
  SYM(address_free, "cuMemAddressFree");
  SYM(map, "cuMemMap");
  SYM(unmap, "cuMemUnmap");
  SYM(set_access, "cuMemSetAccess");
#undef SYM
  ASSERT(cu.init && cu.device_get && cu.primary_retain && cu.ctx_set &&
         cu.granularity && cu.create && cu.release && cu.reserve &&
         cu.address_free && cu.map && cu.unmap && cu.set_access);
  void *ctx = NULL;
  ASSERT_EQ(cu.init(0), 0);
  ASSERT_EQ(cu.device_get(&cudev, usmipc_device_index(dev)), 0);
  ASSERT_EQ(cu.primary_retain(&ctx, cudev), 0);
  ASSERT_EQ(cu.ctx_set(ctx), 0);
  return 0;
}

static cu_prop_t chunk_prop(int handle_types) {
  cu_prop_t prop;
  memset(&prop, 0, sizeof(prop));
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.requested_handle_types = handle_types;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = cudev;
  return prop;
}

static size_t granularity(void) {
  cu_prop_t prop = chunk_prop(CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
  size_t g = 0;
  ASSERT_EQ(cu.granularity(&g, &prop, 0), 0);
  ASSERT_GT(g, 0);
  return g;
}

/* "Another library's" segment: a reservation of `reserved` bytes whose
 * first n chunks are mapped back to back, each its own cuMemCreate, with
 * access set once over all of them. */
#define SEG_MAX 260
typedef struct segment {
  unsigned long long base;
  size_t reserved;
  int n;
  size_t sizes[SEG_MAX];
} segment_t;

static void segment_map(segment_t *s, size_t reserved, const size_t *sizes,
                        int n, int handle_types) {
  ASSERT_LE(n, SEG_MAX);
  cu_prop_t prop = chunk_prop(handle_types);
  s->reserved = reserved;
  s->n = n;
  ASSERT_EQ(cu.reserve(&s->base, reserved, granularity(), 0, 0), 0);
  size_t at = 0;
  for (int i = 0; i < n; i++) {
    unsigned long long h = 0;
    s->sizes[i] = sizes[i];
    ASSERT_EQ(cu.create(&h, sizes[i], &prop, 0), 0);
    ASSERT_EQ(cu.map(s->base + at, sizes[i], 0, h, 0), 0);
    ASSERT_EQ(cu.release(h), 0); /* the mapping keeps it, as in PyTorch */
    at += sizes[i];
  }
  cu_access_t access = {{CU_MEM_LOCATION_TYPE_DEVICE, cudev},
                        CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
  ASSERT_EQ(cu.set_access(s->base, at, &access, 1), 0);
}

static void segment_unmap(segment_t *s) {
  size_t at = 0;
  for (int i = 0; i < s->n; i++) {
    ASSERT_EQ(cu.unmap(s->base + at, s->sizes[i]), 0);
    at += s->sizes[i];
  }
  ASSERT_EQ(cu.address_free(s->base, s->reserved), 0);
}

static void export_hex(const void *ptr, size_t nbytes, usmipc_ipc_handle_t **h,
                       char *hex, usmipc_ipc_handle_info_t *info, size_t *len) {
  uint8_t *data;
  *h = export_copy(ptr, nbytes, &data, len);
  ASSERT_OK(usmipc_ipc_handle_inspect(data, *len, info));
  hex_encode(data, *len, hex);
  free(data);
}

static size_t agent_fds(agent_t *a) {
  AGENT_OK(a, "fds");
  return (size_t)strtoull(a->reply, NULL, 10);
}

TEST_IMPL(cuda_vmm_foreign_chunks) {
  if (cu_load() != 0)
    RETURN_SKIP("the test device is not a CUDA GPU (USMIPC_TEST_DEVICE)");
  const size_t g = granularity();
  /* Chunks A (2g), B (g), C (g), then g reserved but unmapped. */
  segment_t seg;
  segment_map(&seg, 5 * g, (size_t[]){2 * g, g, g}, 3, 1);
  uint8_t *p = (uint8_t *)(uintptr_t)seg.base;
  dev_fill(p, 4 * g, 21, 0);

  /* A pointer of the segment is described by the chunk holding it. */
  usmipc_pointer_info_t qa, qc;
  ASSERT_OK(usmipc_pointer_query(p + 7, &qa));
  ASSERT_OK(usmipc_pointer_query(p + 3 * g + 7, &qc));
  ASSERT(qa.is_foreign && qc.is_foreign);
  ASSERT_PTR_EQ(qa.base, p);
  ASSERT_UEQ(qa.size, 2 * g);
  ASSERT_PTR_EQ(qc.base, p + 3 * g);
  ASSERT_UEQ(qc.size, g);
  ASSERT_UNE(qa.buffer_id, qc.buffer_id);

  /* Warm-up: the broker and the export table exist, and this process has
   * proven itself as an exporter (a run opened here maps again, through
   * its own broker), before descriptors are counted. Sockets are not
   * counted: the broker closes idle connections when it likes. A closed
   * mapping is unmapped at once, so that nothing the driver keeps for an
   * import lingers in the counts. */
  ASSERT_OK(usmipc_ipc_set_cache_size(0));
  {
    usmipc_ipc_handle_t *warm_run, *warm_one;
    uint8_t *run_data, *one_data;
    size_t run_len, one_len;
    void *w = NULL;
    warm_run = export_copy(p, 3 * g, &run_data, &run_len);
    warm_one = export_copy(p + 3 * g, 64, &one_data, &one_len);
    ASSERT_OK(usmipc_ipc_open(run_data, run_len, NULL, 0, &w, NULL));
    ASSERT_OK(usmipc_ipc_close(w));
    free(run_data);
    free(one_data);
    ASSERT_OK(usmipc_ipc_free_handle(warm_run));
    ASSERT_OK(usmipc_ipc_free_handle(warm_one));
  }
  const size_t base_fds = count_fds_except_sockets();

  /* A and B (k = 2), A to C (k = 3, two runs), and C alone (k = 1: an
   * ordinary fd handle without a chunk record). */
  static char hab[HEX_MAX], habc[HEX_MAX], hc[HEX_MAX];
  usmipc_ipc_handle_t *h_ab, *h_abc, *h_c;
  usmipc_ipc_handle_info_t iab, iabc, ic;
  size_t lab, labc, lc;
  const size_t ab_off = 100, ab_n = 3 * g - 200;
  const size_t abc_off = 12345, abc_n = 4 * g - 12345 - 1;
  const size_t c_off = 5, c_n = 4096;
  export_hex(p + ab_off, ab_n, &h_ab, hab, &iab, &lab);
  export_hex(p + abc_off, abc_n, &h_abc, habc, &iabc, &labc);
  export_hex(p + 3 * g + c_off, c_n, &h_c, hc, &ic, &lc);
  ASSERT_UEQ(iab.allocation_size, 3 * g);
  ASSERT_UEQ(iab.offset, ab_off);
  ASSERT_UEQ(iab.nbytes, ab_n);
  ASSERT_UEQ(iabc.allocation_size, 4 * g);
  ASSERT_UEQ(iabc.offset, abc_off);
  ASSERT_UEQ(ic.allocation_size, g);
  ASSERT_UEQ(ic.offset, c_off);
  ASSERT_EQ(iab.handle_kind, 2);
  ASSERT_EQ(ic.handle_kind, 2);
  ASSERT_EQ(lc, 224);                /* no record */
  ASSERT_EQ(lab, 224 + 4 + 8 + 32);  /* runs 2g x 1, g x 1 */
  ASSERT_EQ(labc, 224 + 4 + 8 + 32); /* runs 2g x 1, g x 2 */
  ASSERT_UEQ(ic.buffer_id, qc.buffer_id);
  ASSERT_UNE(iab.buffer_id, iabc.buffer_id);
  /* The exporter holds a descriptor per chunk of each export. */
  ASSERT_EQ(count_fds_except_sockets(), base_fds + 2 + 3 + 1);
  /* A second handle of the same range is the same export. */
  usmipc_ipc_handle_t *again;
  usmipc_ipc_handle_info_t iagain;
  static char hagain[HEX_MAX];
  size_t lagain;
  export_hex(p + ab_off + 1, ab_n - 1, &again, hagain, &iagain, &lagain);
  ASSERT_UEQ(iagain.buffer_id, iab.buffer_id);
  ASSERT_EQ(count_fds_except_sockets(), base_fds + 6);
  ASSERT_OK(usmipc_ipc_free_handle(again));

  /* Opened by the exporter itself: a run is mapped again (it has no one
   * allocation to alias), a single chunk is an alias of the pointer. */
  static uint8_t raw[HEX_MAX / 2];
  ssize_t rawlen = hex_decode(habc, raw, sizeof(raw));
  ASSERT_GT(rawlen, 0);
  void *q = NULL;
  size_t mapped = 0;
  ASSERT_OK(usmipc_ipc_open(raw, (size_t)rawlen, NULL, 0, &q, &mapped));
  ASSERT_PTR_NE(q, p + abc_off);
  ASSERT_UEQ(mapped, abc_n);
  ASSERT_PATTERN(q, abc_n, 21, abc_off);
  ASSERT_OK(usmipc_ipc_close(q));
  rawlen = hex_decode(hc, raw, sizeof(raw));
  ASSERT_OK(usmipc_ipc_open(raw, (size_t)rawlen, NULL, 0, &q, &mapped));
  ASSERT_PTR_EQ(q, p + 3 * g + c_off);
  ASSERT_OK(usmipc_ipc_close(q));

  /* Another process reads what the exporter wrote, through two mappings
   * of the same chunks (two runs), and writes across chunk boundaries. */
  agent_t im;
  agent_start(&im, NULL);
  /* Descriptors here with the three exports and the agent's pipes. */
  const size_t live_fds = count_fds_except_sockets();
  AGENT_OK(&im, "open 0 %s 0", hab);
  AGENT_OK(&im, "check 0 21");
  AGENT_OK(&im, "open 1 %s 0", habc);
  AGENT_OK(&im, "check 1 21");
  /* The importer writes 4 KiB across the A/B boundary through one run ... */
  AGENT_OK(&im, "fill 1 22 %zu 4096", 2 * g - abc_off - 2048);
  ASSERT_PATTERN(p + 2 * g - 2048, 4096, 22, 2 * g - 2048);
  /* ... which the other run of the same chunks sees. */
  AGENT_OK(&im, "check 0 22 %zu 4096", 2 * g - ab_off - 2048);
  /* The exporter writes across the B/C boundary. */
  dev_fill(p + 3 * g - 1000, 2000, 23, 3 * g - 1000);
  AGENT_OK(&im, "check 1 23 %zu 2000", 3 * g - 1000 - abc_off);
  /* One chunk, both ways (origin: the offset in the chunk). */
  dev_fill(p + 3 * g + c_off, c_n, 25, c_off);
  AGENT_OK(&im, "open 2 %s 0", hc);
  AGENT_OK(&im, "check 2 25");
  AGENT_OK(&im, "fill 2 26");
  ASSERT_PATTERN(p + 3 * g + c_off, c_n, 26, c_off);

  /* No descriptor stays behind in the importer: the chunks' descriptors
   * are closed once mapped. With an empty cache each open maps again. */
  AGENT_OK(&im, "close 0");
  AGENT_OK(&im, "close 1");
  AGENT_OK(&im, "close 2");
  AGENT_OK(&im, "cache 0");
  const size_t im_fds = agent_fds(&im);
  for (int round = 0; round < 3; round++) {
    AGENT_OK(&im, "open 1 %s 0", habc);
    AGENT_OK(&im, "check 1 22 %zu 4096", 2 * g - abc_off - 2048);
    AGENT_OK(&im, "close 1");
  }
  ASSERT_EQ(agent_fds(&im), im_fds);

  /* Forced transports: pidfd_getfd cannot take a run (the handle names the
   * first descriptor only); the broker can. */
  if (pidfd_supported()) {
    agent_t pf;
    agent_start(&pf, "pidfd");
    AGENT_ERR(&pf, USMIPC_ETRANSPORT, "open 0 %s 0", habc);
    ASSERT_MSG(strstr(pf.reply, "auto or socket") != NULL, "%s", pf.reply);
    AGENT_OK(&pf, "open 1 %s 0", hc); /* one chunk: an ordinary fd handle */
    AGENT_OK(&pf, "check 1 26");
    AGENT_OK(&pf, "close 1");
    agent_stop_ok(&pf);
  }
  agent_t so;
  agent_start(&so, "socket");
  AGENT_OK(&so, "open 0 %s 0", habc);
  AGENT_OK(&so, "check 0 22 %zu 4096", 2 * g - abc_off - 2048);
  AGENT_OK(&so, "close 0");
  agent_stop_ok(&so);

  /* The last handle of an export revokes it and closes its descriptors;
   * the importer's next open is refused. */
  ASSERT_OK(usmipc_ipc_free_handle(h_abc));
  ASSERT_EQ(count_fds_except_sockets(), live_fds - 3);
  AGENT_ERR(&im, USMIPC_EEXPORTERGONE, "open 1 %s 0", habc);
  ASSERT_OK(usmipc_ipc_free_handle(h_ab));
  ASSERT_OK(usmipc_ipc_free_handle(h_c));
  ASSERT_EQ(count_fds_except_sockets(), live_fds - 6);
  agent_stop_ok(&im);
  ASSERT_EQ(count_fds_except_sockets(), base_fds);

  /* A range that runs past the mapped chunks into the reservation. */
  usmipc_ipc_handle_t *bad = NULL;
  ASSERT_ERR(usmipc_ipc_get_handle(p + 3 * g, 2 * g, &bad), USMIPC_ERANGE);
  ASSERT_MSG(strstr(usmipc_last_error(), "mapped only up to") != NULL, "%s",
             usmipc_last_error());
  ASSERT_EQ(count_fds_except_sockets(), base_fds);
  segment_unmap(&seg);
  return 0;
}

/* Chunks made without a shareable handle type cannot be shared: the error
 * says what to do. And the most chunks one handle carries: 250, every
 * descriptor of them in one broker answer. */
TEST_IMPL(cuda_vmm_foreign_limits) {
  if (cu_load() != 0)
    RETURN_SKIP("the test device is not a CUDA GPU (USMIPC_TEST_DEVICE)");
  const size_t g = granularity();
  segment_t plain;
  segment_map(&plain, 2 * g, (size_t[]){g, g}, 2, 0);
  uint8_t *p = (uint8_t *)(uintptr_t)plain.base;
  usmipc_ipc_handle_t *h = NULL;
  ASSERT_ERR(usmipc_ipc_get_handle(p + 10, 100, &h), USMIPC_ENOTSUP);
  ASSERT_MSG(strstr(usmipc_last_error(), "no shareable handle type") &&
                 strstr(usmipc_last_error(),
                        "CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR") &&
                 strstr(usmipc_last_error(), "usmipc pool"),
             "%s", usmipc_last_error());
  segment_unmap(&plain);

  enum { N = 251 };
  static size_t sizes[N];
  for (int i = 0; i < N; i++)
    sizes[i] = g;
  static segment_t big;
  segment_map(&big, N * g, sizes, N, 1);
  uint8_t *b = (uint8_t *)(uintptr_t)big.base;
  ASSERT_ERR(usmipc_ipc_get_handle(b, N * g, &h), USMIPC_ENOTSUP);
  ASSERT_MSG(strstr(usmipc_last_error(), "more than 250"), "%s",
             usmipc_last_error());
  /* 250 chunks: filled at both ends and across every boundary region. */
  dev_fill(b, 4096, 31, 0);
  dev_fill(b + 250 * g - 4096, 4096, 32, 250 * g - 4096);
  dev_fill(b + 125 * g - 2048, 4096, 33, 125 * g - 2048);
  /* The broker and the export table exist before descriptors are counted. */
  usmipc_ipc_handle_t *warm;
  uint8_t *warm_data;
  size_t warm_len;
  warm = export_copy(b, 64, &warm_data, &warm_len);
  free(warm_data);
  ASSERT_OK(usmipc_ipc_free_handle(warm));
  const size_t before = count_fds_except_sockets();
  static char hex[HEX_MAX];
  usmipc_ipc_handle_info_t info;
  size_t len;
  export_hex(b, 250 * g, &h, hex, &info, &len);
  ASSERT_UEQ(info.allocation_size, 250 * g);
  ASSERT_EQ(len, 224 + 4 + 8 + 16);
  ASSERT_EQ(count_fds_except_sockets(), before + 250);
  agent_t im;
  agent_start(&im, NULL);
  AGENT_OK(&im, "open 0 %s 0", hex);
  AGENT_OK(&im, "check 0 31 0 4096");
  AGENT_OK(&im, "check 0 32 %zu 4096", 250 * g - 4096);
  AGENT_OK(&im, "check 0 33 %zu 4096", 125 * g - 2048);
  AGENT_OK(&im, "fill 0 34 %zu 4096", 249 * g - 2048);
  ASSERT_PATTERN(b + 249 * g - 2048, 4096, 34, 249 * g - 2048);
  AGENT_OK(&im, "close 0");
  agent_stop_ok(&im);
  ASSERT_OK(usmipc_ipc_free_handle(h));
  ASSERT_EQ(count_fds_except_sockets(), before);
  segment_unmap(&big);
  return 0;
}
