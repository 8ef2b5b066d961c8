// linear: y = x W^T + b, the weight stored [out, in] as PyTorch and Megatron store it, with its
// tensor-parallel split a type parameter (Megatron's W X = W_1 X (+) W_2 X over the tp group):
//
//   linear<T, C, tp::none>    the plain layer (linear<T>): nothing split, the group ignored.
//   linear<T, C, tp::column>  weight [out/tp, in] (rows of the full [out, in]), bias [out/tp];
//     forward:  f = identity on x, y_local = x W_local^T + b_local; optionally all-gather the
//               output columns into the full [rows, out];
//     backward: dW_local, db_local from dy_local (the own columns of dy when gathered: the
//               conjugate of the gather is a local split); dx = dy_local W_local, then g =
//               all-reduce-sum of dx over the group.
//     With groups = g > 1 (attention's qkv, g = 3) the output features are g equal groups,
//     each split over tp: the weight is [g, out/g, in] split along dimension 1.
//   linear<T, C, tp::row>     weight [out, in/tp] (columns of the full [out, in]), bias [out]
//                             replicated;
//     forward:  x is split along features ([rows, in/tp]; or, with input_is_parallel off,
//               the full [rows, in] is split locally); y = all-reduce-sum of x_local
//               W_local^T, then + b once;
//     backward: dx_local = dy W_local (no communication; all-gathered into the full dx when
//               the input was split locally), dW_local = dy^T x_local, db = colsum dy (the
//               same on every rank).
//
// Sequence parallel (Megatron's, an option of both splits): outside the tensor-parallel
// regions the activations hold 1/tp of the rows. A column split then all-gathers its input's
// rows (and again in backward, for dW, rather than keeping the whole input) and
// reduce-scatters dx over the rows instead of all-reducing it; a row split reduce-scatters its
// partial products over the rows instead of all-reducing them, and all-gathers dy's rows in
// backward.
//
// With tp = 1 (a null group, null ops, or size 1) the column and row splits run tp::none's
// arithmetic, bit for bit. column_parallel_linear and row_parallel_linear name the two splits.
#pragma once

#include <strata/core/cpu.hpp>
#include <strata/core/element.hpp>
#include <strata/core/error.hpp>
#include <strata/core/tensor.hpp>
#include <strata/core/thread_pool.hpp>
#include <strata/core/vec_map.hpp>
#include <strata/nn/context.hpp>
#include <strata/nn/detail/gemm.hpp>
#include <strata/nn/detail/workspace.hpp>
#include <strata/nn/layer.hpp>
#include <strata/nn/parameter.hpp>
#include <strata/nn/tp.hpp>

#include <concepts>
#include <cstddef>
#include <string>
#include <type_traits>
#include <utility>

