// The frozen base in NF4 (model.base_dtype: nf4, QLoRA): make_nf4_frozen_store
// (frozen_store.h).
//
// What is stored. Each sharding unit is one byte image, in the layout's
// element order: a run of plain tensors (norms, biases, embeddings, the LM
// head: act dtype, as bitsandbytes leaves everything but the Linear4bit
// weights) is its values; an NF4 tensor (a block linear's weight, (out, in)
// flattened: nn.Linear's layout, which is what bitsandbytes quantizes, also
// for GPT-2's Conv1D) is three sections, its packed codes, its qabsmax and
// its absmax2 (kernels/nf4_format.h); its offset is one float on the host.
// Every section starts 16-byte aligned. The image is sharded in bytes like
// any frozen unit: no_shard / shard_grad_op hold all of it, full_shard
// rank g holds bytes [g*S, (g+1)*S) (S = ceil(image / ranks), a multiple of
// 16, so no element and no code byte is split), hybrid_shard the same
// inside its group. An acquire all-gathers the image's bytes (4-bit codes,
// not fp32) and dequantizes the whole unit into an act-dtype buffer (plain
// runs copied, NF4 tensors through Backend::nf4_dequantize); release frees
// both. Held: ~0.516 bytes per NF4 element (1/2 code + 1/64 qabsmax +
// 4/16384 absmax2), act-dtype bytes for the rest.
//
// Equal on any mesh. The numbers are those of quantizing each whole tensor
// on one host (nf4::quantize), because everything that depends on more than
// one element is computed from the whole tensor: load_from reads, per NF4
// tensor, the elements whose codes this rank holds (a 64-block may straddle
// two ranks), takes each touched block's absmax of its part, and the group
// all-reduces (max) the tensor's absmax array (1/64 of the tensor, one
// tensor at a time); every rank then derives the same offset, qabsmax and
// absmax2 (nf4::quantize_absmax) and encodes its own elements against the
// whole blocks' absmaxes. Tensors are keyed by their layout's element
// offsets (tensor-local element e is offset + e): over a pipeline stage's
// layout, where each tensor is whole, the stage store maps them onto the
// model's as it reads (stage_store.cpp), so a stage quantizes as one host
// does.
//
// Tensor parallelism (format.nf4_tp). The layout is a TP rank's local one;
// each NF4 tensor is a slice of a global tensor made of whole 64-blocks of
// it (qlora.h refuses other splits), so a local block is exactly one global
// block and its codes are those of the whole tensor's quantization. The
// double quantization is not: its runs of 256 blocks and its offset are the
// global tensor's, and a row-parallel slice holds a few blocks of every row,
// not a run of them. So the absmax array exchanged is the global tensor's
// (this rank's blocks filled, 0 elsewhere), max-reduced over the shard group
// and then over the TP group (together every rank holding a part); every
// rank derives the global offset, qabsmax and absmax2, encodes its elements
// against their global blocks' absmaxes, and keeps, instead of qabsmax and
// absmax2, each local block's dequantized absmax as fp32 (nf4::block_scale:
// the operations nf4_dequantize runs, so the values are bit-equal), which
// Backend::nf4_dequantize_blocks reads. Held: ~0.5625 bytes per NF4 element
// (1/2 code + 4/64 absmax).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>

#include "core/common/error.h"
#include "kernels/nf4_format.h"
#include "parallel/sharding/frozen_store.h"

