// A 16-float vector for the CPU kernels, one source for two instruction sets: Vec16 is one __m512 when
// built with -DCPU_CAPABILITY_AVX512 (each operation is the one AVX-512 intrinsic the kernels called
// before this header existed) and a pair of __m256 (lanes 0..7, 8..15) with -DCPU_CAPABILITY_AVX2
// (AVX2 + FMA). engine/cpu_kernels.py picks the pair from the CPU, and the same macro selects ATen's
// Vectorized<float>, whose exp is the one torch's own ops run on this CPU.
//
// Loads widen bf16 to fp32 and stores round fp32 to the tensor's dtype (round to nearest even, as torch
// does), so float32 math over bf16 tensors rounds exactly where torch's bf16 ops round. Loads of a
// quantized KV cache's codes (int8, fp8 e4m3) widen them exactly to float32; the row's scale is applied
// by the caller. Every operation is lane by lane and bitwise the same on both instruction sets, except
// the horizontal sums (reduce_add, store_sums8), which add in a fixed tree that is the same on both too.
#pragma once

#include <immintrin.h>

#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#if defined(CPU_CAPABILITY_AVX512)
#if !defined(__AVX512F__) || !defined(__AVX512BW__) || !defined(__AVX512VL__) || !defined(__AVX512DQ__)
#error "CPU_CAPABILITY_AVX512 needs -mavx512f -mavx512bw -mavx512vl -mavx512dq (engine/cpu_kernels.py passes them)"
#endif
#elif defined(CPU_CAPABILITY_AVX2)
#if !defined(__AVX2__) || !defined(__FMA__)
#error "CPU_CAPABILITY_AVX2 needs -mavx2 -mfma (engine/cpu_kernels.py passes them)"
#endif
#else
#error "build with -DCPU_CAPABILITY=AVX512 -DCPU_CAPABILITY_AVX512 or -DCPU_CAPABILITY=AVX2 -DCPU_CAPABILITY_AVX2"
#endif

// One fp8 e4m3 code as torch's float8_e4m3fn stores it: sign, 4 exponent bits (bias 7), 3 mantissa bits;
// no infinities; 0x7f and 0xff are NaN. A distinct type so that loads and conversions dispatch on it.
struct Fp8E4M3 {
  uint8_t bits;
};

#if defined(CPU_CAPABILITY_AVX512)

// Vec16 registers that fit the register file (32 zmm): how many accumulators a micro-kernel can hold.
constexpr int kVec16Registers = 32;

struct Vec16 {
  __m512 v;
};

// 16 32-bit words (a packed operand of the prefill kernel: a float, or a pair of bf16, per word).
struct Words16 {
  __m512i v;
};

inline Vec16 zero16() { return {_mm512_setzero_ps()}; }
inline Vec16 set16(float x) { return {_mm512_set1_ps(x)}; }
inline Vec16 operator+(Vec16 a, Vec16 b) { return {_mm512_add_ps(a.v, b.v)}; }
inline Vec16 operator-(Vec16 a, Vec16 b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline Vec16 operator*(Vec16 a, Vec16 b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline Vec16 operator/(Vec16 a, Vec16 b) { return {_mm512_div_ps(a.v, b.v)}; }
inline Vec16 fma16(Vec16 a, Vec16 b, Vec16 c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }  // a * b + c, one rounding
inline Vec16 max16(Vec16 a, Vec16 b) { return {_mm512_max_ps(a.v, b.v)}; }
inline float reduce_add(Vec16 a) { return _mm512_reduce_add_ps(a.v); }
inline float reduce_max(Vec16 a) { return _mm512_reduce_max_ps(a.v); }

// e^a by ATen's Vectorized<float>::exp (what torch's exp, softmax and silu compute on this CPU).
inline Vec16 exp16(Vec16 a) { return {static_cast<__m512>(at::vec::Vectorized<float>(a.v).exp())}; }
// tanh(a) by ATen's Vectorized<float>::tanh (Sleef's, what torch's vectorized gelu(approximate="tanh") runs).
inline Vec16 tanh16(Vec16 a) { return {static_cast<__m512>(at::vec::Vectorized<float>(a.v).tanh())}; }

inline Vec16 load16(const float* p) { return {_mm512_loadu_ps(p)}; }
inline void store16(float* p, Vec16 a) { _mm512_storeu_ps(p, a.v); }

inline Vec16 load16(const c10::BFloat16* p) {  // a bf16 is the high half of an fp32
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return {_mm512_castsi512_ps(_mm512_slli_epi32(wide, 16))};
}

inline void store16(c10::BFloat16* p, Vec16 a) {  // round to nearest even; NaN stays NaN (0x7fc0)
  const __m512i bits = _mm512_castps_si512(a.v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  rounded = _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(a.v, a.v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(rounded));
}

inline Vec16 load16(const int8_t* p) {
  return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))))};
}

