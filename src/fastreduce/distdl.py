"""`fastreduce.distdl`: the public name of `fastreduce.torch.distdl` (the same module)."""

import sys

from .torch import distdl

sys.modules[__name__] = distdl
