// Lexer and parser of the Jinja2 subset (jinja.h). The lexer applies
// jinja2's whitespace rules as transformers configures them:
//   trim_blocks    the first newline after a block or comment tag is removed
//   lstrip_blocks  spaces and tabs from the start of a line up to a block or
//                  comment tag are removed ({%+ turns it off for one tag)
//   {%- / -%}      all whitespace before / after the tag is removed
//   keep_trailing_newline=False: one newline at the end of the source is dropped.
// The parser follows jinja2's precedence: or < and < not < comparisons
// (in, is) < + - < ~ < * / // % < ** < unary - < postfix (. [] () | is).
#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <cstring>

#include "core/data/chat/jinja.h"
#include "core/data/chat/jinja_ast.h"
#include "core/data/chat/jinja_builtins.h"

namespace trainrun::jinja {
namespace {

enum class Tok { kText, kVarBegin, kVarEnd, kBlockBegin, kBlockEnd, kName, kString, kInt, kFloat, kOp, kEof };

struct Token {
  Tok type;
  std::string text;
  size_t pos = 0;
};

bool is_ws(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; }

class Lexer {
 public:
  Lexer(const std::string& src, const std::string& name) : src_(src), name_(name) {
    for (size_t k = 0; k < src_.size(); ++k)
      if (src_[k] == '\n') line_starts_.push_back(k + 1);
  }

  [[noreturn]] void fail(size_t pos, const std::string& msg) const {
    int col = 0;
    const size_t line = offset_line_col(pos, &col);
    throw TemplateError(name_ + ":" + std::to_string(line) + ":" + std::to_string(col) + ": " + msg, false);
  }

  std::vector<Token> run() {
    size_t pos = 0;
    bool strip_next = false, trim_next = false, line_starting = true;
    while (pos < src_.size()) {
      size_t tag = pos;
      for (;;) {
        tag = src_.find('{', tag);
        if (tag == std::string::npos || tag + 1 >= src_.size()) {
          tag = std::string::npos;
          break;
        }
        const char k = src_[tag + 1];
        if (k == '{' || k == '%' || k == '#') break;
        ++tag;
      }
      std::string data = src_.substr(pos, tag == std::string::npos ? std::string::npos : tag - pos);
      if (strip_next) {
        size_t k = 0;
        while (k < data.size() && is_ws(data[k])) ++k;
        data.erase(0, k);
      } else if (trim_next && !data.empty() && data[0] == '\n') {
        data.erase(0, 1);
      }
      if (tag == std::string::npos) {
        emit_text(std::move(data), pos);
        break;
      }
      const char kind = src_[tag + 1];
      const char sign = tag + 2 < src_.size() ? src_[tag + 2] : 0;
      if (sign == '-') {
        while (!data.empty() && is_ws(data.back())) data.pop_back();
      } else if (kind != '{' && sign != '+') {
        // Only spaces and tabs between the line's start (a newline in the
        // text, or the template's start / a newline a tag end consumed) and the tag.
        const size_t nl = data.rfind('\n');
        const size_t l_pos = nl == std::string::npos ? 0 : nl + 1;
        if (nl != std::string::npos || line_starting) {
          bool only = true;
          for (size_t k = l_pos; k < data.size(); ++k)
            if (data[k] != ' ' && data[k] != '\t') only = false;
          if (only) data.erase(l_pos);
        }
      }
      emit_text(std::move(data), pos);
      size_t p = tag + 2 + ((sign == '-' || sign == '+') ? 1 : 0);
      char end_sign = 0;
      if (kind == '#') {
        const size_t e = src_.find("#}", p);
        if (e == std::string::npos) fail(tag, "unclosed comment (no '#}')");
        end_sign = e > p && (src_[e - 1] == '-' || src_[e - 1] == '+') ? src_[e - 1] : 0;
        p = e + 2;
      } else {
        toks_.push_back({kind == '{' ? Tok::kVarBegin : Tok::kBlockBegin, "", tag});
        p = lex_tag(p, kind == '{' ? '}' : '%', tag, &end_sign);
        toks_.push_back({kind == '{' ? Tok::kVarEnd : Tok::kBlockEnd, "", p - 2});
      }
      strip_next = end_sign == '-';
      trim_next = kind != '{' && end_sign != '+';
      // jinja2's line_starting: the consumed tag end (with the whitespace a
      // '-' strips or the newline trim_blocks eats) ended with a newline.
      line_starting = false;
      if (strip_next) {
        size_t k = p;
        while (k < src_.size() && is_ws(src_[k])) ++k;
        line_starting = k > p && src_[k - 1] == '\n';
      } else if (trim_next && p < src_.size() && src_[p] == '\n') {
        line_starting = true;
      }
      pos = p;
    }
    toks_.push_back({Tok::kEof, "", src_.size()});
    return std::move(toks_);
  }

