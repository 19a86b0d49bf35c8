// megatron_hybrid native ops: schemas (defined once, here), the CPU kernels, and the Python module.
//
//   pack(srcs, out, offsets)            out[offsets[i] : offsets[i] + srcs[i].numel()] = srcs[i].flatten()
//   unpack(flat, dsts, offsets)         dsts[i].copy_(flat[offsets[i] : ...].view(dsts[i].shape))
//   scatter_blocks(flat, dsts, blocks)  dsts[i][r0:r0+rows, c0:c0+cols] = flat[off : off+rows*cols].view(rows, cols)
//   gather_blocks(srcs, flat, blocks)   the inverse of scatter_blocks
//
// Every copy casts to the destination dtype. `blocks` is an int64 CPU tensor [n, 6] with rows
// (tensor_index, flat_offset, rows, cols, row0, col0); 1-D tensors are addressed as [n, 1] columns.
// Destination regions must not overlap each other or the sources (not checked beyond internal overlap).
#include <cstring>

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <c10/util/TypeCast.h>
#include <torch/extension.h>
#include <torch/library.h>

#include "copy_plan.h"

namespace megatron_hybrid {

#ifdef MH_WITH_CUDA
void set_cuda_launch_config(int64_t unroll, int64_t inner, int64_t blocks_per_sm, bool streaming);
#endif

namespace {

// Tiles of this many units: 4 KiB .. 64 KiB of work, big enough for memcpy to dominate, small enough that a few
// large tensors still spread over all threads.
constexpr int64_t kCpuTileUnits = 4096;

struct alignas(16) Bytes16 {
  uint64_t lo, hi;
};

template <typename Unit>
void copy_units(const CopyChunk& c, int64_t begin, int64_t end, bool to_flat) {
  char* flat = reinterpret_cast<char*>(c.flat);
  char* strided = reinterpret_cast<char*>(c.strided);
  if (c.ndim == 1 && c.strides[0] == 1) {
    char* dst = to_flat ? flat : strided;
    const char* src = to_flat ? strided : flat;
    std::memcpy(dst + begin * sizeof(Unit), src + begin * sizeof(Unit), (end - begin) * sizeof(Unit));
    return;
  }
  for (int64_t u = begin; u < end; ++u) {
    char* f = flat + u * sizeof(Unit);
    char* s = strided + strided_offset(c, u) * sizeof(Unit);
    if (to_flat) std::memcpy(f, s, sizeof(Unit)); else std::memcpy(s, f, sizeof(Unit));
  }
}

void copy_range(const CopyChunk& c, int64_t begin, int64_t end, bool to_flat) {
  switch (c.width) {
    case 1: return copy_units<uint8_t>(c, begin, end, to_flat);
    case 2: return copy_units<uint16_t>(c, begin, end, to_flat);
    case 4: return copy_units<uint32_t>(c, begin, end, to_flat);
    case 8: return copy_units<uint64_t>(c, begin, end, to_flat);
    case 16: return copy_units<Bytes16>(c, begin, end, to_flat);
    default: TORCH_INTERNAL_ASSERT(false, "unexpected copy width ", c.width);
  }
}

template <typename S, typename D>
void cast_range(const CopyChunk& c, int64_t begin, int64_t end, bool to_flat) {
  // A unit is c.width elements; widths > 1 only occur on contiguous runs, where unit offsets equal element offsets
  // divided by the width on both sides.
  const int64_t n = c.width;
  const auto* src = reinterpret_cast<const S*>(to_flat ? c.strided : c.flat);
  auto* dst = reinterpret_cast<D*>(to_flat ? c.flat : c.strided);
  for (int64_t u = begin; u < end; ++u) {
    const int64_t s_off = to_flat ? strided_offset(c, u) : u;
    const int64_t d_off = to_flat ? u : strided_offset(c, u);
    for (int64_t k = 0; k < n; ++k) dst[d_off * n + k] = c10::convert<D>(src[s_off * n + k]);
  }
}

// Walk the plan's tiles in parallel; `body(chunk, first_unit, end_unit)` copies part of one chunk.
template <typename Body>
void for_each_tile(const std::vector<CopyChunk>& chunks, Body body) {
  if (chunks.empty()) return;
  const std::vector<int64_t> begin = tile_prefix(chunks, kCpuTileUnits);
  const int n = static_cast<int>(chunks.size());
  at::parallel_for(0, begin.back(), /*grain_size=*/8, [&](int64_t t0, int64_t t1) {
    int c = find_chunk(begin.data(), 0, n, t0);
    for (int64_t t = t0; t < t1; ++t) {
      while (begin[c + 1] <= t) ++c;
      const int64_t first = (t - begin[c]) * kCpuTileUnits;
      body(chunks[c], first, std::min(first + kCpuTileUnits, chunks[c].units));
    }
  });
}

void execute_cpu(const CopyPlan& plan) {
  for (const auto& slow : plan.slow) slow();
  for_each_tile(plan.copies, [&](const CopyChunk& c, int64_t b, int64_t e) { copy_range(c, b, e, plan.to_flat); });
  for (const auto& entry : plan.casts) {
    const auto& key = entry.first;
    const auto& chunks = entry.second;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, key.first, "megatron_hybrid_cast_src", [&] {
      using S = scalar_t;
      AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, key.second, "megatron_hybrid_cast_dst", [&] {
        using D = scalar_t;
        for_each_tile(chunks, [&](const CopyChunk& c, int64_t b, int64_t e) { cast_range<S, D>(c, b, e, plan.to_flat); });
      });
    });
  }
}

