/* This process's identity as written into exported handles, randomness, and
 * what must be redone in a child after fork().
 *
 * Floor 1 of the core (util); fork.c runs its fork hook. */
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "util/util.h"

#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif
#define PIDFS_MAGIC_ 0x50494446 /* linux/magic.h PIDFS_MAGIC */

static usmipc__process_t self;
static pthread_once_t self_once = PTHREAD_ONCE_INIT;

static int random_direct(void *buf, size_t len) {
  uint8_t *p = buf;
  while (len > 0) {
    ssize_t n = getrandom(p, len, 0);
    if (n < 0) {
      if (errno == EINTR)
        continue;
      return usmipc__fail_native(usmipc__errno_code(errno), errno,
                                 "getrandom(2) failed: %s", strerror(errno));
    }
    p += n;
    len -= (size_t)n;
  }
  return 0;
}

/* Secrets come from getrandom(2) 480 bytes at a time: an export, an event,
 * a release ticket each draw 16, and a system call per draw was a third of
 * a fresh export's time (0.35 us of ~1.5 on a 2-vCPU VM, profiled under
 * bench/fakecuda). The bytes wait in a page the kernel zeroes in a child
 * (MADV_WIPEONFORK, Linux 4.14): a child made by fork(), by clone() without
 * the atfork handlers or by anything else never hands out bytes its parent
 * also hands out. Drawn bytes are cleared. Where the kernel refuses the
 * advice, every draw is a system call, as before. random_lock is the
 * innermost leaf of fork.c's lock order (taken under proof_lock). */
#define RANDOM_POOL_BYTES 480
typedef struct {
  uint32_t avail; /* unread bytes at the end of bytes[]; 0 in a child */
  uint8_t bytes[RANDOM_POOL_BYTES];
} random_pool_t;
static pthread_mutex_t random_lock = PTHREAD_MUTEX_INITIALIZER;
static random_pool_t *random_pool; /* NULL: not set up, or refused */
static int random_pool_state;      /* 0 not tried, 1 ready, -1 refused */

static void random_pool_setup(void) {
  long page = sysconf(_SC_PAGESIZE);
  size_t size = page > 0 ? (size_t)page : 4096;
  void *p = mmap(NULL, size, PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) {
    random_pool_state = -1;
    return;
  }
#ifdef MADV_WIPEONFORK
  if (madvise(p, size, MADV_WIPEONFORK) == 0) {
    (void)madvise(p, size, MADV_DONTDUMP); /* secrets: not in core dumps */
    random_pool = p;
    random_pool_state = 1;
    return;
  }
#endif
  munmap(p, size);
  random_pool_state = -1;
}

int usmipc__random(void *buf, size_t len) {
  if (len > RANDOM_POOL_BYTES / 4)
    return random_direct(buf, len);
  pthread_mutex_lock(&random_lock);
  if (random_pool_state == 0)
    random_pool_setup();
  random_pool_t *pool = random_pool;
  if (pool == NULL) {
    pthread_mutex_unlock(&random_lock);
    return random_direct(buf, len);
  }
  if (pool->avail < len) {
    int rc = random_direct(pool->bytes, RANDOM_POOL_BYTES);
    if (rc != 0) {
      pool->avail = 0;
      pthread_mutex_unlock(&random_lock);
      return rc;
    }
    pool->avail = RANDOM_POOL_BYTES;
  }
  uint8_t *from = pool->bytes + RANDOM_POOL_BYTES - pool->avail;
  memcpy(buf, from, len);
  explicit_bzero(from, len);
  pool->avail -= (uint32_t)len;
  pthread_mutex_unlock(&random_lock);
  return 0;
}

static int hexval(int c) {
  if (c >= '0' && c <= '9')
    return c - '0';
  if (c >= 'a' && c <= 'f')
    return c - 'a' + 10;
  if (c >= 'A' && c <= 'F')
    return c - 'A' + 10;
  return -1;
}

/* boot_id is a UUID in text; a handle carries it so that a handle from
 * another machine or from before a reboot is refused by name, not by a
 * confusing failure to reach a process that happens to share its pid. */
