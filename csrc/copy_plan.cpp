// Turning op calls into copy plans: argument checks, dim coalescing, vector widths. See copy_plan.h.
#include "copy_plan.h"

#include <algorithm>
#include <utility>

#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>
#include <c10/util/SmallVector.h>

namespace megatron_hybrid {
namespace {

using Dims = c10::SmallVector<int64_t, 8>;

constexpr int64_t kMaxVectorBytes = 16;

bool castable(at::ScalarType t) {
  return t == at::kFloat || t == at::kDouble || t == at::kHalf || t == at::kBFloat16;
}

uint64_t address(const at::Tensor& t) { return reinterpret_cast<uint64_t>(t.data_ptr()); }

// Drop size-1 dims and merge neighbours that are contiguous with each other; the row-major element order (the
// order in which the flat side is laid out) is unchanged. A tensor with one element becomes sizes [1], strides [1].
void coalesce(at::IntArrayRef in_sizes, at::IntArrayRef in_strides, Dims& sizes, Dims& strides) {
  sizes.clear();
  strides.clear();
  for (size_t d = 0; d < in_sizes.size(); ++d) {
    if (in_sizes[d] == 1) continue;
    if (!sizes.empty() && strides.back() == in_strides[d] * in_sizes[d]) {
      sizes.back() *= in_sizes[d];
      strides.back() = in_strides[d];
    } else {
      sizes.push_back(in_sizes[d]);
      strides.push_back(in_strides[d]);
    }
  }
  if (sizes.empty()) {
    sizes.push_back(1);
    strides.push_back(1);
  }
}

CopyChunk contiguous_chunk(uint64_t flat, uint64_t strided, int64_t units, int32_t width) {
  CopyChunk c{};
  c.units = units;
  c.flat = flat;
  c.strided = strided;
  c.ndim = 1;
  c.sizes[0] = units;
  c.strides[0] = 1;
  c.width = width;
  return c;
}

// Append a strided chunk (ndim > 1), split along dim 0 into pieces of fewer than 2^32 units (see strided_offset).
// Returns false when even one dim-0 slice is too large; the caller then takes the slow path.
bool push_strided(std::vector<CopyChunk>& out, const CopyChunk& c, int64_t flat_unit_bytes, int64_t strided_unit_bytes) {
  constexpr int64_t kMaxUnits = UINT32_MAX;
  if (c.ndim == 1 || c.units <= kMaxUnits) {
    out.push_back(c);
    return true;
  }
  const int64_t inner = c.units / c.sizes[0];
  if (inner > kMaxUnits) return false;
  const int64_t step = kMaxUnits / inner;
  for (int64_t r = 0; r < c.sizes[0]; r += step) {
    CopyChunk piece = c;
    piece.sizes[0] = std::min(step, c.sizes[0] - r);
    piece.units = piece.sizes[0] * inner;
    piece.flat = c.flat + static_cast<uint64_t>(r * inner * flat_unit_bytes);
    piece.strided = c.strided + static_cast<uint64_t>(r * c.strides[0] * strided_unit_bytes);
    out.push_back(piece);
  }
  return true;
}

// Split a contiguous run of `numel` elements into head | body | tail so that the body moves `n` elements per unit
// with both sides aligned to the unit: n is the largest power of two <= max_n for which some head length h < n
// aligns both sides at once (when the two sides are misaligned differently, a smaller n may still work).
// emit(first_element, num_elements, elements_per_unit).
template <typename Emit>
void split_contiguous(uint64_t flat, int64_t flat_esize, uint64_t strided, int64_t strided_esize, int64_t numel,
                      int64_t max_n, Emit emit) {
  for (int64_t n = max_n; n > 1; n /= 2) {
    for (int64_t h = 0; h < n && h + n <= numel; ++h) {
      if ((flat + h * flat_esize) % (n * flat_esize) != 0) continue;
      if ((strided + h * strided_esize) % (n * strided_esize) != 0) continue;
      const int64_t body = (numel - h) / n * n;
      if (h > 0) emit(0, h, 1);
      emit(h, body, n);
      if (h + body < numel) emit(h + body, numel - h - body, 1);
      return;
    }
  }
  emit(0, numel, 1);
}

// Add the copy of one strided view (numel elements) to / from `flat`. `slow` does the same copy with ATen ops and
// is used only when the tables cannot express it.
void add_job(CopyPlan& plan, uint64_t flat, at::ScalarType flat_dtype, uint64_t strided, at::ScalarType strided_dtype,
             at::IntArrayRef view_sizes, at::IntArrayRef view_strides, std::function<void()> slow) {
  const int64_t numel = c10::multiply_integers(view_sizes);
  if (numel == 0) return;
  Dims sizes, strides;
  coalesce(view_sizes, view_strides, sizes, strides);
  const auto ndim = static_cast<int64_t>(sizes.size());
  if (ndim > kMaxDims) {
    plan.slow.push_back(std::move(slow));
    return;
  }
  const bool contiguous = ndim == 1 && strides[0] == 1;
  const int64_t fe = c10::elementSize(flat_dtype);
  const int64_t se = c10::elementSize(strided_dtype);

  if (flat_dtype == strided_dtype) {
    if (contiguous) {
      split_contiguous(flat, fe, strided, se, numel, std::max<int64_t>(1, kMaxVectorBytes / fe),
                       [&](int64_t first, int64_t count, int64_t n) {
                         plan.copies.push_back(contiguous_chunk(flat + first * fe, strided + first * se, count / n,
                                                                static_cast<int32_t>(n * fe)));
                       });
      return;
    }
    // Strided: vectorise along the innermost dim when it is unit-stride and every boundary stays aligned (the
    // typical case is a [rows, cols] block of a wider row-major matrix).
    int64_t n = std::max<int64_t>(1, kMaxVectorBytes / fe);
    for (; n > 1; n /= 2) {
      if (strides.back() != 1 || sizes.back() % n != 0) continue;
      if (flat % (n * fe) != 0 || strided % (n * fe) != 0) continue;
      bool ok = true;
      for (int64_t d = 0; d + 1 < ndim; ++d) ok = ok && strides[d] % n == 0;
      if (ok) break;
    }
    CopyChunk c{};
    c.units = numel / n;
    c.flat = flat;
    c.strided = strided;
    c.ndim = static_cast<int32_t>(ndim);
    c.width = static_cast<int32_t>(n * fe);
    for (int64_t d = 0; d < ndim; ++d) {
      const bool inner = d == ndim - 1 && n > 1;
      c.sizes[d] = inner ? sizes[d] / n : sizes[d];
      c.strides[d] = inner ? 1 : strides[d] / n;
    }
    if (!push_strided(plan.copies, c, n * fe, n * fe)) plan.slow.push_back(std::move(slow));
    return;
  }

  if (!castable(flat_dtype) || !castable(strided_dtype)) {
    plan.slow.push_back(std::move(slow));
    return;
  }
  const auto key = plan.to_flat ? std::make_pair(strided_dtype, flat_dtype) : std::make_pair(flat_dtype, strided_dtype);
  auto& chunks = plan.casts[key];
  if (contiguous) {
    split_contiguous(flat, fe, strided, se, numel, kMaxVectorBytes / std::max(fe, se),
                     [&](int64_t first, int64_t count, int64_t n) {
                       chunks.push_back(contiguous_chunk(flat + first * fe, strided + first * se, count / n,
                                                         static_cast<int32_t>(n)));
                     });
    return;
  }
  CopyChunk c{};
  c.units = numel;
  c.flat = flat;
  c.strided = strided;
  c.ndim = static_cast<int32_t>(ndim);
  c.width = 1;
  for (int64_t d = 0; d < ndim; ++d) {
    c.sizes[d] = sizes[d];
    c.strides[d] = strides[d];
  }
  if (!push_strided(chunks, c, fe, se)) plan.slow.push_back(std::move(slow));
}

void check_flat(const char* op, const char* name, const at::Tensor& flat) {
  TORCH_CHECK(flat.dim() == 1 && flat.is_contiguous(), "megatron_hybrid::", op, ": ", name,
              " must be a 1-D contiguous tensor, got sizes ", flat.sizes(), " and strides ", flat.strides());
}

void check_same_device(const char* op, const char* what, int64_t i, const at::Tensor& t, const at::Tensor& flat) {
  TORCH_CHECK(t.device() == flat.device(), "megatron_hybrid::", op, ": ", what, "[", i, "] is on ", t.device(),
              " but the flat buffer is on ", flat.device(), "; all tensors must be on one device");
}

// Copies between the flat buffer and whole tensors at element offsets (pack / unpack).
CopyPlan plan_offsets(const char* op, bool to_flat, const at::Tensor& flat, at::TensorList tensors,
                      at::IntArrayRef offsets) {
  const char* what = to_flat ? "srcs" : "dsts";
  check_flat(op, to_flat ? "out" : "flat", flat);
  TORCH_CHECK(offsets.size() == tensors.size(), "megatron_hybrid::", op, ": expected one offset per tensor, got ",
              tensors.size(), " tensors and ", offsets.size(), " offsets");
  CopyPlan plan;
  plan.to_flat = to_flat;
  const int64_t total = flat.numel();
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    const int64_t off = offsets[i];
    const int64_t numel = t.numel();
    check_same_device(op, what, static_cast<int64_t>(i), t, flat);
    TORCH_CHECK(off >= 0 && off <= total && numel <= total - off, "megatron_hybrid::", op, ": ", what, "[", i,
                "] (", numel, " elements) at offset ", off, " does not fit in the flat buffer of ", total,
                " elements");
    if (!to_flat) at::assert_no_internal_overlap(t);
    if (numel == 0) continue;
    const uint64_t flat_ptr = address(flat) + static_cast<uint64_t>(off * flat.element_size());
    std::function<void()> slow;
    if (to_flat) {
      slow = [flat, t, off, numel] { flat.narrow(0, off, numel).view(t.sizes()).copy_(t); };
    } else {
      slow = [flat, t, off, numel] { t.copy_(flat.narrow(0, off, numel).view(t.sizes())); };
    }
    add_job(plan, flat_ptr, flat.scalar_type(), address(t), t.scalar_type(), t.sizes(), t.strides(), std::move(slow));
  }
  return plan;
}

// Copies between the flat buffer and [rows, cols] blocks of 2-D tensors (scatter_blocks / gather_blocks).
// A 1-D tensor of n elements is addressed as an [n, 1] column so that dim-0 layouts (biases of column-parallel
// layers, vocab rows) use the same block tables as the matching weights.
CopyPlan plan_blocks(const char* op, bool to_flat, const at::Tensor& flat, at::TensorList tensors,
                     const at::Tensor& blocks) {
  const char* what = to_flat ? "srcs" : "dsts";
  check_flat(op, "flat", flat);
  TORCH_CHECK(blocks.device().is_cpu() && blocks.scalar_type() == at::kLong && blocks.dim() == 2 &&
                  blocks.size(1) == 6,
              "megatron_hybrid::", op, ": blocks must be an int64 CPU tensor of shape [n, 6] with rows (",
              "tensor_index, flat_offset, rows, cols, row0, col0), got ", blocks.scalar_type(), " on ",
              blocks.device(), " with shape ", blocks.sizes());
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    check_same_device(op, what, static_cast<int64_t>(i), t, flat);
    TORCH_CHECK(t.dim() == 1 || t.dim() == 2, "megatron_hybrid::", op, ": ", what, "[", i,
                "] must be 1-D (addressed as [n, 1]) or 2-D, got shape ", t.sizes(),
                "; pass a 2-D view such as t.flatten(1)");
    if (!to_flat) at::assert_no_internal_overlap(t);
  }
  CopyPlan plan;
  plan.to_flat = to_flat;
  const at::Tensor table = blocks.contiguous();
  const int64_t* row = table.const_data_ptr<int64_t>();
  const int64_t total = flat.numel();
  for (int64_t b = 0; b < table.size(0); ++b, row += 6) {
    const int64_t index = row[0], off = row[1], rows = row[2], cols = row[3], row0 = row[4], col0 = row[5];
    TORCH_CHECK(index >= 0 && index < static_cast<int64_t>(tensors.size()), "megatron_hybrid::", op, ": block ", b,
                " names ", what, "[", index, "] but ", tensors.size(), " tensors were given");
    const at::Tensor& t = tensors[index];
    const int64_t t_rows = t.size(0), t_cols = t.dim() == 2 ? t.size(1) : 1;
    const int64_t s_row = t.stride(0), s_col = t.dim() == 2 ? t.stride(1) : 1;
    TORCH_CHECK(rows >= 0 && cols >= 0 && row0 >= 0 && col0 >= 0 && row0 <= t_rows && rows <= t_rows - row0 &&
                    col0 <= t_cols && cols <= t_cols - col0,
                "megatron_hybrid::", op, ": block ", b, " covers rows [", row0, ", ", row0 + rows, ") and cols [",
                col0, ", ", col0 + cols, ") of ", what, "[", index, "] whose 2-D shape is [", t_rows, ", ", t_cols,
                "]");
    const int64_t numel = rows * cols;
    TORCH_CHECK(off >= 0 && off <= total && numel <= total - off, "megatron_hybrid::", op, ": block ", b, " ([",
                rows, ", ", cols, "] at flat offset ", off, ") does not fit in the flat buffer of ", total,
                " elements");
    if (numel == 0) continue;
    const uint64_t flat_ptr = address(flat) + static_cast<uint64_t>(off * flat.element_size());
    const uint64_t t_ptr = address(t) + static_cast<uint64_t>((row0 * s_row + col0 * s_col) * t.element_size());
    std::function<void()> slow;
    if (to_flat) {
      slow = [=] {
        at::Tensor t2 = t.dim() == 1 ? t.unsqueeze(1) : t;
        flat.narrow(0, off, numel).view({rows, cols}).copy_(t2.narrow(0, row0, rows).narrow(1, col0, cols));
      };
    } else {
      slow = [=] {
        at::Tensor t2 = t.dim() == 1 ? t.unsqueeze(1) : t;
        t2.narrow(0, row0, rows).narrow(1, col0, cols).copy_(flat.narrow(0, off, numel).view({rows, cols}));
      };
    }
    const int64_t sizes[2] = {rows, cols};
    const int64_t strides[2] = {s_row, s_col};
    add_job(plan, flat_ptr, flat.scalar_type(), t_ptr, t.scalar_type(), sizes, strides, std::move(slow));
  }
  return plan;
}

}  // namespace

