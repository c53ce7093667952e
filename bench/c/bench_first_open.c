/* usmipc_bench_first: the first open of host memory against raw baselines
 * defined here, measured paired in one importer (issue 8's targets).
 *
 *   usmipc_bench_first [--k 40] [--size 1M] [--json FILE]
 *
 * Every sample opens memory the importer never opened before, maps it and
 * touches its first and last page; usmipc's samples are usmipc_ipc_open of
 * a fresh allocation, the raw samples the bare system calls:
 *
 *  cold   a new exporter each sample (K exporter processes). usmipc: the
 *         first open of that exporter's handle (it proves the exporter and
 *         maps its export table, then takes the descriptor). raw pidfd:
 *         pidfd_open + pidfd_getfd + mmap + touch.
 *  warm   one exporter already met. usmipc: a fresh allocation of it. raw
 *         pidfd: the same with the exporter's pidfd kept open (pidfd_getfd
 *         + mmap + touch).
 *  socket one exporter already met, USMIPC_FD_TRANSPORT=socket. usmipc: a
 *         fresh allocation through the broker (authenticated). raw socket:
 *         connect to a thread of the exporter, a 16-byte request, the
 *         descriptor back with SCM_RIGHTS, close, then mmap + touch.
 *
 * Samples alternate which side goes first. Medians, p10-p90 and the ratio
 * of medians are printed; --json writes every sample. */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "harness.h"
#include "usmipc.h"

#define HANDLE_MAX 2048

static void die(const char *what) {
  fprintf(stderr, "usmipc_bench_first: %s: %s (%s)\n", what,
          usmipc_last_error(), strerror(errno));
  exit(1);
}

/* ---- exporters -------------------------------------------------------------
 */

static size_t size;

static void socket_name(pid_t pid, struct sockaddr_un *addr, socklen_t *len) {
  memset(addr, 0, sizeof(*addr));
  addr->sun_family = AF_UNIX;
  int n = snprintf(addr->sun_path + 1, sizeof(addr->sun_path) - 1,
                   "usmipc-bench-raw.%d", (int)pid);
  *len = (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + (size_t)n);
}

/* The raw socket server: one request (16 bytes), the memfd back. */
static void *raw_server(void *arg) {
  int memfd = (int)(intptr_t)arg;
  struct sockaddr_un addr;
  socklen_t len;
  socket_name(getpid(), &addr, &len);
  int ls = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (ls < 0 || bind(ls, (struct sockaddr *)&addr, len) != 0 ||
      listen(ls, 64) != 0)
    die("raw server");
  for (;;) {
    int c = accept4(ls, NULL, NULL, SOCK_CLOEXEC);
    if (c < 0)
      continue;
    uint8_t req[16];
    if (recv(c, req, sizeof(req), MSG_WAITALL) == (ssize_t)sizeof(req)) {
      uint64_t reply = 0;
      struct iovec iov = {.iov_base = &reply, .iov_len = sizeof(reply)};
      union {
        struct cmsghdr align;
        char buf[CMSG_SPACE(sizeof(int))];
      } control;
      memset(&control, 0, sizeof(control));
      struct msghdr msg = {.msg_iov = &iov,
                           .msg_iovlen = 1,
                           .msg_control = control.buf,
                           .msg_controllen = sizeof(control.buf)};
      struct cmsghdr *cm = CMSG_FIRSTHDR(&msg);
      cm->cmsg_level = SOL_SOCKET;
      cm->cmsg_type = SCM_RIGHTS;
      cm->cmsg_len = CMSG_LEN(sizeof(int));
      memcpy(CMSG_DATA(cm), &memfd, sizeof(int));
      sendmsg(c, &msg, MSG_NOSIGNAL);
    }
    close(c);
  }
  return NULL;
}

/* An exporter process: n usmipc allocations (filled, exported) and one raw
 * memfd of the same size, filled; writes "pid memfd n" then n handles in
 * hex to out, then waits for the importer to hang up. */
