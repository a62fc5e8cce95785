"""Tensor checks, packing and unpacking, and reduce-op translation for the torch.distributed
backend."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from ...backend import collectives as _collectives
from ...errors import BackendError
from ..dense import check_dense

_RedOpType = dist.ReduceOp.RedOpType
_OP_NAMES = {
    _RedOpType.SUM: "sum",
    _RedOpType.AVG: "avg",
    _RedOpType.PRODUCT: "prod",
    _RedOpType.MIN: "min",
    _RedOpType.MAX: "max",
    _RedOpType.BAND: "band",
    _RedOpType.BOR: "bor",
    _RedOpType.BXOR: "bxor",
    _RedOpType.PREMUL_SUM: "sum",  # after multiplying by the op's factor
}


def _op_of(reduce_op) -> tuple[str, object]:
    """(fastreduce op name, PREMUL_SUM factor or None) for a torch ReduceOp."""
    kind = reduce_op.op if isinstance(reduce_op, dist.ReduceOp) else reduce_op
    name = _OP_NAMES.get(kind)
    if name is None:
        raise BackendError(f"fastreduce backend: reduce op {kind} is not supported; use one of "
                           f"SUM, AVG, PRODUCT, MIN, MAX, BAND, BOR, BXOR, PREMUL_SUM")
    if kind != _RedOpType.PREMUL_SUM:
        return name, None
    if not hasattr(reduce_op, "factor"):  # torch older than 2.13 keeps it from Python
        raise BackendError(f"fastreduce backend: PREMUL_SUM needs torch 2.13 or newer, which "
                           f"gives its factor (this is torch {torch.__version__}); multiply "
                           f"by the factor, then reduce with SUM")
    return name, reduce_op.factor


def _premultiply(tensors: Sequence, factor) -> None:
    """PREMUL_SUM's first half: every tensor times factor, once all are known to be valid."""
    for i, t in enumerate(tensors):
        _check_tensor(t, f"tensors[{i}]")
        _collectives.mpi_reduction(t, "sum")  # a dtype SUM refuses is refused before any change
    for t in tensors:
        t.mul_(factor)


def _check_tensor(t, what: str) -> None:
    check_dense(t, what, "fastreduce backend", layout_error=BackendError,
                contiguity_error=BufferError, device_hint="the backend takes cpu and cuda tensors",
                contiguity_hint=" (and copy the result back)")


def _nbytes(t) -> int:
    return t.numel() * t.element_size()


def _joined(tensors: Sequence):
    """A flat view of the tensors when they lie back to back in one storage, in order (as
    list(flat.chunk(n)) makes them); else None."""
    if not tensors:
        return None
    first = tensors[0]
    step = _nbytes(first)
    storage = first.untyped_storage().data_ptr()
    if not all(t.dtype == first.dtype and t.device == first.device and _nbytes(t) == step
               and t.untyped_storage().data_ptr() == storage
               and t.data_ptr() == first.data_ptr() + i * step for i, t in enumerate(tensors)):
        return None
    return first.as_strided((first.numel() * len(tensors),), (1,))


def _packed(tensors: Sequence):
    """The tensors back to back in one flat tensor: a view when they already are, else a
    copy."""
    joined = _joined(tensors)
    return joined if joined is not None else torch.cat([t.reshape(-1) for t in tensors])


def _flat_like(tensors: Sequence):
    """One contiguous tensor holding the tensors' elements back to back (new memory)."""
    first = tensors[0]
    return torch.empty(sum(t.numel() for t in tensors), dtype=first.dtype, device=first.device)


def _unpack(flat, tensors: Sequence) -> None:
    """Copy flat's elements into the tensors, in order (nothing when flat is tensors[0]'s
    memory already, as for consecutive tensors)."""
    if _joined(tensors) is not None and flat.data_ptr() == tensors[0].data_ptr():
        return
    offset = 0
    for t in tensors:
        t.copy_(flat.reshape(-1)[offset:offset + t.numel()].view_as(t))
        offset += t.numel()


def _check_same(tensors: Sequence, like, what, like_what: str = "the input") -> None:
    """Each tensor checked, and of like's dtype and element count; `what` names the list
    (its i-th tensor is what[i]) or is a function of i naming the i-th tensor."""
    for i, t in enumerate(tensors):
        name = what(i) if callable(what) else f"{what}[{i}]"
        _check_tensor(t, name)
        if t.dtype != like.dtype or t.numel() != like.numel():
            raise ValueError(f"fastreduce backend: {name} has {t.numel()} elements of "
                             f"{t.dtype}, {like_what} {like.numel()} of {like.dtype}; they "
                             f"must match")
