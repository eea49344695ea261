#include "megaslide/diffusion/text_to_video.h"

namespace megaslide {

TextToVideo::TextToVideo(TextToVideoModel model, torch::Device device, std::shared_ptr<Denoiser> denoiser,
                         std::shared_ptr<VideoCodec> codec)
    : model_(std::move(model)),
      device_(device),
      schedule_(model_.config.diffusion.timesteps, parse_beta_schedule(model_.config.diffusion.beta_schedule),
                model_.config.diffusion.beta_start, model_.config.diffusion.beta_end),
      denoiser_(std::move(denoiser)),
      codec_(std::move(codec)) {
  model_.dit->to(device_);
  model_.text_encoder->to(device_);
  model_.dit->eval();
  model_.text_encoder->eval();
  if (!denoiser_) denoiser_ = std::make_shared<ResidentDenoiser>(model_.dit);
  if (!codec_) codec_ = std::make_shared<PixelCodec>();
}

SamplerOptions TextToVideo::default_options() const {
  return SamplerOptions().steps(model_.config.diffusion.sample_steps).guidance_scale(model_.config.diffusion.guidance_scale);
}

std::vector<int64_t> TextToVideo::sample_shape() const {
  const auto& d = model_.config.data;
  return {d.channels, d.frames, d.height, d.width};
}

Conditioning TextToVideo::encode(const std::vector<std::string>& prompts) {
  torch::NoGradGuard no_grad;
  auto tokens = tokenizer_.encode_batch(prompts, model_.config.data.max_text_tokens);
  Conditioning c;
  c.text = model_.text_encoder->forward(tokens.ids.to(device_));
  c.mask = tokens.mask.to(device_);
  return c;
}

torch::Tensor TextToVideo::generate(const std::vector<std::string>& prompts, const std::vector<uint64_t>& seeds,
                                    const SamplerOptions& options, const std::function<void(int64_t, int64_t)>& on_step) {
  TORCH_CHECK(prompts.size() == seeds.size() && !prompts.empty(), "TextToVideo::generate: need one seed per prompt, got ",
              prompts.size(), " prompts and ", seeds.size(), " seeds");
  auto cond = encode(prompts);
  auto uncond = encode({""});
  auto samples = sample(*denoiser_, schedule_, options, sample_shape(), seeds, cond, uncond, device_, on_step);
  torch::NoGradGuard no_grad;
  return codec_->decode(samples).to(torch::kCPU, torch::kFloat32);
}

}  // namespace megaslide
