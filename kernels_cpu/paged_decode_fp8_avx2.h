// paged_decode.cc's fp8 path for AVX2 + F16C (head_dim a multiple of 16): a part of that file,
// included once inside its anonymous namespace, after the helpers it uses (Shape, Args, E4M3,
// E5M2, convert_row, for_each_key, for_each_page, softmax_rows). kernels_cpu/build.py hashes it
// with the sources.

#if defined(__F16C__) && defined(__AVX2__)
#define JAXLM_FP8_AVX2 1  // attend_head takes attend_head_fp8_fast (unless the AVX-512 path is built)
// The fast fp8 path (head_dim a multiple of 16 known at compile time): each key's head row is
// converted once, in registers, and used there by all G query heads; no float copy of the row
// is written. A byte becomes an f16 in two integer operations (e5m2 is an f16's high byte;
// e4m3fn's sign and 7 value bits shifted under an f16's exponent read as its value times 2^-8)
// and F16C converts 8 at a time (f16 subnormals exactly, whatever DAZ says). The 2^8 is applied
// once per score and once per output instead of per element: scaling by a power of two is
// exact. e4m3fn's NaN code (S.1111.111) has no f16 twin: a row holding one (checked with the
// same loads) is converted by convert_row instead, NaN and all.
template <typename KV>
struct Fp8Fast {
  static constexpr float kScale = std::is_same_v<KV, E4M3> ? 256.0f : 1.0f;
};

// Bytes (as 16-bit words, each byte in the high half) -> f16 bits: e5m2 already is one; e4m3fn
// gets an arithmetic shift by 1 and the sign's copy at bit 14 cleared: S.0EEEEMMM.0000000.
template <typename KV>
inline __m256i fp8_words_to_f16(__m256i w) {
  if constexpr (std::is_same_v<KV, E5M2>) return w;
  return _mm256_and_si256(_mm256_srai_epi16(w, 1), _mm256_set1_epi16(int16_t(0xbfff)));
}

// Row [kD] of fp8 bytes -> v[kD / 8] as floats / kScale. 32 bytes a load (16 for the last 16 of
// a kD that is an odd multiple of 16); the 256-bit unpacks work per 128-bit lane, so the four f16
// groups of 32 bytes are bytes 0-7, 16-23 (lo) and 8-15, 24-31 (hi).
template <typename KV, int kD>
inline void load_row_fp8(const KV* src, __m256* v) {
  static_assert(kD % 16 == 0);
  const uint8_t* p = reinterpret_cast<const uint8_t*>(src);
  const __m256i zero = _mm256_setzero_si256(), high = _mm256_set1_epi8(char(0x80)), ones = _mm256_set1_epi8(char(0xff));
  __m256i nan = zero;  // e4m3fn's NaN code: (byte | 0x80) == 0xff
  int i = 0;
  for (; i + 32 <= kD; i += 32) {
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i));
    if constexpr (std::is_same_v<KV, E4M3>) nan = _mm256_or_si256(nan, _mm256_cmpeq_epi8(_mm256_or_si256(b, high), ones));
    const __m256i lo = fp8_words_to_f16<KV>(_mm256_unpacklo_epi8(zero, b));
    const __m256i hi = fp8_words_to_f16<KV>(_mm256_unpackhi_epi8(zero, b));
    v[i / 8] = _mm256_cvtph_ps(_mm256_castsi256_si128(lo));
    v[i / 8 + 1] = _mm256_cvtph_ps(_mm256_castsi256_si128(hi));
    v[i / 8 + 2] = _mm256_cvtph_ps(_mm256_extracti128_si256(lo, 1));
    v[i / 8 + 3] = _mm256_cvtph_ps(_mm256_extracti128_si256(hi, 1));
  }
  if (i < kD) {  // 16 bytes left: one lane's worth, in order
    const __m256i b = _mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + i)));
    if constexpr (std::is_same_v<KV, E4M3>) nan = _mm256_or_si256(nan, _mm256_cmpeq_epi8(_mm256_or_si256(b, high), ones));
    v[i / 8] = _mm256_cvtph_ps(_mm256_castsi256_si128(fp8_words_to_f16<KV>(_mm256_unpacklo_epi8(zero, b))));
    v[i / 8 + 1] = _mm256_cvtph_ps(_mm256_castsi256_si128(fp8_words_to_f16<KV>(_mm256_unpackhi_epi8(zero, b))));
  }
  if constexpr (std::is_same_v<KV, E4M3>) {
    if (__builtin_expect(!_mm256_testz_si256(nan, nan), 0)) {
      alignas(32) float row[kD];
      convert_row(src, row, kD);
      const __m256 inv = _mm256_set1_ps(1.0f / Fp8Fast<KV>::kScale);
      for (int k = 0; k < kD / 8; ++k) v[k] = _mm256_mul_ps(_mm256_load_ps(row + 8 * k), inv);
    }
  }
}

