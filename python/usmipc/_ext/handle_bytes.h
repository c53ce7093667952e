/* Floor 2 of the extension usmipc._usmipc (handle_bytes.c): the handle
 * bytes IPCMemoryHandle and IPCEventHandle both take, decode and show.
 * Above util.h only. */
#ifndef PYUSMIPC_HANDLE_BYTES_H
#define PYUSMIPC_HANDLE_BYTES_H

#include "util.h"

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
    rc = usmipc_ipc_handle_get_info(handle, info);
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

#endif /* PYUSMIPC_HANDLE_BYTES_H */
