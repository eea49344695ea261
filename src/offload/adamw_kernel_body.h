// The vector AdamW kernel, written once over a SIMD shim: adamw_kernel_avx512.cpp and adamw_kernel_avx2.cpp
// each define a shim and instantiate this body with it (the scalar kernel stays separate). Include it only
// from those two files. Like them it includes no LibTorch header (adamw_kernels.h says why), and all of it
// sits in an unnamed namespace: each ISA file compiles its own copy with its own -m flags, and a symbol
// shared between them could let the linker keep the AVX-512 copy for AVX2 callers.
//
// A shim is a struct of static inline functions over kLanes lanes:
//   F, I, H       kLanes fp32 lanes, kLanes int32 lanes, kLanes 16-bit lanes
//   Mask          the live lanes of a vector: all(), or first(n) for the n < kLanes of a tail. Dead lanes load
//                 as 0 and their stores leave memory untouched.
//   load_f32 store_f32 load_u16 store_u16<kStream> load_i8 load_u8 store_i8 store_u8   (each with a Mask)
//   load_aligned store_aligned   whole vectors of a vector-aligned float buffer
//   widen_bf16 widen_fp16 to_bf16 to_fp16   exact widening; c10's rounding and NaN patterns
//   to_bf16_not_nan to_fp16_not_nan   the same roundings for lanes known not to be NaN (no NaN fix-up)
//   any_nan       whether any lane is NaN
//   truncate_bf16   the top halves of fp32 lanes (the stream probe's copy)
//   set1 zero add mul div fma sqrt min max abs   IEEE fp32 lane by lane; min and max as x86 has them (the
//                 second operand where either is NaN), which decides what the int8 group maxima do with NaN
//   round_to_i32 (nearest even) truncate_to_i32 at_least_one_where_positive max_lane first_lane store_fence
//   at_least_one_where_positive_not_nan   the same for u >= +0 or u > 0, never NaN
//   store_i8_x4 store_u8_x4   four whole vectors of int32 lanes saturated to 4 * kLanes bytes
//   kScalarProbeTail   whether the stream probe's last partial vector goes to stream_probe_scalar
//   kPipelined    whether the loops start the next vector's update before they finish this one's (pipelined)
// The body performs the contract of adamw_kernels.h in its order, so every path gives the scalar kernel's
// bits. Where the contract leaves bits open (NaN payloads, the int8 group maxima when a moment is NaN, probe
// codes pushed out of range) the two shims may differ, and each keeps the behaviour its ISA's kernel has had.
#pragma once

#if !defined(__AVX2__)
#error "adamw_kernel_body.h is for the SIMD kernel files, compiled with their per-file ISA flags"
#endif

#include <cstdint>
#include <type_traits>

#include "offload/adamw_kernels.h"

// The per-vector functions inline into their loops whatever GCC's size heuristics say, so that all() folds
// into whole-vector instructions: left to the heuristics, GCC called the bf16 state's loads and stores out of
// line, with the AVX2 shim's lane-count tests in them, and that path ran about 30% slower.
#define MEGASLIDE_SIMD_INLINE inline __attribute__((always_inline))

