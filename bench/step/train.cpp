// strata_bench_step, training steps on one rank: the MLP step under strata's trainer beside the
// same step written plainly with Eigen (ratio = strata time / Eigen time, goal <= 1.05), and a
// GPT step with its forward/backward/optimizer split. Single-threaded, f32.
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

std::unique_ptr<mlp_trainer> make_mlp_trainer() {
  return std::make_unique<mlp_trainer>(
      mlp, st::engine::use<st::optim::sgd<float>>({.momentum = mlp_momentum}),
      st::trainer_options{.lr = st::optim::constant_schedule(mlp_lr), .seed = mlp_seed});
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
  auto t = make_mlp_trainer();
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

void gpt_step(benchmark::State& state) {
  st::models::gpt_config const c{.vocab = 256, .seq = 64, .features = 128, .heads = 4, .layers = 8};
  std::size_t const sequences = 8, rows = sequences * c.seq;
  st::models::gpt_model<float> const gpt{c};
  st::trainer<st::models::gpt_model<float>> t(
      gpt, st::engine::use<st::optim::adamw<float>>({}),
      {.lr = st::optim::constant_schedule(3e-4), .seed = 11});
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
  state.counters["step_ms"] = per_step * 1e3;
  state.counters["tokens/s"] = static_cast<double>(rows) / per_step;
  state.counters["fwd_ms"] = fwd / n * 1e3;
  state.counters["bwd_ms"] = bwd / n * 1e3;
  state.counters["opt_ms"] = opt / n * 1e3;
  state.counters["peak_MiB"] = to_mib(t.ledger().peak());
}

// Registered before main runs; Eigen's MLP step first, so strata's can report the ratio.
[[maybe_unused]] bool const train_registered = [] {
  benchmark::RegisterBenchmark("BM_mlp_step/eigen", mlp_step_eigen)->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("BM_mlp_step/strata", mlp_step_strata)
      ->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("BM_gpt_step", gpt_step)->Unit(benchmark::kMillisecond);
  return true;
}();

} // namespace
