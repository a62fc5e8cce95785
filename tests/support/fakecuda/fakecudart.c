/* A fake CUDA runtime for tests on machines without a GPU.
 *
 * fastreduce dlopen()s the CUDA runtime named by FASTREDUCE_CUDART; pointing that at this
 * library lets the tests run its GPU code paths (staging through pinned host memory, stream
 * ordering, copy counting) on CPU-only machines.
 *
 * Model:
 *   - "Device memory" (cudaMalloc) and pinned memory (cudaHostAlloc) are ordinary host memory;
 *     both are kept in a registry of ranges so that copies can be checked against their kind.
 *   - Every stream is a FIFO of operations run in order by its own worker thread, so
 *     cudaMemcpyAsync really is asynchronous. FAKECUDA_COPY_DELAY_US (read at each enqueue)
 *     delays every copy, so that a consumer which forgets to wait reads stale data;
 *     FAKECUDA_H2D_DELAY_US adds to it for host-to-device copies alone.
 *   - Stream handles NULL (legacy default), 1 (DLPack's name for the legacy stream) and 2
 *     (per-thread default) all name one built-in legacy stream. Like in CUDA, work on the legacy
 *     stream waits for earlier work on blocking streams (created with flags 0) and work on a
 *     blocking stream waits for earlier legacy work; non-blocking streams (flags 1) don't.
 *   - cudaEventRecord enqueues a marker; an event is complete when its latest marker has run
 *     (or when it was never recorded). cudaStreamWaitEvent captures the marker current at call
 *     time. Markers are reference counted so that events and streams can be destroyed with work
 *     still pending, as CUDA allows.
 *   - cudaFree and cudaFreeHost wait for all streams first (real CUDA synchronizes too), so no
 *     worker ever touches freed memory.
 *   - Worker threads are detached: a process may exit with streams still alive.
 *
 * Everything shared is guarded by one global mutex; completions are announced on one global
 * condition variable. This is a test double: simplicity beats speed.
 *
 * Not part of CUDA: struct fakecuda_counters with fakecuda_get_counters /
 * fakecuda_reset_counters / fakecuda_counters_size, a log of the copies run and when
 * (fakecuda_log_copies, fakecuda_copy_log), fakecuda_launch_write (a "kernel" writing
 * bytes after a delay), fakecuda_quiesce (wait until every stream is idle), and the DLPack
 * deleter and capsule destructor of the Python test module's exports.
 *
 * Build: cc -O1 -shared -fPIC -pthread -o libfakecudart.so fakecudart.c
 */

#define _POSIX_C_SOURCE 200809L

#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define EXPORT __attribute__((visibility("default")))

/* cudaError_t values used here */
enum {
    cudaSuccess = 0,
    cudaErrorInvalidValue = 1,
    cudaErrorMemoryAllocation = 2,
    cudaErrorInvalidDevice = 101,
    cudaErrorInvalidResourceHandle = 400,
    cudaErrorNotReady = 600,
    cudaErrorIllegalAddress = 700,
    cudaErrorStreamCaptureUnsupported = 900,
    cudaErrorStreamCaptureInvalidated = 901,
};

/* cudaStreamCaptureStatus */
enum { CAPTURE_NONE = 0, CAPTURE_ACTIVE = 1, CAPTURE_INVALIDATED = 2 };

/* cudaMemcpyKind */
enum { H2H = 0, H2D = 1, D2H = 2, D2D = 3, DEFAULT_KIND = 4 };

/* ---------------------------------------------------------------- counters */

struct fakecuda_counters {
    uint64_t d2h_copies, h2d_copies, d2d_copies;
    uint64_t d2h_bytes, h2d_bytes;
    uint64_t pageable_async_copies;
    uint64_t stream_syncs, event_syncs, device_syncs, stream_wait_events;
    uint64_t host_allocs, host_frees, device_allocs, device_frees;
    uint64_t streams_created, events_created;
    uint64_t bad_copies;
    uint64_t capture_violations; /* work queued on, or a wait for, a capturing stream */
};

/* ---------------------------------------------------------------- global state */

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_done = PTHREAD_COND_INITIALIZER; /* some operation completed */
static struct fakecuda_counters g_count;                 /* guarded by g_lock */
static uint64_t g_pending;         /* operations enqueued and not yet completed, all streams */
static _Thread_local int t_device; /* cudaSetDevice is per host thread */
static _Thread_local int t_last_error;
static int g_fail_event_syncs; /* injected faults still to come; guarded by g_lock */
static int g_pass_event_syncs; /* ... after this many more successful calls */

/* Record err as the thread's last error (when it is one) and return it. */
static int fail(int err)
{
    if (err != cudaSuccess)
        t_last_error = err;
    return err;
}

