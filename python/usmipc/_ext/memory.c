/* Floor 6 of the extension: the memory types of usmipc.memory, the base
 * _Memory and its subclasses MemoryUSMDevice, MemoryUSMHost,
 * MemoryUSMShared (allocations made with usmipc_malloc, freed with
 * usmipc_free when the object dies) and MemoryIPCDevice (a mapping opened
 * by IPCMemoryHandle.open), and MemoryPool, whose blocks are
 * MemoryUSMDevice objects. Calls interop.c, memory_core.c, queue.c,
 * device.c and util.c (module.c lists the floors). Its length serves that
 * one concern, the memory objects: how each is made (an allocation, a
 * pool's block, a view, a copy of another object, a mapping), its buffer
 * protocol, its copies and its close.
 *
 * Lifetime: a memory object holds its Device and Queue. Host-accessible
 * memory exports the buffer protocol; every export holds a reference to the
 * memory object (Py_buffer.obj) and is counted, and so is every operation
 * that runs without the GIL. Closing a mapping only marks it closed while
 * that count is non-zero; the last release unmaps it. So close never fails
 * because a memoryview is alive (mmap's trap) and never leaves one dangling.
 */
#include "memory.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "device.h"
#include "interop.h"
#include "memory_core.h"
#include "queue.h"
#include "util.h"

typedef pyusmipc_memory_object_t Mem;

static int is_host_accessible(usmipc_backend_t backend,
                              usmipc_mem_kind_t kind) {
  return backend == USMIPC_BACKEND_HOST || kind == USMIPC_MEM_HOST ||
         kind == USMIPC_MEM_SHARED;
}

/* ---- construction -------------------------------------------------------- */

/* The device and queue of a new allocation (or pool) from its device= and
 * queue= arguments: the queue's device, which device= must then name, or
 * device= (None: the default device) with its default queue. 0 with two
 * new references, or -1 with an exception set. */
static int device_and_queue(pyusmipc_module_state_t *st, PyObject *device_arg,
                            PyObject *queue_arg, PyObject **device_out,
                            PyObject **queue_out) {
  PyObject *device_obj = NULL, *queue_obj = NULL;
  if (queue_arg != NULL && queue_arg != Py_None) {
    if (!PyObject_TypeCheck(queue_arg, st->QueueType)) {
      pyusmipc_type_error("queue must be a usmipc.Queue, not %R",
                          (PyObject *)Py_TYPE(queue_arg));
      return -1;
    }
    queue_obj = Py_NewRef(queue_arg);
    device_obj = Py_NewRef(((pyusmipc_queue_object_t *)queue_arg)->device);
    if (device_arg != NULL && device_arg != Py_None) {
      PyObject *given = pyusmipc_device_from_arg(st, device_arg);
      if (given == NULL) {
        goto fail;
      }
      /* Device objects are unique per device: identity is equality. */
      if (given != device_obj) {
        pyusmipc_value_error(
            "the queue is on device %R but device %R was given", device_obj,
            given);
        Py_DECREF(given);
        goto fail;
      }
      Py_DECREF(given);
    }
  } else {
    device_obj = pyusmipc_device_from_arg(st, device_arg);
    if (device_obj == NULL) {
      goto fail;
    }
    queue_obj = pyusmipc_default_queue(st, device_obj);
    if (queue_obj == NULL) {
      goto fail;
    }
  }
  *device_out = device_obj;
  *queue_out = queue_obj;
  return 0;

fail:
  Py_XDECREF(device_obj);
  Py_XDECREF(queue_obj);
  return -1;
}

/* The ipc= keyword of the allocating constructors and of MemoryPool. */
static int ipc_flags(const char *ipc, unsigned *flags) {
  *flags = 0;
  if (ipc == NULL) {
    return 0;
  }
  if (strcmp(ipc, "fd") == 0) {
    *flags = USMIPC_ALLOC_IPC_FD;
  } else if (strcmp(ipc, "native") == 0) {
    *flags = USMIPC_ALLOC_IPC_NATIVE;
  } else {
    pyusmipc_value_error("ipc must be None, 'fd' or 'native', not '%s'", ipc);
    return -1;
  }
  return 0;
}

/* A new memory object of type describing nbytes of kind on device_obj,
 * its copies ordered on queue_obj (NULL: the device's default queue, taken
 * on first use); ptr is the caller's to set. NULL with an exception set. */
static Mem *memory_new(PyTypeObject *type, PyObject *device_obj,
                       PyObject *queue_obj, Py_ssize_t nbytes,
                       usmipc_mem_kind_t kind) {
  Mem *self = (Mem *)pyusmipc_object_alloc(type);
  if (self == NULL) {
    return NULL;
  }
  self->device = Py_NewRef(device_obj);
  self->queue = Py_XNewRef(queue_obj);
  self->nbytes = nbytes;
  self->kind = kind;
  self->backend =
      usmipc_device_backend(((pyusmipc_device_object_t *)device_obj)->device);
  self->host_accessible = (char)is_host_accessible(self->backend, kind);
  return self;
}

/* A new allocation of nbytes of kind on device_obj, its copies ordered on
 * queue_obj (both references are stolen, also on failure). */
static PyObject *new_allocation(PyTypeObject *type, pyusmipc_module_state_t *st,
                                usmipc_mem_kind_t kind, Py_ssize_t nbytes,
                                Py_ssize_t alignment, unsigned flags,
                                PyObject *device_obj, PyObject *queue_obj) {
  Mem *self = memory_new(type, device_obj, queue_obj, nbytes, kind);
  Py_DECREF(device_obj);
  Py_DECREF(queue_obj);
  if (self == NULL) {
    return NULL;
  }
  usmipc_device_t *device = ((pyusmipc_device_object_t *)self->device)->device;
  void *ptr = NULL;
  int rc;
  Py_BEGIN_ALLOW_THREADS
  rc = usmipc_malloc_flags(device, kind, (size_t)nbytes, flags, &ptr);
  Py_END_ALLOW_THREADS
  if (rc < 0) {
    pyusmipc_raise(st, rc);
    Py_DECREF(self);
    return NULL;
  }
  self->ptr = ptr;
  /* Allocations start on a page (or the driver's granularity): an
   * alignment beyond what this one got is refused, not silently unmet. */
  if (alignment > 1 && (uintptr_t)ptr % (uintptr_t)alignment != 0) {
    pyusmipc_value_error("alignment %zd is more than this device's allocations "
                         "give (this one is at %p); use at most the page size",
                         alignment, ptr);
    Py_DECREF(self);
    return NULL;
  }
  return (PyObject *)self;
}

/* ---- memory of another object ----------------------------------------------
 * MemoryUSMDevice(obj) and copy_from_device(obj) take usmipc memory or an
 * object exposing __sycl_usm_array_interface__ (dpctl's _Memory._cinit_other
 * and copy_from_device). */

static const char *class_name(usmipc_mem_kind_t kind) {
  return kind == USMIPC_MEM_HOST     ? "MemoryUSMHost"
         : kind == USMIPC_MEM_SHARED ? "MemoryUSMShared"
                                     : "MemoryUSMDevice";
}

/* Where a view or a copy takes its bytes: usmipc memory, whose export is
 * held until source_done (a concurrent close waits), or the memory an
 * object's __sycl_usm_array_interface__ describes. */
