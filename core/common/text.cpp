#include "core/common/text.h"

#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdlib>

#include "core/common/error.h"

namespace trainrun {

std::string ascii_lower(std::string s) {
  for (char& c : s) c = char(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

std::string trim_blanks(const std::string& s) {
  const size_t a = s.find_first_not_of(" \t"), b = s.find_last_not_of(" \t");
  return a == std::string::npos ? "" : s.substr(a, b - a + 1);
}

std::string trim_space(const std::string& s) {
  size_t a = 0, b = s.size();
  while (a < b && std::isspace(static_cast<unsigned char>(s[a]))) ++a;
  while (b > a && std::isspace(static_cast<unsigned char>(s[b - 1]))) --b;
  return s.substr(a, b - a);
}

int64_t parse_param_count(const std::string& text) {
  std::string t = text;
  double mult = 1;
  if (!t.empty()) {
    const char c = char(std::toupper(static_cast<unsigned char>(t.back())));
    if (c == 'K' || c == 'M' || c == 'B' || c == 'G') {
      mult = c == 'K' ? 1e3 : c == 'M' ? 1e6 : 1e9;
      t.pop_back();
    }
  }
  char* end = nullptr;
  errno = 0;
  const double v = t.empty() ? 0 : std::strtod(t.c_str(), &end);
  TR_CHECK(!t.empty() && end && *end == 0 && errno == 0 && std::isfinite(v) && v > 0, "--params '",
           text, "' is not a parameter count; use e.g. 124000000, 124M, 1.5B or 350K");
  const double n = v * mult;
  TR_CHECK(n >= 1e4 && n <= 1e12, "--params ", text, " is outside [10K, 1000B]");
  return int64_t(std::llround(n));
}

}  // namespace trainrun
