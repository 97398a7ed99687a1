// Paged decode attention for XLA:CPU, called from a jitted program through XLA's FFI.
//
// Each decode token (one query token per row; the first num_decode tokens of the step) reads the
// keys [lo, position] of its own row straight from the paged cache through the block table: one
// pass over K for the scores of the G query heads sharing a KV head, an exact softmax, then V
// (per query head, its sums in registers; the rows stay in cache for the next one). A work item
// is one KV head of a token, or all of them (heads_per_item), which reads each page as one block.
// XLA's gather-based form copies every page it reads into the dot products' layout first (most
// of its time, docs/PERF_NOTES.md, sessions 6-8); here a page is read where it lies.
//
// Layouts (row-major):
//   q      [T, Hkv, G, D] f32, already times the softmax scale
//   cache  [2, NB, BS, Hkv, D] f32, bf16, fp8 e4m3fn or fp8 e5m2 (K = cache[0], V = cache[1]);
//          an fp8 cache's scales are folded into q and the output by the caller
//   positions, token_rows [T] i32; block_tables [R, P] i32; num_decode [] i32
//   out_in [T, Hkv, G, D] f32: rows >= num_decode are kept (aliased to the result)
// Attributes: window (keys j > position - window visible; 0 = no window), cap (soft cap of the
// scores, cap * tanh(s / cap); 0 = none), fp8 (a uint8 cache's format: 1 e4m3fn, 2 e5m2).
// Garbage safety, as the XLA path: block-table entries and rows are clamped into range, a
// position past the table reads at most the table's keys.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <type_traits>
#include <vector>

#include "xla/ffi/api/ffi.h"
#include "thread_split.h"

#if defined(__SSE__)
#include <immintrin.h>  // the MXCSR; the AVX2 and AVX-512 intrinsics where the target has them
#endif

namespace ffi = xla::ffi;

