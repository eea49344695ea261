#include "megaslide/offload/step_trace.h"

#include <nlohmann/json.hpp>

#include "megaslide/io/files.h"

namespace megaslide::offload {

const char* to_string(TraceLane lane) {
  switch (lane) {
    case TraceLane::kCompute:
      return "compute stream";
    case TraceLane::kH2D:
      return "H2D stream";
    case TraceLane::kD2H:
      return "D2H stream";
    case TraceLane::kOptimizer:
      return "optimizer thread";
    case TraceLane::kNvme:
      return "NVMe I/O thread";
  }
  return "?";
}

StepTrace::StepTrace() : origin_(std::chrono::steady_clock::now()) {}

double StepTrace::now_s() const {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - origin_).count();
}

void StepTrace::add(TraceLane lane, std::string name, double start_s, double duration_s) {
  std::lock_guard<std::mutex> lock(mutex_);
  events_.push_back({lane, std::move(name), start_s, duration_s});
}

std::vector<StepTrace::Event> StepTrace::events() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return events_;
}

std::string StepTrace::to_json() const {
  nlohmann::json events = nlohmann::json::array();
  for (auto lane : {TraceLane::kCompute, TraceLane::kH2D, TraceLane::kD2H, TraceLane::kOptimizer, TraceLane::kNvme}) {
    events.push_back({{"ph", "M"},
                      {"name", "thread_name"},
                      {"pid", 1},
                      {"tid", static_cast<int>(lane)},
                      {"args", {{"name", to_string(lane)}}}});
  }
  events.push_back(
      {{"ph", "M"}, {"name", "process_name"}, {"pid", 1}, {"args", {{"name", "megaslide training step"}}}});
  for (const auto& e : this->events()) {
    events.push_back({{"ph", "X"},
                      {"name", e.name},
                      {"cat", to_string(e.lane)},
                      {"pid", 1},
                      {"tid", static_cast<int>(e.lane)},
                      {"ts", e.start_s * 1e6},
                      {"dur", e.duration_s * 1e6}});
  }
  return nlohmann::json{{"traceEvents", events}, {"displayTimeUnit", "ms"}}.dump();
}

void StepTrace::write(const std::string& path) const { io::write_file_atomically(path, to_json() + "\n"); }

}  // namespace megaslide::offload
