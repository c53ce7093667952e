/* The dma-buf check (src/linux/dmabuf.c) that the Level Zero backend applies
 * to the descriptor in a driver's IPC handle: a memfd, a pipe and a regular
 * file are refused everywhere; on a CUDA machine whose driver exports
 * dma-bufs (cuMemGetHandleForAddressRange), a genuine dma-buf of device
 * memory is accepted with its true size. This kernel has no udmabuf, so the
 * CUDA run is the only place a real dma-buf is checked. */
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "objects.h"
#include "task.h"

TEST_IMPL(dmabuf_check_refuses_others) {
  int memfd = memfd_create("not-a-dmabuf", MFD_CLOEXEC);
  ASSERT(memfd >= 0);
  ASSERT_EQ(ftruncate(memfd, 1 << 20), 0);
  int pipefd[2];
  ASSERT_EQ(pipe2(pipefd, O_CLOEXEC), 0);
  int devnull = open("/dev/null", O_RDWR | O_CLOEXEC);
  ASSERT(devnull >= 0);
  int fds[] = {memfd, pipefd[0], devnull};
  for (size_t i = 0; i < sizeof(fds) / sizeof(fds[0]); i++) {
    uint64_t size = 0;
    ASSERT_EQ(usmipc__dmabuf_size(fds[i], &size), -EBADFD);
    ASSERT_EQ(usmipc__dmabuf_check(fds[i], 1, USMIPC_ENOTSUP, "export"),
              USMIPC_ENOTSUP);
    PROBE_ERR("usmipc__dmabuf_check(fds[i], 1, USMIPC_ENOTSUP, \"export\")",
              USMIPC_ENOTSUP);
    ASSERT_MSG(strstr(usmipc_last_error(), "not a dma-buf") != NULL,
               "message: %s", usmipc_last_error());
  }
  /* A closed descriptor: an errno, not "not a dma-buf". */
  ASSERT_EQ(usmipc__dmabuf_check(1000000, 1, USMIPC_EUNTRUSTED, "import"),
            USMIPC_EUNTRUSTED);
  PROBE_ERR("usmipc__dmabuf_check(1000000, 1, USMIPC_EUNTRUSTED, \"import\")",
            USMIPC_EUNTRUSTED);
  ASSERT_MSG(strstr(usmipc_last_error(), "cannot inspect") != NULL,
             "message: %s", usmipc_last_error());
  close(memfd);
  close(pipefd[0]);
  close(pipefd[1]);
  close(devnull);
  return 0;
}

/* CUDA driver API, the few entry points used here. */
typedef int (*cu_init_t)(unsigned);
typedef int (*cu_device_get_t)(int *, int);
typedef int (*cu_attr_t)(int *, int, int);
typedef int (*cu_primary_retain_t)(void **, int);
typedef int (*cu_ctx_set_t)(void *);
typedef int (*cu_range_handle_t)(void *, unsigned long long, size_t, int,
                                 unsigned long long);
#define CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED 124
#define CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD 1

TEST_IMPL(dmabuf_check_cuda) {
  usmipc_device_t *dev = test_device();
  if (usmipc_device_backend(dev) != USMIPC_BACKEND_CUDA)
    RETURN_SKIP("the test device is not a CUDA GPU (USMIPC_TEST_DEVICE)");
  void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  ASSERT_NOT_NULL(lib);
  cu_init_t cu_init = (cu_init_t)dlsym(lib, "cuInit");
  cu_device_get_t cu_device_get = (cu_device_get_t)dlsym(lib, "cuDeviceGet");
  cu_attr_t cu_attr = (cu_attr_t)dlsym(lib, "cuDeviceGetAttribute");
  cu_primary_retain_t cu_retain =
      (cu_primary_retain_t)dlsym(lib, "cuDevicePrimaryCtxRetain");
  cu_ctx_set_t cu_ctx_set = (cu_ctx_set_t)dlsym(lib, "cuCtxSetCurrent");
  cu_range_handle_t cu_range =
      (cu_range_handle_t)dlsym(lib, "cuMemGetHandleForAddressRange");
  ASSERT(cu_init && cu_device_get && cu_attr && cu_retain && cu_ctx_set);
  if (cu_range == NULL)
    RETURN_SKIP("the CUDA driver has no cuMemGetHandleForAddressRange");
  int cudev = 0, supported = 0;
  void *ctx = NULL;
  ASSERT_EQ(cu_init(0), 0);
  ASSERT_EQ(cu_device_get(&cudev, usmipc_device_index(dev)), 0);
  ASSERT_EQ(cu_attr(&supported, CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED, cudev),
            0);
  if (!supported)
    RETURN_SKIP("this GPU's driver does not export dma-bufs");
  ASSERT_EQ(cu_retain(&ctx, cudev), 0);
  ASSERT_EQ(cu_ctx_set(ctx), 0);
  const size_t n = 2 << 20;
  void *p = NULL;
  ASSERT_EQ(usmipc_malloc(dev, USMIPC_MEM_DEVICE, n, &p), 0);
  int fd = -1;
  int r = cu_range(&fd, (unsigned long long)(uintptr_t)p, n,
                   CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, 0);
  ASSERT_MSG(r == 0 && fd >= 0, "cuMemGetHandleForAddressRange: %d", r);
  uint64_t size = 0;
  ASSERT_EQ(usmipc__dmabuf_size(fd, &size), 0);
  printf("CUDA dma-buf of a %zu-byte allocation: %llu bytes\n", n,
         (unsigned long long)size);
  ASSERT(size >= n);
  ASSERT_EQ(usmipc__dmabuf_check(fd, n, USMIPC_ENOTSUP, "export"), 0);
  ASSERT_EQ(usmipc__dmabuf_check(fd, size + 1, USMIPC_ENOTSUP, "export"),
            USMIPC_ENOTSUP);
  PROBE_ERR("usmipc__dmabuf_check(fd, size + 1, USMIPC_ENOTSUP, \"export\")",
            USMIPC_ENOTSUP);
  ASSERT_MSG(strstr(usmipc_last_error(), "smaller") != NULL, "message: %s",
             usmipc_last_error());
  /* Asking twice gives the same answer: the check leaves no position. */
  ASSERT_EQ(usmipc__dmabuf_size(fd, &size), 0);
  ASSERT(size >= n);
  close(fd);
  ASSERT_EQ(usmipc_free(p), 0);
  return 0;
}
