/* The export table: which allocations a process still exports, in a sealed
 * memfd that importers map read-only.
 *
 * Why: a handle can outlive the allocation it names. Driver handles (CUDA's
 * cuIpcGetMemHandle) are bearer tokens that the driver may still accept
 * after the exporter freed the memory, and a descriptor number fetched with
 * pidfd_getfd(2) may have been closed and reused for another allocation;
 * CUDA's exported descriptors all share one anonymous inode, so (st_dev,
 * st_ino) cannot tell them apart. The exporter alone knows what is live. So
 * each exporter keeps one slot per exported allocation, {buffer id,
 * descriptor number, size}, guarded by a sequence counter (a seqlock), in a
 * shared mapping that an importer fetches once per exporter and from then on
 * reads with a few loads, on every open, cache hits included.
 *
 * The table also answers two questions an importer cannot otherwise answer
 * without a system call:
 *  - Is this the exporter? The header names the process (pid, nonce, uid,
 *    start time, boot id) and carries a MAC of those fields keyed by the
 *    process key that every handle of this exporter carries. A table that
 *    some other process made (after pid reuse, or on a squatted socket name)
 *    fails the tag. The memfd is sealed against shrinking and growing, so no
 *    one can truncate it under an importer's mapping (SIGBUS).
 *  - Is the exporter alive? The header holds a robust, process-shared mutex
 *    that the exporter's broker thread locks at start and never unlocks.
 *    When the process dies, however it dies (SIGKILL included), the kernel
 *    walks the thread's robust list and sets FUTEX_OWNER_DIED in the lock
 *    word (futex(2), "robust futexes"). The header records where in the
 *    mutex that word is, so the importer reads one word.
 *
 * Slot protocol, for one writer (under table_lock) and any readers:
 *   writer: seq++ (odd: changing), store fields, seq++ (even: stable)
 *   reader: s1 = seq (retry while odd), load fields, s2 = seq, retry if s1!=s2
 * A slot is cleared before its descriptor is closed, so a reader that sees
 * the same even seq before and after pidfd_getfd knows the descriptor it
 * took was the one the slot names.
 *
 * Floor 3 of the core (transport, linux/): the exporter writes the table
 * here; the importer maps and reads it through core/peers.c. */
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "linux/transport.h"
#include "util/blake2s.h"

#define FUTEX_OWNER_DIED_ 0x40000000u
#define FUTEX_TID_MASK_ 0x3fffffffu

/* ---- the exporter's side ------------------------------------------------- */

static pthread_mutex_t table_lock = PTHREAD_MUTEX_INITIALIZER;
static uint8_t *table; /* this process's table, read-write */
static int table_fd = -1;
static uint32_t *free_slots; /* stack of released slot indices */
static size_t free_count, free_capacity;
static uint32_t next_unused;

static usmipc__export_slot_t *slots_of(uint8_t *t) {
  return (usmipc__export_slot_t *)(t + USMIPC__TABLE_HEADER_BYTES);
}

void usmipc__exports_fork_prepare(void) { pthread_mutex_lock(&table_lock); }
void usmipc__exports_fork_parent(void) { pthread_mutex_unlock(&table_lock); }
/* The child must never write the parent's table: it drops it and makes its
 * own on its next export. Tables of other exporters stay valid. */
void usmipc__exports_fork_child(void) {
  pthread_mutex_unlock(&table_lock);
  if (table != NULL)
    munmap(table, USMIPC__TABLE_BYTES);
  if (table_fd >= 0)
    close(table_fd);
  table = NULL;
  table_fd = -1;
  free_count = 0;
  next_unused = 0;
}

/* The tag over the header's identity fields [0, HDR_TAG). */
static void header_tag(const uint8_t *hdr, const uint8_t key[16],
                       uint8_t out[16]) {
  uint8_t msg[16 + USMIPC__HDR_TAG];
  memcpy(msg, "usmipc-table-v2\0", 16);
  memcpy(msg + 16, hdr, USMIPC__HDR_TAG);
  usmipc__mac(out, key, msg, sizeof(msg));
}

