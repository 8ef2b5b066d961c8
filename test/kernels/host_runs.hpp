// The two host runs of a device functor behind one interface: Thrust's CPP system over plain host
// memory, and the emulated device over its own memory (filled and read only through copies).
#pragma once

#include "support.hpp"

#include <strata/core/cuda_emulated/context.hpp>
#include <strata/core/cuda_emulated/launch.hpp>
#include <strata/core/element.hpp>

#include <algorithm>
#include <cstddef>
#include <limits>
#include <memory>
#include <vector>

namespace strata::test {

/// Where a functor runs on the host.
enum class host_run { thrust, emulated };

inline char const* name_of(host_run r) {
  return r == host_run::thrust ? "thrust cpp" : "emulated";
}

/// Buffers and launches of one host run. On the emulated device, buffers come from the context
/// while the program is built (seal() ends that) and the host touches them only through
/// write/read (copy_async, and a counted synchronize before reading).
class host_device {
public:
  explicit host_device(host_run r) : run_(r), ctx_({.gemm_workspace = 64}) {}

  host_run run() const noexcept { return run_; }
  emulated_context& context() noexcept { return ctx_; }

  /// A buffer holding `init`.
  template <class T>
  T* buffer(std::vector<T> const& init) {
    T* p;
    if (run_ == host_run::thrust) {
      auto v = std::make_shared<std::vector<T>>(init.size() == 0 ? 1 : init.size());
      keep_.push_back(v);
      p = v->data();
    } else {
      p = ctx_.allocate<T>(memory_kind::workspace, init.size());
    }
    write(p, init);
    return p;
  }
  void seal() { ctx_.seal(); }

  template <class T>
  void write(T* p, std::vector<T> const& v) {
    if (run_ == host_run::thrust)
      std::copy(v.begin(), v.end(), p);
    else
      ctx_.copy_async(ctx_.compute_stream(), p, v.data(), v.size() * sizeof(T));
  }
  template <class T>
  std::vector<T> read(T const* p, std::size_t n) {
    std::vector<T> v(n);
    if (run_ == host_run::thrust) {
      std::copy(p, p + n, v.begin());
    } else {
      ctx_.copy_async(ctx_.compute_stream(), v.data(), p, n * sizeof(T));
      ctx_.synchronize(ctx_.compute_stream(), "test read-back");
    }
    return v;
  }

  /// f(i) for i in [0, n): thrust_elements or launch_elements.
  template <class F>
  void elements(std::size_t n, F const& f) {
    if (run_ == host_run::thrust)
      thrust_elements(f, n);
    else
      launch_elements(ctx_, ctx_.compute_stream(), n, f);
  }
  /// A row kernel over [0, rows): thrust_rows (one lane) or launch_rows with `lanes`.
  template <class K>
  void rows(std::size_t rows, unsigned lanes, K const& k) {
    if (run_ == host_run::thrust)
      thrust_rows(k, rows);
    else
      launch_rows(ctx_, ctx_.compute_stream(), rows, lanes, k);
  }

private:
  host_run run_;
  emulated_context ctx_;
  std::vector<std::shared_ptr<void>> keep_;
};

/// A quiet NaN of any element type (f16 and bf16 included: numeric_limits has none for them).
template <class T>
T nan_of() {
  using C = compute_t<T>;
  return element_traits<T>::from_compute(std::numeric_limits<C>::quiet_NaN());
}

} // namespace strata::test
