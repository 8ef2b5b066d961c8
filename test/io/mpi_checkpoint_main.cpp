// A checkpoint saved by MPI processes loads in-process, and one saved in-process loads under MPI
// (issue 24: "a save under MPI loads in-process and back"). One program, three modes, run in
// turn by mpi_checkpoint.sh:
//   mpi-save <root> <seed>   (mpirun -np 2) ZeRO-2 on dp 2: 2 steps, save, step 3's loss to
//                            <root>/expected_mpi.txt
//   local <root> <seed>      (in-process, 2 thread ranks) ZeRO-1 on dp 2 loads step 2, saves it
//                            again under <root>/back, runs step 3: its loss within 1e-5 of the
//                            MPI run's; writes <root>/expected_local.txt
//   mpi-load <root> <seed>   (mpirun -np 2) data parallel on dp 2 loads <root>/back's step 2,
//                            runs step 3: its loss within 1e-5 of the in-process run's
// Exit 0 when the mode's check holds.
#include "../support/parity.hpp"

#include <strata/comm/local.hpp>
#include <strata/comm/mpi.hpp>
#include <strata/io/trainer_checkpoint.hpp>
#include <strata/models/gpt.hpp>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

namespace st = strata;
namespace fs = std::filesystem;

namespace {

st::models::gpt_model<float> const model{
    {.vocab = 40, .seq = 8, .features = 16, .heads = 4, .layers = 2, .dropout = 0.1}};

/// Builds a trainer under `plan` on the mesh, loads `load` (when not empty), saves into `save`
/// (when not empty), runs steps until step 3 and returns its loss (rank 0's).
template <class C>
double run(C& world, st::plan_descriptor plan, std::uint64_t seed, fs::path const& load,
           fs::path const& save, int steps_before_save) {
  st::comm::mesh mesh(world, {.dp = 2});
  st::trainer<st::models::gpt_model<float>, st::runtime_plan<>> t(
      mesh, model, st::engine::use<st::optim::adamw<float>>({.eps = 1e-6, .weight_decay = 0.1}),
      {.lr = [](std::int64_t) { return 3e-3; }, .clip = 1.0, .seed = seed}, plan);
  if (!load.empty())
    st::io::load(t, mesh, load);
  double loss = 0;
  auto const d = static_cast<std::size_t>(mesh.coords().dp);
  while (t.steps() < 3) {
    if (!save.empty() && t.steps() == steps_before_save)
      st::io::save(t, mesh, save);
    auto const data = st::test::make_parity_data(
        model, {.sequences = 8, .seq = 8}, seed + 100 + static_cast<std::uint64_t>(t.steps()));
    loss = t.step(data.slice(d * 4, 4, 8, 0)).loss;
  }
  return loss;
}

void write_loss(fs::path const& p, double x) {
  std::ofstream(p) << std::hexfloat << x << "\n";
}
double read_loss(fs::path const& p) {
  std::ifstream in(p);
  std::string s;
  in >> s;
  return std::strtod(s.c_str(), nullptr);
}

bool close(char const* what, double got, double want) {
  double const rel = std::abs(got - want) / std::abs(want);
  std::printf("%s: step 3 loss %.9g, expected %.9g (relative %.2g, <= 1e-5)\n", what, got, want,
              rel);
  return rel <= 1e-5;
}

} // namespace

int main(int argc, char** argv) {
  if (argc < 4) {
    std::fprintf(stderr, "usage: %s mpi-save|local|mpi-load <root> <seed>\n", argv[0]);
    return 2;
  }
  std::string const mode = argv[1];
  fs::path const root = argv[2];
  std::uint64_t const seed = std::strtoull(argv[3], nullptr, 10);
  auto const step2 = root / st::io::detail::step_name(2);
  auto const back = root / "back";
  if (mode == "local") {
    double loss = 0;
    st::comm::local::run(2, [&](st::comm::local::communicator& world) {
      auto const l =
          run(world, st::plan<st::sharded<st::zero<1>>>::descriptor(), seed, step2, back, 2);
      if (world.rank() == 0)
        loss = l;
    });
    write_loss(root / "expected_local.txt", loss);
    return close("in-process ZeRO-1 dp 2 from the MPI save", loss,
                 read_loss(root / "expected_mpi.txt"))
               ? 0
               : 1;
  }
  bool ok = true;
  int const rc = st::comm::mpi::run(argc, argv, [&](st::comm::mpi::communicator& world) {
    if (mode == "mpi-save") {
      double const loss =
          run(world, st::plan<st::sharded<st::zero<2>>>::descriptor(), seed, {}, root, 2);
      if (world.rank() == 0)
        write_loss(root / "expected_mpi.txt", loss);
    } else {
      double const loss = run(world, st::plan<st::data_parallel<>>::descriptor(), seed,
                              back / st::io::detail::step_name(2), {}, -1);
      if (world.rank() == 0)
        ok = close("MPI data parallel dp 2 from the in-process save", loss,
                   read_loss(root / "expected_local.txt"));
    }
  });
  return rc != 0 ? rc : (ok ? 0 : 1);
}
