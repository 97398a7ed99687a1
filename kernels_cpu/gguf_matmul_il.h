// gguf_matmul.cc's integer path for the 32-value types (Q4_0, Q4_1, Q8_0) below f32_min_rows: a
// part of that file, included once inside its anonymous namespace after the block types,
// QuantizedX, the AVX2 helpers and gguf_matmul_lanes.h (its vector structs). kernels_cpu/build.py
// hashes it with the sources.
//
// Weight rows in vector lanes. These types reach the kernel with their rows interleaved 16 at a
// time (the kernel layout, kernels_cpu/gguf_matmul.py: to_kernel_layout): for group g (weight rows
// 16g .. 16g + 15) and block b, one stretch of 16 * block bytes holds the 16 rows' f16 scales d
// [16] (then Q4_1's mins m [16]), then the values in chunks of 64 bytes: chunk j is 4 bytes of
// each row in turn, row l's at 4l (Q4_0 / Q4_1: qs[4j .. 4j + 3], whose low nibbles are values
// 4j .. 4j + 3 and high nibbles 16 + 4j ..; Q8_0: q[4j .. 4j + 3] + 128 as unsigned bytes). So one
// 64-byte load holds 4 bytes of 16 weight rows, 4 int8 of x are broadcast against it, and one
// dpbusd advances 16 rows' dot products with no horizontal sums; a block's scales are one
// conversion of 16 f16 and one FMA for the 16 rows. The row-at-a-time kernel this replaces spent a
// scale conversion, a broadcast, an FMA and a horizontal sum per row and block: ~3.2x the time
// for one row in one thread (SmolLM2's shapes, docs/PERF_NOTES.md, session 13). Rows of x take
// their turns against a group's block while it sits in L1, up to kIlRows at a time.

constexpr int kIlRows = 4;   // rows of x per pass over a group's block

template <int T>
constexpr bool interleaved() {
  return T == kQ4_0 || T == kQ4_1 || T == kQ8_0;
}
template <int T>
constexpr int il_scale_bytes() {  // d [16] f16, and Q4_1's m [16]
  return T == kQ4_1 ? 64 : 32;
}
template <int T>
constexpr int il_chunks() {  // 64-byte chunks of values a block
  return T == kQ8_0 ? 8 : 4;
}
template <int T>
constexpr int64_t il_block_bytes() {
  return kIL * block_bytes<T>();
}

// Row n's blocks in the file's layout (Q8_0's q back to signed), for the f32 path's dequantizer.
template <int T>
void il_row_blocks(const uint8_t* w, int64_t nb, int64_t n, uint8_t* dst) {
  const int64_t g = n / kIL, l = n % kIL;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* p = w + (g * nb + b) * il_block_bytes<T>();
    uint8_t* o = dst + b * block_bytes<T>();
    std::memcpy(o, p + 2 * l, 2);
    if constexpr (T == kQ4_1) std::memcpy(o + 2, p + 32 + 2 * l, 2);
    const int head = T == kQ4_1 ? 4 : 2;
    for (int j = 0; j < il_chunks<T>(); ++j) {
      const uint8_t* c = p + il_scale_bytes<T>() + 64 * j + 4 * l;
      for (int i = 0; i < 4; ++i) o[head + 4 * j + i] = T == kQ8_0 ? uint8_t(c[i] ^ 0x80) : c[i];
    }
  }
}

// The coefficient of d_x sum(q_x) in a block's product: Q4_1's m, Q4_0's -8 d (its nibbles are
// q + 8), Q8_0's -128 d (its bytes are q + 128).
template <int T>
inline float il_offset(float d, float m) {
  if constexpr (T == kQ4_1) return m;
  if constexpr (T == kQ4_0) return -8.0f * d;
  return -128.0f * d;
}

