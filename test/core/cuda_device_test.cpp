// The cuda device policy. Without a device: checks the host side of the __half and
// __nv_bfloat16 mapping, prints why the rest cannot run and exits 77 (skipped). With one:
// buffers of the cuda policy allocate, fill, copy and account like host buffers.
#include "../support/seed.hpp"

#include <strata/core/buffer.hpp>
#include <strata/core/cuda/device.hpp>
#include <strata/core/cuda/element.hpp>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

int failures = 0;

void check(bool ok, char const* what) {
  if (!ok) {
    std::printf("FAILED: %s\n", what);
    ++failures;
  }
}

// Host side: every bit pattern keeps its bits through to_cuda/to_host, and the device types'
// traits convert like strata's.
void check_element_mapping() {
  using strata::element_traits;
  static_assert(std::is_same_v<strata::cuda_element_t<strata::f16>, __half>);
  static_assert(std::is_same_v<strata::cuda_element_t<strata::bf16 const>, __nv_bfloat16>);
  static_assert(std::is_same_v<strata::cuda_element_t<float>, float>);
  static_assert(std::is_same_v<strata::host_element_t<__nv_bfloat16>, strata::bf16>);
  static_assert(element_traits<__half>::id == strata::dtype::f16);
  static_assert(std::is_same_v<strata::compute_t<__nv_bfloat16>, float>);
  int bad = 0;
  for (std::uint32_t b = 0; b <= 0xffffu; ++b) {
    auto const h = strata::f16::from_bits(static_cast<std::uint16_t>(b));
    auto const bf = strata::bf16::from_bits(static_cast<std::uint16_t>(b));
    __half const dh = strata::to_cuda(h);
    __nv_bfloat16 const dbf = strata::to_cuda(bf);
    bad += strata::to_host(dh).bits != h.bits;
    bad += strata::to_host(dbf).bits != bf.bits;
    float const fh = element_traits<__half>::to_compute(dh);
    float const fb = element_traits<__nv_bfloat16>::to_compute(dbf);
    // CUDA's own host conversion agrees with strata's (NaN payloads aside).
    float const cuda_fh = __half2float(dh);
    float const cuda_fb = __bfloat162float(dbf);
    bool const nan_h = fh != fh;
    bool const nan_b = fb != fb;
    bad += nan_h ? cuda_fh == cuda_fh : std::memcmp(&fh, &cuda_fh, 4) != 0;
    bad += nan_b ? cuda_fb == cuda_fb : std::memcmp(&fb, &cuda_fb, 4) != 0;
    if (!nan_h) {
      float const x = fh * 1.000377f; // mostly between neighbours: a rounding to check
      bad += strata::to_host(element_traits<__half>::from_compute(x)).bits != strata::f16(x).bits;
      __half const cuda_rn = __float2half_rn(x);
      bad += strata::to_host(cuda_rn).bits != strata::f16(x).bits;
    }
  }
  check(bad == 0, "f16/bf16 <-> __half/__nv_bfloat16 keep bits and round alike");
}

void check_device_buffers() {
  std::uint64_t const seed = strata::test::seed();
  strata::memory_ledger ledger("cuda:0");
  std::size_t const n = 1000 + strata::test::mix(seed, 0) % 100000;
  strata::buffer<float, strata::cuda> buf(n, strata::memory_kind::parameters, ledger);
  check(reinterpret_cast<std::uintptr_t>(buf.data()) % 256 == 0, "256-byte alignment");
  check(ledger.current(strata::memory_kind::parameters) == n * 4, "accounted bytes");

  std::vector<float> in(n);
  for (std::size_t i = 0; i < n; ++i)
    in[i] = static_cast<float>(strata::test::mix(seed, i) % 10007) - 5003.5f;
  buf.copy_from_host(in);
  std::vector<float> out(n, -1.0f);
  buf.copy_to_host(out);
  check(out == in, "host -> device -> host round trip");

  float const value = 3.0f + static_cast<float>(seed % 97); // bytes not all equal: the doubling
  buf.fill(value);
  buf.copy_to_host(out);
  bool all = true;
  for (float x : out)
    all = all && x == value;
  check(all, "fill with a value of unequal bytes");
  buf.fill(0.0f);
  buf.copy_to_host(out);
  all = true;
  for (float x : out)
    all = all && x == 0.0f;
  check(all, "fill with zero (memset)");

  strata::buffer<float, strata::cuda> moved(std::move(buf));
  moved.reset();
  check(ledger.current() == 0 && ledger.allocations() == 1 && ledger.frees() == 1,
        "free after a move is recorded once");
}

} // namespace

int main() {
  try {
    check_element_mapping();
    int const devices = strata::cuda::device_count();
    if (devices == 0) {
      std::printf("%s; skipped: no CUDA device on this machine, so the cuda device policy "
                  "cannot run (gpu test)\n",
                  failures ? "element mapping FAILED" : "element mapping checked");
      return failures ? 1 : 77;
    }
    std::printf("%d CUDA device(s)\n", devices);
    check_device_buffers();
  } catch (std::exception const& e) {
    std::printf("FAILED: %s\n", e.what());
    return 1;
  }
  std::printf("%s\n", failures ? "FAILED" : "ok");
  return failures ? 1 : 0;
}
