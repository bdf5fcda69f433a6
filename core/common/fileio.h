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

}  // namespace trainrun
