#include "core/checkpoint/format.h"

#include <cxxabi.h>
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
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

namespace {
std::atomic<uint64_t> g_write_calls{0};
}  // namespace

void count_checkpoint_write() { g_write_calls.fetch_add(1, std::memory_order_relaxed); }

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
      count_checkpoint_write();
      done += c;
    }
    segs.push_back({off, n, h.digest()});
    data += n;
    off += n;
    bytes -= n;
  }
}

uint64_t runs_per_segment(uint64_t bytes) { return bytes == 0 ? 1 : std::max<uint64_t>(1, kSegmentBytes / bytes); }

void hashed_pwrite_strided(int fd, const char* data, uint64_t bytes, uint64_t stride, uint64_t reps, uint64_t off,
                           const std::string& path, Hasher& h, std::vector<Segment>& segs) {
  if (reps <= 1 || bytes > kSegmentBytes) {
    for (uint64_t i = 0; i < reps; ++i) hashed_pwrite(fd, data + i * bytes, bytes, off + i * stride, path, h, segs);
    return;
  }
  const uint64_t per = runs_per_segment(bytes);
  for (uint64_t first = 0; first < reps; first += per) {
    const uint64_t n = std::min(per, reps - first);
    h.reset();
    for (uint64_t i = first; i < first + n; ++i) {
      h.update(data + i * bytes, size_t(bytes));
      pwrite_all(fd, data + i * bytes, size_t(bytes), off_t(off + i * stride), path);
      count_checkpoint_write();
    }
    if (n == 1)
      segs.push_back({off + first * stride, bytes, h.digest()});
    else
      segs.push_back({off + first * stride, bytes, h.digest(), stride, n});
  }
}

