// Gefen's update on CUDA: every segment of a step in a few launches (one per team width for the
// blocked segments, one for the B = 1 segments), the arithmetic of gefen_dist/reference.py.
//
// A team (a warp, or a whole thread block for long blocks) owns one Gefen block: it sums g^2 in
// double, updates v, moves the parameter with the unquantised m while reducing the new absmax,
// then requantises m: at 8 bits to the nearest level (first midpoint >= x: ties to the lower
// level, as the reference), at 4 bits stochastically with the reference's counter hash. The
// codebook and its midpoints sit in shared memory. A block may be any length: teams stride over
// it, reading g and the old codes twice instead of holding m.
//
// 4-bit codes: two per byte, low nibble first, each segment from a byte boundary. A byte whose
// other nibble belongs to another block (a boundary on an odd element) is written with a
// compare-and-swap on its aligned 32-bit word, so neighbouring teams never lose each other's
// nibble; every other byte has a single writer.
//
// Differences from the reference, bounded by the tests: the sums run in another order (v within
// a few ulp), and nvcc may contract a multiply-add (-fmad), off by default in the build flags.

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "gefen_cuda.h"

namespace gefen {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxLevels = 256;

__device__ __forceinline__ float load(const void* base, int64_t i, int dt) {
  switch (dt) {
    case 1: return __bfloat162float(static_cast<const __nv_bfloat16*>(base)[i]);
    case 2: return __half2float(static_cast<const __half*>(base)[i]);
    default: return static_cast<const float*>(base)[i];
  }
}

__device__ __forceinline__ void store(void* base, int64_t i, float x, int dt) {
  switch (dt) {
    case 1: static_cast<__nv_bfloat16*>(base)[i] = __float2bfloat16_rn(x); break;
    case 2: static_cast<__half*>(base)[i] = __float2half_rn(x); break;
    default: static_cast<float*>(base)[i] = x;
  }
}

// torch's lerp: start + w * (end - start) for w < 0.5, else end - (end - start) * (1 - w)
__device__ __forceinline__ float lerp(float start, float end, float w) {
  return w < 0.5f ? __fadd_rn(start, __fmul_rn(w, __fsub_rn(end, start)))
                  : __fsub_rn(end, __fmul_rn(__fsub_rn(end, start), __fsub_rn(1.0f, w)));
}

__device__ __forceinline__ int get_code(const uint8_t* codes, int64_t i, bool four) {
  if (!four) return codes[i];
  const int b = codes[i >> 1];
  return (i & 1) ? (b >> 4) : (b & 15);
}

// First midpoint >= x among n (branch-free binary search over shared memory).
__device__ __forceinline__ int nearest(float x, const float* mids, int n) {
  int lo = 0, len = n;
  while (len > 0) {
    const int half = len >> 1;
    const bool right = mids[lo + half] < x;
    lo = right ? lo + half + 1 : lo;
    len = right ? len - half - 1 : half;
  }
  return lo;
}

__device__ __forceinline__ uint32_t mix32(uint32_t x) {  // "lowbias32", as codes._mix32
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  return x ^ (x >> 16);
}

// codes.round_bf16: bf16 bits of x, the magnitude rounded up when its low 16 bits plus r carry
__device__ __forceinline__ uint16_t bf16_stochastic(float x, uint32_t r) {
  const uint32_t u = __float_as_uint(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // NaN
  return static_cast<uint16_t>((u + r) >> 16);
}

__device__ __forceinline__ float bf16_bits_to_float(uint16_t b) {
  return __uint_as_float(static_cast<uint32_t>(b) << 16);
}

// 4-bit requantisation: codes.stochastic_quantize of one element with u = codes.uniforms(step,
// index); ``key`` is codes.step_key(step), ``index`` the element's index in its tensor.
__device__ __forceinline__ int stochastic(float x, const float* levels, int64_t index,
                                          uint32_t key) {
  const uint32_t h = mix32(static_cast<uint32_t>(index) ^ key);
  const float u = __fmul_rn(static_cast<float>(h >> 8), 0x1p-24f);
  int k = 0;
  for (int t = 1; t < 15; ++t) k += levels[t] <= x;
  const float low = levels[k];
  return k + (__fmul_rn(u, __fsub_rn(levels[k + 1], low)) < __fsub_rn(x, low) ? 1 : 0);
}

// Sets one nibble of a byte that another team may be writing the other nibble of.
__device__ void put_nibble_atomic(uint8_t* byte, int code, bool high) {
  const uintptr_t addr = reinterpret_cast<uintptr_t>(byte);
  unsigned int* word = reinterpret_cast<unsigned int*>(addr & ~uintptr_t(3));
  const int shift = static_cast<int>(addr & 3) * 8 + (high ? 4 : 0);
  const unsigned int mask = 0xFu << shift;
  unsigned int old = *word, assumed;
  do {
    assumed = old;
    const unsigned int next = (assumed & ~mask) | (static_cast<unsigned int>(code) << shift);
    old = atomicCAS(word, assumed, next);
  } while (old != assumed);
}

template <int T>
__device__ __forceinline__ double team_sum(double x, double* scratch) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  if constexpr (T == 32) {
    return x;
  } else {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    __syncthreads();
    if (lane == 0) scratch[warp] = x;
    __syncthreads();
    double s = 0.0;
#pragma unroll
    for (int w = 0; w < T / 32; ++w) s += scratch[w];
    return s;
  }
}

template <int T>
__device__ __forceinline__ float team_max(float x, float* scratch) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  if constexpr (T == 32) {
    return x;
  } else {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    __syncthreads();
    if (lane == 0) scratch[warp] = x;
    __syncthreads();
    float m = 0.0f;
#pragma unroll
    for (int w = 0; w < T / 32; ++w) m = fmaxf(m, scratch[w]);
    return m;
  }
}

