/* The behaviour probe's recorder (tools/probe/README.md): with
 * USMIPC_TEST_PROBE=FILE in the environment, every failure a test checks is
 * appended to FILE as one line, so that a refactoring can show its messages
 * and codes stayed byte for byte the same. Unset, it is one getenv(3) on the
 * path of a checked failure and nothing else.
 *
 * Header-only (static functions) so that the Level Zero tests, which do not
 * link tests/c/util.c, record the same way. One record:
 *
 *   c TAB pid TAB context TAB test TAB file:line TAB what TAB code TAB message
 *
 * context is the device (USMIPC_TEST_DEVICE, "-" when unset) and the Level
 * Zero test driver's profile (USMIPC_ZE_TEST_PROFILE, if set) the process
 * runs under; test the test or helper (probe_set_test); what the call's
 * source text; code the name of the code it returned ("0" when a call that
 * was to fail did not). Tabs, newlines and backslashes in a field are
 * written as \t, \n and \\.
 *
 * Tests fork and ctest runs several at once, all appending to one file: the
 * file is opened with O_APPEND and each record is one write(2), which
 * Linux appends whole for a regular file. */
#ifndef USMIPC_TEST_PROBE_H
#define USMIPC_TEST_PROBE_H

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "usmipc.h"

#define PROBE_RECORD_MAX 16384

/* The test (or helper role) this process runs, for its records. Weak: one
 * variable for the whole program, though each file that includes this
 * header defines it. */
__attribute__((weak)) const char *probe_test_name_;

static inline void probe_set_test(const char *name) { probe_test_name_ = name; }

static inline size_t probe_put_(char *buf, size_t at, const char *s) {
  for (; s != NULL && *s != '\0' && at + 3 < PROBE_RECORD_MAX; s++) {
    char c = *s;
    if (c == '\t' || c == '\n' || c == '\r' || c == '\\') {
      buf[at++] = '\\';
      c = c == '\t' ? 't' : c == '\n' ? 'n' : c == '\r' ? 'r' : '\\';
    }
    buf[at++] = c;
  }
  return at;
}

static inline size_t probe_field_(char *buf, size_t at, const char *s) {
  if (at + 2 < PROBE_RECORD_MAX)
    buf[at++] = '\t';
  return probe_put_(buf, at, s);
}

/* Appends one record: what failed (its source text), the code's name and
 * the message that came with it. */
static inline void probe_record_named(const char *file, int line,
                                      const char *what, const char *code,
                                      const char *message) {
  const char *path = getenv("USMIPC_TEST_PROBE");
  if (path == NULL || path[0] == '\0')
    return;
  const char *dev = getenv("USMIPC_TEST_DEVICE");
  const char *profile = getenv("USMIPC_ZE_TEST_PROFILE");
  const char *base = strrchr(file, '/');
  char ctx[256], where[256], num[32];
  snprintf(ctx, sizeof(ctx), "%s%s%s", dev && dev[0] ? dev : "-",
           profile && profile[0] ? " ze=" : "",
           profile && profile[0] ? profile : "");
  snprintf(where, sizeof(where), "%s:%d", base ? base + 1 : file, line);
  snprintf(num, sizeof(num), "%d", (int)getpid());
  char b[PROBE_RECORD_MAX];
  size_t at = probe_put_(b, 0, "c");
  at = probe_field_(b, at, num);
  at = probe_field_(b, at, ctx);
  at = probe_field_(b, at, probe_test_name_ ? probe_test_name_ : "-");
  at = probe_field_(b, at, where);
  at = probe_field_(b, at, what);
  at = probe_field_(b, at, code);
  at = probe_field_(b, at, message);
  b[at++] = '\n';
  int saved_errno = errno; /* a test may read errno after the check */
  int fd = open(path, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
  if (fd >= 0) {
    (void)!write(fd, b, at);
    close(fd);
  }
  errno = saved_errno;
}

/* The same with the code a call returned (0: a call that was to fail did
 * not). */
static inline void probe_record(const char *file, int line, const char *what,
                                int rc, const char *message) {
  if (getenv("USMIPC_TEST_PROBE") == NULL)
    return;
  probe_record_named(file, line, what, rc == 0 ? "0" : usmipc_err_name(rc),
                     rc == 0 ? "" : message);
}

/* A failure a test checks by hand (not through ASSERT_ERR), or one a helper
 * process reports to its test: the call's text and its code, with the
 * thread's message. Nothing is recorded when rc is 0. */
#define PROBE_ERR(what, rc)                                                    \
  do {                                                                         \
    int probe_rc_ = (rc);                                                      \
    if (probe_rc_ != 0)                                                        \
      probe_record(__FILE__, __LINE__, (what), probe_rc_,                      \
                   usmipc_last_error());                                       \
  } while (0)

#endif /* USMIPC_TEST_PROBE_H */
