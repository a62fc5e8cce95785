"""fastreduce.distributed: fastreduce.torch.distributed (the backend) under its public name.

At run time the finder in __init__.py serves that module itself under this name;
this stub names it for type checkers."""

from .torch.distributed import *  # noqa: F403