namespace {

inline float bits_f32(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
inline uint32_t f32_bits(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  return bits;
}

inline float to_f32(float x) { return x; }
inline float to_f32(uint16_t x) { return bits_f32(uint32_t(x) << 16); }  // bf16: the float's high half

struct Shape {
  int64_t T, Hkv, G, D, NB, BS, R, P;
};

struct Args {
  Shape s;
  const float* q;
  const void* cache;
  const int32_t* positions;
  const int32_t* rows;
  const int32_t* tables;
  float* out;
  int32_t window;
  float cap;
  int64_t hb = 1;  // KV heads per work item: attend_head takes heads [h, h + hb) of token t
};

// Token t's row's block table and its keys [keys_begin, keys_end), clamped as the XLA path does.
inline const int32_t* row_table(const Args& a, int64_t t) {
  return a.tables + std::clamp<int64_t>(a.rows[t], 0, a.s.R - 1) * a.s.P;
}
inline int64_t keys_end(const Args& a, int64_t t) {
  return std::clamp<int64_t>(int64_t(a.positions[t]) + 1, 0, a.s.P * a.s.BS);
}
inline int64_t keys_begin(const Args& a, int64_t hi) { return a.window > 0 ? std::max<int64_t>(hi - a.window, 0) : 0; }

// Calls f(first, js, je, rows) for each page of keys [lo, hi): keys [js, je) of the page whose
// first key is `first`, key j's [Hkv, D] values at rows + (j - first) * Hkv * D in `base`.
template <typename KV, typename F>
inline void for_each_page(const Shape& s, const int32_t* table, const KV* base, int64_t lo, int64_t hi, F&& f) {
  for (int64_t first = lo - lo % s.BS; first < hi; first += s.BS) {
    const int64_t page = std::clamp<int64_t>(table[first / s.BS], 0, s.NB - 1);
    f(first, std::max(first, lo), std::min(first + s.BS, hi), base + page * s.BS * s.Hkv * s.D);
  }
}

// Calls f(j, row) for every key j in [lo, hi) of a row, row pointing at key j's [Hkv, D] values
// in `base`: one block-table lookup and no division per page, not per key.
template <typename KV, typename F>
inline void for_each_key(const Shape& s, const int32_t* table, const KV* base, int64_t lo, int64_t hi, F&& f) {
  const int64_t row_len = s.Hkv * s.D;
  for_each_page(s, table, base, lo, hi, [&](int64_t first, int64_t js, int64_t je, const KV* rows) {
    for (int64_t j = js; j < je; ++j) f(j, rows + (j - first) * row_len);
  });
}

// Each of the G heads' n scores (the rows of sc): soft-capped when cap > 0, then exp(s - max)
// in place; 1 / their sum into inv_l (the division is left to the V pass).
inline void softmax_rows(float* sc, int64_t G, int64_t n, float cap, float* inv_l) {
  for (int64_t g = 0; g < G; ++g) {
    float* sg = sc + g * n;
    if (cap > 0.0f) {
#pragma omp simd
      for (int64_t x = 0; x < n; ++x) sg[x] = cap * std::tanh(sg[x] / cap);
    }
    float m = -3.0e38f, l = 0.0f;
#pragma omp simd reduction(max : m)
    for (int64_t x = 0; x < n; ++x) m = sg[x] > m ? sg[x] : m;  // std::max stayed scalar here
#pragma omp simd reduction(+ : l)
    for (int64_t x = 0; x < n; ++x) {
      sg[x] = std::exp(sg[x] - m);
      l += sg[x];
    }
    inv_l[g] = 1.0f / l;
  }
}

#include "paged_decode_fp8.h"         // E4M3, E5M2, convert_row, attend_head_fp8
#include "paged_decode_fp8_avx2.h"    // attend_head_fp8_fast
#include "paged_decode_fp8_avx512.h"  // attend_head_fp8_512

// KV heads per work item (Args::hb): all of a token's when there are tokens enough to keep the
// threads busy (4 a thread: items go in chunks), else one (batch 1 still splits by head). A whole
// token's item reads each page's K (then V) as one block of BS * Hkv * D elements where one
// head's item reads D of them every Hkv * D, a stride the hardware prefetchers follow poorly
// (PERF_NOTES sessions 12 and 13). Taken by float32 (any head_dim) and by the AVX2 and AVX-512
// fp8 paths (head_dim 16, 32, 64, 128); bf16 and the portable fp8 path take one head an item
// (correct with more too: each path handles heads [h, h + hb)).
template <typename KV>
constexpr bool takes_whole_tokens(int64_t D) {
  if constexpr (std::is_same_v<KV, float>) return true;
#if defined(JAXLM_FP8_AVX512) || defined(JAXLM_FP8_AVX2)
  if constexpr (kIsFp8<KV>) return D == 16 || D == 32 || D == 64 || D == 128;
#endif
  return false;
}

template <typename KV>
int64_t heads_per_item(const Shape& s, int64_t tokens, int64_t threads) {
  return takes_whole_tokens<KV>(s.D) && tokens >= 4 * threads ? s.Hkv : 1;
}

// Token t's attention over its row's pages for the G query heads of each of KV heads
// [h, h + a.hb): one work item. kD: head_dim when known at compile time (straight-line dot
// products), 0 for any.
template <typename KV, int kD>
void attend_head(const Args& a, int64_t t, int64_t h, std::vector<float>& scratch) {
  if constexpr (kIsFp8<KV>) {
#if defined(JAXLM_FP8_AVX512)
    if constexpr (kD > 0) return attend_head_fp8_512<KV, kD>(a, t, h, scratch);  // kD: 16..128
#elif defined(JAXLM_FP8_AVX2)
    if constexpr (kD > 0 && kD % 16 == 0) return attend_head_fp8_fast<KV, kD>(a, t, h, scratch);
#endif
    for (int64_t e = h + a.hb; h < e; ++h) attend_head_fp8<KV, kD>(a, t, h, scratch);
    return;
  }
  const Shape& s = a.s;
  const KV* kc = static_cast<const KV*>(a.cache);
  const KV* vc = kc + s.NB * s.BS * s.Hkv * s.D;
  const int64_t D = kD > 0 ? kD : s.D, G = s.G, hb = a.hb, HG = hb * G;
  const int32_t* table = row_table(a, t);
  const int64_t hi = keys_end(a, t), lo = keys_begin(a, hi);
  const int64_t n = hi - lo;
  float* o = a.out + (t * s.Hkv + h) * G * D;  // [HG, D]: query head x = hh * G + g of KV head h + hh
  std::fill(o, o + HG * D, 0.0f);
  if (n <= 0) return;  // no keys: zeros
  scratch.resize(HG * n);
  float* sc = scratch.data();  // [HG, n]: a query head's scores contiguous for the softmax
  const float* q = a.q + (t * s.Hkv + h) * G * D;  // [HG, D]

  for_each_key(s, table, kc, lo, hi, [&](int64_t j, const KV* k) {
    for (int64_t hh = 0; hh < hb; ++hh) {
      const KV* kh = k + (h + hh) * D;
      for (int64_t g = 0; g < G; ++g) {
        const float* qx = q + (hh * G + g) * D;
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < D; ++d) dot += qx[d] * to_f32(kh[d]);
        sc[(hh * G + g) * n + (j - lo)] = dot;
      }
    }
  });
  float inv_l[HG];
  softmax_rows(sc, HG, n, a.cap, inv_l);
  // One query head at a time, its D sums in registers across the keys when D is known (a page
  // at a time instead, the rows in L1 for the next query head, was 1.1-1.2x slower: PERF_NOTES
  // session 13).
  for (int64_t x = 0; x < HG; ++x) {
    float* ox = o + x * D;
    float reg[kD > 0 ? kD : 1];
    float* acc = kD > 0 ? reg : ox;  // ox: zeros
    std::fill(acc, acc + D, 0.0f);
    const float* px = sc + x * n - lo;
    const int64_t off = (h + x / G) * D;
    for_each_key(s, table, vc, lo, hi, [&](int64_t j, const KV* v) {
      const KV* vh = v + off;
      const float p = px[j];
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) acc[d] += p * to_f32(vh[d]);
    });
    if (kD > 0) std::copy(acc, acc + D, ox);
  }
  for (int64_t x = 0; x < HG; ++x) {
    float* ox = o + x * D;
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) ox[d] *= inv_l[x];
  }
}

