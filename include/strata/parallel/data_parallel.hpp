// The data-parallel pass (DDP): gradient buckets all-reduced over the dp axis, each started
// as soon as backward has produced it on the last micro-batch, overlapped with the rest of
// backward; parameters broadcast from dp rank 0; replica layout and divergence checks.
#pragma once

#include <strata/comm/communicator.hpp>
#include <strata/comm/reduce_op.hpp>
#include <strata/core/error.hpp>
#include <strata/engine/flat_layout.hpp>
#include <strata/engine/op.hpp>
#include <strata/engine/option.hpp>
#include <strata/engine/pass.hpp>
#include <strata/engine/program.hpp>
#include <strata/engine/state.hpp>
#include <strata/parallel/batch_check.hpp>
#include <strata/parallel/plan.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

namespace strata::parallel {

/// One gradient bucket: flat elements [begin, end), complete when backward has finished
/// layer `ready_layer` (the lowest layer with parameters in it) on the last micro-batch.
struct bucket {
  std::size_t begin = 0;
  std::size_t end = 0;
  std::uint32_t ready_layer = 0;
};

/// Cuts the flat gradient buffer into buckets in backward order, as PyTorch's DDP does:
/// parameters join the open bucket until it holds at least its cap — first_bytes for the
/// first (small, so communication starts early), bytes for the others — and then it closes.
/// `tail` extra elements after the parameters join the last bucket.
template <class T, class D>
std::vector<bucket> make_buckets(engine::flat_layout<T, D> const& f, std::size_t first_bytes,
                                 std::size_t bytes, std::size_t tail) {
  std::vector<bucket> out;
  bucket cur{};
  bool open = false;
  for (auto const& e : f.params) {
    if (!open) {
      cur = {e.offset, e.offset, e.layer};
      open = true;
    }
    cur.ready_layer = std::min(cur.ready_layer, e.layer);
    cur.end = e.offset + e.p->size();
    std::size_t const cap = (out.empty() ? first_bytes : bytes) / sizeof(T);
    if (cur.end - cur.begin >= cap) {
      out.push_back(cur);
      open = false;
    }
  }
  if (open) {
    cur.end += tail;
    out.push_back(cur);
  } else if (!out.empty()) {
    out.back().end += tail;
  } else {
    // No parameters: one bucket of the tail, ready after the backward of layer 0.
    out.push_back({0, tail, 0});
  }
  return out;
}
/// The buckets of an engine state's layout.
template <class T, class D>
std::vector<bucket> make_buckets(engine::state<T, D> const& s, std::size_t first_bytes,
                                 std::size_t bytes, std::size_t tail) {
  return make_buckets(s.flat(), first_bytes, bytes, tail);
}

namespace detail {

// FNV-1a over bytes: a checksum of a replica's parameters (replicas are bit-identical).
inline std::uint64_t fnv1a(void const* data, std::size_t n,
                           std::uint64_t h = 0xcbf29ce484222325ull) noexcept {
  auto const* p = static_cast<unsigned char const*>(data);
  for (std::size_t i = 0; i < n; ++i) {
    h ^= p[i];
    h *= 0x100000001b3ull;
  }
  return h;
}

/// Every rank of a data-parallel group must hold the same parameters: the same count of
/// tensors and elements, the same names and shapes (a hash of them). Throws config_error
/// naming the ranks that differ.
template <class T, class D, comm::communicator C>
void check_replicas(C& dp, engine::state<T, D> const& s, std::string_view who) {
  if (dp.size() == 1)
    return;
  std::uint64_t h = 0xcbf29ce484222325ull;
  for (auto const& e : s.flat().params) {
    h = fnv1a(e.p->name().data(), e.p->name().size(), h);
    for (std::size_t d : e.p->shape())
      h = fnv1a(&d, sizeof d, h);
  }
  std::size_t elements = 0;
  for (auto const& e : s.flat().params)
    elements += e.p->size();
  std::int64_t mine[3] = {static_cast<std::int64_t>(s.flat().params.size()),
                          static_cast<std::int64_t>(elements), static_cast<std::int64_t>(h)};
  std::vector<std::int64_t> all(3 * static_cast<std::size_t>(dp.size()));
  dp.all_gather(std::span<std::int64_t const>(mine, 3), std::span<std::int64_t>(all));
  std::string diff;
  for (int r = 1; r < dp.size(); ++r) {
    auto const* o = all.data() + 3 * r;
    if (o[0] != all[0] || o[1] != all[1] || o[2] != all[2])
      diff += " dp rank " + std::to_string(r) + " holds " + std::to_string(o[1]) + " elements in " +
              std::to_string(o[0]) + " tensors" +
              (o[0] == all[0] && o[1] == all[1] ? " (other names or shapes)" : "") + ";";
  }
  if (!diff.empty())
    throw config_error("strata: " + std::string(who) +
                       ": the replicas hold different models: dp rank 0 holds " +
                       std::to_string(all[1]) + " parameter elements in " + std::to_string(all[0]) +
                       " tensors;" + diff + " every dp rank must build the same model");
}

} // namespace detail

/// The data-parallel pass over communicator C (the mesh's dp group).
///
/// R is the type gradients are reduced in: T, or f32 for 16-bit T (precision::reduce<float>):
/// a bucket is widened into an f32 buffer, all-reduced in f32 and rounded back once. Under
/// precision::accumulate<float> the gradients already sum in the layout's f32 buffer
/// (flat_layout::wide_grads): a bucket is all-reduced there in place, and stays f32.
template <class T, comm::communicator C, class R = T, class Device = host>
class data_parallel_pass final : public engine::pass<T, Device> {
  static constexpr bool widen = !std::is_same_v<R, T>;
  using request_t =
      decltype(std::declval<C&>().all_reduce_async(std::span<R>(), comm::reduce_op::avg));
  enum kind : std::uint8_t {
    k_bucket = 0,     // start a bucket's all-reduce (arg: the bucket)
    k_wait_all = 1,   // wait for every bucket; the loss and the counts out of the tail
    k_loss = 2,       // forward-only: the loss averaged over the replicas
    k_divergence = 3, // compare the replicas' parameters (every divergence_every steps)
  };

public:
  data_parallel_pass(C& dp, plan_descriptor::data_parallel_desc const& d) : dp_(&dp), d_(d) {}

