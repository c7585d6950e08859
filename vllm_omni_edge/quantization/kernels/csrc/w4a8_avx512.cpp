// W4A8 with AVX-512 VNNI on a 16-row interleaved layout, the bf16 prefill path from that
// layout, and a gated SiLU MLP on it: the same cpu_int4 weights and int8 activations per block
// of 32 as w4a8_avx2.cpp (the same integer dot products, vpdpbusd instead of maddubs).
//
// Ops: w4a8_vnni_rows16_mm (a linear), w4a8_vnni_rows16_silu_mlp (down(silu(gate) * up) in one
// call), rows16_group_codes_inplace and interleave_rows16_inplace (the stored layout to the 16-row
// one at load, with 8-bit group codes or with the stored bf16 scales and offsets; the linear ops
// read either), interleave_rows16_high_bits_inplace (a 6-bit layer's top-bits plane, which the
// linear ops take as high_bits), rows16_dequantize, set_bf16_prefill and rows16_path_counts (the
// prefill path's setting and counters).
// The vector functions carry their own target attribute, so the library still loads, and
// w4a8_mm still runs, on AVX2-only CPUs; these ops refuse to run on a CPU without VNNI.
#include "w4a8_common.h"

#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <torch/library.h>

#include <immintrin.h>
#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#ifdef EDGE_ONEDNN
#include <oneapi/dnnl/dnnl.hpp>
#endif

namespace {

using namespace edge_cpu_int4;

#define EDGE_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")))

// 16 activations as fp32 lanes.
EDGE_VNNI inline __m512 load16(const float* x) { return _mm512_loadu_ps(x); }
EDGE_VNNI inline __m512 load16(const double* x) {
  const __m256 lo = _mm512_cvtpd_ps(_mm512_loadu_pd(x));
  const __m256 hi = _mm512_cvtpd_ps(_mm512_loadu_pd(x + 8));
  return _mm512_insertf32x8(_mm512_castps256_ps512(lo), hi, 1);
}
EDGE_VNNI inline __m512 load16(const c10::Half* x) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)));
}
EDGE_VNNI inline __m512 load16(const c10::BFloat16* x) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

// One activation row to int8 per block of 32 (absmax / 127), in k order: the values
// w4a8_avx2.cpp's quantize_row gives (which writes them in the nibble order), up to the fp32
// order of the block sums; cvtps rounds to nearest even, as nearbyint does. Vectorised: the
// scalar loop was a fifth of a decode call at SmolLM2's K.
template <typename T>
EDGE_VNNI void quantize_row_vnni(const T* x, int64_t K, int64_t group_size, int8_t* q,
                                 float* block_scale, float* group_sum) {
  const int64_t blocks_per_group = group_size / kBlock;
  const __m512 sign = _mm512_set1_ps(-0.f);
  for (int64_t b = 0; b < K / kBlock; ++b) {
    const __m512 v0 = load16(x + b * kBlock);
    const __m512 v1 = load16(x + b * kBlock + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_andnot_ps(sign, v0), _mm512_andnot_ps(sign, v1)));
    const float d = amax / 127.f;
    const __m512 inv = _mm512_set1_ps(d > 0.f ? 1.f / d : 0.f);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + b * kBlock),
                     _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(v0, inv))));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + b * kBlock + 16),
                     _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(v1, inv))));
    block_scale[b] = d;
    const float sum = _mm512_reduce_add_ps(_mm512_add_ps(v0, v1));
    const int64_t g = b / blocks_per_group;
    group_sum[g] = (b % blocks_per_group ? group_sum[g] : 0.f) + sum;
  }
}

// The 16-row interleaved layout (w4a8_vnni_rows16_mm). Within a tile of 16 weight rows, block
// b of 32 k is 4 chunks of 64 bytes; byte 4j + i of chunk c holds row j's k = 8c + i (low
// nibble) and k = 8c + 4 + i (high nibble). One vpdpbusd then multiplies 16 rows by 4 k with
// the 4 activations broadcast: int32 lane j is row j, so a tile ends as 16 finished outputs
// with no horizontal sum, and every weight byte is used by one instruction (a per-row layout
// would reduce each row across lanes and move scales between lanes per block pair).
// Scales and offsets of a tile are [group][16 rows], so one widen gives the 16 rows' values.
constexpr int64_t kTileBlockBytes = kTileRows * kBlock / 2;  // 256

// 6-bit layers carry a second plane, the top two bits of each code (code = low nibble + 16 *
// top bits; int4.py): per tile and block of 32 k, 4 chunks of 32 bytes; byte p of chunk c holds
// the 2-bit fields of the low-nibble vector's bytes p (bits 0-1) and p + 32 (bits 2-3) and of the
// high-nibble vector's bytes p (bits 4-5) and p + 32 (bits 6-7) (interleave_rows16_high_bits_inplace
// makes it from the stored plane at load).
constexpr int64_t kTileBlockHighBytes = kTileRows * kBlock / 4;  // 128

// A chunk's top bits added into its two nibble vectors (bits 4-5 of each byte): one broadcast load,
// a variable shift per 256-bit half, a mask.
EDGE_VNNI inline void add_high_bits(const uint8_t* chunk, __m512i& lo, __m512i& hi) {
  const __m512i v = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk)));
  const __m512i mask = _mm512_set1_epi8(0x30);
  const __m512i left = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(2), 1);
  const __m512i right = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1);
  lo = _mm512_or_si512(lo, _mm512_and_si512(_mm512_sllv_epi16(v, left), mask));
  hi = _mm512_or_si512(hi, _mm512_and_si512(_mm512_srlv_epi16(v, right), mask));
}

// bf16 x 16 -> fp32 lanes.
EDGE_VNNI inline __m512 widen_bf16x16(const uint16_t* p) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

// The offset term of a tile's R outputs, group by group: acc[r] += offset_g * (sum of row r's x over
// group g), for any Groups below with offset_of.
template <int R, typename Groups>
EDGE_VNNI void add_offset_terms_by_group(const Groups& meta, const float* const* gs, __m512* acc, int64_t groups) {
  for (int64_t g = 0; g < groups; ++g) {
    const __m512 offset = meta.offset_of(g);
    for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(offset, _mm512_set1_ps(gs[r][g]), acc[r]);
  }
}

// A tile's per-group scales and offsets (16 rows each), in one of the two resident forms. The
// kernels take either as a template parameter; its methods give a group's 16 values as fp32 lanes.
// Bf16Groups: the stored bf16 values, [group][16 rows] each.
struct Bf16Groups {
  const uint16_t* scale;
  const uint16_t* offset;
  Bf16Groups tile(int64_t t, int64_t groups) const {
    return {scale + t * kTileRows * groups, offset + t * kTileRows * groups};
  }
  EDGE_VNNI __m512 scale_of(int64_t g) const { return widen_bf16x16(scale + g * kTileRows); }
  EDGE_VNNI __m512 offset_of(int64_t g) const { return widen_bf16x16(offset + g * kTileRows); }
  template <int R>
  EDGE_VNNI void add_offset_terms(const float* const* gs, __m512* acc, int64_t groups) const {
    add_offset_terms_by_group<R>(*this, gs, acc, groups);
  }
};

// CodeGroups: 8-bit codes [group][16 rows] for scales and for offsets, and bf16 factors
// [superblock][D, M][16 rows] (quantization/group_codes.py): scale = code * D; offset = code * M,
// the code read unsigned where M < 0 and as int8 where M > 0. Code times factor is exact in fp32.
struct CodeGroups {
  const uint8_t* scale;
  const uint8_t* offset;
  const uint16_t* factor;
  int64_t superblock;  // groups per superblock
  CodeGroups tile(int64_t t, int64_t groups) const {
    return {scale + t * kTileRows * groups, offset + t * kTileRows * groups,
            factor + t * kTileRows * 2 * (groups / superblock), superblock};
  }
  EDGE_VNNI __m512 scale_of(int64_t g) const {
    const __m128i codes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(scale + g * kTileRows));
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(codes)),
                         widen_bf16x16(factor + (g / superblock) * 2 * kTileRows));
  }
  EDGE_VNNI __m512 offset_of(int64_t g) const {
    const __m128i codes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(offset + g * kTileRows));
    const __m512 m = widen_bf16x16(factor + (g / superblock) * 2 * kTileRows + kTileRows);
    const __mmask16 magnitudes = _mm512_movepi32_mask(_mm512_castps_si512(m));  // rows whose M < 0
    const __m512i values = _mm512_mask_blend_epi32(magnitudes, _mm512_cvtepi8_epi32(codes), _mm512_cvtepu8_epi32(codes));
    return _mm512_mul_ps(_mm512_cvtepi32_ps(values), m);
  }
  // The offset term a superblock at a time: M * sum of code_g * (sum of x over group g), the
  // factor and the code signedness taken once per superblock.
  template <int R>
  EDGE_VNNI void add_offset_terms(const float* const* gs, __m512* acc, int64_t groups) const {
    for (int64_t su = 0; su < groups / superblock; ++su) {
      const __m512 m = widen_bf16x16(factor + su * 2 * kTileRows + kTileRows);
      const __mmask16 magnitudes = _mm512_movepi32_mask(_mm512_castps_si512(m));
      __m512 sum[R];
      for (int r = 0; r < R; ++r) sum[r] = _mm512_setzero_ps();
      for (int64_t i = 0; i < superblock; ++i) {
        const int64_t g = su * superblock + i;
        const __m128i codes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(offset + g * kTileRows));
        const __m512 c = _mm512_cvtepi32_ps(
            _mm512_mask_blend_epi32(magnitudes, _mm512_cvtepi8_epi32(codes), _mm512_cvtepu8_epi32(codes)));
        for (int r = 0; r < R; ++r) sum[r] = _mm512_fmadd_ps(c, _mm512_set1_ps(gs[r][g]), sum[r]);
      }
      for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(sum[r], m, acc[r]);
    }
  }
};

