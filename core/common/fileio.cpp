#include "core/common/fileio.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "core/common/error.h"

namespace trainrun {

bool reserve_file_size(int fd, off_t bytes, const std::string& path) {
  int rc = 0;
  do rc = ::fallocate(fd, 0, 0, bytes);
  while (rc != 0 && errno == EINTR);
  if (rc == 0) return true;
  const int e = errno;
  if (e == ENOSPC || e == EDQUOT || e == EFBIG) {
    errno = e;
    TR_CHECK_ERRNO(false, "cannot allocate ", bytes, " bytes for '", path, "' (disk full or file size limit?)");
  }
  TR_CHECK_ERRNO(::ftruncate(fd, bytes) == 0, "cannot size '", path, "' to ", bytes,
                 " bytes (its filesystem refused fallocate too: ", std::strerror(e), ")");
  return false;
}

void write_file_synced(const std::string& path, const std::string& data) {
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  TR_CHECK_ERRNO(fd >= 0, "cannot create '", path, "'");
  const char* p = data.data();
  size_t left = data.size();
  while (left) {
    ssize_t n = ::write(fd, p, left);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      int e = errno;
      ::close(fd);
      errno = e;
      TR_CHECK_ERRNO(false, "cannot write '", path, "' (disk full or file size limit?)");
    }
    p += n;
    left -= size_t(n);
  }
  if (::fsync(fd) != 0) {
    int e = errno;
    ::close(fd);
    errno = e;
    TR_CHECK_ERRNO(false, "cannot fsync '", path, "'");
  }
  ::close(fd);
}

void fsync_path(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return;
  ::fsync(fd);
  ::close(fd);
}

void pwrite_all(int fd, const void* data, size_t bytes, off_t off, const std::string& path) {
  const char* p = static_cast<const char*>(data);
  while (bytes) {
    ssize_t n = ::pwrite(fd, p, bytes, off);
    if (n < 0 && errno == EINTR) continue;
    TR_CHECK_ERRNO(n > 0, "cannot write '", path, "' (disk full or file size limit?)");
    p += n;
    bytes -= size_t(n);
    off += n;
  }
}

void pread_all(int fd, void* data, size_t bytes, off_t off, const std::string& path) {
  char* p = static_cast<char*>(data);
  while (bytes) {
    ssize_t n = ::pread(fd, p, bytes, off);
    if (n < 0 && errno == EINTR) continue;
    TR_CHECK_ERRNO(n > 0, "cannot read '", path, "' (truncated?)");
    p += n;
    bytes -= size_t(n);
    off += n;
  }
}

}  // namespace trainrun
