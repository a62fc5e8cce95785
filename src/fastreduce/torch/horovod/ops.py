"""Horovod's collectives on torch tensors over MPI: allreduce (fastreduce's core, on the
progress engine when asynchronous), allgather, broadcast, alltoall, reducescatter (mpi4py
on the tensors' memory), grouped forms, barrier, join and sparse allreduce; each preceded
submitted to the ranks' matching by name (negotiation.py), which runs it once every rank
has submitted it; differentiable as Horovod defines it.

Asynchronous forms return an int handle for poll()/synchronize() at once and run in the
background once every rank has submitted them: an allreduce on the progress engine's
thread or as MPI's own non-blocking call, the other collectives on the engine's thread (on
its duplicate of the set's communicator). With the engine off they run when every rank has
submitted them, their handle then complete.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import numpy as np
import torch
from mpi4py import MPI

from ...backend import collectives as _core
from ...backend import engine as _engine
from ...errors import HorovodArgumentError, HorovodMismatch
from ..dense import check_dense
from . import handles, negotiation, timeline
from .compression import Compression
from .matching import Status, unnamed_number
from .process_sets import ProcessSet, _comm_of, global_process_set

__all__ = [
    "Adasum", "Average", "HorovodMismatch", "Max", "Min", "Product", "Sum",
    "allgather", "allgather_async", "allreduce", "allreduce_", "allreduce_async",
    "allreduce_async_", "alltoall", "alltoall_async", "barrier", "broadcast", "broadcast_",
    "broadcast_async", "broadcast_async_", "grouped_allgather", "grouped_allgather_async",
    "grouped_allreduce", "grouped_allreduce_", "grouped_allreduce_async",
    "grouped_allreduce_async_", "grouped_reducescatter", "grouped_reducescatter_async", "join",
    "poll", "reducescatter", "reducescatter_async", "sparse_allreduce_async", "synchronize",
]

Average, Sum, Adasum, Min, Max, Product = 0, 1, 2, 3, 4, 5
_OP_NAMES = {Average: "Average", Sum: "Sum", Adasum: "Adasum", Min: "Min", Max: "Max",
             Product: "Product"}
_MPI_OPS = {Average: "sum", Sum: "sum", Min: "min", Max: "max", Product: "prod"}

poll = handles.poll
synchronize = handles.synchronize


# -- arguments ------------------------------------------------------------------------------

def _op_of(op, average, what: str):
    """The op (Average unless given), or the ValueError that refuses it: raised in the
    call's validation, so that the other ranks learn of it."""
    if isinstance(op, Exception):
        return op
    if average is not None and op is not None:
        return ValueError(f"fastreduce.horovod: {what}: give op, not both op and the "
                          f"deprecated average")
    if op is None:
        op = Sum if average is False else Average
    if op not in _OP_NAMES:
        return ValueError(f"fastreduce.horovod: {what}: op {op!r} is not one of hvd.Average, "
                          f"hvd.Sum, hvd.Min, hvd.Max, hvd.Product")
    return op


def _name(kind: str, name, process_set) -> str:
    """The call's name; an unnamed call's numbered per process set ("allreduce.noname.3")."""
    if name is None:
        # not a member, or before init(): the call is refused later, its name does not matter
        comm = process_set.comm if isinstance(process_set, ProcessSet) else None
        return f"{kind}.noname.{negotiation.next_number(comm, kind)}"
    if not isinstance(name, str):
        raise TypeError(f"fastreduce.horovod: name must be a str, not {type(name).__qualname__}")
    return name


def _check_tensor(t, what: str) -> None:
    check_dense(t, what, "fastreduce.horovod", layout_hint="give a dense tensor (sparse "
                "tensors: hvd.sparse_allreduce_async)")


_reducible: set = set()  # (dtype, op) pairs the core has accepted


def _check_reduction(t, op: int, what: str) -> None:
    if (t.dtype, op) in _reducible:
        return
    if op == Adasum:
        raise ValueError(f"fastreduce.horovod: {what}: op=hvd.Adasum is not implemented by "
                         f"fastreduce.horovod; use hvd.Average or hvd.Sum")
    _core.mpi_reduction(t, _MPI_OPS[op])  # refuses a dtype the op cannot reduce (bool sum)
    _reducible.add((t.dtype, op))


def _dtype(value) -> torch.dtype:
    """A dtype from a call's description (a torch.dtype, or its text)."""
    return value if isinstance(value, torch.dtype) else getattr(torch, value.split(".")[-1])


def _set_comm(process_set: ProcessSet, what: str) -> MPI.Intracomm:
    return _comm_of(process_set, f"hvd.{what}")


