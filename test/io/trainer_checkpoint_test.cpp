// A trainer saved and loaded (strata/io/trainer_checkpoint.hpp), on the in-process backend,
// through runtime plans (one trainer type a precision, every layout):
// - round trip: k steps, save, a fresh trainer loads, m more steps: losses and parameters bit
//   for bit those of k + m steps without a break, on one rank, data parallel, ZeRO-1, 2, 3,
//   tensor parallel, a 1F1B pipeline and dp 2 x tp 2 with ZeRO-2, in f32; one rank and ZeRO-2
//   in bf16 and fp16 (fp16 with skipped steps on both sides of the save), with dropout on;
// - resharding: saved under one layout, loaded under another (every stage and axis on both
//   sides of some pair, and precisions across): the loaded weights are the saved ones bit for
//   bit and the next step's loss is the unbroken run's within the f32 contract;
// - refusals: a checkpoint of another model, a corrupted piece, a directory that is not one.
#include "../support/parity.hpp"
#include "../support/seed.hpp"
#include "../support/training.hpp"

#include <strata/comm/local.hpp>
#include <strata/io/trainer_checkpoint.hpp>
#include <strata/models/gpt.hpp>

#include <catch2/catch.hpp>

#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <string>
#include <unistd.h>
#include <vector>

namespace st = strata;
namespace fs = std::filesystem;

