/* The Level Zero backend, over the oneAPI loader loaded with
 * dlopen("libze_loader.so.1") at first use: no link-time dependency, no
 * Level Zero headers needed to build. The few types used are declared here
 * with the layouts of ze_api.h (API 1.4, which the loader 1.8 of Debian 12
 * implements); a missing loader or driver makes probe() report the backend
 * unavailable with the reason.
 *
 * Devices are the GPU root devices of every driver (level_zero:gpu:N), with
 * one context per driver. Copies and fills go through a synchronous
 * immediate command list per queue (or a list another library owns,
 * wrapped). Events are IPC event pools of one event each, shared like
 * memory: the pool's dma-buf through the core's transport, the importer's
 * own driver handle built around it (section "events"). Device memory is
 * shared with
 * zeMemGetIpcHandle / zeMemOpenIpcHandle (docs/level-zero.md):
 *
 *  - A Level Zero IPC handle holds a file descriptor that is only valid in
 *    the exporting process (on Intel's Linux driver a dma-buf fd, stored as
 *    a native int at the start of ze_ipc_mem_handle_t.data). The exporter
 *    takes it out of the handle (checked against
 *    zeMemGetFileDescriptorFromIpcHandleExp where the driver has it) and
 *    gives it to the core, whose transport (pidfd_getfd or the socket
 *    broker) moves it to the importer; no ptrace rights are needed with the
 *    broker.
 *  - The payload is the handle's 64 bytes with the fd slot zeroed; the
 *    importer writes the descriptor it received into the slot and opens the
 *    rebuilt handle. zeMemGetIpcHandleFromFileDescriptorExp cannot be used
 *    there: Intel's driver resolves only descriptors that the calling
 *    process itself exported. Handles in Intel's pidfd layout also name the
 *    exporter's pid; the importer names itself there instead.
 *  - The handle is taken once per allocation (the core caches the export),
 *    kept with the allocation, and released with zeMemPutIpcHandle when the
 *    allocation is freed.
 *
 * Floor 3 of the core (backends, beside the transport): the core reaches
 * it only through its ops table (backend.h), and it calls only the floors
 * below and linux/dmabuf.c. Its length serves that one concern, the Level
 * Zero driver: the IPC handle layouts of each of Intel's releases, read
 * from their source (docs/level-zero.md), events, SYCL's blobs and the
 * self-test that checks it all on a real driver. */
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include "backend/backend.h"
#include "linux/transport.h"

/* ---- driver types (ze_api.h, Level Zero API 1.4) ------------------------- */

typedef int ze_result_t; /* every value fits an int */
typedef uint8_t ze_bool_t;
typedef uint32_t ze_structure_type_t;
typedef uint32_t ze_init_flags_t;
typedef uint32_t ze_ipc_memory_flags_t;
typedef struct _ze_driver_handle_t *ze_driver_handle_t;
typedef struct _ze_device_handle_t *ze_device_handle_t;
typedef struct _ze_context_handle_t *ze_context_handle_t;
typedef struct _ze_command_list_handle_t *ze_command_list_handle_t;
typedef struct _ze_event_handle_t *ze_event_handle_t;
typedef struct _ze_event_pool_handle_t *ze_event_pool_handle_t;

#define ZE_MAX_IPC_HANDLE_SIZE 64
#define ZE_MAX_DEVICE_UUID_SIZE 16
#define ZE_MAX_DEVICE_NAME 256

typedef struct {
  char data[ZE_MAX_IPC_HANDLE_SIZE];
} ze_ipc_mem_handle_t;

typedef struct {
  char data[ZE_MAX_IPC_HANDLE_SIZE];
} ze_ipc_event_pool_handle_t;

typedef struct {
  ze_structure_type_t stype;
  void *pNext;
  uint32_t flags; /* ze_ipc_property_flags_t */
} ze_driver_ipc_properties_t;

typedef struct {
  ze_structure_type_t stype;
  const void *pNext;
  uint32_t flags; /* ze_event_pool_flags_t */
  uint32_t count;
} ze_event_pool_desc_t;

typedef struct {
  ze_structure_type_t stype;
  const void *pNext;
  uint32_t index;
  uint32_t signal; /* ze_event_scope_flags_t */
  uint32_t wait;
} ze_event_desc_t;

typedef struct {
  ze_structure_type_t stype;
  void *pNext;
  uint32_t type; /* ze_device_type_t */
  uint32_t vendorId;
  uint32_t deviceId;
  uint32_t flags; /* ze_device_property_flags_t */
  uint32_t subdeviceId;
  uint32_t coreClockRate;
  uint64_t maxMemAllocSize;
  uint32_t maxHardwareContexts;
  uint32_t maxCommandQueuePriority;
  uint32_t numThreadsPerEU;
  uint32_t physicalEUSimdWidth;
  uint32_t numEUsPerSubslice;
  uint32_t numSubslicesPerSlice;
  uint32_t numSlices;
  uint64_t timerResolution;
  uint32_t timestampValidBits;
  uint32_t kernelTimestampValidBits;
  uint8_t uuid[ZE_MAX_DEVICE_UUID_SIZE];
  char name[ZE_MAX_DEVICE_NAME];
} ze_device_properties_t;

typedef struct {
  ze_structure_type_t stype;
  void *pNext;
  uint32_t flags; /* ze_device_memory_property_flags_t */
  uint32_t maxClockRate;
  uint32_t maxBusWidth;
  uint64_t totalSize;
  char name[ZE_MAX_DEVICE_NAME];
} ze_device_memory_properties_t;

typedef struct {
  ze_structure_type_t stype;
  void *pNext;
  uint32_t flags; /* ze_command_queue_group_property_flags_t */
  size_t maxMemoryFillPatternSize;
  uint32_t numQueues;
} ze_command_queue_group_properties_t;

typedef struct {
  ze_structure_type_t stype;
  const void *pNext;
  uint32_t flags;
} ze_context_desc_t;

typedef struct {
  ze_structure_type_t stype;
  const void *pNext;
  uint32_t ordinal;
  uint32_t index;
  uint32_t flags;
  uint32_t mode;     /* ze_command_queue_mode_t */
  uint32_t priority; /* ze_command_queue_priority_t */
} ze_command_queue_desc_t;

typedef struct {
  ze_structure_type_t stype;
  const void *pNext;
  uint32_t flags;
  uint32_t ordinal;
} ze_device_mem_alloc_desc_t;

typedef struct {
  ze_structure_type_t stype;
  const void *pNext;
  uint32_t flags;
} ze_host_mem_alloc_desc_t;

typedef struct {
  ze_structure_type_t stype;
  void *pNext;
  uint32_t type; /* ze_memory_type_t */
  uint64_t id;
  uint64_t pageSize;
} ze_memory_allocation_properties_t;

typedef struct {
  ze_structure_type_t stype;
  void *pNext;
  uint8_t uuid[16];
  uint32_t driverVersion;
} ze_driver_properties_t;

#define ZE_MAX_EXTENSION_NAME 256
typedef struct {
  char name[ZE_MAX_EXTENSION_NAME];
  uint32_t version;
} ze_driver_extension_properties_t;

/* Chained to ze_device_mem_alloc_desc_t: memory meant to be exported. */
typedef struct {
  ze_structure_type_t stype;
  const void *pNext;
  uint32_t flags; /* ze_external_memory_type_flags_t */
} ze_external_memory_export_desc_t;

enum {
  ZE_RESULT_SUCCESS = 0,
  ZE_RESULT_NOT_READY = 1,
  ZE_RESULT_ERROR_DEVICE_LOST = 0x70000001,
  ZE_RESULT_ERROR_OUT_OF_HOST_MEMORY = 0x70000002,
  ZE_RESULT_ERROR_OUT_OF_DEVICE_MEMORY = 0x70000003,
  ZE_RESULT_ERROR_UNINITIALIZED = 0x78000001,
  ZE_RESULT_ERROR_UNSUPPORTED_VERSION = 0x78000002,
  ZE_RESULT_ERROR_UNSUPPORTED_FEATURE = 0x78000003,
  ZE_RESULT_ERROR_INVALID_ARGUMENT = 0x78000004,
  ZE_RESULT_ERROR_INVALID_NULL_HANDLE = 0x78000005,
  ZE_RESULT_ERROR_HANDLE_OBJECT_IN_USE = 0x78000006,
  ZE_RESULT_ERROR_INVALID_NULL_POINTER = 0x78000007,
  ZE_RESULT_ERROR_INVALID_SIZE = 0x78000008,
  ZE_RESULT_ERROR_UNSUPPORTED_SIZE = 0x78000009,
  ZE_RESULT_ERROR_UNSUPPORTED_ALIGNMENT = 0x7800000a,
  ZE_RESULT_ERROR_INVALID_ENUMERATION = 0x7800000c,
  ZE_RESULT_ERROR_UNSUPPORTED_ENUMERATION = 0x7800000d,
  ZE_RESULT_ERROR_UNKNOWN = 0x7ffffffe,

  ZE_STRUCTURE_TYPE_DRIVER_IPC_PROPERTIES = 0x2,
  ZE_STRUCTURE_TYPE_DEVICE_PROPERTIES = 0x3,
  ZE_STRUCTURE_TYPE_COMMAND_QUEUE_GROUP_PROPERTIES = 0x6,
  ZE_STRUCTURE_TYPE_DEVICE_MEMORY_PROPERTIES = 0x7,
  ZE_STRUCTURE_TYPE_CONTEXT_DESC = 0xd,
  ZE_STRUCTURE_TYPE_EVENT_POOL_DESC = 0x10,
  ZE_STRUCTURE_TYPE_EVENT_DESC = 0x11,
  ZE_STRUCTURE_TYPE_COMMAND_QUEUE_DESC = 0xe,
  ZE_STRUCTURE_TYPE_DEVICE_MEM_ALLOC_DESC = 0x15,
  ZE_STRUCTURE_TYPE_HOST_MEM_ALLOC_DESC = 0x16,
  ZE_STRUCTURE_TYPE_MEMORY_ALLOCATION_PROPERTIES = 0x17,
  ZE_STRUCTURE_TYPE_EXTERNAL_MEMORY_EXPORT_DESC = 0x18,
  ZE_STRUCTURE_TYPE_DRIVER_PROPERTIES = 0x1,
  ZE_EXTERNAL_MEMORY_TYPE_FLAG_DMA_BUF = 2,

  ZE_INIT_FLAG_GPU_ONLY = 1,
  ZE_DEVICE_TYPE_GPU = 1,
  ZE_IPC_PROPERTY_FLAG_MEMORY = 1,
  ZE_IPC_PROPERTY_FLAG_EVENT_POOL = 2,
  ZE_EVENT_POOL_FLAG_HOST_VISIBLE = 1,
  ZE_EVENT_POOL_FLAG_IPC = 2,
  ZE_EVENT_SCOPE_FLAG_HOST = 4,
  ZE_COMMAND_QUEUE_GROUP_PROPERTY_FLAG_COPY = 2,
  ZE_COMMAND_QUEUE_MODE_SYNCHRONOUS = 1,
  ZE_COMMAND_QUEUE_PRIORITY_NORMAL = 0,
  ZE_MEMORY_TYPE_UNKNOWN = 0,
  ZE_MEMORY_TYPE_HOST = 1,
  ZE_MEMORY_TYPE_DEVICE = 2,
  ZE_MEMORY_TYPE_SHARED = 3,
};

/* One list of loader entry points drives the function pointers and the
 * dlsym loop (libfabric's habit). All are exported by every loader since
 * 1.0 (API 1.0-1.4). */