  std::string_view name() const noexcept override { return "data_parallel"; }
  std::string_view kind_name(std::uint8_t k) const noexcept override {
    constexpr std::string_view names[] = {"bucket", "wait_all", "loss", "divergence"};
    return k < std::size(names) ? names[k] : std::string_view{};
  }

  std::vector<bucket> const& buckets() const noexcept { return buckets_; }
  C& group() noexcept { return *dp_; }

  /// Extra elements after the parameters carry the step's loss and this rank's sequence
  /// count (detail::count_code) in the last bucket, so averaging the loss over the replicas
  /// and refusing replicas fed batches of different sizes cost no collective of their own.
  /// The dp group is the count group of token-weighted batches: their counted weight is
  /// averaged over it (one all-reduce of one double, when the batch is set), so every
  /// replica's loss divides by the global count and averaging gradients and losses over the
  /// replicas, as for any batch, gives the global masked mean.
  void configure(engine::state<T, Device>& s) override {
    s.flat().tail = std::max(s.flat().tail, tail_size());
    s.settings().data_rank = static_cast<std::size_t>(dp_->rank());
    if (dp_->size() > 1)
      s.reductions().add_count_group(
          [this](double& c) { dp_->all_reduce(std::span<double>(&c, 1), comm::reduce_op::avg); });
  }

  void setup(engine::state<T, Device>& s) override {
    detail::check_replicas(*dp_, s, "data_parallel");
    if (dp_->size() > 1)
      dp_->broadcast(std::span<T>(s.flat().values.data(), s.flat().tail_begin), 0);
    buckets_ = make_buckets(s, d_.first_bucket_bytes, d_.bucket_bytes, tail_size());
    if constexpr (widen) {
      accumulated_ = s.flat().wide_grads.size() != 0;
      if (!accumulated_)
        wide_ = buffer<R, Device>(s.flat().flat_size, memory_kind::communication, default_ledger());
    }
    requests_.assign(buckets_.size(), std::nullopt);
    loss_slot_ = s.flat().tail_begin;
  }

