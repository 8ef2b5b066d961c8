// The troubleshooting detectors' findings (strata/profile/troubleshoot.hpp) as pure functions of
// their readings: each fires on its condition, with the numbers and the fix, and stays silent on
// correct use. The trainer's wiring of them is tested in detectors_test.cpp.
#include <strata/comm/detail/failure_hook.hpp>
#include <strata/core/buffer.hpp>
#include <strata/core/error.hpp>
#include <strata/core/memory.hpp>
#include <strata/core/warning.hpp>
#include <strata/profile/troubleshoot.hpp>
#include <strata/train/detectors.hpp>

#include <catch2/catch.hpp>

#include <array>
#include <cstdint>
#include <string>
#include <vector>

namespace st = strata;
namespace sp = strata::profile;
namespace sd = strata::detectors;

namespace {

constexpr std::uint64_t mib = std::uint64_t{1} << 20;
constexpr std::uint64_t gib = std::uint64_t{1} << 30;

// A host where NCCL would find nothing wrong: 8 GiB of writable /dev/shm, lo and eth0 up with
// addresses, the driver newer than the runtime.
sp::readings healthy_host() {
  sp::readings r;
  r.found.cuda = true;
  r.cuda_runtime = 13000;
  r.cuda_driver = 13010;
  r.shm = {.present = true, .writable = true, .total_bytes = 8 * gib, .free_bytes = 8 * gib};
  r.interfaces = {{"lo", {"127.0.0.1"}, true, true}, {"eth0", {"10.0.0.5"}, true, false}};
  return r;
}

bool contains(std::string const& s, std::string const& part) {
  return s.find(part) != std::string::npos;
}

} // namespace

TEST_CASE("NCCL system error: each machine cause is named with its numbers and fix",
          "[troubleshoot][nccl]") {
  std::string const fine = sp::nccl_error_causes(healthy_host());
  CHECK(contains(fine, "no known cause found"));
  CHECK_FALSE(contains(fine, "FAIL"));
  CHECK_FALSE(contains(fine, "WARNING"));

  auto small = healthy_host();
  small.shm.total_bytes = small.shm.free_bytes = 64 * mib; // Docker's default
  std::string const s = sp::nccl_error_causes(small);
  CHECK(contains(s, "WARNING shm: /dev/shm 64.0 MiB"));
  CHECK(contains(s, "--shm-size"));
  CHECK_FALSE(contains(s, "no known cause found"));

  auto locked = healthy_host();
  locked.shm.writable = false;
  CHECK(contains(sp::nccl_error_causes(locked), "FAIL shm"));
  CHECK(contains(sp::nccl_error_causes(locked), "not writable"));

  auto wrong_if = healthy_host();
  wrong_if.env["NCCL_SOCKET_IFNAME"] = "eth9";
  std::string const w = sp::nccl_error_causes(wrong_if);
  CHECK(contains(w, "FAIL nccl_env"));
  CHECK(contains(w, "NCCL_SOCKET_IFNAME=eth9 selects no interface that is up"));
  CHECK(contains(w, "use one of: lo, eth0"));

  auto old_driver = healthy_host();
  old_driver.cuda_driver = 12040;
  std::string const d = sp::nccl_error_causes(old_driver);
  CHECK(contains(d, "FAIL cuda"));
  CHECK(contains(d, "older than the runtime's 13.0"));
}

TEST_CASE("including the detectors installs the NCCL error hook, which reads this host",
          "[troubleshoot][nccl]") {
  auto const hook = st::comm::detail::nccl_failure_hook().load();
  REQUIRE(hook == &sp::detail::annotate_nccl_failure);
  std::string const text = hook(13010, 13000);
  CHECK(contains(text, "strata checked this host for the known causes of NCCL system errors"));
  CHECK(contains(text, "shm"));
}

