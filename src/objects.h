/* The objects floor's private header: the library's objects, which the
 * public API is made of.
 *
 * Floor 5 of the core (the .c files directly in src/), in this order, each
 * file calling only those before it and the floors below: queue.c,
 * event.c, pool.c, release.c, memory.c, ipc.c, torch_allocator.c,
 * bundle.c, update.c. fork.c stands above them all (floor 6). */
#ifndef USMIPC_OBJECTS_H
#define USMIPC_OBJECTS_H

#include "core/core.h"

struct usmipc_queue {
  usmipc_device_t *device;
  void *native;
  bool wrapped; /* usmipc_queue_from_native: the native queue is not ours */
};

/* ---- events (event.c) ---------------------------------------------------- */

/* ---- events (event.c) -----------------------------------------------------
 */
/* Waits (on queue's device, or the host when queue is NULL) for the record
 * that event wire ew names, opening the event on device (cached). */
int usmipc__event_wait_wire(const usmipc__wire_t *ew, usmipc_device_t *device,
                            usmipc_queue_t *queue);
/* Records a fresh ring event of queue's device on queue and writes the
 * ordering record (0x8002) naming it into out (see usmipc__order_record);
 * returns its length in *len. */
int usmipc__event_order(usmipc_queue_t *queue, uint8_t *out, size_t *len);
int usmipc__event_ring_handle(usmipc_queue_t *queue, uint8_t *out, size_t *len);
/* event.c's lock, which also guards the release registry, and the event
 * wait limit (usmipc_event_set_timeout, USMIPC_EVENT_TIMEOUT_MS; 0: none),
 * which release waits share. */
extern pthread_mutex_t usmipc__events_lock;
unsigned long long usmipc__event_timeout_ms(void);
/* fork.c's hooks of events. */
void usmipc__events_fork_prepare(void);
void usmipc__events_fork_parent(void);
void usmipc__events_fork_child(void);

/* ---- pools (pool.c) ------------------------------------------------------ */

/* ---- pools (pool.c) --------------------------------------------------------
 */
/* usmipc_free of a pointer in a pool segment (region->pool_segment). */
int usmipc__pool_free(void *segment, void *ptr);
/* The block record (0x8101, 4 + 48 bytes into rec) of the block holding ptr,
 * exporting the block's slot the first time; resolves *nbytes == 0 to the
 * rest of the block and checks the range. */
int usmipc__pool_export(void *segment, const void *ptr, size_t *nbytes,
                        uint8_t *rec, size_t *rec_len);
/* Describes the block holding ptr (base, size, buffer id): 0, or
 * USMIPC_EUNKNOWNPTR for a pointer in no live block of the segment. */
int usmipc__pool_query(void *segment, const void *ptr,
                       usmipc_pointer_info_t *info);
/* 1 while the block w's record names is allocated (same process). */
int usmipc__pool_block_live(void *segment, const usmipc__wire_t *w);
/* The token whose usmipc__slot_tag a block's export slot holds: the block
 * record's token bound to the segment (its buffer id), the block's offset
 * and size, so that a record opens only the block it was issued for. */
void usmipc__pool_block_slot_token(const uint8_t token[16], uint64_t segment_id,
                                   uint64_t offset, uint64_t size,
                                   uint8_t out[16]);
/* The pool's free space: bytes and ranges (a test hook: after every block
 * is freed, one range per segment holding all its bytes). */
void usmipc__pool_free_space(usmipc_pool_t *pool, size_t *bytes,
                             size_t *ranges);
/* fork.c's hooks of pools. */
void usmipc__pools_fork_prepare(void);
void usmipc__pools_fork_parent(void);
void usmipc__pools_fork_child(void);

/* Release signals (release.c): a producer's handle hands out tickets (record
 * 0x8003); consumers return them through the producer's broker with an
 * event of their own, which the producer waits for. */
/* The owner (a handle, a bundle) keeps a usmipc__release_t * field, NULL
 * until its first ticket, and passes its address: the registry is made on
 * the first ticket and published whole, so that the counts and the wait may
 * run on other threads meanwhile (they see none, or all of it). */
void usmipc__release_free(usmipc__release_t *rel);
/* The most consumer processes one handoff may go to (a fan-out). */
#define USMIPC__FANOUT_MAX 4096u
/* A new ticket of *slot's registry (made on the first): writes record
 * 0x8003 (4 + 32 bytes) at out and adds its length to *len. consumers: how
 * many processes receive this handoff (a fan-out), each of which returns
 * the ticket once; the wait waits for all of them (1: the usual ticket). */
int usmipc__release_ticket(usmipc__release_t **slot, uint8_t *out, size_t *len,
                           unsigned consumers);
