// Fingerprint of a base model directory (base_fingerprint.h).
#include "core/checkpoint/base_fingerprint.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <vector>

#include "core/checkpoint/format.h"
#include "core/common/error.h"

namespace fs = std::filesystem;

namespace trainrun {

namespace {
constexpr size_t kHead = size_t(1) << 20, kSample = size_t(64) << 10;
constexpr int kSamples = 32;

// Hashes bytes [off, off + n) of fd into h (short at the end of the file).
void hash_range(int fd, const std::string& path, uint64_t off, size_t n, std::vector<char>& buf, ckpt::Hasher& h) {
  buf.resize(n);
  size_t got = 0;
  while (got < n) {
    const ssize_t r = ::pread(fd, buf.data() + got, n - got, off_t(off + got));
    if (r < 0 && errno == EINTR) continue;
    TR_CHECK(r >= 0, "model.init_from: cannot read '", path, "': ", std::strerror(errno));
    if (r == 0) break;
    got += size_t(r);
  }
  h.update(buf.data(), got);
}
}  // namespace

std::string BaseFingerprint::describe() const {
  char gb[32];
  std::snprintf(gb, sizeof gb, "%.2f GB", double(bytes) / 1e9);
  return "xxhash64 " + hash + " over " + std::to_string(files) + (files == 1 ? " file, " : " files, ") + gb;
}

BaseFingerprint fingerprint_base(const std::string& dir) {
  std::error_code ec;
  std::vector<fs::path> files;
  if (fs::is_regular_file(dir, ec)) {
    files.push_back(dir);
  } else {
    for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
      const std::string name = it->path().filename().string();
      const bool st = name.size() > 12 && name.compare(name.size() - 12, 12, ".safetensors") == 0;
      if ((st || name == "config.json") && it->is_regular_file()) files.push_back(it->path());
    }
    TR_CHECK(!ec, "model.init_from: cannot list '", dir, "': ", ec.message());
  }
  std::sort(files.begin(), files.end());
  TR_CHECK(!files.empty(), "model.init_from: '", dir, "' has no *.safetensors or config.json to fingerprint");
  BaseFingerprint fp;
  ckpt::Hasher h;
  h.reset();
  std::vector<char> buf;
  for (const fs::path& p : files) {
    const std::string path = p.string(), name = p.filename().string();
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    TR_CHECK(fd >= 0, "model.init_from: cannot open '", path, "': ", std::strerror(errno));
    const off_t end = ::lseek(fd, 0, SEEK_END);
    try {
      TR_CHECK(end >= 0, "model.init_from: cannot size '", path, "': ", std::strerror(errno));
      const uint64_t size = uint64_t(end);
      h.update(name.data(), name.size() + 1);  // with its NUL: names never run into sizes
      h.update(&size, sizeof size);
      hash_range(fd, path, 0, size_t(std::min<uint64_t>(size, kHead)), buf, h);
      if (size > kHead) {
        // Samples spread from just past the head to the file's last bytes.
        const uint64_t span = size - kHead - std::min<uint64_t>(size - kHead, kSample);
        for (int i = 0; i < kSamples; ++i)
          hash_range(fd, path, kHead + span * uint64_t(i) / uint64_t(kSamples - 1), kSample, buf, h);
      }
      fp.bytes += size;
      ++fp.files;
    } catch (...) {
      ::close(fd);
      throw;
    }
    ::close(fd);
  }
  fp.hash = ckpt::hex64(h.digest());
  return fp;
}

}  // namespace trainrun
