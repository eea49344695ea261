#include "megaslide/train/training_run.h"

#include <fmt/format.h>

#include <unistd.h>

#include <memory>

#include "megaslide/diffusion/text_to_video.h"
#include "megaslide/io/files.h"
#include "megaslide/io/weights.h"
#include "megaslide/model/dit.h"
#include "megaslide/offload/cpu_master_trainer.h"
#include "megaslide/train/auto_settings.h"
#include "megaslide/train/checkpoint.h"
#include "megaslide/train/init_from.h"
#include "megaslide/train/resident_trainer.h"
#include "megaslide/train/run_folder.h"
#include "megaslide/train/run_outputs.h"
#include "megaslide/util/build_info.h"
#include "megaslide/util/errors.h"
#include "megaslide/util/numbers.h"

namespace megaslide {

namespace {

// Either trainer behind one face.
class Trainer {
 public:
  explicit Trainer(const RunConfig& config) {
    if (config.offload.enabled) streamed_ = std::make_unique<CPUMasterVideoDiT>(config);
    else resident_ = std::make_unique<ResidentTrainer>(config);
  }
  StepMetrics step() { return streamed_ ? streamed_->step() : resident_->step(); }
  TrainingState state() { return streamed_ ? streamed_->training_state() : resident_->training_state(); }
  void load(const TrainingState& s) { streamed_ ? streamed_->load_training_state(s) : resident_->load_training_state(s); }
  int64_t parameter_count() const { return streamed_ ? streamed_->parameter_count() : resident_->parameter_count(); }
  int64_t tokens_per_sample() const { return streamed_ ? streamed_->tokens_per_sample() : resident_->tokens_per_sample(); }
  torch::Device device() const { return streamed_ ? streamed_->device() : resident_->device(); }
  CPUMasterVideoDiT* streamed() { return streamed_.get(); }
  DiffusionBatchSource& data() { return streamed_ ? streamed_->data() : resident_->data(); }
  ParameterShapes parameter_shapes() { return streamed_ ? streamed_->parameter_shapes() : resident_->parameter_shapes(); }
  void init_from(const InitPlan& plan) { streamed_ ? streamed_->init_from(plan) : resident_->init_from(plan); }
  void synchronize() {
    if (streamed_) streamed_->synchronize();
  }
  // The model for sampling: the resident trainer's own modules, or a CPU copy of the streamed
  // trainer's masters.
  std::pair<DiT&, TextEncoder&> model(const RunConfig& config) {
    if (resident_) return {resident_->model(), resident_->text_encoder()};
    if (!snapshot_dit_) {
      snapshot_dit_ = DiT(DiTOptions::from_config(config));
      if (config.model.text_encoder.kind == "builtin")  // CLIP is frozen: no trained text encoder to copy
        snapshot_text_ = TextEncoder(TextEncoderOptions(CaptionTokenizer().vocab_size(), config.model.text_dim, config.data.max_text_tokens));
    }
    streamed_->copy_weights_to(snapshot_dit_, snapshot_text_);
    return {snapshot_dit_, snapshot_text_};
  }

 private:
  std::unique_ptr<CPUMasterVideoDiT> streamed_;
  std::unique_ptr<ResidentTrainer> resident_;
  DiT snapshot_dit_{nullptr};
  TextEncoder snapshot_text_{nullptr};
};

}  // namespace

int64_t this_machine_memory_bytes() {
  const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGE_SIZE);
  int64_t bytes = pages > 0 && page > 0 ? static_cast<int64_t>(pages) * page : 0;
  // A container's memory limit (cgroup v2, then v1) when it is lower than the machine's.
  for (const char* limit_file : {"/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"}) {
    try {
      const std::string text = io::read_input_file(limit_file, 64);
      const int64_t limit = parse_integer(text.substr(0, text.find_first_of(" \n")), "bytes");
      if (limit > 0 && (bytes == 0 || limit < bytes)) bytes = limit;
    } catch (const std::exception&) {
      // "max", absent or unreadable: no limit from there.
    }
  }
  return bytes;
}

