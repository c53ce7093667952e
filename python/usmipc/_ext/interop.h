/* Floor 5 of the extension usmipc._usmipc (interop.c): zero-copy interop
 * with other array libraries, both ways (DLPack, __cuda_array_interface__,
 * __sycl_usm_array_interface__). */
#ifndef PYUSMIPC_INTEROP_H
#define PYUSMIPC_INTEROP_H

#include "dlpack.h"
#include "util.h"

/* _Memory.__sycl_usm_array_interface__: dpctl's dict (data (address, False:
 * not read-only), shape (nbytes,), strides None, typestr '|u1', version 1,
 * syclobj the memory's Queue); a closed mapping describes 0 bytes at 0. */
PyObject *pyusmipc_memory_suai(PyObject *self, void *closure);

/* What another object's __sycl_usm_array_interface__ describes, checked
 * against what usmipc knows of the pointer (usmipc_pointer_query): the
 * byte range the array spans, the memory's kind, and the device (and the
 * Queue, when syclobj is one) it belongs to. */
typedef struct pyusmipc_suai {
  void *ptr;         /* the array's lowest byte */
  Py_ssize_t nbytes; /* bytes from ptr to its highest byte, inclusive */
  usmipc_mem_kind_t kind;
  int readonly;     /* data[1] */
  PyObject *device; /* new reference: usmipc.Device */
  PyObject *queue;  /* new reference: usmipc.Queue, or NULL */
} pyusmipc_suai_t;
/* Reads obj's __sycl_usm_array_interface__: 1 with *out filled, 0 if obj
 * has no such attribute, -1 with an exception set (usmipc.ArgumentError for
 * a malformed interface, a syclobj that is not usmipc's, or a pointer that
 * is not memory of that device). what names the caller in messages. */
int pyusmipc_suai_read(pyusmipc_module_state_t *st, PyObject *obj,
                       const char *what, pyusmipc_suai_t *out);

/* The DLPack device of memory of kind on a device of backend whose
 * usmipc_device_index is index: on CUDA kDLCUDA (device memory),
 * kDLCUDAHost or kDLCUDAManaged; on Level Zero kDLOneAPI; on the host the
 * CPU. */
DLDevice pyusmipc_dl_device(usmipc_backend_t backend, usmipc_mem_kind_t kind,
                            int index);
/* The destructor of the DLPack capsules usmipc exports (memory objects,
 * shared arrays): a capsule no consumer took deletes its tensor, keeping a
 * pending exception aside meanwhile. */
void pyusmipc_dl_capsule_destructor(PyObject *capsule);

/* _Memory.__dlpack_device__(), __dlpack__(...), __cuda_array_interface__. */
PyObject *pyusmipc_memory_dlpack_device(PyObject *self, PyObject *ignored);
PyObject *pyusmipc_memory_dlpack(PyObject *self, PyObject *const *args,
                                 Py_ssize_t nargs, PyObject *kwnames);
PyObject *pyusmipc_memory_cuda_array_interface(PyObject *self, void *closure);
/* The byte range of an object with a C-contiguous __cuda_array_interface__:
 * 1 with *ptr and *nbytes set, 0 if obj has no such interface, -1 with an
 * exception set. */
int pyusmipc_cuda_array_range(PyObject *obj, void **ptr, Py_ssize_t *nbytes);
/* The byte range of an object with __dlpack__ whose tensor is C-contiguous
 * CUDA device memory (or usmipc's own device memory on the CPU): 1 with
 * *ptr, *nbytes and *owner set, 0 if obj has no __dlpack__, -1 with an
 * exception set (ValueError for a strided tensor, TypeError for memory that
 * is not device memory). The capsule is consumed; *owner (a new reference)
 * owns the tensor, and dropping it calls the producer's deleter, which
 * keeps the producer's memory alive until then. */
int pyusmipc_dlpack_range(PyObject *obj, void **ptr, Py_ssize_t *nbytes,
                          PyObject **owner);

/* Reads obj's __dlpack__ tensor: 1 with *tensor, *flags and *owner (a new
 * reference owning the tensor: dropping it calls the producer's deleter)
 * set, 0 if obj has no __dlpack__, -1 with an exception set. The tensor's
 * shape and strides stay valid while *owner lives. */
int pyusmipc_dlpack_read(PyObject *obj, void *tensor, uint64_t *flags,
                         PyObject **owner);

#endif /* PYUSMIPC_INTEROP_H */
