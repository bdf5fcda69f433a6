// Synthetic token source: a seeded random first-order Markov chain whose
// entropy rate is known exactly, so a test or a benchmark can say how close
// training got to the best achievable loss.
//
// Bit-for-bit reproducibility across machines and standard libraries is the
// point, so the PRNG and the Gamma sampler are implemented here instead of
// using <random>'s distributions (whose outputs are implementation-defined).
#include <algorithm>
#include <cmath>
#include <numeric>
#include <sstream>

#include "core/common/error.h"
#include "core/common/log.h"
#include "core/data/dataset.h"

namespace trainrun {
namespace {

uint64_t splitmix64(uint64_t& x) {
  uint64_t z = (x += 0x9e3779b97f4a7c15ULL);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

uint64_t mix(uint64_t a, uint64_t b) {
  uint64_t x = a ^ (b * 0xd6e8feb86659fd93ULL);
  return splitmix64(x);
}

// xoshiro256**: small state, fast, and good enough for sampling tokens.
class Rng {
 public:
  explicit Rng(uint64_t seed) {
    for (auto& w : s_) w = splitmix64(seed);
  }
  uint64_t next() {
    uint64_t result = rotl(s_[1] * 5, 7) * 9;
    uint64_t t = s_[1] << 17;
    s_[2] ^= s_[0];
    s_[3] ^= s_[1];
    s_[1] ^= s_[2];
    s_[0] ^= s_[3];
    s_[2] ^= t;
    s_[3] = rotl(s_[3], 45);
    return result;
  }
  double uniform() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }  // [0, 1)
  uint64_t below(uint64_t n) { return static_cast<uint64_t>((static_cast<unsigned __int128>(next()) * n) >> 64); }
  double normal() {  // Box-Muller; the second value is dropped to keep the state simple
    double u1 = 1.0 - uniform(), u2 = uniform();
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
  }
  // Marsaglia-Tsang; shape < 1 via the boost Gamma(k) = Gamma(k+1) * U^(1/k).
  double gamma(double k) {
    if (k < 1.0) return gamma(k + 1.0) * std::pow(1.0 - uniform(), 1.0 / k);
    double d = k - 1.0 / 3.0, c = 1.0 / std::sqrt(9.0 * d);
    for (;;) {
      double x = normal(), v = 1.0 + c * x;
      if (v <= 0) continue;
      v = v * v * v;
      double u = 1.0 - uniform();
      if (u < 1.0 - 0.0331 * x * x * x * x) return d * v;
      if (std::log(u) < 0.5 * x * x + d * (1.0 - v + std::log(v))) return d * v;
    }
  }

 private:
  static uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }
  uint64_t s_[4];
};

// Keeps every listed successor reachable when tiny concentrations make the
// Gamma draws underflow: the cycle edge must stay live for irreducibility.
constexpr double kMinProb = 1e-6;
constexpr int64_t kMaxTransitions = int64_t(1) << 24;
constexpr int64_t kNumSamples = int64_t(1) << 40;
constexpr int kMaxDenseStates = 2048;  // GTH fallback: 32 MB, a few seconds at most

class SyntheticSource : public TokenSource {
 public:
  SyntheticSource(const SyntheticSpec& spec, int V, int split) : spec_(spec), V_(V), b_(spec.branching), split_(split) {
    build_chain();
    stationary();
  }

  int64_t num_samples(int T) const override {
    TR_CHECK(T > 0, "synthetic data: sequence length must be positive, got ", T);
    return kNumSamples;
  }

  void read_samples(int64_t first, int B, int T, int32_t* inputs, int32_t* targets) const override {
    TR_CHECK(T > 0, "synthetic data: sequence length must be positive, got ", T);
#pragma omp parallel for schedule(static) if (static_cast<int64_t>(B) * T >= (1 << 16))
    for (int b = 0; b < B; ++b) {
      int64_t s = (first + b) % kNumSamples;
      if (s < 0) s += kNumSamples;
      int32_t* in = inputs + static_cast<int64_t>(b) * T;
      int32_t* tg = targets + static_cast<int64_t>(b) * T;
      Rng rng(mix(mix(spec_.seed, 0x5EED0000ULL + split_), static_cast<uint64_t>(s)));
      int state = pick(pi_cdf_.data(), V_, rng.uniform());
      in[0] = state;
      for (int t = 0; t < T; ++t) {
        int64_t row = static_cast<int64_t>(state) * b_;
        state = succ_[row + pick(cdf_.data() + row, b_, rng.uniform())];
        tg[t] = state;
        if (t + 1 < T) in[t + 1] = state;
      }
    }
  }

