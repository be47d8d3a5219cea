// The vector type a kernel's inner loop uses, for the instruction set of the region that includes
// this file (isa.h includes it once per region, inside that region's namespace, with LZ_AVX512
// set or not). Every reduction here runs in one fixed order: a kernel built on it sums alike
// whatever rows or threads share its call.

#if LZ_AVX512
struct VF {
  static constexpr int W = 16;
  __m512 v;
  VF() = default;
  VF(__m512 x) : v(x) {}
  static VF zero() { return _mm512_setzero_ps(); }
  static VF set1(float x) { return _mm512_set1_ps(x); }
  static VF load(const float* p) { return _mm512_loadu_ps(p); }
  static VF load(const uint16_t* p) {  // bfloat16 -> float32: the bits move up 16
    __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  // The first n (< W) lanes, zeros after.
  static VF load_part(const float* p, int n) { return _mm512_maskz_loadu_ps((__mmask16)((1u << n) - 1), p); }
  static VF load_part(const uint16_t* p, int n) {
    __m256i h = _mm256_maskz_loadu_epi16((__mmask16)((1u << n) - 1), p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  void store(float* p) const { _mm512_storeu_ps(p, v); }
  void store(uint16_t* p) const { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), to_bf16()); }
  void store_part(float* p, int n) const { _mm512_mask_storeu_ps(p, (__mmask16)((1u << n) - 1), v); }
  void store_part(uint16_t* p, int n) const {
    _mm256_mask_storeu_epi16(p, (__mmask16)((1u << n) - 1), to_bf16());
  }
  // Round to nearest even, as torch's float -> bfloat16 conversion (NaN stays NaN).
  __m256i to_bf16() const {
    __m512i bits = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_or_si512(bits, _mm512_set1_epi32(0x400000)));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
  }
  VF operator+(VF b) const { return _mm512_add_ps(v, b.v); }
  VF operator-(VF b) const { return _mm512_sub_ps(v, b.v); }
  VF operator*(VF b) const { return _mm512_mul_ps(v, b.v); }
  static VF fma(VF a, VF b, VF c) { return _mm512_fmadd_ps(a.v, b.v, c.v); }  // a * b + c
  static VF max(VF a, VF b) { return _mm512_max_ps(a.v, b.v); }
  static VF min(VF a, VF b) { return _mm512_min_ps(a.v, b.v); }
  static VF div(VF a, VF b) { return _mm512_div_ps(a.v, b.v); }
  // Sum of the lanes, halves folded in a fixed order: 16 -> 8 -> 4 -> 2 -> 1.
  float sum() const {
    __m256 a = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
    __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    b = _mm_add_ps(b, _mm_movehl_ps(b, b));
    b = _mm_add_ss(b, _mm_movehdup_ps(b));
    return _mm_cvtss_f32(b);
  }
  float hmax() const { return _mm512_reduce_max_ps(v); }
  VF sqrt() const { return _mm512_sqrt_ps(v); }
  // Scale by 2^n, n integral in float lanes (exp's last step).
  static VF pow2(VF n) {
    __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n.v), _mm512_set1_epi32(127)), 23);
    return _mm512_castsi512_ps(e);
  }
  static VF round(VF x) { return _mm512_roundscale_ps(x.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static VF keep_first(VF a, int n) { return _mm512_maskz_mov_ps((__mmask16)((1u << n) - 1), a.v); }
  // a where x >= lo, else 0
  static VF keep_ge(VF a, VF x, VF lo) { return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x.v, lo.v, _CMP_GE_OQ), a.v); }
};
#else
struct VF {
  static constexpr int W = 8;
  __m256 v;
  VF() = default;
  VF(__m256 x) : v(x) {}
  static __m256i mask(int n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  }
  static VF zero() { return _mm256_setzero_ps(); }
  static VF set1(float x) { return _mm256_set1_ps(x); }
  static VF load(const float* p) { return _mm256_loadu_ps(p); }
  static VF load(const uint16_t* p) {
    __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  static VF load_part(const float* p, int n) { return _mm256_maskload_ps(p, mask(n)); }
  static VF load_part(const uint16_t* p, int n) {
    alignas(32) uint16_t tmp[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int i = 0; i < n; ++i) tmp[i] = p[i];
    return load(tmp);
  }
  void store(float* p) const { _mm256_storeu_ps(p, v); }
  void store(uint16_t* p) const { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), to_bf16()); }
  void store_part(float* p, int n) const { _mm256_maskstore_ps(p, mask(n), v); }
  void store_part(uint16_t* p, int n) const {
    alignas(16) uint16_t tmp[8];
    _mm_store_si128(reinterpret_cast<__m128i*>(tmp), to_bf16());
    for (int i = 0; i < n; ++i) p[i] = tmp[i];
  }
  __m128i to_bf16() const {
    __m256i bits = _mm256_castps_si256(v);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
    __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    rounded = _mm256_blendv_epi8(rounded, _mm256_or_si256(bits, _mm256_set1_epi32(0x400000)), nan);
    __m256i hi = _mm256_srli_epi32(rounded, 16);
    // pack 8 x u32 (each < 2^16) into 8 x u16, in lane order
    __m128i lo128 = _mm256_castsi256_si128(hi), hi128 = _mm256_extracti128_si256(hi, 1);
    return _mm_packus_epi32(lo128, hi128);
  }
  VF operator+(VF b) const { return _mm256_add_ps(v, b.v); }
  VF operator-(VF b) const { return _mm256_sub_ps(v, b.v); }
  VF operator*(VF b) const { return _mm256_mul_ps(v, b.v); }
  static VF fma(VF a, VF b, VF c) { return _mm256_fmadd_ps(a.v, b.v, c.v); }
  static VF max(VF a, VF b) { return _mm256_max_ps(a.v, b.v); }
  static VF min(VF a, VF b) { return _mm256_min_ps(a.v, b.v); }
  static VF div(VF a, VF b) { return _mm256_div_ps(a.v, b.v); }
  float sum() const {  // 8 -> 4 -> 2 -> 1
    __m128 b = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    b = _mm_add_ps(b, _mm_movehl_ps(b, b));
    b = _mm_add_ss(b, _mm_movehdup_ps(b));
    return _mm_cvtss_f32(b);
  }
  float hmax() const {
    __m128 b = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    b = _mm_max_ps(b, _mm_movehl_ps(b, b));
    b = _mm_max_ss(b, _mm_movehdup_ps(b));
    return _mm_cvtss_f32(b);
  }
  VF sqrt() const { return _mm256_sqrt_ps(v); }
  static VF pow2(VF n) {
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n.v), _mm256_set1_epi32(127)), 23);
    return _mm256_castsi256_ps(e);
  }
  static VF round(VF x) { return _mm256_round_ps(x.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static VF keep_first(VF a, int n) { return _mm256_and_ps(_mm256_castsi256_ps(mask(n)), a.v); }
  static VF keep_ge(VF a, VF x, VF lo) { return _mm256_and_ps(_mm256_cmp_ps(x.v, lo.v, _CMP_GE_OQ), a.v); }
};
#endif

// exp(x), Cephes' polynomial: within 2 ulp of expf over [-87, 88]; 0 below -87, exp(88) above.
static inline VF vexp(VF x) {
  const VF lo = VF::set1(-87.0f);
  VF clamped = VF::min(VF::max(x, lo), VF::set1(88.0f));
  VF n = VF::round(clamped * VF::set1(1.44269504088896341f));
  VF r = VF::fma(n, VF::set1(-0.693359375f), clamped);
  r = VF::fma(n, VF::set1(2.12194440e-4f), r);
  VF p = VF::set1(1.9875691500e-4f);
  p = VF::fma(p, r, VF::set1(1.3981999507e-3f));
  p = VF::fma(p, r, VF::set1(8.3334519073e-3f));
  p = VF::fma(p, r, VF::set1(4.1665795894e-2f));
  p = VF::fma(p, r, VF::set1(1.6666665459e-1f));
  p = VF::fma(p, r, VF::set1(5.0000001201e-1f));
  VF r2 = r * r;
  p = VF::fma(p, r2, r + VF::set1(1.0f));
  VF out = p * VF::pow2(n);
  // lanes below the range: exactly 0 (their weight in a softmax is below float32's smallest normal)
  return VF::keep_ge(out, x, lo);
}

// v rounded to bfloat16's precision (nearest even) and widened back: what storing it as
// bfloat16 and loading it again gives, so a fused kernel rounds where torch's separate ops do.
static inline VF round_bf16(VF v) {
  alignas(64) uint16_t tmp[VF::W];
  v.store(tmp);
  return VF::load(tmp);
}

// A value as the storage type T holds it: float32 as is, bfloat16 rounded.
template <class T>
static inline VF as_stored(VF v) {
  if constexpr (sizeof(T) == 2)
    return round_bf16(v);
  else
    return v;
}
