/* Events: ordering device work across queues and processes.
 *
 * An event is a backend event (a CUevent, a Level Zero event; none on the
 * host, whose queue work completes before returning) plus a count of the
 * records made on it. Sharing an event exports it like an allocation: a
 * slot in this process's export table holds {event id, records made, tag},
 * so an importer learns from shared memory, without asking, whether the
 * event still exists, whether its exporter lives, and whether the record a
 * handle names has been overtaken by a later one.
 *
 * A handle names one record (its point, 1 for the first). An importer
 * waiting for point p reads the slot's count n:
 *   n <  p  the handle names a record never made: forged;
 *   n >  p  on a ring event (below), point p completed before the event was
 *           recorded again: nothing to wait for; on a user's event, the
 *           backend event now holds a later record, which is waited for
 *           instead (a wait that may be longer, never shorter, as with
 *           CUDA's own IPC events);
 *   n == p  the backend event holds p: wait on it (on the device, or the
 *           host polls it).
 * Host events (no backend event) are complete when recorded. A device
 * event whose exporter died is refused (USMIPC_EEXPORTERGONE): its pending
 * work died with it, and what a driver does with such an event is not
 * defined.
 *
 * Ordered handoffs take their events from a per-device ring: an event is
 * recorded again only once its previous record completed, so a consumer
 * never waits on work the producer submitted after the handoff (the
 * reason PyTorch makes one event per shared tensor), and importers open
 * each ring event once and find it in their cache afterwards.
 *
 * Locks: usmipc__events_lock guards local events, rings and the import cache
 * (its place in the library's lock order: fork.c). It is never held across a
 * wait on another process or on the device.
 *
 * Floor 5 of the core (objects), above queue.c. Its length serves that
 * one concern, events: local ones, their sharing (export, the import cache,
 * views), the ring that ordered handoffs take their events from, and the
 * waits on the host and on the device. */
#include <errno.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "objects.h"
#include "util/blake2s.h"

enum { EV_LOCAL = 1, EV_VIEW_LOCAL = 2, EV_IMPORTED = 3 };

#define RING_MIN 16
#define RING_MAX 1024
#define IMPORT_BUCKETS 1024

typedef struct imported {
  uint32_t pid;
  uint64_t nonce, id;
  usmipc_device_t *device; /* where it is opened */
  usmipc__peer_t *peer;
  uint32_t slot, flags;
  uint8_t key[16], token[16];
  uint64_t tag;
  void *native; /* the backend's imported event, or NULL (host events) */
  unsigned refs;
  struct imported *next;
} imported_t;

struct usmipc_event {
  usmipc_device_t *device;
  int kind;
  /* EV_LOCAL */
  void *native;
  uint64_t id;
  uint64_t points; /* records made */
  uint64_t nonce;  /* the process that made it (a fork child did not) */
  unsigned refs;   /* 1 + same-process views */
  bool destroyed;  /* usmipc_event_destroy called while views lived */
  bool ring, ring_busy;
  bool exported;
  uint32_t slot, table_fd_number;
  uint8_t token[16];
  uint32_t fd_number; /* the published descriptor, or UINT32_MAX */
  uint64_t fd_dev, fd_ino;
  usmipc__payload_t *payload;
  struct usmipc_event *next_local; /* in the list of local events */
  /* views */
  struct usmipc_event *local; /* EV_VIEW_LOCAL */
  imported_t *src;            /* EV_IMPORTED */
  uint64_t point;
};

pthread_mutex_t usmipc__events_lock = PTHREAD_MUTEX_INITIALIZER;
static usmipc_event_t *locals; /* every live local event */
static imported_t *imports[IMPORT_BUCKETS];
static size_t import_count, sweep_at = 32;  /* import_sweep */
static unsigned long long event_timeout_ms; /* 0: no limit */
static bool timeout_from_env;

typedef struct ring {
  usmipc_device_t *device;
  usmipc_event_t **events;
  size_t count, cursor;
  /* The latest record made for a handoff: (last, last_point), and whether
   * it is known to have completed. A handoff from an idle queue reuses it
   * instead of recording (usmipc__event_order). */
  usmipc_event_t *last;
  uint64_t last_point;
  bool last_done;
  /* The order record of (last, last_point) as encoded for the first handoff
   * that took it: the handoffs that reuse it copy these bytes (rec_len 0:
   * not yet encoded). */
  size_t rec_len;
  uint8_t rec[USMIPC__ORDER_RECORD_MAX];
  struct ring *next;
} ring_t;
static ring_t *rings;

void usmipc__events_fork_prepare(void) {
  pthread_mutex_lock(&usmipc__events_lock);
}
void usmipc__events_fork_parent(void) {
  pthread_mutex_unlock(&usmipc__events_lock);
}
/* The parent's events are not the child's: their slots are in the parent's
 * table, their device events in its contexts. The child forgets them all
 * (leaking their memory, not their resources: those are the parent's);
 * events it still holds refuse use. */
void usmipc__events_fork_child(void) {
  locals = NULL;
  rings = NULL;
  memset(imports, 0, sizeof(imports));
  import_count = 0;
  sweep_at = 32;
  pthread_mutex_unlock(&usmipc__events_lock);
}

/* ---- timeouts and host waits --------------------------------------------- */

int usmipc_event_set_timeout(unsigned long long timeout_ms) {
  pthread_mutex_lock(&usmipc__events_lock);
  event_timeout_ms = timeout_ms;
  timeout_from_env = true;
  pthread_mutex_unlock(&usmipc__events_lock);
  return 0;
}

unsigned long long usmipc__event_timeout_ms(void) {
  pthread_mutex_lock(&usmipc__events_lock);
  if (!timeout_from_env) {
    unsigned long long v;
    if (usmipc__env_number("USMIPC_EVENT_TIMEOUT_MS", 0, ~0ull, false,
                           "no timeout (0: none)", &v))
      event_timeout_ms = v;
    timeout_from_env = true;
  }
  unsigned long long ms = event_timeout_ms;
  pthread_mutex_unlock(&usmipc__events_lock);
  return ms;
}

