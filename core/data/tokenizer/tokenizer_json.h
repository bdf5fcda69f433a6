// Helpers the tokenizer.json readers share: errors that name the file and
// the JSON path, typed member access. Private to core/data/tokenizer.
#pragma once
#include <nlohmann/json.hpp>
#include <string>

#include "core/data/tokenizer/tokenizer_impl.h"

namespace trainrun::tokjson {

using json = nlohmann::json;

// Errors carry "<file>: <json path>: ...".
struct Ctx {
  const std::string& file;
  [[noreturn]] void fail(const std::string& path, const std::string& what) const;
};

// Refuses an id above 2^22 - 1 (the dense id tables' cost), naming path.
void check_token_id_size(const Ctx& c, const std::string& path, uint64_t id);
std::string show(const json& v);
const json* member(const json& obj, const char* key);
bool get_bool(const Ctx& c, const json& obj, const std::string& path, const char* key, bool dflt);
std::string get_string(const Ctx& c, const json& obj, const std::string& path, const char* key, const std::string& dflt);
uint64_t get_uint(const Ctx& c, const json& obj, const std::string& path, const char* key, uint64_t dflt);
std::string get_type(const Ctx& c, const json& obj, const std::string& path);
// The one code point of a JSON string (Metaspace's replacement, Strip's content).
uint32_t get_char(const Ctx& c, const json& obj, const std::string& path, const char* key, uint32_t dflt);
void compile_regex(const Ctx& c, const std::string& path, const std::string& pattern, bool literal, CompiledRegex& out);
// {"String": s} or {"Regex": r} (Split, Replace) compiled.
std::shared_ptr<CompiledRegex> get_pattern(const Ctx& c, const json& obj, const std::string& path);
// The elements of a Sequence's list member (flattened by the callers).
const json& get_list(const Ctx& c, const json& obj, const std::string& path, const char* key);

void load_normalizer(const Ctx& c, const json& n, const std::string& path, std::vector<NormStep>& out);
void load_pre_tokenizer(const Ctx& c, const json& p, const std::string& path, std::vector<PreTokStep>& out);
void load_model(const Ctx& c, const json& m, Tokenizer::Impl& impl);
void load_decoder(const Ctx& c, const json& d, const std::string& path, std::vector<DecodeStep>& out);
void load_post_processor(const Ctx& c, const json& p, const std::string& path, Tokenizer::Impl& impl);

}  // namespace trainrun::tokjson
