#!/usr/bin/env bash
# The system packages the tests need (Debian/Ubuntu, as root): g++ for torch.compile's
# CPU code (inductor), and for the Slurm tests a single-node
# Slurm and the system Open MPI that speaks PMIx to it. Without root this says so and
# does nothing; the Slurm tests then skip with the reason (outside CI). iproute2 and
# util-linux (ip, tc, unshare) for the cluster on one machine (fastreduce.cluster). MPICH
# (Debian's, 4.0) for the wheel's run on it (tests/launch/test_wheel.py); Open MPI stays the
# system's mpicc and mpiexec (Debian ranks it first).
set -euo pipefail
packages=(slurmctld slurmd slurm-client libpmix2 libpmix-dev openmpi-bin libopenmpi-dev g++
          iproute2 util-linux mpich libmpich-dev)
missing=()
for p in "${packages[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
[ "${#missing[@]}" -eq 0 ] && exit 0
if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null; then
  echo "install-system-deps: not root or no apt-get; Slurm tests will skip (${missing[*]})" >&2
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