#define ZE_SYMBOLS(X)                                                          \
  X(zeInit, (ze_init_flags_t))                                                 \
  X(zeDriverGet, (uint32_t *, ze_driver_handle_t *))                           \
  X(zeDriverGetIpcProperties,                                                  \
    (ze_driver_handle_t, ze_driver_ipc_properties_t *))                        \
  X(zeDriverGetExtensionFunctionAddress,                                       \
    (ze_driver_handle_t, const char *, void **))                               \
  X(zeDriverGetProperties, (ze_driver_handle_t, ze_driver_properties_t *))     \
  X(zeDriverGetExtensionProperties,                                            \
    (ze_driver_handle_t, uint32_t *, ze_driver_extension_properties_t *))      \
  X(zeDeviceGet, (ze_driver_handle_t, uint32_t *, ze_device_handle_t *))       \
  X(zeDeviceGetProperties, (ze_device_handle_t, ze_device_properties_t *))     \
  X(zeDeviceGetMemoryProperties,                                               \
    (ze_device_handle_t, uint32_t *, ze_device_memory_properties_t *))         \
  X(zeDeviceGetCommandQueueGroupProperties,                                    \
    (ze_device_handle_t, uint32_t *, ze_command_queue_group_properties_t *))   \
  X(zeDeviceCanAccessPeer,                                                     \
    (ze_device_handle_t, ze_device_handle_t, ze_bool_t *))                     \
  X(zeContextCreate,                                                           \
    (ze_driver_handle_t, const ze_context_desc_t *, ze_context_handle_t *))    \
  X(zeMemAllocDevice,                                                          \
    (ze_context_handle_t, const ze_device_mem_alloc_desc_t *, size_t, size_t,  \
     ze_device_handle_t, void **))                                             \
  X(zeMemAllocHost, (ze_context_handle_t, const ze_host_mem_alloc_desc_t *,    \
                     size_t, size_t, void **))                                 \
  X(zeMemAllocShared,                                                          \
    (ze_context_handle_t, const ze_device_mem_alloc_desc_t *,                  \
     const ze_host_mem_alloc_desc_t *, size_t, size_t, ze_device_handle_t,     \
     void **))                                                                 \
  X(zeMemFree, (ze_context_handle_t, void *))                                  \
  X(zeMemGetAllocProperties,                                                   \
    (ze_context_handle_t, const void *, ze_memory_allocation_properties_t *,   \
     ze_device_handle_t *))                                                    \
  X(zeMemGetAddressRange,                                                      \
    (ze_context_handle_t, const void *, void **, size_t *))                    \
  X(zeMemGetIpcHandle,                                                         \
    (ze_context_handle_t, const void *, ze_ipc_mem_handle_t *))                \
  X(zeMemOpenIpcHandle, (ze_context_handle_t, ze_device_handle_t,              \
                         ze_ipc_mem_handle_t, ze_ipc_memory_flags_t, void **)) \
  X(zeMemCloseIpcHandle, (ze_context_handle_t, const void *))                  \
  X(zeCommandListCreateImmediate,                                              \
    (ze_context_handle_t, ze_device_handle_t, const ze_command_queue_desc_t *, \
     ze_command_list_handle_t *))                                              \
  X(zeCommandListDestroy, (ze_command_list_handle_t))                          \
  X(zeCommandListAppendMemoryCopy,                                             \
    (ze_command_list_handle_t, void *, const void *, size_t,                   \
     ze_event_handle_t, uint32_t, ze_event_handle_t *))                        \
  X(zeCommandListAppendMemoryFill,                                             \
    (ze_command_list_handle_t, void *, const void *, size_t, size_t,           \
     ze_event_handle_t, uint32_t, ze_event_handle_t *))                        \
  X(zeCommandListAppendBarrier, (ze_command_list_handle_t, ze_event_handle_t,  \
                                 uint32_t, ze_event_handle_t *))               \
  X(zeCommandListAppendWaitOnEvents,                                           \
    (ze_command_list_handle_t, uint32_t, ze_event_handle_t *))                 \
  X(zeCommandListAppendEventReset,                                             \
    (ze_command_list_handle_t, ze_event_handle_t))                             \
  X(zeEventPoolCreate,                                                         \
    (ze_context_handle_t, const ze_event_pool_desc_t *, uint32_t,              \
     ze_device_handle_t *, ze_event_pool_handle_t *))                          \
  X(zeEventPoolDestroy, (ze_event_pool_handle_t))                              \
  X(zeEventPoolGetIpcHandle,                                                   \
    (ze_event_pool_handle_t, ze_ipc_event_pool_handle_t *))                    \
  X(zeEventPoolOpenIpcHandle,                                                  \
    (ze_context_handle_t, ze_ipc_event_pool_handle_t,                          \
     ze_event_pool_handle_t *))                                                \
  X(zeEventPoolCloseIpcHandle, (ze_event_pool_handle_t))                       \
  X(zeEventCreate,                                                             \
    (ze_event_pool_handle_t, const ze_event_desc_t *, ze_event_handle_t *))    \
  X(zeEventDestroy, (ze_event_handle_t))                                       \
  X(zeEventHostSignal, (ze_event_handle_t))                                    \
  X(zeEventHostSynchronize, (ze_event_handle_t, uint64_t))                     \
  X(zeEventQueryStatus, (ze_event_handle_t))                                   \
  X(zeEventHostReset, (ze_event_handle_t))

static struct {
#define X(name, args) ze_result_t(*name) args;
  ZE_SYMBOLS(X)
#undef X
} ze;

/* Entry points newer than API 1.4: zeMemPutIpcHandle (1.6) and
 * zeMemGetFileDescriptorFromIpcHandleExp (1.6, experimental). */
typedef ze_result_t (*ze_put_ipc_handle_fn)(ze_context_handle_t,
                                            ze_ipc_mem_handle_t);
typedef ze_result_t (*ze_fd_from_ipc_handle_fn)(ze_context_handle_t,
                                                ze_ipc_mem_handle_t,
                                                uint64_t *);
/* Intel's extension for allocations made of several buffer objects (one
 * per tile): how many handles an allocation has. */
typedef ze_result_t (*zex_get_ipc_handles_fn)(ze_context_handle_t, const void *,
                                              uint32_t *,
                                              ze_ipc_mem_handle_t *);

/* ---- backend state ------------------------------------------------------- */

/* How an allocation or mapping was made (usmipc__allocation_t.how). */
enum {
  HOW_DEVICE = 1,  /* zeMemAllocDevice */
  HOW_HOST = 2,    /* zeMemAllocHost */
  HOW_SHARED = 3,  /* zeMemAllocShared */
  HOW_IPC = 4,     /* zeMemOpenIpcHandle */
  HOW_FOREIGN = 5, /* another library's allocation, seen by pointer_query */
  HOW_DEVICE_EXPORTABLE = 6, /* zeMemAllocDevice with an export desc (DMA_BUF):
                                never placed in a driver pool */
};

/* Handle kinds in the wire payload (docs/handle-format.md). */
enum {
  LZ_HANDLE_FD_IN_DATA = 1, /* 64 bytes: ze_ipc_mem_handle_t, fd slot zeroed */
  LZ_HANDLE_FD_AND_PID = 2, /* the same, pid slot zeroed too */
  LZ_HANDLE_DMABUF = 3,     /* usmipc 0.3: no driver bytes at all; the
                               descriptor and record 0x0201 say everything,
                               and the importer builds its own driver's
                               handle (see lz_ipc_import) */
};

/* Extension record 0x0201 (docs/handle-format.md), 16 bytes: what the
 * exporter's driver was, so that an importer can refuse what it cannot
 * translate: u32 driverVersion, u8 layout (LZ_LAYOUT_*), u8 flags
 * (LZ_REC_*), u16 zero, u64 pool offset. */
#define LZ_RECORD_DRIVER 0x0201
#define LZ_RECORD_LEN 16
enum {
  LZ_LAYOUT_LEGACY = 1,      /* IpcMemoryData: fd, pool offset, type at 16 */
  LZ_LAYOUT_OPAQUE = 2,      /* IpcOpaqueMemoryData without the fd copy
                                (25.35-26.14): pid at 16, type at 20, memory
                                type at 21, compressed flag at 54 (26.09+) */
  LZ_LAYOUT_OPAQUE_COPY = 3, /* 26.18+: the fd copied at 22 (opaqueHandle),
                                compressed flag at 62 */
};
enum {
  LZ_REC_COMPRESSED = 1, /* the driver marked the memory compressed */
  LZ_REC_UNPOOLED = 2,   /* allocated with an export desc (DMA_BUF) */
};

typedef struct lz_driver {
  ze_driver_handle_t handle;
  ze_context_handle_t context;
  int ipc_memory;   /* ZE_IPC_PROPERTY_FLAG_MEMORY */
  int ipc_events;   /* ZE_IPC_PROPERTY_FLAG_EVENT_POOL */
  uint32_t version; /* driverVersion */
  bool test_driver; /* usmipc's test driver: its dma-bufs are memfds */
  ze_put_ipc_handle_fn put_ipc_handle;         /* or NULL */
  ze_fd_from_ipc_handle_fn fd_from_ipc_handle; /* or NULL */
  zex_get_ipc_handles_fn get_ipc_handles;      /* or NULL */
  /* The self-test on first IPC use (lz_ipc_check): 0 untested, 1 passed,
   * -1 failed (selftest_reason says why). */
  int selftest_state;
  pthread_mutex_t selftest_lock;
  char selftest_reason[512];
} lz_driver_t;

/* What this process's own driver writes in an event pool's IPC handle,
 * learnt once per device from a pool of its own (lz_event_template): the
 * importer hands its driver these bytes with only the descriptor (and the
 * fields that would send the driver after another process's) replaced. */
typedef struct lz_event_template {
  int state; /* 0 not learnt, 1 learnt, < 0 the code it failed with */
  uint8_t bytes[ZE_MAX_IPC_HANDLE_SIZE];
  uint8_t layout;       /* LZ_EVL_* */
  uint8_t flags;        /* LZ_EVF_* */
  uint32_t max_packets; /* maxEventPackets */
  char reason[400];     /* why it failed */
} lz_event_template_t;

typedef struct lz_device {
  lz_driver_t *driver;
  uint8_t uuid[16];
  ze_device_handle_t handle;
  int ordinal;         /* probe order, the core's ordinal */
  uint32_t copy_group; /* command queue group ordinal that can copy */
  uint64_t max_alloc;  /* maxMemAllocSize */
  pthread_mutex_t template_lock;
  lz_event_template_t event_template;
} lz_device_t;

/* What an exported allocation keeps (usmipc__allocation_t.native points
 * here): the driver's handle, released with zeMemPutIpcHandle at free. */
typedef struct lz_export {
  ze_ipc_mem_handle_t handle;
  int fd; /* our own duplicate of the handle's dma-buf: what we publish */
  uint8_t record[LZ_RECORD_LEN]; /* record 0x0201 of every handle */
} lz_export_t;

typedef struct lz_queue {
  ze_command_list_handle_t list;
  pthread_mutex_t lock; /* a command list is not safe for concurrent use */
  bool wrapped;         /* another library's list (usmipc_queue_from_native) */
  /* A wrapped list may be asynchronous: queue_synchronize appends a barrier
   * that signals this private event and waits for it on the host. */
  ze_event_pool_handle_t sync_pool;
  ze_event_handle_t sync_event;
} lz_queue_t;

/* An event (usmipc__backend_ops_t.event_*): one event in an event pool of
 * its own (docs/level-zero.md, "Events"). */
typedef struct lz_event {
  lz_device_t *dev;
  ze_event_pool_handle_t pool;
  ze_event_handle_t event;
  bool imported; /* opened from another process's pool */
  int fd;        /* exported: our duplicate of the pool's dma-buf, or -1 */
} lz_event_t;

#define MAX_LZ_DRIVERS 8
#define MAX_LZ_DEVICES 16
static lz_driver_t lz_drivers[MAX_LZ_DRIVERS];
static int lz_driver_count;
static lz_device_t lz_devices[MAX_LZ_DEVICES];
static int lz_device_count;

static const char *result_name(ze_result_t res) {
  switch (res) {
#define R(name)                                                                \
  case name:                                                                   \
    return #name;
    R(ZE_RESULT_SUCCESS)
    R(ZE_RESULT_NOT_READY)
    R(ZE_RESULT_ERROR_DEVICE_LOST)
    R(ZE_RESULT_ERROR_OUT_OF_HOST_MEMORY)
    R(ZE_RESULT_ERROR_OUT_OF_DEVICE_MEMORY)
    R(ZE_RESULT_ERROR_UNINITIALIZED)
    R(ZE_RESULT_ERROR_UNSUPPORTED_VERSION)
    R(ZE_RESULT_ERROR_UNSUPPORTED_FEATURE)
    R(ZE_RESULT_ERROR_INVALID_ARGUMENT)
    R(ZE_RESULT_ERROR_INVALID_NULL_HANDLE)
    R(ZE_RESULT_ERROR_HANDLE_OBJECT_IN_USE)
    R(ZE_RESULT_ERROR_INVALID_NULL_POINTER)
    R(ZE_RESULT_ERROR_INVALID_SIZE)
    R(ZE_RESULT_ERROR_UNSUPPORTED_SIZE)
    R(ZE_RESULT_ERROR_UNSUPPORTED_ALIGNMENT)
    R(ZE_RESULT_ERROR_INVALID_ENUMERATION)
    R(ZE_RESULT_ERROR_UNSUPPORTED_ENUMERATION)
    R(ZE_RESULT_ERROR_UNKNOWN)
#undef R
  }
  return "ZE_RESULT_?";
}

static int lz_fail(ze_result_t res, const char *what) {
  int code = res == ZE_RESULT_ERROR_OUT_OF_HOST_MEMORY ||
                     res == ZE_RESULT_ERROR_OUT_OF_DEVICE_MEMORY
                 ? USMIPC_ENOMEM
                 : USMIPC_EBACKEND;
  return usmipc__fail_native(code, res, "%s failed: %s (0x%x)", what,
                             result_name(res), (unsigned)res);
}

/* ---- probe --------------------------------------------------------------- */

/* Resolves an entry point newer than the loader may be. The loader's own
 * export is preferred: it dispatches to the right driver whatever the
 * handles. Failing that (loader 1.8 predates both functions), the driver's
 * own function is used, but only with a single driver and no forced
 * interception, the case where the loader hands the driver's handles to the
 * application unchanged, so that the driver can understand them. */
static void *newer_entry_point(void *lib, lz_driver_t *drv, const char *name) {
  void *fn = dlsym(lib, name);
  if (fn != NULL)
    return fn;
  const char *intercept = getenv("ZE_ENABLE_LOADER_INTERCEPT");
  if (lz_driver_count != 1 ||
      (intercept != NULL && strcmp(intercept, "") && strcmp(intercept, "0")))
    return NULL;
  if (ze.zeDriverGetExtensionFunctionAddress(drv->handle, name, &fn) !=
      ZE_RESULT_SUCCESS)
    return NULL;
  return fn;
}

/* Whether a driver lists an extension by name. */
static bool has_extension(ze_driver_handle_t drv, const char *name) {
  uint32_t count = 0;
  if (ze.zeDriverGetExtensionProperties(drv, &count, NULL) !=
          ZE_RESULT_SUCCESS ||
      count == 0)
    return false;
  ze_driver_extension_properties_t *ext = calloc(count, sizeof(*ext));
  bool found = false;
  if (ext != NULL &&
      ze.zeDriverGetExtensionProperties(drv, &count, ext) == ZE_RESULT_SUCCESS)
    for (uint32_t i = 0; i < count && !found; i++)
      found = strncmp(ext[i].name, name, sizeof(ext[i].name)) == 0;
  free(ext);
  return found;
}

/* The first command queue group that can copy: copies and fills are the
 * only commands usmipc submits. */
