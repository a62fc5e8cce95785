"""Rank 0's status line, and where it goes: whether the launcher's output is a terminal."""

from __future__ import annotations

import os
import sys
import time

from ...sizes import format_size

# the names a launcher's process has (/proc/PID/stat); Open MPI 5's mpiexec is prterun
LAUNCHERS = frozenset({"mpiexec", "mpirun", "prterun", "orterun", "mpiexec.hydra",
                       "mpirun.hydra", "mpiexec.openmpi", "mpirun.openmpi", "mpiexec.mpich",
                       "mpirun.mpich"})


def _is_terminal(pid: int, fd: int) -> bool:
    try:
        target = os.readlink(f"/proc/{pid}/fd/{fd}")
    except OSError:
        return False
    return target.startswith(("/dev/pts/", "/dev/tty")) or target == "/dev/console"


def _launcher_terminals(depth: int = 8) -> tuple[bool, bool] | None:
    """Whether the stdout and stderr of the mpiexec that started this process are
    terminals, from /proc (Linux); None where no launcher is found among its ancestors."""
    pid = os.getppid()
    for _ in range(depth):
        if pid <= 1:
            return None
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
        except OSError:
            return None
        if stat[stat.index("(") + 1:stat.rindex(")")] in LAUNCHERS:
            return _is_terminal(pid, 1), _is_terminal(pid, 2)
        pid = int(stat[stat.rindex(")") + 2:].split()[1])
    return None


def terminals() -> tuple[bool, bool]:
    """Whether what this rank writes to stdout and stderr ends on a terminal.

    A rank's own isatty() does not say: Open MPI gives every rank's stdout a
    pseudo-terminal even when mpiexec's output is piped, and its stderr (MPICH: both)
    a pipe even on a terminal. The launcher's own descriptors do say; where it is not
    an ancestor (srun, a remote daemon) a rank's stdout counts only outside Open MPI.
    """
    found = _launcher_terminals()
    if found is not None:
        return found
    open_mpi = "OMPI_COMM_WORLD_SIZE" in os.environ
    return (not open_mpi and os.isatty(1)), os.isatty(2)


class _Progress:
    """One status line, "# [3/12] 64 KiB: mpi4py, 5 s", that rank 0 rewrites in place.

    On stdout, where the table goes, so that the two cannot interleave (a launcher
    forwards stdout and stderr separately); on stderr where only stderr is a terminal
    (the table going to a file). Every write ends its line, since Open MPI forwards
    whole lines only: a rewrite first moves the cursor back up and erases the status
    line, and so does the table row that takes its place."""

    ERASE = "\033[A\r\033[K"  # cursor up one line, to its start, erase it

    def __init__(self, stream=None, total: int = 0):
        self.stream, self.total = stream, total
        self.index, self.nbytes, self.started = 0, 0, time.perf_counter()
        self.shown = False

    @classmethod
    def for_rank(cls, rank: int, args, total: int) -> _Progress:
        if rank != 0 or args.no_progress:
            return cls()
        if args.progress:
            return cls(sys.stdout, total)
        out, err = terminals()
        return cls(sys.stdout if out else sys.stderr if err else None, total)

    def size(self, index: int, nbytes: int) -> None:
        self.index, self.nbytes = index, nbytes

    def step(self, what: str) -> None:
        if self.stream is None:
            return
        elapsed = time.perf_counter() - self.started
        self.stream.write(f"{self.ERASE if self.shown else ''}# [{self.index + 1}/{self.total}]"
                          f" {format_size(self.nbytes, exact=False)}: {what}, {elapsed:.0f} s\n")
        self.stream.flush()
        self.shown = True

    def clear(self) -> None:
        """Erase the status line: what is printed next takes its place."""
        if self.shown:
            self.stream.write(self.ERASE)
            self.shown = False
