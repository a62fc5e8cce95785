"""Data-parallel gradient averaging over MPI, on the bucket engine (`buckets.py`)::

    model = Net()
    sync = fastreduce.GradientSync(model)      # also broadcasts rank 0's parameters
    sync.attach(optimizer)                     # optimizer.step() waits for the reductions
    for batch in data:
        optimizer.zero_grad()
        loss(model(batch)).backward()          # buckets are reduced while backward runs
        optimizer.step()

Gradients are gathered in flat buffers (each parameter's .grad is a view into its bucket).
With the overlap schedule, a bucket's in-place non-blocking all-reduce starts as soon as
its last gradient has been accumulated, in a fixed bucket order on every rank; with the
serial schedule, everything is reduced after backward, in one of two forms: each large
gradient in place (one call each, no copy) or all of them in their flat buffer (one
call); "auto" (the default) times overlap and both forms on the first steps and keeps the
fastest (the serial schedule times its two forms and keeps the faster). `timeline=path`
writes each bucket's phases as a Chrome trace.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import weakref

import torch
from mpi4py import MPI

from .. import agreement, watchdog
from ..backend import engine as _engine
from ..backend.collectives import allreduce_, broadcast_, default_comm, iallreduce_
from ..backend.reductions import COMPRESSIONS
from ..timeline import Trace
from .buckets import BucketEngine, Reduction, check_schedule, plan_buckets

__all__ = ["GradientSync"]

_SECOND_BACKWARD = (
    "fastreduce: a gradient arrived again before sync.wait(): its bucket is already being "
    "reduced (or queued for it); call sync.wait() "
    "(or optimizer.step() after sync.attach(optimizer)) before the next backward, or "
    "accumulate under `with sync.no_sync():`")


def model_fields(params: list[torch.Tensor]) -> dict:
    """What every rank's model must share for its gradients to be reduced together: the
    parameters, in order, by shape, dtype and whether they train (as DDP checks)."""
    fields = {"parameters": len(params),
              "trained": sum(p.requires_grad for p in params),
              "elements": sum(p.numel() for p in params)}
    for i, p in enumerate(params):
        fields[f"parameter {i}"] = (f"{tuple(p.shape)} {str(p.dtype).removeprefix('torch.')}"
                                    f"{'' if p.requires_grad else ' frozen'}")
    return fields


def _agree_on_the_model(comm: MPI.Intracomm, params: list[torch.Tensor]) -> None:
    """Collective: the ranks' models are alike (model_fields), else ValueError on every rank
    naming what differs, before any gradient is reduced. The ranks exchange a digest (a few
    bytes each, whatever the model); the full descriptions only where the digests differ."""
    fields = model_fields(params)
    layout = hashlib.blake2b(repr(sorted(fields.items())).encode(), digest_size=16).hexdigest()

    def differ(_: agreement.Differences) -> ValueError:  # every rank is here: collective
        with watchdog.recorded("GradientSync: the ranks' models (MPI_Allgather)", comm):
            found = agreement.differences(comm.allgather(fields))
        shown = dict(list(found.fields.items())[:4])  # the counts, then the first parameters
        text = agreement.Differences(shown, found.groups).text("has")
        return ValueError(f"fastreduce: GradientSync: the ranks' modules differ ({text}); "
                          f"wrap the same model on every rank, with its parameters created "
                          f"in the same order")

    agreement.agree(comm, {"model": layout}, None, differ=differ,
                    refused=lambda ranks, text: ValueError(text),
                    doing="GradientSync: the ranks' models")


class GradientSync:
    """Average (or sum) the gradients of `module` over `comm` in buckets of `bucket_mb` MiB;
    compression "bf16" or "fp16" sends float32 gradients as 16 bits; schedule "auto",
    "overlap" or "serial" (default: FASTREDUCE_GRADIENT_SCHEDULE); timeline: a path for a
    Chrome trace of the buckets ("{rank}" in it is replaced; without it only rank 0 writes)."""

    def __init__(self, module: torch.nn.Module, *, comm: MPI.Intracomm | None = None,
                 bucket_mb: float = 25, op: str = "avg", broadcast_parameters: bool = True,
                 compression: str | None = None, schedule: str | None = None,
                 timeline: str | os.PathLike | None = None):
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"fastreduce: GradientSync needs a torch.nn.Module, not "
                            f"{type(module).__qualname__}")
        if not bucket_mb > 0:
            raise ValueError(f"fastreduce: bucket_mb must be positive, not {bucket_mb!r}")
        if op not in ("avg", "sum"):
            raise ValueError(f"fastreduce: GradientSync op must be 'avg' or 'sum', not {op!r}")
        wire = compression.lower() if isinstance(compression, str) else compression
        if wire not in COMPRESSIONS:
            raise ValueError(f"fastreduce: GradientSync compression {compression!r}: use None, "
                             f"'bf16' or 'fp16' (float32 gradients sent as 16 bits)")
        if COMPRESSIONS[wire] and not _engine.state()[0]:
            raise ValueError(f"fastreduce: GradientSync with compression reduces its buckets "
                             f"on the progress engine, which is off ({_engine.state()[1]}); "
                             f"turn it on (FASTREDUCE_ENGINE=1 with MPI_THREAD_MULTIPLE) or "
                             f"leave compression out")
        schedule = check_schedule(schedule, "GradientSync")
        params = list(module.parameters())
        if not params:
            raise ValueError("fastreduce: the module has no parameters to synchronise")
        trained = [p for p in params if p.requires_grad]
        if not trained:
            raise ValueError("fastreduce: no parameter of the module requires grad; nothing "
                             "to synchronise (unfreeze some, or do not wrap this module)")
        self.module = module
        self.comm = default_comm() if comm is None else comm
        _agree_on_the_model(self.comm, params)
        self.op = op
        self.compression = wire if COMPRESSIONS[wire] else None
        self.bucket_bytes = int(bucket_mb * (1 << 20))
        self._trace = None
        if timeline is not None:
            path = os.fspath(timeline)
            if "{rank}" in path or self.comm.Get_rank() == 0:
                self._trace = Trace(path.replace("{rank}", str(self.comm.Get_rank())))
                weakref.finalize(self, self._trace.close)
        comm = self.comm
        reduction = Reduction(start=self._start, finish=lambda bucket: None,
                              sum=lambda t: allreduce_(t, "sum", comm=comm),
                              bcast=lambda obj: comm.bcast(obj, root=0), run=self._run)
        self._engine = BucketEngine(
            trained, plan_buckets(trained, self.bucket_bytes), reduction, schedule=schedule,
            too_many=lambda: RuntimeError(_SECOND_BACKWARD), trace=lambda: self._trace,
            replan=lambda ordered: plan_buckets(ordered[::-1], self.bucket_bytes))
        if broadcast_parameters:
            self.sync_parameters()

    def _wire(self, bucket) -> str | None:
        return self.compression if bucket.flat.dtype == torch.float32 else None

    def _start(self, bucket):
        return iallreduce_(bucket.flat, self.op, comm=self.comm, compression=self._wire(bucket))

    def _run(self, bucket) -> None:
        allreduce_(bucket.flat, self.op, comm=self.comm, compression=self._wire(bucket))

    @property
    def bucket_sizes(self) -> list[int]:
        """Number of parameters in each bucket, in the order the buckets are reduced."""
        return self._engine.bucket_sizes

    @property
    def schedule(self) -> str:
        """The schedule the next step uses: "overlap" or "serial"."""
        return self._engine.mode

    @property
    def measured(self) -> dict[str, float]:
        """What "auto" measured: the median step time of each schedule, in seconds, summed
        over the ranks (empty until it has decided, and for a fixed schedule); "serial" is
        the time of its form kept (`serial_form`)."""
        return dict(self._engine.chooser.measured)

    @property
    def serial_form(self) -> str:
        """How the serial schedule reduces: "in place" (each gradient of 1 MiB or more where
        autograd left it, one call each; the smaller ones in one flat buffer) or "flat" (all
        gradients in their flat buffer, one call). Both are timed on the first steps where
        they differ (some gradient of 1 MiB or more), and the faster kept."""
        return self._engine.serial_form

    def sync_parameters(self) -> None:
        """Copy rank 0's parameters and buffers to every rank (collective): the compiled
        core's broadcast, on each tensor's device (the GPU path as for every collective)."""
        with torch.no_grad():
            for t in list(self.module.parameters()) + list(self.module.buffers()):
                data = t.data if t.is_contiguous() else t.data.contiguous()
                broadcast_(data, 0, comm=self.comm)
                if data is not t.data:
                    t.data.copy_(data)

    def wait(self) -> None:
        """Start the buckets not yet started, wait for all, and leave the results in .grad.

        Does nothing when no gradient arrived since the last wait(), so calling it
        again (e.g. from optimizer.step() after an explicit wait) is harmless. Every
        rank must run its backward pass before waiting, as with DDP.
        """
        if self._engine.dirty:
            self._engine.finish_step()

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        """Make optimizer.step() wait for the reductions first."""
        optimizer.register_step_pre_hook(lambda *args: self.wait())

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally (no communication) inside this block."""
        engine = self._engine
        old, engine.accumulating = engine.accumulating, True
        try:
            yield
        finally:
            engine.accumulating = old

    def __enter__(self) -> GradientSync:
        return self

    def __exit__(self, *exc) -> None:
        if exc[0] is None:
            self.wait()

    def remove(self) -> None:
        """Detach the gradient hooks and close the timeline."""
        self._engine.remove()
        if self._trace is not None:
            self._trace.close()
