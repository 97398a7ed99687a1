// The C++ decode kernel (kernels_cpu/paged_decode.cc) called directly, one thread, timed in
// thread CPU time (steadier than wall time on a shared machine): float32 against fp8 e4m3 / e5m2
// caches at SmolLM2-135M's decode shapes (32 tokens x 1,025 keys, 3 KV heads x 3 query heads,
// head_dim 64), L layers' caches (30: larger than the last-level cache, as in a decode step).
//
//   INC=$(python -c "import jax; print(jax.ffi.include_dir())")
//   g++ -O3 -march=native -ffast-math -std=c++17 -fopenmp-simd -I $INC -I . \
//       -DPD_SOURCE='"kernels_cpu/paged_decode.cc"' scripts/dev/paged_decode_micro.cc -o /tmp/pd_micro
//   /tmp/pd_micro 5 30      # repetitions, layers
//
// -march=x86-64 instead builds the generic (non-AVX2) path: its checksums must equal the fast path's.
#include PD_SOURCE
#include <ctime>
#include <cstdio>
#include <random>
int main(int argc, char** argv) {
  const int64_t T = 32, Hkv = 3, G = 3, D = 64, BS = 16, ctx = 1024;
  const int64_t P = (ctx + 64 + BS - 1) / BS, NB = T * P + 1, R = T;
  const int reps = argc > 1 ? atoi(argv[1]) : 20;
  const int L = argc > 2 ? atoi(argv[2]) : 1;
  std::mt19937 rng(0);
  std::normal_distribution<float> nd(0, 1);
  size_t n1 = 2 * NB * BS * Hkv * D, n = n1 * L;
  std::vector<float> c32(n);
  std::vector<uint8_t> c8(n);
  for (size_t i = 0; i < n; ++i) {
    c32[i] = nd(rng);
    // fp8 bytes: sign, exponent 3..8, any mantissa (e4m3: 2^-4..2^1; no NaN or infinity)
    uint32_t rr = rng();
    uint8_t b = uint8_t((rr & 0x80) | ((3 + (rr >> 8) % 6) << 3) | ((rr >> 16) & 7));
    c8[i] = b;
  }
  std::vector<float> q(T * Hkv * G * D), out(T * Hkv * G * D);
  for (auto& x : q) x = nd(rng) * 0.1f;
  std::vector<int32_t> pos(T, ctx), rows(T), tables(R * P);
  for (int t = 0; t < T; ++t) rows[t] = t;
  for (int i = 0; i < R * P; ++i) tables[i] = 1 + i;
  Args a;
  a.s = Shape{T, Hkv, G, D, NB, BS, R, P};
  a.q = q.data(); a.positions = pos.data(); a.rows = rows.data(); a.tables = tables.data();
  a.out = out.data(); a.window = 0; a.cap = 0;
  auto run = [&](const char* name, auto fn) {
    std::vector<double> ts;
    auto cpu = [] { timespec x; clock_gettime(CLOCK_THREAD_CPUTIME_ID, &x); return x.tv_sec + 1e-9 * x.tv_nsec; };
    for (int r = 0; r < reps; ++r) {
      double t0 = cpu();
      fn();
      ts.push_back(cpu() - t0);
    }
    std::sort(ts.begin(), ts.end());
    double cs = 0; for (auto x : out) cs += x;
    printf("%s: median %.2f ms min %.2f ms (thread cpu time) checksum %.6g\n", name, ts[reps / 2] * 1e3, ts[0] * 1e3, cs);
  };
  for (int k = 0; k < 1; ++k) {
    a.cache = c32.data();
    a.hb = heads_per_item<float>(a.s, T, 1);  // KV heads per work item, as attend_all picks them
    run("f32", [&] { for (int l = 0; l < L; ++l) { a.cache = c32.data() + l * n1; attend_items<float>(a, 0, T * Hkv / a.hb); } });
    a.cache = c8.data();
    a.hb = heads_per_item<E4M3>(a.s, T, 1);
    run("e4m3", [&] { for (int l = 0; l < L; ++l) { a.cache = c8.data() + l * n1; attend_items<E4M3>(a, 0, T * Hkv / a.hb); } });
    run("e5m2", [&] { for (int l = 0; l < L; ++l) { a.cache = c8.data() + l * n1; attend_items<E5M2>(a, 0, T * Hkv / a.hb); } });
    a.hb = 1;
  }
}
