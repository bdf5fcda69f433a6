// Preference tuning (train.objective dpo | ipo | orpo; core/train/preference.h):
//  - the pair losses and their gradients against the published formulas
//    written in PyTorch (autograd, float64); TRL's own loss functions when
//    the venv has trl (it does not offline: said in the output);
//  - prepare --format preference: the pair index, masks on the response
//    tokens only (not the prompt's earlier assistant turns), and every kind
//    of bad row named by file:line;
//  - the whole network's gradient of each objective against central finite
//    differences of a float64 reference model (tests/support/reference_ops);
//    pairs packed into one row (document mask) equal a row per side;
//  - the jobs: the precomputed reference equals the live one (step 1 of
//    dpo is log 2 exactly; adapter_off == precompute under LoRA), 1 rank ==
//    2 and 4 ranks (and tp2), the sidecar's key, TRL's metric names in
//    metrics.jsonl, and a tiny model that learns a fixed chosen pattern.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>

#include "core/config/job_spec.h"
#include "core/data/dataset.h"
#include "core/data/document_mask.h"
#include "core/data/preference_pairs.h"
#include "core/data/tokenizer/tokenizer.h"
#include "core/model/gpt2/gpt2.h"
#include "core/train/preference.h"
#include "core/train/preference_loss.h"
#include "kernels/backend.h"
#include "parallel/comm/communicator.h"
#include "tests/support/device_io.h"
#include "tests/support/reference_ops.h"
#include "tests/support/testutil.h"

using namespace trainrun;
using Catch::Contains;
using json = nlohmann::json;

namespace {

// ---- data written directly (no tokenizer): one shard, masks, .pairs, prepare.json ----

struct Side {
  std::vector<uint32_t> tok;
  std::vector<uint8_t> mask;
};
struct Pair {
  Side c, r;
};

void write_pref_dir(const std::string& dir, const std::vector<Pair>& pairs, int vocab) {
  std::vector<uint32_t> tok;
  std::vector<uint8_t> mask;
  PairIndexWriter idx(dir + "/train.pairs");
  for (const Pair& p : pairs) {
    idx.add({int64_t(tok.size()), int64_t(p.c.tok.size()), int64_t(p.r.tok.size())});
    for (const Side* s : {&p.c, &p.r}) {
      tok.insert(tok.end(), s->tok.begin(), s->tok.end());
      mask.insert(mask.end(), s->mask.begin(), s->mask.end());
    }
  }
  idx.commit();
  write_llmc_shard(dir + "/train_000000.bin", tok, 1);
  test::write_file(dir + "/train_000000.mask", std::string(mask.begin(), mask.end()));
  uint32_t mx = 0;
  for (uint32_t t : tok) mx = std::max(mx, t);
  const json meta = {{"format", "preference"},
                     {"vocab_size", vocab},
                     {"document_start_id", 1},
                     {"shards", {{"train_000000.bin", {{"tokens", tok.size()}, {"max_token_id", mx}}}}}};
  test::write_file(dir + "/prepare.json", meta.dump());
}

// Pair i: a prompt of 1-3 tokens after the separator 1, responses of 1-3
// tokens; mask 1 on the responses. Tokens 2..V-1; sides fit `max_side`.
std::vector<Pair> random_pairs(int n, int V, uint64_t seed, int max_side) {
  std::mt19937_64 g(seed);
  auto tokn = [&] { return uint32_t(2 + g() % uint64_t(V - 2)); };
  std::vector<Pair> out;
  for (int i = 0; i < n; ++i) {
    Pair p;
    const int np = 1 + int(g() % 3);
    std::vector<uint32_t> prompt = {1};
    for (int k = 0; k < np; ++k) prompt.push_back(tokn());
    for (Side* s : {&p.c, &p.r}) {
      const int nr = 1 + int(g() % uint64_t(std::max(1, std::min(3, max_side - np - 1))));
      s->tok = prompt;
      s->mask.assign(prompt.size(), 0);
      for (int k = 0; k < nr; ++k) {
        s->tok.push_back(tokn());
        s->mask.push_back(1);
      }
    }
    out.push_back(p);
  }
  return out;
}

std::vector<std::map<std::string, double>> read_metrics(const std::string& run_dir) {
  std::vector<std::map<std::string, double>> out;
  std::ifstream f(run_dir + "/metrics.jsonl");
  std::string line;
  while (std::getline(f, line)) {
    if (line.empty()) continue;
    std::map<std::string, double> m;
    const json j = json::parse(line);  // items() of a temporary would dangle
    for (auto& [k, v] : j.items())
      if (v.is_number()) m[k] = v.get<double>();
    out.push_back(m);
  }
  return out;
}

test::RunResult run_job(const std::string& yaml_path, const std::string& sets = "") {
  return test::run_command("OMP_NUM_THREADS=1 '" + test::trainrun_binary() + "' --config '" + yaml_path + "' " + sets +
                           " 2>&1");
}

}  // namespace

