"""The README's quick start, run the way it says: the producer and the
consumer started separately (two processes with nothing in common but the
bytes file), data checked both ways."""
import pathlib
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_quickstart_two_processes(tmp_path):
    path = tmp_path / "q.bytes"
    producer = subprocess.Popen(
        [sys.executable, str(ROOT / "examples" / "quickstart_producer.py"),
         str(path)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True)
    try:
        deadline = time.monotonic() + 60
        while not path.exists() and time.monotonic() < deadline:
            assert producer.poll() is None, producer.stdout.read()
            time.sleep(0.05)
        consumer = subprocess.run(
            [sys.executable, str(ROOT / "examples" / "quickstart_consumer.py"),
             str(path)], capture_output=True, text=True, timeout=60)
        assert consumer.returncode == 0, consumer.stdout + consumer.stderr
        assert "w = [0.0, 1.0, 2.0" in consumer.stdout
        assert consumer.stdout.strip().endswith("ok")
        out, _ = producer.communicate(timeout=60)
        assert producer.returncode == 0, out
        assert "w[:3] = [-1.0, 1.0, 2.0]" in out  # the consumer's write
        assert not path.exists()
    finally:
        if producer.poll() is None:
            producer.kill()


def test_pool_workers_write_the_parents_memory():
    """examples/pool_workers.py, as docs/multiprocessing.md shows it (the
    page holds the file's code verbatim, after its docstring)."""
    path = ROOT / "examples" / "pool_workers.py"
    r = subprocess.run([sys.executable, str(path)], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.splitlines() == ["workers wrote [1, 2, 3, 4]",
                                     "parent sees [1, 2, 3, 4]", "ok"]
    code = path.read_text().split('"""', 2)[2].lstrip("\n")
    assert code in (ROOT / "docs" / "multiprocessing.md").read_text()
