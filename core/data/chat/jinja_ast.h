// The syntax tree of a parsed template (private to core/data/chat).
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "core/data/chat/jinja_value.h"

namespace trainrun::jinja {

struct Node;
using NodePtr = std::shared_ptr<Node>;

struct Node {
  enum class Type {
    // statements
    kBody,      // children in order
    kText,      // str
    kOutput,    // {{ a }}
    kIf,        // a = cond, children[0] = then, children[1] = else (or null)
    kFor,       // targets, a = iterable, b = filter (or null), children[0] = body, children[1] = else
    kSet,       // targets (or attr: target "ns", str "attr"), a = value
    kSetBlock,  // targets[0], children[0] = body
    kMacro,     // str = name, params (targets) + defaults (args), children[0] = body
    kGeneration,  // children[0] = body
    // expressions
    kLiteral,   // value
    kName,      // str
    kList,      // args
    kDict,      // args = k0, v0, k1, v1, ...
    kAttr,      // a . str
    kItem,      // a [ b ]
    kSlice,     // a [ args[0] : args[1] : args[2] ] (null = omitted)
    kCall,      // a ( args, kwargs )
    kFilter,    // str = name, a = operand, args, kwargs
    kTest,      // str = name, a = operand, args; negate
    kUnary,     // str = "not" | "-" | "+", a
    kBinary,    // str = op, a, b
    kCond,      // a if b else c
  };
  Type type;
  int line = 0, col = 0;
  std::string str;
  Value value;
  NodePtr a, b, c;
  std::vector<NodePtr> children;
  std::vector<NodePtr> args;
  std::vector<std::pair<std::string, NodePtr>> kwargs;
  std::vector<std::string> targets;
  bool negate = false;
};

// Parses the template source (see jinja.h for the subset).
NodePtr parse_template(const std::string& source, const std::string& name, bool* has_generation);

}  // namespace trainrun::jinja
