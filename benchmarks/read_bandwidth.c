/* How fast this machine reads memory: the bound a decode step that streams its weights cannot beat.
 * Built by benchmarks/read_bandwidth.py at the CPU's kernel level, so the compiler vectorises the sum with
 * the widest loads the CPU has; one add per loaded word keeps the loads, not the arithmetic, the limit. */
#include <stdint.h>

double read_sum(const uint64_t *data, int64_t n, int nthreads) {
    uint64_t total = 0;
#pragma omp parallel for simd num_threads(nthreads) schedule(static) reduction(+ : total)
    for (int64_t i = 0; i < n; i++) total += data[i];
    return (double)total;
}
