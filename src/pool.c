/* IPC memory pools: many buffers at the cost of one.
 *
 * A pool hands out blocks of a few large allocations, its segments. Each
 * segment is an ordinary usmipc allocation (any backend's device memory),
 * exported once: one descriptor, one driver import per importer. A block's
 * handle is the segment's handle narrowed to the block, plus a block record
 * (0x8101) naming the block's own export-table slot, so that an importer
 * refuses a freed block although the segment stays mapped, and a block
 * allocated later at the same place (a new id and token) is not mistaken
 * for it. The importer maps a segment at its first block; every later open
 * of a block in it is a cache hit plus one slot check.
 *
 * Growth: the first segment has the pool's capacity (64 MiB when 0), each
 * next one twice the last, up to 1 GiB, and always enough for the request:
 * a block never spans two segments. Blocks are placed first fit in a
 * segment's free list (sorted by offset; neighbours coalesce on free).
 *
 * The trust unit is the segment: whoever holds a block's handle maps the
 * whole segment (the block record only decides what usmipc opens). Users
 * who need separation use separate pools.
 *
 * Locks: the pool's own mutex guards its segments and blocks; it is taken
 * without the registry lock held, and takes the export table's inside. */
#include <stdlib.h>
#include <string.h>

#include "blake2s.h"
#include "common.h"

#define POOL_MIN_SEGMENT ((size_t)64 << 20)
#define POOL_MAX_GROWTH ((size_t)1 << 30)
#define POOL_DEFAULT_ALIGN 256

typedef struct range {
  size_t off, size;
  struct range *next;
} range_t;

typedef struct segment {
  usmipc_pool_t *pool;
  void *base;
  size_t size;
  range_t *free; /* sorted by offset, coalesced */
  size_t live;   /* blocks allocated in it */
  struct segment *next;
} segment_t;

typedef struct block {
  uint64_t id;
  segment_t *seg;
  size_t off, size;
  bool exported;
  uint32_t slot;
  uint8_t token[16];
  struct block *next; /* hash chain, keyed by address */
} block_t;

struct usmipc_pool {
  usmipc_device_t *device;
  unsigned flags;
  pthread_mutex_t lock;
  struct usmipc_pool *live_prev, *live_next; /* the live pools, for fork */
  size_t next_segment;
  segment_t *segments;
  block_t **buckets;
  size_t nbuckets, nblocks;
  size_t block_bytes; /* the sizes of the live blocks, summed */
};

/* Every live pool, so that fork() can take their locks: a child forked
 * while another thread held a pool's lock would inherit it held, and its
 * first allocation from that pool would wait forever. In the library's lock
 * order the pools come after the registry (an export holds the registry
 * lock when it asks the pool for its block) and before the export table (a
 * pool lock is held while a block's slot is added or removed). */
static pthread_mutex_t live_pools_lock = PTHREAD_MUTEX_INITIALIZER;
static usmipc_pool_t *live_pools;

void usmipc__pools_fork_prepare(void) {
  pthread_mutex_lock(&live_pools_lock);
  for (usmipc_pool_t *p = live_pools; p; p = p->live_next)
    pthread_mutex_lock(&p->lock);
}

void usmipc__pools_fork_parent(void) {
  for (usmipc_pool_t *p = live_pools; p; p = p->live_next)
    pthread_mutex_unlock(&p->lock);
  pthread_mutex_unlock(&live_pools_lock);
}

void usmipc__pools_fork_child(void) { usmipc__pools_fork_parent(); }

static size_t hash_ptr(const void *p, size_t n) {
  uint64_t h = (uint64_t)(uintptr_t)p * 0x9e3779b97f4a7c15ull;
  return (size_t)(h >> 17) & (n - 1);
}

static block_t *block_at(usmipc_pool_t *pool, const void *p) {
  for (block_t *b = pool->buckets[hash_ptr(p, pool->nbuckets)]; b; b = b->next)
    if ((const uint8_t *)b->seg->base + b->off == (const uint8_t *)p)
      return b;
  return NULL;
}

/* The block containing p (an interior pointer): a scan, which only the
 * export of an interior pointer pays. */
