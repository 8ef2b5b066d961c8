// Threads per rank (core/thread_pool.hpp, trainer_options::threads): the pool runs every
// piece once and passes a piece's exception on; STRATA_NUM_THREADS is read and checked; the
// GEMM gives the same bits with 1, 2 and 3 threads (and agrees with a plain triple loop);
// training runs give the same bits with 1 and 2 threads per rank, alone and on a mesh (data
// parallel, tensor parallel), with every dropout on.
#include <strata/comm/local.hpp>
#include <strata/comm/mesh.hpp>
#include <strata/core/cpu.hpp>
#include <strata/core/float16.hpp>
#include <strata/core/thread_pool.hpp>
#include <strata/models/gpt.hpp>
#include <strata/nn/detail/gemm.hpp>
#include <strata/nn/dropout.hpp>
#include <strata/nn/layer_norm.hpp>
#include <strata/nn/transformer_block.hpp>
#include <strata/optim/adamw.hpp>
#include <strata/train/trainer.hpp>

#include "../support/parity.hpp"
#include "../support/seed.hpp"
#include "../support/training.hpp"

#include <catch2/catch.hpp>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace st = strata;
namespace eng = strata::engine;
using Catch::Matchers::Contains;

TEST_CASE("the pool runs every piece once, on several threads, and passes an exception on",
          "[threads]") {
  st::thread_pool pool(3);
  CHECK(pool.size() == 3);
  st::pool_scope scope(&pool);
  CHECK(st::current_threads() == 3);
  std::vector<std::atomic<int>> hits(257);
  std::atomic<int> inner_threads{0};
  for (int round = 0; round < 50; ++round)
    st::parallel_for(hits.size(), [&](std::size_t p) {
      hits[p].fetch_add(1);
      if (p == 0)
        inner_threads = static_cast<int>(st::current_threads()); // nested: serial
    });
  for (auto& h : hits)
    REQUIRE(h.load() == 50);
  CHECK(inner_threads.load() == 1);
  CHECK_THROWS_WITH(st::parallel_for(8,
                                     [](std::size_t p) {
                                       if (p == 5)
                                         throw std::runtime_error("piece 5 failed");
                                     }),
                    Contains("piece 5 failed"));
  // A pool made and dropped before its workers start, with or without a job, ends.
  for (int i = 0; i < 300; ++i) {
    st::thread_pool p(3);
    if (i % 2 == 0)
      p.run(4, [](std::size_t) {});
  }
  // The pool still works after a piece threw.
  std::atomic<int> n{0};
  st::parallel_for(16, [&](std::size_t) { n.fetch_add(1); });
  CHECK(n.load() == 16);
}

TEST_CASE("STRATA_NUM_THREADS sets the threads per rank; the default shares the cores",
          "[threads]") {
  char const* before = std::getenv("STRATA_NUM_THREADS");
  std::string const saved = before ? before : "";
  ::setenv("STRATA_NUM_THREADS", "3", 1);
  CHECK(st::default_num_threads(1) == 3);
  CHECK(st::default_num_threads(8) == 3);
  ::setenv("STRATA_NUM_THREADS", "two", 1);
  CHECK_THROWS_WITH(st::default_num_threads(1),
                    Contains("STRATA_NUM_THREADS=\"two\"") && Contains("1 to 1024"));
  ::setenv("STRATA_NUM_THREADS", "0", 1);
  CHECK_THROWS_AS(st::default_num_threads(1), st::config_error);
  ::unsetenv("STRATA_NUM_THREADS");
  std::size_t const hw = std::max(1u, std::thread::hardware_concurrency());
  CHECK(st::default_num_threads(1) == hw);
  CHECK(st::default_num_threads(hw) == 1);
  CHECK(st::default_num_threads(4 * hw) == 1);
  if (before)
    ::setenv("STRATA_NUM_THREADS", saved.c_str(), 1);
  INFO("isa " << st::isa_name(st::host_isa()) << ", gemm " << st::nn::detail::gemm_backend());
  SUCCEED();
}

