// metrics.jsonl: one JSON object per logged step (rank 0 only).
#pragma once
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

namespace trainrun {

class MetricsWriter {
 public:
  MetricsWriter() = default;
  explicit MetricsWriter(const std::string& path);  // appends
  ~MetricsWriter();
  MetricsWriter(const MetricsWriter&) = delete;
  MetricsWriter& operator=(const MetricsWriter&) = delete;
  // Numbers in insertion order; integers are printed without a fraction.
  void write(const std::vector<std::pair<std::string, double>>& fields);

 private:
  std::FILE* f_ = nullptr;
  std::string path_;
};

}  // namespace trainrun
