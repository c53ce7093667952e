/* Devices: every backend is probed once, on first use; its devices get
 * stable filter strings ("cuda:gpu:1") and live until the process exits. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

#define MAX_DEVICES 64

typedef struct backend_state {
  int status;       /* 0 available, else USMIPC_EUNAVAILABLE */
  char reason[256]; /* why it is unavailable */
} backend_state_t;

static usmipc_device_t devices[MAX_DEVICES];
static size_t device_count;
static backend_state_t backend_states[8];
static pthread_once_t devices_once = PTHREAD_ONCE_INIT;

static const usmipc__backend_ops_t *ops_for(usmipc_backend_t backend) {
  for (size_t i = 0; i < usmipc__backend_count; i++)
    if (usmipc__backends[i]->backend == backend)
      return usmipc__backends[i];
  return NULL;
}

static const char *type_name(usmipc_device_type_t t) {
  return t == USMIPC_DEVICE_GPU ? "gpu" : "cpu";
}

static void probe_all(void) {
  for (size_t b = 0; b < usmipc__backend_count; b++) {
    const usmipc__backend_ops_t *ops = usmipc__backends[b];
    backend_state_t *st = &backend_states[ops->backend];
    usmipc__device_desc_t desc[16];
    memset(desc, 0, sizeof(desc));
    if (ops->struct_size < sizeof(usmipc__backend_ops_t)) {
      st->status = USMIPC_EUNAVAILABLE;
      snprintf(st->reason, sizeof(st->reason),
               "backend built against an older usmipc backend interface");
      continue;
    }
    int n = ops->probe(desc, (int)USMIPC__ARRAY_SIZE(desc), st->reason,
                       sizeof(st->reason));
    if (n <= 0) {
      st->status = USMIPC_EUNAVAILABLE;
      if (n == 0 && st->reason[0] == '\0')
        snprintf(st->reason, sizeof(st->reason),
                 "the driver reports no devices");
      continue;
    }
    int per_type[3] = {0, 0, 0};
    for (int i = 0; i < n && device_count < MAX_DEVICES; i++) {
      usmipc_device_t *d = &devices[device_count++];
      d->ops = ops;
      d->native = desc[i].native;
      d->type = desc[i].type;
      d->ordinal = i;
      d->index = per_type[d->type == USMIPC_DEVICE_GPU]++;
      d->has_ipc = desc[i].supports_ipc;
      memcpy(d->uuid, desc[i].uuid, 16);
      snprintf(d->name, sizeof(d->name), "%s", desc[i].name);
      snprintf(d->filter, sizeof(d->filter), "%s:%s:%d", ops->name,
               type_name(d->type), d->index);
    }
  }
}

int usmipc__devices_init(void) {
  pthread_once(&devices_once, probe_all);
  return 0;
}

const char *usmipc_backend_name(usmipc_backend_t backend) {
  switch (backend) {
  case USMIPC_BACKEND_HOST:
    return "host";
  case USMIPC_BACKEND_CUDA:
    return "cuda";
  case USMIPC_BACKEND_LEVEL_ZERO:
    return "level_zero";
  }
  return "unknown";
}

int usmipc_backend_status(usmipc_backend_t backend, const char **reason) {
  usmipc__devices_init();
  const char *why;
  int rc;
  if ((unsigned)backend >= USMIPC__ARRAY_SIZE(backend_states) ||
      !strcmp(usmipc_backend_name(backend), "unknown")) {
    why = "no such backend";
    rc = USMIPC_EINVAL;
  } else if (ops_for(backend) == NULL) {
    why = "this build of usmipc does not include the backend";
    rc = USMIPC_EUNAVAILABLE;
  } else {
    backend_state_t *st = &backend_states[backend];
    why = st->status ? st->reason : NULL;
    rc = st->status;
  }
  if (reason != NULL)
    *reason = why;
  if (rc != 0)
    return usmipc__fail(rc, "backend %s is unavailable: %s",
                        usmipc_backend_name(backend), why);
  return 0;
}

int usmipc_get_devices(usmipc_device_t **out, size_t capacity, size_t *count) {
  usmipc__devices_init();
  if (out == NULL && capacity > 0)
    return usmipc__fail(USMIPC_EINVAL, "devices is NULL but capacity is %zu",
                        capacity);
  for (size_t i = 0; i < device_count && i < capacity; i++)
    out[i] = &devices[i];
  if (count != NULL)
    *count = device_count;
  return 0;
}

/* Parses "backend[:type[:index]]" where each part may also be "*"; a lone
 * "gpu" or "cpu" names a type of any backend. */
