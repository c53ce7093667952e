/* Private declarations shared by the C files of the extension usmipc._usmipc.
 *
 * One C file per Python type (python-zstandard's layout): module.c (module
 * state, errors, module functions), device.c, queue.c, memory.c,
 * ipc_handle.c, event.c (Event and IPCEventHandle). Each type file has an init
 * function that creates its heap type with PyType_FromModuleAndSpec and stores
 * it in the module state.
 *
 * The extension is built against the limited API of CPython 3.11
 * (Py_LIMITED_API=0x030B0000, abi3): no struct access to PyTypeObject, no
 * PyType_GetModuleByDef (limited only from 3.13). Methods that need the
 * module state are PyCMethods (METH_METHOD) and use their defining class;
 * slot functions walk the type's bases (pyusmipc_state_from_type) or reach the
 * state through the Device object they hold, whose type is never subclassed.
 */
#ifndef PYUSMIPC_PY_EXT_H
#define PYUSMIPC_PY_EXT_H

#include "util.h"

#include <pthread.h>

#include "dlpack.h"

/* ---- device.c ------------------------------------------------------------ */

typedef struct pyusmipc_device_object {
  PyObject_HEAD usmipc_device_t *device;
} pyusmipc_device_object_t;

int pyusmipc_init_device_type(PyObject *module, pyusmipc_module_state_t *st);

/* One entry per usmipc_device_t seen by this module: its Python Device
 * object (devices live as long as the process, so one object per device)
 * and the device's default Queue, created on first use. */
typedef struct pyusmipc_device_slot {
  usmipc_device_t *device;
  PyObject *device_obj;   /* strong: usmipc.Device */
  PyObject *queue_obj;    /* strong or NULL: usmipc.Queue, the default queue */
  signed char has_events; /* -1 not probed yet, else 0 or 1 */
} pyusmipc_device_slot_t;

/* The cache's entry of device, or NULL if no Device object was made for it
 * yet. The array may move when a Device object is made: look the entry up
 * again after anything that may run Python code. */
pyusmipc_device_slot_t *pyusmipc_device_slot(pyusmipc_module_state_t *st,
                                             usmipc_device_t *device);
/* The Device object for device (new reference). */
PyObject *pyusmipc_device_object(pyusmipc_module_state_t *st,
                               usmipc_device_t *device);
/* 1 if the device's backend has events (so memory handles can be ordered),
 * 0 if not (USMIPC_ENOTSUP: Level Zero for now), -1 with an exception set.
 * Probed once per device with an event created and destroyed. */
int pyusmipc_device_has_events(pyusmipc_module_state_t *st, PyObject *device_obj);

/* The devices of every available backend, the first PYUSMIPC_MAX_DEVICES
 * of them, into devices: 0 with *count set, or -1 with the library's error
 * raised. */
#define PYUSMIPC_MAX_DEVICES 64
int pyusmipc_list_devices(pyusmipc_module_state_t *st,
                          usmipc_device_t *devices[PYUSMIPC_MAX_DEVICES],
                          size_t *count);
/* The Device object a handle's info names, if this process has it (new
 * reference); Py_None (new reference) if not; NULL with an exception. */
PyObject *pyusmipc_device_of_info(pyusmipc_module_state_t *st,
                                const usmipc_ipc_handle_info_t *info);
/* The module state, reached through a Device object (its type is final and
 * was created by this module, so this never fails). */
static inline pyusmipc_module_state_t *pyusmipc_state_from_device(PyObject *dev) {
  return (pyusmipc_module_state_t *)PyType_GetModuleState(Py_TYPE(dev));
}
/* Converts None (the default device), a Device, a Queue (its device) or a
 * filter string into a Device object (new reference). */
PyObject *pyusmipc_device_from_arg(pyusmipc_module_state_t *st, PyObject *arg);
/* The same for a device= whose None (or absence: arg NULL) means no device
 * given: 0 with *device_obj NULL, or a new reference (and *device, unless
 * device is NULL, its usmipc device); -1 with an exception set. */
