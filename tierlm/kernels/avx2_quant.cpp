// tierlm's AVX2 matrix products for weight-only int4 and int8, for CPUs where torch has no fast path
// (no AVX-512, no AMX); built with AVX-512 flags, the int8 product gets a 512-bit loop of its own
// (int8_tile), faster than aten's int8 there too. Activations are quantized to int16 in blocks of 32 (a
// float scale per block, round to nearest: an error of at most 1/65534 of the block's largest |x|, below a
// bf16 activation's own rounding), and the products run as 16-bit integer dot products (vpmaddwd), which
// need far fewer instructions per weight than widening every weight to float. (llama.cpp quantizes
// activations to int8 on these CPUs, which measured here +0.6% perplexity on the default model; int16 keeps
// aten's.)
// tests/test_kernels.py checks the result against the exact product.
// The file also holds a decode step's attention over a K/V cache (decode_attention, below the products), and
// that attention with the step's rotary and static-cache write in one call (decode_rope_attention), and a
// one-row bf16 product (bf16_mv: AVX-512 BF16's dot products where built with them, else AVX2's FMA).
//
// int4: the weight layout and the scales are torch's own on an AVX2 CPU (aten._convert_weight_to_int4pack_for_cpu
// and _weight_int4pack_mm_for_cpu): in each block of 32 rows, byte (k, j) holds column k of row j in its low
// nibble and of row 16 + j in its high one; scales_and_zeros is [K/g, N, 2] and w = (q - 8) * s + z. The
// AVX-512 build also reads torch's AVX-512 layout, blocks of 64 rows with row 32 + j in the high nibble
// (int4_rows64; int4_mm's `block`).
// int8: the weight is int8 [N, K] row-major with a scale per row (aten._weight_int8pack_mm's inputs).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/add.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/gelu.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/remainder.h>
#include <ATen/ops/silu.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <vector>

namespace {

constexpr int64_t QB = 32;  // activations are quantized in blocks of 32 columns
constexpr float QMAX = 32767.f;
#ifndef PREFETCH
#define PREFETCH 8192  // bytes ahead of the weight stream (one core reaches half the read bandwidth without)
#endif

inline __m256 load_bf16x8(const c10::BFloat16* p) {  // 8 bf16 -> 8 float
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) { return load_bf16x8(p); }

// x [M, K] (float or bf16) -> xq [M, K] int16, d [M, K/32] (scale) and xs [M, K/32] (block sums of d * xq)
template <typename X>
void quantize_rows(const X* x, int64_t m, int64_t k, int16_t* xq, float* d, float* xs) {
  const int64_t nb = k / QB;
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t b = 0; b < nb; ++b) {
      const X* v = x + r * k + b * QB;
      __m256 t[4], amax = _mm256_setzero_ps();
      for (int i = 0; i < 4; ++i) {
        t[i] = load8(v + 8 * i);
        amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, t[i]));
      }
      float a[8];
      _mm256_storeu_ps(a, amax);
      float mx = 0.f;
      for (int i = 0; i < 8; ++i) mx = a[i] > mx ? a[i] : mx;
      float scale = mx / QMAX;
      if (scale < std::numeric_limits<float>::min()) scale = 0.f;  // x too tiny to scale: zeros
      const float inv = (scale > 0.f && std::isfinite(scale)) ? 1.f / scale : 0.f;
      // x / scale rounded to nearest even and clamped to +-QMAX, a NaN to 0 (and noted), 8 lanes at a time
      const __m256 vinv = _mm256_set1_ps(inv), lo = _mm256_set1_ps(-QMAX), hi = _mm256_set1_ps(QMAX);
      __m256i c[4], sum = _mm256_setzero_si256();
      int nans = 0;
      for (int i = 0; i < 4; ++i) {
        const __m256 f = _mm256_mul_ps(t[i], vinv);
        const __m256 ordered = _mm256_cmp_ps(f, f, _CMP_ORD_Q);  // all ones where f is not NaN
        nans |= ~_mm256_movemask_ps(ordered) & 0xFF;
        const __m256 rounded = _mm256_round_ps(_mm256_and_ps(f, ordered), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        c[i] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(rounded, lo), hi));
        sum = _mm256_add_epi32(sum, c[i]);
      }
      int16_t* q = xq + r * k + b * QB;  // packs_epi32 interleaves 128-bit lanes: permute them back in order
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), _mm256_permute4x64_epi64(_mm256_packs_epi32(c[0], c[1]), 0xD8));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 16), _mm256_permute4x64_epi64(_mm256_packs_epi32(c[2], c[3]), 0xD8));
      __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
      s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
      s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
      const int64_t qsum = _mm_cvtsi128_si32(s4);
      const bool finite = std::isfinite(mx) && nans == 0;
      // a NaN or infinity in the block makes its scale NaN, so every output it reaches is NaN, as with aten
      if (!finite) scale = std::numeric_limits<float>::quiet_NaN();
      d[r * nb + b] = scale;
      // the block's sum as the quantized values give it, so that the zero points multiply the same x as
      // the codes do (q being 0..15, the exact sum would leave their share of the rounding unbalanced)
      xs[r * nb + b] = scale * static_cast<float>(qsum);
    }
  }
}

// scale and zero of 8 consecutive rows from an interleaved (scale, zero) row of [.., N, 2]
template <typename T>
inline void load_scale_zero(const T* sz, __m256& s, __m256& z);

template <>
inline void load_scale_zero<float>(const float* sz, __m256& s, __m256& z) {
  __m256 a = _mm256_loadu_ps(sz), b = _mm256_loadu_ps(sz + 8);  // s0 z0 s1 z1 ... s7 z7
  __m256 ss = _mm256_shuffle_ps(a, b, 0x88), zz = _mm256_shuffle_ps(a, b, 0xDD);  // s0 s1 s4 s5 s2 s3 s6 s7
  s = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(ss), 0xD8));
  z = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(zz), 0xD8));
}

template <>
inline void load_scale_zero<c10::BFloat16>(const c10::BFloat16* sz, __m256& s, __m256& z) {
  __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sz));  // per int32: scale low, zero high
  s = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
  z = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// Rows 8i..8i+7 of a block's exact int32 sums, from the accumulators of its even rows (a) and odd rows (b):
// a holds rows 2j (j = 0..3) of two column sets in its two lanes, b rows 2j + 1; the lanes are summed
inline __m256i rows_of(__m256i a, __m256i b) {
  const __m256i p = _mm256_unpacklo_epi32(a, b), q = _mm256_unpackhi_epi32(a, b);  // per lane: rows 0-3 | 4-7
  return _mm256_add_epi32(_mm256_permute2x128_si256(p, q, 0x20), _mm256_permute2x128_si256(p, q, 0x31));
}

// One block of 32 rows for one activation row (a decode step): out[0..31] = sum_k w[row, k] * x[k].
// Four columns a step, with one shuffle of the weights: interleaving the 16-bit words of columns c, c+1 with
// those of c+2, c+3 pairs each word's nibbles with the same rows of the column two along (lanes: columns
// (c, c+2) | (c+1, c+3)). A word of column c holds rows 2j, 16+2j, 2j+1, 17+2j in its four nibbles, so shifts
// and masks widen them in place to int16 pairs for vpmaddwd, no byte unpacking (int4_tile32 needs four
// unpacks and two shuffles per two columns: its shuffle ports bound it). The int32 sums of each block are
// exact, so the results are int4_tile32's bit for bit.
template <typename T>
void int4_rows32(const uint8_t* w, const T* sz, int64_t n, int64_t k, int64_t g, const int16_t* xq,
                 const float* d, const float* xs, float* out) {
  const __m256i nibble = _mm256_set1_epi16(0x000F);
  // (x[c], x[c+2]) in each int32 of the low lane, (x[c+1], x[c+3]) in the high one, from x[c..c+3]
  const __m256i spread = _mm256_setr_epi8(0, 1, 4, 5, 0, 1, 4, 5, 0, 1, 4, 5, 0, 1, 4, 5,
                                          2, 3, 6, 7, 2, 3, 6, 7, 2, 3, 6, 7, 2, 3, 6, 7);
  __m256 acc[4];
  for (int i = 0; i < 4; ++i) acc[i] = _mm256_setzero_ps();
  const int64_t nb = k / QB, blocks_per_group = g / QB;
  const T* szg = sz;  // the scales and zeros of the block's group
  for (int64_t b = 0, in_group = 0; b < nb; ++b) {
    // e[half][nibble]: rows 8 * half + 2j (nibble 0), 16 + 8 * half + 2j (1), 8 * half + 2j + 1 (2),
    // 17 + 8 * half + 2j (3), j = 0..3; each int32 lane sums at most 16 products of 15 * 32767 (< 2^23)
    __m256i e[2][4];
    for (int h = 0; h < 2; ++h)
      for (int i = 0; i < 4; ++i) e[h][i] = _mm256_setzero_si256();
    const int64_t k0 = b * QB;
    for (int line = 0; line < 8; ++line)  // the block's 32 columns are 8 cache lines: fetch PREFETCH ahead
      _mm_prefetch(reinterpret_cast<const char*>(w + k0 * 16 + PREFETCH + 64 * line), _MM_HINT_T0);
    // words 0-3 of each column (h = 0), then words 4-7 (h = 1): two passes over the block's 512 bytes (the
    // second from L1), so that the four accumulators of a pass and its temporaries fit the 16 registers
    for (int h = 0; h < 2; ++h) {
      for (int64_t c = k0; c < k0 + QB; c += 4) {
        const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + c * 16));  // c | c+1
        const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + c * 16 + 32));  // c+2 | c+3
        int64_t four;
        std::memcpy(&four, xq + c, 8);
        const __m256i xp = _mm256_shuffle_epi8(_mm256_set1_epi64x(four), spread);
        const __m256i t = h == 0 ? _mm256_unpacklo_epi16(v0, v1) : _mm256_unpackhi_epi16(v0, v1);
        e[h][0] = _mm256_add_epi32(e[h][0], _mm256_madd_epi16(_mm256_and_si256(t, nibble), xp));
        e[h][1] = _mm256_add_epi32(e[h][1], _mm256_madd_epi16(_mm256_and_si256(_mm256_srli_epi16(t, 4), nibble), xp));
        e[h][2] = _mm256_add_epi32(e[h][2], _mm256_madd_epi16(_mm256_and_si256(_mm256_srli_epi16(t, 8), nibble), xp));
        e[h][3] = _mm256_add_epi32(e[h][3], _mm256_madd_epi16(_mm256_srli_epi16(t, 12), xp));
      }
    }
    // rows 0-7, 8-15, 16-23, 24-31
    const __m256i rows[4] = {rows_of(e[0][0], e[0][2]), rows_of(e[1][0], e[1][2]), rows_of(e[0][1], e[0][3]),
                             rows_of(e[1][1], e[1][3])};
    const __m256 db = _mm256_set1_ps(d[b]), xsb = _mm256_set1_ps(xs[b]), eight = _mm256_set1_ps(8.f);
    for (int i = 0; i < 4; ++i) {
      __m256 s, z;
      load_scale_zero<T>(szg + i * 16, s, z);
      // sum (q - 8) s x + z x = s * d * sum(q xq) + (z - 8 s) * sum(x)
      acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(rows[i]), _mm256_mul_ps(s, db), acc[i]);
      acc[i] = _mm256_fmadd_ps(_mm256_fnmadd_ps(eight, s, z), xsb, acc[i]);
    }
    if (++in_group == blocks_per_group) {
      in_group = 0;
      szg += n * 2;
    }
  }
  for (int i = 0; i < 4; ++i) _mm256_storeu_ps(out + 8 * i, acc[i]);
}

