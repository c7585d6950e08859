// Decode attention over vLLM's CPU paged KV cache: every query is one new token.
//
// vLLM's CPU attention op (cpu_attention_with_kv_cache) serves prefill and decode with one
// tiled kernel and a scheduler; for a batch of single-token queries its fixed cost per call
// dwarfs the arithmetic, and the KV write is a second op with its own parallel region. This
// op does both for such a batch: it writes each token's key and value into its cache slot,
// then attends over the request's blocks, one work item per (request, KV head), the query
// heads of a GQA group sharing the item. When a long context gives fewer items than two a
// thread (one request of a model with few KV heads), each item attends over a part of the
// positions and the parts are merged by their softmax maxima and sums, so the group still reads
// each key and value once.
//
// Cache layouts (vLLM's, checked against vLLM's own write in the tests): kv_cache [blocks,
// kv_heads, block_size, 2 * head] holds per (block, kv head) a key half then a value half.
// - "vec" and "vec16" ISAs: keys as [head][block_size] (dim-major, so a dim's scores over 8
//   positions are one vector), values as [block_size][head].
// - "amx" ISA (bfloat16, head and block_size multiples of 32; `amx_layout`): keys as [block_size / 16]
//   [head / 2][16][2] and values as [head / 16][block_size / 2][16][2], pairs of bfloat16 in
//   each 32-bit lane (dims for keys, positions for values). One 256-bit load widens to two
//   vectors in order: the even elements shifted up, the odd ones masked.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include "avx2_math.h"
#include "convert8.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

using edge_cpu_math::exp8;
using edge_cpu_math::horizontal_sum;
using edge_cpu_convert::load8;

// 16 values as two vectors. bfloat16 widens with two unpacks of one load (cheaper than two
// zero-extends and shifts) at the price of order: the vectors hold elements 0-3, 8-11 and
// 4-7, 12-15; in_order() restores it on sums kept in the same order.
struct Pair {
  __m256 a, b;
};
inline Pair load16(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline Pair load16(const c10::Half* p) { return {load8(p), load8(p + 8)}; }
inline Pair load16(const c10::BFloat16* p) {
  const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i zero = _mm256_setzero_si256();
  return {_mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, x)), _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, x))};
}
template <typename T>
inline void in_order(__m256& a, __m256& b) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    const __m256 first = _mm256_permute2f128_ps(a, b, 0x20), second = _mm256_permute2f128_ps(a, b, 0x31);
    a = first;
    b = second;
  }
}

struct Shape {
  int64_t heads, kv_heads, head, block_size, max_blocks;
  int64_t q_row, q_head, k_row, k_head, v_row, v_head, out_row;
  float scale;
  int64_t window;
  bool write_kv;
  bool amx;
};

