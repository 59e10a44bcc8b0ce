// y = x W^T + b with W in panels of 16 output columns (engine/models/packed_linear.py packs them once at
// load), bf16 or fp32.
//
// bf16 is for CPUs without a bf16 GEMM (AVX2, AVX-512 without AVX512_BF16): there oneDNN's only fast
// path widens the weights to fp32 at load, twice the memory and twice the bytes a small-batch decode step
// streams from memory, which is what bounds it. This kernel keeps them bf16 and widens them in registers
// (a bf16 is the high half of a float: one AND or one shift per 8 weights).
//
// Layouts, W [N, K], panel p = output columns [16 p, 16 p + 16), columns past N zero:
//   bf16: int32 [P][ceil(K/2)][16]; word (k2, j) holds W[16p + j, 2 k2] in its low half and
//         W[16p + j, 2 k2 + 1] in its high half (0 past an odd K): one Words16 load = 16 columns at 2 k.
//   fp32: float [P][K][16]; (k, j) holds W[16p + j, k].
//
// panel_linear_silu_mul: the MLP's gate and up projections and silu(gate) * up in one pass, for W = [G | U]
// packed as pairs: panel 2q = G's output columns [16 q, 16 q + 16), panel 2q + 1 = U's same columns (each
// padded with zeros past I on its own). Each 16-column tile's gate and up sums are rounded to x's dtype, then
// silu(gate) * up is computed and rounded where fused_ops.cpp's silu_and_mul rounds it: the result equals
// silu_and_mul(panel_linear(x, [G | U])) bit for bit without writing or reading back the [M, 2I] gate_up.
// panel_linear_gelu_tanh_mul: the same for Gemma's MLP, gelu(gate, approximate="tanh") * up, equal bit for bit
// to torch's F.gelu(gate, approximate="tanh") * up of that product (vec16.h's gelu_tanh_mul16).
//
// Arithmetic: x widened to float32 (and packed in row tiles) once per call; every output is
// sum_k x[m, k] * W[n, k] accumulated in float32 in ascending k, one fused multiply-add per term, plus the
// bias, rounded once to x's dtype. The order depends on nothing but k, so a row's result is the same
// whichever rows share its batch.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <bit>
#include <optional>
#include <type_traits>

#include "vec16.h"

namespace {

constexpr int64_t kPanelColumns = 16;

// The lines of the next unit's panel a tile prefetches into L2 while it runs (a line = one panel row: 16
// words): none unless `any`; else step k of the tile prefetches line first + (k >> shift). A unit's row tiles
// share its next unit's lines out among themselves (for_each_tile), so that DRAM serves them at an even rate
// across the unit instead of all in its first tile.
struct PrefetchSlice {
  bool any = false;
  int64_t first = 0;
  int shift = 0;

