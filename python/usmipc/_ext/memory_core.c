/* Floor 4 of the extension: the memory object's core, what every file that
 * operates on usmipc memory needs of it (interop.c's DLPack and array
 * interfaces, ipc_handle.c's exports, bundle.c's leaves), apart from the
 * memory types themselves (memory.c). The operation count that lets a
 * close wait for the operations running without the GIL
 * (pyusmipc_memory_begin / _end), the release of the memory, the queue its
 * copies use, and the copy helper. Calls queue.c, device.c and util.c
 * (module.c lists the floors).
 *
 * Lifetime: see memory.c. Every buffer export and every operation that runs
 * without the GIL is counted (exports); closing a mapping only marks it
 * closed while that count is non-zero, and the last one to end unmaps it. */
#include "memory_core.h"

#include "device.h"
#include "queue.h"
#include "util.h"

typedef pyusmipc_memory_object_t Mem;

const char *pyusmipc_kind_name(usmipc_mem_kind_t kind) {
  switch (kind) {
  case USMIPC_MEM_DEVICE:
    return "device";
  case USMIPC_MEM_HOST:
    return "host";
  case USMIPC_MEM_SHARED:
    return "shared";
  case USMIPC_MEM_UNKNOWN:
    break;
  }
  return "unknown";
}

/* Frees the allocation or unmaps the mapping now; the GIL is held on entry
 * and released around the call. Returns the library's code. */
int pyusmipc_memory_release(Mem *self) {
  if (self->ptr == NULL || self->released) {
    return 0;
  }
  self->released = 1;
  if (self->is_view) {
    return 0; /* the base owns the memory */
  }
  void *ptr = self->ptr;
  int is_mapping = self->is_mapping;
  int rc;
  Py_BEGIN_ALLOW_THREADS
  rc = is_mapping ? usmipc_ipc_close(ptr) : usmipc_free(ptr);
  Py_END_ALLOW_THREADS
  return rc;
}

/* Raises for a failed release and returns -1; the state comes from the
 * device, which a cleared object may lack. */
static int raise_release_error(Mem *self, int rc) {
  if (self->device != NULL) {
    pyusmipc_raise(pyusmipc_state_from_device(self->device), rc);
  } else {
    PyErr_Format(PyExc_RuntimeError, "usmipc: %s", usmipc_last_error());
  }
  return -1;
}

/* Starts an operation on the memory: refuses closed memory, then counts the
 * operation like a buffer export so that a concurrent close defers the
 * unmap. Returns 0, or -1 with ValueError set. */
int pyusmipc_memory_begin(Mem *self) {
  if (self->closed || self->released) {
    pyusmipc_value_error("mapping is closed");
    return -1;
  }
  if (self->ptr == NULL || self->device == NULL) {
    pyusmipc_value_error("memory object is not initialized");
    return -1;
  }
  self->exports++;
  return 0;
}

/* Ends an operation; performs a close that was requested meanwhile. Returns
 * 0, or -1 with an exception set if that deferred close failed. */
int pyusmipc_memory_end(Mem *self) {
  self->exports--;
  if (self->exports == 0 && self->closed && !self->released) {
    int rc = pyusmipc_memory_release(self);
    if (rc < 0) {
      return raise_release_error(self, rc);
    }
  }
  return 0;
}

/* The queue for copies and fills: the memory's own, else (mappings) the
 * default queue of its device, made on first use. Borrowed. */
usmipc_queue_t *pyusmipc_memory_queue(Mem *self) {
  if (self->queue == NULL) {
    PyObject *queue = pyusmipc_default_queue(
        pyusmipc_state_from_device(self->device), self->device);
    if (queue == NULL) {
      return NULL;
    }
    /* Making the queue may have released the GIL, and another thread may
     * have set one meanwhile. */
    if (self->queue == NULL) {
      self->queue = queue;
    } else {
      Py_DECREF(queue);
    }
  }
  return ((pyusmipc_queue_object_t *)self->queue)->queue;
}

PyObject *pyusmipc_memory_queue_object(Mem *self) {
  if (self->device == NULL) {
    pyusmipc_value_error("memory object is not initialized");
    return NULL;
  }
  if (pyusmipc_memory_queue(self) == NULL) {
    return NULL;
  }
  return self->queue;
}

/* ---- the copy helper ---------------------------------------------------- */

/* Copies n bytes from src to dst, or (src NULL) fills them with value, on
 * the memory's queue and waits, the GIL released; an operation on the
 * memory (pyusmipc_memory_begin and _end: closed memory is refused, a close
 * meanwhile waits for it). n 0 copies nothing. source (or NULL) is the
 * caller's buffer of src, released before the operation ends (it may be an
 * export of this memory). 0, or -1 with an exception set. */
int pyusmipc_memory_run(Mem *self, void *dst, const void *src, int value,
                        size_t n, Py_buffer *source) {
  if (pyusmipc_memory_begin(self) < 0) {
    if (source != NULL) {
      PyBuffer_Release(source);
    }
    return -1;
  }
  usmipc_queue_t *queue = pyusmipc_memory_queue(self);
  int rc = 0;
  if (queue != NULL && n > 0) {
    Py_BEGIN_ALLOW_THREADS
    rc = src != NULL ? usmipc_memcpy(queue, dst, src, n)
                     : usmipc_memset(queue, dst, value, n);
    if (rc == 0) {
      rc = usmipc_queue_synchronize(queue);
    }
    Py_END_ALLOW_THREADS
    if (rc < 0) {
      pyusmipc_raise(pyusmipc_state_from_device(self->device), rc);
    }
  }
  if (source != NULL) {
    PyBuffer_Release(source);
  }
  int failed = queue == NULL || rc < 0;
  if (pyusmipc_memory_end(self) < 0 || failed) {
    return -1;
  }
  return 0;
}

/* Copies all nbytes of the memory to dst. Returns 0 or -1 (exception set). */
static int copy_out(Mem *self, void *dst) {
  return pyusmipc_memory_run(self, dst, self->ptr, 0, (size_t)self->nbytes,
                             NULL);
}

int pyusmipc_memory_copy_out(Mem *self, void *dst) {
  return copy_out(self, dst);
}