def _submit(comm, key_of, names: tuple, name: str, validate, launch, blocking: bool = False,
            exchanged=None):
    """Validate locally and make the call's key (key_of(): its kind, then the values of the
    fields `names`): an exception there is raised on this rank and a HorovodMismatch on the
    ranks that submit the same name. Then submit the call to the ranks' matching by name
    (negotiation.py): blocking, its result once it has run; else a handle at once.
    launch(everyone_blocking) starts it once every rank has submitted it: its result where
    every rank waits for it at once, else a handle. `exchanged`: the ranks' answers to the
    fast path's exchange, which differed (_fast_allreduce)."""
    if exchanged is None and handles.in_flight((id(comm), name)):
        # this rank's own mistake, whatever its arguments: the others are not told
        raise negotiation.in_flight_error(name)
    error, key = None, ("invalid",)
    try:
        validate()
        key = key_of()
    except (TypeError, ValueError, BufferError, AttributeError) as exc:
        error, names = exc, ()

    def describe() -> dict:
        return {"call": key[0], "name": name, **dict(zip(names, key[1:], strict=True))}

    if blocking:
        request = negotiation.submit(comm, key, name, describe, launch, error, blocking=True,
                                     exchanged=exchanged)
        return request.result if request.at_once else synchronize(request.result)
    handle = handles.reserve((id(comm), name))
    try:
        request = negotiation.submit(comm, key, name, describe,
                                     lambda _: handles.adopt(handle, launch(False)), error)
    except BaseException:
        handles.release(handle)
        raise
    handles.submitted(handle, comm, request)
    return handle


def _scale_(t: torch.Tensor, factor: float) -> None:
    """t *= factor in place; integer tensors through float64, truncated toward zero."""
    if factor == 1:
        return
    if t.is_floating_point() or t.is_complex():
        t.mul_(factor)
    else:
        t.copy_(t.to(torch.float64).mul_(factor))


# -- allreduce and grouped allreduce ----------------------------------------------------------

_ALLREDUCE_FIELDS = ("op", "dtype", "shape", "device", "prescale", "postscale")

def _allreduce_start(tensors, outputs, name, op, prescale, postscale, process_set, kind,
                     blocking=False, exchanged=None):
    """Submit the reduction of tensors into outputs (the same objects in place): a handle
    whose result is the outputs (a list); blocking, the outputs once reduced."""
    comm = _set_comm(process_set, kind)
    began = timeline.now()
    def key_of():  # the factors as floats: 1 and 1.0 are the same call (and the fast path's)
        if len(tensors) == 1:
            t = tensors[0]
            return (kind, _OP_NAMES.get(op, op), (t.dtype,), (t.shape,), (t.device.type,),
                    float(prescale), float(postscale))
        return (kind, _OP_NAMES.get(op, op), tuple(t.dtype for t in tensors),
                tuple(t.shape for t in tensors), tuple(t.device.type for t in tensors),
                float(prescale), float(postscale))

    def validate():
        if isinstance(op, Exception):
            raise op
        for i, t in enumerate(tensors):
            _check_tensor(t, f"hvd.{kind}: tensor {i}")
            _check_reduction(t, op, f"hvd.{kind}")

    def launch(everyone_blocking: bool):
        event = timeline.begin(kind, name, began)
        return _run_allreduce(comm, tensors, outputs, op, prescale, postscale, (id(comm), name),
                              event, everyone_blocking, everyone_blocking)

    return _submit(comm, key_of, _ALLREDUCE_FIELDS, name, validate, launch, blocking,
                   exchanged)


_SLOW = object()
_FAST_OPS = {Average: "avg", Sum: "sum", Min: "min", Max: "max", Product: "prod"}
_fast_keys: dict = {}  # (dtype, shape, op) -> the key_digest() of the call's key


def _fast_allreduce(tensor, name, op, prescale, postscale, process_set, in_place: bool,
                    named: bool):
    """allreduce / allreduce_ in one compiled call (the ranks' 16-byte exchange, then the
    reduction) where nothing stands in the way: a CPU tensor the core takes as it is, no
    scale factors (hvd.Average of a floating tensor: the core's "avg"), no timeline,
    nothing pending on this rank's set (the exchange is in the flight record as the other
    path's rounds are). _SLOW where it does not apply;
    where the ranks' answers differ, the negotiation goes on from them (the core having
    taken the tensor, the checks of the slow path pass). `named`: the user gave the name
    (it may be in flight)."""
    comm = process_set.comm if type(process_set) is ProcessSet else None
    opname = _FAST_OPS.get(op) if type(op) is int else None
    if comm is None or opname is None or prescale != 1 or postscale != 1 or \
            type(tensor) is not torch.Tensor or timeline.current() is not None or \
            (named and handles.in_flight((id(comm), name))):
        return _SLOW
    everyone = negotiation.idle(comm, name)
    if everyone is None:
        return _SLOW
    cached = (tensor.dtype, tensor.shape, op)
    keyed = _fast_keys.get(cached)
    if keyed is None:
        if opname == "avg" and not tensor.is_floating_point():
            return _SLOW  # an integer average: a torch multiplication after the sum
        if len(_fast_keys) > 4096:
            _fast_keys.clear()
        keyed = _fast_keys[cached] = negotiation.key_digest(
            ("allreduce", _OP_NAMES[op], (tensor.dtype,), (tensor.shape,), ("cpu",), 1.0, 1.0))
    out = _core.agreed_allreduce(tensor, opname, comm, Status.BLOCKING,
                                 negotiation.named_digest(keyed, name), everyone, in_place)
    if out is None:
        return _allreduce_start([tensor], [tensor if in_place else None], name, op, prescale,
                                postscale, process_set, "allreduce", True, everyone)[0]
    if out is False:  # refused before any exchange: the slow path refuses it on every rank
        return _SLOW
    negotiation.count_round()
    return out


def _core_divides(t: torch.Tensor, op) -> bool:
    """Whether fastreduce's "avg" op averages t: floating and complex CPU tensors, in one
    call without a torch multiplication after it. (On a GPU "avg" is computed on the host,
    so it would take the staged path where "sum" may go to a CUDA-aware MPI.)"""
    return op == Average and t.device.type == "cpu" and (t.is_floating_point() or
                                                          t.is_complex())