namespace trainrun {

namespace {

int64_t align16(int64_t b) { return (b + 15) / 16 * 16; }

class Nf4FrozenStore final : public FrozenStoreBase<LoadingParamStore> {
 public:
  Nf4FrozenStore(const std::string& strategy, const ParamLayout& layout, Backend* be, Communicator* world, int group,
                 const CommFactory& factory, const FrozenFormat& format)
      : strategy_(strategy), layout_(layout), be_(be), codec_(format.codec), act_(be->act_dtype()),
        es_(dtype_size(be->act_dtype())) {
    TR_CHECK(codec_, "nf4 store: no NF4 codec given (a bug)");
    const std::vector<int>& nf4_tensors = format.nf4_tensors;
    const int W = world->world_size(), r = world->rank();
    const bool sharded = strategy == "full_shard" || strategy == "hybrid_shard";
    G_ = !sharded ? 1 : strategy == "hybrid_shard" ? group : W;
    TR_CHECK(G_ >= 1 && W % G_ == 0, "parallel.shard_group_size (", G_, ") must divide the world size (", W, ")");
    g_ = r % G_;
    const int replica = r / G_;
    writes_ = sharded ? replica == 0 : r == 0;
    if (G_ == W && G_ > 1) {
      comm_ = world;
    } else if (G_ > 1) {
      own_ = factory("base_shard" + std::to_string(replica) + "/", g_, G_);
      comm_ = own_.get();
    }
    std::vector<bool> is_nf4(layout.tensors.size(), false);
    for (int t : nf4_tensors) {
      TR_CHECK(t >= 0 && size_t(t) < layout.tensors.size(), "nf4 store: tensor index ", t, " out of range (a bug)");
      is_nf4[size_t(t)] = true;
    }
    // Tensor parallelism: the slice of each NF4 tensor, by layout index.
    std::vector<const Nf4TpSlice*> slice_of(layout.tensors.size(), nullptr);
    if (!format.nf4_tp.empty()) {
      TR_CHECK(format.nf4_tp.size() == nf4_tensors.size() && format.nf4_tp_comm,
               "nf4 store: tensor-parallel slices for ", format.nf4_tp.size(), " of ", nf4_tensors.size(),
               " NF4 tensors, or no TP communicator (a bug)");
      tp_comm_ = format.nf4_tp_comm;
      slices_ = format.nf4_tp;  // the format may be a temporary; Quant::slice points into this copy
      for (size_t i = 0; i < nf4_tensors.size(); ++i) slice_of[size_t(nf4_tensors[i])] = &slices_[i];
    }
    int64_t local = 0;
    for (size_t u = 0; u < layout.units.size(); ++u) {
      const ParamUnit& pu = layout.units[u];
      Unit U;
      int64_t bytes = 0, at = pu.offset;  // the image so far; the unit's next element not yet placed
      auto plain_to = [&](int64_t end) {
        if (end <= at) return;
        bytes = align16(bytes);
        U.plains.push_back({at - pu.offset, end - at, bytes});
        bytes += (end - at) * int64_t(es_);
        at = end;
      };
      for (size_t t = 0; t < layout.tensors.size(); ++t) {
        const ParamTensor& pt = layout.tensors[t];
        if (!is_nf4[t]) continue;
        if (pt.offset < pu.offset || pt.offset >= pu.offset + pu.numel) continue;
        TR_CHECK(pt.offset >= at && pt.offset + pt.numel <= pu.offset + pu.numel,
                 "nf4 store: tensor ", pt.name, " overlaps another or leaves its unit (a bug)");
        plain_to(pt.offset);
        Quant q;
        q.tensor = int(t);
        q.n = pt.numel;
        q.blocks = (q.n + nf4::kBlock - 1) / nf4::kBlock;
        q.runs = (q.blocks + nf4::kAbsmaxBlock - 1) / nf4::kAbsmaxBlock;
        q.packed_at = bytes = align16(bytes);
        bytes += (q.n + 1) / 2;
        if (const Nf4TpSlice* sl = slice_of[t]) {
          // Tensor parallelism: the codes, then each local block's fp32 absmax (q_at).
          int64_t covered = 0;
          for (const Nf4BlockRun& r : sl->runs) {
            TR_CHECK(r.local == covered && r.count > 0 && r.global >= 0 &&
                         (r.global + r.count) * nf4::kBlock <= sl->global_numel + nf4::kBlock - 1,
                     "nf4 store: ", pt.name, ": a tensor-parallel block run out of order or range (a bug)");
            covered += r.count;
          }
          TR_CHECK(covered == q.blocks && q.n % nf4::kBlock == 0, "nf4 store: ", pt.name, ": the slice's runs cover ",
                   covered, " blocks of ", q.blocks, " (a bug)");
          q.slice = sl;
          q.q_at = bytes = align16(bytes);
          bytes += 4 * q.blocks;
        } else {
          q.q_at = bytes = align16(bytes);
          bytes += q.blocks;
          q.a2_at = bytes = align16(bytes);
          bytes += 4 * q.runs;
        }
        at = pt.offset + pt.numel;
        U.quants.push_back(q);
      }
      plain_to(pu.offset + pu.numel);
      U.image = align16(bytes);
      U.shard = align16((U.image + G_ - 1) / G_);
      U.lo = std::min(U.image, g_ * U.shard);
      U.hi = std::min(U.image, U.lo + U.shard);
      U.local_off = local;
      local += U.shard;
      units_.push_back(std::move(U));
    }
    local_bytes_ = local;
    local_ = DeviceBuffer(be, size_t(std::max<int64_t>(16, local)));
    map_ = DeviceBuffer(be, sizeof(float) * nf4::kMapSize);
    be->copy_to_device(map_.get(), codec_->dynamic_map(), sizeof(float) * nf4::kMapSize);
  }

