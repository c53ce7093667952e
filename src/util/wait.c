/* Waiting on another process with one absolute deadline.
 *
 * An open may wait on the exporter several times (connect, the answer). Each
 * wait polls with the time left until one deadline fixed when the open
 * began, so no number of signals can extend it (a timeout restarted after
 * every EINTR never expires under a periodic signal). Between polls, and
 * after every signal, the interrupt handler a language binding installed
 * decides whether to abandon the open (Ctrl-C in Python).
 *
 * Floor 1 of the core (util). */
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "util/util.h"

#define DEFAULT_TIMEOUT_MS 5000u
/* How often a long wait looks at the interrupt handler even without a
 * signal: a signal delivered to another thread does not interrupt us. */
#define INTERRUPT_POLL_MS 50

static unsigned timeout_ms; /* 0: not set; read with atomics */
static usmipc_interrupt_fn interrupt_fn;
static void *interrupt_arg;
static pthread_mutex_t interrupt_lock = PTHREAD_MUTEX_INITIALIZER;

static unsigned env_timeout_ms(void) {
  unsigned long long v;
  if (usmipc__env_number("USMIPC_IPC_TIMEOUT_MS", 1, 86400000, false,
                         "5000 (ms)", &v))
    return (unsigned)v;
  return DEFAULT_TIMEOUT_MS;
}

int usmipc_ipc_set_timeout(unsigned ms) {
  __atomic_store_n(&timeout_ms, ms, __ATOMIC_RELAXED);
  return 0;
}

unsigned usmipc__ipc_timeout_ms(void) {
  unsigned ms = __atomic_load_n(&timeout_ms, __ATOMIC_RELAXED);
  return ms ? ms : env_timeout_ms();
}

void usmipc_set_interrupt_handler(usmipc_interrupt_fn fn, void *arg) {
  pthread_mutex_lock(&interrupt_lock);
  interrupt_fn = fn;
  interrupt_arg = arg;
  pthread_mutex_unlock(&interrupt_lock);
}

uint64_t usmipc__now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

uint64_t usmipc__deadline_after_timeout(void) {
  return usmipc__now_ns() + (uint64_t)usmipc__ipc_timeout_ms() * 1000000u;
}

int usmipc__interrupted(void) {
  pthread_mutex_lock(&interrupt_lock);
  usmipc_interrupt_fn fn = interrupt_fn;
  void *arg = interrupt_arg;
  pthread_mutex_unlock(&interrupt_lock);
  return fn != NULL && fn(arg) != 0;
}

int usmipc__wait_fd(int fd, short events, uint64_t deadline_ns,
                    const char *waiting_for) {
  for (;;) {
    uint64_t now = usmipc__now_ns();
    if (now >= deadline_ns)
      return usmipc__fail(USMIPC_ETIMEDOUT,
                          "timed out after %u ms waiting for %s (the "
                          "exporting process is stalled or stopped; raise "
                          "USMIPC_IPC_TIMEOUT_MS or usmipc_ipc_set_timeout "
                          "if it is only slow)",
                          usmipc__ipc_timeout_ms(), waiting_for);
    uint64_t left_ms = (deadline_ns - now + 999999u) / 1000000u;
    int slice = left_ms > INTERRUPT_POLL_MS ? INTERRUPT_POLL_MS : (int)left_ms;
    struct pollfd p = {.fd = fd, .events = events};
    int n = poll(&p, 1, slice);
    if (n > 0)
      return 0; /* ready, or an error/hangup the next call reports */
    if (n < 0 && errno != EINTR)
      return usmipc__fail_native(USMIPC_ETRANSPORT, errno,
                                 "poll(2) failed waiting for %s: %s",
                                 waiting_for, strerror(errno));
    if (usmipc__interrupted())
      return usmipc__fail(USMIPC_EINTR, "interrupted while waiting for %s",
                          waiting_for);
  }
}
