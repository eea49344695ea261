// bench_wan_step: one Wan DiT training step on the CPU — megaslide's Trainer (resident, and streamed with
// fp32 and with the machine's `auto` compute dtype) beside a plain LibTorch reference of the same math in
// the same run: the same WanTransformer module, autograd forward and backward of the flow-matching loss,
// clip_grad_norm_ and torch::optim::AdamW (what an eager PyTorch loop does). The anchor runs first and
// again last, so drift in the machine's load shows; every figure is a median over --steps steps after
// --warmup steps, and the ratios are against the first anchor. The default sizes are Wan2.1-1.3B's width
// with 2 blocks and one small latent clip (2 × 16 × 16 latents, 128 tokens; 64 text tokens), the shape of the
// diffusers comparison in docs/benchmarks.md (benchmarks/wan_step_diffusers.py runs diffusers' model at the
// same sizes). The last line is one JSON object.
//
//   build/bin/bench_wan_step [--layers 2] [--frames 2 --height 16 --width 16] [--text-tokens 64]
//                            [--steps 5] [--warmup 2] [--rows reference,resident,streamed-fp32,streamed-auto]
//                            [--set key=value ...]
#include <fmt/format.h>
#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/adamw.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <sstream>
#include <string>
#include <vector>

#include "megaslide/config/run_config.h"
#include "megaslide/diffusion/flow_matching.h"
#include "megaslide/io/files.h"
#include "megaslide/io/safetensors.h"
#include "megaslide/model/wan.h"
#include "megaslide/train/auto_settings.h"
#include "megaslide/train/trainer.h"
#include "megaslide/util/cpu_tensor_cache.h"
#include "megaslide/util/numbers.h"

namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

struct Row {
  std::string name, what;
  double step_s = 0.0, optimizer_s = 0.0, loss = 0.0;
};

// The reference: WanTransformer resident in fp32, one sample per step, LibTorch's autograd and AdamW.
Row run_reference(const megaslide::RunConfig& config, const at::Tensor& x0, const at::Tensor& text, int warmup,
                  int steps) {
  torch::manual_seed(config.train.seed);
  megaslide::WanTransformer model(megaslide::WanOptions::from_config(config));
  model->train();
  auto params = model->parameters();
  const auto& t = config.train;
  torch::optim::AdamW optimizer(
      params, torch::optim::AdamWOptions(t.lr).betas({t.beta1, t.beta2}).eps(t.eps).weight_decay(t.weight_decay));
  std::vector<double> step_s, optimizer_s;
  double loss_value = 0.0;
  for (int s = 0; s < warmup + steps; ++s) {
    const auto start = Clock::now();
    optimizer.zero_grad();
    const auto noise = torch::randn_like(x0);
    const auto sigma = torch::rand({1});
    const auto out = model->forward(megaslide::flow_noisy(x0, noise, sigma), sigma * 1000, text);
    const auto loss = torch::mse_loss(out, megaslide::flow_target(x0, noise));
    loss.backward();
    loss_value = loss.item<double>();
    const auto optimizer_start = Clock::now();
    torch::nn::utils::clip_grad_norm_(params, t.grad_clip > 0 ? t.grad_clip : 1e30);
    optimizer.step();
    if (s >= warmup) {
      optimizer_s.push_back(seconds_since(optimizer_start));
      step_s.push_back(seconds_since(start));
    }
  }
  return {"reference", "LibTorch: autograd, clip_grad_norm_, torch::optim::AdamW", median(step_s), median(optimizer_s),
          loss_value};
}

