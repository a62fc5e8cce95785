#!/usr/bin/env bash
# Build the documentation (docs/, Sphinx + MyST) into docs/_build/html, warnings as
# errors; exits non-zero on any warning. Uses the active Python environment (a venv from
# tools/bootstrap.sh, where fastreduce is installed: the API pages import it) and
# installs Sphinx and myst-parser there if they are missing. Arguments go to sphinx.
#
#   . .venv-openmpi/bin/activate && bash tools/docs.sh
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
python=${PYTHON:-python}
if ! "$python" -c "import sphinx, myst_parser" 2>/dev/null; then
  "$python" -m pip install -q sphinx myst-parser
fi
export OMPI_ALLOW_RUN_AS_ROOT=${OMPI_ALLOW_RUN_AS_ROOT:-1}  # importing fastreduce starts MPI
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=${OMPI_ALLOW_RUN_AS_ROOT_CONFIRM:-1}
# Run from outside the tree, so `import fastreduce` finds the installed package, not src/.
cd "$root/docs"
exec "$python" -m sphinx -W --keep-going -b html "$@" . _build/html
