"""The files rank 0 writes: --json, --csv and --plot, and checking beforehand that it can."""

from __future__ import annotations

import csv
import json
import os

from .plots import plot

# the run's columns, the same on every row: ranks per node and node names ";"-separated
RUN_COLUMNS = ["ranks", "nodes", "ranks_per_node", "node_names", "mpi"]


def _unwritable(args) -> str | None:
    """Why an output file could not be written at the end of the run, or None."""
    for option in ("json", "csv", "plot"):
        path = getattr(args, option)
        if not path:
            continue
        folder = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(folder):
            return f"--{option} {path}: the folder {folder} does not exist"
        if not os.access(folder, os.W_OK):
            return f"--{option} {path}: the folder {folder} is not writable"
    return None


def _write_outputs(args, meta: dict, rows: list[dict], peers, group_size: int) -> None:
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["size_bytes", "count", "dtype", "op", "avg_us", "min_us", "max_us",
                             "algbw_GBps", "busbw_GBps", "wrong", *[f"{p}_us" for p in peers],
                             *RUN_COLUMNS])
            run = [meta["ranks"], meta["nodes"], ";".join(map(str, meta["ranks_per_node"])),
                   ";".join(meta["node_names"]), meta["mpi"]]
            for r in rows:
                writer.writerow([r["bytes"], r["count"], args.dtype, meta["op"], r["avg_us"],
                                 r["min_us"], r["max_us"], r["algbw"], r["busbw"], r["wrong"],
                                 *[r["peers"][p] for p in peers], *run])
    if args.plot:
        plot(args.plot, meta, rows, peers, group_size)
