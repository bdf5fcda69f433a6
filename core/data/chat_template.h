// Chat templates: how a conversation becomes token ids for a model's
// tokenizer, shared by `prepare` (training data with loss masks) and
// `generate --chat` (a prompt that ends where the assistant's reply starts).
//
//   llama3  <|begin_of_text|><|start_header_id|>role<|end_header_id|>\n\ncontent<|eot_id|>...
//   chatml  <|im_start|>role\ncontent<|im_end|>\n...
//   plain   "User: ...\n\nAssistant: ...\n\n" (no special tokens)
// The default follows the tokenizer's special tokens: llama3 when it has
// <|start_header_id|>, chatml when it has <|im_start|>, else plain.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "core/data/tokenizer/tokenizer.h"

namespace trainrun::chat {

enum class Template { kLlama3, kChatMl, kPlain };

// One template piece: a special id inserted as is, or text to encode.
struct Segment {
  bool special = false;
  uint32_t id = 0;
  std::string text;
  bool target = false;  // in the loss (chat formats)
};

// The ids the templates and document separation use, resolved once.
struct Specials {
  uint32_t doc_start = 0;        // put before every document
  std::string doc_start_name;
  Template tmpl = Template::kPlain;
  uint32_t start_header = 0, end_header = 0, eot = 0;  // llama3
  uint32_t im_start = 0, im_end = 0;                   // chatml
};

enum class Role { kSystem, kUser, kAssistant };
struct Message {
  Role role;
  std::string content;
};

const char* template_name(Template t);
// `tmpl_opt`: "" (the default above), llama3, chatml or plain; `chat`: the
// template is needed (else only the document start is resolved). Errors
// name `what` (the flag) and the missing special token.
Specials resolve_specials(const Tokenizer& tok, const std::string& tmpl_opt, bool chat,
                          const char* what = "--chat-template");
// The rendered conversation. The template's text and the message contents
// are encoded as separate segments, so a mask boundary is a token boundary.
std::vector<Segment> render_chat(const Specials& sp, const std::vector<Message>& msgs);
// A prompt for the model to answer: the conversation, then the assistant's
// header (transformers' add_generation_prompt=True).
std::vector<Segment> render_generation_prompt(const Specials& sp, const std::vector<Message>& msgs);
// The ids of segments: special ones as they are, text encoded (special
// tokens spelled in it as text).
std::vector<uint32_t> encode_segments(const Tokenizer& tok, const std::vector<Segment>& segs);
// The token that ends an assistant turn (llama3 <|eot_id|>, chatml
// <|im_end|>); -1 for plain.
int64_t end_of_turn(const Specials& sp);

}  // namespace trainrun::chat