def _run_allreduce(comm, tensors, outputs, op, prescale, postscale, key, event, blocking=False,
                   everyone_blocking=False):
    """Reduce tensors into outputs (None: a new tensor); the outputs (blocking), or a
    handle. Every rank takes the same path: MPI does not match MPI_Allreduce with
    MPI_Iallreduce, so the blocking call only where every rank waits at once."""
    for i, t in enumerate(tensors):
        out = outputs[i]
        if out is None:
            outputs[i] = out = t.clone(memory_format=torch.contiguous_format)
        elif out is not t:
            out.copy_(t)
        if prescale != 1:
            _scale_(out, prescale)
    if len(outputs) == 1:
        groups = [outputs]
    else:  # one fused reduction per dtype and device, in order of appearance
        by_kind: dict = {}
        for out in outputs:
            by_kind.setdefault((out.dtype, out.device), []).append(out)
        groups = list(by_kind.values())
    requests, unpack = [], []
    for members in groups:
        if len(members) == 1:
            flat = members[0]
        else:
            flat = torch.cat([m.reshape(-1) for m in members])
            unpack.append((flat, members))
        name = "avg" if _core_divides(flat, op) else _MPI_OPS[op]
        if everyone_blocking:
            _core.allreduce_(flat, name, comm=comm)
        else:  # on the progress engine, or MPI's own MPI_Iallreduce
            requests.append(_core.iallreduce_(flat, name, comm=comm))
    size = comm.Get_size()

    def finish():
        for flat, members in unpack:
            offset = 0
            for m in members:
                m.copy_(flat[offset:offset + m.numel()].view_as(m))
                offset += m.numel()
        for out in outputs:
            factor = postscale / size if op == Average and not _core_divides(out, op) \
                else postscale
            if factor != 1:
                _scale_(out, factor)
        return outputs

    if blocking:
        try:
            for request in requests:
                request.wait()
            return finish()
        finally:
            timeline.end(event)
    return handles.start(requests, finish, key, event)


_BUCKET_FIELDS = ("op", "dtype", "elements", "device", "wire")


def _bucket_start(flat: torch.Tensor, op: str, process_set: ProcessSet, name: str, wire):
    """DistributedOptimizer's bucket: a negotiated non-blocking all-reduce of a flat buffer
    with fastreduce's op name and wire compression (ranks that have joined take part); its
    request (the fastreduce Request, or a _Submitted one until every rank has submitted it)."""
    comm = _set_comm(process_set, "DistributedOptimizer")
    began = timeline.now()

    def launch(_):
        event = timeline.begin("allreduce", name, began)
        request = _core.iallreduce_(flat, op, comm=comm, compression=wire)
        if event is not None:
            request.add_done_callback(lambda _: timeline.end(event))
        return request

    key = ("bucket", op, str(flat.dtype), flat.numel(), flat.device.type, wire)
    submitted = negotiation.submit(
        comm, key, name, lambda: {"call": "bucket", "name": name,
                                  **dict(zip(_BUCKET_FIELDS, key[1:], strict=True))}, launch)
    return submitted.result if submitted.done and submitted.error is None else \
        _Submitted(comm, submitted)


class _Submitted:
    """A bucket's request while some rank has not submitted it: wait() takes part in the
    ranks' rounds until it runs, then waits for the reduction."""

    __slots__ = ("comm", "submitted")

    def __init__(self, comm, submitted):
        self.comm, self.submitted = comm, submitted

    @property
    def done(self) -> bool:
        return self.test()

    def test(self) -> bool:  # True once failed: wait() raises the error
        submitted = self.submitted
        return submitted.done and (submitted.error is not None or submitted.result.test())

    def wait(self) -> None:
        negotiation.wait(self.comm, self.submitted)
        self.submitted.result.wait()

    def add_done_callback(self, fn) -> None:
        def launched(submitted) -> None:
            if submitted.error is not None:
                fn(self)  # done: wait() raises the error
            else:
                submitted.result.add_done_callback(lambda _: fn(self))

        if self.submitted.done:
            launched(self.submitted)
        else:
            self.submitted.callbacks.append(launched)


class _Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, op, prescale, postscale, process_set):
        ctx.args = (op, prescale, postscale, process_set)
        return _allreduce_start([tensor], [None], name, op, prescale, postscale, process_set,
                                "allreduce", blocking=True)[0]

    @staticmethod
    def backward(ctx, grad):
        op, prescale, postscale, process_set = ctx.args
        return (allreduce(grad.contiguous(), op=op, prescale_factor=prescale,
                          postscale_factor=postscale, process_set=process_set),
                None, None, None, None, None)


def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                    postscale_factor=1.0, process_set=global_process_set) -> int:
    """Start reducing tensor over the process set into a new tensor; a handle."""
    op = _op_of(op, average, "allreduce_async")
    name = _name("allreduce", name, process_set)
    return handles.first_only(_allreduce_start([tensor], [None], name, op, prescale_factor,
                                               postscale_factor, process_set, "allreduce"))


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                     postscale_factor=1.0, process_set=global_process_set) -> int:
    """Start reducing tensor in place over the process set; a handle."""
    op = _op_of(op, average, "allreduce_async_")
    name = _name("allreduce", name, process_set)
    return handles.first_only(_allreduce_start([tensor], [tensor], name, op, prescale_factor,
                                               postscale_factor, process_set, "allreduce"))


