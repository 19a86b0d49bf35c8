// CUDA cast kernels for the megatron_hybrid ops: one launch per (source, destination) dtype pair.
// A unit is N elements: N > 1 only on contiguous runs whose both sides are aligned to N elements (the planner
// splits off unaligned heads and tails), so a bf16 -> fp32 unit is an 8-byte load and a 16-byte store.
#ifdef MH_WITH_CUDA

#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/TypeCast.h>

#include "cuda_common.cuh"

namespace megatron_hybrid {
namespace cuda {
namespace {

template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

template <typename S, typename D, int N, int kUnroll, typename Between>
__device__ __forceinline__ void cast_tile(const CopyChunk& c, int64_t first, bool to_flat, Between between) {
  using SV = Vec<S, N>;
  using DV = Vec<D, N>;
  const SV* src = reinterpret_cast<const SV*>(to_flat ? c.strided : c.flat);
  DV* dst = reinterpret_cast<DV*>(to_flat ? c.flat : c.strided);
  const int64_t units = c.units;
  int64_t d_off[kUnroll];
  SV v[kUnroll];
#pragma unroll
  for (int k = 0; k < kUnroll; ++k) {
    const int64_t u = first + k * kThreads + threadIdx.x;
    if (u < units) {
      const int64_t so = strided_offset(c, u);
      d_off[k] = to_flat ? u : so;
      v[k] = src[to_flat ? so : u];
    }
  }
  between();
#pragma unroll
  for (int k = 0; k < kUnroll; ++k) {
    if (first + k * kThreads + threadIdx.x < units) {
      DV w;
#pragma unroll
      for (int j = 0; j < N; ++j) w.v[j] = c10::convert<D>(v[k].v[j]);
      dst[d_off[k]] = w;
    }
  }
}

template <typename S, typename D, int kUnroll>
__global__ void __launch_bounds__(kThreads) cast_kernel(const int64_t* __restrict__ tile_begin,
                                                        const CopyChunk* __restrict__ chunks, int num_chunks,
                                                        bool to_flat) {
  constexpr int kMaxN = 16 / (sizeof(S) > sizeof(D) ? sizeof(S) : sizeof(D));
  walk_tiles<int64_t(kThreads) * kUnroll>(
      tile_begin, chunks, num_chunks, [&](const CopyChunk& ch, int64_t first, auto between) {
        if (ch.width == kMaxN) return cast_tile<S, D, kMaxN, kUnroll>(ch, first, to_flat, between);
        if (kMaxN >= 4 && ch.width == 4) return cast_tile<S, D, (kMaxN >= 4 ? 4 : 1), kUnroll>(ch, first, to_flat, between);
        if (kMaxN >= 2 && ch.width == 2) return cast_tile<S, D, (kMaxN >= 2 ? 2 : 1), kUnroll>(ch, first, to_flat, between);
        return cast_tile<S, D, 1, kUnroll>(ch, first, to_flat, between);
      });
}

}  // namespace

void launch_casts(const CopyPlan& plan, const at::Device& device) {
  for (const auto& entry : plan.casts) {
    const auto& key = entry.first;
    const auto& chunks = entry.second;
    if (chunks.empty()) continue;  // every chunk of this pair took the slow path
    constexpr int kUnroll = 4;
    constexpr int64_t tile_units = kThreads * kUnroll;
    const int64_t num_tiles = tile_prefix(chunks, tile_units).back();
    const at::Tensor table_tensor = upload_table(chunks, tile_units, device);
    const uint8_t* table = table_tensor.const_data_ptr<uint8_t>();
    const auto* begin = reinterpret_cast<const int64_t*>(table);
    const auto* records = reinterpret_cast<const CopyChunk*>(table + chunk_offset(chunks.size()));
    const int n = static_cast<int>(chunks.size());
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, key.first, "megatron_hybrid_cast_src", [&] {
      using S = scalar_t;
      AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, key.second, "megatron_hybrid_cast_dst", [&] {
        using D = scalar_t;
        const auto kernel = cast_kernel<S, D, kUnroll>;
        kernel<<<grid_size(reinterpret_cast<const void*>(kernel), num_tiles), kThreads, 0,
                 c10::cuda::getCurrentCUDAStream()>>>(begin, records, n, plan.to_flat);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
    });
  }
}

}  // namespace cuda
}  // namespace megatron_hybrid

#endif  // MH_WITH_CUDA
