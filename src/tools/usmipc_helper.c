/* usmipc-helper: the processes the library spawns when it needs other
 * processes of its own: the two halves of the Level Zero self-test
 * (src/backend/level_zero.c, "the self-test"), so that the library tests
 * its own sharing end to end while the backend calls no public API.
 *
 *   usmipc-helper ze-selftest DEVICE-UUID-HEX
 *
 * The exporter: allocates 1 MiB on the level_zero device with that UUID,
 * fills it with a pattern, exports it through usmipc and writes the handle
 * in hex on stdout; then waits for a line on stdin and exits, freeing it.
 * Errors go to stdout as "error CODE MESSAGE".
 *
 *   usmipc-helper ze-selftest-open DEVICE-UUID-HEX HANDLE-HEX
 *
 * The importer: opens the handle on that device through the whole usmipc
 * path, with the descriptor at another number than in the exporter, copies
 * the memory back and compares every byte. One line on stdout: "ok";
 * "broken REASON" when sharing itself failed (the open, or the bytes: a
 * verdict on the driver); "error REASON" when the test could not run.
 *
 * Both run with USMIPC_ZE_SELFTEST=0 (they are the self-test). The top
 * floor of the core: a program over the public API, and the handle's
 * decoder for the exporter's descriptor number. */
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "usmipc.h"
#include "wire/wire.h"

#define SELFTEST_BYTES (1u << 20)

static uint8_t selftest_byte(size_t i) {
  return (uint8_t)(i * 31 + (i >> 12) + 7);
}

/* The level_zero device with this UUID (hex) in *out, or NULL: 0, or the
 * error of listing the devices. */
static int device_of(const char *uuid_hex, usmipc_device_t **out) {
  usmipc_device_t *devices[64];
  size_t count = 0;
  *out = NULL;
  int rc = usmipc_get_devices(devices, 64, &count);
  if (rc != 0)
    return rc;
  for (size_t i = 0; i < count && i < 64 && *out == NULL; i++) {
    uint8_t uuid[16];
    char hex[33];
    if (usmipc_device_backend(devices[i]) != USMIPC_BACKEND_LEVEL_ZERO)
      continue;
    usmipc_device_uuid(devices[i], uuid);
    for (int k = 0; k < 16; k++)
      snprintf(hex + 2 * k, 3, "%02x", uuid[k]);
    if (strcmp(hex, uuid_hex) == 0)
      *out = devices[i];
  }
  return 0;
}

static int fail(const char *what, int rc) {
  printf("error %d %s: %s\n", rc, what, usmipc_last_error());
  fflush(stdout);
  return 1;
}

static int ze_selftest(const char *uuid_hex) {
  usmipc_device_t *dev;
  int rc = device_of(uuid_hex, &dev);
  if (rc != 0)
    return fail("listing devices", rc);
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
    pattern[i] = selftest_byte(i);
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

/* The importer's verdict line; returns the exit status. */
static int verdict(const char *kind, const char *reason) {
  if (reason == NULL)
    printf("%s\n", kind);
  else
    printf("%s %s\n", kind, reason);
  fflush(stdout);
  return 0;
}

static int ze_selftest_open(const char *uuid_hex, const char *handle_hex) {
  char reason[512];
  usmipc_device_t *dev;
  if (device_of(uuid_hex, &dev) != 0)
    dev = NULL;
  size_t hlen = strlen(handle_hex) / 2;
  uint8_t *bytes = malloc(hlen + 1), *copy = malloc(SELFTEST_BYTES);
  if (dev == NULL || bytes == NULL || copy == NULL) {
    free(bytes);
    free(copy);
    return verdict("error", dev == NULL ? "cannot set up the self-test: no "
                                          "such device"
                                        : "out of memory");
  }
  for (size_t i = 0; i < hlen; i++) {
    unsigned v = 0;
    sscanf(handle_hex + 2 * i, "%2x", &v);
    bytes[i] = (uint8_t)v;
  }
  /* The descriptor must arrive at another number than the exporter's: hold
   * the exporter's number here if it is the next free one. */
  int hold = -1;
  usmipc__wire_t w;
  if (usmipc__wire_decode(bytes, hlen, &w) == 0) {
    hold = open("/dev/null", O_RDONLY | O_CLOEXEC);
    if (hold >= 0 && (uint32_t)hold != w.fd_number) {
      close(hold);
      hold = -1;
    }
  }
  void *p = NULL;
  usmipc_queue_t *q = NULL;
  const char *kind = "ok";
  reason[0] = '\0';
  if (usmipc_ipc_open(bytes, hlen, dev, 0, &p, NULL) != 0) {
    snprintf(reason, sizeof(reason),
             "opening the self-test's memory failed: %.400s",
             usmipc_last_error());
    kind = "broken";
  } else if (usmipc_queue_create(dev, &q) != 0 ||
             usmipc_memcpy(q, copy, p, SELFTEST_BYTES) != 0 ||
             usmipc_queue_synchronize(q) != 0) {
    snprintf(reason, sizeof(reason),
             "reading the self-test's memory failed: %.400s",
             usmipc_last_error());
    kind = "error";
  } else {
    for (size_t i = 0; i < SELFTEST_BYTES; i++)
      if (copy[i] != selftest_byte(i)) {
        snprintf(reason, sizeof(reason),
                 "the memory another process exported read back wrong (byte "
                 "%zu is 0x%02x, not 0x%02x): this driver's IPC maps other "
                 "memory than it was given",
                 i, copy[i], selftest_byte(i));
        kind = "broken";
        break;
      }
  }
  if (q != NULL)
    usmipc_queue_destroy(q);
  if (p != NULL)
    usmipc_ipc_close(p);
  if (hold >= 0)
    close(hold);
  free(bytes);
  free(copy);
  return verdict(kind, reason[0] != '\0' ? reason : NULL);
}

int main(int argc, char **argv) {
  if (argc == 3 && strcmp(argv[1], "ze-selftest") == 0)
    return ze_selftest(argv[2]);
  if (argc == 4 && strcmp(argv[1], "ze-selftest-open") == 0)
    return ze_selftest_open(argv[2], argv[3]);
  fprintf(stderr, "usage: usmipc-helper ze-selftest DEVICE-UUID-HEX\n"
                  "       usmipc-helper ze-selftest-open DEVICE-UUID-HEX "
                  "HANDLE-HEX\n");
  return 2;
}
