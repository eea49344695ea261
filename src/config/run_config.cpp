#include "megaslide/config/run_config.h"

#include <fmt/format.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <map>
#include <optional>
#include <regex>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string_view>
#include <utility>

#include "megaslide/io/files.h"
#include "megaslide/util/errors.h"
#include "megaslide/util/numbers.h"
#include "util/utf8.h"

namespace megaslide {

ConfigError::ConfigError(std::string source, std::string key, std::string problem)
    : std::runtime_error(source + ": " + (key.empty() ? std::string() : key + ": ") + problem),
      source_(std::move(source)),
      key_(std::move(key)),
      problem_(std::move(problem)) {}

const char* to_string(Architecture arch) {
  switch (arch) {
    case Architecture::kMegaSlide:
      return "megaslide";
    case Architecture::kDense3D:
      return "dense3d";
    case Architecture::kSwin:
      return "swin";
    case Architecture::kWan:
      return "wan";
  }
  return "?";
}

const char* to_string(DsaOffsets offsets) {
  switch (offsets) {
    case DsaOffsets::kLearned:
      return "learned";
    case DsaOffsets::kZero:
      return "zero";
    case DsaOffsets::kFrozen:
      return "frozen";
  }
  return "?";
}

namespace {

// The sections a run config has, for messages.
constexpr const char* kSections = "model, data, diffusion, train, offload, optimizer, lora, output, distributed";

// A value problem inside one field; the caller adds source and key.
struct FieldProblem {
  std::string text;
};

std::string describe(const YAML::Node& node) {
  if (!node.IsDefined() || node.IsNull()) return "nothing";
  if (node.IsScalar()) return "'" + node.Scalar() + "'";
  if (node.IsSequence()) return "a list of " + std::to_string(node.size());
  return "a mapping";
}

std::string format_number(double v) {
  std::ostringstream s;
  s << v;
  return s.str();
}

int64_t parse_int(const YAML::Node& node, const std::string& expected) {
  if (!node.IsScalar()) throw FieldProblem{"expected " + expected + ", got " + describe(node)};
  try {
    return parse_integer(node.Scalar(), expected);
  } catch (const NumberError& e) {
    throw FieldProblem{e.what()};
  }
}

double parse_double(const YAML::Node& node, const std::string& expected) {
  if (!node.IsScalar()) throw FieldProblem{"expected " + expected + ", got " + describe(node)};
  try {
    return parse_real(node.Scalar(), expected);
  } catch (const NumberError& e) {
    throw FieldProblem{e.what()};
  }
}

struct IntRange {
  int64_t lo = std::numeric_limits<int64_t>::min();
  int64_t hi = std::numeric_limits<int64_t>::max();
  std::string text() const {
    if (hi == std::numeric_limits<int64_t>::max()) return "an integer >= " + std::to_string(lo);
    return "an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]";
  }
};

struct RealRange {
  double lo = -std::numeric_limits<double>::infinity();
  double hi = std::numeric_limits<double>::infinity();
  bool lo_open = false;
  bool hi_open = false;
  std::string text() const {
    std::string s = "a number";
    if (std::isfinite(lo) && std::isfinite(hi)) {
      return s + " in " + (lo_open ? "(" : "[") + format_number(lo) + ", " + format_number(hi) + (hi_open ? ")" : "]");
    }
    if (std::isfinite(lo)) return s + (lo_open ? " > " : " >= ") + format_number(lo);
    if (std::isfinite(hi)) return s + (hi_open ? " < " : " <= ") + format_number(hi);
    return s;
  }
  bool contains(double v) const {
    if (lo_open ? !(v > lo) : !(v >= lo)) return false;
    if (hi_open ? !(v < hi) : !(v <= hi)) return false;
    return true;
  }
};

int64_t checked_int(const YAML::Node& node, IntRange range) {
  int64_t v = parse_int(node, range.text());
  if (v < range.lo || v > range.hi) throw FieldProblem{"expected " + range.text() + ", got " + std::to_string(v)};
  return v;
}

// A seed: any unsigned 64-bit integer.
uint64_t checked_seed(const YAML::Node& node) {
  const std::string expected = "an integer in [0, 18446744073709551615]";
  if (!node.IsScalar()) throw FieldProblem{"expected " + expected + ", got " + describe(node)};
  try {
    return parse_unsigned(node.Scalar(), expected);
  } catch (const NumberError& e) {
    throw FieldProblem{e.what()};
  }
}

double checked_real(const YAML::Node& node, RealRange range) {
  double v = parse_double(node, range.text());
  if (!range.contains(v)) throw FieldProblem{"expected " + range.text() + ", got " + node.Scalar()};
  return v;
}

// A number as the shortest text that reads back as it (0.003, not yaml-cpp's 17 digits 0.0030000000000000001), a
// whole number with ".0" (4.0): what config.yaml and the messages show.
YAML::Node real_node(double v) {
  std::string text = fmt::format("{}", v);
  // A dot in every number, 1.0e-05 not 1e-05: YAML 1.1 readers (PyYAML) take a number without one for a string.
  if (text.find_first_of(".n") == std::string::npos) {  // (n: inf, nan)
    const auto e = text.find_first_of("eE");
    text.insert(e == std::string::npos ? text.size() : e, ".0");
  }
  return YAML::Node(text);
}

// A text value's first control character (a newline, a NUL that YAML's "\0" makes), which no path or name holds, as
// a problem; "" for none.
std::string control_character_problem(const std::string& text) {
  for (size_t i = 0; i < text.size(); ++i) {
    const auto c = static_cast<unsigned char>(text[i]);
    if (c < 0x20 || c == 0x7F)
      return fmt::format("holds the control character 0x{:02X} at byte {}; a path or name is one line of text", c,
                         i + 1);
  }
  return "";
}

// One key of the schema: how to read it into a RunConfig and how to write it back.
struct Field {
  std::string key;
  std::function<void(const YAML::Node&)> set;
  std::function<YAML::Node()> get;
};

class Schema {
 public:
  explicit Schema(RunConfig& c) { bind(c); }
  const std::vector<Field>& fields() const { return fields_; }
  const Field* find(const std::string& key) const {
    for (const auto& f : fields_)
      if (f.key == key) return &f;
    return nullptr;
  }
  // model.vae is a group: the prefix of nested keys (model.vae.kind, ...).
  bool is_group(const std::string& key) const {
    for (const auto& f : fields_)
      if (f.key.rfind(key + ".", 0) == 0) return true;
    return false;
  }
  std::string group_keys(const std::string& key) const {
    std::string out;
    for (const auto& f : fields_)
      if (f.key.rfind(key + ".", 0) == 0) out += (out.empty() ? "" : ", ") + f.key.substr(key.size() + 1);
    return out;
  }

 private:
  void add(std::string key, std::function<void(const YAML::Node&)> set, std::function<YAML::Node()> get) {
    fields_.push_back({std::move(key), std::move(set), std::move(get)});
  }
  void integer(std::string key, int64_t& slot, IntRange range) {
    add(
        std::move(key), [&slot, range](const YAML::Node& n) { slot = checked_int(n, range); },
        [&slot] { return YAML::Node(slot); });
  }
  void seed(std::string key, uint64_t& slot) {
    add(
        std::move(key), [&slot](const YAML::Node& n) { slot = checked_seed(n); }, [&slot] { return YAML::Node(slot); });
  }
  void real(std::string key, double& slot, RealRange range) {
    add(
        std::move(key), [&slot, range](const YAML::Node& n) { slot = checked_real(n, range); },
        [&slot] { return real_node(slot); });
  }
  void boolean(std::string key, bool& slot) {
    add(
        std::move(key),
        [&slot](const YAML::Node& n) {
          bool v = false;
          if (!n.IsScalar() || !YAML::convert<bool>::decode(n, v))
            throw FieldProblem{"expected true or false, got " + describe(n)};
          slot = v;
        },
        [&slot] { return YAML::Node(slot); });
  }
  void choice(std::string key, std::string& slot, std::vector<std::string> allowed) {
    add(
        std::move(key),
        [&slot, allowed](const YAML::Node& n) {
          std::string list;
          for (const auto& a : allowed) list += (list.empty() ? "" : " | ") + (a.empty() ? "\"\"" : a);
          if (!n.IsScalar() || std::find(allowed.begin(), allowed.end(), n.Scalar()) == allowed.end())
            throw FieldProblem{"expected one of " + list + ", got " + describe(n)};
          slot = n.Scalar();
        },
        [&slot] { return YAML::Node(slot); });
  }
  // A path or name that may be empty ("" or nothing = none).
  void optional_text(std::string key, std::string& slot) {
    add(
        std::move(key),
        [&slot](const YAML::Node& n) {
          if (n.IsNull()) {
            slot.clear();
            return;
          }
          if (!n.IsScalar()) throw FieldProblem{"expected a string, got " + describe(n)};
          slot = n.Scalar();
        },
        [&slot] { return YAML::Node(slot); });
  }
  void text(std::string key, std::string& slot) {
    add(
        std::move(key),
        [&slot](const YAML::Node& n) {
          if (!n.IsScalar() || n.Scalar().empty())
            throw FieldProblem{"expected a non-empty string, got " + describe(n)};
          slot = n.Scalar();
        },
        [&slot] { return YAML::Node(slot); });
  }
  void text_list(std::string key, std::vector<std::string>& slot) {
    add(
        std::move(key),
        [&slot](const YAML::Node& n) {
          if (!n.IsSequence()) throw FieldProblem{"expected a list of strings, got " + describe(n)};
          std::vector<std::string> v;
          for (const auto& item : n) {
            if (!item.IsScalar() || item.Scalar().empty())
              throw FieldProblem{"expected a list of non-empty strings, got an item " + describe(item)};
            v.push_back(item.Scalar());
          }
          slot = v;
        },
        [&slot] {
          YAML::Node n(YAML::NodeType::Sequence);
          for (const auto& x : slot) n.push_back(x);
          n.SetStyle(YAML::EmitterStyle::Flow);
          return n;
        });
  }
  // A list of [frames, height, width] triples of positive integers.
  void triple_list(std::string key, std::vector<std::array<int64_t, 3>>& slot) {
    add(
        std::move(key),
        [&slot](const YAML::Node& n) {
          if (!n.IsSequence())
            throw FieldProblem{"expected a list of [frames, height, width] lists, got " + describe(n)};
          std::vector<std::array<int64_t, 3>> v;
          for (size_t i = 0; i < n.size(); ++i) {
            const YAML::Node& item = n[i];
            if (!item.IsSequence() || item.size() != 3)
              throw FieldProblem{"item " + std::to_string(i) + ": expected [frames, height, width], got " +
                                 describe(item)};
            std::array<int64_t, 3> t{};
            for (size_t a = 0; a < 3; ++a) {
              try {
                t[a] = checked_int(item[a], IntRange{1});
              } catch (const FieldProblem& p) {
                throw FieldProblem{"item " + std::to_string(i) + ": " + p.text};
              }
            }
            v.push_back(t);
          }
          slot = v;
        },
        [&slot] {
          YAML::Node n(YAML::NodeType::Sequence);
          for (const auto& t : slot) {
            YAML::Node item(YAML::NodeType::Sequence);
            for (auto x : t) item.push_back(x);
            item.SetStyle(YAML::EmitterStyle::Flow);
            n.push_back(item);
          }
          n.SetStyle(YAML::EmitterStyle::Flow);
          return n;
        });
  }
  template <typename T, typename Check>
  void triple(std::string key, std::array<T, 3>& slot, std::string expected, Check check) {
    add(
        std::move(key),
        [&slot, expected, check](const YAML::Node& n) {
          if (!n.IsSequence() || n.size() != 3)
            throw FieldProblem{"expected a list of 3 " + expected + " (t, h, w), got " + describe(n)};
          std::array<T, 3> v{};
          for (size_t i = 0; i < 3; ++i) v[i] = check(n[i]);
          slot = v;
        },
        [&slot] {
          YAML::Node n(YAML::NodeType::Sequence);
          for (const auto& x : slot) {
            if constexpr (std::is_floating_point_v<T>) n.push_back(real_node(x));
            else n.push_back(x);
          }
          n.SetStyle(YAML::EmitterStyle::Flow);
          return n;
        });
  }

