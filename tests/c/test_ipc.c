/* IPC between unrelated processes: agents (task.h) started by re-executing
 * the runner play exporter and importer, or face the test process itself.
 * Every test checks bytes on the far side, in both directions where it
 * matters: an importer that reads the exporter's writes and an exporter
 * that reads the importer's prove one set of pages, not a copy. */
#include <errno.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include "task.h"

#define MiB (1024 * 1024)

/* Decodes an agent's "ok HEX" export reply into bytes. */
static size_t reply_handle(const agent_t *a, uint8_t *out, size_t cap) {
  ssize_t n = hex_decode(a->reply, out, cap);
  ASSERT_MSG(n > 0, "bad handle hex from agent: %s", a->reply);
  return (size_t)n;
}

/* "ok PTR MAPPED" */
static size_t reply_mapped(const agent_t *a) {
  const char *s = strchr(a->reply, ' ');
  ASSERT_NOT_NULL(s);
  return (size_t)strtoull(s + 1, NULL, 10);
}

/* "ok BASE SIZE BUFFER_ID IS_IPC" */
static void reply_query(const agent_t *a, size_t *size, uint64_t *buffer_id,
                        int *is_ipc) {
  unsigned long long base, sz, id;
  int ipc;
  ASSERT_EQ(sscanf(a->reply, "%llx %llu %llu %d", &base, &sz, &id, &ipc), 4);
  if (size)
    *size = (size_t)sz;
  if (buffer_id)
    *buffer_id = id;
  if (is_ipc)
    *is_ipc = ipc;
}

/* pidfd_getfd(2) may be missing or not permitted; /proc reopening works
 * only for host memory (memfds), not for CUDA's or Level Zero's descriptors
 * (dma-bufs; the test driver's stand-ins are marked the same way), whose
 * handles do not carry the REOPENABLE flag. */
static int skip_without_pidfd(const char *transport) {
  if (transport && strcmp(transport, "procfd") == 0)
    return usmipc_device_backend(test_device()) != USMIPC_BACKEND_HOST;
  return transport && strcmp(transport, "pidfd") == 0 && !pidfd_supported();
}

/* Exporter and importer agents, both on `transport`: the importer reads
 * what the exporter wrote and the exporter reads what the importer wrote. */
static int cross_process(const char *transport) {
  if (skip_without_pidfd(transport))
    RETURN_SKIP("%s cannot move this device's descriptors here", transport);
  agent_t ex, im;
  static char hex[HEX_MAX];
  const size_t n = 1 * MiB + 4096;
  agent_start(&ex, transport);
  agent_start(&im, transport);
  AGENT_OK(&ex, "alloc 0 device %zu", n);
  AGENT_OK(&ex, "fill 0 11");
  AGENT_OK(&ex, "export 0 0 0");
  snprintf(hex, sizeof(hex), "%s", ex.reply);
  AGENT_OK(&im, "open 0 %s 0", hex);
  ASSERT_EQ(reply_mapped(&im), n);
  AGENT_OK(&im, "check 0 11");
  /* The importer writes; the exporter sees it. */
  AGENT_OK(&im, "fill 0 22");
  AGENT_OK(&ex, "check 0 22");
  /* The exporter writes a small range; the importer sees just that. */
  AGENT_OK(&ex, "fill 0 33 4096 100");
  AGENT_OK(&im, "check 0 33 4096 100");
  AGENT_OK(&im, "check 0 22 0 4096");
  AGENT_OK(&im, "check 0 22 4196 %zu", n - 4196);

  /* The importer knows the mapping for what it is. */
  uint64_t ex_id, im_id;
  size_t im_size;
  int ex_ipc, im_ipc;
  AGENT_OK(&ex, "query 0");
  reply_query(&ex, NULL, &ex_id, &ex_ipc);
  AGENT_OK(&im, "query 0");
  reply_query(&im, &im_size, &im_id, &im_ipc);
  ASSERT_EQ(ex_ipc, 0);
  ASSERT_EQ(im_ipc, 1);
  ASSERT_UEQ(im_id, ex_id);
  ASSERT_EQ(im_size, n);

  AGENT_OK(&im, "close 0");
  AGENT_ERR(&im, USMIPC_ENOTMAPPED, "close 0");
  agent_stop_ok(&im);
  AGENT_OK(&ex, "free 0");
  agent_stop_ok(&ex);
  return 0;
}

