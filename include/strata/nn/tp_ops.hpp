// tp_ops_of<C>: the tensor-parallel group's collectives (nn::tp_ops, what the split layers call)
// over any communicator.
#pragma once

#include <strata/comm/communicator.hpp>
#include <strata/comm/reduce_op.hpp>
#include <strata/core/float16.hpp>
#include <strata/nn/context.hpp>

#include <span>

namespace strata::nn {

/// tp_ops over a communicator C (not owned; it must outlive the adapter). group() gives the
/// tp_group to put in layer_context::tp and to construct the split layers with.
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

} // namespace strata::nn