namespace strata::nn {

namespace detail {
inline void check_2d(std::size_t rank, std::size_t rows, std::size_t cols, std::size_t want_rows,
                     std::size_t want_cols, std::string const& who, char const* what) {
  if (rank != 2 || rows != want_rows || cols != want_cols)
    throw shape_error("strata: " + who + ": " + what + " is " + std::to_string(rows) + " x " +
                      std::to_string(cols) + " (rank " + std::to_string(rank) + "), expected " +
                      std::to_string(want_rows) + " x " + std::to_string(want_cols) +
                      ": activations are 2-D, rows = batch * seq tokens");
}
template <class V>
void check_act(V const& v, std::size_t rows, std::size_t cols, std::string const& who,
               char const* what) {
  check_2d(v.rank(), v.rank() == 2 ? v.extent(0) : 0, v.rank() == 2 ? v.extent(1) : 0, rows, cols,
           who, what);
  if (v.stride(1) != 1)
    throw shape_error("strata: " + who + ": " + what + " must have contiguous rows");
}

/// linear's forward product: y[r, j] = b[j] when b is not null, then y[r, j] (+)= sum_p x[r, p]
/// W[j, p], W [n, k], in C through the packed GEMM. x and y have row strides sx and sy.
template <class C, class T>
void affine_forward(std::size_t rows, std::size_t n, std::size_t k, T const* x, std::size_t sx,
                    T const* w, T const* b, T* y, std::size_t sy) {
  gemm<C>(rows, n, k, x, sx, 1, w, 1, k, y, sy, false, b); // each piece writes b, then adds
}

/// linear's bias gradient: db[j] += sum_r dy[r, j] (row stride sdy), the column sums in C in
/// `colsum`, then added to db once.
template <class C, class T>
void add_bias_grad(T const* dy, std::size_t sdy, std::size_t rows, std::size_t n, T* db,
                   workspace<C>& colsum) {
  C* s = colsum.get(1, n).data();
  // Blocks of columns over the rank's threads: each column sums its rows in order, so the same
  // bits with any number of threads.
  parallel_rows(n, rows, [&](std::size_t j0, std::size_t j1) {
    for (std::size_t j = j0; j < j1; ++j)
      s[j] = C{0};
    if constexpr (std::is_same_v<T, C>) { // W-byte vectors in the host's copy (core/cpu.hpp)
      strata::detail::dispatch_isa([&]<std::size_t W>() {
        for (std::size_t r = 0; r < rows; ++r)
          strata::detail::vec_map<W, C>(
              j1 - j0, [](auto& d, auto& a) { a += d; }, dy + r * sdy + j0, s + j0);
        strata::detail::vec_map<W, C>(
            j1 - j0, [](auto& a, auto& b) { b += a; }, static_cast<C const*>(s + j0), db + j0);
      });
    } else {
      for (std::size_t r = 0; r < rows; ++r) {
        T const* d = dy + r * sdy;
        for (std::size_t j = j0; j < j1; ++j)
          s[j] += to_compute_value<C>(d[j]);
      }
      for (std::size_t j = j0; j < j1; ++j)
        db[j] = from_compute_value<T>(to_compute_value<C>(db[j]) + s[j]);
    }
  });
}
} // namespace detail

/// Options of a column split (linear<T, C, tp::column>).
struct column_parallel_options {
  bool bias = true;
  bool gather_output = false;     // all-gather the output into the full [rows, out]
  bool sequence_parallel = false; // x holds this rank's 1/tp of the rows (gathered here)
  init_rule weight_init = {};
  std::size_t groups = 1; // > 1: out is `groups` equal groups, each split over tp (qkv: 3)
};

/// Options of a row split (linear<T, C, tp::row>).
struct row_parallel_options {
  bool bias = true;
  bool input_is_parallel = true;  // x is [rows, in/tp]; false: x is the full [rows, in]
  bool sequence_parallel = false; // y holds this rank's 1/tp of the rows (reduce-scattered)
  init_rule weight_init = {};
};

/// The options of a linear layer split S.
template <class S>
using linear_options =
    std::conditional_t<std::same_as<S, tp::row>, row_parallel_options, column_parallel_options>;

/// A fully connected layer, its split over the tp group chosen by S (tp::none, tp::column,
/// tp::row). Parameters "<name>.weight", logically [out, in] (normal 0.02), and, when bias is
/// on, "<name>.bias" [out] (zeros); a split one holds its shard of the logical tensor and keeps
/// the logical name. The products run in C through the packed GEMM (16-bit storage widens to
/// C while packing). Nothing is saved: backward uses x.
///
/// tp::column: activations x [rows, in] (the same on every rank), y [rows, out/tp] (or
/// [rows, out] with gather_output); with sequence_parallel, x is this rank's [rows/tp, in]
/// slice of the rows. tp::row: x [rows, in/tp] (or [rows, in] with input_is_parallel off),
/// y [rows, out] (the same on every rank); with sequence_parallel, y is this rank's
/// [rows/tp, out] slice of the rows. A split layer throws config_error at construction when
/// its split size does not divide by tp, and at a call whose group is not the one it was
/// built with.
template <floating_element T, floating_element C = compute_t<T>, tp::linear_split S = tp::none>
class linear {
  static constexpr bool plain = std::same_as<S, tp::none>;
  static constexpr bool is_row = std::same_as<S, tp::row>;

public:
  using value_type = T;
  using compute_type = C;
  using split_type = S;
  using options_type = linear_options<S>;
  struct saved_type {};

  /// The plain layer.
  linear(std::string name, std::size_t in, std::size_t out, bool bias = true,
         init_rule weight_init = {}) requires plain
      : linear(std::move(name), in, out, 1, 0, {.bias = bias, .weight_init = weight_init}) {}

  /// The split layer over the group tp (null: tp = 1).
  linear(std::string name, std::size_t in, std::size_t out, tp_group const* tp = nullptr,
         options_type options = {}) requires(!plain)
      : linear(std::move(name), in, out, tp_size_of(tp), tp_rank_of(tp), options) {}

