// strata_calibrate: measures what the planner's time estimate needs of this machine — the
// sustained GEMM rate of one rank and the bus bandwidth of an all-reduce between ranks — and
// writes it as a machine profile (strata::machine_profile, plan/time.hpp).
//
//   strata_calibrate [--out FILE] [--threads N] [--gemm M,N,K] [--mib S] [--ranks R]
//                    [--busbw-inter B] [--devices-per-node N]
//
// The GEMM rate is the best of five timed runs of strata's GEMM (OpenBLAS's where linked) on
// M x N x K (default 1024 x 1024 x 1024) f32 products on N threads. The bus bandwidth is the
// best of five all-reduces of S MiB (default 16) f32 over R in-process ranks (default 2; the
// local backend, ranks as threads), as nccl-tests computes busbw: 2 (R - 1) / R x bytes / time.
// It is measured within one process, so it stands for within a node; --busbw-inter gives the
// across-node figure (default: the same). A GPU's or a network's figures come from
// strata_bench_comm on that machine (its busbw column), given with --busbw-intra/--busbw-inter.
#include <strata/comm/local.hpp>
#include <strata/core/thread_pool.hpp>
#include <strata/nn/detail/gemm.hpp>
#include <strata/plan/time.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

namespace st = strata;

namespace {

[[noreturn]] void usage(std::string const& why) {
  std::fprintf(stderr,
               "strata_calibrate: %s\nusage: strata_calibrate [--out FILE] [--threads N] "
               "[--gemm M,N,K] [--mib S] [--ranks R] [--busbw-intra B] [--busbw-inter B] "
               "[--devices-per-node N]\n",
               why.c_str());
  std::exit(2);
}

template <class F>
double best_seconds(F&& f, int runs = 5) {
  f(); // warm
  double best = 1e30;
  for (int r = 0; r < runs; ++r) {
    auto const t0 = std::chrono::steady_clock::now();
    f();
    best = std::min(best,
                    std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return best;
}

} // namespace

int main(int argc, char** argv) try {
  std::string out = "strata_machine.txt";
  std::size_t threads = 1, m = 1024, n = 1024, k = 1024, mib = 16;
  int ranks = 2, per_node = 8;
  double intra_given = 0, inter_given = 0;
  for (int i = 1; i < argc; ++i) {
    std::string const a = argv[i];
    if (i + 1 >= argc)
      usage("option " + a + " needs a value");
    std::string const v = argv[++i];
    auto number = [&] {
      char* end = nullptr;
      double const x = std::strtod(v.c_str(), &end);
      if (end == v.c_str() || *end != '\0' || !(x > 0))
        usage("option " + a + " takes a number > 0, got \"" + v + "\"");
      return x;
    };
    if (a == "--out")
      out = v;
    else if (a == "--threads")
      threads = static_cast<std::size_t>(number());
    else if (a == "--mib")
      mib = static_cast<std::size_t>(number());
    else if (a == "--ranks")
      ranks = static_cast<int>(number());
    else if (a == "--devices-per-node")
      per_node = static_cast<int>(number());
    else if (a == "--busbw-intra")
      intra_given = number();
    else if (a == "--busbw-inter")
      inter_given = number();
    else if (a == "--gemm") {
      if (std::sscanf(v.c_str(), "%zu,%zu,%zu", &m, &n, &k) != 3 || !m || !n || !k)
        usage("--gemm takes M,N,K, got \"" + v + "\"");
    } else
      usage("unknown option " + a);
  }
  if (ranks < 2)
    usage("--ranks takes at least 2");

  std::vector<float> a(m * k, 0.5f), b(n * k, 0.25f), c(m * n);
  st::thread_pool pool(threads);
  double gemm = 0;
  {
    st::pool_scope scope(threads > 1 ? &pool : nullptr);
    gemm = best_seconds([&] {
      st::nn::detail::gemm<float>(m, n, k, a.data(), k, 1, b.data(), 1, k, c.data(), n, false);
    });
  }
  double const rate = 2.0 * static_cast<double>(m * n * k) / gemm;

  double busbw = intra_given;
  if (busbw == 0) {
    std::size_t const count = (mib << 20) / sizeof(float);
    std::vector<double> seconds(static_cast<std::size_t>(ranks));
    st::comm::local::run(ranks, [&](st::comm::local::communicator& w) {
      std::vector<float> buf(count, 1.0f);
      seconds[static_cast<std::size_t>(w.rank())] =
          best_seconds([&] { w.all_reduce(std::span<float>(buf), st::comm::reduce_op::sum); });
    });
    double const t = *std::max_element(seconds.begin(), seconds.end());
    busbw = 2.0 * (ranks - 1) / ranks * static_cast<double>(count * sizeof(float)) / t;
  }
  st::machine_profile p;
  p.flops_per_second = rate;
  p.busbw_intra = busbw;
  p.busbw_inter = inter_given > 0 ? inter_given : busbw;
  p.devices_per_node = per_node;
  char source[256];
  std::snprintf(source, sizeof source,
                "strata_calibrate: gemm %zux%zux%zu f32 on %zu threads; all_reduce %zu MiB f32 "
                "over %d in-process ranks%s",
                m, n, k, threads, mib, ranks, intra_given > 0 ? " (busbw given)" : "");
  p.source = source;
  p.write(out);
  std::printf("%swritten to %s\n", p.text().c_str(), out.c_str());
  return 0;
} catch (std::exception const& e) {
  std::fprintf(stderr, "strata_calibrate: %s\n", e.what());
  return 1;
}