TEST_CASE("preference: dpo cdpo ipo and orpo losses and gradients equal the published formulas in PyTorch",
          "[preference]") {
  test::TempDir d("preff");
  struct Case {
    PreferenceObjective obj;
    double beta, eps;
    PairLogps p;
  };
  std::vector<Case> cases;
  std::mt19937_64 g(7);
  std::uniform_real_distribution<double> u(0.02, 3.0);
  for (int i = 0; i < 40; ++i) {
    Case c;
    c.obj = std::vector<PreferenceObjective>{PreferenceObjective::Dpo, PreferenceObjective::Ipo,
                                             PreferenceObjective::Orpo}[size_t(i % 3)];
    c.beta = std::vector<double>{0.05, 0.1, 0.5, 2.0}[size_t(i % 4)];
    c.eps = c.obj == PreferenceObjective::Dpo && i % 2 ? 0.2 : 0.0;
    c.p.n_chosen = 1 + int64_t(g() % 30);
    c.p.n_rejected = 1 + int64_t(g() % 30);
    // Mean log-probs in (-3, -0.02): orpo's log(1 - e^a) needs a < 0.
    c.p.chosen = -u(g) * double(c.p.n_chosen);
    c.p.rejected = -u(g) * double(c.p.n_rejected);
    c.p.ref_chosen = -u(g) * double(c.p.n_chosen);
    c.p.ref_rejected = -u(g) * double(c.p.n_rejected);
    if (i == 3) c.p.chosen = c.p.ref_chosen + 300;  // a saturated sigmoid (|z| large): still finite
    cases.push_back(c);
  }
  json in = json::array();
  for (const Case& c : cases)
    in.push_back({{"obj", objective_name(c.obj)}, {"beta", c.beta}, {"eps", c.eps}, {"pc", c.p.chosen},
                  {"pr", c.p.rejected}, {"rc", c.p.ref_chosen}, {"rr", c.p.ref_rejected}, {"nc", c.p.n_chosen},
                  {"nr", c.p.n_rejected}});
  test::write_file(d / "in.json", in.dump());
  // The formulas as the papers / TRL's DPOTrainer.dpo_loss and
  // ORPOTrainer.odds_ratio_loss write them, differentiated by autograd.
  test::write_file(d / "ref.py", R"PY(
import json, sys
import torch
import torch.nn.functional as F
torch.set_default_dtype(torch.float64)
out = []
for c in json.load(open(sys.argv[1])):
    pc = torch.tensor(c["pc"], requires_grad=True)
    pr = torch.tensor(c["pr"], requires_grad=True)
    rc, rr, beta, eps = torch.tensor(c["rc"]), torch.tensor(c["rr"]), c["beta"], c["eps"]
    if c["obj"] == "dpo":   # TRL loss_type "sigmoid" with label_smoothing (cDPO)
        logits = (pc - pr) - (rc - rr)
        loss = -F.logsigmoid(beta * logits) * (1 - eps) - F.logsigmoid(-beta * logits) * eps
        rew = (beta * (pc - rc), beta * (pr - rr))
    elif c["obj"] == "ipo": # TRL loss_type "ipo": length-averaged log-probs
        ac, ar = pc / c["nc"], pr / c["nr"]
        logits = (ac - ar) - (rc / c["nc"] - rr / c["nr"])
        loss = (logits - 1 / (2 * beta)) ** 2
        rew = (beta * (ac - rc / c["nc"]), beta * (ar - rr / c["nr"]))
    else:                   # ORPO: odds ratio of the mean log-probs
        ac, ar = pc / c["nc"], pr / c["nr"]
        log_odds = (ac - ar) - (torch.log1p(-torch.exp(ac)) - torch.log1p(-torch.exp(ar)))
        loss = -beta * F.logsigmoid(log_odds)
        rew = (beta * ac, beta * ar)
    loss.backward()
    out.append([loss.item(), pc.grad.item(), pr.grad.item(), rew[0].item(), rew[1].item()])
try:
    import trl  # noqa: F401
    note = "trl " + trl.__version__
except Exception as e:
    note = "trl not installed (" + type(e).__name__ + "): the formulas above are the reference"
print(json.dumps({"out": out, "note": note}))
)PY");
  const auto r = test::run_command("'" + test::hf_python() + "' '" + (d / "ref.py") + "' '" + (d / "in.json") + "'");
  INFO(r.out << r.err);
  REQUIRE(r.exit_code == 0);
  const json res = json::parse(r.out);
  std::printf("  preference formulas: %s\n", res["note"].get<std::string>().c_str());
  double worst = 0;
  for (size_t i = 0; i < cases.size(); ++i) {
    const Case& c = cases[i];
    const PairLoss l = preference_pair_loss(c.obj, c.p, c.beta, c.eps);
    const auto& e = res["out"][i];
    const double got[5] = {l.loss, l.d_chosen, l.d_rejected, l.reward_chosen, l.reward_rejected};
    for (int k = 0; k < 5; ++k) {
      const double ref = e[size_t(k)].get<double>();
      const double err = std::fabs(got[k] - ref) / std::max(1e-12, std::fabs(ref));
      INFO("case " << i << " " << objective_name(c.obj) << " field " << k << ": " << got[k] << " vs " << ref);
      CHECK((err <= 1e-10 || std::fabs(got[k] - ref) <= 1e-14));
      worst = std::max(worst, std::fabs(ref) > 1e-12 ? err : 0.0);
    }
  }
  std::printf("  preference formulas: max relative error %.2e over %zu cases x (loss, 2 grads, 2 rewards)\n", worst,
              cases.size());
}

namespace {
// A byte-level BPE with Llama 3's special tokens (so its tokenizer_config.json
// carries Llama 3's chat template), trained by trainrun itself: no python.
struct TokFixture {
  test::TempDir dir{"preftok"};
  std::string tj;
  TokFixture() {
    std::string corpus;
    for (int i = 0; i < 200; ++i)
      corpus += "What is two plus two? Four. Name a color. Blue is a color. I will not answer that.\n";
    test::write_file(dir / "corpus.txt", corpus);
    const auto r = test::run_trainrun("tokenizer train --input '" + (dir / "corpus.txt") +
                                      "' --vocab-size 300 --output '" + (dir / "tok") +
                                      "' --quiet --special-tokens '<|begin_of_text|>' '<|start_header_id|>' "
                                      "'<|end_header_id|>' '<|eot_id|>' '<|end_of_text|>'");
    INFO(r.out << r.err);
    REQUIRE(r.exit_code == 0);
    tj = dir / "tok/tokenizer.json";
  }
};
TokFixture& tok_fixture() {
  static TokFixture f;
  return f;
}
std::string read_bytes(const std::string& path) { return test::read_file(path); }
}  // namespace

