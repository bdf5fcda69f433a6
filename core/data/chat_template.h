// Chat templates: how a conversation becomes token ids for a model's
// tokenizer, shared by `prepare` (training data with loss masks) and
// `generate --chat` (a prompt that ends where the assistant's reply starts).
//
// The template is the model's own Jinja chat template, rendered as
// transformers' apply_chat_template renders it (core/data/chat/jinja.h):
//   --chat-template ""      the model's: chat_template.jinja, else the
//                           "chat_template" of tokenizer_config.json (a
//                           string, or a list of {name, template}: the one
//                           named "default"), beside the tokenizer.json;
//                           none there: llama3 when the tokenizer has
//                           <|start_header_id|>, chatml when <|im_start|>,
//                           else plain
//   llama3 | chatml | plain a built-in (core/data/chat/builtin_templates.cpp)
//   NAME                    a named template of tokenizer_config.json
//   FILE                    a Jinja file
// The variables are HF's: messages, add_generation_prompt, tools=None,
// documents=None, and the special tokens of tokenizer_config.json
// (bos_token, eos_token, unk_token, pad_token, additional_special_tokens).
//
// Encoding, as apply_chat_template(tokenize=True): the rendered text is
// encoded whole, with special tokens matched (allow_special), no BOS/EOS
// added. The loss mask (docs/data-format.md states the rule) covers the
// text each assistant message adds: from the end of the conversation
// before it rendered with add_generation_prompt=True, to the end of the
// conversation through it (or the {% generation %} blocks, when the
// template has them), mapped to the tokens that lie inside.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/data/chat/jinja.h"
#include "core/data/tokenizer/tokenizer.h"

namespace trainrun::chat {

// The token put before every document (text, jsonl) and before every
// conversation that does not already start with it.
struct DocStart {
  uint32_t id = 0;
  std::string name;
};
DocStart resolve_doc_start(const Tokenizer& tok);

struct Message {
  std::string role;  // system | user | assistant
  std::string content;
};

class ChatTemplate {
 public:
  // Resolves --chat-template `opt` (see above) for the tokenizer loaded
  // from `tokenizer_path`. Errors name `what` (the flag) and the file.
  static ChatTemplate resolve(const Tokenizer& tok, const std::string& tokenizer_path, const std::string& opt,
                              const char* what = "--chat-template");
  // A template from source, with the special-token variables given.
  ChatTemplate(const std::string& source, std::string description, jinja::Value special_tokens);

  // "the model's (dir/tokenizer_config.json)", "llama3 (built-in)", a path.
  const std::string& description() const { return description_; }
  const std::string& source() const { return source_; }

  std::string render(const std::vector<Message>& msgs, bool add_generation_prompt) const;
  // The rendered conversation (add_generation_prompt=False) and the
  // [begin, end) byte spans of its assistant turns, in order.
  struct Spans {
    std::string text;
    std::vector<std::pair<size_t, size_t>> assistant;
  };
  Spans assistant_spans(const std::vector<Message>& msgs) const;

  // Appends the ids of the conversation to `ids`; with `mask`, one 0/1 per
  // id: 1 on the assistant turns' tokens (the conversation must end with
  // an assistant message then, not with add_generation_prompt). Only
  // assistant turns from the `first_masked_turn`-th on (counting assistant
  // messages from 0) get 1s: a preference pair's response after a prompt
  // that holds earlier assistant turns of its own.
  void encode(TokenEncoder& enc, const std::vector<Message>& msgs, bool add_generation_prompt,
              std::vector<uint32_t>& ids, std::vector<uint8_t>* mask, size_t first_masked_turn = 0) const;

  // The first special token of an assistant turn's masked tokens (what
  // ends a reply: <|eot_id|>, <|im_end|>, <end_of_turn>, </s>), found by
  // rendering a one-turn conversation; -1 when the turn has none (plain).
  int64_t end_of_turn(const Tokenizer& tok) const;

 private:
  jinja::Value variables(const std::vector<Message>& msgs, bool add_generation_prompt) const;
  std::string source_, description_;
  std::shared_ptr<jinja::Template> tmpl_;
  jinja::Value specials_;
};

}  // namespace trainrun::chat
