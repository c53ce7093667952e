/* The host backend: the CPU as a device. Device memory is a memfd-backed
 * shared mapping, so it can be shared by handing its file descriptor to
 * another process, which maps the same pages: no copy, and the pages live as
 * long as any process maps them or holds the descriptor. Host and shared
 * memory are private anonymous mappings (page-aligned, like device memory).
 *
 * Floor 3 of the core (backends, beside the transport): the core reaches
 * it only through its ops table (backend.h). */
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/utsname.h>
#include <unistd.h>

#include "backend/backend.h"

#define HOST_HANDLE_MEMFD 1 /* payload-less handle: the memory is the fd */

static size_t page_size(void) {
  static size_t ps; /* threads may race to set it, to the same value */
  size_t v = __atomic_load_n(&ps, __ATOMIC_RELAXED);
  if (v == 0) {
    v = (size_t)sysconf(_SC_PAGESIZE);
    __atomic_store_n(&ps, v, __ATOMIC_RELAXED);
  }
  return v;
}

static int sys_fail(const char *what) {
  int e = errno;
  if (e == EMFILE || e == ENFILE)
    return usmipc__fail_native(USMIPC_EMFILE, e,
                               "%s: %s: every exported host allocation holds "
                               "one file descriptor; free some, raise the "
                               "limit (ulimit -n), or share many small "
                               "buffers as blocks of one pool "
                               "(usmipc_pool_create, docs/pools.md)",
                               what, strerror(e));
  return usmipc__fail_native(usmipc__errno_code(e), e, "%s: %s", what,
                             strerror(e));
}

/* The host "device" is the running kernel: its UUID is the boot id, which
 * every process on the machine reads alike, containers included (each
 * container may have its own /etc/machine-id, which would make the one
 * machine look like several devices). */
static void host_uuid(uint8_t out[16]) {
  memcpy(out, usmipc__self_basic()->boot_id, 16);
}

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
/* The processor's brand string straight from CPUID (leaves 0x80000002-4):
 * what /proc/cpuinfo's "model name" shows, without the 30 us of a read. */
static int cpuid_brand(char *out, size_t len) {
  unsigned regs[12];
  if (__get_cpuid_max(0x80000000u, NULL) < 0x80000004u)
    return -1;
  for (unsigned i = 0; i < 3; i++)
    __get_cpuid(0x80000002u + i, &regs[4 * i], &regs[4 * i + 1],
                &regs[4 * i + 2], &regs[4 * i + 3]);
  char brand[49];
  memcpy(brand, regs, 48);
  brand[48] = '\0';
  const char *start = brand;
  while (*start == ' ')
    start++;
  size_t n = strlen(start);
  while (n > 0 && start[n - 1] == ' ')
    n--;
  if (n == 0)
    return -1;
  snprintf(out, len, "%.*s", (int)n, start);
  return 0;
}
#else
static int cpuid_brand(char *out, size_t len) {
  (void)out;
  (void)len;
  return -1;
}
#endif

static void cpu_name(char *out, size_t len) {
  if (cpuid_brand(out, len) == 0)
    return;
  snprintf(out, len, "host CPU");
  FILE *f = fopen("/proc/cpuinfo", "re");
  if (f == NULL)
    return;
  char line[256];
  while (fgets(line, sizeof(line), f)) {
    if (strncmp(line, "model name", 10) == 0) {
      char *colon = strchr(line, ':');
      if (colon) {
        colon += 1 + (colon[1] == ' ');
        colon[strcspn(colon, "\n")] = '\0';
        snprintf(out, len, "%s", colon);
      }
      break;
    }
  }
  fclose(f);
}

/* CPUID traps to the hypervisor in a VM (8 us a leaf here) and
 * /proc/cpuinfo costs 30 us: the name is learnt only when asked for. */
static void host_device_name(void *dev, char *out, size_t len) {
  (void)dev;
  cpu_name(out, len);
}

/* The host's "driver" is the kernel (uname(2)'s release, as the OpenCL CPU
 * runtime's version would be meaningless here); its memory is physical RAM,
 * and one allocation may take all of it (a memfd or an anonymous mapping
 * is bounded by RAM and overcommit, not by a driver limit). */