TEST_CASE("prepare --format preference: a pair index, both sides rendered by the template, masks on the responses only",
          "[preference][prepare]") {
  TokFixture& fx = tok_fixture();
  test::TempDir d("prefprep");
  const json rows[] = {
      {{"prompt", "What is two plus two?"}, {"chosen", "Four."}, {"rejected", "I will not answer that."}},
      // A multi-turn prompt: its own assistant turn ("Blue is a color.") is
      // context, not a target; a response as assistant messages.
      {{"prompt",
        {{{"role", "system"}, {"content", "Be terse."}},
         {{"role", "user"}, {"content", "Name a color."}},
         {{"role", "assistant"}, {"content", "Blue is a color."}},
         {{"role", "user"}, {"content", "Another?"}}}},
       {"chosen", {{{"role", "assistant"}, {"content", "Blue."}}}},
       {"rejected", "Four."}},
  };
  std::string lines;
  for (const auto& r : rows) lines += r.dump() + "\n\n";  // blank lines are skipped
  test::write_file(d / "pairs.jsonl", lines);
  const auto r = test::run_trainrun("prepare --tokenizer '" + fx.tj + "' --format preference --input '" +
                                    (d / "pairs.jsonl") + "' --output '" + (d / "out") + "' --val-fraction 0");
  INFO(r.out << r.err);
  REQUIRE(r.exit_code == 0);
  CHECK_THAT(r.out, Contains("2 train / 0 val pairs (.pairs)"));
  const json meta = json::parse(test::read_file(d / "out/prepare.json"));
  CHECK(meta["format"] == "preference");
  CHECK(meta["pairs"]["train"] == 2);

  const Tokenizer tok = Tokenizer::load(fx.tj);
  const std::string bin = read_bytes(d / "out/train_000000.bin"), mask = read_bytes(d / "out/train_000000.mask");
  const int64_t ntok = int64_t(mask.size());
  REQUIRE(int64_t(bin.size()) == 1024 + 2 * ntok);
  const auto pairs = read_pair_index(d / "out/train.pairs", ntok);
  REQUIRE(pairs.size() == 2);
  CHECK(pairs[0][0] == 0);
  CHECK(pairs[1][0] == pairs[0][0] + pairs[0][1] + pairs[0][2]);  // back to back
  CHECK(pairs[1][0] + pairs[1][1] + pairs[1][2] == ntok);
  auto side = [&](size_t p, int s, bool masked_only) {
    const int64_t off = s == 0 ? pairs[p][0] : pairs[p][0] + pairs[p][1], n = pairs[p][1 + s];
    std::vector<uint32_t> ids;
    for (int64_t i = off; i < off + n; ++i) {
      uint16_t t;
      std::memcpy(&t, bin.data() + 1024 + 2 * i, 2);
      if (!masked_only || mask[size_t(i)]) ids.push_back(t);
    }
    return ids;
  };
  // The document start: <|end_of_text|> (this tokenizer adds no BOS).
  const uint32_t bos = uint32_t(tok.token_id("<|end_of_text|>"));
  for (size_t p = 0; p < 2; ++p)
    for (int s = 0; s < 2; ++s) {
      INFO("pair " << p << " side " << s);
      CHECK(side(p, s, false)[0] == bos);  // each side is a document of its own
    }
  // The targets are exactly each response and the template's end of turn.
  CHECK(tok.decode(side(0, 0, true)) == "Four.<|eot_id|>");
  CHECK(tok.decode(side(0, 1, true)) == "I will not answer that.<|eot_id|>");
  CHECK(tok.decode(side(1, 0, true)) == "Blue.<|eot_id|>");
  CHECK(tok.decode(side(1, 1, true)) == "Four.<|eot_id|>");
  // The whole side is the template's rendering, the prompt's assistant turn included.
  const std::string whole = tok.decode(side(1, 0, false));
  CHECK_THAT(whole, Contains("Be terse.") && Contains("<|start_header_id|>assistant<|end_header_id|>\n\nBlue is a color."
                                                       "<|eot_id|>") && Contains("Another?"));

  // A later chat run in the same directory leaves no stale pair index.
  test::write_file(d / "chat.jsonl", json{{"messages", {{{"role", "user"}, {"content", "a"}},
                                                        {{"role", "assistant"}, {"content", "b"}}}}}.dump() + "\n");
  const auto c = test::run_trainrun("prepare --tokenizer '" + fx.tj + "' --format chat --input '" + (d / "chat.jsonl") +
                                    "' --output '" + (d / "out") + "' --val-fraction 0");
  INFO(c.out << c.err);
  REQUIRE(c.exit_code == 0);
  CHECK_FALSE(test::file_exists(d / "out/train.pairs"));
}

