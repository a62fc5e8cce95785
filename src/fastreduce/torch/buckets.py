"""The bucket engine: data-parallel gradients in flat buffers, reduced while backward runs
or after it, whichever the ranks measured to be faster.

`fastreduce.GradientSync` and `hvd.DistributedOptimizer` are built on it; each passes its
`Reduction` (how a bucket's reduction is submitted and finished: fastreduce's iallreduce_,
or Horovod's negotiated one with its compression and scale factors) and keeps only its own
arguments and errors. The engine owns the rest:

- **Layout**: one flat buffer per dtype and device holding every trained parameter's
  gradient (each .grad is a view into it); a bucket is a contiguous slice of it.
- **Readiness**: a post-accumulate hook per parameter counts its backward passes; a bucket
  is ready when its last parameter's last pass has been accumulated.
- **Schedule**: ``overlap`` starts each bucket's non-blocking reduction as soon as it and
  every bucket before it are ready (the order is the same on every rank); ``serial``
  reduces everything after backward, which nothing beats where backward and the reduction
  compete for the same cores (one core per rank).
- **Serial forms**: the serial schedule calls MPI in one of two ways (SERIAL_FORMS):
  ``in place``, each gradient of DIRECT_BYTES and more where autograd left it (no copy),
  one call each, the smaller ones in one flat buffer of their own; or ``flat``, every
  gradient copied into its kind's flat buffer as it arrives (as overlap does) and that
  buffer reduced in one call. Which costs less is the network's and the MPI library's
  business, not the model's: on one node the two are within about 2% of a step (the
  copies against the calls); across nodes on Open MPI's TCP transport a call of 4 MiB
  moves about half the link, one call of all the gradients more, and the flat form's
  step is 1.25x faster (docs/benchmarks.md).
- **Calibration** (``auto``, pure logic in `_Chooser`, `calibration_plan` and `choose`):
  on the training loop's own steps, after a first step (warm-up, the buckets rebuilt),
  CALIBRATION_STEPS steps of each schedule in turns, serial first, the serial steps
  taking its forms in turns (each form's steps follow an overlap step alike); the ranks add
  up their medians (one small reduction); the serial form with the lower time is kept,
  and overlap only if it is faster than that form by more than OVERLAP_MARGIN (serial is
  the safe choice). A fixed ``serial`` schedule times its forms alone (CALIBRATION_STEPS
  steps, in turns) and keeps the faster.
- **Order**: after the first step, the buckets are rebuilt in the order the gradients
  arrived on rank 0 (DDP does the same), so the first bucket reduced is the first complete.
- **Timeline**: each bucket's phases per step (filling, queued, reducing, done) as a Chrome
  trace, cheap enough to leave on.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .. import settings
from ..timeline import Trace, now_us

__all__ = ["CALIBRATION_STEPS", "DIRECT_BYTES", "LAST_BUCKET_BYTES", "OVERLAP_MARGIN",
           "SCHEDULES", "SERIAL_FORMS", "Bucket", "BucketEngine",
           "RecurringBuckets", "Reduction", "calibration_plan", "choose", "plan_buckets"]

SCHEDULES = ("auto", "overlap", "serial")
# How the serial schedule calls MPI: large gradients in place, one call each, or every
# gradient of a kind in one flat buffer, one call (see the module's docstring).
SERIAL_FORMS = ("in place", "flat")
# Steps timed per schedule by "auto" (the serial schedule's shared by its forms), after one
# warm-up step: 1 + 2 * CALIBRATION_STEPS steps in all.
CALIBRATION_STEPS = 6
OVERLAP_MARGIN = 0.03  # overlap is kept only if it is this much faster than serial
# The serial schedule's in-place form reduces gradients of at least this size where
# autograd left them, one call each (no copy into a flat buffer).
DIRECT_BYTES = 1 << 20
# The last bucket's size: its reduction is what remains to do once backward has ended.
LAST_BUCKET_BYTES = 1 << 20


def plan_buckets(params: list, bucket_bytes: int,
                 last_bytes: int = LAST_BUCKET_BYTES) -> list[list]:
    """Parameters grouped into buckets of one dtype and device, filled in reverse
    registration order (DDP's), in the order their gradients complete; the last one, whose
    reduction is left when backward ends, at most `last_bytes` (or one parameter).
    Decided from the order and sizes alone, so every rank makes the same buckets."""
    last, size = [], 0
    for p in params:  # the first registered are the last whose gradients arrive
        nbytes = p.numel() * p.element_size()
        if last and (size + nbytes > min(last_bytes, bucket_bytes)
                     or p.dtype != last[0].dtype or p.device != last[0].device):
            break
        last.append(p)
        size += nbytes
    if len(last) == len(params):
        last = []
    buckets, current, size = [], [], 0
    for p in reversed(params[len(last):]):
        nbytes = p.numel() * p.element_size()
        same_kind = not current or (p.dtype == current[0].dtype
                                    and p.device == current[0].device)
        if current and (size + nbytes > bucket_bytes or not same_kind):
            buckets.append(current)
            current, size = [], 0
        current.append(p)
        size += nbytes
    if current:
        buckets.append(current)
    if last:
        buckets.append(last[::-1])
    return buckets


class Bucket:
    """Parameters whose gradients are reduced together: a slice `flat` of their kind's flat
    buffer, and a view of it shaped like each parameter."""

    __slots__ = ("label", "params", "flat", "views", "nready", "request", "sent", "ctx",
                 "times")

    def __init__(self, label: str, params: list, flat: torch.Tensor, views: list):
        self.label = label
        self.params = params
        self.flat = flat
        self.views = views
        self.nready = 0      # parameters whose last pass has been accumulated
        self.request = None  # the reduction in flight
        self.sent = None     # what the Reduction sent (flat, or its compressed form)
        self.ctx = None      # the Reduction's own state for finish()
        self.times = [0.0, 0.0, 0.0, 0.0, 0.0]  # first gradient, ready, started, reduced, done


@dataclass
class Reduction:
    """How a bucket is reduced: `start(bucket)` submits the reduction of bucket.flat and
    returns its request (wait(), test(), done, add_done_callback()); `finish(bucket)`, once
    it has completed, leaves the result in bucket.flat; `sum(values)`, a blocking sum over
    the ranks of a float64 tensor; `bcast(obj)`, rank 0's picklable object (None: the
    buckets are never rebuilt); `run(bucket)`, where given, the same reduction blocking,
    which the serial schedule uses for host buffers."""

    start: Callable[[Bucket], object]
    finish: Callable[[Bucket], None]
    sum: Callable[[torch.Tensor], torch.Tensor]
    bcast: Callable[[object], object] | None = None
    run: Callable[[Bucket], None] | None = None


class _Completed:
    """The request of a reduction that ran blocking."""

    done = True

    def wait(self) -> None:
        pass

    def test(self) -> bool:
        return True

    def add_done_callback(self, fn: Callable[[object], object]) -> None:
        fn(self)


_COMPLETED = _Completed()


def schedule_setting() -> str:
    """FASTREDUCE_GRADIENT_SCHEDULE: auto, overlap or serial."""
    return settings.value("FASTREDUCE_GRADIENT_SCHEDULE")


def check_schedule(schedule: str | None, owner: str) -> str:
    """The schedule asked for (None: the setting), or ValueError naming the choices."""
    if schedule is None:
        return schedule_setting()
    if schedule not in SCHEDULES:
        raise ValueError(f"fastreduce: {owner} schedule={schedule!r}: use 'auto' (measured), "
                         f"'overlap' (reduce buckets during backward) or 'serial' (one "
                         f"reduction after backward)")
    return schedule


def calibration_plan(schedule: str, forms: tuple[str, ...]) -> list[tuple[str, str]]:
    """The (schedule, serial form) of each timed step after the warm-up step: for "auto",
    serial and overlap in turns, serial first, CALIBRATION_STEPS of each, the serial steps
    taking `forms` in turns (so each form's steps follow an overlap step alike); for a
    fixed "serial" with several forms, CALIBRATION_STEPS steps taking them in turns;
    otherwise nothing to time."""
    if schedule == "auto":
        return [("serial", forms[(k // 2) % len(forms)]) if k % 2 else ("overlap", forms[0])
                for k in range(1, 2 * CALIBRATION_STEPS + 1)]
    if schedule == "serial" and len(forms) > 1:
        return [("serial", forms[k % len(forms)]) for k in range(CALIBRATION_STEPS)]
    return []


def choose(overlap: float | None, forms: dict[str, float]) -> tuple[str, str]:
    """The (schedule, serial form) kept from the median step times summed over the ranks:
    the serial form with the lowest time (the first listed on a tie), and overlap (None: not
    timed) only if it is faster than that form by more than OVERLAP_MARGIN."""
    form = min(forms, key=forms.__getitem__)
    if overlap is not None and overlap < (1 - OVERLAP_MARGIN) * forms[form]:
        return "overlap", form
    return "serial", form


class _Chooser:
    """Which schedule, and which form of the serial schedule, each step uses: fixed, or the
    warm-up step, then the steps of `calibration_plan`, then what `choose` keeps from their
    medians summed over the ranks (`total`). Every rank counts the same steps, so every rank
    runs the same schedule and form in each step. A sample is the time from the end of one
    step to the end of the next (`clock`), so nothing between steps goes unmeasured."""

    def __init__(self, schedule: str, total: Callable[[torch.Tensor], torch.Tensor],
                 forms: tuple[str, ...] = ("serial",),
                 clock: Callable[[], float] = time.perf_counter):
        self._schedule = schedule
        self._total = total
        self._forms = tuple(forms)
        self._clock = clock
        self.restart()

    def restart(self) -> None:
        """Choose again from the first step (the ranks ran different numbers of steps)."""
        schedule = self._schedule
        self._plan = calibration_plan(schedule, self._forms)
        self.mode = "overlap" if schedule == "auto" else schedule
        self.form = self._forms[0]
        self.decided = not self._plan
        # the step times of each timed kind: "overlap", and each serial form by name
        self.samples: dict[str, list[float]] = {k: [] for k in self._kinds()}
        self.measured: dict[str, float] = {}  # "auto": overlap and serial (its kept form)
        self.serial_forms: dict[str, float] = {}  # each serial form's, where there are two
        self._step = 0
        self._last_end: float | None = None

    def _kinds(self) -> list[str]:
        return (["overlap"] if self._schedule == "auto" else []) + list(self._forms)

    def step_ended(self) -> None:
        end = self._clock()
        if not self.decided:
            if self._step > 0:  # the first step warms up (and rebuilds the buckets)
                kind = "overlap" if self.mode == "overlap" else self.form
                self.samples[kind].append(end - self._last_end)
            self._step += 1
            if self._step <= len(self._plan):
                self.mode, self.form = self._plan[self._step - 1]
            else:
                self._decide()
        self._last_end = self._clock()

    def _decide(self) -> None:
        kinds = self._kinds()
        mine = torch.tensor([statistics.median(self.samples[k]) for k in kinds],
                            dtype=torch.float64)
        totals = dict(zip(kinds, (float(v) for v in self._total(mine)), strict=True))
        overlap = totals.pop("overlap", None)
        self.mode, self.form = choose(overlap, totals)
        if overlap is not None:
            self.measured = {"overlap": overlap, "serial": totals[self.form]}
        if len(totals) > 1:
            self.serial_forms = totals
        self.decided = True


class RecurringBuckets:
    """The schedule of another reducer's buckets (DDP's, through the torch.distributed
    backend): each step reduces the same bucket buffers in the same order on every rank, so
    a step ends when a buffer comes round again."""

    def __init__(self, schedule: str, total: Callable[[torch.Tensor], torch.Tensor]):
        self.chooser = _Chooser(schedule, total)
        self._seen: set = set()

    def overlap(self, key) -> bool:
        """Whether the bucket `key` (its buffer's address and size) is reduced in the
        background (overlap) or at once (serial)."""
        if key in self._seen:
            self._seen.clear()
            self.chooser.step_ended()  # may agree with the other ranks: a collective
        self._seen.add(key)
        return self.chooser.mode == "overlap"


def _flat(params: list) -> tuple[torch.Tensor, list]:
    """A zeroed flat buffer for `params` (one dtype and device) and a view of it shaped
    like each parameter."""
    flat = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype,
                       device=params[0].device)
    views, offset = [], 0
    for p in params:
        views.append(flat[offset:offset + p.numel()].view_as(p))
        offset += p.numel()
    return flat, views


def _layout(groups: list[list]) -> tuple[list[Bucket], list[Bucket], list[Bucket]]:
    """Buckets for `groups` (each of one dtype and device), contiguous in one flat buffer per
    dtype and device in group order; and for the serial schedule, per dtype and device, a
    bucket of the parameters smaller than DIRECT_BYTES (its in-place form) and a bucket of
    the whole flat buffer (its flat form, sharing the buckets' views)."""
    kinds: dict = {}
    for group in groups:
        kinds.setdefault((group[0].dtype, group[0].device), []).append(group)
    spans: dict = {}
    smalls, wholes = [], []
    for k, kind_groups in enumerate(kinds.values()):
        params = [p for group in kind_groups for p in group]
        flat, views = _flat(params)
        wholes.append(Bucket(f"flat.{k}", params, flat, views))
        offset = 0
        for p, view in zip(params, views, strict=True):
            spans[p] = (flat, offset, view)
            offset += p.numel()
        small = [p for p in params if p.numel() * p.element_size() < DIRECT_BYTES]
        if small:
            smalls.append(Bucket(f"small.{k}", small, *_flat(small)))
    buckets = []
    for b, group in enumerate(groups):
        flat, start, _ = spans[group[0]]
        numel = sum(p.numel() for p in group)
        buckets.append(Bucket(f"bucket.{b}", group, flat[start:start + numel],
                              [spans[p][2] for p in group]))
    return buckets, smalls, wholes


class BucketEngine:
    """Gradients of `params` (trained parameters, registration order) reduced in the buckets
    `groups` (lists of parameters of one dtype and device, in the order they complete)."""

    def __init__(self, params: list, groups: list[list], reduction: Reduction, *,
                 schedule: str = "auto", passes: int = 1,
                 too_many: Callable[[], BaseException],
                 replan: Callable[[list], list[list]] | None = None,
                 trace: Callable[[], Trace | None] = lambda: None,
                 sparse_as_dense: bool = False):
        self.params = params
        self.reduction = reduction
        self.passes = passes
        self.too_many = too_many  # makes the error for a gradient that arrives too often
        self.replan = replan if reduction.bcast is not None else None
        self.trace = trace
        self.sparse_as_dense = sparse_as_dense
        # the serial schedule's forms differ only where some gradient is reduced in place
        large = any(p.numel() * p.element_size() >= DIRECT_BYTES for p in params)
        self.chooser = _Chooser(schedule, reduction.sum,
                                forms=SERIAL_FORMS if large else SERIAL_FORMS[:1])
        self.index = {p: i for i, p in enumerate(params)}
        self.sparse: dict = {}  # parameter -> registration index: sparse gradients this step
        self.arrivals: list[int] | None = [] if self.replan is not None else None
        self.accumulating = False  # no_sync(): gradients stay local
        self._set_layout(groups)
        self._new_step()
        self.hooks = [h for p in params for h in (
            p.register_hook(self._make_guard(p)),
            p.register_post_accumulate_grad_hook(self._on_grad))]

    @property
    def mode(self) -> str:
        """The schedule of the step under way: "overlap" or "serial"."""
        return self.chooser.mode

    @property
    def serial_form(self) -> str:
        """The serial schedule's form in the step under way: "in place" or "flat"."""
        return self.chooser.form

    def _new_step(self) -> None:
        """Nothing accumulated, nothing started: the state at the start of a step."""
        for bucket in self.buckets:
            bucket.nready = 0
        self.next = 0        # the next bucket to start (overlap)
        self.dirty = False   # a gradient arrived since the last finish_step()
        n = len(self.params)
        self.left = [self.passes] * n  # passes each parameter still takes this step
        self.fresh = [False] * n       # its view holds this step's gradient
        self.densified = [False] * n
        self.sparse.clear()

    def _set_layout(self, groups: list[list]) -> None:
        self.buckets, self.smalls, self.wholes = _layout(groups)
        self.where = {}
        for b, bucket in enumerate(self.buckets):
            for i, p in enumerate(bucket.params):
                self.where[p] = (b, i)
        self.small_view = {p: v for small in self.smalls
                           for p, v in zip(small.params, small.views, strict=True)}
        # the gradients the serial schedule reduces in place, in plan order (every rank's)
        self.direct = [p for bucket in self.buckets for p in bucket.params
                       if p not in self.small_view]

    @property
    def bucket_sizes(self) -> list[int]:
        """Number of parameters in each bucket, in the order the buckets are reduced."""
        return [len(b.params) for b in self.buckets]

    # -- during backward -------------------------------------------------------------------
    def _make_guard(self, p: torch.Tensor):
        index = self.index[p]

        def guard(grad: torch.Tensor) -> None:
            """Before a gradient is accumulated: refuse one pass too many."""
            if self.left[index] <= 0 and not self.accumulating:
                raise self.too_many()

        return guard

    def _on_grad(self, p: torch.Tensor) -> None:
        if self.accumulating:
            return
        self.dirty = True
        index = self.index[p]
        left = self.left[index] - 1
        self.left[index] = left
        b, i = self.where[p]
        bucket = self.buckets[b]
        grad = p.grad
        overlap = self.mode == "overlap"
        # overlap and the flat form gather every gradient in the buckets' views
        view = (bucket.views[i] if overlap or self.chooser.form == "flat"
                else self.small_view.get(p))
        if grad.is_sparse and not self.sparse_as_dense:  # the owner reduces it alone
            self.sparse[p] = index
        elif view is None:  # serial in place, a large gradient: reduced where it is
            if grad.is_sparse:
                self.densified[index] = True
                p.grad = grad.to_dense()
        elif grad is not view:  # the first pass since zero_grad(set_to_none=True)
            with torch.no_grad():
                if grad.is_sparse:
                    self.densified[index] = True
                    grad = grad.to_dense()
                view.copy_(grad)
            p.grad = view
        if p not in self.sparse:
            self.fresh[index] = True
        if left:
            return
        if bucket.nready == 0:
            bucket.times[0] = now_us()
        bucket.nready += 1
        if self.arrivals is not None:
            self.arrivals.append(index)
        if bucket.nready == len(bucket.params):
            bucket.times[1] = now_us()
        if overlap:
            buckets = self.buckets
            while self.next < len(buckets) and (
                    buckets[self.next].nready == len(buckets[self.next].params)):
                self._start(buckets[self.next])
                self.next += 1
            self._progress()

    def _start(self, bucket: Bucket, blocking: bool = False) -> None:
        fresh = self.fresh
        index = self.index
        with torch.no_grad():
            for p, view in zip(bucket.params, bucket.views, strict=True):
                if not fresh[index[p]]:  # no gradient this step: contribute zeros
                    view.zero_()
        bucket.times[2] = now_us()
        run = self.reduction.run
        if blocking and run is not None and bucket.flat.device.type == "cpu":
            # after backward, on the host: one blocking call each costs less than the
            # progress engine's hand-off (device buffers keep the pipelined staged path)
            run(bucket)
            bucket.request = request = _COMPLETED
        else:
            bucket.request = request = self.reduction.start(bucket)
        if self.trace() is not None:
            times = bucket.times
            request.add_done_callback(lambda _: times.__setitem__(3, now_us()))

    def _progress(self) -> None:
        # lets MPI libraries that progress only inside MPI calls advance the reductions
        for bucket in self.buckets[:self.next]:
            request = bucket.request
            if request is not None and not request.done:
                request.test()

    # -- after backward --------------------------------------------------------------------
    def finish_step(self) -> None:
        """Start what is not started, wait for every reduction, leave the results in .grad,
        and make ready for the next step."""
        self.dirty = False
        try:
            if self.mode == "overlap":
                pending = self.buckets
                while self.next < len(pending):
                    self._start(pending[self.next])
                    self.next += 1
            elif self.chooser.form == "flat":
                pending = self._start_flat()
            else:
                pending = self._start_serial()
            with torch.no_grad():
                for bucket in pending:
                    self._finish(bucket)
        except BaseException:
            self._abandon()
            raise
        self._trace_step(pending)
        self._new_step()
        if self.arrivals is not None:
            self._rebuild()
        self.chooser.step_ended()

    def _filled(self) -> tuple[float, float]:
        """When the first bucket got its first gradient, and the last was complete."""
        return (min((b.times[0] for b in self.buckets if b.nready), default=0.0),
                max((b.times[1] for b in self.buckets if b.nready), default=0.0))

    def _start_flat(self) -> list[Bucket]:
        """The serial schedule's flat form, started: each kind's whole flat buffer (the
        gradients copied into it as they arrived), one reduction each."""
        first, ready = self._filled()
        for whole in self.wholes:
            whole.times[0], whole.times[1] = first, ready
            self._start(whole, blocking=True)
        return list(self.wholes)

    def _start_serial(self) -> list[Bucket]:
        """The serial schedule's in-place form, started: each small bucket, then each large
        gradient in place (in its bucket's view if it has none, or none contiguous)."""
        first, ready = self._filled()
        started = []
        for small in self.smalls:
            small.times[0], small.times[1] = first, ready
            self._start(small, blocking=True)
            started.append(small)
        index, fresh, sparse = self.index, self.fresh, self.sparse
        for p in self.direct:
            i = index[p]
            grad = p.grad
            if not fresh[i] or p in sparse or not grad.is_contiguous():
                b, j = self.where[p]
                view = self.buckets[b].views[j]
                with torch.no_grad():
                    if fresh[i] and p not in sparse:
                        view.copy_(grad)
                    else:  # no gradient this step: contribute zeros
                        view.zero_()
                grad = view
            fresh[i] = True
            direct = Bucket(f"grad.{i}", [p], grad.view(-1), [grad])
            direct.times[0], direct.times[1] = first, ready
            self._start(direct, blocking=True)
            started.append(direct)
        return started

    def _finish(self, bucket: Bucket) -> None:
        request, bucket.request = bucket.request, None
        request.wait()
        bucket.times[4] = now_us()
        self.reduction.finish(bucket)
        bucket.sent = bucket.ctx = None
        index, sparse, densified = self.index, self.sparse, self.densified
        for p, view in zip(bucket.params, bucket.views, strict=True):
            if p in sparse:
                continue
            if densified[index[p]]:  # sparse_as_dense: the optimizer gets a sparse gradient
                p.grad = view.to_sparse()
            elif p.grad is not view:
                p.grad = view

    def _abandon(self) -> None:
        """A reduction failed: the others in flight end (their errors dropped: the first is
        raised) and the next step starts afresh."""
        for bucket in self.buckets + self.smalls + self.wholes:
            request, bucket.request = bucket.request, None
            if request is not None:
                try:
                    request.wait()
                except Exception:  # noqa: BLE001, S110  (see above)
                    pass
        self._new_step()

    def reset(self) -> None:
        """Forget the gradients of this step (reductions in flight end first)."""
        with torch.no_grad():
            for bucket in self.buckets + self.smalls + self.wholes:
                if bucket.request is not None:
                    bucket.request.wait()
                    bucket.request = None
        self._new_step()

    def _rebuild(self) -> None:
        """After the first step: the buckets in the order rank 0's gradients arrived."""
        arrivals, self.arrivals = self.arrivals, None
        came = set(arrivals)  # parameters without a gradient go last, in plan order
        arrivals += [self.index[p] for b in self.buckets for p in b.params
                     if self.index[p] not in came]
        order = self.reduction.bcast(arrivals)
        groups = self.replan([self.params[i] for i in order])
        if [[self.index[p] for p in g] for g in groups] == \
                [[self.index[p] for p in b.params] for b in self.buckets]:
            return
        old = {p: (self.buckets[b].views[i], self.small_view.get(p))
               for p, (b, i) in self.where.items()}
        self._set_layout(groups)
        with torch.no_grad():
            for p, (b, i) in self.where.items():
                if p.grad is not None and any(p.grad is v for v in old[p]):
                    view = self.buckets[b].views[i]
                    view.copy_(p.grad)
                    p.grad = view

    def _trace_step(self, reduced: list[Bucket]) -> None:
        trace = self.trace()
        if trace is None:
            return
        for bucket in reduced:
            first, ready, started, done, waited = bucket.times
            done = done or waited
            row = f"{bucket.label} ({len(bucket.params)} tensors)"
            args = {"bytes": bucket.flat.numel() * bucket.flat.element_size(),
                    "schedule": self.mode if self.mode == "overlap"
                    else f"serial, {self.chooser.form}"}
            if first and ready:
                trace.complete("FILL", "bucket", row, first, ready, args)
            if ready:
                trace.complete("QUEUED", "bucket", row, ready, started, args)
            trace.complete("REDUCE", "bucket", row, started, done, args)
            trace.complete("WAIT", "bucket", row, done, waited, args)
            bucket.times = [0.0, 0.0, 0.0, 0.0, 0.0]
        trace.flush()

    def remove(self) -> None:
        """Detach the gradient hooks."""
        for handle in self.hooks:
            handle.remove()
        self.hooks = []