static void exporter_main(int n, int out, int in) {
  usmipc_device_t *dev;
  if (usmipc_device_select("host:cpu", &dev) != 0)
    die("select");
  int memfd = memfd_create("bench-raw", MFD_CLOEXEC);
  if (memfd < 0 || ftruncate(memfd, (off_t)size) != 0)
    die("memfd");
  void *raw = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, memfd, 0);
  if (raw == MAP_FAILED)
    die("mmap");
  memset(raw, 1, size);
  pthread_t t;
  pthread_create(&t, NULL, raw_server, (void *)(intptr_t)memfd);
  FILE *f = fdopen(out, "w");
  fprintf(f, "%d %d %d\n", (int)getpid(), memfd, n);
  for (int i = 0; i < n; i++) {
    void *p;
    usmipc_ipc_handle_t *h;
    const void *data;
    size_t len;
    if (usmipc_malloc(dev, USMIPC_MEM_DEVICE, size, &p) != 0)
      die("malloc");
    memset(p, 2, size);
    if (usmipc_ipc_get_handle(p, 0, &h) != 0 ||
        usmipc_ipc_handle_data(h, &data, &len) != 0)
      die("export");
    for (size_t k = 0; k < len; k++)
      fprintf(f, "%02x", ((const uint8_t *)data)[k]);
    fputc('\n', f);
  }
  fflush(f);
  char c;
  while (read(in, &c, 1) > 0) {
  }
  _exit(0);
}

typedef struct exporter {
  pid_t pid;
  int memfd;
  int n;
  uint8_t (*handles)[HANDLE_MAX];
  size_t *lens;
  int hangup; /* closing it lets the exporter exit */
} exporter_t;

static void exporter_start(exporter_t *e, int n) {
  int from, to;
  pid_t pid = fork_with_pipes(&from, &to);
  if (pid == 0)
    exporter_main(n, to, from);
  e->hangup = to;
  FILE *f = fdopen(from, "r");
  int pid_read;
  if (fscanf(f, "%d %d %d\n", &pid_read, &e->memfd, &e->n) != 3)
    die("exporter output");
  e->pid = pid;
  e->handles = calloc((size_t)n, HANDLE_MAX);
  e->lens = calloc((size_t)n, sizeof(size_t));
  static char line[2 * HANDLE_MAX + 2];
  for (int i = 0; i < n; i++) {
    if (!fgets(line, sizeof(line), f))
      die("exporter handle");
    size_t hl = strcspn(line, "\n") / 2;
    for (size_t k = 0; k < hl; k++) {
      unsigned v;
      sscanf(line + 2 * k, "%2x", &v);
      e->handles[i][k] = (uint8_t)v;
    }
    e->lens[i] = hl;
  }
  fclose(f);
}

static void exporter_stop(exporter_t *e) {
  /* Later exporters inherited this one's pipe (fork, no exec): a hang-up
   * alone would not reach it. */
  close(e->hangup);
  kill(e->pid, SIGTERM);
  waitpid(e->pid, NULL, 0);
  free(e->handles);
  free(e->lens);
}

/* ---- the samples --------------------------------------------------------- */

static volatile uint8_t sink;

static void touch(const uint8_t *p) {
  sink ^= p[0];
  sink ^= p[size - 1];
}

static double usmipc_sample(const uint8_t *h, size_t len, void **out) {
  double t0 = now_us();
  void *p;
  if (usmipc_ipc_open(h, len, NULL, 0, &p, NULL) != 0)
    die("usmipc_ipc_open");
  touch(p);
  double t = now_us() - t0;
  *out = p;
  return t;
}

/* The raw baselines' last step: maps the descriptor, touches the memory
 * and closes the descriptor; returns the microseconds since t0. */
static double map_touch_since(int fd, double t0, void **out) {
  void *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED)
    die("raw mmap");
  touch(p);
  double t = now_us() - t0;
  close(fd);
  *out = p;
  return t;
}

