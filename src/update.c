/* Updates: a handoff's arrays copied into the consumer's own (copy plans,
 * usmipc_bundle_update).
 *
 * An engine that keeps its own weights needs, every step, one thing: the
 * producer's bytes copied into them, after the producer's work, with the
 * release ticket returned after the copies. Done leaf by leaf from Python
 * that costs 7 us of host time per tensor (a copy call each) and a Python
 * object per leaf; here it is one call whose host time per leaf is a
 * compare, and one unit of device work (the backend's copy_batch).
 *
 *   create  the destinations are copied and checked on their own (dtype,
 *           shape, strides).
 *   update  the same bundle's next handoff (only its event and ticket
 *           differ: usmipc__bundle_reuse) is copied from the mappings the
 *           plan holds, with neither a decode nor a lookup; other bytes are
 *           opened (usmipc_bundle_open: warm, a cache hit per
 *           allocation) -> if the arrays and nodes are byte for byte those
 *           of the last update, only each source pointer is compared (a
 *           changed mapping changes one copy); else every destination is
 *           checked against its array and the copies are made again, before
 *           anything is queued -> the batch -> the ticket after it -> the
 *           previous update's mappings are closed (this one's stay open
 *           until the next, so the copies never outlive them).
 *
 * Objects floor (5), after bundle.c, whose open it uses. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "objects.h"

struct usmipc_copy_plan {
  usmipc_device_t *device;
  unsigned flags;
  size_t count;
  /* The destinations, as given: */
  uint32_t *array;
  uint64_t *dst;
  usmipc_array_desc_t *desc; /* shape and strides point into dims */
  int64_t *dims;
  char **name;
  /* What the last update bound them to: */
  bool bound;
  uint8_t *meta; /* the bundle's arrays and nodes then */
  size_t meta_len;
  const void **src; /* each source's first element then */
  usmipc__copy_t *copies;
  size_t ncopies;
  size_t *copy_of; /* the destination's copy, or SIZE_MAX (no element) */
  void *batch;     /* the backend's copy_batch state */
  bool batch_made;
  usmipc_queue_t *own_queue;    /* for updates without a queue */
  usmipc_opened_bundle_t *held; /* the last update's mappings */
};

/* ---- a destination's layout --------------------------------------------- */

static void format_dims(char *out, size_t len, int ndim, const int64_t *v) {
  size_t at = (size_t)snprintf(out, len, "(");
  for (int i = 0; i < ndim && at < len; i++)
    at += (size_t)snprintf(out + at, len - at, "%s%lld", i ? ", " : "",
                           (long long)v[i]);
  if (at < len)
    snprintf(out + at, len - at, ndim == 1 ? ",)" : ")");
}

static const char *dest_name(const usmipc_copy_plan_t *p, size_t i, char *buf,
                             size_t len) {
  if (p->name[i] != NULL)
    snprintf(buf, len, "destination %zu (%s)", i, p->name[i]);
  else
    snprintf(buf, len, "destination %zu", i);
  return buf;
}

/* Folds a copy of shape with source and destination strides (elements)
 * into rows: dimensions of one element dropped, a dimension merged into the
 * one inside it where both sides are contiguous across them. 0 and *out
 * filled, or 1 when the elements are not rows of contiguous elements with
 * one pitch per side. *out has rows 0 when there is no element. */
