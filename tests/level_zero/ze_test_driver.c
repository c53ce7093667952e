/* A Level Zero driver for testing usmipc's level_zero backend without Intel
 * hardware: one GPU "device" whose memory is host memory.
 *
 * The real loader (libze_loader.so.1) loads it when ZE_ENABLE_ALT_DRIVERS
 * names its path, asks it for its tables of entry points
 * (zeGet*ProcAddrTable, the loader's driver interface in ze_ddi.h) and
 * routes every zeXxx call of the application to it. So the backend talks to
 * this file through exactly the ABI and loader it meets on an Intel
 * machine; only the device behind the driver is pretend.
 *
 * What it imitates, because the backend depends on it:
 *  - device allocations are memfd-backed MAP_SHARED mappings, host and
 *    shared allocations are private anonymous ones;
 *  - zeMemGetIpcHandle returns a handle laid out like Intel's
 *    (IpcMemoryData: u64 fd, u64 pool offset, u8 memory type; or, on
 *    request, IpcOpaqueMemoryData, which adds the exporter's pid) whose fd,
 *    a duplicate of the memfd, is only meaningful in the exporting process;
 *    repeated gets of one allocation share the fd, reference-counted, and
 *    zeMemPutIpcHandle drops a reference (the fd is closed at zero);
 *  - zeMemOpenIpcHandle accepts only a handle whose fd exists in the calling
 *    process and is a memfd of this driver, and maps it;
 *  - zeMemGetFileDescriptorFromIpcHandleExp and zeMemPutIpcHandle are
 *    reachable through zeDriverGetExtensionFunctionAddress, since the
 *    loader 1.8 predates them (API 1.4) and routes neither;
 *  - errors are ze_result_t codes, as the specification lists them.
 * It counts IPC calls for the tests (ze_test_driver.h).
 *
 * It builds against the loader's own headers (libze-dev), so its structures
 * are the official layouts, while the backend declares its own: running the
 * two together checks the backend's declarations against the real ABI.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <level_zero/ze_api.h>
#include <level_zero/ze_ddi.h>
#include <level_zero/zes_ddi.h>
#include <level_zero/zet_ddi.h>

#include "ze_test_driver.h"

#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif
#ifndef SYS_pidfd_getfd
#define SYS_pidfd_getfd 438
#endif

#define EXPORT __attribute__((visibility("default")))
#define MEMFD_NAME "usmipc-ze-test"
#define HANDLE_MAGIC 0x7473747a656d7375ull /* "usmzetst" */
#define MAGIC_OFFSET 56 /* past both of Intel's layouts */
#define IPC_TYPE_DEVICE 0 /* InternalIpcMemoryType::deviceUnifiedMemory */
#define MAX_FILL_PATTERN 128

/* ---- objects -------------------------------------------------------------- */

/* Each handle type is a struct with a magic number, so that a handle of the
 * wrong kind or a dangling one is refused instead of followed. */
enum { MAGIC_DRIVER = 0x44525652, MAGIC_DEVICE = 0x44455643,
       MAGIC_CONTEXT = 0x43545854, MAGIC_LIST = 0x4c495354 };

struct _ze_driver_handle_t {
  uint32_t magic;
};
struct _ze_device_handle_t {
  uint32_t magic;
};
struct _ze_context_handle_t {
  uint32_t magic;
};
struct _ze_command_list_handle_t {
  uint32_t magic;
  ze_command_queue_mode_t mode;
};

static struct _ze_driver_handle_t the_driver = {MAGIC_DRIVER};
static struct _ze_device_handle_t the_device = {MAGIC_DEVICE};

typedef struct allocation {
  void *base;
  size_t size;     /* as requested */
  size_t mapped;   /* page-rounded */
  ze_memory_type_t type;
  uint64_t id;
  int memfd;       /* device memory: the backing memfd, else -1 */
  int ipc_fd;      /* the fd inside this allocation's IPC handle, or -1 */
  unsigned ipc_refs;
  bool imported;   /* a mapping opened with zeMemOpenIpcHandle */
} allocation_t;

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static allocation_t *allocs;
static size_t alloc_count, alloc_capacity;
static uint64_t next_id = 1;
static usmipc_ze_test_stats_t stats;
static bool initialized, no_fd_ext, no_put;

/* How IPC handles are laid out (ze_test_driver.h, knobs). */
static enum {
  LAYOUT_INTEL,   /* IpcMemoryData: u64 fd, u64 pool offset, u8 type */
  LAYOUT_PIDFD,   /* IpcOpaqueMemoryData: the importer's driver fetches the
                     fd itself from processId with pidfd_getfd */
  LAYOUT_UNKNOWN, /* fd at offset 40, an opaque number at 0 */
} layout;

static bool env_on(const char *name) {
  const char *v = getenv(name);
  return v != NULL && v[0] != '\0' && strcmp(v, "0") != 0;
}

static size_t page_round(size_t n) {
  size_t ps = (size_t)sysconf(_SC_PAGESIZE);
  return (n + ps - 1) / ps * ps;
}

/* The allocation containing ptr; lock held. */
static allocation_t *find(const void *ptr) {
  for (size_t i = 0; i < alloc_count; i++) {
    allocation_t *a = &allocs[i];
    if ((uintptr_t)ptr >= (uintptr_t)a->base &&
        (uintptr_t)ptr - (uintptr_t)a->base < a->size)
      return a;
  }
  return NULL;
}

static ze_result_t add(const allocation_t *a) {
  if (alloc_count == alloc_capacity) {
    size_t cap = alloc_capacity ? alloc_capacity * 2 : 32;
    allocation_t *grown = realloc(allocs, cap * sizeof(*allocs));
    if (grown == NULL)
      return ZE_RESULT_ERROR_OUT_OF_HOST_MEMORY;
    allocs = grown;
    alloc_capacity = cap;
  }
  allocs[alloc_count] = *a;
  allocs[alloc_count].id = next_id++;
  alloc_count++;
  return ZE_RESULT_SUCCESS;
}

static void drop(allocation_t *a) {
  *a = allocs[--alloc_count];
}

static bool good_context(ze_context_handle_t c) {
  return c != NULL && c->magic == MAGIC_CONTEXT;
}
static bool good_device(ze_device_handle_t d) { return d == &the_device; }