TEST_CASE("prepare --format preference: every kind of bad row names file:line, and nothing is written",
          "[preference][prepare]") {
  TokFixture& fx = tok_fixture();
  test::TempDir d("prefbad");
  const std::string good = R"({"prompt": "a", "chosen": "b", "rejected": "c"})";
  struct Bad {
    std::string row, what;
  };
  const std::vector<Bad> bad = {
      {"{\"prompt\": \"a\", \"chosen\": \"b\"", "invalid JSON"},
      {"[1, 2]", "expected a JSON object, got array"},
      {R"({"chosen": "b", "rejected": "c"})", "missing \"prompt\""},
      {R"({"prompt": "a", "rejected": "c"})", "missing \"chosen\""},
      {R"({"prompt": "a", "chosen": "b"})", "missing \"rejected\""},
      {R"({"prompt": 3, "chosen": "b", "rejected": "c"})", "\"prompt\" is neither a string nor a non-empty array"},
      {R"({"prompt": [], "chosen": "b", "rejected": "c"})", "\"prompt\" is neither a string nor a non-empty array"},
      {R"({"prompt": [{"role": "bot", "content": "x"}], "chosen": "b", "rejected": "c"})",
       "prompt[0]: unknown role \"bot\""},
      {R"({"prompt": [{"role": "user"}], "chosen": "b", "rejected": "c"})", "prompt[0]: missing \"content\""},
      {R"({"prompt": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}], "chosen": "b", "rejected": "c"})",
       "prompt: the last message is \"assistant\""},
      {R"({"prompt": "a", "chosen": {"text": "b"}, "rejected": "c"})", "\"chosen\" is neither a string nor a non-empty array"},
      {R"({"prompt": "a", "chosen": "b", "rejected": 7})", "\"rejected\" is neither a string nor a non-empty array"},
      {R"({"prompt": "a", "chosen": [{"role": "user", "content": "b"}], "rejected": "c"})",
       "chosen[0]: role \"user\"; a response holds assistant messages only"},
      {R"({"prompt": "a", "chosen": "b", "rejected": [{"role": "assistant"}]})", "rejected[0]: missing \"content\""},
      {R"({"prompt": "a", "chosen": "b", "rejected": ["c"]})", "rejected[0]: not an object"},
      {"{\"prompt\": \"a\xff\", \"chosen\": \"b\", \"rejected\": \"c\"}", "not valid UTF-8"},
  };
  for (const Bad& b : bad) {
    // Two good rows, then the bad one on line 3.
    test::write_file(d / "x.jsonl", good + "\n" + good + "\n" + b.row + "\n");
    const auto r = test::run_trainrun("prepare --tokenizer '" + fx.tj + "' --format preference --input '" +
                                      (d / "x.jsonl") + "' --output '" + (d / "out") + "' --val-fraction 0");
    INFO(b.row << "\n" << r.out << r.err);
    CHECK(r.exit_code == 1);
    CHECK_THAT(r.err, Contains("x.jsonl:3: ") && Contains(b.what));
    CHECK_FALSE(test::file_exists(d / "out/train.pairs"));
    CHECK_FALSE(test::file_exists(d / "out/train_000000.bin"));
  }
  test::write_file(d / "x.jsonl", good + "\n");
  const auto t = test::run_trainrun("prepare --tokenizer '" + fx.tj + "' --format preference --train-on-input --input '" +
                                    (d / "x.jsonl") + "' --output '" + (d / "out") + "'");
  CHECK(t.exit_code == 1);
  CHECK_THAT(t.err, Contains("--train-on-input") && Contains("responses only"));
}

