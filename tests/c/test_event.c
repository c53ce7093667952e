/* Events: local use, sharing across unrelated processes (agents), ordered
 * memory handoffs, and every way an event handle can be wrong. On the host
 * backend a record is complete when made, so what these tests prove there
 * is the protocol (identity, slots, points, errors); the Level Zero test
 * driver (tests/level_zero) and the GPU suite (tests/gpu) prove waits. */
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <sys/wait.h>
#include <unistd.h>

#include "objects.h" /* usmipc__wire_t, the record layouts, crc32c */
#include "task.h"

static size_t hex_to_bytes(const char *hex, uint8_t *out, size_t cap) {
  ssize_t n = hex_decode(hex, out, cap);
  ASSERT_MSG(n > 0, "bad hex: %s", hex);
  return (size_t)n;
}

static void reseal(uint8_t *b, size_t len) {
  usmipc__put32le(b + len - 4, usmipc__crc32c(0, b, len - 4));
}

/* Edited bytes b with their checksum recomputed, as hex into out. */
static void reseal_hex(uint8_t *b, size_t len, char *out) {
  reseal(b, len);
  hex_encode(b, len, out);
}

/* The body of record type in encoded handle bytes b, or NULL. */
static uint8_t *record_of(uint8_t *b, size_t len, uint16_t type) {
  uint16_t plen = usmipc__get16le(b + 208), elen = usmipc__get16le(b + 210);
  ASSERT_EQ(212 + plen + elen + 4, len);
  uint16_t rlen;
  const uint8_t *r = usmipc__ext_find(b + 212 + plen, elen, type, &rlen);
  return (uint8_t *)r;
}

/* Until a backend has events, its devices refuse them (ENOTSUP). */
#define SKIP_WITHOUT_EVENTS()                                                  \
  do {                                                                         \
    usmipc_event_t *probe_;                                                    \
    int probe_rc_ = usmipc_event_create(test_device(), 0, &probe_);            \
    if (probe_rc_ == USMIPC_ENOTSUP)                                           \
      RETURN_SKIP("%s", usmipc_last_error());                                  \
    ASSERT_OK(probe_rc_);                                                      \
    usmipc_event_destroy(probe_);                                              \
  } while (0)

static usmipc_ipc_handle_t *event_handle(usmipc_event_t *ev, uint8_t *out,
                                         size_t *len) {
  usmipc_ipc_handle_t *h = NULL;
  const void *data;
  ASSERT_OK(usmipc_ipc_get_event_handle(ev, &h));
  ASSERT_OK(usmipc_ipc_handle_data(h, &data, len));
  memcpy(out, data, *len);
  return h;
}

TEST_IMPL(event_local) {
  SKIP_WITHOUT_EVENTS();
  usmipc_device_t *dev = test_device();
  usmipc_queue_t *q;
  usmipc_event_t *ev;
  ASSERT_OK(usmipc_queue_create(dev, &q));
  ASSERT_ERR(usmipc_event_create(NULL, 0, &ev), USMIPC_EINVAL);
  ASSERT_ERR(usmipc_event_create(dev, 0x80, &ev), USMIPC_EINVAL);
  ASSERT_OK(usmipc_event_create(dev, 0, &ev));
  ASSERT_PTR_EQ(usmipc_event_device(ev), dev);
  /* Never recorded: complete. */
  ASSERT_OK(usmipc_event_query(ev));
  ASSERT_OK(usmipc_event_synchronize(ev));
  for (int i = 0; i < 5; i++) {
    ASSERT_OK(usmipc_event_record(ev, q));
    ASSERT_OK(usmipc_event_wait(ev, q));
    ASSERT_OK(usmipc_event_synchronize(ev));
    ASSERT_OK(usmipc_event_query(ev));
  }
  ASSERT_ERR(usmipc_event_record(ev, NULL), USMIPC_EINVAL);
  ASSERT_ERR(usmipc_event_wait(ev, NULL), USMIPC_EINVAL);
  ASSERT_ERR(usmipc_event_synchronize(NULL), USMIPC_EINVAL);
  ASSERT_OK(usmipc_event_destroy(ev));
  ASSERT_OK(usmipc_event_destroy(NULL));
  ASSERT_OK(usmipc_queue_destroy(q));
  return 0;
}

/* A foreign queue is wrapped, not owned: destroying the wrapper leaves it. */
TEST_IMPL(event_queue_from_native) {
  SKIP_WITHOUT_EVENTS();
  usmipc_device_t *dev = test_device();
  usmipc_queue_t *own, *wrapped;
  ASSERT_OK(usmipc_queue_create(dev, &own));
  ASSERT_OK(usmipc_queue_from_native(dev, usmipc_queue_native(own), &wrapped));
  ASSERT_PTR_EQ(usmipc_queue_native(wrapped), usmipc_queue_native(own));
  usmipc_event_t *ev;
  ASSERT_OK(usmipc_event_create(dev, 0, &ev));
  ASSERT_OK(usmipc_event_record(ev, wrapped));
  ASSERT_OK(usmipc_event_wait(ev, wrapped));
  ASSERT_OK(usmipc_queue_destroy(wrapped));
  /* The native queue still works. */
  ASSERT_OK(usmipc_event_record(ev, own));
  ASSERT_OK(usmipc_queue_synchronize(own));
  ASSERT_OK(usmipc_event_destroy(ev));
  ASSERT_OK(usmipc_queue_destroy(own));
  ASSERT_ERR(usmipc_queue_from_native(NULL, NULL, &wrapped), USMIPC_EINVAL);
  if (test_device_is_host())
    ASSERT_ERR(usmipc_queue_from_native(dev, (void *)16, &wrapped),
               USMIPC_EINVAL);
  return 0;
}

/* Opening in the exporting process gives a view of the event itself; a
 * view outliving its event says so. */
TEST_IMPL(event_same_process) {
  SKIP_WITHOUT_EVENTS();
  usmipc_device_t *dev = test_device();
  usmipc_queue_t *q;
  usmipc_event_t *ev, *view, *view2;
  uint8_t b[1024];
  size_t len;
  ASSERT_OK(usmipc_queue_create(dev, &q));
  ASSERT_OK(usmipc_event_create(dev, 0, &ev));
  ASSERT_OK(usmipc_event_record(ev, q));
  usmipc_ipc_handle_t *h = event_handle(ev, b, &len);
  usmipc_ipc_handle_info_t info;
  ASSERT_OK(usmipc_ipc_handle_inspect(b, len, &info));
  ASSERT_EQ(info.is_event, 1);
  ASSERT_EQ(info.is_ordered, 0);
  ASSERT_UEQ(info.event_point, 1);
  ASSERT_OK(usmipc_ipc_open_event(b, len, NULL, &view));
  ASSERT_OK(usmipc_ipc_open_event(b, len, dev, &view2));
  ASSERT_OK(usmipc_event_synchronize(view));
  ASSERT_OK(usmipc_event_wait(view2, q));
  ASSERT_OK(usmipc_event_query(view));
  /* Views cannot be recorded or re-exported. */
  ASSERT_ERR(usmipc_event_record(view, q), USMIPC_EINVAL);
  usmipc_ipc_handle_t *h2;
  ASSERT_ERR(usmipc_ipc_get_event_handle(view, &h2), USMIPC_EINVAL);
  /* Memory and event handles are not interchangeable. */
  void *p;
  ASSERT_ERR(usmipc_ipc_open(b, len, NULL, 0, &p, NULL), USMIPC_EINVAL);
  ASSERT_OK(usmipc_event_destroy(ev));
  ASSERT_ERR(usmipc_event_synchronize(view), USMIPC_EEXPORTERGONE);
  usmipc_event_t *none;
  ASSERT_ERR(usmipc_ipc_open_event(b, len, NULL, &none), USMIPC_EEXPORTERGONE);
  ASSERT_PTR_EQ(none, NULL);
  ASSERT_OK(usmipc_event_destroy(view));
  ASSERT_OK(usmipc_event_destroy(view2));
  ASSERT_OK(usmipc_ipc_free_handle(h));
  ASSERT_OK(usmipc_queue_destroy(q));
  return 0;
}

/* Shared between two unrelated processes: open, wait on the host and on a
 * queue, re-open (a lookup: no descriptor more), re-record, destroy. */