__device__ __forceinline__ int find_segment(const int64_t* prefix, int n_seg, int64_t item) {
  int lo = 0, hi = n_seg - 1;  // largest s with prefix[s] <= item
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (prefix[mid] <= item) lo = mid; else hi = mid - 1;
  }
  return lo;
}

template <int T>
__global__ void __launch_bounds__(kThreads) blocks_kernel(const int64_t* __restrict__ meta,
                                                          const float* __restrict__ hyp,
                                                          const int64_t* __restrict__ prefix,
                                                          int n_seg, int64_t n_items) {
  constexpr int kTeams = kThreads / T;
  __shared__ float s_levels[kTeams][kMaxLevels];
  __shared__ float s_mids[kTeams][kMaxLevels];
  __shared__ double s_sum[kThreads / 32];
  __shared__ float s_max[kThreads / 32];

  const int team = threadIdx.x / T, lane = threadIdx.x % T;
  const int64_t item = static_cast<int64_t>(blockIdx.x) * kTeams + team;
  if (item >= n_items) return;  // uniform over a team; T == 256 is the whole thread block
  const int s = find_segment(prefix, n_seg, item);
  const int64_t* m = meta + static_cast<int64_t>(s) * kMetaCols;
  const float* h = hyp + static_cast<int64_t>(s) * kHypCols;

  void* p = reinterpret_cast<void*>(m[kP]);
  const void* g = reinterpret_cast<const void*>(m[kG]);
  uint8_t* codes = reinterpret_cast<uint8_t*>(m[kCodes]);
  float* absmax = reinterpret_cast<float*>(m[kAbsmax]);
  float* v = reinterpret_cast<float*>(m[kV]);
  const int n_levels = static_cast<int>(m[kNLevels]);
  const int64_t start = m[kStart], numel = m[kNumel], block = m[kBlock];
  const bool four = m[kBits] == 4;
  const uint32_t key = static_cast<uint32_t>(m[kStepKey]);
  const int pt = static_cast<int>(m[kPDtype]), gt = static_cast<int>(m[kGDtype]);

  float* levels = s_levels[team];
  float* mids = s_mids[team];
  for (int k = lane; k < n_levels; k += T) {
    levels[k] = reinterpret_cast<const float*>(m[kLevels])[k];
    if (k < n_levels - 1) mids[k] = reinterpret_cast<const float*>(m[kMids])[k];
  }
  if constexpr (T == 32) __syncwarp(); else __syncthreads();

  const int64_t j = item - prefix[s];
  const int64_t b0 = start / block;
  const int64_t lo = max((b0 + j) * block, start) - start;
  const int64_t hi = min((b0 + j + 1) * block, start + numel) - start;

  double acc = 0.0;
  for (int64_t i = lo + lane; i < hi; i += T) {
    const double x = load(g, i, gt);
    acc += x * x;
  }
  const double total = team_sum<T>(acc, s_sum);
  const float mean = static_cast<float>(total / static_cast<double>(hi - lo));
  const float vj = __fadd_rn(__fmul_rn(v[j], h[kBeta2]), __fmul_rn(h[kA2], mean));
  const float sv = sqrtf(vj);
  const float denom = __fadd_rn(__fdiv_rn(sv, h[kBc2]), h[kEps]);
  const float old = absmax[j];
  const float w = h[kW], decay = h[kDecay], neg_step = h[kNegStep];
  // reference.cross_factor: the element's denominator is sqrt(v) * fac[position] + eps
  const float* fac = reinterpret_cast<const float*>(m[kFactor]);
  const int64_t pos = fac ? (start + lo) % block - lo : 0;

  float amax = 0.0f;
  for (int64_t i = lo + lane; i < hi; i += T) {
    float mi = __fmul_rn(levels[get_code(codes, i, four)], old);
    mi = lerp(mi, load(g, i, gt), w);
    const float pi = __fmul_rn(load(p, i, pt), decay);
    const float d = fac ? __fadd_rn(__fmul_rn(sv, fac[pos + i]), h[kEps]) : denom;
    store(p, i, __fadd_rn(pi, __fmul_rn(neg_step, __fdiv_rn(mi, d))), pt);
    amax = fmaxf(amax, fabsf(mi));
  }
  amax = team_max<T>(amax, s_max);
  const float scale = amax > 0.0f ? amax : 1.0f;
  const int n_mids = n_levels - 1;

  if (!four) {
    for (int64_t i = lo + lane; i < hi; i += T) {
      float mi = __fmul_rn(levels[codes[i]], old);
      mi = lerp(mi, load(g, i, gt), w);
      codes[i] = static_cast<uint8_t>(nearest(__fdiv_rn(mi, scale), mids, n_mids));
    }
  } else {
    // bytes [lo / 2, (hi + 1) / 2): a lane per byte, both nibbles from the same lane
    for (int64_t q = (lo >> 1) + lane; q < ((hi + 1) >> 1); q += T) {
      const int byte = codes[q];
      int out = byte;
      bool mine[2];
      for (int half = 0; half < 2; ++half) {
        const int64_t i = 2 * q + half;
        mine[half] = i >= lo && i < hi;
        if (!mine[half]) continue;
        const int c = half ? (byte >> 4) : (byte & 15);
        float mi = __fmul_rn(levels[c], old);
        mi = lerp(mi, load(g, i, gt), w);
        const int k = stochastic(__fdiv_rn(mi, scale), levels, start + i, key);
        out = half ? ((out & 15) | (k << 4)) : ((out & 240) | k);
      }
      // the other nibble belongs to another block of this segment (not padding): share the byte
      const bool shared_lo = !mine[0] && 2 * q >= 0 && 2 * q < numel;
      const bool shared_hi = !mine[1] && 2 * q + 1 < numel;
      if (shared_lo || shared_hi) {
        if (mine[0]) put_nibble_atomic(codes + q, out & 15, false);
        if (mine[1]) put_nibble_atomic(codes + q, out >> 4, true);
      } else {
        codes[q] = static_cast<uint8_t>(out);
      }
    }
  }
  if (lane == 0) {
    v[j] = vj;
    absmax[j] = amax;
  }
}

