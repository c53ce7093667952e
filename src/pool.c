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
 * a block never spans two segments.
 *
 * Placement: every block starts at a multiple of 256 bytes and takes a
 * multiple of 256 bytes, so no gap a block leaves is too small for another
 * (a 64-byte block once left a 192-byte range that first fit walked past
 * at every later allocation: quadratic). The free ranges of all segments
 * sit in size classes (powers of two, a bitmap of the non-empty ones) and
 * in two hashes keyed by where they start and end, so that allocation and
 * free, coalescing included, cost O(1) however many blocks live.
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
#define POOL_GRANULE ((size_t)256) /* offsets and spans are multiples */
#define POOL_CLASSES 64
/* Ranges of a block's own size class looked at before a larger class's
 * first one (which always fits): a bound, so a class full of ranges a
 * little too small (or misaligned) costs no walk. */
#define POOL_CLASS_SCAN 16

struct segment;

typedef struct range {
  struct segment *seg;
  size_t off, size;                      /* multiples of POOL_GRANULE */
  struct range *class_prev, *class_next; /* its size class, newest first */
  struct range *at_start, *at_end;       /* hash chains */
} range_t;

typedef struct segment {
  usmipc_pool_t *pool;
  void *base;
  size_t size;
  uint64_t buffer_id; /* its region's, with USMIPC__POOL_SEGMENT_ID */
  size_t live;        /* blocks allocated in it */
  struct segment *next;
} segment_t;

typedef struct block {
  uint64_t id;
  segment_t *seg;
  size_t off, size;
  size_t span; /* size rounded up to POOL_GRANULE: what it takes */
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
  /* The free ranges: size classes, class i holding sizes in [2^i, 2^i+1). */
  range_t *classes[POOL_CLASSES];
  uint64_t class_map;       /* bit i: class i is not empty */
  range_t **starts, **ends; /* hashes by (segment, start) and (segment, end) */
  size_t nslots, nranges;
  size_t free_bytes;
  range_t *spare; /* so that splitting a range cannot fail */
  /* Blocks come from slabs of the pool's own, kept until it is destroyed:
   * a million allocations after a million frees touch no new page and call
   * no malloc. */
  struct block_slab *slabs;
  block_t *free_blocks; /* chained by next */
};

#define POOL_SLAB_BLOCKS 4096
typedef struct block_slab {
  struct block_slab *next;
  block_t blocks[POOL_SLAB_BLOCKS];
} block_slab_t;

/* A zeroed block, or NULL; pool lock held. */
static block_t *block_new(usmipc_pool_t *pool) {
  if (pool->free_blocks == NULL) {
    block_slab_t *slab = malloc(sizeof(*slab));
    if (slab == NULL)
      return NULL;
    slab->next = pool->slabs;
    pool->slabs = slab;
    for (size_t i = POOL_SLAB_BLOCKS; i-- > 0;) {
      slab->blocks[i].next = pool->free_blocks;
      pool->free_blocks = &slab->blocks[i];
    }
  }
  block_t *b = pool->free_blocks;
  pool->free_blocks = b->next;
  memset(b, 0, sizeof(*b));
  return b;
}

static void block_release(usmipc_pool_t *pool, block_t *b) {
  b->next = pool->free_blocks;
  pool->free_blocks = b;
}

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

/* The 64 KiB window of p hashed, plus p's granule in it: blocks allocated
 * one after another land in neighbouring buckets, so that a million of
 * them cost no more cache misses each than a thousand; large blocks, one a
 * window, still spread over the whole table. */
