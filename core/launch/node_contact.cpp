// The files in the shared output directory and the other nodes' first
// contact with node 0 (see node_group.h): the secret, the marker, and the
// diagnosis when they do not line up.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include "core/common/error.h"
#include "core/launch/node_group.h"

namespace trainrun {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

namespace {


std::string seconds_text(milliseconds d) {
  std::ostringstream os;
  os << double(d.count()) / 1000.0 << " s";
  return os.str();
}

// Writes `content` to `path` through a temporary file in the same
// directory and a rename, with `mode` set before any byte is written.
void write_atomically(const std::string& path, const std::string& content, mode_t mode) {
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  ::unlink(tmp.c_str());
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, mode);
  TR_CHECK_ERRNO(fd >= 0, "cannot create '", tmp, "'; check that output.dir is writable");
  ::fchmod(fd, mode);  // the umask may have taken bits away; never adds any beyond `mode`
  size_t off = 0;
  bool ok = true;
  while (off < content.size()) {
    const ssize_t n = ::write(fd, content.data() + off, content.size() - off);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      ok = false;
      break;
    }
    off += size_t(n);
  }
  const int e = errno;
  ok = ok && ::fsync(fd) == 0;
  ::close(fd);
  if (!ok) {
    ::unlink(tmp.c_str());
    errno = e;
    TR_CHECK_ERRNO(false, "cannot write '", tmp, "' (disk full?)");
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const int re = errno;
    ::unlink(tmp.c_str());
    errno = re;
    TR_CHECK_ERRNO(false, "cannot rename '", tmp, "' to '", path, "'");
  }
}

// The nonce line of a marker file, "" when the file is not there (yet).
std::string read_marker_nonce(const std::string& path) {
  std::ifstream f(path);
  std::string word, nonce;
  if (f >> word >> nonce && word == "nonce") return nonce;
  return "";
}

// The secret file's first line, "" when it is not there; refuses a file
// that someone else could read.
std::string read_secret_file(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
  if (fd < 0) return "";
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    ::close(fd);
    return "";
  }
  if ((st.st_mode & 077) != 0 || st.st_uid != ::geteuid()) {
    ::close(fd);
    char mode[8];
    std::snprintf(mode, sizeof mode, "%04o", unsigned(st.st_mode & 07777));
    TR_FAIL("refusing the job secret in '", path, "': its mode is ", mode, " and its owner uid ", st.st_uid,
            ", but it must be 0600 and owned by this user (uid ", ::geteuid(),
            ") so that nobody else can join the job; node 0's agent writes it so: did something copy or chmod it?");
  }
  std::string s(256, '\0');
  const ssize_t n = ::read(fd, s.data(), s.size());
  ::close(fd);
  if (n <= 0) return "";
  s.resize(size_t(n));
  const auto nl = s.find('\n');
  return nl == std::string::npos ? s : s.substr(0, nl);
}

// Does anything accept TCP connections at addr:port (within 1 s)?
bool port_answers(const std::string& addr, int port) {
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(uint16_t(port));
  if (::inet_pton(AF_INET, addr.c_str(), &a.sin_addr) != 1) {
    addrinfo hints{};
    hints.ai_family = AF_INET;
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* res = nullptr;
    if (::getaddrinfo(addr.c_str(), nullptr, &hints, &res) != 0 || !res) return false;
    a.sin_addr = reinterpret_cast<sockaddr_in*>(res->ai_addr)->sin_addr;
    ::freeaddrinfo(res);
  }
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) return false;
  bool ok = false;
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0) {
    ok = true;
  } else if (errno == EINPROGRESS) {
    pollfd p{fd, POLLOUT, 0};
    if (::poll(&p, 1, 1000) == 1) {
      int err = 0;
      socklen_t len = sizeof err;
      ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
      ok = err == 0;
    }
  }
  ::close(fd);
  return ok;
}

}  // namespace

// Sleeps up to `d` in short slices, returning early with a stop signal.
int sleep_unless_stopped(milliseconds d, const StopPoll& stop) {
  const auto until = Clock::now() + d;
  for (;;) {
    if (stop) {
      if (const int sig = stop()) return sig;
    }
    const auto now = Clock::now();
    if (now >= until) return 0;
    std::this_thread::sleep_for(std::min<Clock::duration>(until - now, milliseconds(50)));
  }
}

RendezvousFiles rendezvous_files(const std::string& output_dir) {
  const fs::path dir = fs::path(output_dir) / ".trainrun";
  return {dir.string(), (dir / "store.secret").string(), (dir / "node0.marker").string()};
}

std::string secret_for_new_store(const EnvMap& env) {
  auto it = env.find("TRAINRUN_STORE_SECRET");
  if (it != env.end() && !it->second.empty()) return it->second;
  return make_job_secret();
}

