"""The bucket engine's choice of schedule (fastreduce.torch.buckets: calibration_plan, choose
and _Chooser), as pure logic: a fake clock advances by each step's scripted time, in the
schedule and serial form the chooser gave that step, and `total` stands for the sum over
2 ranks (each rank's median doubled).

The step times are the ones measured on this project's VM, 2026-11-27, a 9.5M-parameter
MLP (9 gradients of 4 MiB): across 2 nodes x 1 rank over a 1 Gbit/s link on Open MPI,
overlap took 668 ms a step, the serial schedule in place (one call per large gradient,
each at about half the link on Open MPI's TCP transport) 707 ms and the flat form (one
call of all the gradients, the serial schedule done by hand) 564 ms; choosing between
overlap and in place only, auto kept overlap, 1.19x the flat step. On one node (2 ranks,
shared memory, 25.2M parameters) in place took 419 ms, flat 426 (the copies) and overlap
420.

Run in one child process (importing fastreduce initialises MPI, which a single-process run
must not do itself) on every case at once.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from mpirun import launcher_env

CHILD = """
import json, sys
from fastreduce.torch import buckets
from fastreduce.torch.buckets import CALIBRATION_STEPS, OVERLAP_MARGIN, _Chooser

results = {"constants": {"calibration_steps": CALIBRATION_STEPS, "margin": OVERLAP_MARGIN,
                         "forms": list(buckets.SERIAL_FORMS)}}
for name, case in json.load(sys.stdin).items():
    if case.get("choose"):
        overlap, forms = case["choose"]
        results[name] = list(buckets.choose(overlap, forms))
        continue
    now = [0.0]
    totals = []
    def total(t):
        totals.append(t.tolist())
        return t * 2
    chooser = _Chooser(case["schedule"], total, forms=tuple(case["forms"]),
                       clock=lambda: now[0])
    times = {kind: list(ts) for kind, ts in case["times"].items()}
    used = {kind: 0 for kind in times}
    steps = []
    for _ in range(case["steps"]):
        kind = "overlap" if chooser.mode == "overlap" else chooser.form
        ts = times[kind]
        now[0] += ts[used[kind] % len(ts)]
        used[kind] += 1
        steps.append([chooser.mode, chooser.form])
        decided_before = chooser.decided
        chooser.step_ended()
        if chooser.decided and not decided_before:
            steps[-1].append("decided")
    results[name] = {"steps": steps, "mode": chooser.mode, "form": chooser.form,
                     "decided": chooser.decided, "measured": chooser.measured,
                     "serial_forms": chooser.serial_forms, "totals": totals,
                     "samples": chooser.samples}