// Decode reads each tile once from memory, and a thread's tiles are contiguous: the block this many
// blocks ahead (its four cache lines, and a 6-bit layer's two of top bits) is requested while the
// current one computes. The hardware prefetcher alone left the op short of the box's read
// bandwidth on large matrices. Prefetches never fault, so blocks past a weight's end need no check.
// rows16_decode_prefetch sets the distance (0: none), for A/B runs in one process.
std::atomic<int64_t> g_prefetch_blocks{8};

EDGE_VNNI inline void prefetch_block(const uint8_t* wb, const uint8_t* whb, int64_t blocks) {
  const char* w = reinterpret_cast<const char*>(wb + blocks * kTileBlockBytes);
  for (int c = 0; c < 4; ++c) _mm_prefetch(w + c * 64, _MM_HINT_T0);
  if (whb) {
    const char* h = reinterpret_cast<const char*>(whb + blocks * kTileBlockHighBytes);
    _mm_prefetch(h, _MM_HINT_T0);
    _mm_prefetch(h + 64, _MM_HINT_T0);
  }
}

// One tile (16 weight rows) against R activation rows; outputs to out[r * N + j]. wh: the tile's
// top-bits plane of a 6-bit layer, or null.
template <int R, typename T, typename Groups>
EDGE_VNNI void tile_rows16(const uint8_t* w, const uint8_t* wh, const Groups& meta, int64_t K, int64_t group_size,
                           const QuantizedActivations& a, int64_t row0, T* out, int64_t N) {
  const int64_t blocks = K / kBlock;
  const int64_t groups = K / group_size;
  const int64_t blocks_per_group = group_size / kBlock;
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  const __m512i zero = _mm512_setzero_si512();
  const int32_t* q[R];
  const float* qs[R];
  const float* gs[R];
  __m512 acc[R];
  for (int r = 0; r < R; ++r) {
    q[r] = reinterpret_cast<const int32_t*>(a.q + (row0 + r) * K);
    qs[r] = a.block_scale + (row0 + r) * blocks;
    gs[r] = a.group_sum + (row0 + r) * groups;
    acc[r] = _mm512_setzero_ps();
  }
  meta.template add_offset_terms<R>(gs, acc, groups);  // m_j,g * sum of x over group g
  __m512 wscale = _mm512_setzero_ps();
  const int64_t prefetch = g_prefetch_blocks.load(std::memory_order_relaxed);
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* wb = w + b * kTileBlockBytes;
    if (R == 1 && prefetch > 0) prefetch_block(wb, wh ? wh + b * kTileBlockHighBytes : nullptr, prefetch);
    __m512i lo[4], hi[4];
    for (int c = 0; c < 4; ++c) {
      const __m512i v = _mm512_loadu_si512(wb + c * 64);
      lo[c] = _mm512_and_si512(v, low4);
      hi[c] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
      if (wh) add_high_bits(wh + b * kTileBlockHighBytes + c * 32, lo[c], hi[c]);
    }
    if (b % blocks_per_group == 0) wscale = meta.scale_of(b / blocks_per_group);
    for (int r = 0; r < R; ++r) {
      const int32_t* x = q[r] + b * (kBlock / 4);  // 8 groups of 4 int8
      // Two chains of four: one chain of eight waits on vpdpbusd's latency.
      __m512i even = _mm512_dpbusd_epi32(zero, lo[0], _mm512_set1_epi32(x[0]));
      __m512i odd = _mm512_dpbusd_epi32(zero, hi[0], _mm512_set1_epi32(x[1]));
      for (int c = 1; c < 4; ++c) {
        even = _mm512_dpbusd_epi32(even, lo[c], _mm512_set1_epi32(x[2 * c]));
        odd = _mm512_dpbusd_epi32(odd, hi[c], _mm512_set1_epi32(x[2 * c + 1]));
      }
      const __m512 dot = _mm512_cvtepi32_ps(_mm512_add_epi32(even, odd));
      acc[r] = _mm512_fmadd_ps(dot, _mm512_mul_ps(wscale, _mm512_set1_ps(qs[r][b])), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    alignas(64) float lanes[kTileRows];
    _mm512_store_ps(lanes, acc[r]);
    for (int64_t j = 0; j < kTileRows; ++j) out[r * N + j] = static_cast<T>(lanes[j]);
  }
}

// F32Groups: a tile's scales and offsets decoded to fp32 [group][16 rows] each (prefill decodes a
// tile's groups once for all its activation rows instead of once per kRowTile rows).
struct F32Groups {
  const float* scale;
  const float* offset;
  EDGE_VNNI __m512 scale_of(int64_t g) const { return _mm512_loadu_ps(scale + g * kTileRows); }
  EDGE_VNNI __m512 offset_of(int64_t g) const { return _mm512_loadu_ps(offset + g * kTileRows); }
  template <int R>
  EDGE_VNNI void add_offset_terms(const float* const* gs, __m512* acc, int64_t groups) const {
    add_offset_terms_by_group<R>(*this, gs, acc, groups);
  }
};

template <typename Groups>
EDGE_VNNI void decode_groups(const Groups& tile, int64_t groups, float* scale, float* offset) {
  for (int64_t g = 0; g < groups; ++g) {
    _mm512_storeu_ps(scale + g * kTileRows, tile.scale_of(g));
    _mm512_storeu_ps(offset + g * kTileRows, tile.offset_of(g));
  }
}

// All tiles of a 16-row interleaved weight [N, K/2] against the M quantized activation rows;
// out is [M, N]. A tile's 16 x K/2 weight bytes are contiguous and stay in L1 while all
// activation rows pass over them, kRowTile at a time; with more rows than that, the tile's
// scales and offsets are decoded to fp32 once first.
template <typename T, typename Groups>
EDGE_VNNI void rows16_tiles(const QuantizedActivations& a, int64_t M, const uint8_t* w, const uint8_t* wh,
                            const Groups& meta, int64_t K, int64_t N, int64_t group_size, T* out) {
  const int64_t groups = K / group_size;
  at::parallel_for(0, N / kTileRows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> decoded(M > kRowTile ? 2 * groups * kTileRows : 0);
    for (int64_t t = begin; t < end; ++t) {
      const uint8_t* tw = w + t * kTileRows * (K / 2);
      const uint8_t* th = wh ? wh + t * kTileRows * (K / 4) : nullptr;
      const Groups tile = meta.tile(t, groups);
      if (M > kRowTile) {
        decode_groups(tile, groups, decoded.data(), decoded.data() + groups * kTileRows);
        const F32Groups f32{decoded.data(), decoded.data() + groups * kTileRows};
        for (int64_t m = 0; m < M; m += kRowTile) {
          with_row_count(std::min(kRowTile, M - m), [&](auto rows) {
            tile_rows16<decltype(rows)::value>(tw, th, f32, K, group_size, a, m, out + m * N + t * kTileRows, N);
          });
        }
        continue;
      }
      for (int64_t m = 0; m < M; m += kRowTile) {
        with_row_count(std::min(kRowTile, M - m), [&](auto rows) {
          tile_rows16<decltype(rows)::value>(tw, th, tile, K, group_size, a, m, out + m * N + t * kTileRows, N);
        });
      }
    }
  });
}

// e^x for 16 lanes: 2^n * 2^f with n = round(x log2 e), |f| <= 1/2, 2^f by its degree-6
// Taylor polynomial (relative error < 2e-7, below bf16's 4e-3 rounding of the result).
EDGE_VNNI inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.f)), _mm512_set1_ps(-88.f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.69314718055994531f));  // f ln 2
  __m512 p = _mm512_set1_ps(1.f / 720);
  for (const float c : {1.f / 120, 1.f / 24, 1.f / 6, 1.f / 2, 1.f, 1.f}) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c));
  return _mm512_scalef_ps(p, n);
}

// fp32 -> bf16 bits, round to nearest even (as torch's .to(bfloat16)) for values
// that are not NaN.
EDGE_VNNI inline __m256i to_bf16x16(__m512 f) {
  const __m512i bits = _mm512_castps_si512(f);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
}

// The same for any value, NaN included: c10::BFloat16 makes every NaN 0x7FC0.
EDGE_VNNI inline __m256i to_bf16x16_exact(__m512 f) {
  return _mm256_mask_mov_epi16(to_bf16x16(f), _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q), _mm256_set1_epi16(0x7FC0));
}

// h = silu(gate) * up per element, in fp32, rounded to T: what vLLM's SiluAndMul computes
// from the same T inputs.
template <typename T>
EDGE_VNNI void silu_mul_row(const T* gate, const T* up, int64_t n, T* h) {
  alignas(64) float lanes[16];
  for (int64_t i = 0; i < n; i += 16) {
    const __m512 g = load16(gate + i);
    const __m512 silu = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), g))));
    const __m512 v = _mm512_mul_ps(silu, load16(up + i));
    if constexpr (std::is_same_v<T, c10::BFloat16>) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(h + i), to_bf16x16_exact(v));
    } else if constexpr (std::is_same_v<T, float>) {
      _mm512_storeu_ps(h + i, v);
    } else {
      _mm512_store_ps(lanes, v);
      for (int j = 0; j < 16; ++j) h[i + j] = static_cast<T>(lanes[j]);
    }
  }
}

