/* Bundles from Python: usmipc.share(tree) -> SharedBundle (to_bytes, pickle)
 * and usmipc.open_shared(bytes) -> the same tree of SharedArray leaves,
 * over the C library's bundles (src/bundle.c, docs/bundles.md).
 *
 * share() walks dicts (str keys), lists and tuples; a leaf is usmipc memory
 * (a 1-D uint8 array of its bytes), a torch tensor (read through its methods:
 * data_ptr, shape, stride, dtype; no DLPack round trip, which costs
 * microseconds per tensor), an object with __cuda_array_interface__ (CuPy,
 * Numba) or with __dlpack__ (NumPy over usmipc host memory, JAX, ...). The
 * SharedBundle keeps every leaf alive: its memory is promised to consumers
 * as long as the bundle lives (freeing it makes its bytes refused).
 *
 * Ordering follows IPCMemoryHandle: by default each to_bytes() records an
 * event on the producer's stream (stream=, or the current stream of the
 * first torch/CuPy leaf, or the memory's queue), and open_shared waits for
 * it on the host, or on stream= on the device. A leaf opened on a stream
 * makes any other stream a consumer names in __dlpack__(stream=...) wait
 * for that stream first.
 *
 * A SharedArray holds one open reference to its mapping; close() (or
 * close_shared(tree), or collection) drops it, deferred while a DLPack
 * tensor or a buffer view of it is alive, as for memory objects.
 *
 * Release tickets follow IPCMemoryHandle(release=True) too: share(...,
 * release=True) puts one in every to_bytes() (and pickle); the consumer
 * returns it with release_shared(tree, stream) after its work, or from the
 * host when the last array of the open is closed or collected; the
 * producer's SharedBundle.wait_released(stream) waits for all of them. */
#include "ext.h"

#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "dlpack.h"

/* The name of obj's type, for messages (new reference, or NULL). */
static PyObject *type_name(PyObject *obj) {
  return PyType_GetName(Py_TYPE(obj));
}

/* ---- dtypes -------------------------------------------------------------- */

typedef struct dtype_entry {
  const char *name;      /* SharedArray.dtype */
  const char *torch;     /* str(torch dtype) */
  const char *typestr;   /* __cuda_array_interface__, without byte order */
  const char *format;    /* buffer protocol, NULL: none */
  uint8_t code, bits;
} dtype_entry_t;

static const dtype_entry_t DTYPES[] = {
    {"bool", "torch.bool", "b1", "?", 6, 8},
    {"int8", "torch.int8", "i1", "b", 0, 8},
    {"int16", "torch.int16", "i2", "h", 0, 16},
    {"int32", "torch.int32", "i4", "i", 0, 32},
    {"int64", "torch.int64", "i8", "q", 0, 64},
    {"uint8", "torch.uint8", "u1", "B", 1, 8},
    {"uint16", "torch.uint16", "u2", "H", 1, 16},
    {"uint32", "torch.uint32", "u4", "I", 1, 32},
    {"uint64", "torch.uint64", "u8", "Q", 1, 64},
    {"float16", "torch.float16", "f2", "e", 2, 16},
    {"float32", "torch.float32", "f4", "f", 2, 32},
    {"float64", "torch.float64", "f8", "d", 2, 64},
    {"bfloat16", "torch.bfloat16", NULL, NULL, 4, 16},
    {"complex64", "torch.complex64", "c8", "Zf", 5, 64},
    {"complex128", "torch.complex128", "c16", "Zd", 5, 128},
};
#define NDTYPES (sizeof(DTYPES) / sizeof(DTYPES[0]))

static const dtype_entry_t *dtype_by_code(uint8_t code, uint8_t bits) {
  for (size_t i = 0; i < NDTYPES; i++)
    if (DTYPES[i].code == code && DTYPES[i].bits == bits)
      return &DTYPES[i];
  return NULL;
}

/* ---- leaves of share() ---------------------------------------------------- */

/* What share() learned about a leaf. */
typedef struct leaf_info {
  void *ptr;
  usmipc_array_desc_t desc;
  int64_t shape[USMIPC_BUNDLE_MAX_NDIM], strides[USMIPC_BUNDLE_MAX_NDIM];
  PyObject *keep; /* a new reference the bundle keeps (the source, or the
                     owner of a DLPack tensor) */
  PyObject *stream_of; /* the leaf whose current stream orders the bundle
                          (torch, CuPy), or NULL; borrowed */
  pyusmipc_memory_object_t *mem; /* usmipc memory, borrowed, or NULL */
} leaf_info_t;

/* A dict of torch dtype objects -> index into DTYPES, filled on first use
 * (dtype objects are singletons, so this is a pointer lookup). */
static PyObject *torch_dtypes;

static int fill_int_tuple(PyObject *seq, int64_t *out, int *ndim,
                          const char *what) {
  /* torch.Size is a tuple: no copy */
  PyObject *t = PyTuple_Check(seq) ? Py_NewRef(seq) : PySequence_Tuple(seq);
  if (t == NULL)
    return -1;
  Py_ssize_t n = PyTuple_Size(t);
  if (n > USMIPC_BUNDLE_MAX_NDIM) {
    Py_DECREF(t);
    pyusmipc_value_error("%s has %zd dimensions; at most %d travel",
                 what, n, USMIPC_BUNDLE_MAX_NDIM);
    return -1;
  }
  for (Py_ssize_t i = 0; i < n; i++) {
    out[i] = PyLong_AsLongLong(PyTuple_GetItem(t, i));
    if (out[i] == -1 && PyErr_Occurred()) {
      Py_DECREF(t);
      return -1;
    }
  }
  Py_DECREF(t);
  if (*ndim >= 0 && *ndim != (int)n) {
    pyusmipc_value_error("%s: %zd strides for %d dimensions", what,
                 n, *ndim);
    return -1;
  }
  *ndim = (int)n;
  return 0;
}

/* C-contiguous strides (elements) of shape; -1 with ValueError when the
 * array has more elements than 64 bits count. */
static int contiguous_strides(const int64_t *shape, int64_t *strides, int nd) {
  int64_t step = 1;
  for (int i = nd - 1; i >= 0; i--) {
    strides[i] = step;
    if (shape[i] > 1 && __builtin_mul_overflow(step, shape[i], &step)) {
      pyusmipc_value_error("the array has more elements than 64 bits count; "
                         "it cannot travel in a bundle");
      return -1;
    }
  }
  return 0;
}

static int leaf_torch(PyObject *obj, leaf_info_t *L) {
  PyObject *is_cpu = PyObject_GetAttrString(obj, "is_cpu");
  if (is_cpu == NULL)
    return -1;
  int cpu = PyObject_IsTrue(is_cpu);
  Py_DECREF(is_cpu);
  if (cpu < 0)
    return -1;
  PyObject *dtype = PyObject_GetAttrString(obj, "dtype");
  if (dtype == NULL)
    return -1;
  if (torch_dtypes == NULL && (torch_dtypes = PyDict_New()) == NULL) {
    Py_DECREF(dtype);
    return -1;
  }
  PyObject *idx = PyDict_GetItemWithError(torch_dtypes, dtype);
  if (idx == NULL) {
    if (PyErr_Occurred()) {
      Py_DECREF(dtype);
      return -1;
    }
    PyObject *name = PyObject_Str(dtype);
    long found = -1;
    for (size_t i = 0; name != NULL && i < NDTYPES; i++)
      if (PyUnicode_CompareWithASCIIString(name, DTYPES[i].torch) == 0)
        found = (long)i;
    if (name == NULL) {
      Py_DECREF(dtype);
      return -1;
    }
    if (found < 0) {
      pyusmipc_type_error("a tensor of dtype %U cannot travel in a bundle", name);
      Py_DECREF(name);
      Py_DECREF(dtype);
      return -1;
    }
    Py_DECREF(name);
    PyObject *v = PyLong_FromLong(found);
    if (v == NULL || PyDict_SetItem(torch_dtypes, dtype, v) < 0) {
      Py_XDECREF(v);
      Py_DECREF(dtype);
      return -1;
    }
    Py_DECREF(v);
    idx = PyDict_GetItemWithError(torch_dtypes, dtype);
  }
  /* Read before dtype goes: releasing it may run a __del__. */
  long at = idx != NULL ? PyLong_AsLong(idx) : -1;
  Py_DECREF(dtype);
  if (at < 0 || at >= (long)NDTYPES) {
    if (!PyErr_Occurred())
      pyusmipc_type_error("the tensor's dtype changed while it was read");
    return -1;
  }
  const dtype_entry_t *dt = &DTYPES[at];
  L->desc.dtype_code = dt->code;
  L->desc.dtype_bits = dt->bits;
  L->desc.dtype_lanes = 1;
  PyObject *shape = PyObject_GetAttrString(obj, "shape");
  PyObject *stride = shape ? PyObject_CallMethod(obj, "stride", NULL) : NULL;
  PyObject *ptr = stride ? PyObject_CallMethod(obj, "data_ptr", NULL) : NULL;
  int nd = -1, rc = -1;
  if (ptr != NULL && fill_int_tuple(shape, L->shape, &nd, "the tensor") == 0 &&
      fill_int_tuple(stride, L->strides, &nd, "the tensor") == 0) {
    L->ptr = PyLong_AsVoidPtr(ptr);
    rc = PyErr_Occurred() ? -1 : 0;
  }
  /* A CPU tensor shares only over usmipc's own memory (a view of host:cpu
   * device memory, as torch.distributed's gloo ranks use): torch's own
   * CPU allocations are private to the process. */
  int empty = 0;
  for (int i = 0; rc == 0 && i < nd; i++)
    empty |= L->shape[i] == 0;
  usmipc_pointer_info_t info;
  if (rc == 0 && cpu && !empty &&
      (usmipc_pointer_query(L->ptr, &info) != 0 ||
       info.kind != USMIPC_MEM_DEVICE)) {
    pyusmipc_kind_error("a CPU tensor of torch's own memory: only device "
                      "memory can be shared (move it to the GPU, or make it "
                      "a view of usmipc memory: torch.from_dlpack("
                      "MemoryUSMDevice(n, device='host:cpu')))");
    rc = -1;
  }
  Py_XDECREF(shape);
  Py_XDECREF(stride);
  Py_XDECREF(ptr);
  L->desc.ndim = nd;
  L->stream_of = obj;
  return rc;
}

/* cai[key] as a new reference; NULL with no exception when absent. The
 * lookup may run the code of a colliding key's __eq__, and reading one
 * field may run code (a shape's __len__) that empties the dict: each field
 * is held by a reference of its own (tests/python/test_mutation.py). */
static PyObject *cai_field(PyObject *cai, const char *key) {
  PyObject *k = PyUnicode_FromString(key);
  if (k == NULL)
    return NULL;
  PyObject *v = PyDict_GetItemWithError(cai, k);
  Py_XINCREF(v);
  Py_DECREF(k);
  return v;
}

static int leaf_cai_fields(PyObject *obj, PyObject *data, PyObject *shape,
                           PyObject *typestr, PyObject *strides,
                           leaf_info_t *L) {
  if (data == NULL || !PyTuple_Check(data) || PyTuple_Size(data) < 1 ||
      shape == NULL || typestr == NULL || !PyUnicode_Check(typestr)) {
    pyusmipc_type_error("__cuda_array_interface__ lacks data, shape or typestr");
    return -1;
  }
  const char *ts = PyUnicode_AsUTF8AndSize(typestr, NULL);
  if (ts == NULL)
    return -1;
  const dtype_entry_t *dt = NULL;
  if (ts[0] == '<' || ts[0] == '|')
    for (size_t i = 0; i < NDTYPES; i++)
      if (DTYPES[i].typestr && strcmp(ts + 1, DTYPES[i].typestr) == 0)
        dt = &DTYPES[i];
  if (dt == NULL) {
    pyusmipc_type_error("an array of typestr %s cannot travel in a bundle "
                 "(little-endian bool, int, uint, float, complex can)",
                 ts);
    return -1;
  }
  L->desc.dtype_code = dt->code;
  L->desc.dtype_bits = dt->bits;
  L->desc.dtype_lanes = 1;
  int nd = -1;
  if (fill_int_tuple(shape, L->shape, &nd, "the array") < 0)
    return -1;
  L->desc.ndim = nd;
  if (strides != NULL && strides != Py_None) {
    if (fill_int_tuple(strides, L->strides, &nd, "the array") < 0)
      return -1;
    int64_t item = dt->bits / 8;
    for (int i = 0; i < nd; i++) {
      if (L->strides[i] % item != 0) {
        pyusmipc_value_error("an array whose strides are not whole elements "
                        "cannot travel in a bundle");
        return -1;
      }
      L->strides[i] /= item;
    }
  } else if (contiguous_strides(L->shape, L->strides, nd) < 0) {
    return -1;
  }
  L->ptr = PyLong_AsVoidPtr(PyTuple_GetItem(data, 0));
  if (PyErr_Occurred())
    return -1;
  if (pyusmipc_type_module_is(obj, "cupy"))
    L->stream_of = obj;
  return 0;
}

