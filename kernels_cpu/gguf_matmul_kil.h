// gguf_matmul.cc's integer path for the K-quants (Q4_K, Q5_K, Q6_K) below f32_min_rows: a part
// of that file, included once inside its anonymous namespace after gguf_kquants.h,
// gguf_matmul_lanes.h (kIL, the vector structs, lanes_dot) and gguf_matmul_il.h (kIlRows, its
// vector helpers). kernels_cpu/build.py hashes it.
//
// Weight rows in vector lanes, as gguf_matmul_il.h does for the 32-value types. The rows come
// interleaved 16 at a time (kernels_cpu/gguf_matmul.py: to_kernel_layout): for group g and
// super-block s one stretch of 16 * kil_row_bytes<T>() bytes, its fields each for the 16 rows:
//   Q4_K (148 bytes a row): d [16] f16, dmin [16] f16, sc [8][16] u8, m [8][16] u8, qs in 32
//     chunks of 64 bytes (chunk c: qs[4c .. 4c + 3] of each row in turn);
//   Q5_K (180): Q4_K's d, dmin, sc, m, then qh in 8 chunks, then qs in 32;
//   Q6_K (210, the file's size): d [16] f16, scales [16][16] i8, qh in 16 chunks, ql in 32.
// The 6-bit scales and mins of Q4_K / Q5_K are unpacked to a byte each at load (sub-block j's 16
// rows' sc are one 16-byte load and one conversion): 4 bytes more a row and super-block, +2.8% for
// Q4_K, +2.3% for Q5_K. Per block of 32 values of x (a Q4_K / Q5_K sub-block, two of Q6_K's)
// each row of x takes 8 dpbusd against 16 weight rows, then its scale work once for all 16.

template <int T>
constexpr int64_t kil_row_bytes() {  // bytes a row and super-block in the kernel layout
  return T == kQ4_K ? 148 : T == kQ5_K ? 180 : 210;
}
template <int T>
constexpr int64_t kil_block_bytes() {
  return kIL * kil_row_bytes<T>();
}
// Field offsets in a group's super-block.
constexpr int64_t kKilSc = 64, kKilM = 192, kKilQh5 = 320;     // Q4_K / Q5_K
constexpr int64_t kKil6Sc = 32, kKil6Qh = 288, kKil6Ql = 1312;  // Q6_K
template <int T>
constexpr int64_t kil_qs() {  // Q4_K / Q5_K's qs
  return T == kQ5_K ? kKilQh5 + 8 * 64 : kKilQh5;
}

// Row n's super-blocks back in the file's layout (the f32 path's dequantizer, the generic build).
template <int T>
void kil_row_blocks(const uint8_t* w, int64_t nsb, int64_t n, uint8_t* dst) {
  const int64_t g = n / kIL, l = n % kIL;
  auto chunks = [&](const uint8_t* src, int count, uint8_t* o) {
    for (int c = 0; c < count; ++c) std::memcpy(o + 4 * c, src + 64 * c + 4 * l, 4);
  };
  for (int64_t s = 0; s < nsb; ++s) {
    const uint8_t* p = w + (g * nsb + s) * kil_block_bytes<T>();
    uint8_t* o = dst + s * block_bytes<T>();
    if constexpr (T == kQ6_K) {
      chunks(p + kKil6Ql, 32, o);
      chunks(p + kKil6Qh, 16, o + 128);
      for (int j = 0; j < 16; ++j) o[192 + j] = p[kKil6Sc + 16 * j + l];
      std::memcpy(o + 208, p + 2 * l, 2);
    } else {
      std::memcpy(o, p + 2 * l, 2);
      std::memcpy(o + 2, p + 32 + 2 * l, 2);
      uint8_t sc[8], m[8];
      for (int j = 0; j < 8; ++j) sc[j] = p[kKilSc + 16 * j + l], m[j] = p[kKilM + 16 * j + l];
      for (int j = 0; j < 4; ++j) {  // scales_mins' packing (gguf_kquants.h)
        o[4 + j] = uint8_t(sc[j] | (sc[j + 4] >> 4) << 6);
        o[8 + j] = uint8_t(m[j] | (m[j + 4] >> 4) << 6);
        o[12 + j] = uint8_t((sc[j + 4] & 15) | (m[j + 4] & 15) << 4);
      }
      if constexpr (T == kQ5_K) chunks(p + kKilQh5, 8, o + 16);
      chunks(p + kil_qs<T>(), 32, o + block_bytes<T>() - 128);
    }
  }
}

