// The tile skipping of the CUDA block kernels (kernels/attention_block_tiles.h)
// on the CPU, against a brute-force scan of the visible (query, key) pairs of
// kernels/attention_block.h's rule. The kernels themselves need a GPU
// (test_cuda_ops "[cp]"); what they skip is decided by these functions, so a
// wrong rule shows here as a skipped tile that holds a visible pair (a
// dropped term) or a computed tile that holds none (wasted work).
#include <catch2/catch.hpp>

#include <algorithm>
#include <random>
#include <vector>

#include "kernels/attention_block_tiles.h"

using namespace trainrun;
using block_tiles::kTile;

namespace {

struct Block {
  int Tq, Tk, q_pos0, k_pos0, window;
  std::vector<int> doc;  // per query row: the global start of its document (<= its position)
  // The reference: kernels/attention_block.h's rule, written out here.
  bool sees(int i, int j) const {
    const int kpos = k_pos0 + j, qpos = q_pos0 + i;
    return kpos >= doc[i] && kpos <= qpos && (window == 0 || kpos >= qpos - window + 1);
  }
  // The kernels' first position (block_tiles::first_pos), what they skip by.
  int first(int i) const { return block_tiles::first_pos(doc[i], q_pos0 + i, window); }
  // Whether query tile qt and key tile kt hold a visible pair.
  bool tile_visible(int qt, int kt) const {
    for (int i = qt * kTile; i < std::min(Tq, (qt + 1) * kTile); ++i)
      for (int j = kt * kTile; j < std::min(Tk, (kt + 1) * kTile); ++j)
        if (sees(i, j)) return true;
    return false;
  }
  // The forward / dq kernels' key tiles of query tile qt.
  block_tiles::TileRange range(int qt) const {
    int mn = first(qt * kTile);
    for (int i = qt * kTile; i < std::min(Tq, (qt + 1) * kTile); ++i) mn = std::min(mn, first(i));
    return block_tiles::key_tiles(mn, q_pos0 + std::min(Tq, (qt + 1) * kTile) - 1, k_pos0, Tk);
  }
  // The dk/dv kernel computes (query tile, key tile) iff a row reaches the key tile.
  bool dkv_computes(int qt, int kt) const {
    const int kp0 = k_pos0 + kt * kTile, kp1 = k_pos0 + std::min(Tk, (kt + 1) * kTile) - 1;
    for (int i = qt * kTile; i < std::min(Tq, (qt + 1) * kTile); ++i)
      if (block_tiles::row_reaches(q_pos0 + i, first(i), kp0, kp1)) return true;
    return false;
  }
  // Tiles the forward computes, in all.
  int forward_tiles() const {
    int n = 0;
    for (int qt = 0; qt * kTile < Tq; ++qt) n += range(qt).end - range(qt).begin;
    return n;
  }
};

int tiles(int n) { return (n + kTile - 1) / kTile; }

}  // namespace

TEST_CASE("cp kernels: the block kernels skip exactly the tiles with no visible pair (random blocks, "
          "documents, windows)",
          "[cp][cpu_ops]") {
  std::mt19937 gen(7);
  int checked = 0, skipped = 0;
  for (int trial = 0; trial < 300; ++trial) {
    Block b;
    b.Tq = 1 + int(gen() % 200), b.Tk = 1 + int(gen() % 200);
    b.q_pos0 = int(gen() % 400), b.k_pos0 = int(gen() % 400);
    b.window = trial % 3 == 0 ? 1 + int(gen() % 150) : 0;
    // Documents: none, non-decreasing (a packed sequence), or any start <=
    // the row's position (the op takes any; the old CUDA test uses such).
    b.doc.resize(b.Tq);
    int start = 0;
    for (int i = 0; i < b.Tq; ++i) {
      const int qpos = b.q_pos0 + i;
      if (trial % 4 == 1 && gen() % 40 == 0) start = qpos;
      b.doc[i] = trial % 4 == 0 ? 0 : trial % 4 == 1 ? start : int(gen() % (qpos + 1));
    }
    for (int qt = 0; qt < tiles(b.Tq); ++qt) {
      const block_tiles::TileRange r = b.range(qt);
      REQUIRE(r.begin <= r.end);
      for (int kt = 0; kt < tiles(b.Tk); ++kt) {
        const bool vis = b.tile_visible(qt, kt), fwd = kt >= r.begin && kt < r.end;
        INFO("trial " << trial << ": Tq " << b.Tq << " Tk " << b.Tk << " q_pos0 " << b.q_pos0 << " k_pos0 "
                      << b.k_pos0 << " window " << b.window << ", query tile " << qt << ", key tile " << kt);
        // The forward's range is exact: the rows' visible ranges [first, qpos]
        // are contiguous in union (qpos grows by 1 and first <= qpos).
        CHECK(fwd == vis);
        CHECK(b.dkv_computes(qt, kt) == vis);
        ++checked;
        skipped += !vis;
      }
      CHECK(r.end <= tiles(b.Tk));
    }
  }
  std::printf("  %d (query tile, key tile) pairs checked, %d skipped\n", checked, skipped);
  CHECK(skipped > checked / 10);  // the draws do exercise skipping
  CHECK(skipped < checked);
}

TEST_CASE("cp kernels: tiles computed for a 200-row chunk against K/V before, at and after it", "[cp][cpu_ops]") {
  const int Tc = 200, nt = tiles(Tc);  // 4 tiles, the last partial
  auto block = [&](int k_pos0, std::vector<int> doc, int window) {
    return Block{Tc, Tc, 2 * Tc, k_pos0, window, std::move(doc)};
  };
  const std::vector<int> none(Tc, 0), edge(Tc, 2 * Tc);  // edge: a document starts on the chunk's first row
  CHECK(block(0, none, 0).forward_tiles() == nt * nt);             // before: every tile
  CHECK(block(2 * Tc, none, 0).forward_tiles() == nt * (nt + 1) / 2);  // the diagonal: nt(nt-1)/2 = 6 skipped
  CHECK(block(3 * Tc, none, 0).forward_tiles() == 0);              // after: none
  CHECK(block(0, edge, 0).forward_tiles() == 0);                   // before the chunk's only document: none
  CHECK(block(2 * Tc, edge, 0).forward_tiles() == nt * (nt + 1) / 2);
  // A window of 64 at the diagonal: query tile t sees key tiles t-1 and t
  // only (its rows reach 63 back), so 1 + 2 + 2 + 2 of the 16.
  CHECK(block(2 * Tc, none, 64).forward_tiles() == 7);
  // The chunk before (keys 200..399) with a window of 100: query tile 0
  // (rows 400..463, reaching back to 301..364) sees key tiles 1-3, query
  // tile 1 (464..527: 365..428) tiles 2-3, the others none: 5 of 16.
  CHECK(block(Tc, none, 100).forward_tiles() == 5);
}
