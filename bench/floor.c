/* The floor of the benchmarks: MPI calls made directly from C in a timed loop,
 * with no Python between calls. Built with the same mpicc as fastreduce and loaded
 * with ctypes into the benchmark's own MPI job (bench/allreduce_bench.py's
 * load_floor; fastreduce-bench and bench/collectives_bench.py through
 * fastreduce/tools/benchmark/floor.py, which is installed beside this file). */
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

/* One function per collective, for fastreduce-bench -c and bench/collectives_bench.py: the
 * MPI call in a C loop, `warmup` untimed calls, a barrier, then `iters` timed calls. Each
 * returns seconds per call on this rank, or a negative MPI error code. Counts are MPI's own
 * (per rank, or per peer for MPI_Alltoall); datatypes and ops are Fortran handles (mpi4py's
 * Datatype.py2f() and Op.py2f()), so any element type and reduction can be timed. Where a
 * comment says so, a NULL send buffer means MPI_IN_PLACE. */
#define FLOOR_TIMED(call)                                                       \
  do {                                                                          \
    int ierr_;                                                                  \
    for (int i_ = 0; i_ < warmup; i_++)                                         \
      if ((ierr_ = (call)) != MPI_SUCCESS) return -(double)ierr_;               \
    MPI_Barrier(comm);                                                          \
    double start_ = MPI_Wtime();                                                \
    for (int i_ = 0; i_ < iters; i_++)                                          \
      if ((ierr_ = (call)) != MPI_SUCCESS) return -(double)ierr_;               \
    return (MPI_Wtime() - start_) / iters;                                      \
  } while (0)

#define FLOOR_SEND(buf) ((buf) ? (buf) : MPI_IN_PLACE)

/* MPI_Allreduce of any type and op; sendbuf == NULL: in place. */
double floor_allreduce_typed(MPI_Fint fcomm, const void *sendbuf, void *recvbuf, int count,
                             MPI_Fint ftype, MPI_Fint fop, int warmup, int iters)
{
  MPI_Comm comm = MPI_Comm_f2c(fcomm);
  MPI_Datatype type = MPI_Type_f2c(ftype);
  MPI_Op op = MPI_Op_f2c(fop);
  FLOOR_TIMED(MPI_Allreduce(FLOOR_SEND(sendbuf), recvbuf, count, type, op, comm));
}

/* MPI_Bcast of count elements from root. */
double floor_bcast(MPI_Fint fcomm, void *buf, int count, MPI_Fint ftype, int root, int warmup,
                   int iters)
{
  MPI_Comm comm = MPI_Comm_f2c(fcomm);
  MPI_Datatype type = MPI_Type_f2c(ftype);
  FLOOR_TIMED(MPI_Bcast(buf, count, type, root, comm));
}

/* MPI_Reduce to root; sendbuf == NULL: in place (the root's recvbuf). */
double floor_reduce(MPI_Fint fcomm, const void *sendbuf, void *recvbuf, int count,
                    MPI_Fint ftype, MPI_Fint fop, int root, int warmup, int iters)
{
  MPI_Comm comm = MPI_Comm_f2c(fcomm);
  MPI_Datatype type = MPI_Type_f2c(ftype);
  MPI_Op op = MPI_Op_f2c(fop);
  FLOOR_TIMED(MPI_Reduce(FLOOR_SEND(sendbuf), recvbuf, count, type, op, root, comm));
}

/* MPI_Allgather: count elements from each rank (recvbuf holds size * count). */
double floor_allgather(MPI_Fint fcomm, const void *sendbuf, void *recvbuf, int count,
                       MPI_Fint ftype, int warmup, int iters)
{
  MPI_Comm comm = MPI_Comm_f2c(fcomm);
  MPI_Datatype type = MPI_Type_f2c(ftype);
  FLOOR_TIMED(MPI_Allgather(sendbuf, count, type, recvbuf, count, type, comm));
}

/* MPI_Reduce_scatter_block: count elements to each rank (sendbuf holds size * count). */
double floor_reduce_scatter_block(MPI_Fint fcomm, const void *sendbuf, void *recvbuf,
                                  int count, MPI_Fint ftype, MPI_Fint fop, int warmup,
                                  int iters)
{
  MPI_Comm comm = MPI_Comm_f2c(fcomm);
  MPI_Datatype type = MPI_Type_f2c(ftype);
  MPI_Op op = MPI_Op_f2c(fop);
  FLOOR_TIMED(MPI_Reduce_scatter_block(sendbuf, recvbuf, count, type, op, comm));
}

/* MPI_Alltoall: count elements to and from each rank (both buffers hold size * count). */
double floor_alltoall(MPI_Fint fcomm, const void *sendbuf, void *recvbuf, int count,
                      MPI_Fint ftype, int warmup, int iters)
{
  MPI_Comm comm = MPI_Comm_f2c(fcomm);
  MPI_Datatype type = MPI_Type_f2c(ftype);
  FLOOR_TIMED(MPI_Alltoall(sendbuf, count, type, recvbuf, count, type, comm));
}

/* MPI_Gather: count elements from each rank into the root's recvbuf (size * count). */
double floor_gather(MPI_Fint fcomm, const void *sendbuf, void *recvbuf, int count,
                    MPI_Fint ftype, int root, int warmup, int iters)
{
  MPI_Comm comm = MPI_Comm_f2c(fcomm);
  MPI_Datatype type = MPI_Type_f2c(ftype);
  FLOOR_TIMED(MPI_Gather(sendbuf, count, type, recvbuf, count, type, root, comm));
}

/* MPI_Scatter: count elements to each rank from the root's sendbuf (size * count). */
double floor_scatter(MPI_Fint fcomm, const void *sendbuf, void *recvbuf, int count,
                     MPI_Fint ftype, int root, int warmup, int iters)
{
  MPI_Comm comm = MPI_Comm_f2c(fcomm);
  MPI_Datatype type = MPI_Type_f2c(ftype);
  FLOOR_TIMED(MPI_Scatter(sendbuf, count, type, recvbuf, count, type, root, comm));
}