static size_t hash_ptr(const void *p, size_t n) {
  uint64_t a = (uint64_t)(uintptr_t)p;
  uint64_t h = ((a >> 16) * 0x9e3779b97f4a7c15ull) >> 24;
  return (size_t)(h + ((a >> 8) & 255)) & (n - 1);
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

static void range_insert(usmipc_pool_t *pool, range_t *r);

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
  /* The region is ours alone until its pointer is handed out: marked
   * without the registry lock held under the pool's (lock order). */
  pthread_mutex_unlock(&pool->lock);
  pthread_mutex_lock(&usmipc__registry_lock);
  usmipc__region_t *r = usmipc__region_find(base);
  r->pool_segment = seg;
  /* Not exported yet, so no handle names the old id. */
  r->buffer_id |= USMIPC__POOL_SEGMENT_ID;
  seg->buffer_id = r->buffer_id;
  pthread_mutex_unlock(&usmipc__registry_lock);
  pthread_mutex_lock(&pool->lock);
  /* Appended, oldest first (pool_get_info walks them). */
  segment_t **tail = &pool->segments;
  while (*tail)
    tail = &(*tail)->next;
  *tail = seg;
  all->seg = seg;
  all->off = 0;
  all->size = size & ~(POOL_GRANULE - 1);
  range_insert(pool, all);
  size_t grown = pool->next_segment * 2;
  pool->next_segment = grown > POOL_MAX_GROWTH ? POOL_MAX_GROWTH : grown;
  if (pool->next_segment < POOL_MIN_SEGMENT)
    pool->next_segment = POOL_MIN_SEGMENT;
  *out = seg;
  return 0;
}

/* ---- free ranges ----------------------------------------------------------
 * Pool lock held throughout. */

static unsigned size_class(size_t size) {
  return 63u - (unsigned)__builtin_clzll((unsigned long long)size);
}

static size_t range_hash(const segment_t *seg, size_t at, size_t n) {
  uint64_t h =
      ((uint64_t)(uintptr_t)seg ^ (uint64_t)at * 0xff51afd7ed558ccdull) *
      0x9e3779b97f4a7c15ull;
  return (size_t)(h >> 23) & (n - 1);
}

/* Doubles the hashes when they hold more ranges than slots; a failed
 * allocation keeps the old ones (longer chains, nothing lost). */
static void ranges_rehash(usmipc_pool_t *pool) {
  size_t n = pool->nslots ? pool->nslots * 2 : 256;
  range_t **starts = calloc(n, sizeof(*starts)),
          **ends = calloc(n, sizeof(*ends));
  if (starts == NULL || ends == NULL) {
    free(starts);
    free(ends);
    return;
  }
  for (size_t i = 0; i < pool->nslots; i++)
    for (range_t *r = pool->starts[i], *next; r; r = next) {
      next = r->at_start;
      size_t hs = range_hash(r->seg, r->off, n),
             he = range_hash(r->seg, r->off + r->size, n);
      r->at_start = starts[hs];
      starts[hs] = r;
      r->at_end = ends[he];
      ends[he] = r;
    }
  free(pool->starts);
  free(pool->ends);
  pool->starts = starts;
  pool->ends = ends;
  pool->nslots = n;
}

static void range_insert(usmipc_pool_t *pool, range_t *r) {
  if (pool->nranges + 1 > pool->nslots)
    ranges_rehash(pool);
  unsigned c = size_class(r->size);
  r->class_prev = NULL;
  r->class_next = pool->classes[c];
  if (r->class_next != NULL)
    r->class_next->class_prev = r;
  pool->classes[c] = r;
  pool->class_map |= (uint64_t)1 << c;
  size_t hs = range_hash(r->seg, r->off, pool->nslots),
         he = range_hash(r->seg, r->off + r->size, pool->nslots);
  r->at_start = pool->starts[hs];
  pool->starts[hs] = r;
  r->at_end = pool->ends[he];
  pool->ends[he] = r;
  pool->nranges++;
  pool->free_bytes += r->size;
}

static void range_unlink(usmipc_pool_t *pool, range_t *r) {
  unsigned c = size_class(r->size);
  if (r->class_prev != NULL)
    r->class_prev->class_next = r->class_next;
  else if ((pool->classes[c] = r->class_next) == NULL)
    pool->class_map &= ~((uint64_t)1 << c);
  if (r->class_next != NULL)
    r->class_next->class_prev = r->class_prev;
  range_t **l = &pool->starts[range_hash(r->seg, r->off, pool->nslots)];
  while (*l != r)
    l = &(*l)->at_start;
  *l = r->at_start;
  l = &pool->ends[range_hash(r->seg, r->off + r->size, pool->nslots)];
  while (*l != r)
    l = &(*l)->at_end;
  *l = r->at_end;
  pool->nranges--;
  pool->free_bytes -= r->size;
}

