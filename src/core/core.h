/* The core floor's private header: the registries.
 *
 * Floor 4 of the core (src/core/): devices (device.c), the region registry
 * and its lock (region.c), the importer's record of each exporter
 * (peers.c), the export engine (export.c) and the import engine and cache
 * (import.c). They reach the backends only through their ops tables. */
#ifndef USMIPC_CORE_H
#define USMIPC_CORE_H

#include "backend/backend.h"
#include "linux/transport.h"

/* ---- devices (device.c) -------------------------------------------------- */

struct usmipc_device {
  const usmipc__backend_ops_t *ops;
  void *native; /* from the backend's probe */
  usmipc_device_type_t type;
  int index;   /* among devices of the same backend and type */
  int ordinal; /* probe order within the backend */
  int has_ipc; /* the probe's word; read through usmipc__device_ipc_aspect */
  uint8_t uuid[16];
  char name[128];  /* empty until ops->device_name fills it, if lazy */
  int name_ready;  /* read with acquire */
  char filter[48]; /* "host:cpu:0" */
};

int usmipc__devices_init(void);
usmipc_device_t *usmipc__device_by_ordinal(usmipc_backend_t backend,
                                           int ordinal);
usmipc_device_t *usmipc__device_by_uuid(usmipc_backend_t backend,
                                        const uint8_t uuid[16]);
void usmipc__uuid_format(const uint8_t uuid[16], char out[37]);
/* The device's IPC aspect as known now: what its probe said, unless the
 * backend has since found its IPC broken (ipc_failed: Level Zero's failed
 * self-test). Runs no test; usmipc_device_has_ipc runs ipc_check too. */
bool usmipc__device_ipc_aspect(const usmipc_device_t *d);
/* fork.c's hooks of the device probe. */
void usmipc__devices_fork_prepare(void);
void usmipc__devices_fork_parent(void);
void usmipc__devices_fork_child(void);

/* ---- the region registry (core/region.c)
 * --------------------------------------- Every allocation usmipc made and
 * every IPC mapping it opened is a region: an address range with its device,
 * kind and identity. One mutex guards the registry and the import cache; it is
 * never held across a driver call that can block on another process. */
typedef enum usmipc__origin {
  USMIPC__LOCAL = 1,         /* usmipc_malloc in this process */
  USMIPC__IMPORTED = 2,      /* usmipc_ipc_open of another process's handle */
  USMIPC__FOREIGN_ALIAS = 3, /* this process's own export of memory another
                                library allocated, opened here as an alias */
  USMIPC__IMPORTED_SYCL = 4, /* usmipc_ipc_open_sycl: unmapped at its last
                                close, never cached */
} usmipc__origin_t;
typedef struct usmipc__import_key {
  uint64_t nonce;
  uint64_t buffer_id;
  uint32_t pid;
  usmipc_device_t *device; /* where it is mapped: one mapping per device */
} usmipc__import_key_t;
typedef struct usmipc__region {
  usmipc__allocation_t alloc;
  usmipc_device_t *device;
  usmipc__origin_t origin;
  uint64_t buffer_id; /* LOCAL: drawn at allocation; IMPORTED: the exporter's */

  /* LOCAL and FOREIGN_ALIAS */
  uint64_t alias_refs;        /* same-process opens not yet closed (64
                                  bits: a bundle takes one per array) */
  bool user_freed;            /* usmipc_free called while aliases were open */
  bool exported;              /* payload and fd grant below are valid */
  usmipc__payload_t *payload; /* allocated at the first export: imports never
                                 need one */
  uint8_t token[16];  /* LOCAL: capability importers present to the broker;
                         IMPORTED: the token of the handle first opened,
                         which later opens of the same allocation match */
  uint32_t fd_number; /* the published descriptor, for pidfd_getfd */
  uint64_t fd_dev, fd_ino;
  uint32_t export_slot; /* this allocation's slot in the export table */
  uint32_t table_fd_number;
  bool fd_reopenable;
  void *pool_segment; /* LOCAL: the pool segment this allocation is, or NULL */

  /* IMPORTED */
  usmipc__import_key_t key;
  struct usmipc__peer *peer; /* the exporter's proof and table; NULL for
                                memory of another library (no slot) */
  uint8_t process_key[16];   /* the exporter's key, as the handle said */
  uint64_t slot_tag;         /* usmipc__slot_tag(process_key, token) */
  uint64_t open_refs;        /* usmipc_ipc_open calls not yet closed, and a
                                bundle's one per array: 64 bits, since 4,096
                                opens of 2^20 arrays wrapped 32 */
  struct usmipc__region *idle_prev, *idle_next; /* LRU of closed mappings */
} usmipc__region_t;
extern pthread_mutex_t usmipc__registry_lock;
/* All below: call with usmipc__registry_lock held. */
int usmipc__region_insert(usmipc__region_t *r);
void usmipc__region_remove(usmipc__region_t *r);
usmipc__region_t *usmipc__region_find(const void *ptr);
/* Visits every region (used after fork). */
void usmipc__region_foreach(void (*fn)(usmipc__region_t *r));
uint64_t usmipc__new_buffer_id(void);
/* Drops a LOCAL region from the registry and releases it; lock NOT held. */
void usmipc__region_release_local(usmipc__region_t *r);
/* Lock NOT held: the registry's one-time setup (the buffer id counter). */
void usmipc__registry_ensure(void);
/* usmipc's own memory as usmipc_malloc_flags and usmipc_free make and free
 * it, for callers that checked the arguments (pools: their segments);
 * usmipc__local_free does not hand pool blocks to their pool. Lock NOT
 * held. */
