"""allreduce_ of more than 2**31 int8 elements (about 2 GiB a rank): correct, at both ends."""

import numpy as np
from common import WORLD, Failures

import fastreduce

f = Failures()
n = 2**31 + 4097
x = np.full(n, WORLD.rank + 1, dtype=np.int8)
x[-1] = 2 * (WORLD.rank + 1)  # the last element differs: an off-by-one loses it
fastreduce.allreduce_(x)
total = sum(r + 1 for r in range(WORLD.size))
f.check(int(x[:-1].min()) == total and int(x[:-1].max()) == total,
        f"elements 0..n-2: min {x[:-1].min()} max {x[:-1].max()}, want {total}")
f.check(int(x[-1]) == 2 * total, f"last element {x[-1]}, want {2 * total}")
f.finish()
