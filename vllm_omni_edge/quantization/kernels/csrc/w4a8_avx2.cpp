// W4A8 matmul for AVX2 CPUs: cpu_int4 weights (format 2: unsigned 4-bit, per-group bf16
// scale and offset) times activations quantized on the fly to int8 in blocks of 32, the
// Q4_1 x Q8_1 dot product llama.cpp decodes with.
//
// Per 32-block b of a weight row in group g (scale d, offset m) and an activation row
// quantized as x ~= da_b * qa:
//     sum_k w_k x_k ~= d * da_b * sum_k q_k qa_k  +  m * sum_{k in g} x_k
// The integer dot is _mm256_maddubs_epi16 (u8 x s8; 15 * 127 * 2 fits int16) then
// _mm256_madd_epi16; the offset term uses the exact float sum of x, so only the
// activation rounding (<= da_b / 2 per element) adds error to the weight error.
//
// Weights are read in the stored layout (qweight uint8 [N, K/2], low nibble = even k,
// high nibble = odd k): no repack, no second copy. The activations are written in the
// matching order instead (per block, the 16 even k then the 16 odd k), once per call.
//
// The AVX-512 VNNI ops (w4a8_avx512.cpp) take the same format on a 16-row interleaved copy.
#include "w4a8_common.h"

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>

