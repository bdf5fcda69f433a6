// Filters, tests and methods of the Jinja2 subset (jinja_builtins.h).
// Case mapping (upper, lower, title, capitalize) is ASCII-only: role names
// and template text are ASCII; non-ASCII letters are left as they are.
#include "core/data/chat/jinja_builtins.h"

#include <algorithm>
#include <cmath>
#include <set>
#include <stdexcept>

namespace trainrun::jinja {
namespace {

[[noreturn]] void fail(const std::string& msg) { throw std::runtime_error(msg); }

const Value* kwarg(const KwArgs& kw, const char* name) {
  for (const auto& kv : kw)
    if (kv.first == name) return &kv.second;
  return nullptr;
}
// Argument `pos` (positional) or `name` (keyword), else `def`.
Value arg(const ValueList& args, const KwArgs& kw, size_t pos, const char* name, Value def = Value::undefined()) {
  if (pos < args.size()) return args[pos];
  if (const Value* v = kwarg(kw, name)) return *v;
  return def;
}
const std::string& need_str(const Value& v, const char* what) {
  if (!v.is_string()) fail(std::string(what) + " expects a string, got " + kind_name(v));
  return v.s;
}

std::string lower_ascii(std::string s) {
  for (char& c : s)
    if (c >= 'A' && c <= 'Z') c = static_cast<char>(c - 'A' + 'a');
  return s;
}
std::string upper_ascii(std::string s) {
  for (char& c : s)
    if (c >= 'a' && c <= 'z') c = static_cast<char>(c - 'a' + 'A');
  return s;
}
bool is_alpha(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'); }
std::string title_ascii(const std::string& s) {
  std::string out = s;
  bool prev_cased = false;
  for (char& c : out) {
    if (is_alpha(c)) {
      c = prev_cased ? lower_ascii(std::string(1, c))[0] : upper_ascii(std::string(1, c))[0];
      prev_cased = true;
    } else {
      prev_cased = false;
    }
  }
  return out;
}
std::string capitalize_ascii(const std::string& s) {
  std::string out = lower_ascii(s);
  if (!out.empty()) out[0] = upper_ascii(out.substr(0, 1))[0];
  return out;
}

// str.strip / lstrip / rstrip: Python whitespace, or the code points of `chars`.
std::string py_strip(const std::string& s, const Value& chars, bool left, bool right) {
  const std::u32string u = utf8_to_u32(s);
  const std::u32string set = chars.is_string() ? utf8_to_u32(chars.s) : std::u32string();
  auto strip_it = [&](char32_t c) { return chars.is_string() ? set.find(c) != std::u32string::npos : py_isspace(c); };
  size_t b = 0, e = u.size();
  if (left)
    while (b < e && strip_it(u[b])) ++b;
  if (right)
    while (e > b && strip_it(u[e - 1])) --e;
  return u32_to_utf8(u.substr(b, e - b));
}

Value py_split(const std::string& s, const Value& sep, const Value& maxsplit_v) {
  const int64_t maxsplit = maxsplit_v.kind == Value::Kind::kInt ? maxsplit_v.i : -1;
  ValueList out;
  if (!sep.is_string()) {
    const std::u32string u = utf8_to_u32(s);
    size_t k = 0;
    int64_t splits = 0;
    while (k < u.size()) {
      while (k < u.size() && py_isspace(u[k])) ++k;
      if (k >= u.size()) break;
      if (maxsplit >= 0 && splits >= maxsplit) {
        size_t e = u.size();
        while (e > k && py_isspace(u[e - 1])) --e;
        out.push_back(Value::string(u32_to_utf8(u.substr(k, e - k))));
        break;
      }
      size_t e = k;
      while (e < u.size() && !py_isspace(u[e])) ++e;
      out.push_back(Value::string(u32_to_utf8(u.substr(k, e - k))));
      ++splits;
      k = e;
    }
    return Value::make_list(std::move(out));
  }
  if (sep.s.empty()) fail("empty separator");
  size_t k = 0;
  int64_t splits = 0;
  for (;;) {
    const size_t f = (maxsplit >= 0 && splits >= maxsplit) ? std::string::npos : s.find(sep.s, k);
    if (f == std::string::npos) {
      out.push_back(Value::string(s.substr(k)));
      break;
    }
    out.push_back(Value::string(s.substr(k, f - k)));
    k = f + sep.s.size();
    ++splits;
  }
  return Value::make_list(std::move(out));
}

std::string py_replace(const std::string& s, const std::string& from, const std::string& to, int64_t count) {
  std::string out;
  size_t k = 0;
  int64_t n = 0;
  if (from.empty()) {
    // Python inserts `to` between every character (and at both ends).
    const std::u32string u = utf8_to_u32(s);
    for (size_t j = 0; j <= u.size(); ++j) {
      if (count < 0 || n < count) {
        out += to;
        ++n;
      }
      if (j < u.size()) out += u32_to_utf8(u.substr(j, 1));
    }
    return out;
  }
  for (;;) {
    const size_t f = (count >= 0 && n >= count) ? std::string::npos : s.find(from, k);
    if (f == std::string::npos) break;
    out.append(s, k, f - k);
    out += to;
    k = f + from.size();
    ++n;
  }
  out.append(s, k, std::string::npos);
  return out;
}

bool starts_or_ends(const std::string& s, const Value& what, bool start) {
  auto one = [&](const std::string& p) {
    if (p.size() > s.size()) return false;
    return start ? s.compare(0, p.size(), p) == 0 : s.compare(s.size() - p.size(), p.size(), p) == 0;
  };
  if (what.is_list()) {
    for (const Value& v : *what.list)
      if (one(need_str(v, start ? "startswith" : "endswith"))) return true;
    return false;
  }
  return one(need_str(what, start ? "startswith" : "endswith"));
}

// "{} and {name}".format(...): positional and named fields, no format specs.
std::string py_format(const std::string& fmt, const ValueList& args, const KwArgs& kw) {
  std::string out;
  size_t auto_idx = 0;
  for (size_t k = 0; k < fmt.size(); ++k) {
    const char c = fmt[k];
    if (c == '{' && k + 1 < fmt.size() && fmt[k + 1] == '{') {
      out += '{';
      ++k;
    } else if (c == '}' && k + 1 < fmt.size() && fmt[k + 1] == '}') {
      out += '}';
      ++k;
    } else if (c == '{') {
      const size_t e = fmt.find('}', k);
      if (e == std::string::npos) fail("format: single '{' encountered in format string");
      const std::string field = fmt.substr(k + 1, e - k - 1);
      if (field.find_first_of(":!") != std::string::npos) fail("format: format specs are outside the supported subset");
      if (field.empty()) {
        if (auto_idx >= args.size()) fail("format: replacement index out of range");
        out += to_str(args[auto_idx++]);
      } else if (std::isdigit(static_cast<unsigned char>(field[0]))) {
        const size_t idx = std::stoul(field);
        if (idx >= args.size()) fail("format: replacement index out of range");
        out += to_str(args[idx]);
      } else {
        const Value* v = kwarg(kw, field.c_str());
        if (!v) fail("format: missing key '" + field + "'");
        out += to_str(*v);
      }
      k = e;
    } else {
      out += c;
    }
  }
  return out;
}

Value bound(Builtin fn) { return Value::callable(std::move(fn)); }

Value string_method(const Value& self, const std::string& name) {
  const std::string s = self.s;
  if (name == "strip" || name == "lstrip" || name == "rstrip") {
    const bool l = name != "rstrip", r = name != "lstrip";
    return bound([s, l, r](ValueList& a, KwArgs& kw) {
      return Value::string(py_strip(s, arg(a, kw, 0, "chars", Value::none()), l, r));
    });
  }
  if (name == "startswith" || name == "endswith") {
    const bool st = name == "startswith";
    return bound([s, st](ValueList& a, KwArgs& kw) {
      return Value::boolean(starts_or_ends(s, arg(a, kw, 0, st ? "prefix" : "suffix"), st));
    });
  }
  if (name == "split")
    return bound([s](ValueList& a, KwArgs& kw) {
      return py_split(s, arg(a, kw, 0, "sep", Value::none()), arg(a, kw, 1, "maxsplit", Value::integer(-1)));
    });
  if (name == "splitlines")
    return bound([s](ValueList&, KwArgs&) {
      ValueList out;
      size_t k = 0;
      while (k < s.size()) {
        size_t e = s.find_first_of("\r\n", k);
        if (e == std::string::npos) {
          out.push_back(Value::string(s.substr(k)));
          break;
        }
        out.push_back(Value::string(s.substr(k, e - k)));
        k = e + ((s[e] == '\r' && e + 1 < s.size() && s[e + 1] == '\n') ? 2 : 1);
      }
      return Value::make_list(std::move(out));
    });
  if (name == "upper") return bound([s](ValueList&, KwArgs&) { return Value::string(upper_ascii(s)); });
  if (name == "lower") return bound([s](ValueList&, KwArgs&) { return Value::string(lower_ascii(s)); });
  if (name == "title") return bound([s](ValueList&, KwArgs&) { return Value::string(title_ascii(s)); });
  if (name == "capitalize") return bound([s](ValueList&, KwArgs&) { return Value::string(capitalize_ascii(s)); });
  if (name == "replace")
    return bound([s](ValueList& a, KwArgs& kw) {
      const Value cnt = arg(a, kw, 2, "count", Value::integer(-1));
      return Value::string(py_replace(s, need_str(arg(a, kw, 0, "old"), "replace"),
                                      need_str(arg(a, kw, 1, "new"), "replace"), cnt.i));
    });
  if (name == "find" || name == "count" || name == "rfind")
    return bound([s, name](ValueList& a, KwArgs& kw) {
      const std::string& sub = need_str(arg(a, kw, 0, "sub"), name.c_str());
      if (name == "count") {
        if (sub.empty()) return Value::integer(static_cast<int64_t>(utf8_to_u32(s).size()) + 1);
        int64_t n = 0;
        for (size_t k = s.find(sub); k != std::string::npos; k = s.find(sub, k + sub.size())) ++n;
        return Value::integer(n);
      }
      const size_t f = name == "find" ? s.find(sub) : s.rfind(sub);
      return Value::integer(f == std::string::npos ? -1 : static_cast<int64_t>(utf8_to_u32(s.substr(0, f)).size()));
    });
  if (name == "join")
    return bound([s](ValueList& a, KwArgs& kw) {
      std::string out;
      bool first = true;
      for (const Value& v : iterate(arg(a, kw, 0, "iterable"))) {
        if (!first) out += s;
        out += need_str(v, "join");
        first = false;
      }
      return Value::string(out);
    });
  if (name == "format") return bound([s](ValueList& a, KwArgs& kw) { return Value::string(py_format(s, a, kw)); });
  if (name == "isdigit" || name == "isalpha" || name == "isalnum" || name == "isspace" || name == "isupper" ||
      name == "islower")
    return bound([s, name](ValueList&, KwArgs&) {
      if (s.empty()) return Value::boolean(false);
      bool any_cased = false;
      for (char32_t c : utf8_to_u32(s)) {
        const bool dig = c >= '0' && c <= '9', al = c < 0x80 && is_alpha(static_cast<char>(c));
        if (name == "isdigit" && !dig) return Value::boolean(false);
        if (name == "isalpha" && !al) return Value::boolean(false);
        if (name == "isalnum" && !dig && !al) return Value::boolean(false);
        if (name == "isspace" && !py_isspace(c)) return Value::boolean(false);
        if (name == "isupper" && c >= 'a' && c <= 'z') return Value::boolean(false);
        if (name == "islower" && c >= 'A' && c <= 'Z') return Value::boolean(false);
        if (al) any_cased = true;
      }
      return Value::boolean((name != "isupper" && name != "islower") || any_cased);
    });
  return Value::undefined("str object has no attribute '" + name + "'");
}

Value dict_method(const Value& self, const std::string& name) {
  const auto d = self.dict;
  if (name == "items")
    return bound([d](ValueList&, KwArgs&) {
      ValueList out;
      for (const auto& kv : d->items) out.push_back(Value::make_tuple({Value::string(kv.first), kv.second}));
      return Value::make_list(std::move(out));
    });
  if (name == "keys")
    return bound([d](ValueList&, KwArgs&) {
      ValueList out;
      for (const auto& kv : d->items) out.push_back(Value::string(kv.first));
      return Value::make_list(std::move(out));
    });
  if (name == "values")
    return bound([d](ValueList&, KwArgs&) {
      ValueList out;
      for (const auto& kv : d->items) out.push_back(kv.second);
      return Value::make_list(std::move(out));
    });
  if (name == "get")
    return bound([d](ValueList& a, KwArgs& kw) {
      const Value key = arg(a, kw, 0, "key");
      const Value* v = key.is_string() ? d->find(key.s) : nullptr;
      return v ? *v : arg(a, kw, 1, "default", Value::none());
    });
  return Value::undefined();
}

// selectattr/map attribute paths: "a.b" and "0".
Value attr_path(const Value& v, const std::string& path) {
  Value cur = v;
  size_t k = 0;
  for (;;) {
    const size_t dot = path.find('.', k);
    const std::string part = path.substr(k, dot == std::string::npos ? std::string::npos : dot - k);
    if (!part.empty() && std::all_of(part.begin(), part.end(), [](char c) { return c >= '0' && c <= '9'; }))
      cur = get_item(cur, Value::integer(std::stoll(part)));
    else
      cur = get_attr(cur, part);
    if (dot == std::string::npos) return cur;
    k = dot + 1;
  }
}

// select/reject/selectattr/rejectattr: args after the attribute are a test
// name and its arguments; no test: truth.
Value select_impl(const Value& v, ValueList& args, bool by_attr, bool keep) {
  std::string attr;
  size_t k = 0;
  if (by_attr) {
    if (args.empty()) fail("selectattr/rejectattr need an attribute name");
    attr = need_str(args[0], "selectattr");
    k = 1;
  }
  std::string test;
  ValueList targs;
  if (k < args.size()) {
    test = need_str(args[k], "select");
    if (!known_test(test)) fail("no test named '" + test + "'");
    targs.assign(args.begin() + static_cast<long>(k) + 1, args.end());
  }
  ValueList out;
  for (const Value& item : iterate(v)) {
    const Value x = by_attr ? attr_path(item, attr) : item;
    const bool pass = test.empty() ? truthy(x) : apply_test(test, x, targs);
    if (pass == keep) out.push_back(item);
  }
  return Value::make_list(std::move(out));
}

int64_t to_int(const Value& v, int64_t def) {
  switch (v.kind) {
    case Value::Kind::kInt: return v.i;
    case Value::Kind::kBool: return v.b;
    case Value::Kind::kFloat: return static_cast<int64_t>(v.f);
    case Value::Kind::kString: {
      try {
        size_t used = 0;
        const std::string t = py_strip(v.s, Value::none(), true, true);
        const int64_t x = std::stoll(t, &used, 10);
        if (used == t.size()) return x;
        const double d = std::stod(t, &used);
        if (used == t.size()) return static_cast<int64_t>(d);
      } catch (const std::exception&) {
      }
      return def;
    }
    default: return def;
  }
}

const std::set<std::string>& filter_names() {
  static const std::set<std::string> names = {
      "trim", "length", "count", "tojson", "selectattr", "rejectattr", "select", "reject", "map", "join",
      "first", "last", "default", "d", "upper", "lower", "string", "int", "float", "list", "capitalize",
      "title", "indent", "replace", "items", "abs", "round", "sum", "min", "max", "reverse", "sort",
      "unique", "safe", "e", "escape", "wordcount", "dictsort", "batch"};
  return names;
}
const std::set<std::string>& test_names() {
  static const std::set<std::string> names = {
      "defined", "undefined", "none", "boolean", "false", "true", "integer", "float", "number", "string",
      "mapping", "iterable", "sequence", "callable", "odd", "even", "divisibleby", "eq", "equalto", "==",
      "ne", "!=", "lt", "lessthan", "<", "le", "<=", "gt", "greaterthan", ">", "ge", ">=", "in", "sameas",
      "lower", "upper", "filter", "test"};
  return names;
}

}  // namespace

bool known_filter(const std::string& name) { return filter_names().count(name) > 0; }
bool known_test(const std::string& name) { return test_names().count(name) > 0; }

int64_t py_len(const Value& v) {
  switch (v.kind) {
    case Value::Kind::kString: return static_cast<int64_t>(utf8_to_u32(v.s).size());
    case Value::Kind::kList: return static_cast<int64_t>(v.list->size());
    case Value::Kind::kDict: return static_cast<int64_t>(v.dict->items.size());
    case Value::Kind::kUndefined: return 0;
    default: fail(std::string("object of type '") + kind_name(v) + "' has no len()");
  }
}

ValueList iterate(const Value& v) {
  switch (v.kind) {
    case Value::Kind::kList: return *v.list;
    case Value::Kind::kDict: {
      ValueList out;
      for (const auto& kv : v.dict->items) out.push_back(Value::string(kv.first));
      return out;
    }
    case Value::Kind::kString: {
      ValueList out;
      for (char32_t c : utf8_to_u32(v.s)) out.push_back(Value::string(u32_to_utf8(std::u32string(1, c))));
      return out;
    }
    case Value::Kind::kUndefined: return {};
    default: fail(std::string("'") + kind_name(v) + "' object is not iterable");
  }
}

Value get_attr(const Value& obj, const std::string& name) {
  switch (obj.kind) {
    case Value::Kind::kUndefined:
      fail("'" + (obj.s.empty() ? std::string("value") : obj.s) + "' is undefined (reading ." + name + ")");
    case Value::Kind::kString: return string_method(obj, name);
    case Value::Kind::kDict: {
      if (obj.is_namespace) {
        const Value* v = obj.dict->find(name);
        return v ? *v : Value::undefined("namespace has no attribute '" + name + "'");
      }
      Value m = dict_method(obj, name);
      if (!m.is_undefined()) return m;
      const Value* v = obj.dict->find(name);
      return v ? *v : Value::undefined("dict object has no attribute '" + name + "'");
    }
    default: return Value::undefined(std::string(kind_name(obj)) + " object has no attribute '" + name + "'");
  }
}

Value get_item(const Value& obj, const Value& key) {
  switch (obj.kind) {
    case Value::Kind::kUndefined: fail("'" + (obj.s.empty() ? std::string("value") : obj.s) + "' is undefined (indexed)");
    case Value::Kind::kDict: {
      if (key.is_string() && !obj.is_namespace) {
        if (const Value* v = obj.dict->find(key.s)) return *v;
      }
      if (key.is_string()) return get_attr(obj, key.s);
      return Value::undefined("dict object has no element " + repr(key));
    }
    case Value::Kind::kList:
    case Value::Kind::kString: {
      if (key.kind != Value::Kind::kInt && key.kind != Value::Kind::kBool) {
        if (key.is_string()) return get_attr(obj, key.s);
        fail(std::string(kind_name(obj)) + " indices must be integers, not " + kind_name(key));
      }
      const int64_t n = py_len(obj);
      int64_t k = key.kind == Value::Kind::kBool ? key.b : key.i;
      if (k < 0) k += n;
      if (k < 0 || k >= n) return Value::undefined(std::string(kind_name(obj)) + " index out of range");
      if (obj.is_list()) return (*obj.list)[static_cast<size_t>(k)];
      return Value::string(u32_to_utf8(utf8_to_u32(obj.s).substr(static_cast<size_t>(k), 1)));
    }
    default: return Value::undefined(std::string(kind_name(obj)) + " object is not subscriptable");
  }
}

Value slice(const Value& obj, const Value& start_v, const Value& stop_v, const Value& step_v) {
  if (!obj.is_list() && !obj.is_string()) fail(std::string("'") + kind_name(obj) + "' object is not subscriptable");
  const int64_t n = py_len(obj);
  auto num = [](const Value& v, const char* what) -> std::pair<bool, int64_t> {
    if (v.is_undefined() || v.is_none()) return {false, 0};
    if (v.kind != Value::Kind::kInt && v.kind != Value::Kind::kBool)
      fail(std::string("slice ") + what + " must be an integer or None");
    return {true, v.kind == Value::Kind::kBool ? v.b : v.i};
  };
  const auto [has_step, step0] = num(step_v, "step");
  const int64_t step = has_step ? step0 : 1;
  if (step == 0) fail("slice step cannot be zero");
  auto clamp = [&](std::pair<bool, int64_t> p, int64_t def) {
    if (!p.first) return def;
    int64_t x = p.second;
    if (x < 0) x += n;
    if (step > 0) return std::clamp<int64_t>(x, 0, n);
    return std::clamp<int64_t>(x, -1, n - 1);
  };
  const int64_t start = clamp(num(start_v, "start"), step > 0 ? 0 : n - 1);
  const int64_t stop = clamp(num(stop_v, "stop"), step > 0 ? n : -1);
  std::vector<int64_t> idx;
  for (int64_t k = start; step > 0 ? k < stop : k > stop; k += step) idx.push_back(k);
  if (obj.is_list()) {
    ValueList out;
    for (int64_t k : idx) out.push_back((*obj.list)[static_cast<size_t>(k)]);
    return Value::make_list(std::move(out));
  }
  const std::u32string u = utf8_to_u32(obj.s);
  std::u32string out;
  for (int64_t k : idx) out += u[static_cast<size_t>(k)];
  return Value::string(u32_to_utf8(out));
}

bool apply_test(const std::string& name, const Value& v, const ValueList& args) {
  auto a0 = [&]() -> const Value& {
    if (args.empty()) fail("the test '" + name + "' needs an argument");
    return args[0];
  };
  using K = Value::Kind;
  if (name == "defined") return !v.is_undefined();
  if (name == "undefined") return v.is_undefined();
  if (name == "none") return v.is_none();
  if (name == "boolean") return v.kind == K::kBool;
  if (name == "false") return v.kind == K::kBool && !v.b;
  if (name == "true") return v.kind == K::kBool && v.b;
  if (name == "integer") return v.kind == K::kInt;
  if (name == "float") return v.kind == K::kFloat;
  if (name == "number") return v.is_number();
  if (name == "string") return v.is_string();
  if (name == "mapping") return v.is_dict() && !v.is_namespace;
  if (name == "iterable" || name == "sequence") return v.is_list() || v.is_string() || (v.is_dict() && !v.is_namespace);
  if (name == "callable") return v.kind == K::kCallable;
  if (name == "odd" || name == "even") {
    if (v.kind != K::kInt) fail("the test '" + name + "' needs an integer");
    return ((v.i % 2 + 2) % 2 == 1) == (name == "odd");
  }
  if (name == "divisibleby") {
    const int64_t d = to_int(a0(), 0);
    if (d == 0) fail("divisibleby(0)");
    return to_int(v, 0) % d == 0;
  }
  if (name == "eq" || name == "equalto" || name == "==") return equals(v, a0());
  if (name == "ne" || name == "!=") return !equals(v, a0());
  if (name == "lt" || name == "lessthan" || name == "<") return less(v, a0());
  if (name == "le" || name == "<=") return !less(a0(), v);
  if (name == "gt" || name == "greaterthan" || name == ">") return less(a0(), v);
  if (name == "ge" || name == ">=") return !less(v, a0());
  if (name == "in") {
    const Value& c = a0();
    if (c.is_string()) return v.is_string() && c.s.find(v.s) != std::string::npos;
    if (c.is_dict()) return v.is_string() && c.dict->find(v.s) != nullptr;
    for (const Value& x : iterate(c))
      if (equals(x, v)) return true;
    return false;
  }
  if (name == "sameas") {
    const Value& o = a0();
    if (v.kind != o.kind) return false;
    if (v.is_none() || v.is_undefined()) return true;
    if (v.kind == K::kBool) return v.b == o.b;
    if (v.kind == K::kInt) return v.i == o.i;  // CPython caches small ints; templates compare those
    if (v.is_string()) return v.s == o.s;
    if (v.is_list()) return v.list == o.list;
    if (v.is_dict()) return v.dict == o.dict;
    return false;
  }
  if (name == "lower") return v.is_string() && lower_ascii(v.s) == v.s;
  if (name == "upper") return v.is_string() && upper_ascii(v.s) == v.s;
  if (name == "filter") return a0().is_string() && known_filter(a0().s);
  if (name == "test") return a0().is_string() && known_test(a0().s);
  fail("no test named '" + name + "'");
}

Value apply_filter(const std::string& name, const Value& v, ValueList& args, KwArgs& kw) {
  using K = Value::Kind;
  if (name == "trim") return Value::string(py_strip(to_str(v), arg(args, kw, 0, "chars", Value::none()), true, true));
  if (name == "length" || name == "count") return Value::integer(py_len(v));
  if (name == "tojson") {
    const Value ind = arg(args, kw, 1, "indent", Value::none());
    const Value asc = arg(args, kw, 0, "ensure_ascii", Value::boolean(false));
    const Value seps = arg(args, kw, 2, "separators", Value::none());
    const Value sk = arg(args, kw, 3, "sort_keys", Value::boolean(false));
    // transformers' tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    // a positional first argument is ensure_ascii... but templates pass indent by keyword.
    int indent = -1;
    if (ind.kind == K::kInt) indent = static_cast<int>(ind.i);
    else if (!ind.is_none() && !ind.is_undefined()) fail("tojson: indent must be an integer");
    std::string isep = indent >= 0 ? "," : ", ", ksep = ": ";
    if (seps.is_list() && seps.list->size() == 2) {
      isep = need_str((*seps.list)[0], "tojson separators");
      ksep = need_str((*seps.list)[1], "tojson separators");
    }
    try {
      return Value::string(to_json(v, indent, truthy(asc), isep, ksep, truthy(sk)));
    } catch (const std::invalid_argument& e) {
      fail(e.what());
    }
  }
  if (name == "selectattr" || name == "rejectattr") return select_impl(v, args, true, name == "selectattr");
  if (name == "select" || name == "reject") return select_impl(v, args, false, name == "select");
  if (name == "map") {
    ValueList out;
    if (const Value* at = kwarg(kw, "attribute")) {
      const Value* def = kwarg(kw, "default");
      for (const Value& item : iterate(v)) {
        Value x = attr_path(item, need_str(*at, "map attribute"));
        out.push_back(x.is_undefined() && def ? *def : x);
      }
      return Value::make_list(std::move(out));
    }
    if (args.empty()) fail("map needs a filter name or attribute=");
    const std::string f = need_str(args[0], "map");
    if (!known_filter(f)) fail("no filter named '" + f + "'");
    ValueList fargs(args.begin() + 1, args.end());
    KwArgs fkw;
    for (const Value& item : iterate(v)) {
      ValueList a = fargs;
      out.push_back(apply_filter(f, item, a, fkw));
    }
    return Value::make_list(std::move(out));
  }
  if (name == "join") {
    const Value sep = arg(args, kw, 0, "d", Value::string(""));
    const Value at = arg(args, kw, 1, "attribute", Value::none());
    std::string out;
    bool first = true;
    for (const Value& item : iterate(v)) {
      if (!first) out += to_str(sep);
      out += to_str(at.is_string() ? attr_path(item, at.s) : item);
      first = false;
    }
    return Value::string(out);
  }
  if (name == "first" || name == "last") {
    const ValueList l = iterate(v);
    if (l.empty()) return Value::undefined("No " + name + " item, sequence was empty.");
    return name == "first" ? l.front() : l.back();
  }
  if (name == "default" || name == "d") {
    const Value def = arg(args, kw, 0, "default_value", Value::string(""));
    const bool boolean = truthy(arg(args, kw, 1, "boolean", Value::boolean(false)));
    if (v.is_undefined() || (boolean && !truthy(v))) return def;
    return v;
  }
  if (name == "upper") return Value::string(upper_ascii(to_str(v)));
  if (name == "lower") return Value::string(lower_ascii(to_str(v)));
  if (name == "capitalize") return Value::string(capitalize_ascii(to_str(v)));
  if (name == "title") return Value::string(title_ascii(to_str(v)));
  if (name == "string" || name == "safe" || name == "e" || name == "escape") {
    if (name == "e" || name == "escape") {
      std::string out;
      for (char c : to_str(v)) {
        switch (c) {
          case '&': out += "&amp;"; break;
          case '<': out += "&lt;"; break;
          case '>': out += "&gt;"; break;
          case '"': out += "&#34;"; break;
          case '\'': out += "&#39;"; break;
          default: out += c;
        }
      }
      return Value::string(out);
    }
    return v.is_string() ? v : Value::string(to_str(v));
  }
  if (name == "int") return Value::integer(to_int(v, to_int(arg(args, kw, 0, "default", Value::integer(0)), 0)));
  if (name == "float") {
    if (v.is_number()) return Value::number(v.as_double());
    if (v.is_string()) {
      try {
        size_t used = 0;
        const double d = std::stod(v.s, &used);
        if (used == v.s.size()) return Value::number(d);
      } catch (const std::exception&) {
      }
    }
    return Value::number(arg(args, kw, 0, "default", Value::number(0)).as_double());
  }
  if (name == "list") return Value::make_list(iterate(v));
  if (name == "items") {
    if (v.is_undefined()) return Value::make_list();
    if (!v.is_dict()) fail("items filter: expected a mapping, got " + std::string(kind_name(v)));
    ValueList out;
    for (const auto& kv : v.dict->items) out.push_back(Value::make_tuple({Value::string(kv.first), kv.second}));
    return Value::make_list(std::move(out));
  }
  if (name == "indent") {
    const Value w = arg(args, kw, 0, "width", Value::integer(4));
    const bool first = truthy(arg(args, kw, 1, "first", Value::boolean(false)));
    const bool blank = truthy(arg(args, kw, 2, "blank", Value::boolean(false)));
    const std::string pad = w.is_string() ? w.s : std::string(static_cast<size_t>(std::max<int64_t>(0, w.i)), ' ');
    std::string s = to_str(v), out;
    // jinja2: newlines become "\n" + pad, except before empty lines unless blank.
    size_t k = 0;
    bool first_line = true;
    for (;;) {
      const size_t e = s.find('\n', k);
      const std::string line = s.substr(k, e == std::string::npos ? std::string::npos : e - k);
      if (first_line) out += (first ? pad : "") + line;
      else out += (blank || !line.empty() ? pad : "") + line;
      first_line = false;
      if (e == std::string::npos) break;
      out += '\n';
      k = e + 1;
    }
    return Value::string(out);
  }
  if (name == "replace") {
    const Value cnt = arg(args, kw, 2, "count", Value::none());
    return Value::string(py_replace(to_str(v), to_str(arg(args, kw, 0, "old")), to_str(arg(args, kw, 1, "new")),
                                    cnt.kind == K::kInt ? cnt.i : -1));
  }
  if (name == "abs") {
    if (v.kind == K::kFloat) return Value::number(std::fabs(v.f));
    if (v.kind == K::kInt) return Value::integer(v.i < 0 ? -v.i : v.i);
    fail("bad operand type for abs(): '" + std::string(kind_name(v)) + "'");
  }
  if (name == "round") {
    const int64_t prec = to_int(arg(args, kw, 0, "precision", Value::integer(0)), 0);
    const double m = std::pow(10.0, static_cast<double>(prec));
    return Value::number(std::round(v.as_double() * m) / m);
  }
  if (name == "sum") {
    const Value at = arg(args, kw, 0, "attribute", Value::none());
    Value acc = arg(args, kw, 1, "start", Value::integer(0));
    for (const Value& item : iterate(v)) {
      const Value x = at.is_string() ? attr_path(item, at.s) : item;
      if (acc.kind == K::kInt && x.kind == K::kInt) acc.i += x.i;
      else acc = Value::number(acc.as_double() + x.as_double());
    }
    return acc;
  }
  if (name == "min" || name == "max") {
    const ValueList l = iterate(v);
    if (l.empty()) return Value::undefined("No aggregated item, sequence was empty.");
    Value best = l[0];
    for (const Value& x : l)
      if (name == "min" ? less(x, best) : less(best, x)) best = x;
    return best;
  }
  if (name == "reverse") {
    if (v.is_string()) {
      std::u32string u = utf8_to_u32(v.s);
      std::reverse(u.begin(), u.end());
      return Value::string(u32_to_utf8(u));
    }
    ValueList l = iterate(v);
    std::reverse(l.begin(), l.end());
    return Value::make_list(std::move(l));
  }
  if (name == "sort") {
    const bool rev = truthy(arg(args, kw, 0, "reverse", Value::boolean(false)));
    const Value at = arg(args, kw, 2, "attribute", Value::none());
    ValueList l = iterate(v);
    auto key = [&](const Value& x) { return at.is_string() ? attr_path(x, at.s) : x; };
    std::stable_sort(l.begin(), l.end(), [&](const Value& a, const Value& b) {
      return rev ? less(key(b), key(a)) : less(key(a), key(b));
    });
    return Value::make_list(std::move(l));
  }
  if (name == "unique") {
    ValueList out;
    for (const Value& x : iterate(v)) {
      bool seen = false;
      for (const Value& y : out) seen = seen || equals(x, y);
      if (!seen) out.push_back(x);
    }
    return Value::make_list(std::move(out));
  }
  if (name == "wordcount") return Value::integer(py_len(py_split(to_str(v), Value::none(), Value::integer(-1))));
  if (name == "dictsort") {
    if (!v.is_dict()) fail("dictsort: expected a mapping");
    ValueList out;
    for (const auto& kv : v.dict->items) out.push_back(Value::make_tuple({Value::string(kv.first), kv.second}));
    std::stable_sort(out.begin(), out.end(),
                     [](const Value& a, const Value& b) { return less((*a.list)[0], (*b.list)[0]); });
    return Value::make_list(std::move(out));
  }
  if (name == "batch") {
    const int64_t n = to_int(arg(args, kw, 0, "linecount"), 0);
    if (n <= 0) fail("batch: linecount must be positive");
    ValueList out, cur;
    for (const Value& x : iterate(v)) {
      cur.push_back(x);
      if (static_cast<int64_t>(cur.size()) == n) {
        out.push_back(Value::make_list(std::move(cur)));
        cur.clear();
      }
    }
    if (!cur.empty()) out.push_back(Value::make_list(std::move(cur)));
    return Value::make_list(std::move(out));
  }
  fail("no filter named '" + name + "'");
}

}  // namespace trainrun::jinja