int pyusmipc_optional_device_arg(pyusmipc_module_state_t *st, PyObject *arg,
                               PyObject **device_obj,
                               usmipc_device_t **device);

/* ---- handle_bytes.c ------------------------------------------------------ */

/* The serialized bytes (*data, *len: the handle's own, valid while it
 * lives) and the decoded *info of a library handle, after rc, the code of
 * the call that made it (an error is returned as it is). Needs no GIL: the
 * exporting constructors call it in the same GIL-free stretch as that
 * call. */
static inline int pyusmipc_handle_describe(int rc, usmipc_ipc_handle_t *handle,
                                         const void **data, size_t *len,
                                         usmipc_ipc_handle_info_t *info) {
  if (rc == 0) {
    rc = usmipc_ipc_handle_data(handle, data, len);
  }
  if (rc == 0) {
    rc = usmipc_ipc_handle_inspect(*data, *len, info);
  }
  return rc;
}
/* Getters (PyGetSetDef) of the fields IPCMemoryHandle and IPCEventHandle
 * decode from their bytes, backend and device_uuid: their closure is
 * PYUSMIPC_INFO_OF(the object's struct), where its info member lies. */
PyObject *pyusmipc_info_get_backend(PyObject *self, void *closure);
PyObject *pyusmipc_info_get_device_uuid(PyObject *self, void *closure);
#define PYUSMIPC_INFO_OF(type) ((void *)(uintptr_t)offsetof(type, info))
/* The info dict of IPCMemoryHandle.inspect() (shared with IPCEventHandle). */
PyObject *pyusmipc_handle_info_dict(const usmipc_ipc_handle_info_t *info,
                                  Py_ssize_t len);

/* Handle bytes taken from an argument of IPCMemoryHandle's or
 * IPCEventHandle's methods: bytes, any buffer, or a handle object (its
 * bytes). data and len stay valid until pyusmipc_handle_bytes_release. */
typedef struct pyusmipc_handle_bytes {
  const char *data;
  Py_ssize_t len;
  PyObject *arg;  /* the argument (borrowed) */
  PyObject *keep; /* new reference: the bytes object holding data, or NULL */
  Py_buffer view; /* the argument's buffer, when have_view */
  int have_view;
} pyusmipc_handle_bytes_t;
/* Fills *hb from bytes (a bytes object, stolen, also on failure) that the
 * handle object obj gave. 0, or -1 with an exception set. */
int pyusmipc_handle_bytes_of(PyObject *obj, PyObject *bytes,
                           pyusmipc_handle_bytes_t *hb);
/* Fills *hb from obj given as bytes or any buffer; for anything else raises
 * usmipc.ArgumentTypeError: other_message for a handle object of
 * other_type (the other kind of handle), else "expected <expected>, not
 * <obj's type>". 0 or -1. A reader first takes its own handle objects
 * (pyusmipc_handle_bytes_of), then calls this. */
int pyusmipc_handle_bytes_read(PyObject *obj, pyusmipc_handle_bytes_t *hb,
                             PyTypeObject *other_type,
                             const char *other_message, const char *expected);
/* The bytes as a bytes object for a handle or mapping to keep (new
 * reference): the handle object's, the argument if it is exactly bytes,
 * else a copy. */
PyObject *pyusmipc_handle_bytes_object(const pyusmipc_handle_bytes_t *hb);
/* Releases the buffer and the bytes *hb holds. */
void pyusmipc_handle_bytes_release(pyusmipc_handle_bytes_t *hb);
/* from_bytes() of both handle types: decodes *hb into *info and returns
 * the bytes object the new handle keeps (pyusmipc_handle_bytes_object).
 * want_event says which kind of handle the caller makes (1: an event's, 0:
 * memory's); bytes of the other kind raise usmipc.ArgumentError
 * wrong_kind, invalid bytes the library's error. NULL then. */
PyObject *pyusmipc_handle_bytes_decode(pyusmipc_module_state_t *st,
                                     const pyusmipc_handle_bytes_t *hb,
                                     usmipc_ipc_handle_info_t *info,
                                     int want_event, const char *wrong_kind);
