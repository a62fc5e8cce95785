"""The torch.distributed backend refuses, by name, a torch too old for it."""

import pytest


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
