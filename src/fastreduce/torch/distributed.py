"""torch.distributed on MPI: a process-group backend named "fastreduce".

    import fastreduce.distributed              # registers the backend
    dist.init_process_group("fastreduce")      # under mpiexec or srun: nothing else to set

Rank and world size come from MPI (fastreduce.default_comm()), and so does the rendezvous:
rank 0's address for torch's key-value store travels by MPI_Bcast, so no MASTER_ADDR or
MASTER_PORT is needed (when they are set, torch's own env:// rendezvous runs as usual, and
rank/world_size given to init_process_group must equal MPI's).

Every operation is one MPI call on the group's communicator with the tensors' own memory:
all-reduce through fastreduce's core (zero-copy DLPack, GPU paths as for allreduce, the
progress engine for non-blocking requests), the other collectives and point-to-point
through mpi4py on the tensors' addresses. CUDA tensors go to MPI directly where the MPI
promises blocking calls on device memory (fastreduce.gpupath), else through host copies.
"""

from __future__ import annotations

import datetime
import os
import socket
import sys
import threading
from collections.abc import Callable, Sequence
from urllib.parse import parse_qs, urlparse

import torch
import torch.distributed as dist
from mpi4py import MPI

from ..backend import collectives as _collectives, engine as _engine
from .. import checks, watchdog
from .._version import __version__
from ..errors import BackendError
from .custom_ops import _release

# Older torch.distributed differs in what a Python process group must provide (sub-groups
# hang on 2.4-2.6, PREMUL_SUM has no factor on 2.12): the backend is tested on 2.13.
if _release(torch.__version__) < (2, 13):
    raise ImportError(f"fastreduce.distributed needs torch 2.13 or newer (this is torch "
                      f"{torch.__version__}): pip install 'torch>=2.13'; the rest of fastreduce "
                      f"works with torch 2.4 and newer")

BACKEND = "fastreduce"
_AllgatherOptions = torch._C._distributed_c10d.AllgatherOptions  # not in torch.distributed

_RedOpType = dist.ReduceOp.RedOpType
_SUM = dist.ReduceOp.SUM
_STRIDED = torch.strided
_OP_NAMES = {
    _RedOpType.SUM: "sum",
    _RedOpType.AVG: "avg",
    _RedOpType.PRODUCT: "prod",
    _RedOpType.MIN: "min",
    _RedOpType.MAX: "max",
    _RedOpType.BAND: "band",
    _RedOpType.BOR: "bor",
    _RedOpType.BXOR: "bxor",
    _RedOpType.PREMUL_SUM: "sum",  # after multiplying by the op's factor
}


def _op_of(reduce_op) -> tuple[str, object]:
    """(fastreduce op name, PREMUL_SUM factor or None) for a torch ReduceOp."""
    kind = reduce_op.op if isinstance(reduce_op, dist.ReduceOp) else reduce_op
    name = _OP_NAMES.get(kind)
    if name is None:
        raise BackendError(f"fastreduce backend: reduce op {kind} is not supported; use one of "
                           f"SUM, AVG, PRODUCT, MIN, MAX, BAND, BOR, BXOR, PREMUL_SUM")
    factor = reduce_op.factor if kind == _RedOpType.PREMUL_SUM else None
    return name, factor


def _premultiply(tensors: Sequence, factor) -> None:
    """PREMUL_SUM's first half: every tensor times factor, once all are known to be valid."""
    for i, t in enumerate(tensors):
        _check_tensor(t, f"tensors[{i}]")
        _collectives.mpi_reduction(t, "sum")  # a dtype SUM refuses is refused before any change
    for t in tensors:
        t.mul_(factor)


