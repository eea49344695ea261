#include "megaslide/train/streamed_state.h"

#include <map>

#include "megaslide/train/checkpoint.h"

namespace megaslide {

namespace {
BlockNames or_default(const BlockNames& names) {
  if (names) return names;
  return [](int64_t l) { return "blocks." + std::to_string(l); };
}
}  // namespace

TrainingState streamed_training_state(offload::StreamedStackTrainer& engine, const io::NamedTensors& resident,
                                      const BlockNames& names) {
  const BlockNames block_name = or_default(names);
  engine.synchronize();
  TrainingState s;
  s.optimizer_steps = engine.optimizer_steps();
  s.loss_scale = engine.loss_scale();
  s.clean_steps = engine.clean_steps();
  auto* optimizer = engine.resident_optimizer();
  const bool ema = engine.has_ema();
  s.ema_valid = ema;
  for (const auto& [name, p] : resident) {
    auto moments = adamw_moments(*optimizer, p);
    s.master.emplace_back(name, p.detach().to(torch::kCPU, torch::kFloat32).clone());
    s.exp_avg.emplace_back(name, moments.exp_avg);
    s.exp_avg_sq.emplace_back(name, moments.exp_avg_sq);
    if (ema) s.ema.emplace_back(name, engine.resident_ema(p).to(torch::kCPU).clone());
  }
  const auto& store = engine.store();
  if (store.options().frozen) return s;  // frozen blocks (LoRA's base): the resident parameters are the state
  // The blocks' flat buffers (this rank's shard of them when sharded).
  TrainingState::BlockShards shards;
  shards.rank = store.options().shard_rank;
  shards.world_size = store.options().shard_count;
  shards.owner = &store;
  const bool paged = store.paged();  // the NVMe tier: each block's state in memory only while held
  // Block l's state: the store's own buffers, or (paged) views valid while `lease` lives.
  const auto block_state = [&store, ema](int64_t l, TrainingState::BlockShards::Block& b) {
    b.master = store.master(l);
    b.exp_avg = store.exp_avg(l);
    b.exp_avg_sq = store.exp_avg_sq(l);
    if (ema) b.ema = store.ema(l);
    if (store.options().state_dtype == offload::StateDtype::kInt8) {
      b.exp_avg_scale = store.exp_avg_scale(l);
      b.exp_avg_sq_scale = store.exp_avg_sq_scale(l);
    }
  };
  for (int64_t l = 0; l < store.num_blocks(); ++l) {
    TrainingState::BlockShards::Block b;
    b.name = block_name(l);
    b.numel = store.block_numel(l);
    b.begin = store.shard(l).begin;
    b.end = store.shard(l).end;
    for (const auto& spec : store.block_spec(l).params) b.params.emplace_back(spec.name, spec.shape);
    if (paged) {  // what the tensors are, on the meta device (nothing read): hold(l) gives them
      const auto meta = torch::TensorOptions().device(torch::kMeta);
      const auto state = store.options().state_dtype;
      const auto m = state == offload::StateDtype::kFloat32    ? torch::kFloat
                     : state == offload::StateDtype::kBFloat16 ? torch::kBFloat16
                                                               : torch::kChar;
      const int64_t n = b.end - b.begin;
      b.master = torch::empty({n}, meta.dtype(torch::kFloat));
      b.exp_avg = torch::empty({n}, meta.dtype(m));
      b.exp_avg_sq = torch::empty({n}, meta.dtype(m == torch::kChar ? torch::kByte : m));
      if (ema) b.ema = torch::empty({n}, meta.dtype(torch::kFloat));
      if (state == offload::StateDtype::kInt8) {
        int64_t groups = 0;
        for (const auto& spec : store.block_spec(l).params) {
          int64_t numel = 1;
          for (const int64_t d : spec.shape) numel *= d;
          groups += offload::state_groups(numel);
        }
        b.exp_avg_scale = torch::empty({groups}, meta.dtype(torch::kFloat));
        b.exp_avg_sq_scale = torch::empty({groups}, meta.dtype(torch::kFloat));
      }
    } else {
      block_state(l, b);
    }
    if (store.sharded() || paged) {
      for (const auto& spec : store.block_spec(l).params)
        shards.weights.emplace_back(b.name + "." + spec.name, store.param(l, spec.name).compute);
    }
    shards.blocks.push_back(std::move(b));
  }
  if (ema && (store.sharded() || paged))
    shards.gather_ema = [&engine](int64_t l) { return engine.gathered_block_ema(l); };
  if (paged) {
    const auto names = shards.blocks;  // the names and layouts, copied into the callback
    // A hold for writing (a checkpoint being read in) rounds the block's compute copy from the new masters
    // before it lets the block go, so that load_training_state need not read every block back for it.
    struct WriteHold {
      offload::HostParamStore::StateLease lease;
      std::function<void()> on_release;
      ~WriteHold() {
        if (!on_release) return;
        try {
          on_release();
        } catch (...) {  // a destructor must not throw: the engine marks its compute copies stale (the load's
                         // reload_blocks_from_masters rounds every block again), or the load has failed anyway
        }
      }
    };
    shards.hold = [&engine, &store, block_state, names](int64_t l, TrainingState::BlockShards::Access access) {
      using Access = TrainingState::BlockShards::Access;
      TrainingState::BlockShards::Held held;
      if (access == Access::kRead) {
        held.lease = std::make_shared<offload::HostParamStore::StateLease>(store.acquire_state(l, false));
      } else {
        engine.synchronize();
        auto hold = std::make_shared<WriteHold>();
        hold->lease = access == Access::kOverwrite ? store.acquire_state_to_overwrite(l) : store.acquire_state(l);
        hold->on_release = [&engine, l] { engine.restore_block_compute(l); };
        held.lease = std::move(hold);
      }
      held.block = names[static_cast<size_t>(l)];
      block_state(l, held.block);
      return held;
    };
  }
  s.shards = std::move(shards);
  if (store.sharded() || paged) return s;  // the blocks are in s.shards only
  for (int64_t l = 0; l < store.num_blocks(); ++l) {
    const std::string prefix = block_name(l) + ".";
    for (const auto& spec : store.block_spec(l).params) {
      const auto views = store.param(l, spec.name);
      s.master.emplace_back(prefix + spec.name, views.master);
      s.exp_avg.emplace_back(prefix + spec.name, views.exp_avg);
      s.exp_avg_sq.emplace_back(prefix + spec.name, views.exp_avg_sq);
      if (ema) s.ema.emplace_back(prefix + spec.name, views.ema);
      if (views.exp_avg_scale.defined()) {
        s.exp_avg_scale.emplace_back(prefix + spec.name, views.exp_avg_scale);
        s.exp_avg_sq_scale.emplace_back(prefix + spec.name, views.exp_avg_sq_scale);
      }
    }
  }
  return s;
}

void load_streamed_training_state(offload::StreamedStackTrainer& engine, const io::NamedTensors& resident,
                                  const TrainingState& s, const std::string& who, const BlockNames& names,
                                  const std::function<int64_t(const std::string&)>& adam_steps) {
  const BlockNames block_name = or_default(names);
  engine.synchronize();
  const auto& store = engine.store();
  size_t expected = resident.size();
  const bool frozen = store.options().frozen;               // LoRA's base: nothing of the blocks is in the state
  const bool in_shards = store.sharded() || store.paged();  // the blocks are in s.shards only
  if (!in_shards && !frozen)
    for (int64_t l = 0; l < store.num_blocks(); ++l) expected += store.block_spec(l).params.size();
  TORCH_CHECK(s.master.size() == expected && s.exp_avg.size() == expected && s.exp_avg_sq.size() == expected, who,
              "::load_training_state: expected ", expected, " parameters, got ", s.master.size());
  // The EMA, when this trainer keeps one and the state holds one (else it starts from the loaded weights).
  const bool ema = engine.has_ema() && s.ema_valid;
  TORCH_CHECK(!ema || s.ema.size() == s.master.size(), who, "::load_training_state: the EMA lists ", s.ema.size(),
              " parameters, the masters ", s.master.size());
  std::map<std::string, size_t> index;
  for (size_t i = 0; i < s.master.size(); ++i) index[s.master[i].first] = i;
  auto find = [&](const std::string& name) {
    auto it = index.find(name);
    TORCH_CHECK(it != index.end(), who, "::load_training_state: no state for parameter '", name, "'");
    return it->second;
  };
  std::map<std::string, size_t> scale_index;  // int8 moments: where each block parameter's scales are
  for (size_t q = 0; q < s.exp_avg_scale.size(); ++q) scale_index[s.exp_avg_scale[q].first] = q;
  TORCH_CHECK(s.exp_avg_sq_scale.size() == s.exp_avg_scale.size(), who,
              "::load_training_state: exp_avg and exp_avg_sq scales differ in number");
  torch::NoGradGuard no_grad;
  auto* optimizer = engine.resident_optimizer();
  for (const auto& [name, p] : resident) {
    const size_t i = find(name);
    TORCH_CHECK(s.master[i].second.sizes() == p.sizes(), who, "::load_training_state: '", name, "' is ",
                s.master[i].second.sizes(), ", the model's is ", p.sizes());
    p.copy_(s.master[i].second);
    set_adamw_moments(*optimizer, p, s.exp_avg[i].second, s.exp_avg_sq[i].second,
                      adam_steps ? adam_steps(name) : s.optimizer_steps);
    if (ema) {
      TORCH_CHECK(s.ema[i].first == name && s.ema[i].second.sizes() == p.sizes(), who,
                  "::load_training_state: the EMA of '", name, "' is missing or has another shape");
      engine.resident_ema(p).copy_(s.ema[i].second);
    }
  }
  if (in_shards) {
    // The blocks' shards: read in place when the state is this trainer's own (load_checkpoint), else copied.
    TORCH_CHECK(s.shards && s.shards->blocks.size() == static_cast<size_t>(store.num_blocks()), who,
                "::load_training_state: a sharded trainer, or one on the NVMe tier, needs the blocks' shards "
                "(TrainingState::shards)");
    // This trainer's own state (load_checkpoint read into it): every block is in place, nothing to copy (and on
    // the NVMe tier nothing to read back to find that out).
    const int64_t copied_blocks = s.shards->owner == &store ? 0 : store.num_blocks();
    for (int64_t l = 0; l < copied_blocks; ++l) {
      const auto lease = store.acquire_state(l, /*write=*/false);  // written back only if copied into (below)
      const auto held = s.shards->held(l, TrainingState::BlockShards::Access::kRead);
      const auto& b = held.block;
      std::vector<std::pair<at::Tensor, const torch::Tensor*>> parts = {
          {store.master(l), &b.master}, {store.exp_avg(l), &b.exp_avg}, {store.exp_avg_sq(l), &b.exp_avg_sq}};
      if (ema) {
        TORCH_CHECK(b.ema.defined(), who, "::load_training_state: ", b.name, "'s shard has no EMA");
        parts.emplace_back(store.ema(l), &b.ema);
      }
      if (store.options().state_dtype == offload::StateDtype::kInt8) {
        TORCH_CHECK(b.exp_avg_scale.defined() && b.exp_avg_sq_scale.defined(), who, "::load_training_state: ", b.name,
                    " has no int8 moment scales");
        parts.emplace_back(store.exp_avg_scale(l), &b.exp_avg_scale);
        parts.emplace_back(store.exp_avg_sq_scale(l), &b.exp_avg_sq_scale);
      }
      for (const auto& [target, source] : parts) {
        TORCH_CHECK(source->sizes() == target.sizes() && source->scalar_type() == target.scalar_type(), who,
                    "::load_training_state: ", b.name, "'s shard is ", source->scalar_type(), " ", source->sizes(),
                    ", the store holds ", target.scalar_type(), " ", target.sizes());
        if (source->data_ptr() == target.data_ptr()) continue;
        const auto write = store.acquire_state(l, /*write=*/true);  // the NVMe tier: the block is written back
        target.copy_(*source);
      }
    }
  }
  for (int64_t l = 0; l < (in_shards || frozen ? 0 : store.num_blocks()); ++l) {
    const std::string prefix = block_name(l) + ".";
    for (const auto& spec : store.block_spec(l).params) {
      const size_t i = find(prefix + spec.name);
      const auto views = store.param(l, spec.name);
      std::vector<std::pair<const torch::Tensor*, const torch::Tensor*>> parts = {
          {&views.master, &s.master[i].second},
          {&views.exp_avg, &s.exp_avg[i].second},
          {&views.exp_avg_sq, &s.exp_avg_sq[i].second}};
      if (ema) {
        TORCH_CHECK(s.ema[i].first == prefix + spec.name, who, "::load_training_state: the EMA of '",
                    prefix + spec.name, "' is missing");
        parts.push_back({&views.ema, &s.ema[i].second});
      }
      if (views.exp_avg_scale.defined()) {
        auto q = scale_index.find(prefix + spec.name);
        TORCH_CHECK(q != scale_index.end(), who, "::load_training_state: no int8 moment scales for '",
                    prefix + spec.name, "'");
        parts.push_back({&views.exp_avg_scale, &s.exp_avg_scale[q->second].second});
        parts.push_back({&views.exp_avg_sq_scale, &s.exp_avg_sq_scale[q->second].second});
      }
      for (const auto& [target, source] : parts) {
        TORCH_CHECK(source->sizes() == target->sizes() && source->scalar_type() == target->scalar_type(), who,
                    "::load_training_state: '", prefix + spec.name, "' is ", source->scalar_type(), " ",
                    source->sizes(), ", the store holds ", target->scalar_type(), " ", target->sizes());
        if (source->data_ptr() != target->data_ptr()) target->copy_(*source);  // not read in place
      }
    }
  }
  // On the NVMe tier a state read into this trainer's own store (load_checkpoint through shards.hold) has
  // rounded each block's compute copy as it let the block go.
  engine.reload_blocks_from_masters(/*compute_restored=*/store.paged() && s.shards && s.shards->owner == &store);
  engine.restore_counters(s.optimizer_steps, s.loss_scale, s.clean_steps);
  if (engine.has_ema() && !ema) engine.reset_ema_to_weights();
}

}  // namespace megaslide
