"""The tensors that once gave wrong sums, a hang or a crash, each reduced right or refused:

- torch's lazy views: a conjugate view reduced out of place and in place; negative views
  (x._neg_view(), the imaginary part of a conjugate view) with max and prod, in every form;
- wait_all([r, r]): one request twice (hung on Open MPI);
- a tensor whose storage is swapped (x.set_()) while its request is in flight (SIGSEGV in
  MPI_Waitall): the request keeps the old memory alive and wait() raises;
- refusals by name: tensor subclasses with __torch_dispatch__, sparse, nested, quantized,
  meta, storage-less, byte-swapped; coalesced tensors that share memory.
"""

import numpy as np
import pytest
import torch

import fastreduce

pytestmark = pytest.mark.mpi(ranks=(1, 2, 3))


def equal(got, want) -> bool:
    return torch.equal(got.resolve_conj().resolve_neg(), torch.as_tensor(want, dtype=got.dtype))


def test_lazy_views(checks, comm):
    """Conjugate and negative views reduced out of place, in place, non-blocking,
    coalesced and as out=: the result read through a view is the logical result."""
    p, rank = comm.size, comm.rank
    # the example: logical [1-2j, 3+1j] on every rank
    base = torch.tensor([1 + 2j, 3 - 1j], dtype=torch.complex64)
    want = [p * (1 - 2j), p * (3 + 1j)]
    got = fastreduce.allreduce(base.conj())
    checks.check(not got.is_conj() and equal(got, want), f"conj out of place: {got}")
    x = base.clone().conj()
    fastreduce.allreduce_(x)
    checks.check(x.is_conj() and equal(x, want), f"conj in place: {x} (is_conj {x.is_conj()})")
    checks.check(equal(fastreduce.iallreduce(base.conj()).wait(), want), "conj iallreduce")
    x = base.clone().conj()
    checks.check(fastreduce.iallreduce_(x).wait() is x and equal(x, want),
                 f"conj iallreduce_ {x}")
    # negative views: rank r holds logical [-1 - r, -5 + r]
    logical = torch.tensor([-1.0 - rank, -5.0 + rank])
    neg = (-logical)._neg_view()
    checks.check(neg.is_neg() and torch.equal(neg.resolve_neg(), logical), "test set-up")
    want_max = [-1.0, -5.0 + (p - 1)]
    checks.check(equal(fastreduce.allreduce(neg, "max"), want_max), "neg max out of place")
    x = (-logical)._neg_view()
    fastreduce.allreduce_(x, "max")
    checks.check(equal(x, want_max), f"neg max in place: {x.resolve_neg()}")
    x = torch.tensor([2.0])._neg_view()  # logical -2 on each rank
    fastreduce.allreduce_(x, "prod")
    checks.check(equal(x, [(-2.0) ** p]), f"neg prod in place: {x.resolve_neg()}")
    x = torch.tensor([2.0])._neg_view()
    fastreduce.wait_all([fastreduce.iallreduce_(x, "prod")])
    checks.check(equal(x, [(-2.0) ** p]), f"neg prod iallreduce_: {x.resolve_neg()}")
    # the imaginary part of a conjugate view carries the negative bit
    imag = torch.tensor([1 + 2j], dtype=torch.complex128).conj().imag
    checks.check(imag.is_neg(), "test set-up: .imag of a conj view is a negative view")
    checks.check(equal(fastreduce.allreduce(imag, "min"), [-2.0]), "conj().imag min")
    # coalesced, with a plain tensor between two lazy ones
    a, b, c = base.clone().conj(), torch.ones(3), (-logical)._neg_view()
    fastreduce.allreduce_coalesced_([a, b, c], "sum")
    checks.check(equal(a, want) and equal(b, [p] * 3)
                 and equal(c, [sum(-1.0 - r for r in range(p)),
                               sum(-5.0 + r for r in range(p))]),
                 f"coalesced: {a} {b} {c.resolve_neg()}")
    # out= a lazy view: the result read back through the view is the logical result
    out = torch.empty(2, dtype=torch.complex64).conj()
    fastreduce.allreduce(base, out=out)
    checks.check(out.is_conj() and equal(out, [p * (1 + 2j), p * (3 - 1j)]),
                 f"lazy out: {out}")


