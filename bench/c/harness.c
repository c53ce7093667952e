/* The harness the C benchmarks share (harness.h). */
#include "harness.h"

#include <errno.h>
#include <fcntl.h>
#include <spawn.h>
#include <string.h>
#include <sys/utsname.h>
#include <sys/wait.h>
#include <unistd.h>

extern char **environ;

const char *bench_name = "bench";

void bench_die(const char *what, int rc) {
  fprintf(stderr, "%s: %s: %s (%s)\n", bench_name, what,
          rc ? usmipc_err_name(rc) : strerror(errno),
          rc ? usmipc_last_error() : "");
  exit(1);
}

/* ---- samples and summaries ---- */

void samples_add(samples_t *s, double x) {
  if (s->n == s->cap) {
    s->cap = s->cap ? s->cap * 2 : 256;
    s->v = realloc(s->v, s->cap * sizeof(double));
    if (s->v == NULL)
      bench_die("out of memory", 0);
  }
  s->v[s->n++] = x;
}

double quantile_linear(const double *sorted, size_t n, double q) {
  double pos = q * (double)(n - 1);
  size_t lo = (size_t)pos;
  size_t hi = lo + 1 < n ? lo + 1 : lo;
  double frac = pos - (double)lo;
  return sorted[lo] * (1 - frac) + sorted[hi] * frac;
}

summary_t summarize(samples_t *s) {
  summary_t r;
  memset(&r, 0, sizeof(r));
  if (s->n == 0) {
    snprintf(r.note, sizeof(r.note), "no samples");
    return r;
  }
  qsort(s->v, s->n, sizeof(double), cmp_double);
  r.median = quantile_linear(s->v, s->n, 0.5);
  r.p10 = quantile_linear(s->v, s->n, 0.1);
  r.p90 = quantile_linear(s->v, s->n, 0.9);
  r.n = s->n;
  r.valid = 1;
  return r;
}

summary_t summarize_copy(const samples_t *s) {
  samples_t c = {NULL, 0, 0};
  for (size_t i = 0; i < s->n; i++)
    samples_add(&c, s->v[i]);
  summary_t r = summarize(&c);
  free(c.v);
  return r;
}

uint64_t xorshift64(uint64_t *x) {
  *x ^= *x << 13;
  *x ^= *x >> 7;
  *x ^= *x << 17;
  return *x;
}

void bootstrap_median_ci(const samples_t *s, double ci[2]) {
  ci[0] = ci[1] = 0;
  if (s->n < 2)
    return;
  enum { B = 2000 };
  double *meds = calloc(B, sizeof(double));
  double *tmp = calloc(s->n, sizeof(double));
  if (meds == NULL || tmp == NULL)
    bench_die("out of memory", 0);
  uint64_t x = 0x853C49E6748FEA9Bull;
  for (int b = 0; b < B; b++) {
    for (size_t i = 0; i < s->n; i++)
      tmp[i] = s->v[xorshift64(&x) % s->n];
    qsort(tmp, s->n, sizeof(double), cmp_double);
    meds[b] = quantile_linear(tmp, s->n, 0.5);
  }
  qsort(meds, B, sizeof(double), cmp_double);
  ci[0] = quantile_linear(meds, B, 0.025);
  ci[1] = quantile_linear(meds, B, 0.975);
  free(meds);
  free(tmp);
}

/* ---- an importer ---- */

int write_full(int fd, const void *buf, size_t len) {
  const char *p = buf;
  while (len > 0) {
    ssize_t n = write(fd, p, len);
    if (n < 0 && errno == EINTR)
      continue;
    if (n <= 0)
      return -1;
    p += n;
    len -= (size_t)n;
  }
  return 0;
}

int read_full(int fd, void *buf, size_t len) {
  char *p = buf;
  while (len > 0) {
    ssize_t n = read(fd, p, len);
    if (n < 0 && errno == EINTR)
      continue;
    if (n <= 0)
      return -1;
    p += n;
    len -= (size_t)n;
  }
  return 0;
}

pid_t fork_with_pipes(int *from, int *to) {
  int up[2], down[2]; /* child -> parent, parent -> child */
  if (pipe(up) != 0 || pipe(down) != 0)
    bench_die("pipe", 0);
  pid_t pid = fork();
  if (pid < 0)
    bench_die("fork", 0);
  if (pid == 0) {
    close(up[0]);
    close(down[1]);
    *to = up[1];
    *from = down[0];
    return 0;
  }
  close(up[1]);
  close(down[0]);
  *from = up[0];
  *to = down[1];
  return pid;
}

pid_t spawn_self(const char *role, const char *env_name, const char *env_value,
                 int *to, int *from) {
  int in[2], out[2];
  if (pipe2(in, O_CLOEXEC) != 0 || pipe2(out, O_CLOEXEC) != 0)
    bench_die("pipe2", 0);
  size_t name_len = strlen(env_name);
  size_t n = 0;
  while (environ[n])
    n++;
  char **env = calloc(n + 2, sizeof(char *));
  if (env == NULL)
    bench_die("out of memory", 0);
  size_t m = 0;
  for (size_t i = 0; i < n; i++)
    if (strncmp(environ[i], env_name, name_len) != 0 ||
        environ[i][name_len] != '=')
      env[m++] = environ[i];
  char setting[128];
  snprintf(setting, sizeof(setting), "%s=%s", env_name, env_value);
  env[m++] = setting;
  env[m] = NULL;
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, in[0], 0);
  posix_spawn_file_actions_adddup2(&fa, out[1], 1);
  char *argv[] = {"/proc/self/exe", (char *)role, NULL};
  pid_t pid;
  int err = posix_spawn(&pid, "/proc/self/exe", &fa, NULL, argv, env);
  posix_spawn_file_actions_destroy(&fa);
  free(env);
  if (err != 0) {
    errno = err;
    bench_die("posix_spawn", 0);
  }
  close(in[0]);
  close(out[1]);
  *to = in[1];
  *from = out[0];
  return pid;
}