static int host_device_info(void *dev, usmipc_device_info_t *info) {
  (void)dev;
  struct utsname u;
  if (uname(&u) == 0)
    snprintf(info->driver_version, sizeof(info->driver_version), "%.*s",
             (int)sizeof(info->driver_version) - 1, u.release);
  long pages = sysconf(_SC_PHYS_PAGES);
  if (pages > 0)
    info->global_mem_size = (uint64_t)pages * page_size();
  info->max_mem_alloc_size = info->global_mem_size;
  return 0;
}

static int host_probe(usmipc__device_desc_t *devices, int max, char *reason,
                      size_t reason_len) {
  (void)reason;
  (void)reason_len;
  if (max < 1)
    return 0;
  devices[0].type = USMIPC_DEVICE_CPU;
  devices[0].name[0] = '\0'; /* host_device_name, when asked */
  host_uuid(devices[0].uuid);
  /* memfd_create(2) appeared in Linux 3.17; probe it rather than assume. */
  int fd = memfd_create("usmipc-probe", MFD_CLOEXEC);
  devices[0].supports_ipc = fd >= 0;
  if (fd >= 0)
    close(fd);
  devices[0].native = NULL;
  return 1;
}

static int host_mem_alloc(void *dev, usmipc_mem_kind_t kind, size_t nbytes,
                          unsigned flags, usmipc__allocation_t *out) {
  (void)dev;
  (void)flags; /* host device memory is always shared through its memfd */
  size_t size = (nbytes + page_size() - 1) & ~(page_size() - 1);
  if (size < nbytes)
    return usmipc__fail(USMIPC_ENOMEM, "size %zu is too large", nbytes);
  if (kind != USMIPC_MEM_DEVICE) {
    void *p = mmap(NULL, size, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED)
      return sys_fail("mmap");
    out->base = p;
    out->size = nbytes;
    out->fd = -1;
    out->reserved = size;
    return 0;
  }
  int fd = memfd_create("usmipc", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0)
    return sys_fail("memfd_create");
  /* Sealed at its size: no process that holds the descriptor (an importer
   * included) can shrink it under another's mapping, which would turn the
   * next touch of a page past the new end into SIGBUS. */
  if (ftruncate(fd, (off_t)size) != 0 ||
      fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW) != 0) {
    int rc = sys_fail("sizing the memfd");
    close(fd);
    return rc;
  }
  void *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    int rc = sys_fail("mmap of the memfd");
    close(fd);
    return rc;
  }
  out->base = p;
  out->size = nbytes;
  out->fd = fd;
  out->reserved = size;
  return 0;
}

static int host_mem_free(void *dev, usmipc__allocation_t *a) {
  (void)dev;
  munmap(a->base, a->reserved);
  if (a->fd >= 0)
    close(a->fd);
  a->fd = -1;
  return 0;
}

static int host_queue_create(void *dev, void **queue) {
  (void)dev;
  *queue = NULL; /* host copies complete before returning: nothing to order */
  return 0;
}
static int host_queue_destroy(void *dev, void *queue) {
  (void)dev;
  (void)queue;
  return 0;
}
static int host_queue_synchronize(void *dev, void *queue) {
  (void)dev;
  (void)queue;
  return 0;
}
static int host_queue_idle(void *dev, void *queue) {
  (void)dev;
  (void)queue;
  return 1; /* host work completes before its call returns */
}
static int host_memcpy(void *dev, void *queue, void *dst, const void *src,
                       size_t n) {
  (void)dev;
  (void)queue;
  memmove(dst, src, n);
  return 0;
}
/* ---- batched copies: a parallel memcpy ------------------------------------
 * A host "queue" completes its work before returning, so a batch is copied
 * now: by this thread alone below PARALLEL_MIN bytes (a thread's start costs
 * more than it saves), else by up to 8 threads that claim pieces of at most
 * PIECE bytes in turn (one memcpy stream per core; a node's memory bandwidth
 * is reached with a few). */
#define PIECE ((uint64_t)4 << 20)
#define PARALLEL_MIN ((uint64_t)32 << 20)

