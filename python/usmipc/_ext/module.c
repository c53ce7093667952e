/* Floor 9 of the extension usmipc._usmipc, the top: module initialization
 * (PEP 489 multi-phase), the module state's exceptions and lifecycle, the
 * interrupt hook that lets Ctrl-C end an open or an event wait, and the
 * module functions get_devices(), backends(), set_ipc_cache_size()
 * (ipc_handle.c), set_ipc_cache_bytes(), set_ipc_timeout(),
 * set_event_timeout() (event.c), share() (bundle.c), open_shared(),
 * close_shared(), release_shared() (shared_array.c), stats(),
 * reset_stats(), and for the PyTorch allocator _torch_pool_info() and
 * _last_error() (usmipc.memory).
 *
 * The floors of the extension: each file calls only files on lower floors,
 * and includes only its own header and those of lower floors (one header
 * per file; a header includes only lower ones).
 *
 *   9  module.c         module init and module functions
 *   8  torch_reduce.c   usmipc.torch's per-tensor step (_TorchMessage)
 *      torch_rebuild.c  usmipc.torch's per-tensor step on the receiver
 *   7  ipc_handle.c     IPCMemoryHandle
 *      shared_array.c   open_shared(), SharedArray (bundles, consumer's side)
 *      update.c         _CopyPlan (UpdatePlan's one call), _bundle_paths
 *   6  memory.c         the memory types of usmipc.memory, MemoryPool
 *      bundle.c         share(), SharedBundle (bundles, producer's side)
 *   5  interop.c        DLPack and the array interfaces, both ways
 *   4  memory_core.c    the memory object's core: operation count, copies
 *      event.c          Event, IPCEventHandle
 *   3  queue.c          Queue, default queues, stream= arguments
 *   2  device.c         Device, the per-device cache
 *      handle_bytes.c   handle bytes both handle types take and show
 *   1  util.c           state lookup, errors, argument parsing
 *      torch_readers.c  torch's own C readers of a tensor and a storage
 *      dlpack.h         the DLPack structures
 */
#include "bundle.h"
#include "device.h"
#include "event.h"
#include "ipc_handle.h"
#include "memory.h"
#include "memory_core.h"
#include "queue.h"
#include "shared_array.h"
#include "torch_rebuild.h"
#include "torch_reduce.h"
#include "update.h"
#include "util.h"

#include <limits.h>
#include <math.h>
#include <string.h>

/* ---- module functions ---------------------------------------------------- */

static PyObject *get_devices(PyObject *module, PyObject *Py_UNUSED(ignored)) {
  pyusmipc_module_state_t *st = PyModule_GetState(module);
  usmipc_device_t *stack[16];
  usmipc_device_t **devices = stack;
  size_t count = 0;
  int rc = usmipc_get_devices(stack, 16, &count);
  if (rc < 0) {
    return pyusmipc_raise(st, rc);
  }
  if (count > 16) {
    devices = PyMem_Malloc(count * sizeof(*devices));
    if (devices == NULL) {
      return PyErr_NoMemory();
    }
    size_t capacity = count;
    rc = usmipc_get_devices(devices, capacity, &count);
    if (rc < 0) {
      PyMem_Free(devices);
      return pyusmipc_raise(st, rc);
    }
    if (count > capacity) {
      count = capacity; /* devices are probed once; cannot grow */
    }
  }
  PyObject *list = PyList_New(0);
  for (size_t i = 0; list != NULL && i < count; i++) {
    PyObject *obj = pyusmipc_device_object(st, devices[i]);
    if (obj == NULL || PyList_Append(list, obj) < 0) {
      Py_XDECREF(obj);
      Py_CLEAR(list);
      break;
    }
    Py_DECREF(obj);
  }
  if (devices != stack) {
    PyMem_Free(devices);
  }
  return list;
}

static PyObject *backends(PyObject *module, PyObject *Py_UNUSED(ignored)) {
  (void)module;
  static const usmipc_backend_t all[] = {
      USMIPC_BACKEND_HOST, USMIPC_BACKEND_CUDA, USMIPC_BACKEND_LEVEL_ZERO};
  PyObject *result = PyDict_New();
  if (result == NULL) {
    return NULL;
  }
  for (size_t i = 0; i < sizeof(all) / sizeof(all[0]); i++) {
    const char *reason = NULL;
    int rc = usmipc_backend_status(all[i], &reason);
    if (rc < 0 && (reason == NULL || reason[0] == '\0')) {
      reason = usmipc_last_error();
      if (reason == NULL || reason[0] == '\0') {
        reason = usmipc_strerror(rc);
      }
    }
    PyObject *entry;
    if (rc == 0) {
      entry = Py_BuildValue("(OO)", Py_True, Py_None);
    } else {
      entry = Py_BuildValue("(Os)", Py_False, reason);
    }
    if (entry == NULL ||
        PyDict_SetItemString(result, usmipc_backend_name(all[i]), entry) < 0) {
      Py_XDECREF(entry);
      Py_DECREF(result);
      return NULL;
    }
    Py_DECREF(entry);
  }
  return result;
}

static PyObject *set_ipc_cache_size(PyObject *module, PyObject *arg) {
  return pyusmipc_set_ipc_cache_size(PyModule_GetState(module), arg);
}

