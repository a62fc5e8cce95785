"""MNIST-style training with Horovod's torch API on fastreduce, on synthetic digits.

    mpiexec -n 2 python examples/horovod/pytorch_mnist.py [--epochs 3]

The images are 28x28 and 10 classes like MNIST's, made by a seeded generator (each class
a fixed random pattern plus noise), so nothing is downloaded and every rank holds the same
data set. Each rank trains on its own share (DistributedSampler over hvd.rank() and
hvd.size()); rank 0 prints the test loss and accuracy averaged over the ranks each epoch.
"""

import argparse

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import fastreduce.horovod as hvd

parser = argparse.ArgumentParser(description="MNIST-style training (Horovod API)",
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
parser.add_argument("--batch-size", type=int, default=64, help="training batch size per rank")
parser.add_argument("--test-batch-size", type=int, default=500, help="test batch size")
parser.add_argument("--epochs", type=int, default=3, help="epochs to train")
parser.add_argument("--lr", type=float, default=0.01, help="learning rate on one rank")
parser.add_argument("--momentum", type=float, default=0.5, help="SGD momentum")
parser.add_argument("--seed", type=int, default=42, help="random seed")
parser.add_argument("--train-size", type=int, default=6000, help="training images")
parser.add_argument("--test-size", type=int, default=1000, help="test images")
parser.add_argument("--log-interval", type=int, default=10,
                    help="batches between training-loss lines")
parser.add_argument("--fp16-allreduce", action="store_true",
                    help="compress gradients to float16 for the all-reduce")
parser.add_argument("--use-adasum", action="store_true", help="reduce with Adasum")
parser.add_argument("--gradient-predivide-factor", type=float, default=1.0,
                    help="divide gradients by this before the sum, by size/factor after")


class Net(torch.nn.Module):
    """Two convolutions and two fully connected layers, for 1x28x28 images."""

    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(1, 10, kernel_size=5)
        self.conv2 = torch.nn.Conv2d(10, 20, kernel_size=5)
        self.conv2_drop = torch.nn.Dropout2d()
        self.fc1 = torch.nn.Linear(320, 50)
        self.fc2 = torch.nn.Linear(50, 10)

    def forward(self, x):
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.conv2_drop(self.conv2(x)), 2))
        x = F.relu(self.fc1(x.flatten(1)))
        x = F.dropout(x, training=self.training)
        return F.log_softmax(self.fc2(x), dim=1)


def synthetic_digits(n, generator, patterns):
    """`n` images of the classes of `patterns` (10x1x28x28): the pattern plus noise."""
    labels = torch.randint(0, len(patterns), (n,), generator=generator)
    images = patterns[labels] + 0.8 * torch.randn(n, 1, 28, 28, generator=generator)
    return TensorDataset(images, labels)


def metric_average(value, name):
    """The mean of `value` over all ranks."""
    return hvd.allreduce(torch.tensor(value), name=name).item()


def main():
    args = parser.parse_args()
    hvd.init()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)  # one CPU thread per rank

    gen = torch.Generator().manual_seed(args.seed)  # the same data set on every rank
    patterns = torch.randn(10, 1, 28, 28, generator=gen)
    train_set = synthetic_digits(args.train_size, gen, patterns)
    test_set = synthetic_digits(args.test_size, gen, patterns)

    # Each rank reads its own share of the data.
    train_sampler = DistributedSampler(train_set, num_replicas=hvd.size(), rank=hvd.rank())
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler)
    test_sampler = DistributedSampler(test_set, num_replicas=hvd.size(), rank=hvd.rank(),
                                      shuffle=False)
    test_loader = DataLoader(test_set, batch_size=args.test_batch_size, sampler=test_sampler)

    model = Net()
    # Averaging over size ranks makes each step size times larger in data: so is lr.
    lr_scaler = 1 if args.use_adasum else hvd.size()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * lr_scaler,
                                momentum=args.momentum)

    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    optimizer = hvd.DistributedOptimizer(
        optimizer, named_parameters=model.named_parameters(), compression=compression,
        op=hvd.Adasum if args.use_adasum else hvd.Average,
        gradient_predivide_factor=args.gradient_predivide_factor)

    def train(epoch):
        model.train()
        train_sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank
        for batch_idx, (data, target) in enumerate(train_loader):
            optimizer.zero_grad()
            loss = F.nll_loss(model(data), target)
            loss.backward()
            optimizer.step()
            if batch_idx % args.log_interval == 0 and hvd.rank() == 0:
                print(f"Train Epoch: {epoch} [{batch_idx * len(data)}/{len(train_sampler)} "
                      f"({100.0 * batch_idx / len(train_loader):.0f}%)]\t"
                      f"Loss: {loss.item():.6f}", flush=True)

    def test(epoch):
        model.eval()
        test_loss = test_accuracy = 0.0
        with torch.no_grad():
            for data, target in test_loader:
                output = model(data)
                test_loss += F.nll_loss(output, target, reduction="sum").item()
                test_accuracy += (output.argmax(1) == target).float().sum().item()
        # This rank's share, then the mean over the ranks.
        test_loss = metric_average(test_loss / len(test_sampler), "avg_loss")
        test_accuracy = metric_average(test_accuracy / len(test_sampler), "avg_accuracy")
        if hvd.rank() == 0:
            print(f"\nTest set (epoch {epoch}): Average loss: {test_loss:.4f}, "
                  f"Accuracy: {100.0 * test_accuracy:.2f}%\n", flush=True)

    if hvd.rank() == 0:
        print(f"{hvd.size()} ranks, {len(train_sampler)} training images per rank", flush=True)
    test(0)  # before training: the loss to beat
    for epoch in range(1, args.epochs + 1):
        train(epoch)
        test(epoch)


if __name__ == "__main__":
    main()