namespace {

// One micro-batch of the preference path on a tiny GPT-2 (V 11, T 12):
// the reference table from `p0` (train.reference precompute), then the
// policy `p1`'s forward + weights + backward, as the trainer runs them.
struct PrefRun {
  double loss = 0;
  std::vector<std::pair<std::string, double>> metrics;
  std::vector<float> grads;
  std::vector<double> ref_table;
  std::vector<int32_t> inputs, targets, seq;  // host, the micro-batch's rows
};

GPT2Config pref_config() { return GPT2Config::of(2, 2, 8, 11, 12, 0.3); }

JobSpec pref_job(const std::string& dir, const std::string& objective, bool packed, int mb) {
  JobSpec job;
  job.data.format = "llmc";
  job.data.train = dir + "/train_*.bin";
  job.data.document_mask = packed ? "true" : "false";
  job.model.vocab_size = 11;
  job.model.seq_len = 12;
  job.train.objective = objective;
  job.train.dpo_beta = 0.5;
  job.train.dpo_label_smoothing = objective == "dpo" ? 0.1 : 0.0;
  job.train.micro_batch_size = mb;
  job.train.reference = "precompute";
  return job;
}

PrefRun run_pref(const std::string& dir, const std::string& objective, bool packed, const std::vector<float>& p0,
                 const std::vector<float>& p1) {
  const GPT2Config cfg = pref_config();
  const int npairs = 3, B = packed ? npairs : 2 * npairs, T = cfg.T;
  const JobSpec job = pref_job(dir, objective, packed, B);
  auto be = make_cpu_backend(2);
  auto src = open_preference_source(job, job.data.train, "data.train");
  REQUIRE(src->num_pairs() == npairs);
  GPT2 model(cfg, be.get(), B, false);
  const ParamLayout& lay = model.layout();
  DeviceBuffer g(be.get(), size_t(lay.total) * 4);
  be->zero(g.get(), g.bytes());
  auto comm = make_single_communicator();
  PreferenceTraining::Setup s;
  s.job = &job;
  s.be = be.get();
  s.net = &model;
  s.src = src.get();
  s.world = comm.get();
  s.mb = B;
  s.T = T;
  PreferenceTraining pt(s);
  PrefRun out;
  out.inputs.resize(size_t(B) * T);
  out.targets.resize(size_t(B) * T);
  std::vector<int32_t> ds(size_t(B) * T), pos(size_t(B) * T);
  DeviceBuffer in(be.get(), ds.size() * 4), tg(be.get(), ds.size() * 4), dds(be.get(), ds.size() * 4),
      dpos(be.get(), ds.size() * 4);
  auto read = [&](int64_t first, int b) {
    src->read_samples(first, b, T, out.inputs.data(), out.targets.data());
    be->copy_to_device(in.get(), out.inputs.data(), size_t(b) * T * 4);
    be->copy_to_device(tg.get(), out.targets.data(), size_t(b) * T * 4);
    document_offsets(out.inputs.data(), b, T, 1, ds.data(), pos.data());
    be->copy_to_device(dds.get(), ds.data(), size_t(b) * T * 4);
    be->copy_to_device(dpos.get(), pos.data(), size_t(b) * T * 4);
  };
  const DocumentMask docs = packed ? DocumentMask{dds.as<int32_t>(), dpos.as<int32_t>()} : DocumentMask{};
  DeviceBuffer w0 = test::upload_act(be.get(), p0), w1 = test::upload_act(be.get(), p1);
  FlatUnitAccess u0(lay, w0.get(), g.as<float>(), be->act_dtype()), u1(lay, w1.get(), g.as<float>(), be->act_dtype());
  std::error_code ec;
  std::filesystem::remove(pt.sidecar_path(), ec);  // computed here, not read from another case
  pt.prepare_reference(
      [&](int64_t first, int b) {
        read(first, b);
        model.forward(u0, in.as<int32_t>(), tg.as<int32_t>(), b, T, false, 0.f, docs);
      },
      false);
  out.ref_table = pt.reference_table();
  be->zero(g.get(), g.bytes());
  pt.begin_step(0, B);
  read(0, B);
  pt.micro_batch(
      0, B, [] { FAIL("no live reference with precompute"); },
      [&] { model.forward(u1, in.as<int32_t>(), tg.as<int32_t>(), B, T, true, 1.0f, docs); });
  model.backward(u1);
  std::vector<float> v(1, 0.f);
  pt.push_sums(v);
  out.loss = pt.pop_sums(v);
  out.metrics = pt.metrics();
  out.grads = test::download_f32(be.get(), g.get(), size_t(lay.total));
  out.seq.resize(size_t(B) * T);
  std::vector<int64_t> ids(static_cast<size_t>(B), 0);
  src->read_segments(0, B, T, out.seq.data(), ids.data());
  return out;
}

// The objective on float64 log-probs of the reference model (unpacked rows).
double ref_objective(const std::string& objective, const GPT2Config& cfg, const ref::Vec& params, const PrefRun& r,
                     int B, double beta, double eps) {
  const int T = cfg.T, V = cfg.V;
  const ref::Vec logits = ref::gpt2_logits(cfg, params, ref::Tokens(r.inputs.begin(), r.inputs.end()), B, T);
  const ref::Vec nll = ref::cross_entropy(logits, ref::Tokens(r.targets.begin(), r.targets.end()), B * T, V);
  std::vector<double> lp(size_t(B), 0.0), n(size_t(B), 0.0);
  for (int i = 0; i < B * T; ++i)
    if (r.seq[size_t(i)] >= 0) {
      lp[size_t(r.seq[size_t(i)])] -= nll[size_t(i)];
      n[size_t(r.seq[size_t(i)])] += 1;
    }
  const int P = B / 2;
  double loss = 0, nll_c = 0, ntok_c = 0;
  auto ls = [](double x) { return x >= 0 ? -std::log1p(std::exp(-x)) : x - std::log1p(std::exp(x)); };
  for (int i = 0; i < P; ++i) {
    const bool has_ref = !r.ref_table.empty();  // orpo has none
    const double pc = lp[size_t(2 * i)], pr = lp[size_t(2 * i + 1)], rc = has_ref ? r.ref_table[size_t(2 * i)] : 0.0,
                 rr = has_ref ? r.ref_table[size_t(2 * i + 1)] : 0.0, nc = n[size_t(2 * i)], nr = n[size_t(2 * i + 1)];
    if (objective == "dpo") {
      const double z = beta * ((pc - rc) - (pr - rr));
      loss += -(1 - eps) * ls(z) - eps * ls(-z);
    } else if (objective == "ipo") {
      const double h = (pc / nc - rc / nc) - (pr / nr - rr / nr) - 1 / (2 * beta);
      loss += h * h;
    } else {
      const double ac = pc / nc, ar = pr / nr;
      loss += -beta * ls((ac - ar) - (std::log(1 - std::exp(ac)) - std::log(1 - std::exp(ar))));
      nll_c += -pc;
      ntok_c += nc;
    }
  }
  return loss / P + (objective == "orpo" ? nll_c / ntok_c : 0.0);
}

}  // namespace

