"""Run every multi-rank session tests/mpi needs: one `mpiexec -n N python -m pytest
tests/mpi --profile P` per (rank count, profile) that some selected case asks for.

    python tests/support/sessions.py                   every session, on this host
    python tests/support/sessions.py -- -k engine -x   pytest arguments after --
    python tests/support/sessions.py --ranks 3 --profile fakecuda
    python tests/support/sessions.py --nodes 2         the cases marked across_nodes, on a
                                                       cluster of 2 nodes (root; 4 ranks)

The sessions are found by collecting tests/mpi once (`--mpi-sessions`); each one streams
its output, and a table of every session's time and exit status ends the run. The exit
status is 0 only if every session passed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SUPPORT = Path(__file__).resolve().parent
ROOT = SUPPORT.parents[1]
sys.path.insert(0, str(SUPPORT))

import mpirun  # noqa: E402  (after the path above)

# Across nodes, the rank counts each cluster runs unless --ranks says: 2 nodes x 2 ranks
# (communicators within a node and across); on 3 nodes, one rank a node (every byte over
# the network). `--nodes 2 --ranks 3` gives nodes of 2 and 1 ranks.
ACROSS_NODES = {2: (4,), 3: (3,)}
SESSION_GUARD = 3600.0  # seconds; each case has its own, shorter timeout
LAUNCH_FAILURE_SECONDS = 10.0  # a job that ends sooner without a pytest report did not start


def names_paths(pytest_args: list[str]) -> bool:
    """Whether the arguments name files or cases of tests/mpi."""
    return any(a.split("::")[0].startswith("tests/mpi") for a in pytest_args)


def with_paths(pytest_args: list[str]) -> list[str]:
    """The arguments, with tests/mpi first unless they name files or cases of it."""
    return pytest_args if names_paths(pytest_args) else ["tests/mpi", *pytest_args]


def needed_sessions(pytest_args: list[str],
                    env: dict[str, str]) -> list[tuple[int, str, list[str]]]:
    """(ranks, profile, the files that hold its cases) of the cases the arguments select."""
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                           "--mpi-sessions", "-p", "no:cacheprovider", *pytest_args],
                          cwd=ROOT, capture_output=True, text=True, env=env, timeout=600)
    lines = [line for line in done.stdout.splitlines() if line.startswith("[")]
    if done.returncode != 0 or not lines:
        sys.exit(f"sessions.py: collecting tests/mpi failed:\n{done.stdout}\n{done.stderr}")
    return [(n, p, files) for n, p, files in json.loads(lines[-1])]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=lambda s: [int(n) for n in s.split(",")],
                        help="only these rank counts (comma-separated)")
    parser.add_argument("--profile", action="append", help="only this profile (repeatable)")
    parser.add_argument("--nodes", type=int, default=0,
                        help="run the across_nodes cases on a cluster of this many nodes")
    parser.add_argument("pytest_args", nargs="*", help="for pytest (after --)")
    args = parser.parse_args()

    env = mpirun.launcher_env()
    # Unless the arguments name files, each session collects only the files that hold its
    # cases: every rank imports and collects what it is given (some 5 s of CPU a rank).
    own_files = not names_paths(list(args.pytest_args))
    pytest_args = with_paths(list(args.pytest_args))
    if args.nodes:  # the across_nodes cases (and those any -m given selects)
        expression = "across_nodes"
        if "-m" in pytest_args:
            at = pytest_args.index("-m")
            expression = f"({pytest_args[at + 1]}) and across_nodes"
            del pytest_args[at:at + 2]
        pytest_args = ["-m", expression, *pytest_args]
    if args.ranks and args.profile and not args.nodes and not own_files:
        # rank counts, profiles and files all given: the sessions are known without
        # collecting (5 s: every test module imported once more); one whose files hold no
        # case of its size and profile ends with pytest's exit status 5
        sessions = [(n, p, []) for n in args.ranks for p in args.profile]
    else:
        sessions = needed_sessions(pytest_args, env)
    if args.nodes and not args.ranks:
        sessions = [s for s in sessions if s[0] in ACROSS_NODES[args.nodes]]
    if args.ranks:
        sessions = [s for s in sessions if s[0] in args.ranks]
    if args.profile:
        sessions = [s for s in sessions if s[1] in args.profile]
    if not sessions:
        print("sessions.py: no case selected", file=sys.stderr)
        return 5

    cluster = None
    if args.nodes:
        os.environ["FASTREDUCE_TEST_NODES"] = str(args.nodes)
        env["FASTREDUCE_TEST_NODES"] = str(args.nodes)
        cluster = mpirun.cluster_up(args.nodes)
    results = []
    try:
        for ranks, profile, files in sessions:
            where = f" across {args.nodes} nodes" if args.nodes else ""
            print(f"=== {ranks} rank(s), profile {profile}{where} ===", flush=True)
            paths = ([*files, *(a for a in pytest_args if a != "tests/mpi")] if own_files
                     else pytest_args)
            command = [sys.executable, "-m", "pytest", "--profile", profile,
                       "-p", "no:cacheprovider", *paths]
            report = Path(tempfile.mkdtemp()) / "report.json"
            for attempt in (1, 2):
                start = time.monotonic()
                rc = mpirun.stream_mpi(ranks, command, env={
                    **env, "FASTREDUCE_SESSION_REPORT": str(report)}, cwd=ROOT,
                    timeout=SESSION_GUARD)
                seconds = time.monotonic() - start
                # a launcher that fails to start (Open MPI's PMIx listener, now and then
                # on a loaded machine) ends the job at once: start it once more
                if report.exists() or seconds > LAUNCH_FAILURE_SECONDS or attempt == 2:
                    break
                print(f"=== {ranks} rank(s), profile {profile}: the job ended after "
                      f"{seconds:.1f} s without starting pytest; starting it again ===",
                      flush=True)
            if not report.exists():  # the job never ran pytest to its end
                print(f"=== {ranks} rank(s), profile {profile}: no pytest session finished "
                      f"(the job did not start, or a rank died) ===", flush=True)
                rc = rc or 1
            shutil.rmtree(report.parent, ignore_errors=True)
            results.append((ranks, profile, rc, seconds))
    finally:
        if cluster is not None:
            cluster.__exit__(None, None, None)
    print("=== sessions ===")
    for ranks, profile, rc, seconds in results:
        state = ("passed" if rc == 0 else "FAILED (exit 5: no case selected)" if rc == 5
                 else f"FAILED (exit {rc})")
        print(f"  {ranks:>2} rank(s)  {profile:<22} {seconds:7.1f} s  {state}")
    failed = sum(rc != 0 for *_, rc, _ in results)
    print(f"{len(results) - failed} passed, {failed} failed")
    if results and all(rc == 5 for *_, rc, _ in results):
        return 5  # nothing selected anywhere, as pytest says it
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
