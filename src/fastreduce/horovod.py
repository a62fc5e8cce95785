"""`fastreduce.horovod`: the public name of `fastreduce.torch.horovod` (the same module)."""

import sys

from .torch import horovod

sys.modules[__name__] = horovod
