// torch.ops.lazyserve.decode_attention: attention.inc's kernel for float32 and bfloat16.
//   q [R, H, D]; k, v [S, Hkv, C, D] (a DecodeSlots store or one cache's buffers; rows
//   contiguous); positions [S, C] int64; sizes [S] int64 (rows held per slot); row_slot [R]
//   int64; limits [R] int64 (a query sees keys at positions <= its limit); live [S, W] bool or
//   None (position p of slot s is live where p >= W or live[s, p]); window: 0 or a sliding
//   window. Returns [R, H, D].
#include <cmath>
#include <vector>

#include "common.h"

#define LZ_BODY "attention.inc"
#include "isa.h"
#undef LZ_BODY

namespace lazyserve {

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& positions, const at::Tensor& sizes, const at::Tensor& row_slot,
                            const at::Tensor& limits, const c10::optional<at::Tensor>& live, int64_t window,
                            double scale) {
  check_isa();
  TORCH_CHECK(q.dim() == 3 && k.dim() == 4 && v.sizes() == k.sizes(), "decode_attention: q [R, H, D], k and v [S, Hkv, C, D]");
  const int64_t R = q.size(0), H = q.size(1), D = q.size(2), S = k.size(0), Hkv = k.size(1);
  TORCH_CHECK(k.size(3) == D && H % Hkv == 0, "decode_attention: head dims and groups");
  TORCH_CHECK(D % 16 == 0 && D <= 512 && H / Hkv <= 8, "decode_attention: head dim a multiple of 16 up to 512, at most 8 query heads a KV head");
  TORCH_CHECK(q.is_contiguous(), "decode_attention: contiguous q");
  TORCH_CHECK(k.stride(3) == 1 && k.stride(2) == D && v.strides() == k.strides(), "decode_attention: K/V rows contiguous, one layout");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && k.scalar_type() == v.scalar_type(), "decode_attention: one dtype");
  TORCH_CHECK(positions.dim() == 2 && positions.size(0) == S && positions.stride(1) == 1 &&
                  positions.scalar_type() == at::kLong,
              "decode_attention: positions [S, C] int64");
  for (const at::Tensor* t : {&sizes, &row_slot, &limits})
    TORCH_CHECK(t->dim() == 1 && t->is_contiguous() && t->scalar_type() == at::kLong, "decode_attention: int64 vectors");
  TORCH_CHECK(sizes.size(0) == S && row_slot.size(0) == R && limits.size(0) == R, "decode_attention: one size a slot, one slot and limit a row");
  const int64_t* slot_of = row_slot.data_ptr<int64_t>();
  const int64_t* held = sizes.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r)
    TORCH_CHECK(slot_of[r] >= 0 && slot_of[r] < S && held[slot_of[r]] <= k.size(2), "decode_attention: a row's slot or size out of range");
  const bool* live_flags = nullptr;
  int64_t live_width = 0;
  if (live.has_value()) {
    TORCH_CHECK(live->dim() == 2 && live->size(0) == S && live->is_contiguous() && live->scalar_type() == at::kBool,
                "decode_attention: live [S, W] bool, contiguous");
    live_flags = live->data_ptr<bool>();
    live_width = live->size(1);
  }
  at::Tensor out = at::empty_like(q);
  avx2::AttnShape shape2{H, Hkv, D, k.stride(0), k.stride(1), positions.stride(0), live_width, window, static_cast<float>(scale)};
  avx512::AttnShape shape5{H, Hkv, D, k.stride(0), k.stride(1), positions.stride(0), live_width, window, static_cast<float>(scale)};
  auto run = [&](auto tag) {
    using T = decltype(tag);
    if (host_isa() == Isa::avx512)
      avx512::decode_attention<T>(shape5, data<T>(q), data<T>(k), data<T>(v), positions.data_ptr<int64_t>(), held,
                                  slot_of, limits.data_ptr<int64_t>(), live_flags, mutable_data<T>(out), R);
    else
      avx2::decode_attention<T>(shape2, data<T>(q), data<T>(k), data<T>(v), positions.data_ptr<int64_t>(), held,
                                slot_of, limits.data_ptr<int64_t>(), live_flags, mutable_data<T>(out), R);
  };
  if (q.scalar_type() == at::kFloat)
    run(float{});
  else if (q.scalar_type() == at::kBFloat16)
    run(uint16_t{});
  else
    TORCH_CHECK(false, "decode_attention: float32 or bfloat16, got ", q.scalar_type());
  return out;
}

}  // namespace lazyserve

TORCH_LIBRARY_FRAGMENT(lazyserve, m) {
  m.def(
      "decode_attention(Tensor q, Tensor k, Tensor v, Tensor positions, Tensor sizes, Tensor row_slot, Tensor limits, "
      "Tensor? live, int window, float scale) -> Tensor");
  m.impl("decode_attention", c10::DispatchKey::CPU, TORCH_FN(lazyserve::decode_attention));
}