Row run_trainer(const std::string& name, megaslide::RunConfig config, int warmup, int steps) {
  auto trainer = megaslide::make_trainer(config);
  std::vector<double> step_s, optimizer_s;
  double loss_value = 0.0;
  for (int s = 0; s < warmup + steps; ++s) {
    const auto m = trainer.step();
    loss_value = m.loss;
    if (s >= warmup) {
      step_s.push_back(m.step_time_s);
      optimizer_s.push_back(m.optimizer_s);
    }
  }
  trainer.synchronize();
  const auto& c = trainer.config();
  const std::string what =
      c.offload.enabled ? "Trainer, streamed, " + c.offload.compute_dtype + " compute" : "Trainer, resident (fp32)";
  return {name, what, median(step_s), median(optimizer_s), loss_value};
}

}  // namespace

int run(int argc, char** argv) {
  // As the megaslide-* tools do, for every row alike (docs/benchmarks.md: diffusers' process has no such cache).
  const int64_t tensor_cache = megaslide::util::install_cpu_tensor_cache_from_environment();
  int layers = 2, frames = 2, height = 16, width = 16, text_tokens = 64, steps = 5, warmup = 2;
  std::string rows_flag = "reference,resident,streamed-fp32,streamed-auto";
  std::vector<std::string> overrides;
  for (int i = 1; i < argc; i += 2) {
    const std::string flag = argv[i];
    if (i + 1 >= argc) {
      std::fprintf(stderr, "bench_wan_step: %s needs a value\n", flag.c_str());
      return 2;
    }
    const char* value = argv[i + 1];
    if (flag == "--layers") layers = std::atoi(value);
    else if (flag == "--frames") frames = std::atoi(value);
    else if (flag == "--height") height = std::atoi(value);
    else if (flag == "--width") width = std::atoi(value);
    else if (flag == "--text-tokens") text_tokens = std::atoi(value);
    else if (flag == "--steps") steps = std::atoi(value);
    else if (flag == "--warmup") warmup = std::atoi(value);
    else if (flag == "--rows") rows_flag = value;
    else if (flag == "--set") overrides.push_back(value);
    else {
      std::fprintf(stderr, "bench_wan_step: unknown flag %s\n", flag.c_str());
      return 2;
    }
  }
  if (layers < 1 || frames < 1 || height < 2 || width < 2 || text_tokens < 1 || steps < 1 || warmup < 0) {
    std::fprintf(stderr,
                 "bench_wan_step: --layers, --frames, --text-tokens, --steps must be >= 1, --height and "
                 "--width >= 2, --warmup >= 0\n");
    return 2;
  }
  std::vector<std::string> rows;
  {
    std::stringstream list(rows_flag);
    for (std::string r; std::getline(list, r, ',');) {
      if (r != "reference" && r != "resident" && r != "streamed-fp32" && r != "streamed-auto") {
        std::fprintf(stderr,
                     "bench_wan_step: --rows: unknown row '%s' (reference, resident, streamed-fp32, "
                     "streamed-auto)\n",
                     r.c_str());
        return 2;
      }
      rows.push_back(r);
    }
  }

  const std::string dir = "/tmp/bench-wan-step-" + std::to_string(::getpid());
  megaslide::io::make_directories(dir);
  // Removed however main ends, an error included.
  struct RemoveDir {
    std::string path;
    ~RemoveDir() {
      try {
        megaslide::io::remove_tree(path);
      } catch (...) {
      }
    }
  } remove_dir{dir};
  const std::string tensors = dir + "/latents.safetensors";
  const std::string yaml = fmt::format(R"(
model:
  arch: wan
  wan: {{dim: 1536, layers: {}, heads: 12, ffn_dim: 8960, freq_dim: 256, text_dim: 4096, patch: [1, 2, 2],
        in_channels: 16, out_channels: 16, qk_norm: true, cross_attn_norm: true, eps: 1.0e-6}}
data: {{dataset: latent-tensors, tensors: {}, channels: 16, frames: {}, height: {}, width: {}, max_text_tokens: {}}}
diffusion: {{objective: flow, shift: 5.0, caption_dropout: 0.0}}
train: {{steps: 1000, batch_size: 1, lr: 1.0e-5, warmup_steps: 0, lr_schedule: constant, weight_decay: 0.01,
        grad_clip: 1.0, checkpoint_every: 0, device: cpu, seed: 3}}
offload: {{enabled: false, compute_dtype: fp32}}
)",
                                       layers, tensors, frames, height, width, text_tokens);
  const auto config = megaslide::parse_run_config(yaml, "bench_wan_step", overrides);
  const auto& d = config.data;
  torch::manual_seed(7);
  const auto latents = torch::randn({2, d.channels, d.frames, d.height, d.width});
  const auto text = 0.1 * torch::randn({2, d.max_text_tokens, config.model.wan.text_dim});
  megaslide::io::write_safetensors(tensors,
                                   {{"latents", latents},
                                    {"text", text},
                                    {"empty_text", torch::zeros({d.max_text_tokens, config.model.wan.text_dim})}});

  const auto threads = megaslide::plan_threads(config, torch::kCPU);
  megaslide::apply_threads(threads);
  const auto auto_dtype = megaslide::resolve_compute_dtype("auto", torch::kCPU);
  std::printf("Wan DiT, dim 1536, %d block(s), latents 16 x %d x %d x %d (%d tokens), %d text tokens; %s\n", layers,
              frames, height, width, frames * (height / 2) * (width / 2), text_tokens, threads.describe().c_str());
  std::printf("auto compute dtype here: %s (%s)\n", auto_dtype.dtype.c_str(), auto_dtype.reason.c_str());
  std::printf("median of %d steps after %d warm-up steps; CPU tensor cache %s\n\n", steps, warmup,
              tensor_cache > 0 ? ("cap " + megaslide::human_bytes(static_cast<double>(tensor_cache))).c_str()
                               : "off (MEGASLIDE_CPU_TENSOR_CACHE)");

  // The anchor first and again last.
  if (!rows.empty() && rows.front() == "reference") rows.push_back("reference");
  std::vector<Row> results;
  for (const auto& r : rows) {
    Row row;
    if (r == "reference") {
      row = run_reference(config, latents.slice(0, 0, 1), text.slice(0, 0, 1), warmup, steps);
    } else {
      auto c = config;
      c.offload.enabled = r != "resident";
      c.offload.compute_dtype = r == "streamed-auto" ? auto_dtype.dtype : "fp32";
      row = run_trainer(r, c, warmup, steps);
    }
    std::printf("  %-14s %7.3f s/step  (optimizer %.3f s)  loss %.4f  %s\n", row.name.c_str(), row.step_s,
                row.optimizer_s, row.loss, row.what.c_str());
    std::fflush(stdout);
    results.push_back(row);
  }

  const double anchor = !results.empty() && results.front().name == "reference" ? results.front().step_s : 0.0;
  std::string json = fmt::format(
      "{{\"bench\":\"wan_step\",\"layers\":{},\"tokens\":{},\"text_tokens\":{},\"threads\":{},\"cpu_tensor_cache_"
      "bytes\":{}",
      layers, frames * (height / 2) * (width / 2), text_tokens, threads.intra_op, tensor_cache);
  if (anchor > 0) {
    std::printf("\nstep time / the reference's (first run; below 1 is faster):\n");
    for (size_t i = 1; i < results.size(); ++i)
      std::printf("  %-14s %.2fx\n", results[i].name.c_str(), results[i].step_s / anchor);
  }
  for (size_t i = 0; i < results.size(); ++i) {
    const auto key = results[i].name + (i > 0 && results[i].name == "reference" ? "_again" : "");
    json +=
        fmt::format(",\"{}_s\":{:.4f},\"{}_optimizer_s\":{:.4f}", key, results[i].step_s, key, results[i].optimizer_s);
  }
  std::printf("%s}\n", json.c_str());
  return 0;
}

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {  // after run's scratch folder is gone
    std::fprintf(stderr, "bench_wan_step: %s\n", e.what());
    return 1;
  }
}