int usmipc_device_select(const char *filter, usmipc_device_t **out) {
  usmipc__devices_init();
  if (out == NULL)
    return usmipc__fail(USMIPC_EINVAL, "device output pointer is NULL");
  *out = NULL;
  if (filter == NULL || filter[0] == '\0') {
    for (size_t i = 0; i < device_count; i++)
      if (devices[i].type == USMIPC_DEVICE_GPU) {
        *out = &devices[i];
        return 0;
      }
    for (size_t i = 0; i < device_count; i++)
      if (devices[i].ops->backend == USMIPC_BACKEND_HOST) {
        *out = &devices[i];
        return 0;
      }
    return usmipc__fail(USMIPC_ENODEV, "no device is available");
  }

  char buf[64], *parts[4] = {0};
  int nparts = 0;
  if (strlen(filter) >= sizeof(buf))
    return usmipc__fail(USMIPC_EINVAL, "device filter '%.32s...' is too long",
                        filter);
  strcpy(buf, filter);
  for (char *save = NULL, *tok = strtok_r(buf, ":", &save); tok;
       tok = strtok_r(NULL, ":", &save)) {
    if (nparts == 3)
      goto malformed;
    parts[nparts++] = tok;
  }
  if (nparts == 0)
    goto malformed;

  const char *want_backend = NULL, *want_type = NULL;
  long want_index = -1;
  int i0 = 0;
  if (!strcmp(parts[0], "gpu") || !strcmp(parts[0], "cpu")) {
    if (nparts > 2)
      goto malformed;
    want_type = parts[0];
    i0 = 1;
  } else {
    if (strcmp(parts[0], "*") && strcmp(parts[0], "host") &&
        strcmp(parts[0], "cuda") && strcmp(parts[0], "level_zero"))
      return usmipc__fail(USMIPC_EINVAL,
                          "device filter '%s': unknown backend '%s'; use "
                          "host, cuda or level_zero (e.g. 'host:cpu:0')",
                          filter, parts[0]);
    want_backend = strcmp(parts[0], "*") ? parts[0] : NULL;
    if (nparts > 1) {
      if (strcmp(parts[1], "gpu") && strcmp(parts[1], "cpu") &&
          strcmp(parts[1], "*"))
        return usmipc__fail(USMIPC_EINVAL,
                            "device filter '%s': unknown device type '%s'; "
                            "use cpu or gpu",
                            filter, parts[1]);
      want_type = strcmp(parts[1], "*") ? parts[1] : NULL;
    }
    i0 = 2;
  }
  if (nparts > i0) {
    char *end;
    want_index = strtol(parts[i0], &end, 10);
    if (*end != '\0' || want_index < 0)
      return usmipc__fail(USMIPC_EINVAL,
                          "device filter '%s': index '%s' is not a "
                          "non-negative number",
                          filter, parts[i0]);
  }

  long seen = 0;
  for (size_t i = 0; i < device_count; i++) {
    usmipc_device_t *d = &devices[i];
    if (want_backend && strcmp(want_backend, d->ops->name))
      continue;
    if (want_type && strcmp(want_type, type_name(d->type)))
      continue;
    if (want_index < 0 || seen == want_index) {
      *out = d;
      return 0;
    }
    seen++;
  }
  if (want_backend) {
    const char *reason = NULL;
    for (size_t b = 0; b <= USMIPC_BACKEND_LEVEL_ZERO; b++)
      if (!strcmp(usmipc_backend_name((usmipc_backend_t)b), want_backend))
        usmipc_backend_status((usmipc_backend_t)b, &reason);
    if (reason)
      return usmipc__fail(USMIPC_ENODEV,
                          "no device matches '%s': backend %s is unavailable "
                          "(%s); run 'python -m usmipc' to list devices",
                          filter, want_backend, reason);
  }
  return usmipc__fail(USMIPC_ENODEV,
                      "no device matches '%s' (%ld matched before the index); "
                      "run 'python -m usmipc' to list devices",
                      filter, seen);

malformed:
  return usmipc__fail(USMIPC_EINVAL,
                      "device filter '%s' is malformed; expected "
                      "backend[:type[:index]], e.g. 'cuda:gpu:0' or 'host:cpu'",
                      filter);
}

usmipc_device_t *usmipc__device_by_ordinal(usmipc_backend_t backend,
                                           int ordinal) {
  usmipc__devices_init();
  for (size_t i = 0; i < device_count; i++)
    if (devices[i].ops->backend == backend && devices[i].ordinal == ordinal)
      return &devices[i];
  return NULL;
}

usmipc_device_t *usmipc__device_by_uuid(usmipc_backend_t backend,
                                        const uint8_t uuid[16]) {
  usmipc__devices_init();
  for (size_t i = 0; i < device_count; i++)
    if (devices[i].ops->backend == backend &&
        !memcmp(devices[i].uuid, uuid, 16))
      return &devices[i];
  return NULL;
}

void usmipc__uuid_format(const uint8_t u[16], char out[37]) {
  snprintf(
      out, 37,
      "%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x",
      u[0], u[1], u[2], u[3], u[4], u[5], u[6], u[7], u[8], u[9], u[10], u[11],
      u[12], u[13], u[14], u[15]);
}

const char *usmipc_device_name(const usmipc_device_t *d) {
  return d ? d->name : "";
}
usmipc_backend_t usmipc_device_backend(const usmipc_device_t *d) {
  return d ? d->ops->backend : (usmipc_backend_t)0;
}
usmipc_device_type_t usmipc_device_type(const usmipc_device_t *d) {
  return d ? d->type : (usmipc_device_type_t)0;
}
int usmipc_device_index(const usmipc_device_t *d) { return d ? d->index : -1; }
const char *usmipc_device_filter_string(const usmipc_device_t *d) {
  return d ? d->filter : "";
}
void usmipc_device_uuid(const usmipc_device_t *d, uint8_t uuid[16]) {
  if (d)
    memcpy(uuid, d->uuid, 16);
  else
    memset(uuid, 0, 16);
}
int usmipc_device_has_ipc(const usmipc_device_t *d) {
  return d ? d->has_ipc : 0;
}
