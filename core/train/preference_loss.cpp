#include "core/train/preference_loss.h"

#include <cmath>

#include "core/common/error.h"

namespace trainrun {
namespace {
// log sigmoid(x) and sigmoid(x) without overflow for large |x|.
double log_sigmoid(double x) { return x >= 0 ? -std::log1p(std::exp(-x)) : x - std::log1p(std::exp(x)); }
double sigmoid(double x) { return x >= 0 ? 1.0 / (1.0 + std::exp(-x)) : std::exp(x) / (1.0 + std::exp(x)); }
}  // namespace

PreferenceObjective parse_preference_objective(const std::string& s) {
  if (s == "sft") return PreferenceObjective::Sft;
  if (s == "dpo") return PreferenceObjective::Dpo;
  if (s == "ipo") return PreferenceObjective::Ipo;
  if (s == "orpo") return PreferenceObjective::Orpo;
  TR_FAIL("train.objective: '", s, "' is not one of sft, dpo, ipo, orpo");
}

const char* objective_name(PreferenceObjective o) {
  switch (o) {
    case PreferenceObjective::Sft: return "sft";
    case PreferenceObjective::Dpo: return "dpo";
    case PreferenceObjective::Ipo: return "ipo";
    case PreferenceObjective::Orpo: return "orpo";
  }
  return "?";
}

PairLoss preference_pair_loss(PreferenceObjective obj, const PairLogps& p, double beta, double eps) {
  PairLoss r;
  const double nc = double(std::max<int64_t>(p.n_chosen, 1)), nr = double(std::max<int64_t>(p.n_rejected, 1));
  switch (obj) {
    case PreferenceObjective::Dpo: {
      const double z = beta * ((p.chosen - p.ref_chosen) - (p.rejected - p.ref_rejected));
      r.loss = -(1 - eps) * log_sigmoid(z) - eps * log_sigmoid(-z);
      const double dz = -(1 - eps) * sigmoid(-z) + eps * sigmoid(z);
      r.d_chosen = beta * dz;
      r.d_rejected = -beta * dz;
      r.reward_chosen = beta * (p.chosen - p.ref_chosen);
      r.reward_rejected = beta * (p.rejected - p.ref_rejected);
      r.logp_chosen = p.chosen;
      r.logp_rejected = p.rejected;
      break;
    }
    case PreferenceObjective::Ipo: {
      const double ac = p.chosen / nc, ar = p.rejected / nr, rc = p.ref_chosen / nc, rr = p.ref_rejected / nr;
      const double h = (ac - rc) - (ar - rr), d = h - 1.0 / (2.0 * beta);
      r.loss = d * d;
      r.d_chosen = 2 * d / nc;
      r.d_rejected = -2 * d / nr;
      r.reward_chosen = beta * (ac - rc);
      r.reward_rejected = beta * (ar - rr);
      r.logp_chosen = ac;
      r.logp_rejected = ar;
      break;
    }
    case PreferenceObjective::Orpo: {
      const double ac = p.chosen / nc, ar = p.rejected / nr;
      // log(1 - e^a) for a < 0; log1p(-exp(a)) loses nothing near a = 0-.
      const double lo = (ac - ar) - (std::log1p(-std::exp(ac)) - std::log1p(-std::exp(ar)));
      r.log_sigmoid_log_odds = log_sigmoid(lo);
      r.loss = -beta * r.log_sigmoid_log_odds;
      const double dlo = -beta * sigmoid(-lo);
      // d lo / d ac = 1 / (1 - e^ac); d lo / d ar = -1 / (1 - e^ar).
      r.d_chosen = dlo / (-std::expm1(ac)) / nc;
      r.d_rejected = -dlo / (-std::expm1(ar)) / nr;
      r.reward_chosen = beta * ac;
      r.reward_rejected = beta * ar;
      r.logp_chosen = ac;
      r.logp_rejected = ar;
      r.log_odds = lo;
      break;
    }
    case PreferenceObjective::Sft:
      TR_FAIL("preference_pair_loss: train.objective sft has no pair loss (a bug)");
  }
  return r;
}

}  // namespace trainrun