def allreduce(tensor, average=None, name=None, compression=Compression.none, op=None,
              prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set):
    """The tensor reduced (default: averaged) over the process set; differentiable."""
    op = Average if op is None and average is None else _op_of(op, average, "allreduce")
    named = name is not None
    name = _name("allreduce", name, process_set)
    if compression is Compression.none and type(tensor) is torch.Tensor and \
            not (tensor.requires_grad and torch.is_grad_enabled()):
        out = _fast_allreduce(tensor, name, op, prescale_factor, postscale_factor, process_set,
                              False, named)
        if out is not _SLOW:
            return out
    if compression is Compression.none:
        compressed, context = tensor, None
    else:
        compressed, context = compression.compress(tensor)
    if torch.is_grad_enabled() and isinstance(compressed, torch.Tensor) and \
            compressed.requires_grad:
        out = _Allreduce.apply(compressed, name, op, prescale_factor, postscale_factor,
                               process_set)
    else:
        out = _allreduce_start([compressed], [None], name, op, prescale_factor,
                               postscale_factor, process_set, "allreduce", blocking=True)[0]
    return out if compression is Compression.none else compression.decompress(out, context)


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
               postscale_factor=1.0, process_set=global_process_set):
    """Reduce tensor in place over the process set; returns tensor."""
    op = Average if op is None and average is None else _op_of(op, average, "allreduce_")
    named = name is not None
    name = _name("allreduce", name, process_set)
    out = _fast_allreduce(tensor, name, op, prescale_factor, postscale_factor, process_set, True,
                          named)
    if out is not _SLOW:
        return out
    return _allreduce_start([tensor], [tensor], name, op, prescale_factor, postscale_factor,
                            process_set, "allreduce", blocking=True)[0]


def _like(t):
    return torch.empty_like(t) if isinstance(t, torch.Tensor) else t


def _grouped_start(tensors, outputs, average, name, op, prescale, postscale, process_set,
                   what, blocking=False):
    op = _op_of(op, average, what)
    tensors = list(tensors)
    return _allreduce_start(tensors, outputs if outputs is not None else [None] * len(tensors),
                            _name("grouped_allreduce", name, process_set), op, prescale,
                            postscale, process_set, "grouped_allreduce", blocking)


def grouped_allreduce_async(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                            postscale_factor=1.0, process_set=global_process_set) -> int:
    """Start reducing a list of tensors as one fused operation; a handle (a list)."""
    return _grouped_start(tensors, None, average, name, op, prescale_factor, postscale_factor,
                          process_set, "grouped_allreduce_async")


def grouped_allreduce_async_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                             postscale_factor=1.0, process_set=global_process_set) -> int:
    """Start reducing a list of tensors in place as one fused operation; a handle."""
    tensors = list(tensors)
    return _grouped_start(tensors, tensors, average, name, op, prescale_factor,
                          postscale_factor, process_set, "grouped_allreduce_async_")


class _GroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, op, prescale, postscale, process_set, *tensors):
        ctx.args = (op, prescale, postscale, process_set)
        return tuple(_grouped_start(tensors, None, None, name, op, prescale, postscale,
                                    process_set, "grouped_allreduce", blocking=True))

    @staticmethod
    def backward(ctx, *grads):
        op, prescale, postscale, process_set = ctx.args
        reduced = grouped_allreduce([g.contiguous() for g in grads], op=op,
                                    prescale_factor=prescale, postscale_factor=postscale,
                                    process_set=process_set)
        return (None, None, None, None, None, *reduced)


def grouped_allreduce(tensors, average=None, name=None, compression=Compression.none, op=None,
                      prescale_factor=1.0, postscale_factor=1.0,
                      process_set=global_process_set) -> list:
    """The tensors reduced over the process set as one fused operation; differentiable."""
    op = _op_of(op, average, "grouped_allreduce")
    pairs = [compression.compress(t) for t in tensors]
    compressed = [c for c, _ in pairs]
    if torch.is_grad_enabled() and any(c.requires_grad for c in compressed):
        outs = _GroupedAllreduce.apply(_name("grouped_allreduce", name, process_set), op,
                                       prescale_factor, postscale_factor, process_set,
                                       *compressed)
    else:
        outs = _grouped_start(compressed, None, None, name, op, prescale_factor,
                              postscale_factor, process_set, "grouped_allreduce", blocking=True)
    return [compression.decompress(o, ctx) for o, (_, ctx) in zip(outs, pairs, strict=True)]


def grouped_allreduce_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                       postscale_factor=1.0, process_set=global_process_set) -> list:
    """Reduce the tensors in place as one fused operation; returns them."""
    tensors = list(tensors)
    return _grouped_start(tensors, tensors, average, name, op, prescale_factor,
                          postscale_factor, process_set, "grouped_allreduce_", blocking=True)


# -- movement: allgather, broadcast, alltoall, reducescatter -------------------------------------

def _done(name, comm, result, event) -> int:
    """A handle for an operation complete already (its result)."""
    return handles.start([], lambda: result, (id(comm), name), event)


