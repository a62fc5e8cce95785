"""fastreduce-bench and fastreduce-info as users run them: under mpiexec, no helper runner."""

import csv
import json
import os
import pty
import re
import subprocess
import sys
from pathlib import Path

import pytest
from mpirun import launcher_env, mpiexec, run_mpi

pytestmark = pytest.mark.one_mpi  # its subject does not depend on the MPI family

BENCH = (sys.executable, "-m", "fastreduce.bench")
COLUMNS = ["size(B)", "count", "type", "redop", "avg(us)", "min(us)", "max(us)", "algbw(GB/s)",
           "busbw(GB/s)", "#wrong"]


def table_rows(output: str) -> list[list[str]]:
    return [line.split() for line in output.splitlines() if re.match(r"^ +\d+ +\d+ ", line)]


@pytest.mark.parametrize("nprocs", [1, 2, 3])
def test_columns_outputs_and_plot(nprocs, tmp_path):
    js, cs, png = tmp_path / "r.json", tmp_path / "r.csv", tmp_path / "r.png"
    rc, out = run_mpi(nprocs, *BENCH, "-b", "4", "-e", "64K", "-f", "4", "-n", "20",
                      "--json", str(js), "--csv", str(cs), "--plot", str(png),
                      "--peers", "mpi4py")
    assert rc == 0, out
    header = next(line for line in out.splitlines() if line.startswith("#") and "redop" in line)
    assert header.lstrip("#").split()[:10] == COLUMNS
    assert "MPI:" in out and "CUDA-aware:" in out
    host = re.search(rf"^# {nprocs} ranks? on 1 node \((\S+)\); communicator: all ranks$", out,
                     re.M).group(1)
    assert "WARNING" not in out and "# nodes:" not in out, out
    rows = table_rows(out)
    assert [int(r[0]) for r in rows] == [4, 16, 64, 256, 1024, 4096, 16384, 65536]
    assert all(r[9] == "0" for r in rows)
    assert re.search(r"# Avg bus bandwidth +: [0-9.]+ GB/s", out)
    data = json.loads(js.read_text())
    assert len(data["rows"]) == 8 and data["meta"]["ranks"] == nprocs
    assert {k: data["meta"][k] for k in ("nodes", "ranks_per_node", "node_names", "node_ranks",
                                          "topology_problems")} == {
        "nodes": 1, "ranks_per_node": [nprocs], "node_names": [host],
        "node_ranks": [list(range(nprocs))], "topology_problems": []}
    assert data["meta"]["mpi"] in out
    assert all(r["peers"]["mpi4py"] > 0 for r in data["rows"])
    with cs.open() as f:
        lines = list(csv.reader(f))
    assert lines[0][:10] == ["size_bytes", "count", "dtype", "op", "avg_us", "min_us",
                             "max_us", "algbw_GBps", "busbw_GBps", "wrong"]
    assert len(lines) == 9
    assert lines[0][-5:] == ["ranks", "nodes", "ranks_per_node", "node_names", "mpi"]
    assert all(line[-5:] == [str(nprocs), "1", str(nprocs), host, data["meta"]["mpi"]]
               for line in lines[1:])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    # piped: no status line anywhere, nor in the files
    assert "\x1b" not in out and not re.search(r"# \[\d+/\d+\]", out), out
    assert "\x1b" not in js.read_text() + cs.read_text()


@pytest.mark.parametrize("nprocs, options", [
    (2, ["-d", "bfloat16", "-o", "max"]),
    (2, ["-d", "int32", "-o", "bxor", "--buffers", "numpy"]),
    (3, ["-d", "float64", "-o", "avg", "--out-of-place", "--nonblocking"]),
    (4, ["-d", "bool", "-o", "bor", "--partition", "2x2", "--axes", "1"]),
    (4, ["-d", "float16", "--partition", "4", "--peers", "torch"]),
    (2, ["-d", "float32", "--peers", "torch,torch-fastreduce"]),
])
def test_modes(nprocs, options):
    rc, out = run_mpi(nprocs, *BENCH, "-b", "2", "-e", "4K", "-f", "8", "-n", "10", *options)
    assert rc == 0, out
    rows = table_rows(out)
    assert rows and all(r[9] == "0" for r in rows), out


