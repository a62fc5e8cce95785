"""The per-call choice of an all-reduce algorithm for host memory.

The algorithm decides which MPI calls each rank makes, so every rank of a communicator
must reach the same one. The first all-reduce on each communicator therefore agrees on the
settings with the other ranks and learns the communicator's nodes (collective: the
`agreement` installed at set-up, fastreduce.algorithms.agree); the resulting size table,
the node-local and leaders' communicators are kept in an MPI attribute of the
communicator, so later calls cost one attribute look-up and a table walk. Changing a
setting (forget()) makes each communicator agree again at its next call.

The agreement (set_agreement) returns what every rank of comm agreed on: {"steps":
((start bytes, algorithm name), ...), "segment_bytes", "piece_bytes", "local": node
communicator or None, "leaders": leaders' communicator or None, "cross": the communicator
of this local rank on every node, or None, "ring": a duplicate of comm for the ring's
point-to-point messages, or None}; the communicators become the plan's (freed with comm).
"""

from libc.stdint cimport int64_t
from libc.stdlib cimport free, malloc

from mpi4py cimport MPI

from .commrecord cimport RecordHead, cached_record, fill_steps, keep_record, step_choice
from .libmpi cimport *

cdef extern from "algorithms.h" nogil:
    enum:
        FR_ALGO_MPI
        FR_ALGO_RING
        FR_ALGO_RSAG
        FR_ALGO_HIERARCHICAL

ALGORITHMS = {"mpi": FR_ALGO_MPI, "ring": FR_ALGO_RING, "rsag": FR_ALGO_RSAG,
              "hierarchical": FR_ALGO_HIERARCHICAL}
_NAMES = {code: name for name, code in ALGORITHMS.items()}

cdef extern from *:
    """
    /* The last (communicator, plan) this thread looked up: the hot path skips the attribute
     * look-up. Valid while fr_plan_epoch is unchanged (a plan freed or replaced bumps it). */
    static long long fr_plan_epoch = 0;  /* read and bumped atomically: any thread */
    static inline long long fr_epoch_now(void)
    { return __atomic_load_n(&fr_plan_epoch, __ATOMIC_ACQUIRE); }
    static inline void fr_epoch_bump(void)
    { __atomic_fetch_add(&fr_plan_epoch, 1, __ATOMIC_ACQ_REL); }
    static __thread long long fr_cached_epoch = -1;
    static __thread MPI_Comm fr_cached_comm;
    static __thread void *fr_cached_plan = NULL;
    """
    long long fr_epoch_now() noexcept nogil
    void fr_epoch_bump() noexcept nogil
    long long fr_cached_epoch
    MPI_Comm fr_cached_comm
    void* fr_cached_plan

include "agreement.pxi"

_plan_made = None  # the collectives' hook: plan_made(comm) once a communicator has a plan


def set_plan_hook(hook) -> None:
    """Call hook(comm) (a view of the communicator) after a plan is agreed for it: the
    collectives watch its lifetime from its first collective on."""
    global _plan_made
    _plan_made = hook


cdef int _free_record(MPI_Comm comm, int keyval, void* value, void* extra) noexcept nogil:
    fr_epoch_bump()  # every thread's cached look-up is stale
    cdef Plan* plan = <Plan*>value
    if plan.local != MPI_COMM_NULL:
        MPI_Comm_free(&plan.local)
    if plan.leaders != MPI_COMM_NULL:
        MPI_Comm_free(&plan.leaders)
    if plan.cross != MPI_COMM_NULL:
        MPI_Comm_free(&plan.cross)
    if plan.ring != MPI_COMM_NULL:
        MPI_Comm_free(&plan.ring)
    free(value)
    return MPI_SUCCESS


cdef void _forgotten() noexcept nogil:
    fr_epoch_bump()  # every thread's cached look-up is stale


cdef MPI_Comm _take(object comm) noexcept:
    """The handle of an mpi4py communicator made for a plan (None: MPI_COMM_NULL)."""
    if comm is None:
        return MPI_COMM_NULL
    return (<MPI.Comm>comm).ob_mpi


cdef Plan* _new_plan(dict agreed) except NULL:
    cdef Plan* plan = <Plan*>malloc(sizeof(Plan))
    if plan == NULL:
        raise MemoryError("fastreduce: out of memory for an algorithm table")
    try:
        fill_steps(&plan.table, agreed["steps"], ALGORITHMS, MAX_ALGORITHM_STEPS,
                   "an algorithm table")
        plan.segment_bytes = agreed["segment_bytes"]
        plan.piece_bytes = agreed["piece_bytes"]
    except BaseException:
        free(plan)
        raise
    plan.local = _take(agreed["local"])
    plan.leaders = _take(agreed["leaders"])
    plan.cross = _take(agreed["cross"])
    plan.ring = _take(agreed["ring"])
    return plan


cdef const Plan* plan_for(MPI_Comm handle) except NULL:
    """The communicator's plan: this thread's last look-up, its attribute, else agreed now
    (collective)."""
    global fr_cached_epoch, fr_cached_comm, fr_cached_plan
    cdef long long epoch = fr_epoch_now()
    if fr_cached_epoch == epoch and fr_cached_comm == handle:
        return <const Plan*>fr_cached_plan
    cdef const Plan* plan = _look_up(handle)
    # stamped with the epoch read before the look-up: a plan freed meanwhile is not kept
    fr_cached_epoch, fr_cached_comm, fr_cached_plan = epoch, handle, <void*>plan
    return plan


cdef const Plan* _look_up(MPI_Comm handle) except NULL:
    """The communicator's attribute, else a plan agreed now (collective)."""
    cdef void* kept = _kept(handle)
    if kept != NULL:
        return <const Plan*>kept
    cdef MPI.Intracomm comm = MPI.Intracomm.__new__(MPI.Intracomm)
    comm.ob_mpi = handle  # a view of the handle: not freed with this object
    agreed = _agree_now(comm, "algorithm")
    cdef Plan* plan
    try:
        plan = _new_plan(agreed)
    except BaseException:
        for name in ("local", "leaders", "cross", "ring"):  # the agreement made them for it
            if agreed.get(name) is not None:
                agreed[name].Free()
        raise
    _keep(handle, plan)  # frees an older plan
    if _plan_made is not None:
        _plan_made(comm)
    return plan


cdef int choose_algorithm(const Plan* plan, int64_t nbytes) noexcept nogil:
    """The FR_ALGO_* of the plan's table for a message of nbytes."""
    return step_choice(&plan.table, nbytes)


def plan(comm) -> dict:
    """The communicator's agreed plan (collective at its first use): the size table, the
    mpi algorithm's segment size, the ring's piece size, and whether node communicators
    were made."""
    cdef const Plan* p = plan_for(<MPI_Comm>(<MPI.Comm>comm).ob_mpi)
    cdef int i
    steps = []
    for i in range(p.table.nsteps):
        steps.append((p.table.start[i], _NAMES[p.table.choice[i]]))
    return {
        "steps": tuple(steps),
        "segment_bytes": p.segment_bytes,
        "piece_bytes": p.piece_bytes,
        "nodes_known": p.local != MPI_COMM_NULL,
    }


def choose(comm, int64_t nbytes) -> str:
    """The algorithm an all-reduce of nbytes on comm uses (collective at first use)."""
    return _NAMES[choose_algorithm(plan_for(<MPI_Comm>(<MPI.Comm>comm).ob_mpi), nbytes)]
