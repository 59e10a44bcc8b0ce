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
//   sinks        [H] float32, or none             per query head, a logit that joins the softmax's denominator
//                                                 and weighs no value (GPT-OSS's attention sinks)
// sliding_window > 0 attends only the last sliding_window positions. softcap > 0 caps each scaled score s
// as softcap * tanh(s / softcap) before the softmax (Gemma 2's attn_logit_softcapping); 0 leaves them. Query
// head h reads KV head h / (H / Hkv) (grouped-query attention). Scores, softmax and the weighted sum are
// float32. A quantized pool's codes are widened in registers; a key row's scale multiplies its score, a value
// row's its weight.
//
// How KV is read (at decode contexts the rows come from DRAM, each once per step): a task (a sequence's
// KV heads, see kv_heads_per_task) makes two passes over its positions in ascending order, keys then
// values. Each pass reads a position's rows of all the task's KV heads (adjacent in the pool: one 1 KiB run
// per position for 4 heads of 64 floats) before the next position's, and each (position, KV head) row
// exactly once for all G query heads of that KV head: the row's 16-element pieces are widened once and
// multiplied into G accumulators held in registers (kTileAccumulators). Rows kPrefetchPositions ahead are
// prefetched into L2, which keeps DRAM busy across the scattered blocks; prefetching into L1 was slower
// than no prefetch at all (measured; likely L1's few miss buffers filling up ahead of the loads).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "vec16.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