/* ---------------------------------------------------------------- memory registry */

struct range {
    uintptr_t base;
    size_t size;
    int device; /* 1: cudaMalloc, 0: cudaHostAlloc */
};

static struct range *g_ranges; /* guarded by g_lock */
static size_t g_nranges, g_cap_ranges;

/* Lookups treat an empty allocation as one byte, so that its pointer is still known. */
static size_t span(const struct range *r) { return r->size ? r->size : 1; }

/* Is [p, p+n) wholly inside one allocation of the given sort? */
static int inside(const void *p, size_t n, int device)
{
    uintptr_t a = (uintptr_t)p;
    for (size_t i = 0; i < g_nranges; i++) {
        const struct range *r = &g_ranges[i];
        if (r->device == device && a >= r->base && a - r->base < span(r) &&
            n <= span(r) - (a - r->base))
            return 1;
    }
    return 0;
}

/* Does [p, p+n) (at least the byte at p) overlap any device allocation? */
static int touches_device(const void *p, size_t n)
{
    uintptr_t a = (uintptr_t)p, end = a + (n ? n : 1);
    for (size_t i = 0; i < g_nranges; i++) {
        const struct range *r = &g_ranges[i];
        if (r->device && a < r->base + span(r) && r->base < end)
            return 1;
    }
    return 0;
}

static int add_range(void *p, size_t n, int device)
{
    if (g_nranges == g_cap_ranges) {
        size_t cap = g_cap_ranges ? 2 * g_cap_ranges : 64;
        struct range *grown = realloc(g_ranges, cap * sizeof *grown);
        if (!grown)
            return 0;
        g_ranges = grown;
        g_cap_ranges = cap;
    }
    g_ranges[g_nranges++] = (struct range){(uintptr_t)p, n, device};
    return 1;
}

/* Remove the allocation starting exactly at p; 0 if there is none of that sort. */
static int remove_range(void *p, int device)
{
    for (size_t i = 0; i < g_nranges; i++) {
        if (g_ranges[i].base == (uintptr_t)p && g_ranges[i].device == device) {
            g_ranges[i] = g_ranges[--g_nranges];
            return 1;
        }
    }
    return 0;
}

/* ---------------------------------------------------------------- the copy log */

/* When on (fakecuda_log_copies), each copy (and fakecuda_launch_write) a stream worker runs
 * is recorded: its kind, its stream, the bytes and when it ran (CLOCK_MONOTONIC, ns), so
 * that tests can see which copies overlapped which MPI calls. Guarded by g_lock. */
struct copy_record {
    int kind;
    uint64_t stream;
    uint64_t bytes;
    int64_t start_ns, end_ns;
};

static struct copy_record *g_log;
static size_t g_log_capacity, g_log_used;

static int64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* ---------------------------------------------------------------- markers, streams, events */

/* A point in a stream's queue; done once the stream has run everything before it. */
struct marker {
    int done;
    int refs;
};

static struct marker *marker_new(void)
{
    struct marker *m = calloc(1, sizeof *m);
    if (m)
        m->refs = 1;
    return m;
}

static void marker_unref(struct marker *m)
{
    if (m && --m->refs == 0)
        free(m);
}

enum op_kind { OP_COPY, OP_WRITE, OP_RECORD, OP_WAIT };

struct op {
    enum op_kind kind;
    int copy_kind;    /* OP_COPY: H2D, D2H, ... (for the copy log) */
    void *dst;
    const void *src;
    size_t n;
    unsigned delay_us;
    void *owned;      /* OP_WRITE: the bytes to write, freed after */
    struct marker *m; /* OP_RECORD: marks m done; OP_WAIT: waits until m is done */
    struct op *next;
};

struct stream {
    struct op *head, *tail;
    pthread_cond_t work; /* an operation was enqueued, or the stream was destroyed */
    uint64_t enqueued, completed;
    int blocking;  /* synchronizes with the legacy stream */
    int destroyed; /* handle no longer valid; the worker exits once the queue is empty */
    int started;   /* worker thread running */
    int capture;   /* CAPTURE_*: between cudaStreamBeginCapture and cudaStreamEndCapture */
    struct stream *next;
};

struct event {
    struct marker *m; /* latest record, NULL if never recorded */
    struct event *next;
};

static struct stream g_legacy = {.work = PTHREAD_COND_INITIALIZER, .blocking = 1};
static struct stream *g_streams; /* created streams, including destroyed ones still draining */
static struct event *g_events;

static void sleep_us(unsigned us)
{
    struct timespec ts = {us / 1000000u, (long)(us % 1000000u) * 1000L};
    while (nanosleep(&ts, &ts) == -1 && errno == EINTR)
        ;
}

