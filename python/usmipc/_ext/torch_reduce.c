/* Floor 8 of the extension usmipc._usmipc (torch_reduce.c): usmipc.torch's
 * per-tensor step in C. ForkingPickler.dumps of a message of many tensors
 * (a state dict) reduces each tensor once; in Python that took about 2 us a
 * tensor of reading, grouping and tuple making beside the 0.7 us of reading
 * the tensor's attributes alone (2-vCPU VM), a third of the sender's whole
 * time for a warm 338-tensor state dict (issue 24). python/usmipc/torch.py
 * keeps every rule; this file only runs its common case:
 *
 *   _TorchMessage(put_event): what one dumps collects (torch.py's _Message
 *       before): .groups (list of torch.py's _Group and _Forward), .group_of
 *       (device index -> group index: a CUDA device's index, -1 the host),
 *       .forward_of (bundle bytes -> group index), .put_event; .add(storage,
 *       nbytes, tensor=None) -> (group, index), as torch.py's paths call it.
 *   _torch_setup(config): torch.py's objects this file calls or compares
 *       with (install() passes them; one process, one set).
 *   _torch_push(message or None), _torch_pop(): the message a dumps on this
 *       thread collects into (None: none, torch's own reductions run).
 *   _torch_reduce_tensor(tensor): what the merged pickler of torch.py's
 *       _plain_dumps calls for a tensor: the reduction of the message's
 *       common case (a routed strided tensor of some bytes, no forwarding,
 *       no refusal, no hooks), else torch.py's _reduce_tensor, which says
 *       every other case.
 *
 * What the step reads of each storage (its pointer and bytes, and the
 * dtype and shape of a tensor that covers it whole) is recorded beside the
 * group, and .share(g, stream) makes the group's bundle from the records
 * (bundle.c's pyusmipc_share_read) instead of share() reading every
 * tensor again.
 *
 * Calls bundle.c, torch_readers.c and util.c, and the library's public
 * usmipc_pointer_query(). */
#include "torch_reduce.h"
#include "torch_readers.h"

#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <structmember.h>

#include "bundle.h"
#include "util.h"

/* torch.py's objects (_torch_setup): strong references, for the life of
 * the process. install() may run again after uninstall(): the new set
 * replaces the old. */
static struct {
  PyObject *group_type;  /* _Group(device) */
  PyObject *forward_add; /* _forward_add(message, storage, origin) */
  PyObject *origin;      /* _origin(storage) */
  PyObject *received;    /* dict: what this process received */
  PyObject *counts;      /* dict: stats() counters */
  PyObject *rebuild;     /* _rebuild_tensor */
  PyObject *fallback;    /* _reduce_tensor */
  PyObject *strided;     /* torch.strided */
  PyObject *leaf_dtypes; /* frozenset: dtypes a whole tensor travels as */
  /* The one-tensor message (_torch_lone): */
  PyObject *tensor;       /* torch.Tensor */
  PyObject *raw_stream;   /* torch._C._cuda_getCurrentRawStream, or None */
  PyObject *order_stream; /* _order_stream(index, put_event) */
  PyObject *cuda_names;   /* dict: index -> "cuda:<uuid>" */
  PyObject *cuda_name;    /* _cuda_name(index), which fills it */
  PyObject *dtype_names;  /* dict: torch dtype -> its name in torch */
  PyObject *keep;         /* usmipc.memory._keep(bundle) */
  PyObject *refusal;      /* _refusal(exception) */
} cfg;

/* Attribute names, made once (a lookup by C string makes a str each
 * time); a tensor's and a storage's own readers are torch_readers.c's. */
static PyObject *n_device, *n_index, *n_views, *n_index_of, *k_cuda_tensors,
    *k_host_tensors, *k_routed_tensors, *k_bundles, *k_messages;

static int make_names(void) {
  if (k_messages != NULL) /* made: the last one is */
    return 0;
  static const pyusmipc_named_t names[] = {
      {&n_device, "device"},
      {&n_index, "index"},
      {&n_views, "views"},
      {&n_index_of, "index_of"},
      {&k_cuda_tensors, "cuda_tensors"},
      {&k_host_tensors, "host_tensors"},
      {&k_routed_tensors, "routed_tensors"},
      {&k_bundles, "bundles"},
      {&k_messages, "messages"}};
  return pyusmipc_intern_names(names, sizeof(names) / sizeof(names[0]));
}

/* ---- _TorchMessage --------------------------------------------------------
 */

/* What the message read of one storage of a group, for its bundle: the
 * pointer and bytes, and for a storage one tensor of the message covers
 * whole (torch.py's whole leaves), that tensor's dtype and shape, with
 * which it travels as itself. What the tensor was when it was pickled, as
 * torch's own reduction takes it. */
typedef struct leaf_rec {
  void *ptr;
  int64_t nbytes;
  const pyusmipc_dtype_t *dt; /* NULL: the storage's bytes (uint8) */
  size_t dims_at;             /* its shape: dims[dims_at .. + ndim] */
  int ndim;
} leaf_rec_t;

/* The records of one group, in the order of its views. */
typedef struct group_recs {
  leaf_rec_t *recs;
  size_t n, cap;
  int64_t *dims;
  size_t ndims, dims_cap;
} group_recs_t;

typedef struct torch_message {
  PyObject_HEAD PyObject *groups;
  PyObject *group_of;
  PyObject *forward_of;
  PyObject *put_event;
  /* The group of the last tensor (most messages have one device): its
   * device index and lists, strong references. */
  long last_index;
  Py_ssize_t taken; /* tensors the C step reduced (tests read it) */
  PyObject *last_g; /* int: its index in groups */
  PyObject *last_views, *last_index_of;
  Py_ssize_t last_gi; /* last_g's value */
  /* By group index (a _Forward's stays empty); nrecs entries. */
  group_recs_t *recs;
  Py_ssize_t nrecs;
} torch_message_t;

static PyObject *message_new(PyTypeObject *type, PyObject *args,
                             PyObject *kwargs) {
  PyObject *put_event = Py_None;
  static char *kw[] = {"put_event", NULL};
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "|O:_TorchMessage", kw,
                                   &put_event))
    return NULL;
  torch_message_t *m = (torch_message_t *)pyusmipc_object_alloc(type);
  if (m == NULL)
    return NULL;
  m->groups = PyList_New(0);
  m->group_of = PyDict_New();
  m->forward_of = PyDict_New();
  m->put_event = Py_NewRef(put_event);
  if (m->groups == NULL || m->group_of == NULL || m->forward_of == NULL) {
    Py_DECREF(m);
    return NULL;
  }
  return (PyObject *)m;
}

