// strata_bench_step, training steps on one rank: the MLP step under strata's trainer beside the
// same step written plainly with Eigen (ratio = strata time / Eigen time, goal <= 1.1, both on
// one thread), and a GPT step with its forward/backward/optimizer split and its time against the
// FLOP limit at the GEMM rate measured in the same run, on 1 and 2 threads. f32.
#include <strata/models/gpt.hpp>
#include <strata/models/mlp.hpp>
#include <strata/optim/adamw.hpp>
#include <strata/optim/schedule.hpp>
#include <strata/optim/sgd.hpp>
#include <strata/train/trainer.hpp>

#include <Eigen/Core>
#include <benchmark/benchmark.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

namespace {

namespace st = strata;
using matrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using row_vector = Eigen::Matrix<float, 1, Eigen::Dynamic>;
using col_vector = Eigen::Matrix<float, Eigen::Dynamic, 1>;

// ---- the MLP step ------------------------------------------------------------------------------

constexpr std::size_t mlp_features = 1024, mlp_width = 1024, mlp_depth = 4, mlp_classes = 1024;
constexpr std::size_t mlp_batch = 64;
constexpr double mlp_lr = 1e-2, mlp_momentum = 0.9;
constexpr std::uint64_t mlp_seed = 7;
constexpr int warmup_steps = 2;

st::models::mlp_model<float> const mlp{mlp_features, mlp_width, mlp_depth, mlp_classes};

// Random inputs in [-1, 1) and targets, the same for both benchmarks.
struct mlp_data {
  std::vector<float> x;
  std::vector<std::int32_t> y;
  mlp_data() : x(mlp_batch * mlp_features), y(mlp_batch) {
    std::mt19937 g(1234);
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    for (float& v : x)
      v = u(g);
    std::uniform_int_distribution<std::int32_t> c(0, static_cast<std::int32_t>(mlp_classes) - 1);
    for (auto& t : y)
      t = c(g);
  }
  st::engine::batch_view<float> view() const { return {mlp_batch, 1, {}, x, y}; }
};

mlp_data const& data() {
  static mlp_data const d;
  return d;
}

using mlp_trainer = st::trainer<st::models::mlp_model<float>>;

std::unique_ptr<mlp_trainer> make_mlp_trainer(std::size_t threads = 1) {
  return std::make_unique<mlp_trainer>(
      mlp, st::engine::use<st::optim::sgd<float>>({.momentum = mlp_momentum}),
      st::trainer_options{
          .lr = st::optim::constant_schedule(mlp_lr), .seed = mlp_seed, .threads = threads});
}

// The step written plainly with Eigen: forward (linear + bias, tanh-GELU between), softmax
// cross-entropy (mean over rows), backward (dW, db, and dx except for the first layer), SGD
// with momentum as torch.optim.SGD (buf = g on the first step, then buf = mu buf + g;
// p -= lr buf). Every buffer is allocated here; step() allocates nothing itself (Eigen's GEMM
// takes its packing blocks from the heap for these sizes, 11 a step, as for any caller).
struct eigen_mlp {
  static constexpr float k = 0.7978845608028654f, a = 0.044715f;
  std::array<matrix, mlp_depth> w, dw, w_buf;
  std::array<row_vector, mlp_depth> b, db, b_buf;
  std::array<matrix, mlp_depth> z;     // pre-activation outputs; z[depth-1] are the logits
  std::array<matrix, mlp_depth - 1> h; // gelu(z[i])
  std::array<matrix, mlp_depth> dz;    // d loss / d z[i]
  matrix dh;                           // d loss / d h[i], reused layer by layer
  col_vector row_max, row_sum;
  std::int64_t steps = 0;
  double seconds_forward = 0, seconds_backward = 0, seconds_optimizer = 0;

