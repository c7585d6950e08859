// A llama-family decoder stack run for a batch of one-token queries in one call.
//
// vLLM's compiled forward of a small model on CPU spends much of a decode step between its
// kernels: a Python call per linear, a Python custom op per attention layer, the graph's own
// fused kernels for the norms, rotary embedding and residuals, each with its own dispatch. For a
// batch where every query is one token, DecoderStack::forward runs the same layers from C++:
// per layer RMSNorm (with the residual add), the QKV linear (plus bias), the rotary embedding,
// our decode attention op (KV write and attention), the output linear, the second RMSNorm, the
// gate/up linear, SiLU-and-multiply and the down linear; then the model's final norm. The linears
// are the AVX2 rows8 ops, or the AVX-512 VNNI rows16 ops (the MLP as their one fused op).
//
// Numerics follow vLLM's native ops on the activation dtype T: RMSNorm in float32 over the
// float32 sum of the input and the residual (the residual kept rounded to T), the normalized
// row rounded to T before the weight multiplies it; the rotary embedding and SiLU-and-multiply
// computed in float32 from T inputs and rounded once, as the compiled graph fuses them. The
// linears and the attention are the same ops the compiled graph calls, reached through the
// dispatcher.
//
// The stack holds the layers' tensors (references to the model's own parameters and KV caches):
// made once per model, not per step.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <immintrin.h>

#include "avx2_math.h"
#include "convert8.h"

#include <cmath>
#include <optional>
#include <type_traits>
#include <vector>

namespace {

using edge_cpu_math::exp8;
using edge_cpu_math::horizontal_sum;
using edge_cpu_convert::load8;
using edge_cpu_convert::store8;

// A layer's tensors, in this order, in DecoderStack::weights. Each linear is five: its codes,
// scales and offsets, then the rows16 kernel's superblock factors and 6-bit top bits (empty
// tensors where the linear has none, and always for rows8).
enum Slot : int64_t {
  kInputNorm, kQkv, kQkvBias = kQkv + 5, kOut, kPostNorm = kOut + 5, kGateUp, kDown = kGateUp + 5,
  kSlots = kDown + 5
};
enum LinearPart : int64_t { kCodes, kScales, kOffsets, kFactors, kHighBits };

// The linear kernel whose ops the stack calls: the AVX2 8-row layout, or the AVX-512 VNNI 16-row
// layout (whose MLP is one fused op, as the compiled graph calls it).
enum class Kernel : int64_t { kRows8 = 8, kRows16 = 16 };

using Rows8Fn = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t);
using Rows16Fn = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t,
                            const std::optional<at::Tensor>&, const std::optional<at::Tensor>&);
using Rows16MlpFn = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t,
                               const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t,
                               const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
                               const std::optional<at::Tensor>&, const std::optional<at::Tensor>&);
using AttentionFn = void(const at::Tensor&, const at::Tensor&, const at::Tensor&, at::Tensor&, at::Tensor&,
                         const at::Tensor&, const at::Tensor&, const at::Tensor&, double, int64_t, bool, bool);

// An empty tensor stands for an absent optional argument.
inline std::optional<at::Tensor> optional(const at::Tensor& t) {
  return t.defined() && t.numel() > 0 ? std::optional<at::Tensor>(t) : std::nullopt;
}

template <typename T>
inline float round_to(float v) {
  return static_cast<float>(static_cast<T>(v));
}

// out[i] = silu(gate[i]) * up[i] for the I gates followed by the I ups of one row, in float32 and
// rounded once to T; eight lanes at a time (exp8), the tail (and float64) in scalar.
template <typename T>
void silu_mul(const T* gate_up, int64_t I, T* out) {
  const T* up = gate_up + I;
  const __m256 one = _mm256_set1_ps(1.f);
  int64_t i = 0;
  if constexpr (!std::is_same_v<T, double>) {
    for (; i + 8 <= I; i += 8) {
      const __m256 g = load8(gate_up + i);
      const __m256 silu = _mm256_div_ps(g, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), g))));
      store8(out + i, _mm256_mul_ps(silu, load8(up + i)));
    }
  }
  for (; i < I; ++i) {
    const float g = static_cast<float>(gate_up[i]);
    out[i] = static_cast<T>(g / (1.f + std::exp(-g)) * static_cast<float>(up[i]));
  }
}

