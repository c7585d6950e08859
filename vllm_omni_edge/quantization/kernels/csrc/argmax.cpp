// Row-wise argmax of a 2-D float tensor, as torch.argmax(x, dim=-1) returns it: the index of
// the first maximum of each row, or of the row's first NaN when it has one.
//
// A sampler takes one token per row from a vocabulary-wide row of logits (or of probabilities
// divided by an exponential race). ATen's CPU argmax reduces such a row at about two
// nanoseconds an element; eight lanes here keep their own running maximum and its index with
// a strict greater-than (so each lane keeps its first maximum), and the lanes are merged by
// value, then by the smallest index: the first maximum of the row.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include "widen8.h"

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace {

using edge_cpu_widen::load8;

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

at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2, "argmax_rows: x must be 2-D [rows, n], got ", x.sizes());
  TORCH_CHECK(x.size(1) > 0, "argmax_rows: rows of length 0 have no maximum");
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
  switch (xc.scalar_type()) {
    case at::kFloat: run(float{}); break;
    case at::kBFloat16: run(c10::BFloat16{}); break;
    case at::kHalf: run(c10::Half{}); break;
    default: TORCH_CHECK(false, "argmax_rows: x dtype ", xc.scalar_type(), " is not float32, bfloat16 or float16");
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(edge_cpu, m) { m.def("argmax_rows(Tensor x) -> Tensor"); }

TORCH_LIBRARY_IMPL(edge_cpu, CPU, m) { m.impl("argmax_rows", &argmax_rows); }
