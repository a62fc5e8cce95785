# The all-reduce algorithm each communicator uses, by message size (see algochoice.pyx).

from libc.stdint cimport int64_t

from .commrecord cimport StepTable
from .libmpi cimport MPI_Comm

cdef enum:
    MAX_ALGORITHM_STEPS = 32

ctypedef struct Plan:
    # What the ranks of one communicator agreed on, for one generation of the settings.
    int64_t generation     # first, as commrecord.pxd requires
    StepTable table         # the size table: FR_ALGO_* by size (MAX_ALGORITHM_STEPS steps)
    int64_t segment_bytes   # the mpi algorithm's segments unless FASTREDUCE_SEGMENT_BYTES
    int64_t piece_bytes     # the ring's message pieces
    MPI_Comm local          # this rank's node (MPI_COMM_NULL: not made)
    MPI_Comm leaders        # one rank per node (MPI_COMM_NULL on the others)
    MPI_Comm cross          # the ranks of this local rank on every node (equal nodes only)
    MPI_Comm ring           # a duplicate of the communicator for the ring's messages

cdef const Plan* plan_for(MPI_Comm handle) except NULL
cdef int choose_algorithm(const Plan* plan, int64_t nbytes) noexcept nogil