bool cpu_has_vnni() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
         __builtin_cpu_supports("avx512vnni");
}

// Rows of x [M, K] into the buffer in k order (the 16-row layout's activations).
template <typename T>
EDGE_VNNI void quantize_rows_vnni(const T* x, int64_t M, int64_t K, int64_t group_size, const ActivationBuffer& buffer) {
  const int64_t groups = K / group_size;
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      quantize_row_vnni(x + m * K, K, group_size, buffer.q + m * K, buffer.block_scale + m * (K / kBlock),
                        buffer.group_sum + m * groups);
    }
  });
}

// Prefill on a bf16 GEMM straight from the 16-row layout (no resident dense copy).
// From `min_rows` activation rows up, bf16 activations, the rows16 ops dequantize a block of
// weight rows at a time into a per-thread bf16 scratch [K, rows] and hand it to at::mm, i.e.
// oneDNN's matmul: on an AMX CPU its avx512_core_amx kernels, on others avx512_core_bf16 or
// below. The weights are exactly int4.dequantize()'s bf16 weights; the product differs from
// the W4A8 path only in skipping the int8 activation rounding (bf16 inputs, fp32 sums).
// Decode (fewer rows) keeps the W4A8 tiles: the dequantization costs O(N K) per call, paid
// back only over many rows. Set once per process (set_bf16_prefill, from Python at load);
// min_rows 0 (the library's default) means never.
std::atomic<int64_t> g_prefill_min_rows{0};
// Bytes of one dequantized block; rows per block = bytes / (2 K), a multiple of kTileRows.
std::atomic<int64_t> g_prefill_block_bytes{4 << 20};
// Calls of the rows16 ops by path (fused MLP calls count once): [0] W4A8 tiles, [1] bf16 path
// (either GEMM); GEMMs of [1] (a fused MLP has two): [2] on the AMX tiles, [3] on oneDNN with
// the blocks dequantized into its own weight layout (packed_matmul).
std::atomic<int64_t> g_rows16_calls[4];
// The bf16 path's GEMM: kGemmOneDnn (at::mm on a block dequantized to [K, rows]) or kGemmAmx
// (AMX tiles on a block dequantized straight into the tiles' k-pair layout, see rows16_amx_mm).
constexpr int64_t kGemmOneDnn = 0, kGemmAmx = 1;
std::atomic<int64_t> g_prefill_gemm{kGemmOneDnn};
// With kGemmAmx: from this many rows up the bf16 path runs on oneDNN after all (0: never), where
// the AMX tiles' order (every 32-row slice of activations against each pair of tiles) re-reads
// activations that no longer fit a core's cache.
std::atomic<int64_t> g_prefill_onednn_from_rows{0};

// AMX BF16 tiles usable by this process: the CPU has them and Linux granted the tile state
// (arch_prctl ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA; granting is per process, asking twice is harmless).
bool amx_bf16_ready() {
  static const bool ready = [] {
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("amx-tile") || !__builtin_cpu_supports("amx-bf16") ||
        !__builtin_cpu_supports("avx512bf16")) {
      return false;
    }
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ready;
}

void set_bf16_prefill(int64_t min_rows, int64_t block_bytes, int64_t gemm, int64_t onednn_from_rows) {
  TORCH_CHECK(min_rows >= 0, "set_bf16_prefill: min_rows must be >= 0 (0 = off), got ", min_rows);
  TORCH_CHECK(block_bytes > 0, "set_bf16_prefill: block_bytes must be > 0, got ", block_bytes);
  TORCH_CHECK(gemm == kGemmOneDnn || gemm == kGemmAmx,
              "set_bf16_prefill: gemm must be 0 (oneDNN) or 1 (AMX tiles), got ", gemm);
  TORCH_CHECK(gemm != kGemmAmx || amx_bf16_ready(),
              "set_bf16_prefill: gemm=1 needs AMX BF16 tiles (amx-tile, amx-bf16, avx512bf16) and Linux's "
              "grant of tile state; this CPU or process has not got them");
  TORCH_CHECK(onednn_from_rows >= 0, "set_bf16_prefill: onednn_from_rows must be >= 0 (0 = never), got ",
              onednn_from_rows);
  g_prefill_min_rows = min_rows;
  g_prefill_block_bytes = block_bytes;
  g_prefill_gemm = gemm;
  g_prefill_onednn_from_rows = onednn_from_rows;
}

// The decode prefetch distance in blocks (0: none); returns the previous one.
int64_t rows16_decode_prefetch(int64_t blocks) {
  TORCH_CHECK(blocks >= 0 && blocks <= 64, "rows16_decode_prefetch: blocks must be 0..64, got ", blocks);
  return g_prefetch_blocks.exchange(blocks);
}

std::vector<int64_t> rows16_path_counts() {
  return {g_rows16_calls[0].load(), g_rows16_calls[1].load(), g_rows16_calls[2].load(), g_rows16_calls[3].load()};
}

bool bf16_prefill(const at::Tensor& x) {
  const int64_t min_rows = g_prefill_min_rows.load(std::memory_order_relaxed);
  const bool prefill = min_rows > 0 && x.size(0) >= min_rows && x.scalar_type() == at::kBFloat16;
  g_rows16_calls[prefill].fetch_add(1, std::memory_order_relaxed);
  return prefill;
}

// The codes of k = 8c + i (shift 8i) or 8c + 4 + i (shift 8i + 4) of a chunk's 16 rows, one per
// int32 lane: the nibble, plus 16 times the top bits where the layer has them (hc: the chunk's
// 32 bytes of the top-bits plane, or null; lane j reads byte 4 (j mod 8) + i of it, its field
// further up for rows 8..15).
EDGE_VNNI inline __m512i chunk_codes(__m512i v, const uint8_t* hc, int shift) {
  const __m512i code = _mm512_and_si512(_mm512_srli_epi32(v, shift), _mm512_set1_epi32(0x0F));
  if (!hc) return code;
  const __m512i h = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(hc)));
  // The field sits at the nibble's own shift (bits 0-1 of the byte for k = 8c + i, 4-5 for 8c + 4 + i),
  // 2 bits further up for rows 8..15.
  const __m512i count = _mm512_add_epi32(_mm512_set1_epi32(shift),
                                         _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi32(2), 1));
  return _mm512_or_si512(code, _mm512_slli_epi32(_mm512_and_si512(_mm512_srlv_epi32(h, count), _mm512_set1_epi32(3)), 4));
}

// 32 k (block b) of one tile (16 weight rows) of the 16-row layout, dequantized, into rows
// 32b .. 32b + 31, columns 0..15, of dst [K, ld]: int32 lane j of a 64-byte chunk c is row j,
// its byte i holds k = 32b + 8c + i (low nibble) and 32b + 8c + 4 + i (high nibble), so each
// shift gives one k for all 16 rows. q * scale + offset with one rounding (q * scale is exact
// in fp32), then bf16: int4.dequantize()'s values (group_codes.dequantize()'s with codes).
// (Vectors are not passed across the call: the lambdas that call it lack the AVX-512 target.)
// hb: the block's top-bits plane of a 6-bit layer, or null.
template <typename Groups>
EDGE_VNNI void dequantize_tile_block(const uint8_t* wb, const uint8_t* hb, const Groups& meta, int64_t g, uint16_t* d,
                                     int64_t ld) {
  const __m512 s = meta.scale_of(g), m = meta.offset_of(g);
  for (int c = 0; c < 4; ++c) {
    const __m512i v = _mm512_loadu_si512(wb + c * 64);
    const uint8_t* hc = hb ? hb + c * 32 : nullptr;
    for (int i = 0; i < 4; ++i) {
      const __m512i lo = chunk_codes(v, hc, 8 * i);
      const __m512i hi = chunk_codes(v, hc, 8 * i + 4);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + (8 * c + i) * ld),
                          to_bf16x16(_mm512_fmadd_ps(_mm512_cvtepi32_ps(lo), s, m)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + (8 * c + 4 + i) * ld),
                          to_bf16x16(_mm512_fmadd_ps(_mm512_cvtepi32_ps(hi), s, m)));
    }
  }
}

// The same with AVX512_BF16's vcvtne2ps2bf16 (two vectors to bf16 in one instruction, also
// round to nearest even): AMX CPUs all have it.
#define EDGE_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512bf16")))
template <typename Groups>
EDGE_BF16 void dequantize_tile_block_bf16(const uint8_t* wb, const uint8_t* hb, const Groups& meta, int64_t g,
                                          uint16_t* d, int64_t ld) {
  const __m512 s = meta.scale_of(g), m = meta.offset_of(g);
  for (int c = 0; c < 4; ++c) {
    const __m512i v = _mm512_loadu_si512(wb + c * 64);
    const uint8_t* hc = hb ? hb + c * 32 : nullptr;
    for (int i = 0; i < 4; ++i) {
      const __m512 lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(chunk_codes(v, hc, 8 * i)), s, m);
      const __m512 hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(chunk_codes(v, hc, 8 * i + 4)), s, m);
      const __m512i both = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo));  // [lo x16, hi x16]
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + (8 * c + i) * ld), _mm512_castsi512_si256(both));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + (8 * c + 4 + i) * ld), _mm512_extracti64x4_epi64(both, 1));
    }
  }
}

bool cpu_has_bf16() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512bf16");
}