/* After a failed open of handle bytes (data, len; data may be NULL) with
 * code rc: for USMIPC_EINVAL on bytes that decode as a handle of the other
 * kind (want_event as above), usmipc.ArgumentError wrong_kind; otherwise
 * the library's error. Returns NULL. */
PyObject *pyusmipc_raise_open_error(pyusmipc_module_state_t *st, int rc,
                                  const char *data, Py_ssize_t len,
                                  int want_event, const char *wrong_kind);

/* ---- queue.c ------------------------------------------------------------- */

typedef struct pyusmipc_queue_object {
  PyObject_HEAD usmipc_queue_t *queue;
  PyObject *device; /* usmipc.Device */
  /* For a queue wrapping another library's stream (Queue.from_stream): the
   * Python object owning that stream, kept alive as long as the wrapper
   * (the wrapper does not own the native stream). NULL otherwise. */
  PyObject *stream;
} pyusmipc_queue_object_t;

int pyusmipc_init_queue_type(PyObject *module, pyusmipc_module_state_t *st);
/* The default Queue of a Device object, created on first use (new ref). */
PyObject *pyusmipc_default_queue(pyusmipc_module_state_t *st, PyObject *device_obj);
/* The stream another library's array is used on now, for ordering its
 * handoffs: torch.cuda.current_stream(tensor.device), CuPy's current
 * stream; Py_None for other arrays. New reference, or NULL. */
PyObject *pyusmipc_foreign_current_stream(PyObject *obj);
/* A new Queue on a Device object. */
PyObject *pyusmipc_queue_new(pyusmipc_module_state_t *st, PyObject *device_obj);
/* The one resolver behind every stream= argument and Queue.from_stream:
 * obj is a usmipc.Queue (returned as is), a torch.cuda.Stream, a CuPy
 * stream, an object with __cuda_stream__, or an int (a native stream
 * handle: a CUstream on CUDA, 0 the legacy default stream). device (a
 * Device object, or NULL) is the device= the caller gave: it overrides the
 * CUDA ordinal a stream object names. fallback (a Device object, or NULL)
 * is the device of the operation (the event, the memory), used for ints
 * and for stream objects that do not name their GPU. what names the
 * caller in messages ("Event.record()"). A new reference, or NULL with an
 * exception set. Imports nothing: torch and CuPy objects are recognized
 * by their type's module. */
PyObject *pyusmipc_queue_from_stream(pyusmipc_module_state_t *st, PyObject *obj,
                                   PyObject *device, PyObject *fallback,
                                   const char *what);
/* 1 if the module of obj's type is package or one of its submodules
 * ("torch" for torch.cuda.streams.Stream); never imports anything. */
int pyusmipc_type_module_is(PyObject *obj, const char *package);
/* A Queue wrapping the native stream handle native on device_obj, keeping
 * keep (or NULL) alive; ValueError for a non-zero handle on the host. */
PyObject *pyusmipc_queue_wrap(pyusmipc_module_state_t *st, PyObject *device_obj,
                            void *native, PyObject *keep, const char *what);

/* ---- memory_core.c ------------------------------------------------------- */

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

/* ---- interop.c ----------------------------------------------------------- */

/* _Memory.__sycl_usm_array_interface__: dpctl's dict (data (address, False:
 * not read-only), shape (nbytes,), strides None, typestr '|u1', version 1,
 * syclobj the memory's Queue); a closed mapping describes 0 bytes at 0. */
PyObject *pyusmipc_memory_suai(PyObject *self, void *closure);

/* What another object's __sycl_usm_array_interface__ describes, checked
 * against what usmipc knows of the pointer (usmipc_pointer_query): the
 * byte range the array spans, the memory's kind, and the device (and the
 * Queue, when syclobj is one) it belongs to. */
typedef struct pyusmipc_suai {
  void *ptr;        /* the array's lowest byte */
  Py_ssize_t nbytes; /* bytes from ptr to its highest byte, inclusive */
  usmipc_mem_kind_t kind;
  int readonly;     /* data[1] */
  PyObject *device; /* new reference: usmipc.Device */
  PyObject *queue;  /* new reference: usmipc.Queue, or NULL */
} pyusmipc_suai_t;
/* Reads obj's __sycl_usm_array_interface__: 1 with *out filled, 0 if obj
 * has no such attribute, -1 with an exception set (usmipc.ArgumentError for
 * a malformed interface, a syclobj that is not usmipc's, or a pointer that
 * is not memory of that device). what names the caller in messages. */
