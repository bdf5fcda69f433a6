// Values of the Jinja2 subset (core/data/chat/jinja.h): what Python holds
// when transformers renders a chat template, with Python's semantics for
// truth, equality, ordering, str() and json.dumps().
//
//   undefined  a missing variable, key or attribute (jinja2's Undefined:
//              prints "", is false, iterates empty; arithmetic on it fails)
//   none, bool, int (int64), float (double), string (UTF-8; indexing,
//   slicing and length count code points, as Python's str does)
//   list       (tuples too: templates cannot tell them apart)
//   dict       string keys in insertion order (json.loads keeps file order)
//   callable   a macro, a builtin function, or a bound method ("x".strip)
// Lists and dicts are shared, as Python objects are; the sandbox
// (ImmutableSandboxedEnvironment) never mutates them, and neither do we,
// except a namespace()'s attributes.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

namespace trainrun::jinja {

struct Value;
using ValueList = std::vector<Value>;
using KwArgs = std::vector<std::pair<std::string, Value>>;

struct ValueDict {
  std::vector<std::pair<std::string, Value>> items;
  const Value* find(const std::string& key) const;
  void set(const std::string& key, Value v);
};

// (positional args, keyword args) -> value. Errors are thrown as
// jinja::RenderError by the caller's context (it adds the position).
using Builtin = std::function<Value(ValueList& args, KwArgs& kwargs)>;

struct Value {
  enum class Kind : uint8_t { kUndefined, kNone, kBool, kInt, kFloat, kString, kList, kDict, kCallable };
  Kind kind = Kind::kUndefined;
  bool b = false;
  int64_t i = 0;
  double f = 0;
  std::string s;  // string; for undefined: the name that was missing (messages)
  std::shared_ptr<ValueList> list;
  std::shared_ptr<ValueDict> dict;
  std::shared_ptr<Builtin> fn;
  bool is_namespace = false;  // a dict whose attributes `set ns.x = ...` may assign
  bool is_tuple = false;      // a list that Python holds as a tuple (repr "(a, b)")

  static Value undefined(std::string what = {});
  static Value none();
  static Value boolean(bool v);
  static Value integer(int64_t v);
  static Value number(double v);
  static Value string(std::string v);
  static Value make_list(ValueList v = {});
  static Value make_tuple(ValueList v);
  static Value make_dict();
  static Value callable(Builtin fn);
  static Value from_json(const nlohmann::ordered_json& j);

  bool is_undefined() const { return kind == Kind::kUndefined; }
  bool is_none() const { return kind == Kind::kNone; }
  bool is_string() const { return kind == Kind::kString; }
  bool is_number() const { return kind == Kind::kInt || kind == Kind::kFloat || kind == Kind::kBool; }
  bool is_list() const { return kind == Kind::kList; }
  bool is_dict() const { return kind == Kind::kDict; }
  double as_double() const { return kind == Kind::kFloat ? f : double(kind == Kind::kBool ? b : i); }
};

const char* kind_name(const Value& v);  // Python's type name: "str", "int", "dict", ...
bool truthy(const Value& v);
// Python ==: 1 == 1.0 == True, lists and dicts element-wise, no cross-type
// equality otherwise; undefined equals undefined.
bool equals(const Value& a, const Value& b);
// Python <: numbers with numbers, strings by code point, lists
// lexicographically; anything else throws (the caller names the position).
bool less(const Value& a, const Value& b);
// Python str() (what {{ x }} prints): strings as they are, True/False/None,
// floats as repr(), lists and dicts as repr(); undefined prints "".
std::string to_str(const Value& v);
std::string repr(const Value& v);
// Python's json.dumps(v, ensure_ascii, indent, separators, sort_keys) as
// transformers' tojson filter calls it. indent < 0: none (one line).
std::string to_json(const Value& v, int indent, bool ensure_ascii, const std::string& item_sep,
                    const std::string& key_sep, bool sort_keys);
std::string float_repr(double d);

// UTF-8 <-> code points, for Python-style string indexing.
std::u32string utf8_to_u32(const std::string& s);
std::string u32_to_utf8(const std::u32string& s);
// str.isspace() of one code point.
bool py_isspace(char32_t c);

}  // namespace trainrun::jinja