static int leaf_cai(PyObject *obj, PyObject *cai, leaf_info_t *L) {
  if (!PyDict_Check(cai)) {
    pyusmipc_type_error("__cuda_array_interface__ is not a dict");
    return -1;
  }
  PyObject *data = NULL, *shape = NULL, *typestr = NULL, *strides = NULL;
  int rc = -1;
  if (((data = cai_field(cai, "data")) != NULL || !PyErr_Occurred()) &&
      ((shape = cai_field(cai, "shape")) != NULL || !PyErr_Occurred()) &&
      ((typestr = cai_field(cai, "typestr")) != NULL || !PyErr_Occurred()) &&
      ((strides = cai_field(cai, "strides")) != NULL || !PyErr_Occurred()))
    rc = leaf_cai_fields(obj, data, shape, typestr, strides, L);
  Py_XDECREF(data);
  Py_XDECREF(shape);
  Py_XDECREF(typestr);
  Py_XDECREF(strides);
  return rc;
}

static int leaf_dlpack(PyObject *obj, leaf_info_t *L, int *found) {
  DLTensor t;
  uint64_t flags;
  PyObject *owner;
  int r = pyusmipc_dlpack_read(obj, &t, &flags, &owner);
  *found = r;
  if (r <= 0)
    return r;
  if (t.ndim < 0 || t.ndim > USMIPC_BUNDLE_MAX_NDIM ||
      (t.ndim > 0 && t.shape == NULL) || t.dtype.lanes != 1 ||
      dtype_by_code(t.dtype.code, t.dtype.bits) == NULL) {
    Py_DECREF(owner);
    pyusmipc_type_error("a DLPack tensor of dtype (code %u, %u bits, %u lanes) or %d "
                 "dimensions cannot travel in a bundle",
                 t.dtype.code, t.dtype.bits, t.dtype.lanes, (int)t.ndim);
    return -1;
  }
  L->desc.dtype_code = t.dtype.code;
  L->desc.dtype_bits = t.dtype.bits;
  L->desc.dtype_lanes = 1;
  L->desc.ndim = t.ndim;
  for (int i = 0; i < t.ndim; i++)
    L->shape[i] = t.shape[i];
  if (t.strides != NULL) {
    for (int i = 0; i < t.ndim; i++)
      L->strides[i] = t.strides[i];
  } else if (contiguous_strides(L->shape, L->strides, t.ndim) < 0) {
    Py_DECREF(owner);
    return -1;
  }
  L->ptr = (char *)t.data + t.byte_offset;
  L->keep = owner;
  return 0;
}

/* How a leaf's type is read, found once per type: asking an object for an
 * attribute it lacks raises (and clears) an AttributeError, which costs
 * more than the rest of a leaf. */
enum { LEAF_TORCH = 1, LEAF_CAI = 2, LEAF_DLPACK = 3 };
static PyObject *leaf_kinds; /* type -> kind */

static int leaf_kind(PyObject *obj) {
  if (leaf_kinds == NULL && (leaf_kinds = PyDict_New()) == NULL)
    return -1;
  PyObject *k = PyDict_GetItemWithError(leaf_kinds, (PyObject *)Py_TYPE(obj));
  if (k != NULL)
    return (int)PyLong_AsLong(k);
  if (PyErr_Occurred())
    return -1;
  /* The type is held: the attribute reads below run the caller's code,
   * which may give obj another class and collect this one. */
  PyObject *type = Py_NewRef((PyObject *)Py_TYPE(obj));
  int kind;
  if (pyusmipc_type_module_is(obj, "torch") &&
      PyObject_HasAttrString(obj, "data_ptr"))
    kind = LEAF_TORCH;
  else if (PyObject_HasAttrString(type, "__cuda_array_interface__"))
    kind = LEAF_CAI;
  else
    kind = LEAF_DLPACK;
  PyObject *v = PyLong_FromLong(kind);
  if (v == NULL || PyDict_SetItem(leaf_kinds, type, v) < 0) {
    Py_XDECREF(v);
    Py_DECREF(type);
    return -1;
  }
  Py_DECREF(v);
  Py_DECREF(type);
  return kind;
}

/* Reads a leaf into L; -1 with an exception naming what is wrong. */
static int leaf_read(pyusmipc_module_state_t *st, PyObject *obj,
                     leaf_info_t *L) {
  int kind;
  memset(L, 0, sizeof(*L));
  L->desc.shape = L->shape;
  L->desc.strides = L->strides;
  if (PyObject_TypeCheck(obj, st->MemoryType)) {
    pyusmipc_memory_object_t *m = (pyusmipc_memory_object_t *)obj;
    if (m->closed || m->released) {
      pyusmipc_value_error("the memory is closed");
      return -1;
    }
    L->ptr = m->ptr;
    L->desc = (usmipc_array_desc_t){1, 8, 1, 1, L->shape, L->strides};
    L->shape[0] = m->nbytes;
    L->strides[0] = 1;
    L->mem = m;
  } else if ((kind = leaf_kind(obj)) < 0) {
    return -1;
  } else if (kind == LEAF_TORCH) {
    if (leaf_torch(obj, L) < 0)
      return -1;
  } else {
    PyObject *cai =
        kind == LEAF_CAI
            ? PyObject_GetAttrString(obj, "__cuda_array_interface__")
            : NULL;
    if (cai == NULL && kind == LEAF_CAI)
      return -1;
    if (cai != NULL) {
      int rc = leaf_cai(obj, cai, L);
      Py_DECREF(cai);
      if (rc < 0)
        return -1;
    } else {
      int found;
      if (leaf_dlpack(obj, L, &found) < 0)
        return -1;
      if (!found) { /* an interface set on the instance, not its type */
        cai = pyusmipc_optional_attr(obj, "__cuda_array_interface__");
        if (cai != NULL) {
          int rc = leaf_cai(obj, cai, L);
          Py_DECREF(cai);
          if (rc < 0)
            return -1;
          found = 1;
        } else if (PyErr_Occurred()) {
          return -1;
        }
      }
      if (!found) {
        PyObject *tn = type_name(obj);
        if (tn != NULL)
          pyusmipc_type_error("a %U is not an array: a leaf must be usmipc memory "
                       "or have __cuda_array_interface__ or __dlpack__ "
                       "(dicts, lists and tuples hold the leaves)",
                       tn);
        Py_XDECREF(tn);
        return -1;
      }
    }
  }
  for (int i = 0; i < L->desc.ndim; i++)
    if (L->strides[i] < 0) {
      Py_XDECREF(L->keep);
      L->keep = NULL;
      pyusmipc_value_error("an array with negative strides cannot travel in a "
                      "bundle; share a copy");
      return -1;
    }
  if (L->keep == NULL)
    L->keep = Py_NewRef(obj);
  return 0;
}

/* ---- SharedBundle --------------------------------------------------------- */

typedef struct {
  PyObject_HEAD usmipc_bundle_t *bundle; /* NULL: made from bytes */
  PyObject *keep;   /* list of the leaves' sources */
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
} Bundle;

typedef struct walk {
  pyusmipc_module_state_t *st;
  usmipc_bundle_t *b;
  PyObject *keep;
  PyObject *stream_of; /* first torch/CuPy leaf */
  pyusmipc_memory_object_t *mem; /* first usmipc memory leaf */
  void *first_ptr;             /* first leaf with memory */
  PyObject *path;              /* list of keys/indices, for messages */
  int depth;
} walk_t;

static int walk(walk_t *w, PyObject *obj, const char *key, Py_ssize_t key_len);

/* The path to a failing leaf is collected as the error unwinds (innermost
 * label first), so a walk that succeeds pays nothing for it. */
static int walk_child(walk_t *w, PyObject *child, PyObject *label,
                      const char *key, Py_ssize_t key_len) {
  int rc = walk(w, child, key, key_len);
  if (rc < 0 && w->path != NULL) {
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    if (PyList_Append(w->path, label) < 0)
      PyErr_Clear();
    PyErr_Restore(type, value, tb);
  }
  return rc;
}

static int bundle_fail(walk_t *w, int rc) {
  pyusmipc_raise(w->st, rc);
  return -1;
}

/* A dict key that has no UTF-8 form (a lone surrogate such as '\\ud800',
 * which str allows and UTF-8 does not): usmipc's ArgumentError, with the
 * key in the path, instead of a bare UnicodeEncodeError. */
static void key_not_utf8(walk_t *w, PyObject *k) {
  if (!PyErr_ExceptionMatches(PyExc_UnicodeEncodeError))
    return;
  PyErr_Clear();
  pyusmipc_value_error("the dict key has no UTF-8 form (a lone surrogate?), "
                     "and bundle keys travel as UTF-8: use a key of valid "
                     "text");
  PyObject *type, *value, *tb;
  PyErr_Fetch(&type, &value, &tb);
  if (w->path != NULL && PyList_Append(w->path, k) < 0)
    PyErr_Clear();
  PyErr_Restore(type, value, tb);
}