// R activation rows (2) times one block of 32 rows of torch's AVX2 packing: each weight byte unpacked once
// for all R rows. Each row's block sums are int4_rows32's exact int32s and its two fmas the same, so a row's
// result does not depend on the rows beside it. out[r * 32 + i]; xq, d, xs of row r at r * k, r * nb, r * nb.
template <typename T, int R>
void int4_tile32(const uint8_t* w, const T* sz, int64_t n, int64_t k, int64_t g, const int16_t* xq,
                 const float* d, const float* xs, float* out) {
  const __m256i low = _mm256_set1_epi8(0x0F), zero = _mm256_setzero_si256();
  const __m256i pairs = _mm256_setr_epi8(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15,
                                         0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15);
  const int64_t nb = k / QB;
  for (int i = 0; i < R * 32; i += 8) _mm256_storeu_ps(out + i, _mm256_setzero_ps());
  for (int64_t b = 0; b < nb; ++b) {
    __m256i a[R][4];
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < 4; ++i) a[r][i] = _mm256_setzero_si256();
    const int64_t k0 = b * QB;
    for (int line = 0; line < 8; ++line)
      _mm_prefetch(reinterpret_cast<const char*>(w + k0 * 16 + PREFETCH + 64 * line), _MM_HINT_T0);
    for (int64_t c = k0; c < k0 + QB; c += 2) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + c * 16));
      const __m256i t = _mm256_shuffle_epi8(_mm256_permute4x64_epi64(v, 0xD8), pairs);
      const __m256i lo = _mm256_and_si256(t, low), hi = _mm256_and_si256(_mm256_srli_epi16(t, 4), low);
      const __m256i w0 = _mm256_unpacklo_epi8(lo, zero), w1 = _mm256_unpackhi_epi8(lo, zero);
      const __m256i w2 = _mm256_unpacklo_epi8(hi, zero), w3 = _mm256_unpackhi_epi8(hi, zero);
      for (int r = 0; r < R; ++r) {
        int32_t pair;
        std::memcpy(&pair, xq + r * k + c, 4);
        const __m256i xp = _mm256_set1_epi32(pair);
        a[r][0] = _mm256_add_epi32(a[r][0], _mm256_madd_epi16(w0, xp));
        a[r][1] = _mm256_add_epi32(a[r][1], _mm256_madd_epi16(w1, xp));
        a[r][2] = _mm256_add_epi32(a[r][2], _mm256_madd_epi16(w2, xp));
        a[r][3] = _mm256_add_epi32(a[r][3], _mm256_madd_epi16(w3, xp));
      }
    }
    const int64_t group = k0 / g;
    const __m256 eight = _mm256_set1_ps(8.f);
    const T* szg = sz + group * n * 2;
    __m256 s[4], zs[4];
    for (int i = 0; i < 4; ++i) {
      __m256 z;
      load_scale_zero<T>(szg + i * 16, s[i], z);
      zs[i] = _mm256_fnmadd_ps(eight, s[i], z);
    }
    for (int r = 0; r < R; ++r) {
      const __m256i rows[4] = {
          _mm256_permute2x128_si256(a[r][0], a[r][1], 0x20), _mm256_permute2x128_si256(a[r][0], a[r][1], 0x31),
          _mm256_permute2x128_si256(a[r][2], a[r][3], 0x20), _mm256_permute2x128_si256(a[r][2], a[r][3], 0x31)};
      const __m256 db = _mm256_set1_ps(d[r * nb + b]), xsb = _mm256_set1_ps(xs[r * nb + b]);
      for (int i = 0; i < 4; ++i) {
        float* o = out + r * 32 + 8 * i;
        __m256 acc = _mm256_loadu_ps(o);
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(rows[i]), _mm256_mul_ps(s[i], db), acc);
        acc = _mm256_fmadd_ps(zs[i], xsb, acc);
        _mm256_storeu_ps(o, acc);
      }
    }
  }
}

#if defined(__AVX512BW__)
// scale and zero of 16 consecutive rows from an interleaved (scale, zero) row of [.., N, 2]
template <typename T>
inline void load_scale_zero16(const T* sz, __m512& s, __m512& z);

template <>
inline void load_scale_zero16<float>(const float* sz, __m512& s, __m512& z) {
  const __m512 a = _mm512_loadu_ps(sz), b = _mm512_loadu_ps(sz + 16);  // s0 z0 s1 z1 ... s15 z15
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  s = _mm512_permutex2var_ps(a, even, b);
  z = _mm512_permutex2var_ps(a, _mm512_add_epi32(even, _mm512_set1_epi32(1)), b);
}

template <>
inline void load_scale_zero16<c10::BFloat16>(const c10::BFloat16* sz, __m512& s, __m512& z) {
  const __m512i v = _mm512_loadu_si512(sz);  // per int32: scale low, zero high
  s = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
  z = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// acc plus the products of a and b's int16 pairs, each pair's two summed into an int32 lane: one vpdpwssd
// where the build has AVX-512 VNNI, else vpmaddwd and vpaddd (the same exact integers either way)
inline __m512i dot_add(__m512i acc, __m512i a, __m512i b) {
#if defined(__AVX512VNNI__)
  return _mm512_dpwssd_epi32(acc, a, b);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(a, b));
#endif
}

