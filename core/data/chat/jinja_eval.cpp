// The evaluator of the Jinja2 subset (jinja.h): statements append to the
// output, expressions give Values. Scopes follow jinja2: a for loop's body
// and a macro's body have their own scope (a `set` inside does not leak
// out: that is what namespace() is for); if/else do not.
#include <chrono>
#include <cmath>
#include <ctime>
#include <stdexcept>
#include <unordered_map>

#include "core/data/chat/jinja.h"
#include "core/data/chat/jinja_ast.h"
#include "core/data/chat/jinja_builtins.h"

namespace trainrun::jinja {
namespace {

using Scope = std::unordered_map<std::string, Value>;
using ScopeChain = std::vector<std::shared_ptr<Scope>>;

struct Raised {
  std::string message;
};

class Renderer {
 public:
  Renderer(const std::string& name, ScopeChain scopes) : name_(name), scopes_(std::move(scopes)) {}

  Template::Output out;

  void exec(const NodePtr& n) {
    switch (n->type) {
      case Node::Type::kBody:
        for (const auto& c : n->children) exec(c);
        return;
      case Node::Type::kText: out.text += n->str; return;
      case Node::Type::kOutput: out.text += to_str(eval(n->a)); return;
      case Node::Type::kIf:
        if (truthy(eval(n->a))) exec(n->children[0]);
        else if (n->children[1]) exec(n->children[1]);
        return;
      case Node::Type::kFor: exec_for(n); return;
      case Node::Type::kSet: {
        Value v = eval(n->a);
        if (!n->str.empty()) {
          Value ns = lookup(n->targets[0]);
          if (!ns.is_dict() || !ns.is_namespace)
            fail(n, "cannot assign attribute '" + n->str + "' on '" + n->targets[0] + "' (" + kind_name(ns) +
                        "): only a namespace() has assignable attributes");
          ns.dict->set(n->str, std::move(v));
          return;
        }
        assign(n, n->targets, v);
        return;
      }
      case Node::Type::kSetBlock: {
        const size_t mark = out.text.size();
        exec(n->children[0]);
        std::string captured = out.text.substr(mark);
        out.text.resize(mark);
        scopes_.back()->insert_or_assign(n->targets[0], Value::string(std::move(captured)));
        return;
      }
      case Node::Type::kMacro: define_macro(n); return;
      case Node::Type::kGeneration: {
        const size_t begin = out.text.size();
        exec(n->children[0]);
        out.generation.emplace_back(begin, out.text.size());
        return;
      }
      default: out.text += to_str(eval(n)); return;
    }
  }

 private:
  [[noreturn]] void fail(const NodePtr& n, const std::string& msg) const {
    throw TemplateError(name_ + ":" + std::to_string(n->line) + ":" + std::to_string(n->col) + ": " + msg, false);
  }

  Value lookup(const std::string& name) const {
    for (auto it = scopes_.rbegin(); it != scopes_.rend(); ++it) {
      auto f = (*it)->find(name);
      if (f != (*it)->end()) return f->second;
    }
    return Value::undefined(name);
  }

  void assign(const NodePtr& n, const std::vector<std::string>& targets, const Value& v) {
    if (targets.size() == 1) {
      scopes_.back()->insert_or_assign(targets[0], v);
      return;
    }
    ValueList items;
    try {
      items = iterate(v);
    } catch (const std::exception& e) {
      fail(n, e.what());
    }
    if (items.size() != targets.size())
      fail(n, "cannot unpack " + std::to_string(items.size()) + " values into " + std::to_string(targets.size()) +
                  " names");
    for (size_t k = 0; k < targets.size(); ++k) scopes_.back()->insert_or_assign(targets[k], items[k]);
  }

