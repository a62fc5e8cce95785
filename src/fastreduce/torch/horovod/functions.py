"""Broadcasts of parameters, optimizer state and Python objects; allgather of objects."""

from __future__ import annotations

import pickle

import torch

from ...errors import HorovodInternalError
from .basics import rank
from .ops import allgather, broadcast_, broadcast_async_, synchronize
from .process_sets import global_process_set

__all__ = ["allgather_object", "broadcast_object", "broadcast_optimizer_state",
           "broadcast_parameters"]


def broadcast_parameters(params, root_rank: int, process_set=global_process_set) -> None:
    """Copy root_rank's tensors to every rank, in place: a state_dict, or a list (or other
    iterable) of tensors or of (name, tensor) pairs such as model.named_parameters()."""
    if isinstance(params, dict):
        items = sorted(params.items())
    elif isinstance(params, torch.Tensor):
        raise ValueError("fastreduce.horovod: broadcast_parameters takes a state_dict or a list "
                         "of tensors, not a single tensor; use hvd.broadcast_(tensor, root_rank)")
    else:
        try:
            items = [p if isinstance(p, tuple) else (None, p) for p in params]
        except TypeError:
            raise ValueError(f"fastreduce.horovod: broadcast_parameters takes a state_dict or a "
                             f"list of tensors or (name, tensor) pairs, not "
                             f"{type(params).__qualname__}") from None
    for name, p in items:
        if not isinstance(p, torch.Tensor):
            raise ValueError(f"fastreduce.horovod: broadcast_parameters: {name or 'an entry'} "
                             f"is a {type(p).__qualname__}, not a tensor")
    handles = []
    try:
        for name, p in items:
            # .data: parameters are leaves that require grad; autograd must not see the copy
            handles.append(broadcast_async_(p.data, root_rank, name=name,
                                            process_set=process_set))
    finally:  # those started are complete or in flight: finish them even after a mismatch
        for handle in handles:
            synchronize(handle)


class _Slot:
    """A tensor's place in a broadcast optimizer state: its index, shape, dtype, device."""

    __slots__ = ("index", "shape", "dtype", "cpu")

    def __init__(self, index: int, tensor: torch.Tensor):
        self.index = index
        self.shape = tuple(tensor.shape)
        self.dtype = tensor.dtype
        self.cpu = tensor.device.type == "cpu"


def _skeleton(obj, tensors: list):
    """obj with every tensor replaced by a _Slot; the tensors appended to `tensors`."""
    if isinstance(obj, torch.Tensor):
        tensors.append(obj)
        return _Slot(len(tensors) - 1, obj)
    if isinstance(obj, dict):
        return {k: _skeleton(v, tensors) for k, v in obj.items()}
    if type(obj) in (list, tuple):
        return type(obj)(_skeleton(v, tensors) for v in obj)
    return obj


def _fill(obj, tensors: list):
    """The skeleton with each _Slot replaced by its tensor."""
    if isinstance(obj, _Slot):
        return tensors[obj.index]
    if isinstance(obj, dict):
        return {k: _fill(v, tensors) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_fill(v, tensors) for v in obj)
    return obj


def _slots(obj, out: list) -> list:
    if isinstance(obj, _Slot):
        out.append(obj)
    elif isinstance(obj, dict):
        for v in obj.values():
            _slots(v, out)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _slots(v, out)
    return out