  // 1-based line and column (in bytes) of a source offset.
  size_t offset_line_col(size_t pos, int* col) const {
    const size_t line = static_cast<size_t>(std::upper_bound(line_starts_.begin(), line_starts_.end(), pos) -
                                            line_starts_.begin());
    *col = static_cast<int>(pos - line_starts_[line - 1]) + 1;
    return line;
  }

 private:
  void emit_text(std::string data, size_t pos) {
    if (!data.empty()) toks_.push_back({Tok::kText, std::move(data), pos});
  }

  // Tokens of one {{ }} or {% %} up to its end; returns the offset after it.
  size_t lex_tag(size_t p, char close, size_t tag, char* end_sign) {
    for (;;) {
      while (p < src_.size() && is_ws(src_[p])) ++p;
      if (p >= src_.size()) fail(tag, std::string("unclosed tag (no '") + close + "}')");
      const char c = src_[p];
      if ((c == '-' || c == '+') && p + 2 < src_.size() + 0 && src_[p + 1] == close && src_[p + 2] == '}') {
        *end_sign = c;
        return p + 3;
      }
      if (c == close && p + 1 < src_.size() && src_[p + 1] == '}') {
        *end_sign = 0;
        return p + 2;
      }
      if (std::isalpha(static_cast<unsigned char>(c)) || c == '_') {
        size_t e = p;
        while (e < src_.size() && (std::isalnum(static_cast<unsigned char>(src_[e])) || src_[e] == '_')) ++e;
        toks_.push_back({Tok::kName, src_.substr(p, e - p), p});
        p = e;
        continue;
      }
      if (std::isdigit(static_cast<unsigned char>(c))) {
        size_t e = p;
        bool flt = false;
        while (e < src_.size() && (std::isdigit(static_cast<unsigned char>(src_[e])) || src_[e] == '_')) ++e;
        if (e + 1 < src_.size() && src_[e] == '.' && std::isdigit(static_cast<unsigned char>(src_[e + 1]))) {
          flt = true;
          ++e;
          while (e < src_.size() && std::isdigit(static_cast<unsigned char>(src_[e]))) ++e;
        }
        if (e < src_.size() && (src_[e] == 'e' || src_[e] == 'E')) {
          size_t f = e + 1;
          if (f < src_.size() && (src_[f] == '+' || src_[f] == '-')) ++f;
          if (f < src_.size() && std::isdigit(static_cast<unsigned char>(src_[f]))) {
            flt = true;
            e = f;
            while (e < src_.size() && std::isdigit(static_cast<unsigned char>(src_[e]))) ++e;
          }
        }
        std::string num;
        for (size_t k = p; k < e; ++k)
          if (src_[k] != '_') num += src_[k];
        toks_.push_back({flt ? Tok::kFloat : Tok::kInt, num, p});
        p = e;
        continue;
      }
      if (c == '\'' || c == '"') {
        p = lex_string(p);
        continue;
      }
      static const char* ops[] = {"//", "**", "==", "!=", "<=", ">=", "+", "-", "*", "/", "%", "~", "<", ">", "=",
                                  "(", ")", "[", "]", "{", "}", ",", ".", ":", "|"};
      bool found = false;
      for (const char* op : ops) {
        const size_t n = std::strlen(op);
        if (src_.compare(p, n, op) == 0) {
          toks_.push_back({Tok::kOp, op, p});
          p += n;
          found = true;
          break;
        }
      }
      if (!found) fail(p, std::string("unexpected character '") + c + "'");
    }
  }