TEST_IMPL(ipc_cross_process_auto) { return cross_process("auto"); }
TEST_IMPL(ipc_cross_process_socket) { return cross_process("socket"); }
TEST_IMPL(ipc_cross_process_pidfd) { return cross_process("pidfd"); }
TEST_IMPL(ipc_cross_process_procfd) { return cross_process("procfd"); }

TEST_IMPL(ipc_parent_exporter_child_importer) {
  usmipc_device_t *dev = test_device();
  const size_t n = 2 * MiB;
  uint8_t *p = NULL;
  ASSERT_OK(usmipc_malloc(dev, USMIPC_MEM_DEVICE, n, (void **)&p));
  dev_fill(p, n, 7, 0);
  uint8_t *data;
  size_t len;
  usmipc_ipc_handle_t *h = export_copy(p, 0, &data, &len);
  static char hex[HEX_MAX];
  hex_encode(data, len, hex);

  agent_t im;
  agent_start(&im, NULL);
  AGENT_OK(&im, "open 0 %s 0", hex);
  AGENT_OK(&im, "check 0 7");
  AGENT_OK(&im, "fill 0 8");
  ASSERT_PATTERN(p, n, 8, 0);
  dev_fill(p + MiB, 12345, 9, MiB);
  AGENT_OK(&im, "check 0 9 %d 12345", MiB);
  AGENT_OK(&im, "check 0 8 0 %d", MiB);
  AGENT_OK(&im, "close 0");
  agent_stop_ok(&im);
  free(data);
  ASSERT_OK(usmipc_ipc_free_handle(h));
  ASSERT_OK(usmipc_free(p));
  return 0;
}

TEST_IMPL(ipc_interior_offset) {
  agent_t ex, im;
  static char h1[HEX_MAX], h2[HEX_MAX];
  const size_t n = 256 * 1024;
  agent_start(&ex, NULL);
  agent_start(&im, NULL);
  AGENT_OK(&ex, "alloc 0 device %zu", n);
  AGENT_OK(&ex, "fill 0 5");
  /* Not page aligned, then page aligned. */
  AGENT_OK(&ex, "export 0 12345 10000");
  snprintf(h1, sizeof(h1), "%s", ex.reply);
  AGENT_OK(&ex, "export 0 65536 4096");
  snprintf(h2, sizeof(h2), "%s", ex.reply);

  AGENT_OK(&im, "open 0 %s 0", h1);
  uint8_t *p1 = agent_reply_ptr(&im);
  ASSERT_EQ(reply_mapped(&im), 10000);
  AGENT_OK(&im, "check 0 5"); /* the agent checks at allocation offset 12345 */
  AGENT_OK(&im, "open 1 %s 0", h2);
  uint8_t *p2 = agent_reply_ptr(&im);
  ASSERT_EQ(reply_mapped(&im), 4096);
  AGENT_OK(&im, "check 1 5");
  /* One mapping per allocation: the two ranges keep their distance. */
  ASSERT_EQ(p2 - p1, 65536 - 12345);

  /* The importer's writes land at the exporter's offset, and only there. */
  AGENT_OK(&im, "fill 0 6");
  AGENT_OK(&ex, "check 0 6 12345 10000");
  AGENT_OK(&ex, "check 0 5 0 12345");
  AGENT_OK(&ex, "check 0 5 22345 %zu", n - 22345);
  AGENT_OK(&im, "close 0");
  AGENT_OK(&im, "close 1");
  AGENT_ERR(&im, USMIPC_ENOTMAPPED, "close 1");
  agent_stop_ok(&im);
  agent_stop_ok(&ex);
  return 0;
}

