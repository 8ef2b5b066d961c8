// dropout: counter-based masks keyed by (layer name, seed, step, the element's place in the
// step's global batch); the mask drawing the other dropouts share (attention's probabilities,
// the embedding's output).
#pragma once

#include <strata/core/cpu.hpp>
#include <strata/core/element.hpp>
#include <strata/core/error.hpp>
#include <strata/core/philox.hpp>
#include <strata/core/random.hpp>
#include <strata/core/tensor.hpp>
#include <strata/core/thread_pool.hpp>
#include <strata/core/vec_map.hpp>
#include <strata/nn/context.hpp>
#include <strata/nn/detail/gemm.hpp>
#include <strata/nn/detail/workspace.hpp>
#include <strata/nn/layer.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <type_traits>

namespace strata::nn {

namespace detail {

/// config_error unless p is a dropout probability, in [0, 1); `who` names the dropout.
inline void check_dropout_p(std::string const& who, double p) {
  if (!(p >= 0.0 && p < 1.0))
    throw config_error("strata: dropout \"" + who + "\" with p = " + std::to_string(p) +
                       ": p must be in [0, 1)");
}

/// The random key of dropout `name` at the step and seed of ctx: key_of(name, seed) on stream
/// step. Every dropout of strata keys this way; they differ in the element index.
inline random_key dropout_key(std::string const& name, layer_context const& ctx) noexcept {
  return key_of(name, ctx.seed).with_stream(ctx.step);
}

/// keep[j] = 1 when uniform<float>(key, first + j) >= p, else 0, for j < n: the keep mask of
/// n consecutive elements of a dropout stream, one Philox block per 4 elements (the same bits
/// as uniform<float> element by element). The whole blocks go W / 4 blocks at a time (Philox's
/// rounds on uint32_t lanes) in the copy of `isa` (core/cpu.hpp); integer arithmetic and exact
/// conversions, so the same bits in either copy.
inline void draw_keep_mask(std::uint8_t* keep, std::size_t n, random_key key, std::uint64_t first,
                           float p, cpu_isa isa = host_isa()) noexcept {
  auto one_by_one = [&](std::size_t from, std::size_t to) {
    strata::detail::fill_blocks<float>(
        std::span<std::uint8_t>(keep + from, to - from), key, first + from,
        [p](philox_counter const& w, std::uint64_t lane) {
          return static_cast<std::uint8_t>(strata::detail::uniform_lane<float>(w, lane) >= p);
        });
  };
  std::size_t const head = std::min<std::size_t>(n, (4 - first % 4) % 4);
  one_by_one(0, head);
  std::size_t done = head;
  // u = (w >> 8) 2^-24 >= p, u a multiple of 2^-24 and 0 <= p < 1, is w >= 2^8 ceil(p 2^24)
  // (p 2^24 is exact in double; the threshold is at most 2^32 - 2^8).
  auto const threshold = static_cast<std::uint32_t>(std::ceil(static_cast<double>(p) * 0x1p24))
                         << 8;
  strata::detail::run_isa(isa, [&]<std::size_t W>() {
    // A block's words in the low halves of 64-bit lanes, W / 8 blocks a vector: pmuludq reads
    // the low halves only, so what the high halves hold does not matter.
    using U64 = strata::detail::vec<std::uint64_t, W>;
    using U = strata::detail::vec<std::uint32_t, W>;
    constexpr std::size_t L = W / 8; // blocks a vector
    auto const k0 = static_cast<std::uint32_t>(key.key);
    auto const k1 = static_cast<std::uint32_t>(key.key >> 32);
    U64 const s0 = U64{} + static_cast<std::uint32_t>(key.stream);
    U64 const s1 = U64{} + static_cast<std::uint32_t>(key.stream >> 32);
    // One round on one chain of L blocks.
    auto round = [](U64& a0, U64& a1, U64& a2, U64& a3, U64 const& r0, U64 const& r1) {
      U64 p0, p1;
      strata::detail::mul_u32_lo(p0, a0, 0xD2511F53u);
      strata::detail::mul_u32_lo(p1, a2, 0xCD9E8D57u);
      a0 = (p1 >> 32) ^ a1 ^ r0;
      a1 = p1;
      a2 = (p0 >> 32) ^ a3 ^ r1;
      a3 = p0;
    };
    // keep = w >= threshold, as the carry of (w mod 2^32) + 2^32 - threshold; a block's four
    // bytes in the low 32 bits of its lane, then the lanes' low halves stored in order.
    std::uint64_t const bias = (std::uint64_t{1} << 32) - threshold;
    auto emit = [bias](std::uint8_t* out, U64 const& a0, U64 const& a1, U64 const& a2,
                       U64 const& a3) {
      U64 const m = U64{} + 0xffffffffu, b = U64{} + bias;
      U64 const bytes = ((a0 & m) + b) >> 32 | ((a1 & m) + b) >> 32 << 8 |
                        ((a2 & m) + b) >> 32 << 16 | ((a3 & m) + b) >> 32 << 24;
      U const words = __builtin_bit_cast(U, bytes);
#if !defined(__CUDACC__) // nvcc's front end rejects this shuffle; the loop stores the same words
      if constexpr (L == 4) {
        strata::detail::vec<std::uint32_t, 16> const low =
            __builtin_shufflevector(words, words, 0, 2, 4, 6);
        strata::detail::vstore(out, low);
      } else
#endif
      {
        for (std::size_t k = 0; k < L; ++k) {
          std::uint32_t const v = words[2 * k];
          __builtin_memcpy(out + 4 * k, &v, 4);
        }
      }
    };
    U64 rk0[10], rk1[10]; // the round keys
    rk0[0] = U64{} + k0;
    rk1[0] = U64{} + k1;
    for (int r = 1; r < 10; ++r) {
      rk0[r] = (rk0[r - 1] + 0x9E3779B9u) & 0xffffffffu;
      rk1[r] = (rk1[r - 1] + 0xBB67AE85u) & 0xffffffffu;
    }
    U64 iota;
    for (std::size_t k = 0; k < L; ++k)
      iota[k] = k;
    // G chains of L blocks each an iteration: independent chains hide the multiplies' latency
    // (with 2 a round waited on its multiplies; 4 keep the vector units busy).
    constexpr std::size_t G = 4;
    for (; done + 4 * G * L <= n; done += 4 * G * L) {
      std::uint64_t const block0 = (first + done) / 4;
      U64 c[G][4];
#pragma GCC unroll 4
      for (std::size_t g = 0; g < G; ++g) {
        U64 const full = iota + (block0 + g * L); // whole block indices
        c[g][0] = full;
        c[g][1] = full >> 32;
        c[g][2] = s0;
        c[g][3] = s1;
      }
#pragma GCC unroll 10
      for (int r = 0; r < 10; ++r) // philox4x32<10>, lane by lane
#pragma GCC unroll 4
        for (std::size_t g = 0; g < G; ++g)
          round(c[g][0], c[g][1], c[g][2], c[g][3], rk0[r], rk1[r]);
#pragma GCC unroll 4
      for (std::size_t g = 0; g < G; ++g)
        emit(keep + done + 4 * g * L, c[g][0], c[g][1], c[g][2], c[g][3]);
    }
  });
  one_by_one(done, n);
}

/// y = m ? x scale : 0 element by element, m the keep mask of the rows (one byte an element,
/// row r at m + r * features) over rows [first_row, end_row), in C; x and y may be the same
/// view. With T = C W-byte vectors
/// at a time in the copy of `isa` (core/cpu.hpp): one IEEE product an element either way.
template <class T, class C>
void apply_keep_mask(tensor_view<T const> x, tensor_view<T> y, std::uint8_t const* m,
                     std::size_t features, C scale, std::size_t first_row, std::size_t end_row,
                     cpu_isa isa = host_isa()) {
  if constexpr (std::is_same_v<T, C>) {
    strata::detail::run_isa(isa, [&]<std::size_t W>() {
      using V = strata::detail::vec<C, W>;
      constexpr std::size_t L = W / sizeof(C);
      using I =
          strata::detail::vec<std::conditional_t<sizeof(C) == 4, std::int32_t, std::int64_t>, W>;
      using M = strata::detail::vec<std::uint8_t, L>;
      // Locals the stores cannot alias (a vstore is a memcpy): read once, not per vector.
      std::size_t const n = features, sx = x.stride(0), sy = y.stride(0);
      C const sc = scale;
      T const* const x0 = x.data();
      T* const y0 = y.data();
      for (std::size_t r = first_row; r < end_row; ++r) {
        T const* xr = x0 + r * sx;
        T* yr = y0 + r * sy;
        std::uint8_t const* mr = m + r * n;
        std::size_t j = 0;
        for (; j + L <= n; j += L) {
          V v;
          strata::detail::vload(v, xr + j);
          I keep;
          if constexpr (sizeof(C) == 4) {
            // The L mask bytes, read by one 8- or 4-byte load, zero-extended to 32-bit lanes
            // by one shuffle (pmovzxbd). Converting the byte vector went lane by lane through
            // general registers, and a copy into a zeroed vector stalled on store forwarding.
            using B = strata::detail::vec<std::uint8_t, 16>;
            B b, zero = {};
            if constexpr (L == 8) {
              std::uint64_t w;
              __builtin_memcpy(&w, mr + j, 8);
              b = __builtin_bit_cast(B, strata::detail::vec<std::uint64_t, 16>{w, 0});
            } else {
              std::uint32_t w;
              __builtin_memcpy(&w, mr + j, 4);
              b = __builtin_bit_cast(B, strata::detail::vec<std::uint32_t, 16>{w, 0, 0, 0});
            }
            if constexpr (L == 8)
              keep = __builtin_bit_cast(I, __builtin_shufflevector(b, zero, 0, 16, 16, 16, 1, 16,
                                                                   16, 16, 2, 16, 16, 16, 3, 16, 16,
                                                                   16, 4, 16, 16, 16, 5, 16, 16, 16,
                                                                   6, 16, 16, 16, 7, 16, 16, 16));
            else
              keep =
                  __builtin_bit_cast(I, __builtin_shufflevector(b, zero, 0, 16, 16, 16, 1, 16, 16,
                                                                16, 2, 16, 16, 16, 3, 16, 16, 16));
          } else {
            M mb;
            strata::detail::vload(mb, mr + j);
            keep = __builtin_convertvector(mb, I);
          }
          V const out = keep != 0 ? v * sc : V{};
          strata::detail::vstore(yr + j, out);
        }
        for (; j < n; ++j)
          yr[j] = mr[j] ? xr[j] * sc : C{0};
      }
    });
    return;
  }
  (void)isa;
  for (std::size_t r = first_row; r < end_row; ++r)
    for (std::size_t j = 0; j < features; ++j)
      y(r, j) =
          from_compute_value<T>(m[r * features + j] ? to_compute_value<C>(x(r, j)) * scale : C{0});
}

/// y = x over the rows' first `features` columns (x and y may be the same view).
template <class T>
void copy_rows(tensor_view<T const> x, tensor_view<T> y, std::size_t features) {
  for (std::size_t r = 0; r < x.extent(0); ++r)
    std::memmove(y.data() + r * y.stride(0), x.data() + r * x.stride(0), features * sizeof(T));
}

} // namespace detail

/// Inverted dropout with probability p: y = x * mask / (1 - p). Element (r, j) at step s is
/// kept when uniform(key_of(name, seed).with_stream(s), (ctx.first_row + r) * features + j)
/// >= p: the mask is a function of the element's place in the step's global batch, so a
/// re-run (recompute) draws the same mask, and data-parallel ranks, micro-batches, sequence-
/// parallel row slices and pipeline stages each draw their own part of one device's mask. The
/// identity when !ctx.training or p == 0. The mask is saved (one byte an element) so backward
/// does not draw again. x and y may be the same view (in place); so may dy and dx.
template <floating_element T, floating_element C = compute_t<T>>
class dropout {
public:
  using value_type = T;
  using compute_type = C;
  struct saved_type {
    detail::workspace<std::uint8_t> mask{memory_kind::activations};
    bool active = false;
  };