int usmipc__local_alloc(usmipc_device_t *device, usmipc_mem_kind_t kind,
                        size_t nbytes, unsigned flags, void **ptr);
int usmipc__local_free(void *ptr);
/* Asks each backend about a pointer usmipc did not allocate; lock held. */
int usmipc__foreign_query(const void *ptr, usmipc__allocation_t *alloc,
                          uint64_t *buffer_id, usmipc_device_t **device);
/* The same without the lock held, refusing the slack past the end of one of
 * usmipc's own allocations, with a message. */
int usmipc__foreign_query_unlocked(const void *ptr, usmipc__allocation_t *alloc,
                                   uint64_t *buffer_id,
                                   usmipc_device_t **device);
/* fork.c's hooks of the registry. */
void usmipc__registry_fork_prepare(void);
void usmipc__registry_fork_parent(void);
void usmipc__registry_fork_child(void);

/* ---- the importer's view of exporters (linux/peers.c) ----------------------
 * One record per exporting process this process opened handles of: its
 * verified export table and, where usable, its pidfd. Regions of origin
 * IMPORTED hold a reference. Guarded by usmipc__registry_lock. */
typedef struct usmipc__peer usmipc__peer_t;
/* Finds or makes the peer of w's exporter, proves its identity and maps its
 * table (once per exporter), and returns a reference. When the proof went
 * through the broker and w shares a descriptor, that descriptor may come
 * back too in *fd (else -1). Lock NOT held. */
int usmipc__peer_get(const usmipc__wire_t *w, uint64_t deadline,
                     usmipc__peer_t **peer, int *fd);
/* Takes w's descriptor from the verified exporter, checked against the
 * export table before and after. Lock NOT held. */
int usmipc__peer_fetch_fd(usmipc__peer_t *peer, const usmipc__wire_t *w,
                          uint64_t tag, uint64_t deadline, int *fd);
/* The same for a handle of a run of chunks: its w->chunk_count descriptors,
 * in order, from the exporter's broker (the handle names only the first's
 * number, so pidfd_getfd cannot take the others). Lock NOT held. */
int usmipc__peer_fetch_run_fds(usmipc__peer_t *peer, const usmipc__wire_t *w,
                               uint64_t tag, uint64_t deadline, int *fds);
/* Takes the descriptors of w[0..n), all handles of peer's exporter with
 * USMIPC__WIRE_FLAG_FD, each of one descriptor (EINVAL otherwise: a run of
 * chunks is taken whole by usmipc__peer_fetch_run_fds), into fds[0..n),
 * with the checks of usmipc__peer_fetch_fd for each. pidfd and /proc take them
 * one by one (system calls, no exchange); the broker serves them in one
 * exchange per USMIPC__FDS_PER_REQUEST. All or nothing: on failure every
 * descriptor already taken is closed, fds[] holds -1, and the message names the
 * allocation that failed and why. Lock NOT held. */
