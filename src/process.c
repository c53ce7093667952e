/* This process's identity as written into exported handles, randomness, and
 * what must be redone in a child after fork(). */
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/random.h>
#include <unistd.h>

#include "common.h"

static usmipc__process_t self;
static pthread_once_t self_once = PTHREAD_ONCE_INIT;

int usmipc__random(void *buf, size_t len) {
  uint8_t *p = buf;
  while (len > 0) {
    ssize_t n = getrandom(p, len, 0);
    if (n < 0) {
      if (errno == EINTR)
        continue;
      return usmipc__fail(-errno, "getrandom(2) failed: %s", strerror(errno));
    }
    p += n;
    len -= (size_t)n;
  }
  return 0;
}

static int hexval(int c) {
  if (c >= '0' && c <= '9')
    return c - '0';
  if (c >= 'a' && c <= 'f')
    return c - 'a' + 10;
  if (c >= 'A' && c <= 'F')
    return c - 'A' + 10;
  return -1;
}

/* boot_id is a UUID in text; a handle carries it so that a handle from
 * another machine or from before a reboot is refused by name, not by a
 * confusing failure to reach a process that happens to share its pid. */
static void read_boot_id(uint8_t out[16]) {
  char text[64] = {0};
  memset(out, 0, 16);
  int fd = open("/proc/sys/kernel/random/boot_id", O_RDONLY | O_CLOEXEC);
  if (fd < 0)
    return;
  ssize_t n = read(fd, text, sizeof(text) - 1);
  close(fd);
  if (n <= 0)
    return;
  int k = 0;
  for (ssize_t i = 0; i + 1 < n && k < 16; i++) {
    int hi = hexval(text[i]), lo;
    if (hi < 0)
      continue;
    lo = hexval(text[i + 1]);
    if (lo < 0)
      return;
    out[k++] = (uint8_t)(hi << 4 | lo);
    i++;
  }
}

static void redraw_nonce(void) {
  do {
    if (usmipc__random(&self.nonce, sizeof(self.nonce)) != 0)
      self.nonce = ((uint64_t)getpid() << 32) ^ (uint64_t)(uintptr_t)&self;
  } while (self.nonce == 0);
}

/* fork() from any thread at any moment: every lock of the library is taken
 * before the fork, in the one order normal code nests them (registry, then
 * export table, then broker and pidfd cache), and released after it, so the
 * child never inherits a lock held by a thread that does not exist there.
 * One handler set, registered once when the library loads, instead of one
 * per module: pthread_atfork runs prepare handlers in reverse registration
 * order, and modules registering lazily made that order depend on which was
 * used first, the opposite of the nesting order (a deadlock). */
static void fork_prepare(void) {
  usmipc__registry_fork_prepare();
  usmipc__exports_fork_prepare();
  usmipc__fdxfer_fork_prepare();
}

static void fork_parent(void) {
  usmipc__fdxfer_fork_parent();
  usmipc__exports_fork_parent();
  usmipc__registry_fork_parent();
}

static void fork_child(void) {
  if (self.pid != 0) { /* the identity is per process instance */
    self.pid = (uint32_t)getpid();
    redraw_nonce();
  }
  usmipc__fdxfer_fork_child();
  usmipc__exports_fork_child();
  usmipc__registry_fork_child();
}

__attribute__((constructor)) static void register_fork_handlers(void) {
  pthread_atfork(fork_prepare, fork_parent, fork_child);
}

static void init_self(void) {
  self.pid = (uint32_t)getpid();
  self.uid = (uint32_t)getuid();
  read_boot_id(self.boot_id);
  redraw_nonce();
}

const usmipc__process_t *usmipc__self(void) {
  pthread_once(&self_once, init_self);
  return &self;
}
