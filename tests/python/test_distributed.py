"""usmipc.distributed on host memory, over the engines' own launchers:
torch.distributed with gloo (4 processes) and mpi4py under mpirun (4
ranks). Every rank reads every other rank's value through its mapping, then
sees its peers' new values after a barrier (a copy would not); ranks that
run under another boot id (a bind mount over
/proc/sys/kernel/random/boot_id in their own mount and UTS namespaces, as
root) are another node: None with a reason, and the library itself refuses
their handles. A rank that dies after the exchange leaves its memory mapped
and readable by the others, and one that never arrives fails the exchange
with the engine's own timeout.

The ranks are tests/python/distributed_rank.py. torch and mpi4py come from
`make distributed-deps` (CI installs them): the tests skip without them,
except in CI's own run (CI=true), where a missing one fails them."""
import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import uuid

import pytest

from conftest import child_env

HERE = os.path.dirname(os.path.abspath(__file__))
RANK = os.path.join(HERE, "distributed_rank.py")
BOOT_ID = "/proc/sys/kernel/random/boot_id"
NRANKS = 4
TIMEOUT = 240  # seconds for a whole group of ranks


# CI's own venv has torch and mpi4py (make distributed-deps): a missing one
# fails there. The installed-wheel runs (tests/install/wheel.sh) are fresh
# venvs without them, and skip.
MUST_RUN = os.environ.get("CI") == "true" and \
    os.environ.get("USMIPC_TEST_INSTALLED") != "1"


def need(module, what):
    if importlib.util.find_spec(module) is None:
        message = f"{module} is not installed ({what}: make distributed-deps)"
        if MUST_RUN:
            pytest.fail(message + "; CI must run these tests")
        pytest.skip(message)


@pytest.fixture(scope="module")
def other_node(tmp_path_factory):
    """A command prefix that runs a rank as if on another node: its own
    mount namespace with another boot id bound over the kernel's, and its
    own UTS namespace with another host name."""
    path = tmp_path_factory.mktemp("node-b") / "boot_id"
    fake = str(uuid.uuid4())
    path.write_text(fake + "\n")
    prefix = ["unshare", "--mount", "--uts", "--propagation", "private",
              "sh", "-c",
              f'mount --bind "$0" {BOOT_ID} && hostname node-b && exec "$@"',
              str(path)]
    if shutil.which("unshare") is None:
        pytest.skip("unshare(1) is missing (util-linux)")
    probe = subprocess.run(prefix + ["cat", BOOT_ID], capture_output=True,
                           text=True, timeout=30)
    if probe.returncode != 0 or probe.stdout.strip() != fake:
        pytest.skip("cannot bind another boot id in a mount namespace "
                    f"(needs root): {probe.stderr.strip()}")
    return prefix, fake


