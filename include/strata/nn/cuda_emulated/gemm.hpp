// The emulated device's GEMM: a gemm_plan run by strata's host GEMM, then the epilogue with the
// math cuBLASLt applies (core/cuda/gemm.hpp is the device's twin).
//
// It lives in nn/ because the host GEMM does (nn/detail/gemm.hpp) and core/ may not include
// nn/; moving or duplicating the host GEMM into core/ would fork it. Its callers (the layers'
// device twins) are in nn/ and above.
#pragma once

#include <strata/core/cuda_emulated/context.hpp>
#include <strata/core/element.hpp>
#include <strata/core/error.hpp>
#include <strata/core/float16.hpp>
#include <strata/core/kernels/gelu.hpp>
#include <strata/core/kernels/gemm_plan.hpp>
#include <strata/nn/detail/gemm.hpp>

#include <algorithm>
#include <cstddef>
#include <string>

namespace strata {

/// A GEMM plan bound to the emulated context, built once while the program is built; run()
/// computes, per batch, the product in the compute type (f32 for 16-bit and f32 storage, f64 for
/// f64) through nn::detail::gemm into the context's GEMM workspace, a block of rows at a time,
/// then the epilogue per element in the compute type, rounding once to the storage type:
/// - v = alpha P + C_old (accumulate) ; bias: v += bias[j];
/// - gelu_aux(_bias): aux = round(v), C = round(gelu_tanh(v)) (from the unrounded v);
/// - dgelu: C = round(v gelu_tanh'(aux)); dgelu_bgrad also bias[j] = round(sum_i of the unrounded
///   products), summed in row order i = 0, 1, ... whatever the block size;
/// - bgrad: bias[i] = round(sum_p op(A)(i, p)), summed in order p = 0, 1, ....
/// Allocates nothing per call: the workspace is the context's (checked at build to hold a block
/// of at least one row); the host GEMM's packing buffers grow on first use only. Counts one
/// ctx.count_gemm() per run.
class emulated_gemm {
public:
  emulated_gemm(emulated_context& ctx, kernels::gemm_plan const& plan,
                kernels::gemm_operands const& operands = {})
      : ctx_(&ctx), plan_(plan) {
    std::size_t const cbytes = plan.compute == kernels::gemm_compute::f64 ? 8 : 4;
    std::size_t const n = plan.desc.n;
    std::size_t const reserved = plan.desc.epilogue == kernels::gemm_epilogue::dgelu_bgrad ? n : 0;
    std::size_t const ws = ctx.gemm_workspace_bytes() / cbytes;
    if (ws < reserved + n)
      throw config_error("strata: the emulated GEMM needs " +
                         std::to_string((reserved + n) * cbytes) +
                         " bytes of workspace for one row of n = " + std::to_string(n) +
                         " and has " + std::to_string(ctx.gemm_workspace_bytes()) +
                         "; raise device_context_options::gemm_workspace");
    rows_per_block_ = std::min(plan.desc.m, (ws - reserved) / n);
    if (operands.a != nullptr)
      bind(operands);
  }

  kernels::gemm_plan const& plan() const noexcept { return plan_; }
  /// Rows of C computed per block (the workspace holds rows_per_block x n compute values).
  std::size_t rows_per_block() const noexcept { return rows_per_block_; }

  /// Binds the pointers later runs use (checked as the device's: present, aligned).
  void bind(kernels::gemm_operands const& operands) {
    kernels::check_gemm_operands(plan_, operands);
    ops_ = operands;
    bound_ = true;
  }