std::string memory_shortfall(const RunConfig& config, int64_t available_bytes, bool state_in_host_memory) {
  // A lower bound of what a trainer holds in host memory before its first step: fp32 weights and
  // AdamW's two fp32 moments (12 B a parameter; the streamed trainer adds a compute copy) where they
  // live in host memory, one batch of video in fp32 and the data sampler's order. The real need is
  // larger (activations, the streamed trainer's buffers: megaslide-plan counts them); only a run that
  // cannot fit even this bound is refused, so that it fails here in one line instead of swapping or
  // being killed later.
  const int64_t params = count_dit_parameters(DiTOptions::from_config(config)).total;
  const auto& d = config.data;
  const int64_t state = state_in_host_memory ? params * 12 : 0;  // validate() bounded params * 14 below kMaxMachineBytes
  const int64_t batch = config.train.batch_size * d.channels * d.frames * d.height * d.width * 4;
  const int64_t order = d.num_clips * 8;
  const int64_t needed = state + batch + order;
  if (available_bytes <= 0 || needed <= available_bytes) return "";
  return fmt::format("this run needs at least {} of memory ({} parameters x 12 B of fp32 weights and AdamW moments in host memory = {}; one batch of "
                     "video, train.batch_size {} x {}x{}x{}x{} in fp32 = {}; the sampler's order of data.num_clips {} = {}) but this "
                     "machine has {}: make the model, the batch or the video smaller (megaslide-plan --config ... shows where "
                     "memory goes)",
                     human_bytes(static_cast<double>(needed)), human_count(static_cast<double>(params)),
                     human_bytes(static_cast<double>(state)), config.train.batch_size, d.channels, d.frames, d.height, d.width,
                     human_bytes(static_cast<double>(batch)), d.num_clips, human_bytes(static_cast<double>(order)),
                     human_bytes(static_cast<double>(available_bytes)));
}

