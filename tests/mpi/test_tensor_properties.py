"""A property-based differential test: random tensors drawn over what torch and numpy can
give a tensor (lazy conjugate and negative views, storage offsets, 0-d, empty, zero and
overlapping and negative strides, subclasses, parameters, inference tensors, sparse,
nested, quantized, meta, fake and functional tensors, read-only and byte-swapped arrays)
x dtypes x ops x forms (every entry point: blocking, out=, non-blocking, wait_all with a
request twice, coalesced, a storage swapped under a request, the torch.distributed
backend, the layers, the custom ops) x communicators (world, a split, a Cartesian
sub-communicator).

Each case either reduces right, checked against numpy's reduction of every rank's
*logical* input (rebuilt from per-rank seeds, never from fastreduce), or is refused with
the exception its property calls for, leaving every input as it was. Seeded and
reproducible: a failure names its case and seed; FASTREDUCE_TEST_FORMS (comma-separated)
draws only those forms, to reproduce a failing case faster; the long run (marker `long`)
takes its seed from FASTREDUCE_TEST_SEED.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
import torch.distributed as dist
from reference import matches, ops_for, reduce, values

import fastreduce
import fastreduce.distributed  # noqa: F401  (registers the backend "fastreduce")
import fastreduce.ops

pytestmark = pytest.mark.one_mpi  # Python above the core: one MPI family's pass

DTYPES = ["float64", "float32", "float16", "bfloat16", "complex64", "complex128", "int8",
          "int16", "int32", "int64", "uint8", "bool"]
TORCH_DTYPE = {"bfloat16": torch.bfloat16, "bool": torch.bool}
SIGNED = {"float64", "float32", "float16", "bfloat16", "complex64", "complex128", "int8",
          "int16", "int32", "int64"}

REFUSED_TYPE = (TypeError,)
REFUSED_LAYOUT = (BufferError,)


class Plain(torch.Tensor):
    """A Python subclass without __torch_dispatch__: its memory holds its values."""


# property -> (library, dtypes it applies to or None for all, what fastreduce must do)
# "ok": reduced like a plain tensor; an exception tuple: refused with it.
PROPERTIES = {
    "plain": ("torch", None, "ok"),
    "conj": ("torch", {"complex64", "complex128"}, "ok"),
    "neg": ("torch", SIGNED - {"bfloat16"}, "ok"),
    "conj+neg": ("torch", {"complex64", "complex128"}, "ok"),
    "storage offset": ("torch", None, "ok"),
    "0-d": ("torch", None, "ok"),
    "empty": ("torch", None, "ok"),
    "parameter": ("torch", None, "ok"),
    "requires grad": ("torch", {"float64", "float32", "complex64"}, "ok"),
    "inference": ("torch", None, "ok"),
    "subclass": ("torch", None, "ok"),
    "expanded (zero stride)": ("torch", None, REFUSED_LAYOUT),
    "overlapping (as_strided)": ("torch", None, REFUSED_LAYOUT),
    "transposed": ("torch", None, REFUSED_LAYOUT),
    "sparse": ("torch", {"float32", "float64", "int64"}, REFUSED_TYPE),
    "nested": ("torch", {"float32"}, REFUSED_TYPE),
    "jagged nested": ("torch", {"float32"}, REFUSED_TYPE),
    "quantized": ("torch", {"float32"}, REFUSED_TYPE),
    "meta": ("torch", None, REFUSED_TYPE),
    "fake": ("torch", {"float32", "int64"}, REFUSED_TYPE),
    "functional": ("torch", {"float32", "int64"}, REFUSED_LAYOUT),
    "numpy plain": ("numpy", None, "ok"),
    "numpy offset": ("numpy", None, "ok"),
    "numpy read-only": ("numpy", None, "ok"),  # refused only where written
    "numpy byte-swapped": ("numpy", {"float64", "float32", "int16", "int32", "int64",
                                     "complex64"}, REFUSED_LAYOUT),
    "numpy negative stride": ("numpy", None, REFUSED_LAYOUT),
}
FORMS = ["allreduce_", "allreduce", "allreduce out=", "allreduce lazy out=", "iallreduce_",
         "iallreduce", "iallreduce out=", "wait_all twice", "coalesced", "storage swapped",
         "backend all_reduce", "layer all_reduce", "op allreduce", "op allreduce_"]
IN_PLACE = {"allreduce_", "iallreduce_", "wait_all twice", "coalesced", "storage swapped",
            "backend all_reduce", "op allreduce_"}
TORCH_ONLY = {"allreduce lazy out=", "storage swapped", "backend all_reduce",
              "layer all_reduce", "op allreduce", "op allreduce_"}
BACKEND_OPS = {"sum": dist.ReduceOp.SUM, "prod": dist.ReduceOp.PRODUCT,
               "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX, "avg": dist.ReduceOp.AVG,
               "band": dist.ReduceOp.BAND, "bor": dist.ReduceOp.BOR,
               "bxor": dist.ReduceOp.BXOR}


def torch_dtype(dtype: str):
    return TORCH_DTYPE.get(dtype) or getattr(torch, dtype)


def as_torch(logical: np.ndarray, dtype: str) -> torch.Tensor:
    return torch.from_numpy(np.array(logical, order="C")).to(torch_dtype(dtype))


def logical_of(prop: str, generated: np.ndarray) -> np.ndarray:
    """The logical value of the tensor make(prop, generated) builds."""
    flat = generated.reshape(-1)
    if prop == "expanded (zero stride)":
        return np.repeat(flat[:1], 3)
    if prop == "overlapping (as_strided)":
        return np.array([[flat[0], flat[1]], [flat[1], flat[2]]])
    return generated


def rounded(logical: np.ndarray, dtype: str) -> np.ndarray:
    """The logical values as the dtype holds them (float64 for the 16-bit floats)."""
    if dtype == "bfloat16":
        return as_torch(logical, dtype).to(torch.float64).numpy()
    return np.asarray(logical).astype(dtype)


def make(prop: str, logical: np.ndarray, dtype: str):
    """A tensor (or array) whose logical value is `logical`, with the property `prop`."""
    if prop in ("plain", "0-d", "empty"):
        return as_torch(logical, dtype)
    if prop == "conj":
        return as_torch(np.conj(logical), dtype).conj()
    if prop == "neg":
        return as_torch(-logical, dtype)._neg_view()
    if prop == "conj+neg":
        return as_torch(-np.conj(logical), dtype).conj()._neg_view()
    if prop == "storage offset":
        base = torch.zeros(logical.size + 3, dtype=torch_dtype(dtype))
        base[3:] = as_torch(logical, dtype).reshape(-1)
        return base[3:].view(logical.shape)
    if prop == "parameter":
        return torch.nn.Parameter(as_torch(logical, dtype), requires_grad=False)
    if prop == "requires grad":
        return as_torch(logical, dtype).requires_grad_()
    if prop == "inference":
        with torch.inference_mode():
            return as_torch(logical, dtype)
    if prop == "subclass":
        return as_torch(logical, dtype).as_subclass(Plain)
    if prop == "expanded (zero stride)":
        return as_torch(logical.reshape(-1)[:1], dtype).expand(3)
    if prop == "overlapping (as_strided)":
        return as_torch(logical.reshape(-1)[:3], dtype).as_strided((2, 2), (1, 1))
    if prop == "transposed":
        return as_torch(logical.reshape(2, 3).T.copy(), dtype).t()
    if prop == "sparse":
        return as_torch(logical, dtype).to_sparse()
    if prop == "nested":
        return torch.nested.nested_tensor([as_torch(logical, dtype), as_torch(logical, dtype)])
    if prop == "jagged nested":
        t = as_torch(logical, dtype)
        return torch.nested.nested_tensor([t, t[:1]], layout=torch.jagged)
    if prop == "quantized":
        return torch.quantize_per_tensor(as_torch(logical, dtype), 0.1, 0, torch.qint8)
    if prop == "meta":
        return torch.empty(logical.shape, dtype=torch_dtype(dtype), device="meta")
    if prop == "fake":
        from torch._subclasses.fake_tensor import FakeTensorMode

        with FakeTensorMode():
            return torch.empty(logical.shape, dtype=torch_dtype(dtype))
    if prop == "functional":
        return torch._to_functional_tensor(as_torch(logical, dtype))
    array = np.asarray(logical).astype(dtype)
    if prop == "numpy plain":
        return array
    if prop == "numpy offset":
        base = np.zeros(array.size + 2, dtype=dtype)
        base[2:] = array.reshape(-1)
        return base[2:].reshape(array.shape)
    if prop == "numpy read-only":
        array.setflags(write=False)
        return array
    if prop == "numpy byte-swapped":
        return array.astype(array.dtype.newbyteorder("S"))
    if prop == "numpy negative stride":
        return np.ascontiguousarray(array.reshape(-1)[::-1])[::-1]
    raise AssertionError(prop)


def shape_for(prop: str, rng: np.random.Generator) -> tuple:
    if prop == "0-d":
        return ()
    if prop == "empty":
        return (int(rng.integers(0, 3)), 0)
    if prop in ("expanded (zero stride)", "overlapping (as_strided)"):
        return (4,)
    if prop == "transposed":
        return (2, 3)
    if prop in ("nested", "jagged nested", "numpy negative stride"):
        return (int(rng.integers(2, 6)),)
    if prop == "sparse":
        return (int(rng.integers(1, 4)), 3)
    return tuple(int(n) for n in rng.integers(1, 6, int(rng.integers(1, 3))))


def logical_values(t) -> np.ndarray:
    """What a tensor's values are now, as numpy sees them (torch applies lazy bits)."""
    if isinstance(t, np.ndarray):
        return np.array(t)
    if t.is_meta or t.is_quantized or t.is_nested or type(t).__name__ == "FakeTensor":
        return np.zeros(0)  # no values to compare
    if t.layout != torch.strided:
        t = t.to_dense()
    t = torch._from_functional_tensor(t) if torch._is_functional_tensor(t) else t
    t = t.detach().resolve_conj().resolve_neg()
    return (t.to(torch.float64) if t.dtype == torch.bfloat16 else t).numpy().copy()


