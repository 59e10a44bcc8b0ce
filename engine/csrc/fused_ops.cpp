// Fused elementwise ops of the Llama family for CPU, each one pass over memory instead of torch's
// 3-8 separate ops. Every op computes in float32 and rounds to the tensor's dtype exactly where
// Hugging Face's modules round (after each torch op), so bf16 results match the module-by-module
// computation up to the last-bit differences of a different summation order or exp/rsqrt.
//
//   rms_norm      out = weight * T(x * rsqrt(mean(x^2) + eps))                  x, out [N, H]
//   add_rms_norm  residual = T(residual + x); out = rms_norm(residual)          in place on residual
//   silu_and_mul  out = T(T(silu(gate)) * up), gate_up = [gate | up]          gate_up [N, 2I], out [N, I]
//   rotary        x = T(T(x * cos) + T(rotate_half(x) * sin)) per head, in place; x [T, heads, D] with
//                 any token stride, cos/sin [T, R]; rotate_half(x) = [-x2, x1] (non-interleaved RoPE) over
//                 the first R <= D dims of each head, the other D - R left as they are (a partial rotary)
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <cmath>

#include "vec16.h"

namespace {

// Rows per parallel task: about 64K elements, so a decode step's small tensors (64 x 768) run on one
// thread; waking the others costs more than the op, and a parallel region stalls for a whole
// scheduler slice whenever another process holds one of the cores.
int64_t rows_per_task(int64_t row_elements) { return std::max<int64_t>(1, 65536 / std::max<int64_t>(1, row_elements)); }

template <typename T>
void rms_norm_row(const T* x, const T* weight, float eps, int64_t n, T* out) {
  Vec16 squares = zero16();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const Vec16 v = load16(x + i);
    squares = fma16(v, v, squares);
  }
  float sum = reduce_add(squares);
  for (int64_t j = i; j < n; ++j) sum += static_cast<float>(x[j]) * static_cast<float>(x[j]);
  const float scale = 1.f / std::sqrt(sum / static_cast<float>(n) + eps);
  const Vec16 scale16 = set16(scale);
  for (i = 0; i + 16 <= n; i += 16) store16(out + i, load16(weight + i) * round16<T>(load16(x + i) * scale16));
  for (; i < n; ++i) out[i] = static_cast<T>(static_cast<float>(weight[i]) * round1<T>(static_cast<float>(x[i]) * scale));
}

template <typename T>
void add_row(T* residual, const T* x, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) store16(residual + i, load16(residual + i) + load16(x + i));
  for (; i < n; ++i) residual[i] = static_cast<T>(static_cast<float>(residual[i]) + static_cast<float>(x[i]));
}

template <typename T>
void silu_and_mul_row(const T* gate, const T* up, int64_t n, T* out) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) store16(out + i, silu_mul16<T>(load16(gate + i), load16(up + i)));
  for (; i < n; ++i) out[i] = static_cast<T>(silu_mul1<T>(static_cast<float>(gate[i]), static_cast<float>(up[i])));
}

template <typename T>
void rotary_head(T* x, const T* cos, const T* sin, int64_t half) {
  int64_t i = 0;
  for (; i + 16 <= half; i += 16) {
    const Vec16 x1 = load16(x + i), x2 = load16(x + half + i);
    const Vec16 rotated1 = round16<T>((zero16() - x2) * load16(sin + i));
    const Vec16 rotated2 = round16<T>(x1 * load16(sin + half + i));
    store16(x + i, round16<T>(x1 * load16(cos + i)) + rotated1);
    store16(x + half + i, round16<T>(x2 * load16(cos + half + i)) + rotated2);
  }
  for (; i < half; ++i) {
    const float x1 = static_cast<float>(x[i]), x2 = static_cast<float>(x[half + i]);
    x[i] = static_cast<T>(round1<T>(x1 * static_cast<float>(cos[i])) + round1<T>(-x2 * static_cast<float>(sin[i])));
    x[half + i] = static_cast<T>(round1<T>(x2 * static_cast<float>(cos[half + i])) +
                                 round1<T>(x1 * static_cast<float>(sin[half + i])));
  }
}

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, " must be 2-D with contiguous rows");
}

