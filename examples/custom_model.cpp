// A user's own model, end to end: a residual MLP classifier over feature rows with a custom
// layer (an RMS-normed, tensor-parallel MLP block with a residual connection) written from
// scratch, gradient-checked, then trained under data parallel x tensor parallel with
// micro-batches, on in-process ranks or under mpirun. docs/custom_model.md walks through it.
//
//   strata_custom_model [--steps N] [--dp D] [--tp T] [--backend local|mpi]
//
// The backend is mpi when --backend mpi is given or the program runs under mpirun (the
// launcher's OMPI_COMM_WORLD_SIZE or PMI_SIZE is set) and the build has MPI; under mpirun the
// data-parallel degree is the process count / tp. Exits 1 unless the block's gradient check
// passes and the loss of the last steps is below the first step's by a margin.
#include <strata/comm/local.hpp>
#include <strata/comm/mesh.hpp>
#include <strata/core/element.hpp>
#include <strata/core/random.hpp>
#include <strata/engine/batch.hpp>
#include <strata/engine/node.hpp>
#include <strata/nn/activation.hpp>
#include <strata/nn/cross_entropy.hpp>
#include <strata/nn/grad_check.hpp>
#include <strata/nn/layer.hpp>
#include <strata/nn/linear.hpp>
#include <strata/nn/parameter.hpp>
#include <strata/nn/scratch.hpp>
#include <strata/optim/adamw.hpp>
#include <strata/parallel/plan.hpp>
#include <strata/train/trainer.hpp>
#if STRATA_EXAMPLE_MPI
#include <strata/comm/mpi.hpp>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

namespace st = strata;
namespace nn = strata::nn;

// ---- the custom layer --------------------------------------------------------------------------

/// y = x + proj(gelu(fc(rms_norm(x) * g))): a pre-norm residual MLP block with its own
/// RMS-norm gain g ("<name>.norm.weight", [width], ones, kind norm). fc is column-split and
/// proj row-split over the tensor-parallel group (Megatron's MLP), so x, y and the norm are
/// the same on every tp rank; g is replicated and its gradient is the same on every rank too
/// (it sees every row and the full features), so it needs no reduction. Saved: the norm's
/// 1/rms per row (in C), the normed rows, fc's and gelu's outputs (this rank's hidden / tp).
template <st::floating_element T, st::floating_element C = st::compute_t<T>>
class residual_mlp_block {
public:
  using value_type = T;
  using compute_type = C;
  struct saved_type {
    nn::scratch<C> rstd{st::memory_kind::activations}; // rows x 1
    nn::scratch<T> normed{st::memory_kind::activations}, hidden{st::memory_kind::activations},
        act{st::memory_kind::activations};
  };

  residual_mlp_block(std::string name, std::size_t width, std::size_t hidden,
                     nn::tp_group const* tp = nullptr, double eps = 1e-6)
      : name_(std::move(name)), width_(width), eps_(eps),
        gain_(name_ + ".norm.weight", {width}, {nn::init_rule::kind::ones, 0}),
        fc_(name_ + ".fc", width, hidden, tp), act_(name_ + ".act", hidden / tp_divisor(tp)),
        proj_(name_ + ".proj", hidden, width, tp) {
    gain_.set_kind(nn::parameter_kind::norm); // no weight decay, as for layer norms
  }

  std::string const& name() const noexcept { return name_; }
  std::size_t in_features() const noexcept { return width_; }
  std::size_t out_features() const noexcept { return width_; }
  template <class F>
  void for_each_parameter(F&& f) {
    f(gain_);
    fc_.for_each_parameter(f);
    proj_.for_each_parameter(f);
  }

