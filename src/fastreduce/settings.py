"""Every environment variable fastreduce reads, declared once: its type, default, parser and
meaning (as `mpi4py.rc` is for mpi4py). These are the ``FASTREDUCE_*`` variables, and the
``HOROVOD_*`` variables of Horovod's that `fastreduce.horovod` honours.

`value` reads one setting from the environment and parses it: an invalid value raises
`fastreduce.errors.SettingError` (a ValueError) naming the variable and what to give.
The modules that act on a setting ask here; the compiled core is handed the parsed
values by the Python core, at import or at first use. `fastreduce-info` prints the
table, and the settings page of the documentation is generated from it.
"""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .errors import SettingError
from .sizes import parse_size

__all__ = ["SETTINGS", "Setting", "check_all", "describe", "is_set", "misspelled", "raw",
           "value"]


@dataclass(frozen=True)
class Setting:
    """One environment variable: its name, the kind of value, the default in words, what it
    does, and the parser from its text (None when unset or blank) to the value used."""

    name: str
    kind: str
    default: str
    doc: str
    parse: Callable[[str | None], Any]
    section: str


def _fail(name: str, text: str, hint: str) -> SettingError:
    return SettingError(f"fastreduce: {name}={text!r}: {hint}")


def _choice(name: str, choices: tuple[str, ...], default: str | None, hint: str,
            lower: bool = False) -> Callable[[str | None], Any]:
    def parse(text: str | None):
        text = (text or "").strip()
        if lower:
            text = text.lower()
        if not text:
            return default
        if text not in choices:
            raise _fail(name, text, hint)
        return text
    return parse


def _flag(name: str, default: bool | None) -> Callable[[str | None], Any]:
    """0 or 1; None (unset or blank) gives the default."""
    def parse(text: str | None):
        text = (text or "").strip()
        if not text:
            return default
        if text not in ("0", "1"):
            raise _fail(name, text, "use 0 or 1")
        return text == "1"
    return parse


# The largest size a setting takes: what the compiled core's int64 byte counts hold with
# room to add to them (a petabyte is far past any buffer a rank holds).
MAX_BYTES = 1 << 50
MAX_SECONDS = 1e9  # about 30 years: past any job's wall time


def _seconds(name: str, hint: str, zero_is_none: bool, default: float | None = None
             ) -> Callable[[str | None], Any]:
    """Seconds > 0; unset or blank gives the default; with zero_is_none, 0 gives None."""
    def parse(text: str | None):
        text = (text or "").strip()
        if not text:
            return default
        if zero_is_none and text == "0":
            return None
        try:
            seconds = float(text)
        except ValueError:
            seconds = float("nan")
        if not 0 < seconds <= MAX_SECONDS:  # NaN and infinity fail too
            raise _fail(name, text, hint)
        return seconds
    return parse


def _size(name: str, hint: str, default: int | None, off: int | None = None
          ) -> Callable[[str | None], Any]:
    def parse(text: str | None):
        text = (text or "").strip().lower()
        if not text:
            return default
        if off is not None and text == "off":
            return off
        try:
            nbytes = parse_size(text)
        except ValueError:
            raise _fail(name, text, hint) from None
        if nbytes > MAX_BYTES:
            raise _fail(name, text, f"at most {MAX_BYTES >> 40}TiB; {hint}")
        return nbytes
    return parse


def _number(name: str, hint: str, cast: Callable[[str], Any], lowest: float,
            highest: float) -> Callable[[str | None], Any]:
    """A number from `lowest` to `highest` (NaN and infinity refused); None when unset."""
    def parse(text: str | None):
        text = (text or "").strip()
        if not text:
            return None
        try:
            number = cast(text)
        except ValueError:
            raise _fail(name, text, hint) from None
        if not lowest <= number <= highest:
            raise _fail(name, text, hint)
        return number
    return parse


_HOST_PORT = re.compile(r"\[([0-9A-Fa-f:.]+)\](?::(\d+))?|([^\s:\[\]]+)(?::(\d+))?"
                        r"|([0-9A-Fa-f.]*:[0-9A-Fa-f.]*:[0-9A-Fa-f:.]*)")


def _host_port(name: str, hint: str) -> Callable[[str | None], Any]:
    """ADDR, ADDR:PORT, IPv6 or [IPv6]:PORT: (host, port or None)."""
    def parse(text: str | None):
        text = (text or "").strip()
        if not text:
            return None
        match = _HOST_PORT.fullmatch(text)
        port = match and (match[2] or match[4])
        if not match or (port and not 0 < int(port) < 65536):
            raise _fail(name, text, hint)
        return match[1] or match[3] or match[5], int(port) if port else None
    return parse