  // ---- loading ----
  void load_from(const FlatReader& read) override {
    loaded_ = false;
    std::string failed;  // this rank's reader or data error
    auto attempt = [&](const auto& fn) {
      if (!failed.empty()) return;
      try {
        fn();
      } catch (const std::exception& e) {
        failed = e.what();
      }
    };
    std::vector<uint8_t> staged;
    std::vector<float> x;
    for (size_t u = 0; u < units_.size(); ++u) {
      const Unit& U = units_[u];
      const int64_t unit0 = layout_.units[u].offset;
      staged.assign(size_t(U.shard), 0);
      // [a, b) of the image, clipped to this rank's bytes, relative to lo (or empty).
      auto mine = [&](int64_t a, int64_t b) { return std::make_pair(std::max(a, U.lo), std::min(b, U.hi)); };
      for (const Plain& p : U.plains) {
        const auto [a, b] = mine(p.at, p.at + p.n * int64_t(es_));
        if (a >= b) continue;
        attempt([&] {
          const int64_t e0 = (a - p.at) / int64_t(es_), count = (b - a) / int64_t(es_);
          x.resize(size_t(count));
          read(unit0 + p.e0 + e0, count, 0, 1, x.data());
          uint8_t* to = staged.data() + (a - U.lo);
          if (act_ == DType::F32) {
            std::memcpy(to, x.data(), size_t(count) * 4);
          } else {
            for (int64_t i = 0; i < count; ++i) {
              const uint16_t h = nf4::bf16_bits_rne(x[size_t(i)]);
              std::memcpy(to + 2 * i, &h, 2);
            }
          }
        });
      }
      for (Quant& q : units_[u].quants) {
        if (!quantize_tensor(q, U, read, staged, x, failed)) {
          // Another rank of the group failed: stop here, as it does.
          if (!failed.empty()) TR_FAIL(failed);
          return;
        }
      }
      if (failed.empty() && U.shard > 0) be_->copy_to_device(local_.as<char>() + U.local_off, staged.data(), staged.size());
    }
    if (!failed.empty()) TR_FAIL(failed);
    loaded_ = true;
  }

  // ---- UnitAccess ----
  const void* acquire_params(int u) override {
    TR_CHECK(loaded_, "model.base_dtype nf4: the frozen base was not loaded (its load failed on this rank or "
                      "another of its shard group; that error comes first)");
    Unit& U = units_[size_t(u)];
    if (U.holders++ > 0) return U.full.get();
    const char* image = local_.as<char>() + U.local_off;
    DeviceBuffer gathered;
    if (G_ > 1) {
      gathered = take(size_t(U.shard) * G_);
      comm_->all_gather(gathered.get(), image, size_t(U.shard));
      image = gathered.as<char>();
    }
    const int64_t unit0 = layout_.units[size_t(u)].offset;
    U.full = take(size_t(layout_.units[size_t(u)].numel) * es_);
    char* full = U.full.as<char>();
    for (const Plain& p : U.plains) be_->copy_device(full + p.e0 * int64_t(es_), image + p.at, size_t(p.n) * es_);
    for (const Quant& q : U.quants) {
      const ParamTensor& pt = layout_.tensors[size_t(q.tensor)];
      if (q.slice) {
        be_->nf4_dequantize_blocks(full + (pt.offset - unit0) * int64_t(es_), act_,
                                   reinterpret_cast<const uint8_t*>(image + q.packed_at),
                                   reinterpret_cast<const float*>(image + q.q_at), q.n);
        continue;
      }
      be_->nf4_dequantize(full + (pt.offset - unit0) * int64_t(es_), act_,
                          reinterpret_cast<const uint8_t*>(image + q.packed_at),
                          reinterpret_cast<const uint8_t*>(image + q.q_at),
                          reinterpret_cast<const float*>(image + q.a2_at), map_.as<float>(), q.offset, q.n);
    }
    if (gathered.get()) give(std::move(gathered));
    return U.full.get();
  }
  void release_params(int u) override {
    Unit& U = units_[size_t(u)];
    TR_CHECK(U.holders > 0, "nf4 store: unit ", u, " released more often than acquired (a bug)");
    if (--U.holders == 0) give(std::move(U.full));
  }

