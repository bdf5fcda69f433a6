// GlooStoreAdapter: lets Gloo bootstrap (gloo::rendezvous::Context::
// connectFullMesh) through a trainrun::Store, i.e. through the job's
// authenticated TCP store, so no second rendezvous service is needed.
// Wrap it in gloo::rendezvous::PrefixStore to give each communicator its own
// key space.
#pragma once
#if TRAINRUN_HAVE_GLOO
#include <gloo/rendezvous/store.h>

#include <chrono>
#include <string>
#include <vector>

#include "parallel/rendezvous/store.h"

namespace trainrun {

class GlooStoreAdapter : public gloo::rendezvous::Store {
 public:
  // `store` must outlive the adapter. `default_timeout` bounds get() and the
  // timeout-less wait() (Gloo's own API has no timeout there), and is used
  // when Gloo passes a zero timeout (its "no timeout" value) to wait().
  explicit GlooStoreAdapter(trainrun::Store& store, Millis default_timeout = std::chrono::seconds(30));

  void set(const std::string& key, const std::vector<char>& data) override;
  std::vector<char> get(const std::string& key) override;
  void wait(const std::vector<std::string>& keys) override;
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override;

  Millis default_timeout() const { return default_timeout_; }

 private:
  trainrun::Store& store_;
  Millis default_timeout_;
};

}  // namespace trainrun
#endif  // TRAINRUN_HAVE_GLOO