/* Polls a backend event until it completes. The driver's own blocking wait
 * (cuEventSynchronize) can neither time out nor be interrupted, nor notice
 * that an importer's exporter died; polling can. Like the driver's default
 * scheduling (which spins while a context has a core to itself) it yields
 * the CPU in a loop at first (20 ms: most handoffs complete within it, and
 * are seen within a microsecond), then sleeps 5 us growing to 100 us, so a
 * long wait costs little CPU and at most ~100 us of latency. */
static int host_poll(usmipc_device_t *dev, void *native, const uint8_t *table,
                     uint32_t pid) {
  unsigned long long limit_ms = usmipc__event_timeout_ms();
  uint64_t start = usmipc__now_ns(), next_check = start + 50000000u;
  unsigned sleep_ns = 5000;
  for (;;) {
    int q = dev->ops->event_query(dev->native, native);
    if (q < 0 && table != NULL && !usmipc__table_alive(table)) {
      char said[256];
      snprintf(said, sizeof(said), "%s", usmipc_last_error());
      return usmipc__fail(USMIPC_EEXPORTERGONE,
                          "process %u, which recorded the event, exited "
                          "while this process waited for it (the driver "
                          "said: %s)",
                          pid, said);
    }
    if (q != 0)
      return q < 0 ? q : 0;
    uint64_t now = usmipc__now_ns();
    if (now - start < 20000000u) {
      sched_yield();
      continue;
    }
    if (now >= next_check) {
      next_check = now + 50000000u;
      if (usmipc__interrupted())
        return usmipc__fail(USMIPC_EINTR,
                            "interrupted while waiting for an event");
      if (table != NULL && !usmipc__table_alive(table))
        return usmipc__fail(USMIPC_EEXPORTERGONE,
                            "process %u, which recorded the event, exited "
                            "while this process waited for it: the device "
                            "work it ordered after may never complete",
                            pid);
    }
    /* Compared in milliseconds: limit_ms * 10^6 would wrap above 2^64 /
     * 10^6 ms (18446744073709552) and time out at once. */
    if (limit_ms != 0 && (now - start) / 1000000u >= limit_ms)
      return usmipc__fail(USMIPC_ETIMEDOUT,
                          "timed out after %llu ms waiting for an event (the "
                          "device work it follows is still running; raise "
                          "usmipc_event_set_timeout / USMIPC_EVENT_TIMEOUT_MS "
                          "if that is expected)",
                          limit_ms);
    struct timespec ts = {0, (long)sleep_ns};
    nanosleep(&ts, NULL);
    if (sleep_ns < 100000)
      sleep_ns *= 2;
  }
}

/* ---- local events -------------------------------------------------------- */

static bool forked_away(const usmipc_event_t *ev) {
  return ev->nonce != usmipc__self_basic()->nonce;
}

static int forked_fail(void) {
  return usmipc__fail(USMIPC_EINVAL,
                      "the event was created by the parent of this forked "
                      "process; create events in the process that uses "
                      "them");
}

/* A backend without events must be one whose work completes at once. */
static int check_events_supported(const usmipc_device_t *dev) {
  if (dev->ops->event_create == NULL &&
      dev->ops->backend != USMIPC_BACKEND_HOST)
    return usmipc__fail(USMIPC_ENOTSUP, "%s devices do not support events yet",
                        dev->ops->name);
  return 0;
}

static int event_new_local(usmipc_device_t *dev, usmipc_event_t **out) {
  int rc = check_events_supported(dev);
  if (rc != 0)
    return rc;
  usmipc_event_t *ev = calloc(1, sizeof(*ev));
  if (ev == NULL)
    return usmipc__fail(USMIPC_ENOMEM, "out of memory");
  ev->device = dev;
  ev->kind = EV_LOCAL;
  ev->refs = 1;
  ev->fd_number = UINT32_MAX;
  ev->slot = USMIPC__NO_SLOT;
  ev->nonce = usmipc__self_basic()->nonce;
  if (dev->ops->event_create != NULL) {
    rc = dev->ops->event_create(dev->native, &ev->native);
    if (rc != 0) {
      free(ev);
      return rc;
    }
  }
  /* Events share the allocations' id space: the broker serves both by id. */
  ev->id = usmipc__new_buffer_id();
  pthread_mutex_lock(&usmipc__events_lock);
  ev->next_local = locals;
  locals = ev;
  pthread_mutex_unlock(&usmipc__events_lock);
  *out = ev;
  return 0;
}

/* Releases a local event's resources; usmipc__events_lock NOT held, the event
 * already unlinked. */
static void local_free(usmipc_event_t *ev) {
  if (!forked_away(ev)) {
    if (ev->exported) {
      usmipc__exports_remove(ev->slot);
      if (ev->fd_number != UINT32_MAX)
        usmipc__broker_withdraw(ev->id);
    }
    if (ev->native != NULL)
      ev->device->ops->event_destroy(ev->device->native, ev->native);
  }
  free(ev->payload);
  free(ev);
}

static void local_unlink(usmipc_event_t *ev) {
  for (usmipc_event_t **l = &locals; *l; l = &(*l)->next_local)
    if (*l == ev) {
      *l = ev->next_local;
      return;
    }
}

int usmipc_event_create(usmipc_device_t *device, unsigned flags,
                        usmipc_event_t **event) {
  if (device == NULL || event == NULL)
    return usmipc__fail(USMIPC_EINVAL, "usmipc_event_create: NULL argument");
  *event = NULL;
  if (flags != 0)
    return usmipc__fail(USMIPC_EINVAL,
                        "usmipc_event_create: unknown flags 0x%x", flags);
  return event_new_local(device, event);
}