typedef struct source {
  void *ptr;
  Py_ssize_t nbytes;
  usmipc_mem_kind_t kind;
  PyObject *device; /* usmipc.Device */
  PyObject *queue;  /* usmipc.Queue: the memory's, or its device's default */
  Mem *mem;         /* usmipc memory whose export is held, or NULL */
} source_t;

/* 0 with *src filled, or -1 with an exception set. */
static int source_of(pyusmipc_module_state_t *st, PyObject *obj,
                     const char *what, source_t *src) {
  memset(src, 0, sizeof(*src));
  if (PyObject_TypeCheck(obj, st->MemoryType)) {
    Mem *m = (Mem *)obj;
    if (pyusmipc_memory_begin(m) < 0) {
      return -1;
    }
    PyObject *queue = pyusmipc_memory_queue_object(m); /* borrowed */
    if (queue == NULL) {
      (void)pyusmipc_memory_end(m);
      return -1;
    }
    src->ptr = m->ptr;
    src->nbytes = m->nbytes;
    src->kind = m->kind;
    src->device = Py_NewRef(m->device);
    src->queue = Py_NewRef(queue);
    src->mem = m;
    return 0;
  }
  pyusmipc_suai_t iface;
  int found = pyusmipc_suai_read(st, obj, what, &iface);
  if (found < 0) {
    return -1;
  }
  if (found == 0) {
    pyusmipc_value_error("%s takes usmipc memory or an object exposing "
                         "__sycl_usm_array_interface__; %R does not expose it",
                         what, (PyObject *)Py_TYPE(obj));
    return -1;
  }
  src->ptr = iface.ptr;
  src->nbytes = iface.nbytes;
  src->kind = iface.kind;
  src->device = iface.device;
  src->queue = iface.queue != NULL ? iface.queue
                                   : pyusmipc_default_queue(st, iface.device);
  if (src->queue == NULL) {
    Py_CLEAR(src->device);
    return -1;
  }
  return 0;
}

/* Ends what source_of began. 0, or -1 with an exception set (a close of
 * the source requested meanwhile failed). */
static int source_done(source_t *src) {
  int rc = src->mem != NULL ? pyusmipc_memory_end(src->mem) : 0;
  src->mem = NULL;
  Py_CLEAR(src->device);
  Py_CLEAR(src->queue);
  return rc;
}

/* Copies n bytes of the source to dst, memory of self, then waits. On one
 * device, one copy on self's queue; across devices through a host buffer,
 * the source's queue copying out and self's in (dpctl's copy_via_host for
 * memory of different contexts). 0, or -1 with an exception set. */
static int copy_in(Mem *self, void *dst, source_t *src, size_t n) {
  pyusmipc_module_state_t *st = pyusmipc_state_from_device(self->device);
  usmipc_queue_t *to = pyusmipc_memory_queue(self);
  if (to == NULL) {
    return -1;
  }
  usmipc_queue_t *from = ((pyusmipc_queue_object_t *)src->queue)->queue;
  const void *ptr = src->ptr;
  int same = src->device == self->device; /* one object per device */
  int rc = 0, no_memory = 0;
  Py_BEGIN_ALLOW_THREADS
  if (same) {
    rc = usmipc_memcpy(to, dst, ptr, n);
    if (rc == 0) {
      rc = usmipc_queue_synchronize(to);
    }
  } else {
    void *bounce = malloc(n > 0 ? n : 1);
    if (bounce == NULL) {
      no_memory = 1;
    } else {
      rc = usmipc_memcpy(from, bounce, ptr, n);
      if (rc == 0) {
        rc = usmipc_queue_synchronize(from);
      }
      if (rc == 0) {
        rc = usmipc_memcpy(to, dst, bounce, n);
      }
      if (rc == 0) {
        rc = usmipc_queue_synchronize(to);
      }
      free(bounce);
    }
  }
  Py_END_ALLOW_THREADS
  if (no_memory) {
    PyErr_NoMemory();
    return -1;
  }
  if (rc < 0) {
    pyusmipc_raise(st, rc);
    return -1;
  }
  return 0;
}

/* A memory object over the source's memory, without a copy: it keeps obj
 * alive (reference_obj) and, for usmipc memory, one export of it. */
static PyObject *make_view(PyTypeObject *type, PyObject *obj, source_t *src,
                           PyObject *queue) {
  Mem *self = memory_new(type, src->device, queue != NULL ? queue : src->queue,
                         src->nbytes, src->kind);
  if (self == NULL) {
    return NULL;
  }
  self->ptr = src->ptr;
  self->is_view = 1;
  self->base = Py_NewRef(obj);
  if (src->mem != NULL) {
    src->mem->exports++; /* its own, beside the one source_done ends */
    self->base_export = 1;
    /* A mapping that waits on the device for its producer: DLPack
     * consumers of the view wait the same way. */
    self->order_handle = Py_XNewRef(src->mem->order_handle);
  }
  return (PyObject *)self;
}

/* MemoryUSM*(obj): a view when obj's memory is of the class's kind, a copy
 * into a new allocation when it is not and copy is true (dpctl's
 * semantics), else ArgumentError. */
static PyObject *memory_from_object(PyTypeObject *type,
                                    pyusmipc_module_state_t *st, PyObject *obj,
                                    usmipc_mem_kind_t kind,
                                    Py_ssize_t alignment, const char *ipc,
                                    unsigned flags, PyObject *device_arg,
                                    PyObject *queue_arg, int copy) {
  char what[32];
  snprintf(what, sizeof(what), "%s()", class_name(kind));
  source_t src;
  if (source_of(st, obj, what, &src) < 0) {
    return NULL;
  }
  PyObject *device_obj = NULL, *queue_obj = NULL, *result = NULL;
  int given = (device_arg != NULL && device_arg != Py_None) ||
              (queue_arg != NULL && queue_arg != Py_None);
  if (given && device_and_queue(st, device_arg, queue_arg, &device_obj,
                                &queue_obj) < 0) {
    goto done;
  }
  if (src.kind == kind) {
    if (alignment != 0 || ipc != NULL) {
      pyusmipc_value_error("%s: alignment and ipc are for new allocations; the "
                           "memory of a %R is taken as it is, without a copy",
                           what, (PyObject *)Py_TYPE(obj));
    } else if (given && device_obj != src.device) {
      pyusmipc_value_error("%s: the memory is on %R, not on the device given "
                           "(%R)",
                           what, src.device, device_obj);
    } else {
      /* the queue given, if one was, orders the view's copies */
      int queue_given = queue_arg != NULL && queue_arg != Py_None;
      result = make_view(type, obj, &src, queue_given ? queue_obj : NULL);
    }
    goto done;
  }
  if (!copy) {
    pyusmipc_value_error(
        "%s: the memory of the %R is USM %s memory, not %s: it cannot be "
        "taken without a copy; pass copy=True, or use %s",
        what, (PyObject *)Py_TYPE(obj), pyusmipc_kind_name(src.kind),
        pyusmipc_kind_name(kind), class_name(src.kind));
    goto done;
  }
  if (!given) {
    device_obj = Py_NewRef(src.device);
    queue_obj = pyusmipc_default_queue(st, device_obj);
    if (queue_obj == NULL) {
      goto done;
    }
  }
  result = new_allocation(type, st, kind, src.nbytes, alignment, flags,
                          device_obj, queue_obj);
  device_obj = queue_obj = NULL; /* stolen */
  if (result != NULL && copy_in((Mem *)result, ((Mem *)result)->ptr, &src,
                                (size_t)src.nbytes) < 0) {
    Py_CLEAR(result);
  }

done:
  Py_XDECREF(device_obj);
  Py_XDECREF(queue_obj);
  if (source_done(&src) < 0) {
    Py_CLEAR(result);
  }
  return result;
}

