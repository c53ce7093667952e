/* Floor 7 of the extension: updates, the consumer's one call
 * (usmipc.UpdatePlan, python/usmipc/update.py, over the C library's copy
 * plans: src/update.c, docs/bundles.md).
 *
 *   _copy_plan(device, dests, pin) -> _CopyPlan: dests is a list of
 *       (array index, destination array, name); each destination is read
 *       once, as share() reads a leaf, and kept alive by the plan.
 *   _CopyPlan.update(data, stream=None, ordered=True, release=True): one
 *       library call, without the GIL; no Python object per leaf, no
 *       attribute read per leaf.
 *   _bundle_paths(data) -> (paths, Device): each array's path (dict keys
 *       and list/tuple indices), in array order, for update.py to match
 *       destinations by name once.
 *
 * Calls bundle.c (reading arrays), queue.c (streams), device.c and util.c
 * (module.c lists the floors). */
#include "update.h"

#include <stdlib.h>
#include <string.h>

#include "bundle.h"
#include "device.h"
#include "queue.h"
#include "util.h"

typedef struct copy_plan_object {
  PyObject_HEAD usmipc_copy_plan_t *plan;
  PyObject *device; /* usmipc.Device */
  PyObject *keep;   /* list: what keeps each destination's memory alive */
  Py_ssize_t count;
} copy_plan_t;

/* _copy_plan(device, dests, pin) */
PyObject *pyusmipc_copy_plan(PyObject *module, PyObject *const *args,
                             Py_ssize_t nargs) {
  pyusmipc_module_state_t *st = PyModule_GetState(module);
  if (nargs != 3) {
    pyusmipc_type_error("_copy_plan(device, dests, pin) takes 3 arguments");
    return NULL;
  }
  PyObject *device = args[0], *dests = args[1];
  int pin = PyObject_IsTrue(args[2]);
  if (pin < 0)
    return NULL;
  if (!PyObject_TypeCheck(device, st->DeviceType)) {
    pyusmipc_type_error("_copy_plan(): device must be a usmipc.Device");
    return NULL;
  }
  if (!PyList_Check(dests)) {
    pyusmipc_type_error("_copy_plan(): dests must be a list");
    return NULL;
  }
  usmipc_device_t *dev = ((pyusmipc_device_object_t *)device)->device;
  /* The list is copied first: reading a destination runs its code, which
   * may change the caller's list. */
  PyObject *items = PyList_GetSlice(dests, 0, PyList_Size(dests));
  if (items == NULL)
    return NULL;
  Py_ssize_t n = PyList_Size(items);
  usmipc_copy_dest_t *d = calloc(n ? (size_t)n : 1, sizeof(*d));
  int64_t *dims = malloc((n ? (size_t)n : 1) * 2 * USMIPC_BUNDLE_MAX_NDIM *
                         sizeof(int64_t));
  PyObject *keep = PyList_New(0);
  copy_plan_t *self = NULL;
  if (d == NULL || dims == NULL) {
    PyErr_NoMemory();
    goto fail;
  }
  if (keep == NULL)
    goto fail;
  for (Py_ssize_t i = 0; i < n; i++) {
    PyObject *t = PyList_GetItem(items, i);
    if (!PyTuple_Check(t) || PyTuple_Size(t) != 3) {
      pyusmipc_type_error("_copy_plan(): dests[%zd] is not (index, array, "
                          "name)",
                          i);
      goto fail;
    }
    PyObject *idx = PyTuple_GetItem(t, 0), *arr = PyTuple_GetItem(t, 1),
             *name = PyTuple_GetItem(t, 2);
    unsigned long index = PyLong_AsUnsignedLong(idx);
    if (PyErr_Occurred())
      goto fail;
    pyusmipc_array_t a;
    Py_INCREF(t); /* arr and name live while their tuple does */
    int rc = pyusmipc_array_read(st, arr, &a);
    if (rc < 0) {
      /* Name the destination in the message. */
      PyObject *type, *value, *tb;
      PyErr_Fetch(&type, &value, &tb);
      PyErr_NormalizeException(&type, &value, &tb);
      PyObject *msg = value ? PyObject_Str(value) : NULL;
      if (msg != NULL && PyUnicode_Check(name)) {
        PyObject *full =
            PyUnicode_FromFormat("UpdatePlan: destination %U: %U", name, msg);
        if (full != NULL) {
          PyErr_SetObject(type, full);
          Py_DECREF(full);
          Py_XDECREF(type);
          Py_XDECREF(value);
          Py_XDECREF(tb);
        } else {
          PyErr_Restore(type, value, tb);
        }
      } else {
        PyErr_Restore(type, value, tb);
      }
      Py_XDECREF(msg);
      Py_DECREF(t);
      goto fail;
    }
    rc = PyList_Append(keep, a.keep);
    Py_DECREF(a.keep);
    int64_t *shape = dims + (size_t)i * 2 * USMIPC_BUNDLE_MAX_NDIM,
            *strides = shape + USMIPC_BUNDLE_MAX_NDIM;
    memcpy(shape, a.shape, sizeof(a.shape));
    memcpy(strides, a.strides, sizeof(a.strides));
    d[i].array = (uint32_t)index;
    d[i].ptr = a.ptr;
    d[i].desc = a.desc;
    d[i].desc.shape = shape;
    d[i].desc.strides = strides;
    d[i].name =
        PyUnicode_Check(name) ? PyUnicode_AsUTF8AndSize(name, NULL) : NULL;
    if (rc < 0 || (d[i].name == NULL && PyErr_Occurred())) {
      Py_DECREF(t);
      goto fail;
    }
    Py_DECREF(t);
  }
  self = (copy_plan_t *)pyusmipc_object_alloc((PyTypeObject *)st->CopyPlanType);
  if (self == NULL)
    goto fail;
  int rc;
  usmipc_copy_plan_t *plan = NULL;
  Py_BEGIN_ALLOW_THREADS
  rc = usmipc_copy_plan_create(dev, d, (size_t)n,
                               pin ? USMIPC_PLAN_PIN_TREE : 0, &plan);
  Py_END_ALLOW_THREADS
  if (rc != 0) {
    pyusmipc_raise(st, rc);
    goto fail;
  }
  self->plan = plan;
  self->device = Py_NewRef(device);
  self->keep = keep;
  self->count = n;
  keep = NULL;
  free(d);
  free(dims);
  Py_DECREF(items);
  return (PyObject *)self;
fail:
  Py_XDECREF((PyObject *)self);
  Py_XDECREF(keep);
  free(d);
  free(dims);
  Py_DECREF(items);
  return NULL;
}

