/* PyTorch's CUDA allocator over usmipc pools (docs/pools.md, "PyTorch
 * allocator"): torch.cuda.memory.CUDAPluggableAllocator calls
 * usmipc_torch_malloc and usmipc_torch_free for every CUDA allocation of
 * the process, so that tensors (a model's weights) are blocks of pool
 * segments from the start, and sharing them costs one export per segment.
 *
 * One pool per device ordinal, created at the first allocation on it and
 * kept until the process exits. The same code serves any backend (the
 * host's pools are what the C tests exercise without a GPU); the public
 * entry points are the CUDA ones, where torch's device index is the CUDA
 * ordinal of the process (after CUDA_VISIBLE_DEVICES), as is usmipc's.
 *
 * The stream rule. torch's own caching allocator hands a freed block again
 * only to allocations on the stream that allocated it, whose later work runs
 * after the freed tensor's work: reuse is safe without waiting. A pool has
 * no streams, so a freed block handed to any allocation at once could be
 * overwritten while kernels queued on the tensor's stream still read it.
 * torch gives a pluggable allocator, at free, the stream the tensor was
 * allocated on (it keeps it from the malloc call), and no record_stream
 * hook that Python can set. So a free records an event on that stream and
 * the block stays allocated until the event has completed: every malloc and
 * free hands back the blocks whose events completed (a query, never a
 * wait), a malloc that finds the pool exhausted waits for the pending
 * events and tries once more, and usmipc_torch_synchronize waits for all
 * of them. The host never waits at a free, as with torch's allocator. A
 * backend without events (the host: its work is done when a call returns)
 * returns blocks at once; should recording the event fail, the free waits
 * for the stream instead.
 *
 * Locks: a pool's pending list has its own mutex (its place in the
 * library's lock order: fork.c).
 *
 * Floor 5 of the core (objects), above memory.c and pool.c. */
#include <ctype.h>
#include <errno.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "objects.h"

#define TORCH_ALIGN ((size_t)512) /* what torch's caching allocator gives */
#define TORCH_MAX_DEVICES 16
#define TORCH_BACKENDS (USMIPC_BACKEND_LEVEL_ZERO + 1)
#define TORCH_SPARE_EVENTS 1024 /* completed events kept for reuse */
#define TORCH_MAX_SEGMENT ((size_t)1 << 46)

/* A freed block whose stream's work may still use it. */
typedef struct pending {
  void *ptr;
  void *event; /* the backend's, recorded on stream at the free */
  void *stream;
  struct pending *next;
} pending_t;

typedef struct torch_pool {
  usmipc_pool_t *pool; /* set once, under torch_create_lock; read with
                          acquire */
  usmipc_device_t *device;
  pthread_mutex_t lock; /* the pending frees and the spare events */
  pending_t *head, *tail;
  size_t npending; /* atomic: read without the lock as a hint */
  void **spare;    /* completed events, recorded again by later frees */
  size_t nspare, spare_cap;
} torch_pool_t;

static torch_pool_t torch_pools[TORCH_BACKENDS][TORCH_MAX_DEVICES];
static pthread_mutex_t torch_create_lock = PTHREAD_MUTEX_INITIALIZER;
static size_t torch_segment_size; /* atomic; 0: the environment's, else the
                                     pool default */

/* fork() from any thread: the creation lock, then every pool's lock (a
 * free under one takes the registry lock, so these come before it in the
 * library's lock order; see fork.c). Pools exist until the process
 * ends, and each one's lock is initialised before its pool is published. */
void usmipc__torch_fork_prepare(void) {
  pthread_mutex_lock(&torch_create_lock);
  for (int b = 0; b < TORCH_BACKENDS; b++)
    for (int d = 0; d < TORCH_MAX_DEVICES; d++)
      if (torch_pools[b][d].pool != NULL)
        pthread_mutex_lock(&torch_pools[b][d].lock);
}

void usmipc__torch_fork_parent(void) {
  for (int b = 0; b < TORCH_BACKENDS; b++)
    for (int d = 0; d < TORCH_MAX_DEVICES; d++)
      if (torch_pools[b][d].pool != NULL)
        pthread_mutex_unlock(&torch_pools[b][d].lock);
  pthread_mutex_unlock(&torch_create_lock);
}