static int fold_rows(int ndim, const int64_t *shape, const int64_t *ss,
                     const int64_t *ds, size_t itemsize, uint64_t src,
                     uint64_t dst, usmipc__copy_t *out) {
  int64_t n[USMIPC_BUNDLE_MAX_NDIM], s[USMIPC_BUNDLE_MAX_NDIM],
      d[USMIPC_BUNDLE_MAX_NDIM];
  int k = 0; /* folded dimensions, innermost first */
  memset(out, 0, sizeof(*out));
  out->src = src;
  out->dst = dst;
  for (int i = ndim - 1; i >= 0; i--) {
    if (shape[i] == 0)
      return 0; /* no element: nothing to copy */
    if (shape[i] == 1)
      continue;
    if (k > 0 && ss[i] == s[k - 1] * n[k - 1] && ds[i] == d[k - 1] * n[k - 1]) {
      n[k - 1] *= shape[i];
      continue;
    }
    n[k] = shape[i];
    s[k] = ss[i];
    d[k] = ds[i];
    k++;
  }
  if (k == 0) { /* one element */
    out->row_bytes = itemsize;
    out->rows = 1;
    return 0;
  }
  if (k > 2 || s[0] != 1 || d[0] != 1)
    return 1;
  out->row_bytes = (uint64_t)n[0] * itemsize;
  out->rows = k == 2 ? (uint64_t)n[1] : 1;
  out->src_pitch = k == 2 ? (uint64_t)s[1] * itemsize : 0;
  out->dst_pitch = k == 2 ? (uint64_t)d[1] * itemsize : 0;
  return 0;
}

/* ---- create and free ---------------------------------------------------- */

int usmipc_copy_plan_create(usmipc_device_t *device,
                            const usmipc_copy_dest_t *dests, size_t count,
                            unsigned flags, usmipc_copy_plan_t **out) {
  if (out == NULL)
    return usmipc__fail(USMIPC_EINVAL, "usmipc_copy_plan_create: plan is NULL");
  *out = NULL;
  if (device == NULL || (dests == NULL && count > 0))
    return usmipc__fail(USMIPC_EINVAL,
                        "usmipc_copy_plan_create: device or dests is NULL");
  if (flags & ~USMIPC_PLAN_PIN_TREE)
    return usmipc__fail(USMIPC_EINVAL,
                        "usmipc_copy_plan_create: unknown flags 0x%x", flags);
  if (count > USMIPC__BUNDLE_MAX_ARRAYS)
    return usmipc__fail(USMIPC_EINVAL,
                        "usmipc_copy_plan_create: %zu destinations, more "
                        "than a bundle's %u arrays",
                        count, (unsigned)USMIPC__BUNDLE_MAX_ARRAYS);
  size_t dims = 0;
  for (size_t i = 0; i < count; i++) {
    const usmipc_array_desc_t *dd = &dests[i].desc;
    if (dd->ndim < 0 || dd->ndim > USMIPC_BUNDLE_MAX_NDIM ||
        (dd->ndim > 0 && dd->shape == NULL))
      return usmipc__fail(USMIPC_EINVAL,
                          "usmipc_copy_plan_create: destination %zu has %d "
                          "dimensions (0 to %d, with a shape)",
                          i, dd->ndim, USMIPC_BUNDLE_MAX_NDIM);
    if (usmipc__bundle_itemsize(dd->dtype_code, dd->dtype_bits,
                                dd->dtype_lanes) == 0)
      return usmipc__fail(USMIPC_EINVAL,
                          "usmipc_copy_plan_create: destination %zu has "
                          "dtype code %u, %u bits, %u lanes, which bundles "
                          "do not carry",
                          i, dd->dtype_code, dd->dtype_bits, dd->dtype_lanes);
    for (int j = 0; j < dd->ndim; j++)
      if (dd->shape[j] < 0 || (dd->strides && dd->strides[j] < 0))
        return usmipc__fail(USMIPC_EINVAL,
                            "usmipc_copy_plan_create: destination %zu has a "
                            "negative size or stride in dimension %d",
                            i, j);
    dims += 2u * (size_t)dd->ndim;
  }
  usmipc_copy_plan_t *p = calloc(1, sizeof(*p));
  size_t n = count ? count : 1;
  if (p != NULL) {
    p->array = malloc(n * sizeof(*p->array));
    p->dst = malloc(n * sizeof(*p->dst));
    p->desc = malloc(n * sizeof(*p->desc));
    p->dims = malloc((dims ? dims : 1) * sizeof(*p->dims));
    p->name = calloc(n, sizeof(*p->name));
    p->src = calloc(n, sizeof(*p->src));
    p->copies = malloc(n * sizeof(*p->copies));
    p->copy_of = malloc(n * sizeof(*p->copy_of));
  }
  if (p == NULL || !p->array || !p->dst || !p->desc || !p->dims || !p->name ||
      !p->src || !p->copies || !p->copy_of) {
    usmipc_copy_plan_free(p);
    return usmipc__fail(USMIPC_ENOMEM, "out of memory");
  }
  p->device = device;
  p->flags = flags;
  p->count = count;
  int64_t *at = p->dims;
  for (size_t i = 0; i < count; i++) {
    const usmipc_array_desc_t *dd = &dests[i].desc;
    p->array[i] = dests[i].array;
    p->dst[i] = (uint64_t)(uintptr_t)dests[i].ptr;
    p->desc[i] = *dd;
    int64_t *shape = at, *strides = at + dd->ndim;
    at += 2 * dd->ndim;
    int64_t step = 1;
    for (int j = dd->ndim - 1; j >= 0; j--) {
      shape[j] = dd->shape[j];
      strides[j] = dd->strides ? dd->strides[j] : step;
      step *= dd->shape[j] > 0 ? dd->shape[j] : 1;
    }
    p->desc[i].shape = shape;
    p->desc[i].strides = strides;
    if (dests[i].name != NULL && (p->name[i] = strdup(dests[i].name)) == NULL) {
      usmipc_copy_plan_free(p);
      return usmipc__fail(USMIPC_ENOMEM, "out of memory");
    }
  }
  *out = p;
  return 0;
}