TEST_CASE("out of memory: the ledger's table, the dominant kind and each remedy's saving",
          "[troubleshoot][oom]") {
  sd::memory_reading m;
  m.label = "rank 0";
  m.held[static_cast<std::size_t>(st::memory_kind::parameters)] = 100 * mib;
  m.held[static_cast<std::size_t>(st::memory_kind::gradients)] = 100 * mib;
  m.held[static_cast<std::size_t>(st::memory_kind::optimizer_state)] = 200 * mib;
  m.held[static_cast<std::size_t>(st::memory_kind::activations)] = 40 * mib;
  m.capacity = 450 * mib;
  // 440 MiB held, 50 MiB of optimizer state asked: 40 MiB over.
  std::string const a =
      sd::oom_advice(m, static_cast<int>(st::memory_kind::optimizer_state), 50 * mib,
                     {.data_parallel = 4, .zero_stage = 0, .recompute_every = 0, .layers = 8});
  CHECK(contains(a, "asked for 50.00 MiB of optimizer_state with 440.00 MiB held of a capacity "
                    "of 450.00 MiB"));
  CHECK(contains(a, "optimizer_state dominate (51% with the request)"));
  // ZeRO-1 over 4: 200 -> 50 MiB (saves 150), ZeRO-2 adds 75, ZeRO-3 adds 75.
  CHECK(contains(a, "sharded<zero<1>> over dp 4: optimizer state 200.00 MiB -> 50.00 MiB, saves "
                    "150.00 MiB"));
  CHECK(contains(a, "sharded<zero<2>> over dp 4: gradients 100.00 MiB -> 25.00 MiB, saves "
                    "225.00 MiB in all"));
  CHECK(contains(a, "sharded<zero<3>> over dp 4: parameters 100.00 MiB -> 25.00 MiB, saves "
                    "300.00 MiB in all"));
  // Recompute: 40 MiB of activations, 1/8 kept.
  CHECK(contains(a, "recompute<every<1>>: activations 40.00 MiB -> about 5.00 MiB"));
  // The first remedy that saves the 40 MiB over: recompute saves 35, ZeRO-1 150.
  CHECK(contains(a, "fix: sharded<zero<1>> over dp 4 saves enough (40.00 MiB over the capacity)"));

  // Under ZeRO-1 already, at dp 1: no ZeRO saving, recompute is the remedy.
  std::string const b = sd::oom_advice(m, static_cast<int>(st::memory_kind::activations), 20 * mib,
                                       {.data_parallel = 1, .layers = 8});
  CHECK(contains(b, "activations 60.00 MiB -> about 7.50 MiB"));
  CHECK(contains(b, "with dp = 1 it saves nothing"));
  CHECK(contains(b, "fix: recompute<every<1>>"));
  // Nothing saves enough: the advice says so.
  std::string const c = sd::oom_advice(m, static_cast<int>(st::memory_kind::activations), 500 * mib,
                                       {.data_parallel = 2, .zero_stage = 3});
  CHECK(contains(c, "sharded<zero<3>>: in use"));
  CHECK(contains(c, "no one remedy saves"));
}

TEST_CASE("a ledger's capacity makes a buffer throw, with the request's bytes and kind",
          "[troubleshoot][oom]") {
  st::memory_ledger ledger("capped");
  ledger.set_capacity(1000);
  st::buffer<float> a(200, st::memory_kind::parameters, ledger); // 800 bytes: fits
  CHECK(ledger.current() == 800);
  try {
    st::buffer<float> b(51, st::memory_kind::activations, ledger); // 204 bytes: 4 over
    FAIL("the buffer past the capacity did not throw");
  } catch (st::allocation_error const& e) {
    CHECK(e.requested_bytes() == 204);
    CHECK(e.requested_kind() == static_cast<int>(st::memory_kind::activations));
    CHECK(contains(e.what(), "does not fit"));
  }
  CHECK(ledger.current() == 800);                                // nothing recorded
  st::buffer<float> c(50, st::memory_kind::activations, ledger); // exactly the capacity
  CHECK(ledger.current() == 1000);
}