static block_t *block_containing(usmipc_pool_t *pool, const void *p) {
  block_t *b = block_at(pool, p);
  if (b != NULL)
    return b;
  for (size_t i = 0; i < pool->nbuckets; i++)
    for (b = pool->buckets[i]; b; b = b->next) {
      const uint8_t *start = (const uint8_t *)b->seg->base + b->off;
      if ((const uint8_t *)p >= start && (const uint8_t *)p < start + b->size)
        return b;
    }
  return NULL;
}

static int hash_grow(usmipc_pool_t *pool) {
  size_t n = pool->nbuckets ? pool->nbuckets * 2 : 1024;
  block_t **buckets = calloc(n, sizeof(*buckets));
  if (buckets == NULL)
    return usmipc__fail(USMIPC_ENOMEM, "out of memory");
  for (size_t i = 0; i < pool->nbuckets; i++)
    for (block_t *b = pool->buckets[i], *next; b; b = next) {
      next = b->next;
      size_t h = hash_ptr((uint8_t *)b->seg->base + b->off, n);
      b->next = buckets[h];
      buckets[h] = b;
    }
  free(pool->buckets);
  pool->buckets = buckets;
  pool->nbuckets = n;
  return 0;
}

int usmipc_pool_create(usmipc_device_t *device, size_t capacity, unsigned flags,
                       usmipc_pool_t **out) {
  if (device == NULL || out == NULL)
    return usmipc__fail(USMIPC_EINVAL, "usmipc_pool_create: NULL argument");
  *out = NULL;
  if ((flags & ~(USMIPC_ALLOC_IPC_FD | USMIPC_ALLOC_IPC_NATIVE)) != 0 ||
      flags == (USMIPC_ALLOC_IPC_FD | USMIPC_ALLOC_IPC_NATIVE))
    return usmipc__fail(USMIPC_EINVAL,
                        "usmipc_pool_create: flags 0x%x are unknown or "
                        "contradict each other (USMIPC_ALLOC_IPC_FD or "
                        "USMIPC_ALLOC_IPC_NATIVE or 0)",
                        flags);
  usmipc_pool_t *pool = calloc(1, sizeof(*pool));
  if (pool == NULL)
    return usmipc__fail(USMIPC_ENOMEM, "out of memory");
  pool->device = device;
  pool->flags = flags;
  pool->next_segment = capacity ? capacity : POOL_MIN_SEGMENT;
  pthread_mutex_init(&pool->lock, NULL);
  int rc = hash_grow(pool);
  if (rc != 0) {
    free(pool);
    return rc;
  }
  pthread_mutex_lock(&live_pools_lock);
  pool->live_next = live_pools;
  if (live_pools != NULL)
    live_pools->live_prev = pool;
  live_pools = pool;
  pthread_mutex_unlock(&live_pools_lock);
  *out = pool;
  return 0;
}

/* A new segment of at least need bytes; pool lock held, and dropped while
 * the segment is allocated (the lock order is registry, then pool: an
 * export holds the registry lock when it asks the pool for its block). */
static int segment_new(usmipc_pool_t *pool, size_t need, segment_t **out) {
  size_t size = pool->next_segment;
  if (size < need)
    size = need;
  void *base;
  pthread_mutex_unlock(&pool->lock);
  int rc = usmipc_malloc_flags(pool->device, USMIPC_MEM_DEVICE, size,
                               pool->flags, &base);
  pthread_mutex_lock(&pool->lock);
  if (rc != 0) {
    usmipc__error_prefix("growing a pool by a %zu-byte segment: ", size);
    return rc;
  }
  segment_t *seg = calloc(1, sizeof(*seg));
  range_t *all = calloc(1, sizeof(*all));
  if (seg == NULL || all == NULL) {
    free(seg);
    free(all);
    usmipc_free(base);
    return usmipc__fail(USMIPC_ENOMEM, "out of memory");
  }
  seg->pool = pool;
  seg->base = base;
  seg->size = size;
  all->off = 0;
  all->size = size;
  seg->free = all;
  /* The region is ours alone until its pointer is handed out: marked
   * without the registry lock held under the pool's (lock order). */
  pthread_mutex_unlock(&pool->lock);
  pthread_mutex_lock(&usmipc__registry_lock);
  usmipc__region_t *r = usmipc__region_find(base);
  r->pool_segment = seg;
  pthread_mutex_unlock(&usmipc__registry_lock);
  pthread_mutex_lock(&pool->lock);
  /* Appended: first fit walks the segments oldest first, so freed space
   * of the first segments is taken again before new segments fill. */
  segment_t **tail = &pool->segments;
  while (*tail)
    tail = &(*tail)->next;
  *tail = seg;
  size_t grown = pool->next_segment * 2;
  pool->next_segment = grown > POOL_MAX_GROWTH ? POOL_MAX_GROWTH : grown;
  if (pool->next_segment < POOL_MIN_SEGMENT)
    pool->next_segment = POOL_MIN_SEGMENT;
  *out = seg;
  return 0;
}