usmipc_device_t *usmipc_event_device(const usmipc_event_t *event) {
  return event ? event->device : NULL;
}

/* Records ev on queue; usmipc__events_lock held by the caller when ring is
 * true. */
static int record_local(usmipc_event_t *ev, usmipc_queue_t *queue) {
  if (ev->native != NULL) {
    int rc = ev->device->ops->event_record(ev->device->native, ev->native,
                                           queue->native);
    if (rc != 0)
      return rc;
  }
  uint64_t points = __atomic_add_fetch(&ev->points, 1, __ATOMIC_ACQ_REL);
  if (ev->exported)
    usmipc__exports_set_size(ev->slot, points);
  return 0;
}

int usmipc_event_record(usmipc_event_t *event, usmipc_queue_t *queue) {
  if (event == NULL || queue == NULL)
    return usmipc__fail(USMIPC_EINVAL, "usmipc_event_record: NULL argument");
  if (event->kind != EV_LOCAL)
    return usmipc__fail(USMIPC_EINVAL,
                        "usmipc_event_record: an event opened from a handle "
                        "cannot be recorded; record an event of this process "
                        "and send its handle instead");
  if (forked_away(event))
    return forked_fail();
  if (queue->device != event->device)
    return usmipc__fail(USMIPC_EWRONGDEVICE,
                        "usmipc_event_record: the queue is on %s but the "
                        "event on %s",
                        queue->device->filter, event->device->filter);
  /* One record at a time per event: the count and the backend event's mark
   * must move together. */
  pthread_mutex_lock(&usmipc__events_lock);
  int rc = record_local(event, queue);
  pthread_mutex_unlock(&usmipc__events_lock);
  return rc;
}

/* Exports a local event (first time only): its backend's payload and
 * descriptor, its export-table slot. usmipc__events_lock held. */
static int export_local(usmipc_event_t *ev) {
  if (ev->exported)
    return 0;
  if (forked_away(ev))
    return forked_fail();
  usmipc_device_t *dev = ev->device;
  if (!usmipc__device_ipc_aspect(dev))
    return usmipc__fail(USMIPC_ENOTSUP,
                        "device %s does not support IPC, so its events "
                        "cannot be shared",
                        dev->filter);
  if (ev->payload == NULL &&
      (ev->payload = calloc(1, sizeof(*ev->payload))) == NULL)
    return usmipc__fail(USMIPC_ENOMEM, "out of memory");
  int fd = -1, rc;
  if (ev->native != NULL &&
      (rc = dev->ops->event_export(dev->native, ev->native, ev->payload,
                                   &fd)) != 0)
    return rc;
  if (fd >= 0) {
    usmipc__fd_grant_t grant;
    if ((rc = usmipc__broker_publish(fd, ev->id, false, &grant)) != 0)
      return rc;
    memcpy(ev->token, grant.token, 16);
    ev->fd_number = grant.fd_number;
    ev->fd_dev = grant.dev;
    ev->fd_ino = grant.ino;
  } else if ((rc = usmipc__random(ev->token, 16)) != 0 ||
             (rc = usmipc__broker_serve()) != 0) {
    return rc;
  }
  rc = usmipc__exports_add(
      ev->id, ev->fd_number, __atomic_load_n(&ev->points, __ATOMIC_ACQUIRE),
      usmipc__event_slot_tag(usmipc__self()->key, ev->token), &ev->slot,
      &ev->table_fd_number);
  if (rc != 0) {
    if (fd >= 0)
      usmipc__broker_withdraw(ev->id);
    return rc;
  }
  ev->exported = true;
  return 0;
}

/* The wire of a local event's record point; usmipc__events_lock held. */
static void local_wire(const usmipc_event_t *ev, uint64_t point,
                       usmipc__wire_t *w) {
  usmipc__wire_identity(w, ev->device->ops->backend, ev->device->uuid);
  memcpy(w->token, ev->token, 16);
  w->buffer_id = ev->id;
  w->export_slot = ev->slot;
  w->table_fd_number = ev->table_fd_number;
  w->fd_number = ev->fd_number;
  if (ev->fd_number != UINT32_MAX) {
    w->flags = USMIPC__WIRE_FLAG_FD;
    w->fd_dev = ev->fd_dev;
    w->fd_ino = ev->fd_ino;
  }
  if (usmipc__broker_socket_dir())
    w->flags |= USMIPC__WIRE_FLAG_SOCKET_DIR;
  w->payload.handle_kind = USMIPC__HANDLE_KIND_EVENT;
  w->payload.len = ev->payload->len;
  memcpy(w->payload.bytes, ev->payload->bytes, ev->payload->len);
  w->event_kind = ev->payload->handle_kind;
  w->event_point = point;
  w->event_flags = (ev->ring ? USMIPC__EVENT_FLAG_RING : 0) |
                   (ev->native == NULL ? USMIPC__EVENT_FLAG_HOST : 0);
  w->is_event = true;
}

/* An event handle's record 0x8001 (its point, flags and kind) as w's only
 * extension record. */
static void put_event_record(usmipc__wire_t *w) {
  uint8_t *r = w->ext;
  usmipc__put16le(r, USMIPC__EXT_EVENT);
  usmipc__put16le(r + 2, USMIPC__EVENT_RECORD_LEN);
  memset(r + 4, 0, USMIPC__EVENT_RECORD_LEN);
  usmipc__put64le(r + 4, w->event_point);
  usmipc__put32le(r + 12, w->event_flags);
  r[16] = w->event_kind;
  w->ext_len = 4 + USMIPC__EVENT_RECORD_LEN;
}

/* ---- the ring of ordering events ----------------------------------------- */

static ring_t *ring_of(usmipc_device_t *dev) {
  for (ring_t *r = rings; r; r = r->next)
    if (r->device == dev)
      return r;
  ring_t *r = calloc(1, sizeof(*r));
  if (r == NULL)
    return NULL;
  r->device = dev;
  r->next = rings;
  rings = r;
  return r;
}

