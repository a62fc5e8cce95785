"""`hvd.DistributedOptimizer`: Horovod's gradient-averaging optimizer wrapper over fastreduce.

Gradients are reduced by fastreduce's bucket engine (`fastreduce.torch.buckets`), as
`fastreduce.GradientSync`'s are: each parameter's .grad is a view into a flat buffer; with
the overlap schedule a bucket's reduction starts once its last gradient has been accumulated
(on the last of `backward_passes_per_step` passes), in a fixed order on every rank; with the
serial schedule each flat buffer is reduced in one call at synchronize(); "auto"
(FASTREDUCE_GRADIENT_SCHEDULE) times both on the first steps. Each reduction is negotiated as
hvd.allreduce_async_ is (one small exchange), so that a rank that has called hvd.join()
takes part in it with zeros and a rank whose buckets differ raises everywhere. The buckets
keep the plan's order (not rebuilt in arrival order): a rebuild would need a collective
that a joined rank does not take part in. HOROVOD_TIMELINE gets each bucket's phases.

Bucket size: HOROVOD_FUSION_THRESHOLD bytes (0: a bucket per parameter). When it is unset,
25 MiB rather than Horovod's 64 MiB: Horovod sends what is ready every cycle (5 ms) whatever
the threshold, but here a bucket is sent only once it is full, so 64 MiB buckets would leave
little of the reduction to overlap the backward pass of a mid-sized model.

Compression.fp16 on float32 gradients uses fastreduce's wire compression (sent as float16,
summed in float32) when the progress engine is on; otherwise, and for other dtypes or other
compressors, each bucket is compressed with the compressor, reduced, and decompressed.

Not supported: Adasum (use Average or Sum). A rank without data may either call hvd.join()
or call optimizer.step() after no backward pass: either way it contributes zeros, as with
Horovod.
"""

from __future__ import annotations

import contextlib
import hashlib
import warnings
import weakref

import torch

from ... import settings
from ...backend import engine as _engine
from ..buckets import BucketEngine, Reduction, plan_buckets, schedule_setting
from . import ops as _ops
from . import timeline
from .basics import size
from .compression import Compression, FP16Compressor, NoneCompressor
from .negotiation import agree_call, next_number
from .ops import (
    Adasum,
    Average,
    Max,
    Min,
    Product,
    Sum,
    _bucket_start,
    sparse_allreduce_async,
)
from .process_sets import global_process_set

__all__ = ["DistributedOptimizer"]

DEFAULT_FUSION_BYTES = settings.value("HOROVOD_FUSION_THRESHOLD", {})  # unset: the default
_OP_NAMES = {Average: "avg", Sum: "sum", Min: "min", Max: "max", Product: "prod"}
_TOO_MANY_PASSES = ("fastreduce.horovod: gradients were computed more than "
                    "backward_passes_per_step times before the call to step() or "
                    "synchronize(); increase backward_passes_per_step to accumulate gradients "
                    "locally, or call optimizer.step() after each backward pass")


def fusion_bytes() -> int:
    """The bucket size in bytes: HOROVOD_FUSION_THRESHOLD, else DEFAULT_FUSION_BYTES (25 MiB);
    SettingError (a ValueError) for a value that is not a number of bytes >= 0."""
    return settings.value("HOROVOD_FUSION_THRESHOLD")


def _split_list(items: list, n: int) -> list[list]:
    """`items` cut into n contiguous parts whose lengths differ by at most one."""
    d, r = divmod(len(items), n)
    return [items[i * d + min(i, r):(i + 1) * d + min(i + 1, r)] for i in range(n)]


def _by_kind(group: list) -> list[list]:
    """A group split where dtype or device changes (one flat buffer per dtype and device)."""
    out: dict = {}
    for p in group:
        out.setdefault((p.dtype, p.device), []).append(p)
    return list(out.values())



# Every DistributedOptimizer's bucket engine: after join() the ranks have run different
# numbers of steps, so each engine's choice of schedule ("auto", which counts steps)
# starts again alike on every rank.
_engines: weakref.WeakSet = weakref.WeakSet()


def _restart_schedules() -> None:
    for engine in list(_engines):
        engine.chooser.restart()


_ops._after_join.append(_restart_schedules)