namespace {

st::models::gpt_config gpt_config() {
  return {.vocab = 40, .seq = 8, .features = 16, .heads = 4, .layers = 2, .dropout = 0.1};
}

struct layout {
  char const* name;
  st::comm::mesh_shape shape;
  st::plan_descriptor plan;
  int world() const { return shape.dp * shape.tp * shape.pp; }
};

st::plan_descriptor with_mb(st::plan_descriptor d, std::size_t m) {
  d.micro_batches = m;
  return d;
}

std::vector<layout> const& layouts() {
  static std::vector<layout> const all = [] {
    std::vector<layout> v;
    v.push_back({"one rank", {.dp = 1}, {}});
    v.push_back({"data parallel dp 2", {.dp = 2}, st::plan<st::data_parallel<>>::descriptor()});
    v.push_back({"ZeRO-1 dp 2", {.dp = 2}, st::plan<st::sharded<st::zero<1>>>::descriptor()});
    v.push_back({"ZeRO-2 dp 2", {.dp = 2}, st::plan<st::sharded<st::zero<2>>>::descriptor()});
    v.push_back({"ZeRO-3 dp 2", {.dp = 2}, st::plan<st::sharded<st::zero<3>>>::descriptor()});
    v.push_back({"tensor parallel tp 2",
                 {.dp = 1, .tp = 2},
                 st::plan<st::tensor_parallel<>>::descriptor()});
    v.push_back(
        {"1F1B pp 2",
         {.dp = 1, .pp = 2},
         with_mb(
             st::plan<st::pipeline_parallel<st::one_f_one_b, st::micro_batches<2>>>::descriptor(),
             2)});
    v.push_back({"ZeRO-2 dp 2 x tp 2",
                 {.dp = 2, .tp = 2},
                 st::plan<st::sharded<st::zero<2>>, st::tensor_parallel<>>::descriptor()});
    v.push_back({"ZeRO-3 dp 4", {.dp = 4}, st::plan<st::sharded<st::zero<3>>>::descriptor()});
    using f1b = st::pipeline_parallel<st::one_f_one_b, st::micro_batches<2>>;
    v.push_back({"ZeRO-1 dp 2 x pp 2",
                 {.dp = 2, .pp = 2},
                 with_mb(st::plan<st::sharded<st::zero<1>>, f1b>::descriptor(), 2)});
    v.push_back(
        {"ZeRO-3 dp 2 x tp 2 x pp 2",
         {.dp = 2, .tp = 2, .pp = 2},
         with_mb(st::plan<st::sharded<st::zero<3>>, st::tensor_parallel<>, f1b>::descriptor(), 2)});
    return v;
  }();
  return all;
}

layout const& find_layout(std::string const& name) {
  for (auto const& l : layouts())
    if (name == l.name)
      return l;
  throw std::runtime_error("no layout " + name);
}

using weights = std::map<std::string, std::vector<double>>;

/// What a run gives: rank 0's losses, the model's full weights (the f32-exact ones: the values,
/// widened) gathered from every rank's pieces, and rank 0's optimizer step count.
struct outcome {
  std::vector<double> losses;
  weights w;
  std::vector<bool> skipped;
  // An asynchronous save: rank 0's peak staging bytes, and its weights and optimizer state
  // bytes (the rank's state), and whether the save was still in flight at the next step.
  std::size_t staging_peak = 0, state_bytes = 0;
  bool in_flight = false;
};

fs::path root_of(std::string const& name) {
  auto p = fs::temp_directory_path() / ("strata_ckpt_" + name + "_" + std::to_string(::getpid()));
  return p;
}

/// Runs `steps` steps under layout L in precision P: loading `load_from` first when given,
/// saving into `save_to` after `save_after` steps when given. Returns the outcome of the steps
/// run, and the weights right after a load (in `loaded`) when asked.
/// Faults a test injects right after a load (the harness must catch each).
enum class fault { none, optimizer_state, step, master_from_values };

template <class P>
outcome run(layout const& L, std::size_t steps, fs::path const* load_from = nullptr,
            fs::path const* save_to = nullptr, std::size_t save_after = 0,
            weights* loaded = nullptr, st::optim::loss_scaler_options scaler = {},
            fault f = fault::none, bool async = false,
            st::engine::optimizer_factory<float> optimizer = {}) {
  outcome out;
  std::mutex mu;
  std::uint64_t const seed = st::test::seed();
  st::models::gpt_model<float> const model{gpt_config()};
  st::comm::local::run(L.world(), [&](st::comm::local::communicator& world) {
    st::comm::mesh mesh(world, L.shape);
    auto const d = static_cast<std::size_t>(mesh.coords().dp);
    std::size_t const per = 8 / static_cast<std::size_t>(L.shape.dp);
    st::trainer_options o{.lr = st::test::constant_lr(3e-3), .clip = 1.0, .seed = seed + 3};
    o.loss_scaler = scaler;
    st::plan_descriptor plan = L.plan;
    plan.precision.kind = P::kind;
    if (!optimizer)
      optimizer = st::engine::use<st::optim::adamw<float>>({.eps = 1e-6, .weight_decay = 0.1});
    st::trainer<st::models::gpt_model<float>, st::runtime_plan<P>> t(mesh, model, optimizer, o,
                                                                     plan);
    auto gather = [&](weights& into) {
      t.for_each_value_piece([&](auto const& p, std::size_t first, auto values) {
        std::lock_guard lock(mu);
        auto& v = into[p.name()];
        v.resize(p.full_size());
        for (std::size_t i = 0; i < values.size(); ++i)
          v[first + i] = st::element_cast<double>(values[i]);
      });
    };
    if (load_from != nullptr) {
      auto const fresh = t.optimizer().save();
      st::io::load(t, mesh, *load_from);
      if (f == fault::optimizer_state) // the moments and the step count as built
        t.optimizer().load(fresh);
      if (f == fault::step) // the step (the dropout masks' key, the schedule's) as built
        t.state().values().step = 0;
      if constexpr (!std::is_same_v<P, st::precision::fp32>)
        if (f == fault::master_from_values) // the master weights widened from the 16-bit values
          for (auto const& r : t.state().flat().owned)
            for (std::size_t i = 0; i < r.count; ++i)
              st::io::detail::precision_of(t)->master().data()[r.state_offset + i] =
                  st::element_cast<float>(r.values[i]);
      if (loaded != nullptr)
        gather(*loaded);
    }
    st::io::async_saver saver;
    for (std::size_t k = 0; k < steps; ++k) {
      if (async && k == save_after && world.rank() == 0) // the step after the save's
        out.in_flight = saver.busy();
      // A batch a step (the step's number picks it), so that a resumed run sees what the
      // unbroken one saw.
      auto const data = st::test::make_parity_data(
          model, {.sequences = 8, .seq = 8}, seed + 100 + static_cast<std::uint64_t>(t.steps()));
      auto const r = t.step(data.slice(d * per, per, 8, 0));
      if (world.rank() == 0) {
        out.losses.push_back(r.loss);
        out.skipped.push_back(r.skipped);
      }
      if (save_to != nullptr && k + 1 == save_after) {
        // A loader's state beside it (a loader at this many batches of 8 samples).
        st::data::loader_state ls;
        ls.sampler.seed = seed;
        ls.sampler.consumed = 8 * save_after;
        ls.sampler.dataset_size = 1000;
        ls.global_batch = 8;
        ls.batches = save_after;
        if (async) {
          saver.save(t, mesh, *save_to, {.loader = ls});
        } else {
          st::io::save(t, mesh, *save_to, {.loader = ls});
        }
      }
    }
    saver.wait();
    if (world.rank() == 0) {
      out.staging_peak = t.ledger().peak(st::memory_kind::checkpoint_staging);
      out.state_bytes = t.optimizer().state_bytes() + t.optimizer().size() * sizeof(float);
    }
    gather(out.w);
  });
  return out;
}

/// k steps, save, a fresh trainer loads and runs m: against k + m steps unbroken.
template <class P>
void check_round_trip(layout const& L, std::size_t k, std::size_t m, bool skips = false,
                      st::optim::loss_scaler_options scaler = {},
                      st::engine::optimizer_factory<float> const& optimizer = {},
                      bool async = false) {
  CAPTURE(L.name);
  auto const root = root_of("rt");
  fs::remove_all(root);
  // k + m steps unbroken, saving after step k on the way.
  auto const whole =
      run<P>(L, k + m, nullptr, &root, k, nullptr, scaler, fault::none, async, optimizer);
  auto const dir = root / st::io::detail::step_name(static_cast<std::int64_t>(k));
  REQUIRE(fs::exists(dir));
  auto const ls = st::io::saved_loader_state(dir);
  REQUIRE(ls);
  CHECK(ls->batches == k);
  CHECK(ls->sampler.consumed == 8 * k);
  // A fresh trainer from the checkpoint: steps k + 1 .. k + m.
  auto const second =
      run<P>(L, m, &dir, nullptr, 0, nullptr, scaler, fault::none, false, optimizer);
  CHECK(second.losses ==
        std::vector<double>(whole.losses.begin() + static_cast<long>(k), whole.losses.end()));
  CHECK(second.w == whole.w);
  if (skips) { // fp16: steps skipped before and after the save
    std::size_t before = 0, after = 0;
    for (std::size_t i = 0; i < whole.skipped.size(); ++i)
      (i < k ? before : after) += whole.skipped[i];
    CAPTURE(before, after);
    CHECK(before > 0);
    CHECK(after > 0);
    CHECK(second.skipped ==
          std::vector<bool>(whole.skipped.begin() + static_cast<long>(k), whole.skipped.end()));
  }
  fs::remove_all(root);
}

/// An optimizer without in-place state: AdamW behind save() and load() alone, so that a
/// checkpoint goes through its state_dict.
class adamw_by_state {
public:
  using value_type = float;
  using options_type = st::optim::adamw_options;
  adamw_by_state(std::size_t n, options_type const& o) : a_(n, o) {}
  std::size_t size() const noexcept { return a_.size(); }
  void step(std::span<float> p, std::span<float const> g, st::optim::step_context const& c) {
    a_.step(p, g, c);
  }
  void step(std::span<float> p, std::span<float const> g, st::optim::step_context const& c,
            std::size_t offset) {
    a_.step(p, g, c, offset);
  }
  std::int64_t step_count() const noexcept { return a_.step_count(); }
  st::optim::state_dict save() const { return a_.save(); }
  void load(st::optim::state_dict const& s) { a_.load(s); }
  void load(st::optim::state_dict const& s, std::size_t offset) { a_.load(s, offset); }
  std::size_t state_bytes() const noexcept { return a_.state_bytes(); }

private:
  st::optim::adamw<float> a_;
};
static_assert(st::optim::optimizer<adamw_by_state>);
static_assert(!st::optim::in_place_state<adamw_by_state>);
static_assert(st::optim::in_place_state<st::optim::adamw<float>>);
static_assert(st::optim::in_place_state<st::optim::sgd<double>>);

} // namespace

