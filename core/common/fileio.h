// Durable file writes shared by checkpoints, exports and safetensors: write
// everything (EINTR, short writes), fsync, and name the file in errors.
#pragma once
#include <sys/types.h>

#include <string>

namespace trainrun {

// Create/truncate `path`, write all of `data`, fsync. Throws Error naming
// the file ("disk full or file size limit?" on a failed write).
void write_file_synced(const std::string& path, const std::string& data);
// fsync a file or a directory by path (best effort: a directory entry
// becomes durable only after its directory is synced).
void fsync_path(const std::string& path);
// Positional I/O that loops over partial transfers; errors name `path`.
void pwrite_all(int fd, const void* data, size_t bytes, off_t off, const std::string& path);
void pread_all(int fd, void* data, size_t bytes, off_t off, const std::string& path);

// Sizes the file open on `fd` to `bytes`, reserving its blocks with
// fallocate(2) so that a full disk or a quota shows up here, before anyone
// writes (an Error naming `path`). Where the filesystem cannot preallocate
// (NFSv3, BeeGFS class: EOPNOTSUPP; and anything else but a space error)
// the file is made sparse with ftruncate instead, and false is returned.
// Not posix_fallocate: where the filesystem refuses, glibc emulates it by
// reading and writing every block, which fails with EBADF on a write-only
// descriptor (and costs a pass over the file on any other).
bool reserve_file_size(int fd, off_t bytes, const std::string& path);

}  // namespace trainrun
