// Filters, tests, attribute lookup and the methods of str/dict/list, with
// jinja2's and Python's semantics (private to core/data/chat). Errors are
// std::runtime_error with Python's wording; the evaluator adds the
// template position.
#pragma once
#include <string>

#include "core/data/chat/jinja_value.h"

namespace trainrun::jinja {

bool known_filter(const std::string& name);
bool known_test(const std::string& name);
Value apply_filter(const std::string& name, const Value& v, ValueList& args, KwArgs& kwargs);
bool apply_test(const std::string& name, const Value& v, const ValueList& args);
// jinja2's environment.getattr (obj.name: attribute, then item) and
// getitem (obj[key]: item, then attribute); missing -> undefined.
Value get_attr(const Value& obj, const std::string& name);
Value get_item(const Value& obj, const Value& key);
// Python's len() of a string (code points), list or dict.
int64_t py_len(const Value& v);
// Iteration as Python does it: a list's items, a dict's keys, a string's
// characters; undefined iterates empty.
ValueList iterate(const Value& v);
// obj[start:stop:step] of a list or string.
Value slice(const Value& obj, const Value& start, const Value& stop, const Value& step);

}  // namespace trainrun::jinja