#if defined(JAXLM_AVX2)
template <class V, int S>
inline typename V::I kil_shift16(typename V::I v) {  // 16-bit lanes shifted left by S (right if S < 0)
#if defined(JAXLM_LANES16)
  if constexpr (V::L == 16) {
    if constexpr (S >= 0) return _mm512_slli_epi16(v, S);
    else return _mm512_srli_epi16(v, -S);
  }
#endif
  if constexpr (V::L == 8) {
    if constexpr (S >= 0) return _mm256_slli_epi16(v, S);
    else return _mm256_srli_epi16(v, -S);
  }
}

template <class V>
inline typename V::I kil_mask(typename V::I v, char m) {
#if defined(JAXLM_LANES16)
  if constexpr (V::L == 16) return _mm512_and_si512(v, _mm512_set1_epi8(m));
#endif
  if constexpr (V::L == 8) return _mm256_and_si256(v, _mm256_set1_epi8(m));
}

template <class V>
inline typename V::I kil_or(typename V::I a, typename V::I b) {
#if defined(JAXLM_LANES16)
  if constexpr (V::L == 16) return _mm512_or_si512(a, b);
#endif
  if constexpr (V::L == 8) return _mm256_or_si256(a, b);
}

template <class V, bool Signed>
inline typename V::F kil_bytes_ps(const uint8_t* p) {  // V::L bytes -> f32 (a field's sc, m or scale)
#if defined(JAXLM_LANES16)
  if constexpr (V::L == 16) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm512_cvtepi32_ps(Signed ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b));
  }
#endif
  if constexpr (V::L == 8) {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    return _mm256_cvtepi32_ps(Signed ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b));
  }
}

// Chunk k of x block J of a super-block (values 32 J + 4k .. + 3) for the lanes' rows, as
// unsigned bytes: Q4_K's nibble, Q5_K's with its 5th bit, Q6_K's q + 32 (0 .. 63: maddubs' pair
// sums stay below 2^15).
template <int T, class V, int J>
inline typename V::I kil_vals(const uint8_t* p, int k, int h) {
  const int at = 4 * V::L * h;
  if constexpr (T == kQ6_K) {
    constexpr int half = J / 4, t = J % 4;
    const typename V::I ql = V::load(p + kKil6Ql + 64 * (16 * half + 8 * (t % 2) + k) + at);
    const typename V::I qh = V::load(p + kKil6Qh + 64 * (8 * half + k) + at);
    const typename V::I lo = t / 2 ? il_high4<V>(ql) : il_and15<V>(ql);
    return kil_or<V>(lo, kil_mask<V>(kil_shift16<V, 4 - 2 * t>(qh), 0x30));  // bits 2t, 2t + 1 -> 4, 5
  } else {
    const typename V::I q = V::load(p + kil_qs<T>() + 64 * (8 * (J / 2) + k) + at);
    const typename V::I v = J % 2 ? il_high4<V>(q) : il_and15<V>(q);
    if constexpr (T == kQ4_K) return v;
    const typename V::I qh = V::load(p + kKilQh5 + 64 * k + at);
    return kil_or<V>(v, kil_mask<V>(kil_shift16<V, 4 - J>(qh), 0x10));  // bit J -> 4
  }
}

template <class F, int... J>
inline void kil_unroll(F&& f, std::integer_sequence<int, J...>) {
  (f(std::integral_constant<int, J>{}), ...);
}

