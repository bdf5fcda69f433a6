// Which 64 x 64 tiles of an attention block (kernels/attention_block.h) the
// CUDA block kernels compute (kernels/cuda/attention_block.cu), as plain
// functions of positions, host and device, so that the CPU tests check the
// skipping against a brute-force scan of the visible (query, key) pairs:
// a skipped tile must hold no visible pair (else the kernels would drop
// terms), and the tiles computed are the ones the comments count.
//
// Positions are global: query row i at q_pos0 + i, key row j at k_pos0 + j;
// row i sees keys [first(i), q_pos0 + i], first(i) = max(doc(i), q_pos0 + i -
// window + 1) (the window term only with window > 0).
#pragma once

#if defined(__CUDACC__)
#define TR_BLOCK_TILES_HD __host__ __device__
#else
#define TR_BLOCK_TILES_HD
#endif

namespace trainrun::block_tiles {

constexpr int kTile = 64;  // rows per tile: the CUDA kernels' kTile (static_assert there)

// The first global key position a query row at `qpos` sees.
TR_BLOCK_TILES_HD inline int first_pos(int doc, int qpos, int window) {
  const int w = qpos - window + 1;
  return window > 0 && w > doc ? w : doc;
}

// The key tiles [begin, end) of a block of Tk keys at k_pos0 that the query
// tile may see: from the tile of the smallest first position of its rows
// (`min_first`: a min, because the op takes any per-row document starts) to
// the tile of its last row's diagonal (`last_qpos`). Empty ({0, 0})
// when the block's keys all lie after the tile's queries or before all of
// their first positions.
struct TileRange {
  int begin = 0, end = 0;
};
TR_BLOCK_TILES_HD inline TileRange key_tiles(int min_first, int last_qpos, int k_pos0, int Tk) {
  int jlo = min_first - k_pos0, jhi = last_qpos - k_pos0;
  if (jlo < 0) jlo = 0;
  if (jhi > Tk - 1) jhi = Tk - 1;
  TileRange r;  // empty: {0, 0}
  if (jlo <= jhi) r.begin = jlo / kTile, r.end = jhi / kTile + 1;
  return r;
}

// Whether a query row (at qpos, first position `first`) sees some key of a
// key tile spanning global positions [kp0, kp1]: exact, as first <= qpos.
// The dk/dv kernel computes a query tile iff one of its rows does.
TR_BLOCK_TILES_HD inline bool row_reaches(int qpos, int first, int kp0, int kp1) { return qpos >= kp0 && first <= kp1; }

}  // namespace trainrun::block_tiles