static uint32_t copy_group_of(ze_device_handle_t dev) {
  ze_command_queue_group_properties_t groups[16];
  uint32_t count = 0;
  if (ze.zeDeviceGetCommandQueueGroupProperties(dev, &count, NULL) !=
          ZE_RESULT_SUCCESS ||
      count == 0)
    return 0;
  if (count > USMIPC__ARRAY_SIZE(groups))
    count = USMIPC__ARRAY_SIZE(groups);
  memset(groups, 0, sizeof(groups));
  for (uint32_t i = 0; i < count; i++)
    groups[i].stype = ZE_STRUCTURE_TYPE_COMMAND_QUEUE_GROUP_PROPERTIES;
  if (ze.zeDeviceGetCommandQueueGroupProperties(dev, &count, groups) !=
      ZE_RESULT_SUCCESS)
    return 0;
  for (uint32_t i = 0; i < count; i++)
    if (groups[i].flags & ZE_COMMAND_QUEUE_GROUP_PROPERTY_FLAG_COPY)
      return i;
  return 0;
}

static int lz_probe(usmipc__device_desc_t *devices, int max, char *reason,
                    size_t reason_len) {
  void *lib = dlopen("libze_loader.so.1", RTLD_NOW | RTLD_LOCAL);
  if (lib == NULL) {
    snprintf(reason, reason_len,
             "libze_loader.so.1 not found (%s); install the Level Zero loader "
             "(Debian/Ubuntu package libze1) and a driver",
             dlerror());
    return USMIPC_EUNAVAILABLE;
  }
#define X(name, args)                                                          \
  *(void **)&ze.name = dlsym(lib, #name);                                      \
  if (ze.name == NULL) {                                                       \
    snprintf(reason, reason_len, "the Level Zero loader lacks %s", #name);     \
    return USMIPC_EUNAVAILABLE;                                                \
  }
  ZE_SYMBOLS(X)
#undef X
  ze_result_t res = ze.zeInit(ZE_INIT_FLAG_GPU_ONLY);
  if (res != ZE_RESULT_SUCCESS) {
    snprintf(reason, reason_len,
             "zeInit failed: %s (0x%x): the loader found no working GPU "
             "driver (install intel-level-zero-gpu, or check "
             "ZE_ENABLE_ALT_DRIVERS)",
             result_name(res), (unsigned)res);
    return USMIPC_EUNAVAILABLE;
  }
  ze_driver_handle_t handles[MAX_LZ_DRIVERS];
  uint32_t ndrivers = MAX_LZ_DRIVERS;
  res = ze.zeDriverGet(&ndrivers, handles);
  if (res != ZE_RESULT_SUCCESS) {
    snprintf(reason, reason_len, "zeDriverGet failed: %s (0x%x)",
             result_name(res), (unsigned)res);
    return USMIPC_EUNAVAILABLE;
  }
  lz_driver_count =
      (int)(ndrivers < MAX_LZ_DRIVERS ? ndrivers : MAX_LZ_DRIVERS);
  int count = 0;
  for (int k = 0; k < lz_driver_count; k++) {
    lz_driver_t *drv = &lz_drivers[k];
    drv->handle = handles[k];
    ze_driver_ipc_properties_t ipc = {
        .stype = ZE_STRUCTURE_TYPE_DRIVER_IPC_PROPERTIES};
    if (ze.zeDriverGetIpcProperties(drv->handle, &ipc) == ZE_RESULT_SUCCESS) {
      drv->ipc_memory = (ipc.flags & ZE_IPC_PROPERTY_FLAG_MEMORY) != 0;
      drv->ipc_events = (ipc.flags & ZE_IPC_PROPERTY_FLAG_EVENT_POOL) != 0;
    }
    ze_context_desc_t cdesc = {.stype = ZE_STRUCTURE_TYPE_CONTEXT_DESC};
    res = ze.zeContextCreate(drv->handle, &cdesc, &drv->context);
    if (res != ZE_RESULT_SUCCESS) {
      snprintf(reason, reason_len, "zeContextCreate failed: %s (0x%x)",
               result_name(res), (unsigned)res);
      drv->context = NULL;
      continue;
    }
    *(void **)&drv->put_ipc_handle =
        newer_entry_point(lib, drv, "zeMemPutIpcHandle");
    *(void **)&drv->fd_from_ipc_handle =
        newer_entry_point(lib, drv, "zeMemGetFileDescriptorFromIpcHandleExp");
    *(void **)&drv->get_ipc_handles =
        newer_entry_point(lib, drv, "zexMemGetIpcHandles");
    ze_driver_properties_t dprops = {.stype =
                                         ZE_STRUCTURE_TYPE_DRIVER_PROPERTIES};
    if (ze.zeDriverGetProperties(drv->handle, &dprops) == ZE_RESULT_SUCCESS)
      drv->version = dprops.driverVersion;
    drv->test_driver = has_extension(drv->handle, "ZE_usmipc_test_driver");
    pthread_mutex_init(&drv->selftest_lock, NULL);

    ze_device_handle_t devs[MAX_LZ_DEVICES];
    uint32_t ndevs = MAX_LZ_DEVICES;
    if (ze.zeDeviceGet(drv->handle, &ndevs, devs) != ZE_RESULT_SUCCESS)
      continue;
    for (uint32_t i = 0; i < ndevs && count < max && count < MAX_LZ_DEVICES;
         i++) {
      ze_device_properties_t props;
      memset(&props, 0, sizeof(props));
      props.stype = ZE_STRUCTURE_TYPE_DEVICE_PROPERTIES;
      if (ze.zeDeviceGetProperties(devs[i], &props) != ZE_RESULT_SUCCESS ||
          props.type != ZE_DEVICE_TYPE_GPU)
        continue;
      lz_device_t *d = &lz_devices[count];
      usmipc__device_desc_t *desc = &devices[count];
      d->driver = drv;
      d->handle = devs[i];
      d->ordinal = count;
      d->copy_group = copy_group_of(devs[i]);
      d->max_alloc = props.maxMemAllocSize;
      pthread_mutex_init(&d->template_lock, NULL);
      desc->type = USMIPC_DEVICE_GPU;
      size_t name_len = strnlen(props.name, sizeof(desc->name) - 1);
      memcpy(desc->name, props.name, name_len);
      desc->name[name_len] = '\0';
      memcpy(desc->uuid, props.uuid, 16);
      memcpy(d->uuid, props.uuid, 16);
      desc->supports_ipc = drv->ipc_memory;
      desc->native = d;
      count++;
    }
  }
  lz_device_count = count;
  if (count == 0 && reason[0] == '\0')
    snprintf(reason, reason_len, "the Level Zero drivers report no GPU");
  return count;
}

/* ---- memory -------------------------------------------------------------- */

static int lz_mem_alloc(void *dev, usmipc_mem_kind_t kind, size_t nbytes,
                        unsigned flags, usmipc__allocation_t *out) {
  (void)flags; /* one way to share: the driver's IPC handle */
  lz_device_t *d = dev;
  ze_context_handle_t ctx = d->driver->context;
  ze_device_mem_alloc_desc_t ddesc = {
      .stype = ZE_STRUCTURE_TYPE_DEVICE_MEM_ALLOC_DESC};
  ze_host_mem_alloc_desc_t hdesc = {.stype =
                                        ZE_STRUCTURE_TYPE_HOST_MEM_ALLOC_DESC};
  void *p = NULL;
  ze_result_t res;
  const char *what;
  if (kind == USMIPC_MEM_DEVICE) {
    /* Device memory is what usmipc exports: ask for it exportable as a
     * dma-buf. Besides saying what it is for, this keeps it out of the
     * driver's pools of small allocations (compute-runtime 25.40+ on BMG,
     * LNL, PTL), where the handle would name the whole pool (an importer
     * would reach the neighbours) and any free in the pool drops the
     * pool's descriptor. A driver that refuses the desc gets a plain
     * allocation; ipc_export then refuses it if it was pooled. */
    what = "zeMemAllocDevice";
    ze_external_memory_export_desc_t xdesc = {
        .stype = ZE_STRUCTURE_TYPE_EXTERNAL_MEMORY_EXPORT_DESC,
        .flags = ZE_EXTERNAL_MEMORY_TYPE_FLAG_DMA_BUF};
    ze_device_mem_alloc_desc_t xddesc = ddesc;
    xddesc.pNext = &xdesc;
    res = ze.zeMemAllocDevice(ctx, &xddesc, nbytes, 0, d->handle, &p);
    out->how = HOW_DEVICE_EXPORTABLE;
    if (res == ZE_RESULT_ERROR_UNSUPPORTED_ENUMERATION ||
        res == ZE_RESULT_ERROR_INVALID_ENUMERATION ||
        res == ZE_RESULT_ERROR_UNSUPPORTED_FEATURE ||
        res == ZE_RESULT_ERROR_INVALID_ARGUMENT) {
      res = ze.zeMemAllocDevice(ctx, &ddesc, nbytes, 0, d->handle, &p);
      out->how = HOW_DEVICE;
    }
  } else if (kind == USMIPC_MEM_HOST) {
    what = "zeMemAllocHost";
    res = ze.zeMemAllocHost(ctx, &hdesc, nbytes, 0, &p);
    out->how = HOW_HOST;
  } else {
    what = "zeMemAllocShared";
    res = ze.zeMemAllocShared(ctx, &ddesc, &hdesc, nbytes, 0, d->handle, &p);
    out->how = HOW_SHARED;
  }
  if (res == ZE_RESULT_ERROR_UNSUPPORTED_SIZE)
    return usmipc__fail_native(USMIPC_ENOMEM, res,
                               "%s refused %zu bytes (%s): the device's "
                               "largest allocation is %llu bytes",
                               what, nbytes, result_name(res),
                               (unsigned long long)d->max_alloc);
  if (res != ZE_RESULT_SUCCESS)
    return lz_fail(res, what);
  out->base = p;
  out->size = nbytes;
  out->reserved = nbytes;
  out->fd = -1;
  out->fd_is_device_buffer = true;
  out->native = 0;
  return 0;
}

/* Releases the IPC handle of an exported allocation and closes our
 * duplicate of its descriptor (the driver closes its own). */
static void release_export(lz_device_t *d, usmipc__allocation_t *a) {
  lz_export_t *x = (lz_export_t *)(uintptr_t)a->native;
  if (x == NULL)
    return;
  /* Without zeMemPutIpcHandle (API 1.4 loaders, and compute-runtime, which
   * serves it only through the loader's 1.6 table) the handle lives until
   * zeMemFree, which follows. Errors are ignored: a loader without the
   * driver's entry answers ZE_RESULT_ERROR_UNINITIALIZED, and nothing is
   * left to do either way. */
  if (d->driver->put_ipc_handle != NULL)
    d->driver->put_ipc_handle(d->driver->context, x->handle);
  close(x->fd);
  free(x);
  a->native = 0;
  a->fd = -1;
}

static int lz_mem_free(void *dev, usmipc__allocation_t *a) {
  lz_device_t *d = dev;
  release_export(d, a);
  ze_result_t res = ze.zeMemFree(d->driver->context, a->base);
  return res == ZE_RESULT_SUCCESS ? 0 : lz_fail(res, "zeMemFree");
}

/* Pointers from other libraries (SYCL, PyTorch XPU): the driver knows the
 * allocation around any USM pointer, and its id, which changes when an
 * address is reused. */
static int lz_pointer_query(const void *ptr, usmipc__allocation_t *out,
                            uint64_t *buffer_id, int *device_index) {
  for (int k = 0; k < lz_driver_count; k++) {
    lz_driver_t *drv = &lz_drivers[k];
    if (drv->context == NULL)
      continue;
    ze_memory_allocation_properties_t props = {
        .stype = ZE_STRUCTURE_TYPE_MEMORY_ALLOCATION_PROPERTIES};
    ze_device_handle_t owner = NULL;
    if (ze.zeMemGetAllocProperties(drv->context, ptr, &props, &owner) !=
            ZE_RESULT_SUCCESS ||
        props.type == ZE_MEMORY_TYPE_UNKNOWN)
      continue;
    void *base = NULL;
    size_t size = 0;
    if (ze.zeMemGetAddressRange(drv->context, ptr, &base, &size) !=
            ZE_RESULT_SUCCESS ||
        size == 0)
      continue;
    /* Host memory belongs to no device: report the driver's first. */
    const lz_device_t *d = NULL;
    for (int i = 0; i < lz_device_count && d == NULL; i++)
      if (lz_devices[i].driver == drv &&
          (owner == NULL || lz_devices[i].handle == owner))
        d = &lz_devices[i];
    if (d == NULL)
      continue; /* a sub-device or a device usmipc does not list */
    out->base = base;
    out->size = size;
    out->reserved = size;
    out->fd = -1;
    out->how = HOW_FOREIGN;
    out->native = 0;
    out->kind = props.type == ZE_MEMORY_TYPE_DEVICE ? USMIPC_MEM_DEVICE
                : props.type == ZE_MEMORY_TYPE_HOST ? USMIPC_MEM_HOST
                                                    : USMIPC_MEM_SHARED;
    *buffer_id = props.id;
    *device_index = d->ordinal;
    return 0;
  }
  return USMIPC_EUNKNOWNPTR;
}

/* ---- queues -------------------------------------------------------------- */

/* A synchronous immediate command list: every append has completed when it
 * returns, so queue_synchronize has nothing to wait for. It needs nothing
 * newer than API 1.0 (zeCommandListHostSynchronize, which an asynchronous
 * list would need, is 1.6 and absent from the loader 1.8). */
static int lz_queue_create(void *dev, void **queue) {
  lz_device_t *d = dev;
  lz_queue_t *q = calloc(1, sizeof(*q));
  if (q == NULL)
    return usmipc__fail(USMIPC_ENOMEM, "out of memory");
  ze_command_queue_desc_t desc = {.stype = ZE_STRUCTURE_TYPE_COMMAND_QUEUE_DESC,
                                  .ordinal = d->copy_group,
                                  .index = 0,
                                  .mode = ZE_COMMAND_QUEUE_MODE_SYNCHRONOUS,
                                  .priority = ZE_COMMAND_QUEUE_PRIORITY_NORMAL};
  ze_result_t res = ze.zeCommandListCreateImmediate(d->driver->context,
                                                    d->handle, &desc, &q->list);
  if (res != ZE_RESULT_SUCCESS) {
    free(q);
    return lz_fail(res, "zeCommandListCreateImmediate");
  }
  pthread_mutex_init(&q->lock, NULL);
  *queue = q;
  return 0;
}

/* Frees what usmipc made for a queue: its sync event, the wrapper. */
static void queue_release(lz_queue_t *q) {
  if (q->sync_event != NULL)
    ze.zeEventDestroy(q->sync_event);
  if (q->sync_pool != NULL)
    ze.zeEventPoolDestroy(q->sync_pool);
  pthread_mutex_destroy(&q->lock);
  free(q);
}

static int lz_queue_destroy(void *dev, void *queue) {
  (void)dev;
  lz_queue_t *q = queue;
  ze_result_t res = ze.zeCommandListDestroy(q->list);
  queue_release(q);
  return res == ZE_RESULT_SUCCESS ? 0 : lz_fail(res, "zeCommandListDestroy");
}

/* A command list another library owns (an immediate list: SYCL's, PyTorch
 * XPU's), wrapped without taking it: usmipc appends to it under its own
 * lock (which orders usmipc's appends, not the owner's: the owner must not
 * append concurrently, as with any command list), and destroying the
 * wrapper leaves the list alone. */
static int lz_queue_wrap(void *dev, void *native, void **queue) {
  (void)dev;
  if (native == NULL)
    return usmipc__fail(USMIPC_EINVAL,
                        "usmipc_queue_from_native: a level_zero queue is an "
                        "immediate ze_command_list_handle_t, not NULL");
  lz_queue_t *q = calloc(1, sizeof(*q));
  if (q == NULL)
    return usmipc__fail(USMIPC_ENOMEM, "out of memory");
  q->list = native;
  q->wrapped = true;
  pthread_mutex_init(&q->lock, NULL);
  *queue = q;
  return 0;
}

static int lz_queue_unwrap(void *dev, void *queue) {
  (void)dev;
  queue_release(queue);
  return 0;
}

static void *lz_queue_native(void *dev, void *queue) {
  (void)dev;
  return ((lz_queue_t *)queue)->list;
}

/* usmipc's own lists are synchronous: idle whenever no call is in one. A
 * wrapped list may still run work: not known to be idle (asking would take
 * a barrier and an event, which is what the caller means to save). */
static int lz_queue_idle(void *dev, void *queue) {
  (void)dev;
  return ((lz_queue_t *)queue)->wrapped ? 0 : 1;
}

/* usmipc's own lists are synchronous: nothing is pending. A wrapped list
 * may be asynchronous: a barrier that signals a private event marks all its
 * work so far, and the host waits for that event (the API 1.0 way; the
 * list's own host synchronization is API 1.6). */
static int lz_queue_synchronize(void *dev, void *queue) {
  lz_device_t *d = dev;
  lz_queue_t *q = queue;
  if (!q->wrapped)
    return 0;
  pthread_mutex_lock(&q->lock);
  ze_result_t res = ZE_RESULT_SUCCESS;
  const char *what = "zeEventPoolCreate";
  if (q->sync_pool == NULL) {
    ze_event_pool_desc_t pdesc = {.stype = ZE_STRUCTURE_TYPE_EVENT_POOL_DESC,
                                  .flags = ZE_EVENT_POOL_FLAG_HOST_VISIBLE,
                                  .count = 1};
    res = ze.zeEventPoolCreate(d->driver->context, &pdesc, 1, &d->handle,
                               &q->sync_pool);
    if (res != ZE_RESULT_SUCCESS)
      q->sync_pool = NULL;
  }
  if (res == ZE_RESULT_SUCCESS && q->sync_event == NULL) {
    ze_event_desc_t edesc = {.stype = ZE_STRUCTURE_TYPE_EVENT_DESC,
                             .index = 0,
                             .signal = ZE_EVENT_SCOPE_FLAG_HOST,
                             .wait = ZE_EVENT_SCOPE_FLAG_HOST};
    what = "zeEventCreate";
    res = ze.zeEventCreate(q->sync_pool, &edesc, &q->sync_event);
    if (res != ZE_RESULT_SUCCESS)
      q->sync_event = NULL;
  }
  if (res == ZE_RESULT_SUCCESS) {
    what = "zeEventHostReset";
    res = ze.zeEventHostReset(q->sync_event);
  }
  if (res == ZE_RESULT_SUCCESS) {
    what = "zeCommandListAppendBarrier";
    res = ze.zeCommandListAppendBarrier(q->list, q->sync_event, 0, NULL);
  }
  ze_event_handle_t ev = q->sync_event;
  pthread_mutex_unlock(&q->lock);
  if (res == ZE_RESULT_SUCCESS) {
    what = "zeEventHostSynchronize";
    res = ze.zeEventHostSynchronize(ev, UINT64_MAX);
  }
  return res == ZE_RESULT_SUCCESS ? 0 : lz_fail(res, what);
}

static int lz_memcpy(void *dev, void *queue, void *dst, const void *src,
                     size_t n) {
  (void)dev;
  lz_queue_t *q = queue;
  pthread_mutex_lock(&q->lock);
  ze_result_t res =
      ze.zeCommandListAppendMemoryCopy(q->list, dst, src, n, NULL, 0, NULL);
  pthread_mutex_unlock(&q->lock);
  return res == ZE_RESULT_SUCCESS
             ? 0
             : lz_fail(res, "zeCommandListAppendMemoryCopy");
}

static int lz_memset(void *dev, void *queue, void *dst, int value, size_t n) {
  (void)dev;
  lz_queue_t *q = queue;
  uint8_t pattern = (uint8_t)value;
  pthread_mutex_lock(&q->lock);
  ze_result_t res = ze.zeCommandListAppendMemoryFill(q->list, dst, &pattern, 1,
                                                     n, NULL, 0, NULL);
  pthread_mutex_unlock(&q->lock);
  return res == ZE_RESULT_SUCCESS
             ? 0
             : lz_fail(res, "zeCommandListAppendMemoryFill");
}

/* ---- IPC ------------------------------------------------------------------
 * What Intel's driver puts in ze_ipc_mem_handle_t has changed with almost
 * every compute-runtime release from 25.35 to 26.31 (docs/level-zero.md has the
 * table): a legacy layout, an "opaque" one with the exporter's pid that makes
 * the importer's driver fetch the descriptor itself (pidfd_getfd, or a socket),
 * a copy of the descriptor number whose equality with the first one selects
 * that path (26.18+), and an import cache keyed by descriptor number and pid
 * that importers never clear. Sending the exporter's bytes and patching them,
 * as usmipc 0.2 did, steers a current driver into that cache: a later open can
 * map an earlier allocation and succeed.
 *
 * So no driver bytes cross processes. The exporter takes the dma-buf out of
 * its handle, checks it, keeps a duplicate, and sends what its driver was
 * (record 0x0201); the core moves the descriptor. The importer writes a
 * handle of its own that every release reads as a plain local import: the
 * descriptor at 0 (never 0 itself), zeros where the pid, the handle type,
 * the memory type (device) and the descriptor copy go, the compression flag
 * where its own release keeps it. */

/* A newer loader answers ZE_RESULT_ERROR_UNINITIALIZED for a table entry
 * the driver does not fill, others UNSUPPORTED_FEATURE: the function is not
 * really there, and the layout has to do. */
static bool entry_missing(ze_result_t res) {
  return res == ZE_RESULT_ERROR_UNINITIALIZED ||
         res == ZE_RESULT_ERROR_UNSUPPORTED_FEATURE ||
         res == ZE_RESULT_ERROR_UNSUPPORTED_VERSION;
}

/* What a descriptor from a Level Zero driver must be before usmipc
 * publishes or imports it: a dma-buf of at least min bytes. usmipc's test
 * driver, which says so with an extension, stands its dma-bufs in with
 * memfds of its own name (no udmabuf in the kernels it runs on). */
/* The size of fd when it is one of usmipc's test driver's memfds (its
 * stand-ins for dma-bufs, which it names; the driver says so with an
 * extension), else false. */
static bool test_driver_buffer(const lz_driver_t *drv, int fd, uint64_t *size) {
  static const char prefix[] = "/memfd:usmipc-ze-test";
  char link[64], target[128];
  struct stat st;
  if (!drv->test_driver)
    return false;
  snprintf(link, sizeof(link), "/proc/self/fd/%d", fd);
  ssize_t n = readlink(link, target, sizeof(target) - 1);
  if (n <= 0 ||
      (target[n] = '\0', strncmp(target, prefix, sizeof(prefix) - 1)) != 0 ||
      fstat(fd, &st) != 0)
    return false;
  *size = (uint64_t)st.st_size;
  return true;
}

static int check_descriptor(const lz_driver_t *drv, int fd, uint64_t min,
                            int code, const char *what) {
  uint64_t size;
  if (test_driver_buffer(drv, fd, &size)) {
    if (size < min)
      return usmipc__fail(code,
                          "%s: the test driver's buffer is %llu bytes, "
                          "smaller than the %llu-byte allocation",
                          what, (unsigned long long)size,
                          (unsigned long long)min);
    return 0;
  }
  return usmipc__dmabuf_check(fd, min, code, what);
}

/* The descriptor in a fresh handle: the driver's word where it answers,
 * else the first 4 bytes (where every Intel layout keeps it). */
static int handle_descriptor(lz_driver_t *drv, const ze_ipc_mem_handle_t *h,
                             int *fd) {
  memcpy(fd, h->data, sizeof(*fd));
  if (drv->fd_from_ipc_handle == NULL)
    return 0;
  uint64_t reported = 0;
  ze_result_t res = drv->fd_from_ipc_handle(drv->context, *h, &reported);
  if (entry_missing(res))
    return 0;
  if (res != ZE_RESULT_SUCCESS)
    return lz_fail(res, "zeMemGetFileDescriptorFromIpcHandleExp");
  if (reported != (uint64_t)(int64_t)*fd)
    return usmipc__fail(USMIPC_ENOTSUP,
                        "this Level Zero driver's IPC handle keeps its file "
                        "descriptor (%llu) elsewhere than the first 4 bytes "
                        "(%d); usmipc cannot share memory through such "
                        "handles",
                        (unsigned long long)reported, *fd);
  return 0;
}

/* Reads an exporter's fresh handle (fd is its descriptor) into record
 * 0x0201, or refuses what usmipc cannot share faithfully. */
static int describe_handle(const lz_driver_t *drv, const ze_ipc_mem_handle_t *h,
                           int fd, uint32_t exporter, unsigned how,
                           uint8_t record[LZ_RECORD_LEN]) {
  const uint8_t *b = (const uint8_t *)h->data;
  uint32_t pid, copy;
  uint64_t pool_offset;
  memcpy(&pid, b + 16, 4);
  memcpy(&copy, b + 22, 4);
  memcpy(&pool_offset, b + 8, 8);
  uint8_t layout, flags = how == HOW_DEVICE_EXPORTABLE ? LZ_REC_UNPOOLED : 0;
  if (pid == exporter) {
    /* IpcOpaqueMemoryData: handle type at 20 (0: a descriptor, not a
     * Windows handle), memory type at 21 (0: device). */
    if (b[20] != 0 || b[21] != 0)
      return usmipc__fail(USMIPC_ENOTSUP,
                          "the Level Zero driver's handle is of type %u for "
                          "memory of type %u; usmipc shares device memory "
                          "through descriptors (type 0) only",
                          b[20], b[21]);
    layout = (int)copy == fd ? LZ_LAYOUT_OPAQUE_COPY : LZ_LAYOUT_OPAQUE;
    if (b[layout == LZ_LAYOUT_OPAQUE_COPY ? 62 : 54] != 0)
      flags |= LZ_REC_COMPRESSED;
  } else {
    if (b[16] != 0) /* IpcMemoryData's memory type */
      return usmipc__fail(USMIPC_ENOTSUP,
                          "the Level Zero driver's handle describes memory of "
                          "type %u, not device memory",
                          b[16]);
    layout = LZ_LAYOUT_LEGACY;
  }
  if (pool_offset != 0 && how != HOW_FOREIGN)
    return usmipc__fail(USMIPC_ENOTSUP,
                        "the Level Zero driver placed this allocation at "
                        "offset %llu of a pool it shares with other "
                        "allocations: its handle would give importers the "
                        "neighbours too. usmipc asks for unpooled memory "
                        "(an export desc), which this driver ignored",
                        (unsigned long long)pool_offset);
  memset(record, 0, LZ_RECORD_LEN);
  memcpy(record, &drv->version, 4);
  record[4] = layout;
  record[5] = flags;
  memcpy(record + 8, &pool_offset, 8);
  return 0;
}

static int lz_ipc_export(void *dev, usmipc__allocation_t *a,
                         usmipc__payload_t *payload, int *fd_to_share) {
  lz_device_t *d = dev;
  lz_driver_t *drv = d->driver;
  *fd_to_share = -1;
  if (a->how == HOW_FOREIGN)
    return usmipc__fail(USMIPC_ENOTSUP,
                        "Level Zero memory that another library allocated "
                        "cannot be exported: its IPC handle carries a file "
                        "descriptor that usmipc would have to keep and "
                        "release with the allocation; allocate it with "
                        "usmipc_malloc");
  if (a->how != HOW_DEVICE && a->how != HOW_DEVICE_EXPORTABLE)
    return usmipc__fail(USMIPC_EMEMKIND,
                        "only device memory can be exported, not host or "
                        "shared memory");
  lz_export_t *x = (lz_export_t *)(uintptr_t)a->native;
  if (x == NULL) {
    /* zeMemGetIpcHandle shares only the first buffer object of an
     * allocation that spans several (one per tile, with implicit scaling):
     * an importer would see part of it. */
    uint32_t objects = 0;
    if (drv->get_ipc_handles != NULL &&
        drv->get_ipc_handles(drv->context, a->base, &objects, NULL) ==
            ZE_RESULT_SUCCESS &&
        objects > 1)
      return usmipc__fail(USMIPC_ENOTSUP,
                          "this allocation spans %u buffer objects (one per "
                          "tile); a Level Zero IPC handle shares only the "
                          "first. Allocate on one tile (a sub-device, or "
                          "ZE_FLAT_DEVICE_HIERARCHY=FLAT) to share it",
                          objects);
    x = calloc(1, sizeof(*x));
    if (x == NULL)
      return usmipc__fail(USMIPC_ENOMEM, "out of memory");
    x->fd = -1;
    ze_result_t res = ze.zeMemGetIpcHandle(drv->context, a->base, &x->handle);
    if (res != ZE_RESULT_SUCCESS) {
      free(x);
      return lz_fail(res, "zeMemGetIpcHandle");
    }
    int fd = -1;
    int rc = handle_descriptor(drv, &x->handle, &fd);
    if (rc == 0)
      rc = check_descriptor(drv, fd, a->size, USMIPC_ENOTSUP,
                            "the descriptor in the driver's IPC handle");
    if (rc == 0)
      rc = describe_handle(drv, &x->handle, fd, (uint32_t)getpid(), a->how,
                           x->record);
    /* Our own duplicate is what importers get: the driver closes its
     * descriptor at zeMemFree (and, in a pool, at any neighbour's free),
     * and compute-runtime's zeMemPutIpcHandle closes whatever descriptor
     * has the number it is given. */
    if (rc == 0 && (x->fd = fcntl(fd, F_DUPFD_CLOEXEC, 3)) < 0)
      rc = usmipc__fail_native(usmipc__errno_code(errno), errno,
                               "cannot duplicate the driver's descriptor: %s",
                               strerror(errno));
    if (rc != 0) {
      if (drv->put_ipc_handle != NULL)
        drv->put_ipc_handle(drv->context, x->handle);
      free(x);
      return rc;
    }
    a->native = (uint64_t)(uintptr_t)x;
    a->fd = x->fd; /* owned by x; see release_export */
    a->fd_is_device_buffer = true;
  }
  payload->handle_kind = LZ_HANDLE_DMABUF;
  payload->len = 0;
  usmipc__put16le(payload->ext, LZ_RECORD_DRIVER);
  usmipc__put16le(payload->ext + 2, LZ_RECORD_LEN);
  memcpy(payload->ext + 4, x->record, LZ_RECORD_LEN);
  payload->ext_len = 4 + LZ_RECORD_LEN;
  *fd_to_share = x->fd;
  return 0;
}

/* This process's own driver layout, learnt once from a handle of a small
 * allocation of its own (only needed to place the compression flag). */
static uint8_t own_layout(lz_device_t *d) {
  static uint8_t layout; /* under the caller's serialization: see below */
  if (__atomic_load_n(&layout, __ATOMIC_ACQUIRE) != 0)
    return layout;
  usmipc__allocation_t a = {0};
  uint8_t found = 0;
  if (lz_mem_alloc(d, USMIPC_MEM_DEVICE, 4096, 0, &a) == 0) {
    ze_ipc_mem_handle_t h;
    memset(&h, 0, sizeof(h));
    if (ze.zeMemGetIpcHandle(d->driver->context, a.base, &h) ==
        ZE_RESULT_SUCCESS) {
      int fd;
      uint8_t record[LZ_RECORD_LEN];
      memcpy(&fd, h.data, sizeof(fd));
      if (describe_handle(d->driver, &h, fd, (uint32_t)getpid(), a.how,
                          record) == 0)
        found = record[4];
      if (d->driver->put_ipc_handle != NULL)
        d->driver->put_ipc_handle(d->driver->context, h);
    }
    ze.zeMemFree(d->driver->context, a.base);
  }
  /* Racing threads learn the same answer. */
  __atomic_store_n(&layout, found, __ATOMIC_RELEASE);
  return found;
}

static int import_dmabuf(lz_device_t *d, lz_device_t *owner,
                         const uint8_t rec[LZ_RECORD_LEN], int fd,
                         uint64_t allocation_size, usmipc__allocation_t *out);

static int lz_ipc_import(void *dev, void *owner_dev,
                         const usmipc__payload_t *payload, int fd,
                         uint64_t allocation_size, usmipc__allocation_t *out) {
  lz_device_t *d = dev, *owner = owner_dev;
  if (payload->handle_kind == LZ_HANDLE_FD_IN_DATA ||
      payload->handle_kind == LZ_HANDLE_FD_AND_PID)
    return usmipc__fail(USMIPC_EHANDLEVERSION,
                        "a Level Zero handle of usmipc 0.2, which sent the "
                        "exporter's driver bytes; current Intel drivers can "
                        "map the wrong memory from those. Export it again "
                        "with this usmipc");
  uint16_t rlen = 0;
  const uint8_t *rec =
      usmipc__ext_find(payload->ext, payload->ext_len, LZ_RECORD_DRIVER, &rlen);
  if (payload->handle_kind != LZ_HANDLE_DMABUF || payload->len != 0 ||
      rec == NULL || rlen != LZ_RECORD_LEN)
    return usmipc__fail(USMIPC_EBADHANDLE,
                        "Level Zero handle of unknown kind %u (payload %u "
                        "bytes, %s driver record)",
                        payload->handle_kind, payload->len,
                        rec ? "a malformed" : "no");
  uint8_t layout = rec[4], flags = rec[5];
  uint64_t pool_offset;
  memcpy(&pool_offset, rec + 8, 8);
  if (layout < LZ_LAYOUT_LEGACY || layout > LZ_LAYOUT_OPAQUE_COPY ||
      (flags & ~(LZ_REC_COMPRESSED | LZ_REC_UNPOOLED)) != 0 || pool_offset != 0)
    return usmipc__fail(USMIPC_EBADHANDLE,
                        "the Level Zero driver record is invalid (layout %u, "
                        "flags 0x%x, pool offset %llu)",
                        layout, flags, (unsigned long long)pool_offset);
  return import_dmabuf(d, owner, rec, fd, allocation_size, out);
}

/* Opens a dma-buf that another process's driver exported, described by
 * record 0x0201: a handle of this process's own making around fd. */
static int import_dmabuf(lz_device_t *d, lz_device_t *owner,
                         const uint8_t rec[LZ_RECORD_LEN], int fd,
                         uint64_t allocation_size, usmipc__allocation_t *out) {
  uint8_t flags = rec[5];
  uint64_t pool_offset;
  memcpy(&pool_offset, rec + 8, 8);
  if (fd < 0)
    return usmipc__fail(USMIPC_EBADHANDLE,
                        "Level Zero handle carries no descriptor");
  if (d->driver != owner->driver)
    return usmipc__fail(USMIPC_ENOTSUP,
                        "the memory belongs to another Level Zero driver than "
                        "the target device's; open it on the exporting device");
  if (d != owner) {
    ze_bool_t can = 0;
    ze.zeDeviceCanAccessPeer(d->handle, owner->handle, &can);
    if (!can)
      return usmipc__fail(USMIPC_ENOTSUP,
                          "level_zero GPU %d cannot access the memory of GPU "
                          "%d (no peer access); open the handle on GPU %d",
                          d->ordinal, owner->ordinal, owner->ordinal);
  }
  int rc =
      check_descriptor(d->driver, fd, pool_offset + allocation_size,
                       USMIPC_EUNTRUSTED, "the descriptor the exporter sent");
  if (rc != 0)
    return rc;
  /* Compressed memory opens only where this process's driver has a place
   * for the flag (26.09+ layouts); elsewhere it would read as plain. */
  int flag_at = -1;
  if (flags & LZ_REC_COMPRESSED) {
    uint8_t mine = own_layout(d);
    if (mine != LZ_LAYOUT_OPAQUE && mine != LZ_LAYOUT_OPAQUE_COPY)
      return usmipc__fail(USMIPC_ENOTSUP,
                          "the exporter's driver (version 0x%x) shares this "
                          "memory compressed, and this process's Level Zero "
                          "driver (version 0x%x) has no way to open "
                          "compressed memory; upgrade it",
                          (unsigned)(rec[0] | rec[1] << 8 | rec[2] << 16 |
                                     (unsigned)rec[3] << 24),
                          (unsigned)d->driver->version);
    flag_at = mine == LZ_LAYOUT_OPAQUE_COPY ? 62 : 54;
  }
  /* The descriptor is never 0 in the handle: 26.18+ would take a 0 equal
   * to the cleared copy at 22 for an opaque handle. */
  int local = fd, dup0 = -1;
  if (local == 0) {
    if ((dup0 = fcntl(fd, F_DUPFD_CLOEXEC, 3)) < 0)
      return usmipc__fail_native(usmipc__errno_code(errno), errno,
                                 "cannot duplicate the received descriptor: "
                                 "%s",
                                 strerror(errno));
    local = dup0;
  }
  ze_ipc_mem_handle_t h;
  memset(&h, 0, sizeof(h));
  memcpy(h.data, &local, sizeof(local));
  memcpy(h.data + 8, &pool_offset, 8); /* the driver maps the pool, adds it */
  if (flag_at >= 0)
    h.data[flag_at] = 1;
  ze_context_handle_t ctx = d->driver->context;
  void *p = NULL;
  ze_result_t res = ze.zeMemOpenIpcHandle(ctx, d->handle, h, 0, &p);
  if (dup0 >= 0)
    close(dup0);
  if (res == ZE_RESULT_ERROR_INVALID_ARGUMENT)
    return usmipc__fail_native(USMIPC_EBADHANDLE, res,
                               "zeMemOpenIpcHandle refused the handle (%s): "
                               "the descriptor received is not memory this "
                               "driver can import",
                               result_name(res));
  if (res != ZE_RESULT_SUCCESS)
    return lz_fail(res, "zeMemOpenIpcHandle");
  /* The handle's sizes are untrusted: never hand out a range the mapping
   * does not cover. */
  void *range_base = NULL;
  size_t range_size = 0;
  if (ze.zeMemGetAddressRange(ctx, p, &range_base, &range_size) ==
      ZE_RESULT_SUCCESS) {
    uint64_t lead = (uint64_t)((uintptr_t)p - (uintptr_t)range_base);
    if ((uintptr_t)p < (uintptr_t)range_base || lead > range_size ||
        allocation_size > range_size - lead) {
      ze.zeMemCloseIpcHandle(ctx, p);
      return usmipc__fail(USMIPC_EBADHANDLE,
                          "the handle claims a %llu-byte allocation but the "
                          "exporter's memory is %zu bytes",
                          (unsigned long long)allocation_size, range_size);
    }
  }
  out->base = p;
  out->size = (size_t)allocation_size;
  out->reserved = (size_t)allocation_size;
  out->kind = USMIPC_MEM_DEVICE;
  out->how = HOW_IPC;
  out->fd = -1;
  out->native = 0;
  return 0;
}

/* Memory a SYCL program exported (usmipc_ipc_open_sycl): the exporter's
 * driver handle, read in its own layout, says where the pool offset and the
 * compression flag are; then the same import as for usmipc's handles. */
static int lz_ipc_import_sycl(void *dev, const usmipc__umf_blob_t *blob, int fd,
                              usmipc__allocation_t *out) {
  lz_device_t *d = dev;
  ze_ipc_mem_handle_t h;
  memcpy(h.data, blob->ze_handle, sizeof(h.data));
  uint8_t rec[LZ_RECORD_LEN];
  int rc = describe_handle(d->driver, &h, (int)blob->fd_number, blob->pid,
                           HOW_FOREIGN, rec);
  if (rc != 0)
    return rc;
  return import_dmabuf(d, d, rec, fd, blob->base_size, out);
}

/* ---- the self-test --------------------------------------------------------
 * Everything above is read from Intel's source, not observed on its GPUs.
 * So the first time a process shares Level Zero memory on a real driver
 * (export, import, or asking the device's IPC aspect), usmipc checks that it
 * works end to end, in a way the driver cannot short-circuit: a helper
 * process (usmipc-helper ze-selftest) allocates, fills and exports 1 MiB;
 * a second one (ze-selftest-open) opens it through the whole usmipc path
 * with the descriptor at another number than in the exporter, and compares
 * every byte. Both are helpers so that this backend calls no public API of
 * the library it is part of (backend.h). If that
 * fails, Level Zero IPC is unavailable on this driver, with the reason. The
 * verdict is kept for the process and, per user, driver version, device
 * and boot, in $XDG_RUNTIME_DIR (or ~/.cache): a later process reads it.
 *
 * USMIPC_ZE_SELFTEST=0 skips it, =1 forces it (even on usmipc's test
 * driver, where it is otherwise skipped); USMIPC_HELPER names the helper
 * (default: beside the library, or ../libexec/usmipc/). */
/* Where usmipc-helper is: USMIPC_HELPER, else next to the object that holds
 * this code (libusmipc.so, or the Python extension), else in
 * ../libexec/usmipc/ from it. */
static int helper_path(char *out, size_t len) {
  const char *env = getenv("USMIPC_HELPER");
  if (env != NULL && *env != '\0') {
    snprintf(out, len, "%s", env);
    return access(out, X_OK) == 0 ? 0 : -1;
  }
  Dl_info info;
  if (dladdr((void *)helper_path, &info) == 0 || info.dli_fname == NULL)
    return -1;
  char dir[PATH_MAX];
  snprintf(dir, sizeof(dir), "%s", info.dli_fname);
  char *slash = strrchr(dir, '/');
  if (slash == NULL)
    return -1;
  *slash = '\0';
  static const char *const places[] = {"%s/usmipc-helper",
                                       "%s/../libexec/usmipc/usmipc-helper"};
  for (size_t i = 0; i < sizeof(places) / sizeof(places[0]); i++) {
    snprintf(out, len, places[i], dir);
    if (access(out, X_OK) == 0)
      return 0;
  }
  return -1;
}

static void selftest_cache_path(const lz_device_t *d, char *out, size_t len) {
  const char *runtime = getenv("XDG_RUNTIME_DIR"), *home = getenv("HOME");
  char dir[PATH_MAX];
  if (runtime != NULL && *runtime == '/')
    snprintf(dir, sizeof(dir), "%s", runtime);
  else if (home != NULL && *home == '/')
    snprintf(dir, sizeof(dir), "%s/.cache", home);
  else {
    out[0] = '\0';
    return;
  }
  char uuid[33], boot[33];
  for (int i = 0; i < 16; i++) {
    snprintf(uuid + 2 * i, 3, "%02x", d->uuid[i]);
    snprintf(boot + 2 * i, 3, "%02x", usmipc__self_basic()->boot_id[i]);
  }
  snprintf(out, len, "%s/usmipc-ze-selftest-%08x-%s-%s", dir,
           d->driver->version, uuid, boot);
}

/* A verdict another process of this user left: 1 ok, -1 failed (reason
 * filled), 0 none. Only a file of this user that nobody else may write. */
static int selftest_cached(const char *path, char *reason, size_t len) {
  if (path[0] == '\0')
    return 0;
  int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
  if (fd < 0)
    return 0;
  struct stat st;
  char buf[600];
  ssize_t n = -1;
  if (fstat(fd, &st) == 0 && S_ISREG(st.st_mode) &&
      st.st_uid == usmipc__self_basic()->uid && (st.st_mode & 022) == 0)
    n = read(fd, buf, sizeof(buf) - 1);
  close(fd);
  if (n < 2)
    return 0;
  buf[n] = '\0';
  buf[strcspn(buf, "\n")] = '\0';
  if (strcmp(buf, "ok") == 0)
    return 1;
  if (strncmp(buf, "fail ", 5) == 0) {
    snprintf(reason, len, "%.300s (cached in %.150s)", buf + 5, path);
    return -1;
  }
  return 0;
}

static void selftest_remember(const char *path, int ok, const char *reason) {
  if (path[0] == '\0')
    return;
  char tmp[PATH_MAX + 16];
  snprintf(tmp, sizeof(tmp), "%s.%d", path, (int)getpid());
  int fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0)
    return;
  char buf[600];
  int n = snprintf(buf, sizeof(buf), ok ? "ok\n" : "fail %s\n", reason);
  bool written = n > 0 && write(fd, buf, (size_t)n) == n;
  close(fd);
  if (!written || rename(tmp, path) != 0)
    unlink(tmp);
}

/* Reads one line from fd within timeout_ms. */
static int read_line(int fd, char *buf, size_t len, int timeout_ms) {
  size_t got = 0;
  uint64_t deadline = usmipc__now_ns() + (uint64_t)timeout_ms * 1000000u;
  while (got + 1 < len) {
    uint64_t now = usmipc__now_ns();
    if (now >= deadline)
      return -1;
    struct pollfd p = {.fd = fd, .events = POLLIN};
    int r = poll(&p, 1, (int)((deadline - now) / 1000000u) + 1);
    if (r < 0 && errno == EINTR)
      continue;
    if (r <= 0)
      return -1;
    ssize_t n = read(fd, buf + got, 1);
    if (n <= 0)
      return -1;
    if (buf[got] == '\n')
      break;
    got++;
  }
  buf[got] = '\0';
  return 0;
}

/* Starts usmipc-helper with argv (argv[0] the helper) with the test off in
 * its environment (the driver's settings kept as they are), its stdin and
 * stdout our pipes *to and *from; 0, or an errno value. */
static int spawn_helper(char *const argv[], pid_t *pid, int *to, int *from) {
  int in[2] = {-1, -1}, out[2] = {-1, -1};
  if (pipe2(in, O_CLOEXEC) != 0 || pipe2(out, O_CLOEXEC) != 0) {
    int e = errno;
    for (int i = 0; i < 2; i++) {
      if (in[i] >= 0)
        close(in[i]);
      if (out[i] >= 0)
        close(out[i]);
    }
    return e;
  }
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, in[0], 0);
  posix_spawn_file_actions_adddup2(&fa, out[1], 1);
  extern char **environ;
  size_t n_env = 0;
  while (environ[n_env] != NULL)
    n_env++;
  char **env = calloc(n_env + 2, sizeof(*env));
  int spawned = ENOMEM;
  if (env != NULL) {
    size_t k = 0;
    for (size_t i = 0; i < n_env; i++)
      if (strncmp(environ[i], "USMIPC_ZE_SELFTEST=", 19) != 0)
        env[k++] = environ[i];
    env[k++] = (char *)"USMIPC_ZE_SELFTEST=0";
    env[k] = NULL;
    spawned = posix_spawn(pid, argv[0], &fa, NULL, argv, env);
    free(env);
  }
  posix_spawn_file_actions_destroy(&fa);
  close(in[0]);
  close(out[1]);
  if (spawned != 0) {
    close(in[1]);
    close(out[0]);
    return spawned;
  }
  *to = in[1];
  *from = out[0];
  return 0;
}

