// The seed's vision-language example (section 6.1): a model that is a graph of three parts,
// each under its own strategy on its own factorisation of one world of 8 ranks:
//   image encoder  (patch features)  data parallel       dp 8
//   text encoder   (token ids)       data x tensor par.  dp 4 x tp 2
//   fusion trunk   (image, then text positions; the loss)  ZeRO-3  dp 8
// trained on synthetic paired data (models/vision_language.hpp) with AdamW and clipping, on
// in-process ranks or under mpirun. It first trains the same graph on one rank (every part
// dp 1 x tp 1) for --check-steps steps, and checks that the 8-rank run matches it: every
// step's loss, and every parameter of every part after those steps (the parity contract in
// f32). Then it trains on, and prints each part's collectives, on its own groups, and the
// boundary conversions'. docs/graph.md walks through it.
//
//   strata_vision_language [--steps N] [--check-steps K] [--samples S] [--backend local|mpi]
//
// Exits 1 unless the parity check passes and the loss of the last steps is below the first
// step's by a margin.
#include <strata/comm/local.hpp>
#include <strata/comm/mesh.hpp>
#include <strata/graph/trainer.hpp>
#include <strata/models/vision_language.hpp>
#include <strata/optim/adamw.hpp>
#if STRATA_EXAMPLE_MPI
#include <strata/comm/mpi.hpp>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

namespace st = strata;
namespace models = strata::models;

using vlm = models::vlm_graph<float>;

struct options {
  std::size_t steps = 60, check_steps = 5, samples = 16;
  std::string backend = "local";
};

// What a run hands back: every step's loss, and every parameter before the first step and
// after check_steps steps (on every rank).
struct run_record {
  std::vector<double> losses;
  std::map<std::string, std::vector<double>> p0, pk;
};

std::string shape_text(st::comm::mesh_shape s) {
  return "dp " + std::to_string(s.dp) + (s.tp > 1 ? " x tp " + std::to_string(s.tp) : "");
}

std::string counters_text(st::comm::comm_counters const& c) {
  std::string out;
  for (std::size_t k = 0; k < st::comm::op_kind_count; ++k) {
    auto const kind = static_cast<st::comm::op_kind>(k);
    if (c.calls(kind) == 0 || kind == st::comm::op_kind::split)
      continue;
    out += (out.empty() ? "" : ", ") + std::string(st::comm::name_of(kind)) + " " +
           std::to_string(c.calls(kind)) + " (" + std::to_string(c.bytes(kind)) + " B)";
  }
  return out.empty() ? "none" : out;
}

template <class Comm>
run_record train(Comm& world, std::vector<st::graph::part_layout> const& layouts, options const& o,
                 std::size_t steps, bool print) {
  vlm const model{{models::image_encoder<float>{}, models::text_encoder<float>{},
                   models::fusion_trunk<float>{}}};
  st::graph::trainer<vlm, Comm> trainer(
      world, model, layouts,
      st::engine::use<st::optim::adamw<float>>({.eps = 1e-6, .weight_decay = 0.01}),
      {.lr = [](std::int64_t) { return 2e-3; }, .clip = 1.0, .seed = 3});
  bool const lead = print && world.rank() == 0;
  run_record rec;
  rec.p0 = trainer.full_parameters(); // on the world: the parts' counters count steps only
  for (std::size_t s = 1; s <= steps; ++s) {
    models::vlm_data const d = models::vlm_batch(o.samples, static_cast<std::int64_t>(s));
    st::graph::batch<float> b{
        .samples = o.samples,
        .inputs = {{.name = "patches", .positions = d.patches, .features = d.patch_values},
                   {.name = "tokens", .positions = d.tokens, .tokens = d.token_ids}},
        .targets = d.targets};
    auto const r = trainer.step(b);
    rec.losses.push_back(r.loss);
    if (s == o.check_steps)
      rec.pk = trainer.full_parameters();
    if (lead && (s == 1 || s % 10 == 0 || s == steps))
      std::printf("step %4zu  loss %.4f  grad norm %.4f\n", s, r.loss, r.grad_norm);
  }
  if (lead) {
    std::printf("collectives of rank 0 over %zu steps, each part's on its own groups:\n", steps);
    std::printf("  image  (%s)  dp: %s; tp: %s\n", shape_text(trainer.part_shape(0)).c_str(),
                counters_text(trainer.template part_mesh<0>().dp().counters()).c_str(),
                counters_text(trainer.template part_mesh<0>().tp().counters()).c_str());
    std::printf("  text   (%s)  dp: %s; tp: %s\n", shape_text(trainer.part_shape(1)).c_str(),
                counters_text(trainer.template part_mesh<1>().dp().counters()).c_str(),
                counters_text(trainer.template part_mesh<1>().tp().counters()).c_str());
    std::printf("  fusion (%s)  dp: %s; tp: %s\n", shape_text(trainer.part_shape(2)).c_str(),
                counters_text(trainer.template part_mesh<2>().dp().counters()).c_str(),
                counters_text(trainer.template part_mesh<2>().tp().counters()).c_str());
    std::printf("  boundaries: %s\n", counters_text(trainer.boundary_counters()).c_str());
  }
  return rec;
}

