// Paged decode attention for CPU: one query token per sequence, keys and values read in place
// from the KV pool's blocks (no gather copy). Built at first use by engine/cpu_kernels.py.
//
// Shapes (all contiguous):
//   query        [B, H, D]                        fp32 or bf16
//   kv_cache     [num_blocks, 2, block_size, Hkv, W] query's dtype (W = D), or a quantized pool's int8 /
//                float8_e4m3fn codes (W = D + 2: each row's codes, then its bfloat16 scale); [:, 0] keys, [:, 1] values
//   block_tables [B, max_blocks] int64            block of position p: block_tables[b, p / block_size]
//   context_lens [B] int64                        positions 0 .. context_lens[b] - 1 are attended
//   out          [B, H, D]                        same dtype as query
// sliding_window > 0 attends only the last sliding_window positions. Query head h reads KV head
// h / (H / Hkv) (grouped-query attention). Scores, softmax and the weighted sum are float32. A quantized
// pool's codes are widened in registers; a key row's scale multiplies its score, a value row's its weight.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "vec16.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

template <typename E>
inline float dot(const float* q, const E* k, int64_t dim) {
  int64_t d = 0;
  Vec16 acc = zero16();
  for (; d + 16 <= dim; d += 16) acc = fma16(load16(q + d), load16(k + d), acc);
  float sum = reduce_add(acc);
  for (; d < dim; ++d) sum += q[d] * to_float(k[d]);
  return sum;
}

template <typename E>
inline void axpy(float weight, const E* v, float* acc, int64_t dim) {
  int64_t d = 0;
  const Vec16 w = set16(weight);
  for (; d + 16 <= dim; d += 16) store16(acc + d, fma16(w, load16(v + d), load16(acc + d)));
  for (; d < dim; ++d) acc[d] += weight * to_float(v[d]);
}

// row = softmax(row) in place, exp vectorized (a scalar exp per score costs more than the dots).
inline void softmax(float* row, int64_t length) {
  const float max_score = *std::max_element(row, row + length);
  const Vec16 shift = set16(max_score);
  Vec16 sums = zero16();
  int64_t i = 0;
  for (; i + 16 <= length; i += 16) {
    const Vec16 e = exp16(load16(row + i) - shift);
    store16(row + i, e);
    sums = sums + e;
  }
  float total = reduce_add(sums);
  for (; i < length; ++i) total += (row[i] = std::exp(row[i] - max_score));
  const Vec16 inv_total = set16(1.f / total);
  for (i = 0; i + 16 <= length; i += 16) store16(row + i, load16(row + i) * inv_total);
  for (; i < length; ++i) row[i] *= 1.f / total;
}

struct Geometry {
  int64_t num_heads, num_kv_heads, head_dim, block_size, max_blocks;
  int64_t head_stride;   // elements of one (position, KV head) row: W (D, or D + 2 when quantized)
  int64_t row_stride;    // elements between consecutive positions of one block: Hkv * W
  int64_t block_stride;  // elements of one block (keys and values): 2 * block_size * Hkv * W
};

// Ask for the cache lines of a row needed soon (the positions of the next blocks are scattered
// through the pool, so the hardware prefetcher cannot guess them).
template <typename E>
inline void prefetch_row(const E* row, int64_t dim) {
  const char* bytes = reinterpret_cast<const char*>(row);
  for (int64_t b = 0; b < dim * static_cast<int64_t>(sizeof(E)); b += 64) _mm_prefetch(bytes + b, _MM_HINT_T0);
}

// scores[i] = q . rows[i][offset : offset + dim] for i < length, eight positions at a time.
template <typename E>
void score_row(const float* q, const std::vector<const E*>& rows, int64_t offset, int64_t length, int64_t dim,
               float* scores) {
  int64_t i = 0;
  if (dim % 16 == 0) {
    for (; i + 8 <= length; i += 8) {
      for (int64_t j = i + 8; j < std::min(i + 16, length); ++j) prefetch_row(rows[j] + offset, dim);
      Vec16 acc[8];
      for (int j = 0; j < 8; ++j) acc[j] = zero16();
      for (int64_t d = 0; d < dim; d += 16) {
        const Vec16 qd = load16(q + d);
        for (int j = 0; j < 8; ++j) acc[j] = fma16(qd, load16(rows[i + j] + offset + d), acc[j]);
      }
      store_sums8(acc, scores + i);
    }
  }
  for (; i < length; ++i) scores[i] = dot(q, rows[i] + offset, dim);
  if constexpr (KVRow<E>::kQuantized)
    for (i = 0; i < length; ++i) scores[i] *= KVRow<E>::scale(rows[i] + offset, dim);
}

