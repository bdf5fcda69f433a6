// The on-disk format of a checkpoint directory (see checkpoint.h), shared
// by the save side (checkpoint.cpp: the commit protocol) and the load side
// (resume.cpp): directory names, the two files' headers, hashing in
// segments, the manifest's "files" entries. Internal to core/checkpoint.
#pragma once
#include <xxhash.h>

#include <cstdint>
#include <new>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/checkpoint/checkpoint.h"

namespace trainrun::ckpt {

using json = nlohmann::ordered_json;
using Segment = Checkpointer::Segment;

// 3: segments may be strided ("stride", "reps": a tensor-parallel rank's
// slice of an inner dimension, one run per row); 2: per-segment xxhash64
// ("segments"); 1: one xxhash64 per file. All three load.
constexpr int kFormatVersion = 3;
// The largest range one hash covers: what a rank loading a resharded
// checkpoint reads beyond its own ranges, at most, to verify them.
constexpr uint64_t kSegmentBytes = uint64_t(64) << 20;
// I/O granularity: each piece is hashed right before it is written or right
// after it is read, while it is still in the CPU cache.
constexpr size_t kIoChunk = size_t(4) << 20;

inline const char* const kFileNames[2] = {"model.safetensors", "optimizer.safetensors"};

// "step_00000042", and back (false for any other name).
std::string step_name(int64_t step);
bool parse_step_name(const std::string& name, int64_t* step);

// The two files' headers: F32 tensors in the flat layout's order, so
// global element g of kind k sits at a fixed offset every rank can compute.
std::string model_header(const ModelArch& arch, const ParamLayout& lay);
std::string optimizer_header(const ParamLayout& lay);

// An XXH64 state that frees itself.
class Hasher {
 public:
  Hasher() : st_(XXH64_createState()) {
    if (!st_) throw std::bad_alloc();
    reset();
  }
  ~Hasher() { XXH64_freeState(st_); }
  Hasher(const Hasher&) = delete;
  Hasher& operator=(const Hasher&) = delete;
  void reset() { XXH64_reset(st_, 0); }
  void update(const void* p, size_t n) { XXH64_update(st_, p, n); }
  uint64_t digest() const { return XXH64_digest(st_); }

 private:
  XXH64_state_t* st_;
};

// xxhash64 values as the manifest writes them: 16 lowercase hex digits.
std::string hex64(uint64_t h);
bool parse_hex64(const std::string& s, uint64_t* out);

// pwrite()s [data, data + bytes) at `off`, hashing it on the way in
// segments of at most kSegmentBytes, appended to `segs`.
void hashed_pwrite(int fd, const char* data, uint64_t bytes, uint64_t off, const std::string& path, Hasher& h,
                   std::vector<Segment>& segs);
// The strided form: `reps` runs of `bytes` bytes, `stride` bytes apart in
// the file from `off`, back to back in `data`. One segment per group of
// runs of at most kSegmentBytes (a run longer than that: contiguous
// segments per run), so a rank's whole slice of a tensor is a few manifest
// entries, not one per row. Still one pwrite per run: the runs are not
// adjacent in the file, so no vectored call can merge them.
void hashed_pwrite_strided(int fd, const char* data, uint64_t bytes, uint64_t stride, uint64_t reps, uint64_t off,
                           const std::string& path, Hasher& h, std::vector<Segment>& segs);
// Every pwrite of checkpoint data in this process (all ranks, all files):
// Checkpointer::write_calls() reads it, for the tests and `bench checkpoint`.
void count_checkpoint_write();
// Runs per strided segment for runs of `bytes` (what every writer uses, so a
// synchronous save that streams a range in pieces hashes as one whole write).
uint64_t runs_per_segment(uint64_t bytes);
// "" when `segs` (any order) cover [0, size) exactly once, else the first
// gap or overlap. A merge over the segments' runs: memory per segment, time
// per run.
std::string tiling_error(std::vector<Segment> segs, uint64_t size);
// pread()s [off, off + bytes) into `dst` in cache-sized pieces, feeding `h`.
void hashed_pread(int fd, char* dst, uint64_t bytes, uint64_t off, const std::string& path, Hasher& h);
// "<file>: checksum mismatch in bytes [a, b) (...)".
std::string mismatch(const std::string& name, const Segment& s, uint64_t have);

// A data file as the manifest describes it.
struct FileEntry {
  std::string name;
  uint64_t size = 0;
  std::vector<Segment> segments;  // sorted, tiling [0, size)
};

// The segments of one "files" entry: format 2's list, or format 1's
// whole-file hash as one segment. Throws Error naming the file and the flaw.
FileEntry file_entry(const std::string& name, const json& info);

// Everything about a checkpoint directory that needs no data read: the
// manifest, its format, every file there at its size. "" when good (and
// the manifest in *out), else what is wrong.
std::string check_manifest(const std::string& dir, json* out, std::vector<FileEntry>* files);

// The exception being handled, for a message: an Error's own text; for
// anything else its what() and type, so that a std::bad_alloc or a
// filesystem_error escaping some library still says what it is.
// Call only inside a catch block.
std::string current_exception_text();

}  // namespace trainrun::ckpt
