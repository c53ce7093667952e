set -u
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
cmake -S . -B build-gpu -DUSMIPC_WERROR=ON > /dev/null && cmake --build build-gpu -j 16 > /dev/null || echo BUILD FAILED
python3 -m pip install -q --no-build-isolation --no-index --no-deps . > /dev/null 2>&1 || echo PIP FAILED
for t in event_local event_queue_from_native event_same_process event_cross_process event_exporter_gone event_ordered_handoff event_ordered_same_process event_bad_handles event_forged_cross_process event_threads event_release_cross_process event_release_same_process; do
  for k in fd native; do USMIPC_TEST_DEVICE=cuda:gpu:0 USMIPC_CUDA_IPC=$k timeout 60 build-gpu/tests/c/usmipc_tests $t > /tmp/t.log 2>&1; echo "$t $k rc=$?"; done
done
env USMIPC_CUDA_IPC=native build-gpu/bench/usmipc_bench_event --device cuda:gpu:0 --k 400 --json $OUT/bench_event_h200.json
build-gpu/bench/usmipc_bench_event --device host:cpu --json $OUT/bench_event_host_h200.json
timeout 400 python3 bench/bench_events.py --trials 100 --json $OUT/bench_handoff_h200.json 2>&1 | tail -25