TEST_IMPL(event_cross_process) {
  SKIP_WITHOUT_EVENTS();
  agent_t ex, im;
  static char hex[HEX_MAX], hex2[HEX_MAX];
  agent_start(&ex, NULL);
  agent_start(&im, NULL);
  AGENT_OK(&ex, "evcreate 0");
  AGENT_OK(&ex, "evrecord 0");
  AGENT_OK(&ex, "evhandle 0");
  snprintf(hex, sizeof(hex), "%s", ex.reply);
  AGENT_OK(&im, "evopen 0 %s", hex);
  AGENT_OK(&im, "evsync 0");
  AGENT_OK(&im, "evquery 0");
  AGENT_OK(&im, "evwait 0");
  AGENT_OK(&im, "evopen 1 %s", hex);
  AGENT_OK(&im, "evsync 1");
  /* Recorded again: a new handle names the new record; the old one still
   * waits (for the newer record, or nothing on a ring). */
  AGENT_OK(&ex, "evrecord 0");
  AGENT_OK(&ex, "evhandle 0");
  snprintf(hex2, sizeof(hex2), "%s", ex.reply);
  ASSERT_MSG(strcmp(hex, hex2) != 0, "a new record gives the same handle");
  AGENT_OK(&im, "evopen 2 %s", hex2);
  AGENT_OK(&im, "evsync 2");
  AGENT_OK(&im, "evsync 0");
  /* The importer cannot record the exporter's event. */
  AGENT_ERR(&im, USMIPC_EINVAL, "evrecord 0");
  /* Destroyed by the exporter: views and new opens are refused. */
  AGENT_OK(&ex, "evdestroy 0");
  AGENT_ERR(&im, USMIPC_EEXPORTERGONE, "evsync 0");
  AGENT_ERR(&im, USMIPC_EEXPORTERGONE, "evopen 3 %s", hex);
  AGENT_OK(&im, "evdestroy 0");
  AGENT_OK(&im, "evdestroy 1");
  AGENT_OK(&im, "evdestroy 2");
  agent_stop_ok(&im);
  agent_stop_ok(&ex);
  return 0;
}

/* A dead exporter: its event handles cannot be opened any more (nobody
 * proves the identity); an event opened before the death waits by the
 * documented rule: a host record is complete when made, a device record
 * whose completion nobody saw is refused. */
TEST_IMPL(event_exporter_gone) {
  SKIP_WITHOUT_EVENTS();
  agent_t ex, im;
  static char hex[HEX_MAX];
  agent_start(&ex, NULL);
  agent_start(&im, NULL);
  AGENT_OK(&ex, "evcreate 0");
  AGENT_OK(&ex, "evrecord 0");
  AGENT_OK(&ex, "evhandle 0");
  snprintf(hex, sizeof(hex), "%s", ex.reply);
  AGENT_OK(&im, "evopen 0 %s", hex);
  agent_kill(&ex);
  if (test_device_is_host())
    AGENT_OK(&im, "evsync 0");
  else
    AGENT_ERR(&im, USMIPC_EEXPORTERGONE, "evsync 0");
  AGENT_ERR(&im, USMIPC_EEXPORTERGONE, "evopen 1 %s", hex);
  AGENT_OK(&im, "evdestroy 0");
  agent_stop_ok(&im);
  return 0;
}

/* An ordered handoff between unrelated processes, both ways, many times:
 * each handle names a record of the ring (a completed one, reused, where
 * the exporter's queue is idle at the handoff). */
TEST_IMPL(event_ordered_handoff) {
  SKIP_WITHOUT_EVENTS();
  agent_t ex, im;
  static char hex[HEX_MAX], first[HEX_MAX];
  const size_t n = 64 * 1024;
  agent_start(&ex, NULL);
  agent_start(&im, NULL);
  AGENT_OK(&ex, "alloc 0 device %zu", n);
  for (int i = 0; i < 40; i++) {
    AGENT_OK(&ex, "fill 0 %d", 100 + i);
    AGENT_OK(&ex, "exportord 0");
    snprintf(hex, sizeof(hex), "%s", ex.reply);
    if (i == 0)
      snprintf(first, sizeof(first), "%s", hex);
    uint8_t b[4096];
    size_t len = hex_to_bytes(hex, b, sizeof(b));
    usmipc_ipc_handle_info_t info;
    ASSERT_OK(usmipc_ipc_handle_inspect(b, len, &info));
    ASSERT_EQ(info.is_ordered, 1);
    ASSERT_EQ(info.is_event, 0);
    AGENT_OK(&im, "openord 1 %s", hex);
    AGENT_OK(&im, "check 1 %d", 100 + i);
    AGENT_OK(&im, "fill 1 %d", 200 + i);
    AGENT_OK(&ex, "check 0 %d", 200 + i);
    AGENT_OK(&im, "close 1");
  }
  /* The first handle still opens: its record was overtaken. */
  AGENT_OK(&im, "openord 1 %s", first);
  AGENT_OK(&im, "close 1");
  /* Opened as plain memory by a C caller that skips ordering. */
  AGENT_OK(&im, "open 1 %s 0", hex);
  AGENT_OK(&im, "close 1");
  agent_stop_ok(&im);
  AGENT_OK(&ex, "free 0");
  agent_stop_ok(&ex);
  return 0;
}

/* Handoffs from a queue with nothing pending reuse one completed record
 * instead of recording an event each (the cost ordering added to a fresh
 * export): 100 orders of one handle and one of each of 20 fresh exports
 * make at most one record, and every handle still opens ordered, here and
 * in another process, with the data the exporter wrote. On the host and
 * usmipc's own Level Zero lists (synchronous) the queue is always idle,
 * on CUDA once synchronized; tests/gpu/test_gpu_events.py covers a busy
 * CUDA stream. */
TEST_IMPL(event_order_reuses_completed_record) {
  SKIP_WITHOUT_EVENTS();
  usmipc_device_t *dev = test_device();
  usmipc_queue_t *q;
  ASSERT_OK(usmipc_queue_create(dev, &q));
  usmipc_stats_t a, b;
  ASSERT_OK(usmipc_get_stats(&a, sizeof(a)));
  void *p[21];
  usmipc_ipc_handle_t *h[21];
  const void *data;
  size_t len;
  for (int i = 0; i < 21; i++) {
    ASSERT_OK(usmipc_malloc(dev, USMIPC_MEM_DEVICE, 4096, &p[i]));
    static uint8_t pat[4096];
    pattern_fill(pat, sizeof(pat), (uint64_t)i + 1, 0);
    ASSERT_OK(usmipc_memcpy(q, p[i], pat, sizeof(pat)));
    /* A CUDA stream is busy until the copy lands (a first copy from
     * pageable memory took hundreds of microseconds on an H100): a handoff
     * then records, as it must. */
    ASSERT_OK(usmipc_queue_synchronize(q));
    ASSERT_OK(usmipc_ipc_get_handle(p[i], 0, &h[i]));
    for (int k = 0; k < (i == 0 ? 100 : 1); k++) {
      ASSERT_OK(usmipc_ipc_handle_order(h[i], q));
      /* The first record is itself work on the queue: handoffs that
       * follow it within microseconds find the queue busy and record too
       * (100 records on an H200 without this). */
      if (i == 0 && k == 0)
        ASSERT_OK(usmipc_queue_synchronize(q));
    }
  }
  ASSERT_OK(usmipc_get_stats(&b, sizeof(b)));
  ASSERT_MSG(b.event_records - a.event_records <= 1, "%llu records",
             b.event_records - a.event_records);
  agent_t im;
  static char hex[HEX_MAX];
  agent_start(&im, NULL);
  for (int i = 0; i < 21; i++) {
    ASSERT_OK(usmipc_ipc_handle_data(h[i], &data, &len));
    usmipc_ipc_handle_info_t info;
    ASSERT_OK(usmipc_ipc_handle_inspect(data, len, &info));
    ASSERT_EQ(info.is_ordered, 1);
    void *m;
    ASSERT_OK(usmipc_ipc_open_ex(data, len, NULL, 0, q, 0, &m, NULL));
    ASSERT_OK(usmipc_ipc_close(m));
    hex_encode(data, len, hex);
    AGENT_OK(&im, "openord 1 %s", hex);
    AGENT_OK(&im, "check 1 %d", i + 1);
    AGENT_OK(&im, "close 1");
  }
  agent_stop_ok(&im);
  for (int i = 0; i < 21; i++) {
    ASSERT_OK(usmipc_ipc_free_handle(h[i]));
    ASSERT_OK(usmipc_free(p[i]));
  }
  ASSERT_OK(usmipc_queue_destroy(q));
  return 0;
}

