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
// Two ops on two layouts of the same weights:
// - w4a8_mm reads the stored layout (qweight uint8 [N, K/2], low nibble = even k, high nibble =
//   odd k): no repack. The activations are written in the matching order instead (per block,
//   the 16 even k then the 16 odd k), once per call. One weight row at a time, reduced across
//   lanes at the end.
// - w4a8_avx2_rows8_mm reads the 8-row interleaved layout (w4a8_common.h; made in place at load
//   by interleave_rows8_inplace): int32 lane j of a 256-bit vector is weight row j, so a tile of
//   8 rows needs no horizontal sum, a block's scale multiply and its float conversion serve 8 rows,
//   and each maddubs uses a whole vector of weights. Activations in k order.
//
// The AVX-512 VNNI ops (w4a8_avx512.cpp) take the same format on a 16-row interleaved layout.
#include "w4a8_common.h"

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include "avx2_math.h"
#include "convert8.h"

#include <algorithm>
#include <cmath>

namespace {

using namespace edge_cpu_int4;
using edge_cpu_math::horizontal_sum;

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

// One call's shapes: x [M, K] times a weight of N rows in groups of group_size.
struct Shape {
  int64_t M, K, N, group_size, groups;
};

// The frame both ops share: the checks, contiguous inputs, the output [M, N], the M activation
// rows quantized by quantize(x_row, K, group_size, q, block_scale, group_sum) into one buffer, then
// tiles(shape, a, weights, scales, offsets, out) for the activation dtype. tile_rows: the weight
// layout's (0 for the stored one).
template <typename Quantize, typename Tiles>
at::Tensor w4a8_frame(const char* name, const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                      const at::Tensor& offsets, int64_t group_size, int64_t tile_rows, Quantize&& quantize,
                      Tiles&& tiles) {
  TORCH_CHECK(x.dim() == 2, name, ": x must be 2-D [M, K], got ", x.sizes());
  TORCH_CHECK(at::isFloatingType(x.scalar_type()), name, ": x must be floating point, got ", x.scalar_type());
  const int64_t M = x.size(0), K = x.size(1), N = qweight.size(0);
  check_weight(name, qweight, scales, offsets, K, group_size, tile_rows);
  const Shape shape{M, K, N, group_size, K / group_size};
  const int64_t groups = shape.groups;
  const at::Tensor xc = x.contiguous();
  const at::Tensor w = qweight.contiguous();
  const at::Tensor s = scales.contiguous();
  const at::Tensor o = offsets.contiguous();
  at::Tensor out = at::empty({M, N}, x.options());
  const ActivationBuffer buffer(M, K, group_size, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, xc.scalar_type(), "w4a8_frame", [&] {
    const scalar_t* xp = xc.data_ptr<scalar_t>();
    at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
      for (int64_t m = begin; m < end; ++m) {
        quantize(xp + m * K, K, group_size, buffer.q + m * K, buffer.block_scale + m * (K / kBlock),
                 buffer.group_sum + m * groups);
      }
    });
    tiles(shape, buffer.activations(), w.data_ptr<uint8_t>(), bf16_bits(s), bf16_bits(o), out.data_ptr<scalar_t>());
  });
  return out;
}

