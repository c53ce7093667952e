/* Floor 6 of the extension: bundles from Python, the producer's side:
 * usmipc.share(tree) -> SharedBundle (to_bytes, pickle), over the C
 * library's bundles (src/bundle.c, docs/bundles.md). The consumer's side,
 * usmipc.open_shared(bytes) -> the same tree of SharedArray leaves, is
 * shared_array.c, one floor up. Calls interop.c, memory_core.c, queue.c,
 * device.c, torch_readers.c and util.c (module.c lists the floors). Its length
 * serves that one concern: reading every kind of leaf share() takes, and the
 * SharedBundle it returns.
 *
 * share() walks dicts (str keys), lists and tuples; a leaf is usmipc memory
 * (a 1-D uint8 array of its bytes), a torch tensor (data_ptr, shape,
 * stride, dtype read through torch's own C readers, torch_readers.c; no
 * DLPack round trip, which costs microseconds per tensor), an object with
 * __cuda_array_interface__ (CuPy, Numba) or with __dlpack__ (NumPy over usmipc
 * host memory, JAX, ...). The SharedBundle keeps every leaf alive: its memory
 * is promised to consumers as long as the bundle lives (freeing it makes its
 * bytes refused).
 *
 * Ordering follows IPCMemoryHandle: by default each to_bytes() records an
 * event on the producer's stream (stream=, or the current stream of the
 * first torch/CuPy leaf, or the memory's queue), and open_shared waits for
 * it on the host, or on stream= on the device.
 *
 * Release tickets follow IPCMemoryHandle(release=True) too: share(...,
 * release=True) puts one in every to_bytes() (and pickle); the consumer
 * returns it (shared_array.c), and the producer's
 * SharedBundle.wait_released(stream) waits for all of them. */
#include "bundle.h"
#include "torch_readers.h"

#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "device.h"
#include "dlpack.h"
#include "interop.h"
#include "memory_core.h"
#include "queue.h"
#include "util.h"

/* ---- dtypes -------------------------------------------------------------- */

typedef pyusmipc_dtype_t dtype_entry_t;

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

const dtype_entry_t *pyusmipc_dtype_by_code(uint8_t code, uint8_t bits) {
  for (size_t i = 0; i < NDTYPES; i++)
    if (DTYPES[i].code == code && DTYPES[i].bits == bits)
      return &DTYPES[i];
  return NULL;
}

/* ---- leaves of share() --------------------------------------------------- */

/* What share() learned about a leaf. */
typedef struct leaf_info {
  void *ptr;
  usmipc_array_desc_t desc;
  int64_t shape[USMIPC_BUNDLE_MAX_NDIM], strides[USMIPC_BUNDLE_MAX_NDIM];
  PyObject *keep;      /* a new reference the bundle keeps (the source, or the
                          owner of a DLPack tensor) */
  PyObject *stream_of; /* the leaf whose current stream orders the bundle
                          (torch, CuPy), or NULL; borrowed */
  pyusmipc_memory_object_t *mem; /* usmipc memory, borrowed, or NULL */
  int cpu; /* the array says it is CPU memory (DLPack, a storage), or
              LEAF_CPU_ASK: a torch tensor, asked only if refused */
} leaf_info_t;
#define LEAF_CPU_ASK (-1)

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
    pyusmipc_value_error("%s has %zd dimensions; at most %d travel", what, n,
                         USMIPC_BUNDLE_MAX_NDIM);
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
    pyusmipc_value_error("%s: %zd strides for %d dimensions", what, n, *ndim);
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

/* A CPU tensor or storage shares only over usmipc's own memory (a view
 * of host:cpu device memory, as torch.distributed's gloo ranks use):
 * torch's own CPU allocations, pinned or not, are private to the process.
 * 0 when ptr is memory usmipc owns (of any kind: the bundle refuses a kind
 * that cannot travel, and names it), else -1 with MemoryKindError naming
 * what (a "tensor", a "storage"). */
static int refuse_torch_cpu_memory(void *ptr, const char *what) {
  usmipc_pointer_info_t info;
  if (usmipc_pointer_query(ptr, &info) == 0 && !info.is_foreign)
    return 0;
  pyusmipc_kind_error("a CPU %s of torch's own memory: only device memory "
                      "can be shared (move it to the GPU, or make it a view "
                      "of usmipc memory: torch.from_dlpack("
                      "MemoryUSMDevice(n, device='host:cpu')))",
                      what);
  return -1;
}

