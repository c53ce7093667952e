/* Release signals: a consumer tells the producer it is done with what a
 * handoff gave it.
 *
 * Objects floor of the core, above event.c (a returned ticket carries a
 * consumer's event, which the producer waits for) and below ipc.c and
 * bundle.c (handles and bundles hand out the tickets). The broker
 * (linux/broker.c) moves release requests to usmipc__release_arrived, which
 * this module registers with it at its first ticket: the transport names no
 * object.
 *
 * The producer's handle hands out tickets (record 0x8003, one per ordered
 * handoff); a consumer returns its ticket to the producer's broker
 * (usmipc__broker_release) with the handle of an event of its own, recorded
 * after its work on its queue (none for the host, or when it releases from
 * the host). The broker checks the capability (a MAC keyed by the ticket's
 * own token, which only holders of that handoff's bytes know) and files the
 * ticket; the producer's usmipc_ipc_handle_wait_released waits until every
 * ticket came back, then for the consumers' events, on the device where it
 * can. Each ticket counts once, however often it is returned.
 *
 * Fan-out: one handoff's bytes may go to N consumer processes at once
 * (tensor-parallel ranks). Its ticket then expects N returns, one per
 * process: the broker says which process sent each (SO_PEERCRED), a
 * process's second return of it counts for nothing, and the wait waits
 * for all N (and each one's event). A return whose process the broker
 * cannot see (another PID namespace: pid 0) counts each time.
 *
 * Locks: the registry lives under event.c's usmipc__events_lock (its place
 * in the lock order: fork.c). */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "objects.h"
#include "util/blake2s.h"

#define RELEASE_BUCKETS 64

/* Under usmipc__events_lock: every live registry, and the consumers whose
 * returned tickets' events are still pending. */
static usmipc__release_t *releases[RELEASE_BUCKETS];
typedef struct consumer consumer_t;
static consumer_t *consumers;

/* A returned ticket's consumer event, waited for by wait_released until it
 * is known complete. A consumer that exits takes its device work with it
 * (the driver tears its contexts down as the process's descriptors close),
 * so its event then has nothing left to wait for; but an event of an exited
 * process can no longer be opened, and an export table's owner-died mark
 * appears before the process's descriptors are closed. So each consumer is
 * pinned, when its ticket arrives and it lives, by a pidfd (one per
 * process, shared by its tickets): a consumer whose event cannot be opened
 * or waited for any more is done once that pidfd says it exited, and
 * waited for until then. Without a pidfd (another PID namespace, a kernel
 * without pidfd_open) the exporter-gone answer itself counts as the exit. */
struct consumer {
  uint32_t pid;
  uint64_t nonce;
  int pidfd;
  unsigned refs; /* under usmipc__events_lock */
  struct consumer *next;
};

struct pending {
  uint8_t *bytes; /* a consumer's event handle */
  size_t len;
  consumer_t *consumer; /* NULL: no pidfd (see above) */
  bool exited;          /* the consumer had exited when its ticket came */
  bool self;            /* an event of this process */
  bool complete;        /* known complete: off the list; usmipc__events_lock */
  unsigned refs; /* the registry's list and waiters; usmipc__events_lock */
};

/* A fan-out ticket whose returns are not all in yet: which processes
 * returned it so far. */
typedef struct fanout {
  uint64_t ticket;
  uint32_t need, got;
  struct fanout *next;
  uint32_t pids[]; /* got of them */
} fanout_t;

/* A ticket a forward minted, and its token (derived from its parent's:
 * usmipc__forward_token), kept until it comes back. */
typedef struct minted {
  uint64_t ticket;
  uint8_t token[16];
} minted_t;

struct usmipc__release {
  uint64_t id;
  uint8_t secret[16];      /* keys each ticket's own token (ticket_token) */
  uint64_t sent, released; /* returns expected, and come back */
  uint64_t tickets;        /* the last ticket number handed out */
  fanout_t *fanouts;       /* fan-out tickets not yet all returned */
  uint8_t *returned;       /* bit t-1: ticket t came back */
  uint8_t *forwarded;      /* bit t-1: ticket t was minted by a forward */
  size_t returned_bytes;   /* of each of the two maps */
  minted_t *minted;        /* forwarded tickets not yet come back */
  size_t nminted, cap_minted;
  struct pending **pending; /* events not yet known complete */
  size_t npending, cap_pending;
  pthread_cond_t cond;
  struct usmipc__release *next;
};

/* The log of registries that had every ticket back (usmipc_releases_wait):
 * done_log[s % DONE_LOG] is the key of completion s, done_seq the next
 * one's number; done_cond wakes its readers. Under usmipc__events_lock. */
#define DONE_LOG 4096u
static uint64_t done_log[DONE_LOG];
static uint64_t done_seq;
static pthread_cond_t done_cond;
static pthread_once_t done_once = PTHREAD_ONCE_INIT;
static bool done_ready; /* done_cond made */

static void done_cond_init(void) {
  done_ready = true;
  pthread_condattr_t attr;
  pthread_condattr_init(&attr);
  pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
  pthread_cond_init(&done_cond, &attr);
  pthread_condattr_destroy(&attr);
}