int usmipc_copy_plan_free(usmipc_copy_plan_t *p) {
  if (p == NULL)
    return 0;
  int rc = 0;
  /* The batch waits for its last launch (CUDA) before it goes, and only
   * then are the mappings that launch read closed. */
  if (p->batch_made)
    p->device->ops->copy_batch_destroy(p->device->native, p->batch);
  if (p->held != NULL)
    usmipc_bundle_close(p->held);
  usmipc_queue_destroy(p->own_queue);
  for (size_t i = 0; p->name != NULL && i < p->count; i++)
    free(p->name[i]);
  free(p->name);
  free(p->array);
  free(p->dst);
  free(p->desc);
  free(p->dims);
  free(p->src);
  free(p->copies);
  free(p->copy_of);
  free(p->meta);
  free(p);
  return rc;
}

/* ---- binding to a bundle ------------------------------------------------ */

/* Checks every destination against its array of ob and makes the copies;
 * on failure the plan is as it was. */
static int bind_plan(usmipc_copy_plan_t *p, const usmipc_opened_bundle_t *ob) {
  char who[160], a[200], b[200];
  size_t ncopies = 0;
  for (size_t i = 0; i < p->count; i++) {
    const usmipc_array_desc_t *dd = &p->desc[i];
    if (p->array[i] >= ob->narr)
      return usmipc__fail(USMIPC_EINVAL,
                          "usmipc_bundle_update: %s takes the bundle's array "
                          "%u, but the bundle has %zu arrays (the producer's "
                          "tree changed: make the plan again)",
                          dest_name(p, i, who, sizeof(who)), p->array[i],
                          ob->narr);
    const usmipc_bundle_array_t *sa = &ob->arrays[p->array[i]];
    const usmipc_array_desc_t *sd = &sa->desc;
    if (sd->dtype_code != dd->dtype_code || sd->dtype_bits != dd->dtype_bits ||
        sd->dtype_lanes != dd->dtype_lanes)
      return usmipc__fail(USMIPC_EINVAL,
                          "usmipc_bundle_update: %s has dtype code %u of %u "
                          "bits, but the bundle's array %u has code %u of %u "
                          "bits (nothing was copied)",
                          dest_name(p, i, who, sizeof(who)), dd->dtype_code,
                          dd->dtype_bits, p->array[i], sd->dtype_code,
                          sd->dtype_bits);
    bool same_shape = sd->ndim == dd->ndim;
    for (int j = 0; same_shape && j < dd->ndim; j++)
      same_shape = sd->shape[j] == dd->shape[j];
    if (!same_shape) {
      format_dims(a, sizeof(a), dd->ndim, dd->shape);
      format_dims(b, sizeof(b), sd->ndim, sd->shape);
      return usmipc__fail(USMIPC_EINVAL,
                          "usmipc_bundle_update: %s has shape %s, but the "
                          "bundle's array %u has shape %s (nothing was "
                          "copied)",
                          dest_name(p, i, who, sizeof(who)), a, p->array[i], b);
    }
    size_t itemsize = usmipc__bundle_itemsize(dd->dtype_code, dd->dtype_bits,
                                              dd->dtype_lanes);
    usmipc__copy_t c;
    if (fold_rows(dd->ndim, dd->shape, sd->strides, dd->strides, itemsize,
                  (uint64_t)(uintptr_t)sa->ptr, p->dst[i], &c) != 0) {
      format_dims(a, sizeof(a), dd->ndim, dd->strides);
      format_dims(b, sizeof(b), sd->ndim, sd->strides);
      return usmipc__fail(USMIPC_ENOTSUP,
                          "usmipc_bundle_update: %s (strides %s) and the "
                          "bundle's array %u (strides %s) are not rows of "
                          "contiguous elements with one pitch each, which is "
                          "what one batched copy moves; make the destination "
                          "(or the producer's tensor) contiguous, or copy "
                          "this leaf yourself (nothing was copied)",
                          dest_name(p, i, who, sizeof(who)), a, p->array[i], b);
    }
    if (c.rows == 0) {
      p->copy_of[i] = SIZE_MAX;
    } else {
      if (p->dst[i] == 0)
        return usmipc__fail(USMIPC_EINVAL,
                            "usmipc_bundle_update: %s has elements but no "
                            "pointer",
                            dest_name(p, i, who, sizeof(who)));
      p->copy_of[i] = ncopies;
      p->copies[ncopies++] = c;
    }
    p->src[i] = sa->ptr;
  }
  p->ncopies = ncopies;
  return 0;
}

