/* The random pool of src/util/process.c: secrets are drawn from
 * getrandom(2) ahead of time, so a child must never hand out the bytes its
 * parent hands out next (whether or not the atfork handlers ran), and
 * threads drawing at once never get the same bytes. */
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include "task.h"
#include "util/util.h"

/* Draws 16 bytes in a child made by fork() (handlers == true) or by the
 * bare clone system call (no atfork handler runs), and returns them through
 * a pipe. */
static bool child_draw(bool handlers, uint8_t out[16]) {
  int fds[2];
  ASSERT_EQ(pipe(fds), 0);
  pid_t pid = handlers
                  ? fork()
                  : (pid_t)syscall(SYS_clone, SIGCHLD, NULL, NULL, NULL, NULL);
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    uint8_t b[16];
    if (usmipc__random(b, sizeof(b)) != 0 ||
        write(fds[1], b, sizeof(b)) != (ssize_t)sizeof(b))
      _exit(2);
    _exit(0);
  }
  close(fds[1]);
  ssize_t n = read(fds[0], out, 16);
  close(fds[0]);
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  ASSERT(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  ASSERT_EQ(n, 16);
  return true;
}

TEST_IMPL(random_child_draws_its_own) {
  for (int handlers = 1; handlers >= 0; handlers--) {
    for (int round = 0; round < 40; round++) {
      uint8_t warm[16], mine[16], theirs[16];
      /* The pool now holds bytes the child would inherit. */
      ASSERT_EQ(usmipc__random(warm, sizeof(warm)), 0);
      ASSERT(child_draw(handlers, theirs));
      ASSERT_EQ(usmipc__random(mine, sizeof(mine)), 0);
      ASSERT_MSG(memcmp(mine, theirs, 16) != 0,
                 "a child made by %s drew the bytes its parent drew next",
                 handlers ? "fork()" : "clone() without atfork handlers");
    }
  }
  return 0;
}

#define DRAW_THREADS 4
#define DRAWS 3000
static uint8_t drawn[DRAW_THREADS][DRAWS][16];

static void *draw_many(void *arg) {
  uint8_t(*mine)[16] = drawn[(intptr_t)arg];
  for (int i = 0; i < DRAWS; i++)
    if (usmipc__random(mine[i], 16) != 0)
      return (void *)1;
  return NULL;
}

static int cmp16(const void *a, const void *b) { return memcmp(a, b, 16); }

TEST_IMPL(random_threads_unique) {
  pthread_t t[DRAW_THREADS];
  for (intptr_t i = 0; i < DRAW_THREADS; i++)
    ASSERT_EQ(pthread_create(&t[i], NULL, draw_many, (void *)i), 0);
  for (int i = 0; i < DRAW_THREADS; i++) {
    void *rc = (void *)1;
    ASSERT_EQ(pthread_join(t[i], &rc), 0);
    ASSERT(rc == NULL);
  }
  qsort(drawn, DRAW_THREADS * DRAWS, 16, cmp16);
  static const uint8_t zero[16];
  for (int i = 0; i < DRAW_THREADS * DRAWS; i++) {
    const uint8_t *a = (const uint8_t *)drawn + 16 * (size_t)i;
    ASSERT_MSG(memcmp(a, zero, 16) != 0, "an all-zero draw");
    if (i > 0)
      ASSERT_MSG(memcmp(a - 16, a, 16) != 0, "two draws alike");
  }
  /* Odd lengths and a length past the pool (drawn directly). */
  uint8_t big[400], odd[7];
  ASSERT_EQ(usmipc__random(odd, sizeof(odd)), 0);
  ASSERT_EQ(usmipc__random(big, sizeof(big)), 0);
  return 0;
}
