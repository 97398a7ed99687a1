// Matrix products with GGUF block-quantized weights for XLA:CPU, called through XLA's FFI.
//
// out [M, N] f32 = x [M, K] f32 @ W^T, W [N, K] kept in llama.cpp's blocks (a row of W is
// K / 32 blocks, or K / 256 super-blocks for the K-quants, the bytes ggml writes):
//   Q8_0 (type 8):  f16 d, int8 q[32]              w = d * q
//   Q4_0 (type 2):  f16 d, uint8 qs[16]            w = d * (nibble - 8)
//   Q4_1 (type 3):  f16 d, f16 m, uint8 qs[16]     w = d * nibble + m
// (nibble j < 16 is qs[j] & 15, nibble j + 16 is qs[j] >> 4), and Q4_K (12), Q5_K (13), Q6_K (14)
// in super-blocks of 256 (gguf_kquants.h).
// As llama.cpp does, each row of x is first quantized to int8 per block of 32 (d_x = max|x| / 127,
// round to nearest even) so a block's product is one integer dot product: w.x = d_w d_x sum(q qx)
// (+ m d_x sum(qx) for Q4_1, - 8 d_w d_x sum(qx) for Q4_0). The integer dots use AVX-VNNI /
// AVX512-VNNI (dpbusd) or AVX2 (maddubs + madd) when -march=native has them, else plain C++.
//
// W reaches the kernel in its kernel layout (gguf_matmul.py: to_kernel_layout): its rows
// interleaved 16 at a time, [ceil(N / 16), 16 * kernel row bytes] (the file's bytes but for Q8_0's
// q stored as q + 128 and Q4_K / Q5_K's 6-bit scales and mins unpacked to a byte each;
// gguf_matmul_il.h, gguf_matmul_kil.h). Paths; the threads take groups of 16 weight rows in each.
//  * Below f32_min_rows (decode, batched decode, prefill: the model passes f32_min_rows 0), the
//    32-value types at any count, the K-quants below kKilLanesFrom (32) rows: weight rows in
//    vector lanes, 4 int8 of x broadcast against 4 bytes of 16 weight rows, one dpbusd advancing
//    all 16 rows' dot products; up to 4 rows of x take turns against a group's block while it is
//    in L1 (gguf_matmul_il.h, gguf_matmul_kil.h).
//  * K-quants from kKilLanesFrom rows (gguf_matmul_lanes.h): a group of 16 weight rows unpacked
//    once, then rows of x in vector lanes, 8 or 16 a vector, a weight row's 4 bytes broadcast
//    against them. The generic build takes the first path for these too.
//  * M >= f32_min_rows: each tile is dequantized once to f32 and reused across every row of x
//    in a register-blocked f32 product (x as given, not rounded; gguf_matmul_f32.h). The model
//    does not use it (XLA's dot measured faster).

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "xla/ffi/api/ffi.h"
#include "thread_split.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define JAXLM_AVX2 1
#include <immintrin.h>
#endif

namespace ffi = xla::ffi;