__global__ void __launch_bounds__(kThreads) dense_kernel(const int64_t* __restrict__ meta,
                                                         const float* __restrict__ hyp,
                                                         const int64_t* __restrict__ prefix,
                                                         int n_seg) {
  const int64_t tile = blockIdx.x;
  const int s = find_segment(prefix, n_seg, tile);
  const int64_t* m = meta + static_cast<int64_t>(s) * kMetaCols;
  const float* h = hyp + static_cast<int64_t>(s) * kHypCols;
  void* p = reinterpret_cast<void*>(m[kP]);
  const void* g = reinterpret_cast<const void*>(m[kG]);
  uint16_t* ea = reinterpret_cast<uint16_t*>(m[kExpAvg]);  // bf16 bits (reference.dense_update)
  uint16_t* es = reinterpret_cast<uint16_t*>(m[kExpAvgSq]);
  const int64_t start = m[kStart];
  const uint32_t key = static_cast<uint32_t>(m[kStepKey]);
  const int pt = static_cast<int>(m[kPDtype]), gt = static_cast<int>(m[kGDtype]);
  const int64_t lo = (tile - prefix[s]) * kDenseTile;
  const int64_t hi = min(lo + kDenseTile, m[kNumel]);
  for (int64_t i = lo + threadIdx.x; i < hi; i += kThreads) {
    const float gi = load(g, i, gt);
    const float pi = __fmul_rn(load(p, i, pt), h[kDecay]);
    const float mi = lerp(bf16_bits_to_float(ea[i]), gi, h[kW]);
    const float vi = __fadd_rn(__fmul_rn(bf16_bits_to_float(es[i]), h[kBeta2]),
                               __fmul_rn(__fmul_rn(h[kA2], gi), gi));
    const uint32_t r = mix32(static_cast<uint32_t>(start + i) ^ key);
    ea[i] = bf16_stochastic(mi, r & 0xffffu);
    es[i] = bf16_stochastic(vi, r >> 16);
    const float denom = __fadd_rn(__fdiv_rn(sqrtf(vi), h[kBc2]), h[kEps]);
    store(p, i, __fadd_rn(pi, __fmul_rn(h[kNegStep], __fdiv_rn(mi, denom))), pt);
  }
}

