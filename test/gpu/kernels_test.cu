// The kernel functors on a CUDA device against the emulated device (called from kernels_test.cpp's
// main where a device is present): each kernel runs on both with the same random inputs, outputs
// poisoned with NaN first; the GPU's outputs equal the emulated ones bit for bit where the
// kernel's arithmetic is exact or IEEE's on both (index-space kernels, adds, the optimizers'
// unfused updates; this TU is built with -fmad=false, as the host with -ffp-contract=off), and
// within f32 1e-6 / f64 1e-13 / bf16 1e-2 relative per tensor where the device's libm (expf, erff,
// logf) differs from glibc's in the last bits. Row kernels run with lanes 1, 32, 256 and 1024 and
// must give the same bits on the GPU for every lanes count (the team contract on the device).
#include "../kernels/support.hpp"

#include <strata/core/cuda/context.hpp>
#include <strata/core/cuda/launch.cuh>
#include <strata/core/cuda_emulated/context.hpp>
#include <strata/core/cuda_emulated/launch.hpp>
#include <strata/core/float16.hpp>
#include <strata/core/random.hpp>
#include <strata/nn/kernels/attention.hpp>
#include <strata/nn/kernels/cross_entropy.hpp>
#include <strata/nn/kernels/dropout.hpp>
#include <strata/nn/kernels/elementwise.hpp>
#include <strata/nn/kernels/embedding.hpp>
#include <strata/nn/kernels/layer_norm.hpp>
#include <strata/optim/kernels/adamw.hpp>
#include <strata/optim/kernels/grad_norm.hpp>
#include <strata/optim/kernels/sgd.hpp>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

