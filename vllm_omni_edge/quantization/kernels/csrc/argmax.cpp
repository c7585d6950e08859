// Row-wise argmax of a 2-D float tensor, as torch.argmax(x, dim=-1) returns it: the index of
// the first maximum of each row, or of the row's first NaN when it has one. And a random draw
// from softmax(row) as the argmax of the row plus Gumbel noise made here (gumbel_argmax).
//
// A sampler takes one token per row from a vocabulary-wide row of logits (or of probabilities
// divided by an exponential race). ATen's CPU argmax reduces such a row element by element;
// eight lanes here keep their own running maximum and its index with
// a strict greater-than (so each lane keeps its first maximum), and the lanes are merged by
// value, then by the smallest index: the first maximum of the row.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include "convert8.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

using edge_cpu_convert::load8;

template <typename T>
int64_t first_nan(const T* row, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    if (std::isnan(static_cast<float>(row[i]))) return i;
  }
  return -1;
}

template <typename T>
int64_t argmax_row(const T* row, int64_t n) {
  int64_t i = 0;
  float best = static_cast<float>(row[0]);
  int64_t best_index = 0;
  bool nan = false;
  if (n >= 8) {
    __m256 lane_max = load8(row);
    __m256i lane_index = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    __m256i index = lane_index;
    const __m256i eight = _mm256_set1_epi32(8);
    __m256 unordered = _mm256_cmp_ps(lane_max, lane_max, _CMP_UNORD_Q);
    for (i = 8; i + 8 <= n; i += 8) {
      const __m256 v = load8(row + i);
      index = _mm256_add_epi32(index, eight);
      const __m256 greater = _mm256_cmp_ps(v, lane_max, _CMP_GT_OQ);
      lane_max = _mm256_blendv_ps(lane_max, v, greater);
      lane_index = _mm256_castps_si256(
          _mm256_blendv_ps(_mm256_castsi256_ps(lane_index), _mm256_castsi256_ps(index), greater));
      unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
    nan = _mm256_movemask_ps(unordered) != 0;
    alignas(32) float values[8];
    alignas(32) int32_t indices[8];
    _mm256_store_ps(values, lane_max);
    _mm256_store_si256(reinterpret_cast<__m256i*>(indices), lane_index);
    best = values[0];
    best_index = indices[0];
    for (int j = 1; j < 8; ++j) {
      if (values[j] > best || (values[j] == best && indices[j] < best_index)) {
        best = values[j];
        best_index = indices[j];
      }
    }
  } else {
    i = 1;
    nan = std::isnan(best);
  }
  for (; i < n; ++i) {  // the tail, past every index above: strict > keeps the first maximum
    const float v = static_cast<float>(row[i]);
    nan = nan || std::isnan(v);
    if (v > best) {
      best = v;
      best_index = i;
    }
  }
  return nan ? first_nan(row, n) : best_index;
}

// ---- A draw from softmax(x) by the Gumbel-max trick ----
//
// argmax_i (x_i + G_i) with G_i = -log(-log u_i), u_i uniform in (0, 1), is a draw from
// softmax(x): the exponential race argmax_i p_i / q_i (q_i = -log u_i ~ Exp(1)) in logs, with no
// softmax. u_i comes from a counter-based hash of (seed, row, i), so a draw needs one 64-bit seed
// and no buffer of uniforms, and is the same whatever the thread count.

// Chris Wellons' lowbias32 integer hash, one value and 8 lanes.
inline uint32_t hash32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  return x ^ (x >> 16);
}

inline __m256i hash8(__m256i x) {
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32(0x7feb352d));
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 15));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32(static_cast<int32_t>(0x846ca68bu)));
  return _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
}

