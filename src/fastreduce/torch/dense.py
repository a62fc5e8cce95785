"""The check the torch integrations make of a tensor before handing its memory to MPI."""

from __future__ import annotations

import torch

_TENSOR = torch.Tensor
_STRIDED = torch.strided


def check_dense(t, what: str, prefix: str, *, layout_error: type = ValueError,
                contiguity_error: type = ValueError, layout_hint: str = "give a dense tensor",
                device_hint: str = "give a cpu or cuda tensor",
                contiguity_hint: str = "") -> None:
    """Raise unless t is a dense, contiguous CPU or CUDA torch.Tensor; messages start with
    `prefix` and name the argument as `what`."""
    if (t.__class__ is _TENSOR and t.layout == _STRIDED and (t.is_cpu or t.is_cuda)
            and not t.is_quantized and t.is_contiguous()):
        return  # the common case, in the fewest attribute reads
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{prefix}: {what} must be a torch.Tensor, not {type(t).__qualname__}")
    if t.is_quantized:
        raise TypeError(f"{prefix}: {what} is quantized ({t.dtype}); reduce its "
                        f".dequantize() instead")
    if t.layout != torch.strided:
        raise layout_error(f"{prefix}: {what} has layout {t.layout}; {layout_hint}")
    if t.device.type not in ("cpu", "cuda"):
        raise layout_error(f"{prefix}: {what} is on {t.device}; {device_hint}")
    if not t.is_contiguous():
        raise contiguity_error(f"{prefix}: {what} (shape {tuple(t.shape)}) is not contiguous; "
                               f"call .contiguous() first{contiguity_hint}")