/* r's last outstanding ticket came back: log it; usmipc__events_lock held. */
static void done_log_add(const usmipc__release_t *r) {
  pthread_once(&done_once, done_cond_init);
  done_log[done_seq % DONE_LOG] = r->id;
  done_seq++;
  pthread_cond_broadcast(&done_cond);
}

int usmipc_releases_wait(uint64_t *seq, uint64_t *keys, size_t cap,
                         size_t *count, int *missed,
                         unsigned long long timeout_ms) {
  if (seq == NULL || count == NULL || missed == NULL ||
      (keys == NULL && cap != 0))
    return usmipc__fail(USMIPC_EINVAL,
                        "usmipc_releases_wait: seq, count and missed must "
                        "not be NULL, nor keys when cap is not 0");
  *count = 0;
  *missed = 0;
  pthread_once(&done_once, done_cond_init);
  uint64_t until = usmipc__now_ns() + timeout_ms * 1000000u;
  pthread_mutex_lock(&usmipc__events_lock);
  /* A wait is cut into slices of at most 50 ms, so that an interrupt is
   * seen; the interrupt hook runs without the lock (release.c's wait says
   * why). */
  while (done_seq == *seq && timeout_ms != 0) {
    uint64_t now = usmipc__now_ns();
    if (now >= until)
      break;
    uint64_t slice = until - now < 50000000u ? until : now + 50000000u;
    struct timespec ts = {(time_t)(slice / 1000000000u),
                          (long)(slice % 1000000000u)};
    pthread_cond_timedwait(&done_cond, &usmipc__events_lock, &ts);
    if (done_seq == *seq) {
      pthread_mutex_unlock(&usmipc__events_lock);
      int stop = usmipc__interrupted();
      pthread_mutex_lock(&usmipc__events_lock);
      if (stop != 0 && done_seq == *seq) {
        pthread_mutex_unlock(&usmipc__events_lock);
        return usmipc__fail(USMIPC_EINTR,
                            "interrupted while waiting for releases");
      }
    }
  }
  if (*seq > done_seq || done_seq - *seq > DONE_LOG) {
    *missed = 1; /* fallen behind the log, or a seq from before a fork */
    *seq = done_seq;
  } else {
    size_t n = 0;
    for (; n < cap && *seq + n < done_seq; n++)
      keys[n] = done_log[(*seq + n) % DONE_LOG];
    *seq += n;
    *count = n;
  }
  pthread_mutex_unlock(&usmipc__events_lock);
  return 0;
}

uint64_t usmipc__release_key(usmipc__release_t *const *slot) {
  usmipc__release_t *r = __atomic_load_n(slot, __ATOMIC_ACQUIRE);
  return r != NULL ? r->id : 0;
}

static int release_new(usmipc__release_t **out) {
  usmipc__release_t *r = calloc(1, sizeof(*r));
  if (r == NULL)
    return usmipc__fail(USMIPC_ENOMEM, "out of memory");
  int rc = usmipc__random(r->secret, 16);
  if (rc == 0) {
    /* Consumers return tickets to the broker, which hands them here. */
    usmipc__broker_on_release(usmipc__release_request);
    rc = usmipc__broker_serve();
  }
  if (rc != 0) {
    free(r);
    return rc;
  }
  pthread_condattr_t attr;
  pthread_condattr_init(&attr);
  pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
  pthread_cond_init(&r->cond, &attr);
  pthread_condattr_destroy(&attr);
  r->id = usmipc__new_buffer_id();
  pthread_mutex_lock(&usmipc__events_lock);
  r->next = releases[r->id % RELEASE_BUCKETS];
  releases[r->id % RELEASE_BUCKETS] = r;
  pthread_mutex_unlock(&usmipc__events_lock);
  *out = r;
  return 0;
}

/* Drops a reference to a pending event, and to its consumer with the last;
 * usmipc__events_lock held. */
static void pending_drop(struct pending *p) {
  if (--p->refs != 0)
    return;
  consumer_t *c = p->consumer;
  if (c != NULL && --c->refs == 0) {
    for (consumer_t **l = &consumers; *l; l = &(*l)->next)
      if (*l == c) {
        *l = c->next;
        break;
      }
    close(c->pidfd);
    free(c);
  }
  free(p->bytes);
  free(p);
}

/* The consumer record of event wire w's process, with a reference: found,
 * or made with a pidfd proven to be that process. NULL when there is none
 * to make (another PID namespace, no pidfd_open); *exited when the process
 * has exited already. usmipc__events_lock held; the proof is a pidfd_open and a
 * read of /proc, no talk with the consumer. */
static consumer_t *consumer_get(const usmipc__wire_t *w, bool *exited) {
  *exited = false;
  for (consumer_t *c = consumers; c; c = c->next)
    if (c->pid == w->pid && c->nonce == w->nonce) {
      c->refs++;
      return c;
    }
  if (!usmipc__same_pid_namespace(w))
    return NULL;
  int pidfd;
  int rc = usmipc__exporter_pidfd(w, &pidfd);
  if (rc != 0) {
    *exited = rc == USMIPC_EEXPORTERGONE;
    return NULL;
  }
  consumer_t *c = malloc(sizeof(*c));
  if (c == NULL) {
    close(pidfd);
    return NULL;
  }
  *c = (consumer_t){w->pid, w->nonce, pidfd, 1, consumers};
  consumers = c;
  return c;
}

