// CPU backend: NF4 dequantization (Backend::nf4_dequantize and
// nf4_dequantize_blocks), the host loops
// of kernels/nf4_format.h, which core/model/adapter/nf4.h's dequantize
// shares: the backend op and the quantizer's own inverse are one code.
#include "kernels/cpu/cpu_backend.h"
#include "kernels/nf4_format.h"

namespace trainrun {

void CpuBackend::nf4_dequantize(void* out, DType out_dtype, const uint8_t* packed, const uint8_t* qabsmax,
                                const float* absmax2, const float* map, float offset, int64_t n) {
  if (n <= 0) return;
  if (out_dtype == DType::F32)
    nf4::dequantize_host(packed, qabsmax, absmax2, map, offset, n, static_cast<float*>(out), nullptr);
  else
    nf4::dequantize_host(packed, qabsmax, absmax2, map, offset, n, nullptr, static_cast<uint16_t*>(out));
}

void CpuBackend::nf4_dequantize_blocks(void* out, DType out_dtype, const uint8_t* packed, const float* block_absmax,
                                       int64_t n) {
  if (n <= 0) return;
  if (out_dtype == DType::F32)
    nf4::dequantize_blocks_host(packed, block_absmax, n, static_cast<float*>(out), nullptr);
  else
    nf4::dequantize_blocks_host(packed, block_absmax, n, nullptr, static_cast<uint16_t*>(out));
}

}  // namespace trainrun
