/* 16-feature column panels, the weight layout of the float32, bfloat16 and int8 panel linears:
 * for each block of 16 output features a [K][16] slab (the 16 features' weights for k =
 * 0..K-1 side by side, the last panel zero-padded). Internal. */
#ifndef KVSEAL_PANELS_H
#define KVSEAL_PANELS_H

#include "vec.h"

/* Store MR rows of a 16-wide result block (nr <= 16 valid columns), adding the bias if any. */
static inline void store_block(float *y, int64_t ldy, const v8 *a0, const v8 *a1, int mr, int64_t nr,
                               const float *bias) {
    v8 b0 = {0}, b1 = {0};
    if (bias != NULL) {
        float bb[16] = {0};
        memcpy(bb, bias, sizeof(float) * nr);
        b0 = load8(bb);
        b1 = load8(bb + 8);
    }
    for (int i = 0; i < mr; i++) {
        if (nr == 16) {
            store8(y + i * ldy, a0[i] + b0);
            store8(y + i * ldy + 8, a1[i] + b1);
        } else {
            float t[16];
            store8(t, a0[i] + b0);
            store8(t + 8, a1[i] + b1);
            memcpy(y + i * ldy, t, sizeof(float) * nr);
        }
    }
}

#endif