void publish_rendezvous(Store& store, const std::string& output_dir, const std::string& secret,
                        const std::string& host, const std::string& store_addr, int port) {
  const std::string nonce = make_job_secret();
  store.set("trainrun/marker", store_bytes(nonce));
  const RendezvousFiles f = rendezvous_files(output_dir);
  std::error_code ec;
  fs::create_directories(f.dir, ec);
  TR_CHECK(!ec, "cannot create '", f.dir, "': ", ec.message(), "; check that output.dir is writable");
  ::chmod(f.dir.c_str(), 0700);
  write_atomically(f.secret, secret + "\n", 0600);
  write_atomically(f.marker,
                   "nonce " + nonce + "\nhost " + host + "\nstore " + store_addr + ":" + std::to_string(port) +
                       "\npid " + std::to_string(::getpid()) + "\n",
                   0644);
}

Node0Contact contact_node0(const std::string& output_dir, const std::string& addr, int port, const EnvMap& env,
                           milliseconds timeout, milliseconds io_timeout, const std::string& who,
                           const StopPoll& stop) {
  const RendezvousFiles f = rendezvous_files(output_dir);
  auto it = env.find("TRAINRUN_STORE_SECRET");
  const std::string env_secret = it == env.end() ? "" : it->second;
  const std::string where = addr + ":" + std::to_string(port);
  const auto start = Clock::now();
  const auto deadline = start + timeout;
  enum { kNoMarker, kNoSecret, kNoStore, kNonce } problem = kNoMarker;
  std::string last_error, seen_nonce, store_nonce;
  bool nonce_mismatch = false;  // node 0's store was reached and named another marker: the clearest diagnosis
  for (;;) {
    seen_nonce = read_marker_nonce(f.marker);
    const std::string secret = env_secret.empty() ? read_secret_file(f.secret) : env_secret;
    if (seen_nonce.empty() && env_secret.empty()) {
      problem = kNoMarker;
    } else if (secret.empty()) {
      problem = kNoSecret;
    } else {
      try {
        Node0Contact c;
        c.store = connect_tcp_store(addr, port, secret, milliseconds(1000), io_timeout);
        c.secret = secret;
        // The marker's nonce must be the one node 0 put in the store: the
        // same directory, from this run.
        if (c.store->check("trainrun/marker")) {
          store_nonce = store_text(c.store->get("trainrun/marker", milliseconds(1000)));
          if (!seen_nonce.empty() && store_nonce == seen_nonce) return c;
          problem = kNonce;
          nonce_mismatch = true;
        } else {
          problem = kNoStore;  // a store, but node 0 has not finished setting up
          last_error = "node 0 has not published its marker yet";
        }
      } catch (const Error& e) {
        problem = kNoStore;
        last_error = e.what();
      }
    }
    if (Clock::now() >= deadline) break;
    if (const int sig = sleep_unless_stopped(milliseconds(200), stop)) throw LaunchInterrupted{sig, ""};
  }
  if (nonce_mismatch) problem = kNonce;
  const std::string waited = seconds_text(std::chrono::duration_cast<milliseconds>(Clock::now() - start));
  const std::string shared_hint =
      "every node must see the same output.dir (checkpoints and the rendezvous files live there): put it on a "
      "filesystem that all nodes mount at the same path";
  switch (problem) {
    case kNoMarker:
      if (port_answers(addr, port))
        TR_FAIL("output.dir '", output_dir, "' is not shared between the nodes: ", who, " cannot see '", f.marker,
                "' after ", waited, ", although node 0's rendezvous store answers at ", where, "; ", shared_hint);
      TR_FAIL("node 0 did not come up: ", who, " waited ", waited, ", nothing answers at ", where,
              " (node 0's rendezvous store) and '", f.marker,
              "' did not appear; start trainrun on node 0 with the same --nnodes/--master-addr/--master-port "
              "(under Slurm: srun --ntasks-per-node=1), and check the address, the port and the firewall; if node 0 "
              "did start and has given up since (see its log), the files it wrote may not be visible here: ",
              shared_hint);
    case kNoSecret:
      TR_FAIL(who, " sees node 0's marker '", f.marker, "' but not the job secret '", f.secret, "' after ", waited,
              "; is output.dir shared between the nodes, and TRAINRUN_STORE_SECRET the same on every node?");
    case kNonce:
      TR_FAIL("output.dir '", output_dir, "' is not shared between the nodes: node 0's rendezvous store at ", where,
              " says this run's marker is ", store_nonce, ", but ", who, " sees ",
              seen_nonce.empty() ? std::string("no marker") : "an old one (" + seen_nonce + ")", " in '", f.marker,
              "' after ", waited, "; ", shared_hint);
    case kNoStore: break;
  }
  if (last_error.find("rejected our secret") != std::string::npos ||
      last_error.find("closed the connection during the handshake") != std::string::npos)
    TR_FAIL("node 0's rendezvous store at ", where, " rejected the secret ",
            env_secret.empty() ? "in '" + f.secret + "'" : std::string("in TRAINRUN_STORE_SECRET"), " for ", waited,
            ": ",
            env_secret.empty() ? "the file is from an earlier run and node 0 has not replaced it, or output.dir "
                                 "is not the same directory on every node"
                               : "every node must get the same TRAINRUN_STORE_SECRET",
            " (", last_error, ")");
  TR_FAIL(who, " cannot join node 0's rendezvous store at ", where, " within ", waited, ": ", last_error);
}

}  // namespace trainrun