// Exact widening of 16 fp8 e4m3 codes to float32.
inline Vec16 load16(const Fp8E4M3* p) {
  const __m512i codes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m512i magnitude = _mm512_and_si512(codes, _mm512_set1_epi32(0x7f));
  const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(codes, _mm512_set1_epi32(0x80)), 24);
  // Normal (exponent bits e > 0): float exponent e - 7 + 127, the 3 mantissa bits at float bits 20..22.
  const __m512i normal = _mm512_add_epi32(_mm512_slli_epi32(magnitude, 20), _mm512_set1_epi32(120 << 23));
  // Subnormal (e = 0): mantissa * 2^-9, exact in float32.
  const __m512 subnormal = _mm512_mul_ps(_mm512_cvtepi32_ps(magnitude), _mm512_set1_ps(1.f / 512.f));
  __m512 value = _mm512_mask_mov_ps(_mm512_castsi512_ps(normal),
                                    _mm512_cmplt_epi32_mask(magnitude, _mm512_set1_epi32(8)), subnormal);
  value = _mm512_mask_mov_ps(value, _mm512_cmpeq_epi32_mask(magnitude, _mm512_set1_epi32(0x7f)),
                             _mm512_set1_ps(std::numeric_limits<float>::quiet_NaN()));
  return {_mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(value), sign))};
}

// out[0..8) = the sums of v[0..8), about 2 instructions per sum where a reduce_add per vector costs 7.
[[gnu::always_inline]] inline void store_sums8(const Vec16* v, float* out) {
  __m256 half[8];
  for (int i = 0; i < 8; ++i)
    half[i] = _mm256_add_ps(_mm512_castps512_ps256(v[i].v), _mm512_extractf32x8_ps(v[i].v, 1));
  const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(half[0], half[1]), _mm256_hadd_ps(half[2], half[3]));
  const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(half[4], half[5]), _mm256_hadd_ps(half[6], half[7]));
  _mm256_storeu_ps(out, _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31)));
}

// Lane i keeps a when first + i lies in [lo, hi], else it is `otherwise`.
inline Vec16 keep_in_range(Vec16 a, int32_t first, int32_t lo, int32_t hi, Vec16 otherwise) {
  const __m512i index = _mm512_add_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                         _mm512_set1_epi32(first));
  const __mmask16 inside = _mm512_cmple_epi32_mask(index, _mm512_set1_epi32(hi)) &
                           _mm512_cmpge_epi32_mask(index, _mm512_set1_epi32(lo));
  return {_mm512_mask_mov_ps(otherwise.v, inside, a.v)};
}

inline Words16 load_words(const uint32_t* p) { return {_mm512_loadu_si512(p)}; }
inline Words16 broadcast_word(uint32_t w) { return {_mm512_set1_epi32(static_cast<int>(w))}; }
inline Vec16 as_floats(Words16 w) { return {_mm512_castsi512_ps(w.v)}; }

// Each word as the float of its high bf16 / of its low bf16 (exact: a bf16 is the high half of a float).
inline Vec16 high_bf16(Words16 w) {
  return {_mm512_castsi512_ps(_mm512_and_si512(w.v, _mm512_set1_epi32(static_cast<int>(0xffff0000u))))};
}
inline Vec16 low_bf16(Words16 w) { return {_mm512_castsi512_ps(_mm512_slli_epi32(w.v, 16))}; }

#else  // CPU_CAPABILITY_AVX2: a pair of 8-float halves, each operation applied to both

constexpr int kVec16Registers = 8;  // 16 ymm

struct Vec16 {
  __m256 lo, hi;  // lanes 0..7, 8..15
};

struct Words16 {
  __m256i lo, hi;
};

