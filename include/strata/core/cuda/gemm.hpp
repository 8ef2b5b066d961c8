// The device's GEMM: a gemm_plan built once into cuBLASLt's descriptors, layouts and algorithm,
// then run with no descriptor or heuristic call (nn/cuda_emulated/gemm.hpp is its host twin).
#pragma once

#if !__has_include(<cublasLt.h>) || !__has_include(<cuda_runtime_api.h>)
#error                                                                                             \
    "strata/core/cuda needs the CUDA toolkit with cuBLASLt: configure with STRATA_ENABLE_CUDA=ON on a machine that has it, and link CUDA::cublasLt"
#endif

#include <strata/core/cuda/context.hpp>
#include <strata/core/cuda/cublas_error.hpp>
#include <strata/core/dtype.hpp>
#include <strata/core/error.hpp>
#include <strata/core/kernels/gemm_plan.hpp>

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>

namespace strata {

/// Process-wide counts of cuBLASLt's host-side calls: descriptor, layout and preference
/// creations, heuristic queries, attribute sets and matmuls. Only a plan's build creates or
/// queries: a test reads the counts after warm-up, runs steps, and expects the first two
/// unchanged (issue 21: zero descriptor or heuristic calls in a step).
struct cublaslt_counts {
  std::uint64_t descriptor_creations = 0; ///< matmul descs, matrix layouts, preferences
  std::uint64_t heuristic_queries = 0;    ///< cublasLtMatmulAlgoGetHeuristic
  std::uint64_t attribute_sets = 0;       ///< pointer attributes set on a rebind
  std::uint64_t matmuls = 0;              ///< cublasLtMatmul
};

namespace detail {

struct cublaslt_counters {
  std::atomic<std::uint64_t> descriptor_creations{0}, heuristic_queries{0}, attribute_sets{0},
      matmuls{0};
};
inline cublaslt_counters& cublaslt_counter_state() noexcept {
  static cublaslt_counters c;
  return c;
}

inline cudaDataType_t cuda_data_type(dtype t) {
  switch (t) {
  case dtype::f32:
    return CUDA_R_32F;
  case dtype::f64:
    return CUDA_R_64F;
  case dtype::f16:
    return CUDA_R_16F;
  case dtype::bf16:
    return CUDA_R_16BF;
  default:
    throw config_error("strata: cuBLASLt GEMMs take f32, f64, f16 or bf16 elements");
  }
}

inline cublasLtEpilogue_t cublaslt_epilogue(kernels::lt_epilogue e) noexcept {
  switch (e) {
  case kernels::lt_epilogue::default_:
    return CUBLASLT_EPILOGUE_DEFAULT;
  case kernels::lt_epilogue::bias:
    return CUBLASLT_EPILOGUE_BIAS;
  case kernels::lt_epilogue::gelu_aux:
    return CUBLASLT_EPILOGUE_GELU_AUX;
  case kernels::lt_epilogue::gelu_aux_bias:
    return CUBLASLT_EPILOGUE_GELU_AUX_BIAS;
  case kernels::lt_epilogue::dgelu:
    return CUBLASLT_EPILOGUE_DGELU;
  case kernels::lt_epilogue::dgelu_bgrad:
    return CUBLASLT_EPILOGUE_DGELU_BGRAD;
  case kernels::lt_epilogue::bgrada:
    return CUBLASLT_EPILOGUE_BGRADA;
  case kernels::lt_epilogue::bgradb:
    return CUBLASLT_EPILOGUE_BGRADB;
  }
  return CUBLASLT_EPILOGUE_DEFAULT;
}

// The alignment of a pointer in bytes, up to cuBLASLt's default preference of 256.
inline std::uint32_t pointer_alignment(void const* p) noexcept {
  auto const a = reinterpret_cast<std::uintptr_t>(p);
  std::uint32_t al = 256;
  while (al > 1 && a % al != 0)
    al /= 2;
  return al;
}

} // namespace detail

/// The counts since the process started.
inline cublaslt_counts cublaslt_call_counts() noexcept {
  auto& c = detail::cublaslt_counter_state();
  return {c.descriptor_creations.load(), c.heuristic_queries.load(), c.attribute_sets.load(),
          c.matmuls.load()};
}

/// One GEMM plan as cuBLASLt runs it, built once while the program is built: the matmul
/// descriptor (compute CUBLAS_COMPUTE_32F for f32 and 16-bit storage — never the TF32 or 16F
/// variants, so f32 parity holds —, CUBLAS_COMPUTE_64F for f64), the three layouts of the
/// column-major problem (gemm_plan) with their batch attributes, the epilogue with its bias and
/// aux pointers, a preference limited to the workspace and to the alignment of the pointers
/// bound at build, and the algorithm from one heuristic query.
///
/// run() calls cublasLtMatmul only. A, B and C are arguments of that call; bias and aux are
/// descriptor attributes, set again by bind() only when they change (and refused when less
/// aligned than the pointers the algorithm was chosen for: build another plan). The workspace
/// is the caller's (the device context's cuBLASLt workspace), as is the handle; neither is
/// owned. Not thread-safe: one stream at a time, as a layer's GEMM is.
class cublaslt_gemm {
public:
  cublaslt_gemm(cublasLtHandle_t handle, kernels::gemm_plan const& plan,
                kernels::gemm_operands const& operands, void* workspace,
                std::size_t workspace_bytes)
      : handle_(handle), plan_(plan), workspace_(workspace), workspace_bytes_(workspace_bytes) {
    kernels::check_gemm_operands(plan_, operands);
    ops_ = operands;
    try {
      build();
    } catch (...) {
      release();
      throw;
    }
  }
  cublaslt_gemm(cublaslt_gemm const&) = delete;
  cublaslt_gemm& operator=(cublaslt_gemm const&) = delete;
  cublaslt_gemm(cublaslt_gemm&& o) noexcept { take(o); }
  cublaslt_gemm& operator=(cublaslt_gemm&& o) noexcept {
    if (this != &o) {
      release();
      take(o);
    }
    return *this;
  }
  ~cublaslt_gemm() { release(); }

