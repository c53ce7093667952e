/* Batched copies on CUDA (cuda_copy.c), for cuda.c's copy_batch ops: each
 * call is made with the device's context current. */
#ifndef USMIPC_BACKEND_CUDA_COPY_H
#define USMIPC_BACKEND_CUDA_COPY_H

#include "backend/backend.h"
#include "backend/cuda_driver.h"

typedef struct usmipc__cuda_copy usmipc__cuda_copy_t;

int usmipc__cuda_copy_create(usmipc__cuda_copy_t **batch);
/* Queues count copies on stream; same: the copies of the previous run. */
int usmipc__cuda_copy_run(usmipc__cuda_copy_t *batch, CUstream stream,
                          const usmipc__copy_t *copies, size_t count,
                          bool same);
/* Waits for the batch's last launch, then frees it. */
void usmipc__cuda_copy_destroy(usmipc__cuda_copy_t *batch);

#endif
