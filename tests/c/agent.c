/* The agent helper: an unrelated process that runs usmipc calls on command
 * (one line in, one line out; the protocol is in task.h). Tests start two
 * agents to play exporter and importer, or one to face the test process. */
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include "task.h"

#define AGENT_SLOTS 64
#define AGENT_HANDLES 8

typedef struct slot {
  void *ptr;
  size_t size;
  uint64_t origin; /* allocation offset of ptr[0] (exported offset if mapped) */
  usmipc_ipc_handle_t *handles[AGENT_HANDLES]; /* exports kept alive */
} slot_t;

static slot_t slots[AGENT_SLOTS];
static usmipc_queue_t *queue;
static usmipc_event_t *events[AGENT_SLOTS];

static void reply_ok(const char *fmt, ...)
    __attribute__((format(printf, 1, 2)));
static void reply_ok(const char *fmt, ...) {
  va_list ap;
  fputs("ok", stdout);
  if (fmt && fmt[0]) {
    fputc(' ', stdout);
    va_start(ap, fmt);
    vprintf(fmt, ap);
    va_end(ap);
  }
  fputc('\n', stdout);
  fflush(stdout);
}

/* The command being run, for the behaviour probe's records (probe.h). */
static const char *current_command;

static void reply_err(int code, const char *msg) {
  char clean[2048];
  snprintf(clean, sizeof(clean), "%s", msg && msg[0] ? msg : "");
  for (char *c = clean; *c; c++)
    if (*c == '\n' || *c == '\r')
      *c = ' ';
  if (getenv("USMIPC_TEST_PROBE") != NULL) {
    char what[64];
    snprintf(what, sizeof(what), "agent command %s",
             current_command ? current_command : "?");
    probe_record(__FILE__, __LINE__, what, code, clean);
  }
  printf("err %d %s %s\n", code, usmipc_err_name(code), clean);
  fflush(stdout);
}

static void reply_usmipc_err(int code) { reply_err(code, usmipc_last_error()); }

static slot_t *slot_arg(const char *s) {
  long i = s ? strtol(s, NULL, 10) : -1;
  if (i < 0 || i >= AGENT_SLOTS)
    return NULL;
  return &slots[i];
}

static usmipc_mem_kind_t kind_arg(const char *s) {
  if (s && strcmp(s, "host") == 0)
    return USMIPC_MEM_HOST;
  if (s && strcmp(s, "shared") == 0)
    return USMIPC_MEM_SHARED;
  return USMIPC_MEM_DEVICE;
}

/* Fills or checks [off, off+len) of a slot. Host memory is touched
 * directly, which is the strongest evidence of sharing; other devices go
 * through a staging buffer and the queue. */
static int pattern_op(slot_t *s, int check, uint64_t seed, size_t off,
                      size_t len, size_t *bad) {
  *bad = SIZE_MAX;
  uint8_t *p = (uint8_t *)s->ptr + off;
  if (test_device_is_host()) {
    if (check)
      *bad = pattern_check(p, len, seed, s->origin + off);
    else
      pattern_fill(p, len, seed, s->origin + off);
    return 0;
  }
  int r;
  if (queue == NULL && (r = usmipc_queue_create(test_device(), &queue)) != 0)
    return r;
  uint8_t *stage = malloc(len ? len : 1);
  if (stage == NULL)
    return USMIPC_ENOMEM;
  if (check) {
    r = usmipc_memcpy(queue, stage, p, len);
    if (r == 0)
      r = usmipc_queue_synchronize(queue);
    if (r == 0)
      *bad = pattern_check(stage, len, seed, s->origin + off);
  } else {
    pattern_fill(stage, len, seed, s->origin + off);
    r = usmipc_memcpy(queue, p, stage, len);
    if (r == 0)
      r = usmipc_queue_synchronize(queue);
  }
  free(stage);
  return r;
}

static void drop_handles(slot_t *s) {
  for (int i = 0; i < AGENT_HANDLES; i++) {
    usmipc_ipc_free_handle(s->handles[i]);
    s->handles[i] = NULL;
  }
}

static void slot_reset(slot_t *s) {
  drop_handles(s);
  memset(s, 0, sizeof(*s));
}

/* "open" and "topen": the latter also reports how long usmipc_ipc_open took,
 * measured here, in microseconds (on failure appended to the message). */
