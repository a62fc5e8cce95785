/* What fastreduce needs from <mpi.h> beyond the MPI-3.1 standard, in one place.
 *
 * Everything here compiles against any MPI >= 3.1; features an MPI lacks are
 * replaced by a constant that says so (MPI_DATATYPE_NULL, 0), so the Cython
 * code never needs a preprocessor branch.
 */
#ifndef FASTREDUCE_MPICOMPAT_H
#define FASTREDUCE_MPICOMPAT_H

#include <mpi.h>
#if defined(OPEN_MPI) && OPEN_MPI
#include <mpi-ext.h> /* MPIX_C_FLOAT16 lives in Open MPI's shortfloat extension */
#endif

#ifndef FASTREDUCE_HAVE_LARGE_COUNT
#define FASTREDUCE_HAVE_LARGE_COUNT 0
#endif

/* 16-bit floating types of the MPI itself, or MPI_DATATYPE_NULL. */
#if defined(MPIX_C_FLOAT16)
#define FR_MPIX_FLOAT16 MPIX_C_FLOAT16
#else
#define FR_MPIX_FLOAT16 MPI_DATATYPE_NULL
#endif
#if defined(MPIX_BFLOAT16)
#define FR_MPIX_BFLOAT16 MPIX_BFLOAT16
#elif defined(MPIX_C_BF16)
#define FR_MPIX_BFLOAT16 MPIX_C_BF16
#else
#define FR_MPIX_BFLOAT16 MPI_DATATYPE_NULL
#endif

/* The MPI family this extension was compiled against; its ABI (the size and
 * meaning of MPI_Comm, MPI_Datatype, ...) is fixed by that family. */
#if defined(OPEN_MPI) && OPEN_MPI
#define FR_MPI_FAMILY "Open MPI"
#define FR_STR2(x) #x
#define FR_STR(x) FR_STR2(x)
#define FR_MPI_BUILD_VERSION \
  "Open MPI " FR_STR(OMPI_MAJOR_VERSION) "." FR_STR(OMPI_MINOR_VERSION) "." FR_STR(OMPI_RELEASE_VERSION)
#elif defined(MPICH_VERSION) || defined(MPICH)
#define FR_MPI_FAMILY "MPICH"
#if defined(I_MPI_VERSION)
#define FR_MPI_BUILD_VERSION "Intel MPI " I_MPI_VERSION
#elif defined(MVAPICH2_VERSION)
#define FR_MPI_BUILD_VERSION "MVAPICH2 " MVAPICH2_VERSION
#else
#define FR_MPI_BUILD_VERSION "MPICH " MPICH_VERSION
#endif
#else
#define FR_MPI_FAMILY "unknown"
#define FR_MPI_BUILD_VERSION "unknown MPI"
#endif

/* MPI_Allreduce_c where the MPI has MPI-4 large-count bindings; elsewhere
 * the caller chunks and this is never reached. */
static inline int fr_allreduce_large(const void *sendbuf, void *recvbuf, MPI_Count count,
                                     MPI_Datatype datatype, MPI_Op op, MPI_Comm comm)
{
#if FASTREDUCE_HAVE_LARGE_COUNT
  return MPI_Allreduce_c(sendbuf, recvbuf, count, datatype, op, comm);
#else
  (void)sendbuf; (void)recvbuf; (void)count; (void)datatype; (void)op; (void)comm;
  return MPI_ERR_COUNT;
#endif
}

static inline int fr_iallreduce_large(const void *sendbuf, void *recvbuf, MPI_Count count,
                                      MPI_Datatype datatype, MPI_Op op, MPI_Comm comm,
                                      MPI_Request *request)
{
#if FASTREDUCE_HAVE_LARGE_COUNT
  return MPI_Iallreduce_c(sendbuf, recvbuf, count, datatype, op, comm, request);
#else
  (void)sendbuf; (void)recvbuf; (void)count; (void)datatype; (void)op; (void)comm;
  (void)request;
  return MPI_ERR_COUNT;
#endif
}

#endif /* FASTREDUCE_MPICOMPAT_H */
