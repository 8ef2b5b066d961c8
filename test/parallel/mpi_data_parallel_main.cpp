// Data-parallel parity under MPI: run with mpirun -np N (2 and 4 in the suite). Every rank
// gets only its slice of the global batch; every rank checks against one rank on the whole
// batch and all agree on the report. Rank 0 prints one line per check; exit 1 on a failure.
#include <strata/comm/mpi.hpp>
#include <strata/models/gpt.hpp>
#include <strata/models/mlp.hpp>

#include "../support/parity.hpp"

#include <cstdio>
#include <string>

namespace st = strata;
using st::test::parity_optimizer;

int main(int argc, char** argv) {
  int failures = 0;
  int const rc = st::comm::mpi::run(argc, argv, [&](st::comm::mpi::communicator& world) {
    int const n = world.size();
    std::int64_t seed = world.rank() == 0 ? static_cast<std::int64_t>(st::test::seed()) : 0;
    world.broadcast(std::span<std::int64_t>(&seed, 1), 0);
    auto const s = static_cast<std::uint64_t>(seed);
    auto line = [&](char const* what, st::test::parity_report const& r) {
      if (world.rank() == 0)
        std::printf("%-44s %s\n", what, r.summary().c_str());
      if (!r.ok)
        ++failures;
    };
    using ddp = st::plan<st::data_parallel<>>;
    using ddp_acc = st::plan<st::data_parallel<st::micro_batches<2>, st::bucket_mib<1>>>;
    std::size_t const b = 2 * static_cast<std::size_t>(n);
    st::models::mlp_model<double> m64{24, 32, 3, 7};
    st::models::mlp_model<float> m32{24, 32, 3, 7};
    st::models::gpt_model<float> gpt{
        {.vocab = 24, .seq = 8, .features = 16, .heads = 2, .layers = 2}};
    for (auto opt : {parity_optimizer::sgd, parity_optimizer::adamw}) {
      bool const sgd = opt == parity_optimizer::sgd;
      line(sgd ? "mlp f64 sgd" : "mlp f64 adamw",
           st::test::check_parity<ddp>(world, m64, {.sequences = b, .optimizer = opt, .seed = s}));
      line(sgd ? "mlp f64 sgd, 2 micro-batches" : "mlp f64 adamw, 2 micro-batches",
           st::test::check_parity<ddp_acc>(world, m64,
                                           {.sequences = 2 * b, .optimizer = opt, .seed = s}));
      line(sgd ? "mlp f32 sgd" : "mlp f32 adamw",
           st::test::check_parity<ddp>(world, m32, {.sequences = b, .optimizer = opt, .seed = s}));
      line(sgd ? "gpt f32 sgd" : "gpt f32 adamw",
           st::test::check_parity<ddp>(
               world, gpt, {.sequences = b, .seq = 8, .optimizer = opt, .lr = 1e-2, .seed = s}));
    }
    line("mlp f64 sgd, clipping active",
         st::test::check_parity<ddp_acc>(world, m64,
                                         {.sequences = 2 * b,
                                          .optimizer = parity_optimizer::sgd,
                                          .lr = 0.1,
                                          .clip = 0.05,
                                          .seed = s}));
  });
  if (failures)
    std::fprintf(stderr, "%d parity checks failed\n", failures);
  return rc != 0 ? rc : (failures ? 1 : 0);
}
