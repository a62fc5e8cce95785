"""DDP communication hooks that send float32 gradients as 16 bits through fastreduce.

    model.register_comm_hook(None, fastreduce.distributed.bf16_compression_hook)

As torch's ``bf16_compress_hook``/``fp16_compress_hook`` (DDP refuses the first without
CUDA and NCCL, by its name: hence other names here), but on the
fastreduce backend, CPU or CUDA: the bucket is averaged over the group by fastreduce's
all-reduce with ``compression="bf16"`` (or ``"fp16"``), so the ring and hierarchical
algorithms accumulate in float32 and only the wire carries 16 bits. Buckets of other dtypes
are averaged as they are.
"""

# No `from __future__ import annotations`: DDP checks the hooks' return annotation object.
import torch
import torch.distributed as dist

from ...backend import collectives as _collectives
from .processgroup import ProcessGroupFastreduce
from .work import Work

__all__ = ["bf16_compression_hook", "fp16_compression_hook"]


def bf16_compression_hook(state, bucket) -> torch.futures.Future[torch.Tensor]:
    """DDP hook: the bucket averaged with float32 sent as bfloat16 (state: the group or None)."""
    return _compressed_average("bf16", state, bucket)


def fp16_compression_hook(state, bucket) -> torch.futures.Future[torch.Tensor]:
    """DDP hook: the bucket averaged with float32 sent as float16 (state: the group or None)."""
    return _compressed_average("fp16", state, bucket)


def _compressed_average(wire: str, state, bucket) -> torch.futures.Future[torch.Tensor]:
    buffer = bucket.buffer()
    backend = _fastreduce_backend(state, buffer.device)
    request = _collectives.iallreduce_(
        buffer, "avg", comm=backend._comm,
        compression=wire if buffer.dtype == torch.float32 else None)
    if not request.engine:  # MPI's own non-blocking call: nothing else would advance it
        request.wait()
        return Work([buffer]).get_future().then(lambda fut: fut.value()[0])
    return Work([buffer], request=request).get_future().then(lambda fut: fut.value()[0])


def _fastreduce_backend(state, device: torch.device) -> "ProcessGroupFastreduce":
    group = state if state is not None else dist.group.WORLD
    if isinstance(group, ProcessGroupFastreduce):  # the backend is the group itself
        return group
    try:
        backend = group._get_backend(device)
    except (AttributeError, RuntimeError) as exc:
        raise TypeError(f"fastreduce: a compression hook needs a process group of the "
                        f"'fastreduce' backend as its state (or None for the default group), "
                        f"not {state!r} ({exc})") from None
    if not isinstance(backend, ProcessGroupFastreduce):
        raise TypeError(f"fastreduce: a compression hook runs on the 'fastreduce' backend, "
                        f"but the group's backend for {device} is {type(backend).__name__}; "
                        f"init_process_group('fastreduce'), or use torch's own hook")
    return backend
