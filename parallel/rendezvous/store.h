// Rendezvous key-value store. The node-0 agent hosts a TcpStoreServer; every
// worker connects a TcpStoreClient to MASTER_ADDR:MASTER_PORT with the job's
// secret (TRAINRUN_STORE_SECRET). Gloo contexts bootstrap through it (see
// GlooStoreAdapter) and NCCL's unique id travels through it.
#pragma once
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/common/error.h"

namespace trainrun {

// Store values are bytes; most of ours are text.
inline std::vector<uint8_t> store_bytes(const std::string& s) { return std::vector<uint8_t>(s.begin(), s.end()); }
inline std::string store_text(const std::vector<uint8_t>& v) { return std::string(v.begin(), v.end()); }

using Millis = std::chrono::milliseconds;

// Thrown by get/wait when the store answered "not there yet" at the deadline
// (as opposed to a lost connection, which is a plain Error). Lets callers such
// as wait_for_ranks turn a timeout into a better message.
class StoreTimeoutError : public Error {
 public:
  using Error::Error;
};

class Store {
 public:
  virtual ~Store() = default;
  virtual void set(const std::string& key, const std::vector<uint8_t>& value) = 0;
  // Blocks until the key exists (or the timeout passes: Error naming the key).
  virtual std::vector<uint8_t> get(const std::string& key, Millis timeout) = 0;
  // Atomically adds delta to an integer counter (created at 0) and returns the new value.
  virtual int64_t add(const std::string& key, int64_t delta) = 0;
  // Sets key to desired if its current value equals expected (an absent key
  // matches an empty expected). Returns the value after the operation.
  virtual std::vector<uint8_t> compare_set(const std::string& key, const std::vector<uint8_t>& expected,
                                           const std::vector<uint8_t>& desired) = 0;
  virtual bool check(const std::string& key) = 0;      // exists now?
  virtual bool remove(const std::string& key) = 0;     // true if it existed
  // Blocks until all keys exist. On timeout throws Error listing the missing keys.
  virtual void wait(const std::vector<std::string>& keys, Millis timeout) = 0;
};

// Waits for "<prefix><r>" for every rank r < world; on timeout the Error names
// `what`, the missing ranks and the timeout (e.g. "rendezvous: ranks 2, 3 of 4
// did not arrive within 30 s (waiting for key 'ready/2')").
void wait_for_ranks(Store& store, const std::string& prefix, int world, Millis timeout,
                    const std::string& what);

// Server: binds bind_addr:port (port 0 = pick a free one), serves clients on a
// background thread until destroyed. Every connection must start with the
// secret; a client without it is rejected and logged.
class TcpStoreServer {
 public:
  TcpStoreServer(const std::string& bind_addr, int port, const std::string& secret);
  ~TcpStoreServer();
  int port() const;
  const std::string& address() const;
  // The keys held now that start with `prefix`, sorted: for tests and
  // diagnostics (what a job leaves behind), not for coordination.
  std::vector<std::string> keys(const std::string& prefix = "") const;
  TcpStoreServer(const TcpStoreServer&) = delete;
  TcpStoreServer& operator=(const TcpStoreServer&) = delete;
  struct Impl;
 private:
  std::unique_ptr<Impl> impl_;
};

// Client: connects (retrying until connect_timeout) and authenticates.
// io_timeout bounds the round trip of set/add/check/remove/compare_set (the
// server answers those at once); a node agent's heartbeat client uses a
// short one so a partitioned network is noticed within the node timeout.
std::unique_ptr<Store> connect_tcp_store(const std::string& host, int port, const std::string& secret,
                                         Millis connect_timeout, Millis io_timeout = std::chrono::seconds(60));

// A fresh random secret (hex, 128 bits from /dev/urandom).
std::string make_job_secret();

}  // namespace trainrun
