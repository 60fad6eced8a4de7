/* How fast this machine reads memory: the bound a decode step that streams its weights cannot beat.
 * Built by benchmarks/read_bandwidth.py at the CPU's kernel level, so the compiler vectorises the sums with the
 * widest loads the CPU has; one add per loaded word keeps the loads, not the arithmetic, the limit.
 * NOTE: each thread reads its part of the buffer as STREAMS sequential streams in lockstep, as our one-row GEMV
 * kernels read their weights: on the 2-core AMX Xeon one stream per thread read 24-26.5 GB/s and four 29.3-29.7,
 * and a bound measured with one stream was beaten by those kernels (103% of it). */
#include <omp.h>
#include <stdint.h>
#include <string.h>

#define STREAMS 4
#ifdef __AVX512F__
#define VBYTES 64
#else
#define VBYTES 32 /* AVX2's width (a 64-byte vector there compiled to slower code) */
#endif
#define STEP (VBYTES / 8) /* words of each stream per step */

typedef uint64_t lanes __attribute__((vector_size(VBYTES)));

double read_sum(const uint64_t *data, int64_t n, int nthreads) {
    uint64_t total = 0;
#pragma omp parallel num_threads(nthreads) reduction(+ : total)
    {
        const int64_t threads = omp_get_num_threads(), t = omp_get_thread_num();
        const int64_t lo = n * t / threads, hi = n * (t + 1) / threads, part = (hi - lo) / STREAMS / STEP * STEP;
        lanes sums[STREAMS];
        memset(sums, 0, sizeof sums);
        for (int64_t i = 0; i < part; i += STEP)
            for (int s = 0; s < STREAMS; s++) {
                lanes v;
                memcpy(&v, data + lo + s * part + i, sizeof v);
                sums[s] += v;
            }
        for (int s = 0; s < STREAMS; s++)
            for (int l = 0; l < STEP; l++) total += sums[s][l];
        for (int64_t i = lo + STREAMS * part; i < hi; i++) total += data[i]; /* the rest, one word at a time */
    }
    return (double)total;
}