TEST_IMPL(ipc_rest_of_allocation) {
  /* nbytes == 0 at export means "to the end of the allocation". */
  agent_t ex, im;
  static char hex[HEX_MAX];
  const size_t n = 300000; /* not a page multiple */
  agent_start(&ex, NULL);
  agent_start(&im, NULL);
  AGENT_OK(&ex, "alloc 0 device %zu", n);
  AGENT_OK(&ex, "fill 0 15");
  AGENT_OK(&ex, "export 0 1000 0");
  snprintf(hex, sizeof(hex), "%s", ex.reply);

  uint8_t data[1024];
  size_t len = reply_handle(&ex, data, sizeof(data));
  usmipc_ipc_handle_info_t info;
  ASSERT_OK(usmipc_ipc_handle_inspect(data, len, &info));
  ASSERT_UEQ(info.allocation_size, n);
  ASSERT_UEQ(info.offset, 1000);
  ASSERT_UEQ(info.nbytes, n - 1000);

  AGENT_OK(&im, "open 0 %s 0", hex);
  ASSERT_EQ(reply_mapped(&im), n - 1000);
  AGENT_OK(&im, "check 0 15"); /* every byte up to the allocation's end */
  AGENT_OK(&im, "open 1 %s 10", hex);
  ASSERT_EQ(reply_mapped(&im), 10);
  AGENT_OK(&im, "close 0");
  AGENT_OK(&im, "close 1");
  agent_stop_ok(&im);
  agent_stop_ok(&ex);
  return 0;
}

TEST_IMPL(ipc_open_nbytes_range) {
  agent_t ex, im;
  static char hex[HEX_MAX];
  agent_start(&ex, NULL);
  agent_start(&im, NULL);
  AGENT_OK(&ex, "alloc 0 device %d", MiB);
  AGENT_OK(&ex, "fill 0 16");
  AGENT_OK(&ex, "export 0 4096 8192");
  snprintf(hex, sizeof(hex), "%s", ex.reply);
  AGENT_ERR(&im, USMIPC_ERANGE, "open 0 %s 8193", hex);
  AGENT_ERR(&im, USMIPC_ERANGE, "open 0 %s %d", hex, MiB);
  AGENT_OK(&im, "open 0 %s 8192", hex);
  ASSERT_EQ(reply_mapped(&im), 8192);
  AGENT_OK(&im, "check 0 16");
  AGENT_OK(&im, "open 1 %s 100", hex);
  ASSERT_EQ(reply_mapped(&im), 100);
  AGENT_OK(&im, "check 1 16");
  /* A refused open took no reference: two opens, two closes. */
  AGENT_OK(&im, "close 0");
  AGENT_OK(&im, "close 1");
  AGENT_ERR(&im, USMIPC_ENOTMAPPED, "close 0");
  agent_stop_ok(&im);
  agent_stop_ok(&ex);
  return 0;
}