/* First fit of nbytes at alignment in seg: the offset, or SIZE_MAX. */
static size_t segment_take(segment_t *seg, size_t nbytes, size_t align) {
  for (range_t **l = &seg->free; *l; l = &(*l)->next) {
    range_t *r = *l;
    size_t start = (r->off + align - 1) & ~(align - 1);
    if (start < r->off || start - r->off > r->size ||
        r->size - (start - r->off) < nbytes)
      continue;
    size_t before = start - r->off, after = r->size - before - nbytes;
    if (before == 0 && after == 0) {
      *l = r->next;
      free(r);
    } else if (before == 0) {
      r->off += nbytes;
      r->size = after;
    } else if (after == 0) {
      r->size = before;
    } else {
      range_t *tail = malloc(sizeof(*tail));
      if (tail == NULL)
        return SIZE_MAX;
      tail->off = start + nbytes;
      tail->size = after;
      tail->next = r->next;
      r->size = before;
      r->next = tail;
    }
    return start;
  }
  return SIZE_MAX;
}

static void segment_give(segment_t *seg, size_t off, size_t size) {
  range_t **l = &seg->free, *prev = NULL;
  while (*l && (*l)->off < off) {
    prev = *l;
    l = &(*l)->next;
  }
  range_t *next = *l;
  if (prev && prev->off + prev->size == off) {
    prev->size += size;
    if (next && prev->off + prev->size == next->off) {
      prev->size += next->size;
      prev->next = next->next;
      free(next);
    }
    return;
  }
  if (next && off + size == next->off) {
    next->off = off;
    next->size += size;
    return;
  }
  range_t *r = malloc(sizeof(*r));
  if (r == NULL)
    return; /* the space is lost to the pool, nothing worse */
  r->off = off;
  r->size = size;
  r->next = next;
  *l = r;
}

int usmipc_pool_malloc(usmipc_pool_t *pool, size_t nbytes, size_t alignment,
                       void **ptr) {
  if (pool == NULL || ptr == NULL)
    return usmipc__fail(USMIPC_EINVAL, "usmipc_pool_malloc: NULL argument");
  *ptr = NULL;
  if (nbytes == 0)
    return usmipc__fail(USMIPC_EINVAL,
                        "usmipc_pool_malloc: cannot allocate 0 bytes; ask for "
                        "at least one");
  if (alignment == 0)
    alignment = POOL_DEFAULT_ALIGN;
  if ((alignment & (alignment - 1)) != 0 || alignment > ((size_t)1 << 21))
    return usmipc__fail(USMIPC_EINVAL,
                        "usmipc_pool_malloc: alignment %zu is not a power of "
                        "two up to 2 MiB",
                        alignment);
  if (nbytes > ((size_t)1 << 46))
    return usmipc__fail(USMIPC_ENOMEM,
                        "usmipc_pool_malloc: %zu bytes is more than any "
                        "device holds",
                        nbytes);
  block_t *b = calloc(1, sizeof(*b));
  if (b == NULL)
    return usmipc__fail(USMIPC_ENOMEM, "out of memory");
  pthread_mutex_lock(&pool->lock);
  size_t off = SIZE_MAX;
  segment_t *seg;
  for (seg = pool->segments; seg && off == SIZE_MAX;
       seg = off == SIZE_MAX ? seg->next : seg)
    off = segment_take(seg, nbytes, alignment);
  int rc = 0;
  if (off == SIZE_MAX) {
    rc = segment_new(pool, nbytes + alignment, &seg);
    if (rc == 0)
      off = segment_take(seg, nbytes, alignment);
    if (rc == 0 && off == SIZE_MAX)
      rc = usmipc__fail(USMIPC_ENOMEM, "out of memory");
  }
  if (rc == 0 && pool->nblocks + 1 > pool->nbuckets)
    rc = hash_grow(pool);
  if (rc != 0) {
    if (off != SIZE_MAX)
      segment_give(seg, off, nbytes);
    pthread_mutex_unlock(&pool->lock);
    free(b);
    return rc;
  }
  b->id = usmipc__new_buffer_id();
  b->seg = seg;
  b->off = off;
  b->size = nbytes;
  b->slot = USMIPC__NO_SLOT;
  void *p = (uint8_t *)seg->base + off;
  size_t h = hash_ptr(p, pool->nbuckets);
  b->next = pool->buckets[h];
  pool->buckets[h] = b;
  pool->nblocks++;
  pool->block_bytes += nbytes;
  seg->live++;
  pthread_mutex_unlock(&pool->lock);
  *ptr = p;
  return 0;
}

