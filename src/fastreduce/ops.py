"""fastreduce.ops: fastreduce.torch.custom_ops (the torch.compile custom ops) under its public name.

At run time the finder in __init__.py serves that module itself under this name, and this
file never runs; it is what type checkers and editors read for the name."""

from .torch.custom_ops import *  # noqa: F403
