/* Floor 4 of the extension: usmipc.Event and usmipc.IPCEventHandle,
 * ordering device work across queues and processes (include/usmipc.h,
 * "events"). Calls queue.c, handle_bytes.c, device.c and util.c (module.c
 * lists the floors).
 *
 * An Event is created on a device and recorded on a queue (record), or
 * opened from another process's handle (IPCEventHandle.open), which gives an
 * Event that only waits: for the record the handle names. wait(stream)
 * makes later work on a stream wait on the device; synchronize() (and
 * wait() without a stream) make the host wait, without the GIL, for at
 * most set_event_timeout(); Ctrl-C ends the wait with KeyboardInterrupt
 * through the interrupt hook of module.c.
 *
 * IPCEventHandle mirrors IPCMemoryHandle: IPCEventHandle(event) holds the
 * event (importers are refused once it is destroyed) and the library's
 * handle; its bytes name the event's latest record when the handle was
 * made (a later record is waited for instead: usmipc_event_wait's rule for
 * events recorded again), travel by any channel or by pickle, and
 * IPCEventHandle.open() turns them into an Event in another process. A
 * re-open of an event already open in this process is a lookup in the
 * library's import cache.
 */
#include "event.h"

#include <limits.h>
#include <math.h>
#include <string.h>

#include "device.h"
#include "handle_bytes.h"
#include "queue.h"
#include "util.h"

typedef pyusmipc_event_object_t Event;

typedef struct event_handle_object {
  PyObject_HEAD PyObject *event; /* the exported Event, or NULL */
  PyObject *data;                /* bytes: the serialized handle */
  usmipc_ipc_handle_t *handle;   /* the library's handle, or NULL */
  usmipc_ipc_handle_info_t info;
} EventHandle;

static pyusmipc_module_state_t *event_state(PyObject *self) {
  /* Both types are final and made by this module. */
  return (pyusmipc_module_state_t *)PyType_GetModuleState(Py_TYPE(self));
}

/* Raises unless the Event is usable (dealloc-time clearing aside). */
static int event_check(Event *self) {
  if (self->event == NULL || self->device == NULL) {
    pyusmipc_value_error("event is not initialized");
    return -1;
  }
  return 0;
}

/* A new Event object around event on device_obj (steals event: destroyed
 * on failure). */
static PyObject *event_wrap(pyusmipc_module_state_t *st, PyObject *device_obj,
                            usmipc_event_t *event, int opened) {
  if (st->EventType == NULL) {
    usmipc_event_destroy(event);
    return pyusmipc_state_cleared();
  }
  Event *self = (Event *)pyusmipc_object_alloc(st->EventType);
  if (self == NULL) {
    usmipc_event_destroy(event);
    return NULL;
  }
  self->event = event;
  self->device = Py_NewRef(device_obj);
  self->opened = (char)opened;
  return (PyObject *)self;
}

/* ---- Event --------------------------------------------------------------- */

static PyObject *event_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
  static char *kwlist[] = {"device", NULL};
  PyObject *arg = NULL;
  if (!PyArg_ParseTupleAndKeywords(args, kwds, "|O:Event", kwlist, &arg)) {
    pyusmipc_retype_parse_error();
    return NULL;
  }
  pyusmipc_module_state_t *st = pyusmipc_state_from_type(type);
  if (st == NULL) {
    return NULL;
  }
  PyObject *device_obj = pyusmipc_device_from_arg(st, arg);
  if (device_obj == NULL) {
    return NULL;
  }
  usmipc_device_t *device = ((pyusmipc_device_object_t *)device_obj)->device;
  usmipc_event_t *event = NULL;
  int rc;
  Py_BEGIN_ALLOW_THREADS
  rc = usmipc_event_create(device, 0, &event);
  Py_END_ALLOW_THREADS
  if (rc < 0) {
    Py_DECREF(device_obj);
    return pyusmipc_raise(st, rc);
  }
  PyObject *self = event_wrap(st, device_obj, event, 0);
  Py_DECREF(device_obj);
  return self;
}

static int event_traverse(PyObject *op, visitproc visit, void *arg) {
  Py_VISIT(Py_TYPE(op));
  Py_VISIT(((Event *)op)->device);
  return 0;
}

static int event_clear(PyObject *op) {
  Py_CLEAR(((Event *)op)->device);
  return 0;
}

