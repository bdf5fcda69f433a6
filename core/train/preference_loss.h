// The preference objectives (train.objective) on per-sequence log-probs:
// the published formulas, each with its gradient with respect to the
// policy's log-probs, which the trainer turns into per-token weights on
// the network's cross-entropy gradient (core/train/preference.h).
//
// For pair i, pi_c / pi_r are the policy's summed log-probs of the chosen /
// rejected response tokens, r_c / r_r the reference's, n_c / n_r their
// token counts, beta = train.dpo_beta, eps = train.dpo_label_smoothing:
//   dpo   z = beta * ((pi_c - r_c) - (pi_r - r_r))
//         loss = -(1 - eps) log sigmoid(z) - eps log sigmoid(-z)
//         (Rafailov et al. 2023; eps > 0 is the conservative DPO of
//         Mitchell 2023, TRL's label_smoothing)
//   ipo   on the mean log-probs a = pi / n (as TRL's loss_type "ipo"):
//         h = (a_c - ar_c) - (a_r - ar_r), loss = (h - 1 / (2 beta))^2
//         (Azar et al. 2023, eq. 17)
//   orpo  no reference; a = pi / n, log_odds = (a_c - a_r)
//         - (log(1 - e^a_c) - log(1 - e^a_r)),
//         loss = -beta log sigmoid(log_odds) per pair, plus the chosen
//         responses' NLL (mean over their tokens in the global batch:
//         the driver adds it) (Hong et al. 2024; TRL's ORPOTrainer)
// The step's loss is the mean over the global batch's pairs.
// Rewards, as TRL logs them: dpo beta (pi - r) (summed log-probs), ipo
// beta (a - ar), orpo beta a; logps/* are the log-probs the loss uses
// (summed for dpo, means for ipo and orpo).
#pragma once
#include <cstdint>
#include <string>

namespace trainrun {

enum class PreferenceObjective { Sft, Dpo, Ipo, Orpo };
PreferenceObjective parse_preference_objective(const std::string& s);  // train.objective
const char* objective_name(PreferenceObjective o);

struct PairLogps {
  double chosen = 0, rejected = 0;          // policy, summed over the response tokens
  double ref_chosen = 0, ref_rejected = 0;  // reference (dpo, ipo)
  int64_t n_chosen = 1, n_rejected = 1;     // response tokens (targets)
};

struct PairLoss {
  double loss = 0;                  // this pair's loss (the step divides by the global pairs)
  double d_chosen = 0, d_rejected = 0;  // d loss / d chosen, d loss / d rejected (summed log-probs)
  double reward_chosen = 0, reward_rejected = 0;
  double logp_chosen = 0, logp_rejected = 0;  // as the loss uses them
  double log_odds = 0;                        // orpo: the log odds ratio (TRL logs its mean as log_odds_chosen)
  double log_sigmoid_log_odds = 0;            // orpo: log sigmoid(log_odds) (TRL's log_odds_ratio)
};

PairLoss preference_pair_loss(PreferenceObjective obj, const PairLogps& p, double beta, double label_smoothing);

}  // namespace trainrun
