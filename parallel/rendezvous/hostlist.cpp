// Slurm host list expansion; see hostlist.h for the grammar.
//
// Two passes: parse the whole list into host expressions (literal text and
// bracket groups of ranges), checking every character, then expand. The
// count is known before anything is expanded, so a huge list is refused
// cheaply and first_host() never builds more than one name.
#include "parallel/rendezvous/hostlist.h"

#include <cctype>
#include <cstdint>
#include <limits>

#include "core/common/error.h"

namespace trainrun {

namespace {

struct Range {
  uint64_t lo = 0, hi = 0;
  size_t width = 0;  // digits the lower bound was written with (zero padding)
};

// Literal text, or (when `ranges` is non-empty) one bracket group.
struct Segment {
  std::string text;
  std::vector<Range> ranges;
  // Saturates just above the cap (a range may span all of uint64_t).
  uint64_t count() const {
    const uint64_t cap = kMaxHostlistHosts + 1;
    uint64_t n = 0;
    for (const Range& r : ranges) {
      const uint64_t span = r.hi - r.lo;  // count - 1, cannot overflow
      n = span >= cap || n + span + 1 >= cap ? cap : n + span + 1;
    }
    return n;
  }
};

using Expr = std::vector<Segment>;

class Parser {
 public:
  explicit Parser(const std::string& list) : s_(list) {}

  std::vector<Expr> parse() {
    if (s_.empty()) fail("the list is empty (expected host names such as node[01-04],gpu7)");
    std::vector<Expr> exprs;
    while (true) {
      exprs.push_back(parse_expr());
      if (pos_ == s_.size()) break;
      // parse_expr stops only at a top-level comma or the end.
      ++pos_;
      if (pos_ == s_.size()) fail("',' at column ", pos_, " is not followed by a host name");
    }
    return exprs;
  }

 private:
  template <typename... Args>
  [[noreturn]] void fail(const Args&... what) const {
    TR_FAIL("hostlist '", s_, "': ", what...);
  }

  // One host expression, up to a top-level comma or the end.
  Expr parse_expr() {
    Expr e;
    const size_t start = pos_;
    std::string text;
    while (pos_ < s_.size() && s_[pos_] != ',') {
      const char c = s_[pos_];
      if (c == '[') {
        if (!text.empty()) e.push_back(Segment{std::move(text), {}}), text.clear();
        e.push_back(parse_group());
        continue;
      }
      if (c == ']') fail("']' at column ", pos_ + 1, " has no matching '['");
      check_host_char(c);
      text += c;
      ++pos_;
    }
    if (!text.empty()) e.push_back(Segment{std::move(text), {}});
    if (pos_ == start) {
      if (pos_ == 0) fail("the list starts with ',' (expected a host name at column 1)");
      fail("empty host name at column ", pos_ + 1, " (two commas in a row?)");
    }
    return e;
  }

  void check_host_char(char c) const {
    const unsigned char u = static_cast<unsigned char>(c);
    if (std::isspace(u)) fail("whitespace at column ", pos_ + 1, " (hosts are separated by commas, without spaces)");
    if (std::iscntrl(u)) fail("control character at column ", pos_ + 1);
  }

  // "[" ranges "]", with pos_ on the '['.
  Segment parse_group() {
    const size_t open = pos_;
    ++pos_;
    Segment g;
    while (true) {
      if (pos_ == s_.size()) fail("'[' at column ", open + 1, " has no matching ']'");
      const char c = s_[pos_];
      if (c == '[')
        fail("'[' at column ", pos_ + 1, " inside the brackets opened at column ", open + 1, " (brackets do not nest)");
      if (c == ']' || c == ',') {
        if (c == ']' && g.ranges.empty() && pos_ == open + 1)
          fail("empty brackets at column ", open + 1, " (expected numbers such as [1-4,7])");
        fail("missing number at column ", pos_ + 1, " (in the brackets opened at column ", open + 1, ")");
      }
      g.ranges.push_back(parse_range(open));
      if (pos_ == s_.size()) fail("'[' at column ", open + 1, " has no matching ']'");
      if (s_[pos_] == ']') {
        ++pos_;
        return g;
      }
      if (s_[pos_] == ',') {
        ++pos_;
        continue;
      }
      fail("unexpected '", s_[pos_], "' at column ", pos_ + 1,
           " (inside brackets only numbers, '-' and ',' are allowed)");
    }
  }

