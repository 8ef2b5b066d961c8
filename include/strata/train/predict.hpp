// predict: what trainer::predict returns (the logits, a top-k, the per-token losses of a batch)
// and how it assembles them from the ranks that hold the loss's input.
#pragma once

#include <strata/comm/communicator.hpp>
#include <strata/comm/mesh.hpp>
#include <strata/core/element.hpp>
#include <strata/core/error.hpp>
#include <strata/engine/node.hpp>
#include <strata/nn/context.hpp>
#include <strata/nn/cross_entropy.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <numeric>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace strata {

/// What trainer::predict computes, and where it goes.
struct predict_options {
  /// Which ranks receive the predictions: every rank of the world, or world rank 0 only (the
  /// others get predictions with held = false and nothing in them).
  enum place { every_rank, rank0 };
  bool logits = false;   ///< the loss's input, rows x vocabulary
  std::size_t top_k = 0; ///< the k largest logits of each row and their class ids; 1: argmax
  bool losses = false;   ///< the per-token losses (the batch must have targets)
  place where = every_rank;
};

/// A batch's predictions, of the global batch (under data parallel each rank's slice, in
/// dp-rank order), row r = sequence r / seq, position r % seq. V is the model's compute type
/// (float for f32, bf16 and f16 models; double for f64).
template <class V>
struct predictions {
  bool held = false;         ///< false on the ranks that receive nothing (predict_options::rank0)
  std::size_t rows = 0;      ///< of the global batch
  std::size_t vocab = 0;     ///< the loss's classes
  std::size_t k = 0;         ///< top_k
  std::vector<V> logits;     ///< rows x vocab (predict_options::logits)
  std::vector<V> top_values; ///< rows x k, largest first (ties: the smaller id first)
  std::vector<std::int32_t> top_ids; ///< rows x k, the class of each top value
  std::vector<V> losses; ///< rows: -log softmax(logits)[target]; 0 for an ignore-index target

  std::span<V const> logits_of(std::size_t r) const {
    return std::span<V const>(logits).subspan(r * vocab, vocab);
  }
  std::span<std::int32_t const> top_ids_of(std::size_t r) const {
    return std::span<std::int32_t const>(top_ids).subspan(r * k, k);
  }
  std::span<V const> top_values_of(std::size_t r) const {
    return std::span<V const>(top_values).subspan(r * k, k);
  }
};

namespace detail {

/// The groups predictions move over, type-erased from the mesh's communicator (its
/// communicators must outlive the trainer, as the mesh's already must). Empty functions: a
/// group of one.
template <class V>
struct predict_links {
  int world_rank = 0;
  int dp_size = 1, dp_rank = 0, pp_size = 1, pp_rank = 0, tp_rank = 0;
  std::function<void(std::span<V const>, std::span<V>)> dp_all_gather;
  std::function<void(std::span<V const>, int)> dp_send, pp_send;
  std::function<void(std::span<V>, int)> dp_recv, pp_recv, pp_broadcast;

