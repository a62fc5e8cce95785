"""pytest on every rank: the harness behind tests/mpi.

    mpiexec -n 3 python -m pytest tests/mpi                       every 3-rank case
    mpiexec -n 3 python -m pytest tests/mpi/test_engine.py -k wait --profile fakecuda

Every rank runs the same pytest session. A case is marked with the rank counts and the
profile (tests/support/profiles.py) it runs with, `@pytest.mark.mpi(ranks=(2, 3),
profile="fakecuda")`; unmarked cases run on 1 to 4 ranks in the default profile. Cases for
other rank counts or profiles are deselected, and a session that selects none of its
cases says which sessions would.

After each phase of each case (set-up, call, tear-down) the ranks agree on its outcome:
a failure on any rank is a failure on every rank, so all ranks always run the same
next step, and rank 0 reports it with each failing rank's text and the command that runs
the case again. The other ranks print nothing but what they write to stderr. A case
that runs past its timeout (pytest-timeout's `timeout`, or `@pytest.mark.timeout(s)`)
is named on stderr with every thread's stack, and the job is ended with MPI_Abort:
a hang costs its timeout, never the rest of CI's time.

Why not the pytest-mpi plugin: it skips cases by communicator size, but neither agrees
on outcomes across ranks nor ends a hung job; both are what keeps a multi-rank session
from hanging or diverging, so they live here (about two hundred lines).
"""

from __future__ import annotations

import contextlib
import faulthandler
import hashlib
import json
import os
import shlex
import sys
import threading
import time
from pathlib import Path

import numpy as np
import profiles
import pytest
from checks import Checks
from mpi4py import MPI

DEFAULT_RANKS = (1, 2, 3, 4)
TIMED_OUT_EXIT = 124  # the MPI_Abort error code of a case past its timeout
_TIMER = pytest.StashKey[threading.Timer]()
_OUTCOME_CODES = {"passed": 0, "skipped": 1, "failed": 2}


def case_sessions(item: pytest.Item) -> tuple[tuple[int, ...], str]:
    """(rank counts, profile) a case runs with, from its `mpi` marker."""
    marker = item.get_closest_marker("mpi")
    kwargs = marker.kwargs if marker else {}
    ranks = kwargs.get("ranks", DEFAULT_RANKS)
    ranks = (ranks,) if isinstance(ranks, int) else tuple(ranks)
    return ranks, kwargs.get("profile", "default")


