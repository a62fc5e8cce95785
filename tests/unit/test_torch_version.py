"""The torch.distributed backend refuses, by name, a torch older than it runs on."""

import pytest

from fastreduce.torch.versions import _release, _torch_refusal, _work_needs_cpp_wrapper


@pytest.mark.parametrize("release", [(2, 4), (2, 6), (2, 12), (2, 13), (2, 15), (3, 0)])
def test_releases_from_the_floor_are_accepted(release):
    assert _torch_refusal(release) is None


@pytest.mark.parametrize("release", [(2, 3), (1, 13)])
def test_older_releases_are_refused_naming_the_fix(release):
    assert "pip install 'torch>=2.4'" in _torch_refusal(release)


@pytest.mark.parametrize(("version", "release"), [("2.13.0+cpu", (2, 13)),
                                                  ("2.4.0", (2, 4)), ("2.10.0a0+git1", (2, 10))])
def test_release_of_a_version_string(version, release):
    assert _release(version) == release


@pytest.mark.parametrize(("release", "wrapped"), [((2, 4), True), ((2, 12), True),
                                                  ((2, 13), False), ((2, 15), False)])
def test_collective_work_reaches_old_torch_as_cpp_work(release, wrapped):
    assert _work_needs_cpp_wrapper(release) is wrapped


def test_the_installed_torch_imports():
    """Every torch the suite runs on (2.4, 2.13, 2.15) is one the backend accepts."""
    import torch

    import fastreduce.distributed

    assert _torch_refusal(_release(torch.__version__)) is None
    assert fastreduce.distributed.BACKEND == "fastreduce"