static void event_dealloc(PyObject *op) {
  Event *self = (Event *)op;
  PyObject_GC_UnTrack(op);
  PYUSMIPC_DESTROY_WITHOUT_GIL(usmipc_event_t, self->event,
                               usmipc_event_destroy);
  event_clear(op);
  pyusmipc_object_free(op);
}

/* Runs op (usmipc_event_record or usmipc_event_wait) on the event and the
 * queue of a stream= argument (None: the default queue of the event's
 * device), the GIL released; what names the caller in messages. None, or
 * NULL with an exception set. */
static PyObject *event_on_stream(pyusmipc_module_state_t *st, Event *self,
                                 PyObject *stream, const char *what,
                                 int (*op)(usmipc_event_t *,
                                           usmipc_queue_t *)) {
  PyObject *queue_obj =
      stream == NULL || stream == Py_None
          ? pyusmipc_default_queue(st, self->device)
          : pyusmipc_queue_from_stream(st, stream, NULL, self->device, what);
  if (queue_obj == NULL) {
    return NULL;
  }
  usmipc_queue_t *queue = ((pyusmipc_queue_object_t *)queue_obj)->queue;
  usmipc_event_t *event = self->event;
  int rc;
  Py_BEGIN_ALLOW_THREADS
  rc = op(event, queue);
  Py_END_ALLOW_THREADS
  Py_DECREF(queue_obj);
  if (rc < 0) {
    return pyusmipc_raise(st, rc);
  }
  Py_RETURN_NONE;
}

/* The argument of record(stream=None) and wait(stream=None), parsed into
 * *stream, and the event checked. 0 or -1. */
static int event_stream_arg(Event *self, const char *funcname,
                            PyObject *const *args, Py_ssize_t nargs,
                            PyObject *kwnames, PyObject **stream) {
  static const char *const names[] = {"stream"};
  if (pyusmipc_parse_fastcall(funcname, args, nargs, kwnames, names, 1, 1,
                              stream) < 0) {
    return -1;
  }
  return event_check(self);
}

static PyObject *event_record(PyObject *op, PyTypeObject *defining_class,
                              PyObject *const *args, Py_ssize_t nargs,
                              PyObject *kwnames) {
  PyObject *stream;
  Event *self = (Event *)op;
  pyusmipc_module_state_t *st = PyType_GetModuleState(defining_class);
  if (event_stream_arg(self, "record", args, nargs, kwnames, &stream) < 0) {
    return NULL;
  }
  if (self->opened) {
    return pyusmipc_raise_msg(
        st, USMIPC_EINVAL,
        "Event.record(): this Event was opened from an IPCEventHandle; it "
        "waits for the exporting process's record and cannot be recorded "
        "itself. Record an Event created in this process (usmipc.Event()) "
        "and send IPCEventHandle(event) instead");
  }
  return event_on_stream(st, self, stream, "Event.record()",
                         usmipc_event_record);
}

/* The host waits for the event (usmipc_event_synchronize) without the GIL.
 * A Ctrl-C meanwhile: the interrupt hook left KeyboardInterrupt pending and
 * the wait ended with USMIPC_EINTR, which pyusmipc_raise propagates. */
static PyObject *event_host_wait(pyusmipc_module_state_t *st, Event *self) {
  usmipc_event_t *event = self->event;
  int rc;
  Py_BEGIN_ALLOW_THREADS
  rc = usmipc_event_synchronize(event);
  Py_END_ALLOW_THREADS
  if (rc < 0) {
    return pyusmipc_raise(st, rc);
  }
  if (PyErr_Occurred()) {
    return NULL; /* a signal handler raised, yet the wait completed */
  }
  Py_RETURN_NONE;
}

static PyObject *event_wait(PyObject *op, PyTypeObject *defining_class,
                            PyObject *const *args, Py_ssize_t nargs,
                            PyObject *kwnames) {
  PyObject *stream;
  Event *self = (Event *)op;
  pyusmipc_module_state_t *st = PyType_GetModuleState(defining_class);
  if (event_stream_arg(self, "wait", args, nargs, kwnames, &stream) < 0) {
    return NULL;
  }
  if (stream == NULL || stream == Py_None) {
    return event_host_wait(st, self);
  }
  return event_on_stream(st, self, stream, "Event.wait()", usmipc_event_wait);
}