// Subnormals as zero on this thread while it runs the kernel, then the caller's mode back: exp()
// of scores far below the max lands there, and x86 takes a slow path for each. Only here: the
// library is linked without crtfastmath, which would set this for the whole process at load.
struct FlushSubnormals {
#if defined(__SSE__)
  unsigned int saved = _mm_getcsr();
  FlushSubnormals() { _mm_setcsr(saved | 0x8040); }  // FTZ | DAZ
  ~FlushSubnormals() { _mm_setcsr(saved); }
#endif
};

// Work items [begin, end) of (token, a.hb KV heads), token-major.
template <typename KV>
void attend_items(const Args& a, int64_t begin, int64_t end) {
  FlushSubnormals flush;
  std::vector<float> scratch;
  auto each = [&](auto head) {
    for (int64_t i = begin, nh = a.s.Hkv / a.hb; i < end; ++i) head(a, i / nh, (i % nh) * a.hb, scratch);
  };
  switch (a.s.D) {
    case 16: return each(attend_head<KV, 16>);
    case 32: return each(attend_head<KV, 32>);
    case 64: return each(attend_head<KV, 64>);
    case 128: return each(attend_head<KV, 128>);
    default: return each(attend_head<KV, 0>);
  }
}

// Splits the work items over XLA's intra-op threads when there is enough work to pay for the handoff
// (thread_split.h): chunks of a token's a.hb KV heads.
template <typename KV>
void attend_all(Args a, int64_t num_decode, ffi::ThreadPool& pool) {
  int64_t keys = 0;
  for (int64_t t = 0; t < num_decode; ++t) keys += keys_end(a, t);
  a.hb = heads_per_item<KV>(a.s, num_decode, pool.num_threads());
  const int64_t items = num_decode * a.s.Hkv / a.hb, work = keys * a.s.Hkv * a.s.G * a.s.D;  // multiply-adds a pass
  constexpr int64_t kWorkPerTask = 1 << 16;
  jaxlm_kernels::parallel_for(pool, items, work, kWorkPerTask,
                              [a](int64_t i0, int64_t i1) { attend_items<KV>(a, i0, i1); }, /*stay=*/false, 8);
}