  // ---- ParamStore ----
  void init_params(const ModelArch& arch, uint64_t seed) override {
    check_same_layout(arch, layout_);
    load_from([&](int64_t g, int64_t n, int64_t stride, int64_t reps, float* out) {
      for (int64_t r = 0; r < reps; ++r) arch.init_params(seed, g + r * stride, g + r * stride + n, out + r * n);
    });
  }
  void load_full_params(const std::vector<float>& flat) override {
    TR_CHECK(int64_t(flat.size()) == layout_.total, "nf4 store: ", flat.size(), " values for ", layout_.total);
    load_from([&](int64_t g, int64_t n, int64_t stride, int64_t reps, float* out) {
      for (int64_t r = 0; r < reps; ++r) std::memcpy(out + r * n, flat.data() + g + r * stride, size_t(n) * 4);
    });
  }
  // The elements whose values (plain) or codes (NF4) this rank holds.
  std::vector<Range> held_ranges() const override {
    std::vector<Range> out;
    for (size_t u = 0; u < units_.size(); ++u) {
      const Unit& U = units_[u];
      const int64_t unit0 = layout_.units[u].offset;
      for (const Plain& p : U.plains) {
        const int64_t a = std::max(p.at, U.lo), b = std::min(p.at + p.n * int64_t(es_), U.hi);
        if (a < b) out.push_back({unit0 + p.e0 + (a - p.at) / int64_t(es_), (b - a) / int64_t(es_)});
      }
      for (const Quant& q : U.quants) {
        const int64_t a = std::max(q.packed_at, U.lo), b = std::min(q.packed_at + (q.n + 1) / 2, U.hi);
        if (a >= b) continue;
        const int64_t e0 = 2 * (a - q.packed_at), e1 = std::min(q.n, 2 * (b - q.packed_at));
        out.push_back({layout_.tensors[size_t(q.tensor)].offset + e0, e1 - e0});
      }
    }
    std::sort(out.begin(), out.end(), [](const Range& a, const Range& b) { return a.global < b.global; });
    return out;
  }
  std::vector<Range> write_ranges() const override { return writes_ ? held_ranges() : std::vector<Range>{}; }
  std::vector<float> get_state(int) override { no_fp32("get_state"); }
  void copy_state_range(int, const Range&, float*) override { no_fp32("copy_state_range"); }
  void write_state_range(int, const Range&, const float*) override { no_fp32("write_state_range"); }
  void set_state(int, const std::vector<float>&) override { no_fp32("set_state"); }
  void set_step(int64_t step) override {
    if (own_) own_->set_step(step);
  }
  void check_comms() override {
    if (own_) own_->check_health();
  }
  ShardMemory memory() const override {
    ShardMemory m;
    m.params = size_t(local_bytes_);
    m.comm_buffers = peak_pool_bytes_;
    return m;
  }
  std::string strategy() const override { return strategy_ + ", frozen nf4"; }

