// CUDA kernels for the megatron_hybrid ops (schemas in ops.cpp). Built only with -DMH_WITH_CUDA.
//
// One op call = one launch for all same-dtype copies (any dtypes, copied as bytes) plus one launch per
// (source dtype, destination dtype) pair that needs a cast. The plan's chunk table (copy_plan.h) is uploaded once
// per call, or reused from a small cache when the same tensors are copied again. A persistent grid walks
// fixed-size tiles of all chunks (walk_tiles in cuda_common.cuh), so one huge embedding and a hundred small norms
// share the SMs evenly; 16-byte accesses where both sides are aligned, several loads in flight per thread.
#ifdef MH_WITH_CUDA

#include <atomic>
#include <cstring>
#include <list>
#include <mutex>
#include <vector>

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "cuda_common.cuh"

namespace megatron_hybrid {
namespace cuda {
namespace {

// Tuning hook state (set_cuda_launch_config); blocks_per_sm 0 means "as many as are resident at once". The
// defaults are the best of bench/ops.py --sweep on the H200 (bench/results/ops_h200.json).
std::atomic<int> g_unroll{4};
std::atomic<int> g_inner{4};
std::atomic<int> g_blocks_per_sm{4};
std::atomic<bool> g_streaming{false};

struct alignas(16) Bytes16 {
  uint64_t lo, hi;
};

template <bool kStreaming, typename U>
__device__ __forceinline__ U load(const U* p) {
  if constexpr (kStreaming && sizeof(U) == 16) {
    const uint4 v = __ldcs(reinterpret_cast<const uint4*>(p));
    U out;
    memcpy(&out, &v, sizeof(U));
    return out;
  } else {
    return *p;
  }
}

template <bool kStreaming, typename U>
__device__ __forceinline__ void store(U* p, const U& v) {
  if constexpr (kStreaming && sizeof(U) == 16) {
    uint4 w;
    memcpy(&w, &v, sizeof(U));
    __stcs(reinterpret_cast<uint4*>(p), w);
  } else {
    *p = v;
  }
}

// Tiles are kInner sub-tiles of kThreads * kUnroll units. `between()` (the walker's look-up of the next tile's
// chunk) runs after the last loads are issued and before their stores, so its dependent loads overlap them.

// Any strided side: per-unit offsets, bounds checks.
template <typename U, int kUnroll, int kInner, bool kStreaming, typename Between>
__device__ __forceinline__ void copy_tile_strided(const CopyChunk& c, int64_t first, bool to_flat, Between between) {
  const U* src = reinterpret_cast<const U*>(to_flat ? c.strided : c.flat);
  U* dst = reinterpret_cast<U*>(to_flat ? c.flat : c.strided);
  const int64_t units = c.units;
#pragma unroll 1
  for (int i = 0; i < kInner; ++i) {
    int64_t s_off[kUnroll], d_off[kUnroll];
    U v[kUnroll];
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      const int64_t u = first + (i * kUnroll + k) * kThreads + threadIdx.x;
      if (u < units) {
        const int64_t so = strided_offset(c, u);
        s_off[k] = to_flat ? so : u;
        d_off[k] = to_flat ? u : so;
        v[k] = load<kStreaming>(src + s_off[k]);
      }
    }
    if (i == kInner - 1) between();
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      if (first + (i * kUnroll + k) * kThreads + threadIdx.x < units) store<kStreaming>(dst + d_off[k], v[k]);
    }
  }
}

// The common case (whole tensors packed into / out of the flat buffer): both sides contiguous, so no index math.
// A full tile needs no bounds checks and keeps loads in flight continuously: sub-tile i + 1 is loaded (into the
// other register buffer) before sub-tile i is stored.
template <typename U, int kUnroll, int kInner, bool kStreaming, typename Between>
__device__ __forceinline__ void copy_tile_contiguous(const CopyChunk& c, int64_t first, bool to_flat,
                                                     Between between) {
  const U* src = reinterpret_cast<const U*>(to_flat ? c.strided : c.flat) + first + threadIdx.x;
  U* dst = reinterpret_cast<U*>(to_flat ? c.flat : c.strided) + first + threadIdx.x;
  if (c.units - first >= int64_t(kThreads) * kUnroll * kInner) {
    U buf[2][kUnroll];
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) buf[0][k] = load<kStreaming>(src + k * kThreads);
#pragma unroll
    for (int i = 0; i < kInner; ++i) {
      if (i + 1 < kInner) {
#pragma unroll
        for (int k = 0; k < kUnroll; ++k) buf[(i + 1) & 1][k] = load<kStreaming>(src + ((i + 1) * kUnroll + k) * kThreads);
      } else {
        between();
      }
#pragma unroll
      for (int k = 0; k < kUnroll; ++k) store<kStreaming>(dst + (i * kUnroll + k) * kThreads, buf[i & 1][k]);
    }
    return;
  }
  const int64_t left = c.units - first - threadIdx.x;
#pragma unroll 1
  for (int i = 0; i < kInner; ++i) {
    U v[kUnroll];
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      if ((i * kUnroll + k) * kThreads < left) v[k] = load<kStreaming>(src + (i * kUnroll + k) * kThreads);
    }
    if (i == kInner - 1) between();
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      if ((i * kUnroll + k) * kThreads < left) store<kStreaming>(dst + (i * kUnroll + k) * kThreads, v[k]);
    }
  }
}

