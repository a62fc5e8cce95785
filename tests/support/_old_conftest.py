import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

import mpirun  # noqa: E402  (after the path above)


@pytest.fixture(scope="session", autouse=True)
def test_cluster():
    """With FASTREDUCE_TEST_NODES=K, a K-node cluster for the session, removed at its end."""
    nodes = mpirun.test_nodes()
    if not nodes:
        yield None
        return
    cluster = mpirun.cluster_or_skip(nodes, mpirun.TEST_CLUSTER, mpirun.TEST_SUBNET,
                                     os.environ.get("FASTREDUCE_TEST_LINK"))
    with cluster:
        yield cluster


@pytest.fixture
def fake_cuda(monkeypatch):
    """Workers load the fake CUDA runtime (tests/fakecuda), with no GPU setting inherited."""
    import fakecuda

    monkeypatch.setenv("FASTREDUCE_CUDART", fakecuda.library_path())
    for variable in ("FASTREDUCE_CUDA_AWARE", "FASTREDUCE_STAGING_CHUNK_KB",
                     "FASTREDUCE_GPU_PATH", "FASTREDUCE_GPU_THRESHOLDS",
                     "FASTREDUCE_GPU_THRESHOLDS_FILE", "FASTREDUCE_DEVICE_POINTERS"):
        monkeypatch.delenv(variable, raising=False)


def pytest_collection_modifyitems(config, items):
    """Tests marked `long` run only when selected (pytest -m long): CI stays short."""
    if "long" in (config.getoption("-m") or ""):
        return
    skip = pytest.mark.skip(reason="a long run: select it with pytest -m long")
    for item in items:
        if "long" in item.keywords:
            item.add_marker(skip)
