"""`fastreduce.info`: the public name of `fastreduce.tools.info` (the same module);
`python -m fastreduce.info` runs it."""

import sys

from .tools import info

if __name__ == "__main__":
    sys.exit(info.main())
sys.modules[__name__] = info
