// Megatron-style tensor parallelism: the tp_ops adapter over a communicator, and the column-
// and row-parallel linear layers (W X = W_1 X (+) W_2 X split over the tp group).
//
//   column_parallel_linear  weight [out/tp, in] (rows of the full [out, in]), bias [out/tp];
//     forward:  f = identity on x, y_local = x W_local^T + b_local; optionally all-gather the
//               output columns into the full [rows, out];
//     backward: dW_local, db_local from dy_local (the own columns of dy when gathered: the
//               conjugate of the gather is a local split); dx = dy_local W_local, then g =
//               all-reduce-sum of dx over the group.
//   row_parallel_linear     weight [out, in/tp] (columns of the full [out, in]), bias [out]
//                           replicated;
//     forward:  x is split along features ([rows, in/tp]; or, with input_is_parallel off,
//               the full [rows, in] is split locally); y = all-reduce-sum of x_local
//               W_local^T, then + b once;
//     backward: dx_local = dy W_local (no communication; all-gathered into the full dx when
//               the input was split locally), dW_local = dy^T x_local, db = colsum dy (the
//               same on every rank).
//
// Sequence parallel (Megatron's, an option of both): outside the tensor-parallel regions the
// activations hold 1/tp of the rows. A column-parallel layer then all-gathers its input's rows
// (and again in backward, for dW, rather than keeping the whole input) and reduce-scatters dx
// over the rows instead of all-reducing it; a row-parallel layer reduce-scatters its partial
// products over the rows instead of all-reducing them, and all-gathers dy's rows in backward.
//
// With tp = 1 (a null group, null ops, or size 1) both are nn::linear, bit for bit.
#pragma once

#include <strata/comm/communicator.hpp>
#include <strata/comm/reduce_op.hpp>
#include <strata/core/element.hpp>
#include <strata/core/error.hpp>
#include <strata/core/tensor.hpp>
#include <strata/nn/context.hpp>
#include <strata/nn/detail/gemm.hpp>
#include <strata/nn/detail/workspace.hpp>
#include <strata/nn/layer.hpp>
#include <strata/nn/linear.hpp>
#include <strata/nn/parameter.hpp>

#include <cstddef>
#include <span>
#include <string>

namespace strata::nn {

/// tp_ops over a communicator C (not owned; it must outlive the adapter). group() gives the
/// tp_group to put in layer_context::tp and to construct the parallel layers with.
template <comm::communicator C>
class tp_ops_of final : public tp_ops {
public:
  explicit tp_ops_of(C& comm) noexcept : comm_(&comm) {}

  tp_group group() noexcept { return {comm_->size(), comm_->rank(), this}; }
  C& communicator() noexcept { return *comm_; }

  void all_reduce_sum(std::span<float> b) override { reduce(b); }
  void all_reduce_sum(std::span<double> b) override { reduce(b); }
  void all_reduce_sum(std::span<f16> b) override { reduce(b); }
  void all_reduce_sum(std::span<bf16> b) override { reduce(b); }

  void all_gather(std::span<float const> s, std::span<float> r) override { gather(s, r); }
  void all_gather(std::span<double const> s, std::span<double> r) override { gather(s, r); }
  void all_gather(std::span<f16 const> s, std::span<f16> r) override { gather(s, r); }
  void all_gather(std::span<bf16 const> s, std::span<bf16> r) override { gather(s, r); }

  void reduce_scatter_sum(std::span<float const> s, std::span<float> r) override { scatter(s, r); }
  void reduce_scatter_sum(std::span<double const> s, std::span<double> r) override {
    scatter(s, r);
  }
  void reduce_scatter_sum(std::span<f16 const> s, std::span<f16> r) override { scatter(s, r); }
  void reduce_scatter_sum(std::span<bf16 const> s, std::span<bf16> r) override { scatter(s, r); }

private:
  template <class T>
  void reduce(std::span<T> b) {
    comm_->all_reduce(b, comm::reduce_op::sum);
  }
  template <class T>
  void gather(std::span<T const> s, std::span<T> r) {
    comm_->all_gather(s, r);
  }
  template <class T>
  void scatter(std::span<T const> s, std::span<T> r) {
    comm_->reduce_scatter(s, r, comm::reduce_op::sum);
  }