  // The first line to prefetch of the panel at next_panel, or nullptr for none (panel_tile's `ahead`).
  template <typename W>
  const W* start(const W* next_panel) const { return any ? next_panel + kPanelColumns * first : nullptr; }
};

// Rows per micro-tile: 2 registers per row on AVX2 (Vec16 is two ymm), plus the widened weights and a
// broadcast, within the 16 ymm; AVX-512's 32 zmm leave room for more, 8 keeps the tile small for decode.
constexpr int kTileRows = kVec16Registers >= 32 ? 8 : 6;

// Panels per micro-tile, so that a tile has 3 or more independent accumulators: with one row and one
// panel, each fused multiply-add waits for the previous one (4-5 cycles), and a batch-1 decode step ran
// at that latency instead of at memory bandwidth. A panel's own k order is unchanged. (3 rows x 2 panels
// would need 17 ymm registers on AVX2.)
template <int R>
constexpr int kTilePanels = R >= 3 ? 1 : (R == 1 ? 4 : 2);

// Where a row tile finds input k of its row r: x's rows as they are (x + r width + k), or packed in tiles
// (x + R k + r, pack_row_tiles): a tile's broadcasts then read one sequential stream instead of R rows
// width apart, 7-10% faster tiles at 64 rows of the 88M shapes (AVX2, weights from DRAM), but slower once
// the packed x no longer stays in L2 (from ~512 rows of those shapes: it streams from L3 as one stream
// instead of R).
template <bool kTiled, int R>
inline const float* tile_input(const float* x, int64_t width, int64_t k, int r) {
  return kTiled ? x + R * k + r : x + r * width + k;
}

// acc[r][c] = sum over k of x[r, k] * panel_c[k] for the R rows of a row tile x (rows width inputs long, as
// tile_input finds them) and C panels (stride panel_stride words); steps = a panel's rows: pairs of k for
// bf16 words (uint32_t), single k for float. `ahead` (or nullptr): the first line to prefetch into L2
// meanwhile; step k prefetches line k >> ahead_shift from there (each line 2^ahead_shift times in a row: the
// repeats find it in flight or in L2, and the loop keeps one shape, which GCC allocates without spilling an
// accumulator; a test per step, or runs of steps, made it spill one and bf16 tiles 40% slower).
template <bool kTiled, int R, int C>
inline void panel_tile(const float* x, int64_t width, const uint32_t* panel, int64_t panel_stride, int64_t pairs,
                       const uint32_t* ahead, int ahead_shift, Vec16 (&acc)[R][C]) {
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = zero16();
  for (int64_t k2 = 0; k2 < pairs; ++k2) {
    if (ahead != nullptr)
      _mm_prefetch(reinterpret_cast<const char*>(ahead + kPanelColumns * (k2 >> ahead_shift)), _MM_HINT_T1);
    for (int c = 0; c < C; ++c) {
      const Words16 words = load_words(panel + c * panel_stride + kPanelColumns * k2);
      const Vec16 even = low_bf16(words);  // W[., 2 k2]
      for (int r = 0; r < R; ++r)
        acc[r][c] = fma16(set16(*tile_input<kTiled, R>(x, width, 2 * k2, r)), even, acc[r][c]);
      const Vec16 odd = high_bf16(words);  // W[., 2 k2 + 1]
      for (int r = 0; r < R; ++r)
        acc[r][c] = fma16(set16(*tile_input<kTiled, R>(x, width, 2 * k2 + 1, r)), odd, acc[r][c]);
    }
  }
}

template <bool kTiled, int R, int C>
inline void panel_tile(const float* x, int64_t width, const float* panel, int64_t panel_stride, int64_t steps,
                       const float* ahead, int ahead_shift, Vec16 (&acc)[R][C]) {
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = zero16();
  for (int64_t k = 0; k < steps; ++k) {
    if (ahead != nullptr)
      _mm_prefetch(reinterpret_cast<const char*>(ahead + kPanelColumns * (k >> ahead_shift)), _MM_HINT_T1);
    for (int c = 0; c < C; ++c) {
      const Vec16 w = load16(panel + c * panel_stride + kPanelColumns * k);
      for (int r = 0; r < R; ++r) acc[r][c] = fma16(set16(*tile_input<kTiled, R>(x, width, k, r)), w, acc[r][c]);
    }
  }
}

// Inputs (k) per panel row.
template <typename W>
constexpr int64_t kInputsPerStep = std::is_same_v<W, uint32_t> ? 2 : 1;

template <typename T>
inline void store_columns(Vec16 value, int64_t columns, T* out) {
  if (columns == kPanelColumns) {
    store16(out, value);
    return;
  }
  alignas(64) T staged[kPanelColumns];
  store16(staged, value);
  std::copy(staged, staged + columns, out);
}

struct LinearShape {
  int64_t rows, steps, out_features;  // steps: rows of a panel
};

// Rows [row, row + R) of the output's columns [16 p, 16 (p + C)) that exist; slice: the lines of the next
// panel prefetched meanwhile (C = 1 when it has any).
template <typename T, typename W, bool kTiled, int R, int C = 1>
void tile(const float* x, const W* panels, const float* bias, const LinearShape& shape, int64_t p, int64_t row,
          const PrefetchSlice& slice, T* out) {
  const int64_t width = kInputsPerStep<W> * shape.steps, panel_stride = shape.steps * kPanelColumns;
  const W* panel = panels + p * panel_stride;
  Vec16 acc[R][C];
  panel_tile<kTiled, R, C>(x + row * width, width, panel, panel_stride, shape.steps,
                           slice.start(panel + C * panel_stride), slice.shift, acc);
  for (int c = 0; c < C; ++c) {
    const int64_t first = (p + c) * kPanelColumns, columns = std::min(kPanelColumns, shape.out_features - first);
    for (int r = 0; r < R; ++r) {
      const Vec16 value = bias == nullptr ? acc[r][c] : acc[r][c] + load16(bias + first);
      store_columns(value, columns, out + (row + r) * shape.out_features + first);
    }
  }
}

// f.template operator()<R>() for R = rows, 1 <= rows <= R0: the tile height as a compile-time constant.
template <int R0 = kTileRows - 1, typename F>
void with_rows(int rows, F&& f) {
  if constexpr (R0 > 1) {
    if (rows < R0) return with_rows<R0 - 1>(rows, f);
  }
  f.template operator()<R0>();
}

// Units per tile when all the rows fit one tile: a unit is a panel of panel_linear, a (gate, up) pair of
// panel_linear_silu_mul.
struct PanelUnits {
  template <int R>
  static constexpr int kPerTile = kTilePanels<R>;
};

// Runs `tile` over every (unit, row tile) of a product, in parallel over its num_units units of unit_panels
// panels each: tile.template operator()<R, U>(unit, row, slice) computes rows [row, row + R) of units
// [unit, unit + U), and prefetches slice's lines of the next unit's panels into L2 meanwhile.
// Fewer rows than a tile: all of them in one tile, Units::kPerTile<R> units at a time (the rest one by one),
// a tile of 3 or more rows prefetching the whole next unit (one line per step: at 3-5 rows a line feeds enough
// multiply-adds that its demand load alone leaves DRAM idle; at 1-2 the tile streams its weights at DRAM's pace
// and the hardware prefetcher follows the panels in order). More rows: a unit at a time, all its row tiles
// while its weights are in cache, the tiles sharing out the next unit's lines (else each unit's first tile
// waits on DRAM: a decode step's weights are not in cache; when the first tile prefetched all of them, a
// 64-row decode step's linears were 5-8% slower and a 16-row one's 20%: DRAM could not serve a whole panel
// within one tile, and the rest of the unit's tiles left it idle).
template <typename W, typename Units, typename F>
void for_each_tile(const LinearShape& shape, int64_t num_units, int64_t unit_panels, F&& tile) {
  // About 256K multiply-adds per task: a decode step's small layers run on one thread, where waking the
  // others would cost more than the layer.
  const int64_t per_unit =
      std::max<int64_t>(1, unit_panels * shape.rows * shape.steps * kInputsPerStep<W> * kPanelColumns);
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 18) / per_unit);
  at::parallel_for(0, num_units, grain, [&](int64_t begin, int64_t end) {
    if (shape.rows < kTileRows) {
      return with_rows(static_cast<int>(shape.rows), [&]<int R>() {
        constexpr int U = Units::template kPerTile<R>;
        static_assert(R < 3 || U == 1, "a prefetching tile runs one unit");
        const PrefetchSlice whole_unit{true, 0, 0};
        int64_t unit = begin;
        for (; unit + U <= end; unit += U)
          tile.template operator()<R, U>(unit, 0, R >= 3 && unit + 1 < end ? whole_unit : PrefetchSlice{});
        for (; unit < end; ++unit) tile.template operator()<R, 1>(unit, 0, PrefetchSlice{});
      });
    }
    const int64_t tiles = (shape.rows + kTileRows - 1) / kTileRows;
    const int64_t lines_per_tile = (shape.steps + tiles - 1) / tiles;
    // 2^shift steps per line, at most steps / lines_per_tile: a tile covers its share, up to twice over (into
    // the next tile's share, or past the next panel's last line: prefetches do not fault)
    const int shift = std::bit_width(static_cast<uint64_t>(shape.steps / lines_per_tile)) - 1;
    for (int64_t unit = begin; unit < end; ++unit) {
      const bool has_next = unit + 1 < end;
      // Tile i's share of the next unit's lines: from i lines_per_tile on, while there are any.
      const auto share = [&](int64_t i) {
        const int64_t first = i * lines_per_tile;
        return has_next && first < shape.steps ? PrefetchSlice{true, first, shift} : PrefetchSlice{};
      };
      int64_t row = 0, index = 0;
      for (; row + kTileRows <= shape.rows; row += kTileRows, ++index)
        tile.template operator()<kTileRows, 1>(unit, row, share(index));
      if (row < shape.rows)
        with_rows(static_cast<int>(shape.rows - row),
                  [&]<int R>() { tile.template operator()<R, 1>(unit, row, share(index)); });
    }
  });
}

