// gguf_matmul.cc's vector structs (Lanes8, Lanes16: gguf_matmul_il.h and gguf_matmul_kil.h) and
// its K-quant path for many rows of x (kKilLanesFrom .. f32_min_rows - 1: prefill, wide batched
// decode): a part of that file, included once inside its anonymous namespace after the block
// types, QuantizedX and gguf_kquants.h. kernels_cpu/build.py hashes it.
//
// Rows of x in vector lanes. x is packed so one vector holds 4 consecutive int8 of L rows
// ([block][k/4][row][4]); a weight row's 4 bytes are broadcast against it, so one dpbusd does 4 k
// of L rows and its lane r is row r's dot product, finished after the block's 8 steps: no
// horizontal sums, and the block's scale work (d_w d_x, the min's d_x sum(q_x)) is one vector op
// per weight row for all L rows. A group of 16 weight rows is unpacked once from the kernel
// layout (gguf_matmul_kil.h: kil_unpack; nibbles to bytes, scales to float, each 64-byte chunk
// keeping its 4 bytes of each row in turn, which is what the broadcasts read) and reused by every
// group of L rows. From 32 rows this measured 0.95-1.35x the speed of the weight-rows-in-lanes
// kernel, which unpacks the weights again for every 4 rows of x (at 8 rows 1.3-1.6x slower than
// it; docs/PERF_NOTES.md, session 14).
// Q6_K: a block of x is two sub-blocks of 16 with their own int8 scales, so a block is two
// integer sums of 4 steps each (halves), each with its d * scale and its start -32 sum(q_x of the
// half); its q is kept unsigned (0 .. 63, so maddubs' pair sums, <= 2 * 63 * 127, cannot saturate).

constexpr int64_t kIL = 16;  // weight rows interleaved per group (the kernel layout)

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
  static void store(void* p, I v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v); }
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
  static I set1i(int32_t v) { return _mm256_set1_epi32(v); }
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
  static void store(void* p, I v) { _mm512_storeu_si512(p, v); }
  static I bcast(const uint8_t* p) {
    int32_t v;
    std::memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
  }
  static I dot(I acc, I u, I s) { return _mm512_dpbusd_epi32(acc, u, s); }
  static I abs8(I v) { return _mm512_abs_epi8(v); }
  static I sign8(I x, I) { return x; }  // never called: kVnni
  static I zeroi() { return _mm512_setzero_si512(); }
  static I set1i(int32_t v) { return _mm512_set1_epi32(v); }
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

// res [kLaneCols][L]: a pass of kLaneCols weight rows unpacked by kil_unpack (u: chunk k4 of
// block b at (8 b + k4) * 4 kLaneCols, row c's 4 bytes at 4 c; dw [block][halves][kIL], mw
// [block][kIL], from the pass's first row) against one group of L rows of x.
template <int T, class V>
void lanes_dot(const uint8_t* u, const float* dw, const float* mw, int64_t K, const int8_t* xq, const float* xd,
               const float* xds, const int32_t* xinit, float* res) {
  constexpr int L = V::L, H = halves<T>(), steps = kQK / 4 / H;  // dpbusd steps per integer sum
  const int64_t nb = K / kQK;
  typename V::F facc[kLaneCols];
  for (int c = 0; c < kLaneCols; ++c) facc[c] = V::zerof();
  for (int64_t b = 0; b < nb; ++b) {
    const int8_t* xb = xq + b * kQK * L;
    const uint8_t* ub = u + b * 8 * 4 * kLaneCols;
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
          iacc[c] = V::dot(iacc[c], V::bcast(ub + 4 * kLaneCols * k4 + 4 * c), xv);
        }
      }
      const typename V::F dx = V::loadf(xd + b * L);
      for (int c = 0; c < kLaneCols; ++c)
        facc[c] = V::fma(V::cvt(iacc[c]), V::mul(V::set1(dw[(b * H + h) * kIL + c]), dx), facc[c]);
    }
    if constexpr (has_min<T>()) {
      const typename V::F dsx = V::loadf(xds + b * L);
      for (int c = 0; c < kLaneCols; ++c) facc[c] = V::fma(V::set1(mw[b * kIL + c]), dsx, facc[c]);
    }
  }
  for (int c = 0; c < kLaneCols; ++c) V::storef(res + c * L, facc[c]);
}

#endif  // JAXLM_AVX2