/* The update's copies when nothing but mappings may have moved: true when
 * every source is where it was. */
static bool sources_same(usmipc_copy_plan_t *p,
                         const usmipc_opened_bundle_t *ob) {
  bool same = true;
  for (size_t i = 0; i < p->count; i++) {
    const void *src = ob->arrays[p->array[i]].ptr;
    if (src == p->src[i])
      continue;
    same = false;
    if (p->copy_of[i] != SIZE_MAX) {
      usmipc__copy_t *c = &p->copies[p->copy_of[i]];
      c->src = (uint64_t)(uintptr_t)src;
    }
    p->src[i] = src;
  }
  return same;
}

/* The copies, queued: the backend's batch, or each row with memcpy. */
static int queue_copies(usmipc_copy_plan_t *p, usmipc_queue_t *q, bool same) {
  const usmipc__backend_ops_t *ops = p->device->ops;
  if (ops->copy_batch_run != NULL) {
    if (!p->batch_made) {
      int rc = ops->copy_batch_create(p->device->native, &p->batch);
      if (rc != 0)
        return rc;
      p->batch_made = true;
      same = false;
    }
    return ops->copy_batch_run(p->device->native, p->batch, q->native,
                               p->copies, p->ncopies, same);
  }
  for (size_t i = 0; i < p->ncopies; i++) {
    const usmipc__copy_t *c = &p->copies[i];
    for (uint64_t r = 0; r < c->rows; r++) {
      int rc = ops->memcpy(p->device->native, q->native,
                           (void *)(uintptr_t)(c->dst + r * c->dst_pitch),
                           (const void *)(uintptr_t)(c->src + r * c->src_pitch),
                           c->row_bytes);
      if (rc != 0)
        return rc;
    }
  }
  return 0;
}

/* The copies, then the ticket after them; ob becomes the held open (the
 * one held before is closed, unless it is ob). On a failed copy ob is
 * closed unless held. */
