/* The floor of the all-reduce benchmark: MPI_Allreduce called directly from C
 * in a timed loop, with no Python between calls. Built with the same mpicc as
 * fastreduce and loaded with ctypes into the benchmark's own MPI job. */
#include <mpi.h>

/* Seconds per call of `iters` MPI_Allreduce (float32 sum) after `warmup`
 * untimed calls, on the communicator with Fortran handle `fcomm`.
 * sendbuf == NULL means in place. Returns a negative MPI error code on error. */
double floor_allreduce(MPI_Fint fcomm, const void *sendbuf, void *recvbuf, int count,
                       int warmup, int iters)
{
  MPI_Comm comm = MPI_Comm_f2c(fcomm);
  const void *send = sendbuf ? sendbuf : MPI_IN_PLACE;
  int ierr;
  for (int i = 0; i < warmup; i++) {
    ierr = MPI_Allreduce(send, recvbuf, count, MPI_FLOAT, MPI_SUM, comm);
    if (ierr != MPI_SUCCESS) return -(double)ierr;
  }
  MPI_Barrier(comm);
  double start = MPI_Wtime();
  for (int i = 0; i < iters; i++) {
    ierr = MPI_Allreduce(send, recvbuf, count, MPI_FLOAT, MPI_SUM, comm);
    if (ierr != MPI_SUCCESS) return -(double)ierr;
  }
  return (MPI_Wtime() - start) / iters;
}

/* One MPI_Allreduce (float32 sum; sendbuf == NULL means in place) and nothing
 * else, for loops that time it together with other work (bench/gpu_bench.py:
 * copies to and from a GPU). Returns the MPI error code. */
int floor_allreduce_once(MPI_Fint fcomm, const void *sendbuf, void *recvbuf, int count)
{
  return MPI_Allreduce(sendbuf ? sendbuf : MPI_IN_PLACE, recvbuf, count, MPI_FLOAT, MPI_SUM,
                       MPI_Comm_f2c(fcomm));
}