TEST_CASE("checkpoint round trip: k steps, save, load, m steps is k + m steps bit for bit, in "
          "every layout",
          "[checkpoint][trainer][round_trip]") {
  for (auto const& L : layouts())
    check_round_trip<st::precision::fp32>(L, 3, 2);
}

TEST_CASE("checkpoint round trip in bf16 and fp16 (skipped steps on both sides of the save)",
          "[checkpoint][trainer][round_trip]") {
  for (char const* name : {"one rank", "ZeRO-2 dp 2"}) {
    check_round_trip<st::precision::bf16>(find_layout(name), 3, 2);
    // A scale of 2^30 overflows, backs off to 2^10, grows back after one good step: a skip
    // every other step.
    check_round_trip<st::precision::fp16>(find_layout(name), 4, 4, true,
                                          {.initial_scale = 1073741824.0,
                                           .growth_factor = 1048576.0,
                                           .backoff_factor = 1.0 / 1048576.0,
                                           .growth_interval = 1,
                                           .max_scale = 1099511627776.0});
  }
}

TEST_CASE("checkpoint resharding: saved under one layout, loaded under another",
          "[checkpoint][trainer][reshard]") {
  // A cycle through every layout (each stage and axis saved and loaded), then precisions.
  std::vector<std::pair<std::string, std::string>> const pairs{
      {"one rank", "ZeRO-3 dp 2"},
      {"ZeRO-3 dp 2", "tensor parallel tp 2"},
      {"tensor parallel tp 2", "1F1B pp 2"},
      {"1F1B pp 2", "ZeRO-1 dp 2"},
      {"ZeRO-1 dp 2", "ZeRO-2 dp 2 x tp 2"},
      {"ZeRO-2 dp 2 x tp 2", "data parallel dp 2"},
      {"data parallel dp 2", "ZeRO-3 dp 4"},
      {"ZeRO-3 dp 4", "ZeRO-1 dp 2 x pp 2"},
      {"ZeRO-1 dp 2 x pp 2", "ZeRO-3 dp 2 x tp 2 x pp 2"},
      {"ZeRO-3 dp 2 x tp 2 x pp 2", "ZeRO-2 dp 2"},
      {"ZeRO-2 dp 2", "one rank"}};
  std::size_t const k = 2;
  for (auto const& [from, to] : pairs) {
    CAPTURE(from, to);
    auto const root = root_of("rs");
    fs::remove_all(root);
    auto const& A = find_layout(from);
    auto const& B = find_layout(to);
    // A's k steps (saved), then its step k + 1.
    auto const a = run<st::precision::fp32>(A, k + 1, nullptr, &root, k);
    auto const saved = run<st::precision::fp32>(A, k).w;
    auto const dir = root / st::io::detail::step_name(static_cast<std::int64_t>(k));
    weights loaded;
    auto const b = run<st::precision::fp32>(B, 1, &dir, nullptr, 0, &loaded);
    CHECK(loaded == saved); // the weights, bit for bit
    REQUIRE(b.losses.size() == 1);
    double const rel = std::abs(b.losses[0] - a.losses[k]) / std::abs(a.losses[k]);
    std::printf("reshard %-22s -> %-22s: step %zu loss %.9g vs %.9g (rel %.2g)\n", from.c_str(),
                to.c_str(), k + 1, b.losses[0], a.losses[k], rel);
    CHECK(rel <= 1e-5);
    fs::remove_all(root);
  }
  // Precisions across: bf16 saved (f32 master weights) loads in f32 exactly, and f32 in bf16
  // (rounded).
  auto const root = root_of("prec");
  fs::remove_all(root);
  auto const& one = find_layout("one rank");
  (void)run<st::precision::bf16>(one, k, nullptr, &root, k);
  auto const dir = root / st::io::detail::step_name(static_cast<std::int64_t>(k));
  weights as_f32, as_bf16;
  (void)run<st::precision::fp32>(one, 1, &dir, nullptr, 0, &as_f32);
  (void)run<st::precision::bf16>(one, 1, &dir, nullptr, 0, &as_bf16);
  auto const bf16_values = run<st::precision::bf16>(one, k).w;
  CHECK(as_bf16 == bf16_values); // the bf16 values: the master weights rounded, as saved
  std::size_t differ = 0;
  for (auto const& [name, v] : as_f32)
    for (std::size_t i = 0; i < v.size(); ++i)
      differ += v[i] != bf16_values.at(name)[i];
  CHECK(differ > 0); // f32 got the master weights, not the rounded values
  fs::remove_all(root);
}