def _check_tensor(t, what: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"fastreduce backend: {what} must be a torch.Tensor, not "
                        f"{type(t).__qualname__}")
    if t.layout != torch.strided or t.is_quantized:
        raise BackendError(f"fastreduce backend: {what} has layout {t.layout}"
                           f"{' (quantized)' if t.is_quantized else ''}; give a dense tensor")
    if t.device.type not in ("cpu", "cuda"):
        raise BackendError(f"fastreduce backend: {what} is on {t.device}; the backend takes "
                           f"cpu and cuda tensors")
    if not t.is_contiguous():
        raise BufferError(f"fastreduce backend: {what} (shape {tuple(t.shape)}) is not "
                          f"contiguous; call .contiguous() first (and copy the result back)")


def _nbytes(t) -> int:
    return t.numel() * t.element_size()


def _memory(t):
    """t's memory as an mpi4py buffer (no copy)."""
    return MPI.buffer.fromaddress(t.data_ptr(), _nbytes(t))


def _device_direct() -> bool:
    """Whether blocking MPI calls here may take CUDA device pointers."""
    from ..gpupath import device_pointer_support

    return device_pointer_support().blocking


class _HostSide:
    """The memory MPI reads and writes for some tensors: their own on the CPU, and on the
    GPU where the MPI takes device pointers; else pinned host copies, filled from the
    tensors MPI reads and copied back by write_back() into the tensors MPI writes."""

    def __init__(self, reads: Sequence = (), writes: Sequence = ()):
        tensors = list(reads) + list(writes)
        cuda = any(t.is_cuda for t in tensors)
        self.staged = cuda and not _device_direct()
        self._writes = list(writes)
        self._host: dict[int, torch.Tensor] = {}
        if cuda:
            torch.cuda.current_stream().synchronize()  # MPI reads what the stream produced
        if self.staged:
            for t in tensors:
                if t.is_cuda and id(t) not in self._host:
                    self._host[id(t)] = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            for t in reads:
                if t.is_cuda:
                    self._host[id(t)].copy_(t)

    def __call__(self, t):
        """The memory MPI works on for t: an mpi4py buffer."""
        return _memory(self._host.get(id(t), t))

    def tensor(self, t):
        return self._host.get(id(t), t)

    def write_back(self) -> None:
        for t in self._writes:
            if id(t) in self._host:
                t.copy_(self._host[id(t)])


def _joined(tensors: Sequence):
    """A flat view of the tensors when they lie back to back in one storage, in order (as
    list(flat.chunk(n)) makes them); else None."""
    if not tensors:
        return None
    first = tensors[0]
    step = _nbytes(first)
    storage = first.untyped_storage().data_ptr()
    if not all(t.dtype == first.dtype and t.device == first.device and _nbytes(t) == step
               and t.untyped_storage().data_ptr() == storage
               and t.data_ptr() == first.data_ptr() + i * step for i, t in enumerate(tensors)):
        return None
    return first.as_strided((first.numel() * len(tensors),), (1,))


def _packed(tensors: Sequence):
    """The tensors back to back in one flat tensor: a view when they already are, else a
    copy."""
    joined = _joined(tensors)
    return joined if joined is not None else torch.cat([t.reshape(-1) for t in tensors])


def _flat_like(tensors: Sequence):
    """One contiguous tensor holding the tensors' elements back to back (new memory)."""
    first = tensors[0]
    return torch.empty(sum(t.numel() for t in tensors), dtype=first.dtype, device=first.device)


def _unpack(flat, tensors: Sequence) -> None:
    """Copy flat's elements into the tensors, in order (nothing when flat is tensors[0]'s
    memory already, as for consecutive tensors)."""
    if _joined(tensors) is not None and flat.data_ptr() == tensors[0].data_ptr():
        return
    offset = 0
    for t in tensors:
        t.copy_(flat.reshape(-1)[offset:offset + t.numel()].view_as(t))
        offset += t.numel()


def _blocking(opts, like=None):
    """opts for a part of a larger call: blocking, with like's reduce op."""
    opts.asyncOp = False
    if like is not None:
        opts.reduceOp = like.reduceOp
    return opts