static PyObject *set_ipc_cache_bytes(PyObject *module, PyObject *arg) {
  pyusmipc_module_state_t *st = PyModule_GetState(module);
  PyObject *index = PyNumber_Index(arg);
  if (index == NULL) {
    pyusmipc_retype_parse_error(); /* a wrong type: ArgumentTypeError */
    return NULL;
  }
  PyObject *zero = PyLong_FromLong(0);
  int negative =
      zero == NULL ? -1 : PyObject_RichCompareBool(index, zero, Py_LT);
  Py_XDECREF(zero);
  if (negative != 0) {
    if (negative > 0) {
      pyusmipc_value_error("nbytes must be >= 0, not %R", index);
    }
    Py_DECREF(index);
    return NULL;
  }
  size_t nbytes = PyLong_AsSize_t(index); /* OverflowError past SIZE_MAX */
  Py_DECREF(index);
  if (nbytes == (size_t)-1 && PyErr_Occurred()) {
    return NULL;
  }
  int rc = usmipc_ipc_set_cache_bytes(nbytes);
  if (rc < 0) {
    return pyusmipc_raise(st, rc);
  }
  Py_RETURN_NONE;
}

static PyObject *set_ipc_timeout(PyObject *module, PyObject *arg) {
  pyusmipc_module_state_t *st = PyModule_GetState(module);
  double seconds = PyFloat_AsDouble(arg); /* any real number */
  if (seconds == -1.0 && PyErr_Occurred()) {
    pyusmipc_retype_parse_error(); /* a wrong type: ArgumentTypeError */
    return NULL;
  }
  if (isnan(seconds) || seconds < 0.0) {
    pyusmipc_value_error(
        "timeout must be >= 0 seconds (0 restores the default), "
        "not %R",
        arg);
    return NULL;
  }
  /* Whole milliseconds, rounded up (the 1e-6 forgives float noise such as
   * 16.1 * 1000 == 16100.000000000002); a positive timeout never becomes 0,
   * which would mean the default. */
  double ms = ceil(seconds * 1000.0 - 1e-6);
  if (ms > (double)UINT_MAX) {
    pyusmipc_value_error("timeout must be at most %u.%03u seconds, not %R",
                         UINT_MAX / 1000u, UINT_MAX % 1000u, arg);
    return NULL;
  }
  unsigned timeout_ms = (unsigned)ms;
  if (seconds > 0.0 && timeout_ms == 0) {
    timeout_ms = 1;
  }
  int rc = usmipc_ipc_set_timeout(timeout_ms);
  if (rc < 0) {
    return pyusmipc_raise(st, rc);
  }
  Py_RETURN_NONE;
}

static PyObject *strerror_(PyObject *module, PyObject *arg) {
  (void)module;
  long code = PyLong_AsLong(arg);
  if (code == -1 && PyErr_Occurred()) {
    pyusmipc_retype_parse_error(); /* a wrong type: ArgumentTypeError */
    return NULL;
  }
  return PyUnicode_FromString(usmipc_strerror((int)code));
}

/* A diagnostic for tests: what the library knows of an address. */
static PyObject *pointer_query(PyObject *module, PyObject *arg) {
  pyusmipc_module_state_t *st = PyModule_GetState(module);
  void *ptr = PyLong_AsVoidPtr(arg);
  if (ptr == NULL && PyErr_Occurred()) {
    return NULL;
  }
  usmipc_pointer_info_t info;
  int rc = usmipc_pointer_query(ptr, &info);
  if (rc < 0) {
    return pyusmipc_raise(st, rc);
  }
  PyObject *device = Py_None;
  if (info.device != NULL) {
    device = pyusmipc_device_object(st, info.device);
    if (device == NULL) {
      return NULL;
    }
  } else {
    Py_INCREF(device);
  }
  return Py_BuildValue("{sNsssNsnsKsOsO}", "device", device, "kind",
                       pyusmipc_kind_name(info.kind), "base",
                       PyLong_FromVoidPtr(info.base), "size",
                       (Py_ssize_t)info.size, "buffer_id",
                       (unsigned long long)info.buffer_id, "is_ipc_mapping",
                       info.is_ipc_mapping ? Py_True : Py_False, "is_foreign",
                       info.is_foreign ? Py_True : Py_False);
}

/* usmipc.memory.torch_pool_info(device): the pool behind the PyTorch
 * allocator on CUDA device ordinal device, after the frees still waiting
 * for their streams were waited for. Creates the pool (no memory) if the
 * allocator has not used the device yet. */
static PyObject *torch_pool_info(PyObject *module, PyObject *arg) {
  pyusmipc_module_state_t *st = PyModule_GetState(module);
  long device = PyLong_AsLong(arg);
  if (device == -1 && PyErr_Occurred()) {
    pyusmipc_retype_parse_error(); /* a wrong type: ArgumentTypeError */
    return NULL;
  }
  if (device < INT_MIN || device > INT_MAX) {
    pyusmipc_value_error("no CUDA device %ld", device);
    return NULL;
  }
  usmipc_pool_t *pool = NULL;
  usmipc_pool_info_t info;
  int rc;
  Py_BEGIN_ALLOW_THREADS
  rc = usmipc_torch_pool((int)device, &pool);
  if (rc == 0) {
    rc = usmipc_torch_synchronize((int)device);
  }
  if (rc == 0) {
    rc = usmipc_pool_get_info(pool, &info, sizeof(info));
  }
  Py_END_ALLOW_THREADS
  if (rc < 0) {
    return pyusmipc_raise(st, rc);
  }
  return Py_BuildValue("{snsnsnsn}", "segments", (Py_ssize_t)info.segments,
                       "segment_bytes", (Py_ssize_t)info.segment_bytes,
                       "blocks", (Py_ssize_t)info.blocks, "block_bytes",
                       (Py_ssize_t)info.block_bytes);
}

