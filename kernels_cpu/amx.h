// AMX tile configuration, shared by the kernels that run on AMX tiles (gemv_bf16.cc, gemv_quant.cc).
#pragma once

#include <immintrin.h>
#include <cstdint>

#include "cpu_features.h"

namespace peagle {

struct TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Tiles for a [rows, 16 pairs] x [16 pairs, 32 columns] product: tile 0 the inputs (rows x 16
// bf16 pairs), tiles 1 and 2 the weights' columns 0-15 and 16-31 (16 pairs x 16 columns x 2),
// tiles 3 and 4 their float32 sums (rows x 16).
PEAGLE_AMX inline void amx_configure(int64_t rows) {
  TileConfig cfg{};
  cfg.palette = 1;
  const uint8_t r = static_cast<uint8_t>(rows);
  cfg.rows[0] = r; cfg.colsb[0] = 64;
  cfg.rows[1] = 16; cfg.colsb[1] = 64;
  cfg.rows[2] = 16; cfg.colsb[2] = 64;
  cfg.rows[3] = r; cfg.colsb[3] = 64;
  cfg.rows[4] = r; cfg.colsb[4] = 64;
  // GCC does not treat LDTILECFG as reading `cfg`, and drops the stores above without this.
  __asm__ __volatile__("" : : "r"(&cfg) : "memory");
  _tile_loadconfig(&cfg);
}

PEAGLE_AMX inline void amx_release() { _tile_release(); }

}  // namespace peagle
