/* Floor 8 of the extension usmipc._usmipc (torch_rebuild.c): usmipc.torch's
 * per-tensor step on the receiver, in C. ForkingPickler.loads of a message
 * of many tensors (a state dict) calls usmipc.torch's _rebuild_tensor once
 * per tensor; in Python its two frames (the rebuild and the lookup of
 * storages this process received before) cost about 2 us a tensor beside
 * torch's own calls, most of a warm 338-tensor state dict's loads (issue
 * 24). python/usmipc/torch.py keeps every rule; this file runs its common
 * case and hands every other to torch.py's _rebuild_slow:
 *
 *   _torch_rebuild_setup(config): torch.py's objects this file calls or
 *       compares with (torch.py's _bind_torch passes them, in every process
 *       that sends or receives, installed or not; one process, one set).
 *   _torch_rebuild(at, cls, size, stride, offset, dtype, requires_grad):
 *       torch.py's _rebuild_tensor. The common case: a plain tensor
 *       (cls torch.Tensor, requires_grad False) of the message being
 *       loaded, either the sender's whole tensor (the leaf itself, unless
 *       this process still holds its storage) or a view of a storage the
 *       message has made already.
 *   _torch_storage_or_live(leaf, origin) -> (storage, fresh): torch.py's
 *       _storage_or_live, one implementation for both languages.
 *
 * Calls torch_readers.c and util.c only. */
#include "torch_rebuild.h"
#include "torch_readers.h"

#include "util.h"

/* torch.py's objects (_torch_rebuild_setup): strong references, for the
 * life of the process. */
static struct {
  PyObject *tls;      /* _tls: .opened, the messages being loaded */
  PyObject *received; /* dict (device index or None, ptr, nbytes) ->
                         (weak ref, origin) */
  PyObject *counts;   /* dict: stats() counters */
  PyObject *tensor;   /* torch.Tensor */
  PyObject *empty;    /* torch.empty */
  PyObject *storages; /* torch.UntypedStorage */
  PyObject *slow;     /* _rebuild_slow: every case */
  PyObject *prune;    /* _prune_received(): drops dead entries */
  Py_ssize_t prune_at;
} rb;

/* Names, made once. */
static PyObject *n_opened, *n_storages, *n_leaves, *n_groups, *n_dtype,
    *n_weak_ref, *n_expired, *n_new_with_weak_ptr, *n_free_weak_ref, *n_device,
    *n_set, *k_received_tensors, *k_reused_storages;

static int make_names(void) {
  static const pyusmipc_named_t names[] = {
      {&n_opened, "opened"},
      {&n_storages, "storages"},
      {&n_leaves, "leaves"},
      {&n_groups, "groups"},
      {&n_dtype, "dtype"},
      {&n_weak_ref, "_weak_ref"},
      {&n_expired, "_expired"},
      {&n_new_with_weak_ptr, "_new_with_weak_ptr"},
      {&n_free_weak_ref, "_free_weak_ref"},
      {&n_device, "device"},
      {&n_set, "set_"},
      {&k_received_tensors, "received_tensors"},
      {&k_reused_storages, "reused_storages"}};
  return pyusmipc_intern_names(names, sizeof(names) / sizeof(names[0]));
}

PyObject *pyusmipc_torch_rebuild_setup(PyObject *module, PyObject *config) {
  (void)module;
  static const pyusmipc_named_t keys[] = {
      {&rb.tls, "tls"},       {&rb.received, "received"},
      {&rb.counts, "counts"}, {&rb.tensor, "Tensor"},
      {&rb.empty, "empty"},   {&rb.storages, "UntypedStorage"},
      {&rb.slow, "slow"},     {&rb.prune, "prune"}};
  const char *what = "_torch_rebuild_setup";
  if (!PyDict_Check(config))
    return pyusmipc_type_error("%s: a dict", what);
  /* Checked before anything is taken (str keys: no code runs). */
  PyObject *received = PyDict_GetItemString(config, "received");
  PyObject *counts = PyDict_GetItemString(config, "counts");
  PyObject *at = PyDict_GetItemString(config, "prune_at");
  if ((received != NULL && !PyDict_Check(received)) ||
      (counts != NULL && !PyDict_Check(counts)))
    return pyusmipc_type_error("%s: received and counts are dicts", what);
  if (at == NULL)
    return pyusmipc_value_error("%s: no prune_at", what);
  Py_ssize_t prune_at = PyLong_AsSsize_t(at);
  if (prune_at < 1) {
    if (!PyErr_Occurred())
      pyusmipc_value_error("%s: prune_at, a count > 0", what);
    return NULL;
  }
  /* Counts made under the dict being replaced go to it, not the new. */
  if (pyusmipc_torch_rebuild_fold_counts() < 0 || make_names() < 0 ||
      pyusmipc_take_config(config, keys, sizeof(keys) / sizeof(keys[0]), what) <
          0)
    return NULL;
  rb.prune_at = prune_at;
  Py_RETURN_NONE;
}

