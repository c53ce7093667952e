/* Every test and helper of usmipc_tests, once (libuv's test-list.h habit).
 *
 * TEST_LIST(X) expands X(name) for each test `TEST_IMPL(name)`;
 * HELPER_LIST(X) for each helper role `HELPER_IMPL(name)`.
 * tests/c/CMakeLists.txt reads the X(...) lines below to register each test
 * with CTest as c.<name>, so keep one entry per line. */
#ifndef USMIPC_TEST_LIST_H
#define USMIPC_TEST_LIST_H

#define TEST_LIST(X)                                                           \
  X(errors_strerror_every_code)                                                \
  X(errors_unknown_codes)                                                      \
  X(errors_last_error_per_thread)                                              \
  X(errors_version)                                                            \
  X(devices_get_devices)                                                       \
  X(devices_select_host)                                                       \
  X(devices_select_default)                                                    \
  X(devices_select_bad_filters)                                                \
  X(devices_backend_status)                                                    \
  X(devices_queue)                                                             \
  X(memory_malloc_kinds)                                                       \
  X(memory_memcpy_memset)                                                      \
  X(memory_pointer_query_interior)                                             \
  X(memory_pointer_query_unknown)                                              \
  X(memory_buffer_id_unique)                                                   \
  X(memory_buffer_id_after_reuse)                                              \
  X(memory_free_bad_pointers)                                                  \
  X(memory_malloc_bad_args)                                                    \
  X(memory_threads)                                                            \
  X(ipc_handle_inspect_fields)                                                 \
  X(ipc_export_bad_args)                                                       \
  X(ipc_same_process_alias)                                                    \
  X(ipc_alias_refcount)                                                        \
  X(ipc_free_while_alias_open)                                                 \
  X(ipc_cross_process_auto)                                                    \
  X(ipc_cross_process_socket)                                                  \
  X(ipc_cross_process_pidfd)                                                   \
  X(ipc_cross_process_procfd)                                                  \
  X(ipc_parent_exporter_child_importer)                                        \
  X(ipc_interior_offset)                                                       \
  X(ipc_rest_of_allocation)                                                    \
  X(ipc_open_nbytes_range)                                                     \
  X(ipc_importer_refcount)                                                     \
  X(ipc_stale_cache)                                                           \
  X(ipc_survives_exporter_free_and_exit)                                       \
  X(ipc_survives_exporter_sigkill)                                             \
  X(ipc_exporter_gone_auto)                                                    \
  X(ipc_exporter_gone_socket)                                                  \
  X(ipc_exporter_gone_pidfd)                                                   \
  X(ipc_exporter_gone_procfd)                                                  \
  X(ipc_allocation_freed_before_open)                                          \
  X(ipc_revoke)                                                                \
  X(ipc_other_uid_refused)                                                     \
  X(ipc_fork_child_exports)                                                    \
  X(ipc_cache_limit)                                                           \
  X(ipc_no_leak_cached)                                                        \
  X(ipc_no_leak_uncached)                                                      \
  X(handle_truncated)                                                          \
  X(handle_oversized)                                                          \
  X(handle_bit_flips)                                                          \
  X(handle_version_bumped)                                                     \
  X(handle_wrong_backend)                                                      \
  X(handle_other_boot)                                                         \
  X(handle_forged_token)                                                       \
  X(handle_forged_buffer_id)                                                   \
  X(handle_forged_fd_identity)                                                 \
  X(handle_forged_range_known)                                                 \
  X(handle_range_overflow)                                                     \
  X(handle_null_and_empty)                                                     \
  X(handle_extension_records)                                                  \
  X(handle_chunk_records)                                                      \
  X(mac_blake2s_vectors)                                                       \
  X(trust_fork_storm)                                                          \
  X(trust_squatter_after_exit)                                                 \
  X(trust_squatter_after_sigkill)                                              \
  X(trust_other_uid_exporter)                                                  \
  X(trust_broker_stall)                                                        \
  X(trust_signal_deadline)                                                     \
  X(trust_interrupt_handler)                                                   \
  X(trust_cache_reopen_after_free)                                             \
  X(trust_cache_reopen_after_sigkill)                                          \
  X(trust_open_again_while_mapped_after_free)                                  \
  X(trust_procfd_fifo)                                                         \
  X(trust_procfd_fifo_data)                                                    \
  X(trust_netns_message)                                                       \
  X(trust_pidns_message)                                                       \
  X(trust_container_socket_dir)                                                \
  X(trust_container_socket_dir_machine_id)                                     \
  X(trust_container_socket_dir_userns)                                         \
  X(trust_fd_limit_code)                                                       \
  X(trust_idle_cache_drop_freed)                                               \
  X(trust_idle_cache_byte_cap)                                                 \
  X(trust_sealed_memfd)                                                        \
  X(trust_pid_reuse)                                                           \
  X(trust_socket_dir_stale_files)                                              \
  X(trust_kept_connection)                                                     \
  X(trust_kept_connection_fork)                                                \
  X(trust_broker_threads)                                                      \
  X(dmabuf_check_refuses_others)                                               \
  X(dmabuf_check_cuda)                                                         \
  X(event_local)                                                               \
  X(event_queue_from_native)                                                   \
  X(event_same_process)                                                        \
  X(event_cross_process)                                                       \
  X(event_exporter_gone)                                                       \
  X(event_ordered_handoff)                                                     \
  X(event_ordered_same_process)                                                \
  X(event_bad_handles)                                                         \
  X(event_forged_cross_process)                                                \
  X(event_fork_child)                                                          \
  X(event_threads)                                                             \
  X(event_release_cross_process)                                               \
  X(event_release_same_process)                                                \
  X(event_import_sweep)                                                        \
  X(pool_basics)                                                               \
  X(pool_cross_process)                                                        \
  X(pool_hundred_thousand_blocks)                                              \
  X(pool_threads)                                                              \
  X(stats_count_driver_work)                                                   \
  X(bundle_cross_process)                                                      \
  X(bundle_refused)                                                            \
  X(bundle_ten_thousand_arrays)                                                \
  X(bundle_one_exchange)                                                       \
  X(cuda_vmm_foreign_chunks)                                                   \
  X(cuda_vmm_foreign_limits)                                                   \
  X(torch_alloc_host_threads)                                                  \
  X(torch_alloc_device_threads)                                                \
  X(torch_alloc_host_edges)                                                    \
  X(torch_alloc_cuda)                                                          \
  X(fdbatch_socket_600)                                                        \
  X(fdbatch_refusals)                                                          \
  X(fdbatch_runs_apart)                                                        \
  X(fdbatch_pidfd_procfd)                                                      \
  X(fdbatch_prefetch_open)

#define HELPER_LIST(X) X(agent) X(bundle_reader)

#endif /* USMIPC_TEST_LIST_H */