  int vocab_bound() const override { return V_; }
  double entropy_floor() const override { return entropy_; }

  std::string describe() const override {
    std::ostringstream os;
    os << "synthetic Markov chain (" << V_ << " states, branching " << b_ << ", concentration " << spec_.concentration
       << ", seed " << spec_.seed << "; entropy floor " << entropy_ << " nats/token), " << (split_ == 0 ? "train" : "val")
       << " split";
    return os.str();
  }

 private:
  // Index of the first cdf entry > u; clamped because the last entry is
  // forced to 1.0 but a distribution with trailing zero mass could tie.
  static int pick(const double* cdf, int n, double u) {
    int i = static_cast<int>(std::upper_bound(cdf, cdf + n, u) - cdf);
    return i < n ? i : n - 1;
  }

  void build_chain() {
    Rng rng(mix(spec_.seed, 0xC4A1ULL));
    // A random single-cycle permutation (Sattolo) as one successor of every
    // state makes the chain irreducible whatever the other draws are.
    std::vector<int> cycle(V_);
    std::iota(cycle.begin(), cycle.end(), 0);
    for (int i = V_ - 1; i > 0; --i) std::swap(cycle[i], cycle[rng.below(i)]);

    succ_.assign(static_cast<size_t>(V_) * b_, 0);
    std::vector<double> prob(succ_.size());
    std::vector<int> stamp(V_, -1);
    for (int i = 0; i < V_; ++i) {
      int* s = &succ_[static_cast<size_t>(i) * b_];
      s[0] = cycle[i];
      stamp[cycle[i]] = i;
      for (int j = 1; j < b_; ++j) {
        int c;
        do c = static_cast<int>(rng.below(V_)); while (stamp[c] == i);
        stamp[c] = i;
        s[j] = c;
      }
    }
    make_aperiodic();
    for (int i = 0; i < V_; ++i) {
      double* p = &prob[static_cast<size_t>(i) * b_];
      double sum = 0;
      for (int j = 0; j < b_; ++j) sum += (p[j] = rng.gamma(spec_.concentration));
      double sum2 = 0;
      for (int j = 0; j < b_; ++j) sum2 += (p[j] = sum > 0 ? std::max(p[j] / sum, kMinProb) : 1.0);
      for (int j = 0; j < b_; ++j) p[j] /= sum2;
    }
    prob_ = std::move(prob);
    cdf_.resize(prob_.size());
    for (int i = 0; i < V_; ++i) {
      const double* p = &prob_[static_cast<size_t>(i) * b_];
      double* c = &cdf_[static_cast<size_t>(i) * b_];
      double acc = 0;
      for (int j = 0; j < b_; ++j) c[j] = (acc += p[j]);
      c[b_ - 1] = 1.0;
    }
  }

  // The period is the gcd of (level[u] + 1 - level[v]) over all edges for BFS
  // levels from any state. A periodic chain has no limiting distribution, so
  // power iteration would not converge; one self-loop fixes the period at 1.
  void make_aperiodic() {
    if (b_ < 2) return;  // the bare cycle: deterministic, H = 0, pi uniform
    std::vector<int> level(V_, -1), queue{0};
    level[0] = 0;
    for (size_t q = 0; q < queue.size(); ++q) {
      int u = queue[q];
      for (int j = 0; j < b_; ++j) {
        int v = succ_[static_cast<size_t>(u) * b_ + j];
        if (level[v] < 0) { level[v] = level[u] + 1; queue.push_back(v); }
      }
    }
    int64_t g = 0;
    for (int u = 0; u < V_; ++u)
      for (int j = 0; j < b_; ++j) g = std::gcd(g, std::abs(int64_t(level[u]) + 1 - level[succ_[size_t(u) * b_ + j]]));
    if (g != 1) succ_[b_ - 1] = 0;  // state 0 is not already its own successor, else g would be 1
  }

  // Grassmann-Taksar-Heyman state reduction: Gaussian elimination that only
  // adds and multiplies non-negative numbers (the pivot is the sum of the
  // off-diagonal row, never 1 - p_nn), so it is accurate to machine precision
  // however slowly the chain mixes. O(V^3).
  std::vector<double> stationary_gth() const {
    const size_t n = static_cast<size_t>(V_);
    std::vector<double> a(n * n, 0.0);
    for (size_t i = 0; i < n; ++i)
      for (int j = 0; j < b_; ++j) a[i * n + succ_[i * b_ + j]] += prob_[i * b_ + j];
    for (size_t k = n - 1; k > 0; --k) {
      double s = 0;
      for (size_t j = 0; j < k; ++j) s += a[k * n + j];
      for (size_t i = 0; i < k; ++i) a[i * n + k] /= s;
      for (size_t i = 0; i < k; ++i) {
        double f = a[i * n + k];
        if (f == 0) continue;
        for (size_t j = 0; j < k; ++j) a[i * n + j] += f * a[k * n + j];
      }
    }
    std::vector<double> x(n, 0.0);
    x[0] = 1.0;
    double sum = 1.0;
    for (size_t j = 1; j < n; ++j) {
      for (size_t i = 0; i < j; ++i) x[j] += x[i] * a[i * n + j];
      sum += x[j];
    }
    for (auto& v : x) v /= sum;
    return x;
  }