namespace {

namespace st = strata;
namespace stt = strata::test;
namespace nk = strata::nn::kernels;
namespace ok = strata::optim::kernels;
using bf16 = strata::bf16;

enum side { emu = 0, gpu = 1 };

// One context of each kind, fresh for each kernel (its buffers freed with it).
struct rig {
  st::emulated_context e;
  st::cuda_context g;
  rig() : e(options()), g(options()) {}
  static st::device_context_options options() {
    st::device_context_options o;
    o.gemm_workspace = 1u << 20;
    return o;
  }
};

// A tensor on both devices.
template <class T>
struct twin {
  T* p[2];
  std::size_t n;
  T* at(side s) const { return p[s]; }
};

template <class T>
twin<T> make_twin(rig& r, std::vector<T> const& init) {
  twin<T> t{{r.e.allocate<T>(st::memory_kind::workspace, init.size()),
             r.g.allocate<T>(st::memory_kind::workspace, init.size())},
            init.size()};
  r.e.copy_async(r.e.compute_stream(), t.p[emu], init.data(), init.size() * sizeof(T));
  r.g.copy_async(r.g.compute_stream(), t.p[gpu], init.data(), init.size() * sizeof(T));
  r.g.synchronize(r.g.compute_stream(), "inputs copied");
  return t;
}
template <class T>
twin<T> inputs(rig& r, std::size_t n, std::uint64_t key, double lo = -1.0, double hi = 1.0) {
  return make_twin(r, stt::random_values<T>(n, key, lo, hi));
}
template <class T>
std::vector<T> nan_vector(std::size_t n) {
  if constexpr (std::is_floating_point_v<T>)
    return std::vector<T>(n, std::numeric_limits<T>::quiet_NaN());
  else if constexpr (std::is_same_v<T, bf16>)
    return std::vector<T>(n, bf16(std::numeric_limits<float>::quiet_NaN()));
  else
    return std::vector<T>(n, static_cast<T>(0xA5)); // integers: a pattern no kernel writes
}
template <class T>
twin<T> outputs(rig& r, std::size_t n) {
  return make_twin(r, nan_vector<T>(n));
}
template <class T>
void repoison(rig& r, twin<T> const& t) {
  auto const v = nan_vector<T>(t.n);
  r.e.copy_async(r.e.compute_stream(), t.p[emu], v.data(), t.n * sizeof(T));
  r.g.copy_async(r.g.compute_stream(), t.p[gpu], v.data(), t.n * sizeof(T));
  r.g.synchronize(r.g.compute_stream(), "outputs poisoned");
}
template <class T>
std::vector<T> read(rig& r, twin<T> const& t, side s) {
  std::vector<T> v(t.n);
  if (s == emu) {
    r.e.copy_async(r.e.compute_stream(), v.data(), t.p[emu], t.n * sizeof(T));
    r.e.synchronize(r.e.compute_stream(), "read");
  } else {
    r.g.copy_async(r.g.compute_stream(), v.data(), t.p[gpu], t.n * sizeof(T));
    r.g.synchronize(r.g.compute_stream(), "read");
  }
  return v;
}

// Runs make(side)'s functor on both devices.
template <class Make>
void elements(rig& r, std::size_t n, Make const& make) {
  st::launch_elements(r.e, r.e.compute_stream(), n, make(emu));
  st::launch_elements(r.g, r.g.compute_stream(), n, make(gpu));
}
template <class Make>
void rows(rig& r, std::size_t nrows, unsigned lanes, Make const& make) {
  st::launch_rows(r.e, r.e.compute_stream(), nrows, lanes, make(emu));
  st::launch_rows(r.g, r.g.compute_stream(), nrows, lanes, make(gpu));
}

template <class T>
double as_double(T v) {
  if constexpr (std::is_same_v<T, bf16>)
    return static_cast<double>(static_cast<float>(v));
  else
    return static_cast<double>(v);
}

// The tolerance of a storage type where the kernel's math is not exact on both sides.
template <class T>
double tolerance() {
  if constexpr (std::is_same_v<T, double>)
    return 1e-13;
  else if constexpr (std::is_same_v<T, float>)
    return 1e-6;
  else
    return 1e-2;
}

int failures = 0;
int checks = 0;

// GPU against emulated: bit for bit (tol < 0) or within tol relative (||g - e|| / ||e||; NaN in
// the GPU's tensor where the emulated has none fails).
template <class T>
void compare(rig& r, twin<T> const& t, std::string const& what, double tol) {
  std::vector<T> const e = read(r, t, emu), g = read(r, t, gpu);
  ++checks;
  if (tol < 0) {
    if (std::memcmp(e.data(), g.data(), t.n * sizeof(T)) != 0) {
      std::size_t i = 0;
      while (i < t.n && std::memcmp(&e[i], &g[i], sizeof(T)) == 0)
        ++i;
      std::printf(
          "FAILED %s: not the emulated bits (first at %zu of %zu: gpu %.9g, emulated %.9g)\n",
          what.c_str(), i, t.n, as_double(g[i]), as_double(e[i]));
      ++failures;
    }
    return;
  }
  double d = 0, w = 0;
  bool nan_mismatch = false;
  for (std::size_t i = 0; i < t.n; ++i) {
    double const a = as_double(g[i]), b = as_double(e[i]);
    if (std::isnan(a) != std::isnan(b)) {
      nan_mismatch = true;
      continue;
    }
    if (std::isnan(a))
      continue;
    d += (a - b) * (a - b);
    w += b * b;
  }
  double const err = w == 0 ? std::sqrt(d) : std::sqrt(d / w);
  if (nan_mismatch || !(err <= tol)) {
    std::printf("FAILED %s: relative error %.3g > %.1g%s\n", what.c_str(), err, tol,
                nan_mismatch ? " (NaN where the other has none)" : "");
    ++failures;
  }
}

// The GPU's outputs for lanes L against its own for lanes 1: the same bits.
template <class T>
void same_on_gpu(std::vector<T> const& lanes1, std::vector<T> const& now, std::string const& what) {
  ++checks;
  if (lanes1.size() != now.size() ||
      std::memcmp(lanes1.data(), now.data(), now.size() * sizeof(T)) != 0) {
    std::printf("FAILED %s: the GPU's bits differ from its lanes-1 run\n", what.c_str());
    ++failures;
  }
}

std::string name(char const* kernel, char const* type, std::size_t width, unsigned lanes = 0) {
  std::string s = std::string(kernel) + " " + type + " width " + std::to_string(width);
  if (lanes != 0)
    s += " lanes " + std::to_string(lanes);
  return s;
}

template <class T>
char const* type_name() {
  if constexpr (std::is_same_v<T, double>)
    return "f64";
  else if constexpr (std::is_same_v<T, float>)
    return "f32";
  else
    return "bf16";
}

constexpr std::size_t row_count = 37; // not a multiple of a block's 8 warps

// ---- the team primitives themselves: sums and maxes of S slots, a for_each write ----------
template <unsigned S, class T>
struct team_probe {
  T const* x;
  T* out; // rows x (n + 2): the row scaled by its sum, then the sum and the max
  std::size_t n;
  template <class Team>
  STRATA_HD void operator()(Team& team, std::size_t row) const {
    T const* xr = x + row * n;
    std::size_t const nn = n;
    T const s = team.template sum<S, T>([=](unsigned slot) {
      T a{0};
      for (std::size_t j = slot; j < nn; j += S)
        a += xr[j];
      return a;
    });
    T const m = team.template max<S, T>([=](unsigned slot) {
      T a = -std::numeric_limits<T>::infinity();
      for (std::size_t j = slot; j < nn; j += S)
        a = (a != a || a > xr[j]) ? a : xr[j];
      return a;
    });
    T* o = out + row * (n + 2);
    team.for_each(nn, [=](std::size_t j) { o[j] = xr[j] * s; });
    team.for_each(1, [=](std::size_t) {
      o[nn] = s;
      o[nn + 1] = m;
    });
  }
};

template <unsigned S, class T>
void check_team(std::size_t n) {
  rig r;
  auto x = inputs<T>(r, row_count * n, 100 + S + n);
  auto out = outputs<T>(r, row_count * (n + 2));
  std::vector<T> first;
  for (unsigned lanes : stt::team_lanes) {
    repoison(r, out);
    rows(r, row_count, lanes, [&](side s) { return team_probe<S, T>{x.at(s), out.at(s), n}; });
    std::string const what =
        name(("team S=" + std::to_string(S)).c_str(), type_name<T>(), n, lanes);
    compare(r, out, what, -1);
    auto const g = read(r, out, gpu);
    if (first.empty())
      first = g;
    else
      same_on_gpu(first, g, what);
  }
}

// ---- element-wise kernels -------------------------------------------------------------------
template <class T>
void check_elementwise(std::size_t n) {
  char const* tn = type_name<T>();
  std::size_t const total = row_count * n;
  {
    rig r;
    auto x = inputs<T>(r, total, 1), b = inputs<T>(r, n, 2);
    auto y = outputs<T>(r, total);
    elements(r, total, [&](side s) { return nk::bias_add<T>{x.at(s), b.at(s), y.at(s), n}; });
    compare(r, y, name("bias_add", tn, n), -1);
    auto z = outputs<T>(r, total);
    elements(r, total, [&](side s) { return nk::residual_add<T>{x.at(s), y.at(s), z.at(s)}; });
    compare(r, z, name("residual_add", tn, n), -1);
  }
  {
    rig r;
    auto x = inputs<T>(r, total, 3, -4.0, 4.0), dy = inputs<T>(r, total, 4);
    auto y = outputs<T>(r, total), dx = outputs<T>(r, total);
    using F = nk::gelu_form;
    elements(r, total, [&](side s) { return nk::gelu_forward<F::tanh, T>{x.at(s), y.at(s)}; });
    compare(r, y, name("gelu_forward tanh", tn, n), tolerance<T>());
    elements(r, total, [&](side s) {
      return nk::gelu_backward<F::tanh, T>{x.at(s), dy.at(s), dx.at(s)};
    });
    compare(r, dx, name("gelu_backward tanh", tn, n), tolerance<T>());
    elements(r, total, [&](side s) { return nk::gelu_forward<F::erf, T>{x.at(s), y.at(s)}; });
    compare(r, y, name("gelu_forward erf", tn, n), tolerance<T>());
    elements(r, total, [&](side s) {
      return nk::gelu_backward<F::erf, T>{x.at(s), dy.at(s), dx.at(s)};
    });
    compare(r, dx, name("gelu_backward erf", tn, n), tolerance<T>());
  }
  {
    // The bias gradient's two passes (rows in blocks of 8), db accumulating.
    rig r;
    using C = st::compute_t<T>;
    std::size_t const per_block = 8, blocks = nk::row_blocks(row_count, per_block);
    auto dy = inputs<T>(r, total, 5);
    auto partial = outputs<C>(r, blocks * n);
    auto db = inputs<T>(r, n, 6);
    elements(r, blocks * n, [&](side s) {
      return nk::column_partials<T>{dy.at(s), partial.at(s), row_count, n, per_block};
    });
    compare(r, partial, name("column_partials", tn, n), -1);
    elements(r, n, [&](side s) {
      return nk::fold_column_partials<T>{partial.at(s), db.at(s), n, blocks};
    });
    compare(r, db, name("fold_column_partials", tn, n), -1);
  }
}

// ---- layer norm ------------------------------------------------------------------------------
template <class T>
void check_layer_norm(std::size_t n) {
  using C = st::compute_t<T>;
  char const* tn = type_name<T>();
  std::size_t const total = row_count * n;
  rig r;
  auto x = inputs<T>(r, total, 10, -2.0, 3.0), w = inputs<T>(r, n, 11), b = inputs<T>(r, n, 12);
  auto dy = inputs<T>(r, total, 13);
  auto y = outputs<T>(r, total), dx = outputs<T>(r, total);
  auto stats = outputs<C>(r, 2 * row_count);
  std::vector<T> y1, dx1;
  std::vector<C> stats1;
  for (unsigned lanes : stt::team_lanes) {
    repoison(r, y);
    repoison(r, stats);
    repoison(r, dx);
    rows(r, row_count, lanes, [&](side s) {
      return nk::layer_norm_forward<T>{x.at(s), w.at(s), b.at(s), y.at(s), stats.at(s), n, C(1e-5)};
    });
    compare(r, y, name("layer_norm_forward y", tn, n, lanes), tolerance<T>());
    compare(r, stats, name("layer_norm_forward stats", tn, n, lanes), tolerance<C>());
    // The backward from the emulated device's stats on both (the same inputs).
    auto const es = read(r, stats, emu);
    r.g.copy_async(r.g.compute_stream(), stats.at(gpu), es.data(), es.size() * sizeof(C));
    rows(r, row_count, lanes, [&](side s) {
      return nk::layer_norm_backward_dx<T>{x.at(s), dy.at(s), w.at(s), stats.at(s), dx.at(s), n};
    });
    compare(r, dx, name("layer_norm_backward_dx", tn, n, lanes), tolerance<T>());
    auto const gy = read(r, y, gpu);
    auto const gdx = read(r, dx, gpu);
    if (lanes == 1) {
      y1 = gy;
      dx1 = gdx;
    } else {
      same_on_gpu(y1, gy, name("layer_norm_forward y", tn, n, lanes));
      same_on_gpu(dx1, gdx, name("layer_norm_backward_dx", tn, n, lanes));
    }
  }
  // dw, db in two passes (blocks of 8 rows), accumulating.
  std::size_t const per_block = 8, blocks = nk::row_blocks(row_count, per_block);
  auto partial = outputs<C>(r, 2 * n * blocks);
  auto dw = inputs<T>(r, n, 14), db = inputs<T>(r, n, 15);
  elements(r, blocks * n, [&](side s) {
    return nk::layer_norm_grad_partials<T>{x.at(s),   dy.at(s), stats.at(s), partial.at(s),
                                           row_count, n,        per_block};
  });
  compare(r, partial, name("layer_norm_grad_partials", tn, n), tolerance<C>());
  elements(r, n, [&](side s) {
    return nk::layer_norm_grad_fold<T>{partial.at(s), dw.at(s), db.at(s), n, blocks};
  });
  compare(r, dw, name("layer_norm_grad_fold dw", tn, n), tolerance<T>());
  compare(r, db, name("layer_norm_grad_fold db", tn, n), tolerance<T>());
}

// ---- attention: causal softmax rows, head permutes --------------------------------------------
template <class T>
void check_softmax(std::size_t seq) {
  using C = st::compute_t<T>;
  char const* tn = type_name<T>();
  std::size_t const nrows = seq < 64 ? seq : 64, first = seq - nrows; // the longest rows
  std::size_t const total = nrows * seq;
  rig r;
  auto sc = inputs<T>(r, total, 20, -4.0, 4.0), dp = inputs<T>(r, total, 21);
  auto p = outputs<T>(r, total), ds = outputs<T>(r, total);
  C const scale = nk::attention_scale<C>(64);
  std::vector<T> p1, ds1;
  for (unsigned lanes : stt::team_lanes) {
    repoison(r, p);
    repoison(r, ds);
    rows(r, nrows, lanes, [&](side s) {
      return nk::causal_softmax_forward<T>{sc.at(s), p.at(s), seq, scale, first};
    });
    compare(r, p, name("causal_softmax_forward", tn, seq, lanes), tolerance<T>());
    auto const ep = read(r, p, emu); // the backward from the same probabilities on both
    r.g.copy_async(r.g.compute_stream(), p.at(gpu), ep.data(), ep.size() * sizeof(T));
    rows(r, nrows, lanes, [&](side s) {
      return nk::causal_softmax_backward<T>{p.at(s), dp.at(s), ds.at(s), seq, scale, first};
    });
    compare(r, ds, name("causal_softmax_backward", tn, seq, lanes), tolerance<T>());
    auto const gds = read(r, ds, gpu);
    if (lanes == 1)
      ds1 = gds;
    else
      same_on_gpu(ds1, gds, name("causal_softmax_backward", tn, seq, lanes));
  }
}

template <class T>
void check_permutes() {
  char const* tn = type_name<T>();
  std::size_t const batch = 3, seq = 17, heads = 4, hd = 24;
  std::size_t const total = batch * seq * 3 * heads * hd, part = batch * heads * seq * hd;
  rig r;
  auto qkv = inputs<T>(r, total, 30);
  auto q = outputs<T>(r, part), k = outputs<T>(r, part), v = outputs<T>(r, part);
  elements(r, total, [&](side s) {
    return nk::attention_split_qkv<T>{qkv.at(s), q.at(s), k.at(s), v.at(s), seq, heads, hd};
  });
  compare(r, q, name("attention_split_qkv q", tn, hd), -1);
  compare(r, k, name("attention_split_qkv k", tn, hd), -1);
  compare(r, v, name("attention_split_qkv v", tn, hd), -1);
  auto dqkv = outputs<T>(r, total);
  elements(r, total, [&](side s) {
    return nk::attention_split_qkv_backward<T>{q.at(s), k.at(s), v.at(s), dqkv.at(s),
                                               seq,     heads,   hd};
  });
  compare(r, dqkv, name("attention_split_qkv_backward", tn, hd), -1);
  auto out = outputs<T>(r, part), back = outputs<T>(r, part);
  elements(r, part, [&](side s) {
    return nk::attention_merge_heads<T>{q.at(s), out.at(s), seq, heads, hd};
  });
  compare(r, out, name("attention_merge_heads", tn, hd), -1);
  elements(r, part, [&](side s) {
    return nk::attention_merge_heads_backward<T>{out.at(s), back.at(s), seq, heads, hd};
  });
  compare(r, back, name("attention_merge_heads_backward", tn, hd), -1);
}

// ---- cross-entropy -----------------------------------------------------------------------------
template <class T>
void check_cross_entropy(std::size_t vocab) {
  using C = st::compute_t<T>;
  char const* tn = type_name<T>();
  rig r;
  std::size_t const total = row_count * vocab;
  auto logits = inputs<T>(r, total, 40, -6.0, 6.0);
  std::vector<std::int32_t> tg(row_count);
  for (std::size_t i = 0; i < row_count; ++i)
    tg[i] = i % 5 == 3 ? nk::cross_entropy_ignore_index
                       : static_cast<std::int32_t>(stt::mix(stt::seed() ^ 41, i) % vocab);
  auto targets = make_twin(r, tg);
  auto mask = inputs<float>(r, row_count, 42, 0.0, 1.0);
  auto norm = outputs<C>(r, 1), total_loss = outputs<C>(r, 1), loss = outputs<C>(r, row_count);
  auto dlogits = outputs<T>(r, total);
  std::vector<T> d1;
  for (unsigned lanes : stt::team_lanes) {
    repoison(r, norm);
    repoison(r, loss);
    repoison(r, dlogits);
    repoison(r, total_loss);
    rows(r, 1, lanes, [&](side s) {
      return nk::cross_entropy_norm<C>{targets.at(s), mask.at(s), norm.at(s), row_count, C(0)};
    });
    compare(r, norm, name("cross_entropy_norm", tn, vocab, lanes), -1);
    rows(r, row_count, lanes, [&](side s) {
      return nk::cross_entropy_forward_backward<T>{logits.at(s), dlogits.at(s), targets.at(s),
                                                   mask.at(s),   norm.at(s),    loss.at(s),
                                                   vocab,        C(1)};
    });
    compare(r, loss, name("cross_entropy loss rows", tn, vocab, lanes), tolerance<C>());
    compare(r, dlogits, name("cross_entropy dlogits", tn, vocab, lanes), tolerance<T>());
    rows(r, 1, lanes, [&](side s) {
      return nk::cross_entropy_loss<C>{loss.at(s), norm.at(s), total_loss.at(s), row_count};
    });
    compare(r, total_loss, name("cross_entropy_loss", tn, vocab, lanes), tolerance<C>());
    auto const gd = read(r, dlogits, gpu);
    if (lanes == 1)
      d1 = gd;
    else
      same_on_gpu(d1, gd, name("cross_entropy dlogits", tn, vocab, lanes));
  }
}

// ---- dropout, embedding ------------------------------------------------------------------------
template <class T>
void check_dropout() {
  using C = st::compute_t<T>;
  char const* tn = type_name<T>();
  std::size_t const n = 1001;
  std::uint64_t const first = 4 * 77 + 3; // not a Philox block's first element
  rig r;
  auto x = inputs<T>(r, n, 50), dy = inputs<T>(r, n, 51);
  auto y = outputs<T>(r, n), dx = outputs<T>(r, n);
  auto mask = outputs<std::uint8_t>(r, n);
  st::random_key const key = st::key_of("gpu_test.dropout", stt::seed()).with_stream(7);
  C const scale = nk::dropout_scale<C>(0.1);
  auto const make = [&](side s) {
    return nk::dropout_forward<T>{x.at(s), y.at(s), mask.at(s), n, first, key, 0.1f, scale};
  };
  elements(r, make(emu).size(), make);
  compare(r, mask, name("dropout_forward mask", tn, n), -1);
  compare(r, y, name("dropout_forward y", tn, n), -1);
  elements(r, n, [&](side s) {
    return nk::dropout_backward<T>{dy.at(s), mask.at(s), dx.at(s), scale};
  });
  compare(r, dx, name("dropout_backward", tn, n), -1);
}

template <class T>
void check_embedding() {
  char const* tn = type_name<T>();
  std::size_t const vocab = 50, seq = 13, batch = 3, n = 96, nrows = batch * seq;
  rig r;
  std::vector<std::int32_t> id(nrows);
  for (std::size_t i = 0; i < nrows; ++i)
    id[i] = static_cast<std::int32_t>(stt::mix(stt::seed() ^ 60, i) % 17); // repeats
  auto ids = make_twin(r, id);
  auto wte = inputs<T>(r, vocab * n, 61), wpe = inputs<T>(r, seq * n, 62);
  auto y = outputs<T>(r, nrows * n);
  elements(r, nrows * n, [&](side s) {
    return nk::embedding_forward<T>{ids.at(s), wte.at(s), wpe.at(s), y.at(s), n, seq};
  });
  compare(r, y, name("embedding_forward", tn, n), -1);
  auto order = outputs<std::uint32_t>(r, nrows);
  elements(r, nrows, [&](side s) {
    return nk::embedding_sort_rows{ids.at(s), order.at(s), nrows};
  });
  compare(r, order, name("embedding_sort_rows", tn, n), -1);
  auto dy = inputs<T>(r, nrows * n, 63);
  auto dwte = inputs<T>(r, vocab * n, 64), dwpe = inputs<T>(r, seq * n, 65);
  elements(r, nrows * n, [&](side s) {
    return nk::embedding_backward_tokens<T>{ids.at(s), order.at(s), dy.at(s), dwte.at(s),
                                            nrows,     n,           0,        vocab};
  });
  compare(r, dwte, name("embedding_backward_tokens", tn, n), -1);
  elements(r, seq * n, [&](side s) {
    return nk::embedding_backward_positions<T>{dy.at(s), dwpe.at(s), batch, seq, n};
  });
  compare(r, dwpe, name("embedding_backward_positions", tn, n), -1);
}

// ---- optimizers, gradient norm -----------------------------------------------------------------
template <class G, class P16>
void check_optimizers() {
  char const* tn = type_name<G>();
  std::size_t const n = 100003;
  rig r;
  auto p = inputs<float>(r, n, 70), m = inputs<float>(r, n, 71), v = inputs<float>(r, n, 72, 0, 1);
  auto g = inputs<G>(r, n, 73);
  using P = std::conditional_t<std::is_void_v<P16>, float, P16>;
  auto p16 = outputs<P>(r, n);
  auto clip = make_twin(r, std::vector<double>{0.75});
  auto overflow = make_twin(r, std::vector<int>{0});
  ok::adamw_coefficients<float> c{1.0f,   1.0f - 1e-3f * 0.1f,      0.1f,  0.999f,
                                  0.001f, std::sqrt(1.0f - 0.999f), 1e-8f, -1e-3f / 0.1f};
  elements(r, n, [&](side s) {
    return ok::adamw_update<float, G, P16>{
        c,
        true,
        0.5,
        clip.at(s),
        overflow.at(s),
        p.at(s),
        g.at(s),
        m.at(s),
        v.at(s),
        static_cast<P16*>(std::is_void_v<P16> ? nullptr : p16.at(s))};
  });
  compare(r, p, name("adamw_update params", tn, n), -1);
  compare(r, m, name("adamw_update exp_avg", tn, n), -1);
  compare(r, v, name("adamw_update exp_avg_sq", tn, n), -1);
  if constexpr (!std::is_void_v<P16>)
    compare(r, p16, name("adamw_update params16", tn, n), -1);
  ok::sgd_coefficients<float> sc{1.0f, 1e-2f, 0.9f, 1.0f, -1e-2f};
  ok::sgd_mode mode;
  mode.weight_decay = true;
  mode.momentum = true;
  mode.nesterov = true;
  elements(r, n, [&](side s) {
    return ok::sgd_update<float, G, P16>{
        sc,         mode,           0.5,
        clip.at(s), overflow.at(s), p.at(s),
        g.at(s),    m.at(s),        static_cast<P16*>(std::is_void_v<P16> ? nullptr : p16.at(s))};
  });
  compare(r, p, name("sgd_update params", tn, n), -1);
  compare(r, m, name("sgd_update momentum", tn, n), -1);
}

template <class G>
void check_grad_norm(std::size_t n) {
  char const* tn = type_name<G>();
  rig r;
  std::size_t const blocks = ok::grad_norm_block_count(n);
  auto g = inputs<G>(r, n, 80);
  auto partials = outputs<double>(r, blocks);
  auto sum_sq = outputs<double>(r, 1), norm = outputs<double>(r, 1), clip = outputs<double>(r, 1);
  auto overflow = make_twin(r, std::vector<int>{0});
  std::vector<double> first;
  for (unsigned lanes : stt::team_lanes) {
    repoison(r, partials);
    rows(r, blocks, lanes, [&](side s) {
      return ok::grad_norm_blocks<G>{g.at(s), n, partials.at(s)};
    });
    compare(r, partials, name("grad_norm_blocks", tn, n, lanes), -1);
    rows(r, 1, lanes, [&](side s) {
      return ok::grad_norm_finish{partials.at(s), blocks,         sum_sq.at(s), norm.at(s),
                                  clip.at(s),     overflow.at(s), 1.0,          1e-6};
    });
    compare(r, sum_sq, name("grad_norm_finish sum_sq", tn, n, lanes), -1);
    compare(r, norm, name("grad_norm_finish norm", tn, n, lanes), -1);
    compare(r, clip, name("grad_norm_finish clip_factor", tn, n, lanes), -1);
    compare(r, overflow, name("grad_norm_finish overflow", tn, n, lanes), -1);
    auto const gs = read(r, sum_sq, gpu);
    if (lanes == 1)
      first = gs;
    else
      same_on_gpu(first, gs, name("grad_norm_finish sum_sq", tn, n, lanes));
  }
  elements(r, 1, [&](side s) {
    return ok::grad_clip_factor{sum_sq.at(s), norm.at(s), clip.at(s), overflow.at(s), 1.0, 1e-6};
  });
  compare(r, clip, name("grad_clip_factor", tn, n), -1);
}

} // namespace