class MPIHarness:
    """The pytest plugin: selection by size and profile, agreement, timeouts, reporting."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.comm = MPI.COMM_WORLD.Dup()  # the harness's messages never meet a case's
        self.rank, self.size = self.comm.rank, self.comm.size
        self.profile = config.getoption("profile")
        self.any_size = config.getoption("any_size")
        self.checks = 0  # checks made by this rank's cases (the `checks` fixture)
        self._codes = np.zeros(2, dtype=np.int64)  # (outcome code, -outcome code)
        self.cases = 0

    # -- set-up -------------------------------------------------------------------------
    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionstart(self, session: pytest.Session) -> None:
        config = session.config
        if self.rank == 0:
            return
        reporter = config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:  # rank 0 reports for every rank
            from _pytest._io import TerminalWriter

            reporter._tw = TerminalWriter(open(os.devnull, "w"))  # noqa: SIM115
        if getattr(config, "cache", None) is not None:  # rank 0 keeps the cache
            config.cache.set = lambda key, value: None

    def pytest_report_header(self, config: pytest.Config) -> str:
        return (f"mpi: {self.size} rank(s), profile {self.profile!r}, "
                f"{MPI.Get_library_version().splitlines()[0].strip()}")

    # -- collection ---------------------------------------------------------------------
    def pytest_collection_modifyitems(self, config: pytest.Config,
                                      items: list[pytest.Item]) -> None:
        if config.getoption("mpi_sessions"):
            return
        keep, drop, wanted = [], [], set()
        for item in items:
            ranks, profile = case_sessions(item)
            if (self.size in ranks or self.any_size) and profile == self.profile:
                keep.append(item)
            else:
                drop.append(item)
                wanted.update((n, profile) for n in ranks)
        if drop:
            config.hook.pytest_deselected(items=drop)
            items[:] = keep
        if not keep and wanted and self.rank == 0:
            runs = ", ".join(f"{n} rank(s) --profile {p}" for n, p in sorted(wanted))
            print(f"\nno case here runs on {self.size} rank(s) with profile "
                  f"{self.profile!r}; the selected cases run on: {runs}", file=sys.stderr)
        digest = hashlib.sha1("\n".join(i.nodeid for i in items).encode()).hexdigest()
        digests = self.comm.allgather(digest)
        if len(set(digests)) != 1:
            pytest.exit(f"the ranks collected different cases (digests {digests}): give every "
                        f"rank the same arguments and files", returncode=3)

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        if not session.config.getoption("mpi_sessions"):
            return
        long_too = "long" in (session.config.getoption("-m") or "")
        files: dict[tuple[int, str], set[str]] = {}
        for item in session.items:
            if long_too or "long" not in item.keywords:
                ranks, p = case_sessions(item)
                for n in ranks:
                    files.setdefault((n, p), set()).add(item.nodeid.split("::")[0])
        if self.rank == 0:  # [ranks, profile, the files that hold its cases]
            print(json.dumps([[n, p, sorted(f)] for (n, p), f in sorted(files.items())]))
        pytest.exit("listed the sessions", returncode=0)

    # -- running ------------------------------------------------------------------------
    def _uncaptured(self):
        """A context in which stderr is the job's, not pytest's capture of it: what is
        written just before MPI_Abort would be lost with the capture."""
        capman = self.config.pluginmanager.get_plugin("capturemanager")
        return capman.global_and_fixture_disabled() if capman else contextlib.nullcontext()

    def pytest_runtest_setup(self, item: pytest.Item) -> None:
        watchdog = sys.modules.get("fastreduce.watchdog")
        if watchdog is not None and not getattr(watchdog._say, "uncaptured", False):
            say = watchdog._say  # a stuck call's record, printed as the watchdog ends the job

            def uncaptured_say(text: str) -> None:
                with self._uncaptured():
                    say(text)
            uncaptured_say.uncaptured = True
            watchdog._say = uncaptured_say

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_call(self, item: pytest.Item):
        __tracebackhide__ = True
        result = yield
        checks = getattr(item, "funcargs", {}).get("checks")
        if checks is not None:
            self.checks += checks.count
            if checks.failures:
                raise AssertionError(f"{len(checks.failures)} of {checks.count} checks failed "
                                     f"on rank {self.rank}:\n{checks.report()}")
        return result

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo):
        report = yield
        if call.when == "call":
            self.cases += 1
        # the common case first, in one small reduction: every rank passed, or every rank
        # skipped; the texts are gathered only when the ranks differ or one failed
        code = _OUTCOME_CODES[report.outcome]
        self._codes[:] = (code, -code)
        self.comm.Allreduce(MPI.IN_PLACE, self._codes, op=MPI.MAX)
        if self._codes[0] == -self._codes[1] and not report.failed:
            return report
        local = (report.outcome, report.longreprtext if report.failed else "",
                 _skip_reason(report) if report.skipped else "")
        everyone = self.comm.allgather(local)
        outcomes = {outcome for outcome, _, _ in everyone}
        if outcomes == {report.outcome} and not report.failed:
            return report
        failed = [r for r, (outcome, _, _) in enumerate(everyone) if outcome == "failed"]
        if failed:
            head = (f"{call.when} failed on rank(s) {', '.join(map(str, failed))} "
                    f"of {self.size}")
            texts = [f"---------- rank {r} ----------\n{everyone[r][1]}" for r in failed]
        else:
            by = {o: [r for r, e in enumerate(everyone) if e[0] == o] for o in sorted(outcomes)}
            head = (f"the ranks disagree in {call.when}: "
                    + "; ".join(f"{o} on rank(s) {', '.join(map(str, rs))}"
                                for o, rs in by.items()))
            texts = [f"rank {r} skipped: {reason}" for r, (o, _, reason) in enumerate(everyone)
                     if o == "skipped"]
        report.outcome = "failed"
        report.longrepr = "\n".join([head, *texts, f"run it again: {self.reproduce(item)}"])
        return report

    def reproduce(self, item: pytest.Item) -> str:
        """The command that runs this one case again, with this session's size and profile."""
        command = f"python -m pytest {shlex.quote(item.nodeid)}"
        if self.profile != "default":
            command += f" --profile {self.profile}"
        if self.size > 1:
            command = f"mpiexec -n {self.size} {command}"
        nodes = os.environ.get("FASTREDUCE_TEST_NODES")
        if nodes:
            command = f"python tests/support/sessions.py --nodes {nodes} -- {command}"
        return command

    # -- timeouts (pytest-timeout's hooks: this harness's timer replaces its own) -------
    @pytest.hookimpl(optionalhook=True)
    def pytest_timeout_set_timer(self, item: pytest.Item, settings) -> bool:
        if settings.timeout and settings.timeout > 0:
            timer = threading.Timer(settings.timeout, self._timed_out,
                                    (item, settings.timeout))
            timer.daemon = True
            timer.start()
            item.stash[_TIMER] = timer
        return True

    @pytest.hookimpl(optionalhook=True)
    def pytest_timeout_cancel_timer(self, item: pytest.Item) -> bool:
        timer = item.stash.get(_TIMER, None)
        if timer is not None:
            timer.cancel()
            del item.stash[_TIMER]
        return True

    def _timed_out(self, item: pytest.Item, seconds: float) -> None:
        with self._uncaptured():
            self._report_timeout(item, seconds)
        MPI.COMM_WORLD.Abort(TIMED_OUT_EXIT)

    def _report_timeout(self, item: pytest.Item, seconds: float) -> None:
        sys.stderr.write(
            f"\n{'=' * 24} TIMEOUT {'=' * 24}\n"
            f"{item.nodeid} did not finish in {seconds:g} s on rank {self.rank} of "
            f"{self.size}: FAILED, the job is ended (MPI_Abort)\n"
            f"run it again: {self.reproduce(item)}\nthis rank's threads:\n")
        sys.stderr.flush()
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stderr.flush()
        # The launcher forwards output through its own pipes and kills the job at the abort:
        # on a loaded machine, the report above can still be in flight then and be lost.
        time.sleep(1.0)

    # -- the end ------------------------------------------------------------------------
    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        self.total_checks = self.comm.allreduce(self.checks)
        report = os.environ.get("FASTREDUCE_SESSION_REPORT")
        if report and self.rank == 0:  # for tests/support/sessions.py: the session ran
            Path(report).write_text(json.dumps({
                "exitstatus": int(exitstatus), "cases": self.cases,
                "checks": self.total_checks, "ranks": self.size, "profile": self.profile}))

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if self.rank == 0 and not self.config.getoption("mpi_sessions"):
            terminalreporter.write_line(
                f"mpi: {self.total_checks} checks in {self.cases} cases on {self.size} "
                f"rank(s), profile {self.profile!r}")