// Eight lanes of bfloat16 pairs as two float vectors: the pairs' first and second elements.
inline void widen_pairs(const c10::BFloat16* p, __m256& first, __m256& second) {
  const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  first = _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
  second = _mm256_castsi256_ps(_mm256_and_si256(x, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// The amx layout's element offsets inside a (block, kv head)'s key half and value half.
inline int64_t amx_key(int64_t pos, int64_t d, int64_t D) {
  return (pos / 16) * 16 * D + (d / 2) * 32 + (pos % 16) * 2 + d % 2;
}
inline int64_t amx_value(int64_t pos, int64_t d, int64_t BS) {
  return (d / 16) * BS * 16 + (pos / 2) * 32 + (d % 16) * 2 + pos % 2;
}

// The token's key and value into its slot of kv head h.
template <typename T>
void write_kv_slot(const Shape& s, int64_t r, int64_t h, const T* key, const T* value, T* cache, const int64_t* slots) {
  const int64_t slot = slots[r];
  if (slot < 0) return;  // a padded token
  const int64_t D = s.head, BS = s.block_size, half = BS * D;
  T* base = cache + ((slot / BS) * s.kv_heads + h) * 2 * half;
  const int64_t off = slot % BS;
  const T* k = key + r * s.k_row + h * s.k_head;
  const T* v = value + r * s.v_row + h * s.v_head;
  if (s.amx) {
    for (int64_t d = 0; d < D; ++d) {
      base[amx_key(off, d, D)] = k[d];
      base[half + amx_value(off, d, BS)] = v[d];
    }
    return;
  }
  for (int64_t d = 0; d < D; ++d) base[d * BS + off] = k[d];
  std::copy(v, v + D, base + half + off * D);
}

// amx layout: the scores of NG heads over positions [j, j + 8) of a block (j a multiple of 8):
// per pair of dims one load; even and odd dims summed apart (2 * NG independent sums).
template <int NG>
void amx_scores8(const c10::BFloat16* keys, int64_t j, int64_t D, const float* qf, float* scores, int64_t span) {
  __m256 even[NG], odd[NG];
  for (int g = 0; g < NG; ++g) even[g] = odd[g] = _mm256_setzero_ps();
  const c10::BFloat16* tile = keys + (j / 16) * 16 * D + (j % 16) * 2;
  for (int64_t e = 0; e < D / 2; ++e) {
    __m256 k0, k1;
    widen_pairs(tile + e * 32, k0, k1);
    for (int g = 0; g < NG; ++g) {
      even[g] = _mm256_fmadd_ps(_mm256_broadcast_ss(qf + g * D + 2 * e), k0, even[g]);
      odd[g] = _mm256_fmadd_ps(_mm256_broadcast_ss(qf + g * D + 2 * e + 1), k1, odd[g]);
    }
  }
  for (int g = 0; g < NG; ++g) _mm256_storeu_ps(scores + g * span + j, _mm256_add_ps(even[g], odd[g]));
}

// amx layout: a0/a1 (dims dc .. dc + 16 of NG heads) += the probability-weighted values of
// positions [lo, hi) of a block, a pair of positions a load; p: the block's probabilities.
template <int NG>
void amx_values16(const c10::BFloat16* values, int64_t lo, int64_t hi, int64_t dc, int64_t BS, const float* p,
                  int64_t span, __m256* a0, __m256* a1) {
  const c10::BFloat16* chunk = values + (dc / 16) * BS * 16;
  for (int64_t t = lo & ~int64_t{1}; t < hi; t += 2) {
    __m256 x0, y0, x1, y1;  // positions t and t + 1, dims dc .. dc + 8 and dc + 8 .. dc + 16
    widen_pairs(chunk + (t / 2) * 32, x0, y0);
    widen_pairs(chunk + (t / 2) * 32 + 16, x1, y1);
    // A position outside [lo, hi) weighs nothing; its slot may hold anything (not yet written).
    const bool first = t >= lo, second = t + 1 < hi;
    if (!first) x0 = x1 = _mm256_setzero_ps();
    if (!second) y0 = y1 = _mm256_setzero_ps();
    for (int g = 0; g < NG; ++g) {
      const __m256 p0 = _mm256_set1_ps(first ? p[g * span + t] : 0.f);
      const __m256 p1 = _mm256_set1_ps(second ? p[g * span + t + 1] : 0.f);
      a0[g] = _mm256_fmadd_ps(p1, y0, _mm256_fmadd_ps(p0, x0, a0[g]));
      a1[g] = _mm256_fmadd_ps(p1, y1, _mm256_fmadd_ps(p0, x1, a1[g]));
    }
  }
}

// Blocks a work item asks for ahead of the one it reads: a step's KV lines were last read a whole
// step ago, and the weights streamed since have evicted them.
constexpr int64_t kPrefetchBlocks = 4;

// One block's key half (into L1, read next) or value half (into L2, read after every score).
template <int Hint, typename T>
inline void prefetch_half(const T* p, int64_t elements) {
  const char* c = reinterpret_cast<const char*>(p);
  const int64_t bytes = elements * static_cast<int64_t>(sizeof(T));
  for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(c + off, static_cast<_mm_hint>(Hint));
}

// A head's attention over part of its positions, for the merge: the largest score m, the sum l of
// exp(score - m) and the exp-weighted sum of the value rows (D floats), unnormalized.
constexpr int64_t kPartialHeader = 2;
// At most this many position ranges a (request, kv head) when a long context is split.
constexpr int64_t kMaxParts = 8;

// NG query heads of kv head h's group (heads first_head .. first_head + NG) attend together over
// positions [start, L) of request r: each key and value vector is loaded and widened once for all
// of them. The heads' outputs go to `out`, or, with `partial` (NG rows of kPartialHeader + D
// floats), their unnormalized parts for merge_parts.
template <int NG, typename T>
void attend_heads(const Shape& s, int64_t r, int64_t h, int64_t first_head, int64_t start, int64_t L,
                  const T* query, const T* cache, T* out, float* partial, const int32_t* block_table,
                  std::vector<float>& buffer) {
  const int64_t D = s.head, BS = s.block_size, half = BS * D;
  const int32_t* blocks = block_table + r * s.max_blocks;
  const int64_t first_block = start / BS, last_block = (L - 1) / BS;
  // Scores of each head over whole blocks from the first block's start; [from, to) are attended.
  const int64_t span = (last_block - first_block + 1) * BS;
  const int64_t from = start - first_block * BS, to = L - first_block * BS;
  buffer.resize(static_cast<size_t>(NG * (span + D)));
  float* scores = buffer.data();
  float* qf = scores + NG * span;  // NG x D, scaled
  for (int g = 0; g < NG; ++g) {
    const T* q = query + r * s.q_row + (first_head + g) * s.q_head;
    for (int64_t d = 0; d < D; ++d) qf[g * D + d] = static_cast<float>(q[d]) * s.scale;
  }
  auto kv_of = [&](int64_t b) { return cache + (static_cast<int64_t>(blocks[b]) * s.kv_heads + h) * 2 * half; };
  for (int64_t b = first_block; b <= std::min(last_block, first_block + kPrefetchBlocks - 1); ++b)
    prefetch_half<_MM_HINT_T0>(kv_of(b), half);
  for (int64_t b = first_block; b <= last_block; ++b) {
    const T* keys = kv_of(b);
    if (b + kPrefetchBlocks <= last_block) prefetch_half<_MM_HINT_T0>(kv_of(b + kPrefetchBlocks), half);
    prefetch_half<_MM_HINT_T1>(keys + half, half);
    const int64_t base = (b - first_block) * BS;
    const int64_t lo = std::max<int64_t>(from - base, 0) & ~int64_t{7};
    const int64_t hi = std::min<int64_t>(to - base, BS);
    int64_t j = lo;
    if constexpr (std::is_same_v<T, c10::BFloat16>) {
      if (s.amx) {
        for (; j < hi; j += 8) amx_scores8<NG>(keys, j, D, qf, scores + base, span);
        continue;
      }
    }
    // Two 8-position chunks a pass where the block has them: 2 * NG independent sums hide the
    // multiply-add latency. block_size is a multiple of 8, so a chunk never leaves its block.
    for (; j < hi && j + 16 <= BS; j += 16) {
      __m256 acc[NG][2];
      for (int g = 0; g < NG; ++g) acc[g][0] = acc[g][1] = _mm256_setzero_ps();
      for (int64_t d = 0; d < D; ++d) {
        const Pair k = load16(keys + d * BS + j);
        for (int g = 0; g < NG; ++g) {
          const __m256 q = _mm256_broadcast_ss(qf + g * D + d);
          acc[g][0] = _mm256_fmadd_ps(q, k.a, acc[g][0]);
          acc[g][1] = _mm256_fmadd_ps(q, k.b, acc[g][1]);
        }
      }
      for (int g = 0; g < NG; ++g) {
        in_order<T>(acc[g][0], acc[g][1]);
        _mm256_storeu_ps(scores + g * span + base + j, acc[g][0]);
        _mm256_storeu_ps(scores + g * span + base + j + 8, acc[g][1]);
      }
    }
    for (; j < hi; j += 8) {
      __m256 acc[NG];
      for (int g = 0; g < NG; ++g) acc[g] = _mm256_setzero_ps();
      for (int64_t d = 0; d < D; ++d) {
        const __m256 k = load8(keys + d * BS + j);
        for (int g = 0; g < NG; ++g) acc[g] = _mm256_fmadd_ps(_mm256_broadcast_ss(qf + g * D + d), k, acc[g]);
      }
      for (int g = 0; g < NG; ++g) _mm256_storeu_ps(scores + g * span + base + j, acc[g]);
    }
  }
  float inv[NG], maxima[NG], sums[NG];
  for (int g = 0; g < NG; ++g) {  // softmax over [from, to), probabilities left unnormalized
    float* sc = scores + g * span;
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t j = from; j < to; ++j) m = std::max(m, sc[j]);
    const __m256 vm = _mm256_set1_ps(m);
    __m256 vsum = _mm256_setzero_ps();
    int64_t j = from;
    for (; j + 8 <= to; j += 8) {
      const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sc + j), vm));
      _mm256_storeu_ps(sc + j, e);
      vsum = _mm256_add_ps(vsum, e);
    }
    float sum = horizontal_sum(vsum);
    for (; j < to; ++j) {
      sc[j] = std::exp(sc[j] - m);
      sum += sc[j];
    }
    inv[g] = 1.f / sum;
    maxima[g] = m;
    sums[g] = sum;
  }
  // Each head's output: its probability-weighted value rows, 16 dims a pass (head % 16 == 0).
  for (int64_t dc = 0; dc < D; dc += 16) {
    __m256 a0[NG], a1[NG];
    for (int g = 0; g < NG; ++g) a0[g] = a1[g] = _mm256_setzero_ps();
    for (int64_t b = first_block; b <= last_block; ++b) {
      const T* values = cache + (static_cast<int64_t>(blocks[b]) * s.kv_heads + h) * 2 * half + half + dc;
      const int64_t base = (b - first_block) * BS;
      const int64_t lo = std::max<int64_t>(from - base, 0), hi = std::min<int64_t>(to - base, BS);
      const float* p = scores + base;
      if constexpr (std::is_same_v<T, c10::BFloat16>) {
        if (s.amx) {
          amx_values16<NG>(values - dc, lo, hi, dc, BS, p, span, a0, a1);
          continue;
        }
      }
      for (int64_t t = lo; t < hi; ++t) {
        const Pair v = load16(values + t * D);
        for (int g = 0; g < NG; ++g) {
          const __m256 pg = _mm256_broadcast_ss(p + g * span + t);
          a0[g] = _mm256_fmadd_ps(pg, v.a, a0[g]);
          a1[g] = _mm256_fmadd_ps(pg, v.b, a1[g]);
        }
      }
    }
    for (int g = 0; g < NG; ++g) {
      if (!s.amx) in_order<T>(a0[g], a1[g]);
      if (partial != nullptr) {
        float* row = partial + g * (kPartialHeader + D);
        row[0] = maxima[g];
        row[1] = sums[g];
        _mm256_storeu_ps(row + kPartialHeader + dc, a0[g]);
        _mm256_storeu_ps(row + kPartialHeader + dc + 8, a1[g]);
        continue;
      }
      const __m256 scale = _mm256_set1_ps(inv[g]);
      alignas(32) float o[16];
      _mm256_store_ps(o, _mm256_mul_ps(a0[g], scale));
      _mm256_store_ps(o + 8, _mm256_mul_ps(a1[g], scale));
      T* dst = out + r * s.out_row + (first_head + g) * D + dc;
      for (int i = 0; i < 16; ++i) dst[i] = static_cast<T>(o[i]);
    }
  }
}

