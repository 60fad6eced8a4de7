/* What the AMX kernels share: the tile configuration's layout (palette 1) and the request for the
 * process's AMX state, which Linux grants only when asked (arch_prctl ARCH_REQ_XCOMP_PERM). */
#ifndef RADIXSERVE_AMX_TILES_H
#define RADIXSERVE_AMX_TILES_H

#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

typedef struct {
    uint8_t palette_id;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* 0, or -2 when the OS refuses (an old kernel, or AMX disabled). */
int amx_request(void) { return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 0 : -2; }

/* Tiles 0 .. count - 1 as rows[i] rows of 64 bytes each. */
static inline void configure_tiles(const uint8_t *rows, int count) {
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int i = 0; i < count; i++) {
        cfg.rows[i] = rows[i];
        cfg.colsb[i] = 64;
    }
    _tile_loadconfig(&cfg);
}

#endif