static int walk(walk_t *w, PyObject *obj, const char *key, Py_ssize_t key_len) {
  if (++w->depth > 64) {
    pyusmipc_value_error("the tree is nested deeper than 64 levels");
    return -1;
  }
  int rc;
  if (PyDict_Check(obj) || PyList_Check(obj) || PyTuple_Check(obj)) {
    usmipc_bundle_node_kind_t kind = PyDict_Check(obj)   ? USMIPC_BUNDLE_DICT
                                     : PyList_Check(obj) ? USMIPC_BUNDLE_LIST
                                                         : USMIPC_BUNDLE_TUPLE;
    /* A copy of the container, walked instead of it: reading a leaf runs
     * the caller's code (a property, __index__, a __del__), which may
     * clear the dict or list, delete the key being read or drop the last
     * reference to the leaf. The copy holds every key and child while the
     * walk is inside it (tests/python/test_mutation.py). A tuple cannot
     * change, and the caller holds it. */
    PyObject *items = kind == USMIPC_BUNDLE_DICT ? PyDict_Items(obj)
                      : kind == USMIPC_BUNDLE_LIST
                          ? PyList_GetSlice(obj, 0, PY_SSIZE_T_MAX)
                          : Py_NewRef(obj);
    if (items == NULL)
      return -1;
    Py_ssize_t n =
        kind == USMIPC_BUNDLE_TUPLE ? PyTuple_Size(items) : PyList_Size(items);
    if (n > UINT32_MAX) {
      Py_DECREF(items);
      pyusmipc_value_error("a container too large for a bundle");
      return -1;
    }
    if ((rc = usmipc_bundle_add_container(w->b, kind, (uint32_t)n, key,
                                          (size_t)key_len)) != 0) {
      Py_DECREF(items);
      return bundle_fail(w, rc);
    }
    for (Py_ssize_t i = 0; i < n; i++) {
      if (kind == USMIPC_BUNDLE_DICT) {
        /* (key, value): a tuple the copy holds, borrowed items of it */
        PyObject *pair = PyList_GetItem(items, i);
        PyObject *k = PyTuple_GetItem(pair, 0), *v = PyTuple_GetItem(pair, 1);
        if (!PyUnicode_Check(k)) {
          PyObject *tn = type_name(k);
          if (tn != NULL)
            pyusmipc_type_error("dict keys must be str to travel in a bundle, "
                              "not %U",
                              tn);
          Py_XDECREF(tn);
          Py_DECREF(items);
          return -1;
        }
        /* The UTF-8 lives in k, which the copy keeps. */
        Py_ssize_t kl;
        const char *ks = PyUnicode_AsUTF8AndSize(k, &kl);
        if (ks == NULL) {
          key_not_utf8(w, k);
          Py_DECREF(items);
          return -1;
        }
        rc = walk_child(w, v, k, ks, kl);
      } else {
        PyObject *child = kind == USMIPC_BUNDLE_LIST
                              ? PyList_GetItem(items, i)
                              : PyTuple_GetItem(items, i);
        PyObject *label = PyLong_FromSsize_t(i);
        if (label == NULL) {
          Py_DECREF(items);
          return -1;
        }
        rc = walk_child(w, child, label, NULL, 0);
        Py_DECREF(label);
      }
      if (rc < 0) {
        Py_DECREF(items);
        return -1;
      }
    }
    Py_DECREF(items);
    w->depth--;
    return 0;
  }
  leaf_info_t L;
  if (leaf_read(w->st, obj, &L) < 0)
    return -1;
  rc = PyList_Append(w->keep, L.keep);
  Py_DECREF(L.keep);
  if (rc < 0)
    return -1;
  /* With the GIL held: a few loads for usmipc's memory, one driver query
   * for another library's; releasing and taking the GIL per leaf cost
   * more. (The first export of an allocation may wait longer: rare.) */
  rc = usmipc_bundle_add_array(w->b, key, (size_t)key_len, L.ptr, &L.desc);
  if (rc != 0)
    return bundle_fail(w, rc);
  int has_memory = 1;
  for (int i = 0; i < L.desc.ndim; i++)
    has_memory &= L.shape[i] != 0;
  if (has_memory && w->first_ptr == NULL) {
    w->first_ptr = L.ptr;
    w->stream_of = L.stream_of;
    w->mem = L.mem;
  }
  w->depth--;
  return 0;
}

/* Prefixes the pending exception's message with where in the tree it arose:
 * "share(): at ['layers'][3]['weight']: ...". */
static void prefix_path(PyObject *path) {
  PyObject *type, *value, *tb;
  PyErr_Fetch(&type, &value, &tb);
  PyErr_NormalizeException(&type, &value, &tb);
  PyObject *where = PyUnicode_FromString("");
  for (Py_ssize_t i = PyList_Size(path) - 1; where && i >= 0; i--) {
    PyObject *part = PyUnicode_FromFormat("[%R]", PyList_GetItem(path, i));
    PyObject *joined = part ? PyUnicode_Concat(where, part) : NULL;
    Py_XDECREF(part);
    Py_DECREF(where);
    where = joined;
  }
  PyObject *msg = value ? PyObject_Str(value) : NULL;
  PyObject *text =
      where && msg ? PyUnicode_FromFormat("share(): at %U%s: %U", where,
                                          PyUnicode_GetLength(where) ? "" : "the root",
                                          msg)
                   : NULL;
  Py_XDECREF(where);
  Py_XDECREF(msg);
  if (text != NULL && value != NULL) {
    /* The same exception type (usmipc.Error keeps .code and .name). */
    PyObject *args = PyTuple_Pack(1, text);
    if (args != NULL && PyObject_SetAttrString(value, "args", args) == 0) {
      Py_DECREF(args);
      Py_DECREF(text);
      PyErr_Restore(type, value, tb);
      return;
    }
    Py_XDECREF(args);
    PyErr_Clear();
  }
  Py_XDECREF(text);
  PyErr_Restore(type, value, tb);
}

/* The queue the bundle's handoffs are ordered on, as IPCMemoryHandle picks
 * it; NULL with no exception when unordered. */
static PyObject *order_queue(pyusmipc_module_state_t *st, walk_t *w,
                             PyObject *stream, int ordered, PyObject *device) {
  if (ordered == 0)
    return NULL;
  int has = pyusmipc_device_has_events(st, device);
  if (has < 0)
    return NULL;
  if (!has) {
    if (ordered > 0 || stream != NULL) {
      pyusmipc_raise_msg(st, USMIPC_ENOTSUP,
                       "share(): this device's backend has no events yet, so "
                       "the bundle cannot make consumers wait for the "
                       "producer's work; pass ordered=False and synchronize "
                       "that work before sending the bytes");
    }
    return NULL;
  }
  if (stream != NULL)
    return pyusmipc_queue_from_stream(st, stream, NULL, device, "share()");
  if (w->mem != NULL)
    return Py_XNewRef(pyusmipc_memory_queue_object(w->mem));
  if (w->stream_of != NULL) {
    PyObject *current = pyusmipc_foreign_current_stream(w->stream_of);
    if (current == NULL)
      return NULL;
    if (current != Py_None) {
      PyObject *q =
          pyusmipc_queue_from_stream(st, current, NULL, device, "share()");
      Py_DECREF(current);
      return q;
    }
    Py_DECREF(current);
  }
  if (usmipc_device_backend(((pyusmipc_device_object_t *)device)->device) ==
      USMIPC_BACKEND_CUDA) /* the legacy default stream waits for all */
    return pyusmipc_queue_wrap(st, device, NULL, NULL, "share()");
  return pyusmipc_default_queue(st, device);
}

static PyObject *share(PyObject *module, PyObject *const *args,
                       Py_ssize_t nargs, PyObject *kwnames) {
  static const char *const names[] = {"obj", "stream", "ordered", "release"};
  PyObject *a[4];
  if (pyusmipc_parse_fastcall("share", args, nargs, kwnames, names, 4, 1, a) < 0)
    return NULL;
  if (a[0] == NULL) {
    pyusmipc_type_error("share() missing argument 'obj'");
    return NULL;
  }
  int ordered = -1, release = 0;
  if (a[2] != NULL && a[2] != Py_None &&
      (ordered = PyObject_IsTrue(a[2])) < 0)
    return NULL;
  if (a[3] != NULL && (release = PyObject_IsTrue(a[3])) < 0)
    return NULL;
  if (ordered == 0 && a[1] != NULL && a[1] != Py_None) {
    pyusmipc_value_error("share(): stream= is what the handoff is ordered on, so "
                    "it cannot go with ordered=False");
    return NULL;
  }
  PyObject *stream = a[1] == Py_None ? NULL : a[1];
  pyusmipc_module_state_t *st = PyModule_GetState(module);
  Bundle *self = PyObject_GC_New(Bundle, (PyTypeObject *)st->SharedBundleType);
  if (self == NULL)
    return NULL;
  self->bundle = NULL;
  self->queue = self->device = self->bytes = NULL;
  self->arrays = self->allocations = 0;
  self->release = (char)release;
  self->lock_ready = pthread_mutex_init(&self->order_lock, NULL) == 0;
  self->keep = PyList_New(0);
  PyObject_GC_Track(self);
  if (!self->lock_ready) {
    PyErr_SetString(PyExc_RuntimeError, "share(): could not initialize a "
                                        "mutex");
    Py_DECREF(self);
    return NULL;
  }
  walk_t w = {.st = st, .keep = self->keep};
  int rc = 0;
  if (self->keep == NULL || (w.path = PyList_New(0)) == NULL)
    goto fail;
  if ((rc = usmipc_bundle_create(&self->bundle)) != 0) {
    pyusmipc_raise(st, rc);
    goto fail;
  }
  w.b = self->bundle;
  if (walk(&w, a[0], NULL, 0) < 0) {
    prefix_path(w.path);
    goto fail;
  }
  Py_BEGIN_ALLOW_THREADS
  rc = usmipc_bundle_finish(self->bundle);
  Py_END_ALLOW_THREADS
  if (rc != 0) {
    pyusmipc_raise(st, rc);
    goto fail;
  }
  size_t narr, nseg;
  usmipc_bundle_counts(self->bundle, &narr, &nseg);
  self->arrays = (Py_ssize_t)narr;
  self->allocations = (Py_ssize_t)nseg;
  if (w.first_ptr != NULL) {
    usmipc_pointer_info_t info;
    Py_BEGIN_ALLOW_THREADS
    rc = usmipc_pointer_query(w.first_ptr, &info);
    Py_END_ALLOW_THREADS
    if (rc != 0) {
      pyusmipc_raise(st, rc);
      goto fail;
    }
    if ((self->device = pyusmipc_device_object(st, info.device)) == NULL)
      goto fail;
    self->queue = order_queue(st, &w, stream, ordered, self->device);
    if (self->queue == NULL && PyErr_Occurred())
      goto fail;
  } else if (stream != NULL || ordered > 0) {
    /* Nothing to order: no leaf has memory. */
  }
  Py_DECREF(w.path);
  return (PyObject *)self;
fail:
  Py_XDECREF(w.path);
  Py_DECREF(self);
  return NULL;
}

static PyObject *bundle_to_bytes(PyObject *op, PyObject *Py_UNUSED(ignored)) {
  Bundle *self = (Bundle *)op;
  if (self->bundle == NULL)
    return Py_NewRef(self->bytes);
  const void *data;
  size_t len;
  if (self->queue == NULL && !self->release) { /* the same bytes each time */
    usmipc_bundle_data(self->bundle, &data, &len);
    return PyBytes_FromStringAndSize(data, (Py_ssize_t)len);
  }
  /* Each handoff records anew (an event on the queue, a ticket), and its
   * bytes are copied before another handoff may rewrite them. */
  usmipc_queue_t *q =
      self->queue ? ((pyusmipc_queue_object_t *)self->queue)->queue : NULL;
  unsigned flags = self->release ? USMIPC_ORDER_RELEASE : 0;
  usmipc_bundle_t *b = self->bundle;
  char *copy = NULL;
  int rc;
  Py_BEGIN_ALLOW_THREADS
  pthread_mutex_lock(&self->order_lock);
  rc = usmipc_bundle_order_ex(b, q, flags);
  if (rc == 0 && (rc = usmipc_bundle_data(b, &data, &len)) == 0 &&
      (copy = malloc(len)) != NULL)
    memcpy(copy, data, len);
  pthread_mutex_unlock(&self->order_lock);
  Py_END_ALLOW_THREADS
  if (rc != 0)
    return pyusmipc_raise(pyusmipc_state_from_device(self->device), rc);
  if (copy == NULL)
    return PyErr_NoMemory();
  PyObject *out = PyBytes_FromStringAndSize(copy, (Py_ssize_t)len);
  free(copy);
  return out;
}

static PyObject *bundle_from_bytes(PyObject *module, PyObject *arg) {
  pyusmipc_module_state_t *st = PyModule_GetState(module);
  if (!PyBytes_Check(arg)) {
    pyusmipc_type_error("_bundle_from_bytes takes bytes");
    return NULL;
  }
  size_t narr = 0, nseg = 0;
  int rc = usmipc_bundle_inspect(PyBytes_AsString(arg),
                                 (size_t)PyBytes_Size(arg), &narr, &nseg);
  if (rc != 0)
    return pyusmipc_raise(st, rc);
  Bundle *self = PyObject_GC_New(Bundle, (PyTypeObject *)st->SharedBundleType);
  if (self == NULL)
    return NULL;
  self->bundle = NULL;
  self->keep = self->queue = self->device = NULL;
  self->release = self->lock_ready = 0;
  self->bytes = Py_NewRef(arg);
  self->arrays = (Py_ssize_t)narr;
  self->allocations = (Py_ssize_t)nseg;
  PyObject_GC_Track(self);
  return (PyObject *)self;
}

