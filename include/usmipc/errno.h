/* usmipc error codes.
 *
 * Every call returns 0 on success or a negative code. Codes that mirror a
 * POSIX errno use its negated value (so strerror-style tools agree); the
 * library's own codes live in the reserved range -30000..-30999, far from any
 * errno. Values are pinned: once released a code never changes meaning.
 * One X-macro table generates the enum, usmipc_strerror and usmipc_err_name.
 */
#ifndef USMIPC_ERRNO_H
#define USMIPC_ERRNO_H

#include <errno.h>

#define USMIPC_ERRNO_MAP(XX)                                                   \
  XX(EINVAL, -EINVAL, "invalid argument")                                      \
  XX(ENOMEM, -ENOMEM, "out of memory")                                         \
  XX(EBUSY, -EBUSY, "resource busy")                                           \
  XX(EACCES, -EACCES, "permission denied")                                     \
  XX(ENOTSUP, -ENOTSUP, "operation not supported on this device")              \
  XX(ENODEV, -ENODEV, "no such device")                                        \
  XX(ERANGE, -ERANGE, "size or offset out of range")                           \
  XX(EIO, -EIO, "input/output error")                                          \
  XX(EBACKEND, -30001, "driver call failed")                                   \
  XX(EUNAVAILABLE, -30002, "backend not available")                            \
  XX(EBADHANDLE, -30003, "malformed IPC handle")                               \
  XX(EHANDLEVERSION, -30004, "unsupported IPC handle version")                 \
  XX(EOTHERHOST, -30005, "IPC handle from another host or boot")               \
  XX(EWRONGDEVICE, -30006, "IPC handle belongs to another device")             \
  XX(EEXPORTERGONE, -30007, "exporting process or allocation is gone")         \
  XX(EMEMKIND, -30008, "memory of the wrong kind")                             \
  XX(EUNKNOWNPTR, -30009, "pointer not known to usmipc")                       \
  XX(ENOTMAPPED, -30010, "pointer is not an open IPC mapping")                 \
  XX(ETRANSPORT, -30011, "file descriptor transport failed")                   \
  XX(ETIMEDOUT, -ETIMEDOUT, "timed out waiting for the exporting process")     \
  XX(EINTR, -EINTR, "interrupted")                                             \
  XX(EMFILE, -EMFILE, "too many open files")                                   \
  XX(ENAMESPACE, -30012, "exporter in another PID or network namespace")       \
  XX(EUNTRUSTED, -30013, "peer failed authentication")                         \
  XX(ENOTREADY, -30014, "event not complete yet")

typedef enum usmipc_errno {
#define XX(name, value, text) USMIPC_##name = (value),
  USMIPC_ERRNO_MAP(XX)
#undef XX
} usmipc_errno_t;

#endif /* USMIPC_ERRNO_H */
