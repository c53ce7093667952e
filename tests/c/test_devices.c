/* Backends, device enumeration and filter strings, queues. */
#include <sys/utsname.h>
#include <unistd.h>

#include "task.h"

static usmipc_device_t *find_host_device(void) {
  usmipc_device_t *devs[64];
  size_t count = 0;
  ASSERT_OK(usmipc_get_devices(devs, 64, &count));
  for (size_t i = 0; i < count && i < 64; i++)
    if (usmipc_device_backend(devs[i]) == USMIPC_BACKEND_HOST)
      return devs[i];
  test_fail(__FILE__, __LINE__, "no host device among %zu devices", count);
}

static int gpu_backend_available(void) {
  return usmipc_backend_status(USMIPC_BACKEND_CUDA, NULL) == 0 ||
         usmipc_backend_status(USMIPC_BACKEND_LEVEL_ZERO, NULL) == 0;
}

TEST_IMPL(devices_get_devices) {
  size_t count = 0;
  /* Counting without storage. */
  ASSERT_OK(usmipc_get_devices(NULL, 0, &count));
  ASSERT_GE(count, 1);

  usmipc_device_t *devs[64];
  size_t count2 = 0;
  ASSERT_OK(usmipc_get_devices(devs, 64, &count2));
  ASSERT_EQ(count2, count);

  /* A short array is filled up to its capacity; count still says all. */
  usmipc_device_t *one[1] = {NULL};
  size_t count3 = 0;
  ASSERT_OK(usmipc_get_devices(one, 1, &count3));
  ASSERT_EQ(count3, count);
  ASSERT_PTR_EQ(one[0], devs[0]);

  int hosts = 0;
  for (size_t i = 0; i < count && i < 64; i++) {
    usmipc_device_t *d = devs[i];
    ASSERT_NOT_NULL(d);
    ASSERT_NOT_NULL(usmipc_device_name(d));
    ASSERT_GT(strlen(usmipc_device_name(d)), 0);
    ASSERT_NOT_NULL(usmipc_device_filter_string(d));
    /* The canonical filter string selects this very device. */
    usmipc_device_t *again = NULL;
    ASSERT_OK(usmipc_device_select(usmipc_device_filter_string(d), &again));
    ASSERT_PTR_EQ(again, d);
    if (usmipc_device_backend(d) != USMIPC_BACKEND_HOST)
      continue;
    hosts++;
    ASSERT_EQ(usmipc_device_type(d), USMIPC_DEVICE_CPU);
    ASSERT_EQ(usmipc_device_index(d), 0);
    ASSERT_STR_EQ(usmipc_device_filter_string(d), "host:cpu:0");
    ASSERT_EQ(usmipc_device_has_ipc(d), 1);
    uint8_t u1[16], u2[16], zero[16] = {0};
    usmipc_device_uuid(d, u1);
    usmipc_device_uuid(d, u2);
    ASSERT_EQ(memcmp(u1, u2, 16), 0);
    ASSERT_MSG(memcmp(u1, zero, 16) != 0, "host device uuid is all zero");
  }
  ASSERT_EQ(hosts, 1);

  /* Storage without room to say how much was stored. */
  ASSERT_ERR(usmipc_get_devices(NULL, 4, &count), USMIPC_EINVAL);
  return 0;
}

/* The host's driver is the kernel, its memory the machine's RAM; a caller
 * built against a shorter struct gets its prefix and nothing past it. */