def test_wrong_results_are_counted_and_fail_the_run():
    rc, out = run_mpi(2, *BENCH, "-b", "4", "-e", "1K", "-n", "5", "--inject-wrong")
    assert rc == 1, out
    assert all(int(r[9]) > 0 for r in table_rows(out))
    assert "WRONG" in out


def _torch_has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.mark.parametrize("options, message", [
    (["--frobnicate"], "unrecognized arguments: --frobnicate"),
    (["-b", "1M", "-e", "4K"], "size range is reversed"),
    (["-b", "zz"], "size 'zz'"),
    (["-d", "int32", "-o", "avg"], "op 'avg' is not defined for dtype int32"),
    (["-d", "complex64", "-o", "max"], "op 'max' is not defined for dtype complex64"),
    (["--partition", "3x3"], "has 9 workers but 4 ranks"),
    (["--partition", "2x2", "--axes", "2"], "--axes 2"),
    (["--axes", "1"], "--axes needs --partition"),
    (["--device", "cuda", "--buffers", "numpy"], "--device cuda needs --buffers torch"),
    (["--gpu-paths", "direct"], "--gpu-paths needs --device cuda"),
    (["--gpu-paths", "auto,fast"], "--gpu-paths 'auto,fast': distinct modes"),
    (["-e", "1.5.2M"], "size '1.5.2M'"),
    (["--plot", "/nonexistent/r.png"], "--plot /nonexistent/r.png: the folder /nonexistent does"),
    (["--progress", "--no-progress"], "not allowed with argument"),
    (["-c", "allgatherx"], "argument -c/--collective: invalid choice: 'allgatherx'"),
    (["-c", "allgather", "-o", "max"], "-c allgather does not reduce"),
    (["-c", "gather", "--out-of-place"], "--out-of-place is for -c allreduce only"),
    pytest.param(["--device", "cuda"], "torch.cuda.is_available() is False",
                 marks=pytest.mark.skipif(_torch_has_cuda(), reason="this machine has a GPU")),
    pytest.param(["-c", "scatter", "--device", "cuda"], "torch.cuda.is_available() is False",
                 marks=pytest.mark.skipif(_torch_has_cuda(), reason="this machine has a GPU")),
])
def test_usage_errors_exit_every_rank(options, message):
    rc, out = run_mpi(4, *BENCH, *options, timeout=120)
    assert rc == 2, out
    assert out.count("fastreduce-bench: error:") == 1, out  # rank 0 alone reports it
    assert message in out, out


@pytest.mark.parametrize("nprocs", [1, 2, 3])
def test_info_prints_every_field(nprocs):
    rc, out = run_mpi(nprocs, sys.executable, "-m", "fastreduce.info")
    assert rc == 0, out
    for field in ("fastreduce", "mpi4py", "torch", "built against", "running on",
                  "linked libmpi", "MPI standard", "thread level", "large counts", "segments",
                  "16-bit floats", "CUDA-aware", "CUDA runtime", "GPU path", "device pointers",
                  "GPU size table", "progress engine", "torch buffers", "torch.distributed",
                  "size", "ranks"):
        assert re.search(rf"^ *{re.escape(field)} : \S", out, re.M), (field, out)
    assert len(re.findall(r"\d+@\S+ \(local \d+/\d+\)", out)) == nprocs, out
    assert f"local {nprocs - 1}/{nprocs}" in out
    # one host: one shared-memory node holding every rank, named like the ranks' host
    host = re.search(rf"^ *nodes : {nprocs} ranks? on 1 node \((\S+)\)$", out, re.M).group(1)
    ranks = "0" if nprocs == 1 else f"0-{nprocs - 1}"
    assert re.search(rf"^ *node ranks : {re.escape(host)}: {ranks}$", out, re.M), out
    assert out.count(f"@{host} (local ") == nprocs and "topology :" not in out, out


