// A timeline of chosen training steps (output.trace_steps), in the Chrome
// trace-event format that Perfetto and chrome://tracing open: complete
// events ("ph": "X") with microsecond start and duration, one process per
// rank (pid = rank) and one thread per timeline of that rank (tid 0 the
// compute thread; tid 1, 2, ... the pipeline's sender threads, one per
// outgoing link). Spans are recorded
// only while a traced step runs, so an untraced step costs one branch.
//
// Times are CLOCK_MONOTONIC (steady_clock), shared by the processes of one
// node, so the ranks' timelines line up; ranks on other nodes are only as
// aligned as their clocks.
#pragma once
#include <chrono>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

namespace trainrun {

class StepTracer {
 public:
  StepTracer(std::vector<int> steps, int rank);
  // The step about to run (1-based): records from now on if it is traced.
  void begin_step(int step);
  void end_step();
  bool active() const { return active_; }
  // The trace's name for timeline `tid` (0: "compute", 1: "pipeline sends").
  void name_thread(int tid, const std::string& name);

  // A span from construction to destruction (a no-op when not active).
  class Span {
   public:
    Span(StepTracer* t, std::string name, const char* cat, int tid = 0);
    ~Span();
    Span(const Span&) = delete;
    Span& operator=(const Span&) = delete;

   private:
    StepTracer* t_;
    std::string name_;
    const char* cat_;
    int tid_;
    int64_t t0_ = 0;
  };

  // This rank's events as a JSON array's elements (comma-separated, no brackets).
  std::string events_json() const;
  int rank() const { return rank_; }
  bool any_steps() const { return !steps_.empty(); }

  static int64_t now_us();

 private:
  void add(const std::string& name, const char* cat, int tid, int64_t t0, int64_t t1);
  std::vector<int> steps_;
  int rank_;
  bool active_ = false;
  int step_ = 0;
  mutable std::mutex mu_;
  std::vector<std::string> events_;
  std::map<int, std::string> thread_names_{{0, "compute"}, {1, "pipeline sends"}};
};

// output.trace_steps' text ("2,5", "[2, 5]", "" = none) as step numbers >= 1;
// anything else is an Error naming the key.
std::vector<int> parse_trace_steps(const std::string& text);

// Rank 0's merge of every rank's events_json() fragment into one trace file,
// each rank a process named "rank r".
std::string merge_trace_json(const std::vector<std::string>& fragments);

}  // namespace trainrun