// out[r] = norm(x[r] (+ residual[r])) * weight; residual[r] = x[r] + residual[r] rounded to T when
// `add`, else x[r] itself (the first layer). Rows of H elements. Eight lanes at a time where T is
// not float64 (the sum of squares then adds in lane order, as a vectorized reduction does); the
// roundings are the scalar tail's.
template <typename T>
void add_rms_norm(const T* x, T* residual, bool add, const T* weight, double eps, T* out, int64_t rows, int64_t H,
                  std::vector<float>& row) {
  row.resize(H);
  float* v = row.data();
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * H;
    T* res = residual + r * H;
    T* o = out + r * H;
    int64_t i = 0;
    float sq = 0.f;
    if constexpr (!std::is_same_v<T, double>) {
      __m256 acc = _mm256_setzero_ps();
      for (; i + 8 <= H; i += 8) {
        const __m256 sum = add ? _mm256_add_ps(load8(xr + i), load8(res + i)) : load8(xr + i);
        _mm256_storeu_ps(v + i, sum);
        acc = _mm256_fmadd_ps(sum, sum, acc);
        store8(res + i, sum);
      }
      sq = horizontal_sum(acc);
    }
    for (int64_t j = i; j < H; ++j) {
      v[j] = add ? static_cast<float>(xr[j]) + static_cast<float>(res[j]) : static_cast<float>(xr[j]);
      sq += v[j] * v[j];
      res[j] = static_cast<T>(v[j]);
    }
    const float inv = 1.f / std::sqrt(sq / static_cast<float>(H) + static_cast<float>(eps));
    int64_t j = 0;
    if constexpr (!std::is_same_v<T, double>) {
      const __m256 scale = _mm256_set1_ps(inv);
      alignas(32) T normed[8];
      for (; j + 8 <= H; j += 8) {
        store8(normed, _mm256_mul_ps(_mm256_loadu_ps(v + j), scale));  // rounded to T, then times the weight
        store8(o + j, _mm256_mul_ps(load8(normed), load8(weight + j)));
      }
    }
    for (; j < H; ++j) o[j] = static_cast<T>(round_to<T>(v[j] * inv) * static_cast<float>(weight[j]));
  }
}

// Rotary embedding in place on `heads` heads of `D` dims starting at row pointer p (the table's
// row for the token's position: D / 2 cosines then D / 2 sines, in T as vLLM keeps them).
template <typename T>
void rotate(T* p, int64_t heads, int64_t D, const T* cos_sin, bool neox) {
  const int64_t half = D / 2;
  float cos[512], sin[512];
  for (int64_t i = 0; i < half; ++i) {
    cos[i] = static_cast<float>(cos_sin[i]);
    sin[i] = static_cast<float>(cos_sin[half + i]);
  }
  for (int64_t h = 0; h < heads; ++h) {
    T* x = p + h * D;
    for (int64_t i = 0; i < half; ++i) {
      T* a = neox ? x + i : x + 2 * i;
      T* b = neox ? x + half + i : x + 2 * i + 1;
      const float x1 = static_cast<float>(*a), x2 = static_cast<float>(*b);
      *a = static_cast<T>(x1 * cos[i] - x2 * sin[i]);
      *b = static_cast<T>(x2 * cos[i] + x1 * sin[i]);
    }
  }
}

struct DecoderStack : torch::CustomClassHolder {
  std::vector<at::Tensor> weights;  // kSlots per layer
  std::vector<at::Tensor> kv_caches;
  std::vector<int64_t> windows;
  at::Tensor final_norm;
  at::Tensor cos_sin;  // [positions, head], the activations' dtype
  int64_t heads, kv_heads, head, group_size;
  double eps, scale;
  bool neox;
  Kernel kernel;
  bool amx_layout;  // the KV caches in vLLM's "amx" layout (decode_attention.cpp)

