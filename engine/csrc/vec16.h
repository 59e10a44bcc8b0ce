// 16-float AVX-512 helpers shared by the CPU kernels: loads that widen bf16 to fp32 and stores that
// round fp32 to the tensor's dtype (round to nearest even, as torch does), so float32 math over
// bf16 tensors rounds exactly where torch's bf16 ops round.
#pragma once

#if !defined(__AVX512F__)
#error "the splitserve CPU kernels need AVX-512 (the pure-torch path runs elsewhere)"
#endif

#include <immintrin.h>

#include <c10/util/BFloat16.h>

#include <cstdint>

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
