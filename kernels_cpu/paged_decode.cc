// Paged decode attention for XLA:CPU, called from a jitted program through XLA's FFI.
//
// Each decode token (one query token per row; the first num_decode tokens of the step) reads the
// keys [lo, position] of its own row straight from the paged cache through the block table: one
// pass over K for the scores of the G query heads sharing a KV head, an exact softmax, then V
// (per query head, its sums in registers; the rows stay in L1 for the next one). XLA's
// gather-based form copies every page it reads into the dot products' layout first (most of its
// time, docs/PERF_NOTES.md, sessions 6-8); here a page is read where it lies.
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

// fp8 elements, one byte each (kv_cache_dtype fp8 / fp8_e4m3, fp8_e5m2). Converted with integer
// operations the compiler vectorizes (no table lookups, no float subnormals: the kernel runs with
// denormals-are-zero, so a subnormal f32 built from the bits would read as 0).
struct E4M3 { uint8_t b; };
struct E5M2 { uint8_t b; };

// e4m3fn: 1 sign, 4 exponent bits (bias 7), 3 mantissa bits; no infinities; S.1111.111 is NaN.
inline float to_f32(E4M3 x) {
  const uint32_t em = x.b & 0x7fu, sign = uint32_t(x.b & 0x80u) << 24;
  // A normal number is its bits moved under the f32 exponent, rebiased by 127 - 7 = 120.
  uint32_t bits = (em << 20) + (120u << 23);
  bits = em < 8 ? f32_bits(float(em) * 0x1p-9f) : bits;  // subnormal: m * 2^-9
  bits = em == 0x7fu ? 0x7fc00000u : bits;
  return bits_f32(bits | sign);
}

// e5m2: 1 sign, 5 exponent bits (bias 15), 2 mantissa bits; exponent 31 is inf / NaN as in IEEE.
inline float to_f32(E5M2 x) {
  const uint32_t em = x.b & 0x7fu, sign = uint32_t(x.b & 0x80u) << 24;
  uint32_t bits = (em << 21) + (112u << 23);  // rebiased by 127 - 15 = 112
  bits = em < 4 ? f32_bits(float(em) * 0x1p-16f) : bits;  // subnormal: m * 2^-16
  bits = em >= 0x7cu ? (0x7f800000u | ((em & 3u) << 21)) : bits;
  return bits_f32(bits | sign);
}

template <typename KV>
constexpr bool kIsFp8 = std::is_same_v<KV, E4M3> || std::is_same_v<KV, E5M2>;

// A row of D fp8 values as floats. With F16C, 8 at a time through half precision: e5m2 is the
// high byte of an f16; e4m3fn's 7 value bits placed under an f16's exponent give the value times
// 2^-8 (subnormals included: vcvtph2ps converts f16 subnormals exactly, whatever DAZ says),
// and its one NaN code (S.1111.111) is put back by a compare.
template <typename KV>
inline void convert_row(const KV* src, float* dst, int64_t D) {
  int64_t d = 0;
#if defined(__F16C__) && defined(__AVX2__)
  const uint8_t* bytes = reinterpret_cast<const uint8_t*>(src);
  for (; d + 8 <= D; d += 8) {
    const __m128i w = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes + d)));
    if constexpr (std::is_same_v<KV, E5M2>) {
      _mm256_storeu_ps(dst + d, _mm256_cvtph_ps(_mm_slli_epi16(w, 8)));
    } else {
      const __m128i em = _mm_and_si128(w, _mm_set1_epi16(0x7f));
      const __m128i sign = _mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x80)), 8);
      __m256 f = _mm256_mul_ps(_mm256_cvtph_ps(_mm_or_si128(sign, _mm_slli_epi16(em, 7))), _mm256_set1_ps(256.0f));
      const __m256i nan = _mm256_cvtepi16_epi32(_mm_cmpeq_epi16(em, _mm_set1_epi16(0x7f)));
      f = _mm256_blendv_ps(f, _mm256_castsi256_ps(_mm256_set1_epi32(0x7fc00000)), _mm256_castsi256_ps(nan));
      _mm256_storeu_ps(dst + d, f);
    }
  }
#endif
  for (; d < D; ++d) dst[d] = to_f32(src[d]);
}

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

