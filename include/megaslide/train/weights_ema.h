// WeightsEma: the exponential moving average of a resident trainer's weights (train.ema_decay; the
// streamed trainers keep theirs in the engine, offload/stack_trainer.h). One fp32 tensor per trained
// parameter, beside it on the training device (4 B per parameter more there), updated after each
// optimizer step with offload::ema_decay_at's decay; what a checkpoint saves (TrainingState::ema) and
// restores. Disabled (decay 0) it holds nothing and every call is a no-op.
//
// Threading: the thread that drives the trainer.
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "megaslide/offload/stack_trainer.h"
#include "megaslide/train/checkpoint.h"

namespace megaslide {

class WeightsEma {
 public:
  using Named = std::vector<std::pair<std::string, torch::Tensor>>;

  WeightsEma() = default;
  // Zero tensors beside `params` (fp32): the first update makes them the weights.
  WeightsEma(double decay, const Named& params) : decay_(decay) {
    if (decay_ <= 0) return;
    for (const auto& [name, p] : params) ema_.emplace_back(name, torch::zeros_like(p.detach()));
  }

  bool enabled() const { return decay_ > 0; }
  int64_t bytes() const {
    int64_t n = 0;
    for (const auto& [name, e] : ema_) n += static_cast<int64_t>(e.nbytes());
    return n;
  }

  // After the optimizer's `optimizer_steps`-th update of `params` (the constructor's, in its order); only
  // the parameters whose names start with `prefix` (a model trained one part per step: the step's part).
  void update(const Named& params, int64_t optimizer_steps, const std::string& prefix = "") {
    if (!enabled()) return;
    torch::NoGradGuard no_grad;
    const double decay = offload::ema_decay_at(decay_, optimizer_steps);
    for (size_t i = 0; i < ema_.size(); ++i)
      if (ema_[i].first.rfind(prefix, 0) == 0) offload::ema_update(ema_[i].second, params[i].second.detach(), decay);
  }

  // Into a checkpoint: CPU copies by parameter name.
  void save(TrainingState& s) const {
    if (!enabled()) return;
    s.ema_valid = true;
    for (const auto& [name, e] : ema_) s.ema.emplace_back(name, e.to(torch::kCPU).clone());
  }

  // From a state: its EMA by name when it holds one, else the weights `params` as they are now (a run
  // turning the EMA on at a resume). Throws c10::Error naming a parameter the state lacks.
  void load(const TrainingState& s, const Named& params, const std::string& who) {
    if (!enabled()) return;
    torch::NoGradGuard no_grad;
    std::map<std::string, size_t> index;
    for (size_t i = 0; i < s.ema.size(); ++i) index[s.ema[i].first] = i;
    for (size_t i = 0; i < ema_.size(); ++i) {
      if (!s.ema_valid) {
        ema_[i].second.copy_(params[i].second.detach());
        continue;
      }
      const auto it = index.find(ema_[i].first);
      TORCH_CHECK(it != index.end(), who, "::load_training_state: no EMA for parameter '", ema_[i].first, "'");
      const auto& value = s.ema[it->second].second;
      TORCH_CHECK(value.sizes() == ema_[i].second.sizes(), who, "::load_training_state: the EMA of '", ema_[i].first,
                  "' is ", value.sizes(), ", the model's is ", ema_[i].second.sizes());
      ema_[i].second.copy_(value);
    }
  }

  const Named& tensors() const { return ema_; }

 private:
  double decay_ = 0.0;
  Named ema_;
};

}  // namespace megaslide
