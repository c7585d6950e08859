// What the W4A8 ops share (w4a8_avx2.cpp, w4a8_avx512.cpp): the cpu_int4 stored format's
// checks (format 2: unsigned 4-bit weights uint8 [N, K/2], per-group bf16 scale and offset),
// the int8 activations in blocks of 32 and the buffer that holds them, and the interleaved
// layouts of tiles of weight rows (8 rows for AVX2, 16 for AVX-512) made from the stored one.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace edge_cpu_int4 {

constexpr int64_t kBlock = 32;
// Activation rows sharing one unpacked weight block (prefill): 4 accumulators plus
// their operands fit AVX2's 16 ymm registers.
constexpr int64_t kRowTile = 4;
// Weight rows per tile of the 16-row interleaved layout (w4a8_avx512.cpp).
constexpr int64_t kTileRows = 16;
// Weight rows per tile of the 8-row interleaved layout (w4a8_avx2.cpp): one int32 lane of a
// 256-bit vector each.
constexpr int64_t kTileRows8 = 8;

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

// One linear's 4-bit weights, for an input of K features; in an interleaved layout of tiles of
// `tile_rows` rows (0: the stored layout), N a multiple of it.
inline void check_qweight(const char* op, const at::Tensor& qweight, int64_t K, int64_t group_size,
                          int64_t tile_rows) {
  TORCH_CHECK(qweight.dim() == 2 && qweight.scalar_type() == at::kByte, op, ": qweight must be uint8 [N, K/2]");
  const int64_t N = qweight.size(0);
  TORCH_CHECK(group_size > 0 && group_size % kBlock == 0, op, ": group size ", group_size,
              " is not a multiple of 32");
  TORCH_CHECK(K % group_size == 0, op, ": group size ", group_size, " does not divide K=", K);
  TORCH_CHECK(qweight.size(1) * 2 == K, op, ": qweight ", qweight.sizes(), " does not match K=", K);
  TORCH_CHECK(!tile_rows || N % tile_rows == 0, op, ": the ", tile_rows, "-row layout needs N a multiple of ",
              tile_rows, ", got N=", N);
}

// The stored triple of one linear (bf16 scales and offsets), for an input of K features.
inline void check_weight(const char* op, const at::Tensor& qweight, const at::Tensor& scales, const at::Tensor& offsets,
                         int64_t K, int64_t group_size, int64_t tile_rows) {
  check_qweight(op, qweight, K, group_size, tile_rows);
  const int64_t N = qweight.size(0);
  const int64_t groups = K / group_size;
  for (const auto* t : {&scales, &offsets}) {
    TORCH_CHECK(t->scalar_type() == at::kBFloat16 && t->dim() == 2 && t->size(0) == N && t->size(1) == groups,
                op, ": scales and offsets must be bf16 [", N, ", ", groups, "], got ", t->scalar_type(), " ",
                t->sizes());
  }
}

// The interleaved layouts, same shape and bytes as the stored qweight [N, K/2]: per tile of
// `rows` rows (8 or 16) and block b of 32 k, 4 chunks c of 4 * rows bytes; byte 4j + i of chunk c
// holds row j's k = 32b + 8c + i (low nibble) and k = 32b + 8c + 4 + i (high nibble). So stored
// word w = 4b + c of row j (k = 32b + 8c .. + 7, nibbles in k order) becomes word j of chunk c
// of block b with its nibbles perfect-shuffled: [k0 k4 k1 k5 k2 k6 k3 k7]. One integer dot of a
// chunk with 4 activations broadcast then leaves row j's partial sum in int32 lane j.
// Done once per linear at load, in C++: as torch ops (unpack, a 6-D permute, repack) it was
// a sizeable part of a start (docs/edge/cpu-4bit.md).
inline uint32_t shuffle_nibbles(uint32_t x) {
  uint32_t t = (x ^ (x >> 8)) & 0x0000FF00u;  // [a0 a1 a2 a3 b0 b1 b2 b3] -> [a0 a1 b0 b1 a2 a3 b2 b3]
  x ^= t ^ (t << 8);
  t = (x ^ (x >> 4)) & 0x00F000F0u;  // -> [a0 b0 a1 b1 a2 b2 a3 b3]
  return x ^ t ^ (t << 4);
}