namespace {

using namespace edge_cpu_int4;

// Weight rows per chunk: 16 rows of K = 8960 are 70 KiB, inside a 512 KiB L2.
constexpr int64_t kWeightChunk = 16;
// Decode streams each weight row from memory once: row n + kPrefetchRows is requested
// while row n computes: timed hot in L2 the op looked faster than tinygemm, streamed as a
// forward reads it, it was much slower without this (docs/edge/cpu-4bit.md).
constexpr int64_t kPrefetchRows = 2;
constexpr int64_t kCacheLine = 64;

template <typename T>
void quantize_row(const T* x, int64_t K, int64_t group_size, int8_t* q, float* block_scale,
                  float* group_sum) {
  const int64_t blocks_per_group = group_size / kBlock;
  for (int64_t b = 0; b < K / kBlock; ++b) {
    float v[kBlock];
    float amax = 0.f;
    float sum = 0.f;
    for (int64_t i = 0; i < kBlock; ++i) {
      v[i] = static_cast<float>(x[b * kBlock + i]);
      amax = std::max(amax, std::fabs(v[i]));
      sum += v[i];
    }
    const float d = amax / 127.f;
    const float inv = d > 0.f ? 1.f / d : 0.f;
    int8_t* qb = q + b * kBlock;
    for (int64_t i = 0; i < kBlock / 2; ++i) {
      qb[i] = static_cast<int8_t>(std::nearbyint(v[2 * i] * inv));
      qb[kBlock / 2 + i] = static_cast<int8_t>(std::nearbyint(v[2 * i + 1] * inv));
    }
    block_scale[b] = d;
    const int64_t g = b / blocks_per_group;
    group_sum[g] = (b % blocks_per_group ? group_sum[g] : 0.f) + sum;
  }
}

// 32 weights of one block, in the activations' order: low nibbles, then high nibbles.
inline __m256i unpack_block(const uint8_t* p) {
  const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i low4 = _mm_set1_epi8(0x0F);
  const __m128i even = _mm_and_si128(packed, low4);
  const __m128i odd = _mm_and_si128(_mm_srli_epi16(packed, 4), low4);
  return _mm256_set_m128i(odd, even);
}

inline float horizontal_sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Asks for `rows` weight rows, with their scales and offsets, starting `ahead` rows past w.
// A hint: prefetches never fault, so rows past the last one need no check.
inline void prefetch_rows(const uint8_t* w, const uint16_t* scale, const uint16_t* offset, int64_t K,
                          int64_t groups, int64_t ahead, int64_t rows) {
  const char* next_w = reinterpret_cast<const char*>(w + ahead * (K / 2));
  for (int64_t off = 0; off < rows * (K / 2); off += kCacheLine) _mm_prefetch(next_w + off, _MM_HINT_T0);
  const char* next_s = reinterpret_cast<const char*>(scale + ahead * groups);
  const char* next_o = reinterpret_cast<const char*>(offset + ahead * groups);
  for (int64_t off = 0; off < rows * groups * 2; off += kCacheLine) {
    _mm_prefetch(next_s + off, _MM_HINT_T0);
    _mm_prefetch(next_o + off, _MM_HINT_T0);
  }
}

// One weight row against R activation rows (R <= kRowTile); results to out[r * N], in the
// activations' dtype (rounded once, as a float result's .to() would).
// Prefill takes R = 4: each unpacked weight block serves four activation rows. Decode
// (R = 1) streams one weight row at a time: tiles of 2 or 4 weight rows (independent
// FMA chains) measured slower (docs/edge/cpu-4bit.md), the extra weight streams costing
// more than the FMA latency they hide.
template <int R, typename T>
void dot_row(const uint8_t* w, const uint16_t* scale, const uint16_t* offset, int64_t K,
             int64_t group_size, const QuantizedActivations& a, int64_t row0, T* out,
             int64_t N) {
  const __m256i ones = _mm256_set1_epi16(1);
  const int64_t blocks = K / kBlock;
  const int64_t groups = K / group_size;
  const int64_t blocks_per_group = group_size / kBlock;
  const int8_t* q[R];
  const float* qs[R];
  const float* gs[R];
  __m256 acc[R];
  float offset_term[R];
  for (int r = 0; r < R; ++r) {
    q[r] = a.q + (row0 + r) * K;
    qs[r] = a.block_scale + (row0 + r) * blocks;
    gs[r] = a.group_sum + (row0 + r) * groups;
    acc[r] = _mm256_setzero_ps();
    offset_term[r] = 0.f;
  }
  if (R == 1) prefetch_rows(w, scale, offset, K, groups, kPrefetchRows, 1);
  for (int64_t g = 0; g < groups; ++g) {
    const float d = bf16_to_float(scale[g]);
    const float m = bf16_to_float(offset[g]);
    for (int r = 0; r < R; ++r) offset_term[r] += m * gs[r][g];
    for (int64_t b = g * blocks_per_group; b < (g + 1) * blocks_per_group; ++b) {
      const __m256i wq = unpack_block(w + b * (kBlock / 2));
      for (int r = 0; r < R; ++r) {
        const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q[r] + b * kBlock));
        const __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(wq, x), ones);
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(d * qs[r][b]), acc[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) out[r * N] = static_cast<T>(horizontal_sum(acc[r]) + offset_term[r]);
}

at::Tensor w4a8_mm(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                   const at::Tensor& offsets, int64_t group_size) {
  TORCH_CHECK(x.dim() == 2, "w4a8_mm: x must be 2-D [M, K], got ", x.sizes());
  const int64_t M = x.size(0), K = x.size(1), N = qweight.size(0);
  check_weight("w4a8_mm", qweight, scales, offsets, K, group_size, false);
  const int64_t groups = K / group_size;
  const at::Tensor xc = x.contiguous();
  const at::Tensor w = qweight.contiguous();
  const at::Tensor s = scales.contiguous();
  const at::Tensor o = offsets.contiguous();

  at::Tensor out = at::empty({M, N}, x.options());
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const uint16_t* sp = bf16_bits(s);
  const uint16_t* op = bf16_bits(o);
  const ActivationBuffer buffer(M, K, group_size, x.options());
  const QuantizedActivations a = buffer.activations();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, xc.scalar_type(), "w4a8_mm", [&] {
    const scalar_t* xp = xc.data_ptr<scalar_t>();
    at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
      for (int64_t m = begin; m < end; ++m) {
        quantize_row(xp + m * K, K, group_size, buffer.q + m * K, buffer.block_scale + m * (K / kBlock),
                     buffer.group_sum + m * groups);
      }
    });
    scalar_t* outp = out.data_ptr<scalar_t>();
    // Weight rows in chunks that stay in L2 while every activation tile passes over them.
    at::parallel_for(0, N, kWeightChunk, [&](int64_t begin, int64_t end) {
      for (int64_t n0 = begin; n0 < end; n0 += kWeightChunk) {
        const int64_t n1 = std::min(end, n0 + kWeightChunk);
        for (int64_t m = 0; m < M; m += kRowTile) {
          for (int64_t n = n0; n < n1; ++n) {
            with_row_count(std::min(kRowTile, M - m), [&](auto r) {
              dot_row<decltype(r)::value>(wp + n * (K / 2), sp + n * groups, op + n * groups, K, group_size,
                                          a, m, outp + m * N + n, N);
            });
          }
        }
      }
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(edge_cpu_int4, m) {
  m.def("w4a8_mm(Tensor x, Tensor qweight, Tensor scales, Tensor offsets, int group_size) -> Tensor");
}

TORCH_LIBRARY_IMPL(edge_cpu_int4, CPU, m) { m.impl("w4a8_mm", &w4a8_mm); }
