/* Numbers from the environment: every USMIPC_* count, size and time is read
 * by the one parser here, under one rule (docs/settings in README.md,
 * "Settings"): a value that is malformed, overflows or is out of its
 * range is never fatal and never silently changed; it gets a warning on
 * stderr naming the variable, the value, the form expected and the value
 * used instead, which is the default.
 *
 * Form: decimal digits, and for sizes an optional binary unit, K, M, G or
 * T, alone or followed by B or iB, in any case (64G, 64GB, 64GiB, 64g are
 * all 64 * 2^30). Counts and times take no unit (64 entries, 5000 ms).
 *
 * Floor 1 (util). */
#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "util/util.h"

/* 0 with *out, or -1 when s is not such a number (or overflows). */
static int parse(const char *s, bool units, unsigned long long *out) {
  if (!isdigit((unsigned char)s[0]))
    return -1;
  unsigned long long v = 0;
  const char *p = s;
  for (; isdigit((unsigned char)*p); p++) {
    unsigned d = (unsigned)(*p - '0');
    if (v > (~0ull - d) / 10)
      return -1;
    v = v * 10 + d;
  }
  unsigned shift = 0;
  if (*p != '\0') {
    const char *u = units ? strchr("KMGT", toupper((unsigned char)*p)) : NULL;
    if (u == NULL || *u == '\0')
      return -1;
    shift = 10u * (unsigned)(u - "KMGT" + 1);
    p++;
    if (*p == 'i' || *p == 'I')
      p++;
    if (*p == 'b' || *p == 'B')
      p++;
    if (*p != '\0' || (shift > 0 && v > (~0ull >> shift)))
      return -1;
  }
  *out = v << shift;
  return 0;
}

bool usmipc__env_number(const char *name, unsigned long long min,
                        unsigned long long max, bool units,
                        const char *used_instead, unsigned long long *out) {
  const char *env = getenv(name);
  if (env == NULL || env[0] == '\0')
    return false;
  unsigned long long v;
  if (parse(env, units, &v) == 0 && v >= min && v <= max) {
    *out = v;
    return true;
  }
  char expected[160];
  snprintf(expected, sizeof(expected), "%s from %llu to %llu%s",
           units ? "a size" : "a whole number", min, max,
           units ? ", in bytes or with K, M, G or T (binary: 64G is 64 GiB)"
                 : "");
  usmipc__env_malformed(name, env, expected, used_instead);
  return false;
}