void check_cpu(const char* op, const at::Tensor& flat) {
  TORCH_CHECK(flat.device().is_cpu(), "megatron_hybrid::", op, ": the CPU kernel got a flat buffer on ",
              flat.device());
}

void pack_cpu(at::TensorList srcs, const at::Tensor& out, at::IntArrayRef offsets) {
  check_cpu("pack", out);
  execute_cpu(plan_pack(srcs, out, offsets));
}

void unpack_cpu(const at::Tensor& flat, at::TensorList dsts, at::IntArrayRef offsets) {
  check_cpu("unpack", flat);
  execute_cpu(plan_unpack(flat, dsts, offsets));
}

void scatter_blocks_cpu(const at::Tensor& flat, at::TensorList dsts, const at::Tensor& blocks) {
  check_cpu("scatter_blocks", flat);
  execute_cpu(plan_scatter_blocks(flat, dsts, blocks));
}

void gather_blocks_cpu(at::TensorList srcs, const at::Tensor& flat, const at::Tensor& blocks) {
  check_cpu("gather_blocks", flat);
  execute_cpu(plan_gather_blocks(srcs, flat, blocks));
}

bool cuda_built() {
#ifdef MH_WITH_CUDA
  return true;
#else
  return false;
#endif
}

}  // namespace
}  // namespace megatron_hybrid

TORCH_LIBRARY(megatron_hybrid, m) {
  // Fake (meta) kernels are registered from Python with torch.library.register_fake.
  m.set_python_module("megatron_hybrid.kernels.ops");
  m.def("pack(Tensor[] srcs, Tensor(a!) out, int[] offsets) -> ()");
  m.def("unpack(Tensor flat, Tensor(a!)[] dsts, int[] offsets) -> ()");
  m.def("scatter_blocks(Tensor flat, Tensor(a!)[] dsts, Tensor blocks) -> ()");
  m.def("gather_blocks(Tensor[] srcs, Tensor(a!) flat, Tensor blocks) -> ()");
}

TORCH_LIBRARY_IMPL(megatron_hybrid, CPU, m) {
  m.impl("pack", &megatron_hybrid::pack_cpu);
  m.impl("unpack", &megatron_hybrid::unpack_cpu);
  m.impl("scatter_blocks", &megatron_hybrid::scatter_blocks_cpu);
  m.impl("gather_blocks", &megatron_hybrid::gather_blocks_cpu);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "megatron_hybrid native ops; call them through torch.ops.megatron_hybrid or megatron_hybrid.kernels.ops";
  m.def("cuda_built", &megatron_hybrid::cuda_built, "Whether the CUDA kernels were compiled into this build");
#ifdef MH_WITH_CUDA
  m.def("set_cuda_launch_config", &megatron_hybrid::set_cuda_launch_config, pybind11::arg("unroll"),
        pybind11::arg("inner"), pybind11::arg("blocks_per_sm"), pybind11::arg("streaming"),
        "Tuning hook for bench/ops.py: loads in flight per thread (4 or 8), sub-tiles per tile (1 or 4), blocks "
        "per SM (0: as many as are resident), and whether 16-byte accesses use streaming (evict-first) hints");
#endif
}