  void forward(nn::layer_context const& ctx, st::tensor_view<T const> x, st::tensor_view<T> y,
               saved_type& s) {
    std::size_t const rows = x.extent(0), n = width_, h = fc_.out_features();
    C* rstd = s.rstd.get(rows, 1).data();
    auto normed = s.normed.get(rows, n);
    T const* g = gain_.value().data();
    for (std::size_t r = 0; r < rows; ++r) {
      C ss{0};
      for (std::size_t j = 0; j < n; ++j) {
        C const v = st::to_compute_value<C>(x(r, j)); // widen 16-bit storage to C
        ss += v * v;
      }
      rstd[r] = C{1} / std::sqrt(ss / static_cast<C>(n) + static_cast<C>(eps_));
      for (std::size_t j = 0; j < n; ++j) // round once, to T, when storing
        normed(r, j) = st::from_compute_value<T>(st::to_compute_value<C>(x(r, j)) * rstd[r] *
                                                 st::to_compute_value<C>(g[j]));
    }
    auto hid = s.hidden.get(rows, h);
    auto act = s.act.get(rows, h);
    fc_.forward(ctx, normed, hid, fc_saved_);
    act_.forward(ctx, hid, act, act_saved_);
    proj_.forward(ctx, act, y, proj_saved_); // y = proj(...), all-reduced over tp
    for (std::size_t r = 0; r < rows; ++r)
      for (std::size_t j = 0; j < n; ++j)
        y(r, j) = st::from_compute_value<T>(st::to_compute_value<C>(y(r, j)) +
                                            st::to_compute_value<C>(x(r, j)));
  }

  void backward(nn::layer_context const& ctx, st::tensor_view<T const> x, saved_type const& s,
                st::tensor_view<T const> dy, st::tensor_view<T> dx) {
    std::size_t const rows = x.extent(0), n = width_, h = fc_.out_features();
    auto dact = dact_.get(rows, h);
    auto dhid = dhid_.get(rows, h);
    auto dnormed = dnormed_.get(rows, n);
    proj_.backward(ctx, s.act.view(rows, h), proj_saved_, dy, dact);
    act_.backward(ctx, s.hidden.view(rows, h), act_saved_, dact, dhid);
    fc_.backward(ctx, s.normed.view(rows, n), fc_saved_, dhid, dnormed); // all-reduced over tp
    // The norm: u = x * rstd, normed = u * g. dg += sum_r dnormed * u;
    // dx = rstd * (dnormed * g - u * mean_j(dnormed * g * u)) + dy (the residual).
    C const* rstd = s.rstd.data();
    T const* g = gain_.value().data();
    C* dg = dgain_.get(1, n).data();
    std::fill(dg, dg + n, C{0});
    for (std::size_t r = 0; r < rows; ++r) {
      C dot{0};
      for (std::size_t j = 0; j < n; ++j) {
        C const u = st::to_compute_value<C>(x(r, j)) * rstd[r];
        C const d = st::to_compute_value<C>(dnormed(r, j));
        dg[j] += d * u;
        dot += d * st::to_compute_value<C>(g[j]) * u;
      }
      dot /= static_cast<C>(n);
      if (dx.data() == nullptr) // the model's first layer: no input gradient
        continue;
      for (std::size_t j = 0; j < n; ++j) {
        C const u = st::to_compute_value<C>(x(r, j)) * rstd[r];
        C const d = st::to_compute_value<C>(dnormed(r, j)) * st::to_compute_value<C>(g[j]);
        dx(r, j) =
            st::from_compute_value<T>(rstd[r] * (d - u * dot) + st::to_compute_value<C>(dy(r, j)));
      }
    }
    T* gg = gain_.grad().data(); // gradients accumulate (+=) over micro-batches
    for (std::size_t j = 0; j < n; ++j)
      gg[j] = st::from_compute_value<T>(st::to_compute_value<C>(gg[j]) + dg[j]);
  }

private:
  static std::size_t tp_divisor(nn::tp_group const* tp) {
    return static_cast<std::size_t>(nn::tp_size_of(tp));
  }

