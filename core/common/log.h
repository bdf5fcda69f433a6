// Minimal leveled logging to stderr. stdout is reserved for command output
// (generate's text, validate's YAML) so it can be piped.
#pragma once
#include <string>

#include "core/common/error.h"

namespace trainrun {

enum class LogLevel { Debug = 0, Info = 1, Warn = 2, Error = 3 };

void set_log_level(LogLevel level);
LogLevel log_level();
// Prefix every line with e.g. "[rank 1] " (set by workers).
void set_log_prefix(const std::string& prefix);
void log_line(LogLevel level, const std::string& msg);

}  // namespace trainrun

#define TR_LOG_INFO(...) ::trainrun::log_line(::trainrun::LogLevel::Info, ::trainrun::detail::cat(__VA_ARGS__))
#define TR_LOG_WARN(...) ::trainrun::log_line(::trainrun::LogLevel::Warn, ::trainrun::detail::cat(__VA_ARGS__))
#define TR_LOG_DEBUG(...) ::trainrun::log_line(::trainrun::LogLevel::Debug, ::trainrun::detail::cat(__VA_ARGS__))
