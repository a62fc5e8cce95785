"""`ProcessGroupFastreduce`: a torch.distributed process group over an MPI communicator."""

from __future__ import annotations

import datetime
import math
import threading
import weakref
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from mpi4py import MPI

from ... import checks, watchdog
from ...backend import collectives as _collectives
from ...backend import engine as _engine
from ...errors import BackendError, BarrierTimeout
from ..buckets import RecurringBuckets, schedule_setting
from ..versions import _release, _work_needs_cpp_wrapper
from .packing import (
    _check_same,
    _check_tensor,
    _flat_like,
    _joined,
    _nbytes,
    _op_of,
    _packed,
    _premultiply,
    _unpack,
)
from .profiling import profiled
from .work import Done, Work, completes_within

_graph_task_id = torch._C._current_graph_task_id  # -1 outside a backward pass

BACKEND = "fastreduce"
_AllgatherOptions = torch._C._distributed_c10d.AllgatherOptions  # not in torch.distributed
_SUM = dist.ReduceOp.SUM
_STRIDED = torch.strided
_SPARSE = torch.sparse_coo


def _profiled(event: str, inputs: int | None = 0):
    """A backend operation's profiler event, "fastreduce:<event>" (torch's names)."""
    decorate = profiled(BACKEND, event, inputs)
    # Below 2.13 torch's C++ waits on a collective's work through its own Work::wait (DDP's
    # parameter check), which never reaches a Python Work: it gets a C++ work made from the
    # operation's future instead. Not for send/recv: torch reads their source rank.
    if (not _work_needs_cpp_wrapper(_release(torch.__version__))
            or event in ("send", "recv", "recvAnySource")):
        return decorate

    def wrap(method):
        inner = decorate(method)

        def run(self, *args, **kwargs):
            work = inner(self, *args, **kwargs)
            return torch._C._distributed_c10d._create_work_from_future(work.get_future())
        return run
    return wrap


def _python_backend_base():
    """torch's Backend class where Python may subclass it (torch 2.15), else None."""
    base = torch._C._distributed_c10d.Backend
    try:
        type("_Probe", (base,), {})(0, 1)
    except Exception:  # noqa: BLE001  (TypeError "No constructor defined" where it may not)
        return None
    return base


_PYTHON_BACKEND_BASE = _python_backend_base()


def _torch_asks_python_for_names() -> bool:
    """Whether torch reads a Python group's name from its getGroupName (2.13); torch 2.4
    asks the group's per-device backends, and a group without any raises "ProcessGroup name
    not set" (device meshes and destroy_process_group read it)."""
    probe = type("_Probe", (dist.ProcessGroup,), {"getGroupName": lambda self: "probe"})(0, 1)
    try:
        return probe.group_name == "probe"
    except RuntimeError:
        return False


_TORCH_ASKS_PYTHON_FOR_NAMES = _torch_asks_python_for_names()


_TIMEOUT_SOURCE = "the group's timeout (init_process_group(timeout=) or new_group(timeout=))"


