/* A C program built against an installed usmipc (tests/install/check.sh). */
#include <stdio.h>
#include <usmipc.h>

int main(void) {
  usmipc_device_t *dev;
  if (usmipc_device_select("host:cpu", &dev) != 0) {
    fprintf(stderr, "%s\n", usmipc_last_error());
    return 1;
  }
  void *p;
  if (usmipc_malloc(dev, USMIPC_MEM_DEVICE, 4096, &p) != 0)
    return 1;
  usmipc_ipc_handle_t *h;
  if (usmipc_ipc_get_handle(p, 0, &h) != 0)
    return 1;
  usmipc_ipc_free_handle(h);
  usmipc_free(p);
  printf("usmipc %s on %s\n", usmipc_version_string(),
         usmipc_device_filter_string(dev));
  return usmipc_version() == USMIPC_VERSION_HEX ? 0 : 1;
}
