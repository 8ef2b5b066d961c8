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
#include <strata/core/vec_map.hpp>
#include <strata/nn/context.hpp>
#include <strata/nn/detail/gemm.hpp>
#include <strata/nn/detail/workspace.hpp>
#include <strata/nn/layer.hpp>

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
/// as uniform<float> element by element).
inline void draw_keep_mask(std::uint8_t* keep, std::size_t n, random_key key, std::uint64_t first,
                           float p) noexcept {
  strata::detail::fill_blocks<float>(std::span<std::uint8_t>(keep, n), key, first,
                                     [p](philox_counter const& w, std::uint64_t lane) {
                                       return static_cast<std::uint8_t>(
                                           strata::detail::uniform_lane<float>(w, lane) >= p);
                                     });
}

/// y = m ? x scale : 0 element by element, m the keep mask of the rows (one byte an element,
/// row r at m + r * features), in C; x and y may be the same view. With T = C W-byte vectors
/// at a time in the copy of `isa` (core/cpu.hpp): one IEEE product an element either way.
template <class T, class C>
void apply_keep_mask(tensor_view<T const> x, tensor_view<T> y, std::uint8_t const* m,
                     std::size_t features, C scale, cpu_isa isa = host_isa()) {
  std::size_t const rows = x.extent(0);
  if constexpr (std::is_same_v<T, C>) {
    strata::detail::run_isa(isa, [&]<std::size_t W>() {
      using V = strata::detail::vec<C, W>;
      constexpr std::size_t L = W / sizeof(C);
      using I =
          strata::detail::vec<std::conditional_t<sizeof(C) == 4, std::int32_t, std::int64_t>, W>;
      using M = strata::detail::vec<std::uint8_t, L>;
      for (std::size_t r = 0; r < rows; ++r) {
        T const* xr = x.data() + r * x.stride(0);
        T* yr = y.data() + r * y.stride(0);
        std::uint8_t const* mr = m + r * features;
        std::size_t j = 0;
        for (; j + L <= features; j += L) {
          V v;
          M mb;
          strata::detail::vload(v, xr + j);
          strata::detail::vload(mb, mr + j);
          I const keep = __builtin_convertvector(mb, I);
          V const out = keep != 0 ? v * scale : V{};
          strata::detail::vstore(yr + j, out);
        }
        for (; j < features; ++j)
          yr[j] = mr[j] ? xr[j] * scale : C{0};
      }
    });
    return;
  }
  (void)isa;
  for (std::size_t r = 0; r < rows; ++r)
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
    detail::draw_keep_mask(m, rows * features_, key(ctx), ctx.first_row * features_,
                           static_cast<float>(p_));
    detail::apply_keep_mask<T, C>(x, y, m, features_, scale);
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
    detail::apply_keep_mask<T, C>(dy, dx, s.mask.data(), features_, scale);
  }

private:
  std::string name_;
  std::size_t features_;
  double p_;
};

} // namespace strata::nn
