/* The transport floor's private header: the export table and moving
 * descriptors between processes (Linux).
 *
 * Floor 3 of the core (src/linux/), beside the backends (src/backend/):
 * the export table (exports.c), dma-buf checks (dmabuf.c), the exporter's
 * broker (broker.c) and the importer's descriptor taking (fdtake.c). */
#ifndef USMIPC_TRANSPORT_H
#define USMIPC_TRANSPORT_H

#include "wire/wire.h"

#ifndef SYS_pidfd_getfd
#define SYS_pidfd_getfd 438
#endif
#ifndef SO_PEERPIDFD
#define SO_PEERPIDFD 77 /* Linux 6.5 */
#endif

/* ---- the export table (linux/exports.c) -----------------------------------
 * Which allocations this process still exports, shared read-only with
 * importers (see the file's comment for the layout and the protocol). */
/* A slot's tag: the first 8 bytes of MAC(process key, token). Importers
 * that hold the handle compute it; the table does not reveal the token. */
uint64_t usmipc__slot_tag(const uint8_t key[16], const uint8_t token[16]);
uint64_t usmipc__event_slot_tag(const uint8_t key[16], const uint8_t token[16]);
/* Exporter. */
int usmipc__exports_add(uint64_t buffer_id, uint32_t fd_number, uint64_t size,
                        uint64_t tag, uint32_t *slot,
                        uint32_t *table_fd_number);
void usmipc__exports_remove(uint32_t slot);
/* Rewrites a slot's size field: an event's slot counts its records there. */
void usmipc__exports_set_size(uint32_t slot, uint64_t size);
int usmipc__exports_table_fd(void);
/* The table's liveness mutex (the table is created if need be), which the
 * broker thread locks for the life of the process. */
pthread_mutex_t *usmipc__exports_alive_mutex(void);
/* Locks it from the calling thread, whose kernel tid is tid, and publishes
 * where its futex word is. */
int usmipc__exports_hold_alive(pthread_mutex_t *m, uint32_t tid);
/* Importer: maps a table descriptor read-only after checking that it is a
 * sealed table of the right size, owned by this uid, whose header names the
 * handle's exporter and carries a valid tag for the handle's key. */
int usmipc__table_map(int fd, const usmipc__wire_t *w, const uint8_t **hdr);
/* 1 while the exporter lives (its liveness word is held, not owner-died). */
int usmipc__table_alive(const uint8_t *hdr);
/* A consistent copy of a slot (seqlock); -1 if it stays mid-update,
 * USMIPC_EBADHANDLE (with a message) for a slot beyond the table. */
int usmipc__table_read_slot(const uint8_t *hdr, uint32_t slot,
                            usmipc__export_slot_t *out, uint32_t *seq);
uint32_t usmipc__table_slot_seq(const uint8_t *hdr, uint32_t slot);
/* fork.c's hooks of the export table. */
void usmipc__exports_fork_prepare(void);
void usmipc__exports_fork_parent(void);
void usmipc__exports_fork_child(void);

/* ---- the exporter's broker (broker.c) ------------------------------------ */

typedef struct usmipc__fd_grant {
  uint8_t token[16];
  uint32_t fd_number;
  uint64_t dev, ino;
  bool
      reopenable; /* a memfd: opening /proc/<pid>/fd/<n> yields the same file */
} usmipc__fd_grant_t;
/* Starts this process's broker if it is not running (it also holds the
 * export table's liveness mutex, so it starts on every first export). */
int usmipc__broker_serve(void);
/* Makes fd fetchable by importers that present a capability derived from
 * token (drawn here, returned in grant). fd is borrowed: the caller keeps
 * it open until it has called usmipc__broker_withdraw. may_reopen false
 * keeps importers off /proc/<pid>/fd even for a memfd (a backend whose
 * descriptors are dma-bufs, which do not reopen as themselves). */
int usmipc__broker_publish(int fd, uint64_t buffer_id, bool may_reopen,
                           usmipc__fd_grant_t *grant);
/* The same for nfds descriptors (at most USMIPC__CHUNKS_MAX: a run of
 * chunks) served together, in order, under one token; the grant names the
 * first. They are never reopenable. */
int usmipc__broker_publish_fds(const int *fds, uint32_t nfds,
                               uint64_t buffer_id, bool may_reopen,
                               usmipc__fd_grant_t *grant);
/* Stops serving buffer_id (on return the descriptor is no longer used). */
void usmipc__broker_withdraw(uint64_t buffer_id);
/* 1 when the exporter also listens in USMIPC_SOCKET_DIR. */
bool usmipc__broker_socket_dir(void);
/* Tests only: how long the broker waits between binding its socket file in
 * USMIPC_SOCKET_DIR and using it (0, the default: not at all), to widen the
 * window an attacker who can write the directory would race. */
