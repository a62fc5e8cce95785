"""Every exception fastreduce defines, in one place, under one base class.

Each also derives from the built-in exception that describes it best, so code that
catches ``ValueError`` or ``RuntimeError`` keeps working. Bad arguments that fit a
built-in exception exactly (a tensor of the wrong type, a read-only buffer) are raised
as that built-in (``TypeError``, ``BufferError``), with a message that starts with
``fastreduce:``; an error code MPI returns is raised as ``mpi4py.MPI.Exception``, with
MPI's own message.
"""

from __future__ import annotations

__all__ = [
    "BackendError",
    "BarrierTimeout",
    "CalibrationError",
    "ClusterError",
    "CollectiveMismatch",
    "FastreduceError",
    "HorovodArgumentError",
    "HorovodInternalError",
    "HorovodMismatch",
    "SettingError",
    "SettingWarning",
    "UsageError",
    "WaitTimeout",
]


class FastreduceError(Exception):
    """The base class of every exception fastreduce defines."""


class SettingError(FastreduceError, ValueError):
    """A ``FASTREDUCE_*`` environment variable holds a value its parser refuses."""


class SettingWarning(UserWarning):
    """A ``FASTREDUCE_*`` variable in the environment that is no setting but close to one
    (a misspelling fastreduce would otherwise ignore)."""


class CollectiveMismatch(FastreduceError, RuntimeError):
    """The ranks of a communicator called a collective with different arguments: raised
    on every rank, naming what differs and which ranks passed what."""

    def __init__(self, message: str, differences: dict | None = None):
        super().__init__(message)
        self.differences = differences or {}  # field -> {value: [ranks]}


class CalibrationError(FastreduceError, RuntimeError):
    """The GPU path calibration failed on some rank; every rank of the group raises it."""


class BackendError(FastreduceError, ValueError):
    """An operation, dtype or setting the torch.distributed backend does not support."""


class BarrierTimeout(FastreduceError, RuntimeError):
    """A torch.distributed barrier on a fastreduce group waited past the group's timeout:
    a rank of the group never arrived."""


class WaitTimeout(FastreduceError, RuntimeError):
    """`Work.wait(timeout)` on a fastreduce group elapsed before the operation completed;
    the operation is still in flight (wait again, or end the job)."""


class UsageError(FastreduceError):
    """Bad command-line arguments to a fastreduce tool: every rank finds the same, rank 0
    says so, and all exit with status 2."""


class ClusterError(FastreduceError, RuntimeError):
    """The cluster on one machine (``fastreduce.cluster``) cannot be made, used or removed:
    the message names the command that failed and what to do."""


class HorovodInternalError(FastreduceError, RuntimeError):
    """An operation of ``fastreduce.horovod`` failed (Horovod's name for the error its
    collectives raise)."""


class HorovodArgumentError(FastreduceError, ValueError, RuntimeError):
    """An argument Horovod refuses with a RuntimeError (e.g. hvd.Adasum in reducescatter):
    a ValueError as fastreduce's refusals are, and a RuntimeError as Horovod's."""


class HorovodMismatch(CollectiveMismatch, HorovodInternalError):
    """The ranks of a process set submitted different collectives under one name (dtype,
    shape, op, root...), a rank refused its arguments, or every rank waits for a request
    the others never submitted: raised on every rank concerned."""