/* The dtype object found last and its entry: a model's tensors share one
 * or two dtypes, and comparing a pointer costs less than a dict lookup.
 * The object is held, so its address is not another's later. */
static PyObject *last_dtype;
static const dtype_entry_t *last_dtype_entry;

/* The dtype a torch dtype object travels as; NULL with TypeError when none
 * does. */
const pyusmipc_dtype_t *pyusmipc_dtype_of_torch(PyObject *dtype) {
  if (dtype == last_dtype)
    return last_dtype_entry;
  if (torch_dtypes == NULL && (torch_dtypes = PyDict_New()) == NULL)
    return NULL;
  /* Held: a lookup may run code (a key's __eq__) that releases it. */
  Py_INCREF(dtype);
  PyObject *idx = PyDict_GetItemWithError(torch_dtypes, dtype);
  if (idx == NULL) {
    if (PyErr_Occurred()) {
      Py_DECREF(dtype);
      return NULL;
    }
    PyObject *name = PyObject_Str(dtype);
    long found = -1;
    for (size_t i = 0; name != NULL && i < NDTYPES; i++)
      if (PyUnicode_CompareWithASCIIString(name, DTYPES[i].torch) == 0)
        found = (long)i;
    if (name == NULL) {
      Py_DECREF(dtype);
      return NULL;
    }
    if (found < 0) {
      pyusmipc_type_error("a tensor of dtype %U cannot travel in a bundle",
                          name);
      Py_DECREF(name);
      Py_DECREF(dtype);
      return NULL;
    }
    Py_DECREF(name);
    PyObject *v = PyLong_FromLong(found);
    if (v == NULL || PyDict_SetItem(torch_dtypes, dtype, v) < 0) {
      Py_XDECREF(v);
      Py_DECREF(dtype);
      return NULL;
    }
    Py_DECREF(v);
    idx = PyDict_GetItemWithError(torch_dtypes, dtype);
  }
  /* Read before dtype goes: releasing it may run a __del__. */
  long at = idx != NULL ? PyLong_AsLong(idx) : -1;
  if (at < 0 || at >= (long)NDTYPES) {
    Py_DECREF(dtype);
    if (!PyErr_Occurred())
      pyusmipc_type_error("the tensor's dtype changed while it was read");
    return NULL;
  }
  PyObject *old = last_dtype; /* the reference taken above moves here */
  last_dtype = dtype;
  last_dtype_entry = &DTYPES[at];
  Py_XDECREF(old);
  return &DTYPES[at];
}

/* is_cpu is not read here: a CPU tensor's memory is refused by the bundle
 * itself unless it is usmipc's (no segment holds it), and only then does
 * add_leaf ask is_cpu, to say it in torch's terms. One call into torch a
 * tensor fewer (and, for a CPU tensor over usmipc host memory, no second
 * registry look): share() is paid per tensor beside torch's own reads.
 * The rest are read through torch's own C readers (torch_readers.c). */
static int leaf_torch(PyObject *obj, leaf_info_t *L) {
  PyObject *dtype = pyusmipc_torch_read(obj, PYUSMIPC_T_DTYPE);
  if (dtype == NULL)
    return -1;
  const dtype_entry_t *dt = pyusmipc_dtype_of_torch(dtype);
  Py_DECREF(dtype);
  if (dt == NULL)
    return -1;
  L->desc.dtype_code = dt->code;
  L->desc.dtype_bits = dt->bits;
  L->desc.dtype_lanes = 1;
  PyObject *shape = pyusmipc_torch_read(obj, PYUSMIPC_T_SHAPE);
  PyObject *stride = shape ? pyusmipc_torch_read(obj, PYUSMIPC_T_STRIDE) : NULL;
  PyObject *ptr = stride ? pyusmipc_torch_read(obj, PYUSMIPC_T_DATA_PTR) : NULL;
  int nd = -1, rc = -1;
  if (ptr != NULL && fill_int_tuple(shape, L->shape, &nd, "the tensor") == 0 &&
      fill_int_tuple(stride, L->strides, &nd, "the tensor") == 0) {
    L->ptr = PyLong_AsVoidPtr(ptr);
    rc = PyErr_Occurred() ? -1 : 0;
  }
  Py_XDECREF(shape);
  Py_XDECREF(stride);
  Py_XDECREF(ptr);
  L->desc.ndim = nd;
  L->stream_of = obj;
  L->cpu = LEAF_CPU_ASK;
  return rc;
}

