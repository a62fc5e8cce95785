"""Launched tests: with FASTREDUCE_TEST_NODES=K, their jobs run across a K-node cluster on
this machine, brought up for the session."""

import os

import mpirun
import pytest


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
