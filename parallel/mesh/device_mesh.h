// The device mesh: every rank's place in pp x dp_replicate x dp_shard x cp
// x tp, and one communicator per group it belongs to, built once in setup.
//
// Ranks are laid out with tp innermost (rank = (((pp * R + r) * S + s) * CP
// + c) * T + t), so a tensor-parallel group is T consecutive ranks: on one node and,
// where the agent binds local ranks to GPUs in order, one NVLink island
// (torchtitan and Megatron lay out their meshes the same way). dp is the
// data-parallel dimension the sharding strategies apply over; hybrid_shard
// splits it into dp_replicate groups of dp_shard ranks, every other
// strategy has dp_replicate = 1. cp (context parallelism,
// parallel/context/) splits each sequence over its ranks; it sits just
// outside tp so a cp group's ring stays inside a node when cp x tp fits one,
// and every cp rank holds the same parameters (dp's sharding spans it once
// the trainer uses it). A mesh without cp (cp 1) has the same ranks, groups,
// group names and descriptions as before the dimension existed.
//
// The arithmetic (MeshDims, DeviceMesh) has no communication in it, so
// that plan, topo and the tests can reason about a mesh of 8 x 1024 ranks
// without building one; MeshComms builds the communicators.
#pragma once
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "parallel/comm/communicator.h"

namespace trainrun {

// In layout order, outermost first.
enum class MeshDim { pp = 0, dp_replicate = 1, dp_shard = 2, cp = 3, tp = 4 };
constexpr int kMeshDims = 5;
const char* mesh_dim_name(MeshDim d);  // "pp", "dp_replicate", "dp_shard", "cp", "tp"

struct MeshDims {
  // cp is declared last (it sits between dp_shard and tp in the layout) so
  // that MeshDims{pp, R, S, T} still means what it did before cp existed.
  int pp = 1, dp_replicate = 1, dp_shard = 1, tp = 1, cp = 1;
  int size(MeshDim d) const;
  int dp() const { return dp_replicate * dp_shard; }
  int world() const { return pp * dp_replicate * dp_shard * cp * tp; }
  // "pp1 x dp_replicate2 x dp_shard4 x tp1"; " x cp2" before tp when cp > 1.
  std::string describe() const;
};

// The mesh a job asks for: `world` ranks, tensor_parallel x pipeline_parallel
// x context_parallel per data-parallel replica, parallel.sharding over the rest. hybrid_group:
// hybrid_shard's shard group (the ranks of a dp_shard group), already
// resolved (the spec's shard_group_size, else the topology's); ignored for
// the other strategies. Every bad combination is an Error that names the
// factors and the keys to change.
MeshDims plan_mesh(int world, int tensor_parallel, int pipeline_parallel, const std::string& sharding,
                   int hybrid_group, int context_parallel = 1);

// The parameter stores' mesh under context parallelism: every cp rank holds
// the same parameters and adds its chunks' share to their gradients, so
// the stores shard and reduce over dp x cp (torchtitan's dp_shard_cp). cp
// sits just inside dp_shard in the layout, so the ranks of (dp_shard, cp)
// are the ranks of a dp_shard of dp_shard x cp: the folded mesh is `dims`
// with cp merged into dp_shard (into dp_replicate when dp_shard is 1, i.e.
// no_shard, which then stays all replicas), and cp 1. Its dp_coord() is
// (this mesh's dp_coord) x cp + the cp coordinate. cp 1: `dims` itself.
MeshDims fold_context_parallel(const MeshDims& dims);

// hybrid_shard's shard group when parallel.shard_group_size is 0: the dp
// ranks inside one island of `island_ranks` consecutive ranks (a node, or
// the topology's NVLink island), i.e. island_ranks / tp of them, but never
// more than the dp group and always a divisor of it: with a pipeline the dp
// group is world / (tp x pp), so one node of 4 at pp2 has dp 2 and a group
// of 2 (not 4, which no dp group has). `trainrun plan` uses the same rule.
int default_hybrid_shard_group(int island_ranks, int tensor_parallel, int dp);

class DeviceMesh {
 public:
  DeviceMesh(MeshDims dims, int rank);