template <typename F>
void dispatch(const at::Tensor& t, const char* op, F&& body) {
  switch (t.scalar_type()) {
    case at::kFloat: return body(float{});
    case at::kBFloat16: return body(c10::BFloat16{});
    default: TORCH_CHECK(false, op, ": dtype ", t.scalar_type(), " is not supported");
  }
}

void rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, at::Tensor out) {
  check_rows(x, "rms_norm: x");
  check_rows(out, "rms_norm: out");
  const int64_t n = x.size(1);
  dispatch(x, "rms_norm", [&](auto tag) {
    using T = decltype(tag);
    const T* px = x.const_data_ptr<T>();
    const T* pw = weight.const_data_ptr<T>();
    T* po = out.mutable_data_ptr<T>();
    at::parallel_for(0, x.size(0), rows_per_task(n), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        rms_norm_row(px + r * x.stride(0), pw, static_cast<float>(eps), n, po + r * out.stride(0));
    });
  });
}

void add_rms_norm(at::Tensor residual, const at::Tensor& x, const at::Tensor& weight, double eps, at::Tensor out) {
  check_rows(residual, "add_rms_norm: residual");
  check_rows(x, "add_rms_norm: x");
  check_rows(out, "add_rms_norm: out");
  const int64_t n = x.size(1);
  dispatch(x, "add_rms_norm", [&](auto tag) {
    using T = decltype(tag);
    T* pr = residual.mutable_data_ptr<T>();
    const T* px = x.const_data_ptr<T>();
    const T* pw = weight.const_data_ptr<T>();
    T* po = out.mutable_data_ptr<T>();
    at::parallel_for(0, x.size(0), rows_per_task(n), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        T* row = pr + r * residual.stride(0);
        add_row(row, px + r * x.stride(0), n);
        rms_norm_row(row, pw, static_cast<float>(eps), n, po + r * out.stride(0));
      }
    });
  });
}

void silu_and_mul(const at::Tensor& gate_up, at::Tensor out) {
  check_rows(gate_up, "silu_and_mul: gate_up");
  check_rows(out, "silu_and_mul: out");
  const int64_t n = out.size(1);
  TORCH_CHECK(gate_up.size(1) == 2 * n, "silu_and_mul: gate_up must be twice as wide as out");
  dispatch(out, "silu_and_mul", [&](auto tag) {
    using T = decltype(tag);
    const T* pg = gate_up.const_data_ptr<T>();
    T* po = out.mutable_data_ptr<T>();
    at::parallel_for(0, out.size(0), rows_per_task(n), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const T* row = pg + r * gate_up.stride(0);
        silu_and_mul_row(row, row + n, n, po + r * out.stride(0));
      }
    });
  });
}

void rotary_embedding(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2), "rotary_embedding: x must be "
              "[T, heads, D] with contiguous heads");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.sizes() == sin.sizes() && cos.dim() == 2 &&
                  cos.size(0) == x.size(0) && cos.size(1) <= x.size(2) && cos.size(1) % 2 == 0,
              "rotary_embedding: cos and sin must be contiguous [T, R] with R even and at most D");
  const int64_t heads = x.size(1), dim = x.size(2), rotary_dim = cos.size(1);
  dispatch(x, "rotary_embedding", [&](auto tag) {
    using T = decltype(tag);
    T* px = x.mutable_data_ptr<T>();
    const T* pc = cos.const_data_ptr<T>();
    const T* ps = sin.const_data_ptr<T>();
    at::parallel_for(0, x.size(0), rows_per_task(heads * dim), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t)
        for (int64_t h = 0; h < heads; ++h)
          rotary_head(px + t * x.stride(0) + h * dim, pc + t * rotary_dim, ps + t * rotary_dim, rotary_dim / 2);
    });
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(splitserve_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps, Tensor(a!) out) -> ()");
  m.def("add_rms_norm(Tensor(a!) residual, Tensor x, Tensor weight, float eps, Tensor(b!) out) -> ()");
  m.def("silu_and_mul(Tensor gate_up, Tensor(a!) out) -> ()");
  m.def("rotary_embedding(Tensor(a!) x, Tensor cos, Tensor sin) -> ()");
}

TORCH_LIBRARY_IMPL(splitserve_cpu, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("rotary_embedding", &rotary_embedding);
}
