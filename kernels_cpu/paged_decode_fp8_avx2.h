// paged_decode.cc's fp8 path for AVX2 + F16C (head_dim a multiple of 16): a part of that file,
// included once inside its anonymous namespace, after the helpers it uses (Shape, Args, E4M3,
// E5M2, convert_row, for_each_key, softmax_rows). kernels_cpu/build.py hashes it with the sources.

#if defined(__F16C__) && defined(__AVX2__)
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

// Pages are read one head's row (a cache line or two) every Hkv * D bytes: the hardware
// prefetchers miss that stride, and the kernel waited on memory for each row (30 layers' caches,
// 378 MB: 1.6 GB/s). So the rows of the page kAhead pages on are requested while this one is read.
constexpr int64_t kAhead = 4;

template <int kD, typename KV>
inline void prefetch_page(const Shape& s, const int32_t* table, const KV* base, int64_t h, int64_t first,
                          int64_t hi) {
  const int64_t next = first + kAhead * s.BS;
  if (next >= hi) return;
  const int64_t row_len = s.Hkv * kD;
  const char* rows = reinterpret_cast<const char*>(
      base + std::clamp<int64_t>(table[next / s.BS], 0, s.NB - 1) * s.BS * row_len + h * kD);
  for (int64_t i = 0; i < s.BS; ++i)
    for (int64_t c = 0; c < int64_t(kD * sizeof(KV)); c += 64)
      _mm_prefetch(rows + i * row_len * int64_t(sizeof(KV)) + c, _MM_HINT_T0);
}

// o[g, :] += sum over keys j in [lo, hi) of p[g * n + j] * V[j] for kG heads: p is the heads'
// probabilities (offset by -lo), o their [kG, kD] sums (V as floats / kScale).
template <typename KV, int kD, int kG>
void accumulate_v(const Shape& s, const int32_t* table, const KV* vc, int64_t h, int64_t lo, int64_t hi,
                  const float* p, int64_t n, float* o) {
  const int64_t row_len = s.Hkv * kD;
  for (int64_t first = lo - lo % s.BS; first < hi; first += s.BS) {
    const int64_t page = std::clamp<int64_t>(table[first / s.BS], 0, s.NB - 1);
    const KV* rows = vc + page * s.BS * row_len + h * kD;
    const int64_t js = std::max(first, lo), je = std::min(first + s.BS, hi);
    prefetch_page<kD>(s, table, vc, h, first, hi);
    for (int b = 0; b < kD; b += 16) {
      __m256 acc[kG][2];
      for (int g = 0; g < kG; ++g)
        for (int i = 0; i < 2; ++i) acc[g][i] = _mm256_loadu_ps(o + g * kD + b + 8 * i);
      for (int64_t j = js; j < je; ++j) {
        __m256 v[2];
        load_row_fp8<KV, 16>(rows + (j - first) * row_len + b, v);
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
}

template <typename KV, int kD>
void attend_head_fp8_fast(const Args& a, int64_t t, int64_t h, std::vector<float>& scratch) {
  const Shape& s = a.s;
  const KV* kc = static_cast<const KV*>(a.cache);
  const KV* vc = kc + s.NB * s.BS * s.Hkv * s.D;
  const int64_t G = s.G;
  const int32_t* table = row_table(a, t);
  const int64_t hi = keys_end(a, t), lo = keys_begin(a, hi);
  const int64_t n = hi - lo;
  float* o = a.out + (t * s.Hkv + h) * G * kD;  // [G, kD]
  std::fill(o, o + G * kD, 0.0f);
  if (n <= 0) return;
  // Scores [G, n], then the G heads' partial dot products of 8 keys ([G, 8] vectors).
  scratch.resize(G * n + G * 8 * 8 + 8);
  float* sc = scratch.data();
  __m256* part = reinterpret_cast<__m256*>(
      (reinterpret_cast<uintptr_t>(sc + G * n) + 31) & ~uintptr_t(31));
  const float* q = a.q + (t * s.Hkv + h) * G * kD;
  const __m256 kscale = _mm256_set1_ps(Fp8Fast<KV>::kScale);

  // Scores: 8 keys' products per head summed across lanes at once.
  int64_t count = 0, j0 = lo;
  auto flush = [&] {
    for (int64_t g = 0; g < G; ++g) {
      __m256* pg = part + g * 8;
      for (int64_t i = count; i < 8; ++i) pg[i] = _mm256_setzero_ps();
      const __m256 sums = _mm256_mul_ps(lane_sums8(pg), kscale);
      alignas(32) float tmp[8];
      _mm256_store_ps(tmp, sums);
      std::copy(tmp, tmp + count, sc + g * n + (j0 - lo));
    }
  };
  for_each_key(s, table, kc, lo, hi, [&](int64_t j, const KV* row) {
    if (j % s.BS == 0 || j == lo) prefetch_page<kD>(s, table, kc, h, j - j % s.BS, hi);
    __m256 k[kD / 8];
    load_row_fp8<KV, kD>(row + h * kD, k);
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = q + g * kD;
      __m256 acc0 = _mm256_mul_ps(_mm256_loadu_ps(qg), k[0]);
      __m256 acc1 = _mm256_mul_ps(_mm256_loadu_ps(qg + 8), k[1]);
      for (int i = 2; i < kD / 8; i += 2) {
        acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(qg + 8 * i), k[i], acc0);
        acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(qg + 8 * i + 8), k[i + 1], acc1);
      }
      part[g * 8 + count] = _mm256_add_ps(acc0, acc1);
    }
    if (++count == 8) {
      flush();
      count = 0;
      j0 = j + 1;
    }
  });
  if (count) flush();
  float inv_l[G];
  softmax_rows(sc, G, n, a.cap, inv_l);
  // V: heads in groups of up to 4, their sums in registers, 16 floats of the head dim at a time,
  // a page of keys per pass (its rows stay in L1 for the next 16 floats).
  for (int64_t g0 = 0; g0 < G; g0 += 4) {
    float* og = o + g0 * kD;
    const float* pg = sc + g0 * n - lo;
    switch (std::min<int64_t>(G - g0, 4)) {
      case 1: accumulate_v<KV, kD, 1>(s, table, vc, h, lo, hi, pg, n, og); break;
      case 2: accumulate_v<KV, kD, 2>(s, table, vc, h, lo, hi, pg, n, og); break;
      case 3: accumulate_v<KV, kD, 3>(s, table, vc, h, lo, hi, pg, n, og); break;
      default: accumulate_v<KV, kD, 4>(s, table, vc, h, lo, hi, pg, n, og); break;
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    float* og = o + g * kD;
    const float f = inv_l[g] * Fp8Fast<KV>::kScale;
#pragma omp simd
    for (int64_t d = 0; d < kD; ++d) og[d] *= f;
  }
}
#endif
