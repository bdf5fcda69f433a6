#include "core/data/chat_template.h"

#include "core/common/error.h"

namespace trainrun::chat {

const char* template_name(Template t) {
  return t == Template::kLlama3 ? "llama3" : t == Template::kChatMl ? "chatml" : "plain";
}

Specials resolve_specials(const Tokenizer& tok, const std::string& tmpl_opt, bool chat, const char* what) {
  Specials sp;
  // As llm.c's data scripts do: Llama 3 documents start with the BOS its
  // post-processor adds; GPT-2's (no BOS) with <|endoftext|>, the token it
  // was trained to see between documents.
  if (tok.bos_id() >= 0) {
    sp.doc_start = static_cast<uint32_t>(tok.bos_id());
    sp.doc_start_name = tok.decode({sp.doc_start});
  } else {
    for (const char* name : {"<|endoftext|>", "<|end_of_text|>", "</s>"}) {
      if (int64_t id = tok.special_id(name); id >= 0) {
        sp.doc_start = static_cast<uint32_t>(id);
        sp.doc_start_name = name;
        break;
      }
    }
    if (sp.doc_start_name.empty())
      TR_FAIL("--tokenizer '", tok.name(), "': no BOS (post_processor) and no <|endoftext|>, <|end_of_text|> or </s> "
              "special token to separate documents with; use the model's own tokenizer.json");
  }
  if (!chat) return sp;
  auto need = [&](const char* name, const char* tname) {
    int64_t id = tok.special_id(name);
    if (id < 0)
      TR_FAIL(what, " ", tname, ": the tokenizer '", tok.name(), "' has no special token ", name,
              "; choose another --chat-template (llama3, chatml, plain)");
    return static_cast<uint32_t>(id);
  };
  std::string t = tmpl_opt;
  if (t.empty()) {
    t = tok.special_id("<|start_header_id|>") >= 0 ? "llama3" : tok.special_id("<|im_start|>") >= 0 ? "chatml" : "plain";
  }
  if (t == "llama3") {
    sp.tmpl = Template::kLlama3;
    sp.start_header = need("<|start_header_id|>", "llama3");
    sp.end_header = need("<|end_header_id|>", "llama3");
    sp.eot = need("<|eot_id|>", "llama3");
  } else if (t == "chatml") {
    sp.tmpl = Template::kChatMl;
    sp.im_start = need("<|im_start|>", "chatml");
    sp.im_end = need("<|im_end|>", "chatml");
  } else if (t == "plain") {
    sp.tmpl = Template::kPlain;
  } else {
    TR_FAIL(what, ": '", t, "' is not one of llama3, chatml, plain");
  }
  return sp;
}

std::vector<Segment> render_chat(const Specials& sp, const std::vector<Message>& msgs) {
  std::vector<Segment> segs;
  segs.push_back({true, sp.doc_start, {}, false});
  for (const auto& m : msgs) {
    const bool asst = m.role == Role::kAssistant;
    const char* role = m.role == Role::kSystem ? "system" : m.role == Role::kUser ? "user" : "assistant";
    switch (sp.tmpl) {
      case Template::kLlama3:
        // <|start_header_id|>role<|end_header_id|>\n\ncontent<|eot_id|>
        segs.push_back({true, sp.start_header, {}, false});
        segs.push_back({false, 0, role, false});
        segs.push_back({true, sp.end_header, {}, false});
        segs.push_back({false, 0, "\n\n", false});
        segs.push_back({false, 0, m.content, asst});
        segs.push_back({true, sp.eot, {}, asst});
        break;
      case Template::kChatMl:
        // <|im_start|>role\ncontent<|im_end|>\n
        segs.push_back({true, sp.im_start, {}, false});
        segs.push_back({false, 0, std::string(role) + "\n", false});
        segs.push_back({false, 0, m.content, asst});
        segs.push_back({true, sp.im_end, {}, asst});
        segs.push_back({false, 0, "\n", false});
        break;
      case Template::kPlain: {
        // "System: ...\n\nUser: ...\n\nAssistant: ...\n\n" (the blank line ends a reply)
        const char* label = m.role == Role::kSystem ? "System: " : m.role == Role::kUser ? "User: " : "Assistant: ";
        segs.push_back({false, 0, label, false});
        segs.push_back({false, 0, m.content, asst});
        segs.push_back({false, 0, "\n\n", asst});
        break;
      }
    }
  }
  return segs;
}

std::vector<Segment> render_generation_prompt(const Specials& sp, const std::vector<Message>& msgs) {
  std::vector<Segment> segs = render_chat(sp, msgs);
  switch (sp.tmpl) {
    case Template::kLlama3:
      segs.push_back({true, sp.start_header, {}, false});
      segs.push_back({false, 0, "assistant", false});
      segs.push_back({true, sp.end_header, {}, false});
      segs.push_back({false, 0, "\n\n", false});
      break;
    case Template::kChatMl:
      segs.push_back({true, sp.im_start, {}, false});
      segs.push_back({false, 0, "assistant\n", false});
      break;
    case Template::kPlain:
      segs.push_back({false, 0, "Assistant: ", false});
      break;
  }
  return segs;
}

std::vector<uint32_t> encode_segments(const Tokenizer& tok, const std::vector<Segment>& segs) {
  std::vector<uint32_t> ids;
  TokenEncoder enc(tok);
  for (const Segment& s : segs) {
    if (s.special) ids.push_back(s.id);
    else enc.encode(s.text, false, ids);
  }
  return ids;
}

int64_t end_of_turn(const Specials& sp) {
  return sp.tmpl == Template::kLlama3 ? int64_t(sp.eot) : sp.tmpl == Template::kChatMl ? int64_t(sp.im_end) : -1;
}

}  // namespace trainrun::chat
