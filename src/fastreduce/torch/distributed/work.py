"""`Work`: what the backend's operations return."""

from __future__ import annotations

import datetime
import threading
from collections.abc import Callable

import torch
import torch.distributed as dist
from mpi4py import MPI

from ... import watchdog
from ...backend import engine as _engine


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
            status = MPI.Status()
            if self._mpi_request.Test(status):
                if self._source == MPI.ANY_SOURCE:  # the sender, for recv_anysource
                    self._source = status.Get_source()
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
