// gguf_matmul.cc's integer path for the K-quants at several rows of x (kLanesMinRows ..
// f32_min_rows - 1: batched decode, prefill): a part of that file, included once inside its
// anonymous namespace after the block types, QuantizedX, nibbles and gguf_kquants.h. Its vector
// structs (Lanes8, Lanes16) serve gguf_matmul_il.h too. kernels_cpu/build.py hashes it.
//
// Rows of x in vector lanes. A row-at-a-time kernel spends, per 32 multiply-adds of one block, a
// dot product, a conversion, a scalar scale product and broadcast, an FMA and a horizontal sum at
// the end: ~6 instructions per 32 MACs, which at 16 rows ran no faster than XLA's f32 dot (the
// 32-value types' interleaved layout, gguf_matmul_il.h, avoids the same cost by putting weight
// rows in the lanes instead). Here x is packed so one vector holds 4 consecutive int8 of L rows ([block][k/4]
// [row][4]); a weight row's 4 bytes are broadcast against it, so one dpbusd does 4 k of L rows
// and its lane r is row r's dot product, finished after the block's 8 steps: no horizontal sums,
// and the block's scale work (d_w d_x, the min's d_x sum(q_x)) is one vector op per weight row
// for all L rows. The weight rows are unpacked once per tile of kLaneCols rows (nibbles to bytes,
// scales to float) and reused by every group of L rows.
// Q6_K: a block of x is two sub-blocks of 16 with their own int8 scales, so a block is two
// integer sums of 4 steps each (halves), each with its d * scale and its start -32 sum(q_x of the
// half); its q is kept unsigned (0 .. 63, so maddubs' pair sums, <= 2 * 63 * 127, cannot saturate).

#if defined(JAXLM_AVX2)