#if defined(JAXLM_AVX2)
template <class V>
inline typename V::F il_cvtph(const uint8_t* p) {  // V::L f16 -> f32
#if defined(JAXLM_LANES16)
  if constexpr (V::L == 16) return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#endif
  if constexpr (V::L == 8) return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

template <class V>
inline typename V::I il_and15(typename V::I v) {
#if defined(JAXLM_LANES16)
  if constexpr (V::L == 16) return _mm512_and_si512(v, _mm512_set1_epi8(0x0f));
#endif
  if constexpr (V::L == 8) return _mm256_and_si256(v, _mm256_set1_epi8(0x0f));
}

template <class V>
inline typename V::I il_high4(typename V::I v) {
#if defined(JAXLM_LANES16)
  if constexpr (V::L == 16) return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0f));
#endif
  if constexpr (V::L == 8) return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0f));
}

template <class V>
inline typename V::I il_add(typename V::I a, typename V::I b) {
#if defined(JAXLM_LANES16)
  if constexpr (V::L == 16) return _mm512_add_epi32(a, b);
#endif
  if constexpr (V::L == 8) return _mm256_add_epi32(a, b);
}

template <class V>
inline typename V::I il_flip(typename V::I v) {  // Q8_0's q + 128 back to q
  if constexpr (V::L == 8) return _mm256_xor_si256(v, _mm256_set1_epi8(char(0x80)));
  return v;
}

// out[m0 .. m0 + R, group g's rows] for R rows of x: the group's 16 rows are kIL / V::L vectors.
template <int T, class V, int R>
void il_group(const uint8_t* w, int64_t nb, const QuantizedX& qx, int64_t m0, int64_t K, float* out, int64_t N,
              int64_t g) {
  constexpr int H = kIL / V::L, C = il_chunks<T>();
  constexpr bool kSign = T == kQ8_0 && !V::kVnni;  // maddubs' 16-bit pair sums would saturate at q + 128
  const XRows<R> x(qx, m0, K);
  typename V::F acc[R][H];
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < H; ++h) acc[r][h] = V::zerof();
  const uint8_t* gp = w + g * nb * il_block_bytes<T>();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* p = gp + b * il_block_bytes<T>();
    // A decode step streams every weight once: the hardware prefetcher alone left the row path
    // at ~40% of the bandwidth (session 12); 4 blocks ahead measured best here.
    for (int64_t off = 0; off < il_block_bytes<T>(); off += 64)
      _mm_prefetch(reinterpret_cast<const char*>(p + 4 * il_block_bytes<T>() + off), _MM_HINT_T0);
    for (int h = 0; h < H; ++h) {
      typename V::I wv[2 * C];  // Q4: the low nibbles of chunk j at j, the high at C + j
      for (int j = 0; j < C; ++j) {
        const typename V::I q = V::load(p + il_scale_bytes<T>() + 64 * j + 4 * V::L * h);
        if constexpr (T == kQ8_0) {
          wv[j] = kSign ? il_flip<V>(q) : q;
        } else {
          wv[j] = il_and15<V>(q);
          wv[C + j] = il_high4<V>(q);
        }
      }
      const typename V::F d = il_cvtph<V>(p + 2 * V::L * h);
      typename V::F c;
      if constexpr (T == kQ4_1) c = il_cvtph<V>(p + 32 + 2 * V::L * h);
      if constexpr (T == kQ4_0) c = V::mul(d, V::set1(-8.0f));
      if constexpr (T == kQ8_0) c = V::mul(d, V::set1(-128.0f));
      for (int r = 0; r < R; ++r) {
        const uint8_t* xb = reinterpret_cast<const uint8_t*>(x.q[r] + b * kQK);
        typename V::I s0 = V::zeroi(), s1 = V::zeroi();
        for (int j = 0; j < C; ++j) {
          const typename V::I xv = V::bcast(xb + 4 * j);
          typename V::I& s = (j & 1) ? s1 : s0;
          if constexpr (kSign)
            s = V::dot(s, V::abs8(wv[j]), V::sign8(xv, wv[j]));
          else
            s = V::dot(s, wv[j], xv);
        }
        if constexpr (T != kQ8_0)
          for (int j = 0; j < C; ++j) {
            typename V::I& s = (j & 1) ? s0 : s1;
            s = V::dot(s, wv[C + j], V::bcast(xb + kQK / 2 + 4 * j));
          }
        acc[r][h] = V::fma(V::cvt(il_add<V>(s0, s1)), V::mul(d, V::set1(x.d[r][b])), acc[r][h]);
        if constexpr (!kSign) acc[r][h] = V::fma(c, V::set1(x.ds[r][b]), acc[r][h]);
      }
    }
  }
  const int64_t n0 = g * kIL, cols = std::min<int64_t>(kIL, N - n0);
  for (int r = 0; r < R; ++r) {
    float* o = out + (m0 + r) * N + n0;
    if (cols == kIL) {
      for (int h = 0; h < H; ++h) V::storef(o + h * V::L, acc[r][h]);
    } else {
      alignas(64) float res[kIL];
      for (int h = 0; h < H; ++h) V::storef(res + h * V::L, acc[r][h]);
      std::copy(res, res + cols, o);
    }
  }
}
#endif  // JAXLM_AVX2

