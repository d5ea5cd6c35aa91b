// AMX tiles, for the kernels that use them (quant_ops.cpp: int8 tiles for block-quantized linears;
// extend_attention.cpp: bf16 tiles for prefill attention). Linux hands a process the tile state only
// on request (arch_prctl); a refusal, an old kernel or a CPU without the tiles leaves each kernel on
// its other path. A thread configures the tiles it uses at the start of each call and releases them
// at its end, so calls of different kernels never see each other's configuration.
//
// Everything is in an unnamed namespace, as in common.h: each translation unit gets its own copy.
#pragma once

#if defined(__AMX_TILE__) && defined(__AVX512F__) && defined(__linux__)
#define STRATA_AMX 1
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace {

// The tile configuration (palette 1): rows and bytes per row of each of the 8 tile registers.
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};

  void set(int tile, int nrows, int bytes_per_row) {
    rows[tile] = static_cast<uint8_t>(nrows);
    colsb[tile] = static_cast<uint16_t>(bytes_per_row);
  }
  // asm with the whole config as its operand: GCC 12 drops the rows and widths stored before its
  // _tile_loadconfig builtin, which then loads a config of empty tiles
  void load() const { asm volatile("ldtilecfg %0" ::"m"(*this)); }
};

inline void release_tiles() { asm volatile("tilerelease" ::: "memory"); }

// The tile instructions take the tile as a template argument (GCC's intrinsics take only literal
// numbers): "%c" prints the number bare, so "%%tmm%c0" names the register. Each kernel writes its
// own loads and stores in this form, with the memory effects its loop needs.
template <int T>
inline void tile_zero() {
  asm volatile("tilezero %%tmm%c0" ::"i"(T));
}

// Whether the OS grants this process the tile state (asked once per process).
inline bool tiles_permitted() {
  static const bool ok = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

}  // namespace
#endif