  std::string const& name() const noexcept { return name_; }
  std::size_t in_features() const noexcept { return is_row && input_parallel_ ? local_in_ : in_; }
  std::size_t out_features() const noexcept { return !is_row && !gather_ ? local_out_ : out_; }
  /// The logical layer's features, and this rank's share of them.
  std::size_t full_in_features() const noexcept { return in_; }
  std::size_t full_out_features() const noexcept { return out_; }
  std::size_t local_in_features() const noexcept { return local_in_; }
  std::size_t local_out_features() const noexcept { return local_out_; }
  int tp_size() const noexcept { return tp_; }
  int tp_rank() const noexcept { return rank_; }
  bool gather_output() const noexcept { return gather_; }
  bool input_is_parallel() const noexcept { return input_parallel_; }
  /// Column split: tp under sequence parallel (the input holds 1/tp of the rows), else 1.
  int input_row_split() const noexcept { return is_row ? 1 : split_; }
  /// Row split: tp under sequence parallel (the output holds 1/tp of the rows), else 1.
  int output_row_split() const noexcept { return is_row ? split_ : 1; }
  bool has_bias() const noexcept { return has_bias_; }
  parameter<T>& weight() noexcept { return weight_; }
  parameter<T>& bias() noexcept { return bias_; }

  template <class F>
  void for_each_parameter(F&& f) {
    f(weight_);
    if (has_bias_)
      f(bias_);
  }

  void forward(layer_context const& ctx, tensor_view<T const> x, tensor_view<T> y, saved_type&) {
    tp_ops* ops = ops_for(ctx);
    if constexpr (is_row)
      row_forward(ops, x, y);
    else
      column_forward(ops, x, y);
  }

  void backward(layer_context const& ctx, tensor_view<T const> x, saved_type const&,
                tensor_view<T const> dy, tensor_view<T> dx) {
    tp_ops* ops = ops_for(ctx);
    if constexpr (is_row)
      row_backward(ops, x, dy, dx);
    else
      column_backward(ops, x, dy, dx);
  }

private:
  linear(std::string name, std::size_t in, std::size_t out, int tp, int rank, options_type const& o)
      : name_(std::move(name)), in_(in), out_(out), tp_(tp), rank_(rank),
        local_in_(is_row ? detail::tp_split(in, tp, name_, "input features") : in),
        local_out_(local_out_of(o)), split_(detail::sp_split(sp_of(o), tp)), has_bias_(o.bias),
        weight_(make_weight(o)) {
    if constexpr (is_row) {
      input_parallel_ = o.input_is_parallel;
    } else {
      gather_ = o.gather_output;
      groups_ = o.groups;
    }
    if (has_bias_)
      bias_ = make_bias();
  }

  static bool sp_of(options_type const& o) noexcept {
    if constexpr (plain)
      return false;
    else
      return o.sequence_parallel;
  }

  // This rank's output features: out (a row split), or out / tp (a column split: each of the
  // groups split over tp), after checking the groups.
  std::size_t local_out_of(options_type const& o) const {
    if constexpr (is_row)
      return out_;
    else
      return column_local_out(o);
  }
  std::size_t column_local_out(column_parallel_options const& o) const {
    if (o.groups == 0 || out_ % o.groups != 0)
      throw config_error("strata: " + name_ + ": " + std::to_string(out_) +
                         " output features do not split into " + std::to_string(o.groups) +
                         " equal groups");
    if (o.groups > 1 && o.gather_output)
      throw config_error("strata: " + name_ + ": gather_output with " + std::to_string(o.groups) +
                         " groups is not supported: gather the groups' columns yourself");
    return o.groups * detail::tp_split(out_ / o.groups, tp_, name_, "output features");
  }

  parameter<T> make_weight(options_type const& o) const {
    std::string n = name_ + ".weight";
    if constexpr (is_row) {
      return parameter<T>(std::move(n), {out_, in_}, o.weight_init,
                          detail::tp_shard(1, tp_, rank_));
    } else {
      if (o.groups > 1)
        return parameter<T>(std::move(n), {o.groups, out_ / o.groups, in_}, o.weight_init,
                            detail::tp_shard(1, tp_, rank_));
      return parameter<T>(std::move(n), {out_, in_}, o.weight_init,
                          detail::tp_shard(0, tp_, rank_));
    }
  }