static void do_open(slot_t *s, const char *hex, const char *nbytes_arg,
                    int timed) {
  uint8_t data[4096];
  ssize_t len = hex ? hex_decode(hex, data, sizeof(data)) : -1;
  size_t nbytes = (size_t)strtoull(nbytes_arg ? nbytes_arg : "0", NULL, 10);
  if (len < 0) {
    reply_err(USMIPC_EINVAL, "bad hex");
    return;
  }
  usmipc_ipc_handle_info_t info;
  uint64_t origin = 0;
  if (usmipc_ipc_handle_inspect(data, (size_t)len, &info) == 0)
    origin = info.offset;
  void *p = NULL;
  size_t mapped = 0;
  double t0 = now_seconds();
  int r = usmipc_ipc_open(data, (size_t)len, NULL, nbytes, &p, &mapped);
  long long usec = (long long)((now_seconds() - t0) * 1e6);
  if (r) {
    if (timed) {
      char msg[1024];
      snprintf(msg, sizeof(msg), "%s [after %lld us]", usmipc_last_error(),
               usec);
      reply_err(r, msg);
    } else {
      reply_usmipc_err(r);
    }
    return;
  }
  slot_reset(s);
  s->ptr = p;
  s->size = mapped;
  s->origin = origin;
  if (timed)
    reply_ok("%p %zu %lld", p, mapped, usec);
  else
    reply_ok("%p %zu", p, mapped);
}

/* The fields of the first handle a slot exported (for commands that act on
 * the agent's own descriptors the way a buggy or hostile exporter would). */
static int slot_handle_fields(slot_t *s, trust_handle_fields_t *f) {
  const void *data;
  size_t len;
  for (int i = 0; i < AGENT_HANDLES; i++)
    if (s->handles[i] != NULL &&
        usmipc_ipc_handle_data(s->handles[i], &data, &len) == 0)
      return trust_handle_fields(data, len, f);
  reply_err(USMIPC_EINVAL, "the slot has exported nothing");
  return -1;
}

/* fifo S table|data rd|rdwr: puts a FIFO (opened O_RDONLY or O_RDWR, both
 * O_NONBLOCK) at the descriptor number that the slot's handle names for the
 * export table or for the allocation, as an exporter that closed and reused
 * the number would. The FIFO's name is unlinked at once. */
static void do_fifo(slot_t *s, const char *which, const char *mode) {
  trust_handle_fields_t f;
  if (which == NULL || mode == NULL ||
      (strcmp(which, "table") != 0 && strcmp(which, "data") != 0) ||
      (strcmp(mode, "rd") != 0 && strcmp(mode, "rdwr") != 0)) {
    reply_err(USMIPC_EINVAL, "usage: fifo S table|data rd|rdwr");
    return;
  }
  if (slot_handle_fields(s, &f) != 0)
    return;
  int target = (int)(which[0] == 't' ? f.table_fd_number : f.fd_number);
  char dir[] = "/tmp/usmipc-fifo-XXXXXX", path[64];
  if (mkdtemp(dir) == NULL) {
    reply_err(-errno, strerror(errno));
    return;
  }
  snprintf(path, sizeof(path), "%s/fifo", dir);
  int fd = -1, e = 0;
  if (mkfifo(path, 0600) != 0 ||
      (fd = open(path, (mode[2] == 'w' ? O_RDWR : O_RDONLY) | O_NONBLOCK)) <
          0 ||
      dup2(fd, target) < 0)
    e = errno;
  if (fd >= 0 && fd != target)
    close(fd);
  unlink(path);
  rmdir(dir);
  if (e != 0)
    reply_err(-e, strerror(e));
  else
    reply_ok("%d", target);
}

/* nofile N | nofile +K: sets the soft RLIMIT_NOFILE to N, or to the number
 * of descriptors open now plus K. */
