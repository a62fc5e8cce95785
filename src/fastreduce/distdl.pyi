"""fastreduce.distdl: fastreduce.torch.distdl (DistDL's names) under its public name.

At run time the finder in __init__.py serves that module itself under this name;
this stub names it for type checkers."""

from .torch.distdl import *  # noqa: F403
