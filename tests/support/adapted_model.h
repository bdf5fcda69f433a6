// A frozen base + LoRA/DoRA adapters on the CPU backend, joined as the
// trainer's AdaptedUnitAccess joins them, and the peft cases that
// scripts/reference/peft_lora.py makes: shared by test_lora.cpp (the base
// in fp32, straight from the HF files) and test_qlora.cpp (the base through
// the frozen store in bf16 or NF4, as a training run holds it).
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/model/adapter/lora.h"
#include "core/model/model.h"
#include "kernels/backend_factory.h"
#include "parallel/comm/communicator.h"
#include "parallel/sharding/sharding.h"
#include "tests/support/testutil.h"

namespace trainrun::test {

constexpr int kB = 2, kT = 8;  // the batch every peft comparison runs

struct PeftCase {
  std::string arch, targets;
  bool dora = false;
  std::string name() const { return arch + (dora ? " dora" : ""); }
};
PeftCase llama_case(bool dora = false);
PeftCase gpt2_case(bool dora = false);
std::vector<PeftCase> all_cases();  // llama, gpt2, llama dora, gpt2 dora

float max_abs_diff(const std::vector<float>& a, const std::vector<float>& b);
// Every tensor of DIR/adapter_model.safetensors (a PEFT directory), in file order, as one vector.
std::vector<float> adapter_file(const std::string& dir);
std::vector<int32_t> tokens(int seed, int V);  // (kB * kT) deterministic token ids below V
void write_batch(const std::string& path, const std::vector<int32_t>& in, const std::vector<int32_t>& tgt);
// peft_lora.py make into tmp (base/, adapter/); base_dtype nf4 or bf16 also
// writes base_<dtype>/, the base with its weights round-tripped as trainrun
// holds them (peft_lora.py's docstring).
// layers: the base's blocks (2; the interleaved pipeline tests need 4).
void make_peft_case(const PeftCase& c, int rank, double alpha, const TempDir& tmp, const std::string& base_dtype = "",
                    int layers = 2, int kv_heads = 2);
LoraOptions options_for(const PeftCase& c, int rank, double alpha);
// peft's logits (kB, kT, V) of base_dir with the PEFT adapter adapter_dir
// (PeftModel.from_pretrained, unmerged, fp32); its batch and output files go in tmp.
std::vector<float> peft_logits(const std::string& base_dir, const std::string& adapter_dir,
                               const std::vector<int32_t>& in, const TempDir& tmp);

struct AdaptedModel {
  std::unique_ptr<ModelArch> arch;
  std::unique_ptr<Backend> be = make_cpu_backend(1);
  std::unique_ptr<LoraAdapters> ad;
  DeviceBuffer base_p, base_g, ad_p, ad_g;
  std::unique_ptr<FlatUnitAccess> base_units, ad_units;
  std::unique_ptr<Communicator> comm;        // base_dtype given: the store's (one rank)
  std::unique_ptr<ParamStore> base_store;    // base_dtype given: the frozen store holding the base
  std::unique_ptr<AdaptedUnitAccess> units;

  // The base from the HF directory base_dir; the adapter from adapter_flat
  // or else peft's files in adapter_dir. base_dtype "" : the base in fp32
  // as a flat buffer; fp32 / bf16 / nf4: in the frozen store of that
  // model.base_dtype (no_shard, one rank), loaded as model.init_from is.
  AdaptedModel(const std::string& base_dir, const LoraOptions& o, const std::vector<float>* adapter_flat,
               const std::string& adapter_dir = "", const std::string& base_dtype = "");
  std::vector<float> adapter_params() const;
  std::vector<float> logits(const std::vector<int32_t>& in, bool ckpt = false);
  // Mean loss; the adapter gradients land in ad_g.
  double loss_and_grads(const std::vector<int32_t>& in, const std::vector<int32_t>& tgt, bool ckpt = false);
  std::vector<float> adapter_grads() const;
  void set_adapter_params(const std::vector<float>& a);
  double loss(const std::vector<int32_t>& in, const std::vector<int32_t>& tgt);
};

// peft_lora.py grads on base_dir + adapter_dir against m on (in, tgt):
// logits, loss and every adapter gradient within 1e-5; each of peft's
// gradients nonzero (an all-zero one would match a broken backward too),
// and every tensor peft trains compared. Returns how many were compared.
int check_equals_peft(AdaptedModel& m, const std::string& base_dir, const std::string& adapter_dir,
                      const TempDir& tmp, const std::vector<int32_t>& in, const std::vector<int32_t>& tgt);

}  // namespace trainrun::test
