"""Compare two builds of fastreduce on the hot path, in alternating MPI jobs.

    python bench/compare_builds.py OLD_DIR NEW_DIR [-n 2] [--rounds 6] [--sizes 4,1K,1M]

OLD_DIR and NEW_DIR are folders holding an installed `fastreduce` package (e.g. made
with `pip install --no-deps --no-build-isolation --target DIR SRC`); "-" means the one
installed in this environment. Each round runs bench/allreduce_bench.py once per build,
in turn (old, new, then new, old in the next round), so drift of a noisy machine falls
on both. Within each job fastreduce is timed against the C floor (MPI_Allreduce in a C
loop), and what fastreduce adds over it in that job (fr - C, in us) is compared: the
C floor itself moves between jobs on a shared machine (which cores the ranks land on),
the overhead over it much less. Medians over the rounds; at 1 MiB the ratio fr/C.
"""

from __future__ import annotations

import argparse
import ast
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
COLUMNS = ("C floor", "fr_ torch", "fr torch")


def one_job(build: str, ranks: int, size: str, iters: int, repeat: int,
            script: str) -> dict[str, float]:
    """Median latency in us of each column for one size, in one MPI job of one build."""
    env = dict(os.environ)
    if build != "-":
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [build, env.get("PYTHONPATH")]))
    cmd = ["mpiexec", "-n", str(ranks), sys.executable, script,
           "-b", size, "-e", size, "--repeat", str(repeat), "--iters-small", str(iters),
           "--iters-large", str(max(iters // 20, 200)), "--only", ",".join(COLUMNS)]
    if "OMPI_ALLOW_RUN_AS_ROOT" in env:
        cmd.insert(1, "--oversubscribe")
    out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
    line = next(x for x in out.splitlines() if x.startswith(size_label(size)))
    return ast.literal_eval(line[line.index("{"):line.index("}") + 1])


def size_label(size: str) -> str:
    """The label allreduce_bench.py prints for a size given as 4, 1K or 1M."""
    units = {"K": "KiB", "M": "MiB"}
    return f"{size[:-1]} {units[size[-1]]}" if size[-1] in units else f"{size} B"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("old")
    parser.add_argument("new")
    parser.add_argument("-n", "--ranks", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--sizes", default="4,1K,1M")
    parser.add_argument("--iters", type=int, default=20000, help="iterations per small-size run")
    parser.add_argument("--repeat", type=int, default=5, help="runs per job (median taken)")
    parser.add_argument("--script", default=str(HERE / "allreduce_bench.py"),
                        help="the benchmark both builds run (a copy that imports what an old "
                             "build has, where this one needs newer names)")
    args = parser.parse_args()
    builds = {"old": args.old, "new": args.new}
    ratios = {(s, b, c): [] for s in args.sizes.split(",") for b in builds for c in COLUMNS[1:]}
    extra = {(s, b, c): [] for s in args.sizes.split(",") for b in builds for c in COLUMNS[1:]}
    for r in range(args.rounds):
        order = list(builds) if r % 2 == 0 else list(reversed(builds))
        for size in args.sizes.split(","):
            for label in order:
                us = one_job(builds[label], args.ranks, size, args.iters, args.repeat,
                             args.script)
                for col in COLUMNS[1:]:
                    ratios[size, label, col].append(us[col] / us["C floor"])
                    extra[size, label, col].append(us[col] - us["C floor"])
                print(f"round {r + 1} {size:>3} {label}: " +
                      ", ".join(f"{k} {v:.2f} us" for k, v in us.items()), flush=True)
    print(f"\nmedians over {args.rounds} rounds, {args.ranks} ranks: fastreduce - C floor in "
          f"the same job (us), and fastreduce / C floor")
    print(f"{'size':>5} {'column':>10} {'old us':>7} {'new us':>7} {'diff us':>8} "
          f"{'old x':>6} {'new x':>6} {'new/old':>8}")
    for size in args.sizes.split(","):
        for col in COLUMNS[1:]:
            old, new = (statistics.median(extra[size, b, col]) for b in ("old", "new"))
            rold, rnew = (statistics.median(ratios[size, b, col]) for b in ("old", "new"))
            print(f"{size:>5} {col:>10} {old:7.3f} {new:7.3f} {new - old:+8.3f} "
                  f"{rold:6.3f} {rnew:6.3f} {rnew / rold:8.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