// ln x for 8 positive normal lanes: x = 2^e m with m in [sqrt(1/2), sqrt(2)), ln m = 2 atanh(s),
// s = (m - 1) / (m + 1), by its series to s^9 (|s| < 0.172: relative error below 1e-8).
inline __m256 log8(__m256 x) {
  const __m256i bits = _mm256_castps_si256(x);
  __m256i e = _mm256_sub_epi32(_mm256_srli_epi32(bits, 23), _mm256_set1_epi32(127));
  __m256 m = _mm256_castsi256_ps(
      _mm256_or_si256(_mm256_and_si256(bits, _mm256_set1_epi32(0x007fffff)), _mm256_set1_epi32(0x3f800000)));
  const __m256 big = _mm256_cmp_ps(m, _mm256_set1_ps(1.41421356f), _CMP_GT_OQ);
  m = _mm256_blendv_ps(m, _mm256_mul_ps(m, _mm256_set1_ps(0.5f)), big);
  e = _mm256_add_epi32(e, _mm256_and_si256(_mm256_castps_si256(big), _mm256_set1_epi32(1)));
  const __m256 one = _mm256_set1_ps(1.f);
  const __m256 s = _mm256_div_ps(_mm256_sub_ps(m, one), _mm256_add_ps(m, one));
  const __m256 z = _mm256_mul_ps(s, s);
  __m256 p = _mm256_set1_ps(1.f / 9);
  for (const float c : {1.f / 7, 1.f / 5, 1.f / 3, 1.f}) p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(c));
  const __m256 ln_m = _mm256_mul_ps(_mm256_add_ps(s, s), p);
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(e), _mm256_set1_ps(0.69314718055994531f), ln_m);
}

// Gumbel noise for the 8 elements at `index` of the stream `key` (the hash of key + index, so two
// streams read different stretches of the hash's input): u = (23 hash bits + 1/2) / 2^23,
// in [2^-24, 1 - 2^-24], both ends exact in fp32, so -log u > 0 and the noise is finite.
inline __m256 gumbel8(__m256i index, __m256i key) {
  const __m256i h = hash8(_mm256_add_epi32(index, key));
  const __m256 u = _mm256_mul_ps(_mm256_add_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(h, 9)), _mm256_set1_ps(0.5f)),
                                 _mm256_set1_ps(1.f / 8388608.f));
  const __m256 minus_log_u = _mm256_sub_ps(_mm256_setzero_ps(), log8(u));
  return _mm256_sub_ps(_mm256_setzero_ps(), log8(minus_log_u));
}

struct Best {
  float value;
  int64_t index;
  bool nan;
};

// The first maximum of x_i + G_i over [begin, end) of one row (NaN flagged: the caller returns the
// row's first NaN, as the argmax of a row with NaN does).
template <typename T>
Best gumbel_best(const T* row, int64_t begin, int64_t end, __m256i key) {
  __m256 lane_max = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256i lane_index = _mm256_set1_epi32(std::numeric_limits<int32_t>::max());
  __m256 unordered = _mm256_setzero_ps();
  const __m256i step = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  for (int64_t i = begin; i < end; i += 8) {
    __m256 x;
    if (i + 8 <= end) {
      x = load8(row + i);
    } else {  // the tail, padded with -inf (never a maximum)
      alignas(32) float pad[8];
      for (int j = 0; j < 8; ++j) pad[j] = i + j < end ? static_cast<float>(row[i + j]) : -std::numeric_limits<float>::infinity();
      x = _mm256_load_ps(pad);
    }
    const __m256i index = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int32_t>(i)), step);
    const __m256 y = _mm256_add_ps(x, gumbel8(index, key));
    unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    // Strict >: a lane keeps its first maximum; -inf + noise never beats the initial -inf.
    const __m256 greater = _mm256_cmp_ps(y, lane_max, _CMP_GT_OQ);
    lane_max = _mm256_blendv_ps(lane_max, y, greater);
    lane_index = _mm256_castps_si256(
        _mm256_blendv_ps(_mm256_castsi256_ps(lane_index), _mm256_castsi256_ps(index), greater));
  }
  alignas(32) float values[8];
  alignas(32) int32_t indices[8];
  _mm256_store_ps(values, lane_max);
  _mm256_store_si256(reinterpret_cast<__m256i*>(indices), lane_index);
  Best best{values[0], indices[0], _mm256_movemask_ps(unordered) != 0};
  for (int j = 1; j < 8; ++j) {
    if (values[j] > best.value || (values[j] == best.value && indices[j] < best.index)) {
      best.value = values[j];
      best.index = indices[j];
    }
  }
  return best;
}

