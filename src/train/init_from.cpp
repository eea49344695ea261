#include "megaslide/train/init_from.h"
#include "megaslide/io/finite_weights.h"
#include "megaslide/io/files.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <map>
#include <regex>
#include <set>

#include "megaslide/model/wan_weights.h"
#include "megaslide/train/checkpoint.h"
#include "megaslide/train/run_folder.h"

namespace megaslide {

namespace {

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// For a Wan DiT's published weights at `path` (diffusers' folder or Wan-AI's and ComfyUI's original names, which
// train.init_from does not read): the advice to start from them with model.wan.weights; "" for anything else.
std::string wan_weights_advice(const std::string& path, bool folder) {
  try {
    const auto weights = WanWeights::open(path);
    if (!folder && weights.naming() == WanNaming::kDiffusers) return "";  // read here, under the trained names
    return fmt::format(
        "\n  ('{}' is a Wan DiT's weights ({}): start from them with model.wan.weights, which reads "
        "diffusers', Wan-AI's and ComfyUI's layouts; train.init_from reads a run's checkpoint or a file under the "
        "names the run trains)",
        path, folder ? "diffusers' folder" : "Wan's original names, as Wan-AI's and ComfyUI's files have them");
  } catch (const std::exception&) {
    return "";
  }
}

// The safetensors file `path` stands for.
std::string resolve_source(const std::string& path) {
  if (!io::path_exists(path)) throw InitFromError("train.init_from '" + path + "' does not exist");
  std::string checkpoint = path;
  if (!io::is_directory(path)) {
    // A run's checkpoints/latest pointer names its checkpoint; any other file is the weights.
    if (!is_checkpoint_pointer(path)) return path;
    try {
      checkpoint = find_checkpoint(path);
    } catch (const CheckpointError& e) {
      throw InitFromError(std::string("train.init_from: ") + e.what());
    }
  }
  if (io::path_exists(io::join_path(path, "checkpoints"))) {
    checkpoint = latest_checkpoint(path);
    if (checkpoint.empty()) throw InitFromError("train.init_from '" + path + "' is a run folder without a checkpoint");
  }
  if (checkpoint == path && !describe_existing_run(path).empty())  // a run's files, no checkpoint among them
    throw InitFromError("train.init_from '" + path +
                        "' is a run folder that saved no checkpoint (it stopped before its first, is still before it, "
                        "or was trained with train.checkpoint_every: 0)");
  if (!io::path_exists(io::join_path(checkpoint, "master.safetensors")))
    throw InitFromError("train.init_from '" + path +
                        "' is a folder but neither a checkpoint (no master.safetensors) nor a run folder" +
                        wan_weights_advice(path, true));
  try {
    verify_checkpoint(checkpoint);
  } catch (const CheckpointError& e) {
    throw InitFromError(std::string("train.init_from: ") + e.what());
  }
  return io::join_path(checkpoint, "master.safetensors");
}

}  // namespace

torch::Tensor InitTensor::read(torch::ScalarType dtype) const {
  const int64_t rows = entry.shape.empty() ? 1 : entry.shape[0];
  const int64_t begin = row_end < 0 ? 0 : row_begin, end = row_end < 0 ? rows : row_end;
  std::vector<int64_t> shape = entry.shape;
  if (!shape.empty()) shape[0] = end - begin;
  auto raw = torch::empty(shape, torch::TensorOptions().dtype(entry.dtype));
  const uint64_t total = entry.end - entry.begin;
  const uint64_t row_bytes = rows > 0 ? total / static_cast<uint64_t>(rows) : 0;
  const uint64_t offset = data_start + entry.begin + row_bytes * static_cast<uint64_t>(begin);
  uint64_t remaining = row_bytes * static_cast<uint64_t>(end - begin);
  if (entry.shape.empty()) remaining = total;
  int fd = -1;
  try {
    fd = io::open_input_file(file);
  } catch (const io::IoError& e) {
    throw InitFromError(std::string("train.init_from: ") + e.what());
  }
  auto* out = static_cast<char*>(raw.data_ptr());
  uint64_t done = 0;
  while (done < remaining) {
    const ssize_t r = ::pread(fd, out + done, remaining - done, static_cast<off_t>(offset + done));
    if (r <= 0) {
      ::close(fd);
      throw InitFromError("train.init_from '" + file + "': tensor '" + entry.name + "': read failed" +
                          (r < 0 ? std::string(": ") + std::strerror(errno) : " (file truncated)"));
    }
    done += static_cast<uint64_t>(r);
  }
  ::close(fd);
  try {
    io::require_finite(raw.data_ptr(), raw.numel(), raw.scalar_type(), file, entry.name);
  } catch (const io::NonFiniteWeightsError& e) {
    throw InitFromError(std::string("train.init_from ") + e.what());
  }
  return raw.to(dtype);
}

void InitTensor::read_into(const torch::Tensor& target) const {
  auto values = read(target.scalar_type());
  TORCH_CHECK(values.sizes() == target.sizes(), "InitTensor::read_into: '", entry.name, "' is ", values.sizes(),
              ", the target ", target.sizes());
  torch::NoGradGuard no_grad;
  target.copy_(values);
}

InitPlan plan_init_from(const std::string& path, const ParameterShapes& parameters,
                        const std::vector<std::string>& allow_missing) {
  InitPlan plan;
  plan.path = resolve_source(path);
  io::SafetensorsHeader header;
  try {
    header = io::read_safetensors_header(plan.path);
  } catch (const io::IoError& e) {
    throw InitFromError(std::string("train.init_from: ") + e.what());
  }
  // The file's tensors under the trainer's names (a weights file's "dit." prefix dropped).
  std::map<std::string, const io::SafetensorsEntry*> by_name;
  std::vector<std::string> duplicates;
  for (const auto& e : header.entries) {
    const std::string name = e.name.rfind("dit.", 0) == 0 ? e.name.substr(4) : e.name;
    if (!by_name.emplace(name, &e).second) duplicates.push_back(e.name);
  }
  std::set<std::string> used;
  std::vector<std::string> missing, misshaped;
  auto source = [&](const io::SafetensorsEntry& e) {
    InitTensor t;
    t.file = plan.path;
    t.entry = e;
    t.data_start = header.data_start;
    return t;
  };
  auto floating = [](torch::ScalarType t) {
    return t == torch::kFloat32 || t == torch::kFloat16 || t == torch::kBFloat16 || t == torch::kFloat64;
  };
  for (const auto& [name, shape] : parameters) {
    auto it = by_name.find(name);
    if (it != by_name.end()) {
      const auto& e = *it->second;
      used.insert(it->first);
      if (e.shape != shape) {
        misshaped.push_back(
            fmt::format("{}: {} in the file, {} in the model", e.name, shape_text(e.shape), shape_text(shape)));
      } else if (!floating(e.dtype)) {
        misshaped.push_back(fmt::format("{}: dtype {} in the file, expected a floating-point type", e.name,
                                        io::safetensors_dtype_name(e.dtype)));
      } else {
        plan.tensors.emplace_back(name, source(e));
      }
      continue;
    }
    // A global-attention model's fused qkv feeding separate q, k, v projections.
    bool converted = false;
    for (const char* part : {".q.", ".k.", ".v."}) {
      const auto at = name.rfind(".attn" + std::string(part));
      if (at == std::string::npos ||
          !(ends_with(name, std::string(part) + "weight") || ends_with(name, std::string(part) + "bias")))
        continue;
      const std::string fused = name.substr(0, at) + ".attn.qkv." + (ends_with(name, "weight") ? "weight" : "bias");
      auto f = by_name.find(fused);
      if (f == by_name.end() || shape.empty()) break;
      const auto& e = *f->second;
      std::vector<int64_t> expected = shape;
      expected[0] *= 3;
      used.insert(f->first);
      if (e.shape != expected) {
        misshaped.push_back(fmt::format("{}: {} in the file, {} needed to split it into q, k, v of {}", e.name,
                                        shape_text(e.shape), shape_text(expected), shape_text(shape)));
      } else {
        InitTensor t = source(e);
        const int64_t k = part[1] == 'q' ? 0 : part[1] == 'k' ? 1 : 2;
        t.row_begin = k * shape[0];
        t.row_end = (k + 1) * shape[0];
        plan.tensors.emplace_back(name, t);
      }
      converted = true;
      break;
    }
    if (converted) continue;
    bool allowed = false;
    for (const auto& pattern : allow_missing) allowed |= name_matches(pattern, name);
    if (allowed) plan.kept.push_back(name);
    else missing.push_back(name);
  }
  std::vector<std::string> unexpected;
  for (const auto& [name, e] : by_name)
    if (!used.count(name)) unexpected.push_back(e->name);
  for (const auto& d : duplicates) unexpected.push_back(d + " (a second tensor of that name once 'dit.' is dropped)");
  if (missing.empty() && unexpected.empty() && misshaped.empty()) return plan;

  std::string message =
      fmt::format("train.init_from '{}' does not match the model ({} parameters): ", plan.path, parameters.size());
  auto section = [&](const char* title, const std::vector<std::string>& names) {
    if (names.empty()) return;
    message += fmt::format("\n  {} ({}):", title, names.size());
    for (const auto& n : names) message += "\n    " + n;
  };
  section("missing from the file", missing);
  section("in the file but not in the model", unexpected);
  section("wrong shape or dtype", misshaped);
  if (const std::string advice = wan_weights_advice(plan.path, false); !advice.empty())
    throw InitFromError(message + advice);
  if (!missing.empty()) {
    // Globs of the missing parameters, each block's index a '*' ("blocks.*.attn1.offset_dw.weight"), the first few.
    static const std::regex index("(^|\\.)[0-9]+(?=\\.|$)");  // a name's part that is all digits
    std::set<std::string> globs;
    for (const auto& name : missing) globs.insert(std::regex_replace(name, index, "$1*"));
    std::string examples;
    int shown = 0;
    for (const auto& g : globs) {
      if (shown++ == 3) break;
      examples += fmt::format("{}\"{}\"", examples.empty() ? "" : ", ", g);
    }
    message += fmt::format(
        "\n  (parameters that may start from their initialisation can be named in train.init_allow_missing, e.g. "
        "[{}])",
        examples);
  }
  throw InitFromError(message);
}

}  // namespace megaslide