/* _releases_wait(seq, timeout_ms) -> (keys, seq, missed): the release keys
 * of this process's handles and bundles that had every ticket back since
 * seq (usmipc_releases_wait), waiting up to timeout_ms without the GIL
 * while there are none. usmipc.memory's reaper drops what it keeps by
 * them. */
static PyObject *releases_wait(PyObject *module, PyObject *args) {
  pyusmipc_module_state_t *st = PyModule_GetState(module);
  PyObject *seq_obj, *timeout_obj;
  if (!PyArg_ParseTuple(args, "O!O!:_releases_wait", &PyLong_Type, &seq_obj,
                        &PyLong_Type, &timeout_obj))
    return NULL;
  /* "K" would take -1 as 2**64-1 without a word: both are counts, and a
   * negative one is the caller's bug (OverflowError names it). */
  unsigned long long seq = PyLong_AsUnsignedLongLong(seq_obj);
  if (seq == (unsigned long long)-1 && PyErr_Occurred())
    return NULL;
  unsigned long long timeout_ms = PyLong_AsUnsignedLongLong(timeout_obj);
  if (timeout_ms == (unsigned long long)-1 && PyErr_Occurred())
    return NULL;
  uint64_t s = seq, keys[256];
  size_t n = 0;
  int missed = 0, rc;
  Py_BEGIN_ALLOW_THREADS
  rc = usmipc_releases_wait(&s, keys, 256, &n, &missed, timeout_ms);
  Py_END_ALLOW_THREADS
  if (rc < 0)
    return pyusmipc_raise(st, rc);
  PyObject *list = PyTuple_New((Py_ssize_t)n);
  if (list == NULL)
    return NULL;
  for (size_t i = 0; i < n; i++) {
    PyObject *k = PyLong_FromUnsignedLongLong(keys[i]);
    if (k == NULL) {
      Py_DECREF(list);
      return NULL;
    }
    PyTuple_SetItem(list, (Py_ssize_t)i, k); /* steals k */
  }
  return Py_BuildValue("(NKO)", list, (unsigned long long)s,
                       missed ? Py_True : Py_False);
}

/* The message of the last failed usmipc call on this thread: what a NULL
 * from usmipc_torch_malloc (a tensor whose data_ptr() is 0) was about. */
static PyObject *last_error(PyObject *module, PyObject *Py_UNUSED(ignored)) {
  (void)module;
  return PyUnicode_DecodeUTF8(
      usmipc_last_error(), (Py_ssize_t)strlen(usmipc_last_error()), "replace");
}

/* _torch_fold_counts(): the stats() counts usmipc.torch's C steps made
 * since the last call, added to its counts dict (stats() and
 * reset_stats() call it first). */
static PyObject *torch_fold_counts(PyObject *module, PyObject *ignored) {
  (void)module;
  (void)ignored;
  if (pyusmipc_torch_reduce_fold_counts() < 0 ||
      pyusmipc_torch_rebuild_fold_counts() < 0)
    return NULL;
  Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"get_devices", get_devices, METH_NOARGS,
     "get_devices() -> list of Device\n\n"
     "Every device of every available backend."},
    {"backends", backends, METH_NOARGS,
     "backends() -> dict\n\n"
     "Maps each backend name ('host', 'cuda', 'level_zero') to a pair\n"
     "(available, reason): reason says why a backend is unavailable."},
    {"set_ipc_cache_size", set_ipc_cache_size, METH_O,
     "set_ipc_cache_size(entries)\n\n"
     "At most how many closed IPC mappings this process keeps for cheap\n"
     "re-opens (default: every one whose allocation its exporter still\n"
     "exports, dropped within a second once it is freed; or\n"
     "USMIPC_IPC_CACHE_SIZE); 0 unmaps on the last close."},
    {"set_ipc_cache_bytes", set_ipc_cache_bytes, METH_O,
     "set_ipc_cache_bytes(nbytes)\n\n"
     "At most how many bytes of closed IPC mappings this process keeps\n"
     "(default: no bound on mappings whose allocation is still exported,\n"
     "which pin nothing the exporter does not hold; or\n"
     "USMIPC_IPC_CACHE_BYTES). 0 unmaps on the last close.\n"
     "Applies together with set_ipc_cache_size(); lowering it unmaps the\n"
     "least recently used idle mappings at once."},
    {"set_ipc_timeout", set_ipc_timeout, METH_O,
     "set_ipc_timeout(seconds)\n\n"
     "How long one IPCMemoryHandle.open() may wait for the exporting\n"
     "process (connecting to it, its answer), in seconds (a float; rounded\n"
     "up to whole milliseconds). Every wait of one open shares a single\n"
     "deadline, which signals do not extend; past it the open raises\n"
     "usmipc.IPCTimeoutError (a usmipc.Error and a TimeoutError, code\n"
     "USMIPC_ETIMEDOUT). 0 restores the default (5 s, or\n"
     "USMIPC_IPC_TIMEOUT_MS); negative values raise ValueError. Ctrl-C\n"
     "interrupts a waiting open (KeyboardInterrupt) whatever the timeout."},
    {"set_event_timeout", pyusmipc_set_event_timeout, METH_O,
     "set_event_timeout(seconds)\n\n"
     "The limit of every host wait on an event (Event.synchronize(),\n"
     "Event.wait() without a stream, IPCMemoryHandle.open() of an ordered\n"
     "handle without a stream), in seconds (a float; rounded up to whole\n"
     "milliseconds). None or 0 waits without limit (the default, or\n"
     "USMIPC_EVENT_TIMEOUT_MS): device work may legitimately take minutes.\n"
     "Past it the wait raises usmipc.IPCTimeoutError (USMIPC_ETIMEDOUT).\n"
     "Separate from set_ipc_timeout(), which bounds only the talk with an\n"
     "exporter. Ctrl-C interrupts a waiting event (KeyboardInterrupt)."},
    {"_pointer_query", pointer_query, METH_O,
     "_pointer_query(address) -> dict\n\n"
     "What usmipc knows of an address (device, kind, base, size, "
     "buffer_id,\nis_ipc_mapping, is_foreign); usmipc.Error "
     "USMIPC_EUNKNOWNPTR if nothing."},
    {"_torch_pool_info", torch_pool_info, METH_O,
     "_torch_pool_info(device) -> dict (usmipc.memory.torch_pool_info)."},
    {"_releases_wait", releases_wait, METH_VARARGS,
     "_releases_wait(seq, timeout_ms) -> (keys, seq, missed)\n\n"
     "Release keys of this process's handoffs whose tickets all came back "
     "since\nseq (usmipc_releases_wait); missed: fell behind, look at "
     "all."},
    {"_last_error", last_error, METH_NOARGS,
     "_last_error() -> str\n\n"
     "The message of the last failed usmipc call on this thread."},
    {"strerror", strerror_, METH_O,
     "strerror(code) -> str: the description of a usmipc error code."},
    {NULL, NULL, 0, NULL},
};