  void exec_for(const NodePtr& n) {
    ValueList items;
    const Value seq = eval(n->a);
    try {
      items = iterate(seq);
    } catch (const std::exception& e) {
      fail(n->a, e.what());
    }
    if (n->b) {  // for x in y if cond: filtered before loop.* is computed
      ValueList kept;
      for (const Value& item : items) {
        scopes_.push_back(std::make_shared<Scope>());
        assign(n, n->targets, item);
        const bool keep = truthy(eval(n->b));
        scopes_.pop_back();
        if (keep) kept.push_back(item);
      }
      items = std::move(kept);
    }
    if (items.empty()) {
      if (n->children[1]) exec(n->children[1]);
      return;
    }
    const int64_t len = static_cast<int64_t>(items.size());
    for (int64_t k = 0; k < len; ++k) {
      auto scope = std::make_shared<Scope>();
      Value loop = Value::make_dict();
      auto& d = *loop.dict;
      d.set("index", Value::integer(k + 1));
      d.set("index0", Value::integer(k));
      d.set("revindex", Value::integer(len - k));
      d.set("revindex0", Value::integer(len - k - 1));
      d.set("first", Value::boolean(k == 0));
      d.set("last", Value::boolean(k == len - 1));
      d.set("length", Value::integer(len));
      d.set("depth", Value::integer(1));
      d.set("depth0", Value::integer(0));
      d.set("previtem", k > 0 ? items[static_cast<size_t>(k - 1)] : Value::undefined("loop.previtem"));
      d.set("nextitem", k + 1 < len ? items[static_cast<size_t>(k + 1)] : Value::undefined("loop.nextitem"));
      d.set("cycle", Value::callable([k](ValueList& a, KwArgs&) {
              if (a.empty()) throw std::runtime_error("loop.cycle needs at least one value");
              return a[static_cast<size_t>(k) % a.size()];
            }));
      (*scope)["loop"] = loop;
      scopes_.push_back(scope);
      assign(n, n->targets, items[static_cast<size_t>(k)]);
      exec(n->children[0]);
      scopes_.pop_back();
    }
  }

  void define_macro(const NodePtr& n) {
    // The macro sees the scopes of its definition (closure), as jinja2's does.
    ScopeChain closure = scopes_;
    const std::string name = name_;
    NodePtr node = n;
    Value macro = Value::callable([closure, name, node](ValueList& args, KwArgs& kwargs) {
      if (args.size() > node->targets.size())
        throw std::runtime_error("macro '" + node->str + "' takes " + std::to_string(node->targets.size()) +
                                 " arguments, got " + std::to_string(args.size()));
      auto scope = std::make_shared<Scope>();
      const size_t first_default = node->targets.size() - node->args.size();
      ScopeChain chain = closure;
      chain.push_back(scope);
      Renderer r(name, chain);
      for (size_t k = 0; k < node->targets.size(); ++k) {
        Value v = Value::undefined(node->targets[k]);
        if (k < args.size()) v = args[k];
        else if (k >= first_default) v = r.eval(node->args[k - first_default]);
        (*scope)[node->targets[k]] = v;
      }
      for (auto& kv : kwargs) {
        bool found = false;
        for (const auto& t : node->targets) found = found || t == kv.first;
        if (!found) throw std::runtime_error("macro '" + node->str + "' has no parameter '" + kv.first + "'");
        (*scope)[kv.first] = kv.second;
      }
      r.exec(node->children[0]);
      return Value::string(std::move(r.out.text));
    });
    scopes_.back()->insert_or_assign(n->str, macro);
  }

 public:
  Value eval(const NodePtr& n) {
    try {
      return eval_inner(n);
    } catch (const TemplateError&) {
      throw;
    } catch (const std::exception& e) {
      fail(n, e.what());
    }
  }

