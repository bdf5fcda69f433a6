// A two-rank point-to-point communicator over shared memory (communicator.h:
// make_shm_communicator), for pipeline links between ranks on one host.
//
// Why: the pipeline moves one activation and one gradient per microbatch
// and stage boundary, each on the critical path of the schedule's warm-up
// and cool-down. Over Gloo's TCP loopback a 256 KiB message takes about a
// millisecond (a rendezvous over the socket plus the transport thread's
// wake-ups, which compete with the compute on a rank's own core); here it
// is a memcpy into a ring and one futex wake.
//
// Layout: one mapping holds a header and a ring per direction (ring d is
// written by rank d and read by rank 1 - d). A message is a 16-byte frame
// (magic, tag, size) and its bytes, streamed through the ring in pieces,
// so a message may be larger than the ring. head/tail count bytes ever
// written/read (monotonic; position = count % capacity). The writer
// publishes with a release store of head, the reader with one of tail;
// a side that finds nothing to do spins briefly, then sleeps on a futex
// word its peer bumps after every advance (a shared, not private, futex).
//
// Messages between the pair arrive in the order they were sent (one ring
// per direction): a receive whose frame has another tag or size is an
// Error naming both (the pipeline's link-order check makes that a bug).
//
// Failure: every wait has the timeout; it also checks every 50 ms whether
// the peer process still exists (its pid is in the header), so a peer that
// died is reported as such within that, not after the whole timeout. The
// pid means the same process to both only in one PID namespace, so a link
// is shared memory only between processes of one (shm_identity).
// Lifetime: rank 0 creates the segment under a random name and unlinks it
// as soon as rank 1 has mapped it, so nothing is left in /dev/shm even if
// both die afterwards.
#include <fcntl.h>
#include <linux/futex.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <chrono>
#include <cstring>
#include <random>
#include <thread>

#include "parallel/comm/communicator.h"

namespace trainrun {

namespace {

using Clock = std::chrono::steady_clock;

constexpr uint64_t kMagic = 0x74726e73686d3031ull;  // "trnshm01"
constexpr uint32_t kFrameMagic = 0x6d737367u;       // "gssm"
constexpr uint32_t kAllToAllTag = 0xa11702a1u;      // all_to_all's transfer (user tags are small)

struct alignas(64) Ring {
  alignas(64) std::atomic<uint64_t> head{0};  // bytes written (by the writer)
  alignas(64) std::atomic<uint64_t> tail{0};  // bytes read (by the reader)
  // Bumped after head advances (the reader sleeps on it) and after tail
  // advances (the writer sleeps on it when the ring is full).
  alignas(64) std::atomic<uint32_t> wrote{0};
  std::atomic<uint32_t> reader_waits{0};
  alignas(64) std::atomic<uint32_t> read{0};
  std::atomic<uint32_t> writer_waits{0};
};

struct Header {
  uint64_t magic;
  uint64_t capacity;  // bytes per ring
  std::atomic<int32_t> pid[2];
  alignas(64) std::atomic<uint32_t> barrier[2];
  Ring ring[2];
};

static_assert(std::atomic<uint64_t>::is_always_lock_free && std::atomic<uint32_t>::is_always_lock_free,
              "shared-memory atomics must be lock-free to work across processes");

struct Frame {
  uint32_t magic, tag;
  uint64_t bytes;
};

void futex_wait(std::atomic<uint32_t>* word, uint32_t seen, std::chrono::microseconds max) {
  timespec ts{time_t(max.count() / 1000000), long(max.count() % 1000000) * 1000};
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, seen, &ts, nullptr, 0);
}
void futex_wake(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT32_MAX, nullptr, nullptr, 0);
}