def test_wait_all_twice(checks, comm):
    """wait_all([r, r]): one request twice (hung on Open MPI), and repeats among others."""
    p, rank = comm.size, comm.rank
    x = torch.arange(4.0) + rank
    r = fastreduce.iallreduce_(x)
    first, second = fastreduce.wait_all([r, r])
    checks.check(first is x and second is x, "wait_all([r, r]) results")
    checks.check(torch.equal(x, torch.arange(4.0) * p + sum(range(p))),
                 f"wait_all([r, r]): {x}")
    r1, r2 = fastreduce.iallreduce(x), fastreduce.iallreduce(x, "max")
    got = fastreduce.wait_all([r1, r2, r1, r2])
    checks.check(got[0] is got[2] and got[1] is got[3],
                 "wait_all with repeats: results in order")


@pytest.mark.parametrize("engine", [False, True], ids=["mpi", "engine"])
@pytest.mark.parametrize("swap", ["set_", "set_ out="], ids=["in_place", "out"])
def test_storage_swapped(checks, comm, engine, swap):
    """set_() under a request in flight (SIGSEGV in MPI_Waitall): the request keeps the
    old storage alive and wait() raises; on the MPI path and the engine's."""
    fastreduce.backend.engine.set_host(engine)
    try:
        x = torch.ones(1 << 22)  # 16 MiB: its memory is returned to the system when freed
        out = torch.empty_like(x)
        r = fastreduce.iallreduce(x, out=out) if swap == "set_ out=" else \
            fastreduce.iallreduce_(x)
        (out if swap == "set_ out=" else x).set_(torch.zeros(4))
        checks.expect(BufferError, ["memory replaced", "until wait() returns"], r.wait)
        checks.check(r.done, f"{swap}: the request completed")
    finally:
        fastreduce.backend.engine.set_host(None)


def test_storage_kept(checks, comm):
    """The same tensor keeps working when nothing is swapped."""
    x = torch.ones(8)
    r = fastreduce.iallreduce_(x)
    checks.check(torch.equal(r.wait(), torch.full((8,), float(comm.size))),
                 "plain iallreduce_")


@pytest.mark.filterwarnings("ignore")  # torch's beta/deprecation notices: nested, quantized
def test_refusals(checks, comm):
    """Refused by name, leaving the input as it was: shared memory in a coalesced call,
    sparse, nested, quantized, meta, fake, storage-less, byte-swapped, read-only in place."""
    x = torch.ones(4)
    checks.expect(ValueError, ["tensors[0] and tensors[1] share memory"],
                  lambda: fastreduce.allreduce_coalesced_([x, x]), x)
    checks.expect(ValueError, ["share memory"],
                  lambda: fastreduce.allreduce_coalesced_([x[:3], torch.ones(2), x[2:]]), x)
    checks.expect(TypeError, ["layout torch.sparse_coo", "to_dense"],
                  lambda: fastreduce.allreduce(torch.eye(3).to_sparse()))
    checks.expect(TypeError, ["nested tensor", "unbind"],
                  lambda: fastreduce.allreduce(torch.nested.nested_tensor([x, x[:2]])))
    checks.expect(TypeError, ["quantized", "dequantize"], lambda: fastreduce.allreduce_(
        torch.quantize_per_tensor(x, 0.1, 0, torch.qint8)))
    checks.expect(TypeError, ["meta", "no data"],
                  lambda: fastreduce.allreduce(torch.ones(2, device="meta")))
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        fake = torch.ones(2)
    checks.expect(TypeError, ["FakeTensor", "fastreduce.ops"],
                  lambda: fastreduce.allreduce(fake))
    checks.expect(BufferError, ["no memory", "NULL"], lambda: fastreduce.allreduce(
        torch._to_functional_tensor(torch.ones(3))))
    swapped = np.ones(3, dtype=">f4") if np.little_endian else np.ones(3, dtype="<f4")
    checks.expect(BufferError, ["byte order", "newbyteorder"],
                  lambda: fastreduce.allreduce(swapped), swapped)
    read_only = np.arange(3.0)
    read_only.setflags(write=False)
    checks.expect(BufferError, ["read-only"], lambda: fastreduce.allreduce_(read_only),
                  read_only)
    checks.check(np.array_equal(fastreduce.allreduce(read_only), np.arange(3.0) * comm.size),
                 "a read-only array reduced out of place")
