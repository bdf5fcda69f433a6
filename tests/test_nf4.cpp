// NF4 quantization (core/model/adapter/nf4.h) against an independent
// reference written from bitsandbytes' published algorithm and code table
// (scripts/reference/nf4_reference.py, numpy + torch for the dynamic map;
// bitsandbytes itself needs torch >= 2): the packed codes, the 8-bit
// absmaxes, absmax2 and offset, and the dequantized fp32 and bf16 values must
// be the same bits, on random tensors and on the edges (a partial last
// block, odd n, all-zero and all-subnormal blocks, values exactly on the
// decision thresholds and one ulp either side, magnitudes near the fp32
// limits, n not a multiple of 64 * 256). Then, without the reference: the
// error bound of the format, the byte count the planner uses, the nibble
// order, NaN/Inf refused with the tensor's name and the element's index, and
// the CPU backend's nf4_dequantize op equal to the quantizer's own inverse.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <limits>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "core/common/error.h"
#include "core/model/adapter/nf4.h"
#include "kernels/backend.h"
#include "tests/support/hf_reference.h"
#include "tests/support/testutil.h"

using namespace trainrun;
using namespace trainrun::test;

namespace {

using Bytes = std::vector<uint8_t>;
using Vec = std::vector<float>;

template <typename T>
void write_raw(const std::string& path, const std::vector<T>& v) {
  std::ofstream f(path, std::ios::binary);
  f.write(reinterpret_cast<const char*>(v.data()), std::streamsize(v.size() * sizeof(T)));
  REQUIRE(f.good());
}

template <typename T>
std::vector<T> read_raw(const std::string& path) {
  std::ifstream f(path, std::ios::binary | std::ios::ate);
  INFO("reading " << path);
  REQUIRE(f.good());
  const auto bytes = size_t(f.tellg());
  std::vector<T> v(bytes / sizeof(T));
  f.seekg(0);
  f.read(reinterpret_cast<char*>(v.data()), std::streamsize(bytes));
  return v;
}

template <typename T>
uint64_t bits_of(T v) {
  uint64_t b = 0;
  std::memcpy(&b, &v, sizeof(T));
  return b;
}

// "" when a and b hold the same bits, else where and how they first differ.
template <typename T>
std::string first_difference(const std::vector<T>& got, const std::vector<T>& want) {
  std::ostringstream os;
  if (got.size() != want.size()) {
    os << "sizes differ: " << got.size() << " vs " << want.size();
    return os.str();
  }
  for (size_t i = 0; i < got.size(); ++i)
    if (bits_of(got[i]) != bits_of(want[i])) {
      size_t count = 0;
      for (size_t j = i; j < got.size(); ++j) count += bits_of(got[j]) != bits_of(want[j]);
      os << count << " of " << got.size() << " differ; first at " << i << ": trainrun " << +got[i] << " (0x" << std::hex
         << bits_of(got[i]) << std::dec << "), reference " << +want[i] << " (0x" << std::hex << bits_of(want[i])
         << std::dec << ")";
      return os.str();
    }
  return "";
}

#define CHECK_SAME_BITS(what, got, want) \
  do {                                   \
    INFO(what);                          \
    CHECK(first_difference(got, want) == ""); \
  } while (0)

Vec randn(size_t n, uint64_t seed, float stddev, float mean = 0) {
  std::mt19937_64 gen(seed);
  std::normal_distribution<float> d(mean, stddev);
  Vec v(n);
  for (auto& x : v) x = d(gen);
  return v;
}

float up(float x) { return std::nextafter(x, std::numeric_limits<float>::infinity()); }
float down(float x) { return std::nextafter(x, -std::numeric_limits<float>::infinity()); }

// bitsandbytes' NF4 decision thresholds (its dQuantizeNF4 literals), for
// building values that sit exactly on them; the quantizer has its own copy.
const Vec kThresholds = {-0.8480964004993439f, -0.6106329262256622f, -0.4599952697753906f, -0.33967943489551544f,
                         -0.23460740596055984f, -0.13791173323988914f, -0.045525018125772476f, 0.03979014977812767f,
                         0.1202552504837513f,  0.2035212516784668f,  0.2920137718319893f,  0.3893125355243683f,
                         0.5016634166240692f,  0.6427869200706482f,  0.8614784181118011f};

// The edge-case tensors, by name.
std::map<std::string, Vec> edge_tensors() {
  std::map<std::string, Vec> t;
  // Weights-like, three absmax runs (the last partial), a partial last block, odd n.
  t["normal_w"] = randn(2 * 16384 + 64 * 37 + 29, 1, 0.02f);
  // Wider values off centre, a whole number of runs.
  t["normal_wide"] = randn(4 * 16384, 2, 1.0f, 0.3f);

  // All-zero and all-subnormal blocks among random ones; an all-zero last
  // block (partial, even n) and an all-zero odd tail (its pad nibble).
  {
    Vec v = randn(64 * 300 + 10, 3, 0.5f);
    for (int i = 0; i < 64; ++i) v[2 * 64 + i] = 0.0f;
    for (int i = 0; i < 64; ++i) v[7 * 64 + i] = (i % 2 ? -1.0f : 1.0f) * 1e-40f * float(i + 1);
    for (int i = 0; i < 10; ++i) v[300 * 64 + i] = 0.0f;
    t["zero_blocks"] = v;
    Vec w = randn(64 * 3 + 5, 4, 0.5f);
    for (int i = 0; i < 5; ++i) w[3 * 64 + i] = 0.0f;
    t["zero_tail_odd"] = w;
  }

  // Values exactly on every threshold and one ulp either side, at absmax
  // 1, 2 and 0.25 (x * (1/absmax) exact: lands on the threshold itself) and
  // 3 (inexact: the reciprocal-multiply's own rounding decides).
  {
    Vec v;
    for (float s : {1.0f, 2.0f, 0.25f, 3.0f}) {
      Vec b = {s, -s, 0.0f};
      for (float th : kThresholds) {
        b.push_back(s * th);
        b.push_back(s * up(th));
        b.push_back(s * down(th));
      }
      for (float c : nf4::nf4_code()) b.push_back(s * c);
      while (b.size() < 64) b.push_back(s * 0.5f);
      b.resize(64);
      v.insert(v.end(), b.begin(), b.end());
    }
    t["thresholds"] = v;
  }

  // Magnitudes near the fp32 limits: absmax 1e38 (bitsandbytes' fast-math
  // reciprocal flushes 1/1e38 to 0), 1e30, 1e-30, a tiny normal absmax
  // with subnormal elements (flushed before the huge scale applies), and a
  // block mixing 1e-3 with 1e3.
  {
    Vec v;
    auto block = [&](float scale, uint64_t seed) {
      Vec b = randn(64, seed, 1.0f);
      for (auto& x : b) v.push_back(x * scale);
    };
    block(3e37f, 10);
    block(1e30f, 11);
    block(1e-30f, 12);
    block(1e-37f, 13);
    v.back() = 1.5e-37f;
    for (int i = 0; i < 8; ++i) v[v.size() - 64 + i] = 5e-39f * float(i + 1);
    block(1e-3f, 14);
    v[v.size() - 3] = 1e3f;
    block(1e-3f, 15);
    v[v.size() - 60] = 1e38f;  // absmax 1e38: 1/absmax flushes to 0, every code is 7 (0.0)
    t["magnitudes"] = v;
  }
  t["constant"] = Vec(1000, 0.25f);  // every absmax the offset: absmax2 = 0
  t["all_zero"] = Vec(130, 0.0f);
  t["one"] = Vec{0.7f};
  t["three"] = Vec{-0.3f, 2.0f, 1e-3f};
  return t;
}

struct RefTensor {
  Bytes packed, qabsmax;
  Vec absmax2, offset, deq;
  std::vector<uint16_t> bf16;
};

// One run of the reference over a directory of inputs.
class Reference {
 public:
  Reference() : dir_("nf4_ref") {}
  void tensor(const std::string& name, const Vec& x) { write_raw(dir_ / (name + ".x.f32"), x); }
  void scaled4(const std::string& name, const Vec& x) { write_raw(dir_ / (name + ".s4.f32"), x); }
  void scaled8(const std::string& name, const Vec& x) { write_raw(dir_ / (name + ".s8.f32"), x); }
  void run() {
    const auto r = run_reference_script("nf4_reference.py", "'" + dir_.path() + "'");
    INFO("nf4_reference.py: " << r.out << r.err);
    REQUIRE(r.exit_code == 0);
  }
  RefTensor get(const std::string& name) const {
    RefTensor t;
    t.packed = read_raw<uint8_t>(dir_ / (name + ".packed"));
    t.qabsmax = read_raw<uint8_t>(dir_ / (name + ".qabsmax"));
    t.absmax2 = read_raw<float>(dir_ / (name + ".absmax2"));
    t.offset = read_raw<float>(dir_ / (name + ".offset"));
    t.deq = read_raw<float>(dir_ / (name + ".deq.f32"));
    t.bf16 = read_raw<uint16_t>(dir_ / (name + ".deq.bf16"));
    return t;
  }
  Bytes codes4(const std::string& name) const { return read_raw<uint8_t>(dir_ / (name + ".codes4")); }
  Bytes codes8(const std::string& name) const { return read_raw<uint8_t>(dir_ / (name + ".codes8")); }
  Vec map() const { return read_raw<float>(dir_ / "map.f32"); }