/* The free range of seg that starts (or ends) at offset at, or NULL. */
static range_t *range_starting(usmipc_pool_t *pool, segment_t *seg, size_t at) {
  range_t *r = pool->starts[range_hash(seg, at, pool->nslots)];
  while (r != NULL && (r->seg != seg || r->off != at))
    r = r->at_start;
  return r;
}

static range_t *range_ending(usmipc_pool_t *pool, segment_t *seg, size_t at) {
  range_t *r = pool->ends[range_hash(seg, at, pool->nslots)];
  while (r != NULL && (r->seg != seg || r->off + r->size != at))
    r = r->at_end;
  return r;
}

/* Where a block of span bytes at alignment (at least the granule) starts in
 * r, aligned as an address (a segment's base may be aligned less than the
 * block), or SIZE_MAX if it does not fit. */
static size_t range_fit(const range_t *r, size_t span, size_t align) {
  uintptr_t base = (uintptr_t)r->seg->base;
  size_t start =
      (size_t)(((base + r->off + align - 1) & ~(uintptr_t)(align - 1)) - base);
  if (start - r->off > r->size || r->size - (start - r->off) < span)
    return SIZE_MAX;
  return start;
}

/* Gives [off, off + size) of seg back, merged with the free neighbours. */
static void pool_give(usmipc_pool_t *pool, segment_t *seg, size_t off,
                      size_t size) {
  range_t *r = range_ending(pool, seg, off);
  if (r != NULL) {
    range_unlink(pool, r);
    off = r->off;
    size += r->size;
  }
  range_t *next = range_starting(pool, seg, off + size);
  if (next != NULL) {
    range_unlink(pool, next);
    size += next->size;
    if (r == NULL)
      r = next;
    else
      free(next);
  }
  if (r == NULL && (r = pool->spare) != NULL)
    pool->spare = NULL;
  if (r == NULL && (r = malloc(sizeof(*r))) == NULL)
    return; /* the space is lost to the pool, nothing worse */
  r->seg = seg;
  r->off = off;
  r->size = size;
  range_insert(pool, r);
}

/* Takes span bytes at alignment: good fit from the size classes. A range of
 * the block's own class if one of the first few fits, else the first range
 * of any larger class that fits (looking a few deep into each class too
 * small to fit always); from the first class whose every range fits (size
 * at least span + align - granule), its first. O(1): at most
 * POOL_CLASS_SCAN ranges per class, and 64 classes. pool->spare must be
 * set. */