  // Power iteration, as the chain is sparse; a nearly deterministic chain
  // (tiny concentration) mixes too slowly for it, so small chains then fall
  // back to the exact dense GTH elimination.
  void stationary() {
    std::vector<double> pi(V_, 1.0 / V_), next(V_);
    const int64_t edges = static_cast<int64_t>(V_) * b_;
    const int64_t max_iters = std::max<int64_t>(1000, int64_t(1e8) / edges);
    double diff = 1.0;
    int64_t it = 0;
    for (; it < max_iters && diff >= 1e-14; ++it) {
      std::fill(next.begin(), next.end(), 0.0);
      for (int i = 0; i < V_; ++i)
        for (int j = 0; j < b_; ++j) next[succ_[size_t(i) * b_ + j]] += pi[i] * prob_[size_t(i) * b_ + j];
      double sum = std::accumulate(next.begin(), next.end(), 0.0);
      diff = 0;
      for (int i = 0; i < V_; ++i) {
        next[i] /= sum;
        diff += std::fabs(next[i] - pi[i]);
      }
      pi.swap(next);
    }
    if (diff >= 1e-14 && V_ <= kMaxDenseStates) {
      pi = stationary_gth();
    } else if (diff >= 1e-14) {
      TR_LOG_WARN("synthetic data: the stationary distribution converged only to ", diff, " (L1) after ", it,
                  " iterations; the reported entropy floor is approximate (raise data.synthetic.concentration)");
    }
    entropy_ = 0;
    for (int i = 0; i < V_; ++i) {
      double h = 0;
      for (int j = 0; j < b_; ++j) {
        double p = prob_[size_t(i) * b_ + j];
        h -= p * std::log(p);
      }
      entropy_ += pi[i] * h;
    }
    pi_cdf_.resize(V_);
    double acc = 0;
    for (int i = 0; i < V_; ++i) pi_cdf_[i] = (acc += pi[i]);
    pi_cdf_[V_ - 1] = 1.0;
    pi_ = std::move(pi);
  }

  SyntheticSpec spec_;
  int V_, b_, split_;
  std::vector<int> succ_;        // V*b successor states
  std::vector<double> prob_;     // V*b transition probabilities
  std::vector<double> cdf_;      // V*b cumulative, per state
  std::vector<double> pi_, pi_cdf_;
  double entropy_ = 0;
};

}  // namespace

std::unique_ptr<TokenSource> make_synthetic_source(const SyntheticSpec& spec, int vocab_size, int split) {
  int V = spec.vocab > 0 ? spec.vocab : vocab_size;
  TR_CHECK(spec.vocab >= 0, "data.synthetic.vocab: must be >= 0 (0 = model.vocab_size), got ", spec.vocab);
  TR_CHECK(V >= 2, "data.synthetic.vocab: the chain needs at least 2 states, got ", V,
           " (data.synthetic.vocab = ", spec.vocab, ", model.vocab_size = ", vocab_size, ")");
  TR_CHECK(vocab_size <= 0 || V <= vocab_size, "data.synthetic.vocab: ", V, " states exceed model.vocab_size = ",
           vocab_size, "; lower data.synthetic.vocab or raise model.vocab_size");
  TR_CHECK(spec.branching >= 1 && spec.branching <= V, "data.synthetic.branching: must be in [1, ", V,
           "] (the number of states), got ", spec.branching);
  TR_CHECK(static_cast<int64_t>(V) * spec.branching <= kMaxTransitions, "data.synthetic.branching: ", V, " states x ",
           spec.branching, " successors exceeds ", kMaxTransitions, " transitions; lower the branching or the vocab");
  TR_CHECK(spec.concentration > 0 && std::isfinite(spec.concentration),
           "data.synthetic.concentration: must be a positive number, got ", spec.concentration);
  TR_CHECK(split == 0 || split == 1, "synthetic data: split must be 0 (train) or 1 (val), got ", split);
  return std::make_unique<SyntheticSource>(spec, V, split);
}

}  // namespace trainrun
