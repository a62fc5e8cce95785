"""`fastreduce.gradsync`: the public name of `fastreduce.torch.gradsync` (the same module)."""

import sys

from .torch import gradsync

sys.modules[__name__] = gradsync