// Rearranges the tiles of a contiguous qweight [N, K/2] in place, each through a per-thread scratch
// copy of its rows (a tile's bytes are the same range in both layouts): no second weight-sized
// buffer, whose first touch (page faults) cost about as much as the rearrangement, and the
// scattered writes stay within one tile in L2.
inline void interleave_tiles_inplace(uint8_t* data, int64_t N, int64_t half_k, int64_t rows) {
  const int64_t words = half_k / 4;  // per row; 4 per block of 32 k
  const int64_t tile_bytes = rows * half_k;
  at::parallel_for(0, N / rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<uint8_t> scratch(tile_bytes);
    for (int64_t t = begin; t < end; ++t) {
      uint8_t* tile = data + t * tile_bytes;
      std::memcpy(scratch.data(), tile, tile_bytes);
      for (int64_t j = 0; j < rows; ++j) {
        const uint8_t* row = scratch.data() + j * half_k;
        for (int64_t w = 0; w < words; ++w) {
          uint32_t word;
          std::memcpy(&word, row + 4 * w, 4);
          word = shuffle_nibbles(word);
          std::memcpy(tile + (w / 4) * rows * (kBlock / 2) + (w % 4) * 4 * rows + 4 * j, &word, 4);
        }
      }
    }
  });
}

// Per tile of `rows` rows, a contiguous bf16 [N, groups] becomes [groups][rows], in place.
inline void tile_transpose_inplace(uint16_t* data, int64_t N, int64_t groups, int64_t rows) {
  const int64_t tile = rows * groups;
  at::parallel_for(0, N / rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<uint16_t> scratch(tile);
    for (int64_t t = begin; t < end; ++t) {
      uint16_t* d = data + t * tile;
      std::memcpy(scratch.data(), d, tile * sizeof(uint16_t));
      for (int64_t j = 0; j < rows; ++j) {
        for (int64_t g = 0; g < groups; ++g) d[g * rows + j] = scratch[j * groups + g];
      }
    }
  });
}

inline void check_interleave_shape(const char* op, const at::Tensor& qweight, int64_t rows) {
  TORCH_CHECK(qweight.dim() == 2 && qweight.scalar_type() == at::kByte,
              op, ": qweight must be uint8 [N, K/2], got ", qweight.scalar_type(), " ", qweight.sizes());
  const int64_t N = qweight.size(0), half_k = qweight.size(1);
  TORCH_CHECK(N % rows == 0, op, ": N must be a multiple of ", rows, ", got N=", N);
  TORCH_CHECK(half_k % (kBlock / 2) == 0, op, ": K must be a multiple of ", kBlock, ", got K=", 2 * half_k);
}

// The stored triple rearranged into the `rows`-row layout in place. Scales and offsets: bf16
// [N, groups] -> [tile][group][rows].
inline void interleave_triple_inplace(const char* op, at::Tensor& qweight, at::Tensor& scales, at::Tensor& offsets,
                                      int64_t rows) {
  check_interleave_shape(op, qweight, rows);
  const int64_t N = qweight.size(0);
  TORCH_CHECK(qweight.is_contiguous(), op, ": qweight must be contiguous");
  for (const auto* t : {&scales, &offsets}) {
    TORCH_CHECK(t->scalar_type() == at::kBFloat16 && t->dim() == 2 && t->size(0) == N && t->is_contiguous(),
                op, ": scales and offsets must be contiguous bf16 [", N, ", groups], got ",
                t->scalar_type(), " ", t->sizes());
  }
  TORCH_CHECK(scales.data_ptr() != offsets.data_ptr(), op, ": scales and offsets must be distinct tensors");
  interleave_tiles_inplace(qweight.data_ptr<uint8_t>(), N, qweight.size(1), rows);
  for (auto* t : {&scales, &offsets}) {
    tile_transpose_inplace(reinterpret_cast<uint16_t*>(t->data_ptr<at::BFloat16>()), N, t->size(1), rows);
  }
}

}  // namespace edge_cpu_int4