namespace {

// row = softmax([row, sink])[:length] in place, exp vectorized (a scalar exp per score costs more than the
// dots): the sink logit joins the denominator only; -inf (no sink) is the plain softmax of row.
inline void softmax(float* row, int64_t length, float sink) {
  Vec16 maxima = set16(-std::numeric_limits<float>::infinity());
  int64_t m = 0;
  for (; m + 16 <= length; m += 16) maxima = max16(maxima, load16(row + m));
  float max_score = std::max(reduce_max(maxima), sink);
  for (; m < length; ++m) max_score = std::max(max_score, row[m]);
  const Vec16 shift = set16(max_score);
  Vec16 sums = zero16();
  int64_t i = 0;
  for (; i + 16 <= length; i += 16) {
    const Vec16 e = exp16(load16(row + i) - shift);
    store16(row + i, e);
    sums = sums + e;
  }
  float total = reduce_add(sums) + std::exp(sink - max_score);  // exp(-inf) = 0 without a sink
  for (; i < length; ++i) total += (row[i] = std::exp(row[i] - max_score));
  const Vec16 inv_total = set16(1.f / total);
  for (i = 0; i + 16 <= length; i += 16) store16(row + i, load16(row + i) * inv_total);
  for (; i < length; ++i) row[i] *= 1.f / total;
}

// row = softcap * tanh(row / softcap) in place (cap_scores16 of vec16.h; the tail by std::tanh).
inline void cap_scores(float* row, int64_t length, float softcap) {
  const Vec16 cap = set16(softcap);
  int64_t i = 0;
  for (; i + 16 <= length; i += 16) store16(row + i, cap_scores16(load16(row + i), cap));
  for (; i < length; ++i) row[i] = std::tanh(row[i] / softcap) * softcap;
}

// Accumulators one tile holds in registers, as Vec16s: (query head, position) dot products while reading
// keys, (query head, 16 floats of head_dim) sums while reading values. AVX2: 6 of the 8 Vec16 the 16 ymm
// hold, leaving room for the row being widened; AVX-512: 8, what store_sums8 reduces at once.
constexpr int kTileAccumulators = kVec16Registers == 8 ? 6 : 8;

// Positions read per run of the value pass (its sums go through memory once per run), and how far ahead
// the rows are prefetched: block tables scatter a sequence's blocks through the pool, so the hardware
// prefetcher loses the stream at every block boundary. Measured on the AVX2 EPYC (88M shape): 16 ahead
// beat 6, 8 and 32-40; runs of 8 beat 16.
constexpr int64_t kRunPositions = 8;
constexpr int64_t kPrefetchPositions = 16;

struct Geometry {
  int64_t num_heads, num_kv_heads, head_dim, block_size, max_blocks;
  int64_t head_stride;   // elements of one (position, KV head) row: W (D, or D + 2 when quantized)
  int64_t row_stride;    // elements between consecutive positions of one block: Hkv * W
  int64_t block_stride;  // elements of one block (keys and values): 2 * block_size * Hkv * W
};

// Ask for every cache line of [row, row + bytes) in L2 (T1; L1 is too small to hold a prefetch distance).
inline void prefetch_span(const void* row, int64_t bytes) {
  const char* first = static_cast<const char*>(row);
  for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(first + b, _MM_HINT_T1);
}

// scores[h * score_stride + p] = q_h . k_p for Heads query rows (q, `dim` apart) and Positions key rows
// (rows[p] + offset): each 16 elements of a key row are loaded and widened once for all Heads. Every
// score is reduced by store_sums8's tree (then a scalar tail past the last multiple of 16), so a score
// does not depend on the tile it was computed in.
template <int Heads, int Positions, typename E>
inline void key_tile(const float* q, const E* const* rows, int64_t offset, int64_t dim, float* scores,
                     int64_t score_stride) {
  static_assert(Heads * Positions <= kTileAccumulators);
  Vec16 acc[8];
  for (int j = 0; j < 8; ++j) acc[j] = zero16();
  const int64_t vector_dim = dim - dim % 16;
  for (int64_t d = 0; d < vector_dim; d += 16)
    for (int p = 0; p < Positions; ++p) {
      const Vec16 k = load16(rows[p] + offset + d);
      for (int h = 0; h < Heads; ++h) acc[h * Positions + p] = fma16(load16(q + h * dim + d), k, acc[h * Positions + p]);
    }
  float sums[8];
  store_sums8(acc, sums);
  for (int h = 0; h < Heads; ++h)
    for (int p = 0; p < Positions; ++p) {
      float sum = sums[h * Positions + p];
      for (int64_t d = vector_dim; d < dim; ++d) sum += q[h * dim + d] * to_float(rows[p][offset + d]);
      scores[h * score_stride + p] = sum;
    }
}

// acc[h * dim + first + j] += sum_p weights[h * weight_stride + p] * v_p[first + j] for Heads query heads,
// j < 16 * Chunks, p < count (v_p = rows[p] + offset): each 16 elements of a value row are loaded and
// widened once for all Heads; the sums stay in registers over the positions. Always inlined: GCC kept it
// out of line, and the calls cost 14% of the kernel's time with the rows in L2.
template <int Heads, int Chunks, typename E>
[[gnu::always_inline]] inline void value_tile(const float* weights, int64_t weight_stride, const E* const* rows, int64_t count,
                       int64_t offset, int64_t first, int64_t dim, float* acc) {
  static_assert(Heads * Chunks <= kTileAccumulators);
  Vec16 sum[Heads * Chunks];
  for (int h = 0; h < Heads; ++h)
    for (int c = 0; c < Chunks; ++c) sum[h * Chunks + c] = load16(acc + h * dim + first + 16 * c);
  for (int64_t p = 0; p < count; ++p) {
    const E* v = rows[p] + offset + first;
    for (int c = 0; c < Chunks; ++c) {
      const Vec16 x = load16(v + 16 * c);
      for (int h = 0; h < Heads; ++h)
        sum[h * Chunks + c] = fma16(set16(weights[h * weight_stride + p]), x, sum[h * Chunks + c]);
    }
  }
  for (int h = 0; h < Heads; ++h)
    for (int c = 0; c < Chunks; ++c) store16(acc + h * dim + first + 16 * c, sum[h * Chunks + c]);
}

// One task's view of a sequence: its attended positions' rows and the sizes the passes share.
template <typename E>
struct TaskRows {
  const std::vector<const E*>& rows;  // key row of each attended position, at the task's first KV head
  int64_t length, num_kv, group, dim, width;
  int64_t span_bytes;                 // one position's rows of the task's KV heads (adjacent in the pool)