template <bool kTiled, typename T, typename W>
void linear_panels(const float* x, const W* panels, const float* bias, const LinearShape& shape, int64_t num_panels,
                   T* out) {
  for_each_tile<W, PanelUnits>(shape, num_panels, 1, [&]<int R, int C>(int64_t p, int64_t row, const PrefetchSlice& slice) {
    tile<T, W, kTiled, R, C>(x, panels, bias, shape, p, row, slice, out);
  });
}

// Pairs per gated tile: one row runs two pairs (4 panels: as many independent accumulators as
// linear_panels' one-row tiles; with one pair a bf16 batch-1 step ran 2.4x slower than two passes).
template <int R>
constexpr int kTilePairs = R == 1 ? 2 : 1;

// The activations of the gated products, each computed and rounded as its unfused op does (fused_ops.cpp's
// silu_and_mul, torch's gelu): the vector form on columns [0, vector_columns<T>(I)) of a row (whole panels),
// the scalar form on the rest.
struct SiluMul {
  template <typename T>
  static Vec16 vec(Vec16 gate, Vec16 up) { return silu_mul16<T>(gate, up); }
  template <typename T>
  static float scalar(float gate, float up) { return silu_mul1<T>(gate, up); }
  template <typename T>
  static constexpr int64_t vector_columns(int64_t n) { return n / kPanelColumns * kPanelColumns; }
};