/* update(data, stream=None, ordered=True, release=True) */
static PyObject *plan_update(PyObject *op, PyObject *const *args,
                             Py_ssize_t nargs, PyObject *kwnames) {
  static const char *const names[] = {"data", "stream", "ordered", "release"};
  PyObject *a[4];
  copy_plan_t *self = (copy_plan_t *)op;
  pyusmipc_module_state_t *st = PyType_GetModuleState(Py_TYPE(op));
  if (pyusmipc_parse_fastcall("update", args, nargs, kwnames, names, 4, 4, a) <
      0)
    return NULL;
  if (a[0] == NULL) {
    pyusmipc_type_error("update() missing argument 'data'");
    return NULL;
  }
  unsigned flags = 0;
  int v;
  if (a[2] != NULL && (v = PyObject_IsTrue(a[2])) <= 0) {
    if (v < 0)
      return NULL;
    flags |= USMIPC_OPEN_UNORDERED;
  }
  if (a[3] != NULL && (v = PyObject_IsTrue(a[3])) <= 0) {
    if (v < 0)
      return NULL;
    flags |= USMIPC_UPDATE_KEEP_TICKET;
  }
  if (self->plan == NULL) {
    pyusmipc_value_error("update(): the plan is closed");
    return NULL;
  }
  PyObject *queue_obj = NULL;
  usmipc_queue_t *queue = NULL;
  if (a[1] != NULL && a[1] != Py_None) {
    if ((queue_obj = pyusmipc_queue_from_stream(st, a[1], NULL, self->device,
                                                "UpdatePlan.update()")) == NULL)
      return NULL;
    queue = ((pyusmipc_queue_object_t *)queue_obj)->queue;
  }
  Py_buffer view;
  if (PyObject_GetBuffer(a[0], &view, PyBUF_SIMPLE) < 0) {
    Py_XDECREF(queue_obj);
    PyErr_Clear();
    return pyusmipc_type_error("UpdatePlan.update(): data must be the bytes "
                               "of a handoff (SharedBundle.to_bytes() in the "
                               "producer)");
  }
  int rc;
  usmipc_copy_plan_t *plan = self->plan;
  Py_BEGIN_ALLOW_THREADS
  rc = usmipc_bundle_update(plan, view.buf, (size_t)view.len, queue, flags);
  Py_END_ALLOW_THREADS
  PyBuffer_Release(&view);
  Py_XDECREF(queue_obj);
  if (rc == USMIPC_EINTR && PyErr_Occurred())
    return NULL;
  if (rc != 0)
    return pyusmipc_raise(st, rc);
  Py_RETURN_NONE;
}