/* A wait for a record that has completed puts nothing on the queue: a
 * device wait is work on the GPU, and work of several processes makes it
 * switch between their contexts. On Level Zero (usmipc's lists are
 * synchronous, so every record is complete) no wait is made (10 without
 * the check); on the host events have no device part at all; on CUDA
 * tests/gpu/test_gpu_events.py covers a busy producer. */
TEST_IMPL(event_complete_record_not_waited) {
  SKIP_WITHOUT_EVENTS();
  usmipc_device_t *dev = test_device();
  usmipc_queue_t *q;
  usmipc_event_t *ev;
  ASSERT_OK(usmipc_queue_create(dev, &q));
  ASSERT_OK(usmipc_event_create(dev, 0, &ev));
  ASSERT_OK(usmipc_event_record(ev, q));
  ASSERT_OK(usmipc_queue_synchronize(q));
  usmipc_stats_t a, b;
  ASSERT_OK(usmipc_get_stats(&a, sizeof(a)));
  for (int i = 0; i < 10; i++)
    ASSERT_OK(usmipc_event_wait(ev, q));
  ASSERT_OK(usmipc_get_stats(&b, sizeof(b)));
  ASSERT_UEQ(b.event_waits - a.event_waits, 0);
  ASSERT_OK(usmipc_event_destroy(ev));
  ASSERT_OK(usmipc_queue_destroy(q));
  return 0;
}

/* The same process orders and opens: its own ring event, no import. */
TEST_IMPL(event_ordered_same_process) {
  SKIP_WITHOUT_EVENTS();
  usmipc_device_t *dev = test_device();
  usmipc_queue_t *q;
  void *p, *m;
  ASSERT_OK(usmipc_queue_create(dev, &q));
  ASSERT_OK(usmipc_malloc(dev, USMIPC_MEM_DEVICE, 8192, &p));
  usmipc_ipc_handle_t *h;
  const void *data;
  size_t len, base_len;
  ASSERT_OK(usmipc_ipc_get_handle(p, 0, &h));
  ASSERT_OK(usmipc_ipc_handle_data(h, &data, &base_len));
  ASSERT_OK(usmipc_ipc_handle_order(h, q));
  ASSERT_OK(usmipc_ipc_handle_data(h, &data, &len));
  ASSERT_GT(len, base_len);
  usmipc_event_t *carried;
  ASSERT_OK(usmipc_ipc_open_handle_event(data, len, NULL, &carried));
  ASSERT_NOT_NULL(carried);
  ASSERT_OK(usmipc_event_wait(carried, q));
  ASSERT_OK(usmipc_event_synchronize(carried));
  ASSERT_OK(usmipc_event_destroy(carried));
  for (int i = 0; i < 3; i++) {
    ASSERT_OK(usmipc_ipc_open_ex(data, len, NULL, 0, q, 0, &m, NULL));
    ASSERT_PTR_EQ(m, p);
    ASSERT_OK(usmipc_ipc_close(m));
    ASSERT_OK(usmipc_ipc_open_ex(data, len, NULL, 0, NULL, 0, &m, NULL));
    ASSERT_OK(usmipc_ipc_close(m));
  }
  ASSERT_ERR(usmipc_ipc_open_ex(data, len, NULL, 0, NULL, 0x10, &m, NULL),
             USMIPC_EINVAL);
  /* Unordering restores the base bytes. */
  ASSERT_OK(usmipc_ipc_handle_order(h, NULL));
  ASSERT_OK(usmipc_ipc_handle_data(h, &data, &len));
  ASSERT_EQ(len, base_len);
  ASSERT_OK(usmipc_ipc_open_handle_event(data, len, NULL, &carried));
  ASSERT_PTR_EQ(carried, NULL);
  ASSERT_OK(usmipc_ipc_free_handle(h));
  ASSERT_OK(usmipc_free(p));
  ASSERT_OK(usmipc_queue_destroy(q));
  return 0;
}

/* Every prefix, every single bit flip, and forged fields of an event
 * handle give a clear error; a memory handle's ordering record likewise. */
TEST_IMPL(event_bad_handles) {
  SKIP_WITHOUT_EVENTS();
  usmipc_device_t *dev = test_device();
  usmipc_queue_t *q;
  usmipc_event_t *ev, *view;
  uint8_t b[1024], c[1024];
  size_t len;
  ASSERT_OK(usmipc_queue_create(dev, &q));
  ASSERT_OK(usmipc_event_create(dev, 0, &ev));
  ASSERT_OK(usmipc_event_record(ev, q));
  usmipc_ipc_handle_t *h = event_handle(ev, b, &len);
  for (size_t k = 0; k < len; k++) {
    uint8_t *copy = malloc(k ? k : 1);
    memcpy(copy, b, k);
    ASSERT_ERR(usmipc_ipc_open_event(copy, k, NULL, &view), USMIPC_EBADHANDLE);
    free(copy);
  }
  for (size_t bit = 0; bit < len * 8; bit++) {
    memcpy(c, b, len);
    c[bit / 8] ^= (uint8_t)(1u << (bit % 8));
    test_error_sentinel();
    int r = usmipc_ipc_open_event(c, len, NULL, &view);
    PROBE_ERR("usmipc_ipc_open_event(c, len, NULL, &view) (a bit flipped)", r);
    ASSERT_MSG(r != 0, "bit %zu flipped still opens", bit);
  }
  uint8_t *rec = record_of(b, len, USMIPC__EXT_EVENT);
  ASSERT_NOT_NULL(rec);
  /* A point never recorded: forged. */
  memcpy(c, b, len);
  usmipc__put64le(record_of(c, len, USMIPC__EXT_EVENT), 9);
  reseal(c, len);
  ASSERT_ERR(usmipc_ipc_open_event(c, len, NULL, &view), USMIPC_EBADHANDLE);
  /* Unknown event flags. */
  memcpy(c, b, len);
  usmipc__put32le(record_of(c, len, USMIPC__EXT_EVENT) + 8, 0x100);
  reseal(c, len);
  ASSERT_ERR(usmipc_ipc_open_event(c, len, NULL, &view), USMIPC_EBADHANDLE);
  /* The host flag on a device event, or not on a host event. */
  memcpy(c, b, len);
  uint8_t *crec = record_of(c, len, USMIPC__EXT_EVENT);
  usmipc__put32le(crec + 8,
                  usmipc__get32le(crec + 8) ^ USMIPC__EVENT_FLAG_HOST);
  reseal(c, len);
  ASSERT_ERR(usmipc_ipc_open_event(c, len, NULL, &view), USMIPC_EBADHANDLE);
  /* An event handle that names memory. */
  memcpy(c, b, len);
  usmipc__put64le(c + 144, 4096);
  usmipc__put64le(c + 128, 4096);
  reseal(c, len);
  ASSERT_ERR(usmipc_ipc_open_event(c, len, NULL, &view), USMIPC_EBADHANDLE);
  /* An event handle without its record (kind 128, no 0x8001). */
  memcpy(c, b, len);
  usmipc__put16le(record_of(c, len, USMIPC__EXT_EVENT) - 4, 0x0042);
  reseal(c, len);
  ASSERT_ERR(usmipc_ipc_open_event(c, len, NULL, &view), USMIPC_EBADHANDLE);
  /* Another process's forged event: wrong token. */
  memcpy(c, b, len);
  c[184] ^= 1;
  reseal(c, len);
  ASSERT_ERR(usmipc_ipc_open_event(c, len, NULL, &view), USMIPC_EEXPORTERGONE);
  /* NULLs. */
  ASSERT_ERR(usmipc_ipc_open_event(b, len, NULL, NULL), USMIPC_EINVAL);
  ASSERT_ERR(usmipc_ipc_open_event(NULL, 10, NULL, &view), USMIPC_EINVAL);
  ASSERT_ERR(usmipc_ipc_get_event_handle(NULL, &h), USMIPC_EINVAL);

  /* A memory handle's ordering record: every bit flip refused. */
  void *p, *m;
  ASSERT_OK(usmipc_malloc(dev, USMIPC_MEM_DEVICE, 4096, &p));
  usmipc_ipc_handle_t *mh;
  const void *data;
  size_t mlen;
  ASSERT_OK(usmipc_ipc_get_handle(p, 0, &mh));
  ASSERT_OK(usmipc_ipc_handle_order(mh, q));
  ASSERT_OK(usmipc_ipc_handle_data(mh, &data, &mlen));
  uint8_t mb[1024];
  memcpy(mb, data, mlen);
  uint8_t *orec = record_of(mb, mlen, USMIPC__EXT_ORDER);
  ASSERT_NOT_NULL(orec);
  size_t at = (size_t)(orec - mb);
  for (size_t bit = at * 8; bit < (mlen - 4) * 8; bit++) {
    memcpy(c, mb, mlen);
    c[bit / 8] ^= (uint8_t)(1u << (bit % 8));
    reseal(c, mlen);
    test_error_sentinel();
    int r = usmipc_ipc_open(c, mlen, NULL, 0, &m, NULL);
    size_t field = bit / 8 - at;
    uint64_t point = usmipc__get64le(orec + 8);
    uint64_t flipped = usmipc__get64le(c + at + 8);
    /* What a same-process open does not read (it finds its own event by
     * id, slot and token): a lower point (already complete), the ring
     * flag (its own event knows), the descriptor fields, the event kind
     * and the driver payload. */
    bool may_open = (field >= 8 && field < 16 && flipped < point) ||
                    (field == 20 && bit % 8 == 0) ||
                    (field >= 40 && field < 47) ||
                    (field >= 48 && field < 64) || field >= 68;
    if (r == 0) {
      ASSERT_MSG(may_open,
                 "flipping bit %zu of the ordering record (byte %zu) still "
                 "opens",
                 bit % 8, field);
      ASSERT_OK(usmipc_ipc_close(m));
    }
  }
  /* An event handle is not a memory handle, and vice versa. */
  ASSERT_ERR(usmipc_ipc_open_event(mb, mlen, NULL, &view), USMIPC_EINVAL);
  ASSERT_ERR(usmipc_ipc_handle_order(h, q), USMIPC_EINVAL);
  ASSERT_OK(usmipc_ipc_free_handle(mh));
  ASSERT_OK(usmipc_free(p));
  ASSERT_OK(usmipc_ipc_free_handle(h));
  ASSERT_OK(usmipc_event_destroy(ev));
  ASSERT_OK(usmipc_queue_destroy(q));
  return 0;
}

