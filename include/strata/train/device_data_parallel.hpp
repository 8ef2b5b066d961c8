// The data-parallel group of a device trainer: the communicator a rank's trainer reduces its
// gradient buckets and its loss over, behind one interface whatever the backend (device_local
// thread-ranks, nccl), with the requests of the buckets in flight.
#pragma once

#include <strata/comm/communicator.hpp>
#include <strata/comm/reduce_op.hpp>
#include <strata/core/dtype.hpp>
#include <strata/core/error.hpp>

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace strata::detail {

/// A communicator a device trainer can run data parallelism over: its queue is the device
/// context's stream, so a request makes the compute stream wait for a reduction without
/// blocking the host (comm::device_local::communicator<Ctx>, comm::nccl::communicator).
template <class C, class Ctx>
concept device_communicator =
    comm::communicator<C> && std::same_as<typename C::queue_type, typename Ctx::stream_type>;

/// What the device trainer asks of its data-parallel group, over device memory; T the
/// parameters' storage, M the master (compute) type. Each operation is issued on the
/// communicator's stream after the compute stream's work so far and returns at once (the host
/// never waits on the device here).
template <class T, class M, class Ctx>
class device_data_group {
public:
  virtual ~device_data_group() = default;
  virtual int rank() const noexcept = 0;
  virtual int size() const noexcept = 0;
  /// Rank 0's values and master weights to every rank (at build).
  virtual void broadcast_values(std::span<T> values) = 0;
  virtual void broadcast_master(std::span<M> master) = 0;
  /// The replicas' model checks at build: every rank's three numbers, gathered in rank order
  /// into `all` (device memory, 3 * size()).
  virtual void gather_checks(std::span<std::int64_t const> mine, std::span<std::int64_t> all) = 0;
  /// Sets the number of buckets in flight at most (at build).
  virtual void reserve(std::size_t buckets) = 0;
  /// Starts bucket `slot`'s average over the replicas, in place.
  virtual void start_average(std::size_t slot, std::span<T> grads) = 0;
  /// ZeRO-1: starts bucket `slot`'s average scattered over the replicas, in place: this rank's
  /// slice `mine` of `full` receives the average of every replica's slice.
  virtual void start_reduce_scatter(std::size_t slot, std::span<T> full, std::span<T> mine) = 0;
  /// ZeRO-1: every replica's slice gathered into `full`, in place (mine lies inside it), ordered
  /// before the compute stream's next work.
  virtual void gather(std::span<T const> mine, std::span<T> full) = 0;
  /// ZeRO-3: starts every replica's slice `mine` gathered into `full` (request `slot`; mine lies
  /// outside it), after the compute stream's work so far.
  virtual void start_gather(std::size_t slot, std::span<T const> mine, std::span<T> full) = 0;
  /// The sum over the replicas, ordered before the compute stream's next work.
  virtual void sum(std::span<double> values) = 0;
  /// Makes stream s wait for bucket `slot`'s operation (the host does not wait).
  virtual void wait_one(std::size_t slot, typename Ctx::stream_type s) = 0;
  /// Makes stream s wait for every bucket started (the host does not wait).
  virtual void wait_all(typename Ctx::stream_type s) = 0;
  /// The average over the replicas, ordered before the compute stream's next work.
  virtual void average(std::span<double> values) = 0;
  /// The communicator's call and byte counters.
  virtual comm::comm_counters const& counters() const noexcept = 0;
};

/// device_data_group over communicator C (owned).
template <class T, class M, class Ctx, device_communicator<Ctx> C>
class device_data_group_of final : public device_data_group<T, M, Ctx> {
  using request_t =
      decltype(std::declval<C&>().all_reduce_async(std::span<T>(), comm::reduce_op::avg));

public:
  explicit device_data_group_of(C c) : c_(std::move(c)) {}

  int rank() const noexcept override { return c_.rank(); }
  int size() const noexcept override { return c_.size(); }
  void broadcast_values(std::span<T> values) override { c_.broadcast(values, 0); }
  void broadcast_master(std::span<M> master) override { c_.broadcast(master, 0); }
  void gather_checks(std::span<std::int64_t const> mine, std::span<std::int64_t> all) override {
    c_.all_gather(mine, all);
  }
  void reserve(std::size_t buckets) override { requests_.assign(buckets, std::nullopt); }
  void start_average(std::size_t slot, std::span<T> grads) override {
    requests_[slot].emplace(c_.all_reduce_async(grads, comm::reduce_op::avg));
  }
  void start_reduce_scatter(std::size_t slot, std::span<T> full, std::span<T> mine) override {
    requests_[slot].emplace(
        c_.reduce_scatter_async(std::span<T const>(full), mine, comm::reduce_op::avg));
  }
  void gather(std::span<T const> mine, std::span<T> full) override { c_.all_gather(mine, full); }
  void start_gather(std::size_t slot, std::span<T const> mine, std::span<T> full) override {
    requests_[slot].emplace(c_.all_gather_async(mine, full));
  }
  void sum(std::span<double> values) override { c_.all_reduce(values, comm::reduce_op::sum); }
  void wait_one(std::size_t slot, typename Ctx::stream_type s) override {
    if (auto& r = requests_[slot]) {
      r->wait_on(s);
      r.reset();
    }
  }
  void wait_all(typename Ctx::stream_type s) override {
    for (auto& r : requests_)
      if (r) {
        r->wait_on(s);
        r.reset();
      }
  }
  void average(std::span<double> values) override { c_.all_reduce(values, comm::reduce_op::avg); }
  comm::comm_counters const& counters() const noexcept override { return c_.counters(); }

private:
  C c_;
  std::vector<std::optional<request_t>> requests_;
};

} // namespace strata::detail
