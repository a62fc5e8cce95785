"""fastreduce.horovod: fastreduce.torch.horovod (Horovod's torch API) under its public name.

At run time the finder in __init__.py serves that module itself under this name, and this
file never runs; it is what type checkers and editors read for the name."""

from .torch.horovod import *  # noqa: F403
