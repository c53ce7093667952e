/* The registry of foreign exports (src/core/export.c): memory another
 * library allocated, exported by pointer, whose export lives as long as the
 * handles that hold it. Driven here through a device of nothing (its
 * ipc_export makes a payload of the base; nothing is mapped), so that the
 * registry's own bookkeeping runs without a GPU: 3,000 allocations (the
 * indexes grow many times), each exported twice (one export, two owners),
 * then released in an order unlike the one they were made in, with the
 * export current exactly while an owner holds it; a revoke by range takes
 * the exports it covers and leaves the rest. The GPU runs the whole path
 * (tests/gpu/test_gpu_torch_reducers.py). */
#include <pthread.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include "objects.h"
#include "task.h"

#define N_ALLOCS 3000
#define ALLOC_BYTES 65536u

static int nothing_export(void *dev, usmipc__allocation_t *alloc,
                          usmipc__payload_t *payload, int *fd) {
  (void)dev;
  payload->len = 8;
  usmipc__put64le(payload->bytes, (uint64_t)(uintptr_t)alloc->base);
  *fd = -1;
  return 0;
}

static usmipc__backend_ops_t nothing_ops = {
    .struct_size = sizeof(usmipc__backend_ops_t),
    .backend = USMIPC_BACKEND_CUDA,
    .name = "nothing",
    .ipc_export = nothing_export,
};

static usmipc_device_t nothing_device = {
    .ops = &nothing_ops,
    .type = USMIPC_DEVICE_GPU,
    .has_ipc = 1,
    .uuid = {0x6e, 0x6f, 0x74, 0x68, 0x69, 0x6e, 0x67},
    .filter = "cuda:gpu:nothing",
};

static uintptr_t base_of(size_t i) {
  return (uintptr_t)0x7e0000000000ull + i * ALLOC_BYTES;
}

/* Exports nbytes at offset of allocation i (0: to its end). */
static int export_part(size_t i, size_t offset, size_t nbytes,
                       usmipc_ipc_handle_t **h) {
  usmipc__allocation_ref_t known = {
      .buffer_id = 1000 + i,
      .base = base_of(i),
      .size = ALLOC_BYTES,
      .device = &nothing_device,
      .foreign = true,
      .alloc = {.base = (void *)base_of(i),
                .size = ALLOC_BYTES,
                .kind = USMIPC_MEM_DEVICE,
                .fd = -1}};
  return usmipc__export_foreign((const void *)(base_of(i) + offset), nbytes,
                                &known, h);
}

static int export_one(size_t i, usmipc_ipc_handle_t **h) {
  return export_part(i, 0, 0, h);
}

static int current(const usmipc_ipc_handle_t *h) {
  usmipc__wire_t w;
  const void *data;
  size_t len;
  if (usmipc_ipc_handle_data(h, &data, &len) != 0 ||
      usmipc__wire_decode(data, len, &w) != 0)
    return -1;
  pthread_mutex_lock(&usmipc__registry_lock);
  bool c = usmipc__foreign_export_current(
      w.buffer_id, (const void *)(uintptr_t)w.exporter_base, w.export_slot,
      w.token);
  pthread_mutex_unlock(&usmipc__registry_lock);
  return c;
}