int usmipc__peer_fetch_fds(usmipc__peer_t *peer, const usmipc__wire_t *const *w,
                           size_t n, uint64_t deadline, int *fds);
/* 0 when w's allocation is still exported by a living exporter, else
 * EEXPORTERGONE (or EBADHANDLE for a forged size) with a message. Reads
 * shared memory only: the cache-hit path calls it. */
int usmipc__peer_check(const usmipc__peer_t *peer, const usmipc__wire_t *w,
                       uint64_t tag, uint32_t *seq);
/* The same, quietly, for an idle mapping: 1 while its allocation is live. */
int usmipc__peer_slot_live(const usmipc__peer_t *peer, uint32_t slot,
                           uint64_t buffer_id, uint64_t tag);
/* The verified export table of the peer (valid while a reference is held). */
const uint8_t *usmipc__peer_table(const usmipc__peer_t *peer);
/* Registry lock held. */
void usmipc__peer_ref(usmipc__peer_t *peer);
void usmipc__peer_unref(usmipc__peer_t *peer);
/* Lock NOT held. */
void usmipc__peer_put(usmipc__peer_t *peer);
/* A pidfd of w's pid, proven to be w's exporter (its pidfs inode or start
 * time); USMIPC_EEXPORTERGONE when that process has exited (peers.c). Only
 * for a w of this PID namespace (usmipc__same_pid_namespace). */
int usmipc__exporter_pidfd(const usmipc__wire_t *w, int *out);
/* Whether the process of pidfd has exited, waiting up to wait_ms for it: 1
 * exited, 0 not (yet), -1 the poll failed. */
int usmipc__pidfd_exited(int pidfd, unsigned wait_ms);
/* Whether w's exporter (proven, as for an open) still holds its export-table
 * slot for (id, the tag of token, and *size unless size is NULL): *state 1
 * yes, 0 cleared (freed, or forged), -1 the exporter exited. Returns 0, or
 * the error of proving the exporter. Pool blocks and bundles check their
 * own slots so. */
int usmipc__peer_slot_state(const struct usmipc__wire *w, uint32_t slot,
                            uint64_t id, const uint8_t token[16],
                            const uint64_t *size, int *state);

/* ---- the export engine (export.c) ---------------------------------------- */

/* The allocation a pointer lies in: usmipc's own (a pool's segment, not the
 * block) or another library's (asked of the driver). */
typedef struct usmipc__allocation_ref {
  uint64_t buffer_id;
  uintptr_t base;
  size_t size;
  usmipc_device_t *device;
  bool chunked; /* one physical chunk of CUDA VMM memory (docs/cuda.md) */
  bool foreign; /* another library's: alloc is the driver's description */
  usmipc__allocation_t alloc;
} usmipc__allocation_ref_t;
int usmipc__allocation_of(const void *ptr, usmipc__allocation_ref_t *ref);
/* ---- the export engine (core/export.c) ----------------------------------
 * Registry lock held where said. */
/* The first export of a LOCAL region: payload, descriptor, slot. Lock
 * held. */
int usmipc__export_region(usmipc__region_t *r);
/* Checks that [ptr, ptr + *nbytes) of allocation a on device may be
 * exported; resolves *nbytes == 0 to the rest of the allocation and gives
 * ptr's offset in it. */
int usmipc__check_export(const void *ptr, usmipc_device_t *device,
                         const usmipc__allocation_t *a, size_t *offset,
                         size_t *nbytes);
/* The identity and range fields of a handle of allocation a. */
void usmipc__export_wire_fill(usmipc__wire_t *w, usmipc_device_t *device,
                              const usmipc__allocation_t *a, uint64_t buffer_id,
                              size_t offset, size_t nbytes);
/* A handle of memory another library allocated (lock NOT held). known:
 * the allocation as usmipc__allocation_of described it just before (its
 * driver query is not made again), or NULL. */
int usmipc__export_foreign(const void *ptr, size_t nbytes,
                           const usmipc__allocation_ref_t *known,
                           usmipc_ipc_handle_t **handle);
