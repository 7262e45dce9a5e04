// cuda_cpu_shim.h -- run small CUDA C kernels on the CPU with g++ -std=c++20,
// for logic tests in CI machines that have no GPU.  Part of kvpool.kernels
// (the `emulated` backend); see kvpool_emu.h for the ctypes launch glue.
//
// Supported: threadIdx/blockIdx/blockDim/gridDim, __shared__ (static arrays),
// dynamic shared memory through CUDASHIM_DYN_SMEM(), __syncthreads(),
// __syncwarp(), __shfl_sync/__shfl_xor_sync/__shfl_down_sync/__shfl_up_sync,
// atomics (int/unsigned/float), a few math intrinsics, vector types, and
// __half / __nv_bfloat16 (either minimal built-in types or the real CUDA
// headers when CUDASHIM_REAL_FP16_HEADERS is defined and the CUDA include
// dirs are on the include path).
//
// Backends:
//   default                 : cooperative fibers (ucontext), one OS thread,
//                             deterministic; schedule order selectable
//                             (forward / reverse / random) to expose races.
//   -DCUDASHIM_THREADS      : one std::thread per CUDA thread, std::barrier.
// Blocks of a grid run one after another (so __shared__ == static is safe).
// Divergent barriers (deadlocks), shuffles that read exited lanes and
// partial-mask shuffles are reported and abort().
#pragma once
#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
#error "cuda_cpu_shim.h is for host compilers only"
#endif

#define CUDASHIM 1

// ---- keywords (defined BEFORE any CUDA header so host_defines.h keeps ours)
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
#define __launch_bounds__(...)
#define __grid_constant__
#define __constant__ static
// static __shared__ arrays are collected in one ELF section so that the shim can
// poison them (0xCD) before every block, like uninitialised shared memory.
#define __shared__ static __attribute__((section("cudashim_smem"), aligned(16)))
#ifndef __align__
#define __align__(n) __attribute__((aligned(n)))
#endif

#include <algorithm>
#include <array>
#include <atomic>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <vector>

#ifdef CUDASHIM_THREADS
#include <barrier>
#include <thread>
#else
#include <csetjmp>
#include <ucontext.h>
// Fiber switches: ucontext starts a fiber; later switches use _setjmp/_longjmp, which skip the
// signal-mask system call of swapcontext (10x faster).  Under AddressSanitizer every switch uses
// swapcontext, which ASan understands.
#if defined(__SANITIZE_ADDRESS__)
#define CUDASHIM_UCONTEXT_SWITCH 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define CUDASHIM_UCONTEXT_SWITCH 1
#endif
#endif
#endif

#ifdef CUDASHIM_REAL_FP16_HEADERS
#include <vector_types.h>
#include <vector_functions.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#else
// ---------------------------------------------------------------- vectors
struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned a = 1, unsigned b = 1, unsigned c = 1) : x(a), y(b), z(c) {}
};
struct __attribute__((aligned(16))) uint4 { unsigned x, y, z, w; };
struct __attribute__((aligned(16))) int4 { int x, y, z, w; };
struct __attribute__((aligned(16))) float4 { float x, y, z, w; };
struct __attribute__((aligned(8))) uint2 { unsigned x, y; };
struct __attribute__((aligned(8))) int2 { int x, y; };
struct __attribute__((aligned(8))) float2 { float x, y; };
inline float2 make_float2(float a, float b) { return {a, b}; }
inline float4 make_float4(float a, float b, float c, float d) { return {a, b, c, d}; }
inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return {a, b, c, d}; }