def _check_same(tensors: Sequence, like, what: str) -> None:
    for i, t in enumerate(tensors):
        _check_tensor(t, f"{what}[{i}]")
        if t.dtype != like.dtype or t.numel() != like.numel():
            raise ValueError(f"fastreduce backend: {what}[{i}] has {t.numel()} elements of "
                             f"{t.dtype}, the input {like.numel()} of {like.dtype}; they must "
                             f"match")


# --- work objects ------------------------------------------------------------------------


class Work(dist.Work):
    """What an operation returns: wait() blocks with the GIL released; get_future()
    completes when MPI has completed (from the progress engine's thread), unprompted."""

    def __init__(self, result: list, *, request=None, job=None, mpi_request=None,
                 source: int = -1, flight=None):
        super().__init__()
        self._result = result
        self._error: BaseException | None = None
        self._request = request          # a fastreduce Request run by the progress engine
        self._job = job                  # an engine job (other collectives)
        self._mpi_request = mpi_request  # an mpi4py request (point-to-point)
        self._finished = request is None and job is None and mpi_request is None
        self._future = None  # made on demand for work that is already complete
        if self._finished:
            return
        self._future = torch.futures.Future()
        self._source = source
        self._lock = threading.Lock()
        self._waiter = None
        self._after: Callable[[], None] | None = None
        self._flight = flight  # point-to-point work's flight record entry (a timeout is set)
        if request is not None:
            request.add_done_callback(self._from_request)
        elif job is not None:
            job.add_done_callback(self._from_job)

    def _then(self, fn: Callable[[], None]) -> Work:
        """Run fn (e.g. a copy back to the device) once MPI is done, before completing."""
        self._after = fn
        return self

    def _finish(self, error: BaseException | None) -> None:
        with self._lock:
            if self._finished:
                return
            self._finished = True
        if error is None and self._after is not None:
            try:
                self._after()
            except BaseException as exc:  # noqa: BLE001  (reported by wait() and the future)
                error = exc
        self._error = error
        if self._flight is not None:
            watchdog.end(self._flight, error is None)
        if error is None:
            self._future.set_result(self._result)
        else:
            self._future.set_exception(error)

    def _from_request(self, request) -> None:
        try:
            request.wait()  # finished: returns at once, raises the request's error
        except BaseException as exc:  # noqa: BLE001
            self._finish(exc)
        else:
            self._finish(None)

    def _from_job(self, job) -> None:
        self._finish(job.error)

    def _wait_mpi(self) -> None:
        if self._flight is not None:
            watchdog.waiting(self._flight)
        try:
            status = MPI.Status()
            self._mpi_request.Wait(status)
            if self._source == MPI.ANY_SOURCE:
                self._source = status.Get_source()
        except BaseException as exc:  # noqa: BLE001
            self._finish(exc)
        else:
            self._finish(None)

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        """Block (GIL released) until MPI has completed the operation; raise its error."""
        if self._future is None:  # complete from the start
            return True
        if self._request is not None:
            self._request.wait()
        elif self._job is not None:
            _engine.wait_job(self._job)
        elif self._mpi_request is not None and self._waiter is None and not self._finished:
            self._wait_mpi()
        self._future.wait()  # a callback may still be completing it on another thread
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        if self._future is None:
            return True
        if self._mpi_request is not None and self._waiter is None and not self._finished:
            if self._mpi_request.Test():
                self._finish(None)
        return self._future.done()

    def is_success(self) -> bool:
        return self.is_completed() and self._error is None

    def exception(self):
        return self._error

    def result(self) -> list:
        self.wait()
        return self._result

    def get_future(self) -> torch.futures.Future:
        """A future of the result list; for point-to-point work, a helper thread waits."""
        if self._future is None:
            self._future = torch.futures.Future()
            self._future.set_result(self._result)
        elif self._mpi_request is not None and not self._finished:
            with self._lock:
                if self._waiter is None:
                    self._waiter = threading.Thread(target=self._wait_mpi, daemon=True,
                                                    name="fastreduce-p2p-wait")
                    self._waiter.start()
        return self._future

    def _source_rank(self) -> int:
        """The rank a recv_anysource() received from (after wait())."""
        return self._source

    def synchronize(self) -> None:
        self.wait()


