// gtest main shared by every test program: fixes LibTorch's thread count so timings and reductions do
// not depend on how many other tests run beside this one on a 2-core machine.
#include <gtest/gtest.h>
#include <torch/torch.h>

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  torch::set_num_threads(1);
  return RUN_ALL_TESTS();
}
