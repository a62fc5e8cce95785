"""fastreduce.cluster: fastreduce.tools.cluster (the cluster on one machine) under its public name.

At run time the finder in __init__.py serves that module itself under this name, and this
file never runs; it is what type checkers and editors read for the name."""

from .tools.cluster import *  # noqa: F403
