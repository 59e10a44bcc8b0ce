// 16-float AVX-512 helpers shared by the CPU kernels: loads that widen bf16 to fp32 and stores that
// round fp32 to the tensor's dtype (round to nearest even, as torch does), so float32 math over
// bf16 tensors rounds exactly where torch's bf16 ops round. Loads of a quantized KV cache's codes
// (int8, fp8 e4m3) widen them exactly to float32; the row's scale is applied by the caller.
#pragma once

#if !defined(__AVX512F__)
#error "the splitserve CPU kernels need AVX-512 (the pure-torch path runs elsewhere)"
#endif

#include <immintrin.h>

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>
#include <limits>

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }

inline __m512 load16(const c10::BFloat16* p) {  // a bf16 is the high half of an fp32
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }

inline void store16(c10::BFloat16* p, __m512 v) {  // round to nearest even; NaN stays NaN (0x7fc0)
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  rounded = _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(rounded));
}

// v rounded to T and widened back: what a torch op producing a T tensor leaves.
template <typename T>
inline __m512 round16(__m512 v) {
  alignas(64) T staged[16];
  store16(staged, v);
  return load16(staged);
}

template <>
inline __m512 round16<float>(__m512 v) { return v; }

// The scalar counterpart for tails shorter than 16.
template <typename T>
inline float round1(float v) { return static_cast<float>(static_cast<T>(v)); }

// One fp8 e4m3 code as torch's float8_e4m3fn stores it: sign, 4 exponent bits (bias 7), 3 mantissa bits;
// no infinities; 0x7f and 0xff are NaN. A distinct type so that loads and conversions dispatch on it.
struct Fp8E4M3 {
  uint8_t bits;
};

// Exact widening of 16 fp8 e4m3 codes (the low 16 bytes of `bytes`) to float32.
inline __m512 widen_fp8_e4m3(__m128i bytes) {
  const __m512i codes = _mm512_cvtepu8_epi32(bytes);
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
  return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(value), sign));
}

// The scalar counterpart of widen_fp8_e4m3 (same cases, same results).
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

inline __m512 load16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

inline __m512 load16(const Fp8E4M3* p) { return widen_fp8_e4m3(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

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