// The shape both ops take: 2-D, rows of 1 to 2^31 - 1 elements (lane indices are int32).
void check_rows(const char* op, const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2, op, ": x must be 2-D [rows, n], got ", x.sizes());
  TORCH_CHECK(x.size(1) > 0, op, ": rows of length 0 have no element to pick");
  TORCH_CHECK(x.size(1) < std::numeric_limits<int32_t>::max(), op, ": rows longer than 2^31 - 1");
}

// fn(T{}) for the element type T of x, or an error naming the dtype.
template <typename Fn>
void on_float_rows(const char* op, const at::Tensor& x, Fn&& fn) {
  switch (x.scalar_type()) {
    case at::kFloat: fn(float{}); break;
    case at::kBFloat16: fn(c10::BFloat16{}); break;
    case at::kHalf: fn(c10::Half{}); break;
    default: TORCH_CHECK(false, op, ": x dtype ", x.scalar_type(), " is not float32, bfloat16 or float16");
  }
}

at::Tensor gumbel_argmax(const at::Tensor& x, int64_t seed) {
  check_rows("gumbel_argmax", x);
  const at::Tensor xc = x.contiguous();
  const int64_t rows = xc.size(0), n = xc.size(1);
  at::Tensor out = at::empty({rows}, x.options().dtype(at::kLong));
  int64_t* op = out.data_ptr<int64_t>();
  const uint64_t s = static_cast<uint64_t>(seed);
  // A row splits into chunks for the threads once it is long enough to pay for waking them.
  constexpr int64_t kChunk = 16384;
  const int64_t chunks = (n + kChunk - 1) / kChunk;
  auto run = [&](auto tag) {
    using T = decltype(tag);
    const T* xp = xc.data_ptr<T>();
    std::vector<Best> parts(rows * chunks);
    at::parallel_for(0, rows * chunks, 1, [&](int64_t begin, int64_t end) {
      for (int64_t item = begin; item < end; ++item) {
        const int64_t r = item / chunks, c = item % chunks;
        // Each (seed, row) its own stream: both halves of the seed and the row hashed into the key.
        const uint32_t key = hash32(static_cast<uint32_t>(s) ^ hash32(static_cast<uint32_t>(s >> 32) ^
                                                                     hash32(static_cast<uint32_t>(r) + 0x9E3779B9u)));
        parts[item] = gumbel_best(xp + r * n, c * kChunk, std::min(n, (c + 1) * kChunk),
                                  _mm256_set1_epi32(static_cast<int32_t>(key)));
      }
    });
    for (int64_t r = 0; r < rows; ++r) {
      Best best = parts[r * chunks];
      for (int64_t c = 1; c < chunks; ++c) {  // later chunks hold later indices: strict >
        const Best& part = parts[r * chunks + c];
        best.nan = best.nan || part.nan;
        if (part.value > best.value) {
          best.value = part.value;
          best.index = part.index;
        }
      }
      // A row of -inf has no draw: index 0, as the argmax of its NaN softmax.
      op[r] = best.nan ? first_nan(xp + r * n, n) : best.index == std::numeric_limits<int32_t>::max() ? 0 : best.index;
    }
  };
  on_float_rows("gumbel_argmax", xc, run);
  return out;
}

at::Tensor argmax_rows(const at::Tensor& x) {
  check_rows("argmax_rows", x);
  const at::Tensor xc = x.contiguous();
  const int64_t rows = xc.size(0), n = xc.size(1);
  at::Tensor out = at::empty({rows}, x.options().dtype(at::kLong));
  int64_t* op = out.data_ptr<int64_t>();
  auto run = [&](auto tag) {
    using T = decltype(tag);
    const T* xp = xc.data_ptr<T>();
    // Rows in parallel only when there is enough of them to pay for waking the threads.
    const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 18) / n);
    at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) op[r] = argmax_row(xp + r * n, n);
    });
  };
  on_float_rows("argmax_rows", xc, run);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(edge_cpu, m) {
  m.def("argmax_rows(Tensor x) -> Tensor");
  m.def("gumbel_argmax(Tensor x, int seed) -> Tensor");
}

TORCH_LIBRARY_IMPL(edge_cpu, CPU, m) {
  m.impl("argmax_rows", &argmax_rows);
  m.impl("gumbel_argmax", &gumbel_argmax);
}