/* ---- global, driver, device ----------------------------------------------- */

static ze_result_t ZE_APICALL drv_init(ze_init_flags_t flags) {
  if (flags & ~(ze_init_flags_t)(ZE_INIT_FLAG_GPU_ONLY | ZE_INIT_FLAG_VPU_ONLY))
    return ZE_RESULT_ERROR_INVALID_ENUMERATION;
  if (env_on("USMIPC_ZE_TEST_INIT_FAIL"))
    return ZE_RESULT_ERROR_UNINITIALIZED;
  if (flags & ZE_INIT_FLAG_VPU_ONLY && !(flags & ZE_INIT_FLAG_GPU_ONLY))
    return ZE_RESULT_ERROR_UNINITIALIZED; /* no VPU here */
  pthread_mutex_lock(&lock);
  no_fd_ext = env_on("USMIPC_ZE_TEST_NO_FD_EXT");
  no_put = env_on("USMIPC_ZE_TEST_NO_PUT");
  layout = env_on("USMIPC_ZE_TEST_PIDFD_HANDLE")     ? LAYOUT_PIDFD
           : env_on("USMIPC_ZE_TEST_UNKNOWN_LAYOUT") ? LAYOUT_UNKNOWN
                                                     : LAYOUT_INTEL;
  initialized = true;
  pthread_mutex_unlock(&lock);
  return ZE_RESULT_SUCCESS;
}

static ze_result_t ZE_APICALL drv_driver_get(uint32_t *count,
                                             ze_driver_handle_t *drivers) {
  if (!initialized)
    return ZE_RESULT_ERROR_UNINITIALIZED;
  if (count == NULL)
    return ZE_RESULT_ERROR_INVALID_NULL_POINTER;
  if (*count == 0 || drivers == NULL) {
    *count = 1;
    return ZE_RESULT_SUCCESS;
  }
  *count = 1;
  drivers[0] = &the_driver;
  return ZE_RESULT_SUCCESS;
}

static ze_result_t ZE_APICALL drv_api_version(ze_driver_handle_t d,
                                              ze_api_version_t *version) {
  if (d != &the_driver)
    return ZE_RESULT_ERROR_INVALID_NULL_HANDLE;
  *version = ZE_API_VERSION_CURRENT;
  return ZE_RESULT_SUCCESS;
}

static ze_result_t ZE_APICALL drv_properties(ze_driver_handle_t d,
                                             ze_driver_properties_t *p) {
  if (d != &the_driver)
    return ZE_RESULT_ERROR_INVALID_NULL_HANDLE;
  if (p == NULL)
    return ZE_RESULT_ERROR_INVALID_NULL_POINTER;
  memcpy(p->uuid.id, "usmipc-ze-driver", ZE_MAX_DRIVER_UUID_SIZE);
  p->driverVersion = 1;
  return ZE_RESULT_SUCCESS;
}

static ze_result_t ZE_APICALL drv_ipc_properties(ze_driver_handle_t d,
                                                 ze_driver_ipc_properties_t *p) {
  if (d != &the_driver)
    return ZE_RESULT_ERROR_INVALID_NULL_HANDLE;
  if (p == NULL)
    return ZE_RESULT_ERROR_INVALID_NULL_POINTER;
  p->flags = ZE_IPC_PROPERTY_FLAG_MEMORY;
  return ZE_RESULT_SUCCESS;
}

static ze_result_t ZE_APICALL drv_ext_properties(ze_driver_handle_t d,
                                                 uint32_t *count,
                                                 ze_driver_extension_properties_t *p) {
  if (d != &the_driver)
    return ZE_RESULT_ERROR_INVALID_NULL_HANDLE;
  if (count == NULL)
    return ZE_RESULT_ERROR_INVALID_NULL_POINTER;
  /* One extension: that this is usmipc's test driver, whose dma-bufs are
   * memfds named MEMFD_NAME (the backend checks descriptors by kind). */
  if (*count == 0 || p == NULL) {
    *count = 1;
    return ZE_RESULT_SUCCESS;
  }
  *count = 1;
  snprintf(p[0].name, sizeof(p[0].name), "ZE_usmipc_test_driver");
  p[0].version = 1;
  return ZE_RESULT_SUCCESS;
}

static ze_result_t ZE_APICALL mem_put_ipc_handle(ze_context_handle_t,
                                                 ze_ipc_mem_handle_t);
static ze_result_t ZE_APICALL mem_fd_from_ipc_handle(ze_context_handle_t,
                                                     ze_ipc_mem_handle_t,
                                                     uint64_t *);

static ze_result_t ZE_APICALL drv_ext_function(ze_driver_handle_t d,
                                               const char *name, void **fn) {
  if (d != &the_driver)
    return ZE_RESULT_ERROR_INVALID_NULL_HANDLE;
  if (name == NULL || fn == NULL)
    return ZE_RESULT_ERROR_INVALID_NULL_POINTER;
  *fn = NULL;
  if (!strcmp(name, "zeMemPutIpcHandle") && !no_put)
    *fn = (void *)mem_put_ipc_handle;
  else if (!strcmp(name, "zeMemGetFileDescriptorFromIpcHandleExp") &&
           !no_fd_ext)
    *fn = (void *)mem_fd_from_ipc_handle;
  return *fn ? ZE_RESULT_SUCCESS : ZE_RESULT_ERROR_INVALID_ARGUMENT;
}

static ze_result_t ZE_APICALL dev_get(ze_driver_handle_t d, uint32_t *count,
                                      ze_device_handle_t *devices) {
  if (d != &the_driver)
    return ZE_RESULT_ERROR_INVALID_NULL_HANDLE;
  if (count == NULL)
    return ZE_RESULT_ERROR_INVALID_NULL_POINTER;
  if (*count == 0 || devices == NULL) {
    *count = 1;
    return ZE_RESULT_SUCCESS;
  }
  *count = 1;
  devices[0] = &the_device;
  return ZE_RESULT_SUCCESS;
}

