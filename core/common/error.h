// Errors are exceptions with context: what happened, which key/file/rank,
// and what to do. Everything below main() throws trainrun::Error through
// TR_CHECK / TR_FAIL; the top level turns it into one paragraph and a
// non-zero exit. No exit() below main (a test cannot catch it).
#pragma once
#include <sstream>
#include <stdexcept>
#include <string>

namespace trainrun {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& msg) : std::runtime_error(msg) {}
};

namespace detail {
// Concatenate any streamable arguments into one string.
template <typename... Args>
std::string cat(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}
}  // namespace detail

}  // namespace trainrun

// TR_FAIL("data.train: file '", path, "' is truncated; re-run prepare")
#define TR_FAIL(...) throw ::trainrun::Error(::trainrun::detail::cat(__VA_ARGS__))

// TR_CHECK(cond, "message parts"...): throws Error with the message when cond is false.
#define TR_CHECK(cond, ...)                \
  do {                                     \
    if (!(cond)) TR_FAIL(__VA_ARGS__);     \
  } while (0)

// For system calls that set errno: appends strerror(errno).
#define TR_CHECK_ERRNO(cond, ...)                                                        \
  do {                                                                                   \
    if (!(cond)) TR_FAIL(__VA_ARGS__, ": ", ::trainrun::detail::errno_string());         \
  } while (0)

namespace trainrun::detail {
std::string errno_string();
}
