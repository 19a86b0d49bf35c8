// Copy plans: every op in this extension (pack, unpack, scatter_blocks, gather_blocks) is "copy many strided
// regions to / from one flat contiguous buffer". The host turns an op call into a table of CopyChunk records
// once; the CPU executor (ops.cpp) and the CUDA kernel (ops_cuda.cu) both execute that same table, so the CPU
// tests also cover the table building (coalescing, vector widths, head/body/tail splits) that the GPU relies on.
//
// Vocabulary: the *flat side* of a chunk is a contiguous run inside the flat buffer; the *strided side* is a view
// of a user tensor (any strides). A chunk copies `units` units; a unit is `width` bytes for same-dtype copies and
// `width` elements for casts. Unit u of the flat side sits at flat + u * unit_size; on the strided side it sits at
// the row-major coordinate u of `sizes`, i.e. at strided + sum_d coord_d * strides[d] (both in units).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

#if defined(__CUDACC__)
#define MH_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define MH_HOST_DEVICE inline
#endif

namespace megatron_hybrid {

// Dims of the strided side after coalescing. A view that still has more dims takes the slow path (at::copy_).
constexpr int kMaxDims = 6;

struct CopyChunk {
  int64_t units;              // number of units in this chunk (> 0)
  uint64_t flat;              // address of unit 0 on the flat side
  uint64_t strided;           // address of unit 0 on the strided side
  int64_t sizes[kMaxDims];    // strided side, in units, outermost first
  int64_t strides[kMaxDims];  // strided side, in units
  int32_t ndim;               // 1..kMaxDims; ndim == 1 && strides[0] == 1 is a contiguous run
  int32_t width;              // same-dtype copies: bytes per unit (1..16); casts: elements per unit (1, 2, 4, 8)
};

// Offset (in units) of unit `u` on the strided side. Chunks with ndim > 1 have fewer than 2^32 units (the planner
// splits larger ones along dim 0), so the per-dim divisions are 32-bit: 64-bit division is a slow subroutine call
// on the GPU.
MH_HOST_DEVICE int64_t strided_offset(const CopyChunk& c, int64_t u) {
  if (c.ndim == 1) return u * c.strides[0];
  uint32_t v = static_cast<uint32_t>(u);
  int64_t off = 0;
  for (int d = c.ndim - 1; d > 0; --d) {
    const uint32_t size = static_cast<uint32_t>(c.sizes[d]);
    const uint32_t q = v / size;
    off += static_cast<int64_t>(v - q * size) * c.strides[d];
    v = q;
  }
  return off + static_cast<int64_t>(v) * c.strides[0];
}

// All the work of one op call. `copies` need no conversion (any dtype, copied as bytes); `casts` are grouped by
// (source dtype, destination dtype) so that each group is one kernel launch; `slow` are closures for the rare
// cases the tables do not cover (casts outside {fp64, fp32, fp16, bf16}, views with more than kMaxDims dims).
struct CopyPlan {
  bool to_flat = false;  // true: strided -> flat (pack, gather_blocks); false: flat -> strided
  std::vector<CopyChunk> copies;
  std::map<std::pair<at::ScalarType, at::ScalarType>, std::vector<CopyChunk>> casts;
  std::vector<std::function<void()>> slow;
};

CopyPlan plan_pack(at::TensorList srcs, const at::Tensor& out, at::IntArrayRef offsets);
CopyPlan plan_unpack(const at::Tensor& flat, at::TensorList dsts, at::IntArrayRef offsets);
CopyPlan plan_scatter_blocks(const at::Tensor& flat, at::TensorList dsts, const at::Tensor& blocks);
CopyPlan plan_gather_blocks(at::TensorList srcs, const at::Tensor& flat, const at::Tensor& blocks);

// Number of tiles of `tile_units` units per chunk, as a prefix sum: tile_begin[i] is chunk i's first tile and
// tile_begin[n] the total. Both executors walk tiles, so a 1 GB tensor and a 4-byte bias share the work evenly.
std::vector<int64_t> tile_prefix(const std::vector<CopyChunk>& chunks, int64_t tile_units);

// Index of the chunk that owns `tile`: the last i with tile_begin[i] <= tile, searched in [lo, n).
MH_HOST_DEVICE int find_chunk(const int64_t* tile_begin, int lo, int n, int64_t tile) {
  int hi = n - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (tile_begin[mid] <= tile) lo = mid; else hi = mid - 1;
  }
  return lo;
}

}  // namespace megatron_hybrid