inline Vec16 zero16() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline Vec16 set16(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline Vec16 operator+(Vec16 a, Vec16 b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline Vec16 operator-(Vec16 a, Vec16 b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline Vec16 operator*(Vec16 a, Vec16 b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline Vec16 operator/(Vec16 a, Vec16 b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
inline Vec16 fma16(Vec16 a, Vec16 b, Vec16 c) {  // a * b + c, one rounding
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
inline Vec16 max16(Vec16 a, Vec16 b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }

// The tree of _mm512_reduce_add_ps / _mm512_reduce_max_ps: halves, then 128-bit halves, then pairs.
template <typename Op>
inline float reduce(Vec16 a, Op op) {
  const __m256 eight = op(a.hi, a.lo);
  const __m128 four = op(_mm256_extractf128_ps(eight, 1), _mm256_castps256_ps128(eight));
  const __m128 two = op(four, _mm_shuffle_ps(four, four, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtss_f32(op(two, _mm_shuffle_ps(two, two, _MM_SHUFFLE(0, 0, 0, 1))));
}

inline float reduce_add(Vec16 a) {
  return reduce(a, [](auto x, auto y) {
    if constexpr (sizeof(x) == 32) return _mm256_add_ps(x, y); else return _mm_add_ps(x, y);
  });
}

inline float reduce_max(Vec16 a) {
  return reduce(a, [](auto x, auto y) {
    if constexpr (sizeof(x) == 32) return _mm256_max_ps(x, y); else return _mm_max_ps(x, y);
  });
}

// e^a by ATen's Vectorized<float>::exp (what torch's exp, softmax and silu compute on this CPU).
inline Vec16 exp16(Vec16 a) {
  using Vec = at::vec::Vectorized<float>;
  return {static_cast<__m256>(Vec(a.lo).exp()), static_cast<__m256>(Vec(a.hi).exp())};
}

// tanh(a) by ATen's Vectorized<float>::tanh (Sleef's, what torch's vectorized gelu(approximate="tanh") runs).
inline Vec16 tanh16(Vec16 a) {
  using Vec = at::vec::Vectorized<float>;
  return {static_cast<__m256>(Vec(a.lo).tanh()), static_cast<__m256>(Vec(a.hi).tanh())};
}

inline Vec16 load16(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline void store16(float* p, Vec16 a) {
  _mm256_storeu_ps(p, a.lo);
  _mm256_storeu_ps(p + 8, a.hi);
}

inline __m256 widen_bf16x8(const c10::BFloat16* p) {  // a bf16 is the high half of an fp32
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

inline Vec16 load16(const c10::BFloat16* p) { return {widen_bf16x8(p), widen_bf16x8(p + 8)}; }

// 8 floats' bf16 bit patterns in the low halves of 32-bit lanes: round to nearest even; NaN -> 0x7fc0.
inline __m256i round_bf16x8(__m256 a) {
  const __m256i bits = _mm256_castps_si256(a);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded =
      _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(a, a, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7fc0), nan);
}

inline void store16(c10::BFloat16* p, Vec16 a) {
  // packus works per 128-bit lane: [lo 0-3, hi 0-3, lo 4-7, hi 4-7]; the permute puts the quarters in order.
  const __m256i packed = _mm256_packus_epi32(round_bf16x8(a.lo), round_bf16x8(a.hi));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm256_permute4x64_epi64(packed, _MM_SHUFFLE(3, 1, 2, 0)));
}

inline Vec16 load16(const int8_t* p) {
  const auto widen = [](const int8_t* q) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q))));
  };
  return {widen(p), widen(p + 8)};
}

// Exact widening of 8 fp8 e4m3 codes to float32 (the cases of the AVX-512 load16 above).
inline __m256 widen_fp8_e4m3x8(const Fp8E4M3* p) {
  const __m256i codes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m256i magnitude = _mm256_and_si256(codes, _mm256_set1_epi32(0x7f));
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(codes, _mm256_set1_epi32(0x80)), 24);
  const __m256i normal = _mm256_add_epi32(_mm256_slli_epi32(magnitude, 20), _mm256_set1_epi32(120 << 23));
  const __m256 subnormal = _mm256_mul_ps(_mm256_cvtepi32_ps(magnitude), _mm256_set1_ps(1.f / 512.f));
  const __m256i is_subnormal = _mm256_cmpgt_epi32(_mm256_set1_epi32(8), magnitude);
  const __m256i is_nan = _mm256_cmpeq_epi32(magnitude, _mm256_set1_epi32(0x7f));
  __m256 value = _mm256_blendv_ps(_mm256_castsi256_ps(normal), subnormal, _mm256_castsi256_ps(is_subnormal));
  value = _mm256_blendv_ps(value, _mm256_set1_ps(std::numeric_limits<float>::quiet_NaN()), _mm256_castsi256_ps(is_nan));
  return _mm256_castsi256_ps(_mm256_or_si256(_mm256_castps_si256(value), sign));
}

inline Vec16 load16(const Fp8E4M3* p) { return {widen_fp8_e4m3x8(p), widen_fp8_e4m3x8(p + 8)}; }

// out[0..8) = the sums of v[0..8) (the AVX-512 tree: halves first, then pairwise).
[[gnu::always_inline]] inline void store_sums8(const Vec16* v, float* out) {
  __m256 half[8];
  for (int i = 0; i < 8; ++i) half[i] = _mm256_add_ps(v[i].lo, v[i].hi);
  const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(half[0], half[1]), _mm256_hadd_ps(half[2], half[3]));
  const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(half[4], half[5]), _mm256_hadd_ps(half[6], half[7]));
  _mm256_storeu_ps(out, _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31)));
}