/* stats() counters, counted here and added to the counts dict when
 * usmipc.torch reads it (pyusmipc_torch_rebuild_fold_counts), as
 * torch_reduce.c's. */
enum { C_RECEIVED_TENSORS, C_REUSED_STORAGES };
static Py_ssize_t pending[2];
static PyObject **const pending_key[2] = {&k_received_tensors,
                                          &k_reused_storages};

static int count(int which) {
  pending[which]++;
  return 0;
}

int pyusmipc_torch_rebuild_fold_counts(void) {
  return pyusmipc_fold_counts(rb.counts, pending, pending_key, 2);
}

/* rb.storages.<name>(arg). */
static PyObject *storages_call(PyObject *name, PyObject *arg) {
  return PyObject_CallMethodObjArgs(rb.storages, name, arg, NULL);
}

/* The key a received leaf is filed under in rb.received: (device index or
 * None for the host, data_ptr, nbytes), as the sender's received_here in
 * torch_reduce.c looks it up. */
static PyObject *received_key(PyObject *leaf) {
  PyObject *dev = pyusmipc_torch_read(leaf, PYUSMIPC_T_GET_DEVICE);
  if (dev == NULL)
    return NULL;
  long where = PyLong_AsLong(dev);
  if (where == -1 && PyErr_Occurred()) {
    Py_DECREF(dev);
    return NULL;
  }
  if (where < 0) {
    Py_DECREF(dev);
    dev = Py_NewRef(Py_None);
  }
  PyObject *ptr = pyusmipc_torch_read(leaf, PYUSMIPC_T_DATA_PTR);
  PyObject *nbytes = ptr ? pyusmipc_torch_read(leaf, PYUSMIPC_T_NBYTES) : NULL;
  PyObject *key = nbytes ? PyTuple_Pack(3, dev, ptr, nbytes) : NULL;
  Py_DECREF(dev);
  Py_XDECREF(ptr);
  Py_XDECREF(nbytes);
  return key;
}

/* The leaf's own storage (*fresh 1), filed as received with origin, or the
 * live storage of the same memory this process received before (*fresh
 * 0). NULL with an exception. */
static PyObject *storage_or_live(PyObject *leaf, PyObject *origin, int *fresh) {
  PyObject *key = received_key(leaf);
  if (key == NULL)
    return NULL;
  PyObject *got = PyDict_GetItemWithError(rb.received, key);
  Py_XINCREF(got);
  if (got == NULL && PyErr_Occurred())
    goto fail;
  if (got != NULL) {
    if (!PyTuple_Check(got) || PyTuple_Size(got) != 2) {
      pyusmipc_type_error("usmipc.torch: a received storage's entry is not "
                          "(weak ref, origin)");
      goto fail;
    }
    PyObject *ref = PyTuple_GetItem(got, 0);
    PyObject *dead = storages_call(n_expired, ref);
    int expired = dead != NULL ? PyObject_IsTrue(dead) : -1;
    Py_XDECREF(dead);
    if (expired < 0)
      goto fail;
    if (!expired) {
      PyObject *live = storages_call(n_new_with_weak_ptr, ref);
      Py_DECREF(got);
      Py_DECREF(key);
      if (live == NULL || count(C_REUSED_STORAGES) < 0) {
        Py_XDECREF(live);
        return NULL;
      }
      *fresh = 0;
      return live;
    }
    /* Out of the dict before the ref is freed: a failure below must not
     * leave a freed weak ref to be asked _expired again. */
    if (PyDict_DelItem(rb.received, key) < 0)
      goto fail;
    PyObject *freed = storages_call(n_free_weak_ref, ref);
    Py_CLEAR(got);
    if (freed == NULL)
      goto fail;
    Py_DECREF(freed);
  } else if (PyDict_Size(rb.received) >= rb.prune_at) {
    PyObject *r = PyObject_CallNoArgs(rb.prune);
    if (r == NULL)
      goto fail;
    Py_DECREF(r);
  }
  PyObject *storage = pyusmipc_torch_read(leaf, PYUSMIPC_T_UNTYPED_STORAGE);
  if (storage == NULL)
    goto fail;
  PyObject *ref = PyObject_CallMethodObjArgs(storage, n_weak_ref, NULL);
  PyObject *entry = ref ? PyTuple_Pack(2, ref, origin) : NULL;
  Py_XDECREF(ref);
  if (entry == NULL || PyDict_SetItem(rb.received, key, entry) < 0) {
    Py_XDECREF(entry);
    Py_DECREF(storage);
    goto fail;
  }
  Py_DECREF(entry);
  Py_DECREF(key);
  *fresh = 1;
  return storage;
fail:
  Py_XDECREF(got);
  Py_DECREF(key);
  return NULL;
}