// Calls f(j, row) for every key j in [lo, hi) of a row, row pointing at key j's [Hkv, D] values
// in `base`: one block-table lookup and no division per page, not per key.
template <typename KV, typename F>
inline void for_each_key(const Shape& s, const int32_t* table, const KV* base, int64_t lo, int64_t hi, F&& f) {
  const int64_t row_len = s.Hkv * s.D;
  for (int64_t first = lo - lo % s.BS; first < hi; first += s.BS) {
    const int64_t page = std::clamp<int64_t>(table[first / s.BS], 0, s.NB - 1);
    const KV* rows = base + page * s.BS * row_len;
    for (int64_t j = std::max(first, lo), e = std::min(first + s.BS, hi); j < e; ++j)
      f(j, rows + (j - first) * row_len);
  }
}

// Keys converted to float per chunk (fp8 caches): each element is converted once, not once per
// query head, and the chunk ([kChunk, D] floats) stays in L1 while the G heads read it.
constexpr int64_t kChunk = 32;

// Calls f(j0, rows, count) for chunks of up to kChunk keys of [lo, hi): their head-h values as
// float, row i of the chunk at rows + i * D.
template <typename KV, int kD, typename F>
inline void for_each_chunk(const Shape& s, const int32_t* table, const KV* base, int64_t h, int64_t lo, int64_t hi,
                           float* buf, F&& f) {
  const int64_t D = kD > 0 ? kD : s.D;
  int64_t count = 0, j0 = lo;
  for_each_key(s, table, base, lo, hi, [&](int64_t j, const KV* row) {
    convert_row(row + h * D, buf + count * D, D);
    if (++count == kChunk) {
      f(j0, buf, count);
      count = 0;
      j0 = j + 1;
    }
  });
  if (count) f(j0, buf, count);
}

// attend_head for an fp8 cache: the same passes (scores, exact softmax, V) over float chunks.
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

template <typename KV, int kD>
void attend_head_fp8(const Args& a, int64_t t, int64_t h, std::vector<float>& scratch) {
  const Shape& s = a.s;
  const KV* kc = static_cast<const KV*>(a.cache);
  const KV* vc = kc + s.NB * s.BS * s.Hkv * s.D;
  const int64_t D = kD > 0 ? kD : s.D, G = s.G;
  const int32_t* table = row_table(a, t);
  const int64_t hi = keys_end(a, t), lo = keys_begin(a, hi);
  const int64_t n = hi - lo;
  float* o = a.out + (t * s.Hkv + h) * G * D;  // [G, D]
  std::fill(o, o + G * D, 0.0f);
  if (n <= 0) return;
  scratch.resize(G * n + kChunk * D);
  float* sc = scratch.data();  // [G, n]
  float* buf = sc + G * n;     // [kChunk, D]
  const float* q = a.q + (t * s.Hkv + h) * G * D;

  for_each_chunk<KV, kD>(s, table, kc, h, lo, hi, buf, [&](int64_t j0, const float* rows, int64_t count) {
    for (int64_t i = 0; i < count; ++i) {
      const float* k = rows + i * D;
      for (int64_t g = 0; g < G; ++g) {
        const float* qg = q + g * D;
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < D; ++d) dot += qg[d] * k[d];
        sc[g * n + (j0 + i - lo)] = dot;
      }
    }
  });
  float inv_l[G];
  softmax_rows(sc, G, n, a.cap, inv_l);
  for_each_chunk<KV, kD>(s, table, vc, h, lo, hi, buf, [&](int64_t j0, const float* rows, int64_t count) {
    for (int64_t g = 0; g < G; ++g) {
      float* og = o + g * D;
      float reg[kD > 0 ? kD : 1];
      float* acc = kD > 0 ? reg : og;
      if (kD > 0) std::copy(og, og + D, acc);
      const float* pg = sc + g * n + (j0 - lo);
      for (int64_t i = 0; i < count; ++i) {
        const float* v = rows + i * D;
        const float p = pg[i];
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) acc[d] += p * v[d];
      }
      if (kD > 0) std::copy(acc, acc + D, og);
    }
  });
  for (int64_t g = 0; g < G; ++g) {
    float* og = o + g * D;
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) og[d] *= inv_l[g];
  }
}

#include "paged_decode_fp8_avx2.h"    // attend_head_fp8_fast
#include "paged_decode_fp8_avx512.h"  // attend_head_fp8_512