  std::string name_;
  std::size_t width_;
  double eps_;
  nn::parameter<T> gain_;
  nn::column_parallel_linear<T, C> fc_;
  nn::gelu<T, C> act_;
  nn::row_parallel_linear<T, C> proj_;
  // The children save nothing (linear and gelu recompute from their inputs): one each serves
  // every micro-batch.
  typename nn::column_parallel_linear<T, C>::saved_type fc_saved_;
  typename nn::gelu<T, C>::saved_type act_saved_;
  typename nn::row_parallel_linear<T, C>::saved_type proj_saved_;
  // Backward's scratch, counted by the ledger as workspace, grown once.
  nn::scratch<T> dact_, dhid_, dnormed_;
  nn::scratch<C> dgain_;
};
// Member by member (each missing member named), then the concept.
static_assert(nn::check_layer_members<residual_mlp_block<float>>());

// ---- the model ---------------------------------------------------------------------------------

/// features -> width (a plain linear), `blocks` residual MLP blocks split over tp, -> classes.
template <class T>
struct residual_classifier {
  using value_type = T;
  std::size_t features = 16, width = 32, hidden = 64, classes = 4, blocks = 2;

  template <class U>
  residual_classifier<U> rebind() const {
    return {features, width, hidden, classes, blocks};
  }

  void build(st::engine::model_builder<T>& b) const {
    b.add(nn::linear<T>("embed", features, width));
    for (std::size_t i = 0; i < blocks; ++i)
      b.add(residual_mlp_block<T>("blocks." + std::to_string(i), width, hidden, b.tp()));
    b.add(nn::linear<T>("head", width, classes));
    b.loss(nn::softmax_cross_entropy<T>("loss", classes));
  }
};

// dp x tp with 2 micro-batches: each rank's slice of the batch runs in two halves, gradients
// accumulate, and the dp all-reduce runs once a step.
using plan = st::plan<st::data_parallel<>, st::tensor_parallel<>, st::micro_batches<2>>;

// ---- the data: rows labelled by a fixed random teacher ----------------------------------------

struct dataset {
  std::vector<float> x;
  std::vector<std::int32_t> y;
};

// Row i of every step's global batch is a function of (step, i) only, so every layout sees
// the same global batch and each dp rank takes its own rows.
dataset make_batch(residual_classifier<float> const& m, std::int64_t step, std::size_t first,
                   std::size_t rows) {
  dataset d{std::vector<float>(rows * m.features), std::vector<std::int32_t>(rows)};
  st::fill_uniform(std::span<float>(d.x), st::key_of("data.x", 7).with_stream(step),
                   first * m.features, -1.f, 1.f);
  std::vector<float> teacher(m.classes * m.features);
  st::fill_normal(std::span<float>(teacher), st::key_of("data.teacher", 7), 0, 0.f, 1.f);
  for (std::size_t r = 0; r < rows; ++r) {
    float best = -1e30f;
    for (std::size_t c = 0; c < m.classes; ++c) {
      float z = 0;
      for (std::size_t j = 0; j < m.features; ++j)
        z += teacher[c * m.features + j] * d.x[r * m.features + j];
      if (z > best) {
        best = z;
        d.y[r] = static_cast<std::int32_t>(c);
      }
    }
  }
  return d;
}

// ---- checks and the run -----------------------------------------------------------------------

// The custom layer's backward against central differences, in double, at tp = 1.
bool gradient_check() {
  residual_mlp_block<double> block("check", 8, 12);
  nn::randomize_parameters(block, 42);
  nn::layer_context ctx;
  ctx.batch = 5;
  bool ok = true;
  for (auto const& t : nn::check_gradients(block, ctx, 5, {.seed = 42})) {
    bool const pass = t.error < 1e-6 && t.norm > 0;
    std::printf("gradient check %-20s relative error %.2e%s\n", t.name.c_str(), t.error,
                pass ? "" : "  FAILED");
    ok = ok && pass;
  }
  return ok;
}

struct options {
  std::size_t steps = 60, batch = 32;
  int dp = 2, tp = 2;
  std::string backend = "local";
  bool dp_given = false;
};

