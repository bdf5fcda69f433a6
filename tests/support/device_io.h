// Moving test data to and from a Backend's memory (backend-agnostic: only
// copies and casts), shared by the op, model and CUDA tests.
#pragma once
#include <algorithm>
#include <cstdint>
#include <vector>

#include "kernels/backend.h"

namespace trainrun::test {

// fp32 values into a new buffer (at least 4 bytes, so n = 0 is a valid pointer).
inline DeviceBuffer upload_f32(Backend* be, const std::vector<float>& f) {
  DeviceBuffer d(be, std::max<size_t>(1, f.size()) * 4);
  be->copy_to_device(d.get(), f.data(), f.size() * 4);
  return d;
}
inline std::vector<float> download_f32(Backend* be, const void* p, size_t n) {
  std::vector<float> f(n);
  be->copy_to_host(f.data(), p, n * 4);
  be->synchronize();
  return f;
}
// fp32 values cast into `dst`, which holds the backend's activation dtype.
inline void cast_into(Backend* be, void* dst, const std::vector<float>& f) {
  DeviceBuffer staged = upload_f32(be, f);
  be->cast_from_f32(dst, staged.as<float>(), int64_t(f.size()));
}
// A new activation-dtype buffer holding `f` (rounded to that dtype).
inline DeviceBuffer upload_act(Backend* be, const std::vector<float>& f) {
  DeviceBuffer d(be, std::max<size_t>(1, f.size()) * dtype_size(be->act_dtype()));
  cast_into(be, d.get(), f);
  return d;
}
inline std::vector<float> download_act(Backend* be, const void* p, size_t n) {
  DeviceBuffer staged(be, std::max<size_t>(1, n) * 4);
  be->cast_to_f32(staged.as<float>(), p, int64_t(n));
  return download_f32(be, staged.get(), n);
}
inline DeviceBuffer upload_i32(Backend* be, const std::vector<int32_t>& t) {
  DeviceBuffer d(be, std::max<size_t>(1, t.size()) * 4);
  be->copy_to_device(d.get(), t.data(), t.size() * 4);
  return d;
}

}  // namespace trainrun::test
