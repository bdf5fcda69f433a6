#include "parallel/mesh/device_mesh.h"

#include <algorithm>
#include <numeric>

#include "core/common/error.h"

namespace trainrun {

const char* mesh_dim_name(MeshDim d) {
  switch (d) {
    case MeshDim::pp: return "pp";
    case MeshDim::dp_replicate: return "dp_replicate";
    case MeshDim::dp_shard: return "dp_shard";
    case MeshDim::cp: return "cp";
    case MeshDim::tp: return "tp";
  }
  return "?";
}

int MeshDims::size(MeshDim d) const {
  switch (d) {
    case MeshDim::pp: return pp;
    case MeshDim::dp_replicate: return dp_replicate;
    case MeshDim::dp_shard: return dp_shard;
    case MeshDim::cp: return cp;
    case MeshDim::tp: return tp;
  }
  return 1;
}

std::string MeshDims::describe() const {
  return "pp" + std::to_string(pp) + " x dp_replicate" + std::to_string(dp_replicate) + " x dp_shard" +
         std::to_string(dp_shard) + (cp > 1 ? " x cp" + std::to_string(cp) : std::string()) + " x tp" +
         std::to_string(tp);
}

MeshDims plan_mesh(int world, int tensor_parallel, int pipeline_parallel, const std::string& sharding,
                   int hybrid_group, int context_parallel) {
  TR_CHECK(world >= 1, "mesh: world size ", world, " (must be at least 1)");
  TR_CHECK(tensor_parallel >= 1, "parallel.tensor_parallel: ", tensor_parallel, " (must be at least 1; 1 = off)");
  TR_CHECK(pipeline_parallel >= 1, "parallel.pipeline_parallel: ", pipeline_parallel,
           " (must be at least 1; 1 = off)");
  TR_CHECK(context_parallel >= 1, "parallel.context_parallel: ", context_parallel, " (must be at least 1; 1 = off)");
  const int per_replica = tensor_parallel * pipeline_parallel * context_parallel;
  // cp named only when in use, so messages without it read as before.
  const std::string cp_factor =
      context_parallel > 1 ? " x parallel.context_parallel (" + std::to_string(context_parallel) + ")" : "";
  const std::string cp_term = context_parallel > 1 ? " x context_parallel " + std::to_string(context_parallel) : "";
  TR_CHECK(world % per_replica == 0, "mesh: the world size (", world,
           " ranks) is not divisible by parallel.tensor_parallel (", tensor_parallel,
           ") x parallel.pipeline_parallel (", pipeline_parallel, ")", cp_factor, " = ", per_replica,
           "; run a multiple of ", per_replica, " ranks or change the degrees");
  MeshDims d;
  d.tp = tensor_parallel;
  d.pp = pipeline_parallel;
  d.cp = context_parallel;
  const int dp = world / per_replica;
  if (sharding == "no_shard") {
    d.dp_replicate = dp;  // DDP: every dp rank holds everything
  } else if (sharding == "shard_grad_op" || sharding == "full_shard") {
    d.dp_shard = dp;
  } else if (sharding == "hybrid_shard") {
    TR_CHECK(hybrid_group >= 1, "parallel.shard_group_size: ", hybrid_group, " (hybrid_shard needs a group of at least 1)");
    TR_CHECK(dp % hybrid_group == 0, "parallel.shard_group_size (", hybrid_group,
             ") must divide the data-parallel size dp = ", world, " ranks / (tensor_parallel ", tensor_parallel,
             " x pipeline_parallel ", pipeline_parallel, cp_term, ") = ", dp, "; choose a divisor of ", dp);
    d.dp_shard = hybrid_group;
    d.dp_replicate = dp / hybrid_group;
  } else {
    TR_FAIL("parallel.sharding: unknown strategy '", sharding,
            "'; use no_shard, shard_grad_op, full_shard or hybrid_shard");
  }
  return d;
}

int default_hybrid_shard_group(int island_ranks, int tensor_parallel, int dp) {
  // Ranks are tp-innermost, then dp_shard (device_mesh.h): the dp ranks of
  // one island are consecutive dp_shard indices, so a divisor of both the
  // island's dp ranks and dp keeps every shard group inside an island.
  return std::gcd(std::max(1, dp), std::max(1, island_ranks / std::max(1, tensor_parallel)));
}

DeviceMesh::DeviceMesh(MeshDims dims, int rank) : dims_(dims), rank_(rank) {
  TR_CHECK(rank >= 0 && rank < dims.world(), "mesh: rank ", rank, " is outside ", dims.describe(), " (",
           dims.world(), " ranks)");
  int r = rank;
  coord_[int(MeshDim::tp)] = r % dims.tp;
  r /= dims.tp;
  coord_[int(MeshDim::cp)] = r % dims.cp;
  r /= dims.cp;
  coord_[int(MeshDim::dp_shard)] = r % dims.dp_shard;
  r /= dims.dp_shard;
  coord_[int(MeshDim::dp_replicate)] = r % dims.dp_replicate;
  r /= dims.dp_replicate;
  coord_[int(MeshDim::pp)] = r;
}

int DeviceMesh::rank_at(int pp, int dp_replicate, int dp_shard, int cp, int tp) const {
  return (((pp * dims_.dp_replicate + dp_replicate) * dims_.dp_shard + dp_shard) * dims_.cp + cp) * dims_.tp + tp;
}

int DeviceMesh::rank_at(int pp, int dp_replicate, int dp_shard, int tp) const {
  TR_CHECK(dims_.cp == 1, "mesh: rank_at without a cp coordinate in ", dims_.describe(),
           " (a bug: pass the cp index)");
  return rank_at(pp, dp_replicate, dp_shard, 0, tp);
}

std::vector<int> DeviceMesh::group_ranks(MeshDim d) const {
  std::vector<int> out;
  int c[kMeshDims] = {coord_[0], coord_[1], coord_[2], coord_[3], coord_[4]};
  for (int i = 0; i < dims_.size(d); ++i) {
    c[int(d)] = i;
    out.push_back(rank_at(c[0], c[1], c[2], c[3], c[4]));
  }
  return out;
}

std::vector<int> DeviceMesh::dp_group_ranks() const {
  std::vector<int> out;
  for (int r = 0; r < dims_.dp_replicate; ++r)
    for (int s = 0; s < dims_.dp_shard; ++s)
      out.push_back(rank_at(coord(MeshDim::pp), r, s, coord(MeshDim::cp), coord(MeshDim::tp)));
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
  return "dp" + std::to_string((coord(MeshDim::pp) * dims_.cp + coord(MeshDim::cp)) * dims_.tp + coord(MeshDim::tp));
}

std::vector<std::vector<int>> mesh_groups(const MeshDims& dims, MeshDim d) {
  std::vector<std::vector<int>> out;
  for (int r = 0; r < dims.world(); ++r) {
    const DeviceMesh m(dims, r);
    if (m.coord(d) == 0) out.push_back(m.group_ranks(d));  // a group's first member opens it
  }
  return out;
}

namespace {

std::string coords_of(const MeshDims& dims, int r) {
  const DeviceMesh m(dims, r);
  return std::to_string(m.coord(MeshDim::pp)) + "," + std::to_string(m.coord(MeshDim::dp_replicate)) + "," +
         std::to_string(m.coord(MeshDim::dp_shard)) + "," +
         (dims.cp > 1 ? std::to_string(m.coord(MeshDim::cp)) + "," : std::string()) +
         std::to_string(m.coord(MeshDim::tp));
}

std::string ranks_list(const std::vector<int>& v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s + "]";
}

// A group for the log: in full up to 8 ranks, else its first two, its last
// and the stride (mesh groups are arithmetic progressions).
std::string compact_ranks(const std::vector<int>& v) {
  if (v.size() <= 8) return ranks_list(v);
  return "[" + std::to_string(v[0]) + ", " + std::to_string(v[1]) + ", ..., " + std::to_string(v.back()) + "]";
}

constexpr const char* kLayoutRule =
    "rank = ((pp * dp_replicate_size + dp_replicate) * dp_shard_size + dp_shard) * tp_size + tp (tp innermost)";
constexpr const char* kLayoutRuleCp =
    "rank = (((pp * dp_replicate_size + dp_replicate) * dp_shard_size + dp_shard) * cp_size + cp) * tp_size + tp "
    "(tp innermost, then cp)";
const char* layout_rule(const MeshDims& dims) { return dims.cp > 1 ? kLayoutRuleCp : kLayoutRule; }

}  // namespace

std::string describe_rank_coords(const MeshDims& dims, int max_listed) {
  const int W = dims.world();
  std::string s;
  auto add = [&](int r) { s += (s.empty() ? "" : " ") + std::to_string(r) + "->(" + coords_of(dims, r) + ")"; };
  if (W <= max_listed) {
    for (int r = 0; r < W; ++r) add(r);
    return s;
  }
  const int head = std::max(1, max_listed / 2), tail = std::max(1, max_listed / 4);
  for (int r = 0; r < head; ++r) add(r);
  s += " ...";
  for (int r = W - tail; r < W; ++r) add(r);
  return s + " (" + std::to_string(W) + " ranks; " + layout_rule(dims) + ")";
}

std::string describe_mesh_groups(const MeshDims& dims, int max_groups) {
  std::string s;
  for (MeshDim d : {MeshDim::tp, MeshDim::cp, MeshDim::dp_shard, MeshDim::dp_replicate, MeshDim::pp}) {
    if (dims.size(d) <= 1) continue;
    const auto groups = mesh_groups(dims, d);
    s += std::string(s.empty() ? "" : "; ") + mesh_dim_name(d);
    for (size_t i = 0; i < groups.size() && int(i) < max_groups; ++i) s += " " + compact_ranks(groups[i]);
    if (int(groups.size()) > max_groups) s += " ...";
    if (int(groups.size()) > max_groups || dims.size(d) > 8)
      s += " (" + std::to_string(groups.size()) + " groups of " + std::to_string(dims.size(d)) + ")";
  }
  return s.empty() ? "none (one rank per replica, no groups)" : s;
}

std::string resolved_mesh_yaml(const MeshDims& dims, bool sequence_parallel, int max_listed) {
  const int W = dims.world();
  std::string y =
      "\n# The device mesh this run resolved (informational: written by trainrun at start; ignored when this\n"
      "# file is loaded as a job spec). ranks: rank -> [pp, dp_replicate, dp_shard, " +
      std::string(dims.cp > 1 ? "cp, " : "") + "tp].\n" + "resolved_mesh:\n";
  y += "  world: " + std::to_string(W) + "\n";
  y += "  dims: {pp: " + std::to_string(dims.pp) + ", dp_replicate: " + std::to_string(dims.dp_replicate) +
       ", dp_shard: " + std::to_string(dims.dp_shard) +
       (dims.cp > 1 ? ", cp: " + std::to_string(dims.cp) : std::string()) + ", tp: " + std::to_string(dims.tp) + "}\n";
  y += "  dp: " + std::to_string(dims.dp()) + "\n";
  y += std::string("  sequence_parallel: ") + (sequence_parallel && dims.tp > 1 ? "true" : "false") + "\n";
  y += std::string("  layout: '") + layout_rule(dims) + "'\n";
  if (W > max_listed) {
    y += "  listed: false  # more than " + std::to_string(max_listed) + " ranks: the layout rule gives every group\n";
    return y;
  }
  y += "  groups:\n";
  for (MeshDim d : {MeshDim::tp, MeshDim::dp_shard, MeshDim::dp_replicate, MeshDim::pp, MeshDim::cp}) {
    if (d == MeshDim::cp && dims.cp == 1) continue;  // as before cp existed
    std::string line = std::string("    ") + mesh_dim_name(d) + ": [";
    const auto groups = mesh_groups(dims, d);
    for (size_t i = 0; i < groups.size(); ++i) line += (i ? ", " : "") + ranks_list(groups[i]);
    y += line + "]\n";
  }
  y += "  ranks:\n";
  for (int r = 0; r < W; ++r) y += "    " + std::to_string(r) + ": [" + coords_of(dims, r) + "]\n";
  return y;
}

MeshDims fold_context_parallel(const MeshDims& dims) {
  MeshDims f = dims;
  if (dims.cp == 1) return f;
  if (dims.dp_shard == 1)
    f.dp_replicate *= dims.cp;
  else
    f.dp_shard *= dims.cp;
  f.cp = 1;
  return f;
}

MeshComms::MeshComms(const DeviceMesh& mesh, const GroupCommFactory& factory) : mesh_(mesh) {
  // tp first: the group on the fastest links, and the first a TP model
  // uses; then cp, the next dimension out. The order is the same on every rank.
  for (MeshDim d : {MeshDim::tp, MeshDim::cp, MeshDim::dp_shard, MeshDim::dp_replicate, MeshDim::pp}) {
    const int n = mesh_.dims().size(d);
    if (n > 1) comms_[int(d)] = factory(mesh_.group_name(d) + "/", mesh_.coord(d), n), ++built_;
  }
  // The same ranks in the same order (dp_coord is the dp_shard or the
  // dp_replicate index when the other is 1): one communicator for both.
  const MeshDims& dims = mesh_.dims();
  if (dims.dp() <= 1) return;
  if (dims.dp_replicate == 1) {
    dp_ = comms_[int(MeshDim::dp_shard)].get();
  } else if (dims.dp_shard == 1) {
    dp_ = comms_[int(MeshDim::dp_replicate)].get();
  } else {
    own_dp_ = factory(mesh_.dp_group_name() + "/", mesh_.dp_coord(), dims.dp());
    dp_ = own_dp_.get();
    ++built_;
  }
}

MeshComms::~MeshComms() {
  dp_ = nullptr;
  own_dp_.reset();
  for (MeshDim d : {MeshDim::pp, MeshDim::dp_replicate, MeshDim::dp_shard, MeshDim::cp, MeshDim::tp})
    comms_[int(d)].reset();
}

}  // namespace trainrun
