"""fastreduce.distdl: fastreduce.torch.distdl (DistDL's names) under its public name.

At run time the finder in __init__.py serves that module itself under this name, and this
file never runs; it is what type checkers and editors read for the name."""

from .torch.distdl import *  # noqa: F403
