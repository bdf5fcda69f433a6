/* LD_PRELOAD shim for the tests (tests/test_hostile_io.cpp): a filesystem
 * that cannot preallocate (NFSv3, BeeGFS class). fallocate(2) fails with
 * EOPNOTSUPP, as the kernel answers there; posix_fallocate fails with
 * EBADF, as glibc's emulation (a read and a write per block) does on such a
 * filesystem when the descriptor is write-only. Each call appends its name
 * to $TRAINRUN_SHIM_LOG when that is set, so a test can tell the shim was
 * in the process at all. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static void note(const char* what) {
  const char* path = getenv("TRAINRUN_SHIM_LOG");
  if (!path || !*path) return;
  int fd = open(path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (fd < 0) return;
  ssize_t n = write(fd, what, strlen(what));
  n = write(fd, "\n", 1);
  (void)n;
  close(fd);
}

int fallocate(int fd, int mode, off_t offset, off_t len) {
  (void)fd, (void)mode, (void)offset, (void)len;
  note("fallocate");
  errno = EOPNOTSUPP;
  return -1;
}

int fallocate64(int fd, int mode, off64_t offset, off64_t len) {
  (void)fd, (void)mode, (void)offset, (void)len;
  note("fallocate64");
  errno = EOPNOTSUPP;
  return -1;
}

int posix_fallocate(int fd, off_t offset, off_t len) {
  (void)fd, (void)offset, (void)len;
  note("posix_fallocate");
  return EBADF;
}

int posix_fallocate64(int fd, off64_t offset, off64_t len) {
  (void)fd, (void)offset, (void)len;
  note("posix_fallocate64");
  return EBADF;
}
