// Small text helpers the hand-written parsers share: model shapes and byte
// sizes (`--model`, `--gpu-memory`), nvidia-smi topology tables,
// CUDA_VISIBLE_DEVICES and PCI bus ids.
#pragma once
#include <cstdint>
#include <string>

namespace trainrun {

// ASCII letters to lower case; other bytes (UTF-8 included) unchanged.
std::string ascii_lower(std::string s);

// Without leading and trailing spaces and tabs: one value inside a line.
std::string trim_blanks(const std::string& s);

// Without leading and trailing whitespace of any kind (std::isspace: also
// \r, \n, \v, \f): lines read from files that may end in CRLF.
std::string trim_space(const std::string& s);

// A parameter count as the benches' --params take it: 124000000, 124M,
// 1.5B, 350K (G = B). Throws Error naming the text on anything else, or
// outside [10K, 1000B].
int64_t parse_param_count(const std::string& text);

}  // namespace trainrun
