/* Floor 6 of the extension usmipc._usmipc (bundle.c): bundles, the
 * producer's side (share(), SharedBundle), and the dtypes that travel in
 * a bundle, which the consumer's side (shared_array.c) reads too. */
#ifndef PYUSMIPC_BUNDLE_H
#define PYUSMIPC_BUNDLE_H

#include <pthread.h>

#include "util.h"

/* A SharedBundle: the producer's, from share() (bundle set), or one made
 * from bytes (unpickled: bytes set). */
typedef struct pyusmipc_bundle_object {
  PyObject_HEAD usmipc_bundle_t *bundle; /* NULL: made from bytes */
  PyObject *keep;                        /* list of the leaves' sources */
  PyObject *queue;  /* usmipc.Queue each to_bytes() orders on, or NULL */
  PyObject *device; /* usmipc.Device of the memory, or NULL */
  PyObject *bytes;  /* a bundle made from bytes (unpickled) */
  Py_ssize_t arrays, allocations;
  char release; /* release=True: every handoff carries a release ticket */
  /* One thread at a time rewrites the library's bytes (a handoff's event
   * and ticket) and copies them out, without the GIL: two interleaved
   * handoffs would otherwise send one ticket twice and lose the other,
   * which the producer would then wait for in vain. */
  pthread_mutex_t order_lock;
  char lock_ready;
} pyusmipc_bundle_object_t;

/* The type SharedBundle. */
int pyusmipc_init_bundle_type(PyObject *module, pyusmipc_module_state_t *st);
/* usmipc.share(obj, stream=None, ordered=None, release=False) and the
 * module's _bundle_from_bytes(bytes) (unpickling), for module.c's table. */
PyObject *pyusmipc_share(PyObject *module, PyObject *const *args,
                         Py_ssize_t nargs, PyObject *kwnames);
PyObject *pyusmipc_bundle_from_bytes(PyObject *module, PyObject *arg);
/* SharedBundle.to_bytes(): the bytes of the next handoff (new reference). */
PyObject *pyusmipc_bundle_to_bytes(PyObject *op, PyObject *ignored);

/* A dtype that travels in a bundle: its names in each protocol, and its
 * DLPack code and bits. */
typedef struct pyusmipc_dtype {
  const char *name;    /* SharedArray.dtype */
  const char *torch;   /* str(torch dtype) */
  const char *typestr; /* __cuda_array_interface__, without byte order */
  const char *format;  /* buffer protocol, NULL: none */
  uint8_t code, bits;
} pyusmipc_dtype_t;
/* The dtype of DLPack code and bits, or NULL if none travels. */
const pyusmipc_dtype_t *pyusmipc_dtype_by_code(uint8_t code, uint8_t bits);

/* An array read as share() reads a leaf (usmipc memory, a torch tensor,
 * __cuda_array_interface__, __dlpack__), for a destination: any memory,
 * a CPU tensor of torch's own too. */
typedef struct pyusmipc_array {
  void *ptr;
  usmipc_array_desc_t desc; /* shape and strides point into this struct:
                               copy them, never the struct */
  int64_t shape[USMIPC_BUNDLE_MAX_NDIM], strides[USMIPC_BUNDLE_MAX_NDIM];
  PyObject *keep; /* new reference keeping the memory alive */
} pyusmipc_array_t;
/* 0 with *out filled, or -1 with an exception naming what is wrong. */
int pyusmipc_array_read(pyusmipc_module_state_t *st, PyObject *obj,
                        pyusmipc_array_t *out);

/* The dtype a torch dtype object travels as; NULL with TypeError when none
 * does. */
const pyusmipc_dtype_t *pyusmipc_dtype_of_torch(PyObject *dtype);

/* Leaf i of a list the caller has read already: *out filled (its keep a
 * new reference), 0; or -1 with an exception and no reference made. */
typedef int (*pyusmipc_leaf_source_t)(void *ctx, Py_ssize_t i,
                                      pyusmipc_array_t *out);
/* share([leaf 0, ..., leaf n-1], stream=stream, release=True) of leaves
 * their caller read already: usmipc.torch's per-tensor step (floor 8) has
 * each tensor's pointer, dtype and shape in hand when the message's bundle
 * is made, and reading them again cost about 0.9 us a tensor. The same
 * bundle share() makes of the same arrays; stream NULL: as share()'s. */
PyObject *pyusmipc_share_read(pyusmipc_module_state_t *st, Py_ssize_t n,
                              pyusmipc_leaf_source_t next, void *ctx,
                              PyObject *stream);

#endif /* PYUSMIPC_BUNDLE_H */
