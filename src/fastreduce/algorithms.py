"""Which all-reduce algorithm a host message takes, per communicator and size.

The compiled core has four (``backend/algorithms.h``): ``mpi`` (the MPI library's own
MPI_Allreduce, in segments), ``ring`` (reduce-scatter then all-gather with point-to-point
messages, both directions of every link busy), ``rsag`` (MPI_Reduce_scatter_block +
MPI_Allgather) and ``hierarchical`` (where nodes have equal rank counts, a reduce-scatter
in the node, each shard's ring between the nodes and an all-gather in the node; otherwise
MPI_Reduce to one leader per node, the ring between the leaders, MPI_Bcast in the node).
The ring's messages go on a duplicate of the communicator. ``FASTREDUCE_ALGORITHM`` picks
one for every size, or ``auto`` (the default) follows a size table: pinned by
``FASTREDUCE_ALGORITHM_TABLE``, else derived from the communicator's nodes:

- one node: ``mpi`` at every size (shared memory: the library's call is fastest);
- several nodes of one rank each: ``mpi`` below `NETWORK_FROM`, ``ring`` from there;
- several nodes, some with several ranks: ``mpi`` below `NETWORK_FROM`, ``hierarchical``
  from there; on Open MPI ``mpi`` at every size (its own algorithm spreads the traffic
  over more TCP connections than the hierarchical ring has, and measured faster: see
  docs/algorithms.md).

Across nodes the ``mpi`` algorithm's segments are off (one call per message): a segment
costs a round trip of the network. `agree` runs at a communicator's first collective
(collective): every rank must make the same MPI calls, so a difference in these settings,
or in any other setting that chooses a rank's MPI calls (`call_settings`: segments, the
progress engine, 16-bit ops, GPU staging chunks), raises SettingError on every rank,
naming the setting and each rank's value. (Debug mode's check comes before it, so that
collectives issued in different orders are named; FASTREDUCE_DEBUG itself must be the same
on every rank: turning it on is collective.)
"""

from __future__ import annotations

from mpi4py import MPI

from . import agreement, settings, watchdog
from .backend import algochoice, cudart, engine, mpierrors, reduce, reductions
from .errors import SettingError
from .sizes import SizeTable, format_size

__all__ = ["ALGORITHMS", "NETWORK_FROM", "PIECE_BYTES", "AlgorithmTable", "agree",
           "algorithm_mode", "pinned_table", "plan", "set_algorithm", "set_algorithm_table"]

ALGORITHMS = ("mpi", "ring", "rsag", "hierarchical")
MODES = ("auto", *ALGORITHMS)
# From this size up, a message between nodes takes the ring (or hierarchical) algorithm:
# below it the MPI's latency-bound algorithms are as fast (bench/algorithm_bench.py).
NETWORK_FROM = 256 << 10
MAX_STEPS = 32  # MAX_ALGORITHM_STEPS of backend/algochoice.pxd

# The ring's message pieces on one node: a received piece is combined while the next ones
# arrive. Across nodes each block goes in one message: every message costs the MPI's
# rendezvous round trip, which waits behind the data queued on the link.
PIECE_BYTES = 1 << 20


class AlgorithmTable(SizeTable):
    """Which algorithm a host all-reduce of each size takes: (from bytes, algorithm) steps."""

    CHOICES = ALGORITHMS
    WHAT = "algorithm table"
    SETTING = "FASTREDUCE_ALGORITHM_TABLE"
    EXAMPLE = "0:mpi,256KiB:ring"
    STEP = "SIZE:ALGORITHM"

    def __post_init__(self):
        super().__post_init__()
        if len(self.steps) > MAX_STEPS:
            raise ValueError(f"fastreduce: {self.WHAT} {self.spec()!r}: at most {MAX_STEPS} "
                             f"steps")


_override_mode: str | None = None
_override_table: AlgorithmTable | None = None
_override_table_set = False


def algorithm_mode() -> str:
    """auto, or the algorithm every size takes (set_algorithm, else FASTREDUCE_ALGORITHM)."""
    if _override_mode is not None:
        return _override_mode
    return settings.value("FASTREDUCE_ALGORITHM")


def pinned_table() -> AlgorithmTable | None:
    """auto mode's pinned table (set_algorithm_table, else FASTREDUCE_ALGORITHM_TABLE)."""
    if _override_table_set:
        return _override_table
    text = settings.value("FASTREDUCE_ALGORITHM_TABLE")
    return AlgorithmTable.parse(text, "FASTREDUCE_ALGORITHM_TABLE") if text else None


def set_algorithm(mode: str | None) -> None:
    """Use `mode` (auto, mpi, ring, rsag, hierarchical) from the next all-reduce on, on this
    rank (give every rank the same); None: back to FASTREDUCE_ALGORITHM."""
    global _override_mode
    if mode is not None and mode not in MODES:
        raise ValueError(f"fastreduce: algorithm {mode!r}: use one of {', '.join(MODES)}")
    _override_mode = mode
    _forget()


def set_algorithm_table(table: str | AlgorithmTable | None) -> None:
    """Pin auto mode's size table ("0:mpi,256KiB:ring") on this rank (give every rank the
    same); None: back to FASTREDUCE_ALGORITHM_TABLE."""
    global _override_table, _override_table_set
    if isinstance(table, str):
        table = AlgorithmTable.parse(table, "set_algorithm_table()")
    _override_table, _override_table_set = table, table is not None
    _forget()


def _forget() -> None:
    """Every communicator agrees again at its next all-reduce; the progress engine's queued
    jobs first run with the plan they were started under (on every rank alike)."""
    engine.wait_idle()
    algochoice.forget()


