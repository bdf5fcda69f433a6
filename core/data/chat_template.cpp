#include "core/data/chat_template.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/common/error.h"
#include "core/data/chat/builtin_templates.h"

namespace fs = std::filesystem;
using ojson = nlohmann::ordered_json;

namespace trainrun::chat {
namespace {

std::string read_text(const fs::path& p, const char* what) {
  std::ifstream f(p, std::ios::binary);
  if (!f) TR_FAIL(what, ": cannot read '", p.string(), "': ", detail::errno_string());
  std::ostringstream os;
  os << f.rdbuf();
  return os.str();
}

// An added token in tokenizer_config.json: "<s>" or {"content": "<s>", ...}.
jinja::Value token_string(const ojson& j) {
  if (j.is_string()) return jinja::Value::string(j.get<std::string>());
  if (j.is_object() && j.contains("content") && j["content"].is_string())
    return jinja::Value::string(j["content"].get<std::string>());
  return jinja::Value::none();
}

size_t common_prefix(const std::string& a, size_t a_from, const std::string& b, size_t b_from) {
  size_t n = 0;
  while (a_from + n < a.size() && b_from + n < b.size() && a[a_from + n] == b[b_from + n]) ++n;
  return n;
}

}  // namespace

DocStart resolve_doc_start(const Tokenizer& tok) {
  DocStart d;
  // As llm.c's data scripts do: Llama 3 documents start with the BOS its
  // post-processor adds; GPT-2's (no BOS) with <|endoftext|>, the token it
  // was trained to see between documents.
  if (tok.bos_id() >= 0) {
    d.id = static_cast<uint32_t>(tok.bos_id());
    d.name = tok.decode({d.id});
    return d;
  }
  for (const char* name : {"<|endoftext|>", "<|end_of_text|>", "</s>"}) {
    if (int64_t id = tok.special_id(name); id >= 0) {
      d.id = static_cast<uint32_t>(id);
      d.name = name;
      return d;
    }
  }
  TR_FAIL("--tokenizer '", tok.name(), "': no BOS (post_processor) and no <|endoftext|>, <|end_of_text|> or </s> "
          "special token to separate documents with; use the model's own tokenizer.json");
}

ChatTemplate::ChatTemplate(const std::string& source, std::string description, jinja::Value special_tokens)
    : source_(source), description_(std::move(description)), specials_(std::move(special_tokens)) {
  tmpl_ = std::make_shared<jinja::Template>(source_, description_);
}

ChatTemplate ChatTemplate::resolve(const Tokenizer& tok, const std::string& tokenizer_path, const std::string& opt,
                                   const char* what) {
  const fs::path dir = fs::path(tokenizer_path).parent_path();
  const fs::path config_path = dir / "tokenizer_config.json";
  ojson config = ojson::object();
  if (fs::exists(config_path)) {
    try {
      config = ojson::parse(read_text(config_path, what));
    } catch (const ojson::exception& e) {
      TR_FAIL(what, ": '", config_path.string(), "' is not valid JSON (", e.what(), ")");
    }
    if (!config.is_object()) TR_FAIL(what, ": '", config_path.string(), "' is not a JSON object");
  }
  // The special-token variables, as transformers passes special_tokens_map.
  jinja::Value specials = jinja::Value::make_dict();
  for (const char* key : {"bos_token", "eos_token", "unk_token", "pad_token"})
    if (config.contains(key)) {
      const jinja::Value v = token_string(config[key]);
      if (!v.is_none()) specials.dict->set(key, v);
    }
  if (config.contains("additional_special_tokens") && config["additional_special_tokens"].is_array()) {
    jinja::ValueList l;
    for (const auto& t : config["additional_special_tokens"]) l.push_back(token_string(t));
    specials.dict->set("additional_special_tokens", jinja::Value::make_list(std::move(l)));
  }
  // No tokenizer_config.json (a bare tokenizer.json): the document start
  // stands in for the BOS the built-in llama3 template begins with.
  if (!specials.dict->find("bos_token")) specials.dict->set("bos_token", jinja::Value::string(resolve_doc_start(tok).name));

  // Named templates: the list form of "chat_template".
  std::vector<std::pair<std::string, std::string>> named;
  std::string config_template;
  if (config.contains("chat_template")) {
    const ojson& ct = config["chat_template"];
    if (ct.is_string()) {
      config_template = ct.get<std::string>();
    } else if (ct.is_array()) {
      for (size_t k = 0; k < ct.size(); ++k) {
        const ojson& e = ct[k];
        if (!e.is_object() || !e.contains("name") || !e["name"].is_string() || !e.contains("template") ||
            !e["template"].is_string())
          TR_FAIL(what, ": '", config_path.string(), "' chat_template[", k,
                  "] is not {\"name\": string, \"template\": string}");
        named.emplace_back(e["name"].get<std::string>(), e["template"].get<std::string>());
      }
    } else if (!ct.is_null()) {
      TR_FAIL(what, ": '", config_path.string(), "' chat_template is neither a string nor a list of {name, template}");
    }
  }
  auto named_list = [&]() {
    std::string s;
    for (const auto& [n, t] : named) s += (s.empty() ? "" : ", ") + n;
    return s;
  };
  auto builtin = [&](const std::string& name, const std::string& why) {
    auto need = [&](const char* token) {
      if (tok.special_id(token) < 0)
        TR_FAIL(what, " ", name, ": the tokenizer '", tok.name(), "' has no special token ", token,
                "; choose another --chat-template (llama3, chatml, plain, or a Jinja file)");
    };
    if (name == "llama3")
      for (const char* t : {"<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"}) need(t);
    if (name == "chatml")
      for (const char* t : {"<|im_start|>", "<|im_end|>"}) need(t);
    return ChatTemplate(builtin_template_source(name), name + " (built-in" + why + ")", specials);
  };

  if (opt.empty()) {
    const fs::path jinja_file = dir / "chat_template.jinja";
    if (fs::exists(jinja_file)) return ChatTemplate(read_text(jinja_file, what), jinja_file.string(), specials);
    if (!config_template.empty())
      return ChatTemplate(config_template, config_path.string() + " chat_template", specials);
    if (!named.empty()) {
      for (const auto& [n, t] : named)
        if (n == "default") return ChatTemplate(t, config_path.string() + " chat_template 'default'", specials);
      TR_FAIL(what, ": '", config_path.string(), "' has the named chat templates ", named_list(),
              " and none is 'default'; pass --chat-template NAME");
    }
    const std::string why = ", no chat_template beside " + tokenizer_path;
    if (tok.special_id("<|start_header_id|>") >= 0) return builtin("llama3", why);
    if (tok.special_id("<|im_start|>") >= 0) return builtin("chatml", why);
    return builtin("plain", why);
  }
  if (builtin_template_source(opt)) return builtin(opt, "");
  for (const auto& [n, t] : named)
    if (n == opt) return ChatTemplate(t, config_path.string() + " chat_template '" + n + "'", specials);
  if (fs::is_regular_file(opt)) return ChatTemplate(read_text(opt, what), opt, specials);
  TR_FAIL(what, ": '", opt, "' is not llama3, chatml, plain, ",
          named.empty() ? std::string() : "a chat template name of " + config_path.string() + " (" + named_list() + "), ",
          "or a Jinja file");
}

jinja::Value ChatTemplate::variables(const std::vector<Message>& msgs, bool add_generation_prompt) const {
  jinja::Value vars = jinja::Value::make_dict();
  jinja::ValueList list;
  for (const Message& m : msgs) {
    jinja::Value d = jinja::Value::make_dict();
    d.dict->set("role", jinja::Value::string(m.role));
    d.dict->set("content", jinja::Value::string(m.content));
    list.push_back(d);
  }
  for (const auto& kv : specials_.dict->items) vars.dict->set(kv.first, kv.second);
  vars.dict->set("messages", jinja::Value::make_list(std::move(list)));
  vars.dict->set("add_generation_prompt", jinja::Value::boolean(add_generation_prompt));
  vars.dict->set("tools", jinja::Value::none());
  vars.dict->set("documents", jinja::Value::none());
  return vars;
}

std::string ChatTemplate::render(const std::vector<Message>& msgs, bool add_generation_prompt) const {
  return tmpl_->render(variables(msgs, add_generation_prompt)).text;
}

ChatTemplate::Spans ChatTemplate::assistant_spans(const std::vector<Message>& msgs) const {
  Spans out;
  jinja::Template::Output full = tmpl_->render(variables(msgs, false));
  out.text = std::move(full.text);
  if (tmpl_->has_generation()) {
    for (const auto& g : full.generation)
      if (g.second > g.first) out.assistant.push_back(g);
    return out;
  }
  const std::string& F = out.text;
  size_t prev_end = 0;
  for (size_t k = 0; k < msgs.size(); ++k) {
    if (msgs[k].role != "assistant") continue;
    const std::vector<Message> before(msgs.begin(), msgs.begin() + static_cast<long>(k));
    const std::vector<Message> through(msgs.begin(), msgs.begin() + static_cast<long>(k) + 1);
    const std::string S = render(before, true), E = render(through, false);
    // Where the turn starts in E: after the prompt for it, or, when the
    // template renders the earlier turns differently once the reply is
    // there (Mistral drops the system message unless the last message is
    // the user's), where E and the same conversation with an empty reply part.
    size_t turn = S.size();
    if (E.compare(0, S.size(), S) != 0) {
      std::vector<Message> empty = through;
      empty.back().content.clear();
      turn = common_prefix(render(empty, false), 0, E, 0);
    }
    const std::string delta = E.substr(turn);
    size_t start = 0, end = 0;
    if (turn >= prev_end && F.compare(0, turn, E, 0, turn) == 0) {
      // The usual case: the conversation renders as a growing prefix.
      start = turn;
      end = start + common_prefix(delta, 0, F, start);
    }
    if (end == start && !delta.empty()) {
      // A template that renders earlier turns differently once more follow
      // (Mistral puts the system message in the last user turn): the turn's
      // text, found after the previous one.
      start = F.find(delta, prev_end);
      if (start == std::string::npos)
        TR_FAIL(description_, ": the text of assistant message ", k + 1, " as the template renders it alone (\"",
                delta.substr(0, 60), "\") is not in the whole conversation's text; add {% generation %} blocks to "
                "the template or pass another --chat-template");
      end = start + delta.size();
    }
    if (end > start) out.assistant.emplace_back(start, end);
    prev_end = std::max(prev_end, end);
  }
  return out;
}

void ChatTemplate::encode(TokenEncoder& enc, const std::vector<Message>& msgs, bool add_generation_prompt,
                          std::vector<uint32_t>& ids, std::vector<uint8_t>* mask, size_t first_masked_turn) const {
  if (!mask) {
    enc.encode(render(msgs, add_generation_prompt), true, ids);
    return;
  }
  const Spans sp = assistant_spans(msgs);
  const std::string& text = sp.text;
  std::vector<uint32_t> full;
  enc.encode(text, true, full);
  // Span ends as token counts: the tokens wholly inside text[0, b). Pieces
  // between the boundaries encoded apart give them when their ids join to
  // the whole's (the usual case: a turn starts after a special token or a
  // newline); else each prefix is encoded and compared with the whole.
  std::vector<size_t> bounds = {0, text.size()};
  for (const auto& [b, e] : sp.assistant) {
    bounds.push_back(b);
    bounds.push_back(e);
  }
  for (size_t& b : bounds)
    while (b > 0 && b < text.size() && (static_cast<unsigned char>(text[b]) & 0xC0) == 0x80) --b;
  std::sort(bounds.begin(), bounds.end());
  bounds.erase(std::unique(bounds.begin(), bounds.end()), bounds.end());
  std::vector<size_t> ntok(bounds.size(), 0);
  std::vector<uint32_t> joined, piece;
  for (size_t k = 1; k < bounds.size(); ++k) {
    piece.clear();
    enc.encode(std::string_view(text).substr(bounds[k - 1], bounds[k] - bounds[k - 1]), true, piece);
    joined.insert(joined.end(), piece.begin(), piece.end());
    ntok[k] = joined.size();
  }
  if (joined != full) {
    for (size_t k = 1; k + 1 < bounds.size(); ++k) {
      piece.clear();
      enc.encode(std::string_view(text).substr(0, bounds[k]), true, piece);
      size_t n = 0;
      while (n < piece.size() && n < full.size() && piece[n] == full[n]) ++n;
      ntok[k] = n;
    }
    ntok.back() = full.size();
  }
  auto tokens_before = [&](size_t b) {
    while (b > 0 && b < text.size() && (static_cast<unsigned char>(text[b]) & 0xC0) == 0x80) --b;
    return ntok[static_cast<size_t>(std::lower_bound(bounds.begin(), bounds.end(), b) - bounds.begin())];
  };
  const size_t base = ids.size();
  ids.insert(ids.end(), full.begin(), full.end());
  mask->resize(ids.size(), 0);
  for (size_t k = first_masked_turn; k < sp.assistant.size(); ++k) {
    const auto [b, e] = sp.assistant[k];
    const size_t tb = tokens_before(b), te = tokens_before(e);
    for (size_t t = tb; t < te; ++t) (*mask)[base + t] = 1;
  }
}

int64_t ChatTemplate::end_of_turn(const Tokenizer& tok) const {
  try {
    TokenEncoder enc(tok);
    std::vector<uint32_t> ids;
    std::vector<uint8_t> mask;
    encode(enc, {{"user", "Hi"}, {"assistant", "Hello"}}, false, ids, &mask);
    for (size_t t = 0; t < ids.size(); ++t)
      if (mask[t] && tok.special_id(tok.decode({ids[t]})) == int64_t(ids[t])) return ids[t];
  } catch (const Error&) {
    // A template that cannot render this conversation has no turn end to learn.
  }
  return -1;
}

}  // namespace trainrun::chat
