#!/usr/bin/env bash
# usmipc.distributed on GPUs (issue 13), for the device machine:
#
#   OUT=/tmp/out bash tests/gpu/distributed.sh          # nvidia-h200-x2
#   OUT=/tmp/out bash tests/gpu/distributed.sh one-gpu  # nvidia-h200
#
# Two ranks of torch.distributed (NCCL for the engine's own traffic), and of
# mpi4py under mpirun where the machine has both, for fd and native CUDA
# memory (USMIPC_CUDA_IPC): with 2 GPUs once with both GPUs visible to both
# ranks and once with CUDA_VISIBLE_DEVICES giving each rank only its own
# (the peer's GPU hidden); with one GPU (one-gpu) both ranks on it. Each rank
# reads and writes the peer's buffer through the mapping, measures a copy out
# of it against an in-process copy between the same GPUs (goal >= 0.97x) and
# runs examples/distributed_allreduce.py's all-reduce on 2 x 256 MiB against
# torch.distributed.all_reduce. Results: $OUT/distributed.jsonl (one line
# per rank and run, plus the baseline), $OUT/distributed.log, and a table at
# the end. Needs python3 with torch (the device image has it; CuPy for the
# in-process baseline, else torch's copy); installs usmipc itself unless
# SKIP_BUILD=1. About 2 minutes with one GPU, 4 with two.
set -u
OUT=${OUT:-/tmp/usmipc-gpu}
mkdir -p "$OUT"
mode=${1:-x2}
# Never use NVLink multicast on the shared machines (device README).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
exec > >(tee "$OUT/distributed.log") 2>&1
JSON=$OUT/distributed.jsonl
: > "$JSON"
status=0
here=$(cd "$(dirname "$0")" && pwd)

nvidia-smi --query-gpu=index,name,driver_version,uuid --format=csv,noheader
nvidia-smi topo -m 2>/dev/null | head -4
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count())'
# SKIP_BUILD=1: usmipc is installed already (tests/gpu/run.sh distributed does it).
[ -n "${SKIP_BUILD:-}" ] || python3 -m pip install -q --no-build-isolation --no-index --no-deps . 2>&1 | tail -2
python3 -m usmipc | head -8

run() { # run NAME COMMAND...
  local name=$1; shift
  echo "=== $name: $*"
  local t0=$SECONDS
  if timeout 400 "$@"; then echo "=== $name: pass in $((SECONDS - t0)) s"
  else echo "=== $name: FAIL($?) in $((SECONDS - t0)) s"; status=1; fi
}

if [ "$mode" = one-gpu ]; then
  visibilities="same"
  run baseline env CUDA_VISIBLE_DEVICES=0 python3 "$here/distributed.py" baseline --json "$JSON"
else
  visibilities="all per-rank"
  run baseline python3 "$here/distributed.py" baseline --json "$JSON"
fi

have_mpi=0
if command -v mpirun >/dev/null && python3 -c 'import mpi4py' 2>/dev/null; then
  have_mpi=1
else
  echo "=== no mpirun or no mpi4py here: the MPI runs are skipped"
fi

for kind in fd native; do
  for visible in $visibilities; do
    run "torch-$kind-$visible" env USMIPC_CUDA_IPC=$kind \
      python3 "$here/distributed.py" launch --visible "$visible" --json "$JSON"
    if [ $have_mpi = 1 ]; then
      run "mpi-$kind-$visible" mpirun --allow-run-as-root --oversubscribe -n 2 \
        -x USMIPC_CUDA_IPC=$kind -x NCCL_NVLS_ENABLE -x TORCH_SYMM_MEM_DISABLE_MULTICAST \
        -x NVSHMEM_DISABLE_NVLS -x PYTHONUNBUFFERED -x PATH -x LD_LIBRARY_PATH \
        python3 "$here/distributed.py" rank --engine mpi --visible "$visible" --json "$JSON"
    fi
  done
done

echo "=== results"
python3 - "$JSON" <<'EOF'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
base = next((r for r in rows if r["what"] == "baseline"), {})
print("baseline:", {k: (round(v, 1) if isinstance(v, float) else v)
                    for k, v in base.items() if k != "what"})
print(f"{'engine':6} {'kind':6} {'visible':8} rk {'ordered':8} {'pull GB/s':>9} "
      f"{'x base':>6} {'push GB/s':>9} {'x base':>6} {'ar ms':>7} {'nccl ms':>7} ok")
nan = float("nan")
for r in rows:
    if r["what"] != "rank":
        continue
    if r["visible"] == "same":
        pull_ref = push_ref = base.get("same_gpu_gbps")
    else:
        pull_ref = base.get(f"pull_gbps_{r['rank']}")
        push_ref = base.get(f"push_gbps_{r['rank']}")
    pull, push = r["mapped_pull_gbps"], r["mapped_push_gbps"]
    ordered = "ok" if r["ordered_exchange"] == "ok" else "FAILED"
    print(f"{r['engine']:6} {r['cuda_ipc']:6} {r['visible']:8} {r['rank']:2} "
          f"{ordered:8} {pull:9.1f} {pull / pull_ref if pull_ref else nan:6.3f} "
          f"{push:9.1f} {push / push_ref if push_ref else nan:6.3f} "
          f"{r['allreduce_ms']:7.3f} {r['nccl_allreduce_ms']:7.3f} "
          f"{'yes' if r['ok'] else 'NO ' + str(r['checks'])}")
    if ordered != "ok":
        print("   ordered exchange:", r["ordered_exchange"][:300])
EOF
echo "=== status $status"
exit $status