void usmipc__release_free(usmipc__release_t *r) {
  if (r == NULL)
    return;
  pthread_mutex_lock(&usmipc__events_lock);
  for (usmipc__release_t **l = &releases[r->id % RELEASE_BUCKETS]; *l;
       l = &(*l)->next)
    if (*l == r) {
      *l = r->next;
      break;
    }
  for (size_t i = 0; i < r->npending; i++)
    pending_drop(r->pending[i]);
  pthread_mutex_unlock(&usmipc__events_lock);
  free(r->pending);
  free(r->returned);
  free(r->forwarded);
  free(r->minted);
  while (r->fanouts != NULL) {
    fanout_t *f = r->fanouts;
    r->fanouts = f->next;
    free(f);
  }
  pthread_cond_destroy(&r->cond);
  free(r);
}

/* Ticket t's own token: MAC(registry secret, label || id || t). A holder
 * of one handoff's bytes knows only its ticket's token, and the broker
 * recomputes the token of the ticket a request names, so edited bytes that
 * name another ticket (the number changed, the checksum recomputed) prove
 * nothing: tests/c test_event.c event_release_ticket_own_capability. */
static void ticket_token(const usmipc__release_t *r, uint64_t ticket,
                         uint8_t out[16]) {
  uint8_t msg[16 + 8 + 8];
  memcpy(msg, "usmipc-ticket--2", 16);
  usmipc__put64le(msg + 16, r->id);
  usmipc__put64le(msg + 24, ticket);
  usmipc__mac(out, r->secret, msg, sizeof(msg));
}

int usmipc__release_ticket(usmipc__release_t **slot, uint8_t *out, size_t *len,
                           unsigned nconsumers) {
  if (nconsumers == 0 || nconsumers > USMIPC__FANOUT_MAX)
    return usmipc__fail(USMIPC_EINVAL,
                        "a handoff goes to 1 to %u consumer processes, not "
                        "%u",
                        USMIPC__FANOUT_MAX, nconsumers);
  fanout_t *f = NULL;
  if (nconsumers > 1 &&
      (f = calloc(1, sizeof(*f) + nconsumers * sizeof(uint32_t))) == NULL)
    return usmipc__fail(USMIPC_ENOMEM, "out of memory");
  usmipc__release_t *r = __atomic_load_n(slot, __ATOMIC_ACQUIRE);
  if (r == NULL) {
    int rc = release_new(&r);
    if (rc != 0) {
      free(f);
      return rc;
    }
    usmipc__release_t *none = NULL;
    if (!__atomic_compare_exchange_n(slot, &none, r, false, __ATOMIC_ACQ_REL,
                                     __ATOMIC_ACQUIRE)) {
      usmipc__release_free(r); /* another thread's came first */
      r = none;
    }
  }
  pthread_mutex_lock(&usmipc__events_lock);
  uint64_t ticket = ++r->tickets;
  r->sent += nconsumers;
  if (f != NULL) {
    f->ticket = ticket;
    f->need = nconsumers;
    f->next = r->fanouts;
    r->fanouts = f;
  }
  pthread_mutex_unlock(&usmipc__events_lock);
  usmipc__put16le(out, USMIPC__EXT_RELEASE);
  usmipc__put16le(out + 2, USMIPC__RELEASE_RECORD_LEN);
  usmipc__put64le(out + 4, r->id);
  usmipc__put64le(out + 12, ticket);
  ticket_token(r, ticket, out + 20);
  *len += 4 + USMIPC__RELEASE_RECORD_LEN;
  return 0;
}

void usmipc__release_counts(usmipc__release_t *const *slot, uint64_t *sent,
                            uint64_t *released) {
  usmipc__release_t *r = __atomic_load_n(slot, __ATOMIC_ACQUIRE);
  pthread_mutex_lock(&usmipc__events_lock);
  if (sent)
    *sent = r ? r->sent : 0;
  if (released)
    *released = r ? r->released : 0;
  pthread_mutex_unlock(&usmipc__events_lock);
}

/* The fan-out record of ticket t, or NULL for a plain ticket (or one
 * whose returns are all in). usmipc__events_lock held. */
static fanout_t **fanout_of(usmipc__release_t *r, uint64_t ticket) {
  fanout_t **l = &r->fanouts;
  while (*l != NULL && (*l)->ticket != ticket)
    l = &(*l)->next;
  return l;
}

/* Whether a return of ticket t from process pid counts: a plain ticket's
 * first return; a fan-out ticket's first from each process (pid 0, a
 * process the broker cannot see: every time). returned: t's bit. */
static bool return_counts(usmipc__release_t *r, uint64_t ticket, uint32_t pid,
                          bool returned) {
  if (returned)
    return false;
  fanout_t *f = *fanout_of(r, ticket);
  for (uint32_t i = 0; f != NULL && pid != 0 && i < f->got; i++)
    if (f->pids[i] == pid)
      return false;
  return true;
}