json.dump(results, sys.stdout)
"""

BOTH = ["in place", "flat"]
ACROSS = {"overlap": [0.668], "in place": [0.707], "flat": [0.564]}  # Open MPI, 2 nodes
ONE_NODE = {"overlap": [0.420], "in place": [0.419], "flat": [0.426]}
STEPS = 40  # more than any calibration

CASES = {
    "across-nodes": {"schedule": "auto", "forms": BOTH, "times": ACROSS, "steps": STEPS},
    "one-node": {"schedule": "auto", "forms": BOTH, "times": ONE_NODE, "steps": STEPS},
    # slow first steps (connections set up, buffers touched first): the warm-up step (an
    # overlap step), then the first step of each serial form
    "slow-first-steps": {"schedule": "auto", "forms": BOTH, "steps": STEPS, "times": {
        "overlap": [1.9] + [0.668] * 6,
        "in place": [2.1, 0.707, 0.707], "flat": [2.0, 0.564, 0.564]}},
    # Open MPI's flat call is bimodal (the link's rate, or about 1.4x that): any 2 of 3
    "flat-bimodal": {"schedule": "auto", "forms": BOTH, "steps": STEPS, "times": {
        "overlap": [0.668], "in place": [0.707], "flat": [0.450, 0.600, 0.480]}},
    "overlap-clearly-faster": {"schedule": "auto", "forms": BOTH, "steps": STEPS,
                               "times": {"overlap": [0.40], "in place": [0.50],
                                         "flat": [0.48]}},
    "overlap-within-margin": {"schedule": "auto", "forms": BOTH, "steps": STEPS,
                              "times": {"overlap": [0.55], "in place": [0.60],
                                        "flat": [0.56]}},
    "fixed-serial": {"schedule": "serial", "forms": BOTH, "times": ACROSS, "steps": STEPS},
    "fixed-serial-one-form": {"schedule": "serial", "forms": ["in place"], "times": ACROSS,
                              "steps": 5},
    "fixed-overlap": {"schedule": "overlap", "forms": BOTH, "times": ACROSS, "steps": 5},
    # DDP's buckets (RecurringBuckets): one way to reduce at once
    "one-serial-form": {"schedule": "auto", "forms": ["serial"], "steps": STEPS,
                        "times": {"overlap": [0.668], "serial": [0.564]}},
    "choose-tie": {"choose": [None, {"in place": 0.5, "flat": 0.5}]},
    "choose-overlap-by-margin": {"choose": [0.96, {"in place": 1.0, "flat": 1.2}]},
    "choose-overlap-not-by-margin": {"choose": [0.98, {"in place": 1.2, "flat": 1.0}]},
}


@pytest.fixture(scope="module")
def results() -> dict:
    """Every case, run in one child process."""
    proc = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True,
                          env=launcher_env(), timeout=300, input=json.dumps(CASES))
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def calibration(result: dict) -> list[list]:
    """The (schedule, form) of each step up to the one after which the chooser decided."""
    steps = result["steps"]
    end = next(i for i, s in enumerate(steps) if s[-1] == "decided")
    return [s[:2] for s in steps[:end + 1]]


def test_across_nodes_the_flat_serial_form_wins(results):
    """The skew measured: both schedules that auto used to choose between lose to one flat
    call; with the flat form timed too, auto keeps serial, flat (not overlap, which would
    have won against the in-place form alone)."""
    r = results["across-nodes"]
    assert (r["mode"], r["form"]) == ("serial", "flat")
    assert r["measured"] == pytest.approx({"overlap": 1.336, "serial": 1.128})
    assert r["serial_forms"] == pytest.approx({"in place": 1.414, "flat": 1.128})
    # what the old rule saw: overlap faster than in place by more than the margin
    assert 0.668 < (1 - results["constants"]["margin"]) * 0.707


def test_one_node_keeps_the_in_place_form(results):
    r = results["one-node"]
    assert (r["mode"], r["form"]) == ("serial", "in place")
    assert r["measured"] == pytest.approx({"overlap": 0.840, "serial": 0.838})


def test_the_calibration_plan(results):
    """After one warm-up step, CALIBRATION_STEPS of each schedule, serial first, in turns;
    the serial steps take the forms in turns, each after an overlap step; then the ranks'
    medians are added up once (one reduction of one value per kind) and the choice holds."""
    c = results["constants"]["calibration_steps"]
    assert c % 2 == 0 and c >= 6, "each serial form needs 3 samples or more"
    r = results["across-nodes"]
    plan = calibration(r)
    assert len(plan) == 1 + 2 * c
    assert plan[0][0] == "overlap"  # the warm-up step
    timed = plan[1:]
    assert [m for m, _ in timed] == ["serial", "overlap"] * c
    assert [f for m, f in timed if m == "serial"] == ["in place", "flat"] * (c // 2)
    assert {k: len(v) for k, v in r["samples"].items()} == {
        "overlap": c, "in place": c // 2, "flat": c // 2}
    assert len(r["totals"]) == 1 and len(r["totals"][0]) == 3
    assert all(s[:2] == ["serial", "flat"] for s in r["steps"][1 + 2 * c:])


def test_slow_first_steps_do_not_decide(results):
    """A slow first sample of each kind (e.g. connections set up) is outvoted by the
    median; the warm-up step itself is never a sample."""
    r = results["slow-first-steps"]
    assert (r["mode"], r["form"]) == ("serial", "flat")
    assert r["serial_forms"] == pytest.approx({"in place": 1.414, "flat": 1.128})


def test_a_bimodal_flat_form(results):
    r = results["flat-bimodal"]
    assert (r["mode"], r["form"]) == ("serial", "flat")
    assert r["serial_forms"]["flat"] == pytest.approx(0.96)


def test_overlap_kept_only_when_faster_than_the_best_serial_form(results):
    r = results["overlap-clearly-faster"]
    assert (r["mode"], r["form"]) == ("overlap", "flat")
    assert r["measured"] == pytest.approx({"overlap": 0.80, "serial": 0.96})
    # 3% faster than in place, not than flat: serial, flat
    r = results["overlap-within-margin"]
    assert (r["mode"], r["form"]) == ("serial", "flat")


def test_fixed_schedules(results):
    """A fixed serial schedule times its forms only (C steps, in turns) and reports them
    apart: `measured` stays empty, as for every fixed schedule. A fixed overlap, or serial
    with one form, decides nothing and reduces nothing."""
    c = results["constants"]["calibration_steps"]
    r = results["fixed-serial"]
    plan = calibration(r)
    assert len(plan) == 1 + c
    assert all(s[0] == "serial" for s in r["steps"])
    assert [f for _, f in plan] == ["in place"] + ["in place", "flat"] * (c // 2)
    assert (r["mode"], r["form"], r["measured"]) == ("serial", "flat", {})
    assert r["serial_forms"] == pytest.approx({"in place": 1.414, "flat": 1.128})
    for name, mode in (("fixed-serial-one-form", "serial"), ("fixed-overlap", "overlap")):
        r = results[name]
        assert r["decided"] and r["totals"] == [] and r["measured"] == {}, name
        assert all(s == [mode, "in place"] for s in r["steps"]), (name, r["steps"])


def test_one_serial_form(results):
    """DDP's buckets: overlap against the one serial form, CALIBRATION_STEPS of each."""
    c = results["constants"]["calibration_steps"]
    r = results["one-serial-form"]
    assert len(calibration(r)) == 1 + 2 * c
    assert set(r["measured"]) == {"overlap", "serial"} and r["serial_forms"] == {}
    assert (r["mode"], r["form"]) == ("serial", "serial")


def test_choose(results):
    assert results["choose-tie"] == ["serial", "in place"]
    assert results["choose-overlap-by-margin"] == ["overlap", "in place"]
    assert results["choose-overlap-not-by-margin"] == ["serial", "flat"]
