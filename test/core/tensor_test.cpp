// Tensor views: row-major strides, element access, contiguity, slices, views of buffers,
// and the shape errors with their numbers.
#include "../support/seed.hpp"

#include <strata/core/buffer.hpp>
#include <strata/core/tensor.hpp>

#include <catch2/catch.hpp>

#include <array>
#include <cstdint>
#include <vector>

namespace {

using strata::tensor_view;

std::vector<double> random_values(std::uint64_t seed, std::size_t n) {
  std::vector<double> v(n);
  for (std::size_t i = 0; i < n; ++i)
    v[i] = static_cast<double>(strata::test::mix(seed, i) % 100003) * 0.5 - 25000.25;
  return v;
}

} // namespace

TEST_CASE("a row-major view has strides from its shape and finds every element", "[tensor]") {
  std::uint64_t const seed = strata::test::seed();
  std::size_t const a = 2 + strata::test::mix(seed, 0) % 5;
  std::size_t const b = 2 + strata::test::mix(seed, 1) % 5;
  std::size_t const c = 2 + strata::test::mix(seed, 2) % 5;
  std::size_t const d = 2 + strata::test::mix(seed, 3) % 5;
  auto data = random_values(seed, a * b * c * d);

  tensor_view<double> t4(data.data(), {a, b, c, d});
  CHECK(t4.rank() == 4);
  CHECK(t4.size() == data.size());
  CHECK(t4.stride(3) == 1);
  CHECK(t4.stride(2) == d);
  CHECK(t4.stride(1) == c * d);
  CHECK(t4.stride(0) == b * c * d);
  CHECK(t4.contiguous());
  for (std::size_t i = 0; i < a; ++i)
    for (std::size_t j = 0; j < b; ++j)
      for (std::size_t k = 0; k < c; ++k)
        for (std::size_t l = 0; l < d; ++l)
          REQUIRE(&t4(i, j, k, l) == &data[((i * b + j) * c + k) * d + l]);

  tensor_view<double> t2(data.data(), {a * b, c * d});
  CHECK(t2(1, 2) == data[c * d + 2]);
  t2(1, 2) = 7.5;
  CHECK(data[c * d + 2] == 7.5);
  tensor_view<double> t1(data.data(), {data.size()});
  CHECK(t1.span().data() == data.data());
  CHECK(t1.span().size() == data.size());
  tensor_view<double const> ct = t2;
  CHECK(ct(1, 2) == 7.5);
  CHECK(ct.shape()[1] == c * d);
}

TEST_CASE("explicit strides give non-contiguous views such as a transpose", "[tensor]") {
  std::uint64_t const seed = strata::test::seed();
  std::size_t const rows = 3 + strata::test::mix(seed, 4) % 6;
  std::size_t const cols = 3 + strata::test::mix(seed, 5) % 6;
  auto data = random_values(seed + 1, rows * cols);
  tensor_view<double> m(data.data(), {rows, cols});
  tensor_view<double> t(data.data(), {cols, rows}, {1, cols});
  CHECK_FALSE(t.contiguous());
  for (std::size_t i = 0; i < rows; ++i)
    for (std::size_t j = 0; j < cols; ++j)
      REQUIRE(t(j, i) == m(i, j));
  CHECK_THROWS_AS(t.span(), strata::shape_error);

  // Dimensions of extent 1 may have any stride; an empty view is contiguous.
  CHECK(tensor_view<double>(data.data(), {1, cols}, {12345, 1}).contiguous());
  CHECK(tensor_view<double>(data.data(), {rows, 0}, {7, 3}).contiguous());
  CHECK(tensor_view<double>().empty());
  CHECK(tensor_view<double>().contiguous());
  // Every other column: not contiguous.
  CHECK_FALSE(tensor_view<double>(data.data(), {rows, cols / 2}, {cols, 2}).contiguous());
}

TEST_CASE("slicing the leading dimension keeps strides and shifts the data", "[tensor]") {
  std::uint64_t const seed = strata::test::seed();
  std::size_t const n = 5 + strata::test::mix(seed, 6) % 20;
  auto data = random_values(seed + 2, n * 3 * 4);
  tensor_view<double> t(data.data(), {n, 3, 4});
  std::size_t const b = strata::test::mix(seed, 7) % n;
  std::size_t const e = b + strata::test::mix(seed, 8) % (n - b + 1);
  auto s = t.slice(b, e);
  CHECK(s.extent(0) == e - b);
  CHECK(s.extent(1) == 3);
  CHECK(s.stride(0) == 12);
  CHECK(s.contiguous());
  CHECK(s.span().size() == (e - b) * 12);
  for (std::size_t i = 0; i < e - b; ++i)
    for (std::size_t j = 0; j < 3; ++j)
      for (std::size_t k = 0; k < 4; ++k)
        REQUIRE(&s(i, j, k) == &t(b + i, j, k));
  CHECK(t.slice(n, n).empty());

  // A slice of a transposed view stays strided.
  tensor_view<double> tt(data.data(), {4, n * 3}, {1, 4});
  auto ts = tt.slice(1, 3);
  CHECK(ts(1, 5) == tt(2, 5));
  CHECK_FALSE(ts.contiguous());
}

TEST_CASE("bad shapes, strides and slices throw shape_error with the numbers", "[tensor]") {
  std::vector<float> data(64, 1.25f);
  using Catch::Matchers::Message;
  CHECK_THROWS_MATCHES((tensor_view<float>(data.data(), {2, 2, 2, 2, 2})), strata::shape_error,
                       Message("strata: tensor_view of rank 5 (shape [2, 2, 2, 2, 2]): the rank "
                               "must be 1 to 4; merge dimensions"));
  CHECK_THROWS_MATCHES((tensor_view<float>(data.data(), {4, 4}, {4})), strata::shape_error,
                       Message("strata: tensor_view of shape [4, 4] given 1 strides [4]; give "
                               "one stride per dimension"));
  tensor_view<float> t(data.data(), {8, 8});
  CHECK_THROWS_MATCHES(t.slice(3, 9), strata::shape_error,
                       Message("strata: slice [3, 9) of the leading dimension of a tensor of "
                               "shape [8, 8]: need begin <= end <= 8"));
  CHECK_THROWS_AS(t.slice(5, 4), strata::shape_error);
}

TEST_CASE("views of buffers cover their first elements", "[tensor]") {
  std::uint64_t const seed = strata::test::seed();
  strata::memory_ledger ledger;
  strata::buffer<float> buf(6 * 7, strata::memory_kind::activations, ledger);
  for (std::size_t i = 0; i < buf.size(); ++i)
    buf.span()[i] = static_cast<float>(strata::test::mix(seed, i) % 1000) + 0.5f;
  auto v = strata::view(buf, {6, 7});
  CHECK(v.data() == buf.data());
  CHECK(v(5, 6) == buf.span()[41]);
  auto const& cbuf = buf;
  tensor_view<float const> cv = strata::view(cbuf, {2, 3});
  CHECK(cv(1, 2) == buf.span()[5]);
  CHECK_THROWS_MATCHES(strata::view(buf, {6, 8}), strata::shape_error,
                       Catch::Matchers::Message("strata: a view of shape [6, 8] (48 elements) of "
                                                "a buffer of 42 elements: make the buffer "
                                                "larger"));
  CHECK(ledger.allocations() == 1);
}