static PyObject *stats(PyObject *module, PyObject *Py_UNUSED(x)) {
  (void)module;
  usmipc_stats_t s;
  usmipc_get_stats(&s, sizeof(s));
  return Py_BuildValue(
      "{s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K}", "driver_exports", s.driver_exports,
      "driver_imports", s.driver_imports, "driver_queries", s.driver_queries,
      "descriptors_sent", s.descriptors_sent, "descriptors_received",
      s.descriptors_received, "transport_exchanges", s.transport_exchanges,
      "event_records", s.event_records, "event_waits", s.event_waits);
}

static PyObject *reset_stats(PyObject *module, PyObject *Py_UNUSED(x)) {
  (void)module;
  usmipc_reset_stats();
  Py_RETURN_NONE;
}

/* usmipc.share (bundle.c), open_shared, close_shared, release_shared
 * (shared_array.c), stats and reset_stats: added by module_exec after the
 * types SharedBundle and SharedArray, where the module has always had them. */
static PyMethodDef bundle_functions[] = {
    {"share", PYUSMIPC_CMETHOD(pyusmipc_share), METH_FASTCALL | METH_KEYWORDS,
     "share(obj, stream=None, ordered=None, release=False)\n--\n\n"
     "Exports an array (usmipc memory, a torch tensor, anything with "
     "__cuda_array_interface__ or __dlpack__) or a dict / list / tuple of "
     "them (a state_dict) for other processes: each allocation once, every "
     "array as metadata. Returns a SharedBundle (to_bytes(), pickle) that "
     "keeps the arrays alive. Ordered like IPCMemoryHandle: each "
     "to_bytes() records an event on stream (default: the arrays' current "
     "stream) that open_shared waits for; ordered=False turns that off. "
     "release=True: every to_bytes() (and pickle) also carries a release "
     "ticket, which the consumer returns with release_shared() (or by "
     "closing what it opened); SharedBundle.wait_released() waits for all "
     "of them."},
    {"open_shared", PYUSMIPC_CMETHOD(pyusmipc_open_shared),
     METH_FASTCALL | METH_KEYWORDS,
     "open_shared(data, device=None, stream=None, to=None, "
     "release_stream=None)\n--\n\n"
     "Opens the bytes of a SharedBundle (or the bundle itself): the same "
     "nesting, each array a SharedArray mapped without a copy. Waits for "
     "the producer's work on the host, or on stream (the device waits). "
     "to='torch' gives torch tensors instead (made from DLPack capsules in "
     "C, faster than torch.from_dlpack per leaf), ready on stream; each "
     "keeps its mapping until it dies. release_stream: a function of no "
     "arguments called when the last array closes or dies; the release "
     "ticket then waits for the work on the stream it returns (None: "
     "from the host)."},
    {"close_shared", PYUSMIPC_CMETHOD(pyusmipc_close_shared),
     METH_FASTCALL | METH_KEYWORDS,
     "close_shared(tree, stream=None)\n--\n\nCloses every SharedArray of "
     "a tree open_shared() returned (they also close when collected). If "
     "the producer asked for a release (share(..., release=True)), the "
     "ticket goes back first: after the work submitted to stream, or, "
     "without one, from the host."},
    {"release_shared", PYUSMIPC_CMETHOD(pyusmipc_release_shared),
     METH_FASTCALL | METH_KEYWORDS,
     "release_shared(tree, stream=None)\n--\n\nTells the producer of a "
     "bundle shared with release=True that this consumer is done with it, "
     "after the work submitted to stream (None: now): its "
     "SharedBundle.wait_released() counts the ticket and makes its stream "
     "wait for that work. tree is what open_shared() returned (or any of "
     "its SharedArray leaves), or the bytes it opened (for "
     "to='torch' trees). Once per open: closing the last array of an open "
     "returns its ticket from the host, if nothing did before. Bytes that "
     "carry no ticket are refused; a tree of them needs nothing."},
    {"_return_tickets_at_exit", pyusmipc_return_tickets_at_exit, METH_NOARGS,
     "_return_tickets_at_exit() -> int\n--\n\nReturns the release tickets "
     "of every open this process still holds (after the work on each "
     "open's release_stream), as the process ends: registered with atexit "
     "and multiprocessing's finalizers by usmipc. How many."},
    {"forward_shared", pyusmipc_forward_shared, METH_O,
     "forward_shared(data)\n--\n\nBytes that hand a bundle this process "
     "opened (shared with release=True) on to one more consumer process: "
     "the same bytes with a release ticket of their own, which the "
     "producer makes now, so that its SharedBundle.wait_released() also "
     "waits for whoever opens them. data is the bytes open_shared() "
     "opened, or a SharedArray it returned. Call it while this process "
     "still holds what it opened: once its own ticket went back, the "
     "producer may reuse the memory and refuses (usmipc.ArgumentError). "
     "Work this process queued on the arrays is not ordered before the "
     "next consumer's: finish it (synchronize) first."},
    {"stats", stats, METH_NOARGS,
     "stats()\n--\n\nWhat IPC has cost this process, a dict of counts: "
     "driver_exports,\ndriver_imports, driver_queries, descriptors_sent, "
     "descriptors_received,\ntransport_exchanges (round trips to other "
     "processes' brokers),\nevent_records (records made to order "
     "handoffs and tickets; none from an idle queue)\nand event_waits (waits "
     "put on a "
     "queue; none for a completed record)."},
    {"reset_stats", reset_stats, METH_NOARGS,
     "reset_stats()\n--\n\nSets the counters of stats() to zero."},
    {"_bundle_from_bytes", pyusmipc_bundle_from_bytes, METH_O, NULL},
    {"_copy_plan", PYUSMIPC_CMETHOD(pyusmipc_copy_plan), METH_FASTCALL, NULL},
    {"_bundle_paths", pyusmipc_bundle_paths, METH_O, NULL},
    {"_torch_setup", pyusmipc_torch_setup, METH_O, NULL},
    {"_torch_push", pyusmipc_torch_push, METH_O, NULL},
    {"_torch_pop", pyusmipc_torch_pop, METH_NOARGS, NULL},
    {"_torch_reduce_tensor", pyusmipc_torch_reduce_tensor, METH_O, NULL},
    {"_torch_fold_counts", torch_fold_counts, METH_NOARGS, NULL},
    {"_torch_lone", PYUSMIPC_CMETHOD(pyusmipc_torch_lone), METH_FASTCALL, NULL},
    {"_torch_rebuild_setup", pyusmipc_torch_rebuild_setup, METH_O, NULL},
    {"_torch_rebuild", PYUSMIPC_CMETHOD(pyusmipc_torch_rebuild), METH_FASTCALL,
     NULL},
    {"_torch_storage_or_live", PYUSMIPC_CMETHOD(pyusmipc_torch_storage_or_live),
     METH_FASTCALL, NULL},
    {NULL, NULL, 0, NULL},
};