  const MeshDims& dims() const { return dims_; }
  int rank() const { return rank_; }
  // This rank's index along d.
  int coord(MeshDim d) const { return coord_[int(d)]; }
  // Index inside the flattened dp = dp_replicate x dp_shard (data shards).
  int dp_coord() const { return coord(MeshDim::dp_replicate) * dims_.dp_shard + coord(MeshDim::dp_shard); }
  // The global rank at these coordinates.
  int rank_at(int pp, int dp_replicate, int dp_shard, int cp, int tp) const;
  // The same in a mesh without cp (an Error when cp > 1: say which cp rank).
  int rank_at(int pp, int dp_replicate, int dp_shard, int tp) const;
  // The ranks of this rank's group along d (those that differ from it only
  // in d), in the order of d's index: this rank is at coord(d).
  std::vector<int> group_ranks(MeshDim d) const;
  // The ranks of this rank's flattened dp group (dp_replicate x dp_shard).
  std::vector<int> dp_group_ranks() const;
  // Which group along d this rank is in, as a name that is unique in the
  // job and the same on every member ("tp0", "dp_shard3"): the store prefix
  // of its communicator and the group named in collective errors.
  std::string group_name(MeshDim d) const;
  std::string dp_group_name() const;  // "dp0"

 private:
  MeshDims dims_;
  int rank_;
  int coord_[kMeshDims];
};

// ---- the resolved mesh in words (the start-of-job log, job.resolved.yaml) ----

// Every group along d, each as its ranks in d's order, groups ordered by
// their first rank: {{0,1},{2,3}} for tp at tp2 x dp2.
std::vector<std::vector<int>> mesh_groups(const MeshDims& dims, MeshDim d);
// "0->(0,0,0,0) 1->(0,0,0,1) ..." (pp, dp_replicate, dp_shard, tp; with
// cp > 1: pp, dp_replicate, dp_shard, cp, tp) for every
// rank up to `max_listed` ranks; a larger mesh lists the first and last few
// ranks around "..." and says how any rank's coordinates follow from the
// layout, so a 1024-node job logs one short line.
std::string describe_rank_coords(const MeshDims& dims, int max_listed = 16);
// The groups of every dim of size > 1, "tp [0,1] [2,3]; dp_shard [0,2] [1,3]",
// the first few of each when there are many.
std::string describe_mesh_groups(const MeshDims& dims, int max_groups = 8);
// The `resolved_mesh:` section of job.resolved.yaml (informational; the
// job spec loader checks it is a map and ignores it): degrees, the layout
// rule, and, up to `max_listed` ranks, every group and every rank's
// coordinates.
std::string resolved_mesh_yaml(const MeshDims& dims, bool sequence_parallel, int max_listed = 1024);

// Makes a communicator for one group: prefix (unique per group, ending in
// '/'), this rank's index in it, the group's size.
using GroupCommFactory =
    std::function<std::unique_ptr<Communicator>(const std::string& prefix, int rank, int world)>;

// One communicator per group of size > 1 this rank belongs to, built in a
// fixed order (every rank creates its groups in the same sequence, so
// rendezvous never waits on a group another rank has not started), and a
// size-1 group is no communicator at all: comm() returns null and callers
// skip the collective. Destroyed in reverse order of creation.
//
// The flattened dp group is the same set of ranks as dp_shard when
// dp_replicate is 1 (full_shard, shard_grad_op, hybrid_shard with one
// group) and as dp_replicate when dp_shard is 1 (no_shard): dp() is then
// that communicator, not a second one over the same ranks (on NCCL each
// communicator holds its own GPU buffers and stream). built() counts what
// the factory made.
class MeshComms {
 public:
  MeshComms(const DeviceMesh& mesh, const GroupCommFactory& factory);
  ~MeshComms();
  const DeviceMesh& mesh() const { return mesh_; }
  Communicator* comm(MeshDim d) const { return comms_[int(d)].get(); }
  Communicator* dp() const { return dp_; }  // the flattened dp group
  int built() const { return built_; }

 private:
  const DeviceMesh mesh_;
  std::unique_ptr<Communicator> comms_[kMeshDims];
  std::unique_ptr<Communicator> own_dp_;  // only when dp is neither dp_shard nor dp_replicate
  Communicator* dp_ = nullptr;
  int built_ = 0;
};

}  // namespace trainrun