// Tiles [t0, t1) of a 16-row weight, dequantized into dst [K, (t1 - t0) * 16]. Threads split K
// (blocks of 32); each block goes across all the tiles, so its 32 rows of dst are written
// whole, in order (tile by tile across the full K, the writes strode a row apart).
template <typename Groups>
void dequantize_rows16_block(const uint8_t* w, const uint8_t* wh, const Groups& meta, int64_t K, int64_t group_size,
                             int64_t t0, int64_t t1, uint16_t* dst, bool portable = false) {
  const int64_t groups = K / group_size, ld = (t1 - t0) * kTileRows;
  const int64_t blocks_per_group = group_size / kBlock;
  static const bool native_bf16 = cpu_has_bf16();
  const auto tile_block = native_bf16 && !portable ? dequantize_tile_block_bf16<Groups> : dequantize_tile_block<Groups>;
  at::parallel_for(0, K / kBlock, 4, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t g = b / blocks_per_group;
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t rows = t * kTileRows;
        tile_block(w + rows * (K / 2) + b * kTileBlockBytes,
                   wh ? wh + rows * (K / 4) + b * kTileBlockHighBytes : nullptr, meta.tile(t, groups), g,
                   dst + b * kBlock * ld + (t - t0) * kTileRows, ld);
      }
    }
  });
}

// ---- The bf16 path on AMX tiles ----
// A B tile of tdpbf16ps holds 16 rows of k pairs: row r is the 16 output columns' (k = 2r, 2r + 1)
// bf16 pairs. Dequantizing a 32-k block of one 16-row weight tile straight into that layout (1 KiB)
// spares the GEMM its own repacking of every freshly dequantized block.
#define EDGE_AMX __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512bf16,amx-tile,amx-bf16")))
constexpr int64_t kPairTile = kTileRows * kBlock;  // bf16 elements of one B tile: 16 pair rows x 32

// One 32-k block (block b, group g) of one tile of the 16-row layout as a B tile: the values of
// dequantize_tile_block_bf16 (the same rounding), rows (k = 2r, 2r + 1) instead of rows k.
// ld: elements from one pair row to the next (32 in a B tile; 128 in oneDNN's 64-column blocks).
template <typename Groups>
EDGE_AMX void dequantize_tile_block_pairs(const uint8_t* wb, const uint8_t* hb, const Groups& meta, int64_t g,
                                          uint16_t* d, int64_t ld = 2 * kTileRows) {
  const __m512 s = meta.scale_of(g), m = meta.offset_of(g);
  // [even k x16, odd k x16] -> [even 0, odd 0, even 1, odd 1, ...]
  const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                         21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  for (int c = 0; c < 4; ++c) {
    const __m512i v = _mm512_loadu_si512(wb + c * 64);
    const uint8_t* hc = hb ? hb + c * 32 : nullptr;
    for (int high = 0; high < 2; ++high) {  // low nibbles hold k = 8c + i, high ones 8c + 4 + i
      for (int i = 0; i < 4; i += 2) {
        const __m512 even = _mm512_fmadd_ps(_mm512_cvtepi32_ps(chunk_codes(v, hc, 8 * i + 4 * high)), s, m);
        const __m512 odd = _mm512_fmadd_ps(_mm512_cvtepi32_ps(chunk_codes(v, hc, 8 * (i + 1) + 4 * high)), s, m);
        const __m512i both = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(odd, even));
        _mm512_storeu_si512(d + (4 * c + 2 * high + i / 2) * ld, _mm512_permutexvar_epi16(pairs, both));
      }
    }
  }
}

// Tiles [t0, t1) of a 16-row weight as B tiles: panel[(t - t0) * K / 32 + b] is block b of tile t.
template <typename Groups>
void dequantize_rows16_pairs(const uint8_t* w, const uint8_t* wh, const Groups& meta, int64_t K, int64_t group_size,
                             int64_t t0, int64_t t1, uint16_t* panel) {
  const int64_t groups = K / group_size, blocks = K / kBlock, blocks_per_group = group_size / kBlock;
  for (int64_t t = t0; t < t1; ++t) {
    const Groups tile = meta.tile(t, groups);
    const uint8_t* wt = w + t * kTileRows * (K / 2);
    const uint8_t* ht = wh ? wh + t * kTileRows * (K / 4) : nullptr;
    uint16_t* pt = panel + (t - t0) * blocks * kPairTile;
    for (int64_t b = 0; b < blocks; ++b) {
      dequantize_tile_block_pairs(wt + b * kTileBlockBytes, ht ? ht + b * kTileBlockHighBytes : nullptr, tile,
                                  b / blocks_per_group, pt + b * kPairTile);
    }
  }
}

struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Eight tiles of 16 rows x 64 bytes: 0-3 the fp32 sums of a 32 x 32 output block, 4-5 two 16-row
// slices of activations (32 k), 6-7 two B tiles (32 columns).
EDGE_AMX void load_tile_config() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = 16;
    config.colsb[t] = 64;
  }
  // GCC treats ldtilecfg's operand as unread and drops the stores above without a barrier.
  asm volatile("" : : "r"(&config) : "memory");
  _tile_loadconfig(&config);
}

// 32 rows of fp32 sums (row stride 32) to bf16 out rows, `rows` of them, `cols` (16 or 32) columns.
EDGE_AMX void store_sums(const float* sums, int64_t rows, int64_t cols, uint16_t* out, int64_t ldo) {
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 lo = _mm512_loadu_ps(sums + r * 32);
    if (cols == 32) {
      const __m512 hi = _mm512_loadu_ps(sums + r * 32 + 16);
      _mm512_storeu_si512(out + r * ldo, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo)));
    } else {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * ldo), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(lo)));
    }
  }
}

// out[0 .. rows, 0 .. 32) (16 columns when b1 is null) = a 32-row slice of activations (row
// stride lda elements, K / 32 blocks) times one or two tiles' B tiles (K / 32 each, contiguous):
// four 16 x 16 fp32 sums in tiles 0-3 over two activation tiles (4, 5) and two B tiles (6, 7), the
// most the eight tiles hold. The tiles' configuration is this thread's (load_tile_config).
EDGE_AMX void amx_block(const uint16_t* a, int64_t lda, int64_t rows, const uint16_t* b0, const uint16_t* b1,
                        int64_t K, uint16_t* out, int64_t ldo) {
  alignas(64) float sums[32 * 32];
  const int64_t blocks = K / kBlock, stride = lda * 2;
  const uint16_t* a1 = a + 16 * lda;
  _tile_zero(0);
  _tile_zero(2);
  if (b1) {
    _tile_zero(1);
    _tile_zero(3);
    for (int64_t b = 0; b < blocks; ++b) {
      _tile_loadd(4, a + b * kBlock, stride);
      _tile_loadd(5, a1 + b * kBlock, stride);
      _tile_loadd(6, b0 + b * kPairTile, 64);
      _tile_loadd(7, b1 + b * kPairTile, 64);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(1, sums + 16, 128);
    _tile_stored(3, sums + 16 * 32 + 16, 128);
  } else {
    for (int64_t b = 0; b < blocks; ++b) {
      _tile_loadd(4, a + b * kBlock, stride);
      _tile_loadd(5, a1 + b * kBlock, stride);
      _tile_loadd(6, b0 + b * kPairTile, 64);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(2, 5, 6);
    }
  }
  _tile_stored(0, sums, 128);
  _tile_stored(2, sums + 16 * 32, 128);
  store_sums(sums, rows, b1 ? 32 : 16, out, ldo);
}

EDGE_AMX void release_tiles() { _tile_release(); }

// out [M, N] = x [M, K] (bf16, contiguous) times the 16-row weight, on AMX tiles. As
// rows16_bf16_mm, the threads split N (whole tiles) in one parallel region and walk their share
// a panel at a time (g_prefill_block_bytes of bf16): dequantize the panel as B tiles into the
// thread's scratch, then its columns, two tiles at a time, against every 32 rows of x. Rows past
// the last whole 32 go through a zero-padded copy.
template <typename Groups>
void rows16_amx_mm(const at::Tensor& x, const uint8_t* w, const uint8_t* wh, const Groups& meta, int64_t K,
                   int64_t N, int64_t group_size, at::Tensor& out) {
  const int64_t M = x.size(0);
  const int64_t panel_tiles =
      std::max<int64_t>(1, g_prefill_block_bytes.load(std::memory_order_relaxed) / (2 * K) / kTileRows);
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const int64_t whole = M / 32 * 32, tail = M - whole;
  at::parallel_for(0, N / kTileRows, 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<uint16_t> panel, padded;
    const int64_t elements = std::min(panel_tiles, end - begin) * kTileRows * K;
    if (static_cast<int64_t>(panel.size()) < elements) panel.resize(elements);
    if (tail) {
      padded.assign(32 * K, 0);
      std::memcpy(padded.data(), xp + whole * K, tail * K * sizeof(uint16_t));
    }
    load_tile_config();
    for (int64_t t0 = begin; t0 < end; t0 += panel_tiles) {
      const int64_t t1 = std::min(end, t0 + panel_tiles);
      dequantize_rows16_pairs(w, wh, meta, K, group_size, t0, t1, panel.data());
      // Two tiles (32 columns) at a time against every 32 rows: their B tiles stay in this core's
      // cache while the rows stream past.
      for (int64_t t = t0; t < t1; t += 2) {
        const uint16_t* b0 = panel.data() + (t - t0) * (K / kBlock) * kPairTile;
        const uint16_t* b1 = t + 1 < t1 ? b0 + (K / kBlock) * kPairTile : nullptr;
        uint16_t* columns = op + t * kTileRows;
        for (int64_t m0 = 0; m0 < whole; m0 += 32) amx_block(xp + m0 * K, K, 32, b0, b1, K, columns + m0 * N, N);
        if (tail) amx_block(padded.data(), K, tail, b0, b1, K, columns + whole * N, N);
      }
    }
    release_tiles();
  });
}