/* ---- the interrupt hook -------------------------------------------------- */

/* usmipc_ipc_open (and an event's host wait, usmipc_event_synchronize) calls
 * the hook, without the GIL, when a signal interrupts one of its waits and
 * at least every 50 ms while it waits. The hook runs
 * the Python signal handlers (PyErr_CheckSignals does so only in the main
 * thread of the main interpreter; elsewhere it returns 0): if one raised,
 * KeyboardInterrupt for SIGINT, the exception stays pending on this thread
 * and the nonzero return abandons the open with USMIPC_EINTR, which
 * pyusmipc_raise turns into that exception.
 *
 * From the atexit callback on, the hook no longer touches the interpreter:
 * in a daemon thread still waiting while the interpreter finalizes,
 * PyGILState_Ensure would end the thread (pthread_exit) inside the C core.
 * The hook is process-wide (the core has one); the extension is never
 * unloaded, so the pointer stays valid after the module dies. */
static int interrupt_hook_off;

static int interrupt_hook(void *arg) {
  (void)arg;
  if (__atomic_load_n(&interrupt_hook_off, __ATOMIC_ACQUIRE)) {
    return 0;
  }
  PyGILState_STATE gil = PyGILState_Ensure();
  int r = PyErr_CheckSignals();
  PyGILState_Release(gil);
  return r != 0;
}

static PyObject *interrupt_hook_at_exit(PyObject *self,
                                        PyObject *Py_UNUSED(ignored)) {
  (void)self;
  __atomic_store_n(&interrupt_hook_off, 1, __ATOMIC_RELEASE);
  Py_RETURN_NONE;
}