TEST_IMPL(export_foreign_registry) {
  static usmipc_ipc_handle_t *first[N_ALLOCS], *second[N_ALLOCS];
  for (size_t i = 0; i < N_ALLOCS; i++) {
    ASSERT_MSG(export_one(i, &first[i]) == 0, "export %zu: %s", i,
               usmipc_last_error());
    ASSERT_MSG(export_one(i, &second[i]) == 0, "export %zu again: %s", i,
               usmipc_last_error());
  }
  for (size_t i = 0; i < N_ALLOCS; i++) {
    /* The second export of an allocation is the same export: the same
     * slot and token, so its bytes equal the first's. */
    const void *a, *b;
    size_t la, lb;
    ASSERT_MSG(usmipc_ipc_handle_data(first[i], &a, &la) == 0 &&
                   usmipc_ipc_handle_data(second[i], &b, &lb) == 0 &&
                   la == lb && memcmp(a, b, la) == 0,
               "allocation %zu exported twice made two exports", i);
    ASSERT_MSG(current(first[i]) == 1, "export %zu not current", i);
  }
  /* The first owners go, in a scattered order: every export stays. */
  for (size_t k = 0; k < N_ALLOCS; k++)
    usmipc_ipc_free_handle(first[(k * 7919) % N_ALLOCS]);
  for (size_t i = 0; i < N_ALLOCS; i++)
    ASSERT_MSG(current(second[i]) == 1,
               "export %zu gone while a handle holds it", i);
  /* Every third allocation's last owner goes: those exports alone end
   * (asked again through a copy of the freed handle's bytes). */
  for (size_t i = 0; i < N_ALLOCS; i += 3) {
    usmipc_ipc_handle_t *h = second[i];
    second[i] = NULL;
    const void *d;
    size_t len;
    ASSERT(usmipc_ipc_handle_data(h, &d, &len) == 0);
    uint8_t copy[512];
    ASSERT(len <= sizeof(copy));
    memcpy(copy, d, len);
    usmipc_ipc_free_handle(h);
    usmipc__wire_t w;
    ASSERT(usmipc__wire_decode(copy, len, &w) == 0);
    pthread_mutex_lock(&usmipc__registry_lock);
    bool c = usmipc__foreign_export_current(
        w.buffer_id, (const void *)(uintptr_t)w.exporter_base, w.export_slot,
        w.token);
    pthread_mutex_unlock(&usmipc__registry_lock);
    ASSERT_MSG(!c, "export %zu still current after its last handle", i);
  }
  for (size_t i = 0; i < N_ALLOCS; i++)
    if (i % 3 != 0)
      ASSERT_MSG(current(second[i]) == 1,
                 "export %zu ended with another's last handle", i);
  /* A part of an allocation is no copy of the whole's handle: it names its
   * own offset and length, under the same export. */
  {
    usmipc_ipc_handle_t *part;
    ASSERT(export_part(4, 4096, 512, &part) == 0);
    usmipc__wire_t w, whole;
    const void *d;
    size_t len;
    ASSERT(usmipc_ipc_handle_data(part, &d, &len) == 0 &&
           usmipc__wire_decode(d, len, &w) == 0);
    ASSERT(usmipc_ipc_handle_data(second[4], &d, &len) == 0 &&
           usmipc__wire_decode(d, len, &whole) == 0);
    ASSERT_MSG(w.offset == 4096 && w.nbytes == 512 &&
                   w.export_slot == whole.export_slot &&
                   memcmp(w.token, whole.token, 16) == 0,
               "a part: offset %llu nbytes %llu, slot %u (whole's %u)",
               (unsigned long long)w.offset, (unsigned long long)w.nbytes,
               w.export_slot, whole.export_slot);
    usmipc_ipc_free_handle(part);
  }
  /* A fork child is another process: its export of the same allocation
   * names the child (its pid and nonce), not a copy of the parent's. */
  {
    usmipc__wire_t parent;
    const void *d;
    size_t len;
    ASSERT(usmipc_ipc_handle_data(second[5], &d, &len) == 0 &&
           usmipc__wire_decode(d, len, &parent) == 0);
    pid_t child = fork();
    ASSERT(child >= 0);
    if (child == 0) {
      usmipc_ipc_handle_t *h;
      usmipc__wire_t w;
      int ok = export_one(5, &h) == 0 &&
               usmipc_ipc_handle_data(h, &d, &len) == 0 &&
               usmipc__wire_decode(d, len, &w) == 0 &&
               w.pid == (uint32_t)getpid() && w.nonce != parent.nonce;
      _exit(ok ? 0 : 1);
    }
    int status;
    ASSERT(waitpid(child, &status, 0) == child);
    ASSERT_MSG(WIFEXITED(status) && WEXITSTATUS(status) == 0,
               "the fork child's export named its parent (status %d)", status);
  }
  /* A revoke by range (a pointer inside allocation 1) ends that export
   * alone; its handle's release then finds nothing to release. */
  ASSERT(usmipc_ipc_revoke((const void *)(base_of(1) + 100)) == 0);
  ASSERT_MSG(current(second[1]) == 0, "revoked export 1 still current");
  ASSERT_MSG(current(second[2]) == 1, "export 2 ended with 1's revoke");
  uint8_t old2[512];
  const void *d2;
  size_t len2;
  ASSERT(usmipc_ipc_handle_data(second[2], &d2, &len2) == 0 &&
         len2 <= sizeof(old2));
  memcpy(old2, d2, len2);
  for (size_t i = 0; i < N_ALLOCS; i++)
    usmipc_ipc_free_handle(second[i]);
  /* All gone: a new export of allocation 2 is a new one (another token),
   * no copy of the ended export's handle. */
  usmipc_ipc_handle_t *again;
  ASSERT(export_one(2, &again) == 0);
  ASSERT(current(again) == 1);
  usmipc__wire_t was, now;
  ASSERT(usmipc__wire_decode(old2, len2, &was) == 0);
  ASSERT(usmipc_ipc_handle_data(again, &d2, &len2) == 0 &&
         usmipc__wire_decode(d2, len2, &now) == 0);
  ASSERT_MSG(memcmp(was.token, now.token, 16) != 0,
             "the new export reuses the ended one's token");
  usmipc_ipc_free_handle(again);
  return 0;
}
