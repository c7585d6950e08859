// Rows of an int8 embedding table (one scale a row) for a batch of token ids.
//
// cpu_int4's "int8" input embedding stores codes int8 [V, H] and one scale a row [V, 1]; its
// lookup in Python (embedding.lookup_int8) is two index_selects, two widenings, a multiply and a
// rounding to the activation dtype: six tensor ops for a decode step's few tokens. This op writes
// the same values (float(code) * float(scale), rounded once to the dtype) in one call.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstdint>
#include <vector>

namespace {

at::Tensor embedding_int8_rows(const at::Tensor& ids, const at::Tensor& codes, const at::Tensor& scales,
                               at::ScalarType dtype) {
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kChar && codes.is_contiguous(),
              "embedding_int8_rows: codes must be a contiguous int8 [vocab, hidden], got ", codes.scalar_type(), " ",
              codes.sizes());
  const int64_t V = codes.size(0), H = codes.size(1);
  TORCH_CHECK(scales.numel() == V && scales.is_contiguous(), "embedding_int8_rows: one scale a row (", V,
              "), got ", scales.sizes());
  TORCH_CHECK(ids.scalar_type() == at::kLong || ids.scalar_type() == at::kInt,
              "embedding_int8_rows: ids must be int64 or int32, got ", ids.scalar_type());
  const at::Tensor flat = ids.reshape({-1}).to(at::kLong).contiguous();
  const int64_t T = flat.numel();
  const int64_t* idp = flat.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(idp[t] >= 0 && idp[t] < V, "embedding_int8_rows: token id ", idp[t], " is outside the vocabulary of ",
                V);
  std::vector<int64_t> shape(ids.sizes().begin(), ids.sizes().end());
  shape.push_back(H);
  at::Tensor out = at::empty(shape, codes.options().dtype(dtype));
  const int8_t* cp = codes.data_ptr<int8_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, scales.scalar_type(), "embedding_int8_rows scales", [&] {
    const scalar_t* sp = scales.data_ptr<scalar_t>();
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "embedding_int8_rows", [&] {
      scalar_t* op = out.data_ptr<scalar_t>();
      for (int64_t t = 0; t < T; ++t) {
        const int8_t* row = cp + idp[t] * H;
        const float s = static_cast<float>(sp[idp[t]]);
        for (int64_t i = 0; i < H; ++i) op[t * H + i] = static_cast<scalar_t>(static_cast<float>(row[i]) * s);
      }
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(edge_cpu, m) {
  m.def("embedding_int8_rows(Tensor ids, Tensor codes, Tensor scales, ScalarType dtype) -> Tensor");
}

TORCH_LIBRARY_IMPL(edge_cpu, CPU, m) { m.impl("embedding_int8_rows", &embedding_int8_rows); }