/* Files a counted return of ticket t from pid; true when the ticket is then
 * done with (a plain one at once, a fan-out one at its last return, which
 * forgets its record). */
static bool return_filed(usmipc__release_t *r, uint64_t ticket, uint32_t pid) {
  fanout_t **l = fanout_of(r, ticket), *f = *l;
  if (f == NULL)
    return true;
  f->pids[f->got++] = pid;
  if (f->got < f->need)
    return false;
  *l = f->next;
  free(f);
  return true;
}

/* Room in both maps for ticket t's bit; false when out of memory.
 * usmipc__events_lock held. */
static bool maps_room(usmipc__release_t *r, uint64_t ticket) {
  size_t byte = (size_t)((ticket - 1) / 8);
  if (byte < r->returned_bytes)
    return true;
  size_t n =
      byte + 1 > 2 * r->returned_bytes ? byte + 1 : 2 * r->returned_bytes;
  uint8_t *a = realloc(r->returned, n);
  if (a == NULL)
    return false;
  r->returned = a;
  uint8_t *b = realloc(r->forwarded, n);
  if (b == NULL)
    return false; /* returned_bytes unchanged: both still that long */
  r->forwarded = b;
  memset(a + r->returned_bytes, 0, n - r->returned_bytes);
  memset(b + r->returned_bytes, 0, n - r->returned_bytes);
  r->returned_bytes = n;
  return true;
}

static bool map_bit(const uint8_t *map, size_t bytes, uint64_t ticket) {
  size_t byte = (size_t)((ticket - 1) / 8);
  return byte < bytes && (map[byte] & (1u << ((ticket - 1) % 8))) != 0;
}

static minted_t *minted_find(usmipc__release_t *r, uint64_t ticket) {
  for (size_t i = 0; i < r->nminted; i++)
    if (r->minted[i].ticket == ticket)
      return &r->minted[i];
  return NULL;
}

/* Ticket t's token into out: its own (ticket_token), or for a forwarded
 * one the token kept when it was minted. false for a forwarded ticket that
 * came back already (its token is forgotten). usmipc__events_lock held. */
static bool token_of(usmipc__release_t *r, uint64_t ticket, uint8_t out[16]) {
  if (!map_bit(r->forwarded, r->returned_bytes, ticket)) {
    ticket_token(r, ticket, out);
    return true;
  }
  minted_t *m = minted_find(r, ticket);
  if (m == NULL)
    return false;
  memcpy(out, m->token, 16);
  return true;
}

static bool minted_grow(usmipc__release_t *r) {
  size_t n = r->cap_minted ? 2 * r->cap_minted : 8;
  minted_t *grown = realloc(r->minted, n * sizeof(*grown));
  if (grown == NULL)
    return false;
  r->minted = grown;
  r->cap_minted = n;
  return true;
}

uint32_t usmipc__release_request(const uint8_t *req, const uint8_t *body,
                                 size_t len, uint32_t peer_pid,
                                 uint32_t *word) {
  *word = 0;
  if (usmipc__get32le(req + 12) == USMIPC__WANT_FORWARD)
    return usmipc__release_forward_arrived(req, body, len, peer_pid, word);
  return usmipc__release_arrived(req, body, len, peer_pid);
}

/* Forwarding: a consumer that holds what a handoff gave it hands the same
 * bytes on to one more process (torch.multiprocessing puts a received
 * tensor again). The producer must then wait for that process too, so the
 * forwarder first asks the producer's broker for a ticket of its own for
 * it, proving the ticket it holds (its token). The new ticket's token is
 * derived from the held one and a random nonce the forwarder sent with
 * its request (usmipc__forward_token), so the forwarder writes it into
 * the bytes it hands on, and only it and the producer know it: another
 * holder of the held ticket's bytes (a fan-out's sibling) cannot return
 * the new ticket early (event_release_forward). A forward is refused once the
 * ticket it names came back from the asking process (or from every consumer of
 * a fan-out): the memory may then be reused. A forwarded ticket is an ordinary
 * one-consumer ticket, forwardable in turn. */