  // A number, or lo-hi, with pos_ on its first digit.
  Range parse_range(size_t open) {
    Range r;
    const size_t lo_at = pos_;
    r.lo = parse_number(open, &r.width);
    r.hi = r.lo;
    if (pos_ < s_.size() && s_[pos_] == '-') {
      ++pos_;
      if (pos_ == s_.size() || !std::isdigit(static_cast<unsigned char>(s_[pos_]))) {
        if (pos_ == s_.size()) fail("'[' at column ", open + 1, " has no matching ']'");
        fail("range at column ", lo_at + 1, " has no upper bound");
      }
      size_t hi_width = 0;
      r.hi = parse_number(open, &hi_width);
      if (r.hi < r.lo)
        fail("reversed range ", s_.substr(lo_at, pos_ - lo_at), " at column ", lo_at + 1,
             " (the upper bound must not be below the lower bound)");
    }
    return r;
  }

  uint64_t parse_number(size_t open, size_t* width) {
    const size_t start = pos_;
    uint64_t v = 0;
    while (pos_ < s_.size() && std::isdigit(static_cast<unsigned char>(s_[pos_]))) {
      const uint64_t d = uint64_t(s_[pos_] - '0');
      if (v > (std::numeric_limits<uint64_t>::max() - d) / 10) fail("number at column ", start + 1, " is too large");
      v = v * 10 + d;
      ++pos_;
    }
    if (pos_ == start) {
      if (pos_ == s_.size()) fail("'[' at column ", open + 1, " has no matching ']'");
      fail("unexpected '", s_[pos_], "' at column ", pos_ + 1,
           " (inside brackets only numbers, '-' and ',' are allowed)");
    }
    *width = pos_ - start;
    return v;
  }

  const std::string& s_;
  size_t pos_ = 0;
};

std::string pad(uint64_t v, size_t width) {
  std::string d = std::to_string(v);
  if (d.size() < width) d.insert(0, width - d.size(), '0');
  return d;
}

// Names of one expression, leftmost group slowest, appended to `out` (at most `limit` of them).
void expand_expr(const Expr& e, size_t seg, std::string& prefix, std::vector<std::string>& out, size_t limit) {
  if (out.size() >= limit) return;
  if (seg == e.size()) {
    out.push_back(prefix);
    return;
  }
  const Segment& s = e[seg];
  const size_t keep = prefix.size();
  if (s.ranges.empty()) {
    prefix += s.text;
    expand_expr(e, seg + 1, prefix, out, limit);
  } else {
    for (const Range& r : s.ranges) {
      for (uint64_t v = r.lo;; ++v) {
        prefix.resize(keep);
        prefix += pad(v, r.width);
        expand_expr(e, seg + 1, prefix, out, limit);
        if (v == r.hi || out.size() >= limit) break;
      }
      if (out.size() >= limit) break;
    }
  }
  prefix.resize(keep);
}

std::vector<Expr> parse_checked(const std::string& list, uint64_t* total) {
  std::vector<Expr> exprs = Parser(list).parse();
  uint64_t sum = 0;
  for (const Expr& e : exprs) {
    uint64_t n = 1;
    for (const Segment& s : e) {
      if (s.ranges.empty()) continue;
      const uint64_t c = s.count();
      if (n > kMaxHostlistHosts / c) {
        n = kMaxHostlistHosts + 1;
        break;
      }
      n *= c;
    }
    sum += n;
    if (sum > kMaxHostlistHosts)
      TR_FAIL("hostlist '", list, "': expands to more than ", kMaxHostlistHosts, " hosts; is a range mistyped?");
  }
  *total = sum;
  return exprs;
}

}  // namespace

std::vector<std::string> expand_hostlist(const std::string& list) {
  uint64_t total = 0;
  const std::vector<Expr> exprs = parse_checked(list, &total);
  std::vector<std::string> out;
  out.reserve(size_t(total));
  std::string prefix;
  for (const Expr& e : exprs) expand_expr(e, 0, prefix, out, kMaxHostlistHosts);
  return out;
}

std::string first_host(const std::string& list) {
  uint64_t total = 0;
  const std::vector<Expr> exprs = parse_checked(list, &total);
  std::vector<std::string> out;
  std::string prefix;
  expand_expr(exprs.front(), 0, prefix, out, 1);
  return out.front();
}

}  // namespace trainrun