/* The test itself, with two helper processes, so that the library tests its
 * own path end to end without a backend calling the public API: the
 * exporter (usmipc-helper ze-selftest) allocates, fills and exports; the
 * importer (usmipc-helper ze-selftest-open) opens its handle on the same
 * device, copies the memory back and compares every byte, and says what it
 * saw. 0 when the bytes came through; -2 when sharing itself failed (the
 * open, or the bytes: a verdict on the driver); -1 when the test could not
 * run (no helper, a helper failed, a timeout), which is not remembered
 * beyond this process. reason says why. */
static int selftest_run(lz_device_t *d, char *reason, size_t len) {
  char helper[PATH_MAX];
  if (helper_path(helper, sizeof(helper)) != 0) {
    snprintf(reason, len,
             "the self-test's helper (usmipc-helper) is not installed beside "
             "the library; set USMIPC_HELPER to it, or USMIPC_ZE_SELFTEST=0 "
             "to share without the test");
    return -1;
  }
  char uuid[33];
  for (int i = 0; i < 16; i++)
    snprintf(uuid + 2 * i, 3, "%02x", d->uuid[i]);
  pid_t pid = -1, opener = -1;
  int to = -1, from = -1, opener_to = -1, opener_from = -1;
  char *argv[] = {helper, (char *)"ze-selftest", uuid, NULL};
  int spawned = spawn_helper(argv, &pid, &to, &from);
  int rc = -1;
  char line[2048], verdict[2048];
  if (spawned != 0) {
    snprintf(reason, len, "cannot start %.300s: %s", helper, strerror(spawned));
    goto out;
  }
  if (read_line(from, line, sizeof(line), 60000) != 0) {
    snprintf(reason, len, "the self-test's exporter (%.300s) did not answer",
             helper);
    goto out;
  }
  if (strncmp(line, "handle ", 7) != 0) {
    snprintf(reason, len, "the self-test's exporter failed: %.400s", line);
    goto out;
  }
  char *open_argv[] = {helper, (char *)"ze-selftest-open", uuid, line + 7,
                       NULL};
  if ((spawned = spawn_helper(open_argv, &opener, &opener_to, &opener_from)) !=
      0) {
    snprintf(reason, len, "cannot start %.300s: %s", helper, strerror(spawned));
    goto out;
  }
  if (read_line(opener_from, verdict, sizeof(verdict), 60000) != 0) {
    snprintf(reason, len, "the self-test's importer (%.300s) did not answer",
             helper);
    goto out;
  }
  if (strcmp(verdict, "ok") == 0) {
    rc = 0;
  } else {
    /* "broken REASON" (a verdict on the driver) or "error REASON". */
    bool broken = strncmp(verdict, "broken ", 7) == 0;
    const char *said = broken                               ? verdict + 7
                       : strncmp(verdict, "error ", 6) == 0 ? verdict + 6
                                                            : verdict;
    size_t n = strlen(said) < len - 1 ? strlen(said) : len - 1;
    memcpy(reason, said, n);
    reason[n] = '\0';
    rc = broken ? -2 : -1;
  }
out:
  if (opener_to >= 0)
    close(opener_to);
  if (opener_from >= 0)
    close(opener_from);
  if (opener > 0)
    waitpid(opener, NULL, 0);
  if (to >= 0) {
    if (write(to, "done\n", 5) != 5) { /* the helper exits anyway */
    }
    close(to);
  }
  if (from >= 0)
    close(from);
  if (pid > 0)
    waitpid(pid, NULL, 0);
  return rc;
}

