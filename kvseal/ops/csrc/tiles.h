/* AMX tile set-up shared by the tile linears and the attention kernels' AMX paths, and the
 * runtime dispatch between AMX and AVX512-BF16 (its state lives in dispatch.c). Internal. */
#ifndef KVSEAL_TILES_H
#define KVSEAL_TILES_H

#include <stdint.h>
#include <string.h>

#include "isa.h"

/* kvseal_amx_permitted: the kernel lets this process use AMX tile data (ARCH_REQ_XCOMP_PERM for
   XFEATURE_XTILEDATA; the permission is per process, so every OpenMP thread has it).
   kvseal_amx_linears: the tile linears (and the prefill kernel's AMX blocks) run on AMX, else
   on AVX512-BF16 dot products. Both 0 until kvseal_tiles_init. */
extern int kvseal_amx_permitted, kvseal_amx_linears;

#if KVSEAL_AMX
struct tile_config {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

/* LDTILECFG reads all 64 bytes (a set reserved byte faults), but GCC 12 does not model that
   read and drops the zeroing stores: the barrier keeps every byte written. */
static inline void load_tile_config(const struct tile_config *c) {
    __asm__ volatile("" : : "m"(*c) : "memory");
    _tile_loadconfig(c);
}

/* Tiles 0-3: C (row tile 0 and 1 of panel p, then of p + 1); 4, 5: A (row tiles 0, 1); 6, 7: B
   (panels p, p + 1). r1 = 0: one row tile, tiles 1, 3, 5 unused. */
static inline void configure_tiles(int r0, int r1) {
    struct tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    const int rows[8] = {r0, r1, r0, r1, r0, r1, 16, 16};
    for (int t = 0; t < 8; t++) {
        c.rows[t] = (uint8_t)rows[t];
        c.colsb[t] = rows[t] ? 64 : 0;
    }
    load_tile_config(&c);
}

static inline void tile_release(void) { _tile_release(); }

/* Tiles 0..count-1 as 16 rows x 64 bytes, the rest unused. */
static inline void configure_full_tiles(int count) {
    struct tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < count; t++) {
        c.rows[t] = 16;
        c.colsb[t] = 64;
    }
    load_tile_config(&c);
}
#else
static inline void configure_tiles(int r0, int r1) {
    (void)r0;
    (void)r1;
}
static inline void tile_release(void) {}
#endif

#endif
