// paged_decode.cc's fp8 path for AVX-512 (F, BW, VL; head_dim 16, 32, 64 or 128): a part of that
// file, included once inside its anonymous namespace after paged_decode_fp8_avx2.h, whose
// Fp8Fast scale it shares (every AVX-512BW CPU has AVX2 and F16C). kernels_cpu/build.py hashes
// it with the sources.
//
// Why a second fast path: on a Xeon with AVX-512 the AVX2 one was bound by instructions (fp8 K/V
// read at 4.1 GB/s where float32's reached 9.3, PERF_NOTES session 12): 8 floats a conversion,
// 3-uop hadds for every 8 scores, V re-read per 16 floats of the head, a scalar max and an 8-wide
// exp in the softmax. Here a byte row becomes floats 16 at a time (a sign-extending load, a
// shift, an and, vcvtph2ps), 16 keys' dot products are summed across lanes by one 45-instruction
// tree, a page's V sums for up to 4 query heads stay in registers, the softmax is 16 wide, and a
// work item may take all of a token's KV heads, reading each page as one block.

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__F16C__) && defined(__AVX2__)
#define JAXLM_FP8_AVX512 1  // attend_head takes attend_head_fp8_512
// 16 fp8 bytes -> 16 floats / kScale (as load_row_fp8, but in order and 16 wide). e4m3fn: the byte
// sign-extended to 16 bits and shifted left by 7 is S.S.EEEEMMM.0000000; clearing bit 14 leaves
// the f16 S.0EEEE.MMM0000000, the value times 2^-8 (subnormals too). e5m2 is an f16's high byte.
template <typename KV>
inline __m512 fp8x16_to_ps(const uint8_t* p) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  if constexpr (std::is_same_v<KV, E5M2>) return _mm512_cvtph_ps(_mm256_slli_epi16(_mm256_cvtepu8_epi16(b), 8));
  return _mm512_cvtph_ps(_mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(b), 7),
                                          _mm256_set1_epi16(int16_t(0xbfff))));
}

// Whether a row of kD e4m3fn bytes holds the NaN code S.1111.111 ((byte | 0x80) == 0xff).
template <int kD>
inline bool row_has_nan_e4m3(const uint8_t* p) {
  if constexpr (kD % 64 == 0) {
    __mmask64 m = 0;
    for (int i = 0; i < kD; i += 64) {
      const __m512i b = _mm512_loadu_si512(p + i);
      m |= _mm512_cmpeq_epi8_mask(_mm512_or_si512(b, _mm512_set1_epi8(char(0x80))), _mm512_set1_epi8(char(0xff)));
    }
    return m != 0;
  } else if constexpr (kD == 32) {
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm256_cmpeq_epi8_mask(_mm256_or_si256(b, _mm256_set1_epi8(char(0x80))), _mm256_set1_epi8(char(0xff)));
  } else {
    static_assert(kD == 16);
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm_cmpeq_epi8_mask(_mm_or_si128(b, _mm_set1_epi8(char(0x80))), _mm_set1_epi8(char(0xff)));
  }
}

// Row [kD] of fp8 -> v[kD / 16] as floats / kScale; a row with e4m3fn's NaN code goes through
// convert_row (exact, NaN and all), as in the AVX2 path.
template <typename KV, int kD>
inline void load_row_512(const KV* src, __m512* v) {
  const uint8_t* p = reinterpret_cast<const uint8_t*>(src);
  for (int i = 0; i < kD / 16; ++i) v[i] = fp8x16_to_ps<KV>(p + 16 * i);
  if constexpr (std::is_same_v<KV, E4M3>) {
    if (__builtin_expect(row_has_nan_e4m3<kD>(p), 0)) {
      alignas(64) float row[kD];
      convert_row(src, row, kD);
      const __m512 inv = _mm512_set1_ps(1.0f / Fp8Fast<KV>::kScale);
      for (int i = 0; i < kD / 16; ++i) v[i] = _mm512_mul_ps(_mm512_load_ps(row + 16 * i), inv);
    }
  }
}

