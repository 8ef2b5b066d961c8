// The GEMM plan: a row-major GEMM with its epilogue, checked once, and the column-major problem
// cuBLASLt solves for it (pure functions: no CUDA headers, tested on the host).
#pragma once

#include <strata/core/dtype.hpp>
#include <strata/core/error.hpp>

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace strata::kernels {

/// What happens to the product before it is stored (cuBLASLt's epilogues, by a layer's names).
/// v = alpha op(A) op(B) (+ C when accumulating), in the compute type; then, per element
/// (i, j) of the row-major m x n output:
enum class gemm_epilogue : std::uint8_t {
  none,          ///< C = v
  bias,          ///< C = v + bias[j]                          (bias: n values)
  gelu_aux,      ///< aux = v, C = gelu_tanh(v)                (aux: m x n, the pre-activation)
  gelu_aux_bias, ///< aux = v + bias[j], C = gelu_tanh(aux)
  dgelu,         ///< C = v gelu_tanh'(aux)                    (aux read: the forward's)
  dgelu_bgrad,   ///< C = v gelu_tanh'(aux), bias[j] = sum_i C(i, j)   (bias written: n values)
  bgrad,         ///< C = v, bias[i] = sum_p op(A)(i, p)       (bias written: m values; the
                 ///< weight gradient dW = dy^T x writes db = the column sums of dy with it)
};

constexpr std::string_view name_of(gemm_epilogue e) noexcept {
  switch (e) {
  case gemm_epilogue::none:
    return "none";
  case gemm_epilogue::bias:
    return "bias";
  case gemm_epilogue::gelu_aux:
    return "gelu_aux";
  case gemm_epilogue::gelu_aux_bias:
    return "gelu_aux_bias";
  case gemm_epilogue::dgelu:
    return "dgelu";
  case gemm_epilogue::dgelu_bgrad:
    return "dgelu_bgrad";
  case gemm_epilogue::bgrad:
    return "bgrad";
  }
  return "?";
}

/// Whether the epilogue reads (bias) or writes (bgrad, dgelu_bgrad) the bias vector.
constexpr bool uses_bias(gemm_epilogue e) noexcept {
  return e == gemm_epilogue::bias || e == gemm_epilogue::gelu_aux_bias ||
         e == gemm_epilogue::dgelu_bgrad || e == gemm_epilogue::bgrad;
}
/// Whether it writes (gelu_aux*) or reads (dgelu*) the m x n aux matrix.
constexpr bool uses_aux(gemm_epilogue e) noexcept {
  return e == gemm_epilogue::gelu_aux || e == gemm_epilogue::gelu_aux_bias ||
         e == gemm_epilogue::dgelu || e == gemm_epilogue::dgelu_bgrad;
}

/// A row-major GEMM: C[m, n] = alpha op(A) op(B) (+ C when accumulate, beta = 1), then the
/// epilogue. op(X) = X^T when trans_x. Every matrix is row-major with a leading dimension (the
/// distance between rows, elements; 0 takes the packed value): A is stored (trans_a ? k x m :
/// m x k), B (trans_b ? n x k : k x n), C and aux m x n. One element type for A, B, C, bias and
/// aux (but wide_out: C in f32 for 16-bit A and B); 16-bit types multiply with f32
/// accumulation, f32 in f32 (never TF32), f64 in f64.
/// batch > 1: `batch` GEMMs, matrix b at the base pointer + b * stride (elements; a stride of 0
/// for A or B uses one matrix for every batch, as attention's broadcast operands do).
struct gemm_desc {
  dtype type = dtype::f32;
  std::size_t m = 0, n = 0, k = 0;
  bool trans_a = false, trans_b = false;
  std::size_t lda = 0, ldb = 0, ldc = 0;
  double alpha = 1.0;
  bool accumulate = false;
  gemm_epilogue epilogue = gemm_epilogue::none;
  std::size_t ld_aux = 0;
  std::size_t batch = 1;
  std::size_t stride_a = 0, stride_b = 0, stride_c = 0;
  /// C in f32 where A and B are 16-bit (f16, bf16): the product's f32 accumulation stored
  /// without rounding to 16 bits (attention's scores). No epilogue, no accumulate.
  bool wide_out = false;
};

/// The compute (accumulation) type of a GEMM.
enum class gemm_compute : std::uint8_t { f32, f64 };

/// cuBLASLt's epilogue for the column-major problem (core/cuda/gemm.hpp maps it to
/// cublasLtEpilogue_t one to one).
enum class lt_epilogue : std::uint8_t {
  default_,
  bias,
  gelu_aux,
  gelu_aux_bias,
  dgelu,
  dgelu_bgrad,
  bgrada,
  bgradb
};

/// A column-major cuBLASLt matrix layout: the stored matrix (before its op), rows x cols, ld.
struct lt_layout {
  std::uint64_t rows = 0, cols = 0;
  std::int64_t ld = 0;
  std::int64_t batch_stride = 0; ///< elements; set as STRIDED_BATCH_OFFSET when batch > 1
};

/// A checked GEMM (make_gemm_plan) and the problem cuBLASLt solves for it. A row-major matrix
/// with leading dimension ld is the column-major transpose with the same ld, so the row-major
/// C = op(A) op(B) is the column-major C^T = op(B)^T op(A)^T: cuBLASLt's first operand is the
/// row-major B (with B's transpose flag), its second the row-major A (with A's), its m is n and
/// its n is m; bias vectors indexed by the row-major column j are cuBLASLt's per-row bias, and
/// the bias gradient over op(A) is cuBLASLt's BGRADB.
struct gemm_plan {
  gemm_desc desc; ///< as given, leading dimensions and aux ld filled in
  gemm_compute compute = gemm_compute::f32;
  std::size_t element_bytes = 0;   ///< of the storage type
  std::size_t c_element_bytes = 0; ///< of C: the storage type's, or 4 (f32) with wide_out
  std::size_t bias_length = 0;     ///< elements read or written through the bias pointer (0: none)
  std::size_t span_a = 0, span_b = 0, span_c = 0, span_aux = 0; ///< elements each pointer covers
  std::size_t alignment = 0; ///< bytes every operand pointer must be aligned to

  // cuBLASLt's column-major problem: D (= C) = op_a(first) op_b(second).
  std::uint64_t lt_m = 0, lt_n = 0, lt_k = 0;
  bool lt_trans_a = false;    ///< op of cuBLASLt's A: the row-major B buffer
  bool lt_trans_b = false;    ///< op of cuBLASLt's B: the row-major A buffer
  lt_layout lt_a, lt_b, lt_c; ///< cuBLASLt's A (row-major B), B (row-major A), C = D
  lt_epilogue lt_epi = lt_epilogue::default_;
  std::int64_t lt_aux_ld = 0;
  std::int64_t lt_batch = 1;

  /// 2 m n k per batch: the floating-point operations of the product.
  double flops() const noexcept {
    return 2.0 * static_cast<double>(desc.m) * static_cast<double>(desc.n) *
           static_cast<double>(desc.k) * static_cast<double>(desc.batch);
  }
};

/// The device pointers one GEMM runs on. bias is read (bias, gelu_aux_bias) or written
/// (bgrad, dgelu_bgrad); aux is written (gelu_aux*) or read (dgelu*); unused ones may be null.
struct gemm_operands {
  void const* a = nullptr;
  void const* b = nullptr;
  void* c = nullptr;
  void* bias = nullptr;
  void* aux = nullptr;
};

namespace detail {

inline std::string gemm_shape_text(gemm_desc const& d) {
  return "the " + std::string(name_of(d.type)) + " GEMM m = " + std::to_string(d.m) +
         ", n = " + std::to_string(d.n) + ", k = " + std::to_string(d.k) +
         (d.trans_a ? ", A transposed" : "") + (d.trans_b ? ", B transposed" : "") +
         (d.batch > 1 ? ", batch " + std::to_string(d.batch) : "") + ", epilogue " +
         std::string(name_of(d.epilogue));
}

[[noreturn]] inline void gemm_fail(gemm_desc const& d, std::string const& what) {
  throw config_error("strata: " + gemm_shape_text(d) + ": " + what);
}

constexpr bool is_16bit(dtype t) noexcept {
  return t == dtype::f16 || t == dtype::bf16;
}

} // namespace detail

/// Checks a GEMM and computes its plan; throws config_error naming the numbers and the fix when
/// cuBLASLt (as strata uses it) cannot run it. Called once, while the program is built.
///
/// The rules: a floating type; m, n, k, batch positive; each leading dimension at least the
/// stored row length; for 16-bit types every leading dimension and batch stride a multiple of
/// 8 elements (16 bytes: cuBLASLt's tensor-core kernels read rows in 16-byte vectors); aux's
/// leading dimension a multiple of 8 (cuBLASLt's rule for GELU aux); no epilogue in f64 (cuBLASLt
/// has no GELU for CUBLAS_COMPUTE_64F, and strata runs f64 bias on its own kernels); epilogues
/// only unbatched, with alpha = 1, and GELU/dGELU ones without accumulate (beta C would land
/// inside the activation); bgrad only with A transposed (dy stored rows x outputs, as the
/// weight gradient has it, the layout llm.c runs cuBLASLt's BGRADB with); batched outputs that
/// do not overlap.
inline gemm_plan make_gemm_plan(gemm_desc desc) {
  using detail::gemm_fail;
  auto const num = [](std::size_t v) { return std::to_string(v); };
  gemm_desc& d = desc;
  if (d.type != dtype::f32 && d.type != dtype::f64 && d.type != dtype::f16 && d.type != dtype::bf16)
    gemm_fail(d, "GEMMs take f32, f64, f16 or bf16 elements; convert the integer operands");
  if (d.m == 0 || d.n == 0 || d.k == 0)
    gemm_fail(d, "every dimension must be positive; skip an empty GEMM before planning it");
  if (d.batch == 0)
    gemm_fail(d, "batch must be at least 1");
  constexpr std::size_t max_dim = 0x7fffffff;
  if (d.m > max_dim || d.n > max_dim || d.k > max_dim)
    gemm_fail(d, "a dimension above 2^31 - 1; split the GEMM");

  std::size_t const a_rows = d.trans_a ? d.k : d.m, a_cols = d.trans_a ? d.m : d.k;
  std::size_t const b_rows = d.trans_b ? d.n : d.k, b_cols = d.trans_b ? d.k : d.n;
  if (d.lda == 0)
    d.lda = a_cols;
  if (d.ldb == 0)
    d.ldb = b_cols;
  if (d.ldc == 0)
    d.ldc = d.n;
  if (d.lda < a_cols)
    gemm_fail(d, "lda = " + num(d.lda) + " is below the " + num(a_cols) +
                     " elements of a stored row of A (" + num(a_rows) + " x " + num(a_cols) +
                     "); set lda >= " + num(a_cols));
  if (d.ldb < b_cols)
    gemm_fail(d, "ldb = " + num(d.ldb) + " is below the " + num(b_cols) +
                     " elements of a stored row of B (" + num(b_rows) + " x " + num(b_cols) +
                     "); set ldb >= " + num(b_cols));
  if (d.ldc < d.n)
    gemm_fail(d, "ldc = " + num(d.ldc) + " is below n = " + num(d.n) + "; set ldc >= " + num(d.n));

  bool const aux = uses_aux(d.epilogue);
  if (aux) {
    if (d.ld_aux == 0)
      d.ld_aux = d.ldc;
    if (d.ld_aux < d.n)
      gemm_fail(d, "ld_aux = " + num(d.ld_aux) + " is below n = " + num(d.n) +
                       "; set ld_aux >= " + num(d.n));
    if (d.ld_aux % 8 != 0)
      gemm_fail(d, "ld_aux = " + num(d.ld_aux) +
                       " is not a multiple of 8, which cuBLASLt requires of the GELU aux "
                       "matrix; pad its rows to " +
                       num((d.ld_aux + 7) / 8 * 8));
  } else {
    d.ld_aux = 0;
  }

  if (detail::is_16bit(d.type)) {
    auto const need8 = [&](char const* what, std::size_t v) {
      if (v % 8 != 0)
        gemm_fail(d, std::string(what) + " = " + num(v) + " " + std::string(name_of(d.type)) +
                         " elements (" + num(2 * v) +
                         " bytes) is not a multiple of 16 bytes, which cuBLASLt's 16-bit kernels "
                         "need; pad it to " +
                         num((v + 7) / 8 * 8) + " elements");
    };
    need8("lda", d.lda);
    need8("ldb", d.ldb);
    need8("ldc", d.ldc);
    if (d.batch > 1) {
      need8("stride_a", d.stride_a);
      need8("stride_b", d.stride_b);
      need8("stride_c", d.stride_c);
    }
  }

  if (d.epilogue != gemm_epilogue::none) {
    if (d.type == dtype::f64)
      gemm_fail(d, "f64 GEMMs take no epilogue (cuBLASLt has no GELU epilogue for "
                   "CUBLAS_COMPUTE_64F); use epilogue none and strata's bias and GELU kernels");
    if (d.batch > 1)
      gemm_fail(d, "epilogues run on unbatched GEMMs only; run the batches as separate plans "
                   "or the epilogue as its own kernel");
    if (d.alpha != 1.0)
      gemm_fail(d, "an epilogue needs alpha = 1 (alpha is " + std::to_string(d.alpha) +
                       "); scale an operand instead");
  }
  if (d.accumulate && (aux || d.epilogue == gemm_epilogue::dgelu_bgrad))
    gemm_fail(d, "accumulate (beta = 1) would add C inside the GELU or its gradient; write a "
                 "fresh output and add it with the residual kernel");
  if (d.wide_out && !detail::is_16bit(d.type))
    gemm_fail(d, "wide_out stores an f32 C for 16-bit A and B; with " +
                     std::string(name_of(d.type)) + " operands C is " +
                     std::string(name_of(d.type)) + " already: leave wide_out off");
  if (d.wide_out && (d.epilogue != gemm_epilogue::none || d.accumulate))
    gemm_fail(d, "wide_out takes no epilogue and no accumulate (C is f32, its bias and aux "
                 "would be 16-bit): run them as their own kernels");
  if (d.epilogue == gemm_epilogue::bgrad && !d.trans_a)
    gemm_fail(d, "bgrad sums op(A) over k, which strata plans only with A transposed (dy "
                 "stored as k x m: rows x outputs, as the weight gradient dW = dy^T x has it); "
                 "set trans_a and store A as k x m");

  std::size_t const span_a = (a_rows - 1) * d.lda + a_cols;
  std::size_t const span_b = (b_rows - 1) * d.ldb + b_cols;
  std::size_t const span_c1 = (d.m - 1) * d.ldc + d.n;
  if (d.batch > 1) {
    if (d.stride_c < span_c1)
      gemm_fail(d, "stride_c = " + num(d.stride_c) + " makes the batches' outputs overlap (" +
                       num(span_c1) + " elements each); set stride_c >= " + num(span_c1));
  } else {
    d.stride_a = d.stride_b = d.stride_c = 0;
  }

  gemm_plan p;
  p.desc = d;
  p.compute = d.type == dtype::f64 ? gemm_compute::f64 : gemm_compute::f32;
  p.element_bytes = size_of(d.type);
  p.c_element_bytes = d.wide_out ? 4 : p.element_bytes;
  p.alignment = detail::is_16bit(d.type) ? 16 : p.element_bytes;
  switch (d.epilogue) {
  case gemm_epilogue::bias:
  case gemm_epilogue::gelu_aux_bias:
  case gemm_epilogue::dgelu_bgrad:
    p.bias_length = d.n;
    break;
  case gemm_epilogue::bgrad:
    p.bias_length = d.m;
    break;
  default:
    p.bias_length = 0;
  }
  std::size_t const last = d.batch - 1;
  p.span_a = last * d.stride_a + span_a;
  p.span_b = last * d.stride_b + span_b;
  p.span_c = last * d.stride_c + span_c1;
  p.span_aux = aux ? (d.m - 1) * d.ld_aux + d.n : 0;

  // Row-major C (m x n, ldc) is column-major C^T (n x m, ldc) = op(B)^T op(A)^T.
  p.lt_m = d.n;
  p.lt_n = d.m;
  p.lt_k = d.k;
  p.lt_trans_a = d.trans_b;
  p.lt_trans_b = d.trans_a;
  auto const I = [](std::size_t v) { return static_cast<std::int64_t>(v); };
  // A stored row-major r x c with ld is column-major c x r with ld.
  p.lt_a = {b_cols, b_rows, I(d.ldb), I(d.stride_b)};
  p.lt_b = {a_cols, a_rows, I(d.lda), I(d.stride_a)};
  p.lt_c = {d.n, d.m, I(d.ldc), I(d.stride_c)};
  p.lt_batch = I(d.batch);
  p.lt_aux_ld = I(d.ld_aux);
  switch (d.epilogue) {
  case gemm_epilogue::none:
    p.lt_epi = lt_epilogue::default_;
    break;
  case gemm_epilogue::bias:
    p.lt_epi = lt_epilogue::bias;
    break;
  case gemm_epilogue::gelu_aux:
    p.lt_epi = lt_epilogue::gelu_aux;
    break;
  case gemm_epilogue::gelu_aux_bias:
    p.lt_epi = lt_epilogue::gelu_aux_bias;
    break;
  case gemm_epilogue::dgelu:
    p.lt_epi = lt_epilogue::dgelu;
    break;
  case gemm_epilogue::dgelu_bgrad:
    p.lt_epi = lt_epilogue::dgelu_bgrad;
    break;
  case gemm_epilogue::bgrad:
    p.lt_epi = lt_epilogue::bgradb; // op(A) is cuBLASLt's B
    break;
  }
  return p;
}

/// Checks the pointers a plan runs on: present where the plan uses them, aligned to
/// plan.alignment (16 bytes for 16-bit types, the element size otherwise). Throws config_error.
/// Called when pointers are bound (at build, or on a rebind), never per call.
inline void check_gemm_operands(gemm_plan const& p, gemm_operands const& o) {
  auto const check = [&](char const* name, void const* ptr, bool used) {
    if (!used)
      return;
    if (ptr == nullptr)
      detail::gemm_fail(p.desc, std::string("the ") + name + " pointer is null; the plan uses it");
    auto const addr = reinterpret_cast<std::uintptr_t>(ptr);
    if (addr % p.alignment != 0)
      detail::gemm_fail(p.desc, std::string("the ") + name + " pointer is " +
                                    std::to_string(addr % p.alignment) + " bytes past a " +
                                    std::to_string(p.alignment) +
                                    "-byte boundary; cuBLASLt needs it aligned: allocate or "
                                    "offset the tensor to a multiple of " +
                                    std::to_string(p.alignment) + " bytes");
  };
  check("A", o.a, true);
  check("B", o.b, true);
  check("C", o.c, true);
  check("bias", o.bias, p.bias_length != 0);
  check("aux", o.aux, p.span_aux != 0);
}

} // namespace strata::kernels
