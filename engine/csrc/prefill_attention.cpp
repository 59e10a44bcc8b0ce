// Paged prefill attention for CPU: one request's chunk of query tokens attends, causally, to every
// position before it (a cached prefix, earlier chunks) and to itself, reading keys and values from the
// KV pool's blocks. Built at first use by engine/cpu_kernels.py.
//
// Shapes (all contiguous; query and out float32 or bf16):
//   query       [q, H, D]                             positions start .. start + q - 1
//   kv_cache    [num_blocks, 2, block_size, Hkv, W]   [:, 0] keys, [:, 1] values; already holds the chunk's own;
//                                                     the query's dtype (W = D) or a quantized pool's int8 /
//                                                     float8_e4m3fn codes (W = D + 2: codes, then a bf16 scale)
//   block_table [ceil((start + q) / block_size)] int64
//   out         [q, H, D]
//   sinks       [H] float32, or none: per query head, a logit that joins the softmax's denominator and weighs no
//               value (GPT-OSS's attention sinks)
// Query head h reads KV head h / (H / Hkv). Query position i attends key position j when j <= i and, with
// sliding_window > 0, i - j < sliding_window. softcap > 0 caps each scaled score s as softcap * tanh(s /
// softcap) before the mask (Gemma 2's attn_logit_softcapping); 0 leaves them. D must be a multiple of 16.
//
// Flash-attention style: per (KV head, tile of query positions) task, key tiles of 64 positions update a
// running max, sum and float32 output per query row (online softmax), so a chunk after a prefix needs
// neither a gather of the prefix nor an explicit mask (torch's fused SDPA needs both, and computes the
// masked tiles). In bf16 the products run on AVX512-BF16 dot instructions (two bf16 products per float
// lane, summed in float32; the same sums from two float FMAs on CPUs without them: dot_bf16_pairs in
// vec16.h), where torch's kernel widens to float32; the probabilities are rounded to bf16 before they
// weight the values, as fused GPU kernels do. In float32 they are float FMAs. Written against vec16.h's
// Vec16, so the one source builds for AVX-512 and for AVX2; only the register blocking differs (32 zmm
// hold 4 x 4 score accumulators, 16 ymm hold a quarter of that).
//
// Layout of the work: the G = H / Hkv query heads sharing a KV head form the rows of one task (row
// r = position * G + head), so each key and value tile serves G * kQueryTile rows. Keys and values are
// first repacked per KV head into 32-bit words of P = 4 / sizeof(dtype) elements (pack_tile), the operand
// layouts of the dot instruction (P = 2) or of a broadcast FMA (P = 1); a quantized pool's rows are
// dequantized to the query's dtype on the way (code x scale, rounded as torch's .to(dtype) rounds), so
// the tiles hold what the torch reference attends to. Tasks run heaviest first (the last query tiles see
// the most keys), taken from a shared counter.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "vec16.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <vector>

namespace {

using bf16 = c10::BFloat16;

constexpr int64_t kQueryTile = 32;  // query positions per task
constexpr int64_t kKeyTile = 64;    // key positions per step of a task: 4 vectors of 16 scores
constexpr int64_t kRowBlock = 4;    // query rows per score micro-kernel; rows are padded to a multiple of it
// Vec16 columns (of the tile's 4) per pass of the score micro-kernel: kRowBlock x kScoreColumns
// accumulators plus kScoreColumns key vectors stay in registers.
constexpr int kScoreColumns = kVec16Registers >= 32 ? 4 : 1;

// The dtype's view of a 32-bit word: bf16 packs two elements per word (summed by one dot
// instruction), float one (one FMA). Every packed operand below is a run of such words.
template <typename T>
struct Words {
  static constexpr int64_t kPerWord = 4 / sizeof(T);

  // acc + the products of the elements of a and b, lane by lane (a and b: 16 words each).
  static Vec16 dot(Vec16 acc, Words16 a, Words16 b);

