"""Launched tests: with FASTREDUCE_TEST_NODES=K, their jobs run across a K-node cluster on
this machine, brought up for the session."""

import os

import mpirun
import pytest

# the harness's misbehaving cases run in jobs of their own (test_harness.py), never here:
# collecting them would load the harness, and MPI, into this process
collect_ignore = ["harness_cases"]


def pytest_configure(config):
    """The test cluster is made once per session: pytest-xdist workers would each make it."""
    if mpirun.test_nodes() and getattr(config.option, "numprocesses", None):
        raise pytest.UsageError("FASTREDUCE_TEST_NODES: run the launched tests in one process "
                                "(-n 0): each pytest-xdist worker would make the same cluster")


@pytest.fixture(scope="session", autouse=True)
def test_cluster():
    """With FASTREDUCE_TEST_NODES=K, a K-node cluster for the session, removed at its end."""
    nodes = mpirun.test_nodes()
    if not nodes:
        yield None
        return
    cluster = mpirun.cluster_or_skip(nodes, mpirun.TEST_CLUSTER, mpirun.TEST_SUBNET,
                                     os.environ.get("FASTREDUCE_TEST_LINK"))
    with cluster:
        yield cluster
