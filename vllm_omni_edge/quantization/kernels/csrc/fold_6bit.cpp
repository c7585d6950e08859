// A 6-bit cpu_int4 layer re-quantized to the 4-bit triple, for kernels without 6-bit codes.
//
// The same values as the reference in Python (quantization/linear.py fold_to_4bit: int4.dequantize
// then int4.quantize with float offsets), one group at a time in registers instead of a dozen
// passes over float copies of the whole layer:
//   w      = float(code) * float(scale) + float(offset)
//   scale4 = bf16 of (max - min) / 15, rounded up to the next bf16 when rounding went below; 1 if 0
//   off4   = bf16 of min
//   q      = clamp(round_half_even((w - float(off4)) / float(scale4)), 0, 15)
// Codes: qweight uint8 [N, K/2] (even k in the low nibble), qweight_high uint8 [N, K/4] (k % 4 at
// bits 2 * (k % 4)) the top two bits of each 6-bit code; scales and offsets bf16 [N, G].
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <vector>

namespace {

// code * scale is exact in float (6-bit codes, 8 significant bits in a bf16 scale), so a fused
// multiply-add gives the sum the reference's separate multiply and add give.
inline __m256 dequantize8(__m256 code, __m256 scale, __m256 offset) { return _mm256_fmadd_ps(code, scale, offset); }

// Eight 6-bit codes k..k+7 (k a multiple of 8) as int32 lanes: code j is nibble j of the four low
// bytes (bits 4j) with bits 2j..2j+1 of the two high bytes on top.
inline __m256i codes8(const uint8_t* low, const uint8_t* high) {
  uint32_t low_bits;
  uint16_t high_bits;
  std::memcpy(&low_bits, low, sizeof(low_bits));
  std::memcpy(&high_bits, high, sizeof(high_bits));
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i nibbles = _mm256_and_si256(
      _mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int32_t>(low_bits)), _mm256_slli_epi32(lane, 2)),
      _mm256_set1_epi32(0x0F));
  const __m256i tops = _mm256_and_si256(
      _mm256_srlv_epi32(_mm256_set1_epi32(high_bits), _mm256_slli_epi32(lane, 1)), _mm256_set1_epi32(3));
  return _mm256_or_si256(nibbles, _mm256_slli_epi32(tops, 4));
}

// Eight 4-bit codes (int32 lanes, 0..15) as four bytes, lane j at bits 4j: even k in the low nibble.
inline uint32_t pack8(__m256i codes) {
  const __m256i placed = _mm256_sllv_epi32(codes, _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28));
  __m128i v = _mm_or_si128(_mm256_castsi256_si128(placed), _mm256_extracti128_si256(placed, 1));
  v = _mm_or_si128(v, _mm_shuffle_epi32(v, 0x4E));
  v = _mm_or_si128(v, _mm_shuffle_epi32(v, 0xB1));
  return static_cast<uint32_t>(_mm_cvtsi128_si32(v));
}

inline float horizontal(__m256 v, bool take_max) {
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, v);
  float r = lanes[0];
  for (int i = 1; i < 8; ++i) r = take_max ? std::max(r, lanes[i]) : std::min(r, lanes[i]);
  return r;
}

inline uint16_t bf16_bits(float f) { return c10::BFloat16(f).x; }