int pyusmipc_suai_read(pyusmipc_module_state_t *st, PyObject *obj,
                     const char *what, pyusmipc_suai_t *out);

/* The DLPack device of memory of kind on a device of backend whose
 * usmipc_device_index is index: on CUDA kDLCUDA (device memory),
 * kDLCUDAHost or kDLCUDAManaged; on Level Zero kDLOneAPI; on the host the
 * CPU. */
DLDevice pyusmipc_dl_device(usmipc_backend_t backend, usmipc_mem_kind_t kind,
                          int index);
/* The destructor of the DLPack capsules usmipc exports (memory objects,
 * shared arrays): a capsule no consumer took deletes its tensor, keeping a
 * pending exception aside meanwhile. */
void pyusmipc_dl_capsule_destructor(PyObject *capsule);

/* _Memory.__dlpack_device__(), __dlpack__(...), __cuda_array_interface__. */
PyObject *pyusmipc_memory_dlpack_device(PyObject *self, PyObject *ignored);
PyObject *pyusmipc_memory_dlpack(PyObject *self, PyObject *const *args,
                               Py_ssize_t nargs, PyObject *kwnames);
PyObject *pyusmipc_memory_cuda_array_interface(PyObject *self, void *closure);
/* The byte range of an object with a C-contiguous __cuda_array_interface__:
 * 1 with *ptr and *nbytes set, 0 if obj has no such interface, -1 with an
 * exception set. */
int pyusmipc_cuda_array_range(PyObject *obj, void **ptr, Py_ssize_t *nbytes);
/* The byte range of an object with __dlpack__ whose tensor is C-contiguous
 * CUDA device memory (or usmipc's own device memory on the CPU): 1 with
 * *ptr, *nbytes and *owner set, 0 if obj has no __dlpack__, -1 with an
 * exception set (ValueError for a strided tensor, TypeError for memory that
 * is not device memory). The capsule is consumed; *owner (a new reference)
 * owns the tensor, and dropping it calls the producer's deleter, which
 * keeps the producer's memory alive until then. */
int pyusmipc_dlpack_range(PyObject *obj, void **ptr, Py_ssize_t *nbytes,
                        PyObject **owner);

/* Reads obj's __dlpack__ tensor: 1 with *tensor, *flags and *owner (a new
 * reference owning the tensor: dropping it calls the producer's deleter)
 * set, 0 if obj has no __dlpack__, -1 with an exception set. The tensor's
 * shape and strides stay valid while *owner lives. */
int pyusmipc_dlpack_read(PyObject *obj, void *tensor, uint64_t *flags,
                       PyObject **owner);

/* ---- memory.c ------------------------------------------------------------ */

int pyusmipc_init_memory_types(PyObject *module, pyusmipc_module_state_t *st);
/* Wraps an open IPC mapping in a new MemoryIPCDevice (steals nothing; on
 * failure the caller still owns the mapping). */
PyObject *pyusmipc_mapping_new(pyusmipc_module_state_t *st, PyObject *device_obj,
                             void *ptr, size_t nbytes);
/* Closes a MemoryIPCDevice (idempotent); the unmap waits for the last
 * buffer export. Returns 0, or -1 with an exception set. */
int pyusmipc_mapping_close(pyusmipc_module_state_t *st,
                         pyusmipc_memory_object_t *mem);
/* Returns a mapping's release ticket, if it has one not returned yet, after
 * the work submitted to queue (NULL: now). A producer that no longer waits
 * (gone, or its handle freed) is not an error. 0, or -1 with an exception
 * set. */
int pyusmipc_mapping_release(pyusmipc_module_state_t *st, pyusmipc_memory_object_t *m,
                           usmipc_queue_t *queue);

/* ---- ipc_handle.c -------------------------------------------------------- */

