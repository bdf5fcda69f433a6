// safetensors reader/writer (format: 8-byte little-endian u64 header length N,
// N bytes of JSON {"name": {"dtype": "F32", "shape": [..], "data_offsets": [b, e]},
// "__metadata__": {str: str}}, then the raw little-endian data). Offsets are
// relative to the end of the header; we pad the header with spaces to 8 bytes.
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace trainrun {

struct SafeTensor {
  std::string name;
  std::string dtype = "F32";        // F32 | BF16 | I32 | U16 | U32 ...
  std::vector<int64_t> shape;
  std::vector<uint8_t> data;        // raw little-endian bytes
  std::vector<float> as_f32() const;  // F32 only (BF16 widened)
};

struct SafeTensorFile {
  std::map<std::string, std::string> metadata;
  std::vector<SafeTensor> tensors;   // in file order
  const SafeTensor* find(const std::string& name) const;
};

// Writes atomically (temp file + fsync + rename). Throws Error naming the path.
void write_safetensors(const std::string& path, const SafeTensorFile& file);
// Validates the header (length, JSON, dtypes, offsets within the file, no
// overlaps) and throws Error naming the path and the problem.
SafeTensorFile read_safetensors(const std::string& path);

// Convenience for fp32 tensors.
SafeTensor make_f32_tensor(const std::string& name, std::vector<int64_t> shape, const float* data);

}  // namespace trainrun