std::string tiling_error(std::vector<Segment> segs, uint64_t size) {
  // Each segment yields its runs in file order; a min-heap on the next run's
  // offset walks all of them in file order, checking each starts where the
  // previous ended.
  struct Cursor {
    uint64_t at;  // offset of the segment's next run
    size_t seg;
    uint64_t rep;
  };
  auto later = [](const Cursor& a, const Cursor& b) { return a.at > b.at; };
  std::vector<Cursor> heap;
  heap.reserve(segs.size());
  // Arithmetic first, before walking any run: every segment inside the file
  // and their runs adding up to no more than its size (both without
  // overflow). The walk below visits each run once, so a hostile "reps"
  // (2^60 runs) must be refused here, not counted out.
  uint64_t covered = 0;
  for (size_t i = 0; i < segs.size(); ++i) {
    const Segment& g = segs[i];
    const std::string at = "a segment at byte " + std::to_string(g.offset);
    if (g.bytes == 0 || g.reps == 0) return "an empty segment at byte " + std::to_string(g.offset);
    if (g.reps > 1 && g.stride < g.bytes)
      return "a strided segment at byte " + std::to_string(g.offset) + " whose runs overlap (stride " +
             std::to_string(g.stride) + " < " + std::to_string(g.bytes) + " bytes)";
    uint64_t span = 0, end = 0, run_bytes = 0;
    if (__builtin_mul_overflow(g.reps - 1, g.stride, &span) || __builtin_add_overflow(span, g.bytes, &span) ||
        __builtin_add_overflow(span, g.offset, &end) || end > size)
      return at + " (" + std::to_string(g.reps) + " runs of " + std::to_string(g.bytes) + " bytes, " +
             std::to_string(g.stride) + " apart) ends past the file's " + std::to_string(size) + " bytes";
    if (__builtin_mul_overflow(g.reps, g.bytes, &run_bytes) || __builtin_add_overflow(covered, run_bytes, &covered) ||
        covered > size)
      return "they hold more bytes than the file's " + std::to_string(size) + " (the runs up to " + at +
             " overlap)";
    heap.push_back({g.offset, i, 0});
  }
  // Bounded now: at most one run per byte of the file. A shortfall is
  // found there, at the byte where the gap is.
  std::make_heap(heap.begin(), heap.end(), later);
  uint64_t at = 0;
  while (!heap.empty()) {
    std::pop_heap(heap.begin(), heap.end(), later);
    Cursor c = heap.back();
    heap.pop_back();
    if (c.at != at) return std::string(c.at < at ? "overlap" : "gap") + " at byte " + std::to_string(std::min(at, c.at));
    const Segment& g = segs[c.seg];
    at += g.bytes;
    if (++c.rep < g.reps) {
      c.at += g.stride;
      heap.push_back(c);
      std::push_heap(heap.begin(), heap.end(), later);
    }
  }
  if (at != size) return "they cover " + std::to_string(at) + " of its " + std::to_string(size) + " bytes";
  return "";
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
  const std::string runs = s.reps > 1 ? " (" + std::to_string(s.reps) + " runs of " + std::to_string(s.bytes) +
                                            " bytes, " + std::to_string(s.stride) + " apart)"
                                      : "";
  return name + ": checksum mismatch in bytes [" + std::to_string(s.offset) + ", " + std::to_string(s.end()) + ")" +
         runs + " (xxhash64 " + hex64(have) + ", manifest " + hex64(s.hash) + "); the file is corrupt";
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
      if (j.contains("reps") || j.contains("stride")) {  // format 3: strided
        TR_CHECK(j.contains("reps") && j.at("reps").is_number_unsigned() && j.contains("stride") &&
                     j.at("stride").is_number_unsigned() && j.at("reps").get<uint64_t>() >= 1,
                 "manifest.json: files.", name, ".segments has a strided entry without a valid stride and reps: ",
                 j.dump());
        s.stride = j.at("stride").get<uint64_t>();
        s.reps = j.at("reps").get<uint64_t>();
      }
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
  const std::string flaw = tiling_error(f.segments, f.size);
  TR_CHECK(flaw.empty(), "manifest.json: the segments of ", name, " do not tile the file: ", flaw);
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
      // The size on disk first: the segments are then checked against the
      // file as it is, not against whatever size the manifest claims.
      const uint64_t have = fs::file_size(path);
      if (info.is_object() && info.contains("size") && info.at("size").is_number_unsigned() &&
          info.at("size").get<uint64_t>() != have)
        return name + " has " + std::to_string(have) + " bytes, the manifest says " +
               std::to_string(info.at("size").get<uint64_t>()) + " (truncated?)";
      FileEntry e = file_entry(name, info);
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

uint64_t Checkpointer::write_calls() { return g_write_calls.load(); }

std::string Checkpointer::verify(const std::string& dir, const std::vector<std::string>& only) {
  std::vector<FileEntry> files;
  std::string why = check_manifest(dir, nullptr, &files);
  if (!why.empty()) return why;
  for (const std::string& name : only)
    if (std::none_of(files.begin(), files.end(), [&](const FileEntry& e) { return e.name == name; }))
      return "manifest.json does not list " + name;
  try {
    Hasher h;
    std::vector<char> buf(kIoChunk);
    for (const FileEntry& f : files) {
      if (!only.empty() && std::find(only.begin(), only.end(), f.name) == only.end()) continue;
      const std::string path = dir + "/" + f.name;
      int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
      TR_CHECK_ERRNO(fd >= 0, "cannot open '", path, "'");
      ::posix_fadvise(fd, 0, 0, POSIX_FADV_SEQUENTIAL);
      // The segments tile the file: one pass over them reads every byte once
      // (in file order, but for strided segments, whose runs interleave).
      for (const Segment& g : f.segments) {
        h.reset();
        for (uint64_t rep = 0; rep < g.reps; ++rep) {
          const uint64_t off = g.offset + rep * g.stride;
          for (uint64_t done = 0; done < g.bytes;) {
            const size_t c = size_t(std::min<uint64_t>(g.bytes - done, buf.size()));
            try {
              pread_all(fd, buf.data(), c, off_t(off + done), path);
            } catch (...) {
              ::close(fd);
              throw;
            }
            h.update(buf.data(), c);
            done += c;
          }
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
