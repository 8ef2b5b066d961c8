// ties: tied parameters' gradients summed once a step — one tensor read by two layers (GPT-2's
// token embedding and output head), each layer holding its own member of the set.
#pragma once

#include <strata/core/buffer.hpp>
#include <strata/core/element.hpp>
#include <strata/core/memory.hpp>
#include <strata/engine/flat_layout.hpp>
#include <strata/engine/node.hpp>

#include <cstddef>
#include <functional>
#include <span>
#include <string>
#include <vector>

namespace strata::engine {

/// The tie operation (op_code::tie, before the clip): every member of a tied set gets the sum
/// of the members' gradients, on every rank that holds any of them. The members' gradients
/// are finished by then (every reduction has completed), so the sum is the tied tensor's
/// gradient over the global batch: each rank adds the members' elements it holds into one
/// buffer of the tensor's size on this rank (its tensor-parallel shard: the members split
/// alike), the buffer is summed over the groups the strategies register (add_group), and each
/// member's elements are read back from it.
///
/// A strategy registers a group when the members' elements are spread over its ranks, each
/// held by one of them: the pipeline its stages (the members on the first and the last stage,
/// Megatron's embedding group), ZeRO its dp group (each rank holds a shard of each member).
/// Data parallel registers none (every dp rank holds the same averaged gradient), nor tensor
/// parallel (the buffer is this rank's shard). The sums are in compute_t<T>, rounded to T once.
/// The buffer is allocated in setup; a step allocates nothing.
template <class T>
class tied_gradients {
public:
  using compute_type = compute_t<T>;
  using group_fn = std::function<void(std::span<compute_type>)>;

  /// The builder's ties (names, and each tensor's size on this rank).
  void adopt(std::vector<typename model_builder<T>::tie_info> ties) { ties_ = std::move(ties); }
  bool empty() const noexcept { return ties_.empty(); }
  auto const& ties() const noexcept { return ties_; }

  /// A strategy's sum over its group of ranks (see the class comment).
  void add_group(group_fn f) { groups_.push_back(std::move(f)); }

  /// After every pass's setup: where this rank holds members' gradient elements (the flat
  /// layout's owned ranges: what the optimizer reads, the f32 gradients under
  /// precision::accumulate<float>), and the buffer. A set's tensor is as large as its
  /// primary's shard on this rank.
  template <class Device>
  void setup(flat_layout<T, Device> const& flat, memory_ledger& ledger) {
    runs_.assign(ties_.size(), {});
    std::size_t total = 0;
    for (auto const& t : ties_)
      total += t.local_size;
    sum_ = buffer<compute_type>(total, memory_kind::communication, ledger);
    for (auto const& r : flat.owned)
      flat.for_each_piece(
          r.flat, r.count,
          [&](std::uint32_t param, std::size_t first, std::size_t n, std::size_t at) {
            auto const& p = *flat.params[param].p;
            if (!p.tied())
              return;
            for (std::size_t s = 0; s < ties_.size(); ++s)
              if (ties_[s].primary == p.tie())
                runs_[s].push_back(
                    {r.grads + at, r.wide ? r.wide + at : nullptr, p.local_of(first), n});
          });
  }

  /// The sum: members' gradients added into the buffer, the groups' sums, read back.
  void run() {
    std::size_t base = 0;
    for (std::size_t s = 0; s < ties_.size(); ++s) {
      std::span<compute_type> const b(sum_.data() + base, ties_[s].local_size);
      for (auto& v : b)
        v = compute_type{0};
      for (auto const& r : runs_[s])
        for (std::size_t i = 0; i < r.count; ++i)
          b[r.at + i] += r.wide ? r.wide[i] : element_cast<compute_type>(r.grads[i]);
      for (auto const& g : groups_)
        g(b);
      for (auto const& r : runs_[s])
        for (std::size_t i = 0; i < r.count; ++i) {
          if (r.wide) // the accumulate pass rounds them into the 16-bit ones before the clip
            r.wide[i] = b[r.at + i];
          else
            r.grads[i] = element_cast<T>(b[r.at + i]);
        }
      base += ties_[s].local_size;
    }
  }

private:
  struct run_of {
    T* grads;
    compute_type* wide;    // the f32 gradients the optimizer reads (accumulate<float>), or null
    std::size_t at, count; // the buffer's elements [at, at + count)
  };

  std::vector<typename model_builder<T>::tie_info> ties_;
  std::vector<group_fn> groups_;
  std::vector<std::vector<run_of>> runs_;
  buffer<compute_type> sum_;
};

} // namespace strata::engine