static PyObject *bundle_reduce(PyObject *op, PyObject *Py_UNUSED(ignored)) {
  PyObject *bytes = bundle_to_bytes(op, NULL);
  if (bytes == NULL)
    return NULL;
  PyObject *mod = PyImport_ImportModule("usmipc._usmipc");
  PyObject *fn = mod ? PyObject_GetAttrString(mod, "_bundle_from_bytes") : NULL;
  Py_XDECREF(mod);
  PyObject *r = fn ? Py_BuildValue("(O(O))", fn, bytes) : NULL;
  Py_XDECREF(fn);
  Py_DECREF(bytes);
  return r;
}

static PyObject *bundle_get_arrays(PyObject *op, void *c) {
  (void)c;
  return PyLong_FromSsize_t(((Bundle *)op)->arrays);
}

static PyObject *bundle_get_allocations(PyObject *op, void *c) {
  (void)c;
  return PyLong_FromSsize_t(((Bundle *)op)->allocations);
}

static PyObject *bundle_get_ordered(PyObject *op, void *c) {
  (void)c;
  return PyBool_FromLong(((Bundle *)op)->queue != NULL);
}

static PyObject *bundle_get_releases(PyObject *op, void *c) {
  (void)c;
  Bundle *self = (Bundle *)op;
  uint64_t sent = 0, back = 0;
  if (self->bundle != NULL)
    usmipc_bundle_releases(self->bundle, &sent, &back);
  return Py_BuildValue("(KK)", (unsigned long long)sent,
                       (unsigned long long)back);
}

/* wait_released(stream=None): every ticket handed out so far came back;
 * then stream waits for the consumers' work on the device, or the host
 * waits (IPCMemoryHandle.wait_released). */
static PyObject *bundle_wait_released(PyObject *op, PyObject *const *args,
                                      Py_ssize_t nargs, PyObject *kwnames) {
  static const char *const names[] = {"stream"};
  PyObject *stream = NULL;
  Bundle *self = (Bundle *)op;
  pyusmipc_module_state_t *st = PyType_GetModuleState(Py_TYPE(op));
  if (pyusmipc_parse_fastcall("wait_released", args, nargs, kwnames, names, 1,
                            0, &stream) < 0)
    return NULL;
  if (self->bundle == NULL) {
    pyusmipc_value_error("wait_released(): this SharedBundle was made from "
                       "bytes; only the producer's own (from share()) hands "
                       "out release tickets");
    return NULL;
  }
  PyObject *queue_obj = NULL;
  usmipc_queue_t *queue = NULL;
  if (stream != NULL && stream != Py_None) {
    if ((queue_obj = pyusmipc_queue_from_stream(st, stream, NULL, self->device,
                                              "SharedBundle.wait_released()"))
        == NULL)
      return NULL;
    queue = ((pyusmipc_queue_object_t *)queue_obj)->queue;
  }
  usmipc_bundle_t *b = self->bundle;
  int rc;
  Py_BEGIN_ALLOW_THREADS
  rc = usmipc_bundle_wait_released(b, queue);
  Py_END_ALLOW_THREADS
  Py_XDECREF(queue_obj);
  if (rc == USMIPC_EINTR && PyErr_Occurred())
    return NULL; /* KeyboardInterrupt from the interrupt hook */
  if (rc != 0)
    return pyusmipc_raise(st, rc);
  Py_RETURN_NONE;
}

static PyObject *bundle_repr(PyObject *op) {
  Bundle *self = (Bundle *)op;
  return PyUnicode_FromFormat("<usmipc.SharedBundle of %zd arrays in %zd "
                              "allocations%s>",
                              self->arrays, self->allocations,
                              self->bundle ? "" : " (bytes)");
}

static int bundle_traverse(PyObject *op, visitproc visit, void *arg) {
  Bundle *self = (Bundle *)op;
  Py_VISIT(Py_TYPE(op));
  Py_VISIT(self->keep);
  Py_VISIT(self->queue);
  Py_VISIT(self->device);
  Py_VISIT(self->bytes);
  return 0;
}

static int bundle_clear(PyObject *op) {
  Bundle *self = (Bundle *)op;
  Py_CLEAR(self->queue);
  Py_CLEAR(self->device);
  Py_CLEAR(self->bytes);
  return 0;
}

static void bundle_dealloc(PyObject *op) {
  Bundle *self = (Bundle *)op;
  PyTypeObject *tp = Py_TYPE(op);
  PyObject_GC_UnTrack(op);
  /* The slot first (its bytes are refused from now on), then the sources
   * may go. */
  PYUSMIPC_DESTROY_WITHOUT_GIL(usmipc_bundle_t, self->bundle, usmipc_bundle_free);
  bundle_clear(op);
  Py_CLEAR(self->keep);
  if (self->lock_ready)
    pthread_mutex_destroy(&self->order_lock);
  PyObject_GC_Del(op);
  Py_DECREF(tp);
}