  // A Python string literal: the escapes Python's "unicode-escape" decodes
  // (jinja2 decodes literals with it); unknown escapes stay as written.
  size_t lex_string(size_t p) {
    const char q = src_[p];
    std::string out;
    size_t k = p + 1;
    for (;;) {
      if (k >= src_.size()) fail(p, "unterminated string literal");
      const char c = src_[k];
      if (c == q) break;
      if (c != '\\') {
        out += c;
        ++k;
        continue;
      }
      if (k + 1 >= src_.size()) fail(p, "unterminated string literal");
      const char e = src_[k + 1];
      k += 2;
      switch (e) {
        case 'n': out += '\n'; break;
        case 't': out += '\t'; break;
        case 'r': out += '\r'; break;
        case '\\': out += '\\'; break;
        case '\'': out += '\''; break;
        case '"': out += '"'; break;
        case 'a': out += '\a'; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'v': out += '\v'; break;
        case '\n': break;
        case 'x':
        case 'u':
        case 'U': {
          const size_t n = e == 'x' ? 2 : e == 'u' ? 4 : 8;
          if (k + n > src_.size()) fail(k - 2, "truncated \\" + std::string(1, e) + " escape");
          const std::string hex = src_.substr(k, n);
          char* endp = nullptr;
          const unsigned long cp = std::strtoul(hex.c_str(), &endp, 16);
          if (endp != hex.c_str() + n) fail(k - 2, "bad \\" + std::string(1, e) + " escape");
          out += u32_to_utf8(std::u32string(1, static_cast<char32_t>(cp)));
          k += n;
          break;
        }
        default:
          if (e >= '0' && e <= '7') {
            unsigned cp = static_cast<unsigned>(e - '0');
            for (int j = 0; j < 2 && k < src_.size() && src_[k] >= '0' && src_[k] <= '7'; ++j, ++k)
              cp = cp * 8 + static_cast<unsigned>(src_[k] - '0');
            out += u32_to_utf8(std::u32string(1, static_cast<char32_t>(cp)));
          } else {
            out += '\\';
            out += e;
          }
      }
    }
    toks_.push_back({Tok::kString, out, p});
    return k + 1;
  }

  const std::string& src_;
  const std::string& name_;
  std::vector<size_t> line_starts_{0};
  std::vector<Token> toks_;
};

class Parser {
 public:
  Parser(std::vector<Token> toks, const Lexer& lex, bool* has_gen) : t_(std::move(toks)), lex_(lex), has_gen_(has_gen) {}

  NodePtr parse_all() {
    NodePtr body = parse_body({});
    if (peek().type != Tok::kEof) fail(peek(), "unexpected tag");
    return body;
  }

 private:
  const Token& peek(int k = 0) const { return t_[std::min(i_ + k, t_.size() - 1)]; }
  const Token& next() { return t_[std::min(i_++, t_.size() - 1)]; }
  [[noreturn]] void fail(const Token& t, const std::string& msg) const { lex_.fail(t.pos, msg); }
  bool is_op(const char* op, int k = 0) const { return peek(k).type == Tok::kOp && peek(k).text == op; }
  bool is_name(const char* n, int k = 0) const { return peek(k).type == Tok::kName && peek(k).text == n; }
  void expect_op(const char* op) {
    if (!is_op(op)) fail(peek(), std::string("expected '") + op + "', found " + describe(peek()));
    next();
  }
  std::string expect_name() {
    if (peek().type != Tok::kName) fail(peek(), "expected a name, found " + describe(peek()));
    return next().text;
  }
  void expect_block_end() {
    if (peek().type != Tok::kBlockEnd) fail(peek(), "expected the end of the tag ('%}'), found " + describe(peek()));
    next();
  }
  static std::string describe(const Token& t) {
    switch (t.type) {
      case Tok::kEof: return "the end of the template";
      case Tok::kBlockEnd: return "'%}'";
      case Tok::kVarEnd: return "'}}'";
      case Tok::kText: return "text";
      default: return "'" + t.text + "'";
    }
  }
  NodePtr make(Node::Type type, const Token& at) {
    auto n = std::make_shared<Node>();
    n->type = type;
    int col = 0;
    n->line = static_cast<int>(lex_.offset_line_col(at.pos, &col));
    n->col = col;
    return n;
  }

