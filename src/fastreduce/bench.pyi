"""fastreduce.bench: fastreduce.tools.benchmark (the benchmark command) under its public name.

At run time the finder in __init__.py serves that module itself under this name;
this stub names it for type checkers."""

from .tools.benchmark import *  # noqa: F403
