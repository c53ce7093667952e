/* Floor 2 of the extension: handle bytes, what IPCMemoryHandle
 * (ipc_handle.c) and IPCEventHandle (event.c) share. Taking handle bytes
 * from an argument (bytes, any buffer, or a handle object's own), decoding
 * them with usmipc_ipc_handle_inspect and refusing the bytes of the other
 * kind of handle, the error of a failed open, and the fields both types
 * show (backend, device_uuid, the dict of inspect()). Everything here reads
 * the bytes through the public header: the wire format stays the
 * library's. Calls util.c only (module.c lists the floors). */
#include "handle_bytes.h"

#include <stdio.h>
#include <string.h>

#include "util.h"

int pyusmipc_handle_bytes_of(PyObject *obj, PyObject *bytes,
                             pyusmipc_handle_bytes_t *hb) {
  hb->arg = obj;
  hb->keep = bytes;
  hb->have_view = 0;
  char *p;
  if (PyBytes_AsStringAndSize(bytes, &p, &hb->len) < 0) {
    Py_CLEAR(hb->keep);
    return -1;
  }
  hb->data = p;
  return 0;
}

int pyusmipc_handle_bytes_read(PyObject *obj, pyusmipc_handle_bytes_t *hb,
                               PyTypeObject *other_type,
                               const char *other_message,
                               const char *expected) {
  hb->arg = obj;
  hb->keep = NULL;
  hb->have_view = 0;
  if (PyBytes_Check(obj)) {
    char *p;
    if (PyBytes_AsStringAndSize(obj, &p, &hb->len) < 0) {
      return -1;
    }
    hb->data = p;
    return 0;
  }
  if (PyObject_CheckBuffer(obj)) {
    if (PyObject_GetBuffer(obj, &hb->view, PyBUF_SIMPLE) < 0) {
      return -1;
    }
    hb->have_view = 1;
    hb->data = hb->view.buf;
    hb->len = hb->view.len;
    return 0;
  }
  if (other_type != NULL && Py_IS_TYPE(obj, other_type)) {
    pyusmipc_type_error("%s", other_message);
    return -1;
  }
  pyusmipc_type_error("expected %s, not %R", expected,
                      (PyObject *)Py_TYPE(obj));
  return -1;
}

PyObject *pyusmipc_handle_bytes_object(const pyusmipc_handle_bytes_t *hb) {
  if (hb->keep != NULL) {
    return Py_NewRef(hb->keep);
  }
  if (PyBytes_CheckExact(hb->arg)) {
    return Py_NewRef(hb->arg);
  }
  return PyBytes_FromStringAndSize(hb->data, hb->len);
}

void pyusmipc_handle_bytes_release(pyusmipc_handle_bytes_t *hb) {
  if (hb->have_view) {
    PyBuffer_Release(&hb->view);
    hb->have_view = 0;
  }
  Py_CLEAR(hb->keep);
}

/* 1 with usmipc.ArgumentError wrong_kind raised when info is a handle of
 * the other kind than want_event asks for (1: an event's, 0: memory's);
 * else 0. */
static int refuse_other_kind(pyusmipc_module_state_t *st,
                             const usmipc_ipc_handle_info_t *info,
                             int want_event, const char *wrong_kind) {
  if (!info->is_event == !want_event) {
    return 0;
  }
  pyusmipc_raise_msg(st, USMIPC_EINVAL, wrong_kind);
  return 1;
}

PyObject *pyusmipc_handle_bytes_decode(pyusmipc_module_state_t *st,
                                       const pyusmipc_handle_bytes_t *hb,
                                       usmipc_ipc_handle_info_t *info,
                                       int want_event, const char *wrong_kind) {
  int rc = usmipc_ipc_handle_inspect(hb->data, (size_t)hb->len, info);
  if (rc < 0) {
    return pyusmipc_raise(st, rc);
  }
  if (refuse_other_kind(st, info, want_event, wrong_kind)) {
    return NULL;
  }
  return pyusmipc_handle_bytes_object(hb);
}

PyObject *pyusmipc_raise_open_error(pyusmipc_module_state_t *st, int rc,
                                    const char *data, Py_ssize_t len,
                                    int want_event, const char *wrong_kind) {
  if ((rc == USMIPC_EINVAL || rc == USMIPC_EBADHANDLE) && data != NULL &&
      len >= 8 && memcmp(data, "\x89USMIPCB", 8) == 0) {
    /* The other format of the library: say which opener takes it. */
    return pyusmipc_raise_msg(
        st, rc,
        "these are the bytes of a bundle (usmipc.share()"
        ", SharedBundle.to_bytes()), not of one IPC "
        "handle: open them with usmipc.open_shared(data)");
  }
  if (rc != USMIPC_EINVAL) {
    return pyusmipc_raise(st, rc);
  }
  char message[512];
  snprintf(message, sizeof(message), "%s", usmipc_last_error());
  usmipc_ipc_handle_info_t info;
  if (data != NULL &&
      usmipc_ipc_handle_inspect(data, (size_t)len, &info) == 0 &&
      refuse_other_kind(st, &info, want_event, wrong_kind)) {
    return NULL;
  }
  return pyusmipc_raise_msg(st, rc, message);
}

PyObject *pyusmipc_handle_info_dict(const usmipc_ipc_handle_info_t *info,
                                    Py_ssize_t len) {
  return Py_BuildValue("{sssy#sksKsKsKsKsIsnsOsOsK}", "backend",
                       usmipc_backend_name(info->backend), "device_uuid",
                       (const char *)info->device_uuid, (Py_ssize_t)16,
                       "exporter_pid", (unsigned long)info->exporter_pid,
                       "buffer_id", (unsigned long long)info->buffer_id,
                       "allocation_size",
                       (unsigned long long)info->allocation_size, "offset",
                       (unsigned long long)info->offset, "nbytes",
                       (unsigned long long)info->nbytes, "handle_kind",
                       (unsigned int)info->handle_kind, "length", len,
                       "is_event", info->is_event ? Py_True : Py_False,
                       "is_ordered", info->is_ordered ? Py_True : Py_False,
                       "event_point", (unsigned long long)info->event_point);
}

static const usmipc_ipc_handle_info_t *info_at(PyObject *self, void *closure) {
  return (const usmipc_ipc_handle_info_t *)((const char *)self +
                                            (uintptr_t)closure);
}

PyObject *pyusmipc_info_get_backend(PyObject *self, void *closure) {
  return PyUnicode_FromString(
      usmipc_backend_name(info_at(self, closure)->backend));
}

PyObject *pyusmipc_info_get_device_uuid(PyObject *self, void *closure) {
  return PyBytes_FromStringAndSize(
      (const char *)info_at(self, closure)->device_uuid, 16);
}