namespace {

template <class T>
std::vector<T> random_values(std::size_t n, std::uint64_t seed) {
  std::vector<T> v(n);
  for (std::size_t i = 0; i < n; ++i)
    v[i] =
        static_cast<T>(static_cast<float>(double(st::test::mix(seed, i) >> 11) * 0x1.0p-53 - 0.5));
  return v;
}

// C = op(A) op(B) with the given transposes, on `threads` threads (1: no pool).
template <class T>
std::vector<T> product(std::size_t m, std::size_t n, std::size_t k, bool ta, bool tb,
                       std::vector<T> const& a, std::vector<T> const& b, std::size_t threads) {
  std::vector<T> c(m * n);
  st::thread_pool pool(threads);
  st::pool_scope scope(threads > 1 ? &pool : nullptr);
  st::nn::detail::gemm<st::compute_t<T>>(m, n, k, a.data(), ta ? 1 : k, ta ? m : 1, b.data(),
                                         tb ? 1 : n, tb ? k : 1, c.data(), n, false);
  return c;
}

template <class T>
void check_gemm_threads(std::size_t m, std::size_t n, std::size_t k, bool ta, bool tb) {
  using C = st::compute_t<T>;
  auto const a = random_values<T>(m * k, st::test::seed() + m);
  auto const b = random_values<T>(k * n, st::test::seed() + n + 7);
  auto const c1 = product<T>(m, n, k, ta, tb, a, b, 1);
  for (std::size_t threads : {2u, 3u}) {
    auto const ct = product<T>(m, n, k, ta, tb, a, b, threads);
    INFO(m << " x " << n << " x " << k << (ta ? " A^T" : "") << (tb ? " B^T" : "") << ", "
           << threads << " threads");
    REQUIRE(std::memcmp(c1.data(), ct.data(), c1.size() * sizeof(T)) == 0);
  }
  // Against a plain loop in double (A stored [k, m] when transposed, B [n, k]).
  double worst = 0;
  for (std::size_t i = 0; i < m; ++i)
    for (std::size_t j = 0; j < n; ++j) {
      double s = 0;
      for (std::size_t p = 0; p < k; ++p)
        s += static_cast<double>(st::to_compute_value<C>(ta ? a[p * m + i] : a[i * k + p])) *
             static_cast<double>(st::to_compute_value<C>(tb ? b[j * k + p] : b[p * n + j]));
      worst = std::max(worst,
                       std::abs(s - static_cast<double>(st::to_compute_value<C>(c1[i * n + j]))));
    }
  double const tol = std::is_same_v<T, double> ? 1e-12 : std::is_same_v<T, float> ? 1e-4 : 0.05;
  INFO(m << " x " << n << " x " << k << ": worst difference from the plain loop " << worst);
  CHECK(worst < tol * std::sqrt(static_cast<double>(k)));
}

} // namespace

TEST_CASE("the GEMM gives the same bits with 1, 2 and 3 threads", "[threads]") {
  check_gemm_threads<float>(64, 1024, 256, false, true);  // split along n
  check_gemm_threads<float>(1000, 130, 300, true, false); // split along m, ragged pieces
  check_gemm_threads<float>(37, 19, 5, false, false);     // one piece
  check_gemm_threads<double>(300, 520, 64, true, true);
  check_gemm_threads<st::bf16>(512, 600, 200, false, true); // strata's own kernel
}

