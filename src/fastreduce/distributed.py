"""`fastreduce.distributed`: the public name of `fastreduce.torch.distributed` (the same module)."""

import sys

from .torch import distributed

sys.modules[__name__] = distributed
