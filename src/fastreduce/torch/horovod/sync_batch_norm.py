"""`hvd.SyncBatchNorm`: batch normalization whose statistics cover the batches of all ranks.

Forward: each rank's count, mean and sum of squared deviations per channel are allgathered
and combined exactly (Chan et al.'s pairwise formula), so ranks may hold batches of
different sizes. Backward: the per-channel sums of dy and dy * x_hat are summed over the
ranks, which gives each rank its slice of the gradient of the whole batch's loss; the
weight and bias gradients stay local (DistributedOptimizer averages them, as with Horovod).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from .ops import Sum, allgather, allreduce
from .process_sets import global_process_set

__all__ = ["SyncBatchNorm"]


def _reduce_dims(x: torch.Tensor) -> list[int]:
    return [0] + list(range(2, x.dim()))


def _channel_shape(x: torch.Tensor) -> list[int]:
    return [1, -1] + [1] * (x.dim() - 2)


class _SyncBatchNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, eps, momentum, process_set):
        dims, shape = _reduce_dims(x), _channel_shape(x)
        work = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        channels = x.shape[1]
        count = x.numel() // channels if channels else 0
        if count:
            mean = work.mean(dims)
            m2 = (work - mean.view(shape)).square().sum(dims)
        else:
            mean = m2 = work.new_zeros(channels)
        mine = torch.cat([work.new_tensor([float(count)]), mean, m2]).unsqueeze(0)
        everyone = allgather(mine.detach(), name="sync_batch_norm.stats",
                             process_set=process_set)
        counts, means, m2s = everyone[:, 0], everyone[:, 1:1 + channels], everyone[:, 1 + channels:]
        total = counts.sum()
        if total.item() <= 1:
            raise ValueError(f"fastreduce.horovod: SyncBatchNorm needs more than 1 value per "
                             f"channel over all ranks when training, got "
                             f"{int(total.item())}; use larger batches or eval mode")
        weights = (counts / total).unsqueeze(1)
        global_mean = (weights * means).sum(0)
        global_m2 = (m2s + counts.unsqueeze(1) * (means - global_mean).square()).sum(0)
        var = global_m2 / total
        invstd = torch.rsqrt(var + eps)
        if running_mean is not None:
            with torch.no_grad():
                running_mean.mul_(1 - momentum).add_(global_mean.to(running_mean.dtype),
                                                     alpha=momentum)
                unbiased = global_m2 / (total - 1)
                running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype),
                                                    alpha=momentum)
        xhat = (work - global_mean.view(shape)) * invstd.view(shape)
        y = xhat
        if weight is not None:
            y = y * weight.view(shape).to(y.dtype) + bias.view(shape).to(y.dtype)
        ctx.save_for_backward(xhat, weight, invstd)
        ctx.total = total
        ctx.process_set = process_set
        ctx.has_bias = bias is not None
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, grad_output):
        xhat, weight, invstd = ctx.saved_tensors
        dims, shape = _reduce_dims(xhat), _channel_shape(xhat)
        dy = grad_output.to(xhat.dtype)
        sum_dy = dy.sum(dims)
        sum_dy_xhat = (dy * xhat).sum(dims)
        grad_weight = grad_bias = None
        if weight is not None:
            if ctx.needs_input_grad[1]:
                grad_weight = sum_dy_xhat.to(weight.dtype)
            if ctx.needs_input_grad[2]:
                grad_bias = sum_dy.to(weight.dtype)
        grad_x = None
        if ctx.needs_input_grad[0]:
            both = allreduce(torch.cat([sum_dy, sum_dy_xhat]), op=Sum,
                             name="sync_batch_norm.grads", process_set=ctx.process_set)
            channels = sum_dy.numel()
            mean_dy = (both[:channels] / ctx.total).view(shape)
            mean_dy_xhat = (both[channels:] / ctx.total).view(shape)
            scale = invstd if weight is None else invstd * weight.to(invstd.dtype)
            grad_x = ((dy - mean_dy - xhat * mean_dy_xhat) * scale.view(shape))
            grad_x = grad_x.to(grad_output.dtype)
        return grad_x, grad_weight, grad_bias, None, None, None, None, None


class SyncBatchNorm(_BatchNorm):
    """Batch normalization over the batches of all ranks of `process_set` (any input of
    2 or more dimensions, channels in dimension 1)."""

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1,
                 affine: bool = True, track_running_stats: bool = True,
                 process_set=global_process_set, device=None, dtype=None):
        super().__init__(num_features, eps, momentum, affine, track_running_stats,
                         device=device, dtype=dtype)
        self.process_set = process_set

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"fastreduce.horovod: SyncBatchNorm expects an input of at least 2 "
                             f"dimensions (batch, channels, ...), got {input.dim()}")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """Normalize with the statistics of every rank's batch (training) or the running
        statistics (eval)."""
        self._check_input_dim(input)
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # a cumulative moving average
                factor = 1.0 / float(self.num_batches_tracked)
        if not self.training or self.process_set.size() == 1:
            return F.batch_norm(input, self.running_mean, self.running_var, self.weight,
                                self.bias, self.training or not self.track_running_stats,
                                factor, self.eps)
        running = self.track_running_stats
        return _SyncBatchNormFunction.apply(
            input, self.weight, self.bias, self.running_mean if running else None,
            self.running_var if running else None, self.eps, factor, self.process_set)