// The lane sums of v[0..7], in order.
inline __m256 lane_sums8(const __m256* v) {
  const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

// One head's rows of a page are a cache line or two every Hkv * D bytes: the hardware prefetchers
// miss that stride, and the kernel waited on memory for each row (30 layers' caches, 378 MB:
// 1.6 GB/s, PERF_NOTES session 11). So the rows of heads [h, h + hb) of the page kAhead pages on
// are requested while this one is read (all heads: the page's whole block).
constexpr int64_t kAhead = 4;

template <int kD, typename KV>
inline void prefetch_page(const Shape& s, const int32_t* table, const KV* base, int64_t h, int64_t hb,
                          int64_t first, int64_t hi) {
  const int64_t next = first + kAhead * s.BS;
  if (next >= hi) return;
  const int64_t row_len = s.Hkv * kD;
  const char* rows = reinterpret_cast<const char*>(
      base + std::clamp<int64_t>(table[next / s.BS], 0, s.NB - 1) * s.BS * row_len + h * kD);
  for (int64_t i = 0; i < s.BS; ++i)
    for (int64_t c = 0; c < hb * kD * int64_t(sizeof(KV)); c += 64)
      _mm_prefetch(rows + i * row_len * int64_t(sizeof(KV)) + c, _MM_HINT_T0);
}

// o[g, :] += sum over keys j in [js, je) of one page of p[g * n + j] * V[j] for kG heads: p is the
// heads' probabilities (offset by -first), o their [kG, kD] sums (V as floats / kScale), key j's
// row at rows + j * row_len. 16 floats of the head dim a pass over the page's keys, whose rows
// stay in L1 for the next 16.
template <typename KV, int kD, int kG>
void accumulate_v(const KV* rows, int64_t row_len, int64_t js, int64_t je, const float* p, int64_t n, float* o) {
  for (int b = 0; b < kD; b += 16) {
    __m256 acc[kG][2];
    for (int g = 0; g < kG; ++g)
      for (int i = 0; i < 2; ++i) acc[g][i] = _mm256_loadu_ps(o + g * kD + b + 8 * i);
    for (int64_t j = js; j < je; ++j) {
      __m256 v[2];
      load_row_fp8<KV, 16>(rows + j * row_len + b, v);
      for (int g = 0; g < kG; ++g) {
        const __m256 pj = _mm256_broadcast_ss(p + g * n + j);
        acc[g][0] = _mm256_fmadd_ps(pj, v[0], acc[g][0]);
        acc[g][1] = _mm256_fmadd_ps(pj, v[1], acc[g][1]);
      }
    }
    for (int g = 0; g < kG; ++g)
      for (int i = 0; i < 2; ++i) _mm256_storeu_ps(o + g * kD + b + 8 * i, acc[g][i]);
  }
}

// Token t's attention for KV heads [h, h + a.hb) (heads_per_item, paged_decode.cc) and their G
// query heads each: with all of a token's heads, each page's K and V are read as one block.
template <typename KV, int kD>
void attend_head_fp8_fast(const Args& a, int64_t t, int64_t h, std::vector<float>& scratch) {
  const Shape& s = a.s;
  const KV* kc = static_cast<const KV*>(a.cache);
  const KV* vc = kc + s.NB * s.BS * s.Hkv * s.D;
  const int64_t G = s.G, hb = a.hb, HG = hb * G, row_len = s.Hkv * kD;
  const int32_t* table = row_table(a, t);
  const int64_t hi = keys_end(a, t), lo = keys_begin(a, hi);
  const int64_t n = hi - lo;
  float* o = a.out + (t * s.Hkv + h) * G * kD;  // [HG, kD]: query head x = hh * G + g of KV head h + hh
  std::fill(o, o + HG * kD, 0.0f);
  if (n <= 0) return;
  // Scores [HG, n], then the HG heads' partial dot products of 8 keys ([HG, 8] vectors).
  scratch.resize(HG * n + HG * 8 * 8 + 8);
  float* sc = scratch.data();
  __m256* part = reinterpret_cast<__m256*>(
      (reinterpret_cast<uintptr_t>(sc + HG * n) + 31) & ~uintptr_t(31));
  const float* q = a.q + (t * s.Hkv + h) * G * kD;  // [HG, kD]
  const __m256 kscale = _mm256_set1_ps(Fp8Fast<KV>::kScale);

  // Scores: 8 keys' products per query head summed across lanes at once.
  int64_t count = 0, j0 = lo;
  auto flush = [&] {
    for (int64_t x = 0; x < HG; ++x) {
      __m256* px = part + x * 8;
      for (int64_t i = count; i < 8; ++i) px[i] = _mm256_setzero_ps();
      const __m256 sums = _mm256_mul_ps(lane_sums8(px), kscale);
      alignas(32) float tmp[8];
      _mm256_store_ps(tmp, sums);
      std::copy(tmp, tmp + count, sc + x * n + (j0 - lo));
    }
  };
  for_each_key(s, table, kc, lo, hi, [&](int64_t j, const KV* row) {
    if (j % s.BS == 0 || j == lo) prefetch_page<kD>(s, table, kc, h, hb, j - j % s.BS, hi);
    for (int64_t hh = 0; hh < hb; ++hh) {
      __m256 k[kD / 8];
      load_row_fp8<KV, kD>(row + (h + hh) * kD, k);
      for (int64_t g = 0; g < G; ++g) {
        const float* qx = q + (hh * G + g) * kD;
        __m256 acc0 = _mm256_mul_ps(_mm256_loadu_ps(qx), k[0]);
        __m256 acc1 = _mm256_mul_ps(_mm256_loadu_ps(qx + 8), k[1]);
        for (int i = 2; i < kD / 8; i += 2) {
          acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(qx + 8 * i), k[i], acc0);
          acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(qx + 8 * i + 8), k[i + 1], acc1);
        }
        part[(hh * G + g) * 8 + count] = _mm256_add_ps(acc0, acc1);
      }
    }
    if (++count == 8) {
      flush();
      count = 0;
      j0 = j + 1;
    }
  });
  if (count) flush();
  float inv_l[HG];
  softmax_rows(sc, HG, n, a.cap, inv_l);
  // V a page at a time; for each KV head its query heads in groups of up to 4, their sums in
  // registers.
  for_each_page(s, table, vc, lo, hi, [&](int64_t first, int64_t js, int64_t je, const KV* page) {
    prefetch_page<kD>(s, table, vc, h, hb, first, hi);
    const KV* rows = page + h * kD - first * row_len;  // key j's row: rows + j * row_len
    for (int64_t x = 0; x < HG;) {
      const int64_t hh = x / G, g = std::min<int64_t>(G - x % G, 4);  // within KV head h + hh
      const KV* hr = rows + hh * kD;
      const float* p = sc + x * n - lo;
      float* ox = o + x * kD;
      switch (g) {
        case 1: accumulate_v<KV, kD, 1>(hr, row_len, js, je, p, n, ox); break;
        case 2: accumulate_v<KV, kD, 2>(hr, row_len, js, je, p, n, ox); break;
        case 3: accumulate_v<KV, kD, 3>(hr, row_len, js, je, p, n, ox); break;
        default: accumulate_v<KV, kD, 4>(hr, row_len, js, je, p, n, ox); break;
      }
      x += g;
    }
  });
  for (int64_t x = 0; x < HG; ++x) {
    float* ox = o + x * kD;
    const float f = inv_l[x] * Fp8Fast<KV>::kScale;
#pragma omp simd
    for (int64_t d = 0; d < kD; ++d) ox[d] *= f;
  }
}
#endif
