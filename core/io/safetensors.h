// safetensors reader/writer (format: 8-byte little-endian u64 header length N,
// N bytes of JSON {"name": {"dtype": "F32", "shape": [..], "data_offsets": [b, e]},
// "__metadata__": {str: str}}, then the raw little-endian data). Offsets are
// relative to the end of the header; we pad the header with spaces to 8 bytes.
#pragma once
#include <cstddef>
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
  // (as_f32 also widens F16 and narrows F64; any other dtype throws Error.)
  int64_t numel() const;             // product of shape (1 for a scalar [])
};

struct SafeTensorFile {
  std::map<std::string, std::string> metadata;
  std::vector<SafeTensor> tensors;   // in file order
  const SafeTensor* find(const std::string& name) const;
};

// The header of a safetensors file whose tensors are laid out contiguously
// in the given order: the 8-byte little-endian length, then the JSON
// (padded with spaces so the data starts 8-byte aligned). Writers that fill
// the data area themselves (parallel checkpoint writes) use it directly.
struct SafeTensorEntry {
  std::string name;
  std::string dtype;
  std::vector<int64_t> shape;
  uint64_t nbytes = 0;
};
std::string encode_safetensors_header(const std::vector<SafeTensorEntry>& entries,
                                      const std::map<std::string, std::string>& metadata);

// Writes atomically (temp file + fsync + rename). Throws Error naming the path.
void write_safetensors(const std::string& path, const SafeTensorFile& file);
// Validates the header (length at most 100 MB as safetensors' own limit,
// JSON, dtypes, offsets within the file; the tensors packed back to back
// up to the end of the file: no overlap, gap or trailing bytes, as
// safetensors itself requires) and throws Error naming the path and the problem.
SafeTensorFile read_safetensors(const std::string& path);

// A file mapped read-only, for reading parts of large files (each rank its
// own ranges of a model) without reading or holding the rest: the header is
// validated as by read_safetensors, each tensor's bytes stay in the mapping.
class MappedSafeTensors {
 public:
  struct View {
    std::string name, dtype;
    std::vector<int64_t> shape;
    const uint8_t* data = nullptr;  // in the mapping
    uint64_t nbytes = 0;
  };
  explicit MappedSafeTensors(const std::string& path);
  ~MappedSafeTensors();
  MappedSafeTensors(const MappedSafeTensors&) = delete;
  MappedSafeTensors& operator=(const MappedSafeTensors&) = delete;
  const std::string& path() const { return path_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const std::vector<View>& tensors() const { return views_; }  // in file order
  const View* find(const std::string& name) const;
  // Done with a tensor: its pages leave this process's resident set (they
  // are file-backed; reading them again faults them back in). One madvise
  // per call: callers reading a tensor row by row call it once per tensor
  // (or group of rows), never per row.
  void drop_pages(const View& v) const;
  // madvise calls drop_pages has made in this process (all files, all
  // threads): tests hold the "once per tensor, not per row" bound with it.
  static uint64_t drop_pages_calls();

 private:
  std::string path_;
  std::map<std::string, std::string> metadata_;
  std::vector<View> views_;
  const uint8_t* base_ = nullptr;
  uint64_t size_ = 0;
};

// Widens n elements of a float dtype (F32, BF16, F16, F64) at src to fp32;
// any other dtype throws Error.
void convert_to_f32(const std::string& dtype, const uint8_t* src, size_t n, float* dst);

// Bytes per element of a safetensors dtype name (F32, F16, BF16, F64, I64,
// I32, I16, I8, U8, U16, U32, BOOL); 0 when the name is not supported.
size_t safetensors_dtype_size(const std::string& dtype);

// Any supported dtype: copies numel(shape) * dtype size bytes from data.
SafeTensor make_tensor(const std::string& name, const std::string& dtype,
                       std::vector<int64_t> shape, const void* data);

// Convenience for fp32 tensors.
SafeTensor make_f32_tensor(const std::string& name, std::vector<int64_t> shape, const float* data);

}  // namespace trainrun
