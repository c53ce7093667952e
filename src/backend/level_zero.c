/* The Level Zero backend, over the oneAPI loader loaded with
 * dlopen("libze_loader.so.1") at first use: no link-time dependency, no
 * Level Zero headers needed to build. The few types used are declared here
 * with the layouts of ze_api.h (API 1.4, which the loader 1.8 of Debian 12
 * implements); a missing loader or driver makes probe() report the backend
 * unavailable with the reason.
 *
 * Devices are the GPU root devices of every driver (level_zero:gpu:N), with
 * one context per driver. Copies and fills go through a synchronous
 * immediate command list per queue. Device memory is shared with
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
 */
#include <dlfcn.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "../common.h"

/* ---- driver types (ze_api.h, Level Zero API 1.4) ----------------------------
 */

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

#define ZE_MAX_IPC_HANDLE_SIZE 64
#define ZE_MAX_DEVICE_UUID_SIZE 16
#define ZE_MAX_DEVICE_NAME 256

typedef struct {
  char data[ZE_MAX_IPC_HANDLE_SIZE];
} ze_ipc_mem_handle_t;

typedef struct {
  ze_structure_type_t stype;
  void *pNext;
  uint32_t flags; /* ze_ipc_property_flags_t */
} ze_driver_ipc_properties_t;

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

enum {
  ZE_RESULT_SUCCESS = 0,
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
  ZE_STRUCTURE_TYPE_CONTEXT_DESC = 0xd,
  ZE_STRUCTURE_TYPE_COMMAND_QUEUE_DESC = 0xe,
  ZE_STRUCTURE_TYPE_DEVICE_MEM_ALLOC_DESC = 0x15,
  ZE_STRUCTURE_TYPE_HOST_MEM_ALLOC_DESC = 0x16,
  ZE_STRUCTURE_TYPE_MEMORY_ALLOCATION_PROPERTIES = 0x17,

  ZE_INIT_FLAG_GPU_ONLY = 1,
  ZE_DEVICE_TYPE_GPU = 1,
  ZE_IPC_PROPERTY_FLAG_MEMORY = 1,
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
  X(zeDeviceGet, (ze_driver_handle_t, uint32_t *, ze_device_handle_t *))       \
  X(zeDeviceGetProperties, (ze_device_handle_t, ze_device_properties_t *))     \
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
     ze_event_handle_t, uint32_t, ze_event_handle_t *))

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

/* ---- backend state
 * ------------------------------------------------------------ */

/* How an allocation or mapping was made (usmipc__allocation_t.how). */
enum {
  HOW_DEVICE = 1,  /* zeMemAllocDevice */
  HOW_HOST = 2,    /* zeMemAllocHost */
  HOW_SHARED = 3,  /* zeMemAllocShared */
  HOW_IPC = 4,     /* zeMemOpenIpcHandle */
  HOW_FOREIGN = 5, /* another library's allocation, seen by pointer_query */
};

/* Handle kinds in the wire payload (docs/handle-format.md). */
enum {
  LZ_HANDLE_FD_IN_DATA = 1, /* 64 bytes: ze_ipc_mem_handle_t, fd slot zeroed */
  LZ_HANDLE_FD_AND_PID = 2, /* the same, pid slot zeroed too */
};

/* Where the descriptor sits in ze_ipc_mem_handle_t.data: a native int at
 * offset 0 (Intel's IpcMemoryData.handle and IpcOpaqueMemoryData.handle.fd
 * both start there). */
#define LZ_FD_SLOT_OFFSET 0
#define LZ_FD_SLOT_SIZE sizeof(int)
/* Intel's pidfd layout (IpcOpaqueMemoryData, the default on GPUs where the
 * driver moves descriptors itself) also names the exporter's pid, a u32 at
 * offset 16, and the importer's driver takes the descriptor from that
 * process with pidfd_getfd. In the default layout the byte at 16 is the
 * memory type (0 for device memory), so the slot never holds a pid. */
#define LZ_PID_SLOT_OFFSET 16
#define LZ_PID_SLOT_SIZE sizeof(uint32_t)

typedef struct lz_driver {
  ze_driver_handle_t handle;
  ze_context_handle_t context;
  int ipc_memory;                              /* ZE_IPC_PROPERTY_FLAG_MEMORY */
  ze_put_ipc_handle_fn put_ipc_handle;         /* or NULL */
  ze_fd_from_ipc_handle_fn fd_from_ipc_handle; /* or NULL */
} lz_driver_t;

