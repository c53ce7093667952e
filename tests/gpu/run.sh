#!/usr/bin/env bash
# The GPU verification runner, for the device machine (NVIDIA H200): builds
# usmipc there and runs the subsets of checks it is given (usage below).
# Every step runs even if an earlier one failed, each under a time limit;
# the log, a summary line per step and the benchmarks' JSON go to $OUT
# (tests/gpu/steps.sh). Needs python3 with scikit-build-core, pytest, numpy,
# torch, cupy and cuda.core (the device image has them) and no network.
usage() {
  cat <<'EOF'
usage: OUT=/tmp/out bash tests/gpu/run.sh [SUBSET...]      (default: full)

Subsets, run in the order given; the first that needs them builds
build-gpu/ and pip-installs usmipc, once:
  full          suites, then bench
  quick         suites, then bench-quick
  suites        the C suite on the host (ctest) and on cuda:gpu:0 with fd
                and with native memory; python -m usmipc; the demo on
                cuda:gpu (fd, native) and host:cpu; tests/python; tests/gpu;
                every code block of README.md and docs/ (doc_blocks.sh);
                usmipc pools as torch's allocator, each case in a process
  bench         every benchmark: first open, broker, events, pool blocks,
                the handoff latency, usmipc_bench (fd, native, --raw),
                the fresh exports (tests/gpu/export_bench.py), bench_cuda.py,
                bench_weights.py (10 repetitions; the MoE layout 3)
  bench-quick   the cheap benchmarks of bench, and bench_weights.py with 3
                repetitions (the MoE layout with 2)
  bench-layout  usmipc_bench and bench_cuda.py briefly; each JSON must have
                the layout of the results kept in bench/results/ and no
                error (tests/gpu/bench_layout.py)
  probe         the CUDA driver alone (tests/gpu/probe_native_open_close.c):
                threads opening and closing legacy handles, unlocked and
                locked, one handle and a handle per thread
  races         the C tests of threads opening legacy handles at once,
                repeated: ipc_open_same_handle_threads and ipc_no_leak_uncached
  tickets       release tickets whose consumers exit or are SIGKILLed
                (tests/gpu/tickets_exit.py), fd and native memory
  distributed   usmipc.distributed with 2 ranks (tests/gpu/distributed.sh:
                one rank per GPU with two GPUs, both on GPU 0 with one)
  update        the one-call update (issue 23): its C tests on cuda:gpu:0
                (fd, native), tests/gpu/test_gpu_update.py, and
                tests/gpu/update_bench.py for the 338-tensor and the MoE
                layouts (caching allocator, expandable segments, the copy
                loop) beside a flat device copy; per tensor on both sides
                against torch's floors (tests/gpu/per_tensor_bench.py)
  update-more   the same bench with expandable segments (both layouts) and
                with the copy loop (USMIPC_COPY_BATCH=loop, MoE); fan-out to 8
                consumers (tests/gpu/fanout_bench.py)
  torch-mp      usmipc.torch (issue 24): tests/gpu/test_gpu_torch_reducers.py
                and tests/python/test_torch_reducers.py; PyTorch's own
                test_multiprocessing.py with USMIPC_TORCH=1 in every process
                (tests/torch_mp/run.sh; carry .carry/, which holds the file
                and an expecttest wheel); tests/gpu/torch_mp_bench.py
  wheel         the release wheel in dist/ (carried; make wheel) in a fresh
                environment: tests/python, tests/gpu, the demo
                (tests/gpu/wheel.sh; WHEEL_SKIP_GPU=1 leaves out tests/gpu)

One device call runs at most 10 minutes: give suites a call of its own
and bench another, rather than full in one. Logs: $OUT/gpu-SUBSETS.log
(every step's output; the subsets' names joined by _, as in
gpu-probe_races.log) and $OUT/summary-gpu-SUBSETS.txt (one line per step).
Exit status 0 when every step passed.

Scripts of tests/gpu that run alone too: distributed.sh, wheel.sh and
doc_blocks.sh (which the subsets above call); for a short lease,
events_quick.sh (the event C tests and benchmarks), bundles_quick.sh (the
pool and bundle C tests, the GPU bundle tests, a short weight handoff) and
tickets_exit.sh (the ticket C tests and tickets_exit.py).
EOF
}
SUBSETS=" full quick suites bench bench-quick bench-layout probe races tickets distributed update update-more torch-mp wheel "
[ $# -gt 0 ] || set -- full
for s in "$@"; do
  case $s in
    -h | --help | help) usage; exit 0 ;;
  esac
  if [[ $SUBSETS != *" $s "* ]]; then
    usage >&2
    echo "run.sh: no subset named '$s'" >&2
    exit 2
  fi
