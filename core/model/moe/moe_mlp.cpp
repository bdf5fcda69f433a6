// MoeMlp (moe_mlp.h): the MoE MLP's buffers and its forward/backward over
// the Backend's MoE ops. No tensor memory is touched on the host.
#include "core/model/moe/moe_mlp.h"

#include <algorithm>

#include "core/common/error.h"

namespace trainrun {

MoeMlp::MoeMlp(const MoeConfig& m, int C, size_t es, int64_t maxN, int sets, int layers, bool training, int ep_size)
    : m_(m), C_(C), es_(es), maxN_(maxN), layers_(layers), loss_layers_(layers), training_(training), ep_size_(ep_size),
      sets_(size_t(sets)) {
  TR_CHECK(m.n_experts >= 1 && m.top_k >= 1 && m.top_k <= m.n_experts && m.ffn >= 1,
           "MoeMlp: n_experts ", m.n_experts, ", top_k ", m.top_k, ", expert width ", m.ffn,
           " (needs 1 <= top_k <= n_experts and a width; a bug: the arch checks these)");
}

MoeMlp::MoeMlp(const MoeConfig& m, int C, Backend* be, int64_t maxN, int sets, int layers, bool training,
               const ExpertParallel* ep)
    : MoeMlp(m, C, dtype_size(be->act_dtype()), maxN, sets, layers, training, ep ? ep->size() : 1) {
  be_ = be;
  if (ep_size_ > 1) {
    disp_ = std::make_unique<ExpertDispatch>(*be, *ep, m.n_experts);
    if (ep->split_storage) {  // only this rank's experts are in the unit, from slot 0
      held_ = disp_->local_experts();
      stored_first_ = disp_->first_expert();
    }
    plans_.resize(sets_.size());
    host_off_.resize(size_t(m.n_experts) + 1);
  }
}

MoeMlp::~MoeMlp() = default;

size_t MoeMlp::bytes(const MoeConfig& m, int C, size_t es, int64_t maxN, int sets, int layers, bool training) {
  MoeMlp probe(m, C, es, maxN, sets, layers, training, 1);
  ArenaPlan p;
  probe.plan(p, false);
  return p.total;
}

size_t MoeMlp::ep_exchange_bytes(const MoeConfig& m, int C, size_t es, int64_t maxN, int sets, bool training, int ep) {
  if (ep <= 1) return 0;
  ArenaPlan one, split;
  MoeMlp(m, C, es, maxN, sets, 1, training, 1).plan(one, false);
  MoeMlp(m, C, es, maxN, sets, 1, training, ep).plan(split, false);
  return split.total - one.total;
}

size_t MoeMlp::grown_bytes() const {
  size_t b = grown_scratch_.bytes();
  for (const Acts& a : sets_) b += a.grown.bytes();
  return b;
}

void MoeMlp::plan(ArenaPlan& plan, bool sets_transient) {
  const int64_t N = maxN_, E = m_.n_experts, K = m_.top_k, F = m_.ffn, FS = m_.shared_ffn, C = C_;
  const size_t es = es_;
  auto kept = [&](void* slot, size_t b) { plan.add(static_cast<void**>(slot), b); };
  auto tmp = [&](void* slot, size_t b) { plan.add_transient(static_cast<void**>(slot), b); };
  auto set_buf = [&](void* slot, size_t b) { sets_transient ? tmp(slot, b) : kept(slot, b); };
  for (Acts& a : sets_) {
    set_buf(&a.probs, N * E * 4);
    set_buf(&a.lse, N * 4);
    set_buf(&a.idx, N * K * 4);
    set_buf(&a.w, N * K * 4);
    set_buf(&a.pos, N * K * 4);
    set_buf(&a.offsets, (E + 1) * 4);
    const int64_t R = expert_rows();  // N*K without expert parallelism
    set_buf(&a.xp, N * K * C * es);
    set_buf(&a.gu, R * 2 * F * es);
    set_buf(&a.h, R * F * es);
    set_buf(&a.yp, N * K * C * es);
    if (ep_size_ > 1) {  // the received rows, balanced: ep_fit grows them (moe_mlp.h)
      set_buf(&a.xr, R * C * es);
      set_buf(&a.loff, (E / ep_size_ + 1) * 4);
      a.rows = R;
    }
    if (FS > 0) {
      set_buf(&a.sgu, N * 2 * FS * es);
      set_buf(&a.sh, N * FS * es);
      set_buf(&a.sy, N * C * es);
      set_buf(&a.sg, N * es);
    }
  }
  // The statistics outlive a call (the metrics read them after the step).
  kept(&stats_, size_t(layers_) * (2 * E + 1) * 4);
  kept(&total_, (2 * E + 1) * 4);
  kept(&loss_out_, 2 * 4);
  kept(&aux_grad_, E * 4);  // from the forward to the backward
  if (m_.bias_rate > 0 && training_) {  // (a decoder routes without the bias: export has no such term)
    kept(&bias_, size_t(layers_) * E * 4);
    kept(&load_, size_t(layers_) * (2 * E + 1) * 4);
  }
  tmp(&logits_, N * E * es);
  if (ep_size_ > 1) {
    tmp(&staging_, expert_rows() * C * es);
    tmp(&yr_, expert_rows() * C * es);
    scratch_rows_ = expert_rows();
  }
  if (!training_) return;
  tmp(&dw_, N * K * 4);
  tmp(&dyp_, N * K * C * es);
  tmp(&dh_, expert_rows() * F * es);
  if (FS > 0) {
    tmp(&dtmp_, N * C * es);
    tmp(&dsh_, N * FS * es);
    tmp(&dsy_, N * C * es);
    tmp(&dsg_, N * es);
  }
}

void MoeMlp::allocate_own() {
  ArenaPlan p;
  plan(p, false);
  own_ = p.allocate(be_);
}

void MoeMlp::ready_balance() {
  if (!bias_ || balance_ready_) return;
  be_->zero(bias_, size_t(layers_) * m_.n_experts * 4);  // an arena is not zeroed: no bias and no load yet
  be_->zero(load_, size_t(layers_) * (2 * m_.n_experts + 1) * 4);
  balance_ready_ = true;
}

void MoeMlp::set_bias(const std::vector<float>& bias) {
  TR_CHECK(bias_ && int64_t(bias.size()) == int64_t(layers_) * m_.n_experts, "MoeMlp: an expert bias of ",
           bias.size(), " values for ", layers_, " layers x ", m_.n_experts, " experts",
           bias_ ? "" : " without model.moe_balance: bias", " (a bug)");
  ready_balance();
  be_->copy_to_device(bias_, bias.data(), bias.size() * 4);
}

std::vector<float> MoeMlp::take_load() {
  if (!load_) return {};
  ready_balance();
  const int E = m_.n_experts, row = 2 * E + 1;
  std::vector<float> stats(size_t(layers_) * row), load(size_t(layers_) * E);
  be_->copy_to_host(stats.data(), load_, stats.size() * 4);
  be_->zero(load_, stats.size() * 4);
  for (int l = 0; l < layers_; ++l)
    std::copy(stats.begin() + int64_t(l) * row, stats.begin() + int64_t(l) * row + E, load.begin() + int64_t(l) * E);
  return load;
}

void MoeMlp::begin_forward(bool with_stats, bool count_load) {
  stats_on_ = with_stats;
  count_load_ = count_load && with_stats && load_;
  ready_balance();
  layer_ = 0;
  if (!with_stats) return;
  const size_t row = size_t(2 * m_.n_experts + 1) * 4;
  be_->zero(stats_, size_t(layers_) * row);
  be_->zero(total_, row);
}

void MoeMlp::forward(int set, const void* w, const void* x, void* out, int N, int layer) {
  TR_CHECK(N <= maxN_, "MoeMlp: ", N, " tokens exceed its buffers (", maxN_, ") (a bug)");
  const int E = m_.n_experts, K = m_.top_k, F = m_.ffn, FS = m_.shared_ffn, C = C_;
  const MoeOffsets o(C, m_, held_);
  auto at = [&](int64_t off) { return static_cast<const char*>(w) + off * int64_t(es_); };
  Acts& a = sets_[size_t(set)];
  be_->matmul_forward(logits_, x, at(o.router), nullptr, N, C, E);
  be_->moe_route_forward(a.probs, a.lse, a.idx, a.w, logits_, N, E, K, m_.norm_topk_prob);
  if (bias_)
    be_->moe_route_select_biased(a.idx, a.w, a.probs, bias_ + int64_t(layer < 0 ? set : layer) * E, N, E, K, m_.norm_topk_prob);
  if (stats_on_) {
    if (count_load_) be_->moe_router_stats(load_ + int64_t(layer_) * (2 * E + 1), a.probs, a.lse, a.idx, N, E, K);
    TR_CHECK(layer_ < layers_, "MoeMlp: more MoE layers than ", layers_, " in one forward (a bug)");
    be_->moe_router_stats(stats_ + int64_t(layer_) * (2 * E + 1), a.probs, a.lse, a.idx, N, E, K);
    be_->moe_router_stats(total_, a.probs, a.lse, a.idx, N, E, K);
    ++layer_;
  }
  const int NK = N * K;
  be_->moe_permute(a.pos, a.offsets, a.xp, a.idx, x, N, K, E, C);
  if (disp_) {  // expert parallelism: this rank's experts over the group's rows (moe_mlp.h)
    const int El = disp_->local_experts(), e0 = disp_->first_expert() - stored_first_;
    const int64_t R = ep_dispatch(set, a);
    be_->moe_expert_matmul_forward(a.gu, a.xr, at(o.gu + int64_t(e0) * 2 * F * C), a.loff, El, C, 2 * F);
    be_->swiglu_forward(a.h, a.gu, int(R), F);
    be_->moe_expert_matmul_forward(yr_, a.h, at(o.down + int64_t(e0) * C * F), a.loff, El, F, C);
    disp_->combine(plans_[size_t(set)], yr_, staging_, a.yp, size_t(C) * es_);
  } else {
    be_->moe_expert_matmul_forward(a.gu, a.xp, at(o.gu), a.offsets, E, C, 2 * F);
    be_->swiglu_forward(a.h, a.gu, NK, F);
    be_->moe_expert_matmul_forward(a.yp, a.h, at(o.down), a.offsets, E, F, C);
  }
  be_->moe_unpermute_forward(out, a.yp, a.pos, a.w, N, K, C);
  if (FS > 0) {
    be_->matmul_forward(a.sgu, x, at(o.sgu), nullptr, N, C, 2 * FS);
    be_->swiglu_forward(a.sh, a.sgu, N, FS);
    be_->matmul_forward(a.sy, a.sh, at(o.sdown), nullptr, N, FS, C);
    be_->matmul_forward(a.sg, x, at(o.sgate), nullptr, N, C, 1);
    be_->moe_sigmoid_gate_forward(out, a.sy, a.sg, N, C);
  }
}

int64_t MoeMlp::ep_dispatch(int set, Acts& a) {
  const int E = m_.n_experts;
  // The counts cross the host once per layer (one device sync): the
  // all_to_all_v sizes, the grouped GEMM's block sizes and the landing
  // buffers' rows are host values. Acceptable: the dispatch cannot start
  // before the router has run anyway, and a dropless exchange needs the
  // sizes before it moves a row; Megatron-Core's dropless token dispatcher
  // syncs the same way (its tokens_per_expert to the host) per layer.
  be_->copy_to_host(host_off_.data(), a.offsets, (size_t(E) + 1) * 4);
  be_->synchronize();
  ExpertDispatch::Plan& p = plans_[size_t(set)];
  p = disp_->plan(host_off_.data());
  const int64_t most = expert_rows() * ep_size_;  // dropless: every row of the group
  TR_CHECK(p.recv_total <= most, "MoeMlp: ", p.recv_total, " rows received exceed ", most,
           " (ep x N x K; a bug or a corrupted count exchange)");
  ep_fit(a, p.recv_total);
  be_->copy_to_device(a.loff, p.local_offsets.data(), p.local_offsets.size() * 4);
  disp_->dispatch(p, a.xp, staging_, a.xr, size_t(C_) * es_);
  return p.recv_total;
}

void MoeMlp::ep_fit(Acts& a, int64_t R) {
  const int64_t C = C_, F = m_.ffn;
  const size_t es = es_;
  // Called between ep_dispatch's synchronize and the all_to_all_v: nothing
  // in flight reads the buffers a reset frees. Grown buffers are re-pointed
  // on every call (a later bind_transient would point them back at the plan).
  if (R > a.rows) {
    a.grown = DeviceBuffer(be_, size_t(R) * (C + 3 * F) * es);
    a.rows = R;
    ++grows_;
  }
  if (a.grown.get()) {
    char* g = a.grown.as<char>();
    a.xr = g;
    a.gu = g + a.rows * C * es;
    a.h = g + a.rows * (C + 2 * F) * es;
  }
  if (R > scratch_rows_) {
    grown_scratch_ = DeviceBuffer(be_, size_t(R) * (2 * C + (training_ ? F : 0)) * es);
    scratch_rows_ = R;
    ++grows_;
  }
  if (grown_scratch_.get()) {
    char* g = grown_scratch_.as<char>();
    staging_ = g;
    yr_ = g + scratch_rows_ * C * es;
    if (training_) dh_ = g + scratch_rows_ * 2 * C * es;
  }
}

void MoeMlp::start_statistics_from(const float* partial) {
  be_->copy_device(total_, partial, size_t(2 * m_.n_experts + 1) * 4);
}

void MoeMlp::copy_statistics(float* out) const { be_->copy_device(out, total_, size_t(2 * m_.n_experts + 1) * 4); }

void MoeMlp::set_stage_grad_scale(int N, float grad_scale) {
  last_n_ = N;  // its statistics are reported (the per-layer loads)
  // as finish_forward: each token carries z_coef / (layers x N) of the z sum, its gradient grad_scale = dloss_scale x N
  z_scale_ = float(2.0 * m_.z_loss_coef * grad_scale / (double(loss_layers_) * N));
}

void MoeMlp::copy_aux_grad(float* out) const { be_->copy_device(out, aux_grad_, size_t(m_.n_experts) * 4); }

void MoeMlp::set_aux_grad(const float* g) { be_->copy_device(aux_grad_, g, size_t(m_.n_experts) * 4); }

void MoeMlp::finish_forward(float* losses, int N, float grad_scale) {
  TR_CHECK(stats_on_ && layer_ == layers_, "MoeMlp: finish_forward after ", layer_, " of ", layers_,
           " MoE layers (a bug)");
  const int64_t tokens = int64_t(loss_layers_) * N;
  last_n_ = N;
  be_->moe_aux_loss(loss_out_, aux_grad_, losses, N, total_, tokens, m_.n_experts, float(m_.aux_loss_coef),
                    float(m_.z_loss_coef), grad_scale);
  z_scale_ = float(2.0 * m_.z_loss_coef * grad_scale / double(tokens));
}

void MoeMlp::backward(int set, const void* w, float* dw, const void* x, const void* dout, void* dx, int N) {
  TR_CHECK(training_, "MoeMlp: backward of a forward-only MoE (a bug)");
  const int E = m_.n_experts, K = m_.top_k, F = m_.ffn, FS = m_.shared_ffn, C = C_;
  const MoeOffsets o(C, m_, held_);
  auto at = [&](int64_t off) { return static_cast<const char*>(w) + off * int64_t(es_); };
  auto g = [&](int64_t off) { return dw ? dw + off : nullptr; };
  Acts& a = sets_[size_t(set)];
  const int NK = N * K;
  // Routed experts, back to front: unpermute, down, SwiGLU (in place), gate|up.
  be_->moe_unpermute_backward(dyp_, dw_, dout, a.yp, a.pos, a.w, N, K, C);
  if (disp_) {  // the forward's exchange mirrored: output gradients out, input gradients back
    const ExpertDispatch::Plan& p = plans_[size_t(set)];
    const int El = disp_->local_experts(), e0 = disp_->first_expert() - stored_first_;
    const int64_t gu0 = o.gu + int64_t(e0) * 2 * F * C, down0 = o.down + int64_t(e0) * C * F;
    void* dyr = yr_;  // the forward's scratch: d yr, then d xr
    disp_->dispatch(p, dyp_, staging_, dyr, size_t(C) * es_);
    be_->moe_expert_matmul_backward(dh_, g(down0), dyr, a.h, at(down0), a.loff, El, F, C);
    be_->swiglu_backward(a.gu, dh_, a.gu, int(p.recv_total), F);
    be_->moe_expert_matmul_backward(dyr, g(gu0), a.gu, a.xr, at(gu0), a.loff, El, C, 2 * F);  // dyr <- d xr
    disp_->combine(p, dyr, staging_, dyp_, size_t(C) * es_);                                // dyp_ <- d xp
  } else {
    be_->moe_expert_matmul_backward(dh_, g(o.down), dyp_, a.h, at(o.down), a.offsets, E, F, C);
    be_->swiglu_backward(a.gu, dh_, a.gu, NK, F);
    be_->moe_expert_matmul_backward(dyp_, g(o.gu), a.gu, a.xp, at(o.gu), a.offsets, E, C, 2 * F);  // dyp_ <- d xp
  }
  // The router: its input gradient first (overwrites dx), then the experts' (accumulates).
  be_->moe_route_backward(logits_, dw_, a.probs, a.lse, a.idx, m_.aux_loss_coef != 0 ? aux_grad_ : nullptr, z_scale_,
                          N, E, K, m_.norm_topk_prob);
  be_->matmul_backward(dx, g(o.router), nullptr, logits_, x, at(o.router), N, C, E);
  be_->moe_permute_backward(dx, dyp_, a.pos, N, K, C);
  if (FS > 0) {
    const int64_t nc = int64_t(N) * C;
    be_->moe_sigmoid_gate_backward(dsy_, dsg_, dout, a.sy, a.sg, N, C);
    be_->matmul_backward(dtmp_, g(o.sgate), nullptr, dsg_, x, at(o.sgate), N, C, 1);
    be_->residual_forward(dx, dx, dtmp_, nc);
    be_->matmul_backward(dsh_, g(o.sdown), nullptr, dsy_, a.sh, at(o.sdown), N, FS, C);
    be_->swiglu_backward(a.sgu, dsh_, a.sgu, N, FS);
    be_->matmul_backward(dtmp_, g(o.sgu), nullptr, a.sgu, x, at(o.sgu), N, C, 2 * FS);
    be_->residual_forward(dx, dx, dtmp_, nc);
  }
}

Network::RouterReport MoeMlp::report(Backend* be) const {
  Network::RouterReport r;
  if (last_n_ == 0) return r;  // no forward with a loss yet
  const int E = m_.n_experts, S = stats_stride();
  std::vector<float> st(size_t(layers_) * S), losses(2);
  be->copy_to_host(st.data(), stats_, st.size() * 4);
  be->copy_to_host(losses.data(), loss_out_, 8);
  be->synchronize();
  r.aux_loss = losses[0];
  r.z_loss = losses[1];
  for (int l = 0; l < layers_; ++l) {
    const float* row = st.data() + size_t(l) * S;
    r.max_tokens.push_back(*std::max_element(row, row + E));
    r.mean_tokens.push_back(double(last_n_) * m_.top_k / E);
  }
  return r;
}

}  // namespace trainrun