  DecoderStack(std::vector<at::Tensor> weights_, std::vector<at::Tensor> kv_caches_, std::vector<int64_t> windows_,
               at::Tensor final_norm_, at::Tensor cos_sin_, int64_t heads_, int64_t kv_heads_, int64_t head_,
               int64_t group_size_, double eps_, double scale_, bool neox_, int64_t kernel_rows, bool amx_layout_)
      : weights(std::move(weights_)), kv_caches(std::move(kv_caches_)), windows(std::move(windows_)),
        final_norm(std::move(final_norm_)), cos_sin(std::move(cos_sin_)), heads(heads_), kv_heads(kv_heads_),
        head(head_), group_size(group_size_), eps(eps_), scale(scale_), neox(neox_),
        kernel(static_cast<Kernel>(kernel_rows)), amx_layout(amx_layout_) {
    TORCH_CHECK(kernel == Kernel::kRows8 || kernel == Kernel::kRows16,
                "DecoderStack: the linear kernel is named by its tile rows, 8 or 16, got ", kernel_rows);
    const int64_t layers = static_cast<int64_t>(kv_caches.size());
    TORCH_CHECK(layers > 0 && static_cast<int64_t>(weights.size()) == layers * kSlots,
                "DecoderStack: ", kSlots, " tensors a layer and one KV cache a layer, got ", weights.size(),
                " tensors for ", layers, " caches");
    TORCH_CHECK(static_cast<int64_t>(windows.size()) == layers, "DecoderStack: one sliding window a layer");
    TORCH_CHECK(heads > 0 && kv_heads > 0 && heads % kv_heads == 0 && head > 0 && head % 2 == 0 && head <= 1024,
                "DecoderStack: heads ", heads, ", kv heads ", kv_heads, ", head size ", head, " do not fit");
    TORCH_CHECK(cos_sin.scalar_type() == final_norm.scalar_type() && cos_sin.dim() == 2 && cos_sin.size(1) == head &&
                    cos_sin.is_contiguous(),
                "DecoderStack: the rotary table must be contiguous [positions, head size] in the weights' dtype");
    const int64_t H = final_norm.numel();
    for (int64_t l = 0; l < layers; ++l) {
      const at::Tensor* w = weights.data() + l * kSlots;
      TORCH_CHECK(w[kInputNorm].numel() == H && w[kPostNorm].numel() == H && w[kInputNorm].is_contiguous() &&
                      w[kPostNorm].is_contiguous(),
                  "DecoderStack: layer ", l, "'s norm weights must be contiguous with ", H, " elements");
      TORCH_CHECK(w[kQkv].size(0) == (heads + 2 * kv_heads) * head, "DecoderStack: layer ", l,
                  "'s QKV linear has ", w[kQkv].size(0), " outputs, not (heads + 2 kv heads) x head size");
      TORCH_CHECK(!w[kQkvBias].defined() || w[kQkvBias].numel() == 0 || w[kQkvBias].numel() == w[kQkv].size(0),
                  "DecoderStack: layer ", l, "'s QKV bias does not match its outputs");
      TORCH_CHECK(w[kGateUp].size(0) % 2 == 0 && w[kDown].size(1) * 2 == w[kGateUp].size(0) / 2,
                  "DecoderStack: layer ", l, "'s gate/up and down linears do not match");
      if (kernel == Kernel::kRows8)
        for (const int64_t linear : {kQkv, kOut, kGateUp, kDown})
          TORCH_CHECK(!optional(w[linear + kFactors]) && !optional(w[linear + kHighBits]), "DecoderStack: layer ", l,
                      ": the rows8 kernel takes no group factors or 6-bit top bits");
    }
  }

  int64_t num_layers() const { return static_cast<int64_t>(kv_caches.size()); }

  // A linear (p: its five tensors) on the stack's kernel.
  at::Tensor linear(const at::Tensor& x, const at::Tensor* p) const {
    if (kernel == Kernel::kRows16) {
      static const auto mm = c10::Dispatcher::singleton()
                                 .findSchemaOrThrow("edge_cpu_int4::w4a8_vnni_rows16_mm", "")
                                 .typed<Rows16Fn>();
      return mm.call(x, p[kCodes], p[kScales], p[kOffsets], group_size, optional(p[kFactors]),
                     optional(p[kHighBits]));
    }
    static const auto mm = c10::Dispatcher::singleton()
                               .findSchemaOrThrow("edge_cpu_int4::w4a8_avx2_rows8_mm", "")
                               .typed<Rows8Fn>();
    return mm.call(x, p[kCodes], p[kScales], p[kOffsets], group_size);
  }

  // down(silu(gate) * up) on rows16: the one op the compiled graph calls for the MLP.
  at::Tensor rows16_mlp(const at::Tensor& x, const at::Tensor* gate_up, const at::Tensor* down) const {
    static const auto mlp = c10::Dispatcher::singleton()
                                .findSchemaOrThrow("edge_cpu_int4::w4a8_vnni_rows16_silu_mlp", "")
                                .typed<Rows16MlpFn>();
    return mlp.call(x, gate_up[kCodes], gate_up[kScales], gate_up[kOffsets], group_size, down[kCodes],
                    down[kScales], down[kOffsets], group_size, optional(gate_up[kFactors]),
                    optional(down[kFactors]), optional(gate_up[kHighBits]), optional(down[kHighBits]));
  }

  // The same on rows8: gate/up, SiLU-and-multiply here, down.
  template <typename T>
  at::Tensor rows8_mlp(const at::Tensor& x, const at::Tensor* w) const {
    const at::Tensor gate_up = linear(x, w + kGateUp);
    const int64_t M = x.size(0), I = gate_up.size(1) / 2;
    at::Tensor act = at::empty({M, I}, x.options());
    const T* g = gate_up.data_ptr<T>();
    T* a = act.data_ptr<T>();
    for (int64_t r = 0; r < M; ++r) silu_mul<T>(g + r * 2 * I, I, a + r * I);
    return linear(act, w + kDown);
  }