static void do_nofile(const char *arg) {
  if (arg == NULL) {
    reply_err(USMIPC_EINVAL, "usage: nofile N|+K");
    return;
  }
  /* Counting needs a descriptor: only for "+K" (an absolute N also works
   * when every descriptor is taken, to restore the limit). */
  size_t open_now = arg[0] == '+' ? count_fds() : 0;
  rlim_t limit = arg[0] == '+'
                     ? (rlim_t)(open_now + strtoull(arg + 1, NULL, 10))
                     : (rlim_t)strtoull(arg, NULL, 10);
  struct rlimit rl;
  if (getrlimit(RLIMIT_NOFILE, &rl) != 0) {
    reply_err(-errno, strerror(errno));
    return;
  }
  rl.rlim_cur = limit;
  if (setrlimit(RLIMIT_NOFILE, &rl) != 0) {
    reply_err(-errno, strerror(errno));
    return;
  }
  reply_ok("%llu %zu", (unsigned long long)limit, open_now);
}

/* aslimit +MIB | aslimit off: sets the soft RLIMIT_AS to the address space
 * in use now (VmSize) plus MIB MiB, or back to the hard limit. */
static void do_aslimit(const char *arg) {
  struct rlimit rl;
  if (arg == NULL || getrlimit(RLIMIT_AS, &rl) != 0) {
    reply_err(USMIPC_EINVAL, "usage: aslimit +MIB|off");
    return;
  }
  if (strcmp(arg, "off") == 0) {
    rl.rlim_cur = rl.rlim_max;
  } else {
    unsigned long long pages = 0;
    FILE *f = fopen("/proc/self/statm", "re");
    if (f == NULL || fscanf(f, "%llu", &pages) != 1) {
      if (f != NULL)
        fclose(f);
      reply_err(USMIPC_EIO, "cannot read /proc/self/statm");
      return;
    }
    fclose(f);
    rl.rlim_cur = (rlim_t)(pages * (unsigned long long)sysconf(_SC_PAGESIZE) +
                           (strtoull(arg + (arg[0] == '+'), NULL, 10) << 20));
  }
  if (setrlimit(RLIMIT_AS, &rl) != 0) {
    reply_err(-errno, strerror(errno));
    return;
  }
  reply_ok("%llu", (unsigned long long)rl.rlim_cur);
}

static int agent_queue(void) {
  return queue != NULL ? 0 : usmipc_queue_create(test_device(), &queue);
}

static void reply_hex(const void *data, size_t len) {
  char *hex = malloc(2 * len + 1);
  hex_encode(data, len, hex);
  reply_ok("%s", hex);
  free(hex);
}

/* The bytes of a hex argument; -1 after replying "bad hex" (or none). */
static ssize_t hex_arg(const char *hex, uint8_t *out, size_t cap) {
  ssize_t len = hex ? hex_decode(hex, out, cap) : -1;
  if (len < 0)
    reply_err(USMIPC_EINVAL, "bad hex");
  return len;
}

/* Event commands (task.h): evcreate, evrecord, evhandle, evopen, evsync,
 * evquery, evwait, evdestroy on event slot E; exportord S exports slot S
 * ordered on the agent's queue; openord S HEX opens it with a host wait;
 * exportrel S orders slot S's release handle again (a new ticket);
 * release 0 HEX returns a ticket after the agent's queue; relforward 0 HEX
 * -> ok HEX2, the bytes handed on (usmipc_ipc_forward); relcount S ->
 * ok SENT RELEASED; relwait S; evtimeout MS sets the event timeout. */