  // Statements until a {% name %} with name in `ends` (not consumed).
  NodePtr parse_body(const std::vector<std::string>& ends) {
    NodePtr body = make(Node::Type::kBody, peek());
    for (;;) {
      const Token& t = peek();
      if (t.type == Tok::kEof) {
        if (!ends.empty()) fail(t, "missing '{% " + ends.back() + " %}'");
        return body;
      }
      if (t.type == Tok::kText) {
        NodePtr n = make(Node::Type::kText, t);
        n->str = t.text;
        next();
        body->children.push_back(n);
      } else if (t.type == Tok::kVarBegin) {
        next();
        NodePtr n = make(Node::Type::kOutput, t);
        n->a = parse_expr();
        if (peek().type != Tok::kVarEnd) fail(peek(), "expected '}}', found " + describe(peek()));
        next();
        body->children.push_back(n);
      } else if (t.type == Tok::kBlockBegin) {
        const Token& kw = peek(1);
        if (kw.type != Tok::kName) fail(kw, "expected a statement name after '{%'");
        for (const auto& e : ends)
          if (kw.text == e) return body;
        next();
        body->children.push_back(parse_statement());
      } else {
        fail(t, "unexpected " + describe(t));
      }
    }
  }

  NodePtr parse_statement() {
    const Token kw = next();
    const std::string& w = kw.text;
    if (w == "if") return parse_if(kw);
    if (w == "for") return parse_for(kw);
    if (w == "set") return parse_set(kw);
    if (w == "macro") return parse_macro(kw);
    if (w == "generation") {
      expect_block_end();
      NodePtr n = make(Node::Type::kGeneration, kw);
      n->children.push_back(parse_body({"endgeneration"}));
      end_tag("endgeneration");
      *has_gen_ = true;
      return n;
    }
    if (w.rfind("end", 0) == 0 || w == "else" || w == "elif")
      fail(kw, "unexpected '{% " + w + " %}' (no open block it closes)");
    fail(kw, "the tag '" + w + "' is outside the supported Jinja subset (for, if, set, macro, generation)");
  }

  void end_tag(const char* name) {
    next();  // BlockBegin
    next();  // the name
    expect_block_end();
    (void)name;
  }

  NodePtr parse_if(const Token& kw) {
    NodePtr n = make(Node::Type::kIf, kw);
    n->a = parse_expr();
    expect_block_end();
    n->children.push_back(parse_body({"elif", "else", "endif"}));
    n->children.push_back(nullptr);
    const Token& which = peek(1);
    if (which.text == "elif") {
      next();
      const Token k2 = next();
      n->children[1] = parse_if(k2);  // consumes through endif
      return n;
    }
    if (which.text == "else") {
      next();
      next();
      expect_block_end();
      n->children[1] = parse_body({"endif"});
    }
    end_tag("endif");
    return n;
  }

  std::vector<std::string> parse_targets() {
    std::vector<std::string> names;
    const bool paren = is_op("(");
    if (paren) next();
    names.push_back(expect_name());
    while (is_op(",")) {
      next();
      names.push_back(expect_name());
    }
    if (paren) expect_op(")");
    return names;
  }

  NodePtr parse_for(const Token& kw) {
    NodePtr n = make(Node::Type::kFor, kw);
    n->targets = parse_targets();
    if (!is_name("in")) fail(peek(), "expected 'in' in the for loop, found " + describe(peek()));
    next();
    n->a = parse_ternary(false);
    if (is_name("if")) {
      next();
      n->b = parse_ternary(true);
    }
    if (is_name("recursive")) fail(peek(), "recursive loops are outside the supported Jinja subset");
    expect_block_end();
    n->children.push_back(parse_body({"else", "endfor"}));
    n->children.push_back(nullptr);
    if (peek(1).text == "else") {
      next();
      next();
      expect_block_end();
      n->children[1] = parse_body({"endfor"});
    }
    end_tag("endfor");
    return n;
  }