def test_tools_flag_processor_names_that_split_a_node(tmp_path):
    """Ranks of one shared-memory group reporting two processor names: both tools still
    count one node, and say the two disagree (the JSON records it too)."""
    js = tmp_path / "r.json"
    code = ("import sys\n"
            "from mpi4py import MPI\n"
            "MPI.Get_processor_name = lambda: f'n{MPI.COMM_WORLD.Get_rank()}'\n"
            "from fastreduce import bench, info\n"
            f"sys.exit(info.main([]) or bench.main(['-e', '4', '-n', '2', '--json', {str(js)!r}"
            "]))\n")
    rc, out = run_mpi(2, sys.executable, "-c", code)
    assert rc == 0, out
    problem = ("ranks 0-1 share memory (one MPI_COMM_TYPE_SHARED group) but have processor "
               "names n0, n1")
    assert re.search(r"^ *nodes : 2 ranks on 1 node \(n0\)$", out, re.M), out
    assert re.search(rf"^ *topology : WARNING: .*disagree: {re.escape(problem)}$", out, re.M)
    assert "# 2 ranks on 1 node (n0); communicator: all ranks" in out, out
    assert f"# WARNING: processor names and shared-memory groups disagree: {problem}" in out
    assert json.loads(js.read_text())["meta"]["topology_problems"] == [problem]


