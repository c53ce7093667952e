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
/* The device's memories (zeDeviceGetMemoryProperties): two of
 * USMIPC_ZE_TEST_MEMORY_BYTES each, as a GPU with two HBM stacks lists
 * them, so that a reader of the device's total memory must add them up. */
#define USMIPC_ZE_TEST_MEMORIES 2
#define USMIPC_ZE_TEST_MEMORY_BYTES ((uint64_t)3 << 30)

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
  /* Appended with events. */
  uint64_t event_pools_created;   /* zeEventPoolCreate successes */
  uint64_t live_event_pools;      /* created or opened, not yet destroyed or
                                     closed */
  uint64_t live_events;           /* zeEventCreate not yet zeEventDestroy'd */
  uint64_t event_pool_ipc_gets;   /* zeEventPoolGetIpcHandle successes */
  uint64_t event_pool_opens;      /* zeEventPoolOpenIpcHandle successes */
  uint64_t event_pool_closes;     /* zeEventPoolCloseIpcHandle successes */
  uint64_t event_pool_open_failures; /* zeEventPoolOpenIpcHandle refusals */
  uint64_t event_pool_opaque_opens;  /* opens that took CR 26.18+'s opaque
                                        path (the exporter's pid, the cache) */
  uint64_t event_pool_cache_hits;    /* ... answered by the import cache, whose
                                        key is 0 for every event pool */
  uint64_t event_pool_stale_hits;    /* ... with another file than the one the
                                        handle's (pid, fd) names now */
  uint64_t event_fds_taken;       /* descriptors zeEventPoolOpenIpcHandle took
                                     (closed at once from 26.09, at
                                     zeEventPoolCloseIpcHandle before) */
  uint64_t exported_event_fds_leaked; /* zeEventPoolDestroy left an exported
                                         descriptor open (CR before 26.31) */
  uint64_t event_signals;         /* signals executed (appended or host) */
  uint64_t event_resets;          /* resets executed (appended or host) */
  uint64_t event_waits;           /* appended waits executed */
  uint64_t wait_timeouts;         /* appended waits that gave up after
                                     USMIPC_ZE_TEST_WAIT_TIMEOUT_MS */
  uint64_t delays;                /* usmipcZeTestDriverAppendDelay commands */
  uint64_t async_commands;        /* commands run by an asynchronous list's
                                     worker */
} usmipc_ze_test_stats_t;

/* Exported by the driver library. */
typedef void (*usmipc_ze_test_get_stats_fn)(usmipc_ze_test_stats_t *out);
#define USMIPC_ZE_TEST_GET_STATS "usmipcZeTestDriverGetStats"

/* Events. Event pools keep their events' state in a memfd named
 * USMIPC_ZE_TEST_EVENT_MEMFD_NAME (the pool's "dma-buf"), USMIPC_ZE_TEST_
 * EVENT_SLOT bytes per event (a u32 state at the start: 0 not signalled, 1
 * signalled), the size rounded up to 64 KiB as CR rounds it; an opened
 * pool maps the same memfd, so a signal in one process is seen in the
 * other. Every event pool of the device has USMIPC_ZE_TEST_EVENT_PACKETS
 * packets per event (maxEventPackets), unless USMIPC_ZE_TEST_EVENT_PACKETS
 * says otherwise. */
#define USMIPC_ZE_TEST_EVENT_MEMFD_NAME "usmipc-ze-test-evpool"
#define USMIPC_ZE_TEST_EVENT_SLOT 64
#define USMIPC_ZE_TEST_EVENT_PACKETS 16

/* Command lists: a synchronous immediate list runs each command before the
 * append returns (an appended wait blocks the caller until its events are
 * signalled, or USMIPC_ZE_TEST_WAIT_TIMEOUT_MS pass: then
 * ZE_RESULT_ERROR_DEVICE_LOST, as a hung GPU would end); an asynchronous
 * (or default-mode) immediate list runs its commands in order on a thread
 * of its own, so that an append returns at once.
 *
 * usmipcZeTestDriverAppendDelay(list, ms) appends a command that takes ms
 * milliseconds (a stand-in for a long kernel): on an asynchronous list the
 * commands appended after it (a fill, a signal) run that much later, which
 * lets a test prove that a consumer's wait orders its work after a
 * producer's. Called with the driver's own command list handle (the loader
 * hands those to the application unless it intercepts). */
typedef int (*usmipc_ze_test_append_delay_fn)(void *list, uint32_t ms);
#define USMIPC_ZE_TEST_APPEND_DELAY "usmipcZeTestDriverAppendDelay"

/* zexMemGetIpcHandles, served to cr-* profiles through
 * zeDriverGetExtensionFunctionAddress, as CR does: with *numIpcHandles == 0
 * or pIpcHandles NULL it returns the allocation's count of buffer objects;
 * otherwise it exports that many handles (one get each). */
#define USMIPC_ZE_TEST_ZEX_GET_IPC_HANDLES "zexMemGetIpcHandles"

/* Environment knobs the driver reads at zeInit, to imitate other drivers:
 *  USMIPC_ZE_TEST_PROFILE=NAME    one of the profiles above (an unknown name
 *                              fails zeInit)
 *  USMIPC_ZE_TEST_INIT_FAIL=1  zeInit fails (no usable device); any profile
 *  USMIPC_ZE_TEST_NO_IPC_EVENTS=1  the driver does not list
 *                              ZE_IPC_PROPERTY_FLAG_EVENT_POOL; any profile
 *  USMIPC_ZE_TEST_EVENT_PACKETS=N  maxEventPackets (default 16; another value
 *                              stands for another GPU); any profile
 *  USMIPC_ZE_TEST_WAIT_TIMEOUT_MS=N  how long an appended wait waits (default
 *                              20000); any profile
 *  USMIPC_ZE_TEST_EVENT_LAYOUT=post-26.31|unknown  ideal only: event pool
 *                              handles in CR's layout after 26.31 (master,
 *                              unreleased), or in one no release has (the
 *                              descriptor at 40); default: 25.48+'s
 *                              IpcEventPoolData, opaque mode off
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