  void rewrite(engine::program& p, std::uint16_t id) override {
    using engine::op;
    using engine::op_code;
    bool ended = false; // the waits go before the first operation that ends the backward
    p.rewrite(
        [&](op const& o, std::vector<op>& out) {
          if (!ended && engine::ends_backward(o)) {
            ended = true;
            if (!d_.overlap)
              for (std::uint32_t b = 0; b < buckets_.size(); ++b)
                out.push_back(engine::pass_op(op_code::collective, id, b));
            out.push_back(engine::pass_op(op_code::wait, id, 0, k_wait_all));
          }
          return true;
        },
        [&](op const& o, std::vector<op>& out) {
          if (o.code == op_code::backward && o.last() && d_.overlap)
            for (std::uint32_t b = 0; b < buckets_.size(); ++b)
              if (buckets_[b].ready_layer == o.layer) {
                op c = engine::pass_op(op_code::collective, id, b);
                c.layer = o.layer;
                c.micro_batch = o.micro_batch;
                c.flags = o.flags;
                out.push_back(c);
              }
          if (o.code == op_code::optimizer_step && d_.divergence_every > 0)
            out.push_back(engine::pass_op(op_code::custom, id, 0, k_divergence));
        });
  }

  void rewrite_eval(engine::program& p, std::uint16_t id) override {
    p.ops.push_back(engine::pass_op(engine::op_code::collective, id, 0, k_loss));
  }

  bool communication(engine::op const& o, engine::comm_note& out) const override {
    if (o.code != engine::op_code::collective)
      return false;
    if (o.kind == k_loss)
      out = {"all_reduce", "dp", sizeof(double)};
    else if (o.kind == k_bucket && o.arg < buckets_.size())
      out = {"all_reduce", "dp", (buckets_[o.arg].end - buckets_[o.arg].begin) * sizeof(R)};
    else
      return false;
    return true;
  }

  void run(engine::op const& o, engine::state<T, Device>& s) override {
    if (o.kind == k_loss) { // forward-only: average the loss over the replicas
      dp_->all_reduce(s.reductions().loss(), comm::reduce_op::avg);
      return;
    }
    if (o.kind == k_bucket) {
      bucket const& b = buckets_[o.arg];
      if constexpr (carries_loss)
        if (b.end > loss_slot_) { // the last bucket carries the loss and the count
          s.flat().grads.data()[loss_slot_] = static_cast<T>(s.reductions().loss()[0]);
          code_.write(s.values().batch.sequences, s.flat().grads.data() + loss_slot_ + 1);
        }
      if constexpr (widen) {
        R* const base = accumulated_ ? s.flat().wide_grads.data() : wide_.data();
        std::span<R> const w(base + b.begin, b.end - b.begin);
        if (!accumulated_)
          convert(std::span<T const>(s.flat().grads.data() + b.begin, w.size()), w);
        requests_[o.arg] = dp_->all_reduce_async(w, comm::reduce_op::avg);
      } else {
        requests_[o.arg] = dp_->all_reduce_async(
            std::span<T>(s.flat().grads.data() + b.begin, b.end - b.begin), comm::reduce_op::avg);
      }
      return;
    }
    if (o.kind == k_wait_all) {
      for (auto& r : requests_)
        if (r) {
          r->wait_on(s.context().compute); // the compute queue waits (on the host: wait())
          r.reset();
        }
      if constexpr (widen) // the f32 averages, rounded once (accumulated: they stay f32)
        for (auto const& b :
             accumulated_ ? std::span<bucket const>() : std::span<bucket const>(buckets_))
          convert(std::span<R const>(wide_.data() + b.begin, b.end - b.begin),
                  std::span<T>(s.flat().grads.data() + b.begin, b.end - b.begin));
      bool agrees = true;
      if constexpr (carries_loss) {
        T* const tail = s.flat().grads.data() + loss_slot_;
        s.reductions().loss()[0] = static_cast<double>(tail[0]);
        agrees = code_.agrees(tail + 1);
        std::fill(tail, tail + 1 + code_.slots(), T(0));
      } else { // a 16-bit slot would round the loss: average it (and the count) in double
        double* const v = loss_count_.data();
        v[0] = s.reductions().loss()[0];
        wide_code_.write(s.values().batch.sequences, v + 1);
        dp_->all_reduce(std::span<double>(loss_count_), comm::reduce_op::avg);
        s.reductions().loss()[0] = v[0];
        agrees = wide_code_.agrees(v + 1);
      }
      if (!agrees)
        detail::refuse_uneven_batches(*dp_, s.values().batch.sequences, "data_parallel");
      return;
    }
    if (o.kind == k_divergence) {
      if (s.values().step % static_cast<std::int64_t>(d_.divergence_every) == 0)
        check_divergence(s);
      return;
    }
  }