// out[m0 .. m0 + R, group g's rows] for R rows of x.
template <int T, class V, int R>
void kil_group(const uint8_t* w, int64_t nsb, const QuantizedX& qx, int64_t m0, int64_t K, float* out, int64_t N,
               int64_t g) {
  constexpr int H = kIL / V::L;
  const XRows<R> x(qx, m0, K);
  const int32_t* hs[R];  // sums of x per 16 values (Q6_K's q + 32 start at -32 of them)
  for (int r = 0; r < R; ++r) hs[r] = qx.hs.data() + (m0 + r) * (K / 16);
  typename V::F acc[R][H];
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < H; ++h) acc[r][h] = V::zerof();
  const uint8_t* gp = w + g * nsb * kil_block_bytes<T>();
  for (int64_t s = 0; s < nsb; ++s) {
    const uint8_t* p = gp + s * kil_block_bytes<T>();
    // One super-block ahead (2.4-3.4 KB, about what gguf_matmul_il.h's 4 blocks are).
    for (int64_t off = 0; off < kil_block_bytes<T>(); off += 64)
      _mm_prefetch(reinterpret_cast<const char*>(p + kil_block_bytes<T>() + off), _MM_HINT_T0);
    for (int h = 0; h < H; ++h) {
      const typename V::F d = il_cvtph<V>(p + 2 * V::L * h);
      typename V::F dmin = V::zerof();
      if constexpr (T != kQ6_K) dmin = il_cvtph<V>(p + 32 + 2 * V::L * h);
      kil_unroll([&](auto jc) {
        constexpr int J = decltype(jc)::value;
        const int64_t b = s * (kQK_K / kQK) + J;  // x's block
        typename V::I wv[8];
        for (int k = 0; k < 8; ++k) wv[k] = kil_vals<T, V, J>(p, k, h);
        if constexpr (T == kQ6_K) {
          const typename V::F d0 = V::mul(d, kil_bytes_ps<V, true>(p + kKil6Sc + 16 * (2 * J) + V::L * h));
          const typename V::F d1 = V::mul(d, kil_bytes_ps<V, true>(p + kKil6Sc + 16 * (2 * J + 1) + V::L * h));
          for (int r = 0; r < R; ++r) {
            const uint8_t* xb = reinterpret_cast<const uint8_t*>(x.q[r] + b * kQK);
            typename V::I s0 = V::set1i(-32 * hs[r][2 * b]), s1 = V::set1i(-32 * hs[r][2 * b + 1]);
            for (int k = 0; k < 4; ++k) {
              s0 = V::dot(s0, wv[k], V::bcast(xb + 4 * k));
              s1 = V::dot(s1, wv[4 + k], V::bcast(xb + 16 + 4 * k));
            }
            const typename V::F dx = V::set1(x.d[r][b]);
            acc[r][h] = V::fma(V::cvt(s0), V::mul(d0, dx), acc[r][h]);
            acc[r][h] = V::fma(V::cvt(s1), V::mul(d1, dx), acc[r][h]);
          }
        } else {
          const typename V::F dsc = V::mul(d, kil_bytes_ps<V, false>(p + kKilSc + 16 * J + V::L * h));
          const typename V::F dmn = V::mul(dmin, kil_bytes_ps<V, false>(p + kKilM + 16 * J + V::L * h));
          for (int r = 0; r < R; ++r) {
            const uint8_t* xb = reinterpret_cast<const uint8_t*>(x.q[r] + b * kQK);
            typename V::I s0 = V::zeroi(), s1 = V::zeroi();
            for (int k = 0; k < 8; k += 2) {
              s0 = V::dot(s0, wv[k], V::bcast(xb + 4 * k));
              s1 = V::dot(s1, wv[k + 1], V::bcast(xb + 4 * k + 4));
            }
            acc[r][h] = V::fma(V::cvt(il_add<V>(s0, s1)), V::mul(dsc, V::set1(x.d[r][b])), acc[r][h]);
            acc[r][h] = V::fma(dmn, V::set1(-x.ds[r][b]), acc[r][h]);
          }
        }
      }, std::make_integer_sequence<int, 8>{});
    }
  }
  const int64_t n0 = g * kIL, cols = std::min<int64_t>(kIL, N - n0);
  for (int r = 0; r < R; ++r) {
    alignas(64) float res[kIL];
    for (int h = 0; h < H; ++h) V::storef(res + h * V::L, acc[r][h]);
    std::copy(res, res + cols, out + (m0 + r) * N + n0);
  }
}

// A group's 16 weight rows unpacked for the many-rows path (gguf_matmul_lanes.h: lanes_dot):
// u [pass][block][8][kLaneCols][4] (kil_vals' bytes: a pass's kLaneCols rows' 4 bytes of chunk k
// of x block b, one after another; rows of both passes side by side ran ~15% slower), dw
// [block][halves][16] (d sc of the block, or of each Q6_K half), mw [block][16] (-dmin m).
template <int T, class V>
void kil_unpack(const uint8_t* gp, int64_t nsb, uint8_t* u, float* dw, float* mw) {
  constexpr int H = kIL / V::L;
  const int64_t nb = nsb * (kQK_K / kQK);
  for (int64_t s = 0; s < nsb; ++s) {
    const uint8_t* p = gp + s * kil_block_bytes<T>();
    for (int64_t off = 0; off < kil_block_bytes<T>(); off += 64)  // the next group's too, past the last
      _mm_prefetch(reinterpret_cast<const char*>(p + kil_block_bytes<T>() + off), _MM_HINT_T0);
    for (int h = 0; h < H; ++h) {
      const typename V::F d = il_cvtph<V>(p + 2 * V::L * h);
      kil_unroll([&](auto jc) {
        constexpr int J = decltype(jc)::value;
        const int64_t b = s * (kQK_K / kQK) + J;
        for (int k = 0; k < 8; ++k) {
          alignas(64) uint8_t v[4 * V::L];
          V::store(v, kil_vals<T, V, J>(p, k, h));
          for (int c = 0; c < V::L; c += kLaneCols)  // each pass's rows together (lanes_dot reads them)
            std::memcpy(u + ((V::L * h + c) / kLaneCols * nb + b) * 8 * 4 * kLaneCols + 4 * kLaneCols * k, v + 4 * c,
                        4 * kLaneCols);
        }
        if constexpr (T == kQ6_K) {
          for (int i = 0; i < 2; ++i)
            V::storef(dw + (2 * b + i) * kIL + V::L * h,
                      V::mul(d, kil_bytes_ps<V, true>(p + kKil6Sc + 16 * (2 * J + i) + V::L * h)));
        } else {
          const typename V::F dmin = il_cvtph<V>(p + 32 + 2 * V::L * h);
          V::storef(dw + b * kIL + V::L * h, V::mul(d, kil_bytes_ps<V, false>(p + kKilSc + 16 * J + V::L * h)));
          V::storef(mw + b * kIL + V::L * h,
                    V::mul(V::mul(dmin, V::set1(-1.0f)), kil_bytes_ps<V, false>(p + kKilM + 16 * J + V::L * h)));
        }
      }, std::make_integer_sequence<int, 8>{});
    }
  }
}