/* Bound to torch, or -1 with an exception. A receiver's first routed
 * tensor may come before it imports torch or usmipc.torch binds it (the
 * message names this function, not torch): both are done here then. */
static int ready(void) {
  if (rb.slow != NULL)
    return 0;
  PyObject *torch = PyImport_ImportModule("torch");
  PyObject *ut = torch ? PyImport_ImportModule("usmipc.torch") : NULL;
  PyObject *r = ut ? PyObject_CallMethod(ut, "_bind_torch", NULL) : NULL;
  Py_XDECREF(torch);
  Py_XDECREF(ut);
  Py_XDECREF(r);
  if (r != NULL && rb.slow == NULL)
    pyusmipc_value_error("usmipc.torch: _bind_torch() did not set up the "
                         "receiver's step (_torch_rebuild_setup)");
  return rb.slow != NULL ? 0 : -1;
}

PyObject *pyusmipc_torch_storage_or_live(PyObject *module,
                                         PyObject *const *args,
                                         Py_ssize_t nargs) {
  (void)module;
  if (nargs != 2)
    return pyusmipc_type_error("_torch_storage_or_live(leaf, origin)");
  if (ready() < 0)
    return NULL;
  int fresh = 0;
  PyObject *s = storage_or_live(args[0], args[1], &fresh);
  if (s == NULL)
    return NULL;
  PyObject *out = Py_BuildValue("(NO)", s, fresh ? Py_True : Py_False);
  return out;
}

/* The message being loaded on this thread (the last of _tls.opened), or
 * NULL with no exception when none is (the slow path says so). */
static PyObject *current_opened(void) {
  PyObject *stack = PyObject_GetAttr(rb.tls, n_opened);
  if (stack == NULL) {
    PyErr_Clear();
    return NULL;
  }
  PyObject *top = NULL;
  if (PyList_Check(stack) && PyList_Size(stack) > 0)
    top = Py_NewRef(PyList_GetItem(stack, PyList_Size(stack) - 1));
  Py_DECREF(stack);
  return top;
}

/* seq[i] for a Python int i, new reference, or NULL with an exception. */
static PyObject *item_at(PyObject *seq, PyObject *i) {
  Py_ssize_t k = PyLong_AsSsize_t(i);
  if (k == -1 && PyErr_Occurred())
    return NULL;
  return PySequence_GetItem(seq, k);
}

/* 1 if reader r of tensor t equals want (==), 0 if not, -1 with an
 * exception. */
static int read_equals(PyObject *t, pyusmipc_torch_reader_t r, PyObject *want) {
  PyObject *v = pyusmipc_torch_read(t, r);
  if (v == NULL)
    return -1;
  int eq = PyObject_RichCompareBool(v, want, Py_EQ);
  Py_DECREF(v);
  return eq;
}

/* The leaf the message sent for at, if the tensor is that leaf whole
 * (torch.py's whole leaves: its dtype, offset 0, its shape and stride):
 * a new reference; NULL with no exception when it is not; NULL with one on
 * failure (*failed set). */
static PyObject *whole_leaf(PyObject *opened, PyObject *at, PyObject *size,
                            PyObject *stride, PyObject *dtype, int *failed) {
  *failed = 1;
  PyObject *leaves = PyObject_GetAttr(opened, n_leaves);
  PyObject *row = leaves ? item_at(leaves, PyTuple_GetItem(at, 0)) : NULL;
  PyObject *leaf = row ? item_at(row, PyTuple_GetItem(at, 1)) : NULL;
  Py_XDECREF(leaves);
  Py_XDECREF(row);
  if (leaf == NULL)
    return NULL;
  PyObject *dt = pyusmipc_torch_read(leaf, PYUSMIPC_T_DTYPE);
  if (dt == NULL)
    goto fail;
  Py_DECREF(dt); /* a torch dtype lives in torch: compared only */
  int same = dt == dtype ? read_equals(leaf, PYUSMIPC_T_SHAPE, size) : 0;
  if (same > 0)
    same = read_equals(leaf, PYUSMIPC_T_STRIDE, stride);
  if (same < 0)
    goto fail;
  *failed = 0;
  if (!same)
    Py_CLEAR(leaf);
  return leaf;
fail:
  Py_DECREF(leaf);
  return NULL;
}

/* torch.empty(0, dtype=dtype, device=storage.device).set_(storage, offset,
 * size, stride): a tensor over storage, as torch's rebuild makes it. */