template <int kUnroll, int kInner, bool kStreaming>
__global__ void __launch_bounds__(kThreads) copy_kernel(const int64_t* __restrict__ tile_begin,
                                                        const CopyChunk* __restrict__ chunks, int num_chunks,
                                                        bool to_flat) {
  walk_tiles<int64_t(kThreads) * kUnroll * kInner>(
      tile_begin, chunks, num_chunks, [&](const CopyChunk& ch, int64_t first, auto between) {
        if (ch.ndim == 1 && ch.strides[0] == 1) {
          switch (ch.width) {
            case 16: return copy_tile_contiguous<Bytes16, kUnroll, kInner, kStreaming>(ch, first, to_flat, between);
            case 8: return copy_tile_contiguous<uint64_t, kUnroll, kInner, kStreaming>(ch, first, to_flat, between);
            case 4: return copy_tile_contiguous<uint32_t, kUnroll, kInner, kStreaming>(ch, first, to_flat, between);
            case 2: return copy_tile_contiguous<uint16_t, kUnroll, kInner, kStreaming>(ch, first, to_flat, between);
            default: return copy_tile_contiguous<uint8_t, kUnroll, kInner, kStreaming>(ch, first, to_flat, between);
          }
        }
        switch (ch.width) {
          case 16: return copy_tile_strided<Bytes16, kUnroll, kInner, kStreaming>(ch, first, to_flat, between);
          case 8: return copy_tile_strided<uint64_t, kUnroll, kInner, kStreaming>(ch, first, to_flat, between);
          case 4: return copy_tile_strided<uint32_t, kUnroll, kInner, kStreaming>(ch, first, to_flat, between);
          case 2: return copy_tile_strided<uint16_t, kUnroll, kInner, kStreaming>(ch, first, to_flat, between);
          default: return copy_tile_strided<uint8_t, kUnroll, kInner, kStreaming>(ch, first, to_flat, between);
        }
      });
}

// ---- chunk-table upload, with a small cache keyed on the table's bytes (pointers, sizes, strides) -------------

struct TableCacheEntry {
  int device;
  cudaStream_t stream;
  std::vector<uint8_t> bytes;
  at::Tensor host;    // pinned copy, kept so that a graph capture that recorded the upload stays valid
  at::Tensor device_table;
  bool sticky;        // made during stream capture: a graph may replay its upload, so never evict it
};

constexpr size_t kTableCacheSize = 16;
std::mutex g_cache_mutex;
// Most recently used first. Deliberately leaked: destroying its tensors during static destruction at exit would
// run after the CUDA caching allocator is gone.
std::list<TableCacheEntry>& g_cache = *new std::list<TableCacheEntry>();

}  // namespace

at::Tensor upload_table(const std::vector<CopyChunk>& chunks, int64_t tile_units, const at::Device& device) {
  const std::vector<int64_t> begin = tile_prefix(chunks, tile_units);
  const size_t off = chunk_offset(chunks.size());
  std::vector<uint8_t> bytes(off + chunks.size() * sizeof(CopyChunk), 0);
  std::memcpy(bytes.data(), begin.data(), begin.size() * sizeof(int64_t));
  std::memcpy(bytes.data() + off, chunks.data(), chunks.size() * sizeof(CopyChunk));

  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  const bool capturing = c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None;
  std::lock_guard<std::mutex> lock(g_cache_mutex);
  for (auto it = g_cache.begin(); it != g_cache.end(); ++it) {
    if (it->device == device.index() && it->stream == stream && it->bytes == bytes) {
      g_cache.splice(g_cache.begin(), g_cache, it);
      return g_cache.front().device_table;
    }
  }
  at::Tensor host = at::empty({static_cast<int64_t>(bytes.size())}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
  std::memcpy(host.data_ptr<uint8_t>(), bytes.data(), bytes.size());
  at::Tensor dev = at::empty({static_cast<int64_t>(bytes.size())}, at::TensorOptions().dtype(at::kByte).device(device));
  dev.copy_(host, /*non_blocking=*/true);  // stream-ordered; the host allocator keeps `host` until the copy is done
  g_cache.push_front(TableCacheEntry{device.index(), stream, std::move(bytes), host, dev, capturing});
  size_t evictable = 0;
  for (auto it = g_cache.begin(); it != g_cache.end();) {
    if (!it->sticky && ++evictable > kTableCacheSize) it = g_cache.erase(it); else ++it;
  }
  return g_cache.front().device_table;
}

int grid_size(const void* kernel, int64_t num_tiles) {
  int device = 0, sms = 0, resident = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&resident, kernel, kThreads, 0));
  const int per_sm = g_blocks_per_sm.load() > 0 ? g_blocks_per_sm.load() : std::max(resident, 1);
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(num_tiles, int64_t(sms) * per_sm)));
}