struct GeluTanhMul {
  template <typename T>
  static Vec16 vec(Vec16 gate, Vec16 up) { return gelu_tanh_mul16<T>(gate, up); }
  template <typename T>
  static float scalar(float gate, float up) { return gelu_tanh_mul1<T>(gate, up); }
  template <typename T>
  static constexpr int64_t vector_columns(int64_t n) { return gelu_vector_columns<T>(n); }
};

// out[row + r, 16 q' + j] = Act(gate, up) over rows [row, row + R) and the columns that exist of pairs
// q' in [q, q + Q) (I in shape.out_features). Tiles of two rows or fewer run all their panels at once;
// taller tiles run the gate panel, park its sums in L1, then the up panel (both tiles' accumulators at once
// would not fit the registers), each prefetching slice's lines of its counterpart in the next pair.
template <typename Act, typename T, typename W, bool kTiled, int R, int Q = 1>
void gated_tile(const float* x, const W* panels, const float* bias, const LinearShape& shape, int64_t q, int64_t row,
                const PrefetchSlice& slice, T* out) {
  const int64_t width = kInputsPerStep<W> * shape.steps, panel_stride = shape.steps * kPanelColumns;
  const float* rows = x + row * width;
  const W* first_panel = panels + 2 * q * panel_stride;
  alignas(64) float sums[Q][2][R][kPanelColumns];  // [pair][gate, up][row]
  if constexpr (R <= 2) {
    Vec16 acc[R][2 * Q];
    const W* no_prefetch = nullptr;
    panel_tile<kTiled, R, 2 * Q>(rows, width, first_panel, panel_stride, shape.steps, no_prefetch, 0, acc);
    for (int c = 0; c < 2 * Q; ++c)
      for (int r = 0; r < R; ++r) store16(sums[c / 2][c % 2][r], acc[r][c]);
  } else {
    static_assert(Q == 1, "taller tiles run one pair");
    Vec16 acc[R][1];
    for (int c = 0; c < 2; ++c) {
      const W* panel = first_panel + c * panel_stride;
      const W* next_pairs_panel = panel + 2 * panel_stride;
      panel_tile<kTiled, R, 1>(rows, width, panel, panel_stride, shape.steps, slice.start(next_pairs_panel),
                               slice.shift, acc);
      for (int r = 0; r < R; ++r) store16(sums[0][c][r], acc[r][0]);
    }
  }
  const int64_t vector_end = Act::template vector_columns<T>(shape.out_features);  // a multiple of 16
  for (int pair = 0; pair < Q; ++pair) {
    const int64_t first = (q + pair) * kPanelColumns, columns = std::min(kPanelColumns, shape.out_features - first);
    for (int r = 0; r < R; ++r) {
      Vec16 gate = load16(sums[pair][0][r]), up = load16(sums[pair][1][r]);
      if (bias != nullptr) gate = gate + load16(bias + 2 * first), up = up + load16(bias + 2 * first + kPanelColumns);
      gate = round16<T>(gate), up = round16<T>(up);
      T* target = out + (row + r) * shape.out_features + first;
      if (first + kPanelColumns <= vector_end) {
        store16(target, Act::template vec<T>(gate, up));
        continue;
      }
      float* gates = sums[pair][0][r];  // past vector_end: the fused op's scalar tail
      float* ups = sums[pair][1][r];
      store16(gates, gate), store16(ups, up);
      for (int64_t j = 0; j < columns; ++j) target[j] = static_cast<T>(Act::template scalar<T>(gates[j], ups[j]));
    }
  }
}