  C* comm_;
};

namespace detail {

/// n / tp, or config_error naming the layer, the numbers and the fix.
inline std::size_t tp_split(std::size_t n, int tp, std::string const& who, char const* what) {
  auto const t = static_cast<std::size_t>(tp);
  if (n % t != 0) {
    std::size_t const up = (n / t + 1) * t;
    throw config_error("strata: " + who + ": " + std::to_string(n) + " " + what +
                       " do not split over tp = " + std::to_string(tp) + ": use a multiple of " +
                       std::to_string(tp) + " (e.g. " + std::to_string(up) +
                       ") or a tp size that divides " + std::to_string(n));
  }
  return n / t;
}

/// The group's collectives for this call, checked against the split the layer was built
/// for; null when tp = 1.
inline tp_ops* tp_ops_for(layer_context const& ctx, int tp, int rank, std::string const& who) {
  int const s = tp_size_of(ctx.tp);
  if (s != tp || tp_rank_of(ctx.tp) != rank)
    throw config_error("strata: " + who + ": built for tp = " + std::to_string(tp) + " (rank " +
                       std::to_string(rank) + ") but called with tp = " + std::to_string(s) +
                       " (rank " + std::to_string(tp_rank_of(ctx.tp)) +
                       "): pass the same tp group in layer_context::tp as at construction");
  return tp > 1 ? ctx.tp->ops : nullptr;
}

/// All-reduce-sum of a rows x cols view in place (through `tmp` when its rows are strided).
template <class T>
void tp_all_reduce(tp_ops& ops, tensor_view<T> v, std::size_t rows, std::size_t cols,
                   workspace<T>& tmp) {
  if (v.stride(0) == cols || rows <= 1) {
    ops.all_reduce_sum(std::span<T>(v.data(), rows * cols));
    return;
  }
  auto t = tmp.get(rows, cols);
  for (std::size_t r = 0; r < rows; ++r)
    for (std::size_t j = 0; j < cols; ++j)
      t(r, j) = v(r, j);
  ops.all_reduce_sum(std::span<T>(t.data(), rows * cols));
  for (std::size_t r = 0; r < rows; ++r)
    for (std::size_t j = 0; j < cols; ++j)
      v(r, j) = t(r, j);
}

/// Gathers each rank's rows x part block `local` (contiguous) into the columns q*part.. of
/// `full` (rows x tp*part), through `recv` (tp*rows x part).
template <class T>
void tp_gather_columns(tp_ops& ops, T const* local, std::size_t rows, std::size_t part, int tp,
                       tensor_view<T> full, workspace<T>& recv) {
  auto const t = static_cast<std::size_t>(tp);
  auto g = recv.get(t * rows, part);
  ops.all_gather(std::span<T const>(local, rows * part), std::span<T>(g.data(), t * rows * part));
  for (std::size_t q = 0; q < t; ++q)
    for (std::size_t r = 0; r < rows; ++r) {
      T const* src = g.data() + (q * rows + r) * part;
      T* dst = full.data() + r * full.stride(0) + q * part;
      for (std::size_t j = 0; j < part; ++j)
        dst[j] = src[j];
    }
}

/// All-gather of every rank's rows: `local` (rows x cols) into `full` (tp*rows x cols,
/// contiguous), rank q's rows at q*rows (through `tmp` when `local` is strided).
template <class T>
void tp_gather_rows(tp_ops& ops, tensor_view<T const> local, std::size_t cols, int tp, T* full,
                    workspace<T>& tmp) {
  std::size_t const rows = local.extent(0), n = rows * cols;
  T const* src = local.data();
  if (local.stride(0) != cols && rows > 1) {
    auto t = tmp.get(rows, cols);
    for (std::size_t r = 0; r < rows; ++r)
      for (std::size_t j = 0; j < cols; ++j)
        t(r, j) = local(r, j);
    src = t.data();
  }
  ops.all_gather(std::span<T const>(src, n), std::span<T>(full, static_cast<std::size_t>(tp) * n));
}

/// Reduce-scatter over the rows: `full` (tp*rows x cols, contiguous) summed over the group,
/// rank q receiving rows q*rows .. into `local` (rows x cols; through `tmp` when strided).
template <class T>
void tp_scatter_rows(tp_ops& ops, T const* full, std::size_t cols, int tp, tensor_view<T> local,
                     workspace<T>& tmp) {
  std::size_t const rows = local.extent(0), n = rows * cols;
  std::span<T const> send(full, static_cast<std::size_t>(tp) * n);
  if (local.stride(0) == cols || rows <= 1) {
    ops.reduce_scatter_sum(send, std::span<T>(local.data(), n));
    return;
  }
  auto t = tmp.get(rows, cols);
  ops.reduce_scatter_sum(send, std::span<T>(t.data(), n));
  for (std::size_t r = 0; r < rows; ++r)
    for (std::size_t j = 0; j < cols; ++j)
      local(r, j) = t(r, j);
}

/// x itself, or under sequence parallel (split > 1) every rank's rows of x gathered into
/// `full` (split x its rows).
template <class T>
tensor_view<T const> sp_full_input(tp_ops* ops, int split, tensor_view<T const> x, std::size_t cols,
                                   workspace<T>& full, workspace<T>& tmp) {
  if (ops == nullptr || split == 1)
    return x;
  std::size_t const rows = x.extent(0) * static_cast<std::size_t>(split);
  T* f = full.get(rows, cols).data();
  tp_gather_rows(*ops, x, cols, split, f, tmp);
  return tensor_view<T const>(f, {rows, cols});
}

/// The row split of a sequence-parallel layer: tp when it is on and tp > 1, else 1.
constexpr int sp_split(bool sequence_parallel, int tp) noexcept {
  return sequence_parallel && tp > 1 ? tp : 1;
}

} // namespace detail

/// Options of column_parallel_linear.
struct column_parallel_options {
  bool bias = true;
  bool gather_output = false;     // all-gather the output into the full [rows, out]
  bool sequence_parallel = false; // x holds this rank's 1/tp of the rows (gathered here)
  init_rule weight_init = {};
};

/// A linear layer with its output features split over the tp group. Parameters
/// "<name>.weight", a shard [out/tp, in] of the logical [out, in] (rows rank*out/tp ..), and
/// "<name>.bias", a shard [out/tp] of [out]. Activations: x [rows, in] (the same on every
/// rank), y [rows, out/tp] (or [rows, out] with gather_output); with sequence_parallel, x is
/// this rank's [rows/tp, in] slice of the rows. Throws config_error at construction when out
/// does not divide by tp.
template <floating_element T, floating_element C = compute_t<T>>
class column_parallel_linear {
public:
  using value_type = T;
  using compute_type = C;
  struct saved_type {};