// int4_rows32 for torch's AVX-512 packing, one block of 64 rows (byte (k, j) holds column k of row j in its
// low nibble and of row 32 + j in its high one): out[0..63]. Each row's sums are int4_rows32's, in its order
// (exact int32 sums per block of 32 columns, then the same two fmas), so the same bits on either packing.
template <typename T>
void int4_rows64(const uint8_t* w, const T* sz, int64_t n, int64_t k, int64_t g, const int16_t* xq,
                 const float* d, const float* xs, float* out) {
  const __m512i low = _mm512_set1_epi8(0x0F), zero = _mm512_setzero_si512();
  // qwords (c: rows 0-7, 8-15, 16-23, 24-31 | c+1: the same) -> 128-bit lanes (rows 8i..8i+7 of c, of c+1)
  const __m512i order = _mm512_setr_epi64(0, 4, 1, 5, 2, 6, 3, 7);
  // in each 128-bit lane, bytes 0-7 (column c) and 8-15 (column c + 1) interleaved into byte pairs
  const __m512i pairs = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15));
  __m512 acc[4];
  for (int i = 0; i < 4; ++i) acc[i] = _mm512_setzero_ps();
  const int64_t nb = k / QB;
  for (int64_t b = 0; b < nb; ++b) {
    __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
    const int64_t k0 = b * QB;
    // no software prefetch at one row: the hardware prefetcher streams it better (from DRAM, a Zen 4, 2 threads:
    // 23-25 GB/s without, 18-19 GB/s with it; a 1B Q4_0 decodes 30-39 tok/s, not 23-27; docs/decisions.md)
    for (int64_t c = k0; c < k0 + QB; c += 2) {
      const __m512i v = _mm512_loadu_si512(w + c * 32);
      const __m512i t = _mm512_shuffle_epi8(_mm512_permutexvar_epi64(order, v), pairs);
      int32_t pair;
      std::memcpy(&pair, xq + c, 4);
      const __m512i xp = _mm512_set1_epi32(pair);
      const __m512i lo = _mm512_and_si512(t, low), hi = _mm512_and_si512(_mm512_srli_epi16(t, 4), low);
      // per 128-bit lane i: rows 8i..8i+3 (unpacklo), 8i+4..8i+7 (unpackhi); hi: 32 more
      a0 = dot_add(a0, _mm512_unpacklo_epi8(lo, zero), xp);
      a1 = dot_add(a1, _mm512_unpackhi_epi8(lo, zero), xp);
      a2 = dot_add(a2, _mm512_unpacklo_epi8(hi, zero), xp);
      a3 = dot_add(a3, _mm512_unpackhi_epi8(hi, zero), xp);
    }
    // lanes (a0: 0-3, 8-11, 16-19, 24-27; a1: 4-7, 12-15, 20-23, 28-31) -> rows 0-15, 16-31 (and 32-63 of a2, a3)
    const __m512i lo01 = _mm512_shuffle_i32x4(a0, a1, 0x44), hi01 = _mm512_shuffle_i32x4(a0, a1, 0xEE);
    const __m512i lo23 = _mm512_shuffle_i32x4(a2, a3, 0x44), hi23 = _mm512_shuffle_i32x4(a2, a3, 0xEE);
    const __m512i rows[4] = {_mm512_shuffle_i32x4(lo01, lo01, 0xD8), _mm512_shuffle_i32x4(hi01, hi01, 0xD8),
                             _mm512_shuffle_i32x4(lo23, lo23, 0xD8), _mm512_shuffle_i32x4(hi23, hi23, 0xD8)};
    const int64_t group = k0 / g;
    const __m512 db = _mm512_set1_ps(d[b]), xsb = _mm512_set1_ps(xs[b]), eight = _mm512_set1_ps(8.f);
    const T* szg = sz + group * n * 2;
    // the scales and zeros of 4 blocks ahead, N * 2 apart per group, which no hardware stream follows (from
    // DRAM, Zen 4: 27-28 GB/s with, 22-25 without)
    if (k0 + 4 * QB < k) {
      const char* next = reinterpret_cast<const char*>(sz + (k0 + 4 * QB) / g * n * 2);
      for (int line = 0; line < int(64 * 2 * sizeof(T)); line += 64) _mm_prefetch(next + line, _MM_HINT_T0);
    }
    for (int i = 0; i < 4; ++i) {
      __m512 s, z;
      load_scale_zero16<T>(szg + i * 32, s, z);
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(rows[i]), _mm512_mul_ps(s, db), acc[i]);
      acc[i] = _mm512_fmadd_ps(_mm512_fnmadd_ps(eight, s, z), xsb, acc[i]);
    }
  }
  for (int i = 0; i < 4; ++i) _mm512_storeu_ps(out + 16 * i, acc[i]);
}

// R activation rows (2 or 3) times one block of 64 rows of torch's AVX-512 packing: each weight byte unpacked
// once for all R rows (the unpacking is half of int4_rows64's instructions). Each row's sums are int4_rows64's,
// in its order (exact int32 sums per block of 32 columns, then the same two fmas), so a row's result does not
// depend on the rows beside it. out[r * 64 + i]; xq, d, xs of row r at r * k, r * nb, r * nb.
template <typename T, int R>
void int4_tile64(const uint8_t* w, const T* sz, int64_t n, int64_t k, int64_t g, const int16_t* xq,
                 const float* d, const float* xs, float* out) {
  const __m512i low = _mm512_set1_epi8(0x0F), zero = _mm512_setzero_si512();
  const __m512i order = _mm512_setr_epi64(0, 4, 1, 5, 2, 6, 3, 7);
  const __m512i pairs = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15));
  const int64_t nb = k / QB;
  for (int i = 0; i < R * 64; i += 16) _mm512_storeu_ps(out + i, _mm512_setzero_ps());
  for (int64_t b = 0; b < nb; ++b) {
    __m512i a[R][4];
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < 4; ++i) a[r][i] = _mm512_setzero_si512();
    const int64_t k0 = b * QB;
    for (int line = 0; line < 16; ++line)
      _mm_prefetch(reinterpret_cast<const char*>(w + k0 * 32 + PREFETCH + 64 * line), _MM_HINT_T0);
    for (int64_t c = k0; c < k0 + QB; c += 2) {
      const __m512i v = _mm512_loadu_si512(w + c * 32);
      const __m512i t = _mm512_shuffle_epi8(_mm512_permutexvar_epi64(order, v), pairs);
      const __m512i lo = _mm512_and_si512(t, low), hi = _mm512_and_si512(_mm512_srli_epi16(t, 4), low);
      const __m512i w0 = _mm512_unpacklo_epi8(lo, zero), w1 = _mm512_unpackhi_epi8(lo, zero);
      const __m512i w2 = _mm512_unpacklo_epi8(hi, zero), w3 = _mm512_unpackhi_epi8(hi, zero);
      for (int r = 0; r < R; ++r) {
        int32_t pair;
        std::memcpy(&pair, xq + r * k + c, 4);
        const __m512i xp = _mm512_set1_epi32(pair);
        a[r][0] = dot_add(a[r][0], w0, xp);
        a[r][1] = dot_add(a[r][1], w1, xp);
        a[r][2] = dot_add(a[r][2], w2, xp);
        a[r][3] = dot_add(a[r][3], w3, xp);
      }
    }
    const int64_t group = k0 / g;
    const __m512 eight = _mm512_set1_ps(8.f);
    const T* szg = sz + group * n * 2;
    __m512 s[4], zs[4];
    for (int i = 0; i < 4; ++i) {
      __m512 z;
      load_scale_zero16<T>(szg + i * 32, s[i], z);
      zs[i] = _mm512_fnmadd_ps(eight, s[i], z);
    }
    for (int r = 0; r < R; ++r) {
      const __m512i lo01 = _mm512_shuffle_i32x4(a[r][0], a[r][1], 0x44), hi01 = _mm512_shuffle_i32x4(a[r][0], a[r][1], 0xEE);
      const __m512i lo23 = _mm512_shuffle_i32x4(a[r][2], a[r][3], 0x44), hi23 = _mm512_shuffle_i32x4(a[r][2], a[r][3], 0xEE);
      const __m512i rows[4] = {_mm512_shuffle_i32x4(lo01, lo01, 0xD8), _mm512_shuffle_i32x4(hi01, hi01, 0xD8),
                               _mm512_shuffle_i32x4(lo23, lo23, 0xD8), _mm512_shuffle_i32x4(hi23, hi23, 0xD8)};
      const __m512 db = _mm512_set1_ps(d[r * nb + b]), xsb = _mm512_set1_ps(xs[r * nb + b]);
      for (int i = 0; i < 4; ++i) {
        float* o = out + r * 64 + 16 * i;
        __m512 acc = _mm512_loadu_ps(o);
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(rows[i]), _mm512_mul_ps(s[i], db), acc);
        acc = _mm512_fmadd_ps(zs[i], xsb, acc);
        _mm512_storeu_ps(o, acc);
      }
    }
  }
}
#endif

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Four rows of an int8 weight for one activation row (before the rows' scales), each row read from start to
// end. (Reading the four rows interleaved block by block, with four accumulators, ran at under half the
// speed: the default model's int8 LM head at one row, 1.4-2.0 against 0.8 ms on 2 threads of a Zen 4 in an AVX2
// build; the same sums in the same order, so the same bits.)
void int8_rows4(const int8_t* w, int64_t k, const int16_t* xq, const float* d, float* out) {
  const int64_t nb = k / QB;
  for (int r = 0; r < 4; ++r) {
    const int8_t* wr = w + r * k;
    __m256 acc = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      if ((b & 1) == 0) _mm_prefetch(reinterpret_cast<const char*>(wr + b * QB + PREFETCH), _MM_HINT_T0);
      const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + b * QB));
      const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + b * QB + 16));
      const __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wr + b * QB)));
      const __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wr + b * QB + 16)));
      // int32 lanes summing 4 products of at most 128 * 32767 each (< 2^24: exact as a float too)
      const __m256i p = _mm256_add_epi32(_mm256_madd_epi16(w0, x0), _mm256_madd_epi16(w1, x1));
      acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_broadcast_ss(d + b), acc);
    }
    out[r] = hsum(acc);
  }
}

#if defined(__AVX512BW__)
// The AVX-512 build (tierlm.kernels builds this file with AVX-512 flags on CPUs torch runs at AVX512): R
// activation rows times 4 weight rows, one block of 32 columns a step, each weight block widened once for
// all R rows: 3 instructions per 32 weights and row (vpmaddwd, the int32 -> float conversion, the fma)
// where the AVX2 loop needs 9
template <int R>
void int8_tile(const int8_t* w, int64_t k, const int16_t* xq, const float* d, float* out) {
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < 4; ++i) acc[r][i] = _mm512_setzero_ps();
  const int64_t nb = k / QB;
  for (int64_t b = 0; b < nb; ++b) {
    __m512i wv[4];
    for (int i = 0; i < 4; ++i) {
      const int8_t* wi = w + i * k + b * QB;
      _mm_prefetch(reinterpret_cast<const char*>(wi + PREFETCH), _MM_HINT_T0);
      wv[i] = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wi)));
    }
    for (int r = 0; r < R; ++r) {
      const __m512i xv = _mm512_loadu_si512(xq + r * k + b * QB);
      const __m512 db = _mm512_set1_ps(d[r * nb + b]);
      // int32 lanes summing 2 products of at most 128 * 32767 each (< 2^24: exact as a float too)
      for (int i = 0; i < 4; ++i)
        acc[r][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_madd_epi16(wv[i], xv)), db, acc[r][i]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < 4; ++i) out[r * 4 + i] = _mm512_reduce_add_ps(acc[r][i]);
}

