// torch.ops.lazyserve.linear(x [M, K], packed [P, K, PANEL], bias [N] or None, N) -> [M, N]:
// linear.inc's micro-kernel for float32 and bfloat16, picked by the CPU's flags;
// torch.ops.lazyserve.panel_width() -> PANEL, the outputs per panel this host's region packs.
#include <vector>

#include "common.h"

#define LZ_BODY "linear.inc"
#include "isa.h"
#undef LZ_BODY

namespace lazyserve {

int64_t panel_width() { return host_isa() == Isa::avx512 ? avx512::PANEL : avx2::PANEL; }

template <class T>
static void run_linear(const at::Tensor& x, const at::Tensor& packed, const T* bias, at::Tensor& y, int64_t N) {
  const int64_t M = x.size(0), K = x.size(1);
  // The kernel broadcasts x as float32: a bfloat16 x is widened once here, not at every panel.
  const float* xf;
  std::vector<float> widened;
  if constexpr (sizeof(T) == 2) {
    widened.resize(M * K);
    const T* xs = data<T>(x);
    for (int64_t i = 0; i < M * K; ++i) widened[i] = get(xs + i);
    xf = widened.data();
  } else {
    xf = data<float>(x);
  }
  if (host_isa() == Isa::avx512)
    avx512::linear<T>(xf, data<T>(packed), bias, mutable_data<T>(y), M, N, K);
  else
    avx2::linear<T>(xf, data<T>(packed), bias, mutable_data<T>(y), M, N, K);
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias, int64_t N) {
  check_isa();
  const int64_t width = panel_width();
  TORCH_CHECK(x.dim() == 2 && packed.dim() == 3 && packed.size(1) == x.size(1) && packed.size(2) == width,
              "linear: x [M, K] and packed panels [P, K, ", width, "], got ", x.sizes(), " and ", packed.sizes());
  TORCH_CHECK(N > 0 && N <= packed.size(0) * width && N > (packed.size(0) - 1) * width, "linear: ", N,
              " outputs do not fill ", packed.size(0), " panels of ", width);
  TORCH_CHECK(x.scalar_type() == packed.scalar_type(), "linear: x and weight of one dtype");
  TORCH_CHECK(x.is_contiguous() && packed.is_contiguous(), "linear: contiguous x and packed weight");
  if (bias.has_value())
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N && bias->scalar_type() == x.scalar_type() &&
                    bias->is_contiguous(),
                "linear: bias [N] of the weight's dtype");
  at::Tensor y = at::empty({x.size(0), N}, x.options());
  if (x.size(0) == 0) return y;
  if (x.scalar_type() == at::kFloat)
    run_linear<float>(x, packed, bias.has_value() ? data<float>(*bias) : nullptr, y, N);
  else if (x.scalar_type() == at::kBFloat16)
    run_linear<uint16_t>(x, packed, bias.has_value() ? data<uint16_t>(*bias) : nullptr, y, N);
  else
    TORCH_CHECK(false, "linear: float32 or bfloat16, got ", x.scalar_type());
  return y;
}

}  // namespace lazyserve

TORCH_LIBRARY_FRAGMENT(lazyserve, m) {
  m.def("linear(Tensor x, Tensor packed, Tensor? bias, int N) -> Tensor");
  m.impl("linear", c10::DispatchKey::CPU, TORCH_FN(lazyserve::linear));
  m.def("panel_width() -> int", &lazyserve::panel_width);
}