/* Tickets handed out and come back (0 and 0 before the first). */
void usmipc__release_counts(usmipc__release_t *const *slot, uint64_t *sent,
                            uint64_t *released);
/* The registry's id, its release key (usmipc_releases_wait); 0 before the
 * first ticket. */
uint64_t usmipc__release_key(usmipc__release_t *const *slot);
/* Waits for every ticket handed out so far (none: returns 0 at once). */
int usmipc__release_wait(usmipc__release_t *const *slot, usmipc_queue_t *queue);
/* Consumer: returns the ticket of decoded handoff records w (has_release),
 * after the work queued on queue so far (NULL: now), as usmipc_ipc_release
 * does for the bytes they came from. */
int usmipc__release_send(const usmipc__wire_t *w, usmipc_queue_t *queue);
/* The broker's side: a release request (header req, body of len bytes)
 * for this process from process peer_pid (0: unknown); returns the reply
 * status (0 accepted). Registered with the broker
 * (usmipc__broker_on_release) at the first registry. */
uint32_t usmipc__release_arrived(const uint8_t *req, const uint8_t *body,
                                 size_t len, uint32_t peer_pid);
/* A forward request (WANT_FORWARD, body u64 ticket) from process peer_pid:
 * the reply status, and in *word the ticket minted for one more consumer
 * (release.c, "Forwarding"). */
uint32_t usmipc__release_forward_arrived(const uint8_t *req,
                                         const uint8_t *body, size_t len,
                                         uint32_t peer_pid, uint32_t *word);
/* The broker's handler (usmipc__release_handler_t): either of the two. */
uint32_t usmipc__release_request(const uint8_t *req, const uint8_t *body,
                                 size_t len, uint32_t peer_pid, uint32_t *word);
/* fork.c's hook: the child forgets the parent's registries. */
void usmipc__releases_fork_child(void);

/* ---- handles (ipc.c) ----------------------------------------------------- */

/* An unordered handle of the whole allocation at base (a pool segment as
 * a whole, without a block record); for memory in chunks, of the whole run
 * of chunks under [base, base + nbytes). Fills ref's id, base and size
 * from the handle. known: what usmipc__allocation_of said of base just
 * before (another library's memory is then not asked of the driver
 * again), or NULL. */
int usmipc__export_allocation(const void *base, size_t nbytes,
                              const usmipc__allocation_ref_t *known,
                              usmipc_ipc_handle_t **handle,
                              usmipc__allocation_ref_t *ref);

/* ---- the PyTorch allocator (torch_allocator.c) ----------------------------
 * usmipc_torch_* on any backend's device ordinal (the public calls are the
 * CUDA ones): the C tests drive the host's pools with these. */
void *usmipc__torch_malloc_on(usmipc_backend_t backend, ssize_t size,
                              int ordinal, void *stream);
void usmipc__torch_free_on(usmipc_backend_t backend, void *ptr, int ordinal,
                           void *stream);
int usmipc__torch_pool_for(usmipc_backend_t backend, int ordinal,
                           usmipc_pool_t **pool);
int usmipc__torch_synchronize_on(usmipc_backend_t backend, int ordinal);
/* fork.c's hooks of the PyTorch allocator. */
void usmipc__torch_fork_prepare(void);
void usmipc__torch_fork_parent(void);
void usmipc__torch_fork_child(void);

/* ---- bundles (bundle.c) -------------------------------------------------- */

/* fork.c's hooks of the bundles this process exports. */
void usmipc__bundles_fork_prepare(void);
void usmipc__bundles_fork_parent(void);
void usmipc__bundles_fork_child(void);
/* Tests: how many decoded trees the opens keep, and the bytes they hold
 * (*bytes, if not NULL). */
size_t usmipc__bundle_templates_for_test(size_t *bytes);

/* ---- bundles (bundle.c) --------------------------------------------------
 * For update.c: ob, an open of earlier bytes of one bundle, takes the
 * handoff of data when data is the same bundle's next handoff (only the
 * event and the ticket after the tree differ): the bundle is checked to be
 * still shared and the producer's work waited for on queue (unless flags
 * has USMIPC_OPEN_UNORDERED), and ob carries data's records from then on.
 * 1 when so, 0 when data is not such bytes (open them anew), else an error
 * code (ob unchanged). Its mappings are those already held: a warm update
 * neither decodes the tree nor looks up an allocation. */
int usmipc__bundle_reuse(usmipc_opened_bundle_t *ob, const void *data,
                         size_t len, usmipc_queue_t *queue, unsigned flags);

#endif /* USMIPC_OBJECTS_H */
