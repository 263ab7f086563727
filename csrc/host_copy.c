/* Many host-memory copies in one call: the copies of a weight publisher's small tensors into its
 * pack, and of a subscriber's staging slot into its live tensors. A Python loop, numpy or torch
 * spends a third of a microsecond or more per copy before it moves a byte; here a copy costs its
 * memcpy. Loaded with ctypes (transport/host_copy.py), which lets go of the GIL for the call.
 *
 * Built at install time as transport._host_copy (setup.py); where no C compiler is there, the
 * library copies with torch and numpy instead. */
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#define MAX_THREADS 16

struct span {
    const uint64_t *dst, *src, *nbytes;
    int64_t first, end;
};

static void *copy_span(void *arg)
{
    const struct span *s = arg;
    for (int64_t i = s->first; i < s->end; i++)
        memcpy((void *)(uintptr_t)s->dst[i], (const void *)(uintptr_t)s->src[i], s->nbytes[i]);
    return NULL;
}

/* Copy nbytes[i] bytes from src[i] to dst[i] for every i < count, on up to `threads` threads,
 * each taking a run of consecutive copies of about the same number of bytes. Returns 0, or -1 if
 * a thread could not be started (its copies are then done on the calling thread). */
int transport_host_copy(const uint64_t *dst, const uint64_t *src, const uint64_t *nbytes,
                        int64_t count, int threads)
{
    if (threads > MAX_THREADS)
        threads = MAX_THREADS;
    if (threads < 2 || count < 2) {
        struct span all = {dst, src, nbytes, 0, count};
        copy_span(&all);
        return 0;
    }
    uint64_t total = 0;
    for (int64_t i = 0; i < count; i++)
        total += nbytes[i];
    struct span spans[MAX_THREADS];
    pthread_t ids[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    int n = 0, failed = 0;
    int64_t i = 0;
    uint64_t done = 0;
    for (int t = 0; t < threads && i < count; t++) {
        uint64_t goal = total / (uint64_t)threads * (uint64_t)(t + 1);
        int64_t first = i;
        if (t == threads - 1)
            i = count;
        else
            while (i < count && (done < goal || i == first))
                done += nbytes[i++];
        spans[n] = (struct span){dst, src, nbytes, first, i};
        n++;
    }
    for (int t = 1; t < n; t++) {
        if (pthread_create(&ids[t], NULL, copy_span, &spans[t]) == 0)
            started[t] = 1;
        else
            failed = 1;
    }
    copy_span(&spans[0]);
    for (int t = 1; t < n; t++) {
        if (started[t])
            pthread_join(ids[t], NULL);
        else
            copy_span(&spans[t]);
    }
    return failed ? -1 : 0;
}
