"""`python -m fastreduce.tools.cluster`: the cluster command line."""

import sys

from .cli import main

sys.exit(main())