def _text(text: str | None) -> str | None:
    return (text or "").strip() or None


def _count(name: str, hint: str, default: int) -> Callable[[str | None], Any]:
    """A whole number >= 0; unset or blank gives the default."""
    def parse(text: str | None):
        text = (text or "").strip()
        if not text:
            return default
        try:
            number = int(text)
        except ValueError:
            raise _fail(name, text, hint) from None
        if not 0 <= number <= MAX_BYTES:
            raise _fail(name, text, hint)
        return number
    return parse


def _exact_one(text: str | None) -> bool:
    """On only when exactly "1" (other values are taken for off, as Horovod does)."""
    return text == "1"


def _lenient_flag(text: str | None) -> bool:
    """Anything but unset, blank or 0 turns it on."""
    return (text or "").strip() not in ("", "0")


SETTINGS: tuple[Setting, ...] = (
    # --- checks and diagnostics
    Setting("FASTREDUCE_DEBUG", "0 or 1", "0",
            "Debug mode: before every all-reduce the ranks compare call, count, dtype, op and "
            "device, and raise CollectiveMismatch on every rank where they differ.",
            _flag("FASTREDUCE_DEBUG", False), "checks"),
    Setting("FASTREDUCE_DEBUG_WAIT", "seconds", "10",
            "Debug mode: how long a rank waits for the others' fingerprints before it reports "
            "a rank that has not arrived.",
            _seconds("FASTREDUCE_DEBUG_WAIT", "give a number of seconds > 0", False), "checks"),
    Setting("FASTREDUCE_TIMEOUT", "seconds", "600",
            "The watchdog: a collective waited for longer than this many seconds prints the "
            "flight record and aborts the job (default 600, torch.distributed's bound; 0: "
            "no watchdog and no record).",
            _seconds("FASTREDUCE_TIMEOUT", "give seconds, or 0 for none", True, 600.0),
            "checks"),
    Setting("FASTREDUCE_FLIGHT_RECORD", "count", "64",
            "How many recent collectives the flight record keeps.",
            _number("FASTREDUCE_FLIGHT_RECORD", "give a whole number from 1 to 1000000", int,
                    1, 1_000_000),
            "checks"),
    Setting("FASTREDUCE_CHECK_CONSISTENCY", "0 or 1", "0",
            "The torch layers compare dtype and shape across ranks before each reduction "
            "(one extra small all-gather per call).",
            _lenient_flag, "checks"),
    # --- host all-reduce
    Setting("FASTREDUCE_SEGMENT_BYTES", "bytes (K, M, G)", "4MiB on one node, 0 across",
            "Split host all-reduces (mpi algorithm) larger than this into segments, one MPI "
            "call each (0: one MPI call per all-reduce); unset: 4MiB on one node, 0 across "
            "nodes.",
            _size("FASTREDUCE_SEGMENT_BYTES", "give bytes (with K, M or G), or 0 for one MPI "
                  "call per all-reduce", None), "host"),
    Setting("FASTREDUCE_ALGORITHM", "auto, mpi, ring, rsag or hierarchical", "auto",
            "The host all-reduce algorithm: the MPI's own call (mpi), a ring of point-to-point "
            "messages (ring), MPI_Reduce_scatter_block + MPI_Allgather (rsag), within-node "
            "reduce(-scatter) + ring between nodes + broadcast/all-gather (hierarchical), or "
            "per size and nodes (auto).",
            _choice("FASTREDUCE_ALGORITHM", ("auto", "mpi", "ring", "rsag", "hierarchical"),
                    "auto", "use one of auto, mpi, ring, rsag, hierarchical", lower=True),
            "host"),
    Setting("FASTREDUCE_ALGORITHM_TABLE", "size table", "from the nodes",
            "The pinned size table for ALGORITHM=auto (e.g. 0:mpi,256KiB:ring); unset: mpi on "
            "one node, mpi then ring or hierarchical from 256KiB across nodes.",
            _text, "host"),
    Setting("FASTREDUCE_RESULT_CACHE_MB", "MiB", "256",
            "The most memory the out-of-place result cache keeps for reuse (0: none).",
            _number("FASTREDUCE_RESULT_CACHE_MB", f"give a number of MiB from 0 to "
                    f"{MAX_BYTES >> 20} (0: no cache)", float, 0, MAX_BYTES >> 20), "host"),
    Setting("FASTREDUCE_HALF_OPS", "auto, mpi or fastreduce", "auto",
            "Whose reduction ops 16-bit floats use: fastreduce's (auto, fastreduce) or "
            "the MPI's own types where they reduce correctly (mpi).",
            _choice("FASTREDUCE_HALF_OPS", ("auto", "mpi", "fastreduce"), "auto",
                    "use auto, mpi or fastreduce", lower=True), "host"),
    Setting("FASTREDUCE_ENGINE", "0 or 1", "on where MPI_THREAD_MULTIPLE",
            "The progress engine: non-blocking calls run on a background thread (0: MPI's "
            "non-blocking collectives instead).",
            _flag("FASTREDUCE_ENGINE", None), "host"),
    Setting("FASTREDUCE_ENGINE_HOST_BYTES", "bytes (K, M, G) or off", "64KiB",
            "The smallest non-blocking host all-reduce the engine runs (0: every one; off: "
            "none, MPI_Iallreduce instead).",
            _size("FASTREDUCE_ENGINE_HOST_BYTES", "give bytes (with K, M or G), 0 for every "
                  "host request, or off", None, off=-1), "host"),
    # --- GPU tensors
    Setting("FASTREDUCE_CUDA_AWARE", "0 or 1", "asks the MPI",
            "Whether the MPI can read GPU memory, overriding the MPI's own answer.",
            _flag("FASTREDUCE_CUDA_AWARE", None), "gpu"),
    Setting("FASTREDUCE_DEVICE_POINTERS", "none or blocking,nonblocking,16bit",
            "what the MPI promises",
            "The calls that may hand device pointers to the MPI, overriding fastreduce's table "
            "of what each MPI promises (a wrong promise crashes).",
            _text, "gpu"),
    Setting("FASTREDUCE_GPU_PATH", "auto, direct or staged", "auto",
            "How CUDA tensors are reduced where the MPI allows both: device pointers to MPI "
            "(direct), through pinned host memory (staged), or per the size table (auto).",
            _choice("FASTREDUCE_GPU_PATH", ("auto", "direct", "staged"), "auto",
                    "use one of auto, direct, staged", lower=True), "gpu"),
    Setting("FASTREDUCE_GPU_THRESHOLDS", "size table", "calibrated",
            "The pinned size table for GPU_PATH=auto (the line `fastreduce-info --calibrate` "
            "prints, e.g. 0:direct,4KiB:staged); unset: calibrated per communicator group.",
            _text, "gpu"),
    Setting("FASTREDUCE_GPU_THRESHOLDS_FILE", "path", "none",
            "A file holding the size table (instead of FASTREDUCE_GPU_THRESHOLDS).",
            _text, "gpu"),
    Setting("FASTREDUCE_STAGING_CHUNK_KB", "KiB", "0 (automatic)",
            "The chunk size of the pipelined GPU staging path (0: automatic).",
            _number("FASTREDUCE_STAGING_CHUNK_KB", f"give a whole number of KiB from 0 to "
                    f"{MAX_BYTES >> 10} (0: automatic)", int, 0, MAX_BYTES >> 10), "gpu"),
    Setting("FASTREDUCE_CUDART", "path", "searched",
            "The CUDA runtime library to load, instead of searching for it.",
            _text, "gpu"),
    # --- torch.distributed backend and the data-parallel step (listed after the Horovod
    # layer's: see below)
    Setting("FASTREDUCE_GRADIENT_SCHEDULE", "auto, overlap or serial", "auto",
            "When GradientSync, hvd.DistributedOptimizer and DDP on the fastreduce backend "
            "reduce gradient buckets: during backward (overlap), after it, all at once "
            "(serial), or whichever the first training steps measure faster (auto).",
            _choice("FASTREDUCE_GRADIENT_SCHEDULE", ("auto", "overlap", "serial"), "auto",
                    "use one of auto, overlap, serial", lower=True), "torch"),
    Setting("FASTREDUCE_STORE_ADDR", "address[:port]", "rank 0's addresses",
            "Where the other ranks reach rank 0's torch.distributed store: an address or "
            "hostname of rank 0 (`[IPv6]:PORT` with a port); with a port, rank 0 opens the "
            "store on it. Unset: rank 0 offers its interface addresses, its hostname and "
            "loopback, and each rank takes the first it reaches, its own subnets first.",
            _host_port("FASTREDUCE_STORE_ADDR", "give an address or hostname of rank 0, "
                       "optionally with :PORT (IPv6 with a port: [ADDR]:PORT)"), "torch"),
    Setting("FASTREDUCE_STORE_TIMEOUT", "seconds", "60",
            "How long a rank tries to reach rank 0's torch.distributed store before every rank "
            "raises BackendError (at most init_process_group's timeout).",
            _seconds("FASTREDUCE_STORE_TIMEOUT", "give a number of seconds > 0", False),
            "torch"),
    # --- the Horovod layer: Horovod's own variables, read by fastreduce.horovod
    Setting("HOROVOD_FUSION_THRESHOLD", "bytes", "25MiB",
            "DistributedOptimizer's bucket size: gradients are reduced in buckets of about "
            "this many bytes (0: a bucket per parameter).",
            _count("HOROVOD_FUSION_THRESHOLD", "give a whole number of bytes >= 0 (0 turns "
                   "fusion off)", 25 << 20), "horovod"),
    Setting("HOROVOD_TIMELINE", "path", "none",
            "At init(), start the timeline: rank 0 writes a Chrome trace of every collective "
            "to this file.",
            _text, "horovod"),
    Setting("HOROVOD_TIMELINE_MARK_CYCLES", "0 or 1", "0",
            "Mark cycles in the timeline: accepted for Horovod's scripts (there are no cycles "
            "to mark).",
            _exact_one, "horovod"),
    Setting("HOROVOD_DYNAMIC_PROCESS_SETS", "0 or 1", "0",
            "Allow add_process_set() and remove_process_set() after init(), as "
            "init(process_sets='dynamic') does (anything but unset, blank or 0 turns it on).",
            _lenient_flag, "horovod"),
)