TEST_CASE("checkpoint refusals: another model, a corrupted piece, not a checkpoint",
          "[checkpoint][trainer][errors]") {
  auto const root = root_of("err");
  fs::remove_all(root);
  auto const& one = find_layout("one rank");
  (void)run<st::precision::fp32>(one, 1, nullptr, &root, 1);
  auto const dir = root / "step-00000001";
  // Another model: a wider one.
  {
    st::models::gpt_config c = gpt_config();
    c.features = 32;
    st::models::gpt_model<float> wide{c};
    st::trainer<st::models::gpt_model<float>> t(wide, st::engine::use<st::optim::adamw<float>>(),
                                                {.lr = st::test::constant_lr(1e-3)});
    CHECK_THROWS_WITH(st::io::load(t, dir), Catch::Contains("in the checkpoint and") &&
                                                Catch::Contains("another model configuration"));
  }
  // One byte flipped inside a piece (after the header): the piece's CRC-32C disagrees; the
  // file's own check in the manifest would too, but the piece is named.
  {
    auto const file = dir / "rank-00000.safetensors";
    auto const size = fs::file_size(file);
    std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(static_cast<std::streamoff>(size - 7));
    char x = 0;
    f.read(&x, 1);
    f.seekp(static_cast<std::streamoff>(size - 7));
    x = static_cast<char>(x ^ 0x01);
    f.write(&x, 1);
    f.close();
    st::models::gpt_model<float> const model{gpt_config()};
    st::trainer<st::models::gpt_model<float>> t(model, st::engine::use<st::optim::adamw<float>>(),
                                                {.lr = st::test::constant_lr(1e-3)});
    CHECK_THROWS_WITH(st::io::load(t, dir), Catch::Contains("is corrupted"));
    // No checkpoint there.
    CHECK_THROWS_WITH(st::io::load(t, root), Catch::Contains("is not a complete checkpoint"));
    CHECK(!st::io::load_latest(t, root / "nothing"));
  }
  fs::remove_all(root);
}