// One activation row (a batch-1 decode step): each of the 4 weight rows read from start to end. The R-row tile
// above reads them interleaved block by block, so as to widen each weight block once for all R activation
// rows; for one row that order ran at under half the speed (the default model's int8 LM head, 2 threads of a
// Zen 4: 1.2-2.7 against 0.9-1.1 ms). Each row's sums in the R-row tile's order, so the same bits.
template <>
void int8_tile<1>(const int8_t* w, int64_t k, const int16_t* xq, const float* d, float* out) {
  const int64_t nb = k / QB;
  for (int i = 0; i < 4; ++i) {
    const int8_t* wi = w + i * k;
    __m512 acc = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      if ((b & 1) == 0) _mm_prefetch(reinterpret_cast<const char*>(wi + b * QB + PREFETCH), _MM_HINT_T0);
      const __m512i wv = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wi + b * QB)));
      const __m512i xv = _mm512_loadu_si512(xq + b * QB);
      acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_madd_epi16(wv, xv)), _mm512_set1_ps(d[b]), acc);
    }
    out[i] = _mm512_reduce_add_ps(acc);
  }
}

// Four weight rows for `rows` (1..4) activation rows (before the rows' scales): out[r * 4 + i]
inline void int8_rows4_of(const int8_t* w, int64_t k, const int16_t* xq, const float* d, int rows, float* out) {
  switch (rows) {
    case 1: return int8_tile<1>(w, k, xq, d, out);
    case 2: return int8_tile<2>(w, k, xq, d, out);
    case 3: return int8_tile<3>(w, k, xq, d, out);
    default: return int8_tile<4>(w, k, xq, d, out);
  }
}
constexpr int ROWS_AT_ONCE = 4;
#else
inline void int8_rows4_of(const int8_t* w, int64_t k, const int16_t* xq, const float* d, int, float* out) {
  int8_rows4(w, k, xq, d, out);
}
constexpr int ROWS_AT_ONCE = 1;
#endif

struct Quantized {  // x quantized, in buffers reused by the calls of one thread
  std::vector<int16_t> q;
  std::vector<float> d, s;
};

// x quantized into `buf`: a thread's reused buffers for decode-sized x, a call's own for large ones (a long
// prefill's buffers are not kept for the thread's life)
constexpr int64_t KEEP = 1 << 16;

Quantized& quantize(const at::Tensor& x, Quantized& own) {
  thread_local Quantized kept;
  const int64_t m = x.size(0), k = x.size(1);
  Quantized& buf = m * k <= KEEP ? kept : own;
  buf.q.resize(m * k);
  buf.d.resize(m * k / QB);
  buf.s.resize(m * k / QB);
  if (x.scalar_type() == at::kFloat)
    quantize_rows(x.data_ptr<float>(), m, k, buf.q.data(), buf.d.data(), buf.s.data());
  else
    quantize_rows(x.data_ptr<c10::BFloat16>(), m, k, buf.q.data(), buf.d.data(), buf.s.data());
  return buf;
}

template <typename Y>
inline void store(Y* out, const float* v, int64_t count) {
  for (int64_t i = 0; i < count; ++i) out[i] = static_cast<Y>(v[i]);  // bf16: round to nearest even
}

void check_x(const at::Tensor& x, const char* op) {
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu() && x.is_contiguous(), op, ": x must be a contiguous 2-d CPU tensor");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, op, ": x must be float32 or bfloat16");
}

// f(scales, out) with the typed pointers of the two (float32 or bf16 each; `out` has x's dtype)
template <typename F>
void with_types(const at::Tensor& scales, at::Tensor& out, F&& f) {
  const bool f32 = out.scalar_type() == at::kFloat;
  if (scales.scalar_type() == at::kFloat) {
    if (f32) f(scales.data_ptr<float>(), out.data_ptr<float>());
    else f(scales.data_ptr<float>(), out.data_ptr<c10::BFloat16>());
  } else {
    if (f32) f(scales.data_ptr<c10::BFloat16>(), out.data_ptr<float>());
    else f(scales.data_ptr<c10::BFloat16>(), out.data_ptr<c10::BFloat16>());
  }
}

// Activation rows per int4 tile: 3 on torch's AVX-512 packing (Zen 5, 2 threads, the default model's shapes at 8
// to 128 rows: 1.1-1.3x a tile of 4 rows, whose 16 accumulators and unpacked weights crowd the 32 registers); 2
// on its AVX2 one (16 registers; simulated AVX2, a tile of 3 ran no faster)
constexpr int64_t TILE64 = 3, TILE32 = 2;
static_assert(TILE64 == 3 && TILE32 == 2, "int4_run's switches instantiate these tiles");

// block: the rows of the packing's blocks, 32 (torch's AVX2 packing) or 64 (its AVX-512 one: the AVX-512 build)
template <typename T, typename Y>
void int4_run(const Quantized& x, int64_t m, int64_t k, const uint8_t* w, const T* sz, int64_t n, int64_t g,
              int64_t block, Y* o) {
  const int64_t nb = k / QB;
  const int64_t tile = block == 64 ? TILE64 : TILE32;
  at::parallel_for(0, n / block, 1, [&](int64_t begin, int64_t end) {
    float tmp[3 * 64];
    for (int64_t rb = begin; rb < end; ++rb) {
      const uint8_t* wb = w + rb * block / 2 * k;
      const T* szb = sz + rb * block * 2;
      for (int64_t r = 0; r < m; r += tile) {  // `tile` activation rows at a time, then the rest
        const int rows = static_cast<int>(std::min(tile, m - r));
        const int16_t* xr = x.q.data() + r * k;
        const float *dr = x.d.data() + r * nb, *sr = x.s.data() + r * nb;
#if defined(__AVX512BW__)
        if (block == 64) {
          switch (rows) {
            case 1: int4_rows64<T>(wb, szb, n, k, g, xr, dr, sr, tmp); break;
            case 2: int4_tile64<T, 2>(wb, szb, n, k, g, xr, dr, sr, tmp); break;
            default: int4_tile64<T, 3>(wb, szb, n, k, g, xr, dr, sr, tmp); break;  // 3
          }
        } else
#endif
        {
          switch (rows) {
            case 1: int4_rows32<T>(wb, szb, n, k, g, xr, dr, sr, tmp); break;
            default: int4_tile32<T, 2>(wb, szb, n, k, g, xr, dr, sr, tmp); break;  // 2
          }
        }
        for (int i = 0; i < rows; ++i) store(o + (r + i) * n + rb * block, tmp + i * block, block);
      }
    }
  });
}

#if defined(__AVX512BW__)
constexpr bool BLOCKS_OF_64 = true;
#else
constexpr bool BLOCKS_OF_64 = false;
#endif

at::Tensor int4_mm(const at::Tensor& x, const at::Tensor& packed, int64_t group_size, const at::Tensor& sz,
                   int64_t block) {
  check_x(x, "int4_mm");
  const int64_t m = x.size(0), k = x.size(1);
  TORCH_CHECK(sz.dim() == 3 && sz.size(2) == 2 && sz.size(0) * group_size == k && sz.is_contiguous(),
              "int4_mm: scales_and_zeros must be contiguous [K/g, N, 2]");
  const int64_t n = sz.size(1);
  TORCH_CHECK(block == 32 || (block == 64 && BLOCKS_OF_64),
              "int4_mm: blocks of 32 rows, or of 64 in the AVX-512 build");
  TORCH_CHECK(k % QB == 0 && group_size % QB == 0 && n % block == 0,
              "int4_mm: K and the group size must be multiples of 32, N of the block");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.dim() == 2 && packed.size(0) == n &&
                  packed.size(1) * 2 == k,
              "int4_mm: packed weight must be contiguous uint8 [N, K/2]");
  TORCH_CHECK(sz.scalar_type() == at::kFloat || sz.scalar_type() == at::kBFloat16, "int4_mm: scales must be float32 or bfloat16");
  Quantized own;
  const Quantized& xq = quantize(x, own);
  at::Tensor out = at::empty({m, n}, x.options());
  const uint8_t* w = packed.data_ptr<uint8_t>();
  with_types(sz, out, [&](auto s, auto o) { int4_run(xq, m, k, w, s, n, group_size, block, o); });
  return out;
}

template <typename S, typename Y>
void int8_run(const Quantized& x, int64_t m, int64_t k, const int8_t* w, const S* s, int64_t n, Y* o) {
  const int64_t nb = k / QB;
  at::parallel_for(0, n / 4, 16, [&](int64_t begin, int64_t end) {
    for (int64_t q = begin; q < end; ++q) {
      for (int64_t r0 = 0; r0 < m; r0 += ROWS_AT_ONCE) {
        const int rows = static_cast<int>(std::min<int64_t>(ROWS_AT_ONCE, m - r0));
        float tmp[4 * ROWS_AT_ONCE];
        int8_rows4_of(w + q * 4 * k, k, x.q.data() + r0 * k, x.d.data() + r0 * nb, rows, tmp);
        for (int r = 0; r < rows; ++r) {
          for (int i = 0; i < 4; ++i) tmp[r * 4 + i] *= static_cast<float>(s[q * 4 + i]);
          store(o + (r0 + r) * n + q * 4, tmp + r * 4, 4);
        }
      }
    }
  });
}

