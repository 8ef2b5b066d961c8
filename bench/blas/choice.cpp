// Which BLAS strata's host GEMM should call: OpenBLAS's sgemm, BLIS's and Eigen's product (this
// build's -march), one thread each, on the MLP and GPT benchmarks' shapes, in one process. Not
// linked to strata (BLIS and OpenBLAS both export cblas_* symbols): strata_bench_blas_blis links
// BLIS, strata_bench_blas_openblas OpenBLAS; each prints GFLOP/s beside Eigen's.
#include <Eigen/Core>

#include <algorithm>
#include <chrono>
#include <cstdio>

#if defined(CHOICE_BLIS)
#include <blis.h>
#define CHOICE_NAME "blis"
#else
#include <cblas.h>
#define CHOICE_NAME "openblas"
#endif

namespace {

using matrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

template <class F>
double gflops(F&& f, double flops) {
  f();
  double best = 1e30;
  for (int r = 0; r < 7; ++r) {
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
  return flops / best * 1e-9;
}

struct shape {
  int m, n, k;
  bool ta, tb;
  char const* name;
};

} // namespace

int main() {
#if defined(CHOICE_BLIS)
  bli_thread_set_num_threads(1);
#else
  openblas_set_num_threads(1);
#endif
  shape const shapes[] = {{64, 1024, 1024, false, true, "MLP forward x W^T"},
                          {1024, 1024, 64, true, false, "MLP dW = dy^T x"},
                          {64, 1024, 1024, false, false, "MLP dx = dy W"},
                          {512, 384, 128, false, true, "GPT qkv"},
                          {512, 512, 128, false, true, "GPT fc"},
                          {512, 128, 512, false, true, "GPT fc proj"},
                          {384, 128, 512, true, false, "GPT dW qkv"},
                          {512, 256, 128, false, true, "GPT head"}};
  std::printf("%-18s %5s %5s %5s %14s %14s\n", "shape", "m", "n", "k", "eigen GFLOP/s",
              CHOICE_NAME " GFLOP/s");
  for (shape const s : shapes) {
    matrix a = matrix::Random(s.ta ? s.k : s.m, s.ta ? s.m : s.k);
    matrix b = matrix::Random(s.tb ? s.n : s.k, s.tb ? s.k : s.n);
    matrix c(s.m, s.n);
    double const fl = 2.0 * s.m * s.n * s.k;
    double const e = gflops(
        [&] {
          if (s.ta)
            c.noalias() = a.transpose() * b;
          else if (s.tb)
            c.noalias() = a * b.transpose();
          else
            c.noalias() = a * b;
        },
        fl);
#if defined(CHOICE_BLIS)
    float one = 1, zero = 0;
    double const x = gflops(
        [&] {
          bli_sgemm(s.ta ? BLIS_TRANSPOSE : BLIS_NO_TRANSPOSE,
                    s.tb ? BLIS_TRANSPOSE : BLIS_NO_TRANSPOSE, s.m, s.n, s.k, &one, a.data(),
                    a.cols(), 1, b.data(), b.cols(), 1, &zero, c.data(), s.n, 1);
        },
        fl);
#else
    double const x = gflops(
        [&] {
          cblas_sgemm(CblasRowMajor, s.ta ? CblasTrans : CblasNoTrans,
                      s.tb ? CblasTrans : CblasNoTrans, s.m, s.n, s.k, 1.0f, a.data(),
                      static_cast<int>(a.cols()), b.data(), static_cast<int>(b.cols()), 0.0f,
                      c.data(), s.n);
        },
        fl);
#endif
    std::printf("%-18s %5d %5d %5d %14.1f %14.1f\n", s.name, s.m, s.n, s.k, e, x);
  }
}