TEST_CASE("checkpoint faults: a load that leaves out the optimizer state, the step or the f32 "
          "master weights is caught by the round trip",
          "[checkpoint][trainer][fault]") {
  auto const root = root_of("fault");
  fs::remove_all(root);
  auto const& L = find_layout("ZeRO-2 dp 2");
  std::size_t const k = 3, m = 2;
  auto const whole = run<st::precision::bf16>(L, k + m, nullptr, &root, k);
  auto const dir = root / st::io::detail::step_name(static_cast<std::int64_t>(k));
  std::vector<double> const tail(whole.losses.begin() + static_cast<long>(k), whole.losses.end());
  REQUIRE(run<st::precision::bf16>(L, m, &dir).losses == tail); // the harness passes first
  for (auto f : {fault::optimizer_state, fault::step, fault::master_from_values}) {
    CAPTURE(static_cast<int>(f));
    auto const broken = run<st::precision::bf16>(L, m, &dir, nullptr, 0, nullptr, {}, f);
    double worst = 0;
    for (std::size_t i = 0; i < tail.size(); ++i)
      worst = std::max(worst, std::abs(broken.losses[i] - tail[i]) / std::abs(tail[i]));
    std::printf("fault %d after the load: losses off by %.3g (relative)\n", static_cast<int>(f),
                worst);
    CHECK(broken.losses != tail);
    CHECK(broken.w != whole.w);
  }
  fs::remove_all(root);
}

