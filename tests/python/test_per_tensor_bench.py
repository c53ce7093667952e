"""tests/gpu/per_tensor_bench.py (issue 23, item 2) measures on the GPU;
here its harness on usmipc host memory: it runs, writes every figure, and
the consumer's warm opens made no driver import and took no descriptor."""
import json
import os
import pathlib
import subprocess
import sys

import pytest

from conftest import child_env

BENCH = pathlib.Path(__file__).resolve().parents[2] / "tests" / "gpu" / \
    "per_tensor_bench.py"
MUST_RUN = os.environ.get("CI") == "true" and \
    os.environ.get("USMIPC_TEST_INSTALLED") != "1"


def test_the_harness_runs_on_the_host(tmp_path):
    try:
        import torch  # noqa: F401
    except ImportError:
        if MUST_RUN:
            pytest.fail("torch is not installed (make distributed-deps)")
        pytest.skip("torch is not installed")
    out = tmp_path / "per_tensor.json"
    r = subprocess.run([sys.executable, str(BENCH), "--device", "host",
                        "--layout", "small", "--reps", "3", "--json",
                        str(out)], capture_output=True, text=True,
                       timeout=300, env=child_env())
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads(out.read_text())
    p = res["producer"]
    assert p["tensors"] == p["allocations"] == 10
    assert p["share_driver_exports"] == 0  # every allocation exported once
    for k in ("attrs_us", "share_us", "share_blocks_us"):
        assert p[k] > 0, k
    for label in ("caching", "pool"):
        c = res["consumer"][label]
        assert c["leaves"] == 10
        assert c["warm_driver_imports"] == 0 and c["warm_descriptors"] == 0
        for k in ("open_us", "open_torch_us", "from_dlpack_us"):
            assert c[k] > 0, (label, k)
    assert "target <= 0.3" in r.stdout