struct PairUnits {
  template <int R>
  static constexpr int kPerTile = kTilePairs<R>;
};

template <typename Act, bool kTiled, typename T, typename W>
void gated_pairs(const float* x, const W* panels, const float* bias, const LinearShape& shape, int64_t num_pairs,
                 T* out) {
  for_each_tile<W, PairUnits>(shape, num_pairs, 2, [&]<int R, int Q>(int64_t q, int64_t row, const PrefetchSlice& slice) {
    gated_tile<Act, T, W, kTiled, R, Q>(x, panels, bias, shape, q, row, slice, out);
  });
}

// Rows [row, row + R) of x [rows, in_features] as their tile reads them: input k of row r at out[R k + r], in
// float32, zeros for k in [in_features, width) (an odd K's pair with the panels' zero input).
template <int R, typename T>
void pack_tile_rows(const T* x, int64_t in_features, int64_t width, float* out) {
  for (int64_t k = 0; k < in_features; ++k)
    for (int r = 0; r < R; ++r) out[R * k + r] = static_cast<float>(x[r * in_features + k]);
  std::fill(out + R * in_features, out + R * width, 0.0f);
}

// x [rows, in_features] -> float32 row tiles (tile_input): the tile of rows [row, row + R) (R = kTileRows, fewer
// for the last, as for_each_tile cuts them) at packed[row * width, (row + R) * width). On the calling thread: at
// most kMaxTiledBytes, tens of microseconds, less than waking the other threads would cost.
template <typename T>
void pack_row_tiles(const T* x, int64_t rows, int64_t in_features, int64_t width, float* packed) {
  for (int64_t row = 0; row < rows; row += kTileRows) {
    with_rows<kTileRows>(static_cast<int>(std::min<int64_t>(kTileRows, rows - row)), [&]<int R>() {
      pack_tile_rows<R>(x + row * in_features, in_features, width, packed + row * width);
    });
  }
}