  NodePtr parse_set(const Token& kw) {
    const Token& first = peek();
    std::vector<std::string> targets;
    std::string attr;
    if (peek().type == Tok::kName && is_op(".", 1)) {
      targets.push_back(next().text);
      next();
      attr = expect_name();
    } else {
      targets = parse_targets();
    }
    if (peek().type == Tok::kBlockEnd) {
      if (!attr.empty() || targets.size() != 1) fail(first, "a block set assigns one name");
      next();
      NodePtr n = make(Node::Type::kSetBlock, kw);
      n->targets = targets;
      n->children.push_back(parse_body({"endset"}));
      end_tag("endset");
      return n;
    }
    expect_op("=");
    NodePtr n = make(Node::Type::kSet, kw);
    n->targets = targets;
    n->str = attr;
    n->a = parse_tuple_or_expr();
    expect_block_end();
    return n;
  }

  NodePtr parse_macro(const Token& kw) {
    NodePtr n = make(Node::Type::kMacro, kw);
    n->str = expect_name();
    expect_op("(");
    while (!is_op(")")) {
      n->targets.push_back(expect_name());
      if (is_op("=")) {
        next();
        n->args.push_back(parse_expr());
      } else {
        if (!n->args.empty()) fail(peek(), "a macro parameter without a default follows one with a default");
      }
      if (!is_op(",")) break;
      next();
    }
    expect_op(")");
    expect_block_end();
    n->children.push_back(parse_body({"endmacro"}));
    end_tag("endmacro");
    return n;
  }

  // `a, b` on the right of set: a list.
  NodePtr parse_tuple_or_expr() {
    const Token& at = peek();
    NodePtr e = parse_expr();
    if (!is_op(",")) return e;
    NodePtr l = make(Node::Type::kList, at);
    l->args.push_back(e);
    while (is_op(",")) {
      next();
      l->args.push_back(parse_expr());
    }
    return l;
  }

  NodePtr parse_expr() { return parse_ternary(true); }

  NodePtr parse_ternary(bool allow_cond) {
    NodePtr e = parse_or();
    while (allow_cond && is_name("if")) {
      const Token& at = next();
      NodePtr n = make(Node::Type::kCond, at);
      n->a = e;
      n->b = parse_or();
      if (is_name("else")) {
        next();
        n->c = parse_ternary(true);
      }
      e = n;
    }
    return e;
  }

  NodePtr binary(const Token& at, const std::string& op, NodePtr l, NodePtr r) {
    NodePtr n = make(Node::Type::kBinary, at);
    n->str = op;
    n->a = std::move(l);
    n->b = std::move(r);
    return n;
  }

  NodePtr parse_or() {
    NodePtr e = parse_and();
    while (is_name("or")) {
      const Token at = next();
      e = binary(at, "or", e, parse_and());
    }
    return e;
  }
  NodePtr parse_and() {
    NodePtr e = parse_not();
    while (is_name("and")) {
      const Token at = next();
      e = binary(at, "and", e, parse_not());
    }
    return e;
  }
  NodePtr parse_not() {
    if (is_name("not")) {
      const Token at = next();
      NodePtr n = make(Node::Type::kUnary, at);
      n->str = "not";
      n->a = parse_not();
      return n;
    }
    return parse_compare();
  }
  NodePtr parse_compare() {
    NodePtr e = parse_math1();
    for (;;) {
      const Token at = peek();
      std::string op;
      if (at.type == Tok::kOp && (at.text == "==" || at.text == "!=" || at.text == "<" || at.text == "<=" ||
                                  at.text == ">" || at.text == ">=")) {
        op = at.text;
        next();
      } else if (is_name("in")) {
        op = "in";
        next();
      } else if (is_name("not") && is_name("in", 1)) {
        op = "not in";
        next();
        next();
      } else {
        return e;
      }
      e = binary(at, op, e, parse_math1());
    }
  }
  NodePtr parse_math1() {
    NodePtr e = parse_concat();
    while (is_op("+") || is_op("-")) {
      const Token at = next();
      e = binary(at, at.text, e, parse_concat());
    }
    return e;
  }
  NodePtr parse_concat() {
    NodePtr e = parse_math2();
    while (is_op("~")) {
      const Token at = next();
      e = binary(at, "~", e, parse_math2());
    }
    return e;
  }
  NodePtr parse_math2() {
    NodePtr e = parse_pow();
    while (is_op("*") || is_op("/") || is_op("//") || is_op("%")) {
      const Token at = next();
      e = binary(at, at.text, e, parse_pow());
    }
    return e;
  }
  NodePtr parse_pow() {
    NodePtr e = parse_unary(true);
    while (is_op("**")) {
      const Token at = next();
      e = binary(at, "**", e, parse_unary(true));
    }
    return e;
  }
  NodePtr parse_unary(bool with_filter) {
    NodePtr e;
    if (is_op("-") || is_op("+")) {
      const Token at = next();
      e = make(Node::Type::kUnary, at);
      e->str = at.text;
      e->a = parse_unary(false);
    } else {
      e = parse_primary();
    }
    e = parse_postfix(e);
    if (with_filter) e = parse_filters(e);
    return e;
  }