  void prefetch(int64_t from, int64_t to, int64_t offset) const {
    for (int64_t j = from; j < std::min(to, length); ++j) prefetch_span(rows[j] + offset, span_bytes);
  }
};

// scores [heads, length] = the task's scaled queries q [heads, dim] . its key rows, Heads query heads
// (dividing G) x kTileAccumulators / Heads positions per tile, positions in ascending order, all KV heads
// of a position before the next.
template <int Heads, typename E>
void key_pass(const TaskRows<E>& t, const float* q, float* scores) {
  constexpr int kPositions = kTileAccumulators / Heads;
  t.prefetch(0, kPrefetchPositions, 0);
  int64_t i = 0;
  const auto step = [&](auto positions) {
    constexpr int n = decltype(positions)::value;
    t.prefetch(i + kPrefetchPositions, i + kPrefetchPositions + n, 0);
    for (int64_t kv = 0; kv < t.num_kv; ++kv)
      for (int64_t h = kv * t.group; h < (kv + 1) * t.group; h += Heads)
        key_tile<Heads, n>(q + h * t.dim, &t.rows[i], kv * t.width, t.dim, scores + h * t.length + i, t.length);
    i += n;
  };
  while (i + kPositions <= t.length) step(std::integral_constant<int, kPositions>{});
  while (i < t.length) step(std::integral_constant<int, 1>{});
}

// acc [heads, dim] = sum over positions of weights [heads, length] x the task's value rows (at
// value_offset from the key rows), in runs of kRunPositions positions in ascending order; per run, each
// KV head's rows are read once for its G query heads, Heads of them x kTileAccumulators / Heads chunks of
// 16 floats per tile.
template <int Heads, typename E>
void value_pass(const TaskRows<E>& t, const float* weights, int64_t value_offset, float* acc) {
  constexpr int kChunks = kTileAccumulators / Heads;
  const int64_t chunks = t.dim / 16, vector_dim = 16 * chunks;
  t.prefetch(0, kPrefetchPositions, value_offset);
  for (int64_t i = 0; i < t.length; i += kRunPositions) {
    const int64_t n = std::min(kRunPositions, t.length - i);
    t.prefetch(i + kPrefetchPositions, i + kPrefetchPositions + n, value_offset);
    for (int64_t kv = 0; kv < t.num_kv; ++kv) {
      const int64_t offset = value_offset + kv * t.width;
      for (int64_t h = kv * t.group; h < (kv + 1) * t.group; h += Heads) {
        const float* w = weights + h * t.length + i;
        int64_t c = 0;
        for (; c + kChunks <= chunks; c += kChunks)
          value_tile<Heads, kChunks>(w, t.length, &t.rows[i], n, offset, 16 * c, t.dim, acc + h * t.dim);
        for (; c < chunks; ++c) value_tile<Heads, 1>(w, t.length, &t.rows[i], n, offset, 16 * c, t.dim, acc + h * t.dim);
        for (int64_t k = 0; k < Heads; ++k)
          for (int64_t p = 0; p < n; ++p)
            for (int64_t d = vector_dim; d < t.dim; ++d)
              acc[(h + k) * t.dim + d] += w[k * t.length + p] * to_float(t.rows[i + p][offset + d]);
      }
    }
  }
}

// Query heads per tile: the largest divisor of G that fits the accumulators.
inline int head_tile(int64_t group) {
  int heads = static_cast<int>(std::min<int64_t>(group, kTileAccumulators));
  while (group % heads != 0) --heads;
  return heads;
}

// Runs pass<Heads>() for Heads = heads (1 .. kTileAccumulators).
template <typename Pass>
void with_head_tile(int heads, Pass pass) {
  switch (heads) {
    case 1: return pass(std::integral_constant<int, 1>{});
    case 2: return pass(std::integral_constant<int, 2>{});
    case 3: return pass(std::integral_constant<int, 3>{});
    case 4: return pass(std::integral_constant<int, 4>{});
    case 5: return pass(std::integral_constant<int, 5>{});
    case 6: return pass(std::integral_constant<int, 6>{});
    default:
      if constexpr (kTileAccumulators >= 8) {
        if (heads == 7) return pass(std::integral_constant<int, 7>{});
        return pass(std::integral_constant<int, 8>{});
      }
  }
}

// One sequence's KV heads [first_kv_head, first_kv_head + num_kv) and the G query heads of each, in two
// passes over the attended positions in ascending order: the keys, a softmax per query head, then the
// values. Each pass reads a position's rows of all the task's KV heads (adjacent in the pool) before the
// next position's, each (position, KV head) row once for all G of its query heads, and prefetches rows
// kPrefetchPositions ahead. Cache rows hold E (T itself, or quantized codes whose row scales fold into
// the scores and the weights). sinks: [H] logits of the softmax's denominator, or nullptr.
template <typename T, typename E>
void attend(const T* query, const E* cache, const int64_t* table, int64_t context_len, int64_t window, float scale,
            float softcap, const float* sinks, const Geometry& g, int64_t first_kv_head, int64_t num_kv, T* out) {
  const int64_t group = g.num_heads / g.num_kv_heads, dim = g.head_dim, width = g.head_stride;
  const int64_t heads = num_kv * group;  // query heads of this task, consecutive from first_kv_head * G
  const int64_t start = window > 0 ? std::max<int64_t>(0, context_len - window) : 0;
  const int64_t length = context_len - start;
  std::vector<float> q(heads * dim), scores(heads * length), acc(heads * dim, 0.f);  // scores [heads, length]
  std::vector<const E*> rows(length);
  const T* q_src = query + first_kv_head * group * dim;
  for (int64_t i = 0; i < heads * dim; ++i) q[i] = static_cast<float>(q_src[i]) * scale;
  for (int64_t p = start; p < context_len; ++p)
    rows[p - start] = cache + table[p / g.block_size] * g.block_stride + (p % g.block_size) * g.row_stride +
                      first_kv_head * g.head_stride;
  const TaskRows<E> task{rows, length, num_kv, group, dim, width, num_kv * width * static_cast<int64_t>(sizeof(E))};
  const int64_t value_offset = g.block_size * g.row_stride;
  const int tile = head_tile(group);

  with_head_tile(tile, [&](auto h) { key_pass<decltype(h)::value>(task, q.data(), scores.data()); });
  if constexpr (KVRow<E>::kQuantized)  // a key row's scale multiplies its scores
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t i = 0; i < length; ++i) scores[h * length + i] *= KVRow<E>::scale(rows[i] + (h / group) * width, dim);
  if (softcap > 0.f)  // on the whole scaled score, the key row's scale included
    for (int64_t h = 0; h < heads; ++h) cap_scores(&scores[h * length], length, softcap);
  const float no_sink = -std::numeric_limits<float>::infinity();
  for (int64_t h = 0; h < heads; ++h)
    softmax(&scores[h * length], length, sinks ? sinks[first_kv_head * group + h] : no_sink);
  if constexpr (KVRow<E>::kQuantized)  // probability x value scale: the weight of each value row's codes
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t i = 0; i < length; ++i)
        scores[h * length + i] *= KVRow<E>::scale(rows[i] + value_offset + (h / group) * width, dim);
  with_head_tile(tile, [&](auto h) { value_pass<decltype(h)::value>(task, scores.data(), value_offset, acc.data()); });

  T* out_dst = out + first_kv_head * group * dim;
  const int64_t vector_dim = dim - dim % 16;
  for (int64_t h = 0; h < heads; ++h) {
    for (int64_t d = 0; d < vector_dim; d += 16) store16(out_dst + h * dim + d, load16(&acc[h * dim + d]));
    for (int64_t d = vector_dim; d < dim; ++d) out_dst[h * dim + d] = static_cast<T>(acc[h * dim + d]);
  }
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
            const at::Tensor& context_lens, int64_t window, double scale, double softcap, const float* sinks,
            at::Tensor& out) {
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
      attend<T, E>(q + b * row, cache, tables + b * g.max_blocks, lens[b], window, static_cast<float>(scale),
                   static_cast<float>(softcap), sinks, g,
                   first_kv_head, per_task, o + b * row);
    }
  });
}

