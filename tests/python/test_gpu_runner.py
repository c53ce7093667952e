"""tests/gpu/run.sh, the GPU runner, runs on the device machine only; here
its argument check: every subset its usage names is accepted and has a
branch (torch-mp was named and refused)."""
import pathlib
import re
import subprocess

RUN = pathlib.Path(__file__).resolve().parents[2] / "tests" / "gpu" / "run.sh"


def usage_subsets():
    out = subprocess.run(["bash", str(RUN), "--help"], capture_output=True,
                         text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    block = out.stdout.split("Subsets", 1)[1].split("\n\n", 1)[0]
    return re.findall(r"^  ([a-z][a-z-]*)  ", block, re.M)


def test_every_subset_of_the_usage_is_accepted():
    subsets = usage_subsets()
    assert "torch-mp" in subsets and len(subsets) >= 10
    text = RUN.read_text()
    accepted = re.search(r'^SUBSETS=" (.*) "$', text, re.M).group(1).split()
    assert sorted(accepted) == sorted(subsets)
    for s in subsets:
        assert re.search(rf"^    {re.escape(s)}\) ", text, re.M), s


def test_an_unknown_subset_is_refused_by_name():
    out = subprocess.run(["bash", str(RUN), "no-such"], capture_output=True,
                         text=True, timeout=30)
    assert out.returncode == 2 and "no subset named 'no-such'" in out.stderr
