// prefill_attention.cu -- paged prefill / extend attention (K6).
//
// Sequence s has q_len = cu_seqlens_q[s+1] - cu_seqlens_q[s] queries: its LAST
// q_len positions, so query i sits at position p = seq_lens[s] - q_len + i.
// All its K/V (the queries' own included) are already in the paged cache.
// causal: p attends to keys <= p; window > 0: to keys > p - window.
//
// One CTA per (NW consecutive queries, sequence, kv head x group tile); warp w
// owns query q0 + w and the GT heads of the tile (registers, like the decode
// kernel).  The CTA streams the keys its queries need through shared memory in
// tiles of KT tokens (16-byte cooperative loads), so every warp reads K/V from
// shared memory; each warp masks the keys its own query may not see.
//
// Shapes: q, out [total_q, Hq, D]; k_cache, v_cache [NB, BS, Hkv, D];
// block_tables [S, max_blocks] int32; cu_seqlens_q [S + 1] int32; seq_lens [S] int32.
#include "common.cuh"

template <typename T, int D>
struct PrefillTile {  // tokens per shared-memory K/V tile: 2 * KT * D * sizeof(T) <= 32 KiB
  static constexpr int KT = (16384 / (D * (int)sizeof(T))) < 64 ? 16384 / (D * (int)sizeof(T)) : 64;
};

template <typename T, int D, int GT, int NW>
__device__ __forceinline__ void paged_prefill_impl(
    const T* __restrict__ q, const T* __restrict__ k_cache, const T* __restrict__ v_cache,
    const int* __restrict__ block_tables, const int* __restrict__ cu_seqlens_q,
    const int* __restrict__ seq_lens, T* __restrict__ out, int num_kv_heads, int group,
    int block_size, int max_blocks, int causal, int window, float scale) {
  using G = RowGeo<T, D>;
  constexpr int E = G::E, TG = G::TG, TPW = G::TPW, VEC = G::VEC;
  constexpr int KT = PrefillTile<T, D>::KT;
  constexpr int RV = D / VEC;  // 16-byte vectors per row
  const int s = blockIdx.y;
  const int tiles = (group + GT - 1) / GT;
  const int hkv = blockIdx.z / tiles, tile = blockIdx.z % tiles;
  const int q_begin = cu_seqlens_q[s], q_len = cu_seqlens_q[s + 1] - q_begin;
  const int q0 = blockIdx.x * NW;
  if (q0 >= q_len) return;  // the whole CTA leaves together
  const int len = seq_lens[s];
  const int base = len - q_len;  // position of query 0
  const int Hq = num_kv_heads * group;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int tg_lane = lane % TG, tok_in_warp = lane / TG;

  // keys this CTA needs, and the ones this warp's query sees
  const int q_last = min(q0 + NW, q_len) - 1;
  const int cta_lo = window > 0 ? max(0, base + q0 - window + 1) : 0;
  const int cta_hi = causal ? base + q_last + 1 : len;
  const int qi = q0 + warp;
  const bool q_valid = qi < q_len;
  const int pos = base + qi;
  const int my_lo = window > 0 ? max(0, pos - window + 1) : 0;
  const int my_hi = q_valid ? (causal ? pos + 1 : len) : 0;

  float qf[GT][E];
#pragma unroll
  for (int g = 0; g < GT; ++g) {
    const int hg = tile * GT + g;
    if (q_valid && hg < group) {
      load_vec<T, E>(q + ((i64)(q_begin + qi) * Hq + (i64)hkv * group + hg) * D + tg_lane * E, qf[g]);
#pragma unroll
      for (int i = 0; i < E; ++i) qf[g][i] *= scale;
    } else {
#pragma unroll
      for (int i = 0; i < E; ++i) qf[g][i] = 0.f;
    }
  }
  float m[GT], d[GT], acc[GT][E];
#pragma unroll
  for (int g = 0; g < GT; ++g) {
    m[g] = KV_NEG_INF;
    d[g] = 0.f;
#pragma unroll
    for (int i = 0; i < E; ++i) acc[g][i] = 0.f;
  }

  CUDASHIM_DYN_SMEM(uint4, smem);  // K tile [KT][RV], V tile [KT][RV]
  uint4* sk = smem;
  uint4* sv = smem + KT * RV;
  const int* bt = block_tables + (i64)s * max_blocks;
  for (int k0 = cta_lo; k0 < cta_hi; k0 += KT) {
    __syncthreads();  // the previous tile is consumed
    for (int idx = threadIdx.x; idx < KT * RV; idx += NW * 32) {
      const int j = idx / RV, c = idx % RV, t = k0 + j;
      if (t < cta_hi) {
        const i64 row = ((i64)bt[t / block_size] * block_size + t % block_size) * num_kv_heads + hkv;
        sk[idx] = reinterpret_cast<const uint4*>(k_cache + row * D)[c];
        sv[idx] = reinterpret_cast<const uint4*>(v_cache + row * D)[c];
      }
    }
    __syncthreads();
    for (int j0 = 0; j0 < KT; j0 += TPW) {
      const int j = j0 + tok_in_warp, t = k0 + j;
      const bool valid = t >= my_lo && t < my_hi && t < cta_hi;
      float kf[E], vf[E];
      if (valid) {
        load_vec<T, E>(reinterpret_cast<const T*>(sk + j * RV) + tg_lane * E, kf);
        load_vec<T, E>(reinterpret_cast<const T*>(sv + j * RV) + tg_lane * E, vf);
      } else {
#pragma unroll
        for (int i = 0; i < E; ++i) kf[i] = vf[i] = 0.f;
      }
#pragma unroll
      for (int g = 0; g < GT; ++g) {
        float sc = 0.f;
#pragma unroll
        for (int i = 0; i < E; ++i) sc += qf[g][i] * kf[i];
#pragma unroll
        for (int o = TG / 2; o > 0; o >>= 1) sc += __shfl_xor_sync(0xffffffffu, sc, o);
        if (valid) {
          const float mn = fmaxf(m[g], sc);
          const float a = merge_factor(m[g], mn), b = __expf(sc - mn);
          d[g] = d[g] * a + b;
#pragma unroll
          for (int i = 0; i < E; ++i) acc[g][i] = acc[g][i] * a + b * vf[i];
          m[g] = mn;
        }
      }
    }
  }

  // merge the TPW lane groups of the warp, then lanes 0..TG-1 write the row
#pragma unroll
  for (int g = 0; g < GT; ++g) {
#pragma unroll
    for (int o = TG; o < 32; o <<= 1) {
      const float m2 = __shfl_xor_sync(0xffffffffu, m[g], o);
      const float d2 = __shfl_xor_sync(0xffffffffu, d[g], o);
      const float mn = fmaxf(m[g], m2);
      const float a = merge_factor(m[g], mn), b = merge_factor(m2, mn);
      d[g] = d[g] * a + d2 * b;
#pragma unroll
      for (int i = 0; i < E; ++i) {
        const float x2 = __shfl_xor_sync(0xffffffffu, acc[g][i], o);
        acc[g][i] = acc[g][i] * a + x2 * b;
      }
      m[g] = mn;
    }
    const int hg = tile * GT + g;
    if (q_valid && hg < group && lane < TG) {
      const float inv = d[g] > 0.f ? __fdividef(1.f, d[g]) : 0.f;
#pragma unroll
      for (int i = 0; i < E; ++i) acc[g][i] *= inv;
      store_vec<T, E>(out + ((i64)(q_begin + qi) * Hq + (i64)hkv * group + hg) * D + tg_lane * E,
                      acc[g]);
    }
  }
}

