"""Helpers shared by the worker scripts that run under mpiexec."""

from __future__ import annotations

import sys
import traceback

import numpy as np
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

    def expect(self, exc_type, words, fn, *unchanged) -> None:
        """fn() must raise exc_type with every word in its message, leaving `unchanged` as is."""
        before = [_snapshot(o) for o in unchanged]
        try:
            fn()
        except exc_type as exc:
            missing = [w for w in words if w not in str(exc)]
            self.check(not missing, f"message {str(exc)!r} lacks {missing}")
        except Exception as exc:  # noqa: BLE001
            self.check(False, f"expected {exc_type.__name__} with {words}, got {exc!r}")
        else:
            self.check(False, f"expected {exc_type.__name__} with {words}, nothing raised")
        after = [_snapshot(o) for o in unchanged]
        self.check(all(np.array_equal(a, b, equal_nan=True)
                       for a, b in zip(before, after, strict=True)),
                   f"a rejected call ({words}) modified its tensors")

    def expect_everywhere(self, fn, words, own_error=None, same_message=False) -> None:
        """Collective: fn() must raise on every rank, CollectiveMismatch naming `words` (or
        own_error on the ranks that made the mistake); with same_message, the same text on
        every rank."""
        from fastreduce import CollectiveMismatch

        try:
            fn()
        except CollectiveMismatch as exc:
            missing = [w for w in words if w not in str(exc)]
            self.check(not missing, f"CollectiveMismatch {exc} lacks {missing}")
            outcome = str(exc) if same_message else "mismatch"
        except Exception as exc:  # noqa: BLE001
            self.check(own_error is not None and isinstance(exc, own_error),
                       f"expected CollectiveMismatch with {words}, got {exc!r}")
            outcome = "own"
        else:
            self.check(False, f"nothing raised (expected CollectiveMismatch with {words})")
            outcome = "none"
        outcomes = WORLD.allgather(outcome)
        self.check("none" not in outcomes, f"some ranks raised, others did not: {outcomes}")
        if same_message:
            self.check(len(set(outcomes)) == 1, f"the ranks raised different things: {outcomes}")

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


def _snapshot(obj) -> np.ndarray:
    """A copy of a tensor's values (torch, numpy, or a test producer with .array/.to_numpy)."""
    if hasattr(obj, "to_numpy"):
        return obj.to_numpy()
    return np.array(np.asarray(getattr(obj, "array", obj)))