TEST_IMPL(ipc_importer_refcount) {
  /* The test process imports an agent's allocation several times. */
  agent_t ex;
  agent_start(&ex, NULL);
  const size_t n = 512 * 1024;
  AGENT_OK(&ex, "alloc 0 device %zu", n);
  AGENT_OK(&ex, "fill 0 17");
  AGENT_OK(&ex, "export 0 0 0");
  uint8_t d1[1024], d2[1024];
  size_t l1 = reply_handle(&ex, d1, sizeof(d1));
  AGENT_OK(&ex, "export 0 8192 4096");
  size_t l2 = reply_handle(&ex, d2, sizeof(d2));

  enum { OPENS = 5 };
  void *first = NULL;
  for (int i = 0; i < OPENS; i++) {
    void *p = NULL;
    size_t mapped = 0;
    ASSERT_OK(usmipc_ipc_open(d1, l1, NULL, 0, &p, &mapped));
    ASSERT_EQ(mapped, n);
    if (i == 0)
      first = p;
    ASSERT_PTR_EQ(p, first); /* one shared mapping */
  }
  ASSERT_PATTERN(first, n, 17, 0);
  usmipc_pointer_info_t info;
  ASSERT_OK(usmipc_pointer_query((uint8_t *)first + 100, &info));
  ASSERT_EQ(info.is_ipc_mapping, 1);
  ASSERT_PTR_EQ(info.base, first);
  ASSERT_EQ(info.size, n);

  /* Another handle of the same allocation shares the mapping too. */
  void *q = NULL;
  ASSERT_OK(usmipc_ipc_open(d2, l2, NULL, 0, &q, NULL));
  ASSERT_PTR_EQ(q, (uint8_t *)first + 8192);
  ASSERT_PATTERN(q, 4096, 17, 8192);

  for (int i = 0; i < OPENS; i++)
    ASSERT_OK(usmipc_ipc_close(first));
  ASSERT_OK(usmipc_ipc_close(q));
  ASSERT_ERR(usmipc_ipc_close(first), USMIPC_ENOTMAPPED);
  ASSERT_ERR(usmipc_ipc_close(q), USMIPC_ENOTMAPPED);
  /* A closed mapping (possibly cached idle) is not a live pointer. */
  ASSERT_ERR(usmipc_pointer_query(first, &info), USMIPC_EUNKNOWNPTR);

  /* Opening again works (from the cache or anew), and counts again. */
  void *again = NULL;
  ASSERT_OK(usmipc_ipc_open(d1, l1, NULL, 0, &again, NULL));
  ASSERT_PATTERN(again, n, 17, 0);
  ASSERT_OK(usmipc_ipc_close(again));
  ASSERT_ERR(usmipc_ipc_close(again), USMIPC_ENOTMAPPED);
  /* An IPC mapping is not the importer's to free. */
  ASSERT_OK(usmipc_ipc_open(d1, l1, NULL, 0, &again, NULL));
  ASSERT_ERR2(usmipc_free(again), USMIPC_EINVAL, USMIPC_EUNKNOWNPTR);
  ASSERT_OK(usmipc_ipc_close(again));
  agent_stop_ok(&ex);
  return 0;
}

TEST_IMPL(ipc_stale_cache) {
  /* The exporter frees and reallocates (likely at the same address) and
   * exports again; an importer that cached the first allocation must map
   * the new one, not serve the old pages from its cache. */
  agent_t ex;
  agent_start(&ex, NULL);
  const size_t n = MiB;
  uint8_t d1[1024], d2[1024], d3[1024];
  AGENT_OK(&ex, "alloc 0 device %zu", n);
  void *x1 = agent_reply_ptr(&ex);
  AGENT_OK(&ex, "fill 0 1");
  AGENT_OK(&ex, "export 0 0 0");
  size_t l1 = reply_handle(&ex, d1, sizeof(d1));

  void *m1 = NULL;
  ASSERT_OK(usmipc_ipc_open(d1, l1, NULL, 0, &m1, NULL));
  ASSERT_PATTERN(m1, n, 1, 0);
  ASSERT_OK(usmipc_ipc_close(m1)); /* now idle in the cache */

  AGENT_OK(&ex, "free 0");
  AGENT_OK(&ex, "alloc 0 device %zu", n);
  void *x2 = agent_reply_ptr(&ex);
  AGENT_OK(&ex, "fill 0 2");
  AGENT_OK(&ex, "export 0 0 0");
  size_t l2 = reply_handle(&ex, d2, sizeof(d2));
  printf("exporter address reused: %s\n", x1 == x2 ? "yes" : "no");

  usmipc_ipc_handle_info_t i1, i2;
  ASSERT_OK(usmipc_ipc_handle_inspect(d1, l1, &i1));
  ASSERT_OK(usmipc_ipc_handle_inspect(d2, l2, &i2));
  ASSERT_UNE(i1.buffer_id, i2.buffer_id);

  void *m2 = NULL;
  ASSERT_OK(usmipc_ipc_open(d2, l2, NULL, 0, &m2, NULL));
  ASSERT_PATTERN(m2, n, 2, 0); /* the NEW allocation's bytes */
  /* Writes reach the new allocation in the exporter. */
  dev_fill(m2, n, 3, 0);
  AGENT_OK(&ex, "check 0 3");

  /* Again while the old mapping is still open (not just cached). */
  AGENT_OK(&ex, "free 0");
  AGENT_OK(&ex, "alloc 0 device %zu", n);
  AGENT_OK(&ex, "fill 0 4");
  AGENT_OK(&ex, "export 0 0 0");
  size_t l3 = reply_handle(&ex, d3, sizeof(d3));
  void *m3 = NULL;
  ASSERT_OK(usmipc_ipc_open(d3, l3, NULL, 0, &m3, NULL));
  ASSERT_PTR_NE(m3, m2);
  ASSERT_PATTERN(m3, n, 4, 0);
  ASSERT_PATTERN(m2, n, 3, 0); /* the freed allocation lives on here */
  ASSERT_OK(usmipc_ipc_close(m2));
  ASSERT_OK(usmipc_ipc_close(m3));
  agent_stop_ok(&ex);
  return 0;
}

