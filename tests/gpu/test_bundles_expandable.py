"""A state dict from PyTorch's expandable_segments allocator (cuMemCreate
chunks) shared as one bundle: each array's run of chunks travels once, the
consumer reads the producer's values and its writes come back. The producer
runs in a fresh process, since the allocator setting must precede CUDA."""
import os
import pathlib
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

# The producer (and its consumer) is a script of its own, also run by hand.
SCRIPT = (pathlib.Path(__file__).parent / "expandable_producer.py").read_text()


def test_bundle_of_expandable_segments(tmp_path):
    script = tmp_path / "producer.py"
    script.write_text(SCRIPT)
    env = dict(os.environ,
               PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True")
    r = subprocess.run([sys.executable, str(script)], env=env,
                       capture_output=True, text=True, timeout=120)
    print(r.stdout, r.stderr)
    if r.returncode == 3 and "fabric" in r.stdout:
        pytest.skip("torch made fabric-only chunks: " + r.stdout)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "RESULT ok" in r.stdout