/* 0 when Level Zero IPC may be used on d's driver, else USMIPC_ENOTSUP
 * with the reason. Cheap once decided. */
static int lz_ipc_check(void *dev) {
  lz_device_t *d = dev;
  lz_driver_t *drv = d->driver;
  int state = __atomic_load_n(&drv->selftest_state, __ATOMIC_ACQUIRE);
  if (state == 1)
    return 0;
  if (state < 0)
    return usmipc__fail(USMIPC_ENOTSUP,
                        "Level Zero IPC is unavailable on this driver: its "
                        "self-test failed: %s",
                        drv->selftest_reason);
  pthread_mutex_lock(&drv->selftest_lock);
  if (drv->selftest_state == 0) {
    const char *env = getenv("USMIPC_ZE_SELFTEST");
    bool wanted =
        env != NULL && *env != '\0' ? strcmp(env, "0") != 0 : !drv->test_driver;
    char path[PATH_MAX + 200], reason[sizeof(drv->selftest_reason)];
    int verdict = 1;
    if (wanted) {
      selftest_cache_path(d, path, sizeof(path));
      verdict = selftest_cached(path, reason, sizeof(reason));
      if (verdict == 0) {
        int ran = selftest_run(d, reason, sizeof(reason));
        verdict = ran == 0 ? 1 : -1;
        if (ran != -1) /* a verdict on the driver, not a failure to test */
          selftest_remember(path, verdict > 0, reason);
      }
    }
    /* The IPC aspect of the driver's devices says so from now on
     * (lz_ipc_failed). */
    if (verdict < 0)
      snprintf(drv->selftest_reason, sizeof(drv->selftest_reason), "%s",
               reason);
    __atomic_store_n(&drv->selftest_state, verdict, __ATOMIC_RELEASE);
  }
  pthread_mutex_unlock(&drv->selftest_lock);
  return lz_ipc_check(dev);
}

