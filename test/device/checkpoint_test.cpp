// Checkpoints of the device trainer (strata/io/device_checkpoint.hpp) on the emulated device:
// - round trip: k steps, save, a fresh device trainer loads, m more steps: the losses, loss
//   scales and parameters bit for bit those of k + m steps without a break, in f32 (AdamW and
//   SGD with momentum), bf16 (the f32 master weights) and fp16 (the loss scaler's state);
// - replicas: ZeRO-3 and ZeRO-1 on 2 device_local replicas save (each its slices), one device
//   rank loads: its parameters are the replicas' bit for bit, and its next step's loss is their
//   next step's within the f32 contract; and one rank's checkpoint loads into the replicas;
// - host and device read each other's files: the host trainer's weights and moments go through
//   a device trainer and back bit for bit;
// - a fault the comparison must catch: a load of the checkpoint one step earlier.
#include "harness.hpp"

#include <strata/comm/device_local.hpp>
#include <strata/comm/local.hpp>
#include <strata/io/device_checkpoint.hpp>

#include <catch2/catch.hpp>

#include <filesystem>
#include <mutex>
#include <string>
#include <unistd.h>
#include <vector>

namespace {

namespace fs = std::filesystem;
using ctx_t = st::emulated_context;

fs::path root_of(std::string const& name) {
  auto p =
      fs::temp_directory_path() / ("strata_device_ckpt_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(p);
  return p;
}

/// What a device run gives: its step results and its parameters at the end.
struct device_outcome {
  std::vector<double> losses, scales;
  std::vector<bool> skipped;
  tensors p;
};

template <class T, class Plan, class Trainer>
void steps_on(Trainer& t, token_data const& d, std::size_t n, device_outcome& out) {
  for (std::size_t k = 0; k < n; ++k) {
    auto const s = t.step(d.view<T>());
    out.losses.push_back(s.loss);
    out.scales.push_back(s.loss_scale);
    out.skipped.push_back(s.skipped);
  }
}

template <class Trainer>
tensors parameters_of(Trainer& t) {
  using E = typename Trainer::value_type;
  tensors p;
  t.read_back();
  for (auto const& name : t.parameter_names())
    p[name] = widened<E>(t.values_of(name));
  return p;
}

/// One device trainer: `load_from` loaded first when given, `steps` steps, saved into
/// `save_to` after `save_after` of them when given.
template <class T, class Plan>
device_outcome run_one(bool adamw, token_data const& d, std::size_t steps_n,
                       fs::path const* load_from = nullptr, fs::path const* save_to = nullptr,
                       std::size_t save_after = 0, st::trainer_options o = options(0.5)) {
  st::models::gpt_model<T> m{model_config};
  st::trainer<st::models::gpt_model<T>, Plan, st::cuda_emulated> t(
      m, make_optimizer<st::compute_t<T>>(adamw), o, {.sequences = d.sequences, .seq = d.seq});
  if (load_from != nullptr) {
    std::int64_t const step = st::io::load(t, *load_from);
    REQUIRE(step == t.steps());
  }
  device_outcome out;
  for (std::size_t k = 0; k < steps_n; ++k) {
    steps_on<T, Plan>(t, d, 1, out);
    if (save_to != nullptr && k + 1 == save_after)
      (void)st::io::save(t, *save_to);
  }
  out.p = parameters_of(t);
  return out;
}

/// k steps, save, a fresh trainer loads, m more: against k + m unbroken, bit for bit.
template <class T, class Plan>
void require_round_trip(std::string const& name, bool adamw, token_data const& d,
                        st::trainer_options o = options(0.5)) {
  std::size_t const k = 3, m = 2;
  auto const root = root_of(name);
  auto const whole = run_one<T, Plan>(adamw, d, k + m, nullptr, &root, k, o);
  auto const dir = root / "step-00000003";
  REQUIRE(fs::exists(dir));
  auto const resumed = run_one<T, Plan>(adamw, d, m, &dir, nullptr, 0, o);
  for (std::size_t i = 0; i < m; ++i) {
    INFO(name << ": step " << k + i + 1);
    CHECK(resumed.losses[i] == whole.losses[k + i]);
    CHECK(resumed.scales[i] == whole.scales[k + i]);
    CHECK(resumed.skipped[i] == whole.skipped[k + i]);
  }
  for (auto const& [n, v] : whole.p) {
    INFO(name << ": " << n);
    CHECK(resumed.p.at(n) == v);
  }
  fs::remove_all(root);
}

} // namespace

TEST_CASE("device checkpoint round trip: k steps, save, load, m steps is k + m steps bit for bit",
          "[device][checkpoint]") {
  token_data const d(batch, seq, vocab, 0xc4e1);
  require_round_trip<float, st::plan<>>("f32_adamw", true, d);
  require_round_trip<float, st::plan<>>("f32_sgd", false, d);
  require_round_trip<float, st::plan<st::precision::bf16>>("bf16_adamw", true, d);
  // fp16 from a scale of 2^15 halving every other step and growing every 2 good steps: the
  // scaler's state (scale, good steps, hysteresis) crosses the save
  auto o = options(0.5);
  o.loss_scaler = {.initial_scale = 32768, .growth_interval = 2, .hysteresis = 2};
  require_round_trip<float, st::plan<st::precision::fp16>>("fp16_adamw", true, d, o);
}

TEST_CASE("device checkpoint: the comparison catches a resume from another step",
          "[device][checkpoint]") {
  token_data const d(batch, seq, vocab, 0xc4e2);
  auto const root = root_of("fault");
  auto const whole = run_one<float, st::plan<>>(true, d, 5, nullptr, &root, 2);
  // saved at step 2 (keep every checkpoint): resuming from it for 2 steps is not steps 4-5
  auto const dir = root / "step-00000002";
  auto const resumed = run_one<float, st::plan<>>(true, d, 2, &dir);
  CHECK(resumed.losses[0] != whole.losses[3]);
  bool all_equal = true;
  for (auto const& [n, v] : whole.p)
    all_equal = all_equal && resumed.p.at(n) == v;
  CHECK_FALSE(all_equal);
  fs::remove_all(root);
}

namespace {

/// n device_local replicas under Plan on their shares of d: `load_from` loaded first when
/// given, `steps_n` steps, saved into `save_to` after them when given; rank 0's losses and
/// parameters.
template <class Plan>
device_outcome run_replicas(int n, token_data const& d, std::size_t steps_n,
                            fs::path const* load_from, fs::path const* save_to) {
  device_outcome out;
  std::mutex mu;
  st::comm::local::run(n, [&](st::comm::local::communicator& host) {
    int const r = host.rank();
    std::size_t const per = d.sequences / static_cast<std::size_t>(n);
    token_data mine(per, d.seq, 1, 0);
    std::size_t const rows = per * d.seq, at = static_cast<std::size_t>(r) * rows;
    std::copy_n(d.tokens.begin() + static_cast<std::ptrdiff_t>(at), rows, mine.tokens.begin());
    std::copy_n(d.targets.begin() + static_cast<std::ptrdiff_t>(at), rows, mine.targets.begin());
    st::models::gpt_model<float> m{model_config};
    st::trainer<st::models::gpt_model<float>, Plan, st::cuda_emulated> t(
        [&](ctx_t& c) { return st::comm::device_local::communicator<ctx_t>(std::move(host), c); },
        m, make_optimizer<float>(true), options(0.5),
        {.sequences = mine.sequences, .seq = mine.seq});
    if (load_from != nullptr)
      (void)st::io::load(t, *load_from);
    device_outcome o;
    steps_on<float, Plan>(t, mine, steps_n, o);
    if (save_to != nullptr)
      (void)st::io::save(t, *save_to);
    auto p = parameters_of(t);
    std::lock_guard lock(mu);
    if (r == 0) {
      out = std::move(o);
      out.p = std::move(p);
    }
  });
  return out;
}

} // namespace

namespace {

/// 2 replicas under Plan train 2 steps and save; one device rank loads: its parameters are the
/// replicas' bit for bit, and its next step is the replicas' next step (they load the same
/// files) within the f32 contract; then one rank's checkpoint loads into the replicas.
template <class Plan>
void require_replicas_and_one(std::string const& name, token_data const& d) {
  auto const root = root_of(name);
  auto const replicas = run_replicas<Plan>(2, d, 2, nullptr, &root);
  auto const dir = root / "step-00000002";
  st::models::gpt_model<float> m{model_config};
  st::trainer<st::models::gpt_model<float>, st::plan<>, st::cuda_emulated> one(
      m, make_optimizer<float>(true), options(0.5), {.sequences = d.sequences, .seq = d.seq});
  REQUIRE(st::io::load(one, dir) == 2);
  auto const loaded = parameters_of(one);
  for (auto const& [n, v] : replicas.p) {
    INFO(name << ": " << n);
    CHECK(loaded.at(n) == v);
  }
  device_outcome next_one;
  steps_on<float, st::plan<>>(one, d, 1, next_one);
  auto const next_replicas = run_replicas<Plan>(2, d, 1, &dir, nullptr);
  double const rel =
      std::abs(next_one.losses[0] - next_replicas.losses[0]) / std::abs(next_replicas.losses[0]);
  INFO(name << ": the next step's loss, one rank " << next_one.losses[0] << ", replicas "
            << next_replicas.losses[0]);
  CHECK(rel <= 1e-5);
  auto const after_one = parameters_of(one);
  double worst = 0;
  for (auto const& [n, v] : next_replicas.p) {
    double const moved = diff2(v, loaded.at(n));
    if (moved > 0)
      worst = std::max(worst, diff2(after_one.at(n), v) / moved);
  }
  INFO(name << ": the next step's worst parameter error " << worst << " of how far it moved");
  CHECK(worst <= 1e-4);
  // the reverse: one rank's checkpoint (step 3) into the replicas, who hold it bit for bit
  auto const root1 = root_of(name + "_one");
  (void)st::io::save(one, root1);
  auto const dir1 = root1 / "step-00000003";
  auto const back = run_replicas<Plan>(2, d, 0, &dir1, nullptr);
  for (auto const& [n, v] : after_one) {
    INFO(name << ": loaded by the replicas: " << n);
    CHECK(back.p.at(n) == v);
  }
  fs::remove_all(root);
  fs::remove_all(root1);
}

} // namespace

TEST_CASE("device checkpoint: ZeRO-3 and ZeRO-1 replicas save their slices, one device rank "
          "loads them, and the reverse",
          "[device][checkpoint]") {
  token_data const d(batch, seq, vocab, 0xc4e3);
  require_replicas_and_one<st::plan<st::sharded<st::zero<3>>>>("zero3", d);
  require_replicas_and_one<st::plan<st::sharded<st::zero<1>>>>("zero1", d);
}

TEST_CASE("device checkpoint: the host trainer's files load on the device and come back bit for "
          "bit",
          "[device][checkpoint]") {
  token_data const d(batch, seq, vocab, 0xc4e4);
  auto const root = root_of("host");
  st::models::gpt_model<float> m{model_config};
  using host_t = st::trainer<st::models::gpt_model<float>, st::plan<>>;
  host_t h(m, make_optimizer<float>(true), options(0.5));
  for (int k = 0; k < 3; ++k)
    (void)h.step(d.view<float>());
  (void)st::io::save(h, root);
  st::trainer<st::models::gpt_model<float>, st::plan<>, st::cuda_emulated> dev(
      m, make_optimizer<float>(true), options(0.5), {.sequences = d.sequences, .seq = d.seq});
  REQUIRE(st::io::load(dev, root / "step-00000003") == 3);
  auto const on_device = parameters_of(dev);
  h.for_each_parameter([&](auto& p) {
    INFO("host to device: " << p.name());
    CHECK(on_device.at(p.name()) == widened<float>(p.values()));
  });
  // the device saves what it loaded (step 3 again, another root); a fresh host trainer loads
  // it: weights and the optimizer's whole state (moments, step) equal the first host's
  auto const root2 = root_of("host_back");
  (void)st::io::save(dev, root2);
  host_t h2(m, make_optimizer<float>(true), options(0.5));
  REQUIRE(st::io::load(h2, root2 / "step-00000003") == 3);
  std::map<std::string, std::vector<double>> w1, w2;
  h.for_each_parameter([&](auto& p) { w1[p.name()] = widened<float>(p.values()); });
  h2.for_each_parameter([&](auto& p) { w2[p.name()] = widened<float>(p.values()); });
  CHECK(w1 == w2);
  auto const s1 = h.optimizer().save(), s2 = h2.optimizer().save();
  for (auto const& [name, a] : s1) {
    INFO("the optimizer's " << name);
    REQUIRE(s2.contains(name));
    CHECK(s2.at(name).bytes == a.bytes);
  }
  // and the next step of each is the same step
  CHECK(h2.step(d.view<float>()).loss == h.step(d.view<float>()).loss);
  fs::remove_all(root);
  fs::remove_all(root2);
}

TEST_CASE("device checkpoint: an asynchronous save holds the state at the step of the save while "
          "training goes on",
          "[device][checkpoint]") {
  token_data const d(batch, seq, vocab, 0xc4e5);
  auto const root = root_of("async");
  st::models::gpt_model<float> m{model_config};
  using dev_t =
      st::trainer<st::models::gpt_model<float>, st::plan<st::precision::bf16>, st::cuda_emulated>;
  dev_t t(m, make_optimizer<float>(true), options(0.5), {.sequences = d.sequences, .seq = d.seq});
  device_outcome whole;
  steps_on<float, void>(t, d, 3, whole);
  st::io::async_saver saver;
  saver.save(t, root);
  // the staging (the host copy) is counted while the save is in flight, and freed after
  std::size_t const staged = t.ledger().current(st::memory_kind::checkpoint_staging);
  steps_on<float, void>(t, d, 2, whole); // steps 4 and 5 while it writes
  (void)saver.wait();
  CHECK(t.ledger().current(st::memory_kind::checkpoint_staging) == 0);
  CHECK(staged > 0);
  auto const p5 = parameters_of(t);
  dev_t r(m, make_optimizer<float>(true), options(0.5), {.sequences = d.sequences, .seq = d.seq});
  REQUIRE(st::io::load(r, root / "step-00000003") == 3);
  device_outcome resumed;
  steps_on<float, void>(r, d, 2, resumed);
  CHECK(resumed.losses[0] == whole.losses[3]);
  CHECK(resumed.losses[1] == whole.losses[4]);
  CHECK(parameters_of(r) == p5);
  fs::remove_all(root);
}
