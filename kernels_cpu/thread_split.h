// Work split over the FFI caller and XLA's intra-op threads, for gguf_matmul.cc and
// paged_decode.cc (kernels_cpu/build.py hashes it with the sources).
//
// A decode step calls the kernels ~240 times with a few to a few tens of microseconds of other
// ops between them. Handing each call's work to a pool thread with ThreadPool::Schedule wakes a
// parked thread each time, and on these VMs that wake-up cost more than the work it brought:
// the batch-1 products ran at 19 GB/s with 32 us of other work between layers against 30 GB/s
// back to back (scripts/dev/bench_gguf_chain.py --gap, docs/PERF_NOTES.md, session 14). So a
// pool thread that finished its share of a block product lingers for kLinger, polling for the
// next call's work (`Linger`), and a call finds it there instead of scheduling a new task. The state is one per
// process (an inline function's static: the same object in both sources).

#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace jaxlm_kernels {

// Items [0, items) taken in chunks from a shared counter by the caller and its helpers (a helper
// that starts late finds less, or nothing, to do instead of being waited for). Shared-owned: a
// helper that takes it after the call returned touches only this.
struct Split {
  std::function<void(int64_t, int64_t)> fn;
  int64_t items = 0, chunk = 1;
  std::atomic<int64_t> next{0}, done{0};
  std::atomic<int> seats{0};  // lingering helpers it still takes
};

inline void take_chunks(Split& sp) {
  for (int64_t i; (i = sp.next.fetch_add(sp.chunk, std::memory_order_relaxed)) < sp.items;) {
    const int64_t end = std::min(sp.items, i + sp.chunk);
    sp.fn(i, end);
    sp.done.fetch_add(end - i, std::memory_order_release);
  }
}

// Helpers waiting for work: the posted Split, a counter bumped at each post, how many poll.
struct Linger {
  std::mutex mu;
  std::shared_ptr<Split> posted;
  std::atomic<uint64_t> posts{0};
  std::atomic<int> idle{0};
};

// Never destroyed: a pool thread may still be lingering while the process exits.
inline Linger& linger() {
  static Linger* state = new Linger;
  return *state;
}

// Longer than the gaps inside a decode step (attention, norms: tens of us), short enough that
// a thread XLA wants back is not held long after the last call.
constexpr std::chrono::microseconds kLinger{200};

// A pool task: its first Split, then (if it lingers) any posted while it waits.
inline void help(std::shared_ptr<Split> sp, bool stay) {
  Linger& state = linger();
  while (sp) {
    take_chunks(*sp);
    sp.reset();
    if (!stay) return;
    uint64_t seen = state.posts.load(std::memory_order_acquire);
    state.idle.fetch_add(1, std::memory_order_acq_rel);
    const auto until = std::chrono::steady_clock::now() + kLinger;
    while (std::chrono::steady_clock::now() < until) {
      const uint64_t p = state.posts.load(std::memory_order_acquire);
      if (p != seen) {
        seen = p;
        std::lock_guard<std::mutex> lock(state.mu);
        if (state.posted && state.posted->seats.fetch_sub(1, std::memory_order_acq_rel) > 0) sp = state.posted;
        if (sp) break;
      }
      std::this_thread::yield();  // the core goes to a runnable thread (the host's) at once
    }
    state.idle.fetch_sub(1, std::memory_order_acq_rel);
  }
}

// fn(i0, i1) over items [0, items), split when `work` (multiply-adds, say) is at least
// 2 * work_per_task: below that a second thread costs more than it saves. Threads lingering from
// earlier calls take part first; with `stay`, the threads this call schedules linger after it
// (the block products: several a layer; the attention kernel does not, one call a layer with
// XLA's own multi-threaded dots between them in float models, which a lingering thread delays).
inline void parallel_for(xla::ffi::ThreadPool& pool, int64_t items, int64_t work, int64_t work_per_task,
                         std::function<void(int64_t, int64_t)> fn, bool stay, int64_t chunks_per_task = 4) {
  const int64_t tasks = std::min<int64_t>(
      {items, std::max<int64_t>(pool.num_threads(), 1), std::max<int64_t>(work / work_per_task, 1)});
  if (tasks <= 1) {
    fn(0, items);
    return;
  }
  auto sp = std::make_shared<Split>();
  sp->fn = std::move(fn);
  sp->items = items;
  sp->chunk = std::max<int64_t>(1, items / (tasks * chunks_per_task));
  Linger& state = linger();
  const int waiting = std::min<int>(state.idle.load(std::memory_order_acquire), int(tasks - 1));
  if (waiting > 0) {
    sp->seats.store(waiting, std::memory_order_relaxed);
    {
      std::lock_guard<std::mutex> lock(state.mu);
      state.posted = sp;
    }
    state.posts.fetch_add(1, std::memory_order_acq_rel);
  }
  for (int64_t i = waiting; i < tasks - 1; ++i) pool.Schedule([sp, stay] { help(sp, stay); });
  take_chunks(*sp);
  while (sp->done.load(std::memory_order_acquire) < items) std::this_thread::yield();
  if (waiting > 0) {
    std::lock_guard<std::mutex> lock(state.mu);
    if (state.posted == sp) state.posted.reset();
  }
}

}  // namespace jaxlm_kernels