  // The word holding elements low (and, for bf16, high) in memory order.
  static uint32_t word(const T* low, const T* high);
};

template <>
inline Vec16 Words<float>::dot(Vec16 acc, Words16 a, Words16 b) {
  return fma16(as_floats(a), as_floats(b), acc);
}

template <>
inline uint32_t Words<float>::word(const float* low, const float*) {
  uint32_t w = 0;
  if (low) std::memcpy(&w, low, sizeof w);
  return w;
}

template <>
inline Vec16 Words<bf16>::dot(Vec16 acc, Words16 a, Words16 b) {
  return dot_bf16_pairs(acc, a, b);
}

template <>
inline uint32_t Words<bf16>::word(const bf16* low, const bf16* high) {
  uint16_t l = 0, h = 0;
  if (low) std::memcpy(&l, low, sizeof l);
  if (high) std::memcpy(&h, high, sizeof h);
  return l | (static_cast<uint32_t>(h) << 16);
}

struct Geometry {
  int64_t num_heads, num_kv_heads, head_dim, block_size, group;
  int64_t start, query_len, context_len, window;
  int64_t head_stride;   // elements of one (position, KV head) row: W (D, or D + 2 when quantized)
  int64_t row_stride;    // elements between consecutive positions of one block: Hkv * W
  int64_t block_stride;  // elements of one block (keys and values): 2 * block_size * Hkv * W
  int64_t key_tiles;     // ceil(context_len / kKeyTile)
  float softcap;         // > 0: scaled scores are capped to (-softcap, softcap); 0: no cap
  const float* sinks;    // [H] sink logits, or nullptr
};

// A key or value row of the pool as T values: the row itself when the pool holds T, else its codes
// dequantized into `scratch` (D values).
template <typename T, typename E>
inline const T* row_as(const E* row, int64_t head_dim, T* scratch) {
  if constexpr (KVRow<E>::kQuantized) {
    const float scale = KVRow<E>::scale(row, head_dim);
    for (int64_t d = 0; d < head_dim; ++d) scratch[d] = static_cast<T>(to_float(row[d]) * scale);
    return scratch;
  } else {
    return row;
  }
}

// One key tile of one KV head, repacked; positions past context_len are 0. With P elements per word:
//   keys   [D / P][kKeyTile] words: word (d, j) = dims P*d .. P*d + P-1 of key j
//   values [kKeyTile / P][D] words: word (j, d) = dim d of keys P*j .. P*j + P-1
template <typename T, typename E>
void pack_tile(const E* cache, const int64_t* table, const Geometry& g, int64_t kv_head, int64_t tile, uint32_t* keys,
               uint32_t* values) {
  constexpr int64_t P = Words<T>::kPerWord;
  const int64_t key_words = g.head_dim / P, value_offset = g.block_size * g.row_stride;
  std::vector<T> scratch(KVRow<E>::kQuantized ? 2 * P * g.head_dim : 0);  // dequantized rows: P keys, P values
  for (int64_t j = 0; j < kKeyTile; j += P) {
    const T* key_rows[P];
    const T* value_rows[P];
    for (int64_t k = 0; k < P; ++k) {
      const int64_t p = tile * kKeyTile + j + k;
      key_rows[k] = value_rows[k] = nullptr;
      if (p >= g.context_len) continue;
      const E* row = cache + table[p / g.block_size] * g.block_stride + (p % g.block_size) * g.row_stride +
                     kv_head * g.head_stride;
      key_rows[k] = row_as<T>(row, g.head_dim, scratch.data() + k * g.head_dim);
      value_rows[k] = row_as<T>(row + value_offset, g.head_dim, scratch.data() + (P + k) * g.head_dim);
    }
    for (int64_t k = 0; k < P; ++k)
      for (int64_t d = 0; d < key_words; ++d)
        keys[d * kKeyTile + j + k] =
            key_rows[k] ? Words<T>::word(key_rows[k] + P * d, key_rows[k] + P * d + P - 1) : 0;
    for (int64_t d = 0; d < g.head_dim; ++d)
      values[(j / P) * g.head_dim + d] = Words<T>::word(value_rows[0] ? value_rows[0] + d : nullptr,
                                                        value_rows[P - 1] ? value_rows[P - 1] + d : nullptr);
  }
}

// scores[r][0..64) = q_r . key_j for 4 rows, kScoreColumns * 16 keys per pass; q rows hold key_words words.
template <typename T>
inline void score_block(const uint32_t* q, const uint32_t* keys, int64_t key_words, float* scores) {
  constexpr int C = kScoreColumns;
  for (int c0 = 0; c0 < 4; c0 += C) {
    Vec16 acc[kRowBlock][C];
    for (auto& row : acc)
      for (auto& v : row) v = zero16();
    for (int64_t d = 0; d < key_words; ++d) {
      Words16 k[C];
      for (int c = 0; c < C; ++c) k[c] = load_words(keys + d * kKeyTile + 16 * (c0 + c));
      for (int r = 0; r < kRowBlock; ++r) {
        const Words16 q_word = broadcast_word(q[r * key_words + d]);
        for (int c = 0; c < C; ++c) acc[r][c] = Words<T>::dot(acc[r][c], q_word, k[c]);
      }
    }
    for (int r = 0; r < kRowBlock; ++r)
      for (int c = 0; c < C; ++c) store16(scores + r * kKeyTile + 16 * (c0 + c), acc[r][c]);
  }
}

// out[r][d0 .. d0 + 16N) += sum_j p_r[j] * value_j[d0 .. d0 + 16N) for R rows at a time, the R x N
// accumulators in registers; probs rows hold kKeyTile / P words, out rows head_dim floats.
template <typename T, int N, int R>
inline void weigh_slice(const uint32_t* probs, const uint32_t* values, int64_t rows, int64_t head_dim, int64_t d0,
                        float* out) {
  constexpr int64_t prob_words = kKeyTile / Words<T>::kPerWord;
  for (int64_t r0 = 0; r0 < rows; r0 += R) {
    Vec16 acc[R][N];
    for (int r = 0; r < R; ++r)
      for (int n = 0; n < N; ++n) acc[r][n] = load16(out + (r0 + r) * head_dim + d0 + 16 * n);
    for (int64_t j = 0; j < prob_words; ++j) {
      Words16 v[N];
      for (int n = 0; n < N; ++n) v[n] = load_words(values + j * head_dim + d0 + 16 * n);
      for (int r = 0; r < R; ++r) {
        const Words16 p = broadcast_word(probs[(r0 + r) * prob_words + j]);
        for (int n = 0; n < N; ++n) acc[r][n] = Words<T>::dot(acc[r][n], p, v[n]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int n = 0; n < N; ++n) store16(out + (r0 + r) * head_dim + d0 + 16 * n, acc[r][n]);
  }
}

// Vectors per slice of a value row, and rows per pass for a slice of N vectors, so that the R x N
// accumulators and N value vectors stay in registers: on AVX-512 a whole row of up to 128 dims, 4 rows up
// to 80 dims and 2 above; on AVX2 (a quarter of the register bytes) 16 dims, 4 rows (measured, bf16, 1024
// tokens, 12 / 4 heads of 64: 32 ms against 41 ms for 32-dim slices of 2 rows). R divides kRowBlock.
constexpr int kSliceVectors = kVec16Registers >= 32 ? 8 : 1;

template <int N>
constexpr int weigh_rows() {
  return N <= 5 ? 4 : 2;
}

// weigh_slice for n vectors, 1 <= n <= N.
template <typename T, int N>
inline void weigh_slice_of(int64_t n, const uint32_t* probs, const uint32_t* values, int64_t rows, int64_t head_dim,
                           int64_t d0, float* out) {
  if constexpr (N > 1)
    if (n < N) return weigh_slice_of<T, N - 1>(n, probs, values, rows, head_dim, d0, out);
  weigh_slice<T, N, weigh_rows<N>()>(probs, values, rows, head_dim, d0, out);
}

// out[r][0..D) += sum_j p_r[j] * value_j, slice by slice; rows are padded to a multiple of kRowBlock.
template <typename T>
void weigh_values(const uint32_t* probs, const uint32_t* values, int64_t rows, int64_t head_dim, float* out) {
  for (int64_t d0 = 0; d0 < head_dim; d0 += 16 * kSliceVectors) {
    const int64_t n = std::min<int64_t>(kSliceVectors, (head_dim - d0) / 16);
    weigh_slice_of<T, kSliceVectors>(n, probs, values, rows, head_dim, d0, out);
  }
}

// Per-thread buffers of one task: rows = G * kQueryTile rounded up to kRowBlock.
struct TaskBuffers {
  std::vector<uint32_t> queries;  // [rows][D / P] words
  std::vector<float> scores;      // [rows][kKeyTile]
  std::vector<uint32_t> probs;    // [rows][kKeyTile / P] words: the scores' probabilities in the dtype
  std::vector<float> out;         // [rows][D]
  std::vector<float> row_max, row_sum;

  TaskBuffers(int64_t rows, int64_t head_dim)
      : queries(rows * head_dim), scores(rows * kKeyTile), probs(rows * kKeyTile), out(rows * head_dim),
        row_max(rows), row_sum(rows) {}
};

// Scores of one key tile -> scaled, capped (g.softcap > 0), masked, online-softmax update of the rows' max,
// sum and output scale; leaves the tile's probabilities, in the dtype and key order, in buf.probs (for bf16,
// word j holds keys 2j and 2j + 1: the dot instruction's pair layout).
template <typename T>
void softmax_tile(TaskBuffers& buf, const Geometry& g, int64_t first_position, int64_t rows, int64_t first_key,
                  float scale) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const Vec16 scale_v = set16(scale), neg_inf_v = set16(neg_inf), cap_v = set16(g.softcap);
  const bool capped = g.softcap > 0.f;
  for (int64_t r = 0; r < rows; ++r) {
    float* s = &buf.scores[r * kKeyTile];
    const int64_t position = first_position + r / g.group;
    const int64_t lo = g.window > 0 ? std::max<int64_t>(0, position - g.window + 1) : 0;
    const bool masked = first_key + kKeyTile - 1 > position || first_key < lo;
    Vec16 v[4];
    Vec16 tile_max_v = neg_inf_v;
    for (int c = 0; c < 4; ++c) {
      v[c] = load16(s + 16 * c) * scale_v;
      if (capped) v[c] = cap_scores16(v[c], cap_v);
      if (masked)  // keys first_key + 16c + lane outside [lo, position] get -inf
        v[c] = keep_in_range(v[c], static_cast<int32_t>(first_key + 16 * c), static_cast<int32_t>(lo),
                             static_cast<int32_t>(position), neg_inf_v);
      tile_max_v = max16(tile_max_v, v[c]);
    }
    const float new_max = std::max(buf.row_max[r], reduce_max(tile_max_v));
    T* p = reinterpret_cast<T*>(&buf.probs[r * (kKeyTile / Words<T>::kPerWord)]);
    if (new_max == neg_inf) {  // nothing visible yet in this row
      std::fill(p, p + kKeyTile, T(0.f));
      continue;
    }
    const float correction = std::exp(buf.row_max[r] - new_max);  // 0 when the row had nothing
    buf.row_max[r] = new_max;
    const Vec16 shift = set16(new_max);
    Vec16 sums = zero16();
    for (int c = 0; c < 4; ++c) {
      const Vec16 e = exp16(v[c] - shift);
      sums = sums + e;
      store16(p + 16 * c, e);
    }
    buf.row_sum[r] = buf.row_sum[r] * correction + reduce_add(sums);
    if (correction != 1.f) {
      const Vec16 c = set16(correction);
      float* o = &buf.out[r * g.head_dim];
      for (int64_t d = 0; d < g.head_dim; d += 16) store16(o + d, c * load16(o + d));
    }
  }
}

// The packed keys and values of one KV head: key_tiles consecutive tiles of pack_tile's layout.
struct PackedHead {
  const uint32_t* keys;
  const uint32_t* values;
};

template <typename T>
void run_task(TaskBuffers& buf, const T* query, const PackedHead& head, const Geometry& g, int64_t kv_head,
              int64_t query_tile, float scale, T* out) {
  const int64_t key_words = g.head_dim / Words<T>::kPerWord, row_width = g.num_heads * g.head_dim;
  const int64_t first = query_tile * kQueryTile;  // index of the tile's first query in the chunk
  const int64_t positions = std::min(kQueryTile, g.query_len - first);
  const int64_t rows = positions * g.group, padded_rows = (rows + kRowBlock - 1) / kRowBlock * kRowBlock;
  std::fill(buf.queries.begin(), buf.queries.begin() + padded_rows * key_words, 0u);
  for (int64_t r = 0; r < rows; ++r) {  // a row in memory already is its words
    const T* q = query + (first + r / g.group) * row_width + (kv_head * g.group + r % g.group) * g.head_dim;
    std::memcpy(&buf.queries[r * key_words], q, g.head_dim * sizeof(T));
  }
  std::fill(buf.out.begin(), buf.out.begin() + padded_rows * g.head_dim, 0.f);
  std::fill(buf.row_max.begin(), buf.row_max.end(), -std::numeric_limits<float>::infinity());
  std::fill(buf.row_sum.begin(), buf.row_sum.end(), 0.f);
  if (g.sinks)  // a sink is a key seen before the first tile: its logit, weight exp(0) = 1, and a zero value
    for (int64_t r = 0; r < rows; ++r) {
      buf.row_max[r] = g.sinks[kv_head * g.group + r % g.group];
      buf.row_sum[r] = 1.f;
    }
  const int64_t first_position = g.start + first, last_position = first_position + positions - 1;
  const int64_t lowest_key = g.window > 0 ? std::max<int64_t>(0, first_position - g.window + 1) : 0;
  const int64_t tile_words = kKeyTile * key_words;  // = kKeyTile * D / P, keys or values
  for (int64_t tile = lowest_key / kKeyTile; tile * kKeyTile <= last_position; ++tile) {
    for (int64_t r = 0; r < padded_rows; r += kRowBlock)
      score_block<T>(&buf.queries[r * key_words], head.keys + tile * tile_words, key_words,
                     &buf.scores[r * kKeyTile]);
    softmax_tile<T>(buf, g, first_position, rows, tile * kKeyTile, scale);
    weigh_values<T>(buf.probs.data(), head.values + tile * tile_words, padded_rows, g.head_dim, buf.out.data());
  }
  for (int64_t r = 0; r < rows; ++r) {
    T* o = out + (first + r / g.group) * row_width + (kv_head * g.group + r % g.group) * g.head_dim;
    const Vec16 inv_sum = set16(1.f / buf.row_sum[r]);
    for (int64_t d = 0; d < g.head_dim; d += 16) store16(o + d, inv_sum * load16(&buf.out[r * g.head_dim + d]));
  }
}

template <typename T, typename E>
void prefill(const at::Tensor& query, const at::Tensor& kv_cache, const at::Tensor& block_table,
             const Geometry& g, double scale, at::Tensor& out) {
  const E* cache = static_cast<const E*>(kv_cache.const_data_ptr());
  const int64_t* table = block_table.const_data_ptr<int64_t>();
  const int64_t tile_words = kKeyTile * g.head_dim / Words<T>::kPerWord;
  const int64_t head_words = g.key_tiles * tile_words;  // of one KV head, keys or values
  std::vector<uint32_t> packed_keys(g.num_kv_heads * head_words), packed_values(g.num_kv_heads * head_words);
  at::parallel_for(0, g.num_kv_heads * g.key_tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t kv_head = t / g.key_tiles, offset = kv_head * head_words + (t % g.key_tiles) * tile_words;
      pack_tile<T, E>(cache, table, g, kv_head, t % g.key_tiles, &packed_keys[offset], &packed_values[offset]);
    }
  });
  const int64_t query_tiles = (g.query_len + kQueryTile - 1) / kQueryTile;
  const int64_t tasks = query_tiles * g.num_kv_heads;
  const int64_t rows = (g.group * kQueryTile + kRowBlock - 1) / kRowBlock * kRowBlock;
  const T* q = query.const_data_ptr<T>();
  T* o = out.mutable_data_ptr<T>();
  std::atomic<int64_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    TaskBuffers buf(rows, g.head_dim);
    for (int64_t task = next++; task < tasks; task = next++) {
      const int64_t kv_head = task % g.num_kv_heads, query_tile = query_tiles - 1 - task / g.num_kv_heads;
      const PackedHead head{&packed_keys[kv_head * head_words], &packed_values[kv_head * head_words]};
      run_task<T>(buf, q, head, g, kv_head, query_tile, static_cast<float>(scale), o);
    }
  });
}

