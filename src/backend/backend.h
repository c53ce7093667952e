/* The backend interface: one ops table per backend, one file per backend.
 *
 * The core (device.c, memory.c, ipc.c) calls backends only through this
 * table, and backends know nothing of the core's registries, caches or
 * transports. A backend reports itself unavailable from probe() (with a
 * reason) instead of failing; the table starts with its own size so that it
 * can grow (libfabric's habit); the IPC group is all-or-none (UMF's).
 */
#ifndef USMIPC_BACKEND_H
#define USMIPC_BACKEND_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "wire/wire.h"

/* What a backend says about one of its devices at probe time. */
typedef struct usmipc__device_desc {
  usmipc_device_type_t type;
  char name[128];
  uint8_t uuid[16];
  int supports_ipc;
  void *native; /* backend's per-device state (a CUcontext, ...) */
} usmipc__device_desc_t;

/* One allocation or mapping as a backend sees it. The core keeps one of these
 * in each registry record and hands it back to the backend unchanged. */
typedef struct usmipc__allocation {
  void *base;
  size_t size;
  usmipc_mem_kind_t kind;
  size_t reserved; /* bytes really mapped (page or granularity rounding) */
  int fd;          /* a shareable file descriptor owned by this record, or -1 */
  bool fd_is_device_buffer; /* fd is a dma-buf-like handle: reopening
                               /proc/<pid>/fd/<n> does not give the same
                               memory, so importers never try */
  bool chunked; /* memory of another library made of physical chunks mapped
                   back to back (CUDA VMM): exported with foreign_chunks and
                   chunks_export, not ipc_export */
  unsigned how; /* backend-specific: how the memory was made or mapped */
  uint64_t
      native; /* backend's own handle (CUmemGenericAllocationHandle, ...) */
} usmipc__allocation_t;

/* A run of physical chunks of another library's memory, mapped back to back
 * (CUDA VMM: PyTorch's expandable segments map 2 MiB or 20 MiB chunks into
 * one reserved range). At most USMIPC__CHUNKS_MAX chunks, so that their
 * descriptors fit one SCM_RIGHTS message (the kernel's SCM_MAX_FD is 253)
 * with the export table's. */
typedef struct usmipc__chunk_run {
  void *base;    /* the first chunk's start */
  uint64_t size; /* the sum of the chunk sizes */
  uint32_t count;
  uint64_t sizes[USMIPC__CHUNKS_MAX];
  uint64_t ids[USMIPC__CHUNKS_MAX]; /* each chunk's identity, never reused */
  int fds[USMIPC__CHUNKS_MAX];      /* shareable descriptors, or -1 */
} usmipc__chunk_run_t;

/* A backend's ipc_import: the allocation is mapped by another thread of
 * this process right now (positive: never one of the public codes). */
#define USMIPC__IMPORT_BUSY 1

/* One copy of a batch (usmipc_bundle_update): rows of row_bytes each, the
 * row r from src + r * src_pitch to dst + r * dst_pitch. A contiguous copy is
 * one row. Rows never overlap between or within copies. */
typedef struct usmipc__copy {
  uint64_t src, dst;
  uint64_t row_bytes, rows;
  uint64_t src_pitch, dst_pitch;
} usmipc__copy_t;

