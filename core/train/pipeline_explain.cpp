// `--explain` (pipeline_explain.h).
#include "core/train/pipeline_explain.h"
#include "core/train/planner.h"

#include <algorithm>
#include <sstream>

#include "core/common/error.h"
#include "core/model/model.h"
#include "parallel/mesh/device_mesh.h"
#include "parallel/pipeline/schedule.h"
#include "parallel/pipeline/stage_plan.h"

namespace trainrun {

std::string explain_pipeline_job(const JobSpec& job, int world, int ranks_per_node) {
  const ParallelSpec& p = job.parallel;
  const int pp = p.pipeline_parallel, tp = p.tensor_parallel, v = p.pipeline_virtual_stages;
  // hybrid_shard without a group: the trainer's default (the dp ranks of a node).
  const int group = p.shard_group_size > 0 ? p.shard_group_size
                                           : default_hybrid_shard_group(ranks_per_node > 0 ? ranks_per_node : world, tp,
                                                                        world / std::max(1, tp * pp));
  const MeshDims dims = plan_mesh(world, tp, pp, p.sharding, p.sharding == "hybrid_shard" ? group : 1);
  const int mb = job.train.micro_batch_size, gb = job.train.derived_global_batch_size();
  TR_CHECK(mb > 0 && gb % (mb * dims.dp()) == 0, "train.global_batch_size (", gb,
           ") must be a multiple of train.micro_batch_size (", mb, ") x data-parallel size (", dims.dp(), ")");
  const int accum = gb / (mb * dims.dp());
  std::ostringstream o;
  o << "mesh: " << dims.describe() << " (" << world << " ranks)\n";
  if (pp == 1) {
    o << "pipeline: off (parallel.pipeline_parallel: 1); " << accum << " microbatches accumulated per step\n";
    return o.str();
  }
  auto arch = make_model_arch(ModelConfig::from_spec(job.model));
  const std::vector<int> split = split_pipeline_layers(arch->config().L, pp * v, parse_pipeline_layers(p.pipeline_layers));
  const PipelineSchedule s = make_pipeline_schedule(p.pipeline_schedule, pp, v, accum);
  check_pipeline_schedule(s);
  o << "pipeline: " << p.pipeline_schedule << ", " << accum << " microbatches (train.global_batch_size " << gb
    << " / (micro_batch_size " << mb << " x dp " << dims.dp() << "))\n";
  const DeviceMesh mesh(dims, 0);
  for (int r = 0; r < pp; ++r) {
    const PipelineStagePlan plan(arch->layout(), pp, v, r, split);
    o << "  pp rank " << r << " (global ranks";
    for (int d = 0; d < dims.dp(); ++d)
      for (int t = 0; t < tp; ++t)
        o << ' ' << mesh.rank_at(r, d / dims.dp_shard, d % dims.dp_shard, t);
    o << "):";
    for (const PipelineChunk& c : plan.chunks())
      o << " stage " << c.virtual_stage << " = layers " << c.stage.first_layer << ".."
        << c.stage.first_layer + c.stage.layers - 1 << (c.stage.first ? " + embedding" : "")
        << (c.stage.last ? " + head" : "") << (c.stage.last && plan.tied() && !c.stage.first ? " (tied: a copy of "
                                                                                           "the embedding)" : "")
        << ";";
    o << '\n';
  }
  o << explain_pipeline_schedule(s);
  const double formula = pipeline_bubble_formula(p.pipeline_schedule, pp, v, accum);
  o << "  bubble formula (p-1)/"
    << (p.pipeline_schedule == "interleaved_1f1b" ? "(v m)" : p.pipeline_schedule == "zero_bubble" ? "(3m)" : "m")
    << " relative to the ideal step: " << int(formula * 1000 + 0.5) / 10.0 << "%\n";
  return o.str();
}

}  // namespace trainrun