def _movement(kind, name, comm, began, run, tensor):
    """launch() for a collective's data movement run(comm): run at once where every rank
    waits for it (its result), else a handle (_handle)."""
    def launch(everyone_blocking: bool):
        event = timeline.begin(kind, name, began)
        if not everyone_blocking:
            return _handle(name, comm, run, event, tensor)
        try:
            return run(comm)
        finally:
            timeline.end(event)

    return launch


def _handle(name, comm, run, event, tensor) -> int:
    """A handle for run(comm), the collective's data movement, every rank having submitted
    it. For a CPU tensor with the progress engine on, it runs on the engine's thread and
    its duplicate of comm, in submission order on every rank, so poll() is False until it
    is done; else at once (a CUDA tensor's copies stay on the caller's stream)."""
    if tensor.device.type == "cpu" and _engine.state()[0]:
        dup = _core.engine_comm(comm)
        box: list = []
        job = _engine.submit_call(lambda: box.append(run(dup)))
        return handles.start([job], lambda: box[0], (id(comm), name), event)  # a Job: test, wait
    return _done(name, comm, run(comm), event)


def _allgather_now(comm, tensor, rows_everywhere=None):
    """The compiled core's all-gather of tensor's rows (dim 0 may differ across ranks:
    MPI_Allgatherv; MPI_Allgather where it does not), on the tensor's device; the output
    and every rank's rows."""
    rows = tensor.shape[0] if tensor.dim() else 1
    if rows_everywhere is None:
        everyone = np.empty(comm.Get_size(), np.int64)
        _core.allgather(np.array([rows], np.int64), comm=comm, out=everyone)
        rows_everywhere = everyone.tolist()
    counts = rows_everywhere
    row = math.prod(tensor.shape[1:])
    trailing = tuple(tensor.shape[1:]) if tensor.dim() else ()
    out = None if row else torch.empty((sum(counts), *trailing), dtype=tensor.dtype,
                                       device=tensor.device)
    out = _core.allgather(tensor, comm=comm, out=out, counts=[c * row for c in counts])
    return out, counts


def _allgather_start(tensor, name, process_set, kind="allgather", blocking=False):
    comm = _set_comm(process_set, kind)
    began = timeline.now()

    def validate():
        _check_tensor(tensor, f"hvd.{kind}")
        if tensor.dim() == 0:
            raise ValueError(f"fastreduce.horovod: hvd.{kind} needs a tensor of at least one "
                             f"dimension (it concatenates on the first)")

    return _submit(comm, lambda: (kind, str(tensor.dtype), tuple(tensor.shape[1:]),
                                  tensor.device.type),
                   ("dtype", "trailing shape", "device"), name, validate,
                   _movement(kind, name, comm, began, lambda c: _allgather_now(c, tensor)[0],
                             tensor), blocking)


def allgather_async(tensor, name=None, process_set=global_process_set) -> int:
    """Start concatenating every rank's tensor on dimension 0; a handle."""
    return _allgather_start(tensor, _name("allgather", name, process_set), process_set)


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, process_set):
        ctx.rows = tensor.shape[0]
        ctx.process_set = process_set
        return _allgather_start(tensor, name, process_set, blocking=True)

    @staticmethod
    def backward(ctx, grad):
        reduced = allreduce(grad.contiguous(), op=Average, process_set=ctx.process_set)
        rows = allgather(torch.tensor([ctx.rows], dtype=torch.int64),
                         process_set=ctx.process_set).tolist()
        offset = sum(rows[:ctx.process_set.rank()])
        return reduced.narrow(0, offset, ctx.rows), None, None


def allgather(tensor, name=None, process_set=global_process_set):
    """Every rank's tensor concatenated on dimension 0 (which may differ); differentiable."""
    name = _name("allgather", name, process_set)
    if torch.is_grad_enabled() and isinstance(tensor, torch.Tensor) and tensor.requires_grad:
        return _Allgather.apply(tensor, name, process_set)
    return _allgather_start(tensor, name, process_set, blocking=True)


def grouped_allgather_async(tensors, name=None, process_set=global_process_set) -> int:
    """Start allgathers of a list of tensors; a handle (a list of outputs)."""
    name = _name("grouped_allgather", name, process_set)
    started = _start_each(lambda i, t: _allgather_start(
        t, f"{name}.{i}", process_set, "grouped_allgather"), tensors)
    return _grouped(started, ("grouped_allgather", name))


class _Part:
    """A grouped handle's view of one of its parts' handles: test() and wait() only wait;
    the part's error is raised by the grouped handle's synchronize()."""

    __slots__ = ("handle",)

    def __init__(self, handle: int):
        self.handle = handle

    def test(self) -> bool:
        return handles.poll(self.handle)

    def wait(self) -> None:
        try:
            handles.wait(self.handle)
        except Exception:  # noqa: BLE001  (synchronize_all raises it, after the others)
            pass


def _synchronize_all(started: list[int]) -> list:
    """Every handle of `started` synchronized, even after one raises; their results, or
    the first error."""
    results, error = [], None
    for h in started:
        try:
            results.append(synchronize(h))
        except Exception as exc:  # noqa: BLE001  (raised below, once all are finished)
            error = error or exc
    if error is not None:
        raise error
    return results


def _start_each(start, items) -> list[int]:
    """start(i, item) for each item; if one raises, those started are finished first."""
    started: list[int] = []
    try:
        for i, item in enumerate(items):
            started.append(start(i, item))
    except BaseException:
        try:
            _synchronize_all(started)
        except Exception:  # noqa: BLE001, S110  (the refusal is the error to report)
            pass
        raise
    return started


