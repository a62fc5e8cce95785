/* What fastreduce needs from <mpi.h> beyond the MPI-3.1 standard, in one place.
 *
 * Everything here compiles against any MPI >= 3.1; features an MPI lacks are
 * replaced by a constant that says so (MPI_DATATYPE_NULL, 0), so the Cython
 * code never needs a preprocessor branch.
 */
#ifndef FASTREDUCE_MPICOMPAT_H
#define FASTREDUCE_MPICOMPAT_H

#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* dladdr, RTLD_DEFAULT */
#endif
#include <dlfcn.h>
#include <mpi.h>
#if defined(OPEN_MPI) && OPEN_MPI
#include <mpi-ext.h> /* MPIX_C_FLOAT16 lives in Open MPI's shortfloat extension */
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

/* MPI-4's large-count bindings, looked up at run time in the MPI the process loaded
 * (MPICH 4.0 and 5.0 have them; Open MPI 4.1 and 5.0 do not): a build uses them wherever
 * the MPI at run time has them, and names no symbol an older MPI lacks. The process's
 * global scope first (a PMPI tool preloaded there wraps them), then the library
 * MPI_Allreduce comes from. Each extension module that includes this has its own copy
 * of the state below and looks it up at its import, before any thread can race. */
typedef int (*fr_allreduce_c_fn)(const void *, void *, MPI_Count, MPI_Datatype, MPI_Op,
                                 MPI_Comm);
typedef int (*fr_iallreduce_c_fn)(const void *, void *, MPI_Count, MPI_Datatype, MPI_Op,
                                  MPI_Comm, MPI_Request *);
static fr_allreduce_c_fn fr_allreduce_c = NULL;
static fr_iallreduce_c_fn fr_iallreduce_c = NULL;
static int fr_large_count_state = -1; /* -1: not looked up yet */

static inline void *fr_mpi_symbol(const char *name)
{
  void *found = dlsym(RTLD_DEFAULT, name);
  Dl_info info;
  if (found == NULL && dladdr((void *)&MPI_Allreduce, &info) && info.dli_fname != NULL) {
    void *lib = dlopen(info.dli_fname, RTLD_LAZY | RTLD_NOLOAD);
    if (lib != NULL) {
      found = dlsym(lib, name);
      dlclose(lib); /* (RTLD_NOLOAD: only the reference just taken) */
    }
  }
  return found;
}

/* 1 where the MPI loaded has MPI_Allreduce_c and MPI_Iallreduce_c (looked up once). */
static inline int fr_have_large_count(void)
{
  if (fr_large_count_state < 0) {
    fr_allreduce_c = (fr_allreduce_c_fn)fr_mpi_symbol("MPI_Allreduce_c");
    fr_iallreduce_c = (fr_iallreduce_c_fn)fr_mpi_symbol("MPI_Iallreduce_c");
    fr_large_count_state = fr_allreduce_c != NULL && fr_iallreduce_c != NULL;
  }
  return fr_large_count_state;
}

/* MPI_Allreduce_c where fr_have_large_count(); elsewhere the caller chunks and this is
 * never reached. */
static inline int fr_allreduce_large(const void *sendbuf, void *recvbuf, MPI_Count count,
                                     MPI_Datatype datatype, MPI_Op op, MPI_Comm comm)
{
  if (!fr_have_large_count()) return MPI_ERR_COUNT;
  return fr_allreduce_c(sendbuf, recvbuf, count, datatype, op, comm);
}

static inline int fr_iallreduce_large(const void *sendbuf, void *recvbuf, MPI_Count count,
                                      MPI_Datatype datatype, MPI_Op op, MPI_Comm comm,
                                      MPI_Request *request)
{
  if (!fr_have_large_count()) return MPI_ERR_COUNT;
  return fr_iallreduce_c(sendbuf, recvbuf, count, datatype, op, comm, request);
}

#endif /* FASTREDUCE_MPICOMPAT_H */