_BY_NAME: dict[str, Setting] = {s.name: s for s in SETTINGS}


def _setting(name: str) -> Setting:
    try:
        return _BY_NAME[name]
    except KeyError:
        raise KeyError(f"fastreduce: no setting {name!r}; the settings are "
                       f"{', '.join(_BY_NAME)}") from None


def raw(name: str, environ: Mapping[str, str] | None = None) -> str | None:
    """The text of a setting in the environment (None when unset)."""
    _setting(name)
    return (os.environ if environ is None else environ).get(name)


def is_set(name: str, environ: Mapping[str, str] | None = None) -> bool:
    """Whether a setting is given (set and not blank)."""
    return bool((raw(name, environ) or "").strip())


def value(name: str, environ: Mapping[str, str] | None = None) -> Any:
    """The parsed value of a setting (its parser's default when unset); SettingError if the
    environment's text is invalid."""
    return _setting(name).parse(raw(name, environ))


def describe(environ: Mapping[str, str] | None = None) -> list[tuple[str, str, str]]:
    """(name, text in the environment or "(default: ...)", meaning) for every setting."""
    rows = []
    for s in SETTINGS:
        text = raw(s.name, environ)
        shown = text if text is not None else f"(default: {s.default})"
        rows.append((s.name, shown, s.doc))
    return rows


