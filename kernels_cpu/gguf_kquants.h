// gguf_matmul.cc's K-quants (super-blocks of 256 values): a part of that file, included once
// inside its anonymous namespace, after the helpers it uses (kQK, QuantizedX, f16_to_f32).
// kernels_cpu/build.py hashes it with the sources. The vector kernels read the kernel layout
// (rows interleaved by 16, gguf_matmul_kil.h); what is here reads the file's blocks.
//
// llama.cpp's byte layouts, w for each value:
//   Q4_K (type 12, 144 bytes): f16 d, f16 dmin, uint8 scales[12], uint8 qs[128]. 8 sub-blocks
//     of 32, each with a 6-bit scale sc and min m packed into scales[12] (scales_mins below):
//     w = d * sc * q - dmin * m; q of sub-block j is the low (j even) or high (j odd) nibble of
//     qs[32 (j / 2) + l].
//   Q5_K (type 13, 176 bytes): Q4_K with uint8 qh[32] before qs: bit j of qh[l] is q's 5th bit
//     for value l of sub-block j.
//   Q6_K (type 14, 210 bytes): uint8 ql[128], uint8 qh[64], int8 scales[16], f16 d. 16
//     sub-blocks of 16, each with an int8 scale: w = d * scale * (q - 32); value 128 h + 32 t + l
//     (h < 2, t < 4, l < 32) has q's low 4 bits in ql[64 h + 32 (t % 2) + l] >> 4 (t / 2) and its
//     high 2 in qh[32 h + l] >> 2 t.
// x keeps its rounding to int8 per block of 32 (as for the 32-value types: one rounding of x per
// call serves every type, and a scale per 32 values is closer to x than llama.cpp's Q8_K scale
// per 256). A block of x is one Q4_K/Q5_K sub-block, so its product is one integer dot product
// times d * sc * d_x (less dmin * m * d_x * sum(q_x)); it is two Q6_K sub-blocks of 16, two
// integer sums with their own scales.

constexpr int kQK_K = 256;  // values per K-quant super-block

enum KQType : int32_t { kQ4_K = 12, kQ5_K = 13, kQ6_K = 14 };

constexpr bool is_kquant(int t) { return t == kQ4_K || t == kQ5_K || t == kQ6_K; }

#pragma pack(push, 1)
struct BlockQ4_K {
  uint16_t d, dmin;
  uint8_t scales[12], qs[kQK_K / 2];
};
struct BlockQ5_K {
  uint16_t d, dmin;
  uint8_t scales[12], qh[kQK_K / 8], qs[kQK_K / 2];
};
struct BlockQ6_K {
  uint8_t ql[kQK_K / 2], qh[kQK_K / 4];
  int8_t scales[kQK_K / 16];
  uint16_t d;
};
#pragma pack(pop)
static_assert(sizeof(BlockQ4_K) == 144 && sizeof(BlockQ5_K) == 176 && sizeof(BlockQ6_K) == 210,
              "ggml K-quant block sizes");

template <int T>
struct KBlock;
template <>
struct KBlock<kQ4_K> {
  using type = BlockQ4_K;
};
template <>
struct KBlock<kQ5_K> {
  using type = BlockQ5_K;
};
template <>
struct KBlock<kQ6_K> {
  using type = BlockQ6_K;
};

// Q4_K / Q5_K: the 8 sub-blocks' d * sc and dmin * m. scales[12] holds sc and m of sub-blocks
// 0-3 in the low 6 bits of bytes 0-3 and 4-7; those of 4-7 have their low 4 bits in bytes 8-11
// (sc low nibble, m high) and their top 2 bits in the top bits of bytes 0-3 (sc) and 4-7 (m).
template <typename B>
inline void scales_mins(const B& blk, float* dsc, float* dmn) {
  const float d = f16_to_f32(blk.d), dmin = f16_to_f32(blk.dmin);
  const uint8_t* s = blk.scales;
  for (int j = 0; j < 4; ++j) {
    dsc[j] = d * float(s[j] & 63);
    dmn[j] = dmin * float(s[j + 4] & 63);
    dsc[j + 4] = d * float((s[j + 8] & 15) | ((s[j] >> 6) << 4));
    dmn[j + 4] = dmin * float((s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4));
  }
}