static ze_result_t ZE_APICALL dev_sub_devices(ze_device_handle_t d,
                                              uint32_t *count,
                                              ze_device_handle_t *subs) {
  (void)subs;
  if (!good_device(d))
    return ZE_RESULT_ERROR_INVALID_NULL_HANDLE;
  if (count == NULL)
    return ZE_RESULT_ERROR_INVALID_NULL_POINTER;
  *count = 0;
  return ZE_RESULT_SUCCESS;
}

static ze_result_t ZE_APICALL dev_properties(ze_device_handle_t d,
                                             ze_device_properties_t *p) {
  if (!good_device(d))
    return ZE_RESULT_ERROR_INVALID_NULL_HANDLE;
  if (p == NULL)
    return ZE_RESULT_ERROR_INVALID_NULL_POINTER;
  if (p->stype != ZE_STRUCTURE_TYPE_DEVICE_PROPERTIES)
    return ZE_RESULT_ERROR_INVALID_ARGUMENT;
  static const uint8_t uuid[16] = USMIPC_ZE_TEST_DEVICE_UUID;
  p->type = ZE_DEVICE_TYPE_GPU;
  p->vendorId = 0xffff; /* not a PCI vendor: nobody's hardware */
  p->deviceId = 0x1;
  p->flags = ZE_DEVICE_PROPERTY_FLAG_INTEGRATED;
  p->subdeviceId = 0;
  p->coreClockRate = 1000;
  p->maxMemAllocSize = USMIPC_ZE_TEST_MAX_ALLOC;
  p->maxHardwareContexts = 1;
  p->maxCommandQueuePriority = 0;
  p->numThreadsPerEU = 1;
  p->physicalEUSimdWidth = 8;
  p->numEUsPerSubslice = 1;
  p->numSubslicesPerSlice = 1;
  p->numSlices = 1;
  p->timerResolution = 1;
  p->timestampValidBits = 64;
  p->kernelTimestampValidBits = 64;
  memcpy(p->uuid.id, uuid, sizeof(uuid));
  memset(p->name, 0, sizeof(p->name));
  snprintf(p->name, sizeof(p->name), "%s", USMIPC_ZE_TEST_DEVICE_NAME);
  return ZE_RESULT_SUCCESS;
}

static ze_result_t ZE_APICALL dev_queue_groups(ze_device_handle_t d,
                                               uint32_t *count,
                                               ze_command_queue_group_properties_t *p) {
  if (!good_device(d))
    return ZE_RESULT_ERROR_INVALID_NULL_HANDLE;
  if (count == NULL)
    return ZE_RESULT_ERROR_INVALID_NULL_POINTER;
  if (*count == 0 || p == NULL) {
    *count = 1;
    return ZE_RESULT_SUCCESS;
  }
  *count = 1;
  p[0].flags = ZE_COMMAND_QUEUE_GROUP_PROPERTY_FLAG_COMPUTE |
               ZE_COMMAND_QUEUE_GROUP_PROPERTY_FLAG_COPY;
  p[0].maxMemoryFillPatternSize = MAX_FILL_PATTERN;
  p[0].numQueues = 1;
  return ZE_RESULT_SUCCESS;
}

static ze_result_t ZE_APICALL dev_can_access_peer(ze_device_handle_t d,
                                                  ze_device_handle_t peer,
                                                  ze_bool_t *value) {
  if (!good_device(d) || !good_device(peer))
    return ZE_RESULT_ERROR_INVALID_NULL_HANDLE;
  if (value == NULL)
    return ZE_RESULT_ERROR_INVALID_NULL_POINTER;
  *value = 1;
  return ZE_RESULT_SUCCESS;
}

/* ---- contexts and command lists -------------------------------------------- */

static ze_result_t ZE_APICALL ctx_create(ze_driver_handle_t d,
                                         const ze_context_desc_t *desc,
                                         ze_context_handle_t *out) {
  if (d != &the_driver)
    return ZE_RESULT_ERROR_INVALID_NULL_HANDLE;
  if (desc == NULL || out == NULL)
    return ZE_RESULT_ERROR_INVALID_NULL_POINTER;
  if (desc->stype != ZE_STRUCTURE_TYPE_CONTEXT_DESC)
    return ZE_RESULT_ERROR_INVALID_ARGUMENT;
  /* Contexts come from a static table, never reused: applications keep
   * theirs for the life of the process, and a loader that wraps handles
   * frees its wrappers at exit, which would leave heap contexts
   * unreachable (a leak report under LeakSanitizer). */
  static struct _ze_context_handle_t contexts[64];
  static size_t used;
  pthread_mutex_lock(&lock);
  ze_context_handle_t c = used < 64 ? &contexts[used++] : NULL;
  pthread_mutex_unlock(&lock);
  if (c == NULL)
    return ZE_RESULT_ERROR_OUT_OF_HOST_MEMORY;
  c->magic = MAGIC_CONTEXT;
  *out = c;
  return ZE_RESULT_SUCCESS;
}

static ze_result_t ZE_APICALL ctx_destroy(ze_context_handle_t c) {
  if (!good_context(c))
    return ZE_RESULT_ERROR_INVALID_NULL_HANDLE;
  c->magic = 0;
  return ZE_RESULT_SUCCESS;
}

static ze_result_t ZE_APICALL list_create_immediate(
    ze_context_handle_t c, ze_device_handle_t d,
    const ze_command_queue_desc_t *desc, ze_command_list_handle_t *out) {
  if (!good_context(c) || !good_device(d))
    return ZE_RESULT_ERROR_INVALID_NULL_HANDLE;
  if (desc == NULL || out == NULL)
    return ZE_RESULT_ERROR_INVALID_NULL_POINTER;
  if (desc->stype != ZE_STRUCTURE_TYPE_COMMAND_QUEUE_DESC ||
      desc->ordinal != 0 || desc->index != 0)
    return ZE_RESULT_ERROR_INVALID_ARGUMENT;
  if (desc->mode > ZE_COMMAND_QUEUE_MODE_ASYNCHRONOUS)
    return ZE_RESULT_ERROR_INVALID_ENUMERATION;
  ze_command_list_handle_t l = malloc(sizeof(*l));
  if (l == NULL)
    return ZE_RESULT_ERROR_OUT_OF_HOST_MEMORY;
  l->magic = MAGIC_LIST;
  l->mode = desc->mode;
  *out = l;
  return ZE_RESULT_SUCCESS;
}