static double raw_pidfd_sample(const exporter_t *e, int pidfd_cached,
                               void **out) {
  double t0 = now_us();
  int pidfd = pidfd_cached >= 0 ? pidfd_cached
                                : (int)syscall(SYS_pidfd_open, e->pid, 0);
  int fd = (int)syscall(SYS_pidfd_getfd, pidfd, e->memfd, 0);
  if (fd < 0)
    die("pidfd_getfd");
  double t = map_touch_since(fd, t0, out);
  if (pidfd_cached < 0)
    close(pidfd);
  return t;
}

static double raw_socket_sample(const exporter_t *e, void **out) {
  struct sockaddr_un addr;
  socklen_t len;
  socket_name(e->pid, &addr, &len);
  double t0 = now_us();
  int s = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (connect(s, (struct sockaddr *)&addr, len) != 0)
    die("raw connect");
  uint8_t req[16] = {0};
  send(s, req, sizeof(req), MSG_NOSIGNAL);
  uint64_t reply;
  struct iovec iov = {.iov_base = &reply, .iov_len = sizeof(reply)};
  union {
    struct cmsghdr align;
    char buf[CMSG_SPACE(sizeof(int))];
  } control;
  struct msghdr msg = {.msg_iov = &iov,
                       .msg_iovlen = 1,
                       .msg_control = control.buf,
                       .msg_controllen = sizeof(control.buf)};
  if (recvmsg(s, &msg, MSG_CMSG_CLOEXEC) != (ssize_t)sizeof(reply))
    die("raw recvmsg");
  close(s);
  int fd;
  memcpy(&fd, CMSG_DATA(CMSG_FIRSTHDR(&msg)), sizeof(int));
  return map_touch_since(fd, t0, out);
}

typedef struct series {
  const char *name;
  double *ours, *raw;
  int n;
} series_t;

static void report(FILE *json, series_t *s, const char *raw_name, double target,
                   int last) {
  double *a = malloc(sizeof(double) * (size_t)s->n);
  double *b = malloc(sizeof(double) * (size_t)s->n);
  memcpy(a, s->ours, sizeof(double) * (size_t)s->n);
  memcpy(b, s->raw, sizeof(double) * (size_t)s->n);
  double ma = quantile_nearest(a, s->n, 0.5),
         mb = quantile_nearest(b, s->n, 0.5);
  printf("| %s | %.2f (%.2f-%.2f) | %s %.2f (%.2f-%.2f) | %.2fx | <= %.2fx: "
         "%s |\n",
         s->name, ma, quantile_nearest(a, s->n, 0.1),
         quantile_nearest(a, s->n, 0.9), raw_name, mb,
         quantile_nearest(b, s->n, 0.1), quantile_nearest(b, s->n, 0.9),
         ma / mb, target, ma / mb <= target ? "met" : "NOT met");
  if (json) {
    fprintf(json, "  \"%s\": {\"usmipc_us\": [", s->name);
    for (int i = 0; i < s->n; i++)
      fprintf(json, "%s%.3f", i ? "," : "", s->ours[i]);
    fprintf(json, "], \"%s_us\": [", raw_name);
    for (int i = 0; i < s->n; i++)
      fprintf(json, "%s%.3f", i ? "," : "", s->raw[i]);
    fprintf(json, "], \"median_ratio\": %.4f, \"target\": %.2f}%s\n", ma / mb,
            target, last ? "" : ",");
  }
  free(a);
  free(b);
}

