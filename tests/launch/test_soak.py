"""A soak run: bench/soak_bench.py launched on 2 ranks, its memory growth bounded."""

import json
import sys
from pathlib import Path

from mpirun import run_mpi

BENCH = Path(__file__).resolve().parents[2] / "bench" / "soak_bench.py"


def test_soak_without_leaks(tmp_path):
    """bench/soak_bench.py at half scale: 2500 partitions and layers made and dropped (MPICH
    has about 2048 communicators: a leak fails here), 50k small, 5k out-of-place and 5k
    non-blocking calls, 500 GradientSync steps, with bounded memory growth."""
    result = tmp_path / "soak.json"
    rc, out = run_mpi(2, sys.executable, str(BENCH), "--scale", "0.5", "--json", str(result))
    assert rc == 0, out
    growth = {k: v["rss_growth_kib"] for k, v in json.loads(result.read_text()).items()}
    assert growth["partitions"] < 4096 and all(g < 16384 for g in growth.values()), growth