typedef struct usmipc__backend_ops {
  size_t struct_size; /* sizeof(usmipc__backend_ops_t) when compiled */
  usmipc_backend_t backend;
  const char *name; /* "host", "cuda", "level_zero" */

  /* Load the driver and describe up to max devices. Returns the number of
   * devices (>= 0), or a negative code with reason filled in. Called once. */
  int (*probe)(usmipc__device_desc_t *devices, int max, char *reason,
               size_t reason_len);
  /* Optional: the name of a device whose probe left it empty, filled on the
   * first usmipc_device_name (a name that is costly to learn, such as the
   * host CPU's, is not paid for by programs that never ask). */
  void (*device_name)(void *dev, char *out, size_t len);

  /* Memory. dev is the device's native state from probe. */
  int (*mem_alloc)(void *dev, usmipc_mem_kind_t kind, size_t nbytes,
                   unsigned flags, usmipc__allocation_t *out);
  int (*mem_free)(void *dev, usmipc__allocation_t *alloc);
  /* Describe a pointer usmipc did not allocate: 0 and *out filled (kind,
   * base, size, native) plus *buffer_id and *device_index, or
   * USMIPC_EUNKNOWNPTR. Optional (NULL: the backend knows only its own). */
  int (*pointer_query)(const void *ptr, usmipc__allocation_t *out,
                       uint64_t *buffer_id, int *device_index);

  /* Queues: native queue state in *queue. */
  int (*queue_create)(void *dev, void **queue);
  int (*queue_destroy)(void *dev, void *queue);
  int (*queue_synchronize)(void *dev, void *queue);
  /* 1 when everything submitted to queue so far has completed, 0 when some
   * of it may not have, or a negative code. Optional (NULL: never known to
   * be idle). A handoff from an idle queue needs no new event record: one
   * known to be complete orders it (event.c, usmipc__event_order). */
  int (*queue_idle)(void *dev, void *queue);
  int (*memcpy)(void *dev, void *queue, void *dst, const void *src, size_t n);
  int (*memset)(void *dev, void *queue, void *dst, int value, size_t n);

  /* IPC, all or none. ipc_export fills the payload for the allocation and
   * returns in *fd_to_share a descriptor the core's transport must make
   * available to importers (borrowed: still owned by the allocation), or -1.
   * ipc_import maps an exported allocation for use on device dev; owner is
   * the device (as seen in this process) that exported it, equal to dev
   * unless the open crosses devices (peer access). fd is a descriptor
   * received from the exporter (or -1), owned by the caller; on success the
   * backend keeps what it needs in *out (dup'ing fd if it must keep one).
   * USMIPC__IMPORT_BUSY (above): the driver maps an allocation once per
   * process and another thread of ours holds that mapping now (CUDA's
   * legacy handles); the core looks for it in its registry and retries. */
  int (*ipc_export)(void *dev, usmipc__allocation_t *alloc,
                    usmipc__payload_t *payload, int *fd_to_share);
  int (*ipc_import)(void *dev, void *owner, const usmipc__payload_t *payload,
                    int fd, uint64_t allocation_size,
                    usmipc__allocation_t *out);
  int (*ipc_unmap)(void *dev, usmipc__allocation_t *mapping);
  /* Optional: 0 when the device's IPC may be used now, else a code and a
   * message. Called without locks before a first export of an allocation,
   * before every open, and by usmipc_device_has_ipc; it must be cheap once
   * decided (Level Zero's self-test runs on its first call). */
  int (*ipc_check)(void *dev);
  /* Optional, with ipc_check: true once ipc_check has found the device's IPC
   * broken (it fails from then on); runs no test. The core reads the IPC
   * aspect through it (usmipc__device_ipc_aspect), so a backend never
   * writes the core's devices. */
  bool (*ipc_failed)(void *dev);
  /* Optional (Level Zero): maps memory a SYCL program exported, from its
   * parsed UMF blob (struct usmipc__umf_blob, wire/wire.h) and the dma-buf fd
   * taken from the exporter (owned by the caller); out->base is the
   * provider allocation's base in this process. */
  int (*ipc_import_sycl)(void *dev, const struct usmipc__umf_blob *blob, int fd,
                         usmipc__allocation_t *out);

  /* Events, all or none; NULL for a backend whose queue work completes
   * before the call returns (the host), where the core's counters are the
   * whole event. The core (event.c) keeps the counters that name records
   * across processes; a backend event holds one record at a time.
   * event_record marks the work queue has so far; recording again replaces
   * the mark (the backend resets what it must first). event_query: 1 when
   * the last record completed (or there was none), 0 not yet, < 0 an
   * error. event_wait: later work on queue (of dev) waits on the device.
   * event_export fills payload (at most USMIPC__EVENT_PAYLOAD_MAX bytes, no
   * extension records) and *fd_to_share (borrowed from the event, or -1);
   * the core calls it once per event. event_import opens on dev an event
   * exported on owner (fd received, owned by the caller; -1 if none) from
   * the payload event_export made, whose handle_kind is the exporter's
   * (untrusted) payload kind; event_close releases an imported one. */
  int (*event_create)(void *dev, void **event);
  int (*event_destroy)(void *dev, void *event);
  int (*event_record)(void *dev, void *event, void *queue);
  int (*event_query)(void *dev, void *event);
  int (*event_wait)(void *dev, void *event, void *queue);
  int (*event_export)(void *dev, void *event, usmipc__payload_t *payload,
                      int *fd_to_share);
  int (*event_import)(void *dev, void *owner, const usmipc__payload_t *payload,
                      int fd, void **event);
  int (*event_close)(void *dev, void *event);
  /* Optional: wrap a native queue another library owns (a CUstream, an
   * immediate command list) as *queue, and release the wrapper without
   * touching the native queue. NULL: the native pointer is the queue. */
  int (*queue_wrap)(void *dev, void *native, void **queue);
  int (*queue_unwrap)(void *dev, void *queue);
  /* Optional: the native queue of a queue (NULL: the queue itself). */
  void *(*queue_native)(void *dev, void *queue);

  /* Memory of another library made of physical chunks (pointer_query set
   * alloc.chunked; dev is the device it lives on), all three or none.
   * foreign_chunks describes the
   * smallest run of whole chunks covering [ptr, ptr + nbytes) (fds all -1),
   * or fails: USMIPC_ENOTSUP with a message saying what to do when the
   * chunks cannot be shared through descriptors. chunks_export makes a
   * descriptor for each chunk of the run (owned by the caller; on failure
   * none is left open) and the payload. ipc_import_chunks maps count
   * descriptors (received from the exporter, owned by the caller) back to
   * back, sizes[i] bytes each, into one range usable on dev; owner and
   * allocation_size as for ipc_import. */
  int (*foreign_chunks)(void *dev, const void *ptr, size_t nbytes,
                        usmipc__chunk_run_t *run);
  int (*chunks_export)(void *dev, usmipc__chunk_run_t *run,
                       usmipc__payload_t *payload);
  int (*ipc_import_chunks)(void *dev, void *owner,
                           const usmipc__payload_t *payload, const int *fds,
                           const uint64_t *sizes, uint32_t count,
                           uint64_t allocation_size, usmipc__allocation_t *out);

  /* Optional, all three or none: a batch of copies queued as one unit
   * (CUDA: one kernel launch over a table kept on the device). copy_batch
   * holds the backend's state between calls (the table, its event);
   * copy_batch_run queues count copies on queue after the work queued so
   * far; same says the copies are those of the previous run on this batch
   * (the table on the device may be reused). NULL: the core queues each
   * row with memcpy. */
  int (*copy_batch_create)(void *dev, void **batch);
  int (*copy_batch_run)(void *dev, void *batch, void *queue,
                        const usmipc__copy_t *copies, size_t count, bool same);
  int (*copy_batch_destroy)(void *dev, void *batch);

  /* Optional: fills what usmipc_device_get_info reports of a device (the
   * core zeroed it first), asking the driver. NULL: nothing is known. */
  int (*device_info)(void *dev, usmipc_device_info_t *info);

  /* True when the backend can map memory (and open events) exported on a
   * device this process cannot see onto one it can: ipc_import,
   * ipc_import_chunks and event_import are then called with owner NULL and
   * must decide from dev alone (CUDA: a launcher's CUDA_VISIBLE_DEVICES
   * hides the exporter's GPU; the driver maps its memory for dev through
   * peer access, docs/distributed.md). False: the core refuses such opens. */
  bool ipc_import_hidden_owner;
} usmipc__backend_ops_t;

/* The backends the core knows, in probe order; a new backend adds itself to
 * the table in backend/registry.c and nothing else in the core changes. */
extern const usmipc__backend_ops_t *const usmipc__backends[];
extern const size_t usmipc__backend_count;

extern const usmipc__backend_ops_t usmipc__host_backend;
extern const usmipc__backend_ops_t usmipc__cuda_backend;
extern const usmipc__backend_ops_t usmipc__level_zero_backend;

#endif /* USMIPC_BACKEND_H */
