"""`Work`: what the backend's operations return."""

from __future__ import annotations

import datetime
import threading
import time

import torch
import torch.distributed as dist
from mpi4py import MPI

from ...backend import engine as _engine
from ...errors import WaitTimeout


def completes_within(done, seconds: float) -> bool:
    """Whether done() turns true within seconds (MPI cannot wait with a deadline): a short
    spin, then polls 10 us apart growing to 1 ms, so a prompt completion costs no sleep."""
    deadline = time.monotonic() + seconds
    for _ in range(1000):
        if done():
            return True
    pause = 1e-5
    while time.monotonic() < deadline:
        if done():
            return True
        time.sleep(pause)
        pause = min(pause * 2, 1e-3)
    return bool(done())


class Work(dist.Work):
    """What an operation returns: wait() blocks with the GIL released; get_future()
    completes when MPI has completed (from the progress engine's thread), unprompted."""

    def __init__(self, result: list, *, request=None, job=None, mpi_request=None,
                 source: int = -1):
        super().__init__()
        self._result = result
        self._error: BaseException | None = None
        self._request = request          # a fastreduce Request run by the progress engine
        self._job = job                  # an engine job (other collectives)
        self._mpi_request = mpi_request  # a point-to-point request (wait, test, source)
        self._finished = request is None and job is None and mpi_request is None
        self._future = None  # made on demand for work that is already complete
        # a profiled operation's event ends in a callback of the future, on whichever thread
        # completes it: this future completes after that callback has run
        self._profiled = None
        if self._finished:
            return
        self._future = torch.futures.Future()
        self._source = source
        self._lock = threading.Lock()
        self._waiter = None
        if request is not None:
            request.add_done_callback(self._from_request)
        elif job is not None:
            job.add_done_callback(self._from_job)

    def _finish(self, error: BaseException | None) -> None:
        with self._lock:
            if self._finished:
                return
            self._finished = True
        self._error = error
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
        try:
            self._mpi_request.wait()
            if self._source == MPI.ANY_SOURCE:
                self._source = self._mpi_request.source
        except BaseException as exc:  # noqa: BLE001
            self._finish(exc)
        else:
            self._finish(None)

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        """Block (GIL released) until MPI has completed the operation; raise its error.
        A positive timeout raises WaitTimeout once it elapses, the operation still in
        flight (torch's C++ passes 0: no bound)."""
        if self._future is None:  # complete from the start
            return True
        if (timeout and timeout.total_seconds() > 0
                and not completes_within(self.is_completed, timeout.total_seconds())):
            raise WaitTimeout(
                f"fastreduce backend: wait() timed out after {timeout.total_seconds():g} s: "
                f"the operation has not completed (a rank it needs has not reached it). It "
                f"is still in flight and its tensors are MPI's until it completes: wait "
                f"again, or end the job")
        if self._request is not None:
            self._request.wait()
        elif self._job is not None:
            _engine.wait_job(self._job)
        elif self._mpi_request is not None and self._waiter is None and not self._finished:
            self._wait_mpi()
        self._future.wait()  # a callback may still be completing it on another thread
        if self._profiled is not None:
            # the profiler event's end, ended on another thread, before wait() returns: a
            # profile stopped or read after wait() must not race with it
            try:
                self._profiled.wait()
            except BaseException:  # noqa: BLE001  (the operation's error, raised below)
                pass
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        if self._future is None:
            return True
        if self._mpi_request is not None and self._waiter is None and not self._finished:
            try:
                completed = self._mpi_request.test()
            except BaseException as exc:  # noqa: BLE001  (reported by wait() and the future)
                self._finish(exc)
            else:
                if completed:
                    if self._source == MPI.ANY_SOURCE:  # the sender, for recv_anysource
                        self._source = self._mpi_request.source
                    self._finish(None)
        return self._completion().done()

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
        return self._completion()

    def _pending_future(self):
        """The future the operation completes, or None if it has completed."""
        return None if self._future is None or self._finished else self._future

    def _completion(self) -> torch.futures.Future:
        """The future that completes last: the profiled one where there is one."""
        return self._future if self._profiled is None else self._profiled

    def _set_profiled(self, profiled: torch.futures.Future) -> None:
        """The future that completes once the profiler event's end has run on the
        operation's future (wait(), is_completed() and get_future() wait for it)."""
        self._profiled = profiled

    def _source_rank(self) -> int:
        """The rank a recv_anysource() received from (after wait())."""
        return self._source

    def synchronize(self) -> None:
        self.wait()


class Done(Work):
    """What an operation that completed before returning gives: no waiting, its result
    (a Work made in the fewest steps: the backend's small blocking calls return one)."""

    def __init__(self, result: list):
        dist.Work.__init__(self)  # (not Work's: nothing to wait for)
        self._result = result

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        return True

    def _pending_future(self):
        return None

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def exception(self):
        return None

    def result(self) -> list:
        return self._result

    def get_future(self) -> torch.futures.Future:
        future = torch.futures.Future()
        future.set_result(self._result)
        return future

    def _source_rank(self) -> int:
        return -1

    def synchronize(self) -> None:
        pass