// Token t's attention over its row's pages for the G query heads of KV head h (of KV heads
// [h, h + a.hb) on the AVX-512 fp8 path, the only one given a.hb > 1).
// kD: head_dim when known at compile time (straight-line dot products), 0 for any.
template <typename KV, int kD>
void attend_head(const Args& a, int64_t t, int64_t h, std::vector<float>& scratch) {
  if constexpr (kIsFp8<KV>) {
#if defined(JAXLM_FP8_AVX512)
    if constexpr (kD > 0) return attend_head_fp8_512<KV, kD>(a, t, h, scratch);  // kD: 16..128
#elif defined(__F16C__) && defined(__AVX2__)
    if constexpr (kD > 0 && kD % 16 == 0) return attend_head_fp8_fast<KV, kD>(a, t, h, scratch);
#endif
    attend_head_fp8<KV, kD>(a, t, h, scratch);
    return;
  }
  const Shape& s = a.s;
  const KV* kc = static_cast<const KV*>(a.cache);
  const KV* vc = kc + s.NB * s.BS * s.Hkv * s.D;
  const int64_t D = kD > 0 ? kD : s.D, G = s.G;
  const int32_t* table = row_table(a, t);
  const int64_t hi = keys_end(a, t), lo = keys_begin(a, hi);
  const int64_t n = hi - lo;
  float* o = a.out + (t * s.Hkv + h) * G * D;  // [G, D]
  if (n <= 0) return std::fill(o, o + G * D, 0.0f);  // no keys: zeros
  scratch.resize(G * n);
  float* sc = scratch.data();  // [G, n]: a query head's scores contiguous for the softmax
  const float* q = a.q + (t * s.Hkv + h) * G * D;

  for_each_key(s, table, kc, lo, hi, [&](int64_t j, const KV* k) {
    const KV* kh = k + h * D;
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = q + g * D;
      float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
      for (int64_t d = 0; d < D; ++d) dot += qg[d] * to_f32(kh[d]);
      sc[g * n + (j - lo)] = dot;
    }
  });
  float inv_l[G];
  softmax_rows(sc, G, n, a.cap, inv_l);
  // One query head at a time, its D sums in registers across the keys when D is known (the
  // head's V rows stay in L1 for the group's next query head).
  for (int64_t g = 0; g < G; ++g) {
    float* og = o + g * D;
    float reg[kD > 0 ? kD : 1];
    float* acc = kD > 0 ? reg : og;
    std::fill(acc, acc + D, 0.0f);
    const float* pg = sc + g * n - lo;
    for_each_key(s, table, vc, lo, hi, [&](int64_t j, const KV* v) {
      const KV* vh = v + h * D;
      const float p = pg[j];
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) acc[d] += p * to_f32(vh[d]);
    });
    if (kD > 0) std::copy(acc, acc + D, og);
  }
  for (int64_t g = 0; g < G; ++g) {
    float* og = o + g * D;
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) og[d] *= inv_l[g];
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

// What the threads share: the caller and XLA's pool threads take chunks of (token, KV head)
// pairs from `next` until none is left, so a pool thread that wakes late finds less (or nothing)
// to do instead of being waited for. Shared-owned: a task that starts after the call returned
// touches only this, and takes nothing.
struct Split {
  Args a;
  int64_t items, chunk;
  std::atomic<int64_t> next{0}, done{0};
};

template <typename KV>
void take_chunks(Split& sp) {
  for (int64_t i; (i = sp.next.fetch_add(sp.chunk, std::memory_order_relaxed)) < sp.items;) {
    const int64_t end = std::min(sp.items, i + sp.chunk);
    attend_items<KV>(sp.a, i, end);
    sp.done.fetch_add(end - i, std::memory_order_release);
  }
}

// Splits the pairs over XLA's intra-op threads when there is enough work to pay for the handoff.
template <typename KV>
void attend_all(Args a, int64_t num_decode, ffi::ThreadPool& pool) {
  int64_t keys = 0;
  for (int64_t t = 0; t < num_decode; ++t) keys += keys_end(a, t);
  a.hb = heads_per_item<KV>(a.s, num_decode, pool.num_threads());
  const int64_t items = num_decode * a.s.Hkv / a.hb, work = keys * a.s.Hkv * a.s.G * a.s.D;  // multiply-adds a pass
  constexpr int64_t kWorkPerTask = 1 << 16;
  const int64_t tasks = std::min<int64_t>(
      {items, std::max<int64_t>(pool.num_threads(), 1), std::max<int64_t>(work / kWorkPerTask, 1)});
  if (tasks <= 1) {
    attend_items<KV>(a, 0, items);
    return;
  }
  auto sp = std::make_shared<Split>();
  sp->a = a;
  sp->items = items;
  sp->chunk = std::max<int64_t>(1, items / (tasks * 8));
  for (int64_t i = 1; i < tasks; ++i) pool.Schedule([sp] { take_chunks<KV>(*sp); });
  take_chunks<KV>(*sp);
  while (sp->done.load(std::memory_order_acquire) < items) std::this_thread::yield();
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