// ---------------------------------------------------------------- entry points
// paged_prefill_<dtype>_d<D>_g<GT>: NW = 4 warps (128 threads), 4 queries per CTA.
#define KVPOOL_PREFILL(SUF, T, D, GT)                                                        \
  extern "C" __global__ void __launch_bounds__(128, 1) paged_prefill_##SUF##_d##D##_g##GT(      \
      const T* q, const T* k_cache, const T* v_cache, const int* block_tables,               \
      const int* cu_seqlens_q, const int* seq_lens, T* out, int num_kv_heads, int group,     \
      int block_size, int max_blocks, int causal, int window, float scale) {                 \
    paged_prefill_impl<T, D, GT, 4>(q, k_cache, v_cache, block_tables, cu_seqlens_q,         \
                                    seq_lens, out, num_kv_heads, group, block_size,          \
                                    max_blocks, causal, window, scale);                      \
  }                                                                                          \
  KVPOOL_EXPORT(paged_prefill_##SUF##_d##D##_g##GT)

#define KVPOOL_PREFILL_GROUPS(SUF, T, D) \
  KVPOOL_PREFILL(SUF, T, D, 1)           \
  KVPOOL_PREFILL(SUF, T, D, 2)           \
  KVPOOL_PREFILL(SUF, T, D, 4)           \
  KVPOOL_PREFILL(SUF, T, D, 8)

#define KVPOOL_PREFILL_DTYPE(SUF, T) \
  KVPOOL_PREFILL_GROUPS(SUF, T, 64)  \
  KVPOOL_PREFILL_GROUPS(SUF, T, 128) \
  KVPOOL_PREFILL_GROUPS(SUF, T, 256)

KVPOOL_PREFILL_DTYPE(f16, __half)
KVPOOL_PREFILL_DTYPE(bf16, __nv_bfloat16)
KVPOOL_PREFILL_DTYPE(f32, float)