  void abort() noexcept override {
    // Operations this rank started must finish before the buffers go; the other replicas
    // start the same ones (they run the same program), or fail and release them.
    for (auto& r : requests_)
      if (r) {
        try {
          r->wait();
        } catch (...) {
        }
        r.reset();
      }
  }

private:
  void check_divergence(engine::state<T, Device> const& s) {
    std::int64_t const mine = static_cast<std::int64_t>(
        detail::fnv1a(s.flat().values.data(), s.flat().tail_begin * sizeof(T)));
    hashes_.resize(static_cast<std::size_t>(dp_->size()));
    dp_->all_gather(std::span<std::int64_t const>(&mine, 1), std::span<std::int64_t>(hashes_));
    std::string bad;
    for (int r = 1; r < dp_->size(); ++r)
      if (hashes_[static_cast<std::size_t>(r)] != hashes_[0])
        bad += (bad.empty() ? "" : ", ") + std::to_string(r);
    if (!bad.empty())
      throw error("strata: data_parallel: the replicas diverged at step " +
                  std::to_string(s.values().step) + ": the parameters of dp rank(s) [" + bad +
                  "] differ from dp rank 0's. Replicas start equal and apply the same averaged "
                  "gradients, so something outside strata changed them (a rank-dependent "
                  "update, uninitialised memory, a non-deterministic kernel)");
  }

  C* dp_;
  plan_descriptor::data_parallel_desc d_;
  std::vector<bucket> buckets_;
  std::vector<std::optional<request_t>> requests_;
  std::vector<std::int64_t> hashes_;
  std::size_t loss_slot_ = 0;
  buffer<R, Device> wide_;   // R != T: the f32 gradients being reduced
  bool accumulated_ = false; // R != T, accumulate<float>: reduced in flat_layout::wide_grads
  // f32 and f64 gradients carry the loss and the count in their last bucket; 16-bit ones
  // would round them: they go in one all-reduce of doubles.
  static constexpr bool carries_loss = sizeof(T) >= 4;
  using code_type = std::conditional_t<std::is_same_v<T, double>, double, float>;
  detail::count_code<code_type> code_{dp_->size()};
  detail::count_code<double> wide_code_{dp_->size()};
  std::size_t tail_size() const noexcept { return carries_loss ? 1 + code_.slots() : 1; }
  std::vector<double> loss_count_ = std::vector<double>(1 + wide_code_.slots());
};

} // namespace strata::parallel

namespace strata {

/// data_parallel<...> as a plan option: DDP over the dp axis.
template <class... Os>
struct option_traits<data_parallel<Os...>> {
  static constexpr std::string_view name = "data_parallel";
  static constexpr std::string_view axis = "dp";
  static constexpr int fold = folds::data_parallel;
  using options_type = plan_descriptor::data_parallel_desc;
  static constexpr options_type options() noexcept {
    plan_descriptor d;
    data_parallel<Os...>::lower(d);
    return d.data_parallel;
  }
  static void check(options_type const&, plan_context const&) {}
  template <class T, class R, class D, class C>
  static std::unique_ptr<engine::pass<T, D>> make_pass(options_type const& o,
                                                       pass_context<C>& ctx) {
    return std::make_unique<parallel::data_parallel_pass<T, C, R, D>>(ctx.mesh->dp(), o);
  }
};

} // namespace strata