uint32_t usmipc__release_forward_arrived(const uint8_t *req,
                                         const uint8_t *body, size_t len,
                                         uint32_t peer_pid, uint32_t *word) {
  *word = 0;
  if (len != USMIPC__FORWARD_BODY_LEN)
    return USMIPC__REPLY_BAD_REQUEST;
  uint64_t ticket = usmipc__get64le(body);
  uint64_t id = usmipc__get64le(req + 24);
  uint32_t status;
  pthread_mutex_lock(&usmipc__events_lock);
  usmipc__release_t *r = releases[id % RELEASE_BUCKETS];
  while (r != NULL && r->id != id)
    r = r->next;
  uint8_t token[16], cap[16];
  if (r == NULL) {
    status = USMIPC__REPLY_UNKNOWN_BUFFER;
  } else if (ticket == 0 || ticket > r->tickets) {
    status = USMIPC__REPLY_BAD_REQUEST;
  } else if (map_bit(r->returned, r->returned_bytes, ticket) ||
             !token_of(r, ticket, token)) {
    status = USMIPC__REPLY_RELEASED;
  } else if (usmipc__forward_capability(req, token, body, len, cap),
             !usmipc__ct_equal(cap, req + 64, 16)) {
    status = USMIPC__REPLY_BAD_CAPABILITY;
  } else if (!return_counts(r, ticket, peer_pid, false)) {
    status = USMIPC__REPLY_RELEASED; /* this process's return is in */
  } else if (r->nminted >= USMIPC__FORWARDS_MAX || r->tickets >= UINT32_MAX) {
    status = USMIPC__REPLY_TOO_MANY;
  } else if (!maps_room(r, r->tickets + 1) ||
             (r->nminted == r->cap_minted && !minted_grow(r))) {
    status = USMIPC__REPLY_TOO_MANY; /* out of memory */
  } else {
    uint64_t t = ++r->tickets;
    r->sent++;
    minted_t *m = &r->minted[r->nminted++];
    m->ticket = t;
    usmipc__forward_token(token, r->id, t, body + 8, m->token);
    r->forwarded[(t - 1) / 8] |= (uint8_t)(1u << ((t - 1) % 8));
    *word = (uint32_t)t;
    status = USMIPC__REPLY_OK;
  }
  pthread_mutex_unlock(&usmipc__events_lock);
  return status;
}

uint32_t usmipc__release_arrived(const uint8_t *req, const uint8_t *body,
                                 size_t len, uint32_t peer_pid) {
  enum { OK = 0, UNKNOWN = 1, BAD_CAPABILITY = 2, BAD_REQUEST = 4 };
  uint64_t ticket;
  const uint8_t *ev;
  size_t ev_len;
  usmipc__wire_t w;
  if (usmipc__release_body_check(body, len, &ticket, &ev, &ev_len, &w) != 0)
    return BAD_REQUEST;
  uint8_t *copy = NULL;
  if (ev != NULL && (copy = malloc(ev_len)) == NULL)
    return BAD_REQUEST;
  if (copy)
    memcpy(copy, ev, ev_len);
  uint64_t id = usmipc__get64le(req + 24);
  uint32_t status = UNKNOWN;
  pthread_mutex_lock(&usmipc__events_lock);
  usmipc__release_t *r = releases[id % RELEASE_BUCKETS];
  while (r != NULL && r->id != id)
    r = r->next;
  /* The capability is the MAC of the request under the token of the
   * ticket it names (a never-issued number is refused first, as before). */
  uint8_t token[16], cap[16];
  bool known = false; /* the ticket's token is known */
  if (r != NULL && ticket <= r->tickets && (known = token_of(r, ticket, token)))
    usmipc__release_capability(req, token, body, len, cap);
  if (r == NULL) {
    status = UNKNOWN;
  } else if (ticket > r->tickets) {
    status = BAD_REQUEST;
  } else if (!known) {
    /* A forwarded ticket back again: it came back already, and counted
     * then (each ticket counts once, however often it is returned). */
    status = OK;
  } else if (!usmipc__ct_equal(cap, req + 64, 16)) {
    status = BAD_CAPABILITY;
  } else {
    status = OK;
    size_t byte = (size_t)((ticket - 1) / 8);
    if (!maps_room(r, ticket)) {
      status = BAD_REQUEST;
      goto out;
    }
    uint8_t bit = (uint8_t)(1u << ((ticket - 1) % 8));
    if (return_counts(r, ticket, peer_pid, r->returned[byte] & bit)) {
      if (copy != NULL) {
        if (r->npending == r->cap_pending) {
          size_t n = r->cap_pending ? 2 * r->cap_pending : 8;
          struct pending **grown = realloc(r->pending, n * sizeof(*grown));
          if (grown == NULL) {
            status = BAD_REQUEST;
            goto out;
          }
          r->pending = grown;
          r->cap_pending = n;
        }
        struct pending *p = calloc(1, sizeof(*p));
        if (p == NULL) {
          status = BAD_REQUEST;
          goto out;
        }
        const usmipc__process_t *self = usmipc__self_basic();
        p->bytes = copy;
        p->len = ev_len;
        p->refs = 1;
        p->self = w.pid == self->pid && w.nonce == self->nonce;
        /* Pinned now, while the consumer waits for this answer (alive). */
        if (!p->self)
          p->consumer = consumer_get(&w, &p->exited);
        r->pending[r->npending++] = p;
        copy = NULL;
      }
      if (return_filed(r, ticket, peer_pid)) {
        r->returned[byte] |= bit;
        minted_t *m = r->forwarded[byte] & bit ? minted_find(r, ticket) : NULL;
        if (m != NULL) /* its token is no longer needed */
          *m = r->minted[--r->nminted];
      }
      r->released++;
      pthread_cond_broadcast(&r->cond);
      if (r->released == r->sent)
        done_log_add(r);
    }
  }
out:
  pthread_mutex_unlock(&usmipc__events_lock);
  free(copy);
  return status;
}