namespace {

template <int kUnroll, int kInner, bool kStreaming>
void launch_copies(const std::vector<CopyChunk>& chunks, bool to_flat, const at::Device& device) {
  constexpr int64_t tile_units = int64_t(kThreads) * kUnroll * kInner;
  const int64_t num_tiles = tile_prefix(chunks, tile_units).back();
  const at::Tensor table_tensor = upload_table(chunks, tile_units, device);
  const uint8_t* table = table_tensor.const_data_ptr<uint8_t>();
  const auto kernel = copy_kernel<kUnroll, kInner, kStreaming>;
  kernel<<<grid_size(reinterpret_cast<const void*>(kernel), num_tiles), kThreads, 0,
           c10::cuda::getCurrentCUDAStream()>>>(
      reinterpret_cast<const int64_t*>(table),
      reinterpret_cast<const CopyChunk*>(table + chunk_offset(chunks.size())), static_cast<int>(chunks.size()),
      to_flat);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <int kUnroll, int kInner>
void launch_copies(const std::vector<CopyChunk>& chunks, bool to_flat, const at::Device& device) {
  if (g_streaming.load()) {
    launch_copies<kUnroll, kInner, true>(chunks, to_flat, device);
  } else {
    launch_copies<kUnroll, kInner, false>(chunks, to_flat, device);
  }
}

void execute_cuda(const CopyPlan& plan, const at::Device& device) {
  for (const auto& slow : plan.slow) slow();
  if (!plan.copies.empty()) {
    TORCH_CHECK(plan.copies.size() < static_cast<size_t>(INT32_MAX), "megatron_hybrid: too many copy chunks");
    const bool wide = g_unroll.load() == 8;
    if (g_inner.load() == 1) {
      wide ? launch_copies<8, 1>(plan.copies, plan.to_flat, device)
           : launch_copies<4, 1>(plan.copies, plan.to_flat, device);
    } else {
      wide ? launch_copies<8, 4>(plan.copies, plan.to_flat, device)
           : launch_copies<4, 4>(plan.copies, plan.to_flat, device);
    }
  }
  launch_casts(plan, device);
}

void check_cuda(const char* op, const at::Tensor& flat) {
  TORCH_CHECK(flat.is_cuda(), "megatron_hybrid::", op, ": the CUDA kernel got a flat buffer on ", flat.device(),
              "; the flat buffer and all tensors must be on one CUDA device");
}

void pack_cuda(at::TensorList srcs, const at::Tensor& out, at::IntArrayRef offsets) {
  check_cuda("pack", out);
  const c10::cuda::CUDAGuard guard(out.device());
  execute_cuda(plan_pack(srcs, out, offsets), out.device());
}

void unpack_cuda(const at::Tensor& flat, at::TensorList dsts, at::IntArrayRef offsets) {
  check_cuda("unpack", flat);
  const c10::cuda::CUDAGuard guard(flat.device());
  execute_cuda(plan_unpack(flat, dsts, offsets), flat.device());
}

void scatter_blocks_cuda(const at::Tensor& flat, at::TensorList dsts, const at::Tensor& blocks) {
  check_cuda("scatter_blocks", flat);
  const c10::cuda::CUDAGuard guard(flat.device());
  execute_cuda(plan_scatter_blocks(flat, dsts, blocks), flat.device());
}

void gather_blocks_cuda(at::TensorList srcs, const at::Tensor& flat, const at::Tensor& blocks) {
  check_cuda("gather_blocks", flat);
  const c10::cuda::CUDAGuard guard(flat.device());
  execute_cuda(plan_gather_blocks(srcs, flat, blocks), flat.device());
}

}  // namespace
}  // namespace cuda

void set_cuda_launch_config(int64_t unroll, int64_t inner, int64_t blocks_per_sm, bool streaming) {
  TORCH_CHECK(unroll == 4 || unroll == 8, "megatron_hybrid: unroll must be 4 or 8, got ", unroll);
  TORCH_CHECK(inner == 1 || inner == 4, "megatron_hybrid: inner must be 1 or 4, got ", inner);
  TORCH_CHECK(blocks_per_sm >= 0 && blocks_per_sm <= 64,
              "megatron_hybrid: blocks_per_sm must be in [0, 64] (0: as many as are resident), got ",
              blocks_per_sm);
  cuda::g_unroll = static_cast<int>(unroll);
  cuda::g_inner = static_cast<int>(inner);
  cuda::g_blocks_per_sm = static_cast<int>(blocks_per_sm);
  cuda::g_streaming = streaming;
}

}  // namespace megatron_hybrid

TORCH_LIBRARY_IMPL(megatron_hybrid, CUDA, m) {
  m.impl("pack", &megatron_hybrid::cuda::pack_cuda);
  m.impl("unpack", &megatron_hybrid::cuda::unpack_cuda);
  m.impl("scatter_blocks", &megatron_hybrid::cuda::scatter_blocks_cuda);
  m.impl("gather_blocks", &megatron_hybrid::cuda::gather_blocks_cuda);
}

#endif  // MH_WITH_CUDA