// Every kernel on the device against the emulated device; the number of failed checks. small:
// widths 1, 63 and 769 only, the gradient norm up to 4097 elements (what compute-sanitizer
// checks in scripts/gpu_check.sh).
int run_kernel_checks(bool small) {
  try {
    for (std::size_t n : stt::row_widths) {
      if (small && n != 1 && n != 63 && n != 769)
        continue;
      check_team<1, float>(n);
      check_team<32, float>(n);
      check_team<256, float>(n);
      check_team<1024, float>(n);
      check_team<1024, double>(n);
      check_elementwise<float>(n);
      check_layer_norm<float>(n);
      check_cross_entropy<float>(n);
    }
    for (std::size_t n : {std::size_t{63}, std::size_t{769}}) {
      check_elementwise<double>(n);
      check_elementwise<bf16>(n);
      check_layer_norm<double>(n);
      check_layer_norm<bf16>(n);
      check_cross_entropy<bf16>(n);
    }
    for (std::size_t seq : stt::row_widths)
      if (!small || seq != 3072)
        check_softmax<float>(seq);
    check_softmax<bf16>(769);
    check_permutes<float>();
    check_permutes<bf16>();
    check_dropout<float>();
    check_dropout<bf16>();
    check_embedding<float>();
    check_embedding<bf16>();
    check_optimizers<float, void>();
    check_optimizers<bf16, bf16>();
    for (std::size_t n : {std::size_t{1}, std::size_t{4097}, small ? 0 : std::size_t{5u << 20}}) {
      if (n == 0)
        continue;
      check_grad_norm<float>(n);
      check_grad_norm<bf16>(n);
    }
  } catch (std::exception const& e) {
    std::printf("FAILED: %s\n", e.what());
    ++failures;
  }
  std::printf("kernels on the device against the emulated device: %d checks, %d failed\n", checks,
              failures);
  return failures;
}
