"""fastreduce.autograd: fastreduce.torch.autograd (the autograd layers) under its public name.

At run time the finder in __init__.py serves that module itself under this name;
this stub names it for type checkers."""

from .torch.autograd import *  # noqa: F403