at::Tensor int8_mm(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales) {
  check_x(x, "int8_mm");
  const int64_t m = x.size(0), k = x.size(1), n = weight.size(0);
  TORCH_CHECK(weight.scalar_type() == at::kChar && weight.dim() == 2 && weight.size(1) == k && weight.is_contiguous(),
              "int8_mm: weight must be contiguous int8 [N, K]");
  TORCH_CHECK(scales.dim() == 1 && scales.size(0) == n && scales.is_contiguous() &&
                  (scales.scalar_type() == at::kFloat || scales.scalar_type() == at::kBFloat16),
              "int8_mm: scales must be contiguous float32 or bfloat16 [N]");
  TORCH_CHECK(k % QB == 0 && n % 4 == 0, "int8_mm: K must be a multiple of 32 and N of 4");
  Quantized own;
  const Quantized& xq = quantize(x, own);
  at::Tensor out = at::empty({m, n}, x.options());
  const int8_t* w = weight.data_ptr<int8_t>();
  with_types(scales, out, [&](auto s, auto o) { int8_run(xq, m, k, w, s, n, o); });
  return out;
}


// ---- decode attention: one new query position per row, grouped-query heads, over a K/V cache -------------
// out[b, h] = softmax(scale * q[b, h] . K[b, h / G]^T, masked) V[b, h / G], G = H / KV query heads per K/V head,
// in fp32 whatever the inputs' dtype (bf16 or fp32), rounded once to q's dtype. A row's attended slots (its
// mask's true ones, in slot order) are split into chunks of CHUNK; each (row, K/V head, chunk) is a task that
// reads its keys and values once for all G heads and keeps its own max, sum and unnormalised output, merged at
// the end as in split-K ("flash") decoding. Chunks are cut by a slot's rank among the attended ones, not by its
// index, so a row's result depends only on its attended keys and values in slot order, not on where they sit:
// alone, after a batch's left padding, or with a continuous step's key in a scratch column, the same bits (a
// sliding layer's ring is the exception: its slot order is a rotation of the keys' order, which left padding
// changes). Replaces
// two tiny matmuls and a softmax: faster, and inductor renders no GEMM template for it.
constexpr int64_t CHUNK = 64;

// e^x for x <= 0 (scores less their max), 8 lanes: Cephes' expf (range reduction by ln 2, a degree-6
// polynomial; within 2 ulp of the exact value); below -87 the result is 0, a NaN stays NaN
inline __m256 exp_nonpositive(__m256 x) {
  const __m256 tiny = _mm256_cmp_ps(x, _mm256_set1_ps(-87.f), _CMP_LT_OQ);
  x = _mm256_max_ps(_mm256_set1_ps(-87.f), x);  // max_ps returns its second operand where either is NaN
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(tiny, _mm256_mul_ps(y, _mm256_castsi256_ps(e)));
}

struct Partial {  // one task's share of G heads: the max score, the sum of e^(s - max), sum of e^(s - max) v
  float max, sum;
};

// One task: the attended slots slot[0..n) (n <= CHUNK) of one row's K/V head for its G query heads. qf: G x d
// scaled queries in fp32; k, v: the head's first slot, `ls` elements between slots. Writes part[g] and
// o[g * d ...] (unnormalised)
template <int G, typename T>
void attend_chunk(const float* qf, const T* k, const T* v, int64_t ls, const int32_t* slot, int64_t n, int64_t d,
                  Partial* part, float* o) {
  alignas(32) float s[G][CHUNK];
  const int64_t nv = d / 8;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < n; ++j) {
    const T* kl = k + slot[j] * ls;
    __m256 acc[G];
    for (int g = 0; g < G; ++g) acc[g] = _mm256_setzero_ps();
    for (int64_t i = 0; i < nv; ++i) {
      const __m256 kv = load8(kl + 8 * i);
      for (int g = 0; g < G; ++g) acc[g] = _mm256_fmadd_ps(_mm256_loadu_ps(qf + g * d + 8 * i), kv, acc[g]);
    }
    for (int g = 0; g < G; ++g) s[g][j] = hsum(acc[g]);
  }
  for (int64_t j = n; j < (n + 7) / 8 * 8; ++j)  // pad the last vector: masked
    for (int g = 0; g < G; ++g) s[g][j] = neg_inf;
  const int64_t nj = (n + 7) / 8;
  for (int g = 0; g < G; ++g) {
    float mx = neg_inf;  // a NaN score wins, so that the merge makes the head's output NaN
    for (int64_t j = 0; j < n; ++j) mx = (s[g][j] > mx || std::isnan(s[g][j])) ? s[g][j] : mx;
    part[g].max = mx;
    __m256 sum = _mm256_setzero_ps();
    if (mx != neg_inf) {  // every score -inf (infinite inputs): the merge skips this share
      const __m256 vmx = _mm256_set1_ps(mx);
      for (int64_t j = 0; j < nj; ++j) {
        const __m256 p = exp_nonpositive(_mm256_sub_ps(_mm256_load_ps(s[g] + 8 * j), vmx));
        _mm256_store_ps(s[g] + 8 * j, p);
        sum = _mm256_add_ps(sum, p);
      }
    }
    part[g].sum = hsum(sum);
  }
  // o[g] = sum_j p[g][j] v[j], W vectors of d at a time, so that the G x W sums stay in registers
  constexpr int W = G <= 2 ? 4 : G <= 4 ? 2 : 1;
  for (int64_t i0 = 0; i0 < nv; i0 += W) {
    const int w = static_cast<int>(std::min<int64_t>(W, nv - i0));
    __m256 acc[G][W];
    for (int g = 0; g < G; ++g)
      for (int i = 0; i < W; ++i) acc[g][i] = _mm256_setzero_ps();
    for (int64_t j = 0; j < n; ++j) {
      const T* vl = v + slot[j] * ls + 8 * i0;
      __m256 vv[W];
      for (int i = 0; i < w; ++i) vv[i] = load8(vl + 8 * i);
      for (int g = 0; g < G; ++g) {
        const __m256 p = _mm256_set1_ps(s[g][j]);
        for (int i = 0; i < w; ++i) acc[g][i] = _mm256_fmadd_ps(p, vv[i], acc[g][i]);
      }
    }
    for (int g = 0; g < G; ++g)
      for (int i = 0; i < w; ++i) _mm256_storeu_ps(o + g * d + 8 * (i0 + i), acc[g][i]);
  }
}

template <typename T>
using ChunkFn = void (*)(const float*, const T*, const T*, int64_t, const int32_t*, int64_t, int64_t, Partial*,
                         float*);

template <typename T>
ChunkFn<T> chunk_fn(int64_t g) {
  switch (g) {
    case 1: return attend_chunk<1, T>;
    case 2: return attend_chunk<2, T>;
    case 3: return attend_chunk<3, T>;
    case 4: return attend_chunk<4, T>;
    case 5: return attend_chunk<5, T>;
    case 6: return attend_chunk<6, T>;
    case 7: return attend_chunk<7, T>;
    case 8: return attend_chunk<8, T>;
    default: return nullptr;
  }
}

template <typename T, typename Q>
void decode_attention_run(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                          const at::Tensor& mask, float scale, int64_t len, at::Tensor& out) {
  const int64_t b = q.size(0), h = q.size(1), d = q.size(2), kvh = keys.size(1), g = h / kvh;
  const bool* mp = mask.data_ptr<bool>();
  const int64_t ms = mask.stride(-1), mb = mask.stride(0);
  // each row's attended slots, in slot order (row r's from r * len), and the most chunks a row has (1 for a
  // row that attends nothing: its one empty task makes the merge answer NaN)
  std::vector<int32_t> slots(b * len);
  std::vector<int64_t> attended(b);
  int64_t chunks = 1;
  for (int64_t r = 0; r < b; ++r) {
    int32_t* sr = slots.data() + r * len;
    int64_t n = 0;
    for (int64_t l = 0; l < len; ++l)
      if (mp[r * mb + l * ms]) sr[n++] = static_cast<int32_t>(l);
    attended[r] = n;
    chunks = std::max(chunks, (n + CHUNK - 1) / CHUNK);
  }
  const int64_t tasks = b * kvh * chunks;
  const ChunkFn<T> fn = chunk_fn<T>(g);
  const Q* qp = q.data_ptr<Q>();
  const T* kp = keys.data_ptr<T>();
  const T* vp = values.data_ptr<T>();
  const float neg_inf = -std::numeric_limits<float>::infinity();
  std::vector<Partial> parts(tasks * g);
  std::vector<float> outs(tasks * g * d);
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(g * d);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t c = t % chunks, head = (t / chunks) % kvh, row = t / (chunks * kvh);
      const int64_t l0 = c * CHUNK, n = std::min(attended[row], l0 + CHUNK) - l0;
      if (n <= 0) {  // past this row's attended slots: an empty share, skipped by the merge
        for (int64_t j = 0; j < g; ++j) parts[t * g + j] = Partial{neg_inf, 0.f};
        continue;
      }
      for (int64_t j = 0; j < g; ++j) {  // the G query heads of this K/V head, scaled, in fp32
        const Q* qh = qp + row * q.stride(0) + (head * g + j) * q.stride(1);
        for (int64_t i = 0; i < d; ++i) qf[j * d + i] = static_cast<float>(qh[i]) * scale;
      }
      const int64_t off = row * keys.stride(0) + head * keys.stride(1);
      const int64_t voff = row * values.stride(0) + head * values.stride(1);
      fn(qf.data(), kp + off, vp + voff, keys.stride(2), slots.data() + row * len + l0, n, d, parts.data() + t * g,
         outs.data() + t * g * d);
    }
  });
  // merge the chunks of each (row, query head): rescale each chunk's sums to the overall max (in parallel
  // where there is enough of it: long caches, many heads)
  Q* op = out.data_ptr<Q>();
  at::parallel_for(0, b * h, std::max<int64_t>(1, 16384 / (chunks * d)), [&](int64_t begin, int64_t end) {
    std::vector<float> acc(d);
    for (int64_t rh = begin; rh < end; ++rh) {
      const int64_t row = rh / h, head = (rh % h) / g, j = rh % g;
      const int64_t t0 = (row * kvh + head) * chunks;
      float mx = neg_inf;
      for (int64_t c = 0; c < chunks; ++c) mx = std::max(mx, parts[(t0 + c) * g + j].max);
      float total = 0.f;
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t c = 0; c < chunks; ++c) {
        const Partial& p = parts[(t0 + c) * g + j];
        if (p.max == neg_inf) continue;
        const float w = std::exp(p.max - mx);
        total += w * p.sum;
        const float* o = outs.data() + ((t0 + c) * g + j) * d;
        for (int64_t i = 0; i < d; ++i) acc[i] += w * o[i];
      }
      // no slot attended: NaN, as a softmax over nothing but -inf gives
      const float inv = total > 0.f ? 1.f / total : std::numeric_limits<float>::quiet_NaN();
      Q* oh = op + rh * d;
      for (int64_t i = 0; i < d; ++i) oh[i] = static_cast<Q>(acc[i] * inv);
    }
  });
}

