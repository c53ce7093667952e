/* The consumer of the two-process C sample (README, "C"): reads the handle
 * bytes the producer wrote to FILE, maps the producer's memory (no copy),
 * reads its greeting, writes an answer into it, and removes FILE to say
 * it is done.
 *
 *   consumer FILE */
#include <stdio.h>
#include <string.h>

#include <usmipc.h>

int main(int argc, char **argv) {
  if (argc < 2) {
    fprintf(stderr, "usage: consumer FILE\n");
    return 2;
  }
  unsigned char bytes[4096];
  FILE *f = fopen(argv[1], "rb");
  if (f == NULL) {
    perror("consumer: opening the handle file (start the producer first)");
    return 1;
  }
  size_t len = fread(bytes, 1, sizeof bytes, f);
  fclose(f);

  void *mem;
  size_t n;
  /* NULL: the device the handle names (matched by UUID here). */
  if (usmipc_ipc_open(bytes, len, NULL, 0, &mem, &n) != 0) {
    fprintf(stderr, "consumer: %s\n", usmipc_last_error());
    return 1;
  }
  usmipc_pointer_info_t info;
  usmipc_queue_t *queue;
  if (usmipc_pointer_query(mem, &info) != 0 ||
      usmipc_queue_create(info.device, &queue) != 0) {
    fprintf(stderr, "consumer: %s\n", usmipc_last_error());
    return 1;
  }
  char text[64];
  usmipc_memcpy(queue, text, mem, sizeof text); /* device memory: copy out */
  usmipc_queue_synchronize(queue);
  printf("consumer: %zu bytes mapped; the producer wrote \"%s\"\n", n, text);
  char answer[64] = "hello back from the consumer";
  usmipc_memcpy(queue, mem, answer, sizeof answer);
  usmipc_queue_synchronize(queue);
  usmipc_ipc_close(mem);
  usmipc_queue_destroy(queue);
  remove(argv[1]); /* done: the producer reads the answer */
  return strcmp(text, "hello from the producer") == 0 ? 0 : 1;
}