/* Forged points and the wrong device, seen from another process. */
TEST_IMPL(event_forged_cross_process) {
  SKIP_WITHOUT_EVENTS();
  agent_t ex, im;
  static char hex[HEX_MAX];
  agent_start(&ex, NULL);
  agent_start(&im, NULL);
  AGENT_OK(&ex, "evcreate 0");
  AGENT_OK(&ex, "evrecord 0");
  AGENT_OK(&ex, "evhandle 0");
  uint8_t b[4096];
  size_t len = hex_to_bytes(ex.reply, b, sizeof(b));
  usmipc__put64le(record_of(b, len, USMIPC__EXT_EVENT), 2);
  reseal(b, len);
  hex_encode(b, len, hex);
  /* The open proves the exporter; the forged point fails at the wait. */
  int r = agent_call(&im, "evopen 0 %s", hex);
  if (r == 0)
    AGENT_ERR(&im, USMIPC_EBADHANDLE, "evsync 0");
  else
    agent_check_error(__FILE__, __LINE__, &im, "\"evopen 0 %s\", hex", r,
                      USMIPC_EBADHANDLE, USMIPC_EBADHANDLE, USMIPC_EBADHANDLE);
  /* Recorded once more, the point exists. */
  AGENT_OK(&ex, "evrecord 0");
  AGENT_OK(&im, "evopen 1 %s", hex);
  AGENT_OK(&im, "evsync 1");
  agent_stop_ok(&im);
  agent_stop_ok(&ex);
  return 0;
}

/* A fork child cannot use its parent's events (their slots and device
 * events are the parent's). */
TEST_IMPL(event_fork_child) {
  SKIP_WITHOUT_EVENTS();
  usmipc_device_t *dev = test_device();
  if (!test_device_is_host())
    RETURN_SKIP("device contexts do not survive fork");
  usmipc_queue_t *q;
  usmipc_event_t *ev;
  ASSERT_OK(usmipc_queue_create(dev, &q));
  ASSERT_OK(usmipc_event_create(dev, 0, &ev));
  ASSERT_OK(usmipc_event_record(ev, q));
  pid_t pid = fork();
  if (pid == 0) {
    int r = usmipc_event_record(ev, q);
    PROBE_ERR("usmipc_event_record(ev, q) in a fork child", r);
    usmipc_ipc_handle_t *h;
    int r2 = usmipc_ipc_get_event_handle(ev, &h);
    PROBE_ERR("usmipc_ipc_get_event_handle(ev, &h) in a fork child", r2);
    /* The child's own events work. */
    usmipc_event_t *mine;
    int r3 = usmipc_event_create(dev, 0, &mine);
    if (r3 == 0)
      r3 = usmipc_event_record(mine, q);
    if (r3 == 0)
      r3 = usmipc_ipc_get_event_handle(mine, &h);
    _exit(r == USMIPC_EINVAL && r2 == USMIPC_EINVAL && r3 == 0 ? 0 : 1);
  }
  int status = wait_pid_timeout(pid, 10);
  ASSERT_EQ(exit_code_of(status), 0);
  ASSERT_OK(usmipc_event_record(ev, q));
  ASSERT_OK(usmipc_event_destroy(ev));
  ASSERT_OK(usmipc_queue_destroy(q));
  return 0;
}

/* Threads ordering handles, recording, opening and waiting at once (for
 * ThreadSanitizer): each thread its own queue, events and handles of one
 * shared allocation. */
static void *event_thread(void *arg) {
  void *p = arg;
  usmipc_device_t *dev = test_device();
  usmipc_queue_t *q;
  ASSERT_OK(usmipc_queue_create(dev, &q));
  usmipc_ipc_handle_t *h;
  ASSERT_OK(usmipc_ipc_get_handle(p, 0, &h));
  for (int i = 0; i < 200; i++) {
    usmipc_event_t *ev, *view;
    uint8_t b[1024];
    size_t len;
    const void *data;
    size_t dlen;
    void *m;
    ASSERT_OK(usmipc_event_create(dev, 0, &ev));
    ASSERT_OK(usmipc_event_record(ev, q));
    usmipc_ipc_handle_t *eh = event_handle(ev, b, &len);
    ASSERT_OK(usmipc_ipc_open_event(b, len, NULL, &view));
    ASSERT_OK(usmipc_event_wait(view, q));
    ASSERT_OK(usmipc_event_destroy(ev));
    ASSERT_OK(usmipc_event_destroy(view));
    ASSERT_OK(usmipc_ipc_free_handle(eh));
    ASSERT_OK(usmipc_ipc_handle_order(h, q));
    ASSERT_OK(usmipc_ipc_handle_data(h, &data, &dlen));
    ASSERT_OK(usmipc_ipc_open_ex(data, dlen, NULL, 0, q, 0, &m, NULL));
    ASSERT_OK(usmipc_ipc_close(m));
  }
  ASSERT_OK(usmipc_ipc_free_handle(h));
  ASSERT_OK(usmipc_queue_synchronize(q));
  ASSERT_OK(usmipc_queue_destroy(q));
  return NULL;
}

TEST_IMPL(event_threads) {
  SKIP_WITHOUT_EVENTS();
  void *p;
  ASSERT_OK(usmipc_malloc(test_device(), USMIPC_MEM_DEVICE, 4096, &p));
  pthread_t t[4];
  for (int i = 0; i < 4; i++)
    ASSERT_EQ(pthread_create(&t[i], NULL, event_thread, p), 0);
  for (int i = 0; i < 4; i++)
    pthread_join(t[i], NULL);
  ASSERT_OK(usmipc_free(p));
  return 0;
}

/* Release signals between unrelated processes: tickets come back once
 * each, the producer's wait ends only when all did, a forged or stale
 * ticket is refused. */
