// kvpool_emu.h -- glue that turns every `extern "C" __global__` kernel of a
// kvpool .cu file into a ctypes entry point when the file is built for the CPU
// with g++ and cuda_cpu_shim.h (the `emulated` backend of kvpool.kernels).
//
// For a kernel K, KVPOOL_EXPORT(K) defines
//   void kvpool_emu_K(const unsigned* dims, size_t smem, void** args)
//       dims = {grid.x, grid.y, grid.z, block.x, block.y, block.z};
//       args = one pointer per kernel parameter, like cuLaunchKernel's kernelParams
//   const char* kvpool_emu_sig_K()   "8,8,4,..." : sizeof of every parameter,
//       checked by the Python side before the first launch.
#pragma once
#include "cuda_cpu_shim.h"

#include <string>
#include <type_traits>
#include <utility>

namespace kvpool_emu {

template <typename... A, size_t... I>
inline void launch_impl(const unsigned* d, size_t smem, void (*k)(A...), void** args,
                        std::index_sequence<I...>) {
  cudashim::launch(dim3(d[0], d[1], d[2]), dim3(d[3], d[4], d[5]), smem, k,
                   *reinterpret_cast<std::remove_cv_t<std::remove_reference_t<A>>*>(args[I])...);
}

template <typename... A>
inline void launch_packed(const unsigned* d, size_t smem, void (*k)(A...), void** args) {
  launch_impl(d, smem, k, args, std::index_sequence_for<A...>{});
}

template <typename... A>
inline const char* signature(void (*)(A...)) {
  static const std::string s = [] {
    std::string r;
    ((r += std::to_string(sizeof(A)) + ","), ...);
    if (!r.empty()) r.pop_back();
    return r;
  }();
  return s.c_str();
}

}  // namespace kvpool_emu

#define KVPOOL_EXPORT(name)                                                           \
  extern "C" void kvpool_emu_##name(const unsigned* d, size_t smem, void** args) {   \
    kvpool_emu::launch_packed(d, smem, name, args);                                   \
  }                                                                                   \
  extern "C" const char* kvpool_emu_sig_##name() { return kvpool_emu::signature(name); }

// Thread schedule of the fibers: 0 forward, 1 reverse, 2 random (seeded).
extern "C" void kvpool_emu_set_order(int order, unsigned seed) {
  cudashim::config().order = static_cast<cudashim::Order>(order);
  cudashim::config().seed = seed;
}