TEST_CASE("asynchronous save: the checkpoint holds the state at the step of the save while "
          "training goes on",
          "[checkpoint][trainer][async]") {
  for (char const* name : {"one rank", "ZeRO-2 dp 2"}) {
    auto const& L = find_layout(name);
    CAPTURE(name);
    auto const root = root_of("async");
    fs::remove_all(root);
    std::size_t const k = 2, m = 3;
    // Saved in the background after step k while steps k + 1 .. k + m run.
    auto const whole =
        run<st::precision::fp32>(L, k + m, nullptr, &root, k, nullptr, {}, fault::none, true);
    auto const dir = root / st::io::detail::step_name(static_cast<std::int64_t>(k));
    REQUIRE(fs::exists(dir));
    auto const second = run<st::precision::fp32>(L, m, &dir);
    CHECK(second.losses ==
          std::vector<double>(whole.losses.begin() + static_cast<long>(k), whole.losses.end()));
    CHECK(second.w == whole.w);
    // The staging: one copy of the rank's weights and optimizer state (and the file's header).
    std::printf("async save, %s: staging peak %zu bytes, the rank's state %zu bytes, in flight "
                "at the next step: %s\n",
                name, whole.staging_peak, whole.state_bytes, whole.in_flight ? "yes" : "no");
    CHECK(whole.staging_peak > 0);
    CHECK(whole.staging_peak <= whole.state_bytes + 64 * 1024);
    fs::remove_all(root);
  }
}

TEST_CASE("checkpoint round trip of an optimizer saved in place (SGD with momentum) and of one "
          "saved through its state_dict, synchronous and asynchronous",
          "[checkpoint][trainer][round_trip]") {
  auto const sgd = st::engine::use<st::optim::sgd<float>>({.momentum = 0.9, .weight_decay = 0.01});
  auto const by_state = st::engine::use<adamw_by_state>({.eps = 1e-6, .weight_decay = 0.1});
  for (char const* name : {"one rank", "ZeRO-2 dp 2"}) {
    auto const& L = find_layout(name);
    check_round_trip<st::precision::fp32>(L, 2, 2, false, {}, sgd);
    check_round_trip<st::precision::fp32>(L, 2, 2, false, {}, by_state);
    check_round_trip<st::precision::bf16>(L, 2, 2, false, {}, by_state, true);
  }
}

TEST_CASE("asynchronous saves one after another: each holds its own step's state (the staging "
          "buffer is reused)",
          "[checkpoint][trainer][async]") {
  auto const root = root_of("async2");
  fs::remove_all(root);
  st::models::gpt_model<float> const model{gpt_config()};
  auto make = [&] {
    return st::trainer<st::models::gpt_model<float>>(
        model, st::engine::use<st::optim::adamw<float>>(), {.lr = st::test::constant_lr(1e-3)});
  };
  auto t = make();
  auto const data = st::test::make_parity_data(model, {.sequences = 8, .seq = 8}, 11);
  std::vector<std::vector<float>> at_save;
  st::io::async_saver saver({.idle_priority = false}); // (the other async test: the default)
  for (int s = 0; s < 3; ++s) {
    (void)t.step(data.slice(0, 8, 8, 0));
    std::vector<float> w;
    t.for_each_value_piece([&](auto const&, std::size_t, auto values) {
      w.insert(w.end(), values.begin(), values.end());
    });
    at_save.push_back(std::move(w));
    saver.save(t, root); // waits for the previous one, then reuses its buffer
    if (s == 0)
      CHECK(saver.staging_bytes() > 0);
  }
  saver.wait();
  for (int s = 0; s < 3; ++s) {
    CAPTURE(s);
    auto u = make();
    CHECK(st::io::load(u, root / st::io::detail::step_name(s + 1)) == s + 1);
    std::vector<float> w;
    u.for_each_value_piece([&](auto const&, std::size_t, auto values) {
      w.insert(w.end(), values.begin(), values.end());
    });
    CHECK(w == at_save[static_cast<std::size_t>(s)]);
  }
  saver.release();
  CHECK(saver.staging_bytes() == 0);
  fs::remove_all(root);
}
