/* Floor 7 of the extension: bundles from Python, the consumer's side:
 * usmipc.open_shared(bytes, or the SharedBundle itself) -> the tree the
 * producer shared (bundle.c), each array a SharedArray mapped without a
 * copy (or, to='torch', a torch tensor), and close_shared(tree) /
 * release_shared(tree) after it. Calls bundle.c, interop.c, queue.c,
 * device.c and util.c (module.c lists the floors). Its length serves that
 * one concern: the arrays one open makes and the ready and ticket records
 * they share, which live and die together.
 *
 * Ordering: open_shared waits for the producer's work on the host, or on
 * stream= on the device. A leaf opened on a stream makes any other stream a
 * consumer names in __dlpack__(stream=...) wait for that stream first.
 *
 * A SharedArray holds one open reference to its mapping; close() (or
 * close_shared(tree), or collection) drops it, deferred while a DLPack
 * tensor or a buffer view of it is alive, as for memory objects.
 *
 * Release tickets (share(..., release=True)): the consumer returns the
 * ticket with release_shared(tree, stream) after its work, or from the host
 * when the last array of the open is closed or collected. */
#include "shared_array.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "bundle.h"
#include "device.h"
#include "dlpack.h"
#include "interop.h"
#include "memory.h"
#include "queue.h"
#include "util.h"

typedef pyusmipc_dtype_t dtype_entry_t;
typedef pyusmipc_bundle_object_t Bundle;

/* ---- SharedArray --------------------------------------------------------- */

/* What the arrays of one open share: where they are ready. The event is
 * recorded on the open's stream when another stream first asks for an
 * array (__dlpack__(stream=...)), not at the open: a consumer that uses
 * only the open's stream queues no work for it, and work queued from
 * several processes on one GPU makes it switch between their contexts
 * (8 consumers synchronizing their streams after one handoff each took
 * 0.8 ms, a lone one 0.01, H100 run 59). Recorded later, it covers what
 * the open queued and what came after on that stream: more, never less. */
