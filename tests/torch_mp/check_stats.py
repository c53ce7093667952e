"""Reads the counters every process of a run wrote (USMIPC_TORCH_STATS)
and checks that no CUDA tensor or storage was pickled by torch's own CUDA
IPC: every one the reducers saw was routed through usmipc (a bundle) or
refused as torch refuses it, and none fell back. Prints one line per process that did something, then the
totals; exits 1 if a check fails."""

import json
import pathlib
import sys

directory = pathlib.Path(sys.argv[1])
records = [json.loads(p.read_text()) for p in sorted(directory.glob("*.json"))]
# A process killed while writing leaves only its .tmp file.
unfinished = sorted(p.name for p in directory.glob("*.tmp"))
if unfinished:
    print(f"{len(unfinished)} processes were killed while writing their "
          f"counters: {' '.join(unfinished)}")
keys = ("cuda_tensors", "cuda_storages", "routed_tensors", "routed_storages",
        "host_tensors", "torch_tensors", "fallbacks", "refused", "messages",
        "bundles",
        "standalone", "forwarded", "received_tensors", "received_storages",
        "reused_storages")
total = dict.fromkeys(keys, 0)
exports = imports = 0
for r in records:
    for k in keys:
        total[k] += r.get(k, 0)
    u = r.get("usmipc", {})
    exports += u.get("driver_exports", 0)
    imports += u.get("driver_imports", 0)
    busy = {k: r[k] for k in keys if r.get(k)}
    if busy:
        print(r["pid"], " ".join(r["argv"])[-60:], busy)
print(f"{len(records)} processes wrote counters; totals:", total,
      f"driver exports {exports}, imports {imports}")
failures = []
cuda_routed = total["routed_tensors"] - total["host_tensors"]
if total["fallbacks"]:
    failures.append(f"{total['fallbacks']} CUDA tensors went by torch's path")
# Refused as torch refuses them (a non-leaf that requires grad): seen,
# never pickled (test_non_leaf_variable_sharing).
if total["cuda_tensors"] != cuda_routed + total["refused"]:
    failures.append(f"{total['cuda_tensors']} CUDA tensors pickled, "
                    f"{cuda_routed} through usmipc, {total['refused']} "
                    f"refused as torch refuses them")
if not records:
    failures.append("no process wrote counters (is usmipc-torch.pth "
                    "installed? USMIPC_TORCH=1 set?)")
for f in failures:
    print("FAIL:", f)
sys.exit(1 if failures else 0)