def memory(t):
    """The raw memory of a dense tensor (to see that a refusal wrote nothing)."""
    if isinstance(t, torch.Tensor) and t.layout == torch.strided and not t.is_meta \
            and not t.is_quantized and not t.is_nested and type(t).__name__ != "FakeTensor" \
            and not torch._is_functional_tensor(t):
        return torch.tensor([], dtype=torch.uint8).set_(t.untyped_storage()).numpy().copy()
    return np.zeros(0)


def run(form: str, x, op: str, comm, others: list, ctx: Differential) -> object:
    """One call of `form` on x; returns the tensor that holds the result."""
    if form == "allreduce_":
        return fastreduce.allreduce_(x, op, comm=comm)
    if form == "allreduce":
        return fastreduce.allreduce(x, op, comm=comm)
    if form in ("allreduce out=", "iallreduce out="):
        out = np.empty_like(x) if isinstance(x, np.ndarray) else torch.empty_like(x)
        if form == "iallreduce out=":
            return fastreduce.iallreduce(x, op, comm=comm, out=out).wait()
        return fastreduce.allreduce(x, op, comm=comm, out=out)
    if form == "allreduce lazy out=":
        out = torch.empty_like(x)
        out = out.conj() if out.is_complex() else out._neg_view()
        fastreduce.allreduce(x, op, comm=comm, out=out)
        return out
    if form == "iallreduce_":
        return fastreduce.iallreduce_(x, op, comm=comm).wait()
    if form == "iallreduce":
        return fastreduce.iallreduce(x, op, comm=comm).wait()
    if form == "wait_all twice":
        request = fastreduce.iallreduce_(x, op, comm=comm)
        first, second = fastreduce.wait_all([request, request])
        ctx.checks.check(first is second,
                         f"wait_all gave two results for one request: {form}")
        return first
    if form == "coalesced":
        fastreduce.allreduce_coalesced_([others[0], x, *others[1:]], op, comm=comm)
        return x
    if form == "storage swapped":
        request = fastreduce.iallreduce_(x, op, comm=comm)
        x.set_(torch.zeros_like(x))
        request.wait()  # must raise: the memory MPI wrote is no longer x's
        raise AssertionError("wait() did not notice the storage swap")
    group = None if comm is None else ctx.groups.get(id(comm))
    if comm is not None and group is None:
        group = ctx.groups[id(comm)] = fastreduce.distributed.process_group(comm)
    if form == "backend all_reduce":
        dist.all_reduce(x, BACKEND_OPS[op], group=group)
        return x
    if form == "layer all_reduce":
        return fastreduce.all_reduce(x, comm=comm, op=op)
    if form == "op allreduce":
        return fastreduce.ops.allreduce(x, op, comm=comm)
    if form == "op allreduce_":
        return fastreduce.ops.allreduce_(x, op, comm=comm)
    raise AssertionError(form)


