// Checks on the streamed engine's state shared by the trainer tests.
#pragma once

#include <gtest/gtest.h>

#include "megaslide/offload/stack_trainer.h"

namespace megaslide::testing {

// Every block's compute copy (what the next step uploads) is its master rounded as CpuAdamW rounds.
inline void expect_compute_copies_are_the_masters(const megaslide::offload::StreamedStackTrainer& engine) {
  const auto& store = engine.store();
  if (!store.compute(0).defined() || store.compute(0).scalar_type() == torch::kFloat) return;
  for (int64_t l = 0; l < store.num_blocks(); ++l) {
    EXPECT_TRUE(torch::equal(store.compute(l), store.master(l).to(store.compute(l).scalar_type())))
        << "block " << l << "'s compute copy is not its master";
  }
}

}  // namespace megaslide::testing
