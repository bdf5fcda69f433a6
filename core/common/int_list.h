// A spec value that is a list of non-negative integers, written as YAML
// flow list or a bare comma list: "[3, 1]", "3,1", "" (none). Shared by
// parallel.pipeline_layers and output.trace_steps, which store the list as
// text in the job spec.
#pragma once
#include <cstddef>
#include <string>
#include <vector>

namespace trainrun {

struct IntListFormat {
  const char* key;    // the spec key the errors name, e.g. "output.trace_steps"
  const char* noun;   // one entry, e.g. "step number"
  const char* hint;   // what to write instead, e.g. "write the steps to trace, e.g. [2, 10] (or '2,10')"
  size_t max_digits;  // longer entries are "too large" (keeps std::stoi in range)
};

// The entries in order. Throws Error "<key>: '<text>' <what is wrong>; <hint>"
// on an empty entry, an entry over max_digits or any other character.
std::vector<int> parse_int_list(const std::string& text, const IntListFormat& f);

}  // namespace trainrun
