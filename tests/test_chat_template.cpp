// Chat templates (core/data/chat_template.h, core/data/chat/jinja*) against
// transformers 4.44.2 itself (scripts/reference/hf_chat_template.py):
//   - the Jinja renderer gives jinja2's text, as transformers configures it,
//     on snippets for each construct and on the templates of seven models;
//   - the ids equal apply_chat_template(tokenize=True) for Llama 3.1, 3.2,
//     Qwen2.5, Mistral v0.3, Gemma 2, Phi-3 and a ChatML model (SmolLM2),
//     with and without a system turn and add_generation_prompt, on a
//     byte-level tokenizer the test trains;
//   - the loss mask covers the assistant turns (the prefix rule), and equals
//     HF's assistant mask for a template with {% generation %};
//   - bad templates are errors naming line:column, a template's own
//     raise_exception names the data row.
#include <catch2/catch.hpp>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/data/chat/builtin_templates.h"
#include "core/data/chat/jinja.h"
#include "core/data/chat_template.h"
#include "core/data/tokenizer/tokenizer.h"
#include "tests/support/testutil.h"

using namespace trainrun;
using Catch::Contains;
using ojson = nlohmann::ordered_json;
namespace fs = std::filesystem;

namespace {

std::string fixture_dir() { return test::source_dir() + "/tests/fixtures/chat_templates"; }

const std::vector<std::string>& model_templates() {
  static const std::vector<std::string> names = {"llama3.1", "llama3.2", "qwen2.5", "mistral-v0.3",
                                                 "gemma2",   "phi3",     "chatml-smollm2"};
  return names;
}
std::string template_source(const std::string& name) {
  return test::read_file(fixture_dir() + "/" + name + ".jinja");
}

test::RunResult hf_chat(const std::string& args) {
  return test::run_command("'" + test::hf_python() + "' '" + test::source_dir() +
                           "/scripts/reference/hf_chat_template.py' " + args);
}

ojson read_json(const std::string& path) {
  std::ifstream f(path);
  return ojson::parse(f);
}

// Conversations with and without a system turn, ending with a user or an
// assistant turn; contents with spaces to trim, CJK, an emoji, a newline.
std::vector<ojson> conversations() {
  auto m = [](const char* role, const std::string& content) { return ojson{{"role", role}, {"content", content}}; };
  return {
      ojson::array({m("user", "Hello there!")}),
      ojson::array({m("system", "You are terse. "), m("user", " Hi\n"), m("assistant", " Hey! \n"),
                    m("user", "日本語? \U0001F600")}),
      ojson::array({m("user", "q one"), m("assistant", "c d"), m("user", "q two"), m("assistant", "f\ng")}),
      ojson::array({m("system", "S"), m("user", "How are you today?"), m("assistant", "I am fine, thank you.")}),
      // Mistral renders the system turn in the last user turn: earlier turns move.
      ojson::array({m("system", "Be kind."), m("user", "q three"), m("assistant", "r one"), m("user", "q four"),
                    m("assistant", "r two")}),
  };
}

std::vector<chat::Message> to_messages(const ojson& conv) {
  std::vector<chat::Message> out;
  for (const auto& m : conv) out.push_back({m["role"].get<std::string>(), m["content"].get<std::string>()});
  return out;
}

// The test's tokenizer: byte-level BPE with every special token the
// templates use (trained offline by the reference script), made once.
const std::string& tokenizer_dir() {
  static test::TempDir dir("chat_tok");
  static bool made = false;
  if (!made) {
    const test::RunResult r = hf_chat("tokenizer '" + dir.path() + "'");
    INFO(r.err);
    REQUIRE(r.exit_code == 0);
    made = true;
  }
  return dir.path();
}

}  // namespace