// Q6_K: the 16 sub-blocks' d * scale.
inline void scales6(const BlockQ6_K& blk, float* dsc) {
  const float d = f16_to_f32(blk.d);
  for (int j = 0; j < kQK_K / 16; ++j) dsc[j] = d * float(blk.scales[j]);
}

// A super-block's 256 q as ints (Q6_K's with the 32 taken off: -32 .. 31).
template <int T>
inline void unpack_k(const typename KBlock<T>::type& blk, int* q) {
  if constexpr (T == kQ6_K) {
    for (int h = 0; h < 2; ++h)
      for (int t = 0; t < 4; ++t)
        for (int l = 0; l < 32; ++l) {
          const int lo = (blk.ql[64 * h + 32 * (t & 1) + l] >> (4 * (t >> 1))) & 15;
          const int hi = (blk.qh[32 * h + l] >> (2 * t)) & 3;
          q[128 * h + 32 * t + l] = (lo | (hi << 4)) - 32;
        }
  } else {
    for (int j = 0; j < 8; ++j)
      for (int l = 0; l < 32; ++l) {
        int v = (blk.qs[32 * (j >> 1) + l] >> (4 * (j & 1))) & 15;
        if constexpr (T == kQ5_K) v |= ((blk.qh[l] >> j) & 1) << 4;
        q[32 * j + l] = v;
      }
  }
}

// A row of nsb super-blocks -> 256 nsb floats (the many-rows path's tiles).
template <int T>
void dequantize_row_k(const uint8_t* wrow, int64_t nsb, float* out) {
  using B = typename KBlock<T>::type;
  int q[kQK_K];
  float dsc[16], dmn[8];
  for (int64_t s = 0; s < nsb; ++s) {
    const B& blk = reinterpret_cast<const B*>(wrow)[s];
    unpack_k<T>(blk, q);
    float* o = out + s * kQK_K;
    if constexpr (T == kQ6_K) {
      scales6(blk, dsc);
      for (int i = 0; i < kQK_K; ++i) o[i] = dsc[i / 16] * float(q[i]);
    } else {
      scales_mins(blk, dsc, dmn);
      for (int i = 0; i < kQK_K; ++i) o[i] = dsc[i / 32] * float(q[i]) - dmn[i / 32];
    }
  }
}

// Row m of x against weight row wrow of nsb super-blocks (the file's layout), in plain C++: the
// generic build's K-quant product (gguf_matmul_kil.h: kil_groups).
template <int T>
float dot_row_k(const uint8_t* wrow, int64_t nsb, const QuantizedX& qx, int64_t m, int64_t K) {
  using B = typename KBlock<T>::type;
  const int8_t* xq = qx.q.data() + m * K;
  const float *xd = qx.d.data() + m * (K / kQK), *xds = qx.ds.data() + m * (K / kQK);
  float acc = 0.0f, off = 0.0f;  // off: the mins' terms on sum(q_x)
  float dsc[16], dmn[8];
  int q[kQK_K];
  for (int64_t s = 0; s < nsb; ++s) {
    const B& blk = reinterpret_cast<const B*>(wrow)[s];
    const int64_t b0 = s * (kQK_K / kQK);  // x's block under sub-block 0
    if constexpr (T == kQ6_K) {
      scales6(blk, dsc);
    } else {
      scales_mins(blk, dsc, dmn);
      for (int j = 0; j < 8; ++j) off -= dmn[j] * xds[b0 + j];
    }
    unpack_k<T>(blk, q);
    for (int j = 0; j < 8; ++j) {
      const int* qj = q + 32 * j;
      const int8_t* xb = xq + (b0 + j) * kQK;
      int s0 = 0, s1 = 0;
      for (int l = 0; l < 16; ++l) s0 += qj[l] * xb[l];
      for (int l = 16; l < 32; ++l) s1 += qj[l] * xb[l];
      const float sum = T == kQ6_K ? float(s0) * dsc[2 * j] + float(s1) * dsc[2 * j + 1] : float(s0 + s1) * dsc[j];
      acc += sum * xd[b0 + j];
    }
  }
  return acc + off;
}
