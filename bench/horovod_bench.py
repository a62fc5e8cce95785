"""fastreduce.horovod (Horovod's torch API) against fastreduce's own calls, in one MPI job.

    mpiexec -n 2 python bench/horovod_bench.py [--repeat 5] [--json FILE] [--markdown FILE]
    python bench/horovod_bench.py --cluster [--mpis openmpi,mpich] [--link 1gbit]   # root

Every variant runs in the same job, alternated, and every ratio is the median of the
ratios within each run:

  step      one SGD step of the 10M-parameter MLP of bench/gradsync_bench.py (100 tensors):
            no communication; fastreduce.GradientSync (float32, and compression="fp16");
            hvd.DistributedOptimizer, with Compression.none and Compression.fp16
  small     a float32 all-reduce of 4 B to 1 KiB: hvd.allreduce (Average) against
            fastreduce.allreduce(t, "avg") on the same tensor, and the in-place pair
            hvd.allreduce_ / fastreduce.allreduce_
  --network the training step only, for jobs across nodes: the variants above, and
            torch DDP on gloo (float32, and with an fp16 compression hook)
  --cluster (root) brings up 2 nodes of a fastreduce.cluster cluster on this machine
            ("frv", a 1 Gbit/s link) and runs --network there, 1 rank per node, per MPI

Rank 0 prints markdown tables headed by the machine, MPI, link and date.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from mpi4py import MPI

import fastreduce
import fastreduce.distributed  # noqa: F401  (registers the torch.distributed backend)
import fastreduce.horovod as hvd
from fastreduce._abi import first_line

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from gradsync_bench import cast_hook, make_mlp, sample_steps, sgd_steps, timed  # noqa: E402

SMALL_BYTES = [4 << k for k in range(9)]  # 4 B .. 1 KiB


def machine() -> str:
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{platform.machine()}, {os.cpu_count()} cores{', ' + model if model else ''}"


half_hook = cast_hook(torch.float16)


def step_variants(args, comm, network: bool) -> dict:
    """Name -> a function doing one training step, every model starting equal."""
    models = {"no communication": make_mlp(args.width, args.depth),
              "GradientSync": make_mlp(args.width, args.depth),
              "GradientSync fp16": make_mlp(args.width, args.depth),
              "hvd.DistributedOptimizer": make_mlp(args.width, args.depth),
              "hvd.DistributedOptimizer fp16": make_mlp(args.width, args.depth)}
    if network:
        gloo = dist.new_group(backend="gloo")
        models["DDP gloo"] = torch.nn.parallel.DistributedDataParallel(
            make_mlp(args.width, args.depth), process_group=gloo)
        models["DDP gloo fp16 hook"] = torch.nn.parallel.DistributedDataParallel(
            make_mlp(args.width, args.depth), process_group=gloo)
        models["DDP gloo fp16 hook"].register_comm_hook(gloo, half_hook)
    syncs = {"GradientSync": fastreduce.GradientSync(models["GradientSync"]),
             "GradientSync fp16": fastreduce.GradientSync(models["GradientSync fp16"],
                                                          compression="fp16")}
    x = torch.randn(args.batch, args.width, generator=torch.Generator().manual_seed(comm.rank))

    def prepare(name, model, opt):
        if name in syncs:
            return syncs[name].attach(opt)
        if not name.startswith("hvd."):
            return None
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        compression = hvd.Compression.fp16 if name.endswith("fp16") else hvd.Compression.none
        return hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                        compression=compression)

    return sgd_steps(models, x, prepare)


def ratio(samples: dict, a: str, b: str) -> float:
    return statistics.median(x / y for x, y in zip(samples[a], samples[b], strict=True))


def measure_steps(args, comm, network: bool) -> dict:
    samples = sample_steps(comm, step_variants(args, comm, network), args.repeat, args.steps)
    pairs = [("hvd.DistributedOptimizer", "GradientSync"),
             ("hvd.DistributedOptimizer fp16", "GradientSync fp16"),
             ("hvd.DistributedOptimizer", "no communication"),
             ("GradientSync", "no communication")]
    if network:
        pairs = [("hvd.DistributedOptimizer", "DDP gloo"),
                 ("hvd.DistributedOptimizer fp16", "DDP gloo"),
                 ("hvd.DistributedOptimizer fp16", "DDP gloo fp16 hook"),
                 ("hvd.DistributedOptimizer", "GradientSync"),
                 ("hvd.DistributedOptimizer fp16", "GradientSync fp16")]
    return {"ms": {k: statistics.median(v) * 1e3 for k, v in samples.items()},
            "ratios": {f"{a} / {b}": ratio(samples, a, b) for a, b in pairs},
            "parameters": sum(p.numel() for p in make_mlp(args.width, args.depth).parameters())}


def calls_per_sample(comm, fn, seconds: float) -> int:
    """How many calls of `fn` take about `seconds` (rank 0's estimate, the same on all)."""
    start = time.perf_counter()
    for _ in range(20):
        fn()
    per_call = (time.perf_counter() - start) / 20
    return comm.bcast(max(20, min(20000, int(seconds / max(per_call, 1e-7)))))


def measure_small(args, comm) -> list[dict]:
    rows = []
    for nbytes in SMALL_BYTES:
        t = torch.full((nbytes // 4,), float(comm.rank))
        fns = {"hvd.allreduce": lambda t=t: hvd.allreduce(t),
               "fastreduce.allreduce": lambda t=t: fastreduce.allreduce(t, "avg"),
               "hvd.allreduce_": lambda t=t: hvd.allreduce_(t),
               "fastreduce.allreduce_": lambda t=t: fastreduce.allreduce_(t, "avg")}
        iters = calls_per_sample(comm, fns["hvd.allreduce"], args.small_seconds)
        samples = {name: [] for name in fns}
        for _ in range(args.repeat):
            for name, fn in fns.items():
                samples[name].append(timed(comm, fn, iters))
        rows.append({"bytes": nbytes, "calls": iters,
                     **{f"{k} us": statistics.median(v) * 1e6 for k, v in samples.items()},
                     "out of place ratio": ratio(samples, "hvd.allreduce",
                                                 "fastreduce.allreduce"),
                     "in place ratio": ratio(samples, "hvd.allreduce_",
                                             "fastreduce.allreduce_")})
    return rows


def markdown(results: dict) -> str:
    lines = [f"- machine: {results['machine']}",
             f"- MPI: {results['mpi']}",
             f"- link: {results['link']}",
             f"- date: {results['date']}",
             f"- {results['ranks']} ranks, fastreduce {results['fastreduce']}, torch "
             f"{results['torch']}, median of {results['repeat']} runs"
             f"{', HOROVOD_FUSION_THRESHOLD=' + results['fusion'] if results['fusion'] else ''}",
             ""]
    step = results["step"]
    base = step["ms"]["no communication"]
    lines += [f"Training step, MLP of {step['parameters']} parameters, batch "
              f"{results['batch']}:", "",
              "| variant | ms per step | / no communication |", "|---|---|---|"]
    lines += [f"| {k} | {v:.1f} | {v / base:.2f} |" for k, v in step["ms"].items()]
    lines += ["", "| ratio (median of per-run ratios) | |", "|---|---|"]
    lines += [f"| {k} | {v:.2f} |" for k, v in step["ratios"].items()]
    if results.get("small"):
        lines += ["", "Small all-reduce, float32, average (us per call):", "",
                  "| bytes | hvd.allreduce | fastreduce.allreduce | ratio | hvd.allreduce_ | "
                  "fastreduce.allreduce_ | ratio |", "|---|---|---|---|---|---|---|"]
        for r in results["small"]:
            lines.append(f"| {r['bytes']} | {r['hvd.allreduce us']:.1f} | "
                         f"{r['fastreduce.allreduce us']:.1f} | {r['out of place ratio']:.2f} | "
                         f"{r['hvd.allreduce_ us']:.1f} | {r['fastreduce.allreduce_ us']:.1f} | "
                         f"{r['in place ratio']:.2f} |")
    return "\n".join(lines)


def job(args) -> int:
    torch.set_num_threads(1)  # one core per rank
    hvd.init()
    comm = fastreduce.default_comm()
    if args.network:
        dist.init_process_group("fastreduce")  # for DDP's gloo group; rendezvous from MPI
    mpi = " ".join(first_line(MPI.Get_library_version()).split(",")[0].split())
    results = {"ranks": comm.size, "mpi": mpi,
               "machine": machine(), "link": args.link_label,
               "date": datetime.date.today().isoformat(), "fastreduce": fastreduce.__version__,
               "torch": torch.__version__, "repeat": args.repeat, "batch": args.batch,
               "fusion": os.environ.get("HOROVOD_FUSION_THRESHOLD", "")}
    results["step"] = measure_steps(args, comm, args.network)
    if args.network:
        dist.destroy_process_group()
    else:
        results["small"] = measure_small(args, comm)
    if comm.rank == 0:
        table = markdown(results)
        print(table, flush=True)
        if args.markdown:
            Path(args.markdown).write_text(table + "\n")
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


def cluster(args) -> int:
    """--cluster: 2 nodes with a shaped link, --network on 1 rank per node, per MPI."""
    from network_bench import RESULTS, run

    from fastreduce.cluster import Cluster, remove

    RESULTS.mkdir(parents=True, exist_ok=True)
    remove("frv")
    nodes = Cluster.up(2, link=None if args.link == "unshaped" else args.link, name="frv",
                       subnet="10.77.98.0/24")
    try:
        for mpi in args.mpis.split(","):
            label = f"horovod-{mpi}-2x1-{args.link}"
            run(nodes, mpi, 2, 1,
                [str(Path(__file__).resolve()), "--network", "--repeat", str(args.repeat),
                 "--steps", str(args.steps), "--link-label",
                 f"2 nodes x 1 rank, {args.link} (tbf), TCP",
                 "--markdown", str(RESULTS / f"network-{label}.md"),
                 "--json", str(RESULTS / f"network-{label}.json")],
                {}, label, args.timeout)
    finally:
        nodes.down()
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per run")
    parser.add_argument("--width", type=int, default=448)
    parser.add_argument("--depth", type=int, default=50, help="Linear layers (2 tensors each)")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--small-seconds", type=float, default=0.05,
                        help="about how long each small all-reduce sample runs")
    parser.add_argument("--network", action="store_true",
                        help="training steps only, with DDP on gloo: for jobs across nodes")
    parser.add_argument("--link-label", default="one host (shared memory)",
                        help="what joins the ranks, for the table's header")
    parser.add_argument("--json")
    parser.add_argument("--markdown", help="also write the tables to this file")
    parser.add_argument("--cluster", action="store_true",
                        help="(root, not under mpiexec) run --network on a 2-node cluster")
    parser.add_argument("--mpis", default="openmpi,mpich", help="with --cluster")
    parser.add_argument("--link", default="1gbit", help="with --cluster: a rate, or unshaped")
    parser.add_argument("--timeout", type=float, default=900, help="with --cluster, seconds")
    args = parser.parse_args()
    return cluster(args) if args.cluster else job(args)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