// The checks of decode_attention over the first `len` slots of keys and values
void check_attention(const char* op, const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                     const at::Tensor& mask, int64_t len) {
  TORCH_CHECK(q.dim() == 3 && keys.dim() == 4 && values.dim() == 4 && q.device().is_cpu() && keys.device().is_cpu() &&
                  values.device().is_cpu() && mask.device().is_cpu(),
              op, ": q must be [B, H, d], keys and values [B, KV, L, d], on the CPU");
  TORCH_CHECK(len <= std::numeric_limits<int32_t>::max(), op, ": at most 2^31 - 1 slots");
  const int64_t b = q.size(0), h = q.size(1), d = q.size(2), kvh = keys.size(1);
  TORCH_CHECK(keys.sizes() == values.sizes() && keys.size(0) == b && keys.size(3) == d && kvh > 0 && h > 0 && h % kvh == 0 &&
                  h / kvh <= 8 && d % 8 == 0 && d > 0 && len > 0 && len <= keys.size(2),
              op, ": K and V must be [B, KV, L, d] with L > 0, d a multiple of 8 and H / KV at most 8 (KV > 0)");
  TORCH_CHECK(q.stride(2) == 1 && keys.stride(3) == 1 && values.stride(3) == 1, op,
              ": the head dimension must be contiguous");
  TORCH_CHECK(keys.stride(2) == values.stride(2), op, ": K and V must have the same slot stride");
  TORCH_CHECK(mask.scalar_type() == at::kBool && mask.size(0) == b && mask.size(-1) == len && mask.numel() == b * len,
              op, ": mask must be bool [B, ..., L] with one row of L per batch row");
  TORCH_CHECK(keys.scalar_type() == values.scalar_type() &&
                  (keys.scalar_type() == at::kFloat || keys.scalar_type() == at::kBFloat16) &&
                  (q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16),
              op, ": q, K and V must be float32 or bfloat16");
}

// decode_attention over the first `len` slots, checked: out [B, H, d]
void attend(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values, const at::Tensor& mask,
            double scale, int64_t len, at::Tensor& out) {
  const float s = static_cast<float>(scale);
  const bool kf = keys.scalar_type() == at::kFloat, qf = q.scalar_type() == at::kFloat;
  if (kf && qf) decode_attention_run<float, float>(q, keys, values, mask, s, len, out);
  else if (kf) decode_attention_run<float, c10::BFloat16>(q, keys, values, mask, s, len, out);
  else if (qf) decode_attention_run<c10::BFloat16, float>(q, keys, values, mask, s, len, out);
  else decode_attention_run<c10::BFloat16, c10::BFloat16>(q, keys, values, mask, s, len, out);
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                            const at::Tensor& mask, double scale) {
  TORCH_CHECK(q.dim() == 3 && keys.dim() == 4, "decode_attention: q must be [B, H, d], keys and values [B, KV, L, d], on the CPU");
  check_attention("decode_attention", q, keys, values, mask, keys.size(2));
  at::Tensor out = at::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  attend(q, keys, values, mask, scale, keys.size(2), out);
  return out;
}


inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(c10::BFloat16* p, __m256 v) {  // round to nearest even, a NaN to 0x7FC0: c10's rounding
  __m256i u = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  u = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), odd)), 16);
  u = _mm256_blendv_epi8(u, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm_packus_epi32(_mm256_castsi256_si128(u), _mm256_extracti128_si256(u, 1)));
}

// y = x * cos + roll(x, d / 2) * sin (rotate-half rotary with a signed sin table, as layers.apply_rope) for
// `heads` heads of d, from x's dtype to y's, rounded once. The file is built with -ffp-contract=off: two
// products and a sum, each rounded in fp32, so fp32 is bit for bit aten's (and transformers') three ops.
template <typename X, typename Y>
void rope_heads(const X* x, int64_t xs, int64_t heads, int64_t d, const float* c, const float* s, Y* y, int64_t ys) {
  const int64_t half = d / 2;
  for (int64_t h = 0; h < heads; ++h) {
    const X* xh = x + h * xs;
    Y* yh = y + h * ys;
    if (half % 8 == 0) {
      for (int64_t i = 0; i < half; i += 8) {
        const __m256 a = load8(xh + i), b = load8(xh + i + half);
        store8(yh + i, _mm256_add_ps(_mm256_mul_ps(a, _mm256_loadu_ps(c + i)), _mm256_mul_ps(b, _mm256_loadu_ps(s + i))));
        store8(yh + i + half, _mm256_add_ps(_mm256_mul_ps(b, _mm256_loadu_ps(c + i + half)),
                                            _mm256_mul_ps(a, _mm256_loadu_ps(s + i + half))));
      }
    } else {
      for (int64_t i = 0; i < d; ++i) {
        const float a = static_cast<float>(xh[i]) * c[i];
        const float b = static_cast<float>(xh[i < half ? i + half : i - half]) * s[i];
        yh[i] = static_cast<Y>(a + b);
      }
    }
  }
}

template <typename X, typename Y>
void copy_heads(const X* x, int64_t xs, int64_t heads, int64_t d, Y* y, int64_t ys) {
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t i = 0; i < d; ++i) y[h * ys + i] = static_cast<Y>(static_cast<float>(x[h * xs + i]));
}

template <typename T>
void float_row(const T* p, int64_t stride, int64_t d, float* out) {
  for (int64_t i = 0; i < d; ++i) out[i] = static_cast<float>(p[i * stride]);
}

// rows of this token's k (rotated) and v into slot `slot` of the cache, and q rotated into qr [B, H, d]
template <typename X, typename T, typename C>
void rope_and_write(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
                    const at::Tensor& sin, at::Tensor& keys, at::Tensor& values, int64_t slot, at::Tensor& qr) {
  const int64_t b = q.size(0), h = q.size(1), kvh = k.size(1), d = q.size(2);
  float c[512], s[512];  // d <= 512: checked
  for (int64_t r = 0; r < b; ++r) {
    const int64_t cr = cos.size(0) == 1 ? 0 : r;  // one table for every row, or one per row
    float_row(cos.data_ptr<C>() + cr * cos.stride(0), cos.stride(-1), d, c);
    float_row(sin.data_ptr<C>() + cr * sin.stride(0), sin.stride(-1), d, s);
    T* kd = keys.data_ptr<T>() + r * keys.stride(0) + slot * keys.stride(2);
    T* vd = values.data_ptr<T>() + r * values.stride(0) + slot * values.stride(2);
    rope_heads(k.data_ptr<X>() + r * k.stride(0), k.stride(1), kvh, d, c, s, kd, keys.stride(1));
    copy_heads(v.data_ptr<X>() + r * v.stride(0), v.stride(1), kvh, d, vd, values.stride(1));
    rope_heads(q.data_ptr<X>() + r * q.stride(0), q.stride(1), h, d, c, s, qr.data_ptr<X>() + r * qr.stride(0), d);
  }
}

template <typename X, typename T>
void rope_and_write_c(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
                      const at::Tensor& sin, at::Tensor& keys, at::Tensor& values, int64_t slot, at::Tensor& qr) {
  if (cos.scalar_type() == at::kFloat) rope_and_write<X, T, float>(q, k, v, cos, sin, keys, values, slot, qr);
  else rope_and_write<X, T, c10::BFloat16>(q, k, v, cos, sin, keys, values, slot, qr);
}