class ShmCommunicator final : public Communicator {
 public:
  ShmCommunicator(Store& store, const std::string& prefix, int rank, std::chrono::milliseconds timeout,
                  size_t ring_bytes)
      : rank_(rank), timeout_(timeout) {
    TR_CHECK(rank == 0 || rank == 1, "shm link: rank ", rank, " (a link has ranks 0 and 1)");
    const size_t cap = std::max<size_t>(4096, (ring_bytes + 4095) / 4096 * 4096);
    if (rank == 0) {
      std::random_device rd;
      name_ = detail::cat("/trainrun-", ::getpid(), "-", std::hex, rd(), rd());
      const int fd = ::shm_open(name_.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
      TR_CHECK(fd >= 0, "shm link ", prefix, ": shm_open('", name_, "') failed: ", std::strerror(errno),
               " (is /dev/shm mounted and writable?)");
      bytes_ = sizeof(Header) + 2 * cap;
      if (::ftruncate(fd, off_t(bytes_)) != 0) {
        const int e = errno;
        ::close(fd);
        ::shm_unlink(name_.c_str());
        TR_FAIL("shm link ", prefix, ": cannot size '", name_, "' to ", bytes_, " bytes: ", std::strerror(e),
                " (/dev/shm full?)");
      }
      map(fd, prefix);
      h_ = new (base_) Header();
      h_->magic = kMagic;
      h_->capacity = cap;
      h_->pid[0].store(::getpid());
      h_->pid[1].store(0);
      store.set(prefix + "shm_name", store_bytes(name_));
      // Unlinked once rank 1 has it mapped (or we give up): nothing stays behind.
      try {
        store.get(prefix + "shm_mapped", timeout_);
      } catch (...) {
        ::shm_unlink(name_.c_str());
        throw;
      }
      ::shm_unlink(name_.c_str());
    } else {
      name_ = store_text(store.get(prefix + "shm_name", timeout_));
      const int fd = ::shm_open(name_.c_str(), O_RDWR, 0600);
      TR_CHECK(fd >= 0, "shm link ", prefix, ": shm_open('", name_, "') failed: ", std::strerror(errno),
               "; a shared-memory link needs both ranks on one host");
      struct stat st {};
      TR_CHECK(::fstat(fd, &st) == 0 && size_t(st.st_size) > sizeof(Header), "shm link ", prefix, ": '", name_,
               "' is not a link segment");
      bytes_ = size_t(st.st_size);
      map(fd, prefix);
      h_ = static_cast<Header*>(base_);
      TR_CHECK(h_->magic == kMagic && sizeof(Header) + 2 * h_->capacity == bytes_, "shm link ", prefix, ": '", name_,
               "' is not a trainrun link segment (another build?)");
      h_->pid[1].store(::getpid());
      store.set(prefix + "shm_mapped", store_bytes("1"));
    }
    cap_ = h_->capacity;
    data_ = static_cast<char*>(base_) + sizeof(Header);
    set_group(prefix);
  }
  ~ShmCommunicator() override {
    if (base_) ::munmap(base_, bytes_);
  }

  int rank() const override { return rank_; }
  int world_size() const override { return 2; }
  std::string name() const override { return "shm"; }

  void all_reduce(float*, int64_t, ReduceOp) override { no("all_reduce"); }
  void reduce_scatter(float*, const float*, int64_t, ReduceOp) override { no("reduce_scatter"); }
  void all_gather(void*, const void*, size_t) override { no("all_gather"); }
  void broadcast(void*, size_t, int) override { no("broadcast"); }
  void barrier() override {
    const auto t0 = Clock::now();
    const uint32_t mine = h_->barrier[rank_].fetch_add(1) + 1;
    futex_wake(&h_->barrier[rank_]);
    std::atomic<uint32_t>& theirs = h_->barrier[1 - rank_];
    while (int32_t(theirs.load() - mine) < 0) {
      check_wait("barrier", t0);
      const uint32_t seen = theirs.load();
      if (int32_t(seen - mine) >= 0) break;
      futex_wait(&theirs, seen, std::chrono::microseconds(50000));
    }
  }

  // Of a pair, each keeps its own block and swaps the other's.
  void all_to_all(void* out, const void* in, size_t bytes_per_rank) override {
    if (bytes_per_rank == 0) return;
    const int peer = 1 - rank_;
    std::memcpy(static_cast<char*>(out) + size_t(rank_) * bytes_per_rank,
                static_cast<const char*>(in) + size_t(rank_) * bytes_per_rank, bytes_per_rank);
    send_recv(static_cast<const char*>(in) + size_t(peer) * bytes_per_rank, bytes_per_rank, peer,
              static_cast<char*>(out) + size_t(peer) * bytes_per_rank, bytes_per_rank, peer, kAllToAllTag);
  }

  // Of a pair: block `rank_` is a copy, the peer's one transfer each way
  // (always, even of 0 bytes, so a size that disagrees with the peer's is the
  // frame check's Error, not a hang).
  void all_to_all_v(void* out, const size_t* recv_bytes, const void* in, const size_t* send_bytes) override {
    const int peer = 1 - rank_;
    TR_CHECK(recv_bytes[rank_] == send_bytes[rank_], where("all_to_all_v"), ": receives ", recv_bytes[rank_],
             " bytes from itself but sends ", send_bytes[rank_]);
    // Blocks are packed in rank order: block 1 starts after block 0.
    const size_t in_mine = rank_ == 0 ? 0 : send_bytes[0], in_peer = peer == 0 ? 0 : send_bytes[0];
    const size_t out_mine = rank_ == 0 ? 0 : recv_bytes[0], out_peer = peer == 0 ? 0 : recv_bytes[0];
    if (send_bytes[rank_] > 0)
      std::memcpy(static_cast<char*>(out) + out_mine, static_cast<const char*>(in) + in_mine, send_bytes[rank_]);
    send_recv(static_cast<const char*>(in) + in_peer, send_bytes[peer], peer, static_cast<char*>(out) + out_peer,
              recv_bytes[peer], peer, kAllToAllTag);
  }

  void send_recv(const void* send_buf, size_t send_bytes, int send_to, void* recv_buf, size_t recv_bytes,
                 int recv_from, uint32_t tag) override {
    const char* what = "send_recv";
    for (int peer : {send_to, recv_from})
      TR_CHECK(peer >= -1 && peer < 2, where(what), ": peer ", peer, " is not a rank of a link of 2");
    TR_CHECK(send_to != rank_ && recv_from != rank_, where(what), ": a link rank sends to itself");
    const bool sending = send_to >= 0, receiving = recv_from >= 0;
    if (!sending && !receiving) return;
    const auto t0 = Clock::now();
    Ring& out = h_->ring[rank_];
    Ring& in = h_->ring[1 - rank_];
    const Frame f{kFrameMagic, tag, send_bytes};
    Frame g{};
    // Progress both sides without blocking on either, so a pair that sends
    // to each other at once (each message larger than the ring) cannot hang.
    size_t sent = 0, got = 0;
    const size_t send_total = sending ? sizeof f + send_bytes : 0;
    const size_t recv_total = receiving ? sizeof g + recv_bytes : 0;
    for (int idle = 0; sent < send_total || got < recv_total;) {
      bool moved = false;
      if (sent < send_total) {
        const size_t n = write_some(out, f, static_cast<const char*>(send_buf), sent, send_total);
        sent += n;
        moved |= n > 0;
      }
      if (got < recv_total) {
        const size_t n = read_some(in, g, static_cast<char*>(recv_buf), got, recv_total);
        if (got < sizeof g && got + n >= sizeof g) check_frame(g, tag, recv_bytes, what);
        got += n;
        moved |= n > 0;
      }
      if (moved) {
        idle = 0;
        continue;
      }
      if (++idle < 200) {
        std::this_thread::yield();
        continue;
      }
      check_wait(what, t0);
      // Sleep on the one side still pending (both: poll, a short sleep each).
      if (sent < send_total && got < recv_total) {
        std::this_thread::sleep_for(std::chrono::microseconds(50));
      } else if (sent < send_total) {
        out.writer_waits.store(1);
        const uint32_t seen = out.read.load();
        if (out.head.load() - out.tail.load() == cap_) futex_wait(&out.read, seen, std::chrono::microseconds(50000));
        out.writer_waits.store(0);
      } else {
        in.reader_waits.store(1);
        const uint32_t seen = in.wrote.load();
        if (in.head.load() == in.tail.load()) futex_wait(&in.wrote, seen, std::chrono::microseconds(50000));
        in.reader_waits.store(0);
      }
    }
  }

 private:
  void map(int fd, const std::string& prefix) {
    base_ = ::mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    const int e = errno;
    ::close(fd);
    if (base_ == MAP_FAILED) {
      base_ = nullptr;
      if (rank_ == 0) ::shm_unlink(name_.c_str());
      TR_FAIL("shm link ", prefix, ": mmap of ", bytes_, " bytes failed: ", std::strerror(e));
    }
  }
  [[noreturn]] void no(const char* op) const {
    TR_FAIL(describe(op), ": a shared-memory link only sends and receives (a bug: collectives use the group's "
            "communicator)");
  }
  std::string where(const char* op) const { return describe(std::string("shm ") + op); }

  // The stream's bytes [0, total): the frame, then the payload.
  static const char* piece(const Frame& f, const char* payload, size_t at, size_t& len) {
    if (at < sizeof f) {
      len = sizeof f - at;
      return reinterpret_cast<const char*>(&f) + at;
    }
    len = SIZE_MAX;
    return payload + (at - sizeof f);
  }

  size_t write_some(Ring& r, const Frame& f, const char* payload, size_t at, size_t total) {
    const uint64_t head = r.head.load(std::memory_order_relaxed);
    const uint64_t space = cap_ - (head - r.tail.load(std::memory_order_acquire));
    size_t done = 0;
    uint64_t h = head;
    while (done < space && at + done < total) {
      size_t len;
      const char* src = piece(f, payload, at + done, len);
      const size_t pos = size_t(h % cap_);
      const size_t n = std::min({len, total - at - done, size_t(space - done), cap_ - pos});
      std::memcpy(data_ + size_t(rank_) * cap_ + pos, src, n);
      done += n;
      h += n;
    }
    if (done) {
      r.head.store(h, std::memory_order_seq_cst);
      r.wrote.fetch_add(1, std::memory_order_seq_cst);
      if (r.reader_waits.load(std::memory_order_seq_cst)) futex_wake(&r.wrote);
    }
    return done;
  }

  size_t read_some(Ring& r, Frame& g, char* payload, size_t at, size_t total) {
    const uint64_t tail = r.tail.load(std::memory_order_relaxed);
    const uint64_t avail = r.head.load(std::memory_order_acquire) - tail;
    const char* ring = data_ + size_t(1 - rank_) * cap_;
    size_t done = 0;
    uint64_t t = tail;
    while (done < avail && at + done < total) {
      size_t len;
      char* dst = const_cast<char*>(piece(g, payload, at + done, len));
      const size_t pos = size_t(t % cap_);
      const size_t n = std::min({len, total - at - done, size_t(avail - done), cap_ - pos});
      std::memcpy(dst, ring + pos, n);
      done += n;
      t += n;
      // Stop at the end of the frame so the caller checks it before any payload lands.
      if (at + done == sizeof g) break;
    }
    if (done) {
      r.tail.store(t, std::memory_order_seq_cst);
      r.read.fetch_add(1, std::memory_order_seq_cst);
      if (r.writer_waits.load(std::memory_order_seq_cst)) futex_wake(&r.read);
    }
    return done;
  }

  void check_frame(const Frame& g, uint32_t tag, size_t bytes, const char* what) {
    TR_CHECK(g.magic == kFrameMagic, where(what), ": corrupt message frame from rank ", 1 - rank_);
    TR_CHECK(g.tag == tag && g.bytes == bytes, where(what), ": the next message from rank ", 1 - rank_, " has tag ",
             g.tag, " and ", g.bytes, " bytes but this receive expects tag ", tag, " and ", bytes,
             " bytes; messages on a link arrive in the order they were sent, so the two ranks' schedules disagree");
  }

  void check_wait(const char* what, Clock::time_point t0) {
    const int peer = 1 - rank_;
    const int32_t pid = h_->pid[peer].load();
    if (pid > 0 && ::kill(pid, 0) != 0 && errno == ESRCH)
      TR_FAIL(where(what), ": rank ", peer, " (pid ", pid, ") has exited while this rank waited for it");
    if (Clock::now() - t0 > timeout_)
      TR_FAIL(where(what), ": timed out after ", timeout_.count() / 1000.0, " s waiting for rank ", peer,
              "; a peer may be hung or dead (see its log)");
  }

  int rank_;
  std::chrono::milliseconds timeout_;
  std::string name_;
  void* base_ = nullptr;
  size_t bytes_ = 0;
  Header* h_ = nullptr;
  char* data_ = nullptr;
  size_t cap_ = 0;
};

// Which /dev/shm this process sees: the boot and the tmpfs mount's device
// and inode; and its PID namespace. Two processes with the same one can
// share a segment (same host, same mount, whatever their hostnames or
// containers say) and name each other by pid: the link's liveness check is
// kill(peer pid, 0), which in another PID namespace (two containers sharing
// /dev/shm, a sidecar) asks about whatever process has that number here,
// so such a pair takes Gloo instead. Without /proc/self/ns/pid (no
// namespaces) it is left out: every process is then in the one namespace.
std::string shm_identity() {
  std::string boot;
  if (FILE* f = std::fopen("/proc/sys/kernel/random/boot_id", "r")) {
    char buf[64] = {0};
    if (std::fgets(buf, sizeof buf, f)) boot = buf;
    std::fclose(f);
  }
  struct stat st {};
  if (boot.empty() || ::stat("/dev/shm", &st) != 0) return "";
  std::string id = detail::cat(boot, "/", st.st_dev, "/", st.st_ino);
  struct stat ns {};
  if (::stat("/proc/self/ns/pid", &ns) == 0) id += detail::cat("/pidns:", ns.st_dev, ":", ns.st_ino);
  return id;
}

}  // namespace