TEST_IMPL(event_release_cross_process) {
  SKIP_WITHOUT_EVENTS();
  agent_t ex, im;
  static char hex[3][HEX_MAX];
  agent_start(&ex, NULL);
  agent_start(&im, NULL);
  AGENT_OK(&ex, "alloc 0 device 8192");
  AGENT_OK(&ex, "evtimeout 300");
  for (int i = 0; i < 3; i++) {
    AGENT_OK(&ex, "fill 0 %d", 10 + i);
    AGENT_OK(&ex, "exportrel 0");
    snprintf(hex[i], sizeof(hex[i]), "%s", ex.reply);
    AGENT_OK(&im, "openord 1 %s", hex[i]);
    AGENT_OK(&im, "check 1 %d", 10 + i);
    AGENT_OK(&im, "close 1");
  }
  AGENT_OK(&ex, "relcount 0");
  ASSERT_STR_EQ(ex.reply, "3 0");
  AGENT_OK(&im, "release 0 %s", hex[0]);
  AGENT_OK(&im, "release 0 %s", hex[2]);
  AGENT_OK(&im, "release 0 %s", hex[2]); /* counts once */
  AGENT_OK(&ex, "relcount 0");
  ASSERT_STR_EQ(ex.reply, "3 2");
  /* One ticket is still out: the producer's wait times out, saying so. */
  AGENT_ERR(&ex, USMIPC_ETIMEDOUT, "relwait 0");
  ASSERT_MSG(strstr(ex.reply, "2 of 3") != NULL, "%s", ex.reply);
  AGENT_OK(&im, "release 0 %s", hex[1]);
  AGENT_OK(&ex, "relwait 0");
  AGENT_OK(&ex, "relcount 0");
  ASSERT_STR_EQ(ex.reply, "3 3");

  /* Forged: a ticket never handed out, a wrong token. */
  uint8_t b[4096];
  size_t len = hex_to_bytes(hex[0], b, sizeof(b));
  uint8_t *rel = record_of(b, len, USMIPC__EXT_RELEASE);
  ASSERT_NOT_NULL(rel);
  usmipc__put64le(rel + 8, 99);
  reseal(b, len);
  static char forged[HEX_MAX];
  hex_encode(b, len, forged);
  AGENT_ERR(&im, USMIPC_EBADHANDLE, "release 0 %s", forged);
  usmipc__put64le(rel + 8, 1);
  rel[16] ^= 1;
  reseal(b, len);
  hex_encode(b, len, forged);
  AGENT_ERR(&im, USMIPC_EACCES, "release 0 %s", forged);
  /* A handle that asks for no release. */
  AGENT_OK(&ex, "exportord 0");
  AGENT_ERR(&im, USMIPC_EINVAL, "release 0 %s", ex.reply);
  /* The producer freed its handle: nobody waits any more. */
  AGENT_OK(&ex, "free 0");
  AGENT_ERR(&im, USMIPC_EEXPORTERGONE, "release 0 %s", hex[1]);
  agent_stop_ok(&ex);
  AGENT_ERR2(&im, USMIPC_EEXPORTERGONE, USMIPC_ETRANSPORT, "release 0 %s",
             hex[1]);
  agent_stop_ok(&im);
  return 0;
}

/* Each ticket is its own capability: a holder of one handoff's bytes that
 * edits the ticket number (and the checksum) cannot return another
 * consumer's ticket. Before, every ticket of a handle carried the same
 * token, so the edited ticket was accepted and the producer's wait counted
 * a consumer that still used the memory. */
TEST_IMPL(event_release_ticket_own_capability) {
  agent_t ex, im;
  static char hex[2][HEX_MAX], forged[HEX_MAX];
  agent_start(&ex, NULL);
  agent_start(&im, NULL);
  AGENT_OK(&ex, "alloc 0 device 8192");
  for (int i = 0; i < 2; i++) {
    AGENT_OK(&ex, "exportrel 0");
    snprintf(hex[i], sizeof(hex[i]), "%s", ex.reply);
  }
  /* The holder of ticket 1 returns "ticket 2" with ticket 1's token. */
  uint8_t b[4096];
  size_t len = hex_to_bytes(hex[0], b, sizeof(b));
  uint8_t *rel = record_of(b, len, USMIPC__EXT_RELEASE);
  ASSERT_NOT_NULL(rel);
  ASSERT_UEQ(usmipc__get64le(rel + 8), 1);
  usmipc__put64le(rel + 8, 2);
  reseal(b, len);
  hex_encode(b, len, forged);
  AGENT_ERR(&im, USMIPC_EACCES, "release 0 %s", forged);
  ASSERT_MSG(strstr(im.reply, "ticket") != NULL, "%s", im.reply);
  AGENT_OK(&ex, "relcount 0");
  ASSERT_STR_EQ(ex.reply, "2 0");
  /* Ticket 2 is still out: its real holder returns it, then ticket 1's. */
  AGENT_OK(&im, "release 0 %s", hex[1]);
  AGENT_OK(&ex, "relcount 0");
  ASSERT_STR_EQ(ex.reply, "2 1");
  AGENT_OK(&im, "release 0 %s", hex[0]);
  AGENT_OK(&ex, "relcount 0");
  ASSERT_STR_EQ(ex.reply, "2 2");
  agent_stop_ok(&ex);
  agent_stop_ok(&im);
  return 0;
}

/* Forwarding (usmipc_ipc_forward): a consumer hands what it holds on to a
 * third process, which gets a ticket of its own from the producer; the
 * producer's wait then waits for it too. Refused once the forwarder's
 * ticket came back (the memory may be reused), for edited bytes, and when
 * the producer freed the handle. A forwarded ticket is forwardable in
 * turn, and returning it twice counts once. */
TEST_IMPL(event_release_forward) {
  agent_t ex, im, im2;
  static char hex[HEX_MAX], fwd[HEX_MAX], fwd2[HEX_MAX], forged[HEX_MAX];
  agent_start(&ex, NULL);
  agent_start(&im, NULL);
  agent_start(&im2, NULL);
  AGENT_OK(&ex, "alloc 0 device 8192");
  AGENT_OK(&ex, "evtimeout 300");
  AGENT_OK(&ex, "fill 0 33");
  AGENT_OK(&ex, "exportrel 0");
  snprintf(hex, sizeof(hex), "%s", ex.reply);
  AGENT_OK(&im, "openord 1 %s", hex);
  AGENT_OK(&im, "relforward 0 %s", hex);
  snprintf(fwd, sizeof(fwd), "%s", im.reply);
  ASSERT_EQ(strlen(fwd), strlen(hex));
  ASSERT_MSG(strcmp(fwd, hex) != 0, "the forwarded bytes are the same");
  AGENT_OK(&ex, "relcount 0");
  ASSERT_STR_EQ(ex.reply, "2 0");
  /* Whoever else holds the first bytes (a fan-out's sibling) knows the
   * held ticket's token, but not the forwarder's nonce: it cannot make
   * the forwarded ticket's token and return that ticket early. */
  {
    uint8_t p[4096], f[4096];
    size_t plen = hex_to_bytes(hex, p, sizeof(p));
    size_t flen = hex_to_bytes(fwd, f, sizeof(f));
    const uint8_t *held = record_of(p, plen, USMIPC__EXT_RELEASE);
    uint8_t *minted = record_of(f, flen, USMIPC__EXT_RELEASE);
    ASSERT_NOT_NULL(held);
    ASSERT_NOT_NULL(minted);
    static const uint8_t zero[16];
    usmipc__forward_token(held + 16, usmipc__get64le(held),
                          usmipc__get64le(minted + 8), zero, minted + 16);
    reseal_hex(f, flen, forged);
    AGENT_ERR(&im2, USMIPC_EACCES, "release 0 %s", forged);
    AGENT_OK(&ex, "relcount 0");
    ASSERT_STR_EQ(ex.reply, "2 0");
  }
  /* The third process reads the producer's memory through them. */
  AGENT_OK(&im2, "openord 1 %s", fwd);
  AGENT_OK(&im2, "check 1 33");
  /* The forwarder is done: the producer still waits for the third. */
  AGENT_OK(&im, "close 1");
  AGENT_OK(&im, "release 0 %s", hex);
  AGENT_OK(&ex, "relcount 0");
  ASSERT_STR_EQ(ex.reply, "2 1");
  AGENT_ERR(&ex, USMIPC_ETIMEDOUT, "relwait 0");
  ASSERT_MSG(strstr(ex.reply, "1 of 2") != NULL, "%s", ex.reply);
  /* Too late for the first ticket: it came back. */
  AGENT_ERR(&im, USMIPC_EINVAL, "relforward 0 %s", hex);
  ASSERT_MSG(strstr(im.reply, "before releasing") != NULL, "%s", im.reply);
  /* The third forwards in turn, then returns its own ticket. */
  AGENT_OK(&im2, "relforward 0 %s", fwd);
  snprintf(fwd2, sizeof(fwd2), "%s", im2.reply);
  AGENT_OK(&im2, "close 1");
  AGENT_OK(&im2, "release 0 %s", fwd);
  AGENT_OK(&im2, "release 0 %s", fwd); /* counts once */
  AGENT_OK(&ex, "relcount 0");
  ASSERT_STR_EQ(ex.reply, "3 2");

  /* Edited bytes (checksum recomputed): the forwarded ticket's number
   * changed to one that came back (refused as released: nothing to
   * gain), a token flipped, a ticket never handed out. */
  uint8_t b[4096];
  size_t len = hex_to_bytes(fwd2, b, sizeof(b));
  uint8_t *rel = record_of(b, len, USMIPC__EXT_RELEASE);
  ASSERT_NOT_NULL(rel);
  ASSERT_UEQ(usmipc__get64le(rel + 8), 3);
  usmipc__put64le(rel + 8, 2);
  reseal_hex(b, len, forged);
  AGENT_ERR(&im, USMIPC_EINVAL, "relforward 0 %s", forged);
  usmipc__put64le(rel + 8, 3);
  rel[20] ^= 1;
  reseal_hex(b, len, forged);
  AGENT_ERR(&im, USMIPC_EACCES, "relforward 0 %s", forged);
  AGENT_ERR(&im, USMIPC_EACCES, "release 0 %s", forged);
  rel[20] ^= 1;
  usmipc__put64le(rel + 8, 99);
  reseal_hex(b, len, forged);
  AGENT_ERR(&im, USMIPC_EBADHANDLE, "relforward 0 %s", forged);
  AGENT_OK(&ex, "relcount 0");
  ASSERT_STR_EQ(ex.reply, "3 2");
  /* The producer hands its own handoff on (same process), then every
   * ticket comes back and the wait ends. */
  AGENT_OK(&ex, "relforward 0 %s", fwd2);
  snprintf(fwd, sizeof(fwd), "%s", ex.reply);
  AGENT_OK(&ex, "relcount 0");
  ASSERT_STR_EQ(ex.reply, "4 2");
  AGENT_OK(&im, "release 0 %s", fwd2);
  AGENT_OK(&ex, "release 0 %s", fwd);
  AGENT_OK(&ex, "relwait 0");
  AGENT_OK(&ex, "relcount 0");
  ASSERT_STR_EQ(ex.reply, "4 4");
  /* The producer freed its handle: nothing left to hand on. */
  AGENT_OK(&ex, "exportrel 0");
  snprintf(hex, sizeof(hex), "%s", ex.reply);
  AGENT_OK(&ex, "free 0");
  AGENT_ERR(&im, USMIPC_EEXPORTERGONE, "relforward 0 %s", hex);
  agent_stop_ok(&ex);
  agent_stop_ok(&im);
  agent_stop_ok(&im2);
  return 0;
}

