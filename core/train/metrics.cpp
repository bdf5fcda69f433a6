#include "core/train/metrics.h"

#include <cmath>
#include <nlohmann/json.hpp>

#include "core/common/error.h"

namespace trainrun {

MetricsWriter::MetricsWriter(const std::string& path) : path_(path) {
  f_ = std::fopen(path.c_str(), "a");
  TR_CHECK_ERRNO(f_, "cannot open metrics file '", path, "' for appending; check output.dir");
}

MetricsWriter::~MetricsWriter() {
  if (f_) std::fclose(f_);
}

void MetricsWriter::write(const std::vector<std::pair<std::string, double>>& fields) {
  if (!f_) return;
  nlohmann::ordered_json j;
  for (const auto& [k, v] : fields) {
    if (std::isfinite(v) && v == std::floor(v) && std::fabs(v) < 9e15 && (k == "step" || k == "tokens"))
      j[k] = static_cast<int64_t>(v);
    else if (std::isfinite(v))
      j[k] = v;
    else
      j[k] = nullptr;  // JSON has no NaN; a diverged loss shows as null
  }
  std::string line = j.dump() + "\n";
  TR_CHECK_ERRNO(std::fwrite(line.data(), 1, line.size(), f_) == line.size(), "cannot write metrics file '", path_,
                 "' (disk full?)");
  std::fflush(f_);
}

}  // namespace trainrun