def expected_outcome(prop: str, form: str, dtype: str, op: str, n: int):
    """'ok', "torch's" (torch's fake kernel ran), 'identity' (x itself returned), or the
    exception types the call must raise."""
    outcome = PROPERTIES[prop][2]
    if form == "layer all_reduce" and n == 1:
        return "identity"  # a group of one worker: x itself, no reduction
    if form == "backend all_reduce" and op == "prod" and dtype.startswith("complex"):
        return (ValueError,)  # torch.distributed refuses PRODUCT on complex itself
    if form == "backend all_reduce" and prop in ("conj", "conj+neg"):
        return (RuntimeError,)  # torch.distributed's view_as_real refuses them itself
    if form == "op allreduce_" and prop == "functional":
        return (RuntimeError,)  # torch cannot functionalize a custom in-place op
    if form == "storage swapped":
        return (BufferError,) if outcome == "ok" else outcome
    if prop == "numpy read-only" and form in IN_PLACE:
        return (BufferError,)
    if form in ("layer all_reduce", "op allreduce") and outcome == REFUSED_LAYOUT \
            and prop != "functional":
        return "ok"  # the layers and the out-of-place op make x contiguous themselves
    if form == "backend all_reduce" and outcome != "ok":
        return (TypeError, ValueError, BufferError)  # the backend's own checks come first
    if form in ("op allreduce", "op allreduce_") and prop in ("meta", "fake"):
        return "torch's"  # torch runs the op's fake kernel: a result without data
    if form in ("op allreduce", "op allreduce_") and prop == "functional":
        return "ok"  # torch unwraps a functional tensor for a custom op
    return outcome