// Weight rows per dequantized block for an input of K features: the block's bytes within
// g_prefill_block_bytes, whole tiles, at least one.
int64_t prefill_block_rows(int64_t K, int64_t N) {
  const int64_t rows = g_prefill_block_bytes.load(std::memory_order_relaxed) / (2 * K) / kTileRows * kTileRows;
  return std::min(N, std::max(kTileRows, rows));
}

// ---- oneDNN's matmul in its own weight layout (a build with EDGE_ONEDNN: the oneDNN library) ----
// at::mm on a plain [K, rows] block makes oneDNN copy the block into its blocked layout on every
// call, and creates its primitives through PyTorch's wrapper at every new row count. Here the
// primitive is oneDNN's own (cached per shape), and the block is dequantized straight into the
// weight layout the primitive asks for, when that is the 64-column k-pair layout (BA16a64b2a,
// what its AMX BF16 kernels take); any other layout keeps at::mm.
namespace packed_matmul {

constexpr int64_t kColumns = 64;  // columns per block of the layout; whole tiles: 4
// Below this many input features the result's copy into place (M x columns) costs more than the
// repack it saves at long prompts (docs/edge/cpu-4bit.md).
constexpr int64_t kMinFeatures = 1024;
#ifdef EDGE_ONEDNN
struct Entry {
  dnnl::matmul prim;
  dnnl::memory::desc scratchpad;
  bool usable = false;
};

dnnl::engine& engine() {
  static dnnl::engine e(dnnl::engine::kind::cpu, 0);
  return e;
}

// Shapes seen: a prompt of a new length adds its own; past this many the cache starts over.
constexpr size_t kMaxEntries = 256;

// The primitive for x [M, K] times a [K, cols] block into a contiguous [M, cols], on the calling
// thread's OpenMP thread count, or one marked unusable (other layout, or none at all). A dst with
// a row stride past cols (out's columns) would make oneDNN fall back to a kernel without AMX.
std::shared_ptr<Entry> primitive(int64_t M, int64_t K, int64_t cols) {
  static std::mutex mutex;
  static std::map<std::array<int64_t, 4>, std::shared_ptr<Entry>> cache;
  const std::array<int64_t, 4> key{M, K, cols, omp_get_max_threads()};
  std::lock_guard<std::mutex> lock(mutex);
  if (auto it = cache.find(key); it != cache.end()) return it->second;
  if (cache.size() >= kMaxEntries) cache.clear();
  using md = dnnl::memory::desc;
  using dt = dnnl::memory::data_type;
  using tag = dnnl::memory::format_tag;
  auto entry = std::make_shared<Entry>();
  try {
    const md a({M, K}, dt::bf16, tag::ab), b({K, cols}, dt::bf16, tag::any), c({M, cols}, dt::bf16, tag::ab);
    // The caller's scratchpad: the library's own is shared, and both threads run primitives at once.
    dnnl::primitive_attr attr;
    attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
    const dnnl::matmul::primitive_desc pd(engine(), a, b, c, attr);
    if (pd.weights_desc() == md({K, cols}, dt::bf16, tag::BA16a64b2a)) {
      entry->prim = dnnl::matmul(pd);
      entry->scratchpad = pd.scratchpad_desc();
      entry->usable = true;
    }
  } catch (const dnnl::error&) {
    // No implementation for this shape here: at::mm.
  }
  cache.emplace(key, entry);
  return entry;
}

// Tiles [t0, t1) (a multiple of 4) of a 16-row weight into dst in BA16a64b2a for K rows: 64-column
// blocks one after another, each K / 32 blocks of [16 k pairs][64 columns][2].
template <typename Groups>
void dequantize(const uint8_t* w, const uint8_t* wh, const Groups& meta, int64_t K, int64_t group_size, int64_t t0,
                int64_t t1, uint16_t* dst) {
  const int64_t groups = K / group_size, blocks = K / kBlock, blocks_per_group = group_size / kBlock;
  for (int64_t t = t0; t < t1; ++t) {
    const Groups tile = meta.tile(t, groups);
    const uint8_t* wt = w + t * kTileRows * (K / 2);
    const uint8_t* ht = wh ? wh + t * kTileRows * (K / 4) : nullptr;
    const int64_t column_block = (t - t0) / 4, quarter = (t - t0) % 4;
    uint16_t* base = dst + column_block * blocks * kBlock * kColumns + quarter * 2 * kTileRows;
    for (int64_t b = 0; b < blocks; ++b) {
      dequantize_tile_block_pairs(wt + b * kTileBlockBytes, ht ? ht + b * kTileBlockHighBytes : nullptr, tile,
                                  b / blocks_per_group, base + b * kBlock * kColumns, 2 * kColumns);
    }
  }
}

// out[:, 16 t0 .. 16 t1) = x times tiles [t0, t1) dequantized into scratch, through a
// thread-local [M, cols] result copied into out's columns; false (nothing done) when oneDNN has
// no primitive in that layout for the shape.
template <typename Groups>
bool run(const at::Tensor& x, const uint8_t* w, const uint8_t* wh, const Groups& meta, int64_t K, int64_t group_size,
         int64_t t0, int64_t t1, uint16_t* scratch, at::Tensor& out) {
  const int64_t M = x.size(0), cols = (t1 - t0) * kTileRows, ldo = out.stride(0);
  if (out.stride(1) != 1) return false;
  const std::shared_ptr<Entry> entry = primitive(M, K, cols);
  if (!entry->usable) return false;
  thread_local std::vector<uint16_t> result;
  if (static_cast<int64_t>(result.size()) < M * cols) result.resize(M * cols);
  dequantize(w, wh, meta, K, group_size, t0, t1, scratch);
  using md = dnnl::memory::desc;
  using dt = dnnl::memory::data_type;
  using tag = dnnl::memory::format_tag;
  const dnnl::memory a(md({M, K}, dt::bf16, tag::ab), engine(), x.data_ptr());
  const dnnl::memory b(md({K, cols}, dt::bf16, tag::BA16a64b2a), engine(), scratch);
  const dnnl::memory c(md({M, cols}, dt::bf16, tag::ab), engine(), result.data());
  thread_local std::vector<uint8_t> pad;
  if (pad.size() < entry->scratchpad.get_size()) pad.resize(entry->scratchpad.get_size());
  const dnnl::memory p(entry->scratchpad, engine(), pad.data());
  thread_local dnnl::stream stream(engine());
  entry->prim.execute(stream, {{DNNL_ARG_SRC, a}, {DNNL_ARG_WEIGHTS, b}, {DNNL_ARG_DST, c}, {DNNL_ARG_SCRATCHPAD, p}});
  stream.wait();
  uint16_t* o = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()) + t0 * kTileRows;
  for (int64_t m = 0; m < M; ++m) std::memcpy(o + m * ldo, result.data() + m * cols, cols * sizeof(uint16_t));
  return true;
}
#endif

// Whether this build and CPU can take the path for a weight of N rows and K input features:
// columns in whole 64-column blocks, K from kMinFeatures, AVX512_BF16 for the pair-tile
// dequantization.
bool possible(int64_t N, int64_t K) {
#ifdef EDGE_ONEDNN
  static const bool bf16 = cpu_has_bf16();
  return bf16 && N % kColumns == 0 && K >= kMinFeatures;
#else
  (void)N;
  (void)K;
  return false;
#endif
}

}  // namespace packed_matmul

// out [M, N] = x [M, K] (bf16, contiguous) times the 16-row weight. The threads split N (whole
// tiles) in one parallel region; each walks its share block by block: dequantize the block into
// its own scratch (in its core's L2), then at::mm writes the block's columns of out (oneDNN runs
// single-threaded inside the region). One fork/join per call: two per block (dequantize on all
// threads, then a threaded at::mm) measured far slower (docs/edge/cpu-4bit.md). Each
// thread keeps its scratch between calls (grown, never shrunk): at most g_prefill_block_bytes,
// rounded up to one tile of 16 rows.
template <typename Groups>
void rows16_bf16_mm(const at::Tensor& x, const uint8_t* w, const uint8_t* wh, const Groups& meta, int64_t K,
                    int64_t N, int64_t group_size, at::Tensor& out) {
  const int64_t onednn_from = g_prefill_onednn_from_rows.load(std::memory_order_relaxed);
  if (g_prefill_gemm.load(std::memory_order_relaxed) == kGemmAmx && (onednn_from == 0 || x.size(0) < onednn_from)) {
    g_rows16_calls[2].fetch_add(1, std::memory_order_relaxed);
    rows16_amx_mm(x, w, wh, meta, K, N, group_size, out);
    return;
  }
  // With the packed path the threads' shares and blocks are whole 64-column blocks (4 tiles).
  const bool packed = packed_matmul::possible(N, K);
  const int64_t unit = packed ? packed_matmul::kColumns / kTileRows : 1;
  const int64_t block_tiles = std::max(unit, prefill_block_rows(K, N) / kTileRows / unit * unit);
  std::atomic<bool> any_packed{false};
  const at::ThreadLocalState tls;  // inference mode and dispatch state, for the worker threads
  at::parallel_for(0, N / kTileRows / unit, 1, [&](int64_t begin_units, int64_t end_units) {
    at::ThreadLocalStateGuard tls_guard(tls);
    const int64_t begin = begin_units * unit, end = end_units * unit;
    // oneDNN sizes its work split by omp_get_max_threads(), which inside this region still reads the
    // team's size although a nested region runs on one thread: at some row counts its split for the
    // whole team, run serially, was far slower (docs/edge/cpu-4bit.md). One thread for this thread's
    // own task (an OpenMP ICV of the implicit task: the caller's setting is unchanged after the region).
    omp_set_num_threads(1);
    thread_local at::Tensor scratch;
    const int64_t elements = std::min(block_tiles, end - begin) * kTileRows * K;
    if (!scratch.defined() || scratch.numel() < elements) {
      scratch = at::empty({elements}, x.options().dtype(at::kBFloat16));
    }
    uint16_t* dst = reinterpret_cast<uint16_t*>(scratch.data_ptr<at::BFloat16>());
    for (int64_t t0 = begin; t0 < end; t0 += block_tiles) {
      const int64_t t1 = std::min(end, t0 + block_tiles), rows = (t1 - t0) * kTileRows;
#ifdef EDGE_ONEDNN
      if (packed && packed_matmul::run(x, w, wh, meta, K, group_size, t0, t1, dst, out)) {
        any_packed.store(true, std::memory_order_relaxed);
        continue;
      }
#endif
      dequantize_rows16_block(w, wh, meta, K, group_size, t0, t1, dst);  // serial: inside the region
      at::Tensor columns = out.narrow(1, t0 * kTileRows, rows);
      at::mm_out(columns, x, scratch.narrow(0, 0, rows * K).view({K, rows}));
    }
  });
  if (any_packed.load(std::memory_order_relaxed)) g_rows16_calls[3].fetch_add(1, std::memory_order_relaxed);
}