namespace {

constexpr int kQK = 32;  // values per block of Q8_0 / Q4_0 / Q4_1, and of x's int8 rounding
constexpr int64_t kTileN = 16;

enum QType : int32_t { kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8 };

#pragma pack(push, 1)
struct BlockQ8_0 {
  uint16_t d;
  int8_t q[kQK];
};
struct BlockQ4_0 {
  uint16_t d;
  uint8_t qs[kQK / 2];
};
struct BlockQ4_1 {
  uint16_t d, m;
  uint8_t qs[kQK / 2];
};
#pragma pack(pop)
static_assert(sizeof(BlockQ8_0) == 34 && sizeof(BlockQ4_0) == 18 && sizeof(BlockQ4_1) == 20, "ggml block sizes");

inline float f16_to_f32(uint16_t h) {
#if defined(JAXLM_AVX2)
  return _cvtsh_ss(h);
#else
  const uint32_t sign = uint32_t(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  uint32_t bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000 | (man << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else {  // subnormal half: normalize
    int e = -1;
    uint32_t m = man;
    do {
      m <<= 1;
      ++e;
    } while (!(m & 0x400));
    bits = sign | ((112 - e) << 23) | ((m & 0x3ff) << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
#endif
}

// x quantized to int8 per block: q [M, K], d and d * sum(q) [M, K / 32], and sum(q) per 16
// values [M, K / 16] (Q6_K's sub-blocks).
struct QuantizedX {
  std::vector<int8_t> q;
  std::vector<float> d, ds;
  std::vector<int32_t> hs;
};

// Rows m0 .. m0 + R of x: their int8 values, scales and d * sum(q) per block.
template <int R>
struct XRows {
  const int8_t* q[R];
  const float *d[R], *ds[R];
  XRows(const QuantizedX& qx, int64_t m0, int64_t K) {
    for (int r = 0; r < R; ++r)
      q[r] = qx.q.data() + (m0 + r) * K, d[r] = qx.d.data() + (m0 + r) * (K / 32), ds[r] = qx.ds.data() + (m0 + r) * (K / 32);
  }
};

void quantize_rows(const float* x, int64_t K, int64_t m0, int64_t m1, QuantizedX& qx) {
  const int64_t nb = K / kQK;
  for (int64_t m = m0; m < m1; ++m) {
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = x + m * K + b * kQK;
      int8_t* qb = qx.q.data() + m * K + b * kQK;
      float amax = 0.0f;
      for (int j = 0; j < kQK; ++j) amax = std::max(amax, std::fabs(xb[j]));
      const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
      int sum = 0, half = 0;
      for (int j = 0; j < kQK; ++j) {
        const int v = int(std::nearbyint(xb[j] * id));
        qb[j] = int8_t(v);
        sum += v;
      }
      for (int j = 0; j < kQK / 2; ++j) half += qb[j];  // its own loop: the one above stays vectorized
      qx.d[m * nb + b] = d;
      qx.ds[m * nb + b] = d * float(sum);
      qx.hs[(m * nb + b) * 2] = half, qx.hs[(m * nb + b) * 2 + 1] = sum - half;
    }
  }
}

#include "gguf_kquants.h"

// Bytes per block of type T (a super-block for the K-quants).
template <int T>
constexpr int64_t block_bytes() {
  if constexpr (T == kQ8_0) return sizeof(BlockQ8_0);
  if constexpr (T == kQ4_0) return sizeof(BlockQ4_0);
  if constexpr (T == kQ4_1) return sizeof(BlockQ4_1);
  if constexpr (is_kquant(T)) return sizeof(typename KBlock<T>::type);
  return 0;
}

#include "gguf_matmul_lanes.h"
#include "gguf_matmul_il.h"
#include "gguf_matmul_kil.h"
#include "gguf_matmul_f32.h"

// Bytes of one block (super-block) of a group of 16 rows in the kernel layout.
template <int T>
constexpr int64_t group_block_bytes() {
  if constexpr (is_kquant(T)) return kil_block_bytes<T>();
  return il_block_bytes<T>();
}

// Below this much work (multiply-adds), handing part of it to a pool thread costs more than it saves.
constexpr int64_t kWorkPerTask = 1 << 17;

void parallel_for(ffi::ThreadPool& pool, int64_t items, int64_t work, std::function<void(int64_t, int64_t)> fn) {
  jaxlm_kernels::parallel_for(pool, items, work, kWorkPerTask, std::move(fn), /*stay=*/true);
}

#if defined(JAXLM_AVX2)
// From this many rows of x a K-quant product takes the lanes path (gguf_matmul_lanes.h): below,
// the weight-rows-in-lanes kernel (gguf_matmul_kil.h) measured faster (docs/PERF_NOTES.md, session 14).
constexpr int64_t kKilLanesFrom = 32;

template <int T, class V>
void kil_lanes_all(ffi::ThreadPool& pool, const uint8_t* w, const QuantizedX& qx, int64_t M, int64_t K, int64_t N,
                   float* out) {
  LaneX lx;
  size_lanes(M, K, V::L, halves<T>(), lx);
  parallel_for(pool, lx.groups, M * K * 8, [&](int64_t g0, int64_t g1) {
    pack_lanes(qx, M, K, V::L, int_bias<T, V>(), g0, g1, lx);
  });
  parallel_for(pool, (N + kIL - 1) / kIL, M * N * K, [&](int64_t g0, int64_t g1) {
    kil_lanes_groups<T, V>(w, lx, M, K, N, g0, g1, out);
  });
}
#endif

// Calls f(std::integral_constant<int, T>{}) for kernel type qtype; false for any other type.
template <typename F>
bool with_type(int32_t qtype, F&& f) {
  switch (qtype) {
    case kQ8_0:
      return f(std::integral_constant<int, kQ8_0>{}), true;
    case kQ4_0:
      return f(std::integral_constant<int, kQ4_0>{}), true;
    case kQ4_1:
      return f(std::integral_constant<int, kQ4_1>{}), true;
    case kQ4_K:
      return f(std::integral_constant<int, kQ4_K>{}), true;
    case kQ5_K:
      return f(std::integral_constant<int, kQ5_K>{}), true;
    case kQ6_K:
      return f(std::integral_constant<int, kQ6_K>{}), true;
    default:
      return false;
  }
}

ffi::Error GgufMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> w,
                          ffi::Result<ffi::Buffer<ffi::F32>> out, int32_t qtype, int32_t f32_min_rows) {
  auto xd = x.dimensions(), wd = w.dimensions(), od = out->dimensions();
  int64_t gb = 0, qk = 0;  // bytes per block of a group of 16 rows in the kernel layout, values per block
  const bool known = with_type(qtype, [&](auto t) {
    gb = group_block_bytes<decltype(t)::value>();
    qk = is_kquant(decltype(t)::value) ? kQK_K : kQK;
  });
  if (!known)
    return ffi::Error::InvalidArgument(
        "gguf_matmul: GGUF type must be Q4_0 (2), Q4_1 (3), Q8_0 (8), Q4_K (12), Q5_K (13) or Q6_K (14)");
  if (xd.size() != 2 || wd.size() != 2 || od.size() != 2)
    return ffi::Error::InvalidArgument("gguf_matmul: x [M, K], w [N, K / block values * block bytes], out [M, N]");
  const int64_t M = xd[0], K = xd[1], N = od[1];
  const int64_t w_rows = (N + kIL - 1) / kIL, w_row_bytes = K / qk * gb;  // rows interleaved by 16
  if (K % qk != 0 || wd[0] != w_rows || wd[1] != w_row_bytes || od[0] != M)
    return ffi::Error::InvalidArgument(
        "gguf_matmul: shapes of x, w and out disagree (K must be whole blocks: 32 values, 256 for K-quants; "
        "weights in the kernel layout, [ceil(N / 16), 16 * row bytes])");
  float* o = out->typed_data();
  if (M == 0 || N == 0) return ffi::Error::Success();
  if (K == 0) {
    std::fill(o, o + M * N, 0.0f);
    return ffi::Error::Success();
  }
  const float* xp = x.typed_data();
  const uint8_t* wp = w.typed_data();
  const int64_t row_bytes = wd[1], tiles = (N + kTileN - 1) / kTileN;
  if (f32_min_rows > 0 && M >= f32_min_rows) {
    with_type(qtype, [&](auto t) {
      parallel_for(pool, tiles, M * N * K, [&](int64_t t0, int64_t t1) {
        matmul_tile_f32<decltype(t)::value>(wp, row_bytes, xp, M, K, N, t0 * kTileN, std::min(N, t1 * kTileN), o);
      });
    });
    return ffi::Error::Success();
  }
  QuantizedX qx;
  qx.q.resize(M * K);
  qx.d.resize(M * K / kQK);
  qx.ds.resize(M * K / kQK);
  qx.hs.resize(M * K / 16);
  parallel_for(pool, M, M * K * 8, [&](int64_t m0, int64_t m1) { quantize_rows(xp, K, m0, m1, qx); });
  with_type(qtype, [&](auto t) {
    constexpr int T = decltype(t)::value;
    if constexpr (is_kquant(T)) {
#if defined(JAXLM_AVX2)
      if (M >= kKilLanesFrom) {
#if defined(JAXLM_LANES16)
        if (M > Lanes8::L) return kil_lanes_all<T, Lanes16>(pool, wp, qx, M, K, N, o);
#endif
        return kil_lanes_all<T, Lanes8>(pool, wp, qx, M, K, N, o);
      }
#endif
      parallel_for(pool, w_rows, M * N * K, [&](int64_t g0, int64_t g1) {
        kil_groups<T>(wp, K / kQK_K, qx, M, K, o, N, g0, g1);
      });
    } else {
      parallel_for(pool, w_rows, M * N * K, [&](int64_t g0, int64_t g1) {
        il_groups<T>(wp, K / kQK, qx, M, K, o, N, g0, g1);
      });
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxlmGgufMatmul, GgufMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int32_t>("qtype")
                                  .Attr<int32_t>("f32_min_rows"));