inline float bf16_value(uint16_t bits) {
  c10::BFloat16 b;
  b.x = bits;
  return static_cast<float>(b);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, bool> fold_6bit_to_4bit(const at::Tensor& qweight,
                                                                       const at::Tensor& qweight_high,
                                                                       const at::Tensor& scales,
                                                                       const at::Tensor& offsets) {
  TORCH_CHECK(qweight.dim() == 2 && qweight.scalar_type() == at::kByte, "fold_6bit_to_4bit: qweight must be uint8 "
              "[N, K/2], got ", qweight.scalar_type(), " ", qweight.sizes());
  const int64_t N = qweight.size(0), K = qweight.size(1) * 2;
  TORCH_CHECK(qweight_high.scalar_type() == at::kByte && qweight_high.dim() == 2 && qweight_high.size(0) == N &&
                  qweight_high.size(1) * 4 == K,
              "fold_6bit_to_4bit: qweight_high must be uint8 [", N, ", ", K / 4, "], got ", qweight_high.sizes());
  TORCH_CHECK(scales.scalar_type() == at::kBFloat16 && offsets.scalar_type() == at::kBFloat16 && scales.dim() == 2 &&
                  scales.sizes() == offsets.sizes() && scales.size(0) == N,
              "fold_6bit_to_4bit: scales and offsets must be bf16 [N, G] alike, got ", scales.scalar_type(), " ",
              scales.sizes(), " and ", offsets.scalar_type(), " ", offsets.sizes());
  const int64_t G = scales.size(1);
  TORCH_CHECK(G > 0 && K % G == 0 && (K / G) % 8 == 0, "fold_6bit_to_4bit: ", G, " groups do not divide K=", K,
              " into multiples of 8");
  const int64_t group = K / G;
  const at::Tensor w4 = qweight.contiguous(), hi = qweight_high.contiguous();
  const at::Tensor s6 = scales.contiguous(), o6 = offsets.contiguous();
  at::Tensor q_out = at::empty({N, K / 2}, qweight.options());
  at::Tensor s_out = at::empty({N, G}, scales.options());
  at::Tensor o_out = at::empty({N, G}, offsets.options());
  const uint8_t* lp = w4.data_ptr<uint8_t>();
  const uint8_t* hp = hi.data_ptr<uint8_t>();
  const uint16_t* sp = reinterpret_cast<const uint16_t*>(s6.data_ptr<at::BFloat16>());
  const uint16_t* op = reinterpret_cast<const uint16_t*>(o6.data_ptr<at::BFloat16>());
  uint8_t* qo = q_out.data_ptr<uint8_t>();
  uint16_t* so = reinterpret_cast<uint16_t*>(s_out.data_ptr<at::BFloat16>());
  uint16_t* oo = reinterpret_cast<uint16_t*>(o_out.data_ptr<at::BFloat16>());
  std::atomic<bool> finite{true};
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> w(group);
    const __m256 zero = _mm256_setzero_ps(), fifteen = _mm256_set1_ps(15.f);
    for (int64_t n = begin; n < end; ++n) {
      const uint8_t* low_row = lp + n * (K / 2);
      const uint8_t* high_row = hp + n * (K / 4);
      for (int64_t g = 0; g < G; ++g) {
        const int64_t k0 = g * group;
        const float scale6 = bf16_value(sp[n * G + g]), offset6 = bf16_value(op[n * G + g]);
        const __m256 s = _mm256_set1_ps(scale6), z = _mm256_set1_ps(offset6);
        __m256 lo = _mm256_set1_ps(INFINITY), hi_v = _mm256_set1_ps(-INFINITY);
        for (int64_t i = 0; i < group; i += 8) {
          const __m256 v = dequantize8(_mm256_cvtepi32_ps(codes8(low_row + (k0 + i) / 2, high_row + (k0 + i) / 4)), s, z);
          _mm256_storeu_ps(w.data() + i, v);
          lo = _mm256_min_ps(lo, v);
          hi_v = _mm256_max_ps(hi_v, v);
        }
        const float wmin = horizontal(lo, false), wmax = horizontal(hi_v, true);
        uint8_t* row = qo + n * (K / 2) + k0 / 2;
        // A NaN weight needs a NaN or infinite scale or offset (min and max would drop it); an
        // overflowed product is infinite and kept by them.
        if (!std::isfinite(scale6) || !std::isfinite(offset6) || !std::isfinite(wmin) || !std::isfinite(wmax)) {
          finite.store(false, std::memory_order_relaxed);
          so[n * G + g] = oo[n * G + g] = 0;
          std::fill_n(row, group / 2, 0);
          continue;
        }
        const float exact = (wmax - wmin) / 15.f;
        uint16_t scale_bits = bf16_bits(exact);
        if (bf16_value(scale_bits) < exact) ++scale_bits;  // a positive bf16's next value up
        if (bf16_value(scale_bits) == 0.f) scale_bits = bf16_bits(1.f);
        const uint16_t offset_bits = bf16_bits(wmin);
        so[n * G + g] = scale_bits;
        oo[n * G + g] = offset_bits;
        const __m256 scale4 = _mm256_set1_ps(bf16_value(scale_bits));
        const __m256 offset4 = _mm256_set1_ps(bf16_value(offset_bits));
        for (int64_t i = 0; i < group; i += 8) {
          const __m256 steps = _mm256_div_ps(_mm256_sub_ps(_mm256_loadu_ps(w.data() + i), offset4), scale4);
          const __m256 q = _mm256_min_ps(fifteen, _mm256_max_ps(zero, _mm256_round_ps(
              steps, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)));
          const uint32_t packed = pack8(_mm256_cvtps_epi32(q));
          std::memcpy(row + i / 2, &packed, sizeof(packed));
        }
      }
    }
  });
  return {q_out, s_out, o_out, finite.load()};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(edge_cpu, m) {
  m.def("fold_6bit_to_4bit(Tensor qweight, Tensor qweight_high, Tensor scales, Tensor offsets) -> "
        "(Tensor, Tensor, Tensor, bool)");
}

TORCH_LIBRARY_IMPL(edge_cpu, CPU, m) { m.impl("fold_6bit_to_4bit", &fold_6bit_to_4bit); }