/* Unlink and free a destroyed stream whose queue has drained. Called with g_lock held. */
static void stream_free(struct stream *s)
{
    for (struct stream **p = &g_streams; *p; p = &(*p)->next) {
        if (*p == s) {
            *p = s->next;
            break;
        }
    }
    pthread_cond_destroy(&s->work);
    free(s);
}

/* The worker thread of one stream: runs its operations in order. */
static void *worker(void *arg)
{
    struct stream *s = arg;
    pthread_mutex_lock(&g_lock);
    for (;;) {
        while (!s->head && !s->destroyed)
            pthread_cond_wait(&s->work, &g_lock);
        if (!s->head)
            break; /* destroyed and drained */
        struct op *op = s->head;
        switch (op->kind) {
        case OP_WAIT:
            while (!op->m->done)
                pthread_cond_wait(&g_done, &g_lock);
            break;
        case OP_RECORD:
            op->m->done = 1;
            break;
        case OP_COPY:
        case OP_WRITE: {
            int64_t start = now_ns();
            pthread_mutex_unlock(&g_lock);
            if (op->delay_us)
                sleep_us(op->delay_us);
            if (op->n)
                memmove(op->dst, op->kind == OP_WRITE ? op->owned : op->src, op->n);
            pthread_mutex_lock(&g_lock);
            if (g_log_used < g_log_capacity) /* a write's kind: -1 */
                g_log[g_log_used++] = (struct copy_record){
                    op->kind == OP_COPY ? op->copy_kind : -1, (uint64_t)(uintptr_t)s, op->n,
                    start, now_ns()};
            break;
        }
        }
        /* Dequeue only now, so that the stream counts as busy while op runs. */
        s->head = op->next;
        if (!s->head)
            s->tail = NULL;
        marker_unref(op->m);
        free(op->owned);
        free(op);
        s->completed++;
        g_pending--;
        pthread_cond_broadcast(&g_done);
    }
    stream_free(s);
    pthread_mutex_unlock(&g_lock);
    return NULL;
}

/* Start s's worker if it has none yet. Called with g_lock held. */
static int ensure_worker(struct stream *s)
{
    if (s->started)
        return 1;
    pthread_attr_t attr;
    pthread_t tid;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    int ok = pthread_create(&tid, &attr, worker, s) == 0;
    pthread_attr_destroy(&attr);
    s->started = ok;
    return ok;
}

/* Append op to s. Called with g_lock held. */
static void push(struct stream *s, struct op *op)
{
    op->next = NULL;
    if (s->tail)
        s->tail->next = op;
    else
        s->head = op;
    s->tail = op;
    s->enqueued++;
    g_pending++;
    pthread_cond_signal(&s->work);
}

static int busy(const struct stream *s) { return s->completed != s->enqueued; }

/* Make `waiter` wait for everything enqueued so far on `target`. Called with g_lock held. */
static int order_after(struct stream *waiter, struct stream *target)
{
    struct op *rec = calloc(1, sizeof *rec), *wait = calloc(1, sizeof *wait);
    struct marker *m = marker_new();
    if (!rec || !wait || !m) {
        free(rec);
        free(wait);
        free(m);
        return 0;
    }
    m->refs = 2;
    *rec = (struct op){.kind = OP_RECORD, .m = m};
    *wait = (struct op){.kind = OP_WAIT, .m = m};
    push(target, rec);
    push(waiter, wait);
    return 1;
}

/* Enqueue a user operation on s, after the legacy stream's implicit synchronization.
 * Called with g_lock held; takes ownership of op (freed on failure). */
static int enqueue(struct stream *s, struct op *op)
{
    if (s->capture != CAPTURE_NONE) {
        /* Real CUDA would record op into the graph instead of running it; nothing that
         * fastreduce queues may end up there (MPI cannot be captured), so count it. */
        g_count.capture_violations++;
        s->capture = CAPTURE_INVALIDATED;
        free(op->owned);
        free(op);
        return cudaErrorStreamCaptureInvalidated;
    }
    if (!ensure_worker(s)) {
        free(op->owned);
        free(op);
        return cudaErrorMemoryAllocation;
    }
    int ok = 1;
    if (s == &g_legacy) {
        for (struct stream *o = g_streams; o && ok; o = o->next)
            if (o->blocking && busy(o))
                ok = order_after(s, o);
    } else if (s->blocking && busy(&g_legacy)) {
        ok = order_after(s, &g_legacy);
    }
    if (!ok) {
        free(op->owned);
        free(op);
        return cudaErrorMemoryAllocation;
    }
    push(s, op);
    return cudaSuccess;
}