int usmipc__pool_free(void *segment, void *ptr) {
  segment_t *seg = segment;
  usmipc_pool_t *pool = seg->pool;
  pthread_mutex_lock(&pool->lock);
  block_t **l = &pool->buckets[hash_ptr(ptr, pool->nbuckets)];
  while (*l && (uint8_t *)(*l)->seg->base + (*l)->off != (uint8_t *)ptr)
    l = &(*l)->next;
  block_t *b = *l;
  if (b == NULL) {
    pthread_mutex_unlock(&pool->lock);
    return usmipc__fail(USMIPC_EINVAL,
                        "usmipc_free: %p lies in a pool but is not the start "
                        "of a live block (already freed, or an interior "
                        "pointer)",
                        ptr);
  }
  *l = b->next;
  pool->nblocks--;
  pool->block_bytes -= b->size;
  b->seg->live--;
  /* Importers refuse the block from now on (its slot is cleared); the
   * space may be handed out again at once: a new block has a new id. */
  if (b->exported)
    usmipc__exports_remove(b->slot);
  segment_give(b->seg, b->off, b->size);
  pthread_mutex_unlock(&pool->lock);
  free(b);
  return 0;
}

int usmipc_pool_get_info(usmipc_pool_t *pool, usmipc_pool_info_t *out,
                         size_t size) {
  if (pool == NULL || out == NULL || size == 0)
    return usmipc__fail(USMIPC_EINVAL,
                        "usmipc_pool_get_info: NULL argument or size 0");
  usmipc_pool_info_t info = {0};
  pthread_mutex_lock(&pool->lock);
  for (segment_t *seg = pool->segments; seg; seg = seg->next) {
    info.segments++;
    info.segment_bytes += seg->size;
  }
  info.blocks = pool->nblocks;
  info.block_bytes = pool->block_bytes;
  pthread_mutex_unlock(&pool->lock);
  /* A caller built against an older, shorter struct gets its prefix. */
  memset(out, 0, size);
  memcpy(out, &info, size < sizeof(info) ? size : sizeof(info));
  return 0;
}

int usmipc_pool_destroy(usmipc_pool_t *pool) {
  if (pool == NULL)
    return 0;
  pthread_mutex_lock(&pool->lock);
  if (pool->nblocks > 0) {
    size_t n = pool->nblocks;
    pthread_mutex_unlock(&pool->lock);
    return usmipc__fail(USMIPC_EBUSY,
                        "usmipc_pool_destroy: %zu blocks of the pool are "
                        "still allocated; free them first",
                        n);
  }
  segment_t *seg = pool->segments;
  pool->segments = NULL;
  pthread_mutex_unlock(&pool->lock);
  pthread_mutex_lock(&live_pools_lock);
  if (pool->live_prev != NULL)
    pool->live_prev->live_next = pool->live_next;
  else
    live_pools = pool->live_next;
  if (pool->live_next != NULL)
    pool->live_next->live_prev = pool->live_prev;
  pthread_mutex_unlock(&live_pools_lock);
  while (seg) {
    segment_t *next = seg->next;
    pthread_mutex_lock(&usmipc__registry_lock);
    usmipc__region_t *r = usmipc__region_find(seg->base);
    if (r != NULL)
      r->pool_segment = NULL;
    pthread_mutex_unlock(&usmipc__registry_lock);
    usmipc_free(seg->base); /* importers keep their mappings */
    for (range_t *f = seg->free, *fn; f; f = fn) {
      fn = f->next;
      free(f);
    }
    free(seg);
    seg = next;
  }
  free(pool->buckets);
  pthread_mutex_destroy(&pool->lock);
  free(pool);
  return 0;
}