def applicable(prop: str, form: str, dtype: str, op: str) -> bool:
    library, dtypes, _ = PROPERTIES[prop]
    if dtypes is not None and dtype not in dtypes:
        return False
    if library == "numpy" and (form in TORCH_ONLY or dtype == "bfloat16"):
        return False
    if form == "storage swapped" and prop not in ("plain", "parameter", "storage offset"):
        return False  # lazy views are reduced in a copy; set_ needs a plain storage
    if prop == "requires grad" and form in IN_PLACE and form not in (
            "allreduce_", "iallreduce_", "coalesced", "wait_all twice"):
        return False  # torch itself refuses in-place ops on such a leaf (backend, ops)
    if form == "allreduce lazy out=" and (dtype not in SIGNED - {"bfloat16"} or prop not in (
            "plain", "conj", "neg", "conj+neg", "storage offset", "0-d", "empty", "parameter",
            "inference", "subclass", "numpy plain")):
        return False
    if form == "layer all_reduce" and op not in ("sum", "avg"):
        return False  # the tensor-parallel AllReduce layer's ops
    return True


def run_case(k: int, rng: np.random.Generator, ctx: Differential) -> None:
    f, world, rank = ctx.checks, ctx.world, ctx.world.rank
    while True:
        prop = str(rng.choice(list(PROPERTIES)))
        form = str(rng.choice(ctx.forms))
        dtype = str(rng.choice(DTYPES))
        op = str(rng.choice(ops_for(dtype)))
        if applicable(prop, form, dtype, op):
            break
    comm_name = str(rng.choice(list(ctx.comms)))
    comm = ctx.comms[comm_name]
    n = world.size if comm is None else comm.Get_size()
    shape = shape_for(prop, rng)
    case_seed = int(rng.integers(0, 2**31))
    label = (f"case {k} (seed {ctx.seed}): {form} {op} {dtype} {shape} {prop} over {comm_name} "
             f"of {n}")
    members = list(range(world.size)) if comm is None else \
        comm.allgather(rank)  # world ranks of comm's members, in comm's order
    generated = np.asarray(values(dtype, op, shape, rank, case_seed, integral=True))
    x = make(prop, generated, dtype)
    others = []
    if form == "coalesced":  # plain companions of other dtypes, reduced in the same call
        for j, other_dtype in enumerate(rng.choice(["float32", "int64", dtype], 2)):
            other_dtype = str(other_dtype)
            if op not in ops_for(other_dtype):
                other_dtype = dtype
            o = np.asarray(values(other_dtype, op, (3,), rank, (case_seed, j), integral=True))
            others.append((other_dtype, o, as_torch(o, other_dtype)
                           if isinstance(x, torch.Tensor) else o.astype(other_dtype)))
    before = logical_values(x)
    raw = memory(x)
    companions = [t for _, _, t in others]
    companions_before = [logical_values(t) for t in companions]
    expected = expected_outcome(prop, form, dtype, op, n)
    try:
        got = run(form, x, op, comm, companions, ctx)
    except Exception as exc:  # noqa: BLE001
        if not isinstance(expected, tuple):
            f.check(False, f"{label}: raised {type(exc).__name__}: {exc}")
            return
        f.check(isinstance(exc, expected), f"{label}: raised {type(exc).__name__}: {exc}; "
                f"expected {[e.__name__ for e in expected]}")
        f.check("fastreduce" in str(exc) or form == "backend all_reduce"
                or isinstance(exc, RuntimeError) and "functionaliz" in str(exc)
                or isinstance(exc, RuntimeError) and "resolve_conj" in str(exc),
                f"{label}: the error does not say it is fastreduce's: {exc}")
        if form != "storage swapped":  # (that one refuses after MPI wrote the old memory)
            f.check(np.array_equal(logical_values(x), before, equal_nan=True)
                    and np.array_equal(memory(x), raw, equal_nan=True),
                    f"{label}: a refused call changed its input")
            f.check(all(np.array_equal(logical_values(t), b) for t, b in
                        zip(companions, companions_before, strict=True)),
                    f"{label}: a refused call changed another tensor")
        return
    if expected == "identity":
        f.check(got is x, f"{label}: a group of one did not return x itself")
        return
    if expected == "torch's":
        f.check(got.device == x.device and type(got) is type(x) and got.shape == x.shape,
                f"{label}: torch's fake kernel gave {type(got).__name__} {got.shape}")
        return
    if expected != "ok":
        f.check(False, f"{label}: expected {[e.__name__ for e in expected]}, nothing raised")
        return
    everyone = np.stack([rounded(logical_of(prop, np.asarray(values(
        dtype, op, shape, r, case_seed, integral=True))), dtype) for r in members])
    want = reduce(everyone, op, n)
    result = logical_values(got)
    check_close(f, result, want, dtype, op, everyone, n, label)
    if form not in IN_PLACE:
        f.check(np.array_equal(logical_values(x), before, equal_nan=True),
                f"{label}: the input changed")
    for j, (other_dtype, _, t) in enumerate(others):
        stack = np.stack([rounded(values(other_dtype, op, (3,), r, (case_seed, j),
                                         integral=True), other_dtype) for r in members])
        check_close(f, logical_values(t), reduce(stack, op, n), other_dtype, op, stack, n,
                    f"{label}: companion {j}")


