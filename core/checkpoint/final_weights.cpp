#include "core/checkpoint/final_weights.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <vector>

#include "core/common/error.h"
#include "core/common/fileio.h"
#include "core/model/model_io.h"

namespace trainrun {

namespace {

std::string parent_of(const std::string& path) {
  const size_t slash = path.find_last_of('/');
  return slash == std::string::npos ? "." : slash == 0 ? "/" : path.substr(0, slash);
}

// Rank 0: the temporary file at full size (blocks reserved, so a full disk
// shows up here rather than as some rank's short write).
void lay_out(const std::string& tmp, const std::string& header, int64_t total) {
  write_file_synced(tmp, header);
  const off_t size = off_t(header.size() + uint64_t(total) * 4);
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CLOEXEC);
  TR_CHECK_ERRNO(fd >= 0, "cannot open '", tmp, "'");
  try {
    reserve_file_size(fd, size, tmp);  // sparse where the filesystem cannot preallocate
  } catch (...) {
    ::close(fd);
    throw;
  }
  ::close(fd);
}

// This rank's ranges, piece by piece.
void write_mine(const std::string& tmp, uint64_t base, ParamStore& ps) {
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CLOEXEC);
  TR_CHECK_ERRNO(fd >= 0, "cannot open '", tmp, "'");
  try {
    const int64_t piece = int64_t(kFinalWeightsPiece / 4);
    std::vector<float> buf;
    for (const auto& r : ps.write_ranges()) {
      if (r.reps > 1) {  // strided (a TP slice): groups of whole runs, one pwrite per run
        const int64_t per = std::max<int64_t>(1, piece / r.count);
        for (int64_t first = 0; first < r.reps; first += per) {
          const ParamStore::Range part = r.rows(first, std::min(per, r.reps - first));
          buf.resize(size_t(part.numel()));
          ps.copy_state_range(0, part, buf.data());
          for (int64_t i = 0; i < part.reps; ++i)
            pwrite_all(fd, buf.data() + i * r.count, size_t(r.count) * 4,
                       off_t(base + uint64_t(part.global + i * r.stride) * 4), tmp);
        }
        continue;
      }
      for (int64_t at = 0; at < r.count; at += piece) {
        const int64_t n = std::min(piece, r.count - at);
        buf.resize(size_t(n));
        ps.copy_state_range(0, {r.global + at, n}, buf.data());
        pwrite_all(fd, buf.data(), size_t(n) * 4, off_t(base + uint64_t(r.global + at) * 4), tmp);
      }
    }
    TR_CHECK_ERRNO(::fsync(fd) == 0, "cannot fsync '", tmp, "'");
  } catch (...) {
    ::close(fd);
    throw;
  }
  TR_CHECK_ERRNO(::close(fd) == 0, "cannot close '", tmp, "'");
}

std::string what_of(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& x) {
    return x.what();
  } catch (...) {
    return "an unknown exception";
  }
}

}  // namespace

int64_t disk_wait_timeout_ms(const JobSpec& job) {
  return std::max<int64_t>(600'000, int64_t(job.parallel.timeout_s * 10'000));
}

void save_final_weights(const std::string& path, const ModelArch& arch, ParamStore& ps, int rank, int world,
                        Store* store, const std::string& key_prefix, std::chrono::milliseconds timeout) {
  TR_CHECK(world == 1 || store, "final weights: a multi-rank job needs the rendezvous store");
  const std::string header = model_file_header(arch);
  const int64_t total = arch.layout().total;
  // Rank 0 names the temporary file (its pid) for everyone.
  const std::string key = key_prefix + "final_weights/";
  std::string tmp = path + ".tmp." + std::to_string(::getpid());
  auto fail_all = [&](const std::string& msg) {
    TR_FAIL("final weights '", path, "' could not be written: ", msg);
  };

  // 1. rank 0 lays out the file.
  std::string status = "ok";
  if (rank == 0) {
    try {
      lay_out(tmp, header, total);
    } catch (...) {
      status = "rank 0: " + what_of(std::current_exception());
      ::unlink(tmp.c_str());
    }
    if (store) store->set(key + "ready", store_bytes(status == "ok" ? "ok" + tmp : status));
  } else {
    const std::string r = store_text(store->get(key + "ready", timeout));
    if (r.rfind("ok", 0) == 0) tmp = r.substr(2);
    else status = r;
  }
  if (status != "ok") fail_all(status);

  // 2. every rank writes its ranges and reports, whatever happened.
  std::string mine = "ok";
  try {
    // Tests: TRAINRUN_DEBUG_FINAL_WEIGHTS_FAIL_RANK=r makes rank r's write
    // throw something that is not a trainrun::Error.
    const char* fail = std::getenv("TRAINRUN_DEBUG_FINAL_WEIGHTS_FAIL_RANK");
    if (fail && *fail && std::atoi(fail) == rank) throw std::runtime_error("injected failure (debug hook)");
    write_mine(tmp, header.size(), ps);
  } catch (...) {
    mine = "rank " + std::to_string(rank) + ": " + what_of(std::current_exception());
  }
  if (store) store->set(key + "written/" + std::to_string(rank), store_bytes(mine));

  // 3. rank 0 commits once every rank reported ok; everyone learns the outcome.
  std::string outcome;
  if (rank == 0) {
    try {
      std::string first_bad;
      for (int r = 0; r < world && store; ++r) {
        const std::string s = store_text(store->get(key + "written/" + std::to_string(r), timeout));
        if (s != "ok" && first_bad.empty()) first_bad = s;
      }
      if (!store && mine != "ok") first_bad = mine;
      TR_CHECK(first_bad.empty(), first_bad);
      TR_CHECK(::rename(tmp.c_str(), path.c_str()) == 0, "cannot rename '", tmp, "' to '", path,
               "': ", detail::errno_string());
      fsync_path(parent_of(path));
      outcome = "ok";
    } catch (...) {
      outcome = what_of(std::current_exception());
      ::unlink(tmp.c_str());
    }
    if (store) store->set(key + "committed", store_bytes(outcome));
  } else {
    outcome = store_text(store->get(key + "committed", timeout));
  }
  if (outcome != "ok") fail_all(outcome);
}

}  // namespace trainrun