  template <comm::communicator C>
  static predict_links of(comm::mesh<C>& mesh) {
    predict_links l;
    auto const shape = mesh.shape();
    auto const at = mesh.coords();
    l.world_rank = mesh.world().rank();
    l.dp_size = shape.dp, l.dp_rank = at.dp;
    l.pp_size = shape.pp, l.pp_rank = at.pp;
    l.tp_rank = at.tp;
    C* dp = &mesh.dp();
    C* pp = &mesh.pp();
    l.dp_all_gather = [dp](std::span<V const> s, std::span<V> r) { dp->all_gather(s, r); };
    l.dp_send = [dp](std::span<V const> s, int to) { dp->send(s, to); };
    l.dp_recv = [dp](std::span<V> s, int from) { dp->recv(s, from); };
    l.pp_send = [pp](std::span<V const> s, int to) { pp->send(s, to); };
    l.pp_recv = [pp](std::span<V> s, int from) { pp->recv(s, from); };
    l.pp_broadcast = [pp](std::span<V> s, int root) { pp->broadcast(s, root); };
    return l;
  }
};

// Orders candidates (value, id): the larger value first, then the smaller id.
template <class V>
bool before(V va, std::int32_t ia, V vb, std::int32_t ib) noexcept {
  return va > vb || (va == vb && ia < ib);
}

/// The k best (value, id) of n candidates, into out (2k values: value, id as V).
template <class V>
void best_k(V const* values, std::int32_t const* ids, std::size_t n, std::size_t k, V* out,
            std::vector<std::size_t>& order) {
  order.resize(n);
  std::iota(order.begin(), order.end(), std::size_t{0});
  std::size_t const kk = std::min(k, n);
  std::partial_sort(
      order.begin(), order.begin() + static_cast<std::ptrdiff_t>(kk), order.end(),
      [&](std::size_t a, std::size_t b) { return before(values[a], ids[a], values[b], ids[b]); });
  for (std::size_t i = 0; i < k; ++i) {
    bool const have = i < kk;
    out[2 * i] = have ? values[order[i]] : -std::numeric_limits<V>::infinity();
    out[2 * i + 1] = have ? static_cast<V>(ids[order[i]]) : V{-1};
  }
}

/// The predictions of this rank's rows, one record of `width` values a row, from the logits'
/// local columns (rows x cls.local): [logits (vocab) | top-k (value, id) pairs | loss]. The
/// tensor-parallel peers of a vocab-split loss exchange only what each part needs: the local
/// columns for the logits, k candidates a row for the top-k, three numbers a row for the loss
/// (maximum, sum of exponentials, target logit).
template <class V>
std::vector<V> predict_records(std::vector<V> const& local, std::size_t rows,
                               engine::loss_classes cls, predict_options const& o,
                               std::span<std::int32_t const> targets, nn::tp_group const* tp,
                               std::size_t width) {
  std::size_t const n = cls.local, vocab = cls.total, k = o.top_k;
  bool const split = n != vocab;
  std::size_t const t = static_cast<std::size_t>(nn::tp_size_of(tp));
  if (split && t * n != vocab)
    throw error("strata: predict: the loss holds " + std::to_string(n) + " of " +
                std::to_string(vocab) + " classes on each of " + std::to_string(t) +
                " tensor-parallel ranks: its split is not the trainer's tp group");
  std::vector<V> rec(rows * width);
  std::size_t at = 0; // the part's first value in a record
  if (o.logits) {
    if (!split) {
      for (std::size_t r = 0; r < rows; ++r)
        std::copy_n(local.data() + r * n, n, rec.data() + r * width);
    } else {
      std::vector<V> all(t * rows * n);
      tp->ops->all_gather(std::span<V const>(local), std::span<V>(all));
      for (std::size_t q = 0; q < t; ++q)
        for (std::size_t r = 0; r < rows; ++r)
          std::copy_n(all.data() + (q * rows + r) * n, n, rec.data() + r * width + q * n);
    }
    at += vocab;
  }
  if (k) {
    std::vector<std::int32_t> ids(std::max(n, t * k));
    std::iota(ids.begin(), ids.begin() + static_cast<std::ptrdiff_t>(n),
              static_cast<std::int32_t>(cls.first));
    std::vector<std::size_t> order;
    std::vector<V> cand(rows * 2 * k);
    for (std::size_t r = 0; r < rows; ++r)
      best_k(local.data() + r * n, ids.data(), n, k, cand.data() + r * 2 * k, order);
    if (split) {
      // Each rank's k candidates of each row (global ids), gathered and merged: the
      // vocabulary never moves.
      std::vector<V> all(t * rows * 2 * k);
      tp->ops->all_gather(std::span<V const>(cand), std::span<V>(all));
      std::vector<V> vals(t * k);
      for (std::size_t r = 0; r < rows; ++r) {
        for (std::size_t q = 0; q < t; ++q)
          for (std::size_t i = 0; i < k; ++i) {
            V const* c = all.data() + ((q * rows + r) * k + i) * 2;
            vals[q * k + i] = c[0];
            ids[q * k + i] = static_cast<std::int32_t>(c[1]);
          }
        best_k(vals.data(), ids.data(), t * k, k, cand.data() + r * 2 * k, order);
      }
    }
    for (std::size_t r = 0; r < rows; ++r)
      std::copy_n(cand.data() + r * 2 * k, 2 * k, rec.data() + r * width + at);
    at += 2 * k;
  }
  if (o.losses) {
    // Per row: this rank's maximum, sum of exp(z - maximum) and target logit (0 when another
    // rank owns the target), combined over the group.
    std::vector<V> stats(rows * 3);
    for (std::size_t r = 0; r < rows; ++r) {
      V const* z = local.data() + r * n;
      V const m = nn::detail::row_max<V>(z, n);
      stats[3 * r] = m;
      stats[3 * r + 1] = nn::detail::row_sum_exp<V>(z, n, m);
      std::int32_t const tg = targets[r];
      bool const mine = tg != nn::ignore_index && static_cast<std::size_t>(tg) >= cls.first &&
                        static_cast<std::size_t>(tg) < cls.first + n;
      stats[3 * r + 2] = mine ? z[static_cast<std::size_t>(tg) - cls.first] : V{0};
    }
    std::vector<V> all = stats;
    if (split) {
      all.resize(t * rows * 3);
      tp->ops->all_gather(std::span<V const>(stats), std::span<V>(all));
    }
    std::size_t const parts = split ? t : 1;
    for (std::size_t r = 0; r < rows; ++r) {
      V m = all[3 * r];
      for (std::size_t q = 1; q < parts; ++q)
        m = std::max(m, all[(q * rows + r) * 3]);
      V s{0}, zt{0};
      for (std::size_t q = 0; q < parts; ++q) {
        V const* st = all.data() + (q * rows + r) * 3;
        s += st[1] * std::exp(st[0] - m);
        zt += st[2];
      }
      rec[r * width + at] = targets[r] == nn::ignore_index ? V{0} : m + std::log(s) - zt;
    }
  }
  return rec;
}

/// Moves the records (rows x width on the ranks that hold the loss, `holds`) to the ranks
/// that receive them: from the last pipeline stage over the pp group, then every dp rank's
/// rows in dp order over the dp group; to every rank, or to world rank 0 alone. Returns the
/// global batch's records on a receiving rank, empty on the others.
template <class V>
std::vector<V> move_records(std::vector<V> rec, std::size_t rows, std::size_t width,
                            predict_options const& o, predict_links<V> const& l) {
  rec.resize(rows * width);
  bool const all = o.where == predict_options::every_rank;
  if (l.pp_size > 1) {
    if (all)
      l.pp_broadcast(std::span<V>(rec), l.pp_size - 1);
    else if (l.tp_rank == 0 && l.pp_rank == l.pp_size - 1)
      l.pp_send(std::span<V const>(rec), 0);
    else if (l.tp_rank == 0 && l.pp_rank == 0)
      l.pp_recv(std::span<V>(rec), l.pp_size - 1);
  }
  std::size_t const dp = static_cast<std::size_t>(l.dp_size);
  if (dp > 1) {
    if (all) {
      std::vector<V> g(dp * rows * width);
      l.dp_all_gather(std::span<V const>(rec), std::span<V>(g));
      rec = std::move(g);
    } else if (l.tp_rank == 0 && l.pp_rank == 0) {
      if (l.dp_rank != 0) {
        l.dp_send(std::span<V const>(rec), 0);
      } else {
        rec.resize(dp * rows * width);
        for (int q = 1; q < l.dp_size; ++q)
          l.dp_recv(
              std::span<V>(rec).subspan(static_cast<std::size_t>(q) * rows * width, rows * width),
              q);
      }
    }
  }
  if (!all && l.world_rank != 0)
    return {};
  return rec;
}

/// Unpacks the global batch's records into predictions.
template <class V>
predictions<V> unpack(std::vector<V> const& rec, std::size_t width, std::size_t vocab,
                      predict_options const& o) {
  predictions<V> p;
  if (rec.empty())
    return p;
  std::size_t const rows = rec.size() / width, k = o.top_k;
  p.held = true;
  p.rows = rows;
  p.vocab = vocab;
  p.k = k;
  if (o.logits)
    p.logits.resize(rows * vocab);
  p.top_values.resize(rows * k);
  p.top_ids.resize(rows * k);
  if (o.losses)
    p.losses.resize(rows);
  for (std::size_t r = 0; r < rows; ++r) {
    V const* x = rec.data() + r * width;
    if (o.logits)
      std::copy_n(x, vocab, p.logits.data() + r * vocab), x += vocab;
    for (std::size_t i = 0; i < k; ++i) {
      p.top_values[r * k + i] = x[2 * i];
      p.top_ids[r * k + i] = static_cast<std::int32_t>(x[2 * i + 1]);
    }
    x += 2 * k;
    if (o.losses)
      p.losses[r] = *x;
  }
  return p;
}

/// The options' checks against the model's loss and the batch.
inline void check_predict(predict_options const& o, engine::loss_classes cls,
                          std::string const& loss_name, bool has_targets, std::size_t id_limit) {
  if (cls.total == 0)
    throw config_error("strata: predict: the model's loss \"" + loss_name +
                       "\" is not a softmax_cross_entropy, so its input is not known to be "
                       "logits: end the model with nn::softmax_cross_entropy (or its "
                       "vocab-parallel form)");
  if (!o.logits && o.top_k == 0 && !o.losses)
    throw config_error("strata: predict: the options ask for nothing: set logits, top_k "
                       "(1: argmax) or losses");
  if (o.top_k > cls.total)
    throw config_error("strata: predict: top_k = " + std::to_string(o.top_k) + " but the loss \"" +
                       loss_name + "\" has " + std::to_string(cls.total) +
                       " classes: ask for at most " + std::to_string(cls.total));
  if (o.losses && !has_targets)
    throw config_error("strata: predict: per-token losses need targets, and the batch has none: "
                       "give the batch its targets, or leave predict_options::losses off");
  if (o.top_k && cls.total > id_limit)
    throw config_error("strata: predict: a vocabulary of " + std::to_string(cls.total) +
                       " classes has ids beyond " + std::to_string(id_limit) +
                       ", which the model's compute type carries exactly: use a top-k over "
                       "logits (predict_options::logits) instead");
}

} // namespace detail
} // namespace strata