TEST_CASE("chat template: the Jinja renderer gives jinja2's text, as transformers configures it", "[chat][jinja][hf]") {
  test::TempDir d("jinja");
  ojson cases = read_json(fixture_dir() + "/jinja_cases.json");
  const size_t snippets = cases.size();
  for (const auto& name : model_templates())
    for (const ojson& conv : conversations())
      for (const bool agp : {false, true})
        cases.push_back({{"template", template_source(name)},
                         {"vars",
                          {{"messages", conv},
                           {"add_generation_prompt", agp},
                           {"bos_token", "<s>"},
                           {"eos_token", "</s>"},
                           {"tools", nullptr},
                           {"documents", nullptr}}}});
  test::write_file(d / "cases.json", cases.dump());
  const test::RunResult r = hf_chat("render '" + d / "cases.json" + "' '" + d / "ref.json" + "'");
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  const ojson ref = read_json(d / "ref.json");
  REQUIRE(ref.size() == cases.size());
  int errors = 0;
  for (size_t k = 0; k < cases.size(); ++k) {
    const std::string src = cases[k]["template"].get<std::string>();
    INFO("case " << k << (k < snippets ? " (snippet)" : " (model template)") << ": " << src.substr(0, 300));
    std::string got, err;
    try {
      got = jinja::Template(src, "t").render(jinja::Value::from_json(cases[k]["vars"])).text;
    } catch (const jinja::TemplateError& e) {
      err = e.what();
    }
    if (ref[k].is_object()) {
      // jinja2 refused it: so must we, naming where.
      INFO("jinja2: " << ref[k]["error"].get<std::string>());
      CHECK(!err.empty());
      CHECK_THAT(err, Catch::Matchers::Matches("t:[0-9]+(:[0-9]+)?: .*"));
      ++errors;
    } else {
      INFO("error: " << err);
      CHECK(got == ref[k].get<std::string>());
    }
  }
  CHECK(errors >= 10);  // the bad snippets, and Gemma refusing a system turn
}

TEST_CASE("chat template: ids equal apply_chat_template(tokenize=True) for seven models' templates",
          "[chat][hf]") {
  const std::string dir = tokenizer_dir();
  const Tokenizer tok = Tokenizer::load(dir + "/tokenizer.json");
  test::TempDir d("chat_ids");
  ojson cases = ojson::array();
  struct Ours {
    std::string name;
    ojson conv;
    bool agp;
  };
  std::vector<Ours> ours;
  for (const auto& name : model_templates())
    for (const ojson& conv : conversations())
      for (const bool agp : {false, true}) {
        cases.push_back({{"chat_template", template_source(name)}, {"messages", conv}, {"add_generation_prompt", agp}});
        ours.push_back({name, conv, agp});
      }
  test::write_file(d / "cases.json", cases.dump());
  const test::RunResult r = hf_chat("apply '" + dir + "' '" + d / "cases.json" + "' '" + d / "ref.json" + "'");
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  const ojson ref = read_json(d / "ref.json");
  REQUIRE(ref.size() == ours.size());
  int compared = 0, masked = 0;
  for (size_t k = 0; k < ours.size(); ++k) {
    const Ours& c = ours[k];
    INFO(c.name << " conversation " << c.conv.dump() << " add_generation_prompt=" << c.agp);
    // The template as a file (--chat-template FILE): the specials come from
    // tokenizer_config.json beside the tokenizer.
    const chat::ChatTemplate tmpl =
        chat::ChatTemplate::resolve(tok, dir + "/tokenizer.json", fixture_dir() + "/" + c.name + ".jinja");
    const auto msgs = to_messages(c.conv);
    TokenEncoder enc(tok);
    std::vector<uint32_t> ids;
    if (ref[k].is_object()) {
      INFO("HF: " << ref[k]["error"].get<std::string>());
      CHECK_THROWS_AS(tmpl.encode(enc, msgs, c.agp, ids, nullptr), jinja::TemplateError);
      continue;
    }
    tmpl.encode(enc, msgs, c.agp, ids, nullptr);
    CHECK(ids == ref[k].get<std::vector<uint32_t>>());
    ++compared;
    // The mask (training rows end with the assistant): same ids, and the
    // masked runs are the assistant turns: one run per reply, holding its
    // text, and no user text.
    if (c.agp || msgs.back().role != "assistant") continue;
    std::vector<uint32_t> mids;
    std::vector<uint8_t> mask;
    tmpl.encode(enc, msgs, false, mids, &mask);
    CHECK(mids == ids);
    REQUIRE(mask.size() == mids.size());
    std::vector<std::string> runs;
    std::vector<uint32_t> cur;
    for (size_t t = 0; t <= mids.size(); ++t) {
      if (t < mids.size() && mask[t]) {
        cur.push_back(mids[t]);
      } else if (!cur.empty()) {
        runs.push_back(tok.decode(cur));
        cur.clear();
      }
    }
    size_t a = 0;
    for (const auto& m : msgs) {
      if (m.role != "assistant") continue;
      REQUIRE(a < runs.size());
      std::string content = m.content;
      content.erase(0, content.find_first_not_of(" \n"));
      content.erase(content.find_last_not_of(" \n") + 1);
      CHECK_THAT(runs[a], Contains(content));
      for (const auto& u : msgs)
        if (u.role == "user") CHECK_THAT(runs[a], !Contains(u.content));
      ++a;
    }
    CHECK(runs.size() == a);
    ++masked;
  }
  CHECK(compared >= 45);
  CHECK(masked >= 12);
}

