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
//  - the jobs (the references, ranks, sidecar, metrics, learning):
//    tests/test_preference_jobs.cpp.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>
#include <filesystem>
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
#include "tests/support/preference_data.h"
#include "tests/support/testutil.h"

using namespace trainrun;
using Catch::Contains;
using json = nlohmann::json;

using test::PrefPair;
using test::read_metrics;
using test::random_pairs;
using test::run_job;
using test::write_pref_dir;
using Pair = test::PrefPair;

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
  {  // A hostile header: n + 2^61 pairs wraps 16 + 24 n around to the real size.
     // It must be a clear error naming the file, not an exabyte allocation.
    std::string idx = read_bytes(d / "out/train.pairs");
    uint64_t n = 0;
    std::memcpy(&n, idx.data() + 8, 8);
    n += uint64_t(1) << 61;
    std::memcpy(&idx[8], &n, 8);
    test::write_file(d / "hostile.pairs", idx);
    CHECK_THROWS_WITH(read_pair_index(d / "hostile.pairs", ntok),
                      Contains("hostile.pairs") && Contains("truncated or changed"));
  }
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

// output.dir: `out`, else <dir>/run/new, which does not exist yet (the
// reference pass writes its sidecar there before anything else makes it).
JobSpec pref_job(const std::string& dir, const std::string& objective, bool packed, int mb,
                 const std::string& out = "") {
  JobSpec job;
  job.output.dir = out.empty() ? dir + "/run/new" : out;
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
                 const std::vector<float>& p1, const std::string& out_dir = "") {
  const GPT2Config cfg = pref_config();
  const int npairs = 3, B = packed ? npairs : 2 * npairs, T = cfg.T;
  const JobSpec job = pref_job(dir, objective, packed, B, out_dir);
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
      [&](int64_t first) {
        read(first, B);
        model.forward(u0, in.as<int32_t>(), tg.as<int32_t>(), B, T, false, 0.f, docs);
        pt.record_reference(first, B, model);
      },
      B, false);
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

TEST_CASE("preference: the whole network's gradient of dpo, ipo and orpo equals finite differences of a float64 model, "
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
    // The reference pass wrote its sidecar into output.dir, a directory that
    // did not exist before the first run (a fresh run's): it is there, whole.
    const std::string sidecar = d / "run/new/train.reference_logps";
    if (obj != "orpo") {
      REQUIRE(test::file_exists(sidecar));
      CHECK(std::filesystem::file_size(sidecar) == 40 + 6 * 8);  // header + 3 pairs x 2 sides, float64
    }
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
  // An output.dir that cannot be made (under a regular file) is an error naming it, not a crash.
  test::write_file(d / "blocker", "a file, not a directory");
  CHECK_THROWS_WITH(run_pref(d.path(), "dpo", false, p0, p1, d / "blocker/run"),
                    Contains("cannot create the directory of") && Contains("blocker/run/train.reference_logps") &&
                        Contains("check output.dir"));
}


TEST_CASE("preference: a row of exactly T + 1 tokens counts its last target in the log-prob, packed or not",
          "[preference][data]") {
  // T 12. A row per side: the chosen side is 13 tokens (its last prediction
  // at t = 11, which read_samples sets). Packed: chosen 8 + rejected 5 = 13
  // tokens in one row, the rejected side's last token the t = 11 target.
  // Every target the loss sees must belong to its sequence, and the targets
  // counted must be count_targets' (ORPO's NLL divides by that).
  const int T = 12, V = 11, B = 2;
  for (const bool packed : {false, true}) {
    INFO((packed ? "packed" : "a row per side"));
    test::TempDir d("pref_full_row");
    test::PrefPair pair;
    if (!packed) {
      pair.c = {{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 2, 3, 4}, {0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1}};
      pair.r = {{1, 2, 3, 5, 6}, {0, 0, 0, 1, 1}};
    } else {
      pair.c = {{1, 2, 3, 4, 5, 6, 7, 8}, {0, 0, 0, 1, 1, 1, 1, 1}};
      pair.r = {{1, 2, 3, 5, 4}, {0, 0, 0, 1, 1}};
    }
    test::write_pref_dir(d.path(), {pair, pair}, V);
    JobSpec job = pref_job(d.path(), "orpo", packed, B);
    job.model.vocab_size = V;
    auto src = open_preference_source(job, job.data.train, "data.train");
    std::vector<int32_t> in(size_t(B) * T), tg(size_t(B) * T), seq(size_t(B) * T);
    std::vector<int64_t> pair_ids(B);
    src->read_samples(0, B, T, in.data(), tg.data());
    src->read_segments(0, B, T, seq.data(), pair_ids.data());
    int64_t seen = 0;
    for (int i = 0; i < B * T; ++i) {
      INFO("row " << i / T << " t " << i % T << ": target " << tg[size_t(i)] << ", sequence " << seq[size_t(i)]);
      CHECK((tg[size_t(i)] >= 0) == (seq[size_t(i)] >= 0));
      seen += seq[size_t(i)] >= 0;
    }
    CHECK(tg[size_t(T - 1)] == 4);  // the row's last token is a target
    CHECK(seen == src->count_targets(0, B, T));
    // A row per side: rows 0 and 1 are pair 0's chosen (10) and rejected (2). Packed: two pairs of 5 + 2.
    CHECK(seen == (packed ? 2 * (5 + 2) : 10 + 2));
  }
}