typedef struct handle_waiter {
  usmipc_ipc_handle_t *h;
  int rc;
  int done; /* atomic */
} handle_waiter_t;

static void *handle_wait_thread(void *arg) {
  handle_waiter_t *w = arg;
  w->rc = usmipc_ipc_handle_wait_released(w->h, NULL);
  __atomic_store_n(&w->done, 1, __ATOMIC_RELEASE);
  return NULL;
}

/* Event timeouts of any size: milliseconds times 10^6 overflowed 64 bits
 * above 2^64 / 10^6 ms, so usmipc_event_set_timeout(18446744073709552)
 * timed out after 50 ms "after 18446744073709552 ms". A wait under such a
 * limit (the largest, ULLONG_MAX, too) goes on until its ticket comes
 * back. */
TEST_IMPL(event_timeout_no_wrap) {
  usmipc_device_t *dev = test_device();
  static const unsigned long long limits[] = {18446744073709552ull,
                                              18446744073709551615ull};
  void *p;
  ASSERT_OK(usmipc_malloc(dev, USMIPC_MEM_DEVICE, 4096, &p));
  for (size_t i = 0; i < 2; i++) {
    usmipc_ipc_handle_t *h;
    ASSERT_OK(usmipc_ipc_get_handle(p, 0, &h));
    ASSERT_OK(usmipc_ipc_handle_order_ex(h, NULL, USMIPC_ORDER_RELEASE));
    const void *data;
    size_t len;
    uint8_t b[1024];
    ASSERT_OK(usmipc_ipc_handle_data(h, &data, &len));
    memcpy(b, data, len);
    ASSERT_OK(usmipc_event_set_timeout(limits[i]));
    handle_waiter_t w = {.h = h};
    pthread_t t;
    ASSERT_EQ(pthread_create(&t, NULL, handle_wait_thread, &w), 0);
    sleep_ms(300);
    ASSERT_MSG(__atomic_load_n(&w.done, __ATOMIC_ACQUIRE) == 0,
               "the wait under a limit of %llu ms ended after 300 ms: %s",
               limits[i], usmipc_err_name(w.rc));
    ASSERT_OK(usmipc_ipc_release(b, len, NULL));
    pthread_join(t, NULL);
    ASSERT_OK(w.rc);
    ASSERT_OK(usmipc_ipc_free_handle(h));
  }
  ASSERT_OK(usmipc_event_set_timeout(0));
  ASSERT_OK(usmipc_free(p));
  return 0;
}

/* A ticket of h as hex (no ordering event) into out. */
static void ticket_hex(usmipc_ipc_handle_t *h, char *out) {
  const void *data;
  size_t len;
  ASSERT_OK(usmipc_ipc_handle_order_ex(h, NULL, USMIPC_ORDER_RELEASE));
  ASSERT_OK(usmipc_ipc_handle_data(h, &data, &len));
  hex_encode(data, len, out);
}

/* Consumers that exit after returning their tickets: A exits normally, B
 * has not returned its ticket yet; then B returns it and is killed. Every
 * call of the producer's wait gives the same answer: it waits for B while B
 * holds its ticket, and an exited consumer's returned ticket leaves nothing
 * to wait for. Before, on a device with events (level_zero.c.*), the wait
 * failed with EEXPORTERGONE opening the exited consumer's event and forgot
 * the other events, so a second call returned 0 at once (the Level Zero
 * suite's release_consumer_* tests show it with work still queued). */
TEST_IMPL(event_release_consumer_exits) {
  usmipc_device_t *dev = test_device();
  void *p;
  usmipc_ipc_handle_t *h;
  static char ta[HEX_MAX], tb[HEX_MAX], tc[HEX_MAX];
  ASSERT_OK(usmipc_malloc(dev, USMIPC_MEM_DEVICE, 4096, &p));
  ASSERT_OK(usmipc_ipc_get_handle(p, 0, &h));
  ticket_hex(h, ta);
  ticket_hex(h, tb);
  agent_t a, b;
  agent_start(&a, NULL);
  agent_start(&b, NULL);
  AGENT_OK(&a, "release 0 %s", ta);
  agent_stop_ok(&a);
  ASSERT_OK(usmipc_event_set_timeout(200));
  for (int call = 0; call < 3; call++) {
    ASSERT_ERR(usmipc_ipc_handle_wait_released(h, NULL), USMIPC_ETIMEDOUT);
    ASSERT_MSG(strstr(usmipc_last_error(), "1 of 2") != NULL, "%s",
               usmipc_last_error());
  }
  AGENT_OK(&b, "release 0 %s", tb);
  for (int call = 0; call < 3; call++)
    ASSERT_OK(usmipc_ipc_handle_wait_released(h, NULL));
  /* B returns another ticket and is killed: nothing left to wait for. */
  ticket_hex(h, tc);
  AGENT_OK(&b, "release 0 %s", tc);
  agent_kill(&b);
  usmipc_queue_t *q;
  ASSERT_OK(usmipc_queue_create(dev, &q));
  for (int call = 0; call < 3; call++)
    ASSERT_OK(usmipc_ipc_handle_wait_released(h, call == 1 ? q : NULL));
  ASSERT_OK(usmipc_queue_synchronize(q));
  ASSERT_OK(usmipc_queue_destroy(q));
  ASSERT_OK(usmipc_event_set_timeout(0));
  ASSERT_OK(usmipc_ipc_free_handle(h));
  ASSERT_OK(usmipc_free(p));
  return 0;
}

