// StepTrace: a Chrome-trace (Trace Event Format) record of one training step, written as
// {"traceEvents": [...]} that chrome://tracing and Perfetto (ui.perfetto.dev) open. Each lane is one
// "thread" of the trace: the compute, H2D and D2H streams, the host optimizer thread and the NVMe tier's I/O
// thread (reads and write-backs of the blocks' state).
// Times are seconds since the trace's origin (construction).
//
// On a GPU the WeightStreamer converts CUDA-event times of the three streams onto this clock; on the
// CPU every span is a host timestamp pair of the same phase, so the file exists and is testable
// without a GPU.
//
// Threading: add() may be called from any thread (a mutex guards the events).
#pragma once

#include <chrono>
#include <mutex>
#include <string>
#include <vector>

namespace megaslide::offload {

enum class TraceLane { kCompute = 1, kH2D = 2, kD2H = 3, kOptimizer = 4, kNvme = 5 };
const char* to_string(TraceLane lane);

class StepTrace {
 public:
  struct Event {
    TraceLane lane;
    std::string name;
    double start_s, duration_s;
  };

  StepTrace();
  double now_s() const;  // seconds since the origin, host clock
  void add(TraceLane lane, std::string name, double start_s, double duration_s);
  std::vector<Event> events() const;
  std::string to_json() const;
  // Writes to_json() atomically; throws io::IoError naming the path.
  void write(const std::string& path) const;

 private:
  std::chrono::steady_clock::time_point origin_;
  mutable std::mutex mutex_;
  std::vector<Event> events_;
};

}  // namespace megaslide::offload
