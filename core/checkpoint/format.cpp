#include "core/checkpoint/format.h"

#include <cxxabi.h>
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <fstream>
#include <typeinfo>

#include "core/common/error.h"
#include "core/common/fileio.h"
#include "core/io/safetensors.h"
#include "core/model/model_io.h"

namespace fs = std::filesystem;

namespace trainrun {
namespace ckpt {

std::string step_name(int64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "step_%08lld", static_cast<long long>(step));
  return buf;
}

bool parse_step_name(const std::string& name, int64_t* step) {
  if (name.size() != 13 || name.rfind("step_", 0) != 0) return false;
  for (size_t i = 5; i < name.size(); ++i)
    if (name[i] < '0' || name[i] > '9') return false;
  *step = std::stoll(name.substr(5));
  return true;
}

// The two files' headers: F32 tensors in the flat layout's order, so
// global element g of kind k sits at a fixed offset every rank can compute.
std::string model_header(const ModelArch& arch, const ParamLayout&) { return model_file_header(arch); }

std::string optimizer_header(const ParamLayout& lay) {
  std::vector<SafeTensorEntry> es;
  for (const char* prefix : {"exp_avg.", "exp_avg_sq."})
    for (const auto& t : lay.tensors) es.push_back({prefix + t.name, "F32", t.shape, uint64_t(t.numel) * 4});
  return encode_safetensors_header(es, {{"format", "trainrun-adamw"}});
}

std::string hex64(uint64_t h) {
  char hex[17];
  std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(h));
  return hex;
}

bool parse_hex64(const std::string& s, uint64_t* out) {
  if (s.empty() || s.size() > 16 || s.find_first_not_of("0123456789abcdefABCDEF") != std::string::npos) return false;
  *out = std::stoull(s, nullptr, 16);
  return true;
}

// pwrite()s [data, data + bytes) at `off`, hashing it on the way in
// segments of at most kSegmentBytes, appended to `segs`.
void hashed_pwrite(int fd, const char* data, uint64_t bytes, uint64_t off, const std::string& path, Hasher& h,
                   std::vector<Segment>& segs) {
  while (bytes > 0) {
    const uint64_t n = std::min(bytes, kSegmentBytes);
    h.reset();
    for (uint64_t done = 0; done < n;) {
      const size_t c = size_t(std::min<uint64_t>(n - done, kIoChunk));
      h.update(data + done, c);
      pwrite_all(fd, data + done, c, off_t(off + done), path);
      done += c;
    }
    segs.push_back({off, n, h.digest()});
    data += n;
    off += n;
    bytes -= n;
  }
}

// pread()s [off, off + bytes) into `dst` in cache-sized pieces, feeding `h`.
void hashed_pread(int fd, char* dst, uint64_t bytes, uint64_t off, const std::string& path, Hasher& h) {
  for (uint64_t done = 0; done < bytes;) {
    const size_t c = size_t(std::min<uint64_t>(bytes - done, kIoChunk));
    pread_all(fd, dst + done, c, off_t(off + done), path);
    h.update(dst + done, c);
    done += c;
  }
}

std::string mismatch(const std::string& name, const Segment& s, uint64_t have) {
  return name + ": checksum mismatch in bytes [" + std::to_string(s.offset) + ", " + std::to_string(s.offset + s.bytes) +
         ") (xxhash64 " + hex64(have) + ", manifest " + hex64(s.hash) + "); the file is corrupt";
}

// The segments of one "files" entry: format 2's list, or format 1's
// whole-file hash as one segment. Throws Error naming the file and the flaw.
FileEntry file_entry(const std::string& name, const json& info) {
  FileEntry f;
  f.name = name;
  TR_CHECK(info.is_object() && info.contains("size") && info.at("size").is_number_unsigned(), "manifest.json: files.",
           name, " has no valid size");
  f.size = info.at("size").get<uint64_t>();
  if (info.contains("segments")) {
    TR_CHECK(info.at("segments").is_array(), "manifest.json: files.", name, ".segments is not a list");
    for (const json& j : info.at("segments")) {
      Segment s;
      TR_CHECK(j.is_object() && j.contains("offset") && j.at("offset").is_number_unsigned() && j.contains("bytes") &&
                   j.at("bytes").is_number_unsigned() && j.contains("xxhash64") && j.at("xxhash64").is_string() &&
                   parse_hex64(j.at("xxhash64").get<std::string>(), &s.hash),
               "manifest.json: files.", name, ".segments has an entry that is not {offset, bytes, xxhash64}: ",
               j.dump());
      s.offset = j.at("offset").get<uint64_t>();
      s.bytes = j.at("bytes").get<uint64_t>();
      f.segments.push_back(s);
    }
  } else {
    Segment s;
    TR_CHECK(info.contains("xxhash64") && info.at("xxhash64").is_string() &&
                 parse_hex64(info.at("xxhash64").get<std::string>(), &s.hash),
             "manifest.json: files.", name, " has neither segments nor an xxhash64");
    s.bytes = f.size;
    f.segments.push_back(s);
  }
  // Gaps would be bytes nobody verifies; overlaps cannot come from a save.
  std::sort(f.segments.begin(), f.segments.end(),
            [](const Segment& a, const Segment& b) { return a.offset < b.offset; });
  uint64_t at = 0;
  for (const Segment& s : f.segments) {
    TR_CHECK(s.offset == at && s.bytes > 0, "manifest.json: the segments of ", name, " do not tile the file (bytes ",
             at, " onwards)");
    at += s.bytes;
  }
  TR_CHECK(at == f.size, "manifest.json: the segments of ", name, " cover ", at, " of its ", f.size, " bytes");
  return f;
}

