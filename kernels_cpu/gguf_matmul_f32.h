// gguf_matmul.cc's many-rows path (M >= f32_min_rows): a part of that file, included once inside
// its anonymous namespace, after the block types, gguf_kquants.h and gguf_matmul_il.h. kernels_cpu/build.py hashes
// it with the sources.

// ---- Many rows (prefill): a tile of kTileN weight rows dequantized once to f32, laid out [K][16]
// so its 16 output columns are two vectors, then rows of x (as given, not rounded) kRowsF at a
// time against it with 2 * kRowsF accumulators in registers; the tile (16 * K floats) stays in
// L1/L2 across all of x.
constexpr int kRowsF = 6;

template <int T>
void dequantize_row(const uint8_t* wrow, int64_t nb, float* out) {
  if constexpr (is_kquant(T)) {
    dequantize_row_k<T>(wrow, nb * kQK / kQK_K, out);
    return;
  }
  for (int64_t b = 0; b < nb; ++b) {
    float* o = out + b * kQK;
    if constexpr (T == kQ8_0) {
      const auto* blk = reinterpret_cast<const BlockQ8_0*>(wrow) + b;
      const float d = f16_to_f32(blk->d);
      for (int j = 0; j < kQK; ++j) o[j] = d * float(blk->q[j]);
    } else {
      const uint8_t* qs;
      float d, m;
      if constexpr (T == kQ4_0) {
        const auto* blk = reinterpret_cast<const BlockQ4_0*>(wrow) + b;
        qs = blk->qs, d = f16_to_f32(blk->d), m = -8.0f * d;
      } else {
        const auto* blk = reinterpret_cast<const BlockQ4_1*>(wrow) + b;
        qs = blk->qs, d = f16_to_f32(blk->d), m = f16_to_f32(blk->m);
      }
      for (int j = 0; j < kQK / 2; ++j) {
        o[j] = d * float(qs[j] & 15) + m;
        o[j + kQK / 2] = d * float(qs[j] >> 4) + m;
      }
    }
  }
}

// out[m0 .. m0 + R, n0 .. n0 + nt] from tile [K][16].
template <int R>
void tile_rows_f32(const float* x, int64_t K, const float* tile, float* out, int64_t N, int64_t m0, int64_t n0,
                   int64_t nt) {
  const float* xr = x + m0 * K;
#if defined(JAXLM_AVX2)
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const __m256 w0 = _mm256_loadu_ps(tile + k * 16), w1 = _mm256_loadu_ps(tile + k * 16 + 8);
    for (int r = 0; r < R; ++r) {
      const __m256 xb = _mm256_broadcast_ss(xr + r * K + k);
      acc[r][0] = _mm256_fmadd_ps(xb, w0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(xb, w1, acc[r][1]);
    }
  }
  alignas(32) float res[16];
  for (int r = 0; r < R; ++r) {
    _mm256_store_ps(res, acc[r][0]);
    _mm256_store_ps(res + 8, acc[r][1]);
    std::copy(res, res + nt, out + (m0 + r) * N + n0);
  }
#else
  float acc[R][16] = {};
  for (int64_t k = 0; k < K; ++k)
    for (int r = 0; r < R; ++r) {
      const float xv = xr[r * K + k];
      for (int j = 0; j < 16; ++j) acc[r][j] += xv * tile[k * 16 + j];
    }
  for (int r = 0; r < R; ++r) std::copy(acc[r], acc[r] + nt, out + (m0 + r) * N + n0);
#endif
}

template <int T>
void matmul_tile_f32(const uint8_t* w, int64_t row_bytes, const float* x, int64_t M, int64_t K, int64_t N,
                     int64_t n0, int64_t n1, float* out) {
  const int64_t nb = K / kQK;
  std::vector<float> row(K), tile(K * 16);
  std::vector<uint8_t> blocks(nb * block_bytes<T>());  // a row in the file's layout (more than a K-quant row needs)
  for (int64_t t0 = n0; t0 < n1; t0 += 16) {
    const int64_t nt = std::min<int64_t>(16, n1 - t0);
    std::fill(tile.begin(), tile.end(), 0.0f);
    for (int64_t j = 0; j < nt; ++j) {
      if constexpr (is_kquant(T)) {  // the row's blocks back in the file's layout
        kil_row_blocks<T>(w, K / kQK_K, t0 + j, blocks.data());
        dequantize_row<T>(blocks.data(), nb, row.data());
      } else if constexpr (interleaved<T>()) {
        il_row_blocks<T>(w, nb, t0 + j, blocks.data());
        dequantize_row<T>(blocks.data(), nb, row.data());
      } else {
        dequantize_row<T>(w + (t0 + j) * row_bytes, nb, row.data());
      }
      for (int64_t k = 0; k < K; ++k) tile[k * 16 + j] = row[k];
    }
    int64_t m = 0;
    for (; m + kRowsF <= M; m += kRowsF) tile_rows_f32<kRowsF>(x, K, tile.data(), out, N, m, t0, nt);
    for (; m < M; ++m) tile_rows_f32<1>(x, K, tile.data(), out, N, m, t0, nt);
  }
}