  kernels::gemm_plan const& plan() const noexcept { return plan_; }
  /// The workspace bytes the chosen algorithm needs (at most the workspace given).
  std::size_t workspace_needed() const noexcept { return heuristic_.workspaceSize; }

  /// Points later runs at other tensors of the same shapes. Sets the bias or aux attribute
  /// only when that pointer changed; refuses pointers less aligned than those at build.
  void bind(kernels::gemm_operands const& o) {
    kernels::check_gemm_operands(plan_, o);
    auto const at_least = [&](char const* name, void const* p, std::uint32_t built) {
      if (detail::pointer_alignment(p) < built)
        throw config_error("strata: " + kernels::detail::gemm_shape_text(plan_.desc) + ": the " +
                           name + " pointer is aligned to " +
                           std::to_string(detail::pointer_alignment(p)) + " bytes, below the " +
                           std::to_string(built) +
                           " bytes the plan's algorithm was chosen for; build a plan for it");
    };
    at_least("A", o.a, align_a_);
    at_least("B", o.b, align_b_);
    at_least("C", o.c, align_c_);
    if (plan_.bias_length != 0 && o.bias != ops_.bias) {
      at_least("bias", o.bias, align_bias_);
      set_desc(CUBLASLT_MATMUL_DESC_BIAS_POINTER, &o.bias, sizeof(o.bias));
    }
    if (plan_.span_aux != 0 && o.aux != ops_.aux) {
      at_least("aux", o.aux, align_aux_);
      set_desc(CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &o.aux, sizeof(o.aux));
    }
    ops_ = o;
  }

