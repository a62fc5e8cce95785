"""What the conformance tools share: an outside test file run unchanged on every rank of
one MPI job (all ranks run the same tests in the same order, under pytest), each rank's
outcome of each test recorded as it ends, a hung test ended by a per-test timeout and the
job started again with the tests not yet run, so one hang costs one test.

Used by tools/horovod_conformance.py (Horovod's torch tests) and
tools/torch_conformance.py (PyTorch's distributed_test.py); not a module of the package.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

# The pytest plugin, written as conftest.py beside the test file: it records, per rank,
# each test as it starts and its outcome as it ends (a killed job keeps what it wrote),
# and deselects the tests already run.
PLUGIN = '''
import json, os, sys
import pytest

_RANK = int(os.environ.get("OMPI_COMM_WORLD_RANK") or os.environ.get("PMI_RANK") or 0)
_LOG = open(os.path.join(os.environ["CONFORMANCE_OUT"], f"rank{_RANK}.jsonl"), "a", 1)
_DONE = set(json.load(open(os.environ["CONFORMANCE_DONE"])))


def pytest_collection_modifyitems(config, items):
    keep = [item for item in items if item.nodeid not in _DONE]
    config.hook.pytest_deselected(items=[i for i in items if i.nodeid in _DONE])
    items[:] = keep


def pytest_runtest_logstart(nodeid, location):
    _LOG.write(json.dumps({"test": nodeid, "event": "start"}) + "\\n")


def pytest_runtest_logreport(report):
    if report.when == "call" or report.outcome != "passed":
        if report.when != "call" and report.outcome == "passed":
            return
        message = ""
        if report.outcome != "passed":
            text = str(report.longrepr) if report.longrepr is not None else ""
            if report.skipped and isinstance(report.longrepr, tuple):
                text = report.longrepr[2]
            errors = [line[1:].strip() for line in text.splitlines() if line.startswith("E ")]
            tail = text.strip().splitlines()
            message = (errors[0] if errors else tail[-1] if tail else "")[:300]
        _LOG.write(json.dumps({"test": report.nodeid, "event": report.outcome,
                               "when": report.when, "message": message}) + "\\n")
'''


def mpiexec_command(ranks: int) -> list[str]:
    """mpiexec beside this interpreter, with what Open MPI needs to run as root and
    oversubscribed."""
    mpiexec = Path(sys.executable).parent / "mpiexec"
    command = [str(mpiexec if mpiexec.exists() else shutil.which("mpiexec") or "mpiexec")]
    version = subprocess.run([command[0], "--version"], capture_output=True, text=True).stdout
    if "Open MPI" in version or "PRRTE" in version:
        command += ["--oversubscribe", "--allow-run-as-root"]
    return command + ["-n", str(ranks)]


def read_logs(out: Path, ranks: int) -> dict[str, dict[int, dict]]:
    """test -> rank -> its last record ("start" alone: it never ended on that rank)."""
    results: dict[str, dict[int, dict]] = {}
    for rank in range(ranks):
        path = out / f"rank{rank}.jsonl"
        if not path.exists():
            continue
        for line in path.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:  # the last line of a rank that was killed
                continue
            per_rank = results.setdefault(record["test"], {})
            if record["event"] == "start" or per_rank.get(rank, {}).get("event") in (
                    None, "start", "passed"):
                per_rank[rank] = record
    return results


def finished(per_rank: dict[int, dict], rank: int) -> bool:
    """Whether `rank` recorded an outcome of the test (not only its start)."""
    return per_rank.get(rank, {}).get("event", "start") != "start"


def run(root: Path, tests: str, ranks: int, timeout: float, select: list[str],
        job_timeout: float = 3600, env: dict | None = None, hint: str = "") -> dict:
    """Every test of the file `tests` (relative to root, where conftest.py is PLUGIN) on
    `ranks` ranks, jobs restarted after a hang; test -> outcome. env: added to the job's
    environment; hint: what to say when a job runs no test at all."""
    out = root / f"out-{ranks}"
    out.mkdir()
    done_file = out / "done.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(root / "shim"), os.environ.get("PYTHONPATH", "")]),
        "CONFORMANCE_OUT": str(out), "CONFORMANCE_DONE": str(done_file),
        "PYTHONUNBUFFERED": "1", "OMPI_MCA_mpi_yield_when_idle": "1", **(env or {})}
    ended: dict[str, str] = {}  # test -> why the job ended in it (a hang or a crash)
    while True:
        results = read_logs(out, ranks)
        done = [t for t, per_rank in results.items()
                if t in ended or all(finished(per_rank, r) for r in range(ranks))]
        done_file.write_text(json.dumps(done))
        command = [*mpiexec_command(ranks), sys.executable, "-m", "pytest", "-q",
                   "-p", "no:cacheprovider", "-o", f"timeout={timeout}",
                   "-o", "timeout_method=thread", tests, *select]
        started = time.monotonic()
        try:  # a hang outside any test (collection, exit) ends at the job's limit
            proc = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True,
                                  timeout=job_timeout)
        except subprocess.TimeoutExpired as exc:
            stdout, stderr = (t.decode(errors="replace") if isinstance(t, bytes) else t or ""
                              for t in (exc.stdout, exc.stderr))
            proc = subprocess.CompletedProcess(command, 124, stdout, f"{stderr}\nTimeout: the "
                                               f"job ran past {job_timeout:.0f} s")
        results = read_logs(out, ranks)
        unfinished = [t for t, per_rank in results.items() if t not in ended
                      and not all(finished(per_rank, r) for r in range(ranks))]
        if not unfinished:
            if proc.returncode not in (0, 1, 5) or not results:  # 5: none left to run
                sys.exit(f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}\nconformance: the job "
                         f"on {ranks} ranks ran no test (exit {proc.returncode}); its "
                         f"output is above. {hint}")
            break
        test = unfinished[0]  # the earliest, in rank 0's order
        how = "hung" if "Timeout" in proc.stdout + proc.stderr else "ended the job"
        ended[test] = (f"{how}: the job ended after {time.monotonic() - started:.0f} s "
                       f"(exit {proc.returncode}); ranks that did not finish it: "
                       + ", ".join(str(r) for r in range(ranks)
                                   if not finished(results[test], r))
                       + "".join(f"; rank {r}: {e['event']} {e.get('message', '')}"
                                 for r, e in sorted(results[test].items())
                                 if finished(results[test], r)))
        print(f"  {ranks} ranks: {test}: {ended[test]}", file=sys.stderr)
    outcomes = {}
    for test, per_rank in sorted(read_logs(out, ranks).items()):
        events = {r: per_rank.get(r, {"event": "not run"}) for r in range(ranks)}
        if test in ended:
            outcome, message = "hung", ended[test]
        elif all(e["event"] == "passed" for e in events.values()):
            outcome, message = "passed", ""
        elif all(e["event"] == "skipped" for e in events.values()):
            outcome, message = "skipped", events[0]["message"]
        else:
            bad = {r: e for r, e in events.items() if e["event"] not in ("passed", "skipped")}
            outcome = "failed"
            message = "; ".join(f"rank {r}: {e['event']} {e.get('message', '')}".strip()
                                for r, e in bad.items())
        outcomes[test.split("::")[-1]] = {"outcome": outcome, "message": message}
    return outcomes


def summary(outcomes: dict) -> str:
    """One line of counts: passed, failed, skipped, hung."""
    counts = {k: sum(o["outcome"] == k for o in outcomes.values())
              for k in ("passed", "failed", "skipped", "hung")}
    return f"{len(outcomes)} tests: " + ", ".join(f"{n} {k}" for k, n in counts.items())


def print_report(ranks: int, outcomes: dict) -> None:
    """The counts, then each test that did not pass with the first line of its error."""
    print(f"\n{ranks} ranks: {summary(outcomes)}")
    for name, o in outcomes.items():
        if o["outcome"] != "passed":
            print(f"  {o['outcome']:7} {name}: {o['message'][:200]}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options every conformance tool takes."""
    parser.add_argument("--ranks", default="2,3", help="rank counts, e.g. 2,3 (default)")
    parser.add_argument("--timeout", type=float, default=120, help="seconds per test")
    parser.add_argument("--job-timeout", type=float, default=3600,
                        help="seconds per MPI job (a hang outside any test)")
    parser.add_argument("--json", type=Path, help="write every outcome here")
    parser.add_argument("-k", help="pytest -k expression: only these tests")


def run_all(root: Path, tests: str, args, env_for=lambda ranks: {}, hint: str = "") -> int:
    """The tests on each rank count of args.ranks (env_for(ranks): the job's added
    environment), each count's report printed, --json written, root removed; 0."""
    select = ["-k", args.k] if args.k else []
    report = {}
    for ranks in (int(n) for n in args.ranks.split(",")):
        outcomes = run(root, tests, ranks, args.timeout, select, args.job_timeout,
                       env=env_for(ranks), hint=hint)
        report[ranks] = outcomes
        print_report(ranks, outcomes)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    shutil.rmtree(root, ignore_errors=True)
    return 0