static void read_boot_id(uint8_t out[16]) {
  char text[64] = {0};
  memset(out, 0, 16);
  int fd = open("/proc/sys/kernel/random/boot_id", O_RDONLY | O_CLOEXEC);
  if (fd < 0)
    return;
  ssize_t n = read(fd, text, sizeof(text) - 1);
  close(fd);
  if (n <= 0)
    return;
  int k = 0;
  for (ssize_t i = 0; i + 1 < n && k < 16; i++) {
    int hi = hexval(text[i]), lo;
    if (hi < 0)
      continue;
    lo = hexval(text[i + 1]);
    if (lo < 0)
      return;
    out[k++] = (uint8_t)(hi << 4 | lo);
    i++;
  }
}

uint64_t usmipc__ns_inode(const char *pid, const char *name) {
  char path[64];
  struct stat st;
  snprintf(path, sizeof(path), "/proc/%s/ns/%s", pid, name);
  return stat(path, &st) == 0 ? (uint64_t)st.st_ino : 0;
}

uint64_t usmipc__start_time(const char *pid) {
  char path[64], text[1024];
  snprintf(path, sizeof(path), "/proc/%s/stat", pid);
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0)
    return 0;
  ssize_t n = read(fd, text, sizeof(text) - 1);
  close(fd);
  if (n <= 0)
    return 0;
  text[n] = '\0';
  /* Field 2 (comm) may hold spaces and parentheses: count from the last
   * ')'; start time is field 22, the 20th after it. */
  char *p = strrchr(text, ')');
  if (p == NULL)
    return 0;
  for (int field = 2; field < 22 && p != NULL; field++)
    p = strchr(p + 1, ' ');
  return p ? strtoull(p + 1, NULL, 10) : 0;
}

uint64_t usmipc__pidfd_inode(int pidfd) {
  struct stat st;
  struct statfs fs;
  /* Before pidfs (Linux 6.9) every pidfd was the same anon inode, which
   * proves nothing: only pidfs inodes identify a process. */
  if (fstatfs(pidfd, &fs) != 0 || fs.f_type != PIDFS_MAGIC_ ||
      fstat(pidfd, &st) != 0)
    return 0;
  return (uint64_t)st.st_ino;
}

/* PIDFD_GET_INFO (Linux 6.13, linux/pidfd.h; the headers here may predate
 * it): the credentials of the process a pidfd refers to, read through the
 * pidfd itself, in this process's user namespace. The ioctl is extensible:
 * the kernel reads the size from the request, 64 bytes is its version 0. */
struct pidfd_info_v0 {
  uint64_t mask, cgroupid;
  uint32_t pid, tgid, ppid, ruid, rgid, euid, egid, suid, sgid, fsuid, fsgid;
  uint32_t spare;
};
#define PIDFD_INFO_CREDS_ (1ull << 1)
#define PIDFD_GET_INFO_ _IOWR(0xFF, 11, struct pidfd_info_v0)
#ifndef SYS_pidfd_send_signal
#define SYS_pidfd_send_signal 424
#endif

int usmipc__pidfd_euid(int pidfd, uint32_t pid, uint32_t *euid) {
  struct pidfd_info_v0 info;
  memset(&info, 0, sizeof(info));
  info.mask = PIDFD_INFO_CREDS_;
  int r = ioctl(pidfd, PIDFD_GET_INFO_, &info);
  if (r == 0 && (info.mask & PIDFD_INFO_CREDS_)) {
    *euid = info.euid;
    return 0;
  }
  if (r != 0 && errno == ESRCH)
    return -ESRCH;
  /* An older kernel (ENOTTY): the pid's /proc entry, which names the
   * pidfd's process only if that process still holds the pid once read. A
   * pid is freed only when its process is reaped, and a signal 0 through
   * the pidfd fails with ESRCH from then on (EPERM, for another user's
   * process, still means it exists); the start time must not have changed
   * either. */
  char dir[16], path[48], text[4096];
  snprintf(dir, sizeof(dir), "%u", pid);
  uint64_t started = usmipc__start_time(dir);
  snprintf(path, sizeof(path), "/proc/%u/status", pid);
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0)
    return errno == ENOENT ? -ESRCH : -errno;
  ssize_t n = read(fd, text, sizeof(text) - 1);
  int e = errno;
  close(fd);
  if (n <= 0)
    return n == 0 ? -ESRCH : -e;
  text[n] = '\0';
  const char *uid = strstr(text, "\nUid:");
  unsigned long real, effective;
  if (uid == NULL || sscanf(uid + 5, "%lu %lu", &real, &effective) != 2)
    return -EIO;
  if ((syscall(SYS_pidfd_send_signal, pidfd, 0, NULL, 0) != 0 &&
       errno != EPERM) ||
      started == 0 || usmipc__start_time(dir) != started)
    return -ESRCH;
  *euid = (uint32_t)effective;
  return 0;
}

