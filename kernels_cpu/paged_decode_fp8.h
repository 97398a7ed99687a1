// paged_decode.cc's fp8 formats and its portable fp8 path: a part of that file, included once
// inside its anonymous namespace after the helpers it uses (bits_f32, f32_bits, Shape, Args,
// row_table, keys_*, for_each_key, softmax_rows), before the AVX2 and AVX-512 paths, which
// use convert_row for rows holding e4m3fn's NaN code. kernels_cpu/build.py hashes it with the
// sources.

// fp8 elements, one byte each (kv_cache_dtype fp8 / fp8_e4m3, fp8_e5m2). Converted with integer
// operations the compiler vectorizes (no table lookups, no float subnormals: the kernel runs with
// denormals-are-zero, so a subnormal f32 built from the bits would read as 0).
struct E4M3 { uint8_t b; };
struct E5M2 { uint8_t b; };

// e4m3fn: 1 sign, 4 exponent bits (bias 7), 3 mantissa bits; no infinities; S.1111.111 is NaN.
inline float to_f32(E4M3 x) {
  const uint32_t em = x.b & 0x7fu, sign = uint32_t(x.b & 0x80u) << 24;
  // A normal number is its bits moved under the f32 exponent, rebiased by 127 - 7 = 120.
  uint32_t bits = (em << 20) + (120u << 23);
  bits = em < 8 ? f32_bits(float(em) * 0x1p-9f) : bits;  // subnormal: m * 2^-9
  bits = em == 0x7fu ? 0x7fc00000u : bits;
  return bits_f32(bits | sign);
}

// e5m2: 1 sign, 5 exponent bits (bias 15), 2 mantissa bits; exponent 31 is inf / NaN as in IEEE.
inline float to_f32(E5M2 x) {
  const uint32_t em = x.b & 0x7fu, sign = uint32_t(x.b & 0x80u) << 24;
  uint32_t bits = (em << 21) + (112u << 23);  // rebiased by 127 - 15 = 112
  bits = em < 4 ? f32_bits(float(em) * 0x1p-16f) : bits;  // subnormal: m * 2^-16
  bits = em >= 0x7cu ? (0x7f800000u | ((em & 3u) << 21)) : bits;
  return bits_f32(bits | sign);
}

template <typename KV>
constexpr bool kIsFp8 = std::is_same_v<KV, E4M3> || std::is_same_v<KV, E5M2>;

// A row of D fp8 values as floats. With F16C, 8 at a time through half precision: e5m2 is the
// high byte of an f16; e4m3fn's 7 value bits placed under an f16's exponent give the value times
// 2^-8 (subnormals included: vcvtph2ps converts f16 subnormals exactly, whatever DAZ says),
// and its one NaN code (S.1111.111) is put back by a compare.
template <typename KV>
inline void convert_row(const KV* src, float* dst, int64_t D) {
  int64_t d = 0;
#if defined(__F16C__) && defined(__AVX2__)
  const uint8_t* bytes = reinterpret_cast<const uint8_t*>(src);
  for (; d + 8 <= D; d += 8) {
    const __m128i w = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes + d)));
    if constexpr (std::is_same_v<KV, E5M2>) {
      _mm256_storeu_ps(dst + d, _mm256_cvtph_ps(_mm_slli_epi16(w, 8)));
    } else {
      const __m128i em = _mm_and_si128(w, _mm_set1_epi16(0x7f));
      const __m128i sign = _mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x80)), 8);
      __m256 f = _mm256_mul_ps(_mm256_cvtph_ps(_mm_or_si128(sign, _mm_slli_epi16(em, 7))), _mm256_set1_ps(256.0f));
      const __m256i nan = _mm256_cvtepi16_epi32(_mm_cmpeq_epi16(em, _mm_set1_epi16(0x7f)));
      f = _mm256_blendv_ps(f, _mm256_castsi256_ps(_mm256_set1_epi32(0x7fc00000)), _mm256_castsi256_ps(nan));
      _mm256_storeu_ps(dst + d, f);
    }
  }
#endif
  for (; d < D; ++d) dst[d] = to_f32(src[d]);
}

// Keys converted to float per chunk (fp8 caches): each element is converted once, not once per
// query head, and the chunk ([kChunk, D] floats) stays in L1 while the G heads read it.
constexpr int64_t kChunk = 32;

// Calls f(j0, rows, count) for chunks of up to kChunk keys of [lo, hi): their head-h values as
// float, row i of the chunk at rows + i * D.
template <typename KV, int kD, typename F>
inline void for_each_chunk(const Shape& s, const int32_t* table, const KV* base, int64_t h, int64_t lo, int64_t hi,
                           float* buf, F&& f) {
  const int64_t D = kD > 0 ? kD : s.D;
  int64_t count = 0, j0 = lo;
  for_each_key(s, table, base, lo, hi, [&](int64_t j, const KV* row) {
    convert_row(row + h * D, buf + count * D, D);
    if (++count == kChunk) {
      f(j0, buf, count);
      count = 0;
      j0 = j + 1;
    }
  });
  if (count) f(j0, buf, count);
}

// attend_head for an fp8 cache without a fast path (no AVX2 + F16C, or a head_dim without a
// specialised kernel): the same passes (scores, exact softmax, V) over float chunks.
template <typename KV, int kD>
void attend_head_fp8(const Args& a, int64_t t, int64_t h, std::vector<float>& scratch) {
  const Shape& s = a.s;
  const KV* kc = static_cast<const KV*>(a.cache);
  const KV* vc = kc + s.NB * s.BS * s.Hkv * s.D;
  const int64_t D = kD > 0 ? kD : s.D, G = s.G;
  const int32_t* table = row_table(a, t);
  const int64_t hi = keys_end(a, t), lo = keys_begin(a, hi);
  const int64_t n = hi - lo;
  float* o = a.out + (t * s.Hkv + h) * G * D;  // [G, D]
  std::fill(o, o + G * D, 0.0f);
  if (n <= 0) return;
  scratch.resize(G * n + kChunk * D);
  float* sc = scratch.data();  // [G, n]
  float* buf = sc + G * n;     // [kChunk, D]
  const float* q = a.q + (t * s.Hkv + h) * G * D;

  for_each_chunk<KV, kD>(s, table, kc, h, lo, hi, buf, [&](int64_t j0, const float* rows, int64_t count) {
    for (int64_t i = 0; i < count; ++i) {
      const float* k = rows + i * D;
      for (int64_t g = 0; g < G; ++g) {
        const float* qg = q + g * D;
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < D; ++d) dot += qg[d] * k[d];
        sc[g * n + (j0 + i - lo)] = dot;
      }
    }
  });
  float inv_l[G];
  softmax_rows(sc, G, n, a.cap, inv_l);
  for_each_chunk<KV, kD>(s, table, vc, h, lo, hi, buf, [&](int64_t j0, const float* rows, int64_t count) {
    for (int64_t g = 0; g < G; ++g) {
      float* og = o + g * D;
      float reg[kD > 0 ? kD : 1];
      float* acc = kD > 0 ? reg : og;
      if (kD > 0) std::copy(og, og + D, acc);
      const float* pg = sc + g * n + (j0 - lo);
      for (int64_t i = 0; i < count; ++i) {
        const float* v = rows + i * D;
        const float p = pg[i];
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) acc[d] += p * v[d];
      }
      if (kD > 0) std::copy(acc, acc + D, og);
    }
  });
  for (int64_t g = 0; g < G; ++g) {
    float* og = o + g * D;
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) og[d] *= inv_l[g];
  }
}