  void bind(RunConfig& c) {
    constexpr int64_t kBig = std::numeric_limits<int64_t>::max();
    auto positive_int = [](const YAML::Node& n) { return checked_int(n, IntRange{1}); };
    auto odd_positive_int = [](const YAML::Node& n) {
      int64_t v = checked_int(n, IntRange{1});
      if (v % 2 == 0) throw FieldProblem{"expected odd kernel sizes (the window is centred), got " + std::to_string(v)};
      return v;
    };

    // model
    add(
        "model.arch",
        [&c](const YAML::Node& n) {
          const std::map<std::string, Architecture> names{{"megaslide", Architecture::kMegaSlide},
                                                          {"dense3d", Architecture::kDense3D},
                                                          {"swin", Architecture::kSwin},
                                                          {"wan", Architecture::kWan}};
          auto it = n.IsScalar() ? names.find(n.Scalar()) : names.end();
          if (it == names.end())
            throw FieldProblem{"expected one of megaslide | dense3d | swin | wan, got " + describe(n)};
          c.model.arch = it->second;
        },
        [&c] { return YAML::Node(std::string(to_string(c.model.arch))); });
    triple("model.patch", c.model.patch, "positive integers", positive_int);
    integer("model.hidden", c.model.hidden, IntRange{1});
    // Each block is a module object even on the meta device (~85 kB and ~0.3 ms to build, measured at
    // 10,000 blocks): the cap, ~100x the deepest shipped config (105b: 104), keeps a typo from hanging.
    integer("model.layers", c.model.layers, IntRange{1, 10000});
    integer("model.heads", c.model.heads, IntRange{1});
    real("model.mlp_ratio", c.model.mlp_ratio, RealRange{0.0, 64.0, true, false});
    integer("model.text_dim", c.model.text_dim, IntRange{1});
    triple("model.dsa_kernel", c.model.dsa_kernel, "odd positive integers", odd_positive_int);
    integer("model.dsa_groups", c.model.dsa_groups, IntRange{1});
    triple("model.dsa_offset_range", c.model.dsa_offset_range, "numbers >= 0",
           [](const YAML::Node& n) { return checked_real(n, RealRange{0.0}); });
    add(
        "model.dsa_offsets",
        [&c](const YAML::Node& n) {
          const std::map<std::string, DsaOffsets> names{
              {"learned", DsaOffsets::kLearned}, {"zero", DsaOffsets::kZero}, {"frozen", DsaOffsets::kFrozen}};
          auto it = n.IsScalar() ? names.find(n.Scalar()) : names.end();
          if (it == names.end()) throw FieldProblem{"expected one of learned | zero | frozen, got " + describe(n)};
          c.model.dsa_offsets = it->second;
        },
        [&c] { return YAML::Node(std::string(to_string(c.model.dsa_offsets))); });
    choice("model.dense_attention", c.model.dense_attention, {"fused", "materialized"});
    triple("model.swin_window", c.model.swin_window, "positive integers", positive_int);
    choice("model.position_embedding", c.model.position_embedding, {"auto", "sincos", "none"});
    choice("model.self_attention", c.model.self_attention, {"dense", "dsa3d"});
    // model.wan: Wan2.1's hyper-parameters (model.arch wan)
    integer("model.wan.dim", c.model.wan.dim, IntRange{1});
    integer("model.wan.layers", c.model.wan.layers, IntRange{1, 10000});
    integer("model.wan.heads", c.model.wan.heads, IntRange{1});
    integer("model.wan.ffn_dim", c.model.wan.ffn_dim, IntRange{1});
    integer("model.wan.freq_dim", c.model.wan.freq_dim, IntRange{2});
    integer("model.wan.text_dim", c.model.wan.text_dim, IntRange{1});
    triple("model.wan.patch", c.model.wan.patch, "positive integers", positive_int);
    integer("model.wan.in_channels", c.model.wan.in_channels, IntRange{1, 64});
    integer("model.wan.out_channels", c.model.wan.out_channels, IntRange{1, 64});
    boolean("model.wan.qk_norm", c.model.wan.qk_norm);
    boolean("model.wan.cross_attn_norm", c.model.wan.cross_attn_norm);
    real("model.wan.eps", c.model.wan.eps, RealRange{0.0, 1.0, true, false});
    integer("model.wan.image_dim", c.model.wan.image_dim, IntRange{0});
    optional_text("model.wan.weights", c.model.wan.weights);
    optional_text("model.wan.weights_2", c.model.wan.weights_2);
    real("model.wan.boundary_ratio", c.model.wan.boundary_ratio, RealRange{0.0, 1.0, false, true});
    choice("model.wan.expert", c.model.wan.expert, {"", "high", "low", "both"});
    // Nested keys: model.text_encoder: {kind: clip, weights: DIR} in a file, --set model.vae.kind=sd.
    choice("model.text_encoder.kind", c.model.text_encoder.kind, {"builtin", "clip", "umt5"});
    optional_text("model.text_encoder.weights", c.model.text_encoder.weights);
    optional_text("model.text_encoder.vocab", c.model.text_encoder.vocab);
    choice("model.text_encoder.dtype", c.model.text_encoder.dtype, {"fp32", "bf16", "fp8"});
    choice("model.vae.kind", c.model.vae.kind, {"none", "sd", "wan"});
    optional_text("model.vae.weights", c.model.vae.weights);
    integer("model.vae.latent_channels", c.model.vae.latent_channels, IntRange{1, 64});
    integer("model.vae.downscale", c.model.vae.downscale, IntRange{1, 64});
    integer("model.vae.frames_per_batch", c.model.vae.frames_per_batch, IntRange{1, 4096});
    choice("model.vae.dtype", c.model.vae.dtype, {"fp32", "bf16"});
    integer("model.vae.tile_size", c.model.vae.tile_size, IntRange{0, 1 << 16});
    real("model.vae.tile_overlap", c.model.vae.tile_overlap, RealRange{0.0, 1.0, false, true});
    optional_text("model.image_encoder.weights", c.model.image_encoder.weights);
    choice("model.image_encoder.dtype", c.model.image_encoder.dtype, {"fp32", "bf16", "fp8"});
    // data
    choice("data.dataset", c.data.dataset, {"structured-motion", "videos", "latent-tensors"});
    integer("data.channels", c.data.channels, IntRange{1, 64});
    integer("data.frames", c.data.frames, IntRange{1});
    integer("data.height", c.data.height, IntRange{1});
    integer("data.width", c.data.width, IntRange{1});
    integer("data.num_clips", c.data.num_clips, IntRange{1});
    integer("data.max_text_tokens", c.data.max_text_tokens, IntRange{2, 4096});
    seed("data.seed", c.data.seed);
    optional_text("data.manifest", c.data.manifest);
    optional_text("data.root", c.data.root);
    text("data.video_path_template", c.data.video_path_template);
    real("data.fps", c.data.fps, RealRange{0.0, 1000.0});
    integer("data.frame_stride", c.data.frame_stride, IntRange{1, 10000});
    choice("data.clip_start", c.data.clip_start, {"random", "center"});
    choice("data.crop", c.data.crop, {"center", "random"});
    triple_list("data.buckets", c.data.buckets);
    real("data.max_bad_fraction", c.data.max_bad_fraction, RealRange{0.0, 1.0});
    optional_text("data.cache", c.data.cache);
    integer("data.workers", c.data.workers, IntRange{0, 256});
    integer("data.prefetch", c.data.prefetch, IntRange{1, 1024});
    optional_text("data.tensors", c.data.tensors);
    integer("data.image_frame", c.data.image_frame, IntRange{0});
    // diffusion
    integer("diffusion.timesteps", c.diffusion.timesteps, IntRange{2, 100000});
    choice("diffusion.beta_schedule", c.diffusion.beta_schedule, {"linear", "cosine"});
    real("diffusion.beta_start", c.diffusion.beta_start, RealRange{0.0, 1.0, true, true});
    real("diffusion.beta_end", c.diffusion.beta_end, RealRange{0.0, 1.0, true, true});
    real("diffusion.caption_dropout", c.diffusion.caption_dropout, RealRange{0.0, 1.0});
    real("diffusion.first_frame_clean", c.diffusion.first_frame_clean, RealRange{0.0, 1.0});
    real("diffusion.image_dropout", c.diffusion.image_dropout, RealRange{0.0, 1.0});
    choice("diffusion.prediction", c.diffusion.prediction, {"epsilon", "v", "x0"});
    integer("diffusion.sample_steps", c.diffusion.sample_steps, IntRange{1});
    choice("diffusion.timestep_spacing", c.diffusion.timestep_spacing, {"linspace", "leading", "trailing"});
    real("diffusion.guidance_scale", c.diffusion.guidance_scale, RealRange{0.0});
    real("diffusion.guidance_scale_2", c.diffusion.guidance_scale_2, RealRange{-1.0});
    choice("diffusion.objective", c.diffusion.objective, {"ddpm", "flow"});
    real("diffusion.shift", c.diffusion.shift, RealRange{0.0, 1e6, true, false});
    choice("diffusion.timestep_sampling", c.diffusion.timestep_sampling, {"uniform", "logit_normal"});
    real("diffusion.logit_mean", c.diffusion.logit_mean, RealRange{-20.0, 20.0});
    real("diffusion.logit_std", c.diffusion.logit_std, RealRange{0.0, 20.0, true, false});
    choice("diffusion.loss_weighting", c.diffusion.loss_weighting, {"none", "min_snr", "sigma_sqrt", "cosmap"});
    real("diffusion.snr_gamma", c.diffusion.snr_gamma, RealRange{0.0, 1e6, true, false});
    // train
    integer("train.steps", c.train.steps, IntRange{1});
    integer("train.batch_size", c.train.batch_size, IntRange{1});
    real("train.lr", c.train.lr, RealRange{0.0, 10.0, true, false});
    real("train.min_lr_ratio", c.train.min_lr_ratio, RealRange{0.0, 1.0});
    integer("train.warmup_steps", c.train.warmup_steps, IntRange{0});
    choice("train.lr_schedule", c.train.lr_schedule, {"cosine", "constant"});
    real("train.weight_decay", c.train.weight_decay, RealRange{0.0});
    real("train.beta1", c.train.beta1, RealRange{0.0, 1.0, false, true});
    real("train.beta2", c.train.beta2, RealRange{0.0, 1.0, false, true});
    real("train.eps", c.train.eps, RealRange{0.0, 1.0, true, false});
    real("train.grad_clip", c.train.grad_clip, RealRange{0.0});
    real("train.ema_decay", c.train.ema_decay, RealRange{0.0, 1.0, false, true});
    seed("train.seed", c.train.seed);
    add(
        "train.device",
        [&c](const YAML::Node& n) {
          if (!n.IsScalar() || !is_device_spec(n.Scalar()))
            throw FieldProblem{"expected auto | cpu | cuda | cuda:N, got " + describe(n)};
          c.train.device = n.Scalar();
        },
        [&c] { return YAML::Node(c.train.device); });
    integer("train.threads", c.train.threads, IntRange{0, 4096});
    integer("train.log_every", c.train.log_every, IntRange{1});
    integer("train.grad_accum_steps", c.train.grad_accum_steps, IntRange{1, 65536});
    real("train.loss_scale_init", c.train.loss_scale_init, RealRange{1.0, 1e30});
    integer("train.loss_scale_window", c.train.loss_scale_window, IntRange{1});
    real("train.peak_tflops", c.train.peak_tflops, RealRange{0.0});
    integer("train.sample_every", c.train.sample_every, IntRange{0});
    optional_text("train.sample_prompts", c.train.sample_prompts);
    integer("train.val_every", c.train.val_every, IntRange{0});
    integer("train.val_batches", c.train.val_batches, IntRange{1, 100000});
    text_list("train.val_data", c.train.val_data);
    integer("train.checkpoint_every", c.train.checkpoint_every, IntRange{0});
    integer("train.keep_last", c.train.keep_last, IntRange{0});
    integer("train.max_consecutive_skips", c.train.max_consecutive_skips, IntRange{0});
    optional_text("train.init_from", c.train.init_from);
    text_list("train.init_allow_missing", c.train.init_allow_missing);
    // offload
    boolean("offload.enabled", c.offload.enabled);
    choice("offload.mode", c.offload.mode, {"async", "sync"});
    choice("offload.compute_dtype", c.offload.compute_dtype, {"auto", "bf16", "fp16", "fp32"});
    integer("offload.optimizer_threads", c.offload.optimizer_threads, IntRange{0, 4096});
    real("offload.emulated_copy_delay_ms", c.offload.emulated_copy_delay_ms, RealRange{0.0, 10000.0});
    choice("offload.state_tier", c.offload.state_tier, {"ram", "nvme"});
    optional_text("offload.nvme_dir", c.offload.nvme_dir);
    integer("offload.nvme_blocks_in_flight", c.offload.nvme_blocks_in_flight, IntRange{2, 1024});
    choice("offload.activations", c.offload.activations, {"device", "host"});
    // optimizer
    choice("optimizer.state_dtype", c.optimizer.state_dtype, {"fp32", "bf16", "int8"});
    // lora
    choice("lora.type", c.lora.type, {"lora", "lokr"});
    integer("lora.rank", c.lora.rank, IntRange{0, 1 << 16});
    real("lora.alpha", c.lora.alpha, RealRange{0.0, 1e6});
    real("lora.dropout", c.lora.dropout, RealRange{0.0, 1.0, false, true});
    text_list("lora.targets", c.lora.targets);
    choice("lora.init", c.lora.init, {"default", "gaussian"});
    integer("lora.factor", c.lora.factor, IntRange{-1, 1 << 20});
    choice("lora.base_dtype", c.lora.base_dtype, {"compute", "fp8"});
    // output
    text("output.run_dir", c.output.run_dir);
    boolean("output.progress", c.output.progress);
    boolean("output.tensorboard", c.output.tensorboard);
    // distributed
    choice("distributed.backend", c.distributed.backend, {"auto", "nccl", "gloo"});
    real("distributed.timeout_s", c.distributed.timeout_s, RealRange{0.0, 86400.0, true, false});
    boolean("distributed.rank_logs", c.distributed.rank_logs);
    integer("distributed.context_parallel", c.distributed.context_parallel, IntRange{1, 1 << 16});
    (void)kBig;
  }