// The parity contract in f32 (DESIGN.md): every step's loss within 1e-5 (relative), every
// parameter tensor within ||p - p_ref||2 <= 1e-4 ||p_ref - p0||2.
bool check_parity(run_record const& ref, run_record const& got, std::size_t k) {
  bool ok = true;
  double worst_loss = 0, worst_param = 0;
  std::string worst_name;
  for (std::size_t s = 0; s < k; ++s) {
    double const e = std::abs(got.losses[s] - ref.losses[s]) / std::abs(ref.losses[s]);
    worst_loss = std::max(worst_loss, e);
    if (!(e <= 1e-5)) {
      std::printf("parity: step %zu loss %.9g, the reference's %.9g (relative %.2e > 1e-5)\n",
                  s + 1, got.losses[s], ref.losses[s], e);
      ok = false;
    }
  }
  for (auto const& [name, r] : ref.pk) {
    auto const it = got.pk.find(name);
    if (it == got.pk.end() || it->second.size() != r.size()) {
      std::printf("parity: parameter %s missing or of another size\n", name.c_str());
      ok = false;
      continue;
    }
    double diff = 0, moved = 0;
    auto const& p0 = ref.p0.at(name);
    for (std::size_t e = 0; e < r.size(); ++e) {
      diff += (it->second[e] - r[e]) * (it->second[e] - r[e]);
      moved += (r[e] - p0[e]) * (r[e] - p0[e]);
    }
    double const rel = std::sqrt(diff) / std::max(std::sqrt(moved), 1e-30);
    if (rel > worst_param)
      worst_param = rel, worst_name = name;
    if (!(rel <= 1e-4)) {
      std::printf("parity: %s differs by %.2e of its change (> 1e-4)\n", name.c_str(), rel);
      ok = false;
    }
  }
  std::printf("parity against one rank after %zu steps: %zu parameter tensors, worst loss "
              "error %.2e, worst parameter error %.2e (%s): %s\n",
              k, ref.pk.size(), worst_loss, worst_param, worst_name.c_str(), ok ? "ok" : "FAILED");
  return ok;
}

// The reference: the same graph, every part dp 1 x tp 1 on one rank.
run_record reference(options const& o) {
  run_record ref;
  st::comm::local::run(1, [&](st::comm::local::communicator& w) {
    ref = train(w, {{"image", {.dp = 1}}, {"text", {.dp = 1}}, {"fusion", {.dp = 1}}}, o,
                o.check_steps, false);
  });
  return ref;
}

template <class Comm>
int run(Comm& world, options const& o, run_record const* ref) {
  bool const lead = world.rank() == 0;
  int const n = world.size();
  if (n % 2 != 0)
    throw st::config_error("strata_vision_language: " + std::to_string(n) +
                           " ranks; the text encoder's tp 2 needs an even count");
  std::vector<st::graph::part_layout> const layouts{
      {"image", {.dp = n}}, {"text", {.dp = n / 2, .tp = 2}}, {"fusion", {.dp = n}}};
  if (lead)
    std::printf("layout: %d ranks (%s backend): image dp %d (data parallel), text dp %d x tp 2 "
                "(data x tensor parallel), fusion dp %d (ZeRO-3)\n",
                n, o.backend.c_str(), n, n / 2, n);
  run_record const got = train(world, layouts, o, o.steps, true);
  if (!lead)
    return 0;
  int rc = 0;
  if (ref != nullptr && !check_parity(*ref, got, o.check_steps))
    rc = 1;
  std::size_t const tail = std::min<std::size_t>(5, o.steps);
  double last = 0;
  for (std::size_t s = o.steps - tail; s < o.steps; ++s)
    last += got.losses[s] / static_cast<double>(tail);
  std::printf("final: mean loss of the last %zu steps %.4f, first step %.4f\n", tail, last,
              got.losses[0]);
  if (!(last < 0.6 * got.losses[0])) {
    std::fprintf(stderr, "strata_vision_language: the loss did not fall by 40%% (%.4f -> %.4f)\n",
                 got.losses[0], last);
    rc = 1;
  }
  return rc;
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
    else if (a == "--check-steps")
      o.check_steps = std::stoul(next());
    else if (a == "--samples")
      o.samples = std::stoul(next());
    else if (a == "--backend")
      o.backend = next();
    else
      throw std::invalid_argument("unknown option " + a +
                                  " (--steps N --check-steps K --samples S --backend local|mpi)");
  }
  if (std::getenv("OMPI_COMM_WORLD_SIZE") || std::getenv("PMI_SIZE"))
    o.backend = "mpi";
  if (o.check_steps > o.steps)
    throw std::invalid_argument("--check-steps " + std::to_string(o.check_steps) +
                                " exceeds --steps " + std::to_string(o.steps));
  return o;
}

int main(int argc, char** argv) try {
  options const o = parse(argc, argv);
  std::atomic<int> rc{0};
  if (o.backend == "mpi") {
#if STRATA_EXAMPLE_MPI
    int const mrc = st::comm::mpi::run(argc, argv, [&](st::comm::mpi::communicator& w) {
      run_record ref;
      if (w.rank() == 0 && o.check_steps > 0) // the other ranks wait in the first collective
        ref = reference(o);
      int const r = run(w, o, o.check_steps > 0 && w.rank() == 0 ? &ref : nullptr);
      if (r != 0)
        rc = r;
    });
    return mrc != 0 ? mrc : rc.load();
#else
    std::fprintf(stderr, "strata_vision_language: this build has no MPI\n");
    return 2;
#endif
  }
  run_record ref;
  if (o.check_steps > 0)
    ref = reference(o);
  st::comm::local::run(8, [&](st::comm::local::communicator& w) {
    int const r = run(w, o, o.check_steps > 0 ? &ref : nullptr);
    if (r != 0)
      rc = r;
  });
  return rc.load();
} catch (std::exception const& e) {
  std::fprintf(stderr, "strata_vision_language: %s\n", e.what());
  return 1;
}