typedef struct host_batch_work {
  const usmipc__copy_t *copies;
  size_t count;
  size_t next; /* the next piece to claim: copy index << 32 | piece */
  pthread_mutex_t lock;
} host_batch_work_t;

static void copy_rows(const usmipc__copy_t *k, uint64_t r0, uint64_t rows,
                      uint64_t at, uint64_t len) {
  for (uint64_t r = r0; r < r0 + rows; r++)
    memcpy((char *)(uintptr_t)(k->dst + r * k->dst_pitch) + at,
           (const char *)(uintptr_t)(k->src + r * k->src_pitch) + at, len);
}

/* Claims pieces until none is left: a piece is PIECE bytes of a one-row
 * copy, or as many whole rows of a copy as fit PIECE (at least one). */
static void *host_batch_worker(void *arg) {
  host_batch_work_t *w = arg;
  for (;;) {
    pthread_mutex_lock(&w->lock);
    size_t i = w->next >> 32;
    uint64_t p = w->next & 0xffffffffu;
    while (i < w->count) {
      const usmipc__copy_t *k = &w->copies[i];
      uint64_t rows_per = k->row_bytes >= PIECE ? 1 : PIECE / k->row_bytes;
      uint64_t pieces = k->rows == 1 ? (k->row_bytes + PIECE - 1) / PIECE
                                     : (k->rows + rows_per - 1) / rows_per;
      if (k->row_bytes != 0 && p < pieces)
        break;
      i++;
      p = 0;
    }
    if (i >= w->count) {
      w->next = (size_t)i << 32;
      pthread_mutex_unlock(&w->lock);
      return NULL;
    }
    w->next = ((size_t)i << 32) | (p + 1);
    pthread_mutex_unlock(&w->lock);
    const usmipc__copy_t *k = &w->copies[i];
    if (k->rows == 1) {
      uint64_t at = p * PIECE;
      copy_rows(k, 0, 1, at,
                k->row_bytes - at < PIECE ? k->row_bytes - at : PIECE);
    } else {
      uint64_t rows_per = k->row_bytes >= PIECE ? 1 : PIECE / k->row_bytes;
      uint64_t r0 = p * rows_per;
      copy_rows(k, r0, k->rows - r0 < rows_per ? k->rows - r0 : rows_per, 0,
                k->row_bytes);
    }
  }
}

static int host_copy_batch_create(void *dev, void **batch) {
  (void)dev;
  *batch = NULL; /* nothing is kept between runs */
  return 0;
}

static int host_copy_batch_run(void *dev, void *batch, void *queue,
                               const usmipc__copy_t *copies, size_t count,
                               bool same) {
  (void)dev;
  (void)batch;
  (void)queue;
  (void)same;
  uint64_t total = 0;
  for (size_t i = 0; i < count; i++)
    total += copies[i].row_bytes * copies[i].rows;
  long cores = sysconf(_SC_NPROCESSORS_ONLN);
  int threads = cores > 8 ? 8 : (int)cores;
  if (total < PARALLEL_MIN || threads < 2) {
    for (size_t i = 0; i < count; i++)
      copy_rows(&copies[i], 0, copies[i].rows, 0, copies[i].row_bytes);
    return 0;
  }
  host_batch_work_t w = {.copies = copies, .count = count};
  pthread_mutex_init(&w.lock, NULL);
  pthread_t tid[8];
  int started = 0;
  for (; started < threads - 1; started++)
    if (pthread_create(&tid[started], NULL, host_batch_worker, &w) != 0)
      break; /* fewer helpers: this thread copies the rest */
  host_batch_worker(&w);
  for (int t = 0; t < started; t++)
    pthread_join(tid[t], NULL);
  pthread_mutex_destroy(&w.lock);
  return 0;
}

static int host_copy_batch_destroy(void *dev, void *batch) {
  (void)dev;
  (void)batch;
  return 0;
}

static int host_memset(void *dev, void *queue, void *dst, int value, size_t n) {
  (void)dev;
  (void)queue;
  memset(dst, value, n);
  return 0;
}

