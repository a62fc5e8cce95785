"""`fastreduce.ops`: the public name of `fastreduce.torch.custom_ops` (the same module)."""

import sys

from .torch import custom_ops

sys.modules[__name__] = custom_ops
