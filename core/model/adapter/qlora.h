// Which of a base's tensors QLoRA holds in NF4 (model.base_dtype: nf4): as
// bitsandbytes and peft do it (transformers' replace_with_bnb_linear swaps
// every nn.Linear / Conv1D inside the blocks for a Linear4bit), the weight
// of every block linear (ModelArch::block_linears, targeted by the adapter
// or not); the embeddings, norms, biases and the LM head stay in the act
// dtype. Each weight is quantized as the (out, in) matrix of nn.Linear,
// flattened: the layout's own order (GPT-2's Conv1D weights are stored
// (in, out) in HF files; the reader transposes them, and bitsandbytes
// quantizes the transposed, nn.Linear-shaped weight too).
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "core/model/model.h"
#include "core/model/tensor_parallel.h"
#include "parallel/sharding/frozen_store.h"

namespace trainrun {

// Indices into arch.layout().tensors, in layout order.
std::vector<int> nf4_base_tensors(const ModelArch& arch);

// nf4.h's quantizer as the frozen store runs it (frozen_store.h's Nf4Codec).
std::shared_ptr<const Nf4Codec> nf4_codec();

// The base's weights as a run with model.base_dtype holds them, in place on
// whole-model fp32 weights (`generate --base-dtype`: sample as the run
// trained): nf4 = each NF4 tensor quantized whole and dequantized, as the
// frozen store's units are; bf16 = every value rounded to bf16; auto and
// fp32 = unchanged.
void round_trip_base(const ModelArch& arch, std::vector<float>& flat, const std::string& base_dtype);

// The frozen store's format for model.base_dtype (auto: fp32, the CPU
// backend's dtype) over the whole model's layout.
FrozenFormat frozen_format(const ModelArch& arch, const std::string& base_dtype);

// The same over `layout`, a part of the model that keeps its tensors'
// names and holds each of them whole (a pipeline stage's layout,
// parallel/pipeline/stage_plan.h): nf4_tensors indexes `layout`'s tensors,
// those of nf4_base_tensors it holds. Each is quantized whole, so a stage's
// tensors get the very bytes the whole model's do. A tensor-parallel
// slice cuts its (out, in) weights: the overload below.
FrozenFormat frozen_format(const ModelArch& arch, const std::string& base_dtype, const ParamLayout& layout);
// The same for a tensor-parallel rank's base (the store's layout is
// plan.local_layout()): with nf4, each NF4 tensor's slice as runs of whole
// 64-blocks of the global tensor (frozen_store.h, Nf4TpSlice) and the TP
// group's communicator for the absmax exchange. Throws an Error naming the
// tensor, its shape, the tp size and the fix when a slice is not whole
// blocks: bitsandbytes' blocks are 64 consecutive elements of the whole
// flattened (out, in) weight, and a slice that cuts one would need another
// rank's elements to quantize it (column-parallel: (out/tp) x in, and
// row-parallel: in/tp, must be multiples of 64; true of real models, e.g.
// 28672 / 8 = 56 x 64).
FrozenFormat frozen_format(const ModelArch& arch, const std::string& base_dtype, const TensorParallelPlan& plan,
                           Communicator* tp_comm);

}  // namespace trainrun