typedef struct lz_device {
  lz_driver_t *driver;
  ze_device_handle_t handle;
  int ordinal;         /* probe order, the core's ordinal */
  uint32_t copy_group; /* command queue group ordinal that can copy */
  uint64_t max_alloc;  /* maxMemAllocSize */
} lz_device_t;

/* What an exported allocation keeps (usmipc__allocation_t.native points
 * here): the driver's handle, released with zeMemPutIpcHandle at free. */
typedef struct lz_export {
  ze_ipc_mem_handle_t handle;
  uint8_t kind; /* LZ_HANDLE_*, decided when the handle was taken */
} lz_export_t;

typedef struct lz_queue {
  ze_command_list_handle_t list;
  pthread_mutex_t lock; /* a command list is not safe for concurrent use */
} lz_queue_t;

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

/* ---- probe
 * -------------------------------------------------------------------- */

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
    if (ze.zeDriverGetIpcProperties(drv->handle, &ipc) == ZE_RESULT_SUCCESS)
      drv->ipc_memory = (ipc.flags & ZE_IPC_PROPERTY_FLAG_MEMORY) != 0;
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
      desc->type = USMIPC_DEVICE_GPU;
      size_t name_len = strnlen(props.name, sizeof(desc->name) - 1);
      memcpy(desc->name, props.name, name_len);
      desc->name[name_len] = '\0';
      memcpy(desc->uuid, props.uuid, 16);
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

/* ---- memory
 * ------------------------------------------------------------------- */

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
    what = "zeMemAllocDevice";
    res = ze.zeMemAllocDevice(ctx, &ddesc, nbytes, 0, d->handle, &p);
    out->how = HOW_DEVICE;
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
  out->native = 0;
  return 0;
}

/* Releases the IPC handle of an exported allocation. Its descriptor (which
 * alloc->fd only borrowed) is the driver's to close. */