static PyObject *tensor_over(PyObject *storage, PyObject *offset,
                             PyObject *size, PyObject *stride,
                             PyObject *dtype) {
  PyObject *device = PyObject_GetAttr(storage, n_device);
  if (device == NULL)
    return NULL;
  PyObject *kw = PyDict_New();
  PyObject *args = kw ? Py_BuildValue("(i)", 0) : NULL;
  PyObject *t = NULL;
  if (args != NULL && PyDict_SetItem(kw, n_dtype, dtype) == 0 &&
      PyDict_SetItem(kw, n_device, device) == 0)
    t = PyObject_Call(rb.empty, args, kw);
  Py_DECREF(device);
  Py_XDECREF(kw);
  Py_XDECREF(args);
  if (t == NULL)
    return NULL;
  PyObject *r =
      PyObject_CallMethodObjArgs(t, n_set, storage, offset, size, stride, NULL);
  Py_DECREF(t);
  return r;
}

static PyObject *slow(PyObject *const *args, Py_ssize_t nargs) {
  PyObject *t = PyTuple_New(nargs);
  if (t == NULL)
    return NULL;
  for (Py_ssize_t i = 0; i < nargs; i++)
    PyTuple_SetItem(t, i, Py_NewRef(args[i]));
  PyObject *r = PyObject_Call(rb.slow, t, NULL);
  Py_DECREF(t);
  return r;
}

PyObject *pyusmipc_torch_rebuild(PyObject *module, PyObject *const *args,
                                 Py_ssize_t nargs) {
  (void)module;
  if (ready() < 0)
    return NULL;
  if (nargs != 7)
    return slow(args, nargs); /* which says what is wrong */
  PyObject *at = args[0], *cls = args[1], *size = args[2], *stride = args[3],
           *offset = args[4], *dtype = args[5], *requires_grad = args[6];
  if (cls != rb.tensor || requires_grad != Py_False || !PyTuple_Check(at) ||
      PyTuple_Size(at) != 2 || !PyLong_Check(PyTuple_GetItem(at, 0)) ||
      !PyLong_Check(PyTuple_GetItem(at, 1)) || !PyLong_Check(offset))
    return slow(args, nargs);
  PyObject *opened = current_opened();
  if (opened == NULL)
    return slow(args, nargs); /* which raises: outside a message */
  PyObject *storages = PyObject_GetAttr(opened, n_storages);
  PyObject *out = NULL, *storage = NULL;
  if (storages == NULL || !PyDict_Check(storages)) {
    PyErr_Clear(); /* the slow path reads it again and says what is wrong */
    Py_XDECREF(storages);
    Py_DECREF(opened);
    return slow(args, nargs);
  }
  storage = PyDict_GetItemWithError(storages, at);
  Py_XINCREF(storage);
  if (storage == NULL) {
    if (PyErr_Occurred())
      goto done;
    int failed = 0;
    long off = PyLong_AsLong(offset);
    if (off == -1 && PyErr_Occurred())
      PyErr_Clear(); /* not 0: the slow path takes it */
    PyObject *leaf =
        off == 0 ? whole_leaf(opened, at, size, stride, dtype, &failed) : NULL;
    if (leaf == NULL) {
      if (failed || PyErr_Occurred())
        goto done;
      out = slow(args, nargs); /* a view: opened.storage(at) makes it */
      goto done;
    }
    /* The sender's tensor itself: handed out as it is, unless this process
     * still holds that storage (then the tensor is made over it). */
    PyObject *groups = PyObject_GetAttr(opened, n_groups);
    PyObject *group = groups ? item_at(groups, PyTuple_GetItem(at, 0)) : NULL;
    Py_XDECREF(groups);
    PyObject *origin = NULL;
    if (group != NULL && PyTuple_Check(group) && PyTuple_Size(group) == 2)
      origin = PyTuple_Pack(3, PyTuple_GetItem(group, 0),
                            PyTuple_GetItem(group, 1), PyTuple_GetItem(at, 1));
    else if (group != NULL)
      pyusmipc_type_error("usmipc.torch: a message's group is not "
                          "(device, bytes)");
    Py_XDECREF(group);
    int fresh = 0;
    storage = origin ? storage_or_live(leaf, origin, &fresh) : NULL;
    Py_XDECREF(origin);
    if (storage == NULL || PyDict_SetItem(storages, at, storage) < 0) {
      Py_DECREF(leaf);
      goto done;
    }
    if (fresh) {
      if (count(C_RECEIVED_TENSORS) == 0)
        out = leaf;
      else
        Py_DECREF(leaf);
      goto done;
    }
    Py_DECREF(leaf);
  }
  if (count(C_RECEIVED_TENSORS) == 0)
    out = tensor_over(storage, offset, size, stride, dtype);
done:
  Py_XDECREF(storage);
  Py_DECREF(storages);
  Py_DECREF(opened);
  return out;
}