// Bytes of float32 inputs up to which the tiles read them packed (tile_input): 1 MiB, the L2 of the AVX2 CPU
// measured, where 256 rows of 768 inputs (768 KiB) ran 5-15% faster packed and 512 rows (1.5 MiB) 5-10%
// slower. Covers decode batches; prefill chunks read x's rows as they are.
constexpr int64_t kMaxTiledBytes = int64_t{1} << 20;

// x as the tiles read it: float32 [M, width] (width: the panels' inputs, K rounded up to whole bf16 pairs),
// packed in row tiles when `tiled`.
struct TileInputs {
  at::Tensor x;
  bool tiled;
};

// Checks x [M, K] (float32 or bfloat16) against panels int32 [P, ceil(K/2), 16] (bf16 pairs) or float32
// [P, K, 16] and bias float32 [16 P] or None; returns x as the tiles read it.
TileInputs tile_inputs(const char* op, const at::Tensor& x, const at::Tensor& panels,
                       const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), op, ": x must be a contiguous [rows, in_features] matrix");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, op, ": x must be float32 or bfloat16");
  const bool bf16 = panels.scalar_type() == at::kInt;
  TORCH_CHECK(panels.dim() == 3 && panels.size(2) == kPanelColumns && (bf16 || panels.scalar_type() == at::kFloat) &&
                  panels.is_contiguous(),
              op, ": panels must be a contiguous int32 [P, ceil(K/2), 16] or float32 [P, K, 16] tensor");
  const int64_t rows = x.size(0), in_features = x.size(1), steps = panels.size(1), per_step = bf16 ? 2 : 1;
  TORCH_CHECK(steps == (in_features + per_step - 1) / per_step, op, ": x has ", in_features, " features, the panels ",
              steps, bf16 ? " pairs" : " inputs");
  if (bias.has_value())
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() &&
                    bias->numel() == kPanelColumns * panels.size(0),
                op, ": bias must be contiguous float32 of 16 per panel");
  const int64_t width = steps * per_step;
  if (rows * width * static_cast<int64_t>(sizeof(float)) > kMaxTiledBytes) {
    at::Tensor wide = x.to(at::kFloat);
    if (in_features != width) wide = at::constant_pad_nd(wide, {0, width - in_features});
    return {wide, false};
  }
  at::Tensor packed = at::empty({rows, width}, x.options().dtype(at::kFloat));
  if (x.scalar_type() == at::kFloat)
    pack_row_tiles(x.data_ptr<float>(), rows, in_features, width, packed.data_ptr<float>());
  else
    pack_row_tiles(x.data_ptr<c10::BFloat16>(), rows, in_features, width, packed.data_ptr<float>());
  return {packed, true};
}

// Runs body(W* panels) with the panels' word type (uint32_t bf16 pairs or float).
template <typename F>
void with_panel_words(const at::Tensor& panels, F&& body) {
  if (panels.scalar_type() == at::kInt)
    body(reinterpret_cast<const uint32_t*>(panels.data_ptr<int32_t>()));
  else
    body(panels.data_ptr<float>());
}

const float* bias_pointer(const std::optional<at::Tensor>& bias) {
  return bias.has_value() ? bias->data_ptr<float>() : nullptr;
}

// body.template operator()<kTiled>(rows, words, target) with the inputs' layout and float32 rows, the panels'
// word type (with_panel_words) and out's element type (float or c10::BFloat16).
template <typename F>
void dispatch_product(const TileInputs& inputs, const at::Tensor& panels, at::Tensor& out, F&& body) {
  const float* rows = inputs.x.data_ptr<float>();
  with_panel_words(panels, [&](auto words) {
    const auto run = [&]<bool kTiled>() {
      if (out.scalar_type() == at::kFloat)
        body.template operator()<kTiled>(rows, words, out.data_ptr<float>());
      else
        body.template operator()<kTiled>(rows, words, out.data_ptr<c10::BFloat16>());
    };
    if (inputs.tiled)
      run.template operator()<true>();
    else
      run.template operator()<false>();
  });
}

