/* What the Level Zero test driver (ze_test_driver.c) tells its tests.
 *
 * The driver counts the IPC calls it serves so that a test can assert real
 * outcomes ("zeMemPutIpcHandle was called once per exported allocation, and
 * no allocation was freed with its IPC handle still live") instead of
 * trusting the backend. A test reaches the counters of the driver instance
 * that the loader loaded with dlopen(path, RTLD_NOLOAD) + dlsym.
 */
#ifndef USMIPC_ZE_TEST_DRIVER_H
#define USMIPC_ZE_TEST_DRIVER_H

#include <stdint.h>

#define USMIPC_ZE_TEST_DEVICE_NAME "usmipc Level Zero test device"
/* "usmipc-ze-test-0" as 16 bytes: fixed, so that handles name the device. */
#define USMIPC_ZE_TEST_DEVICE_UUID                                             \
  {0x75, 0x73, 0x6d, 0x69, 0x70, 0x63, 0x2d, 0x7a,                            \
   0x65, 0x2d, 0x74, 0x65, 0x73, 0x74, 0x2d, 0x30}
/* Largest single allocation the test device accepts (maxMemAllocSize). */
#define USMIPC_ZE_TEST_MAX_ALLOC ((uint64_t)1 << 30)

/* Every profile lists this extension (zeDriverGetExtensionProperties,
 * version 1): a backend that sees it knows that this driver's "dma-bufs"
 * are memfds named USMIPC_ZE_TEST_MEMFD_NAME ("/memfd:usmipc-ze-test" in
 * /proc/self/fd), not descriptors of the dma-buf file system. */
#define USMIPC_ZE_TEST_EXTENSION_NAME "ZE_usmipc_test_driver"
#define USMIPC_ZE_TEST_EXTENSION_VERSION 1
#define USMIPC_ZE_TEST_MEMFD_NAME "usmipc-ze-test"

/* Profiles (USMIPC_ZE_TEST_PROFILE, read at zeInit; stats.profile says
 * which one the driver runs). Each cr-* profile behaves like a release of
 * Intel's compute-runtime (CR) as its source reads; ze_test_driver.c cites
 * the source line of every rule:
 *  ideal            (default) the driver as it was before profiles: the
 *                   knobs below marked "ideal" apply; zeMemPutIpcHandle and
 *                   zeMemGetFileDescriptorFromIpcHandleExp are served through
 *                   zeDriverGetExtensionFunctionAddress
 *  cr-25.35         25.35 to 26.05 defaults: legacy 17-byte IpcMemoryData,
 *                   no pools
 *  cr-26.05-opaque  26.05 with opaque handles opted in (debug key): 22-byte
 *                   IpcOpaqueMemoryData, opaque path iff processId != 0,
 *                   no import cache
 *  cr-26.09, cr-26.14  55-byte layout, opaque on (the Xe2+ default), opaque
 *                   path iff processId != 0, an import cache per context
 *                   holding the fetched descriptor numbers, device USM pools
 *  cr-26.18, cr-26.31  63-byte layout (opaqueHandle: a copy of the fd at
 *                   22-25), opaque path iff bytes 0-3 == bytes 22-25, an
 *                   import cache per driver holding dups, pools
 *  cr-sockets       cr-26.31 with ForceIpcSocketFallback: the opaque path
 *                   fetches over the abstract socket "\0neo_ipc_<pid>"
 * driverVersion (ze_driver_properties_t) is 1 for ideal and, by this
 * driver's own convention, (major << 24) | (minor << 16) | (build & 0xffff)
 * of the release for cr-* (cr-26.09: 26.09.37435).
 */
enum {
  USMIPC_ZE_TEST_PROFILE_IDEAL = 0,
  USMIPC_ZE_TEST_PROFILE_CR_25_35,
  USMIPC_ZE_TEST_PROFILE_CR_26_05_OPAQUE,
  USMIPC_ZE_TEST_PROFILE_CR_26_09,
  USMIPC_ZE_TEST_PROFILE_CR_26_14,
  USMIPC_ZE_TEST_PROFILE_CR_26_18,
  USMIPC_ZE_TEST_PROFILE_CR_26_31,
  USMIPC_ZE_TEST_PROFILE_CR_SOCKETS,
};

/* Pools of the cr-26.09 and later profiles: device allocations of at most
 * USMIPC_ZE_TEST_POOLED_MAX bytes, without an export descriptor, are carved
 * from USMIPC_ZE_TEST_POOL_SIZE pools. */
#define USMIPC_ZE_TEST_POOL_SIZE ((uint64_t)2 << 20)
#define USMIPC_ZE_TEST_POOLED_MAX ((uint64_t)1 << 20)
/* USMIPC_ZE_TEST_MULTI_BO=1: device allocations of at least this size have
 * two buffer objects. */
#define USMIPC_ZE_TEST_MULTI_BO_MIN ((uint64_t)2 << 20)