/* Called with table_lock held. */
static int table_create(void) {
  if (table != NULL)
    return 0;
  const usmipc__process_t *self = usmipc__self();
  char name[64];
  snprintf(name, sizeof(name), "usmipc-exports.%u.%016llx", self->pid,
           (unsigned long long)self->nonce);
  int fd = memfd_create(name, MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0)
    return usmipc__fail_native(usmipc__errno_code(errno), errno,
                               "cannot create the export table: %s",
                               strerror(errno));
  void *p = MAP_FAILED;
  if (ftruncate(fd, (off_t)USMIPC__TABLE_BYTES) == 0 &&
      fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) == 0)
    p = mmap(NULL, USMIPC__TABLE_BYTES, PROT_READ | PROT_WRITE, MAP_SHARED, fd,
             0);
  if (p == MAP_FAILED) {
    int e = errno;
    close(fd);
    return usmipc__fail_native(usmipc__errno_code(e), e,
                               "cannot map the export table: %s", strerror(e));
  }
  uint8_t *hdr = p;
  memcpy(hdr + USMIPC__HDR_MAGIC, USMIPC__TABLE_MAGIC, 8);
  usmipc__put32le(hdr + USMIPC__HDR_VERSION, 2);
  usmipc__put32le(hdr + USMIPC__HDR_PID, self->pid);
  usmipc__put32le(hdr + USMIPC__HDR_UID, self->uid);
  usmipc__put64le(hdr + USMIPC__HDR_NONCE, self->nonce);
  usmipc__put64le(hdr + USMIPC__HDR_START_TIME, self->start_time);
  memcpy(hdr + USMIPC__HDR_BOOT_ID, self->boot_id, 16);
  usmipc__put64le(hdr + USMIPC__HDR_SLOTS, USMIPC__TABLE_SLOTS);
  header_tag(hdr, self->key, hdr + USMIPC__HDR_TAG);
  /* The liveness mutex: robust (the kernel marks it when the holder dies)
   * and process-shared (importers read its word in their own mapping). */
  pthread_mutexattr_t attr;
  pthread_mutexattr_init(&attr);
  pthread_mutexattr_setpshared(&attr, PTHREAD_PROCESS_SHARED);
  pthread_mutexattr_setrobust(&attr, PTHREAD_MUTEX_ROBUST);
  pthread_mutex_init((pthread_mutex_t *)(hdr + USMIPC__HDR_MUTEX), &attr);
  pthread_mutexattr_destroy(&attr);
  table = p;
  table_fd = fd;
  return 0;
}

_Static_assert(sizeof(pthread_mutex_t) <= USMIPC__HDR_MUTEX_BYTES,
               "the liveness mutex fits its header field");

pthread_mutex_t *usmipc__exports_alive_mutex(void) {
  pthread_mutex_lock(&table_lock);
  int rc = table_create();
  pthread_mutex_t *m =
      rc == 0 ? (pthread_mutex_t *)(table + USMIPC__HDR_MUTEX) : NULL;
  pthread_mutex_unlock(&table_lock);
  return m;
}

int usmipc__exports_hold_alive(pthread_mutex_t *m, uint32_t tid) {
  int rc = pthread_mutex_lock(m);
  if (rc != 0)
    return rc;
  /* Find the kernel's futex word: the 4 bytes that now hold our tid (the
   * robust-futex protocol requires the owner's tid in it; where the C
   * library keeps it inside pthread_mutex_t is its own business). */
  const uint8_t *bytes = (const uint8_t *)m;
  for (uint32_t off = 0; off + 4 <= sizeof(pthread_mutex_t); off += 4) {
    uint32_t word =
        __atomic_load_n((const uint32_t *)(bytes + off), __ATOMIC_RELAXED);
    if ((word & FUTEX_TID_MASK_) == tid) {
      __atomic_store_n((uint32_t *)((uint8_t *)m - USMIPC__HDR_MUTEX +
                                    USMIPC__HDR_ALIVE_OFFSET),
                       USMIPC__HDR_MUTEX + off, __ATOMIC_RELEASE);
      return 0;
    }
  }
  return -1;
}

