/* The export table: which allocations a process still exports, in a memfd
 * that importers map read-only.
 *
 * Why: a handle can outlive the allocation it names. Driver handles (CUDA's
 * cuIpcGetMemHandle) are bearer tokens that the driver may still accept
 * after the exporter freed the memory (it keeps small allocations in larger
 * chunks), and a descriptor number fetched with pidfd_getfd(2) may have been
 * closed and reused for another allocation; CUDA's exported descriptors all
 * share one anonymous inode, so (st_dev, st_ino) cannot tell them apart. The
 * exporter alone knows what is live, and asking its broker on every first
 * open costs a socket round trip. So each exporter keeps one slot per
 * exported allocation, {buffer id, descriptor number, size}, guarded by a
 * sequence counter (a seqlock), in a shared mapping. An importer fetches the
 * table once per exporter (through the fd transport, so the same uid and ptrace
 * rules apply) and from then on checks a handle with two memory reads.
 *
 * Slot protocol, for one writer (under table_lock) and any readers:
 *   writer: seq++ (odd: changing), store fields, seq++ (even: stable)
 *   reader: s1 = seq (retry while odd), load fields, s2 = seq, retry if s1!=s2
 * A slot is cleared before its descriptor is closed, so a reader that sees
 * the same even seq before and after pidfd_getfd knows the descriptor it
 * took was the one the slot names.
 */
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "../common.h"

typedef struct export_slot {
  uint32_t seq;
  uint32_t fd_number;
  uint64_t buffer_id; /* 0: free */
  uint64_t size;      /* the allocation's size, which a handle must state */
  uint64_t reserved;
} export_slot_t;
_Static_assert(sizeof(export_slot_t) == 32, "slots are 32 bytes on the wire");

/* 1 Mi slots = 32 MiB of address space; pages are touched only as slots are
 * used, so a process exporting a hundred buffers costs one page. */
#define TABLE_SLOTS (1u << 20)
#define TABLE_BYTES ((size_t)TABLE_SLOTS * sizeof(export_slot_t))
#define IMPORT_TABLES_MAX 64

/* ---- the exporter's side ---------------------------------------------------
 */

static pthread_mutex_t table_lock = PTHREAD_MUTEX_INITIALIZER;
static export_slot_t *table; /* this process's table, read-write */
static int table_fd = -1;
static uint32_t *free_slots; /* stack of released slot indices */
static size_t free_count, free_capacity;
static uint32_t next_unused;
static pthread_once_t exports_once = PTHREAD_ONCE_INIT;

/* ---- the importer's side
 * ----------------------------------------------------- */

typedef struct import_table {
  uint32_t pid;
  uint64_t nonce;
  const export_slot_t *slots;
  uint64_t last_use;
} import_table_t;

static import_table_t imported[IMPORT_TABLES_MAX];
static uint64_t use_clock;

void usmipc__exports_fork_prepare(void) { pthread_mutex_lock(&table_lock); }
void usmipc__exports_fork_parent(void) { pthread_mutex_unlock(&table_lock); }
/* The child must never write the parent's table: it drops it and makes its
 * own on its next export. Tables of other exporters stay valid. */
void usmipc__exports_fork_child(void) {
  pthread_mutex_init(&table_lock, NULL);
  if (table != NULL)
    munmap(table, TABLE_BYTES);
  if (table_fd >= 0)
    close(table_fd);
  table = NULL;
  table_fd = -1;
  free_count = 0;
  next_unused = 0;
}

static void exports_init(void) {}

void usmipc__exports_table_name(uint32_t pid, uint64_t nonce, char *out,
                                size_t len) {
  snprintf(out, len, "usmipc-exports.%u.%016llx", pid,
           (unsigned long long)nonce);
}

/* Called with table_lock held. */
static int table_create(void) {
  if (table != NULL)
    return 0;
  const usmipc__process_t *self = usmipc__self();
  char name[64];
  usmipc__exports_table_name(self->pid, self->nonce, name, sizeof(name));
  int fd = memfd_create(name, MFD_CLOEXEC);
  if (fd < 0)
    return usmipc__fail_native(USMIPC_ETRANSPORT, errno,
                               "cannot create the export table: %s",
                               strerror(errno));
  void *p = MAP_FAILED;
  if (ftruncate(fd, (off_t)TABLE_BYTES) == 0)
    p = mmap(NULL, TABLE_BYTES, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    int e = errno;
    close(fd);
    return usmipc__fail_native(USMIPC_ETRANSPORT, e,
                               "cannot map the export table: %s", strerror(e));
  }
  table = p;
  table_fd = fd;
  return 0;
}

