#include "core/common/log.h"

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <mutex>

namespace trainrun {
namespace {
LogLevel g_level = LogLevel::Info;
std::string g_prefix;
std::mutex g_mu;
}  // namespace

void set_log_level(LogLevel level) { g_level = level; }
LogLevel log_level() { return g_level; }
void set_log_prefix(const std::string& prefix) { g_prefix = prefix; }

void log_line(LogLevel level, const std::string& msg) {
  if (static_cast<int>(level) < static_cast<int>(g_level)) return;
  const char* tag = level == LogLevel::Warn ? "warning: " : level == LogLevel::Error ? "error: " : "";
  std::lock_guard<std::mutex> lock(g_mu);
  std::fprintf(stderr, "%s%s%s\n", g_prefix.c_str(), tag, msg.c_str());
  std::fflush(stderr);
}

namespace detail {
std::string errno_string() { return std::strerror(errno); }
}  // namespace detail

}  // namespace trainrun
