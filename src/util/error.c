/* Error codes, their names and texts, and the per-thread message of the last
 * failure. The message is the library's main way to tell a user what was
 * wrong and what to do, so every failure path sets one.
 *
 * Floor 1 of the core (util), its lowest file: everything fails through it. */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "util/util.h"

static _Thread_local char last_message[512];
static _Thread_local long last_native;

const char *usmipc_strerror(int err) {
  switch (err) {
  case 0:
    return "success";
#define XX(name, value, text)                                                  \
  case value:                                                                  \
    return text;
    USMIPC_ERRNO_MAP(XX)
#undef XX
  default:
    return "unknown error";
  }
}

const char *usmipc_err_name(int err) {
  switch (err) {
  case 0:
    return "USMIPC_OK";
#define XX(name, value, text)                                                  \
  case value:                                                                  \
    return "USMIPC_" #name;
    USMIPC_ERRNO_MAP(XX)
#undef XX
  default:
    return "USMIPC_EUNKNOWN";
  }
}

const char *usmipc_last_error(void) {
  return last_message[0] ? last_message : "no error recorded on this thread";
}

long usmipc_last_native_error(void) { return last_native; }

static int fail_v(int code, long native, const char *fmt, va_list ap) {
  vsnprintf(last_message, sizeof(last_message), fmt, ap);
  last_native = native;
  return code;
}

int usmipc__fail(int code, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  fail_v(code, 0, fmt, ap);
  va_end(ap);
  return code;
}

int usmipc__fail_native(int code, long native, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  fail_v(code, native, fmt, ap);
  va_end(ap);
  return code;
}

void usmipc__error_prefix(const char *fmt, ...) {
  char prefix[192], old[sizeof(last_message)];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(prefix, sizeof(prefix), fmt, ap);
  va_end(ap);
  memcpy(old, last_message, sizeof(old));
  size_t plen = strlen(prefix), olen = strlen(old);
  if (plen >= sizeof(last_message))
    plen = sizeof(last_message) - 1;
  if (olen > sizeof(last_message) - 1 - plen)
    olen = sizeof(last_message) - 1 - plen;
  memcpy(last_message, prefix, plen);
  memcpy(last_message + plen, old, olen);
  last_message[plen + olen] = '\0';
}

unsigned usmipc_version(void) { return USMIPC_VERSION_HEX; }
const char *usmipc_version_string(void) { return USMIPC_VERSION_STRING; }