  // x: [tokens, hidden] (the embedded tokens); returns the final norm's output. One token a
  // request: row r of x is request r's query.
  at::Tensor forward(const at::Tensor& x, const at::Tensor& positions, const at::Tensor& slot_mapping,
                     const at::Tensor& block_table, const at::Tensor& seq_lens) {
    static const auto attention =
        c10::Dispatcher::singleton().findSchemaOrThrow("edge_cpu::decode_attention", "").typed<AttentionFn>();
    const int64_t H = final_norm.numel();
    TORCH_CHECK(x.dim() == 2 && x.size(1) == H && x.is_contiguous(), "DecoderStack: x must be contiguous [tokens, ",
                H, "], got ", x.sizes());
    TORCH_CHECK(x.scalar_type() == final_norm.scalar_type(), "DecoderStack: x is ", x.scalar_type(),
                ", the model's weights ", final_norm.scalar_type());
    const int64_t M = x.size(0);
    TORCH_CHECK(seq_lens.size(0) == M && positions.numel() == M && positions.scalar_type() == at::kLong,
                "DecoderStack: one int64 position and one sequence length a token");
    const int64_t* pos = positions.data_ptr<int64_t>();
    const int64_t table_rows = cos_sin.size(0);
    for (int64_t r = 0; r < M; ++r)
      TORCH_CHECK(pos[r] >= 0 && pos[r] < table_rows, "DecoderStack: position ", pos[r],
                  " is outside the rotary table's ", table_rows, " positions");
    const int64_t q_size = heads * head, kv_size = kv_heads * head;
    at::Tensor hidden = at::empty_like(x);
    at::Tensor residual = x.clone();
    at::Tensor attn_out = at::empty({M, q_size}, x.options());
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "DecoderStack", [&] {
      using T = scalar_t;
      std::vector<float> row;
      at::Tensor h = x;  // the first layer normalizes x; later ones the previous layer's output
      for (int64_t l = 0; l < num_layers(); ++l) {
        const at::Tensor* w = weights.data() + l * kSlots;
        add_rms_norm<T>(h.data_ptr<T>(), residual.data_ptr<T>(), l > 0, w[kInputNorm].data_ptr<T>(), eps,
                        hidden.data_ptr<T>(), M, H, row);
        at::Tensor qkv = linear(hidden, w + kQkv);
        T* qp = qkv.data_ptr<T>();
        const int64_t width = qkv.size(1);
        const bool bias = w[kQkvBias].defined() && w[kQkvBias].numel() > 0;
        const T* bp = bias ? w[kQkvBias].data_ptr<T>() : nullptr;
        const T* table = cos_sin.data_ptr<T>();
        for (int64_t r = 0; r < M; ++r) {
          T* q = qp + r * width;
          if (bias)
            for (int64_t i = 0; i < width; ++i) q[i] = static_cast<T>(static_cast<float>(q[i]) + static_cast<float>(bp[i]));
          rotate<T>(q, heads + kv_heads, head, table + pos[r] * head, neox);
        }
        attention.call(qkv.narrow(1, 0, q_size).view({M, heads, head}),
                       qkv.narrow(1, q_size, kv_size).view({M, kv_heads, head}),
                       qkv.narrow(1, q_size + kv_size, kv_size).view({M, kv_heads, head}), kv_caches[l], attn_out,
                       slot_mapping, block_table, seq_lens, scale, windows[l], true, amx_layout);
        at::Tensor o = linear(attn_out, w + kOut);
        add_rms_norm<T>(o.data_ptr<T>(), residual.data_ptr<T>(), true, w[kPostNorm].data_ptr<T>(), eps,
                        hidden.data_ptr<T>(), M, H, row);
        h = kernel == Kernel::kRows16 ? rows16_mlp(hidden, w + kGateUp, w + kDown) : rows8_mlp<T>(hidden, w);
      }
      add_rms_norm<T>(h.data_ptr<T>(), residual.data_ptr<T>(), true, final_norm.data_ptr<T>(), eps,
                      hidden.data_ptr<T>(), M, H, row);
    });
    return hidden;
  }
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(edge_cpu, m) {
  m.class_<DecoderStack>("DecoderStack")
      .def(torch::init<std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<int64_t>, at::Tensor,
                       at::Tensor, int64_t, int64_t, int64_t, int64_t, double, double, bool, int64_t, bool>())
      .def("forward", &DecoderStack::forward);
}