static PyObject *memory_alloc(PyTypeObject *type, PyObject *args,
                              PyObject *kwds, usmipc_mem_kind_t kind,
                              const char *format) {
  /* dpctl's order: nbytes (or an object: dpctl's other), alignment, then
   * the keywords. */
  static char *kwlist[] = {"nbytes", "alignment",   "device",
                           "queue",  "sycl_device", "sycl_queue",
                           "ipc",    "copy",        NULL};
  PyObject *first;
  Py_ssize_t alignment = 0;
  PyObject *device_arg = NULL, *queue_arg = NULL;
  PyObject *sycl_device = NULL, *sycl_queue = NULL;
  const char *ipc = NULL;
  int copy = 0;
  if (!PyArg_ParseTupleAndKeywords(args, kwds, format, kwlist, &first,
                                   &alignment, &device_arg, &queue_arg,
                                   &sycl_device, &sycl_queue, &ipc, &copy)) {
    pyusmipc_retype_parse_error();
    return NULL;
  }
  if (alignment < 0 || (alignment & (alignment - 1)) != 0) {
    return pyusmipc_value_error(
        "alignment must be 0 or a power of two, not %zd", alignment);
  }
  unsigned flags;
  if (ipc_flags(ipc, &flags) < 0) {
    return NULL;
  }
  if ((device_arg && sycl_device) || (queue_arg && sycl_queue)) {
    return pyusmipc_type_error(
        "give device or sycl_device, queue or sycl_queue, not both");
  }
  if (device_arg == NULL) {
    device_arg = sycl_device;
  }
  if (queue_arg == NULL) {
    queue_arg = sycl_queue;
  }
  pyusmipc_module_state_t *st = pyusmipc_state_from_type(type);
  if (st == NULL) {
    return NULL;
  }
  if (!PyIndex_Check(first)) {
    return memory_from_object(type, st, first, kind, alignment, ipc, flags,
                              device_arg, queue_arg, copy);
  }
  Py_ssize_t nbytes = PyNumber_AsSsize_t(first, PyExc_OverflowError);
  if (nbytes == -1 && PyErr_Occurred()) {
    return NULL;
  }
  if (nbytes <= 0) {
    return pyusmipc_value_error("nbytes must be positive, not %zd", nbytes);
  }
  PyObject *device_obj = NULL, *queue_obj = NULL;
  if (device_and_queue(st, device_arg, queue_arg, &device_obj, &queue_obj) <
      0) {
    return NULL;
  }
  return new_allocation(type, st, kind, nbytes, alignment, flags, device_obj,
                        queue_obj);
}

static PyObject *usm_device_new(PyTypeObject *type, PyObject *args,
                                PyObject *kwds) {
  return memory_alloc(type, args, kwds, USMIPC_MEM_DEVICE,
                      "O|n$OOOOzp:MemoryUSMDevice");
}

static PyObject *usm_host_new(PyTypeObject *type, PyObject *args,
                              PyObject *kwds) {
  return memory_alloc(type, args, kwds, USMIPC_MEM_HOST,
                      "O|n$OOOOzp:MemoryUSMHost");
}

static PyObject *usm_shared_new(PyTypeObject *type, PyObject *args,
                                PyObject *kwds) {
  return memory_alloc(type, args, kwds, USMIPC_MEM_SHARED,
                      "O|n$OOOOzp:MemoryUSMShared");
}

PyObject *pyusmipc_mapping_new(pyusmipc_module_state_t *st,
                               PyObject *device_obj, void *ptr, size_t nbytes) {
  PyTypeObject *type = st->MemoryIPCDeviceType;
  if (type == NULL) {
    return pyusmipc_state_cleared();
  }
  Mem *self =
      memory_new(type, device_obj, NULL, (Py_ssize_t)nbytes, USMIPC_MEM_DEVICE);
  if (self == NULL) {
    return NULL;
  }
  self->is_mapping = 1;
  self->ptr = ptr;
  return (PyObject *)self;
}

/* The mappings with a ticket not returned yet (pyusmipc_mapping_ticket_
 * list): a mapping still open when the interpreter exits is never closed,
 * and its producer kept the memory until it exited itself. GIL held; a
 * mapping leaves the list before anything releases the GIL on its way to
 * returning or dropping the ticket, so the walk at exit never meets one
 * whose bytes another thread is sending. */
static Mem *ticketed_mappings;

void pyusmipc_mapping_ticket_list(Mem *m) {
  if (m->ticket_listed) {
    return;
  }
  m->ticket_prev = NULL;
  m->ticket_next = ticketed_mappings;
  if (ticketed_mappings != NULL) {
    ticketed_mappings->ticket_prev = m;
  }
  ticketed_mappings = m;
  m->ticket_listed = 1;
}

static void mapping_ticket_unlist(Mem *m) {
  if (!m->ticket_listed) {
    return;
  }
  if (m->ticket_prev != NULL) {
    m->ticket_prev->ticket_next = m->ticket_next;
  } else {
    ticketed_mappings = m->ticket_next;
  }
  if (m->ticket_next != NULL) {
    m->ticket_next->ticket_prev = m->ticket_prev;
  }
  m->ticket_prev = m->ticket_next = NULL;
  m->ticket_listed = 0;
}

long pyusmipc_mapping_tickets_return_all(pyusmipc_module_state_t *st) {
  long n = 0;
  while (ticketed_mappings != NULL) {
    Mem *m = ticketed_mappings;
    Py_INCREF((PyObject *)m);
    if (pyusmipc_mapping_release(st, m, NULL) < 0) {
      PyErr_Clear();
    }
    mapping_ticket_unlist(m); /* released unlisted it; a failure too */
    Py_DECREF((PyObject *)m);
    n++;
  }
  return n;
}

int pyusmipc_mapping_release(pyusmipc_module_state_t *st,
                             pyusmipc_memory_object_t *m,
                             usmipc_queue_t *queue) {
  PyObject *bytes = m->release_handle;
  mapping_ticket_unlist(m);
  if (bytes == NULL) {
    return 0;
  }
  m->release_handle = NULL; /* once, even if it fails */
  const char *data = PyBytes_AsString(bytes);
  size_t len = (size_t)PyBytes_Size(bytes);
  int rc;
  Py_BEGIN_ALLOW_THREADS
  rc = usmipc_ipc_release(data, len, queue);
  Py_END_ALLOW_THREADS
  Py_DECREF(bytes);
  if (rc == USMIPC_EEXPORTERGONE) {
    return 0; /* nobody waits for it any more */
  }
  if (rc < 0) {
    pyusmipc_raise(st, rc);
    return -1;
  }
  return 0;
}

int pyusmipc_mapping_close(pyusmipc_module_state_t *st, Mem *self) {
  if (self->closed) {
    return 0;
  }
  /* A producer that asked for a release learns of the close (from the
   * host: work still queued on the mapping should be released with
   * IPCMemoryHandle.release(m, stream=...) first). */
  if (self->release_handle != NULL &&
      pyusmipc_mapping_release(st, self, NULL) < 0) {
    return -1;
  }
  self->closed = 1;
  if (self->exports > 0) {
    return 0; /* the last buffer release or operation unmaps */
  }
  int rc = pyusmipc_memory_release(self);
  if (rc < 0) {
    pyusmipc_raise(st, rc);
    return -1;
  }
  return 0;
}