uint64_t usmipc__slot_tag(const uint8_t key[16], const uint8_t token[16]) {
  /* Every open computes one tag, almost always under the key it used last
   * (one exporter's handles): each thread keeps that key's keyed state. */
  static __thread struct {
    uint8_t key[16];
    bool valid;
    usmipc__blake2s_t keyed;
  } last;
  if (!last.valid || memcmp(last.key, key, 16) != 0) {
    usmipc__mac_keyed_init(&last.keyed, key);
    memcpy(last.key, key, 16);
    last.valid = true;
  }
  uint8_t msg[32], mac[16];
  memcpy(msg, "usmipc-slottag-2", 16);
  memcpy(msg + 16, token, 16);
  usmipc__mac_keyed(mac, &last.keyed, msg, sizeof(msg));
  /* The low two bits say what the slot holds, never 0 (a free slot): an
   * importer can then tell a handle that names another kind of export's
   * slot (an event handle forged with a memory allocation's slot, token
   * and buffer id, all in that allocation's handle) from a revoked one,
   * and say what the slot holds (event_handle_names_another_export). */
  return (usmipc__get64le(mac) & ~(uint64_t)USMIPC__SLOT_KIND_MASK) |
         USMIPC__SLOT_KIND_MEMORY;
}

uint64_t usmipc__event_slot_tag(const uint8_t key[16],
                                const uint8_t token[16]) {
  return (usmipc__slot_tag(key, token) & ~(uint64_t)USMIPC__SLOT_KIND_MASK) |
         USMIPC__SLOT_KIND_EVENT;
}

static void slot_write(usmipc__export_slot_t *s, uint64_t buffer_id,
                       uint32_t fd_number, uint64_t size, uint64_t tag) {
  /* Each field store is a release: a reader that sees any new field also
   * sees the odd count stored before it, and retries. (Release stores and
   * acquire loads instead of fences: the same instructions on x86, and
   * ThreadSanitizer understands them.) */
  uint32_t seq = __atomic_load_n(&s->seq, __ATOMIC_RELAXED);
  __atomic_store_n(&s->seq, seq + 1, __ATOMIC_RELAXED);
  __atomic_store_n(&s->fd_number, fd_number, __ATOMIC_RELEASE);
  __atomic_store_n(&s->buffer_id, buffer_id, __ATOMIC_RELEASE);
  __atomic_store_n(&s->size, size, __ATOMIC_RELEASE);
  __atomic_store_n(&s->tag, tag, __ATOMIC_RELEASE);
  __atomic_store_n(&s->seq, seq + 2, __ATOMIC_RELEASE);
}

int usmipc__exports_add(uint64_t buffer_id, uint32_t fd_number, uint64_t size,
                        uint64_t tag, uint32_t *slot,
                        uint32_t *table_fd_number) {
  pthread_mutex_lock(&table_lock);
  int rc = table_create();
  if (rc == 0) {
    uint32_t at;
    if (free_count > 0) {
      at = free_slots[--free_count];
    } else if (next_unused < USMIPC__TABLE_SLOTS) {
      at = next_unused++;
    } else {
      pthread_mutex_unlock(&table_lock);
      return usmipc__fail(USMIPC_ENOMEM,
                          "this process already exports %u allocations, the "
                          "most one process can; free some first",
                          USMIPC__TABLE_SLOTS);
    }
    slot_write(&slots_of(table)[at], buffer_id, fd_number, size, tag);
    *slot = at;
    *table_fd_number = (uint32_t)table_fd;
  }
  pthread_mutex_unlock(&table_lock);
  return rc;
}