 private:
  TempDir dir_;
};

}  // namespace

TEST_CASE("nf4: quantize and dequantize equal the bitsandbytes reference bit for bit", "[nf4]") {
  const auto tensors = edge_tensors();
  Reference ref;
  for (const auto& [name, x] : tensors) ref.tensor(name, x);

  // The two rounding rules alone, at their edges.
  Vec s4 = {0.0f, -0.0f, 1.0f, -1.0f, 2.0f, -2.0f, std::numeric_limits<float>::quiet_NaN()};
  for (float th : kThresholds) s4.insert(s4.end(), {th, up(th), down(th)});
  const auto& map = nf4::dynamic_map();
  Vec s8 = {std::numeric_limits<float>::quiet_NaN(), 2.0f, -2.0f, -0.0f};
  for (int k = 0; k < nf4::kMapSize; ++k) {
    s8.push_back(map[k]);
    if (k + 1 < nf4::kMapSize) {
      const float mid = (map[k] + map[k + 1]) * 0.5f;
      s8.insert(s8.end(), {mid, up(mid), down(mid)});
    }
  }
  {
    std::mt19937_64 gen(7);
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    for (int i = 0; i < 2000; ++i) s8.push_back(u(gen));
  }
  ref.scaled4("edges", s4);
  ref.scaled8("edges", s8);
  ref.run();

  CHECK_SAME_BITS("the dynamic map", Vec(map.begin(), map.end()), ref.map());
  Bytes c4, c8;
  for (float x : s4) c4.push_back(nf4::nf4_code_of(x));
  for (float x : s8) c8.push_back(nf4::map_index_of(x));
  CHECK_SAME_BITS("NF4 codes of scaled values at the thresholds", c4, ref.codes4("edges"));
  CHECK_SAME_BITS("dynamic-map indices at the map's midpoints", c8, ref.codes8("edges"));

  for (const auto& [name, x] : tensors) {
    INFO("tensor " << name << " (n = " << x.size() << ")");
    const RefTensor want = ref.get(name);
    const nf4::Nf4Tensor t = nf4::quantize(x.data(), int64_t(x.size()), name);
    CHECK_SAME_BITS("packed codes", t.packed, want.packed);
    CHECK_SAME_BITS("qabsmax", t.qabsmax, want.qabsmax);
    CHECK_SAME_BITS("absmax2", t.absmax2, want.absmax2);
    CHECK_SAME_BITS("offset", Vec{t.offset}, want.offset);
    Vec deq(x.size());
    nf4::dequantize(t, deq.data());
    CHECK_SAME_BITS("dequantized fp32", deq, want.deq);
    std::vector<uint16_t> bf16(x.size());
    nf4::dequantize_bf16(t, bf16.data());
    CHECK_SAME_BITS("dequantized bf16", bf16, want.bf16);
  }
}