static int finish(usmipc_copy_plan_t *p, usmipc_opened_bundle_t *ob,
                  usmipc_queue_t *q, usmipc_queue_t *queue, unsigned flags,
                  bool same) {
  int rc = queue_copies(p, q, same);
  if (rc != 0) {
    usmipc__error_prefix("usmipc_bundle_update: ");
    if (ob != p->held)
      usmipc_bundle_close(ob);
    return rc;
  }
  if (!(flags & USMIPC_UPDATE_KEEP_TICKET) && ob->handoff != NULL &&
      ob->handoff->has_release &&
      (rc = usmipc__release_send(ob->handoff, q)) != 0) {
    /* The copies are queued: keep the mappings they read. */
    usmipc__error_prefix("usmipc_bundle_update: the copies are queued, but "
                         "returning the ticket failed: ");
  }
  if (ob != p->held) {
    usmipc_opened_bundle_t *old = p->held;
    p->held = ob;
    if (old != NULL)
      usmipc_bundle_close(old);
  }
  if (rc == 0 && queue == NULL)
    rc = usmipc_queue_synchronize(q);
  return rc;
}

int usmipc_bundle_update(usmipc_copy_plan_t *p, const void *data, size_t len,
                         usmipc_queue_t *queue, unsigned flags) {
  if (p == NULL)
    return usmipc__fail(USMIPC_EINVAL, "usmipc_bundle_update: plan is NULL");
  if (flags & ~(USMIPC_OPEN_UNORDERED | USMIPC_UPDATE_KEEP_TICKET))
    return usmipc__fail(USMIPC_EINVAL,
                        "usmipc_bundle_update: unknown flags 0x%x", flags);
  if (queue != NULL && queue->device != p->device)
    return usmipc__fail(USMIPC_EINVAL,
                        "usmipc_bundle_update: the queue is on %s, but the "
                        "plan's destinations are on %s",
                        queue->device->filter, p->device->filter);
  usmipc_queue_t *q = queue;
  int rc;
  if (q == NULL) {
    if (p->own_queue == NULL &&
        (rc = usmipc_queue_create(p->device, &p->own_queue)) != 0)
      return rc;
    q = p->own_queue;
  }
  /* Warm: the same bundle's next handoff, its mappings already held. */
  if (p->held != NULL &&
      (rc = usmipc__bundle_reuse(p->held, data, len, q,
                                 flags & USMIPC_OPEN_UNORDERED)) != 0) {
    if (rc < 0)
      return rc;
    return finish(p, p->held, q, queue, flags, true);
  }
  usmipc_opened_bundle_t *ob;
  if ((rc = usmipc_bundle_open(data, len, p->device, q,
                               flags & USMIPC_OPEN_UNORDERED, &ob)) != 0)
    return rc;
  const uint8_t *meta = ob->bytes + ob->meta_at;
  bool same_tree = p->bound && ob->meta_len == p->meta_len &&
                   memcmp(meta, p->meta, p->meta_len) == 0;
  bool same = same_tree;
  if (!same_tree) {
    if (p->bound && (p->flags & USMIPC_PLAN_PIN_TREE)) {
      usmipc_bundle_close(ob);
      return usmipc__fail(USMIPC_EINVAL,
                          "usmipc_bundle_update: the bundle's tree (keys, "
                          "nesting, dtypes, shapes) is not the one this plan "
                          "was first used with; make the plan again for the "
                          "new tree (nothing was copied)");
    }
    uint8_t *copy = malloc(ob->meta_len ? ob->meta_len : 1);
    if (copy == NULL) {
      usmipc_bundle_close(ob);
      return usmipc__fail(USMIPC_ENOMEM, "out of memory");
    }
    if ((rc = bind_plan(p, ob)) != 0) {
      free(copy);
      usmipc_bundle_close(ob);
      return rc;
    }
    memcpy(copy, meta, ob->meta_len);
    free(p->meta);
    p->meta = copy;
    p->meta_len = ob->meta_len;
    p->bound = true;
  } else {
    same = sources_same(p, ob);
  }
  return finish(p, ob, q, queue, flags, same);
}