static bool pool_take(usmipc_pool_t *pool, size_t span, size_t align,
                      segment_t **seg, size_t *off) {
  size_t sure = span + align - POOL_GRANULE;
  unsigned lo = size_class(span);
  unsigned sure_class = size_class(sure) + ((sure & (sure - 1)) != 0);
  range_t *found = NULL;
  size_t start = SIZE_MAX;
  for (unsigned c = lo; c < sure_class && c < POOL_CLASSES && !found; c++) {
    range_t *r = pool->classes[c];
    for (int k = 0; r != NULL && k < POOL_CLASS_SCAN; k++, r = r->class_next)
      if ((start = range_fit(r, span, align)) != SIZE_MAX) {
        found = r;
        break;
      }
  }
  /* (Each class's first fits unless a segment's base is aligned less than
   * the granule, which no backend does: then the next class is tried.) */
  uint64_t map = sure_class < POOL_CLASSES
                     ? pool->class_map & ~(((uint64_t)1 << sure_class) - 1)
                     : 0;
  for (; found == NULL && map != 0; map &= map - 1)
    if ((start = range_fit(pool->classes[__builtin_ctzll(map)], span, align)) !=
        SIZE_MAX)
      found = pool->classes[__builtin_ctzll(map)];
  if (found == NULL)
    return false;
  *seg = found->seg;
  range_unlink(pool, found);
  size_t before = start - found->off, after = found->size - before - span;
  if (before > 0) { /* the range keeps what lies before the block */
    found->size = before;
    range_insert(pool, found);
    found = NULL;
  }
  if (after > 0) { /* ... and what lies after, in it or in the spare */
    range_t *tail = found;
    if (tail == NULL) {
      tail = pool->spare;
      pool->spare = NULL;
    }
    tail->seg = *seg;
    tail->off = start + span;
    tail->size = after;
    range_insert(pool, tail);
  } else {
    free(found); /* taken whole (NULL when split before) */
  }
  *off = start;
  return true;
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
  /* A multiple of the granule, at an alignment of at least the granule:
   * what the block leaves free stays usable (see the top of the file). */
  size_t span = (nbytes + POOL_GRANULE - 1) & ~(POOL_GRANULE - 1);
  if (alignment < POOL_GRANULE)
    alignment = POOL_GRANULE;
  pthread_mutex_lock(&pool->lock);
  int rc = 0;
  if (pool->spare == NULL && (pool->spare = malloc(sizeof(range_t))) == NULL)
    rc = usmipc__fail(USMIPC_ENOMEM, "out of memory");
  segment_t *seg = NULL;
  size_t off = SIZE_MAX;
  if (rc == 0 && !pool_take(pool, span, alignment, &seg, &off)) {
    rc = segment_new(pool, span + alignment, &seg);
    /* The lock was dropped meanwhile: another thread may have taken the
     * spare, or the new segment. */
    if (rc == 0 && pool->spare == NULL &&
        (pool->spare = malloc(sizeof(range_t))) == NULL)
      rc = usmipc__fail(USMIPC_ENOMEM, "out of memory");
    if (rc == 0 && !pool_take(pool, span, alignment, &seg, &off))
      rc = usmipc__fail(USMIPC_ENOMEM, "out of memory");
  }
  if (rc == 0 && pool->nblocks + 1 > pool->nbuckets)
    rc = hash_grow(pool);
  block_t *b = rc == 0 ? block_new(pool) : NULL;
  if (rc == 0 && b == NULL)
    rc = usmipc__fail(USMIPC_ENOMEM, "out of memory");
  if (rc != 0) {
    if (off != SIZE_MAX)
      pool_give(pool, seg, off, span);
    pthread_mutex_unlock(&pool->lock);
    return rc;
  }
  b->id = usmipc__new_buffer_id();
  b->seg = seg;
  b->off = off;
  b->size = nbytes;
  b->span = span;
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
  pool_give(pool, b->seg, b->off, b->span);
  block_release(pool, b);
  pthread_mutex_unlock(&pool->lock);
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
    free(seg);
    seg = next;
  }
  free(pool->buckets);
  for (size_t i = 0; i < pool->nslots; i++) /* each range is in one chain */
    for (range_t *r = pool->starts[i], *next; r; r = next) {
      next = r->at_start;
      free(r);
    }
  free(pool->starts);
  free(pool->ends);
  free(pool->spare);
  for (block_slab_t *slab = pool->slabs, *next; slab; slab = next) {
    next = slab->next;
    free(slab);
  }
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
    uint8_t bound[16];
    rc = usmipc__random(b->token, 16);
    usmipc__pool_block_slot_token(b->token, seg->buffer_id, b->off, b->size,
                                  bound);
    if (rc == 0)
      rc = usmipc__exports_add(b->id, UINT32_MAX, b->size,
                               usmipc__slot_tag(usmipc__self()->key, bound),
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

void usmipc__pool_block_slot_token(const uint8_t token[16], uint64_t segment_id,
                                   uint64_t offset, uint64_t size,
                                   uint8_t out[16]) {
  /* A MAC keyed by the record's token: whoever edits the segment, offset or
   * size of a record (or moves a record to another segment) would need
   * another token with the same slot tag. */
  uint8_t msg[16 + 24];
  memcpy(msg, "usmipc-poolblk-1", 16);
  usmipc__put64le(msg + 16, segment_id);
  usmipc__put64le(msg + 24, offset);
  usmipc__put64le(msg + 32, size);
  usmipc__mac(out, token, msg, sizeof(msg));
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

void usmipc__pool_free_space(usmipc_pool_t *pool, size_t *bytes,
                             size_t *ranges) {
  pthread_mutex_lock(&pool->lock);
  *bytes = pool->free_bytes;
  *ranges = pool->nranges;
  pthread_mutex_unlock(&pool->lock);
}
