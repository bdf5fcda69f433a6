// `trainrun tokenizer train|encode|decode`: the front-end of
// core/data/tokenizer/bpe_train.h and of Tokenizer for shell checks.
#pragma once
#include <CLI/CLI.hpp>
#include <memory>

namespace trainrun {

class TokenizerCommand {
 public:
  // Adds the `tokenizer` subcommand (and its three) to `app`.
  static std::unique_ptr<TokenizerCommand> add(CLI::App& app);
  CLI::App* command() const { return cmd_; }
  bool parsed() const { return cmd_->parsed(); }
  int run() const;

 private:
  struct Options;
  std::shared_ptr<Options> o_;
  CLI::App *cmd_ = nullptr, *train_ = nullptr, *encode_ = nullptr, *decode_ = nullptr;
};

}  // namespace trainrun