static ze_result_t ZE_APICALL list_destroy(ze_command_list_handle_t l) {
  if (l == NULL || l->magic != MAGIC_LIST)
    return ZE_RESULT_ERROR_INVALID_NULL_HANDLE;
  l->magic = 0;
  free(l);
  return ZE_RESULT_SUCCESS;
}

/* Work on this "device" is done by the host thread at append time, so every
 * command list behaves as a synchronous one. */
static ze_result_t ZE_APICALL list_copy(ze_command_list_handle_t l, void *dst,
                                        const void *src, size_t size,
                                        ze_event_handle_t signal,
                                        uint32_t nwait, ze_event_handle_t *wait) {
  (void)wait;
  if (l == NULL || l->magic != MAGIC_LIST)
    return ZE_RESULT_ERROR_INVALID_NULL_HANDLE;
  if (dst == NULL || src == NULL)
    return ZE_RESULT_ERROR_INVALID_NULL_POINTER;
  if (signal != NULL || nwait != 0)
    return ZE_RESULT_ERROR_UNSUPPORTED_FEATURE; /* no events here */
  memmove(dst, src, size);
  return ZE_RESULT_SUCCESS;
}

static ze_result_t ZE_APICALL list_fill(ze_command_list_handle_t l, void *ptr,
                                        const void *pattern, size_t pattern_size,
                                        size_t size, ze_event_handle_t signal,
                                        uint32_t nwait, ze_event_handle_t *wait) {
  (void)wait;
  if (l == NULL || l->magic != MAGIC_LIST)
    return ZE_RESULT_ERROR_INVALID_NULL_HANDLE;
  if (ptr == NULL || pattern == NULL)
    return ZE_RESULT_ERROR_INVALID_NULL_POINTER;
  if (signal != NULL || nwait != 0)
    return ZE_RESULT_ERROR_UNSUPPORTED_FEATURE;
  if (pattern_size == 0 || pattern_size > MAX_FILL_PATTERN ||
      (pattern_size & (pattern_size - 1)) != 0 || size % pattern_size != 0)
    return ZE_RESULT_ERROR_INVALID_SIZE;
  for (size_t i = 0; i < size; i += pattern_size)
    memcpy((uint8_t *)ptr + i, pattern, pattern_size);
  return ZE_RESULT_SUCCESS;
}

/* ---- memory ----------------------------------------------------------------- */