/* The stream a handle names, or NULL if it names none. Called with g_lock held. */
static struct stream *find_stream(void *handle)
{
    uintptr_t h = (uintptr_t)handle;
    if (h == 0 || h == 1 || h == 2)
        return &g_legacy;
    for (struct stream *s = g_streams; s; s = s->next)
        if (s == handle && !s->destroyed)
            return s;
    return NULL;
}

static struct event *find_event(void *handle)
{
    for (struct event *e = g_events; e; e = e->next)
        if (e == handle)
            return e;
    return NULL;
}

/* Block until every stream is idle. Called with g_lock held. */
static void wait_all(void)
{
    while (g_pending)
        pthread_cond_wait(&g_done, &g_lock);
}

/* Block until s has run everything enqueued on it so far. Called with g_lock held. */
static void wait_stream(struct stream *s)
{
    uint64_t target = s->enqueued;
    while (s->completed < target)
        pthread_cond_wait(&g_done, &g_lock);
}

static unsigned env_uint(const char *name, unsigned fallback)
{
    const char *v = getenv(name);
    if (!v || !*v)
        return fallback;
    char *end;
    unsigned long x = strtoul(v, &end, 10);
    return *end ? fallback : (unsigned)x;
}

/* ---------------------------------------------------------------- devices and versions */

EXPORT int cudaGetDeviceCount(int *count)
{
    if (!count)
        return fail(cudaErrorInvalidValue);
    *count = (int)env_uint("FAKECUDA_DEVICES", 2);
    return cudaSuccess;
}

EXPORT int cudaGetDevice(int *device)
{
    if (!device)
        return fail(cudaErrorInvalidValue);
    *device = t_device;
    return cudaSuccess;
}

EXPORT int cudaSetDevice(int device)
{
    if (device < 0 || device >= (int)env_uint("FAKECUDA_DEVICES", 2))
        return fail(cudaErrorInvalidDevice);
    t_device = device;
    return cudaSuccess;
}

EXPORT int cudaDriverGetVersion(int *version)
{
    if (!version)
        return fail(cudaErrorInvalidValue);
    *version = 12080;
    return cudaSuccess;
}

EXPORT int cudaRuntimeGetVersion(int *version)
{
    if (!version)
        return fail(cudaErrorInvalidValue);
    *version = 12080;
    return cudaSuccess;
}

EXPORT const char *cudaGetErrorString(int err)
{
    switch (err) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorInvalidDevice: return "invalid device ordinal";
    case cudaErrorInvalidResourceHandle: return "invalid resource handle";
    case cudaErrorNotReady: return "device not ready";
    case cudaErrorIllegalAddress: return "an illegal memory access was encountered";
    case cudaErrorStreamCaptureUnsupported: return "operation not permitted when stream is capturing";
    case cudaErrorStreamCaptureInvalidated: return "operation failed due to a previous error during capture";
    default: return "unrecognized error code";
    }
}

EXPORT int cudaGetLastError(void)
{
    int err = t_last_error;
    t_last_error = cudaSuccess;
    return err;
}

EXPORT int cudaDeviceSynchronize(void)
{
    pthread_mutex_lock(&g_lock);
    g_count.device_syncs++;
    wait_all();
    pthread_mutex_unlock(&g_lock);
    return cudaSuccess;
}

/* ---------------------------------------------------------------- memory */

static int allocate(void **p, size_t n, int device)
{
    if (!p)
        return fail(cudaErrorInvalidValue);
    /* Round up so aligned_alloc accepts the size; never allocate zero bytes. */
    size_t align = device ? 256 : 4096;
    size_t bytes = n ? n : 1;
    bytes = (bytes + align - 1) / align * align;
    void *mem = aligned_alloc(align, bytes);
    if (!mem)
        return fail(cudaErrorMemoryAllocation);
    pthread_mutex_lock(&g_lock);
    int ok = add_range(mem, n, device);
    if (ok) {
        if (device)
            g_count.device_allocs++;
        else
            g_count.host_allocs++;
    }
    pthread_mutex_unlock(&g_lock);
    if (!ok) {
        free(mem);
        return fail(cudaErrorMemoryAllocation);
    }
    *p = mem;
    return cudaSuccess;
}

static int release(void *p, int device)
{
    if (!p)
        return cudaSuccess;
    pthread_mutex_lock(&g_lock);
    wait_all(); /* like CUDA, freeing synchronizes: no queued copy may touch freed memory */
    int ok = remove_range(p, device);
    if (ok) {
        if (device)
            g_count.device_frees++;
        else
            g_count.host_frees++;
    }
    pthread_mutex_unlock(&g_lock);
    if (!ok)
        return fail(cudaErrorInvalidValue);
    free(p);
    return cudaSuccess;
}