int pyusmipc_init_ipc_handle_type(PyObject *module, pyusmipc_module_state_t *st);
/* usmipc.set_ipc_cache_size(entries), which
 * IPCMemoryHandle.set_cache_size(entries) is too. */
PyObject *pyusmipc_set_ipc_cache_size(pyusmipc_module_state_t *st, PyObject *arg);

/* ---- bundle.c ------------------------------------------------------------ */

/* A SharedBundle: the producer's, from share() (bundle set), or one made
 * from bytes (unpickled: bytes set). */
typedef struct pyusmipc_bundle_object {
  PyObject_HEAD usmipc_bundle_t *bundle; /* NULL: made from bytes */
  PyObject *keep;   /* list of the leaves' sources */
  PyObject *queue;  /* usmipc.Queue each to_bytes() orders on, or NULL */
  PyObject *device; /* usmipc.Device of the memory, or NULL */
  PyObject *bytes;  /* a bundle made from bytes (unpickled) */
  Py_ssize_t arrays, allocations;
  char release; /* release=True: every handoff carries a release ticket */
  /* One thread at a time rewrites the library's bytes (a handoff's event
   * and ticket) and copies them out, without the GIL: two interleaved
   * handoffs would otherwise send one ticket twice and lose the other,
   * which the producer would then wait for in vain. */
  pthread_mutex_t order_lock;
  char lock_ready;
} pyusmipc_bundle_object_t;

/* The type SharedBundle. */
int pyusmipc_init_bundle_type(PyObject *module, pyusmipc_module_state_t *st);
/* usmipc.share(obj, stream=None, ordered=None, release=False) and the
 * module's _bundle_from_bytes(bytes) (unpickling), for module.c's table. */
PyObject *pyusmipc_share(PyObject *module, PyObject *const *args,
                         Py_ssize_t nargs, PyObject *kwnames);
PyObject *pyusmipc_bundle_from_bytes(PyObject *module, PyObject *arg);
/* SharedBundle.to_bytes(): the bytes of the next handoff (new reference). */
PyObject *pyusmipc_bundle_to_bytes(PyObject *op, PyObject *ignored);

/* A dtype that travels in a bundle: its names in each protocol, and its
 * DLPack code and bits. */
typedef struct pyusmipc_dtype {
  const char *name;      /* SharedArray.dtype */
  const char *torch;     /* str(torch dtype) */
  const char *typestr;   /* __cuda_array_interface__, without byte order */
  const char *format;    /* buffer protocol, NULL: none */
  uint8_t code, bits;
} pyusmipc_dtype_t;
/* The dtype of DLPack code and bits, or NULL if none travels. */
const pyusmipc_dtype_t *pyusmipc_dtype_by_code(uint8_t code, uint8_t bits);

/* ---- shared_array.c ------------------------------------------------------ */

/* The type SharedArray. */
int pyusmipc_init_shared_array_type(PyObject *module,
                                    pyusmipc_module_state_t *st);
/* usmipc.open_shared, close_shared and release_shared, for module.c's
 * table. */
PyObject *pyusmipc_open_shared(PyObject *module, PyObject *const *args,
                               Py_ssize_t nargs, PyObject *kwnames);
PyObject *pyusmipc_close_shared(PyObject *module, PyObject *const *args,
                                Py_ssize_t nargs, PyObject *kwnames);
PyObject *pyusmipc_release_shared(PyObject *module, PyObject *const *args,
                                  Py_ssize_t nargs, PyObject *kwnames);

/* ---- event.c ------------------------------------------------------------- */

typedef struct pyusmipc_event_object {
  PyObject_HEAD usmipc_event_t *event;
  PyObject *device; /* usmipc.Device */
  char opened;      /* opened from a handle: waits only, cannot record */
} pyusmipc_event_object_t;

int pyusmipc_init_event_types(PyObject *module, pyusmipc_module_state_t *st);
/* usmipc.set_event_timeout(seconds) (module.c's method table). */
PyObject *pyusmipc_set_event_timeout(PyObject *module, PyObject *arg);

#endif /* PYUSMIPC_PY_EXT_H */
