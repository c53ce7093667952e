/* USMIPC_DEBUG=1: one line per decision on stderr ("usmipc[pid]: ..."):
 * backends probed and why one is unavailable, how each open went (cache
 * hit, miss, which transport brought the descriptor), mappings evicted.
 * And, whether or not debugging is on, one warning per USMIPC_* variable
 * whose value is malformed: such a value is never silently ignored.
 *
 * Floor 1 of the core (util). */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "util/util.h"

static int debug_state = -1; /* -1: not read yet */

bool usmipc__debug_enabled(void) {
  int s = __atomic_load_n(&debug_state, __ATOMIC_RELAXED);
  if (s < 0) {
    const char *env = getenv("USMIPC_DEBUG");
    s = env != NULL && env[0] != '\0' && strcmp(env, "0") != 0;
    if (s && strcmp(env, "1") != 0)
      usmipc__env_malformed("USMIPC_DEBUG", env, "0 or 1", "on");
    __atomic_store_n(&debug_state, s, __ATOMIC_RELAXED);
  }
  return s != 0;
}

void usmipc__debug(const char *fmt, ...) {
  if (!usmipc__debug_enabled())
    return;
  char line[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(line, sizeof(line), fmt, ap);
  va_end(ap);
  /* One write: lines of several threads do not interleave. */
  char out[560];
  int n = snprintf(out, sizeof(out), "usmipc[%d]: %s\n", (int)getpid(), line);
  if (n > 0 &&
      write(2, out, (size_t)n < sizeof(out) ? (size_t)n : sizeof(out) - 1) < 0)
    return;
}

void usmipc__env_malformed(const char *name, const char *value,
                           const char *expected, const char *used) {
  char out[400];
  int n = snprintf(out, sizeof(out),
                   "usmipc[%d]: warning: %s='%.80s' is malformed (expected "
                   "%s); using %s\n",
                   (int)getpid(), name, value, expected, used);
  if (n > 0 &&
      write(2, out, (size_t)n < sizeof(out) ? (size_t)n : sizeof(out) - 1) < 0)
    return;
}