namespace megaslide::offload::detail {
namespace {

template <class Simd>
struct Constants {
  using F = typename Simd::F;
  F grad_scale, decay, beta1, one_minus_beta1, beta2, one_minus_beta2, sqrt_bc2, eps, neg_step_size;
  explicit Constants(const AdamWKernelParams& p)
      : grad_scale(Simd::set1(p.grad_scale)),
        decay(Simd::set1(p.decay)),
        beta1(Simd::set1(p.beta1)),
        one_minus_beta1(Simd::set1(p.one_minus_beta1)),
        beta2(Simd::set1(p.beta2)),
        one_minus_beta2(Simd::set1(p.one_minus_beta2)),
        sqrt_bc2(Simd::set1(p.sqrt_bias_correction2)),
        eps(Simd::set1(p.eps)),
        neg_step_size(Simd::set1(p.neg_step_size)) {}
};

template <class Simd>
struct Moments {
  typename Simd::F m, v, u;  // u = sqrt(v)
  // Whether a lane of the new weight is NaN. A NaN m or v makes that lane's weight NaN (NaN propagates
  // through the update), so where no weight lane is NaN no lane of m or v is either.
  bool nan;
};

template <class Simd, GradType G>
MEGASLIDE_SIMD_INLINE typename Simd::F load_grad(const void* grad, int64_t i, typename Simd::Mask k) {
  if constexpr (G == GradType::kFloat32) {
    return Simd::load_f32(static_cast<const float*>(grad) + i, k);
  } else {
    const typename Simd::H h = Simd::load_u16(static_cast<const uint16_t*>(grad) + i, k);
    return G == GradType::kBFloat16 ? Simd::widen_bf16(h) : Simd::widen_fp16(h);
  }
}

// The rounding to 16 bits: c10's NaN patterns only where a lane may be NaN (the fix-up is a compare and a
// blend per conversion, about a quarter of the AVX2 path's vector instructions with bf16 moments).
template <class Simd>
MEGASLIDE_SIMD_INLINE typename Simd::H to_bf16(typename Simd::F x, bool may_be_nan) {
  return __builtin_expect(may_be_nan, 0) ? Simd::to_bf16(x) : Simd::to_bf16_not_nan(x);
}
template <class Simd>
MEGASLIDE_SIMD_INLINE typename Simd::H to_fp16(typename Simd::F x, bool may_be_nan) {
  return __builtin_expect(may_be_nan, 0) ? Simd::to_fp16(x) : Simd::to_fp16_not_nan(x);
}

template <class Simd, ComputeType C, bool kStream>
MEGASLIDE_SIMD_INLINE void store_compute(void* compute, int64_t i, typename Simd::F w, typename Simd::Mask k,
                                         bool may_be_nan) {
  if constexpr (C != ComputeType::kNone) {
    const typename Simd::H h =
        C == ComputeType::kBFloat16 ? to_bf16<Simd>(w, may_be_nan) : to_fp16<Simd>(w, may_be_nan);
    Simd::template store_u16<kStream>(static_cast<uint16_t*>(compute) + i, h, k);
  }
}

// Whether [begin, end) can take streaming stores for the copy: asked for, and element `begin` of the copy
// on a vector boundary (16 bytes for AVX2, 32 for AVX-512), so every full vector after it is.
template <class Simd>
inline bool use_streaming(const AdamWKernelParams& p, int64_t begin) {
  return p.stream_compute && p.compute != nullptr &&
         reinterpret_cast<uintptr_t>(static_cast<const uint16_t*>(p.compute) + begin) % sizeof(typename Simd::H) == 0;
}

// --- state: fp32, bf16 or int8 moments --------------------------------------------------------------

template <class Simd, StateType S>
MEGASLIDE_SIMD_INLINE typename Simd::F load_state(const void* state, int64_t i, typename Simd::Mask k) {
  if constexpr (S == StateType::kFloat32) {
    return Simd::load_f32(static_cast<const float*>(state) + i, k);
  } else {
    return Simd::widen_bf16(Simd::load_u16(static_cast<const uint16_t*>(state) + i, k));
  }
}

template <class Simd, StateType S>
MEGASLIDE_SIMD_INLINE void store_state(void* state, int64_t i, typename Simd::F x, typename Simd::Mask k,
                                       bool may_be_nan) {
  if constexpr (S == StateType::kFloat32) {
    Simd::store_f32(static_cast<float*>(state) + i, x, k);
  } else {
    Simd::template store_u16<false>(static_cast<uint16_t*>(state) + i, to_bf16<Simd>(x, may_be_nan), k);
  }
}

// --- kernels ---------------------------------------------------------------------------------------

// The contract of adamw_kernels.h on the live lanes, in two halves: adamw_front reads the gradient and master
// and computes the new moments and the denominator; adamw_back divides, writes master and the copy. Each
// vector's work is one long chain (the square root, then two divisions, each waiting on the one before), and
// where the core's out-of-order window is too short to overlap one vector's chain with the next's, the loops
// overlap them by hand (pipelined below).
template <class Simd>
struct Front {
  typename Simd::F w, m, v, u, d;  // master · decay, the new moments, u = sqrt(v), d = u / sqrt_bc2 + eps
};

template <class Simd, GradType G>
MEGASLIDE_SIMD_INLINE Front<Simd> adamw_front(const AdamWKernelParams& p, const Constants<Simd>& c, int64_t i,
                                              typename Simd::Mask k, typename Simd::F m_old, typename Simd::F v_old) {
  using F = typename Simd::F;
  const F g = Simd::mul(load_grad<Simd, G>(p.grad, i, k), c.grad_scale);
  const F w = Simd::mul(Simd::load_f32(p.master + i, k), c.decay);
  const F m = Simd::fma(g, c.one_minus_beta1, Simd::mul(m_old, c.beta1));
  const F v = Simd::fma(Simd::mul(c.one_minus_beta2, g), g, Simd::mul(v_old, c.beta2));
  const F u = Simd::sqrt(v);
  const F d = Simd::add(Simd::div(u, c.sqrt_bc2), c.eps);
  return {w, m, v, u, d};
}

template <class Simd, ComputeType C, bool kStream>
MEGASLIDE_SIMD_INLINE Moments<Simd> adamw_back(const AdamWKernelParams& p, const Constants<Simd>& c, int64_t i,
                                               typename Simd::Mask k, const Front<Simd>& f) {
  const typename Simd::F w = Simd::add(f.w, Simd::div(Simd::mul(c.neg_step_size, f.m), f.d));
  Simd::store_f32(p.master + i, w, k);
  const bool nan = Simd::any_nan(w);
  store_compute<Simd, C, kStream>(p.compute, i, w, k, nan);
  return {f.m, f.v, f.u, nan};
}

// Both halves for one vector (a tail's partial vector).
template <class Simd, GradType G, ComputeType C, bool kStream>
MEGASLIDE_SIMD_INLINE Moments<Simd> adamw_core(const AdamWKernelParams& p, const Constants<Simd>& c, int64_t i,
                                               typename Simd::Mask k, typename Simd::F m_old, typename Simd::F v_old) {
  return adamw_back<Simd, C, kStream>(p, c, i, k, adamw_front<Simd, G>(p, c, i, k, m_old, v_old));
}

// back(j, front(j)) for the whole vectors j = i, i + kLanes, ... below end, with the next vector's front issued
// before this one's back (software pipelining, one vector deep: deeper ran out of registers on AVX2 and was
// slower). Returns where the whole vectors end. The gradient may be the compute copy: a vector's front reads
// its gradient before its back writes its copy, and the next vector's front touches other elements.
// Measured on a 2-core AMD EPYC (Zen 1, AVX2) VM, docs/cpu-adamw.md: 21 % less time a parameter in cache with fp32
// moments, 7–11 % with bf16 and int8 moments; with the AVX-512 shim on an AVX-512 Zen VM 6–9 % less with bf16 and
// int8 moments, fp32 even.
template <class Simd, class FrontFn, class BackFn>
MEGASLIDE_SIMD_INLINE int64_t pipelined(int64_t i, int64_t end, FrontFn&& front, BackFn&& back) {
  constexpr int64_t kLanes = Simd::kLanes;
  if constexpr (!Simd::kPipelined) {
    for (; i + kLanes <= end; i += kLanes) back(i, front(i));
    return i;
  } else {
    if (i + kLanes > end) return i;
    Front<Simd> current = front(i);
    for (; i + 2 * kLanes <= end; i += kLanes) {
      const Front<Simd> next = front(i + kLanes);
      back(i, current);
      current = next;
    }
    back(i, current);
    return i + kLanes;
  }
}

// Software prefetch of the arrays kPrefetchElements ahead of element i, one request per 64-byte line.
constexpr int64_t kPrefetchElements = 1024;
template <class Simd, GradType G, StateType S>
MEGASLIDE_SIMD_INLINE void prefetch_ahead(const AdamWKernelParams& p, int64_t i) {
  // Unsigned, so that each j % n below is a mask, not a signed remainder's six instructions.
  const uint64_t j = static_cast<uint64_t>(i + kPrefetchElements);
  if (j % 16 < Simd::kLanes) __builtin_prefetch(p.master + j, 1, 3);
  if (j % 32 < Simd::kLanes) {
    if constexpr (G != GradType::kFloat32) __builtin_prefetch(static_cast<const uint16_t*>(p.grad) + j, 0, 3);
    if constexpr (S == StateType::kBFloat16) {
      __builtin_prefetch(static_cast<const uint16_t*>(p.exp_avg) + j, 1, 3);
      __builtin_prefetch(static_cast<const uint16_t*>(p.exp_avg_sq) + j, 1, 3);
    }
  }
  if constexpr (S == StateType::kFloat32)
    if (j % 16 < Simd::kLanes) {
      __builtin_prefetch(static_cast<const float*>(p.exp_avg) + j, 1, 3);
      __builtin_prefetch(static_cast<const float*>(p.exp_avg_sq) + j, 1, 3);
    }
  if constexpr (S == StateType::kInt8)
    if (j % 64 < Simd::kLanes) {
      __builtin_prefetch(static_cast<const int8_t*>(p.exp_avg) + j, 1, 3);
      __builtin_prefetch(static_cast<const uint8_t*>(p.exp_avg_sq) + j, 1, 3);
    }
}

template <class Simd, GradType G, ComputeType C, StateType S, bool kStream>
MEGASLIDE_SIMD_INLINE void adamw_vector(const AdamWKernelParams& p, const Constants<Simd>& c, int64_t i,
                                        typename Simd::Mask k) {
  const Moments<Simd> r = adamw_core<Simd, G, C, kStream>(p, c, i, k, load_state<Simd, S>(p.exp_avg, i, k),
                                                          load_state<Simd, S>(p.exp_avg_sq, i, k));
  store_state<Simd, S>(p.exp_avg, i, r.m, k, r.nan);
  store_state<Simd, S>(p.exp_avg_sq, i, r.v, k, r.nan);
}

// x * inv rounded to nearest even, clamped to [lo, hi], as int32.
template <class Simd>
MEGASLIDE_SIMD_INLINE typename Simd::I quantise(typename Simd::F x, typename Simd::F inv, typename Simd::F lo,
                                                typename Simd::F hi) {
  return Simd::round_to_i32(Simd::min(Simd::max(Simd::mul(x, inv), lo), hi));
}

// One quantisation group [begin, begin + n), n <= kQuantGroup, of kInt8 state (adamw_kernels.h).
template <class Simd, GradType G, ComputeType C, bool kStream>
inline void adamw_int8_group(const AdamWKernelParams& p, const Constants<Simd>& c, int64_t begin, int64_t n) {
  using F = typename Simd::F;
  constexpr int64_t kLanes = Simd::kLanes;
  const int64_t q = begin / kQuantGroup;
  auto* m_codes = static_cast<int8_t*>(p.exp_avg) + begin;
  auto* u_codes = static_cast<uint8_t*>(p.exp_avg_sq) + begin;
  const F m_scale = Simd::set1(p.exp_avg_scale[q]), u_scale = Simd::set1(p.exp_avg_sq_scale[q]);
  alignas(sizeof(F)) float m_new[kQuantGroup], u_new[kQuantGroup];
  F m_max = Simd::zero(), u_max = Simd::zero();
  bool nan = false;  // whether a lane of m or v may be NaN (Moments::nan)
  const auto front = [&](int64_t j, typename Simd::Mask k) __attribute__((always_inline)) {
    const F u_old = Simd::mul(Simd::load_u8(u_codes + j, k), u_scale);
    const F m_old = Simd::mul(Simd::load_i8(m_codes + j, k), m_scale);
    return adamw_front<Simd, G>(p, c, begin + j, k, m_old, Simd::mul(u_old, u_old));
  };
  const auto back = [&](int64_t j, typename Simd::Mask k, const Front<Simd>& f, auto stream_tag, auto partial_tag)
      __attribute__((always_inline)) {
    const Moments<Simd> r = adamw_back<Simd, C, decltype(stream_tag)::value>(p, c, begin + j, k, f);
    Simd::store_aligned(m_new + j, r.m);
    Simd::store_aligned(u_new + j, r.u);
    F m = r.m, u = r.u;
    if constexpr (decltype(partial_tag)::value) {
      // A partial vector's dead lanes start from zero inputs but may still not be 0 (an infinite scale times a
      // zero code is NaN): read back with the live lanes only, so that they cannot enter the maxima.
      m = Simd::load_f32(m_new + j, k);
      u = Simd::load_f32(u_new + j, k);
      Simd::store_aligned(m_new + j, m);
      Simd::store_aligned(u_new + j, u);
    }
    m_max = Simd::max(m_max, Simd::abs(m));
    u_max = Simd::max(u_max, u);
    nan |= r.nan;
  };
  const int64_t j = pipelined<Simd>(
      0, n,
      [&](int64_t j) __attribute__((always_inline)) {
        prefetch_ahead<Simd, G, StateType::kInt8>(p, begin + j);
        return front(j, Simd::all());
      },
      [&](int64_t j, const Front<Simd>& f) __attribute__((always_inline)) {
        back(j, Simd::all(), f, std::bool_constant<kStream>{}, std::false_type{});
      });
  // Streaming stores need whole vectors; a partial one takes the ordinary store.
  if (j < n) back(j, Simd::first(n - j), front(j, Simd::first(n - j)), std::false_type{}, std::true_type{});
  const float m_amax = Simd::max_lane(m_max), u_amax = Simd::max_lane(u_max);
  const float m_inv_s = m_amax > 0.f ? 127.f / m_amax : 0.f, u_inv_s = u_amax > 0.f ? 255.f / u_amax : 0.f;
  const F m_inv = Simd::set1(m_inv_s), u_inv = Simd::set1(u_inv_s);
  const F m_lo = Simd::set1(-127.f), m_hi = Simd::set1(127.f);
  const F u_lo = Simd::zero(), u_hi = Simd::set1(255.f);
  const auto requantise_all = [&](auto m_code, auto u_code) __attribute__((always_inline)) {
    // Four vectors at a time where the group has them: their codes narrow and store together.
    int64_t k = 0;
    for (; k + 4 * kLanes <= n; k += 4 * kLanes) {
      Simd::store_i8_x4(m_codes + k, m_code(k), m_code(k + kLanes), m_code(k + 2 * kLanes), m_code(k + 3 * kLanes));
      Simd::store_u8_x4(u_codes + k, u_code(k), u_code(k + kLanes), u_code(k + 2 * kLanes), u_code(k + 3 * kLanes));
    }
    const auto requantise = [&](int64_t at, typename Simd::Mask live) __attribute__((always_inline)) {
      Simd::store_i8(m_codes + at, m_code(at), live);
      Simd::store_u8(u_codes + at, u_code(at), live);
    };
    for (; k + kLanes <= n; k += kLanes) requantise(k, Simd::all());
    if (k < n) requantise(k, Simd::first(n - k));
  };
  // No NaN among the group's moments and finite maxima and reciprocals: then |m · m_inv| <= 127 · (1 + 2^-23)^2
  // and 0 <= u · u_inv <= 255 · (1 + 2^-23)^2, so rounding gives codes within range without the clamps (the same
  // codes), and u > 0 is its bits > 0 as an integer. Otherwise the clamped rounding decides NaN and infinities.
  constexpr float kMax = __FLT_MAX__;
  if (!nan && m_amax <= kMax && u_amax <= kMax && m_inv_s <= kMax && u_inv_s <= kMax) {
    requantise_all(
        [&](int64_t k) __attribute__((always_inline)) {
          return Simd::round_to_i32(Simd::mul(Simd::load_aligned(m_new + k), m_inv));
        },
        [&](int64_t k) __attribute__((always_inline)) {
          const F u = Simd::load_aligned(u_new + k);
          return Simd::at_least_one_where_positive_not_nan(Simd::round_to_i32(Simd::mul(u, u_inv)), u);
        });
  } else {
    requantise_all(
        [&](int64_t k)
            __attribute__((always_inline)) { return quantise<Simd>(Simd::load_aligned(m_new + k), m_inv, m_lo, m_hi); },
        [&](int64_t k) __attribute__((always_inline)) {
          const F u = Simd::load_aligned(u_new + k);
          return Simd::at_least_one_where_positive(quantise<Simd>(u, u_inv, u_lo, u_hi), u);
        });
  }
  p.exp_avg_scale[q] = m_amax / 127.f;
  p.exp_avg_sq_scale[q] = u_amax / 255.f;
}

template <class Simd, GradType G, ComputeType C, StateType S>
void adamw_typed(const AdamWKernelParams& p, int64_t begin, int64_t end) {
  const Constants<Simd> c(p);
  const bool stream = use_streaming<Simd>(p, begin);
  if constexpr (S == StateType::kInt8) {
    for (int64_t i = begin; i < end; i += kQuantGroup) {
      // Not std::min: unoptimised builds emit it as a weak symbol, which the linker may share with other files.
      const int64_t n = end - i < kQuantGroup ? end - i : kQuantGroup;
      if (stream) adamw_int8_group<Simd, G, C, true>(p, c, i, n);
      else adamw_int8_group<Simd, G, C, false>(p, c, i, n);
    }
    if (stream) Simd::store_fence();
  } else {
    const auto all = Simd::all();
    const auto front = [&](int64_t i) __attribute__((always_inline)) {
      prefetch_ahead<Simd, G, S>(p, i);
      return adamw_front<Simd, G>(p, c, i, all, load_state<Simd, S>(p.exp_avg, i, all),
                                  load_state<Simd, S>(p.exp_avg_sq, i, all));
    };
    const auto back = [&](int64_t i, const Front<Simd>& f, auto stream_tag) __attribute__((always_inline)) {
      const Moments<Simd> r = adamw_back<Simd, C, decltype(stream_tag)::value>(p, c, i, all, f);
      store_state<Simd, S>(p.exp_avg, i, r.m, all, r.nan);
      store_state<Simd, S>(p.exp_avg_sq, i, r.v, all, r.nan);
    };
    // The whole vectors, with streaming copy stores or cached ones.
    const auto whole_vectors = [&](auto stream_tag) __attribute__((always_inline)) {
      return pipelined<Simd>(
          begin, end,
          front, [&](int64_t i, const Front<Simd>& f) __attribute__((always_inline)) { back(i, f, stream_tag); });
    };
    int64_t i;
    if (stream) {
      i = whole_vectors(std::true_type{});
      Simd::store_fence();  // streaming stores are weakly ordered: publish them before the caller signals done
    } else {
      i = whole_vectors(std::false_type{});
    }
    if (i < end) adamw_vector<Simd, G, C, S, false>(p, c, i, Simd::first(end - i));
  }
}

// x + d through fp32 for the live lanes (the probe's one add per array).
template <class Simd, StateType S>
MEGASLIDE_SIMD_INLINE void probe_state(void* state, float* scales, int64_t i, typename Simd::F d,
                                       typename Simd::Mask k) {
  if constexpr (S == StateType::kFloat32) {
    float* x = static_cast<float*>(state) + i;
    Simd::store_f32(x, Simd::add(Simd::load_f32(x, k), d), k);
  } else if constexpr (S == StateType::kBFloat16) {
    const typename Simd::F x = Simd::add(load_state<Simd, S>(state, i, k), d);
    Simd::template store_u16<false>(static_cast<uint16_t*>(state) + i, Simd::truncate_bf16(x), k);
  } else {
    int8_t* x = static_cast<int8_t*>(state) + i;
    Simd::store_i8(x, Simd::truncate_to_i32(Simd::add(Simd::load_i8(x, k), d)), k);
    if (i % kQuantGroup == 0) scales[i / kQuantGroup] += Simd::first_lane(d);
  }
}

template <class Simd, GradType G, StateType S, bool kStream>
MEGASLIDE_SIMD_INLINE void probe_vector(const AdamWKernelParams& p, typename Simd::F scale, int64_t i,
                                        typename Simd::Mask k) {
  using F = typename Simd::F;
  const F g = Simd::mul(load_grad<Simd, G>(p.grad, i, k), scale);
  const F w = Simd::add(Simd::load_f32(p.master + i, k), g);
  Simd::store_f32(p.master + i, w, k);
  probe_state<Simd, S>(p.exp_avg, p.exp_avg_scale, i, g, k);
  probe_state<Simd, S>(p.exp_avg_sq, p.exp_avg_sq_scale, i, g, k);
  Simd::template store_u16<kStream>(static_cast<uint16_t*>(p.compute) + i, Simd::truncate_bf16(w), k);
}

template <class Simd, GradType G, StateType S>
void stream_probe_typed(const AdamWKernelParams& p, int64_t begin, int64_t end) {
  constexpr int64_t kLanes = Simd::kLanes;
  const typename Simd::F scale = Simd::set1(p.grad_scale);
  int64_t i = begin;
  if (use_streaming<Simd>(p, begin)) {
    for (; i + kLanes <= end; i += kLanes) probe_vector<Simd, G, S, true>(p, scale, i, Simd::all());
    Simd::store_fence();
  } else {
    for (; i + kLanes <= end; i += kLanes) probe_vector<Simd, G, S, false>(p, scale, i, Simd::all());
  }
  if (i < end) {
    if constexpr (Simd::kScalarProbeTail) {
      stream_probe_scalar(p, i, end);
    } else {
      probe_vector<Simd, G, S, false>(p, scale, i, Simd::first(end - i));
    }
  }
}

// The kernels adamw_kernels.h declares, for one shim.
template <class Simd>
void adamw_kernel(const AdamWKernelParams& p, int64_t begin, int64_t end) {
  dispatch(p, [&](auto g, auto c, auto s) { adamw_typed<Simd, g.value, c.value, s.value>(p, begin, end); });
}

template <class Simd>
void stream_probe_kernel(const AdamWKernelParams& p, int64_t begin, int64_t end) {
  dispatch(p, [&](auto g, auto c, auto s) {
    if constexpr (g.value != GradType::kFloat32 && c.value == ComputeType::kBFloat16) {
      stream_probe_typed<Simd, g.value, s.value>(p, begin, end);
    }
  });
}

}  // namespace
}  // namespace megaslide::offload::detail

#undef MEGASLIDE_SIMD_INLINE