TEST_IMPL(ipc_survives_exporter_free_and_exit) {
  agent_t ex, im;
  static char hex[HEX_MAX];
  const size_t n = 4 * MiB;
  agent_start(&ex, NULL);
  agent_start(&im, NULL);
  AGENT_OK(&ex, "alloc 0 device %zu", n);
  AGENT_OK(&ex, "fill 0 21");
  AGENT_OK(&ex, "export 0 0 0");
  snprintf(hex, sizeof(hex), "%s", ex.reply);
  AGENT_OK(&im, "open 0 %s 0", hex);
  AGENT_OK(&im, "check 0 21");

  AGENT_OK(&ex, "free 0");
  AGENT_OK(&im, "check 0 21");
  AGENT_OK(&im, "fill 0 22");
  AGENT_OK(&im, "check 0 22");

  agent_stop_ok(&ex);
  AGENT_OK(&im, "check 0 22");
  AGENT_OK(&im, "fill 0 23");
  AGENT_OK(&im, "check 0 23");
  AGENT_OK(&im, "close 0");
  agent_stop_ok(&im);
  return 0;
}

TEST_IMPL(ipc_survives_exporter_sigkill) {
  agent_t ex, im;
  static char hex[HEX_MAX];
  const size_t n = 32 * MiB;
  agent_start(&ex, NULL);
  agent_start(&im, NULL);
  AGENT_OK(&ex, "alloc 0 device %zu", n);
  AGENT_OK(&ex, "fill 0 31");
  AGENT_OK(&ex, "export 0 0 0");
  snprintf(hex, sizeof(hex), "%s", ex.reply);
  AGENT_OK(&im, "open 0 %s 0", hex);
  AGENT_OK(&im, "check 0 31 0 4096");

  agent_kill(&ex);             /* SIGKILL: no atexit, no frees */
  AGENT_OK(&im, "check 0 31"); /* every byte */
  AGENT_OK(&im, "fill 0 32");
  AGENT_OK(&im, "check 0 32");
  AGENT_OK(&im, "close 0");
  agent_stop_ok(&im);
  return 0;
}

/* Handles whose exporter is dead, and that this importer never opened. */
static int exporter_gone(const char *transport) {
  if (skip_without_pidfd(transport))
    RETURN_SKIP("%s cannot move this device's descriptors here", transport);
  agent_t ex1, ex2, im;
  static char h1[HEX_MAX], h2[HEX_MAX], h3[HEX_MAX];
  agent_start(&ex1, transport);
  agent_start(&ex2, transport);
  agent_start(&im, transport);
  AGENT_OK(&ex1, "alloc 0 device %d", MiB);
  AGENT_OK(&ex1, "alloc 1 device 65536");
  AGENT_OK(&ex1, "export 0 0 0");
  snprintf(h1, sizeof(h1), "%s", ex1.reply);
  AGENT_OK(&ex1, "export 1 4096 0");
  snprintf(h2, sizeof(h2), "%s", ex1.reply);
  AGENT_OK(&ex2, "alloc 0 device %d", MiB);
  AGENT_OK(&ex2, "export 0 0 0");
  snprintf(h3, sizeof(h3), "%s", ex2.reply);

  agent_kill(&ex1);    /* killed */
  agent_stop_ok(&ex2); /* exited normally */
  AGENT_ERR(&im, USMIPC_EEXPORTERGONE, "open 0 %s 0", h1);
  AGENT_ERR(&im, USMIPC_EEXPORTERGONE, "open 1 %s 0", h2);
  AGENT_ERR(&im, USMIPC_EEXPORTERGONE, "open 2 %s 0", h3);
  agent_stop_ok(&im);
  return 0;
}

