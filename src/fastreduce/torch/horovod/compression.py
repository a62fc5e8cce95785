"""Gradient compression for `fastreduce.horovod` (Horovod's `hvd.Compression`)."""

from __future__ import annotations

import torch

__all__ = ["Compression", "Compressor", "FP16Compressor", "NoneCompressor"]


class Compressor:
    """Base of the compressors: `compress` before the reduction, `decompress` after it."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, object]:
        """Return the tensor to send and the context `decompress` needs."""
        raise NotImplementedError("fastreduce.horovod: a Compressor must define compress()")

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: object) -> torch.Tensor:
        """Return the reduced tensor in its original form."""
        raise NotImplementedError("fastreduce.horovod: a Compressor must define decompress()")


class NoneCompressor(Compressor):
    """Send tensors as they are."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, object]:
        """Return `tensor` unchanged."""
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: object) -> torch.Tensor:
        """Return `tensor` unchanged."""
        return tensor


class FP16Compressor(Compressor):
    """Send floating-point tensors as float16 and cast the result back."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, object]:
        """Cast a floating-point tensor to float16; the context is its original dtype."""
        dtype = tensor.dtype
        if dtype.is_floating_point and dtype != torch.float16:
            return tensor.to(torch.float16), dtype
        return tensor, dtype

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: object) -> torch.Tensor:
        """Cast back to the dtype recorded by `compress`."""
        if ctx is not None and tensor.dtype != ctx:
            return tensor.to(ctx)
        return tensor


class Compression:
    """The available compressors: `Compression.none` and `Compression.fp16`."""

    none = NoneCompressor
    fp16 = FP16Compressor