TEST_CASE("preference: the whole network's gradient of dpo, ipo and orpo equals finite differences of a float64 model; "
          "packed pairs equal a row per side",
          "[preference][grad]") {
  test::TempDir d("prefgrad");
  const GPT2Config cfg = pref_config();
  write_pref_dir(d.path(), random_pairs(3, cfg.V, 11, 6), cfg.V);
  const ParamLayout lay = make_gpt2_layout(cfg);
  std::vector<float> p0(size_t(lay.total)), p1;
  gpt2_init_params(cfg, lay, 1234, 0, lay.total, p0.data());
  p1 = p0;
  std::mt19937_64 g(5);
  std::normal_distribution<double> nd(0.0, 0.1);
  for (float& x : p1) x += float(nd(g));  // the policy has moved away from the reference
  for (const std::string obj : {"dpo", "ipo", "orpo"}) {
    const PrefRun un = run_pref(d.path(), obj, false, p0, p1);
    const PrefRun pk = run_pref(d.path(), obj, true, p0, p1);
    // The reference table is the float64 model's log-probs at p0.
    const ref::Vec dp0(p0.begin(), p0.end());
    ref::Vec dp1(p1.begin(), p1.end());
    if (obj == "orpo") {
      CHECK(un.ref_table.empty());  // no reference pass at all
    } else {
      const ref::Vec logits = ref::gpt2_logits(cfg, dp0, ref::Tokens(un.inputs.begin(), un.inputs.end()), 6, cfg.T);
      const ref::Vec nll = ref::cross_entropy(logits, ref::Tokens(un.targets.begin(), un.targets.end()), 6 * cfg.T, cfg.V);
      std::vector<double> lp(6, 0.0);
      for (int i = 0; i < 6 * cfg.T; ++i)
        if (un.seq[size_t(i)] >= 0) lp[size_t(un.seq[size_t(i)])] -= nll[size_t(i)];
      INFO(obj);
      CHECK(ref::rel_err(un.ref_table, lp) < 1e-5);
      CHECK(ref::rel_err(pk.ref_table, lp) < 1e-5);
    }
    const double beta = 0.5, eps = obj == "dpo" ? 0.1 : 0.0;
    const double want = ref_objective(obj, cfg, dp1, un, 6, beta, eps);
    const ref::Vec fd = ref::central_fd(dp1, [&] { return ref_objective(obj, cfg, dp1, un, 6, beta, eps); });
    const double e_loss = std::fabs(un.loss - want) / std::fabs(want);
    const double e_grad = ref::rel_err(ref::Vec(un.grads.begin(), un.grads.end()), fd);
    const double e_pk_loss = std::fabs(pk.loss - un.loss) / std::fabs(un.loss);
    const double e_pk_grad = ref::rel_err(ref::Vec(pk.grads.begin(), pk.grads.end()),
                                          ref::Vec(un.grads.begin(), un.grads.end()));
    std::printf("  %s: loss %.6f (float64 model %.6f, rel %.1e), gradient vs finite differences rel %.2e over %lld "
                "parameters; packed vs unpacked: loss rel %.1e, gradient rel %.1e\n",
                obj.c_str(), un.loss, want, e_loss, e_grad, (long long)lay.total, e_pk_loss, e_pk_grad);
    INFO(obj);
    CHECK(e_loss < 1e-5);
    CHECK(e_grad < 1e-4);
    CHECK(e_pk_loss < 1e-5);
    CHECK(e_pk_grad < 1e-5);
    for (size_t k = 0; k < un.metrics.size(); ++k) {
      INFO(un.metrics[k].first);
      CHECK(pk.metrics[k].first == un.metrics[k].first);
      CHECK(std::fabs(pk.metrics[k].second - un.metrics[k].second) <= 1e-5 * (1 + std::fabs(un.metrics[k].second)));
    }
  }
}

namespace {
// A 16-pair data set and a tiny GPT-2 job on it; `extra` YAML lines appended.
struct JobDir {
  test::TempDir d{"prefjob"};
  JobDir() {
    std::filesystem::create_directories(d / "data");
    write_pref_dir(d / "data", random_pairs(16, 32, 3, 8), 32);
  }
  std::string yaml(const std::string& run, const std::string& extra) const {
    const std::string path = d / (run + ".yaml");
    test::write_file(path, "model: {arch: gpt2, n_layer: 2, n_head: 2, n_embd: 32, vocab_size: 32, seq_len: 16}\n"
                           "data: {format: llmc, train: '" + (d / "data") + "/train_*.bin'}\n"
                           "train: {objective: dpo, dpo_beta: 0.1, global_batch_size: 32, micro_batch_size: 8, "
                           "max_steps: 3, lr: 1.0e-2, warmup_steps: 0, log_interval: 1, eval_interval: 0, "
                           "grad_clip: 0}\n"
                           "output: {dir: '" + (d / run) + "', sample_tokens: 0}\n" + extra);
    return path;
  }
};

void check_same(const std::vector<std::map<std::string, double>>& a, const std::vector<std::map<std::string, double>>& b,
                const std::string& what) {
  REQUIRE(a.size() == b.size());
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i)
    for (const char* k : {"loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies",
                          "logps/chosen", "logps/rejected", "grad_norm"}) {
      // At z = 0 (step 1: policy == reference) a pair's "chosen reward >
      // rejected reward" compares rounding noise (TP's sums differ in the
      // last bits): the share is not a figure to compare there.
      if (std::string(k) == "rewards/accuracies" && std::fabs(b[i].at("rewards/margins")) < 1e-6) continue;
      INFO(what << " step " << i + 1 << " " << k << ": " << a[i].at(k) << " vs " << b[i].at(k));
      const double e = std::fabs(a[i].at(k) - b[i].at(k)) / (1e-3 + std::fabs(b[i].at(k)));
      CHECK(e <= 2e-5);
      worst = std::max(worst, e);
    }
  std::printf("  %s: %zu steps, max relative difference %.1e\n", what.c_str(), a.size(), worst);
}
}  // namespace

