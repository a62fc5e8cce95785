#!/bin/bash
# On the GPU machine (from tools/gpu/make_kit.sh): build fastreduce for the torch venv there, then run tests/mpi/test_gpu.py
# on 2 and 4 ranks and tests/launch/test_gpu_bench.py; logs into $OUT.
cd "$(dirname "$0")/.."
PY=/opt/torch/.venv/bin/python
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_mpi_yield_when_idle=1
export PYTHONUNBUFFERED=1
start=$(date +%s)
.venv-gpukit/build.sh $PY .venv-gpukit/wheels/mpi4py-*cp312*.whl > $OUT/build.txt 2>&1
rc=$?; echo "build rc=$rc in $(( $(date +%s) - start )) s"; tail -5 $OUT/build.txt
[ $rc = 0 ] || { cp /tmp/gk/*.log $OUT/ 2>/dev/null; exit 1; }
export $(tail -1 $OUT/build.txt)
mpiexec --version | head -1
extra=; mpiexec --version | grep -q -E "Open MPI|OpenRTE" && extra=--oversubscribe
$PY -c "import fastreduce, torch; print(fastreduce.build_mpi(), fastreduce.cuda_aware(), torch.cuda.get_device_name())"
for n in 2 4; do
  t=$(date +%s)
  timeout ${T:-200} mpiexec $extra -n $n $PY -m pytest tests/mpi/test_gpu.py -p no:cacheprovider -q -rs --durations=8 > $OUT/n$n.txt 2>&1
  echo "=== $n ranks: rc=$? in $(( $(date +%s) - t )) s"; grep -E "^mpi:|passed|failed|skipped|error" $OUT/n$n.txt | tail -4
done
t=$(date +%s)
timeout 150 $PY -m pytest tests/launch/test_gpu_bench.py -p no:cacheprovider -q -rs > $OUT/bench.txt 2>&1
echo "=== bench: rc=$? in $(( $(date +%s) - t )) s"; tail -3 $OUT/bench.txt
