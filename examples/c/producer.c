/* The producer of the two-process C sample (README, "C"): allocates device
 * memory on DEVICE (default: the default device, a GPU where there is
 * one), writes a greeting into it, and writes its IPC handle's bytes to
 * FILE. Then it waits for the consumer, which opens the handle, reads the
 * greeting and writes its answer into the same memory; the producer
 * prints that answer.
 *
 *   producer FILE [DEVICE]        (run consumer FILE in another process) */
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include <usmipc.h>

static int fail(const char *what) {
  fprintf(stderr, "producer: %s: %s\n", what, usmipc_last_error());
  return 1;
}

int main(int argc, char **argv) {
  if (argc < 2) {
    fprintf(stderr, "usage: producer FILE [DEVICE]\n");
    return 2;
  }
  usmipc_device_t *dev;
  usmipc_queue_t *queue;
  void *mem;
  if (usmipc_device_select(argc > 2 ? argv[2] : NULL, &dev) != 0 ||
      usmipc_queue_create(dev, &queue) != 0)
    return fail("device");
  if (usmipc_malloc(dev, USMIPC_MEM_DEVICE, 4096, &mem) != 0)
    return fail("usmipc_malloc");
  char text[64] = "hello from the producer";
  usmipc_memcpy(queue, mem, text, sizeof text);
  usmipc_queue_synchronize(queue);

  usmipc_ipc_handle_t *h;
  const void *bytes;
  size_t len;
  if (usmipc_ipc_get_handle(mem, 0, &h) != 0 ||
      usmipc_ipc_handle_data(h, &bytes, &len) != 0)
    return fail("usmipc_ipc_get_handle");
  /* Any channel carries the bytes; here a file, written whole, then
   * renamed into place so that the consumer never reads half of it. */
  char tmp[4096];
  snprintf(tmp, sizeof tmp, "%s.tmp", argv[1]);
  FILE *f = fopen(tmp, "wb");
  if (f == NULL || fwrite(bytes, 1, len, f) != len || fclose(f) != 0 ||
      rename(tmp, argv[1]) != 0) {
    perror("producer: writing the handle");
    return 1;
  }
  printf("producer: %zu handle bytes in %s on %s; waiting\n", len, argv[1],
         usmipc_device_filter_string(dev));
  fflush(stdout);

  /* The consumer removes the file when it has written its answer. */
  for (int i = 0; access(argv[1], F_OK) == 0; i++) {
    if (i == 600) {
      fprintf(stderr, "producer: no consumer within a minute\n");
      return 1;
    }
    usleep(100 * 1000);
  }
  usmipc_memcpy(queue, text, mem, sizeof text);
  usmipc_queue_synchronize(queue);
  printf("producer: the consumer wrote \"%s\"\n", text);
  usmipc_ipc_free_handle(h);
  usmipc_free(mem);
  usmipc_queue_destroy(queue);
  return strcmp(text, "hello back from the consumer") == 0 ? 0 : 1;
}