at::Tensor w4a8_mm(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                   const at::Tensor& offsets, int64_t group_size) {
  return w4a8_frame(
      "w4a8_mm", x, qweight, scales, offsets, group_size, 0,
      [](const auto* row, auto... rest) { quantize_row(row, rest...); },
      [](const Shape& shape, const QuantizedActivations& a, const uint8_t* wp, const uint16_t* sp,
         const uint16_t* op, auto* outp) {
        const int64_t M = shape.M, K = shape.K, N = shape.N, group_size = shape.group_size, groups = shape.groups;
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
}

// ---- The 8-row interleaved layout ----

using edge_cpu_convert::load8;
inline __m256 load8(const double* x) {
  return _mm256_set_m128(_mm256_cvtpd_ps(_mm256_loadu_pd(x + 4)), _mm256_cvtpd_ps(_mm256_loadu_pd(x)));
}

inline float horizontal_max(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

// One activation row to int8 per block of 32 (absmax / 127) in k order: quantize_row's values
// (cvtps rounds to nearest even, as nearbyint does), up to the fp32 order of the block sums.
template <typename T>
void quantize_row_k_order(const T* x, int64_t K, int64_t group_size, int8_t* q, float* block_scale,
                          float* group_sum) {
  const int64_t blocks_per_group = group_size / kBlock;
  const __m256 sign = _mm256_set1_ps(-0.f);
  // packs works within 128-bit halves: this puts the 8 groups of 4 bytes back in k order.
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t b = 0; b < K / kBlock; ++b) {
    __m256 v[4];
    for (int i = 0; i < 4; ++i) v[i] = load8(x + b * kBlock + 8 * i);
    const __m256 amax = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                                      _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
    const float d = horizontal_max(amax) / 127.f;
    const __m256 inv = _mm256_set1_ps(d > 0.f ? 1.f / d : 0.f);
    __m256i i32[4];
    for (int i = 0; i < 4; ++i) i32[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));
    const __m256i i8 = _mm256_packs_epi16(_mm256_packs_epi32(i32[0], i32[1]), _mm256_packs_epi32(i32[2], i32[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + b * kBlock), _mm256_permutevar8x32_epi32(i8, order));
    block_scale[b] = d;
    const float sum = horizontal_sum(_mm256_add_ps(_mm256_add_ps(v[0], v[1]), _mm256_add_ps(v[2], v[3])));
    const int64_t g = b / blocks_per_group;
    group_sum[g] = (b % blocks_per_group ? group_sum[g] : 0.f) + sum;
  }
}

// bf16 x 8 -> fp32 lanes.
inline __m256 widen_bf16x8(const uint16_t* p) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}

constexpr int64_t kTile8BlockBytes = kTileRows8 * kBlock / 2;  // 128
// Decode reads each tile once from memory, and a thread's tiles are contiguous: the block this far
// ahead is requested while the current one computes. The hardware prefetcher alone left the op
// short of the box's read bandwidth, most on the small matrices whose streams are short.
constexpr int64_t kTile8PrefetchBytes = 2048;

// One tile (8 weight rows, scales and offsets [group][8 rows]) against R activation rows;
// outputs to out[r * N + j]. Per block of 32 k and activation row: 8 maddubs (u8 weights x s8
// activations, pairs to int16), summed in int16 (32 products of at most 15 * 127 each fit), one
// madd to int32 lanes, one float conversion and one FMA for the tile's 8 rows.
template <int R, typename T>
void tile_rows8(const uint8_t* w, const uint16_t* scale, const uint16_t* offset, int64_t K, int64_t group_size,
                const QuantizedActivations& a, int64_t row0, T* out, int64_t N) {
  const int64_t blocks = K / kBlock;
  const int64_t groups = K / group_size;
  const int64_t blocks_per_group = group_size / kBlock;
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  const int32_t* q[R];
  const float* qs[R];
  const float* gs[R];
  __m256 acc[R];
  for (int r = 0; r < R; ++r) {
    q[r] = reinterpret_cast<const int32_t*>(a.q + (row0 + r) * K);
    qs[r] = a.block_scale + (row0 + r) * blocks;
    gs[r] = a.group_sum + (row0 + r) * groups;
    acc[r] = _mm256_setzero_ps();
  }
  for (int64_t g = 0; g < groups; ++g) {  // m_j,g * sum of x over group g
    const __m256 m = widen_bf16x8(offset + g * kTileRows8);
    for (int r = 0; r < R; ++r) acc[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(gs[r][g]), acc[r]);
  }
  __m256 wscale = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* wb = w + b * kTile8BlockBytes;
    _mm_prefetch(reinterpret_cast<const char*>(wb + kTile8PrefetchBytes), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(wb + kTile8PrefetchBytes + kCacheLine), _MM_HINT_T0);
    __m256i lo[4], hi[4];
    for (int c = 0; c < 4; ++c) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + c * 32));
      lo[c] = _mm256_and_si256(v, low4);
      hi[c] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
    }
    if (b % blocks_per_group == 0) wscale = widen_bf16x8(scale + (b / blocks_per_group) * kTileRows8);
    for (int r = 0; r < R; ++r) {
      const int32_t* x = q[r] + b * (kBlock / 4);  // 8 groups of 4 int8
      // Two chains: low nibbles (k = 8c + 0..3) and high nibbles (8c + 4..7).
      __m256i even = _mm256_maddubs_epi16(lo[0], _mm256_set1_epi32(x[0]));
      __m256i odd = _mm256_maddubs_epi16(hi[0], _mm256_set1_epi32(x[1]));
      for (int c = 1; c < 4; ++c) {
        even = _mm256_add_epi16(even, _mm256_maddubs_epi16(lo[c], _mm256_set1_epi32(x[2 * c])));
        odd = _mm256_add_epi16(odd, _mm256_maddubs_epi16(hi[c], _mm256_set1_epi32(x[2 * c + 1])));
      }
      const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_add_epi16(even, odd), ones));
      acc[r] = _mm256_fmadd_ps(dot, _mm256_mul_ps(wscale, _mm256_set1_ps(qs[r][b])), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    alignas(32) float lanes[kTileRows8];
    _mm256_store_ps(lanes, acc[r]);
    for (int64_t j = 0; j < kTileRows8; ++j) out[r * N + j] = static_cast<T>(lanes[j]);
  }
}

