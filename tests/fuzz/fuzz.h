/* What every fuzz target shares: a check that aborts (libFuzzer records the
 * input; the replay driver fails) with the target's name and a message. */
#ifndef USMIPC_FUZZ_H
#define USMIPC_FUZZ_H

#include <stdio.h>
#include <stdlib.h>

#ifndef FUZZ_TARGET
#error "define FUZZ_TARGET (the target's name) before including fuzz.h"
#endif

#define FUZZ_CHECK(cond, ...)                                                  \
  do {                                                                         \
    if (!(cond)) {                                                             \
      fprintf(stderr, "%s: %s:%d: %s: ", FUZZ_TARGET, __FILE__, __LINE__,      \
              #cond);                                                          \
      fprintf(stderr, __VA_ARGS__);                                            \
      fputc('\n', stderr);                                                     \
      abort();                                                                 \
    }                                                                          \
  } while (0)

#endif /* USMIPC_FUZZ_H */