def _grouped(started: list[int], key) -> int:
    """One handle for the handles `started`: done when all are, their results a list."""
    return handles.start([_Part(h) for h in started], lambda: _synchronize_all(started), key,
                         None)


def grouped_allgather(tensors, name=None, process_set=global_process_set) -> list:
    """Allgather of each tensor of a list; differentiable."""
    name = _name("grouped_allgather", name, process_set)
    return [allgather(t, f"{name}.{i}", process_set) for i, t in enumerate(tensors)]


def _broadcast_start(tensor, output, root_rank, name, process_set, kind="broadcast",
                     blocking=False):
    comm = _set_comm(process_set, kind)
    began = timeline.now()
    ranks = process_set.ranks

    def validate():
        _check_tensor(tensor, f"hvd.{kind}")
        if root_rank not in ranks:
            raise ValueError(f"fastreduce.horovod: hvd.{kind}: root_rank {root_rank} is not in "
                             f"the process set (ranks {ranks})")

    def run(c):
        if output is not tensor:
            output.copy_(tensor)
        return _core.broadcast_(output, ranks.index(root_rank), comm=c)

    return _submit(comm, lambda: (kind, str(tensor.dtype), tuple(tensor.shape),
                                  int(root_rank), tensor.device.type),
                   ("dtype", "shape", "root rank", "device"), name, validate,
                   _movement(kind, name, comm, began, run, output), blocking)


def broadcast_async(tensor, root_rank, name=None, process_set=global_process_set) -> int:
    """Start broadcasting root_rank's tensor into a new tensor; a handle."""
    return _broadcast_start(tensor, _like(tensor), root_rank, _name("broadcast", name, process_set),
                            process_set)


def broadcast_async_(tensor, root_rank, name=None, process_set=global_process_set) -> int:
    """Start broadcasting root_rank's tensor into tensor on every rank; a handle."""
    return _broadcast_start(tensor, tensor, root_rank, _name("broadcast", name, process_set),
                            process_set)


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, root_rank, name, process_set):
        ctx.root_rank = root_rank
        ctx.process_set = process_set
        return _broadcast_start(tensor, torch.empty_like(tensor), root_rank, name, process_set,
                                blocking=True)

    @staticmethod
    def backward(ctx, grad):
        from .basics import rank

        reduced = allreduce(grad.contiguous(), op=Average, process_set=ctx.process_set)
        if rank() != ctx.root_rank:
            reduced = reduced * 0
        return reduced, None, None, None


def broadcast(tensor, root_rank, name=None, process_set=global_process_set):
    """root_rank's tensor, on every rank of the process set; differentiable."""
    name = _name("broadcast", name, process_set)
    if torch.is_grad_enabled() and isinstance(tensor, torch.Tensor) and tensor.requires_grad:
        return _Broadcast.apply(tensor, root_rank, name, process_set)
    return _broadcast_start(tensor, _like(tensor), root_rank, name, process_set, blocking=True)


def broadcast_(tensor, root_rank, name=None, process_set=global_process_set):
    """Broadcast root_rank's tensor into tensor on every rank; returns tensor."""
    return _broadcast_start(tensor, tensor, root_rank, _name("broadcast", name, process_set),
                            process_set, blocking=True)


def _splits_list(splits, rows: int, size: int, what: str) -> list[int]:
    if splits is None:
        if rows % size:
            raise ValueError(f"fastreduce.horovod: hvd.{what}: {rows} rows do not divide among "
                             f"{size} ranks; give splits")
        return [rows // size] * size
    if isinstance(splits, torch.Tensor) and splits.dtype != torch.int32:
        raise ValueError(f"fastreduce.horovod: hvd.{what}: splits of {splits.dtype}; give a "
                         f"torch.int32 tensor (or a list of ints)")
    values = splits.tolist() if isinstance(splits, torch.Tensor) else list(splits)
    if not all(isinstance(v, (int, np.integer)) for v in values):
        raise ValueError(f"fastreduce.horovod: hvd.{what}: splits {values} must be ints")
    if len(values) != size or any(int(v) < 0 for v in values) or sum(values) != rows:
        raise ValueError(f"fastreduce.horovod: hvd.{what}: splits {values} must be {size} "
                         f"non-negative row counts summing to the tensor's {rows} rows")
    return [int(v) for v in values]


def _alltoall_start(tensor, splits, name, process_set, blocking=False):
    comm = _set_comm(process_set, "alltoall")
    began = timeline.now()
    size = comm.Get_size()
    sends: list[int] = []

    def validate():
        _check_tensor(tensor, "hvd.alltoall")
        if tensor.dim() == 0:
            raise ValueError("fastreduce.horovod: hvd.alltoall needs a tensor of at least one "
                             "dimension (it splits the first)")
        sends.extend(_splits_list(splits, tensor.shape[0], size, "alltoall"))


    def run(c):
        # every rank's splits, so that all tell alike when every part is the same size
        matrix = np.empty((size, size), np.int64)
        c.Allgather(np.asarray(sends, np.int64), matrix)
        received = matrix[:, c.Get_rank()].copy()
        row = math.prod(tensor.shape[1:])
        out = None if row else torch.empty((int(received.sum()), *tensor.shape[1:]),
                                           dtype=tensor.dtype, device=tensor.device)
        if (matrix == matrix[0, 0]).all():  # MPI_Alltoall (pipelined when staged)
            out = _core.alltoall(tensor, comm=c, out=out)
        else:
            out = _core.alltoall(tensor, comm=c, out=out, send_counts=[s * row for s in sends],
                                 recv_counts=[int(r) * row for r in received])
        return out, torch.from_numpy(received.astype(np.int32))

    return _submit(comm, lambda: ("alltoall", str(tensor.dtype), tuple(tensor.shape[1:]),
                                  tensor.device.type),
                   ("dtype", "trailing shape", "device"), name, validate,
                   _movement("alltoall", name, comm, began, run, tensor), blocking)


def alltoall_async(tensor, splits=None, name=None, process_set=global_process_set) -> int:
    """Start an alltoall; synchronize() returns (output, received splits)."""
    return _alltoall_start(tensor, splits, _name("alltoall", name, process_set), process_set)


class _Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, splits, name, process_set):
        out, received = _alltoall_start(tensor, splits, name, process_set, blocking=True)
        ctx.received = received
        ctx.process_set = process_set
        ctx.mark_non_differentiable(received)
        return out, received

    @staticmethod
    def backward(ctx, grad, _):
        back, _ = alltoall(grad.contiguous(), splits=ctx.received, process_set=ctx.process_set)
        return back, None, None, None