void usmipc__exports_set_size(uint32_t slot, uint64_t size) {
  pthread_mutex_lock(&table_lock);
  if (table != NULL && slot < next_unused) {
    usmipc__export_slot_t *s = &slots_of(table)[slot];
    slot_write(s, s->buffer_id, s->fd_number, size, s->tag);
  }
  pthread_mutex_unlock(&table_lock);
}

void usmipc__exports_remove(uint32_t slot) {
  pthread_mutex_lock(&table_lock);
  if (table != NULL && slot < next_unused) {
    slot_write(&slots_of(table)[slot], 0, UINT32_MAX, 0, 0);
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

/* ---- reading another process's table ------------------------------------- */

/* The liveness word lies inside the header's mutex, aligned. */
static bool alive_offset_valid(uint32_t off) {
  return off >= USMIPC__HDR_MUTEX &&
         off <= USMIPC__HDR_MUTEX + USMIPC__HDR_MUTEX_BYTES - 4 && off % 4 == 0;
}

int usmipc__table_map(int fd, const usmipc__wire_t *w, const uint8_t **out) {
  /* Everything about the file is checked before it is mapped: a regular
   * shmem file of exactly the table's size that nobody can shrink or grow,
   * owned by this process's user (a table made by another user is never
   * ours to trust). */
  struct stat st;
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) ||
      (uint64_t)st.st_size != USMIPC__TABLE_BYTES)
    return usmipc__fail(USMIPC_EUNTRUSTED,
                        "process %u's export table is not a table (wrong "
                        "file type or size): the process at that pid or "
                        "socket name is not the exporter",
                        w->pid);
  if (st.st_uid != usmipc__self()->uid)
    return usmipc__fail(USMIPC_EACCES,
                        "process %u's export table belongs to uid %u, not to "
                        "this process's uid %u: IPC is refused between "
                        "processes of different users",
                        w->pid, (unsigned)st.st_uid,
                        (unsigned)usmipc__self()->uid);
  int seals = fcntl(fd, F_GET_SEALS);
  if (seals < 0 ||
      (seals & (F_SEAL_SHRINK | F_SEAL_GROW)) != (F_SEAL_SHRINK | F_SEAL_GROW))
    return usmipc__fail(USMIPC_EUNTRUSTED,
                        "process %u's export table is not sealed against "
                        "resizing: refused, since a peer could truncate it "
                        "under this process's mapping",
                        w->pid);
  void *p = mmap(NULL, USMIPC__TABLE_BYTES, PROT_READ, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED)
    return usmipc__fail_native(usmipc__errno_code(errno), errno,
                               "cannot map process %u's export table: %s",
                               w->pid, strerror(errno));
  const uint8_t *hdr = p;
  uint8_t tag[16];
  header_tag(hdr, w->key, tag);
  uint32_t alive_off = usmipc__get32le(hdr + USMIPC__HDR_ALIVE_OFFSET);
  if (memcmp(hdr + USMIPC__HDR_MAGIC, USMIPC__TABLE_MAGIC, 8) != 0 ||
      usmipc__get32le(hdr + USMIPC__HDR_VERSION) != 2 ||
      usmipc__get32le(hdr + USMIPC__HDR_PID) != w->pid ||
      usmipc__get32le(hdr + USMIPC__HDR_UID) != w->uid ||
      usmipc__get64le(hdr + USMIPC__HDR_NONCE) != w->nonce ||
      usmipc__get64le(hdr + USMIPC__HDR_START_TIME) != w->start_time ||
      memcmp(hdr + USMIPC__HDR_BOOT_ID, w->boot_id, 16) != 0 ||
      usmipc__get64le(hdr + USMIPC__HDR_SLOTS) != USMIPC__TABLE_SLOTS ||
      !usmipc__ct_equal(tag, hdr + USMIPC__HDR_TAG, 16)) {
    munmap(p, USMIPC__TABLE_BYTES);
    return usmipc__fail(USMIPC_EUNTRUSTED,
                        "the export table offered for process %u does not "
                        "prove the exporter's identity (its tag or fields "
                        "differ from the handle's): the process at that pid "
                        "or socket name is not the exporter, or the handle is "
                        "forged",
                        w->pid);
  }
  if (alive_off != 0 && !alive_offset_valid(alive_off)) {
    munmap(p, USMIPC__TABLE_BYTES);
    return usmipc__fail(USMIPC_EUNTRUSTED,
                        "process %u's export table is malformed", w->pid);
  }
  *out = hdr;
  return 0;
}