 private:
  Value eval_inner(const NodePtr& n) {
    using K = Value::Kind;
    switch (n->type) {
      case Node::Type::kLiteral: return n->value;
      case Node::Type::kName: return lookup(n->str);
      case Node::Type::kList: {
        ValueList l;
        for (const auto& a : n->args) l.push_back(eval(a));
        return n->str == "tuple" ? Value::make_tuple(std::move(l)) : Value::make_list(std::move(l));
      }
      case Node::Type::kDict: {
        Value d = Value::make_dict();
        for (size_t k = 0; k + 1 < n->args.size(); k += 2) {
          const Value key = eval(n->args[k]);
          if (!key.is_string()) fail(n->args[k], "dict keys other than strings are outside the supported subset");
          d.dict->set(key.s, eval(n->args[k + 1]));
        }
        return d;
      }
      case Node::Type::kAttr: return get_attr(eval(n->a), n->str);
      case Node::Type::kItem: return get_item(eval(n->a), eval(n->b));
      case Node::Type::kSlice: {
        auto part = [&](const NodePtr& p) { return p ? eval(p) : Value::none(); };
        return slice(eval(n->a), part(n->args[0]), part(n->args[1]), part(n->args[2]));
      }
      case Node::Type::kCall: {
        const Value f = eval(n->a);
        ValueList args;
        for (const auto& a : n->args) args.push_back(eval(a));
        KwArgs kw;
        for (const auto& [k, v] : n->kwargs) kw.emplace_back(k, eval(v));
        if (f.kind != K::kCallable) {
          const std::string what = n->a->type == Node::Type::kName ? "'" + n->a->str + "'"
                                   : n->a->type == Node::Type::kAttr ? "'." + n->a->str + "'"
                                                                     : "the value";
          fail(n, what + " is not callable (" + (f.is_undefined() ? std::string("undefined") : kind_name(f)) + ")");
        }
        try {
          return (*f.fn)(args, kw);
        } catch (const Raised& e) {
          throw TemplateError(name_ + ":" + std::to_string(n->line) + ":" + std::to_string(n->col) +
                                  ": the template raised an exception: " + e.message,
                              true);
        }
      }
      case Node::Type::kFilter: {
        const Value v = eval(n->a);
        ValueList args;
        for (const auto& a : n->args) args.push_back(eval(a));
        KwArgs kw;
        for (const auto& [k, x] : n->kwargs) kw.emplace_back(k, eval(x));
        return apply_filter(n->str, v, args, kw);
      }
      case Node::Type::kTest: {
        const Value v = eval(n->a);
        ValueList args;
        for (const auto& a : n->args) args.push_back(eval(a));
        return Value::boolean(apply_test(n->str, v, args) != n->negate);
      }
      case Node::Type::kUnary: {
        const Value v = eval(n->a);
        if (n->str == "not") return Value::boolean(!truthy(v));
        if (v.kind == K::kFloat) return Value::number(n->str == "-" ? -v.f : v.f);
        if (v.kind == K::kInt || v.kind == K::kBool) {
          const int64_t x = v.kind == K::kBool ? v.b : v.i;
          return Value::integer(n->str == "-" ? -x : x);
        }
        fail(n, "bad operand type for unary " + n->str + ": '" + kind_name(v) + "'");
      }
      case Node::Type::kCond:
        if (truthy(eval(n->b))) return eval(n->a);
        return n->c ? eval(n->c) : Value::undefined("the else branch of a conditional");
      case Node::Type::kBinary: return eval_binary(n);
      default: fail(n, "a statement where an expression was expected");
    }
  }

  Value eval_binary(const NodePtr& n) {
    using K = Value::Kind;
    const std::string& op = n->str;
    if (op == "and") {
      Value l = eval(n->a);
      return truthy(l) ? eval(n->b) : l;
    }
    if (op == "or") {
      Value l = eval(n->a);
      return truthy(l) ? l : eval(n->b);
    }
    const Value l = eval(n->a), r = eval(n->b);
    if (op == "~") return Value::string(to_str(l) + to_str(r));
    if (op == "==") return Value::boolean(equals(l, r));
    if (op == "!=") return Value::boolean(!equals(l, r));
    if (op == "<") return Value::boolean(less(l, r));
    if (op == ">") return Value::boolean(less(r, l));
    if (op == "<=") return Value::boolean(!less(r, l));
    if (op == ">=") return Value::boolean(!less(l, r));
    if (op == "in" || op == "not in") {
      ValueList a{r};
      bool in = false;
      if (!r.is_string() && !r.is_dict() && !r.is_list() && !r.is_undefined())
        fail(n, std::string("argument of type '") + kind_name(r) + "' is not iterable");
      in = apply_test("in", l, a);
      return Value::boolean(op == "in" ? in : !in);
    }
    auto type_error = [&]() {
      fail(n, "unsupported operand type(s) for " + op + ": '" + kind_name(l) + "' and '" + kind_name(r) + "'" +
                  (l.is_undefined() || r.is_undefined()
                       ? " (undefined: " + (l.is_undefined() ? l.s : r.s) + ")"
                       : std::string()));
    };
    if (op == "+") {
      if (l.is_string() && r.is_string()) return Value::string(l.s + r.s);
      if (l.is_list() && r.is_list()) {
        ValueList out = *l.list;
        out.insert(out.end(), r.list->begin(), r.list->end());
        return Value::make_list(std::move(out));
      }
    }
    if (op == "*") {
      const Value* seq = l.is_string() || l.is_list() ? &l : r.is_string() || r.is_list() ? &r : nullptr;
      const Value* cnt = seq == &l ? &r : &l;
      if (seq && (cnt->kind == K::kInt || cnt->kind == K::kBool)) {
        const int64_t times = cnt->kind == K::kBool ? cnt->b : cnt->i;
        if (seq->is_string()) {
          std::string out;
          for (int64_t k = 0; k < times; ++k) out += seq->s;
          return Value::string(out);
        }
        ValueList out;
        for (int64_t k = 0; k < times; ++k) out.insert(out.end(), seq->list->begin(), seq->list->end());
        return Value::make_list(std::move(out));
      }
    }
    if (!l.is_number() || !r.is_number()) type_error();
    const bool ints = l.kind != K::kFloat && r.kind != K::kFloat;
    const int64_t li = l.kind == K::kBool ? l.b : l.i, ri = r.kind == K::kBool ? r.b : r.i;
    const double lf = l.as_double(), rf = r.as_double();
    if (op == "+") return ints ? Value::integer(li + ri) : Value::number(lf + rf);
    if (op == "-") return ints ? Value::integer(li - ri) : Value::number(lf - rf);
    if (op == "*") return ints ? Value::integer(li * ri) : Value::number(lf * rf);
    if (op == "/") {
      if (rf == 0) fail(n, "division by zero");
      return Value::number(lf / rf);
    }
    if (op == "//" || op == "%") {
      if (rf == 0) fail(n, op == "//" ? "integer division or modulo by zero" : "modulo by zero");
      if (ints) {
        int64_t q = li / ri, m = li % ri;
        if (m != 0 && ((m < 0) != (ri < 0))) {
          --q;
          m += ri;
        }
        return Value::integer(op == "//" ? q : m);
      }
      const double q = std::floor(lf / rf);
      return Value::number(op == "//" ? q : lf - q * rf);
    }
    if (op == "**") {
      if (ints && ri >= 0) {
        int64_t out = 1;
        for (int64_t k = 0; k < ri; ++k) out *= li;
        return Value::integer(out);
      }
      return Value::number(std::pow(lf, rf));
    }
    type_error();
    return Value::none();
  }