/* In one process: the ticket is filed without the broker. */
TEST_IMPL(event_release_same_process) {
  SKIP_WITHOUT_EVENTS();
  usmipc_device_t *dev = test_device();
  usmipc_queue_t *q;
  void *p, *m;
  ASSERT_OK(usmipc_queue_create(dev, &q));
  ASSERT_OK(usmipc_malloc(dev, USMIPC_MEM_DEVICE, 4096, &p));
  usmipc_ipc_handle_t *h;
  const void *data;
  size_t len;
  uint64_t sent, back;
  ASSERT_OK(usmipc_ipc_get_handle(p, 0, &h));
  ASSERT_OK(usmipc_ipc_handle_releases(h, &sent, &back));
  ASSERT_UEQ(sent, 0);
  ASSERT_OK(usmipc_ipc_handle_wait_released(h, q)); /* nothing handed out */
  ASSERT_ERR(usmipc_ipc_handle_order_ex(h, q, 0x40), USMIPC_EINVAL);
  ASSERT_OK(usmipc_ipc_handle_order_ex(h, q, USMIPC_ORDER_RELEASE));
  ASSERT_OK(usmipc_ipc_handle_data(h, &data, &len));
  uint8_t b[1024];
  memcpy(b, data, len);
  ASSERT_OK(usmipc_ipc_open_ex(b, len, NULL, 0, q, 0, &m, NULL));
  ASSERT_OK(usmipc_ipc_release(b, len, q));
  ASSERT_OK(usmipc_ipc_close(m));
  ASSERT_OK(usmipc_ipc_handle_releases(h, &sent, &back));
  ASSERT_UEQ(sent, 1);
  ASSERT_UEQ(back, 1);
  ASSERT_OK(usmipc_ipc_handle_wait_released(h, q));
  ASSERT_OK(usmipc_ipc_handle_wait_released(h, NULL));
  /* Host-only producer: a ticket without an ordering event. */
  ASSERT_OK(usmipc_ipc_handle_order_ex(h, NULL, USMIPC_ORDER_RELEASE));
  ASSERT_OK(usmipc_ipc_handle_data(h, &data, &len));
  usmipc_ipc_handle_info_t info;
  ASSERT_OK(usmipc_ipc_handle_inspect(data, len, &info));
  ASSERT_EQ(info.is_ordered, 0);
  memcpy(b, data, len);
  ASSERT_OK(usmipc_ipc_release(b, len, NULL));
  ASSERT_OK(usmipc_ipc_handle_wait_released(h, NULL));
  ASSERT_OK(usmipc_ipc_free_handle(h));
  ASSERT_ERR(usmipc_ipc_release(b, len, NULL), USMIPC_EEXPORTERGONE);
  ASSERT_OK(usmipc_free(p));
  ASSERT_OK(usmipc_queue_destroy(q));
  return 0;
}

/* The log of handoffs whose tickets are all back (usmipc_releases_wait):
 * a handle is logged once its last outstanding ticket returns, not before;
 * a wait with nothing logged times out empty; a reader that fell more than
 * the log's 4096 behind, or a fork child holding its parent's seq, is told
 * it missed some; bad arguments are refused. */
static void release_one(usmipc_ipc_handle_t *h, usmipc_queue_t *q,
                        uint8_t *b, size_t *len) {
  const void *data;
  ASSERT_OK(usmipc_ipc_handle_order_ex(h, q, USMIPC_ORDER_RELEASE));
  ASSERT_OK(usmipc_ipc_handle_data(h, &data, len));
  memcpy(b, data, *len);
}

/* What both usmipc_releases_wait tests start from: a queue, one device
 * allocation and its handle. */
struct release_fixture {
  usmipc_queue_t *q;
  void *p;
  usmipc_ipc_handle_t *h;
};

static void release_fixture_open(struct release_fixture *f) {
  ASSERT_OK(usmipc_queue_create(test_device(), &f->q));
  ASSERT_OK(usmipc_malloc(test_device(), USMIPC_MEM_DEVICE, 4096, &f->p));
  ASSERT_OK(usmipc_ipc_get_handle(f->p, 0, &f->h));
}

static void release_fixture_close(struct release_fixture *f) {
  ASSERT_OK(usmipc_ipc_free_handle(f->h));
  ASSERT_OK(usmipc_free(f->p));
  ASSERT_OK(usmipc_queue_destroy(f->q));
}

TEST_IMPL(event_releases_wait_log) {
  SKIP_WITHOUT_EVENTS();
  struct release_fixture f;
  release_fixture_open(&f);
  usmipc_queue_t *q = f.q;
  usmipc_ipc_handle_t *h = f.h;
  ASSERT_UEQ(usmipc_ipc_handle_release_key(h), 0);
  ASSERT_UEQ(usmipc_ipc_handle_release_key(NULL), 0);
  uint64_t seq = 0, keys[8];
  size_t n = 99;
  int missed = 7;
  ASSERT_ERR(usmipc_releases_wait(NULL, keys, 8, &n, &missed, 0),
             USMIPC_EINVAL);
  ASSERT_ERR(usmipc_releases_wait(&seq, NULL, 8, &n, &missed, 0),
             USMIPC_EINVAL);
  /* Nothing back yet in this process: a wait of 60 ms comes back empty. */
  uint64_t t0 = usmipc__now_ns();
  ASSERT_OK(usmipc_releases_wait(&seq, keys, 8, &n, &missed, 60));
  ASSERT_MSG(usmipc__now_ns() - t0 >= 50000000u, "returned after %llu ns",
             (unsigned long long)(usmipc__now_ns() - t0));
  ASSERT_UEQ(n, 0);
  ASSERT_EQ(missed, 0);
  /* Two tickets out: the first back logs nothing, the second the key. */
  uint8_t b1[1024], b2[1024];
  size_t l1, l2;
  release_one(h, q, b1, &l1);
  release_one(h, q, b2, &l2);
  uint64_t key = usmipc_ipc_handle_release_key(h);
  ASSERT_MSG(key != 0, "no key after a ticket");
  ASSERT_OK(usmipc_ipc_release(b1, l1, q));
  ASSERT_OK(usmipc_releases_wait(&seq, keys, 8, &n, &missed, 0));
  ASSERT_UEQ(n, 0);
  ASSERT_OK(usmipc_ipc_release(b2, l2, q));
  ASSERT_OK(usmipc_releases_wait(&seq, keys, 8, &n, &missed, 1000));
  ASSERT_UEQ(n, 1);
  ASSERT_UEQ(keys[0], key);
  ASSERT_UEQ(seq, 1);
  /* The same ticket again counts for nothing and logs nothing. */
  ASSERT_OK(usmipc_ipc_release(b2, l2, q));
  ASSERT_OK(usmipc_releases_wait(&seq, keys, 8, &n, &missed, 0));
  ASSERT_UEQ(n, 0);
  /* A reader left 4097 completions behind missed some. */
  for (int i = 0; i < 4097; i++) {
    release_one(h, q, b1, &l1);
    ASSERT_OK(usmipc_ipc_release(b1, l1, q));
  }
  uint64_t behind = 1;
  ASSERT_OK(usmipc_releases_wait(&behind, keys, 8, &n, &missed, 0));
  ASSERT_EQ(missed, 1);
  ASSERT_UEQ(n, 0);
  ASSERT_UEQ(behind, 4098);
  /* cap 0 reads nothing and moves nothing. */
  uint64_t near = 4095;
  ASSERT_OK(usmipc_releases_wait(&near, NULL, 0, &n, &missed, 0));
  ASSERT_UEQ(n, 0);
  ASSERT_UEQ(near, 4095);
  ASSERT_EQ(missed, 0);
  /* Paging: 3 at a time from seq 4090 to the end. */
  uint64_t page = 4090;
  ASSERT_OK(usmipc_releases_wait(&page, keys, 3, &n, &missed, 0));
  ASSERT_UEQ(n, 3);
  ASSERT_UEQ(page, 4093);
  ASSERT_UEQ(keys[2], key);
  ASSERT_OK(usmipc_releases_wait(&page, keys, 8, &n, &missed, 0));
  ASSERT_UEQ(n, 5);
  ASSERT_UEQ(page, 4098);
  if (test_device_is_host()) {
    /* A fork child's log starts empty: the parent's seq is ahead of it. */
    pid_t pid = fork();
    if (pid == 0) {
      uint64_t s = page, k[2];
      size_t cn = 9;
      int cm = 0;
      int r = usmipc_releases_wait(&s, k, 2, &cn, &cm, 0);
      _exit(r == 0 && cm == 1 && cn == 0 && s == 0 ? 0 : 1);
    }
    ASSERT_EQ(exit_code_of(wait_pid_timeout(pid, 10)), 0);
  }
  release_fixture_close(&f);
  return 0;
}

/* A thread blocked in usmipc_releases_wait wakes at a return, well before
 * its limit. */
struct releases_waiter {
  uint64_t seq;
  size_t n;
  uint64_t key;
  uint64_t waited_ns;
};