TEST_CASE("preference jobs: TRL's metric names, step 1 is log 2 (precomputed == live reference), 1 rank == 2 and 4 "
          "ranks, sharding strategies and tp2; the sidecar is reused, recomputed, or refused on resume",
          "[preference][train]") {
  JobDir j;
  auto run = [&](const std::string& name, const std::string& extra, const std::string& sets = "") {
    const auto r = run_job(j.yaml(name, extra), sets);
    INFO(r.out);
    REQUIRE(r.exit_code == 0);
    return std::make_pair(read_metrics(j.d / name), r.out);
  };
  const auto [one, log1] = run("r1", "parallel: {nproc_per_node: 1}\n");
  CHECK_THAT(log1, Contains("reference: computing 16 pairs' log-probs") && Contains("it does not exist"));
  REQUIRE(one.size() == 3);
  for (const char* k : {"rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
                        "logps/rejected"})
    CHECK(one[0].count(k) == 1);
  // Step 1: the policy is the starting weights, which the precomputed
  // reference was made from: z = 0, loss log 2, rewards 0.
  CHECK(std::fabs(one[0].at("loss") - std::log(2.0)) < 1e-6);
  CHECK(std::fabs(one[0].at("rewards/chosen")) < 1e-6);
  CHECK(std::fabs(one[0].at("rewards/margins")) < 1e-6);
  CHECK(one[2].at("loss") < one[0].at("loss"));  // it trains
  // TensorBoard has the same names.
  std::string tb;
  for (const auto& e : std::filesystem::directory_iterator(j.d / "r1/tb")) tb += test::read_file(e.path());
  CHECK_THAT(tb, Contains("rewards/accuracies") && Contains("logps/rejected"));

  // The sidecar is read back when data and model match...
  const std::string sidecar = j.d / "data/train.reference_logps";
  REQUIRE(test::file_exists(sidecar));
  const auto [again, log2] = run("r1b", "parallel: {nproc_per_node: 1}\n");
  CHECK_THAT(log2, Contains("reference: 16 pairs' log-probs from " + sidecar));
  check_same(again, one, "sidecar read back vs computed");
  // ... and recomputed, saying why, for another model (here: another seed).
  const auto r = run_job(j.yaml("r1d", "parallel: {nproc_per_node: 1}\n"), "--set train.seed=7");
  INFO(r.out);
  REQUIRE(r.exit_code == 0);
  CHECK_THAT(r.out, Contains("reference: computing") && Contains("it was made for data") && Contains("this job has"));

  const std::string mb2 = "--set train.micro_batch_size=2", mb4 = "--set train.micro_batch_size=4";
  check_same(run("r1m2", "parallel: {nproc_per_node: 1}\n", mb2).first, one, "1 rank, 4 micro-batches vs 1");
  // 2 and 4 ranks compute the reference themselves (each its share of the pairs).
  std::filesystem::remove(sidecar);
  const auto [two, log_two] = run("r2", "parallel: {nproc_per_node: 2}\n", mb4);
  CHECK_THAT(log_two, Contains("reference: computing 16 pairs"));
  check_same(two, one, "2 ranks full_shard");
  std::filesystem::remove(sidecar);
  check_same(run("r4", "parallel: {nproc_per_node: 4}\n", mb2).first, one, "4 ranks full_shard");
  check_same(run("r2ns", "parallel: {nproc_per_node: 2, sharding: no_shard}\n", mb4).first, one, "2 ranks no_shard");
  check_same(run("tp2", "parallel: {nproc_per_node: 2, tensor_parallel: 2}\n").first, one, "tp2");

  // A resumed run must not recompute the reference from trained weights.
  const std::string y = j.yaml("res", "parallel: {nproc_per_node: 1}\ncheckpoint: {interval: 1}\n");
  auto first = run_job(y, "--set train.exit_interval=2");
  INFO(first.out);
  REQUIRE(first.exit_code == 0);
  const std::string kept = test::read_file(sidecar);
  std::filesystem::remove(sidecar);
  const auto resumed = run_job(y, "--set train.exit_interval=2 --set launcher.max_restarts=0");
  INFO(resumed.out);
  CHECK(resumed.exit_code != 0);
  CHECK_THAT(resumed.out, Contains("train.reference precompute: resuming") && Contains(sidecar) &&
                              Contains("it does not exist") && Contains("starting weights"));
  // With the file back, the resumed run reads it and continues the run
  // exactly: its step 3 is the uninterrupted run's.
  test::write_file(sidecar, kept);
  const auto ok = run_job(y, "--set launcher.max_restarts=0");
  INFO(ok.out);
  REQUIRE(ok.exit_code == 0);
  CHECK_THAT(ok.out, Contains("reference: 16 pairs' log-probs from"));
  const auto res = read_metrics(j.d / "res");
  REQUIRE(res.size() == 3);
  check_same({res[2]}, {one[2]}, "resumed at step 2 vs uninterrupted, step 3");
}

TEST_CASE("preference jobs under LoRA: the adapters-off reference equals the precomputed one, step by step; ipo and "
          "orpo train", "[preference][train]") {
  JobDir j;
  const std::string lora = "parallel: {nproc_per_node: 1}\n";
  auto run = [&](const std::string& name, const std::string& sets) {
    const auto r = run_job(j.yaml(name, lora), "--set model.adapter.type=lora --set model.adapter.rank=4 " + sets);
    INFO(r.out);
    REQUIRE(r.exit_code == 0);
    return std::make_pair(read_metrics(j.d / name), r.out);
  };
  // LoRA's B starts at zero: the adapters-off network is the starting
  // policy, which the precompute pass ran; every step's reference is equal.
  const auto [pre, log_pre] = run("pre", "--set train.reference=precompute");
  const auto [off, log_off] = run("off", "--set train.reference=adapter_off");
  CHECK_THAT(log_pre, Contains("reference: computing 16 pairs"));
  CHECK_THAT(log_off, !Contains("reference: computing"));
  check_same(off, pre, "adapter_off vs precompute (LoRA)");
  CHECK(std::fabs(off[0].at("loss") - std::log(2.0)) < 1e-6);
  CHECK(off[2].at("loss") < off[0].at("loss"));
  // dp2 with the live reference.
  const auto r2 = run_job(j.yaml("off2", "parallel: {nproc_per_node: 2}\n"),
                          "--set model.adapter.type=lora --set model.adapter.rank=4 --set train.reference=adapter_off "
                          "--set train.micro_batch_size=4");
  INFO(r2.out);
  REQUIRE(r2.exit_code == 0);
  check_same(read_metrics(j.d / "off2"), off, "adapter_off: 2 ranks vs 1");

  // DoRA (its magnitudes start at ||W||) and QLoRA (the reference is the
  // NF4 base): the adapters-off reference is the starting policy too.
  for (const std::string sets : {std::string("--set model.adapter.type=dora"), std::string("--set model.base_dtype=nf4")}) {
    const bool dora = sets.find("dora") != std::string::npos;
    const auto [m, log] = run(dora ? "dora" : "qlora", "--set train.reference=adapter_off " + sets);
    INFO(sets);
    CHECK_THAT(log, Contains(dora ? "adapter: dora" : "frozen nf4"));
    REQUIRE(m.size() == 3);
    CHECK(std::fabs(m[0].at("loss") - std::log(2.0)) < 1e-5);
    CHECK(m[2].at("loss") < m[0].at("loss"));
  }
  for (const std::string obj : {"ipo", "orpo"}) {
    const auto m = run(obj, "--set train.objective=" + obj).first;
    INFO(obj);
    REQUIRE(m.size() == 3);
    CHECK(m[2].at("loss") < m[0].at("loss"));
    if (obj == "orpo") CHECK(m[0].count("nll_loss") == 1);
  }
}