// A decode step's attention with its rotary and its K/V write, for a static cache: q [B, H, d], k and v
// [B, KV, d] (this token's, before rotary, of one dtype); keys and values [B, KV, Lmax, d] get rotated k and
// v at slot `slots[0]`; then q (rotated, rounded to its dtype) attends over the first L slots, L being the
// mask's length (decode_attention). One call replaces a layer's two rotary passes, two index_copy_ and the
// attention (eager: ~31 us of small ops per layer on the default model).
at::Tensor decode_rope_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
                                 const at::Tensor& sin, at::Tensor& keys, at::Tensor& values, const at::Tensor& slots,
                                 const at::Tensor& mask, double scale) {
  const char* op = "decode_rope_attention";
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3 && keys.dim() == 4 && values.dim() == 4,
              op, ": q must be [B, H, d], k and v [B, KV, d], keys and values [B, KV, L, d]");
  const int64_t b = q.size(0), d = q.size(2), kvh = keys.size(1), lmax = keys.size(2);
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(0) == b && k.size(1) == kvh && k.size(2) == d &&
                  keys.sizes() == values.sizes() && keys.size(0) == b && keys.size(3) == d,
              op, ": k, v, keys and values must match q's batch and head size and each other");
  TORCH_CHECK(d % 2 == 0 && d <= 512, op, ": the head size must be even and at most 512");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1 && keys.stride(3) == 1 && values.stride(3) == 1,
              op, ": the head dimension must be contiguous");
  const at::Tensor* floats[] = {&q, &cos, &keys};
  for (const at::Tensor* t : floats)
    TORCH_CHECK(t->scalar_type() == at::kFloat || t->scalar_type() == at::kBFloat16,
                op, ": q, k, v, the rotary tables and the cache must be float32 or bfloat16");
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type() &&
                  values.scalar_type() == keys.scalar_type(),
              op, ": k and v must have q's dtype, values the keys'");
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.scalar_type() == sin.scalar_type() && cos.size(-1) == d &&
                  (cos.size(0) == 1 || cos.size(0) == b) && cos.numel() == cos.size(0) * d,
              op, ": cos and sin must be [B or 1, ..., d] with one row of d per batch row");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.numel() == 1 && slots.device().is_cpu(),
              op, ": slots must hold one int64 slot");
  const int64_t slot = slots.data_ptr<int64_t>()[0];
  TORCH_CHECK(slot >= 0 && slot < lmax, op, ": slot ", slot, " is outside the cache of ", lmax);
  TORCH_CHECK(mask.dim() >= 1 && mask.size(-1) > slot && mask.size(-1) <= lmax,
              op, ": the mask must cover the written slot and at most the whole cache");
  check_attention(op, q, keys, values, mask, mask.size(-1));  // before anything is written
  at::Tensor qr = at::empty({b, q.size(1), d}, q.options());
  at::Tensor out = at::empty({b, q.size(1), d}, q.options());
  const bool xf = q.scalar_type() == at::kFloat, tf = keys.scalar_type() == at::kFloat;
  if (xf && tf) rope_and_write_c<float, float>(q, k, v, cos, sin, keys, values, slot, qr);
  else if (xf) rope_and_write_c<float, c10::BFloat16>(q, k, v, cos, sin, keys, values, slot, qr);
  else if (tf) rope_and_write_c<c10::BFloat16, float>(q, k, v, cos, sin, keys, values, slot, qr);
  else rope_and_write_c<c10::BFloat16, c10::BFloat16>(q, k, v, cos, sin, keys, values, slot, qr);
  attend(qr, keys, values, mask, scale, mask.size(-1), out);
  return out;
}

// RMSNorm of each row of x [..., D] (contiguous, fp32 or bf16) as layers.RMSNorm computes it: in fp32
// x / sqrt(mean(x^2) + eps), rounded to x's dtype, then times the weight in x's dtype (llama: two roundings,
// as Hugging Face's); gemma: x / rms * (1 + weight) in fp32, rounded once (GemmaRMSNorm). The sum of squares
// runs in 8 fp32 lanes, so the mean may differ from aten's in its last bit. One call instead of an eager
// decode step's ~8 small ops per norm (~20 us on the default model; two norms a layer).
template <typename X, typename W>
void rms_rows(const X* x, const W* w, int64_t rows, int64_t dim, float eps, bool gemma, X* y) {
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / dim), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const X* xr = x + r * dim;
      X* yr = y + r * dim;
      __m256 acc = _mm256_setzero_ps();
      int64_t i = 0;
      for (; i + 8 <= dim; i += 8) {
        const __m256 v = load8(xr + i);
        acc = _mm256_add_ps(acc, _mm256_mul_ps(v, v));
      }
      float ss = hsum(acc);
      for (; i < dim; ++i) ss += static_cast<float>(xr[i]) * static_cast<float>(xr[i]);
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(dim) + eps);
      for (int64_t j = 0; j < dim; ++j) {
        const float n = static_cast<float>(xr[j]) * inv;
        if (gemma) yr[j] = static_cast<X>(n * (1.f + static_cast<float>(w[j])));
        else yr[j] = static_cast<X>(static_cast<float>(w[j]) * static_cast<float>(static_cast<X>(n)));
      }
    }
  });
}

// After an eager continuous-batching step, which wrote every row's new key and value at one scratch column:
// copy that column of each store [rows, heads, slots, dim] (a layer's keys or values) to each row's own slot,
// where[r]. One call for every layer instead of two indexing ops a layer (0.3 ms a step at one row).
void copy_column(at::TensorList stores, const at::Tensor& where, int64_t scratch) {
  TORCH_CHECK(where.scalar_type() == at::kLong && where.is_contiguous(), "where must be contiguous int64");
  const int64_t rows = where.numel();
  const int64_t* w = where.data_ptr<int64_t>();
  for (const at::Tensor& s : stores) {
    TORCH_CHECK(s.dim() == 4 && s.size(0) == rows && s.stride(3) == 1, "stores must be [rows, heads, slots, dim]");
    TORCH_CHECK(scratch >= 0 && scratch < s.size(2), "scratch column out of range");
    const int64_t slots = s.size(2), size = s.element_size(), bytes = s.size(3) * size;
    char* base = static_cast<char*>(s.data_ptr());
    for (int64_t r = 0; r < rows; ++r) {
      TORCH_CHECK(w[r] >= 0 && w[r] < slots, "row slot out of range");
      if (w[r] == scratch) continue;
      for (int64_t h = 0; h < s.size(1); ++h) {
        char* row = base + (r * s.stride(0) + h * s.stride(1)) * size;
        std::memcpy(row + w[r] * s.stride(2) * size, row + scratch * s.stride(2) * size, bytes);
      }
    }
  }
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, bool gemma) {
  TORCH_CHECK(x.dim() >= 1 && x.is_contiguous() && x.device().is_cpu() && x.size(-1) > 0,
              "rms_norm: x must be a contiguous CPU tensor");
  const int64_t dim = x.size(-1), rows = x.numel() / dim;
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == dim && weight.is_contiguous(),
              "rms_norm: the weight must be contiguous [D], D being x's last dimension");
  TORCH_CHECK((x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) &&
                  (weight.scalar_type() == at::kFloat || weight.scalar_type() == at::kBFloat16) &&
                  (gemma || weight.scalar_type() == x.scalar_type()),
              "rms_norm: x and the weight must be float32 or bfloat16 (of one dtype unless gemma)");
  at::Tensor y = at::empty(x.sizes(), x.options());
  const float e = static_cast<float>(eps);
  const bool xf = x.scalar_type() == at::kFloat, wf = weight.scalar_type() == at::kFloat;
  if (xf && wf) rms_rows(x.data_ptr<float>(), weight.data_ptr<float>(), rows, dim, e, gemma, y.data_ptr<float>());
  else if (xf) rms_rows(x.data_ptr<float>(), weight.data_ptr<c10::BFloat16>(), rows, dim, e, gemma, y.data_ptr<float>());
  else if (wf)
    rms_rows(x.data_ptr<c10::BFloat16>(), weight.data_ptr<float>(), rows, dim, e, gemma, y.data_ptr<c10::BFloat16>());
  else
    rms_rows(x.data_ptr<c10::BFloat16>(), weight.data_ptr<c10::BFloat16>(), rows, dim, e, gemma,
             y.data_ptr<c10::BFloat16>());
  return y;
}