static void release_export(lz_device_t *d, usmipc__allocation_t *a) {
  lz_export_t *x = (lz_export_t *)(uintptr_t)a->native;
  if (x == NULL)
    return;
  /* Without zeMemPutIpcHandle (drivers before API 1.6) the handle lives
   * until zeMemFree, which follows. */
  if (d->driver->put_ipc_handle != NULL)
    d->driver->put_ipc_handle(d->driver->context, x->handle);
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

/* ---- queues
 * ------------------------------------------------------------------- */

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

static int lz_queue_destroy(void *dev, void *queue) {
  (void)dev;
  lz_queue_t *q = queue;
  ze_result_t res = ze.zeCommandListDestroy(q->list);
  pthread_mutex_destroy(&q->lock);
  free(q);
  return res == ZE_RESULT_SUCCESS ? 0 : lz_fail(res, "zeCommandListDestroy");
}

static int lz_queue_synchronize(void *dev, void *queue) {
  (void)dev;
  (void)queue;
  return 0;
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

/* ---- IPC
 * ---------------------------------------------------------------------- */

static int handle_fd(const ze_ipc_mem_handle_t *h) {
  int fd;
  memcpy(&fd, h->data + LZ_FD_SLOT_OFFSET, LZ_FD_SLOT_SIZE);
  return fd;
}

/* Takes the descriptor out of a fresh handle, or refuses a driver whose
 * handles do not carry one where usmipc expects it. */
static int extract_fd(lz_driver_t *drv, const ze_ipc_mem_handle_t *h, int *fd) {
  *fd = handle_fd(h);
  if (drv->fd_from_ipc_handle != NULL) {
    uint64_t reported = 0;
    ze_result_t res = drv->fd_from_ipc_handle(drv->context, *h, &reported);
    if (res != ZE_RESULT_SUCCESS)
      return lz_fail(res, "zeMemGetFileDescriptorFromIpcHandleExp");
    if (reported != (uint64_t)(int64_t)*fd)
      return usmipc__fail(USMIPC_ENOTSUP,
                          "this Level Zero driver's IPC handle keeps its file "
                          "descriptor (%llu) elsewhere than the first 4 bytes "
                          "(%d); usmipc cannot rebuild such handles in "
                          "another process",
                          (unsigned long long)reported, *fd);
  }
  if (*fd < 0 || fcntl(*fd, F_GETFD) < 0)
    return usmipc__fail(USMIPC_ENOTSUP,
                        "this Level Zero driver's IPC handle does not start "
                        "with a file descriptor of this process (found %d); "
                        "usmipc cannot rebuild such handles in another "
                        "process",
                        *fd);
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
  if (a->how != HOW_DEVICE)
    return usmipc__fail(USMIPC_EMEMKIND,
                        "only device memory can be exported, not host or "
                        "shared memory");
  lz_export_t *x = (lz_export_t *)(uintptr_t)a->native;
  if (x == NULL) {
    x = calloc(1, sizeof(*x));
    if (x == NULL)
      return usmipc__fail(USMIPC_ENOMEM, "out of memory");
    ze_result_t res = ze.zeMemGetIpcHandle(drv->context, a->base, &x->handle);
    if (res != ZE_RESULT_SUCCESS) {
      free(x);
      return lz_fail(res, "zeMemGetIpcHandle");
    }
    int fd;
    int rc = extract_fd(drv, &x->handle, &fd);
    if (rc != 0) {
      if (drv->put_ipc_handle != NULL)
        drv->put_ipc_handle(drv->context, x->handle);
      free(x);
      return rc;
    }
    uint32_t pid_slot;
    memcpy(&pid_slot, x->handle.data + LZ_PID_SLOT_OFFSET, LZ_PID_SLOT_SIZE);
    x->kind = pid_slot == (uint32_t)getpid() ? LZ_HANDLE_FD_AND_PID
                                             : LZ_HANDLE_FD_IN_DATA;
    a->native = (uint64_t)(uintptr_t)x;
    a->fd = fd; /* borrowed from the handle; see release_export */
  }
  payload->handle_kind = x->kind;
  payload->len = ZE_MAX_IPC_HANDLE_SIZE;
  memcpy(payload->bytes, x->handle.data, ZE_MAX_IPC_HANDLE_SIZE);
  /* The exporter's descriptor number and pid mean nothing elsewhere. */
  memset(payload->bytes + LZ_FD_SLOT_OFFSET, 0, LZ_FD_SLOT_SIZE);
  if (x->kind == LZ_HANDLE_FD_AND_PID)
    memset(payload->bytes + LZ_PID_SLOT_OFFSET, 0, LZ_PID_SLOT_SIZE);
  *fd_to_share = a->fd;
  return 0;
}

static int lz_ipc_import(void *dev, void *owner_dev,
                         const usmipc__payload_t *payload, int fd,
                         uint64_t allocation_size, usmipc__allocation_t *out) {
  lz_device_t *d = dev, *owner = owner_dev;
  static const uint8_t zero_slot[4];
  int with_pid = payload->handle_kind == LZ_HANDLE_FD_AND_PID;
  if ((payload->handle_kind != LZ_HANDLE_FD_IN_DATA && !with_pid) ||
      payload->len != ZE_MAX_IPC_HANDLE_SIZE)
    return usmipc__fail(USMIPC_EBADHANDLE,
                        "Level Zero handle of unknown kind %u (payload %u "
                        "bytes)",
                        payload->handle_kind, payload->len);
  if (memcmp(payload->bytes + LZ_FD_SLOT_OFFSET, zero_slot, LZ_FD_SLOT_SIZE) !=
          0 ||
      (with_pid && memcmp(payload->bytes + LZ_PID_SLOT_OFFSET, zero_slot,
                          LZ_PID_SLOT_SIZE) != 0))
    return usmipc__fail(USMIPC_EBADHANDLE,
                        "Level Zero handle payload has a non-zero descriptor "
                        "or pid slot");
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
  /* Rebuild the exporter's handle around this process's descriptor. The
   * driver imports the memory (a dma-buf import on Intel) and does not keep
   * fd, which the caller closes. In the pidfd layout the handle names this
   * process, so the driver's pidfd_getfd copies fd from ourselves, which
   * needs no ptrace rights. */
  ze_ipc_mem_handle_t h;
  memcpy(h.data, payload->bytes, ZE_MAX_IPC_HANDLE_SIZE);
  memcpy(h.data + LZ_FD_SLOT_OFFSET, &fd, LZ_FD_SLOT_SIZE);
  if (with_pid) {
    uint32_t self = (uint32_t)getpid();
    memcpy(h.data + LZ_PID_SLOT_OFFSET, &self, LZ_PID_SLOT_SIZE);
  }
  ze_context_handle_t ctx = d->driver->context;
  void *p = NULL;
  ze_result_t res = ze.zeMemOpenIpcHandle(ctx, d->handle, h, 0, &p);
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

static int lz_ipc_unmap(void *dev, usmipc__allocation_t *m) {
  lz_device_t *d = dev;
  ze_result_t res = ze.zeMemCloseIpcHandle(d->driver->context, m->base);
  return res == ZE_RESULT_SUCCESS ? 0 : lz_fail(res, "zeMemCloseIpcHandle");
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
    .memcpy = lz_memcpy,
    .memset = lz_memset,
    .ipc_export = lz_ipc_export,
    .ipc_import = lz_ipc_import,
    .ipc_unmap = lz_ipc_unmap,
};
