/* Floor 1 of the extension usmipc._usmipc: torch's own C readers of a
 * tensor and of a storage, called directly.
 *
 * share() and usmipc.torch's reducers read a dozen attributes of every
 * tensor (dtype, shape, stride(), data_ptr(), the storage, ...). Read by
 * name (PyObject_GetAttr, PyObject_CallMethodObjArgs), each looked itself
 * up in the type and, for a method, built an argument array: as much again
 * as torch's own code behind them (the stable ABI of 3.11 has no vectorcall
 * to a descriptor). Here they are torch._C.TensorBase's (and StorageBase's)
 * descriptors, found once: a getset descriptor runs through its type's
 * descr_get; a method runs as the C function behind the descriptor, with
 * the calling convention its flags say (checked when found; another
 * convention, or another kind of descriptor, is read by name).
 *
 * What is read is then the tensor as torch's C code knows it, also where a
 * subclass or the instance rebinds a reader in Python (`data_ptr`,
 * `stride`): the truth about the memory, which is what travels. torch's
 * __torch_function__ overrides still run: its C readers dispatch to them.
 * Nothing is imported: a tensor means torch._C is in sys.modules already.
 */
#include "torch_readers.h"

typedef struct {
  const char *name;
  int storage;      /* a reader of a storage (StorageBase), not a tensor */
  PyObject *str;    /* the name, interned */
  PyObject *getter; /* the getset descriptor of an attribute, or NULL */
  void *fn;         /* the C function of a method, or NULL */
  int flags;        /* its calling convention */
} reader_t;

static reader_t readers[PYUSMIPC_TORCH_NREADERS] = {
    [PYUSMIPC_T_DTYPE] = {.name = "dtype"},
    [PYUSMIPC_T_SHAPE] = {.name = "shape"},
    [PYUSMIPC_T_IS_CUDA] = {.name = "is_cuda"},
    [PYUSMIPC_T_IS_CPU] = {.name = "is_cpu"},
    [PYUSMIPC_T_IS_NESTED] = {.name = "is_nested"},
    [PYUSMIPC_T_LAYOUT] = {.name = "layout"},
    [PYUSMIPC_T_REQUIRES_GRAD] = {.name = "requires_grad"},
    [PYUSMIPC_T_IS_LEAF] = {.name = "is_leaf"},
    [PYUSMIPC_T_BACKWARD_HOOKS] = {.name = "_backward_hooks"},
    [PYUSMIPC_T_NBYTES] = {.name = "nbytes"},
    [PYUSMIPC_T_STRIDE] = {.name = "stride"},
    [PYUSMIPC_T_DATA_PTR] = {.name = "data_ptr"},
    [PYUSMIPC_T_SIZE] = {.name = "size"},
    [PYUSMIPC_T_UNTYPED_STORAGE] = {.name = "untyped_storage"},
    [PYUSMIPC_T_GET_DEVICE] = {.name = "get_device"},
    [PYUSMIPC_T_STORAGE_OFFSET] = {.name = "storage_offset"},
    [PYUSMIPC_T_IS_CONTIGUOUS] = {.name = "is_contiguous"},
    [PYUSMIPC_S_DATA_PTR] = {.name = "data_ptr", .storage = 1},
    [PYUSMIPC_S_NBYTES] = {.name = "nbytes", .storage = 1},
    [PYUSMIPC_S_IS_CUDA] = {.name = "is_cuda", .storage = 1},
};

/* Whether reader r is a method (called without arguments), not an
 * attribute. */
static int is_method(int r) {
  return r >= PYUSMIPC_T_STRIDE && r != PYUSMIPC_S_IS_CUDA;
}

/* torch._C.TensorBase and StorageBase, once found; kept for the process's
 * life, as torch keeps them. */
static PyObject *bases[2];
static const char *const base_names[2] = {"TensorBase", "StorageBase"};
static descrgetfunc getset_get, method_get;
static PyObject *no_args; /* () */

static int names_ready(void) {
  if (no_args != NULL)
    return 0;
  for (int r = 0; r < PYUSMIPC_TORCH_NREADERS; r++)
    if (readers[r].str == NULL &&
        (readers[r].str = PyUnicode_InternFromString(readers[r].name)) == NULL)
      return -1;
  getset_get =
      (descrgetfunc)PyType_GetSlot(&PyGetSetDescr_Type, Py_tp_descr_get);
  method_get =
      (descrgetfunc)PyType_GetSlot(&PyMethodDescr_Type, Py_tp_descr_get);
  PyErr_Clear(); /* a slot that is not there: every reader by name */
  return (no_args = PyTuple_New(0)) == NULL ? -1 : 0;
}