int main(int argc, char **argv) {
  bench_name = "usmipc_bench_first";
  int k = 40;
  size = 1 << 20;
  const char *json_path = NULL;
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--k") && i + 1 < argc)
      k = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--size") && i + 1 < argc)
      size = parse_size(argv[++i]);
    else if (!strcmp(argv[i], "--json") && i + 1 < argc)
      json_path = argv[++i];
    else
      k = 0; /* the usage below */
  }
  if (k < 1 || size == 0) {
    fprintf(stderr, "usage: usmipc_bench_first [--k 40] [--size 1M] "
                    "[--json FILE]\n");
    return 2;
  }
  signal(SIGPIPE, SIG_IGN);
  /* Exporters first, before this process touches usmipc (they are fork
   * children: no exec, so every one shares this binary's pages). */
  exporter_t *cold = calloc((size_t)k, sizeof(*cold));
  for (int i = 0; i < k; i++)
    exporter_start(&cold[i], 1);
  exporter_t warm;
  exporter_start(&warm, 2 * k + 2);

  series_t s_cold = {"cold", calloc((size_t)k, 8), calloc((size_t)k, 8), k};
  series_t s_warm = {"warm", calloc((size_t)k, 8), calloc((size_t)k, 8), k};
  series_t s_sock = {"socket", calloc((size_t)k, 8), calloc((size_t)k, 8), k};
  void *p, *q;
  usmipc_device_t *dev;
  usmipc_device_select("host:cpu", &dev); /* probed before any sample */

  /* cold: every sample meets a new exporter, both ways. */
  for (int i = 0; i < k; i++) {
    if (i & 1) {
      s_cold.raw[i] = raw_pidfd_sample(&cold[i], -1, &q);
      s_cold.ours[i] = usmipc_sample(cold[i].handles[0], cold[i].lens[0], &p);
    } else {
      s_cold.ours[i] = usmipc_sample(cold[i].handles[0], cold[i].lens[0], &p);
      s_cold.raw[i] = raw_pidfd_sample(&cold[i], -1, &q);
    }
    usmipc_ipc_close(p);
    munmap(q, size);
  }
  /* warm: the exporter is met (its allocation 0), its pidfd is kept. */
  usmipc_sample(warm.handles[0], warm.lens[0], &p);
  usmipc_ipc_close(p);
  int pidfd = (int)syscall(SYS_pidfd_open, warm.pid, 0);
  for (int i = 0; i < k; i++) {
    const uint8_t *h = warm.handles[1 + i];
    if (i & 1) {
      s_warm.raw[i] = raw_pidfd_sample(&warm, pidfd, &q);
      s_warm.ours[i] = usmipc_sample(h, warm.lens[1 + i], &p);
    } else {
      s_warm.ours[i] = usmipc_sample(h, warm.lens[1 + i], &p);
      s_warm.raw[i] = raw_pidfd_sample(&warm, pidfd, &q);
    }
    usmipc_ipc_close(p);
    munmap(q, size);
  }
  /* socket: the same exporter, fresh allocations, through its broker. */
  setenv("USMIPC_FD_TRANSPORT", "socket", 1);
  for (int i = 0; i < k; i++) {
    const uint8_t *h = warm.handles[1 + k + i];
    if (i & 1) {
      s_sock.raw[i] = raw_socket_sample(&warm, &q);
      s_sock.ours[i] = usmipc_sample(h, warm.lens[1 + k + i], &p);
    } else {
      s_sock.ours[i] = usmipc_sample(h, warm.lens[1 + k + i], &p);
      s_sock.raw[i] = raw_socket_sample(&warm, &q);
    }
    usmipc_ipc_close(p);
    munmap(q, size);
  }
  unsetenv("USMIPC_FD_TRANSPORT");

  printf("# usmipc_bench_first %s: first open of %zu-byte host buffers, K = "
         "%d, medians in us (p10-p90)\n\n",
         usmipc_version_string(), size, k);
  printf("| case | usmipc | raw baseline | ratio | target |\n");
  printf("|---|---|---|---|---|\n");
  FILE *json = json_path ? fopen(json_path, "w") : NULL;
  if (json)
    fprintf(json, "{\n  \"size\": %zu, \"k\": %d,\n", size, k);
  report(json, &s_cold, "raw_pidfd", 2.0, 0);
  report(json, &s_warm, "raw_pidfd", 1.15, 0);
  report(json, &s_sock, "raw_socket", 1.5, 1);
  if (json) {
    fprintf(json, "}\n");
    fclose(json);
  }
  for (int i = 0; i < k; i++)
    exporter_stop(&cold[i]);
  exporter_stop(&warm);
  return 0;
}