/* Waits until the consumer of p has exited (its pidfd polls readable), for
 * an event that can no longer be opened or waited for; the wait's limit and
 * Ctrl-C end it. rc is the error that sent us here: returned as it is where
 * no exit can be seen (the event is this process's own). 0 once the
 * consumer has exited. */
static int consumer_wait_exit(const struct pending *p, int rc,
                              unsigned long long limit_ms, uint64_t start) {
  if (p->self)
    return rc;
  if (p->consumer == NULL)
    return 0; /* no pidfd: exporter-gone is all there is to see */
  char said[256];
  snprintf(said, sizeof(said), "%s", usmipc_last_error());
  for (;;) {
    int e = usmipc__pidfd_exited(p->consumer->pidfd, 50);
    if (e == 1)
      return 0;
    if (e < 0)
      return usmipc__fail_native(usmipc__errno_code(errno), errno,
                                 "polling the pidfd of process %u failed: %s",
                                 p->consumer->pid, strerror(errno));
    if (usmipc__interrupted())
      return usmipc__fail(USMIPC_EINTR, "interrupted while waiting for "
                                        "releases");
    if (limit_ms != 0 && (usmipc__now_ns() - start) / 1000000u >= limit_ms)
      return usmipc__fail(USMIPC_ETIMEDOUT,
                          "timed out after %llu ms waiting for process %u, "
                          "which returned a release ticket: its event can "
                          "no longer be waited for (%s), and the process "
                          "has not exited, so its work may still use the "
                          "memory",
                          limit_ms, p->consumer->pid, said);
  }
}

/* Waits for one consumer's event: on queue's device, or the host. *complete
 * when the event is known complete (or its consumer exited): it need never
 * be waited for again. */
static int pending_wait(const struct pending *p, usmipc_queue_t *queue,
                        unsigned long long limit_ms, uint64_t start,
                        bool *complete) {
  *complete = false;
  if (p->exited) {
    *complete = true;
    return 0;
  }
  usmipc_event_t *ev;
  int rc = usmipc_ipc_open_event(p->bytes, p->len, queue ? queue->device : NULL,
                                 &ev);
  if (rc == 0) {
    rc = queue ? usmipc_event_wait(ev, queue) : usmipc_event_synchronize(ev);
    if (rc == 0)
      *complete = queue == NULL || usmipc_event_query(ev) == 0;
    usmipc_event_destroy(ev);
  }
  if (rc == 0 || p->self)
    return rc;
  /* Could not open or wait: the consumer exited (or is exiting), or its
   * event is gone while it lives. Exited, its work can no longer touch the
   * memory; alive, it is waited for until it exits. */
  if (rc != USMIPC_EEXPORTERGONE &&
      (p->consumer == NULL || usmipc__pidfd_exited(p->consumer->pidfd, 0) != 1))
    return rc;
  rc = consumer_wait_exit(p, rc, limit_ms, start);
  *complete = rc == 0;
  return rc;
}

int usmipc__release_wait(usmipc__release_t *const *slot,
                         usmipc_queue_t *queue) {
  usmipc__release_t *r = __atomic_load_n(slot, __ATOMIC_ACQUIRE);
  if (r == NULL)
    return 0; /* no ticket handed out */
  unsigned long long limit_ms = usmipc__event_timeout_ms();
  uint64_t start = usmipc__now_ns();
  pthread_mutex_lock(&usmipc__events_lock);
  while (r->released < r->sent) {
    uint64_t now = usmipc__now_ns();
    if (limit_ms != 0 && (now - start) / 1000000u >= limit_ms) {
      uint64_t sent = r->sent, released = r->released;
      pthread_mutex_unlock(&usmipc__events_lock);
      return usmipc__fail(USMIPC_ETIMEDOUT,
                          "timed out after %llu ms waiting for releases: "
                          "%llu of %llu handoffs came back (a consumer that "
                          "exits or drops a mapping without releasing it "
                          "never returns its ticket)",
                          limit_ms, (unsigned long long)released,
                          (unsigned long long)sent);
    }
    struct timespec ts;
    uint64_t until = now + 50000000u;
    ts.tv_sec = (time_t)(until / 1000000000u);
    ts.tv_nsec = (long)(until % 1000000000u);
    pthread_cond_timedwait(&r->cond, &usmipc__events_lock, &ts);
    if (r->released < r->sent) {
      /* The interrupt hook may take a binding's lock (Python's GIL), whose
       * holder may be waiting for this one (bundle.releases): never call it
       * with a library lock held (test_bundles_release.py
       * test_counts_while_wait_released_waits). */
      pthread_mutex_unlock(&usmipc__events_lock);
      bool stop = usmipc__interrupted() != 0;
      pthread_mutex_lock(&usmipc__events_lock);
      if (stop && r->released < r->sent) {
        pthread_mutex_unlock(&usmipc__events_lock);
        return usmipc__fail(USMIPC_EINTR, "interrupted while waiting for "
                                          "releases");
      }
    }
  }
  /* Every ticket is back: now the consumers' own work, on the device where
   * the producer gave a queue. The events stay filed until each is known
   * complete, so that every call waits for the same work (a failed or
   * device-side wait leaves them for the next). */
  size_t n = r->npending;
  struct pending **snap = n ? malloc(n * sizeof(*snap)) : NULL;
  if (n != 0 && snap == NULL) {
    pthread_mutex_unlock(&usmipc__events_lock);
    return usmipc__fail(USMIPC_ENOMEM, "out of memory");
  }
  for (size_t i = 0; i < n; i++) {
    snap[i] = r->pending[i];
    snap[i]->refs++;
  }
  pthread_mutex_unlock(&usmipc__events_lock);
  int rc = 0;
  bool *complete = n ? calloc(n, sizeof(*complete)) : NULL;
  if (n != 0 && complete == NULL)
    rc = usmipc__fail(USMIPC_ENOMEM, "out of memory");
  for (size_t i = 0; i < n && rc == 0; i++) {
    rc = pending_wait(snap[i], queue, limit_ms, start, &complete[i]);
    if (rc != 0)
      usmipc__error_prefix("waiting for a consumer's release: ");
  }
  pthread_mutex_lock(&usmipc__events_lock);
  for (size_t i = 0; i < n; i++)
    if (complete != NULL && complete[i])
      snap[i]->complete = true;
  size_t kept = 0;
  for (size_t j = 0; j < r->npending; j++)
    if (r->pending[j]->complete)
      pending_drop(r->pending[j]); /* the list's reference */
    else
      r->pending[kept++] = r->pending[j];
  r->npending = kept;
  for (size_t i = 0; i < n; i++)
    pending_drop(snap[i]);
  pthread_mutex_unlock(&usmipc__events_lock);
  free(complete);
  free(snap);
  return rc;
}

