"""Soft checks for multi-rank cases: a failed check is recorded and the case goes on, so
every rank still reaches the collectives that follow (a raised assertion on one rank would
leave the others waiting in them). The harness (tests/support/mpi_harness.py) fails a case
whose `checks` fixture recorded a failure, after the case returns.

Launcher programs (tests/launch/programs) use the same class and end with `exit_report()`.
"""

from __future__ import annotations

import sys
import traceback

import numpy as np
from mpi4py import MPI

WORLD = MPI.COMM_WORLD


class Checks:
    """Collects failed checks on this rank; `count` is how many were made."""

    def __init__(self, comm: MPI.Comm = WORLD) -> None:
        self.comm = comm
        self.failures: list[str] = []
        self.count = 0

    def check(self, ok: bool, what: str) -> None:
        """Record `what` as a failure unless `ok`."""
        self.count += 1
        if not ok:
            self.failures.append(what)

    def run(self, name: str, fn, *args) -> None:
        """Call fn(*args); an exception it raises is a failure named `name`."""
        self.count += 1
        try:
            fn(*args)
        except Exception:
            self.failures.append(f"{name}:\n{traceback.format_exc()}")

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
        outcomes = self.comm.allgather(outcome)
        self.check("none" not in outcomes, f"some ranks raised, others did not: {outcomes}")
        if same_message:
            self.check(len(set(outcomes)) == 1, f"the ranks raised different things: {outcomes}")

    def report(self) -> str:
        """This rank's failures as one text ("" when there are none)."""
        shown = self.failures[:20]
        more = len(self.failures) - len(shown)
        return "\n".join([*shown, *([f"... and {more} more"] if more > 0 else [])])

    def exit_report(self) -> None:
        """For a launcher program: print every rank's failures and the total, then exit
        with 0 (all passed), 1 (a check failed) or 3 (no check was made)."""
        total = self.comm.allreduce(len(self.failures))
        checks = self.comm.allreduce(self.count)
        for item in self.failures[:20]:
            print(f"[rank {self.comm.rank}] FAILED {item}", flush=True)
        self.comm.Barrier()
        if self.comm.rank == 0:
            print(f"{checks} checks on {self.comm.size} ranks, {total} failed", flush=True)
        sys.exit(3 if checks == 0 else 1 if total else 0)


def _snapshot(obj) -> np.ndarray:
    """A copy of a tensor's values (torch, numpy, or a test producer with .array/.to_numpy)."""
    if hasattr(obj, "to_numpy"):
        return obj.to_numpy()
    return np.array(np.asarray(getattr(obj, "array", obj)))