// out [M, N] for groups g0 .. g1 from x packed in lanes (pack_lanes): each group unpacked once,
// then kLaneCols of its rows at a time against every group of L rows of x.
template <int T, class V>
void kil_lanes_groups(const uint8_t* w, const LaneX& lx, int64_t M, int64_t K, int64_t N, int64_t g0, int64_t g1,
                      float* out) {
  constexpr int L = V::L;
  const int64_t nb = K / kQK, nsb = K / kQK_K;
  std::vector<uint8_t> u(nb * 8 * 64);
  std::vector<float> dw(nb * halves<T>() * kIL), mw(nb * kIL);
  alignas(64) float res[kLaneCols * L];
  for (int64_t g = g0; g < g1; ++g) {
    kil_unpack<T, V>(w + g * nsb * kil_block_bytes<T>(), nsb, u.data(), dw.data(), mw.data());
    for (int64_t c0 = 0; c0 < kIL && g * kIL + c0 < N; c0 += kLaneCols) {
      const int64_t n = g * kIL + c0, cols = std::min<int64_t>(kLaneCols, N - n);
      for (int64_t xg = 0; xg < lx.groups; ++xg) {
        const int64_t at = xg * nb * L;
        lanes_dot<T, V>(u.data() + c0 / kLaneCols * nb * 8 * 4 * kLaneCols, dw.data() + c0, mw.data() + c0, K, lx.q.data() + at * kQK,
                        lx.d.data() + at, lx.ds.data() + at, lx.init.data() + at * lx.H, res);
        const int64_t rows = std::min<int64_t>(L, M - xg * L);
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t c = 0; c < cols; ++c) out[(xg * L + r) * N + n + c] = res[c * L + r];
      }
    }
  }
}
#endif  // JAXLM_AVX2

// Groups g0 .. g1 against every row of x.
template <int T>
void kil_groups(const uint8_t* w, int64_t nsb, const QuantizedX& qx, int64_t M, int64_t K, float* out, int64_t N,
                int64_t g0, int64_t g1) {
#if defined(JAXLM_AVX2)
#if defined(JAXLM_LANES16)
  using V = Lanes16;
#else
  using V = Lanes8;
#endif
  for (int64_t g = g0; g < g1; ++g) {
    int64_t m = 0;
    for (; m + kIlRows <= M; m += kIlRows) kil_group<T, V, kIlRows>(w, nsb, qx, m, K, out, N, g);
    switch (M - m) {
      case 3: kil_group<T, V, 3>(w, nsb, qx, m, K, out, N, g); break;
      case 2: kil_group<T, V, 2>(w, nsb, qx, m, K, out, N, g); break;
      case 1: kil_group<T, V, 1>(w, nsb, qx, m, K, out, N, g); break;
      default: break;
    }
  }
#else
  // The generic build: each row's super-blocks back in the file's layout, then a row at a time.
  std::vector<uint8_t> row(nsb * block_bytes<T>());
  for (int64_t g = g0; g < g1; ++g)
    for (int64_t n = g * kIL; n < std::min<int64_t>(N, (g + 1) * kIL); ++n) {
      kil_row_blocks<T>(w, nsb, n, row.data());
      for (int64_t m = 0; m < M; ++m) out[m * N + n] = dot_row_k<T>(row.data(), nsb, qx, m, K);
    }
#endif
}