TEST_CASE("nf4: the first element of a pair is the high nibble", "[nf4]") {
  // 1.0 is code 15, -1.0 code 0, 0.0 code 7 (absmax 1 here).
  const Vec x = {1.0f, -1.0f, 0.0f, 1.0f, -1.0f};
  const auto t = nf4::quantize(x.data(), 5, "x");
  REQUIRE(t.packed.size() == 3);
  CHECK(t.packed[0] == 0xF0);
  CHECK(t.packed[1] == 0x7F);
  CHECK(t.packed[2] == 0x07);  // odd n: the pad is the code of 0.0
}

TEST_CASE("nf4: dequantization error within the format's bound", "[nf4]") {
  // |x - x'| <= absmax * h4 + |absmax - absmax'|, h4 the largest half-gap
  // of the NF4 table (|code| <= 1 carries the absmax error at most once),
  // and |absmax - absmax'| <= absmax2 * h8, h8 the dynamic map's largest
  // half-gap; a few fp32 ulps of slack for the roundings in between.
  const auto& code = nf4::nf4_code();
  const auto& map = nf4::dynamic_map();
  double h4 = 0, h8 = 0;
  for (int c = 0; c + 1 < 16; ++c) h4 = std::max(h4, (double(code[c + 1]) - code[c]) / 2);
  for (int k = 0; k + 1 < nf4::kMapSize; ++k) h8 = std::max(h8, (double(map[k + 1]) - map[k]) / 2);
  std::mt19937_64 gen(5);
  std::student_t_distribution<float> heavy(3.0f);
  Vec tails(40000);
  for (auto& v : tails) v = 0.01f * heavy(gen);
  for (const Vec& x : {randn(50000, 21, 0.02f), randn(33333, 22, 1.0f, -0.5f), tails}) {
    const auto t = nf4::quantize(x.data(), int64_t(x.size()), "x");
    Vec deq(x.size());
    nf4::dequantize(t, deq.data());
    const Vec a_deq = nf4::block_absmax(t);
    double worst = 0;  // the largest error as a fraction of its bound
    for (size_t b = 0; b < a_deq.size(); ++b) {
      double absmax = 0;
      const size_t i0 = b * nf4::kBlock, i1 = std::min(x.size(), i0 + nf4::kBlock);
      for (size_t i = i0; i < i1; ++i) absmax = std::max(absmax, std::fabs(double(x[i])));
      const double a_err = std::fabs(absmax - a_deq[b]);
      // The roundings scale with the larger of absmax and the offset added back.
      const double slack = 4e-7 * (absmax + std::fabs(double(t.offset)));
      REQUIRE(a_err <= t.absmax2[b / nf4::kAbsmaxBlock] * h8 * (1 + 1e-5) + slack);
      const double bound = absmax * h4 + a_err + slack;
      for (size_t i = i0; i < i1; ++i) {
        const double e = std::fabs(double(x[i]) - deq[i]);
        INFO("element " << i << ": x " << x[i] << ", dequantized " << deq[i] << ", block absmax " << absmax);
        REQUIRE(e <= bound);
        worst = std::max(worst, e / bound);
      }
    }
    CHECK(worst > 0.5);  // the bound is tight enough to mean something
  }
}

