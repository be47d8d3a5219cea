// torch.ops.lazyserve.rms_norm, silu_mul, rope: rows.inc's fused row work, float32 and bfloat16.
#include <cmath>
#include <vector>

#include "common.h"

#define LZ_BODY "rows.inc"
#include "isa.h"
#undef LZ_BODY

namespace lazyserve {

// Calls `body` with the storage type of t's dtype (float or bfloat16's 16-bit words).
template <class F>
static void by_dtype(const at::Tensor& t, const char* op, F&& body) {
  if (t.scalar_type() == at::kFloat)
    body(float{});
  else if (t.scalar_type() == at::kBFloat16)
    body(uint16_t{});
  else
    TORCH_CHECK(false, op, ": float32 or bfloat16, got ", t.scalar_type());
}

static void same(const at::Tensor& a, const at::Tensor& b, const char* op) {
  TORCH_CHECK(a.scalar_type() == b.scalar_type() && a.is_contiguous() && b.is_contiguous(), op,
              ": contiguous tensors of one dtype");
}

// (normed, summed): summed is x + residual where a residual is given, else an empty tensor.
std::tuple<at::Tensor, at::Tensor> rms_norm(const at::Tensor& x, const c10::optional<at::Tensor>& residual,
                                            const at::Tensor& weight, double eps, bool unit_offset) {
  check_isa();
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 1 && weight.size(0) == x.size(1), "rms_norm: x [M, H], weight [H]");
  same(x, weight, "rms_norm");
  if (residual.has_value()) {
    TORCH_CHECK(residual->sizes() == x.sizes(), "rms_norm: residual as x");
    same(x, *residual, "rms_norm");
  }
  at::Tensor out = at::empty_like(x);
  at::Tensor summed = residual.has_value() ? at::empty_like(x) : at::empty({0}, x.options());
  by_dtype(x, "rms_norm", [&](auto tag) {
    using T = decltype(tag);
    const T* r = residual.has_value() ? data<T>(*residual) : nullptr;
    T* s = residual.has_value() ? mutable_data<T>(summed) : nullptr;
    if (host_isa() == Isa::avx512)
      avx512::rms_norm<T>(data<T>(x), r, data<T>(weight), mutable_data<T>(out), s, x.size(0), x.size(1), eps, unit_offset);
    else
      avx2::rms_norm<T>(data<T>(x), r, data<T>(weight), mutable_data<T>(out), s, x.size(0), x.size(1), eps, unit_offset);
  });
  return {out, summed};
}

at::Tensor silu_mul(const at::Tensor& gate, const at::Tensor& up) {
  check_isa();
  TORCH_CHECK(gate.sizes() == up.sizes(), "silu_mul: gate and up of one shape");
  same(gate, up, "silu_mul");
  at::Tensor out = at::empty_like(gate);
  by_dtype(gate, "silu_mul", [&](auto tag) {
    using T = decltype(tag);
    if (host_isa() == Isa::avx512)
      avx512::silu_mul<T>(data<T>(gate), data<T>(up), mutable_data<T>(out), gate.numel());
    else
      avx2::silu_mul<T>(data<T>(gate), data<T>(up), mutable_data<T>(out), gate.numel());
  });
  return out;
}

// x [M, heads, D] rotated at positions [M] by the tables cos, sin [P, D].
at::Tensor rope(const at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin) {
  check_isa();
  TORCH_CHECK(x.dim() == 3 && cos.dim() == 2 && cos.sizes() == sin.sizes() && cos.size(1) == x.size(2),
              "rope: x [M, heads, D], cos and sin [P, D]");
  TORCH_CHECK(x.size(2) % 32 == 0, "rope: head dim a multiple of 32");
  same(x, cos, "rope");
  same(cos, sin, "rope");
  TORCH_CHECK(positions.dim() == 1 && positions.size(0) == x.size(0) && positions.scalar_type() == at::kLong &&
                  positions.is_contiguous(),
              "rope: positions [M] int64");
  const int64_t* at_ = positions.data_ptr<int64_t>();
  for (int64_t m = 0; m < x.size(0); ++m)
    TORCH_CHECK(at_[m] >= 0 && at_[m] < cos.size(0), "rope: a position past the tables");
  at::Tensor out = at::empty_like(x);
  by_dtype(x, "rope", [&](auto tag) {
    using T = decltype(tag);
    if (host_isa() == Isa::avx512)
      avx512::rope<T>(data<T>(x), at_, data<T>(cos), data<T>(sin), mutable_data<T>(out), x.size(0), x.size(1), x.size(2));
    else
      avx2::rope<T>(data<T>(x), at_, data<T>(cos), data<T>(sin), mutable_data<T>(out), x.size(0), x.size(1), x.size(2));
  });
  return out;
}

}  // namespace lazyserve

TORCH_LIBRARY_FRAGMENT(lazyserve, m) {
  m.def("rms_norm(Tensor x, Tensor? residual, Tensor weight, float eps, bool unit_offset) -> (Tensor, Tensor)");
  m.impl("rms_norm", c10::DispatchKey::CPU, TORCH_FN(lazyserve::rms_norm));
  m.def("silu_mul(Tensor gate, Tensor up) -> Tensor");
  m.impl("silu_mul", c10::DispatchKey::CPU, TORCH_FN(lazyserve::silu_mul));
  m.def("rope(Tensor x, Tensor positions, Tensor cos, Tensor sin) -> Tensor");
  m.impl("rope", c10::DispatchKey::CPU, TORCH_FN(lazyserve::rope));
}
