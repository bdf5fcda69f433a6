// NF4 quantization (see nf4.h for the rules and the two known differences
// from bitsandbytes' CUDA build).
#include "core/model/adapter/nf4.h"

#include <algorithm>
#include <cmath>

#include "core/common/error.h"

namespace trainrun::nf4 {

namespace {

// The NF4 decision thresholds (midpoints of adjacent NF4 values), ascending,
// as the fp32 literals of bitsandbytes' dQuantizeNF4 tree.
constexpr float kThreshold[15] = {
    -0.8480964004993439f, -0.6106329262256622f, -0.4599952697753906f, -0.33967943489551544f,
    -0.23460740596055984f, -0.13791173323988914f, -0.045525018125772476f, 0.03979014977812767f,
    0.1202552504837513f,  0.2035212516784668f,  0.2920137718319893f,  0.3893125355243683f,
    0.5016634166240692f,  0.6427869200706482f,  0.8614784181118011f};

// An fp32 value the compiler must materialise (no fused multiply-add across
// it): torch's vector path rounds the product and the sum separately.
inline float rounded(float x) {
  asm volatile("" : "+x"(x));
  return x;
}

// torch.linspace(0.1, 1, steps, dtype=float32) as torch's CPU kernel
// computes it with AVX2 (8-float vectors): the scalar formula, which GCC
// contracts to a fused multiply-add (start + step*i below the halfway
// index, end - step*(steps-1-i) from it), for the elements after the last
// pair of full vectors; each full vector is its first element by that
// formula plus j*step, rounded twice.
std::vector<float> torch_linspace(int steps) {
  const float start = static_cast<float>(0.1), end = 1.0f;
  const float step = (end - start) / static_cast<float>(steps - 1);
  const int halfway = steps / 2;
  auto scalar = [&](int i) {
    return i < halfway ? std::fma(step, float(i), start) : std::fma(-step, float(steps - i - 1), end);
  };
  constexpr int kVec = 8;
  const int vectorised = steps / (2 * kVec) * (2 * kVec);
  std::vector<float> out(steps);
  for (int i0 = 0; i0 < vectorised; i0 += kVec) {
    const float base = scalar(i0);
    out[i0] = base;
    for (int j = 1; j < kVec; ++j) out[i0 + j] = base + rounded(float(j) * step);
  }
  for (int i = vectorised; i < steps; ++i) out[i] = scalar(i);
  return out;
}

std::array<float, kMapSize> make_dynamic_map() {
  // create_dynamic_map(signed=True, max_exponent_bits=7, total_bits=8): for
  // exponent e = 0..6, the midpoints of linspace(0.1, 1, 2^e + 1) times
  // 10^(e-6) (a Python float cast to the tensor's fp32), both signs; then 0
  // and 1.0; sorted. 2 * 127 + 2 = 256 entries, no padding.
  std::vector<float> data;
  for (int e = 0; e < 7; ++e) {
    const std::vector<float> b = torch_linspace((1 << e) + 1);
    const float scale = static_cast<float>(std::pow(10.0, e - 6));
    for (size_t k = 0; k + 1 < b.size(); ++k) {
      const float mean = (b[k] + b[k + 1]) / 2.0f;
      data.push_back(scale * mean);
      data.push_back(-(scale * mean));
    }
  }
  data.push_back(0.0f);
  data.push_back(1.0f);
  TR_CHECK(data.size() == size_t(kMapSize), "nf4: the dynamic map has ", data.size(), " entries, not 256");
  std::sort(data.begin(), data.end());
  std::array<float, kMapSize> map{};
  std::copy(data.begin(), data.end(), map.begin());
  return map;
}

// bitsandbytes' reciprocal: fast-math flushes a subnormal 1/absmax (absmax
// above ~8.5e37) to zero, which sends the whole block to the code of 0.
inline float reciprocal(float absmax) { return ftz(1.0f / absmax); }

}  // namespace

const std::array<float, 16>& nf4_code() {
  static const std::array<float, 16> code = {TR_NF4_CODE_VALUES};
  return code;
}

const std::array<float, kMapSize>& dynamic_map() {
  static const std::array<float, kMapSize> map = make_dynamic_map();
  return map;
}

size_t stored_bytes(int64_t n) {
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  const int64_t runs = (blocks + kAbsmaxBlock - 1) / kAbsmaxBlock;
  return size_t((n + 1) / 2) + size_t(blocks) + 4 * size_t(runs) + 4;
}

uint8_t nf4_code_of(float scaled) {
  // A 4-level binary tree over the ascending thresholds: the code is the
  // number of thresholds strictly below `scaled` (NaN: none, code 0).
  int c = 0;
  for (int step = 8; step >= 1; step >>= 1)
    if (scaled > kThreshold[c + step - 1]) c += step;
  return uint8_t(c);
}

uint8_t map_index_of(float x) {
  // bitsandbytes' dQuantize (non-stochastic): seven halving steps from the
  // middle of the map, then the nearer of the last bracket's ends by fp32
  // midpoint (a tie keeps the search's own index).
  const auto& map = dynamic_map();
  int pivot = 127, upper_pivot = 255, lower_pivot = 0;
  float lower = -1.0f, upper = 1.0f, val = map[pivot];
  for (int step = 64; step > 0; step >>= 1) {
    if (x > val) {
      lower_pivot = pivot;
      lower = val;
      pivot += step;
    } else {
      upper_pivot = pivot;
      upper = val;
      pivot -= step;
    }
    val = map[pivot];
  }
  if (upper_pivot == 255) upper = map[255];
  if (lower_pivot == 0) lower = map[0];
  if (x > val) return uint8_t(x > (upper + val) * 0.5f ? upper_pivot : pivot);
  return uint8_t(x < (lower + val) * 0.5f ? lower_pivot : pivot);
}

float absmax_of(const float* x, int64_t n) {
  float m = 0.0f;
  for (int64_t i = 0; i < n; ++i) m = std::max(m, ftz(std::fabs(x[i])));
  return m;
}

void encode(const float* x, int64_t first, int64_t count, int64_t n, const float* absmax, uint8_t* packed) {
  TR_CHECK(first % 2 == 0 && first >= 0 && count >= 0 && first + count <= n && (count % 2 == 0 || first + count == n),
           "nf4::encode: elements [", first, ", ", first + count, ") of ", n, " do not cover whole bytes (a bug)");
  const int64_t bytes = (count + 1) / 2;
#pragma omp parallel for schedule(static)
  for (int64_t j = 0; j < bytes; ++j) {
    const int64_t i = first + 2 * j;  // its two elements i, i + 1 lie in one 64-block (64 is even)
    const float m = absmax[i / kBlock];
    const float scale = reciprocal(m);
    // absmax 0: bitsandbytes' 0 * (1/0) is NaN, which its tree sends to code 0.
    // Elements past n (the low nibble of an odd n's last byte) quantize 0.0,
    // as bitsandbytes' zero-filled loads do.
    auto code = [&](int64_t e) -> uint8_t {
      if (m == 0.0f) return 0;
      return nf4_code_of(ftz((e < n ? ftz(x[e - first]) : 0.0f) * scale));
    };
    packed[j] = uint8_t(code(i) << 4 | code(i + 1));
  }
}

Nf4Stats quantize_absmax(const std::vector<float>& absmax) {
  Nf4Stats s;
  const int64_t blocks = int64_t(absmax.size());
  const int64_t runs = (blocks + kAbsmaxBlock - 1) / kAbsmaxBlock;
  s.qabsmax.assign(size_t(blocks), 0);
  s.absmax2.assign(size_t(runs), 0.0f);
  if (blocks == 0) return s;
  // offset: the mean of the absmaxes, summed in double (Neumaier's
  // compensation keeps it exact to the last bits for any count).
  double sum = 0, comp = 0;
  for (float a : absmax) {
    const double v = a, t = sum + v;
    comp += std::fabs(sum) >= std::fabs(v) ? (sum - t) + v : (v - t) + sum;
    sum = t;
  }
  s.offset = static_cast<float>((sum + comp) / double(blocks));
  // The double quantization: absmax - offset in runs of 256, 8 bits each.
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < runs; ++r) {
    const int64_t b0 = r * kAbsmaxBlock, b1 = std::min(blocks, b0 + kAbsmaxBlock);
    float m = 0.0f;
    for (int64_t b = b0; b < b1; ++b) m = std::max(m, ftz(std::fabs(absmax[size_t(b)] - s.offset)));
    s.absmax2[size_t(r)] = m;
    const float scale = reciprocal(m);
    for (int64_t b = b0; b < b1; ++b)
      s.qabsmax[size_t(b)] = m == 0.0f ? 0 : map_index_of(ftz(ftz(absmax[size_t(b)] - s.offset) * scale));
  }
  return s;
}

