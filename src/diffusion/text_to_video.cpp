#include "megaslide/diffusion/text_to_video.h"

#include <fmt/format.h>

#include <algorithm>

#include "megaslide/data/structured_motion.h"
#include "megaslide/io/vbench_layout.h"
#include "megaslide/io/video.h"

namespace megaslide {

std::shared_ptr<Denoiser> sampling_denoiser(DiT dit, torch::Device device, StreamChoice stream,
                                            c10::ScalarType compute_dtype, bool* streamed) {
  int64_t weight_bytes = 0;
  for (const auto& p : dit->parameters()) weight_bytes += static_cast<int64_t>(p.nbytes());
  const bool stream_it = should_stream(stream, device, weight_bytes);
  if (streamed != nullptr) *streamed = stream_it;
  if (stream_it) {
    StreamedDenoiserOptions so;
    so.device = device;
    so.compute_dtype = compute_dtype;
    return std::make_shared<StreamedDenoiser>(dit, so);
  }
  if (compute_dtype == c10::ScalarType::Float) return nullptr;
  dit->to(device);
  return std::make_shared<ResidentDenoiser>(dit, compute_dtype);
}

TextToVideo::TextToVideo(TextToVideoModel model, torch::Device device, std::shared_ptr<Denoiser> denoiser,
                         std::shared_ptr<VideoCodec> codec)
    : model_(std::move(model)),
      device_(device),
      schedule_(model_.config.diffusion.timesteps, parse_beta_schedule(model_.config.diffusion.beta_schedule),
                model_.config.diffusion.beta_start, model_.config.diffusion.beta_end),
      denoiser_(std::move(denoiser)),
      codec_(std::move(codec)) {
  if (!denoiser_)
    model_.dit->to(device_);  // a given denoiser places the DiT itself (StreamedDenoiser keeps blocks on the host)
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

int64_t TextToVideo::prompt_tokens(const std::string& prompt) const {
  if (model_.frozen && model_.frozen->has_text()) return model_.frozen->prompt_tokens(prompt);
  // The built-in tokenizer: at most one word a character, after <bos>; the ids before the padding.
  const auto ids = tokenizer_.encode(prompt, static_cast<int64_t>(prompt.size()) + 2);
  return static_cast<int64_t>(std::find(ids.begin(), ids.end(), CaptionTokenizer::kPad) - ids.begin());
}

Conditioning TextToVideo::encode(const std::vector<std::string>& prompts) {
  torch::NoGradGuard no_grad;
  Conditioning c;
  if (model_.frozen && model_.frozen->has_text()) {
    auto [text, mask] = model_.frozen->encode_text(prompts);
    c.text = text.to(
        device_, model_.dit->parameters().front().scalar_type());  // the DiT's dtype, as the built-in encoder's output
    c.mask = mask.to(device_);
    return c;
  }
  auto tokens = tokenizer_.encode_batch(prompts, model_.config.data.max_text_tokens);
  c.text = model_.text_encoder->forward(tokens.ids.to(device_));
  c.mask = tokens.mask.to(device_);
  return c;
}

torch::Tensor TextToVideo::generate(const std::vector<std::string>& prompts, const std::vector<uint64_t>& seeds,
                                    const SamplerOptions& options, const std::function<void(int64_t, int64_t)>& on_step,
                                    const std::vector<int64_t>& shape, const std::string& negative) {
  TORCH_CHECK(prompts.size() == seeds.size() && !prompts.empty(),
              "TextToVideo::generate: need one seed per prompt, got ", prompts.size(), " prompts and ", seeds.size(),
              " seeds");
  auto cond = encode(prompts);
  auto uncond = encode({negative});
  auto samples = sample(*denoiser_, schedule_, options, shape.empty() ? sample_shape() : shape, seeds, cond, uncond,
                        device_, on_step);
  torch::NoGradGuard no_grad;
  return codec_->decode(samples).to(torch::kCPU, torch::kFloat32);
}

std::vector<ValidationVideo> plan_validation_videos(const RunConfig& config, const std::vector<std::string>& prompts,
                                                    const std::string& source) {
  const auto run = model_sample_shape(config);
  const std::vector<int64_t> run_shape(run.begin(), run.end());
  std::vector<ValidationVideo> out;
  if (config.train.sample_prompts.empty()) {
    for (auto& job : io::plan_vbench_samples(prompts, 1, config.train.seed)) out.push_back({std::move(job), run_shape});
    return out;
  }
  try {
    const auto specs = io::read_prompt_specs(config.train.sample_prompts);
    for (const auto& spec : specs)
      if (spec.image)
        throw std::invalid_argument(fmt::format(
            "prompt file '{}' line {}: --i is megaslide-sample's; a run's validation videos of image-to-video start "
            "from its data's images (Wan2.2 TI2V with diffusion.first_frame_clean: its clips' first frames)",
            spec.file, spec.line));
    return plan_prompt_videos(config, specs, 1, config.train.seed);
  } catch (const std::exception& e) {
    throw ConfigError(source, "train.sample_prompts", e.what());
  }
}

std::vector<ValidationVideo> plan_prompt_videos(const RunConfig& config, const std::vector<io::PromptSpec>& specs,
                                                int64_t samples_per_line, uint64_t base_seed) {
  const auto run = model_sample_shape(config);
  const std::vector<int64_t> run_shape(run.begin(), run.end());
  auto jobs = io::plan_prompt_specs(specs, base_seed, samples_per_line);
  const VideoSize size = run_video_size(config);
  std::vector<ValidationVideo> out;
  for (size_t i = 0; i < jobs.size(); ++i) {
    const auto& spec = specs[i / static_cast<size_t>(samples_per_line)];
    ValidationVideo video{std::move(jobs[i]), run_shape};
    const std::string where = fmt::format("prompt file '{}' line {}", spec.file, spec.line);
    if (spec.has_size()) {
      const VideoSize own{spec.frames.value_or(size.frames), spec.height.value_or(size.height),
                          spec.width.value_or(size.width)};
      try {
        const auto shape = model_sample_shape_at(config, own);
        video.shape.assign(shape.begin(), shape.end());
      } catch (const std::invalid_argument& e) {
        throw std::invalid_argument(fmt::format("{}: this model cannot sample {}x{}x{} (frames x height x width): {}",
                                                where, own.frames, own.height, own.width, e.what()));
      }
      video.job.frames = own.frames, video.job.height = own.height, video.job.width = own.width;
    }
    if (spec.image && config.model.arch != Architecture::kWan)
      throw std::invalid_argument(fmt::format("{}: --i: image-to-video is Wan's; this model is text-to-video", where));
    if (spec.steps && config.diffusion.objective == "ddpm" && *spec.steps > config.diffusion.timesteps)
      throw std::invalid_argument(
          fmt::format("{}: --s {} exceeds diffusion.timesteps ({}): DDPM sampling respaces the training "
                      "timesteps",
                      where, *spec.steps, config.diffusion.timesteps));
    out.push_back(std::move(video));
  }
  return out;
}

bool same_sampling_settings(const ValidationVideo& a, const ValidationVideo& b) {
  return a.shape == b.shape && a.job.steps == b.job.steps && a.job.guidance_scale == b.job.guidance_scale &&
         a.job.negative_prompt == b.job.negative_prompt && a.job.image == b.job.image;
}

std::vector<std::string> dit_validation_prompts(const RunConfig& config, int64_t count,
                                                const std::vector<std::string>& dataset_captions) {
  TORCH_CHECK(count >= 1, "dit_validation_prompts: count must be >= 1, got ", count);
  const auto& d = config.data;
  std::vector<std::string> candidates = dataset_captions;
  if (candidates.empty()) {
    StructuredMotionDataset dataset(StructuredMotionOptions()
                                        .channels(d.channels)
                                        .frames(d.frames)
                                        .height(d.height)
                                        .width(d.width)
                                        .num_clips(d.num_clips)
                                        .seed(d.seed));
    for (int64_t i = 0; i < std::min(count, dataset.size()); ++i) candidates.push_back(dataset.get(i).caption);
  }
  std::vector<std::string> captions;
  for (int64_t i = 0; i < std::min<int64_t>(count, static_cast<int64_t>(candidates.size())); ++i) {
    const auto& caption = candidates[static_cast<size_t>(i)];
    if (std::find(captions.begin(), captions.end(), caption) == captions.end()) captions.push_back(caption);
  }
  return captions;
}

std::vector<std::string> write_validation_samples(const std::string& dir, const RunConfig& config, DiT& dit,
                                                  TextEncoder& text_encoder, const std::vector<ValidationVideo>& videos,
                                                  std::shared_ptr<FrozenEncoders> frozen,
                                                  std::shared_ptr<Denoiser> denoiser) {
  TORCH_CHECK(!videos.empty(), "write_validation_samples: no videos");
  const bool was_training = dit->is_training();
  const auto device = dit->parameters().front().device();  // the patch embedding's: resident either way
  TextToVideo generator(TextToVideoModel{config, dit, text_encoder, std::move(frozen)}, device, std::move(denoiser));
  const auto defaults = generator.default_options();
  const auto run_shape = generator.sample_shape();
  const auto own_settings = [&](const ValidationVideo& v) {
    return v.shape != run_shape || v.job.steps || v.job.guidance_scale || v.job.negative_prompt;
  };
  std::vector<torch::Tensor> pixels(videos.size());  // each [C, T, H, W]
  try {
    // The videos at the run's settings in one batch, as before prompt files; the others one at a time.
    std::vector<std::string> prompts;
    std::vector<uint64_t> seeds;
    std::vector<size_t> batched;
    for (size_t i = 0; i < videos.size(); ++i)
      if (!own_settings(videos[i]))
        prompts.push_back(videos[i].job.prompt), seeds.push_back(videos[i].job.seed), batched.push_back(i);
    if (!batched.empty()) {
      const auto batch = generator.generate(prompts, seeds, defaults);
      for (size_t k = 0; k < batched.size(); ++k) pixels[batched[k]] = batch[static_cast<int64_t>(k)];
    }
    for (size_t i = 0; i < videos.size(); ++i) {
      if (!own_settings(videos[i])) continue;
      const auto& job = videos[i].job;
      auto options = defaults;
      if (job.steps) options.steps(*job.steps);
      if (job.guidance_scale) options.guidance_scale(*job.guidance_scale);
      pixels[i] = generator.generate({job.prompt}, {job.seed}, options, {}, videos[i].shape,
                                     job.negative_prompt.value_or(""))[0];
    }
  } catch (...) {
    dit->train(was_training);
    if (text_encoder) text_encoder->train(was_training);
    throw;
  }
  dit->train(was_training);
  if (text_encoder) text_encoder->train(was_training);

  int64_t upscale = 1;  // H.264 needs even sizes: every video upscaled when one has an odd side
  for (const auto& p : pixels)
    if (p.size(2) % 2 != 0 || p.size(3) % 2 != 0) upscale = 2;
  const std::string videos_dir = io::join_path(dir, io::kVideosFolder);
  io::make_directories(videos_dir);
  std::vector<std::string> files;
  std::vector<io::SampleJob> jobs;
  for (size_t i = 0; i < videos.size(); ++i) {
    io::write_mp4(io::join_path(videos_dir, videos[i].job.file), io::to_rgb_frames(pixels[i], upscale));
    files.push_back(videos[i].job.file);
    jobs.push_back(videos[i].job);
  }
  io::SamplingRecord record{"(training run)",
                            to_string(defaults.kind()),
                            defaults.steps(),
                            defaults.guidance_scale(),
                            defaults.eta(),
                            config.train.seed,
                            8,
                            upscale};
  record.timestep_spacing = to_string(defaults.timestep_spacing());
  io::write_file_atomically(io::join_path(dir, "index.json"), io::index_json(jobs, record));
  return files;
}

}  // namespace megaslide