  NodePtr parse_primary() {
    const Token t = next();
    switch (t.type) {
      case Tok::kName: {
        if (t.text == "true" || t.text == "True" || t.text == "false" || t.text == "False") {
          NodePtr n = make(Node::Type::kLiteral, t);
          n->value = Value::boolean(t.text[0] == 't' || t.text[0] == 'T');
          return n;
        }
        if (t.text == "none" || t.text == "None") {
          NodePtr n = make(Node::Type::kLiteral, t);
          n->value = Value::none();
          return n;
        }
        NodePtr n = make(Node::Type::kName, t);
        n->str = t.text;
        return n;
      }
      case Tok::kString: {
        std::string s = t.text;
        while (peek().type == Tok::kString) s += next().text;  // adjacent literals concatenate
        NodePtr n = make(Node::Type::kLiteral, t);
        n->value = Value::string(s);
        return n;
      }
      case Tok::kInt: {
        NodePtr n = make(Node::Type::kLiteral, t);
        n->value = Value::integer(std::strtoll(t.text.c_str(), nullptr, 10));
        return n;
      }
      case Tok::kFloat: {
        NodePtr n = make(Node::Type::kLiteral, t);
        n->value = Value::number(std::strtod(t.text.c_str(), nullptr));
        return n;
      }
      case Tok::kOp:
        if (t.text == "(") {
          if (is_op(")")) {
            next();
            NodePtr l = make(Node::Type::kList, t);
            l->str = "tuple";
            return l;
          }
          NodePtr e = parse_expr();
          if (is_op(",")) {
            NodePtr l = make(Node::Type::kList, t);
            l->str = "tuple";
            l->args.push_back(e);
            while (is_op(",")) {
              next();
              if (is_op(")")) break;
              l->args.push_back(parse_expr());
            }
            e = l;
          }
          expect_op(")");
          return e;
        }
        if (t.text == "[") {
          NodePtr l = make(Node::Type::kList, t);
          while (!is_op("]")) {
            l->args.push_back(parse_expr());
            if (!is_op(",")) break;
            next();
          }
          expect_op("]");
          return l;
        }
        if (t.text == "{") {
          NodePtr d = make(Node::Type::kDict, t);
          while (!is_op("}")) {
            d->args.push_back(parse_expr());
            expect_op(":");
            d->args.push_back(parse_expr());
            if (!is_op(",")) break;
            next();
          }
          expect_op("}");
          return d;
        }
        break;
      default: break;
    }
    fail(t, "expected an expression, found " + describe(t));
  }

  void parse_call_args(NodePtr& n) {
    expect_op("(");
    while (!is_op(")")) {
      if (peek().type == Tok::kName && is_op("=", 1)) {
        const std::string k = next().text;
        next();
        n->kwargs.emplace_back(k, parse_expr());
      } else {
        if (!n->kwargs.empty()) fail(peek(), "a positional argument follows a keyword argument");
        n->args.push_back(parse_expr());
      }
      if (!is_op(",")) break;
      next();
    }
    expect_op(")");
  }

