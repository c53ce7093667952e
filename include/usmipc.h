/* usmipc: zero-copy sharing of accelerator memory between processes.
 *
 * The only public C header. Conventions (libuv's):
 *  - every call that can fail returns 0 or a negative code from
 *    usmipc/errno.h; usmipc_last_error() then says, in a sentence, what was
 *    wrong and what to do;
 *  - objects are opaque; devices live as long as the process, queues and
 *    handles are created and destroyed explicitly;
 *  - every call is thread-safe.
 *
 * The data path of an IPC round trip:
 *   exporter: usmipc_malloc -> usmipc_ipc_get_handle -> usmipc_ipc_handle_data
 *             (send the bytes by any channel) -> usmipc_ipc_free_handle
 *   importer: usmipc_ipc_open(bytes) -> use the pointer -> usmipc_ipc_close
 */
#ifndef USMIPC_H
#define USMIPC_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h> /* ssize_t */

#include "usmipc/errno.h"
#include "usmipc/version.h"

#ifdef __cplusplus
extern "C" {
#endif

#if defined(__GNUC__)
#define USMIPC_API __attribute__((visibility("default")))
#else
#define USMIPC_API
#endif

typedef struct usmipc_device usmipc_device_t;
typedef struct usmipc_queue usmipc_queue_t;
typedef struct usmipc_ipc_handle usmipc_ipc_handle_t;
typedef struct usmipc_event usmipc_event_t;
typedef struct usmipc_pool usmipc_pool_t;

typedef enum usmipc_backend {
  USMIPC_BACKEND_HOST = 1,       /* the CPU; device memory is memfd-backed */
  USMIPC_BACKEND_CUDA = 2,       /* NVIDIA driver API, loaded with dlopen */
  USMIPC_BACKEND_LEVEL_ZERO = 3, /* oneAPI Level Zero, loaded with dlopen */
} usmipc_backend_t;

typedef enum usmipc_device_type {
  USMIPC_DEVICE_CPU = 1,
  USMIPC_DEVICE_GPU = 2,
} usmipc_device_type_t;

/* The USM kinds of the seed: device memory (exportable), host memory
 * (pinned, host-resident), shared memory (migrating). */
typedef enum usmipc_mem_kind {
  USMIPC_MEM_UNKNOWN = 0,
  USMIPC_MEM_DEVICE = 1,
  USMIPC_MEM_HOST = 2,
  USMIPC_MEM_SHARED = 3,
} usmipc_mem_kind_t;

/* ---- version and errors -------------------------------------------------- */

/* The version of the library actually loaded, as USMIPC_VERSION_HEX
 * (major << 16 | minor << 8 | patch), which is the one compiled against. */
USMIPC_API unsigned usmipc_version(void);
/* The same as a string, "major.minor.patch" (USMIPC_VERSION_STRING is the
 * one compiled against). */
USMIPC_API const char *usmipc_version_string(void);

/* "invalid argument" for USMIPC_EINVAL; never NULL. */
USMIPC_API const char *usmipc_strerror(int err);
/* "USMIPC_EINVAL" for USMIPC_EINVAL; never NULL. */
USMIPC_API const char *usmipc_err_name(int err);
/* The message of the last failed call on this thread: what was wrong and what
 * to do. Valid until the next usmipc call on the same thread. */
USMIPC_API const char *usmipc_last_error(void);
/* For USMIPC_EBACKEND: the driver's own error code of the last failure on
 * this thread (CUresult, ze_result_t, errno), 0 otherwise. */
USMIPC_API long usmipc_last_native_error(void);

/* ---- backends and devices ------------------------------------------------ */

/* "host", "cuda", "level_zero"; "unknown" for another value. */
USMIPC_API const char *usmipc_backend_name(usmipc_backend_t backend);
/* 0 when the backend loaded and has devices; otherwise USMIPC_EUNAVAILABLE and
 * *reason (if not NULL) says why ("libcuda.so.1 not found: ..."). */
USMIPC_API int usmipc_backend_status(usmipc_backend_t backend,
                                     const char **reason);

/* Fills devices[0..capacity) and sets *count to the number of devices of
 * every available backend (which may exceed capacity). */
USMIPC_API int usmipc_get_devices(usmipc_device_t **devices, size_t capacity,
                                  size_t *count);

/* Selects a device by filter string "backend[:type[:index]]", for example
 * "host:cpu", "host:cpu:0", "cuda:gpu:1", "level_zero:gpu", "cuda" or "gpu".
 * NULL or "" selects the default device: the first GPU, else the host. */
USMIPC_API int usmipc_device_select(const char *filter,
                                    usmipc_device_t **device);

/* The driver's name of the device ("NVIDIA H200"); "" for NULL. */
USMIPC_API const char *usmipc_device_name(const usmipc_device_t *device);
/* The backend the device belongs to. */
USMIPC_API usmipc_backend_t
usmipc_device_backend(const usmipc_device_t *device);
/* USMIPC_DEVICE_CPU or USMIPC_DEVICE_GPU. */
USMIPC_API usmipc_device_type_t
usmipc_device_type(const usmipc_device_t *device);
/* Index among the devices of the same backend and type. */
USMIPC_API int usmipc_device_index(const usmipc_device_t *device);
/* The canonical filter string, "host:cpu:0". */
USMIPC_API const char *
usmipc_device_filter_string(const usmipc_device_t *device);
/* Copies the device's 16-byte UUID (the driver's; the host device's is the
 * boot id), which handles carry; zeros for NULL. */
USMIPC_API void usmipc_device_uuid(const usmipc_device_t *device,
                                   uint8_t uuid[16]);
/* The aspect "supports IPC memory": 1 or 0. */
USMIPC_API int usmipc_device_has_ipc(const usmipc_device_t *device);

/* What a user prints about a device (dpctl's driver_version,
 * global_mem_size and max_mem_alloc_size), asked of the driver on each
 * call. driver_version is the driver's own version as SYCL prints it:
 * "CUDA 12.4" (cuDriverGetVersion), "1.6.31294" (Level Zero's
 * driverVersion as major.minor.build), the kernel release for the host
 * ("6.8.0-45-generic", uname(2)). global_mem_size is the device's memory
 * in bytes (Level Zero: the sum of its memories; the host: physical RAM);
 * max_mem_alloc_size the largest single allocation the driver accepts (CUDA
 * and the host: global_mem_size). Pass sizeof(usmipc_device_info_t): fields
 * are only ever appended, and a caller built against a shorter struct gets
 * its prefix. */
typedef struct usmipc_device_info {
  char driver_version[64];
  uint64_t global_mem_size;
  uint64_t max_mem_alloc_size;
} usmipc_device_info_t;
USMIPC_API int usmipc_device_get_info(const usmipc_device_t *device,
                                      usmipc_device_info_t *info, size_t size);

/* ---- queues -------------------------------------------------------------- */

/* A queue orders copies and fills on one device (a CUDA stream, a Level Zero
 * command list; on the host backend copies complete before returning). */
USMIPC_API int usmipc_queue_create(usmipc_device_t *device,
                                   usmipc_queue_t **queue);
/* Destroys a queue (of a wrapped native queue, only the wrapper). NULL is
 * accepted. */
USMIPC_API int usmipc_queue_destroy(usmipc_queue_t *queue);
/* The queue's device; NULL for NULL. */
USMIPC_API usmipc_device_t *usmipc_queue_device(const usmipc_queue_t *queue);
/* The host waits until the work submitted to the queue so far is done. */
USMIPC_API int usmipc_queue_synchronize(usmipc_queue_t *queue);
/* Enqueues a copy of nbytes from src to dst, either of them device or host
 * memory (unified addressing finds the direction); call
 * usmipc_queue_synchronize before reading the result on the host. */
USMIPC_API int usmipc_memcpy(usmipc_queue_t *queue, void *dst, const void *src,
                             size_t nbytes);
/* Enqueues a fill of nbytes at dst with the byte value; as usmipc_memcpy,
 * synchronize before the host reads it. */
USMIPC_API int usmipc_memset(usmipc_queue_t *queue, void *dst, int value,
                             size_t nbytes);
/* Wraps a queue another library owns, without taking ownership: a CUstream
 * on a cuda device (NULL is the legacy default stream; (void *)2 the
 * per-thread default stream), an immediate ze_command_list_handle_t on a
 * level_zero device, NULL on the host. usmipc_queue_destroy frees the
 * wrapper only; the native queue must outlive it. */
USMIPC_API int usmipc_queue_from_native(usmipc_device_t *device, void *native,
                                        usmipc_queue_t **queue);
/* The native queue (CUstream, ze_command_list_handle_t; NULL on the host). */
USMIPC_API void *usmipc_queue_native(const usmipc_queue_t *queue);

/* ---- memory -------------------------------------------------------------- */

/* Allocates nbytes (> 0) of memory of kind on device: USMIPC_MEM_DEVICE
 * memory can be exported (usmipc_ipc_get_handle), host and shared memory
 * cannot. usmipc_free frees it. usmipc_malloc_flags with flags 0. */
USMIPC_API int usmipc_malloc(usmipc_device_t *device, usmipc_mem_kind_t kind,
                             size_t nbytes, void **ptr);

/* How device memory will be shared, for backends that offer a choice (CUDA):
 * through a file descriptor (cuMemCreate with POSIX fds: the memory outlives
 * the exporter, and only processes the exporter's broker admits can open
 * it), or through the driver's own handle (cuMemAlloc + cuIpcGetMemHandle:
 * what PyTorch and CuPy allocate; a bearer token for the whole allocation).
 * 0 picks the backend's default (docs/cuda.md); USMIPC_CUDA_IPC=fd or
 * USMIPC_CUDA_IPC=native changes it for the process. Backends with a single way
 * ignore the flags. */
#define USMIPC_ALLOC_IPC_FD 0x1u
#define USMIPC_ALLOC_IPC_NATIVE 0x2u
USMIPC_API int usmipc_malloc_flags(usmipc_device_t *device,
                                   usmipc_mem_kind_t kind, size_t nbytes,
                                   unsigned flags, void **ptr);
/* ---- pools: many buffers at the cost of one -------------------------------
 *
 * A pool hands out blocks of a few large segments of device memory; each
 * segment is exported once, so an importer maps a segment at its first
 * block and opens every later block in it with a lookup (docs/pools.md).
 * usmipc_ipc_get_handle of a block gives a handle of just that block, which
 * importers refuse once the block is freed. Trust: whoever holds a block's
 * handle can reach its whole segment; use separate pools to keep consumers
 * apart. */

/* Creates a pool of device memory on device. The first segment has
 * capacity bytes (0: 64 MiB), each next one twice the last up to 1 GiB, and
 * always room for the request: a block never spans segments. flags as for
 * usmipc_malloc_flags. */
USMIPC_API int usmipc_pool_create(usmipc_device_t *device, size_t capacity,
                                  unsigned flags, usmipc_pool_t **pool);
/* A block of nbytes aligned to alignment (0: 256; a power of two up to
 * 2 MiB; less gives 256), taking nbytes rounded up to a multiple of 256.
 * usmipc_free returns it to the pool. */
USMIPC_API int usmipc_pool_malloc(usmipc_pool_t *pool, size_t nbytes,
                                  size_t alignment, void **ptr);
/* Frees the pool's segments (importers keep their mappings);
 * USMIPC_EBUSY while blocks are still allocated. */
USMIPC_API int usmipc_pool_destroy(usmipc_pool_t *pool);
/* What a pool holds now: its segments (each exported at most once, however
 * many of its blocks are shared) and their bytes, the blocks allocated and
 * not yet freed and their bytes. Pass sizeof(usmipc_pool_info_t). */
typedef struct usmipc_pool_info {
  size_t segments;
  size_t segment_bytes;
  size_t blocks;
  size_t block_bytes;
} usmipc_pool_info_t;
USMIPC_API int usmipc_pool_get_info(usmipc_pool_t *pool,
                                    usmipc_pool_info_t *info, size_t size);

/* ---- PyTorch's CUDA allocator ----------------------------------------------
 *
 * torch.cuda.memory.CUDAPluggableAllocator(<path of the library or of the
 * Python extension>, "usmipc_torch_malloc", "usmipc_torch_free"), installed
 * with torch.cuda.memory.change_current_allocator before torch's first CUDA
 * allocation (Python: usmipc.memory.use_torch_allocator()), makes every CUDA
 * tensor of the process a block of a usmipc pool: sharing a tensor with
 * usmipc_ipc_get_handle (IPCMemoryHandle(tensor)) then costs one export per
 * segment, and an importer one driver import per segment (docs/pools.md,
 * "PyTorch allocator"). */

/* torch's malloc: a block of size bytes for CUDA device ordinal device
 * (stream is the one torch allocates on). One pool per CUDA device ordinal
 * of the process (after CUDA_VISIBLE_DEVICES, as torch numbers them),
 * created at the first allocation on it and never destroyed. Thread-safe.
 * Blocks are 512-byte aligned and sized in multiples of 512 bytes. size 0
 * gives NULL (as torch's own allocator does). A failure gives NULL and
 * leaves the reason in usmipc_last_error() of the calling thread; note that
 * torch does not check for NULL (docs/pools.md).
 *
 * Stream rule: usmipc_torch_free records an event on stream (the one the
 * tensor was allocated on, which torch passes) and the block goes back to
 * the pool only once that event has completed; the host does not wait. So
 * a block is never handed out again while work queued before the free may
 * still use it, on any stream. Work on other streams is not seen (torch
 * gives pluggable allocators no record_stream from Python). */
USMIPC_API void *usmipc_torch_malloc(ssize_t size, int device, void *stream);
/* size is ignored (the pool knows each block's size); NULL is accepted. */
USMIPC_API void usmipc_torch_free(void *ptr, ssize_t size, int device,
                                  void *stream);
/* The pool of CUDA device ordinal device, created if needed (for
 * usmipc_pool_get_info; it must not be destroyed). */
USMIPC_API int usmipc_torch_pool(int device, usmipc_pool_t **pool);
/* Waits until the work queued before each free still pending on device
 * completed, and returns those blocks to the pool (then
 * usmipc_pool_get_info counts only live tensors). */
USMIPC_API int usmipc_torch_synchronize(int device);
/* The first segment of pools created after the call (0: the default,
 * USMIPC_TORCH_POOL_SEGMENT if set, such as "4G", else 64 MiB); the next
 * ones are twice the last up to 1 GiB, and always room for the request.
 * The segment is device memory allocated at once: a model of known size
 * fits in one segment, exported once. */
USMIPC_API int usmipc_torch_set_segment_size(size_t nbytes);

/* Frees an allocation from usmipc_malloc (or a pool block, which goes back
 * to its pool). If the allocation is also open as a
 * same-process IPC alias, the memory is released when the last alias closes;
 * importers in other processes keep their mappings. */
USMIPC_API int usmipc_free(void *ptr);

typedef struct usmipc_pointer_info {
  usmipc_device_t *device;
  usmipc_mem_kind_t kind;
  void *base;         /* start of the allocation holding the pointer */
  size_t size;        /* size of that allocation */
  uint64_t buffer_id; /* unique per allocation; differs after address reuse */
  int is_ipc_mapping; /* 1 when the memory was opened from an IPC handle */
  int is_foreign;     /* 1 when another library allocated it */
} usmipc_pointer_info_t;

/* Which device and kind, base and size of the allocation containing ptr.
 * Knows usmipc's allocations and mappings, and pointers that a backend's
 * driver can describe (any CUDA allocation). */
USMIPC_API int usmipc_pointer_query(const void *ptr,
                                    usmipc_pointer_info_t *info);

/* ---- IPC: the four calls of the seed ------------------------------------- */

/* Exports nbytes of device memory starting at ptr (an interior pointer is
 * fine: the handle carries the offset). nbytes == 0 exports up to the end of
 * the allocation. The handle's bytes are a documented wire format
 * (docs/handle-format.md) that any channel can carry. */
USMIPC_API int usmipc_ipc_get_handle(const void *ptr, size_t nbytes,
                                     usmipc_ipc_handle_t **handle);
/* The serialized handle; valid until usmipc_ipc_free_handle. */
USMIPC_API int usmipc_ipc_handle_data(const usmipc_ipc_handle_t *handle,
                                      const void **data, size_t *len);
/* Releases the handle data (and any driver-side handle). Mappings already
 * opened elsewhere stay valid. NULL is accepted. For memory usmipc
 * allocated, handle bytes stay openable until the memory is freed (or
 * revoked). For memory of another library (a torch tensor), which usmipc
 * cannot see freed, the export lives only while a handle of it lives: when
 * the last one is freed, its bytes are refused by every importer. */
USMIPC_API int usmipc_ipc_free_handle(usmipc_ipc_handle_t *handle);
/* Revokes every handle exported so far for the allocation containing ptr:
 * importers refuse them from now on (mappings already open stay valid; a
 * later usmipc_ipc_get_handle makes new, valid handles). For native CUDA
 * handles this is advisory: the driver handle inside the bytes could still
 * be opened by a program that bypasses usmipc (docs/security.md). */
USMIPC_API int usmipc_ipc_revoke(const void *ptr);

/* Maps handle bytes on device (NULL: the device named by the handle; another
 * device of the same backend maps through peer access where the hardware
 * allows it) and
 * returns the address of the exported range in *ptr and its size in
 * *mapped_nbytes. nbytes == 0 maps the whole exported size; more than it is
 * refused. Opening in the exporting process returns the original pointer.
 * Re-opening an allocation that is already open in this process is cheap:
 * mappings are shared and reference-counted. */
USMIPC_API int usmipc_ipc_open(const void *data, size_t len,
                               usmipc_device_t *device, size_t nbytes,
                               void **ptr, size_t *mapped_nbytes);
/* Drops one reference taken by usmipc_ipc_open (or _open_sycl) on ptr. */
USMIPC_API int usmipc_ipc_close(void *ptr);

/* Opens memory that a SYCL program exported on a Level Zero GPU: the bytes
 * of dpctl's IPCMemoryHandle.to_bytes() or of sycl::ext::oneapi::
 * experimental::ipc::memory::get() (a Unified Memory Framework blob of 108
 * or 120 bytes), never a usmipc handle. Opt-in, and weaker than
 * usmipc_ipc_open (docs/level-zero.md): the blob proves nothing about its
 * exporter, and a freed allocation is not detected (its descriptor number
 * may by then name another buffer of the exporter). The descriptor is
 * taken with pidfd_getfd(2) from the pid in the blob, which must be in this
 * process's PID namespace (Intel's driver lets any process of the user do
 * so, PR_SET_PTRACER_ANY, from compute-runtime 26.09 on Xe2 GPUs and 26.31
 * everywhere). device: a level_zero device (NULL: level_zero:gpu:0).
 * nbytes == 0 maps from the exported pointer to the end of its allocation.
 * Every call maps anew; usmipc_ipc_close unmaps. */
USMIPC_API int usmipc_ipc_open_sycl(const void *data, size_t len,
                                    usmipc_device_t *device, size_t nbytes,
                                    void **ptr, size_t *mapped_nbytes);

/* ---- events: ordering work across queues and processes --------------------
 *
 * An event marks a point in a queue's work. usmipc_event_record marks what
 * the queue has been given so far; usmipc_event_wait makes later work on a
 * queue wait for it on the device (the host does not block);
 * usmipc_event_synchronize makes the host wait. Every event can be shared:
 * its handle names one record (the latest when the handle is made), and the
 * importer's waits are for that record. The data path of an ordered
 * handoff (docs/events.md):
 *   producer: launch work on q -> usmipc_ipc_get_handle ->
 *             usmipc_ipc_handle_order(handle, q) -> send the bytes
 *   consumer: usmipc_ipc_open_ex(bytes, ..., its queue) -> launch work
 * On the host device queue work completes before returning, so events there
 * are complete when recorded; they still order, signal and cross processes
 * like the others, so the same program runs everywhere. */

/* Creates a shareable event of device; flags must be 0. */
USMIPC_API int usmipc_event_create(usmipc_device_t *device, unsigned flags,
                                   usmipc_event_t **event);
/* Destroys an event (created or opened). Importers of a destroyed event's
 * handles are refused from then on. NULL is accepted. */
USMIPC_API int usmipc_event_destroy(usmipc_event_t *event);
/* The event's device; NULL for NULL. */
USMIPC_API usmipc_device_t *usmipc_event_device(const usmipc_event_t *event);
/* Marks the work submitted to queue so far (a queue of the event's
 * device). Only created events can be recorded, not opened ones. */
USMIPC_API int usmipc_event_record(usmipc_event_t *event,
                                   usmipc_queue_t *queue);
/* Work submitted to queue after this call waits, on the device, until the
 * event's record completes. queue may be of another device of the same
 * backend. An event never recorded is complete. */
USMIPC_API int usmipc_event_wait(usmipc_event_t *event, usmipc_queue_t *queue);
/* The host waits until the record completes, for at most the event timeout
 * (usmipc_event_set_timeout; USMIPC_ETIMEDOUT past it); the interrupt
 * handler (usmipc_set_interrupt_handler) can abandon the wait
 * (USMIPC_EINTR). An event whose exporter exited before its record was
 * known complete fails with USMIPC_EEXPORTERGONE: a process's pending
 * device work dies with it. */
USMIPC_API int usmipc_event_synchronize(usmipc_event_t *event);
/* 0 when the record has completed, USMIPC_ENOTREADY while it has not; never
 * blocks. */
USMIPC_API int usmipc_event_query(usmipc_event_t *event);
/* The limit of every host wait on an event, in milliseconds; 0 (the
 * default, or USMIPC_EVENT_TIMEOUT_MS) waits without limit: device work may
 * legitimately take minutes. Every value is a limit of that many
 * milliseconds, up to ULLONG_MAX (compared without overflow: no large
 * value wraps into a short one). Separate from usmipc_ipc_set_timeout,
 * which bounds only the talk with an exporter. */
USMIPC_API int usmipc_event_set_timeout(unsigned long long timeout_ms);

/* The handle of the event's latest record (none yet: a handle that is
 * complete at once). Same wire format family as memory handles
 * (docs/handle-format.md); free it with usmipc_ipc_free_handle. */
USMIPC_API int usmipc_ipc_get_event_handle(usmipc_event_t *event,
                                           usmipc_ipc_handle_t **handle);
/* Opens an event handle on device (NULL: the device that recorded it; or
 * another device of its backend). Re-opening an event of the same exporter
 * is a lookup; opening in the exporting process gives a view of its own
 * event. The result waits for the record the handle names, and cannot be
 * recorded. Destroy it with usmipc_event_destroy. */
USMIPC_API int usmipc_ipc_open_event(const void *data, size_t len,
                                     usmipc_device_t *device,
                                     usmipc_event_t **event);

/* Orders the handle: records a fresh interprocess event on queue (after the
 * work queue has been given so far) and puts it in the handle's bytes, so
 * that importers wait for that work before they use the memory. Call it
 * before every handoff (each call records anew, from a per-process ring of
 * events, so a consumer never waits for later producer work). The bytes
 * from usmipc_ipc_handle_data change; a handle is ordered by one thread at
 * a time. queue NULL removes the ordering. */
USMIPC_API int usmipc_ipc_handle_order(usmipc_ipc_handle_t *handle,
                                       usmipc_queue_t *queue);

/* ---- release signals: the consumer tells the producer it is done --------
 *
 * A producer that will overwrite or free memory it handed over must know
 * that its consumers are done with it (PyTorch keeps a shared reference
 * count for this). usmipc_ipc_handle_order_ex with USMIPC_ORDER_RELEASE
 * puts a release ticket in the bytes (one per call); a consumer returns it
 * with usmipc_ipc_release after its work on its queue; the producer's
 * usmipc_ipc_handle_wait_released waits until every ticket handed out so
 * far came back, then makes its queue wait on the device for the consumers'
 * work (or waits on the host, queue NULL). A ticket counts once, however
 * often it is returned; a consumer that never returns its ticket (it died,
 * or it is not usmipc) makes the producer wait until the event timeout
 * (usmipc_event_set_timeout). */

/* usmipc_ipc_handle_order with flags: USMIPC_ORDER_RELEASE also puts a
 * fresh release ticket in the bytes (one per call). flags 0 is
 * usmipc_ipc_handle_order. */
#define USMIPC_ORDER_RELEASE 0x1u
USMIPC_API int usmipc_ipc_handle_order_ex(usmipc_ipc_handle_t *handle,
                                          usmipc_queue_t *queue,
                                          unsigned flags);
/* Consumer: returns the ticket of handle bytes data (as opened) to their
 * producer, after the work submitted to queue so far (NULL: now, from the
 * host). data may be bundle bytes too (usmipc_bundle_order_ex); a bundle
 * that names no memory has no ticket, and returns 0 at once.
 * USMIPC_EEXPORTERGONE when the producer is gone or no longer waits for it
 * (its handle or bundle was freed); USMIPC_EINVAL when the bytes carry no
 * ticket; USMIPC_EACCES (wrong token) or USMIPC_EBADHANDLE (a ticket never
 * handed out) for forged bytes. Returning a ticket twice counts once. */
USMIPC_API int usmipc_ipc_release(const void *data, size_t len,
                                  usmipc_queue_t *queue);
/* Consumer: hands the handoff of bytes data (handle or bundle bytes with a
 * release ticket, as opened here) on to one more consumer process: out
 * (len bytes; may be data) receives the same bytes with a ticket of their
 * own, which the producer mints at this call, so that its wait for
 * releases also waits for the process that opens out (and returns that
 * ticket). Call it while this process still holds what it opened from
 * data, before returning data's ticket: the producer refuses afterwards
 * (USMIPC_EINVAL), as it may reuse the memory then. out keeps the
 * producer's ordering record: work this process queued on the memory is
 * not ordered before the next consumer's, so finish it first.
 * USMIPC_EEXPORTERGONE when the producer is gone or freed the handle or
 * bundle; USMIPC_EACCES or USMIPC_EBADHANDLE for forged bytes; USMIPC_EBUSY
 * while 65,536 forwarded tickets of one handoff are out. A bundle of no
 * memory is copied as it is. */
USMIPC_API int usmipc_ipc_forward(const void *data, size_t len, void *out);
/* Producer: tickets handed out and come back so far. This and
 * usmipc_ipc_handle_wait_released may run while another thread orders the
 * handle. */
USMIPC_API int usmipc_ipc_handle_releases(const usmipc_ipc_handle_t *handle,
                                          uint64_t *sent, uint64_t *released);
/* Producer: waits until every ticket handed out so far came back, then
 * makes queue wait on the device for the work the consumers submitted
 * before returning them (queue NULL: the host waits). USMIPC_ETIMEDOUT past
 * the event timeout (usmipc_event_set_timeout). */
USMIPC_API int usmipc_ipc_handle_wait_released(usmipc_ipc_handle_t *handle,
                                               usmipc_queue_t *queue);

/* Producer, for a process that keeps many handoffs out (a reaper thread
 * that frees what came back): which handles and bundles of this process had
 * every ticket back, without asking each. Each time one does (its last
 * outstanding ticket returns), its release key joins a process-wide log;
 * usmipc_releases_wait returns the keys logged after *seq (at most cap, in
 * keys; *count of them) and advances *seq past them, waiting up to
 * timeout_ms (0: not at all) while there are none (*count 0 then). The log
 * keeps the last 4096; a caller further behind (or starting from a *seq
 * this process never reached: after fork) gets *missed 1, no keys, and
 * *seq set to now: it must then look at every handle it keeps. Readers do
 * not take keys from each other. A key says the counts were equal then: a
 * handle that hands out another ticket afterwards is logged again when that
 * one is back. Check usmipc_*_releases before freeing. */
USMIPC_API int usmipc_releases_wait(uint64_t *seq, uint64_t *keys, size_t cap,
                                    size_t *count, int *missed,
                                    unsigned long long timeout_ms);
/* The release key of a handle (usmipc_releases_wait; a bundle's:
 * usmipc_bundle_release_key), 0 before its first ticket. */
USMIPC_API uint64_t
usmipc_ipc_handle_release_key(const usmipc_ipc_handle_t *handle);

/* usmipc_ipc_open with ordering: when the handle is ordered, later work on
 * queue waits for the producer's work on the device, or, with queue NULL,
 * the host waits (usmipc_event_synchronize's rules). usmipc_ipc_open is
 * usmipc_ipc_open_ex(..., NULL, 0, ...). USMIPC_OPEN_UNORDERED skips the
 * wait, for callers that order the work themselves. */
#define USMIPC_OPEN_UNORDERED 0x1u
USMIPC_API int usmipc_ipc_open_ex(const void *data, size_t len,
                                  usmipc_device_t *device, size_t nbytes,
                                  usmipc_queue_t *queue, unsigned flags,
                                  void **ptr, size_t *mapped_nbytes);
/* The event an ordered memory handle carries, opened on device like
 * usmipc_ipc_open_event (for a consumer that waits later, on other
 * queues: DLPack's stream argument); *event is NULL when the handle is not
 * ordered. */
USMIPC_API int usmipc_ipc_open_handle_event(const void *data, size_t len,
                                            usmipc_device_t *device,
                                            usmipc_event_t **event);

typedef struct usmipc_ipc_handle_info {
  usmipc_backend_t backend;
  uint8_t device_uuid[16];
  uint32_t exporter_pid;
  uint64_t buffer_id;
  uint64_t allocation_size;
  uint64_t offset;
  uint64_t nbytes;
  unsigned handle_kind; /* backend-specific: see docs/handle-format.md */
  uint32_t exporter_uid;
  uint64_t exporter_nonce; /* random per process instance */
  unsigned wire_version;   /* of the handle's format */
  uint32_t writer_version; /* USMIPC_VERSION_HEX of the exporter's library */
  int is_event;            /* an event handle (usmipc_ipc_get_event_handle) */
  int is_ordered;       /* a memory handle that carries an event to wait for */
  uint64_t event_point; /* the record an event handle (or ordering) names */
  uint64_t release_ticket; /* the ticket to return (usmipc_ipc_release), or 0 */
} usmipc_ipc_handle_info_t;

/* Validates handle bytes (as untrusted input) without opening them. */
USMIPC_API int usmipc_ipc_handle_inspect(const void *data, size_t len,
                                         usmipc_ipc_handle_info_t *info);
/* What usmipc_ipc_handle_inspect says of the bytes the handle was made with
 * (before any handoff's ordering or ticket), without decoding them again:
 * the library made them. */
USMIPC_API int usmipc_ipc_handle_get_info(const usmipc_ipc_handle_t *handle,
                                          usmipc_ipc_handle_info_t *info);

/* Importers keep closed mappings so that a re-open is cheap. By default a
 * closed mapping stays as long as its exporter still exports the
 * allocation (its export table says so), however many there are: it pins
 * nothing the exporter does not hold anyway. Once the allocation is freed
 * or its exporter gone, the mapping is dropped at the next close or within
 * a second by the cache's sweeper thread, even if the process makes no
 * further call (USMIPC_IPC_CACHE_DROP_FREED=0 turns that off, for tests).
 * Mappings whose liveness cannot be read are kept at most 64 and 1 GiB.
 * usmipc_ipc_set_cache_size (or USMIPC_IPC_CACHE_SIZE) bounds every closed
 * mapping to this many; 0 unmaps on the last close. */
USMIPC_API int usmipc_ipc_set_cache_size(size_t entries);
/* ... and usmipc_ipc_set_cache_bytes (or USMIPC_IPC_CACHE_BYTES) to this
 * many bytes of them; lowering either unmaps the least recently used idle
 * mappings at once. */
USMIPC_API int usmipc_ipc_set_cache_bytes(size_t bytes);

/* Every wait inside one usmipc_ipc_open (connecting to the exporter, its
 * answer) shares one absolute deadline, this many milliseconds after the
 * call starts (default 5000, or USMIPC_IPC_TIMEOUT_MS); signals do not
 * extend it. Past it the open fails with USMIPC_ETIMEDOUT. 0 restores the
 * default. */
USMIPC_API int usmipc_ipc_set_timeout(unsigned timeout_ms);

/* Called from inside a wait of usmipc_ipc_open when a signal interrupts it
 * and at least every 50 ms while it waits; a nonzero return abandons the
 * open with USMIPC_EINTR. Language bindings use it to honour Ctrl-C (the
 * Python package checks for pending signals). NULL removes it. */
typedef int (*usmipc_interrupt_fn)(void *arg);
USMIPC_API void usmipc_set_interrupt_handler(usmipc_interrupt_fn fn, void *arg);

/* ---- bundles: many arrays in one handoff (docs/bundles.md) ----------------
 *
 *   producer: usmipc_bundle_create -> add containers and arrays in preorder
 *             -> usmipc_bundle_finish (each allocation exported once) ->
 *             usmipc_bundle_order(b, q) (optional) -> usmipc_bundle_data ->
 *             send the bytes; keep the bundle (and the arrays' memory)
 *             until the consumer has opened them: usmipc_bundle_free makes
 *             the bytes refused from then on.
 *   consumer: usmipc_bundle_open -> nodes and arrays -> use the pointers ->
 *             usmipc_bundle_close (or usmipc_ipc_close of each pointer
 *             after usmipc_bundle_release).
 *   done:     a producer that will overwrite the arrays orders each handoff
 *             with usmipc_bundle_order_ex(b, q, USMIPC_ORDER_RELEASE); each
 *             consumer returns the ticket with usmipc_ipc_release(bytes,
 *             len, its queue) after its work; usmipc_bundle_wait_released
 *             waits for all of them (the release signals of single handles,
 *             above).
 *
 * The bytes are a documented format (docs/handle-format.md, "Bundles") that
 * names each allocation once and each array as an offset, a DLPack dtype, a
 * shape and strides; the tree (dicts with UTF-8 keys, lists, tuples) is a
 * preorder list of nodes. No code or pickle travels. */
typedef struct usmipc_bundle usmipc_bundle_t;
typedef struct usmipc_opened_bundle usmipc_opened_bundle_t;

typedef enum usmipc_bundle_node_kind {
  USMIPC_BUNDLE_DICT = 1,
  USMIPC_BUNDLE_LIST = 2,
  USMIPC_BUNDLE_TUPLE = 3,
  USMIPC_BUNDLE_ARRAY = 4,
} usmipc_bundle_node_kind_t;

/* An array: DLPack's dtype (code: 0 int, 1 uint, 2 float, 4 bfloat, 5
 * complex, 6 bool; bits; lanes 1), shape, and strides in elements (NULL:
 * C-contiguous; never negative). */
typedef struct usmipc_array_desc {
  uint8_t dtype_code;
  uint8_t dtype_bits;
  uint16_t dtype_lanes;
  int ndim; /* 0 to USMIPC_BUNDLE_MAX_NDIM */
  const int64_t *shape;
  const int64_t *strides;
} usmipc_array_desc_t;
#define USMIPC_BUNDLE_MAX_NDIM 32

typedef struct usmipc_bundle_node {
  usmipc_bundle_node_kind_t kind;
  uint32_t count;  /* a container's children; an array's index */
  const char *key; /* in a dict: its key (UTF-8, not NUL-terminated) */
  size_t key_len;
} usmipc_bundle_node_t;

typedef struct usmipc_bundle_array {
  void *ptr; /* the mapped first element; NULL for an array of no element */
  usmipc_array_desc_t desc; /* strides always set */
  size_t extent;            /* bytes from ptr that the array spans */
} usmipc_bundle_array_t;

/* Starts a bundle: add its nodes in preorder, then usmipc_bundle_finish. */
USMIPC_API int usmipc_bundle_create(usmipc_bundle_t **bundle);
/* A dict, list or tuple of count children, which follow (in a dict each
 * child carries its key). key: this node's key in its parent dict. */
USMIPC_API int usmipc_bundle_add_container(usmipc_bundle_t *bundle,
                                           usmipc_bundle_node_kind_t kind,
                                           uint32_t count, const char *key,
                                           size_t key_len);
/* An array whose first element is at ptr, in device memory that can be
 * exported (usmipc's own, a pool block, or another library's); an array of
 * no element needs no memory (ptr may be NULL). The allocation is found and
 * exported (once per bundle) here, so errors name this array. */
USMIPC_API int usmipc_bundle_add_array(usmipc_bundle_t *bundle, const char *key,
                                       size_t key_len, const void *ptr,
                                       const usmipc_array_desc_t *desc);
/* Checks the tree is complete and writes the bytes. */
USMIPC_API int usmipc_bundle_finish(usmipc_bundle_t *bundle);
/* Records an event on queue and makes the bytes carry it, so that the
 * consumer's open waits for the work queued so far (as
 * usmipc_ipc_handle_order); each call records anew. NULL: unordered. */
USMIPC_API int usmipc_bundle_order(usmipc_bundle_t *bundle,
                                   usmipc_queue_t *queue);
/* usmipc_bundle_order with flags, as usmipc_ipc_handle_order_ex:
 * USMIPC_ORDER_RELEASE also puts a fresh release ticket in the bytes (one
 * per call; queue may be NULL for a ticket without ordering). A bundle that
 * names no memory carries none. flags 0 is usmipc_bundle_order. */
USMIPC_API int usmipc_bundle_order_ex(usmipc_bundle_t *bundle,
                                      usmipc_queue_t *queue, unsigned flags);
/* usmipc_bundle_order_ex(bundle, queue, USMIPC_ORDER_RELEASE) for one
 * handoff sent to `consumers` processes at once (tensor-parallel ranks
 * getting the same bytes): one event, one ticket, the same bytes for all;
 * each process returns the ticket (usmipc_ipc_release), a process's second
 * return counts for nothing, and usmipc_bundle_wait_released waits for all
 * of them. The broker tells processes apart by the kernel's word
 * (SO_PEERCRED); one it cannot see (another PID namespace) counts at each
 * return. 1 to 4096; 1 is usmipc_bundle_order_ex's ticket. */
USMIPC_API int usmipc_bundle_order_fanout(usmipc_bundle_t *bundle,
                                          usmipc_queue_t *queue,
                                          unsigned consumers);
/* Producer: the returns the bundle's tickets expect (one per handoff, or
 * its consumer count for a fan-out) and those that came back so far
 * (usmipc_ipc_release of its bytes). */
USMIPC_API int usmipc_bundle_releases(const usmipc_bundle_t *bundle,
                                      uint64_t *sent, uint64_t *released);
/* The bundle's release key (usmipc_releases_wait), 0 before its first
 * ticket. */
USMIPC_API uint64_t usmipc_bundle_release_key(const usmipc_bundle_t *bundle);
/* Producer: waits until every ticket the bundle handed out so far came
 * back, then makes queue wait on the device for the work the consumers
 * submitted before returning them (queue NULL: the host waits). A consumer
 * that never returns its ticket (it died) makes it fail with
 * USMIPC_ETIMEDOUT past the event timeout (usmipc_event_set_timeout). It
 * and usmipc_bundle_releases may run while another thread orders the
 * bundle. */
USMIPC_API int usmipc_bundle_wait_released(usmipc_bundle_t *bundle,
                                           usmipc_queue_t *queue);
/* The bytes of a finished bundle, to send; valid until usmipc_bundle_free
 * (usmipc_bundle_order rewrites them, and their length, in place). */
USMIPC_API int usmipc_bundle_data(const usmipc_bundle_t *bundle,
                                  const void **data, size_t *len);
/* Counts of what usmipc_bundle_finish found. */
USMIPC_API int usmipc_bundle_counts(const usmipc_bundle_t *bundle,
                                    size_t *arrays, size_t *allocations);
/* The device of the bundle's memory (every allocation's; NULL when it
 * names none), known since each array was added: no driver call. */
USMIPC_API usmipc_device_t *usmipc_bundle_device(const usmipc_bundle_t *bundle);
/* Frees the bundle and withdraws its bytes: importers refuse them from now
 * on (mappings already open stay valid), and tickets still out are refused
 * when returned (USMIPC_EEXPORTERGONE). NULL is accepted. */
USMIPC_API int usmipc_bundle_free(usmipc_bundle_t *bundle);

/* Maps every allocation the bytes name (each once; the descriptors of one
 * exporter in one exchange), waits for the producer's work as
 * usmipc_ipc_open_ex does (on queue, or the host; USMIPC_OPEN_UNORDERED
 * skips it), and describes the tree. Each array with a pointer holds one
 * open reference to its mapping. */
USMIPC_API int usmipc_bundle_open(const void *data, size_t len,
                                  usmipc_device_t *device,
                                  usmipc_queue_t *queue, unsigned flags,
                                  usmipc_opened_bundle_t **opened);
/* The tree's nodes in preorder, *count of them; valid until the bundle is
 * closed or released. */
USMIPC_API const usmipc_bundle_node_t *
usmipc_opened_bundle_nodes(const usmipc_opened_bundle_t *opened, size_t *count);
/* The arrays, *count of them, in the order array nodes name them; valid
 * until the bundle is closed or released. */
USMIPC_API const usmipc_bundle_array_t *
usmipc_opened_bundle_arrays(const usmipc_opened_bundle_t *opened,
                            size_t *count);
/* The device the arrays are mapped on (NULL when the bundle names no
 * memory and no device was given). */
USMIPC_API usmipc_device_t *
usmipc_opened_bundle_device(const usmipc_opened_bundle_t *opened);
/* The release ticket the opened bytes carry (usmipc_bundle_order_ex with
 * USMIPC_ORDER_RELEASE), to return with usmipc_ipc_release of the same
 * bytes once done; 0 when the producer asked for none. */
USMIPC_API uint64_t
usmipc_opened_bundle_ticket(const usmipc_opened_bundle_t *opened);
/* Closes every array's mapping reference and frees the description. */
USMIPC_API int usmipc_bundle_close(usmipc_opened_bundle_t *opened);
/* Frees the description only: the caller closes each array's pointer with
 * usmipc_ipc_close (language bindings, whose arrays live on their own). */
USMIPC_API int usmipc_bundle_release(usmipc_opened_bundle_t *opened);
/* Validates bundle bytes (as untrusted input) without opening them. */
USMIPC_API int usmipc_bundle_inspect(const void *data, size_t len,
                                     size_t *arrays, size_t *allocations);

/* ---- updates: a handoff copied into the consumer's own arrays ------------
 * (docs/bundles.md, "Updating an engine's weights")
 *
 * An engine keeps its own weights and copies each handoff into them. A copy
 * plan says, once, where each of the bundle's arrays goes; each
 * usmipc_bundle_update then opens the bytes (warm: no driver work), orders
 * the copies after the producer's work on queue, queues every copy as one
 * unit (CUDA: one kernel launch over a table kept on the device; Level
 * Zero: the copies on one command list; host memory: a parallel memcpy),
 * and returns the bytes' release ticket after the copies, on the device.
 * Host time does not grow with the leaf count beyond a compare per leaf.
 *
 * A destination takes the bundle's array `array` (its index in
 * usmipc_opened_bundle_arrays order): the same dtype and shape; any
 * strides on both sides whose elements fall into rows of contiguous
 * elements with one pitch each (a contiguous tensor, a row or column shard
 * of a matrix); other layouts are refused naming the destination. Every
 * destination is checked against the bundle before anything is copied. */
typedef struct usmipc_copy_plan usmipc_copy_plan_t;

typedef struct usmipc_copy_dest {
  uint32_t array;           /* the bundle's array that goes here */
  void *ptr;                /* the destination's first element */
  usmipc_array_desc_t desc; /* its dtype, shape, strides (NULL: C order) */
  const char *name;         /* for errors (NUL-terminated; may be NULL) */
} usmipc_copy_dest_t;

/* usmipc_copy_plan_create flags: refuse a bundle whose tree (keys, nesting,
 * arrays' dtypes and shapes) differs from the one of the plan's first
 * update, with USMIPC_EINVAL (bindings that match by name rebuild then). */
#define USMIPC_PLAN_PIN_TREE 1u
/* usmipc_bundle_update flags: USMIPC_OPEN_UNORDERED, and this one: keep
 * the bytes' release ticket (the caller returns it, usmipc_ipc_release). */
#define USMIPC_UPDATE_KEEP_TICKET 0x100u

/* A plan of count destinations on device (the memory the copies write
 * must be usable there). The destinations are copied: dests may go. */
USMIPC_API int usmipc_copy_plan_create(usmipc_device_t *device,
                                       const usmipc_copy_dest_t *dests,
                                       size_t count, unsigned flags,
                                       usmipc_copy_plan_t **plan);
/* Copies the handoff in data into the plan's destinations, on queue after
 * the producer's work (queue NULL: the host waits for the copies), and
 * returns the ticket the bytes carry after the copies. The mappings stay
 * open until the next update or usmipc_copy_plan_free, so that a warm
 * update maps nothing. One thread at a time per plan. */
USMIPC_API int usmipc_bundle_update(usmipc_copy_plan_t *plan, const void *data,
                                    size_t len, usmipc_queue_t *queue,
                                    unsigned flags);
/* Closes the plan's mappings and frees it. Where the backend batches its
 * copies on the device (CUDA's kernel) it first waits for the last ones;
 * otherwise (USMIPC_COPY_BATCH=loop, Level Zero) synchronize the last
 * update's queue first. NULL is accepted. */
USMIPC_API int usmipc_copy_plan_free(usmipc_copy_plan_t *plan);

/* What IPC has cost this process since it started (or since
 * usmipc_reset_stats): driver exports (a new driver handle or descriptor for
 * an allocation), driver imports (a driver open or map of another process's
 * allocation), driver queries (of memory another library allocated, to find
 * its allocation), descriptors this process's broker sent and descriptors
 * this process took (by any transport), and round trips to other processes'
 * brokers (one round trip carries up to 253 descriptors of one exporter),
 * event records made to order handoffs and release tickets (one from a queue
 * with nothing pending reuses a completed record and makes none), and waits for
 * events put on a queue (a record already complete is not waited for). A second
 * share of buffers already shared costs none of the first two, nor descriptors.
 * Pass sizeof(usmipc_stats_t). */
typedef struct usmipc_stats {
  unsigned long long driver_exports;
  unsigned long long driver_imports;
  unsigned long long driver_queries;
  unsigned long long descriptors_sent;
  unsigned long long descriptors_received;
  unsigned long long transport_exchanges;
  unsigned long long event_records;
  unsigned long long event_waits;
} usmipc_stats_t;
USMIPC_API int usmipc_get_stats(usmipc_stats_t *stats, size_t size);
/* Sets every count of usmipc_get_stats to 0. */
USMIPC_API void usmipc_reset_stats(void);

#ifdef __cplusplus
}
#endif
#endif /* USMIPC_H */