TEST_CASE("nf4: stored_bytes counts the buffers a tensor holds", "[nf4]") {
  for (int64_t n : {int64_t(1), int64_t(2), int64_t(63), int64_t(64), int64_t(65), int64_t(16383), int64_t(16384),
                    int64_t(16385), int64_t(49153), int64_t(100001)}) {
    const Vec x = randn(size_t(n), uint64_t(n), 1.0f);
    const auto t = nf4::quantize(x.data(), n, "x");
    INFO("n = " << n);
    CHECK(nf4::stored_bytes(n) == t.packed.size() + t.qabsmax.size() + 4 * t.absmax2.size() + 4);
  }
  // By hand from the format: n = 49153 -> 24577 packed + 769 qabsmax + 4 runs * 4 + 4.
  CHECK(nf4::stored_bytes(49153) == 24577 + 769 + 16 + 4);
  // A 8192 x 8192 weight: 32 MiB of codes, 1 MiB of qabsmax, 16 KiB of absmax2 (0.516 bytes per element).
  CHECK(nf4::stored_bytes(int64_t(8192) * 8192) == 33554432u + 1048576u + 16384u + 4u);
  CHECK(nf4::stored_bytes(0) == 4);
  const auto empty = nf4::quantize(nullptr, 0, "x");
  CHECK(empty.packed.empty());
  CHECK(empty.qabsmax.empty());
}