/* An event of ring r (ring_of) whose previous record has completed (or that
 * has none); usmipc__events_lock held (and dropped while it waits). Grows the
 * ring while every event is busy, and past RING_MAX waits for the oldest. */
static int ring_take(ring_t *r, usmipc_event_t **out) {
  usmipc_device_t *dev = r->device;
again:
  for (size_t i = 0; i < r->count; i++) {
    size_t at = (r->cursor + i) % r->count;
    usmipc_event_t *ev = r->events[at];
    int q = ev->native == NULL || ev->points == 0
                ? 1
                : dev->ops->event_query(dev->native, ev->native);
    if (q < 0)
      return q;
    if (q == 1) {
      r->cursor = (at + 1) % r->count;
      *out = ev;
      return 0;
    }
  }
  if (r->count < RING_MAX) {
    size_t grow = r->count == 0 ? RING_MIN : r->count;
    usmipc_event_t **events =
        realloc(r->events, (r->count + grow) * sizeof(*events));
    if (events == NULL)
      return usmipc__fail(USMIPC_ENOMEM, "out of memory");
    r->events = events;
    usmipc_event_t *ev;
    /* event_new_local takes usmipc__events_lock itself. */
    pthread_mutex_unlock(&usmipc__events_lock);
    int rc = event_new_local(dev, &ev);
    pthread_mutex_lock(&usmipc__events_lock);
    if (rc != 0)
      return rc;
    ev->ring = true;
    r->cursor = r->count;
    r->events[r->count++] = ev;
    r->cursor = (r->cursor + 1) % r->count;
    *out = ev;
    return 0;
  }
  /* RING_MAX handoffs in flight: the oldest must finish first. It is waited
   * for without usmipc__events_lock, since the wait reads the wait limit and
   * asks the interrupt hook, which take locks of their own (the lock
   * order, fork.c): with the lock held the process deadlocked with itself
   * (tests/level_zero event_ring_full). Another thread may take the event
   * meanwhile, so the ring is looked at again. */
  usmipc_event_t *ev = r->events[r->cursor];
  pthread_mutex_unlock(&usmipc__events_lock);
  int rc = host_poll(dev, ev->native, NULL, 0);
  pthread_mutex_lock(&usmipc__events_lock);
  if (rc != 0)
    return rc;
  goto again;
}

/* USMIPC_ORDER_REUSE=0: a new record for every handoff, as before the
 * reuse below (to measure it, or should a driver's idle report be wrong). */
static bool order_reuse(void) {
  static int on = -1; /* read once: the hot path reads no environment */
  int v = __atomic_load_n(&on, __ATOMIC_RELAXED);
  if (v < 0) {
    unsigned long long n = 1;
    (void)usmipc__env_number("USMIPC_ORDER_REUSE", 0, 1, false, "1 (reuse)",
                             &n);
    v = (int)n;
    __atomic_store_n(&on, v, __ATOMIC_RELAXED);
  }
  return v == 1;
}

/* A completed record of r that orders a handoff from queue, or false: when
 * the queue is idle, everything submitted to it before the handoff has
 * completed, so any completed record orders the handoff as well as a new
 * one would, and costs the importer no more (it waits for nothing). That
 * saves the event record (a driver call, most of what ordering added to a
 * fresh export on CUDA) for the common producer that exports after its
 * work finished. The record must still be the event's latest (a later
 * record of it would be waited for instead: correct, but later work), and
 * known to have completed: by a query, once, made before the queue's (a
 * record still pending settles it at once: handoffs that follow a record
 * within microseconds find the queue busy with that record and record
 * again, as before). usmipc__events_lock held. */
static bool reuse_record(ring_t *r, usmipc_queue_t *queue) {
  usmipc_device_t *dev = queue->device;
  usmipc_event_t *ev = r->last;
  if (ev == NULL || dev->ops->queue_idle == NULL || !order_reuse() ||
      __atomic_load_n(&ev->points, __ATOMIC_ACQUIRE) != r->last_point)
    return false;
  if (!r->last_done &&
      !(r->last_done = ev->native == NULL ||
                       dev->ops->event_query(dev->native, ev->native) == 1))
    return false;
  return dev->ops->queue_idle(dev->native, queue->native) == 1;
}

/* The record of r that orders everything submitted to queue so far: the
 * last one reused where reuse_record allows, else a new record, which
 * becomes the last. An ordered handoff and a release ticket's event both
 * come here, so either finds the other's completed record.
 * usmipc__events_lock held. */
static int order_take(ring_t *r, usmipc_queue_t *queue, usmipc_event_t **out) {
  if (reuse_record(r, queue)) {
    *out = r->last; /* exported when it was recorded */
    return 0;
  }
  usmipc_event_t *ev = NULL;
  int rc;
  if ((rc = ring_take(r, &ev)) != 0 || (rc = export_local(ev)) != 0 ||
      (rc = record_local(ev, queue)) != 0)
    return rc;
  USMIPC__STAT_ADD(event_records, 1);
  r->last = ev;
  r->last_point = __atomic_load_n(&ev->points, __ATOMIC_ACQUIRE);
  r->last_done = false;
  r->rec_len = 0;
  *out = ev;
  return 0;
}

int usmipc__event_order(usmipc_queue_t *queue, uint8_t *out, size_t *len) {
  usmipc_event_t *ev = NULL;
  pthread_mutex_lock(&usmipc__events_lock);
  ring_t *r = ring_of(queue->device);
  int rc = r == NULL ? usmipc__fail(USMIPC_ENOMEM, "out of memory")
                     : order_take(r, queue, &ev);
  if (rc == 0 && r->rec_len == 0) {
    usmipc__wire_t w;
    local_wire(ev, r->last_point, &w);
    r->rec_len = usmipc__order_record(&w, r->rec);
  }
  if (rc == 0) {
    memcpy(out, r->rec, r->rec_len);
    *len = r->rec_len;
  }
  pthread_mutex_unlock(&usmipc__events_lock);
  return rc;
}