TEST_CASE("chat template: {% generation %} blocks give HF's assistant mask", "[chat][hf]") {
  const std::string dir = tokenizer_dir();
  const Tokenizer tok = Tokenizer::load(dir + "/tokenizer.json");
  test::TempDir d("chat_gen");
  const std::string src =
      "{% for message in messages %}{% if message['role'] == 'assistant' %}{{ '<|im_start|>assistant\\n' }}"
      "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\\n' }}"
      "{% else %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{% endif %}"
      "{% endfor %}";
  ojson cases = ojson::array();
  for (const ojson& conv : conversations())
    cases.push_back({{"chat_template", src}, {"messages", conv}, {"add_generation_prompt", false}, {"assistant_mask", true}});
  test::write_file(d / "cases.json", cases.dump());
  test::write_file(d / "gen.jinja", src);
  const test::RunResult r = hf_chat("apply '" + dir + "' '" + d / "cases.json" + "' '" + d / "ref.json" + "'");
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  const ojson ref = read_json(d / "ref.json");
  const chat::ChatTemplate tmpl = chat::ChatTemplate::resolve(tok, dir + "/tokenizer.json", d / "gen.jinja");
  int with_targets = 0;
  for (size_t k = 0; k < cases.size(); ++k) {
    INFO(cases[k]["messages"].dump());
    TokenEncoder enc(tok);
    std::vector<uint32_t> ids;
    std::vector<uint8_t> mask;
    tmpl.encode(enc, to_messages(cases[k]["messages"]), false, ids, &mask);
    CHECK(ids == ref[k]["ids"].get<std::vector<uint32_t>>());
    CHECK(std::vector<int>(mask.begin(), mask.end()) == ref[k]["mask"].get<std::vector<int>>());
    with_targets += std::count(mask.begin(), mask.end(), 1) > 0;
  }
  CHECK(with_targets == 4);
}