EXPORT int cudaMalloc(void **p, size_t n) { return allocate(p, n, 1); }
EXPORT int cudaFree(void *p) { return release(p, 1); }

EXPORT int cudaHostAlloc(void **p, size_t n, unsigned flags)
{
    (void)flags; /* portable / mapped / write-combined: all the same here */
    return allocate(p, n, 0);
}

EXPORT int cudaFreeHost(void *p) { return release(p, 0); }

/* ---------------------------------------------------------------- streams */

EXPORT int cudaStreamCreateWithFlags(void **stream, unsigned flags)
{
    if (!stream)
        return fail(cudaErrorInvalidValue);
    struct stream *s = calloc(1, sizeof *s);
    if (!s)
        return fail(cudaErrorMemoryAllocation);
    pthread_cond_init(&s->work, NULL);
    s->blocking = !(flags & 1u); /* cudaStreamNonBlocking */
    pthread_mutex_lock(&g_lock);
    if (!ensure_worker(s)) {
        pthread_mutex_unlock(&g_lock);
        pthread_cond_destroy(&s->work);
        free(s);
        return fail(cudaErrorMemoryAllocation);
    }
    s->next = g_streams;
    g_streams = s;
    g_count.streams_created++;
    pthread_mutex_unlock(&g_lock);
    *stream = s;
    return cudaSuccess;
}

EXPORT int cudaStreamDestroy(void *stream)
{
    pthread_mutex_lock(&g_lock);
    struct stream *s = find_stream(stream);
    if (!s || s == &g_legacy) {
        pthread_mutex_unlock(&g_lock);
        return fail(cudaErrorInvalidResourceHandle);
    }
    /* Pending work still runs; the worker frees the stream once it is done. */
    s->destroyed = 1;
    pthread_cond_signal(&s->work);
    pthread_mutex_unlock(&g_lock);
    return cudaSuccess;
}

EXPORT int cudaStreamSynchronize(void *stream)
{
    pthread_mutex_lock(&g_lock);
    struct stream *s = find_stream(stream);
    if (!s) {
        pthread_mutex_unlock(&g_lock);
        return fail(cudaErrorInvalidResourceHandle);
    }
    if (s->capture != CAPTURE_NONE) {
        g_count.capture_violations++;
        s->capture = CAPTURE_INVALIDATED;
        pthread_mutex_unlock(&g_lock);
        return fail(cudaErrorStreamCaptureUnsupported);
    }
    g_count.stream_syncs++;
    wait_stream(s);
    pthread_mutex_unlock(&g_lock);
    return cudaSuccess;
}

EXPORT int cudaStreamQuery(void *stream)
{
    pthread_mutex_lock(&g_lock);
    struct stream *s = find_stream(stream);
    int err = !s ? cudaErrorInvalidResourceHandle : busy(s) ? cudaErrorNotReady : cudaSuccess;
    pthread_mutex_unlock(&g_lock);
    /* Like CUDA, "not ready" is a status, not an error: it is not recorded as the last error. */
    return err == cudaErrorNotReady ? err : fail(err);
}

EXPORT int cudaStreamWaitEvent(void *stream, void *event, unsigned flags)
{
    (void)flags;
    pthread_mutex_lock(&g_lock);
    struct stream *s = find_stream(stream);
    struct event *e = find_event(event);
    int err = cudaSuccess;
    if (!s || !e) {
        err = cudaErrorInvalidResourceHandle;
    } else {
        g_count.stream_wait_events++;
        if (e->m && !e->m->done) { /* otherwise there is nothing to wait for */
            struct op *op = calloc(1, sizeof *op);
            if (!op) {
                err = cudaErrorMemoryAllocation;
            } else {
                *op = (struct op){.kind = OP_WAIT, .m = e->m};
                e->m->refs++;
                err = enqueue(s, op);
                if (err)
                    e->m->refs--;
            }
        }
    }
    pthread_mutex_unlock(&g_lock);
    return fail(err);
}

/* ---------------------------------------------------------------- events */

EXPORT int cudaEventCreateWithFlags(void **event, unsigned flags)
{
    (void)flags; /* timing, blocking sync, interprocess: all irrelevant here */
    if (!event)
        return fail(cudaErrorInvalidValue);
    struct event *e = calloc(1, sizeof *e);
    if (!e)
        return fail(cudaErrorMemoryAllocation);
    pthread_mutex_lock(&g_lock);
    e->next = g_events;
    g_events = e;
    g_count.events_created++;
    pthread_mutex_unlock(&g_lock);
    *event = e;
    return cudaSuccess;
}

