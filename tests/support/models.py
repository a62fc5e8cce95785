"""Small torch models shared by the worker scripts."""

from __future__ import annotations

import torch


class MLP(torch.nn.Module):
    """Four linear layers, one never used and one used on some ranks only (GradientSync's
    unused-parameter cases)."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(
            torch.nn.Linear(a, b, dtype=dtype) for a, b in [(6, 32), (32, 32), (32, 16), (16, 3)])
        self.unused = torch.nn.Linear(4, 4, dtype=dtype)  # never gets a gradient
        self.sometimes = torch.nn.Linear(3, 3, dtype=dtype)  # a gradient on some ranks only

    def forward(self, x, use_sometimes):
        for layer in self.layers[:-1]:
            x = torch.tanh(layer(x))
        x = self.layers[-1](x)
        return self.sometimes(x) if use_sometimes else x