/* ---- sharing ------------------------------------------------------------- */

int usmipc_ipc_get_event_handle(usmipc_event_t *event,
                                usmipc_ipc_handle_t **handle) {
  if (event == NULL || handle == NULL)
    return usmipc__fail(USMIPC_EINVAL,
                        "usmipc_ipc_get_event_handle: NULL argument");
  *handle = NULL;
  if (event->kind != EV_LOCAL)
    return usmipc__fail(USMIPC_EINVAL,
                        "usmipc_ipc_get_event_handle: the event was opened "
                        "from a handle; forward the original handle bytes");
  if (event->device->ops->ipc_check != NULL) {
    int rc = event->device->ops->ipc_check(event->device->native);
    if (rc != 0)
      return rc;
  }
  pthread_mutex_lock(&usmipc__events_lock);
  int rc = export_local(event);
  usmipc__wire_t w;
  if (rc == 0) {
    local_wire(event, event->points, &w);
    put_event_record(&w);
  }
  pthread_mutex_unlock(&usmipc__events_lock);
  if (rc != 0)
    return rc;
  return usmipc__handle_from_wire(&w, handle);
}

static size_t bucket_of(uint32_t pid, uint64_t nonce, uint64_t id) {
  uint64_t h = (nonce ^ id * 0x9e3779b97f4a7c15ull) + pid;
  h ^= h >> 29;
  return (size_t)(h % IMPORT_BUCKETS);
}

static imported_t *import_find(const usmipc__wire_t *w,
                               usmipc_device_t *device) {
  for (imported_t *e = imports[bucket_of(w->pid, w->nonce, w->buffer_id)]; e;
       e = e->next)
    if (e->pid == w->pid && e->nonce == w->nonce && e->id == w->buffer_id &&
        e->device == device)
      return e;
  return NULL;
}

/* A same-process handle: the local event it names; usmipc__events_lock held. */
static int find_local(const usmipc__wire_t *w, usmipc_event_t **out) {
  for (usmipc_event_t *ev = locals; ev; ev = ev->next_local)
    if (ev->id == w->buffer_id && !ev->destroyed) {
      if (!ev->exported || ev->slot != w->export_slot ||
          !usmipc__ct_equal(ev->token, w->token, 16))
        break;
      if (w->event_point > ev->points)
        return usmipc__fail(USMIPC_EBADHANDLE,
                            "the event handle names record %llu, but the "
                            "event has been recorded only %llu times: forged",
                            (unsigned long long)w->event_point,
                            (unsigned long long)ev->points);
      /* Everything else the handle says must be what this process wrote:
       * another process would check the payload and descriptor through its
       * backend and transport, this one opens its own event directly. */
      bool fd = ev->fd_number != UINT32_MAX;
      uint32_t flags = (ev->ring ? USMIPC__EVENT_FLAG_RING : 0) |
                       (ev->native == NULL ? USMIPC__EVENT_FLAG_HOST : 0);
      if (w->event_flags != flags || w->fd_number != ev->fd_number ||
          ((w->flags & USMIPC__WIRE_FLAG_FD) != 0) != fd ||
          (w->flags & USMIPC__WIRE_FLAG_REOPENABLE) ||
          (fd && (w->fd_dev != ev->fd_dev || w->fd_ino != ev->fd_ino)) ||
          w->event_kind != ev->payload->handle_kind ||
          w->payload.len != ev->payload->len ||
          memcmp(w->payload.bytes, ev->payload->bytes, ev->payload->len) != 0)
        return usmipc__fail(USMIPC_EBADHANDLE,
                            "the event handle names an event of this process "
                            "but does not describe it as this process "
                            "exported it (flags, descriptor or payload "
                            "differ): forged or corrupted");
      *out = ev;
      return 0;
    }
  return usmipc__fail(USMIPC_EEXPORTERGONE,
                      "the event handle was made by this process, but the "
                      "event it names has been destroyed");
}

/* The checks every open makes before it looks anything up: the host, the
 * backend, the device. */
static int check_target(const usmipc__wire_t *w, usmipc_device_t **device,
                        usmipc_device_t **owner) {
  const usmipc__process_t *self = usmipc__self_basic();
  if (memcmp(w->boot_id, self->boot_id, 16) != 0)
    return usmipc__fail(USMIPC_EOTHERHOST,
                        "the event handle was made on another machine or "
                        "before this machine rebooted (boot id differs)");
  *owner = usmipc__device_by_uuid(w->backend, w->device_uuid);
  if (*device != NULL && (*device)->ops->backend != w->backend)
    return usmipc__fail(USMIPC_EWRONGDEVICE,
                        "the event handle is of a %s device but the target "
                        "device %s is a %s device",
                        usmipc_backend_name(w->backend), (*device)->filter,
                        (*device)->ops->name);
  /* A device hidden from this process (CUDA_VISIBLE_DEVICES): opened on
   * the target device where the backend can (as for memory, ipc.c). */
  if (*owner == NULL &&
      (*device == NULL || !(*device)->ops->ipc_import_hidden_owner)) {
    char uuid[37];
    usmipc__uuid_format(w->device_uuid, uuid);
    return usmipc__fail(USMIPC_EWRONGDEVICE,
                        "the event was recorded on %s device %s, which this "
                        "process cannot see%s",
                        usmipc_backend_name(w->backend), uuid,
                        *device == NULL && w->backend == USMIPC_BACKEND_CUDA
                            ? " (CUDA_VISIBLE_DEVICES hides it); name one of "
                              "this process's GPUs as the device to wait on"
                            : "");
  }
  if (*device == NULL)
    *device = *owner;
  int rc = check_events_supported(*device);
  if (rc != 0)
    return rc;
  if ((w->event_flags & USMIPC__EVENT_FLAG_HOST) !=
      ((*device)->ops->event_create == NULL ? USMIPC__EVENT_FLAG_HOST : 0))
    return usmipc__fail(USMIPC_EBADHANDLE,
                        "the event handle's kind does not match its backend "
                        "(%s): forged or corrupted",
                        usmipc_backend_name(w->backend));
  return 0;
}

