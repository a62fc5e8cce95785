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
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

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

struct call_record {
    uint64_t bytes;
    int64_t start_ns, end_ns;
};

static pthread_mutex_t g_calls_lock = PTHREAD_MUTEX_INITIALIZER; /* guards the three below */
static struct call_record *g_calls;
static size_t g_calls_capacity, g_calls_used;

static int64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* Record the next `capacity` blocking all-reduces (0: stop); 0, or 1 if out of memory.
 * Not to be called while all-reduces run. */
EXPORT int pointerlog_log_calls(size_t capacity)
{
    pthread_mutex_lock(&g_calls_lock);
    free(g_calls);
    g_calls = capacity ? calloc(capacity, sizeof *g_calls) : NULL;
    g_calls_capacity = g_calls ? capacity : 0;
    g_calls_used = 0;
    pthread_mutex_unlock(&g_calls_lock);
    return capacity && !g_calls;
}

/* Copy up to `max` records into out; returns how many calls were recorded. */
EXPORT size_t pointerlog_calls(struct call_record *out, size_t max)
{
    pthread_mutex_lock(&g_calls_lock);
    size_t used = g_calls_used, n = used < max ? used : max;
    if (n)
        memcpy(out, g_calls, n * sizeof *out);
    pthread_mutex_unlock(&g_calls_lock);
    return used;
}

EXPORT int MPI_Allreduce(const void *sendbuf, void *recvbuf, int count, MPI_Datatype datatype,
                         MPI_Op op, MPI_Comm comm)
{
    record(CALL_ALLREDUCE, sendbuf, recvbuf);
    int64_t start = now_ns();
    int err = PMPI_Allreduce(sendbuf, recvbuf, count, datatype, op, comm);
    int64_t end = now_ns();
    pthread_mutex_lock(&g_calls_lock);
    if (g_calls_used < g_calls_capacity) {
        int size = 0;
        PMPI_Type_size(datatype, &size);
        g_calls[g_calls_used++] = (struct call_record){(uint64_t)count * (uint64_t)size, start,
                                                       end};
    }
    pthread_mutex_unlock(&g_calls_lock);
    return err;
}

EXPORT int MPI_Iallreduce(const void *sendbuf, void *recvbuf, int count, MPI_Datatype datatype,
                          MPI_Op op, MPI_Comm comm, MPI_Request *request)
{
    record(CALL_IALLREDUCE, sendbuf, recvbuf);
    return PMPI_Iallreduce(sendbuf, recvbuf, count, datatype, op, comm, request);
}