void usmipc__torch_fork_child(void) { usmipc__torch_fork_parent(); }

/* The first segment of pools created from now on: usmipc_torch_set_segment_
 * size, else USMIPC_TORCH_POOL_SEGMENT (bytes, or a number with K, M or G),
 * else 0 (the pool default, 64 MiB). */
static int first_segment_size(size_t *out) {
  *out = __atomic_load_n(&torch_segment_size, __ATOMIC_RELAXED);
  if (*out != 0)
    return 0;
  unsigned long long v;
  if (usmipc__env_number("USMIPC_TORCH_POOL_SEGMENT", 1, TORCH_MAX_SEGMENT,
                         true, "the pool default (64 MiB)", &v))
    *out = (size_t)v;
  return 0;
}

int usmipc_torch_set_segment_size(size_t nbytes) {
  if (nbytes > TORCH_MAX_SEGMENT)
    return usmipc__fail(USMIPC_EINVAL,
                        "usmipc_torch_set_segment_size: %zu bytes is more "
                        "than any device holds",
                        nbytes);
  __atomic_store_n(&torch_segment_size, nbytes, __ATOMIC_RELAXED);
  return 0;
}

/* The pool state of (backend, ordinal) if its pool exists, else NULL. */
static torch_pool_t *torch_pool_find(usmipc_backend_t backend, int ordinal) {
  if ((unsigned)backend >= TORCH_BACKENDS || ordinal < 0 ||
      ordinal >= TORCH_MAX_DEVICES)
    return NULL;
  torch_pool_t *tp = &torch_pools[backend][ordinal];
  return __atomic_load_n(&tp->pool, __ATOMIC_ACQUIRE) != NULL ? tp : NULL;
}

/* ... creating the pool if it does not exist. */
static int torch_pool_get(usmipc_backend_t backend, int ordinal,
                          torch_pool_t **out) {
  torch_pool_t *tp = *out = torch_pool_find(backend, ordinal);
  if (tp != NULL)
    return 0;
  const char *name = usmipc_backend_name(backend);
  if ((unsigned)backend >= TORCH_BACKENDS || ordinal < 0 ||
      ordinal >= TORCH_MAX_DEVICES)
    return usmipc__fail(USMIPC_ENODEV,
                        "no %s device %d: device indexes run from 0 to %d",
                        name, ordinal, TORCH_MAX_DEVICES - 1);
  tp = &torch_pools[backend][ordinal];
  pthread_mutex_lock(&torch_create_lock);
  int rc = 0;
  if (tp->pool == NULL) {
    usmipc_device_t *dev = usmipc__device_by_ordinal(backend, ordinal);
    const char *reason = NULL;
    size_t first = 0;
    usmipc_pool_t *pool = NULL;
    if (dev == NULL && usmipc_backend_status(backend, &reason) != 0)
      rc = usmipc__fail(USMIPC_ENODEV, "no %s device %d: %s", name, ordinal,
                        reason ? reason : "the backend is unavailable");
    else if (dev == NULL)
      rc = usmipc__fail(USMIPC_ENODEV,
                        "no %s device %d in this process (for CUDA, "
                        "CUDA_VISIBLE_DEVICES decides which GPUs a process "
                        "sees); run 'python -m usmipc' to list devices",
                        name, ordinal);
    else if ((rc = first_segment_size(&first)) == 0 &&
             (rc = usmipc_pool_create(dev, first, 0, &pool)) == 0) {
      pthread_mutex_init(&tp->lock, NULL);
      tp->device = dev;
      __atomic_store_n(&tp->pool, pool, __ATOMIC_RELEASE);
    }
  }
  pthread_mutex_unlock(&torch_create_lock);
  if (rc == 0)
    *out = tp;
  return rc;
}

/* Keeps a completed event for a later free, or destroys it. Lock held. */
static void spare_put(torch_pool_t *tp, void *event) {
  if (tp->nspare == tp->spare_cap && tp->spare_cap < TORCH_SPARE_EVENTS) {
    size_t cap = tp->spare_cap ? tp->spare_cap * 2 : 16;
    void **spare = realloc(tp->spare, cap * sizeof(*spare));
    if (spare != NULL) {
      tp->spare = spare;
      tp->spare_cap = cap;
    }
  }
  if (tp->nspare < tp->spare_cap)
    tp->spare[tp->nspare++] = event;
  else
    tp->device->ops->event_destroy(tp->device->native, event);
}

