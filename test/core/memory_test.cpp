// Memory accounting and buffers: current and peak bytes per kind through allocations, frees
// and moves; the allocation counter; alignment; threads recording at once.
#include "../support/seed.hpp"

#include <strata/core/buffer.hpp>
#include <strata/core/float16.hpp>
#include <strata/core/memory.hpp>

#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdint>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace {

using strata::buffer;
using strata::memory_kind;
using strata::memory_ledger;

// A device whose allocations always fail, as a full device's would.
struct full_device : strata::host {
  static void* allocate(std::size_t bytes) {
    throw strata::allocation_error("strata: test allocation of " + std::to_string(bytes) +
                                   " bytes failed");
  }
};
static_assert(strata::device_policy<full_device>);

std::size_t random_count(std::uint64_t seed, std::uint64_t i, std::size_t max) {
  return 1 + static_cast<std::size_t>(strata::test::mix(seed, i) % max);
}

} // namespace

TEST_CASE("a ledger counts current and peak bytes per kind and in total", "[memory]") {
  std::uint64_t const seed = strata::test::seed();
  memory_ledger ledger("rank 0");
  std::size_t const np = random_count(seed, 0, 100000);
  std::size_t const ng = random_count(seed, 1, 100000);
  std::size_t const na = random_count(seed, 2, 100000);

  buffer<float> params(np, memory_kind::parameters, ledger);
  buffer<strata::bf16> grads(ng, memory_kind::gradients, ledger);
  CHECK(ledger.current(memory_kind::parameters) == np * 4);
  CHECK(ledger.current(memory_kind::gradients) == ng * 2);
  CHECK(ledger.current() == np * 4 + ng * 2);
  CHECK(ledger.allocations() == 2);
  {
    buffer<double> acts(na, memory_kind::activations, ledger);
    CHECK(ledger.current(memory_kind::activations) == na * 8);
    CHECK(ledger.peak() == np * 4 + ng * 2 + na * 8);
  }
  CHECK(ledger.current(memory_kind::activations) == 0);
  CHECK(ledger.peak(memory_kind::activations) == na * 8);
  CHECK(ledger.current() == np * 4 + ng * 2);
  CHECK(ledger.peak() == np * 4 + ng * 2 + na * 8);
  CHECK(ledger.allocations() == 3);
  CHECK(ledger.frees() == 1);
  for (auto k : {memory_kind::optimizer_state, memory_kind::communication, memory_kind::workspace})
    CHECK((ledger.current(k) == 0 && ledger.peak(k) == 0));

  // The peak of the total is the highest total, not the sum of the kinds' peaks.
  buffer<float> workspace(na, memory_kind::workspace, ledger);
  CHECK(ledger.peak() == np * 4 + ng * 2 + std::max(na * 8, na * 4));

  ledger.reset_peaks();
  CHECK(ledger.peak(memory_kind::activations) == 0);
  CHECK(ledger.peak(memory_kind::parameters) == np * 4);
  CHECK(ledger.peak() == ledger.current());

  params.reset();
  CHECK(params.empty());
  CHECK(params.data() == nullptr);
  CHECK(ledger.current(memory_kind::parameters) == 0);
  CHECK(ledger.peak(memory_kind::parameters) == np * 4);
  CHECK(ledger.frees() == 2);
}

TEST_CASE("moving a buffer moves its accounting and records nothing", "[memory]") {
  std::uint64_t const seed = strata::test::seed();
  memory_ledger ledger;
  std::size_t const n = random_count(seed, 10, 50000);
  std::size_t const m = random_count(seed, 11, 50000);

  buffer<float> a(n, memory_kind::optimizer_state, ledger);
  float* const p = a.data();
  buffer<float> b(std::move(a));
  CHECK(b.data() == p);
  CHECK(b.size() == n);
  CHECK(b.kind() == memory_kind::optimizer_state);
  CHECK(b.ledger() == &ledger);
  CHECK(a.empty()); // NOLINT(bugprone-use-after-move): a moved-from buffer is empty
  CHECK(ledger.current(memory_kind::optimizer_state) == n * 4);
  CHECK((ledger.allocations() == 1 && ledger.frees() == 0));

  // Move assignment frees what the target held, under the target's kind.
  buffer<float> c(m, memory_kind::communication, ledger);
  c = std::move(b);
  CHECK(c.data() == p);
  CHECK(c.kind() == memory_kind::optimizer_state);
  CHECK(ledger.current(memory_kind::communication) == 0);
  CHECK(ledger.peak(memory_kind::communication) == m * 4);
  CHECK(ledger.current(memory_kind::optimizer_state) == n * 4);
  CHECK((ledger.allocations() == 2 && ledger.frees() == 1));

  // Buffers in a vector move when it grows: still one allocation each.
  std::vector<buffer<float>> v;
  for (std::uint64_t i = 0; i < 20; ++i)
    v.emplace_back(random_count(seed, 100 + i, 1000), memory_kind::activations, ledger);
  CHECK(ledger.allocations() == 22);
  v.clear();
  CHECK(ledger.current(memory_kind::activations) == 0);
  CHECK(ledger.frees() == 21);
}