template <class Comm>
int train(Comm& world, options const& o) {
  st::comm::mesh mesh(world, {.dp = o.dp, .tp = o.tp});
  bool const lead = world.rank() == 0;
  residual_classifier<float> const model;
  st::trainer<residual_classifier<float>, plan> trainer(
      mesh, model, st::engine::use<st::optim::adamw<float>>({}),
      {.lr = [](std::int64_t) { return 3e-3; }, .seed = 1});
  if (lead)
    std::printf("layout: %d ranks (%s backend) = dp %d x tp %d, %zu micro-batches; rank 0 holds "
                "%zu parameters\n",
                world.size(), o.backend.c_str(), o.dp, o.tp, trainer.micro_batches(),
                trainer.parameter_count());
  std::size_t const per = o.batch / static_cast<std::size_t>(o.dp);
  std::size_t const first = static_cast<std::size_t>(mesh.coords().dp) * per;
  double first_loss = 0, last = 0;
  std::size_t const tail = std::min<std::size_t>(5, o.steps);
  for (std::size_t s = 1; s <= o.steps; ++s) {
    dataset const d = make_batch(model, static_cast<std::int64_t>(s), first, per);
    auto const r = trainer.step(
        st::engine::batch_view<float>{.sequences = per, .seq = 1, .features = d.x, .targets = d.y});
    if (s == 1)
      first_loss = r.loss;
    if (s > o.steps - tail)
      last += r.loss / static_cast<double>(tail);
    if (lead && (s == 1 || s % 10 == 0 || s == o.steps))
      std::printf("step %4zu  loss %.4f\n", s, r.loss);
  }
  if (!lead)
    return 0;
  double const margin = 0.3 * first_loss;
  std::printf("final: mean loss of the last %zu steps %.4f, first step %.4f\n", tail, last,
              first_loss);
  if (!(last < first_loss - margin)) {
    std::fprintf(stderr, "strata_custom_model: the loss did not fall by 30%% (%.4f -> %.4f)\n",
                 first_loss, last);
    return 1;
  }
  return 0;
}

options parse(int argc, char** argv) {
  options o;
  for (int i = 1; i < argc; ++i) {
    std::string const a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc)
        throw std::invalid_argument(a + " needs a value");
      return argv[++i];
    };
    if (a == "--steps")
      o.steps = std::stoul(next());
    else if (a == "--dp")
      o.dp = std::stoi(next()), o.dp_given = true;
    else if (a == "--tp")
      o.tp = std::stoi(next());
    else if (a == "--backend")
      o.backend = next();
    else
      throw std::invalid_argument("unknown option " + a +
                                  " (--steps N --dp D --tp T --backend local|mpi)");
  }
  if (std::getenv("OMPI_COMM_WORLD_SIZE") || std::getenv("PMI_SIZE"))
    o.backend = "mpi";
  return o;
}

int main(int argc, char** argv) try {
  options o = parse(argc, argv);
  if (!gradient_check()) {
    std::fprintf(stderr, "strata_custom_model: the custom layer's gradient check failed\n");
    return 1;
  }
  std::atomic<int> rc{0};
  if (o.backend == "mpi") {
#if STRATA_EXAMPLE_MPI
    int const mrc = st::comm::mpi::run(argc, argv, [&](st::comm::mpi::communicator& w) {
      options m = o;
      if (!m.dp_given)
        m.dp = w.size() / m.tp;
      if (m.dp * m.tp != w.size())
        throw st::config_error("strata_custom_model: " + std::to_string(w.size()) +
                               " processes, but dp x tp = " + std::to_string(m.dp * m.tp));
      rc = std::max(rc.load(), train(w, m));
    });
    return mrc != 0 ? mrc : rc.load();
#else
    std::fprintf(stderr, "strata_custom_model: this build has no MPI\n");
    return 2;
#endif
  }
  st::comm::local::run(o.dp * o.tp, [&](st::comm::local::communicator& w) {
    int const r = train(w, o);
    if (r != 0)
      rc = r;
  });
  return rc.load();
} catch (std::exception const& e) {
  std::fprintf(stderr, "strata_custom_model: %s\n", e.what());
  return 1;
}
