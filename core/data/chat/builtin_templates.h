// The built-in chat templates' Jinja sources (builtin_templates.cpp).
#pragma once
#include <string>

namespace trainrun::chat {

// The source of built-in template `name` (llama3, chatml, plain), nullptr for another name.
const char* builtin_template_source(const std::string& name);

}  // namespace trainrun::chat