static int do_event_command(const char *cmd, const char *a1, const char *a2) {
  long i = a1 ? strtol(a1, NULL, 10) : -1;
  if (strncmp(cmd, "ev", 2) != 0 && strcmp(cmd, "exportord") != 0 &&
      strcmp(cmd, "openord") != 0 && strncmp(cmd, "rel", 3) != 0 &&
      strcmp(cmd, "exportrel") != 0)
    return 0;
  if (strcmp(cmd, "evtimeout") == 0) {
    usmipc_event_set_timeout((unsigned long long)i);
    reply_ok(NULL);
    return 1;
  }
  if (i < 0 || i >= AGENT_SLOTS) {
    reply_err(USMIPC_EINVAL, "bad slot");
    return 1;
  }
  usmipc_event_t **ev = &events[i];
  int r = 0;
  if (strcmp(cmd, "evcreate") == 0) {
    r = usmipc_event_create(test_device(), 0, ev);
  } else if (strcmp(cmd, "evrecord") == 0) {
    if ((r = agent_queue()) == 0)
      r = usmipc_event_record(*ev, queue);
  } else if (strcmp(cmd, "evhandle") == 0) {
    usmipc_ipc_handle_t *h = NULL;
    const void *data;
    size_t len;
    if ((r = usmipc_ipc_get_event_handle(*ev, &h)) == 0 &&
        (r = usmipc_ipc_handle_data(h, &data, &len)) == 0)
      reply_hex(data, len);
    usmipc_ipc_free_handle(h);
    if (r == 0)
      return 1;
  } else if (strcmp(cmd, "evopen") == 0) {
    uint8_t data[4096];
    ssize_t len = hex_arg(a2, data, sizeof(data));
    if (len < 0)
      return 1;
    usmipc_event_t *opened = NULL;
    if ((r = usmipc_ipc_open_event(data, (size_t)len, NULL, &opened)) == 0) {
      usmipc_event_destroy(*ev);
      *ev = opened;
    }
  } else if (strcmp(cmd, "evsync") == 0) {
    r = usmipc_event_synchronize(*ev);
  } else if (strcmp(cmd, "evquery") == 0) {
    r = usmipc_event_query(*ev);
  } else if (strcmp(cmd, "evwait") == 0) {
    if ((r = agent_queue()) == 0 && (r = usmipc_event_wait(*ev, queue)) == 0)
      r = usmipc_queue_synchronize(queue);
  } else if (strcmp(cmd, "evdestroy") == 0) {
    r = usmipc_event_destroy(*ev);
    *ev = NULL;
  } else if (strcmp(cmd, "release") == 0) {
    uint8_t data[4096];
    ssize_t len = hex_arg(a2, data, sizeof(data));
    if (len < 0)
      return 1;
    if ((r = agent_queue()) == 0)
      r = usmipc_ipc_release(data, (size_t)len, queue);
  } else if (strcmp(cmd, "relforward") == 0) {
    uint8_t data[4096];
    ssize_t len = hex_arg(a2, data, sizeof(data));
    if (len < 0)
      return 1;
    if ((r = usmipc_ipc_forward(data, (size_t)len, data)) == 0) {
      reply_hex(data, (size_t)len);
      return 1;
    }
  } else if (strcmp(cmd, "relcount") == 0 || strcmp(cmd, "relwait") == 0) {
    slot_t *s = &slots[i];
    const int k = 0; /* the handle of exportrel */
    uint64_t sent = 0, back = 0;
    if (cmd[3] == 'c') {
      r = usmipc_ipc_handle_releases(s->handles[k], &sent, &back);
      if (r == 0) {
        reply_ok("%llu %llu", (unsigned long long)sent,
                 (unsigned long long)back);
        return 1;
      }
    } else if ((r = agent_queue()) == 0 && (r = usmipc_ipc_handle_wait_released(
                                                s->handles[k], queue)) == 0) {
      r = usmipc_queue_synchronize(queue);
    }
  } else if (strcmp(cmd, "exportrel") == 0) {
    /* One handle per slot, ordered again (a new ticket) at every call. */
    slot_t *s = &slots[i];
    const void *data;
    size_t len;
    if ((r = agent_queue()) == 0 &&
        (s->handles[0] != NULL ||
         (r = usmipc_ipc_get_handle(s->ptr, 0, &s->handles[0])) == 0) &&
        (r = usmipc_ipc_handle_order_ex(s->handles[0], queue,
                                        USMIPC_ORDER_RELEASE)) == 0 &&
        (r = usmipc_ipc_handle_data(s->handles[0], &data, &len)) == 0) {
      reply_hex(data, len);
      return 1;
    }
  } else if (strcmp(cmd, "exportord") == 0) {
    slot_t *s = &slots[i];
    usmipc_ipc_handle_t *h = NULL;
    const void *data;
    size_t len;
    if ((r = agent_queue()) == 0 &&
        (r = usmipc_ipc_get_handle(s->ptr, 0, &h)) == 0 &&
        (r = usmipc_ipc_handle_order(h, queue)) == 0 &&
        (r = usmipc_ipc_handle_data(h, &data, &len)) == 0) {
      int k = 0;
      while (k < AGENT_HANDLES - 1 && s->handles[k])
        k++;
      usmipc_ipc_free_handle(s->handles[k]);
      s->handles[k] = h;
      reply_hex(data, len);
      return 1;
    }
    usmipc_ipc_free_handle(h);
  } else if (strcmp(cmd, "openord") == 0) {
    slot_t *s = &slots[i];
    uint8_t data[4096];
    ssize_t len = a2 ? hex_decode(a2, data, sizeof(data)) : -1;
    void *p = NULL;
    size_t mapped = 0;
    if (len < 0) {
      reply_err(USMIPC_EINVAL, "bad hex");
      return 1;
    }
    r = usmipc_ipc_open_ex(data, (size_t)len, NULL, 0, NULL, 0, &p, &mapped);
    if (r == 0) {
      s->ptr = p;
      s->size = mapped;
      s->origin = 0;
    }
  } else {
    reply_err(USMIPC_EINVAL, "unknown command");
    return 1;
  }
  if (r)
    reply_usmipc_err(r);
  else
    reply_ok(NULL);
  return 1;
}

