// See int_list.h.
#include "core/common/int_list.h"

#include "core/common/error.h"

namespace trainrun {

std::vector<int> parse_int_list(const std::string& text, const IntListFormat& f) {
  std::vector<int> out;
  std::string cur;
  auto bad = [&](const std::string& why) { TR_FAIL(f.key, ": '", text, "' ", why, "; ", f.hint); };
  auto flush = [&] {
    if (cur.empty()) bad("has an empty entry");
    if (cur.size() > f.max_digits) bad(std::string("has a ") + f.noun + " too large (" + cur + ")");
    out.push_back(std::stoi(cur));
    cur.clear();
  };
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    const bool bracket = (c == '[' && i == text.find_first_not_of(' ')) ||
                         (c == ']' && i == text.find_last_not_of(' '));
    if (c >= '0' && c <= '9') cur += c;
    else if (c == ',') flush();
    else if (c != ' ' && c != '\t' && !bracket)
      bad(std::string("is not a list of ") + f.noun + "s (a '" + c + "')");
  }
  if (!cur.empty() || !out.empty()) flush();
  return out;
}

}  // namespace trainrun
