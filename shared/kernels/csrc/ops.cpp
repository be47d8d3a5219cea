// What the Python face asks of the build itself: which vector region this host runs.
#include "common.h"

namespace lazyserve {

std::string isa() {
  switch (host_isa()) {
    case Isa::avx512:
      return "avx512";
    case Isa::avx2:
      return "avx2";
    default:
      return "none";
  }
}

// Whether this CPU multiplies bfloat16 in hardware (AVX512-BF16, which every AMX CPU also has):
// there torch's bfloat16 products outrun the row kernels from a few rows on.
bool bf16_matmul() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512bf16");
}

}  // namespace lazyserve

TORCH_LIBRARY_FRAGMENT(lazyserve, m) {
  m.def("isa() -> str", &lazyserve::isa);
  m.def("bf16_matmul() -> bool", &lazyserve::bf16_matmul);
}
