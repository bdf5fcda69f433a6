// TensorBoard event files, so `tensorboard --logdir <output.dir>/tb` shows a
// run's scalars (rank 0 writes them).
//
// The format: a TFRecord file, i.e. a sequence of records
//   uint64 length (little endian) | uint32 masked_crc32c(length bytes)
//   | payload | uint32 masked_crc32c(payload)
// where each payload is a serialized tensorboard.Event protobuf (see
// proto/tensorboard_event.proto); the first event carries
// file_version "brain.Event:2", each later one a Summary of simple_value
// scalars at a step. The mask is ((crc >> 15) | (crc << 17)) + 0xa282ead8.
//
// Why protobuf from Debian's libprotobuf and not hand-encoded bytes: the
// payload is a public protobuf schema; the library's encoder is the one
// TensorBoard's decoder is tested against. CRC32C is written here (20
// lines, checked against the standard test vector) because Debian packages
// no C/C++ CRC32C library and the record framing is not protobuf's concern.
#pragma once
#include <cstdint>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

namespace trainrun {

// CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), continuing from `crc`.
uint32_t crc32c(const void* data, size_t n, uint32_t crc = 0);
// TFRecord's masked form of the CRC of `data`.
uint32_t masked_crc32c(const void* data, size_t n);
// One TFRecord: length, masked CRC of the length, payload, masked CRC of the payload.
std::string tfrecord_frame(const std::string& payload);

class TensorBoardWriter {
 public:
  // Creates `dir` and a new event file in it named like TensorFlow's:
  // events.out.tfevents.<unix seconds>.<host>.<pid>.<n>. A resumed run gets
  // a new file; TensorBoard merges every file of a directory by step.
  explicit TensorBoardWriter(const std::string& dir);
  ~TensorBoardWriter();
  TensorBoardWriter(const TensorBoardWriter&) = delete;
  TensorBoardWriter& operator=(const TensorBoardWriter&) = delete;

  // One Event at `step` holding every (tag, value) as a simple_value scalar;
  // non-finite values are skipped (TensorBoard would plot them as gaps anyway).
  // Flushed at once, so a live TensorBoard sees each step as it is written.
  void add_scalars(int64_t step, const std::vector<std::pair<std::string, double>>& values);
  void add_scalar(const std::string& tag, int64_t step, double value) { add_scalars(step, {{tag, value}}); }
  // SessionLog START at `step`: TensorBoard discards what earlier files hold
  // for steps >= `step`, so a resumed run (or a fresh run in a reused
  // directory, step 1) shows one consistent history, as metrics.jsonl does.
  void add_session_start(int64_t step);
  const std::string& path() const { return path_; }

 private:
  void write_event(const std::string& payload);
  std::FILE* f_ = nullptr;
  std::string path_;
};

}  // namespace trainrun
