// Compiles the kernel body named by LZ_BODY twice: once for AVX-512 in namespace `avx512`, once
// for AVX2 + FMA in namespace `avx2`, each under its own target pragma, so that one build runs on
// either kind of host and the dispatcher picks the region at run time (common.h's host_isa).
// The body sees VF (vec.h) and LZ_AVX512, and nothing else differs between the two.

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
#define LZ_AVX512 1
namespace lazyserve::avx512 {
#include "vec.h"
#include LZ_BODY
}  // namespace lazyserve::avx512
#undef LZ_AVX512
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#define LZ_AVX512 0
namespace lazyserve::avx2 {
#include "vec.h"
#include LZ_BODY
}  // namespace lazyserve::avx2
#undef LZ_AVX512
#pragma GCC pop_options
