#include "core/data/chat/jinja_value.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>

namespace trainrun::jinja {

const Value* ValueDict::find(const std::string& key) const {
  for (const auto& kv : items)
    if (kv.first == key) return &kv.second;
  return nullptr;
}

void ValueDict::set(const std::string& key, Value v) {
  for (auto& kv : items)
    if (kv.first == key) {
      kv.second = std::move(v);
      return;
    }
  items.emplace_back(key, std::move(v));
}

Value Value::undefined(std::string what) {
  Value v;
  v.s = std::move(what);
  return v;
}
Value Value::none() {
  Value v;
  v.kind = Kind::kNone;
  return v;
}
Value Value::boolean(bool x) {
  Value v;
  v.kind = Kind::kBool;
  v.b = x;
  return v;
}
Value Value::integer(int64_t x) {
  Value v;
  v.kind = Kind::kInt;
  v.i = x;
  return v;
}
Value Value::number(double x) {
  Value v;
  v.kind = Kind::kFloat;
  v.f = x;
  return v;
}
Value Value::string(std::string x) {
  Value v;
  v.kind = Kind::kString;
  v.s = std::move(x);
  return v;
}
Value Value::make_list(ValueList x) {
  Value v;
  v.kind = Kind::kList;
  v.list = std::make_shared<ValueList>(std::move(x));
  return v;
}
Value Value::make_tuple(ValueList x) {
  Value v = make_list(std::move(x));
  v.is_tuple = true;
  return v;
}
Value Value::make_dict() {
  Value v;
  v.kind = Kind::kDict;
  v.dict = std::make_shared<ValueDict>();
  return v;
}
Value Value::callable(Builtin fn) {
  Value v;
  v.kind = Kind::kCallable;
  v.fn = std::make_shared<Builtin>(std::move(fn));
  return v;
}

Value Value::from_json(const nlohmann::ordered_json& j) {
  switch (j.type()) {
    case nlohmann::ordered_json::value_t::null: return none();
    case nlohmann::ordered_json::value_t::boolean: return boolean(j.get<bool>());
    case nlohmann::ordered_json::value_t::number_integer: return integer(j.get<int64_t>());
    case nlohmann::ordered_json::value_t::number_unsigned: return integer(static_cast<int64_t>(j.get<uint64_t>()));
    case nlohmann::ordered_json::value_t::number_float: return number(j.get<double>());
    case nlohmann::ordered_json::value_t::string: return string(j.get<std::string>());
    case nlohmann::ordered_json::value_t::array: {
      ValueList l;
      l.reserve(j.size());
      for (const auto& x : j) l.push_back(from_json(x));
      return make_list(std::move(l));
    }
    case nlohmann::ordered_json::value_t::object: {
      Value d = make_dict();
      for (auto it = j.begin(); it != j.end(); ++it) d.dict->items.emplace_back(it.key(), from_json(it.value()));
      return d;
    }
    default: return undefined("a binary JSON value");
  }
}

const char* kind_name(const Value& v) {
  switch (v.kind) {
    case Value::Kind::kUndefined: return "undefined";
    case Value::Kind::kNone: return "NoneType";
    case Value::Kind::kBool: return "bool";
    case Value::Kind::kInt: return "int";
    case Value::Kind::kFloat: return "float";
    case Value::Kind::kString: return "str";
    case Value::Kind::kList: return "list";
    case Value::Kind::kDict: return v.is_namespace ? "Namespace" : "dict";
    case Value::Kind::kCallable: return "function";
  }
  return "?";
}

bool truthy(const Value& v) {
  switch (v.kind) {
    case Value::Kind::kUndefined:
    case Value::Kind::kNone: return false;
    case Value::Kind::kBool: return v.b;
    case Value::Kind::kInt: return v.i != 0;
    case Value::Kind::kFloat: return v.f != 0.0;
    case Value::Kind::kString: return !v.s.empty();
    case Value::Kind::kList: return !v.list->empty();
    case Value::Kind::kDict: return v.is_namespace || !v.dict->items.empty();
    case Value::Kind::kCallable: return true;
  }
  return false;
}

bool equals(const Value& a, const Value& b) {
  if (a.is_number() && b.is_number()) {
    if (a.kind != Value::Kind::kFloat && b.kind != Value::Kind::kFloat)
      return (a.kind == Value::Kind::kBool ? a.b : a.i) == (b.kind == Value::Kind::kBool ? b.b : b.i);
    return a.as_double() == b.as_double();
  }
  if (a.kind != b.kind) return false;
  switch (a.kind) {
    case Value::Kind::kUndefined:
    case Value::Kind::kNone: return true;
    case Value::Kind::kString: return a.s == b.s;
    case Value::Kind::kList: {
      if (a.list->size() != b.list->size()) return false;
      for (size_t k = 0; k < a.list->size(); ++k)
        if (!equals((*a.list)[k], (*b.list)[k])) return false;
      return true;
    }
    case Value::Kind::kDict: {
      if (a.dict->items.size() != b.dict->items.size()) return false;
      for (const auto& kv : a.dict->items) {
        const Value* o = b.dict->find(kv.first);
        if (!o || !equals(kv.second, *o)) return false;
      }
      return true;
    }
    case Value::Kind::kCallable: return a.fn == b.fn;
    default: return false;
  }
}

bool less(const Value& a, const Value& b) {
  if (a.is_number() && b.is_number()) return a.as_double() < b.as_double();
  if (a.is_string() && b.is_string()) return utf8_to_u32(a.s) < utf8_to_u32(b.s);
  if (a.is_list() && b.is_list()) {
    const auto &x = *a.list, &y = *b.list;
    for (size_t k = 0; k < x.size() && k < y.size(); ++k) {
      if (less(x[k], y[k])) return true;
      if (less(y[k], x[k])) return false;
    }
    return x.size() < y.size();
  }
  throw std::invalid_argument(std::string("'<' not supported between instances of '") + kind_name(a) + "' and '" +
                              kind_name(b) + "'");
}

std::string float_repr(double d) {
  if (std::isnan(d)) return "nan";
  if (std::isinf(d)) return d > 0 ? "inf" : "-inf";
  // Python's repr: the shortest digits that round-trip, positional for
  // exponents in [-4, 16), scientific otherwise.
  char buf[64];
  int prec = 1;
  for (; prec <= 17; ++prec) {
    std::snprintf(buf, sizeof buf, "%.*e", prec - 1, d);
    if (std::strtod(buf, nullptr) == d) break;
  }
  std::string s = buf;
  const size_t e = s.find('e');
  const int exp10 = std::atoi(s.c_str() + e + 1);
  std::string mant = s.substr(0, e);
  const bool neg = mant[0] == '-';
  if (neg) mant.erase(0, 1);
  std::string digits;
  for (char c : mant)
    if (c != '.') digits += c;
  while (digits.size() > 1 && digits.back() == '0') digits.pop_back();
  std::string out;
  if (exp10 >= -4 && exp10 < 16) {
    if (exp10 >= 0) {
      if (static_cast<int>(digits.size()) <= exp10 + 1) out = digits + std::string(exp10 + 1 - digits.size(), '0') + ".0";
      else out = digits.substr(0, exp10 + 1) + "." + digits.substr(exp10 + 1);
    } else {
      out = "0." + std::string(-exp10 - 1, '0') + digits;
    }
  } else {
    out = digits.substr(0, 1);
    if (digits.size() > 1) out += "." + digits.substr(1);
    char eb[16];
    std::snprintf(eb, sizeof eb, "e%c%02d", exp10 < 0 ? '-' : '+', std::abs(exp10));
    out += eb;
  }
  return neg ? "-" + out : out;
}

namespace {
// str.isprintable() approximated without Unicode tables: controls, the
// separators py_isspace knows (but ' ') and the zero-width format
// characters are not printable; other code points are.
bool py_printable(char32_t c) {
  if (c == ' ') return true;
  if (c < 0x20 || (c >= 0x7F && c <= 0xA0) || c == 0xAD || py_isspace(c)) return false;
  if ((c >= 0x200B && c <= 0x200F) || (c >= 0x202A && c <= 0x202E) || (c >= 0x2060 && c <= 0x2064) || c == 0xFEFF)
    return false;
  return true;
}
std::string repr_string(const std::string& s) {
  // Python: single quotes unless the text has ' and no ".
  const bool dq = s.find('\'') != std::string::npos && s.find('"') == std::string::npos;
  const char q = dq ? '"' : '\'';
  std::string out(1, q);
  for (char32_t c : utf8_to_u32(s)) {
    if (c == static_cast<char32_t>(q) || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c == '\n') out += "\\n";
    else if (c == '\r') out += "\\r";
    else if (c == '\t') out += "\\t";
    else if (!py_printable(c)) {
      char b[16];
      std::snprintf(b, sizeof b, c < 0x100 ? "\\x%02x" : c < 0x10000 ? "\\u%04x" : "\\U%08x", static_cast<unsigned>(c));
      out += b;
    } else out += u32_to_utf8(std::u32string(1, c));
  }
  return out + q;
}
}  // namespace

std::string repr(const Value& v) {
  switch (v.kind) {
    case Value::Kind::kString: return repr_string(v.s);
    case Value::Kind::kList: {
      std::string out = v.is_tuple ? "(" : "[";
      for (size_t k = 0; k < v.list->size(); ++k) out += (k ? ", " : "") + repr((*v.list)[k]);
      if (v.is_tuple && v.list->size() == 1) out += ",";
      return out + (v.is_tuple ? ")" : "]");
    }
    case Value::Kind::kDict: {
      if (v.is_namespace) return "<Namespace>";
      std::string out = "{";
      bool first = true;
      for (const auto& kv : v.dict->items) {
        out += (first ? "" : ", ") + repr_string(kv.first) + ": " + repr(kv.second);
        first = false;
      }
      return out + "}";
    }
    default: return to_str(v);
  }
}

std::string to_str(const Value& v) {
  switch (v.kind) {
    case Value::Kind::kUndefined: return "";
    case Value::Kind::kNone: return "None";
    case Value::Kind::kBool: return v.b ? "True" : "False";
    case Value::Kind::kInt: return std::to_string(v.i);
    case Value::Kind::kFloat: return float_repr(v.f);
    case Value::Kind::kString: return v.s;
    case Value::Kind::kCallable: return "<function>";
    default: return repr(v);
  }
}

namespace {
void json_string(const std::string& s, bool ensure_ascii, std::string& out) {
  out += '"';
  const std::u32string u = ensure_ascii ? utf8_to_u32(s) : std::u32string();
  auto esc = [&](uint32_t c) {
    char b[8];
    std::snprintf(b, sizeof b, "\\u%04x", c);
    out += b;
  };
  auto one = [&](char32_t c, const char* raw, size_t rawlen) {
    switch (c) {
      case '"': out += "\\\""; return;
      case '\\': out += "\\\\"; return;
      case '\n': out += "\\n"; return;
      case '\r': out += "\\r"; return;
      case '\t': out += "\\t"; return;
      case '\b': out += "\\b"; return;
      case '\f': out += "\\f"; return;
      default: break;
    }
    if (c < 0x20) esc(c);
    else if (ensure_ascii && c > 0x7E) {
      if (c >= 0x10000) {
        const uint32_t v = c - 0x10000;
        esc(0xD800 + (v >> 10));
        esc(0xDC00 + (v & 0x3FF));
      } else esc(c);
    } else out.append(raw, rawlen);
  };
  if (ensure_ascii) {
    for (char32_t c : u) {
      const char r = static_cast<char>(c);
      one(c, &r, 1);
    }
  } else {
    for (size_t k = 0; k < s.size(); ++k) one(static_cast<unsigned char>(s[k]), &s[k], 1);
  }
  out += '"';
}

void json_value(const Value& v, int indent, int depth, bool ascii, const std::string& isep, const std::string& ksep,
                bool sort_keys, std::string& out) {
  auto newline = [&](int d) {
    if (indent < 0) return;
    out += '\n';
    out.append(static_cast<size_t>(indent) * d, ' ');
  };
  switch (v.kind) {
    case Value::Kind::kUndefined:
      throw std::invalid_argument("Object of type Undefined is not JSON serializable");
    case Value::Kind::kNone: out += "null"; return;
    case Value::Kind::kBool: out += v.b ? "true" : "false"; return;
    case Value::Kind::kInt: out += std::to_string(v.i); return;
    case Value::Kind::kFloat:
      out += std::isnan(v.f) ? "NaN" : std::isinf(v.f) ? (v.f > 0 ? "Infinity" : "-Infinity") : float_repr(v.f);
      return;
    case Value::Kind::kString: json_string(v.s, ascii, out); return;
    case Value::Kind::kList: {
      if (v.list->empty()) {
        out += "[]";
        return;
      }
      out += '[';
      for (size_t k = 0; k < v.list->size(); ++k) {
        if (k) out += isep;
        newline(depth + 1);
        json_value((*v.list)[k], indent, depth + 1, ascii, isep, ksep, sort_keys, out);
      }
      newline(depth);
      out += ']';
      return;
    }
    case Value::Kind::kDict: {
      if (v.dict->items.empty()) {
        out += "{}";
        return;
      }
      std::vector<const std::pair<std::string, Value>*> items;
      for (const auto& kv : v.dict->items) items.push_back(&kv);
      if (sort_keys)
        std::stable_sort(items.begin(), items.end(), [](auto* a, auto* b) { return a->first < b->first; });
      out += '{';
      for (size_t k = 0; k < items.size(); ++k) {
        if (k) out += isep;
        newline(depth + 1);
        json_string(items[k]->first, ascii, out);
        out += ksep;
        json_value(items[k]->second, indent, depth + 1, ascii, isep, ksep, sort_keys, out);
      }
      newline(depth);
      out += '}';
      return;
    }
    case Value::Kind::kCallable: throw std::invalid_argument("Object of type function is not JSON serializable");
  }
}
}  // namespace

std::string to_json(const Value& v, int indent, bool ensure_ascii, const std::string& item_sep,
                    const std::string& key_sep, bool sort_keys) {
  std::string out;
  json_value(v, indent, 0, ensure_ascii, item_sep, key_sep, sort_keys, out);
  return out;
}

std::u32string utf8_to_u32(const std::string& s) {
  // The input is valid UTF-8 (rows are checked before rendering); a stray
  // byte is kept as its own code point rather than refused.
  std::u32string out;
  out.reserve(s.size());
  for (size_t k = 0; k < s.size();) {
    const unsigned char c = static_cast<unsigned char>(s[k]);
    int n = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 1;
    if (k + n > s.size()) n = 1;
    char32_t cp = n == 1 ? c : n == 2 ? (c & 0x1F) : n == 3 ? (c & 0x0F) : (c & 0x07);
    for (int j = 1; j < n; ++j) cp = (cp << 6) | (static_cast<unsigned char>(s[k + j]) & 0x3F);
    out += cp;
    k += n;
  }
  return out;
}

std::string u32_to_utf8(const std::u32string& u) {
  std::string out;
  out.reserve(u.size());
  for (char32_t c : u) {
    if (c < 0x80) out += static_cast<char>(c);
    else if (c < 0x800) {
      out += static_cast<char>(0xC0 | (c >> 6));
      out += static_cast<char>(0x80 | (c & 0x3F));
    } else if (c < 0x10000) {
      out += static_cast<char>(0xE0 | (c >> 12));
      out += static_cast<char>(0x80 | ((c >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (c & 0x3F));
    } else {
      out += static_cast<char>(0xF0 | (c >> 18));
      out += static_cast<char>(0x80 | ((c >> 12) & 0x3F));
      out += static_cast<char>(0x80 | ((c >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (c & 0x3F));
    }
  }
  return out;
}

bool py_isspace(char32_t c) {
  return (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x20) || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}

}  // namespace trainrun::jinja
