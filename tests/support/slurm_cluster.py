"""Slurm clusters in a temporary folder, for srun tests: one node on loopback
(SlurmCluster), or one slurmd per node of a fastreduce.cluster Cluster (MultiNodeSlurm).

Needs slurmctld, slurmd and srun (Debian: slurmctld slurmd slurm-client, plus
libpmix2 libpmix-dev for --mpi=pmix) and root. No munge: auth/none.
"""

from __future__ import annotations

import os
import random
import shlex
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

BASE = """\
ClusterName={name}
SlurmUser=root
AuthType=auth/none
CredType=cred/none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
StateSaveLocation={d}/state
SlurmctldPidFile={d}/slurmctld.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdParameters=config_overrides
"""
CONF = BASE + """\
SlurmctldHost=localhost
SlurmdSpoolDir={d}/spool
SlurmdPidFile={d}/slurmd.pid
SlurmdLogFile={d}/slurmd.log
NodeName=localhost NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName=test Nodes=localhost Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
"""
# %n: each slurmd's files in its own folder. TmpFS too: the pmix plugin makes its
# spmix_appdir_UID_JOB.STEP there, and the nodes share one /tmp.
MULTI_CONF = BASE + """\
SlurmctldHost=localhost({controller})
SlurmctldPort={ports[0]}
SlurmdPort={ports[1]}
SlurmdSpoolDir={d}/%n/spool
SlurmdPidFile={d}/%n/slurmd.pid
SlurmdLogFile={d}/%n/slurmd.log
TmpFS={d}/%n/tmp
{nodes}PartitionName=test Nodes={names} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
"""


def _listening(port: int) -> bool:
    """Whether something on this machine accepts connections on the TCP port."""
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return False
    return True


def missing_tools() -> list[str]:
    return [t for t in ("slurmctld", "slurmd", "srun", "sinfo") if shutil.which(t) is None]


class SlurmCluster:
    """slurmctld and one slurmd (node `localhost`) on loopback."""

    def __init__(self, folder: Path, cpus: int = 16):
        self.folder = folder
        self.nodes = ["localhost"]
        self._configure(CONF.format(d=folder, name="fastreduce-test", cpus=cpus), ["spool"])

    def _configure(self, conf: str, folders: list[str]) -> None:
        for sub in ("state", *folders):
            (self.folder / sub).mkdir(parents=True, exist_ok=True)
        self.conf = self.folder / "slurm.conf"
        # Job ids that no earlier test cluster used: MPICH names its shared-memory segments
        # after the job and step, and a segment a killed job left in /dev/shm under the same
        # name makes MPI_Init fail ("Out of memory" in MPIDI_POSIX_comm_bootstrap).
        self.conf.write_text(conf + f"FirstJobId={random.randrange(10_000, 60_000_000)}\n")
        self.env = dict(os.environ, SLURM_CONF=str(self.conf))
        self.procs: list[subprocess.Popen] = []

    def daemons(self) -> list[list[str]]:
        return [["slurmctld", "-D", "-f", str(self.conf)],
                ["slurmd", "-D", "-N", "localhost", "-f", str(self.conf)]]

    controller_port = 6817  # Slurm's default

    def start(self, timeout: float = 60) -> None:
        if _listening(self.controller_port):  # another cluster's daemons would answer
            raise RuntimeError(
                f"port {self.controller_port} is taken: a slurmctld of an earlier run (one "
                f"stopped before its end) is still running, and its slurmd would run this "
                f"cluster's jobs; stop it (pkill -x slurmctld; pkill -x slurmd) and run again")
        for cmd in self.daemons():
            self.procs.append(subprocess.Popen(cmd, env=self.env, stdout=subprocess.DEVNULL,
                                               stderr=subprocess.DEVNULL,
                                               start_new_session=True))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            states = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], env=self.env,
                                    capture_output=True, text=True).stdout.split()
            if len(states) == len(self.nodes) and set(states) == {"idle"}:
                return
            time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"Slurm did not become idle in {timeout}s:\n{self.logs()}")

    def logs(self) -> str:
        return "\n".join(f"--- {p.relative_to(self.folder)}\n"
                         f"{p.read_text(errors='replace')[-3000:]}"
                         for p in sorted(self.folder.rglob("*.log")))

    def srun(self, ntasks: int, mpi: str, *command: str, timeout: float = 300,
             env: dict | None = None, nodes: int | None = None) -> tuple[int, str]:
        """srun [-N nodes] -n ntasks -O --mpi=<mpi> command; (exit status, output). A hang
        is killed."""
        cmd = ["srun", *(["-N", str(nodes)] if nodes else []), "-n", str(ntasks), "-O",
               f"--mpi={mpi}", *command]
        full_env = dict(self.env, **(env or {}))
        proc = subprocess.Popen(cmd, env=full_env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            subprocess.run(["scancel", "--user", "root"], env=self.env, capture_output=True)
            out, _ = proc.communicate()
            raise AssertionError(
                f"{' '.join(cmd)} hung for {timeout}s:\n{out}\n{self.logs()}") from None
        return proc.returncode, out

    def stop(self) -> None:
        subprocess.run(["scancel", "--user", "root"], env=self.env, capture_output=True)
        for proc in self.procs:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        self.procs = []


def cgroup_mounts() -> str:
    """Shell commands mounting this machine's cgroup file systems again: `ip netns exec`
    mounts a fresh /sys without them, and slurmd 22.05 does not start without them
    ("can't stat /sys/fs/cgroup/systemd/", "Unable to initialize cgroup plugin")."""
    commands = []
    for line in Path("/proc/self/mounts").read_text().splitlines():
        source, target, fstype, options = line.split()[:4]
        if target == "/sys/fs/cgroup" or target.startswith("/sys/fs/cgroup/"):
            commands.append(f"mkdir -p {target} && mount -t {fstype} -o "
                            f"{shlex.quote(options)} {source} {target}")
    return "".join(f"{c} && " for c in commands)


class MultiNodeSlurm(SlurmCluster):
    """slurmctld in the machine's namespace, at the bridge address of `cluster` (a
    fastreduce.cluster Cluster), and one slurmd inside each node's namespace under the
    node's hostname. Ports other than the defaults, so that a SlurmCluster can run too."""

    def __init__(self, folder: Path, cluster, cpus: int = 4,
                 ports: tuple[int, int] = (6917, 6918)):
        self.folder = folder
        self.controller_port = ports[0]
        self.nodes = [node.name for node in cluster.nodes]
        lines = "".join(f"NodeName={node.name} NodeAddr={node.address} CPUs={cpus} "
                        f"State=UNKNOWN\n" for node in cluster.nodes)
        conf = MULTI_CONF.format(d=folder, name=cluster.name, ports=ports, nodes=lines,
                                 controller=cluster.bridge_address,
                                 names=",".join(self.nodes))
        self._configure(conf, [f"{node}/{sub}" for node in self.nodes
                               for sub in ("spool", "tmp")])

    def daemons(self) -> list[list[str]]:
        mounts = cgroup_mounts()
        return [["slurmctld", "-D", "-f", str(self.conf)]] + [
            ["ip", "netns", "exec", node, "unshare", "--uts", "bash", "-c",
             f"{mounts}hostname {node} && exec slurmd -D -N {node} -f {self.conf}"]
            for node in self.nodes]