static PyObject *plan_close(PyObject *op, PyObject *Py_UNUSED(ignored)) {
  copy_plan_t *self = (copy_plan_t *)op;
  int rc = 0;
  usmipc_copy_plan_t *plan = self->plan;
  self->plan = NULL;
  if (plan != NULL) {
    Py_BEGIN_ALLOW_THREADS
    rc = usmipc_copy_plan_free(plan);
    Py_END_ALLOW_THREADS
  }
  Py_CLEAR(self->keep);
  if (rc != 0)
    return pyusmipc_raise(PyType_GetModuleState(Py_TYPE(op)), rc);
  Py_RETURN_NONE;
}

static int plan_traverse(PyObject *op, visitproc visit, void *arg) {
  copy_plan_t *self = (copy_plan_t *)op;
  Py_VISIT(Py_TYPE(op));
  Py_VISIT(self->device);
  Py_VISIT(self->keep);
  return 0;
}

static int plan_clear(PyObject *op) {
  copy_plan_t *self = (copy_plan_t *)op;
  Py_CLEAR(self->device);
  return 0;
}

static void plan_dealloc(PyObject *op) {
  copy_plan_t *self = (copy_plan_t *)op;
  PyTypeObject *tp = Py_TYPE(op);
  PyObject_GC_UnTrack(op);
  /* The plan first (its last copies done where the backend can wait), then
   * the destinations may go. */
  PYUSMIPC_DESTROY_WITHOUT_GIL(usmipc_copy_plan_t, self->plan,
                               usmipc_copy_plan_free);
  plan_clear(op);
  Py_CLEAR(self->keep);
  PyObject_GC_Del(op);
  Py_DECREF(tp);
}

static PyObject *plan_repr(PyObject *op) {
  copy_plan_t *self = (copy_plan_t *)op;
  return PyUnicode_FromFormat("<usmipc._CopyPlan of %zd destinations%s>",
                              self->count, self->plan ? "" : " (closed)");
}

