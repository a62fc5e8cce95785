"""Data-parallel gradient averaging that overlaps the backward pass (DDP-style buckets)::

    model = Net()
    sync = fastreduce.GradientSync(model)      # also broadcasts rank 0's parameters
    sync.attach(optimizer)                     # optimizer.step() waits for the reductions
    for batch in data:
        optimizer.zero_grad()
        loss(model(batch)).backward()          # buckets are reduced while backward runs
        optimizer.step()

Gradients are gathered in flat per-bucket buffers (each parameter's .grad is a
view into its bucket), in reverse order of registration as backward produces
them. When the last gradient of a bucket has been accumulated, an in-place
non-blocking all-reduce of the bucket starts; buckets start in a fixed order
on every rank, so the collectives always match. Each gradient hook also tests
the reductions in flight, which lets MPI libraries that progress only inside
MPI calls advance them while backward computes.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
from mpi4py import MPI

from .. import gpupaths
from ..backend import engine as _engine
from ..backend.collectives import default_comm, iallreduce_
from ..backend.reductions import COMPRESSIONS

__all__ = ["GradientSync"]


@dataclass
class _Bucket:
    flat: torch.Tensor
    params: list
    views: list
    ready: set = field(default_factory=set)
    request: object = None


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


def flat_views(params: list) -> tuple[torch.Tensor, list]:
    """A zeroed flat buffer for `params` (one dtype and device) and a view of it shaped
    like each parameter."""
    flat = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype,
                       device=params[0].device)
    views, offset = [], 0
    for p in params:
        views.append(flat[offset:offset + p.numel()].view_as(p))
        offset += p.numel()
    return flat, views


class GradientSync:
    """Average (or sum) the gradients of `module` over `comm` in buckets of `bucket_mb` MiB;
    compression "bf16" or "fp16" sends float32 gradients as 16 bits."""

    def __init__(self, module: torch.nn.Module, *, comm: MPI.Intracomm | None = None,
                 bucket_mb: float = 25, op: str = "avg", broadcast_parameters: bool = True,
                 compression: str | None = None):
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
        params = list(module.parameters())
        if not params:
            raise ValueError("fastreduce: the module has no parameters to synchronise")
        trained = [p for p in params if p.requires_grad]
        if not trained:
            raise ValueError("fastreduce: no parameter of the module requires grad; nothing "
                             "to synchronise (unfreeze some, or do not wrap this module)")
        self.module = module
        self.comm = default_comm() if comm is None else comm
        self.op = op
        self.compression = wire if COMPRESSIONS[wire] else None
        self.bucket_bytes = int(bucket_mb * (1 << 20))
        self._buckets = self._make_buckets(trained)
        self._where = {}
        for b, bucket in enumerate(self._buckets):
            for i, p in enumerate(bucket.params):
                self._where[p] = (b, i)
        self._next = 0           # the next bucket to start, in bucket order
        self._in_step = False    # a gradient arrived since the last wait()
        self._accumulating = False
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in trained]
        self._hooks += [p.register_hook(self._make_guard(p)) for p in trained]
        if broadcast_parameters:
            self.sync_parameters()

    def _make_buckets(self, params: list) -> list[_Bucket]:
        out = []
        for group in plan_buckets(params, self.bucket_bytes):
            flat, views = flat_views(group)
            out.append(_Bucket(flat=flat, params=group, views=views))
        return out

    @property
    def bucket_sizes(self) -> list[int]:
        """Number of parameters in each bucket, in the order the buckets are reduced."""
        return [len(b.params) for b in self._buckets]

    def sync_parameters(self) -> None:
        """Copy rank 0's parameters and buffers to every rank (collective)."""
        # device pointers only to an MPI that promises blocking collectives on them
        through_host = (not gpupaths.device_pointer_support().blocking
                        or gpupaths.gpu_path_mode()[0] == "staged")
        with torch.no_grad():
            for t in list(self.module.parameters()) + list(self.module.buffers()):
                data = t.data if t.is_contiguous() else t.data.contiguous()
                if data.device.type != "cpu":
                    if through_host:  # an MPI that cannot read GPU memory gets host memory
                        data = data.cpu()
                    else:  # MPI reads the device memory: let queued writes finish first
                        torch.cuda.current_stream(data.device).synchronize()
                self.comm.Bcast(data, root=0)
                if data is not t.data:
                    t.data.copy_(data)

    # -- during backward -------------------------------------------------------------
    def _make_guard(self, p: torch.Tensor):
        bucket_index = self._where[p][0]

        def guard(grad: torch.Tensor) -> None:
            """Before a gradient is accumulated: refuse it if its bucket is in flight."""
            if bucket_index < self._next and not self._accumulating:
                raise RuntimeError(
                    "fastreduce: a gradient arrived for a bucket already being reduced: "
                    "call sync.wait() (or optimizer.step() after sync.attach(optimizer)) "
                    "before the next backward, or accumulate under `with sync.no_sync():`")

        return guard

    def _on_grad(self, p: torch.Tensor) -> None:
        if self._accumulating:
            return
        self._in_step = True
        b, i = self._where[p]
        bucket = self._buckets[b]
        view = bucket.views[i]
        if p.grad is not view:  # first gradient since zero_grad(set_to_none=True)
            view.copy_(p.grad)
            p.grad = view
        bucket.ready.add(i)
        while self._next < len(self._buckets) and (
                len(self._buckets[self._next].ready) == len(self._buckets[self._next].params)):
            self._start(self._next)
        self._progress()

    def _start(self, b: int) -> None:
        bucket = self._buckets[b]
        with torch.no_grad():
            for i in range(len(bucket.params)):
                if i not in bucket.ready:  # no gradient this step: contribute zeros
                    bucket.views[i].zero_()
        wire = self.compression if bucket.flat.dtype == torch.float32 else None
        bucket.request = iallreduce_(bucket.flat, self.op, comm=self.comm, compression=wire)
        self._next = b + 1

    def _progress(self) -> None:
        for bucket in self._buckets[:self._next]:
            if bucket.request is not None and not bucket.request.done:
                bucket.request.test()

    # -- after backward ----------------------------------------------------------------
    def wait(self) -> None:
        """Start the buckets not yet started, wait for all, and leave the results in .grad.

        Does nothing when no gradient arrived since the last wait(), so calling it
        again (e.g. from optimizer.step() after an explicit wait) is harmless. Every
        rank must run its backward pass before waiting, as with DDP.
        """
        if not self._in_step:
            return
        self._in_step = False
        while self._next < len(self._buckets):
            self._start(self._next)
        for bucket in self._buckets:
            if bucket.request is not None:
                bucket.request.wait()
                bucket.request = None
            for p, view in zip(bucket.params, bucket.views, strict=True):
                if p.grad is not view:
                    p.grad = view
            bucket.ready.clear()
        self._next = 0

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        """Make optimizer.step() wait for the reductions first."""
        optimizer.register_step_pre_hook(lambda *args: self.wait())

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally (no communication) inside this block."""
        old, self._accumulating = self._accumulating, True
        try:
            yield
        finally:
            self._accumulating = old

    def __enter__(self) -> GradientSync:
        return self

    def __exit__(self, *exc) -> None:
        if exc[0] is None:
            self.wait()

    def remove(self) -> None:
        """Detach the gradient hooks."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
