"""fastreduce.cluster: fastreduce.tools.cluster (the cluster on one machine) under its public name.

At run time the finder in __init__.py serves that module itself under this name;
this stub names it for type checkers."""

from .tools.cluster import *  # noqa: F403