/* Unlinks the imported events that nobody holds and that can never be
 * waited for again (their exporter exited, or destroyed the event);
 * usmipc__events_lock held. The caller frees them after unlocking
 * (import_free): an entry pins its exporter's peer (a pidfd, the mapped export
 * table) and, on a device, the opened backend event, so without this sweep
 * every exporter an importer ever took an event from stayed pinned for good
 * (idle peers are otherwise bounded by the registry's LRU). */
/* A sweep walks every entry, so it runs only once the cache has doubled
 * since the last one (at 32 entries first): amortized, a miss pays a few
 * loads for it, not a walk (the first opens of a 400-event ring took 2.4 us
 * each with a walk per miss, against 0.27 us for the bare driver call). */
static imported_t *import_sweep(void) {
  imported_t *dead = NULL;
  if (import_count < sweep_at)
    return NULL;
  for (size_t b = 0; b < IMPORT_BUCKETS; b++)
    for (imported_t **pp = &imports[b]; *pp != NULL;) {
      imported_t *e = *pp;
      if (e->refs == 0 &&
          !usmipc__peer_slot_live(e->peer, e->slot, e->id, e->tag)) {
        *pp = e->next;
        e->next = dead;
        dead = e;
        import_count--;
      } else {
        pp = &e->next;
      }
    }
  sweep_at = import_count * 2 > 32 ? import_count * 2 : 32;
  return dead;
}

/* Frees what import_sweep unlinked; usmipc__events_lock NOT held. */
static void import_free(imported_t *dead) {
  while (dead != NULL) {
    imported_t *next = dead->next;
    if (dead->native != NULL)
      dead->device->ops->event_close(dead->device->native, dead->native);
    usmipc__peer_put(dead->peer);
    free(dead);
    dead = next;
  }
}

/* Finds or opens the imported event of w on device, with a reference;
 * usmipc__events_lock NOT held. A miss first sweeps the dead entries out of the
 * cache (a walk of its buckets, next to the exporter round trip a miss
 * costs). */
static int import_get(const usmipc__wire_t *w, usmipc_device_t *device,
                      usmipc_device_t *owner, imported_t **out) {
  pthread_mutex_lock(&usmipc__events_lock);
  imported_t *e = import_find(w, device);
  if (e != NULL) {
    int rc = 0;
    /* A hit is checked like a miss: the event must still be exported by a
     * living exporter (a few loads from its table). The handle's token is
     * the one the entry was opened with (its tag proven then), so no MAC
     * is computed again. */
    if (!usmipc__ct_equal(e->key, w->key, 16) || e->slot != w->export_slot ||
        !usmipc__ct_equal(e->token, w->token, 16))
      rc = usmipc__fail(USMIPC_EACCES,
                        "process %u's event handle carries the wrong "
                        "capability token or slot for its event (forged or "
                        "corrupted)",
                        w->pid);
    else if (!usmipc__peer_slot_live(e->peer, e->slot, e->id, e->tag))
      rc = usmipc__fail(USMIPC_EEXPORTERGONE,
                        usmipc__table_alive(usmipc__peer_table(e->peer))
                            ? "process %u destroyed the event this handle "
                              "names"
                            : "process %u, which recorded the event, has "
                              "exited",
                        w->pid);
    else
      e->refs++;
    pthread_mutex_unlock(&usmipc__events_lock);
    *out = rc == 0 ? e : NULL;
    return rc;
  }
  imported_t *dead = import_sweep();
  pthread_mutex_unlock(&usmipc__events_lock);
  import_free(dead);
  uint64_t tag = usmipc__event_slot_tag(w->key, w->token);

  uint64_t deadline = usmipc__deadline_after_timeout();
  usmipc__peer_t *peer = NULL;
  int fd = -1;
  int rc = usmipc__peer_get(w, deadline, &peer, &fd);
  if (rc != 0)
    return rc;
  if (fd < 0 && (w->flags & USMIPC__WIRE_FLAG_FD))
    rc = usmipc__peer_fetch_fd(peer, w, tag, deadline, &fd);
  else
    rc = usmipc__peer_check(peer, w, tag, NULL);
  imported_t *made = NULL;
  if (rc == 0 && (made = calloc(1, sizeof(*made))) == NULL)
    rc = usmipc__fail(USMIPC_ENOMEM, "out of memory");
  if (rc == 0 && device->ops->event_import != NULL) {
    /* The backend sees its own event kind, not the handle's (128). */
    usmipc__payload_t payload = w->payload;
    payload.handle_kind = w->event_kind;
    rc = device->ops->event_import(device->native,
                                   owner != NULL ? owner->native : NULL,
                                   &payload, fd, &made->native);
  }
  if (fd >= 0)
    close(fd);
  if (rc != 0) {
    free(made);
    usmipc__peer_put(peer);
    usmipc__error_prefix("opening the event handle of process %u: ", w->pid);
    return rc;
  }
  made->pid = w->pid;
  made->nonce = w->nonce;
  made->id = w->buffer_id;
  made->device = device;
  made->peer = peer;
  made->slot = w->export_slot;
  made->flags = w->event_flags;
  made->tag = tag;
  memcpy(made->key, w->key, 16);
  memcpy(made->token, w->token, 16);
  made->refs = 1;

  pthread_mutex_lock(&usmipc__events_lock);
  e = import_find(w, device);
  if (e == NULL) {
    size_t b = bucket_of(w->pid, w->nonce, w->buffer_id);
    made->next = imports[b];
    imports[b] = made;
    import_count++;
    e = made;
    made = NULL;
  } else {
    e->refs++;
  }
  pthread_mutex_unlock(&usmipc__events_lock);
  if (made != NULL) { /* another thread opened it meanwhile */
    if (made->native != NULL)
      device->ops->event_close(device->native, made->native);
    usmipc__peer_put(made->peer);
    free(made);
  }
  *out = e;
  return 0;
}