static PyMethodDef bundle_methods[] = {
    {"to_bytes", bundle_to_bytes, METH_NOARGS,
     "to_bytes()\n--\n\nThe bundle's bytes, to send to another process "
     "(usmipc.open_shared opens them). Ordered bundles record a fresh event "
     "on the producer's stream at every call."},
    {"__reduce__", bundle_reduce, METH_NOARGS, NULL},
    {"wait_released", PYUSMIPC_CMETHOD(bundle_wait_released),
     METH_FASTCALL | METH_KEYWORDS,
     "wait_released(stream=None)\n--\n\nWaits until every release ticket "
     "handed out so far came back (the\nevent timeout, "
     "usmipc.set_event_timeout, bounds the wait: a consumer\nthat died never "
     "returns its ticket), then makes stream wait on the device\nfor the "
     "work the consumers submitted before returning them (no stream:\nthe "
     "host waits). A bundle of share(..., release=True)."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef bundle_getset[] = {
    {"arrays", bundle_get_arrays, NULL, "The number of arrays (leaves).",
     NULL},
    {"allocations", bundle_get_allocations, NULL,
     "The number of allocations the arrays live in, each exported once.",
     NULL},
    {"ordered", bundle_get_ordered, NULL,
     "Whether each to_bytes() orders the handoff after the producer's work.",
     NULL},
    {"releases", bundle_get_releases, NULL,
     "(sent, returned): release tickets handed out (one per to_bytes() or "
     "pickle of\na bundle shared with release=True) and returned by "
     "consumers so far.",
     NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot bundle_slots[] = {
    {Py_tp_doc,
     (void *)"What usmipc.share() returns: a tree of arrays exported for "
             "other processes. It keeps the arrays alive; once it is "
             "collected its bytes are refused."},
    {Py_tp_dealloc, bundle_dealloc},
    {Py_tp_traverse, bundle_traverse},
    {Py_tp_clear, bundle_clear},
    {Py_tp_repr, bundle_repr},
    {Py_tp_methods, bundle_methods},
    {Py_tp_getset, bundle_getset},
    {0, NULL},
};

static PyType_Spec bundle_spec = {
    .name = "usmipc.SharedBundle",
    .basicsize = sizeof(Bundle),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC |
             Py_TPFLAGS_IMMUTABLETYPE | Py_TPFLAGS_DISALLOW_INSTANTIATION,
    .slots = bundle_slots,
};

/* ---- SharedArray ----------------------------------------------------------- */

/* What the arrays of one open share: where they are ready. */
#define READY_SYNCED_MAX 8
typedef struct ready {
  Py_ssize_t refs;      /* arrays and capsules; GIL held */
  void *synced[READY_SYNCED_MAX]; /* native streams made to wait already */
  int nsynced;
  usmipc_event_t *event; /* recorded on the open's stream, or NULL */
  usmipc_queue_t *queue; /* that stream (its Queue object kept below) */
  PyObject *queue_obj;
} ready_t;

static void ready_put(ready_t *r) {
  if (r == NULL || --r->refs > 0)
    return;
  if (r->event != NULL) {
    usmipc_event_t *ev = r->event;
    Py_BEGIN_ALLOW_THREADS
    usmipc_event_destroy(ev);
    Py_END_ALLOW_THREADS
  }
  Py_XDECREF(r->queue_obj);
  free(r);
}

/* What the arrays of one open share when its bytes carry a release ticket:
 * the bytes, and whether the ticket went back. It goes back once: by
 * release_shared() after the work on a stream, or from the host when the
 * last of the open's arrays is closed or collected (as a mapping of
 * IPCMemoryHandle.open returns its ticket when closed). Every open with a
 * ticket is listed while it lives, so that release_shared(bytes) -- the way
 * back for to="torch" trees, whose leaves are torch's tensors -- finds it
 * too, and so that all opens of the same bytes (one ticket) count as
 * returned once one of them has returned it. GIL held throughout. */
typedef struct ticket {
  Py_ssize_t refs;  /* arrays alive, and the open while it builds them */
  Py_ssize_t open;  /* arrays not closed yet */
  PyObject *bytes;  /* the bundle's bytes: they carry the ticket */
  PyObject *device; /* the arrays' usmipc.Device (stream= resolves on it) */
  char returned;
  struct ticket *prev, *next; /* tickets_of_opens */
} ticket_t;

static ticket_t *tickets_of_opens;

static int same_bytes(PyObject *a, const char *data, Py_ssize_t len) {
  return PyBytes_Size(a) == len &&
         memcmp(PyBytes_AsString(a), data, (size_t)len) == 0;
}

/* The first listed open of these bytes, or NULL. */
static ticket_t *ticket_of_bytes(const char *data, Py_ssize_t len) {
  for (ticket_t *t = tickets_of_opens; t != NULL; t = t->next)
    if (same_bytes(t->bytes, data, len))
      return t;
  return NULL;
}

/* Returns the ticket of bundle bytes after the work on queue (NULL: from
 * the host), and marks every open of those bytes returned first (once,
 * even if sending fails). A producer that no longer waits (gone, or its
 * bundle freed) is no error, as for mappings. 0, or -1 with an exception
 * set (quiet: none, for deallocation). */
static int ticket_send(pyusmipc_module_state_t *st, PyObject *bytes,
                       usmipc_queue_t *queue, int quiet) {
  const char *data = PyBytes_AsString(bytes);
  Py_ssize_t len = PyBytes_Size(bytes);
  for (ticket_t *t = tickets_of_opens; t != NULL; t = t->next)
    if (same_bytes(t->bytes, data, len))
      t->returned = 1;
  Py_INCREF(bytes); /* an open may die while the GIL is released */
  int rc;
  Py_BEGIN_ALLOW_THREADS
  rc = usmipc_ipc_release(data, (size_t)len, queue);
  Py_END_ALLOW_THREADS
  Py_DECREF(bytes);
  if (rc == 0 || rc == USMIPC_EEXPORTERGONE || quiet)
    return 0;
  pyusmipc_raise(st, rc);
  return -1;
}

/* The ticket of t's open, unless returned already, after the work on
 * stream (NULL or None: from the host). */
static void ticket_put(ticket_t *t);

static int ticket_return(ticket_t *t, PyObject *stream, const char *what,
                         int quiet) {
  if (t == NULL || t->returned)
    return 0;
  pyusmipc_module_state_t *st = pyusmipc_state_from_device(t->device);
  PyObject *queue_obj = NULL;
  if (stream != NULL && stream != Py_None) {
    /* The stream's code may drop every array of the open (and release
     * the bytes' open list entry): t is held across it. */
    t->refs++;
    queue_obj = pyusmipc_queue_from_stream(st, stream, NULL, t->device, what);
    if (queue_obj == NULL || t->returned) {
      ticket_put(t);
      Py_XDECREF(queue_obj);
      return queue_obj == NULL ? -1 : 0;
    }
  }
  int rc = ticket_send(
      st, t->bytes,
      queue_obj ? ((pyusmipc_queue_object_t *)queue_obj)->queue : NULL, quiet);
  if (queue_obj != NULL) {
    ticket_put(t);
    Py_DECREF(queue_obj);
  }
  return rc;
}

/* An array of t's open was closed (or collected unclosed): the last one
 * gives the ticket back from the host. */
static int ticket_close(ticket_t *t, int quiet) {
  if (t == NULL || --t->open > 0)
    return 0;
  return ticket_return(t, NULL, "close()", quiet);
}

static void ticket_put(ticket_t *t) {
  if (t == NULL || --t->refs > 0)
    return;
  /* No array was made (the open failed while building): nothing holds the
   * memory any more. */
  (void)ticket_return(t, NULL, "open_shared()", 1);
  if (t->prev)
    t->prev->next = t->next;
  else
    tickets_of_opens = t->next;
  if (t->next)
    t->next->prev = t->prev;
  Py_DECREF(t->bytes);
  Py_XDECREF(t->device);
  free(t);
}

typedef struct {
  PyObject_HEAD void *ptr;
  size_t extent;
  uint8_t code, bits;
  int ndim;
  int64_t *dims; /* shape then strides (elements) */
  PyObject *device;
  ready_t *ready;
  ticket_t *ticket; /* the open's release ticket, or NULL */
  Py_ssize_t exports; /* capsules and buffer views alive */
  char closed, released;
  char unticketed; /* of bytes that name memory but carry no ticket */
} Arr;

static int arr_release(Arr *self) {
  if (self->released || self->ptr == NULL) {
    self->released = 1;
    return 0;
  }
  self->released = 1;
  int rc;
  void *p = self->ptr;
  Py_BEGIN_ALLOW_THREADS
  rc = usmipc_ipc_close(p);
  Py_END_ALLOW_THREADS
  if (rc != 0)
    return pyusmipc_raise(pyusmipc_state_from_device(self->device), rc) ? 0 : -1;
  return 0;
}

static PyObject *arr_close(PyObject *op, PyObject *Py_UNUSED(ignored)) {
  Arr *self = (Arr *)op;
  int first = !self->closed;
  self->closed = 1;
  if (self->exports == 0 && arr_release(self) < 0)
    return NULL;
  if (first && ticket_close(self->ticket, 0) < 0)
    return NULL;
  Py_RETURN_NONE;
}

static void arr_end_export(Arr *self) {
  if (--self->exports == 0 && self->closed && arr_release(self) < 0)
    PyErr_WriteUnraisable((PyObject *)self);
}

/* The number of elements times scale, in *out; 0, or -1 when that does
 * not fit a Py_ssize_t. A broadcast array (zero strides) is valid with any
 * shape the decoder accepts: 2^120 elements of one byte each. */
static int arr_count(const Arr *self, Py_ssize_t scale, Py_ssize_t *out) {
  Py_ssize_t n = scale;
  for (int i = 0; i < self->ndim; i++)
    if (self->dims[i] > PY_SSIZE_T_MAX ||
        __builtin_mul_overflow(n, (Py_ssize_t)self->dims[i], &n))
      return -1;
  *out = n;
  return 0;
}

/* The number of elements times scale as a Python int, exact however
 * large (size, nbytes). */
static PyObject *arr_count_object(const Arr *self, Py_ssize_t scale) {
  Py_ssize_t n;
  if (arr_count(self, scale, &n) == 0)
    return PyLong_FromSsize_t(n);
  PyObject *r = PyLong_FromSsize_t(scale);
  for (int i = 0; r != NULL && i < self->ndim; i++) {
    PyObject *d = PyLong_FromLongLong(self->dims[i]);
    PyObject *m = d ? PyNumber_Multiply(r, d) : NULL;
    Py_XDECREF(d);
    Py_DECREF(r);
    r = m;
  }
  return r;
}

static PyObject *arr_tuple(const int64_t *v, int n, int64_t scale) {
  PyObject *t = PyTuple_New(n);
  for (int i = 0; t && i < n; i++) {
    int64_t scaled;
    PyObject *x;
    if (!__builtin_mul_overflow(v[i], scale, &scaled)) {
      x = PyLong_FromLongLong(scaled);
    } else { /* strides in bytes past 64 bits: exact as a Python int */
      PyObject *a = PyLong_FromLongLong(v[i]), *b = PyLong_FromLongLong(scale);
      x = a && b ? PyNumber_Multiply(a, b) : NULL;
      Py_XDECREF(a);
      Py_XDECREF(b);
    }
    if (x == NULL) {
      Py_CLEAR(t);
      break;
    }
    PyTuple_SetItem(t, i, x);
  }
  return t;
}

static int check_open(Arr *self) {
  if (self->closed || self->released) {
    pyusmipc_value_error("the shared array is closed");
    return -1;
  }
  return 0;
}

static PyObject *arr_get_shape(PyObject *op, void *c) {
  (void)c;
  Arr *self = (Arr *)op;
  return arr_tuple(self->dims, self->ndim, 1);
}

static PyObject *arr_get_strides(PyObject *op, void *c) {
  (void)c;
  Arr *self = (Arr *)op;
  return arr_tuple(self->dims + self->ndim, self->ndim, self->bits / 8);
}

static PyObject *arr_get_dtype(PyObject *op, void *c) {
  (void)c;
  Arr *self = (Arr *)op;
  return PyUnicode_FromString(dtype_by_code(self->code, self->bits)->name);
}

static PyObject *arr_get_ndim(PyObject *op, void *c) {
  (void)c;
  return PyLong_FromLong(((Arr *)op)->ndim);
}

static PyObject *arr_get_size(PyObject *op, void *c) {
  (void)c;
  return arr_count_object((Arr *)op, 1);
}

static PyObject *arr_get_nbytes(PyObject *op, void *c) {
  (void)c;
  Arr *self = (Arr *)op;
  return arr_count_object(self, self->bits / 8);
}

static PyObject *arr_get_itemsize(PyObject *op, void *c) {
  (void)c;
  return PyLong_FromLong(((Arr *)op)->bits / 8);
}

static PyObject *arr_get_ptr(PyObject *op, void *c) {
  (void)c;
  Arr *self = (Arr *)op;
  if (check_open(self) < 0)
    return NULL;
  return PyLong_FromVoidPtr(self->ptr);
}

static PyObject *arr_get_closed(PyObject *op, void *c) {
  (void)c;
  Arr *self = (Arr *)op;
  return PyBool_FromLong(self->closed || self->released);
}

static PyObject *arr_get_device(PyObject *op, void *c) {
  (void)c;
  Arr *self = (Arr *)op;
  return Py_NewRef(self->device ? self->device : Py_None);
}

static usmipc_backend_t arr_backend(const Arr *self) {
  return self->device
             ? usmipc_device_backend(
                   ((pyusmipc_device_object_t *)self->device)->device)
             : USMIPC_BACKEND_HOST;
}

static int arr_contiguous(const Arr *self) {
  int64_t expect = 1;
  int past = 0; /* expect went past 64 bits: no stride can equal it */
  for (int i = self->ndim - 1; i >= 0; i--) {
    if (self->dims[i] > 1 && (past || self->dims[self->ndim + i] != expect))
      return 0;
    past |= __builtin_mul_overflow(expect, self->dims[i], &expect);
  }
  return 1;
}

static PyObject *arr_cai(PyObject *op, void *c) {
  (void)c;
  Arr *self = (Arr *)op;
  const dtype_entry_t *dt = dtype_by_code(self->code, self->bits);
  if (arr_backend(self) != USMIPC_BACKEND_CUDA || dt->typestr == NULL) {
    PyErr_Format(PyExc_AttributeError,
                 "__cuda_array_interface__: %s",
                 dt->typestr == NULL ? "bfloat16 has no typestr; use DLPack"
                                     : "not CUDA memory");
    return NULL;
  }
  if (check_open(self) < 0)
    return NULL;
  PyObject *shape = arr_get_shape(op, NULL);
  PyObject *strides = arr_contiguous(self) ? Py_NewRef(Py_None)
                                           : arr_get_strides(op, NULL);
  PyObject *r = NULL;
  if (shape && strides)
    r = Py_BuildValue("{s:N,s:s#,s:(N,O),s:N,s:i,s:O}", "shape", shape,
                      "typestr", "<", 1, "data",
                      PyLong_FromVoidPtr(self->ptr), Py_False, "strides",
                      strides, "version", 3, "stream", Py_None);
  else {
    Py_XDECREF(shape);
    Py_XDECREF(strides);
    return NULL;
  }
  /* typestr: byte order then the code ("<f4", "|b1"). */
  if (r != NULL) {
    PyObject *ts = PyUnicode_FromFormat("%s%s", self->bits == 8 ? "|" : "<",
                                        dt->typestr);
    if (ts == NULL || PyDict_SetItemString(r, "typestr", ts) < 0)
      Py_CLEAR(r);
    Py_XDECREF(ts);
  }
  return r;
}

static DLDevice arr_dl_device(const Arr *self) {
  if (self->device == NULL)
    return (DLDevice){kDLCPU, 0};
  /* A shared array is a mapping of exported device memory. */
  usmipc_device_t *dev = ((pyusmipc_device_object_t *)self->device)->device;
  return pyusmipc_dl_device(usmipc_device_backend(dev), USMIPC_MEM_DEVICE,
                          usmipc_device_index(dev));
}

static PyObject *arr_dlpack_device(PyObject *op, PyObject *Py_UNUSED(x)) {
  DLDevice d = arr_dl_device((Arr *)op);
  return Py_BuildValue("(ii)", (int)d.device_type, (int)d.device_id);
}

/* The capsule's context: the managed tensor, then shape and strides. */
typedef struct {
  union {
    DLManagedTensor unversioned;
    DLManagedTensorVersioned versioned;
  } managed;
  PyObject *arr;
  int64_t dims[2 * USMIPC_BUNDLE_MAX_NDIM];
} arr_ctx_t;

static void arr_ctx_release(arr_ctx_t *ctx) {
  if (!Py_IsInitialized())
    return;
  PyGILState_STATE gil = PyGILState_Ensure();
  PyObject *type, *value, *tb;
  PyErr_Fetch(&type, &value, &tb);
  Arr *self = (Arr *)ctx->arr;
  free(ctx);
  arr_end_export(self);
  Py_DECREF(self);
  PyErr_Restore(type, value, tb);
  PyGILState_Release(gil);
}

static void arr_deleter(DLManagedTensor *m) { arr_ctx_release(m->manager_ctx); }

static void arr_deleter_versioned(DLManagedTensorVersioned *m) {
  arr_ctx_release(m->manager_ctx);
}

/* Makes the consumer's stream wait for the stream the bundle was opened on
 * (DLPack's rule: the producer orders the consumer's stream). */
static int arr_dlpack_sync(Arr *self, PyObject *stream) {
  ready_t *r = self->ready;
  if (r == NULL || r->event == NULL || stream == NULL || stream == Py_None)
    return 0;
  pyusmipc_module_state_t *st = pyusmipc_state_from_device(self->device);
  PyObject *q;
  void *remember = NULL; /* a native stream to mark as synced after the wait */
  int has_native = 0;
  if (PyLong_Check(stream)) {
    long long v = PyLong_AsLongLong(stream);
    if (v == -1 && PyErr_Occurred())
      return -1;
    if (v == -1)
      return 0;
    /* DLPack's CUDA streams: 1 (and 0) the legacy default stream, 2 the
     * per-thread one (CU_STREAM_PER_THREAD), else a CUstream. The stream
     * the arrays were opened on, or one already made to wait, needs
     * nothing: no Queue is made (this runs once per tensor). */
    void *native = v <= 1 ? NULL : (void *)(uintptr_t)v;
    if (native == usmipc_queue_native(r->queue))
      return 0;
    for (int i = 0; i < r->nsynced; i++)
      if (r->synced[i] == native)
        return 0;
    q = pyusmipc_queue_wrap(st, self->device, native, NULL, "__dlpack__()");
    remember = native;
    has_native = 1;
  } else {
    q = pyusmipc_queue_from_stream(st, stream, NULL, self->device,
                                 "__dlpack__()");
  }
  if (q == NULL)
    return -1;
  usmipc_queue_t *queue = ((pyusmipc_queue_object_t *)q)->queue;
  int rc = 0;
  if (usmipc_queue_native(queue) != usmipc_queue_native(r->queue)) {
    usmipc_event_t *ev = r->event;
    Py_BEGIN_ALLOW_THREADS
    rc = usmipc_event_wait(ev, queue);
    Py_END_ALLOW_THREADS
  }
  Py_DECREF(q);
  if (rc != 0) {
    pyusmipc_raise(st, rc);
    return -1;
  }
  /* The ready event is recorded once and never again: a stream that
   * waited for it once is ordered for every array of the open. */
  if (has_native && r->nsynced < READY_SYNCED_MAX)
    r->synced[r->nsynced++] = remember;
  return 0;
}

static PyObject *arr_capsule(Arr *self, int versioned);

static PyObject *arr_dlpack(PyObject *op, PyObject *const *args,
                            Py_ssize_t nargs, PyObject *kwnames) {
  Arr *self = (Arr *)op;
  static const char *const names[] = {"stream", "max_version", "dl_device",
                                      "copy"};
  PyObject *a[4];
  if (pyusmipc_parse_fastcall("__dlpack__", args, nargs, kwnames, names, 4, 0,
                            a) < 0)
    return NULL;
  if (check_open(self) < 0)
    return NULL;
  int copy = a[3] != NULL && a[3] != Py_None ? PyObject_IsTrue(a[3]) : 0;
  if (copy < 0)
    return NULL;
  if (copy) {
    PyErr_SetString(PyExc_BufferError,
                    "__dlpack__(copy=True): a shared array is exported "
                    "without a copy");
    return NULL;
  }
  DLDevice dev = arr_dl_device(self);
  if (a[2] != NULL && a[2] != Py_None) {
    long t, i;
    PyObject *tt = PyTuple_Check(a[2]) && PyTuple_Size(a[2]) == 2
                       ? a[2]
                       : NULL;
    if (tt == NULL ||
        (t = PyLong_AsLong(PyTuple_GetItem(tt, 0))) == -1 ||
        (i = PyLong_AsLong(PyTuple_GetItem(tt, 1))) == -1 ||
        t != dev.device_type || i != dev.device_id) {
      PyErr_Clear();
      PyErr_SetString(PyExc_BufferError,
                      "__dlpack__(dl_device=...): a shared array is exported "
                      "on its own device only");
      return NULL;
    }
  }
  int versioned = 0;
  if (a[1] != NULL && a[1] != Py_None) {
    if (!PyTuple_Check(a[1]) || PyTuple_Size(a[1]) < 1) {
      pyusmipc_type_error("max_version must be a tuple");
      return NULL;
    }
    long major = PyLong_AsLong(PyTuple_GetItem(a[1], 0));
    if (major == -1 && PyErr_Occurred())
      return NULL;
    versioned = major >= 1;
  }
  if (arr_dlpack_sync(self, a[0]) < 0)
    return NULL;
  /* Again: reading the arguments (__index__, __bool__) and the stream ran
   * the caller's code, which may have closed the array. */
  if (check_open(self) < 0)
    return NULL;
  return arr_capsule(self, versioned);
}

/* A new DLPack capsule of the array (an export: the array stays mapped
 * until the consumer's deleter runs). */
static PyObject *arr_capsule(Arr *self, int versioned) {
  PyObject *op = (PyObject *)self;
  DLDevice dev = arr_dl_device(self);
  arr_ctx_t *ctx = calloc(1, sizeof(*ctx));
  if (ctx == NULL)
    return PyErr_NoMemory();
  memcpy(ctx->dims, self->dims, 2 * (size_t)self->ndim * sizeof(int64_t));
  DLTensor t = {.data = self->ptr,
                .device = dev,
                .ndim = self->ndim,
                .dtype = {self->code, self->bits, 1},
                .shape = ctx->dims,
                .strides = ctx->dims + self->ndim,
                .byte_offset = 0};
  ctx->arr = Py_NewRef(op);
  PyObject *capsule;
  if (versioned) {
    ctx->managed.versioned.version = (DLPackVersion){1, 0};
    ctx->managed.versioned.manager_ctx = ctx;
    ctx->managed.versioned.deleter = arr_deleter_versioned;
    ctx->managed.versioned.dl_tensor = t;
    capsule = PyCapsule_New(&ctx->managed.versioned, "dltensor_versioned",
                            pyusmipc_dl_capsule_destructor);
  } else {
    ctx->managed.unversioned.manager_ctx = ctx;
    ctx->managed.unversioned.deleter = arr_deleter;
    ctx->managed.unversioned.dl_tensor = t;
    capsule = PyCapsule_New(&ctx->managed.unversioned, "dltensor",
                            pyusmipc_dl_capsule_destructor);
  }
  if (capsule == NULL) {
    Py_DECREF(op);
    free(ctx);
    return NULL;
  }
  self->exports++;
  return capsule;
}

static int arr_getbuffer(PyObject *op, Py_buffer *view, int flags) {
  Arr *self = (Arr *)op;
  view->obj = NULL;
  if (check_open(self) < 0)
    return -1;
  const dtype_entry_t *dt = dtype_by_code(self->code, self->bits);
  if (arr_backend(self) != USMIPC_BACKEND_HOST || dt->format == NULL) {
    PyErr_Format(PyExc_BufferError,
                 "%s; use __dlpack__",
                 dt->format == NULL ? "bfloat16 has no buffer format"
                                    : "device memory is not accessible from "
                                      "the host");
    return -1;
  }
  /* The buffer's len is the elements' bytes, a Py_ssize_t: a broadcast
   * array of more (its strides zero) has no buffer, as NumPy makes no
   * array of more than PY_SSIZE_T_MAX bytes. */
  Py_ssize_t len;
  int too_large = arr_count(self, self->bits / 8, &len) < 0;
  for (int i = 0; !too_large && i < self->ndim; i++) {
    Py_ssize_t step;
    too_large = self->dims[self->ndim + i] > PY_SSIZE_T_MAX ||
                __builtin_mul_overflow((Py_ssize_t)self->dims[self->ndim + i],
                                       (Py_ssize_t)(self->bits / 8), &step);
  }
  if (too_large) {
    PyErr_SetString(PyExc_BufferError,
                    "the shared array's size in bytes (or a stride) does "
                    "not fit in a Py_ssize_t, so it has no buffer (a "
                    "broadcast array of that many elements); use __dlpack__, "
                    "or share a smaller view");
    return -1;
  }
  /* shape and strides in bytes, kept in one block freed at release. */
  Py_ssize_t *sv = malloc(sizeof(Py_ssize_t) * 2 * (size_t)(self->ndim + 1));
  if (sv == NULL) {
    PyErr_NoMemory();
    return -1;
  }
  for (int i = 0; i < self->ndim; i++) {
    sv[i] = (Py_ssize_t)self->dims[i];
    sv[self->ndim + i] =
        (Py_ssize_t)self->dims[self->ndim + i] * (self->bits / 8);
  }
  view->buf = self->ptr;
  view->obj = Py_NewRef(op);
  view->len = len;
  view->itemsize = self->bits / 8;
  view->readonly = 0;
  view->ndim = self->ndim;
  view->format = (flags & PyBUF_FORMAT) ? (char *)dt->format : NULL;
  view->shape = sv;
  view->strides = sv + self->ndim;
  view->suboffsets = NULL;
  view->internal = sv;
  if (!(flags & PyBUF_STRIDES) && !arr_contiguous(self)) {
    free(sv);
    Py_CLEAR(view->obj);
    PyErr_SetString(PyExc_BufferError, "the shared array is not contiguous");
    return -1;
  }
  self->exports++;
  return 0;
}

static void arr_releasebuffer(PyObject *op, Py_buffer *view) {
  free(view->internal);
  arr_end_export((Arr *)op);
}

static PyObject *arr_repr(PyObject *op) {
  Arr *self = (Arr *)op;
  PyObject *shape = arr_get_shape(op, NULL);
  if (shape == NULL)
    return NULL;
  PyObject *r = PyUnicode_FromFormat(
      "<usmipc.SharedArray %s %R%s>",
      dtype_by_code(self->code, self->bits)->name, shape,
      self->closed || self->released ? " closed" : "");
  Py_DECREF(shape);
  return r;
}

static int arr_traverse(PyObject *op, visitproc visit, void *arg) {
  Py_VISIT(Py_TYPE(op));
  Py_VISIT(((Arr *)op)->device);
  return 0;
}

static void arr_dealloc(PyObject *op) {
  Arr *self = (Arr *)op;
  PyTypeObject *tp = Py_TYPE(op);
  PyObject_GC_UnTrack(op);
  if (arr_release(self) < 0)
    PyErr_WriteUnraisable(op);
  /* Collected unclosed: the producer still learns of it (best effort;
   * nothing can be reported from here). */
  if (!self->closed)
    (void)ticket_close(self->ticket, 1);
  ticket_put(self->ticket);
  ready_put(self->ready);
  free(self->dims);
  Py_CLEAR(self->device);
  PyObject_GC_Del(op);
  Py_DECREF(tp);
}

/* The bytes the array spans (its elements, and for a strided array the
 * gaps between them), copied to the host through the device's queue. */
static PyObject *arr_tobytes(PyObject *op, PyObject *Py_UNUSED(ignored)) {
  Arr *self = (Arr *)op;
  if (check_open(self) < 0)
    return NULL;
  PyObject *out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)self->extent);
  if (out == NULL || self->extent == 0)
    return out;
  PyObject *queue = pyusmipc_default_queue(
      pyusmipc_state_from_device(self->device), self->device);
  if (queue == NULL) {
    Py_DECREF(out);
    return NULL;
  }
  usmipc_queue_t *q = ((pyusmipc_queue_object_t *)queue)->queue;
  char *dst = PyBytes_AsString(out);
  int rc;
  self->exports++; /* a close meanwhile waits for the copy */
  Py_BEGIN_ALLOW_THREADS
  rc = usmipc_memcpy(q, dst, self->ptr, self->extent);
  Py_END_ALLOW_THREADS
  arr_end_export(self);
  Py_DECREF(queue);
  if (rc != 0) {
    Py_DECREF(out);
    return pyusmipc_raise(pyusmipc_state_from_device(self->device), rc);
  }
  return out;
}

static PyMethodDef arr_methods[] = {
    {"tobytes", arr_tobytes, METH_NOARGS,
     "tobytes()\n--\n\nA host copy of the bytes the array spans (for a "
     "C-contiguous array, its elements in order)."},
    {"close", arr_close, METH_NOARGS,
     "close()\n--\n\nDrops this array's mapping (deferred while a DLPack "
     "tensor or a buffer view of it lives). Idempotent. Closing the last "
     "array of an open returns its release ticket, if the producer asked "
     "for one and it was not returned yet, from the host."},
    {"__dlpack__", PYUSMIPC_CMETHOD(arr_dlpack),
     METH_FASTCALL | METH_KEYWORDS,
     "__dlpack__(*, stream=None, max_version=None, dl_device=None, "
     "copy=None)\n--\n\nA DLPack capsule of the array, without a copy."},
    {"__dlpack_device__", arr_dlpack_device, METH_NOARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef arr_getset[] = {
    {"shape", arr_get_shape, NULL, "The shape, as the producer's.", NULL},
    {"strides", arr_get_strides, NULL, "Strides in bytes (NumPy's unit).",
     NULL},
    {"dtype", arr_get_dtype, NULL, "The element type's name ('bfloat16').",
     NULL},
    {"ndim", arr_get_ndim, NULL, NULL, NULL},
    {"size", arr_get_size, NULL, "The number of elements.", NULL},
    {"nbytes", arr_get_nbytes, NULL, "size * itemsize.", NULL},
    {"itemsize", arr_get_itemsize, NULL, NULL, NULL},
    {"ptr", arr_get_ptr, NULL, "The address of the first element here.",
     NULL},
    {"closed", arr_get_closed, NULL, NULL, NULL},
    {"device", arr_get_device, NULL, "The usmipc.Device it is mapped on.",
     NULL},
    {"__cuda_array_interface__", arr_cai, NULL, NULL, NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot arr_slots[] = {
    {Py_tp_doc,
     (void *)"An array another process shared (a leaf of "
             "usmipc.open_shared()), mapped without a copy: shape, dtype, "
             "strides, __dlpack__, __cuda_array_interface__ on CUDA and the "
             "buffer protocol on host memory."},
    {Py_tp_dealloc, arr_dealloc},
    {Py_tp_traverse, arr_traverse},
    {Py_tp_repr, arr_repr},
    {Py_tp_methods, arr_methods},
    {Py_tp_getset, arr_getset},
    {Py_bf_getbuffer, arr_getbuffer},
    {Py_bf_releasebuffer, arr_releasebuffer},
    {0, NULL},
};

static PyType_Spec arr_spec = {
    .name = "usmipc.SharedArray",
    .basicsize = sizeof(Arr),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC |
             Py_TPFLAGS_IMMUTABLETYPE | Py_TPFLAGS_DISALLOW_INSTANTIATION,
    .slots = arr_slots,
};

/* ---- open_shared / close_shared ------------------------------------------- */

typedef struct build {
  pyusmipc_module_state_t *st;
  const usmipc_bundle_node_t *nodes;
  const usmipc_bundle_array_t *arrays;
  size_t next;
  PyObject **made; /* the arrays made so far, to close on failure */
  PyObject *device;
  ready_t *ready;
  ticket_t *ticket;
  char unticketed;   /* the bytes name memory and carry no ticket */
  PyObject *convert; /* to="torch": torch._C._from_dlpack; else NULL */
} build_t;

static PyObject *make_array(build_t *b, const usmipc_bundle_array_t *a) {
  Arr *self = PyObject_GC_New(Arr, (PyTypeObject *)b->st->SharedArrayType);
  if (self == NULL)
    return NULL;
  self->ptr = a->ptr;
  self->extent = a->extent;
  self->code = a->desc.dtype_code;
  self->bits = a->desc.dtype_bits;
  self->ndim = a->desc.ndim;
  self->exports = 0;
  self->closed = self->released = 0;
  self->unticketed = b->unticketed;
  self->device = Py_XNewRef(b->device);
  self->ready = b->ready;
  if (b->ready)
    b->ready->refs++;
  self->ticket = b->ticket;
  if (b->ticket) {
    b->ticket->refs++;
    b->ticket->open++;
  }
  self->dims = malloc(sizeof(int64_t) * 2 * (size_t)(a->desc.ndim + 1));
  if (self->dims == NULL) {
    self->released = 1; /* the caller still owns the reference */
    Py_DECREF(self);
    return PyErr_NoMemory();
  }
  memcpy(self->dims, a->desc.shape, sizeof(int64_t) * (size_t)a->desc.ndim);
  memcpy(self->dims + a->desc.ndim, a->desc.strides,
         sizeof(int64_t) * (size_t)a->desc.ndim);
  PyObject_GC_Track(self);
  return (PyObject *)self;
}

static PyObject *build_node(build_t *b) {
  const usmipc_bundle_node_t *n = &b->nodes[b->next++];
  if (n->kind == USMIPC_BUNDLE_ARRAY) {
    PyObject *arr = make_array(b, &b->arrays[n->count]);
    if (arr != NULL)
      b->made[n->count] = Py_NewRef(arr);
    if (arr == NULL || b->convert == NULL)
      return arr;
    /* to="torch": the framework's tensor of a capsule, which keeps the
     * array (and its mapping) alive until the tensor dies. A versioned
     * capsule (DLPack 1.0), as torch.from_dlpack asks for. */
    PyObject *capsule = arr_capsule((Arr *)arr, 1);
    Py_DECREF(arr);
    if (capsule == NULL)
      return NULL;
    PyObject *tensor =
        PyObject_CallFunctionObjArgs(b->convert, capsule, NULL);
    Py_DECREF(capsule);
    return tensor;
  }
  PyObject *c = n->kind == USMIPC_BUNDLE_DICT   ? PyDict_New()
                : n->kind == USMIPC_BUNDLE_LIST ? PyList_New(n->count)
                                                : PyTuple_New(n->count);
  if (c == NULL)
    return NULL;
  for (uint32_t i = 0; i < n->count; i++) {
    const usmipc_bundle_node_t *child = &b->nodes[b->next];
    PyObject *v = build_node(b);
    if (v == NULL) {
      Py_DECREF(c);
      return NULL;
    }
    if (n->kind == USMIPC_BUNDLE_DICT) {
      PyObject *k = PyUnicode_DecodeUTF8(child->key, (Py_ssize_t)child->key_len,
                                         "strict");
      int rc = k ? PyDict_SetItem(c, k, v) : -1;
      Py_XDECREF(k);
      Py_DECREF(v);
      if (rc < 0) {
        Py_DECREF(c);
        return NULL;
      }
    } else if (n->kind == USMIPC_BUNDLE_LIST) {
      PyList_SetItem(c, i, v);
    } else {
      PyTuple_SetItem(c, i, v);
    }
  }
  if (n->kind == USMIPC_BUNDLE_DICT && PyDict_Size(c) != n->count) {
    Py_DECREF(c);
    pyusmipc_value_error("open_shared(): a dict of the bundle repeats a key");
    return NULL;
  }
  return c;
}

static PyObject *open_shared(PyObject *module, PyObject *const *args,
                             Py_ssize_t nargs, PyObject *kwnames) {
  static const char *const names[] = {"data", "device", "stream", "to"};
  PyObject *a[4];
  if (pyusmipc_parse_fastcall("open_shared", args, nargs, kwnames, names, 4, 1,
                            a) < 0)
    return NULL;
  pyusmipc_module_state_t *st = PyModule_GetState(module);
  PyObject *convert = NULL;
  if (a[3] != NULL && a[3] != Py_None) {
    if (!PyUnicode_Check(a[3]) ||
        PyUnicode_CompareWithASCIIString(a[3], "torch") != 0) {
      pyusmipc_value_error("open_shared(to=...): None (SharedArray leaves) or "
                      "'torch' (torch tensors)");
      return NULL;
    }
    /* torch.from_dlpack's own converter, after torch's CUDA is initialized
     * (its Python wrapper does that through current_stream(); the converter
     * alone does not). */
    PyObject *torch = PyImport_ImportModule("torch");
    PyObject *cuda = torch ? PyObject_GetAttrString(torch, "cuda") : NULL;
    PyObject *avail =
        cuda ? PyObject_CallMethod(cuda, "is_available", NULL) : NULL;
    int has_cuda = avail ? PyObject_IsTrue(avail) : -1;
    Py_XDECREF(avail);
    PyObject *inited =
        has_cuda > 0 ? PyObject_CallMethod(cuda, "init", NULL) : NULL;
    if (has_cuda > 0 && inited == NULL) {
      Py_XDECREF(cuda);
      Py_XDECREF(torch);
      return NULL;
    }
    Py_XDECREF(inited);
    Py_XDECREF(cuda);
    PyObject *torch_c = has_cuda >= 0 ? PyObject_GetAttrString(torch, "_C")
                                      : NULL;
    Py_XDECREF(torch);
    convert = torch_c ? PyObject_GetAttrString(torch_c, "_from_dlpack") : NULL;
    Py_XDECREF(torch_c);
    if (convert == NULL)
      return NULL;
  }
  if (a[0] == NULL) {
    pyusmipc_type_error("open_shared() missing argument 'data'");
    return NULL;
  }
  PyObject *bytes;
  if (PyObject_TypeCheck(a[0], (PyTypeObject *)st->SharedBundleType)) {
    bytes = bundle_to_bytes(a[0], NULL);
  } else if (PyBytes_Check(a[0])) {
    bytes = Py_NewRef(a[0]);
  } else {
    bytes = PyBytes_FromObject(a[0]); /* any buffer */
  }
  if (bytes == NULL) {
    Py_XDECREF(convert);
    return NULL;
  }
  PyObject *device, *queue = NULL;
  usmipc_device_t *dev;
  if (pyusmipc_optional_device_arg(st, a[1], &device, &dev) < 0) {
    Py_DECREF(bytes);
    Py_XDECREF(convert);
    return NULL;
  }
  if (a[2] != NULL && a[2] != Py_None &&
      (queue = pyusmipc_queue_from_stream(st, a[2], device, device,
                                        "open_shared()")) == NULL) {
    Py_XDECREF(device);
    Py_DECREF(bytes);
    Py_XDECREF(convert);
    return NULL;
  }
  usmipc_queue_t *q = queue ? ((pyusmipc_queue_object_t *)queue)->queue : NULL;
  const char *data = PyBytes_AsString(bytes);
  size_t len = (size_t)PyBytes_Size(bytes);
  usmipc_opened_bundle_t *ob = NULL;
  int rc;
  Py_BEGIN_ALLOW_THREADS
  rc = usmipc_bundle_open(data, len, dev, q, 0, &ob);
  Py_END_ALLOW_THREADS
  Py_XDECREF(device);
  if (rc != 0) {
    Py_DECREF(bytes);
    Py_XDECREF(queue);
    Py_XDECREF(convert);
    return pyusmipc_raise(st, rc);
  }
  size_t nnode, narr;
  build_t b = {.st = st, .convert = convert};
  b.nodes = usmipc_opened_bundle_nodes(ob, &nnode);
  b.arrays = usmipc_opened_bundle_arrays(ob, &narr);
  usmipc_device_t *mapped = usmipc_opened_bundle_device(ob);
  b.device = mapped ? pyusmipc_device_object(st, mapped) : NULL;
  b.made = calloc(narr ? narr : 1, sizeof(PyObject *));
  PyObject *tree = NULL;
  if ((mapped != NULL && b.device == NULL) || b.made == NULL) {
    if (b.made == NULL)
      PyErr_NoMemory();
    goto done;
  }
  if (queue != NULL) {
    /* Ready on the open's stream: other streams wait for it (__dlpack__). */
    b.ready = calloc(1, sizeof(*b.ready));
    if (b.ready == NULL) {
      PyErr_NoMemory();
      goto done;
    }
    b.ready->refs = 1;
    b.ready->queue = q;
    b.ready->queue_obj = Py_NewRef(queue);
    if (usmipc_event_create(usmipc_queue_device(q), 0, &b.ready->event) == 0)
      usmipc_event_record(b.ready->event, q);
    else
      b.ready->event = NULL; /* a backend without events: host waited */
  }
  if (usmipc_opened_bundle_ticket(ob) != 0) {
    /* The producer asked for a release: the arrays keep the bytes until
     * the ticket goes back (the bytes carry it, and name the producer). */
    b.ticket = calloc(1, sizeof(*b.ticket));
    if (b.ticket == NULL) {
      PyErr_NoMemory();
      goto done;
    }
    b.ticket->refs = 1;
    b.ticket->bytes = Py_NewRef(bytes);
    b.ticket->device = Py_XNewRef(b.device);
    b.ticket->next = tickets_of_opens;
    if (tickets_of_opens)
      tickets_of_opens->prev = b.ticket;
    tickets_of_opens = b.ticket;
  } else {
    /* As usmipc_ipc_release judges the bytes: with no memory there is
     * nothing to give back, with memory the missing ticket is an error. */
    for (size_t i = 0; i < narr; i++)
      b.unticketed |= b.arrays[i].ptr != NULL;
  }
  tree = build_node(&b);
done:
  if (tree == NULL) {
    /* Arrays made so far close when their objects die below; the rest of
     * the references are dropped here. */
    for (size_t i = 0; i < narr; i++)
      if (b.made == NULL || b.made[i] == NULL) {
        if (b.arrays[i].ptr != NULL)
          usmipc_ipc_close(b.arrays[i].ptr);
      }
  }
  for (size_t i = 0; b.made && i < narr; i++)
    Py_XDECREF(b.made[i]);
  free(b.made);
  ready_put(b.ready);
  ticket_put(b.ticket);
  Py_XDECREF(b.device);
  Py_XDECREF(queue);
  Py_XDECREF(convert);
  Py_DECREF(bytes);
  usmipc_bundle_release(ob);
  return tree;
}

/* Calls leaf(leaf_ctx, array) on every SharedArray of a tree of dicts,
 * lists and tuples (what open_shared() returned), stopping at the first
 * failure. Anything else in the tree is refused: "WHAT: a T is not a shared
 * array (pass what open_shared() returned HINT)". */
typedef int (*tree_leaf_fn)(void *leaf_ctx, PyObject *array);

static int walk_tree(pyusmipc_module_state_t *st, PyObject *obj,
                     tree_leaf_fn leaf, void *leaf_ctx, const char *what,
                     const char *hint, int depth) {
  if (depth > 64) {
    pyusmipc_value_error("%s: nested too deeply", what);
    return -1;
  }
  if (PyObject_TypeCheck(obj, (PyTypeObject *)st->SharedArrayType))
    return leaf(leaf_ctx, obj);
  if (PyDict_Check(obj) || PyList_Check(obj) || PyTuple_Check(obj)) {
    /* A copy: a leaf (release_shared's stream=) runs the caller's code,
     * which may empty the container and free the arrays in it. */
    PyObject *seq =
        PyDict_Check(obj) ? PyDict_Values(obj) : PySequence_Tuple(obj);
    if (seq != NULL && PyList_Check(seq)) {
      PyObject *t = PyList_AsTuple(seq);
      Py_DECREF(seq);
      seq = t;
    }
    if (seq == NULL)
      return -1;
    for (Py_ssize_t i = 0; i < PyTuple_Size(seq); i++)
      if (walk_tree(st, PyTuple_GetItem(seq, i), leaf, leaf_ctx, what, hint,
                    depth + 1) < 0) {
        Py_DECREF(seq);
        return -1;
      }
    Py_DECREF(seq);
    return 0;
  }
  PyObject *tn = type_name(obj);
  if (tn != NULL)
    pyusmipc_type_error("%s: a %U is not a shared array (pass what "
                      "open_shared() returned%s)",
                      what, tn, hint);
  Py_XDECREF(tn);
  return -1;
}

static int close_leaf(void *unused, PyObject *array) {
  (void)unused;
  PyObject *r = arr_close(array, NULL);
  Py_XDECREF(r);
  return r ? 0 : -1;
}

static int close_tree(pyusmipc_module_state_t *st, PyObject *obj) {
  return walk_tree(st, obj, close_leaf, NULL, "close_shared()", "", 0);
}

/* Returns the tickets of the opens a tree's SharedArray leaves belong to,
 * each once, after the work on stream. */
typedef struct {
  pyusmipc_module_state_t *st;
  PyObject *stream;
  const char *what;
  int strict; /* release_shared(): a leaf without a ticket is refused */
} release_leaf_ctx;

static int release_leaf(void *ctx, PyObject *array) {
  release_leaf_ctx *c = ctx;
  Arr *a = (Arr *)array;
  if (a->ticket == NULL && a->unticketed && c->strict) {
    /* What release_shared(bytes) says of the same bytes (the library's
     * message, src/bundle.c usmipc__bundle_ticket), word for word. */
    pyusmipc_raise_msg(c->st, USMIPC_EINVAL,
                     "usmipc_ipc_release: the bundle carries no release "
                     "ticket (its producer did not order it with "
                     "usmipc_bundle_order_ex(..., USMIPC_ORDER_RELEASE), or "
                     "share(..., release=True) in Python)");
    return -1;
  }
  return ticket_return(a->ticket, c->stream, c->what, 0);
}

static int release_tree(pyusmipc_module_state_t *st, PyObject *obj,
                        PyObject *stream, const char *what) {
  release_leaf_ctx c = {st, stream, what,
                        strcmp(what, "release_shared()") == 0};
  return walk_tree(st, obj, release_leaf, &c, what,
                   "; for open_shared(..., to='torch'), whose leaves are "
                   "torch tensors, pass the bytes it opened",
                   0);
}

/* release_shared(bytes): the ticket of bundle bytes. Of bytes opened here
 * it is the opens' ticket (returned once; their arrays then send nothing
 * when they close); other bytes go back as given, and are refused as C
 * refuses them (no ticket: USMIPC_EINVAL). */
static int release_bytes(pyusmipc_module_state_t *st, PyObject *bytes,
                         PyObject *stream) {
  ticket_t *t = ticket_of_bytes(PyBytes_AsString(bytes), PyBytes_Size(bytes));
  if (t != NULL)
    return ticket_return(t, stream, "release_shared()", 0);
  PyObject *queue_obj = NULL;
  if (stream != NULL && stream != Py_None &&
      (queue_obj = pyusmipc_queue_from_stream(st, stream, NULL, NULL,
                                            "release_shared()")) == NULL)
    return -1;
  int rc = ticket_send(
      st, bytes,
      queue_obj ? ((pyusmipc_queue_object_t *)queue_obj)->queue : NULL, 0);
  Py_XDECREF(queue_obj);
  return rc;
}

static PyObject *release_shared(PyObject *module, PyObject *const *args,
                                Py_ssize_t nargs, PyObject *kwnames) {
  static const char *const names[] = {"tree", "stream"};
  PyObject *a[2];
  if (pyusmipc_parse_fastcall("release_shared", args, nargs, kwnames, names, 2,
                            1, a) < 0)
    return NULL;
  if (a[0] == NULL) {
    pyusmipc_type_error("release_shared() missing argument 'tree'");
    return NULL;
  }
  pyusmipc_module_state_t *st = PyModule_GetState(module);
  PyObject *obj = a[0];
  int rc;
  if (PyObject_TypeCheck(obj, (PyTypeObject *)st->SharedArrayType) ||
      PyDict_Check(obj) || PyList_Check(obj) || PyTuple_Check(obj)) {
    rc = release_tree(st, obj, a[1], "release_shared()");
  } else if (PyObject_TypeCheck(obj, (PyTypeObject *)st->SharedBundleType)) {
    if (((Bundle *)obj)->bundle != NULL) {
      pyusmipc_value_error("release_shared(): this SharedBundle is the "
                         "producer's own (from share()), which hands tickets "
                         "out; a consumer passes what open_shared() returned, "
                         "or the bytes it opened");
      return NULL;
    }
    rc = release_bytes(st, ((Bundle *)obj)->bytes, a[1]);
  } else if (PyBytes_Check(obj) || PyObject_CheckBuffer(obj)) {
    PyObject *bytes = PyBytes_Check(obj) ? Py_NewRef(obj)
                                         : PyBytes_FromObject(obj);
    if (bytes == NULL)
      return NULL;
    rc = release_bytes(st, bytes, a[1]);
    Py_DECREF(bytes);
  } else {
    rc = release_tree(st, obj, a[1], "release_shared()"); /* says why */
  }
  if (rc < 0)
    return NULL;
  Py_RETURN_NONE;
}

static PyObject *close_shared(PyObject *module, PyObject *const *args,
                              Py_ssize_t nargs, PyObject *kwnames) {
  static const char *const names[] = {"tree", "stream"};
  PyObject *a[2];
  if (pyusmipc_parse_fastcall("close_shared", args, nargs, kwnames, names, 2, 1,
                            a) < 0)
    return NULL;
  if (a[0] == NULL) {
    pyusmipc_type_error("close_shared() missing argument 'tree'");
    return NULL;
  }
  pyusmipc_module_state_t *st = PyModule_GetState(module);
  /* With a stream, the tickets go back after its work first; without, the
   * last close of each open returns its ticket from the host. */
  if (a[1] != NULL && a[1] != Py_None &&
      release_tree(st, a[0], a[1], "close_shared()") < 0)
    return NULL;
  if (close_tree(st, a[0]) < 0)
    return NULL;
  Py_RETURN_NONE;
}

static PyObject *stats(PyObject *module, PyObject *Py_UNUSED(x)) {
  (void)module;
  usmipc_stats_t s;
  usmipc_get_stats(&s, sizeof(s));
  return Py_BuildValue(
      "{s:K,s:K,s:K,s:K,s:K,s:K}", "driver_exports", s.driver_exports,
      "driver_imports", s.driver_imports, "driver_queries", s.driver_queries,
      "descriptors_sent", s.descriptors_sent, "descriptors_received",
      s.descriptors_received, "transport_exchanges", s.transport_exchanges);
}

static PyObject *reset_stats(PyObject *module, PyObject *Py_UNUSED(x)) {
  (void)module;
  usmipc_reset_stats();
  Py_RETURN_NONE;
}

static PyMethodDef bundle_functions[] = {
    {"share", PYUSMIPC_CMETHOD(share),
     METH_FASTCALL | METH_KEYWORDS,
     "share(obj, stream=None, ordered=None, release=False)\n--\n\n"
     "Exports an array (usmipc memory, a torch tensor, anything with "
     "__cuda_array_interface__ or __dlpack__) or a dict / list / tuple of "
     "them (a state_dict) for other processes: each allocation once, every "
     "array as metadata. Returns a SharedBundle (to_bytes(), pickle) that "
     "keeps the arrays alive. Ordered like IPCMemoryHandle: each "
     "to_bytes() records an event on stream (default: the arrays' current "
     "stream) that open_shared waits for; ordered=False turns that off. "
     "release=True: every to_bytes() (and pickle) also carries a release "
     "ticket, which the consumer returns with release_shared() (or by "
     "closing what it opened); SharedBundle.wait_released() waits for all "
     "of them."},
    {"open_shared", PYUSMIPC_CMETHOD(open_shared),
     METH_FASTCALL | METH_KEYWORDS,
     "open_shared(data, device=None, stream=None, to=None)\n--\n\n"
     "Opens the bytes of a SharedBundle (or the bundle itself): the same "
     "nesting, each array a SharedArray mapped without a copy. Waits for "
     "the producer's work on the host, or on stream (the device waits). "
     "to='torch' gives torch tensors instead (made from DLPack capsules in "
     "C, faster than torch.from_dlpack per leaf), ready on stream; each "
     "keeps its mapping until it dies."},
    {"close_shared", PYUSMIPC_CMETHOD(close_shared),
     METH_FASTCALL | METH_KEYWORDS,
     "close_shared(tree, stream=None)\n--\n\nCloses every SharedArray of "
     "a tree open_shared() returned (they also close when collected). If "
     "the producer asked for a release (share(..., release=True)), the "
     "ticket goes back first: after the work submitted to stream, or, "
     "without one, from the host."},
    {"release_shared", PYUSMIPC_CMETHOD(release_shared),
     METH_FASTCALL | METH_KEYWORDS,
     "release_shared(tree, stream=None)\n--\n\nTells the producer of a "
     "bundle shared with release=True that this consumer is done with it, "
     "after the work submitted to stream (None: now): its "
     "SharedBundle.wait_released() counts the ticket and makes its stream "
     "wait for that work. tree is what open_shared() returned (or any of "
     "its SharedArray leaves), or the bytes it opened (for "
     "to='torch' trees). Once per open: closing the last array of an open "
     "returns its ticket from the host, if nothing did before. Bytes that "
     "carry no ticket are refused; a tree of them needs nothing."},
    {"stats", stats, METH_NOARGS,
     "stats()\n--\n\nWhat IPC has cost this process: driver exports, "
     "imports and queries, descriptors sent and received, round trips to "
     "other processes' brokers (usmipc_get_stats)."},
    {"reset_stats", reset_stats, METH_NOARGS,
     "reset_stats()\n--\n\nSets the counters of stats() to zero."},
    {"_bundle_from_bytes", bundle_from_bytes, METH_O, NULL},
    {NULL, NULL, 0, NULL},
};

int pyusmipc_init_bundle_types(PyObject *module, pyusmipc_module_state_t *st) {
  st->SharedBundleType = PyType_FromModuleAndSpec(module, &bundle_spec, NULL);
  st->SharedArrayType = PyType_FromModuleAndSpec(module, &arr_spec, NULL);
  if (st->SharedBundleType == NULL || st->SharedArrayType == NULL ||
      PyModule_AddObjectRef(module, "SharedBundle", st->SharedBundleType) < 0 ||
      PyModule_AddObjectRef(module, "SharedArray", st->SharedArrayType) < 0 ||
      PyModule_AddFunctions(module, bundle_functions) < 0)
    return -1;
  return 0;
}
