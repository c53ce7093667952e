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
 *  - device allocations are memfd-backed MAP_SHARED mappings (memfds named
 *    "usmipc-ze-test", standing for dma-bufs), host and shared allocations
 *    are private anonymous ones;
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
 * That is the "ideal" profile. The cr-* profiles (USMIPC_ZE_TEST_PROFILE,
 * ze_test_driver.h) behave instead like releases of Intel's compute-runtime
 * (CR) as its source reads: handle layouts, how zeMemOpenIpcHandle picks
 * the opaque or the legacy path, the import cache, device USM pools and
 * their per-descriptor reference count, zeMemFree closing exported
 * descriptors, the extension functions CR serves. Every such rule cites
 * CR@<tag>:<file>:<lines> (intel/compute-runtime at that release tag;
 * "..." abbreviates the directory of the previous citation). "Research §N"
 * names the section of the project's study of CR's source
 * (notes/l0-research.md, kept outside this repository) that the rule
 * comes from.
 * Events: event pools keep their events' state in a memfd that an opened
 * pool maps (a signal crosses processes), with CR's IPC handle layouts,
 * open paths and descriptor ownership per profile (section "events: pools,
 * events, IPC"); immediate lists are synchronous or, as CR's default,
 * asynchronous (a thread per list runs its commands in order), and
 * usmipcZeTestDriverAppendDelay appends a command that takes time.
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
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/time.h>
#include <time.h>
#include <sys/un.h>
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
#ifndef PR_SET_PTRACER
#define PR_SET_PTRACER 0x59616d61
#endif
#ifndef PR_SET_PTRACER_ANY
#define PR_SET_PTRACER_ANY ((unsigned long)-1)
#endif

#define EXPORT __attribute__((visibility("default")))
#define MEMFD_NAME USMIPC_ZE_TEST_MEMFD_NAME
#define HANDLE_MAGIC 0x7473747a656d7375ull /* "usmzetst" */
#define MAGIC_OFFSET 56 /* past both of Intel's layouts */
#define IPC_TYPE_DEVICE 0 /* InternalIpcMemoryType::deviceUnifiedMemory */
#define IPC_TYPE_HOST 1   /* InternalIpcMemoryType::hostUnifiedMemory */
#define MAX_FILL_PATTERN 128

/* ---- profiles ------------------------------------------------------------ */

/* How a cr-* profile's zeMemOpenIpcHandle decides that a handle takes the
 * opaque path (research §1.3). */
enum {
  RULE_LEGACY, /* never: opaque handles are off (25.35 to 26.05 defaults) */
  RULE_PID,    /* processId != 0: CR@26.05.37020.3:level_zero/core/source/
                  context/context_imp_drm/context_imp_drm.cpp:70,
                  CR@26.09.37435.12:.../context_imp_drm.cpp:86,
                  CR@26.14.37833.4:.../context_drm/context_drm.cpp:90 */
  RULE_COPY,   /* normalized fd (bytes 0-3) == normalized opaqueHandle (bytes
                  22-25); the pid is not consulted:
                  CR@26.18.38308.4:.../context_drm/context_drm.cpp:131-135,
                  CR@26.31.39395.13:.../context/linux/context_linux.cpp:
                  156-172 (commit 0e12aefdbe, first in 26.18.38308.1) */
};

/* How the opaque path gets the exporter's descriptor when the import cache
 * has none. */
enum {
  FETCH_2605,    /* pidfd_open + pidfd_getfd; if either fails, the socket
                    fallback (EnableIpcSocketFallback defaults to true,
                    CR@26.05.37020.3:shared/source/debug_settings/
                    debug_variables_base.inl:84); if that fails too, no
                    import: CR@26.05.37020.3:level_zero/core/source/context/
                    context_imp_drm/context_imp_drm.cpp:72-117 */
  FETCH_2609,    /* pidfd_open + pidfd_getfd; if either fails, the raw number
                    is imported as a local descriptor (the socket fallback
                    runs only in sockets mode):
                    CR@26.09.37435.12:.../context_imp_drm.cpp:102-124, 127,
                    159-160; CR@26.14.37833.4:.../context_drm.cpp the same */
  FETCH_2618,    /* pidfd_open fails: the raw number is imported;
                    pidfd_getfd fails: no import:
                    CR@26.18.38308.4:.../context_drm/context_drm.cpp:208-227;
                    CR@26.31.39395.13:.../linux/context_linux.cpp:83-104 */
  FETCH_SOCKETS, /* "\0neo_ipc_<pid>" only; failure: no import:
                    CR@26.31.39395.13:.../linux/context_linux.cpp:107-138 */
};

/* Import cache (research §2). */
enum {
  CACHE_NONE,
  CACHE_CONTEXT, /* per context, cacheID -> the fetched descriptor number
                    itself: CR@26.09.37435.12:level_zero/core/source/context/
                    context_imp.h:217-228, 334; context_imp.cpp:1868-1880 */
  CACHE_DRIVER,  /* per driver, cacheID -> {dup, refCount}; a hit returns a
                    new dup: CR@26.18.38308.4:level_zero/core/source/driver/
                    driver_handle.cpp:1024-1045 */
};

/* Event pool IPC handle layouts (ze_ipc_event_pool_handle_t), as
 * EventPool::getIpcHandle writes them (packed, host order); the value is
 * the size of the struct written:
 *  33  IpcEventPoolData, 25.35-25.44 (CR@25.35.35096.9:level_zero/core/
 *      source/event/event.h:56-67, written at event.cpp:397-421): u64 fd,
 *      u64 numEvents, u32 rootDeviceIndex, u32 maxEventPackets, u32
 *      numDevices, bool isDeviceEventPoolAllocation, isHostVisible...,
 *      isImplicitScalingCapable, isEventPoolKernelMappedTsFlagSet,
 *      isEventPoolTsFlagSet (28-32)
 *  27  25.48+: getIpcHandle always writes IpcOpaqueEventPoolData
 *      (CR@25.48.36300.8:.../event/event.h:74-91, event.cpp:402-432), whose
 *      first 27 bytes are the IpcEventPoolData the importer reads
 *      (event.h:58-69: numDevices u16 at 24, the five flags as bits of
 *      byte 26); with the context not in opaque mode, type (27) keeps its
 *      default IpcHandleType::maxHandle (2) and processId (28-31) 0; from
 *      26.18 opaqueHandle (32-39) 0
 *  32  the same in opaque mode, 25.48-26.14: type 0 (fdHandle), processId
 *      = getpid() (CR@26.09.37435.12:.../event.cpp:403-433)
 *  40  opaque mode, 26.18-26.31: and opaqueHandle = the fd
 *      (CR@26.18.38308.4:.../event/event.h:73-96, event.cpp:704-737;
 *      CR@26.31.39395.13:.../event.h:75-98, event.cpp:710-747)
 *  62  after 26.31 (master e37c60bf2a, unreleased; ideal with
 *      USMIPC_ZE_TEST_EVENT_LAYOUT=post-26.31): u64 fd, u64 opaqueHandle,
 *      u32 numEvents, u32 processId, u16 rootDeviceIndex, u8
 *      maxEventPackets, u8 numDevices, flag bits 28, type 29,
 *      reservedHandleData 30-61 (event.h:80-110)
 *  1   ideal with USMIPC_ZE_TEST_EVENT_LAYOUT=unknown: the fd at 40. */
enum { EVL_UNKNOWN = 1, EVL_27 = 27, EVL_32 = 32, EVL_33 = 33, EVL_40 = 40,
       EVL_62 = 62 };

typedef struct profile {
  const char *name;
  unsigned major, minor, build; /* driverVersion, this driver's convention */
  unsigned layout_bytes; /* 0: ideal; else bytes setIPCHandleData writes */
  int rule, fetch, cache;
  bool pools;  /* device USM pools (research §3) */
  bool prctl;  /* prctl(PR_SET_PTRACER_ANY) in zeContextCreate (§7) */
  bool server; /* the exporter serves "\0neo_ipc_<pid>" */
  /* Event pool IPC (EVL_* below). */
  unsigned evl;       /* the layout getIpcHandle writes */
  bool evl_consume;   /* zeEventPoolOpenIpcHandle closes the descriptor at
                         once (26.09+), else at zeEventPoolCloseIpcHandle */
  bool evl_put;       /* zeEventPoolDestroy closes the exported descriptor
                         (26.31), else it stays open until exit */
} profile_t;

/* Layout sizes (research §1.1):
 *  17: IpcMemoryData, CR@25.35.35096.9:level_zero/core/source/context/
 *      context.h:34-40 (identical up to CR@26.31.39395.13:.../context.h:55-62)
 *  22: IpcOpaqueMemoryData, CR@26.05.37020.3:.../context/context.h:44-56
 *  55: + reservedHandleData[32], compressedMemory,
 *      CR@26.09.37435.12:.../context/context.h:44-60
 *  63: + opaqueHandle at 22, CR@26.18.38308.4:.../context/context.h:64-81,
 *      CR@26.31.39395.13:.../context/context.h:64-82 */
#define LEGACY_BYTES 17
static const profile_t profiles[] = {
    [USMIPC_ZE_TEST_PROFILE_IDEAL] = {"ideal", 0, 0, 1, 0, RULE_LEGACY,
                                      FETCH_2609, CACHE_NONE, false, false,
                                      false, EVL_27, true, true},
    /* Opaque handles off on every product before 26.09 unless the debug key
     * EnablePidFdOrSocketsForIpc is set (CR@25.35.35096.9:shared/source/
     * os_interface/product_helper_xe2_and_later.inl:66-71,
     * product_helper_before_xe2.inl:62-67); no L0 device pools on BMG and
     * LNL at 25.35 (research §3). prctl only with opaque handles. */
    [USMIPC_ZE_TEST_PROFILE_CR_25_35] = {"cr-25.35", 25, 35, 35096,
                                         LEGACY_BYTES, RULE_LEGACY, FETCH_2609,
                                         CACHE_NONE, false, false, false,
                                         EVL_33, false, false},
    /* Opaque by EnablePidFdOrSocketsForIpc=1 (CR@26.05.37020.3:shared/
     * source/debug_settings/debug_variables_base.inl:321), decided in the
     * Context constructor, which calls prctl (CR@26.05.37020.3:level_zero/
     * core/source/context/context_imp.cpp:82 -> context_imp_drm/
     * context_imp_drm.cpp:44); the exporter starts the socket server at
     * each new export (context_imp.h:276-287). No import cache yet. Pools
     * are left out: the research places 26.05 with the "no pools" defaults
     * and pooling needs a BMG or LNL product (§3). */
    [USMIPC_ZE_TEST_PROFILE_CR_26_05_OPAQUE] = {"cr-26.05-opaque", 26, 5, 37020,
                                                22, RULE_PID, FETCH_2605,
                                                CACHE_NONE, false, true, true,
                                                EVL_32, false, false},
    /* Opaque on by default on Xe2+ (CR@26.09.37435.12:shared/source/
     * os_interface/product_helper_xe2_and_later.inl:66-71); prctl in the
     * Context constructor (context_imp.cpp:82 -> context_imp_drm/
     * context_imp_drm.cpp:44); device pools on BMG from 25.40 and LNL from
     * 25.44 (research §3). */
    [USMIPC_ZE_TEST_PROFILE_CR_26_09] = {"cr-26.09", 26, 9, 37435, 55, RULE_PID,
                                         FETCH_2609, CACHE_CONTEXT, true, true,
                                         false, EVL_32, true, false},
    [USMIPC_ZE_TEST_PROFILE_CR_26_14] = {"cr-26.14", 26, 14, 37833, 55,
                                         RULE_PID, FETCH_2609, CACHE_CONTEXT,
                                         true, true, false, EVL_32, true,
                                         false},
    [USMIPC_ZE_TEST_PROFILE_CR_26_18] = {"cr-26.18", 26, 18, 38308, 63,
                                         RULE_COPY, FETCH_2618, CACHE_DRIVER,
                                         true, true, false, EVL_40, true,
                                         false},
    /* prctl at every zeContextCreate on every DRM GPU
     * (CR@26.31.39395.13:level_zero/core/source/context/linux/
     * context_linux.cpp:39, from context.cpp:89). */
    [USMIPC_ZE_TEST_PROFILE_CR_26_31] = {"cr-26.31", 26, 31, 39395, 63,
                                         RULE_COPY, FETCH_2618, CACHE_DRIVER,
                                         true, true, false, EVL_40, true,
                                         true},
    /* ForceIpcSocketFallback returns "sockets" before prctl is called
     * (CR@26.31.39395.13:.../linux/context_linux.cpp:34-38); the exporter
     * starts its server at the first export and registers each exported
     * descriptor (context.cpp:810-822, 2234-2236). */
    [USMIPC_ZE_TEST_PROFILE_CR_SOCKETS] = {"cr-sockets", 26, 31, 39395, 63,
                                           RULE_COPY, FETCH_SOCKETS,
                                           CACHE_DRIVER, true, false, true,
                                           EVL_40, true, true},
};
#define NPROFILES (sizeof(profiles) / sizeof(profiles[0]))

/* ---- objects -------------------------------------------------------------- */

/* Each handle type is a struct with a magic number, so that a handle of the
 * wrong kind or a dangling one is refused instead of followed. */
enum { MAGIC_DRIVER = 0x44525652, MAGIC_DEVICE = 0x44455643,
       MAGIC_CONTEXT = 0x43545854, MAGIC_LIST = 0x4c495354,
       MAGIC_EVENT_POOL = 0x45504f4c, MAGIC_EVENT = 0x45564e54 };

/* An import cache entry: cacheID -> descriptor (and, per driver, a count). */
typedef struct cache_entry {
  uint64_t id;
  int fd;
  unsigned refs;
} cache_entry_t;

typedef struct cache {
  cache_entry_t *entries;
  size_t count, capacity;
} cache_t;

struct _ze_driver_handle_t {
  uint32_t magic;
};
struct _ze_device_handle_t {
  uint32_t magic;
};
struct _ze_context_handle_t {
  uint32_t magic;
  cache_t cache; /* CACHE_CONTEXT */
};
/* A command of an asynchronous list, queued for its worker. */
typedef struct cmd cmd_t;

struct _ze_command_list_handle_t {
  uint32_t magic;
  ze_command_queue_mode_t mode;
  /* Asynchronous lists: a worker runs the queued commands in order. */
  bool async;
  pthread_t worker;
  pthread_mutex_t mu;
  pthread_cond_t cv;
  cmd_t *head, *tail;
  bool stop;
};

/* An event pool: its events' state in a memfd (the pool's "dma-buf"),
 * USMIPC_ZE_TEST_EVENT_SLOT bytes per event. */
struct _ze_event_pool_handle_t {
  uint32_t magic;
  uint32_t count;
  ze_event_pool_flags_t flags;
  int memfd;     /* created pools: the memory; -1 for opened ones */
  uint8_t *base; /* shared mapping of the memory */
  size_t size;
  bool imported; /* zeEventPoolOpenIpcHandle */
  int ipc_fd;    /* the exported descriptor (a dup of memfd), or -1 */
  int kept_fd;   /* opened before 26.09: the descriptor it was given,
                    closed at zeEventPoolCloseIpcHandle; else -1 */
  unsigned events; /* live events */
};

struct _ze_event_handle_t {
  uint32_t magic;
  ze_event_pool_handle_t pool;
  uint32_t index;
};

static struct _ze_driver_handle_t the_driver = {MAGIC_DRIVER};
static struct _ze_device_handle_t the_device = {MAGIC_DEVICE};

/* A buffer object: one memfd (the "dma-buf") and its IPC export, which CR
 * tracks per descriptor number in the driver (research §3). */
typedef struct bo {
  int memfd;
  size_t size;
  int ipc_fd;    /* the exported descriptor (a dup of memfd), or -1 */
  int handle_fd; /* the number handles carry: ipc_fd, or with
                    USMIPC_ZE_TEST_HANDLE_FD=devnode a /dev/null */
  unsigned ipc_refs;
} bo_t;

/* A device USM pool (cr-26.09 and later): one memfd, carved sequentially. */
typedef struct pool {
  bo_t bo;
  uint8_t *base;
  size_t used;
} pool_t;

typedef struct allocation {
  void *base;
  size_t size;     /* as requested */
  size_t mapped;   /* page-rounded */
  ze_memory_type_t type;
  uint64_t id;
  bo_t bo[2];   /* device memory outside a pool: its buffer objects */
  unsigned nbo; /* 1, or 2 with USMIPC_ZE_TEST_MULTI_BO */
  pool_t *pool; /* the pool it was carved from, or NULL */
  size_t pool_offset;
  bool exported;   /* an IPC handle was taken of it */
  bool imported;   /* a mapping opened with zeMemOpenIpcHandle */
} allocation_t;

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static allocation_t *allocs;
static size_t alloc_count, alloc_capacity;
static uint64_t next_id = 1;
static usmipc_ze_test_stats_t stats;
static bool initialized, no_fd_ext, no_put;

#define MAX_POOLS 1024
static pool_t *pools[MAX_POOLS];
static size_t pool_count;
static cache_t driver_cache; /* CACHE_DRIVER */

/* The profile and the cr-* knobs (ze_test_driver.h). */
static const profile_t *prof = &profiles[USMIPC_ZE_TEST_PROFILE_IDEAL];
static enum { LOADER_1_8, LOADER_ROUTED, LOADER_UNINITIALIZED } newer_loader;
static bool multi_bo, handle_devnode;
/* Events (ze_test_driver.h). */
static bool no_ipc_events;
static unsigned event_packets = USMIPC_ZE_TEST_EVENT_PACKETS;
static unsigned ideal_evl = EVL_27;
static uint64_t wait_timeout_ms = 20000;

/* How IPC handles are laid out in the ideal profile (knobs). */
static enum {
  LAYOUT_INTEL,   /* IpcMemoryData: u64 fd, u64 pool offset, u8 type */
  LAYOUT_PIDFD,   /* IpcOpaqueMemoryData: the importer's driver fetches the
                     fd itself from processId with pidfd_getfd */
  LAYOUT_UNKNOWN, /* fd at offset 40, an opaque number at 0 */
} layout;

static bool is_cr(void) { return prof->layout_bytes != 0; }

static bool env_on(const char *name) {
  const char *v = getenv(name);
  return v != NULL && v[0] != '\0' && strcmp(v, "0") != 0;
}

/* Reads USMIPC_ZE_TEST_PROFILE and the knobs; false (with a message) for a
 * value this driver does not know, so that a typo fails instead of testing
 * another driver. */
static bool read_config(void) {
  const char *name = getenv("USMIPC_ZE_TEST_PROFILE");
  prof = NULL;
  for (size_t i = 0; i < NPROFILES; i++)
    if (name == NULL || name[0] == '\0' ? i == 0
                                        : !strcmp(name, profiles[i].name))
      prof = &profiles[i];
  if (prof == NULL) {
    fprintf(stderr, "ze_test_driver: unknown USMIPC_ZE_TEST_PROFILE '%s'\n",
            name);
    prof = &profiles[USMIPC_ZE_TEST_PROFILE_IDEAL];
    return false;
  }
  const char *loader = getenv("USMIPC_ZE_TEST_NEWER_LOADER");
  if (loader == NULL || loader[0] == '\0')
    newer_loader = LOADER_1_8;
  else if (!strcmp(loader, "routed"))
    newer_loader = LOADER_ROUTED;
  else if (!strcmp(loader, "uninitialized"))
    newer_loader = LOADER_UNINITIALIZED;
  else {
    fprintf(stderr,
            "ze_test_driver: USMIPC_ZE_TEST_NEWER_LOADER is 'routed' or "
            "'uninitialized', not '%s'\n",
            loader);
    return false;
  }
  const char *hfd = getenv("USMIPC_ZE_TEST_HANDLE_FD");
  handle_devnode = hfd != NULL && !strcmp(hfd, "devnode");
  if (hfd != NULL && hfd[0] != '\0' && !handle_devnode) {
    fprintf(stderr,
            "ze_test_driver: USMIPC_ZE_TEST_HANDLE_FD is 'devnode', not "
            "'%s'\n",
            hfd);
    return false;
  }
  no_ipc_events = env_on("USMIPC_ZE_TEST_NO_IPC_EVENTS");
  const char *packets = getenv("USMIPC_ZE_TEST_EVENT_PACKETS");
  event_packets = packets && packets[0] ? (unsigned)strtoul(packets, NULL, 10)
                                        : USMIPC_ZE_TEST_EVENT_PACKETS;
  const char *wait_ms = getenv("USMIPC_ZE_TEST_WAIT_TIMEOUT_MS");
  wait_timeout_ms = wait_ms && wait_ms[0] ? strtoull(wait_ms, NULL, 10) : 20000;
  const char *evl = getenv("USMIPC_ZE_TEST_EVENT_LAYOUT");
  if (evl == NULL || evl[0] == '\0')
    ideal_evl = EVL_27;
  else if (!strcmp(evl, "post-26.31"))
    ideal_evl = EVL_62;
  else if (!strcmp(evl, "unknown"))
    ideal_evl = EVL_UNKNOWN;
  else {
    fprintf(stderr,
            "ze_test_driver: USMIPC_ZE_TEST_EVENT_LAYOUT is 'post-26.31' or "
            "'unknown', not '%s'\n",
            evl);
    return false;
  }
  multi_bo = env_on("USMIPC_ZE_TEST_MULTI_BO");
  no_fd_ext = env_on("USMIPC_ZE_TEST_NO_FD_EXT");
  no_put = env_on("USMIPC_ZE_TEST_NO_PUT");
  layout = env_on("USMIPC_ZE_TEST_PIDFD_HANDLE")     ? LAYOUT_PIDFD
           : env_on("USMIPC_ZE_TEST_UNKNOWN_LAYOUT") ? LAYOUT_UNKNOWN
                                                     : LAYOUT_INTEL;
  return true;
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

static bo_t bo_new(int memfd, size_t size) {
  bo_t b = {.memfd = memfd, .size = size, .ipc_fd = -1, .handle_fd = -1};
  return b;
}

/* The buffer object whose export handles name by `number` (CR's IPC map is
 * keyed by that number, research §3); lock held. */
static bo_t *bo_by_handle_number(int64_t number) {
  if (number < 0 || number > INT32_MAX)
    return NULL;
  for (size_t i = 0; i < alloc_count; i++)
    for (unsigned k = 0; k < allocs[i].nbo && !allocs[i].imported; k++)
      if (allocs[i].bo[k].ipc_refs > 0 &&
          allocs[i].bo[k].handle_fd == (int)number)
        return &allocs[i].bo[k];
  for (size_t i = 0; i < pool_count; i++)
    if (pools[i]->bo.ipc_refs > 0 && pools[i]->bo.handle_fd == (int)number)
      return &pools[i]->bo;
  return NULL;
}

/* Closes an exported descriptor (CR: closeInternalHandle); lock held. */
static void bo_unexport(bo_t *b) {
  if (b->handle_fd >= 0 && b->handle_fd != b->ipc_fd)
    close(b->handle_fd);
  close(b->ipc_fd);
  b->ipc_fd = b->handle_fd = -1;
  b->ipc_refs = 0;
  stats.live_ipc_handles--;
}

static void start_server_locked(void);

/* Takes a reference on the export of b, exporting it first if needed (a
 * dma-buf export: a new descriptor for the same memory, cached by the
 * allocation: CR@26.31.39395.13:shared/source/os_interface/linux/
 * drm_allocation.cpp:117-131; context.cpp:2217-2219); lock held. */
static ze_result_t bo_export(bo_t *b) {
  if (b->ipc_fd < 0) {
    b->ipc_fd = fcntl(b->memfd, F_DUPFD_CLOEXEC, 0);
    if (b->ipc_fd < 0)
      return ZE_RESULT_ERROR_OUT_OF_HOST_MEMORY;
    b->handle_fd = b->ipc_fd;
    if (handle_devnode && is_cr()) {
      b->handle_fd = open("/dev/null", O_RDWR | O_CLOEXEC);
      if (b->handle_fd < 0) {
        close(b->ipc_fd);
        b->ipc_fd = -1;
        return ZE_RESULT_ERROR_OUT_OF_HOST_MEMORY;
      }
    }
    stats.live_ipc_handles++;
    b->ipc_refs = 0;
  }
  b->ipc_refs++;
  if (prof->server)
    start_server_locked();
  return ZE_RESULT_SUCCESS;
}

/* ---- global, driver, device ----------------------------------------------- */

static ze_result_t ZE_APICALL drv_init(ze_init_flags_t flags) {
  if (flags & ~(ze_init_flags_t)(ZE_INIT_FLAG_GPU_ONLY | ZE_INIT_FLAG_VPU_ONLY))
    return ZE_RESULT_ERROR_INVALID_ENUMERATION;
  if (env_on("USMIPC_ZE_TEST_INIT_FAIL"))
    return ZE_RESULT_ERROR_UNINITIALIZED;
  if (flags & ZE_INIT_FLAG_VPU_ONLY && !(flags & ZE_INIT_FLAG_GPU_ONLY))
    return ZE_RESULT_ERROR_UNINITIALIZED; /* no VPU here */
  pthread_mutex_lock(&lock);
  bool ok = read_config();
  stats.profile = (uint64_t)(prof - profiles);
  initialized = ok;
  pthread_mutex_unlock(&lock);
  return ok ? ZE_RESULT_SUCCESS : ZE_RESULT_ERROR_UNINITIALIZED;
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
  /* ideal: 1; cr-*: the release as (major << 24) | (minor << 16) |
   * (build & 0xffff), this driver's convention (ze_test_driver.h). */
  p->driverVersion =
      (prof->major << 24) | (prof->minor << 16) | (prof->build & 0xffff);
  return ZE_RESULT_SUCCESS;
}

static ze_result_t ZE_APICALL drv_ipc_properties(ze_driver_handle_t d,
                                                 ze_driver_ipc_properties_t *p) {
  if (d != &the_driver)
    return ZE_RESULT_ERROR_INVALID_NULL_HANDLE;
  if (p == NULL)
    return ZE_RESULT_ERROR_INVALID_NULL_POINTER;
  p->flags = ZE_IPC_PROPERTY_FLAG_MEMORY |
             (no_ipc_events ? 0 : ZE_IPC_PROPERTY_FLAG_EVENT_POOL);
  return ZE_RESULT_SUCCESS;
}

/* One extension in every profile: ZE_usmipc_test_driver, which tells a
 * backend that this driver's "dma-bufs" are memfds (ze_test_driver.h). */
static ze_result_t ZE_APICALL
drv_ext_properties(ze_driver_handle_t d, uint32_t *count,
                   ze_driver_extension_properties_t *p) {
  if (d != &the_driver)
    return ZE_RESULT_ERROR_INVALID_NULL_HANDLE;
  if (count == NULL)
    return ZE_RESULT_ERROR_INVALID_NULL_POINTER;
  if (*count == 0 || p == NULL) {
    *count = 1;
    return ZE_RESULT_SUCCESS;
  }
  *count = 1;
  memset(p[0].name, 0, sizeof(p[0].name));
  snprintf(p[0].name, sizeof(p[0].name), "%s", USMIPC_ZE_TEST_EXTENSION_NAME);
  p[0].version = USMIPC_ZE_TEST_EXTENSION_VERSION;
  return ZE_RESULT_SUCCESS;
}

static ze_result_t ZE_APICALL mem_put_ipc_handle(ze_context_handle_t,
                                                 ze_ipc_mem_handle_t);
static ze_result_t ZE_APICALL mem_fd_from_ipc_handle(ze_context_handle_t,
                                                     ze_ipc_mem_handle_t,
                                                     uint64_t *);
static ze_result_t ZE_APICALL zex_mem_get_ipc_handles(ze_context_handle_t,
                                                      const void *, uint32_t *,
                                                      ze_ipc_mem_handle_t *);

/* USMIPC_ZE_TEST_NEWER_LOADER=uninitialized: what a loader >= 1.10 answers
 * for a DDI entry the driver left empty, in its intercept layer
 * (oneapi-src/level-zero@v1.32.0:source/loader/ze_ldrddi.cpp:4299-4311). */
static ze_result_t ZE_APICALL stub_put_ipc_handle(ze_context_handle_t c,
                                                  ze_ipc_mem_handle_t h) {
  (void)c;
  (void)h;
  pthread_mutex_lock(&lock);
  stats.uninitialized_stub_calls++;
  pthread_mutex_unlock(&lock);
  return ZE_RESULT_ERROR_UNINITIALIZED;
}

static ze_result_t ZE_APICALL stub_fd_from_ipc_handle(ze_context_handle_t c,
                                                      ze_ipc_mem_handle_t h,
                                                      uint64_t *out) {
  (void)c;
  (void)h;
  (void)out;
  pthread_mutex_lock(&lock);
  stats.uninitialized_stub_calls++;
  pthread_mutex_unlock(&lock);
  return ZE_RESULT_ERROR_UNINITIALIZED;
}

static ze_result_t ZE_APICALL drv_ext_function(ze_driver_handle_t d,
                                               const char *name, void **fn) {
  if (d != &the_driver)
    return ZE_RESULT_ERROR_INVALID_NULL_HANDLE;
  if (name == NULL || fn == NULL)
    return ZE_RESULT_ERROR_INVALID_NULL_POINTER;
  *fn = NULL;
  if (!is_cr()) {
    if (!strcmp(name, "zeMemPutIpcHandle") && !no_put)
      *fn = (void *)mem_put_ipc_handle;
    else if (!strcmp(name, "zeMemGetFileDescriptorFromIpcHandleExp") &&
             !no_fd_ext)
      *fn = (void *)mem_fd_from_ipc_handle;
    return *fn ? ZE_RESULT_SUCCESS : ZE_RESULT_ERROR_INVALID_ARGUMENT;
  }
  /* CR serves zexMemGetIpcHandles but none of zeMemPutIpcHandle,
   * zeMemGetFileDescriptorFromIpcHandleExp and
   * zeMemGetIpcHandleFromFileDescriptorExp, which are DDI entries (API 1.6)
   * that the loader 1.8 neither exports nor routes; an unknown name is
   * ZE_RESULT_ERROR_INVALID_ARGUMENT (CR@26.31.39395.13:level_zero/core/
   * source/driver/driver_handle.cpp:156-162; the list:
   * extension_function_address.cpp:43-171; the same IPC names at 25.35 and
   * 26.09, research §4). NEWER_LOADER stands for the loader's side. */
  if (!strcmp(name, USMIPC_ZE_TEST_ZEX_GET_IPC_HANDLES))
    *fn = (void *)zex_mem_get_ipc_handles;
  else if (!strcmp(name, "zeMemPutIpcHandle") && newer_loader != LOADER_1_8)
    *fn = newer_loader == LOADER_ROUTED ? (void *)mem_put_ipc_handle
                                        : (void *)stub_put_ipc_handle;
  else if (!strcmp(name, "zeMemGetFileDescriptorFromIpcHandleExp") &&
           newer_loader != LOADER_1_8)
    *fn = newer_loader == LOADER_ROUTED ? (void *)mem_fd_from_ipc_handle
                                        : (void *)stub_fd_from_ipc_handle;
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

/* The specification's two-call protocol: *count 0 (or no array) asks how
 * many; otherwise at most *count are filled and *count says how many. */
static ze_result_t ZE_APICALL
dev_memory_properties(ze_device_handle_t d, uint32_t *count,
                      ze_device_memory_properties_t *p) {
  if (!good_device(d))
    return ZE_RESULT_ERROR_INVALID_NULL_HANDLE;
  if (count == NULL)
    return ZE_RESULT_ERROR_INVALID_NULL_POINTER;
  if (*count == 0 || p == NULL) {
    *count = USMIPC_ZE_TEST_MEMORIES;
    return ZE_RESULT_SUCCESS;
  }
  if (*count > USMIPC_ZE_TEST_MEMORIES)
    *count = USMIPC_ZE_TEST_MEMORIES;
  for (uint32_t i = 0; i < *count; i++) {
    if (p[i].stype != ZE_STRUCTURE_TYPE_DEVICE_MEMORY_PROPERTIES)
      return ZE_RESULT_ERROR_INVALID_ARGUMENT;
    p[i].flags = 0;
    p[i].maxClockRate = 1000;
    p[i].maxBusWidth = 64;
    p[i].totalSize = USMIPC_ZE_TEST_MEMORY_BYTES;
    memset(p[i].name, 0, sizeof(p[i].name));
    snprintf(p[i].name, sizeof(p[i].name), "HBM%u", (unsigned)i);
  }
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
  /* CR makes the whole process ptrace-attachable by any process of the
   * user when the context decides on opaque handles (research §7):
   * CR@26.09.37435.12:level_zero/core/source/context/context_imp.cpp:82 ->
   * context_imp_drm/context_imp_drm.cpp:44; CR@26.31.39395.13:level_zero/
   * core/source/context/linux/context_linux.cpp:39. Where prctl fails (a
   * kernel without Yama) CR 26.05+ would switch to sockets mode
   * (context_linux.cpp:39-46); this driver keeps the profile's mode, so
   * that a profile means the same on every machine (cr-sockets is that
   * mode). */
  if (c != NULL && prof->prctl &&
      prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY, 0, 0, 0) == 0)
    stats.ptracer_any_set++;
  pthread_mutex_unlock(&lock);
  if (c == NULL)
    return ZE_RESULT_ERROR_OUT_OF_HOST_MEMORY;
  c->magic = MAGIC_CONTEXT;
  memset(&c->cache, 0, sizeof(c->cache));
  *out = c;
  return ZE_RESULT_SUCCESS;
}

static ze_result_t ZE_APICALL ctx_destroy(ze_context_handle_t c) {
  if (!good_context(c))
    return ZE_RESULT_ERROR_INVALID_NULL_HANDLE;
  c->magic = 0;
  /* CR's per-context cache goes with the context; the descriptors in it
   * stay open (nothing closes them, research §2). */
  pthread_mutex_lock(&lock);
  free(c->cache.entries);
  memset(&c->cache, 0, sizeof(c->cache));
  pthread_mutex_unlock(&lock);
  return ZE_RESULT_SUCCESS;
}

/* ---- events: state, waits ------------------------------------------------- */

static bool good_event(ze_event_handle_t e) {
  return e != NULL && e->magic == MAGIC_EVENT;
}

/* The event's state word in its pool's shared memory: 0 not signalled, 1
 * signalled. Every process that opened the pool sees the same word. */
static uint32_t *event_state(ze_event_handle_t e) {
  return (uint32_t *)(e->pool->base +
                      (size_t)e->index * USMIPC_ZE_TEST_EVENT_SLOT);
}

static void event_set(ze_event_handle_t e, uint32_t v) {
  __atomic_store_n(event_state(e), v, __ATOMIC_RELEASE);
  pthread_mutex_lock(&lock);
  if (v)
    stats.event_signals++;
  else
    stats.event_resets++;
  pthread_mutex_unlock(&lock);
}

static bool event_is_set(ze_event_handle_t e) {
  return __atomic_load_n(event_state(e), __ATOMIC_ACQUIRE) == 1;
}

static uint64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* Polls until every event is signalled (true) or timeout_ns pass (false;
 * UINT64_MAX waits without limit). The state may be written by another
 * process, so there is nothing to block on but time. */
static bool events_wait(uint32_t n, ze_event_handle_t *evs, uint64_t timeout_ns) {
  uint64_t start = now_ns();
  for (;;) {
    bool all = true;
    for (uint32_t i = 0; i < n && all; i++)
      all = event_is_set(evs[i]);
    if (all)
      return true;
    if (timeout_ns != UINT64_MAX && now_ns() - start >= timeout_ns)
      return false;
    struct timespec ts = {0, 50000};
    nanosleep(&ts, NULL);
  }
}

/* ---- contexts and command lists: commands ------------------------------ */

enum { CMD_COPY, CMD_FILL, CMD_BARRIER, CMD_SIGNAL, CMD_RESET, CMD_DELAY };

struct cmd {
  int kind;
  void *dst;
  const void *src;
  size_t size;
  uint8_t pattern[MAX_FILL_PATTERN];
  size_t pattern_size;
  ze_event_handle_t target; /* CMD_RESET */
  ze_event_handle_t signal; /* signalled when the command is done */
  uint32_t nwait;           /* events it waits for first */
  ze_event_handle_t *waits;
  uint32_t ms; /* CMD_DELAY */
  cmd_t *next;
};

static void cmd_free(cmd_t *c) {
  free(c->waits);
  free(c);
}

/* Runs a command: its waits (a hung "GPU" past USMIPC_ZE_TEST_WAIT_TIMEOUT_MS
 * is ZE_RESULT_ERROR_DEVICE_LOST), the work, the signal. */
static ze_result_t cmd_run(cmd_t *c) {
  if (c->nwait > 0) {
    pthread_mutex_lock(&lock);
    stats.event_waits++;
    pthread_mutex_unlock(&lock);
    if (!events_wait(c->nwait, c->waits, wait_timeout_ms * 1000000u)) {
      pthread_mutex_lock(&lock);
      stats.wait_timeouts++;
      pthread_mutex_unlock(&lock);
      return ZE_RESULT_ERROR_DEVICE_LOST;
    }
  }
  switch (c->kind) {
  case CMD_COPY:
    memmove(c->dst, c->src, c->size);
    break;
  case CMD_FILL:
    for (size_t i = 0; i < c->size; i += c->pattern_size)
      memcpy((uint8_t *)c->dst + i, c->pattern, c->pattern_size);
    break;
  case CMD_RESET:
    event_set(c->target, 0);
    break;
  case CMD_DELAY: {
    struct timespec ts = {(time_t)(c->ms / 1000),
                          (long)(c->ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR)
      ;
    break;
  }
  default: /* CMD_BARRIER, CMD_SIGNAL: only the signal */
    break;
  }
  if (c->signal != NULL)
    event_set(c->signal, 1);
  return ZE_RESULT_SUCCESS;
}

static void *list_worker(void *arg) {
  ze_command_list_handle_t l = arg;
  pthread_mutex_lock(&l->mu);
  for (;;) {
    while (l->head == NULL && !l->stop)
      pthread_cond_wait(&l->cv, &l->mu);
    cmd_t *c = l->head;
    if (c == NULL)
      break;
    pthread_mutex_unlock(&l->mu);
    cmd_run(c);
    pthread_mutex_lock(&lock);
    stats.async_commands++;
    pthread_mutex_unlock(&lock);
    pthread_mutex_lock(&l->mu);
    l->head = c->next;
    if (l->head == NULL)
      l->tail = NULL;
    cmd_free(c);
    pthread_cond_broadcast(&l->cv);
  }
  pthread_mutex_unlock(&l->mu);
  return NULL;
}

/* A new command for list l, waiting for waits[0..nwait) and signalling
 * signal; NULL with *res set when an argument is bad. */
static cmd_t *cmd_new(ze_command_list_handle_t l, int kind,
                      ze_event_handle_t signal, uint32_t nwait,
                      ze_event_handle_t *waits, ze_result_t *res) {
  *res = ZE_RESULT_ERROR_INVALID_NULL_HANDLE;
  if (l == NULL || l->magic != MAGIC_LIST)
    return NULL;
  if (signal != NULL && !good_event(signal))
    return NULL;
  if (nwait > 0 && waits == NULL) {
    *res = ZE_RESULT_ERROR_INVALID_NULL_POINTER;
    return NULL;
  }
  for (uint32_t i = 0; i < nwait; i++)
    if (!good_event(waits[i]))
      return NULL;
  cmd_t *c = calloc(1, sizeof(*c));
  if (c == NULL || (nwait > 0 && (c->waits = calloc(nwait, sizeof(*waits))) ==
                                     NULL)) {
    free(c);
    *res = ZE_RESULT_ERROR_OUT_OF_HOST_MEMORY;
    return NULL;
  }
  c->kind = kind;
  c->signal = signal;
  c->nwait = nwait;
  if (nwait > 0)
    memcpy(c->waits, waits, nwait * sizeof(*waits));
  *res = ZE_RESULT_SUCCESS;
  return c;
}

/* Runs c now (a synchronous list: the append returns when it is done) or
 * queues it for the list's worker (an asynchronous one). */
static ze_result_t cmd_append(ze_command_list_handle_t l, cmd_t *c) {
  if (!l->async) {
    ze_result_t res = cmd_run(c);
    cmd_free(c);
    return res;
  }
  pthread_mutex_lock(&l->mu);
  if (l->tail != NULL)
    l->tail->next = c;
  else
    l->head = c;
  l->tail = c;
  pthread_cond_broadcast(&l->cv);
  pthread_mutex_unlock(&l->mu);
  return ZE_RESULT_SUCCESS;
}

/* CR's immediate lists are asynchronous unless made synchronous (the
 * default mode is asynchronous). */
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
  ze_command_list_handle_t l = calloc(1, sizeof(*l));
  if (l == NULL)
    return ZE_RESULT_ERROR_OUT_OF_HOST_MEMORY;
  l->magic = MAGIC_LIST;
  l->mode = desc->mode;
  l->async = desc->mode != ZE_COMMAND_QUEUE_MODE_SYNCHRONOUS;
  pthread_mutex_init(&l->mu, NULL);
  pthread_cond_init(&l->cv, NULL);
  if (l->async && pthread_create(&l->worker, NULL, list_worker, l) != 0) {
    free(l);
    return ZE_RESULT_ERROR_OUT_OF_HOST_MEMORY;
  }
  *out = l;
  return ZE_RESULT_SUCCESS;
}

/* An asynchronous list finishes its queued commands first. */
static ze_result_t ZE_APICALL list_destroy(ze_command_list_handle_t l) {
  if (l == NULL || l->magic != MAGIC_LIST)
    return ZE_RESULT_ERROR_INVALID_NULL_HANDLE;
  l->magic = 0;
  if (l->async) {
    pthread_mutex_lock(&l->mu);
    l->stop = true;
    pthread_cond_broadcast(&l->cv);
    pthread_mutex_unlock(&l->mu);
    pthread_join(l->worker, NULL);
  }
  pthread_cond_destroy(&l->cv);
  pthread_mutex_destroy(&l->mu);
  free(l);
  return ZE_RESULT_SUCCESS;
}

static ze_result_t ZE_APICALL list_copy(ze_command_list_handle_t l, void *dst,
                                        const void *src, size_t size,
                                        ze_event_handle_t signal,
                                        uint32_t nwait, ze_event_handle_t *wait) {
  ze_result_t res;
  if (dst == NULL || src == NULL)
    return l == NULL || l->magic != MAGIC_LIST
               ? ZE_RESULT_ERROR_INVALID_NULL_HANDLE
               : ZE_RESULT_ERROR_INVALID_NULL_POINTER;
  cmd_t *c = cmd_new(l, CMD_COPY, signal, nwait, wait, &res);
  if (c == NULL)
    return res;
  c->dst = dst;
  c->src = src;
  c->size = size;
  return cmd_append(l, c);
}

/* The pattern is copied at the append, as CR does. */
static ze_result_t ZE_APICALL list_fill(ze_command_list_handle_t l, void *ptr,
                                        const void *pattern, size_t pattern_size,
                                        size_t size, ze_event_handle_t signal,
                                        uint32_t nwait, ze_event_handle_t *wait) {
  ze_result_t res;
  if (ptr == NULL || pattern == NULL)
    return l == NULL || l->magic != MAGIC_LIST
               ? ZE_RESULT_ERROR_INVALID_NULL_HANDLE
               : ZE_RESULT_ERROR_INVALID_NULL_POINTER;
  if (pattern_size == 0 || pattern_size > MAX_FILL_PATTERN ||
      (pattern_size & (pattern_size - 1)) != 0 || size % pattern_size != 0)
    return ZE_RESULT_ERROR_INVALID_SIZE;
  cmd_t *c = cmd_new(l, CMD_FILL, signal, nwait, wait, &res);
  if (c == NULL)
    return res;
  c->dst = ptr;
  c->size = size;
  memcpy(c->pattern, pattern, pattern_size);
  c->pattern_size = pattern_size;
  return cmd_append(l, c);
}

/* Everything appended before it is done before it signals (and, on an
 * asynchronous list, before anything after it runs: one worker, in order). */
static ze_result_t ZE_APICALL list_barrier(ze_command_list_handle_t l,
                                           ze_event_handle_t signal,
                                           uint32_t nwait,
                                           ze_event_handle_t *wait) {
  ze_result_t res;
  cmd_t *c = cmd_new(l, CMD_BARRIER, signal, nwait, wait, &res);
  return c == NULL ? res : cmd_append(l, c);
}

static ze_result_t ZE_APICALL list_signal_event(ze_command_list_handle_t l,
                                                ze_event_handle_t e) {
  if (e == NULL)
    return ZE_RESULT_ERROR_INVALID_NULL_HANDLE;
  ze_result_t res;
  cmd_t *c = cmd_new(l, CMD_SIGNAL, e, 0, NULL, &res);
  return c == NULL ? res : cmd_append(l, c);
}

static ze_result_t ZE_APICALL list_wait_on_events(ze_command_list_handle_t l,
                                                  uint32_t n,
                                                  ze_event_handle_t *events) {
  ze_result_t res;
  if (n == 0)
    return ZE_RESULT_ERROR_INVALID_SIZE;
  cmd_t *c = cmd_new(l, CMD_BARRIER, NULL, n, events, &res);
  return c == NULL ? res : cmd_append(l, c);
}

static ze_result_t ZE_APICALL list_event_reset(ze_command_list_handle_t l,
                                               ze_event_handle_t e) {
  if (!good_event(e))
    return ZE_RESULT_ERROR_INVALID_NULL_HANDLE;
  ze_result_t res;
  cmd_t *c = cmd_new(l, CMD_RESET, NULL, 0, NULL, &res);
  if (c == NULL)
    return res;
  c->target = e;
  return cmd_append(l, c);
}

/* usmipcZeTestDriverAppendDelay (ze_test_driver.h). */
EXPORT ze_result_t usmipcZeTestDriverAppendDelay(ze_command_list_handle_t l,
                                                 uint32_t ms) {
  ze_result_t res;
  cmd_t *c = cmd_new(l, CMD_DELAY, NULL, 0, NULL, &res);
  if (c == NULL)
    return res;
  c->ms = ms;
  pthread_mutex_lock(&lock);
  stats.delays++;
  pthread_mutex_unlock(&lock);
  return cmd_append(l, c);
}

/* ---- memory ----------------------------------------------------------------- */

/* Carves a device allocation out of the newest pool, or a new one (research
 * §3: device allocations of at most 1 MB come from 2 MB pools,
 * CR@26.31.39395.13:level_zero/core/source/driver/driver_handle.cpp:417-439,
 * shared/source/dll/usm_pool_size.cpp:13-15; CR@25.35.35096.9:level_zero/
 * core/source/driver/driver_handle_imp.cpp:391-414). Pools live as long as
 * the process, as CR's live as long as the driver; lock held. */
static ze_result_t pool_carve(allocation_t *a) {
  pool_t *p = pool_count ? pools[pool_count - 1] : NULL;
  if (p == NULL || p->used + a->mapped > USMIPC_ZE_TEST_POOL_SIZE) {
    if (pool_count == MAX_POOLS)
      return ZE_RESULT_ERROR_OUT_OF_DEVICE_MEMORY;
    p = calloc(1, sizeof(*p));
    int memfd = memfd_create(MEMFD_NAME, MFD_CLOEXEC);
    if (p == NULL || memfd < 0 ||
        ftruncate(memfd, (off_t)USMIPC_ZE_TEST_POOL_SIZE) != 0 ||
        (p->base = mmap(NULL, USMIPC_ZE_TEST_POOL_SIZE, PROT_READ | PROT_WRITE,
                        MAP_SHARED, memfd, 0)) == MAP_FAILED) {
      if (memfd >= 0)
        close(memfd);
      free(p);
      return ZE_RESULT_ERROR_OUT_OF_DEVICE_MEMORY;
    }
    p->bo = bo_new(memfd, USMIPC_ZE_TEST_POOL_SIZE);
    pools[pool_count++] = p;
  }
  a->pool = p;
  a->pool_offset = p->used;
  a->base = p->base + p->used;
  p->used += a->mapped;
  stats.pooled_allocations++;
  return ZE_RESULT_SUCCESS;
}

/* Device memory outside a pool: one memfd, or two buffer objects side by
 * side (USMIPC_ZE_TEST_MULTI_BO: one BO per memory bank, research §6). */
static ze_result_t device_memory(allocation_t *a) {
  unsigned nbo =
      is_cr() && multi_bo && a->size >= USMIPC_ZE_TEST_MULTI_BO_MIN ? 2 : 1;
  size_t first = nbo == 2 ? page_round(a->mapped / 2) : a->mapped;
  size_t sizes[2] = {first, a->mapped - first};
  uint8_t *base =
      nbo == 1 ? NULL
               : mmap(NULL, a->mapped, PROT_NONE,
                      MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (base == MAP_FAILED)
    return ZE_RESULT_ERROR_OUT_OF_DEVICE_MEMORY;
  size_t at = 0;
  for (unsigned k = 0; k < nbo; k++) {
    int memfd = memfd_create(MEMFD_NAME, MFD_CLOEXEC);
    void *p = MAP_FAILED;
    if (memfd >= 0 && ftruncate(memfd, (off_t)sizes[k]) == 0)
      p = mmap(base ? base + at : NULL, sizes[k], PROT_READ | PROT_WRITE,
               MAP_SHARED | (base ? MAP_FIXED : 0), memfd, 0);
    if (p == MAP_FAILED) {
      if (memfd >= 0)
        close(memfd);
      for (unsigned j = 0; j < k; j++)
        close(a->bo[j].memfd);
      if (base != NULL)
        munmap(base, a->mapped);
      return ZE_RESULT_ERROR_OUT_OF_DEVICE_MEMORY;
    }
    if (base == NULL)
      base = p;
    a->bo[k] = bo_new(memfd, sizes[k]);
    at += sizes[k];
  }
  a->nbo = nbo;
  a->base = base;
  return ZE_RESULT_SUCCESS;
}

static ze_result_t alloc_common(ze_context_handle_t c, ze_memory_type_t type,
                                size_t size, size_t alignment, bool exported,
                                void **out) {
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
  allocation_t a = {.size = size, .mapped = page_round(size), .type = type};
  /* An allocation with an export descriptor is never pooled
   * (CR@26.09.37435.12:level_zero/core/source/context/context_imp.cpp:327;
   * CR@26.31.39395.13:.../context.cpp:352-356). */
  if (type == ZE_MEMORY_TYPE_DEVICE && prof->pools && !exported &&
      size <= USMIPC_ZE_TEST_POOLED_MAX) {
    pthread_mutex_lock(&lock);
    ze_result_t res = pool_carve(&a);
    if (res == ZE_RESULT_SUCCESS)
      res = add(&a);
    if (res == ZE_RESULT_SUCCESS)
      stats.live_allocations++;
    pthread_mutex_unlock(&lock);
    if (res == ZE_RESULT_SUCCESS)
      *out = a.base;
    return res;
  }
  if (type == ZE_MEMORY_TYPE_DEVICE) {
    ze_result_t res = device_memory(&a);
    if (res != ZE_RESULT_SUCCESS)
      return res;
  } else {
    a.base = mmap(NULL, a.mapped, PROT_READ | PROT_WRITE,
                  MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (a.base == MAP_FAILED)
      return ZE_RESULT_ERROR_OUT_OF_HOST_MEMORY;
  }
  pthread_mutex_lock(&lock);
  ze_result_t res = add(&a);
  if (res == ZE_RESULT_SUCCESS)
    stats.live_allocations++;
  pthread_mutex_unlock(&lock);
  if (res != ZE_RESULT_SUCCESS) {
    munmap(a.base, a.mapped);
    for (unsigned k = 0; k < a.nbo; k++)
      close(a.bo[k].memfd);
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
  /* ze_external_memory_export_desc_t with DMA_BUF, OPAQUE_FD or
   * OPAQUE_WIN32 sets exportMemory, any other flags are refused
   * (CR@26.09.37435.12:level_zero/core/source/helpers/
   * properties_parser.h:158-166). */
  bool exported = false;
  for (const ze_base_desc_t *x = dd->pNext; x != NULL; x = x->pNext) {
    if (x->stype != ZE_STRUCTURE_TYPE_EXTERNAL_MEMORY_EXPORT_DESC)
      continue;
    const ze_external_memory_export_desc_t *e = (const void *)x;
    if (e->flags & (ZE_EXTERNAL_MEMORY_TYPE_FLAG_DMA_BUF |
                    ZE_EXTERNAL_MEMORY_TYPE_FLAG_OPAQUE_FD |
                    ZE_EXTERNAL_MEMORY_TYPE_FLAG_OPAQUE_WIN32))
      exported = true;
    else if (is_cr())
      return ZE_RESULT_ERROR_UNSUPPORTED_ENUMERATION;
  }
  return alloc_common(c, ZE_MEMORY_TYPE_DEVICE, size, alignment, exported, out);
}

static ze_result_t ZE_APICALL mem_alloc_host(ze_context_handle_t c,
                                             const ze_host_mem_alloc_desc_t *hd,
                                             size_t size, size_t alignment,
                                             void **out) {
  if (hd == NULL)
    return ZE_RESULT_ERROR_INVALID_NULL_POINTER;
  if (hd->stype != ZE_STRUCTURE_TYPE_HOST_MEM_ALLOC_DESC)
    return ZE_RESULT_ERROR_INVALID_ARGUMENT;
  return alloc_common(c, ZE_MEMORY_TYPE_HOST, size, alignment, false, out);
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
  return alloc_common(c, ZE_MEMORY_TYPE_SHARED, size, alignment, false, out);
}

/* What zeMemFree does to the IPC export of a freed allocation a (already
 * dropped from the table); lock held. */
static void free_exports(const allocation_t *a) {
  if (!is_cr()) {
    bo_t b = a->bo[0];
    if (a->nbo == 0 || b.ipc_fd < 0)
      return;
    if (no_put) {
      /* Without zeMemPutIpcHandle (API 1.4) the handle lives as long as the
       * allocation, so freeing releases it. */
      bo_unexport(&b);
    } else {
      /* An IPC handle nobody put: its fd stays open (leaked) until the
       * process exits, the worst case of a driver that keeps handles until
       * they are put. The tests check that usmipc never gets here. */
      stats.freed_with_live_handle++;
    }
    return;
  }
  /* CR: the IPC entry of the allocation's base (for pooled memory, the
   * pool's) loses a reference, and its descriptor is closed when the count
   * reaches 0 or the allocation is not pooled
   * (CR@26.09.37435.12:level_zero/core/source/context/context_imp.cpp:
   * 542-565, `refcnt == 0 || nullptr == usmPool` at 558;
   * CR@26.31.39395.13:.../context.cpp:571-597; CR@25.35.35096.9:.../
   * context_imp.cpp:544-559). So freeing any allocation of a pool drops
   * the count that another allocation's export holds (research §3). */
  if (a->pool != NULL) {
    bo_t *b = &a->pool->bo;
    if (b->ipc_fd < 0)
      return;
    if (a->exported)
      stats.freed_with_live_handle++;
    else
      stats.pool_refs_dropped_by_unexported_free++;
    if (--b->ipc_refs > 0)
      return;
    for (size_t i = 0; i < alloc_count; i++)
      if (allocs[i].pool == a->pool && allocs[i].exported) {
        stats.pool_fd_closed_while_exported++;
        break;
      }
    bo_unexport(b);
    stats.exported_fd_closed_by_free++;
    return;
  }
  bool live = false;
  for (unsigned k = 0; k < a->nbo; k++) {
    bo_t b = a->bo[k];
    if (b.ipc_fd < 0)
      continue;
    live = true;
    bo_unexport(&b);
    stats.exported_fd_closed_by_free++;
  }
  if (live)
    stats.freed_with_live_handle++;
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
  free_exports(&copy);
  pthread_mutex_unlock(&lock);
  if (copy.pool != NULL)
    return ZE_RESULT_SUCCESS; /* the pool keeps the memory */
  munmap(copy.base, copy.mapped);
  for (unsigned k = 0; k < copy.nbo; k++)
    close(copy.bo[k].memfd);
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

/* For pooled memory the allocation's own range, as CR answers
 * (CR@26.09.37435.12:.../context_imp.cpp:735-746). */
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

/* ---- IPC: handles -------------------------------------------------------- */

/* The handle, in one of Intel's two layouts (packed, little-endian):
 *   IpcMemoryData        0: u64 fd  8: u64 pool offset  16: u8 type
 *   IpcOpaqueMemoryData  0: int fd (in a u64)  8: u64 pool offset
 *                        16: u32 processId  20: u8 handle type (0: fd)
 *                        21: u8 memory type  22: 32 reserved bytes
 * or, for USMIPC_ZE_TEST_UNKNOWN_LAYOUT, with the fd at offset 40 and an
 * opaque number at 0. This driver's magic sits at offset 56 in all. (The
 * ideal profile; cr_encode writes the cr-* profiles' handles.) */
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

/* A cr-* handle, as setIPCHandleData writes it
 * (CR@26.31.39395.13:level_zero/core/source/context/context.cpp:2182-2214;
 * CR@25.35.35096.9:.../context_imp.h:215-235): the layout's own bytes are
 * zeroed first (`ipcData = {}`), bytes past it keep what the caller had.
 *   17 bytes (legacy): u64 fd, u64 poolOffset, u8 type (0: device)
 *   22, 55, 63 bytes (opaque): int fd (4-7 zero), u64 poolOffset,
 *     u32 processId = getpid(), u8 handle type (0: fd), u8 memory type;
 *     55: reservedHandleData 22-53 (filled only for fabric handles,
 *     context.cpp:1063-1067) and compressedMemory 54, zero;
 *     63: opaqueHandle at 22 (a copy of the fd, 26-29 zero), reserved
 *     30-61, compressedMemory 62. */
static void cr_encode(ze_ipc_mem_handle_t *h, int fd, uint64_t pool_offset) {
  memset(h->data, 0, prof->layout_bytes);
  if (prof->layout_bytes == LEGACY_BYTES) {
    uint64_t fd64 = (uint64_t)fd;
    memcpy(h->data, &fd64, 8);
    memcpy(h->data + 8, &pool_offset, 8);
    h->data[16] = IPC_TYPE_DEVICE;
    return;
  }
  uint32_t pid = (uint32_t)getpid();
  memcpy(h->data, &fd, 4);
  memcpy(h->data + 8, &pool_offset, 8);
  memcpy(h->data + 16, &pid, 4);
  h->data[20] = 0; /* IpcHandleType::fdHandle */
  h->data[21] = IPC_TYPE_DEVICE;
  if (prof->layout_bytes == 63)
    memcpy(h->data + 22, &fd, 4);
}

/* The number CR's IPC map knows a handle by: bytes 0-3 (opaque) or 0-7
 * (legacy) (CR@26.31.39395.13:.../context.cpp:832-869, 932-978). */
static int64_t cr_handle_number(const ze_ipc_mem_handle_t *h) {
  if (prof->layout_bytes == LEGACY_BYTES) {
    uint64_t n;
    memcpy(&n, h->data, 8);
    return (int64_t)n;
  }
  int32_t n;
  memcpy(&n, h->data, 4);
  return n;
}

/* Exports the buffer objects of the allocation at ptr into handles (at most
 * *count of them); lock held. zeMemGetIpcHandle is this with one handle:
 * it exports BO 0 only (CR@26.31.39395.13:level_zero/core/source/context/
 * context.cpp:1110-1114, the loop at 1058-1087). A pooled allocation's
 * handle names the pool's descriptor and the offset in the pool
 * (context.cpp:980-1089, 2211-2237). */
static ze_result_t export_handles(const void *ptr, uint32_t *count,
                                  ze_ipc_mem_handle_t *handles) {
  allocation_t *a = find(ptr);
  if (a == NULL || a->imported)
    return ZE_RESULT_ERROR_INVALID_ARGUMENT;
  if (a->type != ZE_MEMORY_TYPE_DEVICE)
    return ZE_RESULT_ERROR_UNSUPPORTED_FEATURE; /* anonymous: not shareable */
  uint32_t n = a->pool != NULL ? 1 : a->nbo;
  if (*count > n)
    *count = n;
  for (uint32_t k = 0; k < *count; k++) {
    bo_t *b = a->pool != NULL ? &a->pool->bo : &a->bo[k];
    ze_result_t res = bo_export(b);
    if (res != ZE_RESULT_SUCCESS)
      return res;
    a->exported = true;
    stats.ipc_gets++;
    if (is_cr())
      cr_encode(&handles[k], b->handle_fd, a->pool ? a->pool_offset : 0);
    else
      handle_encode(&handles[k], b->ipc_fd, a->id);
  }
  return ZE_RESULT_SUCCESS;
}

static ze_result_t ZE_APICALL mem_get_ipc_handle(ze_context_handle_t c,
                                                 const void *ptr,
                                                 ze_ipc_mem_handle_t *h) {
  if (!good_context(c))
    return ZE_RESULT_ERROR_INVALID_NULL_HANDLE;
  if (ptr == NULL || h == NULL)
    return ZE_RESULT_ERROR_INVALID_NULL_POINTER;
  uint32_t one = 1;
  pthread_mutex_lock(&lock);
  ze_result_t res = export_handles(ptr, &one, h);
  pthread_mutex_unlock(&lock);
  return res;
}

/* zexMemGetIpcHandles (cr-* profiles, through the extension lookup):
 * *numIpcHandles == 0 or pIpcHandles NULL asks for the count. */
static ze_result_t ZE_APICALL zex_mem_get_ipc_handles(
    ze_context_handle_t c, const void *ptr, uint32_t *numIpcHandles,
    ze_ipc_mem_handle_t *pIpcHandles) {
  if (!good_context(c))
    return ZE_RESULT_ERROR_INVALID_NULL_HANDLE;
  if (ptr == NULL || numIpcHandles == NULL)
    return ZE_RESULT_ERROR_INVALID_NULL_POINTER;
  pthread_mutex_lock(&lock);
  stats.zex_get_ipc_handles++;
  ze_result_t res;
  if (*numIpcHandles == 0 || pIpcHandles == NULL) {
    allocation_t *a = find(ptr);
    res = a == NULL || a->imported ? ZE_RESULT_ERROR_INVALID_ARGUMENT
          : a->type != ZE_MEMORY_TYPE_DEVICE
              ? ZE_RESULT_ERROR_UNSUPPORTED_FEATURE
              : ZE_RESULT_SUCCESS;
    if (res == ZE_RESULT_SUCCESS)
      *numIpcHandles = a->pool != NULL ? 1 : a->nbo;
  } else {
    res = export_handles(ptr, numIpcHandles, pIpcHandles);
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

/* ideal: by the handle's fd. cr-* (NEWER_LOADER=routed): by the number in
 * bytes 0-3 (0-7 legacy), refcount-- of whichever export has that number,
 * closed at 0, and an unknown number is a success
 * (CR@26.31.39395.13:level_zero/core/source/context/context.cpp:832-869;
 * CR@26.09.37435.12:.../context_imp.cpp:780-800; research §3). */
static ze_result_t ZE_APICALL mem_put_ipc_handle(ze_context_handle_t c,
                                                 ze_ipc_mem_handle_t h) {
  if (!good_context(c))
    return ZE_RESULT_ERROR_INVALID_NULL_HANDLE;
  int64_t number = is_cr() ? cr_handle_number(&h) : handle_fd(&h);
  pthread_mutex_lock(&lock);
  bo_t *b = bo_by_handle_number(number);
  if (b != NULL) {
    stats.ipc_puts++;
    if (--b->ipc_refs == 0)
      bo_unexport(b);
  }
  pthread_mutex_unlock(&lock);
  /* Intel's driver answers success for a handle it does not know, too. */
  return ZE_RESULT_SUCCESS;
}

/* Only numbers this process exported are known (CR@26.31.39395.13:
 * .../context.cpp:932-978): an unknown one is
 * ZE_RESULT_ERROR_OUT_OF_HOST_MEMORY up to 26.14 (CR@25.35.35096.9:
 * .../context_imp.cpp:751-795) and ZE_RESULT_ERROR_INVALID_ARGUMENT from
 * 26.18 (research §4). */
static ze_result_t ZE_APICALL mem_fd_from_ipc_handle(ze_context_handle_t c,
                                                     ze_ipc_mem_handle_t h,
                                                     uint64_t *out) {
  if (!good_context(c))
    return ZE_RESULT_ERROR_INVALID_NULL_HANDLE;
  if (out == NULL)
    return ZE_RESULT_ERROR_INVALID_NULL_POINTER;
  int64_t number = is_cr() ? cr_handle_number(&h) : handle_fd(&h);
  pthread_mutex_lock(&lock);
  bool known;
  if (is_cr()) {
    known = bo_by_handle_number(number) != NULL;
  } else {
    known = false;
    for (size_t i = 0; i < alloc_count && !known; i++)
      known =
          allocs[i].nbo > 0 && allocs[i].bo[0].ipc_fd == number && number >= 0;
  }
  if (known)
    stats.fd_queries++;
  pthread_mutex_unlock(&lock);
  if (!known)
    return is_cr() && prof->major * 100 + prof->minor >= 2618
               ? ZE_RESULT_ERROR_INVALID_ARGUMENT
               : ZE_RESULT_ERROR_OUT_OF_HOST_MEMORY;
  *out = (uint64_t)number;
  return ZE_RESULT_SUCCESS;
}

/* ---- IPC: the neo_ipc socket (cr-26.05-opaque, cr-sockets) --------------- */

/* "\0neo_ipc_<pid>", abstract, its length without a terminating NUL
 * (CR@26.31.39395.13:shared/source/os_interface/linux/
 * ipc_socket_client.cpp:48-52). The request (the handle's number, a u64)
 * and the reply (one status byte, the descriptor as SCM_RIGHTS) are this
 * driver's: CR's wire format is not modelled. */
static socklen_t neo_ipc_address(pid_t pid, struct sockaddr_un *addr) {
  memset(addr, 0, sizeof(*addr));
  addr->sun_family = AF_UNIX;
  int n = snprintf(addr->sun_path + 1, sizeof(addr->sun_path) - 1, "neo_ipc_%d",
                   (int)pid);
  return (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + (size_t)n);
}

static int server_fd = -1;

/* Answers one request per connection with the descriptor of a registered
 * export (one whose IPC entry is live) of that number, or none. */
static void *server_main(void *arg) {
  int s = (int)(intptr_t)arg;
  for (;;) {
    int conn = accept4(s, NULL, NULL, SOCK_CLOEXEC);
    if (conn < 0) {
      if (errno == EINTR || errno == ECONNABORTED)
        continue;
      return NULL;
    }
    struct timeval tv = {.tv_sec = 2};
    setsockopt(conn, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    uint64_t number;
    if (recv(conn, &number, sizeof(number), MSG_WAITALL) ==
        (ssize_t)sizeof(number)) {
      union {
        struct cmsghdr h;
        char buf[CMSG_SPACE(sizeof(int))];
      } u;
      memset(&u, 0, sizeof(u));
      pthread_mutex_lock(&lock);
      bo_t *b =
          number <= INT32_MAX ? bo_by_handle_number((int64_t)number) : NULL;
      uint8_t ok = b != NULL;
      struct iovec iov = {.iov_base = &ok, .iov_len = 1};
      struct msghdr m = {.msg_iov = &iov, .msg_iovlen = 1};
      if (ok) {
        m.msg_control = u.buf;
        m.msg_controllen = sizeof(u.buf);
        struct cmsghdr *cm = CMSG_FIRSTHDR(&m);
        cm->cmsg_level = SOL_SOCKET;
        cm->cmsg_type = SCM_RIGHTS;
        cm->cmsg_len = CMSG_LEN(sizeof(int));
        memcpy(CMSG_DATA(cm), &b->handle_fd, sizeof(int));
      }
      /* Sent under the lock: the descriptor cannot be closed meanwhile. */
      if (sendmsg(conn, &m, MSG_NOSIGNAL) == 1 && ok)
        stats.socket_requests_served++;
      pthread_mutex_unlock(&lock);
    }
    close(conn);
  }
}

/* Starts this process's server at its first export; lock held. */
static void start_server_locked(void) {
  if (server_fd >= 0)
    return;
  int s = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (s < 0)
    return;
  struct sockaddr_un addr;
  socklen_t len = neo_ipc_address(getpid(), &addr);
  pthread_attr_t attr;
  pthread_t thread;
  if (bind(s, (struct sockaddr *)&addr, len) != 0 || listen(s, 64) != 0 ||
      pthread_attr_init(&attr) != 0) {
    close(s);
    return;
  }
  pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
  if (pthread_create(&thread, &attr, server_main, (void *)(intptr_t)s) == 0)
    server_fd = s;
  else
    close(s);
  pthread_attr_destroy(&attr);
}

/* The descriptor `number` of process pid, from its server; -1 if none. */
static int socket_fetch(uint32_t pid, int64_t number) {
  int s = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (s < 0)
    return -1;
  struct timeval tv = {.tv_sec = 2};
  setsockopt(s, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  setsockopt(s, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
  struct sockaddr_un addr;
  socklen_t len = neo_ipc_address((pid_t)pid, &addr);
  int fd = -1;
  uint64_t request = (uint64_t)number;
  if (connect(s, (struct sockaddr *)&addr, len) == 0 &&
      send(s, &request, sizeof(request), MSG_NOSIGNAL) ==
          (ssize_t)sizeof(request)) {
    union {
      struct cmsghdr h;
      char buf[CMSG_SPACE(sizeof(int))];
    } u;
    uint8_t ok = 0;
    struct iovec iov = {.iov_base = &ok, .iov_len = 1};
    struct msghdr m = {.msg_iov = &iov,
                       .msg_iovlen = 1,
                       .msg_control = u.buf,
                       .msg_controllen = sizeof(u.buf)};
    if (recvmsg(s, &m, MSG_CMSG_CLOEXEC) == 1) {
      struct cmsghdr *cm = CMSG_FIRSTHDR(&m);
      if (cm != NULL && cm->cmsg_level == SOL_SOCKET &&
          cm->cmsg_type == SCM_RIGHTS)
        memcpy(&fd, CMSG_DATA(cm), sizeof(int));
      if (!ok && fd >= 0) {
        close(fd);
        fd = -1;
      }
    }
  }
  close(s);
  return fd;
}

/* ---- IPC: opening -------------------------------------------------------- */

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

/* Maps the whole memory behind fd (for pooled memory, the whole pool) and
 * returns base + offset (CR@26.31.39395.13:level_zero/core/source/context/
 * context.cpp:1161), or INVALID_ARGUMENT when fd is not memory of this
 * driver (a failed dma-buf import, context.cpp:1157-1159). An offset past
 * the memory is refused too, where CR would return a pointer past its
 * mapping. The caller keeps fd. */
static ze_result_t map_import(int fd, uint64_t offset, bool from_self,
                              void **out) {
  struct stat st;
  /* The handle's fd must exist in this process: the exporter's number means
   * nothing here unless someone moved the descriptor. */
  if (fd < 0 || fstat(fd, &st) != 0 || !is_driver_memfd(fd) ||
      st.st_size <= 0 || offset >= (uint64_t)st.st_size)
    return ZE_RESULT_ERROR_INVALID_ARGUMENT;
  allocation_t a = {.size = (size_t)st.st_size,
                    .mapped = (size_t)st.st_size,
                    .type = ZE_MEMORY_TYPE_DEVICE,
                    .imported = true};
  /* USMIPC_ZE_TEST_BROKEN_OPEN=1: a driver that maps the wrong memory and
   * says it succeeded (what the self-test on first IPC use must catch). */
  if (env_on("USMIPC_ZE_TEST_BROKEN_OPEN"))
    a.base = mmap(NULL, a.mapped, PROT_READ | PROT_WRITE,
                  MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  else
    a.base = mmap(NULL, a.mapped, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
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
  *out = (uint8_t *)a.base + offset;
  return ZE_RESULT_SUCCESS;
}

static ze_result_t ideal_open(ze_ipc_mem_handle_t h, void **out) {
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
  ze_result_t res = map_import(fd, offset, from_self, out);
  /* The mapping keeps the memory; the caller still owns (and closes) fd. */
  if (fetched >= 0)
    close(fetched);
  return res;
}

/* std::hash of an integer is the integer (libstdc++); CR combines the
 * fields boost-style (CR@26.09.37435.12:level_zero/core/source/context/
 * context.h:66-69). */
static void hash_combine(uint64_t *seed, uint64_t v) {
  *seed ^= v + 0x9e3779b97f4a7c15ull + (*seed << 6) + (*seed >> 2);
}

/* cacheID = hash(normalized fd, poolOffset, processId, handle type, memory
 * type) (CR@26.09.37435.12:.../context_imp.cpp:943-955;
 * CR@26.31.39395.13:.../context.cpp:1091-1108). */
static uint64_t cache_id(uint64_t normalized, uint64_t offset, uint32_t pid,
                         uint8_t htype, uint8_t mtype) {
  uint64_t h = 0;
  hash_combine(&h, normalized);
  hash_combine(&h, offset);
  hash_combine(&h, pid);
  hash_combine(&h, htype);
  hash_combine(&h, mtype);
  return h;
}

static cache_entry_t *cache_find(cache_t *c, uint64_t id) {
  for (size_t i = 0; i < c->count; i++)
    if (c->entries[i].id == id)
      return &c->entries[i];
  return NULL;
}

static void cache_set(cache_t *c, uint64_t id, int fd) {
  cache_entry_t *e = cache_find(c, id);
  if (e == NULL && c->count == c->capacity) {
    size_t cap = c->capacity ? c->capacity * 2 : 16;
    cache_entry_t *grown = realloc(c->entries, cap * sizeof(*grown));
    if (grown == NULL)
      return;
    c->entries = grown;
    c->capacity = cap;
  }
  if (e == NULL)
    e = &c->entries[c->count++];
  *e = (cache_entry_t){.id = id, .fd = fd, .refs = 1};
}

/* A cache hit is stale when the descriptor it gives is another file than
 * the one the handle's (pid, number) names now; unknown (false) when that
 * cannot be looked at. */
static bool cache_hit_is_stale(int fd, uint32_t pid, int64_t number) {
  char path[64];
  struct stat now, cached;
  snprintf(path, sizeof(path), "/proc/%u/fd/%lld", pid, (long long)number);
  if (stat(path, &now) != 0 || fstat(fd, &cached) != 0)
    return false;
  return now.st_dev != cached.st_dev || now.st_ino != cached.st_ino;
}

/* The opaque path's descriptor: the import cache, then pidfd_getfd or the
 * exporter's socket, as the profile's release does (FETCH_*, CACHE_*
 * above). Returns false for "no import" (ZE_RESULT_ERROR_INVALID_ARGUMENT).
 * Whatever descriptor it takes, the driver never closes: imported
 * allocations skip the close (CR@26.31.39395.13:shared/source/os_interface/
 * linux/drm_memory_manager.cpp:1670-1672; memory_manager.cpp:1502-1503),
 * and the cache is cleared only for handles this process exported
 * (context.cpp:590, 863), never by zeMemCloseIpcHandle (= freeMem,
 * context.cpp:806-808): intel/compute-runtime#974 (research §2). */
static bool opaque_fd(ze_context_handle_t c, int64_t number, uint64_t id,
                      uint32_t pid, int *out) {
  cache_t *cache = prof->cache == CACHE_CONTEXT  ? &c->cache
                   : prof->cache == CACHE_DRIVER ? &driver_cache
                                                 : NULL;
  pthread_mutex_lock(&lock);
  cache_entry_t *e = cache ? cache_find(cache, id) : NULL;
  int fd = -1;
  if (e != NULL) {
    /* 26.09: the number itself; 26.18: a new dup, refCount++ (a failed dup
     * is a miss). */
    fd =
        prof->cache == CACHE_CONTEXT ? e->fd : fcntl(e->fd, F_DUPFD_CLOEXEC, 0);
    if (fd >= 0) {
      stats.import_cache_hits++;
      if (prof->cache == CACHE_DRIVER) {
        e->refs++;
        stats.import_fds_kept++;
      }
      if (cache_hit_is_stale(fd, pid, number))
        stats.import_cache_stale_hits++;
    }
  }
  pthread_mutex_unlock(&lock);
  if (fd >= 0) {
    *out = fd;
    return true;
  }
  bool open_failed = false, by_socket = false;
  if (prof->fetch != FETCH_SOCKETS) {
    int pidfd = (int)syscall(SYS_pidfd_open, (pid_t)pid, 0);
    open_failed = pidfd < 0;
    if (pidfd >= 0) {
      fd = (int)syscall(SYS_pidfd_getfd, pidfd, (int)number, 0);
      close(pidfd);
    }
  }
  if (fd < 0) {
    switch (prof->fetch) {
    case FETCH_2609:
      *out = (int)number; /* the raw number, as a local descriptor */
      pthread_mutex_lock(&lock);
      stats.raw_fallbacks++;
      pthread_mutex_unlock(&lock);
      return true;
    case FETCH_2618:
      if (!open_failed)
        return false;
      *out = (int)number;
      pthread_mutex_lock(&lock);
      stats.raw_fallbacks++;
      pthread_mutex_unlock(&lock);
      return true;
    default: /* FETCH_2605, FETCH_SOCKETS */
      fd = socket_fetch(pid, number);
      if (fd < 0)
        return false;
      by_socket = true;
    }
  }
  pthread_mutex_lock(&lock);
  if (by_socket)
    stats.socket_fetches++;
  else
    stats.pidfd_fetches++;
  stats.import_fds_kept++;
  if (!by_socket && pid == (uint32_t)getpid())
    stats.pidfd_self_fetches++;
  if (prof->cache == CACHE_CONTEXT) {
    cache_set(cache, id, fd);
  } else if (prof->cache == CACHE_DRIVER) {
    int dup_fd = fcntl(fd, F_DUPFD_CLOEXEC, 0);
    if (dup_fd >= 0) {
      cache_set(cache, id, dup_fd);
      stats.import_fds_kept++;
    }
  }
  pthread_mutex_unlock(&lock);
  *out = fd;
  return true;
}

/* zeMemOpenIpcHandle of a cr-* profile: the handle is read by this
 * process's own profile, whatever the exporter's was. */
static ze_result_t cr_open(ze_context_handle_t c, ze_ipc_mem_handle_t h,
                           void **out) {
  const uint8_t *d = (const uint8_t *)h.data;
  uint64_t offset, wide;
  memcpy(&offset, d + 8, 8);
  memcpy(&wide, d, 8);
  int64_t number;
  uint32_t pid = 0;
  uint8_t htype = 0, mtype;
  bool opaque = false;
  if (prof->layout_bytes == LEGACY_BYTES) {
    /* IpcMemoryData: handle (u64), poolOffset, type at 16
     * (CR@25.35.35096.9:level_zero/core/source/context/context_imp_drm/
     * context_imp_drm.cpp:65-81, the legacy branch). */
    number = (int64_t)wide;
    mtype = d[16];
  } else {
    /* IpcOpaqueMemoryData, read whenever the context is in opaque mode:
     * fd, poolOffset, processId, type, memoryType at 21
     * (CR@26.09.37435.12:.../context_imp_drm/context_imp_drm.cpp:175-190;
     * CR@26.31.39395.13:.../linux/context_linux.cpp:143-172). */
    int32_t fd32;
    memcpy(&fd32, d, 4);
    number = fd32;
    memcpy(&pid, d + 16, 4);
    htype = d[20];
    mtype = d[21];
    if (prof->rule == RULE_PID) {
      opaque = pid != 0;
    } else if (prof->rule == RULE_COPY) {
      /* normalizeIPCHandle: the fd sign-extended for fdHandle, the u64 for
       * ntHandle, 0 for another type (CR@26.18.38308.4:level_zero/core/
       * source/context/context.h:92-101); the copy is read the same way
       * (context_drm/context_drm.cpp:131-135). */
      int32_t copy32;
      uint64_t copy_wide;
      memcpy(&copy32, d + 22, 4);
      memcpy(&copy_wide, d + 22, 8);
      uint64_t normalized = htype == 0   ? (uint64_t)(int64_t)fd32
                            : htype == 1 ? wide
                                         : 0;
      uint64_t normalized_copy =
          htype == 1 ? copy_wide : (uint64_t)(int64_t)copy32;
      opaque = normalized == normalized_copy;
    }
  }
  /* Memory type 0 (device) or 1 (host), else INVALID_ARGUMENT
   * (CR@26.31.39395.13:level_zero/core/source/context/context.cpp:
   * 1138-1144; CR@25.35.35096.9:.../context_imp.cpp:867-899). */
  if (mtype != IPC_TYPE_DEVICE && mtype != IPC_TYPE_HOST)
    return ZE_RESULT_ERROR_INVALID_ARGUMENT;
  int fd = (int)number;
  if (opaque) {
    uint64_t normalized = htype == 0 ? (uint64_t)number : htype == 1 ? wide : 0;
    uint64_t id = cache_id(normalized, offset, pid, htype, mtype);
    if (!opaque_fd(c, number, id, pid, &fd))
      return ZE_RESULT_ERROR_INVALID_ARGUMENT;
  }
  pthread_mutex_lock(&lock);
  if (opaque)
    stats.opaque_opens++;
  else
    stats.legacy_opens++;
  pthread_mutex_unlock(&lock);
  return map_import(fd, offset, false, out);
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
  return is_cr() ? cr_open(c, h, out) : ideal_open(h, out);
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

/* ---- events: pools, events, IPC --------------------------------------------- */

static bool good_pool(ze_event_pool_handle_t p) {
  return p != NULL && p->magic == MAGIC_EVENT_POOL;
}

/* CR: eventPoolSize = alignUp(numEvents * eventSize, 64 KiB)
 * (CR@26.31.39395.13:level_zero/core/source/event/event.cpp:249). */
static size_t evpool_bytes(uint32_t count) {
  size_t n = (size_t)count * USMIPC_ZE_TEST_EVENT_SLOT;
  return (n + 65535) / 65536 * 65536;
}

static ze_result_t ZE_APICALL evpool_create(ze_context_handle_t c,
                                            const ze_event_pool_desc_t *desc,
                                            uint32_t ndev,
                                            ze_device_handle_t *devs,
                                            ze_event_pool_handle_t *out) {
  if (!good_context(c))
    return ZE_RESULT_ERROR_INVALID_NULL_HANDLE;
  if (desc == NULL || out == NULL || (ndev > 0 && devs == NULL))
    return ZE_RESULT_ERROR_INVALID_NULL_POINTER;
  if (desc->stype != ZE_STRUCTURE_TYPE_EVENT_POOL_DESC)
    return ZE_RESULT_ERROR_INVALID_ARGUMENT;
  if (desc->flags & ~(ze_event_pool_flags_t)(ZE_EVENT_POOL_FLAG_HOST_VISIBLE |
                                             ZE_EVENT_POOL_FLAG_IPC |
                                             ZE_EVENT_POOL_FLAG_KERNEL_TIMESTAMP))
    return ZE_RESULT_ERROR_INVALID_ENUMERATION;
  /* "cannot be combined with ZE_EVENT_POOL_FLAG_IPC" (ze_api.h). */
  if ((desc->flags & ZE_EVENT_POOL_FLAG_IPC) &&
      (desc->flags & ZE_EVENT_POOL_FLAG_KERNEL_TIMESTAMP))
    return ZE_RESULT_ERROR_INVALID_ARGUMENT;
  if (desc->count == 0 || desc->count > (1u << 20))
    return ZE_RESULT_ERROR_INVALID_SIZE;
  for (uint32_t i = 0; i < ndev; i++)
    if (!good_device(devs[i]))
      return ZE_RESULT_ERROR_INVALID_NULL_HANDLE;
  ze_event_pool_handle_t p = calloc(1, sizeof(*p));
  if (p == NULL)
    return ZE_RESULT_ERROR_OUT_OF_HOST_MEMORY;
  p->size = evpool_bytes(desc->count);
  p->memfd = memfd_create(USMIPC_ZE_TEST_EVENT_MEMFD_NAME, MFD_CLOEXEC);
  p->base = MAP_FAILED;
  if (p->memfd >= 0 && ftruncate(p->memfd, (off_t)p->size) == 0)
    p->base = mmap(NULL, p->size, PROT_READ | PROT_WRITE, MAP_SHARED, p->memfd,
                   0);
  if (p->base == MAP_FAILED) {
    if (p->memfd >= 0)
      close(p->memfd);
    free(p);
    return ZE_RESULT_ERROR_OUT_OF_DEVICE_MEMORY;
  }
  p->magic = MAGIC_EVENT_POOL;
  p->count = desc->count;
  p->flags = desc->flags;
  p->ipc_fd = p->kept_fd = -1;
  pthread_mutex_lock(&lock);
  stats.event_pools_created++;
  stats.live_event_pools++;
  pthread_mutex_unlock(&lock);
  *out = p;
  return ZE_RESULT_SUCCESS;
}

/* Before 26.31 nothing closes the descriptor a pool exported (it is cached
 * on the allocation, CR@26.14.37833.4:shared/source/os_interface/linux/
 * drm_allocation.cpp:117-131, and only the memory paths close such
 * descriptors); 26.31 releases it in ~EventPool (CR@26.31.39395.13:
 * level_zero/core/source/event/event.cpp:171-176, commit fc87638d16). */
static ze_result_t ZE_APICALL evpool_destroy(ze_event_pool_handle_t p) {
  if (!good_pool(p))
    return ZE_RESULT_ERROR_INVALID_NULL_HANDLE;
  if (p->imported)
    return ZE_RESULT_ERROR_INVALID_ARGUMENT; /* zeEventPoolCloseIpcHandle */
  pthread_mutex_lock(&lock);
  if (p->events > 0) {
    pthread_mutex_unlock(&lock);
    return ZE_RESULT_ERROR_HANDLE_OBJECT_IN_USE;
  }
  if (p->ipc_fd >= 0) {
    if (prof->evl_put)
      close(p->ipc_fd);
    else
      stats.exported_event_fds_leaked++;
  }
  stats.live_event_pools--;
  pthread_mutex_unlock(&lock);
  p->magic = 0;
  munmap(p->base, p->size);
  close(p->memfd);
  free(p);
  return ZE_RESULT_SUCCESS;
}

static unsigned my_evl(void) { return is_cr() ? prof->evl : ideal_evl; }
static bool opaque_mode(void) { return is_cr() && prof->rule != RULE_LEGACY; }

/* The handle of pool p, whose exported descriptor is fd, in this profile's
 * layout (EVL_* above). */
static void evpool_encode(ze_event_pool_handle_t p, int fd, uint8_t *h) {
  bool device = !(p->flags & ZE_EVENT_POOL_FLAG_HOST_VISIBLE);
  bool ts = (p->flags & ZE_EVENT_POOL_FLAG_KERNEL_TIMESTAMP) != 0;
  /* isDeviceEventPoolAllocation, isHostVisibleEventPoolAllocation, ...,
   * isEventPoolTsFlagSet (CR@26.31.39395.13:.../event.cpp:100-111: a
   * device pool is host-visible only with the flag). */
  uint8_t bits = (uint8_t)(device | (!device) << 1 | ts << 4);
  uint64_t fd64 = (uint64_t)(uint32_t)fd, count = p->count, copy = fd64;
  uint32_t packets = event_packets, pid = (uint32_t)getpid(), one32 = 1;
  uint16_t one16 = 1;
  switch (my_evl()) {
  case EVL_33:
    memset(h, 0, 33);
    memcpy(h, &fd64, 8);
    memcpy(h + 8, &count, 8);
    memcpy(h + 20, &packets, 4);
    memcpy(h + 24, &one32, 4);
    h[28] = device;
    h[29] = !device;
    h[32] = ts;
    break;
  case EVL_62:
    memset(h, 0, 62);
    memcpy(h, &fd64, 8);
    memcpy(h + 16, &count, 4);
    h[26] = (uint8_t)packets;
    h[27] = 1;
    h[28] = bits;
    h[29] = 2; /* IpcHandleType::maxHandle: opaque mode off */
    break;
  case EVL_UNKNOWN: {
    uint64_t token = 0x7fff0000u | (uint64_t)(fd & 0xffff);
    memset(h, 0, ZE_MAX_IPC_HANDLE_SIZE);
    memcpy(h, &token, 8);
    memcpy(h + 40, &fd64, 8);
    break;
  }
  default: /* EVL_27, EVL_32, EVL_40: IpcOpaqueEventPoolData, `= {}` */
    memset(h, 0, my_evl() == EVL_40 ? 40 : 32);
    memcpy(h, &fd64, 8);
    memcpy(h + 8, &count, 8);
    memcpy(h + 20, &packets, 4);
    memcpy(h + 24, &one16, 2);
    h[26] = bits;
    h[27] = 2; /* IpcHandleType::maxHandle */
    if (opaque_mode()) {
      h[27] = 0; /* fdHandle */
      memcpy(h + 28, &pid, 4);
      if (my_evl() == EVL_40)
        memcpy(h + 32, &copy, 8);
    }
  }
}

/* A pool made without ZE_EVENT_POOL_FLAG_IPC, or an opened one, is not
 * shareable: ZE_RESULT_ERROR_UNSUPPORTED_FEATURE
 * (CR@26.31.39395.13:.../event.cpp:711-713). The descriptor is exported
 * once and cached, as peekInternalHandle caches it. */
static ze_result_t ZE_APICALL evpool_get_ipc(ze_event_pool_handle_t p,
                                             ze_ipc_event_pool_handle_t *h) {
  if (!good_pool(p))
    return ZE_RESULT_ERROR_INVALID_NULL_HANDLE;
  if (h == NULL)
    return ZE_RESULT_ERROR_INVALID_NULL_POINTER;
  if (p->imported || !(p->flags & ZE_EVENT_POOL_FLAG_IPC))
    return ZE_RESULT_ERROR_UNSUPPORTED_FEATURE;
  pthread_mutex_lock(&lock);
  if (p->ipc_fd < 0)
    p->ipc_fd = fcntl(p->memfd, F_DUPFD_CLOEXEC, 0);
  int fd = p->ipc_fd;
  if (fd >= 0)
    stats.event_pool_ipc_gets++;
  pthread_mutex_unlock(&lock);
  if (fd < 0)
    return ZE_RESULT_ERROR_OUT_OF_HOST_MEMORY;
  evpool_encode(p, fd, (uint8_t *)h->data);
  return ZE_RESULT_SUCCESS;
}

/* 26.18-26.31's opaque path for event pools: importOpaqueHandleWithFallback
 * with cacheID 0 for every pool ("cacheID not used for event pools",
 * CR@26.18.38308.4:level_zero/core/source/event/event.cpp:771-786;
 * CR@26.31.39395.13:.../event.cpp:782-797), so that the first pool an
 * importer opened this way answers every later one from the per-driver
 * cache (driver_handle.cpp:1024-1045 at 26.18); then pidfd_getfd, or the
 * socket (context_drm/context_drm.cpp:184-262 at 26.18; linux/
 * context_linux.cpp:67-141 at 26.31), whose server knows no event pool
 * descriptor (EventPool::getIpcHandle registers none, event.cpp:710-747 at
 * 26.31). Fixed after 26.31 by a cache key per handle (commit 34b4652df7,
 * not in a release). */
static bool evpool_opaque_fd(int64_t number, uint32_t pid, int *out) {
  pthread_mutex_lock(&lock);
  cache_entry_t *e = cache_find(&driver_cache, 0);
  int fd = e != NULL ? fcntl(e->fd, F_DUPFD_CLOEXEC, 0) : -1;
  if (fd >= 0) {
    e->refs++;
    stats.event_pool_cache_hits++;
    stats.import_fds_kept++;
    if (cache_hit_is_stale(fd, pid, number))
      stats.event_pool_stale_hits++;
  }
  pthread_mutex_unlock(&lock);
  if (fd >= 0) {
    *out = fd;
    return true;
  }
  if (prof->fetch == FETCH_SOCKETS) {
    fd = socket_fetch(pid, number);
  } else {
    int pidfd = (int)syscall(SYS_pidfd_open, (pid_t)pid, 0);
    if (pidfd < 0) {
      *out = (int)number; /* the raw number, as a local descriptor */
      return true;
    }
    fd = (int)syscall(SYS_pidfd_getfd, pidfd, (int)number, 0);
    close(pidfd);
  }
  if (fd < 0)
    return false;
  pthread_mutex_lock(&lock);
  int dup_fd = fcntl(fd, F_DUPFD_CLOEXEC, 0);
  if (dup_fd >= 0) {
    cache_set(&driver_cache, 0, dup_fd);
    stats.import_fds_kept++;
  }
  pthread_mutex_unlock(&lock);
  *out = fd;
  return true;
}

static bool is_event_memfd(int fd) {
  static const char want[] = "/memfd:" USMIPC_ZE_TEST_EVENT_MEMFD_NAME;
  char link[64], target[128];
  snprintf(link, sizeof(link), "/proc/self/fd/%d", fd);
  ssize_t n = readlink(link, target, sizeof(target) - 1);
  if (n < 0)
    return false;
  target[n] = '\0';
  return strncmp(target, want, sizeof(want) - 1) == 0;
}

/* zeEventPoolOpenIpcHandle, by this process's own profile
 * (EventPool::openEventPoolIpcHandle: CR@25.35.35096.9:level_zero/core/
 * source/event/event.cpp:425-520; CR@26.09.37435.12:.../event.cpp:435-530;
 * CR@26.31.39395.13:.../event.cpp:749-887). The importer reads
 * IpcEventPoolData (the first 27 or 33 bytes) whatever the mode; in opaque
 * mode the processId only becomes osHandleData.parentProcessId, which the
 * Linux memory manager never reads, up to 26.14 (event.cpp:459-471 at
 * 25.48): the descriptor number is imported as a local one. From 26.18 a
 * handle whose fd equals its opaqueHandle takes the opaque path above. A
 * maxEventPackets other than the device's is INVALID_ARGUMENT (event.cpp:
 * 820-826 at 26.31), a failed import OUT_OF_DEVICE_MEMORY (:847-849). The
 * descriptor becomes the driver's: a host-visible pool's import consumes
 * it from 26.09 (createUSMHostAllocationFromSharedHandle(..., consumeFd =
 * true), CR@26.09.37435.12:shared/source/os_interface/linux/
 * drm_memory_manager.cpp:1279-1280, commit 57e417aa74), also when the
 * import fails from 26.18 (CR@26.18.38308.4:.../drm_memory_manager.cpp:
 * 3197-3209, commit 6487021c6c; 26.09-26.14 leave it open then); before
 * 26.09 the allocation keeps it as its shared handle and closes it when the
 * pool is closed (freeGraphicsMemoryImpl -> closeSharedHandle,
 * CR@26.05.37020.3:.../drm_memory_manager.cpp:1278-1279, 1484). */
static ze_result_t ZE_APICALL evpool_open_ipc(ze_context_handle_t c,
                                              ze_ipc_event_pool_handle_t h,
                                              ze_event_pool_handle_t *out) {
  if (!good_context(c))
    return ZE_RESULT_ERROR_INVALID_NULL_HANDLE;
  if (out == NULL)
    return ZE_RESULT_ERROR_INVALID_NULL_POINTER;
  const uint8_t *d = (const uint8_t *)h.data;
  uint64_t number = 0, count = 0, copy = 0;
  uint32_t packets = 0, pid = 0, count32 = 0;
  bool host;
  unsigned evl = my_evl();
  switch (evl) {
  case EVL_33:
    memcpy(&number, d, 8);
    memcpy(&count, d + 8, 8);
    memcpy(&packets, d + 20, 4);
    host = d[29] != 0;
    break;
  case EVL_62:
    memcpy(&number, d, 8);
    memcpy(&copy, d + 8, 8);
    memcpy(&count32, d + 16, 4);
    count = count32;
    packets = d[26];
    host = (d[28] & 2) != 0;
    break;
  case EVL_UNKNOWN:
    memcpy(&number, d + 40, 8);
    count = 1;
    packets = event_packets;
    host = true;
    break;
  default:
    memcpy(&number, d, 8);
    memcpy(&count, d + 8, 8);
    memcpy(&packets, d + 20, 4);
    host = (d[26] & 2) != 0;
    if (opaque_mode()) {
      memcpy(&pid, d + 28, 4);
      if (evl == EVL_40)
        memcpy(&copy, d + 32, 8);
    }
  }
  ze_result_t res = ZE_RESULT_SUCCESS;
  if (packets != event_packets || count == 0 || count > (1u << 20))
    res = ZE_RESULT_ERROR_INVALID_ARGUMENT;
  int fd = (int)number; /* static_cast<NEO::osHandle> */
  bool opaque = evl == EVL_40 && opaque_mode() && number == copy;
  if (res == ZE_RESULT_SUCCESS && opaque && !evpool_opaque_fd((int32_t)number, pid, &fd))
    res = ZE_RESULT_ERROR_INVALID_ARGUMENT;
  if (res != ZE_RESULT_SUCCESS) {
    pthread_mutex_lock(&lock);
    stats.event_pool_open_failures++;
    pthread_mutex_unlock(&lock);
    return res;
  }
  bool consume = host && prof->evl_consume;
  struct stat st;
  ze_event_pool_handle_t p = NULL;
  if (fstat(fd, &st) == 0 && is_event_memfd(fd) &&
      (uint64_t)st.st_size >= count * USMIPC_ZE_TEST_EVENT_SLOT &&
      (p = calloc(1, sizeof(*p))) != NULL) {
    p->size = (size_t)st.st_size;
    p->base = mmap(NULL, p->size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p->base == MAP_FAILED) {
      free(p);
      p = NULL;
    }
  }
  if (consume && (p != NULL || !is_cr() ||
                  prof->major * 100 + prof->minor >= 2618))
    close(fd);
  pthread_mutex_lock(&lock);
  if (p == NULL) {
    stats.event_pool_open_failures++;
  } else {
    stats.event_pool_opens++;
    stats.live_event_pools++;
    stats.event_fds_taken++;
    if (opaque)
      stats.event_pool_opaque_opens++;
  }
  pthread_mutex_unlock(&lock);
  if (p == NULL)
    return ZE_RESULT_ERROR_OUT_OF_DEVICE_MEMORY;
  p->magic = MAGIC_EVENT_POOL;
  p->count = (uint32_t)count;
  p->flags = ZE_EVENT_POOL_FLAG_IPC | (host ? ZE_EVENT_POOL_FLAG_HOST_VISIBLE : 0);
  p->memfd = p->ipc_fd = -1;
  p->kept_fd = consume ? -1 : fd;
  p->imported = true;
  *out = p;
  return ZE_RESULT_SUCCESS;
}

static ze_result_t ZE_APICALL evpool_close_ipc(ze_event_pool_handle_t p) {
  if (!good_pool(p))
    return ZE_RESULT_ERROR_INVALID_NULL_HANDLE;
  if (!p->imported)
    return ZE_RESULT_ERROR_INVALID_ARGUMENT;
  pthread_mutex_lock(&lock);
  if (p->events > 0) {
    pthread_mutex_unlock(&lock);
    return ZE_RESULT_ERROR_HANDLE_OBJECT_IN_USE;
  }
  stats.event_pool_closes++;
  stats.live_event_pools--;
  pthread_mutex_unlock(&lock);
  p->magic = 0;
  munmap(p->base, p->size);
  if (p->kept_fd >= 0)
    close(p->kept_fd);
  free(p);
  return ZE_RESULT_SUCCESS;
}

/* An event of a created pool starts not signalled; one of an opened pool
 * keeps the state it has (CR: "do not reset even if it has been imported",
 * CR@26.31.39395.13:level_zero/core/source/event/event_impl.inl:112-115).
 * An index past the pool is INVALID_ARGUMENT (event.cpp:203-205). */
static ze_result_t ZE_APICALL event_create(ze_event_pool_handle_t p,
                                           const ze_event_desc_t *desc,
                                           ze_event_handle_t *out) {
  if (!good_pool(p))
    return ZE_RESULT_ERROR_INVALID_NULL_HANDLE;
  if (desc == NULL || out == NULL)
    return ZE_RESULT_ERROR_INVALID_NULL_POINTER;
  if (desc->stype != ZE_STRUCTURE_TYPE_EVENT_DESC || desc->index >= p->count)
    return ZE_RESULT_ERROR_INVALID_ARGUMENT;
  ze_event_handle_t e = calloc(1, sizeof(*e));
  if (e == NULL)
    return ZE_RESULT_ERROR_OUT_OF_HOST_MEMORY;
  e->magic = MAGIC_EVENT;
  e->pool = p;
  e->index = desc->index;
  if (!p->imported)
    __atomic_store_n(event_state(e), 0, __ATOMIC_RELEASE);
  pthread_mutex_lock(&lock);
  p->events++;
  stats.live_events++;
  pthread_mutex_unlock(&lock);
  *out = e;
  return ZE_RESULT_SUCCESS;
}

static ze_result_t ZE_APICALL event_destroy(ze_event_handle_t e) {
  if (!good_event(e))
    return ZE_RESULT_ERROR_INVALID_NULL_HANDLE;
  pthread_mutex_lock(&lock);
  e->pool->events--;
  stats.live_events--;
  pthread_mutex_unlock(&lock);
  e->magic = 0;
  free(e);
  return ZE_RESULT_SUCCESS;
}

static ze_result_t ZE_APICALL event_host_signal(ze_event_handle_t e) {
  if (!good_event(e))
    return ZE_RESULT_ERROR_INVALID_NULL_HANDLE;
  event_set(e, 1);
  return ZE_RESULT_SUCCESS;
}

static ze_result_t ZE_APICALL event_host_reset(ze_event_handle_t e) {
  if (!good_event(e))
    return ZE_RESULT_ERROR_INVALID_NULL_HANDLE;
  event_set(e, 0);
  return ZE_RESULT_SUCCESS;
}

static ze_result_t ZE_APICALL event_query(ze_event_handle_t e) {
  if (!good_event(e))
    return ZE_RESULT_ERROR_INVALID_NULL_HANDLE;
  return event_is_set(e) ? ZE_RESULT_SUCCESS : ZE_RESULT_NOT_READY;
}

/* timeout in nanoseconds; UINT64_MAX without limit; NOT_READY past it. */
static ze_result_t ZE_APICALL event_host_sync(ze_event_handle_t e,
                                              uint64_t timeout) {
  if (!good_event(e))
    return ZE_RESULT_ERROR_INVALID_NULL_HANDLE;
  return events_wait(1, &e, timeout) ? ZE_RESULT_SUCCESS : ZE_RESULT_NOT_READY;
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
  t->pfnGetMemoryProperties = dev_memory_properties;
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
  t->pfnAppendBarrier = list_barrier;
  t->pfnAppendSignalEvent = list_signal_event;
  t->pfnAppendWaitOnEvents = list_wait_on_events;
  t->pfnAppendEventReset = list_event_reset;
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
  /* Loaders of API 1.6+ route zeMemPutIpcHandle through this table; CR
   * fills it (CR@26.31.39395.13:level_zero/api/core/ze_core_loader.cpp:59),
   * which the cr-* profiles model with NEWER_LOADER=routed. */
  read_config();
  if (is_cr() ? newer_loader == LOADER_ROUTED
              : !env_on("USMIPC_ZE_TEST_NO_PUT"))
    t->pfnPutIpcHandle = mem_put_ipc_handle;
#endif
  return r;
}

#ifdef USMIPC_ZE_DDI_HAS_MEM_EXP
EXPORT ze_result_t ZE_APICALL zeGetMemExpProcAddrTable(ze_api_version_t v,
                                                       ze_mem_exp_dditable_t *t) {
  ze_result_t r = check_version(v, t);
  read_config();
  if (r == ZE_RESULT_SUCCESS && (is_cr() ? newer_loader == LOADER_ROUTED
                                         : !env_on("USMIPC_ZE_TEST_NO_FD_EXT")))
    t->pfnGetFileDescriptorFromIpcHandleExp = mem_fd_from_ipc_handle;
  return r;
}
#endif

EXPORT ze_result_t ZE_APICALL
zeGetEventPoolProcAddrTable(ze_api_version_t v, ze_event_pool_dditable_t *t) {
  ze_result_t r = check_version(v, t);
  if (r != ZE_RESULT_SUCCESS)
    return r;
  t->pfnCreate = evpool_create;
  t->pfnDestroy = evpool_destroy;
  t->pfnGetIpcHandle = evpool_get_ipc;
  t->pfnOpenIpcHandle = evpool_open_ipc;
  t->pfnCloseIpcHandle = evpool_close_ipc;
  return r;
}

EXPORT ze_result_t ZE_APICALL zeGetEventProcAddrTable(ze_api_version_t v,
                                                      ze_event_dditable_t *t) {
  ze_result_t r = check_version(v, t);
  if (r != ZE_RESULT_SUCCESS)
    return r;
  t->pfnCreate = event_create;
  t->pfnDestroy = event_destroy;
  t->pfnHostSignal = event_host_signal;
  t->pfnHostSynchronize = event_host_sync;
  t->pfnQueryStatus = event_query;
  t->pfnHostReset = event_host_reset;
  return r;
}

/* Tables of objects this driver does not have: present and empty. The
 * loader 1.8 fails zeInit unless every core, tools (zet) and sysman (zes)
 * table getter exists; the experimental ones are optional. */
#define EMPTY_TABLE(getter, type)                                              \
  EXPORT ze_result_t ZE_APICALL getter(ze_api_version_t v, type *t) {         \
    return check_version(v, t);                                                \
  }
EMPTY_TABLE(zeGetCommandQueueProcAddrTable, ze_command_queue_dditable_t)
EMPTY_TABLE(zeGetFenceProcAddrTable, ze_fence_dditable_t)
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