at::Tensor w4a8_avx2_rows8_mm(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                              const at::Tensor& offsets, int64_t group_size) {
  return w4a8_frame(
      "w4a8_avx2_rows8_mm", x, qweight, scales, offsets, group_size, kTileRows8,
      [](const auto* row, auto... rest) { quantize_row_k_order(row, rest...); },
      [](const Shape& shape, const QuantizedActivations& a, const uint8_t* wp, const uint16_t* sp,
         const uint16_t* op, auto* outp) {
        const int64_t M = shape.M, K = shape.K, N = shape.N, group_size = shape.group_size, groups = shape.groups;
        // A tile's 8 x K/2 weight bytes are contiguous and stay in L1/L2 while every activation row
        // passes over them, kRowTile at a time.
        at::parallel_for(0, N / kTileRows8, 1, [&](int64_t begin, int64_t end) {
          for (int64_t t = begin; t < end; ++t) {
            const uint8_t* tw = wp + t * kTileRows8 * (K / 2);
            const uint16_t* ts = sp + t * kTileRows8 * groups;
            const uint16_t* to = op + t * kTileRows8 * groups;
            for (int64_t m = 0; m < M; m += kRowTile) {
              with_row_count(std::min(kRowTile, M - m), [&](auto rows) {
                tile_rows8<decltype(rows)::value>(tw, ts, to, K, group_size, a, m, outp + m * N + t * kTileRows8, N);
              });
            }
          }
        });
      });
}

// The stored triple rearranged into the 8-row layout in place (the kernel class at load: the
// tensors it replaces are not kept). Scales and offsets: bf16 [N, groups] -> [tile][group][8 rows].
void interleave_rows8_inplace(at::Tensor& qweight, at::Tensor& scales, at::Tensor& offsets) {
  interleave_triple_inplace("interleave_rows8_inplace", qweight, scales, offsets, kTileRows8);
}

}  // namespace

TORCH_LIBRARY(edge_cpu_int4, m) {
  m.def("w4a8_mm(Tensor x, Tensor qweight, Tensor scales, Tensor offsets, int group_size) -> Tensor");
  m.def("w4a8_avx2_rows8_mm(Tensor x, Tensor qweight, Tensor scales, Tensor offsets, int group_size) -> Tensor");
  m.def("interleave_rows8_inplace(Tensor(a!) qweight, Tensor(b!) scales, Tensor(c!) offsets) -> ()");
}

TORCH_LIBRARY_IMPL(edge_cpu_int4, CPU, m) {
  m.impl("w4a8_mm", &w4a8_mm);
  m.impl("w4a8_avx2_rows8_mm", &w4a8_avx2_rows8_mm);
  m.impl("interleave_rows8_inplace", &interleave_rows8_inplace);
}