// One linear's per-group scales and offsets as the ops receive them: bf16 [N, groups] each
// (factors absent), or the 8-bit codes uint8 [N, groups] each with bf16 factors
// [N, 2 * superblocks] (rows16_group_codes_inplace's tile layout). Calls f with the matching
// Groups; the tensors must be contiguous (the kernel class made them so at load).
template <typename F>
void with_groups(const char* op, const at::Tensor& scales, const at::Tensor& offsets,
                 const c10::optional<at::Tensor>& factors, int64_t N, int64_t groups, F&& f) {
  if (!factors.has_value()) {
    for (const auto* t : {&scales, &offsets}) {
      TORCH_CHECK(t->scalar_type() == at::kBFloat16 && t->dim() == 2 && t->size(0) == N && t->size(1) == groups &&
                      t->is_contiguous(),
                  op, ": scales and offsets must be bf16 [", N, ", ", groups, "] and contiguous, got ",
                  t->scalar_type(), " ", t->sizes());
    }
    return f(Bf16Groups{bf16_bits(scales), bf16_bits(offsets)});
  }
  const at::Tensor& fac = *factors;
  for (const auto* t : {&scales, &offsets}) {
    TORCH_CHECK(t->scalar_type() == at::kByte && t->dim() == 2 && t->size(0) == N && t->size(1) == groups &&
                    t->is_contiguous(),
                op, ": with factors, scales and offsets must be uint8 codes [", N, ", ", groups,
                "] and contiguous, got ", t->scalar_type(), " ", t->sizes());
  }
  TORCH_CHECK(fac.scalar_type() == at::kBFloat16 && fac.dim() == 2 && fac.size(0) == N && fac.is_contiguous() &&
                  fac.size(1) % 2 == 0 && fac.size(1) > 0 && groups % (fac.size(1) / 2) == 0,
              op, ": factors must be bf16 [", N, ", 2 * superblocks] and contiguous, the superblocks dividing ",
              groups, " groups, got ", fac.scalar_type(), " ", fac.sizes());
  return f(CodeGroups{scales.data_ptr<uint8_t>(), offsets.data_ptr<uint8_t>(),
                      reinterpret_cast<const uint16_t*>(fac.data_ptr<at::BFloat16>()), groups / (fac.size(1) / 2)});
}

// A 6-bit layer's top-bits plane as the ops read it (uint8 [N, K/4], contiguous, in the 16-row
// layout): its data, or null for a 4-bit layer.
const uint8_t* high_bits_of(const char* op, const c10::optional<at::Tensor>& high_bits, int64_t N, int64_t K) {
  if (!high_bits.has_value()) return nullptr;
  const at::Tensor& h = *high_bits;
  TORCH_CHECK(h.scalar_type() == at::kByte && h.dim() == 2 && h.size(0) == N && h.size(1) * 4 == K &&
                  h.is_contiguous(),
              op, ": high_bits must be uint8 [", N, ", ", K / 4, "] and contiguous, got ", h.scalar_type(), " ",
              h.sizes());
  return h.data_ptr<uint8_t>();
}

// The 16-row weight [N, K/2] dequantized to bf16 [K, N], as the prefill GEMM reads it (tests: the
// transpose of int4.dequantize's bf16 values, exactly; timing the dequantization alone).
// portable: without AVX512_BF16 instructions even where the CPU has them (tests both).
at::Tensor rows16_dequantize(const at::Tensor& qweight, const at::Tensor& scales, const at::Tensor& offsets,
                             int64_t group_size, bool portable, const c10::optional<at::Tensor>& factors,
                             const c10::optional<at::Tensor>& high_bits) {
  const int64_t N = qweight.size(0), K = qweight.size(1) * 2;
  check_qweight("rows16_dequantize", qweight, K, group_size, kTileRows);
  const at::Tensor w = qweight.contiguous();
  const uint8_t* wh = high_bits_of("rows16_dequantize", high_bits, N, K);
  at::Tensor kn = at::empty({K, N}, qweight.options().dtype(at::kBFloat16));
  with_groups("rows16_dequantize", scales, offsets, factors, N, K / group_size, [&](const auto& meta) {
    dequantize_rows16_block(w.data_ptr<uint8_t>(), wh, meta, K, group_size, 0, N / kTileRows,
                            reinterpret_cast<uint16_t*>(kn.data_ptr<at::BFloat16>()), portable);
  });
  return kn;
}

// Weights, scales and offsets in the 16-row interleaved layout (see tile_rows16); the
// kernel class makes it from the stored triple at load time.
at::Tensor w4a8_vnni_rows16_mm(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                               const at::Tensor& offsets, int64_t group_size,
                               const c10::optional<at::Tensor>& factors,
                               const c10::optional<at::Tensor>& high_bits) {
  static const bool supported = cpu_has_vnni();
  TORCH_CHECK(supported, "w4a8_vnni_rows16_mm: this CPU has no AVX-512 VNNI (avx512f/bw/vl/dq/vnni)");
  TORCH_CHECK(x.dim() == 2, "w4a8_vnni_rows16_mm: x must be 2-D [M, K], got ", x.sizes());
  const int64_t M = x.size(0), K = x.size(1), N = qweight.size(0);
  check_qweight("w4a8_vnni_rows16_mm", qweight, K, group_size, kTileRows);
  const at::Tensor xc = x.contiguous();
  const at::Tensor w = qweight.contiguous();
  at::Tensor out = at::empty({M, N}, x.options());
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const uint8_t* wh = high_bits_of("w4a8_vnni_rows16_mm", high_bits, N, K);
  with_groups("w4a8_vnni_rows16_mm", scales, offsets, factors, N, K / group_size, [&](const auto& meta) {
    if (bf16_prefill(xc)) {
      rows16_bf16_mm(xc, wp, wh, meta, K, N, group_size, out);
      return;
    }
    const ActivationBuffer buffer(M, K, group_size, x.options());
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, xc.scalar_type(), "w4a8_vnni_rows16_mm", [&] {
      quantize_rows_vnni(xc.data_ptr<scalar_t>(), M, K, group_size, buffer);
      rows16_tiles(buffer.activations(), M, wp, wh, meta, K, N, group_size, out.data_ptr<scalar_t>());
    });
  });
  return out;
}