 private:
  struct Plain {
    int64_t e0 = 0, n = 0;  // elements [e0, e0 + n) of the unit
    int64_t at = 0;         // their byte offset in the image
  };
  struct Quant {
    int tensor = 0;  // index into the layout's tensors
    int64_t n = 0, blocks = 0, runs = 0;
    int64_t packed_at = 0, q_at = 0, a2_at = 0;  // byte offsets of its sections in the image
    float offset = 0;                            // the mean absmax (set by load_from; the same on every rank)
    const Nf4TpSlice* slice = nullptr;           // tensor parallelism: the slice's global blocks (q_at: fp32 absmaxes)
  };
  struct Unit {
    std::vector<Plain> plains;
    std::vector<Quant> quants;
    int64_t image = 0;     // bytes of the whole unit's image
    int64_t shard = 0;     // bytes each rank of the group holds (the last ones padded)
    int64_t lo = 0, hi = 0;  // this rank's bytes [lo, hi) of the image
    int64_t local_off = 0;   // where they lie in local_
    int holders = 0;
    DeviceBuffer full;  // (numel) act dtype, dequantized while held
  };

  // One NF4 tensor's part of this rank (see the top). Returns false when a
  // rank of the group failed (this one: `failed` says why).
  bool quantize_tensor(Quant& q, const Unit& U, const FlatReader& read, std::vector<uint8_t>& staged,
                       std::vector<float>& x, std::string& failed) {
    const ParamTensor& pt = layout_.tensors[size_t(q.tensor)];
    const int64_t a = std::max(q.packed_at, U.lo), b = std::min(q.packed_at + (q.n + 1) / 2, U.hi);
    const int64_t e0 = a < b ? 2 * (a - q.packed_at) : 0, e1 = a < b ? std::min(q.n, 2 * (b - q.packed_at)) : 0;
    // The block absmaxes of the tensor (under TP the global tensor's: a
    // local block's index mapped through the slice), this rank's part of
    // each (0 elsewhere), and a last slot > 0 when a rank failed.
    const int64_t blocks = q.slice ? (q.slice->global_numel + nf4::kBlock - 1) / nf4::kBlock : q.blocks;
    std::vector<int64_t> global_block;  // TP: local block -> global block
    if (q.slice) {
      global_block.resize(size_t(q.blocks));
      for (const Nf4BlockRun& r : q.slice->runs)
        for (int64_t k = 0; k < r.count; ++k) global_block[size_t(r.local + k)] = r.global + k;
    }
    auto block = [&](int64_t local) { return q.slice ? global_block[size_t(local)] : local; };
    std::vector<float> absmax(size_t(blocks) + 1, 0.0f);
    if (failed.empty() && e1 > e0) {
      try {
        x.resize(size_t(e1 - e0));
        read(pt.offset + e0, e1 - e0, 0, 1, x.data());
        for (int64_t i = e0; i < e1; ++i)
          if (!std::isfinite(x[size_t(i - e0)]))
            TR_FAIL("model.base_dtype nf4: tensor ", pt.name, " element ",
                    block(i / nf4::kBlock) * nf4::kBlock + i % nf4::kBlock, " is ", x[size_t(i - e0)],
                    "; NF4 holds finite values only: check the weights file this tensor came from");
        for (int64_t blk = e0 / nf4::kBlock; blk * nf4::kBlock < e1; ++blk) {
          const int64_t i0 = std::max(e0, blk * nf4::kBlock), i1 = std::min(e1, (blk + 1) * nf4::kBlock);
          absmax[size_t(block(blk))] = codec_->absmax_of(x.data() + (i0 - e0), i1 - i0);
        }
      } catch (const std::exception& e) {
        failed = e.what();
      }
    }
    if (!failed.empty()) absmax.back() = 1.0f;
    // The collectives run on device memory (NCCL's contract; a copy on the CPU).
    auto max_over = [&](Communicator* c) {
      DeviceBuffer dev = take(absmax.size() * 4);
      be_->copy_to_device(dev.get(), absmax.data(), absmax.size() * 4);
      c->all_reduce(dev.as<float>(), int64_t(absmax.size()), ReduceOp::Max);
      be_->copy_to_host(absmax.data(), dev.get(), absmax.size() * 4);
      give(std::move(dev));
    };
    if (G_ > 1) max_over(comm_);
    if (q.slice && tp_comm_->world_size() > 1) max_over(tp_comm_);
    if (absmax.back() > 0.0f) return false;
    absmax.pop_back();
    std::vector<uint8_t> qabsmax;
    std::vector<float> absmax2;
    codec_->quantize_absmax(absmax, q.offset, qabsmax, absmax2);
    auto copy_section = [&](int64_t at, const void* src, int64_t bytes) {
      const int64_t c0 = std::max(at, U.lo), c1 = std::min(at + bytes, U.hi);
      if (c0 < c1) std::memcpy(staged.data() + (c0 - U.lo), static_cast<const char*>(src) + (c0 - at), size_t(c1 - c0));
    };
    if (!q.slice) {
      if (e1 > e0) codec_->encode(x.data(), e0, e1 - e0, q.n, absmax.data(), staged.data() + (a - U.lo));
      copy_section(q.q_at, qabsmax.data(), q.blocks);
      copy_section(q.a2_at, absmax2.data(), 4 * q.runs);
      return true;
    }
    // TP: the local blocks' absmaxes (encode indexes them by local element),
    // and their dequantized values, as nf4_dequantize would compute them.
    std::vector<float> local_absmax(size_t(q.blocks)), scale(size_t(q.blocks));
    const float* map = codec_->dynamic_map();
    for (int64_t lb = 0; lb < q.blocks; ++lb) {
      const int64_t gb = global_block[size_t(lb)];
      local_absmax[size_t(lb)] = absmax[size_t(gb)];
      scale[size_t(lb)] = nf4::block_scale(map, qabsmax[size_t(gb)], absmax2[size_t(gb / nf4::kAbsmaxBlock)], q.offset);
    }
    if (e1 > e0) codec_->encode(x.data(), e0, e1 - e0, q.n, local_absmax.data(), staged.data() + (a - U.lo));
    copy_section(q.q_at, scale.data(), 4 * q.blocks);
    return true;
  }