// The rows of heads [h, h + hb) of the page kAhead512 pages on (the table may scatter pages, and
// the hardware's prefetchers stop at each 4 KiB). One head's rows are every Hkv * kD bytes; all
// heads' are the page's whole block.
constexpr int64_t kAhead512 = 2;

template <int kD, typename KV>
inline void prefetch_page_512(const Shape& s, const int32_t* table, const KV* base, int64_t h, int64_t hb,
                              int64_t first, int64_t hi) {
  const int64_t next = first + kAhead512 * s.BS;
  if (next >= hi) return;
  const int64_t row_len = s.Hkv * kD;
  const char* rows = reinterpret_cast<const char*>(
      base + std::clamp<int64_t>(table[next / s.BS], 0, s.NB - 1) * s.BS * row_len + h * kD);
  for (int64_t i = 0; i < s.BS; ++i)
    for (int64_t c = 0; c < hb * kD; c += 64) _mm_prefetch(rows + i * row_len + c, _MM_HINT_T0);
}

// Where key c (0-15) of a group of 16 goes in lane_sums16's input so that its sum lands in lane c.
inline int sum_slot(int64_t c) { return int(c >> 2) + 4 * int(c & 3); }

// The lane sums of v[0..15], v[sum_slot(c)] -> lane c. Four halvings: 256-bit halves, 128-bit
// lanes, then pairs and single floats within each 128-bit lane; each combines two vectors with
// two shuffles and an add.
inline __m512 lane_sums16(const __m512* v) {
  __m512 c[8], d[4], e[2];
  for (int k = 0; k < 8; ++k)  // c[k] = v[2k]'s 8 half sums, then v[2k+1]'s
    c[k] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], 0xee));
  for (int k = 0; k < 4; ++k)  // 128-bit lane i of d[k]: v[4k + i]'s 4 partial sums
    d[k] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * k], c[2 * k + 1], 0x88),
                         _mm512_shuffle_f32x4(c[2 * k], c[2 * k + 1], 0xdd));
  for (int k = 0; k < 2; ++k)  // lane i of e[k]: v[8k + i]'s 2 partial sums, then v[8k + 4 + i]'s
    e[k] = _mm512_add_ps(_mm512_shuffle_ps(d[2 * k], d[2 * k + 1], 0x44),
                         _mm512_shuffle_ps(d[2 * k], d[2 * k + 1], 0xee));
  // lane i: the sums of v[i], v[4 + i], v[8 + i], v[12 + i]
  return _mm512_add_ps(_mm512_shuffle_ps(e[0], e[1], 0x88), _mm512_shuffle_ps(e[0], e[1], 0xdd));
}

// o[g, :] += sum over keys j in [js, je) of p[g * n + j] * V[j] for kG heads (V as floats / kScale,
// row j at rows + j * row_len): a page's worth, the kG * kD / 16 sums in registers meanwhile.
template <typename KV, int kD, int kG>
void accumulate_v_512(const KV* rows, int64_t row_len, int64_t js, int64_t je, const float* p, int64_t n, float* o) {
  constexpr int kV = kD / 16;
  __m512 acc[kG][kV];
  for (int g = 0; g < kG; ++g)
    for (int i = 0; i < kV; ++i) acc[g][i] = _mm512_loadu_ps(o + g * kD + 16 * i);
  for (int64_t j = js; j < je; ++j) {
    __m512 v[kV];
    load_row_512<KV, kD>(rows + j * row_len, v);
    for (int g = 0; g < kG; ++g) {
      const __m512 pj = _mm512_set1_ps(p[g * n + j]);
      for (int i = 0; i < kV; ++i) acc[g][i] = _mm512_fmadd_ps(pj, v[i], acc[g][i]);
    }
  }
  for (int g = 0; g < kG; ++g)
    for (int i = 0; i < kV; ++i) _mm512_storeu_ps(o + g * kD + 16 * i, acc[g][i]);
}

// Query heads a V pass takes at once: their sums and a V row fit in the 32 registers.
template <int kD>
constexpr int64_t kVGroup = kD <= 64 ? 4 : 2;