  /// C = the plan's GEMM on the bound pointers, enqueued on stream s.
  void run(cudaStream_t s) const {
    void const* alpha = plan_.compute == kernels::gemm_compute::f64
                            ? static_cast<void const*>(&alpha64_)
                            : static_cast<void const*>(&alpha32_);
    void const* beta = plan_.compute == kernels::gemm_compute::f64
                           ? static_cast<void const*>(&beta64_)
                           : static_cast<void const*>(&beta32_);
    // cuBLASLt's A is the row-major B, its B the row-major A (gemm_plan).
    STRATA_CUBLAS_CHECK(cublasLtMatmul(handle_, desc_, alpha, ops_.b, layout_a_, ops_.a, layout_b_,
                                       beta, ops_.c, layout_c_, ops_.c, layout_c_, &heuristic_.algo,
                                       workspace_, workspace_bytes_, s));
    ++detail::cublaslt_counter_state().matmuls;
  }
  /// bind(o), then run(s).
  void run(cudaStream_t s, kernels::gemm_operands const& o) {
    bind(o);
    run(s);
  }

private:
  void set_desc(cublasLtMatmulDescAttributes_t attr, void const* v, std::size_t bytes) {
    STRATA_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc_, attr, v, bytes));
    ++detail::cublaslt_counter_state().attribute_sets;
  }

  void build() {
    auto& count = detail::cublaslt_counter_state();
    kernels::gemm_desc const& d = plan_.desc;
    cudaDataType_t const type = detail::cuda_data_type(d.type);
    bool const f64 = plan_.compute == kernels::gemm_compute::f64;
    alpha32_ = static_cast<float>(d.alpha);
    alpha64_ = d.alpha;
    beta32_ = d.accumulate ? 1.0f : 0.0f;
    beta64_ = d.accumulate ? 1.0 : 0.0;

    STRATA_CUBLAS_CHECK(cublasLtMatmulDescCreate(
        &desc_, f64 ? CUBLAS_COMPUTE_64F : CUBLAS_COMPUTE_32F, f64 ? CUDA_R_64F : CUDA_R_32F));
    ++count.descriptor_creations;
    cublasOperation_t const ta = plan_.lt_trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
    cublasOperation_t const tb = plan_.lt_trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
    STRATA_CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(desc_, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
    STRATA_CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(desc_, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
    cublasLtEpilogue_t const epi = detail::cublaslt_epilogue(plan_.lt_epi);
    STRATA_CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(desc_, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof(epi)));
    if (plan_.bias_length != 0) {
      int const bias_type = type; // bias and bias gradient in the storage type
      STRATA_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc_, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE,
                                                         &bias_type, sizeof(bias_type)));
      STRATA_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc_, CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                                                         &ops_.bias, sizeof(ops_.bias)));
      align_bias_ = detail::pointer_alignment(ops_.bias);
    }
    if (plan_.span_aux != 0) {
      std::int64_t const ld = plan_.lt_aux_ld;
      STRATA_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(
          desc_, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &ld, sizeof(ld)));
      STRATA_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(
          desc_, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &ops_.aux, sizeof(ops_.aux)));
      align_aux_ = detail::pointer_alignment(ops_.aux);
    }

    auto const make_layout = [&](cublasLtMatrixLayout_t& l, kernels::lt_layout const& s,
                                 cudaDataType_t t) {
      STRATA_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&l, t, s.rows, s.cols, s.ld));
      ++count.descriptor_creations;
      if (plan_.lt_batch > 1) {
        std::int32_t const batch = static_cast<std::int32_t>(plan_.lt_batch);
        std::int64_t const stride = s.batch_stride;
        STRATA_CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT,
                                                             &batch, sizeof(batch)));
        STRATA_CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(
            l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride, sizeof(stride)));
      }
    };
    make_layout(layout_a_, plan_.lt_a, type);
    make_layout(layout_b_, plan_.lt_b, type);
    make_layout(layout_c_, plan_.lt_c, d.wide_out ? CUDA_R_32F : type); // f32 scores: wide_out

    // Alignments as bound now (cuBLASLt's A is the row-major B): the algorithm must work for
    // them, and later binds must keep them.
    align_a_ = detail::pointer_alignment(ops_.a);
    align_b_ = detail::pointer_alignment(ops_.b);
    align_c_ = detail::pointer_alignment(ops_.c);
    cublasLtMatmulPreference_t pref = nullptr;
    STRATA_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
    ++count.descriptor_creations;
    std::uint64_t const ws = workspace_bytes_;
    std::uint32_t const lt_a_align = align_b_, lt_b_align = align_a_;
    cublasStatus_t rc = cublasLtMatmulPreferenceSetAttribute(
        pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws));
    if (rc == CUBLAS_STATUS_SUCCESS)
      rc = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
                                                &lt_a_align, sizeof(lt_a_align));
    if (rc == CUBLAS_STATUS_SUCCESS)
      rc = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                                                &lt_b_align, sizeof(lt_b_align));
    if (rc == CUBLAS_STATUS_SUCCESS)
      rc = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
                                                &align_c_, sizeof(align_c_));
    if (rc == CUBLAS_STATUS_SUCCESS)
      rc = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES,
                                                &align_c_, sizeof(align_c_));
    int found = 0;
    if (rc == CUBLAS_STATUS_SUCCESS) {
      rc = cublasLtMatmulAlgoGetHeuristic(handle_, desc_, layout_a_, layout_b_, layout_c_,
                                          layout_c_, pref, 1, &heuristic_, &found);
      ++count.heuristic_queries;
    }
    cublasLtMatmulPreferenceDestroy(pref);
    STRATA_CUBLAS_CHECK(rc);
    if (found == 0)
      throw config_error(
          "strata: " + kernels::detail::gemm_shape_text(d) +
          ": cuBLASLt has no algorithm for it with " + std::to_string(workspace_bytes_) +
          " bytes of workspace and the bound pointers' alignment; raise "
          "device_context_options::gemm_workspace or align the tensors to 256 bytes");
  }

  void release() noexcept {
    if (layout_c_ != nullptr)
      cublasLtMatrixLayoutDestroy(layout_c_);
    if (layout_b_ != nullptr)
      cublasLtMatrixLayoutDestroy(layout_b_);
    if (layout_a_ != nullptr)
      cublasLtMatrixLayoutDestroy(layout_a_);
    if (desc_ != nullptr)
      cublasLtMatmulDescDestroy(desc_);
    layout_a_ = layout_b_ = layout_c_ = nullptr;
    desc_ = nullptr;
  }

  void take(cublaslt_gemm& o) noexcept {
    handle_ = o.handle_;
    plan_ = o.plan_;
    ops_ = o.ops_;
    workspace_ = o.workspace_;
    workspace_bytes_ = o.workspace_bytes_;
    desc_ = std::exchange(o.desc_, nullptr);
    layout_a_ = std::exchange(o.layout_a_, nullptr);
    layout_b_ = std::exchange(o.layout_b_, nullptr);
    layout_c_ = std::exchange(o.layout_c_, nullptr);
    heuristic_ = o.heuristic_;
    alpha32_ = o.alpha32_;
    beta32_ = o.beta32_;
    alpha64_ = o.alpha64_;
    beta64_ = o.beta64_;
    align_a_ = o.align_a_;
    align_b_ = o.align_b_;
    align_c_ = o.align_c_;
    align_bias_ = o.align_bias_;
    align_aux_ = o.align_aux_;
  }

  cublasLtHandle_t handle_ = nullptr;
  kernels::gemm_plan plan_{};
  kernels::gemm_operands ops_{};
  void* workspace_ = nullptr;
  std::size_t workspace_bytes_ = 0;
  cublasLtMatmulDesc_t desc_ = nullptr;
  cublasLtMatrixLayout_t layout_a_ = nullptr, layout_b_ = nullptr, layout_c_ = nullptr;
  cublasLtMatmulHeuristicResult_t heuristic_{};
  float alpha32_ = 1.0f, beta32_ = 0.0f;
  double alpha64_ = 1.0, beta64_ = 0.0;
  std::uint32_t align_a_ = 256, align_b_ = 256, align_c_ = 256, align_bias_ = 256, align_aux_ = 256;
};

/// A cuBLASLt plan on a CUDA context: what the device twins run (make_gemm), as emulated_gemm
/// on the emulated device. Counts one gemm call on the context per run.
class cuda_gemm {
public:
  cuda_gemm(cuda_context& ctx, kernels::gemm_plan const& plan, kernels::gemm_operands const& o)
      : ctx_(&ctx), g_(ctx.cublaslt(), plan, o, ctx.gemm_workspace(), ctx.gemm_workspace_bytes()) {}
  void run(cudaStream_t s, kernels::gemm_operands const& o) {
    g_.run(s, o);
    ctx_->count_gemm();
  }
  kernels::gemm_plan const& plan() const noexcept { return g_.plan(); }

private:
  cuda_context* ctx_;
  cublaslt_gemm g_;
};

inline cuda_gemm make_gemm(cuda_context& ctx, kernels::gemm_plan const& plan,
                           kernels::gemm_operands const& o) {
  return cuda_gemm(ctx, plan, o);
}

} // namespace strata