  [[noreturn]] void no_fp32(const char* what) const {
    TR_FAIL("nf4 store: ", what, ": the NF4 base is quantized as it loads (load_from) and holds no fp32 values "
            "to read or write range by range; a bug if reached from a loader (model.init_from uses load_from)");
  }
  // Device buffers by size, reused across acquires (the gather image, the
  // dequantized unit, the absmax exchange).
  DeviceBuffer take(size_t bytes) {
    auto& free = pool_[bytes];
    if (free.empty()) {
      pool_bytes_ += bytes;
      peak_pool_bytes_ = std::max(peak_pool_bytes_, pool_bytes_);
      return DeviceBuffer(be_, bytes);
    }
    DeviceBuffer b = std::move(free.back());
    free.pop_back();
    return b;
  }
  void give(DeviceBuffer b) { pool_[b.bytes()].push_back(std::move(b)); }

  std::string strategy_;
  const ParamLayout& layout_;
  Backend* be_;
  std::shared_ptr<const Nf4Codec> codec_;
  DType act_;
  size_t es_;
  int G_ = 1, g_ = 0;
  bool writes_ = false, loaded_ = false;
  Communicator* comm_ = nullptr;
  std::unique_ptr<Communicator> own_;
  Communicator* tp_comm_ = nullptr;  // tensor parallelism: the TP group (the absmax exchange's second step)
  std::vector<Nf4TpSlice> slices_;   // tensor parallelism: format.nf4_tp
  std::vector<Unit> units_;
  int64_t local_bytes_ = 0;
  DeviceBuffer local_;  // this rank's bytes of every unit's image
  DeviceBuffer map_;    // (256) the dynamic map, fp32
  std::map<size_t, std::vector<DeviceBuffer>> pool_;
  size_t pool_bytes_ = 0, peak_pool_bytes_ = 0;
};

}  // namespace

std::unique_ptr<ParamStore> make_nf4_frozen_store(const std::string& strategy, const ParamLayout& layout, Backend* be,
                                                  Communicator* world, int shard_group_size,
                                                  const CommFactory& factory, const FrozenFormat& format) {
  return std::make_unique<Nf4FrozenStore>(strategy, layout, be, world, shard_group_size, factory, format);
}

}  // namespace trainrun