EXPORT int cudaEventDestroy(void *event)
{
    pthread_mutex_lock(&g_lock);
    int found = 0;
    for (struct event **p = &g_events; *p; p = &(*p)->next) {
        if (*p == event) {
            struct event *e = *p;
            *p = e->next;
            marker_unref(e->m); /* a pending record still completes; it holds its own ref */
            free(e);
            found = 1;
            break;
        }
    }
    pthread_mutex_unlock(&g_lock);
    return found ? cudaSuccess : fail(cudaErrorInvalidResourceHandle);
}

EXPORT int cudaEventRecord(void *event, void *stream)
{
    pthread_mutex_lock(&g_lock);
    struct stream *s = find_stream(stream);
    struct event *e = find_event(event);
    int err = cudaSuccess;
    struct op *op = NULL;
    struct marker *m = NULL;
    if (!s || !e) {
        err = cudaErrorInvalidResourceHandle;
    } else if (!(op = calloc(1, sizeof *op)) || !(m = marker_new())) {
        free(op);
        err = cudaErrorMemoryAllocation;
    } else {
        m->refs = 2; /* the event's and the record operation's */
        *op = (struct op){.kind = OP_RECORD, .m = m};
        err = enqueue(s, op);
        if (err) {
            free(m);
        } else { /* re-recording replaces what the event stands for */
            marker_unref(e->m);
            e->m = m;
        }
    }
    pthread_mutex_unlock(&g_lock);
    return fail(err);
}

EXPORT int cudaEventQuery(void *event)
{
    pthread_mutex_lock(&g_lock);
    struct event *e = find_event(event);
    int err = !e                   ? cudaErrorInvalidResourceHandle
              : e->m && !e->m->done ? cudaErrorNotReady
                                    : cudaSuccess;
    pthread_mutex_unlock(&g_lock);
    return err == cudaErrorNotReady ? err : fail(err);
}

EXPORT int cudaEventSynchronize(void *event)
{
    pthread_mutex_lock(&g_lock);
    struct event *e = find_event(event);
    if (!e) {
        pthread_mutex_unlock(&g_lock);
        return fail(cudaErrorInvalidResourceHandle);
    }
    g_count.event_syncs++;
    if (g_fail_event_syncs > 0 && g_pass_event_syncs > 0) {
        g_pass_event_syncs--;
    } else if (g_fail_event_syncs > 0) { /* an injected fault (fakecuda_fail_event_syncs) */
        g_fail_event_syncs--;
        pthread_mutex_unlock(&g_lock);
        return fail(cudaErrorIllegalAddress);
    }
    struct marker *m = e->m;
    if (m) {
        m->refs++; /* the event may be re-recorded or destroyed while we wait */
        while (!m->done)
            pthread_cond_wait(&g_done, &g_lock);
        marker_unref(m);
    }
    pthread_mutex_unlock(&g_lock);
    return cudaSuccess;
}

/* ---------------------------------------------------------------- copies */

/* Check a copy against its kind, enqueue it on s and count it. Called with g_lock held. */
static int copy_locked(struct stream *s, void *dst, const void *src, size_t n, int kind,
                       int async)
{
    if (n == 0)
        return cudaSuccess; /* nothing to copy: a no-op, not counted */
    int src_dev = inside(src, n, 1), dst_dev = inside(dst, n, 1);
    int ok;
    switch (kind) {
    case H2H: ok = !touches_device(src, n) && !touches_device(dst, n); break;
    case H2D: ok = dst_dev && !touches_device(src, n); break;
    case D2H: ok = src_dev && !touches_device(dst, n); break;
    case D2D: ok = src_dev && dst_dev; break;
    case DEFAULT_KIND:
        ok = (src_dev || !touches_device(src, n)) && (dst_dev || !touches_device(dst, n));
        kind = src_dev ? (dst_dev ? D2D : D2H) : (dst_dev ? H2D : H2H);
        break;
    default: ok = 0;
    }
    if (!ok) {
        g_count.bad_copies++;
        return cudaErrorInvalidValue;
    }
    const void *host = kind == H2D ? src : kind == D2H ? dst : NULL;
    struct op *op = calloc(1, sizeof *op);
    if (!op)
        return cudaErrorMemoryAllocation;
    *op = (struct op){.kind = OP_COPY, .copy_kind = kind, .dst = dst, .src = src, .n = n,
                      .delay_us = env_uint("FAKECUDA_COPY_DELAY_US", 0) +
                                  (kind == H2D ? env_uint("FAKECUDA_H2D_DELAY_US", 0) : 0)};
    int err = enqueue(s, op);
    if (err)
        return err;
    if (kind == D2H) {
        g_count.d2h_copies++;
        g_count.d2h_bytes += n;
    } else if (kind == H2D) {
        g_count.h2d_copies++;
        g_count.h2d_bytes += n;
    } else if (kind == D2D) {
        g_count.d2d_copies++;
    }
    if (async && host && !inside(host, n, 0))
        g_count.pageable_async_copies++;
    return cudaSuccess;
}

