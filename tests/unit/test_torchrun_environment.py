"""torchrun's variables under mpiexec and srun: which are set, from what (a pure function:
no MPI is called, though importing the package starts it)."""

from __future__ import annotations

import pytest

rendezvous = pytest.importorskip("fastreduce.torch.distributed.rendezvous",
                                 exc_type=ImportError)
torchrun_environment = rendezvous.torchrun_environment
SET_BY = rendezvous._SET_BY


def never():
    raise AssertionError("the node's ranks were looked up though not needed")


def test_bare_launch_gets_all_four():
    got = torchrun_environment({}, 3, 8, lambda: (1, 4), 77)
    assert got == {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
                   SET_BY: "77:RANK=3,WORLD_SIZE=8,LOCAL_RANK=1,LOCAL_WORLD_SIZE=4"}


def test_torchrun_launch_is_left_alone():
    for env in ({"RANK": "0"}, {"WORLD_SIZE": "2"}, {"TORCHELASTIC_RUN_ID": "x"}):
        assert torchrun_environment(env, 0, 2, never, 77) == {}


def test_local_variables_from_the_launcher_are_kept():
    env = {"LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "3"}
    assert torchrun_environment(env, 5, 6, never, 77) == {
        "RANK": "5", "WORLD_SIZE": "6", SET_BY: "77:RANK=5,WORLD_SIZE=6"}
    got = torchrun_environment({"LOCAL_RANK": "2"}, 5, 6, lambda: (2, 3), 77)
    assert got == {"RANK": "5", "WORLD_SIZE": "6", "LOCAL_WORLD_SIZE": "3",
                   SET_BY: "77:RANK=5,WORLD_SIZE=6,LOCAL_WORLD_SIZE=3"}


def test_a_parents_values_are_replaced_a_launchers_kept():
    parent = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
              SET_BY: "12:RANK=0,WORLD_SIZE=1,LOCAL_RANK=0,LOCAL_WORLD_SIZE=1"}
    got = torchrun_environment(parent, 1, 2, lambda: (1, 2), 77)
    assert got == {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                   SET_BY: "77:RANK=1,WORLD_SIZE=2,LOCAL_RANK=1,LOCAL_WORLD_SIZE=2"}
    # torchrun started by that parent set its own values: they stay
    worker = dict(parent, RANK="3", WORLD_SIZE="4", LOCAL_RANK="1", LOCAL_WORLD_SIZE="2")
    assert torchrun_environment(worker, 0, 1, never, 77) == {}
    assert torchrun_environment(dict(parent, **{SET_BY: "77:RANK=0"}), 1, 2, never, 77) == {}