struct Lanes8 {  // 8 rows of x, 256-bit vectors
  static constexpr int L = 8;
  using I = __m256i;
  using F = __m256;
#if defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__))
  static constexpr bool kVnni = true;
#else
  static constexpr bool kVnni = false;
#endif
  static I load(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static I bcast(const uint8_t* p) {
    int32_t v;
    std::memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
  }
  static I dot(I acc, I u, I s) {
#if defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(acc, u, s);
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(acc, u, s);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
  }
  static I abs8(I v) { return _mm256_abs_epi8(v); }
  static I sign8(I x, I w) { return _mm256_sign_epi8(x, w); }
  static I zeroi() { return _mm256_setzero_si256(); }
  static F zerof() { return _mm256_setzero_ps(); }
  static F loadf(const float* p) { return _mm256_loadu_ps(p); }
  static F set1(float v) { return _mm256_set1_ps(v); }
  static F cvt(I v) { return _mm256_cvtepi32_ps(v); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static void storef(float* p, F v) { _mm256_storeu_ps(p, v); }
};

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define JAXLM_LANES16 1
struct Lanes16 {  // 16 rows of x, 512-bit vectors: one dpbusd is 64 MACs
  static constexpr int L = 16;
  using I = __m512i;
  using F = __m512;
  static constexpr bool kVnni = true;
  static I load(const void* p) { return _mm512_loadu_si512(p); }
  static I bcast(const uint8_t* p) {
    int32_t v;
    std::memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
  }
  static I dot(I acc, I u, I s) { return _mm512_dpbusd_epi32(acc, u, s); }
  static I abs8(I v) { return _mm512_abs_epi8(v); }
  static I sign8(I x, I) { return x; }  // never called: kVnni
  static I zeroi() { return _mm512_setzero_si512(); }
  static F zerof() { return _mm512_setzero_ps(); }
  static F loadf(const float* p) { return _mm512_loadu_ps(p); }
  static F set1(float v) { return _mm512_set1_ps(v); }
  static F cvt(I v) { return _mm512_cvtepi32_ps(v); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static void storef(float* p, F v) { _mm512_storeu_ps(p, v); }
};
#endif

// Weight rows per pass: kLaneCols integer and kLaneCols float accumulators, independent chains enough to
// cover dpbusd's latency; AVX2 alone has 16 vector registers, so half as many there.
#if defined(__AVX512F__)
constexpr int kLaneCols = 8;
#else
constexpr int kLaneCols = 4;
#endif

template <int T>
constexpr bool has_min() {  // a float offset per block: Q4_K / Q5_K's -dmin * m
  return T == kQ4_K || T == kQ5_K;
}
template <int T, class V>
constexpr int32_t int_bias() {  // w = d (u - bias) with u the unpacked unsigned byte: Q6_K's q + 32
  return T == kQ6_K ? 32 : 0;
}
template <int T>
constexpr int halves() {  // integer sums per block of x, each with its own scale: Q6_K's 2 sub-blocks
  return T == kQ6_K ? 2 : 1;
}

// x for the lanes path: groups of L rows (the last padded with zero rows).
struct LaneX {
  int64_t groups = 0;
  int H = 1;                    // halves<T>(): 1 or 2
  std::vector<int8_t> q;        // [group][block][k/4][L][4]
  std::vector<float> d, ds;     // [group][block][L]: d_x, d_x sum(q_x)
  std::vector<int32_t> init;    // [group][block][H][L]: -bias sum(q_x) over the block (H = 1) or its half
};

void size_lanes(int64_t M, int64_t K, int L, int H, LaneX& lx) {
  const int64_t nb = K / kQK;
  lx.groups = (M + L - 1) / L;
  lx.H = H;
  lx.q.assign(lx.groups * nb * kQK * L, 0);
  lx.d.assign(lx.groups * nb * L, 0.0f);
  lx.ds.assign(lx.groups * nb * L, 0.0f);
  lx.init.assign(lx.groups * nb * H * L, 0);
}

// Groups g0 .. g1 of x (sized by size_lanes) from its rows rounded a row at a time.
void pack_lanes(const QuantizedX& qx, int64_t M, int64_t K, int L, int32_t bias, int64_t g0, int64_t g1, LaneX& lx) {
  const int64_t nb = K / kQK;
  for (int64_t m = g0 * L; m < std::min(M, g1 * L); ++m) {
    const int64_t g = m / L, r = m % L;
    for (int64_t b = 0; b < nb; ++b) {
      const int8_t* src = qx.q.data() + m * K + b * kQK;
      int8_t* dst = lx.q.data() + (g * nb + b) * kQK * L + r * 4;
      for (int k4 = 0; k4 < kQK / 4; ++k4) std::memcpy(dst + k4 * 4 * L, src + 4 * k4, 4);
      int32_t s0 = 0, s1 = 0;  // fixed bounds (vectorized: a runtime bound here cost Q8_0 ~4% at 64 rows)
      for (int j = 0; j < kQK / 2; ++j) s0 += src[j], s1 += src[j + kQK / 2];
      if (lx.H == 1) {
        lx.init[(g * nb + b) * L + r] = -bias * (s0 + s1);
      } else {
        lx.init[((g * nb + b) * 2) * L + r] = -bias * s0;
        lx.init[((g * nb + b) * 2 + 1) * L + r] = -bias * s1;
      }
      const int64_t at = (g * nb + b) * L + r;
      lx.d[at] = qx.d[m * nb + b];
      lx.ds[at] = qx.ds[m * nb + b];
    }
  }
}

// kLaneCols weight rows from n (rows at or past n1 zero) as unsigned bytes u [kLaneCols][K] and per block
// of 32 their scales dw [block][halves][kLaneCols] and float offset mw [block][kLaneCols].
template <int T, class V>
void unpack_cols(const uint8_t* w, int64_t row_bytes, int64_t K, int64_t n, int64_t n1, uint8_t* u, float* dw,
                 float* mw) {
  const int64_t nb = K / kQK;
  constexpr int H = halves<T>();
  for (int c = 0; c < kLaneCols; ++c) {
    uint8_t* uc = u + c * K;
    if (n + c >= n1) {
      std::memset(uc, 0, K);
      for (int64_t b = 0; b < nb; ++b) {
        mw[b * kLaneCols + c] = 0.0f;
        for (int h = 0; h < H; ++h) dw[(b * H + h) * kLaneCols + c] = 0.0f;
      }
      continue;
    }
    const uint8_t* wrow = w + (n + c) * row_bytes;
    // The next tile's row c: W streams from memory for the LM head (as in the row path).
    for (int64_t at = 0; at < row_bytes; at += 64)
      _mm_prefetch(reinterpret_cast<const char*>(wrow + kLaneCols * row_bytes + at), _MM_HINT_T0);
    if constexpr (T == kQ6_K) {  // block b of a super-block: sub-blocks 2b, 2b + 1
      float dsc[16];
      for (int64_t s = 0; s < K / kQK_K; ++s) {
        const BlockQ6_K& blk = reinterpret_cast<const BlockQ6_K*>(wrow)[s];
        scales6(blk, dsc);
        for (int j = 0; j < 8; ++j) {
          const int64_t b = s * 8 + j;
          const __m256i q = _mm256_add_epi8(kquant_bytes<T>(blk, j), _mm256_set1_epi8(32));  // 0 .. 63
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(uc + b * kQK), q);
          dw[(b * 2) * kLaneCols + c] = dsc[2 * j], dw[(b * 2 + 1) * kLaneCols + c] = dsc[2 * j + 1];
          mw[b * kLaneCols + c] = 0.0f;
        }
      }
    } else if constexpr (is_kquant(T)) {  // Q4_K / Q5_K: a sub-block of 32 is a block here
      using B = typename KBlock<T>::type;
      float dsc[16], dmn[8];
      for (int64_t s = 0; s < K / kQK_K; ++s) {
        const B& blk = reinterpret_cast<const B*>(wrow)[s];
        scales_mins(blk, dsc, dmn);
        for (int j = 0; j < 8; ++j) {
          const int64_t b = s * 8 + j;
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(uc + b * kQK), kquant_bytes<T>(blk, j));
          dw[b * kLaneCols + c] = dsc[j], mw[b * kLaneCols + c] = -dmn[j];
        }
      }
    }
  }
}

// res [kLaneCols][L]: the unpacked weight rows against one group of L rows of x.
template <int T, class V>
void lanes_dot(const uint8_t* u, const float* dw, const float* mw, int64_t K, const int8_t* xq, const float* xd,
               const float* xds, const int32_t* xinit, float* res) {
  constexpr int L = V::L, H = halves<T>(), steps = kQK / 4 / H;  // dpbusd steps per integer sum
  const int64_t nb = K / kQK;
  typename V::F facc[kLaneCols];
  for (int c = 0; c < kLaneCols; ++c) facc[c] = V::zerof();
  for (int64_t b = 0; b < nb; ++b) {
    const int8_t* xb = xq + b * kQK * L;
    const uint8_t* ub = u + b * kQK;
    // Unrolled: GCC otherwise left Q6_K's halves as loops (k4 bounds not constant, x spilled).
#pragma GCC unroll 2
    for (int h = 0; h < H; ++h) {
      typename V::I iacc[kLaneCols];
      const typename V::I start = int_bias<T, V>() != 0 ? V::load(xinit + (b * H + h) * L) : V::zeroi();
      for (int c = 0; c < kLaneCols; ++c) iacc[c] = start;
#pragma GCC unroll 8
      for (int k4 = h * steps; k4 < (h + 1) * steps; ++k4) {
        const typename V::I xv = V::load(xb + k4 * 4 * L);
        for (int c = 0; c < kLaneCols; ++c) {
          iacc[c] = V::dot(iacc[c], V::bcast(ub + c * K + 4 * k4), xv);
        }
      }
      const typename V::F dx = V::loadf(xd + b * L);
      for (int c = 0; c < kLaneCols; ++c)
        facc[c] = V::fma(V::cvt(iacc[c]), V::mul(V::set1(dw[(b * H + h) * kLaneCols + c]), dx), facc[c]);
    }
    if constexpr (has_min<T>()) {
      const typename V::F dsx = V::loadf(xds + b * L);
      for (int c = 0; c < kLaneCols; ++c) facc[c] = V::fma(V::set1(mw[b * kLaneCols + c]), dsx, facc[c]);
    }
  }
  for (int c = 0; c < kLaneCols; ++c) V::storef(res + c * L, facc[c]);
}

template <int T>
constexpr bool has_lanes() {  // the 32-value types have their own (gguf_matmul_il.h)
  return is_kquant(T);
}

// out [M, N] columns n0 .. n1: kLaneCols weight rows at a time, unpacked once, against every group.
template <int T, class V>
void lanes_tile(const uint8_t* w, int64_t row_bytes, const LaneX& lx, int64_t M, int64_t K, int64_t N, int64_t n0,
                int64_t n1, float* out) {
  constexpr int L = V::L;
  const int64_t nb = K / kQK;
  std::vector<uint8_t> u(kLaneCols * K);
  std::vector<float> dw(nb * halves<T>() * kLaneCols), mw(nb * kLaneCols);
  alignas(64) float res[kLaneCols * L];
  for (int64_t n = n0; n < n1; n += kLaneCols) {
    unpack_cols<T, V>(w, row_bytes, K, n, n1, u.data(), dw.data(), mw.data());
    for (int64_t g = 0; g < lx.groups; ++g) {
      const int64_t at = g * nb * L;
      lanes_dot<T, V>(u.data(), dw.data(), mw.data(), K, lx.q.data() + at * kQK, lx.d.data() + at,
                      lx.ds.data() + at, lx.init.data() + at * lx.H, res);
      const int64_t rows = std::min<int64_t>(L, M - g * L), cols = std::min<int64_t>(kLaneCols, n1 - n);
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = 0; c < cols; ++c) out[(g * L + r) * N + n + c] = res[c * L + r];
    }
  }
}

#endif  // JAXLM_AVX2