static int message_clear(PyObject *self) {
  torch_message_t *m = (torch_message_t *)self;
  Py_CLEAR(m->groups);
  Py_CLEAR(m->group_of);
  Py_CLEAR(m->forward_of);
  Py_CLEAR(m->put_event);
  Py_CLEAR(m->last_g);
  Py_CLEAR(m->last_views);
  Py_CLEAR(m->last_index_of);
  return 0;
}

static int message_traverse(PyObject *self, visitproc visit, void *arg) {
  torch_message_t *m = (torch_message_t *)self;
  Py_VISIT(Py_TYPE(self));
  Py_VISIT(m->groups);
  Py_VISIT(m->group_of);
  Py_VISIT(m->forward_of);
  Py_VISIT(m->put_event);
  Py_VISIT(m->last_g);
  Py_VISIT(m->last_views);
  Py_VISIT(m->last_index_of);
  return 0;
}

static void message_dealloc(PyObject *self) {
  PyObject_GC_UnTrack(self);
  message_clear(self);
  torch_message_t *m = (torch_message_t *)self;
  for (Py_ssize_t g = 0; g < m->nrecs; g++) {
    free(m->recs[g].recs);
    free(m->recs[g].dims);
  }
  free(m->recs);
  pyusmipc_object_free(self);
}

/* Grows an array of *cap elements of size to hold need; 0 or -1 with
 * MemoryError. */
static int grow(void **p, size_t *cap, size_t need, size_t size) {
  if (need <= *cap)
    return 0;
  size_t c = *cap ? *cap : 16;
  while (c < need)
    c *= 2;
  void *q = c <= SIZE_MAX / size ? realloc(*p, c * size) : NULL;
  if (q == NULL) {
    PyErr_NoMemory();
    return -1;
  }
  *p = q;
  *cap = c;
  return 0;
}

/* Records the storage (ptr, nbytes) as the next leaf of group gi; with a
 * whole tensor's dtype and size (else NULL): as that tensor. 0 or -1. */
static int record(torch_message_t *m, Py_ssize_t gi, void *ptr, int64_t nbytes,
                  PyObject *dtype, PyObject *size) {
  if (gi >= m->nrecs) {
    size_t cap = (size_t)m->nrecs;
    if (grow((void **)&m->recs, &cap, (size_t)gi + 1, sizeof(group_recs_t)) < 0)
      return -1;
    memset(m->recs + m->nrecs, 0,
           (cap - (size_t)m->nrecs) * sizeof(group_recs_t));
    m->nrecs = (Py_ssize_t)cap;
  }
  group_recs_t *r = &m->recs[gi];
  if (grow((void **)&r->recs, &r->cap, r->n + 1, sizeof(leaf_rec_t)) < 0)
    return -1;
  leaf_rec_t rec = {.ptr = ptr, .nbytes = nbytes};
  if (dtype != NULL && PyTuple_Check(size) &&
      PyTuple_Size(size) <= USMIPC_BUNDLE_MAX_NDIM) {
    int nd = (int)PyTuple_Size(size);
    if ((rec.dt = pyusmipc_dtype_of_torch(dtype)) == NULL ||
        grow((void **)&r->dims, &r->dims_cap, r->ndims + (size_t)nd,
             sizeof(int64_t)) < 0)
      return -1;
    for (int k = 0; k < nd; k++) {
      int64_t d = PyLong_AsLongLong(PyTuple_GetItem(size, k));
      if (d == -1 && PyErr_Occurred())
        return -1;
      r->dims[r->ndims + (size_t)k] = d;
    }
    rec.dims_at = r->ndims;
    rec.ndim = nd;
    r->ndims += (size_t)nd;
  } /* else a shape past what travels: the storage's bytes, rebuilt over */
  r->recs[r->n++] = rec;
  return 0;
}

/* Makes the group of device index the message's last one: found, or made
 * (_Group(device), device the storage's). 0, or -1 with an exception. */
static int select_group(torch_message_t *m, long index, PyObject *storage) {
  if (m->last_g != NULL && m->last_index == index)
    return 0;
  PyObject *key = PyLong_FromLong(index);
  if (key == NULL)
    return -1;
  PyObject *g = PyDict_GetItemWithError(m->group_of, key);
  Py_XINCREF(g);
  if (g == NULL) {
    if (PyErr_Occurred()) {
      Py_DECREF(key);
      return -1;
    }
    PyObject *device = PyObject_GetAttr(storage, n_device);
    PyObject *group =
        device ? PyObject_CallFunctionObjArgs(cfg.group_type, device, NULL)
               : NULL;
    Py_XDECREF(device);
    g = group ? PyLong_FromSsize_t(PyList_Size(m->groups)) : NULL;
    if (g == NULL || PyList_Append(m->groups, group) < 0 ||
        PyDict_SetItem(m->group_of, key, g) < 0) {
      Py_XDECREF(group);
      Py_XDECREF(g);
      Py_DECREF(key);
      return -1;
    }
    Py_DECREF(group);
  }
  Py_DECREF(key);
  /* Held while its attributes are read: reading one may run code (a
   * group's class is torch.py's) that changes the list. */
  PyObject *group = PyList_GetItem(m->groups, PyLong_AsSsize_t(g));
  Py_XINCREF(group);
  PyObject *views = group ? PyObject_GetAttr(group, n_views) : NULL;
  PyObject *index_of = views ? PyObject_GetAttr(group, n_index_of) : NULL;
  Py_XDECREF(group);
  if (index_of == NULL || !PyList_Check(views) || !PyDict_Check(index_of)) {
    if (index_of != NULL)
      PyErr_SetString(PyExc_TypeError, "usmipc.torch: a malformed group");
    Py_XDECREF(views);
    Py_XDECREF(index_of);
    Py_DECREF(g);
    return -1;
  }
  /* The fields first, then the old references dropped: a release may run
   * code, which must find the message whole. */
  PyObject *old[3] = {m->last_g, m->last_views, m->last_index_of};
  m->last_g = g;
  m->last_views = views;
  m->last_index_of = index_of;
  m->last_gi = PyLong_AsSsize_t(g);
  for (int k = 0; k < 3; k++)
    Py_XDECREF(old[k]);
  m->last_index = index;
  return 0;
}

