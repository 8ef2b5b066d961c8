// The communicator conformance suite, written once for every backend: each function runs on
// every rank of a communicator and throws on the first wrong element.
#pragma once

#include "../support/seed.hpp"

#include <strata/comm/communicator.hpp>
#include <strata/comm/mesh.hpp>
#include <strata/core/dtype.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

namespace strata::test::conformance {

using comm::reduce_op;

template <class... Ts>
struct type_list {};
using all_types = type_list<float, double, f16, bf16, std::int32_t, std::int64_t>;

template <class Fn, class... Ts>
void for_each_type(type_list<Ts...>, Fn&& fn) {
  (fn.template operator()<Ts>(), ...);
}

inline constexpr reduce_op all_ops[] = {reduce_op::sum, reduce_op::avg, reduce_op::max,
                                        reduce_op::min};

/// Sizes every collective is checked on: empty, one, primes, and sizes no rank count divides.
inline constexpr std::size_t sizes[] = {0, 1, 2, 7, 13, 61, 1021, 4099, 65537};

/// Rank `rank`'s element `i` of the call keyed `key`: random, reproducible by every rank.
template <class T>
T value(std::uint64_t key, int rank, std::size_t i) {
  std::uint64_t const h = mix(mix(key, static_cast<std::uint64_t>(rank)), i);
  if constexpr (std::is_integral_v<T>) {
    if constexpr (sizeof(T) == 4)
      return static_cast<T>(static_cast<std::int64_t>(h % 2001u) - 1000);
    else
      return static_cast<T>(static_cast<std::int64_t>(h % (1ull << 41)) - (1ll << 40));
  } else {
    double const u = static_cast<double>(h >> 11) * 0x1.0p-53 * 2.0 - 1.0; // [-1, 1)
    if constexpr (std::is_same_v<T, double>)
      return u;
    else
      return T(static_cast<float>(u));
  }
}

/// A value no correct result contains: what outputs are filled with before each call.
template <class T>
T poison() {
  if constexpr (std::is_integral_v<T>)
    return static_cast<T>(0x5a5a5a5a5a5a5a5all);
  else if constexpr (std::is_same_v<T, f16> || std::is_same_v<T, bf16>)
    return T::from_bits(0x7fa5);
  else
    return std::numeric_limits<T>::quiet_NaN();
}

template <class T>
bool same_bits(T const& a, T const& b) {
  return std::memcmp(&a, &b, sizeof(T)) == 0;
}

template <class T>
double as_double(T v) {
  return static_cast<double>(static_cast<std::conditional_t<std::is_integral_v<T>, T, float>>(v));
}
inline double as_double(double v) {
  return v;
}

/// The documented result: combine ranks 0..n-1 in order (16-bit floats in float, rounded
/// once), avg divides the sum by n.
template <class T, class Get>
T reference(reduce_op op, int n, Get&& get) {
  using A = std::conditional_t<std::is_same_v<T, f16> || std::is_same_v<T, bf16>, float, T>;
  A acc = static_cast<A>(get(0));
  for (int j = 1; j < n; ++j) {
    A const v = static_cast<A>(get(j));
    switch (op) {
    case reduce_op::sum:
    case reduce_op::avg:
      acc = acc + v;
      break;
    case reduce_op::max:
      acc = v > acc ? v : acc;
      break;
    case reduce_op::min:
      acc = v < acc ? v : acc;
      break;
    }
  }
  if (op == reduce_op::avg)
    acc = acc / static_cast<A>(n);
  if constexpr (std::is_same_v<A, T>)
    return acc;
  else
    return T(acc);
}

/// Unit roundoff of T.
template <class T>
constexpr double unit_roundoff() {
  if constexpr (std::is_same_v<T, double>)
    return 0x1.0p-53;
  else if constexpr (std::is_same_v<T, f16>)
    return 0x1.0p-11;
  else if constexpr (std::is_same_v<T, bf16>)
    return 0x1.0p-8;
  else
    return 0x1.0p-24;
}

/// Whether `got` is an acceptable result where `want` is the fixed-order reference. With
/// `exact`, bits must match. Otherwise (a backend whose library picks the summation order, as
/// MPI does) a floating-point sum or average may differ by the rounding of another order:
/// n accumulation roundings of the absolute sum plus one rounding of the result.
template <class T, class Get>
bool matches(T got, T want, bool exact, reduce_op op, int n, Get&& get) {
  if (exact || std::is_integral_v<T> || op == reduce_op::max || op == reduce_op::min)
    return same_bits(got, want);
  double abs_sum = 0;
  for (int j = 0; j < n; ++j)
    abs_sum += std::abs(as_double(get(j)));
  if (op == reduce_op::avg)
    abs_sum /= n;
  using A = std::conditional_t<std::is_same_v<T, double>, double, float>;
  double const tol =
      (n + 1) * unit_roundoff<A>() * abs_sum + 2 * unit_roundoff<T>() * std::abs(as_double(want));
  return std::abs(as_double(got) - as_double(want)) <= tol;
}

template <class T>
std::string mismatch(char const* call, std::size_t count, std::size_t i, T got, T want, int rank) {
  return std::string(call) + " " + std::string(name_of(dtype_of<T>)) + " count " +
         std::to_string(count) + ": rank " + std::to_string(rank) + " element " +
         std::to_string(i) + " is " + std::to_string(as_double(got)) + ", expected " +
         std::to_string(as_double(want));
}

/// Each call gets its own key, the same on every rank (ranks make the same calls in order).
struct keys {
  std::uint64_t seed;
  std::uint64_t n = 0;
  std::uint64_t next() { return mix(seed, ++n); }
};

/// `exact`: floating-point sums must equal the fixed-order reference bit for bit (backends
/// that own their reduction order); otherwise within the rounding of another order.
template <comm::communicator C>
void all_reduce(C& c, std::uint64_t seed, bool exact = true) {
  keys k{seed};
  int const n = c.size(), r = c.rank();
  for_each_type(all_types{}, [&]<class T>() {
    for (std::size_t count : sizes) {
      for (reduce_op op : all_ops) {
        for (bool in_place : {false, true}) {
          std::uint64_t const key = k.next();
          std::vector<T> send(count), recv(count, poison<T>());
          for (std::size_t i = 0; i < count; ++i)
            send[i] = value<T>(key, r, i);
          if (in_place) {
            c.all_reduce(std::span<T>(send), op);
            recv = send;
          } else {
            c.all_reduce(std::span<T const>(send), std::span<T>(recv), op);
            for (std::size_t i = 0; i < count; ++i)
              STRATA_CHECK_MSG(same_bits(send[i], value<T>(key, r, i)),
                               "all_reduce wrote to its send buffer");
          }
          for (std::size_t i = 0; i < count; ++i) {
            auto const in = [&](int j) { return value<T>(key, j, i); };
            T const want = reference<T>(op, n, in);
            STRATA_CHECK_MSG(matches(recv[i], want, exact, op, n, in),
                             mismatch(in_place ? "in-place all_reduce" : "all_reduce", count, i,
                                      recv[i], want, r) +
                                 " op " + std::string(name_of(op)));
          }
        }
      }
    }
  });
}

template <comm::communicator C>
void reduce_scatter(C& c, std::uint64_t seed, bool exact = true) {
  keys k{seed};
  int const n = c.size(), r = c.rank();
  for_each_type(all_types{}, [&]<class T>() {
    for (std::size_t count : {0, 1, 7, 13, 1021, 4099}) {
      for (reduce_op op : all_ops) {
        for (bool in_place : {false, true}) {
          std::uint64_t const key = k.next();
          std::size_t const total = count * static_cast<std::size_t>(n);
          std::vector<T> send(total), recv(count, poison<T>());
          for (std::size_t i = 0; i < total; ++i)
            send[i] = value<T>(key, r, i);
          std::span<T> out(recv);
          if (in_place)
            out = std::span<T>(send).subspan(static_cast<std::size_t>(r) * count, count);
          c.reduce_scatter(std::span<T const>(send), out, op);
          for (std::size_t i = 0; i < count; ++i) {
            std::size_t const g = static_cast<std::size_t>(r) * count + i;
            auto const in = [&](int j) { return value<T>(key, j, g); };
            T const want = reference<T>(op, n, in);
            STRATA_CHECK_MSG(matches(out[i], want, exact, op, n, in),
                             mismatch(in_place ? "in-place reduce_scatter" : "reduce_scatter",
                                      count, i, out[i], want, r) +
                                 " op " + std::string(name_of(op)));
          }
        }
      }
    }
  });
}

template <comm::communicator C>
void all_gather(C& c, std::uint64_t seed) {
  keys k{seed};
  int const n = c.size(), r = c.rank();
  for_each_type(all_types{}, [&]<class T>() {
    for (std::size_t count : sizes) {
      for (bool in_place : {false, true}) {
        std::uint64_t const key = k.next();
        std::size_t const total = count * static_cast<std::size_t>(n);
        std::vector<T> send(count), recv(total, poison<T>());
        for (std::size_t i = 0; i < count; ++i)
          send[i] = value<T>(key, r, i);
        std::span<T const> in(send);
        if (in_place) {
          auto mine = std::span<T>(recv).subspan(static_cast<std::size_t>(r) * count, count);
          std::copy(send.begin(), send.end(), mine.begin());
          in = mine;
        }
        c.all_gather(in, std::span<T>(recv));
        for (std::size_t i = 0; i < total; ++i) {
          T const want = value<T>(key, static_cast<int>(i / std::max<std::size_t>(count, 1)),
                                  i % std::max<std::size_t>(count, 1));
          STRATA_CHECK_MSG(same_bits(recv[i], want),
                           mismatch(in_place ? "in-place all_gather" : "all_gather", count, i,
                                    recv[i], want, r));
        }
      }
    }
  });
}

template <comm::communicator C>
void broadcast(C& c, std::uint64_t seed) {
  keys k{seed};
  int const n = c.size(), r = c.rank();
  for_each_type(all_types{}, [&]<class T>() {
    for (std::size_t count : sizes) {
      for (int root : {0, n - 1, n / 2}) {
        for (bool in_place : {false, true}) {
          std::uint64_t const key = k.next();
          std::vector<T> send(count), recv(count, poison<T>());
          for (std::size_t i = 0; i < count; ++i)
            send[i] = value<T>(key, r, i);
          if (in_place) {
            if (r == root)
              recv = send;
            c.broadcast(std::span<T>(recv), root);
          } else {
            c.broadcast(std::span<T const>(send), std::span<T>(recv), root);
          }
          for (std::size_t i = 0; i < count; ++i) {
            T const want = value<T>(key, root, i);
            STRATA_CHECK_MSG(same_bits(recv[i], want),
                             mismatch("broadcast", count, i, recv[i], want, r) + " from root " +
                                 std::to_string(root));
          }
        }
      }
    }
  });
}

/// Rings in both directions through group(), several messages to one peer in order, and
/// blocking send/recv pairs ordered so they cannot deadlock.
template <comm::communicator C>
void point_to_point(C& c, std::uint64_t seed) {
  keys k{seed};
  int const n = c.size(), r = c.rank();
  int const right = (r + 1) % n, left = (r + n - 1) % n;
  for_each_type(all_types{}, [&]<class T>() {
    for (std::size_t count : {0, 1, 13, 4099, 65537}) {
      std::uint64_t const key = k.next();
      // Each rank sends two messages right and one left, and receives the matching ones; with
      // one or two ranks left and right are the same peer, and order per peer still matches.
      std::vector<T> to_right_a(count), to_right_b(count + 1), to_left(count);
      for (std::size_t i = 0; i < count; ++i) {
        to_right_a[i] = value<T>(key, r, i);
        to_left[i] = value<T>(key + 1, r, i);
      }
      for (std::size_t i = 0; i <= count; ++i)
        to_right_b[i] = value<T>(key + 2, r, i);
      std::vector<T> from_left_a(count, poison<T>()), from_left_b(count + 1, poison<T>()),
          from_right(count, poison<T>());
      comm::p2p const ops[] = {
          comm::p2p::send(std::span<T const>(to_right_a), right),
          comm::p2p::recv(std::span<T>(from_left_a), left),
          comm::p2p::send(std::span<T const>(to_right_b), right),
          comm::p2p::send(std::span<T const>(to_left), left),
          comm::p2p::recv(std::span<T>(from_left_b), left),
          comm::p2p::recv(std::span<T>(from_right), right),
      };
      c.group(std::span<comm::p2p const>(ops));
      for (std::size_t i = 0; i < count; ++i) {
        STRATA_CHECK_MSG(
            same_bits(from_left_a[i], value<T>(key, left, i)),
            mismatch("group recv", count, i, from_left_a[i], value<T>(key, left, i), r));
        STRATA_CHECK_MSG(
            same_bits(from_right[i], value<T>(key + 1, right, i)),
            mismatch("group recv", count, i, from_right[i], value<T>(key + 1, right, i), r));
      }
      for (std::size_t i = 0; i <= count; ++i)
        STRATA_CHECK_MSG(same_bits(from_left_b[i], value<T>(key + 2, left, i)),
                         mismatch("group recv (2nd)", count + 1, i, from_left_b[i],
                                  value<T>(key + 2, left, i), r));
      // Blocking pairs: rank 2m sends to 2m+1 first, then receives back.
      if (n >= 2 && !(n % 2 == 1 && r == n - 1)) {
        int const peer = r ^ 1;
        std::vector<T> back(count, poison<T>());
        if (r % 2 == 0) {
          c.send(std::span<T const>(to_right_a), peer);
          c.recv(std::span<T>(back), peer);
        } else {
          c.recv(std::span<T>(back), peer);
          c.send(std::span<T const>(to_right_a), peer);
        }
        for (std::size_t i = 0; i < count; ++i)
          STRATA_CHECK_MSG(same_bits(back[i], value<T>(key, peer, i)),
                           mismatch("send/recv", count, i, back[i], value<T>(key, peer, i), r));
      }
    }
  });
}

/// split() by parity with keys that reverse the order, then collectives on the pieces.
template <comm::communicator C>
void split(C& c, std::uint64_t seed, bool exact = true) {
  int const n = c.size(), r = c.rank();
  int const color = r % 2;
  C sub = c.split(color, -r);
  std::vector<int> members; // parent ranks of my color, in the new order (descending)
  for (int j = n - 1; j >= 0; --j)
    if (j % 2 == color)
      members.push_back(j);
  STRATA_CHECK(sub.size() == static_cast<int>(members.size()));
  STRATA_CHECK(members[static_cast<std::size_t>(sub.rank())] == r);
  std::uint64_t const key = mix(seed, 77);
  std::vector<double> v(1021);
  for (std::size_t i = 0; i < v.size(); ++i)
    v[i] = value<double>(key, r, i);
  sub.all_reduce(std::span<double>(v), reduce_op::sum);
  for (std::size_t i = 0; i < v.size(); ++i) {
    auto const in = [&](int j) {
      return value<double>(key, members[static_cast<std::size_t>(j)], i);
    };
    double const want = reference<double>(reduce_op::sum, sub.size(), in);
    STRATA_CHECK_MSG(matches(v[i], want, exact, reduce_op::sum, sub.size(), in),
                     mismatch("split all_reduce", v.size(), i, v[i], want, r));
  }
  std::vector<std::int64_t> ids(static_cast<std::size_t>(sub.size()), -1);
  std::int64_t const me = r;
  sub.all_gather(std::span<std::int64_t const>(&me, 1), std::span<std::int64_t>(ids));
  for (std::size_t j = 0; j < ids.size(); ++j)
    STRATA_CHECK(ids[j] == members[j]);
  // A split of a split, and the parent still works after both.
  C one = sub.split(sub.rank(), 0);
  STRATA_CHECK(one.size() == 1 && one.rank() == 0);
  c.barrier();
}

/// Every axis of every mesh shape that fits the world reduces over exactly its own ranks.
template <comm::communicator C>
void mesh(C& world) {
  int const n = world.size();
  for (int tp = 1; tp <= n; ++tp) {
    for (int pp = 1; pp * tp <= n; ++pp) {
      if (n % (tp * pp) != 0)
        continue;
      comm::mesh<C> m(world, {.dp = 0, .tp = tp, .pp = pp});
      auto const s = m.shape();
      auto const me = m.coords();
      STRATA_CHECK(s.dp * s.tp * s.pp == n);
      STRATA_CHECK(m.rank_at(me) == world.rank());
      STRATA_CHECK(m.tp().rank() == me.tp && m.tp().size() == s.tp);
      STRATA_CHECK(m.dp().rank() == me.dp && m.dp().size() == s.dp);
      STRATA_CHECK(m.pp().rank() == me.pp && m.pp().size() == s.pp);
      // Sum of world ranks over each axis, against the ranks the coordinates name.
      auto check_axis = [&](C& axis, auto vary, int len) {
        std::int64_t sum = world.rank();
        axis.all_reduce(std::span<std::int64_t>(&sum, 1), reduce_op::sum);
        std::int64_t want = 0;
        for (int i = 0; i < len; ++i)
          want += m.rank_at(vary(me, i));
        STRATA_CHECK_MSG(sum == want, "mesh dp=" + std::to_string(s.dp) +
                                          " tp=" + std::to_string(s.tp) +
                                          " pp=" + std::to_string(s.pp) + ": axis sum " +
                                          std::to_string(sum) + " != " + std::to_string(want));
      };
      check_axis(
          m.tp(), [](comm::mesh_coords c, int i) { return c.tp = i, c; }, s.tp);
      check_axis(
          m.dp(), [](comm::mesh_coords c, int i) { return c.dp = i, c; }, s.dp);
      check_axis(
          m.pp(), [](comm::mesh_coords c, int i) { return c.pp = i, c; }, s.pp);
    }
  }
}

/// Non-blocking forms: several in flight, waited in reverse; a blocking call issued behind
/// them runs after them (it sees their results).
template <comm::communicator C>
void async(C& c, std::uint64_t seed, bool exact = true) {
  int const n = c.size(), r = c.rank();
  std::uint64_t const key = mix(seed, 99);
  constexpr int inflight = 6;
  std::size_t const count = 4099;
  std::vector<std::vector<float>> bufs(inflight, std::vector<float>(count));
  for (int b = 0; b < inflight; ++b)
    for (std::size_t i = 0; i < count; ++i)
      bufs[static_cast<std::size_t>(b)][i] =
          value<float>(key + static_cast<std::uint64_t>(b), r, i);
  using req_t = decltype(c.all_reduce_async(std::span<float>(bufs[0]), reduce_op::sum));
  std::vector<req_t> reqs;
  for (int b = 0; b < inflight; ++b)
    reqs.push_back(c.all_reduce_async(std::span<float>(bufs[static_cast<std::size_t>(b)]),
                                      b % 2 ? reduce_op::max : reduce_op::sum));
  std::vector<float> gathered(count * static_cast<std::size_t>(n), poison<float>());
  c.all_gather(std::span<float const>(bufs[inflight - 1]), std::span<float>(gathered));
  for (int b = inflight - 1; b >= 0; --b) {
    reqs[static_cast<std::size_t>(b)].wait();
    STRATA_CHECK(reqs[static_cast<std::size_t>(b)].test());
    reduce_op const op = b % 2 ? reduce_op::max : reduce_op::sum;
    for (std::size_t i = 0; i < count; ++i) {
      auto const in = [&](int j) {
        return value<float>(key + static_cast<std::uint64_t>(b), j, i);
      };
      float const want = reference<float>(op, n, in);
      float const got = bufs[static_cast<std::size_t>(b)][i];
      STRATA_CHECK_MSG(matches(got, want, exact, op, n, in),
                       mismatch("all_reduce_async", count, i, got, want, r));
      if (b == inflight - 1) // every rank's result, gathered, has the same bits as ours
        for (int j = 0; j < n; ++j)
          STRATA_CHECK_MSG(same_bits(gathered[static_cast<std::size_t>(j) * count + i], got),
                           "a blocking all_gather did not run after the queued all_reduce");
    }
  }
  // The other non-blocking forms, each checked.
  std::vector<double> rs_in(count * static_cast<std::size_t>(n)), rs_out(count, poison<double>());
  for (std::size_t i = 0; i < rs_in.size(); ++i)
    rs_in[i] = value<double>(key + 50, r, i);
  std::vector<double> ag_out(count * static_cast<std::size_t>(n), poison<double>());
  std::vector<double> bc(count);
  for (std::size_t i = 0; i < count; ++i)
    bc[i] = value<double>(key + 51, r, i);
  auto q1 = c.reduce_scatter_async(std::span<double const>(rs_in), std::span<double>(rs_out),
                                   reduce_op::sum);
  auto q2 = c.all_gather_async(std::span<double const>(bc), std::span<double>(ag_out));
  auto q3 = c.broadcast_async(std::span<double>(bc), n - 1);
  q3.wait();
  q1.wait();
  q2.wait();
  for (std::size_t i = 0; i < count; ++i) {
    std::size_t const g = static_cast<std::size_t>(r) * count + i;
    auto const in = [&](int j) { return value<double>(key + 50, j, g); };
    STRATA_CHECK(
        matches(rs_out[i], reference<double>(reduce_op::sum, n, in), exact, reduce_op::sum, n, in));
    STRATA_CHECK(same_bits(bc[i], value<double>(key + 51, n - 1, i)));
  }
  for (std::size_t i = 0; i < ag_out.size(); ++i)
    STRATA_CHECK(
        same_bits(ag_out[i], value<double>(key + 51, static_cast<int>(i / count), i % count)));
  // A non-blocking ring exchange.
  std::vector<std::int32_t> out(count), in(count, poison<std::int32_t>());
  for (std::size_t i = 0; i < count; ++i)
    out[i] = value<std::int32_t>(key + 52, r, i);
  comm::p2p const ops[] = {comm::p2p::send(std::span<std::int32_t const>(out), (r + 1) % n),
                           comm::p2p::recv(std::span<std::int32_t>(in), (r + n - 1) % n)};
  auto q4 = c.group_async(std::span<comm::p2p const>(ops));
  q4.wait();
  for (std::size_t i = 0; i < count; ++i)
    STRATA_CHECK(in[i] == value<std::int32_t>(key + 52, (r + n - 1) % n, i));
}

/// The queue: every communicator names its queue type, and each request can make a queue wait
/// for it. On a host backend the queue is the host, so wait_on(q) completes the request and
/// its results are there when it returns; a device backend's results are there once the host
/// waits too, which a later wait() does.
template <comm::communicator C>
void queue(C& c, std::uint64_t seed, bool exact = true) {
  using Q = typename C::queue_type;
  constexpr bool host = std::is_same_v<Q, comm::host_queue>;
  Q q{};
  int const n = c.size(), r = c.rank();
  std::uint64_t const key = mix(seed, 11);
  std::size_t const count = 1021;
  std::vector<float> a(count);
  for (std::size_t i = 0; i < count; ++i)
    a[i] = value<float>(key, r, i);
  std::vector<std::int64_t> mine(count), all(count * static_cast<std::size_t>(n), -1);
  for (std::size_t i = 0; i < count; ++i)
    mine[i] = value<std::int64_t>(key + 1, r, i);
  std::vector<double> rs_in(count * static_cast<std::size_t>(n)), rs_out(count, poison<double>());
  for (std::size_t i = 0; i < rs_in.size(); ++i)
    rs_in[i] = value<double>(key + 2, r, i);
  std::vector<std::int32_t> bc(count), out(count), in(count, poison<std::int32_t>());
  for (std::size_t i = 0; i < count; ++i) {
    bc[i] = value<std::int32_t>(key + 3, r, i);
    out[i] = value<std::int32_t>(key + 4, r, i);
  }
  comm::p2p const ops[] = {comm::p2p::send(std::span<std::int32_t const>(out), (r + 1) % n),
                           comm::p2p::recv(std::span<std::int32_t>(in), (r + n - 1) % n)};
  auto q1 = c.all_reduce_async(std::span<float>(a), reduce_op::sum);
  auto q2 = c.all_gather_async(std::span<std::int64_t const>(mine), std::span<std::int64_t>(all));
  auto q3 = c.reduce_scatter_async(std::span<double const>(rs_in), std::span<double>(rs_out),
                                   reduce_op::max);
  auto q4 = c.broadcast_async(std::span<std::int32_t>(bc), 0);
  auto q5 = c.group_async(std::span<comm::p2p const>(ops));
  // In reverse: wait_on completes earlier operations first, as wait() does.
  q5.wait_on(q);
  q4.wait_on(q);
  q3.wait_on(q);
  q2.wait_on(q);
  q1.wait_on(q);
  if constexpr (host)
    STRATA_CHECK_MSG(q1.test() && q2.test() && q3.test() && q4.test() && q5.test(),
                     "wait_on(host_queue) returned before its request completed");
  q1.wait();
  q2.wait();
  q3.wait();
  q4.wait();
  q5.wait();
  for (std::size_t i = 0; i < count; ++i) {
    auto const sum_in = [&](int j) { return value<float>(key, j, i); };
    float const want = reference<float>(reduce_op::sum, n, sum_in);
    STRATA_CHECK_MSG(matches(a[i], want, exact, reduce_op::sum, n, sum_in),
                     mismatch("all_reduce_async + wait_on", count, i, a[i], want, r));
    std::size_t const g = static_cast<std::size_t>(r) * count + i;
    auto const max_in = [&](int j) { return value<double>(key + 2, j, g); };
    double const want_max = reference<double>(reduce_op::max, n, max_in);
    STRATA_CHECK_MSG(same_bits(rs_out[i], want_max),
                     mismatch("reduce_scatter_async + wait_on", count, i, rs_out[i], want_max, r));
    STRATA_CHECK_MSG(bc[i] == value<std::int32_t>(key + 3, 0, i),
                     "broadcast_async + wait_on: rank " + std::to_string(r) + " element " +
                         std::to_string(i) + " is not the root's");
    STRATA_CHECK_MSG(in[i] == value<std::int32_t>(key + 4, (r + n - 1) % n, i),
                     "group_async + wait_on: rank " + std::to_string(r) + " element " +
                         std::to_string(i) + " is not the left neighbour's");
  }
  for (std::size_t i = 0; i < all.size(); ++i)
    STRATA_CHECK_MSG(all[i] == value<std::int64_t>(key + 1, static_cast<int>(i / count), i % count),
                     "all_gather_async + wait_on: rank " + std::to_string(r) + " element " +
                         std::to_string(i) + " is not its rank's");
}

/// The counters count what was called: calls and nccl-tests bytes per kind.
template <comm::communicator C>
void counters(C& c) {
  int const n = c.size();
  comm::comm_counters const before = c.counters();
  std::vector<float> a(100, 1.0f), b(100 * static_cast<std::size_t>(n), 1.0f);
  std::vector<double> d(10, 1.0), e(10);
  c.all_reduce(std::span<float>(a), reduce_op::sum);
  c.all_reduce(std::span<float>(a), reduce_op::max);
  c.reduce_scatter(std::span<float const>(b), std::span<float>(a), reduce_op::sum);
  c.all_gather(std::span<float const>(a), std::span<float>(b));
  c.broadcast(std::span<double>(d), 0);
  c.barrier();
  comm::p2p const ops[] = {comm::p2p::send(std::span<double const>(d), (c.rank() + 1) % n),
                           comm::p2p::recv(std::span<double>(e), (c.rank() + n - 1) % n)};
  c.group(std::span<comm::p2p const>(ops));
  c.all_reduce_async(std::span<float>(a), reduce_op::sum).wait();
  comm::comm_counters const& now = c.counters();
  using comm::op_kind;
  auto calls = [&](op_kind k) { return now.calls(k) - before.calls(k); };
  auto bytes = [&](op_kind k) { return now.bytes(k) - before.bytes(k); };
  std::uint64_t const un = static_cast<std::uint64_t>(n);
  STRATA_CHECK(calls(op_kind::all_reduce) == 3 && bytes(op_kind::all_reduce) == 3 * 400);
  STRATA_CHECK(calls(op_kind::reduce_scatter) == 1 && bytes(op_kind::reduce_scatter) == 400 * un);
  STRATA_CHECK(calls(op_kind::all_gather) == 1 && bytes(op_kind::all_gather) == 400 * un);
  STRATA_CHECK(calls(op_kind::broadcast) == 1 && bytes(op_kind::broadcast) == 80);
  STRATA_CHECK(calls(op_kind::barrier) == 1 && bytes(op_kind::barrier) == 0);
  STRATA_CHECK(calls(op_kind::send) == 1 && bytes(op_kind::send) == 80);
  STRATA_CHECK(calls(op_kind::recv) == 1 && bytes(op_kind::recv) == 80);
}

/// The same bits on every rank and in a rerun: a float sum of 100003 elements, twice, then
/// every rank's result gathered and compared with this rank's.
template <comm::communicator C>
void same_bits_everywhere(C& c, std::uint64_t seed) {
  std::size_t const count = 100003;
  std::uint64_t const key = mix(seed, 4321);
  std::vector<float> in(count), a(count), b(count);
  for (std::size_t i = 0; i < count; ++i)
    in[i] = value<float>(key, c.rank(), i) * 1e3f;
  c.all_reduce(std::span<float const>(in), std::span<float>(a), reduce_op::sum);
  c.all_reduce(std::span<float const>(in), std::span<float>(b), reduce_op::sum);
  STRATA_CHECK(std::memcmp(a.data(), b.data(), count * sizeof(float)) == 0);
  std::vector<float> all(count * static_cast<std::size_t>(c.size()));
  c.all_gather(std::span<float const>(a), std::span<float>(all));
  for (int j = 0; j < c.size(); ++j)
    STRATA_CHECK(std::memcmp(all.data() + static_cast<std::size_t>(j) * count, a.data(),
                             count * sizeof(float)) == 0);
}

/// Everything above, in one order every backend runs.
template <comm::communicator C>
void all(C& c, std::uint64_t seed, bool exact = true) {
  all_reduce(c, mix(seed, 1), exact);
  reduce_scatter(c, mix(seed, 2), exact);
  all_gather(c, mix(seed, 3));
  broadcast(c, mix(seed, 4));
  point_to_point(c, mix(seed, 5));
  split(c, mix(seed, 6), exact);
  mesh(c);
  async(c, mix(seed, 7), exact);
  queue(c, mix(seed, 8), exact);
  counters(c);
}

} // namespace strata::test::conformance