TrainingRunResult run_training(const RunConfig& requested, const TrainingRunOptions& options) {
  // `auto` settings resolved once: config.yaml, the log and checkpoints carry the resolved values, and a
  // resume compares them with the checkpoint's.
  const RunConfig config = resolve_auto_settings(requested);
  const std::string& run_dir = config.output.run_dir;
  const auto& train = config.train;
  TrainingRunResult result;

  // Everything that can refuse the input happens before the first byte of the run is written: the run
  // folder is locked (and a fresh run refused when the folder holds one), the output paths checked,
  // the device and the memory the run needs checked, and load_checkpoint verifies the checkpoint
  // (every file read once for its checksum) before it reads a tensor.
  RunFolderGuard guard(run_dir, /*resuming=*/!options.resume.empty());
  try {
    if (!options.trace_path.empty()) io::check_output_file(options.trace_path, "--trace");
    if (!options.export_weights.empty()) io::check_output_file(options.export_weights, "--export-weights");
  } catch (const io::IoError& e) {
    throw ConfigError(options.config_source, "", e.what());
  }
  bool state_in_host_memory = true;
  try {
    // The resident loop keeps its weights and moments on its device; the streamed trainer in host RAM.
    const bool on_cpu = resolve_device(train.device).is_cpu();  // checked whichever trainer runs
    state_in_host_memory = config.offload.enabled || on_cpu;
  } catch (const c10::Error& e) {
    throw ConfigError(options.config_source, "train.device", error_message(e));
  }
  if (const std::string shortfall = memory_shortfall(config, this_machine_memory_bytes(), state_in_host_memory); !shortfall.empty()) {
    const auto& d = config.data;
    const bool batch_dominates = !state_in_host_memory || config.train.batch_size * d.channels * d.frames * d.height * d.width * 4 >
                                                            count_dit_parameters(DiTOptions::from_config(config)).total * 12;
    throw ConfigError(options.config_source, batch_dominates ? "train.batch_size" : "model", shortfall);
  }
  std::string resume_path;
  if (!options.resume.empty()) {
    resume_path = resolve_checkpoint(run_dir, options.resume);
    const int64_t saved_step = checkpoint_step(resume_path);
    if (saved_step > train.steps)
      throw ConfigError(options.config_source, "train.steps",
                        fmt::format("is {} but checkpoint {} is already at step {}: nothing would be trained; set train.steps "
                                    "above {} to continue it",
                                    train.steps, resume_path, saved_step, saved_step));
  }
  // The trainers load the frozen encoders the config names (CLIP, the VAE): bad folders or sizes that
  // disagree with the config are the config's errors.
  std::unique_ptr<Trainer> trainer_holder;
  try {
    trainer_holder = std::make_unique<Trainer>(config);
  } catch (const ConfigError& e) {
    throw ConfigError(options.config_source, e.key(), e.problem());
  }
  Trainer& trainer = *trainer_holder;
  std::vector<std::string> warnings;
  if (!resume_path.empty()) {
    TrainingState state = trainer.state();
    load_checkpoint(resume_path, config, state);
    try {
      trainer.load(state);
    } catch (const std::invalid_argument& e) {
      throw CheckpointError("checkpoint '" + resume_path + "': trainer_state.json: " + e.what());
    }
    result.first_step = state.step;
    warnings = resume_warnings(resume_path, config);
    if (roll_back_latest(run_dir, resume_path))
      warnings.push_back(fmt::format("rolled back: {} now names {}; the newer checkpoints of the abandoned run are replaced as this run "
                                     "saves their steps again",
                                     io::join_path(run_dir, "checkpoints/latest"), resume_path));
  }
  InitPlan init;  // train.init_from: a fresh run only (a resumed one continues its checkpoint)
  if (resume_path.empty() && !config.train.init_from.empty()) {
    init = plan_init_from(config.train.init_from, trainer.parameter_shapes(), config.train.init_allow_missing);
    trainer.init_from(init);
  }

  RunDirectory dir(run_dir, config);
  guard.started();
  TrainLog log(dir.file("train.log"), /*append=*/!resume_path.empty());
  MetricsWriter metrics(dir.file("metrics.jsonl"), resume_path.empty() ? -1 : result.first_step);
  log.info(build_summary());
  log.info(fmt::format("config {} -> run dir {}", options.config_source, dir.path()));
  log.info(fmt::format("model {} ({} parameters, text encoder included), {} tokens per sample, device {}, {} steps",
                       to_string(config.model.arch), human_count(static_cast<double>(trainer.parameter_count())),
                       trainer.tokens_per_sample(), trainer.device().str(), train.steps));
  if (auto* streamed = trainer.streamed()) {
    log.info(fmt::format("trainer: streamed CPU-master (offload.mode {}, compute {}, grad_accum_steps {}); host memory at start:\n{}",
                         config.offload.mode, config.offload.compute_dtype, train.grad_accum_steps, streamed->host_memory_report()));
    log.info(fmt::format("compute dtype {} ({})", config.offload.compute_dtype,
                         resolve_compute_dtype(requested.offload.compute_dtype, trainer.device()).reason));
    const std::string slow = compute_dtype_warning(config.offload.compute_dtype, trainer.device(),
                                                   "set offload.compute_dtype: auto (fp32 on this CPU) to run faster");
    if (!slow.empty()) log.warn(slow);
  } else {
    log.info("trainer: resident reference loop (offload.enabled: false), compute dtype fp32");
  }
  log.info(plan_threads(config, trainer.device()).describe());
  if (config.model.text_encoder.kind == "clip")
    log.info(fmt::format("text encoder: CLIP from {} (frozen), {} tokens of width {}", config.model.text_encoder.weights,
                         config.data.max_text_tokens, config.model.text_dim));
  if (config.model.vae.kind == "sd") {
    const auto shape = model_sample_shape(config);
    log.info(fmt::format("latent space: SD VAE from {} (frozen, {} frames per call): {}x{}x{} pixels -> latents {}x{}x{}x{}",
                         config.model.vae.weights, config.model.vae.frames_per_batch, config.data.frames, config.data.height,
                         config.data.width, shape[0], shape[1], shape[2], shape[3]));
  }
  if (!options.trace_path.empty() && !trainer.streamed()) log.warn("--trace records the streamed trainer only (offload.enabled: true); ignored");
  if (!resume_path.empty()) log.info(fmt::format("resumed from {} at step {}", resume_path, result.first_step));
  for (const auto& w : warnings) log.warn(w);
  if (!resume_path.empty() && result.first_step == train.steps)
    log.info(fmt::format("the checkpoint is at train.steps ({}): the run is complete, nothing to train", train.steps));
  if (!init.path.empty()) {
    std::string kept;
    for (const auto& name : init.kept) kept += (kept.empty() ? "" : ", ") + name;
    log.info(fmt::format("initialised from {}: {} tensors; {} parameters keep their initialisation{}{}", init.path, init.tensors.size(),
                         init.kept.size(), init.kept.empty() ? "" : ": ", kept));
  } else if (!resume_path.empty() && !config.train.init_from.empty()) {
    log.info("train.init_from ignored: the run resumes from its checkpoint");
  }
  if (config.data.dataset == "videos")
    log.info(config.data.cache.empty() ? fmt::format("data: decoding {} ({} loader workers, {} batches ahead)", config.data.manifest.empty() ? config.data.root : config.data.manifest,
                                                     config.data.workers, config.data.prefetch)
                                       : fmt::format("data: cache {} ({} loader workers, {} batches ahead)", config.data.cache,
                                                     config.data.workers, config.data.prefetch));
  auto report_bad_items = [&] {
    for (const auto& b : trainer.data().take_new_bad_items()) log.warn(fmt::format("bad item skipped: {}: {}", b.path, b.reason));
  };
  report_bad_items();

  int64_t last_saved = result.first_step;
  auto save = [&](const char* why) {
    const TrainingState state = trainer.state();  // waits for host updates still running
    try {
      result.last_checkpoint = save_checkpoint(run_dir, config, state);
      last_saved = state.step;
      log.info(fmt::format("step {}: checkpoint ({}) {}", state.step, why, result.last_checkpoint));
      for (const auto& removed : prune_checkpoints(run_dir, train.keep_last)) log.info("removed old checkpoint " + removed);
      return true;
    } catch (const CheckpointError& e) {
      log.warn(e.what());
      return false;
    }
  };

  const int64_t start = result.first_step;
  ProgressLine progress(train.steps, train.log_every, config.output.progress);
  double window = 0.0;
  int64_t window_steps = 0;
  result.steps_done = start;
  for (int64_t i = start; i < train.steps; ++i) {
    if (auto* streamed = trainer.streamed(); streamed && !options.trace_path.empty() && i + 1 == std::min(options.trace_step, train.steps))
      streamed->trace_next_step(options.trace_path);
    const StepMetrics m = trainer.step();
    report_bad_items();
    result.steps_done = m.step;
    metrics.write(m);
    progress.update(m);
    if (m.skipped) {
      log.warn(fmt::format("step {}: non-finite loss or gradient (loss {}, grad_norm {}); step skipped ({} in a row, {} in all)", m.step,
                           m.loss, m.grad_norm, m.consecutive_skips, m.skipped_total));
      if (train.max_consecutive_skips > 0 && m.consecutive_skips >= train.max_consecutive_skips) {
        progress.finish();
        const std::string last = latest_checkpoint(run_dir);
        throw NonFiniteError(fmt::format(
            "stopping at step {}: {} consecutive steps had a non-finite loss or gradient (train.max_consecutive_skips: {}); "
            "the weights were not updated by them. Lower train.lr, raise train.warmup_steps or set train.grad_clip; {}",
            m.step, m.consecutive_skips, train.max_consecutive_skips,
            last.empty() ? std::string("there is no checkpoint to resume from") : "the last checkpoint is " + last));
      }
    }
    if (train.sample_every > 0 && m.step % train.sample_every == 0) {
      const auto samples = dir.file(fmt::format("samples/step-{:07}", m.step));
      auto [dit, text] = trainer.model(config);
      const auto files = write_validation_samples(samples, config, dit, text, 4,
                                                  config.data.dataset == "videos" ? trainer.data().captions(4) : std::vector<std::string>{},
                                                  trainer.data().frozen());
      log.info(fmt::format("step {}: {} validation videos in {}", m.step, files.size(), samples));
    }
    window += m.loss;
    ++window_steps;
    if (m.step % train.log_every == 0 || m.step == train.steps) {
      log.info(fmt::format("step {}/{} loss {:.5f} (mean of last {}: {:.5f}) lr {:.3g} grad_norm {:.3f} {:.3f} s/step", m.step, train.steps,
                           m.loss, window_steps, window / static_cast<double>(window_steps), m.lr, m.grad_norm, m.step_time_s));
      window = 0.0;
      window_steps = 0;
    }
    if (options.stop_requested != nullptr && options.stop_requested->load() != 0) {
      result.stop_signal = options.stop_requested->load();
      progress.finish();
      log.info(fmt::format("stop requested (signal {}) after step {}: saving a checkpoint", result.stop_signal, m.step));
      if (!save("stop")) throw OutputError("could not save a checkpoint before stopping (see the warning above)");
      log.info(fmt::format("stopped at step {}; continue with --resume latest", m.step));
      return result;
    }
    if (train.checkpoint_every > 0 && m.step % train.checkpoint_every == 0 && m.step < train.steps) save("periodic");
  }
  progress.finish();
  trainer.synchronize();
  if (train.checkpoint_every > 0 && (last_saved != result.steps_done || result.last_checkpoint.empty()) && result.steps_done > start)
    if (!save("final")) throw OutputError("could not save the final checkpoint (see the warning above)");
  if (!options.trace_path.empty() && trainer.streamed())
    log.info(fmt::format("trace of step {} in {}", std::min(options.trace_step, train.steps), options.trace_path));
  log.info(fmt::format("done: {} steps; metrics in {}", result.steps_done, dir.file("metrics.jsonl")));
  if (!options.export_weights.empty()) {
    if (auto* streamed = trainer.streamed()) {
      // Straight from the host store, one tensor at a time: no copy of the model.
      save_weights(options.export_weights, config, streamed->master_views());
    } else {
      auto [dit, text] = trainer.model(config);
      save_weights(options.export_weights, config, dit, text);
    }
    log.info(fmt::format("weights written to {}", options.export_weights));
  }
  return result;
}

}  // namespace megaslide