std::unique_ptr<Communicator> make_p2p_link_communicator(Store& store, const std::string& prefix, int rank,
                                                         const std::string& host, std::chrono::milliseconds timeout,
                                                         bool* shared_memory) {
  TR_CHECK(rank == 0 || rank == 1, "p2p link ", prefix, ": rank ", rank, " (a link has ranks 0 and 1)");
  const char* env = std::getenv("TRAINRUN_PIPELINE_SHM");
  const bool allowed = !(env && std::strcmp(env, "0") == 0);
  // Both sides publish what they see and decide alike from the pair.
  const std::string mine = allowed ? shm_identity() : "";
  store.set(prefix + "shm_identity/" + std::to_string(rank), store_bytes(mine.empty() ? "-" : mine));
  const std::string theirs = store_text(store.get(prefix + "shm_identity/" + std::to_string(1 - rank), timeout));
  const bool shm = !mine.empty() && theirs == mine;
  if (shared_memory) *shared_memory = shm;
  if (shm) return make_shm_communicator(store, prefix, rank, timeout);
  return make_gloo_communicator(store, prefix, rank, 2, host, timeout);
}

std::unique_ptr<Communicator> make_shm_communicator(Store& store, const std::string& prefix, int rank,
                                                    std::chrono::milliseconds timeout, size_t ring_bytes) {
  return std::make_unique<ShmCommunicator>(store, prefix, rank, timeout, ring_bytes);
}

}  // namespace trainrun
