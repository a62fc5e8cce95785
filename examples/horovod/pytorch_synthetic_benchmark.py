"""Synthetic training throughput with Horovod's torch API on fastreduce.

    mpiexec -n 2 python examples/horovod/pytorch_synthetic_benchmark.py
    srun -n 2 --mpi=pmix python examples/horovod/pytorch_synthetic_benchmark.py --num-iters 10

Each rank trains a model on one fixed random batch with hvd.DistributedOptimizer; rank 0
prints the images per second of every timed iteration, then their mean and the total.
The default model is an MLP of 50 Linear layers of width 448 (about 10M parameters in
100 tensors); with torchvision installed, --model also takes a torchvision model name.
"""

import argparse
import timeit

import numpy as np
import torch
import torch.nn.functional as F

import fastreduce.horovod as hvd

parser = argparse.ArgumentParser(description="Synthetic training benchmark (Horovod API)",
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
parser.add_argument("--model", default="mlp",
                    help="mlp, or a torchvision model name (e.g. resnet50)")
parser.add_argument("--width", type=int, default=448, help="the MLP's layer width")
parser.add_argument("--depth", type=int, default=50, help="the MLP's Linear layers")
parser.add_argument("--batch-size", type=int, default=32, help="input batch size per rank")
parser.add_argument("--num-warmup-batches", type=int, default=2,
                    help="untimed batches before the benchmark")
parser.add_argument("--num-batches-per-iter", type=int, default=5,
                    help="batches per timed iteration")
parser.add_argument("--num-iters", type=int, default=5, help="timed iterations")
parser.add_argument("--fp16-allreduce", action="store_true",
                    help="compress gradients to float16 for the all-reduce")
parser.add_argument("--use-adasum", action="store_true", help="reduce with Adasum")
parser.add_argument("--threads", type=int, default=1, help="torch CPU threads per rank")
args = parser.parse_args()

hvd.init()
torch.set_num_threads(args.threads)
torch.manual_seed(hvd.rank())  # different initial weights: the broadcast makes them equal

if args.model == "mlp":
    layers = []
    for _ in range(args.depth):
        layers += [torch.nn.Linear(args.width, args.width), torch.nn.Tanh()]
    model = torch.nn.Sequential(*layers)
    data = torch.randn(args.batch_size, args.width)
    classes = args.width
else:
    from torchvision import models  # only for --model NAME

    model = getattr(models, args.model)()
    data = torch.randn(args.batch_size, 3, 224, 224)
    classes = 1000
target = torch.randint(0, classes, (args.batch_size,))

# Adasum needs no larger learning rate; averaging does.
lr_scaler = 1 if args.use_adasum else hvd.size()
optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * lr_scaler)

compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                     compression=compression,
                                     op=hvd.Adasum if args.use_adasum else hvd.Average)

hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(optimizer, root_rank=0)


def benchmark_step():
    optimizer.zero_grad()
    loss = F.cross_entropy(model(data), target)
    loss.backward()
    optimizer.step()


def log(text):
    if hvd.rank() == 0:
        print(text, flush=True)


n_params = sum(p.numel() for p in model.parameters())
log(f"Model: {args.model} ({n_params} parameters)")
log(f"Batch size: {args.batch_size}")
log(f"Number of CPUs: {hvd.size()}")
log(f"Gradient all-reduce: {'fp16' if args.fp16_allreduce else 'float32'}"
    f"{', Adasum' if args.use_adasum else ''}")

log("Running warmup...")
timeit.timeit(benchmark_step, number=args.num_warmup_batches)

log("Running benchmark...")
img_secs = []
for i in range(args.num_iters):
    seconds = timeit.timeit(benchmark_step, number=args.num_batches_per_iter)
    img_sec = args.batch_size * args.num_batches_per_iter / seconds
    log(f"Iter #{i}: {img_sec:.1f} img/sec per CPU")
    img_secs.append(img_sec)

mean, conf = np.mean(img_secs), 1.96 * np.std(img_secs)
log(f"Img/sec per CPU: {mean:.1f} +-{conf:.1f}")
log(f"Total img/sec on {hvd.size()} CPU(s): {hvd.size() * mean:.1f} +-{hvd.size() * conf:.1f}")