// A one-row bf16 product (bf16_mv): on AVX-512 BF16 by vdpbf16ps, else (AVX2) by widening and FMA.
#if defined(__AVX512BF16__)
// A one-row bf16 product on AVX-512 BF16 (vdpbf16ps: pairs of bf16 products summed into fp32 lanes): y [1, N] =
// x [1, K] @ w.T (+ bias), four weight rows at a time, each read from start to end, each row's sum in one fixed
// order, rounded to bf16 once (with the bias added in fp32 first). torch's one-row bf16 F.linear reads the
// weight at 12-18 GB/s on a Zen 4 (2 threads) where this reads at 21-26 (weights not in cache; in cache 4-5x).
inline void bf16_rows4(const c10::BFloat16* w, const c10::BFloat16* x, int64_t k, float* out) {
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t c = 0; c < k; c += 32) {
    const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + c);
    for (int r = 0; r < 4; ++r)
      _mm_prefetch(reinterpret_cast<const char*>(w + r * k + c) + PREFETCH / 2, _MM_HINT_T0);
    a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512(w + c), xv);
    a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_loadu_si512(w + k + c), xv);
    a2 = _mm512_dpbf16_ps(a2, (__m512bh)_mm512_loadu_si512(w + 2 * k + c), xv);
    a3 = _mm512_dpbf16_ps(a3, (__m512bh)_mm512_loadu_si512(w + 3 * k + c), xv);
  }
  out[0] = _mm512_reduce_add_ps(a0);
  out[1] = _mm512_reduce_add_ps(a1);
  out[2] = _mm512_reduce_add_ps(a2);
  out[3] = _mm512_reduce_add_ps(a3);
}
#else
// The same product without native bf16 (AVX2): each bf16 widened to fp32 exactly (a 16-bit shift) and multiplied
// into fp32 sums by FMA, two sums a row (even and odd 8-element blocks) added at the end, four rows at a time.
// aten's one-row bf16 product (torch.mv or F.linear) reads the weight at 16-19 GB/s on a Zen 3 (2 threads),
// the time fp32's takes for twice the bytes: its widening bounds it, not memory.
inline __m256 bf16x8(const c10::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

inline void bf16_rows4(const c10::BFloat16* w, const c10::BFloat16* x, int64_t k, float* out) {
  __m256 a[4][2];
  for (int r = 0; r < 4; ++r) a[r][0] = a[r][1] = _mm256_setzero_ps();
  for (int64_t c = 0; c < k; c += 32) {  // one 64-byte line of each row
    const __m256 x0 = bf16x8(x + c), x1 = bf16x8(x + c + 8), x2 = bf16x8(x + c + 16), x3 = bf16x8(x + c + 24);
    for (int r = 0; r < 4; ++r) {
      const c10::BFloat16* row = w + r * k + c;
      _mm_prefetch(reinterpret_cast<const char*>(row) + PREFETCH / 2, _MM_HINT_T0);
      a[r][0] = _mm256_fmadd_ps(bf16x8(row), x0, a[r][0]);
      a[r][1] = _mm256_fmadd_ps(bf16x8(row + 8), x1, a[r][1]);
      a[r][0] = _mm256_fmadd_ps(bf16x8(row + 16), x2, a[r][0]);
      a[r][1] = _mm256_fmadd_ps(bf16x8(row + 24), x3, a[r][1]);
    }
  }
  for (int r = 0; r < 4; ++r) out[r] = hsum(_mm256_add_ps(a[r][0], a[r][1]));
}
#endif

at::Tensor bf16_mv(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.size(0) == 1 && x.is_contiguous() && x.device().is_cpu() &&
                  x.scalar_type() == at::kBFloat16,
              "bf16_mv: x must be a contiguous bf16 CPU row [1, K]");
  const int64_t k = x.size(1), n = w.size(0);
  TORCH_CHECK(w.dim() == 2 && w.size(1) == k && w.is_contiguous() && w.scalar_type() == at::kBFloat16 &&
                  k % 32 == 0 && n % 4 == 0,
              "bf16_mv: weight must be contiguous bf16 [N, K], K a multiple of 32, N of 4");
  const bool has_bias = bias.has_value() && bias->defined();
  TORCH_CHECK(!has_bias || (bias->dim() == 1 && bias->size(0) == n && bias->is_contiguous() &&
                            bias->scalar_type() == at::kBFloat16),
              "bf16_mv: bias must be contiguous bf16 [N]");
  at::Tensor out = at::empty({1, n}, x.options());
  const c10::BFloat16* xp = x.data_ptr<c10::BFloat16>();
  const c10::BFloat16* wp = w.data_ptr<c10::BFloat16>();
  const c10::BFloat16* bp = has_bias ? bias->data_ptr<c10::BFloat16>() : nullptr;
  c10::BFloat16* yp = out.data_ptr<c10::BFloat16>();
  at::parallel_for(0, n / 4, 16, [&](int64_t begin, int64_t end) {
    float t[4];
    for (int64_t i = begin; i < end; ++i) {
      bf16_rows4(wp + i * 4 * k, xp, k, t);
      for (int j = 0; j < 4; ++j)
        yp[i * 4 + j] = c10::BFloat16(bp ? t[j] + static_cast<float>(bp[i * 4 + j]) : t[j]);
    }
  });
  return out;
}

// One product of a layer step: int4 (group > 0: int4_mm's group size), int8 (group 0: int8_mm) or one bf16
// row (group -1: bf16_mv, which adds the bias before its one rounding; s unused); the quantized products add
// their bias (in x's dtype) after, as quant's `product` functions do
at::Tensor layer_product(const at::Tensor& x, const at::Tensor& w, const at::Tensor& s, int64_t group, int64_t block,
                         const std::optional<at::Tensor>& bias) {
  if (group < 0) return bf16_mv(x, w, bias);
  at::Tensor y = group > 0 ? int4_mm(x, w, group, s, block) : int8_mm(x, w, s);
  return bias.has_value() && bias->defined() ? at::add(y, *bias) : y;
}

// A decoder layer's eager decode step, as one call: the ops of its Python layer program
// (tierlm/models/programs.py) in the same order on the same tensors, so the same bits, without the ~15 calls
// from Python a layer (each a few microseconds of dispatch). x [rows, hidden]; products: q/k/v fused, o,
// gate/up fused, down (weights[i], scales[i], groups[i], biases[i]); shape: heads, kv heads, head size. norms:
// in, mid (before the MLP), then optionally q and k (Qwen 3, Gemma 3: each head's q and k), then optionally
// after the attention and after the MLP (Gemma 3: each sublayer's output before its residual add); gemma:
// Gemma's (1 + w) norms; gelu: GeGLU (tanh GELU), else SwiGLU; ring: a sliding layer's ring of that many
// slots (the K/V are written at slot % ring), 0 for a static cache.
at::Tensor layer_step(const at::Tensor& x, at::TensorList norms, double eps, bool gemma, bool gelu,
                      at::TensorList weights, at::TensorList scales, at::IntArrayRef groups,
                      const c10::List<std::optional<at::Tensor>>& biases, int64_t block, at::IntArrayRef shape,
                      const at::Tensor& cos, const at::Tensor& sin, at::Tensor& keys, at::Tensor& values,
                      const at::Tensor& slots, int64_t ring, const at::Tensor& mask, double scale) {
  TORCH_CHECK(weights.size() == 4 && scales.size() == 4 && groups.size() == 4 && biases.size() == 4 &&
                  shape.size() == 3,
              "layer_step: four products (q/k/v, o, gate/up, down) and the shape (heads, kv heads, head size)");
  TORCH_CHECK(x.dim() == 2, "layer_step: x must be [rows, hidden]");
  const size_t n = norms.size();
  TORCH_CHECK(n == 2 || n == 4 || n == 6, "layer_step: norms are in and mid, then q and k, then the two after");
  const int64_t rows = x.size(0), heads = shape[0], kv = shape[1], d = shape[2];
  auto product = [&](const at::Tensor& in, int i) {
    return layer_product(in, weights[i], scales[i], groups[i], block, biases.get(i));
  };
  auto norm = [&](const at::Tensor& in, size_t i) { return rms_norm(in.contiguous(), norms[i], eps, gemma); };
  const at::Tensor qkv = product(norm(x, 0), 0).view({rows, heads + 2 * kv, d});
  std::vector<at::Tensor> q_k_v = qkv.split_with_sizes({heads, kv, kv}, 1);
  if (n >= 4) {
    q_k_v[0] = norm(q_k_v[0], 2);
    q_k_v[1] = norm(q_k_v[1], 3);
  }
  const at::Tensor at_slots = ring > 0 ? at::remainder(slots, ring) : slots;
  at::Tensor out = product(
      decode_rope_attention(q_k_v[0], q_k_v[1], q_k_v[2], cos, sin, keys, values, at_slots, mask, scale).view({rows, -1}),
      1);
  at::Tensor h = at::add(x, n == 6 ? norm(out, 4) : out);
  const std::vector<at::Tensor> gate_up = product(norm(h, 1), 2).chunk(2, -1);
  at::Tensor act = at::mul(gelu ? at::gelu(gate_up[0], "tanh") : at::silu(gate_up[0]), gate_up[1]);
  out = product(act, 3);
  return at::add(h, n == 6 ? norm(out, 5) : out);
}

}  // namespace

TORCH_LIBRARY(tierlm_avx2, lib) {
  lib.def("int4_mm(Tensor x, Tensor packed, int group_size, Tensor scales_and_zeros, int block=32) -> Tensor");
  lib.def("int8_mm(Tensor x, Tensor weight, Tensor scales) -> Tensor");
  lib.def("decode_attention(Tensor q, Tensor keys, Tensor values, Tensor mask, float scale) -> Tensor");
  lib.def(
      "decode_rope_attention(Tensor q, Tensor k, Tensor v, Tensor cos, Tensor sin, Tensor(a!) keys, "
      "Tensor(b!) values, Tensor slots, Tensor mask, float scale) -> Tensor");
  lib.def("rms_norm(Tensor x, Tensor weight, float eps, bool gemma) -> Tensor");
  lib.def("copy_column(Tensor(a!)[] stores, Tensor where, int scratch) -> ()");
  lib.def("bf16_mv(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  lib.def(
      "layer_step(Tensor x, Tensor[] norms, float eps, bool gemma, bool gelu, Tensor[] weights, Tensor[] scales, "
      "int[] groups, Tensor?[] biases, int block, int[] shape, Tensor cos, Tensor sin, Tensor(a!) keys, "
      "Tensor(b!) values, Tensor slots, int ring, Tensor mask, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(tierlm_avx2, CPU, lib) {
  lib.impl("int4_mm", &int4_mm);
  lib.impl("int8_mm", &int8_mm);
  lib.impl("decode_attention", &decode_attention);
  lib.impl("decode_rope_attention", &decode_rope_attention);
  lib.impl("rms_norm", &rms_norm);
  lib.impl("copy_column", &copy_column);
  lib.impl("bf16_mv", &bf16_mv);
  lib.impl("layer_step", &layer_step);
}
