/* Queues, copies and fills: a device's queue (a CUstream, an immediate
 * command list; none on the host) and the work usmipc puts on it.
 *
 * Objects floor of the core, the lowest of them: it needs only the devices
 * (core/device.c) and the backends' ops. */
#include <stdlib.h>

#include "objects.h"

int usmipc_queue_create(usmipc_device_t *device, usmipc_queue_t **queue) {
  if (device == NULL || queue == NULL)
    return usmipc__fail(USMIPC_EINVAL, "usmipc_queue_create: NULL argument");
  usmipc_queue_t *q = calloc(1, sizeof(*q));
  if (q == NULL)
    return usmipc__fail(USMIPC_ENOMEM, "out of memory");
  q->device = device;
  int rc = device->ops->queue_create(device->native, &q->native);
  if (rc != 0) {
    free(q);
    return rc;
  }
  *queue = q;
  return 0;
}

int usmipc_queue_from_native(usmipc_device_t *device, void *native,
                             usmipc_queue_t **queue) {
  if (device == NULL || queue == NULL)
    return usmipc__fail(USMIPC_EINVAL,
                        "usmipc_queue_from_native: NULL argument");
  *queue = NULL;
  if (device->ops->backend == USMIPC_BACKEND_HOST && native != NULL)
    return usmipc__fail(USMIPC_EINVAL,
                        "usmipc_queue_from_native: %s has no native queues "
                        "(its work completes at once); pass NULL",
                        device->filter);
  if (device->ops->backend != USMIPC_BACKEND_HOST &&
      device->ops->queue_wrap == NULL)
    return usmipc__fail(USMIPC_ENOTSUP,
                        "usmipc_queue_from_native: %s devices cannot wrap "
                        "native queues yet",
                        device->ops->name);
  usmipc_queue_t *q = calloc(1, sizeof(*q));
  if (q == NULL)
    return usmipc__fail(USMIPC_ENOMEM, "out of memory");
  q->device = device;
  q->wrapped = true;
  q->native = native;
  if (device->ops->queue_wrap != NULL) {
    int rc = device->ops->queue_wrap(device->native, native, &q->native);
    if (rc != 0) {
      free(q);
      return rc;
    }
  }
  *queue = q;
  return 0;
}

void *usmipc_queue_native(const usmipc_queue_t *queue) {
  if (queue == NULL)
    return NULL;
  const usmipc__backend_ops_t *ops = queue->device->ops;
  return ops->queue_native
             ? ops->queue_native(queue->device->native, queue->native)
             : queue->native;
}

int usmipc_queue_destroy(usmipc_queue_t *queue) {
  if (queue == NULL)
    return 0;
  int rc = 0;
  const usmipc__backend_ops_t *ops = queue->device->ops;
  if (!queue->wrapped)
    rc = ops->queue_destroy(queue->device->native, queue->native);
  else if (ops->queue_unwrap != NULL)
    rc = ops->queue_unwrap(queue->device->native, queue->native);
  free(queue);
  return rc;
}

usmipc_device_t *usmipc_queue_device(const usmipc_queue_t *queue) {
  return queue ? queue->device : NULL;
}

int usmipc_queue_synchronize(usmipc_queue_t *queue) {
  if (queue == NULL)
    return usmipc__fail(USMIPC_EINVAL, "usmipc_queue_synchronize: NULL queue");
  return queue->device->ops->queue_synchronize(queue->device->native,
                                               queue->native);
}

int usmipc_memcpy(usmipc_queue_t *queue, void *dst, const void *src,
                  size_t nbytes) {
  if (queue == NULL || ((dst == NULL || src == NULL) && nbytes > 0))
    return usmipc__fail(USMIPC_EINVAL, "usmipc_memcpy: NULL argument");
  if (nbytes == 0)
    return 0;
  return queue->device->ops->memcpy(queue->device->native, queue->native, dst,
                                    src, nbytes);
}

int usmipc_memset(usmipc_queue_t *queue, void *dst, int value, size_t nbytes) {
  if (queue == NULL || (dst == NULL && nbytes > 0))
    return usmipc__fail(USMIPC_EINVAL, "usmipc_memset: NULL argument");
  if (nbytes == 0)
    return 0;
  return queue->device->ops->memset(queue->device->native, queue->native, dst,
                                    value, nbytes);
}