def broadcast_optimizer_state(optimizer, root_rank: int, process_set=global_process_set) -> None:
    """Give every rank root_rank's optimizer state and hyper-parameters (lr, momentum...).

    The structure and scalars travel as one pickled object, the state tensors as
    broadcasts; the other ranks then load it with load_state_dict(). As Horovod does, an
    optimizer with no state yet (no step taken) first gets it from one local step with
    every trained parameter's gradient set to zero (a DistributedOptimizer's step without
    its reduction); the gradients stay zero, and the parameters are put back as they were
    (where the optimizer decays weights, SGD's weight_decay or AdamW, that step would move
    them on the ranks with no state only: Horovod's do move). An optimizer that keeps no
    state (SGD without momentum) takes that step at every call. torch.optim.LBFGS is
    refused, as in Horovod (its step needs a closure).
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"fastreduce.horovod: broadcast_optimizer_state takes a torch "
                        f"optimizer, not {type(optimizer).__qualname__}")
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("fastreduce.horovod: broadcast_optimizer_state cannot broadcast "
                         "torch.optim.LBFGS's state (as Horovod); save and load its "
                         "state_dict() with broadcast_object instead")
    error = None
    if not optimizer.state_dict()["state"]:
        try:
            _initialize_state(optimizer)
        except Exception as exc:  # noqa: BLE001  (every rank learns of it below)
            error = exc
    failed = allgather_object(None if error is None else f"{type(error).__name__}: {error}",
                              name="optimizer_state.init", process_set=process_set)
    if error is not None:
        raise error
    if any(failed):
        listing = "; ".join(f"rank {r}: {text}" for r, text in enumerate(failed) if text)
        raise HorovodInternalError(f"fastreduce.horovod: broadcast_optimizer_state: the step "
                                   f"that makes a fresh optimizer's state failed elsewhere "
                                   f"({listing}), so nothing was broadcast")
    is_root = rank() == root_rank
    tensors: list = []
    skeleton = _skeleton(optimizer.state_dict(), tensors) if is_root else None
    skeleton = broadcast_object(skeleton, root_rank, name="optimizer_state.layout",
                                process_set=process_set)
    slots = sorted(_slots(skeleton, []), key=lambda s: s.index)
    if not is_root:
        device = None
        params = [p for group in optimizer.param_groups for p in group["params"]]
        if params and params[0].device.type != "cpu":
            device = params[0].device
        tensors = [torch.empty(s.shape, dtype=s.dtype, device="cpu" if s.cpu else device)
                   for s in slots]
    handles = []
    try:
        for s, t in zip(slots, tensors, strict=True):
            handles.append(broadcast_async_(t if t.is_contiguous() else t.contiguous(),
                                            root_rank, name=f"optimizer_state.{s.index}",
                                            process_set=process_set))
    finally:  # those started are complete or in flight: finish them even after a mismatch
        for handle in handles:
            synchronize(handle)
    if not is_root:
        optimizer.load_state_dict(_fill(skeleton, tensors))


def _initialize_state(optimizer) -> None:
    """Make a fresh optimizer's state: zero gradients (sparse for SparseAdam), then one step
    of the optimizer itself, on this rank alone; the parameters are put back after it."""
    from .optimizer import _DistributedOptimizer

    trained = [p for group in optimizer.param_groups for p in group["params"]
               if p.requires_grad]
    with torch.no_grad():
        kept = [p.detach().clone() for p in trained]
        for p in trained:
            p.grad = torch.zeros_like(p)
            if isinstance(optimizer, torch.optim.SparseAdam):
                p.grad = p.grad.to_sparse()
    try:
        if isinstance(optimizer, _DistributedOptimizer):
            super(_DistributedOptimizer, optimizer).step()
        else:
            optimizer.step()
    finally:
        with torch.no_grad():
            for p, was in zip(trained, kept, strict=True):
                p.copy_(was)


def broadcast_object(obj, root_rank: int = 0, name: str | None = None,
                     process_set=global_process_set):
    """Return root_rank's `obj` on every rank (pickled: its size, then its bytes); the other
    ranks' obj is ignored (None will do)."""
    if name is None:  # not the object's type, which differs where non-root ranks pass None
        name = "broadcast_object"
    error = None
    if rank() == root_rank:
        try:
            payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
            nbytes = torch.tensor([payload.numel()], dtype=torch.int64)
        except Exception as exc:  # noqa: BLE001  (every rank learns of it below)
            error, nbytes = exc, torch.tensor([-1], dtype=torch.int64)
    else:
        nbytes = torch.zeros(1, dtype=torch.int64)
    broadcast_(nbytes, root_rank, name=f"{name}.sz", process_set=process_set)
    if error is not None:
        raise error
    if nbytes.item() < 0:
        raise ValueError(f"fastreduce.horovod: broadcast_object: rank {root_rank} could not "
                         f"pickle its object (it raised the error)")
    if rank() != root_rank:
        payload = torch.empty(int(nbytes.item()), dtype=torch.uint8)
    broadcast_(payload, root_rank, name=f"{name}.t", process_set=process_set)
    if rank() == root_rank:
        return obj
    return pickle.loads(payload.numpy().tobytes())


def allgather_object(obj, name: str | None = None, process_set=global_process_set) -> list:
    """Return every rank's `obj`, in rank order (pickled: the sizes, then the bytes)."""
    if name is None:
        name = "allgather_object"
    try:
        payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        error = None
    except Exception as exc:  # noqa: BLE001  (every rank learns of it below)
        payload, error = torch.empty(0, dtype=torch.uint8), exc
    sizes = allgather(torch.tensor([-1 if error else payload.numel()], dtype=torch.int64),
                      name=f"{name}.sz", process_set=process_set).tolist()
    if error is not None:
        raise error
    if min(sizes) < 0:
        failed = [r for r, n in enumerate(sizes) if n < 0]
        raise ValueError(f"fastreduce.horovod: allgather_object: ranks {failed} of the process "
                         f"set could not pickle their objects (they raised the error)")
    gathered = allgather(payload, name=f"{name}.t", process_set=process_set).numpy()
    out, start = [], 0
    for n in sizes:
        out.append(pickle.loads(gathered[start:start + n].tobytes()))
        start += n
    return out
