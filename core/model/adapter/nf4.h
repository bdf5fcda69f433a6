// NF4 quantization of a frozen base tensor (QLoRA), byte-for-byte as
// bitsandbytes' quantize_4bit(A, blocksize=64, compress_statistics=True,
// quant_type="nf4") computes it on CUDA; the format itself is described in
// kernels/nf4_format.h, and dequantization on a device is
// Backend::nf4_dequantize.
//
// Quantize, step by step (bitsandbytes' kQuantizeBlockwise kernels):
//  1. per block of 64: absmax = max |x| (subnormals count as 0: its kernels
//     flush them); scale = 1 / absmax; each element's code is the NF4
//     decision tree on x * scale (thresholds: the midpoints of adjacent NF4
//     values, as fp32 literals; x exactly on a threshold takes the lower code).
//     An all-zero block has scale 1/0: bitsandbytes' 0 * inf = NaN falls
//     through the tree to code 0 (-1.0), times absmax 0.
//  2. offset = mean of the absmaxes.
//  3. per run of 256 absmaxes: v = absmax - offset (fp32); absmax2 = max |v|;
//     qabsmax = the 8-bit search of bitsandbytes' dQuantize over the signed
//     dynamic map on v * (1 / absmax2) (a 7-step binary search, then the
//     nearer of the two neighbours by fp32 midpoint).
// Two places where bitsandbytes cannot be matched bit for bit, and what is
// done instead (docs/fine-tuning.md, "NF4 storage"):
//  - its CUDA build uses --use_fast_math, so 1/absmax there is the GPU's
//    approximate reciprocal (rcp.approx, <= 1 ulp off); here it is the
//    correctly rounded 1.0f / absmax. A value within ~1 ulp of a threshold
//    can take the neighbouring code; everything else is identical.
//  - its offset is torch's float32 mean (a reduction tree whose order
//    depends on the device); here it is the sum in double, divided, rounded
//    once to fp32 (the correctly rounded mean, but for the last bits of a
//    double sum).
// The dynamic map is computed as torch.linspace computes it on an x86 CPU
// with AVX2 (bitsandbytes builds it on the host with torch), so it equals
// the map bitsandbytes stores next to its tensors (nested_quant_map) there.
#pragma once
#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "kernels/nf4_format.h"

namespace trainrun::nf4 {

// One quantized tensor (shapes: kernels/nf4_format.h).
struct Nf4Tensor {
  int64_t n = 0;                 // elements
  std::vector<uint8_t> packed;   // (ceil(n/2)) two 4-bit codes per byte, first element high
  std::vector<uint8_t> qabsmax;  // (ceil(n/64)) 8-bit codes of absmax - offset
  std::vector<float> absmax2;    // (ceil(ceil(n/64)/256)) scale of each run of 256 qabsmax
  float offset = 0;              // mean of the fp32 absmaxes
};

// Bytes an NF4 tensor of n elements occupies: packed + qabsmax + absmax2 +
// offset (what the planner counts per base tensor). The 1 KiB dynamic map
// and the 64-byte NF4 table are shared by every tensor, not counted here
// (bitsandbytes keeps a copy of the map per tensor).
size_t stored_bytes(int64_t n);

// The 16 NF4 values and the signed dynamic map (256 ascending fp32 values in
// [-1, 1], one exact 0 at index 127, 1.0 at 255).
const std::array<float, 16>& nf4_code();
const std::array<float, kMapSize>& dynamic_map();

// x (n fp32) -> NF4. `name` (the tensor's, e.g. its HF name) goes into the
// error for a NaN or Inf element, with the element's index. n may be 0.
Nf4Tensor quantize(const float* x, int64_t n, const std::string& name);

// quantize() in three steps, for a tensor whose elements lie on several
// ranks (parallel/sharding/nf4_frozen_store.cpp): each rank takes the
// absmax_of its part of every 64-block it touches, the ranks combine them
// with a max (exact: max is associative) into the whole tensor's absmaxes,
// every rank derives the same statistics from those with quantize_absmax,
// and each encodes its own elements. quantize() runs the same three steps on
// one host, so both give the same bytes.
//   absmax_of: max |x| over n values (subnormals as 0), the part of a block's absmax.
//   quantize_absmax: offset, qabsmax and absmax2 from all the absmaxes of a tensor.
//   encode: elements [first, first + count) of a tensor of n elements (x holds
//     just those; first even, count even unless the range ends at n) into
//     packed bytes [first/2, ...) (`packed` points at byte first/2), with
//     `absmax` the whole tensor's block absmaxes.
struct Nf4Stats {
  float offset = 0;
  std::vector<uint8_t> qabsmax;  // (ceil(n/64))
  std::vector<float> absmax2;    // (ceil(ceil(n/64)/256))
};
float absmax_of(const float* x, int64_t n);
Nf4Stats quantize_absmax(const std::vector<float>& absmax);
void encode(const float* x, int64_t first, int64_t count, int64_t n, const float* absmax, uint8_t* packed);

// The fp32 absmax of every 64-block as dequantization sees it
// (ceil(n/64) values: map[qabsmax] * absmax2 + offset, kernels/nf4_format.h).
std::vector<float> block_absmax(const Nf4Tensor& t);
// out (t.n) = the dequantized values, fp32 or bf16 bits.
void dequantize(const Nf4Tensor& t, float* out);
void dequantize_bf16(const Nf4Tensor& t, uint16_t* out);

// The two rounding rules alone, for the tests of their edges: the NF4 code
// of a scaled value (x * scale, in [-1, 1]), and the dynamic map index of a
// scaled absmax deviation.
uint8_t nf4_code_of(float scaled);
uint8_t map_index_of(float scaled);

}  // namespace trainrun::nf4