TEST_IMPL(ipc_exporter_gone_auto) { return exporter_gone("auto"); }
TEST_IMPL(ipc_exporter_gone_socket) { return exporter_gone("socket"); }
TEST_IMPL(ipc_exporter_gone_pidfd) { return exporter_gone("pidfd"); }
TEST_IMPL(ipc_exporter_gone_procfd) { return exporter_gone("procfd"); }

TEST_IMPL(ipc_revoke) {
  /* usmipc_ipc_revoke: every handle issued so far is refused, by every
   * transport, on a cache hit (the mapping idle in the importer's cache)
   * and in the exporter itself; a new export gives a handle that works;
   * mappings already open keep working. */
  static const char *const transports[] = {"auto", "socket", "pidfd", "procfd"};
  for (size_t t = 0; t < sizeof(transports) / sizeof(transports[0]); t++) {
    if (skip_without_pidfd(transports[t]))
      continue;
    agent_t ex, im;
    static char h0[HEX_MAX], h1[HEX_MAX];
    agent_start(&ex, NULL);
    agent_start(&im, transports[t]);
    AGENT_OK(&ex, "alloc 0 device %d", MiB);
    AGENT_OK(&ex, "fill 0 51");
    AGENT_OK(&ex, "export 0 0 0");
    snprintf(h0, sizeof(h0), "%s", ex.reply);
    AGENT_OK(&im, "open 0 %s 0", h0); /* stays open */
    AGENT_OK(&im, "open 1 %s 0", h0);
    AGENT_OK(&im, "close 1"); /* idle in the cache, still mapped */
    AGENT_OK(&ex, "revoke 0");
    AGENT_ERR(&im, USMIPC_EEXPORTERGONE, "open 1 %s 0", h0);
    AGENT_ERR(&ex, USMIPC_EEXPORTERGONE, "open 5 %s 0", h0);
    AGENT_OK(&im, "check 0 51"); /* the open mapping still works */
    AGENT_OK(&ex, "export 0 0 0");
    snprintf(h1, sizeof(h1), "%s", ex.reply);
    ASSERT(strcmp(h0, h1) != 0);
    AGENT_OK(&im, "open 2 %s 0", h1);
    AGENT_OK(&im, "check 2 51");
    AGENT_OK(&im, "close 2");
    AGENT_ERR(&im, USMIPC_EEXPORTERGONE, "open 1 %s 0", h0);
    AGENT_OK(&im, "close 0");
    agent_stop_ok(&im);
    agent_stop_ok(&ex);
  }
  /* Nothing exported there. */
  void *p;
  ASSERT_OK(usmipc_malloc(host_device(), USMIPC_MEM_DEVICE, 4096, &p));
  ASSERT_ERR(usmipc_ipc_revoke(p), USMIPC_EUNKNOWNPTR);
  ASSERT_OK(usmipc_free(p));
  return 0;
}