/* (group, index) of the storage (nbytes, at data_ptr) on device index in
 * the message, added if new; tensor: the one tensor of the message over it
 * so far (Py_None: a second one, or the storage itself pickled), with its
 * dtype and size (a tuple) when not None. */
static PyObject *add_own(torch_message_t *m, PyObject *storage,
                         PyObject *nbytes, long index, PyObject *tensor,
                         PyObject *dtype, PyObject *size) {
  if (select_group(m, index, storage) < 0)
    return NULL;
  PyObject *ptr = pyusmipc_torch_read(storage, PYUSMIPC_S_DATA_PTR);
  if (ptr == NULL)
    return NULL;
  void *p = PyLong_AsVoidPtr(ptr);
  int64_t nb = PyLong_AsLongLong(nbytes);
  if (PyErr_Occurred()) {
    Py_DECREF(ptr);
    return NULL;
  }
  PyObject *key = PyTuple_Pack(2, ptr, nbytes);
  Py_DECREF(ptr);
  if (key == NULL)
    return NULL;
  /* Held: code a lookup or an append runs may select another group. */
  Py_ssize_t gi = m->last_gi;
  PyObject *g = Py_NewRef(m->last_g), *views = Py_NewRef(m->last_views),
           *index_of = Py_NewRef(m->last_index_of);
  PyObject *i = PyDict_GetItemWithError(index_of, key);
  Py_XINCREF(i);
  int rc = 0;
  if (i == NULL && !PyErr_Occurred()) {
    int whole = tensor != Py_None;
    i = PyLong_FromSsize_t(PyList_Size(views));
    rc = i == NULL || PyDict_SetItem(index_of, key, i) < 0 ||
                 record(m, gi, p, nb, whole ? dtype : NULL,
                        whole ? size : NULL) < 0 ||
                 PyList_Append(views, storage) < 0
             ? -1
             : 0;
  } else if (i != NULL) {
    Py_ssize_t at = PyLong_AsSsize_t(i);
    rc = PyErr_Occurred() ? -1 : 0;
    if (rc == 0 && gi < m->nrecs && at >= 0 && (size_t)at < m->recs[gi].n)
      m->recs[gi].recs[at].dt = NULL; /* two tensors: the bytes travel */
  }
  Py_DECREF(key);
  PyObject *at = i != NULL && rc == 0 ? PyTuple_Pack(2, g, i) : NULL;
  Py_XDECREF(i);
  Py_DECREF(g);
  Py_DECREF(views);
  Py_DECREF(index_of);
  return at;
}

/* A storage's device index: its CUDA index, -1 on the host. */
static int storage_index(PyObject *storage, long *index) {
  int is_cuda = pyusmipc_torch_true(storage, PYUSMIPC_S_IS_CUDA);
  if (is_cuda <= 0) {
    *index = -1;
    return is_cuda;
  }
  PyObject *device = PyObject_GetAttr(storage, n_device);
  PyObject *i = device ? PyObject_GetAttr(device, n_index) : NULL;
  Py_XDECREF(device);
  *index = i ? PyLong_AsLong(i) : -1;
  Py_XDECREF(i);
  return PyErr_Occurred() ? -1 : 0;
}

static int configured(void) {
  if (cfg.rebuild != NULL)
    return 0;
  PyErr_SetString(PyExc_RuntimeError,
                  "usmipc.torch: _torch_setup() was not called (install())");
  return -1;
}

/* add(storage, nbytes, tensor=None): torch.py's _Message.add. */
static PyObject *message_add(PyObject *self, PyObject *args) {
  torch_message_t *m = (torch_message_t *)self;
  PyObject *storage, *nbytes, *tensor = Py_None;
  if (!PyArg_ParseTuple(args, "OO|O:add", &storage, &nbytes, &tensor) ||
      configured() < 0 || make_names() < 0)
    return NULL;
  if (PyDict_Size(cfg.received) > 0) {
    /* Memory this process received is handed on, not exported. */
    PyObject *origin = PyObject_CallFunctionObjArgs(cfg.origin, storage, NULL);
    if (origin == NULL)
      return NULL;
    if (origin != Py_None) {
      PyObject *at = PyObject_CallFunctionObjArgs(cfg.forward_add, self,
                                                  storage, origin, NULL);
      Py_DECREF(origin);
      return at;
    }
    Py_DECREF(origin);
  }
  long index;
  if (storage_index(storage, &index) < 0)
    return NULL;
  if (tensor == Py_None)
    return add_own(m, storage, nbytes, index, tensor, NULL, NULL);
  /* torch.py's path found the tensor whole: its dtype and size recorded. */
  PyObject *dtype = pyusmipc_torch_read(tensor, PYUSMIPC_T_DTYPE);
  PyObject *size = dtype ? pyusmipc_torch_read(tensor, PYUSMIPC_T_SIZE) : NULL;
  PyObject *tsize = size ? PySequence_Tuple(size) : NULL;
  PyObject *at =
      tsize ? add_own(m, storage, nbytes, index, tensor, dtype, tsize) : NULL;
  Py_XDECREF(dtype);
  Py_XDECREF(size);
  Py_XDECREF(tsize);
  return at;
}

/* Leaf i of a group's bundle, from its record (pyusmipc_share_read). */
typedef struct share_ctx {
  const group_recs_t *r;
  PyObject *views;
} share_ctx_t;

/* *out as a leaf of nbytes at ptr: a C-contiguous array of dtype dt and
 * shape (ndim of them) when dt is not NULL (a tensor that covers its
 * storage whole), else a 1-D uint8 array of the bytes; its keep, a new
 * reference to keep. */
static void fill_leaf(pyusmipc_array_t *out, void *ptr, int64_t nbytes,
                      const pyusmipc_dtype_t *dt, int ndim,
                      const int64_t *shape, PyObject *keep) {
  out->ptr = ptr;
  if (dt != NULL) {
    out->desc = (usmipc_array_desc_t){.dtype_code = dt->code,
                                      .dtype_bits = dt->bits,
                                      .dtype_lanes = 1,
                                      .ndim = ndim};
    int64_t step = 1; /* the step found it contiguous */
    for (int k = ndim - 1; k >= 0; k--) {
      out->shape[k] = shape[k];
      out->strides[k] = step;
      step *= shape[k] > 1 ? shape[k] : 1;
    }
  } else {
    out->desc = (usmipc_array_desc_t){
        .dtype_code = 1, .dtype_bits = 8, .dtype_lanes = 1, .ndim = 1};
    out->shape[0] = nbytes;
    out->strides[0] = 1;
  }
  out->desc.shape = out->shape;
  out->desc.strides = out->strides;
  out->keep = Py_NewRef(keep);
}

