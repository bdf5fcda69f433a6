// Step timelines as Chrome trace events (trace.h).
#include "core/common/trace.h"

#include <algorithm>

#include "core/common/error.h"
#include "core/common/int_list.h"

namespace trainrun {

namespace {
std::string json_escape(const std::string& s) {
  std::string o;
  for (char c : s) {
    if (c == '"' || c == '\\') o += '\\';
    if (static_cast<unsigned char>(c) < 0x20) continue;
    o += c;
  }
  return o;
}
}  // namespace

StepTracer::StepTracer(std::vector<int> steps, int rank) : steps_(std::move(steps)), rank_(rank) {}

int64_t StepTracer::now_us() {
  return std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

void StepTracer::begin_step(int step) {
  step_ = step;
  active_ = std::find(steps_.begin(), steps_.end(), step) != steps_.end();
}
void StepTracer::end_step() { active_ = false; }

StepTracer::Span::Span(StepTracer* t, std::string name, const char* cat, int tid)
    : t_(t && t->active() ? t : nullptr), name_(std::move(name)), cat_(cat), tid_(tid) {
  if (t_) t0_ = now_us();
}
StepTracer::Span::~Span() {
  if (t_) t_->add(name_, cat_, tid_, t0_, now_us());
}

void StepTracer::add(const std::string& name, const char* cat, int tid, int64_t t0, int64_t t1) {
  std::string e = "{\"name\":\"" + json_escape(name) + "\",\"cat\":\"" + cat + "\",\"ph\":\"X\",\"ts\":" +
                  std::to_string(t0) + ",\"dur\":" + std::to_string(std::max<int64_t>(0, t1 - t0)) +
                  ",\"pid\":" + std::to_string(rank_) + ",\"tid\":" + std::to_string(tid) +
                  ",\"args\":{\"step\":" + std::to_string(step_) + "}}";
  std::lock_guard<std::mutex> lk(mu_);
  events_.push_back(std::move(e));
}

void StepTracer::name_thread(int tid, const std::string& name) {
  std::lock_guard<std::mutex> lk(mu_);
  thread_names_[tid] = name;
}

std::string StepTracer::events_json() const {
  std::lock_guard<std::mutex> lk(mu_);
  std::string out;
  // Thread names, so the viewer labels the rows.
  out += "{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":" + std::to_string(rank_) +
         ",\"args\":{\"name\":\"rank " + std::to_string(rank_) + "\"}}";
  for (const auto& [tid, name] : thread_names_)
    out += ",{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":" + std::to_string(rank_) +
           ",\"tid\":" + std::to_string(tid) + ",\"args\":{\"name\":\"" + json_escape(name) + "\"}}";
  for (const std::string& e : events_) out += "," + e;
  return out;
}

std::vector<int> parse_trace_steps(const std::string& text) {
  const std::vector<int> out = parse_int_list(
      text, {"output.trace_steps", "step number", "write the steps to trace, e.g. [2, 10] (or '2,10')", 9});
  for (int v : out)
    if (v < 1)
      TR_FAIL("output.trace_steps: '", text, "' has step ", v,
              " (steps count from 1); write the steps to trace, e.g. [2, 10] (or '2,10')");
  return out;
}

std::string merge_trace_json(const std::vector<std::string>& fragments) {
  std::string out = "{\"displayTimeUnit\":\"ms\",\"traceEvents\":[";
  bool first = true;
  for (const std::string& f : fragments) {
    if (f.empty()) continue;
    out += (first ? "" : ",") + f;
    first = false;
  }
  return out + "]}\n";
}

}  // namespace trainrun
