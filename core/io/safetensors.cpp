// safetensors reader/writer. The format is tiny, so we implement it directly
// instead of depending on the Rust library: 8-byte LE header length N, N bytes
// of JSON, then the data area. Everything the reader takes from the file is
// validated before it is trusted (a corrupt checkpoint must produce a clear
// error, never a crash or a silent misread), and the writer is atomic (a crash
// mid-write leaves the previous file intact).
#include "core/io/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>

#include "core/common/error.h"

// The data area is raw little-endian bytes and we copy it as-is into host
// memory; a big-endian host would need byte swapping everywhere.
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "safetensors I/O assumes a little-endian host");

namespace trainrun {

namespace {

struct DtypeInfo {
  const char* name;
  size_t size;
};
// The dtypes we accept. The format knows a few more (F8_*, ...); we reject
// them by name rather than misreading them.
constexpr DtypeInfo kDtypes[] = {
    {"F64", 8}, {"F32", 4}, {"F16", 2}, {"BF16", 2}, {"I64", 8}, {"I32", 4},
    {"I16", 2}, {"I8", 1},  {"U8", 1},  {"U16", 2},  {"U32", 4}, {"BOOL", 1},
};

std::string supported_dtypes() {
  std::string s;
  for (const auto& d : kDtypes) s += (s.empty() ? "" : ", ") + std::string(d.name);
  return s;
}

std::string shape_str(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? "," : "") + std::to_string(shape[i]);
  return s + "]";
}

// numel * elem_size with overflow detection (a hostile header can claim a
// shape whose byte size wraps around u64 and then "matches" the offsets).
bool checked_nbytes(const std::vector<int64_t>& shape, size_t elem, uint64_t* out) {
  uint64_t n = elem;
  for (int64_t d : shape) {
    if (d < 0) return false;
    uint64_t ud = static_cast<uint64_t>(d);
    if (ud != 0 && n > std::numeric_limits<uint64_t>::max() / ud) return false;
    n *= ud;
  }
  *out = n;
  return true;
}

float half_to_float(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;  // +-0
    } else {
      // Subnormal half: value = mant * 2^-24, exactly representable in float.
      float v = std::ldexp(static_cast<float>(mant), -24);
      return sign ? -v : v;
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (mant << 13);  // inf / nan (payload kept)
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// ---- low-level file helpers (POSIX so we can fsync and report errno) --------

void write_all(int fd, const uint8_t* p, size_t n, const std::string& what) {
  while (n > 0) {
    // Linux writes at most ~2 GiB per call; chunk so huge tensors work.
    size_t chunk = std::min<size_t>(n, size_t(1) << 30);
    ssize_t w = ::write(fd, p, chunk);
    if (w < 0 && errno == EINTR) continue;
    TR_CHECK_ERRNO(w >= 0, what);
    TR_CHECK(w > 0, what, ": write returned 0 bytes");
    p += w;
    n -= static_cast<size_t>(w);
  }
}

void pread_all(int fd, uint8_t* p, size_t n, uint64_t off, const std::string& what) {
  while (n > 0) {
    size_t chunk = std::min<size_t>(n, size_t(1) << 30);
    ssize_t r = ::pread(fd, p, chunk, static_cast<off_t>(off));
    if (r < 0 && errno == EINTR) continue;
    TR_CHECK_ERRNO(r >= 0, what);
    TR_CHECK(r > 0, what, ": unexpected end of file (was it truncated while being read?)");
    p += r;
    n -= static_cast<size_t>(r);
    off += static_cast<uint64_t>(r);
  }
}

struct Fd {
  int fd = -1;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

std::string parent_dir(const std::string& path) {
  size_t slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

}  // namespace

size_t safetensors_dtype_size(const std::string& dtype) {
  for (const auto& d : kDtypes)
    if (dtype == d.name) return d.size;
  return 0;
}

int64_t SafeTensor::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::vector<float> SafeTensor::as_f32() const {
  const size_t elem = safetensors_dtype_size(dtype);
  TR_CHECK(dtype == "F32" || dtype == "BF16" || dtype == "F16" || dtype == "F64", "tensor '", name,
           "' has dtype ", dtype, "; as_f32() converts only F32, BF16, F16 and F64");
  const size_t n = static_cast<size_t>(numel());
  TR_CHECK(data.size() == n * elem, "tensor '", name, "': ", data.size(), " bytes of data but shape ",
           shape_str(shape), " of ", dtype, " needs ", n * elem);
  std::vector<float> out(n);
  convert_to_f32(dtype, data.data(), n, out.data());
  return out;
}

void convert_to_f32(const std::string& dtype, const uint8_t* p, size_t n, float* out) {
  if (dtype == "F32") {
    if (n) std::memcpy(out, p, n * 4);
  } else if (dtype == "BF16") {
    for (size_t i = 0; i < n; ++i) {
      uint16_t h;
      std::memcpy(&h, p + 2 * i, 2);
      uint32_t bits = static_cast<uint32_t>(h) << 16;  // bf16 is the top half of an f32
      std::memcpy(&out[i], &bits, 4);
    }
  } else if (dtype == "F16") {
    for (size_t i = 0; i < n; ++i) {
      uint16_t h;
      std::memcpy(&h, p + 2 * i, 2);
      out[i] = half_to_float(h);
    }
  } else if (dtype == "F64") {
    for (size_t i = 0; i < n; ++i) {
      double d;
      std::memcpy(&d, p + 8 * i, 8);
      out[i] = static_cast<float>(d);
    }
  } else {
    TR_FAIL("cannot convert dtype ", dtype, " to F32 (only F32, BF16, F16 and F64)");
  }
}

const SafeTensor* SafeTensorFile::find(const std::string& name) const {
  for (const auto& t : tensors)
    if (t.name == name) return &t;
  return nullptr;
}

SafeTensor make_tensor(const std::string& name, const std::string& dtype, std::vector<int64_t> shape,
                       const void* data) {
  const size_t elem = safetensors_dtype_size(dtype);
  TR_CHECK(elem != 0, "tensor '", name, "': unknown dtype '", dtype, "' (supported: ", supported_dtypes(), ")");
  uint64_t nbytes = 0;
  TR_CHECK(checked_nbytes(shape, elem, &nbytes), "tensor '", name, "': invalid shape ", shape_str(shape));
  SafeTensor t;
  t.name = name;
  t.dtype = dtype;
  t.shape = std::move(shape);
  t.data.resize(nbytes);
  if (nbytes) std::memcpy(t.data.data(), data, nbytes);
  return t;
}

SafeTensor make_f32_tensor(const std::string& name, std::vector<int64_t> shape, const float* data) {
  return make_tensor(name, "F32", std::move(shape), data);
}

// ---- writer --------------------------------------------------------------------

std::string encode_safetensors_header(const std::vector<SafeTensorEntry>& entries,
                                      const std::map<std::string, std::string>& metadata) {
  // ordered_json keeps the header in file order, which makes files easy to
  // inspect with `head -c`.
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) {
    nlohmann::ordered_json meta = nlohmann::ordered_json::object();
    for (const auto& [k, v] : metadata) meta[k] = v;
    header["__metadata__"] = std::move(meta);
  }
  uint64_t offset = 0;
  for (const auto& e : entries) {
    header[e.name] = {{"dtype", e.dtype}, {"shape", e.shape}, {"data_offsets", {offset, offset + e.nbytes}}};
    offset += e.nbytes;
  }
  std::string json = header.dump();
  // Pad with spaces (valid JSON whitespace) so the data area starts 8-byte
  // aligned: 8 + N is a multiple of 8, which lets readers mmap and cast.
  json.append((8 - json.size() % 8) % 8, ' ');
  std::string out(8, '\0');
  const uint64_t n = json.size();
  for (int i = 0; i < 8; ++i) out[size_t(i)] = static_cast<char>(uint8_t(n >> (8 * i)));
  return out + json;
}

void write_safetensors(const std::string& path, const SafeTensorFile& file) {
  const std::string where = "safetensors file '" + path + "'";

  // Validate first: a bad tensor must not leave a half-written temp file.
  std::vector<SafeTensorEntry> entries;
  std::set<std::string> names;
  for (const auto& t : file.tensors) {
    TR_CHECK(!t.name.empty(), where, ": cannot write a tensor with an empty name");
    TR_CHECK(t.name != "__metadata__", where, ": '__metadata__' is reserved and cannot name a tensor");
    TR_CHECK(names.insert(t.name).second, where, ": tensor name '", t.name, "' appears twice");
    const size_t elem = safetensors_dtype_size(t.dtype);
    TR_CHECK(elem != 0, where, ": tensor '", t.name, "' has unknown dtype '", t.dtype,
             "' (supported: ", supported_dtypes(), ")");
    uint64_t nbytes = 0;
    TR_CHECK(checked_nbytes(t.shape, elem, &nbytes), where, ": tensor '", t.name, "' has invalid shape ",
             shape_str(t.shape));
    TR_CHECK(nbytes == t.data.size(), where, ": tensor '", t.name, "' has shape ", shape_str(t.shape), " of ",
             t.dtype, " (", nbytes, " bytes) but holds ", t.data.size(), " bytes of data");
    entries.push_back({t.name, t.dtype, t.shape, nbytes});
  }
  const std::string header = encode_safetensors_header(entries, file.metadata);

  // Atomic commit: write a temp file in the same directory (rename is atomic
  // only within one filesystem), fsync it, rename over the target, then fsync
  // the directory so the rename itself survives a power loss.
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  const std::string wtmp = "cannot write " + where + " (temp file '" + tmp + "')";
  {
    Fd f;
    f.fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    TR_CHECK_ERRNO(f.fd >= 0, "cannot create ", where, " (temp file '", tmp, "')");
    try {
      write_all(f.fd, reinterpret_cast<const uint8_t*>(header.data()), header.size(), wtmp);
      for (const auto& t : file.tensors) write_all(f.fd, t.data.data(), t.data.size(), wtmp);
      TR_CHECK_ERRNO(::fsync(f.fd) == 0, wtmp, ": fsync failed");
      int fd = f.fd;
      f.fd = -1;
      // close() can report a deferred write error (NFS, quota): check it.
      TR_CHECK_ERRNO(::close(fd) == 0, wtmp, ": close failed");
    } catch (...) {
      ::unlink(tmp.c_str());
      throw;
    }
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    std::string err = detail::errno_string();
    ::unlink(tmp.c_str());
    TR_FAIL("cannot write ", where, ": rename from '", tmp, "' failed: ", err);
  }
  const std::string dir = parent_dir(path);
  Fd d;
  d.fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  TR_CHECK_ERRNO(d.fd >= 0, "wrote ", where, " but cannot open its directory '", dir, "' to fsync it");
  TR_CHECK_ERRNO(::fsync(d.fd) == 0, "wrote ", where, " but fsync of its directory '", dir, "' failed");
}

// ---- reader --------------------------------------------------------------------

namespace {
// safetensors' MAX_HEADER_SIZE (tensor.rs): 100 MB, decimal.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;
}  // namespace

namespace {
// The validated header of an open file: metadata, tensors (no data yet) and
// each one's byte range in the data area, which starts at *data_start.
struct ParsedHeader {
  SafeTensorFile file;  // tensors without data, in header order
  struct Entry {
    uint64_t begin, end;
    size_t index;
  };
  std::vector<Entry> entries;  // sorted by data offset (see below)
  uint64_t data_start = 0, size = 0;
};

ParsedHeader parse_header(int fd, const std::string& path) {
  const struct {
    int fd;
  } f{fd};  // not owned: the caller closes it
  const std::string where = "safetensors file '" + path + "'";
  struct stat st;
  TR_CHECK_ERRNO(::fstat(f.fd, &st) == 0, "cannot stat ", where);
  TR_CHECK(S_ISREG(st.st_mode), where, " is not a regular file");
  const uint64_t size = static_cast<uint64_t>(st.st_size);

  TR_CHECK(size >= 8, where, ": file too short (", size,
           " bytes; a safetensors file starts with an 8-byte header length). "
           "The file is truncated or not a safetensors file");
  uint8_t len_bytes[8];
  pread_all(f.fd, len_bytes, 8, 0, "cannot read " + where);
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= static_cast<uint64_t>(len_bytes[i]) << (8 * i);
  TR_CHECK(n <= size - 8, where, ": header length ", n, " is larger than the file (", size,
           " bytes). The file is truncated or not a safetensors file");
  // The reference implementation's limit (safetensors' MAX_HEADER_SIZE):
  // a header is read and parsed whole, so without one a hostile file costs
  // its header's size in memory, several times over once parsed.
  TR_CHECK(n <= kMaxHeaderBytes, where, ": header length ", n, " bytes is over the ", kMaxHeaderBytes,
           "-byte limit that safetensors itself enforces (a real header of 100K tensors is a few MB). "
           "The file is corrupt or not a safetensors file");
  std::string json(n, '\0');
  pread_all(f.fd, reinterpret_cast<uint8_t*>(json.data()), n, 8, "cannot read " + where);

  nlohmann::json header;
  // nlohmann::json keeps only the last of duplicate keys; a header naming a
  // tensor twice is corrupt, so catch top-level duplicates while parsing.
  std::set<std::string> top_keys;
  std::string duplicate;
  auto on_event = [&](int depth, nlohmann::json::parse_event_t ev, nlohmann::json& parsed) {
    if (ev == nlohmann::json::parse_event_t::key && depth == 1 && parsed.is_string() &&
        !top_keys.insert(parsed.get<std::string>()).second && duplicate.empty())
      duplicate = parsed.get<std::string>();
    return true;
  };
  try {
    header = nlohmann::json::parse(json, on_event);
  } catch (const nlohmann::json::parse_error& e) {
    TR_FAIL(where, ": JSON parse error in the header: ", e.what(), ". The file is corrupt or not a safetensors file");
  }
  TR_CHECK(duplicate.empty(), where, ": the header names '", duplicate, "' twice");
  TR_CHECK(header.is_object(), where, ": the header is JSON but not an object");

  const uint64_t data_start = 8 + n;
  const uint64_t data_size = size - data_start;
  ParsedHeader ph;
  ph.data_start = data_start;
  ph.size = size;
  SafeTensorFile& out = ph.file;
  using Entry = ParsedHeader::Entry;
  std::vector<Entry>& entries = ph.entries;

  for (auto it = header.begin(); it != header.end(); ++it) {
    const std::string& key = it.key();
    const nlohmann::json& v = it.value();
    if (key == "__metadata__") {
      TR_CHECK(v.is_object(), where, ": __metadata__ must be an object of string to string");
      for (auto m = v.begin(); m != v.end(); ++m) {
        TR_CHECK(m.value().is_string(), where, ": __metadata__ value for '", m.key(), "' is ",
                 m.value().type_name(), ", expected a string");
        out.metadata[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    const std::string t = where + ": tensor '" + key + "'";
    TR_CHECK(v.is_object(), t, ": header entry is not an object");
    TR_CHECK(v.contains("dtype") && v["dtype"].is_string(), t, ": missing or non-string 'dtype'");
    TR_CHECK(v.contains("shape") && v["shape"].is_array(), t, ": missing or non-array 'shape'");
    TR_CHECK(v.contains("data_offsets") && v["data_offsets"].is_array() && v["data_offsets"].size() == 2, t,
             ": 'data_offsets' must be an array [begin, end]");
    SafeTensor tensor;
    tensor.name = key;
    tensor.dtype = v["dtype"].get<std::string>();
    const size_t elem = safetensors_dtype_size(tensor.dtype);
    TR_CHECK(elem != 0, t, ": unknown dtype '", tensor.dtype, "' (supported: ", supported_dtypes(), ")");
    for (const auto& d : v["shape"]) {
      TR_CHECK(d.is_number_unsigned(), t, ": shape entries must be non-negative integers, got ", d.dump());
      uint64_t ud = d.get<uint64_t>();
      TR_CHECK(ud <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max()), t, ": shape entry ", ud,
               " is too large");
      tensor.shape.push_back(static_cast<int64_t>(ud));
    }
    const auto& offs = v["data_offsets"];
    TR_CHECK(offs[0].is_number_unsigned() && offs[1].is_number_unsigned(), t,
             ": data_offsets must be non-negative integers, got ", offs.dump());
    const uint64_t b = offs[0].get<uint64_t>(), e = offs[1].get<uint64_t>();
    TR_CHECK(b <= e, t, ": data_offsets [", b, ", ", e, "] end before they begin");
    uint64_t nbytes = 0;
    const bool fits = checked_nbytes(tensor.shape, elem, &nbytes);
    TR_CHECK(fits && nbytes == e - b, t, ": shape/offset size mismatch: shape ", shape_str(tensor.shape), " of ",
             tensor.dtype, " needs ", fits ? std::to_string(nbytes) : std::string("more than 2^64"),
             " bytes but data_offsets [", b, ", ", e, "] span ", e - b);
    TR_CHECK(e <= data_size, t, ": data_offsets [", b, ", ", e, "] are outside the data area (", data_size,
             " bytes after the header). The file is truncated or corrupt");
    entries.push_back({b, e, out.tensors.size()});
    out.tensors.push_back(std::move(tensor));
  }

  // The tensors must tile the data area, as safetensors' own reader
  // requires (Metadata::validate: sorted by offsets, each starts where the
  // previous ended, the last ends at the end of the file): no overlaps, and
  // no gaps or trailing bytes either, which no writer of the format leaves
  // and which would be bytes no tensor accounts for. stable_sort: ties
  // (empty tensors at one offset) keep the header's iteration order, which
  // nlohmann::json makes alphabetical: deterministic.
  std::stable_sort(entries.begin(), entries.end(), [](const Entry& a, const Entry& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  const Entry* prev = nullptr;
  uint64_t packed_to = 0;  // where the next tensor must start
  for (const auto& e : entries) {
    if (e.begin < packed_to)
      TR_FAIL(where, ": overlapping tensors '", out.tensors[prev->index].name, "' [", prev->begin, ", ", prev->end,
              ") and '", out.tensors[e.index].name, "' [", e.begin, ", ", e.end, ")");
    if (e.begin > packed_to)
      TR_FAIL(where, ": a gap of ", e.begin - packed_to, " bytes before tensor '", out.tensors[e.index].name,
              "' (data_offsets [", e.begin, ", ", e.end, "]; the data before it ends at ", packed_to,
              "); safetensors packs tensors back to back and refuses such files too. The file is corrupt");
    packed_to = e.end;
    prev = &e;
  }
  TR_CHECK(packed_to == data_size, where, ": ", data_size - packed_to, " bytes after the last tensor (the tensors end at ",
           packed_to, " of the data area's ", data_size,
           " bytes); safetensors refuses such files too. The file is corrupt or was appended to");

  return ph;
}

}  // namespace

SafeTensorFile read_safetensors(const std::string& path) {
  const std::string where = "safetensors file '" + path + "'";
  Fd f;
  f.fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  TR_CHECK_ERRNO(f.fd >= 0, "cannot open ", where);
  ParsedHeader ph = parse_header(f.fd, path);
  SafeTensorFile& out = ph.file;
  const uint64_t data_start = ph.data_start;
  const auto& entries = ph.entries;
  // Read the data, then put the tensors in file (data offset) order, which is
  // the order the writer was given.
  for (const auto& e : entries) {
    auto& tensor = out.tensors[e.index];
    tensor.data.resize(e.end - e.begin);
    if (!tensor.data.empty())
      pread_all(f.fd, tensor.data.data(), tensor.data.size(), data_start + e.begin,
                "cannot read " + where + " (tensor '" + tensor.name + "')");
  }
  std::vector<SafeTensor> ordered;
  ordered.reserve(out.tensors.size());
  for (const auto& e : entries) ordered.push_back(std::move(out.tensors[e.index]));
  out.tensors = std::move(ordered);
  return out;
}

// ---- mapped reader -------------------------------------------------------------

MappedSafeTensors::MappedSafeTensors(const std::string& path) : path_(path) {
  const std::string where = "safetensors file '" + path + "'";
  Fd f;
  f.fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  TR_CHECK_ERRNO(f.fd >= 0, "cannot open ", where);
  ParsedHeader ph = parse_header(f.fd, path);
  size_ = ph.size;
  if (size_ > 0) {
    void* m = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, f.fd, 0);
    TR_CHECK_ERRNO(m != MAP_FAILED, "cannot mmap ", where);
    base_ = static_cast<const uint8_t*>(m);
  }
  metadata_ = std::move(ph.file.metadata);
  for (const auto& e : ph.entries) {
    SafeTensor& t = ph.file.tensors[e.index];
    views_.push_back({t.name, t.dtype, t.shape, base_ + ph.data_start + e.begin, e.end - e.begin});
  }
}

MappedSafeTensors::~MappedSafeTensors() {
  if (base_) ::munmap(const_cast<uint8_t*>(base_), size_);
}

const MappedSafeTensors::View* MappedSafeTensors::find(const std::string& name) const {
  for (const auto& v : views_)
    if (v.name == name) return &v;
  return nullptr;
}

namespace {
std::atomic<uint64_t> g_drop_pages_calls{0};
}  // namespace

uint64_t MappedSafeTensors::drop_pages_calls() { return g_drop_pages_calls.load(); }

void MappedSafeTensors::drop_pages(const View& v) const {
  // Whole pages inside the tensor only: a neighbour's pages may still be read.
  const uintptr_t page = uintptr_t(::sysconf(_SC_PAGESIZE));
  const uintptr_t b = (reinterpret_cast<uintptr_t>(v.data) + page - 1) / page * page;
  const uintptr_t e = (reinterpret_cast<uintptr_t>(v.data) + v.nbytes) / page * page;
  if (e <= b) return;
  g_drop_pages_calls.fetch_add(1, std::memory_order_relaxed);
  ::madvise(reinterpret_cast<void*>(b), e - b, MADV_DONTNEED);
}

}  // namespace trainrun
