// bench_streamer: the cost of streaming alone, on the CPU. Three trainers of one DiT config (8 blocks
// by default) step in turn, interleaved so that load from other processes hits them alike:
//   - the streamed Trainer, offload.mode async (the streamed trainer as shipped, fp32 compute);
//   - the same in sync mode (every copy and update in line);
//   - the anchor: a resident loop with the *same* activation checkpointing (block inputs kept, each
//     block recomputed in the backward), the same host optimizer (CpuAdamW on the same flat fp32
//     master/m/v buffers, right after each block's backward) and the same resident prologue/epilogue
//     with LibTorch's AdamW, but no copies: the blocks' parameters are the host buffers themselves.
// So streamed_vs_resident_step_ratio is what the slots, the copies and the scheduling cost. A fourth
// trainer, LoRA (lora.rank 16 on every Linear of the blocks) on the same streamed model, steps beside them:
// lora_vs_full_step_ratio is its step against the full fine-tuning step (async), with its bytes each way
// (H2D as full fine-tuning's, no D2H); a fifth, the same LoRA on an fp8 base (lora.base_dtype fp8), gives
// fp8_vs_compute_upload_ratio: its H2D bytes against the LoRA's (fp32 compute here: 1/4; bf16 blocks: 1/2).
// Bytes per step are checked against DESIGN.md §6: 2·P·e bytes up for the forward and 2·P·e for the
// recompute (e = bytes per compute element), less the two blocks the backward finds still in the
// slots; P·e bytes of gradient down. The last line is one JSON object.
//
//   build/bin/bench_streamer [--layers L] [--hidden D] [--steps S] [--threads T]
//   build/bin/bench_streamer --pinned-bandwidth 1      (GPU: pinned-copy GB/s, one JSON line)
#include <torch/types.h>
#include <torch/optim/adamw.h>
#include <torch/cuda.h>
#include <torch/autograd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "megaslide/offload/cpu_adamw.h"
#include "megaslide/train/dit_family.h"
#include "megaslide/offload/host_param_store.h"
#include "megaslide/train/trainer.h"