static PyMethodDef interrupt_hook_at_exit_def = {
    "_usmipc_interrupt_hook_off", interrupt_hook_at_exit, METH_NOARGS,
    "Stops usmipc's interrupt hook from entering the interpreter "
    "(registered with atexit)."};

static int install_interrupt_hook(void) {
  PyObject *atexit = PyImport_ImportModule("atexit");
  if (atexit == NULL) {
    return -1;
  }
  PyObject *fn = PyCFunction_New(&interrupt_hook_at_exit_def, NULL);
  PyObject *r =
      fn == NULL ? NULL : PyObject_CallMethod(atexit, "register", "O", fn);
  Py_XDECREF(fn);
  Py_DECREF(atexit);
  if (r == NULL) {
    return -1;
  }
  Py_DECREF(r);
  __atomic_store_n(&interrupt_hook_off, 0, __ATOMIC_RELEASE);
  usmipc_set_interrupt_handler(interrupt_hook, NULL);
  return 0;
}

/* ---- module lifecycle ---------------------------------------------------- */

static int add_error_codes(PyObject *module) {
  PyObject *errorcode = PyDict_New();
  if (errorcode == NULL) {
    return -1;
  }
#define XX(name, value, text)                                                  \
  do {                                                                         \
    PyObject *k = PyLong_FromLong(USMIPC_##name);                              \
    PyObject *v = PyUnicode_FromString("USMIPC_" #name);                       \
    int failed = k == NULL || v == NULL ||                                     \
                 PyDict_SetItem(errorcode, k, v) < 0 ||                        \
                 PyModule_AddObjectRef(module, "USMIPC_" #name, k) < 0;        \
    Py_XDECREF(k);                                                             \
    Py_XDECREF(v);                                                             \
    if (failed) {                                                              \
      Py_DECREF(errorcode);                                                    \
      return -1;                                                               \
    }                                                                          \
  } while (0);
  USMIPC_ERRNO_MAP(XX)
#undef XX
  int rc = PyModule_AddObjectRef(module, "errorcode", errorcode);
  Py_DECREF(errorcode);
  return rc;
}

/* dir() of usmipc's exception classes (and of subclasses users make):
 * the names their own classes define, not the ones every exception inherits
 * from builtins (BaseException's __init__, args, with_traceback, ...).
 * pydoc lists whatever dir() of a class gives, grouped by defining class, so
 * without this help(usmipc) spent about 640 of its lines repeating
 * BaseException's members under each of the eight exception classes
 * (issue 25). Instances are unaffected: dir(an exception) still lists args
 * and the rest, and so does dir(RuntimeError). */
static PyObject *error_type_dir(PyObject *cls, PyObject *unused) {
  (void)unused;
  PyObject *mro = PyObject_GetAttrString(cls, "__mro__");
  PyObject *names = mro ? PySet_New(NULL) : NULL;
  Py_ssize_t n = mro ? PyTuple_Size(mro) : -1;
  for (Py_ssize_t i = 0; names != NULL && i < n; i++) {
    PyObject *k = PyTuple_GetItem(mro, i); /* borrowed */
    PyObject *mod = k ? PyObject_GetAttrString(k, "__module__") : NULL;
    int builtin = mod == NULL ? -1
                  : PyUnicode_Check(mod)
                      ? PyUnicode_CompareWithASCIIString(mod, "builtins") == 0
                      : 0;
    Py_XDECREF(mod);
    PyObject *d = builtin == 0 ? PyObject_GetAttrString(k, "__dict__") : NULL;
    PyObject *it = d ? PyObject_GetIter(d) : NULL;
    Py_XDECREF(d);
    if (builtin == 1)
      continue;
    PyObject *key;
    while (it != NULL && (key = PyIter_Next(it)) != NULL) {
      /* The weak-reference slot every Python-level exception class gets. */
      int rc = PyUnicode_Check(key) &&
                       PyUnicode_CompareWithASCIIString(key, "__weakref__") == 0
                   ? 0
                   : PySet_Add(names, key);
      Py_DECREF(key);
      if (rc < 0)
        break;
    }
    Py_XDECREF(it);
    if (PyErr_Occurred())
      Py_CLEAR(names);
  }
  Py_XDECREF(mro);
  if (names == NULL)
    return NULL;
  PyObject *list = PySequence_List(names);
  Py_DECREF(names);
  if (list != NULL && PyList_Sort(list) < 0)
    Py_CLEAR(list);
  return list;
}

static PyMethodDef error_type_methods[] = {
    {"__dir__", error_type_dir, METH_NOARGS,
     "The names usmipc's exception classes define, without those of "
     "BaseException."},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot error_type_slots[] = {
    {Py_tp_methods, error_type_methods},
    {Py_tp_doc, "The metaclass of usmipc.Error: dir() of an error class "
                "lists what usmipc defines, not BaseException's members."},
    {0, NULL},
};

static PyType_Spec error_type_spec = {
    .name = "usmipc._ErrorType",
    .flags = Py_TPFLAGS_DEFAULT,
    .slots = error_type_slots,
};

static int create_error(PyObject *module, pyusmipc_module_state_t *st) {
  /* usmipc.Error is made by its metaclass; the subclasses below get it from
   * their base (type() picks the most derived metaclass of the bases). */
  PyObject *meta =
      PyType_FromSpecWithBases(&error_type_spec, (PyObject *)&PyType_Type);
  if (meta == NULL)
    return -1;
  PyObject *dict = Py_BuildValue(
      "{sssssOsOsO}", "__module__", "usmipc", "__doc__",
      "A failed usmipc call.\n\n"
      "code is the library's negative error code, name its symbol\n"
      "('USMIPC_EEXPORTERGONE'), native_code the driver's own code (or 0).\n"
      "Invalid arguments and handles raise ValueError, memory of the wrong\n"
      "kind TypeError, exhaustion MemoryError; they carry the same\n"
      "attributes.",
      "code", Py_None, "name", Py_None, "native_code", Py_None);
  if (dict == NULL) {
    Py_DECREF(meta);
    return -1;
  }
  st->Error =
      PyObject_CallFunction(meta, "s(O)O", "Error", PyExc_RuntimeError, dict);
  Py_DECREF(dict);
  Py_DECREF(meta);
  if (st->Error == NULL) {
    return -1;
  }
  if (PyModule_AddObjectRef(module, "Error", st->Error) < 0) {
    return -1;
  }
  PyObject *bases = PyTuple_Pack(2, st->Error, PyExc_TimeoutError);
  if (bases == NULL) {
    return -1;
  }
  st->TimeoutError = PyErr_NewExceptionWithDoc(
      "usmipc.IPCTimeoutError",
      "An open waited for the exporting process past its deadline\n"
      "(USMIPC_ETIMEDOUT; usmipc.set_ipc_timeout()): the exporter is\n"
      "stopped, stalled or overloaded; or a host wait on an event ran past\n"
      "usmipc.set_event_timeout(). Both a usmipc.Error (.code, .name)\n"
      "and a TimeoutError (an OSError with errno ETIMEDOUT).",
      bases, NULL);
  Py_DECREF(bases);
  if (st->TimeoutError == NULL) {
    return -1;
  }
  if (PyModule_AddObjectRef(module, "IPCTimeoutError", st->TimeoutError) < 0)
    return -1;
  struct {
    PyObject **slot;
    const char *name, *doc;
    PyObject *builtin;
  } kinds[] = {
      {&st->ArgumentError, "usmipc.ArgumentError",
       "A bad argument, handle or size (USMIPC_EINVAL, EBADHANDLE,\n"
       "EHANDLEVERSION, ERANGE, EOTHERHOST, EWRONGDEVICE): a usmipc.Error\n"
       "and a ValueError.",
       PyExc_ValueError},
      {&st->MemoryKindError, "usmipc.MemoryKindError",
       "Memory of the wrong kind (USMIPC_EMEMKIND: host or shared memory\n"
       "where device memory is needed): a usmipc.Error and a TypeError.",
       PyExc_TypeError},
      {&st->ArgumentTypeError, "usmipc.ArgumentTypeError",
       "An argument of the wrong type (USMIPC_EINVAL), found by usmipc's\n"
       "argument parsing: a usmipc.Error and a TypeError.",
       PyExc_TypeError},
      {&st->OutOfMemoryError, "usmipc.OutOfMemoryError",
       "An allocation failed (USMIPC_ENOMEM): a usmipc.Error and a\n"
       "MemoryError.",
       PyExc_MemoryError},
  };
  for (size_t i = 0; i < sizeof(kinds) / sizeof(kinds[0]); i++) {
    PyObject *b = PyTuple_Pack(2, st->Error, kinds[i].builtin);
    if (b == NULL)
      return -1;
    *kinds[i].slot =
        PyErr_NewExceptionWithDoc(kinds[i].name, kinds[i].doc, b, NULL);
    Py_DECREF(b);
    if (*kinds[i].slot == NULL ||
        PyModule_AddObjectRef(module, strchr(kinds[i].name, '.') + 1,
                              *kinds[i].slot) < 0)
      return -1;
  }
  bases = PyTuple_Pack(1, st->ArgumentError);
  if (bases == NULL)
    return -1;
  st->DeviceCreationError = PyErr_NewExceptionWithDoc(
      "usmipc.SyclDeviceCreationError",
      "Device() (alias SyclDevice()) found no device for the filter string,\n"
      "or the filter string is malformed: dpctl's name for that error. A\n"
      "usmipc.Error (.code, .name) and a ValueError.",
      bases, NULL);
  Py_DECREF(bases);
  if (st->DeviceCreationError == NULL)
    return -1;
  return PyModule_AddObjectRef(module, "SyclDeviceCreationError",
                               st->DeviceCreationError);
}

static PyModuleDef module_def;

static int module_exec(PyObject *module) {
  pyusmipc_module_state_t *st = PyModule_GetState(module);
  /* Before any type exists: util.c's state lookups compare against it. */
  pyusmipc_set_module_def(&module_def);

  /* python-zstandard's habit: refuse a library other than the one compiled
   * against (the library is linked statically, so this catches a broken
   * build rather than a wrong shared object). */
  if (usmipc_version() != USMIPC_VERSION_HEX) {
    PyErr_Format(PyExc_ImportError,
                 "usmipc._usmipc was compiled against usmipc %s (0x%06x) but "
                 "loaded library version %s (0x%06x); rebuild the extension",
                 USMIPC_VERSION_STRING, (unsigned)USMIPC_VERSION_HEX,
                 usmipc_version_string(), usmipc_version());
    return -1;
  }

  if (create_error(module, st) < 0 ||
      pyusmipc_init_device_type(module, st) < 0 ||
      pyusmipc_init_queue_type(module, st) < 0 ||
      pyusmipc_init_memory_types(module, st) < 0 ||
      pyusmipc_init_ipc_handle_type(module, st) < 0 ||
      pyusmipc_init_event_types(module, st) < 0 ||
      pyusmipc_init_bundle_type(module, st) < 0 ||
      pyusmipc_init_shared_array_type(module, st) < 0 ||
      pyusmipc_init_copy_plan_type(module, st) < 0 ||
      pyusmipc_init_torch_message_type(module) < 0 ||
      PyModule_AddFunctions(module, bundle_functions) < 0 ||
      add_error_codes(module) < 0 || install_interrupt_hook() < 0) {
    return -1;
  }
  if (PyModule_AddStringConstant(module, "__version__",
                                 usmipc_version_string()) < 0 ||
      PyModule_AddIntConstant(module, "VERSION_HEX", (long)usmipc_version()) <
          0 ||
      PyModule_AddIntConstant(module, "COMPILED_VERSION_HEX",
                              (long)USMIPC_VERSION_HEX) < 0) {
    return -1;
  }
  return 0;
}

static int module_traverse(PyObject *module, visitproc visit, void *arg) {
  pyusmipc_module_state_t *st = PyModule_GetState(module);
  if (st == NULL) {
    return 0;
  }
  Py_VISIT(st->Error);
  Py_VISIT(st->TimeoutError);
  Py_VISIT(st->DeviceCreationError);
  Py_VISIT(st->ArgumentError);
  Py_VISIT(st->MemoryKindError);
  Py_VISIT(st->ArgumentTypeError);
  Py_VISIT(st->OutOfMemoryError);
  Py_VISIT(st->DeviceType);
  Py_VISIT(st->QueueType);
  Py_VISIT(st->MemoryType);
  Py_VISIT(st->MemoryUSMDeviceType);
  Py_VISIT(st->MemoryPoolType);
  Py_VISIT(st->MemoryUSMHostType);
  Py_VISIT(st->MemoryUSMSharedType);
  Py_VISIT(st->MemoryIPCDeviceType);
  Py_VISIT(st->IPCMemoryHandleType);
  Py_VISIT(st->EventType);
  Py_VISIT(st->IPCEventHandleType);
  Py_VISIT(st->SharedBundleType);
  Py_VISIT(st->SharedArrayType);
  Py_VISIT(st->CopyPlanType);
  Py_VISIT(st->torch_from_dlpack);
  for (Py_ssize_t i = 0; i < st->nslots; i++) {
    Py_VISIT(st->slots[i].device_obj);
    Py_VISIT(st->slots[i].queue_obj);
  }
  return 0;
}

static int module_clear(PyObject *module) {
  pyusmipc_module_state_t *st = PyModule_GetState(module);
  if (st == NULL) {
    return 0;
  }
  /* Queues first: a Queue's dealloc destroys its usmipc queue. */
  for (Py_ssize_t i = 0; i < st->nslots; i++) {
    Py_CLEAR(st->slots[i].queue_obj);
  }
  for (Py_ssize_t i = 0; i < st->nslots; i++) {
    Py_CLEAR(st->slots[i].device_obj);
  }
  st->nslots = 0;
  Py_CLEAR(st->Error);
  Py_CLEAR(st->TimeoutError);
  Py_CLEAR(st->DeviceCreationError);
  Py_CLEAR(st->ArgumentError);
  Py_CLEAR(st->MemoryKindError);
  Py_CLEAR(st->ArgumentTypeError);
  Py_CLEAR(st->OutOfMemoryError);
  Py_CLEAR(st->IPCEventHandleType);
  Py_CLEAR(st->SharedBundleType);
  Py_CLEAR(st->SharedArrayType);
  Py_CLEAR(st->CopyPlanType);
  Py_CLEAR(st->torch_from_dlpack);
  Py_CLEAR(st->EventType);
  Py_CLEAR(st->IPCMemoryHandleType);
  Py_CLEAR(st->MemoryIPCDeviceType);
  Py_CLEAR(st->MemoryUSMSharedType);
  Py_CLEAR(st->MemoryUSMHostType);
  Py_CLEAR(st->MemoryUSMDeviceType);
  Py_CLEAR(st->MemoryPoolType);
  Py_CLEAR(st->MemoryType);
  Py_CLEAR(st->QueueType);
  Py_CLEAR(st->DeviceType);
  return 0;
}

static void module_free(void *module) {
  module_clear((PyObject *)module);
  pyusmipc_module_state_t *st = PyModule_GetState((PyObject *)module);
  if (st != NULL) {
    PyMem_Free(st->slots);
    st->slots = NULL;
    st->slots_capacity = 0;
  }
}

static PyModuleDef_Slot module_slots[] = {
    {Py_mod_exec, module_exec},
    {0, NULL},
};

static PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    .m_name = "usmipc._usmipc",
    .m_doc = "Zero-copy sharing of accelerator memory between processes "
             "(the C extension of the usmipc package).",
    .m_size = sizeof(pyusmipc_module_state_t),
    .m_methods = module_methods,
    .m_slots = module_slots,
    .m_traverse = module_traverse,
    .m_clear = module_clear,
    .m_free = module_free,
};

PyMODINIT_FUNC PyInit__usmipc(void) { return PyModuleDef_Init(&module_def); }