def alltoall(tensor, splits=None, name=None, process_set=global_process_set):
    """Rows of tensor sent to each rank by splits (default: equal); the rows received, and
    with splits given also the received splits; differentiable."""
    name = _name("alltoall", name, process_set)
    if torch.is_grad_enabled() and isinstance(tensor, torch.Tensor) and tensor.requires_grad:
        out, received = _Alltoall.apply(tensor, splits, name, process_set)
    else:
        out, received = _alltoall_start(tensor, splits, name, process_set, blocking=True)
    return out if splits is None else (out, received)


def _reducescatter_start(tensor, name, op, prescale, postscale, process_set,
                         kind="reducescatter", blocking=False):
    comm = _set_comm(process_set, kind)
    began = timeline.now()
    size, me = comm.Get_size(), comm.Get_rank()

    def validate():
        _check_tensor(tensor, f"hvd.{kind}")
        if op not in (Average, Sum, Min, Max, Product):
            raise HorovodArgumentError(f"fastreduce.horovod: hvd.{kind}: op "
                                       f"{_OP_NAMES.get(op, op)} is not supported; use "
                                       f"hvd.Average or hvd.Sum")
        _check_reduction(tensor, op, f"hvd.{kind}")
        if tensor.dim() == 0:
            raise ValueError(f"fastreduce.horovod: hvd.{kind} needs a tensor of at least one "
                             f"dimension (it splits the first)")

    def run(c):
        rows = tensor.shape[0]
        mine = [rows // size + (1 if r < rows % size else 0) for r in range(size)]
        row = math.prod(tensor.shape[1:])
        src = tensor if prescale == 1 else tensor.clone()  # the core only reads its input
        _scale_(src, prescale)
        out = None if row else torch.empty((mine[me], *tensor.shape[1:]),
                                           dtype=tensor.dtype, device=tensor.device)
        out = _core.reduce_scatter(src, _MPI_OPS[op], comm=c, out=out,
                                   counts=[m * row for m in mine])
        _scale_(out, postscale / size if op == Average else postscale)
        return out

    return _submit(comm, lambda: (kind, str(tensor.dtype), tuple(tensor.shape),
                                  _OP_NAMES.get(op, op), float(prescale), float(postscale),
                                  tensor.device.type),
                   ("dtype", "shape", "op", "prescale", "postscale", "device"), name, validate,
                   _movement(kind, name, comm, began, run, tensor), blocking)


def reducescatter_async(tensor, name=None, op=Average, process_set=global_process_set,
                        prescale_factor=1.0, postscale_factor=1.0) -> int:
    """Start a reduce-scatter over dimension 0 (the first rows % size ranks get one row
    more); a handle."""
    return _reducescatter_start(tensor, _name("reducescatter", name, process_set), op,
                                prescale_factor, postscale_factor, process_set)


def _reducescatter_grad(grad: torch.Tensor, op, prescale, postscale, process_set):
    """The gradient Horovod defines for a reduce-scatter: every rank's incoming gradient
    gathered, scaled as the forward pass was (Sum: also by the set's size; Average: not
    divided)."""
    factor = (process_set.size() if op == Sum else 1) * prescale * postscale
    grad = grad.contiguous()
    return allgather(grad * factor if factor != 1 else grad, process_set=process_set)


class _Reducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, op, prescale, postscale, process_set):
        ctx.args = (op, prescale, postscale, process_set)
        return _reducescatter_start(tensor, name, op, prescale, postscale, process_set,
                                    blocking=True)

    @staticmethod
    def backward(ctx, grad):
        return _reducescatter_grad(grad, *ctx.args), None, None, None, None, None


def reducescatter(tensor, name=None, compression=Compression.none, op=Average,
                  process_set=global_process_set, prescale_factor=1.0, postscale_factor=1.0):
    """tensor reduced over the process set, this rank's share of dimension 0;
    differentiable."""
    name = _name("reducescatter", name, process_set)
    compressed, context = compression.compress(tensor)
    if torch.is_grad_enabled() and compressed.requires_grad:
        out = _Reducescatter.apply(compressed, name, op, prescale_factor, postscale_factor,
                                   process_set)
    else:
        out = _reducescatter_start(compressed, name, op, prescale_factor, postscale_factor,
                                   process_set, blocking=True)
    return compression.decompress(out, context)


