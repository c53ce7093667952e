/* Is a descriptor a dma-buf, and how large? Level Zero's IPC handles carry a
 * dma-buf descriptor at an offset that the driver's layout decides, and that
 * layout has changed between releases: usmipc checks what it is about to
 * publish (and what it received) instead of trusting the offset. A wrong
 * guess would otherwise publish, say, the DRM device node itself.
 *
 * The kernel answers both questions without side effects: every dma-buf
 * lives on the dma-buf pseudo file system (fstatfs reports DMA_BUF_MAGIC,
 * include/uapi/linux/magic.h), and dma_buf_llseek (drivers/dma-buf/
 * dma-buf.c) answers SEEK_END with the buffer's size and accepts only
 * offset 0, so the position it moves is meaningless for a dma-buf.
 *
 * Floor 3 of the core (transport, linux/). */
#include <errno.h>
#include <string.h>
#include <sys/vfs.h>
#include <unistd.h>

#include "linux/transport.h"

#define DMA_BUF_MAGIC 0x444d4142u /* "DMAB" */

int usmipc__dmabuf_size(int fd, uint64_t *size) {
  struct statfs sf;
  if (fstatfs(fd, &sf) != 0)
    return -errno;
  if ((uint32_t)sf.f_type != DMA_BUF_MAGIC)
    return -EBADFD;
  off_t end = lseek(fd, 0, SEEK_END);
  if (end < 0)
    return -errno;
  (void)lseek(fd, 0, SEEK_SET);
  *size = (uint64_t)end;
  return 0;
}

int usmipc__dmabuf_check(int fd, uint64_t min_size, int code,
                         const char *what) {
  uint64_t size = 0;
  int e = usmipc__dmabuf_size(fd, &size);
  if (e == -EBADFD)
    return usmipc__fail(code,
                        "%s: descriptor %d is not a dma-buf (the Level Zero "
                        "driver's handle layout is not the one usmipc "
                        "expects); refused",
                        what, fd);
  if (e != 0)
    return usmipc__fail_native(code, -e, "%s: cannot inspect descriptor %d: %s",
                               what, fd, strerror(-e));
  if (size < min_size)
    return usmipc__fail(code,
                        "%s: the dma-buf is %llu bytes, smaller than the "
                        "%llu-byte allocation it should hold; refused",
                        what, (unsigned long long)size,
                        (unsigned long long)min_size);
  return 0;
}