static void import_put(imported_t *e) {
  pthread_mutex_lock(&usmipc__events_lock);
  e->refs--;
  pthread_mutex_unlock(&usmipc__events_lock);
}

/* ---- waiting ------------------------------------------------------------- */

/* Where the record a view waits for stands. *native is the backend event
 * to wait on, or NULL when there is nothing to wait for. */
static int imported_status(const imported_t *e, uint64_t point, void **native) {
  *native = NULL;
  const uint8_t *table = usmipc__peer_table(e->peer);
  usmipc__export_slot_t s;
  bool alive = usmipc__table_alive(table);
  int read = usmipc__table_read_slot(table, e->slot, &s, NULL);
  if (read == USMIPC_EBADHANDLE) /* a slot beyond the table: said why */
    return read;
  if (read != 0)
    return usmipc__fail(USMIPC_EEXPORTERGONE,
                        "process %u's export table is stuck mid-update; the "
                        "exporter probably died",
                        e->pid);
  if (s.buffer_id != e->id || s.tag != e->tag)
    return usmipc__fail(USMIPC_EEXPORTERGONE,
                        alive ? "process %u destroyed the event this handle "
                                "names"
                              : "process %u, which recorded the event, has "
                                "exited",
                        e->pid);
  if (s.size < point)
    return usmipc__fail(USMIPC_EBADHANDLE,
                        "the event handle names record %llu, but process %u "
                        "has recorded the event only %llu times: forged",
                        (unsigned long long)point, e->pid,
                        (unsigned long long)s.size);
  if (e->flags & USMIPC__EVENT_FLAG_HOST)
    return 0; /* complete when recorded */
  if (s.size > point && (e->flags & USMIPC__EVENT_FLAG_RING))
    return 0; /* recorded again: only after point completed */
  if (!alive)
    return usmipc__fail(USMIPC_EEXPORTERGONE,
                        "process %u exited before the device work this event "
                        "follows was known to be complete; a process's "
                        "pending work dies with it (open with ordering off "
                        "if you know that work finished)",
                        e->pid);
  *native = e->native;
  return 0;
}

static int local_status(const usmipc_event_t *ev, uint64_t point,
                        void **native) {
  *native = NULL;
  uint64_t points = __atomic_load_n(&ev->points, __ATOMIC_ACQUIRE);
  if (ev->destroyed)
    return usmipc__fail(USMIPC_EEXPORTERGONE,
                        "the event this view names has been destroyed");
  if (ev->native == NULL || points == 0 || (points > point && ev->ring))
    return 0;
  *native = ev->native;
  return 0;
}

/* Waits for point of a view: on queue's device, or the host when queue is
 * NULL. */
static int wait_point(usmipc_event_t *local, imported_t *src, uint64_t point,
                      usmipc_queue_t *queue) {
  void *native;
  usmipc_device_t *dev;
  int rc;
  if (local != NULL) {
    dev = local->device;
    rc = local_status(local, point, &native);
  } else {
    dev = src->device;
    rc = imported_status(src, point, &native);
  }
  if (rc != 0 || native == NULL)
    return rc;
  if (queue == NULL)
    return host_poll(dev, native, src ? usmipc__peer_table(src->peer) : NULL,
                     src ? src->pid : 0);
  if (queue->device->ops != dev->ops)
    return usmipc__fail(USMIPC_EWRONGDEVICE,
                        "cannot make a %s queue wait for a %s event",
                        queue->device->ops->name, dev->ops->name);
  /* A record already complete needs no wait on the device: asking reads
   * the event's memory, while a wait is work on the queue, and work from
   * several processes on one GPU makes it switch between their contexts
   * (8 consumers opening one handoff at once took 4.4x a lone consumer's
   * time, run 53). The producer's idle handoffs name completed records. */
  if (dev->ops->event_query(dev->native, native) == 1)
    return 0;
  USMIPC__STAT_ADD(event_waits, 1);
  return queue->device->ops->event_wait(queue->device->native, native,
                                        queue->native);
}

static int view_wait(usmipc_event_t *ev, usmipc_queue_t *queue) {
  if (ev == NULL)
    return usmipc__fail(USMIPC_EINVAL, "NULL event");
  if (ev->kind == EV_LOCAL) {
    if (forked_away(ev))
      return forked_fail();
    return wait_point(ev, NULL, __atomic_load_n(&ev->points, __ATOMIC_ACQUIRE),
                      queue);
  }
  return wait_point(ev->local, ev->src, ev->point, queue);
}

int usmipc_event_wait(usmipc_event_t *event, usmipc_queue_t *queue) {
  if (queue == NULL)
    return usmipc__fail(USMIPC_EINVAL,
                        "usmipc_event_wait: NULL queue (use "
                        "usmipc_event_synchronize to wait on the host)");
  return view_wait(event, queue);
}

int usmipc_event_synchronize(usmipc_event_t *event) {
  return view_wait(event, NULL);
}

int usmipc_event_query(usmipc_event_t *event) {
  if (event == NULL)
    return usmipc__fail(USMIPC_EINVAL, "usmipc_event_query: NULL event");
  void *native;
  usmipc_device_t *dev = event->device;
  int rc;
  if (event->kind == EV_LOCAL)
    rc = local_status(event, __atomic_load_n(&event->points, __ATOMIC_ACQUIRE),
                      &native);
  else if (event->kind == EV_VIEW_LOCAL)
    rc = local_status(event->local, event->point, &native);
  else
    rc = imported_status(event->src, event->point, &native);
  if (rc != 0 || native == NULL)
    return rc;
  int q = dev->ops->event_query(dev->native, native);
  if (q < 0)
    return q;
  return q ? 0 : USMIPC_ENOTREADY;
}