ffi::Error PagedDecodeImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer cache,
                           ffi::Buffer<ffi::S32> positions, ffi::Buffer<ffi::S32> token_rows,
                           ffi::Buffer<ffi::S32> block_tables, ffi::Buffer<ffi::S32> num_decode,
                           ffi::Buffer<ffi::F32> out_in, ffi::Result<ffi::Buffer<ffi::F32>> out,
                           int32_t window, float cap, int32_t fp8) {
  auto qd = q.dimensions(), cd = cache.dimensions(), td = block_tables.dimensions();
  if (qd.size() != 4 || cd.size() != 5 || td.size() != 2 || cd[0] != 2 || cd[3] != qd[1] ||
      cd[4] != qd[3])
    return ffi::Error::InvalidArgument("paged_decode: q [T, Hkv, G, D] and cache [2, NB, BS, Hkv, D] disagree");
  Args a;
  a.s = Shape{qd[0], qd[1], qd[2], qd[3], cd[1], cd[2], td[0], td[1]};
  if (positions.element_count() != size_t(a.s.T) || token_rows.element_count() != size_t(a.s.T) ||
      out_in.element_count() != q.element_count() || a.s.R < 1 || a.s.NB < 1)
    return ffi::Error::InvalidArgument("paged_decode: positions, rows or out do not match q");
  a.q = q.typed_data();
  a.cache = cache.untyped_data();
  a.positions = positions.typed_data();
  a.rows = token_rows.typed_data();
  a.tables = block_tables.typed_data();
  a.out = out->typed_data();
  a.window = window;
  a.cap = cap;
  if (a.out != out_in.typed_data())
    std::memcpy(a.out, out_in.typed_data(), sizeof(float) * q.element_count());
  const int64_t nd = std::clamp<int64_t>(num_decode.typed_data()[0], 0, a.s.T);
  switch (cache.element_type()) {
    case ffi::F32:
      attend_all<float>(a, nd, pool);
      break;
    case ffi::BF16:
      attend_all<uint16_t>(a, nd, pool);
      break;
    case ffi::F8E4M3FN:
      attend_all<E4M3>(a, nd, pool);
      break;
    case ffi::F8E5M2:
      attend_all<E5M2>(a, nd, pool);
      break;
    case ffi::U8:  // fp8 kept as bytes (XLA:CPU scatters those in place): fp8 names the format
      if (fp8 == 1) {
        attend_all<E4M3>(a, nd, pool);
        break;
      }
      if (fp8 == 2) {
        attend_all<E5M2>(a, nd, pool);
        break;
      }
      return ffi::Error::InvalidArgument("paged_decode: a uint8 cache needs fp8 = 1 (e4m3fn) or 2 (e5m2)");
    default:
      return ffi::Error::InvalidArgument(
          "paged_decode: the cache must be float32, bfloat16, float8_e4m3fn or float8_e5m2");
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxlmPagedDecode, PagedDecodeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int32_t>("window")
                                  .Attr<float>("cap")
                                  .Attr<int32_t>("fp8"));