EXPORT int cudaMemcpyAsync(void *dst, const void *src, size_t n, int kind, void *stream)
{
    pthread_mutex_lock(&g_lock);
    struct stream *s = find_stream(stream);
    int err = s ? copy_locked(s, dst, src, n, kind, 1) : cudaErrorInvalidResourceHandle;
    pthread_mutex_unlock(&g_lock);
    return fail(err);
}

EXPORT int cudaMemcpy(void *dst, const void *src, size_t n, int kind)
{
    pthread_mutex_lock(&g_lock);
    int err = copy_locked(&g_legacy, dst, src, n, kind, 0);
    if (!err)
        wait_stream(&g_legacy); /* synchronous with respect to the host */
    pthread_mutex_unlock(&g_lock);
    return fail(err);
}

EXPORT int cudaMemset(void *dst, int value, size_t n)
{
    pthread_mutex_lock(&g_lock);
    int err = inside(dst, n, 1) ? cudaSuccess : cudaErrorInvalidValue;
    if (!err) {
        wait_stream(&g_legacy); /* ordered on the legacy stream, synchronous for the host */
        memset(dst, value, n);
    }
    pthread_mutex_unlock(&g_lock);
    return fail(err);
}

/* ---------------------------------------------------------------- stream capture
 *
 * Enough of CUDA graph capture to test that nothing is queued on a capturing stream: begin
 * marks the stream, cudaStreamIsCapturing reports it, any work queued on it or a host wait for
 * it invalidates the capture (counted), and end returns no graph (NULL) with the status.
 */

EXPORT int cudaStreamBeginCapture(void *stream, int mode)
{
    (void)mode;
    pthread_mutex_lock(&g_lock);
    struct stream *s = find_stream(stream);
    int err = cudaSuccess;
    if (!s || s == &g_legacy)
        err = s ? cudaErrorStreamCaptureUnsupported : cudaErrorInvalidResourceHandle;
    else if (s->capture != CAPTURE_NONE)
        err = cudaErrorInvalidValue;
    else
        s->capture = CAPTURE_ACTIVE;
    pthread_mutex_unlock(&g_lock);
    return fail(err);
}

EXPORT int cudaStreamEndCapture(void *stream, void **graph)
{
    pthread_mutex_lock(&g_lock);
    struct stream *s = find_stream(stream);
    int err = cudaSuccess;
    if (!s || s->capture == CAPTURE_NONE)
        err = s ? cudaErrorInvalidValue : cudaErrorInvalidResourceHandle;
    else {
        err = s->capture == CAPTURE_INVALIDATED ? cudaErrorStreamCaptureInvalidated : cudaSuccess;
        s->capture = CAPTURE_NONE;
    }
    pthread_mutex_unlock(&g_lock);
    if (graph)
        *graph = NULL;
    return fail(err);
}

EXPORT int cudaStreamIsCapturing(void *stream, int *status)
{
    if (!status)
        return fail(cudaErrorInvalidValue);
    pthread_mutex_lock(&g_lock);
    struct stream *s = find_stream(stream);
    if (s)
        *status = s->capture;
    pthread_mutex_unlock(&g_lock);
    return fail(s ? cudaSuccess : cudaErrorInvalidResourceHandle);
}

/* ---------------------------------------------------------------- test helpers (not CUDA) */

/* Record the next `capacity` copies (0: stop and forget the log); 0, or an allocation error. */
EXPORT int fakecuda_log_copies(size_t capacity)
{
    pthread_mutex_lock(&g_lock);
    free(g_log);
    g_log = capacity ? calloc(capacity, sizeof *g_log) : NULL;
    g_log_capacity = g_log ? capacity : 0;
    g_log_used = 0;
    pthread_mutex_unlock(&g_lock);
    return capacity && !g_log ? cudaErrorMemoryAllocation : cudaSuccess;
}

/* Copy up to `max` records of the log into out; returns how many there are. */
EXPORT size_t fakecuda_copy_log(struct copy_record *out, size_t max)
{
    pthread_mutex_lock(&g_lock);
    size_t n = g_log_used < max ? g_log_used : max;
    if (n)
        memcpy(out, g_log, n * sizeof *out);
    n = g_log_used;
    pthread_mutex_unlock(&g_lock);
    return n;
}

