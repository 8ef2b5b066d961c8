// One rank of the multi-process rendezvous test: meets the others, then exchanges values.
#include "strata/comm/rendezvous/env.hpp"

#include <cstdint>
#include <cstdio>
#include <exception>
#include <string>

namespace {

// Deterministic per rank, so every rank can check what every other rank wrote; the length
// varies with the rank so that values of different sizes cross the store.
std::string value_of(int rank) {
  std::uint64_t x = 0x9e3779b97f4a7c15ull * static_cast<std::uint64_t>(rank + 1);
  std::string s;
  auto const length = 17 + 3001 * static_cast<std::size_t>(rank);
  while (s.size() < length) {
    x ^= x >> 31;
    x *= 0xbf58476d1ce4e5b9ull;
    x ^= x >> 27;
    s.push_back(static_cast<char>(x & 0xff));
  }
  return s;
}

} // namespace

int main() {
  try {
    auto r = strata::comm::rendezvous_from_env();
    auto& store = *r.store;
    store.set("value/" + std::to_string(r.rank), value_of(r.rank));
    for (int q = 0; q < r.world_size; ++q) {
      auto const got = store.get("value/" + std::to_string(q));
      if (got != value_of(q)) {
        std::fprintf(stderr, "rank %d: value/%d differs: expected %zu bytes, got %zu bytes%s\n",
                     r.rank, q, value_of(q).size(), got.size(),
                     got.size() == value_of(q).size() ? " with different content" : "");
        return 2;
      }
    }
    store.add("counter", r.rank + 1);
    strata::comm::store_barrier(store, "after-add", r.rank, r.world_size);
    if (r.rank == 0) {
      auto const expected = std::int64_t{r.world_size} * (r.world_size + 1) / 2;
      auto const total = store.add("counter", 0);
      if (total != expected) {
        std::fprintf(stderr, "rank 0: counter is %lld after the barrier, expected %lld\n",
                     static_cast<long long>(total), static_cast<long long>(expected));
        return 2;
      }
    }
    // A second use of the same barrier name must not pass on the first round's keys.
    strata::comm::store_barrier(store, "after-add", r.rank, r.world_size);
    return 0;
  } catch (strata::error const& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  } catch (std::exception const& e) {
    std::fprintf(stderr, "unexpected exception: %s\n", e.what());
    return 3;
  }
}
