/* Devices: each backend is probed once, when a device or a handle of its
 * own is first asked for (a program that selects "host:cpu" never loads a
 * GPU driver, nor the C++ runtime the Level Zero loader pulls in); its
 * devices get stable filter strings ("cuda:gpu:1") and live until the
 * process exits. Listing devices, the default device ("first GPU, else the
 * host") and "gpu"/"cpu" filters probe every backend.
 *
 * Floor 4 of the core (registries), its lowest file. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/core.h"

#define MAX_BACKENDS 8
#define MAX_DEVICES_PER_BACKEND 16

typedef struct backend_state {
  int probed;       /* read with acquire: the fields below are final */
  int status;       /* 0 available, else USMIPC_EUNAVAILABLE */
  char reason[256]; /* why it is unavailable */
  int count;
  usmipc_device_t devices[MAX_DEVICES_PER_BACKEND];
} backend_state_t;

/* Indexed by usmipc_backend_t. Probes are serialised (a driver's probe may
 * take long, once); lookups of probed backends take no lock. */
static backend_state_t backend_states[MAX_BACKENDS];
static pthread_mutex_t probe_lock = PTHREAD_MUTEX_INITIALIZER;

void usmipc__devices_fork_prepare(void) { pthread_mutex_lock(&probe_lock); }
void usmipc__devices_fork_parent(void) { pthread_mutex_unlock(&probe_lock); }
void usmipc__devices_fork_child(void) { pthread_mutex_unlock(&probe_lock); }

static const usmipc__backend_ops_t *ops_for(usmipc_backend_t backend) {
  for (size_t i = 0; i < usmipc__backend_count; i++)
    if (usmipc__backends[i]->backend == backend)
      return usmipc__backends[i];
  return NULL;
}

static const char *type_name(usmipc_device_type_t t) {
  return t == USMIPC_DEVICE_GPU ? "gpu" : "cpu";
}