// A work item: request r, kv head h, its query heads [h * group + first, + count), count <= 4, over
// positions [start, L); into `out`, or into `partial` (one row a head) when not null.
template <typename T>
void attend(const Shape& s, int64_t r, int64_t h, int64_t first, int64_t count, int64_t start, int64_t L,
            const T* query, const T* cache, T* out, float* partial, const int32_t* block_table,
            std::vector<float>& buffer) {
  const int64_t head = h * (s.heads / s.kv_heads) + first;
  switch (count) {
    case 1: attend_heads<1>(s, r, h, head, start, L, query, cache, out, partial, block_table, buffer); break;
    case 2: attend_heads<2>(s, r, h, head, start, L, query, cache, out, partial, block_table, buffer); break;
    case 3: attend_heads<3>(s, r, h, head, start, L, query, cache, out, partial, block_table, buffer); break;
    default: attend_heads<4>(s, r, h, head, start, L, query, cache, out, partial, block_table, buffer); break;
  }
}

// A head's output from its parts over consecutive position ranges (rows `stride` floats apart):
// each part's value sum and exp-sum rescaled to the largest maximum, summed, and divided (a part
// over no position has l = 0).
template <typename T>
void merge_parts(const float* parts, int64_t count, int64_t stride, int64_t D, T* out) {
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t p = 0; p < count; ++p)
    if (parts[p * stride + 1] > 0.f) m = std::max(m, parts[p * stride]);
  float weights[kMaxParts], total = 0.f;
  for (int64_t p = 0; p < count; ++p) {
    weights[p] = parts[p * stride + 1] > 0.f ? std::exp(parts[p * stride] - m) : 0.f;
    total += weights[p] * parts[p * stride + 1];
  }
  const float inv = 1.f / total;
  for (int64_t d = 0; d < D; ++d) {
    float acc = 0.f;
    for (int64_t p = 0; p < count; ++p) acc += weights[p] * parts[p * stride + kPartialHeader + d];
    out[d] = static_cast<T>(acc * inv);
  }
}

