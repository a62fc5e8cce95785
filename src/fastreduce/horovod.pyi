"""fastreduce.horovod: fastreduce.torch.horovod (Horovod's torch API) under its public name.

At run time the finder in __init__.py serves that module itself under this name;
this stub names it for type checkers."""

from .torch.horovod import *  # noqa: F403