/* ---- GC and deallocation ------------------------------------------------- */

static int memory_traverse(PyObject *op, visitproc visit, void *arg) {
  Mem *self = (Mem *)op;
  Py_VISIT(Py_TYPE(op));
  Py_VISIT(self->device);
  Py_VISIT(self->queue);
  Py_VISIT(self->pool);
  Py_VISIT(self->base);
  return 0;
}

/* A view gives back the export it held of its base (usmipc memory), which
 * performs a close of the base requested meanwhile; nothing can be
 * reported from the GC or a dealloc but an unraisable error. */
static void view_release(Mem *self) {
  if (!self->base_export) {
    return;
  }
  self->base_export = 0;
  self->released = 1; /* the memory may be unmapped from here on */
  PyObject *type, *value, *traceback;
  PyErr_Fetch(&type, &value, &traceback);
  if (pyusmipc_memory_end((Mem *)self->base) < 0) {
    PyErr_WriteUnraisable(self->base);
  }
  PyErr_Restore(type, value, traceback);
}

static int memory_clear(PyObject *op) {
  Mem *self = (Mem *)op;
  mapping_ticket_unlist(self);
  view_release(self);
  Py_CLEAR(self->base);
  Py_CLEAR(self->queue);
  Py_CLEAR(self->device);
  Py_CLEAR(self->order_handle);
  Py_CLEAR(self->release_handle);
  return 0;
}

static void memory_dealloc(PyObject *op) {
  Mem *self = (Mem *)op;
  PyObject_GC_UnTrack(op);
  mapping_ticket_unlist(self); /* before the GIL is released below */
  /* No export can be alive: each holds a reference to this object. Errors
   * cannot be reported from here; a failed free leaks, nothing worse. */
  (void)pyusmipc_memory_release(self);
  if (self->release_handle != NULL && PyBytes_Check(self->release_handle)) {
    /* Collected without a close: the producer still learns of it (best
     * effort; nothing can be reported from here). */
    const char *data = PyBytes_AsString(self->release_handle);
    size_t len = (size_t)PyBytes_Size(self->release_handle);
    /* As written: clang-format 14 would read the macro and the cast after
     * it as one call, Py_BEGIN_ALLOW_THREADS(void). */
    /* clang-format off */
    Py_BEGIN_ALLOW_THREADS
    (void)usmipc_ipc_release(data, len, NULL);
    Py_END_ALLOW_THREADS
    /* clang-format on */
  }
  PYUSMIPC_DESTROY_WITHOUT_GIL(usmipc_event_t, self->order_event,
                               usmipc_event_destroy);
  view_release(self);
  memory_clear(op);
  Py_CLEAR(self->pool); /* after the block went back to it */
  pyusmipc_object_free(op);
}

/* ---- the buffer protocol ------------------------------------------------- */

static int memory_getbuffer(PyObject *op, Py_buffer *view, int flags) {
  Mem *self = (Mem *)op;
  if (self->closed || self->released) {
    view->obj = NULL;
    pyusmipc_value_error("mapping is closed");
    return -1;
  }
  if (!self->host_accessible) {
    view->obj = NULL;
    PyErr_Format(PyExc_BufferError,
                 "%s memory on a %s device is not accessible from the host; "
                 "use copy_to_host() and copy_from_host()",
                 pyusmipc_kind_name(self->kind),
                 usmipc_backend_name(self->backend));
    return -1;
  }
  if (self->ptr == NULL) {
    view->obj = NULL;
    PyErr_SetString(PyExc_BufferError, "memory object is not initialized");
    return -1;
  }
  if (PyBuffer_FillInfo(view, op, self->ptr, self->nbytes, 0, flags) < 0) {
    return -1;
  }
  self->exports++;
  return 0;
}

static void memory_releasebuffer(PyObject *op, Py_buffer *view) {
  (void)view;
  Mem *self = (Mem *)op;
  if (pyusmipc_memory_end(self) < 0) {
    PyErr_WriteUnraisable(op);
  }
}

static Py_ssize_t memory_length(PyObject *op) { return ((Mem *)op)->nbytes; }

/* ---- methods ------------------------------------------------------------- */

static PyObject *memory_copy_from_host(PyObject *op, PyObject *obj) {
  Mem *self = (Mem *)op;
  Py_buffer src;
  if (PyObject_GetBuffer(obj, &src, PyBUF_SIMPLE) < 0) {
    PyErr_Clear();
    PyObject *tn = pyusmipc_type_name(obj);
    if (tn != NULL)
      pyusmipc_type_error("copy_from_host(): obj is bytes-like (bytes, "
                          "bytearray, memoryview, a contiguous NumPy array), "
                          "not a %U; bytes(obj) makes one of a list of ints",
                          tn);
    Py_XDECREF(tn);
    return NULL;
  }
  if (src.len > self->nbytes) {
    pyusmipc_value_error(
        "source of %zd bytes does not fit in %zd bytes of memory", src.len,
        self->nbytes);
    PyBuffer_Release(&src);
    return NULL;
  }
  if (pyusmipc_memory_run(self, self->ptr, src.buf, 0, (size_t)src.len, &src) <
      0) {
    return NULL;
  }
  Py_RETURN_NONE;
}

static PyObject *copy_to_bytes(Mem *self) {
  if (self->closed || self->released) {
    pyusmipc_value_error("mapping is closed");
    return NULL;
  }
  PyObject *bytes = PyBytes_FromStringAndSize(NULL, self->nbytes);
  if (bytes == NULL) {
    return NULL;
  }
  /* Filling a bytes object before anyone else sees it is allowed. */
  if (pyusmipc_memory_copy_out(self, PyBytes_AsString(bytes)) < 0) {
    Py_DECREF(bytes);
    return NULL;
  }
  return bytes;
}

/* 1 once an import of NumPy failed: usmipc does not need NumPy, and a
 * process without it should not search sys.path on every copy. */
static int numpy_missing;

/* What dpctl's copy_to_host() returns: a new numpy.ndarray of n uint8
 * (numpy.empty), or a bytearray when NumPy cannot be imported. */
static PyObject *new_host_array(Py_ssize_t n) {
  if (!numpy_missing) {
    PyObject *numpy = PyImport_ImportModule("numpy");
    if (numpy != NULL) {
      PyObject *arr = PyObject_CallMethod(numpy, "empty", "ns", n, "u1");
      Py_DECREF(numpy);
      return arr;
    }
    if (!PyErr_ExceptionMatches(PyExc_ImportError)) {
      return NULL;
    }
    PyErr_Clear();
    numpy_missing = 1;
  }
  return PyByteArray_FromStringAndSize(NULL, n);
}

