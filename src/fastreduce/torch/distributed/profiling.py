"""Profiler events for the backend's operations, named as torch's backends name theirs
("fastreduce:all_reduce"), with the input tensors' shapes, asynchronous as theirs are;
recorded only while torch's profiler runs (otherwise one check per call)."""

from __future__ import annotations

import functools
import queue
import sys
import threading
import traceback

import torch

_enabled = torch._C._autograd._profiler_enabled
_enter = torch._C._autograd._record_function_with_args_enter
_exit = torch._C._autograd._record_function_with_args_exit
# ends the event when the future completes, on the thread that completes it: the
# profiler's state goes with it (a plain done-callback on another thread records no end)
_exit_on = torch.ops.profiler._call_end_callbacks_on_jit_fut._RecordFunction
_inside = threading.local()  # an operation made of others records one event
# Torch's backends' events are asynchronous (their work ends on a worker thread), and the
# profiler keeps such events out of the CPU operators' tree: every operation's event is
# ended on the ender's thread to be one too (a blocking operation's as it returns).
_to_end: queue.SimpleQueue = queue.SimpleQueue()  # (callable, its argument), run in order
_ender: threading.Thread | None = None
_ender_lock = threading.Lock()


def _ending() -> None:
    while True:
        call, argument = _to_end.get()
        try:
            call(argument)
        except BaseException:  # noqa: BLE001  (the thread must live on: others wait on it)
            print("fastreduce: ending a profiler event failed:", file=sys.stderr)
            traceback.print_exc()


def _on_ender(call, argument) -> None:
    """Run call(argument) on the ender's thread (started at the first event)."""
    global _ender
    if _ender is None:
        with _ender_lock:
            if _ender is None:
                _ender = threading.Thread(target=_ending, name="fastreduce-profiler",
                                          daemon=True)
                _ender.start()
    _to_end.put((call, argument))


def _hop(relay: torch.futures.Future) -> None:
    """Complete relay on the ender's thread and wait for that: the profiler event its end
    callback ends is then an asynchronous one. The ender runs nothing else (no user
    callback: those run where the operation completes), so it never waits on itself."""
    ended = threading.Lock()
    ended.acquire()
    _on_ender(_complete_then_release, (relay, ended))
    ended.acquire()  # (a thread hop: some 100 us a call on a 2-core VM, while profiling)


def _complete_then_release(pair) -> None:
    relay, ended = pair
    try:
        relay.set_result(None)
    finally:
        ended.release()


def _end_async(handle) -> None:
    """End the event now, as an asynchronous one."""
    relay = torch.futures.Future()
    _exit_on(handle, relay)
    _hop(relay)


def _end_async_on(handle, future: torch.futures.Future) -> torch.futures.Future:
    """End the event, as an asynchronous one, once `future` completes; returns the future
    that completes after that end, with future's value, on the thread that completed
    future (its callbacks run there, as without a profiler)."""
    relay = torch.futures.Future()
    _exit_on(handle, relay)  # here: this thread's profiler state goes with the end
    finished = torch.futures.Future()

    def on_done(done: torch.futures.Future) -> None:
        _hop(relay)
        _pass_on(done, finished)

    future.add_done_callback(on_done)
    return finished


def _pass_on(source: torch.futures.Future, target: torch.futures.Future) -> None:
    try:
        value = source.value()
    except BaseException as exc:  # noqa: BLE001  (the operation's error goes on with it)
        target.set_exception(exc)
    else:
        target.set_result(value)


def _tensors(arg) -> list[torch.Tensor]:
    if isinstance(arg, torch.Tensor):
        return [arg]
    if isinstance(arg, (list, tuple)):
        return [t for a in arg for t in _tensors(a)]
    return []


def profiled(backend: str, event: str, inputs: int | None = 0):
    """A method that records the event "<backend>:<event>" from its call until its work
    completes (an asynchronous event, ended on the ender's thread), with the shapes of
    its argument number `inputs` (None: no tensors)."""

    def wrap(method):
        @functools.wraps(method)
        def run(self, *args, **kwargs):
            if not _enabled() or getattr(_inside, "active", False):
                return method(self, *args, **kwargs)
            given = _tensors(args[inputs]) if inputs is not None and len(args) > inputs else []
            handle = _enter(f"{backend}:{event}", *given)
            _inside.active = True
            try:
                work = method(self, *args, **kwargs)
            except BaseException:
                _exit(handle)
                raise
            finally:
                _inside.active = False
            future = work._pending_future()
            if future is None:
                _end_async(handle)
            else:
                work._set_profiled(_end_async_on(handle, future))
            return work

        return run

    return wrap