// One thread block per Gefen block; a shared-memory histogram flushed once per thread block.
__global__ void __launch_bounds__(kThreads) histogram_kernel(const void* __restrict__ g, int gt,
                                                             int64_t start, int64_t numel,
                                                             int64_t block, float head_amax,
                                                             float tail_amax,
                                                             unsigned long long* counts,
                                                             int bins) {
  extern __shared__ unsigned int s_hist[];
  __shared__ float s_max[kThreads / 32];
  for (int k = threadIdx.x; k < bins; k += kThreads) s_hist[k] = 0;
  const int64_t j = blockIdx.x;
  const int64_t nb = gridDim.x;
  const int64_t b0 = start / block;
  const int64_t lo = max((b0 + j) * block, start) - start;
  const int64_t hi = min((b0 + j + 1) * block, start + numel) - start;
  float amax = 0.0f;
  for (int64_t i = lo + threadIdx.x; i < hi; i += kThreads) amax = fmaxf(amax, fabsf(load(g, i, gt)));
  amax = team_max<kThreads>(amax, s_max);
  const bool cut = (hi - lo) < block;
  if (cut && j == 0 && head_amax >= 0.0f) amax = head_amax;
  else if (cut && j == nb - 1 && tail_amax >= 0.0f) amax = tail_amax;
  __syncthreads();
  if (amax > 0.0f) {
    const double half = static_cast<double>(bins) / 2.0;
    for (int64_t i = lo + threadIdx.x; i < hi; i += kThreads) {
      const float x = __fdiv_rn(load(g, i, gt), amax);
      long long b = static_cast<long long>(floor((static_cast<double>(x) + 1.0) * half));
      b = b < 0 ? 0 : (b >= bins ? bins - 1 : b);
      atomicAdd(&s_hist[b], 1u);
    }
  }
  __syncthreads();
  for (int k = threadIdx.x; k < bins; k += kThreads)
    if (s_hist[k]) atomicAdd(&counts[k], static_cast<unsigned long long>(s_hist[k]));
}

// Column segments (block size -P): the segment's element e belongs to block k = e mod P. A
// column's v and new absmax need all of its rows before any element can be written, so a step is
// three launches: partial sums and maxima over chunks of rows (a thread per column and chunk,
// consecutive threads on consecutive columns, so reads coalesce), their fixed-order reduction
// per column (deterministic, unlike atomics), then an elementwise pass (8-bit: a thread per
// element; 4-bit: a thread per byte, both nibbles) that recomputes m, moves the parameter and
// writes the codes; the new absmax is copied over the old one last.
struct ColumnRow {
  void* p;
  const void* g;
  uint8_t* codes;
  float* absmax;
  float* v;
  const float* levels;
  const float* mids;
  const float* fac;  // reference.cross_factor per row of the tensor, or null
  int64_t start, numel, period;
  int n_levels, pt, gt;
  bool four;
  uint32_t key;
};

__device__ __forceinline__ ColumnRow column_row(const int64_t* m) {
  ColumnRow r;
  r.p = reinterpret_cast<void*>(m[kP]);
  r.g = reinterpret_cast<const void*>(m[kG]);
  r.codes = reinterpret_cast<uint8_t*>(m[kCodes]);
  r.absmax = reinterpret_cast<float*>(m[kAbsmax]);
  r.v = reinterpret_cast<float*>(m[kV]);
  r.levels = reinterpret_cast<const float*>(m[kLevels]);
  r.mids = reinterpret_cast<const float*>(m[kMids]);
  r.fac = reinterpret_cast<const float*>(m[kFactor]);
  r.start = m[kStart];
  r.key = static_cast<uint32_t>(m[kStepKey]);
  r.numel = m[kNumel];
  r.period = -m[kBlock];
  r.n_levels = static_cast<int>(m[kNLevels]);
  r.pt = static_cast<int>(m[kPDtype]);
  r.gt = static_cast<int>(m[kGDtype]);
  r.four = m[kBits] == 4;
  return r;
}

// A column segment's row of the table, for the thread block ``blockIdx.x`` of a launch whose
// ``prefix`` counts each segment's thread blocks; ``local`` is the block's index in its segment
struct ColumnItem {
  ColumnRow r;
  const float* h;
  const int64_t* aux;
  int64_t local, nb;
};

__device__ __forceinline__ ColumnItem column_item(const int64_t* meta, const float* hyp,
                                                  const int64_t* aux, const int64_t* prefix,
                                                  int n_seg) {
  const int s = find_segment(prefix, n_seg, blockIdx.x);
  ColumnItem c;
  c.r = column_row(meta + static_cast<int64_t>(s) * kMetaCols);
  c.h = hyp + static_cast<int64_t>(s) * kHypCols;
  c.aux = aux + static_cast<int64_t>(s) * kCAuxCols;
  c.local = blockIdx.x - prefix[s];
  c.nb = min(c.r.numel, c.r.period);
  return c;
}