TEST_CASE("learning rate: a global batch that changed with the rate kept is named, with both "
          "factors",
          "[troubleshoot][lr]") {
  sd::lr_reference const then{.global_batch = 64, .data_parallel = 2, .step = 100, .lr = 3e-4};
  std::string const f = sd::lr_scaling_finding(then, 128, 4, 3e-4);
  CHECK(contains(f, "the global batch is 128 (dp 4) but the learning rate 0.0003 was set for 64 "
                    "(dp 2, step 100)"));
  CHECK(contains(f, "linear rule, x2 -> 0.0006"));
  CHECK(contains(f, "square-root rule, x1.41421 -> 0.000424264"));
  CHECK(contains(f, "keep the global batch: 16 samples per rank"));
  // Silent: the same batch; the rate scaled (linear or sqrt); no reference.
  CHECK(sd::lr_scaling_finding(then, 64, 4, 3e-4).empty());
  CHECK(sd::lr_scaling_finding(then, 128, 4, 6e-4).empty());
  CHECK(sd::lr_scaling_finding(then, 128, 4, 3e-4 * 1.4142135623730951).empty());
  CHECK(sd::lr_scaling_finding({}, 128, 4, 3e-4).empty());
}

TEST_CASE("data: ranks with the same samples, different seeds or places are named",
          "[troubleshoot][data]") {
  // Correct use: different batches, one seed, one place.
  std::vector<sd::batch_record> ok{{11, 0, 0, 7, 1}, {12, 0, 0, 7, 1}, {13, 0, 0, 7, 1}};
  CHECK(sd::sharding_findings(ok).empty());
  CHECK(sd::sharding_findings(std::vector<sd::batch_record>{{1, 0, 0, 0, 0}}).empty());

  std::vector<sd::batch_record> same{{5, 0, 0, 7, 1}, {5, 0, 0, 7, 1}, {5, 0, 0, 7, 1}};
  std::string const s = sd::sharding_findings(same);
  CHECK(contains(s, "every data-parallel rank (0, 1, 2) got the same samples"));
  CHECK(contains(s, "distributed_sampler(size, mesh.dp().size(), mesh.dp().rank())"));

  std::vector<sd::batch_record> two{{5, 0, 0, 7, 1}, {6, 0, 0, 7, 1}, {5, 0, 0, 7, 1}};
  CHECK(contains(sd::sharding_findings(two), "data-parallel ranks 0, 2 got the same samples"));

  std::vector<sd::batch_record> seeds{{1, 0, 0, 7, 1}, {2, 0, 0, 8, 1}};
  std::string const d = sd::sharding_findings(seeds);
  CHECK(contains(d, "different seeds (rank 0: 7, rank 1: 8)"));
  CHECK_FALSE(contains(d, "same samples"));

  std::vector<sd::batch_record> places{{1, 0, 0, 7, 1}, {2, 1, 3, 7, 1}};
  CHECK(
      contains(sd::sharding_findings(places),
               "different places of the data (rank 0: epoch 0 batch 0, rank 1: epoch 1 batch 3)"));
  // Batches made by hand carry no origin: only the fingerprints count.
  std::vector<sd::batch_record> hand{{1, 0, 0, 0, 0}, {2, 5, 5, 9, 0}};
  CHECK(sd::sharding_findings(hand).empty());
}

TEST_CASE("data: an epoch that restarts instead of advancing is said once",
          "[troubleshoot][data]") {
  sd::epoch_watch ok;
  int said = 0;
  for (std::uint64_t e = 0; e < 3; ++e)
    for (std::uint64_t i = 0; i < 4; ++i)
      said += !ok.observe(e, i, static_cast<std::int64_t>(e * 4 + i + 1)).empty();
  CHECK(said == 0);

  sd::epoch_watch stuck;
  std::vector<std::string> findings;
  for (int pass = 0; pass < 3; ++pass)
    for (std::uint64_t i = 0; i < 4; ++i)
      if (auto f = stuck.observe(0, i, pass * 4 + static_cast<std::int64_t>(i) + 1); !f.empty())
        findings.push_back(f);
  REQUIRE(findings.size() == 1);
  CHECK(contains(findings[0], "at step 5 the data went back to epoch 0 batch 0 after epoch 0 "
                              "batch 3: the epoch did not advance"));
}

TEST_CASE("warnings go to the handler that is set", "[troubleshoot]") {
  std::vector<std::string> got;
  auto previous = st::set_warning_handler([&](std::string_view t) { got.emplace_back(t); });
  st::warn("one");
  st::warn("two");
  st::set_warning_handler(previous);
  CHECK(got == std::vector<std::string>{"one", "two"});
}
