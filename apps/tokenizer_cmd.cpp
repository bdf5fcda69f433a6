// `trainrun tokenizer`: train a byte-level BPE (core/data/tokenizer/bpe_train.h),
// and encode/decode with any tokenizer.json, for checks from the shell.
#include "apps/tokenizer_cmd.h"

#include <filesystem>
#include <iostream>
#include <iterator>
#include <sstream>

#include "core/common/error.h"
#include "core/data/tokenizer/bpe_train.h"
#include "core/data/tokenizer/tokenizer.h"

namespace trainrun {

struct TokenizerCommand::Options {
  BpeTrainOptions train;
  std::string output, tokenizer, text, ids;
  bool text_set = false, allow_special = false, quiet = false;
};

std::unique_ptr<TokenizerCommand> TokenizerCommand::add(CLI::App& app) {
  auto c = std::make_unique<TokenizerCommand>();
  c->o_ = std::make_shared<Options>();
  Options& o = *c->o_;
  c->cmd_ = app.add_subcommand("tokenizer", "train a byte-level BPE tokenizer; encode and decode text with a tokenizer.json");
  c->cmd_->require_subcommand(1);

  c->train_ = c->cmd_->add_subcommand(
      "train", "train a byte-level BPE (the merges of HF tokenizers' BpeTrainer) and write DIR/tokenizer.json");
  auto* t = c->train_;
  t->add_option("--input", o.train.inputs, "text or jsonl files, or directories of them")->required();
  t->add_option("--vocab-size", o.train.vocab_size, "tokens in all: special tokens + 256 bytes + merges")->required();
  t->add_option("--output", o.output, "directory for tokenizer.json and tokenizer_config.json")->required();
  t->add_option("--format", o.train.format, "text: one document per file; jsonl: one per line")
      ->capture_default_str()->check(CLI::IsMember({"text", "jsonl"}));
  t->add_option("--text-field", o.train.text_field, "jsonl: the field holding each document")->capture_default_str();
  t->add_option("--pre-tokenizer", o.train.pre_tokenizer, "the split before byte-level BPE: Llama 3's or GPT-2's regex")
      ->capture_default_str()->check(CLI::IsMember({"llama3", "gpt2"}));
  t->add_option("--special-tokens", o.train.special_tokens,
                "special tokens, ids 0.. in order (Llama 3's <|begin_of_text|> <|start_header_id|> <|end_header_id|> "
                "<|eot_id|>, or ChatML's <|im_start|> <|im_end|>, add a chat template to tokenizer_config.json)");
  t->add_option("--min-frequency", o.train.min_frequency, "never merge a pair seen fewer times")->capture_default_str();
  t->add_option("--threads", o.train.threads, "word-counting threads (0: all cores)")->capture_default_str()
      ->check(CLI::Range(0, 4096));
  t->add_flag("--quiet", o.quiet, "no progress line");

  for (auto** sub : {&c->encode_, &c->decode_}) {
    const bool enc = sub == &c->encode_;
    *sub = c->cmd_->add_subcommand(enc ? "encode" : "decode",
                                   enc ? "print the ids of text (--text, else stdin), space-separated"
                                       : "print the text of ids (--ids, else stdin; space-separated)");
    (*sub)->add_option("--tokenizer", o.tokenizer, "a tokenizer.json, or a directory holding one")->required();
  }
  c->encode_->add_option("--text", o.text, "the text (default: all of stdin)");
  c->encode_->add_flag("--allow-special", o.allow_special, "match special tokens spelled in the text (as HF encode does)");
  c->decode_->add_option("--ids", o.ids, "the ids, space-separated (default: stdin)");
  for (CLI::App* sub : {c->train_, c->encode_, c->decode_}) sub->footer("Docs: docs/data-format.md");
  return c;
}

namespace {

std::string tokenizer_path(const std::string& p) {
  std::error_code ec;
  if (std::filesystem::is_directory(p, ec)) return (std::filesystem::path(p) / "tokenizer.json").string();
  return p;
}

std::string read_stdin() {
  return std::string(std::istreambuf_iterator<char>(std::cin), std::istreambuf_iterator<char>());
}

}  // namespace

int TokenizerCommand::run() const {
  const Options& o = *o_;
  if (train_->parsed()) {
    BpeTrainOptions opt = o.train;
    opt.progress = !o.quiet;
    std::cout << train_tokenizer(opt, o.output) << "\n";
    return 0;
  }
  const Tokenizer tok = Tokenizer::load(tokenizer_path(o.tokenizer));
  if (encode_->parsed()) {
    const std::string text = encode_->get_option("--text")->count() ? o.text : read_stdin();
    const std::vector<uint32_t> ids = tok.encode(text, o.allow_special);
    for (size_t i = 0; i < ids.size(); ++i) std::cout << (i ? " " : "") << ids[i];
    std::cout << "\n";
    return 0;
  }
  const std::string src = decode_->get_option("--ids")->count() ? o.ids : read_stdin();
  std::istringstream in(src);
  std::vector<uint32_t> ids;
  std::string word;
  while (in >> word) {
    char* end = nullptr;
    const unsigned long v = std::strtoul(word.c_str(), &end, 10);
    TR_CHECK(*end == 0 && !word.empty() && word[0] != '-' && v < tok.vocab_size(), "tokenizer decode: '", word,
             "' is not a token id of ", tok.name(), " (0 .. ", tok.vocab_size() - 1, ")");
    ids.push_back(static_cast<uint32_t>(v));
  }
  std::cout << utf8_lossy(tok.decode(ids));
  return 0;
}

}  // namespace trainrun