int usmipc__table_alive(const uint8_t *hdr) {
  uint32_t off = __atomic_load_n(
      (const uint32_t *)(hdr + USMIPC__HDR_ALIVE_OFFSET), __ATOMIC_ACQUIRE);
  if (off == 0)
    return 0; /* never held: the exporter's broker did not start */
  /* Checked at every read, not only at usmipc__table_map: the exporter
   * publishes the offset when its broker starts, which may be after this
   * process mapped the table, and an offset outside the mutex would make
   * every importer read outside its mapping (handle_table_indexes_bounded).
   * Such an exporter counts as gone. */
  if (!alive_offset_valid(off))
    return 0;
  uint32_t word =
      __atomic_load_n((const uint32_t *)(hdr + off), __ATOMIC_ACQUIRE);
  return (word & FUTEX_OWNER_DIED_) == 0 && (word & FUTEX_TID_MASK_) != 0;
}

/* Every slot an importer reads comes from bytes it was sent (a handle, a
 * bundle, a pool block's record, an event): the reader bounds it itself
 * against the table's size (checked at usmipc__table_map), so that a caller
 * that forgot to cannot read outside the mapping (bundle_slot_out_of_range
 * feeds it 0x00100005 and 0xFFFFFFF0). */
static bool slot_in_table(const uint8_t *hdr, uint32_t slot) {
  return slot < USMIPC__TABLE_SLOTS &&
         slot < usmipc__get64le(hdr + USMIPC__HDR_SLOTS);
}

int usmipc__table_read_slot(const uint8_t *hdr, uint32_t slot,
                            usmipc__export_slot_t *out, uint32_t *seq_out) {
  if (!slot_in_table(hdr, slot))
    return usmipc__fail(USMIPC_EBADHANDLE,
                        "export slot %u is beyond the %u slots of the "
                        "exporter's table: the handle or bundle naming it is "
                        "forged or corrupted",
                        slot, USMIPC__TABLE_SLOTS);
  const usmipc__export_slot_t *s = slots_of((uint8_t *)hdr) + slot;
  uint32_t s1, s2;
  unsigned spins = 0;
  do {
    /* An odd count is a write in progress: nanoseconds, unless the exporter
     * died in the middle of it. */
    while ((s1 = __atomic_load_n(&s->seq, __ATOMIC_ACQUIRE)) & 1)
      if (++spins > (1u << 20))
        return -1;
    /* Acquire loads: the second count is read after the fields. */
    out->fd_number = __atomic_load_n(&s->fd_number, __ATOMIC_ACQUIRE);
    out->buffer_id = __atomic_load_n(&s->buffer_id, __ATOMIC_ACQUIRE);
    out->size = __atomic_load_n(&s->size, __ATOMIC_ACQUIRE);
    out->tag = __atomic_load_n(&s->tag, __ATOMIC_ACQUIRE);
    s2 = __atomic_load_n(&s->seq, __ATOMIC_RELAXED);
  } while (s1 != s2);
  out->seq = s1;
  if (seq_out)
    *seq_out = s1;
  return 0;
}

uint32_t usmipc__table_slot_seq(const uint8_t *hdr, uint32_t slot) {
  if (!slot_in_table(hdr, slot))
    return 1; /* odd: never the even count of a stable slot */
  const usmipc__export_slot_t *s = slots_of((uint8_t *)hdr) + slot;
  return __atomic_load_n(&s->seq, __ATOMIC_ACQUIRE);
}
