"""The torch.distributed backend's rendezvous through MPI: rank 0's store reached without a
resolvable hostname, FASTREDUCE_STORE_ADDR, and the candidate addresses rank 0 offers and
a rank tries. The launched program is tests/launch/programs/torch_rendezvous.py."""

import pytest
from mpirun import run_program

pytestmark = pytest.mark.one_mpi  # its subject does not depend on the MPI family


@pytest.mark.parametrize("nprocs", [2, 3])
def test_rendezvous_without_a_resolvable_hostname(nprocs):
    """Rank 0's hostname resolves nowhere: the ranks reach its store at an interface address
    (or loopback); FASTREDUCE_STORE_ADDR=ADDR:PORT puts the store there."""
    out = run_program("torch_rendezvous.py", nprocs, "reachable")
    assert f"on {nprocs} ranks, 0 failed" in out


def test_rendezvous_candidate_addresses():
    """Rank 0 offers IPv4, IPv6, hostname, loopback last; a rank tries its own subnets first;
    FASTREDUCE_STORE_ADDR is ADDR, ADDR:PORT, IPv6 or [IPv6]:PORT."""
    from ipaddress import ip_interface

    rdv = pytest.importorskip("fastreduce.torch.distributed.rendezvous")
    from fastreduce.errors import SettingError
    from fastreduce.settings import value

    rank0 = [ip_interface("10.1.0.5/16"), ip_interface("fd00::5/64"),
             ip_interface("192.168.7.5/24")]
    offered = rdv._candidates(rank0, "node0")
    assert offered == ["10.1.0.5", "192.168.7.5", "fd00::5", "node0", "127.0.0.1"]
    mine = [ip_interface("192.168.7.9/24"), ip_interface("fd00::9/64")]
    assert rdv._ordered(offered, mine) == ["192.168.7.5", "fd00::5", "10.1.0.5", "node0",
                                           "127.0.0.1"]
    assert rdv._ordered(offered, []) == offered
    here = rdv._interfaces()
    assert all(not (i.ip.is_loopback or i.ip.is_link_local) for i in here)
    assert rdv._candidates(here, "h")[-2:] == ["h", "127.0.0.1"]
    for text, parsed in [("10.0.0.1", ("10.0.0.1", None)), ("node1:29500", ("node1", 29500)),
                         ("fd00::2", ("fd00::2", None)), ("[fd00::2]:80", ("fd00::2", 80))]:
        assert value("FASTREDUCE_STORE_ADDR", {"FASTREDUCE_STORE_ADDR": text}) == parsed
    for text in ["node1:", "node1:70000", "a b", "[node]:1", ":5"]:
        with pytest.raises(SettingError, match="FASTREDUCE_STORE_ADDR"):
            value("FASTREDUCE_STORE_ADDR", {"FASTREDUCE_STORE_ADDR": text})


# A probe still inside torch's client when the program ends: its client times out (a
# listener whose backlog is full: the connect is never answered) after the rendezvous
# stopped waiting for it. Returning from C++ after the exit handlers (into MPI_Finalize, say,
# which waits for the other ranks) would abort the process: it must be over by then. The
# first exit handler registered runs last: it says whether the probe still runs.
LATE_PROBE = """
import atexit, socket, sys

atexit.register(lambda: print("probe running after the exit handlers:", any(
    t.is_alive() for t in sys.modules["fastreduce.torch.distributed.rendezvous"]._late)))
import fastreduce.torch.distributed.rendezvous as rdv

listener = socket.socket()
listener.bind(("127.0.0.1", 0))
listener.listen(0)
port = listener.getsockname()[1]
fillers = []
for _ in range(4):  # fill the backlog: later connects are not answered
    s = socket.socket()
    s.setblocking(False)
    s.connect_ex(("127.0.0.1", port))
    fillers.append(s)
rdv._ANSWER_S = 0.05  # the rendezvous moves on before the client's own 2 s timeout
print("answer:", rdv._client("127.0.0.1", port, 2, "token"))
print("late probes:", len(rdv._late))
"""


def test_a_late_probe_ends_before_the_program_does():
    import subprocess
    import sys

    pytest.importorskip("fastreduce.torch.distributed.rendezvous")
    proc = subprocess.run([sys.executable, "-c", LATE_PROBE], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "late probes: 1" in proc.stdout, proc.stdout + proc.stderr
    assert "probe running after the exit handlers: False" in proc.stdout, proc.stdout