TEST_CASE("a zero-size buffer allocates and records nothing", "[memory]") {
  memory_ledger ledger;
  buffer<double> z(0, memory_kind::parameters, ledger);
  CHECK(z.data() == nullptr);
  CHECK(z.empty());
  CHECK(z.span().empty());
  z.fill(1.5);
  CHECK(ledger.allocations() == 0);
  CHECK(ledger.current() == 0);
  buffer<double> d;
  CHECK(d.ledger() == nullptr);
  d = std::move(z);
  CHECK(ledger.frees() == 0);
}

TEST_CASE("buffers are aligned to 64 bytes and hold what is written", "[memory]") {
  std::uint64_t const seed = strata::test::seed();
  memory_ledger ledger;
  for (std::uint64_t i = 0; i < 50; ++i) {
    std::size_t const n = random_count(seed, 200 + i, 5000);
    buffer<strata::f16> h(n, memory_kind::workspace, ledger);
    buffer<double> d(n, memory_kind::workspace, ledger);
    REQUIRE(reinterpret_cast<std::uintptr_t>(h.data()) % 64 == 0);
    REQUIRE(reinterpret_cast<std::uintptr_t>(d.data()) % 64 == 0);
    REQUIRE(h.size_bytes() == 2 * n);

    double const value = static_cast<double>(strata::test::mix(seed, i) % 1000) + 0.25;
    d.fill(value);
    for (double x : d.span())
      REQUIRE(x == value);
    std::vector<double> in(n);
    for (std::size_t j = 0; j < n; ++j)
      in[j] = static_cast<double>(strata::test::mix(seed + i, j) % 997) - 498.5;
    d.copy_from_host(in);
    std::vector<double> out(n);
    d.copy_to_host(out);
    REQUIRE(out == in);
  }
  buffer<float> f(10, memory_kind::workspace, ledger);
  std::vector<float> wrong(11);
  CHECK_THROWS_MATCHES(
      f.copy_from_host(wrong), strata::shape_error,
      Catch::Matchers::Message("strata: buffer::copy_from_host with 11 host elements, but the host "
                               "buffer has 10; pass a span of the buffer's size"));
}

TEST_CASE("an allocation that fails names the request and what the ledger holds", "[memory]") {
  memory_ledger ledger("rank 3");
  buffer<float> held(1000, memory_kind::parameters, ledger);
  CHECK_THROWS_MATCHES(
      (buffer<float, full_device>(256, memory_kind::activations, ledger)), strata::allocation_error,
      Catch::Matchers::Message("strata: test allocation of 1024 bytes failed [activations; ledger "
                               "\"rank 3\" holds 4000 bytes, of them 0 activations]"));
  CHECK(ledger.allocations() == 1);
  CHECK_THROWS_AS((buffer<double>(std::size_t{1} << 62, memory_kind::workspace, ledger)),
                  strata::allocation_error);
  CHECK(ledger.current() == 4000);
}

TEST_CASE("a ledger stays exact while threads allocate and free at once", "[memory]") {
  std::uint64_t const seed = strata::test::seed();
  memory_ledger ledger;
  constexpr int threads = 4;
  constexpr std::uint64_t rounds = 2000;
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t)
    pool.emplace_back([&, t] {
      std::vector<buffer<float>> held;
      for (std::uint64_t i = 0; i < rounds; ++i) {
        auto const kind = static_cast<memory_kind>(i % strata::memory_kind_count);
        held.emplace_back(random_count(seed + static_cast<std::uint64_t>(t), i, 256), kind, ledger);
        if (held.size() > 8)
          held.erase(held.begin());
      }
    });
  for (auto& th : pool)
    th.join();
  CHECK(ledger.allocations() == threads * rounds);
  CHECK(ledger.frees() == threads * rounds);
  CHECK(ledger.current() == 0);
  for (std::size_t k = 0; k < strata::memory_kind_count; ++k)
    CHECK(ledger.current(static_cast<memory_kind>(k)) == 0);
  // No more than 9 buffers of at most 256 floats per thread were ever held at once.
  CHECK(ledger.peak() > 0);
  CHECK(ledger.peak() <= threads * 9 * 256 * sizeof(float));
}

TEST_CASE("the ledger's report names every kind with current and peak bytes", "[memory]") {
  memory_ledger ledger("rank 1");
  buffer<float> p(3u << 20, memory_kind::parameters, ledger);
  { buffer<float> a(1000, memory_kind::activations, ledger); }
  std::string const r = ledger.report();
  INFO(r);
  CHECK(r.find("memory \"rank 1\": 2 allocations, 1 frees") == 0);
  CHECK(r.find("parameters") != std::string::npos);
  CHECK(r.find("12582912 B (12.00 MiB)") != std::string::npos);
  CHECK(r.find("4000 B (3.91 KiB)") != std::string::npos);
  for (std::size_t k = 0; k < strata::memory_kind_count; ++k)
    CHECK(r.find(std::string(strata::name_of(static_cast<memory_kind>(k)))) != std::string::npos);
  CHECK(r.find("total") != std::string::npos);
}

TEST_CASE("buffers without a ledger are counted in the default ledger", "[memory]") {
  auto& ledger = strata::default_ledger();
  auto const before = ledger.allocations();
  auto const held = ledger.current(memory_kind::gradients);
  {
    buffer<float> g(123, memory_kind::gradients);
    CHECK(g.ledger() == &ledger);
    CHECK(ledger.current(memory_kind::gradients) == held + 492);
  }
  CHECK(ledger.allocations() == before + 1);
  CHECK(ledger.current(memory_kind::gradients) == held);
}