static int host_ipc_export(void *dev, usmipc__allocation_t *a,
                           usmipc__payload_t *payload, int *fd_to_share) {
  (void)dev;
  if (a->fd < 0)
    return usmipc__fail(USMIPC_EMEMKIND,
                        "only device memory can be exported; this allocation "
                        "is not memfd-backed");
  payload->handle_kind = HOST_HANDLE_MEMFD;
  payload->len = 0;
  *fd_to_share = a->fd;
  return 0;
}

static int host_ipc_import(void *dev, void *owner,
                           const usmipc__payload_t *payload, int fd,
                           uint64_t allocation_size,
                           usmipc__allocation_t *out) {
  (void)dev;
  (void)owner;
  if (payload->handle_kind != HOST_HANDLE_MEMFD || payload->len != 0)
    return usmipc__fail(USMIPC_EBADHANDLE,
                        "host handle of unknown kind %u (payload %u bytes)",
                        payload->handle_kind, payload->len);
  if (fd < 0)
    return usmipc__fail(USMIPC_EBADHANDLE, "host handle carries no descriptor");
  /* Never map what could shrink under us, or past the end of the file: a
   * truncation or a forged size would turn into SIGBUS on a later touch
   * instead of an error here. Only a memfd of this user, sealed against
   * shrinking, is mapped. */
  struct stat st;
  if (fstat(fd, &st) != 0)
    return sys_fail("fstat of the received descriptor");
  int seals = fcntl(fd, F_GET_SEALS);
  if (!S_ISREG(st.st_mode) || seals < 0 || !(seals & F_SEAL_SHRINK))
    return usmipc__fail(USMIPC_EUNTRUSTED,
                        "the exporter's memory is not a memfd sealed against "
                        "shrinking: refused, since it could be truncated "
                        "under this process's mapping (SIGBUS)");
  if (st.st_uid != usmipc__self_basic()->uid)
    return usmipc__fail(USMIPC_EACCES,
                        "the exporter's memory belongs to uid %u, not to this "
                        "process's uid %u: refused",
                        (unsigned)st.st_uid,
                        (unsigned)usmipc__self_basic()->uid);
  size_t size = (allocation_size + page_size() - 1) & ~(page_size() - 1);
  if (allocation_size > (uint64_t)SIZE_MAX - page_size() ||
      (uint64_t)st.st_size < size)
    return usmipc__fail(USMIPC_EBADHANDLE,
                        "the handle claims a %llu-byte allocation but the "
                        "exporter's memory is %lld bytes",
                        (unsigned long long)allocation_size,
                        (long long)st.st_size);
  void *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED && errno == ENOMEM)
    return usmipc__fail_native(
        USMIPC_ENOMEM, ENOMEM,
        "mapping the exporter's %zu bytes: this process has no room left in "
        "its address space (ulimit -v / RLIMIT_AS, or too many mappings: "
        "vm.max_map_count); close mappings it no longer needs",
        size);
  if (p == MAP_FAILED)
    return sys_fail("mmap of the exporter's memory");
  out->base = p;
  out->size = (size_t)allocation_size;
  out->kind = USMIPC_MEM_DEVICE;
  out->fd = -1; /* the mapping keeps the pages alive; no need to hold fd */
  out->reserved = size;
  return 0;
}

static int host_ipc_unmap(void *dev, usmipc__allocation_t *m) {
  (void)dev;
  munmap(m->base, m->reserved);
  return 0;
}

const usmipc__backend_ops_t usmipc__host_backend = {
    .struct_size = sizeof(usmipc__backend_ops_t),
    .backend = USMIPC_BACKEND_HOST,
    .name = "host",
    .probe = host_probe,
    .device_name = host_device_name,
    .mem_alloc = host_mem_alloc,
    .mem_free = host_mem_free,
    .pointer_query = NULL,
    .queue_create = host_queue_create,
    .queue_destroy = host_queue_destroy,
    .queue_synchronize = host_queue_synchronize,
    .queue_idle = host_queue_idle,
    .memcpy = host_memcpy,
    .memset = host_memset,
    .copy_batch_create = host_copy_batch_create,
    .copy_batch_run = host_copy_batch_run,
    .copy_batch_destroy = host_copy_batch_destroy,
    .ipc_export = host_ipc_export,
    .ipc_import = host_ipc_import,
    .ipc_unmap = host_ipc_unmap,
    .device_info = host_device_info,
};
