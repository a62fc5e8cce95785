"""`fastreduce.autograd`: the public name of `fastreduce.torch.autograd` (the same module)."""

import sys

from .torch import autograd

sys.modules[__name__] = autograd
