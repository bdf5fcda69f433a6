// A tiny mixture-of-experts model for the MoE family tests (test_mixtral,
// test_qwen2_moe, test_qwen3_moe): its shape as trainrun's ModelConfig and
// as the family's reference script (scripts/reference/hf_<arch>.py random)
// builds it in transformers, so both sides describe one model.
#pragma once
#include <string>

#include "core/model/model.h"

namespace trainrun::test {

struct MoeShape {
  std::string arch; // mixtral, qwen2_moe, qwen3_moe
  int L = 2, NH = 4, NKV = 2, C = 32, F = 40, V = 37, T = 9;
  int HD = 0;       // qwen3_moe: head_dim (0 = C / NH)
  int E = 4, K = 2; // experts, top-k
  int FE = 16;      // an expert's width (qwen; Mixtral's experts are F wide)
  int FS = 0;       // qwen2_moe: the shared expert's width
  bool tied = false,
       norm = false; // norm: norm_topk_prob (qwen; Mixtral always renormalises)
  double aux = 0.02; // router_aux_loss_coef (with output_router_logits)
  int seed = 5;      // the script's draw of every parameter
};

ModelConfig moe_config(const MoeShape &s);
// `hf_<arch>.py random` into `dir`; with `batch`, the reference pass too
// (logits, loss, gradients into `out_ref`). REQUIREs the script's success.
void hf_moe_random(const std::string &dir, const MoeShape &s,
                   const std::string &batch = "",
                   const std::string &out_ref = "");

} // namespace trainrun::test
