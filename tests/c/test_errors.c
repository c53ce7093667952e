/* Error codes, their names and messages, and the version calls. */
#include <limits.h>
#include <pthread.h>

#include "task.h"

typedef struct code_entry {
  int code;
  const char *name;
  const char *text;
} code_entry_t;

static const code_entry_t codes[] = {
#define XX(name, value, text) {USMIPC_##name, "USMIPC_" #name, text},
    USMIPC_ERRNO_MAP(XX)
#undef XX
};
#define NCODES (sizeof(codes) / sizeof(codes[0]))

TEST_IMPL(errors_strerror_every_code) {
  for (size_t i = 0; i < NCODES; i++) {
    ASSERT_LT(codes[i].code, 0);
    ASSERT_STR_EQ(usmipc_err_name(codes[i].code), codes[i].name);
    ASSERT_STR_EQ(usmipc_strerror(codes[i].code), codes[i].text);
    /* Codes are distinct, so each maps back to its own name. */
    for (size_t j = 0; j < i; j++)
      ASSERT_NE(codes[i].code, codes[j].code);
  }
  /* The library's own codes are pinned in the reserved range. */
  ASSERT_EQ(USMIPC_EBACKEND, -30001);
  ASSERT_EQ(USMIPC_ETRANSPORT, -30011);
  ASSERT_EQ(USMIPC_EINVAL, -EINVAL);
  ASSERT_EQ(USMIPC_EACCES, -EACCES);
  return 0;
}

TEST_IMPL(errors_unknown_codes) {
  static const int unknown[] = {0,       1,      -1,     -29999,
                                -30000,  -30999, -31000, INT_MIN,
                                INT_MAX, -EPERM, 12345,  -123456};
  for (size_t i = 0; i < sizeof(unknown) / sizeof(unknown[0]); i++) {
    int c = unknown[i];
    const char *s = usmipc_strerror(c);
    const char *n = usmipc_err_name(c);
    ASSERT_NOT_NULL(s);
    ASSERT_NOT_NULL(n);
    ASSERT_GT(strlen(s), 0);
    ASSERT_GT(strlen(n), 0);
    /* An unknown code must not borrow a known code's name. */
    for (size_t j = 0; j < NCODES; j++)
      if (codes[j].code != c)
        ASSERT_MSG(strcmp(n, codes[j].name) != 0, "code %d named %s", c, n);
  }
  return 0;
}

static char other_thread_msg[512];

static void *other_thread(void *arg) {
  (void)arg;
  /* A thread that made no failed call must not see another thread's
   * message; then it fails on its own and sees its own message. */
  snprintf(other_thread_msg, sizeof(other_thread_msg), "%s",
           usmipc_last_error() ? usmipc_last_error() : "(null)");
  return NULL;
}

TEST_IMPL(errors_last_error_per_thread) {
  void *p = NULL;
  ASSERT_ERR(usmipc_malloc(test_device(), USMIPC_MEM_DEVICE, 0, &p),
             USMIPC_EINVAL);
  char mine[512];
  snprintf(mine, sizeof(mine), "%s", usmipc_last_error());
  ASSERT_GT(strlen(mine), 0);

  pthread_t t;
  ASSERT_EQ(pthread_create(&t, NULL, other_thread, NULL), 0);
  ASSERT_EQ(pthread_join(t, NULL), 0);
  ASSERT_MSG(strcmp(other_thread_msg, mine) != 0,
             "another thread sees this thread's message \"%s\"", mine);

  /* Still ours after the other thread ran. */
  ASSERT_STR_EQ(usmipc_last_error(), mine);
  return 0;
}

TEST_IMPL(errors_version) {
  ASSERT_EQ(usmipc_version(), USMIPC_VERSION_HEX);
  ASSERT_STR_EQ(usmipc_version_string(), USMIPC_VERSION_STRING);
  return 0;
}
