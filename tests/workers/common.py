"""Helpers shared by the worker scripts that run under mpiexec."""

from __future__ import annotations

import sys
import traceback

from mpi4py import MPI

WORLD = MPI.COMM_WORLD


class Failures:
    """Collects failed checks on this rank; `finish()` reports them and sets the exit status."""

    def __init__(self) -> None:
        self.items: list[str] = []
        self.checks = 0

    def check(self, ok: bool, what: str) -> None:
        self.checks += 1
        if not ok:
            self.items.append(what)

    def run(self, name: str, fn, *args) -> None:
        self.checks += 1
        try:
            fn(*args)
        except Exception:
            self.items.append(f"{name}:\n{traceback.format_exc()}")

    def finish(self) -> None:
        total = WORLD.allreduce(len(self.items))
        checks = WORLD.allreduce(self.checks)
        for item in self.items[:20]:
            print(f"[rank {WORLD.rank}] FAILED {item}", flush=True)
        WORLD.Barrier()
        if WORLD.rank == 0:
            print(f"{checks} checks on {WORLD.size} ranks, {total} failed", flush=True)
        if checks == 0:
            sys.exit(3)
        sys.exit(1 if total else 0)