typedef struct usmipc_ze_test_stats {
  uint64_t ipc_gets;    /* successful zeMemGetIpcHandle calls (and handles
                           exported by zexMemGetIpcHandles) */
  uint64_t ipc_puts;    /* zeMemPutIpcHandle calls that released a reference */
  uint64_t ipc_opens;   /* successful zeMemOpenIpcHandle calls */
  uint64_t ipc_closes;  /* successful zeMemCloseIpcHandle calls */
  uint64_t live_ipc_handles;       /* exported descriptors still open */
  uint64_t freed_with_live_handle; /* zeMemFree while the IPC fd was live */
  uint64_t live_allocations;       /* zeMemAlloc* not yet zeMemFree'd */
  uint64_t live_mappings;          /* opened IPC mappings not yet closed */
  uint64_t fd_queries; /* zeMemGetFileDescriptorFromIpcHandleExp answers */
  uint64_t pidfd_self_fetches; /* pidfd-layout opens that took the fd from
                                  the calling process itself */
  /* Appended with the profiles. */
  uint64_t profile;                    /* USMIPC_ZE_TEST_PROFILE_* */
  uint64_t exported_fd_closed_by_free; /* zeMemFree closed an exported
                                          descriptor (cr-*: CR closes it) */
  uint64_t pooled_allocations;         /* device allocations from a pool */
  uint64_t pool_refs_dropped_by_unexported_free; /* zeMemFree of a pooled
      allocation never exported decremented its pool's IPC count */
  uint64_t pool_fd_closed_while_exported;        /* that count reached 0 and the
             pool's descriptor was closed while another live allocation of the pool
             had been exported (its handle names the closed descriptor) */
  uint64_t opaque_opens;      /* opens that took CR's opaque path */
  uint64_t legacy_opens;      /* cr-* opens of bytes 0-3 as a local fd */
  uint64_t pidfd_fetches;     /* descriptors the opaque path took with
                                 pidfd_getfd */
  uint64_t socket_fetches;    /* ... over the exporter's neo_ipc socket */
  uint64_t raw_fallbacks;     /* opaque path imported the raw number after a
                                 failed pidfd_open / pidfd_getfd */
  uint64_t import_cache_hits; /* opaque opens answered by the cache */
  uint64_t import_cache_stale_hits; /* ... with a descriptor of another file
      than the one the handle's (pid, fd) names now */
  uint64_t import_fds_kept;     /* descriptors the driver took for imports and
                                   never closes (CR: imported allocations skip
                                   the close; cache entries are never cleared) */
  uint64_t ptracer_any_set;     /* successful prctl(PR_SET_PTRACER_ANY) */
  uint64_t zex_get_ipc_handles; /* zexMemGetIpcHandles calls */
  uint64_t uninitialized_stub_calls; /* NEWER_LOADER=uninitialized stubs */
  uint64_t socket_requests_served;   /* descriptors this process's
                                        neo_ipc server sent */
} usmipc_ze_test_stats_t;

/* Exported by the driver library. */
typedef void (*usmipc_ze_test_get_stats_fn)(usmipc_ze_test_stats_t *out);
#define USMIPC_ZE_TEST_GET_STATS "usmipcZeTestDriverGetStats"

/* zexMemGetIpcHandles, served to cr-* profiles through
 * zeDriverGetExtensionFunctionAddress, as CR does: with *numIpcHandles == 0
 * or pIpcHandles NULL it returns the allocation's count of buffer objects;
 * otherwise it exports that many handles (one get each). */
#define USMIPC_ZE_TEST_ZEX_GET_IPC_HANDLES "zexMemGetIpcHandles"

/* Environment knobs the driver reads at zeInit, to imitate other drivers:
 *  USMIPC_ZE_TEST_PROFILE=NAME    one of the profiles above (an unknown name
 *                              fails zeInit)
 *  USMIPC_ZE_TEST_INIT_FAIL=1  zeInit fails (no usable device); any profile
 * ideal only:
 *  USMIPC_ZE_TEST_NO_FD_EXT=1  no zeMemGetFileDescriptorFromIpcHandleExp
 *                              (the backend must use the handle layout)
 *  USMIPC_ZE_TEST_NO_PUT=1     no zeMemPutIpcHandle (an API 1.4 driver: the
 *                              handle lives until zeMemFree)
 *  USMIPC_ZE_TEST_PIDFD_HANDLE=1  Intel's pidfd layout (IpcOpaqueMemoryData):
 *                              the handle names the exporter's pid, and
 *                              zeMemOpenIpcHandle fetches the fd from that
 *                              process with pidfd_getfd
 *  USMIPC_ZE_TEST_UNKNOWN_LAYOUT=1  the handle's first bytes are not its fd
 *                              (a layout usmipc must refuse to export)
 * cr-* only:
 *  USMIPC_ZE_TEST_NEWER_LOADER=routed  zeDriverGetExtensionFunctionAddress
 *                              serves zeMemPutIpcHandle and
 *                              zeMemGetFileDescriptorFromIpcHandleExp with
 *                              CR's semantics (a loader >= 1.10 routing the
 *                              DDI entries)
 *  USMIPC_ZE_TEST_NEWER_LOADER=uninitialized  it serves stubs of those two
 *                              that return ZE_RESULT_ERROR_UNINITIALIZED (a
 *                              newer loader's intercept layer over a driver
 *                              that lacks them)
 *  USMIPC_ZE_TEST_MULTI_BO=1   device allocations of at least 2 MiB have two
 *                              buffer objects: zexMemGetIpcHandles reports
 *                              2, zeMemGetIpcHandle exports the first only
 *  USMIPC_ZE_TEST_HANDLE_FD=devnode  the descriptor number in handles is a
 *                              /dev/null the driver opened (as if a layout
 *                              change put a DRM node there); the memory's
 *                              own descriptor is elsewhere */

#endif /* USMIPC_ZE_TEST_DRIVER_H */
