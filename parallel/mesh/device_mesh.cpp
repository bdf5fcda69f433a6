#include "parallel/mesh/device_mesh.h"

#include "core/common/error.h"

namespace trainrun {

const char* mesh_dim_name(MeshDim d) {
  switch (d) {
    case MeshDim::pp: return "pp";
    case MeshDim::dp_replicate: return "dp_replicate";
    case MeshDim::dp_shard: return "dp_shard";
    case MeshDim::tp: return "tp";
  }
  return "?";
}

int MeshDims::size(MeshDim d) const {
  switch (d) {
    case MeshDim::pp: return pp;
    case MeshDim::dp_replicate: return dp_replicate;
    case MeshDim::dp_shard: return dp_shard;
    case MeshDim::tp: return tp;
  }
  return 1;
}

std::string MeshDims::describe() const {
  return "pp" + std::to_string(pp) + " x dp_replicate" + std::to_string(dp_replicate) + " x dp_shard" +
         std::to_string(dp_shard) + " x tp" + std::to_string(tp);
}

MeshDims plan_mesh(int world, int tensor_parallel, int pipeline_parallel, const std::string& sharding,
                   int hybrid_group) {
  TR_CHECK(world >= 1, "mesh: world size ", world, " (must be at least 1)");
  TR_CHECK(tensor_parallel >= 1, "parallel.tensor_parallel: ", tensor_parallel, " (must be at least 1; 1 = off)");
  TR_CHECK(pipeline_parallel >= 1, "parallel.pipeline_parallel: ", pipeline_parallel,
           " (must be at least 1; 1 = off)");
  const int per_replica = tensor_parallel * pipeline_parallel;
  TR_CHECK(world % per_replica == 0, "mesh: the world size (", world,
           " ranks) is not divisible by parallel.tensor_parallel (", tensor_parallel,
           ") x parallel.pipeline_parallel (", pipeline_parallel, ") = ", per_replica,
           "; run a multiple of ", per_replica, " ranks or change the degrees");
  MeshDims d;
  d.tp = tensor_parallel;
  d.pp = pipeline_parallel;
  const int dp = world / per_replica;
  if (sharding == "no_shard") {
    d.dp_replicate = dp;  // DDP: every dp rank holds everything
  } else if (sharding == "shard_grad_op" || sharding == "full_shard") {
    d.dp_shard = dp;
  } else if (sharding == "hybrid_shard") {
    TR_CHECK(hybrid_group >= 1, "parallel.shard_group_size: ", hybrid_group, " (hybrid_shard needs a group of at least 1)");
    TR_CHECK(dp % hybrid_group == 0, "parallel.shard_group_size (", hybrid_group,
             ") must divide the data-parallel size dp = ", world, " ranks / (tensor_parallel ", tensor_parallel,
             " x pipeline_parallel ", pipeline_parallel, ") = ", dp, "; choose a divisor of ", dp);
    d.dp_shard = hybrid_group;
    d.dp_replicate = dp / hybrid_group;
  } else {
    TR_FAIL("parallel.sharding: unknown strategy '", sharding,
            "'; use no_shard, shard_grad_op, full_shard or hybrid_shard");
  }
  return d;
}

DeviceMesh::DeviceMesh(MeshDims dims, int rank) : dims_(dims), rank_(rank) {
  TR_CHECK(rank >= 0 && rank < dims.world(), "mesh: rank ", rank, " is outside ", dims.describe(), " (",
           dims.world(), " ranks)");
  int r = rank;
  coord_[int(MeshDim::tp)] = r % dims.tp;
  r /= dims.tp;
  coord_[int(MeshDim::dp_shard)] = r % dims.dp_shard;
  r /= dims.dp_shard;
  coord_[int(MeshDim::dp_replicate)] = r % dims.dp_replicate;
  r /= dims.dp_replicate;
  coord_[int(MeshDim::pp)] = r;
}

int DeviceMesh::rank_at(int pp, int dp_replicate, int dp_shard, int tp) const {
  return ((pp * dims_.dp_replicate + dp_replicate) * dims_.dp_shard + dp_shard) * dims_.tp + tp;
}

std::vector<int> DeviceMesh::group_ranks(MeshDim d) const {
  std::vector<int> out;
  int c[kMeshDims] = {coord_[0], coord_[1], coord_[2], coord_[3]};
  for (int i = 0; i < dims_.size(d); ++i) {
    c[int(d)] = i;
    out.push_back(rank_at(c[0], c[1], c[2], c[3]));
  }
  return out;
}

std::vector<int> DeviceMesh::dp_group_ranks() const {
  std::vector<int> out;
  for (int r = 0; r < dims_.dp_replicate; ++r)
    for (int s = 0; s < dims_.dp_shard; ++s) out.push_back(rank_at(coord(MeshDim::pp), r, s, coord(MeshDim::tp)));
  return out;
}

std::string DeviceMesh::group_name(MeshDim d) const {
  // The group is the set of ranks sharing every other coordinate; number it
  // by those coordinates in the mesh's order (row-major without d).
  int index = 0;
  for (int i = 0; i < kMeshDims; ++i) {
    if (i == int(d)) continue;
    index = index * dims_.size(MeshDim(i)) + coord_[i];
  }
  return std::string(mesh_dim_name(d)) + std::to_string(index);
}

std::string DeviceMesh::dp_group_name() const {
  return "dp" + std::to_string(coord(MeshDim::pp) * dims_.tp + coord(MeshDim::tp));
}

MeshComms::MeshComms(const DeviceMesh& mesh, const GroupCommFactory& factory) : mesh_(mesh) {
  // tp first: the group on the fastest links, and the first a TP model
  // uses. The order is the same on every rank.
  for (MeshDim d : {MeshDim::tp, MeshDim::dp_shard, MeshDim::dp_replicate, MeshDim::pp}) {
    const int n = mesh_.dims().size(d);
    if (n > 1) comms_[int(d)] = factory(mesh_.group_name(d) + "/", mesh_.coord(d), n);
  }
  const int ndp = mesh_.dims().dp();
  if (ndp > 1) dp_ = factory(mesh_.dp_group_name() + "/", mesh_.dp_coord(), ndp);
}

MeshComms::~MeshComms() {
  dp_.reset();
  for (MeshDim d : {MeshDim::pp, MeshDim::dp_replicate, MeshDim::dp_shard, MeshDim::tp}) comms_[int(d)].reset();
}

}  // namespace trainrun