int usmipc__errno_code(int e) {
  switch (e) {
  case EMFILE:
  case ENFILE:
    return USMIPC_EMFILE;
  case ENOMEM:
    return USMIPC_ENOMEM;
  case EACCES:
  case EPERM:
    return USMIPC_EACCES;
  default:
    return USMIPC_EIO;
  }
}

/* What names this process instance: cheap, needed by every call. */
static void draw_basic(void) {
  self.pid = (uint32_t)getpid();
  self.uid = (uint32_t)geteuid();
  do {
    if (usmipc__random(&self.nonce, sizeof(self.nonce)) != 0)
      self.nonce = ((uint64_t)getpid() << 32) ^ (uint64_t)(uintptr_t)&self;
  } while (self.nonce == 0);
}

/* What proves it: a dozen system calls, needed only once the process
 * exports or imports (a program that only allocates never pays them).
 * Called with proof_lock held. */
static pthread_mutex_t proof_lock = PTHREAD_MUTEX_INITIALIZER;
static int proof_ready; /* read with acquire: the fields below are final */

static void draw_proof(void) {
  if (usmipc__random(self.key, sizeof(self.key)) != 0)
    abort(); /* no randomness: no secret; never guess one */
  self.start_time = usmipc__start_time("self");
  self.pidfd_ino = 0;
  int pidfd = (int)syscall(SYS_pidfd_open, getpid(), 0);
  if (pidfd >= 0) {
    self.pidfd_ino = usmipc__pidfd_inode(pidfd);
    close(pidfd);
  }
  self.pid_ns = usmipc__ns_inode("self", "pid");
  self.net_ns = usmipc__ns_inode("self", "net");
  self.user_ns = usmipc__ns_inode("self", "user");
}

/* This file's share of fork() (src/fork.c runs every module's handlers in
 * the library's lock order): the proof lock is a leaf, taken last, and the
 * child's identity is its own, a new pid and nonce now, a new key (and the
 * rest of the proof) when the child first needs them. */
void usmipc__process_fork_prepare(void) {
  pthread_mutex_lock(&proof_lock);
  pthread_mutex_lock(&random_lock);
}

void usmipc__process_fork_parent(void) {
  pthread_mutex_unlock(&random_lock);
  pthread_mutex_unlock(&proof_lock);
}

void usmipc__process_fork_child(void) {
  /* The kernel zeroed the random pool's page (MADV_WIPEONFORK). */
  pthread_mutex_unlock(&random_lock);
  if (self.pid != 0)
    draw_basic();
  proof_ready = 0;
  pthread_mutex_unlock(&proof_lock);
}

static void init_self(void) {
  read_boot_id(self.boot_id);
  draw_basic();
}

const usmipc__process_t *usmipc__self_basic(void) {
  pthread_once(&self_once, init_self);
  return &self;
}

const usmipc__process_t *usmipc__self(void) {
  pthread_once(&self_once, init_self);
  if (!__atomic_load_n(&proof_ready, __ATOMIC_ACQUIRE)) {
    pthread_mutex_lock(&proof_lock);
    if (!proof_ready) {
      draw_proof();
      __atomic_store_n(&proof_ready, 1, __ATOMIC_RELEASE);
    }
    pthread_mutex_unlock(&proof_lock);
  }
  return &self;
}
