"""`fastreduce.nn`: the public name of `fastreduce.torch.nn` (the same module)."""

import sys

from .torch import nn

sys.modules[__name__] = nn