// exp(x) for x <= 0 (scores minus their max), 16 at a time: x = n ln2 + r with |r| <= ln2 / 2,
// e^r by its Taylor series to r^7 (remainder below 1e-8 relative), times 2^n by vscalef. The
// compiler's vectorized expf was the AVX2 one (8 wide), and the max before it scalar: together
// a quarter of the kernel. Below -104 the result is 0 (also for -inf, which an e5m2 infinity in K
// can give); NaN stays NaN (the unordered compare keeps it).
inline __m512 exp_nonpositive(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);  // ln2's high bits: n * them is exact
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.0f / 5040);
  for (const float c : {1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f})
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(-104.0f), _CMP_NLT_UQ), _mm512_scalef_ps(p, n));
}

// softmax_rows with 16-wide max, exp and sum (the soft cap's tanh stays the compiler's).
inline void softmax_rows_512(float* sc, int64_t G, int64_t n, float cap, float* inv_l) {
  const __m512 lowest = _mm512_set1_ps(-3.0e38f);
  for (int64_t g = 0; g < G; ++g) {
    float* sg = sc + g * n;
    if (cap > 0.0f) {
#pragma omp simd
      for (int64_t x = 0; x < n; ++x) sg[x] = cap * std::tanh(sg[x] / cap);
    }
    __m512 m = lowest;
    int64_t x = 0;
    for (; x + 16 <= n; x += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(sg + x));
    const __mmask16 tail = __mmask16((1u << (n - x)) - 1);
    m = _mm512_max_ps(m, _mm512_mask_loadu_ps(lowest, tail, sg + x));
    const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(m));
    __m512 l = _mm512_setzero_ps();
    for (x = 0; x + 16 <= n; x += 16) {
      const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(sg + x), mx));
      _mm512_storeu_ps(sg + x, e);
      l = _mm512_add_ps(l, e);
    }
    const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, sg + x), mx));
    _mm512_mask_storeu_ps(sg + x, tail, e);
    l = _mm512_add_ps(l, _mm512_maskz_mov_ps(tail, e));
    inv_l[g] = 1.0f / _mm512_reduce_add_ps(l);
  }
}

// Scores sc[x * n + j - lo] of keys [lo, hi) for the hb * G query heads x of KV heads [h, h + hb)
// (q [hb * G, kD]), times kScale: each K row converted once; 16 keys' products per query head
// summed across lanes at once (part: [hb * G, 16] vectors).
template <typename KV, int kD>
void scores_512(const Shape& s, const int32_t* table, const KV* kc, int64_t h, int64_t hb, int64_t lo,
                int64_t hi, const float* q, float* sc, int64_t n, __m512* part) {
  constexpr int kV = kD / 16;
  const int64_t G = s.G, row_len = s.Hkv * kD;
  const __m512 kscale = _mm512_set1_ps(Fp8Fast<KV>::kScale);
  int64_t count = 0, j0 = lo;
  auto flush = [&] {
    for (int64_t x = 0; x < hb * G; ++x)  // lanes past count are not stored: their slots may hold anything
      _mm512_mask_storeu_ps(sc + x * n + (j0 - lo), __mmask16((1u << count) - 1),
                            _mm512_mul_ps(lane_sums16(part + x * 16), kscale));
  };
  for (int64_t first = lo - lo % s.BS; first < hi; first += s.BS) {
    const int64_t page = std::clamp<int64_t>(table[first / s.BS], 0, s.NB - 1);
    const KV* rows = kc + page * s.BS * row_len + h * kD;
    prefetch_page_512<kD>(s, table, kc, h, hb, first, hi);
    for (int64_t j = std::max(first, lo), je = std::min(first + s.BS, hi); j < je; ++j) {
      __m512* slot = part + sum_slot(count);
      for (int64_t hh = 0; hh < hb; ++hh) {
        __m512 k[kV];
        load_row_512<KV, kD>(rows + (j - first) * row_len + hh * kD, k);
        for (int64_t g = 0; g < G; ++g) {
          const float* qg = q + (hh * G + g) * kD;
          __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(qg), k[0]);
          for (int i = 1; i < kV; ++i) acc = _mm512_fmadd_ps(_mm512_loadu_ps(qg + 16 * i), k[i], acc);
          slot[(hh * G + g) * 16] = acc;
        }
      }
      if (++count == 16) {
        flush();
        count = 0;
        j0 = j + 1;
      }
    }
  }
  if (count) flush();
}