/* Waits on the host until a backend event completed: 1, or a negative
 * code. It polls, as the core's event waits do (yielding for 20 ms, then
 * sleeping 5 us growing to 100 us), but never calls the binding's interrupt
 * handler: a thread of torch may wait here holding the pending list while
 * the thread holding Python's GIL waits for that list. The event's stream
 * is not used: it may be gone by now (an external stream destroyed after
 * the free). */
static int wait_event(usmipc_device_t *dev, void *event) {
  uint64_t start = usmipc__now_ns();
  unsigned sleep_ns = 5000;
  for (;;) {
    int q = dev->ops->event_query(dev->native, event);
    if (q != 0)
      return q;
    if (usmipc__now_ns() - start < 20000000u) {
      sched_yield();
      continue;
    }
    struct timespec ts = {0, (long)sleep_ns};
    nanosleep(&ts, NULL);
    if (sleep_ns < 100000)
      sleep_ns *= 2;
  }
}

/* Hands back to the pool the pending blocks whose events completed; with
 * wait, first waits for each that has not. Events of one
 * stream complete in order, so after one that has not, later ones of the
 * same stream are not asked (up to 8 such streams are remembered). A query
 * that fails (a broken context) counts as complete: waiting longer helps
 * nothing. Returns the first failure of a wait, else 0. Lock held. */
static int reclaim_locked(torch_pool_t *tp, bool wait) {
  usmipc_device_t *dev = tp->device;
  void *busy[8];
  size_t nbusy = 0;
  int rc = 0;
  pending_t **link = &tp->head, *prev = NULL;
  while (*link != NULL) {
    pending_t *p = *link;
    bool known_busy = false;
    for (size_t i = 0; i < nbusy && !known_busy; i++)
      known_busy = busy[i] == p->stream;
    int done = known_busy ? 0 : dev->ops->event_query(dev->native, p->event);
    if (done == 0 && wait) {
      done = wait_event(dev, p->event);
      if (done < 0 && rc == 0)
        rc = done;
    }
    if (done == 0) {
      if (!known_busy && nbusy < USMIPC__ARRAY_SIZE(busy))
        busy[nbusy++] = p->stream;
      prev = p;
      link = &p->next;
      continue;
    }
    *link = p->next;
    if (tp->tail == p)
      tp->tail = prev;
    __atomic_sub_fetch(&tp->npending, 1, __ATOMIC_RELAXED);
    (void)usmipc_free(p->ptr);
    spare_put(tp, p->event);
    free(p);
  }
  return rc;
}

static bool has_pending(torch_pool_t *tp) {
  return __atomic_load_n(&tp->npending, __ATOMIC_RELAXED) != 0;
}

static void *malloc_failed(usmipc_backend_t backend, ssize_t size,
                           int ordinal) {
  usmipc__error_prefix("usmipc_torch_malloc(%zd bytes, %s device %d): ", size,
                       usmipc_backend_name(backend), ordinal);
  return NULL;
}

void *usmipc__torch_malloc_on(usmipc_backend_t backend, ssize_t size,
                              int ordinal, void *stream) {
  (void)stream; /* a block freed after its stream's work suits any stream */
  if (size <= 0) {
    /* torch's own allocator gives NULL for 0 bytes, and so do we. */
    if (size < 0)
      usmipc__fail(USMIPC_EINVAL, "usmipc_torch_malloc: size %zd is negative",
                   size);
    return NULL;
  }
  torch_pool_t *tp;
  if (torch_pool_get(backend, ordinal, &tp) != 0)
    return malloc_failed(backend, size, ordinal);
  if (has_pending(tp)) {
    pthread_mutex_lock(&tp->lock);
    (void)reclaim_locked(tp, false);
    pthread_mutex_unlock(&tp->lock);
  }
  /* Sizes in multiples of the alignment, as torch rounds them: small
   * blocks then leave no slivers between them. */
  size_t n = ((size_t)size + TORCH_ALIGN - 1) & ~(TORCH_ALIGN - 1);
  void *p = NULL;
  int rc = usmipc_pool_malloc(tp->pool, n, TORCH_ALIGN, &p);
  if (rc == USMIPC_ENOMEM && has_pending(tp)) {
    /* Blocks still wait for their streams: wait for them, then retry. */
    pthread_mutex_lock(&tp->lock);
    (void)reclaim_locked(tp, true);
    pthread_mutex_unlock(&tp->lock);
    rc = usmipc_pool_malloc(tp->pool, n, TORCH_ALIGN, &p);
  }
  return rc == 0 ? p : malloc_failed(backend, size, ordinal);
}

