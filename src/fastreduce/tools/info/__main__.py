"""`python -m fastreduce.tools.info` (or `python -m fastreduce.info`): run fastreduce-info."""

import sys

from . import main

sys.exit(main())