static int leaf_of_record(void *ctx, Py_ssize_t i, pyusmipc_array_t *out) {
  share_ctx_t *c = ctx;
  const leaf_rec_t *rec = &c->r->recs[i];
  /* The storage keeps the memory the record points at. */
  PyObject *storage = PyList_GetItem(c->views, i);
  if (storage == NULL)
    return -1;
  fill_leaf(out, rec->ptr, rec->nbytes, rec->dt, rec->ndim,
            rec->dt != NULL ? c->r->dims + rec->dims_at : NULL, storage);
  return 0;
}

/* share(g, stream=None): the bundle of group g made from what the step
 * recorded (release tickets on): each storage's bytes, or the one tensor
 * over it where that tensor is whole (torch.py's whole leaves); None when
 * the records do not match the group's views (storages added other than
 * through the message: the caller shares the views' bytes). */
static PyObject *message_share(PyObject *self, PyObject *args) {
  torch_message_t *m = (torch_message_t *)self;
  Py_ssize_t g;
  PyObject *stream = Py_None;
  if (!PyArg_ParseTuple(args, "n|O:share", &g, &stream) || make_names() < 0)
    return NULL;
  if (g < 0 || g >= PyList_Size(m->groups))
    return pyusmipc_value_error("_TorchMessage.share: no group %zd", g);
  PyObject *group = Py_XNewRef(PyList_GetItem(m->groups, g));
  PyObject *views = group ? PyObject_GetAttr(group, n_views) : NULL;
  Py_XDECREF(group);
  if (views == NULL)
    return NULL;
  /* A copy: the bundle's leaves are what the records say, whatever code
   * the making runs does to the group's list. */
  PyObject *held =
      PyList_Check(views) ? PyList_GetSlice(views, 0, PY_SSIZE_T_MAX) : NULL;
  Py_DECREF(views);
  if (held == NULL) {
    if (!PyErr_Occurred())
      PyErr_SetString(PyExc_TypeError, "usmipc.torch: a malformed group");
    return NULL;
  }
  if (g >= m->nrecs || m->recs[g].n != (size_t)PyList_Size(held)) {
    Py_DECREF(held);
    Py_RETURN_NONE;
  }
  /* No Python code runs while the leaves are added (the records cannot
   * move under the callback); ordering on stream comes after them. */
  share_ctx_t ctx = {&m->recs[g], held};
  PyObject *bundle = pyusmipc_share_read(
      PyType_GetModuleState(Py_TYPE(self)), PyList_Size(held), leaf_of_record,
      &ctx, stream == Py_None ? NULL : stream);
  Py_DECREF(held);
  return bundle;
}