/* The parent's registries are its handles': the child forgets them (their
 * consumers' pidfds stay open, the parent's). Run by fork.c with
 * usmipc__events_lock held. */
void usmipc__releases_fork_child(void) {
  memset(releases, 0, sizeof(releases));
  consumers = NULL;
  /* The log is the parent's too; a waiter's seq from before the fork is
   * then ahead of it (missed). The condition variable may have had a
   * waiter in another thread of the parent: made anew. */
  done_seq = 0;
  if (done_ready)
    done_cond_init();
}

/* The release record of handle or bundle bytes, decoded into *w; *no_memory
 * for a bundle of no memory (nothing was lent: no ticket). fn names the
 * caller in the messages. */
static int bytes_ticket(const void *data, size_t len, usmipc__wire_t *w,
                        bool *no_memory, const char *fn) {
  int rc;
  *no_memory = false;
  if (usmipc__bundle_magic(data, len)) {
    /* Bundle bytes: their ticket rides after the tree as if appended to
     * allocation 0's handle, which names the producer; from here on a
     * bundle's ticket goes back exactly as a handle's does. */
    return usmipc__bundle_ticket(data, len, fn, w, no_memory);
  }
  if ((rc = usmipc__wire_decode(data, len, w)) != 0)
    return rc;
  if (!w->has_release)
    return usmipc__fail(USMIPC_EINVAL,
                        "%s: the handle asks for no release (its producer "
                        "did not order it with USMIPC_ORDER_RELEASE)",
                        fn);
  return 0;
}

int usmipc_ipc_release(const void *data, size_t len, usmipc_queue_t *queue) {
  usmipc__wire_t w;
  bool no_memory;
  int rc = bytes_ticket(data, len, &w, &no_memory, "usmipc_ipc_release");
  if (rc != 0)
    return rc;
  if (no_memory)
    return 0; /* a bundle of no memory: nothing was lent */
  return usmipc__release_send(&w, queue);
}

/* The record both formats end with, before the checksum, when ordered with
 * a release (usmipc_ipc_handle_order_ex, usmipc_bundle_order_ex append
 * it last): u16 type, u16 length, u64 release id, u64 ticket, [16] token. */
#define TICKET_RECORD_END (4 + 4 + USMIPC__RELEASE_RECORD_LEN)