__global__ void __launch_bounds__(kThreads) columns_reduce_kernel(
    const int64_t* __restrict__ meta, const float* __restrict__ hyp,
    const int64_t* __restrict__ aux, const int64_t* __restrict__ prefix, int n_seg,
    double* __restrict__ part_sum, float* __restrict__ part_max) {
  __shared__ float s_levels[kMaxLevels];
  const ColumnItem c = column_item(meta, hyp, aux, prefix, n_seg);
  const ColumnRow& r = c.r;
  for (int k = threadIdx.x; k < r.n_levels; k += kThreads) s_levels[k] = r.levels[k];
  __syncthreads();
  const int64_t tiles = (c.nb + kThreads - 1) / kThreads, chunk = c.local / tiles;
  const int64_t k = (c.local % tiles) * kThreads + threadIdx.x;
  if (k >= c.nb) return;
  const float old = r.absmax[k], w = c.h[kW];
  double acc = 0.0;
  float amax = 0.0f;
  const int64_t r0 = chunk * c.aux[kCPer];
  for (int64_t row = r0; row < r0 + c.aux[kCPer]; ++row) {
    const int64_t e = row * r.period + k;
    if (e >= r.numel) break;
    const float gi = load(r.g, e, r.gt);
    const double x = gi;
    acc += x * x;
    const float mi = lerp(__fmul_rn(s_levels[get_code(r.codes, e, r.four)], old), gi, w);
    amax = fmaxf(amax, fabsf(mi));
  }
  part_sum[c.aux[kCPart] + chunk * c.nb + k] = acc;
  part_max[c.aux[kCPart] + chunk * c.nb + k] = amax;
}

__global__ void __launch_bounds__(kThreads) columns_finish_kernel(
    const int64_t* __restrict__ meta, const float* __restrict__ hyp,
    const int64_t* __restrict__ aux, const int64_t* __restrict__ prefix, int n_seg,
    const double* __restrict__ part_sum, const float* __restrict__ part_max,
    float* __restrict__ denom, float* __restrict__ amax_new) {
  const ColumnItem c = column_item(meta, hyp, aux, prefix, n_seg);
  const ColumnRow& r = c.r;
  const int64_t k = c.local * kThreads + threadIdx.x;
  if (k >= c.nb) return;
  double total = 0.0;
  float amax = 0.0f;
  for (int64_t q = 0; q < c.aux[kCChunks]; ++q) {
    total += part_sum[c.aux[kCPart] + q * c.nb + k];
    amax = fmaxf(amax, part_max[c.aux[kCPart] + q * c.nb + k]);
  }
  const int64_t count = r.numel / r.period + (k < r.numel % r.period ? 1 : 0);
  const float mean = static_cast<float>(total / static_cast<double>(count));
  const float vk = __fadd_rn(__fmul_rn(r.v[k], c.h[kBeta2]), __fmul_rn(c.h[kA2], mean));
  r.v[k] = vk;
  const float sv = sqrtf(vk);  // factored: sqrt(v) here, the row's factor in column_element
  denom[c.aux[kCCol] + k] = r.fac ? sv : __fadd_rn(__fdiv_rn(sv, c.h[kBc2]), c.h[kEps]);
  amax_new[c.aux[kCCol] + k] = amax;
}

// ``denom`` and ``amax_new`` are the segment's own (from kCCol)
__device__ __forceinline__ int column_element(const ColumnRow& r, const float* hyp,
                                              const float* levels, const float* mids,
                                              const float* denom, const float* amax_new,
                                              int64_t e, int code) {
  const int64_t k = e % r.period;
  const float mi = lerp(__fmul_rn(levels[code], r.absmax[k]), load(r.g, e, r.gt), hyp[kW]);
  const float pi = __fmul_rn(load(r.p, e, r.pt), hyp[kDecay]);
  const float d =
      r.fac ? __fadd_rn(__fmul_rn(denom[k], r.fac[(r.start + e) / r.period]), hyp[kEps])
            : denom[k];
  store(r.p, e, __fadd_rn(pi, __fmul_rn(hyp[kNegStep], __fdiv_rn(mi, d))), r.pt);
  const float scale = amax_new[k] > 0.0f ? amax_new[k] : 1.0f;
  const float x = __fdiv_rn(mi, scale);
  return r.four ? stochastic(x, levels, r.start + e, r.key) : nearest(x, mids, r.n_levels - 1);
}