// The same without vector instructions (the generic build).
template <int T>
void il_group_scalar(const uint8_t* w, int64_t nb, const QuantizedX& qx, int64_t m, int64_t K, float* out,
                     int64_t N, int64_t g) {
  const int8_t* xq = qx.q.data() + m * K;
  const float *xd = qx.d.data() + m * nb, *xds = qx.ds.data() + m * nb;
  const int64_t n0 = g * kIL, cols = std::min<int64_t>(kIL, N - n0);
  for (int64_t l = 0; l < cols; ++l) {
    float acc = 0.0f;
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* p = w + (g * nb + b) * il_block_bytes<T>();
      const float d = f16_to_f32(uint16_t(p[2 * l] | p[2 * l + 1] << 8));
      const float mn = T == kQ4_1 ? f16_to_f32(uint16_t(p[32 + 2 * l] | p[33 + 2 * l] << 8)) : 0.0f;
      const int8_t* xb = xq + b * kQK;
      int32_t s = 0;
      for (int j = 0; j < il_chunks<T>(); ++j) {
        const uint8_t* c = p + il_scale_bytes<T>() + 64 * j + 4 * l;
        for (int i = 0; i < 4; ++i) {
          if constexpr (T == kQ8_0) {
            s += int32_t(c[i]) * xb[4 * j + i];
          } else {
            s += int32_t(c[i] & 15) * xb[4 * j + i] + int32_t(c[i] >> 4) * xb[kQK / 2 + 4 * j + i];
          }
        }
      }
      acc += float(s) * d * xd[b] + il_offset<T>(d, mn) * xds[b];
    }
    out[m * N + n0 + l] = acc;
  }
}

// Groups g0 .. g1 against every row of x.
template <int T>
void il_groups(const uint8_t* w, int64_t nb, const QuantizedX& qx, int64_t M, int64_t K, float* out, int64_t N,
               int64_t g0, int64_t g1) {
  for (int64_t g = g0; g < g1; ++g) {
#if defined(JAXLM_AVX2)
#if defined(JAXLM_LANES16)
    using V = Lanes16;
#else
    using V = Lanes8;
#endif
    int64_t m = 0;
    for (; m + kIlRows <= M; m += kIlRows) il_group<T, V, kIlRows>(w, nb, qx, m, K, out, N, g);
    switch (M - m) {
      case 3: il_group<T, V, 3>(w, nb, qx, m, K, out, N, g); break;
      case 2: il_group<T, V, 2>(w, nb, qx, m, K, out, N, g); break;
      case 1: il_group<T, V, 1>(w, nb, qx, m, K, out, N, g); break;
      default: break;
    }
#else
    for (int64_t m = 0; m < M; ++m) il_group_scalar<T>(w, nb, qx, m, K, out, N, g);
#endif
  }
}
