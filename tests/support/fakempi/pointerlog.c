/* A PMPI interposer that records what kind of memory each all-reduce is handed.
 *
 * Loaded with RTLD_GLOBAL before fastreduce's extension modules, its MPI_Allreduce and
 * MPI_Iallreduce come first in the symbol search, so fastreduce's calls land here; each is
 * counted by the kind of its buffers and passed on to the real MPI (PMPI_*). The kind comes
 * from a classifier the test installs: the fake CUDA runtime's fakecuda_pointer_kind (1: device
 * memory, 2: pinned host memory, 0: other host memory). A call with a device pointer in either
 * buffer counts as "device".
 *
 * Build: mpicc -O1 -shared -fPIC -o libpointerlog.so pointerlog.c
 */
#include <mpi.h>
#include <stddef.h>
#include <stdint.h>

#define EXPORT __attribute__((visibility("default")))

enum { KIND_HOST, KIND_DEVICE, KIND_PINNED, NKINDS };
enum { CALL_ALLREDUCE, CALL_IALLREDUCE, NCALLS };

struct pointerlog_counts {
    uint64_t calls[NCALLS][NKINDS]; /* [blocking, non-blocking][host, device, pinned] */
};

static struct pointerlog_counts g_counts;
static int (*g_classify)(const void *);

EXPORT void pointerlog_set_classifier(int (*classify)(const void *)) { g_classify = classify; }
EXPORT void pointerlog_get_counts(struct pointerlog_counts *out) { *out = g_counts; }
EXPORT void pointerlog_reset(void)
{
    struct pointerlog_counts zero = {0};
    g_counts = zero;
}
EXPORT size_t pointerlog_counts_size(void) { return sizeof g_counts; }

static int kind_of(const void *p)
{
    if (!g_classify || p == MPI_IN_PLACE)
        return KIND_HOST;
    int kind = g_classify(p);
    return kind == 1 ? KIND_DEVICE : kind == 2 ? KIND_PINNED : KIND_HOST;
}

static void record(int call, const void *sendbuf, const void *recvbuf)
{
    int kind = kind_of(recvbuf);
    if (kind_of(sendbuf) == KIND_DEVICE)
        kind = KIND_DEVICE;
    __atomic_fetch_add(&g_counts.calls[call][kind], 1, __ATOMIC_RELAXED);
}

EXPORT int MPI_Allreduce(const void *sendbuf, void *recvbuf, int count, MPI_Datatype datatype,
                         MPI_Op op, MPI_Comm comm)
{
    record(CALL_ALLREDUCE, sendbuf, recvbuf);
    return PMPI_Allreduce(sendbuf, recvbuf, count, datatype, op, comm);
}

EXPORT int MPI_Iallreduce(const void *sendbuf, void *recvbuf, int count, MPI_Datatype datatype,
                          MPI_Op op, MPI_Comm comm, MPI_Request *request)
{
    record(CALL_IALLREDUCE, sendbuf, recvbuf);
    return PMPI_Iallreduce(sendbuf, recvbuf, count, datatype, op, comm, request);
}
