/* The one runtime dispatch of the library: whether the tile linears (and the attention
 * kernels' AMX paths) run on AMX or on AVX512-BF16 dot products. Everything else is chosen at
 * compile time (isa.h): the library is built for the host's CPU. A build that targets AMX
 * still needs the kernel's permission for tile data, per process, which a container or an old
 * kernel may refuse; then the same tiles run on the dot products. */
#include "kvseal_ops.h"
#include "tiles.h"

#if KVSEAL_AMX
#include <sys/syscall.h>
#include <unistd.h>
#endif

int kvseal_amx_permitted = 0, kvseal_amx_linears = 0;

#if KVSEAL_AVX512BF16
int kvseal_tiles_init(void) {
#if KVSEAL_AMX
    kvseal_amx_permitted = syscall(SYS_arch_prctl, 0x1023, 18) == 0; /* ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA */
#endif
    kvseal_amx_linears = kvseal_amx_permitted;
    return kvseal_amx_linears ? KVSEAL_TILES_AMX : KVSEAL_TILES_AVX512;
}

int kvseal_tiles_engine(int engine) {
    kvseal_amx_linears = engine == KVSEAL_TILES_AMX && kvseal_amx_permitted;
    return kvseal_amx_linears ? KVSEAL_TILES_AMX : KVSEAL_TILES_AVX512;
}
#else
int kvseal_tiles_init(void) { return KVSEAL_TILES_NONE; }
int kvseal_tiles_engine(int engine) {
    (void)engine;
    return KVSEAL_TILES_NONE;
}
#endif