  explicit eigen_mlp(mlp_trainer& t) {
    auto const rows = static_cast<Eigen::Index>(mlp_batch);
    for (std::size_t i = 0; i < mlp_depth; ++i) {
      auto const in = static_cast<Eigen::Index>(i == 0 ? mlp_features : mlp_width);
      auto const out = static_cast<Eigen::Index>(i + 1 == mlp_depth ? mlp_classes : mlp_width);
      std::string const name = "fc" + std::to_string(i);
      auto* pw = t.find_parameter(name + ".weight");
      auto* pb = t.find_parameter(name + ".bias");
      w[i] = Eigen::Map<matrix const>(pw->values().data(), out, in);
      b[i] = Eigen::Map<row_vector const>(pb->values().data(), out);
      dw[i] = matrix::Zero(out, in);
      w_buf[i] = matrix::Zero(out, in);
      db[i] = row_vector::Zero(out);
      b_buf[i] = row_vector::Zero(out);
      z[i] = matrix::Zero(rows, out);
      dz[i] = matrix::Zero(rows, out);
      if (i + 1 < mlp_depth)
        h[i] = matrix::Zero(rows, out);
    }
    dh = matrix::Zero(rows, static_cast<Eigen::Index>(mlp_width));
    row_max = col_vector::Zero(rows);
    row_sum = col_vector::Zero(rows);
  }

