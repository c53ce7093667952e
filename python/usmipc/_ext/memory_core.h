/* Floor 4 of the extension usmipc._usmipc (memory_core.c): the memory
 * object's struct and what every file that operates on usmipc memory needs
 * of it; the memory types themselves are memory.c's (floor 6). */
#ifndef PYUSMIPC_MEMORY_CORE_H
#define PYUSMIPC_MEMORY_CORE_H

#include "util.h"

typedef struct pyusmipc_memory_object {
  PyObject_HEAD void *ptr;
  Py_ssize_t nbytes;
  usmipc_mem_kind_t kind;
  usmipc_backend_t backend;
  char is_mapping;      /* opened by IPCMemoryHandle.open (MemoryIPCDevice) */
  char closed;          /* close requested: no new operation may start */
  char released;        /* usmipc_free / usmipc_ipc_close done */
  char host_accessible; /* may be exported through the buffer protocol */
  /* Buffer exports plus operations in progress without the GIL. The memory
   * is released only when this drops to zero after close. */
  Py_ssize_t exports;
  PyObject *device; /* usmipc.Device */
  PyObject *queue;  /* usmipc.Queue, or NULL until first needed (mappings) */
  /* Mappings opened with a device-side wait (IPCMemoryHandle.open with a
   * stream, ordered): the handle bytes, from which __dlpack__(stream=...)
   * opens the producer's event on first need (order_event) to make the
   * consumer's stream wait for it too. Both NULL otherwise, and
   * order_handle is dropped once known to carry no event. */
  PyObject *order_handle;
  usmipc_event_t *order_event;
  /* Mappings whose handle bytes carry a release ticket (the producer asked
   * for one): the bytes, until the ticket is returned (release(), or
   * close_mapping / close, which return it from the host). */
  PyObject *release_handle;
  /* While release_handle is set: this mapping's place in the list of
   * mappings whose ticket has not gone back (memory.c), which the process
   * returns as it exits. GIL held. */
  struct pyusmipc_memory_object *ticket_prev, *ticket_next;
  char ticket_listed;
  /* A block of a MemoryPool: the pool, kept alive until the block is
   * returned (usmipc_free gives it back). NULL otherwise. */
  PyObject *pool;
  /* Memory made without a copy from another object (MemoryUSMDevice(obj),
   * obj usmipc memory or exposing __sycl_usm_array_interface__): is_view
   * is set, and base (dpctl's reference_obj) owns the memory, which this
   * object neither frees nor unmaps. When base is usmipc memory, this
   * object holds one of its exports (base_export, as a memoryview would),
   * so that closing a mapping defers its unmap until this view is gone. */
  char is_view;
  char base_export;
  PyObject *base;
} pyusmipc_memory_object_t;

/* "device", "host", "shared", or "unknown": the name of a memory kind in
 * messages and in usm_type. */
const char *pyusmipc_kind_name(usmipc_mem_kind_t kind);
/* Starts an operation that will run without the GIL: refuses closed memory
 * (ValueError "mapping is closed") and counts the operation like a buffer
 * export, so that a concurrent close defers the unmap. 0 or -1. */
int pyusmipc_memory_begin(pyusmipc_memory_object_t *mem);
/* Ends it, performing a close requested meanwhile. 0 or -1. */
int pyusmipc_memory_end(pyusmipc_memory_object_t *mem);
/* Copies all nbytes of the memory to dst (host memory), then waits; the
 * GIL is released meanwhile. 0, or -1 with an exception set. */
int pyusmipc_memory_copy_out(pyusmipc_memory_object_t *mem, void *dst);
/* The Queue object the memory's copies use (its own, or for a mapping its
 * device's default queue, made on first use). Borrowed; NULL with an
 * exception set. */
PyObject *pyusmipc_memory_queue_object(pyusmipc_memory_object_t *mem);
/* Frees the allocation or unmaps the mapping now (once; a view's base owns
 * its memory); the GIL is held on entry and released around the call.
 * Returns the library's code. */
int pyusmipc_memory_release(pyusmipc_memory_object_t *mem);
/* The native queue of pyusmipc_memory_queue_object. Borrowed; NULL with an
 * exception set. */
usmipc_queue_t *pyusmipc_memory_queue(pyusmipc_memory_object_t *mem);
/* Copies n bytes from src to dst, or (src NULL) fills them with value, on
 * the memory's queue and waits, the GIL released, as an operation on the
 * memory (pyusmipc_memory_begin and _end). n 0 copies nothing. source (or
 * NULL) is the caller's buffer of src, released before the operation ends
 * (it may be an export of this memory). 0, or -1 with an exception set. */
int pyusmipc_memory_run(pyusmipc_memory_object_t *mem, void *dst,
                        const void *src, int value, size_t n,
                        Py_buffer *source);

#endif /* PYUSMIPC_MEMORY_CORE_H */