namespace {

// The outputs of the row-block kernels on one input, with `threads` threads (1: no pool).
struct row_outputs {
  std::vector<float> ln_y, ln_stats, ln_dx, ln_dw, ln_db, drop_y, drop_dx, residual;
  std::vector<std::uint8_t> mask;
};

row_outputs row_kernels(std::size_t rows, std::size_t cols, std::size_t threads) {
  namespace nn = st::nn;
  auto const x = random_values<float>(rows * cols, st::test::seed() + 11);
  auto const dy = random_values<float>(rows * cols, st::test::seed() + 12);
  auto const w = random_values<float>(cols, st::test::seed() + 13);
  auto const b = random_values<float>(cols, st::test::seed() + 14);
  st::thread_pool pool(threads);
  st::pool_scope scope(threads > 1 ? &pool : nullptr);
  row_outputs o;
  o.ln_y.resize(rows * cols);
  o.ln_stats.resize(2 * rows);
  o.ln_dx.resize(rows * cols);
  o.ln_dw.assign(cols, 0.25f);
  o.ln_db.assign(cols, -0.5f);
  std::vector<float> acc(nn::detail::layer_norm_acc_size(rows, cols));
  st::tensor_view<float const> xv(x.data(), {rows, cols});
  st::tensor_view<float const> dyv(dy.data(), {rows, cols});
  nn::detail::layer_norm_forward<float, float>(xv, {o.ln_y.data(), {rows, cols}}, w.data(),
                                               b.data(), 1e-5f, o.ln_stats.data(), cols);
  nn::detail::layer_norm_backward<float, float>(xv, dyv, {o.ln_dx.data(), {rows, cols}}, w.data(),
                                                o.ln_stats.data(), acc.data(), o.ln_dw.data(),
                                                o.ln_db.data(), cols);
  nn::dropout<float> drop("blocks.0.drop", cols, 0.3);
  nn::layer_context ctx;
  ctx.batch = rows;
  ctx.seed = st::test::seed();
  ctx.step = 3;
  ctx.first_row = 40;
  nn::dropout<float>::saved_type saved;
  o.drop_y.resize(rows * cols);
  o.drop_dx.resize(rows * cols);
  drop.forward(ctx, xv, {o.drop_y.data(), {rows, cols}}, saved);
  drop.backward(ctx, xv, saved, dyv, {o.drop_dx.data(), {rows, cols}});
  o.mask.assign(saved.mask.data(), saved.mask.data() + rows * cols);
  o.residual = x;
  nn::detail::residual_add<float>(st::tensor_view<float>(o.residual.data(), {rows, cols}), dyv);
  return o;
}

template <class T>
bool same_bits(std::vector<T> const& a, std::vector<T> const& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

// Column sums of v (rows x cols) with one partial a thread, rows split evenly over `threads`
// (an OpenMP-style reduction): the split follows the thread count.
std::vector<float> sums_by_thread(std::vector<float> const& v, std::size_t rows, std::size_t cols,
                                  std::size_t threads) {
  std::vector<float> part(threads * cols, 0.0f), out(cols, 0.0f);
  for (std::size_t t = 0; t < threads; ++t)
    for (std::size_t r = t * rows / threads; r < (t + 1) * rows / threads; ++r)
      for (std::size_t j = 0; j < cols; ++j)
        part[t * cols + j] += v[r * cols + j];
  for (std::size_t t = 0; t < threads; ++t)
    for (std::size_t j = 0; j < cols; ++j)
      out[j] += part[t * cols + j];
  return out;
}

} // namespace

TEST_CASE("layer norm, dropout and the residual add give the same bits with 1, 2 and 3 threads; "
          "sums split by the thread count do not",
          "[threads]") {
  std::size_t const rows = 300, cols = 520; // 9 row blocks (split_rows)
  REQUIRE(st::split_rows(rows, cols).count == 9);
  row_outputs const one = row_kernels(rows, cols, 1);
  for (std::size_t threads : {2u, 3u}) {
    INFO(threads << " threads");
    row_outputs const t = row_kernels(rows, cols, threads);
    CHECK(same_bits(one.ln_y, t.ln_y));
    CHECK(same_bits(one.ln_stats, t.ln_stats));
    CHECK(same_bits(one.ln_dx, t.ln_dx));
    CHECK(same_bits(one.ln_dw, t.ln_dw));
    CHECK(same_bits(one.ln_db, t.ln_db));
    CHECK(same_bits(one.mask, t.mask));
    CHECK(same_bits(one.drop_y, t.drop_y));
    CHECK(same_bits(one.drop_dx, t.drop_dx));
    CHECK(same_bits(one.residual, t.residual));
  }
  // The gradients' sums are sums: the bias gradient is db0 + the column sums of dy, within
  // rounding of the sum in double.
  auto const dy = random_values<float>(rows * cols, st::test::seed() + 12);
  double worst = 0;
  for (std::size_t j = 0; j < cols; ++j) {
    double s = -0.5;
    for (std::size_t r = 0; r < rows; ++r)
      s += static_cast<double>(dy[r * cols + j]);
    worst = std::max(worst, std::abs(s - static_cast<double>(one.ln_db[j])));
  }
  CHECK(worst < 1e-4);
  // The fault the fixed blocks prevent: partials per thread give other bits with 2 threads
  // than with 1, and the comparison above would catch it.
  CHECK_FALSE(same_bits(sums_by_thread(dy, rows, cols, 1), sums_by_thread(dy, rows, cols, 2)));
}

namespace {

st::models::gpt_model<float> const dropout_gpt{{.vocab = 40,
                                                .seq = 16,
                                                .features = 32,
                                                .heads = 4,
                                                .layers = 2,
                                                .dropout = 0.1,
                                                .attn_dropout = 0.1,
                                                .embd_dropout = 0.1}};

// Every parameter value of a trainer, in its order.
template <class Trainer>
std::vector<float> all_values(Trainer& t) {
  std::vector<float> v;
  t.for_each_parameter([&](auto& p) {
    for (auto x : p.values())
      v.push_back(static_cast<float>(x));
  });
  return v;
}

template <class Plan>
std::vector<float> train_on_mesh(st::comm::mesh_shape shape, int world, std::size_t threads,
                                 std::vector<double>& losses) {
  std::uint64_t const seed = st::test::seed();
  auto const data = st::test::make_parity_data(dropout_gpt, {.sequences = 8, .seq = 16}, seed);
  std::vector<float> out;
  std::vector<std::vector<double>> rank_losses(static_cast<std::size_t>(world));
  st::comm::local::run(world, [&](st::comm::local::communicator& c) {
    st::comm::mesh mesh(c, shape);
    st::trainer<st::models::gpt_model<float>, Plan> t(
        mesh, dropout_gpt, eng::use<st::optim::adamw<float>>({}),
        {.lr = st::test::constant_lr(0.01), .seed = seed, .threads = threads});
    REQUIRE(t.threads() == threads);
    std::size_t const per = 8 / static_cast<std::size_t>(mesh.shape().dp);
    for (int step = 0; step < 3; ++step) {
      auto const mine = data.slice(static_cast<std::size_t>(mesh.coords().dp) * per, per, 16, 0);
      rank_losses[static_cast<std::size_t>(c.rank())].push_back(t.step(mine).loss);
    }
    if (c.rank() == 0)
      out = all_values(t);
  });
  losses = rank_losses[0];
  return out;
}

} // namespace

TEST_CASE("training gives the same bits with 1 and 2 threads per rank", "[threads][parity]") {
  std::uint64_t const seed = st::test::seed();
  auto const data = st::test::make_parity_data(dropout_gpt, {.sequences = 8, .seq = 16}, seed);
  auto run_one = [&](std::size_t threads, std::vector<double>& losses) {
    st::trainer<st::models::gpt_model<float>> t(
        dropout_gpt, eng::use<st::optim::adamw<float>>({}),
        {.lr = st::test::constant_lr(0.01), .seed = seed, .threads = threads});
    REQUIRE(t.threads() == threads);
    for (int step = 0; step < 3; ++step)
      losses.push_back(t.step(data.view(8, 16)).loss);
    return all_values(t);
  };
  std::vector<double> l1, l2;
  auto const p1 = run_one(1, l1);
  auto const p2 = run_one(2, l2);
  CHECK(l1 == l2);
  REQUIRE(p1.size() == p2.size());
  CHECK(std::memcmp(p1.data(), p2.data(), p1.size() * sizeof(float)) == 0);
  CHECK(l1.front() != l1.back()); // it trained

  SECTION("data parallel, 2 ranks") {
    std::vector<double> a, b;
    auto const q1 = train_on_mesh<st::plan<st::data_parallel<>>>({.dp = 2}, 2, 1, a);
    auto const q2 = train_on_mesh<st::plan<st::data_parallel<>>>({.dp = 2}, 2, 2, b);
    CHECK(a == b);
    REQUIRE(q1.size() == q2.size());
    CHECK(std::memcmp(q1.data(), q2.data(), q1.size() * sizeof(float)) == 0);
  }
  SECTION("tensor parallel, 2 ranks") {
    std::vector<double> a, b;
    auto const q1 = train_on_mesh<st::plan<st::tensor_parallel<>>>({.tp = 2}, 2, 1, a);
    auto const q2 = train_on_mesh<st::plan<st::tensor_parallel<>>>({.tp = 2}, 2, 2, b);
    CHECK(a == b);
    REQUIRE(q1.size() == q2.size());
    CHECK(std::memcmp(q1.data(), q2.data(), q1.size() * sizeof(float)) == 0);
  }
}