static PyMethodDef plan_methods[] = {
    {"update", PYUSMIPC_CMETHOD(plan_update), METH_FASTCALL | METH_KEYWORDS,
     "update(data, stream=None, ordered=True, release=True)\n--\n\nCopies "
     "the handoff into the destinations (usmipc_bundle_update)."},
    {"close", plan_close, METH_NOARGS,
     "close()\n--\n\nFrees the plan and its mappings."},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot plan_slots[] = {
    {Py_tp_doc, (void *)"A copy plan of the C library (usmipc.UpdatePlan "
                        "makes and uses it)."},
    {Py_tp_dealloc, plan_dealloc},
    {Py_tp_traverse, plan_traverse},
    {Py_tp_clear, plan_clear},
    {Py_tp_repr, plan_repr},
    {Py_tp_methods, plan_methods},
    {0, NULL},
};

static PyType_Spec plan_spec = {
    .name = "usmipc._CopyPlan",
    .basicsize = sizeof(copy_plan_t),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC |
             Py_TPFLAGS_IMMUTABLETYPE | Py_TPFLAGS_DISALLOW_INSTANTIATION,
    .slots = plan_slots,
};

int pyusmipc_init_copy_plan_type(PyObject *module,
                                 pyusmipc_module_state_t *st) {
  st->CopyPlanType = PyType_FromModuleAndSpec(module, &plan_spec, NULL);
  return st->CopyPlanType == NULL ? -1 : 0;
}

/* ---- _bundle_paths --------------------------------------------------------
 */

PyObject *pyusmipc_bundle_paths(PyObject *module, PyObject *arg) {
  pyusmipc_module_state_t *st = PyModule_GetState(module);
  Py_buffer view;
  if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0) {
    PyErr_Clear();
    return pyusmipc_type_error("UpdatePlan.update(): data must be the bytes "
                               "of a handoff (SharedBundle.to_bytes() in the "
                               "producer)");
  }
  usmipc_opened_bundle_t *ob = NULL;
  int rc;
  Py_BEGIN_ALLOW_THREADS
  rc = usmipc_bundle_open(view.buf, (size_t)view.len, NULL, NULL,
                          USMIPC_OPEN_UNORDERED, &ob);
  Py_END_ALLOW_THREADS
  PyBuffer_Release(&view);
  if (rc != 0)
    return pyusmipc_raise(st, rc);
  size_t nnode;
  const usmipc_bundle_node_t *nodes = usmipc_opened_bundle_nodes(ob, &nnode);
  /* A preorder walk: for each open container, its path and the children
   * left; each child's label is its key (dicts) or its index. */
  struct frame {
    PyObject *path;
    uint32_t left, next, kind;
  } stack[USMIPC_BUNDLE_MAX_NDIM * 2 + 70];
  int depth = 0;
  PyObject *paths = PyList_New(0), *result = NULL;
  PyObject *root = PyTuple_New(0);
  if (paths == NULL || root == NULL)
    goto out;
  for (size_t i = 0; i < nnode; i++) {
    const usmipc_bundle_node_t *nd = &nodes[i];
    PyObject *path;
    if (depth == 0) {
      path = Py_NewRef(root);
    } else {
      struct frame *f = &stack[depth - 1];
      PyObject *label =
          f->kind == USMIPC_BUNDLE_DICT
              ? PyUnicode_DecodeUTF8(nd->key, (Py_ssize_t)nd->key_len, NULL)
              : PyLong_FromUnsignedLong(f->next);
      if (label == NULL)
        goto out;
      PyObject *one = PyTuple_Pack(1, label);
      Py_DECREF(label);
      path = one ? PySequence_Concat(f->path, one) : NULL;
      Py_XDECREF(one);
      if (path == NULL)
        goto out;
      f->next++;
      f->left--;
    }
    if (nd->kind == USMIPC_BUNDLE_ARRAY) {
      int r = PyList_Append(paths, path);
      Py_DECREF(path);
      if (r < 0)
        goto out;
    } else if (nd->count > 0) {
      if (depth == (int)(sizeof(stack) / sizeof(stack[0]))) {
        Py_DECREF(path);
        pyusmipc_value_error("_bundle_paths(): the tree is nested too deep");
        goto out;
      }
      stack[depth++] = (struct frame){path, nd->count, 0, nd->kind};
    } else {
      Py_DECREF(path);
    }
    while (depth > 0 && stack[depth - 1].left == 0)
      Py_DECREF(stack[--depth].path);
  }
  usmipc_device_t *dev = usmipc_opened_bundle_device(ob);
  PyObject *device = dev ? pyusmipc_device_object(st, dev) : Py_NewRef(Py_None);
  if (device != NULL) {
    result = PyTuple_Pack(2, paths, device);
    Py_DECREF(device);
  }
out:
  while (depth > 0)
    Py_DECREF(stack[--depth].path);
  Py_XDECREF(paths);
  Py_XDECREF(root);
  Py_BEGIN_ALLOW_THREADS
  usmipc_bundle_close(ob);
  Py_END_ALLOW_THREADS
  return result;
}