__global__ void __launch_bounds__(kThreads) columns_apply_kernel(
    const int64_t* __restrict__ meta, const float* __restrict__ hyp,
    const int64_t* __restrict__ aux, const int64_t* __restrict__ prefix, int n_seg,
    const float* __restrict__ denom_all, const float* __restrict__ amax_all) {
  __shared__ float s_levels[kMaxLevels];
  __shared__ float s_mids[kMaxLevels];
  const ColumnItem c = column_item(meta, hyp, aux, prefix, n_seg);
  const ColumnRow& r = c.r;
  for (int k = threadIdx.x; k < r.n_levels; k += kThreads) {
    s_levels[k] = r.levels[k];
    if (k < r.n_levels - 1) s_mids[k] = r.mids[k];
  }
  __syncthreads();
  const float* denom = denom_all + c.aux[kCCol];
  const float* amax_new = amax_all + c.aux[kCCol];
  const int64_t u = c.local * kThreads + threadIdx.x;
  if (!r.four) {
    if (u < r.numel)
      r.codes[u] = static_cast<uint8_t>(
          column_element(r, c.h, s_levels, s_mids, denom, amax_new, u, r.codes[u]));
    return;
  }
  if (u >= (r.numel + 1) / 2) return;
  const int byte = r.codes[u];
  int out = byte;
  for (int half = 0; half < 2; ++half) {
    const int64_t e = 2 * u + half;
    if (e >= r.numel) continue;  // the pad nibble of an odd-length segment stays as it is
    const int code = half ? (byte >> 4) : (byte & 15);
    const int k = column_element(r, c.h, s_levels, s_mids, denom, amax_new, e, code);
    out = half ? ((out & 15) | (k << 4)) : ((out & 240) | k);
  }
  r.codes[u] = static_cast<uint8_t>(out);
}

// The new absmax over the old, once every element has been coded with the old
__global__ void __launch_bounds__(kThreads) columns_commit_kernel(
    const int64_t* __restrict__ meta, const float* __restrict__ hyp,
    const int64_t* __restrict__ aux, const int64_t* __restrict__ prefix, int n_seg,
    const float* __restrict__ amax_new) {
  const ColumnItem c = column_item(meta, hyp, aux, prefix, n_seg);
  const int64_t k = c.local * kThreads + threadIdx.x;
  if (k < c.nb) c.r.absmax[k] = amax_new[c.aux[kCCol] + k];
}

// The factor's pass (reference.cross_sums / cross_factor) for every factored segment of a step.
// Contiguous blocks of B: entry j sums g^2 over the piece's elements at position j of their
// tensor row. A thread per position and chunk of the piece's tensor rows (consecutive threads
// on consecutive positions, so reads coalesce) writes a partial sum; cross_finish_kernel adds a
// position's partials in chunk order, so the sums do not depend on scheduling.
__device__ __forceinline__ int64_t cross_rows(const int64_t* m, int64_t* first) {
  const int64_t width = m[kXBlock], start = m[kXStart];
  *first = start / width;
  return (start + m[kXNumel] - 1) / width - *first + 1;
}

__global__ void __launch_bounds__(kThreads) cross_rows_kernel(const int64_t* __restrict__ meta,
                                                              const int64_t* __restrict__ prefix,
                                                              int n_seg, double* __restrict__ part) {
  const int s = find_segment(prefix, n_seg, blockIdx.x);
  const int64_t* m = meta + static_cast<int64_t>(s) * kXCols;
  const int64_t width = m[kXBlock], start = m[kXStart], numel = m[kXNumel];
  const int64_t tiles = (width + kThreads - 1) / kThreads, local = blockIdx.x - prefix[s];
  const int64_t chunk = local / tiles, j = (local % tiles) * kThreads + threadIdx.x;
  if (j >= width) return;
  int64_t first;
  const int64_t rows = cross_rows(m, &first), chunks = m[kXChunks];
  const int64_t per = (rows + chunks - 1) / chunks;
  const int64_t r0 = first + chunk * per, r1 = min(r0 + per, first + rows);
  const void* g = reinterpret_cast<const void*>(m[kXG]);
  const int gt = static_cast<int>(m[kXGDtype]);
  double acc = 0.0;
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t i = r * width + j - start;
    if (i >= 0 && i < numel) {
      const double x = load(g, i, gt);
      acc += x * x;
    }
  }
  part[m[kXPart] + chunk * width + j] = acc;
}

__global__ void __launch_bounds__(kThreads) cross_finish_kernel(
    const int64_t* __restrict__ meta, const int64_t* __restrict__ prefix, int n_seg,
    int64_t n_items, const double* __restrict__ part) {
  const int64_t item = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (item >= n_items) return;
  const int s = find_segment(prefix, n_seg, item);
  const int64_t* m = meta + static_cast<int64_t>(s) * kXCols;
  const int64_t width = m[kXBlock], start = m[kXStart], end = start + m[kXNumel];
  const int64_t j = item - prefix[s], chunks = m[kXChunks];
  const double* pj = part + m[kXPart] + j;
  double total = 0.0;
  for (int64_t c = 0; c < chunks; ++c) total += pj[c * width];
  // the piece's elements at position j: from the first at or after start, one per row
  const int64_t e0 = start + ((j - start % width) % width + width) % width;
  reinterpret_cast<double*>(m[kXSums])[j] = total;
  reinterpret_cast<double*>(m[kXCounts])[j] =
      e0 < end ? static_cast<double>(1 + (end - 1 - e0) / width) : 0.0;
}

