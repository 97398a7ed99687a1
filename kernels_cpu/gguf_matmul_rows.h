// gguf_matmul.cc's integer path a row of x at a time: fewer than kLanesMinRows rows (the K-quants'
// in gguf_kquants.h's dot_row_k), and every few-rows product in the generic build. A
// part of that file, included once inside its anonymous namespace after the block types,
// QuantizedX, the AVX2 helpers and gguf_kquants.h. kernels_cpu/build.py hashes it with the sources.

// One block of weight row wrow: its scale (and Q4_1's min; Q4_0's -8 d) and its 32 values as
// bytes (nibbles unpacked; Q8_0's signed bytes).
template <int T>
inline void load_block(const uint8_t* wrow, int64_t b, float& dw, float& mw,
#if defined(JAXLM_AVX2)
                       __m256i& wv
#else
                       int* wv
#endif
) {
  mw = 0.0f;
  if constexpr (T == kQ8_0) {
    const auto* blk = reinterpret_cast<const BlockQ8_0*>(wrow) + b;
    dw = f16_to_f32(blk->d);
#if defined(JAXLM_AVX2)
    wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk->q));
#else
    for (int j = 0; j < kQK; ++j) wv[j] = blk->q[j];
#endif
  } else {
    const uint8_t* qs;
    if constexpr (T == kQ4_0) {
      const auto* blk = reinterpret_cast<const BlockQ4_0*>(wrow) + b;
      dw = f16_to_f32(blk->d), mw = -8.0f * dw, qs = blk->qs;
    } else {
      const auto* blk = reinterpret_cast<const BlockQ4_1*>(wrow) + b;
      dw = f16_to_f32(blk->d), mw = f16_to_f32(blk->m), qs = blk->qs;
    }
#if defined(JAXLM_AVX2)
    wv = nibbles(qs);
#else
    for (int j = 0; j < kQK / 2; ++j) wv[j] = qs[j] & 15, wv[j + 16] = qs[j] >> 4;
#endif
  }
}

// out[m0 + r, n0 + c] for R rows of x (R <= kRowsM) against C consecutive weight rows from n0:
// each weight block is unpacked once for the R rows of x, each block of x loaded once for the C
// weight rows, and the R * C accumulators are independent chains (one row of x against one
// weight row would wait on a single fused multiply-add chain every block).
template <int T, int R, int C>
void dot_rows(const uint8_t* w, int64_t row_bytes, int64_t nb, const QuantizedX& qx, int64_t m0, int64_t K,
              float* out, int64_t N, int64_t n0) {
  const int8_t* xq[R];
  const float *xd[R], *xds[R];
  for (int r = 0; r < R; ++r) {
    xq[r] = qx.q.data() + (m0 + r) * K;
    xd[r] = qx.d.data() + (m0 + r) * nb;
    xds[r] = qx.ds.data() + (m0 + r) * nb;
  }
  float off[R][C] = {};  // the Q4_0 / Q4_1 terms on sum(qx)
#if defined(JAXLM_AVX2)
  __m256 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
#else
  float acc[R][C] = {};
#endif
  for (int64_t b = 0; b < nb; ++b) {
    float dw[C], mw[C];
#if defined(JAXLM_AVX2)
    __m256i wv[C], wu[C];
    for (int c = 0; c < C; ++c) {
      // The next C rows' block at this offset: a stream that leaves L2 every call (the LM head,
      // a decode step's every weight) ran at ~40% of the bandwidth on hardware prefetch alone.
      _mm_prefetch(reinterpret_cast<const char*>(w + (n0 + C + c) * row_bytes) + b * block_bytes<T>(), _MM_HINT_T0);
      load_block<T>(w + (n0 + c) * row_bytes, b, dw[c], mw[c], wv[c]);
      // Q8_0's weights are signed: |w| against x with w's sign (llama.cpp's signed x signed).
      wu[c] = T == kQ8_0 ? _mm256_sign_epi8(wv[c], wv[c]) : wv[c];
    }
    for (int r = 0; r < R; ++r) {
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq[r] + b * kQK));
      const float xdb = xd[r][b];
      for (int c = 0; c < C; ++c) {
        const __m256i xs = T == kQ8_0 ? _mm256_sign_epi8(xv, wv[c]) : xv;
        const __m256 p = _mm256_cvtepi32_ps(dot_u8_i8(wu[c], xs));
        acc[r][c] = _mm256_fmadd_ps(p, _mm256_set1_ps(dw[c] * xdb), acc[r][c]);
        if constexpr (T != kQ8_0) off[r][c] += mw[c] * xds[r][b];
      }
    }
#else
    int wv[C][kQK];
    for (int c = 0; c < C; ++c) load_block<T>(w + (n0 + c) * row_bytes, b, dw[c], mw[c], wv[c]);
    for (int r = 0; r < R; ++r) {
      const int8_t* xb = xq[r] + b * kQK;
      for (int c = 0; c < C; ++c) {
        int s = 0;
        for (int j = 0; j < kQK; ++j) s += wv[c][j] * xb[j];
        acc[r][c] += float(s) * dw[c] * xd[r][b];
        if constexpr (T != kQ8_0) off[r][c] += mw[c] * xds[r][b];
      }
    }
#endif
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
#if defined(JAXLM_AVX2)
      out[(m0 + r) * N + n0 + c] = hsum(acc[r][c]) + off[r][c];
#else
      out[(m0 + r) * N + n0 + c] = acc[r][c] + off[r][c];
#endif
    }
}

// Weight rows n0 .. n1 for R rows of x from m0, kCols at a time.
constexpr int kCols = 4;

template <int T, int R>
void rows_against_tile(const uint8_t* w, int64_t row_bytes, int64_t nb, const QuantizedX& qx, int64_t m0,
                       int64_t K, float* out, int64_t N, int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + kCols <= n1; n += kCols) dot_rows<T, R, kCols>(w, row_bytes, nb, qx, m0, K, out, N, n);
  for (; n < n1; ++n) dot_rows<T, R, 1>(w, row_bytes, nb, qx, m0, K, out, N, n);
}

template <int T>
void matmul_tile(const uint8_t* w, int64_t row_bytes, const QuantizedX& qx, int64_t M, int64_t K, int64_t N,
                 int64_t n0, int64_t n1, float* out) {
  int64_t m = 0;
  if constexpr (is_kquant(T)) {
    for (; m + kRowsM <= M; m += kRowsM)
      for (int64_t n = n0; n < n1; ++n) dot_row_k<T, kRowsM>(w + n * row_bytes, K / kQK_K, qx, m, K, out, N, n);
    for (; m < M; ++m)
      for (int64_t n = n0; n < n1; ++n) dot_row_k<T, 1>(w + n * row_bytes, K / kQK_K, qx, m, K, out, N, n);
  } else {
    const int64_t nb = K / kQK;
    // Four rows of x against two weight rows at a time: 8 chains; fewer rows of x take four weight
    // rows each.
    for (; m + kRowsM <= M; m += kRowsM) {
      int64_t n = n0;
      for (; n + 2 <= n1; n += 2) dot_rows<T, kRowsM, 2>(w, row_bytes, nb, qx, m, K, out, N, n);
      for (; n < n1; ++n) dot_rows<T, kRowsM, 1>(w, row_bytes, nb, qx, m, K, out, N, n);
    }
    for (; m < M; ++m) rows_against_tile<T, 1>(w, row_bytes, nb, qx, m, K, out, N, n0, n1);
  }
}