// A gated SiLU MLP in one call: down(silu(gate) * up) with gate/up one merged linear
// [2I, H/2] (gate rows first, as vLLM's MergedColumnParallelLinear holds them) and down
// [N, I/2], both in the 16-row layout. The same products and roundings as the three calls
// it replaces (gate_up, SiluAndMul, down), without two op dispatches, the intermediate
// tensors and an inductor kernel per layer: at decode those fixed costs are about as large
// as the small model's matrix work.
at::Tensor w4a8_vnni_rows16_silu_mlp(const at::Tensor& x, const at::Tensor& gate_up_qweight,
                                     const at::Tensor& gate_up_scales, const at::Tensor& gate_up_offsets,
                                     int64_t gate_up_group_size, const at::Tensor& down_qweight,
                                     const at::Tensor& down_scales, const at::Tensor& down_offsets,
                                     int64_t down_group_size, const c10::optional<at::Tensor>& gate_up_factors,
                                     const c10::optional<at::Tensor>& down_factors,
                                     const c10::optional<at::Tensor>& gate_up_high_bits,
                                     const c10::optional<at::Tensor>& down_high_bits) {
  static const bool supported = cpu_has_vnni();
  TORCH_CHECK(supported, "w4a8_vnni_rows16_silu_mlp: this CPU has no AVX-512 VNNI (avx512f/bw/vl/dq/vnni)");
  TORCH_CHECK(x.dim() == 2, "w4a8_vnni_rows16_silu_mlp: x must be 2-D [M, H], got ", x.sizes());
  const int64_t M = x.size(0), H = x.size(1);
  check_qweight("w4a8_vnni_rows16_silu_mlp (gate_up)", gate_up_qweight, H, gate_up_group_size, kTileRows);
  TORCH_CHECK(gate_up_qweight.size(0) % 2 == 0, "w4a8_vnni_rows16_silu_mlp: gate_up has an odd row count");
  const int64_t I = gate_up_qweight.size(0) / 2;
  check_qweight("w4a8_vnni_rows16_silu_mlp (down)", down_qweight, I, down_group_size, kTileRows);
  const int64_t N = down_qweight.size(0);
  const at::Tensor xc = x.contiguous();
  const at::Tensor gw = gate_up_qweight.contiguous(), dw = down_qweight.contiguous();
  const uint8_t* gh = high_bits_of("w4a8_vnni_rows16_silu_mlp (gate_up)", gate_up_high_bits, 2 * I, H);
  const uint8_t* dh = high_bits_of("w4a8_vnni_rows16_silu_mlp (down)", down_high_bits, N, I);
  at::Tensor gate_up = at::empty({M, 2 * I}, x.options());
  const at::Tensor h = at::empty({M, I}, x.options());
  at::Tensor out = at::empty({M, N}, x.options());
  with_groups("w4a8_vnni_rows16_silu_mlp (gate_up)", gate_up_scales, gate_up_offsets, gate_up_factors, 2 * I,
              H / gate_up_group_size, [&](const auto& gmeta) {
  with_groups("w4a8_vnni_rows16_silu_mlp (down)", down_scales, down_offsets, down_factors, N,
              I / down_group_size, [&](const auto& dmeta) {
    if (bf16_prefill(xc)) {
      using bf16 = at::BFloat16;
      rows16_bf16_mm(xc, gw.data_ptr<uint8_t>(), gh, gmeta, H, 2 * I, gate_up_group_size, gate_up);
      const bf16* gu = gate_up.data_ptr<bf16>();
      bf16* hp = h.data_ptr<bf16>();
      at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
        for (int64_t m = begin; m < end; ++m) silu_mul_row(gu + m * 2 * I, gu + m * 2 * I + I, I, hp + m * I);
      });
      rows16_bf16_mm(h, dw.data_ptr<uint8_t>(), dh, dmeta, I, N, down_group_size, out);
      return;
    }
    const ActivationBuffer x_buffer(M, H, gate_up_group_size, x.options());
    const ActivationBuffer h_buffer(M, I, down_group_size, x.options());
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, xc.scalar_type(), "w4a8_vnni_rows16_silu_mlp", [&] {
      scalar_t* gu = gate_up.data_ptr<scalar_t>();
      scalar_t* hp = h.data_ptr<scalar_t>();
      quantize_rows_vnni(xc.data_ptr<scalar_t>(), M, H, gate_up_group_size, x_buffer);
      rows16_tiles(x_buffer.activations(), M, gw.data_ptr<uint8_t>(), gh, gmeta, H, 2 * I, gate_up_group_size, gu);
      at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
        for (int64_t m = begin; m < end; ++m) silu_mul_row(gu + m * 2 * I, gu + m * 2 * I + I, I, hp + m * I);
      });
      quantize_rows_vnni(static_cast<const scalar_t*>(hp), M, I, down_group_size, h_buffer);
      rows16_tiles(h_buffer.activations(), M, dw.data_ptr<uint8_t>(), dh, dmeta, I, N, down_group_size,
                   out.data_ptr<scalar_t>());
    });
  });
  });
  return out;
}

// The stored triple rearranged into the 16-row layout in place (the kernel class at load: the
// tensors it replaces are not kept). Scales and offsets: bf16 [N, groups] -> [tile][group][16 rows].
void interleave_rows16_inplace(at::Tensor& qweight, at::Tensor& scales, at::Tensor& offsets) {
  interleave_triple_inplace("interleave_rows16_inplace", qweight, scales, offsets, kTileRows);
}

// A 6-bit layer's stored top-bits plane (uint8 [N, K/4], four 2-bit fields per byte in k order,
// k % 4 at bits 2 (k % 4); int4.py) into the 16-row layout add_high_bits reads, in place (per tile,
// through a scratch copy, as interleave_tiles_inplace). Row j, k = 32b + 8c + 4h + i of a tile goes
// to byte 4 (j mod 8) + i of chunk c of block b, field 2h + j / 8.
void interleave_rows16_high_bits_inplace(at::Tensor& high_bits) {
  TORCH_CHECK(high_bits.dim() == 2 && high_bits.scalar_type() == at::kByte && high_bits.is_contiguous(),
              "interleave_rows16_high_bits_inplace: high_bits must be contiguous uint8 [N, K/4], got ",
              high_bits.scalar_type(), " ", high_bits.sizes());
  const int64_t N = high_bits.size(0), quarter_k = high_bits.size(1), K = 4 * quarter_k;
  TORCH_CHECK(N % kTileRows == 0, "interleave_rows16_high_bits_inplace: N must be a multiple of ", kTileRows,
              ", got N=", N);
  TORCH_CHECK(K % kBlock == 0, "interleave_rows16_high_bits_inplace: K must be a multiple of ", kBlock,
              ", got K=", K);
  const int64_t tile_bytes = kTileRows * quarter_k;
  uint8_t* data = high_bits.data_ptr<uint8_t>();
  at::parallel_for(0, N / kTileRows, 1, [&](int64_t begin, int64_t end) {
    std::vector<uint8_t> scratch(tile_bytes);
    for (int64_t t = begin; t < end; ++t) {
      uint8_t* tile = data + t * tile_bytes;
      std::memcpy(scratch.data(), tile, tile_bytes);
      // Destination byte 4 jl + i of chunk c, block b: k = 32b + 8c + 4h + i is stored byte 8b + 2c + h
      // of its row, field i; rows jl (fields 0 and 2, h = 0 and 1) and 8 + jl (fields 1 and 3).
      for (int64_t q = 0; q < quarter_k / 2; ++q) {  // q = 4b + c: the stored bytes 2q, 2q + 1 of each row
        uint8_t* dst = tile + (q / 4) * kTileBlockHighBytes + (q % 4) * 32;
        for (int64_t jl = 0; jl < 8; ++jl) {
          const uint8_t* lo_row = scratch.data() + jl * quarter_k + 2 * q;
          const uint8_t* hi_row = scratch.data() + (8 + jl) * quarter_k + 2 * q;
          for (int i = 0; i < 4; ++i) {
            const int shift = 2 * i;
            dst[4 * jl + i] = static_cast<uint8_t>(((lo_row[0] >> shift) & 3) | (((hi_row[0] >> shift) & 3) << 2) |
                                                   (((lo_row[1] >> shift) & 3) << 4) | (((hi_row[1] >> shift) & 3) << 6));
          }
        }
      }
    }
  });
}

constexpr int64_t kMaxSuperblock = 8;  // group_codes.SUPERBLOCK_MAX_GROUPS

int64_t superblock_groups(int64_t groups) {
  for (int64_t d = kMaxSuperblock; d > 1; --d) {
    if (groups % d == 0) return d;
  }
  return 1;
}

// 16 fp32 lanes rounded to the nearest bf16 value (ties to even), as fp32; the values are finite.
EDGE_VNNI inline __m512 bf16_round16(__m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_srli_epi32(rounded, 16), 16));
}

EDGE_VNNI inline __m512 round_even(__m512 x) {
  return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

// group_codes._fit_unsigned for 16 rows at once, lane j being row j: v[i] (>= 0) are the rows'
// values of the superblock's group i. Codes 0..255 under the better (smaller summed absolute
// error, added in group order) of top / 63 and top / 255 in bf16; returns that factor per lane.
// Division and round-to-nearest-even are exact in IEEE fp32, as in the reference.
EDGE_VNNI __m512 fit_unsigned16(const __m512* v, int64_t n, __m512* codes) {
  const __m512 zero = _mm512_setzero_ps(), one = _mm512_set1_ps(1.f), sign = _mm512_set1_ps(-0.f);
  __m512 top = zero;
  for (int64_t i = 0; i < n; ++i) top = _mm512_max_ps(top, v[i]);  // signed zeros: both ways f = 1 below
  __m512 best_err = zero, best_factor = one;
  bool first = true;
  for (const float divisor : {63.f, 255.f}) {
    __m512 f = bf16_round16(_mm512_div_ps(top, _mm512_set1_ps(divisor)));
    f = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(f, zero, _CMP_GT_OQ), one, f);
    __m512 c[kMaxSuperblock];
    __m512 err = zero;
    for (int64_t i = 0; i < n; ++i) {
      c[i] = _mm512_min_ps(_mm512_max_ps(round_even(_mm512_div_ps(v[i], f)), zero), _mm512_set1_ps(255.f));
      err = _mm512_add_ps(err, _mm512_andnot_ps(sign, _mm512_sub_ps(_mm512_mul_ps(c[i], f), v[i])));
    }
    const __mmask16 take = first ? __mmask16(0xFFFF) : _mm512_cmp_ps_mask(err, best_err, _CMP_LT_OQ);
    best_err = _mm512_mask_blend_ps(take, best_err, err);
    best_factor = _mm512_mask_blend_ps(take, best_factor, f);
    for (int64_t i = 0; i < n; ++i) codes[i] = _mm512_mask_blend_ps(take, codes[i], c[i]);
    first = false;
  }
  return best_factor;
}

// 16 integer-valued fp32 lanes (0..255 or -127..127) to their 16 bytes; bf16-valued lanes to bits.
EDGE_VNNI inline void store_codes16(uint8_t* dst, __m512 codes) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(codes)));
}
EDGE_VNNI inline void store_bf16x16(uint16_t* dst, __m512 bf16_valued) {
  const __m512i bits = _mm512_srli_epi32(_mm512_castps_si512(bf16_valued), 16);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm512_cvtepi32_epi16(bits));
}

