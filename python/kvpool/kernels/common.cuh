// common.cuh -- shared helpers of the kvpool kernels.  Every .cu file of
// kvpool.kernels includes this; the Python loader inlines it, so the same text
// compiles with NVRTC (CuPy RawModule) and with g++ under csrc/kvpool_emu.h.
#pragma once

#ifndef CUDASHIM
#include <cuda_fp16.h>
#include <cuda_bf16.h>
// Dynamic shared memory: `extern __shared__` on the GPU, a poisoned buffer under the shim.
#define CUDASHIM_DYN_SMEM(T, name)                              \
  extern __shared__ __align__(16) unsigned char name##_raw_[]; \
  T* name = reinterpret_cast<T*>(name##_raw_)
#define KVPOOL_EXPORT(name)
#endif

#define KV_NEG_INF (-__int_as_float(0x7f800000))

typedef long long i64;

template <typename T> __device__ __forceinline__ float to_f(T x) { return static_cast<float>(x); }
template <> __device__ __forceinline__ float to_f<__half>(__half x) { return __half2float(x); }
template <> __device__ __forceinline__ float to_f<__nv_bfloat16>(__nv_bfloat16 x) {
  return __bfloat162float(x);
}
template <typename T> __device__ __forceinline__ T from_f(float x) { return static_cast<T>(x); }
template <> __device__ __forceinline__ __half from_f<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// Geometry of one K/V row of D elements read with 16-byte loads by a group of
// TG lanes: every lane owns E consecutive elements (LOADS 16-byte vectors), a
// warp covers TPW tokens per step.
template <typename T, int D>
struct RowGeo {
  static constexpr int VEC = 16 / (int)sizeof(T);
  static constexpr int TG = (D / VEC) < 32 ? (D / VEC) : 32;
  static constexpr int E = D / TG;
  static constexpr int LOADS = E / VEC;
  static constexpr int TPW = 32 / TG;
  static_assert(D % VEC == 0 && 32 % TG == 0 && E % VEC == 0, "unsupported head_dim");
};

template <typename T>
union Vec16 {
  uint4 u;
  T e[16 / sizeof(T)];
};

// Load E elements (LOADS 16-byte vectors) starting at p, converted to float.
template <typename T, int E>
__device__ __forceinline__ void load_vec(const T* __restrict__ p, float (&x)[E]) {
  constexpr int VEC = 16 / (int)sizeof(T);
#pragma unroll
  for (int l = 0; l < E / VEC; ++l) {
    Vec16<T> r;
    r.u = reinterpret_cast<const uint4*>(p)[l];
#pragma unroll
    for (int i = 0; i < VEC; ++i) x[l * VEC + i] = to_f(r.e[i]);
  }
}

// Store E floats as T at p with 16-byte vectors.
template <typename T, int E>
__device__ __forceinline__ void store_vec(T* __restrict__ p, const float (&x)[E]) {
  constexpr int VEC = 16 / (int)sizeof(T);
#pragma unroll
  for (int l = 0; l < E / VEC; ++l) {
    Vec16<T> r;
#pragma unroll
    for (int i = 0; i < VEC; ++i) r.e[i] = from_f<T>(x[l * VEC + i]);
    reinterpret_cast<uint4*>(p)[l] = r.u;
  }
}

// Online-softmax state of one query head over the tokens one lane group saw:
// running max m, denominator d (sum of exp(s - m)) and accumulator acc (sum of
// exp(s - m) * v), all in fp32.  Merging two states is associative.
__device__ __forceinline__ float merge_factor(float m_old, float m_new) {
  return m_old == KV_NEG_INF ? 0.f : __expf(m_old - m_new);
}