class _DistributedOptimizer:
    """The methods the wrapped optimizer's class gets; see DistributedOptimizer."""

    def _hvd_setup(self, named_parameters, compression, backward_passes_per_step, op,
                   gradient_predivide_factor, groups, sparse_as_dense, process_set) -> None:
        params = [p for group in self.param_groups for p in group["params"]]
        if named_parameters is not None:
            named_parameters = list(named_parameters)
        else:
            named_parameters = [(f"allreduce.noname.{i}.{j}", p)
                                for i, group in enumerate(self.param_groups)
                                for j, p in enumerate(group["params"])]
        if any(not isinstance(item, tuple) for item in named_parameters):
            raise ValueError("fastreduce.horovod: named_parameters must be a sequence of "
                             "(name, parameter) tuples, as model.named_parameters() gives")
        seen, dups = set(), set()
        for name, _ in named_parameters:
            (dups if name in seen else seen).add(name)
        if dups:
            raise ValueError(f"fastreduce.horovod: parameter names in named_parameters must "
                             f"be unique; found duplicates: {', '.join(sorted(map(str, dups)))}")
        named_ids = {id(p) for _, p in named_parameters}
        unnamed = [p for p in params if id(p) not in named_ids]
        if unnamed:
            raise ValueError(f"fastreduce.horovod: named_parameters was given, but "
                             f"{len(unnamed)} of the optimizer's parameters are not named in "
                             f"it (shapes {[tuple(p.shape) for p in unnamed[:5]]}); pass "
                             f"model.named_parameters() of the model the optimizer trains")
        if not isinstance(backward_passes_per_step, int) or backward_passes_per_step < 1:
            raise ValueError(f"fastreduce.horovod: backward_passes_per_step must be an integer "
                             f">= 1, not {backward_passes_per_step!r}")
        if groups is not None:
            if isinstance(groups, list):
                grouped = set()
                for group in groups:
                    for p in group:
                        if not isinstance(p, torch.Tensor):
                            raise ValueError("fastreduce.horovod: groups must be a list of "
                                             "lists of torch.Tensor (parameters)")
                        if id(p) in grouped:
                            raise ValueError("fastreduce.horovod: a parameter can appear only "
                                             "once in groups")
                        grouped.add(id(p))
            elif isinstance(groups, bool) or not isinstance(groups, int) or groups <= 0:
                raise ValueError(f"fastreduce.horovod: groups must be a positive integer or a "
                                 f"list of lists of torch.Tensor, not {groups!r}")
        if not (hasattr(compression, "compress") and hasattr(compression, "decompress")):
            raise ValueError(f"fastreduce.horovod: compression must be a Compressor such as "
                             f"hvd.Compression.none or hvd.Compression.fp16, not {compression!r}")

        self._parameter_names = {p: name for name, p in named_parameters}
        self._compression = compression
        self.backward_passes_per_step = backward_passes_per_step
        self.op = op
        self.gradient_predivide_factor = gradient_predivide_factor
        self.sparse_as_dense = sparse_as_dense
        self.process_set = process_set
        self._should_synchronize = True
        self._synchronized = False
        self._hvd_engine: BucketEngine | None = None
        trained = [p for p in params if p.requires_grad]
        if not (process_set.included() and size() > 1):
            return
        # Every rank must make the same buckets: check the parameters match rank 0's (on
        # every rank of the set, one without trained parameters too).
        layout = repr([(self._parameter_names[p], tuple(p.shape), str(p.dtype))
                       for p in trained]).encode()
        agree_call(process_set.comm, "hvd.DistributedOptimizer",
                     {"parameters": f"{len(trained)} tensors "
                                    f"({hashlib.blake2b(layout, digest_size=8).hexdigest()})",
                      "groups": groups if not isinstance(groups, list) else
                      [len(g) for g in groups]})
        if not trained:
            return
        # the buckets' names, distinct per optimizer (made in the same order on every rank)
        made = next_number(process_set.comm, "DistributedOptimizer")
        self._hvd_label = f"DistributedOptimizer.{made}"
        self._hvd_comm = process_set.comm
        self._hvd_nranks = process_set.size()
        predivide = op == Average and gradient_predivide_factor != 1.0
        self._hvd_opname = "sum" if predivide else _OP_NAMES[op]
        self._hvd_prescale = 1.0 / gradient_predivide_factor if predivide else 1.0
        self._hvd_postscale = gradient_predivide_factor / self._hvd_nranks if predivide else 1.0
        self._hvd_wire = (compression is FP16Compressor and self._hvd_opname in ("avg", "sum")
                          and _engine.state()[0])
        self._hvd_engine = BucketEngine(
            trained, self._hvd_plan(trained, groups),
            Reduction(start=self._hvd_start, finish=self._hvd_finish, sum=self._hvd_sum),
            schedule=schedule_setting(), passes=backward_passes_per_step,
            too_many=lambda: AssertionError(_TOO_MANY_PASSES), trace=timeline.current,
            sparse_as_dense=sparse_as_dense)
        _engines.add(self._hvd_engine)

    @staticmethod
    def _hvd_plan(trained: list, groups) -> list[list]:
        """The buckets, in the order they are reduced (the order their gradients complete
        in a backward pass: reverse parameter order)."""
        if groups is None:
            return plan_buckets(trained, fusion_bytes())
        if isinstance(groups, int):
            explicit = _split_list(trained, groups)
        else:
            ids = {id(p) for group in groups for p in group}
            known = {id(p) for p in trained}
            explicit = [[p for p in group if id(p) in known] for group in groups]
            explicit += [[p] for p in trained if id(p) not in ids]
        index = {id(p): i for i, p in enumerate(trained)}
        parts = [sorted(part, key=lambda p: index[id(p)])
                 for group in explicit if group for part in _by_kind(group)]
        # a bucket is complete when its first-registered parameter's gradient arrives
        return sorted(parts, key=lambda part: -index[id(part[0])])

    # -- the bucket engine's Reduction ----------------------------------------------------
    def _hvd_start(self, bucket):
        with torch.no_grad():
            flat = bucket.flat
            if self._hvd_prescale != 1.0:
                flat.mul_(self._hvd_prescale)
            compression = self._compression
            if compression is NoneCompressor:
                sent, ctx, wire = flat, None, None
            elif self._hvd_wire and flat.dtype == torch.float32:
                sent, ctx, wire = flat, None, "fp16"
            else:
                sent, ctx = compression.compress(flat)
                wire = None
                if not sent.is_contiguous():
                    sent = sent.contiguous()
            bucket.sent, bucket.ctx = sent, ctx
            return _bucket_start(sent, self._hvd_opname, self.process_set,
                                 f"{self._hvd_label}.{bucket.label}", wire)

    def _hvd_finish(self, bucket) -> None:
        flat = bucket.flat
        if bucket.sent is not flat:
            flat.copy_(self._compression.decompress(bucket.sent, bucket.ctx))
        if self._hvd_postscale != 1.0:
            flat.mul_(self._hvd_postscale)

    def _hvd_sum(self, values: torch.Tensor) -> torch.Tensor:
        # negotiated like a bucket, so that a joined rank takes part (with zeros)
        _bucket_start(values, "sum", self.process_set, f"{self._hvd_label}.schedule",
                      None).wait()
        return values

    # -- after backward --------------------------------------------------------------------
    def synchronize(self) -> None:
        """Finish the gradient reductions (starting those not started) and leave the results
        in each parameter's .grad."""
        engine = self._hvd_engine
        if engine is None:
            self._synchronized = True
            return
        if self._synchronized and not engine.dirty:
            return  # reduced already, and no gradient since: reducing zeros would lose them
        sparse = sorted(engine.sparse, key=engine.sparse.__getitem__)
        engine.finish_step()
        handles = [sparse_allreduce_async(p.grad, name=self._parameter_names.get(p),
                                          op=self.op, process_set=self.process_set)
                   for p in sparse]
        with torch.no_grad():
            for p, handle in zip(sparse, handles, strict=True):
                p.grad.zero_().add_(handle())
        self._synchronized = True

    @contextlib.contextmanager
    def skip_synchronize(self):
        """Within this block, step() does not synchronize (after an explicit synchronize())."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure=None):
        """Synchronize the gradients (unless in skip_synchronize()), then take the step."""
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn("fastreduce.horovod: optimizer.step() called without "
                              "optimizer.skip_synchronize() context after "
                              "optimizer.synchronize(): the gradients reduced then are used as "
                              "they are; wrap step() in `with optimizer.skip_synchronize():`",
                              stacklevel=2)
            self.synchronize()
        self._synchronized = False
        return super().step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As the wrapped optimizer's, refused between backward and step()/synchronize()."""
        if self._hvd_engine is not None and self._hvd_engine.dirty:
            raise AssertionError("fastreduce.horovod: optimizer.zero_grad() was called after "
                                 "loss.backward() but before optimizer.step() or "
                                 "optimizer.synchronize(); call it before the backward pass "
                                 "or after step()")
        return super().zero_grad(set_to_none=set_to_none)

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Change how many backward passes accumulate locally before a reduction."""
        if not isinstance(passes, int) or passes < 1:
            raise ValueError(f"fastreduce.horovod: backward_passes_per_step must be an integer "
                             f">= 1, not {passes!r}")
        self.backward_passes_per_step = passes
        if self._hvd_engine is not None:
            self._hvd_engine.passes = passes
            self._hvd_engine.left = [passes] * len(self._hvd_engine.params)

    def load_state_dict(self, state_dict) -> None:
        """As the wrapped optimizer's; also forgets gradients accumulated since the last step."""
        if self._hvd_engine is not None:
            self._hvd_engine.reset()  # reductions in flight end before they are forgotten
        self._synchronized = False
        self._should_synchronize = True
        return super().load_state_dict(state_dict)

    def _hvd_remove_hooks(self) -> None:
        if self._hvd_engine is not None:
            self._hvd_engine.remove()