@pytest.fixture(scope="module")
def fake_rsh(other_node, tmp_path_factory):
    """An rsh for mpirun that reaches host 'node-b' by starting its command
    (Open MPI's daemon, orted) here, under other_node's namespaces: mpirun
    then runs a second daemon on what it takes for a second node."""
    prefix, fake = other_node
    path = tmp_path_factory.mktemp("rsh") / "fake_rsh"
    # rsh's arguments: the host, then the remote command line as words.
    # It leaves a mark, so that a test can tell an mpirun that never used it.
    path.write_text(f"#!/bin/sh\ntouch '{path}.used'\nshift\nexec " +
                    " ".join(f"'{w}'" for w in prefix) + ' sh -c "$*"\n')
    path.chmod(0o755)
    return str(path), fake


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def collect(procs, outdir, timeout=TIMEOUT):
    """Waits for every rank (killing all past timeout); returns the exit
    codes, each rank's output and the ranks' JSON reports by rank."""
    deadline = time.monotonic() + timeout
    outs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=max(1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            out, _ = p.communicate()
            out += b"\n[killed: the group ran past its timeout]"
        outs.append(out.decode(errors="replace"))
    reports = {}
    for name in os.listdir(outdir):
        if name.startswith("rank") and name.endswith(".json"):
            with open(os.path.join(outdir, name)) as f:
                report = json.load(f)
            reports[report["rank"]] = report
    return [p.returncode for p in procs], outs, reports


def run_torch(tmp_path, scenario, n=NRANKS, prefix_for=None, pg_timeout=60):
    need("torch", "torch.distributed with gloo")
    env = child_env(USMIPC_TEST_INIT=f"tcp://127.0.0.1:{free_port()}",
                    WORLD_SIZE=n, USMIPC_TEST_PG_TIMEOUT=pg_timeout,
                    GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS=1)
    procs = []
    t0 = time.monotonic()
    for r in range(n):
        cmd = [sys.executable, RANK, "torch", scenario, str(tmp_path)]
        if prefix_for is not None:
            cmd = prefix_for(r) + cmd
        procs.append(subprocess.Popen(cmd, env=dict(env, RANK=str(r)),
                                      stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT))
    codes, outs, reports = collect(procs, tmp_path)
    print(f"torch/gloo {scenario}: {n} ranks in "
          f"{time.monotonic() - t0:.1f} s")
    return codes, outs, reports


def mpirun():
    need("mpi4py", "mpi4py under mpirun")
    launcher = shutil.which("mpirun")
    if launcher is None:
        if MUST_RUN:
            pytest.fail("mpirun is missing (apt-get install openmpi-bin); "
                        "CI must run these tests")
        pytest.skip("mpirun is missing (apt-get install openmpi-bin)")
    return [launcher, "--allow-run-as-root", "--oversubscribe"]


def run_mpi(tmp_path, scenario, apps, env=None, options=()):
    """mpirun with one app context per (count, prefix) in apps."""
    cmd = mpirun() + list(options)
    for i, (count, prefix) in enumerate(apps):
        if i:
            cmd.append(":")
        cmd += ["-n", str(count), *prefix, sys.executable, RANK, "mpi",
                scenario, str(tmp_path)]
    t0 = time.monotonic()
    p = subprocess.Popen(cmd, env=child_env(OMP_NUM_THREADS=1, **(env or {})),
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    codes, outs, reports = collect([p], tmp_path)
    print(f"mpirun {scenario}: {sum(c for c, _ in apps)} ranks in "
          f"{time.monotonic() - t0:.1f} s")
    return codes[0], outs[0], reports


def check_basic(reports, n):
    assert sorted(reports) == list(range(n))
    print(f"exchange of {n} ranks: "
          f"{max(r['exchange_s'] for r in reports.values()) * 1e3:.1f} ms "
          "(slowest rank)")
    for r, rep in reports.items():
        assert rep["ok"] and rep["size"] == n
        assert rep["after_write"] == [100 + k for k in range(n)]
        assert "rank 1 could not share its memory" in rep["bad_input_error"]
        # its own memory for itself, a mapping of every peer
        assert rep["kinds"][r] != "SharedArray"
        assert all(kind == "SharedArray" for k, kind in
                   enumerate(rep["kinds"]) if k != r)


def check_two_nodes(reports, n, other, fake, reason_words):
    assert sorted(reports) == list(range(n))
    for r, rep in reports.items():
        mine = other if r in other else set(range(n)) - other
        assert (rep["boot_id"] == fake) == (r in other)
        assert {int(k) for k in rep["reasons"]} == set(range(n)) - mine
        for k, why in rep["reasons"].items():
            assert f"rank {k} " in why and reason_words in why, why
            assert reports[int(k)]["boot_id"] in why, why
        for k, refusal in rep["library_refusals"].items():
            assert refusal is not None, f"rank {r} opened rank {k}'s memory"
            assert refusal[0] == "USMIPC_EOTHERHOST", refusal
            assert "boot id differs" in refusal[1] or "another machine" in \
                refusal[1], refusal


# ---- torch.distributed (gloo) ----------------------------------------------


def test_torch_not_initialized():
    need("torch", "torch.distributed")
    import usmipc.distributed
    from usmipc.memory import MemoryUSMDevice
    mem = MemoryUSMDevice(64, device="host:cpu")
    with pytest.raises(RuntimeError, match="init_process_group"):
        usmipc.distributed.exchange(mem)


def test_torch_gloo_four_ranks(tmp_path):
    codes, outs, reports = run_torch(tmp_path, "basic")
    assert codes == [0] * NRANKS, "\n".join(outs)
    check_basic(reports, NRANKS)
    # odd ranks passed torch tensors: their own entry is the tensor
    assert reports[1]["kinds"][1] == "Tensor"
    assert reports[0]["kinds"][0] == "MemoryUSMDevice"


def test_torch_gloo_two_nodes(tmp_path, other_node):
    prefix, fake = other_node
    other = {2, 3}
    env_other = ",".join(map(str, sorted(other)))
    os.environ["USMIPC_TEST_OTHER_NODE"] = env_other
    try:
        codes, outs, reports = run_torch(
            tmp_path, "two_nodes",
            prefix_for=lambda r: prefix if r in other else [])
    finally:
        del os.environ["USMIPC_TEST_OTHER_NODE"]
    assert codes == [0] * NRANKS, "\n".join(outs)
    check_two_nodes(reports, NRANKS, other, fake, "runs on another node")
    assert "host 'node-b'" in reports[0]["reasons"]["2"]


def test_torch_rank_killed_after_exchange(tmp_path):
    n = 3
    codes, outs, reports = run_torch(tmp_path, "death_after", n=n,
                                     pg_timeout=20)
    assert codes[:-1] == [0] * (n - 1), "\n".join(outs)
    assert codes[-1] == -9, "\n".join(outs)
    for r in range(n - 1):
        rep = reports[r]
        # its memory stays mapped and holds what it last wrote
        assert rep["dead_rank_value"] == 500 + n - 1
        # a new open of it fails cleanly
        assert rep["reopen_error"][0] == "USMIPC_EEXPORTERGONE", rep
        # the collective close reports the engine's failure, not a hang
        assert rep["close"].startswith(f"rank {r}: close() could not wait"), \
            rep["close"]
        assert rep["close_s"] < 60


def test_torch_rank_missing_from_exchange(tmp_path):
    n, timeout = 3, 5
    codes, outs, reports = run_torch(tmp_path, "death_during", n=n,
                                     pg_timeout=timeout)
    assert codes == [0] * n, "\n".join(outs)
    for r in range(n - 1):
        rep = reports[r]
        assert rep["exchange"] != "returned", rep
        assert "timed out" in rep["exchange"].lower(), rep["exchange"]
        assert timeout - 1 < rep["failed_after_s"] < timeout + 30, rep


def check_bad_records(reports, n):
    """Every rank, rank 1 included, raised ExchangeError naming rank 1 for
    each bad record it sent, and said what was wrong with it."""
    assert sorted(reports) == list(range(n))
    for r, rep in reports.items():
        assert rep["ok"]
        seen = rep["bad_records"]
        assert len(seen) == 12, seen
        for name, message in seen.items():
            assert "rank 1 sent a malformed" in message, (r, name, message)
        assert "not a dict" in seen["a list"]
        assert "'bundle'" in seen["no bundle key"]
        assert "'pid'" in seen["pid a string"] and "str" in seen["pid a string"]
        assert "'pid'" in seen["pid a bool"]
        assert "'host'" in seen["host bytes"]
        assert "error report" in seen["report a dict"]


def test_torch_gloo_bad_records(tmp_path):
    codes, outs, reports = run_torch(tmp_path, "bad_records")
    assert codes == [0] * NRANKS, "\n".join(outs)
    check_bad_records(reports, NRANKS)


FORGED_SLOTS = (0x00100005, 0xFFFFFFF0)


def check_forged_slot(reports, n):
    """Every rank came through (none crashed or hung: the decoder used to
    read outside rank 1's export table, SIGSEGV for 0xFFFFFFF0), and raised
    ExchangeError for each forged slot: every honest rank refused rank 1's
    bundle bytes as beyond the export table; then a normal exchange read
    every peer's memory."""
    assert sorted(reports) == list(range(n))
    for r, rep in reports.items():
        assert rep["ok"], r
        seen = rep["forged_slot"]
        assert sorted(seen) == sorted(str(s) for s in FORGED_SLOTS), seen
        for slot, got in seen.items():
            assert sorted(got["failures"]) == \
                [str(k) for k in range(n) if k != 1], got
            for k, why in got["failures"].items():
                assert f"rank {k} could not map rank 1's memory" in why, why
                assert f"slot {slot} is beyond the 1048576 slots" in why, why
            assert got["message"].startswith(
                "usmipc.distributed: the exchange failed on "
                f"{n - 1} rank(s): rank 0 could not map rank 1's memory"), \
                got["message"]
        assert rep["after_forged"] == [100 + k for k in range(n)], rep


def test_torch_gloo_forged_slot(tmp_path):
    """Issue 21: rank 1 sends bundle bytes whose slot lies past its export
    table (checksum recomputed) over torch.distributed (gloo)."""
    codes, outs, reports = run_torch(tmp_path, "forged_slot")
    assert codes == [0] * NRANKS, "\n".join(outs)
    check_forged_slot(reports, NRANKS)


# ---- mpi4py under mpirun -----------------------------------------------------


def test_mpi_four_ranks(tmp_path):
    code, out, reports = run_mpi(tmp_path, "basic", [(NRANKS, [])])
    assert code == 0, out
    check_basic(reports, NRANKS)


def test_mpi_ranks_of_another_kernel(tmp_path, other_node):
    """mpirun starts every rank on this host, so MPI's COMM_TYPE_SHARED puts
    all four on one node; ranks 2 and 3 run under another boot id, which
    the library refuses: the exchange narrows MPI's node to this kernel's
    ranks and says why."""
    prefix, fake = other_node
    code, out, reports = run_mpi(
        tmp_path, "two_nodes", [(2, []), (2, prefix)],
        env={"USMIPC_TEST_OTHER_NODE": "2,3"})
    assert code == 0, out
    check_two_nodes(reports, NRANKS, {2, 3}, fake,
                    "MPI puts rank")


def test_mpi_two_nodes(tmp_path, fake_rsh):
    """Two nodes as MPI itself sees them: mpirun starts ranks 2 and 3
    through its rsh launcher on host 'node-b' (a daemon in other mount and
    UTS namespaces, with another boot id), so COMM_TYPE_SHARED splits the
    job in two."""
    rsh, fake = fake_rsh
    here = socket.gethostname()
    code, out, reports = run_mpi(
        tmp_path, "two_nodes", [(NRANKS, [])],
        options=["--mca", "plm_rsh_agent", rsh,
                 "--host", f"{here}:2,node-b:2",
                 "-x", "USMIPC_TEST_OTHER_NODE=2,3"],
        # Open MPI 5's launcher (PRRTE) names its agent plm_ssh_agent.
        env={"PRTE_MCA_plm_ssh_agent": rsh})
    if not os.path.exists(rsh + ".used") and os.environ.get("CI") != "true":
        # Seen on the GPU machine's mpirun: every rank started here, so the
        # job has one node and the test has nothing to check.
        pytest.skip("this mpirun started no daemon through the rsh agent "
                    "(its launcher took no plm_rsh_agent/plm_ssh_agent): "
                    "there is no second node to tell apart")
    assert code == 0, out
    check_two_nodes(reports, NRANKS, {2, 3}, fake,
                    "is on another node by MPI's COMM_TYPE_SHARED split")
    assert "host 'node-b'" in reports[0]["reasons"]["3"]


def test_mpi_bad_records(tmp_path):
    code, out, reports = run_mpi(tmp_path, "bad_records", [(NRANKS, [])])
    assert code == 0, out
    check_bad_records(reports, NRANKS)


def test_mpi_forged_slot(tmp_path):
    """Issue 21: the same forged bundle bytes over exchange_mpi."""
    code, out, reports = run_mpi(tmp_path, "forged_slot", [(NRANKS, [])])
    assert code == 0, out
    check_forged_slot(reports, NRANKS)
