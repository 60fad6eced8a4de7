// The packed kernels' activations: one row of K values (float32, or bf16 bits) rounded to int8 per block of QK
// (the includer defines QK): q = round(v * 127 / amax) to nearest even, clamped to [-127, 127]; d[b] = amax / 127,
// s[b] = d[b] * sum(q), and the integer sum itself in sums[b] when `sums` is given (the AVX2 tiled kernel's int8
// offset). Scalar: quant_matmul.c at every level and the AVX2 tiled kernel (quant_tiled_avx2.h) call it; the
// AVX-512 tiled kernel (quant_tiled.c) vectorizes the same arithmetic.

#ifndef RADIXSERVE_QUANT_ACTIVATIONS_H
#define RADIXSERVE_QUANT_ACTIVATIONS_H

#include <math.h>
#include <stdint.h>
#include <string.h>

static void quantize_row(const void *x, int bf16, int64_t K, int8_t *q, float *d, float *s, int32_t *sums) {
    for (int64_t b = 0; b < K / QK; b++) {
        float v[QK], amax = 0.0f;
        for (int j = 0; j < QK; j++) {
            const int64_t i = b * QK + j;
            if (bf16) {
                const uint32_t bits = (uint32_t)((const uint16_t *)x)[i] << 16;
                memcpy(&v[j], &bits, 4);
            } else {
                v[j] = ((const float *)x)[i];
            }
            amax = fabsf(v[j]) > amax ? fabsf(v[j]) : amax;
        }
        const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        int32_t sum = 0;
        for (int j = 0; j < QK; j++) {
            int qi = (int)lrintf(v[j] * inv);
            qi = qi > 127 ? 127 : (qi < -127 ? -127 : qi);
            q[b * QK + j] = (int8_t)qi;
            sum += qi;
        }
        d[b] = amax / 127.0f;
        s[b] = d[b] * (float)sum;
        if (sums) sums[b] = sum;
    }
}

#endif