static PyObject *memory_copy_to_host(PyObject *op, PyObject *const *args,
                                     Py_ssize_t nargs, PyObject *kwnames) {
  static const char *const names[] = {"obj"};
  PyObject *obj;
  Mem *self = (Mem *)op;
  if (pyusmipc_parse_fastcall("copy_to_host", args, nargs, kwnames, names, 1, 1,
                              &obj) < 0) {
    return NULL;
  }
  PyObject *fresh = NULL;
  if (obj == NULL || obj == Py_None) {
    if (self->closed || self->released) {
      return pyusmipc_value_error("mapping is closed");
    }
    fresh = obj = new_host_array(self->nbytes);
    if (fresh == NULL) {
      return NULL;
    }
  }
  Py_buffer dst;
  /* C-contiguous and writable: a strided view would take the bytes in
   * the wrong places. */
  if (PyObject_GetBuffer(obj, &dst, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
    Py_XDECREF(fresh);
    return NULL;
  }
  if (dst.len < self->nbytes) {
    pyusmipc_value_error("destination of %zd bytes is too small for %zd bytes",
                         dst.len, self->nbytes);
    PyBuffer_Release(&dst);
    Py_XDECREF(fresh);
    return NULL;
  }
  int rc = pyusmipc_memory_copy_out(self, dst.buf);
  PyBuffer_Release(&dst);
  if (rc < 0) {
    Py_XDECREF(fresh);
    return NULL;
  }
  return fresh != NULL ? fresh : Py_NewRef(obj);
}

/* dpctl's copy_from_device(sycl_usm_ary): the memory of usmipc memory or
 * of an object with __sycl_usm_array_interface__, copied to the start of
 * this memory (through the host when it is on another device). */
static PyObject *memory_copy_from_device(PyObject *op, PyObject *obj) {
  Mem *self = (Mem *)op;
  if (pyusmipc_memory_begin(self) < 0) {
    return NULL;
  }
  pyusmipc_module_state_t *st = pyusmipc_state_from_device(self->device);
  source_t src;
  int failed = source_of(st, obj, "copy_from_device()", &src) < 0;
  if (!failed) {
    if (src.nbytes > self->nbytes) {
      pyusmipc_value_error("copy_from_device(): the source's %zd bytes do not "
                           "fit in %zd bytes of memory",
                           src.nbytes, self->nbytes);
      failed = 1;
    } else {
      failed = copy_in(self, self->ptr, &src, (size_t)src.nbytes) < 0;
    }
    if (source_done(&src) < 0) {
      failed = 1;
    }
  }
  if (pyusmipc_memory_end(self) < 0 || failed) {
    return NULL;
  }
  Py_RETURN_NONE;
}

static PyObject *memory_tobytes(PyObject *op, PyObject *Py_UNUSED(ignored)) {
  return copy_to_bytes((Mem *)op);
}

static PyObject *memory_memset(PyObject *op, PyObject *const *args,
                               Py_ssize_t nargs, PyObject *kwnames) {
  static const char *const names[] = {"value"};
  PyObject *value_obj;
  Mem *self = (Mem *)op;
  if (pyusmipc_parse_fastcall("memset", args, nargs, kwnames, names, 1, 1,
                              &value_obj) < 0) {
    return NULL;
  }
  long value = 0;
  if (value_obj != NULL) {
    value = PyLong_AsLong(value_obj);
    if (value == -1 && PyErr_Occurred()) {
      pyusmipc_retype_parse_error(); /* a wrong type: ArgumentTypeError */
      return NULL;
    }
    if (value < 0 || value > 255) {
      pyusmipc_value_error("memset value must be a byte (0..255), not %ld",
                           value);
      return NULL;
    }
  }
  if (pyusmipc_memory_run(self, self->ptr, NULL, (int)value,
                          (size_t)self->nbytes, NULL) < 0) {
    return NULL;
  }
  Py_RETURN_NONE;
}

/* dpctl's get_usm_type(syclobj=None): the kind, or 'unknown' relative to
 * a device or queue of another backend (whose driver would not know the
 * pointer). */
static PyObject *memory_get_usm_type(PyObject *op, PyObject *const *args,
                                     Py_ssize_t nargs, PyObject *kwnames) {
  static const char *const names[] = {"syclobj"};
  PyObject *obj = NULL;
  Mem *self = (Mem *)op;
  if (pyusmipc_parse_fastcall("get_usm_type", args, nargs, kwnames, names, 1, 1,
                              &obj) < 0) {
    return NULL;
  }
  if (obj != NULL && obj != Py_None && self->device != NULL) {
    PyObject *dev =
        pyusmipc_device_from_arg(pyusmipc_state_from_device(self->device), obj);
    if (dev == NULL) {
      return NULL;
    }
    int other = usmipc_device_backend(
                    ((pyusmipc_device_object_t *)dev)->device) != self->backend;
    Py_DECREF(dev);
    if (other) {
      return PyUnicode_FromString("unknown");
    }
  }
  return PyUnicode_FromString(pyusmipc_kind_name(self->kind));
}

static PyObject *mapping_close(PyObject *op, PyObject *Py_UNUSED(ignored)) {
  Mem *self = (Mem *)op;
  if (self->device == NULL) {
    Py_RETURN_NONE; /* cleared by the GC: dealloc will unmap */
  }
  if (pyusmipc_mapping_close(pyusmipc_state_from_device(self->device), self) <
      0) {
    return NULL;
  }
  Py_RETURN_NONE;
}

static PyObject *mapping_enter(PyObject *op, PyObject *Py_UNUSED(ignored)) {
  return Py_NewRef(op);
}

static PyObject *mapping_exit(PyObject *op, PyObject *args) {
  (void)args;
  PyObject *r = mapping_close(op, NULL);
  if (r == NULL) {
    return NULL;
  }
  Py_DECREF(r);
  Py_RETURN_FALSE;
}

/* ---- getters ------------------------------------------------------------- */

/* A closed mapping reports no memory (dpctl's MemoryIPCDevice after
 * SyclIPCCloseMemHandle: _pointer 0, nbytes 0); the object keeps the
 * address until its last export ends and the unmap happens. */
static int closed_mapping(const Mem *self) {
  return self->is_mapping && (self->closed || self->released);
}

static PyObject *memory_get_nbytes(PyObject *op, void *closure) {
  (void)closure;
  Mem *self = (Mem *)op;
  return PyLong_FromSsize_t(closed_mapping(self) ? 0 : self->nbytes);
}

static PyObject *memory_get_device(PyObject *op, void *closure) {
  (void)closure;
  Mem *self = (Mem *)op;
  if (self->device == NULL) {
    Py_RETURN_NONE;
  }
  return Py_NewRef(self->device);
}

static PyObject *memory_get_queue(PyObject *op, void *closure) {
  (void)closure;
  Mem *self = (Mem *)op;
  if (self->device == NULL) {
    Py_RETURN_NONE;
  }
  if (self->queue == NULL && pyusmipc_memory_queue(self) == NULL) {
    return NULL;
  }
  return Py_NewRef(self->queue);
}

static PyObject *memory_get_kind(PyObject *op, void *closure) {
  (void)closure;
  return PyUnicode_FromString(pyusmipc_kind_name(((Mem *)op)->kind));
}

static PyObject *memory_get_pointer(PyObject *op, void *closure) {
  (void)closure;
  Mem *self = (Mem *)op;
  return PyLong_FromVoidPtr(closed_mapping(self) ? NULL : self->ptr);
}

static PyObject *memory_get_is_closed(PyObject *op, void *closure) {
  (void)closure;
  Mem *self = (Mem *)op;
  return PyBool_FromLong(self->closed || self->released);
}

static PyObject *memory_get_reference_obj(PyObject *op, void *closure) {
  (void)closure;
  Mem *self = (Mem *)op;
  return Py_NewRef(self->base != NULL ? self->base : Py_None);
}

static PyObject *memory_get_host_accessible(PyObject *op, void *closure) {
  (void)closure;
  return PyBool_FromLong(((Mem *)op)->host_accessible);
}

static PyObject *memory_repr(PyObject *op) {
  Mem *self = (Mem *)op;
  PyObject *type = (PyObject *)Py_TYPE(op);
  PyObject *module = PyObject_GetAttrString(type, "__module__");
  PyObject *name = module ? PyObject_GetAttrString(type, "__qualname__") : NULL;
  if (name == NULL) {
    Py_XDECREF(module);
    return NULL;
  }
  const char *filter =
      self->device ? usmipc_device_filter_string(
                         ((pyusmipc_device_object_t *)self->device)->device)
                   : "?";
  PyObject *r = PyUnicode_FromFormat(
      "<%S.%S of %zd bytes at %p on [%s]%s>", module, name, self->nbytes,
      self->ptr, filter, (self->closed || self->released) ? " (closed)" : "");
  Py_DECREF(module);
  Py_DECREF(name);
  return r;
}

static PyGetSetDef memory_getset[] = {
    {"nbytes", memory_get_nbytes, NULL, "Size in bytes.", NULL},
    {"size", memory_get_nbytes, NULL, "Alias of nbytes.", NULL},
    {"device", memory_get_device, NULL, "The Device of the memory.", NULL},
    {"sycl_device", memory_get_device, NULL, "Alias of device.", NULL},
    {"queue", memory_get_queue, NULL,
     "The Queue used for copies (a mapping uses its device's default "
     "queue).",
     NULL},
    {"sycl_queue", memory_get_queue, NULL, "Alias of queue.", NULL},
    {"kind", memory_get_kind, NULL, "'device', 'host' or 'shared'.", NULL},
    {"_pointer", memory_get_pointer, NULL, "The address, as an int.", NULL},
    {"is_closed", memory_get_is_closed, NULL, "True once a mapping was closed.",
     NULL},
    {"__cuda_array_interface__", pyusmipc_memory_cuda_array_interface, NULL,
     "The CUDA array interface (v3) of CUDA memory; AttributeError "
     "elsewhere.\nIt holds no reference: keep the memory open while a "
     "consumer uses it\n(DLPack consumers are tracked; prefer "
     "__dlpack__).",
     NULL},
    {"__sycl_usm_array_interface__", pyusmipc_memory_suai, NULL,
     "dpctl's description of the memory: data (address, False: not "
     "read-only),\nshape (nbytes,), strides None, typestr '|u1', version 1, "
     "syclobj the\nmemory's Queue. MemoryUSMDevice(obj) and "
     "copy_from_device(obj) read it.",
     NULL},
    {"reference_obj", memory_get_reference_obj, NULL,
     "The object whose memory this is, for memory made from another object "
     "without\na copy (MemoryUSMDevice(obj)); None otherwise (dpctl's).",
     NULL},
    {"host_accessible", memory_get_host_accessible, NULL,
     "True if the memory supports the buffer protocol (memoryview, numpy).",
     NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

/* numpy.asarray(memory): NumPy reads host-accessible memory through the
 * buffer protocol first; this is its fallback, reached when that failed,
 * so that a closed mapping or device memory raises instead of becoming a
 * 0-d object array. */
static PyObject *memory_array(PyObject *op, PyObject *const *args,
                              Py_ssize_t nargs, PyObject *kwnames) {
  static const char *const names[] = {"dtype", "copy"};
  PyObject *a[2];
  Mem *self = (Mem *)op;
  if (pyusmipc_parse_fastcall("__array__", args, nargs, kwnames, names, 2, 2,
                              a) < 0) {
    return NULL;
  }
  if (self->closed || self->released) {
    pyusmipc_value_error("mapping is closed");
    return NULL;
  }
  if (!self->host_accessible) {
    pyusmipc_kind_error(
        "%s memory on a %s device is not accessible from the host: "
        "numpy cannot view it; use copy_to_host(), or DLPack with "
        "a device array library",
        pyusmipc_kind_name(self->kind), usmipc_backend_name(self->backend));
    return NULL;
  }
  PyObject *numpy = PyImport_ImportModule("numpy");
  PyObject *arr =
      numpy ? PyObject_CallMethod(numpy, "frombuffer", "Os", op, "uint8")
            : NULL;
  Py_XDECREF(numpy);
  if (arr != NULL && a[0] != NULL && a[0] != Py_None) {
    PyObject *cast = PyObject_CallMethod(arr, "astype", "O", a[0]);
    Py_DECREF(arr);
    arr = cast;
  }
  return arr;
}

static PyMethodDef memory_methods[] = {
    {"__array__", PYUSMIPC_CMETHOD(memory_array), METH_FASTCALL | METH_KEYWORDS,
     "__array__(dtype=None, copy=None)\n--\n\nA NumPy view of host-"
     "accessible memory (uint8); a closed mapping raises ValueError, device "
     "memory TypeError."},
    {"copy_from_host", memory_copy_from_host, METH_O,
     "copy_from_host($self, obj, /)\n--\n\nCopies a bytes-like object (at most "
     "nbytes) to "
     "the start of the memory."},
    {"copy_to_host", PYUSMIPC_CMETHOD(memory_copy_to_host),
     METH_FASTCALL | METH_KEYWORDS,
     "copy_to_host($self, /, obj=None)\n--\n\nCopies the memory to the host "
     "and returns the copy: as dpctl does, a new\nnumpy.ndarray of nbytes "
     "uint8 (a bytearray when NumPy is not installed),\nor, given obj, into "
     "obj (a writable C-contiguous buffer of at least\nnbytes) and returns "
     "obj. tobytes() or bytes(memory) give bytes."},
    {"copy_from_device", memory_copy_from_device, METH_O,
     "copy_from_device($self, sycl_usm_ary, /)\n--\n\nCopies the memory of "
     "sycl_usm_ary (usmipc memory, or an object exposing\n"
     "__sycl_usm_array_interface__ whose syclobj is a usmipc Queue, Device "
     "or\nfilter string) to the start of this memory, through the host when "
     "it is\non another device (dpctl's method). More bytes than this "
     "memory has\nraise usmipc.ArgumentError."},
    {"tobytes", memory_tobytes, METH_NOARGS,
     "tobytes($self, /)\n--\n\nA bytes copy of the memory."},
    {"__bytes__", memory_tobytes, METH_NOARGS,
     "__bytes__($self, /)\n--\n\nbytes(memory): the same as tobytes() "
     "(device memory too)."},
    {"memset", PYUSMIPC_CMETHOD(memory_memset), METH_FASTCALL | METH_KEYWORDS,
     "memset($self, /, value=0)\n--\n\nFills the memory with the byte value."},
    {"__dlpack__", PYUSMIPC_CMETHOD(pyusmipc_memory_dlpack),
     METH_FASTCALL | METH_KEYWORDS,
     "__dlpack__($self, /, stream=None, *, max_version=None, dl_device=None, "
     "copy=None)\n--\n\n"
     "A DLPack capsule of the memory as nbytes uint8 (zero-copy). The "
     "capsule\nholds the memory like a memoryview: a mapping closed "
     "meanwhile is unmapped\nwhen the consumer drops the tensor. "
     "dl_device is the memory's own device\n(__dlpack_device__()) or, for "
     "memory the host can read (host and shared\nmemory, the host "
     "backend's), the CPU (1, 0), still without a copy:\n"
     "numpy.from_dlpack(mem, device='cpu') takes Level Zero host memory "
     "so.\ncopy=True always copies (to the CPU for dl_device=(1, 0), else "
     "into a new\nallocation on the device); device memory reaches the CPU "
     "only so\n(BufferError with copy=None or False)."},
    {"__dlpack_device__", pyusmipc_memory_dlpack_device, METH_NOARGS,
     "__dlpack_device__($self, /)\n--\n\n"
     "The (DLPack device type, device id) of the memory."},
    {"get_usm_type", PYUSMIPC_CMETHOD(memory_get_usm_type),
     METH_FASTCALL | METH_KEYWORDS,
     "get_usm_type(syclobj=None)\n--\n\n'device', 'host' or 'shared'; "
     "'unknown' relative to a Device or Queue (syclobj) of another "
     "backend."},
    {NULL, NULL, 0, NULL},
};

static PyMethodDef mapping_methods[] = {
    {"close", mapping_close, METH_NOARGS,
     "close()\n\nCloses the mapping (idempotent); the same as "
     "IPCMemoryHandle.close_mapping(self)."},
    {"__enter__", mapping_enter, METH_NOARGS, NULL},
    {"__exit__", mapping_exit, METH_VARARGS, NULL},
    {NULL, NULL, 0, NULL},
};

/* ---- types --------------------------------------------------------------- */

static PyType_Slot memory_slots[] = {
    {Py_tp_doc, (void *)"The base of usmipc's memory types."},
    {Py_tp_dealloc, memory_dealloc},
    {Py_tp_traverse, memory_traverse},
    {Py_tp_clear, memory_clear},
    {Py_tp_repr, memory_repr},
    {Py_tp_getset, memory_getset},
    {Py_tp_methods, memory_methods},
    {Py_bf_getbuffer, memory_getbuffer},
    {Py_bf_releasebuffer, memory_releasebuffer},
    {Py_sq_length, memory_length},
    {0, NULL},
};

#define MEMORY_FLAGS                                                           \
  (Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_IMMUTABLETYPE)

static PyType_Spec memory_spec = {
    .name = "usmipc.memory._Memory",
    .basicsize = sizeof(Mem),
    .flags =
        MEMORY_FLAGS | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_DISALLOW_INSTANTIATION,
    .slots = memory_slots,
};

#define USM_DOC(cls, what, kind)                                               \
  cls "(nbytes, alignment=0, *, device=None, queue=None, sycl_device=None, "   \
      "sycl_queue=None, ipc=None, copy=False)\n--\n\n"                         \
      "nbytes of " what " allocated with usmipc on device (a Device or a "     \
      "filter\nstring) or on the device of queue; with neither, on the "       \
      "default device.\nsycl_device and sycl_queue are aliases. alignment, a " \
      "power of two, is\nrefused if the device's allocations do not give "     \
      "it. ipc picks how device\nmemory will be shared where a backend "       \
      "offers a choice (CUDA): 'fd' (a\nfile descriptor; outlives the "        \
      "exporter) or 'native' (the driver's handle);\nNone is the backend's "   \
      "default. Freed when the object dies.\n\n"                               \
      "Instead of nbytes, an object: usmipc memory, or one exposing\n"         \
      "__sycl_usm_array_interface__ (dpctl's), whose memory is taken "         \
      "without a\ncopy if it is " kind " memory (reference_obj keeps the "     \
      "object alive; a\nmapping it holds stays mapped), else copied into a "   \
      "new allocation on\nits device (or the one given) when copy=True, "      \
      "else usmipc.ArgumentError."

/* Each subtype names the GC slots again: a spec with Py_TPFLAGS_HAVE_GC
 * must have a traverse function before inheritance is applied. */
#define SUBTYPE_GC_SLOTS                                                       \
  {Py_tp_traverse, memory_traverse}, {Py_tp_clear, memory_clear},

static PyType_Slot usm_device_slots[] = {
    {Py_tp_doc,
     (void *)USM_DOC("MemoryUSMDevice",
                     "device memory (exportable with IPCMemoryHandle)",
                     "device")},
    {Py_tp_new, usm_device_new},
    SUBTYPE_GC_SLOTS{0, NULL},
};
static PyType_Slot usm_host_slots[] = {
    {Py_tp_doc,
     (void *)USM_DOC("MemoryUSMHost", "host (pinned) memory", "host")},
    {Py_tp_new, usm_host_new},
    SUBTYPE_GC_SLOTS{0, NULL},
};
static PyType_Slot usm_shared_slots[] = {
    {Py_tp_doc,
     (void *)USM_DOC("MemoryUSMShared", "shared (migrating) memory", "shared")},
    {Py_tp_new, usm_shared_new},
    SUBTYPE_GC_SLOTS{0, NULL},
};
static PyType_Slot mapping_slots[] = {
    {Py_tp_doc,
     (void *)"Device memory of another allocation, mapped by "
             "IPCMemoryHandle.open().\n\n"
             "Closed by close(), IPCMemoryHandle.close_mapping(), leaving a "
             "with block,\nor when garbage-collected. Cannot be constructed "
             "directly."},
    {Py_tp_methods, mapping_methods},
    SUBTYPE_GC_SLOTS{0, NULL},
};

static PyType_Spec usm_device_spec = {
    .name = "usmipc.memory.MemoryUSMDevice",
    .basicsize = sizeof(Mem),
    .flags = MEMORY_FLAGS | Py_TPFLAGS_BASETYPE,
    .slots = usm_device_slots,
};
static PyType_Spec usm_host_spec = {
    .name = "usmipc.memory.MemoryUSMHost",
    .basicsize = sizeof(Mem),
    .flags = MEMORY_FLAGS | Py_TPFLAGS_BASETYPE,
    .slots = usm_host_slots,
};
static PyType_Spec usm_shared_spec = {
    .name = "usmipc.memory.MemoryUSMShared",
    .basicsize = sizeof(Mem),
    .flags = MEMORY_FLAGS | Py_TPFLAGS_BASETYPE,
    .slots = usm_shared_slots,
};
static PyType_Spec mapping_spec = {
    .name = "usmipc.memory.MemoryIPCDevice",
    .basicsize = sizeof(Mem),
    .flags = MEMORY_FLAGS | Py_TPFLAGS_DISALLOW_INSTANTIATION,
    .slots = mapping_slots,
};

/* ---- MemoryPool ------------------------------------------------------------
 * usmipc.memory.MemoryPool(nbytes=0, device=None, queue=None, ipc=None): a
 * C pool (usmipc_pool_create, docs/pools.md); allocate(nbytes,
 * alignment=0) gives a MemoryUSMDevice block whose IPCMemoryHandle is the
 * small block handle. Blocks keep the pool alive; a block goes back to the
 * pool when its memory object is freed. */

typedef struct pool_object {
  PyObject_HEAD usmipc_pool_t *pool;
  PyObject *device; /* usmipc.Device */
  PyObject *queue;  /* usmipc.Queue for the blocks' copies */
  Py_ssize_t capacity;
} Pool;

static PyObject *pool_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
  static char *kwlist[] = {"nbytes", "device", "queue", "ipc", NULL};
  Py_ssize_t nbytes = 0;
  PyObject *device_arg = NULL, *queue_arg = NULL;
  const char *ipc = NULL;
  if (!PyArg_ParseTupleAndKeywords(args, kwds, "|n$OOz:MemoryPool", kwlist,
                                   &nbytes, &device_arg, &queue_arg, &ipc)) {
    pyusmipc_retype_parse_error();
    return NULL;
  }
  if (nbytes < 0) {
    pyusmipc_value_error("nbytes must be 0 (64 MiB) or positive, "
                         "not %zd",
                         nbytes);
    return NULL;
  }
  unsigned flags;
  if (ipc_flags(ipc, &flags) < 0) {
    return NULL;
  }
  pyusmipc_module_state_t *st = pyusmipc_state_from_type(type);
  if (st == NULL) {
    return NULL;
  }
  PyObject *device_obj = NULL, *queue_obj = NULL;
  if (device_and_queue(st, device_arg, queue_arg, &device_obj, &queue_obj) <
      0) {
    return NULL;
  }
  Pool *self = (Pool *)pyusmipc_object_alloc(type);
  if (self == NULL) {
    Py_DECREF(device_obj);
    Py_DECREF(queue_obj);
    return NULL;
  }
  self->device = device_obj;
  self->queue = queue_obj;
  self->capacity = nbytes;
  int rc = usmipc_pool_create(((pyusmipc_device_object_t *)device_obj)->device,
                              (size_t)nbytes, flags, &self->pool);
  if (rc < 0) {
    pyusmipc_raise(st, rc);
    Py_DECREF(self);
    return NULL;
  }
  return (PyObject *)self;
}

static PyObject *pool_allocate(PyObject *op, PyObject *args, PyObject *kwds) {
  static char *kwlist[] = {"nbytes", "alignment", NULL};
  Pool *pool = (Pool *)op;
  Py_ssize_t nbytes, alignment = 0;
  if (!PyArg_ParseTupleAndKeywords(args, kwds, "n|n:allocate", kwlist, &nbytes,
                                   &alignment)) {
    pyusmipc_retype_parse_error();
    return NULL;
  }
  if (nbytes <= 0 || alignment < 0) {
    pyusmipc_value_error(
        "nbytes must be positive and alignment 0 or a power of two, "
        "not %zd and %zd",
        nbytes, alignment);
    return NULL;
  }
  pyusmipc_module_state_t *st = pyusmipc_state_from_device(pool->device);
  Mem *self = memory_new(st->MemoryUSMDeviceType, pool->device, pool->queue,
                         nbytes, USMIPC_MEM_DEVICE);
  if (self == NULL) {
    return NULL;
  }
  void *ptr = NULL;
  int rc;
  usmipc_pool_t *p = pool->pool;
  Py_BEGIN_ALLOW_THREADS
  rc = usmipc_pool_malloc(p, (size_t)nbytes, (size_t)alignment, &ptr);
  Py_END_ALLOW_THREADS
  if (rc < 0) {
    pyusmipc_raise(st, rc);
    Py_DECREF(self);
    return NULL;
  }
  self->ptr = ptr;
  self->pool = Py_NewRef(op);
  return (PyObject *)self;
}

static PyObject *pool_get_device(PyObject *op, void *closure) {
  (void)closure;
  return Py_NewRef(((Pool *)op)->device);
}

static PyObject *pool_repr(PyObject *op) {
  Pool *self = (Pool *)op;
  return PyUnicode_FromFormat("<usmipc.memory.MemoryPool on %R>", self->device);
}

static int pool_traverse(PyObject *op, visitproc visit, void *arg) {
  Pool *self = (Pool *)op;
  Py_VISIT(Py_TYPE(op));
  Py_VISIT(self->device);
  Py_VISIT(self->queue);
  return 0;
}

static void pool_dealloc(PyObject *op) {
  Pool *self = (Pool *)op;
  PyObject_GC_UnTrack(op);
  /* Every block held a reference: none is live now. */
  PYUSMIPC_DESTROY_WITHOUT_GIL(usmipc_pool_t, self->pool, usmipc_pool_destroy);
  Py_CLEAR(self->device);
  Py_CLEAR(self->queue);
  pyusmipc_object_free(op);
}

static PyMethodDef pool_methods[] = {
    {"allocate", PYUSMIPC_CMETHOD(pool_allocate), METH_VARARGS | METH_KEYWORDS,
     "allocate($self, /, nbytes, alignment=0)\n--\n\nA block of the pool "
     "as a MemoryUSMDevice (aligned to alignment, 0: 256\nbytes); its "
     "IPCMemoryHandle is a block handle, which importers open with\na "
     "lookup once they mapped the block's segment. Freed with the memory\n"
     "object; the pool lives as long as one of its blocks does."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef pool_getset[] = {
    {"device", pool_get_device, NULL, "The pool's Device.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot pool_slots[] = {
    {Py_tp_doc,
     (void *)"MemoryPool(nbytes=0, *, device=None, queue=None, ipc=None)\n--"
             "\n\nA pool of device memory whose blocks are shared at the "
             "cost of one\nexport per segment (docs/pools.md): the first "
             "segment has nbytes (0:\n64 MiB), each next one twice the last "
             "up to 1 GiB. Whoever holds a\nblock's handle can map its whole "
             "segment: use separate pools to keep\nconsumers apart."},
    {Py_tp_new, pool_new},
    {Py_tp_dealloc, pool_dealloc},
    {Py_tp_traverse, pool_traverse},
    {Py_tp_methods, pool_methods},
    {Py_tp_getset, pool_getset},
    {Py_tp_repr, pool_repr},
    {0, NULL},
};

static PyType_Spec pool_spec = {
    .name = "usmipc.memory.MemoryPool",
    .basicsize = sizeof(Pool),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = pool_slots,
};

static PyTypeObject *make_subtype(PyObject *module, PyType_Spec *spec,
                                  PyTypeObject *base) {
  PyTypeObject *type =
      (PyTypeObject *)PyType_FromModuleAndSpec(module, spec, (PyObject *)base);
  if (type == NULL) {
    return NULL;
  }
  if (PyModule_AddType(module, type) < 0) {
    Py_DECREF(type);
    return NULL;
  }
  return type;
}

int pyusmipc_init_memory_types(PyObject *module, pyusmipc_module_state_t *st) {
  st->MemoryType =
      (PyTypeObject *)PyType_FromModuleAndSpec(module, &memory_spec, NULL);
  if (st->MemoryType == NULL || PyModule_AddType(module, st->MemoryType) < 0) {
    return -1;
  }
  st->MemoryUSMDeviceType =
      make_subtype(module, &usm_device_spec, st->MemoryType);
  if (st->MemoryUSMDeviceType == NULL) {
    return -1;
  }
  st->MemoryUSMHostType = make_subtype(module, &usm_host_spec, st->MemoryType);
  if (st->MemoryUSMHostType == NULL) {
    return -1;
  }
  st->MemoryUSMSharedType =
      make_subtype(module, &usm_shared_spec, st->MemoryType);
  if (st->MemoryUSMSharedType == NULL) {
    return -1;
  }
  /* A mapping is device memory: dpctl's MemoryIPCDevice is a subclass of
   * MemoryUSMDevice, and the seed's example checks for that. */
  st->MemoryIPCDeviceType =
      make_subtype(module, &mapping_spec, st->MemoryUSMDeviceType);
  if (st->MemoryIPCDeviceType == NULL) {
    return -1;
  }
  st->MemoryPoolType = make_subtype(module, &pool_spec, NULL);
  if (st->MemoryPoolType == NULL) {
    return -1;
  }
  return 0;
}
