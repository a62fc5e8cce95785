"""Rendezvous through MPI: rank, world size and the store's address come from MPI, so no
MASTER_ADDR or MASTER_PORT is needed.

Rank 0 opens torch's TCPStore on every interface and broadcasts its candidate addresses
(its IPv4 and global IPv6 interface addresses, its hostname, loopback last) or the one in
FASTREDUCE_STORE_ADDR. Each other rank takes the first that answers with rank 0's token,
those in its own subnets first, within FASTREDUCE_STORE_TIMEOUT; then the ranks agree, so
a rank that reached nothing makes every rank raise BackendError.
"""

from __future__ import annotations

import atexit
import datetime
import ipaddress
import os
import secrets
import socket
import struct
import sys
import threading
import time
from urllib.parse import parse_qs, urlparse

import torch.distributed as dist

from ... import runtime, settings, watchdog
from ...backend import collectives as _collectives
from ...errors import BackendError

_KEY = "fastreduce/rendezvous"  # rank 0 sets its token here: the store reached is rank 0's
_PROBE_S = 2.0  # the longest one connection attempt may take
_ANSWER_S = 2 * _PROBE_S  # how long the rendezvous waits for one probe's answer
_LOOPBACK = "127.0.0.1"


def _interfaces() -> list[ipaddress.IPv4Interface | ipaddress.IPv6Interface]:
    """This host's IPv4 and global IPv6 interface addresses with their networks, loopback
    and link-local left out (Linux; none where the ioctl or /proc/net are missing)."""
    found = []
    try:
        import fcntl

        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            for _, name in socket.if_nameindex():
                request = struct.pack("256s", name.encode()[:15])
                try:
                    addr, mask = (socket.inet_ntoa(fcntl.ioctl(s, code, request)[20:24])
                                  for code in (0x8915, 0x891B))  # SIOCGIFADDR, SIOCGIFNETMASK
                except OSError:
                    continue  # no IPv4 address on this interface
                found.append(ipaddress.ip_interface(f"{addr}/{mask}"))
    except (ImportError, OSError, AttributeError):
        pass
    try:
        with open("/proc/net/if_inet6") as lines:
            for line in lines:
                addr, _, prefix, scope = line.split()[:4]
                if int(scope, 16) == 0:  # global scope
                    ip = ipaddress.IPv6Address(bytes.fromhex(addr))
                    found.append(ipaddress.ip_interface(f"{ip}/{int(prefix, 16)}"))
    except (OSError, ValueError):
        pass
    return [i for i in found if not (i.ip.is_loopback or i.ip.is_link_local)]


def _candidates(interfaces, hostname: str) -> list[str]:
    """Rank 0's addresses for its store, in its order: IPv4, IPv6, hostname, loopback last."""
    ips = sorted(interfaces, key=lambda i: i.version)
    return list(dict.fromkeys([*(str(i.ip) for i in ips), hostname, _LOOPBACK]))


def _ordered(candidates: list[str], interfaces) -> list[str]:
    """The candidates in one of this rank's networks first (the way MPI reaches rank 0),
    loopback last, otherwise in rank 0's order."""
    def key(host: str) -> tuple[bool, bool]:
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            return False, True  # a hostname
        return ip.is_loopback, not any(ip in i.network for i in interfaces)
    return sorted(candidates, key=key)