#define READY_SYNCED_MAX 8
typedef struct ready {
  Py_ssize_t refs;                /* arrays and capsules; GIL held */
  void *synced[READY_SYNCED_MAX]; /* native streams made to wait already */
  int nsynced;
  int no_events;         /* the backend has none: the open waited on the host */
  usmipc_event_t *event; /* recorded on the open's stream once asked, or NULL */
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
  /* open_shared(release_stream=): called when the last array closes or
   * dies, for the stream whose work the ticket's event covers (None: from
   * the host). usmipc.torch passes torch.cuda.current_stream, so that a
   * tensor dropped while a kernel still reads it keeps the producer's
   * memory until that kernel is done. */
  PyObject *release_stream;
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
/* sys.is_finalizing() (Py_IsFinalizing is not in the stable ABI before
 * 3.13): no stream is asked for while the interpreter tears down. */
static int interpreter_finalizing(void) {
  PyObject *f = PySys_GetObject("is_finalizing"); /* borrowed */
  PyObject *r = f ? PyObject_CallNoArgs(f) : NULL;
  int yes = r == NULL || PyObject_IsTrue(r) != 0;
  Py_XDECREF(r);
  if (r == NULL)
    PyErr_Clear();
  return yes;
}

static int ticket_close(ticket_t *t, int quiet) {
  if (t == NULL || --t->open > 0)
    return 0;
  PyObject *stream = NULL;
  if (t->release_stream != NULL && !t->returned && !interpreter_finalizing()) {
    /* Held across the call: it may drop what holds the ticket. */
    t->refs++;
    stream = PyObject_CallNoArgs(t->release_stream);
    if (stream == NULL) {
      /* The ticket still goes back (from the host): a producer must not
       * wait forever because the consumer's stream could not be found. */
      if (quiet)
        PyErr_WriteUnraisable(t->release_stream);
      else
        PyErr_Clear();
    }
    int rc = ticket_return(t, stream, "release_stream()", quiet);
    if (rc < 0 && stream != NULL && stream != Py_None) {
      /* Not a stream usmipc can order: from the host instead. */
      if (quiet)
        PyErr_WriteUnraisable(t->release_stream);
      else
        PyErr_Clear();
      rc = ticket_return(t, NULL, "close()", quiet);
    }
    Py_XDECREF(stream);
    ticket_put(t);
    return rc;
  }
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
  Py_XDECREF(t->release_stream);
  free(t);
}

typedef struct {
  PyObject_HEAD void *ptr;
  size_t extent;
  uint8_t code, bits;
  int ndim;
  int64_t *dims; /* shape then strides (elements): small_dims up to 4-D */
  int64_t small_dims[8];
  PyObject *device;
  ready_t *ready;
  ticket_t *ticket;   /* the open's release ticket, or NULL */
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
    return pyusmipc_raise(pyusmipc_state_from_device(self->device), rc) ? 0
                                                                        : -1;
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
  return PyUnicode_FromString(
      pyusmipc_dtype_by_code(self->code, self->bits)->name);
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
  return self->device ? usmipc_device_backend(
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
  const dtype_entry_t *dt = pyusmipc_dtype_by_code(self->code, self->bits);
  if (arr_backend(self) != USMIPC_BACKEND_CUDA || dt->typestr == NULL) {
    PyErr_Format(PyExc_AttributeError, "__cuda_array_interface__: %s",
                 dt->typestr == NULL ? "bfloat16 has no typestr; use DLPack"
                                     : "not CUDA memory");
    return NULL;
  }
  if (check_open(self) < 0)
    return NULL;
  PyObject *shape = arr_get_shape(op, NULL);
  PyObject *strides =
      arr_contiguous(self) ? Py_NewRef(Py_None) : arr_get_strides(op, NULL);
  PyObject *r = NULL;
  if (shape && strides)
    r = Py_BuildValue("{s:N,s:s#,s:(N,O),s:N,s:i,s:O}", "shape", shape,
                      "typestr", "<", 1, "data", PyLong_FromVoidPtr(self->ptr),
                      Py_False, "strides", strides, "version", 3, "stream",
                      Py_None);
  else {
    Py_XDECREF(shape);
    Py_XDECREF(strides);
    return NULL;
  }
  /* typestr: byte order then the code ("<f4", "|b1"). */
  if (r != NULL) {
    PyObject *ts =
        PyUnicode_FromFormat("%s%s", self->bits == 8 ? "|" : "<", dt->typestr);
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

/* Records r's event on the open's stream, once (see ready_t): 0 with
 * r->event set, or r->no_events for a backend without events; -1 with an
 * exception set. Drops the GIL for the driver: another thread of the same
 * open may record meanwhile, and then its event is kept. */
static int ready_record(pyusmipc_module_state_t *st, ready_t *r) {
  if (r->event != NULL || r->no_events)
    return 0;
  usmipc_event_t *made = NULL;
  usmipc_queue_t *q = r->queue;
  int rc = 0;
  Py_BEGIN_ALLOW_THREADS
  if (usmipc_event_create(usmipc_queue_device(q), 0, &made) == 0 &&
      (rc = usmipc_event_record(made, q)) != 0) {
    usmipc_event_destroy(made);
    made = NULL;
  }
  Py_END_ALLOW_THREADS
  if (rc != 0) {
    pyusmipc_raise(st, rc);
    return -1;
  }
  if (made == NULL) {
    r->no_events = 1;
  } else if (r->event == NULL) {
    r->event = made;
  } else {
    Py_BEGIN_ALLOW_THREADS
    usmipc_event_destroy(made);
    Py_END_ALLOW_THREADS
  }
  return 0;
}

/* Makes the consumer's stream wait for the stream the bundle was opened on
 * (DLPack's rule: the producer orders the consumer's stream). */
static int arr_dlpack_sync(Arr *self, PyObject *stream) {
  ready_t *r = self->ready;
  if (r == NULL || r->no_events || stream == NULL || stream == Py_None)
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
    if (ready_record(st, r) < 0) {
      Py_DECREF(q);
      return -1;
    }
    if (r->no_events) { /* a backend without events: the open waited */
      Py_DECREF(q);
      return 0;
    }
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
    PyObject *tt = PyTuple_Check(a[2]) && PyTuple_Size(a[2]) == 2 ? a[2] : NULL;
    if (tt == NULL || (t = PyLong_AsLong(PyTuple_GetItem(tt, 0))) == -1 ||
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
  const dtype_entry_t *dt = pyusmipc_dtype_by_code(self->code, self->bits);
  if (arr_backend(self) != USMIPC_BACKEND_HOST || dt->format == NULL) {
    PyErr_Format(PyExc_BufferError, "%s; use __dlpack__",
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
      pyusmipc_dtype_by_code(self->code, self->bits)->name, shape,
      self->closed || self->released ? " closed" : "");
  Py_DECREF(shape);
  return r;
}

static void arr_dealloc(PyObject *op) {
  Arr *self = (Arr *)op;
  if (arr_release(self) < 0)
    PyErr_WriteUnraisable(op);
  /* Collected unclosed: the producer still learns of it (best effort;
   * nothing can be reported from here). */
  if (!self->closed)
    (void)ticket_close(self->ticket, 1);
  ticket_put(self->ticket);
  ready_put(self->ready);
  if (self->dims != self->small_dims)
    free(self->dims);
  Py_CLEAR(self->device);
  pyusmipc_object_free(op);
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

/* A SharedArray is a view of a mapping that this process opened: pickled
 * on its own it would mean nothing elsewhere (and copying its bytes would
 * hide that). Send what opens it instead. */
static PyObject *arr_reduce(PyObject *op, PyObject *Py_UNUSED(ignored)) {
  (void)op;
  return pyusmipc_type_error(
      "a SharedArray is not pickled on its own: it is a view of a mapping "
      "this process opened; send the bundle's bytes (SharedBundle.to_bytes(), "
      "or the SharedBundle itself) and open them with usmipc.open_shared() "
      "there, or copy the data (numpy.array(leaf) on host memory)");
}

static PyMethodDef arr_methods[] = {
    {"__reduce__", arr_reduce, METH_NOARGS, NULL},
    {"__reduce_ex__", (PyCFunction)(void (*)(void))arr_reduce, METH_O, NULL},
    {"tobytes", arr_tobytes, METH_NOARGS,
     "tobytes()\n--\n\nA host copy of the bytes the array spans (for a "
     "C-contiguous array, its elements in order)."},
    {"close", arr_close, METH_NOARGS,
     "close()\n--\n\nDrops this array's mapping (deferred while a DLPack "
     "tensor or a buffer view of it lives). Idempotent. Closing the last "
     "array of an open returns its release ticket, if the producer asked "
     "for one and it was not returned yet, from the host."},
    {"__dlpack__", PYUSMIPC_CMETHOD(arr_dlpack), METH_FASTCALL | METH_KEYWORDS,
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
    {"ptr", arr_get_ptr, NULL, "The address of the first element here.", NULL},
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
    /* Not tracked by the cycle collector: an array refers to its Device
     * and to C state only, and neither takes attributes, so the collector
     * could never find a cycle through it (its traverse visited the
     * Device alone); an open of 4,719 leaves made as many tracked objects
     * and so about seven young-generation collections. */
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE |
             Py_TPFLAGS_DISALLOW_INSTANTIATION,
    .slots = arr_slots,
};

/* ---- open_shared / close_shared ------------------------------------------ */

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
  Arr *self =
      (Arr *)pyusmipc_object_alloc((PyTypeObject *)b->st->SharedArrayType);
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
  self->dims = a->desc.ndim <= 4
                   ? self->small_dims
                   : malloc(sizeof(int64_t) * 2 * (size_t)(a->desc.ndim + 1));
  if (self->dims == NULL) {
    self->released = 1; /* the caller still owns the reference */
    Py_DECREF(self);
    return PyErr_NoMemory();
  }
  memcpy(self->dims, a->desc.shape, sizeof(int64_t) * (size_t)a->desc.ndim);
  memcpy(self->dims + a->desc.ndim, a->desc.strides,
         sizeof(int64_t) * (size_t)a->desc.ndim);
  return (PyObject *)self;
}

/* The dict keys of the last opens, by node index: an engine opens the same
 * tree every step, and a key made again each time (decoded, then hashed
 * by the dict) was a fifth of a warm open of a 338-leaf bundle. A cached
 * key is used only when its bytes are the node's; a different tree
 * replaces the entries it differs in. At most KEY_CACHE_MAX nodes; the GIL
 * guards it. */
enum { KEY_CACHE_MAX = 1 << 16 };
static PyObject **key_cache;
static size_t key_cache_len;

static PyObject *node_key(size_t at, const usmipc_bundle_node_t *n) {
  Py_ssize_t len = (Py_ssize_t)n->key_len;
  if (at < key_cache_len && key_cache[at] != NULL) {
    Py_ssize_t have;
    const char *u = PyUnicode_AsUTF8AndSize(key_cache[at], &have);
    if (u != NULL && have == len && memcmp(u, n->key, (size_t)len) == 0)
      return Py_NewRef(key_cache[at]);
    PyErr_Clear();
  }
  PyObject *k = PyUnicode_DecodeUTF8(n->key, len, "strict");
  if (k == NULL || at >= KEY_CACHE_MAX)
    return k;
  if (at >= key_cache_len) {
    size_t cap = key_cache_len ? key_cache_len : 256;
    while (cap <= at)
      cap *= 2;
    if (cap > KEY_CACHE_MAX)
      cap = KEY_CACHE_MAX;
    PyObject **grown = realloc(key_cache, cap * sizeof(*grown));
    if (grown == NULL)
      return k; /* uncached, still right */
    memset(grown + key_cache_len, 0, (cap - key_cache_len) * sizeof(*grown));
    key_cache = grown;
    key_cache_len = cap;
  }
  PyObject *old = key_cache[at];
  key_cache[at] = Py_NewRef(k);
  Py_XDECREF(old);
  return k;
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
    PyObject *tensor = PyObject_CallFunctionObjArgs(b->convert, capsule, NULL);
    Py_DECREF(capsule);
    return tensor;
  }
  PyObject *c = n->kind == USMIPC_BUNDLE_DICT   ? PyDict_New()
                : n->kind == USMIPC_BUNDLE_LIST ? PyList_New(n->count)
                                                : PyTuple_New(n->count);
  if (c == NULL)
    return NULL;
  for (uint32_t i = 0; i < n->count; i++) {
    size_t child_at = b->next;
    const usmipc_bundle_node_t *child = &b->nodes[child_at];
    PyObject *v = build_node(b);
    if (v == NULL) {
      Py_DECREF(c);
      return NULL;
    }
    if (n->kind == USMIPC_BUNDLE_DICT) {
      PyObject *k = node_key(child_at, child);
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

/* torch.from_dlpack's own converter, torch._C._from_dlpack, after torch's
 * CUDA is initialized (its Python wrapper does that through
 * current_stream(); the converter alone does not). Looked up once per
 * process: torch.cuda.is_available() and init() from here cost 2-3 us an
 * open (an H100's profile of usmipc.torch's receiver), and a forked child
 * looks it up again (torch's own check of a bad fork then speaks). New
 * reference; NULL with an exception set. */
static PyObject *torch_converter(pyusmipc_module_state_t *st) {
  long pid = (long)getpid();
  if (st->torch_from_dlpack != NULL && st->torch_from_dlpack_pid == pid)
    return Py_NewRef(st->torch_from_dlpack);
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
  PyObject *torch_c =
      has_cuda >= 0 ? PyObject_GetAttrString(torch, "_C") : NULL;
  Py_XDECREF(torch);
  PyObject *convert =
      torch_c ? PyObject_GetAttrString(torch_c, "_from_dlpack") : NULL;
  Py_XDECREF(torch_c);
  if (convert != NULL) {
    Py_XDECREF(st->torch_from_dlpack);
    st->torch_from_dlpack = Py_NewRef(convert);
    st->torch_from_dlpack_pid = pid;
  }
  return convert;
}

PyObject *pyusmipc_open_shared(PyObject *module, PyObject *const *args,
                               Py_ssize_t nargs, PyObject *kwnames) {
  static const char *const names[] = {"data", "device", "stream", "to",
                                      "release_stream"};
  PyObject *a[5];
  if (pyusmipc_parse_fastcall("open_shared", args, nargs, kwnames, names, 5, 1,
                              a) < 0)
    return NULL;
  pyusmipc_module_state_t *st = PyModule_GetState(module);
  PyObject *release_stream = a[4] == Py_None ? NULL : a[4];
  if (release_stream != NULL && !PyCallable_Check(release_stream)) {
    pyusmipc_type_error("open_shared(release_stream=...): a function of no "
                        "arguments that returns the stream (or None) whose "
                        "work the release ticket waits for, e.g. "
                        "torch.cuda.current_stream");
    return NULL;
  }
  PyObject *convert = NULL;
  if (a[3] != NULL && a[3] != Py_None) {
    if (!PyUnicode_Check(a[3]) ||
        PyUnicode_CompareWithASCIIString(a[3], "torch") != 0) {
      pyusmipc_value_error("open_shared(to=...): None (SharedArray leaves) or "
                           "'torch' (torch tensors)");
      return NULL;
    }
    convert = torch_converter(st);
    if (convert == NULL)
      return NULL;
  }
  if (a[0] == NULL) {
    pyusmipc_type_error("open_shared() missing argument 'data'");
    return NULL;
  }
  PyObject *bytes;
  if (PyObject_TypeCheck(a[0], (PyTypeObject *)st->SharedBundleType)) {
    bytes = pyusmipc_bundle_to_bytes(a[0], NULL);
  } else if (PyBytes_Check(a[0])) {
    bytes = Py_NewRef(a[0]);
  } else if (PyObject_CheckBuffer(a[0])) {
    bytes = PyBytes_FromObject(a[0]); /* bytearray, memoryview, ... */
  } else {
    /* PyBytes_FromObject would take a list of ints as bytes. */
    PyObject *tn = pyusmipc_type_name(a[0]);
    if (tn != NULL)
      pyusmipc_type_error("open_shared(): data is the bytes of "
                          "SharedBundle.to_bytes() (bytes, bytearray, "
                          "memoryview) or a SharedBundle, not a %U",
                          tn);
    Py_XDECREF(tn);
    bytes = NULL;
  }
  if (bytes == NULL) {
    Py_XDECREF(convert);
    return NULL;
  }
  if (PyBytes_Size(bytes) >= 8 &&
      memcmp(PyBytes_AsString(bytes), "\x89USMIPC\n", 8) == 0) {
    Py_DECREF(bytes);
    Py_XDECREF(convert);
    return pyusmipc_raise_msg(st, USMIPC_EBADHANDLE,
                              "open_shared(): these are the bytes of one IPC "
                              "handle (IPCMemoryHandle.to_bytes()), not of a "
                              "bundle: open them with IPCMemoryHandle.open("
                              "data, device)");
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
  if (queue != NULL && convert == NULL) {
    /* Ready on the open's stream: other streams wait for it (__dlpack__).
     * Not for to="torch": its arrays are reached only through torch's
     * tensors, which never call __dlpack__ back, and torch's rule holds
     * (ready on the stream current at the receive, the open's): an event
     * made, recorded and destroyed an open for nothing. */
    b.ready = calloc(1, sizeof(*b.ready));
    if (b.ready == NULL) {
      PyErr_NoMemory();
      goto done;
    }
    b.ready->refs = 1;
    b.ready->queue = q;
    b.ready->queue_obj = Py_NewRef(queue);
    b.ready->event = NULL; /* recorded when another stream asks */
    /* A stream given as a bare handle has no object here keeping it: the
     * caller may destroy it before another stream asks, so its record is
     * made now (the legacy and per-thread default streams, 0-2, live
     * for ever). */
    if (PyLong_Check(a[2]) && PyLong_AsUnsignedLongLongMask(a[2]) > 2 &&
        ready_record(st, b.ready) < 0)
      goto done;
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
    b.ticket->release_stream = Py_XNewRef(release_stream);
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
  PyObject *tn = pyusmipc_type_name(obj);
  if (tn != NULL)
    pyusmipc_type_error("%s: %s %U is not a shared array (pass what "
                        "open_shared() returned%s)",
                        what, pyusmipc_article(tn), tn, hint);
  Py_XDECREF(tn);
  return -1;
}

/* close_shared(): the tree's arrays closed, their mappings released in
 * one call without the GIL instead of one GIL hand-over per array (taking
 * and dropping the GIL was 14% of a warm open and close of a 338-leaf
 * bundle, the closes themselves 3%). Then the arrays' tickets, in order:
 * a ticket goes back only after the mappings of its arrays are closed, as
 * arr_close does it. */
typedef struct {
  void **ptrs;     /* mappings to close */
  PyObject **arrs; /* arrays closed here first, with a reference each */
  size_t nptr, narr, cap;
} close_batch_t;

static int close_leaf(void *ctx, PyObject *array) {
  close_batch_t *c = ctx;
  Arr *self = (Arr *)array;
  if (c->narr == c->cap) {
    size_t cap = c->cap ? 2 * c->cap : 64;
    void **p = realloc(c->ptrs, cap * sizeof(*p));
    if (p != NULL)
      c->ptrs = p;
    PyObject **a = p ? realloc(c->arrs, cap * sizeof(*a)) : NULL;
    if (a == NULL) {
      PyErr_NoMemory();
      return -1;
    }
    c->arrs = a;
    c->cap = cap;
  }
  if (self->exports == 0 && !self->released) {
    self->released = 1; /* as arr_release */
    if (self->ptr != NULL)
      c->ptrs[c->nptr++] = self->ptr;
  }
  if (!self->closed) {
    self->closed = 1;
    c->arrs[c->narr++] = Py_NewRef(array);
  }
  return 0;
}

static int close_tree(pyusmipc_module_state_t *st, PyObject *obj) {
  close_batch_t c = {0};
  /* A tree refused part way (a leaf that is not an array) still closes
   * what came before it, as before. */
  int rc = walk_tree(st, obj, close_leaf, &c, "close_shared()", "", 0);
  int first = 0;
  if (c.nptr > 0) {
    Py_BEGIN_ALLOW_THREADS
    for (size_t i = 0; i < c.nptr; i++) {
      int r = usmipc_ipc_close(c.ptrs[i]);
      if (r != 0 && first == 0)
        first = r;
    }
    Py_END_ALLOW_THREADS
  }
  if (first != 0 && rc == 0) {
    pyusmipc_raise(st, first);
    rc = -1;
  }
  for (size_t i = 0; i < c.narr; i++) {
    Arr *a = (Arr *)c.arrs[i];
    if (rc == 0) {
      if (ticket_close(a->ticket, 0) < 0)
        rc = -1;
    } else {
      /* The error stands; the other tickets still go back (quietly), or
       * their producers would wait for them for ever. */
      PyObject *et, *ev, *tb;
      PyErr_Fetch(&et, &ev, &tb);
      (void)ticket_close(a->ticket, 1);
      PyErr_Restore(et, ev, tb);
    }
    Py_DECREF(c.arrs[i]);
  }
  free(c.ptrs);
  free(c.arrs);
  return rc;
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

PyObject *pyusmipc_release_shared(PyObject *module, PyObject *const *args,
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
      pyusmipc_value_error(
          "release_shared(): this SharedBundle is the "
          "producer's own (from share()), which hands tickets "
          "out; a consumer passes what open_shared() returned, "
          "or the bytes it opened");
      return NULL;
    }
    rc = release_bytes(st, ((Bundle *)obj)->bytes, a[1]);
  } else if (PyBytes_Check(obj) || PyObject_CheckBuffer(obj)) {
    PyObject *bytes =
        PyBytes_Check(obj) ? Py_NewRef(obj) : PyBytes_FromObject(obj);
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

/* forward_shared(data): the bytes that hand what this process opened on to
 * one more consumer (usmipc_ipc_forward): data is the bytes it opened, a
 * consumer's SharedBundle of them, or one of its SharedArrays. */
/* _return_tickets_at_exit() -> int: the tickets of every open (and mapping
 * of IPCMemoryHandle.open) this process still holds, returned now (after the
 * work on each open's release_stream, else from the host), as the process ends.
 * An open whose arrays are still alive when the interpreter exits never closes
 * them: a tensor a spawned Process got as its argument lives as long as
 * multiprocessing's Process object, to the very end, and its producer kept
 * the memory until it exited itself. usmipc registers this with atexit and
 * multiprocessing's finalizers (python/usmipc/__init__.py). The arrays stay
 * mapped; their memory may be reused by the producer from now on, so
 * nothing of this process may use them after it (at exit, nothing should).
 * The count returned, for tests. */
PyObject *pyusmipc_return_tickets_at_exit(PyObject *module,
                                          PyObject *Py_UNUSED(ignored)) {
  pyusmipc_module_state_t *st = PyModule_GetState(module);
  /* Mappings of IPCMemoryHandle.open first (memory.c), from the host. */
  long n = pyusmipc_mapping_tickets_return_all(st);
  for (;;) {
    /* From the head each time: a release_stream call may close other
     * opens and unlink them. Each pass returns one, so this ends. */
    ticket_t *t = tickets_of_opens;
    while (t != NULL && t->returned)
      t = t->next;
    if (t == NULL)
      break;
    t->refs++;
    t->open = 1; /* ticket_close: this is the last close */
    (void)ticket_close(t, 1);
    t->returned = 1; /* even where sending failed: once */
    ticket_put(t);
    n++;
  }
  return PyLong_FromLong(n);
}

PyObject *pyusmipc_forward_shared(PyObject *module, PyObject *obj) {
  pyusmipc_module_state_t *st = PyModule_GetState(module);
  PyObject *bytes;
  if (PyObject_TypeCheck(obj, (PyTypeObject *)st->SharedArrayType)) {
    ticket_t *t = ((Arr *)obj)->ticket;
    if (t == NULL) {
      pyusmipc_value_error(
          "forward_shared(): this array's bundle carries no release ticket "
          "(its producer shared it without release=True): its bytes can be "
          "sent on as they are");
      return NULL;
    }
    bytes = Py_NewRef(t->bytes);
  } else if (PyObject_TypeCheck(obj, (PyTypeObject *)st->SharedBundleType)) {
    if (((Bundle *)obj)->bundle != NULL) {
      pyusmipc_value_error(
          "forward_shared(): this SharedBundle is the producer's own (from "
          "share()): share it again for one more consumer; a consumer "
          "passes what it opened");
      return NULL;
    }
    bytes = Py_NewRef(((Bundle *)obj)->bytes);
  } else if (PyBytes_Check(obj) || PyObject_CheckBuffer(obj)) {
    bytes = PyBytes_Check(obj) ? Py_NewRef(obj) : PyBytes_FromObject(obj);
    if (bytes == NULL)
      return NULL;
  } else {
    PyObject *tn = pyusmipc_type_name(obj);
    if (tn != NULL)
      pyusmipc_type_error("forward_shared() takes the bytes open_shared() "
                          "opened, or a SharedArray it returned, not %s %U",
                          pyusmipc_article(tn), tn);
    Py_XDECREF(tn);
    return NULL;
  }
  Py_ssize_t len = PyBytes_Size(bytes);
  PyObject *out = PyBytes_FromStringAndSize(NULL, len);
  if (out == NULL) {
    Py_DECREF(bytes);
    return NULL;
  }
  int rc;
  const char *data = PyBytes_AsString(bytes);
  char *dst = PyBytes_AsString(out);
  Py_BEGIN_ALLOW_THREADS
  rc = usmipc_ipc_forward(data, (size_t)len, dst);
  Py_END_ALLOW_THREADS
  Py_DECREF(bytes);
  if (rc != 0) {
    Py_DECREF(out);
    pyusmipc_raise(st, rc);
    return NULL;
  }
  return out;
}

PyObject *pyusmipc_close_shared(PyObject *module, PyObject *const *args,
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

int pyusmipc_init_shared_array_type(PyObject *module,
                                    pyusmipc_module_state_t *st) {
  st->SharedArrayType = PyType_FromModuleAndSpec(module, &arr_spec, NULL);
  if (st->SharedArrayType == NULL ||
      PyModule_AddObjectRef(module, "SharedArray", st->SharedArrayType) < 0)
    return -1;
  return 0;
}