  parameter<T> make_bias() const {
    std::string n = name_ + ".bias";
    init_rule const zeros{init_rule::kind::zeros, 0};
    if (is_row)
      return parameter<T>(std::move(n), {out_}, zeros);
    if (groups_ > 1)
      return parameter<T>(std::move(n), {groups_, out_ / groups_}, zeros,
                          detail::tp_shard(1, tp_, rank_));
    return parameter<T>(std::move(n), {out_}, zeros, detail::tp_shard(0, tp_, rank_));
  }

  // The group's collectives for this call: none for the plain layer (it ignores the group).
  tp_ops* ops_for(layer_context const& ctx) const {
    if constexpr (plain)
      return nullptr;
    else
      return detail::tp_ops_for(ctx, tp_, rank_, name_);
  }

  // x itself, or under sequence parallel every rank's rows of it gathered (tp x its rows).
  tensor_view<T const> full_input(tp_ops* ops, tensor_view<T const> x) {
    return detail::sp_full_input(ops, split_, x, in_, xfull_, xtmp_);
  }

  void column_forward(tp_ops* ops, tensor_view<T const> x_in, tensor_view<T> y) {
    auto const x = full_input(ops, x_in);
    std::size_t const rows = x.extent(0);
    detail::check_act(x, rows, in_, name_, "the input");
    detail::check_act(y, rows, out_features(), name_, "the output");
    bool const gather = ops != nullptr && gather_;
    // The local product: straight into y, or into a contiguous block to gather from.
    T* yl = gather ? ylocal_.get(rows, local_out_).data() : y.data();
    std::size_t const syl = gather ? local_out_ : y.stride(0);
    detail::affine_forward<C>(rows, local_out_, in_, x.data(), x.stride(0), weight_.value().data(),
                              has_bias_ ? bias_.value().data() : nullptr, yl, syl);
    if (gather)
      detail::tp_gather_columns(*ops, yl, rows, local_out_, tp_, y, gathered_);
  }

  void column_backward(tp_ops* ops, tensor_view<T const> x_in, tensor_view<T const> dy,
                       tensor_view<T> dx) {
    // Sequence parallel: the rows gathered again (Megatron's choice: not kept since forward).
    auto const x = full_input(ops, x_in);
    std::size_t const rows = x.extent(0);
    detail::check_act(x, rows, in_, name_, "the input");
    detail::check_act(dy, rows, out_features(), name_, "the output gradient");
    // With a gathered output, this rank's columns of dy (the gather's conjugate is a split).
    T const* d = dy.data() + (ops != nullptr && gather_ ? rank_ * local_out_ : 0);
    std::size_t const sd = dy.stride(0);
    // dW[j, p] += sum_r dy[r, j] x[r, p]
    detail::gemm<C>(local_out_, in_, rows, d, 1, sd, x.data(), x.stride(0), 1,
                    weight_.grad().data(), in_, true);
    if (has_bias_)
      detail::add_bias_grad<C>(d, sd, rows, local_out_, bias_.grad().data(), colsum_);
    if (dx.data() == nullptr)
      return;
    detail::check_act(dx, x_in.extent(0), in_, name_, "the input gradient");
    // dx[r, p] = sum_j dy[r, j] W[j, p]: a partial sum over this rank's output features,
    // all-reduced; or, sequence parallel, reduce-scattered over the rows.
    bool const scatter = ops != nullptr && split_ > 1;
    T* dxp = scatter ? dxfull_.get(rows, in_).data() : dx.data();
    std::size_t const sdx = scatter ? in_ : dx.stride(0);
    detail::gemm<C>(rows, in_, local_out_, d, sd, 1, weight_.value().data(), in_, 1, dxp, sdx,
                    false);
    if (scatter)
      detail::tp_scatter_rows(*ops, dxp, in_, tp_, dx, dxtmp_);
    else if (ops != nullptr)
      detail::tp_all_reduce(*ops, dx, rows, in_, dxtmp_);
  }

  // This rank's columns of x (x itself when it is already split, or tp = 1).
  T const* local_input(tensor_view<T const> x) const noexcept {
    return x.data() + (input_parallel_ ? 0 : static_cast<std::size_t>(rank_) * local_in_);
  }