  std::vector<Field> fields_;
};

// Keys of one family only: the DiT family's shape keys, or Wan's (model.wan.*, model.self_attention). A
// config sets the keys of its own architecture; to_yaml writes only those.
bool wan_only_key(const std::string& key) {
  return key.rfind("model.wan.", 0) == 0 || key.rfind("model.image_encoder.", 0) == 0 ||
         key == "model.self_attention" || key == "data.image_frame" || key == "diffusion.image_dropout";
}
bool dit_only_key(const std::string& key) {
  // model.text_encoder and model.vae apply to both families (CLIP and the SD VAE for the DiT family, umT5
  // and the Wan VAE for Wan: validate() checks the kind against the architecture).
  static const std::set<std::string> keys{"model.patch",           "model.hidden",      "model.layers",
                                          "model.heads",           "model.mlp_ratio",   "model.text_dim",
                                          "model.dense_attention", "model.swin_window", "model.position_embedding"};
  return keys.count(key) > 0;
}
bool applies(const RunConfig& c, const std::string& key) {
  return c.model.arch == Architecture::kWan ? !dit_only_key(key) : !wan_only_key(key);
}

// The problem with a key set for the other family, or "" when it applies.
std::string inapplicable_key_problem(const RunConfig& c, const std::string& key) {
  if (applies(c, key)) return "";
  if (c.model.arch == Architecture::kWan) {
    const std::string wan_key = key == "model.hidden" ? "model.wan.dim" : "model.wan." + key.substr(6);
    const bool has_wan_twin = key == "model.hidden" || key == "model.layers" || key == "model.heads" ||
                              key == "model.patch" || key == "model.text_dim";
    return "does not apply to model.arch wan" +
           (has_wan_twin ? " (its hyper-parameters are under model.wan: set " + wan_key + ")" : std::string());
  }
  return std::string("applies to model.arch wan only (this config's model.arch is ") + to_string(c.model.arch) + ")";
}

bool has_keys_under(const Schema& schema, const std::string& prefix) {
  for (const auto& f : schema.fields())
    if (f.key.rfind(prefix, 0) == 0) return true;
  return false;
}

std::string unknown_key_problem(const Schema& schema, const std::string& key) {
  std::string best;
  size_t best_distance = 4;  // suggest only near misses
  for (const auto& f : schema.fields()) {
    size_t d = edit_distance(key, f.key);
    if (d < best_distance) best_distance = d, best = f.key;
  }
  std::string section = key.substr(0, key.find('.'));
  std::string known;
  for (const auto& f : schema.fields())
    if (f.key.rfind(section + ".", 0) == 0) known += (known.empty() ? "" : ", ") + f.key.substr(section.size() + 1);
  std::string problem = "unknown key";
  if (!best.empty()) problem += " (did you mean " + best + "?)";
  if (!known.empty()) problem += "; keys of section " + section + ": " + known;
  else problem += "; sections are " + std::string(kSections);
  return problem;
}

void apply(const Schema& schema, const std::string& source, const std::string& key, const YAML::Node& value) {
  const Field* field = schema.find(key);
  if (field == nullptr) throw ConfigError(source, key, unknown_key_problem(schema, key));
  try {
    field->set(value);
  } catch (const FieldProblem& p) {
    throw ConfigError(source, key, p.text);
  }
}

// Sizes multiplied out: every tensor a run must hold (one batch of video, one block's activations,
// the offsets 3D-DSA predicts, dense attention's score matrix, the parameters' host state) is computed
// with overflow checks and refused when no machine could hold it (kMaxMachineBytes). Whether this
// machine can is decided when a run starts (train/training_run.h); megaslide-plan reports the rest.
void check_sizes(const RunConfig& c, const std::function<void(const std::string&, const std::string&)>& fail) {
  struct Factor {
    const char* name;
    int64_t value;
  };
  // `factors` multiplied by `bytes_per_value` must stay below kMaxMachineBytes; `key` is the config key
  // named first, the message lists every factor.
  auto limit = [&](const std::string& key, const std::string& what, std::initializer_list<Factor> factors,
                   int64_t bytes_per_value) {
    std::string product;
    std::optional<int64_t> n = 1;
    for (const auto& f : factors) {
      product += (product.empty() ? "" : " x ") + std::string(f.name) + " " + std::to_string(f.value);
      n = n ? checked_product({*n, f.value}) : std::nullopt;
    }
    const auto bytes = n ? checked_product({*n, bytes_per_value}) : std::nullopt;
    if (!bytes || *bytes > kMaxMachineBytes) {
      const std::string size = bytes ? human_bytes(static_cast<double>(*bytes))
                                     : std::string("beyond 9.2e18 bytes (the product overflows 64 bits)");
      fail(key, what + " is " + product + (n ? " = " + std::to_string(*n) + " values, " : " values, ") + size +
                    ": more than any machine holds (" + human_bytes(static_cast<double>(kMaxMachineBytes)) +
                    "); a typo?");
    }
  };
  const auto& m = c.model;
  const auto& d = c.data;
  const int64_t B = c.train.batch_size;
  // Wan's shape keys are under model.wan; the products below name the keys of the run's architecture.
  const bool wan = m.arch == Architecture::kWan;
  const auto& patch = wan ? m.wan.patch : m.patch;
  const int64_t hidden = wan ? m.wan.dim : m.hidden, layers = wan ? m.wan.layers : m.layers;
  const int64_t text_dim = wan ? m.wan.text_dim : m.text_dim;
  const char* hidden_key = wan ? "model.wan.dim" : "model.hidden";
  const char* layers_key = wan ? "model.wan.layers" : "model.layers";
  limit("train.batch_size", "one batch of video (fp32)",
        {{"train.batch_size", B},
         {"data.channels", d.channels},
         {"data.frames", d.frames},
         {"data.height", d.height},
         {"data.width", d.width}},
        4);
  // Divisibility by the patch was checked above: the token grid is exact.
  const auto shape = model_sample_shape(c);  // pixels, or the VAE's latents
  const int64_t T = shape[1] / patch[0], H = shape[2] / patch[1], W = shape[3] / patch[2];
  limit("train.batch_size", "one block's input activations (fp32)",
        {{"train.batch_size", B}, {"tokens t", T}, {"tokens h", H}, {"tokens w", W}, {hidden_key, hidden}}, 4);
  // The streamed trainer keeps every block's input for the backward (megaslide-plan's "checkpoints").
  limit(layers_key, "the block inputs kept for the backward (fp32)",
        {{layers_key, layers}, {"train.batch_size", B}, {"tokens", T * H * W}, {hidden_key, hidden}}, 4);
  // The host state is 14 bytes a parameter (docs/planner.md); each block holds at least its four
  // hidden x hidden attention projections and its hidden x text_dim cross-attention inputs.
  limit(layers_key, "a lower bound of the parameters (host state, 14 B each)",
        {{layers_key, layers},
         {hidden_key, hidden},
         {"(4 x hidden + 2 x text_dim)", 4 * hidden + 2 * std::min<int64_t>(text_dim, int64_t{1} << 60)}},
        14);
  if (uses_dsa3d(m)) {
    const auto& k = m.dsa_kernel;
    limit("model.dsa_kernel", "3D-DSA's predicted offsets (fp32)",
          {{"train.batch_size", B},
           {"tokens", T * H * W},
           {"model.dsa_groups", m.dsa_groups},
           {"kernel t", k[0]},
           {"kernel h", k[1]},
           {"kernel w", k[2]},
           {"3 axes", 3}},
          4);
    // The grid_sample reference (what the fused kernels are tested against) materialises K sampled keys
    // and values per token; an axis shorter than the kernel shrinks it to the axis.
    limit("model.dsa_kernel", "the 3D-DSA reference's sampled keys (fp32)",
          {{"train.batch_size", B},
           {"tokens", T * H * W},
           {"kernel t", std::min(k[0], T)},
           {"kernel h", std::min(k[1], H)},
           {"kernel w", std::min(k[2], W)},
           {hidden_key, hidden}},
          4);
  }
  if (m.arch == Architecture::kDense3D && m.dense_attention == "materialized") {
    limit("model.dense_attention", "the materialized attention scores (fp32)",
          {{"train.batch_size", B}, {"model.heads", m.heads}, {"tokens", T * H * W}, {"tokens", T * H * W}}, 4);
  }
  if (m.arch == Architecture::kSwin) {
    const auto& w = m.swin_window;
    // A window larger than the token grid is the grid. The shifted-window mask holds every token
    // against every token of its window.
    limit("model.swin_window", "the shifted windows' attention mask",
          {{"train.batch_size", B},
           {"tokens", T * H * W},
           {"window t", std::min(w[0], T)},
           {"window h", std::min(w[1], H)},
           {"window w", std::min(w[2], W)}},
          1);
  }
  limit("data.num_clips", "the data sampler's shuffled order (8 B a clip)", {{"data.num_clips", d.num_clips}}, 8);
}

}  // namespace

namespace {
// Whether YAML text holds a second document (yaml-cpp's Load reads the first alone, and its LoadAll
// loops without end on some malformed inputs): a "---" line at column 0 after content, or content after
// a "..." line. Document markers cannot occur inside a scalar at column 0, so lines suffice.
bool has_second_document(const std::string& text) {
  bool content = false, ended = false;
  size_t begin = 0;
  while (begin < text.size()) {
    size_t end = text.find('\n', begin);
    if (end == std::string::npos) end = text.size();
    std::string_view line(text.data() + begin, end - begin);
    begin = end + 1;
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    const auto marker = [&](const char* m) {
      return line.compare(0, 3, m) == 0 && (line.size() == 3 || line[3] == ' ' || line[3] == '\t');
    };
    if (marker("---")) {
      if (content || ended) return true;
      const auto rest = line.substr(3).find_first_not_of(" \t");
      if (rest != std::string_view::npos && line[3 + rest] != '#') content = true;  // "--- value"
      continue;
    }
    if (marker("...")) {
      ended = true;
      continue;
    }
    const auto first = line.find_first_not_of(" \t");
    if (first == std::string_view::npos || line[first] == '#') continue;
    if (ended) return true;
    content = true;
  }
  return false;
}
}  // namespace

bool is_device_spec(const std::string& spec) {
  static const std::regex kDevice(R"(auto|cpu|cuda(:[0-9]{1,4})?)");
  return std::regex_match(spec, kDevice);
}

namespace {
// What a config a user gives may not hold, beyond validate(): values an older MegaSlide accepted and saved in
// checkpoints and weights files, which those keep loading with (parse_saved_run_config).
void check_user_values(const RunConfig& c, const std::string& source) {
  RunConfig copy = c;
  const Schema schema(copy);
  for (const auto& f : schema.fields()) {
    const YAML::Node n = f.get();
    const auto check_text = [&](const std::string& text, const std::string& what) {
      if (const auto problem = control_character_problem(text); !problem.empty())
        throw ConfigError(source, f.key, what + problem);
    };
    if (n.IsScalar()) check_text(n.Scalar(), "");
    if (n.IsSequence())
      for (const auto& item : n)
        if (item.IsScalar()) check_text(item.Scalar(), "an item ");
  }
  // A folder or manifest of one's own videos beside another dataset would otherwise train on that one, silently.
  for (const auto& [key, value] : {std::pair{"data.root", &c.data.root}, std::pair{"data.manifest", &c.data.manifest}})
    if (!value->empty() && c.data.dataset != "videos")
      throw ConfigError(source, key,
                        "names videos, but data.dataset is " + c.data.dataset +
                            ", which does not read them: set data.dataset: videos (or remove " + key + ")");
  // In tokens: past 10^4 a typo, and past float's range every offset, so every step, would be infinite.
  const auto& r = c.model.dsa_offset_range;
  if (std::max({r[0], r[1], r[2]}) > 1e4)
    throw ConfigError(source, "model.dsa_offset_range",
                      fmt::format("expected numbers in [0, 10000] (tokens), got [{}, {}, {}]", r[0], r[1], r[2]));
  // A kernel shrinks to an axis shorter than it, but its parameters and predicted offsets (each kernel point's) do
  // not: one far past the grid is a typo that fills memory.
  if (uses_dsa3d(c.model)) {
    const auto& k = c.model.dsa_kernel;
    const auto& patch = c.model.arch == Architecture::kWan ? c.model.wan.patch : c.model.patch;
    const auto shape = model_sample_shape(c);
    const int64_t grid[3] = {shape[1] / patch[0], shape[2] / patch[1], shape[3] / patch[2]};
    for (size_t a = 0; a < 3; ++a)
      if (k[a] > 2 * grid[a] + 1)
        throw ConfigError(
            source, "model.dsa_kernel",
            fmt::format("[{}, {}, {}] is more than twice the token grid {}x{}x{} (t x h x w) on its {} axis: the "
                        "kernel shrinks to the grid there, but its parameters and predicted offsets (each kernel "
                        "point's) do not; at most {} on that axis",
                        k[0], k[1], k[2], grid[0], grid[1], grid[2], "thw"[a], 2 * grid[a] + 1));
  }
}

RunConfig parse_config_text(const std::string& yaml_text, const std::string& source,
                            const std::vector<std::string>& overrides, bool user) {
  RunConfig config;
  Schema schema(config);
  std::vector<std::pair<std::string, std::string>> applied;  // (key, where it was set)
  YAML::Node root;
  if (has_second_document(yaml_text))
    throw ConfigError(source, "", "holds more than one YAML document (a second one after ---); a run config is one");
  try {
    root = YAML::Load(yaml_text);
  } catch (const YAML::Exception& e) {
    // A tab in a line's indentation is the usual cause of a puzzling message ("illegal map value"): YAML indents
    // with spaces only. Named where the first such line is.
    std::string hint;
    for (size_t begin = 0, line = 1; begin < yaml_text.size(); ++line) {
      size_t end = yaml_text.find('\n', begin);
      if (end == std::string::npos) end = yaml_text.size();
      const size_t text = yaml_text.find_first_not_of(" \t", begin);
      if (text != std::string::npos && text < end && yaml_text.find('\t', begin) < text) {
        hint = "; line " + std::to_string(line) + " is indented with a tab, and YAML indents with spaces only";
        break;
      }
      begin = end + 1;
    }
    throw ConfigError(source, "",
                      "not valid YAML: " + e.msg + " (line " + std::to_string(e.mark.line + 1) + ")" + hint);
  }
  if (root.IsDefined() && !root.IsNull()) {
    if (!root.IsMap())
      throw ConfigError(source, "", "expected a mapping of sections (model, data, ...), got " + describe(root));
    // Keys must be plain scalars: YAML also allows sequences or mappings as keys ("? [a]: 1").
    const auto key_of = [&source](const YAML::Node& key, const std::string& where) {
      if (!key.IsScalar()) throw ConfigError(source, where, "a key must be a plain name, got " + describe(key));
      if (key.Scalar() == "<<")
        throw ConfigError(source, where,
                          "YAML merge keys (<<) are not supported (line " + std::to_string(key.Mark().line + 1) +
                              "): write the keys out, or set them with --set");
      return key.Scalar();
    };
    // yaml-cpp keeps both entries of a repeated key; a file that says two things about one key is
    // refused rather than read as whichever comes last.
    std::map<std::string, int> seen;  // key -> its line
    // A mapping inside a section (model.wan) holds keys one level further down.
    std::function<void(const YAML::Node&, const std::string&)> read_keys = [&](const YAML::Node& map,
                                                                               const std::string& prefix) {
      for (const auto& entry : map) {
        const std::string key = prefix + "." + key_of(entry.first, prefix);
        const int line = entry.first.Mark().line + 1;
        if (const auto [it, fresh] = seen.emplace(key, line); !fresh)
          throw ConfigError(
              source, key,
              fmt::format("key appears twice in the file, on lines {} and {} (keep one)", it->second, line));
        if (entry.second.IsMap() && has_keys_under(schema, key + ".")) {
          read_keys(entry.second, key);
          continue;
        }
        if (schema.find(key) == nullptr &&
            has_keys_under(schema, key + "."))  // a group (model.vae) given a scalar or a list
          throw ConfigError(source, key,
                            "expected a mapping of " + schema.group_keys(key) + ", got " + describe(entry.second));
        apply(schema, source, key, entry.second);
        applied.emplace_back(key, source);
      }
    };
    for (const auto& section : root) {
      const std::string name = key_of(section.first, "");
      const int line = section.first.Mark().line + 1;
      if (const auto [it, fresh] = seen.emplace(name, line); !fresh)
        throw ConfigError(source, name,
                          fmt::format("section appears twice in the file, on lines {} and {} (merge the two into one)",
                                      it->second, line));
      bool known_section = false;
      for (const auto& f : schema.fields()) known_section |= f.key.rfind(name + ".", 0) == 0;
      if (!known_section) throw ConfigError(source, name, std::string("unknown section; sections are ") + kSections);
      if (!section.second.IsMap())
        throw ConfigError(source, name, "expected a section (a mapping of keys), got " + describe(section.second));
      read_keys(section.second, name);
    }
  }
  for (const auto& assignment : overrides) {
    const std::string where = "--set " + assignment;
    auto eq = assignment.find('=');
    if (eq == std::string::npos || eq == 0)
      throw ConfigError(where, "", "expected key.path=value, e.g. --set model.hidden=32");
    const std::string key = assignment.substr(0, eq);
    if (key.find_first_of(" \t") != std::string::npos)
      throw ConfigError(where, "", "the key '" + key + "' holds white space: write key.path=value without spaces");
    if (has_second_document(assignment.substr(eq + 1)))
      throw ConfigError(where, key, "the value holds more than one YAML document (a second one after ---)");
    YAML::Node value;
    try {
      value = YAML::Load(assignment.substr(eq + 1));
    } catch (const YAML::Exception& e) {
      throw ConfigError(where, key, "value is not valid YAML: " + e.msg);
    }
    apply(schema, where, key, value);
    applied.emplace_back(key, where);
  }
  for (const auto& [key, where] : applied) {
    if (const std::string problem = inapplicable_key_problem(config, key); !problem.empty())
      throw ConfigError(where, key, problem);
    config.given.insert(key);
  }
  const std::string suffix = " with --set overrides";  // not twice: a source may already say so (a run's own)
  const bool said =
      source.size() >= suffix.size() && source.compare(source.size() - suffix.size(), suffix.size(), suffix) == 0;
  const std::string where = overrides.empty() || said ? source : source + suffix;
  validate(config, where);
  if (user) check_user_values(config, where);
  return config;
}
}  // namespace

RunConfig parse_run_config(const std::string& yaml_text, const std::string& source,
                           const std::vector<std::string>& overrides) {
  return parse_config_text(yaml_text, source, overrides, /*user=*/true);
}

RunConfig parse_saved_run_config(const std::string& yaml_text, const std::string& source) {
  return parse_config_text(yaml_text, source, {}, /*user=*/false);
}

RunConfig load_run_config(const std::string& path, const std::vector<std::string>& overrides) {
  // A run file is a few kB: the cap refuses a wrong file (a video, /dev/zero) before it fills memory.
  constexpr uint64_t kMaxConfigBytes = 1 << 20;
  if (!io::path_exists(path))
    throw ConfigError(path, "", "cannot open the config file (does it exist and is it readable?)");
  std::string text;
  try {
    text = io::read_input_file(path, kMaxConfigBytes);
  } catch (const io::IoError& e) {
    throw ConfigError(path, "", std::string("cannot read the config file: ") + e.what());
  }
  return parse_run_config(text, path, overrides);
}

namespace {
// model.arch wan: the shape of Wan's blocks and what its trainer and samplers need.
// `sizes`: whether the sizes (dim, heads, channels, patch) are the model's: false while model.wan.weights has not
// been read.
void validate_wan(const RunConfig& c, bool sizes,
                  const std::function<void(const std::string&, const std::string&)>& fail) {
  const auto& m = c.model;
  const auto& w = m.wan;
  if (sizes && w.dim % w.heads != 0)
    fail("model.wan.dim",
         "expected a multiple of model.wan.heads (" + std::to_string(w.heads) + "), got " + std::to_string(w.dim));
  if (sizes && (w.dim / w.heads) % 2 != 0)
    fail("model.wan.dim", "expected model.wan.dim / model.wan.heads (the head size, " +
                              std::to_string(w.dim / w.heads) + ") to be even: 3D RoPE rotates pairs of channels");
  const auto& te = m.text_encoder;
  const auto& vae = m.vae;
  if (te.dtype == "fp8" && te.kind != "umt5")
    fail("model.text_encoder.dtype", std::string("is fp8, which keeps a frozen encoder's matrices in 8 bits, but ") +
                                         "model.text_encoder.kind is " + te.kind +
                                         " (no umT5 is loaded): set umt5, or fp32 or bf16");
  if (te.kind == "clip")
    fail("model.text_encoder.kind",
         "clip conditions the DiT family; Wan's text encoder is umt5 (or builtin: the data brings its "
         "text embeddings)");
  if (vae.kind == "sd")
    fail("model.vae.kind", "sd is the DiT family's VAE; Wan's is wan (or none: the data brings its latents)");
  if (te.kind == "umt5" && te.weights.empty())
    fail("model.text_encoder.weights",
         "model.text_encoder.kind: umt5 needs umT5's weights (a transformers folder, a diffusers "
         "repository or umt5_xxl_fp16.safetensors; docs/wan.md)");
  if (vae.kind == "wan" && vae.tile_size > 0 && vae.tile_size % vae.downscale != 0)
    fail("model.vae.tile_size", "expected a multiple of model.vae.downscale (" + std::to_string(vae.downscale) +
                                    ": the Wan VAE's tiles start on whole latents), got " +
                                    std::to_string(vae.tile_size));
  if (vae.kind == "wan" && vae.weights.empty())
    fail("model.vae.weights",
         "model.vae.kind: wan needs the Wan VAE's weights (diffusers' vae/ folder or wan_2.1_vae.safetensors; "
         "docs/wan.md)");
  if (te.kind == "builtin" && !te.weights.empty())
    fail("model.text_encoder.weights",
         "model.text_encoder.kind is builtin (the data brings its text embeddings), which reads no weights; set "
         "model.text_encoder.kind: umt5 to load umT5 from '" +
             te.weights + "'");
  if (vae.kind == "none" && !vae.weights.empty())
    fail("model.vae.weights",
         "model.vae.kind is none (the data brings its latents), which reads no weights; set model.vae.kind: wan to "
         "load the Wan VAE from '" +
             vae.weights + "'");
  if (c.data.dataset == "videos") {
    // Pixels in data.*, latents from the Wan VAE (cached by megaslide-cache; data/latent_cache.h).
    // Encoders the config leaves to model.wan.weights (a diffusers repository's text_encoder/ and vae/:
    // with_wan_repository_encoders) are checked once it has been read.
    // Once model.wan.weights was read (sizes), an encoder left unnamed was looked for in its repository and not found.
    const bool t5_unnamed = te.kind == "builtin" && te.weights.empty() && te.vocab.empty();
    const bool vae_unnamed = vae.kind == "none" && vae.weights.empty();
    const bool from_repository = !sizes && !w.weights.empty();
    const bool vae_pending = from_repository && vae_unnamed;
    const auto or_repository = [&](bool unnamed, const char* folder) {
      return sizes && unnamed && !w.weights.empty()
                 ? fmt::format(" (model.wan.weights '{}' is no diffusers repository with {}/ to take it from)",
                               w.weights, folder)
                 : std::string(" (or name a diffusers repository holding it in model.wan.weights)");
    };
    if (te.kind != "umt5" && !(from_repository && t5_unnamed))
      fail("model.text_encoder.kind",
           "expected umt5 for model.arch wan with data.dataset: videos (the cache holds umT5's embeddings): set "
           "model.text_encoder.kind: umt5 and model.text_encoder.weights" +
               or_repository(t5_unnamed, "text_encoder"));
    if (vae.kind != "wan" && !vae_pending)
      fail("model.vae.kind",
           "expected wan for model.arch wan with data.dataset: videos (the cache holds the Wan VAE's latents): set "
           "model.vae.kind: wan and model.vae.weights" +
               or_repository(vae_unnamed, "vae"));
    if (sizes && vae.latent_channels != w.out_channels)
      fail("model.vae.latent_channels", "expected model.wan.out_channels (" + std::to_string(w.out_channels) +
                                            ": the Wan VAE's z_dim is the DiT's latents), got " +
                                            std::to_string(vae.latent_channels));
    if ((c.data.frames - 1) % 4 != 0)
      fail("data.frames", "expected 1 + 4k frames for the Wan VAE (it keeps the first frame and every 4 after), got " +
                              std::to_string(c.data.frames));
    for (const auto& [axis, size] : {std::pair<const char*, int64_t>{"height", c.data.height}, {"width", c.data.width}})
      if (!vae_pending && size % vae.downscale != 0)
        fail(std::string("data.") + axis, "expected a multiple of model.vae.downscale (" +
                                              std::to_string(vae.downscale) + "), got " + std::to_string(size));
    // Each bucket a clip the Wan VAE takes and the DiT patches (model_sample_shape_at, once the sizes are known).
    for (size_t i = 0; i < c.data.buckets.size(); ++i) {
      const auto& b = c.data.buckets[i];
      std::string problem;
      if ((b[0] - 1) % 4 != 0) problem = fmt::format("{} frames: the Wan VAE takes 1 + 4k frames", b[0]);
      else if (!vae_pending && (b[1] % vae.downscale != 0 || b[2] % vae.downscale != 0))
        problem = fmt::format("{} x {}: not multiples of model.vae.downscale ({})", b[1], b[2], vae.downscale);
      else if (sizes) try {
          model_sample_shape_at(c, {b[0], b[1], b[2]});
        } catch (const std::invalid_argument& e) {
          problem = e.what();
        }
      if (!problem.empty()) fail("data.buckets", "item " + std::to_string(i) + ": " + problem);
    }
    if (sizes && wan_image_to_video(w) && c.data.image_frame >= c.data.frames)
      fail("data.image_frame", "is " + std::to_string(c.data.image_frame) + ": the conditioning frame of a clip of " +
                                   std::to_string(c.data.frames) + " frames (data.frames) is 0 to " +
                                   std::to_string(c.data.frames - 1));
    if (w.image_dim > 0 && m.image_encoder.weights.empty() && w.weights.empty())
      fail("model.image_encoder.weights",
           "Wan2.1 image-to-video (model.wan.image_dim " + std::to_string(w.image_dim) +
               ") caches each clip's CLIP image tokens: name CLIP ViT-H's image encoder (diffusers' image_encoder/ "
               "folder or clip_vision_h.safetensors; docs/wan.md)");
  } else if (sizes && c.data.channels != w.out_channels) {
    fail("data.channels", "expected model.wan.out_channels (" + std::to_string(w.out_channels) +
                              ": the latents') for model.arch wan, got " + std::to_string(c.data.channels));
  }
  if (!w.weights_2.empty() && w.weights.empty())
    fail("model.wan.weights_2",
         "names the low-noise expert but model.wan.weights (the high-noise expert, or the two-expert repository) "
         "is empty");
  // Without weights the model is one randomly initialised DiT, or two with expert both (with weights,
  // with_wan_architecture_from_weights says whether they hold two experts).
  if (!w.expert.empty() && c.diffusion.objective != "flow")
    fail("model.wan.expert", "is " + w.expert +
                                 ": Wan2.2's experts are flow-matching models (diffusion.objective: flow), "
                                 "got diffusion.objective " +
                                 c.diffusion.objective);
  if (w.weights.empty() && w.boundary_ratio != 0 && w.expert.empty())
    fail("model.wan.boundary_ratio",
         "switches between Wan2.2's two experts, but model.wan.weights is empty: the "
         "model is one randomly initialised DiT (set model.wan.expert to train it on one expert's timesteps)");
  if (w.weights.empty() && c.diffusion.guidance_scale_2 != -1.0 && w.expert.empty())
    fail("diffusion.guidance_scale_2",
         "is Wan2.2's low-noise expert's guidance scale, but model.wan.weights is "
         "empty: the model is one randomly initialised DiT");
  if (sizes && w.out_channels != w.in_channels && !wan_image_to_video(w))
    fail("model.wan.in_channels",
         "expected model.wan.out_channels (" + std::to_string(w.out_channels) + ": text-to-video) or 2 x " +
             std::to_string(w.out_channels) + " + 4 = " + std::to_string(2 * w.out_channels + 4) +
             " (image-to-video: the noisy latents, the first-frame mask, the conditioning video's latents), got " +
             std::to_string(w.in_channels));
  if (sizes && w.image_dim > 0 && !wan_image_to_video(w))
    fail("model.wan.image_dim",
         "is " + std::to_string(w.image_dim) +
             ": the image branch is Wan2.1 I2V's, whose input is image-to-video's (model.wan.in_channels 2 x "
             "out_channels + 4 = " +
             std::to_string(2 * w.out_channels + 4) + "), got model.wan.in_channels " + std::to_string(w.in_channels));
  if (sizes && !wan_image_to_video(w) && c.diffusion.image_dropout > 0)
    fail("diffusion.image_dropout",
         "drops the image of image-to-video; this Wan is text-to-video (model.wan.in_channels "
         "equals out_channels)");
  if (sizes && wan_image_to_video(w) && c.diffusion.first_frame_clean > 0)
    fail("diffusion.first_frame_clean",
         "is Wan2.2 TI2V's image-to-video (the first latent frame clean in the input); this Wan takes its image as "
         "conditioning channels (model.wan.in_channels " +
             std::to_string(w.in_channels) + "): set it to 0");
  if (m.self_attention == "dsa3d") {
    if (sizes && w.heads % m.dsa_groups != 0)
      fail("model.dsa_groups", "expected a divisor of model.wan.heads (" + std::to_string(w.heads) + "), got " +
                                   std::to_string(m.dsa_groups));
    if (m.dsa_offsets == DsaOffsets::kFrozen)
      fail("model.dsa_offsets",
           "expected learned or zero for model.arch wan (frozen offsets are the DiT family's ablation)");
  }
}
}  // namespace

void validate(const RunConfig& c, const std::string& source, bool wan_sizes_resolved) {
  auto fail = [&](const std::string& key, const std::string& problem) { throw ConfigError(source, key, problem); };
  {
    // Every value is stored as UTF-8 text (config.yaml, checkpoints' JSON, logs): a path with another
    // encoding's byte is refused here, before anything is written, not at the first checkpoint save.
    RunConfig copy = c;
    const Schema schema(copy);
    std::function<void(const std::string&, const YAML::Node&)> check = [&](const std::string& key,
                                                                           const YAML::Node& v) {
      if (v.IsScalar()) {
        const size_t at = utf8::first_invalid(v.Scalar());
        if (at != std::string::npos)
          fail(key,
               fmt::format(
                   "is not UTF-8 text (byte 0x{:02x} at offset {}); paths and values must be UTF-8 (rename the file "
                   "or folder)",
                   static_cast<unsigned char>(v.Scalar()[at]), at));
      } else if (v.IsSequence() || v.IsMap()) {
        for (const auto& item : v) check(key, item.IsDefined() ? item : item.second);
      }
    };
    for (const auto& f : schema.fields()) check(f.key, f.get());
  }
  const auto& m = c.model;
  const bool wan = m.arch == Architecture::kWan;
  const bool wan_sizes = wan && (wan_sizes_resolved || m.wan.weights.empty());
  if (c.diffusion.guidance_scale_2 < 0 && c.diffusion.guidance_scale_2 != -1.0)
    fail("diffusion.guidance_scale_2",
         "expected -1 (the low-noise expert guided as diffusion.guidance_scale) or a "
         "number >= 0, got " +
             format_number(c.diffusion.guidance_scale_2));
  if (!wan && c.diffusion.guidance_scale_2 != -1.0)
    fail("diffusion.guidance_scale_2", "is the guidance scale of Wan2.2's low-noise expert; model.arch " +
                                           std::string(to_string(m.arch)) + " has one DiT");
  if (c.diffusion.first_frame_clean > 0) {
    const std::string why = "is " + format_number(c.diffusion.first_frame_clean) + ": Wan2.2 TI2V's image-to-video ";
    if (!wan) fail("diffusion.first_frame_clean", why + "is model.arch wan's");
    if (c.diffusion.objective != "flow")
      fail("diffusion.first_frame_clean", why + "trains with diffusion.objective flow");
    if (wan_sizes && c.model.wan.patch[0] != 1)
      fail("diffusion.first_frame_clean", why + "needs model.wan.patch[0] 1 (the first frame's tokens its own)");
    if (wan && !c.model.wan.expert.empty())
      fail("diffusion.first_frame_clean", why + "is one DiT's, not one of two experts'");
    if (model_sample_shape(c)[1] < 2)
      fail("diffusion.first_frame_clean", why + "needs at least 2 latent frames (the first one clean)");
    for (size_t i = 0; i < c.data.buckets.size() && wan && c.data.dataset == "videos"; ++i)
      if (const int64_t f = c.data.buckets[i][0]; 1 + (f - 1) / 4 < 2)
        fail(
            "diffusion.first_frame_clean",
            why + fmt::format("needs at least 2 latent frames (the first one clean) in every bucket: data.buckets item "
                              "{} has {} frame{} (1 latent frame)",
                              i, f, f == 1 ? "" : "s"));
  }
  if (wan) {
    validate_wan(c, wan_sizes, fail);
  } else {
    if (m.hidden % m.heads != 0)
      fail("model.hidden",
           "expected a multiple of model.heads (" + std::to_string(m.heads) + "), got " + std::to_string(m.hidden));
    if (m.hidden < 6 || m.hidden % 2 != 0)
      fail("model.hidden",
           "expected an even number >= 6 (the 3D sin-cos position embedding splits it over t, h, w), got " +
               std::to_string(m.hidden));
    if (m.heads % m.dsa_groups != 0)
      fail("model.dsa_groups",
           "expected a divisor of model.heads (" + std::to_string(m.heads) + "), got " + std::to_string(m.dsa_groups));
    if (static_cast<int64_t>(std::llround(m.hidden * m.mlp_ratio)) < 1)
      fail("model.mlp_ratio", "expected model.hidden * model.mlp_ratio >= 1");
    const auto& te = m.text_encoder;
    if (te.dtype == "fp8" && te.kind == "builtin")
      fail("model.text_encoder.dtype",
           "is fp8, which keeps a frozen encoder's matrices in 8 bits; the built-in text encoder trains with the DiT: "
           "choose fp32 or bf16");
    if (te.kind == "umt5")
      fail("model.text_encoder.kind",
           "umt5 is Wan's text encoder (model.arch wan); the DiT family's is builtin or clip");
    if (m.vae.kind == "wan")
      fail("model.vae.kind", "wan is Wan's VAE (model.arch wan); the DiT family's is none or sd");
    if (te.kind == "clip" && te.weights.empty())
      fail("model.text_encoder.weights",
           "model.text_encoder.kind: clip needs the folder of CLIP's text encoder (docs/conditioning.md)");
    if (te.kind == "builtin" && !te.weights.empty())
      fail("model.text_encoder.weights",
           "the built-in text encoder is trained with the DiT and reads no weights; set "
           "model.text_encoder.kind: clip to load CLIP from '" +
               te.weights + "'");
    if (te.kind == "clip" && c.data.max_text_tokens > 77)
      fail("data.max_text_tokens", "expected at most 77 with model.text_encoder.kind: clip (CLIP's positions), got " +
                                       std::to_string(c.data.max_text_tokens));
    const auto& vae = m.vae;
    if (vae.kind == "sd" && vae.weights.empty())
      fail("model.vae.weights",
           "model.vae.kind: sd needs the folder of the Stable Diffusion VAE (docs/conditioning.md)");
    if (vae.kind == "none" && !vae.weights.empty())
      fail("model.vae.weights",
           "model.vae.kind is none (the DiT works on pixels); set model.vae.kind: sd to load the VAE from '" +
               vae.weights + "'");
    if (vae.kind == "sd" && c.data.channels != 3)
      fail("data.channels",
           "expected 3 with model.vae.kind: sd (the VAE encodes RGB frames), got " + std::to_string(c.data.channels));
    if (vae.kind == "sd" && vae.tile_size > 0 && vae.tile_size % vae.downscale != 0)
      fail("model.vae.tile_size", "expected a multiple of model.vae.downscale (" + std::to_string(vae.downscale) +
                                      "), got " + std::to_string(vae.tile_size));
    if (vae.kind == "sd") {
      const char* pixel_axes[2] = {"height", "width"};
      const int64_t pixel_sizes[2] = {c.data.height, c.data.width};
      for (int a = 0; a < 2; ++a)
        if (pixel_sizes[a] % (vae.downscale * m.patch[a + 1]) != 0)
          fail(std::string("data.") + pixel_axes[a],
               "expected a multiple of model.vae.downscale x model.patch[" + std::to_string(a + 1) +
                   "] = " + std::to_string(vae.downscale * m.patch[a + 1]) +
                   " (the DiT patches the VAE's latents), got " + std::to_string(pixel_sizes[a]));
      for (size_t i = 0; i < c.data.buckets.size(); ++i)
        for (int a = 0; a < 2; ++a)
          if (c.data.buckets[i][a + 1] % (vae.downscale * m.patch[a + 1]) != 0)
            fail("data.buckets", "item " + std::to_string(i) + ": " + pixel_axes[a] + " " +
                                     std::to_string(c.data.buckets[i][a + 1]) +
                                     " is not a multiple of model.vae.downscale x model.patch[" +
                                     std::to_string(a + 1) + "] = " + std::to_string(vae.downscale * m.patch[a + 1]));
    }
  }
  const char* axes[3] = {"frames", "height", "width"};
  // Wan's patches apply to its latents (the Wan VAE's, for videos).
  const auto latent = model_sample_shape(c);
  const int64_t sizes[3] = {wan ? latent[1] : c.data.frames, wan ? latent[2] : c.data.height,
                            wan ? latent[3] : c.data.width};
  const char* patch_names[3] = {"temporal", "height", "width"};
  const auto& patch = wan ? m.wan.patch : m.patch;
  for (int a = 0; a < 3; ++a) {
    if ((!wan || wan_sizes) && sizes[a] % patch[a] != 0)
      fail(std::string("data.") + axes[a],
           "expected a multiple of the " + std::string(patch_names[a]) + " patch " +
               (wan ? "model.wan.patch[" : "model.patch[") + std::to_string(a) + "] = " + std::to_string(patch[a]) +
               ", got " + std::to_string(sizes[a]) +
               (wan && c.data.dataset == "videos" ? " latent " + std::string(axes[a]) + " (the Wan VAE's)" : ""));
  }
  const auto& data = c.data;
  if (data.dataset == "videos") {
    if (data.manifest.empty() == data.root.empty())
      fail(data.manifest.empty() ? "data.root" : "data.manifest",
           "data.dataset: videos needs exactly one of data.manifest (a CSV or JSONL file) and data.root (a folder of "
           "videos with "
           ".txt captions)");
    if (data.fps > 0 && data.frame_stride != 1)
      fail("data.frame_stride", "set either data.fps (frames sampled at that rate) or data.frame_stride, not both");
    if (data.channels != 3)
      fail("data.channels", "expected 3 for data.dataset: videos (RGB), got " + std::to_string(data.channels));
  }
  for (size_t i = 0; i < data.buckets.size() && !wan; ++i) {  // Wan's: above, in latents
    for (int a = 0; a < 3; ++a) {
      if (data.buckets[i][a] % m.patch[a] != 0)
        fail("data.buckets", "item " + std::to_string(i) + ": " + axes[a] + " " + std::to_string(data.buckets[i][a]) +
                                 " is not a multiple of model.patch[" + std::to_string(a) +
                                 "] = " + std::to_string(m.patch[a]));
    }
  }
  if (!data.buckets.empty() && data.dataset != "videos") fail("data.buckets", "only data.dataset: videos has buckets");
  if (!data.cache.empty() && data.dataset != "videos") fail("data.cache", "only data.dataset: videos reads a cache");
  const auto& d = c.diffusion;
  if (wan ? c.data.dataset == "structured-motion" : c.data.dataset == "latent-tensors")
    fail("data.dataset",
         wan ? "expected latent-tensors (latent videos and text embeddings) or videos (cached through umT5 and the Wan "
               "VAE) for model.arch wan; structured-motion renders pixel videos for the DiT family"
             : "latent-tensors holds Wan's latents and text embeddings: expected structured-motion for model.arch " +
                   std::string(to_string(m.arch)));
  if (!c.data.tensors.empty() && c.data.dataset != "latent-tensors")
    fail("data.tensors", "applies to data.dataset: latent-tensors");
  if (d.objective == "flow" && !wan)
    fail("diffusion.objective", std::string("flow matching is implemented for model.arch wan; the ") +
                                    to_string(m.arch) + " DiT trains with ddpm");
  if (d.objective == "flow" && d.prediction != "epsilon")
    fail("diffusion.prediction",
         "applies to diffusion.objective ddpm; flow matching predicts the velocity ε − x0 (leave "
         "diffusion.prediction at epsilon)");
  for (const auto& entry : c.train.val_data) {
    const auto eq = entry.find('=');
    if (entry.rfind("data.", 0) != 0 || eq == std::string::npos || eq == 5)
      fail("train.val_data", "entry '" + entry +
                                 "': expected data.KEY=VALUE, a setting of the validation data that differs from the "
                                 "training data's (data.cache=/data/val, data.manifest=val.csv, data.seed=7)");
    const std::string key = entry.substr(0, eq);
    if (key == "data.channels" || key == "data.max_text_tokens")
      fail("train.val_data", "entry '" + entry + "': " + key +
                                 " is what the model takes (its input channels, its text length): the validation "
                                 "data keeps the training data's");
  }
  // The validation data's whole config checked with the run's (once: its own train.val_data is empty).
  if (c.train.val_every > 0 && !c.train.val_data.empty()) validation_data_config(c, source);
  if (d.loss_weighting == "min_snr" && d.objective != "ddpm")
    fail("diffusion.loss_weighting",
         "is min_snr, which weighs DDPM timesteps by their signal-to-noise ratio; diffusion.objective flow takes "
         "sigma_sqrt or cosmap (or none)");
  if ((d.loss_weighting == "sigma_sqrt" || d.loss_weighting == "cosmap") && d.objective != "flow")
    fail("diffusion.loss_weighting", "is " + d.loss_weighting +
                                         ", which weighs flow matching's σ; diffusion.objective ddpm takes min_snr "
                                         "(or none)");
  if (d.beta_end <= d.beta_start)
    fail("diffusion.beta_end", "expected a value above diffusion.beta_start (" + format_number(d.beta_start) +
                                   "), got " + format_number(d.beta_end));
  if (d.sample_steps > d.timesteps)
    fail("diffusion.sample_steps", "expected at most diffusion.timesteps (" + std::to_string(d.timesteps) + "), got " +
                                       std::to_string(d.sample_steps));
  check_sizes(c, fail);
  if (c.lora.rank > 0 && c.lora.targets.empty())
    fail("lora.targets", "is empty: name the Linear weights LoRA adapts (globs, [\"*\"]: every Linear of the blocks)");
  if (c.lora.factor == 0)
    fail("lora.factor", "is 0: expected -1 (each dimension's divisors nearest its square root) or a factor >= 1");
  if (c.lora.type == "lokr" && c.lora.rank > 0 && c.lora.dropout > 0)
    fail("lora.dropout",
         "is " + format_number(c.lora.dropout) +
             ", but lora.type lokr has no input dropout (LoKr's update is a weight, kron(W1, W2), applied to the "
             "whole input): set 0");
  if (c.lora.type == "lokr" && c.lora.rank > 0 && c.lora.init != "default")
    fail("lora.init", "is " + c.lora.init +
                          ", which is LoRA's; lora.type lokr starts as PEFT does (W1 = 0, W2 Kaiming-uniform): set "
                          "default");
  if (c.lora.base_dtype == "fp8" && c.lora.rank == 0)
    fail(
        "lora.base_dtype",
        "is fp8, but lora.rank is 0: every weight trains, and trained weights keep fp32 masters; fp8 stores the frozen "
        "base of a LoRA run (set lora.rank, or lora.base_dtype: compute)");
  if (c.lora.base_dtype == "fp8" && !c.offload.enabled)
    fail("lora.base_dtype",
         "is fp8, which the streamed trainer's frozen blocks use (offload.enabled: true); the resident loop keeps the "
         "model in fp32 on the device");
  if (c.lora.rank > 0 && c.optimizer.state_dtype != "fp32")
    fail("optimizer.state_dtype",
         "expected fp32 with lora.rank > 0: the adapters train on the device with LibTorch's AdamW (fp32 moments); "
         "bf16 and int8 moments are the streamed full fine-tuning's, got " +
             c.optimizer.state_dtype);
  if (c.offload.state_tier == "nvme" && !c.offload.enabled)
    fail("offload.state_tier",
         "is nvme, which keeps the streamed trainer's masters and moments on disk (offload.enabled: true); the "
         "resident loop keeps them on the device");
  if (c.offload.activations == "host" && !c.offload.enabled)
    fail("offload.activations",
         "is host, which moves the streamed trainer's block-boundary checkpoints to host memory (offload.enabled: "
         "true); the resident loop keeps every block's graph on the device");
  if (c.offload.state_tier == "nvme" && c.offload.nvme_dir.empty())
    fail("offload.nvme_dir",
         "is empty, but offload.state_tier is nvme: name a folder on the NVMe disk to hold the "
         "optimizer state");
  if (c.offload.state_tier == "nvme" && c.lora.rank > 0)
    fail("offload.state_tier",
         "is nvme, but lora.rank > 0: a LoRA run's frozen base has no optimizer state (its adapters train on the "
         "device); use ram");
  if (!c.offload.enabled && c.optimizer.state_dtype != "fp32")
    fail("optimizer.state_dtype",
         "expected fp32 with offload.enabled: false (the resident reference loop keeps LibTorch's "
         "fp32 moments; bf16 and int8 moments are the streamed trainer's), got " +
             c.optimizer.state_dtype);
}

std::array<int64_t, 4> model_sample_shape(const RunConfig& c) {
  const auto& d = c.data;
  if (c.model.arch == Architecture::kWan &&
      d.dataset == "videos") {  // the Wan VAE: 1 + 4k frames -> 1 + k latent frames
    const auto& v = c.model.vae;
    return {v.latent_channels, 1 + (d.frames - 1) / 4, d.height / v.downscale, d.width / v.downscale};
  }
  if (c.model.vae.kind == "sd") {
    const auto& v = c.model.vae;
    return {v.latent_channels, d.frames, d.height / v.downscale, d.width / v.downscale};
  }
  return {d.channels, d.frames, d.height, d.width};
}

VideoSize run_video_size(const RunConfig& c) {
  const auto& d = c.data;
  if (c.model.arch == Architecture::kWan && d.dataset != "videos")
    return {4 * (d.frames - 1) + 1, d.height * c.model.vae.downscale, d.width * c.model.vae.downscale};
  return {d.frames, d.height, d.width};
}

std::array<int64_t, 4> model_sample_shape_at(const RunConfig& c, VideoSize size) {
  const bool wan = c.model.arch == Architecture::kWan;
  const bool latent = wan || c.model.vae.kind == "sd";
  const int64_t ds = latent ? c.model.vae.downscale : 1;
  const auto& patch = wan ? c.model.wan.patch : c.model.patch;
  if (wan && (size.frames - 1) % 4 != 0)
    throw std::invalid_argument(fmt::format("{} frames: the Wan VAE takes 1 + 4k frames (e.g. {} or {})", size.frames,
                                            1 + 4 * ((size.frames - 1) / 4), 1 + 4 * ((size.frames - 1) / 4 + 1)));
  const int64_t t = wan ? 1 + (size.frames - 1) / 4 : size.frames;
  if (t % patch[0] != 0)
    throw std::invalid_argument(fmt::format("{} frames{}: not a multiple of the temporal patch {}", size.frames,
                                            wan ? fmt::format(" ({} latent frames)", t) : "", patch[0]));
  const std::pair<const char*, int64_t> sides[2] = {{"height", size.height}, {"width", size.width}};
  for (int a = 0; a < 2; ++a)
    if (sides[a].second % (ds * patch[a + 1]) != 0)
      throw std::invalid_argument(
          fmt::format("{} {}: not a multiple of {} ({}the patch {})", sides[a].first, sides[a].second,
                      ds * patch[a + 1], latent ? fmt::format("the VAE's downscale {} x ", ds) : "", patch[a + 1]));
  const int64_t channels = wan ? c.model.wan.out_channels : latent ? c.model.vae.latent_channels : c.data.channels;
  return {channels, t, size.height / ds, size.width / ds};
}

bool uses_dsa3d(const ModelConfig& model) {
  return model.arch == Architecture::kMegaSlide ||
         (model.arch == Architecture::kWan && model.self_attention == "dsa3d");
}

bool wan_image_to_video(const WanConfig& wan) {
  return wan.in_channels != wan.out_channels && wan.in_channels == 2 * wan.out_channels + 4;
}
int64_t wan_condition_channels(const WanConfig& wan) {
  return wan_image_to_video(wan) ? wan.in_channels - wan.out_channels : 0;
}

std::string to_yaml(const RunConfig& config) {
  RunConfig copy = config;
  Schema schema(copy);
  YAML::Emitter out;
  out << YAML::BeginMap;
  std::vector<std::string> open;  // the mappings open around the next key (section, then e.g. "wan")
  for (const auto& f : schema.fields()) {
    if (!applies(config, f.key)) continue;
    std::vector<std::string> parts;
    for (size_t begin = 0, dot; begin <= f.key.size(); begin = dot + 1) {
      dot = f.key.find('.', begin);
      if (dot == std::string::npos) dot = f.key.size();
      parts.push_back(f.key.substr(begin, dot - begin));
    }
    size_t common = 0;
    while (common < open.size() && common + 1 < parts.size() && open[common] == parts[common]) ++common;
    for (; open.size() > common; open.pop_back()) out << YAML::EndMap;
    for (size_t i = common; i + 1 < parts.size(); ++i) {
      out << YAML::Key << parts[i] << YAML::Value << YAML::BeginMap;
      open.push_back(parts[i]);
    }
    out << YAML::Key << parts.back() << YAML::Value << f.get();
  }
  for (; !open.empty(); open.pop_back()) out << YAML::EndMap;
  out << YAML::EndMap;
  return std::string(out.c_str()) + "\n";
}

std::vector<std::string> differing_keys(const RunConfig& a, const RunConfig& b) {
  RunConfig x = a, y = b;
  const Schema sx(x), sy(y);
  std::vector<std::string> out;
  for (size_t i = 0; i < sx.fields().size(); ++i)
    if (YAML::Dump(sx.fields()[i].get()) != YAML::Dump(sy.fields()[i].get())) out.push_back(sx.fields()[i].key);
  return out;
}

std::vector<std::string> unused_settings(const RunConfig& c) {
  const auto set = differing_keys(c, RunConfig{});
  std::vector<std::string> out;
  const auto unused = [&](const std::vector<std::string>& prefixes, const std::string& why) {
    std::string keys;
    for (const auto& key : set)
      for (const auto& prefix : prefixes)
        if (key.rfind(prefix, 0) == 0) keys += (keys.empty() ? "" : ", ") + key;
    if (!keys.empty()) out.push_back(keys + ": set, but " + why + ": ignored");
  };
  if (c.lora.rank == 0)
    unused({"lora.type", "lora.alpha", "lora.dropout", "lora.targets", "lora.init", "lora.factor"},
           "lora.rank is 0 (full fine-tuning, no LoRA)");
  if (c.offload.state_tier != "nvme")
    unused({"offload.nvme_dir", "offload.nvme_blocks_in_flight"}, "offload.state_tier is " + c.offload.state_tier);
  if (c.train.init_from.empty()) unused({"train.init_allow_missing"}, "train.init_from is not set");
  if (!c.offload.enabled) {
    unused({"offload.mode"}, "offload.enabled is false (the resident reference loop streams nothing)");
    if (c.offload.compute_dtype == "bf16" || c.offload.compute_dtype == "fp16")
      out.push_back("offload.compute_dtype: " + c.offload.compute_dtype +
                    ", but offload.enabled is false (the resident reference loop computes in fp32): ignored");
  }
  if (c.train.sample_every == 0) unused({"train.sample_prompts"}, "train.sample_every is 0 (no validation videos)");
  if (c.train.val_every == 0)
    unused({"train.val_batches", "train.val_data"}, "train.val_every is 0 (no validation loss)");
  // Wan's sizes as the config gives them (with model.wan.weights, the trainer says it once the weights were read).
  if (c.model.arch == Architecture::kWan && c.model.wan.weights.empty() && !wan_image_to_video(c.model.wan))
    unused({"data.image_frame"}, "this Wan is text-to-video (model.wan.in_channels equals out_channels)");
  if (c.diffusion.loss_weighting != "min_snr")
    unused({"diffusion.snr_gamma"}, "diffusion.loss_weighting is " + c.diffusion.loss_weighting + ", not min_snr");
  if (c.data.dataset != "structured-motion")
    unused({"data.num_clips"}, "data.dataset is " + c.data.dataset + ": an epoch is its items");
  if (c.data.dataset != "videos")
    unused({"data.fps", "data.frame_stride", "data.clip_start", "data.crop"},
           "data.dataset is " + c.data.dataset + ", not videos");
  if (c.offload.compute_dtype != "fp16" || !c.offload.enabled)
    unused({"train.loss_scale_init", "train.loss_scale_window"}, "the compute dtype is not fp16");
  const int64_t blocks =
      c.model.arch == Architecture::kWan ? c.model.wan.layers * (c.model.wan.expert == "both" ? 2 : 1) : c.model.layers;
  if (c.offload.enabled && c.offload.state_tier == "nvme" && c.lora.rank == 0 &&
      c.given.count("offload.nvme_blocks_in_flight") > 0 && c.offload.nvme_blocks_in_flight > blocks)
    out.push_back(fmt::format(
        "offload.nvme_blocks_in_flight ({}) is above the model's {} block{}: every block's state is in memory at a "
        "time (no saving over the RAM tier, which needs no file)",
        c.offload.nvme_blocks_in_flight, blocks, blocks == 1 ? "" : "s"));
  // Buckets are sized against data.frames/height/width, which the memory check, the planner and the dry run use.
  for (const auto& b : c.data.buckets)
    if (b[0] > c.data.frames || b[1] > c.data.height || b[2] > c.data.width) {
      out.push_back(fmt::format(
          "data.buckets [{}, {}, {}] is larger than data.frames/height/width ({} x {} x {}), by which the memory "
          "check, the planner and the dry run size a batch: set them to the largest bucket",
          b[0], b[1], b[2], c.data.frames, c.data.height, c.data.width));
      break;
    }
  if (c.train.warmup_steps > c.train.steps)
    out.push_back(
        fmt::format("train.warmup_steps ({}) is above train.steps ({}): the learning rate never reaches "
                    "train.lr (the last step's is {:.3g})",
                    c.train.warmup_steps, c.train.steps,
                    c.train.lr * static_cast<double>(c.train.steps) / static_cast<double>(c.train.warmup_steps)));
  return out;
}

RunConfig validation_data_config(const RunConfig& config, const std::string& source) {
  RunConfig base = config;
  base.train.val_data.clear();  // the validation config has none: parsing it does not come back here
  base.train.val_every = 0;
  RunConfig out;
  try {
    out = parse_run_config(to_yaml(base), source, config.train.val_data);
  } catch (const ConfigError& e) {
    // An entry's own error comes from "--set data.frames=0" ("--set data.frames=0: data.frames: ..."): said as the
    // entry; a rule across keys names the source (which may itself say "with --set overrides"), kept as it is.
    std::string problem = e.what();
    if (e.source().rfind("--set ", 0) == 0) problem = "entry " + problem.substr(6);
    throw ConfigError(source, "train.val_data", "the validation data's config: " + problem);
  }
  out.diffusion.caption_dropout = 0.0;
  out.diffusion.image_dropout = 0.0;
  return out;
}

std::string config_value_text(const RunConfig& config, const std::string& key) {
  RunConfig copy = config;
  const Schema schema(copy);
  const Field* f = schema.find(key);
  if (f == nullptr) return "";
  YAML::Emitter out;
  out << YAML::Flow << f->get();
  return out.c_str();
}

std::vector<std::string> config_keys() {
  RunConfig c;
  Schema schema(c);
  std::vector<std::string> keys;
  for (const auto& f : schema.fields()) keys.push_back(f.key);
  return keys;
}

}  // namespace megaslide
