// Launchers of the Gefen CUDA kernels (gefen_cuda.cu). Plain pointers and a stream, no torch
// types, so the kernels compile (and are compile-checked in CI) with nvcc alone; the torch
// binding (gefen_cuda_binding.cpp) checks tensors and passes their pointers.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace gefen {

// One row of the segment table (int64 fields); pointers are device addresses.
enum Meta : int {
  kP = 0,         // parameter piece (dtype kPDtype)
  kG,             // gradient piece (dtype kGDtype)
  kCodes,         // uint8 codes of the segment (B > 1)
  kAbsmax,        // fp32 per block (B > 1)
  kV,             // fp32 per block (B > 1)
  kLevels,        // fp32 codebook, kNLevels entries (B > 1)
  kMids,          // fp32 midpoints, kNLevels - 1 entries (B > 1)
  kStart,         // first element's index in the original tensor
  kNumel,         // elements in the segment
  kBlock,         // block size B
  kBits,          // 4 or 8
  kPDtype,        // 0 fp32, 1 bf16, 2 fp16
  kGDtype,        // same codes
  kExpAvg,        // bf16 m per element (B = 1), stochastically rounded
  kExpAvgSq,      // bf16 v per element (B = 1), stochastically rounded
  kNLevels,       // 16 or 256
  kStepKey,       // codes.step_key(step): 4-bit stochastic rounding's per-step hash
  kFactor,        // fp32 reference.cross_factor of the segment (B != 1), or 0 for none
  kVCross,        // CPU kernel only (0 here): fp32 v_cross of a tensor held whole, from which
                  // the kernel writes the factor into kFactor, and into which it folds the
                  // sums it takes in the update (reference.cross_factor)
  kMetaCols = 19
};

// One row of the per-segment hyperparameters (fp32), computed on the host from the group's lr,
// betas, weight decay and the parameter's step, so a schedule changes nothing on the device.
enum Hyp : int {
  kBeta1 = 0,    // beta1
  kW,            // 1 - beta1 (the lerp weight)
  kBeta2,        // beta2
  kA2,           // 1 - beta2
  kDecay,        // 1 - lr * weight_decay
  kNegStep,      // -lr / (1 - beta1^t)
  kBc2,          // sqrt(1 - beta2^t)
  kEps,          // eps
  kHypCols = 8
};

// Blocked segments. ``prefix`` (n_seg + 1 entries) holds each segment's first work item: one
// item per block. ``team`` is 32 (a warp per block, for short blocks) or 256 (a thread block per
// block, for long ones); any block length works with either.
cudaError_t launch_blocks(const int64_t* meta, const float* hyp, const int64_t* prefix, int n_seg,
                          int64_t n_items, int team, cudaStream_t stream);

// B = 1 segments: exact AdamW. ``prefix`` counts tiles of kDenseTile elements.
constexpr int kDenseTile = 2048;
cudaError_t launch_dense(const int64_t* meta, const float* hyp, const int64_t* prefix, int n_seg,
                         int64_t n_tiles, cudaStream_t stream);

// Adds the block-normalised values g / absmax(block) of one segment to ``counts`` (bins int64
// counters over [-1, 1], binned as gefen_dist.codebook.histogram). ``head_amax`` /
// ``tail_amax`` (>= 0) replace the absmax of a first / last block that a shard boundary cuts;
// pass -1 to use the piece's own.
cudaError_t launch_histogram(const void* g, int g_dtype, int64_t start, int64_t numel,
                             int64_t block, float head_amax, float tail_amax,
                             unsigned long long* counts, int bins, cudaStream_t stream);

// Column segments (block size -P; rows of ``meta``/``hyp``, n_seg of them): v and absmax per
// column, four launches for all. ``aux`` per segment (int64, the columns of ColumnAux) places
// its scratch: ``part_sum`` (double) and ``part_max`` from kCPart (chunks x min(numel, P)),
// ``denom`` and ``amax_new`` from kCCol (min(numel, P)); chunk c covers rows [c * per, (c + 1) *
// per) of the segment's (rows, P) view. The prefixes count each segment's thread blocks of 256
// threads in the three shapes (so a thread block never spans two segments): ``reduce_prefix``
// column tiles x chunks, ``col_prefix`` column tiles, ``unit_prefix`` tiles of units (bytes at 4
// bits, elements at 8); ``*_blocks`` are their last entries, the grids. A factored row (kFactor) keeps sqrt(v) in ``denom`` and completes it per
// row of the view. Each segment's absmax is overwritten last, on ``stream``.
enum ColumnAux : int { kCPart = 0, kCCol, kCChunks, kCPer, kCAuxCols = 4 };

cudaError_t launch_columns(const int64_t* meta, const float* hyp, const int64_t* aux, int n_seg,
                           const int64_t* reduce_prefix, int64_t reduce_blocks,
                           const int64_t* col_prefix, int64_t col_blocks,
                           const int64_t* unit_prefix, int64_t unit_blocks, double* part_sum,
                           float* part_max, float* denom, float* amax_new, cudaStream_t stream);

// The factor's sums (reference.cross_sums) of every factored segment of a step, and the factor
// itself (reference.cross_factor) of those held whole, in four launches rather than a chain of
// torch ops per tensor. One row per segment (int64, the columns of Cross; pointers are device
// addresses), rows with contiguous blocks (B > 0) first: ``n_rows_seg`` of them, then the column
// segments (B < 0). ``hyp`` per row (fp32): beta2, 1 - beta2, sqrt(1 - beta2^t), the factor's
// floor. Contiguous rows: partial sums per chunk of the piece's tensor rows (kXChunks of them,
// into ``part`` from kXPart on, a thread per position), then their fixed-order reduction;
// ``row_prefix`` counts each row's chunks x tiles of 256 positions, ``pos_prefix`` its positions.
// Column rows: a warp per tensor row; ``col_prefix`` counts each one's rows. Sums and counts
// (fp64, kXLength entries each) must be zero where the piece has no elements; entries are
// written, not added to. Where kXOut is set, the factor is written there from v_cross as the
// steps before left it (from the fold where that is all zero), and v_cross is folded.
enum Cross : int {
  kXG = 0,    // gradient piece (dtype kXGDtype)
  kXGDtype,   // 0 fp32, 1 bf16, 2 fp16
  kXStart,    // first element's index in the tensor
  kXNumel,    // elements in the piece (> 0)
  kXBlock,    // B (> 1) or -P (P > 1)
  kXLength,   // v_cross entries: B positions, or the tensor's rows
  kXSums,     // fp64 out
  kXCounts,   // fp64 out
  kXVCross,   // fp32 v_cross, folded in place where kXOut is set
  kXOut,      // fp32 factor out, or 0 for a piece of a tensor spread over ranks
  kXPart,     // contiguous rows: first fp64 of this row's partial sums in ``part``
  kXChunks,   // contiguous rows: chunks of tensor rows (part holds kXChunks x B)
  kXCols = 12
};
constexpr int kCrossHypCols = 4;

cudaError_t launch_cross(const int64_t* meta, const float* hyp, int n_seg, int n_rows_seg,
                         const int64_t* row_prefix, int64_t row_items, const int64_t* pos_prefix,
                         int64_t pos_items, const int64_t* col_prefix, int64_t col_items,
                         double* part, cudaStream_t stream);

}  // namespace gefen
