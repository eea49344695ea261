#include "megaslide/diffusion/flow_matching.h"

#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <cmath>

namespace megaslide {

namespace {
// numpy.linspace(start, stop, num) in float64: start + i·step, the last value exactly `stop`.
std::vector<double> linspace(double start, double stop, int64_t num) {
  std::vector<double> y(static_cast<size_t>(num));
  if (num == 1) return {start};
  const double step = (stop - start) / static_cast<double>(num - 1);
  for (int64_t i = 0; i < num; ++i) y[static_cast<size_t>(i)] = static_cast<double>(i) * step + start;
  y.back() = stop;
  return y;
}

// Solves the small system A·x = b (n ≤ 3) by Gaussian elimination with partial pivoting.
std::vector<double> solve(std::vector<std::vector<double>> a, std::vector<double> b) {
  const size_t n = b.size();
  for (size_t c = 0; c < n; ++c) {
    size_t pivot = c;
    for (size_t r = c + 1; r < n; ++r)
      if (std::abs(a[r][c]) > std::abs(a[pivot][c])) pivot = r;
    std::swap(a[c], a[pivot]);
    std::swap(b[c], b[pivot]);
    for (size_t r = c + 1; r < n; ++r) {
      const double f = a[r][c] / a[c][c];
      for (size_t k = c; k < n; ++k) a[r][k] -= f * a[c][k];
      b[r] -= f * b[c];
    }
  }
  std::vector<double> x(n);
  for (size_t r = n; r-- > 0;) {
    double s = b[r];
    for (size_t k = r + 1; k < n; ++k) s -= a[r][k] * x[k];
    x[r] = s / a[r][r];
  }
  return x;
}
}  // namespace

TimestepSampling parse_timestep_sampling(const std::string& name) {
  if (name == "uniform") return TimestepSampling::kUniform;
  if (name == "logit_normal") return TimestepSampling::kLogitNormal;
  TORCH_CHECK(false, "diffusion.timestep_sampling: expected uniform or logit_normal, got '", name, "'");
}

FlowMatchingOptions FlowMatchingOptions::from_config(const RunConfig& config) {
  const auto& d = config.diffusion;
  auto options = FlowMatchingOptions()
                     .train_timesteps(d.timesteps)
                     .shift(d.shift)
                     .sampling(parse_timestep_sampling(d.timestep_sampling))
                     .logit_mean(d.logit_mean)
                     .logit_std(d.logit_std);
  const auto& w = config.model.wan;
  if (config.model.arch == Architecture::kWan && !w.expert.empty()) {
    TORCH_CHECK(w.boundary_ratio > 0 && w.boundary_ratio < 1, "FlowMatchingOptions: model.wan.expert ", w.expert,
                " needs the resolved model.wan.boundary_ratio in (0, 1), got ", w.boundary_ratio);
    if (w.expert == "high") options.sigma_min(w.boundary_ratio);
    if (w.expert == "low") options.sigma_max(w.boundary_ratio);
  }
  return options;
}

double shift_sigma(double sigma, double shift) { return shift * sigma / (1.0 + (shift - 1.0) * sigma); }
double unshift_sigma(double sigma, double shift) { return sigma / (shift - (shift - 1.0) * sigma); }

torch::Tensor shift_sigmas(const torch::Tensor& sigma, double shift) {
  return shift * sigma / (1.0 + (shift - 1.0) * sigma);
}

double flow_sigma_cdf(double sigma, const FlowMatchingOptions& options) {
  const double x = unshift_sigma(sigma, options.shift());  // the unshifted u below which σ falls
  if (options.sampling() != TimestepSampling::kLogitNormal || x <= 0 || x >= 1) return std::clamp(x, 0.0, 1.0);
  return 0.5 * std::erfc(-(std::log(x / (1.0 - x)) - options.logit_mean()) / (options.logit_std() * std::sqrt(2.0)));
}

torch::Tensor sample_flow_sigmas(int64_t batch, const FlowMatchingOptions& options, at::Generator& generator) {
  const auto f64 = torch::TensorOptions().dtype(torch::kFloat64);
  const double lo = options.sigma_min(), hi = options.sigma_max();
  TORCH_CHECK(0 <= lo && lo < hi && hi <= 1, "sample_flow_sigmas: the σ range [", lo, ", ", hi,
              ") is empty or not in [0, 1]");
  torch::Tensor u;
  if (lo > 0 || hi < 1) {
    // The CDF of u at the unshifted ends, a uniform draw between them, back through the inverse CDF.
    const bool logit = options.sampling() == TimestepSampling::kLogitNormal;
    const double p_lo = flow_sigma_cdf(lo, options), p_hi = flow_sigma_cdf(hi, options);
    const auto p = p_lo + torch::rand({batch}, generator, f64) * (p_hi - p_lo);
    u = logit
            ? torch::sigmoid(options.logit_mean() + options.logit_std() * std::sqrt(2.0) * torch::erfinv(2.0 * p - 1.0))
            : p;
  } else if (options.sampling() == TimestepSampling::kUniform) {
    u = torch::rand({batch}, generator, f64);
  } else {
    u = torch::sigmoid(torch::randn({batch}, generator, f64) * options.logit_std() + options.logit_mean());
  }
  auto sigma = shift_sigmas(u, options.shift()).to(torch::kFloat32);
  // A σ just under the range's end may round up to it in float32: kept below (the other expert's side).
  if (hi < 1) sigma.clamp_max_(std::nextafter(static_cast<float>(hi), 0.0f));
  return sigma;
}

torch::Tensor flow_noisy(const torch::Tensor& x0, const torch::Tensor& noise, const torch::Tensor& sigma) {
  std::vector<int64_t> shape(static_cast<size_t>(x0.dim()), 1);
  shape[0] = sigma.size(0);
  const auto s = sigma.to(x0.device(), x0.scalar_type()).view(shape);
  return (1 - s) * x0 + s * noise;
}

torch::Tensor flow_target(const torch::Tensor& x0, const torch::Tensor& noise) { return noise - x0; }

FlowEulerSchedule::FlowEulerSchedule(int64_t steps, double shift, int64_t train_timesteps) {
  TORCH_CHECK(steps >= 1 && train_timesteps >= 2 && shift > 0, "FlowEulerSchedule: steps ", steps, ", shift ", shift,
              ", train_timesteps ", train_timesteps);
  // diffusers' constructor shifts its table (σ = t/T for t = T … 1) in float32; σ_max is then 1 and σ_min
  // the shifted 1/T.
  const float s = 1.0f / static_cast<float>(train_timesteps);
  const float shifted_min = static_cast<float>(shift) * s / (1.0f + static_cast<float>(shift - 1.0) * s);
  const float shifted_max = static_cast<float>(shift) * 1.0f / (1.0f + static_cast<float>(shift - 1.0) * 1.0f);
  // set_timesteps: linspace of σ·T in float64, back to σ, shifted again, rounded to float32.
  const double T = static_cast<double>(train_timesteps);
  const auto t = linspace(static_cast<double>(shifted_max) * T, static_cast<double>(shifted_min) * T, steps);
  sigmas_ = torch::empty({steps + 1}, torch::kFloat32);
  for (int64_t i = 0; i < steps; ++i)
    sigmas_[i] = static_cast<float>(shift_sigma(t[static_cast<size_t>(i)] / T, shift));
  sigmas_[steps] = 0.0f;
  timesteps_ = sigmas_.narrow(0, 0, steps) * static_cast<float>(train_timesteps);
}

torch::Tensor FlowEulerSchedule::step(int64_t i, const torch::Tensor& x, const torch::Tensor& v) const {
  TORCH_CHECK(i >= 0 && i < steps(), "FlowEulerSchedule::step: index ", i, " outside [0, ", steps(), ")");
  // dt in float32 as diffusers subtracts its float32 σ values.
  const float dt = sigmas_[i + 1].item<float>() - sigmas_[i].item<float>();
  return x.to(torch::kFloat32) + dt * v.to(torch::kFloat32);
}

FlowUniPC::FlowUniPC(int64_t steps, double shift, int64_t order, UniPCSolverType solver, int64_t train_timesteps)
    : order_(order), solver_(solver) {
  TORCH_CHECK(steps >= 1 && train_timesteps >= 2 && shift > 0, "FlowUniPC: steps ", steps, ", shift ", shift);
  TORCH_CHECK(order >= 1 && order <= 3, "FlowUniPC: solver order must be 1, 2 or 3, got ", order);
  const double T = static_cast<double>(train_timesteps);
  auto s = linspace(1.0, 1.0 / T, steps + 1);
  s.pop_back();
  for (auto& x : s) x = shift_sigma(x, shift);
  if (std::fabs(s[0] - 1.0) < 1e-6) s[0] -= 1e-6;
  sigmas_ = torch::empty({steps + 1}, torch::kFloat32);
  timesteps_ = torch::empty({steps}, torch::kInt64);
  for (int64_t i = 0; i < steps; ++i) {
    sigmas_[i] = static_cast<float>(s[static_cast<size_t>(i)]);
    timesteps_[i] = static_cast<int64_t>(s[static_cast<size_t>(i)] * T);  // truncation, as .to(int64)
  }
  sigmas_[steps] = 0.0f;
  for (int64_t i = 0; i <= steps; ++i) sigma_.push_back(static_cast<double>(sigmas_[i].item<float>()));
}

double FlowUniPC::lambda(int64_t i) const {
  const double s = sigma_[static_cast<size_t>(i)];
  return std::log(1.0 - s) - std::log(s);
}

namespace {
// The UniPC coefficients for `order` with ratios `rks` (the last 1) at step size h (predict_x0: hh = −h).
struct UniCoefficients {
  double h_phi_1 = 0, B_h = 0;
  std::vector<std::vector<double>> R;
  std::vector<double> b;
};
UniCoefficients coefficients(double h, const std::vector<double>& rks, int64_t order, UniPCSolverType solver) {
  UniCoefficients c;
  const double hh = -h;
  c.h_phi_1 = std::expm1(hh);
  double h_phi_k = c.h_phi_1 / hh - 1.0;
  double factorial = 1.0;
  c.B_h = solver == UniPCSolverType::kBh1 ? hh : std::expm1(hh);
  for (int64_t i = 1; i <= order; ++i) {
    std::vector<double> row;
    for (double r : rks) row.push_back(std::pow(r, static_cast<double>(i - 1)));
    c.R.push_back(row);
    c.b.push_back(h_phi_k * factorial / c.B_h);
    factorial *= static_cast<double>(i + 1);
    h_phi_k = h_phi_k / hh - 1.0 / factorial;
  }
  return c;
}
}  // namespace

torch::Tensor FlowUniPC::predictor(const torch::Tensor& x, int64_t order) {
  const int64_t i = index_;
  const double sigma_t = sigma_[static_cast<size_t>(i + 1)], sigma_s0 = sigma_[static_cast<size_t>(i)];
  const double alpha_t = 1.0 - sigma_t;
  const double lambda_s0 = lambda(i);
  const double h = (std::log(alpha_t) - std::log(sigma_t)) - lambda_s0;
  const auto& m0 = x0_history_.back();
  std::vector<double> rks;
  std::vector<torch::Tensor> D1s;
  for (int64_t k = 1; k < order; ++k) {
    const double rk = (lambda(i - k) - lambda_s0) / h;
    rks.push_back(rk);
    D1s.push_back((x0_history_[x0_history_.size() - 1 - static_cast<size_t>(k)] - m0) / static_cast<float>(rk));
  }
  rks.push_back(1.0);
  const auto c = coefficients(h, rks, order, solver_);
  auto x_t = static_cast<float>(sigma_t / sigma_s0) * x - static_cast<float>(alpha_t * c.h_phi_1) * m0;
  if (!D1s.empty()) {
    std::vector<double> rhos;
    if (order == 2) {
      rhos = {0.5};
    } else {
      std::vector<std::vector<double>> R(c.R.begin(), c.R.end() - 1);
      for (auto& row : R) row.pop_back();
      rhos = solve(R, std::vector<double>(c.b.begin(), c.b.end() - 1));
    }
    torch::Tensor res = static_cast<float>(rhos[0]) * D1s[0];
    for (size_t k = 1; k < D1s.size(); ++k) res = res + static_cast<float>(rhos[k]) * D1s[k];
    x_t = x_t - static_cast<float>(alpha_t * c.B_h) * res;
  }
  return x_t;
}

torch::Tensor FlowUniPC::corrector(const torch::Tensor& this_x0, const torch::Tensor& last_sample,
                                   const torch::Tensor& this_sample, int64_t order) {
  (void)this_sample;
  const int64_t i = index_;
  const double sigma_t = sigma_[static_cast<size_t>(i)], sigma_s0 = sigma_[static_cast<size_t>(i - 1)];
  const double alpha_t = 1.0 - sigma_t;
  const double lambda_s0 = lambda(i - 1);
  const double h = lambda(i) - lambda_s0;
  const auto& m0 = x0_history_.back();
  std::vector<double> rks;
  std::vector<torch::Tensor> D1s;
  for (int64_t k = 1; k < order; ++k) {
    const double rk = (lambda(i - (k + 1)) - lambda_s0) / h;
    rks.push_back(rk);
    D1s.push_back((x0_history_[x0_history_.size() - 1 - static_cast<size_t>(k)] - m0) / static_cast<float>(rk));
  }
  rks.push_back(1.0);
  const auto c = coefficients(h, rks, order, solver_);
  const std::vector<double> rhos = order == 1 ? std::vector<double>{0.5} : solve(c.R, c.b);
  auto x_t = static_cast<float>(sigma_t / sigma_s0) * last_sample - static_cast<float>(alpha_t * c.h_phi_1) * m0;
  torch::Tensor correction = static_cast<float>(rhos.back()) * (this_x0 - m0);
  if (!D1s.empty()) {
    torch::Tensor res = static_cast<float>(rhos[0]) * D1s[0];
    for (size_t k = 1; k < D1s.size(); ++k) res = res + static_cast<float>(rhos[k]) * D1s[k];
    correction = res + correction;
  }
  return x_t - static_cast<float>(alpha_t * c.B_h) * correction;
}

torch::Tensor FlowUniPC::step(int64_t i, const torch::Tensor& x_in, const torch::Tensor& v) {
  TORCH_CHECK(i == index_, "FlowUniPC::step: steps are taken in order; expected step ", index_, ", got ", i);
  TORCH_CHECK(i < steps(), "FlowUniPC::step: all ", steps(), " steps are done");
  torch::Tensor x = x_in.to(torch::kFloat32);
  // The flow output converted to the x0 prediction at σ_i (from the sample before any correction).
  const auto x0 = x - static_cast<float>(sigma_[static_cast<size_t>(i)]) * v.to(torch::kFloat32);
  if (i > 0 && last_sample_.defined()) x = corrector(x0, last_sample_, x, this_order_);
  x0_history_.push_back(x0);
  if (static_cast<int64_t>(x0_history_.size()) > order_) x0_history_.erase(x0_history_.begin());
  const int64_t this_order = std::min(order_, steps() - i);  // lower_order_final
  this_order_ = std::min(this_order, lower_order_nums_ + 1);
  last_sample_ = x;
  auto next = predictor(x, this_order_);
  lower_order_nums_ = std::min(lower_order_nums_ + 1, order_);
  ++index_;
  return next;
}

FlowSamplerKind parse_flow_sampler(const std::string& name) {
  if (name == "euler") return FlowSamplerKind::kEuler;
  if (name == "unipc") return FlowSamplerKind::kUniPC;
  TORCH_CHECK(false, "flow sampler: expected euler or unipc, got '", name, "'");
}

torch::Tensor flow_sample(const FlowModelFn& model, const FlowSamplerOptions& options,
                          const std::vector<int64_t>& sample_shape, const std::vector<uint64_t>& seeds,
                          const Conditioning& cond, const Conditioning& uncond, torch::Device device,
                          const std::function<void(int64_t, int64_t)>& on_step) {
  const int64_t B = static_cast<int64_t>(seeds.size());
  TORCH_CHECK(B >= 1, "flow_sample: no seeds");
  std::vector<torch::Tensor> starts;
  for (uint64_t seed : seeds) {
    auto gen = at::detail::createCPUGenerator(seed);
    starts.push_back(torch::randn(sample_shape, gen, torch::TensorOptions().dtype(torch::kFloat32)));
  }
  torch::Tensor x = torch::stack(starts).to(device);
  const bool guided = options.guidance_scale() != 1.0;
  auto batch_of = [&](const torch::Tensor& t) {
    if (!t.defined() || t.size(0) == B) return t;
    TORCH_CHECK(t.size(0) == 1, "flow_sample: the unconditional batch must be 1 or ", B, ", got ", t.size(0));
    auto shape = t.sizes().vec();
    shape[0] = B;
    return t.expand(shape);
  };
  const torch::Tensor text = guided ? torch::cat({cond.text, batch_of(uncond.text)}) : cond.text;
  torch::Tensor mask;
  if (cond.mask.defined()) mask = guided ? torch::cat({cond.mask, batch_of(uncond.mask)}) : cond.mask;
  // The low-noise expert's scale below the boundary (diffusers compares the step's timestep with
  // boundary_ratio x num_train_timesteps).
  const double boundary = options.boundary_ratio() * static_cast<double>(options.train_timesteps());
  const double scale_2 = options.guidance_scale_2() < 0 ? options.guidance_scale() : options.guidance_scale_2();
  auto scale_at = [&](const torch::Tensor& t) {
    return options.boundary_ratio() > 0 && t.item<double>() < boundary ? scale_2 : options.guidance_scale();
  };
  auto guide = [&](const torch::Tensor& t) {
    torch::NoGradGuard no_grad;
    if (!guided) return model(x, t.expand({B}), text, mask).to(torch::kFloat32);
    auto out = model(torch::cat({x, x}), t.expand({2 * B}), text, mask).to(torch::kFloat32);
    auto c = out.narrow(0, 0, B), u = out.narrow(0, B, B);
    return u + scale_at(t) * (c - u);
  };
  const int64_t S = options.steps();
  if (options.kind() == FlowSamplerKind::kEuler) {
    FlowEulerSchedule schedule(S, options.shift(), options.train_timesteps());
    for (int64_t i = 0; i < S; ++i) {
      x = schedule.step(i, x, guide(schedule.timesteps()[i].to(device).view({1})));
      if (on_step) on_step(i + 1, S);
    }
  } else {
    FlowUniPC solver(S, options.shift(), options.order(), UniPCSolverType::kBh2, options.train_timesteps());
    for (int64_t i = 0; i < S; ++i) {
      x = solver.step(i, x, guide(solver.timesteps()[i].to(device, torch::kFloat32).view({1})));
      if (on_step) on_step(i + 1, S);
    }
  }
  return x;
}

}  // namespace megaslide
