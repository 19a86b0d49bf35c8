// Shared by the CUDA translation units (ops_cuda.cu: copies, table upload, registration; casts_cuda.cu: casts).
// The two halves compile in parallel; the kernels themselves are described in ops_cuda.cu.
#pragma once

#ifdef MH_WITH_CUDA

#include <cstddef>
#include <cstdint>
#include <vector>

#include <ATen/core/Tensor.h>

#include "copy_plan.h"

namespace megatron_hybrid {
namespace cuda {

constexpr int kThreads = 256;

// Device copy of a chunk table laid out as [tile_begin: (n + 1) int64, padded to 16 bytes][n CopyChunk], on the
// current stream. Returned as a tensor (not a pointer) so that a concurrent cache eviction cannot free it first.
at::Tensor upload_table(const std::vector<CopyChunk>& chunks, int64_t tile_units, const at::Device& device);

// Byte offset of the CopyChunk records in such a table.
inline size_t chunk_offset(size_t num_chunks) { return ((num_chunks + 1) * sizeof(int64_t) + 15) / 16 * 16; }

// Blocks for a persistent launch of `kernel` (kThreads threads): as many as fit on the device at once (or the
// tuning hook's blocks per SM), never more than there are tiles.
int grid_size(const void* kernel, int64_t num_tiles);

// One launch per (source, destination) dtype pair of plan.casts, on the current stream (casts_cuda.cu).
void launch_casts(const CopyPlan& plan, const at::Device& device);

#ifdef __CUDACC__
// Persistent-grid walk over a chunk table: block b takes tiles b, b + gridDim.x, ... and calls
// body(chunk, first_unit, lookahead) for each. Calling lookahead() finds the chunk of the block's next tile; bodies
// call it after issuing their last loads, so its dependent loads (usually one) overlap the loads in flight instead
// of stalling the block between tiles.
template <int64_t kTileUnits, typename Body>
__device__ __forceinline__ void walk_tiles(const int64_t* __restrict__ tile_begin,
                                           const CopyChunk* __restrict__ chunks, int num_chunks, Body body) {
  const int64_t num_tiles = tile_begin[num_chunks];
  int64_t t = blockIdx.x;
  if (t >= num_tiles) return;
  int c = find_chunk(tile_begin, 0, num_chunks, t);
  int64_t c_begin = tile_begin[c];
  for (;;) {
    const int64_t t_next = t + gridDim.x;
    int c_next = c;
    int64_t c_next_begin = c_begin;
    auto lookahead = [&] {
      if (t_next < num_tiles && c + 1 < num_chunks && tile_begin[c + 1] <= t_next) {
        c_next = find_chunk(tile_begin, c + 1, num_chunks, t_next);
        c_next_begin = tile_begin[c_next];
      }
    };
    body(chunks[c], (t - c_begin) * kTileUnits, lookahead);
    if (t_next >= num_tiles) return;
    t = t_next;
    c = c_next;
    c_begin = c_next_begin;
  }
}
#endif  // __CUDACC__

}  // namespace cuda
}  // namespace megatron_hybrid

#endif  // MH_WITH_CUDA
