// Internal to the TCP store (store.cpp = client, store_server.cpp = server):
// the wire protocol and a few socket helpers. Not part of the public API.
//
// Wire format. Every message is a frame: u32 payload length (big-endian),
// then the payload. Integers are big-endian; a "bytes" field is a u32 length
// followed by the bytes. Requests are {u8 op, fields...}; replies are
// {u8 status, fields...}. One request is in flight per connection at a time
// (the client serialises its calls), so replies need no ids.
//
//   Hello      u32 magic, u32 version, bytes secret   -> Ok | Rejected{u8 reason, bytes text}
//   Set        bytes key, bytes value                 -> Ok
//   Get        bytes key, u64 timeout_ms              -> Ok{bytes value} | Timeout
//   Add        bytes key, i64 delta                   -> Ok{i64 new} | Failed{bytes text}
//   CompareSet bytes key, bytes expected, bytes desired -> Ok{bytes value}
//   Check      bytes key                              -> Ok{u8 exists}
//   Remove     bytes key                              -> Ok{u8 existed}
//   Wait       u32 n, n x bytes key, u64 timeout_ms   -> Ok | Timeout{u32 n, n x bytes missing}
//
// The first frame on a connection must be Hello with the job secret; anything
// else (or a wrong secret) gets Rejected and the server closes the socket.
#pragma once
#include <netinet/in.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "core/common/error.h"
#include "parallel/rendezvous/store.h"

namespace trainrun::store_proto {

using Clock = std::chrono::steady_clock;

constexpr uint32_t kMagic = 0x54525354;  // "TRST"
constexpr uint32_t kVersion = 1;
// Before authentication a peer may send only a small Hello: an unauthenticated
// client must not make the server allocate much.
constexpr uint32_t kMaxHelloBytes = 4096;
// After authentication: values are small (addresses, NCCL ids), but leave room
// for e.g. a topology description. A larger length means a corrupt stream.
constexpr uint32_t kMaxFrameBytes = 256u << 20;
// Longest wait the server honours; bigger timeouts are clamped so that
// steady_clock arithmetic cannot overflow (Millis::max() means "forever").
constexpr Millis kMaxWait = std::chrono::hours(24 * 365);

enum Op : uint8_t { kHello = 1, kSet = 2, kGet = 3, kAdd = 4, kCompareSet = 5, kCheck = 6, kRemove = 7, kWait = 8 };
enum Status : uint8_t { kOk = 0, kTimeout = 1, kFailed = 2, kRejected = 3 };
enum RejectReason : uint8_t { kWrongSecret = 1, kBadHello = 2 };

// Builds one frame; the length prefix is filled in by frame().
class Writer {
 public:
  Writer() : buf_(4, 0) {}
  Writer& u8(uint8_t v) {
    buf_.push_back(v);
    return *this;
  }
  Writer& u32(uint32_t v) {
    for (int s = 24; s >= 0; s -= 8) buf_.push_back(static_cast<uint8_t>(v >> s));
    return *this;
  }
  Writer& u64(uint64_t v) {
    for (int s = 56; s >= 0; s -= 8) buf_.push_back(static_cast<uint8_t>(v >> s));
    return *this;
  }
  Writer& bytes(const void* p, size_t n) {
    u32(static_cast<uint32_t>(n));
    const auto* b = static_cast<const uint8_t*>(p);
    buf_.insert(buf_.end(), b, b + n);
    return *this;
  }
  Writer& str(const std::string& s) { return bytes(s.data(), s.size()); }
  Writer& vec(const std::vector<uint8_t>& v) { return bytes(v.data(), v.size()); }
  std::vector<uint8_t>& frame() {
    uint32_t n = static_cast<uint32_t>(buf_.size() - 4);
    for (int i = 0; i < 4; ++i) buf_[i] = static_cast<uint8_t>(n >> (24 - 8 * i));
    return buf_;
  }

 private:
  std::vector<uint8_t> buf_;
};

inline uint32_t read_be32(const uint8_t* p) {
  return (uint32_t(p[0]) << 24) | (uint32_t(p[1]) << 16) | (uint32_t(p[2]) << 8) | uint32_t(p[3]);
}

// Parses one payload; a short or malformed payload throws Error (the server
// drops such a peer, the client reports a protocol error).
class Reader {
 public:
  Reader(const uint8_t* p, size_t n) : p_(p), n_(n) {}
  uint8_t u8() {
    need(1);
    return p_[pos_++];
  }
  uint32_t u32() {
    need(4);
    uint32_t v = read_be32(p_ + pos_);
    pos_ += 4;
    return v;
  }
  uint64_t u64() {
    need(8);
    uint64_t v = 0;
    for (int i = 0; i < 8; ++i) v = (v << 8) | p_[pos_ + i];
    pos_ += 8;
    return v;
  }
  std::vector<uint8_t> vec() {
    uint32_t n = u32();
    need(n);
    std::vector<uint8_t> v(p_ + pos_, p_ + pos_ + n);
    pos_ += n;
    return v;
  }
  std::string str() {
    uint32_t n = u32();
    need(n);
    std::string s(reinterpret_cast<const char*>(p_ + pos_), n);
    pos_ += n;
    return s;
  }
  size_t remaining() const { return n_ - pos_; }

 private:
  void need(size_t k) {
    TR_CHECK(n_ - pos_ >= k, "malformed store message (", n_, " bytes, needed ", k, " more at offset ", pos_, ")");
  }
  const uint8_t* p_;
  size_t n_;
  size_t pos_ = 0;
};

// "300 ms", "10 s", "1.5 s": for messages.
std::string format_duration(Millis d);
// "127.0.0.1:54321"
std::string format_peer(const sockaddr_in& a);
// Resolves an IPv4 host name or dotted address (empty = any, for binding).
// Returns false with a message in *err when it cannot.
bool resolve_ipv4(const std::string& host, int port, bool passive, sockaddr_in* out, std::string* err);
// Compares in time that depends only on the lengths, not on where they differ.
bool secrets_equal(const std::string& a, const std::string& b);
// Milliseconds from now until t, rounded up, at least 0, at most INT_MAX (for poll()).
int poll_ms_until(Clock::time_point t);

}  // namespace trainrun::store_proto