extern unsigned usmipc__test_socket_bind_delay_ms;
/* The broker hands each release and forward request of this process to
 * the handler registered last (none: it answers as a handler with no
 * registry would), with the requester's pid as the kernel gave it when it
 * connected (SO_PEERCRED, in this process's PID namespace; 0 when it is not
 * visible there). The handler returns the reply's status and sets *word,
 * the reply's word 8 (a forward's minted ticket; else 0). */
typedef uint32_t (*usmipc__release_handler_t)(const uint8_t *req,
                                              const uint8_t *body, size_t len,
                                              uint32_t peer_pid,
                                              uint32_t *word);
void usmipc__broker_on_release(usmipc__release_handler_t handler);
/* fork.c's hooks of the broker. */
void usmipc__broker_fork_prepare(void);
void usmipc__broker_fork_parent(void);
void usmipc__broker_fork_child(void);

/* ---- the importer's descriptor taking (fdtake.c) ------------------------- */

typedef enum usmipc__transport {
  USMIPC__TRANSPORT_AUTO,
  USMIPC__TRANSPORT_SOCKET,
  USMIPC__TRANSPORT_PIDFD,
  USMIPC__TRANSPORT_PROCFD,
} usmipc__transport_t;
/* USMIPC_FD_TRANSPORT, or EINVAL with a message. */
int usmipc__transport_mode(usmipc__transport_t *mode);
/* Asks the exporter's broker for its table and/or the handle's descriptor,
 * after checking that the listener is the exporter (its credentials, its
 * pidfd) and before trusting an answer, that it proved the handle's key.
 * Received descriptors land in *table_fd / *data_fd (-1 when not asked);
 * for a handle of a run of chunks (w->chunk_count) data_fd is an array of
 * that many, filled in chunk order. */
int usmipc__broker_call(const usmipc__wire_t *w, unsigned want,
                        uint64_t deadline, int *table_fd, int *data_fd);
/* Sends a release signal (body: see usmipc__release_body_parse) to the
 * broker of w's exporter for w's release record, and awaits its answer. */
int usmipc__broker_release(const usmipc__wire_t *w, const uint8_t *body,
                           size_t len, uint64_t deadline);
/* Asks the broker of w's exporter for one more consumer of w's release
 * ticket (w->release_ticket, proven with w->release_token), with the
 * forwarder's nonce: *ticket receives the ticket minted for it (release.c,
 * "Forwarding"). */
int usmipc__broker_forward(const usmipc__wire_t *w, const uint8_t nonce[16],
                           uint64_t deadline, uint64_t *ticket);
/* Asks the broker of the exporter of w[0] for the descriptors of w[0..n)
 * (1 <= n <= USMIPC__FDS_PER_REQUEST, all of that exporter, each with
 * USMIPC__WIRE_FLAG_FD and of one piece: a run of chunks, whose descriptors
 * travel only together, is EINVAL here and refused by the broker) in one
 * request and one answer; fds[i] receives
 * w[i]'s descriptor. The broker serves all or none: on failure no
 * descriptor is left open, fds[] holds -1 and *failed names the entry the
 * broker refused (SIZE_MAX when the failure names none). The descriptors
 * are the broker's word only: the caller checks each one's identity. */
int usmipc__broker_fetch_fds(const usmipc__wire_t *const *w, size_t n,
                             uint64_t deadline, int *fds, size_t *failed);
/* EEXPORTERGONE for an exporter that has exited (errno e, or 0). */
int usmipc__fail_exporter_exited(const usmipc__wire_t *w, int e);
/* pidfd_getfd(2) of descriptor number n from the process of pidfd. */
int usmipc__pidfd_take(int pidfd, uint32_t pid, uint32_t n, int *out);
/* Reopens /proc/<pid>/fd/<n> without blocking on what it finds: opened
 * O_PATH, required to be a regular file, then reopened with flags. */
int usmipc__procfd_reopen(const usmipc__wire_t *w, uint32_t n, int flags,
                          int *out);
/* fork.c's hooks of the importer's kept connections (linux/fdtake.c). */
void usmipc__fdtake_fork_prepare(void);
void usmipc__fdtake_fork_parent(void);
void usmipc__fdtake_fork_child(void);

/* ---- dma-buf descriptors (dmabuf.c) -------------------------------------- */

/* ---- dma-buf descriptors (linux/dmabuf.c) ------------------------------- */
/* The size of the dma-buf behind fd: 0, or -EBADFD when fd is not a dma-buf,
 * or another negative errno. */
int usmipc__dmabuf_size(int fd, uint64_t *size);
/* 0 when fd is a dma-buf of at least min_size bytes; otherwise fails with
 * code and a message that starts with what. */
int usmipc__dmabuf_check(int fd, uint64_t min_size, int code, const char *what);

#endif /* USMIPC_TRANSPORT_H */