void usmipc__torch_free_on(usmipc_backend_t backend, void *ptr, int ordinal,
                           void *stream) {
  if (ptr == NULL)
    return; /* what a 0-byte (or failed) allocation gave */
  torch_pool_t *tp = torch_pool_find(backend, ordinal);
  const usmipc__backend_ops_t *ops = tp ? tp->device->ops : NULL;
  if (ops == NULL || ops->event_record == NULL) {
    /* No pool for this device (not one of our blocks: usmipc_free says
     * so), or a backend whose work is done when its calls return. */
    (void)usmipc_free(ptr);
    return;
  }
  void *native = tp->device->native;
  /* The backend's view of the native stream (on CUDA the CUstream itself);
   * a wrapper only for the time of the record. */
  void *queue = stream;
  bool wrapped =
      ops->queue_wrap == NULL || ops->queue_wrap(native, stream, &queue) == 0;
  pending_t *p = malloc(sizeof(*p));
  pthread_mutex_lock(&tp->lock);
  void *ev = NULL;
  if (tp->nspare > 0)
    ev = tp->spare[--tp->nspare];
  else if (ops->event_create(native, &ev) != 0)
    ev = NULL;
  if (p != NULL && ev != NULL && wrapped &&
      ops->event_record(native, ev, queue) == 0) {
    p->ptr = ptr;
    p->event = ev;
    p->stream = stream;
    p->next = NULL;
    if (tp->tail != NULL)
      tp->tail->next = p;
    else
      tp->head = p;
    tp->tail = p;
    __atomic_add_fetch(&tp->npending, 1, __ATOMIC_RELAXED);
  } else {
    /* The stream's work cannot be marked: wait for it here (a stream the
     * backend cannot even wrap has nothing usmipc could wait for). */
    if (wrapped)
      (void)ops->queue_synchronize(native, queue);
    (void)usmipc_free(ptr);
    if (ev != NULL)
      spare_put(tp, ev);
    free(p);
  }
  if (wrapped && ops->queue_wrap != NULL && ops->queue_unwrap != NULL)
    (void)ops->queue_unwrap(native, queue);
  (void)reclaim_locked(tp, false);
  pthread_mutex_unlock(&tp->lock);
}

int usmipc__torch_pool_for(usmipc_backend_t backend, int ordinal,
                           usmipc_pool_t **pool) {
  if (pool == NULL)
    return usmipc__fail(USMIPC_EINVAL, "usmipc_torch_pool: NULL argument");
  torch_pool_t *tp;
  int rc = torch_pool_get(backend, ordinal, &tp);
  *pool = rc == 0 ? tp->pool : NULL;
  return rc;
}

int usmipc__torch_synchronize_on(usmipc_backend_t backend, int ordinal) {
  torch_pool_t *tp = torch_pool_find(backend, ordinal);
  if (tp == NULL || !has_pending(tp))
    return 0;
  pthread_mutex_lock(&tp->lock);
  int rc = reclaim_locked(tp, true);
  pthread_mutex_unlock(&tp->lock);
  return rc;
}

/* ---- the entry points torch calls (CUDA device ordinals) ----------------- */

void *usmipc_torch_malloc(ssize_t size, int device, void *stream) {
  return usmipc__torch_malloc_on(USMIPC_BACKEND_CUDA, size, device, stream);
}

void usmipc_torch_free(void *ptr, ssize_t size, int device, void *stream) {
  (void)size; /* the pool knows each block's size */
  usmipc__torch_free_on(USMIPC_BACKEND_CUDA, ptr, device, stream);
}

int usmipc_torch_pool(int device, usmipc_pool_t **pool) {
  return usmipc__torch_pool_for(USMIPC_BACKEND_CUDA, device, pool);
}

int usmipc_torch_synchronize(int device) {
  return usmipc__torch_synchronize_on(USMIPC_BACKEND_CUDA, device);
}