TEST_IMPL(devices_info) {
  usmipc_device_t *host = find_host_device();
  usmipc_device_info_t info;
  memset(&info, 0xee, sizeof(info));
  ASSERT_OK(usmipc_device_get_info(host, &info, sizeof(info)));
  struct utsname u;
  ASSERT_EQ(uname(&u), 0);
  ASSERT_STR_EQ(info.driver_version, u.release);
  uint64_t ram = (uint64_t)sysconf(_SC_PHYS_PAGES) * sysconf(_SC_PAGESIZE);
  ASSERT_EQ(info.global_mem_size, ram);
  ASSERT_EQ(info.max_mem_alloc_size, ram);

  unsigned char raw[sizeof(usmipc_device_info_t) + 8];
  memset(raw, 0xee, sizeof(raw));
  size_t prefix = offsetof(usmipc_device_info_t, max_mem_alloc_size);
  ASSERT_OK(usmipc_device_get_info(host, (usmipc_device_info_t *)raw, prefix));
  usmipc_device_info_t got;
  memcpy(&got, raw, sizeof(got));
  ASSERT_STR_EQ(got.driver_version, u.release);
  ASSERT_EQ(got.global_mem_size, ram);
  ASSERT_EQ(raw[prefix], 0xee); /* nothing written past the prefix */

  /* Every device answers, with a version and some memory. */
  usmipc_device_t *devs[64];
  size_t count = 0;
  ASSERT_OK(usmipc_get_devices(devs, 64, &count));
  for (size_t i = 0; i < count && i < 64; i++) {
    ASSERT_OK(usmipc_device_get_info(devs[i], &info, sizeof(info)));
    ASSERT_GT(strlen(info.driver_version), 0);
    ASSERT_GT(info.global_mem_size, 0);
    ASSERT_GT(info.max_mem_alloc_size, 0);
    ASSERT_MSG(info.max_mem_alloc_size <= info.global_mem_size,
               "%s: largest allocation %llu above its memory %llu",
               usmipc_device_filter_string(devs[i]),
               (unsigned long long)info.max_mem_alloc_size,
               (unsigned long long)info.global_mem_size);
  }
  ASSERT_ERR(usmipc_device_get_info(NULL, &info, sizeof(info)), USMIPC_EINVAL);
  ASSERT_ERR(usmipc_device_get_info(host, NULL, sizeof(info)), USMIPC_EINVAL);
  ASSERT_ERR(usmipc_device_get_info(host, &info, 0), USMIPC_EINVAL);
  return 0;
}

TEST_IMPL(devices_select_host) {
  usmipc_device_t *host = find_host_device();
  static const char *const filters[] = {"host:cpu", "host:cpu:0", "host",
                                        "HOST:CPU:0"};
  for (size_t i = 0; i < 3; i++) {
    usmipc_device_t *d = NULL;
    ASSERT_OK(usmipc_device_select(filters[i], &d));
    ASSERT_PTR_EQ(d, host);
  }
  /* Filter matching is case-sensitive or not; either way it must not crash
   * and, if it succeeds, it must name the host. */
  usmipc_device_t *d = NULL;
  if (usmipc_device_select(filters[3], &d) == 0)
    ASSERT_PTR_EQ(d, host);

  /* The same device object every time: devices live as long as the process. */
  usmipc_device_t *a = NULL, *b = NULL;
  ASSERT_OK(usmipc_device_select("host:cpu", &a));
  ASSERT_OK(usmipc_device_select("host:cpu", &b));
  ASSERT_PTR_EQ(a, b);
  ASSERT_ERR(usmipc_device_select("host", NULL), USMIPC_EINVAL);
  return 0;
}

TEST_IMPL(devices_select_default) {
  usmipc_device_t *host = find_host_device();
  usmipc_device_t *d1 = NULL, *d2 = NULL;
  ASSERT_OK(usmipc_device_select(NULL, &d1));
  ASSERT_OK(usmipc_device_select("", &d2));
  ASSERT_NOT_NULL(d1);
  ASSERT_PTR_EQ(d1, d2);
  /* The default is the first GPU, else the host. */
  if (gpu_backend_available())
    ASSERT_EQ(usmipc_device_type(d1), USMIPC_DEVICE_GPU);
  else
    ASSERT_PTR_EQ(d1, host);
  return 0;
}

