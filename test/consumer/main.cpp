// A user's program built against the installed strata package with plain -O2 (no -march):
// 4 thread-ranks all-reduce, and the linear layer's forward and backward at GFLOP/s beside the
// GEMM it runs on (OpenBLAS's sgemm when the package brings it), reported for CI's log.
#include <strata/strata.hpp>

#include <chrono>
#include <cstdio>
#include <vector>

namespace {

template <class F>
double best_seconds(F&& f) {
  f(); // warm-up: packing buffers, first touch
  double best = 1e30;
  for (int r = 0; r < 5; ++r) {
    auto const t0 = std::chrono::steady_clock::now();
    int it = 0;
    double el = 0;
    do {
      f();
      ++it;
      el = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    } while (el < 0.05);
    best = std::min(best, el / it);
  }
  return best;
}

// The MLP benchmark's shape: 64 rows, 1024 -> 1024; one thread (the figure per core).
int linear_speed() {
  namespace nn = strata::nn;
  constexpr std::size_t rows = 64, in = 1024, out = 1024;
  nn::linear<float> l("fc", in, out);
  nn::init_parameters(l, 1);
  nn::layer_context ctx;
  ctx.seq = rows;
  std::vector<float> x(rows * in, 0.5f), y(rows * out), dy(rows * out, 0.25f), dx(rows * in);
  nn::linear<float>::saved_type saved;
  double const fl = 2.0 * rows * in * out;
  double const fwd = best_seconds([&] {
    l.forward(ctx, {x.data(), {rows, in}}, {y.data(), {rows, out}}, saved);
  });
  double const bwd = best_seconds([&] {
    l.backward(ctx, {x.data(), {rows, in}}, saved, {dy.data(), {rows, out}},
               {dx.data(), {rows, in}});
  });
  // The product alone, through the same GEMM entry the layer uses (y = x W^T).
  std::vector<float> w(out * in, 0.1f);
  double const gemm = best_seconds([&] {
    nn::detail::gemm<float>(rows, out, in, x.data(), in, 1, w.data(), 1, in, y.data(), out, false);
  });
  double const gf = fl / gemm * 1e-9, ff = fl / fwd * 1e-9, bf = 2 * fl / bwd * 1e-9;
  std::printf("strata consumer: isa %s, gemm %s; 64 x 1024 x 1024: gemm %.1f GFLOP/s, linear "
              "forward %.1f (%.2f of it), backward %.1f (%.2f)\n",
              strata::isa_name(strata::host_isa()), nn::detail::gemm_backend(), gf, ff, ff / gf, bf,
              bf / gf);
  return 0;
}

} // namespace

int main() {
  namespace sc = strata::comm;
  int failures = 0;
  sc::local::run(4, [&](sc::local::communicator& c) {
    std::vector<double> v(1000);
    for (std::size_t i = 0; i < v.size(); ++i)
      v[i] = static_cast<double>(c.rank() * 1000 + i);
    c.all_reduce(std::span<double>(v), sc::reduce_op::sum);
    for (std::size_t i = 0; i < v.size(); ++i)
      if (v[i] != static_cast<double>(6000 + 4 * i))
        ++failures; // 0+1+2+3 = 6
  });
  std::printf("strata consumer: %s\n", failures ? "wrong results" : "ok");
  linear_speed();
  return failures ? 1 : 0;
}
