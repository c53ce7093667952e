/* Memory: the public allocation calls and pointer queries.
 *
 * Objects floor of the core, above pools (a pool block's free and query go
 * to its pool) and the region registry (core/region.c), which allocates
 * and frees usmipc's own memory. */
#include <stdlib.h>
#include <string.h>

#include "objects.h"

int usmipc_malloc(usmipc_device_t *device, usmipc_mem_kind_t kind,
                  size_t nbytes, void **ptr) {
  return usmipc_malloc_flags(device, kind, nbytes, 0, ptr);
}

int usmipc_malloc_flags(usmipc_device_t *device, usmipc_mem_kind_t kind,
                        size_t nbytes, unsigned flags, void **ptr) {
  usmipc__registry_ensure();
  if (device == NULL || ptr == NULL)
    return usmipc__fail(USMIPC_EINVAL, "usmipc_malloc: device and ptr must "
                                       "not be NULL");
  *ptr = NULL;
  if (kind != USMIPC_MEM_DEVICE && kind != USMIPC_MEM_HOST &&
      kind != USMIPC_MEM_SHARED)
    return usmipc__fail(USMIPC_EINVAL,
                        "usmipc_malloc: kind %d is not device, host or shared",
                        (int)kind);
  if (nbytes == 0)
    return usmipc__fail(USMIPC_EINVAL,
                        "usmipc_malloc: cannot allocate 0 bytes; ask for at "
                        "least one");
  if ((flags & ~(USMIPC_ALLOC_IPC_FD | USMIPC_ALLOC_IPC_NATIVE)) != 0 ||
      flags == (USMIPC_ALLOC_IPC_FD | USMIPC_ALLOC_IPC_NATIVE))
    return usmipc__fail(USMIPC_EINVAL,
                        "usmipc_malloc_flags: flags 0x%x are unknown or "
                        "contradict each other; pass USMIPC_ALLOC_IPC_FD or "
                        "USMIPC_ALLOC_IPC_NATIVE or 0",
                        flags);
  return usmipc__local_alloc(device, kind, nbytes, flags, ptr);
}

int usmipc_free(void *ptr) {
  usmipc__registry_ensure();
  if (ptr == NULL)
    return 0;
  /* A pool block: back to its pool (segments live until the pool is
   * destroyed). Anything else is freed (or refused) as an allocation. */
  pthread_mutex_lock(&usmipc__registry_lock);
  usmipc__region_t *r = usmipc__region_find(ptr);
  void *segment =
      r != NULL && r->origin == USMIPC__LOCAL ? r->pool_segment : NULL;
  pthread_mutex_unlock(&usmipc__registry_lock);
  if (segment != NULL)
    return usmipc__pool_free(segment, ptr);
  return usmipc__local_free(ptr);
}

int usmipc_pointer_query(const void *ptr, usmipc_pointer_info_t *info) {
  usmipc__registry_ensure();
  if (info == NULL)
    return usmipc__fail(USMIPC_EINVAL, "usmipc_pointer_query: info is NULL");
  memset(info, 0, sizeof(*info));
  pthread_mutex_lock(&usmipc__registry_lock);
  usmipc__region_t *r = usmipc__region_find(ptr);
  if (r != NULL && r->origin == USMIPC__IMPORTED && r->open_refs == 0) {
    /* A closed mapping kept only by the import cache. The driver still
     * knows the range, so asking it would describe a pointer the user may
     * no longer use. */
    pthread_mutex_unlock(&usmipc__registry_lock);
    return usmipc__fail(USMIPC_EUNKNOWNPTR,
                        "pointer %p is in an IPC mapping that was closed; "
                        "open the handle again to use it",
                        ptr);
  }
  if (r != NULL) {
    info->device = r->device;
    info->kind = r->alloc.kind;
    info->base = r->alloc.base;
    info->size = r->alloc.size;
    info->buffer_id = r->buffer_id;
    info->is_ipc_mapping = r->origin == USMIPC__IMPORTED;
    info->is_foreign = r->origin == USMIPC__FOREIGN_ALIAS;
    /* A pool block: the block, not its segment (registry, then pool lock). */
    int rc = r->pool_segment != NULL
                 ? usmipc__pool_query(r->pool_segment, ptr, info)
                 : 0;
    pthread_mutex_unlock(&usmipc__registry_lock);
    return rc;
  }
  pthread_mutex_unlock(&usmipc__registry_lock);

  /* Not ours: ask the drivers (a CUDA pointer from another library). */
  usmipc__allocation_t a = {0};
  int rc =
      usmipc__foreign_query_unlocked(ptr, &a, &info->buffer_id, &info->device);
  if (rc != 0) {
    memset(info, 0, sizeof(*info));
    return rc;
  }
  info->kind = a.kind;
  info->base = a.base;
  info->size = a.size;
  info->is_foreign = 1;
  return 0;
}