TEST_IMPL(ipc_allocation_freed_before_open) {
  /* The exporter lives but freed the allocation: no transport may hand out
   * its memory, even when the descriptor number it used is taken by the
   * next allocation (pidfd_getfd would copy that one). */
  static const char *const transports[] = {"auto", "socket", "pidfd", "procfd"};
  agent_t ex;
  static char h0[HEX_MAX], h1[HEX_MAX];
  agent_start(&ex, NULL);
  AGENT_OK(&ex, "alloc 0 device %d", MiB);
  AGENT_OK(&ex, "fill 0 41");
  AGENT_OK(&ex, "export 0 0 0");
  snprintf(h0, sizeof(h0), "%s", ex.reply);
  AGENT_OK(&ex, "free 0");
  AGENT_OK(&ex, "alloc 1 device %d", MiB);
  AGENT_OK(&ex, "fill 1 42");
  AGENT_OK(&ex, "export 1 0 0");
  snprintf(h1, sizeof(h1), "%s", ex.reply);

  uint8_t b0[1024], b1[1024];
  usmipc_ipc_handle_info_t i0, i1;
  size_t l0 = (size_t)hex_decode(h0, b0, sizeof(b0));
  size_t l1 = (size_t)hex_decode(h1, b1, sizeof(b1));
  ASSERT_OK(usmipc_ipc_handle_inspect(b0, l0, &i0));
  ASSERT_OK(usmipc_ipc_handle_inspect(b1, l1, &i1));

  for (size_t t = 0; t < sizeof(transports) / sizeof(transports[0]); t++) {
    if (skip_without_pidfd(transports[t]))
      continue;
    agent_t im;
    agent_start(&im, transports[t]);
    AGENT_ERR(&im, USMIPC_EEXPORTERGONE, "open 0 %s 0", h0);
    AGENT_OK(&im, "open 1 %s 0", h1);
    AGENT_OK(&im, "check 1 42");
    AGENT_OK(&im, "close 1");
    agent_stop_ok(&im);
  }
  agent_stop_ok(&ex);
  return 0;
}

TEST_IMPL(ipc_other_uid_refused) {
  if (!running_as_root())
    RETURN_SKIP("needs root to run an importer as another user");
  agent_t ex, ok_im;
  static char hex[HEX_MAX];
  agent_start(&ex, NULL);
  AGENT_OK(&ex, "alloc 0 device %d", MiB);
  AGENT_OK(&ex, "fill 0 51");
  AGENT_OK(&ex, "export 0 0 0");
  snprintf(hex, sizeof(hex), "%s", ex.reply);

  /* Control: the same handle opens for the same user over the socket. */
  agent_start(&ok_im, "socket");
  AGENT_OK(&ok_im, "open 0 %s 0", hex);
  AGENT_OK(&ok_im, "check 0 51");
  agent_stop_ok(&ok_im);

  /* uid/gid 65534 (nobody), even with the right token. */
  agent_t im;
  agent_start(&im, "socket");
  AGENT_OK(&im, "setuid 65534");
  AGENT_ERR(&im, USMIPC_EACCES, "open 0 %s 0", hex);
  agent_stop_ok(&im);

  agent_start(&im, "auto"); /* pidfd refused (no ptrace), then the broker */
  AGENT_OK(&im, "setuid 65534");
  AGENT_ERR(&im, USMIPC_EACCES, "open 0 %s 0", hex);
  agent_stop_ok(&im);

  if (pidfd_supported()) {
    agent_start(&im, "pidfd");
    AGENT_OK(&im, "setuid 65534");
    AGENT_ERR2(&im, USMIPC_EACCES, USMIPC_ETRANSPORT, "open 0 %s 0", hex);
    agent_stop_ok(&im);
  }

  agent_start(&im, "procfd"); /* /proc/<pid>/fd needs the same user too */
  AGENT_OK(&im, "setuid 65534");
  AGENT_ERR2(&im, USMIPC_EACCES, USMIPC_ETRANSPORT, "open 0 %s 0", hex);
  agent_stop_ok(&im);
  agent_stop_ok(&ex);
  return 0;
}

