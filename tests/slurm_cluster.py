"""A single-node Slurm cluster on loopback, in a temporary folder, for srun tests.

Needs slurmctld, slurmd and srun (Debian: slurmctld slurmd slurm-client, plus
libpmix2 libpmix-dev for --mpi=pmix) and root. No munge: auth/none.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

CONF = """\
ClusterName=fastreduce-test
SlurmctldHost=localhost
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
SlurmdSpoolDir={d}/spool
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd.log
SlurmdParameters=config_overrides
NodeName=localhost NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName=test Nodes=localhost Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
"""


def missing_tools() -> list[str]:
    return [t for t in ("slurmctld", "slurmd", "srun", "sinfo") if shutil.which(t) is None]


class SlurmCluster:
    def __init__(self, folder: Path, cpus: int = 16):
        self.folder = folder
        for sub in ("state", "spool"):
            (folder / sub).mkdir(parents=True, exist_ok=True)
        self.conf = folder / "slurm.conf"
        self.conf.write_text(CONF.format(d=folder, cpus=cpus))
        self.env = dict(os.environ, SLURM_CONF=str(self.conf))
        self.procs: list[subprocess.Popen] = []

    def start(self, timeout: float = 60) -> None:
        for cmd in (["slurmctld", "-D", "-f", str(self.conf)],
                    ["slurmd", "-D", "-N", "localhost", "-f", str(self.conf)]):
            self.procs.append(subprocess.Popen(cmd, env=self.env, stdout=subprocess.DEVNULL,
                                               stderr=subprocess.DEVNULL,
                                               start_new_session=True))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            state = subprocess.run(["sinfo", "-h", "-o", "%T"], env=self.env,
                                   capture_output=True, text=True).stdout.strip()
            if state == "idle":
                return
            time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"Slurm did not become idle in {timeout}s:\n{self.logs()}")

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}"
                         for p in sorted(self.folder.glob("*.log")))

    def srun(self, ntasks: int, mpi: str, *command: str, timeout: float = 300,
             env: dict | None = None) -> tuple[int, str]:
        """srun -n ntasks -O --mpi=<mpi> command; (exit status, output). A hang is killed."""
        cmd = ["srun", "-n", str(ntasks), "-O", f"--mpi={mpi}", *command]
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
