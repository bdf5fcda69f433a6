// The disk I/O of parallel.offload: nvme. One state file per rank, read and
// written in whole 4 KiB pages (O_DIRECT), through one of two engines:
//
//   io_uring  (liburing, when built in: TRAINRUN_HAVE_LIBURING) one ring per
//             file; a batch of reads/writes is one submission, so the
//             kernel queues them to the disk together, no I/O threads;
//   pool      pread/pwrite on two I/O threads, one batch per job; used when
//             liburing was not built in or the kernel refuses a ring
//             (io_uring_disabled, seccomp in a container): logged once.
//
// TRAINRUN_OFFLOAD_IO=auto|uring|pool picks one (default auto: io_uring when
// it works); uring errors out when io_uring cannot be used, pool forces the
// fallback (the tests run both and compare).
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace trainrun {

// Blocking whole-buffer I/O, each error naming the path: a short read (the
// file is shorter than the state), a full disk (ENOSPC), any other errno.
void pread_full(int fd, const std::string& path, void* buf, size_t bytes, uint64_t offset);
void pwrite_full(int fd, const std::string& path, const void* buf, size_t bytes, uint64_t offset);

struct IoOp {
  bool write = false;
  void* buf = nullptr;
  size_t bytes = 0;
  uint64_t offset = 0;
};

enum class IoChoice { Auto, Uring, Pool };
// "auto" | "uring" | "pool"; anything else names TRAINRUN_OFFLOAD_IO.
IoChoice parse_io_choice(const std::string& text);
// TRAINRUN_OFFLOAD_IO, Auto when unset.
IoChoice io_choice_from_env();

class IoEngine {
 public:
  virtual ~IoEngine() = default;
  // Starts every op of the batch on the engine's file; the buffers must stay
  // untouched until wait() returns for the ticket.
  virtual uint64_t submit(const std::vector<IoOp>& ops) = 0;
  // Blocks until the batch is complete; throws its first error.
  virtual void wait(uint64_t ticket) = 0;
  virtual const char* name() const = 0;  // "io_uring" | "pool"
};

// Whether this binary was built with liburing.
bool io_uring_built_in();
// The engine for `fd` (errors name `path`). With Auto, `fallback_reason` is
// set when the pool is used for lack of io_uring (empty otherwise).
std::unique_ptr<IoEngine> make_io_engine(int fd, const std::string& path, IoChoice choice,
                                         std::string* fallback_reason);

}  // namespace trainrun