// Column blocks of P: entry r sums g^2 over the piece's elements of tensor row r, a warp per row
// (lanes stride over it, then a fixed shuffle tree).
__global__ void __launch_bounds__(kThreads) cross_cols_kernel(const int64_t* __restrict__ meta,
                                                              const int64_t* __restrict__ prefix,
                                                              int n_seg, int64_t n_items) {
  const int64_t item = static_cast<int64_t>(blockIdx.x) * (kThreads / 32) + threadIdx.x / 32;
  if (item >= n_items) return;  // uniform over a warp
  const int lane = threadIdx.x % 32;
  const int s = find_segment(prefix, n_seg, item);
  const int64_t* m = meta + static_cast<int64_t>(s) * kXCols;
  const int64_t period = -m[kXBlock], start = m[kXStart], numel = m[kXNumel];
  const int64_t r = start / period + (item - prefix[s]);
  const int64_t lo = max(r * period, start) - start, hi = min((r + 1) * period, start + numel) - start;
  const void* g = reinterpret_cast<const void*>(m[kXG]);
  const int gt = static_cast<int>(m[kXGDtype]);
  double acc = 0.0;
  for (int64_t i = lo + lane; i < hi; i += 32) {
    const double x = load(g, i, gt);
    acc += x * x;
  }
  acc = team_sum<32>(acc, nullptr);
  if (lane == 0) {
    reinterpret_cast<double*>(m[kXSums])[r] = acc;
    reinterpret_cast<double*>(m[kXCounts])[r] = static_cast<double>(hi - lo);
  }
}

// reference.cross_factor of a tensor held whole, a thread block per segment, as the CPU
// kernel's gefen_cpu_cross_factor: the mean g^2 per entry folded into v_cross (an entry no
// element reached gets 0), mean(v_cross) summed in fp64, sqrt(max(v / mean, floor)) / bc2.
__global__ void __launch_bounds__(kThreads) cross_factor_kernel(const int64_t* __restrict__ meta,
                                                                const float* __restrict__ hyp) {
  __shared__ double s_sum[kThreads / 32];
  const int64_t* m = meta + static_cast<int64_t>(blockIdx.x) * kXCols;
  const float* h = hyp + static_cast<int64_t>(blockIdx.x) * kCrossHypCols;
  float* out = reinterpret_cast<float*>(m[kXOut]);
  if (out == nullptr) return;  // uniform over the thread block
  const double* sums = reinterpret_cast<const double*>(m[kXSums]);
  const double* counts = reinterpret_cast<const double*>(m[kXCounts]);
  float* v = reinterpret_cast<float*>(m[kXVCross]);
  const int64_t n = m[kXLength];
  // the factor from v_cross as the steps before left it, then the fold (reference.cross_factor)
  double acc = 0.0;
  for (int64_t i = threadIdx.x; i < n; i += kThreads) acc += v[i];
  const float before = static_cast<float>(team_sum<kThreads>(acc, s_sum) / static_cast<double>(n));
  const bool lagged = before > 0.0f;  // uniform over the thread block
  double folded = 0.0;
  for (int64_t i = threadIdx.x; i < n; i += kThreads) {
    const float vi = v[i];
    if (lagged) out[i] = __fdiv_rn(sqrtf(fmaxf(__fdiv_rn(vi, before), h[3])), h[2]);
    const float mean = counts[i] > 0.0 ? static_cast<float>(sums[i] / counts[i]) : 0.0f;
    const float nv = __fadd_rn(__fmul_rn(vi, h[0]), __fmul_rn(h[1], mean));
    v[i] = nv;
    folded += nv;
  }
  if (lagged) return;
  // v_cross was all zero (the first step): the factor from this step's fold
  float mean = static_cast<float>(team_sum<kThreads>(folded, s_sum) / static_cast<double>(n));
  if (!(mean > 0.0f)) mean = 1.0f;
  for (int64_t i = threadIdx.x; i < n; i += kThreads)
    out[i] = __fdiv_rn(sqrtf(fmaxf(__fdiv_rn(v[i], mean), h[3])), h[2]);
}

int64_t blocks_of(int64_t start, int64_t numel, int64_t block) {
  return numel ? (start + numel - 1) / block - start / block + 1 : 0;
}

}  // namespace