  NodePtr parse_postfix(NodePtr e) {
    for (;;) {
      if (is_op(".")) {
        const Token at = next();
        NodePtr n = make(Node::Type::kAttr, at);
        n->a = e;
        if (peek().type == Tok::kInt) {  // foo.0
          n->type = Node::Type::kItem;
          NodePtr idx = make(Node::Type::kLiteral, peek());
          idx->value = Value::integer(std::strtoll(next().text.c_str(), nullptr, 10));
          n->b = idx;
        } else {
          n->str = expect_name();
        }
        e = n;
      } else if (is_op("[")) {
        const Token at = next();
        NodePtr parts[3];
        int nparts = 0;
        bool slice = false;
        for (;;) {
          if (!is_op(":") && !is_op("]")) parts[nparts] = parse_expr();
          if (is_op(":")) {
            slice = true;
            next();
            if (++nparts > 2) fail(peek(), "a slice has at most three parts");
            continue;
          }
          break;
        }
        expect_op("]");
        NodePtr n = make(slice ? Node::Type::kSlice : Node::Type::kItem, at);
        n->a = e;
        if (slice) n->args = {parts[0], parts[1], parts[2]};
        else n->b = parts[0];
        if (!slice && !n->b) fail(at, "empty subscript");
        e = n;
      } else if (is_op("(")) {
        // Positioned at the callee: "f.jinja:1:4: ... raise_exception(...)".
        NodePtr n = make(Node::Type::kCall, peek());
        n->line = e->line;
        n->col = e->col;
        n->a = e;
        parse_call_args(n);
        e = n;
      } else {
        return e;
      }
    }
  }

  NodePtr parse_filters(NodePtr e) {
    for (;;) {
      if (is_op("|")) {
        const Token at = next();
        NodePtr n = make(Node::Type::kFilter, at);
        const Token& fname = peek();
        n->str = expect_name();
        if (!known_filter(n->str)) fail(fname, "the filter '" + n->str + "' is outside the supported Jinja subset");
        n->a = e;
        if (is_op("(")) parse_call_args(n);
        e = parse_postfix(n);
      } else if (is_name("is")) {
        const Token at = next();
        NodePtr n = make(Node::Type::kTest, at);
        if (is_name("not")) {
          next();
          n->negate = true;
        }
        const Token& tname = peek();
        n->str = expect_name();
        if (!known_test(n->str)) fail(tname, "the test '" + n->str + "' is outside the supported Jinja subset");
        n->a = e;
        if (is_op("(")) {
          parse_call_args(n);
        } else if (peek().type == Tok::kString || peek().type == Tok::kInt || peek().type == Tok::kFloat ||
                   (peek().type == Tok::kName && !is_name("else") && !is_name("or") && !is_name("and") &&
                    !is_name("if") && !is_name("is") && !is_name("in") && !is_name("not"))) {
          n->args.push_back(parse_primary());  // `x is divisibleby 3`, `x is sameas none`
        }
        e = n;
      } else {
        return e;
      }
    }
  }

  std::vector<Token> t_;
  size_t i_ = 0;
  const Lexer& lex_;
  bool* has_gen_;
};

}  // namespace

NodePtr parse_template(const std::string& source, const std::string& name, bool* has_generation) {
  // jinja2 turns every \r\n and \r into \n (newline_sequence), then drops
  // one trailing newline (keep_trailing_newline=False).
  std::string src;
  src.reserve(source.size());
  for (size_t k = 0; k < source.size(); ++k) {
    if (source[k] == '\r') {
      src += '\n';
      if (k + 1 < source.size() && source[k + 1] == '\n') ++k;
    } else {
      src += source[k];
    }
  }
  if (!src.empty() && src.back() == '\n') src.pop_back();
  Lexer lex(src, name);
  std::vector<Token> toks = lex.run();
  *has_generation = false;
  Parser p(std::move(toks), lex, has_generation);
  return p.parse_all();
}

}  // namespace trainrun::jinja