// One tile's superblocks (16 rows, lanes): the codes and factors group_codes.encode gives, written
// in the ops' tile layout. s and o are the tile's stored rows ([16][groups] bf16), w its stored
// qweight rows; false if a scale is negative or a value not finite.
EDGE_VNNI bool encode_tile(const uint16_t* s, const uint16_t* o, const uint8_t* w, int64_t groups, int64_t sb,
                           int64_t half_k, uint8_t* scale_codes, uint8_t* offset_codes, uint16_t* factors) {
  const int64_t group_bytes = half_k / groups, supers = groups / sb;
  alignas(64) float sv[kMaxSuperblock][kTileRows], ov[kMaxSuperblock][kTileRows];
  bool ok = true;
  const __m512 zero = _mm512_setzero_ps(), sign = _mm512_set1_ps(-0.f);
  for (int64_t su = 0; su < supers; ++su) {
    for (int64_t i = 0; i < sb; ++i) {
      const int64_t g = su * sb + i;
      for (int64_t j = 0; j < kTileRows; ++j) {
        float scale = bf16_to_float(s[j * groups + g]);
        const float offset = bf16_to_float(o[j * groups + g]);
        ok = ok && std::isfinite(scale) && std::isfinite(offset) && scale >= 0.f;
        // A group whose 4-bit codes are all 0 never reads its scale (group_codes.encode).
        const uint8_t* g4 = w + j * half_k + g * group_bytes;
        bool unused = true;
        for (int64_t k = 0; k < group_bytes && unused; ++k) unused = g4[k] == 0;
        sv[i][j] = unused && std::isfinite(scale) ? 0.f : scale;
        ov[i][j] = offset;
      }
    }
    __m512 v[kMaxSuperblock], c[kMaxSuperblock], mag[kMaxSuperblock], mc[kMaxSuperblock];
    for (int64_t i = 0; i < sb; ++i) v[i] = _mm512_load_ps(sv[i]);
    const __m512 d = fit_unsigned16(v, sb, c);
    __mmask16 nonpositive = 0xFFFF;
    __m512 top = zero;
    for (int64_t i = 0; i < sb; ++i) {
      v[i] = _mm512_load_ps(ov[i]);
      nonpositive &= _mm512_cmp_ps_mask(v[i], zero, _CMP_LE_OQ);
      mag[i] = _mm512_max_ps(_mm512_xor_ps(v[i], sign), zero);
      top = _mm512_max_ps(top, _mm512_andnot_ps(sign, v[i]));
    }
    const __m512 magnitude = fit_unsigned16(mag, sb, mc);
    __m512 m = bf16_round16(_mm512_div_ps(top, _mm512_set1_ps(127.f)));
    m = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(m, zero, _CMP_GT_OQ), _mm512_set1_ps(1.f), m);
    for (int64_t i = 0; i < sb; ++i) {
      const int64_t g = su * sb + i;
      store_codes16(scale_codes + g * kTileRows, c[i]);
      const __m512 signed_codes = _mm512_min_ps(_mm512_max_ps(round_even(_mm512_div_ps(v[i], m)),
                                                              _mm512_set1_ps(-127.f)), _mm512_set1_ps(127.f));
      store_codes16(offset_codes + g * kTileRows, _mm512_mask_blend_ps(nonpositive, signed_codes, mc[i]));
    }
    store_bf16x16(factors + su * 2 * kTileRows, d);
    store_bf16x16(factors + su * 2 * kTileRows + kTileRows,
                  _mm512_mask_blend_ps(nonpositive, m, _mm512_xor_ps(magnitude, sign)));
  }
  return ok;
}

// The stored triple into the 16-row layout with 8-bit group codes (quantization/group_codes.py):
// qweight rearranged in place; returns [scale codes uint8 [N, G], offset codes uint8 [N, G],
// factors bf16 [N, 2 * superblocks]], each in the tile layout the ops read ([tile][group][16 rows];
// [tile][superblock][D, M][16 rows]). The codes are group_codes.encode(scales, offsets, qweight)'s,
// bit for bit; a tile's 16 rows are encoded together, one per vector lane.
std::vector<at::Tensor> rows16_group_codes_inplace(at::Tensor& qweight, const at::Tensor& scales,
                                                   const at::Tensor& offsets) {
  static const bool supported = cpu_has_vnni();
  TORCH_CHECK(supported, "rows16_group_codes_inplace: this CPU has no AVX-512 VNNI (avx512f/bw/vl/dq/vnni)");
  check_interleave_shape("rows16_group_codes_inplace", qweight, kTileRows);
  TORCH_CHECK(qweight.is_contiguous(), "rows16_group_codes_inplace: qweight must be contiguous");
  const int64_t N = qweight.size(0), half_k = qweight.size(1);
  for (const auto* t : {&scales, &offsets}) {
    TORCH_CHECK(t->scalar_type() == at::kBFloat16 && t->dim() == 2 && t->size(0) == N,
                "rows16_group_codes_inplace: scales and offsets must be bf16 [", N, ", groups], got ",
                t->scalar_type(), " ", t->sizes());
  }
  TORCH_CHECK(scales.sizes() == offsets.sizes(), "rows16_group_codes_inplace: scales ", scales.sizes(),
              " and offsets ", offsets.sizes(), " differ");
  const int64_t groups = scales.size(1), sb = superblock_groups(groups), supers = groups / sb;
  TORCH_CHECK(groups > 0 && half_k % groups == 0, "rows16_group_codes_inplace: ", groups,
              " groups do not divide K=", 2 * half_k);
  const at::Tensor sc = scales.contiguous(), oc = offsets.contiguous();
  at::Tensor scale_codes = at::empty({N, groups}, qweight.options());
  at::Tensor offset_codes = at::empty({N, groups}, qweight.options());
  at::Tensor factors = at::empty({N, 2 * supers}, qweight.options().dtype(at::kBFloat16));
  const uint16_t* sp = bf16_bits(sc);
  const uint16_t* op = bf16_bits(oc);
  const uint8_t* w = qweight.data_ptr<uint8_t>();  // read in the stored layout, before the rearrangement
  uint8_t* scp = scale_codes.data_ptr<uint8_t>();
  uint8_t* ocp = offset_codes.data_ptr<uint8_t>();
  uint16_t* fp = reinterpret_cast<uint16_t*>(factors.data_ptr<at::BFloat16>());
  std::atomic<bool> bad{false};
  at::parallel_for(0, N / kTileRows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t row = t * kTileRows;
      if (!encode_tile(sp + row * groups, op + row * groups, w + row * half_k, groups, sb, half_k,
                       scp + row * groups, ocp + row * groups, fp + row * 2 * supers)) {
        bad = true;
      }
    }
  });
  TORCH_CHECK(!bad, "rows16_group_codes_inplace: group codes need finite scales >= 0 and finite offsets");
  interleave_tiles_inplace(qweight.data_ptr<uint8_t>(), N, half_k, kTileRows);
  return {scale_codes, offset_codes, factors};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(edge_cpu_int4, m) {
  m.def("w4a8_vnni_rows16_mm(Tensor x, Tensor qweight, Tensor scales, Tensor offsets, int group_size, "
        "Tensor? factors=None, Tensor? high_bits=None) -> Tensor");
  m.def("w4a8_vnni_rows16_silu_mlp(Tensor x, Tensor gate_up_qweight, Tensor gate_up_scales, "
        "Tensor gate_up_offsets, int gate_up_group_size, Tensor down_qweight, Tensor down_scales, "
        "Tensor down_offsets, int down_group_size, Tensor? gate_up_factors=None, "
        "Tensor? down_factors=None, Tensor? gate_up_high_bits=None, Tensor? down_high_bits=None) -> Tensor");
  m.def("interleave_rows16_inplace(Tensor(a!) qweight, Tensor(b!) scales, Tensor(c!) offsets) -> ()");
  m.def("rows16_group_codes_inplace(Tensor(a!) qweight, Tensor scales, Tensor offsets) -> Tensor[]");
  m.def("rows16_dequantize(Tensor qweight, Tensor scales, Tensor offsets, int group_size, bool portable=False, "
        "Tensor? factors=None, Tensor? high_bits=None) -> Tensor");
  m.def("interleave_rows16_high_bits_inplace(Tensor(a!) high_bits) -> ()");
  m.def("set_bf16_prefill(int min_rows, int block_bytes, int gemm=0, int onednn_from_rows=0) -> ()", &set_bf16_prefill);
  m.def("rows16_path_counts() -> int[]", &rows16_path_counts);
  m.def("rows16_decode_prefetch(int blocks) -> int", &rows16_decode_prefetch);
  m.def("amx_bf16_usable() -> bool", &amx_bf16_ready);
}

TORCH_LIBRARY_IMPL(edge_cpu_int4, CPU, m) {
  m.impl("w4a8_vnni_rows16_mm", &w4a8_vnni_rows16_mm);
  m.impl("w4a8_vnni_rows16_silu_mlp", &w4a8_vnni_rows16_silu_mlp);
  m.impl("interleave_rows16_inplace", &interleave_rows16_inplace);
  m.impl("rows16_group_codes_inplace", &rows16_group_codes_inplace);
  m.impl("rows16_dequantize", &rows16_dequantize);
  m.impl("interleave_rows16_high_bits_inplace", &interleave_rows16_high_bits_inplace);
}
