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


def _readme_c_block():
    """The README's lines that build the two-process C sample."""
    text = (ROOT / "README.md").read_text()
    start = text.index("```sh no-run\ncmake -S . -B build-c")
    block = text[start:text.index("```\n", start + 3)]
    return block.splitlines()[1:]


def test_c_sample_as_the_readme_builds_it(tmp_path):
    """The README's C commands as written (HOME a fresh directory, so the
    install lands there), then its two terminals: the producer of the CMake
    build and the consumer of the pkg-config build, data checked both
    ways."""
    import os
    import shutil
    import pytest
    if os.environ.get("USMIPC_TEST_INSTALLED") == "1":
        pytest.skip("the C sample builds from the source tree, not the wheel")
    for tool in ("cmake", "cc", "pkg-config"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is not installed")
    lines = _readme_c_block()
    # Each terminal's command is the line after its "# terminal N" comment.
    terminals = [lines[i + 1] for i, x in enumerate(lines)
                 if x.startswith("# terminal")]
    build = [x for x in lines if x not in terminals]
    assert len(terminals) == 2
    env = dict(os.environ, HOME=str(tmp_path))
    env.pop("PKG_CONFIG_PATH", None)
    r = subprocess.run(["bash", "-e", "-c", "\n".join(build)], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    path = tmp_path / "h.bytes"
    producer_cmd = terminals[0].split("#")[0].split()
    consumer_cmd = terminals[1].split("#")[0].split()
    producer = subprocess.Popen([producer_cmd[0], str(path)], cwd=ROOT,
                                env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while not path.exists() and time.monotonic() < deadline:
            assert producer.poll() is None, producer.stdout.read()
            time.sleep(0.05)
        consumer = subprocess.run([consumer_cmd[0], str(path)], cwd=ROOT,
                                  env=env, capture_output=True, text=True,
                                  timeout=60)
        assert consumer.returncode == 0, consumer.stdout + consumer.stderr
        assert 'the producer wrote "hello from the producer"' in \
            consumer.stdout
        out, _ = producer.communicate(timeout=60)
        assert producer.returncode == 0, out
        assert 'the consumer wrote "hello back from the consumer"' in out
    finally:
        if producer.poll() is None:
            producer.kill()
    # Without the rpath the loader cannot find the library, as the README
    # says.
    bare = tmp_path / "consumer-norpath"
    flags = subprocess.run(["pkg-config", "--cflags", "--libs", "usmipc"],
                           env=dict(env, PKG_CONFIG_PATH=str(
                               tmp_path / ".local/lib/pkgconfig")),
                           capture_output=True, text=True).stdout.split()
    subprocess.run(["cc", str(ROOT / "examples/c/consumer.c"), "-o",
                    str(bare), *flags], check=True)
    r = subprocess.run([str(bare), str(path)], capture_output=True, text=True,
                       env={k: v for k, v in env.items()
                            if k != "LD_LIBRARY_PATH"})
    assert "libusmipc.so.0: cannot open shared object file" in r.stderr
