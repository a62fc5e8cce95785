"""What the misuse checks cost: debug mode and the flight record against the default path.

    mpiexec -n 2 python bench/checks_bench.py [--repeat 5] [--json FILE]

In one MPI job, alternating, for float32 allreduce_ in place at each size: the default
path; debug mode (set_debug(True): one extra small collective per call, the fingerprint
exchange); and a timeout set (set_timeout: each call recorded in the flight record).
Latency in us (average over ranks, median of runs); ratios to the default within each run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
from mpi4py import MPI

import fastreduce
from fastreduce._abi import first_line

sys.path.insert(0, str(Path(__file__).parent))
import layers_bench  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--sizes", default="4,65536,1048576", help="bytes, comma-separated")
    parser.add_argument("--json")
    args = parser.parse_args()
    comm = fastreduce.default_comm()
    modes = {"default": (False, None), "debug": (True, None), "timeout": (False, 600.0)}
    rows = []
    for nbytes in (int(s) for s in args.sizes.split(",")):
        x = torch.rand(max(1, nbytes // 4))
        iters = 2000 if nbytes <= 65536 else 200
        samples = {k: [] for k in modes}
        for _ in range(args.repeat):
            for name, (debug, timeout) in modes.items():
                fastreduce.set_debug(debug)
                fastreduce.set_timeout(timeout)
                t = layers_bench.timed(comm, lambda x=x: fastreduce.allreduce_(x), iters)
                samples[name].append(comm.allreduce(t) / comm.Get_size())
        fastreduce.set_debug(False)
        fastreduce.set_timeout(None)
        row = {"bytes": nbytes, **{k: statistics.median(v) * 1e6 for k, v in samples.items()}}
        for name in ("debug", "timeout"):
            row[f"{name} / default"] = statistics.median(
                a / b for a, b in zip(samples[name], samples["default"], strict=True))
        rows.append(row)
    if comm.Get_rank() == 0:
        print(f"# fastreduce {fastreduce.__version__} checks benchmark: {comm.Get_size()} ranks, "
              f"{first_line(MPI.Get_library_version())}, median of {args.repeat}")
        print(f"{'bytes':>8} {'default':>9} {'debug':>9} {'timeout':>9} {'debug/def':>10} "
              f"{'timeout/def':>11}")
        for r in rows:
            print(f"{r['bytes']:>8} {r['default']:9.2f} {r['debug']:9.2f} {r['timeout']:9.2f} "
                  f"{r['debug / default']:10.2f} {r['timeout / default']:11.2f}")
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