TEST_CASE("nf4: NaN or Inf is an error naming the tensor and the element", "[nf4]") {
  const std::string name = "model.layers.3.mlp.up_proj.weight";
  Vec x = randn(200, 9, 0.02f);
  x[70] = std::numeric_limits<float>::quiet_NaN();
  REQUIRE_THROWS_WITH(nf4::quantize(x.data(), 200, name),
                      Catch::Contains(name) && Catch::Contains("element 70") && Catch::Contains("nan"));
  x[70] = 0.0f;
  x[5] = -std::numeric_limits<float>::infinity();
  REQUIRE_THROWS_WITH(nf4::quantize(x.data(), 200, name), Catch::Contains(name) && Catch::Contains("element 5 "));
}

TEST_CASE("nf4: the CPU backend's nf4_dequantize and nf4_dequantize_blocks equal the quantizer's inverse", "[nf4]") {
  auto be = make_cpu_backend(2);
  const auto tensors = edge_tensors();
  for (const char* name : {"normal_w", "zero_blocks", "thresholds", "one"}) {
    INFO("tensor " << name);
    const Vec& x = tensors.at(name);
    const int64_t n = int64_t(x.size());
    const auto t = nf4::quantize(x.data(), n, name);
    const auto& map = nf4::dynamic_map();
    DeviceBuffer packed(be.get(), t.packed.size()), qabsmax(be.get(), t.qabsmax.size()),
        absmax2(be.get(), 4 * t.absmax2.size()), dmap(be.get(), 4 * map.size()), out(be.get(), 4 * x.size()),
        out16(be.get(), 2 * x.size());
    be->copy_to_device(packed.get(), t.packed.data(), t.packed.size());
    be->copy_to_device(qabsmax.get(), t.qabsmax.data(), t.qabsmax.size());
    be->copy_to_device(absmax2.get(), t.absmax2.data(), 4 * t.absmax2.size());
    be->copy_to_device(dmap.get(), map.data(), 4 * map.size());
    be->nf4_dequantize(out.get(), DType::F32, packed.as<uint8_t>(), qabsmax.as<uint8_t>(), absmax2.as<float>(),
                       dmap.as<float>(), t.offset, n);
    be->nf4_dequantize(out16.get(), DType::BF16, packed.as<uint8_t>(), qabsmax.as<uint8_t>(), absmax2.as<float>(),
                       dmap.as<float>(), t.offset, n);
    Vec got(x.size()), want(x.size());
    std::vector<uint16_t> got16(x.size()), want16(x.size());
    be->copy_to_host(got.data(), out.get(), 4 * x.size());
    be->copy_to_host(got16.data(), out16.get(), 2 * x.size());
    nf4::dequantize(t, want.data());
    nf4::dequantize_bf16(t, want16.data());
    CHECK_SAME_BITS("fp32", got, want);
    CHECK_SAME_BITS("bf16", got16, want16);
    // nf4_dequantize_blocks (a tensor-parallel slice's form): the same bits
    // from one fp32 absmax per block, computed as the NF4 store does.
    std::vector<float> scale(t.qabsmax.size());
    for (size_t b = 0; b < scale.size(); ++b)
      scale[b] = nf4::block_scale(map.data(), t.qabsmax[b], t.absmax2[b / nf4::kAbsmaxBlock], t.offset);
    DeviceBuffer blocks(be.get(), 4 * scale.size());
    be->copy_to_device(blocks.get(), scale.data(), 4 * scale.size());
    be->nf4_dequantize_blocks(out.get(), DType::F32, packed.as<uint8_t>(), blocks.as<float>(), n);
    be->nf4_dequantize_blocks(out16.get(), DType::BF16, packed.as<uint8_t>(), blocks.as<float>(), n);
    be->copy_to_host(got.data(), out.get(), 4 * x.size());
    be->copy_to_host(got16.data(), out16.get(), 2 * x.size());
    CHECK_SAME_BITS("fp32 blocks", got, want);
    CHECK_SAME_BITS("bf16 blocks", got16, want16);
  }
}