  /// Runs on the bound pointers, on stream s (executed before the call returns).
  void run(emulated_context::stream_type /*s*/) {
    if (!bound_)
      throw config_error("strata: an emulated GEMM ran before its pointers were bound; pass "
                         "them at build or call bind()");
    ctx_->count_gemm();
    switch (plan_.desc.type) {
    case dtype::f32:
      run_typed<float, float>();
      break;
    case dtype::f64:
      run_typed<double, double>();
      break;
    case dtype::f16:
      if (plan_.desc.wide_out)
        run_typed<f16, float, float>();
      else
        run_typed<f16, float>();
      break;
    case dtype::bf16:
      if (plan_.desc.wide_out)
        run_typed<bf16, float, float>();
      else
        run_typed<bf16, float>();
      break;
    default:
      break; // make_gemm_plan admits no other type
    }
  }
  /// Binds, then runs.
  void run(emulated_context::stream_type s, kernels::gemm_operands const& operands) {
    bind(operands);
    run(s);
  }

private:
  // T: A, B, bias and aux; TC: C (T, or f32 with wide_out); C: the compute type.
  template <class T, class C, class TC = T>
  void run_typed() {
    using kernels::gemm_epilogue;
    kernels::gemm_desc const& d = plan_.desc;
    std::size_t const m = d.m, n = d.n, k = d.k;
    std::size_t const rsa = d.trans_a ? 1 : d.lda, csa = d.trans_a ? d.lda : 1;
    std::size_t const rsb = d.trans_b ? 1 : d.ldb, csb = d.trans_b ? d.ldb : 1;
    gemm_epilogue const e = d.epilogue;
    C const alpha = static_cast<C>(d.alpha);
    C* const ws = reinterpret_cast<C*>(ctx_->gemm_workspace());
    C* const colsum = ws;                                            // dgelu_bgrad: n sums
    C* const block = ws + (e == gemm_epilogue::dgelu_bgrad ? n : 0); // rows x n products
    T* const bias = static_cast<T*>(ops_.bias);
    T* const aux = static_cast<T*>(ops_.aux);

    if (e == gemm_epilogue::dgelu_bgrad)
      std::fill(colsum, colsum + n, C{0});
    if (e == gemm_epilogue::bgrad) {
      T const* a = static_cast<T const*>(ops_.a);
      for (std::size_t i = 0; i < m; ++i) {
        C s{0};
        for (std::size_t p = 0; p < k; ++p)
          s += to_compute_value<C>(a[i * rsa + p * csa]);
        bias[i] = from_compute_value<T>(s);
      }
    }

    for (std::size_t b = 0; b < d.batch; ++b) {
      T const* a = static_cast<T const*>(ops_.a) + b * d.stride_a;
      T const* bm = static_cast<T const*>(ops_.b) + b * d.stride_b;
      TC* c = static_cast<TC*>(ops_.c) + b * d.stride_c;
      for (std::size_t r0 = 0; r0 < m; r0 += rows_per_block_) {
        std::size_t const rows = std::min(rows_per_block_, m - r0);
        nn::detail::gemm<C>(rows, n, k, a + r0 * rsa, rsa, csa, bm, rsb, csb, block, n, false);
        for (std::size_t r = 0; r < rows; ++r) {
          std::size_t const i = r0 + r;
          C const* pr = block + r * n;
          TC* cr = c + i * d.ldc;
          T* xr = aux != nullptr ? aux + i * d.ld_aux : nullptr;
          for (std::size_t j = 0; j < n; ++j) {
            C v = alpha * pr[j];
            if (d.accumulate)
              v += to_compute_value<C>(cr[j]);
            switch (e) {
            case gemm_epilogue::none:
            case gemm_epilogue::bgrad:
              cr[j] = from_compute_value<TC>(v);
              break;
            case gemm_epilogue::bias:
              cr[j] = from_compute_value<TC>(v + to_compute_value<C>(bias[j]));
              break;
            case gemm_epilogue::gelu_aux_bias:
              v += to_compute_value<C>(bias[j]);
              [[fallthrough]];
            case gemm_epilogue::gelu_aux:
              xr[j] = from_compute_value<T>(v);
              cr[j] = from_compute_value<TC>(kernels::gelu_tanh(v));
              break;
            case gemm_epilogue::dgelu:
              cr[j] =
                  from_compute_value<TC>(v * kernels::gelu_tanh_grad(to_compute_value<C>(xr[j])));
              break;
            case gemm_epilogue::dgelu_bgrad: {
              C const g = v * kernels::gelu_tanh_grad(to_compute_value<C>(xr[j]));
              cr[j] = from_compute_value<TC>(g);
              colsum[j] += g;
              break;
            }
            }
          }
        }
      }
    }
    if (e == gemm_epilogue::dgelu_bgrad)
      for (std::size_t j = 0; j < n; ++j)
        bias[j] = from_compute_value<T>(colsum[j]);
  }

  emulated_context* ctx_;
  kernels::gemm_plan plan_;
  kernels::gemm_operands ops_{};
  bool bound_ = false;
  std::size_t rows_per_block_ = 0;
};

/// The emulated device's GEMM for a plan (what the device twins run; core/cuda/gemm.hpp's
/// make_gemm is the GPU's).
inline emulated_gemm make_gemm(emulated_context& ctx, kernels::gemm_plan const& plan,
                               kernels::gemm_operands const& o) {
  return emulated_gemm(ctx, plan, o);
}

} // namespace strata