namespace {

using namespace megaslide;
using Clock = std::chrono::steady_clock;

int64_t int_flag(int argc, char** argv, const char* name, int64_t fallback) {
  for (int i = 1; i + 1 < argc; ++i)
    if (std::strcmp(argv[i], name) == 0) return std::strtoll(argv[i + 1], nullptr, 10);
  return fallback;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// The anchor: resident, checkpointed, CpuAdamW on flat host buffers that the modules use directly.
class ResidentCheckpointed {
 public:
  explicit ResidentCheckpointed(const RunConfig& config, int optimizer_threads)
      : config_(config),
        batches_(config),
        adamw_(offload::AdamWOptions{config.train.lr, config.train.beta1, config.train.beta2, config.train.eps,
                                     config.train.weight_decay},
               optimizer_threads) {
    torch::manual_seed(config.train.seed);
    model_ = DiT(DiTOptions::from_config(config));
    text_encoder_ = TextEncoder(
        TextEncoderOptions(batches_.tokenizer().vocab_size(), config.model.text_dim, config.data.max_text_tokens));
    std::vector<offload::BlockSpec> specs;
    for (size_t l = 0; l < model_->blocks->size(); ++l) {
      offload::BlockSpec spec{"blocks." + std::to_string(l), {}};
      for (const auto& item : model_->blocks[l]->named_parameters(true))
        spec.params.push_back({item.key(), item.value().sizes().vec()});
      specs.push_back(spec);
    }
    offload::HostParamStoreOptions o;
    o.separate_grad = true;  // an fp32 gradient per block, where autograd accumulates
    store_ = std::make_unique<offload::HostParamStore>(specs, o);
    for (size_t l = 0; l < model_->blocks->size(); ++l) {
      for (const auto& item : model_->blocks[l]->named_parameters(true)) {
        auto views = store_->param(static_cast<int64_t>(l), item.key());
        views.master.copy_(item.value().detach());
        item.value().set_data(views.master);
        item.value().mutable_grad() = views.grad;
      }
    }
    for (const auto& item : model_->named_parameters(true))
      if (item.key().rfind("blocks.", 0) != 0) resident_.push_back(item.value());
    for (auto& p : text_encoder_->parameters()) resident_.push_back(p);
    const auto& t = config.train;
    optimizer_ = std::make_unique<torch::optim::AdamW>(
        resident_, torch::optim::AdamWOptions(t.lr).betas({t.beta1, t.beta2}).eps(t.eps).weight_decay(t.weight_decay));
  }

  double step() {
    const auto start = Clock::now();
    const double lr = learning_rate(config_.train, steps_);
    ++steps_;
    for (auto& group : optimizer_->param_groups()) static_cast<torch::optim::AdamWOptions&>(group.options()).lr(lr);
    optimizer_->zero_grad();
    auto b = batches_.next(torch::kCPU);
    auto text = text_encoder_(b.text_ids);
    auto e = model_->embed(b.xt, b.timesteps, text, b.text_mask);
    BlockContext ctx = e.ctx;
    ctx.t_mod = e.ctx.t_mod.detach().requires_grad_(true);
    ctx.text = e.ctx.text.detach().requires_grad_(true);
    const int64_t L = static_cast<int64_t>(model_->blocks->size());
    std::vector<torch::Tensor> saved(L);
    auto x = e.tokens.detach();
    {
      torch::NoGradGuard no_grad;
      for (int64_t l = 0; l < L; ++l) {
        saved[l] = x;
        x = model_->blocks[l]->as<DiTBlockImpl>()->forward(x, ctx);
      }
    }
    auto last = x.detach().requires_grad_(true);
    auto loss = epsilon_loss(model_->head(last, e.t_emb, e.ctx.grid), b.noise);
    loss.backward({}, true);
    auto grad = last.grad();
    for (int64_t l = L - 1; l >= 0; --l) {
      store_->grad(l).zero_();
      auto input = saved[l].detach().requires_grad_(true);
      torch::autograd::backward({model_->blocks[l]->as<DiTBlockImpl>()->forward(input, ctx)}, {grad});
      grad = input.grad();
      saved[l] = torch::Tensor();
      adamw_.step_block(store_->master(l), store_->exp_avg(l), store_->exp_avg_sq(l), store_->grad(l), {}, steps_, lr);
    }
    torch::autograd::backward({e.tokens, e.ctx.t_mod, e.ctx.text}, {grad, ctx.t_mod.grad(), ctx.text.grad()});
    optimizer_->step();
    loss.item<double>();
    return std::chrono::duration<double>(Clock::now() - start).count();
  }

 private:
  RunConfig config_;
  DiffusionBatchSource batches_;
  offload::CpuAdamW adamw_;
  DiT model_{nullptr};
  TextEncoder text_encoder_{nullptr};
  std::unique_ptr<offload::HostParamStore> store_;
  std::vector<torch::Tensor> resident_;
  std::unique_ptr<torch::optim::AdamW> optimizer_;
  int64_t steps_ = 0;
};

}  // namespace

// Pinned host <-> device copy bandwidth (GB/s), 1 GiB each way, best of 5: the anchor for the GPU
// check's H2D figures (benchmarks/gpu/streamer.sh).
int pinned_bandwidth() {
  if (!torch::cuda::is_available()) {
    std::printf("{\"bench\":\"pinned_bandwidth\",\"error\":\"no GPU\"}\n");
    return 1;
  }
  const int64_t n = int64_t{1} << 30;
  auto host = torch::empty({n}, torch::TensorOptions().dtype(torch::kUInt8).pinned_memory(true));
  auto dev = torch::empty({n}, torch::TensorOptions().dtype(torch::kUInt8).device(torch::kCUDA));
  const auto best_gbps = [&](bool h2d) {
    double best = 0.0;
    for (int i = 0; i < 6; ++i) {
      torch::cuda::synchronize();
      const auto t0 = Clock::now();
      if (h2d) dev.copy_(host, true);
      else host.copy_(dev, true);
      torch::cuda::synchronize();
      const double s = std::chrono::duration<double>(Clock::now() - t0).count();
      if (i > 0) best = std::max(best, static_cast<double>(n) / s / 1e9);
    }
    return best;
  };
  const double h2d = best_gbps(true), d2h = best_gbps(false);
  std::printf("{\"bench\":\"pinned_bandwidth\",\"pinned_h2d_gbps\":%.2f,\"pinned_d2h_gbps\":%.2f}\n", h2d, d2h);
  return 0;
}

int main(int argc, char** argv) {
  if (int_flag(argc, argv, "--pinned-bandwidth", 0) != 0) return pinned_bandwidth();
  const int64_t layers = int_flag(argc, argv, "--layers", 8);
  const int64_t hidden = int_flag(argc, argv, "--hidden", 96);
  const int64_t steps = int_flag(argc, argv, "--steps", 8);
  const int64_t threads = int_flag(argc, argv, "--threads", 2);
  const int optimizer_threads = 1;
  auto config = parse_run_config(
      "", "bench_streamer",
      {"model.arch=megaslide", "model.layers=" + std::to_string(layers), "model.hidden=" + std::to_string(hidden),
       "model.heads=4", "model.text_dim=32", "model.dsa_kernel=[3,5,5]", "data.frames=8", "data.height=16",
       "data.width=16", "train.batch_size=2", "train.grad_clip=0", "train.device=cpu",
       "train.threads=" + std::to_string(threads), "train.steps=" + std::to_string(steps + 2),
       "offload.compute_dtype=fp32", "offload.optimizer_threads=" + std::to_string(optimizer_threads)});
  auto sync_config = config;
  sync_config.offload.mode = "sync";

  auto lora_config = config;
  lora_config.lora.rank = 16;
  Trainer async_trainer = make_trainer(config), sync_trainer = make_trainer(sync_config);  // offload.enabled: true
  Trainer lora_trainer = make_trainer(lora_config);
  auto fp8_config = lora_config;
  fp8_config.lora.base_dtype = "fp8";
  Trainer fp8_trainer = make_trainer(fp8_config);
  ResidentCheckpointed resident(config, optimizer_threads);
  std::vector<double> t_async, t_sync, t_resident, t_lora, t_fp8, exposed;
  int64_t h2d = 0, d2h = 0, lora_h2d = 0, lora_d2h = 0, fp8_h2d = 0;
  for (int64_t i = 0; i < steps + 2; ++i) {  // the first two steps warm up
    auto a = async_trainer.step();
    auto s = sync_trainer.step();
    const double r = resident.step();
    auto l = lora_trainer.step();
    auto f = fp8_trainer.step();
    if (i < 2) continue;
    t_fp8.push_back(f.step_time_s);
    fp8_h2d = f.h2d_bytes;
    t_lora.push_back(l.step_time_s);
    lora_h2d = l.h2d_bytes;
    lora_d2h = l.d2h_bytes;
    t_async.push_back(a.step_time_s);
    t_sync.push_back(s.step_time_s);
    t_resident.push_back(r);
    exposed.push_back(a.exposed_transfer_s);
    h2d = a.h2d_bytes;
    d2h = a.d2h_bytes;
  }
  async_trainer.synchronize();

  const auto& store = async_trainer.engine()->store();
  const int64_t P = store.memory_report().num_params;
  const int64_t e = 4;  // fp32 compute
  const int64_t cached = store.block_numel(layers - 1) + (layers >= 2 ? store.block_numel(layers - 2) : 0);
  const double h2d_model = static_cast<double>(2 * P * e - cached * e);
  const double d2h_model = static_cast<double>(P * e);
  const double ratio = median(t_async) / median(t_resident);
  const int64_t slots = async_trainer.engine()->streamer().max_resident_blocks();
  std::printf(
      "bench_streamer: MegaSlideDiT %lld blocks x hidden %lld, %lld streamed params (%lld per block), %lld tokens x "
      "batch 2,\n"
      "  fp32 compute, %lld LibTorch threads, CpuAdamW %d thread; median of %lld steps after 2 warm-up\n",
      static_cast<long long>(layers), static_cast<long long>(hidden), static_cast<long long>(P),
      static_cast<long long>(store.block_numel(0)), static_cast<long long>(async_trainer.tokens_per_sample()),
      static_cast<long long>(threads), optimizer_threads, static_cast<long long>(steps));
  std::printf("  resident, checkpointed (anchor)  %8.1f ms/step\n", median(t_resident) * 1e3);
  std::printf("  streamed, async                  %8.1f ms/step  (%.3fx; exposed transfer %.2f ms)\n",
              median(t_async) * 1e3, ratio, median(exposed) * 1e3);
  std::printf("  streamed, sync                   %8.1f ms/step  (%.3fx)\n", median(t_sync) * 1e3,
              median(t_sync) / median(t_resident));
  std::printf("  H2D %lld B/step vs DESIGN.md §6 model %.0f B (%.4fx; without the cache 4·P = %lld B)\n",
              static_cast<long long>(h2d), h2d_model, h2d / h2d_model, static_cast<long long>(2 * P * e));
  std::printf("  D2H %lld B/step vs model %.0f B (%.4fx); max blocks on the device at once: %lld\n",
              static_cast<long long>(d2h), d2h_model, d2h / d2h_model, static_cast<long long>(slots));
  const double lora_ratio = median(t_lora) / median(t_async);
  std::printf(
      "  LoRA rank 16, streamed async     %8.1f ms/step  (%.3fx the full fine-tuning step; %lld trained params; "
      "H2D %lld B, D2H %lld B)\n",
      median(t_lora) * 1e3, lora_ratio, static_cast<long long>(lora_trainer.parameter_count()),
      static_cast<long long>(lora_h2d), static_cast<long long>(lora_d2h));
  const double fp8_ratio = static_cast<double>(fp8_h2d) / static_cast<double>(lora_h2d);
  std::printf("  LoRA on an fp8 base              %8.1f ms/step  (H2D %lld B: %.4fx the fp32 blocks' bytes)\n",
              median(t_fp8) * 1e3, static_cast<long long>(fp8_h2d), fp8_ratio);
  std::printf(
      "{\"bench\":\"streamer\",\"layers\":%lld,\"hidden\":%lld,\"streamed_params\":%lld,\"resident_step_ms\":%.3f,"
      "\"async_step_ms\":%.3f,\"sync_step_ms\":%.3f,\"streamed_vs_resident_step_ratio\":%.4f,"
      "\"sync_vs_resident_step_ratio\":%.4f,\"exposed_transfer_ms\":%.3f,\"h2d_bytes\":%lld,\"h2d_bytes_model\":%.0f,"
      "\"h2d_bytes_vs_model\":%.4f,\"d2h_bytes\":%lld,\"d2h_bytes_vs_model\":%.4f,\"max_device_weight_slots\":%lld,"
      "\"lora_step_ms\":%.3f,\"lora_vs_full_step_ratio\":%.4f,\"lora_h2d_bytes\":%lld,\"lora_d2h_bytes\":%lld,"
      "\"fp8_lora_step_ms\":%.3f,\"fp8_h2d_bytes\":%lld,\"fp8_vs_compute_upload_ratio\":%.4f}\n",
      static_cast<long long>(layers), static_cast<long long>(hidden), static_cast<long long>(P),
      median(t_resident) * 1e3, median(t_async) * 1e3, median(t_sync) * 1e3, ratio, median(t_sync) / median(t_resident),
      median(exposed) * 1e3, static_cast<long long>(h2d), h2d_model, h2d / h2d_model, static_cast<long long>(d2h),
      d2h / d2h_model, static_cast<long long>(slots), median(t_lora) * 1e3, lora_ratio,
      static_cast<long long>(lora_h2d), static_cast<long long>(lora_d2h), median(t_fp8) * 1e3,
      static_cast<long long>(fp8_h2d), fp8_ratio);
  return 0;
}
