// Learning-rate schedule: linear warmup from lr/warmup to lr over
// warmup_steps, then cosine or linear decay to min_lr at max_steps (or
// constant). `step` is 0-based. A warmup longer than the run is a warmup
// over the whole run (validation clamps it the same way, with a warning), so
// a short smoke run of a long job still ends at lr.
#pragma once
#include <algorithm>
#include <cmath>
#include <string>

namespace trainrun {

inline double lr_at(int step, int max_steps, int warmup, double lr, double min_lr, const std::string& schedule) {
  warmup = std::min(warmup, max_steps);
  if (warmup > 0 && step < warmup) return lr * double(step + 1) / double(warmup);
  if (schedule == "constant") return lr;
  const int span = max_steps - warmup;
  if (span <= 0) return lr;
  double frac = double(step - warmup) / double(span);
  if (frac > 1.0) frac = 1.0;
  double shape = schedule == "linear" ? 1.0 - frac : 0.5 * (1.0 + std::cos(M_PI * frac));
  return min_lr + (lr - min_lr) * shape;
}

}  // namespace trainrun
