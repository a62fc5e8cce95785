"""fastreduce-bench and fastreduce-info as users run them: under mpiexec, no helper runner."""

import csv
import json
import re
import sys
from pathlib import Path

import pytest
from mpirun import run_mpi

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
    assert "MPI:" in out and f"{nprocs} ranks on 1 node(s)" in out and "CUDA-aware:" in out
    rows = table_rows(out)
    assert [int(r[0]) for r in rows] == [4, 16, 64, 256, 1024, 4096, 16384, 65536]
    assert all(r[9] == "0" for r in rows)
    assert re.search(r"# Avg bus bandwidth +: [0-9.]+ GB/s", out)
    data = json.loads(js.read_text())
    assert len(data["rows"]) == 8 and data["meta"]["ranks"] == nprocs
    assert all(r["peers"]["mpi4py"] > 0 for r in data["rows"])
    with cs.open() as f:
        lines = list(csv.reader(f))
    assert lines[0][:10] == ["size_bytes", "count", "dtype", "op", "avg_us", "min_us",
                             "max_us", "algbw_GBps", "busbw_GBps", "wrong"]
    assert len(lines) == 9
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


@pytest.mark.parametrize("options", [
    ["-d", "bfloat16", "-o", "max"],
    ["-d", "int32", "-o", "bxor", "--buffers", "numpy"],
    ["-d", "float64", "-o", "avg", "--out-of-place", "--nonblocking"],
    ["-d", "bool", "-o", "bor", "--partition", "2x2", "--axes", "1"],
    ["-d", "float16", "--partition", "4", "--peers", "torch"],
    ["-d", "float32", "--peers", "torch,torch-fastreduce"],
])
def test_modes(options):
    rc, out = run_mpi(4, *BENCH, "-b", "2", "-e", "4K", "-f", "8", "-n", "10", *options)
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
    pytest.param(["--device", "cuda"], "torch.cuda.is_available() is False",
                 marks=pytest.mark.skipif(_torch_has_cuda(), reason="this machine has a GPU")),
])
def test_usage_errors_exit_every_rank(options, message):
    rc, out = run_mpi(4, *BENCH, *options, timeout=120)
    assert rc == 2, out
    assert out.count("fastreduce-bench: error:") == 1, out  # rank 0 alone reports it
    assert message in out, out


@pytest.mark.parametrize("nprocs", [1, 3])
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
    """bench/train_step_bench.py in CI size: every variant timed, both ratios printed."""
    script = str(Path(__file__).resolve().parents[1] / "bench" / "train_step_bench.py")
    rc, out = run_mpi(2, sys.executable, script, "--width", "64", "--depth", "2", "--batch",
                      "8", "--steps", "2", "--repeat", "1", timeout=300)
    assert rc == 0, out
    for name in ("no communication", "GradientSync", "coalesced", "DDP gloo", "allreduce alone"):
        assert re.search(rf"^  {name} +[0-9.]+ ms$", out, re.M), (name, out)
    assert re.search(r"GradientSync / DDP gloo: [0-9.]+", out), out


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
            "from fastreduce import _engine\n"
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