/* Whether d's driver failed its self-test: its devices' IPC aspect is off
 * from then on. Runs no test. */
static bool lz_ipc_failed(void *dev) {
  const lz_device_t *d = dev;
  return __atomic_load_n(&d->driver->selftest_state, __ATOMIC_ACQUIRE) < 0;
}

static int lz_ipc_unmap(void *dev, usmipc__allocation_t *m) {
  lz_device_t *d = dev;
  ze_result_t res = ze.zeMemCloseIpcHandle(d->driver->context, m->base);
  return res == ZE_RESULT_SUCCESS ? 0 : lz_fail(res, "zeMemCloseIpcHandle");
}

/* ---- events ---------------------------------------------------------------
 * (docs/level-zero.md, "Events".) An event is the only event of an event
 * pool of its own, made with ZE_EVENT_POOL_FLAG_IPC |
 * ZE_EVENT_POOL_FLAG_HOST_VISIBLE: an importer opens exactly the event it
 * was given (a pool shared by several events would give every importer of
 * one the others too, to wait on, signal or reset), and a pool's life is
 * its event's. Recording appends a barrier that signals the event (a plain
 * appended signal orders nothing before it on a list that is not in
 * order), after a reset: on the host when the previous record completed,
 * else on the list behind a wait for it, so that a record never completes
 * early. Counter-based events are not used: their IPC handle carries the
 * counter value of one record (one handle per record, where the core
 * exports an event once), they need in-order lists (a wrapped list may not
 * be), an IPC pool cannot be counter-based (CR@26.31.39395.13:level_zero/
 * core/source/event/event.cpp:47-49), and from 26.18 their handle carries
 * a communication allocation whose driver handles the importer's driver
 * fetches itself (pidfd, sockets): what usmipc avoids for memory.
 *
 * What the driver puts in ze_ipc_event_pool_handle_t changed with the
 * releases (the layouts below; the docs cite compute-runtime's lines). As
 * for memory, no driver bytes cross processes: the exporter sends the
 * pool's dma-buf (through the core's transport) and a payload of its own
 * (LZ_EVENT_POOL); the importer checks the dma-buf, and hands its driver
 * the handle that its own driver writes for a pool of its own (learnt once
 * per device) with the descriptor replaced and the exporter-naming fields
 * (pid, descriptor copy) cleared, which every release reads as a plain
 * import of a local descriptor. zeEventPoolOpenIpcHandle takes ownership
 * of that descriptor on every release (it closes it at once from 26.09,
 * at zeEventPoolCloseIpcHandle before), so it is given a duplicate. */

enum { LZ_EVENT_POOL = 1 }; /* the backend's event kind (docs) */

/* Layouts of ze_ipc_event_pool_handle_t, packed, host order. */
enum {
  LZ_EVL_33 = 1, /* IpcEventPoolData, 25.35-25.44: u64 fd, u64 numEvents,
                    u32 rootDeviceIndex, u32 maxEventPackets, u32
                    numDevices, 5 bools at 28-32 */
  LZ_EVL_27 = 2, /* IpcEventPoolData, 25.48+: ... u16 numDevices at 24,
                    flag bits at 26 (an opaque struct's type at 27 is 2,
                    maxHandle, when the context is not in opaque mode) */
  LZ_EVL_32 = 3, /* IpcOpaqueEventPoolData, 25.48-26.14: type 0 at 27, the
                    exporter's pid at 28-31 */
  LZ_EVL_40 = 4, /* 26.18-26.31: and opaqueHandle, a copy of the fd, at 32 */
  LZ_EVL_62 = 5, /* after 26.31 (unreleased): u64 fd, u64 opaqueHandle, u32
                    numEvents, u32 pid, u16 rootDeviceIndex, u8
                    maxEventPackets, u8 numDevices, flag bits at 28, type at
                    29, reservedHandleData 30-61 */
};
/* Flag bits, as 25.48+ packs them (isDeviceEventPoolAllocation first). */
enum {
  LZ_EVF_DEVICE = 1,
  LZ_EVF_HOST_VISIBLE = 2,
  LZ_EVF_IMPLICIT_SCALING = 4,
  LZ_EVF_KERNEL_MAPPED_TS = 8,
  LZ_EVF_TS = 16,
  LZ_EVF_KNOWN = 31,
};