/* A torch tensor whose memory the bundle refused: if it is a CPU tensor
 * of memory usmipc does not own, the refusal in torch's terms (-1); 0
 * otherwise, and the bundle's own error stands. */
static int torch_cpu_refusal(PyObject *tensor, void *ptr) {
  int cpu = pyusmipc_torch_true(tensor, PYUSMIPC_T_IS_CPU);
  return cpu <= 0 ? cpu : refuse_torch_cpu_memory(ptr, "tensor");
}

/* A torch storage (UntypedStorage; usmipc.torch sends whole storages): a
 * 1-D uint8 array of its bytes, read through data_ptr(), nbytes() and
 * is_cuda, and refused as a CPU tensor is when it is torch's own memory. */
static int leaf_torch_storage(PyObject *obj, leaf_info_t *L, int dest) {
  int cuda = pyusmipc_torch_true(obj, PYUSMIPC_S_IS_CUDA);
  if (cuda < 0)
    return -1;
  PyObject *n = pyusmipc_torch_read(obj, PYUSMIPC_S_NBYTES);
  PyObject *ptr = n ? pyusmipc_torch_read(obj, PYUSMIPC_S_DATA_PTR) : NULL;
  int rc = -1;
  if (ptr != NULL) {
    L->shape[0] = PyLong_AsLongLong(n);
    L->ptr = PyLong_AsVoidPtr(ptr);
    rc = PyErr_Occurred() || L->shape[0] < 0 ? -1 : 0;
    if (rc < 0 && !PyErr_Occurred())
      pyusmipc_value_error("the storage has a negative size");
  }
  Py_XDECREF(n);
  Py_XDECREF(ptr);
  L->desc = (usmipc_array_desc_t){1, 8, 1, 1, L->shape, L->strides};
  L->strides[0] = 1;
  if (rc == 0 && !cuda && L->shape[0] != 0 && !dest)
    rc = refuse_torch_cpu_memory(L->ptr, "storage");
  L->stream_of = obj;
  L->cpu = !cuda;
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
    pyusmipc_type_error(
        "__cuda_array_interface__ lacks data, shape or typestr");
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
      pyusmipc_dtype_by_code(t.dtype.code, t.dtype.bits) == NULL) {
    Py_DECREF(owner);
    pyusmipc_type_error(
        "a DLPack tensor of dtype (code %u, %u bits, %u lanes) or %d "
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
  L->cpu = t.device.device_type == kDLCPU;
  return 0;
}

/* How a leaf's type is read, found once per type: asking an object for an
 * attribute it lacks raises (and clears) an AttributeError, which costs
 * more than the rest of a leaf. */
enum { LEAF_TORCH = 1, LEAF_CAI = 2, LEAF_DLPACK = 3, LEAF_TORCH_STORAGE = 4 };
static PyObject *leaf_kinds; /* type -> kind */

/* The type found last and its kind: a tree's leaves are of one type as a
 * rule. The type is held, so its address is not another's later. */
static PyObject *last_leaf_type;
static int last_leaf_kind;

static int leaf_kind(PyObject *obj) {
  if ((PyObject *)Py_TYPE(obj) == last_leaf_type)
    return last_leaf_kind;
  if (leaf_kinds == NULL && (leaf_kinds = PyDict_New()) == NULL)
    return -1;
  PyObject *k = PyDict_GetItemWithError(leaf_kinds, (PyObject *)Py_TYPE(obj));
  if (k != NULL) {
    int kind = (int)PyLong_AsLong(k);
    PyObject *old = last_leaf_type;
    last_leaf_type = Py_NewRef((PyObject *)Py_TYPE(obj));
    last_leaf_kind = kind;
    Py_XDECREF(old);
    return kind;
  }
  if (PyErr_Occurred())
    return -1;
  /* The type is held: the attribute reads below run the caller's code,
   * which may give obj another class and collect this one. */
  PyObject *type = Py_NewRef((PyObject *)Py_TYPE(obj));
  int kind;
  /* Any tensor, of a subclass defined anywhere (a framework's parameter
   * class), is read as torch's; a type of a "torch" module that is none
   * (a storage) is told by its methods. */
  int tensor = pyusmipc_torch_is_tensor(obj);
  if (tensor < 0) {
    Py_DECREF(type);
    return -1;
  }
  if (tensor)
    kind = LEAF_TORCH;
  else if (pyusmipc_type_module_is(obj, "torch") &&
           PyObject_HasAttrString(obj, "data_ptr"))
    kind =
        PyObject_HasAttrString(obj, "stride") ? LEAF_TORCH : LEAF_TORCH_STORAGE;
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
static int leaf_read(pyusmipc_module_state_t *st, PyObject *obj, leaf_info_t *L,
                     int dest) {
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
  } else if (kind == LEAF_TORCH_STORAGE) {
    if (leaf_torch_storage(obj, L, dest) < 0)
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
        PyObject *tn = pyusmipc_type_name(obj);
        if (tn != NULL)
          pyusmipc_type_error(
              "%s %U is not an array: a leaf must be usmipc memory "
              "or have __cuda_array_interface__ or __dlpack__ "
              "(dicts, lists and tuples hold the leaves)",
              pyusmipc_article(tn), tn);
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

int pyusmipc_array_read(pyusmipc_module_state_t *st, PyObject *obj,
                        pyusmipc_array_t *out) {
  leaf_info_t L;
  if (leaf_read(st, obj, &L, 1) < 0)
    return -1;
  out->ptr = L.ptr;
  out->desc = L.desc;
  memcpy(out->shape, L.shape, sizeof(out->shape));
  memcpy(out->strides, L.strides, sizeof(out->strides));
  out->desc.shape = out->shape;
  out->desc.strides = out->strides;
  out->keep = L.keep;
  return 0;
}

/* ---- SharedBundle -------------------------------------------------------- */

typedef pyusmipc_bundle_object_t Bundle;

typedef struct walk {
  pyusmipc_module_state_t *st;
  usmipc_bundle_t *b;
  PyObject *keep;
  PyObject *stream_of;           /* first torch/CuPy leaf */
  pyusmipc_memory_object_t *mem; /* first usmipc memory leaf */
  void *first_ptr;               /* first leaf with memory */
  PyObject *path;                /* list of keys/indices, for messages */
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

/* Adds leaf L (read) to the bundle under key; the bundle keeps L->keep,
 * whose reference moves to it. 0, or -1 with an exception. */
static int add_leaf(walk_t *w, const char *key, Py_ssize_t key_len,
                    leaf_info_t *L) {
  int rc = PyList_Append(w->keep, L->keep);
  Py_DECREF(L->keep);
  L->keep = NULL;
  if (rc < 0)
    return -1;
  /* With the GIL held: a few loads for usmipc's memory, one driver query
   * for another library's; releasing and taking the GIL per leaf cost
   * more. (The first export of an allocation may wait longer: rare.) */
  rc = usmipc_bundle_add_array(w->b, key, (size_t)key_len, L->ptr, &L->desc);
  if (rc != 0 && L->cpu == LEAF_CPU_ASK) {
    /* The bundle's error, raised first (the question runs torch's code and
     * may make usmipc calls), stands unless the tensor is a CPU tensor of
     * torch's own memory, which is said in those terms. */
    bundle_fail(w, rc);
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    if (torch_cpu_refusal(L->stream_of, L->ptr) < 0) {
      Py_XDECREF(type);
      Py_XDECREF(value);
      Py_XDECREF(tb);
    } else {
      PyErr_Restore(type, value, tb);
    }
    return -1;
  }
  if (rc == USMIPC_EUNKNOWNPTR && L->cpu == 1) {
    /* Ordinary process memory (a NumPy array of its own): say what to
     * do, as for a torch CPU tensor. */
    pyusmipc_kind_error("an array in ordinary CPU memory (a NumPy array of "
                        "its own, say), which is private to this process: "
                        "only shareable memory can be shared; copy it into "
                        "some with usmipc.memory.host_array(array), or "
                        "allocate it there (np.from_dlpack(MemoryUSMDevice("
                        "n, device='host:cpu')))");
    return -1;
  }
  if (rc != 0)
    return bundle_fail(w, rc);
  int has_memory = 1;
  for (int i = 0; i < L->desc.ndim; i++)
    has_memory &= L->shape[i] != 0;
  if (has_memory && w->first_ptr == NULL) {
    w->first_ptr = L->ptr;
    w->stream_of = L->stream_of;
    w->mem = L->mem;
  }
  return 0;
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
    /* A dict's keys and values as two lists (no code runs between the
     * two copies): no (key, value) tuple per leaf, which the cyclic GC
     * would then have to visit. */
    PyObject *keys = kind == USMIPC_BUNDLE_DICT ? PyDict_Keys(obj) : NULL;
    PyObject *items = kind == USMIPC_BUNDLE_DICT ? PyDict_Values(obj)
                      : kind == USMIPC_BUNDLE_LIST
                          ? PyList_GetSlice(obj, 0, PY_SSIZE_T_MAX)
                          : Py_NewRef(obj);
    if (items == NULL || (kind == USMIPC_BUNDLE_DICT && keys == NULL)) {
      Py_XDECREF(keys);
      Py_XDECREF(items);
      return -1;
    }
    Py_ssize_t n =
        kind == USMIPC_BUNDLE_TUPLE ? PyTuple_Size(items) : PyList_Size(items);
    if (n > UINT32_MAX) {
      Py_XDECREF(keys);
      Py_DECREF(items);
      pyusmipc_value_error("a container too large for a bundle");
      return -1;
    }
    if ((rc = usmipc_bundle_add_container(w->b, kind, (uint32_t)n, key,
                                          (size_t)key_len)) != 0) {
      Py_XDECREF(keys);
      Py_DECREF(items);
      return bundle_fail(w, rc);
    }
    for (Py_ssize_t i = 0; i < n; i++) {
      if (kind == USMIPC_BUNDLE_DICT) {
        /* Borrowed from the copies, which hold them. */
        PyObject *k = PyList_GetItem(keys, i), *v = PyList_GetItem(items, i);
        if (!PyUnicode_Check(k)) {
          PyObject *tn = pyusmipc_type_name(k);
          if (tn != NULL)
            pyusmipc_type_error("dict keys must be str to travel in a bundle, "
                                "not %U",
                                tn);
          Py_XDECREF(tn);
          Py_XDECREF(keys);
          Py_DECREF(items);
          return -1;
        }
        /* The UTF-8 lives in k, which the copy keeps. */
        Py_ssize_t kl;
        const char *ks = PyUnicode_AsUTF8AndSize(k, &kl);
        if (ks == NULL) {
          key_not_utf8(w, k);
          Py_XDECREF(keys);
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
          Py_XDECREF(keys);
          Py_DECREF(items);
          return -1;
        }
        rc = walk_child(w, child, label, NULL, 0);
        Py_DECREF(label);
      }
      if (rc < 0) {
        Py_XDECREF(keys);
        Py_DECREF(items);
        return -1;
      }
    }
    Py_XDECREF(keys);
    Py_DECREF(items);
    w->depth--;
    return 0;
  }
  leaf_info_t L;
  if (leaf_read(w->st, obj, &L, 0) < 0 || add_leaf(w, key, key_len, &L) < 0)
    return -1;
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
  PyObject *text = where && msg
                       ? PyUnicode_FromFormat(
                             "share(): at %U%s: %U", where,
                             PyUnicode_GetLength(where) ? "" : "the root", msg)
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

/* A SharedBundle being made (share_end finishes it), with its walk's
 * state in *w; NULL with an exception. */
static Bundle *share_start(pyusmipc_module_state_t *st, int release,
                           walk_t *w) {
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
  *w = (walk_t){.st = st, .keep = self->keep};
  int rc;
  if (self->keep == NULL || (w->path = PyList_New(0)) == NULL) {
    Py_DECREF(self);
    return NULL;
  }
  if ((rc = usmipc_bundle_create(&self->bundle)) != 0) {
    pyusmipc_raise(st, rc);
    Py_DECREF(w->path);
    Py_DECREF(self);
    return NULL;
  }
  w->b = self->bundle;
  return self;
}

/* Finishes the bundle whose leaves w added and picks the queue its
 * handoffs are ordered on; consumes self and w's path. */
static PyObject *share_end(Bundle *self, walk_t *w, PyObject *stream,
                           int ordered) {
  pyusmipc_module_state_t *st = w->st;
  int rc;
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
  if (w->first_ptr != NULL) {
    /* The bundle knows its memory's device: asking the driver again about
     * another library's pointer would be a second query of an allocation
     * (issue 23: one per allocation per share). */
    usmipc_device_t *dev = usmipc_bundle_device(self->bundle);
    if (dev == NULL) {
      pyusmipc_raise_msg(st, USMIPC_EINVAL,
                         "share(): the bundle names no allocation although "
                         "an array has memory");
      goto fail;
    }
    if ((self->device = pyusmipc_device_object(st, dev)) == NULL)
      goto fail;
    self->queue = order_queue(st, w, stream, ordered, self->device);
    if (self->queue == NULL && PyErr_Occurred())
      goto fail;
  } /* else nothing to order: no leaf has memory. */
  Py_DECREF(w->path);
  return (PyObject *)self;
fail:
  Py_DECREF(w->path);
  Py_DECREF(self);
  return NULL;
}

PyObject *pyusmipc_share(PyObject *module, PyObject *const *args,
                         Py_ssize_t nargs, PyObject *kwnames) {
  static const char *const names[] = {"obj", "stream", "ordered", "release"};
  PyObject *a[4];
  if (pyusmipc_parse_fastcall("share", args, nargs, kwnames, names, 4, 1, a) <
      0)
    return NULL;
  if (a[0] == NULL) {
    pyusmipc_type_error("share() missing argument 'obj'");
    return NULL;
  }
  int ordered = -1, release = 0;
  if (a[2] != NULL && a[2] != Py_None && (ordered = PyObject_IsTrue(a[2])) < 0)
    return NULL;
  if (a[3] != NULL && (release = PyObject_IsTrue(a[3])) < 0)
    return NULL;
  if (ordered == 0 && a[1] != NULL && a[1] != Py_None) {
    pyusmipc_value_error(
        "share(): stream= is what the handoff is ordered on, so "
        "it cannot go with ordered=False");
    return NULL;
  }
  PyObject *stream = a[1] == Py_None ? NULL : a[1];
  walk_t w;
  Bundle *self = share_start(PyModule_GetState(module), release, &w);
  if (self == NULL)
    return NULL;
  if (walk(&w, a[0], NULL, 0) < 0) {
    prefix_path(w.path);
    Py_DECREF(w.path);
    Py_DECREF(self);
    return NULL;
  }
  return share_end(self, &w, stream, ordered);
}

PyObject *pyusmipc_share_read(pyusmipc_module_state_t *st, Py_ssize_t n,
                              pyusmipc_leaf_source_t next, void *ctx,
                              PyObject *stream) {
  if (n > UINT32_MAX) {
    pyusmipc_value_error("a container too large for a bundle");
    return NULL;
  }
  walk_t w;
  Bundle *self = share_start(st, 1, &w);
  if (self == NULL)
    return NULL;
  int rc = usmipc_bundle_add_container(w.b, USMIPC_BUNDLE_LIST, (uint32_t)n,
                                       NULL, 0);
  if (rc != 0) {
    bundle_fail(&w, rc);
    goto fail;
  }
  for (Py_ssize_t i = 0; i < n; i++) {
    pyusmipc_array_t a;
    if (next(ctx, i, &a) < 0)
      goto fail;
    leaf_info_t L = {.ptr = a.ptr, .desc = a.desc, .keep = a.keep};
    memcpy(L.shape, a.shape, sizeof(L.shape[0]) * (size_t)a.desc.ndim);
    memcpy(L.strides, a.strides, sizeof(L.strides[0]) * (size_t)a.desc.ndim);
    L.desc.shape = L.shape;
    L.desc.strides = L.strides;
    L.stream_of = a.keep; /* held by the bundle once added */
    if (add_leaf(&w, NULL, 0, &L) < 0)
      goto fail;
  }
  return share_end(self, &w, stream, -1);
fail:
  Py_DECREF(w.path);
  Py_DECREF(self);
  return NULL;
}

/* The next handoff's bytes, for `consumers` processes (a fan-out of one
 * ticket when more than one). */
static PyObject *to_bytes_for(PyObject *op, unsigned consumers) {
  Bundle *self = (Bundle *)op;
  if (consumers != 1 && !self->release) {
    pyusmipc_value_error("to_bytes(consumers=%u): a fan-out counts each "
                         "consumer's release ticket, and this bundle hands "
                         "out none; share it with release=True",
                         consumers);
    return NULL;
  }
  if (self->bundle == NULL) {
    if (consumers != 1) {
      pyusmipc_value_error("to_bytes(consumers=%u): this SharedBundle was "
                           "made from bytes; only the producer's own (from "
                           "share()) hands out release tickets",
                           consumers);
      return NULL;
    }
    return Py_NewRef(self->bytes);
  }
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
  rc = consumers > 1 ? usmipc_bundle_order_fanout(b, q, consumers)
                     : usmipc_bundle_order_ex(b, q, flags);
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

PyObject *pyusmipc_bundle_to_bytes(PyObject *op, PyObject *Py_UNUSED(ignored)) {
  return to_bytes_for(op, 1);
}

/* to_bytes(consumers=1) */
static PyObject *bundle_to_bytes_method(PyObject *op, PyObject *const *args,
                                        Py_ssize_t nargs, PyObject *kwnames) {
  static const char *const names[] = {"consumers"};
  PyObject *c = NULL;
  if (pyusmipc_parse_fastcall("to_bytes", args, nargs, kwnames, names, 1, 1,
                              &c) < 0)
    return NULL;
  unsigned long n = 1;
  if (c != NULL) {
    if (!PyLong_Check(c)) {
      pyusmipc_type_error("to_bytes(): consumers must be an int");
      return NULL;
    }
    n = PyLong_AsUnsignedLong(c);
    if (n == (unsigned long)-1 && PyErr_Occurred()) {
      PyErr_Clear();
      n = 0;
    }
    if (n < 1 || n > 4096) {
      pyusmipc_value_error("to_bytes(): consumers is 1 to 4096 (the "
                           "processes this handoff goes to)");
      return NULL;
    }
  }
  return to_bytes_for(op, (unsigned)n);
}

PyObject *pyusmipc_bundle_from_bytes(PyObject *module, PyObject *arg) {
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
  PyObject *bytes = pyusmipc_bundle_to_bytes(op, NULL);
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

static PyObject *bundle_get_release_key(PyObject *op, void *c) {
  (void)c;
  Bundle *self = (Bundle *)op;
  return PyLong_FromUnsignedLongLong(
      self->bundle != NULL ? usmipc_bundle_release_key(self->bundle) : 0);
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
    if ((queue_obj = pyusmipc_queue_from_stream(
             st, stream, NULL, self->device, "SharedBundle.wait_released()")) ==
        NULL)
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
  return PyUnicode_FromFormat(
      "<usmipc.SharedBundle of %zd array%s in %zd allocation%s%s>",
      self->arrays, self->arrays == 1 ? "" : "s", self->allocations,
      self->allocations == 1 ? "" : "s", self->bundle ? "" : " (bytes)");
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
  PYUSMIPC_DESTROY_WITHOUT_GIL(usmipc_bundle_t, self->bundle,
                               usmipc_bundle_free);
  bundle_clear(op);
  Py_CLEAR(self->keep);
  if (self->lock_ready)
    pthread_mutex_destroy(&self->order_lock);
  PyObject_GC_Del(op);
  Py_DECREF(tp);
}

static PyMethodDef bundle_methods[] = {
    {"to_bytes", PYUSMIPC_CMETHOD(bundle_to_bytes_method),
     METH_FASTCALL | METH_KEYWORDS,
     "to_bytes(consumers=1)\n--\n\nThe bundle's bytes, to send to another "
     "process (usmipc.open_shared opens them). Ordered bundles record a "
     "fresh event on the producer's stream at every call (none when it is "
     "idle). consumers=N "
     "(release=True bundles): the same bytes go to N processes (a "
     "broadcast to tensor-parallel ranks); each returns the ticket once and "
     "wait_released() waits for all N."},
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
    {"arrays", bundle_get_arrays, NULL, "The number of arrays (leaves).", NULL},
    {"allocations", bundle_get_allocations, NULL,
     "The number of allocations the arrays live in, each exported once.", NULL},
    {"ordered", bundle_get_ordered, NULL,
     "Whether each to_bytes() orders the handoff after the producer's work.",
     NULL},
    {"releases", bundle_get_releases, NULL,
     "(sent, returned): release tickets handed out (one per to_bytes() or "
     "pickle of\na bundle shared with release=True) and returned by "
     "consumers so far.",
     NULL},
    {"_release_key", bundle_get_release_key, NULL,
     "The key usmipc._releases_wait() names this bundle by (0 before its "
     "first\nticket).",
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

int pyusmipc_init_bundle_type(PyObject *module, pyusmipc_module_state_t *st) {
  st->SharedBundleType = PyType_FromModuleAndSpec(module, &bundle_spec, NULL);
  if (st->SharedBundleType == NULL ||
      PyModule_AddObjectRef(module, "SharedBundle", st->SharedBundleType) < 0)
    return -1;
  return 0;
}
