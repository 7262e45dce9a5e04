// decode_attention.cu -- paged decode attention (K5).
//
// One CTA per (kv head, group tile, sequence, KV split).  The CTA holds up to
// GT query heads of one kv head's GQA group in registers, so every K/V row is
// read from memory once per kv head.  A group of TG lanes owns one token and
// reads its K and V rows with 16-byte loads; a warp covers TPW tokens per step
// and NW warps stride over the split's tokens.  Softmax is online in fp32; the
// lane groups merge through shuffles, the warps through shared memory.  With
// one split the CTA writes `out`; otherwise it writes a partial output and its
// log-sum-exp, and merge_splits combines them.
//
// Shapes: q, out [S, Hq, D]; k_cache, v_cache [NB, BS, Hkv, D] (NHD);
// block_tables [S, max_blocks] int32; seq_lens [S] int32;
// o_part [S, Hq, P, D] fp32; lse_part [S, Hq, P] fp32.
// The query of sequence s sits at position seq_lens[s] - 1; with window > 0 it
// attends to keys at positions > seq_lens[s] - 1 - window.
#include "common.cuh"

template <typename T, int D, int GT, int NW>
__device__ __forceinline__ void paged_decode_impl(
    const T* __restrict__ q, const T* __restrict__ k_cache, const T* __restrict__ v_cache,
    const int* __restrict__ block_tables, const int* __restrict__ seq_lens, T* __restrict__ out,
    float* __restrict__ o_part, float* __restrict__ lse_part, int num_kv_heads, int group,
    int block_size, int max_blocks, int part_size, int window, float scale) {
  using G = RowGeo<T, D>;
  constexpr int E = G::E, TG = G::TG, TPW = G::TPW;
  const int tiles = (group + GT - 1) / GT;
  const int hkv = blockIdx.x / tiles, tile = blockIdx.x % tiles;
  const int s = blockIdx.y, p = blockIdx.z, P = gridDim.z;
  const int Hq = num_kv_heads * group;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int tg_lane = lane % TG, tok_in_warp = lane / TG;

  const int len = seq_lens[s];
  const int lo = window > 0 ? max(0, len - window) : 0;  // first key the query sees
  const int start = lo + p * part_size;
  const int end = min(len, start + part_size);

  // q (pre-scaled) for the heads of this tile; heads past the group stay zero
  float qf[GT][E];
#pragma unroll
  for (int g = 0; g < GT; ++g) {
    const int hg = tile * GT + g;
    if (hg < group) {
      load_vec<T, E>(q + ((i64)s * Hq + (i64)hkv * group + hg) * D + tg_lane * E, qf[g]);
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

  const int* bt = block_tables + (i64)s * max_blocks;
  for (int t0 = start; t0 < end; t0 += NW * TPW) {
    const int t = t0 + warp * TPW + tok_in_warp;
    const bool valid = t < end;
    float kf[E], vf[E];
    if (valid) {
      const i64 row = ((i64)bt[t / block_size] * block_size + t % block_size) * num_kv_heads + hkv;
      load_vec<T, E>(k_cache + row * D + tg_lane * E, kf);
      load_vec<T, E>(v_cache + row * D + tg_lane * E, vf);
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

  // merge the TPW lane groups of each warp (lanes tg_lane + k * TG)
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
  }

  // merge the warps through shared memory: acc [NW][GT][D], m and d [NW][GT]
  CUDASHIM_DYN_SMEM(float, smem);
  float* sm_acc = smem;
  float* sm_m = smem + NW * GT * D;
  float* sm_d = sm_m + NW * GT;
  if (lane < TG) {
#pragma unroll
    for (int g = 0; g < GT; ++g) {
#pragma unroll
      for (int i = 0; i < E; ++i) sm_acc[(warp * GT + g) * D + lane * E + i] = acc[g][i];
      if (lane == 0) {
        sm_m[warp * GT + g] = m[g];
        sm_d[warp * GT + g] = d[g];
      }
    }
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < GT * D; idx += NW * 32) {
    const int g = idx / D, c = idx % D;
    const int hg = tile * GT + g;
    if (hg >= group) continue;
    float M = KV_NEG_INF;
    for (int w = 0; w < NW; ++w) M = fmaxf(M, sm_m[w * GT + g]);
    float den = 0.f, num = 0.f;
    for (int w = 0; w < NW; ++w) {
      const float f = merge_factor(sm_m[w * GT + g], M);
      den += sm_d[w * GT + g] * f;
      num += sm_acc[(w * GT + g) * D + c] * f;
    }
    const float o = den > 0.f ? __fdividef(num, den) : 0.f;
    const i64 head = (i64)s * Hq + (i64)hkv * group + hg;
    if (P == 1) {
      out[head * D + c] = from_f<T>(o);
    } else {
      o_part[(head * P + p) * D + c] = o;
      if (c == 0) lse_part[head * P + p] = den > 0.f ? M + __logf(den) : KV_NEG_INF;
    }
  }
}

// Merge the P split partials of every (sequence, q head): grid (S * Hq), block D.
template <typename T>
__device__ __forceinline__ void merge_splits_impl(const float* __restrict__ o_part,
                                                  const float* __restrict__ lse_part,
                                                  T* __restrict__ out, int P, int D) {
  const i64 head = blockIdx.x;
  float M = KV_NEG_INF;
  for (int p = 0; p < P; ++p) M = fmaxf(M, lse_part[head * P + p]);
  for (int c = threadIdx.x; c < D; c += blockDim.x) {
    float num = 0.f, den = 0.f;
    for (int p = 0; p < P; ++p) {
      const float w = merge_factor(lse_part[head * P + p], M);
      num += w * o_part[(head * P + p) * D + c];
      den += w;
    }
    out[head * D + c] = from_f<T>(den > 0.f ? __fdividef(num, den) : 0.f);
  }
}

// ---------------------------------------------------------------- entry points
// paged_decode_<dtype>_d<D>_g<GT>: NW = 4 warps (128 threads).
#define KVPOOL_DECODE(SUF, T, D, GT)                                                              \
  extern "C" __global__ void __launch_bounds__(128, 1) paged_decode_##SUF##_d##D##_g##GT(            \
      const T* q, const T* k_cache, const T* v_cache, const int* block_tables, const int* seq_lens, \
      T* out, float* o_part, float* lse_part, int num_kv_heads, int group, int block_size,          \
      int max_blocks, int part_size, int window, float scale) {                                     \
    paged_decode_impl<T, D, GT, 4>(q, k_cache, v_cache, block_tables, seq_lens, out, o_part,        \
                                   lse_part, num_kv_heads, group, block_size, max_blocks,           \
                                   part_size, window, scale);                                       \
  }                                                                                                 \
  KVPOOL_EXPORT(paged_decode_##SUF##_d##D##_g##GT)

#define KVPOOL_DECODE_GROUPS(SUF, T, D) \
  KVPOOL_DECODE(SUF, T, D, 1)           \
  KVPOOL_DECODE(SUF, T, D, 2)           \
  KVPOOL_DECODE(SUF, T, D, 4)           \
  KVPOOL_DECODE(SUF, T, D, 8)

#define KVPOOL_DECODE_DTYPE(SUF, T)                                                         \
  KVPOOL_DECODE_GROUPS(SUF, T, 64)                                                          \
  KVPOOL_DECODE_GROUPS(SUF, T, 128)                                                         \
  KVPOOL_DECODE_GROUPS(SUF, T, 256)                                                         \
  extern "C" __global__ void __launch_bounds__(256)                                         \
      merge_splits_##SUF(const float* o_part, const float* lse_part, T* out, int P, int D) { \
    merge_splits_impl<T>(o_part, lse_part, out, P, D);                                      \
  }                                                                                         \
  KVPOOL_EXPORT(merge_splits_##SUF)

KVPOOL_DECODE_DTYPE(f16, __half)
KVPOOL_DECODE_DTYPE(bf16, __nv_bfloat16)
KVPOOL_DECODE_DTYPE(f32, float)
