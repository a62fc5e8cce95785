"""fastreduce.checks.split_mismatches, debug mode's pairwise check of an uneven all-to-all:
from every rank's (send counts, receive counts) it lists (i, j, what rank i sends to j,
what rank j expects from i) for each pair (i, j) that differs, in the order of (i, j).

A pure function, run here in one child process (importing fastreduce initialises MPI,
which a single-process run must not do itself) on every case at once (each also as the tuples
comm.allgather gives); the expected lists are written out by hand, or built from the send
and receive matrices of random counts.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest
from mpirun import launcher_env

CHILD = """
import json, sys
from fastreduce.checks import split_mismatches
cases = json.load(sys.stdin)
results = []
for rows in cases:
    copy = json.loads(json.dumps(rows))
    found = split_mismatches(rows)
    assert rows == copy, "split_mismatches changed its input"
    as_tuples = [tuple(tuple(counts) for counts in row) for row in rows]  # as allgather gives
    assert split_mismatches(as_tuples) == found, (rows, found)
    assert all(isinstance(m, tuple) and len(m) == 4 for m in found), found
    results.append([list(m) for m in found])
json.dump(results, sys.stdout)
"""

# (id, rows: each rank's (send counts, receive counts), the expected mismatches)
CASES = [
    ("no-ranks", [], []),
    ("one-rank", [([3], [3])], []),
    ("one-rank-to-itself", [([3], [2])], [(0, 0, 3, 2)]),
    ("two-ranks-pair-up", [([1, 2], [1, 5]), ([5, 0], [2, 0])], []),
    ("zeros-pair-up", [([0, 0], [0, 0]), ([0, 0], [0, 0])], []),
    # rank 0 expects 2 from rank 1, which sends it 1: one pair
    ("one-pair", [([1, 1], [1, 2]), ([1, 1], [1, 1])], [(1, 0, 1, 2)]),
    # totals that agree do not hide a pair that differs both ways
    ("both-ways", [([1, 3], [1, 3]), ([2, 1], [2, 1])], [(0, 1, 3, 2), (1, 0, 2, 3)]),
    # sending to a rank that expects nothing, and nothing to one that expects some
    ("zero-against-some", [([0, 4, 0], [0, 0, 0]), ([0, 0, 0], [0, 0, 0]),
                           ([0, 0, 0], [1, 0, 0])],
     [(0, 1, 4, 0), (0, 2, 0, 1)]),
    # three ranks, several mismatches: listed by sender, then receiver
    ("three-ranks", [([1, 2, 3], [1, 9, 7]), ([4, 5, 6], [2, 5, 8]), ([7, 8, 9], [3, 6, 0])],
     [(1, 0, 4, 9), (2, 2, 9, 0)]),
    ("four-ranks-one-off", [([1] * 4, [1] * 4)] * 3 + [([1, 1, 1, 2], [1, 1, 1, 2])], []),
    ("four-ranks-last-to-first", [([1] * 4, [1, 1, 1, 2])] + [([1] * 4, [1] * 4)] * 3,
     [(3, 0, 1, 2)]),
]


def mismatches_by_matrix(rows: list) -> list[tuple[int, int, int, int]]:
    """The reference: S[i][j] what i sends to j, R[j][i] what j expects from i."""
    n = len(rows)
    sent = [[rows[i][0][j] for j in range(n)] for i in range(n)]
    expected = [[rows[j][1][i] for j in range(n)] for i in range(n)]  # indexed [i][j]
    return [(i, j, sent[i][j], expected[i][j]) for i in range(n) for j in range(n)
            if sent[i][j] != expected[i][j]]


def random_cases(count: int = 40) -> list[tuple[str, list, list]]:
    """Consistent counts for 1-6 ranks, then 0-3 receive counts changed at random."""
    rng = random.Random(20240611)
    cases = []
    for k in range(count):
        n = rng.randint(1, 6)
        matrix = [[rng.randint(0, 5) for _ in range(n)] for _ in range(n)]  # i sends to j
        rows = [[list(matrix[i]), [matrix[j][i] for j in range(n)]] for i in range(n)]
        for _ in range(rng.randint(0, 3)):
            j, i = rng.randrange(n), rng.randrange(n)
            rows[j][1][i] += rng.choice([-1, 1, 7]) if rows[j][1][i] else 2
        cases.append((f"random-{k}", rows, mismatches_by_matrix(rows)))
    return cases


ALL = CASES + random_cases()


@pytest.fixture(scope="module")
def results() -> dict[str, list]:
    """split_mismatches of every case, computed in one child process."""
    proc = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True,
                          env=launcher_env(), timeout=300,
                          input=json.dumps([rows for _, rows, _ in ALL]))
    assert proc.returncode == 0, proc.stderr
    return {name: found for (name, _, _), found in zip(ALL, json.loads(proc.stdout),
                                                        strict=True)}


def test_the_reference_agrees_with_the_hand_written_cases():
    for name, rows, expected in CASES:
        assert mismatches_by_matrix(rows) == expected, name


@pytest.mark.parametrize("name, rows, expected", [pytest.param(*c, id=c[0]) for c in ALL])
def test_split_mismatches(name, rows, expected, results):
    assert results[name] == [list(m) for m in expected], (rows, results[name])
