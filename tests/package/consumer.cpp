// Links the installed libmegaslide: builds a MegaSlideDiT and runs one forward pass.
#include <megaslide/megaslide.h>

#include <iostream>
#include <type_traits>

int main() {
  auto model =
      megaslide::MegaSlideDiT(megaslide::DiTOptions().hidden(16).heads(2).layers(1).text_dim(8).dsa_kernel({3, 3, 3}));
  auto x = torch::randn({1, 3, 2, 8, 8});
  auto eps = model(x, torch::tensor({10}, torch::kLong), torch::randn({1, 4, 8}));
  // The whole API is behind the umbrella header, Wan's weights files included.
  static_assert(sizeof(megaslide::WanConfig) > 0 && std::is_class_v<megaslide::WanWeights>, "model/wan_weights.h");
  std::cout << "consumer: " << megaslide::version() << " eps " << eps.sizes() << " params "
            << megaslide::count_parameters(*model) << "\n";
  return eps.sizes() == x.sizes() ? 0 : 1;
}
