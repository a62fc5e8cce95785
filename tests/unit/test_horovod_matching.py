"""fastreduce.torch.horovod.matching, what a round of Horovod's matching by name decides
from every rank's record: pure functions, tested on records written by hand for 2 and 3
ranks.

Importing the package initialises MPI (which a single-process run must not do), so the
module is loaded from its file under stand-in parent packages, which are removed again at
once; it imports nothing of fastreduce but `errors` (test_import_layering checks that).
"""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

import numpy as np
import pytest

SRC = Path(__file__).resolve().parents[2] / "src" / "fastreduce"


def _load() -> tuple[types.ModuleType, types.ModuleType]:
    """fastreduce.errors and fastreduce.torch.horovod.matching, without the package."""
    names = ["fastreduce", "fastreduce.torch", "fastreduce.torch.horovod", "fastreduce.errors",
             "fastreduce.torch.horovod.matching"]
    saved = {name: sys.modules.pop(name) for name in names if name in sys.modules}
    try:
        for name in names[:3]:
            package = types.ModuleType(name)
            package.__path__ = []
            sys.modules[name] = package
        loaded = []
        for name, path in (("fastreduce.errors", SRC / "errors.py"),
                           ("fastreduce.torch.horovod.matching",
                            SRC / "torch" / "horovod" / "matching.py")):
            spec = importlib.util.spec_from_file_location(name, path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            spec.loader.exec_module(module)
            loaded.append(module)
        return loaded[0], loaded[1]
    finally:
        for name in names:
            sys.modules.pop(name, None)
        sys.modules.update(saved)


errors, matching = _load()


def rec(pending=(), waiting=None, joined=False, refusal=None):
    """A rank's record as comm.allgather gives it: a plain tuple."""
    return (joined, waiting, list(pending), refusal)


def test_statuses_keep_their_wire_values():
    assert {s.name: int(s) for s in matching.Status} == {
        "ACTIVE": 0, "JOINED": 1, "REFUSED": 2, "BLOCKING": 4, "SHUTDOWN": 8, "LISTED": 16}
    assert np.array([matching.Status.BLOCKING, 7], np.int64).tolist() == [4, 7]


def test_the_same_lists_run_in_the_first_ranks_order():
    records = [rec([("a", 1), ("b", 2), ("c", 3)], waiting="a"),
               rec([("c", 3), ("a", 1), ("b", 2)], waiting="c"),
               rec([("b", 2), ("c", 3), ("a", 1)])]
    decision = matching.decide(records)
    assert decision.runnable == ["a", "b", "c"]
    assert (decision.differ, decision.refused, decision.joined) == ([], {}, [])
    assert decision.active == [0, 1, 2]
    assert not decision.stuck
    assert decision.wanted == []  # nothing to describe: no exchange of descriptions


def test_the_first_active_rank_orders_when_rank_0_has_joined():
    records = [rec(joined=True), rec([("b", 2), ("a", 1)]), rec([("a", 1), ("b", 2)])]
    decision = matching.decide(records)
    assert decision.runnable == ["b", "a"]
    assert (decision.joined, decision.active) == ([0], [1, 2])


def test_a_name_missing_on_one_rank_does_not_run():
    records = [rec([("a", 1), ("b", 2)], waiting="b"), rec([("a", 1)], waiting="a"),
               rec([("b", 2), ("a", 1)])]
    decision = matching.decide(records)
    assert decision.runnable == ["a"]
    assert decision.differ == [] and not decision.stuck


def test_a_name_only_on_later_ranks_does_not_run():
    decision = matching.decide([rec([("a", 1)]), rec([("a", 1), ("z", 9)])])
    assert decision.runnable == ["a"]


def test_different_digests_differ_and_do_not_run():
    records = [rec([("a", 1), ("b", 2)]), rec([("a", 1), ("b", 5)]), rec([("b", 2), ("a", 1)])]
    decision = matching.decide(records)
    assert decision.differ == ["b"]
    assert decision.runnable == ["a"]
    assert decision.wanted == ["b"]
    assert not decision.stuck


def test_a_refusal_names_the_rank_and_its_reason():
    records = [rec([("a", 1), ("x", 3)]), rec([("a", 1)], refusal=("x", "bad dtype")),
               rec([("x", 3), ("a", 1)])]
    decision = matching.decide(records)
    assert decision.refused == {"x": "fastreduce.horovod: rank 1 refused the collective 'x', "
                                     "so no rank runs it (bad dtype)"}
    assert decision.runnable == ["a"]


def test_the_first_refusing_rank_is_named_and_a_refused_name_never_runs():
    records = [rec([("x", 3)], waiting="x"), rec([("x", 3)], refusal=("x", "one")),
               rec([("x", 3)], refusal=("x", "two"))]
    decision = matching.decide(records)
    assert list(decision.refused) == ["x"]
    assert "rank 1 refused" in decision.refused["x"] and "(one)" in decision.refused["x"]
    assert decision.runnable == [] and decision.differ == []
    assert not decision.stuck  # the refusal settles the wait


def test_every_rank_waiting_for_a_name_another_lacks_is_stuck():
    records = [rec([("a", 1)], waiting="a"), rec([("b", 2)], waiting="b")]
    decision = matching.decide(records)
    assert decision.stuck and decision.runnable == []
    assert matching.stuck_text(records, decision.active, 2) == (
        "fastreduce.horovod: every rank of a process set of 2 waits for a call (collective) "
        "that another rank has not submitted, so none can run (rank 0 waits for 'a' "
        "(pending: 'a'); rank 1 waits for 'b' (pending: 'b')); every rank must submit the "
        "same calls, matched by name")


def test_a_rank_that_does_not_wait_keeps_the_others_waiting():
    records = [rec([("a", 1)], waiting="a"), rec([("b", 2)]), rec([("a", 1)], waiting="a")]
    assert not matching.decide(records).stuck


def test_nothing_is_stuck_where_something_runs_or_differs():
    runs = [rec([("a", 1), ("b", 2)], waiting="b"), rec([("a", 1)], waiting="a")]
    differs = [rec([("a", 1)], waiting="a"), rec([("a", 4)], waiting="a")]
    assert not matching.decide(runs).stuck
    assert not matching.decide(differs).stuck


def test_joined_ranks_are_left_out_of_the_stuck_condition():
    records = [rec([("a", 1)], waiting="a"), rec(joined=True), rec([("b", 2)], waiting="b")]
    decision = matching.decide(records)
    assert decision.stuck and decision.active == [0, 2]


def test_joined_ranks_take_part_in_reductions_and_barriers_only():
    records = [rec([("g", 1), ("m", 2), ("bar", 3)], waiting="g"), rec(joined=True),
               rec([("g", 1), ("m", 2), ("bar", 3)])]
    decision = matching.decide(records)
    assert (decision.joined, decision.active) == ([1], [0, 2])
    assert decision.runnable == ["g", "m", "bar"]
    assert decision.wanted == ["g", "m", "bar"]  # the joined learn what to take part in
    allreduce = {"call": "allreduce", "name": "g", "op": "Sum"}
    allgather = {"call": "allgather", "name": "m"}
    barrier = {"call": "barrier", "name": "bar"}
    described = [{"g": allreduce, "m": allgather, "bar": barrier}, {},
                 {"g": allreduce, "m": allgather, "bar": barrier}]
    parts = matching.join_parts(decision, described)
    assert [(name, fields) for name, fields, _ in parts] == [
        ("g", allreduce), ("m", allgather), ("bar", barrier)]
    assert parts[0][2] is None and parts[2][2] is None
    refusal = parts[1][2]
    assert isinstance(refusal, errors.HorovodInternalError)
    assert str(refusal) == ("fastreduce.horovod: ranks [1] have joined (hvd.join()); they "
                            "take part in allreduce (hvd.Average, hvd.Sum) and barrier only, "
                            "not allgather: 'm' is refused")


@pytest.mark.parametrize("fields, why", [
    ({"call": "allreduce", "name": "n", "op": "Average"}, None),
    ({"call": "grouped_allreduce", "name": "n", "op": "Sum"}, None),
    ({"call": "bucket", "name": "n", "op": "avg"}, None),
    ({"call": "barrier", "name": "n"}, None),
    ({"call": "allreduce", "name": "n", "op": "Min"},
     "an allreduce with hvd.Average or hvd.Sum only, not Min"),
    ({"call": "bucket", "name": "n", "op": "min"},
     "DistributedOptimizer's reductions with hvd.Average or hvd.Sum"),
    ({"call": "broadcast", "name": "n"},
     "allreduce (hvd.Average, hvd.Sum) and barrier only, not broadcast"),
])
def test_join_refusal(fields, why):
    error = matching.join_refusal(fields, [0, 2])
    if why is None:
        assert error is None
    else:
        assert str(error) == (f"fastreduce.horovod: ranks [0, 2] have joined (hvd.join()); "
                              f"they take part in {why}: 'n' is refused")


def test_a_joined_rank_takes_part_in_the_first_active_ranks_description():
    records = [rec(joined=True), rec([("g", 1)]), rec([("g", 1)])]
    decision = matching.decide(records)
    first = {"call": "allreduce", "name": "g", "op": "Sum", "shape": (2,)}
    later = {"call": "allreduce", "name": "g", "op": "Sum", "shape": (3,)}
    assert matching.join_parts(decision, [{}, {"g": first}, {"g": later}]) == [("g", first, None)]


class _Found:
    """agreement.Differences as mismatch_text reads it."""

    def __init__(self, fields):
        self.fields = fields

    def text(self):
        return "shape: rank 0 passed (2,), rank 1 passed (3,)"


def test_mismatch_text():
    same_call = matching.mismatch_text("w", 2, "allreduce", _Found({"shape": {}}))
    assert same_call == (
        "fastreduce.horovod: the ranks of a process set of 2 submitted allreduce differently "
        "under the name 'w' (shape: rank 0 passed (2,), rank 1 passed (3,)); every rank must "
        "submit the same collective, with the same dtype, shape and op, under one name")
    other_call = matching.mismatch_text("w", 3, "allreduce", _Found({"call": {}}))
    assert "submitted different collectives under the name 'w'" in other_call
    assert "submitted different collectives under the name 'w' ()" in \
        matching.mismatch_text("w", 3, "allreduce", None)


def test_all_offer():
    A, B, L = matching.Status.ACTIVE, matching.Status.BLOCKING, matching.Status.LISTED
    statuses = np.array([A, B, A], np.int64)
    assert matching.all_offer(statuses, np.array([7, 7, 7]), A, 7)
    assert not matching.all_offer(statuses, np.array([7, 8, 7]), A, 7)
    assert not matching.all_offer(np.array([A, L, A]), np.array([7, 7, 7]), A, 7)
    assert not matching.all_offer(statuses, np.array([7, 7, 7]), L, 7)


def test_decided_alone():
    A, S, L = matching.Status.ACTIVE, matching.Status.SHUTDOWN, matching.Status.LISTED
    send = np.array([A, 5], np.int64)
    assert matching.decided_alone(np.array([A, 5, A, 5], np.int64), send)
    assert matching.decided_alone(np.array([A, 5, S, 0], np.int64), send)  # a rank left
    assert not matching.decided_alone(np.array([A, 5, L, 0], np.int64), send)
    assert not matching.decided_alone(np.array([A, 5, A, 6], np.int64), send)


def test_unnamed_numbering():
    assert matching.unnamed_number("allreduce.noname.3") == ("allreduce", 3)
    assert matching.unnamed_number("grouped_allreduce.noname.12.1") == ("grouped_allreduce", 12)
    assert matching.unnamed_number("weights") == (None, 0)
    numbers = {"allreduce": 5, "allgather": 2}
    unused = matching.unused_numbering(numbers, ["allreduce.noname.3", "weights",
                                                 "broadcast.noname.0"])
    assert unused == {"allreduce": 3, "allgather": 2, "broadcast": 0}
    assert numbers == {"allreduce": 5, "allgather": 2}  # the caller's numbering untouched
    assert matching.highest_numbering([{"allreduce": 3}, {"allreduce": 5, "allgather": 1},
                                       {}]) == {"allreduce": 5, "allgather": 1}