/* The payload (LZ_EVENT_POOL, docs/handle-format.md), little-endian:
 *   0 u8 version (1)   1 u8 the exporter's layout (LZ_EVL_*)
 *   2 u8 flags (LZ_EVF_*)   3 u8 0   4 u32 the exporter's driverVersion
 *   8 u32 numEvents (1)   12 u32 maxEventPackets   16 u32 event index (0)
 *  20 u32 0   24 u64 the pool's size (bytes of its dma-buf) */
#define LZ_EVENT_PAYLOAD_LEN 32
#define LZ_EVENT_PAYLOAD_VERSION 1
#define LZ_EVENT_POOL_MAX ((uint64_t)1 << 30)

static int64_t get_i64(const uint8_t *p) {
  int64_t v;
  memcpy(&v, p, sizeof(v));
  return v;
}
static uint32_t get_u32(const uint8_t *p) {
  uint32_t v;
  memcpy(&v, p, sizeof(v));
  return v;
}

typedef struct lz_evh {
  uint8_t layout, flags;
  uint32_t max_packets, num_devices;
  uint64_t num_events;
  int fd;
} lz_evh_t;

static bool all_zero(const uint8_t *p, size_t n) {
  for (size_t i = 0; i < n; i++)
    if (p[i] != 0)
      return false;
  return true;
}

/* Reads an event pool handle that this process's driver wrote (for a pool
 * of one host-visible event): 0, or -1 with why filled for a layout usmipc
 * does not know. */
static int event_handle_parse(const uint8_t h[ZE_MAX_IPC_HANDLE_SIZE],
                              uint32_t self, lz_evh_t *out, char *why,
                              size_t why_len) {
  memset(out, 0, sizeof(*out));
  int32_t fd;
  memcpy(&fd, h, 4);
  out->fd = fd;
  if (fd < 0 || get_u32(h + 4) != 0) {
    snprintf(why, why_len,
             "its first 8 bytes (0x%016llx) are not a file "
             "descriptor",
             (unsigned long long)get_i64(h));
    return -1;
  }
  if (get_i64(h + 8) == 1) {
    out->num_events = 1;
    out->max_packets = get_u32(h + 20);
    if (h[26] == 0 && h[27] == 0 && h[29] == 1) {
      /* 25.35-25.44: five bools. */
      out->layout = LZ_EVL_33;
      out->num_devices = get_u32(h + 24);
      for (int i = 0; i < 5; i++) {
        if (h[28 + i] > 1) {
          snprintf(why, why_len,
                   "byte %d (a bool of the 33-byte layout) is "
                   "%u",
                   28 + i, h[28 + i]);
          return -1;
        }
        out->flags |= (uint8_t)(h[28 + i] << i);
      }
      if (!all_zero(h + 33, ZE_MAX_IPC_HANDLE_SIZE - 33)) {
        snprintf(why, why_len, "bytes past the 33-byte layout are set");
        return -1;
      }
      return 0;
    }
    uint16_t ndev;
    memcpy(&ndev, h + 24, 2);
    out->num_devices = ndev;
    out->flags = h[26];
    uint8_t type = h[27];
    uint32_t pid = get_u32(h + 28);
    int64_t copy = get_i64(h + 32);
    if (out->flags & ~LZ_EVF_KNOWN) {
      snprintf(why, why_len, "its flag byte (26) is 0x%02x", out->flags);
      return -1;
    }
    if (type == 2 && pid == 0 && copy == 0)
      out->layout = LZ_EVL_27;
    else if (type == 0 && pid == self && copy == 0)
      out->layout = LZ_EVL_32;
    else if (type == 0 && pid == self && copy == fd)
      out->layout = LZ_EVL_40;
    else {
      snprintf(why, why_len,
               "handle type %u, process %u (this one is %u) and descriptor "
               "copy %lld match no release's layout",
               type, pid, self, (long long)copy);
      return -1;
    }
    if (!all_zero(h + 40, ZE_MAX_IPC_HANDLE_SIZE - 40)) {
      snprintf(why, why_len, "bytes past the 40-byte layout are set");
      return -1;
    }
    return 0;
  }
  int64_t copy = get_i64(h + 8);
  if (get_u32(h + 16) == 1 && (copy == 0 || copy == fd)) {
    /* After 26.31: IpcOpaqueEventPoolData is the only layout. */
    uint32_t pid = get_u32(h + 20);
    uint8_t type = h[29];
    out->layout = LZ_EVL_62;
    out->num_events = 1;
    out->max_packets = h[26];
    out->num_devices = h[27];
    out->flags = h[28];
    if (!((type == 2 && pid == 0 && copy == 0) ||
          (type == 0 && pid == self && copy == fd)) ||
        (out->flags & ~LZ_EVF_KNOWN) || h[62] != 0 || h[63] != 0) {
      snprintf(why, why_len,
               "handle type %u, process %u, descriptor copy %lld and flags "
               "0x%02x do not fit the post-26.31 layout",
               type, pid, (long long)copy, out->flags);
      return -1;
    }
    return 0;
  }
  snprintf(why, why_len,
           "bytes 8-15 (0x%016llx) hold neither the pool's event count nor "
           "a copy of its descriptor",
           (unsigned long long)copy);
  return -1;
}

/* What usmipc requires of a pool of one event. */
static int event_handle_usable(const lz_evh_t *e, char *why, size_t why_len) {
  if (e->num_events != 1 || e->num_devices != 1)
    snprintf(why, why_len, "it describes %llu events on %u devices, not 1 on 1",
             (unsigned long long)e->num_events, e->num_devices);
  else if (!(e->flags & LZ_EVF_HOST_VISIBLE) ||
           (e->flags & (LZ_EVF_TS | LZ_EVF_KERNEL_MAPPED_TS)))
    snprintf(why, why_len,
             "its flags (0x%02x) are not those of a host-visible pool "
             "without timestamps",
             e->flags);
  else if (e->max_packets == 0 || e->max_packets > 0xffff)
    snprintf(why, why_len, "it says %u packets per event", e->max_packets);
  else
    return 0;
  return -1;
}

static int lz_event_create(void *dev, void **event) {
  lz_device_t *d = dev;
  lz_event_t *e = calloc(1, sizeof(*e));
  if (e == NULL)
    return usmipc__fail(USMIPC_ENOMEM, "out of memory");
  e->dev = d;
  e->fd = -1;
  ze_event_pool_desc_t pdesc = {
      .stype = ZE_STRUCTURE_TYPE_EVENT_POOL_DESC,
      .flags = ZE_EVENT_POOL_FLAG_HOST_VISIBLE |
               (d->driver->ipc_events ? ZE_EVENT_POOL_FLAG_IPC : 0),
      .count = 1};
  ze_result_t res =
      ze.zeEventPoolCreate(d->driver->context, &pdesc, 1, &d->handle, &e->pool);
  if (res != ZE_RESULT_SUCCESS) {
    free(e);
    return lz_fail(res, "zeEventPoolCreate");
  }
  ze_event_desc_t edesc = {.stype = ZE_STRUCTURE_TYPE_EVENT_DESC,
                           .index = 0,
                           .signal = ZE_EVENT_SCOPE_FLAG_HOST,
                           .wait = ZE_EVENT_SCOPE_FLAG_HOST};
  const char *what = "zeEventCreate";
  res = ze.zeEventCreate(e->pool, &edesc, &e->event);
  /* Born complete, as a CUDA event is: a handle made before the first
   * record (point 0) has nothing to wait for, in any process. */
  if (res == ZE_RESULT_SUCCESS) {
    what = "zeEventHostSignal";
    res = ze.zeEventHostSignal(e->event);
    if (res != ZE_RESULT_SUCCESS)
      ze.zeEventDestroy(e->event);
  }
  if (res != ZE_RESULT_SUCCESS) {
    ze.zeEventPoolDestroy(e->pool);
    free(e);
    return lz_fail(res, what);
  }
  *event = e;
  return 0;
}

static int lz_event_destroy(void *dev, void *event) {
  (void)dev;
  lz_event_t *e = event;
  ze_result_t res = ze.zeEventDestroy(e->event);
  ze_result_t res2 = ze.zeEventPoolDestroy(e->pool);
  if (e->fd >= 0)
    close(e->fd);
  free(e);
  if (res != ZE_RESULT_SUCCESS)
    return lz_fail(res, "zeEventDestroy");
  return res2 == ZE_RESULT_SUCCESS ? 0 : lz_fail(res2, "zeEventPoolDestroy");
}

/* Marks what queue has been given so far. The core re-records an event of
 * its ring only once its previous record completed; a user's event may be
 * re-recorded at any time, and then the new record also waits for the old
 * one, so that the old one's signal, landing after a reset, can never make
 * the new one look complete. */
static int lz_event_record(void *dev, void *event, void *queue) {
  (void)dev;
  lz_event_t *e = event;
  lz_queue_t *q = queue;
  ze_result_t res = ZE_RESULT_SUCCESS;
  const char *what = "zeEventQueryStatus";
  pthread_mutex_lock(&q->lock);
  res = ze.zeEventQueryStatus(e->event);
  if (res == ZE_RESULT_SUCCESS) {
    what = "zeEventHostReset";
    res = ze.zeEventHostReset(e->event);
  } else if (res == ZE_RESULT_NOT_READY) {
    what = "zeCommandListAppendWaitOnEvents";
    res = ze.zeCommandListAppendWaitOnEvents(q->list, 1, &e->event);
    if (res == ZE_RESULT_SUCCESS) {
      what = "zeCommandListAppendEventReset";
      res = ze.zeCommandListAppendEventReset(q->list, e->event);
    }
  }
  if (res == ZE_RESULT_SUCCESS) {
    what = "zeCommandListAppendBarrier";
    res = ze.zeCommandListAppendBarrier(q->list, e->event, 0, NULL);
  }
  pthread_mutex_unlock(&q->lock);
  return res == ZE_RESULT_SUCCESS ? 0 : lz_fail(res, what);
}

static int lz_event_query(void *dev, void *event) {
  (void)dev;
  ze_result_t res = ze.zeEventQueryStatus(((lz_event_t *)event)->event);
  if (res == ZE_RESULT_SUCCESS)
    return 1;
  return res == ZE_RESULT_NOT_READY ? 0 : lz_fail(res, "zeEventQueryStatus");
}

/* Later work on queue waits on the device. On usmipc's own queues
 * (synchronous lists) the append itself returns once the event completed. */
static int lz_event_wait(void *dev, void *event, void *queue) {
  (void)dev;
  lz_event_t *e = event;
  lz_queue_t *q = queue;
  pthread_mutex_lock(&q->lock);
  ze_result_t res = ze.zeCommandListAppendWaitOnEvents(q->list, 1, &e->event);
  pthread_mutex_unlock(&q->lock);
  return res == ZE_RESULT_SUCCESS
             ? 0
             : lz_fail(res, "zeCommandListAppendWaitOnEvents");
}

/* The size of a descriptor a Level Zero driver gave or an exporter sent:
 * a dma-buf (or the test driver's stand-in), else code with a message. */
static int descriptor_size(const lz_driver_t *drv, int fd, uint64_t *size,
                           int code, const char *what) {
  if (test_driver_buffer(drv, fd, size))
    return 0;
  int e = usmipc__dmabuf_size(fd, size);
  if (e == -EBADFD)
    return usmipc__fail(code, "%s: descriptor %d is not a dma-buf; refused",
                        what, fd);
  if (e != 0)
    return usmipc__fail_native(code, -e, "%s: cannot inspect descriptor %d: %s",
                               what, fd, strerror(-e));
  return 0;
}

static int lz_event_export(void *dev, void *event, usmipc__payload_t *payload,
                           int *fd_to_share) {
  lz_device_t *d = dev;
  lz_driver_t *drv = d->driver;
  lz_event_t *e = event;
  *fd_to_share = -1;
  if (!drv->ipc_events)
    return usmipc__fail(USMIPC_ENOTSUP,
                        "this Level Zero driver does not share event pools "
                        "between processes (no ZE_IPC_PROPERTY_FLAG_EVENT_POOL)"
                        ", so its events cannot be shared");
  if (e->imported)
    return usmipc__fail(USMIPC_EINVAL, "an opened event cannot be exported");
  ze_ipc_event_pool_handle_t h;
  memset(&h, 0, sizeof(h));
  ze_result_t res = ze.zeEventPoolGetIpcHandle(e->pool, &h);
  if (res != ZE_RESULT_SUCCESS)
    return lz_fail(res, "zeEventPoolGetIpcHandle");
  lz_evh_t evh;
  char why[200];
  if (event_handle_parse((const uint8_t *)h.data, (uint32_t)getpid(), &evh, why,
                         sizeof(why)) != 0 ||
      event_handle_usable(&evh, why, sizeof(why)) != 0)
    return usmipc__fail(USMIPC_ENOTSUP,
                        "this Level Zero driver (version 0x%x) writes an event "
                        "pool IPC handle that usmipc cannot read (%s); its "
                        "events cannot be shared",
                        (unsigned)drv->version, why);
  uint64_t size = 0;
  int rc = descriptor_size(drv, evh.fd, &size, USMIPC_ENOTSUP,
                           "the descriptor in the driver's event pool handle");
  if (rc != 0)
    return rc;
  if (size == 0 || size > LZ_EVENT_POOL_MAX)
    return usmipc__fail(USMIPC_ENOTSUP,
                        "the driver's event pool buffer is %llu bytes; usmipc "
                        "shares pools of 1 byte to 1 GiB",
                        (unsigned long long)size);
  /* Our own duplicate is what importers get: before 26.31 the driver
   * never closes its descriptor, from 26.31 at zeEventPoolDestroy. (A
   * second export, after the core failed to publish the first, replaces
   * it.) */
  if (e->fd >= 0)
    close(e->fd);
  if ((e->fd = fcntl(evh.fd, F_DUPFD_CLOEXEC, 3)) < 0)
    return usmipc__fail_native(usmipc__errno_code(errno), errno,
                               "cannot duplicate the event pool's descriptor: "
                               "%s",
                               strerror(errno));
  uint8_t *p = payload->bytes;
  memset(p, 0, LZ_EVENT_PAYLOAD_LEN);
  p[0] = LZ_EVENT_PAYLOAD_VERSION;
  p[1] = evh.layout;
  p[2] = evh.flags;
  usmipc__put32le(p + 4, drv->version);
  usmipc__put32le(p + 8, (uint32_t)evh.num_events);
  usmipc__put32le(p + 12, evh.max_packets);
  usmipc__put32le(p + 16, 0);
  usmipc__put64le(p + 24, size);
  payload->handle_kind = LZ_EVENT_POOL;
  payload->len = LZ_EVENT_PAYLOAD_LEN;
  payload->ext_len = 0;
  *fd_to_share = e->fd;
  return 0;
}