TEST_CASE("chat template: the model's template is found beside its tokenizer, built-ins, names and files override it",
          "[chat]") {
  const std::string dir = tokenizer_dir();
  const Tokenizer tok = Tokenizer::load(dir + "/tokenizer.json");
  test::TempDir d("chat_resolve");
  fs::copy_file(dir + "/tokenizer.json", d / "tokenizer.json");
  ojson config = read_json(dir + "/tokenizer_config.json");
  const std::string tj = d / "tokenizer.json";
  const std::vector<chat::Message> msgs = {{"user", "Hi"}, {"assistant", "Hello"}};

  // No chat_template: a built-in chosen by the tokenizer's special tokens (it has Llama 3's).
  test::write_file(d / "tokenizer_config.json", config.dump());
  CHECK_THAT(chat::ChatTemplate::resolve(tok, tj, "").description(), Contains("llama3 (built-in"));
  // The llama3 built-in is Meta's Llama 3.1 template, as the fixture holds it.
  CHECK(std::string(chat::builtin_template_source("llama3")) == template_source("llama3.1"));
  // A string chat_template.
  config["chat_template"] = template_source("gemma2");
  test::write_file(d / "tokenizer_config.json", config.dump());
  chat::ChatTemplate t = chat::ChatTemplate::resolve(tok, tj, "");
  CHECK_THAT(t.description(), Contains("tokenizer_config.json chat_template"));
  CHECK(t.render(msgs, true) == "<|begin_of_text|><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"
                                "Hello<end_of_turn>\n<start_of_turn>model\n");
  CHECK(t.end_of_turn(tok) == tok.special_id("<end_of_turn>"));
  // Built-ins override it; they are what the flag says.
  CHECK(chat::ChatTemplate::resolve(tok, tj, "chatml").render(msgs, false) ==
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello<|im_end|>\n");
  CHECK(chat::ChatTemplate::resolve(tok, tj, "plain").render(msgs, true) == "User: Hi\n\nAssistant: Hello\n\nAssistant: ");
  CHECK(chat::ChatTemplate::resolve(tok, tj, "chatml").end_of_turn(tok) == tok.special_id("<|im_end|>"));
  CHECK(chat::ChatTemplate::resolve(tok, tj, "plain").end_of_turn(tok) == -1);
  // Named templates: 'default', or one by name; none named default is an error listing them.
  config["chat_template"] = ojson::array({{{"name", "tool_use"}, {"template", template_source("qwen2.5")}},
                                          {{"name", "default"}, {"template", template_source("phi3")}}});
  test::write_file(d / "tokenizer_config.json", config.dump());
  CHECK(chat::ChatTemplate::resolve(tok, tj, "").render(msgs, true) == "<|user|>\nHi<|end|>\n<|assistant|>\nHello<|end|>\n<|assistant|>\n");
  CHECK_THAT(chat::ChatTemplate::resolve(tok, tj, "tool_use").render(msgs, false),
             Catch::Matchers::StartsWith("<|im_start|>system\nYou are Qwen"));
  config["chat_template"] = ojson::array({{{"name", "a"}, {"template", "x"}}, {{"name", "b"}, {"template", "y"}}});
  test::write_file(d / "tokenizer_config.json", config.dump());
  CHECK_THROWS_WITH(chat::ChatTemplate::resolve(tok, tj, ""), Contains("named chat templates a, b") && Contains("--chat-template NAME"));
  CHECK_THROWS_WITH(chat::ChatTemplate::resolve(tok, tj, "c"), Contains("'c' is not llama3, chatml, plain") && Contains("(a, b)"));
  // chat_template.jinja beside the tokenizer comes first.
  test::write_file(d / "chat_template.jinja", template_source("chatml-smollm2"));
  CHECK_THAT(chat::ChatTemplate::resolve(tok, tj, "").render(msgs, false),
             Catch::Matchers::StartsWith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM"));
  // A bad config is named.
  test::write_file(d / "tokenizer_config.json", "{\"chat_template\": 3}");
  fs::remove(d / "chat_template.jinja");
  CHECK_THROWS_WITH(chat::ChatTemplate::resolve(tok, tj, ""), Contains("tokenizer_config.json' chat_template is neither"));
}

TEST_CASE("chat template: a turn is found when earlier turns render differently as more follow", "[chat]") {
  const jinja::Value specials = jinja::Value::make_dict();
  const std::vector<chat::Message> msgs = {{"user", "hi"}, {"assistant", "yo"}, {"user", "ok"}, {"assistant", "bye"}};
  // The header counts the messages: no prefix of the whole conversation is
  // a rendered prefix, so each reply's text is found after the previous one.
  const chat::ChatTemplate count(
      "{{ messages | length }} messages\n{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}",
      "count.jinja", specials);
  const auto sp = count.assistant_spans(msgs);
  REQUIRE(sp.assistant.size() == 2);
  CHECK(sp.text.substr(sp.assistant[0].first, sp.assistant[0].second - sp.assistant[0].first) == "yo\n");
  CHECK(sp.text.substr(sp.assistant[1].first, sp.assistant[1].second - sp.assistant[1].first) == "bye\n");
  // A reply rendered differently once more follows is not in the whole text: an error naming it.
  const chat::ChatTemplate upper(
      "{% for m in messages %}{{ m.role }}: {{ m.content if loop.last else m.content | upper }}\n{% endfor %}",
      "upper.jinja", specials);
  CHECK_THROWS_WITH(upper.assistant_spans(msgs), Contains("upper.jinja: the text of assistant message 2") &&
                                                     Contains("{% generation %}"));
}

TEST_CASE("chat template: a template outside the subset or broken is an error naming line:column", "[chat][errors]") {
  struct Bad {
    std::string src, where, what;
  };
  const std::vector<Bad> bad = {
      {"ok\n{% for m in messages %}\n  {{ m | frobnicate }}\n{% endfor %}", "f.jinja:3:10:", "filter 'frobnicate'"},
      {"{% if x %}\nunclosed", "f.jinja:2:9:", "missing '{% endif %}'"},
      {"a\n\n  {% include 'other.jinja' %}", "f.jinja:3:6:", "the tag 'include' is outside"},
      {"{{ x is frob }}", "f.jinja:1:9:", "the test 'frob'"},
      {"{{ 'open }}", "f.jinja:1:4:", "unterminated string"},
      {"{% endfor %}", "f.jinja:1:4:", "no open block"},
      {"{{ 1 +* 2 }}", "f.jinja:1:7:", "expected an expression"},
      {"{{ x ! y }}", "f.jinja:1:6:", "unexpected character '!'"},
  };
  for (const auto& b : bad) {
    INFO(b.src);
    CHECK_THROWS_WITH(jinja::Template(b.src, "f.jinja"), Contains(b.where) && Contains(b.what));
  }
  // Errors while rendering name the expression too.
  CHECK_THROWS_WITH(jinja::Template("line\n{{ 'a' + 1 }}", "f.jinja").render(jinja::Value::make_dict()),
                    Contains("f.jinja:2:8:") && Contains("unsupported operand type(s) for +: 'str' and 'int'"));
  try {
    jinja::Template("{{ raise_exception('No system role') }}", "f.jinja").render(jinja::Value::make_dict());
    FAIL("no exception");
  } catch (const jinja::TemplateError& e) {
    CHECK(e.raised());
    CHECK_THAT(e.what(), Contains("f.jinja:1:4: the template raised an exception: No system role"));
  }
}

TEST_CASE("prepare --format chat: the model's template from tokenizer_config.json, HF's ids, raise_exception names the row",
          "[chat][prepare][hf]") {
  const std::string dir = tokenizer_dir();
  test::TempDir d("chat_prep");
  fs::copy_file(dir + "/tokenizer.json", d / "tokenizer.json");
  ojson config = read_json(dir + "/tokenizer_config.json");
  config["chat_template"] = template_source("qwen2.5");
  test::write_file(d / "tokenizer_config.json", config.dump());
  const Tokenizer tok = Tokenizer::load(d / "tokenizer.json");
  std::string rows;
  ojson cases = ojson::array();
  for (const ojson& conv : conversations()) {
    rows += ojson{{"messages", conv}}.dump() + "\n";
    cases.push_back({{"chat_template", template_source("qwen2.5")}, {"messages", conv}, {"add_generation_prompt", false}});
  }
  test::write_file(d / "chat.jsonl", rows);
  test::write_file(d / "cases.json", cases.dump());
  const test::RunResult ref = hf_chat("apply '" + d.path() + "' '" + d / "cases.json" + "' '" + d / "ref.json" + "'");
  INFO(ref.err);
  REQUIRE(ref.exit_code == 0);
  const test::RunResult r = test::run_trainrun("prepare --tokenizer '" + d / "tokenizer.json" + "' --format chat --input '" +
                                               d / "chat.jsonl" + "' --output '" + d / "out" + "' --val-fraction 0");
  INFO(r.out << r.err);
  REQUIRE(r.exit_code == 0);
  CHECK_THAT(r.out + r.err, Contains("chat template " + d / "tokenizer_config.json chat_template"));
  // Each conversation: the document start (Qwen's template has no BOS), then HF's ids.
  const uint32_t doc = uint32_t(chat::resolve_doc_start(tok).id);
  std::vector<uint32_t> want;
  for (const auto& ids : read_json(d / "ref.json")) {
    want.push_back(doc);
    for (const auto& x : ids) want.push_back(x.get<uint32_t>());
  }
  const std::string bin = test::read_file(d / "out/train_000000.bin");
  REQUIRE(bin.size() == 256 * 4 + want.size() * 2);
  std::vector<uint32_t> got;
  for (size_t k = 256 * 4; k < bin.size(); k += 2)
    got.push_back(uint32_t(uint8_t(bin[k])) | uint32_t(uint8_t(bin[k + 1])) << 8);
  CHECK(got == want);
  const ojson meta = read_json(d / "out/prepare.json");
  CHECK_THAT(meta["chat_template"].get<std::string>(), Contains("tokenizer_config.json chat_template"));

  // Gemma's template refuses a system turn: the error names the row and the template's message.
  config["chat_template"] = template_source("gemma2");
  test::write_file(d / "tokenizer_config.json", config.dump());
  const test::RunResult g = test::run_trainrun("prepare --tokenizer '" + d / "tokenizer.json" + "' --format chat --input '" +
                                               d / "chat.jsonl" + "' --output '" + d / "out" + "' --val-fraction 0");
  CHECK(g.exit_code != 0);
  CHECK_THAT(g.err, Contains(d / "chat.jsonl:2:") && Contains("System role not supported"));
  // A broken --chat-template file names its line and column.
  test::write_file(d / "bad.jinja", "{% for m in messages %}\n{{ m.content | nope }}{% endfor %}");
  const test::RunResult b = test::run_trainrun("prepare --tokenizer '" + d / "tokenizer.json" + "' --format chat --input '" +
                                               d / "chat.jsonl" + "' --output '" + d / "out" + "' --chat-template '" +
                                               d / "bad.jinja" + "'");
  CHECK(b.exit_code != 0);
  CHECK_THAT(b.err, Contains(d / "bad.jinja:2:16:") && Contains("filter 'nope'"));
}
