// torch.ops.lazyserve.linear(x [M, K], weight [N, K], bias [N] or None) -> [M, N]: linear.inc's
// kernel for float32 and bfloat16, picked by the CPU's flags.
#include "common.h"

#define LZ_BODY "linear.inc"
#include "isa.h"
#undef LZ_BODY

namespace lazyserve {

template <class T>
static void run_linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias, at::Tensor& y) {
  const T* b = bias.has_value() ? data<T>(*bias) : nullptr;
  const int64_t M = x.size(0), N = w.size(0), K = x.size(1);
  if (host_isa() == Isa::avx512)
    avx512::linear<T>(data<T>(x), data<T>(w), b, mutable_data<T>(y), M, N, K);
  else
    avx2::linear<T>(data<T>(x), data<T>(w), b, mutable_data<T>(y), M, N, K);
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  check_isa();
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "linear: x [M, K] and weight [N, K], got ",
              x.sizes(), " and ", w.sizes());
  TORCH_CHECK(x.scalar_type() == w.scalar_type(), "linear: x and weight of one dtype");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous(), "linear: contiguous x and weight");
  if (bias.has_value())
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == w.size(0) && bias->scalar_type() == w.scalar_type() &&
                    bias->is_contiguous(),
                "linear: bias [N] of the weight's dtype");
  at::Tensor y = at::empty({x.size(0), w.size(0)}, x.options());
  if (x.scalar_type() == at::kFloat)
    run_linear<float>(x, w, bias, y);
  else if (x.scalar_type() == at::kBFloat16)
    run_linear<uint16_t>(x, w, bias, y);
  else
    TORCH_CHECK(false, "linear: float32 or bfloat16, got ", x.scalar_type());
  return y;
}

}  // namespace lazyserve

TORCH_LIBRARY_FRAGMENT(lazyserve, m) {
  m.def("linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.impl("linear", c10::DispatchKey::CPU, TORCH_FN(lazyserve::linear));
}