int usmipc__pool_export(void *segment, const void *ptr, size_t *nbytes,
                        uint8_t *rec, size_t *rec_len) {
  segment_t *seg = segment;
  usmipc_pool_t *pool = seg->pool;
  pthread_mutex_lock(&pool->lock);
  block_t *b = block_containing(pool, ptr);
  int rc = 0;
  if (b == NULL || b->seg != seg) {
    rc = usmipc__fail(USMIPC_EUNKNOWNPTR,
                      "cannot export %p: it lies in a pool segment but in "
                      "no live block (freed?)",
                      ptr);
  } else {
    size_t in =
        (size_t)((const uint8_t *)ptr - ((const uint8_t *)seg->base + b->off));
    if (*nbytes == 0)
      *nbytes = b->size - in;
    if (*nbytes > b->size - in)
      rc = usmipc__fail(USMIPC_ERANGE,
                        "cannot export %zu bytes at offset %zu of a %zu-byte "
                        "pool block",
                        *nbytes, in, b->size);
  }
  if (rc == 0 && !b->exported) {
    rc = usmipc__random(b->token, 16);
    if (rc == 0)
      rc = usmipc__exports_add(b->id, UINT32_MAX, b->size,
                               usmipc__slot_tag(usmipc__self()->key, b->token),
                               &b->slot, &(uint32_t){0});
    b->exported = rc == 0;
  }
  if (rc == 0) {
    /* Record 0x8101: u64 block id, u32 slot, u32 0, 16 token, u64 block
     * offset in the segment, u64 block size. */
    uint8_t *r = rec + 4;
    usmipc__put16le(rec, USMIPC__EXT_BLOCK);
    usmipc__put16le(rec + 2, USMIPC__BLOCK_RECORD_LEN);
    memset(r, 0, USMIPC__BLOCK_RECORD_LEN);
    usmipc__put64le(r, b->id);
    usmipc__put32le(r + 8, b->slot);
    memcpy(r + 16, b->token, 16);
    usmipc__put64le(r + 32, b->off);
    usmipc__put64le(r + 40, b->size);
    *rec_len = 4 + USMIPC__BLOCK_RECORD_LEN;
  }
  pthread_mutex_unlock(&pool->lock);
  return rc;
}

int usmipc__pool_block_live(void *segment, const usmipc__wire_t *w) {
  segment_t *seg = segment;
  usmipc_pool_t *pool = seg->pool;
  pthread_mutex_lock(&pool->lock);
  block_t *b = block_at(pool, (uint8_t *)seg->base + w->block_offset);
  int live = b != NULL && b->seg == seg && b->id == w->block_id &&
             b->exported && b->slot == w->block_slot &&
             b->size == w->block_size &&
             usmipc__ct_equal(b->token, w->block_token, 16);
  pthread_mutex_unlock(&pool->lock);
  return live;
}

int usmipc__pool_query(void *segment, const void *ptr,
                       usmipc_pointer_info_t *info) {
  segment_t *seg = segment;
  usmipc_pool_t *pool = seg->pool;
  pthread_mutex_lock(&pool->lock);
  block_t *b = block_containing(pool, ptr);
  if (b != NULL && b->seg == seg) {
    info->base = (uint8_t *)seg->base + b->off;
    info->size = b->size;
    info->buffer_id = b->id;
  }
  pthread_mutex_unlock(&pool->lock);
  if (b == NULL || b->seg != seg) {
    memset(info, 0, sizeof(*info));
    return usmipc__fail(USMIPC_EUNKNOWNPTR,
                        "pointer %p lies in a pool segment but in no live "
                        "block (freed, or never allocated)",
                        ptr);
  }
  return 0;
}