static ze_result_t alloc_common(ze_context_handle_t c, ze_memory_type_t type,
                                size_t size, size_t alignment, void **out) {
  if (!good_context(c))
    return ZE_RESULT_ERROR_INVALID_NULL_HANDLE;
  if (out == NULL)
    return ZE_RESULT_ERROR_INVALID_NULL_POINTER;
  if (size == 0)
    return ZE_RESULT_ERROR_UNSUPPORTED_SIZE;
  if (size > USMIPC_ZE_TEST_MAX_ALLOC)
    return ZE_RESULT_ERROR_UNSUPPORTED_SIZE;
  if ((alignment & (alignment - 1)) != 0 ||
      alignment > (size_t)sysconf(_SC_PAGESIZE))
    return ZE_RESULT_ERROR_UNSUPPORTED_ALIGNMENT;
  allocation_t a = {.size = size, .mapped = page_round(size), .type = type,
                    .memfd = -1, .ipc_fd = -1};
  if (type == ZE_MEMORY_TYPE_DEVICE) {
    a.memfd = memfd_create(MEMFD_NAME, MFD_CLOEXEC);
    if (a.memfd < 0)
      return ZE_RESULT_ERROR_OUT_OF_HOST_MEMORY;
    if (ftruncate(a.memfd, (off_t)a.mapped) != 0) {
      close(a.memfd);
      return ZE_RESULT_ERROR_OUT_OF_DEVICE_MEMORY;
    }
    a.base = mmap(NULL, a.mapped, PROT_READ | PROT_WRITE, MAP_SHARED, a.memfd,
                  0);
  } else {
    a.base = mmap(NULL, a.mapped, PROT_READ | PROT_WRITE,
                  MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  }
  if (a.base == MAP_FAILED) {
    if (a.memfd >= 0)
      close(a.memfd);
    return type == ZE_MEMORY_TYPE_DEVICE ? ZE_RESULT_ERROR_OUT_OF_DEVICE_MEMORY
                                         : ZE_RESULT_ERROR_OUT_OF_HOST_MEMORY;
  }
  pthread_mutex_lock(&lock);
  ze_result_t res = add(&a);
  if (res == ZE_RESULT_SUCCESS)
    stats.live_allocations++;
  pthread_mutex_unlock(&lock);
  if (res != ZE_RESULT_SUCCESS) {
    munmap(a.base, a.mapped);
    if (a.memfd >= 0)
      close(a.memfd);
    return res;
  }
  *out = a.base;
  return ZE_RESULT_SUCCESS;
}

static ze_result_t ZE_APICALL mem_alloc_device(ze_context_handle_t c,
                                               const ze_device_mem_alloc_desc_t *dd,
                                               size_t size, size_t alignment,
                                               ze_device_handle_t d, void **out) {
  if (!good_device(d))
    return ZE_RESULT_ERROR_INVALID_NULL_HANDLE;
  if (dd == NULL)
    return ZE_RESULT_ERROR_INVALID_NULL_POINTER;
  if (dd->stype != ZE_STRUCTURE_TYPE_DEVICE_MEM_ALLOC_DESC)
    return ZE_RESULT_ERROR_INVALID_ARGUMENT;
  return alloc_common(c, ZE_MEMORY_TYPE_DEVICE, size, alignment, out);
}

static ze_result_t ZE_APICALL mem_alloc_host(ze_context_handle_t c,
                                             const ze_host_mem_alloc_desc_t *hd,
                                             size_t size, size_t alignment,
                                             void **out) {
  if (hd == NULL)
    return ZE_RESULT_ERROR_INVALID_NULL_POINTER;
  if (hd->stype != ZE_STRUCTURE_TYPE_HOST_MEM_ALLOC_DESC)
    return ZE_RESULT_ERROR_INVALID_ARGUMENT;
  return alloc_common(c, ZE_MEMORY_TYPE_HOST, size, alignment, out);
}

static ze_result_t ZE_APICALL mem_alloc_shared(ze_context_handle_t c,
                                               const ze_device_mem_alloc_desc_t *dd,
                                               const ze_host_mem_alloc_desc_t *hd,
                                               size_t size, size_t alignment,
                                               ze_device_handle_t d, void **out) {
  if (d != NULL && !good_device(d))
    return ZE_RESULT_ERROR_INVALID_NULL_HANDLE;
  if (dd == NULL || hd == NULL)
    return ZE_RESULT_ERROR_INVALID_NULL_POINTER;
  if (dd->stype != ZE_STRUCTURE_TYPE_DEVICE_MEM_ALLOC_DESC ||
      hd->stype != ZE_STRUCTURE_TYPE_HOST_MEM_ALLOC_DESC)
    return ZE_RESULT_ERROR_INVALID_ARGUMENT;
  return alloc_common(c, ZE_MEMORY_TYPE_SHARED, size, alignment, out);
}

static ze_result_t ZE_APICALL mem_free(ze_context_handle_t c, void *ptr) {
  if (!good_context(c))
    return ZE_RESULT_ERROR_INVALID_NULL_HANDLE;
  if (ptr == NULL)
    return ZE_RESULT_ERROR_INVALID_NULL_POINTER;
  pthread_mutex_lock(&lock);
  allocation_t *a = find(ptr);
  if (a == NULL || a->base != ptr || a->imported) {
    pthread_mutex_unlock(&lock);
    return ZE_RESULT_ERROR_INVALID_ARGUMENT;
  }
  allocation_t copy = *a;
  drop(a);
  stats.live_allocations--;
  if (copy.ipc_fd >= 0) {
    if (no_put) {
      /* Without zeMemPutIpcHandle (API 1.4) the handle lives as long as the
       * allocation, so freeing releases it. */
      close(copy.ipc_fd);
      stats.live_ipc_handles--;
    } else {
      /* An IPC handle nobody put: its fd stays open (leaked) until the
       * process exits, the worst case of a driver that keeps handles until
       * they are put. The tests check that usmipc never gets here. */
      stats.freed_with_live_handle++;
    }
  }
  pthread_mutex_unlock(&lock);
  munmap(copy.base, copy.mapped);
  if (copy.memfd >= 0)
    close(copy.memfd);
  return ZE_RESULT_SUCCESS;
}

static ze_result_t ZE_APICALL mem_alloc_properties(
    ze_context_handle_t c, const void *ptr, ze_memory_allocation_properties_t *p,
    ze_device_handle_t *dev) {
  if (!good_context(c))
    return ZE_RESULT_ERROR_INVALID_NULL_HANDLE;
  if (ptr == NULL || p == NULL)
    return ZE_RESULT_ERROR_INVALID_NULL_POINTER;
  if (p->stype != ZE_STRUCTURE_TYPE_MEMORY_ALLOCATION_PROPERTIES)
    return ZE_RESULT_ERROR_INVALID_ARGUMENT;
  pthread_mutex_lock(&lock);
  allocation_t *a = find(ptr);
  p->type = a ? a->type : ZE_MEMORY_TYPE_UNKNOWN;
  p->id = a ? a->id : 0;
  p->pageSize = a ? (uint64_t)sysconf(_SC_PAGESIZE) : 0;
  if (dev != NULL)
    *dev = a && a->type != ZE_MEMORY_TYPE_HOST ? &the_device : NULL;
  pthread_mutex_unlock(&lock);
  return ZE_RESULT_SUCCESS;
}

static ze_result_t ZE_APICALL mem_address_range(ze_context_handle_t c,
                                                const void *ptr, void **base,
                                                size_t *size) {
  if (!good_context(c))
    return ZE_RESULT_ERROR_INVALID_NULL_HANDLE;
  if (ptr == NULL)
    return ZE_RESULT_ERROR_INVALID_NULL_POINTER;
  pthread_mutex_lock(&lock);
  allocation_t *a = find(ptr);
  if (a != NULL) {
    if (base)
      *base = a->base;
    if (size)
      *size = a->size;
  }
  pthread_mutex_unlock(&lock);
  return a ? ZE_RESULT_SUCCESS : ZE_RESULT_ERROR_UNKNOWN;
}

/* The handle, in one of Intel's two layouts (packed, little-endian):
 *   IpcMemoryData        0: u64 fd  8: u64 pool offset  16: u8 type
 *   IpcOpaqueMemoryData  0: int fd (in a u64)  8: u64 pool offset
 *                        16: u32 processId  20: u8 handle type (0: fd)
 *                        21: u8 memory type  22: 32 reserved bytes
 * or, for USMIPC_ZE_TEST_UNKNOWN_LAYOUT, with the fd at offset 40 and an
 * opaque number at 0. This driver's magic sits at offset 56 in all. */
#define UNKNOWN_FD_OFFSET 40
static void handle_encode(ze_ipc_mem_handle_t *h, int fd, uint64_t id) {
  uint64_t fd64 = (uint64_t)fd, offset = 0, magic = HANDLE_MAGIC;
  memset(h, 0, sizeof(*h));
  if (layout == LAYOUT_UNKNOWN) {
    uint64_t token = 0x7fff0000u | (id & 0xffff);
    memcpy(h->data, &token, 8);
    memcpy(h->data + UNKNOWN_FD_OFFSET, &fd64, 8);
  } else {
    memcpy(h->data, &fd64, 8);
  }
  memcpy(h->data + 8, &offset, 8);
  if (layout == LAYOUT_PIDFD) {
    uint32_t pid = (uint32_t)getpid();
    memcpy(h->data + 16, &pid, 4);
    h->data[20] = 0; /* IpcHandleType::fdHandle */
    h->data[21] = IPC_TYPE_DEVICE;
  } else {
    h->data[16] = IPC_TYPE_DEVICE;
  }
  memcpy(h->data + MAGIC_OFFSET, &magic, 8);
}

static ze_result_t ZE_APICALL mem_get_ipc_handle(ze_context_handle_t c,
                                                 const void *ptr,
                                                 ze_ipc_mem_handle_t *h) {
  if (!good_context(c))
    return ZE_RESULT_ERROR_INVALID_NULL_HANDLE;
  if (ptr == NULL || h == NULL)
    return ZE_RESULT_ERROR_INVALID_NULL_POINTER;
  pthread_mutex_lock(&lock);
  allocation_t *a = find(ptr);
  ze_result_t res = ZE_RESULT_SUCCESS;
  if (a == NULL || a->imported)
    res = ZE_RESULT_ERROR_INVALID_ARGUMENT;
  else if (a->type != ZE_MEMORY_TYPE_DEVICE)
    res = ZE_RESULT_ERROR_UNSUPPORTED_FEATURE; /* anonymous: not shareable */
  else if (a->ipc_fd < 0) {
    /* Like a dma-buf export: a new descriptor for the same memory. */
    a->ipc_fd = fcntl(a->memfd, F_DUPFD_CLOEXEC, 0);
    if (a->ipc_fd < 0)
      res = ZE_RESULT_ERROR_OUT_OF_HOST_MEMORY;
    else
      stats.live_ipc_handles++;
  }
  if (res == ZE_RESULT_SUCCESS) {
    a->ipc_refs++;
    stats.ipc_gets++;
    handle_encode(h, a->ipc_fd, a->id);
  }
  pthread_mutex_unlock(&lock);
  return res;
}

static int handle_fd(const ze_ipc_mem_handle_t *h) {
  int fd;
  memcpy(&fd, h->data + (layout == LAYOUT_UNKNOWN ? UNKNOWN_FD_OFFSET : 0),
         sizeof(fd));
  return fd;
}

static ze_result_t ZE_APICALL mem_put_ipc_handle(ze_context_handle_t c,
                                                 ze_ipc_mem_handle_t h) {
  if (!good_context(c))
    return ZE_RESULT_ERROR_INVALID_NULL_HANDLE;
  int fd = handle_fd(&h);
  pthread_mutex_lock(&lock);
  for (size_t i = 0; i < alloc_count; i++) {
    allocation_t *a = &allocs[i];
    if (a->ipc_fd == fd && fd >= 0 && a->ipc_refs > 0) {
      stats.ipc_puts++;
      if (--a->ipc_refs == 0) {
        close(a->ipc_fd);
        a->ipc_fd = -1;
        stats.live_ipc_handles--;
      }
      break;
    }
  }
  pthread_mutex_unlock(&lock);
  /* Intel's driver answers success for a handle it does not know, too. */
  return ZE_RESULT_SUCCESS;
}

static ze_result_t ZE_APICALL mem_fd_from_ipc_handle(ze_context_handle_t c,
                                                     ze_ipc_mem_handle_t h,
                                                     uint64_t *out) {
  if (!good_context(c))
    return ZE_RESULT_ERROR_INVALID_NULL_HANDLE;
  if (out == NULL)
    return ZE_RESULT_ERROR_INVALID_NULL_POINTER;
  int fd = handle_fd(&h);
  bool known = false;
  pthread_mutex_lock(&lock);
  for (size_t i = 0; i < alloc_count && !known; i++)
    known = allocs[i].ipc_fd == fd && fd >= 0;
  if (known)
    stats.fd_queries++;
  pthread_mutex_unlock(&lock);
  /* Like Intel's: only handles this process exported are known. */
  if (!known)
    return ZE_RESULT_ERROR_OUT_OF_HOST_MEMORY;
  *out = (uint64_t)fd;
  return ZE_RESULT_SUCCESS;
}

/* True when fd is open here and is one of this driver's memfds. */
static bool is_driver_memfd(int fd) {
  char link[64], target[128];
  snprintf(link, sizeof(link), "/proc/self/fd/%d", fd);
  ssize_t n = readlink(link, target, sizeof(target) - 1);
  if (n < 0)
    return false;
  target[n] = '\0';
  return strncmp(target, "/memfd:" MEMFD_NAME, strlen("/memfd:" MEMFD_NAME)) ==
         0;
}

static ze_result_t ZE_APICALL mem_open_ipc_handle(ze_context_handle_t c,
                                                  ze_device_handle_t d,
                                                  ze_ipc_mem_handle_t h,
                                                  ze_ipc_memory_flags_t flags,
                                                  void **out) {
  if (!good_context(c) || !good_device(d))
    return ZE_RESULT_ERROR_INVALID_NULL_HANDLE;
  if (out == NULL)
    return ZE_RESULT_ERROR_INVALID_NULL_POINTER;
  if (flags & ~(ze_ipc_memory_flags_t)(ZE_IPC_MEMORY_FLAG_BIAS_CACHED |
                                       ZE_IPC_MEMORY_FLAG_BIAS_UNCACHED))
    return ZE_RESULT_ERROR_INVALID_ENUMERATION;
  uint64_t offset, magic;
  memcpy(&offset, h.data + 8, 8);
  memcpy(&magic, h.data + MAGIC_OFFSET, 8);
  uint8_t type = h.data[layout == LAYOUT_PIDFD ? 21 : 16];
  /* Like Intel's driver, the handle's bytes are not checked beyond the
   * memory type: an importer may build its own handle around a dma-buf it
   * received (the magic is written, never required). */
  (void)magic;
  if (type != IPC_TYPE_DEVICE)
    return ZE_RESULT_ERROR_INVALID_ARGUMENT;
  int fd = handle_fd(&h), fetched = -1;
  bool from_self = false;
  if (layout == LAYOUT_PIDFD) {
    /* Intel's pidfd mode: fetch the descriptor from the process the handle
     * names, and fall back to the number as a local one if that fails. */
    uint32_t pid;
    memcpy(&pid, h.data + 16, 4);
    int pidfd = (int)syscall(SYS_pidfd_open, (pid_t)pid, 0);
    if (pidfd >= 0) {
      fetched = (int)syscall(SYS_pidfd_getfd, pidfd, fd, 0);
      close(pidfd);
    }
    if (fetched >= 0) {
      from_self = pid == (uint32_t)getpid();
      fd = fetched;
    }
  }
  struct stat st;
  /* The handle's fd must exist in this process: the exporter's number means
   * nothing here unless someone moved the descriptor. */
  if (fd < 0 || fstat(fd, &st) != 0 || !is_driver_memfd(fd) ||
      st.st_size <= 0 || offset >= (uint64_t)st.st_size) {
    if (fetched >= 0)
      close(fetched);
    return ZE_RESULT_ERROR_INVALID_ARGUMENT;
  }
  allocation_t a = {.size = (size_t)st.st_size, .mapped = (size_t)st.st_size,
                    .type = ZE_MEMORY_TYPE_DEVICE, .memfd = -1, .ipc_fd = -1,
                    .imported = true};
  a.base = mmap(NULL, a.mapped, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (fetched >= 0)
    close(fetched);
  if (a.base == MAP_FAILED)
    return ZE_RESULT_ERROR_OUT_OF_HOST_MEMORY;
  pthread_mutex_lock(&lock);
  ze_result_t res = add(&a);
  if (res == ZE_RESULT_SUCCESS) {
    stats.ipc_opens++;
    stats.live_mappings++;
    if (from_self)
      stats.pidfd_self_fetches++;
  }
  pthread_mutex_unlock(&lock);
  if (res != ZE_RESULT_SUCCESS) {
    munmap(a.base, a.mapped);
    return res;
  }
  /* The mapping keeps the memory; the caller still owns (and closes) fd. */
  *out = (uint8_t *)a.base + offset;
  return ZE_RESULT_SUCCESS;
}

static ze_result_t ZE_APICALL mem_close_ipc_handle(ze_context_handle_t c,
                                                   const void *ptr) {
  if (!good_context(c))
    return ZE_RESULT_ERROR_INVALID_NULL_HANDLE;
  if (ptr == NULL)
    return ZE_RESULT_ERROR_INVALID_NULL_POINTER;
  pthread_mutex_lock(&lock);
  allocation_t *a = find(ptr);
  if (a == NULL || !a->imported) {
    pthread_mutex_unlock(&lock);
    return ZE_RESULT_ERROR_INVALID_ARGUMENT;
  }
  allocation_t copy = *a;
  drop(a);
  stats.ipc_closes++;
  stats.live_mappings--;
  pthread_mutex_unlock(&lock);
  munmap(copy.base, copy.mapped);
  return ZE_RESULT_SUCCESS;
}

/* ---- the loader's driver interface ------------------------------------------ */

/* Every table getter accepts any 1.x version and fills only the entries this
 * driver implements; the loader leaves the others NULL. */
static ze_result_t check_version(ze_api_version_t version, const void *table) {
  if (table == NULL)
    return ZE_RESULT_ERROR_INVALID_NULL_POINTER;
  if (ZE_MAJOR_VERSION(version) != ZE_MAJOR_VERSION(ZE_API_VERSION_CURRENT))
    return ZE_RESULT_ERROR_UNSUPPORTED_VERSION;
  return ZE_RESULT_SUCCESS;
}

EXPORT ze_result_t ZE_APICALL zeGetGlobalProcAddrTable(ze_api_version_t v,
                                                       ze_global_dditable_t *t) {
  ze_result_t r = check_version(v, t);
  if (r == ZE_RESULT_SUCCESS)
    t->pfnInit = drv_init;
  return r;
}

EXPORT ze_result_t ZE_APICALL zeGetDriverProcAddrTable(ze_api_version_t v,
                                                       ze_driver_dditable_t *t) {
  ze_result_t r = check_version(v, t);
  if (r != ZE_RESULT_SUCCESS)
    return r;
  t->pfnGet = drv_driver_get;
  t->pfnGetApiVersion = drv_api_version;
  t->pfnGetProperties = drv_properties;
  t->pfnGetIpcProperties = drv_ipc_properties;
  t->pfnGetExtensionProperties = drv_ext_properties;
  t->pfnGetExtensionFunctionAddress = drv_ext_function;
  return r;
}

EXPORT ze_result_t ZE_APICALL zeGetDeviceProcAddrTable(ze_api_version_t v,
                                                       ze_device_dditable_t *t) {
  ze_result_t r = check_version(v, t);
  if (r != ZE_RESULT_SUCCESS)
    return r;
  t->pfnGet = dev_get;
  t->pfnGetSubDevices = dev_sub_devices;
  t->pfnGetProperties = dev_properties;
  t->pfnGetCommandQueueGroupProperties = dev_queue_groups;
  t->pfnCanAccessPeer = dev_can_access_peer;
  return r;
}

EXPORT ze_result_t ZE_APICALL zeGetContextProcAddrTable(ze_api_version_t v,
                                                        ze_context_dditable_t *t) {
  ze_result_t r = check_version(v, t);
  if (r != ZE_RESULT_SUCCESS)
    return r;
  t->pfnCreate = ctx_create;
  t->pfnDestroy = ctx_destroy;
  return r;
}

EXPORT ze_result_t ZE_APICALL
zeGetCommandListProcAddrTable(ze_api_version_t v, ze_command_list_dditable_t *t) {
  ze_result_t r = check_version(v, t);
  if (r != ZE_RESULT_SUCCESS)
    return r;
  t->pfnCreateImmediate = list_create_immediate;
  t->pfnDestroy = list_destroy;
  t->pfnAppendMemoryCopy = list_copy;
  t->pfnAppendMemoryFill = list_fill;
  return r;
}

EXPORT ze_result_t ZE_APICALL zeGetMemProcAddrTable(ze_api_version_t v,
                                                    ze_mem_dditable_t *t) {
  ze_result_t r = check_version(v, t);
  if (r != ZE_RESULT_SUCCESS)
    return r;
  t->pfnAllocShared = mem_alloc_shared;
  t->pfnAllocDevice = mem_alloc_device;
  t->pfnAllocHost = mem_alloc_host;
  t->pfnFree = mem_free;
  t->pfnGetAllocProperties = mem_alloc_properties;
  t->pfnGetAddressRange = mem_address_range;
  t->pfnGetIpcHandle = mem_get_ipc_handle;
  t->pfnOpenIpcHandle = mem_open_ipc_handle;
  t->pfnCloseIpcHandle = mem_close_ipc_handle;
#ifdef USMIPC_ZE_DDI_HAS_PUT
  /* Loaders of API 1.6+ route zeMemPutIpcHandle through this table. */
  if (!env_on("USMIPC_ZE_TEST_NO_PUT"))
    t->pfnPutIpcHandle = mem_put_ipc_handle;
#endif
  return r;
}

#ifdef USMIPC_ZE_DDI_HAS_MEM_EXP
EXPORT ze_result_t ZE_APICALL zeGetMemExpProcAddrTable(ze_api_version_t v,
                                                       ze_mem_exp_dditable_t *t) {
  ze_result_t r = check_version(v, t);
  if (r == ZE_RESULT_SUCCESS && !env_on("USMIPC_ZE_TEST_NO_FD_EXT"))
    t->pfnGetFileDescriptorFromIpcHandleExp = mem_fd_from_ipc_handle;
  return r;
}
#endif

/* Tables of objects this driver does not have: present and empty. The
 * loader 1.8 fails zeInit unless every core, tools (zet) and sysman (zes)
 * table getter exists; the experimental ones are optional. */
#define EMPTY_TABLE(getter, type)                                              \
  EXPORT ze_result_t ZE_APICALL getter(ze_api_version_t v, type *t) {         \
    return check_version(v, t);                                                \
  }
EMPTY_TABLE(zeGetCommandQueueProcAddrTable, ze_command_queue_dditable_t)
EMPTY_TABLE(zeGetFenceProcAddrTable, ze_fence_dditable_t)
EMPTY_TABLE(zeGetEventPoolProcAddrTable, ze_event_pool_dditable_t)
EMPTY_TABLE(zeGetEventProcAddrTable, ze_event_dditable_t)
EMPTY_TABLE(zeGetImageProcAddrTable, ze_image_dditable_t)
EMPTY_TABLE(zeGetModuleProcAddrTable, ze_module_dditable_t)
EMPTY_TABLE(zeGetModuleBuildLogProcAddrTable, ze_module_build_log_dditable_t)
EMPTY_TABLE(zeGetKernelProcAddrTable, ze_kernel_dditable_t)
EMPTY_TABLE(zeGetSamplerProcAddrTable, ze_sampler_dditable_t)
EMPTY_TABLE(zeGetPhysicalMemProcAddrTable, ze_physical_mem_dditable_t)
EMPTY_TABLE(zeGetVirtualMemProcAddrTable, ze_virtual_mem_dditable_t)
EMPTY_TABLE(zeGetDeviceExpProcAddrTable, ze_device_exp_dditable_t)
EMPTY_TABLE(zeGetEventExpProcAddrTable, ze_event_exp_dditable_t)
EMPTY_TABLE(zeGetFabricEdgeExpProcAddrTable, ze_fabric_edge_exp_dditable_t)
EMPTY_TABLE(zeGetFabricVertexExpProcAddrTable, ze_fabric_vertex_exp_dditable_t)
EMPTY_TABLE(zeGetImageExpProcAddrTable, ze_image_exp_dditable_t)
EMPTY_TABLE(zeGetKernelExpProcAddrTable, ze_kernel_exp_dditable_t)
EMPTY_TABLE(zetGetDeviceProcAddrTable, zet_device_dditable_t)
EMPTY_TABLE(zetGetContextProcAddrTable, zet_context_dditable_t)
EMPTY_TABLE(zetGetCommandListProcAddrTable, zet_command_list_dditable_t)
EMPTY_TABLE(zetGetModuleProcAddrTable, zet_module_dditable_t)
EMPTY_TABLE(zetGetKernelProcAddrTable, zet_kernel_dditable_t)
EMPTY_TABLE(zetGetMetricGroupProcAddrTable, zet_metric_group_dditable_t)
EMPTY_TABLE(zetGetMetricGroupExpProcAddrTable, zet_metric_group_exp_dditable_t)
EMPTY_TABLE(zetGetMetricProcAddrTable, zet_metric_dditable_t)
EMPTY_TABLE(zetGetMetricStreamerProcAddrTable, zet_metric_streamer_dditable_t)
EMPTY_TABLE(zetGetMetricQueryPoolProcAddrTable, zet_metric_query_pool_dditable_t)
EMPTY_TABLE(zetGetMetricQueryProcAddrTable, zet_metric_query_dditable_t)
EMPTY_TABLE(zetGetTracerExpProcAddrTable, zet_tracer_exp_dditable_t)
EMPTY_TABLE(zetGetDebugProcAddrTable, zet_debug_dditable_t)
EMPTY_TABLE(zesGetDriverProcAddrTable, zes_driver_dditable_t)
EMPTY_TABLE(zesGetDeviceProcAddrTable, zes_device_dditable_t)
EMPTY_TABLE(zesGetSchedulerProcAddrTable, zes_scheduler_dditable_t)
EMPTY_TABLE(zesGetPerformanceFactorProcAddrTable, zes_performance_factor_dditable_t)
EMPTY_TABLE(zesGetPowerProcAddrTable, zes_power_dditable_t)
EMPTY_TABLE(zesGetFrequencyProcAddrTable, zes_frequency_dditable_t)
EMPTY_TABLE(zesGetEngineProcAddrTable, zes_engine_dditable_t)
EMPTY_TABLE(zesGetStandbyProcAddrTable, zes_standby_dditable_t)
EMPTY_TABLE(zesGetFirmwareProcAddrTable, zes_firmware_dditable_t)
EMPTY_TABLE(zesGetMemoryProcAddrTable, zes_memory_dditable_t)
EMPTY_TABLE(zesGetFabricPortProcAddrTable, zes_fabric_port_dditable_t)
EMPTY_TABLE(zesGetTemperatureProcAddrTable, zes_temperature_dditable_t)
EMPTY_TABLE(zesGetPsuProcAddrTable, zes_psu_dditable_t)
EMPTY_TABLE(zesGetFanProcAddrTable, zes_fan_dditable_t)
EMPTY_TABLE(zesGetLedProcAddrTable, zes_led_dditable_t)
EMPTY_TABLE(zesGetRasProcAddrTable, zes_ras_dditable_t)
EMPTY_TABLE(zesGetDiagnosticsProcAddrTable, zes_diagnostics_dditable_t)

/* ---- for the tests ------------------------------------------------------------ */

EXPORT void usmipcZeTestDriverGetStats(usmipc_ze_test_stats_t *out) {
  pthread_mutex_lock(&lock);
  *out = stats;
  pthread_mutex_unlock(&lock);
}
