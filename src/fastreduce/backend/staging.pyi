from mpi4py import MPI

def _time_device_path(
    comm: MPI.Comm, device_ptr: int, nbytes: int, path: str, reps: int
) -> list[float]: ...