  void row_forward(tp_ops* ops, tensor_view<T const> x, tensor_view<T> y) {
    std::size_t const rows = x.extent(0);
    bool const scatter = ops != nullptr && split_ > 1;
    detail::check_act(x, rows, in_features(), name_, "the input");
    detail::check_act(y, scatter ? rows / static_cast<std::size_t>(tp_) : rows, out_, name_,
                      "the output");
    T const* xl = local_input(x);
    T const* w = weight_.value().data();
    if (ops == nullptr) { // the plain layer's order: y = b, then y += x W^T
      detail::affine_forward<C>(rows, out_, local_in_, xl, x.stride(0), w,
                                has_bias_ ? bias_.value().data() : nullptr, y.data(), y.stride(0));
      return;
    }
    // y = sum over ranks of x_local W_local^T (all-reduced, or reduce-scattered over the rows
    // under sequence parallel), then + b once
    T* yp = scatter ? yfull_.get(rows, out_).data() : y.data();
    detail::gemm<C>(rows, out_, local_in_, xl, x.stride(0), 1, w, 1, local_in_, yp,
                    scatter ? out_ : y.stride(0), false);
    if (scatter)
      detail::tp_scatter_rows(*ops, yp, out_, tp_, y, ytmp_);
    else
      detail::tp_all_reduce(*ops, y, rows, out_, ytmp_);
    if (has_bias_) {
      T const* b = bias_.value().data();
      for (std::size_t r = 0; r < y.extent(0); ++r)
        for (std::size_t j = 0; j < out_; ++j)
          y(r, j) = detail::from_compute_value<T>(detail::to_compute_value<C>(y(r, j)) +
                                                  detail::to_compute_value<C>(b[j]));
    }
  }

  void row_backward(tp_ops* ops, tensor_view<T const> x, tensor_view<T const> dy_in,
                    tensor_view<T> dx) {
    std::size_t const rows = x.extent(0);
    detail::check_act(x, rows, in_features(), name_, "the input");
    // Sequence parallel: every rank's rows of dy (the reduce-scatter's conjugate).
    auto dy = dy_in;
    if (ops != nullptr && split_ > 1) {
      T* full = dyfull_.get(rows, out_).data();
      detail::tp_gather_rows(*ops, dy_in, out_, tp_, full, dytmp_);
      dy = tensor_view<T const>(full, {rows, out_});
    }
    detail::check_act(dy, rows, out_, name_, "the output gradient");
    T const* xl = local_input(x);
    // dW[j, p] += sum_r dy[r, j] x[r, p], over this rank's input features p
    detail::gemm<C>(out_, local_in_, rows, dy.data(), 1, dy.stride(0), xl, x.stride(0), 1,
                    weight_.grad().data(), local_in_, true);
    if (has_bias_)
      detail::add_bias_grad<C>(dy.data(), dy.stride(0), rows, out_, bias_.grad().data(), colsum_);
    if (dx.data() == nullptr)
      return;
    detail::check_act(dx, rows, in_features(), name_, "the input gradient");
    T const* w = weight_.value().data();
    if (ops == nullptr || input_parallel_) {
      // dx[r, p] = sum_j dy[r, j] W[j, p]: this rank's features, no communication
      detail::gemm<C>(rows, local_in_, out_, dy.data(), dy.stride(0), 1, w, local_in_, 1, dx.data(),
                      dx.stride(0), false);
      return;
    }
    // The input was split locally: gather every rank's columns of dx (the split's conjugate).
    T* dl = dxlocal_.get(rows, local_in_).data();
    detail::gemm<C>(rows, local_in_, out_, dy.data(), dy.stride(0), 1, w, local_in_, 1, dl,
                    local_in_, false);
    detail::tp_gather_columns(*ops, dl, rows, local_in_, tp_, dx, gathered_);
  }

  std::string name_;
  std::size_t in_, out_;
  int tp_, rank_;
  std::size_t local_in_, local_out_;
  int split_;
  bool has_bias_;
  bool gather_ = false;        // column
  std::size_t groups_ = 1;     // column
  bool input_parallel_ = true; // row
  parameter<T> weight_;
  parameter<T> bias_;
  detail::workspace<C> colsum_;
  detail::workspace<T> ylocal_, gathered_, dxtmp_, xfull_, xtmp_, dxfull_; // column
  detail::workspace<T> ytmp_, dxlocal_, yfull_, dyfull_, dytmp_;           // row
};

/// The column and row splits by their Megatron names.
template <floating_element T, floating_element C = compute_t<T>>
using column_parallel_linear = linear<T, C, tp::column>;
template <floating_element T, floating_element C = compute_t<T>>
using row_parallel_linear = linear<T, C, tp::row>;

} // namespace strata::nn