def grouped_reducescatter_async(tensors, name=None, op=Average, process_set=global_process_set,
                                prescale_factor=1.0, postscale_factor=1.0) -> int:
    """Start reduce-scatters of a list of tensors; a handle (a list of outputs)."""
    name = _name("grouped_reducescatter", name, process_set)
    started = _start_each(lambda i, t: _reducescatter_start(
        t, f"{name}.{i}", op, prescale_factor, postscale_factor, process_set,
        "grouped_reducescatter"), tensors)
    return _grouped(started, ("grouped_reducescatter", name))


def grouped_reducescatter(tensors, name=None, compression=Compression.none, op=Average,
                          process_set=global_process_set, prescale_factor=1.0,
                          postscale_factor=1.0) -> list:
    """Reduce-scatter of each tensor of a list; differentiable."""
    name = _name("grouped_reducescatter", name, process_set)
    return [reducescatter(t, f"{name}.{i}", compression, op, process_set, prescale_factor,
                          postscale_factor) for i, t in enumerate(tensors)]


# -- sparse, barrier, join --------------------------------------------------------------------

def sparse_allreduce_async(tensor, name, op,
                           process_set=global_process_set) -> Callable[[], torch.Tensor]:
    """Start reducing a sparse COO tensor (allgather of indices and values); as Horovod's,
    a handle to call: handle() waits and returns the coalesced sparse result."""
    if not isinstance(tensor, torch.Tensor) or tensor.layout != torch.sparse_coo:
        raise ValueError("fastreduce.horovod: sparse_allreduce_async takes a sparse COO tensor")
    if op not in (Average, Sum):
        raise ValueError(f"fastreduce.horovod: sparse_allreduce_async: op "
                         f"{_OP_NAMES.get(op, op)} is not supported; use hvd.Average or hvd.Sum")
    name = _name("sparse_allreduce", name, process_set)
    t = tensor.coalesce()
    parts = {"indices": t.indices().t().contiguous(), "values": t.values().contiguous()}
    indices, values = _start_each(lambda _, part: _allgather_start(
        parts[part], f"{name}.{part}", process_set), parts)

    def handle() -> torch.Tensor:
        where, gathered = _synchronize_all([indices, values])
        if op == Average:
            gathered = gathered / process_set.size()
        return torch.sparse_coo_tensor(where.t(), gathered, t.shape).coalesce()

    return handle


def barrier(process_set=global_process_set) -> None:
    """Wait until every rank of the process set has reached the barrier."""
    comm = _set_comm(process_set, "barrier")

    def launch(everyone_blocking: bool):
        comm.Barrier()  # at once on every rank, in the round that runs it
        return None if everyone_blocking else _done("barrier", comm, None, None)

    _submit(comm, lambda: ("barrier",), (), "barrier", lambda: None, launch, blocking=True)


_after_join: list[Callable[[], None]] = []  # called on every rank as join() returns


def join(device=-1) -> int:
    """This rank has no more data: it takes part (with zeros) in the other ranks' allreduce
    (hvd.Average, hvd.Sum), barrier and DistributedOptimizer reductions on the global
    process set until every rank has joined; returns the last rank to join. Other
    collectives raise HorovodInternalError on the active ranks meanwhile, as in Horovod.
    Zeros go where the others' tensors are: the CPU, or CUDA device `device` (-1: the
    current one). Collectives on other process sets are not joined."""
    comm = _set_comm(global_process_set, "join")
    joined_at = time.time_ns() // 1000
    negotiation.drain(comm)  # this rank's own requests run with its data, not zeros
    while True:
        followed = negotiation.follow(comm, joined_at)
        if followed[0] == "joined":
            for fn in _after_join:
                fn()
            return followed[1]
        take_part, names = followed
        for name in names:  # unnamed calls stay numbered alike on every rank
            kind, number = unnamed_number(name)
            if kind is not None:
                negotiation.follow_numbering(comm, {kind: number + 1})
        for fields in take_part:
            _take_part(comm, fields, device)


def _take_part(comm, fields: dict, device) -> None:
    """A joined rank's part in a collective the others run (described by fields)."""
    call = fields["call"]

    def place(kind: str) -> torch.device:
        # the others' device type: it decides the path their reduction takes
        if kind == "cpu":
            return torch.device("cpu")
        index = device if device is not None and device >= 0 else torch.cuda.current_device()
        return torch.device("cuda", index)

    if call == "bucket":
        zeros = torch.zeros(fields["elements"], dtype=_dtype(fields["dtype"]),
                            device=place(fields["device"]))
        _core.iallreduce_(zeros, fields["op"], comm=comm, compression=fields["wire"]).wait()
    elif call in ("allreduce", "grouped_allreduce"):
        op = Average if fields["op"] == "Average" else Sum
        zeros = [torch.zeros(shape, dtype=_dtype(d), device=place(kind))
                 for d, shape, kind in zip(fields["dtype"], fields["shape"], fields["device"],
                                           strict=True)]
        _run_allreduce(comm, zeros, zeros, op, 1.0, 1.0, None, None, blocking=True)
    elif call == "barrier":
        comm.Barrier()
