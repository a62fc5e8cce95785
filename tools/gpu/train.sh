#!/bin/bash
# On the GPU machine (from tools/gpu/make_kit.sh): build fastreduce for the torch venv there,
# then time the data-parallel step (bench/train_step_bench.py --device cuda, the 25.2M MLP)
# at 2 and 4 ranks sharing the GPU under MPS, with GradientSync's timeline of every rank;
# results, JSON and traces into $OUT. About 4 minutes on an H200.
cd "$(dirname "$0")/.."
PY=/opt/torch/.venv/bin/python
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 PYTHONUNBUFFERED=1
.venv-gpukit/build.sh $PY .venv-gpukit/wheels/mpi4py-*cp312*.whl > $OUT/build.txt 2>&1 ||
  { tail -20 $OUT/build.txt; exit 1; }
export $(tail -1 $OUT/build.txt)
extra=; mpiexec --version | grep -q -E "Open MPI|OpenRTE" && extra=--oversubscribe
nvidia-cuda-mps-control -d 2>/dev/null && echo "MPS started"
$PY -c "import fastreduce, torch; print(fastreduce.build_mpi(), torch.cuda.get_device_name())"
for n in 2 4; do
  timeout ${T:-240} mpiexec $extra -n $n $PY bench/train_step_bench.py --device cuda \
    --repeat 5 --steps 20 --json $OUT/train$n.json > $OUT/train$n.txt 2>&1
  echo "=== $n ranks: rc=$?"; tail -12 $OUT/train$n.txt
done
timeout 120 mpiexec $extra -n 2 $PY bench/train_step_bench.py --device cuda --repeat 1 \
  --steps 5 --timeline "$OUT/timeline-{rank}.json" > $OUT/timeline.txt 2>&1
echo "=== timeline: rc=$?"
echo quit | nvidia-cuda-mps-control 2>/dev/null