TEST_IMPL(ipc_fork_child_exports) {
  /* A process that exported (its broker runs) forks; the child exports a
   * new allocation of its own, and an unrelated third process opens both
   * the child's and the parent's handles. Host memory only: a fork child
   * of a process that uses a GPU driver cannot use the driver (CUDA's state
   * does not survive fork; the child must exec), and this child allocates,
   * exports and touches memory directly. */
  if (!test_device_is_host())
    RETURN_SKIP("a fork child cannot use the %s driver of its parent, and "
                "this test's child allocates, exports and touches device "
                "memory",
                usmipc_backend_name(usmipc_device_backend(test_device())));
  usmipc_device_t *dev = test_device();
  const size_t n = MiB;
  uint8_t *p = NULL;
  ASSERT_OK(usmipc_malloc(dev, USMIPC_MEM_DEVICE, n, (void **)&p));
  dev_fill(p, n, 61, 0);
  uint8_t *pd;
  size_t pl;
  usmipc_ipc_handle_t *ph = export_copy(p, 0, &pd, &pl);
  static char parent_hex[HEX_MAX], child_hex[HEX_MAX];
  hex_encode(pd, pl, parent_hex);

  int to_parent[2], to_child[2];
  ASSERT_EQ(pipe(to_parent), 0);
  ASSERT_EQ(pipe(to_child), 0);
  fflush(stdout);
  fflush(stderr);
  pid_t child = fork();
  ASSERT(child >= 0);
  if (child == 0) {
    close(to_parent[0]);
    close(to_child[1]);
    uint8_t *q = NULL;
    if (usmipc_malloc(dev, USMIPC_MEM_DEVICE, n, (void **)&q) != 0)
      _exit(10);
    pattern_fill(q, n, 62, 0);
    usmipc_ipc_handle_t *h = NULL;
    const void *d;
    size_t l;
    if (usmipc_ipc_get_handle(q, 0, &h) != 0 ||
        usmipc_ipc_handle_data(h, &d, &l) != 0) {
      fprintf(stderr, "child export failed: %s\n", usmipc_last_error());
      _exit(11);
    }
    static char out[HEX_MAX];
    hex_encode(d, l, out);
    strcat(out, "\n");
    if (write(to_parent[1], out, strlen(out)) < 0)
      _exit(12);
    char c;
    while (read(to_child[0], &c, 1) > 0) { /* until the parent is done */
    }
    /* The importer wrote seed 63 into the child's memory. */
    if (pattern_check(q, n, 63, 0) != SIZE_MAX)
      _exit(13);
    _exit(0);
  }
  close(to_parent[1]);
  close(to_child[0]);
  FILE *f = fdopen(to_parent[0], "r");
  ASSERT_NOT_NULL(f);
  ASSERT_NOT_NULL(fgets(child_hex, sizeof(child_hex), f));
  child_hex[strcspn(child_hex, "\n")] = '\0';

  uint8_t cd[1024];
  size_t cl = (size_t)hex_decode(child_hex, cd, sizeof(cd));
  usmipc_ipc_handle_info_t ci;
  ASSERT_OK(usmipc_ipc_handle_inspect(cd, cl, &ci));
  ASSERT_EQ(ci.exporter_pid, child);

  agent_t im;
  agent_start(&im, "socket"); /* the broker path: the child must run its own */
  AGENT_OK(&im, "open 0 %s 0", child_hex);
  AGENT_OK(&im, "check 0 62");
  AGENT_OK(&im, "fill 0 63");
  AGENT_OK(&im, "open 1 %s 0", parent_hex);
  AGENT_OK(&im, "check 1 61");
  AGENT_OK(&im, "close 0");
  AGENT_OK(&im, "close 1");
  agent_stop_ok(&im);

  agent_start(&im, "auto");
  AGENT_OK(&im, "open 0 %s 0", child_hex);
  AGENT_OK(&im, "check 0 63");
  AGENT_OK(&im, "close 0");
  agent_stop_ok(&im);

  close(to_child[1]);
  int status = wait_pid_timeout(child, 10);
  ASSERT_MSG(exit_code_of(status) == 0, "fork child exited with %d",
             exit_code_of(status));
  fclose(f);
  free(pd);
  ASSERT_OK(usmipc_ipc_free_handle(ph));
  ASSERT_OK(usmipc_free(p));
  return 0;
}