# FASTREDUCE_* names in the environment that are not settings: fastreduce's own hand-over
# to child processes, and its test suite's variables (FASTREDUCE_TEST_*)
_NOT_SETTINGS = ("FASTREDUCE_TORCHRUN_VARIABLES_OF",)
_NOT_SETTINGS_PREFIX = "FASTREDUCE_TEST_"


def check_all(environ: Mapping[str, str] | None = None) -> None:
    """Parse every setting given in the environment; one SettingError naming each bad
    variable, its value and what to give (nothing is acted on)."""
    problems = []
    for s in SETTINGS:
        try:
            s.parse(raw(s.name, environ))
        except SettingError as exc:
            problems.append(str(exc).removeprefix("fastreduce: "))
    if problems:
        raise SettingError("fastreduce: " + "; ".join(problems))


def misspelled(environ: Mapping[str, str] | None = None) -> list[tuple[str, str]]:
    """(name, the setting it is closest to) for each FASTREDUCE_* variable in the
    environment that is no setting but near one: a typo that would be ignored."""
    environ = os.environ if environ is None else environ
    prefix = "FASTREDUCE_"
    suffixes = {s.name[len(prefix):]: s.name for s in SETTINGS if s.name.startswith(prefix)}
    found = []
    for name in sorted(environ):
        if not name.startswith(prefix) or name in _BY_NAME or name in _NOT_SETTINGS or \
                name.startswith(_NOT_SETTINGS_PREFIX):
            continue
        close = difflib.get_close_matches(name[len(prefix):], suffixes, n=1, cutoff=0.75)
        if close:
            found.append((name, suffixes[close[0]]))
    return found
