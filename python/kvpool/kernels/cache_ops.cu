// cache_ops.cu -- data movement on the paged KV cache (K2, K3, K4, K7).
// All kernels are byte movers: V is the vector type (uint4 = 16-byte copies;
// unsigned char is the fallback for rows whose size or alignment is not a
// multiple of 16).  Launch geometry is chosen in kvpool/kernels/_ops.py.
#include "common.cuh"

// K2 write_kv: token t's row (num_kv_heads * head_dim elements) goes to slot
// slot_mapping[t] of k_cache / v_cache (NHD, so the slot's row is contiguous).
// grid (num_tokens), block (any); slot < 0 is padding and is skipped.
template <typename V>
__device__ __forceinline__ void write_kv_impl(const char* __restrict__ k, const char* __restrict__ v,
                                              char* __restrict__ k_cache, char* __restrict__ v_cache,
                                              const i64* __restrict__ slot_mapping, i64 row_bytes,
                                              i64 k_stride, i64 v_stride) {
  const i64 t = blockIdx.x;
  const i64 slot = slot_mapping[t];
  if (slot < 0) return;
  const V* ks = reinterpret_cast<const V*>(k + t * k_stride);
  const V* vs = reinterpret_cast<const V*>(v + t * v_stride);
  V* kd = reinterpret_cast<V*>(k_cache + slot * row_bytes);
  V* vd = reinterpret_cast<V*>(v_cache + slot * row_bytes);
  const int n = (int)(row_bytes / (i64)sizeof(V));
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    kd[i] = ks[i];
    vd[i] = vs[i];
  }
}

// K3 copy_blocks / K7 copy_linear_state: in each of grid.y arrays (base
// pointers `ptrs`, row sizes `row_bytes`), copy row src[i] to row dst[i],
// i = blockIdx.x; grid.z splits a row into chunks of chunk_vecs vectors.
template <typename V>
__device__ __forceinline__ void copy_rows_impl(const i64* __restrict__ ptrs,
                                               const i64* __restrict__ row_bytes,
                                               const int* __restrict__ src, const int* __restrict__ dst,
                                               i64 chunk_vecs) {
  const int a = blockIdx.y;
  const i64 rb = row_bytes[a];
  char* base = reinterpret_cast<char*>(ptrs[a]);
  const V* s = reinterpret_cast<const V*>(base + (i64)src[blockIdx.x] * rb);
  V* d = reinterpret_cast<V*>(base + (i64)dst[blockIdx.x] * rb);
  const i64 n = rb / (i64)sizeof(V);
  const i64 hi = min(n, (i64)(blockIdx.z + 1) * chunk_vecs);
  for (i64 i = blockIdx.z * chunk_vecs + threadIdx.x; i < hi; i += blockDim.x) d[i] = s[i];
}

// K4 swap_blocks: block src_ids[i] of src_cache -> block dst_ids[i] of
// dst_cache.  One of the two is pinned host memory, mapped into the device
// address space (UVA), so one launch moves any number of blocks over PCIe.
template <typename V>
__device__ __forceinline__ void swap_blocks_impl(const char* __restrict__ src_cache,
                                                 char* __restrict__ dst_cache,
                                                 const int* __restrict__ src_ids,
                                                 const int* __restrict__ dst_ids, i64 block_bytes,
                                                 i64 chunk_vecs) {
  const V* s = reinterpret_cast<const V*>(src_cache + (i64)src_ids[blockIdx.x] * block_bytes);
  V* d = reinterpret_cast<V*>(dst_cache + (i64)dst_ids[blockIdx.x] * block_bytes);
  const i64 n = block_bytes / (i64)sizeof(V);
  const i64 hi = min(n, (i64)(blockIdx.y + 1) * chunk_vecs);
  for (i64 i = blockIdx.y * chunk_vecs + threadIdx.x; i < hi; i += blockDim.x) d[i] = s[i];
}

// ---------------------------------------------------------------- entry points
#define KVPOOL_CACHE_OPS(SUF, V)                                                                 \
  extern "C" __global__ void __launch_bounds__(256)                                             \
      write_kv_##SUF(const char* k, const char* v, char* k_cache, char* v_cache,                \
                     const i64* slot_mapping, i64 row_bytes, i64 k_stride, i64 v_stride) {      \
    write_kv_impl<V>(k, v, k_cache, v_cache, slot_mapping, row_bytes, k_stride, v_stride);      \
  }                                                                                             \
  KVPOOL_EXPORT(write_kv_##SUF)                                                                 \
  extern "C" __global__ void __launch_bounds__(256)                                             \
      copy_rows_##SUF(const i64* ptrs, const i64* row_bytes, const int* src, const int* dst,    \
                      i64 chunk_vecs) {                                                         \
    copy_rows_impl<V>(ptrs, row_bytes, src, dst, chunk_vecs);                                   \
  }                                                                                             \
  KVPOOL_EXPORT(copy_rows_##SUF)                                                                \
  extern "C" __global__ void __launch_bounds__(256)                                             \
      swap_blocks_##SUF(const char* src_cache, char* dst_cache, const int* src_ids,             \
                        const int* dst_ids, i64 block_bytes, i64 chunk_vecs) {                  \
    swap_blocks_impl<V>(src_cache, dst_cache, src_ids, dst_ids, block_bytes, chunk_vecs);       \
  }                                                                                             \
  KVPOOL_EXPORT(swap_blocks_##SUF)

KVPOOL_CACHE_OPS(v16, uint4)
KVPOOL_CACHE_OPS(v1, unsigned char)
