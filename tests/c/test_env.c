/* The one parser of USMIPC_* numbers (src/util/env.c): every form a
 * variable took before still works, and anything else warns, naming the
 * variable, the value, the form expected and what is used instead. */
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "task.h"
#include "util/util.h"

/* Runs usmipc__env_number with name=value, stderr captured into said. */
static bool parse_env(const char *value, unsigned long long min,
                      unsigned long long max, bool units,
                      unsigned long long *out, char *said, size_t said_len) {
  ASSERT_EQ(setenv("USMIPC_TEST_NUMBER", value, 1), 0);
  char path[] = "/tmp/usmipc-env-XXXXXX";
  int fd = mkstemp(path);
  ASSERT_GE(fd, 0);
  unlink(path);
  fflush(stderr);
  int saved = dup(2);
  ASSERT_GE(saved, 0);
  ASSERT_GE(dup2(fd, 2), 0);
  bool got = usmipc__env_number("USMIPC_TEST_NUMBER", min, max, units,
                                "the default", out);
  ASSERT_GE(dup2(saved, 2), 0);
  close(saved);
  ssize_t n = pread(fd, said, said_len - 1, 0);
  said[n > 0 ? n : 0] = '\0';
  close(fd);
  return got;
}

TEST_IMPL(env_numbers) {
  char said[512];
  unsigned long long v = 0;
  struct {
    const char *value;
    bool units;
    unsigned long long want;
  } good[] = {
      {"0", false, 0},
      {"64", false, 64},
      {"5000", false, 5000},
      {"1024", true, 1024},
      {"64G", true, 64ull << 30},  /* refused as malformed before */
      {"40g", true, 40ull << 30},  /* USMIPC_TORCH_POOL_SEGMENT's forms */
      {"2M", true, 2ull << 20},
      {"2MiB", true, 2ull << 20},
      {"2MB", true, 2ull << 20},
      {"3k", true, 3ull << 10},
      {"1T", true, 1ull << 40},
      {"18446744073709551615", false, ~0ull},
  };
  for (size_t i = 0; i < sizeof(good) / sizeof(good[0]); i++) {
    v = 12345;
    ASSERT_MSG(parse_env(good[i].value, 0, ~0ull, good[i].units, &v, said,
                         sizeof(said)),
               "'%s' refused: %s", good[i].value, said);
    ASSERT_UEQ(v, good[i].want);
    ASSERT_MSG(said[0] == '\0', "'%s' warned: %s", good[i].value, said);
  }
  const char *bad[] = {"",  "-1",  "12Q",  "64G", "1.5", "0x10", " 5",
                       "5 ", "99999999999999999999", "16EiB", "4Gx"};
  for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
    v = 777;
    /* A count takes no unit: "64G" is malformed where units are off. */
    ASSERT_MSG(!parse_env(bad[i], 0, ~0ull, strcmp(bad[i], "64G") != 0, &v,
                          said, sizeof(said)),
               "'%s' accepted", bad[i]);
    ASSERT_UEQ(v, 777);
    if (bad[i][0] == '\0') {
      ASSERT_MSG(said[0] == '\0', "unset warned: %s", said);
      continue;
    }
    char quoted[64];
    snprintf(quoted, sizeof(quoted), "USMIPC_TEST_NUMBER='%s'", bad[i]);
    ASSERT_MSG(strstr(said, quoted) && strstr(said, "using the default"),
               "'%s': %s", bad[i], said);
  }
  /* Out of range: warned with the range, never clamped. */
  ASSERT(!parse_env("99", 1, 16, false, &v, said, sizeof(said)));
  ASSERT_MSG(strstr(said, "from 1 to 16") != NULL, "%s", said);
  ASSERT(!parse_env("0", 1, 16, false, &v, said, sizeof(said)));
  ASSERT(parse_env("16", 1, 16, false, &v, said, sizeof(said)));
  ASSERT_UEQ(v, 16);
  unsetenv("USMIPC_TEST_NUMBER");
  return 0;
}