# --- the process group -----------------------------------------------------------------


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

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    def __repr__(self) -> str:
        return f"ProcessGroupFastreduce(rank {self._rank} of {self._size})"

    # -- running an operation: now, or on the progress engine --

    def _start(self, name: str, opts, result: list, call: Callable[[MPI.Intracomm], None],
               nbytes: int, inputs: Sequence) -> Work:
        """call(comm) now; or, for a non-blocking operation on host tensors (asyncOp, the
        engine on, at least FASTREDUCE_ENGINE_HOST_BYTES: every rank decides alike), on the
        progress engine's thread and its duplicate communicator. In debug mode the ranks
        first agree on the operation and its size."""
        if checks._debug:
            checks.fingerprint(self._comm, name, bytes=nbytes,
                               root=getattr(opts, "rootRank", None))
        if watchdog._timeout is not None:
            call = _recorded(call, name, self._comm, nbytes)
        if getattr(opts, "asyncOp", False) and _engine.state()[0] and \
                0 <= _engine.host_bytes() <= nbytes and not _any_cuda(inputs):
            dup = _collectives.engine_comm(self._comm)
            return Work(result, job=_engine.submit_call(lambda: call(dup)))
        call(self._comm)
        return Work(result)

    # -- all-reduce (fastreduce's core) --

    def allreduce(self, tensors, opts=None) -> Work:
        """Each tensor reduced in place; non-blocking on the progress engine when asked
        (asyncOp, as DDP's buckets are) for CUDA tensors and host tensors of at least
        FASTREDUCE_ENGINE_HOST_BYTES, else at once. The core validates the tensors."""
        if opts is None:
            opts = dist.AllreduceOptions()
        reduce_op = opts.reduceOp
        if reduce_op == _SUM:  # the common case without the look-up
            op, factor = "sum", None
        else:
            op, factor = _op_of(reduce_op)
            if factor is not None:
                _premultiply(tensors, factor)
        for i, t in enumerate(tensors):
            if t.layout != _STRIDED:  # the core would see no memory at all
                _check_tensor(t, f"tensors[{i}]")
        if len(tensors) == 1 and opts.asyncOp and _engine.state()[0]:
            t = tensors[0]
            if t.is_cuda or 0 <= _engine.host_bytes() <= t.nbytes:
                request = _collectives.iallreduce_(t, op, comm=self._comm)
                if request.engine:
                    return Work(list(tensors), request=request)
                request.wait()  # MPI's own non-blocking call: nothing else would advance it
                return Work(list(tensors))
        for t in tensors:
            _collectives.allreduce_(t, op, comm=self._comm)
        return Work(list(tensors))

    def allreduce_coalesced(self, tensors, opts=None) -> Work:
        opts = opts if opts is not None else dist.AllreduceCoalescedOptions()
        op, factor = _op_of(opts.reduceOp)
        for i, t in enumerate(tensors):
            _check_tensor(t, f"tensors[{i}]")
        if factor is not None:
            _premultiply(tensors, factor)
        _collectives.allreduce_coalesced_(list(tensors), op, comm=self._comm)
        return Work(list(tensors))

    # -- data movement: mpi4py on the tensors' memory --

    def broadcast(self, tensors, opts=None) -> Work:
        opts = opts if opts is not None else dist.BroadcastOptions()
        root = self._root(opts.rootRank)
        for i, t in enumerate(tensors):
            _check_tensor(t, f"tensors[{i}]")
        tensors = list(tensors)

        def call(comm):
            side = _HostSide(reads=tensors if self._rank == root else (), writes=tensors)
            for t in tensors:
                comm.Bcast([side(t), MPI.BYTE], root=root)
            side.write_back()

        return self._start("broadcast", opts, tensors, call, sum(_nbytes(t) for t in tensors),
                           tensors)

    def reduce(self, tensors, opts=None) -> Work:
        opts = opts if opts is not None else dist.ReduceOptions()
        root = self._root(opts.rootRank)
        op, factor = _op_of(opts.reduceOp)
        for i, t in enumerate(tensors):
            _check_tensor(t, f"tensors[{i}]")
        handles = [_collectives.mpi_reduction(t, op) for t in tensors]
        tensors = list(tensors)
        if factor is not None:
            _premultiply(tensors, factor)

        def call(comm):
            side = _HostSide(reads=tensors, writes=tensors if self._rank == root else ())
            for t, (datatype, mpi_op) in zip(tensors, handles, strict=True):
                buf = [side(t), t.numel(), datatype]
                if self._rank == root:
                    comm.Reduce(MPI.IN_PLACE, buf, op=mpi_op, root=root)
                    if op == "avg":
                        side.tensor(t).div_(self._size)
                else:
                    comm.Reduce(buf, None, op=mpi_op, root=root)
            side.write_back()

        return self._start("reduce", opts, tensors, call, sum(_nbytes(t) for t in tensors),
                           tensors)

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
                side = _HostSide(reads=[x], writes=[target])
                comm.Allgather([side(x), MPI.BYTE], [side(target), MPI.BYTE])
                side.write_back()
                _unpack(target, outs)

        return self._start("allgather", opts, output_tensors, call,
                           sum(_nbytes(x) for x in input_tensors) * self._size,
                           [input_tensors, output_tensors])

    def _allgather_base(self, output, input, opts=None) -> Work:
        opts = opts if opts is not None else _AllgatherOptions()
        _check_tensor(output, "output")
        _check_tensor(input, "input")
        if output.dtype != input.dtype or output.numel() != input.numel() * self._size:
            raise ValueError(f"fastreduce backend: all_gather_into_tensor needs an output of "
                             f"{self._size} x {input.numel()} elements of {input.dtype}, got "
                             f"{output.numel()} of {output.dtype}")
        in_place = input.numel() > 0 and input.device == output.device and \
            input.data_ptr() == output.data_ptr() + self._rank * _nbytes(input)

        def call(comm):
            side = _HostSide(reads=[input], writes=[output])
            send = MPI.IN_PLACE if in_place and not side.staged else [side(input), MPI.BYTE]
            comm.Allgather(send, [side(output), MPI.BYTE])
            side.write_back()

        return self._start("all_gather_into_tensor", opts, [output], call, _nbytes(output),
                           [input, output])

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None) -> Work:
        for o, x in zip(outputs, inputs, strict=True):
            self._allgather_base(o, x, _blocking(_AllgatherOptions()))
        return Work(list(outputs))

    def allgather_coalesced(self, output_lists, input_list, opts=None) -> Work:
        for outs, x in zip(output_lists, input_list, strict=True):
            self.allgather([outs], [x], _blocking(_AllgatherOptions()))
        return Work(list(output_lists))

    def reduce_scatter(self, output_tensors, input_tensors, opts=None) -> Work:
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        self._one_per_rank(input_tensors, output_tensors, "input_tensors")
        for out, ins in zip(output_tensors, input_tensors, strict=True):
            _check_tensor(out, "output tensor")
            _check_same(ins, out, "input_tensors")
        for out, ins in zip(output_tensors, input_tensors, strict=True):
            flat = _packed(ins)
            self._reduce_scatter_base(out, flat, _blocking(dist.ReduceScatterOptions(), opts))
        return Work(list(output_tensors))

    def _reduce_scatter_base(self, output, input, opts=None) -> Work:
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        _check_tensor(output, "output")
        _check_tensor(input, "input")
        if output.dtype != input.dtype or input.numel() != output.numel() * self._size:
            raise ValueError(f"fastreduce backend: reduce_scatter_tensor needs an input of "
                             f"{self._size} x {output.numel()} elements of {output.dtype}, got "
                             f"{input.numel()} of {input.dtype}")
        op, factor = _op_of(opts.reduceOp)
        datatype, mpi_op = _collectives.mpi_reduction(output, op)
        if factor is not None:
            input = input * factor
        count, size = output.numel(), self._size

        def call(comm):
            side = _HostSide(reads=[input], writes=[output])
            comm.Reduce_scatter_block([side(input), count, datatype],
                                      [side(output), count, datatype], op=mpi_op)
            if op == "avg":
                side.tensor(output).div_(size)
            side.write_back()

        return self._start("reduce_scatter_tensor", opts, [output], call, _nbytes(input),
                           [input, output])

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None) -> Work:
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        for o, x in zip(outputs, inputs, strict=True):
            self._reduce_scatter_base(o, x, _blocking(dist.ReduceScatterOptions(), opts))
        return Work(list(outputs))

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
                side = _HostSide(reads=[x])
                comm.Gather([side(x), MPI.BYTE], None, root=root)
                return
            target = _joined(outs)
            target = _flat_like(outs) if target is None else target
            side = _HostSide(reads=[x], writes=[target])
            comm.Gather([side(x), MPI.BYTE], [side(target), MPI.BYTE], root=root)
            side.write_back()
            _unpack(target, outs)

        return self._start("gather", opts, output_tensors, call, _nbytes(x) * self._size,
                           [x, output_tensors])

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
            if self._rank != root:
                side = _HostSide(writes=[out])
                comm.Scatter(None, [side(out), MPI.BYTE], root=root)
            else:
                flat = _packed(ins)
                side = _HostSide(reads=[flat], writes=[out])
                comm.Scatter([side(flat), MPI.BYTE], [side(out), MPI.BYTE], root=root)
            side.write_back()

        return self._start("scatter", opts, output_tensors, call, _nbytes(out) * self._size,
                           [out, input_tensors])

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes,
                      opts=None) -> Work:
        opts = opts if opts is not None else dist.AllToAllOptions()
        _check_tensor(output, "output")
        _check_tensor(input, "input")
        if output.dtype != input.dtype:
            raise ValueError(f"fastreduce backend: all_to_all_single output is {output.dtype}, "
                             f"input {input.dtype}; they must match")
        send_counts = self._split_bytes(input, input_split_sizes, "input_split_sizes")
        recv_counts = self._split_bytes(output, output_split_sizes, "output_split_sizes")

        def call(comm):
            side = _HostSide(reads=[input], writes=[output])
            comm.Alltoallv([side(input), (send_counts, _displs(send_counts)), MPI.BYTE],
                           [side(output), (recv_counts, _displs(recv_counts)), MPI.BYTE])
            side.write_back()

        return self._start("all_to_all_single", opts, [output], call, _nbytes(input),
                           [input, output])

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
        return Work(list(output_tensors))

    def barrier(self, opts=None) -> Work:
        if checks._debug:
            checks.fingerprint(self._comm, "barrier")
        _engine.wait_idle()  # work queued before the barrier is done when it returns
        self._comm.Barrier()
        return Work([])

    # torch's newer names for the same operations
    all_gather_single = _allgather_base
    all_gather_single_coalesced = allgather_into_tensor_coalesced
    reduce_scatter_single = _reduce_scatter_base
    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced
    all_to_all_single = alltoall_base

    # -- point-to-point: MPI_Isend / MPI_Irecv on the group's communicator --

    def send(self, tensors, dst_rank: int, tag: int = 0) -> Work:
        t = self._p2p_tensor(tensors, dst_rank, "dst")
        side = _HostSide(reads=[t])
        request = self._comm.Isend([side(t), MPI.BYTE], dest=dst_rank, tag=tag)
        return Work([t], mpi_request=request, flight=self._flight(f"send to {dst_rank}", t)
                    )._then(side.write_back)  # keeps the copy alive

    def recv(self, tensors, src_rank: int, tag: int = 0) -> Work:
        t = self._p2p_tensor(tensors, src_rank, "src")
        return self._irecv(t, src_rank, tag)

    def recv_anysource(self, tensors, tag: int = 0) -> Work:
        t = self._p2p_tensor(tensors, None, "src")
        return self._irecv(t, MPI.ANY_SOURCE, tag)

    def _irecv(self, t, source: int, tag: int) -> Work:
        side = _HostSide(writes=[t])
        request = self._comm.Irecv([side(t), MPI.BYTE], source=source, tag=tag)
        peer = "any rank" if source == MPI.ANY_SOURCE else source
        return Work([t], mpi_request=request, source=source,
                    flight=self._flight(f"recv from {peer}", t))._then(side.write_back)

    def _flight(self, name: str, t):
        """A point-to-point call's flight record entry, while a timeout is set."""
        if watchdog._timeout is None:
            return None
        return watchdog.begin(name, self._comm, _nbytes(t), "bytes", blocking=False)

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

    def _split_bytes(self, t, splits, what: str) -> list[int]:
        rows = t.shape[0] if t.dim() else 1
        row_bytes = _nbytes(t) // rows if rows else 0
        if not splits:
            if rows % self._size:
                raise ValueError(f"fastreduce backend: all_to_all_single: {rows} rows do not "
                                 f"divide among {self._size} ranks; give {what}")
            return [rows // self._size * row_bytes] * self._size
        if len(splits) != self._size or sum(splits) != rows or min(splits) < 0:
            raise ValueError(f"fastreduce backend: {what} {list(splits)} must be {self._size} "
                             f"non-negative row counts summing to {rows}")
        return [int(s) * row_bytes for s in splits]

    def _p2p_tensor(self, tensors, peer, what: str):
        if len(tensors) != 1:
            raise BackendError("fastreduce backend: send and recv take one tensor")
        _check_tensor(tensors[0], "tensor")
        if peer is not None and not 0 <= peer < self._size:
            raise ValueError(f"fastreduce backend: {what} rank {peer} is not in this group of "
                             f"{self._size}")
        return tensors[0]


def _recorded(call: Callable, name: str, comm, nbytes: int) -> Callable:
    """call, recorded in the flight record while it runs (a timeout is set)."""
    def run(c):
        entry = watchdog.begin(name, comm, nbytes, "bytes")
        try:
            call(c)
        except BaseException:
            watchdog.end(entry, False)
            raise
        watchdog.end(entry)

    return run


def _any_cuda(tensors) -> bool:
    """Whether any tensor in a (nested) list is on a GPU."""
    return any(_any_cuda(t) if isinstance(t, (list, tuple)) else t.is_cuda for t in tensors)


def _displs(counts: list[int]) -> list[int]:
    out, total = [], 0
    for c in counts:
        out.append(total)
        total += c
    return out


# --- creating groups ---------------------------------------------------------------------

_adopt = threading.local()  # a communicator the next group creation takes as it is


def _create(options, backend_options=None) -> ProcessGroupFastreduce:
    """torch's creator: the world (a duplicate of fastreduce.default_comm()) or a new group
    of the given ranks (MPI_Comm_create_group, collective over its members only)."""
    comm = getattr(_adopt, "comm", None)
    _adopt.comm = None
    world = _collectives.default_comm()
    ranks = list(options.global_ranks_in_group)
    if comm is None:
        if not ranks or ranks == list(range(world.Get_size())):
            with watchdog.recorded("MPI_Comm_dup: a process group", world):
                comm = world.Dup()
        else:
            group = world.Get_group()
            try:
                subgroup = group.Incl(ranks)
                try:
                    with watchdog.recorded(f"MPI_Comm_create_group: ranks {ranks}", world):
                        comm = world.Create_group(subgroup, tag=_GROUP_TAG)
                finally:
                    subgroup.Free()
            finally:
                group.Free()
    if (options.group_rank, options.group_size) != (comm.Get_rank(), comm.Get_size()):
        raise ValueError(
            f"fastreduce backend: torch gave rank {options.group_rank} of {options.group_size} "
            f"but MPI has rank {comm.Get_rank()} of {comm.Get_size()}; launch with mpiexec or "
            f"srun and leave rank and world_size out (they come from MPI)")
    return ProcessGroupFastreduce(comm, timeout=options.timeout)


_GROUP_TAG = 0x7A11


def process_group(comm: MPI.Intracomm, ranks: Sequence[int] | None = None):
    """A torch process group over an existing communicator (e.g. a Partition's cached
    sub-communicator): called by the communicator's members only. `ranks`: its members'
    ranks in torch's world, found from MPI when omitted."""
    if comm == MPI.COMM_NULL:
        raise ValueError("fastreduce backend: this worker is not in the communicator "
                         "(MPI.COMM_NULL); only its members call process_group()")
    if not dist.is_initialized():
        raise RuntimeError("fastreduce backend: call dist.init_process_group('fastreduce') "
                           "first")
    if ranks is None:
        world = _collectives.default_comm()
        ranks = MPI.Group.Translate_ranks(comm.Get_group(), list(range(comm.Get_size())),
                                          world.Get_group())
    _adopt.comm = comm
    try:
        return dist.new_group(list(ranks), backend=BACKEND, use_local_synchronization=True)
    finally:
        _adopt.comm = None


# --- rendezvous through MPI --------------------------------------------------------------


def _mpi_rendezvous(url: str = "mpi://", timeout=None, **kwargs):
    """torch rendezvous handler: rank and world size from MPI; rank 0's TCPStore address
    broadcast over MPI. A rank or world size given to init_process_group must be MPI's."""
    world = _collectives.default_comm()
    rank, size = world.Get_rank(), world.Get_size()
    given = {k: v[-1] for k, v in parse_qs(urlparse(url).query).items()}
    for key, mpi_value in (("rank", rank), ("world_size", size)):
        value = kwargs.get(key, given.get(key, "-1"))
        if int(value) not in (-1, mpi_value):
            raise ValueError(f"fastreduce backend: {key}={value} but MPI says {mpi_value} "
                             f"(rank {rank} of {size} in fastreduce.default_comm()); leave "
                             f"{key} out under mpiexec or srun")
    timeout = timeout or datetime.timedelta(minutes=30)
    if rank == 0:
        store = dist.TCPStore(socket.gethostname(), 0, size, is_master=True, timeout=timeout,
                              wait_for_workers=False)
        address = (socket.gethostname(), store.port)
    else:
        address = None
    with watchdog.recorded("rendezvous: the store's address (MPI_Bcast)", world):
        address = world.bcast(address, root=0)
    if rank != 0:
        store = dist.TCPStore(address[0], address[1], size, is_master=False, timeout=timeout)
    yield store, rank, size


def _env_or_mpi(url: str, timeout=None, **kwargs):
    """env:// as torch does it when MASTER_ADDR is set; else the rendezvous through MPI."""
    if "MASTER_ADDR" in os.environ or "TORCHELASTIC_USE_AGENT_STORE" in os.environ:
        return _torch_env_handler(url, timeout=timeout, **kwargs)
    return _mpi_rendezvous(url, timeout=timeout, **kwargs)


_rendezvous_module = sys.modules["torch.distributed.rendezvous"]
_torch_env_handler = _rendezvous_module._rendezvous_handlers.get("env")


def _register() -> None:
    if BACKEND.upper() in getattr(dist.Backend, "_plugins", {}):
        return
    dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu", "cuda"])
    handlers = _rendezvous_module._rendezvous_handlers
    if "mpi" not in handlers:
        dist.register_rendezvous_handler("mpi", _mpi_rendezvous)
    if _torch_env_handler is not None and handlers.get("env") is _torch_env_handler:
        handlers["env"] = _env_or_mpi  # only changes what would have failed: no MASTER_ADDR


_register()

__all__ = ["BACKEND", "BackendError", "ProcessGroupFastreduce", "Work", "process_group",
           "__version__"]