// The cache's element type for a query of dtype T: T itself, or a quantized pool's codes.
template <typename T>
void decode_for_cache(const at::Tensor& query, const at::Tensor& kv_cache, const at::Tensor& block_tables,
                      const at::Tensor& context_lens, int64_t window, double scale, double softcap,
                      const float* sinks, at::Tensor& out) {
  switch (kv_cache.scalar_type()) {
    case at::kChar:
      return decode<T, int8_t>(query, kv_cache, block_tables, context_lens, window, scale, softcap, sinks, out);
    case at::kFloat8_e4m3fn:
      return decode<T, Fp8E4M3>(query, kv_cache, block_tables, context_lens, window, scale, softcap, sinks, out);
    default: return decode<T, T>(query, kv_cache, block_tables, context_lens, window, scale, softcap, sinks, out);
  }
}

bool is_quantized_kv(const at::Tensor& kv_cache) {
  return kv_cache.scalar_type() == at::kChar || kv_cache.scalar_type() == at::kFloat8_e4m3fn;
}

// The sinks' float32 logits, one per query head; nullptr without sinks.
const float* sink_logits(const std::optional<at::Tensor>& sinks, int64_t num_heads, const char* op) {
  if (!sinks.has_value()) return nullptr;
  TORCH_CHECK(sinks->dim() == 1 && sinks->size(0) == num_heads && sinks->is_contiguous() &&
                  sinks->scalar_type() == at::kFloat,
              op, ": sinks must be a contiguous float32 tensor of one logit per query head");
  return sinks->const_data_ptr<float>();
}

void paged_decode_attention(const at::Tensor& query, const at::Tensor& kv_cache, const at::Tensor& block_tables,
                            const at::Tensor& context_lens, int64_t sliding_window, double scale, double softcap,
                            const std::optional<at::Tensor>& sinks, at::Tensor out) {
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
  const float* sink_row = sink_logits(sinks, query.size(1), "paged_decode_attention");
  switch (query.scalar_type()) {
    case at::kFloat:
      return decode_for_cache<float>(query, kv_cache, block_tables, context_lens, sliding_window, scale, softcap,
                                     sink_row, out);
    case at::kBFloat16:
      return decode_for_cache<c10::BFloat16>(query, kv_cache, block_tables, context_lens, sliding_window, scale,
                                             softcap, sink_row, out);
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
        "int sliding_window, float scale, float softcap, Tensor? sinks, Tensor(a!) out) -> ()");
  m.def("fp8_e4m3_to_float(Tensor codes, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(splitserve_cpu, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
  m.impl("fp8_e4m3_to_float", &fp8_e4m3_codes_to_float);
}