// ----------------------------------------------------- half / bfloat16
struct __half {
  uint16_t __x;
  __half() = default;
  __half(float f) { __x = f2h(f); }
  operator float() const { return h2f(__x); }
  static uint16_t f2h(float f) {  // round to nearest even
    _Float16 h = (_Float16)f;
    uint16_t r; std::memcpy(&r, &h, 2); return r;
  }
  static float h2f(uint16_t b) { _Float16 h; std::memcpy(&h, &b, 2); return (float)h; }
};
struct __nv_bfloat16 {
  uint16_t __x;
  __nv_bfloat16() = default;
  __nv_bfloat16(float f) { __x = f2b(f); }
  operator float() const { return b2f(__x); }
  static uint16_t f2b(float f) {  // round to nearest even, NaN kept quiet
    uint32_t u; std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
  }
  static float b2f(uint16_t b) { uint32_t u = (uint32_t)b << 16; float f; std::memcpy(&f, &u, 4); return f; }
};
struct __attribute__((aligned(4))) __half2 { __half x, y; };
struct __attribute__((aligned(4))) __nv_bfloat162 { __nv_bfloat16 x, y; };
typedef __half half;
typedef __half2 half2;
inline float __half2float(__half h) { return (float)h; }
inline __half __float2half(float f) { return __half(f); }
inline __half __float2half_rn(float f) { return __half(f); }
inline float __bfloat162float(__nv_bfloat16 b) { return (float)b; }
inline __nv_bfloat16 __float2bfloat16(float f) { return __nv_bfloat16(f); }
inline __nv_bfloat16 __float2bfloat16_rn(float f) { return __nv_bfloat16(f); }
inline float2 __half22float2(__half2 h) { return {(float)h.x, (float)h.y}; }
inline float2 __bfloat1622float2(__nv_bfloat162 h) { return {(float)h.x, (float)h.y}; }
inline __half2 __floats2half2_rn(float a, float b) { return {__half(a), __half(b)}; }
inline __nv_bfloat162 __floats2bfloat162_rn(float a, float b) { return {__nv_bfloat16(a), __nv_bfloat16(b)}; }
#endif  // CUDASHIM_REAL_FP16_HEADERS