  column_parallel_linear(std::string name, std::size_t in, std::size_t out,
                         tp_group const* tp = nullptr, column_parallel_options options = {})
      : name_(std::move(name)), in_(in), out_(out), tp_(tp_size_of(tp)), rank_(tp_rank_of(tp)),
        local_out_(detail::tp_split(out, tp_, name_, "output features")),
        gather_(options.gather_output), split_(detail::sp_split(options.sequence_parallel, tp_)),
        has_bias_(options.bias),
        weight_(name_ + ".weight", {out, in}, options.weight_init, spec()) {
    if (has_bias_)
      bias_ = parameter<T>(name_ + ".bias", {out}, {init_rule::kind::zeros, 0}, spec());
  }

  std::string const& name() const noexcept { return name_; }
  std::size_t in_features() const noexcept { return in_; }
  std::size_t out_features() const noexcept { return gather_ ? out_ : local_out_; }
  /// The logical layer's output features, and this rank's share of them.
  std::size_t full_out_features() const noexcept { return out_; }
  std::size_t local_out_features() const noexcept { return local_out_; }
  int tp_size() const noexcept { return tp_; }
  int tp_rank() const noexcept { return rank_; }
  bool gather_output() const noexcept { return gather_; }
  /// tp under sequence parallel (the input holds 1/tp of the rows), else 1.
  int input_row_split() const noexcept { return split_; }
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
    tp_ops* ops = detail::tp_ops_for(ctx, tp_, rank_, name_);
    x = full_input(ops, x);
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

