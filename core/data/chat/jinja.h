// A Jinja2 subset for the chat templates models ship, rendering what
// transformers 4.44's apply_chat_template renders: jinja2 in an
// ImmutableSandboxedEnvironment with trim_blocks=True, lstrip_blocks=True,
// keep_trailing_newline=False, its own tojson filter (json.dumps with
// ensure_ascii=False) and raise_exception; strftime_now as transformers
// 4.45 added it; the {% generation %} tag of its AssistantTracker.
//
// Supported (what the templates of Llama 3.x, Qwen2.x, Mistral, Gemma, Phi,
// ChatML, DeepSeek and friends use):
//   {{ expr }}, {% stmt %}, {# comment #}, whitespace control {%- -%} {%+,
//   for (loop.index/index0/revindex/revindex0/first/last/length/previtem/
//   nextitem/cycle, for-else, for ... if ...), if/elif/else, set (also
//   block set and `set ns.attr`), namespace(), macro (with defaults and
//   keywords), generation;
//   literals, and/or/not, comparisons, in / not in, is [not] tests,
//   + - * / // % ** ~, x if c else y, slicing, attribute and item access,
//   calls, filters (see jinja_builtins.cpp for the list), string and dict
//   methods.
// Anything else (extends, include, import, call blocks, break, ...) is a
// parse error naming its line and column, never silently rendered.
#pragma once
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/common/error.h"
#include "core/data/chat/jinja_value.h"

namespace trainrun::jinja {

// A template error: `what()` is "NAME:LINE:COL: message".
class TemplateError : public Error {
 public:
  TemplateError(const std::string& msg, bool raised) : Error(msg), raised_(raised) {}
  // From the template's own raise_exception("...").
  bool raised() const { return raised_; }

 private:
  bool raised_;
};

struct Node;

class Template {
 public:
  // Parses `source`; `name` prefixes error positions (a file path).
  Template(const std::string& source, std::string name);
  ~Template();
  Template(Template&&) noexcept;
  Template& operator=(Template&&) noexcept;

  struct Output {
    std::string text;
    // [begin, end) byte ranges of the text that {% generation %} blocks
    // rendered, in order.
    std::vector<std::pair<size_t, size_t>> generation;
  };
  // Renders with `vars` (a dict) as the globals.
  Output render(const Value& vars) const;
  // True when the template has a {% generation %} block.
  bool has_generation() const { return has_generation_; }
  const std::string& name() const { return name_; }

 private:
  std::string name_;
  std::shared_ptr<Node> root_;
  bool has_generation_ = false;
};

}  // namespace trainrun::jinja