static PyMethodDef message_methods[] = {
    {"add", message_add, METH_VARARGS,
     "add(storage, nbytes, tensor=None) -> (group, index): the storage's "
     "place in the message, added if new."},
    {"share", message_share, METH_VARARGS,
     "share(g, stream=None) -> SharedBundle of group g from what the message "
     "recorded of its storages (release tickets on), or None if the records "
     "do not match the group's views."},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef message_members[] = {
    {"groups", T_OBJECT_EX, offsetof(torch_message_t, groups), READONLY, NULL},
    {"group_of", T_OBJECT_EX, offsetof(torch_message_t, group_of), READONLY,
     NULL},
    {"forward_of", T_OBJECT_EX, offsetof(torch_message_t, forward_of), READONLY,
     NULL},
    {"put_event", T_OBJECT_EX, offsetof(torch_message_t, put_event), READONLY,
     NULL},
    {"taken", T_PYSSIZET, offsetof(torch_message_t, taken), READONLY,
     "How many tensors the C step reduced (the rest: usmipc.torch's "
     "_reduce_tensor)."},
    {NULL, 0, 0, 0, NULL},
};

static PyType_Slot message_slots[] = {
    {Py_tp_doc, (void *)"What one ForkingPickler.dumps of usmipc.torch "
                        "collects: the routed storages, grouped by device, "
                        "and the received ones, by the bundle they came in."},
    {Py_tp_new, message_new},
    {Py_tp_dealloc, message_dealloc},
    {Py_tp_traverse, message_traverse},
    {Py_tp_clear, message_clear},
    {Py_tp_methods, message_methods},
    {Py_tp_members, message_members},
    {0, NULL},
};

static PyType_Spec message_spec = {
    .name = "usmipc._TorchMessage",
    .basicsize = sizeof(torch_message_t),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = message_slots,
};

static PyObject *message_type;

int pyusmipc_init_torch_message_type(PyObject *module) {
  message_type = PyType_FromModuleAndSpec(module, &message_spec, NULL);
  if (message_type == NULL)
    return -1;
  return PyModule_AddObjectRef(module, "_TorchMessage", message_type);
}

/* ---- the current message, per thread --------------------------------------
 * A stack: a reducer may pickle (dumps inside dumps). Deeper than it holds,
 * the messages are torch.py's alone (the C step declines). */

#define STACK_MAX 8
static _Thread_local PyObject *stack[STACK_MAX]; /* borrowed: torch.py's
                                                    _tls.messages holds them */
static _Thread_local int depth;

PyObject *pyusmipc_torch_push(PyObject *module, PyObject *msg) {
  (void)module;
  if (msg != Py_None && !PyObject_TypeCheck(msg, (PyTypeObject *)message_type))
    return pyusmipc_type_error("_torch_push: a _TorchMessage or None");
  if (depth < STACK_MAX)
    stack[depth] = msg == Py_None ? NULL : msg;
  depth++;
  Py_RETURN_NONE;
}

PyObject *pyusmipc_torch_pop(PyObject *module, PyObject *Py_UNUSED(ignored)) {
  (void)module;
  if (depth > 0)
    depth--;
  if (depth < STACK_MAX)
    stack[depth] = NULL;
  Py_RETURN_NONE;
}

PyObject *pyusmipc_torch_setup(PyObject *module, PyObject *config) {
  (void)module;
  static const pyusmipc_named_t keys[] = {
      {&cfg.group_type, "Group"},        {&cfg.forward_add, "forward_add"},
      {&cfg.origin, "origin"},           {&cfg.received, "received"},
      {&cfg.counts, "counts"},           {&cfg.rebuild, "rebuild"},
      {&cfg.fallback, "fallback"},       {&cfg.strided, "strided"},
      {&cfg.leaf_dtypes, "leaf_dtypes"}, {&cfg.tensor, "Tensor"},
      {&cfg.raw_stream, "raw_stream"},   {&cfg.order_stream, "order_stream"},
      {&cfg.cuda_names, "cuda_names"},   {&cfg.cuda_name, "cuda_name"},
      {&cfg.dtype_names, "dtype_names"}, {&cfg.keep, "keep"},
      {&cfg.refusal, "refusal"}};
  const char *what = "_torch_setup";
  if (!PyDict_Check(config))
    return pyusmipc_type_error("%s: a dict", what);
  /* Checked before anything is taken (str keys: no code runs). */
  const char *dicts[] = {"received", "counts", "cuda_names", "dtype_names"};
  for (size_t i = 0; i < sizeof(dicts) / sizeof(dicts[0]); i++) {
    PyObject *v = PyDict_GetItemString(config, dicts[i]);
    if (v != NULL && !PyDict_Check(v))
      return pyusmipc_type_error("%s: received, counts, cuda_names and "
                                 "dtype_names are dicts, leaf_dtypes a set",
                                 what);
  }
  PyObject *set = PyDict_GetItemString(config, "leaf_dtypes");
  if (set != NULL && !PyAnySet_Check(set))
    return pyusmipc_type_error("%s: received, counts, cuda_names and "
                               "dtype_names are dicts, leaf_dtypes a set",
                               what);
  /* Counts made under the dict being replaced go to it, not the new. */
  if (pyusmipc_torch_reduce_fold_counts() < 0 || make_names() < 0 ||
      pyusmipc_take_config(config, keys, sizeof(keys) / sizeof(keys[0]), what) <
          0)
    return NULL;
  Py_RETURN_NONE;
}

/* ---- the per-tensor step --------------------------------------------------
 */

/* stats() counters, counted here and added to the counts dict when
 * usmipc.torch reads it (pyusmipc_torch_reduce_fold_counts): a dict update
 * per count was a twentieth of a tensor's cost in dumps. */
enum {
  C_CUDA_TENSORS,
  C_HOST_TENSORS,
  C_ROUTED_TENSORS,
  C_BUNDLES,
  C_MESSAGES
};
static Py_ssize_t pending[5];
static PyObject **const pending_key[5] = {&k_cuda_tensors, &k_host_tensors,
                                          &k_routed_tensors, &k_bundles,
                                          &k_messages};

static int count(int which) {
  pending[which]++;
  return 0;
}

int pyusmipc_torch_reduce_fold_counts(void) {
  return pyusmipc_fold_counts(cfg.counts, pending, pending_key, 5);
}

/* Whether host memory at ptr is usmipc's to send (torch.py's
 * _is_usmipc_host): usmipc memory not registered from elsewhere. */
static int usmipc_host(PyObject *storage) {
  PyObject *p = pyusmipc_torch_read(storage, PYUSMIPC_S_DATA_PTR);
  if (p == NULL)
    return -1;
  void *ptr = PyLong_AsVoidPtr(p);
  Py_DECREF(p);
  if (ptr == NULL)
    return PyErr_Occurred() ? -1 : 0;
  usmipc_pointer_info_t info;
  return usmipc_pointer_query(ptr, &info) == 0 && !info.is_foreign;
}

/* Whether this process received the storage (nbytes, on device index, -1
 * the host): the key torch.py's _received files it under, (device index or
 * None, data_ptr, nbytes), is there. 1, 0, or -1 with an exception. Such
 * memory is handed on (torch.py's _origin decides, if it is still alive),
 * never exported as this process's own. */
static int received_here(long index, PyObject *storage, PyObject *nbytes) {
  if (PyDict_Size(cfg.received) == 0)
    return 0;
  PyObject *where = index >= 0 ? PyLong_FromLong(index) : Py_NewRef(Py_None);
  PyObject *ptr =
      where ? pyusmipc_torch_read(storage, PYUSMIPC_S_DATA_PTR) : NULL;
  PyObject *key = ptr ? PyTuple_Pack(3, where, ptr, nbytes) : NULL;
  Py_XDECREF(where);
  Py_XDECREF(ptr);
  if (key == NULL)
    return -1;
  int found = PyDict_Contains(cfg.received, key);
  Py_DECREF(key);
  return found;
}

/* The untyped storage of t if t is a strided tensor that is not nested
 * (what usmipc.torch routes), with *cuda whether it is on a GPU: 1; 0 when
 * it is not; -1 with an exception. */
static int strided_storage(PyObject *t, int *cuda, PyObject **storage) {
  int nested = pyusmipc_torch_true(t, PYUSMIPC_T_IS_NESTED);
  if (nested != 0)
    return nested < 0 ? -1 : 0;
  PyObject *layout = pyusmipc_torch_read(t, PYUSMIPC_T_LAYOUT);
  if (layout == NULL)
    return -1;
  Py_DECREF(layout); /* torch.strided lives in torch: compared only */
  if (layout != cfg.strided)
    return 0;
  if ((*cuda = pyusmipc_torch_true(t, PYUSMIPC_T_IS_CUDA)) < 0)
    return -1;
  *storage = pyusmipc_torch_read(t, PYUSMIPC_T_UNTYPED_STORAGE);
  return *storage == NULL ? -1 : 1;
}

/* Where t's memory is, if usmipc.torch sends it: *index its CUDA device's
 * index, or -1 for usmipc's host memory (a CPU tensor of torch's own is
 * torch's to send). 1, 0 (not routed), or -1 with an exception. */
static int routed_index(PyObject *t, PyObject *storage, int cuda, long *index) {
  *index = -1;
  if (!cuda) {
    int cpu = pyusmipc_torch_true(t, PYUSMIPC_T_IS_CPU);
    return cpu == 1 ? usmipc_host(storage) : cpu;
  }
  PyObject *i = pyusmipc_torch_read(t, PYUSMIPC_T_GET_DEVICE);
  *index = i ? PyLong_AsLong(i) : -1;
  Py_XDECREF(i);
  return *index >= 0 ? 1 : PyErr_Occurred() ? -1 : 0;
}

/* Whether t (at offset 0 of its storage of nbytes, of dtype) covers the
 * storage whole and may travel as itself (torch.py's whole leaves): all
 * of its bytes, contiguous, of a dtype in leaf_dtypes. 1, 0, or -1. */
static int covers_whole(PyObject *t, PyObject *nbytes, PyObject *dtype) {
  PyObject *tnbytes = pyusmipc_torch_read(t, PYUSMIPC_T_NBYTES);
  int same = tnbytes ? PyObject_RichCompareBool(tnbytes, nbytes, Py_EQ) : -1;
  Py_XDECREF(tnbytes);
  int whole = same == 1 ? PySet_Contains(cfg.leaf_dtypes, dtype) : same;
  if (whole == 1) {
    PyObject *c = pyusmipc_torch_read(t, PYUSMIPC_T_IS_CONTIGUOUS);
    whole = c ? PyObject_IsTrue(c) : -1;
    Py_XDECREF(c);
  }
  return whole;
}

/* The message's reduction of tensor: NULL without an exception when the
 * common case does not hold (torch.py's _reduce_tensor says what does). */
static PyObject *reduce_common(torch_message_t *m, PyObject *t) {
  int cuda = 0;
  PyObject *storage = NULL;
  if (strided_storage(t, &cuda, &storage) != 1)
    return NULL;
  PyObject *out = NULL, *nbytes = NULL, *size = NULL, *tsize = NULL,
           *stride = NULL, *offset = NULL, *dtype = NULL, *at = NULL,
           *rg = NULL, *args = NULL;
  long index;
  if (routed_index(t, storage, cuda, &index) != 1)
    goto done;
  rg = pyusmipc_torch_read(t, PYUSMIPC_T_REQUIRES_GRAD);
  int grad = rg ? PyObject_IsTrue(rg) : -1;
  if (grad < 0 || (grad && pyusmipc_torch_true(t, PYUSMIPC_T_IS_LEAF) != 1))
    goto done; /* the refusal: torch.py's */
  int hooks = pyusmipc_torch_true(t, PYUSMIPC_T_BACKWARD_HOOKS);
  if (hooks != 0)
    goto done; /* torch.py warns */
  nbytes = pyusmipc_torch_read(storage, PYUSMIPC_S_NBYTES);
  if (nbytes == NULL || PyObject_IsTrue(nbytes) != 1)
    goto done; /* no bytes: torch.py's */
  if (received_here(index, storage, nbytes) != 0)
    goto done; /* maybe memory to hand on: torch.py's */
  size = pyusmipc_torch_read(t, PYUSMIPC_T_SIZE);
  tsize = size ? PySequence_Tuple(size) : NULL;
  stride = tsize ? pyusmipc_torch_read(t, PYUSMIPC_T_STRIDE) : NULL;
  offset = stride ? pyusmipc_torch_read(t, PYUSMIPC_T_STORAGE_OFFSET) : NULL;
  dtype = offset ? pyusmipc_torch_read(t, PYUSMIPC_T_DTYPE) : NULL;
  if (dtype == NULL)
    goto done;
  /* Whole: may travel as itself (torch.py's whole leaves). */
  long off = PyLong_AsLong(offset);
  if (off == -1 && PyErr_Occurred())
    goto done;
  int whole = off == 0 ? covers_whole(t, nbytes, dtype) : 0;
  if (whole < 0)
    goto done;
  at = add_own(m, storage, nbytes, index, whole ? t : Py_None, dtype, tsize);
  if (at == NULL)
    goto done;
  if (count(cuda ? C_CUDA_TENSORS : C_HOST_TENSORS) < 0 ||
      count(C_ROUTED_TENSORS) < 0)
    goto done;
  args = PyTuple_Pack(7, at, (PyObject *)Py_TYPE(t), tsize, stride, offset,
                      dtype, grad ? Py_True : Py_False);
  if (args != NULL && (out = PyTuple_Pack(2, cfg.rebuild, args)) != NULL)
    m->taken++;
done:
  Py_DECREF(storage);
  Py_XDECREF(nbytes);
  Py_XDECREF(size);
  Py_XDECREF(tsize);
  Py_XDECREF(stride);
  Py_XDECREF(offset);
  Py_XDECREF(dtype);
  Py_XDECREF(at);
  Py_XDECREF(rg);
  Py_XDECREF(args);
  return out;
}

PyObject *pyusmipc_torch_reduce_tensor(PyObject *module, PyObject *tensor) {
  (void)module;
  if (configured() < 0)
    return NULL;
  PyObject *msg = depth > 0 && depth <= STACK_MAX ? stack[depth - 1] : NULL;
  if (msg != NULL) {
    PyObject *red = reduce_common((torch_message_t *)msg, tensor);
    if (red != NULL || PyErr_Occurred())
      return red;
  }
  return PyObject_CallFunctionObjArgs(cfg.fallback, tensor, NULL);
}

/* ---- the one-tensor message -----------------------------------------------
 * ForkingPickler.dumps of one tensor, the repeated send of a weight-update
 * loop: torch.py's _lone_message in C for its common case (a plain
 * torch.Tensor, routed, with bytes, no grad, no hooks, not received here).
 * Its Python took about 10 us a call on the 2-vCPU VM, a third of it the
 * pickling of one small tuple through _Reduced (a global looked up and
 * checked by the pickler); here the tensor is read once, the bundle made
 * from what was read, and the pickle written directly: PROTO 4, the
 * global usmipc.torch._open_lone, its arguments' tuple, REDUCE; strs,
 * bytes, ints, tuples of ints and a bool, which any unpickler reads. */

typedef struct pbuf {
  char *p;
  size_t n, cap;
} pbuf_t;

static int put(pbuf_t *b, const void *s, size_t n) {
  if (grow((void **)&b->p, &b->cap, b->n + n, 1) < 0)
    return -1;
  memcpy(b->p + b->n, s, n);
  b->n += n;
  return 0;
}

static int put_op_u32(pbuf_t *b, char op, uint32_t v) {
  unsigned char w[5] = {(unsigned char)op, (unsigned char)v,
                        (unsigned char)(v >> 8), (unsigned char)(v >> 16),
                        (unsigned char)(v >> 24)};
  return put(b, w, 5);
}

/* An int: BININT (4 bytes) when it fits, else LONG1 of 8 bytes (two's
 * complement, little-endian). */
static int put_int(pbuf_t *b, long long v) {
  if (v >= INT32_MIN && v <= INT32_MAX)
    return put_op_u32(b, 'J', (uint32_t)(int32_t)v);
  unsigned char w[10] = {0x8a, 8};
  uint64_t u = (uint64_t)v;
  for (int k = 0; k < 8; k++)
    w[2 + k] = (unsigned char)(u >> (8 * k));
  return put(b, w, 10);
}

/* A str (BINUNICODE) from its UTF-8, or bytes (BINBYTES). */
static int put_text(pbuf_t *b, char op, const char *s, size_t n) {
  if (n > UINT32_MAX) {
    pyusmipc_value_error("usmipc.torch: a field too long to pickle");
    return -1;
  }
  return put_op_u32(b, op, (uint32_t)n) < 0 ? -1 : put(b, s, n);
}

static int put_str(pbuf_t *b, PyObject *str) {
  Py_ssize_t n;
  const char *s = PyUnicode_AsUTF8AndSize(str, &n);
  return s == NULL ? -1 : put_text(b, 'X', s, (size_t)n);
}

/* A tuple of the ints in dims: MARK, the ints, TUPLE. */
static int put_dims(pbuf_t *b, const int64_t *dims, int n) {
  if (put(b, "(", 1) < 0)
    return -1;
  for (int k = 0; k < n; k++)
    if (put_int(b, dims[k]) < 0)
      return -1;
  return put(b, "t", 1);
}

/* The one leaf of a lone message's bundle. */
typedef struct lone_leaf {
  void *ptr;
  int64_t nbytes;
  const pyusmipc_dtype_t *dt; /* NULL: the storage's bytes */
  int ndim;
  const int64_t *shape;
  PyObject *keep;
} lone_leaf_t;

static int leaf_of_lone(void *ctx, Py_ssize_t i, pyusmipc_array_t *out) {
  (void)i;
  const lone_leaf_t *l = ctx;
  fill_leaf(out, l->ptr, l->nbytes, l->dt, l->ndim, l->shape, l->keep);
  return 0;
}

/* The ints of a tuple (a torch.Size, a stride) into dims; 1 if they fit
 * (at most USMIPC_BUNDLE_MAX_NDIM), 0 if not, -1 with an exception. */
static int read_dims(PyObject *tuple, int64_t *dims, int *n) {
  if (!PyTuple_Check(tuple))
    return 0;
  Py_ssize_t len = PyTuple_Size(tuple);
  if (len > USMIPC_BUNDLE_MAX_NDIM)
    return 0;
  for (Py_ssize_t k = 0; k < len; k++) {
    dims[k] = PyLong_AsLongLong(PyTuple_GetItem(tuple, k));
    if (dims[k] == -1 && PyErr_Occurred())
      return -1;
  }
  *n = (int)len;
  return 1;
}

/* A share() that usmipc.torch would send by torch's path instead (its
 * _refusal): the exception dropped, 1; 0 with it kept; -1 on failure. */
static int drop_refusal(void) {
  PyObject *type, *value, *tb;
  PyErr_Fetch(&type, &value, &tb);
  PyErr_NormalizeException(&type, &value, &tb);
  PyObject *r =
      value ? PyObject_CallFunctionObjArgs(cfg.refusal, value, NULL) : NULL;
  int refused = r ? PyObject_IsTrue(r) : -1;
  Py_XDECREF(r);
  if (refused == 1) {
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(tb);
    return 1;
  }
  if (refused < 0) { /* the check's own failure wins */
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(tb);
    return -1;
  }
  PyErr_Restore(type, value, tb);
  return 0;
}

/* _torch_lone(tensor, put_event, protocol): the pickle of the message of
 * one tensor (a memoryview, as ForkingPickler.dumps returns), or None where
 * torch.py's _lone_message must decide (another class, grad, hooks, no
 * bytes, memory received or refused, a dtype not yet named, protocol < 4). */
PyObject *pyusmipc_torch_lone(PyObject *module, PyObject *const *args,
                              Py_ssize_t nargs) {
  if (nargs != 3)
    return pyusmipc_type_error("_torch_lone(tensor, put_event, protocol)");
  if (configured() < 0)
    return NULL;
  PyObject *t = args[0], *put_event = args[1], *protocol = args[2];
  if (protocol != Py_None) {
    long proto = PyLong_AsLong(protocol);
    if (proto == -1 && PyErr_Occurred())
      return NULL;
    if (proto >= 0 && proto < 4)
      Py_RETURN_NONE;
  }
  if ((PyObject *)Py_TYPE(t) != cfg.tensor)
    Py_RETURN_NONE;
  int cuda = 0;
  PyObject *storage = NULL;
  int routed = strided_storage(t, &cuda, &storage);
  if (routed != 1)
    return routed < 0 ? NULL : Py_NewRef(Py_None);
  PyObject *out = NULL, *nbytes = NULL, *size = NULL, *stride = NULL,
           *offset = NULL, *dtype = NULL, *stream = NULL, *dtype_name = NULL,
           *bundle = NULL, *raw = NULL, *kept = NULL, *pickled = NULL;
  pbuf_t b = {0};
  int declined = 1;
  long index;
  int routed_here = routed_index(t, storage, cuda, &index);
  if (routed_here != 1) {
    declined = routed_here == 0;
    goto done;
  }
  int grad = pyusmipc_torch_true(t, PYUSMIPC_T_REQUIRES_GRAD);
  int hooks =
      grad == 0 ? pyusmipc_torch_true(t, PYUSMIPC_T_BACKWARD_HOOKS) : grad;
  if (hooks != 0) {
    declined = hooks > 0;
    goto done;
  }
  nbytes = pyusmipc_torch_read(storage, PYUSMIPC_S_NBYTES);
  int some = nbytes ? PyObject_IsTrue(nbytes) : -1;
  int got = some == 1 ? received_here(index, storage, nbytes) : 0;
  if (got == 1) { /* handed on if still alive (torch.py's _origin) */
    PyObject *origin = PyObject_CallFunctionObjArgs(cfg.origin, storage, NULL);
    got = origin == NULL ? -1 : origin != Py_None;
    Py_XDECREF(origin);
  }
  if (some != 1 || got != 0) {
    declined = some == 0 || got == 1;
    goto done;
  }
  dtype = pyusmipc_torch_read(t, PYUSMIPC_T_DTYPE);
  dtype_name = dtype ? PyDict_GetItemWithError(cfg.dtype_names, dtype) : NULL;
  Py_XINCREF(dtype_name); /* held: code may change the dict */
  if (dtype_name == NULL || !PyUnicode_Check(dtype_name)) {
    declined = !PyErr_Occurred(); /* named by _lone_message the first time */
    goto done;
  }
  PyObject *size_obj = pyusmipc_torch_read(t, PYUSMIPC_T_SIZE);
  size = size_obj ? PySequence_Tuple(size_obj) : NULL;
  Py_XDECREF(size_obj);
  stride = size ? pyusmipc_torch_read(t, PYUSMIPC_T_STRIDE) : NULL;
  offset = stride ? pyusmipc_torch_read(t, PYUSMIPC_T_STORAGE_OFFSET) : NULL;
  if (offset == NULL) {
    declined = 0;
    goto done;
  }
  int64_t shape[USMIPC_BUNDLE_MAX_NDIM], strides[USMIPC_BUNDLE_MAX_NDIM];
  int nd = 0, nds = 0;
  int fits = read_dims(size, shape, &nd);
  fits = fits == 1 ? read_dims(stride, strides, &nds) : fits;
  long long off = PyLong_AsLongLong(offset);
  if (fits != 1 || nd != nds || (off == -1 && PyErr_Occurred())) {
    declined = fits == 0 || (fits == 1 && nd != nds);
    goto done;
  }
  lone_leaf_t leaf = {.keep = storage};
  leaf.nbytes = PyLong_AsLongLong(nbytes);
  PyObject *p = pyusmipc_torch_read(storage, PYUSMIPC_S_DATA_PTR);
  leaf.ptr = p ? PyLong_AsVoidPtr(p) : NULL;
  Py_XDECREF(p);
  if (PyErr_Occurred()) {
    declined = 0;
    goto done;
  }
  /* Whole: travels as itself (torch.py's whole leaves). */
  int whole = off == 0 ? covers_whole(t, nbytes, dtype) : 0;
  if (whole == 1 && (leaf.dt = pyusmipc_dtype_of_torch(dtype)) != NULL) {
    leaf.ndim = nd;
    leaf.shape = shape;
  }
  if (whole < 0 || PyErr_Occurred()) {
    declined = 0;
    goto done;
  }
  PyObject *device_name;
  if (cuda) {
    if (put_event != Py_None) {
      PyObject *i = PyLong_FromLong(index);
      stream =
          i ? PyObject_CallFunctionObjArgs(cfg.order_stream, i, put_event, NULL)
            : NULL;
      Py_XDECREF(i);
      if (stream == NULL) {
        declined = 0;
        goto done;
      }
    }
    if (stream == NULL || stream == Py_None) {
      Py_XDECREF(stream);
      stream = NULL;
      if (cfg.raw_stream == Py_None)
        goto done; /* no CUDA in this torch */
      PyObject *i = PyLong_FromLong(index);
      stream = i ? PyObject_CallFunctionObjArgs(cfg.raw_stream, i, NULL) : NULL;
      Py_XDECREF(i);
      if (stream == NULL) {
        declined = 0;
        goto done;
      }
    }
    PyObject *i = PyLong_FromLong(index);
    device_name = i ? PyDict_GetItemWithError(cfg.cuda_names, i) : NULL;
    if (device_name != NULL) {
      Py_INCREF(device_name);
    } else if (i != NULL && !PyErr_Occurred()) {
      device_name = PyObject_CallFunctionObjArgs(cfg.cuda_name, i, NULL);
    }
    Py_XDECREF(i);
    if (device_name == NULL || !PyUnicode_Check(device_name)) {
      Py_XDECREF(device_name);
      declined = 0;
      if (!PyErr_Occurred())
        pyusmipc_type_error("usmipc.torch: a CUDA device's name is a str");
      goto done;
    }
  } else {
    device_name = PyUnicode_FromString("cpu");
    if (device_name == NULL) {
      declined = 0;
      goto done;
    }
  }
  /* The pickle, from here on: _open_lone(device_name, raw, 0, size,
   * stride, offset, dtype_name, False). */
  bundle = pyusmipc_share_read(PyModule_GetState(module), 1, leaf_of_lone,
                               &leaf, stream);
  if (bundle == NULL) {
    Py_DECREF(device_name);
    int r = drop_refusal(); /* then _lone_message says it, and warns */
    declined = r == 1;
    goto done;
  }
  raw = pyusmipc_bundle_to_bytes(bundle, NULL);
  kept = raw ? PyObject_CallFunctionObjArgs(cfg.keep, bundle, NULL) : NULL;
  char *rb;
  Py_ssize_t rn;
  if (kept == NULL || PyBytes_AsStringAndSize(raw, &rb, &rn) < 0) {
    Py_DECREF(device_name);
    declined = 0;
    goto done;
  }
  static const char head[] = "\x80\x04"
                             "cusmipc.torch\n_open_lone\n"
                             "(";
  int rc = put(&b, head, sizeof(head) - 1) < 0 ||
                   put_str(&b, device_name) < 0 ||
                   put_text(&b, 'B', rb, (size_t)rn) < 0 ||
                   put_int(&b, 0) < 0 || put_dims(&b, shape, nd) < 0 ||
                   put_dims(&b, strides, nd) < 0 || put_int(&b, off) < 0 ||
                   put_str(&b, dtype_name) < 0 || put(&b, "\x89tR.", 4) < 0
               ? -1
               : 0;
  Py_DECREF(device_name);
  declined = 0;
  if (rc < 0)
    goto done;
  if (count(cuda ? C_CUDA_TENSORS : C_HOST_TENSORS) < 0 ||
      count(C_ROUTED_TENSORS) < 0 || count(C_BUNDLES) < 0 ||
      count(C_MESSAGES) < 0)
    goto done;
  pickled = PyBytes_FromStringAndSize(b.p, (Py_ssize_t)b.n);
  out = pickled ? PyMemoryView_FromObject(pickled) : NULL;
done:
  free(b.p);
  Py_DECREF(storage);
  Py_XDECREF(nbytes);
  Py_XDECREF(size);
  Py_XDECREF(stride);
  Py_XDECREF(offset);
  Py_XDECREF(dtype);
  Py_XDECREF(stream);
  Py_XDECREF(dtype_name);
  Py_XDECREF(bundle);
  Py_XDECREF(raw);
  Py_XDECREF(kept);
  Py_XDECREF(pickled);
  if (out == NULL && declined && !PyErr_Occurred())
    Py_RETURN_NONE;
  return out;
}
