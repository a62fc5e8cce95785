"""Profiler events for the backend's operations, named as torch's backends name theirs
("fastreduce:all_reduce"), with the input tensors' shapes; recorded only while torch's
profiler runs (otherwise one check per call)."""

from __future__ import annotations

import functools
import threading

import torch

_enabled = torch._C._autograd._profiler_enabled
_enter = torch._C._autograd._record_function_with_args_enter
_exit = torch._C._autograd._record_function_with_args_exit
# ends the event when the future completes, on whichever thread: the profiler's state
# goes with it (a plain done-callback on the engine's thread would record no end)
_exit_on = torch.ops.profiler._call_end_callbacks_on_jit_fut._RecordFunction
_inside = threading.local()  # an operation made of others records one event


def _tensors(arg) -> list[torch.Tensor]:
    if isinstance(arg, torch.Tensor):
        return [arg]
    if isinstance(arg, (list, tuple)):
        return [t for a in arg for t in _tensors(a)]
    return []


def profiled(backend: str, event: str, inputs: int | None = 0):
    """A method that records the event "<backend>:<event>" from its call until its work
    completes (in the engine's thread for work run there), with the shapes of its argument
    number `inputs` (None: no tensors)."""

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
                _exit(handle)
            else:
                work._set_profiled(_exit_on(handle, future))
            return work

        return run

    return wrap