Nf4Tensor quantize(const float* x, int64_t n, const std::string& name) {
  TR_CHECK(n >= 0, "nf4: tensor ", name, " has a negative element count (", n, ")");
  for (int64_t i = 0; i < n; ++i)
    if (!std::isfinite(x[i]))
      TR_FAIL("nf4: tensor ", name, " element ", i, " is ", x[i],
              "; NF4 holds finite values only: check the weights file this tensor came from");
  // The same three steps a sharded store runs on its part (nf4.h): block
  // absmaxes, the codes, the double quantization of the absmaxes.
  Nf4Tensor t;
  t.n = n;
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  std::vector<float> absmax(static_cast<size_t>(blocks));
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < blocks; ++b)
    absmax[size_t(b)] = absmax_of(x + b * kBlock, std::min<int64_t>(kBlock, n - b * kBlock));
  t.packed.assign(size_t((n + 1) / 2), 0);
  encode(x, 0, n, n, absmax.data(), t.packed.data());
  Nf4Stats s = quantize_absmax(absmax);
  t.offset = s.offset;
  t.qabsmax = std::move(s.qabsmax);
  t.absmax2 = std::move(s.absmax2);
  return t;
}

std::vector<float> block_absmax(const Nf4Tensor& t) {
  std::vector<float> a(t.qabsmax.size());
  for (size_t b = 0; b < a.size(); ++b)
    a[b] = block_scale(dynamic_map().data(), t.qabsmax[b], t.absmax2[b / kAbsmaxBlock], t.offset);
  return a;
}

void dequantize(const Nf4Tensor& t, float* out) {
  dequantize_host(t.packed.data(), t.qabsmax.data(), t.absmax2.data(), dynamic_map().data(), t.offset, t.n, out,
                  nullptr);
}

void dequantize_bf16(const Nf4Tensor& t, uint16_t* out) {
  dequantize_host(t.packed.data(), t.qabsmax.data(), t.absmax2.data(), dynamic_map().data(), t.offset, t.n, nullptr,
                  out);
}

}  // namespace trainrun::nf4