def check_close(f, result, want, dtype, op, stack, n, label) -> None:
    f.check(matches(result, want, dtype, op, stack, n),
            f"{label}: got {np.ravel(result)[:4]} want {want.ravel()[:4]}")


@dataclass
class Differential:
    """What a run of cases shares: its checks, seed, forms, communicators and groups."""

    checks: object
    seed: int
    world: object
    comms: dict
    groups: dict = field(default_factory=dict)  # torch process groups, made at first use
    forms: list = field(default_factory=lambda: list(FORMS))  # the forms drawn from


@pytest.fixture(scope="module")
def communicators(comm):
    """The communicators cases draw from: the world, a split and a Cartesian sub (its
    partition kept alive meanwhile: freeing a partition frees its subs)."""
    p, rank = comm.size, comm.rank
    partition = fastreduce.Partition().create_cartesian_topology_partition([p, 1])
    yield {"world": None, "split": comm.Split(rank % 2, rank),
            "cartesian sub": partition.sub([0])}


def differential(checks, comm, communicators, seed: int, cases: int) -> None:
    """`cases` random cases from `seed`, the same choices on every rank."""
    ctx = Differential(checks, seed, comm, communicators)
    only = os.environ.get("FASTREDUCE_TEST_FORMS")
    if only:
        ctx.forms = only.split(",")
    rng = np.random.default_rng(seed)  # the same choices on every rank
    for k in range(cases):
        checks.run(f"case {k}", run_case, k, rng, ctx)
    fastreduce.wait_all([])


@pytest.mark.filterwarnings("ignore")  # torch's beta/prototype notices for sparse and nested
@pytest.mark.parametrize("seed", [
    pytest.param(2026, marks=pytest.mark.mpi(ranks=2), id="2-2026"),
    pytest.param(7, marks=[pytest.mark.mpi(ranks=3), pytest.mark.across_nodes], id="3-7"),
])
def test_tensor_properties_differential(checks, comm, process_group, communicators, seed):
    """300 random cases over tensor properties x dtypes x ops x entry points x
    communicators against numpy's reduction of every rank's logical input (rerun one
    with: mpiexec -n 3 python -m pytest tests/mpi/test_tensor_properties.py -k 3-7)."""
    differential(checks, comm, communicators, seed, 300)


@pytest.mark.long
@pytest.mark.timeout(1200)
@pytest.mark.mpi(ranks=(2, 3, 4))
@pytest.mark.filterwarnings("ignore")
def test_tensor_properties_long(checks, comm, process_group, communicators):
    """The long run (marker `long`): 3000 cases per rank count, the seed from
    FASTREDUCE_TEST_SEED (default 1)."""
    seed = int(os.environ.get("FASTREDUCE_TEST_SEED", "1"))
    differential(checks, comm, communicators, seed, 3000)
