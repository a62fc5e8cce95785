"""The backend's rendezvous through MPI. argv[1]:
"reachable": rank 0's hostname does not resolve (patched), then FASTREDUCE_STORE_ADDR
  names a port (one host);
"across": no patching, on nodes where rank 0's name resolves only on its own node;
"unreachable ADDR": FASTREDUCE_STORE_ADDR=ADDR, an address of this test's own where
  nothing listens (the bridge of a cluster on this machine)."""

import datetime
import faulthandler
import os
import re
import socket
import sys
import time

import torch
import torch.distributed as dist
from checks import WORLD, Checks

import fastreduce.distributed  # noqa: F401
from fastreduce.errors import BackendError

assert "MASTER_ADDR" not in os.environ, "test must run bare"
faulthandler.dump_traceback_later(120, exit=True)
f = Checks()
me, n = WORLD.rank, WORLD.size
hostname = socket.gethostname()


def tcp_store() -> dist.TCPStore:
    """The TCPStore under the default group's prefix stores."""
    store = dist.distributed_c10d._get_default_store()
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return store


def all_reduce_works(what: str) -> None:
    t = torch.arange(5, dtype=torch.float64) * (me + 1)
    dist.all_reduce(t)
    f.check(torch.equal(t, torch.arange(5, dtype=torch.float64) * n * (n + 1) / 2),
            f"{what}: all_reduce gave {t}")
    store = dist.distributed_c10d._get_default_store()
    store.set(f"from {me}", str(me * me))
    f.check(store.get(f"from {(me + 1) % n}") == str(((me + 1) % n) ** 2).encode(),
            f"{what}: the store does not carry values between ranks")
    dist.barrier()  # rank 0's store serves until every rank has read


if sys.argv[1] == "reachable":
    socket.gethostname = lambda: "node-that-does-not-resolve.invalid"
    dist.init_process_group("fastreduce")
    f.check(tcp_store().host != socket.gethostname(),
            "a rank connected to the hostname that does not resolve")
    all_reduce_works("unresolvable hostname")
    dist.destroy_process_group()
    with socket.socket() as s:  # a free port for FASTREDUCE_STORE_ADDR=ADDR:PORT
        s.bind(("127.0.0.1", 0))
        port = WORLD.bcast(s.getsockname()[1])
    os.environ["FASTREDUCE_STORE_ADDR"] = f"127.0.0.1:{port}"
    dist.init_process_group("fastreduce")
    store = tcp_store()
    f.check((store.host, store.port) == ("127.0.0.1", port),
            f"the store is at {store.host}:{store.port}, not FASTREDUCE_STORE_ADDR's")
    all_reduce_works("FASTREDUCE_STORE_ADDR with a port")
    dist.destroy_process_group()
elif sys.argv[1] == "across":
    dist.init_process_group("fastreduce")
    all_reduce_works("rank 0's hostname resolves on its node only")
    dist.destroy_process_group()
else:
    address = sys.argv[2]
    os.environ["FASTREDUCE_STORE_ADDR"] = address
    os.environ["FASTREDUCE_STORE_TIMEOUT"] = "3"
    rank0_host = WORLD.bcast(hostname)
    started = time.monotonic()
    try:
        dist.init_process_group("fastreduce", timeout=datetime.timedelta(seconds=600))
    except BackendError as exc:
        text = str(exc)
        words = [f"rank(s) {', '.join(map(str, range(1, n)))} of {n}", "within 3 s",
                 f"hostname {rank0_host!r}", "Set FASTREDUCE_STORE_ADDR",
                 "MASTER_ADDR"]
        f.check(all(w in text for w in words)
                and re.search(re.escape(address) + r":\d+ \(", text),
                f"the message lacks the ranks, address and port tried, hostname or fix: {text}")
    except Exception as exc:  # noqa: BLE001
        f.check(False, f"expected BackendError, got {exc!r}")
    else:
        f.check(False, "init_process_group with an unreachable store raised nothing")
    elapsed = time.monotonic() - started
    f.check(elapsed < 3 + 10, f"raised after {elapsed:.1f} s with a bound of 3 s")
    f.check(not dist.is_initialized(), "a failed rendezvous left a group behind")
    del os.environ["FASTREDUCE_STORE_ADDR"]  # then it works
    dist.init_process_group("fastreduce")
    all_reduce_works("after a failed rendezvous")
    dist.destroy_process_group()
f.exit_report()