static PyObject *event_synchronize(PyObject *op, PyObject *Py_UNUSED(ignored)) {
  Event *self = (Event *)op;
  if (event_check(self) < 0) {
    return NULL;
  }
  return event_host_wait(event_state(op), self);
}

static PyObject *event_query(PyObject *op, PyObject *Py_UNUSED(ignored)) {
  Event *self = (Event *)op;
  if (event_check(self) < 0) {
    return NULL;
  }
  int rc = usmipc_event_query(self->event); /* never blocks */
  if (rc == 0) {
    Py_RETURN_TRUE;
  }
  if (rc == USMIPC_ENOTREADY) {
    Py_RETURN_FALSE;
  }
  return pyusmipc_raise(event_state(op), rc);
}

static PyObject *event_get_device(PyObject *op, void *closure) {
  (void)closure;
  PyObject *device = ((Event *)op)->device;
  return Py_NewRef(device ? device : Py_None);
}

static PyObject *event_get_is_opened(PyObject *op, void *closure) {
  (void)closure;
  return PyBool_FromLong(((Event *)op)->opened);
}

static PyObject *event_repr(PyObject *op) {
  Event *self = (Event *)op;
  if (self->device == NULL) {
    return PyUnicode_FromString("<usmipc.Event (cleared)>");
  }
  return PyUnicode_FromFormat(
      "<usmipc.Event %s on [%s] at %p>",
      self->opened ? "opened from a handle" : "created here",
      usmipc_device_filter_string(
          ((pyusmipc_device_object_t *)self->device)->device),
      (void *)self);
}

static PyObject *event_reduce(PyObject *op, PyObject *Py_UNUSED(ignored)) {
  (void)op;
  pyusmipc_type_error(
      "usmipc.Event cannot be pickled; send "
      "usmipc.IPCEventHandle(event) (or its to_bytes()) and open "
      "it with IPCEventHandle.open() in the other process");
  return NULL;
}

#define METHOD_FLAGS (METH_METHOD | METH_FASTCALL | METH_KEYWORDS)

