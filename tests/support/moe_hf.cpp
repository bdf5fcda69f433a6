// A tiny MoE model on both sides (moe_hf.h).
#include "tests/support/moe_hf.h"

#include <catch2/catch.hpp>
#include <cstdio>

#include "tests/support/hf_reference.h"

namespace trainrun::test {

ModelConfig moe_config(const MoeShape &s) {
  ModelConfig c;
  c.arch = s.arch;
  c.L = s.L, c.NH = s.NH, c.NKV = s.NKV, c.C = s.C, c.F = s.F, c.V = s.V,
  c.T = s.T;
  c.head_dim = s.HD;
  c.tied = s.tied;
  c.norm_eps = s.arch == "mixtral"
                   ? 1e-5
                   : 1e-6; // MixtralConfig's and the scripts' Qwen value
  c.rope_theta = 1e6;
  c.moe.n_experts = s.E;
  c.moe.top_k = s.K;
  c.moe.aux_loss_coef = s.aux;
  if (s.arch != "mixtral") {
    c.moe.ffn = s.FE;
    c.moe.shared_ffn = s.FS;
    c.moe.norm_topk_prob = s.norm;
  }
  return c;
}

void hf_moe_random(const std::string &dir, const MoeShape &s,
                   const std::string &batch, const std::string &out_ref) {
  const auto num = [](double v) {
    char b[32];
    std::snprintf(b, sizeof b, "%g", v);
    return std::string(b);
  };
  std::string a =
      "random --out '" + dir + "' --layers " + std::to_string(s.L) +
      " --hidden " + std::to_string(s.C) + " --heads " + std::to_string(s.NH) +
      " --kv-heads " + std::to_string(s.NKV) + " --intermediate " +
      std::to_string(s.F) + " --experts " + std::to_string(s.E) + " --top-k " +
      std::to_string(s.K) + " --vocab " + std::to_string(s.V) +
      " --max-positions " + std::to_string(s.T) + " --aux-coef " + num(s.aux) +
      " --seed " + std::to_string(s.seed);
  if (s.arch != "mixtral") {
    a += " --expert-intermediate " + std::to_string(s.FE);
    if (s.norm)
      a += " --norm-topk";
  }
  if (s.arch == "qwen2_moe")
    a += " --shared-intermediate " + std::to_string(s.FS);
  if (s.arch == "qwen3_moe" && s.HD > 0)
    a += " --head-dim " + std::to_string(s.HD);
  if (s.tied)
    a += " --tie";
  if (!batch.empty())
    a += " --batch '" + batch + "' --out-ref '" + out_ref + "'";
  const RunResult r = run_reference_script("hf_" + s.arch + ".py", a);
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
}

} // namespace trainrun::test