cudaError_t launch_blocks(const int64_t* meta, const float* hyp, const int64_t* prefix, int n_seg,
                          int64_t n_items, int team, cudaStream_t stream) {
  if (n_items == 0) return cudaSuccess;
  if (team == 32) {
    const int64_t grid = (n_items + kThreads / 32 - 1) / (kThreads / 32);
    blocks_kernel<32><<<static_cast<unsigned int>(grid), kThreads, 0, stream>>>(meta, hyp, prefix,
                                                                               n_seg, n_items);
  } else if (team == kThreads) {
    blocks_kernel<kThreads><<<static_cast<unsigned int>(n_items), kThreads, 0, stream>>>(
        meta, hyp, prefix, n_seg, n_items);
  } else {
    return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

cudaError_t launch_dense(const int64_t* meta, const float* hyp, const int64_t* prefix, int n_seg,
                         int64_t n_tiles, cudaStream_t stream) {
  if (n_tiles == 0) return cudaSuccess;
  dense_kernel<<<static_cast<unsigned int>(n_tiles), kThreads, 0, stream>>>(meta, hyp, prefix,
                                                                             n_seg);
  return cudaGetLastError();
}

cudaError_t launch_histogram(const void* g, int g_dtype, int64_t start, int64_t numel,
                             int64_t block, float head_amax, float tail_amax,
                             unsigned long long* counts, int bins, cudaStream_t stream) {
  const int64_t nb = blocks_of(start, numel, block);
  if (nb == 0) return cudaSuccess;
  const size_t shmem = static_cast<size_t>(bins) * sizeof(unsigned int);
  histogram_kernel<<<static_cast<unsigned int>(nb), kThreads, shmem, stream>>>(
      g, g_dtype, start, numel, block, head_amax, tail_amax, counts, bins);
  return cudaGetLastError();
}

cudaError_t launch_columns(const int64_t* meta, const float* hyp, const int64_t* aux, int n_seg,
                           const int64_t* reduce_prefix, int64_t reduce_blocks,
                           const int64_t* col_prefix, int64_t col_blocks,
                           const int64_t* unit_prefix, int64_t unit_blocks, double* part_sum,
                           float* part_max, float* denom, float* amax_new, cudaStream_t stream) {
  if (n_seg == 0) return cudaSuccess;
  if (reduce_blocks < 1 || col_blocks < 1 || unit_blocks < 1 || reduce_blocks > 0x7fffffff ||
      unit_blocks > 0x7fffffff)
    return cudaErrorInvalidValue;
  const auto grid = [](int64_t n) { return static_cast<unsigned int>(n); };
  columns_reduce_kernel<<<grid(reduce_blocks), kThreads, 0, stream>>>(meta, hyp, aux, reduce_prefix,
                                                                      n_seg, part_sum, part_max);
  columns_finish_kernel<<<grid(col_blocks), kThreads, 0, stream>>>(
      meta, hyp, aux, col_prefix, n_seg, part_sum, part_max, denom, amax_new);
  columns_apply_kernel<<<grid(unit_blocks), kThreads, 0, stream>>>(meta, hyp, aux, unit_prefix,
                                                                   n_seg, denom, amax_new);
  columns_commit_kernel<<<grid(col_blocks), kThreads, 0, stream>>>(meta, hyp, aux, col_prefix,
                                                                   n_seg, amax_new);
  return cudaGetLastError();
}

cudaError_t launch_cross(const int64_t* meta, const float* hyp, int n_seg, int n_rows_seg,
                         const int64_t* row_prefix, int64_t row_items, const int64_t* pos_prefix,
                         int64_t pos_items, const int64_t* col_prefix, int64_t col_items,
                         double* part, cudaStream_t stream) {
  if (n_seg == 0) return cudaSuccess;
  if (n_rows_seg < 0 || n_rows_seg > n_seg || row_items > 0x7fffffff) return cudaErrorInvalidValue;
  if (row_items > 0) {
    cross_rows_kernel<<<static_cast<unsigned int>(row_items), kThreads, 0, stream>>>(
        meta, row_prefix, n_rows_seg, part);
    cross_finish_kernel<<<static_cast<unsigned int>((pos_items + kThreads - 1) / kThreads),
                          kThreads, 0, stream>>>(meta, pos_prefix, n_rows_seg, pos_items, part);
  }
  const int n_col_seg = n_seg - n_rows_seg;
  if (col_items > 0) {
    const int64_t warps = kThreads / 32;
    cross_cols_kernel<<<static_cast<unsigned int>((col_items + warps - 1) / warps), kThreads, 0,
                        stream>>>(meta + static_cast<int64_t>(n_rows_seg) * kXCols, col_prefix,
                                  n_col_seg, col_items);
  }
  cross_factor_kernel<<<static_cast<unsigned int>(n_seg), kThreads, 0, stream>>>(meta, hyp);
  return cudaGetLastError();
}

}  // namespace gefen