int usmipc_ipc_forward(const void *data, size_t len, void *out) {
  if (out == NULL)
    return usmipc__fail(USMIPC_EINVAL, "usmipc_ipc_forward: out is NULL");
  usmipc__wire_t w;
  bool no_memory;
  int rc = bytes_ticket(data, len, &w, &no_memory, "usmipc_ipc_forward");
  if (rc != 0)
    return rc;
  if (no_memory) { /* nothing lent: the same bytes serve anyone */
    memmove(out, data, len);
    return 0;
  }
  /* Decoded, the record is known well formed; it must also be the last,
   * where the new ticket goes (both writers put it there). */
  const uint8_t *rec = len > TICKET_RECORD_END
                           ? (const uint8_t *)data + len - TICKET_RECORD_END
                           : NULL;
  if (rec == NULL || usmipc__get16le(rec) != USMIPC__EXT_RELEASE ||
      usmipc__get16le(rec + 2) != USMIPC__RELEASE_RECORD_LEN ||
      usmipc__get64le(rec + 4) != w.release_id ||
      usmipc__get64le(rec + 12) != w.release_ticket ||
      memcmp(rec + 20, w.release_token, 16) != 0)
    return usmipc__fail(
        USMIPC_EBADHANDLE,
        "usmipc_ipc_forward: the release ticket is not the "
        "last record of the bytes (they were not written by "
        "usmipc_ipc_handle_order_ex or usmipc_bundle_order_ex)");
  const usmipc__process_t *self = usmipc__self_basic();
  if (memcmp(w.boot_id, self->boot_id, 16) != 0)
    return usmipc__fail(USMIPC_EOTHERHOST,
                        "the handle was exported on another machine or boot");
  uint64_t ticket = 0;
  uint8_t nonce[16]; /* ours: another holder of data cannot know it */
  int rn = usmipc__random(nonce, 16);
  if (rn != 0)
    return rn;
  if (w.nonce == self->nonce && w.pid == self->pid) {
    /* Our own handoff: ask the registry directly, as the broker would. */
    uint8_t req[USMIPC__REQUEST_LEN], client[16] = {0},
                                      body[USMIPC__FORWARD_BODY_LEN];
    usmipc__wire_t named = w;
    named.buffer_id = w.release_id;
    usmipc__request_build(req, &named, USMIPC__WANT_FORWARD, client);
    usmipc__put64le(body, w.release_ticket);
    memcpy(body + 8, nonce, 16);
    usmipc__forward_capability(req, w.release_token, body, sizeof(body),
                               req + 64);
    uint32_t word = 0;
    uint32_t status = usmipc__release_forward_arrived(req, body, sizeof(body),
                                                      self->pid, &word);
    /* The codes and reasons of the broker's answer, as the forwarder reads
     * it (usmipc__reply_check_forward). */
    uint8_t rep[USMIPC__REPLY_LEN];
    usmipc__reply_build(rep, req, status, (int)word, w.key);
    rc = usmipc__reply_check_forward(rep, sizeof(rep), req, &w, 0,
                                     "this process's own registry", &ticket);
  } else {
    rc = usmipc__broker_forward(&w, nonce, usmipc__deadline_after_timeout(),
                                &ticket);
  }
  if (rc != 0) {
    usmipc__error_prefix("handing a handoff of process %u on: ", w.pid);
    return rc;
  }
  uint8_t token[16];
  usmipc__forward_token(w.release_token, w.release_id, ticket, nonce, token);
  memmove(out, data, len);
  uint8_t *o = (uint8_t *)out + len - TICKET_RECORD_END;
  usmipc__put64le(o + 12, ticket);
  memcpy(o + 20, token, 16);
  uint8_t *end = (uint8_t *)out + len - 4;
  usmipc__put32le(end, usmipc__crc32c(0, out, len - 4));
  return 0;
}

int usmipc__release_send(const usmipc__wire_t *wp, usmipc_queue_t *queue) {
  const usmipc__wire_t w = *wp;
  int rc;
  const usmipc__process_t *self = usmipc__self_basic();
  if (memcmp(w.boot_id, self->boot_id, 16) != 0)
    return usmipc__fail(USMIPC_EOTHERHOST,
                        "the handle was exported on another machine or boot");
  /* The body: the ticket and, when the consumer's work is on a device
   * queue, the handle of an event recorded after it. */
  uint8_t body[USMIPC__RELEASE_BODY_MAX];
  size_t ev_len = 0;
  usmipc__put64le(body, w.release_ticket);
  if (queue != NULL && queue->device->ops->event_create != NULL &&
      (rc = usmipc__event_ring_handle(queue, body + 10, &ev_len)) != 0)
    return rc;
  usmipc__put16le(body + 8, (uint16_t)ev_len);
  if (w.nonce == self->nonce && w.pid == self->pid) {
    /* Our own handoff: file the ticket directly, as the broker would. */
    uint8_t req[USMIPC__REQUEST_LEN], nonce[16] = {0};
    usmipc__wire_t named = w;
    named.buffer_id = w.release_id;
    usmipc__request_build(req, &named, USMIPC__WANT_RELEASE, nonce);
    usmipc__release_capability(req, w.release_token, body, 10 + ev_len,
                               req + 64);
    uint32_t status =
        usmipc__release_arrived(req, body, 10 + ev_len, self->pid);
    /* The codes and reasons of the broker's answer (usmipc__reply_check). */
    if (status == 0)
      return 0;
    if (status == 1)
      return usmipc__fail(USMIPC_EEXPORTERGONE,
                          "usmipc_ipc_release: this process no longer waits "
                          "for that release (its handle or bundle was "
                          "freed)");
    if (status == 2)
      return usmipc__fail(USMIPC_EACCES,
                          "usmipc_ipc_release: the release ticket's token is "
                          "wrong for its ticket number (forged, edited or "
                          "corrupted bytes: each handoff's bytes return only "
                          "their own ticket)");
    return usmipc__fail(USMIPC_EBADHANDLE,
                        "usmipc_ipc_release: the ticket was never handed out "
                        "(forged), or the consumer's event handle is "
                        "malformed");
  }
  rc = usmipc__broker_release(&w, body, 10 + ev_len,
                              usmipc__deadline_after_timeout());
  if (rc != 0)
    usmipc__error_prefix("returning a release ticket to process %u: ", w.pid);
  return rc;
}