int usmipc__event_wait_wire(const usmipc__wire_t *ew, usmipc_device_t *device,
                            usmipc_queue_t *queue) {
  usmipc_device_t *owner;
  int rc = check_target(ew, &device, &owner);
  if (rc != 0)
    return rc;
  const usmipc__process_t *self = usmipc__self_basic();
  if (ew->nonce == self->nonce && ew->pid == self->pid) {
    usmipc_event_t *local;
    pthread_mutex_lock(&usmipc__events_lock);
    rc = find_local(ew, &local);
    if (rc == 0)
      local->refs++;
    pthread_mutex_unlock(&usmipc__events_lock);
    if (rc != 0)
      return rc;
    rc = wait_point(local, NULL, ew->event_point, queue);
    pthread_mutex_lock(&usmipc__events_lock);
    bool last = --local->refs == 0;
    if (last)
      local_unlink(local);
    pthread_mutex_unlock(&usmipc__events_lock);
    if (last)
      local_free(local);
    return rc;
  }
  imported_t *e;
  if ((rc = import_get(ew, device, owner, &e)) != 0)
    return rc;
  rc = wait_point(NULL, e, ew->event_point, queue);
  import_put(e);
  return rc;
}

/* A view of the record that event wire w names, on device. */
static int open_event_wire(const usmipc__wire_t *w, usmipc_device_t *device,
                           usmipc_event_t **event) {
  usmipc_device_t *owner;
  int rc = check_target(w, &device, &owner);
  if (rc != 0)
    return rc;
  if (device->ops->ipc_check != NULL &&
      (rc = device->ops->ipc_check(device->native)) != 0)
    return rc;
  usmipc_event_t *view = calloc(1, sizeof(*view));
  if (view == NULL)
    return usmipc__fail(USMIPC_ENOMEM, "out of memory");
  view->device = device;
  view->point = w->event_point;
  const usmipc__process_t *self = usmipc__self_basic();
  if (w->nonce == self->nonce && w->pid == self->pid) {
    pthread_mutex_lock(&usmipc__events_lock);
    rc = find_local(w, &view->local);
    if (rc == 0)
      view->local->refs++;
    pthread_mutex_unlock(&usmipc__events_lock);
    view->kind = EV_VIEW_LOCAL;
    if (rc == 0)
      view->device = view->local->device;
  } else {
    view->kind = EV_IMPORTED;
    rc = import_get(w, device, owner, &view->src);
  }
  if (rc != 0) {
    free(view);
    return rc;
  }
  *event = view;
  return 0;
}

int usmipc_ipc_open_event(const void *data, size_t len, usmipc_device_t *device,
                          usmipc_event_t **event) {
  if (event == NULL)
    return usmipc__fail(USMIPC_EINVAL, "usmipc_ipc_open_event: NULL event");
  *event = NULL;
  usmipc__wire_t w;
  int rc = usmipc__wire_decode(data, len, &w);
  if (rc != 0)
    return rc;
  if (!w.is_event)
    return usmipc__fail(USMIPC_EINVAL,
                        "usmipc_ipc_open_event: these are the bytes of a "
                        "memory handle; open them with usmipc_ipc_open");
  return open_event_wire(&w, device, event);
}

int usmipc_ipc_open_handle_event(const void *data, size_t len,
                                 usmipc_device_t *device,
                                 usmipc_event_t **event) {
  if (event == NULL)
    return usmipc__fail(USMIPC_EINVAL,
                        "usmipc_ipc_open_handle_event: NULL event");
  *event = NULL;
  usmipc__wire_t w;
  int rc = usmipc__wire_decode(data, len, &w);
  if (rc != 0)
    return rc;
  if (w.is_event)
    return usmipc__fail(USMIPC_EINVAL,
                        "usmipc_ipc_open_handle_event: these are the bytes "
                        "of an event handle; open them with "
                        "usmipc_ipc_open_event");
  if (w.order_len == 0)
    return 0;
  usmipc__wire_t ev;
  usmipc__wire_order_event(&w, &ev);
  return open_event_wire(&ev, device, event);
}

int usmipc_event_destroy(usmipc_event_t *event) {
  if (event == NULL)
    return 0;
  if (event->kind == EV_IMPORTED) {
    import_put(event->src);
    free(event);
    return 0;
  }
  bool is_view = event->kind == EV_VIEW_LOCAL;
  usmipc_event_t *local = is_view ? event->local : event;
  pthread_mutex_lock(&usmipc__events_lock);
  if (!is_view) {
    if (local->ring) { /* rings belong to the library */
      pthread_mutex_unlock(&usmipc__events_lock);
      return usmipc__fail(USMIPC_EINVAL, "usmipc_event_destroy: not yours");
    }
    local->destroyed = true;
  }
  bool last = --local->refs == 0;
  if (last)
    local_unlink(local);
  pthread_mutex_unlock(&usmipc__events_lock);
  if (last)
    local_free(local); /* may be event itself */
  if (is_view)
    free(event);
  return 0;
}

int usmipc__event_ring_handle(usmipc_queue_t *queue, uint8_t *out,
                              size_t *len) {
  usmipc_event_t *ev = NULL;
  usmipc__wire_t w;
  pthread_mutex_lock(&usmipc__events_lock);
  ring_t *r = ring_of(queue->device);
  int rc = r == NULL ? usmipc__fail(USMIPC_ENOMEM, "out of memory")
                     : order_take(r, queue, &ev);
  if (rc == 0)
    local_wire(ev, r->last_point, &w);
  pthread_mutex_unlock(&usmipc__events_lock);
  if (rc != 0)
    return rc;
  put_event_record(&w);
  *len = usmipc__wire_len(&w);
  usmipc__wire_encode(&w, out);
  return 0;
}
