/* usmipc-helper: the process the library spawns when it needs a second
 * process of its own. Today one job:
 *
 *   usmipc-helper ze-selftest DEVICE-UUID-HEX
 *
 * The Level Zero self-test's exporter (src/backend/level_zero.c, "the
 * self-test"): allocates 1 MiB on the level_zero device with that UUID,
 * fills it with a pattern, exports it through usmipc and writes the handle
 * in hex on stdout; then waits for a line on stdin and exits, freeing it.
 * Errors go to stdout as "error CODE MESSAGE". It runs with
 * USMIPC_ZE_SELFTEST=0 (it is the self-test). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "usmipc.h"

#define SELFTEST_BYTES (1u << 20)

static int fail(const char *what, int rc) {
  printf("error %d %s: %s\n", rc, what, usmipc_last_error());
  fflush(stdout);
  return 1;
}

static int ze_selftest(const char *uuid_hex) {
  usmipc_device_t *devices[64];
  size_t count = 0;
  int rc = usmipc_get_devices(devices, 64, &count);
  if (rc != 0)
    return fail("listing devices", rc);
  usmipc_device_t *dev = NULL;
  for (size_t i = 0; i < count && i < 64 && dev == NULL; i++) {
    uint8_t uuid[16];
    char hex[33];
    if (usmipc_device_backend(devices[i]) != USMIPC_BACKEND_LEVEL_ZERO)
      continue;
    usmipc_device_uuid(devices[i], uuid);
    for (int k = 0; k < 16; k++)
      snprintf(hex + 2 * k, 3, "%02x", uuid[k]);
    if (strcmp(hex, uuid_hex) == 0)
      dev = devices[i];
  }
  if (dev == NULL)
    return fail("finding the device", USMIPC_EINVAL);
  uint8_t *pattern = malloc(SELFTEST_BYTES);
  void *p = NULL;
  usmipc_queue_t *q = NULL;
  usmipc_ipc_handle_t *h = NULL;
  const void *data;
  size_t len;
  if (pattern == NULL)
    return fail("allocating", USMIPC_ENOMEM);
  for (size_t i = 0; i < SELFTEST_BYTES; i++)
    pattern[i] = (uint8_t)(i * 31 + (i >> 12) + 7);
  if ((rc = usmipc_malloc(dev, USMIPC_MEM_DEVICE, SELFTEST_BYTES, &p)) != 0)
    return fail("allocating device memory", rc);
  if ((rc = usmipc_queue_create(dev, &q)) != 0 ||
      (rc = usmipc_memcpy(q, p, pattern, SELFTEST_BYTES)) != 0 ||
      (rc = usmipc_queue_synchronize(q)) != 0)
    return fail("filling device memory", rc);
  if ((rc = usmipc_ipc_get_handle(p, 0, &h)) != 0 ||
      (rc = usmipc_ipc_handle_data(h, &data, &len)) != 0)
    return fail("exporting", rc);
  fputs("handle ", stdout);
  for (size_t i = 0; i < len; i++)
    printf("%02x", ((const uint8_t *)data)[i]);
  fputc('\n', stdout);
  fflush(stdout);
  char line[16];
  if (fgets(line, sizeof(line), stdin) == NULL) { /* the library is done */
  }
  usmipc_ipc_free_handle(h);
  usmipc_queue_destroy(q);
  usmipc_free(p);
  free(pattern);
  return 0;
}

int main(int argc, char **argv) {
  if (argc == 3 && strcmp(argv[1], "ze-selftest") == 0)
    return ze_selftest(argv[2]);
  fprintf(stderr, "usage: usmipc-helper ze-selftest DEVICE-UUID-HEX\n");
  return 2;
}