  // One step; returns the loss (before the update).
  double step(float const* x_data, std::int32_t const* targets, float lr, float momentum) {
    using clock = std::chrono::steady_clock;
    auto const rows = static_cast<Eigen::Index>(mlp_batch);
    Eigen::Map<matrix const> x(x_data, rows, static_cast<Eigen::Index>(mlp_features));
    auto const t0 = clock::now();
    // forward
    for (std::size_t i = 0; i < mlp_depth; ++i) {
      if (i == 0)
        z[i].noalias() = x * w[i].transpose();
      else
        z[i].noalias() = h[i - 1] * w[i].transpose();
      z[i].rowwise() += b[i];
      if (i + 1 < mlp_depth) {
        auto const zz = z[i].array();
        h[i].array() = 0.5f * zz * (1.0f + (k * (zz + a * zz * zz * zz)).tanh());
      }
    }
    // loss and d loss / d logits
    matrix& logits = z[mlp_depth - 1];
    matrix& dlogits = dz[mlp_depth - 1];
    row_max.noalias() = logits.rowwise().maxCoeff();
    dlogits.array() = (logits.array().colwise() - row_max.array()).exp();
    row_sum.noalias() = dlogits.rowwise().sum();
    double total = 0;
    for (Eigen::Index r = 0; r < rows; ++r)
      total += double(row_max(r) + std::log(row_sum(r)) - logits(r, targets[r]));
    float const inv_rows = 1.0f / static_cast<float>(rows);
    for (Eigen::Index r = 0; r < rows; ++r) { // (a colwise() product would allocate)
      dlogits.row(r) *= inv_rows / row_sum(r);
      dlogits(r, targets[r]) -= inv_rows;
    }
    auto const t1 = clock::now();
    // backward
    for (std::size_t i = mlp_depth; i-- > 0;) {
      if (i == 0)
        dw[i].noalias() = dz[i].transpose() * x;
      else
        dw[i].noalias() = dz[i].transpose() * h[i - 1];
      db[i].noalias() = dz[i].colwise().sum();
      if (i > 0) {
        dh.noalias() = dz[i] * w[i];
        auto const zz = z[i - 1].array();
        auto const t = (k * (zz + a * zz * zz * zz)).tanh();
        dz[i - 1].array() = dh.array() * (0.5f * (1.0f + t) + 0.5f * zz * (1.0f - t * t) * k *
                                                                  (1.0f + 3.0f * a * zz * zz));
      }
    }
    auto const t2 = clock::now();
    // SGD with momentum
    ++steps;
    for (std::size_t i = 0; i < mlp_depth; ++i) {
      if (steps == 1) {
        w_buf[i] = dw[i];
        b_buf[i] = db[i];
      } else {
        w_buf[i] = momentum * w_buf[i] + dw[i];
        b_buf[i] = momentum * b_buf[i] + db[i];
      }
      w[i] -= lr * w_buf[i];
      b[i] -= lr * b_buf[i];
    }
    auto const t3 = clock::now();
    seconds_forward += std::chrono::duration<double>(t1 - t0).count();
    seconds_backward += std::chrono::duration<double>(t2 - t1).count();
    seconds_optimizer += std::chrono::duration<double>(t3 - t2).count();
    return total / static_cast<double>(rows);
  }
};

// The largest |a - b| over the largest |b|.
double relative_difference(float const* a, float const* b, std::size_t n) {
  double diff = 0, scale = 0;
  for (std::size_t i = 0; i < n; ++i) {
    diff = std::max(diff, std::abs(double(a[i]) - double(b[i])));
    scale = std::max(scale, std::abs(double(b[i])));
  }
  return scale > 0 ? diff / scale : diff;
}

// Eigen's seconds per step and iterations, one entry per run (Google Benchmark's trial runs
// included), measured before strata's.
std::vector<std::pair<double, benchmark::IterationCount>>& eigen_seconds() {
  static std::vector<std::pair<double, benchmark::IterationCount>> v;
  return v;
}

// The median over the runs with the most iterations (the repetitions, not the trial runs).
double eigen_median() {
  auto const& all = eigen_seconds();
  benchmark::IterationCount most = 0;
  for (auto const& e : all)
    most = std::max(most, e.second);
  std::vector<double> v;
  for (auto const& e : all)
    if (e.second == most)
      v.push_back(e.first);
  std::sort(v.begin(), v.end());
  std::size_t const n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

double to_mib(std::size_t bytes) {
  return static_cast<double>(bytes) / (1024.0 * 1024.0);
}

void mlp_step_eigen(benchmark::State& state) {
  auto const& d = data();
  double peak_mib = 0, loss_diff = 0, grad_diff = 0;
  auto net = [&] {
    // Start from strata's initial parameters; check the first step against strata's.
    auto t = make_mlp_trainer();
    auto n = std::make_unique<eigen_mlp>(*t);
    double const strata_loss = t->step(d.view()).loss;
    double const eigen_loss = n->step(d.x.data(), d.y.data(), static_cast<float>(mlp_lr),
                                      static_cast<float>(mlp_momentum));
    std::string error;
    loss_diff = std::abs(eigen_loss - strata_loss) / std::abs(strata_loss);
    if (!(loss_diff <= 1e-4))
      error = "first-step loss: Eigen " + std::to_string(eigen_loss) + ", strata " +
              std::to_string(strata_loss);
    for (std::size_t i = 0; i < mlp_depth && error.empty(); ++i) {
      std::string const name = "fc" + std::to_string(i);
      auto* gw = t->find_parameter(name + ".weight");
      auto* gb = t->find_parameter(name + ".bias");
      double const ew = relative_difference(n->dw[i].data(), gw->grads().data(), gw->size());
      double const eb = relative_difference(n->db[i].data(), gb->grads().data(), gb->size());
      grad_diff = std::max({grad_diff, ew, eb});
      if (!(ew <= 1e-3 && eb <= 1e-3))
        error = "first-step gradients of " + name + ": relative difference " +
                std::to_string(std::max(ew, eb));
    }
    peak_mib = to_mib(t->ledger().peak());
    if (!error.empty()) {
      state.SkipWithError(error.c_str());
      n.reset();
    }
    return n;
  }();
  if (!net)
    return;
  auto const lr = static_cast<float>(mlp_lr), mu = static_cast<float>(mlp_momentum);
  for (int i = 0; i < warmup_steps; ++i)
    net->step(d.x.data(), d.y.data(), lr, mu);
  net->seconds_forward = net->seconds_backward = net->seconds_optimizer = 0;
  double seconds = 0;
  for (auto _ : state) {
    auto const t0 = std::chrono::steady_clock::now();
    double const loss = net->step(d.x.data(), d.y.data(), lr, mu);
    seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    benchmark::DoNotOptimize(loss);
  }
  double const n = static_cast<double>(state.iterations());
  double const per_step = seconds / n;
  eigen_seconds().emplace_back(per_step, state.iterations());
  state.counters["step_ms"] = per_step * 1e3;
  state.counters["samples/s"] = static_cast<double>(mlp_batch) / per_step;
  state.counters["fwd_ms"] = net->seconds_forward / n * 1e3;
  state.counters["bwd_ms"] = net->seconds_backward / n * 1e3;
  state.counters["opt_ms"] = net->seconds_optimizer / n * 1e3;
  state.counters["peak_MiB"] = peak_mib; // strata's ledger for the same model, for reference
  // The first-step check: relative differences of the loss and of the gradients to strata's.
  state.counters["loss_diff"] = loss_diff;
  state.counters["grad_diff"] = grad_diff;
}

void mlp_step_strata(benchmark::State& state) {
  auto const& d = data();
  auto t = make_mlp_trainer(static_cast<std::size_t>(state.range(0)));
  auto const batch = d.view();
  for (int i = 0; i < warmup_steps; ++i)
    t->step(batch);
  double seconds = 0, fwd = 0, bwd = 0, opt = 0, traced = 0;
  for (auto _ : state) {
    auto const t0 = std::chrono::steady_clock::now();
    st::step_result const r = t->step(batch);
    seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    fwd += r.forward;
    bwd += r.backward;
    opt += r.optimizer;
    traced += r.seconds;
  }
  double const n = static_cast<double>(state.iterations());
  double const per_step = seconds / n;
  state.counters["step_ms"] = per_step * 1e3;
  state.counters["samples/s"] = static_cast<double>(mlp_batch) / per_step;
  state.counters["fwd_ms"] = fwd / n * 1e3;
  state.counters["bwd_ms"] = bwd / n * 1e3;
  state.counters["opt_ms"] = opt / n * 1e3;
  state.counters["other_ms"] = (traced - fwd - bwd - opt) / n * 1e3; // zero_grad, the trace
  state.counters["peak_MiB"] = to_mib(t->ledger().peak());
  if (!eigen_seconds().empty())
    state.counters["ratio"] = per_step / eigen_median();
}

// ---- the GPT step ------------------------------------------------------------------------------

// FLOPs of one GPT step in its products (forward 2 m n k each; backward twice the forward):
// per block qkv, the scores and the heads' outputs (the whole seq x seq, as the core computes
// them), proj, fc, fc's projection; then the head.
double gpt_step_flops(st::models::gpt_config const& c, std::size_t sequences) {
  double const rows = static_cast<double>(sequences * c.seq), d = static_cast<double>(c.features);
  double const s = static_cast<double>(c.seq), v = static_cast<double>(c.vocab);
  double const block = 2 * rows * d * (3 * d + d + 4 * d + 4 * d) + 2 * 2 * rows * s * d;
  double const forward = static_cast<double>(c.layers) * block + 2 * rows * d * v;
  return 3 * forward;
}

// The GEMM rate on this step's largest block product (512 x 512 x 128, fc), on `threads`
// threads: the best of strata's GEMM (OpenBLAS's when linked) and Eigen's (one thread).
double gemm_gflops(std::size_t threads) {
  std::size_t const m = 512, n = 512, k = 128;
  matrix a = matrix::Random(m, k), b = matrix::Random(n, k), out(m, n);
  st::thread_pool pool(threads);
  st::pool_scope scope(threads > 1 ? &pool : nullptr);
  auto best = [&](auto&& f) {
    f();
    double b_s = 1e30;
    for (int r = 0; r < 5; ++r) {
      auto const t0 = std::chrono::steady_clock::now();
      int it = 0;
      double el = 0;
      do {
        f();
        ++it;
        el = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      } while (el < 0.02);
      b_s = std::min(b_s, el / it);
    }
    return 2.0 * m * n * k / b_s * 1e-9;
  };
  double const ours = best([&] {
    st::nn::detail::gemm<float>(m, n, k, a.data(), k, 1, b.data(), 1, k, out.data(), n, false);
    benchmark::DoNotOptimize(out.data());
  });
  double const eigen = best([&] {
    out.noalias() = a * b.transpose();
    benchmark::DoNotOptimize(out.data());
  });
  return std::max(ours, eigen);
}

void gpt_step(benchmark::State& state) {
  std::size_t const threads = static_cast<std::size_t>(state.range(0));
  st::models::gpt_config const c{.vocab = 256, .seq = 64, .features = 128, .heads = 4, .layers = 8};
  std::size_t const sequences = 8, rows = sequences * c.seq;
  st::models::gpt_model<float> const gpt{c};
  st::trainer<st::models::gpt_model<float>> t(
      gpt, st::engine::use<st::optim::adamw<float>>({}),
      {.lr = st::optim::constant_schedule(3e-4), .seed = 11, .threads = threads});
  std::vector<std::int32_t> tokens(rows), targets(rows);
  std::mt19937 g(4321);
  std::uniform_int_distribution<std::int32_t> u(0, static_cast<std::int32_t>(c.vocab) - 1);
  for (std::size_t i = 0; i < rows; ++i) {
    tokens[i] = u(g);
    targets[i] = u(g);
  }
  st::engine::batch_view<float> const batch{sequences, c.seq, tokens, {}, targets};
  for (int i = 0; i < warmup_steps; ++i)
    t.step(batch);
  double const rate = gemm_gflops(threads);
  double seconds = 0, fwd = 0, bwd = 0, opt = 0;
  for (auto _ : state) {
    auto const t0 = std::chrono::steady_clock::now();
    st::step_result const r = t.step(batch);
    seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    fwd += r.forward;
    bwd += r.backward;
    opt += r.optimizer;
  }
  double const n = static_cast<double>(state.iterations());
  double const per_step = seconds / n;
  double const fl = gpt_step_flops(c, sequences);
  state.counters["step_ms"] = per_step * 1e3;
  state.counters["tokens/s"] = static_cast<double>(rows) / per_step;
  state.counters["fwd_ms"] = fwd / n * 1e3;
  state.counters["bwd_ms"] = bwd / n * 1e3;
  state.counters["opt_ms"] = opt / n * 1e3;
  state.counters["peak_MiB"] = to_mib(t.ledger().peak());
  state.counters["GFLOP"] = fl * 1e-9;
  state.counters["gemm_GFLOP/s"] = rate;
  state.counters["flop_limit_ms"] = fl / (rate * 1e9) * 1e3;
  state.counters["ratio_to_limit"] = per_step / (fl / (rate * 1e9));
  // The planner's time estimate of this step (its FLOPs over the GEMM rate measured above; one
  // rank, no communication) and its error against the measured step (no bound: docs/planner.md).
  auto const est = st::estimate_time(t.estimate(sequences, c.seq),
                                     {.flops_per_second = rate * 1e9, .busbw_intra = 1});
  state.counters["estimate_ms"] = est.total * 1e3;
  state.counters["estimate_error"] = per_step / est.total - 1;
  if (threads > 1) {
    // The speedup over one thread, paired: a one-thread trainer of the same model steps in turn
    // with this one, 9 pairs, the median of the pairs' ratios. (Two benchmarks run a minute
    // apart differ by 10-20% on a shared machine; steps taken in turn see the same machine.)
    st::trainer<st::models::gpt_model<float>> one(
        gpt, st::engine::use<st::optim::adamw<float>>({}),
        {.lr = st::optim::constant_schedule(3e-4), .seed = 11, .threads = 1});
    for (int i = 0; i < warmup_steps; ++i)
      one.step(batch);
    auto timed = [&](auto& tr) {
      auto const t0 = std::chrono::steady_clock::now();
      benchmark::DoNotOptimize(tr.step(batch));
      return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    };
    std::vector<double> ratios;
    for (int p = 0; p < 9; ++p) {
      double const t1 = timed(one);
      ratios.push_back(t1 / timed(t));
    }
    std::nth_element(ratios.begin(), ratios.begin() + 4, ratios.end());
    state.counters["speedup_vs_1"] = ratios[4];
  }
}

// Registered before main runs; Eigen's MLP step first, so strata's can report the ratio.
[[maybe_unused]] bool const train_registered = [] {
  benchmark::RegisterBenchmark("BM_mlp_step/eigen", mlp_step_eigen)->Unit(benchmark::kMillisecond);
  // threads:1 against Eigen (one thread); threads:2 uses both cores of this machine.
  benchmark::RegisterBenchmark("BM_mlp_step/strata", mlp_step_strata)
      ->ArgName("threads")
      ->Arg(1)
      ->Arg(2)
      ->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("BM_gpt_step", gpt_step)
      ->ArgName("threads")
      ->Arg(1)
      ->Arg(2)
      ->Unit(benchmark::kMillisecond);
  return true;
}();

} // namespace
