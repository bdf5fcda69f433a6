#include "parallel/rendezvous/gloo_store.h"

#if TRAINRUN_HAVE_GLOO

namespace trainrun {

GlooStoreAdapter::GlooStoreAdapter(trainrun::Store& store, Millis default_timeout)
    : store_(store), default_timeout_(default_timeout) {}

void GlooStoreAdapter::set(const std::string& key, const std::vector<char>& data) {
  store_.set(key, std::vector<uint8_t>(data.begin(), data.end()));
}

std::vector<char> GlooStoreAdapter::get(const std::string& key) {
  // Gloo calls get() after wait(); blocking here too (bounded) also covers
  // callers that skip the wait.
  std::vector<uint8_t> v = store_.get(key, default_timeout_);
  return std::vector<char>(v.begin(), v.end());
}

void GlooStoreAdapter::wait(const std::vector<std::string>& keys) { store_.wait(keys, default_timeout_); }

void GlooStoreAdapter::wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) {
  // Gloo's kNoTimeout is zero; never turn that into "wait forever".
  store_.wait(keys, timeout.count() > 0 ? timeout : default_timeout_);
}

}  // namespace trainrun

#endif  // TRAINRUN_HAVE_GLOO