constexpr int64_t kMaxHeadsAPass = 4;

// Work below this many multiply-adds runs on the calling thread: a parallel region costs more.
constexpr int64_t kSerialMacs = 1 << 17;

void decode_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                      at::Tensor& kv_cache, at::Tensor& output, const at::Tensor& slot_mapping,
                      const at::Tensor& block_table, const at::Tensor& seq_lens, double scale,
                      int64_t sliding_window, bool write_kv, bool amx_layout) {
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1, "decode_attention: query must be [tokens, heads, head] with unit stride in head");
  TORCH_CHECK(kv_cache.dim() == 4 && kv_cache.is_contiguous(), "decode_attention: kv_cache must be a contiguous [blocks, kv_heads, block_size, 2 * head]");
  const int64_t requests = seq_lens.size(0);
  const int64_t heads = query.size(1), D = query.size(2);
  const int64_t kv_heads = kv_cache.size(1), BS = kv_cache.size(2);
  TORCH_CHECK(kv_cache.size(3) == 2 * D, "decode_attention: kv_cache's last dim must be 2 * head");
  TORCH_CHECK(D % 16 == 0 && BS % 8 == 0, "decode_attention: head size must be a multiple of 16, block size of 8");
  TORCH_CHECK(heads % kv_heads == 0, "decode_attention: query heads must be a multiple of kv heads");
  TORCH_CHECK(!amx_layout || (kv_cache.scalar_type() == at::kBFloat16 && BS % 16 == 0 && D % 32 == 0),
              "decode_attention: the amx layout holds bfloat16 heads of a multiple of 32 dims in blocks of a "
              "multiple of 16 positions, got ", kv_cache.scalar_type(), " heads of ", D, " in blocks of ", BS);
  TORCH_CHECK(query.size(0) >= requests && output.numel() >= requests * heads * D && output.is_contiguous(),
              "decode_attention: one query token and one contiguous output row per request");
  TORCH_CHECK(query.scalar_type() == kv_cache.scalar_type() && output.scalar_type() == kv_cache.scalar_type(),
              "decode_attention: query, output and kv_cache must share a dtype");
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && block_table.scalar_type() == at::kInt && block_table.is_contiguous(),
              "decode_attention: seq_lens and block_table must be int32 (block_table contiguous)");
  if (write_kv) {
    TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.size(0) >= requests,
                "decode_attention: slot_mapping must be int64 with a slot per request");
    TORCH_CHECK(key.dim() == 3 && value.dim() == 3 && key.stride(2) == 1 && value.stride(2) == 1 &&
                    key.size(1) == kv_heads && value.size(1) == kv_heads && key.size(0) >= requests &&
                    value.size(0) >= requests && key.scalar_type() == kv_cache.scalar_type() &&
                    value.scalar_type() == kv_cache.scalar_type(),
                "decode_attention: key and value must be [tokens, kv_heads, head] in the cache's dtype");
  }
  Shape s{heads, kv_heads, D, BS, block_table.size(1),
          query.stride(0), query.stride(1),
          write_kv ? key.stride(0) : 0, write_kv ? key.stride(1) : 0,
          write_kv ? value.stride(0) : 0, write_kv ? value.stride(1) : 0,
          heads * D, static_cast<float>(scale), sliding_window, write_kv, amx_layout};
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int64_t positions = block_table.size(1) * BS;
  int64_t macs = 0;
  for (int64_t r = 0; r < requests; ++r) {
    TORCH_CHECK(lens[r] >= 1 && lens[r] <= positions, "decode_attention: request ", r, " has sequence length ",
                lens[r], "; its block table holds 1 to ", positions, " positions");
    macs += 2 * static_cast<int64_t>(lens[r]) * heads * D;
  }
  if (write_kv) {
    const int64_t* slots = slot_mapping.data_ptr<int64_t>();
    const int64_t cache_slots = kv_cache.size(0) * BS;
    for (int64_t r = 0; r < requests; ++r)
      TORCH_CHECK(slots[r] < cache_slots, "decode_attention: request ", r, "'s slot ", slots[r],
                  " is past the cache's ", cache_slots, " slots");
  }
  auto dispatch = [&](auto tag) {
    using scalar_t = decltype(tag);
    const auto* q = query.data_ptr<scalar_t>();
    const auto* k = write_kv ? key.data_ptr<scalar_t>() : nullptr;
    const auto* v = write_kv ? value.data_ptr<scalar_t>() : nullptr;
    auto* cache = kv_cache.data_ptr<scalar_t>();
    auto* out = output.data_ptr<scalar_t>();
    const int64_t* slots = write_kv ? slot_mapping.data_ptr<int64_t>() : nullptr;
    const int32_t* table = block_table.data_ptr<int32_t>();
    if (write_kv)
      for (int64_t r = 0; r < requests; ++r)
        for (int64_t h = 0; h < kv_heads; ++h) write_kv_slot<scalar_t>(s, r, h, k, v, cache, slots);
    // Items: (request, kv head, pass of up to four query heads, part of the positions), the
    // group's heads split evenly over the passes.
    const int64_t group = heads / kv_heads;
    const int64_t passes = (group + kMaxHeadsAPass - 1) / kMaxHeadsAPass;
    const bool parallel = macs >= kSerialMacs;
    // Fewer items than two a thread leaves a thread idle for a whole item: then each (request, kv
    // head, pass) attends over parts of its positions, merged afterwards. Splitting the positions
    // rather than the group keeps every key and value read once for the whole group.
    int64_t parts = 1;
    if (parallel && requests * kv_heads * passes < 2 * at::get_num_threads()) {
      const int64_t wanted = 2 * at::get_num_threads();
      parts = std::min(kMaxParts, (wanted + requests * kv_heads * passes - 1) / (requests * kv_heads * passes));
    }
    const int64_t items = requests * kv_heads * passes * parts;
    std::vector<float> partial(parts > 1 ? static_cast<size_t>(requests * heads * parts * (kPartialHeader + D)) : 0);
    auto run = [&](int64_t begin, int64_t end) {
      std::vector<float> buffer;
      for (int64_t i = begin; i < end; ++i) {
        const int64_t part = i % parts, pass = (i / parts) % passes, rh = i / parts / passes;
        const int64_t r = rh / kv_heads, h = rh % kv_heads;
        const int64_t first = pass * group / passes, last = (pass + 1) * group / passes;
        const int64_t L = lens[r];
        int64_t start = sliding_window > 0 ? std::max<int64_t>(0, L - sliding_window) : 0;
        int64_t stop = L;
        float* rows = nullptr;
        if (parts > 1) {
          // Ranges of whole 8-position chunks; a request shorter than its parts leaves the last empty.
          const int64_t chunk = ((L - start + parts - 1) / parts + 7) / 8 * 8;
          stop = std::min(L, start + (part + 1) * chunk);
          start = std::min(L, start + part * chunk);
          // Part p's rows of request r: [heads][kPartialHeader + D], one part after another.
          rows = partial.data() + ((r * parts + part) * heads + h * group + first) * (kPartialHeader + D);
          if (start >= stop) {
            for (int64_t g = first; g < last; ++g) rows[(g - first) * (kPartialHeader + D) + 1] = 0.f;
            continue;
          }
        }
        attend<scalar_t>(s, r, h, first, last - first, start, stop, q, cache, out, rows, table, buffer);
      }
    };
    if (!parallel) {
      run(0, items);
    } else {
      at::parallel_for(0, items, 1, run);
    }
    if (parts > 1)
      for (int64_t r = 0; r < requests; ++r)
        for (int64_t head = 0; head < heads; ++head)
          merge_parts<scalar_t>(partial.data() + (r * parts * heads + head) * (kPartialHeader + D), parts,
                                heads * (kPartialHeader + D), D, out + r * s.out_row + head * D);
  };
  switch (kv_cache.scalar_type()) {
    case at::kFloat: dispatch(float{}); break;
    case at::kBFloat16: dispatch(c10::BFloat16{}); break;
    case at::kHalf: dispatch(c10::Half{}); break;
    default: TORCH_CHECK(false, "decode_attention: kv_cache dtype ", kv_cache.scalar_type(), " is not float32, bfloat16 or float16");
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(edge_cpu, m) {
  m.def("decode_attention(Tensor query, Tensor key, Tensor value, Tensor(a!) kv_cache, Tensor(b!) output, "
        "Tensor slot_mapping, Tensor block_table, Tensor seq_lens, float scale, int sliding_window, "
        "bool write_kv, bool amx_layout=False) -> ()");
}

TORCH_LIBRARY_IMPL(edge_cpu, CPU, m) { m.impl("decode_attention", &decode_attention); }