def DistributedOptimizer(optimizer, named_parameters=None, compression=Compression.none,
                         backward_passes_per_step=1, op=Average, gradient_predivide_factor=1.0,
                         num_groups=0, groups=None, sparse_as_dense=False,
                         process_set=global_process_set):
    """Wrap a torch optimizer so that step() first averages (op) the gradients over the
    process set, the reductions overlapping the backward pass."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"fastreduce.horovod: DistributedOptimizer wraps a torch.optim."
                        f"Optimizer, not {type(optimizer).__qualname__}")
    if isinstance(optimizer, _DistributedOptimizer):
        raise ValueError("fastreduce.horovod: this optimizer is a DistributedOptimizer "
                         "already; wrap the plain torch optimizer once")
    if op == Adasum:
        raise ValueError("fastreduce.horovod: op=hvd.Adasum is not implemented in "
                         "fastreduce.horovod; use op=hvd.Average or op=hvd.Sum")
    if op not in _OP_NAMES:
        raise ValueError(f"fastreduce.horovod: op={op!r} is not a reduction; use hvd.Average "
                         f"or hvd.Sum (or hvd.Min, hvd.Max, hvd.Product)")
    if gradient_predivide_factor != 1.0 and op != Average:
        raise ValueError("fastreduce.horovod: gradient_predivide_factor is supported only with "
                         "op=hvd.Average; leave it at 1.0 for other ops")
    if not gradient_predivide_factor > 0:
        raise ValueError(f"fastreduce.horovod: gradient_predivide_factor must be positive, not "
                         f"{gradient_predivide_factor!r}")
    if num_groups:
        warnings.warn("fastreduce.horovod: DistributedOptimizer(num_groups=) is deprecated; "
                      "pass groups= instead", DeprecationWarning, stacklevel=2)
        if groups is None:
            groups = num_groups
    process_set._registered()
    # The same object, its class swapped for a subclass of its class: its state, defaults,
    # hyper-parameters and hooks carry over, whatever arguments its constructor needs.
    base = type(optimizer)
    # The class's step() is left unpatched by torch, so the step hooks run once, around
    # the wrapped class's step(), after the gradients are synchronized.
    cls = type(base.__name__, (_DistributedOptimizer, base), {})
    wrapped = cls.__new__(cls)
    wrapped.__dict__.update((k, v) for k, v in optimizer.__dict__.items()
                            if k not in ("step", "zero_grad"))  # e.g. an LR scheduler's wrapper
    wrapped._hvd_setup(named_parameters, compression, backward_passes_per_step, op,
                       gradient_predivide_factor, groups, sparse_as_dense, process_set)
    return wrapped