// The cache's element type for a query of dtype T: T itself, or a quantized pool's codes.
template <typename T>
void prefill_for_cache(const at::Tensor& query, const at::Tensor& kv_cache, const at::Tensor& block_table,
                       const Geometry& g, double scale, at::Tensor& out) {
  switch (kv_cache.scalar_type()) {
    case at::kChar: return prefill<T, int8_t>(query, kv_cache, block_table, g, scale, out);
    case at::kFloat8_e4m3fn: return prefill<T, Fp8E4M3>(query, kv_cache, block_table, g, scale, out);
    default: return prefill<T, T>(query, kv_cache, block_table, g, scale, out);
  }
}

void paged_prefill_attention(const at::Tensor& query, const at::Tensor& kv_cache, const at::Tensor& block_table,
                             int64_t start_position, int64_t sliding_window, double scale, double softcap,
                             const std::optional<at::Tensor>& sinks, at::Tensor out) {
  TORCH_CHECK(query.dim() == 3 && kv_cache.dim() == 5 && block_table.dim() == 1 && out.dim() == 3,
              "paged_prefill_attention: bad ranks");
  TORCH_CHECK(query.is_contiguous() && kv_cache.is_contiguous() && block_table.is_contiguous() &&
                  out.is_contiguous(),
              "paged_prefill_attention: inputs must be contiguous");
  const bool quantized = kv_cache.scalar_type() == at::kChar || kv_cache.scalar_type() == at::kFloat8_e4m3fn;
  TORCH_CHECK((quantized || query.scalar_type() == kv_cache.scalar_type()) && out.scalar_type() == query.scalar_type(),
              "paged_prefill_attention: query and out must share a dtype, and kv_cache have it or be int8 / fp8 codes");
  TORCH_CHECK(block_table.scalar_type() == at::kLong, "paged_prefill_attention: block_table must be int64");
  TORCH_CHECK(query.size(1) % kv_cache.size(3) == 0 && query.size(2) + (quantized ? 2 : 0) == kv_cache.size(4) &&
                  query.size(2) % 16 == 0 && out.sizes() == query.sizes(),
              "paged_prefill_attention: head counts or head_dim (a multiple of 16) do not match the cache");
  TORCH_CHECK(!sinks.has_value() || (sinks->dim() == 1 && sinks->size(0) == query.size(1) && sinks->is_contiguous() &&
                                      sinks->scalar_type() == at::kFloat),
              "paged_prefill_attention: sinks must be a contiguous float32 tensor of one logit per query head");
  const int64_t context_len = start_position + query.size(0);
  TORCH_CHECK(block_table.size(0) * kv_cache.size(2) >= context_len,
              "paged_prefill_attention: block_table is shorter than the context");
  const Geometry g{query.size(1), kv_cache.size(3), query.size(2), kv_cache.size(2),
                   query.size(1) / kv_cache.size(3), start_position, query.size(0), context_len, sliding_window,
                   kv_cache.size(4), kv_cache.size(3) * kv_cache.size(4),
                   2 * kv_cache.size(2) * kv_cache.size(3) * kv_cache.size(4), (context_len + kKeyTile - 1) / kKeyTile,
                   static_cast<float>(softcap), sinks.has_value() ? sinks->const_data_ptr<float>() : nullptr};
  switch (query.scalar_type()) {
    case at::kFloat: return prefill_for_cache<float>(query, kv_cache, block_table, g, scale, out);
    case at::kBFloat16: return prefill_for_cache<bf16>(query, kv_cache, block_table, g, scale, out);
    default: TORCH_CHECK(false, "paged_prefill_attention: dtype ", query.scalar_type(), " is not supported");
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(splitserve_cpu, m) {
  m.def("paged_prefill_attention(Tensor query, Tensor kv_cache, Tensor block_table, int start_position, "
        "int sliding_window, float scale, float softcap, Tensor? sinks, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(splitserve_cpu, CPU, m) { m.impl("paged_prefill_attention", &paged_prefill_attention); }