TEST_CASE("preference: a tiny model learns that the chosen answer is one fixed pattern (rewards/accuracies > 0.9)",
          "[preference][train]") {
  test::TempDir d("preflearn");
  std::filesystem::create_directories(d / "data");
  // Prompts of random tokens; the chosen answer is always 5 6 7 8, the
  // rejected one four random tokens (never that pattern).
  std::mt19937_64 g(17);
  std::vector<Pair> pairs;
  for (int i = 0; i < 64; ++i) {
    Pair p;
    std::vector<uint32_t> prompt = {1};
    for (int k = 0; k < 3; ++k) prompt.push_back(uint32_t(9 + g() % 7));
    p.c.tok = p.r.tok = prompt;
    p.c.mask = p.r.mask = std::vector<uint8_t>(prompt.size(), 0);
    for (uint32_t t : {5u, 6u, 7u, 8u}) p.c.tok.push_back(t);
    for (int k = 0; k < 4; ++k) p.r.tok.push_back(uint32_t(2 + g() % 14));
    if (p.r.tok[4] == 5) p.r.tok[4] = 4;
    p.c.mask.resize(p.c.tok.size(), 1);
    p.r.mask.resize(p.r.tok.size(), 1);
    pairs.push_back(p);
  }
  write_pref_dir(d / "data", pairs, 16);
  test::write_file(d / "job.yaml", "model: {arch: gpt2, n_layer: 1, n_head: 2, n_embd: 32, vocab_size: 16, seq_len: 16}\n"
                                   "data: {format: llmc, train: '" + (d / "data") + "/train_*.bin', document_mask: true}\n"
                                   "train: {objective: dpo, dpo_beta: 0.1, global_batch_size: 16, micro_batch_size: 16, "
                                   "max_steps: 60, lr: 3.0e-3, warmup_steps: 5, log_interval: 5, eval_interval: 0}\n"
                                   "output: {dir: '" + (d / "run") + "', sample_tokens: 0}\n"
                                   "parallel: {nproc_per_node: 1}\n");
  const auto r = run_job(d / "job.yaml");
  INFO(r.out);
  REQUIRE(r.exit_code == 0);
  const auto m = read_metrics(d / "run");
  REQUIRE(m.size() >= 3);
  const double first = m.front().at("rewards/accuracies"), last = m.back().at("rewards/accuracies");
  std::printf("  learning: rewards/accuracies %.3f at step %g -> %.3f at step %g; margins %.3f; loss %.4f -> %.4f\n",
              first, m.front().at("step"), last, m.back().at("step"), m.back().at("rewards/margins"),
              m.front().at("loss"), m.back().at("loss"));
  CHECK(last > 0.9);
  CHECK(m.back().at("rewards/margins") > 0);
  CHECK(m.back().at("loss") < 0.9 * std::log(2.0));
}

TEST_CASE("preference: what a preference job cannot do is refused by name", "[preference][errors]") {
  JobDir j;
  const std::string y = j.yaml("bad", "parallel: {nproc_per_node: 1}\nlauncher: {max_restarts: 0}\n");
  struct Bad {
    std::string sets, what;
  };
  const std::vector<Bad> bad = {
      {"--set train.reference=adapter_off", "train.reference adapter_off needs model.adapter"},
      {"--set train.micro_batch_size=1", "train.micro_batch_size 1 is odd"},
      {"--set train.objective=ipo --set train.dpo_label_smoothing=0.1", "train.dpo_label_smoothing: 0.1 is for dpo"},
      {"--set parallel.nproc_per_node=2 --set parallel.pipeline_parallel=2 --set train.micro_batch_size=4",
       "parallel.pipeline_parallel 2 is not supported yet"},
      {"--set data.val=" + (j.d / "data") + "/train_000000.bin", "with data.val"},
      {"--set train.objective=sft", "holds preference pairs (prepare --format preference) and train.objective is sft"},
      {"--set model.seq_len=4", "pairs do not fit a row of model.seq_len + 1 = 5 tokens"},
      {"--set data.format=synthetic", "reads preference pairs"},
      {"--set train.objective=kto", "train.objective"},
  };
  for (const Bad& b : bad) {
    const auto r = run_job(y, b.sets);
    INFO(b.sets << "\n" << r.out);
    CHECK(r.exit_code != 0);
    CHECK_THAT(r.out, Contains(b.what));
  }
  // Data that is not preference pairs: no prepare.json of that format.
  test::write_file(j.d / "data/prepare.json", json{{"format", "chat"}}.dump());
  const auto r = run_job(y);
  INFO(r.out);
  CHECK(r.exit_code != 0);
  CHECK_THAT(r.out, Contains("is not preference data") && Contains("--format preference"));
}

TEST_CASE("configs/dpo_example.yaml parses and names the preference fields", "[preference][config]") {
  const JobSpec job = load_job_spec(test::source_dir() + "/configs/dpo_example.yaml");
  CHECK(job.train.objective == "dpo");
  CHECK(job.train.reference == "adapter_off");
  CHECK(job.model.adapter.on());
  CHECK(job.train.micro_batch_size % 2 == 0);
}