  dropout(std::string name, std::size_t features, double p)
      : name_(std::move(name)), features_(features), p_(p) {
    detail::check_dropout_p(name_, p);
  }

  std::string const& name() const noexcept { return name_; }
  std::size_t in_features() const noexcept { return features_; }
  std::size_t out_features() const noexcept { return features_; }
  double p() const noexcept { return p_; }
  /// Whether a forward under ctx drops anything (training and p > 0).
  bool active(layer_context const& ctx) const noexcept { return ctx.training && p_ > 0.0; }
  template <class F>
  void for_each_parameter(F&&) {}

  /// The random key of the step under ctx.
  random_key key(layer_context const& ctx) const noexcept {
    return detail::dropout_key(name_, ctx);
  }

  void forward(layer_context const& ctx, tensor_view<T const> x, tensor_view<T> y, saved_type& s) {
    std::size_t const rows = x.extent(0);
    s.active = active(ctx);
    if (!s.active) {
      detail::copy_rows(x, y, features_);
      return;
    }
    C const scale = static_cast<C>(1.0 / (1.0 - p_));
    std::uint8_t* m = s.mask.get(rows, features_).data();
    // In row blocks over the rank's threads (parallel_rows; each element's mask is a function
    // of its place, so the same bits), each block's mask drawn and applied a few rows at a
    // time, while they are in cache.
    std::size_t const chunk = std::max<std::size_t>(1, 16384 / std::max<std::size_t>(1, features_));
    random_key const k = key(ctx);
    parallel_rows(rows, features_, [&](std::size_t r0, std::size_t r1) {
      for (std::size_t r = r0; r < r1; r += chunk) {
        std::size_t const end = std::min(r1, r + chunk);
        detail::draw_keep_mask(m + r * features_, (end - r) * features_, k,
                               (ctx.first_row + r) * features_, static_cast<float>(p_));
        detail::apply_keep_mask<T, C>(x, y, m, features_, scale, r, end);
      }
    });
  }

  void backward(layer_context const&, tensor_view<T const>, saved_type const& s,
                tensor_view<T const> dy, tensor_view<T> dx) {
    if (dx.data() == nullptr) // the input needs no gradient
      return;
    if (!s.active) {
      detail::copy_rows(dy, dx, features_);
      return;
    }
    C const scale = static_cast<C>(1.0 / (1.0 - p_));
    parallel_rows(dy.extent(0), features_, [&](std::size_t r0, std::size_t r1) {
      detail::apply_keep_mask<T, C>(dy, dx, s.mask.data(), features_, scale, r0, r1);
    });
  }

private:
  std::string name_;
  std::size_t features_;
  double p_;
};

} // namespace strata::nn
