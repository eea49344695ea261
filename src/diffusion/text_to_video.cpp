#include "megaslide/diffusion/text_to_video.h"

#include <algorithm>

#include "megaslide/data/structured_motion.h"
#include "megaslide/io/vbench_layout.h"
#include "megaslide/io/video.h"

namespace megaslide {

TextToVideo::TextToVideo(TextToVideoModel model, torch::Device device, std::shared_ptr<Denoiser> denoiser,
                         std::shared_ptr<VideoCodec> codec)
    : model_(std::move(model)),
      device_(device),
      schedule_(model_.config.diffusion.timesteps, parse_beta_schedule(model_.config.diffusion.beta_schedule),
                model_.config.diffusion.beta_start, model_.config.diffusion.beta_end),
      denoiser_(std::move(denoiser)),
      codec_(std::move(codec)) {
  if (!denoiser_) model_.dit->to(device_);  // a given denoiser places the DiT itself (StreamedDenoiser keeps blocks on the host)
  if (!model_.frozen) model_.frozen = FrozenEncoders::load(model_.config, device_, "the model's config");
  const bool clip = model_.frozen && model_.frozen->has_text();
  TORCH_CHECK(clip || model_.text_encoder, "TextToVideo: the model has neither a built-in text encoder nor CLIP");
  if (!clip) {
    model_.text_encoder->to(device_);
    model_.text_encoder->eval();
  }
  model_.dit->eval();
  if (!denoiser_) denoiser_ = std::make_shared<ResidentDenoiser>(model_.dit);
  if (!codec_) {
    if (model_.frozen && model_.frozen->has_vae()) codec_ = std::make_shared<VaeCodec>(model_.frozen);
    else codec_ = std::make_shared<PixelCodec>();
  }
}

SamplerOptions TextToVideo::default_options() const {
  return SamplerOptions()
      .steps(model_.config.diffusion.sample_steps)
      .timestep_spacing(parse_timestep_spacing(model_.config.diffusion.timestep_spacing))
      .guidance_scale(model_.config.diffusion.guidance_scale)
      .prediction(parse_prediction(model_.config.diffusion.prediction));
}

std::vector<int64_t> TextToVideo::sample_shape() const {
  const auto shape = model_sample_shape(model_.config);
  return {shape.begin(), shape.end()};
}

Conditioning TextToVideo::encode(const std::vector<std::string>& prompts) {
  torch::NoGradGuard no_grad;
  Conditioning c;
  if (model_.frozen && model_.frozen->has_text()) {
    auto [text, mask] = model_.frozen->encode_text(prompts);
    c.text = text.to(device_, model_.dit->parameters().front().scalar_type());  // the DiT's dtype, as the built-in encoder's output
    c.mask = mask.to(device_);
    return c;
  }
  auto tokens = tokenizer_.encode_batch(prompts, model_.config.data.max_text_tokens);
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

std::vector<std::string> write_validation_samples(const std::string& dir, const RunConfig& config, DiT& dit,
                                                  TextEncoder& text_encoder, int64_t count, const std::vector<std::string>& dataset_captions,
                                                  std::shared_ptr<FrozenEncoders> frozen) {
  TORCH_CHECK(count >= 1, "write_validation_samples: count must be >= 1, got ", count);
  const auto& d = config.data;
  std::vector<std::string> candidates = dataset_captions;
  if (candidates.empty()) {
    StructuredMotionDataset dataset(
        StructuredMotionOptions().channels(d.channels).frames(d.frames).height(d.height).width(d.width).num_clips(d.num_clips).seed(d.seed));
    for (int64_t i = 0; i < std::min(count, dataset.size()); ++i) candidates.push_back(dataset.get(i).caption);
  }
  std::vector<std::string> captions;
  for (int64_t i = 0; i < std::min<int64_t>(count, static_cast<int64_t>(candidates.size())); ++i) {
    const auto& caption = candidates[static_cast<size_t>(i)];
    if (std::find(captions.begin(), captions.end(), caption) == captions.end()) captions.push_back(caption);
  }
  auto jobs = io::plan_vbench_samples(captions, 1, config.train.seed);
  std::vector<std::string> prompts;
  std::vector<uint64_t> seeds;
  for (const auto& job : jobs) prompts.push_back(job.prompt), seeds.push_back(job.seed);

  const bool was_training = dit->is_training();
  const auto device = dit->parameters().front().device();
  TextToVideo generator(TextToVideoModel{config, dit, text_encoder, std::move(frozen)}, device);
  const auto options = generator.default_options();
  torch::Tensor videos;
  try {
    videos = generator.generate(prompts, seeds, options);
  } catch (...) {
    dit->train(was_training);
    if (text_encoder) text_encoder->train(was_training);
    throw;
  }
  dit->train(was_training);
  if (text_encoder) text_encoder->train(was_training);

  const int64_t upscale = (d.height % 2 != 0 || d.width % 2 != 0) ? 2 : 1;
  const std::string videos_dir = io::join_path(dir, io::kVideosFolder);
  io::make_directories(videos_dir);
  std::vector<std::string> files;
  for (size_t i = 0; i < jobs.size(); ++i) {
    io::write_mp4(io::join_path(videos_dir, jobs[i].file), io::to_rgb_frames(videos[static_cast<int64_t>(i)], upscale));
    files.push_back(jobs[i].file);
  }
  io::SamplingRecord record{"(training run)", to_string(options.kind()), options.steps(), options.guidance_scale(), options.eta(),
                              config.train.seed, 8, upscale};
  io::write_file_atomically(io::join_path(dir, "index.json"), io::index_json(jobs, record));
  return files;
}

}  // namespace megaslide