static void slot_write(export_slot_t *s, uint64_t buffer_id, uint32_t fd_number,
                       uint64_t size) {
  uint32_t seq = __atomic_load_n(&s->seq, __ATOMIC_RELAXED);
  __atomic_store_n(&s->seq, seq + 1, __ATOMIC_RELAXED);
  __atomic_thread_fence(__ATOMIC_RELEASE);
  __atomic_store_n(&s->fd_number, fd_number, __ATOMIC_RELAXED);
  __atomic_store_n(&s->buffer_id, buffer_id, __ATOMIC_RELAXED);
  __atomic_store_n(&s->size, size, __ATOMIC_RELAXED);
  __atomic_store_n(&s->seq, seq + 2, __ATOMIC_RELEASE);
}

int usmipc__exports_add(uint64_t buffer_id, uint32_t fd_number, uint64_t size,
                        uint32_t *slot, uint32_t *table_fd_number) {
  pthread_once(&exports_once, exports_init);
  pthread_mutex_lock(&table_lock);
  int rc = table_create();
  if (rc == 0) {
    uint32_t at;
    if (free_count > 0) {
      at = free_slots[--free_count];
    } else if (next_unused < TABLE_SLOTS) {
      at = next_unused++;
    } else {
      pthread_mutex_unlock(&table_lock);
      return usmipc__fail(USMIPC_ENOMEM,
                          "this process already exports %u allocations, the "
                          "most one process can; free some first",
                          TABLE_SLOTS);
    }
    slot_write(&table[at], buffer_id, fd_number, size);
    *slot = at;
    *table_fd_number = (uint32_t)table_fd;
  }
  pthread_mutex_unlock(&table_lock);
  return rc;
}

void usmipc__exports_remove(uint32_t slot) {
  pthread_mutex_lock(&table_lock);
  if (table != NULL && slot < next_unused) {
    slot_write(&table[slot], 0, UINT32_MAX, 0);
    if (free_count == free_capacity) {
      size_t cap = free_capacity ? free_capacity * 2 : 256;
      void *grown = realloc(free_slots, cap * sizeof(*free_slots));
      if (grown != NULL) {
        free_slots = grown;
        free_capacity = cap;
      }
    }
    if (free_count < free_capacity) /* else the slot is leaked, not reused */
      free_slots[free_count++] = slot;
  }
  pthread_mutex_unlock(&table_lock);
}

int usmipc__exports_table_fd(void) {
  pthread_mutex_lock(&table_lock);
  int fd = table_fd;
  pthread_mutex_unlock(&table_lock);
  return fd;
}

/* ---- checking a handle in an importer ------------------------------------ */

/* The exporter's table, mapped read-only; fetched on first use. Called with
 * table_lock held; drops it while fetching, which may wait on the exporter.
 * NULL on failure, with the code in *rc. */
static const export_slot_t *table_of(const usmipc__wire_t *w, int *rc_out) {
  import_table_t *lru = &imported[0];
  for (int i = 0; i < IMPORT_TABLES_MAX; i++) {
    import_table_t *t = &imported[i];
    if (t->slots != NULL && t->pid == w->pid && t->nonce == w->nonce) {
      t->last_use = ++use_clock;
      return t->slots;
    }
    if (t->slots == NULL || (lru->slots != NULL && t->last_use < lru->last_use))
      lru = t;
  }
  pthread_mutex_unlock(&table_lock);
  int fd = -1;
  int rc = usmipc__fdxfer_fetch_table(w, &fd);
  void *p = MAP_FAILED;
  if (rc == 0) {
    struct stat st;
    if (fstat(fd, &st) == 0 && (size_t)st.st_size == TABLE_BYTES)
      p = mmap(NULL, TABLE_BYTES, PROT_READ, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED)
      rc = usmipc__fail(USMIPC_ETRANSPORT,
                        "process %u's export table is not mappable", w->pid);
    close(fd);
  }
  pthread_mutex_lock(&table_lock);
  *rc_out = rc;
  if (rc != 0)
    return NULL;
  /* Another thread may have mapped it meanwhile; keep one. */
  for (int i = 0; i < IMPORT_TABLES_MAX; i++) {
    import_table_t *t = &imported[i];
    if (t->slots != NULL && t->pid == w->pid && t->nonce == w->nonce) {
      munmap(p, TABLE_BYTES);
      return t->slots;
    }
  }
  if (lru->slots != NULL)
    munmap((void *)lru->slots, TABLE_BYTES);
  lru->pid = w->pid;
  lru->nonce = w->nonce;
  lru->slots = p;
  lru->last_use = ++use_clock;
  return p;
}

