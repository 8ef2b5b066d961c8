// strata_zero_memory: the model-state memory one rank holds under data parallel and under each
// ZeRO stage, against the ZeRO paper's formulas, on n = 1, 2, 4, 8 in-process ranks (threads).
//
// The model: models::mlp_model<float>{800, 800, 16, 800}, 16 linear layers of 800 x 800 + 800
// (psi = 10,252,800 parameters), trained with AdamW (f32: 4 bytes of parameters, 4 of
// gradients and 8 of optimizer state per element) for a few steps on 8 random rows per rank.
// Per rank, the peaks since construction from the trainer's memory ledger: parameters,
// gradients, optimizer state (their sum is the model state) and communication buffers. The
// formulas, for f32 with AdamW (K = 8 bytes of optimizer state per element):
//   data parallel 16 psi; stage 1: 8 psi + 8 psi / n; stage 2: 4 psi + 12 psi / n;
//   stage 3: 16 psi / n.
// The working buffers the formulas leave out are shown beside them: stages 2 and 3 stage a
// unit's gradients in two buffers of the largest segment before reducing them, and stage 3
// gathers units into gather_slots buffers of the largest segment. Stages 1 and 2 use 1 MiB
// buckets (each layer its own segment), stage 3 one layer a unit.
//
// A second table does the same under precision::bf16 (the plans above with precision::bf16
// added): parameters and gradients in bf16 (2 bytes an element), AdamW<float> on f32 master
// weights (the master weights, 4 bytes an element, count as optimizer state beside AdamW's 8),
// against the paper's mixed-precision formulas (2 + 2 + K bytes an element, K = 12):
//   data parallel 16 psi; stage 1: 4 psi + 12 psi / n; stage 2: 2 psi + 14 psi / n;
//   stage 3: 16 psi / n.
// The working buffers are the same counts of bf16 elements.
//
// Prints markdown tables on stdout, progress on stderr. An argument fp32 or bf16 prints only
// that table (fp32: exactly the output of the tool before the bf16 table was added).
#include <strata/comm/local.hpp>
#include <strata/comm/mesh.hpp>
#include <strata/models/mlp.hpp>
#include <strata/optim/adamw.hpp>
#include <strata/train/trainer.hpp>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <random>
#include <string_view>
#include <vector>