done
. "$(dirname "$0")/steps.sh" "gpu-$(IFS=_; echo "$*")"

built=0 installed=0
need_build() { [ $built = 1 ] || step build 600 build; built=1; }
need_install() { [ $installed = 1 ] || step pip 300 install; installed=1; }

# The C test NAME, N times in a row on cuda:gpu:0 with KIND memory: a race
# that one run of the suite may miss.
repeat_c_test() { # repeat_c_test NAME KIND N
  local i
  for i in $(seq "$3"); do
    if ! USMIPC_TEST_DEVICE=cuda:gpu:0 USMIPC_CUDA_IPC=$2 \
         build-gpu/tests/c/usmipc_tests "$1" > /tmp/usmipc-repeat.log 2>&1; then
      tail -n 30 /tmp/usmipc-repeat.log
      echo "$1 ($2 memory): failed in run $i of $3"
      return 1
    fi
  done
  echo "$1 ($2 memory): $3 of $3 passed"
}

# The driver, threads opening and closing legacy handles at once: each run
# in a process of its own, so that a crash (exit 139) is counted, not fatal.
# A report, not a test: it passes whatever the driver does.
probe() {
  local p=build-gpu/tests/c/probe_native_open_close crashes=0 mode rc
  for mode in unlocked unlocked unlocked unlocked unlocked unlocked locked locked; do
    "$p" $mode 8 2000; rc=$?
    echo "exit $rc ($mode)"; [ $rc -ge 128 ] && crashes=$((crashes + 1))
  done
  for mode in unlocked locked unlocked locked; do
    "$p" $mode 8 500 distinct; echo "exit $? ($mode, distinct)"
  done
  "$p" unlocked 1 4000 distinct; echo "exit $? (one thread)"
  echo "crashes: $crashes"
}

suites() {
  need_build; need_install
  step ctest-host 600 ctest --test-dir build-gpu -j 8 --output-on-failure
  step c-cuda-fd 600 env USMIPC_TEST_DEVICE=cuda:gpu:0 USMIPC_CUDA_IPC=fd build-gpu/tests/c/usmipc_tests
  step c-cuda-native 600 env USMIPC_TEST_DEVICE=cuda:gpu:0 USMIPC_CUDA_IPC=native build-gpu/tests/c/usmipc_tests
  step py-list 60 python3 -m usmipc
  step demo-cuda 120 python3 -m usmipc demo --device cuda:gpu
  step demo-cuda-native 120 env USMIPC_CUDA_IPC=native python3 -m usmipc demo --device cuda:gpu
  step demo-host 120 python3 -m usmipc demo --device host:cpu
  step pytest-host 600 python3 -m pytest -q -rs tests/python
  step pytest-gpu 900 python3 -m pytest -q -rs -s tests/gpu --ignore=tests/gpu/test_gpu_torch_allocator.py
  # Every code block of README.md and docs/, the GPU ones included.
  step doc-blocks 600 bash tests/gpu/doc_blocks.sh
  # usmipc pools as torch's CUDA allocator: each case in a fresh process
  # (torch's allocator is chosen once per process); prints one RESULT line
  # per case (segments, driver exports and imports per sharing round).
  step torch-allocator 600 python3 -m pytest -v -rs -s tests/gpu/test_gpu_torch_allocator.py
}