static PyMethodDef event_methods[] = {
    {"record", PYUSMIPC_CMETHOD(event_record), METHOD_FLAGS,
     "record($self, /, stream=None)\n--\n\n"
     "Marks the work submitted to stream so far (None: the default queue "
     "of\nthe event's device). stream: a usmipc.Queue, a torch or CuPy "
     "stream, an\nobject with __cuda_stream__, or an int (a native stream "
     "handle). Each\nrecord replaces the previous one. Raises usmipc.Error "
     "(ValueError) for an\nEvent opened from a handle: those only wait."},
    {"wait", PYUSMIPC_CMETHOD(event_wait), METHOD_FLAGS,
     "wait($self, /, stream=None)\n--\n\n"
     "With a stream, work submitted to it later waits for the event's "
     "record\non the device (the host does not block); without, the same "
     "as\nsynchronize()."},
    {"synchronize", event_synchronize, METH_NOARGS,
     "synchronize($self, /)\n--\n\n"
     "The host waits until the record has completed (without the GIL), for "
     "at\nmost usmipc.set_event_timeout() (then usmipc.IPCTimeoutError). "
     "Ctrl-C\nraises KeyboardInterrupt. An event whose exporter exited "
     "before its record\nwas known complete raises usmipc.Error "
     "USMIPC_EEXPORTERGONE. An event never\nrecorded is complete."},
    {"query", event_query, METH_NOARGS,
     "query($self, /) -> bool\n--\n\n"
     "True if the record has completed (never blocks)."},
    {"__reduce__", event_reduce, METH_NOARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef event_getset[] = {
    {"device", event_get_device, NULL, "The event's Device.", NULL},
    {"is_opened", event_get_is_opened, NULL,
     "True for an Event opened from an IPCEventHandle (it waits only).", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

PyDoc_STRVAR(event_doc,
             "Event(device=None)\n--\n\n"
             "An event on device (a Device, a filter string, or None for the "
             "default\ndevice): record() marks the work a stream has been "
             "given so far,\nwait(stream) makes a stream wait for it on the "
             "device, synchronize() makes\nthe host wait. Share it with "
             "IPCEventHandle(event). On the host backend\nwork completes "
             "when submitted, so events are complete when recorded; they\n"
             "still travel between processes and fail like the others.");

static PyType_Slot event_slots[] = {
    {Py_tp_doc, (void *)event_doc},
    {Py_tp_new, event_new},
    {Py_tp_dealloc, event_dealloc},
    {Py_tp_traverse, event_traverse},
    {Py_tp_clear, event_clear},
    {Py_tp_repr, event_repr},
    {Py_tp_methods, event_methods},
    {Py_tp_getset, event_getset},
    {0, NULL},
};

static PyType_Spec event_spec = {
    .name = "usmipc.Event",
    .basicsize = sizeof(Event),
    .itemsize = 0,
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = event_slots,
};

/* ---- IPCEventHandle ------------------------------------------------------ */

static PyObject *ehandle_new(PyTypeObject *type, PyObject *args,
                             PyObject *kwds) {
  static char *kwlist[] = {"event", NULL};
  PyObject *event_obj;
  if (!PyArg_ParseTupleAndKeywords(args, kwds, "O:IPCEventHandle", kwlist,
                                   &event_obj)) {
    pyusmipc_retype_parse_error();
    return NULL;
  }
  pyusmipc_module_state_t *st = pyusmipc_state_from_type(type);
  if (st == NULL) {
    return NULL;
  }
  if (st->EventType == NULL || !Py_IS_TYPE(event_obj, st->EventType)) {
    pyusmipc_type_error("IPCEventHandle() shares a usmipc.Event, not %R%s",
                        (PyObject *)Py_TYPE(event_obj),
                        st->MemoryType != NULL &&
                                PyObject_TypeCheck(event_obj, st->MemoryType)
                            ? " (share memory with IPCMemoryHandle)"
                            : "");
    return NULL;
  }
  Event *event = (Event *)event_obj;
  if (event_check(event) < 0) {
    return NULL;
  }
  if (event->opened) {
    return pyusmipc_raise_msg(
        st, USMIPC_EINVAL,
        "IPCEventHandle(): this Event was opened from a handle; forward the "
        "original handle bytes instead");
  }
  EventHandle *self = (EventHandle *)pyusmipc_object_alloc(type);
  if (self == NULL) {
    return NULL;
  }
  usmipc_event_t *ev = event->event;
  usmipc_ipc_handle_t *handle = NULL;
  const void *data = NULL;
  size_t len = 0;
  int rc;
  Py_BEGIN_ALLOW_THREADS
  rc = usmipc_ipc_get_event_handle(ev, &handle);
  rc = pyusmipc_handle_describe(rc, handle, &data, &len, &self->info);
  Py_END_ALLOW_THREADS
  self->handle = handle; /* freed by dealloc, even after a failure */
  if (rc < 0) {
    pyusmipc_raise(st, rc);
    Py_DECREF(self);
    return NULL;
  }
  self->data = PyBytes_FromStringAndSize(data, (Py_ssize_t)len);
  if (self->data == NULL) {
    Py_DECREF(self);
    return NULL;
  }
  self->event = Py_NewRef(event_obj);
  return (PyObject *)self;
}

/* Event handle bytes given as bytes, an IPCEventHandle or any buffer. 0,
 * or -1 with an exception set. */
static int ehandle_bytes(pyusmipc_module_state_t *st, PyObject *obj,
                         pyusmipc_handle_bytes_t *hb) {
  if (st->IPCEventHandleType != NULL &&
      Py_IS_TYPE(obj, st->IPCEventHandleType)) {
    return pyusmipc_handle_bytes_of(obj, Py_NewRef(((EventHandle *)obj)->data),
                                    hb);
  }
  return pyusmipc_handle_bytes_read(
      obj, hb, st->IPCMemoryHandleType,
      "expected the bytes of an event handle or an IPCEventHandle, not an "
      "IPCMemoryHandle (open it with IPCMemoryHandle.open())",
      "event handle bytes or an IPCEventHandle");
}

/* The refusal of memory handle bytes given to what, a method of
 * IPCEventHandle. */
#define MEMORY_BYTES_REFUSED(what)                                             \
  what ": these are the bytes of a memory handle, not of an event; open "      \
       "them with IPCMemoryHandle.open()"

static PyObject *ehandle_from_bytes(PyObject *cls, PyTypeObject *defining_class,
                                    PyObject *const *args, Py_ssize_t nargs,
                                    PyObject *kwnames) {
  (void)cls;
  PyObject *raw;
  pyusmipc_module_state_t *st = PyType_GetModuleState(defining_class);
  if (pyusmipc_parse_one_arg("from_bytes", "data", args, nargs, kwnames, &raw) <
      0) {
    return NULL;
  }
  PyTypeObject *type = st->IPCEventHandleType;
  if (type == NULL) {
    return pyusmipc_state_cleared();
  }
  pyusmipc_handle_bytes_t hb;
  if (ehandle_bytes(st, raw, &hb) < 0) {
    return NULL;
  }
  EventHandle *self = (EventHandle *)pyusmipc_object_alloc(type);
  if (self != NULL &&
      (self->data = pyusmipc_handle_bytes_decode(
           st, &hb, &self->info, 1,
           MEMORY_BYTES_REFUSED("IPCEventHandle.from_bytes()"))) == NULL) {
    Py_CLEAR(self);
  }
  pyusmipc_handle_bytes_release(&hb);
  return (PyObject *)self;
}

static PyObject *ehandle_open(PyObject *cls, PyTypeObject *defining_class,
                              PyObject *const *args, Py_ssize_t nargs,
                              PyObject *kwnames) {
  (void)cls;
  static const char *const names[] = {"handle_bytes", "device"};
  PyObject *a[2];
  pyusmipc_module_state_t *st = PyType_GetModuleState(defining_class);
  if (pyusmipc_parse_fastcall("open", args, nargs, kwnames, names, 2, 2, a) <
      0) {
    return NULL;
  }
  if (a[0] == NULL) {
    pyusmipc_type_error("open() missing required argument 'handle_bytes'");
    return NULL;
  }
  PyObject *device_obj;
  usmipc_device_t *device;
  if (pyusmipc_optional_device_arg(st, a[1], &device_obj, &device) < 0) {
    return NULL;
  }
  pyusmipc_handle_bytes_t hb;
  if (ehandle_bytes(st, a[0], &hb) < 0) {
    Py_XDECREF(device_obj);
    return NULL;
  }
  usmipc_event_t *event = NULL;
  int rc;
  /* Opening may talk to the exporting process (the first time). */
  Py_BEGIN_ALLOW_THREADS
  rc = usmipc_ipc_open_event(hb.data, (size_t)hb.len, device, &event);
  Py_END_ALLOW_THREADS
  if (rc < 0) {
    /* A Ctrl-C while it waited left KeyboardInterrupt pending, which
     * propagates (pyusmipc_raise). */
    pyusmipc_raise_open_error(st, rc, hb.data, hb.len, 1,
                              MEMORY_BYTES_REFUSED("IPCEventHandle.open()"));
    pyusmipc_handle_bytes_release(&hb);
    Py_XDECREF(device_obj);
    return NULL;
  }
  pyusmipc_handle_bytes_release(&hb);
  if (PyErr_Occurred()) { /* a signal handler raised; the open completed */
    usmipc_event_destroy(event);
    Py_XDECREF(device_obj);
    return NULL;
  }
  /* The device the library opened it on (the exporter's own event, for a
   * handle opened in the process that made it). */
  Py_XDECREF(device_obj);
  device_obj = pyusmipc_device_object(st, usmipc_event_device(event));
  if (device_obj == NULL) {
    usmipc_event_destroy(event);
    return NULL;
  }
  PyObject *result = event_wrap(st, device_obj, event, 1);
  Py_DECREF(device_obj);
  return result;
}

static int ehandle_traverse(PyObject *op, visitproc visit, void *arg) {
  EventHandle *self = (EventHandle *)op;
  Py_VISIT(Py_TYPE(op));
  Py_VISIT(self->event);
  Py_VISIT(self->data);
  return 0;
}

static int ehandle_clear(PyObject *op) {
  EventHandle *self = (EventHandle *)op;
  Py_CLEAR(self->event);
  Py_CLEAR(self->data);
  return 0;
}

static void ehandle_dealloc(PyObject *op) {
  EventHandle *self = (EventHandle *)op;
  PyObject_GC_UnTrack(op);
  PYUSMIPC_DESTROY_WITHOUT_GIL(usmipc_ipc_handle_t, self->handle,
                               usmipc_ipc_free_handle);
  ehandle_clear(op);
  pyusmipc_object_free(op);
}

static PyObject *ehandle_to_bytes(PyObject *self,
                                  PyObject *Py_UNUSED(ignored)) {
  return Py_NewRef(((EventHandle *)self)->data);
}

static PyObject *ehandle_reduce(PyObject *self, PyObject *Py_UNUSED(ignored)) {
  PyObject *from_bytes =
      PyObject_GetAttrString((PyObject *)Py_TYPE(self), "from_bytes");
  if (from_bytes == NULL) {
    return NULL;
  }
  return Py_BuildValue("(N(O))", from_bytes, ((EventHandle *)self)->data);
}

static PyObject *ehandle_inspect(PyObject *self, PyObject *Py_UNUSED(ignored)) {
  EventHandle *h = (EventHandle *)self;
  return pyusmipc_handle_info_dict(&h->info, PyBytes_Size(h->data));
}

static PyObject *ehandle_get_event(PyObject *self, void *closure) {
  (void)closure;
  PyObject *event = ((EventHandle *)self)->event;
  return Py_NewRef(event ? event : Py_None);
}

static PyObject *ehandle_get_exporter_pid(PyObject *self, void *closure) {
  (void)closure;
  return PyLong_FromUnsignedLong(((EventHandle *)self)->info.exporter_pid);
}

static PyObject *ehandle_get_event_point(PyObject *self, void *closure) {
  (void)closure;
  return PyLong_FromUnsignedLongLong(((EventHandle *)self)->info.event_point);
}

static PyObject *ehandle_get_device(PyObject *self, void *closure) {
  (void)closure;
  EventHandle *h = (EventHandle *)self;
  if (h->event != NULL && ((Event *)h->event)->device != NULL) {
    return Py_NewRef(((Event *)h->event)->device);
  }
  return pyusmipc_device_of_info(event_state(self), &h->info);
}

static PyObject *ehandle_repr(PyObject *op) {
  EventHandle *self = (EventHandle *)op;
  return PyUnicode_FromFormat(
      "<usmipc.IPCEventHandle: record %llu of a %s event, exported by pid "
      "%u; %zd-byte handle>",
      (unsigned long long)self->info.event_point,
      usmipc_backend_name(self->info.backend),
      (unsigned)self->info.exporter_pid,
      self->data ? PyBytes_Size(self->data) : 0);
}

static PyObject *ehandle_richcompare(PyObject *self, PyObject *other, int op) {
  if ((op != Py_EQ && op != Py_NE) || !Py_IS_TYPE(other, Py_TYPE(self))) {
    Py_RETURN_NOTIMPLEMENTED;
  }
  return PyObject_RichCompare(((EventHandle *)self)->data,
                              ((EventHandle *)other)->data, op);
}

static Py_hash_t ehandle_hash(PyObject *self) {
  return PyObject_Hash(((EventHandle *)self)->data);
}

PYUSMIPC_CLASSMETHOD(ehandle_open_cls, ehandle_open, IPCEventHandleType)
PYUSMIPC_CLASSMETHOD(ehandle_from_bytes_cls, ehandle_from_bytes,
                     IPCEventHandleType)

static PyMethodDef ehandle_methods[] = {
    {"open", PYUSMIPC_CMETHOD(ehandle_open_cls), PYUSMIPC_CLASS_FLAGS,
     "open($cls, /, handle_bytes, device=None)\n--\n\n"
     "Returns an Event that waits for the record the handle names (bytes, "
     "an\nIPCEventHandle or any buffer), opened on device (None: the device "
     "that\nrecorded it). It cannot be recorded. Re-opening an event already "
     "open in\nthis process is a cheap lookup. Memory handle bytes raise "
     "ValueError; a\ndestroyed event or a dead exporter usmipc.Error "
     "USMIPC_EEXPORTERGONE."},
    {"from_bytes", PYUSMIPC_CMETHOD(ehandle_from_bytes_cls),
     PYUSMIPC_CLASS_FLAGS,
     "from_bytes($cls, /, data)\n--\n\nAn IPCEventHandle carrying only the "
     "given bytes (validated), as after\nunpickling."},
    {"to_bytes", ehandle_to_bytes, METH_NOARGS,
     "to_bytes() -> bytes: the serialized handle, for any channel."},
    {"__bytes__", ehandle_to_bytes, METH_NOARGS, NULL},
    {"__reduce__", ehandle_reduce, METH_NOARGS, NULL},
    {"inspect", ehandle_inspect, METH_NOARGS,
     "inspect() -> dict: the handle's metadata, as "
     "IPCMemoryHandle.inspect()."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef ehandle_getset[] = {
    {"event", ehandle_get_event, NULL,
     "The shared Event (None for a handle made from bytes).", NULL},
    {"backend", pyusmipc_info_get_backend, NULL, "The backend's name.",
     PYUSMIPC_INFO_OF(EventHandle)},
    {"device_uuid", pyusmipc_info_get_device_uuid, NULL,
     "UUID of the recording device.", PYUSMIPC_INFO_OF(EventHandle)},
    {"device", ehandle_get_device, NULL,
     "The recording Device, or None if this process does not see it.", NULL},
    {"exporter_pid", ehandle_get_exporter_pid, NULL,
     "Process id of the exporter.", NULL},
    {"event_point", ehandle_get_event_point, NULL,
     "The record the handle names (1 for the first; 0: none yet).", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

PyDoc_STRVAR(
    ehandle_doc,
    "IPCEventHandle(event)\n--\n\n"
    "Shares an Event created in this process with other processes: send "
    "to_bytes()\n(or pickle the handle) by any channel and call "
    "IPCEventHandle.open() there.\nThe bytes name the event's latest record "
    "when the handle is made (if the\nevent is recorded again, importers "
    "wait for the newer record). The handle\nkeeps the event alive; once the "
    "event is destroyed its handles are refused.\nOnly processes of the "
    "exporter's user can open it.");

static PyType_Slot ehandle_slots[] = {
    {Py_tp_doc, (void *)ehandle_doc},
    {Py_tp_new, ehandle_new},
    {Py_tp_dealloc, ehandle_dealloc},
    {Py_tp_traverse, ehandle_traverse},
    {Py_tp_clear, ehandle_clear},
    {Py_tp_repr, ehandle_repr},
    {Py_tp_richcompare, ehandle_richcompare},
    {Py_tp_hash, ehandle_hash},
    {Py_tp_methods, ehandle_methods},
    {Py_tp_getset, ehandle_getset},
    {0, NULL},
};

static PyType_Spec ehandle_spec = {
    .name = "usmipc.IPCEventHandle",
    .basicsize = sizeof(EventHandle),
    .itemsize = 0,
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = ehandle_slots,
};

/* ---- set_event_timeout --------------------------------------------------- */

PyObject *pyusmipc_set_event_timeout(PyObject *module, PyObject *arg) {
  pyusmipc_module_state_t *st = PyModule_GetState(module);
  unsigned long long timeout_ms = 0;
  if (arg != Py_None) {
    double seconds = PyFloat_AsDouble(arg); /* any real number */
    if (seconds == -1.0 && PyErr_Occurred()) {
      pyusmipc_retype_parse_error(); /* a wrong type: ArgumentTypeError */
      return NULL;
    }
    if (isnan(seconds) || seconds < 0.0) {
      pyusmipc_value_error(
          "timeout must be None or >= 0 seconds (None and 0 wait "
          "without limit), not %R",
          arg);
      return NULL;
    }
    /* Whole milliseconds, rounded up (set_ipc_timeout's rule); a positive
     * timeout never becomes 0, which would mean no limit. */
    double ms = ceil(seconds * 1000.0 - 1e-6);
    if (ms >= 1.8e19) {
      pyusmipc_value_error("timeout %R is too large", arg);
      return NULL;
    }
    timeout_ms = (unsigned long long)ms;
    if (seconds > 0.0 && timeout_ms == 0) {
      timeout_ms = 1;
    }
  }
  int rc = usmipc_event_set_timeout(timeout_ms);
  if (rc < 0) {
    return pyusmipc_raise(st, rc);
  }
  Py_RETURN_NONE;
}

/* ---- types --------------------------------------------------------------- */

int pyusmipc_init_event_types(PyObject *module, pyusmipc_module_state_t *st) {
  st->EventType =
      (PyTypeObject *)PyType_FromModuleAndSpec(module, &event_spec, NULL);
  if (st->EventType == NULL || PyModule_AddType(module, st->EventType) < 0) {
    return -1;
  }
  st->IPCEventHandleType =
      (PyTypeObject *)PyType_FromModuleAndSpec(module, &ehandle_spec, NULL);
  if (st->IPCEventHandleType == NULL) {
    return -1;
  }
  return PyModule_AddType(module, st->IPCEventHandleType);
}