// Token t's attention for KV heads [h, h + a.hb) and their G query heads each. Several KV heads
// an item (heads_per_item, paged_decode.cc) read each page's K and V as one block (their rows
// interleave): 1.3x faster on the Xeon of PERF_NOTES session 12 than one head's rows every
// Hkv * D bytes.
template <typename KV, int kD>
void attend_head_fp8_512(const Args& a, int64_t t, int64_t h, std::vector<float>& scratch) {
  static_assert(kD == 16 || kD == 32 || kD == 64 || kD == 128);
  const Shape& s = a.s;
  const KV* kc = static_cast<const KV*>(a.cache);
  const KV* vc = kc + s.NB * s.BS * s.Hkv * s.D;
  const int64_t G = s.G, hb = a.hb, HG = hb * G, row_len = s.Hkv * kD;
  const int32_t* table = row_table(a, t);
  const int64_t hi = keys_end(a, t), lo = keys_begin(a, hi);
  const int64_t n = hi - lo;
  float* o = a.out + (t * s.Hkv + h) * G * kD;  // [HG, kD]
  std::fill(o, o + HG * kD, 0.0f);
  if (n <= 0) return;
  // Scores [HG, n], then each query head's products of 16 keys ([HG, 16] vectors, 64-byte aligned).
  scratch.resize(HG * n + HG * 16 * 16 + 16);
  float* sc = scratch.data();
  __m512* part = reinterpret_cast<__m512*>((reinterpret_cast<uintptr_t>(sc + HG * n) + 63) & ~uintptr_t(63));
  scores_512<KV, kD>(s, table, kc, h, hb, lo, hi, a.q + (t * s.Hkv + h) * G * kD, sc, n, part);
  float inv_l[HG];
  softmax_rows_512(sc, HG, n, a.cap, inv_l);
  // V a page at a time, for each KV head its query heads in groups of kVGroup.
  for (int64_t first = lo - lo % s.BS; first < hi; first += s.BS) {
    const int64_t page = std::clamp<int64_t>(table[first / s.BS], 0, s.NB - 1);
    const KV* rows = vc + page * s.BS * row_len + h * kD - first * row_len;  // key j's row: rows + j * row_len
    prefetch_page_512<kD>(s, table, vc, h, hb, first, hi);
    const int64_t js = std::max(first, lo), je = std::min(first + s.BS, hi);
    for (int64_t x = 0; x < HG;) {
      const int64_t hh = x / G, g = std::min<int64_t>(G - x % G, kVGroup<kD>);  // within head hh
      const KV* hr = rows + hh * kD;
      const float* p = sc + x * n - lo;
      float* ox = o + x * kD;
      switch (g) {
        case 1: accumulate_v_512<KV, kD, 1>(hr, row_len, js, je, p, n, ox); break;
        case 2: accumulate_v_512<KV, kD, 2>(hr, row_len, js, je, p, n, ox); break;
        case 3: if constexpr (kVGroup<kD> >= 3) accumulate_v_512<KV, kD, 3>(hr, row_len, js, je, p, n, ox); break;
        default: if constexpr (kVGroup<kD> >= 4) accumulate_v_512<KV, kD, 4>(hr, row_len, js, je, p, n, ox); break;
      }
      x += g;
    }
  }
  for (int64_t x = 0; x < HG; ++x) {
    const __m512 f = _mm512_set1_ps(inv_l[x] * Fp8Fast<KV>::kScale);
    for (float* ox = o + x * kD; ox < o + (x + 1) * kD; ox += 16)
      _mm512_storeu_ps(ox, _mm512_mul_ps(_mm512_loadu_ps(ox), f));
  }
}

#endif
