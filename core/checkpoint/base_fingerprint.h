// A fingerprint of a frozen base model's files (model.init_from), recorded
// in every adapter checkpoint's manifest so that resuming the adapters on a
// different base is an error instead of silently wrong weights.
//
// Why not a hash of every byte: the base of a 70B adapter run is ~140 GB on
// NFS/Lustre, and every resume would read all of it once more just to hash
// it. The fingerprint reads ~3 MiB per file instead: for each
// *.safetensors file and config.json of the directory (sorted by name) its
// name, size, first MiB (the safetensors header: every tensor's name, dtype,
// shape and offsets) and 32 samples of 64 KiB spread evenly over the file.
// Another checkpoint of the same architecture (a different fine-tune, a
// re-download of another revision) differs in nearly every sampled byte;
// an edit of a few weights in place between the samples is not detected.
#pragma once
#include <string>

namespace trainrun {

struct BaseFingerprint {
  std::string hash;   // 16 hex digits (xxhash64 over everything read)
  int files = 0;
  unsigned long long bytes = 0;  // the files' total size
  std::string describe() const;  // "xxhash64 3f2a... over 4 files, 16.1 GB"
};

// Throws Error naming the directory when it cannot be listed or read.
BaseFingerprint fingerprint_base(const std::string& dir);

}  // namespace trainrun
