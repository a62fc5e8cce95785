"""The compiled core: buffers, reductions, MPI calls, GPU staging and the progress engine.

Each extension module holds one concern; they share C functions through their .pxd
files. Nothing here imports the Python layers above it: settings and hooks are
handed down by them at set-up (`fastreduce.settings`, `fastreduce.checks`,
`fastreduce.watchdog`).
"""

from . import variants as _variants

_variants.use_variant(__path__)  # a wheel's build for the MPI mpi4py loaded