// Lane i keeps a when first + i lies in [lo, hi], else it is `otherwise`.
inline Vec16 keep_in_range(Vec16 a, int32_t first, int32_t lo, int32_t hi, Vec16 otherwise) {
  const auto half = [&](__m256 x, __m256 fill, int32_t base) {
    const __m256i index = _mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(base));
    const __m256i outside = _mm256_or_si256(_mm256_cmpgt_epi32(index, _mm256_set1_epi32(hi)),
                                            _mm256_cmpgt_epi32(_mm256_set1_epi32(lo), index));
    return _mm256_blendv_ps(x, fill, _mm256_castsi256_ps(outside));
  };
  return {half(a.lo, otherwise.lo, first), half(a.hi, otherwise.hi, first + 8)};
}

inline Words16 load_words(const uint32_t* p) {
  return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)),
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 8))};
}
inline Words16 broadcast_word(uint32_t w) {
  const __m256i all = _mm256_set1_epi32(static_cast<int>(w));
  return {all, all};
}
inline Vec16 as_floats(Words16 w) { return {_mm256_castsi256_ps(w.lo), _mm256_castsi256_ps(w.hi)}; }

inline Vec16 high_bf16(Words16 w) {
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
  return {_mm256_castsi256_ps(_mm256_and_si256(w.lo, high)), _mm256_castsi256_ps(_mm256_and_si256(w.hi, high))};
}
inline Vec16 low_bf16(Words16 w) {
  return {_mm256_castsi256_ps(_mm256_slli_epi32(w.lo, 16)), _mm256_castsi256_ps(_mm256_slli_epi32(w.hi, 16))};
}

#endif

// acc + a.high * b.high + a.low * b.low per 32-bit word of bf16 pairs, in that order, summed in float32.
// With AVX512_BF16 it is one vdpbf16ps. Without, two FMAs on the widened halves compute the same: the
// product of two bf16 is exact in float32 (8 + 8 significant bits), so each FMA rounds once, as each of
// the instruction's two accumulations does, in the order Intel's pseudo-code gives (high pair first).
// The one difference: the instruction treats denormal inputs as zero and flushes denormal results to
// zero, the FMAs keep them; |values| < 2^-126 are far below the tests' bf16 tolerance (2e-2).
inline Vec16 dot_bf16_pairs(Vec16 acc, Words16 a, Words16 b) {
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
  return {_mm512_dpbf16_ps(acc.v, reinterpret_cast<__m512bh>(a.v), reinterpret_cast<__m512bh>(b.v))};
#else
  return fma16(low_bf16(a), low_bf16(b), fma16(high_bf16(a), high_bf16(b), acc));
#endif
}

// v rounded to T and widened back: what a torch op producing a T tensor leaves.
template <typename T>
inline Vec16 round16(Vec16 v) {
  alignas(64) T staged[16];
  store16(staged, v);
  return load16(staged);
}

template <>
inline Vec16 round16<float>(Vec16 v) { return v; }

// The scalar counterpart for tails shorter than 16.
template <typename T>
inline float round1(float v) { return static_cast<float>(static_cast<T>(v)); }

// cap * tanh(score / cap) for scaled scores: Gemma 2's attn_logit_softcapping, in float32 as transformers'
// eager attention computes it in a float32 model (in the same order: divide, tanh, multiply).
inline Vec16 cap_scores16(Vec16 score, Vec16 cap) { return tanh16(score / cap) * cap; }

// silu(gate) * up rounded where torch's F.silu(gate) * up rounds (the silu to T), for gate and up already
// values of T; the caller's store rounds the product. The scalar form for tails (std::exp, as torch's).
template <typename T>
inline Vec16 silu_mul16(Vec16 gate, Vec16 up) {
  return round16<T>(gate / (set16(1.f) + exp16(zero16() - gate))) * up;
}

