// What the W4A8 ops share (w4a8_avx2.cpp, w4a8_avx512.cpp): the cpu_int4 stored format's
// checks (format 2: unsigned 4-bit weights uint8 [N, K/2], per-group bf16 scale and offset),
// the int8 activations in blocks of 32 and the buffer that holds them.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace edge_cpu_int4 {

constexpr int64_t kBlock = 32;
// Activation rows sharing one unpacked weight block (prefill): 4 accumulators plus
// their operands fit AVX2's 16 ymm registers.
constexpr int64_t kRowTile = 4;
// Weight rows per tile of the 16-row interleaved layout (w4a8_avx512.cpp).
constexpr int64_t kTileRows = 16;

inline float bf16_to_float(uint16_t bits) {
  const uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

struct QuantizedActivations {
  const int8_t* q;           // [M, K], each block in the order the op's weights use
  const float* block_scale;  // [M, K / 32]
  const float* group_sum;    // [M, K / group_size], exact float sums of x
};

// Calls f(std::integral_constant<int, R>{}) with R = rows (1..kRowTile): the kernels take the
// activation-row count as a template parameter so their accumulators stay in registers.
template <typename F>
inline void with_row_count(int64_t rows, F&& f) {
  switch (rows) {
    case 4: return f(std::integral_constant<int, 4>{});
    case 3: return f(std::integral_constant<int, 3>{});
    case 2: return f(std::integral_constant<int, 2>{});
    default: return f(std::integral_constant<int, 1>{});
  }
}

// An activation's int8 rows, block scales and group sums, in one uninitialised allocation:
// every element is written by the quantization before it is read.
struct ActivationBuffer {
  at::Tensor storage;
  int8_t* q;
  float* block_scale;
  float* group_sum;

  ActivationBuffer(int64_t M, int64_t K, int64_t group_size, const at::TensorOptions& options) {
    const auto aligned = [](int64_t bytes) { return (bytes + 63) / 64 * 64; };
    const int64_t q_bytes = aligned(M * K), scale_bytes = aligned(M * (K / kBlock) * 4);
    storage = at::empty({q_bytes + scale_bytes + M * (K / group_size) * 4}, options.dtype(at::kByte));
    uint8_t* base = storage.data_ptr<uint8_t>();
    q = reinterpret_cast<int8_t*>(base);
    block_scale = reinterpret_cast<float*>(base + q_bytes);
    group_sum = reinterpret_cast<float*>(base + q_bytes + scale_bytes);
  }
  QuantizedActivations activations() const { return {q, block_scale, group_sum}; }
};

// A contiguous bf16 tensor's elements as raw bits (scales and offsets are widened by shifts).
inline const uint16_t* bf16_bits(const at::Tensor& t) {
  return reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>());
}

// One linear's 4-bit weights, for an input of K features (rows16: N a multiple of 16).
inline void check_qweight(const char* op, const at::Tensor& qweight, int64_t K, int64_t group_size, bool rows16) {
  TORCH_CHECK(qweight.dim() == 2 && qweight.scalar_type() == at::kByte, op, ": qweight must be uint8 [N, K/2]");
  const int64_t N = qweight.size(0);
  TORCH_CHECK(group_size > 0 && group_size % kBlock == 0, op, ": group size ", group_size,
              " is not a multiple of 32");
  TORCH_CHECK(K % group_size == 0, op, ": group size ", group_size, " does not divide K=", K);
  TORCH_CHECK(qweight.size(1) * 2 == K, op, ": qweight ", qweight.sizes(), " does not match K=", K);
  TORCH_CHECK(!rows16 || N % kTileRows == 0, op, ": the 16-row layout needs N a multiple of 16, got N=", N);
}

// The stored triple of one linear (bf16 scales and offsets), for an input of K features.
inline void check_weight(const char* op, const at::Tensor& qweight, const at::Tensor& scales, const at::Tensor& offsets,
                         int64_t K, int64_t group_size, bool rows16) {
  check_qweight(op, qweight, K, group_size, rows16);
  const int64_t N = qweight.size(0);
  const int64_t groups = K / group_size;
  for (const auto* t : {&scales, &offsets}) {
    TORCH_CHECK(t->scalar_type() == at::kBFloat16 && t->dim() == 2 && t->size(0) == N && t->size(1) == groups,
                op, ": scales and offsets must be bf16 [", N, ", ", groups, "], got ", t->scalar_type(), " ",
                t->sizes());
  }
}

}  // namespace edge_cpu_int4