# The cheap benchmarks: the transport's first open and broker concurrency
# (host memory, all cores of the device machine), events (issue 10: their C
# costs against the bare driver, and the handoff latency against
# torch.multiprocessing and a CuPy host synchronize), pool blocks.
bench_cheap() {
  need_build; need_install
  step bench-first 300 build-gpu/bench/usmipc_bench_first --k 60 --json "$OUT/bench_first_h200.json"
  step bench-broker 300 build-gpu/bench/usmipc_bench_broker --json "$OUT/bench_broker_h200.json"
  step bench-event 300 env USMIPC_CUDA_IPC=native build-gpu/bench/usmipc_bench_event --device cuda:gpu:0 --k 400 --json "$OUT/bench_event_h200.json"
  step bench-event-host 300 build-gpu/bench/usmipc_bench_event --device host:cpu
  step bench-pool 300 build-gpu/bench/usmipc_bench_pool --device cuda:gpu:0 --json "$OUT/bench_pool_h200.json"
  step bench-handoff 600 python3 bench/bench_events.py --trials 100 --json "$OUT/bench_handoff_h200.json"
  # Fresh native exports from Python, ordered (issue 23, item 5), with the
  # reuse of completed records on and off side by side.
  step bench-export-reuse 120 python3 tests/gpu/export_bench.py --json "$OUT/export_reuse1.json"
  step bench-export-record 120 env USMIPC_ORDER_REUSE=0 python3 tests/gpu/export_bench.py --json "$OUT/export_reuse0.json"
}
# Weight handoff (issue 11): a Qwen2.5-1.5B bf16 state dict (338 tensors,
# 3.1 GB) through usmipc bundles against torch.multiprocessing, a flattened
# bucket and cuda.core; bench-quick: the full shapes, 3 repetitions (~40 s).
bench_quick() {
  bench_cheap
  step bench-weights-quick 240 python3 bench/bench_weights.py --reps 3 --json "$OUT/bench_weights_quick_h200.json"
  step bench-weights-moe-quick 420 python3 bench/bench_weights.py --layout moe --reps 2 --json "$OUT/bench_weights_moe_quick_h200.json"
}
bench() {
  bench_cheap
  step bench-c-cuda-fd 600 env USMIPC_CUDA_IPC=fd build-gpu/bench/usmipc_bench --device cuda:gpu:0 --sizes 4096,1048576,268435456,1073741824 --json "$OUT/bench_c_cuda_fd.json"
  step bench-c-cuda-native 600 env USMIPC_CUDA_IPC=native build-gpu/bench/usmipc_bench --device cuda:gpu:0 --sizes 4096,1048576,268435456,1073741824 --json "$OUT/bench_c_cuda_native.json"
  step bench-raw-fd 600 build-gpu/bench/usmipc_bench --raw --device cuda:gpu:0 --kind fd --k 60 --rounds 2 --json "$OUT/bench_raw_fd.json"
  step bench-raw-native 600 build-gpu/bench/usmipc_bench --raw --device cuda:gpu:0 --kind native --k 60 --rounds 2 --json "$OUT/bench_raw_native.json"
  step bench-cuda 600 python3 bench/bench_cuda.py --json "$OUT/bench_cuda.json" --plot "$OUT/bench_cuda.png"
  step bench-weights 540 python3 bench/bench_weights.py --reps 10 --json "$OUT/bench_weights_h200.json"
  step bench-weights-moe 600 python3 bench/bench_weights.py --layout moe --reps 3 --json "$OUT/bench_weights_moe_h200.json"
}

# Every usmipc_bench and bench_cuda.py invocation of bench, briefly, and
# its JSON against a result kept from before the benchmarks were split by
# system (bench/README.md; H200, 2026-11-29): the same keys at every level,
# no error. A minute.
bench_layout() {
  need_build; need_install
  local B=build-gpu/bench/usmipc_bench J=$OUT/bench-layout REF=bench/results
  local L="python3 tests/gpu/bench_layout.py"
  mkdir -p "$J"
  step layout-run-c-fd 300 env USMIPC_CUDA_IPC=fd $B --device cuda:gpu:0 --sizes 4096,1048576 --k 10 --rounds 1 --iters 200 --json "$J/bench_c_cuda_fd.json"
  step layout-run-c-native 300 env USMIPC_CUDA_IPC=native $B --device cuda:gpu:0 --sizes 4096,1048576 --k 10 --rounds 1 --iters 200 --json "$J/bench_c_cuda_native.json"
  step layout-run-raw-fd 300 $B --raw --device cuda:gpu:0 --kind fd --sizes 4096,1048576 --k 20 --rounds 1 --json "$J/bench_raw_fd.json"
  step layout-run-raw-native 300 $B --raw --device cuda:gpu:0 --kind native --sizes 4096,1048576 --k 20 --rounds 1 --json "$J/bench_raw_native.json"
  step layout-run-cuda 600 python3 bench/bench_cuda.py --sizes 4K,1M --k 5 --repeat-export 100 --reopen 100 --torch-repeat 20 --bw-reps 5 --json "$J/bench_cuda.json" --plot "$J/bench_cuda.png"
  step layout-selftest 300 python3 bench/bench_cuda.py --selftest
  step layout-c-fd 60 $L $REF/h200-x2-2026-11-29/bench_c_cuda_fd.json "$J/bench_c_cuda_fd.json" --no-errors
  step layout-c-native 60 $L $REF/h200-x2-2026-11-29/bench_c_cuda_native.json "$J/bench_c_cuda_native.json" --no-errors
  step layout-raw-fd 60 $L $REF/h200-2026-11-29-run4/bench_raw_fd.json "$J/bench_raw_fd.json" --no-errors
  # The raw native reference of 2026-11-29 predates wire format v2; the raw
  # fd one of run 4 has the layout both kinds write now.
  step layout-raw-native 60 $L $REF/h200-2026-11-29-run4/bench_raw_fd.json "$J/bench_raw_native.json" --no-errors
  step layout-cuda 60 $L $REF/h200-x2-2026-11-29/bench_cuda.json "$J/bench_cuda.json" --no-errors
}

