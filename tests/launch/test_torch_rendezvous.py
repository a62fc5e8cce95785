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