/* After `after` more successful cudaEventSynchronize calls (any thread), make the next n
 * fail with cudaErrorIllegalAddress. */
EXPORT void fakecuda_fail_event_syncs(int n, int after)
{
    pthread_mutex_lock(&g_lock);
    g_fail_event_syncs = n;
    g_pass_event_syncs = after;
    pthread_mutex_unlock(&g_lock);
}

/* What a pointer points into: 1 device memory (cudaMalloc), 2 pinned host memory
 * (cudaHostAlloc), 0 anything else. For a fake MPI that records what it is handed. */
EXPORT int fakecuda_pointer_kind(const void *p)
{
    pthread_mutex_lock(&g_lock);
    int kind = inside(p, 1, 1) ? 1 : inside(p, 1, 0) ? 2 : 0;
    pthread_mutex_unlock(&g_lock);
    return kind;
}

EXPORT void fakecuda_get_counters(struct fakecuda_counters *out)
{
    pthread_mutex_lock(&g_lock);
    *out = g_count;
    pthread_mutex_unlock(&g_lock);
}

EXPORT void fakecuda_reset_counters(void)
{
    pthread_mutex_lock(&g_lock);
    memset(&g_count, 0, sizeof g_count);
    pthread_mutex_unlock(&g_lock);
}

/* sizeof(struct fakecuda_counters), so that bindings can check their copy of the layout. */
EXPORT size_t fakecuda_counters_size(void) { return sizeof(struct fakecuda_counters); }

/* A "kernel" on `stream`: after delay_us, write the n bytes src held at enqueue time to dst.
 * Not counted as a copy, and dst is not checked (it may be any memory). */
EXPORT int fakecuda_launch_write(void *stream, void *dst, const void *src, size_t n,
                                 unsigned delay_us)
{
    if (n && (!dst || !src))
        return fail(cudaErrorInvalidValue);
    void *copy = malloc(n ? n : 1);
    struct op *op = calloc(1, sizeof *op);
    if (!copy || !op) {
        free(copy);
        free(op);
        return fail(cudaErrorMemoryAllocation);
    }
    if (n)
        memcpy(copy, src, n);
    *op = (struct op){.kind = OP_WRITE, .dst = dst, .n = n, .delay_us = delay_us, .owned = copy};
    pthread_mutex_lock(&g_lock);
    struct stream *s = find_stream(stream);
    int err;
    if (!s) {
        free(copy);
        free(op);
        err = cudaErrorInvalidResourceHandle;
    } else {
        err = enqueue(s, op);
    }
    pthread_mutex_unlock(&g_lock);
    return fail(err);
}

/* Wait until every stream is idle. Unlike cudaDeviceSynchronize, not counted. */
EXPORT void fakecuda_quiesce(void)
{
    pthread_mutex_lock(&g_lock);
    wait_all();
    pthread_mutex_unlock(&g_lock);
}

/* ---------------------------------------------------------------- DLPack exports (not CUDA)
 *
 * For the DLPack producer of the Python test module (fakecuda/__init__.py). Its deleter and
 * capsule destructor are C functions, not Python callbacks: consumers call the deleter from
 * any thread, and CPython runs capsule destructors even while an exception is pending, when a
 * Python callback would replace that exception with a SystemError.
 *
 * Each managed tensor (DLManagedTensor or DLManagedTensorVersioned) is preceded in memory by a
 * uint64 release count; the deleter increments it and Python frees the export's resources once
 * it sees it nonzero.
 */

/* Resolved from the Python process that loads us; weak, so that a plain C program can load
 * the library too (and then never calls the destructor). */
extern const char *PyCapsule_GetName(void *capsule) __attribute__((weak));
extern void *PyCapsule_GetPointer(void *capsule, const char *name) __attribute__((weak));

/* The DLPack deleter of every export. */
EXPORT void fakecuda_dlpack_deleter(void *managed)
{
    if (managed)
        atomic_fetch_add((_Atomic uint64_t *)managed - 1, 1);
}

/* The PyCapsule destructor: release the tensor unless a consumer took it (and renamed the
 * capsule used_dltensor*), after which calling the deleter is the consumer's job. */
EXPORT void fakecuda_dlpack_capsule_destructor(void *capsule)
{
    if (!PyCapsule_GetName || !PyCapsule_GetPointer)
        return;
    const char *name = PyCapsule_GetName(capsule);
    if (name && (!strcmp(name, "dltensor") || !strcmp(name, "dltensor_versioned")))
        fakecuda_dlpack_deleter(PyCapsule_GetPointer(capsule, name));
}