CopyPlan plan_pack(at::TensorList srcs, const at::Tensor& out, at::IntArrayRef offsets) {
  return plan_offsets("pack", /*to_flat=*/true, out, srcs, offsets);
}

CopyPlan plan_unpack(const at::Tensor& flat, at::TensorList dsts, at::IntArrayRef offsets) {
  return plan_offsets("unpack", /*to_flat=*/false, flat, dsts, offsets);
}

CopyPlan plan_scatter_blocks(const at::Tensor& flat, at::TensorList dsts, const at::Tensor& blocks) {
  return plan_blocks("scatter_blocks", /*to_flat=*/false, flat, dsts, blocks);
}

CopyPlan plan_gather_blocks(at::TensorList srcs, const at::Tensor& flat, const at::Tensor& blocks) {
  return plan_blocks("gather_blocks", /*to_flat=*/true, flat, srcs, blocks);
}

std::vector<int64_t> tile_prefix(const std::vector<CopyChunk>& chunks, int64_t tile_units) {
  std::vector<int64_t> begin(chunks.size() + 1, 0);
  for (size_t i = 0; i < chunks.size(); ++i) begin[i + 1] = begin[i] + (chunks[i].units + tile_units - 1) / tile_units;
  return begin;
}

}  // namespace megatron_hybrid