void wait_child(pid_t pid) {
  int st;
  while (waitpid(pid, &st, 0) < 0 && errno == EINTR) {
  }
}

int send_handles(int fd, usmipc_ipc_handle_t *const *hs, uint32_t n) {
  for (uint32_t i = 0; i < n; i++) {
    const void *data;
    size_t len;
    usmipc_ipc_handle_data(hs[i], &data, &len);
    uint32_t l = (uint32_t)len;
    if (write_full(fd, &l, 4) != 0 || write_full(fd, data, len) != 0)
      return -1;
  }
  return 0;
}

int recv_handles(int fd, uint32_t n, uint8_t (*handles)[BENCH_HANDLE_MAX],
                 uint32_t *lens) {
  for (uint32_t i = 0; i < n; i++) {
    if (read_full(fd, &lens[i], 4) != 0 || lens[i] > BENCH_HANDLE_MAX ||
        read_full(fd, handles[i], lens[i]) != 0)
      return -1;
  }
  return 0;
}

void reply_status(int32_t status, const char *msg, const void *results,
                  size_t len) {
  write_full(1, &status, sizeof(status));
  if (status == 0)
    write_full(1, results, len);
  else
    write_full(1, msg, BENCH_MSG_LEN);
}

int read_status(int fd, int32_t *status, char msg[BENCH_MSG_LEN]) {
  *status = -1;
  if (read_full(fd, status, sizeof(*status)) != 0)
    return -1;
  if (*status != 0) {
    if (read_full(fd, msg, BENCH_MSG_LEN) != 0)
      snprintf(msg, BENCH_MSG_LEN, "importer failed");
    msg[BENCH_MSG_LEN - 1] = '\0';
  }
  return 0;
}

/* ---- sizes ---- */

size_t parse_size(const char *s) {
  char *end;
  unsigned long long v = strtoull(s, &end, 10);
  switch (*end) {
  case 'k':
  case 'K':
    v <<= 10;
    break;
  case 'm':
  case 'M':
    v <<= 20;
    break;
  case 'g':
  case 'G':
    v <<= 30;
    break;
  default:
    break;
  }
  return (size_t)v;
}

void size_label(size_t size, char *out, size_t len) {
  if (size >= (1u << 30) && size % (1u << 30) == 0)
    snprintf(out, len, "%zu GiB", size >> 30);
  else if (size >= (1u << 20) && size % (1u << 20) == 0)
    snprintf(out, len, "%zu MiB", size >> 20);
  else if (size >= 1024 && size % 1024 == 0)
    snprintf(out, len, "%zu KiB", size >> 10);
  else
    snprintf(out, len, "%zu B", size);
}

/* ---- output ---- */

void md_cell(const summary_t *s) {
  if (!s->valid)
    printf(" n/a (%s) |", s->note[0] ? s->note : "not measured");
  else
    printf(" %.2f (%.2f–%.2f) |", s->median, s->p10, s->p90);
}

FILE *json_open(const char *path, const char *mode, usmipc_device_t *dev) {
  FILE *f = fopen(path, "w");
  if (f == NULL) {
    fprintf(stderr, "%s: %s: %s\n", bench_name, path, strerror(errno));
    exit(1);
  }
  struct utsname u;
  uname(&u);
  fprintf(f, "{\n  \"tool\": \"%s\",\n", bench_name);
  if (mode != NULL)
    fprintf(f, "  \"mode\": \"%s\",\n", mode);
  fprintf(f, "  \"usmipc_version\": \"%s\",\n", usmipc_version_string());
  fprintf(f, "  \"device\": \"%s\",\n  \"device_name\": \"%s\",\n",
          usmipc_device_filter_string(dev), usmipc_device_name(dev));
  fprintf(f, "  \"kernel\": \"%s\",\n  \"unit\": \"us\",\n", u.release);
  return f;
}

void json_summary_ci(FILE *f, const char *key, const summary_t *s,
                     const double *ci) {
  if (!s->valid) {
    fprintf(f, ",\n      \"%s\": null", key);
    return;
  }
  fprintf(f,
          ",\n      \"%s\": {\"median\": %.4f, \"p10\": %.4f, "
          "\"p90\": %.4f, \"n\": %zu",
          key, s->median, s->p10, s->p90, s->n);
  if (ci)
    fprintf(f, ", \"median_ci95\": [%.4f, %.4f]", ci[0], ci[1]);
  fprintf(f, "}");
}

void json_summary(FILE *f, const char *key, const summary_t *s) {
  json_summary_ci(f, key, s, NULL);
}

void json_samples(FILE *f, const char *key, const samples_t *s, int decimals) {
  fprintf(f, ",\n        \"%s\": [", key);
  for (size_t i = 0; i < s->n; i++)
    fprintf(f, "%s%.*f", i ? ", " : "", decimals, s->v[i]);
  fprintf(f, "]");
}