TEST_IMPL(devices_select_bad_filters) {
  static const char *const bad[] = {"nonsense",
                                    "host:gpu",
                                    "host:cpu:1",
                                    "host:cpu:-1",
                                    "host:cpu:x",
                                    "host:cpu:0x",
                                    "host:cpu:0:0",
                                    "host:cpu:99999999999999999999",
                                    "hostx",
                                    "cuda:gpu:4096",
                                    "level_zero:gpu:4096"};
  for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
    usmipc_device_t *d = NULL;
    int r = usmipc_device_select(bad[i], &d);
    PROBE_ERR(bad[i], r);
    ASSERT_MSG(r == USMIPC_ENODEV || r == USMIPC_EINVAL,
               "usmipc_device_select(\"%s\") returned %d (%s), expected "
               "USMIPC_ENODEV or USMIPC_EINVAL",
               bad[i], r, usmipc_err_name(r));
    ASSERT_MSG(usmipc_last_error()[0] != '\0',
               "usmipc_device_select(\"%s\") failed without a message", bad[i]);
  }
  /* A GPU that this machine does not have. */
  if (usmipc_backend_status(USMIPC_BACKEND_CUDA, NULL) != 0) {
    usmipc_device_t *d = NULL;
    ASSERT_ERR2(usmipc_device_select("cuda:gpu:7", &d), USMIPC_ENODEV,
                USMIPC_EINVAL);
    ASSERT_ERR2(usmipc_device_select("cuda", &d), USMIPC_ENODEV, USMIPC_EINVAL);
  }
  if (!gpu_backend_available()) {
    usmipc_device_t *d = NULL;
    ASSERT_ERR2(usmipc_device_select("gpu", &d), USMIPC_ENODEV, USMIPC_EINVAL);
  }
  return 0;
}

TEST_IMPL(devices_backend_status) {
  const char *reason = NULL;
  ASSERT_OK(usmipc_backend_status(USMIPC_BACKEND_HOST, &reason));
  ASSERT_OK(usmipc_backend_status(USMIPC_BACKEND_HOST, NULL));
  ASSERT_STR_EQ(usmipc_backend_name(USMIPC_BACKEND_HOST), "host");
  ASSERT_STR_EQ(usmipc_backend_name(USMIPC_BACKEND_CUDA), "cuda");
  ASSERT_STR_EQ(usmipc_backend_name(USMIPC_BACKEND_LEVEL_ZERO), "level_zero");
  ASSERT_NOT_NULL(usmipc_backend_name((usmipc_backend_t)0));
  ASSERT_NOT_NULL(usmipc_backend_name((usmipc_backend_t)99));

  usmipc_backend_t gpus[] = {USMIPC_BACKEND_CUDA, USMIPC_BACKEND_LEVEL_ZERO};
  for (int i = 0; i < 2; i++) {
    reason = NULL;
    int r = usmipc_backend_status(gpus[i], &reason);
    if (r != 0) {
      probe_record(__FILE__, __LINE__, usmipc_backend_name(gpus[i]), r, reason);
      ASSERT_EQ(r, USMIPC_EUNAVAILABLE);
      ASSERT_NOT_NULL(reason);
      ASSERT_MSG(reason[0] != '\0', "%s unavailable without a reason",
                 usmipc_backend_name(gpus[i]));
    }
  }
  ASSERT_NE(usmipc_backend_status((usmipc_backend_t)99, &reason), 0);
  return 0;
}

TEST_IMPL(devices_queue) {
  usmipc_device_t *dev = test_device();
  usmipc_queue_t *q1 = NULL, *q2 = NULL;
  ASSERT_OK(usmipc_queue_create(dev, &q1));
  ASSERT_OK(usmipc_queue_create(dev, &q2));
  ASSERT_NOT_NULL(q1);
  ASSERT_PTR_NE(q1, q2);
  ASSERT_PTR_EQ(usmipc_queue_device(q1), dev);
  ASSERT_OK(usmipc_queue_synchronize(q1));
  ASSERT_OK(usmipc_queue_destroy(q1));
  ASSERT_OK(usmipc_queue_destroy(q2));
  ASSERT_ERR(usmipc_queue_create(NULL, &q1), USMIPC_EINVAL);
  ASSERT_ERR(usmipc_queue_create(dev, NULL), USMIPC_EINVAL);
  return 0;
}