// Everything about a checkpoint directory that needs no data read: the
// manifest, its format, every file there at its size. "" when good (and
// the manifest in *out), else what is wrong.
std::string check_manifest(const std::string& dir, json* out, std::vector<FileEntry>* files) {
  try {
    std::ifstream f(dir + "/manifest.json");
    if (!f) return "manifest.json is missing";
    json m;
    try {
      m = json::parse(f);
    } catch (const std::exception& e) {
      return std::string("manifest.json is not valid JSON (") + e.what() + ")";
    }
    if (!m.is_object() || !m.contains("format_version") || !m["format_version"].is_number_integer() ||
        m["format_version"].get<int>() < 1 || m["format_version"].get<int>() > kFormatVersion)
      return "manifest.json has an unsupported format_version";
    std::vector<FileEntry> fs_;
    if (!m.contains("files") || !m.at("files").is_object()) return "manifest.json has no files";
    for (const auto& [name, info] : m.at("files").items()) {
      const std::string path = dir + "/" + name;
      if (!fs::exists(path)) return name + " is missing";
      FileEntry e = file_entry(name, info);
      const uint64_t have = fs::file_size(path);
      if (have != e.size)
        return name + " has " + std::to_string(have) + " bytes, the manifest says " + std::to_string(e.size) +
               " (truncated?)";
      fs_.push_back(std::move(e));
    }
    for (const char* name : kFileNames)
      if (std::none_of(fs_.begin(), fs_.end(), [&](const FileEntry& e) { return e.name == name; }))
        return std::string("manifest.json does not list ") + name;
    if (out) *out = std::move(m);
    if (files) *files = std::move(fs_);
    return "";
  } catch (const std::exception& e) {
    return std::string("unreadable: ") + e.what();
  }
}

std::string current_exception_text() {
  try {
    throw;
  } catch (const Error& e) {
    return e.what();
  } catch (const std::bad_alloc&) {
    return "out of host memory (std::bad_alloc)";
  } catch (const std::exception& e) {
    int status = 0;
    char* name = abi::__cxa_demangle(typeid(e).name(), nullptr, nullptr, &status);
    std::string text = std::string(e.what()) + " (" + (status == 0 && name ? name : typeid(e).name()) + ")";
    std::free(name);
    return text;
  } catch (...) {
    return "an exception that is not a std::exception";
  }
}

}  // namespace ckpt

using namespace ckpt;

std::string Checkpointer::verify(const std::string& dir) {
  std::vector<FileEntry> files;
  std::string why = check_manifest(dir, nullptr, &files);
  if (!why.empty()) return why;
  try {
    Hasher h;
    std::vector<char> buf(kIoChunk);
    for (const FileEntry& f : files) {
      const std::string path = dir + "/" + f.name;
      int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
      TR_CHECK_ERRNO(fd >= 0, "cannot open '", path, "'");
      ::posix_fadvise(fd, 0, 0, POSIX_FADV_SEQUENTIAL);
      // The segments tile the file: one sequential pass hashes them all.
      for (const Segment& g : f.segments) {
        h.reset();
        for (uint64_t done = 0; done < g.bytes;) {
          const size_t c = size_t(std::min<uint64_t>(g.bytes - done, buf.size()));
          try {
            pread_all(fd, buf.data(), c, off_t(g.offset + done), path);
          } catch (...) {
            ::close(fd);
            throw;
          }
          h.update(buf.data(), c);
          done += c;
        }
        if (h.digest() != g.hash) {
          ::close(fd);
          return mismatch(f.name, g, h.digest());
        }
      }
      ::close(fd);
    }
    return "";
  } catch (const std::exception& e) {
    return std::string("unreadable: ") + e.what();
  }
}

}  // namespace trainrun