@pytest.mark.parametrize("per_rank, summary, listing, problems", [
    ([("h", 0)], "1 rank on 1 node (h)", "h: 0", []),
    ([("n0", 0), ("n0", 0), ("n1", 2), ("n1", 2)],
     "4 ranks on 2 nodes (n0, n1), 2 ranks per node", "n0: 0-1; n1: 2-3", []),
    ([("n0", "a"), ("n1", "b"), ("n0", "a")],
     "3 ranks on 2 nodes: n0 2, n1 1", "n0: 0, 2; n1: 1", []),
    # two shared-memory groups under one processor name (e.g. one host, split namespaces)
    ([("h", 0), ("h", 0), ("h", 2), ("h", 2)],
     "4 ranks on 2 nodes (h, h), 2 ranks per node", "h: 0-1; h: 2-3",
     ["processor name h covers 2 MPI_COMM_TYPE_SHARED groups: [0-1], [2-3]"]),
    # one group whose ranks report different processor names
    ([("n0", 0), ("n1", 0), ("n1", 0)], "3 ranks on 1 node (n0)", "n0: 0-2",
     ["ranks 0-2 share memory (one MPI_COMM_TYPE_SHARED group) but have processor names "
      "n0, n1"]),
    # both at once: n1 spans the second group and a group of its own
    ([("n0", 0), ("n1", 1), ("n2", 1), ("n1", 3)],
     "4 ranks on 3 nodes: n0 1, n1 2, n1 1", "n0: 0; n1: 1-2; n1: 3",
     ["ranks 1-2 share memory (one MPI_COMM_TYPE_SHARED group) but have processor names "
      "n1, n2", "processor name n1 covers 2 MPI_COMM_TYPE_SHARED groups: [1-2], [3]"]),
    ([(f"n{r // 2}", r // 2) for r in range(20)],
     "20 ranks on 10 nodes (n0, n1, n2, n3, n4, n5, n6, n7, ... (2 more)), 2 ranks per node",
     "; ".join(f"n{i}: {2 * i}-{2 * i + 1}" for i in range(10)), []),
])
def test_topology_summary(per_rank, summary, listing, problems):
    """The nodes from each rank's (processor name, shared-memory group), and the
    disagreements between the two."""
    from fastreduce import topology

    nodes = topology.summarise(per_rank)
    assert (nodes.summary(), nodes.listing(), list(nodes.problems)) == (summary, listing,
                                                                        problems)
    record = nodes.as_dict()
    assert record["nodes"] == len(record["node_names"]) == len(record["node_ranks"])
    assert sum(record["ranks_per_node"]) == len(per_rank)
    assert sorted(r for ranks in record["node_ranks"] for r in ranks) == list(range(len(per_rank)))


def test_collective_sizes_follow_nccl_tests():
    """-c's rows: nccl-tests' size (the larger of a rank's buffers) and count (a part, in
    whole 16-byte units, at least one), and its busbw factors."""
    from fastreduce.tools.benchmark import collectives as c

    kib = [1 << 10, 1 << 20]
    assert c.rows_for("allreduce", [4, 1 << 20], 4, 3) == [(4, 1), (1 << 20, 1 << 18)]
    assert c.rows_for("allgather", kib, 4, 2) == [(1024, 128), (1 << 20, 1 << 17)]
    # 3 ranks: 1 KiB / 3 = 85 floats, down to 84 (whole 16-byte units); 4 B: one unit each
    assert c.rows_for("reduce_scatter", [4, 16, 1024], 4, 3) == [(48, 4), (1008, 84)]
    assert c.rows_for("alltoall", [1 << 20], 1, 8) == [(1 << 20, 1 << 17)]
    assert c.rows_for("gather", [100], 8, 3) == [(96, 4)]  # float64: 2 per unit
    assert c.rows_for("scatter", [4], 16, 2) == [(32, 1)]  # complex128: 1 per unit
    assert c.rows_for("broadcast", [6], 2, 4) == [(6, 3)]
    factors = {name: c.bus_factor(name, 4) for name in c.NAMES}
    assert factors == {"allreduce": 1.5, "allgather": 0.75, "reduce_scatter": 0.75,
                       "broadcast": 1.0, "alltoall": 0.75, "reduce": 1.0, "gather": 0.75,
                       "scatter": 0.75}


def test_staged_by_hand_copies_only_what_a_rank_sends_and_receives():
    """The by-hand GPU column (--device cuda's mpi4py): the root of a broadcast or scatter
    alone copies x out; a receiving rank alone copies back, into x or out."""
    from fastreduce.tools.benchmark.collectives import ROOT, by_hand_sides

    other = ROOT + 1
    want = {  # name: (root's, another rank's)
        "allreduce": ((True, "x"), (True, "x")),
        "broadcast": ((True, None), (False, "x")),
        "reduce": ((True, "x"), (True, None)),
        "allgather": ((True, "out"), (True, "out")),
        "reduce_scatter": ((True, "out"), (True, "out")),
        "alltoall": ((True, "out"), (True, "out")),
        "gather": ((True, "out"), (True, None)),
        "scatter": ((True, "out"), (False, "out")),
    }
    assert {n: (by_hand_sides(n, ROOT), by_hand_sides(n, other)) for n in want} == want


def test_gpu_movement_bench_host_check():
    """bench/gpu_movement_bench.py --host-check (no GPU): every collective timed in its three
    columns and checked, the table printed."""
    script = str(Path(__file__).resolve().parents[2] / "bench" / "gpu_movement_bench.py")
    rc, out = run_mpi(3, sys.executable, script, "--host-check", "--sizes", "4K",
                      "--repeat", "1", timeout=120)
    assert rc == 0, out
    rows = re.findall(r"^\| (\w+) \| [\d.]+ KiB \|.* \| (\d+) \|$", out, re.M)
    assert [name for name, _ in rows] == ["allreduce", "broadcast", "reduce", "allgather",
                                          "reduce_scatter", "alltoall", "gather",
                                          "scatter"], out
    assert all(wrong == "0" for _, wrong in rows), out


@pytest.mark.parametrize("nprocs", [1, 2])
def test_info_calibrate_over_fake_cuda(fake_cuda, monkeypatch, nprocs):
    """--calibrate times both paths and prints a size table that FASTREDUCE_GPU_THRESHOLDS
    takes back; where the MPI takes no device pointers it says so and prints "staged"."""
    monkeypatch.setenv("FASTREDUCE_DEVICE_POINTERS", "blocking")
    rc, out = run_mpi(nprocs, sys.executable, "-m", "fastreduce.info", "--calibrate")
    assert rc == 0, out
    assert f"GPU path calibration on {nprocs} ranks" in out, out
    rows = [line.split() for line in out.splitlines() if re.match(r"^ +\d+ +[\d.]+ +[\d.]+ ", line)]
    assert [int(r[0]) for r in rows] == [8, 256, 4096, 32768, 262144, 1 << 20, 4 << 20, 16 << 20]
    assert all(r[3] in ("direct", "staged") and float(r[1]) > 0 < float(r[2]) for r in rows)
    spec = re.search(r"^FASTREDUCE_GPU_THRESHOLDS=(\S+)$", out, re.M).group(1)
    monkeypatch.setenv("FASTREDUCE_GPU_THRESHOLDS", spec)  # the printed line is accepted
    rc, again = run_mpi(1, sys.executable, "-m", "fastreduce.info")
    assert rc == 0 and "pinned by FASTREDUCE_GPU_THRESHOLDS" in again, again
    monkeypatch.delenv("FASTREDUCE_GPU_THRESHOLDS")
    monkeypatch.setenv("FASTREDUCE_DEVICE_POINTERS", "none")
    rc, out = run_mpi(nprocs, sys.executable, "-m", "fastreduce.info", "--calibrate")
    assert rc == 0 and "not calibrated" in out and "FASTREDUCE_GPU_THRESHOLDS=staged" in out, out


def test_info_calibrate_without_cuda(monkeypatch):
    monkeypatch.setenv("FASTREDUCE_CUDART", "/nonexistent/libcudart.so")
    rc, out = run_mpi(2, sys.executable, "-m", "fastreduce.info", "--calibrate")
    assert rc != 0 and out.count("fastreduce-info: cannot calibrate:") == 1, out
    assert "FASTREDUCE_CUDART" in out, out
    rc, out = run_mpi(1, sys.executable, "-m", "fastreduce.info", "--frobnicate")
    assert rc == 2 and "usage: fastreduce-info [--calibrate]" in out, out


def test_bench_unsegmented_column(monkeypatch):
    """--peers unsegmented times fastreduce with one MPI call per all-reduce beside the
    segmented calls (1 KiB segments here), both correct."""
    monkeypatch.setenv("FASTREDUCE_SEGMENT_BYTES", "1K")
    rc, out = run_mpi(3, *BENCH, "-b", "256", "-e", "16K", "-f", "4", "-n", "10",
                      "--peers", "unsegmented")
    assert rc == 0, out
    header = next(line for line in out.splitlines() if line.startswith("#") and "redop" in line)
    assert header.split()[-1] == "unsegmented(us)", header
    rows = table_rows(out)
    assert len(rows) == 4 and all(r[9] == "0" and float(r[10]) > 0 for r in rows), out


def test_segment_setting(monkeypatch):
    monkeypatch.setenv("FASTREDUCE_SEGMENT_BYTES", "2MiB")
    rc, out = run_mpi(1, sys.executable, "-m", "fastreduce.info")
    assert rc == 0 and re.search(r"segments : .* above 2MiB go one 2MiB segment", out), out
    monkeypatch.setenv("FASTREDUCE_SEGMENT_BYTES", "0")
    rc, out = run_mpi(1, sys.executable, "-m", "fastreduce.info")
    assert rc == 0 and "segments : off" in out, out
    monkeypatch.setenv("FASTREDUCE_SEGMENT_BYTES", "lots")
    rc, out = run_mpi(1, sys.executable, "-c", "import fastreduce")
    assert rc != 0 and "FASTREDUCE_SEGMENT_BYTES='lots'" in out, out


def test_train_step_bench_cpu_sized():
    """bench/train_step_bench.py in CI size: every variant timed, the ratios and the schedules
    printed."""
    script = str(Path(__file__).resolve().parents[2] / "bench" / "train_step_bench.py")
    rc, out = run_mpi(2, sys.executable, script, "--width", "64", "--depth", "2", "--batch",
                      "8", "--steps", "2", "--repeat", "1", timeout=300)
    assert rc == 0, out
    for name in ("no communication", "backward, allreduce", "GradientSync", "hvd",
                 "DDP fastreduce", "DDP gloo", "allreduce alone"):
        assert re.search(rf"^  {name} +[0-9.]+ ms$", out, re.M), (name, out)
    for ratio in ("GradientSync / (backward, allreduce)", "hvd / GradientSync",
                  "DDP fastreduce / GradientSync", "GradientSync / DDP gloo"):
        assert re.search(rf"{re.escape(ratio)}: [0-9.]+", out), (ratio, out)
    for who in ("GradientSync", "hvd", "DDP fastreduce"):
        assert re.search(rf"{who} schedule: (overlap|serial|not used)", out), (who, out)


def test_engine_settings(monkeypatch):
    rc, out = run_mpi(1, sys.executable, "-m", "fastreduce.info")
    assert rc == 0 and re.search(r"progress engine : on .*host requests of 64KiB and more", out)
    monkeypatch.setenv("FASTREDUCE_ENGINE_HOST_BYTES", "off")
    rc, out = run_mpi(1, sys.executable, "-m", "fastreduce.info")
    assert rc == 0 and "no host requests" in out, out
    monkeypatch.setenv("FASTREDUCE_ENGINE_HOST_BYTES", "some")
    rc, out = run_mpi(1, sys.executable, "-m", "fastreduce.info")
    assert "FASTREDUCE_ENGINE_HOST_BYTES='some'" in out, out
    monkeypatch.delenv("FASTREDUCE_ENGINE_HOST_BYTES")
    monkeypatch.setenv("FASTREDUCE_ENGINE", "0")
    rc, out = run_mpi(1, sys.executable, "-m", "fastreduce.info")
    assert rc == 0 and "progress engine : off (FASTREDUCE_ENGINE=0)" in out, out
    monkeypatch.setenv("FASTREDUCE_ENGINE", "maybe")
    rc, out = run_mpi(1, sys.executable, "-m", "fastreduce.info")
    assert "FASTREDUCE_ENGINE='maybe': use 0 or 1" in out, out


def test_engine_off_below_thread_multiple():
    """An MPI initialised below MPI_THREAD_MULTIPLE: the engine stays off and says why;
    non-blocking calls still work."""
    code = ("import mpi4py; mpi4py.rc.thread_level = 'serialized'\n"
            "import numpy as np, fastreduce\n"
            "from mpi4py import MPI\n"
            "from fastreduce.backend import engine as _engine\n"
            "x = np.ones(1 << 20, np.float32)\n"
            "r = fastreduce.iallreduce_(x)\n"
            "seen = (_engine.state(), r.engine, bool((r.wait() == 2).all()))\n"
            "everyone = MPI.COMM_WORLD.gather(seen)\n"
            "if MPI.COMM_WORLD.rank == 0: print(everyone, flush=True)\n")
    rc, out = run_mpi(2, sys.executable, "-c", code)
    assert rc == 0, out
    off = ("(False, \"off: the MPI gives less than MPI_THREAD_MULTIPLE; non-blocking calls use "
           "MPI's non-blocking collectives\"), False, True)")
    assert out.count(off) == 2, out


# ---------------------------------------------------------------------------------------
# rank 0's status line: on a terminal only

STATUS = re.compile(r"# \[(\d+)/(\d+)\] \S+ \S+: [\w() -]+, \d+ s")
local_launcher = pytest.mark.skipif(
    bool(os.environ.get("FASTREDUCE_MPIEXEC")),
    reason="the status line follows a local mpiexec's terminal; srun tasks cannot see it")


def run_on_terminal(nprocs: int, *command: str, stdout_file: Path | None = None,
                    timeout: float = 300) -> tuple[int, str]:
    """Run under mpiexec with its stderr (and stdout, unless stdout_file) on a
    pseudo-terminal: (exit status, what the terminal received)."""
    import select
    import time

    master, slave = pty.openpty()
    out = open(stdout_file, "w") if stdout_file else slave  # noqa: SIM115
    proc = subprocess.Popen([*mpiexec(), "-n", str(nprocs), *command], stdin=subprocess.DEVNULL,
                            stdout=out, stderr=slave, env=launcher_env(),
                            start_new_session=True)
    os.close(slave)
    if stdout_file:
        out.close()
    received, deadline = b"", time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if select.select([master], [], [], 1)[0]:
                try:
                    chunk = os.read(master, 1 << 16)
                except OSError:  # EIO: every writer has closed the terminal
                    break
                if not chunk:
                    break
                received += chunk
            elif proc.poll() is not None:
                break
        else:
            proc.kill()
            raise AssertionError(f"hung; the terminal received:\n{received.decode()}")
    finally:
        os.close(master)
    return proc.wait(), received.decode()


def screen(received: str) -> list[str]:
    """The lines a terminal shows after `received` (cursor up, carriage return, erase line)."""
    lines, row = [""], 0
    for token in re.findall(r"\x1b\[A|\x1b\[K|\r|\n|[^\x1b\r\n]+", received):
        if token == "\x1b[A":
            row = max(row - 1, 0)
        elif token == "\x1b[K":
            lines[row] = ""  # always at the line's start here
        elif token == "\n":
            row += 1
            if row == len(lines):
                lines.append("")
        elif token != "\r":
            lines[row] += token
    return [line for line in lines if line]


@local_launcher
def test_progress_on_a_terminal_replaced_by_the_table(tmp_path):
    js, cs = tmp_path / "r.json", tmp_path / "r.csv"
    rc, received = run_on_terminal(2, *BENCH, "-b", "1K", "-e", "16K", "-f", "4", "-n", "5",
                                   "--peers", "mpi4py", "--json", str(js), "--csv", str(cs))
    assert rc == 0, received
    status = STATUS.findall(received)
    # per size and column, on rank 0 alone: fastreduce, the check, mpi4py for each of 3 sizes
    assert status.count(("1", "3")) == 3 and status.count(("3", "3")) == 3, received
    assert "# [2/3] 4 KiB: mpi4py" in received, received
    shown = screen(received)
    assert not any(STATUS.search(line) for line in shown), shown  # every status line erased
    assert [int(r[0]) for r in table_rows("\n".join(shown))] == [1024, 4096, 16384], shown
    assert shown[-1].startswith("# Avg bus bandwidth"), shown
    for path in (js, cs):
        assert "\x1b" not in path.read_text() and not STATUS.search(path.read_text())


@local_launcher
def test_progress_on_stderr_when_the_table_goes_to_a_file(tmp_path):
    table = tmp_path / "table.txt"
    rc, received = run_on_terminal(2, *BENCH, "-b", "1K", "-e", "4K", "-f", "4", "-n", "5",
                                   stdout_file=table)
    assert rc == 0, received
    assert STATUS.search(received) and screen(received) == [], received
    text = table.read_text()
    assert "\x1b" not in text and not STATUS.search(text) and len(table_rows(text)) == 2, text


@local_launcher
def test_no_progress_on_a_terminal():
    rc, received = run_on_terminal(2, *BENCH, "-b", "1K", "-e", "4K", "-n", "5",
                                   "--no-progress")
    assert rc == 0 and "\x1b" not in received and not STATUS.search(received), received


def test_progress_forced_through_a_pipe():
    """--progress: for launchers (srun) whose tasks cannot see the terminal."""
    proc = subprocess.run([*mpiexec(), "-n", "2", *BENCH, "-b", "1K", "-e", "4K", "-f", "4",
                           "-n", "5", "--progress"], stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, env=launcher_env(), timeout=300)
    rc, out = proc.returncode, proc.stdout.decode()  # bytes: text mode would turn \r to \n
    assert rc == 0, out
    assert [m for m in STATUS.findall(out)] == [("1", "2"), ("1", "2"), ("2", "2"), ("2", "2")]
    assert not any(STATUS.search(line) for line in screen(out)), out


# ---------------------------------------------------------------------------------------
# --plot, drawn from rows like a run's

def _rows(sizes, peers=(), modes=()):
    rows = []
    for n in sizes:
        us = 2 + n / 2e3
        rows.append({"bytes": n, "count": n // 4, "avg_us": us, "min_us": us, "max_us": us,
                     "algbw": n / us / 1e3, "busbw": n / us / 1e3, "wrong": 0,
                     "peers": {p: us * (1.5 + i) for i, p in enumerate(peers)},
                     "modes": {m: {"avg_us": us * 1.2, "path": "staged"} for m in modes}})
    return rows


def _meta(ranks=4, **extra):
    return {"fastreduce": "0", "mpi": "Open MPI v5.0.11, package: Open MPI user@localhost",
            "ranks": ranks, "nodes": 1, "communicator": "all ranks", "device": "cpu",
            "buffers": "torch", "dtype": "float32", "op": "sum", "mode": "in place, blocking",
            "cuda_aware": "no", "torch": "2.13.0", **extra}


def test_plot_draws_every_column_on_log_axes_with_units(tmp_path):
    pytest.importorskip("matplotlib")
    from fastreduce import bench

    sizes = [4 << (2 * i) for i in range(13)]  # 4 B .. 64 MiB
    peers = ["mpi4py", "torch", "unsegmented"]
    png = tmp_path / "p.png"
    fig = bench.plot(str(png), _meta(communicator="partition [2, 2], axes (1,)"),
                     _rows(sizes, peers), peers, group_size=2)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    lat, alg, bus = fig.axes
    want = ["fastreduce", "mpi4py", "torch (all 4 ranks)", "unsegmented"]
    for ax, unit in ((lat, "\u00b5s"), (alg, "GB/s"), (bus, "GB/s")):
        assert ax.get_xscale() == "log" and ax.get_yscale() == "log"
        assert unit in ax.get_ylabel() and ax.get_xlabel() == "message size"
        assert [line.get_label() for line in ax.get_lines()] == want
        assert all(list(line.get_xdata()) == sizes for line in ax.get_lines())
        labels = [t.get_text() for t in ax.get_xticklabels() if t.get_text()]
        assert labels[0] == "4 B" and labels[-1] == "64 MiB" and 4 <= len(labels) <= 6, labels
    # the legend is the figure's, below the panels, not inside one
    assert not any(ax.get_legend() for ax in fig.axes)
    legend = fig.legends[0]
    assert [t.get_text() for t in legend.get_texts()] == want
    # busbw: algbw * 2(p-1)/p of the group (p=2: equal), of the world for torch (p=4)
    fr, _, torch_line, _ = bus.get_lines()
    assert list(fr.get_ydata()) == list(alg.get_lines()[0].get_ydata())
    assert torch_line.get_ydata()[-1] == pytest.approx(alg.get_lines()[2].get_ydata()[-1] * 1.5)
    # nothing overlaps: tick labels of neighbouring panels, the legend and the axes
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)  # plot() closed the figure: draw it as it was saved
    canvas.draw()
    renderer = canvas.get_renderer()
    boxes = [ax.get_tightbbox(renderer) for ax in fig.axes]
    for left, right in zip(boxes, boxes[1:], strict=False):
        assert left.x1 < right.x0
    assert legend.get_window_extent(renderer).y1 < min(b.y0 for b in boxes)
    for ax in fig.axes:
        ticks = [t.get_window_extent(renderer) for t in ax.get_xticklabels() if t.get_text()]
        assert all(a.x1 + 10 < b.x0 for a, b in zip(ticks, ticks[1:], strict=False))


def test_plot_gpu_modes_and_one_rank(tmp_path):
    pytest.importorskip("matplotlib")
    from fastreduce import bench

    sizes = [1 << 20, 4 << 20]
    fig = bench.plot(str(tmp_path / "g.png"),
                     _meta(ranks=1, gpu_modes=["auto", "direct", "staged"]),
                     _rows(sizes, modes=["direct", "staged"]), [], group_size=1)
    lat, alg, bus = fig.axes
    assert [line.get_label() for line in lat.get_lines()] == [
        "fastreduce (auto)", "fastreduce (direct)", "fastreduce (staged)"]
    assert [t.get_text() for t in bus.texts] == ["busbw is 0 with 1 rank"]
    assert lat.get_yscale() == "log" and alg.get_yscale() == "log"