/* core/foreign_payloads.c: the driver payloads of foreign allocations,
 * kept by (buffer id, base, size, device) after their exports are gone, at
 * most 4096, the oldest dropped first. Registry lock held. */
bool usmipc__foreign_payload_find(uint64_t buffer_id, const void *base,
                                  size_t size, const usmipc_device_t *device,
                                  usmipc__payload_t *out);
void usmipc__foreign_payload_keep(uint64_t buffer_id, const void *base,
                                  size_t size, const usmipc_device_t *device,
                                  const usmipc__payload_t *payload);
size_t usmipc__foreign_payloads_count(void);
/* Drops one owner of a foreign export; the last revokes it. */
void usmipc__foreign_export_put(uint64_t foreign_id);
/* Whether a live foreign export of buffer_id at base has this slot and
 * token (a same-process open of its handle). Lock held. */
bool usmipc__foreign_export_current(uint64_t buffer_id, const void *base,
                                    uint32_t slot, const uint8_t token[16]);

/* ---- the import engine (import.c) ---------------------------------------- */

/* The steps of usmipc_ipc_open, for callers that open many handles at once
 * and fetch their descriptors together first (usmipc__open_wire is
 * usmipc__open_mapping without a prefetched descriptor). */
/* ---- the import engine (core/import.c) ---------------------------------- */
/* fork.c's hook of the import cache, in the child with the registry lock
 * held: its sweeper thread does not exist there. */
void usmipc__imports_fork_child(void);
/* Unmaps a list of regions linked by idle_next (lock NOT held). */
void usmipc__unmap_list(usmipc__region_t *list);
/* Maps w (a decoded memory handle) on device (NULL: the exporting device)
 * as usmipc_ipc_open does, without the ordering wait. prefetched_fd is -1
 * (the descriptor is fetched here when needed) or w's descriptor, taken
 * beforehand (usmipc__prefetch_fds); it is owned by the call: used for the
 * mapping, or closed (a cache hit, a same-process handle, any failure).
 * A handle of a run of chunks is never prefetched: its open fetches the
 * run's k descriptors itself, and closes a descriptor given unused. */
int usmipc__open_mapping(const usmipc__wire_t *w, usmipc_device_t *device,
                         size_t nbytes, int prefetched_fd, void **ptr,
                         size_t *mapped_nbytes);
/* 1 when w's allocation is mapped on device (NULL: the exporting device) in
 * this process's import cache, open or idle: an open then needs no
 * descriptor. A hint: the mapping may be dropped before the open. */
bool usmipc__import_cached(const usmipc__wire_t *w, usmipc_device_t *device);
/* Takes the descriptors that opening w[0..n) needs, w[i] of any exporter,
 * with one usmipc__peer_fetch_fds per exporter (so one broker exchange per
 * exporter and USMIPC__FDS_PER_REQUEST descriptors). fds[i] is -1 for a
 * handle that needs none (no USMIPC__WIRE_FLAG_FD, no export slot, or this
 * process's own) and for a handle of a run of chunks (chunk_count != 0),
 * which is not batched: usmipc__open_mapping fetches its run whole, in one
 * exchange of its own, as usmipc_ipc_open does. All or nothing: on failure
 * no descriptor is left open and the message names the handle that
 * failed. */
int usmipc__prefetch_fds(const usmipc__wire_t *const *w, size_t n,
                         uint64_t deadline, int *fds);
/* usmipc_ipc_open of a decoded memory handle, all of it, unordered. */
int usmipc__open_wire(const struct usmipc__wire *w, usmipc_device_t *device,
                      void **ptr);
/* Takes n more open references on the mapping (or same-process alias) at
 * ptr, each to be dropped by usmipc_ipc_close. */
int usmipc__mapping_addref(void *ptr, unsigned n);
/* Tests only (tests/c bundle_mapping_refs_do_not_wrap): reads (get) and
 * sets (set) the reference count of the open mapping at ptr, to start it
 * near a limit. */
int usmipc__mapping_refs_for_test(void *ptr, const uint64_t *set,
                                  uint64_t *get);

#endif /* USMIPC_CORE_H */
