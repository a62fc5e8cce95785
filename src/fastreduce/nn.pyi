"""fastreduce.nn: fastreduce.torch.nn (the tensor-parallel modules) under its public name.

At run time the finder in __init__.py serves that module itself under this name;
this stub names it for type checkers."""

from .torch.nn import *  # noqa: F403
