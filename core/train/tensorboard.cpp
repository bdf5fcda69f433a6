#include "core/train/tensorboard.h"

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>

#include "core/common/error.h"
#include "core/train/proto/tensorboard_event.pb.h"

namespace fs = std::filesystem;

namespace trainrun {

namespace {

struct Crc32cTable {
  uint32_t t[256];
  Crc32cTable() {
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
      t[i] = c;
    }
  }
};

double unix_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

void put_le(std::string& out, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out.push_back(char((v >> (8 * i)) & 0xff));
}

}  // namespace

uint32_t crc32c(const void* data, size_t n, uint32_t crc) {
  static const Crc32cTable table;
  const auto* p = static_cast<const unsigned char*>(data);
  crc = ~crc;
  for (size_t i = 0; i < n; ++i) crc = table.t[(crc ^ p[i]) & 0xff] ^ (crc >> 8);
  return ~crc;
}

uint32_t masked_crc32c(const void* data, size_t n) {
  const uint32_t crc = crc32c(data, n);
  return ((crc >> 15) | (crc << 17)) + 0xa282ead8u;
}

std::string tfrecord_frame(const std::string& payload) {
  std::string out;
  out.reserve(payload.size() + 16);
  put_le(out, payload.size(), 8);
  put_le(out, masked_crc32c(out.data(), 8), 4);
  out += payload;
  put_le(out, masked_crc32c(payload.data(), payload.size()), 4);
  return out;
}

TensorBoardWriter::TensorBoardWriter(const std::string& dir) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  TR_CHECK(!ec, "tensorboard: cannot create '", dir, "': ", ec.message(), "; check that output.dir is writable");
  char host[256] = "localhost";
  if (::gethostname(host, sizeof host - 1) != 0) std::snprintf(host, sizeof host, "localhost");
  host[sizeof host - 1] = 0;
  // TensorBoard reads a directory's files in name order, and a SessionLog
  // START only purges what was read before it: a new file must sort after
  // every existing one, even when a resumed run starts within the same
  // second as the last (the seconds field, 10 digits, decides the order).
  int64_t secs = int64_t(unix_seconds());
  const std::string prefix = "events.out.tfevents.";
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string n = e.path().filename().string();
    if (n.rfind(prefix, 0) != 0) continue;
    const int64_t t = std::atoll(n.c_str() + prefix.size());
    if (t >= secs) secs = t + 1;
  }
  // The counter keeps two writers of one process apart as well.
  static std::atomic<int> counter{0};
  const std::string name = prefix + std::to_string(secs) + "." + host + "." + std::to_string(::getpid()) + "." +
                           std::to_string(counter++);
  path_ = (fs::path(dir) / name).string();
  f_ = std::fopen(path_.c_str(), "wb");
  TR_CHECK_ERRNO(f_, "tensorboard: cannot create '", path_, "'");
  tensorboard::Event ev;
  ev.set_wall_time(unix_seconds());
  ev.set_file_version("brain.Event:2");
  write_event(ev.SerializeAsString());
}

TensorBoardWriter::~TensorBoardWriter() {
  if (f_) std::fclose(f_);
}

void TensorBoardWriter::add_scalars(int64_t step, const std::vector<std::pair<std::string, double>>& values) {
  tensorboard::Event ev;
  ev.set_wall_time(unix_seconds());
  ev.set_step(step);
  auto* summary = ev.mutable_summary();
  for (const auto& [tag, v] : values) {
    if (!std::isfinite(v)) continue;
    auto* val = summary->add_value();
    val->set_tag(tag);
    val->set_simple_value(float(v));
  }
  if (summary->value_size() == 0) return;
  write_event(ev.SerializeAsString());
}

void TensorBoardWriter::add_session_start(int64_t step) {
  tensorboard::Event ev;
  ev.set_wall_time(unix_seconds());
  ev.set_step(step);
  ev.mutable_session_log()->set_status(tensorboard::SessionLog::START);
  write_event(ev.SerializeAsString());
}

void TensorBoardWriter::write_event(const std::string& payload) {
  const std::string rec = tfrecord_frame(payload);
  TR_CHECK_ERRNO(std::fwrite(rec.data(), 1, rec.size(), f_) == rec.size() && std::fflush(f_) == 0,
                 "tensorboard: cannot write '", path_, "' (disk full?)");
}

}  // namespace trainrun
