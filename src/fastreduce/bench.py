"""`fastreduce.bench`: the public name of `fastreduce.tools.benchmark` (the same module);
`python -m fastreduce.bench` runs it."""

import sys

from .tools import benchmark

if __name__ == "__main__":
    sys.exit(benchmark.main())
sys.modules[__name__] = benchmark