  void backward(layer_context const& ctx, tensor_view<T const> x_in, saved_type const&,
                tensor_view<T const> dy, tensor_view<T> dx) {
    tp_ops* ops = detail::tp_ops_for(ctx, tp_, rank_, name_);
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

private:
  shard_spec spec() const noexcept {
    return tp_ > 1 ? shard_spec{0, static_cast<std::size_t>(tp_), static_cast<std::size_t>(rank_)}
                   : shard_spec{};
  }

  // x itself, or under sequence parallel every rank's rows of it gathered (tp x its rows).
  tensor_view<T const> full_input(tp_ops* ops, tensor_view<T const> x) {
    return detail::sp_full_input(ops, split_, x, in_, xfull_, xtmp_);
  }

  std::string name_;
  std::size_t in_, out_;
  int tp_, rank_;
  std::size_t local_out_;
  bool gather_;
  int split_;
  bool has_bias_;
  parameter<T> weight_;
  parameter<T> bias_;
  detail::workspace<C> colsum_;
  detail::workspace<T> ylocal_;
  detail::workspace<T> gathered_;
  detail::workspace<T> dxtmp_;
  detail::workspace<T> xfull_, xtmp_, dxfull_;
};

/// Options of row_parallel_linear.
struct row_parallel_options {
  bool bias = true;
  bool input_is_parallel = true;  // x is [rows, in/tp]; false: x is the full [rows, in]
  bool sequence_parallel = false; // y holds this rank's 1/tp of the rows (reduce-scattered)
  init_rule weight_init = {};
};

/// A linear layer with its input features split over the tp group. Parameters
/// "<name>.weight", a shard [out, in/tp] of the logical [out, in] (columns rank*in/tp ..),
/// and "<name>.bias" [out], replicated (each rank holds it whole, with the same gradient).
/// Activations: x [rows, in/tp] (or [rows, in] with input_is_parallel off), y [rows, out]
/// (the same on every rank); with sequence_parallel, y is this rank's [rows/tp, out] slice of
/// the rows. Throws config_error at construction when in does not divide by tp.
template <floating_element T, floating_element C = compute_t<T>>
class row_parallel_linear {
public:
  using value_type = T;
  using compute_type = C;
  struct saved_type {};

  row_parallel_linear(std::string name, std::size_t in, std::size_t out,
                      tp_group const* tp = nullptr, row_parallel_options options = {})
      : name_(std::move(name)), in_(in), out_(out), tp_(tp_size_of(tp)), rank_(tp_rank_of(tp)),
        local_in_(detail::tp_split(in, tp_, name_, "input features")),
        input_parallel_(options.input_is_parallel),
        split_(detail::sp_split(options.sequence_parallel, tp_)), has_bias_(options.bias),
        weight_(name_ + ".weight", {out, in}, options.weight_init,
                tp_ > 1
                    ? shard_spec{1, static_cast<std::size_t>(tp_), static_cast<std::size_t>(rank_)}
                    : shard_spec{}) {
    if (has_bias_)
      bias_ = parameter<T>(name_ + ".bias", {out}, {init_rule::kind::zeros, 0});
  }

  std::string const& name() const noexcept { return name_; }
  std::size_t in_features() const noexcept { return input_parallel_ ? local_in_ : in_; }
  std::size_t out_features() const noexcept { return out_; }
  /// The logical layer's input features, and this rank's share of them.
  std::size_t full_in_features() const noexcept { return in_; }
  std::size_t local_in_features() const noexcept { return local_in_; }
  int tp_size() const noexcept { return tp_; }
  int tp_rank() const noexcept { return rank_; }
  bool input_is_parallel() const noexcept { return input_parallel_; }
  /// tp under sequence parallel (the output holds 1/tp of the rows), else 1.
  int output_row_split() const noexcept { return split_; }
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
    std::size_t const rows = x.extent(0);
    tp_ops* ops = detail::tp_ops_for(ctx, tp_, rank_, name_);
    bool const scatter = ops != nullptr && split_ > 1;
    detail::check_act(x, rows, in_features(), name_, "the input");
    detail::check_act(y, scatter ? rows / static_cast<std::size_t>(tp_) : rows, out_, name_,
                      "the output");
    T const* xl = local_input(x);
    T const* w = weight_.value().data();
    if (ops == nullptr) { // nn::linear's order: y = b, then y += x W^T
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

  void backward(layer_context const& ctx, tensor_view<T const> x, saved_type const&,
                tensor_view<T const> dy_in, tensor_view<T> dx) {
    std::size_t const rows = x.extent(0);
    detail::check_act(x, rows, in_features(), name_, "the input");
    tp_ops* ops = detail::tp_ops_for(ctx, tp_, rank_, name_);
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

private:
  // This rank's columns of x (x itself when it is already split, or tp = 1).
  T const* local_input(tensor_view<T const> x) const noexcept {
    return x.data() + (input_parallel_ ? 0 : static_cast<std::size_t>(rank_) * local_in_);
  }

  std::string name_;
  std::size_t in_, out_;
  int tp_, rank_;
  std::size_t local_in_;
  bool input_parallel_;
  int split_;
  bool has_bias_;
  parameter<T> weight_;
  parameter<T> bias_;
  detail::workspace<C> colsum_;
  detail::workspace<T> ytmp_;
  detail::workspace<T> dxlocal_;
  detail::workspace<T> gathered_;
  detail::workspace<T> yfull_, dyfull_, dytmp_;
};

} // namespace strata::nn