# What each field of the agreement is called in messages: the setting and its switches.
_FIELD_NAMES = {
    "algorithm": "the all-reduce algorithm (FASTREDUCE_ALGORITHM, set_algorithm)",
    "table": "the algorithm table (FASTREDUCE_ALGORITHM_TABLE, set_algorithm_table)",
    "segments": "the all-reduce segment size (FASTREDUCE_SEGMENT_BYTES, "
                "runtime.set_segment_bytes)",
    "engine": "the progress engine (FASTREDUCE_ENGINE)",
    "engine host bytes": "the engine's host threshold (FASTREDUCE_ENGINE_HOST_BYTES)",
    "half ops": "the 16-bit ops (FASTREDUCE_HALF_OPS)",
    "staging chunk": "the GPU staging chunk (FASTREDUCE_STAGING_CHUNK_KB, "
                     "gpupaths.set_staging_chunk)",
}


def call_settings() -> dict:
    """This rank's settings, besides the algorithm's, that choose the MPI calls it makes:
    what a communicator's ranks must agree on before their first collective."""
    host_bytes = engine.host_bytes()
    return {
        "segments": (format_size(reduce.segment_bytes()) if reduce.segment_bytes_pinned()
                     else "per communicator"),
        "engine": "on" if engine.state()[0] else "off",
        "engine host bytes": "off" if host_bytes < 0 else format_size(host_bytes),
        "half ops": reductions.half_ops(),
        "staging chunk": format_size(cudart.staging_chunk()) if cudart.staging_chunk()
        else "automatic",
    }


def agree(comm) -> dict:
    """What every rank of comm agreed on: the size table, segments, node communicators.

    Collective. A bad setting on any rank raises ValueError on every rank; settings that
    differ between ranks (the algorithm's and `call_settings()`), SettingError.
    """
    try:
        mode = algorithm_mode()
        pinned = pinned_table() if mode == "auto" else None
        mine, error = {"algorithm": mode, "table": pinned.spec() if pinned else "from the nodes",
                       **call_settings()}, None
    except ValueError as exc:
        mine, error = None, exc
    size = comm.Get_size()
    with watchdog.recorded("algorithm agreement (MPI_Comm_split_type, MPI_Allgather)", comm):
        local = comm.Split_type(MPI.COMM_TYPE_SHARED, comm.Get_rank()) if size > 1 else None
        leads = local is None or local.Get_rank() == 0
        votes = comm.allgather(agreement.vote(mine, error,
                                              (local.Get_size() if local else 1, leads)))
    try:
        agreement.settle(votes, error, refused=_refused, differ=_differ)
    except ValueError:
        if local is not None:
            local.Free()
        raise
    nodes = sum(1 for _, _, (_, leads) in votes if leads)
    most_local = max(n for _, _, (n, _) in votes)
    steps = _steps(mode, pinned, nodes, most_local)
    used = {name for _, name in steps}
    leaders = cross = ring = None
    if local is not None and (nodes == 1 or "hierarchical" not in used):
        local.Free()  # no node communicators needed
        local = None
    with watchdog.recorded("algorithm agreement: the algorithms' communicators", comm):
        if local is not None:
            leaders = comm.Split(0 if local.Get_rank() == 0 else MPI.UNDEFINED, comm.Get_rank())
            if leaders == MPI.COMM_NULL:
                leaders = None
            if most_local > 1 and len({n for _, _, (n, _) in votes}) == 1:
                cross = comm.Split(local.Get_rank(), comm.Get_rank())  # equal nodes
        if size > 1 and used & {"ring", "hierarchical"}:
            ring = comm.Dup()  # the ring's messages never meet the application's
    return {"steps": steps,
            "segment_bytes": (reduce.DEFAULT_SEGMENT_BYTES if nodes <= 1 else 0),
            "piece_bytes": PIECE_BYTES if nodes <= 1 else 0,
            "local": local, "leaders": leaders, "cross": cross, "ring": ring}


def _steps(mode: str, pinned: AlgorithmTable | None, nodes: int, most_local: int) -> tuple:
    if mode != "auto":
        return ((0, mode),)
    if pinned is not None:
        return pinned.steps
    if nodes <= 1:
        return ((0, "mpi"),)
    if most_local == 1:
        return ((0, "mpi"), (NETWORK_FROM, "ring"))
    if mpierrors.build_mpi()[0] == "Open MPI":
        return ((0, "mpi"),)
    return ((0, "mpi"), (NETWORK_FROM, "hierarchical"))


def _refused(ranks: list[int], listing: str) -> ValueError:
    return ValueError(f"fastreduce: {agreement.ranks_text(ranks)} of this communicator "
                      f"{'has' if len(ranks) == 1 else 'have'} a bad algorithm setting "
                      f"({listing})")


def _differ(found: agreement.Differences) -> SettingError:
    said = "; ".join(
        f"{_FIELD_NAMES.get(field, field)}: " + ", ".join(
            f"{agreement.ranks_text(ranks, 8)} {value}" for value, ranks in by_value.items())
        for field, by_value in found.fields.items())
    return SettingError(
        f"fastreduce: the ranks of this communicator disagree on settings that decide the "
        f"MPI calls each one makes, so no collective runs on it ({said}); give every rank "
        f"the same environment and the same set_* calls")


def plan(comm=None) -> dict:
    """The communicator's agreed plan (collective at its first all-reduce): its size table,
    the MPI call's segment size and the ring's piece size."""
    from .backend import collectives

    return algochoice.plan(collectives.default_comm() if comm is None else comm)