// ------------------------------------------------------------ math helpers
inline float __expf(float x) { return std::exp(x); }
inline float __logf(float x) { return std::log(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float __frcp_rn(float a) { return 1.0f / a; }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline float __saturatef(float x) { return std::min(1.0f, std::max(0.0f, x)); }
inline int __float_as_int(float f) { int i; std::memcpy(&i, &f, 4); return i; }
inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }
template <typename T> inline T __ldg(const T* p) { return *p; }
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline void __threadfence_block() { std::atomic_thread_fence(std::memory_order_seq_cst); }
#define warpSize 32

// ---------------------------------------------------------------- runtime
namespace cudashim {

[[noreturn]] inline void fail(const char* msg) {
  std::fprintf(stderr, "cudashim: %s\n", msg);
  std::abort();
}

enum class Order { Forward, Reverse, Random };
struct Config {
  Order order = Order::Forward;
  unsigned seed = 1;
  size_t stack_bytes = 256 * 1024;
  bool strict_barriers = true;  // abort if some threads exit and others then hit __syncthreads
};
inline Config& config() { static Config c; return c; }

inline std::vector<unsigned char>& dyn_smem_buf() { static std::vector<unsigned char> b; return b; }
inline void* dyn_smem() { return dyn_smem_buf().data(); }
}  // namespace cudashim
extern "C" char __start_cudashim_smem[] __attribute__((weak, visibility("hidden")));
extern "C" char __stop_cudashim_smem[] __attribute__((weak, visibility("hidden")));
namespace cudashim {
inline void poison_static_smem() {
  if (__start_cudashim_smem && __stop_cudashim_smem)
    std::memset(__start_cudashim_smem, 0xCD, (size_t)(__stop_cudashim_smem - __start_cudashim_smem));
}

}  // namespace cudashim

#define CUDASHIM_DYN_SMEM(T, name) T* name = reinterpret_cast<T*>(cudashim::dyn_smem())

#ifndef CUDASHIM_THREADS
// ============================================================ fiber backend
inline dim3 threadIdx, blockIdx, blockDim, gridDim;

namespace cudashim {
enum State : int { RUNNABLE = 0, WAIT_BLOCK = 1, WAIT_WARP = 2, DONE = 3 };
struct Fiber {
  ucontext_t ctx;
  std::jmp_buf jb;
  bool started = false;
  dim3 tid;
  int state = RUNNABLE;
  int lane = 0, warp = 0;
  int nbar = 0;  // block barriers passed
};
struct BlockRun {
  std::vector<Fiber> f;
  char* stacks = nullptr;
  ucontext_t sched;
  std::jmp_buf sched_jb;
  int cur = -1;
  std::function<void()> body;
  std::vector<std::array<unsigned char, 16>> xchg;  // shuffle slots
  int nwarps = 0;
};
inline BlockRun*& run() { static BlockRun* r = nullptr; return r; }

inline void fiber_entry() {
  BlockRun* r = run();
  r->body();
  r->f[r->cur].state = DONE;
#ifndef CUDASHIM_UCONTEXT_SWITCH
  _longjmp(r->sched_jb, 1);
#endif
  // returning resumes uc_link (= scheduler)
}

// Fiber stacks, reused by every block (grown when a block has more threads).
inline char* fiber_stacks(size_t bytes) {
  static std::unique_ptr<char[]> buf;
  static size_t have = 0;
  if (bytes > have) { buf.reset(new char[bytes]); have = bytes; }
  return buf.get();
}

inline void yield_with(int st) {
  BlockRun* r = run();
  Fiber& me = r->f[r->cur];
  me.state = st;
#ifdef CUDASHIM_UCONTEXT_SWITCH
  swapcontext(&me.ctx, &r->sched);
#else
  if (!_setjmp(me.jb)) _longjmp(r->sched_jb, 1);
#endif
}

inline unsigned live_lane_mask(int warp) {
  BlockRun* r = run();
  unsigned m = 0;
  int n = (int)r->f.size();
  for (int l = 0; l < 32; ++l) {
    int i = warp * 32 + l;
    if (i < n && r->f[i].state != DONE) m |= 1u << l;
  }
  return m;
}

inline void warp_barrier(unsigned mask, const char* what) {
  BlockRun* r = run();
  Fiber& me = r->f[r->cur];
  unsigned live = live_lane_mask(me.warp);
  if ((mask & live) != live) {
    std::fprintf(stderr, "cudashim: %s with mask 0x%08x but live lanes 0x%08x (warp %d) "
                 "-- partial-mask warp ops are not supported\n", what, mask, live, me.warp);
    std::abort();
  }
  yield_with(WAIT_WARP);
}

inline void run_block(dim3 block, const std::function<void()>& body) {
  const Config& cfg = config();
  BlockRun r;
  const int n = (int)(block.x * block.y * block.z);
  r.f.resize(n);
  r.xchg.resize(n);
  r.nwarps = (n + 31) / 32;
  r.body = body;
  r.stacks = fiber_stacks((size_t)n * cfg.stack_bytes);
  run() = &r;
  for (int i = 0; i < n; ++i) {
    Fiber& fb = r.f[i];
    fb.tid = dim3(i % block.x, (i / block.x) % block.y, i / (block.x * block.y));
    fb.lane = i % 32;
    fb.warp = i / 32;
    getcontext(&fb.ctx);
    fb.ctx.uc_stack.ss_sp = r.stacks + (size_t)i * cfg.stack_bytes;
    fb.ctx.uc_stack.ss_size = cfg.stack_bytes;
    fb.ctx.uc_link = &r.sched;
    makecontext(&fb.ctx, (void (*)())fiber_entry, 0);
  }
  std::vector<int> order(n);
  for (int i = 0; i < n; ++i) order[i] = i;
  std::mt19937 rng(cfg.seed + blockIdx.x * 7919u + blockIdx.y * 104729u + blockIdx.z);
  for (;;) {
    if (cfg.order == Order::Reverse) std::reverse(order.begin(), order.end());
    else if (cfg.order == Order::Random) std::shuffle(order.begin(), order.end(), rng);
    for (int i : order) {
      if (r.f[i].state != RUNNABLE) continue;
      r.cur = i;
      threadIdx = r.f[i].tid;
#ifdef CUDASHIM_UCONTEXT_SWITCH
      swapcontext(&r.sched, &r.f[i].ctx);
#else
      if (!_setjmp(r.sched_jb)) {
        if (!r.f[i].started) { r.f[i].started = true; setcontext(&r.f[i].ctx); }
        _longjmp(r.f[i].jb, 1);
      }
#endif
    }
    // everyone is waiting or done: release barriers
    int done = 0, wb = 0;
    for (auto& fb : r.f) { done += fb.state == DONE; wb += fb.state == WAIT_BLOCK; }
    if (done == n) break;
    bool released = false;
    for (int w = 0; w < r.nwarps; ++w) {
      int live = 0, ww = 0;
      for (int l = 0; l < 32 && w * 32 + l < n; ++l) {
        int s = r.f[w * 32 + l].state;
        live += s != DONE; ww += s == WAIT_WARP;
      }
      if (live > 0 && ww == live) {
        for (int l = 0; l < 32 && w * 32 + l < n; ++l)
          if (r.f[w * 32 + l].state == WAIT_WARP) r.f[w * 32 + l].state = RUNNABLE;
        released = true;
      }
    }
    if (!released && wb == n - done) {
      if (done > 0 && cfg.strict_barriers) {
        int gen = 0;
        for (auto& fb : r.f) if (fb.state == WAIT_BLOCK) gen = fb.nbar;
        for (int i = 0; i < n; ++i)
          if (r.f[i].state == DONE && r.f[i].nbar <= gen) {
            std::fprintf(stderr, "cudashim: thread %d of block (%u,%u,%u) exited before __syncthreads #%d "
                         "that other threads reached (divergent barrier)\n", i, blockIdx.x, blockIdx.y,
                         blockIdx.z, gen + 1);
            std::abort();
          }
      }
      for (auto& fb : r.f) if (fb.state == WAIT_BLOCK) { fb.state = RUNNABLE; ++fb.nbar; }
      released = true;
    }
    if (!released) {
      std::fprintf(stderr, "cudashim: deadlock in block (%u,%u,%u): divergent __syncthreads/"
                   "__syncwarp/shuffle. states:", blockIdx.x, blockIdx.y, blockIdx.z);
      for (int i = 0; i < n; ++i) std::fprintf(stderr, " %d", r.f[i].state);
      std::fprintf(stderr, "\n");
      std::abort();
    }
  }
  run() = nullptr;
}

template <typename T>
inline T shfl_impl(unsigned mask, T var, int src_lane, const char* what) {
  static_assert(sizeof(T) <= 16, "shuffle of types > 16 bytes");
  BlockRun* r = run();
  const int me = r->cur;
  const int base = (me / 32) * 32;
  std::memcpy(r->xchg[me].data(), &var, sizeof(T));
  warp_barrier(mask, what);                    // everyone has written
  const int src = base + src_lane;
  T out = var;
  if (src < (int)r->f.size()) {
    if (r->f[src].state == DONE) fail("shuffle reads a lane that has exited");
    std::memcpy(&out, r->xchg[src].data(), sizeof(T));
  }
  warp_barrier(mask, what);                    // everyone has read
  return out;
}
}  // namespace cudashim

inline void __syncthreads() { cudashim::yield_with(cudashim::WAIT_BLOCK); }
inline void __syncwarp(unsigned mask = 0xffffffffu) { cudashim::warp_barrier(mask, "__syncwarp"); }
inline int cudashim_lane() { return cudashim::run()->cur % 32; }

// atomics: fibers never run concurrently, so plain read-modify-write is atomic
template <typename T> inline T atomicAdd(T* p, T v) { T o = *p; *p = o + v; return o; }
template <typename T> inline T atomicMax(T* p, T v) { T o = *p; *p = o > v ? o : v; return o; }
template <typename T> inline T atomicMin(T* p, T v) { T o = *p; *p = o < v ? o : v; return o; }
template <typename T> inline T atomicExch(T* p, T v) { T o = *p; *p = v; return o; }
template <typename T> inline T atomicCAS(T* p, T cmp, T v) { T o = *p; if (o == cmp) *p = v; return o; }

#else
// ========================================================== thread backend
inline thread_local dim3 threadIdx;
inline dim3 blockIdx, blockDim, gridDim;  // written only between blocks

namespace cudashim {
struct ThreadRun {
  std::unique_ptr<std::barrier<>> block_bar;
  std::vector<std::unique_ptr<std::barrier<>>> warp_bar;
  std::vector<std::array<unsigned char, 16>> xchg;
  std::vector<std::atomic<int>> done;
  int n = 0;
  ThreadRun(int n_) : xchg(n_), done(n_), n(n_) {}
};
inline ThreadRun*& trun() { static ThreadRun* r = nullptr; return r; }
inline thread_local int t_linear = 0;

inline void run_block(dim3 block, const std::function<void()>& body) {
  const int n = (int)(block.x * block.y * block.z);
  ThreadRun r(n);
  r.block_bar = std::make_unique<std::barrier<>>(n);
  for (int w = 0; w < (n + 31) / 32; ++w)
    r.warp_bar.push_back(std::make_unique<std::barrier<>>(std::min(32, n - w * 32)));
  trun() = &r;
  std::vector<std::thread> ts;
  ts.reserve(n);
  for (int i = 0; i < n; ++i) {
    ts.emplace_back([&, i] {
      threadIdx = dim3(i % block.x, (i / block.x) % block.y, i / (block.x * block.y));
      t_linear = i;
      body();
      r.done[i].store(1);
      r.warp_bar[i / 32]->arrive_and_drop();   // exited threads leave barriers
      r.block_bar->arrive_and_drop();
    });
  }
  for (auto& t : ts) t.join();
  trun() = nullptr;
}

template <typename T>
inline T shfl_impl(unsigned /*mask*/, T var, int src_lane, const char*) {
  ThreadRun* r = trun();
  const int me = t_linear, base = (me / 32) * 32;
  std::memcpy(r->xchg[me].data(), &var, sizeof(T));
  r->warp_bar[me / 32]->arrive_and_wait();
  const int src = base + src_lane;
  T out = var;
  if (src < r->n) {
    if (r->done[src].load()) fail("shuffle reads a lane that has exited");
    std::memcpy(&out, r->xchg[src].data(), sizeof(T));
  }
  r->warp_bar[me / 32]->arrive_and_wait();
  return out;
}
}  // namespace cudashim

inline void __syncthreads() { cudashim::trun()->block_bar->arrive_and_wait(); }
inline void __syncwarp(unsigned = 0xffffffffu) {
  cudashim::trun()->warp_bar[cudashim::t_linear / 32]->arrive_and_wait();
}
inline int cudashim_lane() { return cudashim::t_linear % 32; }

template <typename T> inline T atomicAdd(T* p, T v) { return std::atomic_ref<T>(*p).fetch_add(v); }
template <typename T> inline T atomicExch(T* p, T v) { return std::atomic_ref<T>(*p).exchange(v); }
template <typename T> inline T atomicCAS(T* p, T cmp, T v) {
  std::atomic_ref<T>(*p).compare_exchange_strong(cmp, v); return cmp;
}
template <typename T> inline T atomicMax(T* p, T v) {
  std::atomic_ref<T> a(*p); T o = a.load();
  while (o < v && !a.compare_exchange_weak(o, v)) {}
  return o;
}
#endif  // backend

// ------------------------------------------------------------ warp shuffles
template <typename T> inline T __shfl_sync(unsigned mask, T var, int src, int width = 32) {
  int lane = cudashim_lane();
  int seg = lane & ~(width - 1);
  return cudashim::shfl_impl(mask, var, seg + (src & (width - 1)), "__shfl_sync");
}
template <typename T> inline T __shfl_xor_sync(unsigned mask, T var, int lane_mask, int width = 32) {
  int lane = cudashim_lane();
  int src = lane ^ lane_mask;
  // CUDA: reading from a later segment of size `width` returns own value
  if ((src & ~(width - 1)) > (lane & ~(width - 1))) src = lane;
  return cudashim::shfl_impl(mask, var, src, "__shfl_xor_sync");
}
template <typename T> inline T __shfl_down_sync(unsigned mask, T var, unsigned delta, int width = 32) {
  int lane = cudashim_lane();
  int seg = lane & ~(width - 1);
  int src = lane + (int)delta;
  if (src >= seg + width) src = lane;
  return cudashim::shfl_impl(mask, var, src, "__shfl_down_sync");
}
template <typename T> inline T __shfl_up_sync(unsigned mask, T var, unsigned delta, int width = 32) {
  int lane = cudashim_lane();
  int seg = lane & ~(width - 1);
  int src = lane - (int)delta;
  if (src < seg) src = lane;
  return cudashim::shfl_impl(mask, var, src, "__shfl_up_sync");
}

// ------------------------------------------------------------------ launch
namespace cudashim {
template <typename K, typename... Args>
inline void launch(dim3 grid, dim3 block, size_t dyn_smem_bytes, K kernel, Args... args) {
  gridDim = grid;
  blockDim = block;
  dyn_smem_buf().assign(dyn_smem_bytes + 16, 0xCD);  // poison, like uninitialised smem
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x) {
        blockIdx = dim3(x, y, z);
        std::fill(dyn_smem_buf().begin(), dyn_smem_buf().end(), (unsigned char)0xCD);
        poison_static_smem();
        run_block(block, [&] { kernel(args...); });
      }
}
}  // namespace cudashim