def _show(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _client(host: str, port: int, size: int, token: str):
    """A client of the store at host:port if it answers with rank 0's token, else why not.
    On a thread: torch's client waits without a timeout on a listener that is not a store."""
    answer = []

    def connect() -> None:
        try:
            store = dist.TCPStore(host, port, size, is_master=False,
                                  timeout=datetime.timedelta(seconds=_PROBE_S))
            answer.append(store if store.get(_KEY).decode() == token
                          else "another store answered")
        except Exception as exc:  # noqa: BLE001  (any failure: this address does not serve)
            answer.append((str(exc).splitlines() or [""])[0] or type(exc).__name__)

    thread = threading.Thread(target=connect, name="fastreduce-rendezvous", daemon=True)
    thread.start()
    thread.join(_ANSWER_S)
    if thread.is_alive():
        _late.append(thread)
    return answer[0] if answer else "a listener that is not torch's store"


# Probes still inside torch's client when the rendezvous went on. One that returns while the
# interpreter shuts down aborts the process (a daemon thread leaving C++ code then is ended
# by an unwind that C++ turns into std::terminate): at exit, each gets the time its client's
# own timeout needs. One that waits for ever (a listener that is not a store) stays blocked
# in C++, which ends with the process.
_late: list[threading.Thread] = []


def _join_late_probes() -> None:
    deadline = time.monotonic() + 2 * _PROBE_S
    for thread in _late:
        thread.join(max(0.0, deadline - time.monotonic()))


atexit.register(_join_late_probes)


def _reach(hosts: list[str], port: int, token: str, size: int, bound: float,
           tried: dict[str, str]):
    """A client of rank 0's store at the first host that answers, trying in rounds for
    `bound` seconds; None if none did (`tried` gets each host's last error)."""
    deadline = time.monotonic() + bound
    while True:
        for host in hosts:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            try:
                socket.create_connection((host, port), timeout=min(_PROBE_S, left)).close()
            except Exception as exc:  # noqa: BLE001  (an unresolvable or malformed name too:
                # every rank must reach the agreement below, never raise alone)
                tried[_show(host, port)] = str(exc) or type(exc).__name__
                continue
            answer = _client(host, port, size, token)
            if not isinstance(answer, str):
                return answer
            tried[_show(host, port)] = answer
        time.sleep(min(0.2, max(deadline - time.monotonic(), 0)))


def _unreachable(results: list, offer: tuple, size: int, bound: float, named: bool) -> str:
    hosts, port, _, hostname = offer
    failed = [r for r, tried in enumerate(results) if tried is not None]
    first = failed[0]
    attempts = "; ".join(f"{a} ({e})" for a, e in results[first].items()) or "nothing"
    given = "FASTREDUCE_STORE_ADDR's address" if named else "rank 0's addresses"
    return (f"fastreduce backend: rank(s) {', '.join(map(str, failed))} of {size} could not "
            f"reach torch's store on rank 0 (hostname {hostname!r}) within {bound:g} s at "
            f"{given} {', '.join(_show(h, port) for h in hosts)}; rank {first} tried "
            f"{attempts}. Set FASTREDUCE_STORE_ADDR to an address of rank 0 that the other "
            f"nodes reach (ADDR or ADDR:PORT), or set MASTER_ADDR and MASTER_PORT for torch's "
            f"env:// rendezvous")


def _mpi_rendezvous(url: str = "mpi://", timeout=None, **kwargs):
    """torch rendezvous handler: rank and world size from MPI; rank 0's TCPStore addresses
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
    named = settings.value("FASTREDUCE_STORE_ADDR")  # (host, port or None) or None
    bound = min(settings.value("FASTREDUCE_STORE_TIMEOUT") or 60.0, timeout.total_seconds())
    store = offer = None
    if rank == 0:
        try:  # the server listens on every interface; rank 0's own client uses loopback
            store = dist.TCPStore(_LOOPBACK, (named and named[1]) or 0, size, is_master=True,
                                  timeout=timeout, wait_for_workers=False)
            token = secrets.token_hex(16)
            store.set(_KEY, token)
            hostname = socket.gethostname()
            hosts = [named[0]] if named else _candidates(_interfaces(), hostname)
            offer = (hosts, store.port, token, hostname)
        except (OSError, RuntimeError) as exc:
            offer = f"rank 0 could not open torch's store: {str(exc).splitlines()[0]}"
    with watchdog.recorded("rendezvous: the store's addresses (MPI_Bcast)", world):
        offer = world.bcast(offer, root=0)
    if isinstance(offer, str):
        raise BackendError(f"fastreduce backend: {offer}")
    tried: dict[str, str] = {}
    if rank != 0:
        hosts = offer[0] if named else _ordered(offer[0], _interfaces())
        store = _reach(hosts, offer[1], offer[2], size, bound, tried)
    with watchdog.recorded("rendezvous: every rank reached the store (MPI_Allgather)", world):
        results = world.allgather(None if store is not None else tried)
    if any(tried is not None for tried in results):
        raise BackendError(_unreachable(results, offer, size, bound, bool(named)))
    store.set_timeout(timeout)
    yield store, rank, size


TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
# "pid:RANK=..,WORLD_SIZE=..": the process that set them and what it set. A child (a job
# this one launches) inherits them but is not described by them; a launcher between (e.g.
# torchrun) sets its own values, which are kept.
_SET_BY = "FASTREDUCE_TORCHRUN_VARIABLES_OF"


def torchrun_environment(environ, rank: int, size: int, local, pid: int) -> dict[str, str]:
    """The variables torchrun sets that environ lacks, from MPI: rank and size of the
    world, and local() -> (rank, size) on the node, called only when needed. Where RANK
    or WORLD_SIZE is set by the launcher, it is torchrun's kind: nothing is added; where
    another process (pid: this one) set them, its values are replaced."""
    setter, _, inherited = environ.get(_SET_BY, "").partition(":")
    if setter == str(pid):
        return {}
    if setter:
        set_there = dict(kv.split("=", 1) for kv in inherited.split(",") if "=" in kv)
        environ = {k: v for k, v in environ.items()
                   if not (k in TORCHRUN_VARIABLES and set_there.get(k) == v)}
    if "RANK" in environ or "WORLD_SIZE" in environ or "TORCHELASTIC_RUN_ID" in environ:
        return {}
    values = {"RANK": rank, "WORLD_SIZE": size}
    if "LOCAL_RANK" not in environ or "LOCAL_WORLD_SIZE" not in environ:
        values["LOCAL_RANK"], values["LOCAL_WORLD_SIZE"] = local()
    added = {k: str(v) for k, v in values.items() if k not in environ}
    return {**added, _SET_BY: f"{pid}:" + ",".join(f"{k}={v}" for k, v in added.items())}


def export_torchrun_environment() -> None:
    """Set RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE from MPI where the launcher
    (mpiexec, srun) did not, so scripts written for torchrun run unchanged. Collective over
    fastreduce.default_comm() when LOCAL_RANK is unset (the node's ranks, found once by
    MPI_Comm_split_type): every rank imports fastreduce.distributed."""
    world = _collectives.default_comm()
    os.environ.update(torchrun_environment(
        os.environ, world.Get_rank(), world.Get_size(),
        lambda: (runtime.local_rank(), runtime.local_size()), os.getpid()))


def _env_or_mpi(url: str, timeout=None, **kwargs):
    """env:// as torch does it when MASTER_ADDR is set; else the rendezvous through MPI."""
    if "MASTER_ADDR" in os.environ or "TORCHELASTIC_USE_AGENT_STORE" in os.environ:
        return _torch_env_handler(url, timeout=timeout, **kwargs)
    return _mpi_rendezvous(url, timeout=timeout, **kwargs)


_rendezvous_module = sys.modules["torch.distributed.rendezvous"]
_torch_env_handler = _rendezvous_module._rendezvous_handlers.get("env")