  std::string name_;
  ScopeChain scopes_;
};

std::string strftime_now(const std::string& fmt) {
  const std::time_t t = std::time(nullptr);
  std::tm tm{};
  localtime_r(&t, &tm);
  char buf[256];
  const size_t n = std::strftime(buf, sizeof buf, fmt.c_str(), &tm);
  return std::string(buf, n);
}

}  // namespace

Template::Template(const std::string& source, std::string name) : name_(std::move(name)) {
  root_ = parse_template(source, name_, &has_generation_);
}
Template::~Template() = default;
Template::Template(Template&&) noexcept = default;
Template& Template::operator=(Template&&) noexcept = default;

Template::Output Template::render(const Value& vars) const {
  auto globals = std::make_shared<Scope>();
  (*globals)["raise_exception"] = Value::callable([](ValueList& a, KwArgs&) -> Value {
    throw Raised{a.empty() ? std::string() : to_str(a[0])};
  });
  (*globals)["strftime_now"] = Value::callable([](ValueList& a, KwArgs&) {
    if (a.empty() || !a[0].is_string()) throw std::runtime_error("strftime_now needs a format string");
    return Value::string(strftime_now(a[0].s));
  });
  (*globals)["namespace"] = Value::callable([](ValueList& a, KwArgs& kw) {
    Value ns = Value::make_dict();
    ns.is_namespace = true;
    for (const Value& d : a)
      if (d.is_dict())
        for (const auto& kv : d.dict->items) ns.dict->set(kv.first, kv.second);
    for (const auto& kv : kw) ns.dict->set(kv.first, kv.second);
    return ns;
  });
  (*globals)["range"] = Value::callable([](ValueList& a, KwArgs&) {
    int64_t start = 0, stop = 0, step = 1;
    if (a.size() == 1) stop = a[0].i;
    else if (a.size() >= 2) {
      start = a[0].i;
      stop = a[1].i;
      if (a.size() > 2) step = a[2].i;
    }
    if (step == 0) throw std::runtime_error("range() arg 3 must not be zero");
    ValueList out;
    for (int64_t k = start; step > 0 ? k < stop : k > stop; k += step) out.push_back(Value::integer(k));
    return Value::make_list(std::move(out));
  });
  if (vars.is_dict())
    for (const auto& kv : vars.dict->items) (*globals)[kv.first] = kv.second;
  // The template's own top-level `set`s live above the globals.
  Renderer r(name_, {globals, std::make_shared<Scope>()});
  try {
    r.exec(root_);
  } catch (const Raised& e) {
    throw TemplateError(name_ + ": the template raised an exception: " + e.message, true);
  }
  return std::move(r.out);
}

}  // namespace trainrun::jinja