static void *releases_waiter_main(void *arg) {
  struct releases_waiter *w = arg;
  int missed;
  uint64_t t0 = usmipc__now_ns();
  ASSERT_OK(usmipc_releases_wait(&w->seq, &w->key, 1, &w->n, &missed, 10000));
  w->waited_ns = usmipc__now_ns() - t0;
  return NULL;
}

TEST_IMPL(event_releases_wait_wakes) {
  SKIP_WITHOUT_EVENTS();
  struct release_fixture f;
  release_fixture_open(&f);
  uint8_t b[1024];
  size_t len;
  release_one(f.h, f.q, b, &len);
  struct releases_waiter w = {0};
  pthread_t t;
  ASSERT_EQ(pthread_create(&t, NULL, releases_waiter_main, &w), 0);
  usleep(100000);
  ASSERT_OK(usmipc_ipc_release(b, len, f.q));
  ASSERT_EQ(pthread_join(t, NULL), 0);
  ASSERT_UEQ(w.n, 1);
  ASSERT_UEQ(w.key, usmipc_ipc_handle_release_key(f.h));
  ASSERT_MSG(w.waited_ns < 5000000000u, "woke after %llu ns",
             (unsigned long long)w.waited_ns);
  release_fixture_close(&f);
  return 0;
}

/* Events imported from exporters that exited do not stay pinned: the
 * import cache drops such entries (at a miss, once it has doubled since its
 * last sweep), so an importer that
 * takes events from many short-lived processes keeps no more descriptors
 * than the registry's idle peers (64), as memory imports do. Before, each
 * exporter ever imported from kept its pidfd, its export table mapped and
 * (on a device) its opened event. */
TEST_IMPL(event_import_sweep) {
#if defined(__SANITIZE_THREAD__)
  /* Each agent takes about a second to start and stop under TSan. */
  RETURN_SKIP("150 exporter processes take minutes under ThreadSanitizer; "
              "the plain and ASan builds run this test");
#endif
  SKIP_WITHOUT_EVENTS();
  if (!test_device_is_host())
    RETURN_SKIP("the sweep is the core's, the same on every backend; on a "
                "GPU each of the 150 agents takes a second to start");
  usmipc_device_t *dev = test_device();
  static char hex[HEX_MAX];
  const int exporters = 150;
  size_t fds0 = 0;
  for (int i = 0; i < exporters; i++) {
    agent_t ex;
    agent_start(&ex, NULL);
    AGENT_OK(&ex, "evcreate 0");
    AGENT_OK(&ex, "evrecord 0");
    AGENT_OK(&ex, "evhandle 0");
    snprintf(hex, sizeof(hex), "%s", ex.reply);
    uint8_t b[4096];
    size_t len = hex_to_bytes(hex, b, sizeof(b));
    usmipc_event_t *view;
    ASSERT_OK(usmipc_ipc_open_event(b, len, dev, &view));
    ASSERT_OK(usmipc_event_synchronize(view));
    ASSERT_OK(usmipc_event_destroy(view));
    agent_stop_ok(&ex);
    if (i == 0)
      fds0 = count_fds();
  }
  /* Bounded, whatever the number of exporters: the registry's idle peers
   * (64), the imports not swept yet (fewer than the sweep threshold, 32)
   * and the kept broker connections (16). Without the sweep: one per
   * exporter, 150. */
  size_t fds = count_fds();
  ASSERT_MSG(fds < fds0 + 64 + 32 + 16,
             "%zu descriptors after importing from %d exporters that exited "
             "(%zu after the first): imports pin dead exporters",
             fds, exporters, fds0);
  return 0;
}

/* The first ticket creates the handle's ticket registry while another
 * thread asks for the counts (a producer's background wait, Python's
 * releases): the registry is published whole (ThreadSanitizer saw the
 * plain pointer race). */
static atomic_int release_watch_stop;
static void *release_watcher(void *arg) {
  usmipc_ipc_handle_t *h = arg;
  while (!atomic_load(&release_watch_stop)) {
    uint64_t sent = 0, back = 0;
    if (usmipc_ipc_handle_releases(h, &sent, &back) != 0 || back > sent)
      return (void *)1;
    if (sent > 0 && usmipc_ipc_handle_wait_released(h, NULL) == USMIPC_EINVAL)
      return (void *)1;
  }
  return NULL;
}

TEST_IMPL(event_release_first_ticket_threads) {
  usmipc_device_t *dev = test_device();
  for (int round = 0; round < 200; round++) {
    void *p;
    usmipc_ipc_handle_t *h;
    ASSERT_OK(usmipc_malloc(dev, USMIPC_MEM_DEVICE, 4096, &p));
    ASSERT_OK(usmipc_ipc_get_handle(p, 0, &h));
    atomic_store(&release_watch_stop, 0);
    pthread_t t;
    ASSERT_EQ(pthread_create(&t, NULL, release_watcher, h), 0);
    ASSERT_OK(usmipc_ipc_handle_order_ex(h, NULL, USMIPC_ORDER_RELEASE));
    const void *data;
    size_t len;
    ASSERT_OK(usmipc_ipc_handle_data(h, &data, &len));
    uint8_t b[1024];
    memcpy(b, data, len);
    ASSERT_OK(usmipc_ipc_release(b, len, NULL));
    atomic_store(&release_watch_stop, 1);
    void *bad;
    ASSERT_EQ(pthread_join(t, &bad), 0);
    ASSERT_PTR_EQ(bad, NULL);
    uint64_t sent, back;
    ASSERT_OK(usmipc_ipc_handle_releases(h, &sent, &back));
    ASSERT_UEQ(sent, 1);
    ASSERT_UEQ(back, 1);
    ASSERT_OK(usmipc_ipc_free_handle(h));
    ASSERT_OK(usmipc_free(p));
  }
  return 0;
}

/* An event handle must name an event's slot. Forged with a memory
 * allocation's slot, buffer id and token (all in that allocation's handle),
 * it used to open as an event (the slot's size read as its record count);
 * now it is refused, saying what the slot holds. And an event handle whose
 * event was destroyed and whose slot now holds a memory allocation was told
 * "no longer exports the memory this handle names": now it hears that the
 * event was destroyed and what took its slot. */
TEST_IMPL(event_handle_names_another_export) {
  SKIP_WITHOUT_EVENTS();
  agent_t ex, im;
  static char hex[HEX_MAX];
  agent_start(&ex, NULL);
  agent_start(&im, NULL);
  AGENT_OK(&ex, "alloc 0 device 4096");
  AGENT_OK(&ex, "export 0 0 0");
  uint8_t m[4096], e[4096];
  size_t mlen = hex_to_bytes(ex.reply, m, sizeof(m));
  AGENT_OK(&ex, "evcreate 0");
  AGENT_OK(&ex, "evrecord 0");
  AGENT_OK(&ex, "evhandle 0");
  size_t elen = hex_to_bytes(ex.reply, e, sizeof(e));
  ASSERT(mlen > 212 && elen > 212);
  memcpy(e + 112, m + 112, 8);  /* buffer id */
  memcpy(e + 184, m + 184, 16); /* token */
  memcpy(e + 200, m + 200, 4);  /* export slot */
  reseal(e, elen);
  hex_encode(e, elen, hex);
  AGENT_ERR(&im, USMIPC_EBADHANDLE, "evopen 0 %s", hex);
  ASSERT_MSG(strstr(im.reply, "memory allocation") != NULL &&
                 strstr(im.reply, "not an event") != NULL,
             "%s", im.reply);

  /* A destroyed event's slot, reused by the next export (the freed slots
   * are a stack). */
  AGENT_OK(&ex, "evcreate 1");
  AGENT_OK(&ex, "evrecord 1");
  AGENT_OK(&ex, "evhandle 1");
  elen = hex_to_bytes(ex.reply, e, sizeof(e));
  AGENT_OK(&ex, "evdestroy 1");
  AGENT_OK(&ex, "alloc 1 device 4096");
  AGENT_OK(&ex, "export 1 0 0");
  mlen = hex_to_bytes(ex.reply, m, sizeof(m));
  ASSERT_EQ(usmipc__get32le(m + 200), usmipc__get32le(e + 200));
  hex_encode(e, elen, hex);
  AGENT_ERR(&im, USMIPC_EEXPORTERGONE, "evopen 1 %s", hex);
  ASSERT_MSG(strstr(im.reply, "no longer exports the event") != NULL &&
                 strstr(im.reply, "now holds a memory allocation") != NULL,
             "%s", im.reply);
  ASSERT(strstr(im.reply, "memory this handle names") == NULL);
  agent_stop_ok(&im);
  agent_stop_ok(&ex);
  return 0;
}
