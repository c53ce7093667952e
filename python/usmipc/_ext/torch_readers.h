/* Floor 1 of the extension usmipc._usmipc (torch_readers.c): torch's own C
 * readers of a tensor and of a storage, called directly. */
#ifndef PYUSMIPC_TORCH_READERS_H
#define PYUSMIPC_TORCH_READERS_H

#include "util.h"

/* What the extension reads of a torch tensor: attributes (getset
 * descriptors of torch._C.TensorBase), then methods called without
 * arguments. */
typedef enum {
  PYUSMIPC_T_DTYPE,
  PYUSMIPC_T_SHAPE,
  PYUSMIPC_T_IS_CUDA,
  PYUSMIPC_T_IS_CPU,
  PYUSMIPC_T_IS_NESTED,
  PYUSMIPC_T_LAYOUT,
  PYUSMIPC_T_REQUIRES_GRAD,
  PYUSMIPC_T_IS_LEAF,
  PYUSMIPC_T_BACKWARD_HOOKS,
  PYUSMIPC_T_NBYTES,
  PYUSMIPC_T_STRIDE, /* the first method */
  PYUSMIPC_T_DATA_PTR,
  PYUSMIPC_T_SIZE,
  PYUSMIPC_T_UNTYPED_STORAGE,
  PYUSMIPC_T_GET_DEVICE,
  PYUSMIPC_T_STORAGE_OFFSET,
  PYUSMIPC_T_IS_CONTIGUOUS,
  /* of a storage (torch._C.StorageBase): methods, then is_cuda (a Python
   * property of torch's storage classes: read by name) */
  PYUSMIPC_S_DATA_PTR,
  PYUSMIPC_S_NBYTES,
  PYUSMIPC_S_IS_CUDA,
  PYUSMIPC_TORCH_NREADERS
} pyusmipc_torch_reader_t;

/* Whether obj is a torch tensor (an instance of torch._C.TensorBase, of any
 * subclass), found without importing anything: 1, 0 (torch is not
 * imported, or obj is none), -1 with an exception. The first tensor seen
 * finds the readers. */
int pyusmipc_torch_is_tensor(PyObject *obj);

/* Reader r of t (a tensor for PYUSMIPC_T_..., a storage for PYUSMIPC_S_...),
 * a new reference, or NULL with an exception: torch's C reader itself where
 * it was found with the expected calling convention and t is an instance
 * of its class, else the attribute or method by name (a look-alike, or a
 * torch whose readers changed kind). */
PyObject *pyusmipc_torch_read(PyObject *t, pyusmipc_torch_reader_t r);

/* pyusmipc_torch_read(t, r) as a truth value: 1, 0, or -1. */
int pyusmipc_torch_true(PyObject *t, pyusmipc_torch_reader_t r);

/* The interned name of reader r (for messages and lookups by name). */
PyObject *pyusmipc_torch_reader_name(pyusmipc_torch_reader_t r);

#endif /* PYUSMIPC_TORCH_READERS_H */