namespace {

namespace st = strata;
using comm_t = st::comm::local::communicator;
using model_t = st::models::mlp_model<float>;

model_t const model{800, 800, 16, 800};
constexpr std::size_t rows = 8; // per rank
constexpr int steps = 3;

/// Random features in [-1, 1) and class targets for one rank.
struct rank_batch {
  std::vector<float> x;
  std::vector<std::int32_t> y;
  explicit rank_batch(int rank) : x(rows * model.features), y(rows) {
    std::mt19937 g(static_cast<unsigned>(101 + rank));
    std::uniform_real_distribution<float> u(-1, 1);
    std::generate(x.begin(), x.end(), [&] { return u(g); });
    std::generate(y.begin(), y.end(),
                  [&] { return static_cast<std::int32_t>(g() % model.classes); });
  }
  st::engine::batch_view<float> view() const { return {rows, 1, {}, x, y}; }
};

/// What one rank held.
struct held {
  std::size_t parameters = 0, gradients = 0, optimizer = 0, communication = 0;
  std::size_t psi = 0, slots = 0, largest = 0; // slots, largest segment: sharded plans only
  std::size_t element = 0;                     // bytes of the trainer's value type
  std::size_t master = 0;                      // bytes of f32 master weights (mixed precision)
  std::size_t model_state() const { return parameters + gradients + optimizer; }
};

template <class Plan>
held measure(int n) {
  std::vector<held> ranks(static_cast<std::size_t>(n));
  st::comm::local::run(n, [&](comm_t& world) {
    st::comm::mesh<comm_t> mesh(world, {.dp = n});
    st::trainer_options o;
    o.lr = [](std::int64_t) { return 1e-3; };
    o.seed = 7;
    using trainer_t = st::trainer<model_t, Plan>;
    using value_t = typename trainer_t::value_type;
    trainer_t t(mesh, model, st::engine::use<st::optim::adamw<float>>({}), o);
    rank_batch const b(world.rank());
    for (int k = 0; k < steps; ++k)
      t.step(b.view());
    auto const& l = t.ledger();
    held h;
    h.parameters = l.peak(st::memory_kind::parameters);
    h.gradients = l.peak(st::memory_kind::gradients);
    h.optimizer = l.peak(st::memory_kind::optimizer_state);
    h.communication = l.peak(st::memory_kind::communication);
    h.psi = t.parameter_count();
    h.element = sizeof(value_t);
    if (auto const* pp = t.template find_pass<st::policy::precision_pass<value_t>>())
      h.master = pp->master().size() * sizeof(float);
    if (auto* sp =
            dynamic_cast<st::parallel::sharded_pass<value_t, comm_t>*>(t.passes()[0].get())) {
      h.slots = sp->gather_slots();
      h.largest = sp->largest_segment();
    }
    ranks[static_cast<std::size_t>(world.rank())] = h;
  });
  // The rank that held the most (the shards are equal: every rank holds the same).
  return *std::max_element(ranks.begin(), ranks.end(), [](held const& a, held const& b) {
    return a.model_state() < b.model_state();
  });
}

double mib(double bytes) {
  return bytes / (1 << 20);
}

struct row_spec {
  char const* name;
  int stage; // 0: data parallel
};

// mixed: the bf16 table (the paper's mixed-precision formulas, and a column for the master
// weights).
void print_row(int n, row_spec const& r, held const& h, bool mixed) {
  double const psi = double(h.psi), dn = n;
  double formula = 0, gathered = 0, staging = 0;
  double const segment_bytes = double(h.largest) * double(h.element);
  switch (r.stage) {
  case 0:
    formula = 16 * psi;
    break;
  case 1:
    formula = mixed ? 4 * psi + 12 * psi / dn : 8 * psi + 8 * psi / dn;
    break;
  case 2:
    formula = mixed ? 2 * psi + 14 * psi / dn : 4 * psi + 12 * psi / dn;
    staging = 2 * segment_bytes;
    break;
  default:
    formula = 16 * psi / dn;
    gathered = double(h.slots) * segment_bytes;
    staging = 2 * segment_bytes;
    break;
  }
  double const measured = double(h.model_state());
  double const with_buffers = formula + gathered + staging;
  char gathered_cell[64] = "—", staging_cell[32] = "—";
  if (r.stage == 3)
    std::snprintf(gathered_cell, sizeof gathered_cell, "%zu x %zu el = %.2f", h.slots, h.largest,
                  mib(gathered));
  if (staging > 0)
    std::snprintf(staging_cell, sizeof staging_cell, "%.2f", mib(staging));
  if (mixed)
    std::printf(
        "| %d | %s | %.2f | %.2f | %.2f | %.2f | **%.2f** | %.2f | %.2f | **%.3f** | %s | %s | "
        "%.2f | **%.3f** |\n",
        n, r.name, mib(double(h.parameters)), mib(double(h.gradients)), mib(double(h.optimizer)),
        mib(double(h.master)), mib(measured), mib(double(h.communication)), mib(formula),
        measured / formula, gathered_cell, staging_cell, mib(with_buffers),
        measured / with_buffers);
  else
    std::printf(
        "| %d | %s | %.2f | %.2f | %.2f | **%.2f** | %.2f | %.2f | **%.3f** | %s | %s | %.2f | "
        "**%.3f** |\n",
        n, r.name, mib(double(h.parameters)), mib(double(h.gradients)), mib(double(h.optimizer)),
        mib(measured), mib(double(h.communication)), mib(formula), measured / formula,
        gathered_cell, staging_cell, mib(with_buffers), measured / with_buffers);
  std::fflush(stdout);
}

/// One table: the four plans under Precision at n = 1, 2, 4, 8; returns psi.
template <class Precision>
std::size_t print_table(bool mixed) {
  using clock = std::chrono::steady_clock;
  char const* const tag = mixed ? "bf16, " : "";
  std::size_t psi = 0;
  for (int n : {1, 2, 4, 8}) {
    auto run = [&]<class Plan>(row_spec const& r) {
      auto const t0 = clock::now();
      held const h = measure<Plan>(n);
      psi = h.psi;
      std::fprintf(stderr, "%sn = %d, %s: %.1f s\n", tag, n, r.name,
                   std::chrono::duration<double>(clock::now() - t0).count());
      print_row(n, r, h, mixed);
    };
    run.template operator()<st::plan<st::data_parallel<>, Precision>>({"data parallel", 0});
    run.template operator()<st::plan<st::sharded<st::zero<1>, st::bucket_mib<1>>, Precision>>(
        {"ZeRO-1", 1});
    run.template operator()<st::plan<st::sharded<st::zero<2>, st::bucket_mib<1>>, Precision>>(
        {"ZeRO-2", 2});
    run.template operator()<st::plan<st::sharded<st::zero<3>>, Precision>>({"ZeRO-3", 3});
  }
  return psi;
}

} // namespace

int main(int argc, char** argv) {
  using clock = std::chrono::steady_clock;
  std::string_view const only = argc > 1 ? argv[1] : "";
  if (!only.empty() && only != "fp32" && only != "bf16") {
    std::fprintf(stderr, "usage: %s [fp32|bf16]  (no argument: both tables)\n", argv[0]);
    return 2;
  }
  auto const start = clock::now();
  if (only != "bf16") {
    std::printf(
        "| n | plan | parameters | gradients | optimizer state | model state | communication "
        "| paper formula | measured / formula | gathered units | gradient staging | formula + "
        "buffers | measured / (formula + buffers) |\n");
    std::printf(
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n");
    std::size_t const psi = print_table<st::precision::fp32>(false);
    std::printf(
        "\npsi = %zu parameters (%zu linear layers); MiB = 2^20 bytes; %d AdamW steps of %zu "
        "rows per rank; peaks per rank since construction.\n",
        psi, model.depth, steps, rows);
  }
  if (only != "fp32") {
    if (only.empty())
      std::printf("\n");
    std::printf("precision::bf16 (bf16 parameters and gradients, AdamW<float> on f32 master "
                "weights; the master weights are part of the optimizer state):\n\n");
    std::printf("| n | plan | parameters | gradients | optimizer state | of which master "
                "weights | model state | communication | paper formula (mixed precision) | "
                "measured / formula | gathered units | gradient staging | formula + buffers | "
                "measured / (formula + buffers) |\n");
    std::printf("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- "
                "| --- |\n");
    std::size_t const psi = print_table<st::precision::bf16>(true);
    std::printf("\npsi = %zu parameters; bytes per element: 2 of parameters, 2 of gradients, 12 of "
                "optimizer state (4 of master weights, 8 of AdamW's moments).\n",
                psi);
  }
  std::fprintf(stderr, "total %.1f s\n",
               std::chrono::duration<double>(clock::now() - start).count());
  return 0;
}