int usmipc__exports_check(const usmipc__wire_t *w, uint32_t *seq_out) {
  pthread_once(&exports_once, exports_init);
  if (w->export_slot >= TABLE_SLOTS)
    return usmipc__fail(USMIPC_EBADHANDLE,
                        "not a valid usmipc IPC handle: export slot %u is out "
                        "of range",
                        w->export_slot);
  pthread_mutex_lock(&table_lock);
  int rc = 0;
  const export_slot_t *slots = table_of(w, &rc);
  if (slots == NULL) {
    pthread_mutex_unlock(&table_lock);
    return rc; /* message set by the fetch */
  }
  const export_slot_t *s = &slots[w->export_slot];
  uint32_t s1, s2, fd_number;
  uint64_t buffer_id, size;
  unsigned spins = 0;
  do {
    /* An odd count is a write in progress: microseconds at most, unless the
     * exporter died in the middle of it. */
    while ((s1 = __atomic_load_n(&s->seq, __ATOMIC_ACQUIRE)) & 1) {
      if (++spins > (1u << 24)) {
        pthread_mutex_unlock(&table_lock);
        return usmipc__fail(USMIPC_EEXPORTERGONE,
                            "process %u's export table is stuck mid-update; "
                            "the exporter probably died",
                            w->pid);
      }
    }
    fd_number = __atomic_load_n(&s->fd_number, __ATOMIC_RELAXED);
    buffer_id = __atomic_load_n(&s->buffer_id, __ATOMIC_RELAXED);
    size = __atomic_load_n(&s->size, __ATOMIC_RELAXED);
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
    s2 = __atomic_load_n(&s->seq, __ATOMIC_RELAXED);
  } while (s1 != s2);
  pthread_mutex_unlock(&table_lock);
  if (buffer_id != w->buffer_id ||
      ((w->flags & USMIPC__WIRE_FLAG_FD) && fd_number != w->fd_number))
    return usmipc__fail(USMIPC_EEXPORTERGONE,
                        "process %u no longer exports the memory this handle "
                        "names (the allocation was freed)",
                        w->pid);
  if (size != w->allocation_size)
    return usmipc__fail(USMIPC_EBADHANDLE,
                        "not a valid usmipc IPC handle: it claims a %llu-byte "
                        "allocation, but process %u exported %llu bytes",
                        (unsigned long long)w->allocation_size, w->pid,
                        (unsigned long long)size);
  *seq_out = s1;
  return 0;
}

int usmipc__exports_recheck(const usmipc__wire_t *w, uint32_t seq) {
  pthread_mutex_lock(&table_lock);
  const export_slot_t *slots = NULL;
  for (int i = 0; i < IMPORT_TABLES_MAX; i++)
    if (imported[i].slots != NULL && imported[i].pid == w->pid &&
        imported[i].nonce == w->nonce)
      slots = imported[i].slots;
  uint32_t now =
      slots ? __atomic_load_n(&slots[w->export_slot].seq, __ATOMIC_ACQUIRE)
            : seq + 1;
  pthread_mutex_unlock(&table_lock);
  if (now != seq)
    return usmipc__fail(USMIPC_EEXPORTERGONE,
                        "process %u freed the memory this handle names while "
                        "it was being opened",
                        w->pid);
  return 0;
}