/* Called with probe_lock held. */
static void probe_one(const usmipc__backend_ops_t *ops, backend_state_t *st) {
  usmipc__device_desc_t desc[MAX_DEVICES_PER_BACKEND];
  memset(desc, 0, sizeof(desc));
  if (ops->struct_size < sizeof(usmipc__backend_ops_t)) {
    st->status = USMIPC_EUNAVAILABLE;
    snprintf(st->reason, sizeof(st->reason),
             "backend built against an older usmipc backend interface");
    return;
  }
  int n = ops->probe(desc, (int)USMIPC__ARRAY_SIZE(desc), st->reason,
                     sizeof(st->reason));
  if (n <= 0) {
    st->status = USMIPC_EUNAVAILABLE;
    if (n == 0 && st->reason[0] == '\0')
      snprintf(st->reason, sizeof(st->reason), "the driver reports no devices");
    usmipc__debug("backend %s unavailable: %s", ops->name, st->reason);
    return;
  }
  usmipc__debug("backend %s: %d device(s)", ops->name, n);
  int per_type[2] = {0, 0};
  for (int i = 0; i < n && i < MAX_DEVICES_PER_BACKEND; i++) {
    usmipc_device_t *d = &st->devices[st->count++];
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

/* The state of one backend, probed on first use; NULL when this build has
 * no such backend. */
static backend_state_t *backend_probed(usmipc_backend_t b) {
  const usmipc__backend_ops_t *ops = ops_for(b);
  if (ops == NULL || (unsigned)b >= MAX_BACKENDS)
    return NULL;
  backend_state_t *st = &backend_states[b];
  if (!__atomic_load_n(&st->probed, __ATOMIC_ACQUIRE)) {
    pthread_mutex_lock(&probe_lock);
    if (!st->probed) {
      probe_one(ops, st);
      __atomic_store_n(&st->probed, 1, __ATOMIC_RELEASE);
    }
    pthread_mutex_unlock(&probe_lock);
  }
  return st;
}

int usmipc__devices_init(void) {
  for (size_t i = 0; i < usmipc__backend_count; i++)
    backend_probed(usmipc__backends[i]->backend);
  return 0;
}

/* Visits the devices of every backend, in the registry's order. */
#define FOR_EACH_DEVICE(d)                                                     \
  for (size_t b_ = 0; b_ < usmipc__backend_count; b_++)                        \
    for (backend_state_t *st_ = backend_probed(usmipc__backends[b_]->backend); \
         st_ != NULL; st_ = NULL)                                              \
      for (usmipc_device_t *d = st_->devices; d < st_->devices + st_->count;   \
           d++)

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
  const char *why;
  int rc;
  if ((unsigned)backend >= MAX_BACKENDS ||
      !strcmp(usmipc_backend_name(backend), "unknown")) {
    why = "no such backend";
    rc = USMIPC_EINVAL;
  } else if (ops_for(backend) == NULL) {
    why = "this build of usmipc does not include the backend";
    rc = USMIPC_EUNAVAILABLE;
  } else {
    backend_state_t *st = backend_probed(backend);
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
  if (out == NULL && capacity > 0)
    return usmipc__fail(USMIPC_EINVAL, "devices is NULL but capacity is %zu",
                        capacity);
  size_t n = 0;
  FOR_EACH_DEVICE(d) {
    if (n < capacity)
      out[n] = d;
    n++;
  }
  if (count != NULL)
    *count = n;
  return 0;
}

/* Parses "backend[:type[:index]]" where each part may also be "*"; a lone
 * "gpu" or "cpu" names a type of any backend. */
int usmipc_device_select(const char *filter, usmipc_device_t **out) {
  if (out == NULL)
    return usmipc__fail(USMIPC_EINVAL, "device output pointer is NULL");
  *out = NULL;
  if (filter == NULL || filter[0] == '\0') {
    /* USMIPC_DEFAULT_DEVICE picks the default (a filter string: dpctl
     * programs and their tests ask for the default device); a value that
     * names no device is an error, never ignored. */
    const char *env = getenv("USMIPC_DEFAULT_DEVICE");
    if (env != NULL && env[0] != '\0') {
      int rc = usmipc_device_select(env, out);
      if (rc != 0)
        usmipc__error_prefix("USMIPC_DEFAULT_DEVICE='%.40s': ", env);
      return rc;
    }
    FOR_EACH_DEVICE(d) {
      if (d->type == USMIPC_DEVICE_GPU) {
        *out = d;
        return 0;
      }
    }
    FOR_EACH_DEVICE(d) {
      if (d->ops->backend == USMIPC_BACKEND_HOST) {
        *out = d;
        return 0;
      }
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

  /* Only the named backend is probed; a filter naming no backend probes
   * them all. */
  long seen = 0;
  for (size_t b = 0; b < usmipc__backend_count; b++) {
    const usmipc__backend_ops_t *ops = usmipc__backends[b];
    if (want_backend && strcmp(want_backend, ops->name))
      continue;
    backend_state_t *st = backend_probed(ops->backend);
    for (int i = 0; i < st->count; i++) {
      usmipc_device_t *d = &st->devices[i];
      if (want_type && strcmp(want_type, type_name(d->type)))
        continue;
      if (want_index < 0 || seen == want_index) {
        *out = d;
        return 0;
      }
      seen++;
    }
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
  if (want_index >= 0 && seen == 1)
    return usmipc__fail(USMIPC_ENODEV,
                        "no device matches '%s': there is one such device, "
                        "index 0; run 'python -m usmipc' to list devices",
                        filter);
  if (want_index >= 0 && seen > 1)
    return usmipc__fail(USMIPC_ENODEV,
                        "no device matches '%s': there are %ld such devices, "
                        "indexes 0 to %ld; run 'python -m usmipc' to list "
                        "devices",
                        filter, seen, seen - 1);
  return usmipc__fail(USMIPC_ENODEV,
                      "no device matches '%s'; run 'python -m usmipc' to "
                      "list devices",
                      filter);

malformed:
  return usmipc__fail(USMIPC_EINVAL,
                      "device filter '%s' is malformed; expected "
                      "backend[:type[:index]], e.g. 'cuda:gpu:0' or 'host:cpu'",
                      filter);
}

usmipc_device_t *usmipc__device_by_ordinal(usmipc_backend_t b, int ordinal) {
  backend_state_t *st = backend_probed(b);
  for (int i = 0; st != NULL && i < st->count; i++)
    if (st->devices[i].ordinal == ordinal)
      return &st->devices[i];
  return NULL;
}

usmipc_device_t *usmipc__device_by_uuid(usmipc_backend_t b,
                                        const uint8_t uuid[16]) {
  backend_state_t *st = backend_probed(b);
  for (int i = 0; st != NULL && i < st->count; i++)
    if (!memcmp(st->devices[i].uuid, uuid, 16))
      return &st->devices[i];
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
  if (d == NULL)
    return "";
  usmipc_device_t *dev = (usmipc_device_t *)d; /* the name is a cache */
  if (!__atomic_load_n(&dev->name_ready, __ATOMIC_ACQUIRE)) {
    pthread_mutex_lock(&probe_lock);
    if (!dev->name_ready && dev->name[0] == '\0' &&
        dev->ops->device_name != NULL)
      dev->ops->device_name(dev->native, dev->name, sizeof(dev->name));
    __atomic_store_n(&dev->name_ready, 1, __ATOMIC_RELEASE);
    pthread_mutex_unlock(&probe_lock);
  }
  return d->name;
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
bool usmipc__device_ipc_aspect(const usmipc_device_t *d) {
  return d->has_ipc &&
         (d->ops->ipc_failed == NULL || !d->ops->ipc_failed(d->native));
}

int usmipc_device_has_ipc(const usmipc_device_t *d) {
  if (d == NULL || !usmipc__device_ipc_aspect(d))
    return 0;
  /* The aspect is the truth, not the driver's claim: a backend that checks
   * its IPC once (Level Zero's self-test) does it now if it has not. */
  if (d->ops->ipc_check != NULL && d->ops->ipc_check(d->native) != 0)
    return 0;
  return usmipc__device_ipc_aspect(d);
}

int usmipc_device_get_info(const usmipc_device_t *d, usmipc_device_info_t *out,
                           size_t size) {
  if (d == NULL || out == NULL || size == 0)
    return usmipc__fail(USMIPC_EINVAL,
                        "usmipc_device_get_info: NULL argument or size 0");
  usmipc_device_info_t info;
  memset(&info, 0, sizeof(info));
  if (d->ops->device_info != NULL) {
    int rc = d->ops->device_info(d->native, &info);
    if (rc < 0)
      return rc;
  }
  info.driver_version[sizeof(info.driver_version) - 1] = '\0';
  /* A caller built against an older, shorter struct gets its prefix. */
  memset(out, 0, size);
  memcpy(out, &info, size < sizeof(info) ? size : sizeof(info));
  return 0;
}
