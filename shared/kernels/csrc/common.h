// What every kernel file includes: torch's op registration and threads, and the intrinsics.
#pragma once

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>
#include <torch/types.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <string>

namespace lazyserve {

enum class Isa { none, avx2, avx512 };

// Read once from the CPU's flags: the widest region this host runs (AVX-512 needs F, BW, VL, DQ).
// LAZYSERVE_KERNEL_ISA=avx2 holds an AVX-512 host to the AVX2 region (its tests run there too).
inline Isa host_isa() {
  static const Isa isa = [] {
    __builtin_cpu_init();
    const char* asked = std::getenv("LAZYSERVE_KERNEL_ISA");
    if (asked && std::string(asked) == "avx2" && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
      return Isa::avx2;
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
      return Isa::avx512;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return Isa::avx2;
    return Isa::none;
  }();
  return isa;
}

inline void check_isa() {
  TORCH_CHECK(host_isa() != Isa::none, "lazyserve kernels need AVX2 and FMA, which this CPU lacks");
}

// One scalar in and out of a kernel's storage type (bfloat16 rounds to nearest even, as torch).
inline float get(const float* p) { return *p; }
inline float get(const uint16_t* p) {
  uint32_t bits = static_cast<uint32_t>(*p) << 16;
  float v;
  __builtin_memcpy(&v, &bits, 4);
  return v;
}
inline void put(float v, float* p) { *p = v; }
inline void put(float v, uint16_t* p) {
  uint32_t bits;
  __builtin_memcpy(&bits, &v, 4);
  if (v != v) {
    *p = static_cast<uint16_t>((bits >> 16) | 0x40);
    return;
  }
  *p = static_cast<uint16_t>((bits + 0x7fff + ((bits >> 16) & 1)) >> 16);
}

// bfloat16 tensors are handed to the kernels as their raw 16-bit words.
template <class T>
inline const T* data(const at::Tensor& t) {
  return reinterpret_cast<const T*>(t.data_ptr());
}
template <class T>
inline T* mutable_data(at::Tensor& t) {
  return reinterpret_cast<T*>(t.data_ptr());
}

}  // namespace lazyserve