static void do_command(char *line) {
  char *save = NULL;
  char *cmd = strtok_r(line, " \n", &save);
  char *a1 = strtok_r(NULL, " \n", &save);
  char *a2 = strtok_r(NULL, " \n", &save);
  char *a3 = strtok_r(NULL, " \n", &save);
  char *a4 = strtok_r(NULL, " \n", &save);
  int r;
  current_command = cmd;

  if (cmd == NULL) {
    reply_err(USMIPC_EINVAL, "empty command");
  } else if (do_event_command(cmd, a1, a2)) {
    return;
  } else if (strcmp(cmd, "exit") == 0) {
    fflush(stdout);
    exit(0);
  } else if (strcmp(cmd, "pid") == 0) {
    reply_ok("%d", (int)getpid());
  } else if (strcmp(cmd, "fds") == 0) {
    reply_ok("%zu", count_fds_except_sockets());
  } else if (strcmp(cmd, "setuid") == 0) {
    uid_t uid = (uid_t)strtoul(a1 ? a1 : "65534", NULL, 10);
    if (setgroups(0, NULL) != 0 || setgid(uid) != 0 || setuid(uid) != 0) {
      reply_err(-errno, strerror(errno));
      return;
    }
    /* Changing credentials clears the parent-death signal: set it again. */
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    reply_ok("%d", (int)getuid());
  } else if (strcmp(cmd, "unshare") == 0) {
    if (a1 == NULL || strcmp(a1, "net") != 0) {
      reply_err(USMIPC_EINVAL, "usage: unshare net");
    } else if (unshare(CLONE_NEWNET) != 0) {
      reply_err(-errno, strerror(errno));
    } else {
      reply_ok(NULL);
    }
  } else if (strcmp(cmd, "nofile") == 0) {
    do_nofile(a1);
  } else if (strcmp(cmd, "aslimit") == 0) {
    do_aslimit(a1);
  } else if (strcmp(cmd, "cache") == 0) {
    r = usmipc_ipc_set_cache_size((size_t)strtoull(a1 ? a1 : "0", NULL, 10));
    if (r)
      reply_usmipc_err(r);
    else
      reply_ok(NULL);
  } else if (strcmp(cmd, "closeptr") == 0) {
    void *p = (void *)(uintptr_t)strtoull(a1 ? a1 : "0", NULL, 16);
    r = usmipc_ipc_close(p);
    if (r)
      reply_usmipc_err(r);
    else
      reply_ok(NULL);
  } else {
    slot_t *s = slot_arg(a1);
    if (s == NULL) {
      reply_err(USMIPC_EINVAL, "bad slot");
      return;
    }
    if (strcmp(cmd, "alloc") == 0) {
      size_t size = (size_t)strtoull(a3 ? a3 : "0", NULL, 10);
      void *p = NULL;
      r = usmipc_malloc(test_device(), kind_arg(a2), size, &p);
      if (r) {
        reply_usmipc_err(r);
        return;
      }
      slot_reset(s);
      s->ptr = p;
      s->size = size;
      reply_ok("%p", p);
    } else if (strcmp(cmd, "fill") == 0 || strcmp(cmd, "check") == 0) {
      uint64_t seed = strtoull(a2 ? a2 : "0", NULL, 10);
      size_t off = a3 ? (size_t)strtoull(a3, NULL, 10) : 0;
      size_t len = a4 ? (size_t)strtoull(a4, NULL, 10) : s->size - off;
      size_t bad;
      if (s->ptr == NULL || off > s->size || len > s->size - off) {
        reply_err(USMIPC_EINVAL, "range outside the slot");
        return;
      }
      r = pattern_op(s, cmd[0] == 'c', seed, off, len, &bad);
      if (r) {
        reply_usmipc_err(r);
      } else if (bad != SIZE_MAX) {
        char msg[160];
        snprintf(msg, sizeof(msg), "byte %zu of %zu (slot offset %zu) differs",
                 bad, len, off + bad);
        reply_err(USMIPC_EIO, msg);
      } else {
        reply_ok(NULL);
      }
    } else if (strcmp(cmd, "export") == 0) {
      size_t off = (size_t)strtoull(a2 ? a2 : "0", NULL, 10);
      size_t nbytes = (size_t)strtoull(a3 ? a3 : "0", NULL, 10);
      usmipc_ipc_handle_t *h = NULL;
      const void *data;
      size_t len;
      r = usmipc_ipc_get_handle((uint8_t *)s->ptr + off, nbytes, &h);
      if (r == 0)
        r = usmipc_ipc_handle_data(h, &data, &len);
      if (r) {
        reply_usmipc_err(r);
        usmipc_ipc_free_handle(h);
        return;
      }
      int k = 0;
      while (k < AGENT_HANDLES - 1 && s->handles[k])
        k++;
      usmipc_ipc_free_handle(s->handles[k]); /* only when all are taken */
      s->handles[k] = h;
      char *hex = malloc(2 * len + 1);
      hex_encode(data, len, hex);
      reply_ok("%s", hex);
      free(hex);
    } else if (strcmp(cmd, "freehandle") == 0) {
      drop_handles(s);
      reply_ok(NULL);
    } else if (strcmp(cmd, "open") == 0 || strcmp(cmd, "topen") == 0) {
      do_open(s, a2, a3, cmd[0] == 't');
    } else if (strcmp(cmd, "close") == 0) {
      r = usmipc_ipc_close(s->ptr);
      if (r)
        reply_usmipc_err(r);
      else
        reply_ok(NULL);
    } else if (strcmp(cmd, "free") == 0) {
      drop_handles(s);
      r = usmipc_free(s->ptr);
      if (r)
        reply_usmipc_err(r);
      else
        reply_ok(NULL);
    } else if (strcmp(cmd, "revoke") == 0) {
      r = usmipc_ipc_revoke(s->ptr);
      if (r)
        reply_usmipc_err(r);
      else
        reply_ok(NULL);
    } else if (strcmp(cmd, "memset") == 0) {
      int byte = (int)strtol(a2 ? a2 : "0", NULL, 10);
      if (s->ptr == NULL) {
        reply_err(USMIPC_EINVAL, "empty slot");
      } else if (test_device_is_host()) {
        memset(s->ptr, byte, s->size); /* touches every page */
        reply_ok(NULL);
      } else if ((queue != NULL ||
                  (r = usmipc_queue_create(test_device(), &queue)) == 0) &&
                 (r = usmipc_memset(queue, s->ptr, byte, s->size)) == 0 &&
                 (r = usmipc_queue_synchronize(queue)) == 0) {
        reply_ok(NULL);
      } else {
        reply_usmipc_err(r);
      }
    } else if (strcmp(cmd, "truncate") == 0) {
      trust_handle_fields_t f;
      off_t len = (off_t)strtoll(a2 ? a2 : "0", NULL, 10);
      if (slot_handle_fields(s, &f) != 0)
        return;
      if (ftruncate((int)f.fd_number, len) != 0)
        reply_err(-errno, strerror(errno));
      else
        reply_ok("%u", f.fd_number);
    } else if (strcmp(cmd, "fifo") == 0) {
      do_fifo(s, a2, a3);
    } else if (strcmp(cmd, "query") == 0) {
      usmipc_pointer_info_t info;
      r = usmipc_pointer_query(s->ptr, &info);
      if (r)
        reply_usmipc_err(r);
      else
        reply_ok("%p %zu %" PRIu64 " %d", info.base, info.size, info.buffer_id,
                 info.is_ipc_mapping);
    } else {
      reply_err(USMIPC_EINVAL, "unknown command");
    }
  }
}

HELPER_IMPL(agent) {
  (void)argc;
  (void)argv;
  static char line[16384];
  while (fgets(line, sizeof(line), stdin) != NULL)
    do_command(line);
  return 0; /* EOF: the test closed our stdin */
}