// out = sum_i probs[i] * rows[i][offset : offset + D] with N = D / 16 accumulators held in registers.
template <int N, typename E, typename T>
void weighted_sum_fixed(const float* probs, const std::vector<const E*>& rows, int64_t offset, int64_t length,
                        T* out) {
  Vec16 acc[N];
  for (int j = 0; j < N; ++j) acc[j] = zero16();
  for (int64_t i = 0; i < length; ++i) {
    if (i + 8 < length) prefetch_row(rows[i + 8] + offset, 16 * N);
    const Vec16 w = set16(probs[i]);
    const E* v = rows[i] + offset;
    for (int j = 0; j < N; ++j) acc[j] = fma16(w, load16(v + 16 * j), acc[j]);
  }
  for (int j = 0; j < N; ++j) store16(out + 16 * j, acc[j]);
}

template <typename E, typename T>
void weighted_sum(const float* probs, const std::vector<const E*>& rows, int64_t offset, int64_t length, int64_t dim,
                  T* out) {
  switch (dim) {
    case 32: return weighted_sum_fixed<2>(probs, rows, offset, length, out);
    case 64: return weighted_sum_fixed<4>(probs, rows, offset, length, out);
    case 80: return weighted_sum_fixed<5>(probs, rows, offset, length, out);
    case 96: return weighted_sum_fixed<6>(probs, rows, offset, length, out);
    case 128: return weighted_sum_fixed<8>(probs, rows, offset, length, out);
    default: break;
  }
  std::vector<float> acc(dim, 0.f);
  for (int64_t i = 0; i < length; ++i) axpy(probs[i], rows[i] + offset, acc.data(), dim);
  for (int64_t d = 0; d < dim; ++d) out[d] = static_cast<T>(acc[d]);
}

// One sequence's KV heads [first_kv_head, first_kv_head + num_kv) and the G query heads of each.
// Scores head by head over the positions' key rows (eight positions per reduction), a softmax
// per head, then each head's weighted sum of value rows accumulated in registers. Cache rows hold E
// (T itself, or quantized codes whose row scales fold into the scores and the weights).
template <typename T, typename E>
void attend(const T* query, const E* cache, const int64_t* table, int64_t context_len, int64_t window, float scale,
            const Geometry& g, int64_t first_kv_head, int64_t num_kv, T* out) {
  const int64_t group = g.num_heads / g.num_kv_heads;
  const int64_t heads = num_kv * group;  // query heads of this task, consecutive from first_kv_head * G
  const int64_t start = window > 0 ? std::max<int64_t>(0, context_len - window) : 0;
  const int64_t length = context_len - start;
  std::vector<float> q(heads * g.head_dim), scores(heads * length);
  std::vector<const E*> rows(length);  // key row of each attended position, at this task's first KV head
  const T* q_src = query + first_kv_head * group * g.head_dim;
  for (int64_t i = 0; i < heads * g.head_dim; ++i) q[i] = static_cast<float>(q_src[i]) * scale;
  for (int64_t p = start; p < context_len; ++p)
    rows[p - start] = cache + table[p / g.block_size] * g.block_stride + (p % g.block_size) * g.row_stride +
                      first_kv_head * g.head_stride;
  for (int64_t h = 0; h < heads; ++h)
    score_row(&q[h * g.head_dim], rows, (h / group) * g.head_stride, length, g.head_dim, &scores[h * length]);
  for (int64_t h = 0; h < heads; ++h) softmax(&scores[h * length], length);
  const int64_t value_offset = g.block_size * g.row_stride;
  if constexpr (KVRow<E>::kQuantized)  // probability x value scale: the weight of each value row's codes
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t i = 0; i < length; ++i)
        scores[h * length + i] *= KVRow<E>::scale(rows[i] + value_offset + (h / group) * g.head_stride, g.head_dim);
  T* out_dst = out + first_kv_head * group * g.head_dim;
  for (int64_t h = 0; h < heads; ++h)
    weighted_sum(&scores[h * length], rows, value_offset + (h / group) * g.head_stride, length, g.head_dim,
                 out_dst + h * g.head_dim);
}

// KV heads per task: all of a sequence's (streaming reads) unless there are too few sequences to
// keep every thread busy, then the largest divisor of Hkv that gives each thread about two tasks.
int64_t kv_heads_per_task(int64_t batch, int64_t num_kv_heads) {
  const int64_t wanted_tasks = 2 * static_cast<int64_t>(at::get_num_threads());
  int64_t per_task = num_kv_heads;
  while (per_task > 1 && batch * (num_kv_heads / per_task) < wanted_tasks) {
    do --per_task; while (num_kv_heads % per_task != 0);
  }
  return per_task;
}

template <typename T, typename E>
void decode(const at::Tensor& query, const at::Tensor& kv_cache, const at::Tensor& block_tables,
            const at::Tensor& context_lens, int64_t window, double scale, at::Tensor& out) {
  const Geometry g{query.size(1), kv_cache.size(3), query.size(2), kv_cache.size(2), block_tables.size(1),
                   kv_cache.size(4), kv_cache.size(3) * kv_cache.size(4),
                   2 * kv_cache.size(2) * kv_cache.size(3) * kv_cache.size(4)};
  const int64_t batch = query.size(0);
  const int64_t per_task = kv_heads_per_task(batch, g.num_kv_heads);
  const int64_t tasks_per_seq = g.num_kv_heads / per_task;
  const T* q = query.const_data_ptr<T>();
  const E* cache = static_cast<const E*>(kv_cache.const_data_ptr());
  const int64_t* tables = block_tables.const_data_ptr<int64_t>();
  const int64_t* lens = context_lens.const_data_ptr<int64_t>();
  T* o = out.mutable_data_ptr<T>();
  const int64_t row = g.num_heads * g.head_dim;
  at::parallel_for(0, batch * tasks_per_seq, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / tasks_per_seq, first_kv_head = (task % tasks_per_seq) * per_task;
      attend<T, E>(q + b * row, cache, tables + b * g.max_blocks, lens[b], window, static_cast<float>(scale), g,
                   first_kv_head, per_task, o + b * row);
    }
  });
}

