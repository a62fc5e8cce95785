"""The torch.distributed backend: every operation against a reference and gloo, groups,
DDP/FSDP2/ZeRO/checkpoint training equal to gloo, the tutorials' programs."""

import pytest
from mpirun import run_workers


@pytest.mark.parametrize("nprocs", [1, 2, 3, 4])
def test_every_operation(nprocs):
    out = run_workers("torch_backend.py", nprocs)
    assert f"on {nprocs} ranks, 0 failed" in out


def test_every_operation_without_the_engine(monkeypatch):
    """Non-blocking operations run at once when the progress engine is off: same answers."""
    monkeypatch.setenv("FASTREDUCE_ENGINE", "0")
    out = run_workers("torch_backend.py", 3)
    assert "on 3 ranks, 0 failed" in out


def test_every_operation_through_the_engine(monkeypatch):
    """Every non-blocking operation, however small, on the progress engine."""
    monkeypatch.setenv("FASTREDUCE_ENGINE_HOST_BYTES", "0")
    out = run_workers("torch_backend.py", 3)
    assert "on 3 ranks, 0 failed" in out


@pytest.mark.parametrize("nprocs", [1, 2, 3, 4])
def test_training_equals_gloo(nprocs, tmp_path):
    """DDP (plain, find_unused_parameters, no_sync, comm hook), ZeRO, FSDP2 and a
    distributed checkpoint give gloo's models."""
    out = run_workers("torch_training.py", nprocs, str(tmp_path / "checkpoint"))
    assert f"on {nprocs} ranks, 0 failed" in out


def test_tutorial_programs():
    """The introductory tutorial's programs (2 processes, as written there), env://
    rendezvous with rank= and world_size=, the backend name changed."""
    out = run_workers("torch_tutorial.py", 2)
    assert "on 2 ranks, 0 failed" in out


def test_functional_collectives():
    """torch's functional collectives run on the backend, eager and compiled."""
    out = run_workers("functional_collectives.py", 2)
    assert "on 2 ranks, 0 failed" in out


def test_torch_older_than_2_13_is_refused_by_name():
    """On torch older than 2.13 importing the backend raises ImportError naming the torch it
    needs (instead of hanging in sub-groups later); on 2.13 and newer it imports."""
    import torch

    from fastreduce.ops import _release

    if _release(torch.__version__) >= (2, 13):
        import fastreduce.distributed

        assert fastreduce.distributed.BACKEND == "fastreduce"
    else:
        with pytest.raises(ImportError, match=r"needs torch 2\.13 or newer .*torch>=2\.13"):
            import fastreduce.distributed  # noqa: F401


@pytest.mark.parametrize("nprocs", [2, 3])
def test_rendezvous_without_a_resolvable_hostname(nprocs):
    """Rank 0's hostname resolves nowhere: the ranks reach its store at an interface address
    (or loopback); FASTREDUCE_STORE_ADDR=ADDR:PORT puts the store there."""
    out = run_workers("torch_rendezvous.py", nprocs, "reachable")
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