/* This process's own driver's handle for a pool of one host-visible event
 * on d, learnt once (the pool is destroyed again). */
static int event_template(lz_device_t *d, const lz_event_template_t **out) {
  lz_event_template_t *t = &d->event_template;
  int rc = 0;
  pthread_mutex_lock(&d->template_lock);
  if (t->state == 0) {
    ze_event_pool_desc_t pdesc = {.stype = ZE_STRUCTURE_TYPE_EVENT_POOL_DESC,
                                  .flags = ZE_EVENT_POOL_FLAG_HOST_VISIBLE |
                                           ZE_EVENT_POOL_FLAG_IPC,
                                  .count = 1};
    ze_event_pool_handle_t pool = NULL;
    ze_ipc_event_pool_handle_t h;
    memset(&h, 0, sizeof(h));
    ze_result_t res =
        ze.zeEventPoolCreate(d->driver->context, &pdesc, 1, &d->handle, &pool);
    const char *what = "zeEventPoolCreate";
    if (res == ZE_RESULT_SUCCESS) {
      what = "zeEventPoolGetIpcHandle";
      res = ze.zeEventPoolGetIpcHandle(pool, &h);
      ze.zeEventPoolDestroy(pool);
    }
    lz_evh_t evh;
    char why[200];
    if (res != ZE_RESULT_SUCCESS) {
      rc = lz_fail(res, what); /* not kept: may pass */
    } else if (event_handle_parse((const uint8_t *)h.data, (uint32_t)getpid(),
                                  &evh, why, sizeof(why)) != 0 ||
               event_handle_usable(&evh, why, sizeof(why)) != 0) {
      t->state = USMIPC_ENOTSUP;
      snprintf(t->reason, sizeof(t->reason),
               "this process's Level Zero driver (version 0x%x) writes event "
               "pool IPC handles that usmipc cannot read (%s), so it cannot "
               "open another process's events",
               (unsigned)d->driver->version, why);
    } else {
      memcpy(t->bytes, h.data, sizeof(t->bytes));
      t->layout = evh.layout;
      t->flags = evh.flags;
      t->max_packets = evh.max_packets;
      t->state = 1;
    }
  }
  if (t->state < 0)
    rc = usmipc__fail(t->state, "%s", t->reason);
  pthread_mutex_unlock(&d->template_lock);
  *out = t;
  return rc;
}

/* Checks an exporter's payload (untrusted bytes); 0 or USMIPC_EBADHANDLE. */
static int event_payload_check(const usmipc__payload_t *payload,
                               uint64_t *pool_size) {
  const uint8_t *p = payload->bytes;
  if (payload->handle_kind != LZ_EVENT_POOL ||
      payload->len != LZ_EVENT_PAYLOAD_LEN)
    return usmipc__fail(USMIPC_EBADHANDLE,
                        "not a valid usmipc event handle: a Level Zero event "
                        "is of kind %u with a %u-byte payload, this one of "
                        "kind %u with %u bytes (forged or corrupted)",
                        LZ_EVENT_POOL, LZ_EVENT_PAYLOAD_LEN,
                        payload->handle_kind, payload->len);
  if (p[0] != LZ_EVENT_PAYLOAD_VERSION)
    return usmipc__fail(USMIPC_EBADHANDLE,
                        "not a valid usmipc event handle: Level Zero event "
                        "payload version %u (this usmipc reads %u)",
                        p[0], LZ_EVENT_PAYLOAD_VERSION);
  *pool_size = usmipc__get64le(p + 24);
  uint32_t packets = usmipc__get32le(p + 12);
  if (p[1] < LZ_EVL_33 || p[1] > LZ_EVL_62 || (p[2] & ~LZ_EVF_KNOWN) ||
      !(p[2] & LZ_EVF_HOST_VISIBLE) ||
      (p[2] & (LZ_EVF_TS | LZ_EVF_KERNEL_MAPPED_TS)) || p[3] != 0 ||
      usmipc__get32le(p + 8) != 1 || usmipc__get32le(p + 16) != 0 ||
      usmipc__get32le(p + 20) != 0 || packets == 0 || packets > 0xffff ||
      *pool_size == 0 || *pool_size > LZ_EVENT_POOL_MAX)
    return usmipc__fail(USMIPC_EBADHANDLE,
                        "not a valid usmipc event handle: its Level Zero "
                        "event payload is inconsistent (layout %u, flags "
                        "0x%02x, %u events, index %u, %u packets, a %llu-byte "
                        "pool): forged or corrupted",
                        p[1], p[2], usmipc__get32le(p + 8),
                        usmipc__get32le(p + 16), packets,
                        (unsigned long long)*pool_size);
  return 0;
}

static int lz_event_import(void *dev, void *owner_dev,
                           const usmipc__payload_t *payload, int fd,
                           void **event) {
  lz_device_t *d = dev, *owner = owner_dev;
  uint64_t pool_size = 0, size = 0;
  int rc = event_payload_check(payload, &pool_size);
  if (rc != 0)
    return rc;
  if (fd < 0)
    return usmipc__fail(USMIPC_EBADHANDLE,
                        "not a valid usmipc event handle: a Level Zero event "
                        "handle must share its pool's descriptor");
  if (d->driver != owner->driver)
    return usmipc__fail(USMIPC_ENOTSUP,
                        "the event belongs to another Level Zero driver than "
                        "the target device's; open it on the recording "
                        "device");
  if ((rc = descriptor_size(d->driver, fd, &size, USMIPC_EBADHANDLE,
                            "the event pool descriptor the exporter sent")) !=
      0)
    return rc;
  if (size != pool_size)
    return usmipc__fail(USMIPC_EBADHANDLE,
                        "the event pool descriptor the exporter sent holds "
                        "%llu bytes, but its handle says %llu: forged or the "
                        "wrong descriptor",
                        (unsigned long long)size,
                        (unsigned long long)pool_size);
  const lz_event_template_t *t;
  if ((rc = event_template(d, &t)) != 0)
    return rc;
  const uint8_t *p = payload->bytes;
  uint32_t packets = usmipc__get32le(p + 12);
  if (packets != t->max_packets || p[2] != t->flags)
    return usmipc__fail(USMIPC_ENOTSUP,
                        "the exporter's Level Zero driver (version 0x%x) lays "
                        "its event pools out with %u packets per event and "
                        "flags 0x%02x, this process's driver (version 0x%x) "
                        "with %u and 0x%02x: events cannot be shared between "
                        "them",
                        (unsigned)usmipc__get32le(p + 4), packets, p[2],
                        (unsigned)d->driver->version, t->max_packets, t->flags);
  /* The driver takes the descriptor it is given (see above): a duplicate,
   * never 0 (a 0 would equal the cleared descriptor copy of 26.18+). */
  int mine = fcntl(fd, F_DUPFD_CLOEXEC, 3);
  if (mine < 0)
    return usmipc__fail_native(usmipc__errno_code(errno), errno,
                               "cannot duplicate the received descriptor: %s",
                               strerror(errno));
  ze_ipc_event_pool_handle_t h;
  memcpy(h.data, t->bytes, sizeof(h.data));
  uint8_t *b = (uint8_t *)h.data;
  uint64_t wide = (uint64_t)mine;
  memcpy(b, &wide, 8);
  switch (t->layout) {
  case LZ_EVL_40:
    memset(b + 32, 0, 8); /* no descriptor copy: not the opaque path */
    /* fall through */
  case LZ_EVL_32:
    memset(b + 28, 0, 4); /* no process to fetch from */
    break;
  case LZ_EVL_62:
    memset(b + 8, 0, 8);
    memset(b + 20, 0, 4);
    memset(b + 30, 0, 32);
    break;
  default:
    break;
  }
  lz_event_t *e = calloc(1, sizeof(*e));
  if (e == NULL) {
    close(mine);
    return usmipc__fail(USMIPC_ENOMEM, "out of memory");
  }
  e->dev = d;
  e->fd = -1;
  e->imported = true;
  /* From here on the descriptor is the driver's, even when it fails
   * (releases before 26.09 may then leave it open). */
  ze_result_t res =
      ze.zeEventPoolOpenIpcHandle(d->driver->context, h, &e->pool);
  if (res != ZE_RESULT_SUCCESS) {
    free(e);
    return usmipc__fail_native(
        res == ZE_RESULT_ERROR_INVALID_ARGUMENT ? USMIPC_EBADHANDLE
                                                : USMIPC_EBACKEND,
        res,
        "zeEventPoolOpenIpcHandle refused the exporter's event pool (%s, "
        "0x%x): the descriptor received is not an event pool this driver "
        "can import",
        result_name(res), (unsigned)res);
  }
  ze_event_desc_t edesc = {.stype = ZE_STRUCTURE_TYPE_EVENT_DESC,
                           .index = 0,
                           .signal = ZE_EVENT_SCOPE_FLAG_HOST,
                           .wait = ZE_EVENT_SCOPE_FLAG_HOST};
  res = ze.zeEventCreate(e->pool, &edesc, &e->event);
  if (res != ZE_RESULT_SUCCESS) {
    ze.zeEventPoolCloseIpcHandle(e->pool);
    free(e);
    return lz_fail(res, "zeEventCreate (in an opened event pool)");
  }
  *event = e;
  return 0;
}

static int lz_event_close(void *dev, void *event) {
  (void)dev;
  lz_event_t *e = event;
  ze_result_t res = ze.zeEventDestroy(e->event);
  ze_result_t res2 = ze.zeEventPoolCloseIpcHandle(e->pool);
  free(e);
  if (res != ZE_RESULT_SUCCESS)
    return lz_fail(res, "zeEventDestroy");
  return res2 == ZE_RESULT_SUCCESS ? 0
                                   : lz_fail(res2, "zeEventPoolCloseIpcHandle");
}

/* What SYCL's Level Zero adapter prints: driverVersion as
 * major.minor.build (Intel's drivers pack it as bits 31-24, 23-16, 15-0);
 * the device's memory is the sum of its memories (one per HBM stack or
 * tile); the largest allocation is the device's maxMemAllocSize (read at
 * probe). */
#define LZ_MAX_MEMORIES 8
static int lz_device_info(void *dev, usmipc_device_info_t *info) {
  lz_device_t *d = dev;
  uint32_t v = d->driver->version;
  snprintf(info->driver_version, sizeof(info->driver_version), "%u.%u.%u",
           (unsigned)(v >> 24), (unsigned)((v >> 16) & 0xffu),
           (unsigned)(v & 0xffffu));
  ze_device_memory_properties_t mem[LZ_MAX_MEMORIES];
  memset(mem, 0, sizeof(mem));
  for (int i = 0; i < LZ_MAX_MEMORIES; i++)
    mem[i].stype = ZE_STRUCTURE_TYPE_DEVICE_MEMORY_PROPERTIES;
  uint32_t count = LZ_MAX_MEMORIES;
  ze_result_t res = ze.zeDeviceGetMemoryProperties(d->handle, &count, mem);
  if (res != ZE_RESULT_SUCCESS)
    return lz_fail(res, "zeDeviceGetMemoryProperties");
  for (uint32_t i = 0; i < count && i < LZ_MAX_MEMORIES; i++)
    info->global_mem_size += mem[i].totalSize;
  info->max_mem_alloc_size = d->max_alloc;
  return 0;
}

const usmipc__backend_ops_t usmipc__level_zero_backend = {
    .struct_size = sizeof(usmipc__backend_ops_t),
    .backend = USMIPC_BACKEND_LEVEL_ZERO,
    .name = "level_zero",
    .probe = lz_probe,
    .mem_alloc = lz_mem_alloc,
    .mem_free = lz_mem_free,
    .pointer_query = lz_pointer_query,
    .queue_create = lz_queue_create,
    .queue_destroy = lz_queue_destroy,
    .queue_synchronize = lz_queue_synchronize,
    .queue_idle = lz_queue_idle,
    .memcpy = lz_memcpy,
    .memset = lz_memset,
    .ipc_export = lz_ipc_export,
    .ipc_import = lz_ipc_import,
    .ipc_unmap = lz_ipc_unmap,
    .ipc_import_sycl = lz_ipc_import_sycl,
    .ipc_check = lz_ipc_check,
    .ipc_failed = lz_ipc_failed,
    .event_create = lz_event_create,
    .event_destroy = lz_event_destroy,
    .event_record = lz_event_record,
    .event_query = lz_event_query,
    .event_wait = lz_event_wait,
    .event_export = lz_event_export,
    .event_import = lz_event_import,
    .event_close = lz_event_close,
    .queue_wrap = lz_queue_wrap,
    .queue_unwrap = lz_queue_unwrap,
    .queue_native = lz_queue_native,
    .device_info = lz_device_info,
};