template <typename T>
inline float silu_mul1(float gate, float up) { return round1<T>(gate / (1.f + std::exp(-gate))) * up; }

// gelu(gate, approximate="tanh") * up as torch's CPU kernel computes it (GeluKernelImpl, in float32 for both
// float32 and bf16: 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))), x^3 as (x x) x, x + 0.044715 x^3 one
// fused multiply-add as torch's build contracts it (found by comparing results: rounding the product on its
// own differed in the last bit), the other products and sums rounded on their own), the gelu rounded to T
// before the product like F.gelu(gate) * up; gate and up already values of T, the caller's store rounds the
// product. Torch runs its vector form (Sleef's tanh) over each contiguous row's first gelu_vector_columns<T>(n)
// elements and its scalar form (std::tanh) over the rest: callers pick the form per column the same way, and
// then agree with it bit for bit. (Where torch's threads split a large tensor inside a row of a width that is
// not a whole number of vector steps, its boundary moves for that one row.)
constexpr float kGeluBeta = static_cast<float>(M_SQRT2 * M_2_SQRTPI * 0.5);  // sqrt(2 / pi)
constexpr float kGeluKappa = static_cast<float>(0.044715);  // torch's float(0.044715) from the double

template <typename T>
inline Vec16 gelu_tanh_mul16(Vec16 gate, Vec16 up) {
  const Vec16 inner = set16(kGeluBeta) * fma16(set16(kGeluKappa), gate * gate * gate, gate);
  return round16<T>(set16(0.5f) * gate * (set16(1.f) + tanh16(inner))) * up;
}

template <typename T>
inline float gelu_tanh_mul1(float gate, float up) {
  const float inner = kGeluBeta * std::fma(kGeluKappa, gate * gate * gate, gate);
  return round1<T>(0.5f * gate * (1.f + std::tanh(inner))) * up;
}

// Elements of a contiguous row of n that torch's elementwise loop (ATen's vectorized_loop) runs in its vector
// form: whole steps of two Vectorized<T>, the rest one by one (16 / 32 floats, 32 / 64 bf16 on AVX2 / AVX-512).
template <typename T>
constexpr int64_t gelu_vector_columns(int64_t n) {
  constexpr int64_t step = 2 * at::vec::Vectorized<T>::size();
  return n / step * step;
}

// The scalar counterpart of load16(const Fp8E4M3*) (same cases, same results).
inline float fp8_e4m3_to_float(uint8_t code) {
  const uint32_t magnitude = code & 0x7fu, sign = static_cast<uint32_t>(code & 0x80u) << 24;
  if (magnitude == 0x7fu) return std::numeric_limits<float>::quiet_NaN();
  float value;
  if (magnitude < 8) {
    value = static_cast<float>(magnitude) * (1.f / 512.f);
  } else {
    const uint32_t bits = (magnitude << 20) + (120u << 23);
    std::memcpy(&value, &bits, sizeof value);
  }
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  bits |= sign;
  std::memcpy(&value, &bits, sizeof value);
  return value;
}

// One element widened to float32 (the scalar tails of the vector loops).
inline float to_float(float v) { return v; }
inline float to_float(c10::BFloat16 v) { return static_cast<float>(v); }
inline float to_float(int8_t v) { return static_cast<float>(v); }
inline float to_float(Fp8E4M3 v) { return fp8_e4m3_to_float(v.bits); }

// How a KV pool of element type E stores a (token, KV head) row: plain E values (kQuantized false), or
// head_dim codes followed by the row's bfloat16 scale (engine/kv_quant.py), for int8 and fp8 e4m3 codes.
template <typename E>
struct KVRow {
  static constexpr bool kQuantized = false;
  static constexpr int64_t kScaleElements = 0;
  static float scale(const E*, int64_t) { return 1.f; }
};

template <typename E>
struct QuantizedKVRow {
  static constexpr bool kQuantized = true;
  static constexpr int64_t kScaleElements = 2;  // a bfloat16's two bytes after the head_dim one-byte codes
  static float scale(const E* row, int64_t head_dim) {
    uint16_t bits;
    std::memcpy(&bits, reinterpret_cast<const uint8_t*>(row + head_dim), sizeof bits);
    const uint32_t wide = static_cast<uint32_t>(bits) << 16;
    float value;
    std::memcpy(&value, &wide, sizeof value);
    return value;
  }
};

template <>
struct KVRow<int8_t> : QuantizedKVRow<int8_t> {};
template <>
struct KVRow<Fp8E4M3> : QuantizedKVRow<Fp8E4M3> {};