probe_subset() {
  need_build
  step probe 300 probe
}
# The striped legacy-handle locks and the cache's unmap race (docs/cuda.md,
# "Threads opening legacy handles").
races() {
  need_build
  step same-handle-native-x5 300 repeat_c_test ipc_open_same_handle_threads native 5
  step same-handle-fd-x2 300 repeat_c_test ipc_open_same_handle_threads fd 2
  step no-leak-uncached-native-x10 300 repeat_c_test ipc_no_leak_uncached native 10
}
update() {
  need_build; need_install
  local t kind
  for kind in fd native; do
    for t in update_cross_process update_refused; do
      step "c-$t-$kind" 120 env USMIPC_TEST_DEVICE=cuda:gpu:0 USMIPC_CUDA_IPC=$kind build-gpu/tests/c/usmipc_tests $t
    done
  done
  step pytest-update 300 python3 -m pytest -q -rs tests/gpu/test_gpu_update.py tests/gpu/test_gpu_share_queries.py tests/python/test_update.py
  step per-tensor-qwen 200 python3 tests/gpu/per_tensor_bench.py --layout qwen --json "$OUT/per_tensor_qwen.json"
  step per-tensor-moe 300 python3 tests/gpu/per_tensor_bench.py --layout moe --reps 5 --json "$OUT/per_tensor_moe.json"
  step update-qwen 300 python3 tests/gpu/update_bench.py --layout qwen --json "$OUT/update_qwen.json"
  step update-moe 400 python3 tests/gpu/update_bench.py --layout moe --json "$OUT/update_moe.json"
}
update_more() {
  need_install
  step update-moe-expandable 400 python3 tests/gpu/update_bench.py --layout moe --expandable --json "$OUT/update_moe_expandable.json"
  step update-qwen-expandable 300 python3 tests/gpu/update_bench.py --layout qwen --expandable --json "$OUT/update_qwen_expandable.json"
  step update-moe-loop 400 env USMIPC_COPY_BATCH=loop python3 tests/gpu/update_bench.py --layout moe --rounds 3 --json "$OUT/update_moe_loop.json"
  step fanout-qwen 300 python3 tests/gpu/fanout_bench.py --layout qwen --json "$OUT/fanout_qwen.json"
  local k
  for k in 256 4096; do
    step "update-moe-chunk-$k" 300 env USMIPC_COPY_CHUNK_KIB=$k python3 tests/gpu/update_bench.py --layout moe --rounds 4 --json "$OUT/update_moe_chunk$k.json"
  done
}
tickets() {
  need_install
  step tickets-exit-fd 400 env USMIPC_CUDA_IPC=fd python3 tests/gpu/tickets_exit.py
  step tickets-exit-native 400 env USMIPC_CUDA_IPC=native python3 tests/gpu/tickets_exit.py
}
distributed() {
  need_install
  local mode=one-gpu
  [ "$(nvidia-smi -L 2>/dev/null | wc -l)" -ge 2 ] && mode=x2
  step distributed 540 env OUT="$OUT/distributed" SKIP_BUILD=1 bash tests/gpu/distributed.sh $mode
}
torch_mp() {
  need_install
  step pytest-torch-reducers 400 python3 -m pytest -q -rs tests/gpu/test_gpu_torch_reducers.py tests/python/test_torch_reducers.py
  step torch-test-multiprocessing 540 env PY=python3 OUT="$OUT/torch_mp" bash tests/torch_mp/run.sh
  step torch-mp-bench 500 python3 tests/gpu/torch_mp_bench.py --json "$OUT/torch_mp_bench.json"
}
wheel() {
  step wheel 540 env OUT="$OUT/wheel" bash tests/gpu/wheel.sh
}

for s in "$@"; do
  case $s in
    full) suites; bench ;;
    quick) suites; bench_quick ;;
    suites) suites ;;
    bench) bench ;;
    bench-quick) bench_quick ;;
    bench-layout) bench_layout ;;
    probe) probe_subset ;;
    races) races ;;
    tickets) tickets ;;
    update) update ;;
    update-more) update_more ;;
    distributed) distributed ;;
    torch-mp) torch_mp ;;
    wheel) wheel ;;
  esac
done
summary
exit $status
