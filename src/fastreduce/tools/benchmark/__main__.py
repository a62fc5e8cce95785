"""`python -m fastreduce.tools.benchmark`: run fastreduce-bench."""

import sys

from .cli import main

sys.exit(main())
