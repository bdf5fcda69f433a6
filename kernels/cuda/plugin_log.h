// Logging inside libtrainrun_cuda.so: the plugin has no logger of its own;
// the host installs trainrun::log_line through CudaPluginApi::set_logger
// (so the rank prefix and the log level are the binary's). Before that,
// messages go to stderr.
#pragma once
#include <cstdio>
#include <string>

#include "core/common/error.h"
#include "kernels/backend_factory.h"

namespace trainrun::cuda {

inline LogFn g_plugin_log = nullptr;

inline void plugin_log(int level, const std::string& msg) {
  if (g_plugin_log) g_plugin_log(level, msg.c_str());
  else std::fprintf(stderr, "%s\n", msg.c_str());
}

}  // namespace trainrun::cuda

// Levels as trainrun::LogLevel: 0 debug, 1 info, 2 warn, 3 error.
#define TR_CUDA_LOG_DEBUG(...) ::trainrun::cuda::plugin_log(0, ::trainrun::detail::cat(__VA_ARGS__))
#define TR_CUDA_LOG_INFO(...) ::trainrun::cuda::plugin_log(1, ::trainrun::detail::cat(__VA_ARGS__))
#define TR_CUDA_LOG_WARN(...) ::trainrun::cuda::plugin_log(2, ::trainrun::detail::cat(__VA_ARGS__))
