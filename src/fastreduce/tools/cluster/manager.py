"""A cluster on one machine: bring it up, run MPI jobs across its nodes, take it down.

The state of a cluster that is up (its nodes, link and launcher agent) lives in a folder
named after it, so that ``up``, ``run`` and ``down`` can be separate commands.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
from pathlib import Path

from ...errors import ClusterError
from . import launch, network
from .network import Link, Node

__all__ = ["DEFAULT_NAME", "DEFAULT_SUBNET", "Cluster"]

DEFAULT_NAME = "fr"
DEFAULT_SUBNET = "10.77.0.0/24"


STATE = Path("/run/fastreduce-cluster")  # root's: the launcher agent root runs lives here


def _folder(name: str) -> Path:
    return STATE / name


def _private_folder(folder: Path) -> None:
    """Make `folder` (and STATE) owned by this user, mode 0700, and refuse anything else:
    root runs the agent written there."""
    for path in (folder.parent, folder):
        path.mkdir(mode=0o700, exist_ok=True)
        info = os.lstat(path)
        if (not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid()
                or info.st_mode & 0o077):
            raise ClusterError(f"fastreduce.cluster: {path} is not a private folder of this "
                               f"user (a link, another owner, or open to others); remove it")


class Cluster:
    """K nodes on one machine; ``with Cluster.up(...) as c: c.run(4, [...])``."""

    def __init__(self, name: str, subnet: str, bridge_address: str, nodes: list[Node],
                 link: Link):
        self.name, self.subnet, self.bridge_address = name, subnet, bridge_address
        self.nodes, self.link = nodes, link
        self.folder = _folder(name)

    # -- making and removing -------------------------------------------------------------

    @classmethod
    def up(cls, nodes: int = 2, link: str | Link | None = None, name: str = DEFAULT_NAME,
           subnet: str = DEFAULT_SUBNET, hosts: bool = True) -> Cluster:
        """Make `nodes` namespaced nodes on a bridge, links shaped as `link` (`hosts`:
        node names resolve on every node); on any failure remove what was made and raise
        ClusterError."""
        if not (1 <= len(name) <= 8 and name.replace("_", "").isalnum()):
            raise ClusterError(f"fastreduce.cluster: name {name!r}: 1 to 8 letters or digits "
                               f"(device names are limited to 15 characters)")
        if nodes < 1:
            raise ClusterError(f"fastreduce.cluster: --nodes {nodes}: at least one node")
        link = link if isinstance(link, Link) else Link.parse(link)
        network.check_allowed()
        network.check_free(name, subnet)
        try:
            bridge_address, made = network.create(name, nodes, subnet, hosts)
            cluster = cls(name, subnet, bridge_address, made, link)
            network.shape(made, link)
            cluster._save()
        except BaseException:
            remove(name)
            raise
        return cluster

    @classmethod
    def attach(cls, name: str = DEFAULT_NAME) -> Cluster:
        """The cluster `name` brought up before (by this or another process)."""
        state = _folder(name) / "cluster.json"
        if not state.exists():
            raise ClusterError(f"fastreduce.cluster: no cluster named {name!r} is up; "
                               f"`python -m fastreduce.cluster up --name {name}` first")
        data = json.loads(state.read_text())
        return cls(name, data["subnet"], data["bridge_address"],
                   [Node(**node) for node in data["nodes"]], Link(**data["link"]))

    def down(self) -> list[str]:
        """Kill its processes, delete its namespaces, links and bridge; what was removed."""
        return remove(self.name)

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc) -> None:
        self.down()

    def _save(self) -> None:
        _private_folder(self.folder)
        agent = self.folder / "agent.sh"
        agent.write_text(launch.agent_script(self.nodes))
        agent.chmod(0o755)
        (self.folder / "cluster.json").write_text(json.dumps({
            "subnet": self.subnet, "bridge_address": self.bridge_address,
            "nodes": [vars(node) for node in self.nodes], "link": vars(self.link)}, indent=1))

    # -- links ---------------------------------------------------------------------------

    def shape(self, link: str | Link | None) -> None:
        """Shape every node's link anew (``None``: unshaped)."""
        self.link = link if isinstance(link, Link) else Link.parse(link)
        network.shape(self.nodes, self.link)
        self._save()

    def node(self, which: int | str) -> Node:
        """A node by index, name (fr-n1) or short name (n1)."""
        for index, node in enumerate(self.nodes):
            if which in (index, node.name, node.name.removeprefix(f"{self.name}-")):
                return node
        raise ClusterError(f"fastreduce.cluster: no node {which!r} in cluster {self.name!r} "
                           f"(nodes: {', '.join(n.name for n in self.nodes)})")

    def set_link(self, which: int | str, up: bool) -> None:
        """Pull a node's cable (up=False) or plug it back."""
        network.set_link_state(self.node(which), up)

    def kill_node(self, which: int | str, sig: int = signal.SIGKILL) -> list[int]:
        """Send `sig` to every process on a node (as a node crash would end them)."""
        pids = network.node_pids(self.node(which).name)
        for pid in pids:
            try:
                os.kill(pid, sig)
            except OSError:
                pass
        return pids

    # -- jobs ----------------------------------------------------------------------------

    def command(self, nprocs: int, argv: list[str], per_node: int | None = None,
                mpiexec: str | None = None, env: dict[str, str] | None = None
                ) -> tuple[list[str], dict[str, str], list[str]]:
        """(mpiexec command line, its environment, each rank's node) for `argv`."""
        mpiexec = launch.find_mpiexec(mpiexec)
        placement = launch.layout(self.nodes, nprocs, per_node)
        full_env = launch.environment(dict(os.environ if env is None else env),
                                      launch.family(mpiexec))
        cmd = launch.command(mpiexec, self.folder, self.bridge_address, self.subnet,
                             placement, list(argv), full_env)
        expected = [node.name for node, count in placement for _ in range(count)]
        return cmd, full_env, expected

    def check_placement(self, nprocs: int, per_node: int | None = None,
                        mpiexec: str | None = None, python: str | None = None,
                        timeout: float = 120) -> str:
        """Run the placement probe; its report, or ClusterError saying what is wrong."""
        _, _, expected = self.command(nprocs, [], per_node, mpiexec)
        probe = [python or sys.executable, "-m", "fastreduce.tools.cluster.placement",
                 *expected]
        rc, out = self.run(nprocs, probe, per_node, mpiexec, timeout=timeout, capture=True)
        if rc != 0:
            raise ClusterError(f"fastreduce.cluster: the ranks are not where they were "
                               f"placed (or the probe failed, status {rc}):\n{out}")
        return out

    def start(self, nprocs: int, argv: list[str], per_node: int | None = None,
              mpiexec: str | None = None, env: dict[str, str] | None = None,
              capture: bool = False) -> subprocess.Popen:
        """Start `argv` on `nprocs` ranks across the nodes (in a new process group)."""
        cmd, full_env, _ = self.command(nprocs, argv, per_node, mpiexec, env)
        return subprocess.Popen(cmd, env=full_env, text=True, start_new_session=True,
                                stdout=subprocess.PIPE if capture else None,
                                stderr=subprocess.STDOUT if capture else None)

    def run(self, nprocs: int, argv: list[str], per_node: int | None = None,
            mpiexec: str | None = None, env: dict[str, str] | None = None,
            timeout: float | None = None, capture: bool = False) -> tuple[int, str]:
        """Run `argv` on `nprocs` ranks across the nodes; (exit status, output if captured).

        On `timeout` the launcher's process group is killed, and so is every process the
        job left on the nodes (exit status 124)."""
        proc = self.start(nprocs, argv, per_node, mpiexec, env, capture)
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.stop(proc)
            out, _ = proc.communicate()
            return 124, (out or "") + f"\nfastreduce.cluster: killed after {timeout:g} s"
        except BaseException:
            self.stop(proc)
            raise
        return proc.returncode, out or ""

    def stop(self, proc: subprocess.Popen) -> None:
        """Kill a job started here: its launcher and whatever it left on the nodes."""
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
        self.kill_jobs()

    def kill_jobs(self) -> None:
        """End every process on every node (what a job left behind), until none is left."""
        for node in self.nodes:
            network.kill_all(node.name)

    def describe(self) -> str:
        """One line per node, and the link."""
        lines = [f"cluster {self.name}: {len(self.nodes)} nodes on bridge {self.name}-br "
                 f"({self.bridge_address}), link {self.link.describe()}"]
        lines += [f"  {node.name}  {node.address}" for node in self.nodes]
        return "\n".join(lines)


def remove(name: str) -> list[str]:
    """Remove cluster `name` by name, whatever state it is in; what was removed."""
    removed = network.remove(name)
    folder = _folder(name)
    if folder.exists():
        shutil.rmtree(folder, ignore_errors=True)
        removed.append(f"folder {folder}")
    return removed