// x [M, K], panels as tile_inputs says -> [M, out_features] in x's dtype, out_features in (16 (P - 1), 16 P].
at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& panels, const std::optional<at::Tensor>& bias,
                        int64_t out_features) {
  const TileInputs inputs = tile_inputs("panel_linear", x, panels, bias);
  const int64_t num_panels = panels.size(0);
  TORCH_CHECK(out_features > kPanelColumns * (num_panels - 1) && out_features <= kPanelColumns * num_panels,
              "panel_linear: ", out_features, " output features do not fill ", num_panels, " panels");
  at::Tensor out = at::empty({x.size(0), out_features}, x.options());
  if (x.size(0) == 0) return out;  // a step with no row to compute (no logits wanted): the tiles assume >= 1
  const LinearShape shape{x.size(0), panels.size(1), out_features};
  dispatch_product(inputs, panels, out, [&]<bool kTiled>(const float* rows, auto words, auto* target) {
    linear_panels<kTiled>(rows, words, bias_pointer(bias), shape, num_panels, target);
  });
  return out;
}

// x [M, K], panels [2 Q, ., 16] in pairs (gate, up) -> Act(gate, up) [M, intermediate] in x's dtype,
// intermediate in (16 (Q - 1), 16 Q].
template <typename Act>
at::Tensor panel_linear_gated(const char* op, const at::Tensor& x, const at::Tensor& panels,
                              const std::optional<at::Tensor>& bias, int64_t intermediate) {
  const TileInputs inputs = tile_inputs(op, x, panels, bias);
  const int64_t num_pairs = panels.size(0) / 2;
  TORCH_CHECK(panels.size(0) % 2 == 0 && intermediate > kPanelColumns * (num_pairs - 1) &&
                  intermediate <= kPanelColumns * num_pairs,
              op, ": ", intermediate, " features do not fill ", panels.size(0), " panels in pairs");
  at::Tensor out = at::empty({x.size(0), intermediate}, x.options());
  if (x.size(0) == 0) return out;
  const LinearShape shape{x.size(0), panels.size(1), intermediate};
  dispatch_product(inputs, panels, out, [&]<bool kTiled>(const float* rows, auto words, auto* target) {
    gated_pairs<Act, kTiled>(rows, words, bias_pointer(bias), shape, num_pairs, target);
  });
  return out;
}

at::Tensor panel_linear_silu_mul(const at::Tensor& x, const at::Tensor& panels, const std::optional<at::Tensor>& bias,
                                 int64_t intermediate) {
  return panel_linear_gated<SiluMul>("panel_linear_silu_mul", x, panels, bias, intermediate);
}

at::Tensor panel_linear_gelu_tanh_mul(const at::Tensor& x, const at::Tensor& panels,
                                      const std::optional<at::Tensor>& bias, int64_t intermediate) {
  return panel_linear_gated<GeluTanhMul>("panel_linear_gelu_tanh_mul", x, panels, bias, intermediate);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(splitserve_cpu, m) {
  m.def("panel_linear(Tensor x, Tensor panels, Tensor? bias, int out_features) -> Tensor");
  m.def("panel_linear_silu_mul(Tensor x, Tensor panels, Tensor? bias, int intermediate) -> Tensor");
  m.def("panel_linear_gelu_tanh_mul(Tensor x, Tensor panels, Tensor? bias, int intermediate) -> Tensor");
}

TORCH_LIBRARY_IMPL(splitserve_cpu, CPU, m) {
  m.impl("panel_linear", &panel_linear);
  m.impl("panel_linear_silu_mul", &panel_linear_silu_mul);
  m.impl("panel_linear_gelu_tanh_mul", &panel_linear_gelu_tanh_mul);
}
