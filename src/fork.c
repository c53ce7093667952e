/* fork() from any thread at any moment, and the library's one lock order.
 *
 * The top floor of the core: it calls every module's fork handlers and
 * nothing calls it (libuv's uv_loop_fork stands above uv__io_fork and the
 * rest in the same way).
 *
 * Every lock of the library is taken before the fork, in the one order
 * normal code nests them, and released after it, so that the child never
 * inherits a lock held by a thread that does not exist there. One handler
 * set, registered once when the library loads, instead of one per module:
 * pthread_atfork runs prepare handlers in reverse registration order, and
 * modules registering lazily made that order depend on which was used first,
 * the opposite of the nesting order (a deadlock).
 *
 * THE LOCK ORDER. A thread holding one of these locks takes only locks
 * below it in this list, never one above (the other modules' comments refer
 * here rather than repeat it):
 *
 *   1. bundle.c        live_lock: the list of live bundles; taken alone.
 *   2. torch_allocator.c  torch_create_lock, then each pool's pending-list
 *                      lock: a free under one takes the registry lock.
 *   3. event.c         events_lock: local events, rings, the event import
 *                      cache and (release.c) the release-ticket registry;
 *                      taken before the registry's (peer references).
 *   4. core/region.c   usmipc__registry_lock: regions, the import cache and
 *                      the importer's peers (one lock, by design); the
 *                      import cache's sweeper thread holds it while it
 *                      sweeps.
 *   5. pool.c          live_pools_lock, then each pool's lock: an export
 *                      holds the registry lock when it asks the pool for its
 *                      block, and a pool lock is held while a block's slot is
 *                      added to or removed from the export table.
 *   6. core/device.c   probe_lock: a foreign pointer query probes the
 *                      backends under the registry lock.
 *   7. linux/exports.c table_lock: the export table.
 *   8. linux/broker.c  fdx_lock: the broker's grants and listening sockets.
 *   9. linux/fdtake.c  kept_lock: the importer's kept broker connections; a
 *                      leaf (nothing is taken under it).
 *  10. util/process.c  proof_lock, then random_lock (the random pool's):
 *                      leaves, taken under any of them.
 *
 * Locks not listed (a backend's per-device locks, wait.c's interrupt
 * handler lock) are not taken by the fork handlers: each guards its own
 * module's state only.
 *
 * No library lock is held across a wait on another process or on the
 * device, nor across a call to the binding's interrupt hook
 * (usmipc__interrupted), which may take a lock of the binding's own
 * (Python's GIL) whose holder may be waiting for a library lock.
 *
 * The handlers are registered by a constructor, so this object must be
 * linked into every program: the static archive usmipc_static makes its
 * users reference usmipc__fork_linked (CMakeLists.txt), since an archive
 * member nothing references is left out of the link. */
#include <pthread.h>

#include "objects.h"

const int usmipc__fork_linked = 1;

static void fork_prepare(void) {
  usmipc__bundles_fork_prepare();
  usmipc__torch_fork_prepare();
  usmipc__events_fork_prepare();
  usmipc__registry_fork_prepare();
  usmipc__pools_fork_prepare();
  usmipc__devices_fork_prepare();
  usmipc__exports_fork_prepare();
  usmipc__broker_fork_prepare();
  usmipc__fdtake_fork_prepare();
  usmipc__process_fork_prepare();
}

static void fork_parent(void) {
  usmipc__process_fork_parent();
  usmipc__fdtake_fork_parent();
  usmipc__broker_fork_parent();
  usmipc__exports_fork_parent();
  usmipc__devices_fork_parent();
  usmipc__pools_fork_parent();
  usmipc__registry_fork_parent();
  usmipc__events_fork_parent();
  usmipc__torch_fork_parent();
  usmipc__bundles_fork_parent();
}

static void fork_child(void) {
  usmipc__process_fork_child();
  usmipc__fdtake_fork_child();
  usmipc__broker_fork_child();
  usmipc__exports_fork_child();
  usmipc__devices_fork_child();
  usmipc__pools_fork_child();
  usmipc__imports_fork_child(); /* under usmipc__registry_lock */
  usmipc__registry_fork_child();
  usmipc__releases_fork_child(); /* under usmipc__events_lock */
  usmipc__events_fork_child();
  usmipc__torch_fork_child();
  usmipc__bundles_fork_child();
}

__attribute__((constructor)) static void register_fork_handlers(void) {
  pthread_atfork(fork_prepare, fork_parent, fork_child);
}
