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

typedef struct usmipc_ze_test_stats {
  uint64_t ipc_gets;    /* successful zeMemGetIpcHandle calls */
  uint64_t ipc_puts;    /* zeMemPutIpcHandle calls that released a reference */
  uint64_t ipc_opens;   /* successful zeMemOpenIpcHandle calls */
  uint64_t ipc_closes;  /* successful zeMemCloseIpcHandle calls */
  uint64_t live_ipc_handles;       /* allocations with an IPC fd not yet put */
  uint64_t freed_with_live_handle; /* zeMemFree while the IPC fd was live */
  uint64_t live_allocations;       /* zeMemAlloc* not yet zeMemFree'd */
  uint64_t live_mappings;          /* opened IPC mappings not yet closed */
  uint64_t fd_queries; /* zeMemGetFileDescriptorFromIpcHandleExp answers */
  uint64_t pidfd_self_fetches; /* pidfd-layout opens that took the fd from
                                  the calling process itself */
} usmipc_ze_test_stats_t;

/* Exported by the driver library. */
typedef void (*usmipc_ze_test_get_stats_fn)(usmipc_ze_test_stats_t *out);
#define USMIPC_ZE_TEST_GET_STATS "usmipcZeTestDriverGetStats"

/* Environment knobs the driver reads at zeInit, to imitate other drivers:
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
 *  USMIPC_ZE_TEST_INIT_FAIL=1  zeInit fails (no usable device) */

#endif /* USMIPC_ZE_TEST_DRIVER_H */