// The cache's element type for a query of dtype T: T itself, or a quantized pool's codes.
template <typename T>
void decode_for_cache(const at::Tensor& query, const at::Tensor& kv_cache, const at::Tensor& block_tables,
                      const at::Tensor& context_lens, int64_t window, double scale, at::Tensor& out) {
  switch (kv_cache.scalar_type()) {
    case at::kChar: return decode<T, int8_t>(query, kv_cache, block_tables, context_lens, window, scale, out);
    case at::kFloat8_e4m3fn:
      return decode<T, Fp8E4M3>(query, kv_cache, block_tables, context_lens, window, scale, out);
    default: return decode<T, T>(query, kv_cache, block_tables, context_lens, window, scale, out);
  }
}

bool is_quantized_kv(const at::Tensor& kv_cache) {
  return kv_cache.scalar_type() == at::kChar || kv_cache.scalar_type() == at::kFloat8_e4m3fn;
}

void paged_decode_attention(const at::Tensor& query, const at::Tensor& kv_cache, const at::Tensor& block_tables,
                            const at::Tensor& context_lens, int64_t sliding_window, double scale, at::Tensor out) {
  TORCH_CHECK(query.dim() == 3 && kv_cache.dim() == 5 && block_tables.dim() == 2 && context_lens.dim() == 1,
              "paged_decode_attention: bad ranks");
  TORCH_CHECK(query.is_contiguous() && kv_cache.is_contiguous() && block_tables.is_contiguous() &&
                  context_lens.is_contiguous() && out.is_contiguous(),
              "paged_decode_attention: inputs must be contiguous");
  const bool quantized = is_quantized_kv(kv_cache);
  TORCH_CHECK((quantized || query.scalar_type() == kv_cache.scalar_type()) && out.scalar_type() == query.scalar_type(),
              "paged_decode_attention: query and out must share a dtype, and kv_cache have it or be int8 / fp8 codes");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong,
              "paged_decode_attention: block_tables and context_lens must be int64");
  TORCH_CHECK(query.size(1) % kv_cache.size(3) == 0 && query.size(2) + (quantized ? 2 : 0) == kv_cache.size(4),
              "paged_decode_attention: head counts or head_dim do not match the cache");
  switch (query.scalar_type()) {
    case at::kFloat:
      return decode_for_cache<float>(query, kv_cache, block_tables, context_lens, sliding_window, scale, out);
    case at::kBFloat16:
      return decode_for_cache<c10::BFloat16>(query, kv_cache, block_tables, context_lens, sliding_window, scale, out);
    default: TORCH_CHECK(false, "paged_decode_attention: dtype ", query.scalar_type(), " is not supported");
  }
}

// out[i] = codes[i] (fp8 e4m3 bit patterns, uint8) widened to float32 by the kernels' conversion: 16 at a
// time with load16, the tail with fp8_e4m3_to_float (tests compare both with torch's).
void fp8_e4m3_codes_to_float(const at::Tensor& codes, at::Tensor out) {
  TORCH_CHECK(codes.dim() == 1 && codes.is_contiguous() && codes.scalar_type() == at::kByte,
              "fp8_e4m3_to_float: codes must be a contiguous 1-D uint8 tensor");
  TORCH_CHECK(out.is_contiguous() && out.scalar_type() == at::kFloat && out.sizes() == codes.sizes(),
              "fp8_e4m3_to_float: out must be a contiguous float32 tensor shaped like codes");
  const uint8_t* in = codes.const_data_ptr<uint8_t>();
  float* o = out.mutable_data_ptr<float>();
  int64_t i = 0;
  for (; i + 16 <= codes.size(0); i += 16)
    store16(o + i, load16(reinterpret_cast<const Fp8E4M3*>(in + i)));
  for (; i < codes.size(0); ++i) o[i] = fp8_e4m3_to_float(in[i]);
}

}  // namespace

TORCH_LIBRARY(splitserve_cpu, m) {
  m.def("paged_decode_attention(Tensor query, Tensor kv_cache, Tensor block_tables, Tensor context_lens, "
        "int sliding_window, float scale, Tensor(a!) out) -> ()");
  m.def("fp8_e4m3_to_float(Tensor codes, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(splitserve_cpu, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
  m.impl("fp8_e4m3_to_float", &fp8_e4m3_codes_to_float);
}
