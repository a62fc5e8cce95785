"""`fastreduce.cluster`: the public name of `fastreduce.tools.cluster` (the same module);
`python -m fastreduce.cluster` runs it."""

import sys

from .tools import cluster

if __name__ == "__main__":
    sys.exit(cluster.main())
sys.modules[__name__] = cluster