class ProcessGroupFastreduce(dist.ProcessGroup):
    """A torch.distributed process group over an MPI communicator (one group rank per
    communicator rank, in the same order)."""

    def __init__(self, comm: MPI.Intracomm, *, timeout: datetime.timedelta | None = None):
        super().__init__(comm.Get_rank(), comm.Get_size())
        self._comm = comm
        self._rank = comm.Get_rank()
        self._size = comm.Get_size()
        self._timeout = timeout
        self._group_name = ""
        self._group_desc = ""
        self._buckets: RecurringBuckets | None = None  # made at the first asyncOp all-reduce
        self._abandoned: list = []  # barriers that timed out, kept until they complete
        self._bounded: set[int] = set()  # communicators whose calls the timeout bounds
        self._bound(comm)
        if _PYTHON_BACKEND_BASE is not None:
            self._register_device_backends()

    def _bound(self, comm: MPI.Intracomm) -> None:
        """The group's timeout bounds every call on comm (the group's, or the progress
        engine's duplicate of it): past it the watchdog ends the job with each stuck rank's
        flight record (MPI cannot cancel a collective, so a call cannot raise instead)."""
        seconds = self._timeout.total_seconds() if self._timeout is not None else 0
        if seconds > 0 and comm.handle not in self._bounded:
            self._bounded.add(comm.handle)
            weakref.finalize(self, watchdog.bound_communicator(comm, seconds, _TIMEOUT_SOURCE))

    @property
    def comm(self) -> MPI.Intracomm:
        """The mpi4py communicator this group's operations run on."""
        return self._comm

    def getBackendName(self) -> str:  # noqa: N802  (torch's name)
        return BACKEND

    def name(self) -> str:
        return BACKEND

    # torch keeps a Python group's name and description only if the group does: device
    # meshes, FSDP2 and functional collectives look groups up by name.
    def getGroupName(self) -> str:  # noqa: N802
        return self._group_name

    def setGroupName(self, name: str) -> None:  # noqa: N802
        self._group_name = name

    def getGroupDesc(self) -> str:  # noqa: N802
        return self._group_desc

    def setGroupDesc(self, desc: str) -> None:  # noqa: N802
        self._group_desc = desc

    if not _TORCH_ASKS_PYTHON_FOR_NAMES:  # torch 2.4: the group keeps them here
        def _set_group_name(self, name: str) -> None:
            self._group_name = name

        def _set_group_desc(self, desc: str) -> None:
            self._group_desc = desc

        @property
        def group_name(self) -> str:
            return self._group_name

        @property
        def group_desc(self) -> str:
            return self._group_desc

    # torch looks a group's backend up per device (batch_isend_irecv on torch 2.15, the
    # object collectives' device, torch.distributed.checkpoint's default device): for host
    # tensors and, where there is a GPU, CUDA tensors. Where torch has a Python backend
    # base, a DeviceBackend is registered per device (set up by __init__); else the group
    # answers torch's look-ups itself, as its own backend.
    def _register_device_backends(self) -> None:
        backend = DeviceBackend(self)
        kind = dist.ProcessGroup.BackendType.CUSTOM
        for device in _device_types():
            self._register_backend(device, kind, backend)
        self._set_default_backend(kind)

    if _PYTHON_BACKEND_BASE is None:
        supports_coalescing = False  # batch_isend_irecv: one isend/irecv per operation
        supports_splitting = False

        @property
        def _device_types(self) -> list[torch.device]:
            return _device_types()

        def _get_backend(self, device) -> ProcessGroupFastreduce:
            kind = torch.device(device).type
            if torch.device(kind) not in _device_types():
                raise RuntimeError(
                    f"fastreduce backend: no backend for device type {kind} (this group "
                    f"serves {', '.join(d.type for d in _device_types())})")
            return self

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    def __repr__(self) -> str:
        return f"ProcessGroupFastreduce(rank {self._rank} of {self._size})"

    # -- running an operation: now, or on the progress engine --

    def _start(self, name: str, opts, result: list, call: Callable[[MPI.Intracomm], None],
               nbytes: int, inputs: Sequence, fields: Callable[[], dict] = dict) -> Work:
        """call(comm) now; or, for a non-blocking operation on host tensors (asyncOp, the
        engine on, at least FASTREDUCE_ENGINE_HOST_BYTES: every rank decides alike), on the
        progress engine's thread and its duplicate communicator (nbytes -1: a size that
        differs between ranks, decided as 0 bytes). The compiled calls check
        (debug mode) and record (a timeout set) what they do; for the engine's jobs the
        ranks agree on the operation here, on the caller's thread, with fields(): what
        torch's DETAIL debug mode checks (dtypes, shapes, op, root), which the core's own
        check (counts, op, root) does not see, on either path."""
        if checks._debug:
            checks.fingerprint(self._comm, name, **fields(),
                               **({"bytes": nbytes} if nbytes >= 0 else {}))
        if _async_op(opts) and _engine.state()[0] and \
                0 <= _engine.host_bytes() <= (nbytes if nbytes >= 0 else 0) and \
                not _any_cuda(inputs):
            dup = _collectives.engine_comm(self._comm)
            self._bound(dup)
            return Work(result, job=_engine.submit_call(lambda: call(dup)))
        call(self._comm)
        return Done(result)

    # -- all-reduce (fastreduce's core) --

    @_profiled("all_reduce")
    def allreduce(self, tensors, opts=None) -> Work:
        """Each tensor reduced in place; non-blocking on the progress engine when asked
        (asyncOp, as DDP's buckets are) for CUDA tensors and host tensors of at least
        FASTREDUCE_ENGINE_HOST_BYTES, else at once. The core validates the tensors."""
        if opts is None:
            opts = dist.AllreduceOptions()
        for i, t in enumerate(tensors):
            if t.layout != _STRIDED:  # the core would see no memory at all
                if t.layout == _SPARSE:
                    return self._allreduce_sparse(tensors, opts)
                _check_tensor(t, f"tensors[{i}]")
        if checks._debug:  # shapes, which the core's check (counts) does not see
            checks.fingerprint(self._comm, "all_reduce", shapes=_shapes(tensors))
        reduce_op = opts.reduceOp
        if reduce_op == _SUM:  # the common case without the look-up
            op, factor = "sum", None
        else:
            op, factor = _op_of(reduce_op)
            if factor is not None:
                _premultiply(tensors, factor)
        if len(tensors) == 1 and _async_op(opts) and _engine.state()[0]:
            t = tensors[0]
            if (t.is_cuda or 0 <= _engine.host_bytes() <= t.nbytes) and self._overlap(t):
                request = _collectives.iallreduce_(t, op, comm=self._comm)
                if request.engine:
                    return Work(list(tensors), request=request)
                request.wait()  # MPI's own non-blocking call: nothing else would advance it
                return Done(list(tensors))
        for t in tensors:
            _collectives.allreduce_(t, op, comm=self._comm)
        return Done(list(tensors))

    allreduce_sparse = allreduce  # torch 2.15's name for a sparse tensor's all-reduce

    def _allreduce_sparse(self, tensors, opts) -> Work:
        """Sparse COO host tensors summed as gloo sums them: every rank's indices and values
        gathered (MPI_Allgatherv), duplicates added, the result copied into each tensor.
        Every rank checks that all ranks give the same shape and dtype before any data
        moves."""
        if opts.reduceOp != _SUM:
            raise BackendError(f"fastreduce backend: a sparse all_reduce sums only (as gloo's); "
                               f"got {opts.reduceOp}: reduce t.to_dense() for other ops")
        for i, t in enumerate(tensors):
            if t.layout != _SPARSE or t.is_cuda:
                raise BackendError(f"fastreduce backend: tensors[{i}] is {t.layout} on "
                                   f"{t.device}: a sparse all_reduce takes sparse COO host "
                                   f"tensors only, all of them")
        for t in tensors:
            x = t.coalesce()
            mine = (x._nnz(), tuple(x.shape), x.sparse_dim(), str(x.dtype))
            every = self._comm.allgather(mine)
            if any(e[1:] != mine[1:] for e in every):
                shapes = "; ".join(f"rank {r}: {tuple(e[1])} {e[3]}" for r, e in
                                   enumerate(every))
                raise BackendError(f"fastreduce backend: sparse all_reduce of tensors that "
                                   f"differ between ranks ({shapes}): give every rank the "
                                   f"same shape, sparse dimensions and dtype")
            counts = [e[0] for e in every]
            dims = x.sparse_dim()
            dense = tuple(x.shape[dims:])
            row = math.prod(dense)
            indices = _collectives.allgather(x.indices().t().contiguous().reshape(-1),
                                             counts=[c * dims for c in counts], comm=self._comm)
            values = _collectives.allgather(x.values().contiguous().reshape(-1),
                                            counts=[c * row for c in counts], comm=self._comm)
            total = sum(counts)
            summed = torch.sparse_coo_tensor(indices.reshape(total, dims).t(),
                                             values.reshape(total, *dense), x.shape,
                                             check_invariants=True)  # others' indices
            t.copy_(summed.coalesce())
        return Done(list(tensors))

    def _overlap(self, t: torch.Tensor) -> bool:
        """Whether this asyncOp all-reduce runs in the background. One made during backward
        (a DDP bucket) follows the gradient schedule: in the background (overlap) or at once
        (serial), as FASTREDUCE_GRADIENT_SCHEDULE says or, for "auto", as the first steps
        measure (a step ends when a bucket comes round again)."""
        if _graph_task_id() < 0:  # not in backward: no gradient reducer's bucket
            return True
        buckets = self._buckets
        if buckets is None:
            comm = self._comm
            buckets = self._buckets = RecurringBuckets(
                schedule_setting(), lambda v: _collectives.allreduce_(v, "sum", comm=comm))
        return buckets.overlap((t.data_ptr(), t.numel()))

    @_profiled("all_reduce_coalesced")
    def allreduce_coalesced(self, tensors, opts=None) -> Work:
        opts = opts if opts is not None else dist.AllreduceCoalescedOptions()
        op, factor = _op_of(opts.reduceOp)
        for i, t in enumerate(tensors):
            _check_tensor(t, f"tensors[{i}]")
        if checks._debug:
            checks.fingerprint(self._comm, "all_reduce_coalesced", shapes=_shapes(tensors))
        if factor is not None:
            _premultiply(tensors, factor)
        _collectives.allreduce_coalesced_(list(tensors), op, comm=self._comm)
        return Done(list(tensors))

    # -- data movement: the compiled core's calls on the tensors' memory --

    @_profiled("broadcast")
    def broadcast(self, tensors, opts=None) -> Work:
        opts = opts if opts is not None else dist.BroadcastOptions()
        root = self._root(opts.rootRank)
        for i, t in enumerate(tensors):
            _check_tensor(t, f"tensors[{i}]")
        tensors = list(tensors)

        def call(comm):
            for t in tensors:
                _collectives.broadcast_(t, root, comm=comm)

        return self._start("broadcast", opts, tensors, call, sum(_nbytes(t) for t in tensors),
                           tensors, lambda: dict(root=root, dtypes=_dtypes(tensors),
                                                 shapes=_shapes(tensors)))

    @_profiled("reduce")
    def reduce(self, tensors, opts=None) -> Work:
        opts = opts if opts is not None else dist.ReduceOptions()
        root = self._root(opts.rootRank)
        op, factor = _op_of(opts.reduceOp)
        for i, t in enumerate(tensors):
            _check_tensor(t, f"tensors[{i}]")
            _collectives.mpi_reduction(t, op)  # a dtype the op refuses: before any change
        tensors = list(tensors)
        if factor is not None:
            _premultiply(tensors, factor)

        def call(comm):
            for t in tensors:
                _collectives.reduce_(t, op, root, comm=comm)

        return self._start("reduce", opts, tensors, call, sum(_nbytes(t) for t in tensors),
                           tensors, lambda: dict(root=root, op=op, dtypes=_dtypes(tensors),
                                                 shapes=_shapes(tensors)))

    @_profiled("all_gather", 1)
    def allgather(self, output_tensors, input_tensors, opts=None) -> Work:
        opts = opts if opts is not None else _AllgatherOptions()
        self._one_per_rank(output_tensors, input_tensors, "output_tensors")
        for outs, x in zip(output_tensors, input_tensors, strict=True):
            _check_tensor(x, "input tensor")
            _check_same(outs, x, "output_tensors")
        pairs = list(zip(output_tensors, input_tensors, strict=True))

        def call(comm):
            for outs, x in pairs:
                target = _joined(outs)
                target = _flat_like(outs) if target is None else target
                _collectives.allgather(x.reshape(-1), comm=comm, out=target)
                _unpack(target, outs)

        return self._start("allgather", opts, output_tensors, call,
                           sum(_nbytes(x) for x in input_tensors) * self._size,
                           [input_tensors, output_tensors],
                           lambda: dict(dtypes=_dtypes(input_tensors),
                                        shapes=_shapes(input_tensors)))

    @_profiled("all_gather_into_tensor", 1)
    def _allgather_base(self, output, input, opts=None) -> Work:
        opts = opts if opts is not None else _AllgatherOptions()
        _check_tensor(output, "output")
        _check_tensor(input, "input")
        if output.dtype != input.dtype or output.numel() != input.numel() * self._size:
            raise ValueError(f"fastreduce backend: all_gather_into_tensor needs an output of "
                             f"{self._size} x {input.numel()} elements of {input.dtype}, got "
                             f"{output.numel()} of {output.dtype}")

        def call(comm):
            _collectives.allgather(input, comm=comm, out=output)

        return self._start("all_gather_into_tensor", opts, [output], call, _nbytes(output),
                           [input, output], lambda: dict(dtypes=_dtypes([input]),
                                                         shapes=_shapes([input])))

    @_profiled("all_gather_into_tensor_coalesced", 1)
    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None) -> Work:
        for o, x in zip(outputs, inputs, strict=True):
            self._allgather_base(o, x, _blocking(_AllgatherOptions()))
        return Done(list(outputs))

    @_profiled("all_gather_coalesced", 1)
    def allgather_coalesced(self, output_lists, input_list, opts=None) -> Work:
        """torch's all_gather_coalesced: output_lists[r][i] receives rank r's input_list[i]
        (one list per rank, each with one tensor per input)."""
        if len(output_lists) != self._size:
            raise ValueError(f"fastreduce backend: all_gather_coalesced needs one output list "
                             f"per rank of the group ({self._size}), got {len(output_lists)}")
        for r, outs in enumerate(output_lists):
            if len(outs) != len(input_list):
                raise ValueError(f"fastreduce backend: all_gather_coalesced: "
                                 f"output_tensor_lists[{r}] has {len(outs)} tensors for "
                                 f"{len(input_list)} inputs; give one per input")
        per_input = [[outs[i] for outs in output_lists] for i in range(len(input_list))]
        for i, (outs, x) in enumerate(zip(per_input, input_list, strict=True)):
            _check_tensor(x, f"input_tensor_list[{i}]")
            _check_same(outs, x, lambda r, i=i: f"output_tensor_lists[{r}][{i}]",
                        f"input_tensor_list[{i}]")
        for outs, x in zip(per_input, input_list, strict=True):
            self.allgather([outs], [x], _blocking(_AllgatherOptions()))
        return Done(list(output_lists))

    @_profiled("reduce_scatter", 1)
    def reduce_scatter(self, output_tensors, input_tensors, opts=None) -> Work:
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        self._one_per_rank(input_tensors, output_tensors, "input_tensors")
        for out, ins in zip(output_tensors, input_tensors, strict=True):
            _check_tensor(out, "output tensor")
            _check_same(ins, out, "input_tensors")
        for out, ins in zip(output_tensors, input_tensors, strict=True):
            flat = _packed(ins)
            self._reduce_scatter_base(out, flat, _blocking(dist.ReduceScatterOptions(), opts))
        return Done(list(output_tensors))

    @_profiled("reduce_scatter_tensor", 1)
    def _reduce_scatter_base(self, output, input, opts=None) -> Work:
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        _check_tensor(output, "output")
        _check_tensor(input, "input")
        if output.dtype != input.dtype or input.numel() != output.numel() * self._size:
            raise ValueError(f"fastreduce backend: reduce_scatter_tensor needs an input of "
                             f"{self._size} x {output.numel()} elements of {output.dtype}, got "
                             f"{input.numel()} of {input.dtype}")
        op, factor = _op_of(opts.reduceOp)
        _collectives.mpi_reduction(output, op)  # a dtype the op refuses: before any call
        if factor is not None:
            input = input * factor

        def call(comm):
            _collectives.reduce_scatter(input, op, comm=comm, out=output)

        return self._start("reduce_scatter_tensor", opts, [output], call, _nbytes(input),
                           [input, output], lambda: dict(op=op, dtypes=_dtypes([input]),
                                                         shapes=_shapes([input])))

    @_profiled("reduce_scatter_tensor_coalesced", 1)
    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None) -> Work:
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        for o, x in zip(outputs, inputs, strict=True):
            self._reduce_scatter_base(o, x, _blocking(dist.ReduceScatterOptions(), opts))
        return Done(list(outputs))

    @_profiled("gather", 1)
    def gather(self, output_tensors, input_tensors, opts=None) -> Work:
        opts = opts if opts is not None else dist.GatherOptions()
        root = self._root(opts.rootRank)
        if len(input_tensors) != 1:
            raise BackendError("fastreduce backend: gather takes one input tensor per rank")
        x = input_tensors[0]
        _check_tensor(x, "input tensor")
        outs = []
        if self._rank == root:
            self._one_per_rank(output_tensors, input_tensors, "output_tensors")
            outs = output_tensors[0]
            _check_same(outs, x, "output_tensors[0]")
        elif any(len(o) for o in output_tensors):
            raise ValueError("fastreduce backend: gather takes output tensors on the root only")

        def call(comm):
            if self._rank != root:
                _collectives.gather(x, root, comm=comm)
                return
            target = _joined(outs)
            target = _flat_like(outs) if target is None else target
            _collectives.gather(x.reshape(-1), root, comm=comm, out=target)
            _unpack(target, outs)

        return self._start("gather", opts, output_tensors, call, _nbytes(x) * self._size,
                           [x, output_tensors], lambda: dict(root=root, dtypes=_dtypes([x]),
                                                             shapes=_shapes([x])))

    @_profiled("scatter", 1)
    def scatter(self, output_tensors, input_tensors, opts=None) -> Work:
        opts = opts if opts is not None else dist.ScatterOptions()
        root = self._root(opts.rootRank)
        if len(output_tensors) != 1:
            raise BackendError("fastreduce backend: scatter takes one output tensor per rank")
        out = output_tensors[0]
        _check_tensor(out, "output tensor")
        ins = []
        if self._rank == root:
            self._one_per_rank(input_tensors, output_tensors, "input_tensors")
            ins = input_tensors[0]
            _check_same(ins, out, "input_tensors[0]")
        elif any(len(i) for i in input_tensors):
            raise ValueError("fastreduce backend: scatter takes input tensors on the root only")

        def call(comm):
            flat = _packed(ins) if self._rank == root else None
            _collectives.scatter(flat, root, comm=comm, out=out.reshape(-1))

        return self._start("scatter", opts, output_tensors, call, _nbytes(out) * self._size,
                           [out, input_tensors], lambda: dict(root=root, dtypes=_dtypes([out]),
                                                              shapes=_shapes([out])))

    @_profiled("all_to_all", 1)
    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes,
                      opts=None) -> Work:
        opts = opts if opts is not None else dist.AllToAllOptions()
        _check_tensor(output, "output")
        _check_tensor(input, "input")
        if output.dtype != input.dtype:
            raise ValueError(f"fastreduce backend: all_to_all_single output is {output.dtype}, "
                             f"input {input.dtype}; they must match")
        send_counts = self._split_elements(input, input_split_sizes, "input_split_sizes")
        recv_counts = self._split_elements(output, output_split_sizes, "output_split_sizes")
        even = not input_split_sizes and not output_split_sizes

        def call(comm):
            if even:
                _collectives.alltoall(input, comm=comm, out=output)
            else:
                _collectives.alltoall(input, comm=comm, out=output, send_counts=send_counts,
                                      recv_counts=recv_counts)

        # uneven splits: byte counts differ between ranks, so the engine is taken from the
        # settings alone (-1: as for a message of 0 bytes), and the core checks the splits
        return self._start("all_to_all_single", opts, [output], call,
                           _nbytes(input) if even else -1, [input, output],
                           lambda: dict(dtypes=_dtypes([input]),
                                        rows=_shapes([input], rows=True)))

    @_profiled("all_to_all", 1)
    def alltoall(self, output_tensors, input_tensors, opts=None) -> Work:
        for name, ts in (("output_tensors", output_tensors), ("input_tensors", input_tensors)):
            if len(ts) != self._size:
                raise ValueError(f"fastreduce backend: all_to_all needs {self._size} "
                                 f"{name} (one per rank), got {len(ts)}")
            for i, t in enumerate(ts):
                _check_tensor(t, f"{name}[{i}]")
        flat_in = torch.cat([t.reshape(-1) for t in input_tensors])
        flat_out = _flat_like(output_tensors)
        self.alltoall_base(flat_out, flat_in, [t.numel() for t in output_tensors],
                           [t.numel() for t in input_tensors], _blocking(dist.AllToAllOptions()))
        _unpack(flat_out, output_tensors)
        return Done(list(output_tensors))

    @_profiled("barrier", None)
    def barrier(self, opts=None) -> Work:
        """Every rank of the group arrived; bounded by the group's timeout (BarrierOptions'
        own where given): past it, every rank that waits raises, naming the barrier. Not
        bounded: debug mode's check and queued engine work, which come first."""
        if checks._debug:
            checks.fingerprint(self._comm, "barrier")
        _engine.wait_idle()  # work queued before the barrier is done when it returns
        limit, source = getattr(opts, "timeout", None), "the barrier's timeout argument"
        if limit is None or limit.total_seconds() <= 0:
            limit, source = self._timeout, _TIMEOUT_SOURCE
        request = self._comm.Ibarrier()
        with watchdog.recorded("MPI_Ibarrier: dist.barrier", self._comm):
            arrived = _wait_at_most(request, limit.total_seconds() if limit else None)
        if not arrived:
            self._abandoned.append(request)  # completes if the missing ranks ever arrive
            raise BarrierTimeout(
                f"fastreduce backend: barrier timed out after {limit.total_seconds():g} s on "
                f"rank {self._rank} of a group of {self._size}: a rank of the group did not "
                f"arrive (it failed, or is stuck before the barrier). The bound is {source}; "
                f"this group cannot be used again: end the job")
        return Done([])

    # torch's newer names for the same operations
    all_gather_single = _allgather_base
    all_gather_single_coalesced = allgather_into_tensor_coalesced
    reduce_scatter_single = _reduce_scatter_base
    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced
    all_to_all_single = alltoall_base

    # -- point-to-point: MPI_Isend / MPI_Irecv on the group's communicator --

    @_profiled("send")
    def send(self, tensors, dst_rank: int, tag: int = 0) -> Work:
        t = self._p2p_tensor(tensors, dst_rank, "dst")
        request = _collectives.isend(t, dst_rank, tag, comm=self._comm)
        return Work([t], mpi_request=request)

    @_profiled("recv")
    def recv(self, tensors, src_rank: int, tag: int = 0) -> Work:
        t = self._p2p_tensor(tensors, src_rank, "src")
        request = _collectives.irecv(t, src_rank, tag, comm=self._comm)
        return Work([t], mpi_request=request, source=src_rank)

    @_profiled("recvAnySource")
    def recv_anysource(self, tensors, tag: int = 0) -> Work:
        t = self._p2p_tensor(tensors, None, "src")
        return Work([t], mpi_request=_AnySourceReceive(self._comm, t, tag),
                    source=MPI.ANY_SOURCE)

    # -- helpers --

    def _root(self, root: int) -> int:
        if not 0 <= root < self._size:
            raise ValueError(f"fastreduce backend: root rank {root} is not in this group of "
                             f"{self._size} (valid: 0..{self._size - 1})")
        return root

    def _one_per_rank(self, lists, others, what: str) -> None:
        if len(lists) != len(others):
            raise ValueError(f"fastreduce backend: {what} has {len(lists)} lists for "
                             f"{len(others)} tensors")
        for i, ts in enumerate(lists):
            if len(ts) != self._size:
                raise ValueError(f"fastreduce backend: {what}[{i}] has {len(ts)} tensors; "
                                 f"give one per rank of the group ({self._size})")

    def _split_elements(self, t, splits, what: str) -> list[int]:
        """Elements per rank from torch's row counts (None or empty: equal rows)."""
        rows = t.shape[0] if t.dim() else 1
        row = t.numel() // rows if rows else 0
        if not splits:
            if rows % self._size:
                raise ValueError(f"fastreduce backend: all_to_all_single: {rows} rows do not "
                                 f"divide among {self._size} ranks; give {what}")
            return [rows // self._size * row] * self._size
        if len(splits) != self._size or sum(splits) != rows or min(splits) < 0:
            raise ValueError(f"fastreduce backend: {what} {list(splits)} must be {self._size} "
                             f"non-negative row counts summing to {rows}")
        return [int(s) * row for s in splits]

    def _p2p_tensor(self, tensors, peer, what: str):
        if len(tensors) != 1:
            raise BackendError("fastreduce backend: send and recv take one tensor")
        _check_tensor(tensors[0], "tensor")
        if peer is not None and not 0 <= peer < self._size:
            raise ValueError(f"fastreduce backend: {what} rank {peer} is not in this group of "
                             f"{self._size}")
        return tensors[0]


class _AnySourceReceive:
    """A receive from any rank as a request (wait(), test(), done, source): the compiled
    core's recv, which probes first (MPICH 5.0 with UCX over TCP leaves a posted
    MPI_Irecv(MPI_ANY_SOURCE) unmatched across nodes). Under MPI_THREAD_MULTIPLE a helper
    thread started when the receive is posted makes it, so the receive is pending from the
    start, as a posted MPI_Irecv is (a rank may send before it waits); otherwise wait()
    does, or test() once a probe finds a message. Two pending receives that can match the
    same message match in the order they probe."""

    def __init__(self, comm: MPI.Intracomm, tensor, tag: int):
        self._comm = comm
        self._tensor = tensor
        # a CUDA tensor is received on its device and the caller's current stream, from any
        # thread (a new thread's current device is 0, its stream the default one)
        self._stream = torch.cuda.current_stream(tensor.device) if tensor.is_cuda else None
        self._tag = tag
        self.source = -1
        self._error: BaseException | None = None
        self.done = False
        self._thread = None
        if MPI.Query_thread() == MPI.THREAD_MULTIPLE:
            self._thread = threading.Thread(target=self._receive, daemon=True,
                                            name="fastreduce-anysource-recv")
            self._thread.start()

    def _receive(self) -> None:
        try:
            if self._stream is None:
                self.source, _ = _collectives.recv(self._tensor, None, self._tag,
                                                   comm=self._comm)
            else:
                with torch.cuda.device(self._tensor.device), torch.cuda.stream(self._stream):
                    self.source, _ = _collectives.recv(self._tensor, None, self._tag,
                                                       comm=self._comm)
        except BaseException as exc:  # noqa: BLE001  (raised by wait or test)
            self._error = exc
        self.done = True

    def _result(self):
        if self._error is not None:
            raise self._error
        return self._tensor

    def wait(self):
        """Block until the message is in the tensor; returns it."""
        if self._thread is not None:
            self._thread.join()
        elif not self.done:
            self._receive()
        return self._result()

    def test(self) -> bool:
        """Whether the message is in the tensor (receiving it if a probe finds it here)."""
        if self._thread is None and not self.done:
            if self._comm.Iprobe(MPI.ANY_SOURCE, self._tag):
                self._receive()  # a message is there: the matched probe returns at once
        if not self.done:
            return False
        if self._thread is not None:
            self._thread.join()  # finished: returns at once
        self._result()
        return True


# The operations torch may call on a backend looked up by device, each the group's own.
_BACKEND_OPERATIONS = (
    "broadcast", "allreduce", "allreduce_sparse", "allreduce_coalesced", "reduce", "allgather",
    "all_gather_single", "allgather_coalesced", "all_gather_single_coalesced", "gather",
    "scatter", "reduce_scatter", "reduce_scatter_single", "reduce_scatter_single_coalesced",
    "all_to_all_single", "alltoall", "send", "recv", "recv_anysource", "barrier")


def _delegate(name: str):
    def operation(self, *args):
        return getattr(self._group(), name)(*args)

    operation.__name__ = name
    operation.__doc__ = f"The group's {name}."
    return operation


if _PYTHON_BACKEND_BASE is not None:
    class DeviceBackend(_PYTHON_BACKEND_BASE):
        """The backend a fastreduce group registers per device: its group's operations."""

        supports_coalescing = False
        supports_splitting = False

        def __init__(self, group: ProcessGroupFastreduce):
            super().__init__(group.rank(), group.size())
            # weakly: the group holds this backend, and a cycle through C++ is never freed
            self._group = weakref.ref(group)

        def getBackendName(self) -> str:  # noqa: N802  (torch's name)
            return BACKEND

    for _name in _BACKEND_OPERATIONS:
        setattr(DeviceBackend, _name, _delegate(_name))


def _device_types() -> list[torch.device]:
    """The devices a group serves: the host, and CUDA where this process has a GPU."""
    if torch.cuda.is_available():
        return [torch.device("cpu"), torch.device("cuda")]
    return [torch.device("cpu")]


def _wait_at_most(request: MPI.Request, seconds: float | None) -> bool:
    """Whether request completed within seconds (None: no bound)."""
    if seconds is None:
        request.Wait()
        return True
    return completes_within(request.Test, seconds)


def _any_cuda(tensors) -> bool:
    """Whether any tensor in a (nested) list is on a GPU."""
    return any(_any_cuda(t) if isinstance(t, (list, tuple)) else t.is_cuda for t in tensors)


def _dtypes(tensors) -> str:
    """The tensors' dtypes, for debug mode's check."""
    return ",".join(str(t.dtype).removeprefix("torch.") for t in tensors)


def _shapes(tensors, rows: bool = False) -> str:
    """The tensors' shapes (rows: without the first dimension), for debug mode's check."""
    return ";".join(str(list(t.shape[1:] if rows else t.shape)) for t in tensors)


def _async_op(opts) -> bool:
    """Whether the caller asked for a non-blocking operation: torch's options say so (2.9
    and newer do); where they do not (2.4, 2.6), the call runs at once, and torch's
    wrappers wait on its work object either way."""
    return getattr(opts, "asyncOp", False)


def _blocking(opts, like=None):
    """opts for a part of a larger call: blocking, with like's reduce op."""
    if hasattr(opts, "asyncOp"):
        opts.asyncOp = False
    if like is not None:
        opts.reduceOp = like.reduceOp
    return opts