def _skip_reason(report) -> str:
    longrepr = report.longrepr
    return longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)


def apply_profile(name: str) -> None:
    """Set the profile's variables (and clear the others) and load what it loads, before
    fastreduce is imported."""
    env = profiles.environment(name)
    for variable in profiles.CLEARED:
        os.environ.pop(variable, None)
    os.environ.update(env)
    profiles.prepare(name)


# -- the plugin's hooks and fixtures, imported by the conftest.py of each folder of cases --

def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("mpi", "multi-rank cases (tests/support/mpi_harness.py)")
    group.addoption("--profile", default="default",
                    help="the environment of this session (tests/support/profiles.py); "
                         "cases of other profiles are deselected")
    group.addoption("--any-size", action="store_true",
                    help="run the selected cases on this many ranks whatever rank counts "
                         "they are marked for (e.g. under another launcher's task count)")
    group.addoption("--mpi-sessions", action="store_true",
                    help="print the [ranks, profile] sessions the collected cases need, "
                         "as JSON, and exit")


def pytest_configure(config: pytest.Config) -> None:
    apply_profile(config.getoption("profile"))
    config.pluginmanager.register(MPIHarness(config), "mpi_harness")


@pytest.fixture
def checks() -> Checks:
    """Soft checks: a failure is recorded and the case goes on to its next collective; the
    case fails after it returns, on every rank, with each rank's failures."""
    return Checks()


@pytest.fixture(scope="session")
def comm() -> MPI.Intracomm:
    """MPI.COMM_WORLD: every rank of the session."""
    return MPI.COMM_WORLD


@pytest.fixture
def shared_tmp_path():
    """A new directory every rank sees (made by rank 0, removed after the case; the nodes of
    a test cluster share this machine's file system)."""
    import shutil
    import tempfile

    world = MPI.COMM_WORLD
    path = Path(world.bcast(tempfile.mkdtemp(prefix="fastreduce-case-")
                            if world.rank == 0 else None))
    yield path
    world.Barrier()
    if world.rank == 0:
        shutil.rmtree(path, ignore_errors=True)