/* Reader r's descriptor in base, checked, bound to instance for a method
 * (which gives its C function and flags); left by name if anything is not
 * as expected. */
static void find_reader(reader_t *x, int method, PyObject *base,
                        PyObject *instance) {
  PyObject *d = PyObject_GetAttr(base, x->str);
  if (d != NULL && !method && Py_IS_TYPE(d, &PyGetSetDescr_Type) &&
      getset_get != NULL) {
    x->getter = d; /* kept */
    return;
  }
  PyObject *bound =
      d != NULL && Py_IS_TYPE(d, &PyMethodDescr_Type) && method_get != NULL
          ? method_get(d, instance, (PyObject *)Py_TYPE(instance))
          : NULL;
  if (bound != NULL && PyCFunction_Check(bound)) {
    int flags = PyCFunction_GetFlags(bound);
    if (flags == METH_NOARGS || flags == (METH_VARARGS | METH_KEYWORDS)) {
      x->fn = (void *)PyCFunction_GetFunction(bound);
      x->flags = flags;
    }
  }
  Py_XDECREF(bound);
  Py_XDECREF(d);
  PyErr_Clear();
}

/* Finds torch._C's base class `which` (0 tensors, 1 storages) and its
 * readers, if obj is an instance of it; otherwise looks again next time
 * (obj may be a look-alike, or torch not imported yet). 0, or -1. */
static int find_base(int which, PyObject *obj) {
  if (names_ready() < 0)
    return -1;
  PyObject *name = PyUnicode_FromString("torch._C");
  if (name == NULL)
    return -1;
  PyObject *c = PyImport_GetModule(name); /* new reference, or NULL */
  Py_DECREF(name);
  PyObject *base =
      c != NULL ? PyObject_GetAttrString(c, base_names[which]) : NULL;
  Py_XDECREF(c);
  if (base == NULL || !PyType_Check(base) ||
      !PyObject_TypeCheck(obj, (PyTypeObject *)base)) {
    PyErr_Clear();
    Py_XDECREF(base);
    return 0;
  }
  for (int r = 0; r < PYUSMIPC_TORCH_NREADERS; r++)
    if (readers[r].storage == which)
      find_reader(&readers[r], is_method(r), base, obj);
  bases[which] = base;
  return 0;
}

/* The type last found to derive from bases[which]: the next object of it
 * needs no walk of its type's bases (a model's tensors are of one or two
 * types). Held, so that its address is not another type's later. */
static PyObject *known_type[2];

/* Whether t is an instance of bases[which] (found): 1 or 0. */
static int instance_of(PyObject *t, int which) {
  PyObject *type = (PyObject *)Py_TYPE(t);
  if (type == known_type[which])
    return 1;
  if (bases[which] == NULL ||
      !PyType_IsSubtype((PyTypeObject *)type, (PyTypeObject *)bases[which]))
    return 0;
  PyObject *old = known_type[which];
  known_type[which] = Py_NewRef(type);
  Py_XDECREF(old);
  return 1;
}

int pyusmipc_torch_is_tensor(PyObject *obj) {
  if (bases[0] == NULL && find_base(0, obj) < 0)
    return -1;
  return instance_of(obj, 0);
}

PyObject *pyusmipc_torch_read(PyObject *t, pyusmipc_torch_reader_t r) {
  reader_t *x = &readers[r];
  PyObject *base = bases[x->storage];
  if (base == NULL) {
    if (find_base(x->storage, t) < 0)
      return NULL;
    base = bases[x->storage];
  }
  if (base != NULL && (x->getter != NULL || x->fn != NULL) &&
      instance_of(t, x->storage)) {
    if (x->getter != NULL)
      return getset_get(x->getter, t, (PyObject *)Py_TYPE(t));
    if (x->flags == METH_NOARGS)
      return ((PyCFunction)x->fn)(t, NULL);
    return ((PyCFunctionWithKeywords)x->fn)(t, no_args, NULL);
  }
  if (x->str == NULL && names_ready() < 0)
    return NULL;
  return is_method(r) ? PyObject_CallMethodObjArgs(t, x->str, NULL)
                      : PyObject_GetAttr(t, x->str);
}

int pyusmipc_torch_true(PyObject *t, pyusmipc_torch_reader_t r) {
  PyObject *v = pyusmipc_torch_read(t, r);
  if (v == NULL)
    return -1;
  int truth = PyObject_IsTrue(v);
  Py_DECREF(v);
  return truth;
}

PyObject *pyusmipc_torch_reader_name(pyusmipc_torch_reader_t r) {
  if (readers[r].str == NULL && names_ready() < 0)
    return NULL;
  return readers[r].str;
}
