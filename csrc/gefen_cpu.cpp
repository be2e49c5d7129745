// Gefen's update on the CPU: every segment of a step in one call, blocks spread over OpenMP
// threads.
//
// The arithmetic is gefen_dist/reference.py's, in its fp32 order of operations, with stated
// differences: the block mean of g^2 is accumulated in double (torch sums fp32 in its own
// order), the overshoot rule's means in orders of their own (m^2 in fp32, the factor's square
// in double), and nothing else is reordered (built without -ffast-math and with
// -ffp-contract=off, so no FMA changes a rounding; -fno-math-errno only lets a loop's sqrt
// vectorise). Per block: one read of g for v, one pass that folds m and finds the new absmax and
// the sum of m^2, one that moves the parameter (the block still in cache), one pass that writes
// the codes; no temporaries. The loops run on typed restrict pointers with lerp's branch
// hoisted, so GCC vectorises them (AVX2 here).
//
// Plain C ABI (loaded with ctypes by gefen_dist/native_cpu.py), so the library builds in a
// second with the system compiler and does not depend on torch's C++ ABI.

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif
#ifdef __AVX2__
#include <immintrin.h>
#endif

// The tables' columns, named as gefen_dist/backends/segment_table.py names them, in the same order
// (each value is its column's index). Each list is written once, here, as an X-macro: it makes
// the enum and the names gefen_cpu_tables() gives Python, which tests/test_tables.py compares
// with segment_table's enums, so neither side can change alone.
#define GEFEN_DTYPE(X) X(F32) X(BF16) X(F16) X(BF16_SR)
#define GEFEN_META(X)                                                                      \
  X(P) X(G) X(CODES) X(ABSMAX) X(V) X(LEVELS) X(MIDS) X(START) X(NUMEL) X(BLOCK) X(BITS)  \
  X(P_DTYPE) X(G_DTYPE) X(EXP_AVG) X(EXP_AVG_SQ) X(N_LEVELS) X(STEP_KEY) X(FACTOR) X(V_CROSS)
#define GEFEN_HYP(X) \
  X(BETA1) X(W) X(BETA2) X(A2) X(DECAY) X(NEG_STEP) X(BC2) X(EPS) X(BC1) X(G_FLOOR)
#define GEFEN_CROSS(X)                                                                     \
  X(G) X(G_DTYPE) X(START) X(NUMEL) X(BLOCK) X(LENGTH) X(V) X(SUMS) X(COUNTS) X(V_CROSS)  \
  X(OUT) X(PART) X(CHUNKS)
#define GEFEN_CROSS_HYP(X) X(BETA2) X(A2) X(BC2) X(FLOOR)
#define GEFEN_TABLES(T)                                                                    \
  T(DType, GEFEN_DTYPE) T(Meta, GEFEN_META) T(Hyp, GEFEN_HYP) T(Cross, GEFEN_CROSS)        \
  T(CrossHyp, GEFEN_CROSS_HYP)

// Each table a namespace holding its columns (Meta::P, Cross::G) and their count (kCols), so that
// tables with a column of the same name (G, START, V_CROSS) do not collide, and a column still
// converts to the int that indexes a row.
#define GEFEN_MEMBER(name) name,
#define GEFEN_ENUM(table, columns)          \
  namespace table {                         \
  enum : int { columns(GEFEN_MEMBER) kCols }; \
  }
GEFEN_TABLES(GEFEN_ENUM)
#undef GEFEN_ENUM
#undef GEFEN_MEMBER

namespace {

// DType::BF16_SR: a bf16 parameter written with stochastic rounding (bf16_stochastic_round; never
// a g). The dtype codes are used unqualified throughout.
using namespace DType;

struct Hyper {
  float beta1, w, beta2, a2, decay, neg_step, bc2, eps, bc1, g_floor;
};

inline float bf16_to_f32(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// codes.round_bf16: the magnitude rounds up when its low 16 bits plus r (< 2^16) carry
inline uint16_t f32_to_bf16_stochastic(float f, uint32_t r) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // NaN
  return static_cast<uint16_t>((u + r) >> 16);
}

// round to nearest even, as torch: the same carry with r = 0x7fff, 0x8000 above an odd last bit
inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return f32_to_bf16_stochastic(f, 0x7fffu + ((u >> 16) & 1u));
}

inline uint32_t mix32(uint32_t x) {  // "lowbias32", as codes._mix32
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  return x ^ (x >> 16);
}

// codes.param_key from the step key: the parameter write's own stream of the counter hash
constexpr uint32_t kParamStream = 0x2545F491u;
inline uint32_t param_key(uint32_t key) { return mix32(key ^ kParamStream); }

// Element access by dtype, on typed pointers: loops over them vectorise, where a runtime dtype
// switch on void pointers kept GCC to scalar code (alias checks it could not prove).
template <int DT> struct Elem;
// ``put_at``: a parameter's write, element ``i`` of its tensor at a step of parameter key ``pk``
template <> struct Elem<F32> {
  using T = float;
  static float get(float x) { return x; }
  static float put(float x) { return x; }
  static float put_at(float x, uint32_t, uint32_t) { return x; }
};
template <> struct Elem<BF16> {
  using T = uint16_t;
  static float get(uint16_t x) { return bf16_to_f32(x); }
  static uint16_t put(float x) { return f32_to_bf16(x); }
  static uint16_t put_at(float x, uint32_t, uint32_t) { return f32_to_bf16(x); }
};
template <> struct Elem<F16> {
  using T = _Float16;
  static float get(_Float16 x) { return static_cast<float>(x); }
  static _Float16 put(float x) { return static_cast<_Float16>(x); }
  static _Float16 put_at(float x, uint32_t, uint32_t) { return static_cast<_Float16>(x); }
};
// codes.write_param: round_bf16 with r = codes.param_bits (the low 16 bits of the hash)
template <> struct Elem<BF16_SR> {
  using T = uint16_t;
  static float get(uint16_t x) { return bf16_to_f32(x); }
  static uint16_t put_at(float x, uint32_t i, uint32_t pk) {
    return f32_to_bf16_stochastic(x, mix32(i ^ pk) & 0xffffu);
  }
};

// torch's lerp: start + w * (end - start) for w < 0.5, else end - (end - start) * (1 - w); the
// branch is a template argument so loops carry none
template <bool kLow>
inline float lerp(float start, float end, float w, float w1) {
  return kLow ? start + w * (end - start) : end - (end - start) * w1;
}

inline int get_code(const uint8_t* codes, int64_t i, bool four) {
  if (!four) return codes[i];
  const int b = codes[i >> 1];
  return (i & 1) ? (b >> 4) : (b & 15);
}

inline void put_code(uint8_t* codes, int64_t i, int c, bool four) {
  if (!four) {
    codes[i] = static_cast<uint8_t>(c);
  } else if (i & 1) {
    codes[i >> 1] = static_cast<uint8_t>((codes[i >> 1] & 15) | (c << 4));
  } else {
    codes[i >> 1] = static_cast<uint8_t>((codes[i >> 1] & 240) | c);
  }
}

// v's step from a block's (or column's) fp64 sum of g^2 over n elements: v * beta2 + a2 * mean,
// the mean rounded to fp32 once; block_move, columns and cross_sums' fold all take it from here
inline float ema_mean_sq(float v, double sum, double n, float beta2, float a2) {
  return v * beta2 + a2 * static_cast<float>(sum / n);
}


#ifdef __AVX512F__
// 4 bits with AVX-512: the 16 levels fill one register, so a level is one permute, and the
// interior-level count (the number of lv[1..14] <= x) takes two rounds of three independent
// compares: against lv[4], lv[8], lv[12] for the group of four, then against the group's next
// three levels, fetched by permutes from ``search`` (the levels with +inf at 15). For sorted
// levels (state.check_loaded refuses unsorted ones) that is the count: same codes as a binary
// search, whose four dependent permute-compare steps left the loop waiting on their latency.
inline __m512i count16(__m512 search, __m512 x, __m512 l4, __m512 l8, __m512 l12) {
  const __m512i one = _mm512_set1_epi32(1), four = _mm512_set1_epi32(4);
  __m512i k = _mm512_maskz_mov_epi32(_mm512_cmp_ps_mask(l4, x, _CMP_LE_OQ), four);
  k = _mm512_mask_add_epi32(k, _mm512_cmp_ps_mask(l8, x, _CMP_LE_OQ), k, four);
  k = _mm512_mask_add_epi32(k, _mm512_cmp_ps_mask(l12, x, _CMP_LE_OQ), k, four);
  const __m512i k1 = _mm512_add_epi32(k, one), k2 = _mm512_add_epi32(k, _mm512_set1_epi32(2)),
                k3 = _mm512_add_epi32(k, _mm512_set1_epi32(3));
  const __mmask16 a = _mm512_cmp_ps_mask(_mm512_permutexvar_ps(k1, search), x, _CMP_LE_OQ);
  const __mmask16 b = _mm512_cmp_ps_mask(_mm512_permutexvar_ps(k2, search), x, _CMP_LE_OQ);
  const __mmask16 c = _mm512_cmp_ps_mask(_mm512_permutexvar_ps(k3, search), x, _CMP_LE_OQ);
  k = _mm512_mask_add_epi32(k, a, k, one);
  k = _mm512_mask_add_epi32(k, b, k, one);
  return _mm512_mask_add_epi32(k, c, k, one);
}
#endif

// At 4 bits, what decoding and coding a codebook's blocks read, built once per step (Prep) rather
// than per block: in a profile of the demo GPT's step (blocks of 256) the coding's setup took a
// sixth of its time.
//
// ``grid`` counts the interior levels at or below each of 128 equal cells of [-1, 1] (widened by
// kGridSlack on both sides), so with AVX-512 VBMI the level count of x is one byte permute of
// x's cell plus ``reach`` compares against the next levels, where reach is the most interior
// levels a widened cell holds: 8 operations per 16 elements where count16 takes 18, and the same
// count for any x in [-1, 1] or NaN (see levels4). reach is -1 where the grid cannot stand in.
constexpr int kGridCells = 128;
constexpr double kGridSlack = 0x1p-23;  // over the rounding of (x + 1) * 64: at most 2^-24
constexpr int kMaxReach = 3;
struct Levels4 {
  float pair[512];                  // byte b -> levels[b & 15], levels[b >> 4]
  float lv[16];                     // the levels
  float next[16];                   // lv[k + 1] (k <= 14)
  float search[16];                 // count16's: lv with +inf at 15
  float above[kMaxReach][16];       // lv[k + r + 1] where k + r + 1 <= 14, else +inf
  uint8_t grid[kGridCells];
  int reach;
};

// Levels4 for sorted levels (state.check_loaded refuses unsorted ones). Cell c is
// [-1 + c / 64, -1 + (c + 1) / 64). For x in [-1, 1] the computed cell c = min(floor(fl(x + 1) *
// 64), 127) holds x, or x lies within 2^-24 outside one of its edges (fl(x + 1) is exact below
// x = -0.5 and within 2^-24 above), so every interior level at or below the widened cell's left
// edge is <= x, every one above its right edge is > x, and the count is grid[c] plus the
// compares against the at most ``reach`` levels between.
// A NaN x reads cell 0 and compares false throughout, so it counts grid[0], which must be 0
// (count16 gives 0): the grid stands in only then, and for a reach of at most kMaxReach.
void levels4(const float* levels, Levels4& l) {
  for (int b = 0; b < 256; ++b) {
    l.pair[2 * b] = levels[b & 15];
    l.pair[2 * b + 1] = levels[b >> 4];
  }
  for (int k = 0; k < 16; ++k) {
    l.lv[k] = levels[k];
    l.next[k] = levels[std::min(k + 1, 15)];
    l.search[k] = k < 15 ? levels[k] : INFINITY;
    for (int r = 0; r < kMaxReach; ++r)
      l.above[r][k] = k + r + 1 <= 14 ? levels[k + r + 1] : INFINITY;
  }
  int reach = 0;
  for (int c = 0; c < kGridCells; ++c) {
    const double lo = -1.0 + c / 64.0 - kGridSlack, hi = -1.0 + (c + 1) / 64.0 + kGridSlack;
    int below = 0, inside = 0;
    for (int t = 1; t <= 14; ++t) {
      below += static_cast<double>(levels[t]) <= lo;
      inside += lo < static_cast<double>(levels[t]) && static_cast<double>(levels[t]) <= hi;
    }
    l.grid[c] = static_cast<uint8_t>(below);
    reach = std::max(reach, inside);
  }
  l.reach = reach <= kMaxReach && l.grid[0] == 0 ? reach : -1;
}

// 8 bits: the nearest level (the first midpoint >= x, ties to the lower level), from a grid of
// kCells8 equal cells over [-1, 1] built once per step for each codebook. ``pair`` holds, per
// cell, the midpoints below the cell's left edge widened by kGridSlack (``base``, low 32 bits)
// and the bits of mids[base] (high 32), and ``reach`` is the most midpoints a widened cell
// holds. For x in [-1, 1] the computed cell holds x or lies within 2^-24 of it (see levels4), so
// every midpoint before base is below x and every one past the next ``reach`` above it: the
// code is base plus how many of those ``reach`` are below x. At reach <= 1, one 8-byte load per
// element. A learned codebook's levels are the means of disjoint runs of its histogram's bins
// (codebook.py), so where every level has bins of its own its midpoints lie at least a bin
// (2 / 4096) apart, two cells here: reach 1. Other codebooks (one with levels the DP spread over
// empty bins, a loaded one, the tests' crowded ones) take ``reach`` compares against ``mids``,
// padded with reach + 1 infinities. A NaN x reads cell 0 and compares false: base[0],
// 0 for levels from -1 up, as the walk this replaced gave.
//
// Why not codes.code_table's answer for most cells and a walk from its start for the rest (the
// numba backend's way): in training many elements fall in a cell with a midpoint, and walking
// those one by one, on branches that mispredict, made the 8-bit step 2.9x
// (demo GPT) and 3.5x (100M set) as slow as this
// (research/results/step_speed/step_ab_grid8.json).
constexpr int kCells8 = 8192;
struct Levels8 {
  std::vector<int64_t> pair;
  std::vector<float> mids;
  int reach;
  uint8_t planes[4][256];  // byte k of each level's bits (decode's byte permutes)
};

void levels8(const float* levels, const float* mids, int n_mids, Levels8& l) {
  for (int c = 0; c < 256; ++c) {
    uint32_t bits;
    std::memcpy(&bits, levels + c, 4);
    for (int k = 0; k < 4; ++k) l.planes[k][c] = static_cast<uint8_t>(bits >> (8 * k));
  }
  l.pair.resize(kCells8);
  l.reach = 0;
  const double width = 2.0 / kCells8;
  std::vector<int32_t> base(kCells8);
  int b = 0;
  for (int c = 0; c < kCells8; ++c) {
    const double lo = -1.0 + c * width - kGridSlack, hi = -1.0 + (c + 1) * width + kGridSlack;
    while (b < n_mids && static_cast<double>(mids[b]) < lo) ++b;
    int inside = 0;
    while (b + inside < n_mids && static_cast<double>(mids[b + inside]) <= hi) ++inside;
    base[c] = b;
    l.reach = std::max(l.reach, inside);
  }
  l.mids.assign(mids, mids + n_mids);
  l.mids.resize(n_mids + l.reach + 1, INFINITY);
  for (int c = 0; c < kCells8; ++c) {
    uint32_t bits;
    std::memcpy(&bits, &l.mids[base[c]], 4);
    l.pair[c] = static_cast<int64_t>(static_cast<uint64_t>(bits) << 32 |
                                     static_cast<uint32_t>(base[c]));
  }
}

// The cell of x in [-1, 1] (NaN: 0)
inline int cell8(float x) {
  const int c = static_cast<int>((x + 1.0f) * static_cast<float>(kCells8 / 2));
  return std::min(std::max(c, 0), kCells8 - 1);
}

#ifdef __AVX2__
// levels[k] for eight k in [0, 16): the 16 levels live in two registers, low8 = levels[0..8)
// and high8 = levels[8..16); bit 3 of k picks the register
inline __m256 level16(__m256 low8, __m256 high8, __m256i k) {
  const __m256 a = _mm256_permutevar8x32_ps(low8, k), b = _mm256_permutevar8x32_ps(high8, k);
  return _mm256_blendv_ps(a, b, _mm256_castsi256_ps(_mm256_slli_epi32(k, 28)));
}
#endif

// The byte-plane decode's code order, so its unpacks leave the 64 floats in order: position
// 16 L + 4 q + r (lane L of unpack result q) takes element 16 q + 4 L + r
constexpr std::array<uint8_t, 64> decode8_order() {
  std::array<uint8_t, 64> order{};
  for (int L = 0; L < 4; ++L)
    for (int q = 0; q < 4; ++q)
      for (int r = 0; r < 4; ++r)
        order[16 * L + 4 * q + r] = static_cast<uint8_t>(16 * q + 4 * L + r);
  return order;
}
alignas(64) constexpr std::array<uint8_t, 64> kDecode8Order = decode8_order();

// The levels of elements [lo, hi) into buf[0, hi - lo). At 4 bits: with AVX2, eight nibbles at a
// time through two in-register 8-level permutes; otherwise a byte's two levels in one 8-byte load
// from ``l4->pair``. Both are cheaper than a table lookup (or a gather) per element. At 8 bits
// with VBMI and ``l8``: 64 codes at a time, each of a level's four bytes from its 256-byte plane
// (two two-register byte permutes and a blend on the code's top bit), the four planes then
// interleaved into floats by unpacks; 22 operations per 64 codes where the 16-lane float
// permutes take 18 per 16 (research/results/step_speed/kernel_ab_decode8.json: 0.90x the
// 100M set's 8-bit step, 0.91x the demo GPT's).
inline void decode(const uint8_t* codes, int64_t lo, int64_t hi, bool four, const float* levels,
                   const Levels4* l4, float* buf, const Levels8* l8 = nullptr) {
  if (!four) {
    const uint8_t* c = codes + lo;
    int64_t i = 0;
#ifdef __AVX512VBMI__
    if (l8) {  // 64 at a time: each byte of the levels' bits from 256-entry byte permutes
      __m512i t[4][4];
      for (int k = 0; k < 4; ++k)
        for (int q = 0; q < 4; ++q) t[k][q] = _mm512_loadu_si512(l8->planes[k] + 64 * q);
      const __m512i perm = _mm512_load_si512(kDecode8Order.data());
      for (; i + 64 <= hi - lo; i += 64) {
        const __m512i k = _mm512_permutexvar_epi8(perm, _mm512_loadu_si512(c + i));
        const __mmask64 top = _mm512_movepi8_mask(k);
        __m512i b[4];
        for (int q = 0; q < 4; ++q)
          b[q] = _mm512_mask_blend_epi8(top, _mm512_permutex2var_epi8(t[q][0], k, t[q][1]),
                                        _mm512_permutex2var_epi8(t[q][2], k, t[q][3]));
        const __m512i l01 = _mm512_unpacklo_epi8(b[0], b[1]);
        const __m512i h01 = _mm512_unpackhi_epi8(b[0], b[1]);
        const __m512i l23 = _mm512_unpacklo_epi8(b[2], b[3]);
        const __m512i h23 = _mm512_unpackhi_epi8(b[2], b[3]);
        _mm512_storeu_si512(buf + i, _mm512_unpacklo_epi16(l01, l23));
        _mm512_storeu_si512(buf + i + 16, _mm512_unpackhi_epi16(l01, l23));
        _mm512_storeu_si512(buf + i + 32, _mm512_unpacklo_epi16(h01, h23));
        _mm512_storeu_si512(buf + i + 48, _mm512_unpackhi_epi16(h01, h23));
      }
    }
#endif
#ifdef __AVX512F__
    // 256 levels in 16 registers: eight two-register permutes on the code's low 5 bits, then
    // blends on bits 5, 6 and 7; no gather
    __m512 t[16];
    for (int r = 0; r < 16; ++r) t[r] = _mm512_loadu_ps(levels + 16 * r);
    for (; i + 16 <= hi - lo; i += 16) {
      const __m512i k =
          _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c + i)));
      __m512 r[8];
      for (int q = 0; q < 8; ++q) r[q] = _mm512_permutex2var_ps(t[2 * q], k, t[2 * q + 1]);
      const __mmask16 b5 = _mm512_test_epi32_mask(k, _mm512_set1_epi32(32));
      const __mmask16 b6 = _mm512_test_epi32_mask(k, _mm512_set1_epi32(64));
      const __mmask16 b7 = _mm512_test_epi32_mask(k, _mm512_set1_epi32(128));
      const __m512 a0 = _mm512_mask_blend_ps(b5, r[0], r[1]);
      const __m512 a1 = _mm512_mask_blend_ps(b5, r[2], r[3]);
      const __m512 a2 = _mm512_mask_blend_ps(b5, r[4], r[5]);
      const __m512 a3 = _mm512_mask_blend_ps(b5, r[6], r[7]);
      const __m512 b0 = _mm512_mask_blend_ps(b6, a0, a1), b1 = _mm512_mask_blend_ps(b6, a2, a3);
      _mm512_storeu_ps(buf + i, _mm512_mask_blend_ps(b7, b0, b1));
    }
#endif
    for (; i < hi - lo; ++i) buf[i] = levels[c[i]];
    return;
  }
  int64_t i = lo;
  if (i & 1) buf[0] = levels[get_code(codes, i++, true)];
  const uint8_t* c = codes + (i >> 1);
  const int64_t pairs = (hi - i) / 2;
  float* out = buf + (i - lo);
  int64_t q = 0;
#ifdef __AVX512F__
  {  // 8 bytes -> each byte twice -> 16 lanes -> shifted so the lane's nibble is its low 4 bits,
     // all a 16-entry permute reads of its index
    const __m512 lv16 = _mm512_loadu_ps(levels);
    const __m512i shifts = _mm512_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4);
    for (; q + 8 <= pairs; q += 8) {
      const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(c + q));
      const __m512i k = _mm512_srlv_epi32(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(b, b)), shifts);
      _mm512_storeu_ps(out + 2 * q, _mm512_permutexvar_ps(k, lv16));
    }
  }
#endif
#ifdef __AVX2__
  // 4 bytes -> 8 nibbles (lane l: bits 4l..4l+3) -> levels through two 8-entry permutes
  const __m256 low8 = _mm256_loadu_ps(levels), high8 = _mm256_loadu_ps(levels + 8);
  const __m256i shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
  const __m256i nibble = _mm256_set1_epi32(15);
  for (; q + 4 <= pairs; q += 4) {
    int32_t word;
    std::memcpy(&word, c + q, 4);
    const __m256i k = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(word), shifts), nibble);
    _mm256_storeu_ps(out + 2 * q, level16(low8, high8, k));
  }
#endif
  for (; q < pairs; ++q) std::memcpy(out + 2 * q, l4->pair + 2 * c[q], 8);
  i += 2 * pairs;
  if (i < hi) buf[i - lo] = levels[get_code(codes, i, true)];
}

// Codes idx[0, hi - lo) of elements [lo, hi); a nibble whose byte-mate lies outside is merged.
inline void encode(uint8_t* codes, int64_t lo, int64_t hi, bool four, const int32_t* idx) {
  if (!four) {
    uint8_t* c = codes + lo;
    for (int64_t i = 0; i < hi - lo; ++i) c[i] = static_cast<uint8_t>(idx[i]);
    return;
  }
  int64_t i = lo;
  if (i & 1) put_code(codes, i++, idx[0], true);
  const int64_t pairs = (hi - i) / 2;
  uint8_t* __restrict c = codes + (i >> 1);
  const int32_t* __restrict k = idx + (i - lo);
#pragma omp simd
  for (int64_t q = 0; q < pairs; ++q) c[q] = static_cast<uint8_t>(k[2 * q] | (k[2 * q + 1] << 4));
  i += 2 * pairs;
  if (i < hi) put_code(codes, i, idx[i - lo], true);
}

// The next block's (or column row's) parameter and gradient, which requantize_range prefetches
// while it computes: the update loop before it waits on memory, requantize on arithmetic. A line
// of each per 16 elements, spread through the loop rather than issued at once before it
// (the burst was 7609be4: 0.79x / 0.90x its 4- / 8-bit 100M step,
// research/results/step_speed/kernel_ab_prefetch.json).
struct Prefetch {
  const char* p;
  int64_t p_bytes;
  const char* g;
  int64_t g_bytes;
  template <class P, class G>
  Prefetch(const P* p_next, const G* g_next, int64_t n)
      : p(reinterpret_cast<const char*>(p_next)),
        p_bytes(n * static_cast<int64_t>(sizeof(P))),
        g(reinterpret_cast<const char*>(g_next)),
        g_bytes(n * static_cast<int64_t>(sizeof(G))) {}
  void line(int64_t offset) const {  // the 64 bytes at ``offset`` of each, where it has them
    if (offset < p_bytes) __builtin_prefetch(p + offset, 1);
    if (offset < g_bytes) __builtin_prefetch(g + offset, 0);
  }
};

#ifdef __AVX512F__
// requantize_range's 4-bit codes sixteen at a time, the AVX2 loop's operations; the level count
// from the grid (kReach >= 0, Levels4) or count16 (kReach < 0). Returns how many it coded.
template <bool kPer, int kReach>
inline int64_t stochastic16(const float* __restrict buf, const float* __restrict scale,
                            float scale_one, int64_t n, const Levels4& l4, int64_t first,
                            uint32_t key, int32_t* __restrict idx, const Prefetch& next) {
  const __m512 lv16 = _mm512_loadu_ps(l4.lv), next16 = _mm512_loadu_ps(l4.next);
  const __m512 search = _mm512_loadu_ps(l4.search);
  const __m512 l4v = _mm512_set1_ps(l4.lv[4]), l8 = _mm512_set1_ps(l4.lv[8]),
               l12 = _mm512_set1_ps(l4.lv[12]);
  __m512 above[kMaxReach];
  for (int r = 0; r < kMaxReach; ++r) above[r] = _mm512_loadu_ps(l4.above[r]);
#ifdef __AVX512VBMI__
  const __m512i grid_lo = _mm512_loadu_si512(l4.grid), grid_hi = _mm512_loadu_si512(l4.grid + 64);
#endif
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i one = _mm512_set1_epi32(1), keys = _mm512_set1_epi32(static_cast<int32_t>(key));
  const __m512i c1 = _mm512_set1_epi32(0x7FEB352D), c2 = _mm512_set1_epi32(0x846CA68B);
  int64_t i0 = 0;
  for (; i0 + 16 <= n; i0 += 16) {
    next.line(i0 * 4);  // 16 fp32 elements: one 64-byte line
    const __m512 d = kPer ? _mm512_loadu_ps(scale + i0) : _mm512_set1_ps(scale_one);
    const __m512 x = _mm512_div_ps(_mm512_loadu_ps(buf + i0), d);
    const int32_t base = static_cast<int32_t>(static_cast<uint32_t>(first + i0));
    __m512i h = _mm512_xor_si512(_mm512_add_epi32(_mm512_set1_epi32(base), lane), keys);
    h = _mm512_xor_si512(h, _mm512_srli_epi32(h, 16));
    h = _mm512_mullo_epi32(h, c1);
    h = _mm512_xor_si512(h, _mm512_srli_epi32(h, 15));
    h = _mm512_mullo_epi32(h, c2);
    h = _mm512_xor_si512(h, _mm512_srli_epi32(h, 16));
    const __m512 u =
        _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(h, 8)), _mm512_set1_ps(0x1p-24f));
    __m512i k;
#ifdef __AVX512VBMI__
    if constexpr (kReach >= 0) {
      // the cell's count sits in each lane's low byte; the other bytes are zeroed
      const __m512i cell = _mm512_min_epi32(
          _mm512_cvttps_epi32(
              _mm512_mul_ps(_mm512_add_ps(x, _mm512_set1_ps(1.0f)), _mm512_set1_ps(64.0f))),
          _mm512_set1_epi32(kGridCells - 1));
      const __m512i k0 = _mm512_maskz_permutex2var_epi8(0x1111111111111111ULL, grid_lo, cell,
                                                         grid_hi);
      k = k0;
      for (int r = 0; r < kReach; ++r)
        k = _mm512_mask_add_epi32(
            k, _mm512_cmp_ps_mask(_mm512_permutexvar_ps(k0, above[r]), x, _CMP_LE_OQ), k, one);
    } else
#endif
      k = count16(search, x, l4v, l8, l12);
    const __m512 lo = _mm512_permutexvar_ps(k, lv16);
    const __m512 hi = _mm512_permutexvar_ps(k, next16);
    const __mmask16 up = _mm512_cmp_ps_mask(_mm512_mul_ps(u, _mm512_sub_ps(hi, lo)),
                                            _mm512_sub_ps(x, lo), _CMP_LT_OQ);
    _mm512_storeu_si512(idx + i0, _mm512_mask_add_epi32(k, up, k, one));
  }
  return i0;
}
#endif

// Codes of x[i] = buf[i] / scale[i] (kPer) or buf[i] / scale_one, element i being element
// first + i of its tensor. 4 bits: stochastic rounding, codes.stochastic_quantize with u =
// codes.uniforms(step, index) (``key`` = codes.step_key(step)); the two neighbouring levels
// come from in-register permutes with AVX2, else (and for the tail) from select chains over
// the 16 sorted levels, which vectorise where a gather would not pay. 8 bits: the nearest
// level, from ``l8`` (Levels8). While it computes, it prefetches ``next`` one line of each
// stream per 16 elements.
template <bool kPer>
inline void requantize_range(const float* __restrict buf, const float* __restrict scale,
                             float scale_one, int64_t n, bool four, const Levels8* l8,
                             int64_t first, uint32_t key, int32_t* __restrict idx,
                             const Prefetch& next, const Levels4* l4) {
  if (four) {
    const float* lv = l4->lv;
    int64_t i0 = 0;
#ifdef __AVX512F__
    auto sixteen = [&](auto reach) {
      return stochastic16<kPer, decltype(reach)::value>(buf, scale, scale_one, n, *l4, first, key,
                                                        idx, next);
    };
    switch (l4->reach) {
      case 0: i0 = sixteen(std::integral_constant<int, 0>()); break;
      case 1: i0 = sixteen(std::integral_constant<int, 1>()); break;
      case 2: i0 = sixteen(std::integral_constant<int, 2>()); break;
      case 3: i0 = sixteen(std::integral_constant<int, 3>()); break;
      default: i0 = sixteen(std::integral_constant<int, -1>());
    }
#endif
#ifdef __AVX2__
    // eight at a time: the same operations, with both neighbouring levels from two in-register
    // 8-level permutes instead of the select chains
    const __m256 low8 = _mm256_loadu_ps(lv), high8 = _mm256_loadu_ps(lv + 8);
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), one = _mm256_set1_epi32(1);
    const __m256i c1 = _mm256_set1_epi32(0x7FEB352D), c2 = _mm256_set1_epi32(0x846CA68B);
    const __m256i keys = _mm256_set1_epi32(static_cast<int32_t>(key));
    for (; i0 + 8 <= n; i0 += 8) {
      if ((i0 & 15) == 0) next.line(i0 * 4);
      const __m256 d = kPer ? _mm256_loadu_ps(scale + i0) : _mm256_set1_ps(scale_one);
      const __m256 x = _mm256_div_ps(_mm256_loadu_ps(buf + i0), d);
      const int32_t base = static_cast<int32_t>(static_cast<uint32_t>(first + i0));
      __m256i h = _mm256_xor_si256(_mm256_add_epi32(_mm256_set1_epi32(base), lane), keys);
      h = _mm256_xor_si256(h, _mm256_srli_epi32(h, 16));
      h = _mm256_mullo_epi32(h, c1);
      h = _mm256_xor_si256(h, _mm256_srli_epi32(h, 15));
      h = _mm256_mullo_epi32(h, c2);
      h = _mm256_xor_si256(h, _mm256_srli_epi32(h, 16));
      const __m256 u =
          _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(h, 8)), _mm256_set1_ps(0x1p-24f));
      __m256i k = _mm256_setzero_si256();
      for (int t = 1; t < 15; ++t)
        k = _mm256_sub_epi32(
            k, _mm256_castps_si256(_mm256_cmp_ps(_mm256_set1_ps(lv[t]), x, _CMP_LE_OQ)));
      const __m256 lo = level16(low8, high8, k);
      const __m256 hi = level16(low8, high8, _mm256_add_epi32(k, one));
      const __m256 up = _mm256_cmp_ps(_mm256_mul_ps(u, _mm256_sub_ps(hi, lo)),
                                      _mm256_sub_ps(x, lo), _CMP_LT_OQ);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(idx + i0),
                          _mm256_sub_epi32(k, _mm256_castps_si256(up)));
    }
#endif
#pragma omp simd
    for (int64_t i = i0; i < n; ++i) {
      const float x = buf[i] / (kPer ? scale[i] : scale_one);
      const uint32_t hsh = mix32(static_cast<uint32_t>(first + i) ^ key);
      const float u = static_cast<float>(hsh >> 8) * 0x1p-24f;
      int k = 0;
      float low = lv[0], high = lv[15];
#pragma GCC unroll 14
      for (int t = 1; t < 15; ++t) {
        const bool le = lv[t] <= x;
        k += le;
        low = le ? lv[t] : low;
      }
#pragma GCC unroll 14
      for (int t = 14; t >= 1; --t) high = lv[t] > x ? lv[t] : high;
      idx[i] = k + (u * (high - low) < x - low ? 1 : 0);
    }
    return;
  }
  const int64_t* __restrict pair = l8->pair.data();
  const float* __restrict mids = l8->mids.data();
  int64_t i0 = 0;
#ifdef __AVX512F__
  if (l8->reach <= 1) {  // two 8-lane gathers of the pairs: half the loads of base, then mids
    const __m512 one_f = _mm512_set1_ps(1.0f), half = _mm512_set1_ps(kCells8 / 2);
    const __m512i last = _mm512_set1_epi32(kCells8 - 1), zero = _mm512_setzero_si512();
    const __m512i one = _mm512_set1_epi32(1);
    const __m512i low = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28,
                                          30);
    const __m512i high = _mm512_add_epi32(low, one);
    const auto* table = reinterpret_cast<const long long*>(pair);
    for (; i0 + 16 <= n; i0 += 16) {
      next.line(i0 * 4);
      const __m512 d = kPer ? _mm512_loadu_ps(scale + i0) : _mm512_set1_ps(scale_one);
      const __m512 x = _mm512_div_ps(_mm512_loadu_ps(buf + i0), d);
      const __m512i c = _mm512_min_epi32(
          _mm512_max_epi32(_mm512_cvttps_epi32(_mm512_mul_ps(_mm512_add_ps(x, one_f), half)),
                           zero),
          last);
      const __m512i p0 = _mm512_i32gather_epi64(_mm512_castsi512_si256(c), table, 8);
      const __m512i p1 = _mm512_i32gather_epi64(_mm512_extracti32x8_epi32(c, 1), table, 8);
      const __m512i base = _mm512_permutex2var_epi32(p0, low, p1);
      const __m512 above = _mm512_castsi512_ps(_mm512_permutex2var_epi32(p0, high, p1));
      const __mmask16 up = _mm512_cmp_ps_mask(above, x, _CMP_LT_OQ);
      _mm512_storeu_si512(idx + i0, _mm512_mask_add_epi32(base, up, base, one));
    }
  }
#endif
  float x[64];
  int32_t k[64];
  for (int64_t c0 = i0; c0 < n; c0 += 64) {
    for (int64_t line = c0 * 4; line < c0 * 4 + 256; line += 64) next.line(line);
    const int64_t e = std::min<int64_t>(n - c0, 64);
#pragma omp simd
    for (int64_t i = 0; i < e; ++i) x[i] = buf[c0 + i] / (kPer ? scale[c0 + i] : scale_one);
    // the table loads (GCC gathers them) in loops of their own, as the code table's before
    // (research/results/step_speed/kernel_ab_lut_loads.json)
#pragma omp simd
    for (int64_t i = 0; i < e; ++i) k[i] = static_cast<int32_t>(pair[cell8(x[i])]);
    int32_t* __restrict out = idx + c0;
#pragma omp simd
    for (int64_t i = 0; i < e; ++i) out[i] = k[i];
    for (int r = 0; r < l8->reach; ++r)
#pragma omp simd
      for (int64_t i = 0; i < e; ++i) out[i] += mids[k[i] + r] < x[i] ? 1 : 0;
  }
}

// reference.block_keep: the share of a block's (or column's) v that is noise, 1 - mean(m_hat^2) /
// mean(s^2) clamped to [0, 1]; 0 where mean(s^2) is not above 0
inline float block_keep(float mean_m2, float mean_s2) {
  return mean_s2 > 0.0f ? std::max(0.0f, 1.0f - mean_m2 / mean_s2) : 0.0f;
}

// 1 / (1 - beta1^t)^2, which turns m^2 into m_hat^2: in double, from the row's fp32 1 - beta1^t
// (the reference's from its double; an ulp apart)
inline double inv_bc1_sq(const Hyper& h) {
  const double bc1 = h.bc1;
  return 1.0 / (bc1 * bc1);
}

// The mean of f^2 over n factor entries (fp64 sum)
inline float mean_sq(const float* f, int64_t n) {
  double s = 0.0;
  for (int64_t i = 0; i < n; ++i) s += static_cast<double>(f[i]) * f[i];
  return static_cast<float>(s / static_cast<double>(n));
}

// reference.denominator plus eps, for one element of shared denominator s: s, and where
// this step's g opposes m, at least sqrt(s^2 keep + m^2 ib2); everywhere at least AdamW's floor
// |g| g_floor (Hyper::g_floor: sqrt(1 - beta2) / sqrt(1 - beta2^t)). The split and the max are
// taken on every lane and the sign test only picks, so the loops around it vectorise: a max
// taken only where the test holds is a conditional compare, which GCC will not speculate (it
// may trap), and that kept them scalar. (The square root vectorises because the build has
// -fno-math-errno.)
inline float denominator(float s, float m, float g, float keep, float ib2, const Hyper& h) {
  const float split = std::sqrt(s * s * keep + ib2 * m * m);
  const float wide = std::max(s, split);
  return std::max(g * m < 0.0f ? wide : s, std::fabs(g) * h.g_floor) + h.eps;
}

// A block's loop 1: m = lerp(level * old, g) of its n elements, the levels read from buf and m
// written back; returns max |m| and adds the fp32 sum of m^2 into ``m2``
template <int GT, bool kLow>
inline float first_moment(float* __restrict buf, const typename Elem<GT>::T* __restrict g,
                          int64_t n, float old, const Hyper& h, float& m2) {
  const float w1 = 1.0f - h.w;
  float amax = 0.0f, sq = 0.0f;
#pragma omp simd reduction(max : amax) reduction(+ : sq)
  for (int64_t i = 0; i < n; ++i) {
    const float m = lerp<kLow>(buf[i] * old, Elem<GT>::get(g[i]), h.w, w1);
    buf[i] = m;
    amax = std::max(amax, std::fabs(m));
    sq += m * m;
  }
  m2 += sq;
  return amax;
}

// Loop 2: the parameter step of n elements from m in buf, with ``denominator`` for
// s = ``s``, or s * fac[i] with kFac (reference.cross_factor; ``s`` is then sqrt(v))
template <int PT, int GT, bool kFac>
inline void move(const float* __restrict buf, typename Elem<PT>::T* __restrict p,
                 const typename Elem<GT>::T* __restrict g, int64_t n, float s,
                 const float* __restrict fac, float keep, float ib2, const Hyper& h,
                 int64_t first, uint32_t pk) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float m = buf[i];
    const float pi = Elem<PT>::get(p[i]) * h.decay;
    const float d = denominator(kFac ? s * fac[i] : s, m, Elem<GT>::get(g[i]), keep, ib2, h);
    p[i] = Elem<PT>::put_at(pi + h.neg_step * (m / d), static_cast<uint32_t>(first + i), pk);
  }
}

#ifdef __AVX512F__
// first_moment() for fp32 g and 4-bit codes from an even element, decoding in the loop (decode's
// permute) so the levels never pass through buf; the same operations in the same order, m^2
// summed in sixteen lanes. The elements past the last sixteen go through decode and
// first_moment.
template <bool kLow>
inline float first_moment4(float* __restrict buf, const float* __restrict g,
                           const uint8_t* __restrict codes, int64_t n, float old, const Hyper& h,
                           const Levels4& l4, float& m2) {
  const __m512 lv16 = _mm512_loadu_ps(l4.lv);
  const __m512i shifts = _mm512_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4);
  const __m512 vold = _mm512_set1_ps(old), w = _mm512_set1_ps(h.w), w1 = _mm512_set1_ps(1.0f - h.w);
  __m512 amax = _mm512_setzero_ps(), sq = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + i / 2));
    const __m512i k = _mm512_srlv_epi32(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(b, b)), shifts);
    const __m512 start = _mm512_mul_ps(_mm512_permutexvar_ps(k, lv16), vold);
    const __m512 end = _mm512_loadu_ps(g + i), diff = _mm512_sub_ps(end, start);
    const __m512 m = kLow ? _mm512_add_ps(start, _mm512_mul_ps(w, diff))
                          : _mm512_sub_ps(end, _mm512_mul_ps(diff, w1));
    _mm512_storeu_ps(buf + i, m);
    amax = _mm512_max_ps(_mm512_abs_ps(m), amax);
    sq = _mm512_add_ps(sq, _mm512_mul_ps(m, m));
  }
  float a = _mm512_reduce_max_ps(amax);
  m2 += _mm512_reduce_add_ps(sq);
  if (i < n) {
    decode(codes, i, n, true, l4.lv, &l4, buf + i);
    a = std::max(a, first_moment<F32, kLow>(buf + i, g + i, n - i, old, h, m2));
  }
  return a;
}
#endif

// A block's m, parameter step and max |m| from its codes, in two loops over the block (in cache
// for the second): loop 1 (decode, then first_moment; first_moment4 where it can) leaves m in
// buf with max |m| and the sum of m^2, from which the block's keep (reference.block_keep) comes
// before any element steps; loop 2 (move) steps the parameter. ``s``: sqrt(v) / bc2, or with
// kFac sqrt(v), which the factor ``fac`` completes (``fac_sq``: its mean square over the
// block's elements).
template <int PT, int GT, bool kFac>
inline float update(float* buf, typename Elem<PT>::T* p, const typename Elem<GT>::T* g,
                    const uint8_t* codes, int64_t lo, int64_t hi, bool four, const float* levels,
                    const Levels4* l4, float old, float s, const float* fac, float fac_sq,
                    const Hyper& h, const Levels8* l8, int64_t first, uint32_t pk) {
  const int64_t n = hi - lo;
  float m2 = 0.0f, amax = 0.0f;
  bool done = false;
#ifdef __AVX512F__
  if constexpr (GT == F32) {
    if (four && !(lo & 1)) {
      const uint8_t* c = codes + lo / 2;
      amax = h.w < 0.5f ? first_moment4<true>(buf, g, c, n, old, h, *l4, m2)
                        : first_moment4<false>(buf, g, c, n, old, h, *l4, m2);
      done = true;
    }
  }
#endif
  if (!done) {
    decode(codes, lo, hi, four, levels, l4, buf, l8);
    amax = h.w < 0.5f ? first_moment<GT, true>(buf, g, n, old, h, m2)
                      : first_moment<GT, false>(buf, g, n, old, h, m2);
  }
  const double ib2 = inv_bc1_sq(h);
  const float mean_m2 = static_cast<float>(m2 / static_cast<double>(n) * ib2);
  const float keep = block_keep(mean_m2, kFac ? s * s * fac_sq : s * s);
  move<PT, GT, kFac>(buf, p, g, n, s, fac, keep, static_cast<float>(ib2), h, first, pk);
  return amax;
}

// reference.cross_factor's c from fp32 v_cross ``v`` (``n`` entries) into ``out`` as sqrt(max(v /
// mean(v), floor)) / bc2. Where mean(v) is not above 0: false, with nothing written, or with
// ``always`` the mean taken as 1 (v all zero: the floor's factor). mean(v) is summed in fp64 (the
// reference's torch.mean sums fp32 in its own order: the two agree to an ulp or so).
bool factor_from(const float* v, int64_t n, float bc2, float floor_c, float* out,
                 bool always = false) {
  double total = 0.0;
  for (int64_t i = 0; i < n; ++i) total += v[i];
  float mean = static_cast<float>(total / static_cast<double>(n));
  if (!(mean > 0.0f)) {
    if (!always) return false;
    mean = 1.0f;
  }
  for (int64_t i = 0; i < n; ++i) out[i] = std::sqrt(std::max(v[i] / mean, floor_c)) / bc2;
  return true;
}

// This step's mean g^2 per entry (fp64 ``sums`` over ``counts``; 0 where none) folded into v.
void fold_cross(const double* sums, const double* counts, int64_t n, float* v, float beta2,
                float a2) {
  for (int64_t i = 0; i < n; ++i) {
    const float mean = counts[i] > 0.0 ? static_cast<float>(sums[i] / counts[i]) : 0.0f;
    v[i] = v[i] * beta2 + a2 * mean;
  }
}

// reference.cross_factor whole: the factor from v as the steps before left it, then the fold;
// where v was all zero, the fold first and the factor from it
void factor_and_fold(const double* sums, const double* counts, int64_t n, float* v, float beta2,
                     float a2, float bc2, float floor_c, float* out) {
  const bool lagged = factor_from(v, n, bc2, floor_c, out);
  fold_cross(sums, counts, n, v, beta2, a2);
  if (!lagged) factor_from(v, n, bc2, floor_c, out, true);
}

// cross_sums' chunks of whole rows (blocks): at most 16, at least 32 rows each, by the shape
// alone, so the sums do not depend on the thread count; Sums takes the same ones
inline int64_t rows_per_chunk(int64_t whole) { return std::max<int64_t>(32, (whole + 15) / 16); }

// A tensor's sums of g^2 per v_cross position (contiguous blocks, the tensor held whole), taken
// in the update's own read of g rather than in a pass of their own: the chunks of
// cross_sums (a fixed number of whole blocks each, by the shape alone) and their partials, added
// in chunk order by whichever run finishes last, so the sums have cross_sums' bits whatever the
// thread count. A run takes whole chunks (gefen_cpu_step), so no two threads share a partial,
// and each partial lives from its chunk's first block to the fold, not for the whole step.
struct Sums {
  int64_t width, whole, tail, per, chunks;
  std::vector<std::vector<double>> part;  // per chunk: width; the tail block's last
  std::atomic<int> left{0};                // runs still to finish
  float* v_cross;
  float beta2, a2;
  Sums(int64_t numel, int64_t block, float* v, float b2, float one_minus_b2)
      : width(block), whole(numel / block), tail(numel % block),
        per(rows_per_chunk(whole)), chunks((whole + per - 1) / per),
        part(chunks + 1), v_cross(v), beta2(b2), a2(one_minus_b2) {}
  // the partial block j adds into (zeroed at the chunk's first block)
  double* acc(int64_t j) {
    std::vector<double>& a = part[j < whole ? j / per : chunks];
    if (a.empty()) a.assign(width, 0.0);
    return a.data();
  }
  // a run is done: the last one adds the partials in order, as cross_sums, and folds
  void done() {
    if (left.fetch_sub(1, std::memory_order_acq_rel) != 1) return;
    std::vector<double> sums(width, 0.0), counts(width, static_cast<double>(whole));
    for (int64_t c = 0; c < chunks; ++c)
      for (int64_t j = 0; j < width; ++j) sums[j] += part[c][j];
    for (int64_t j = 0; j < tail; ++j) {
      sums[j] += part[chunks][j];
      counts[j] += 1.0;
    }
    fold_cross(sums.data(), counts.data(), width, v_cross, beta2, a2);
    std::vector<std::vector<double>>().swap(part);
  }
};

// A segment's pointers and constants, read once from its table row
struct Segment {
  void* p;
  const void* g;
  uint8_t* codes;
  float* absmax;
  float* v;
  const float* levels;
  const Levels8* l8;
  int64_t start, numel, block;
  bool four, v_done;
  uint32_t key;
  Hyper h;
  const Levels4* l4;
  const float* fac;
  struct Sums* sums;  // this step's v_cross sums, taken in the update (contiguous blocks)
  float* fold;        // column blocks: the v_cross columns() folds the rows' sums into
  uint32_t pkey = 0;  // param_key(key): the parameter write's draws (BF16_SR)
  float fac_sq = 0.0f;  // contiguous blocks with ``fac``: the mean of fac^2 over a whole block
  // row block j's elements [lo, hi) of the piece; empty past its last block
  int64_t lo(int64_t j) const {
    return std::min(std::max((start / block + j) * block, start) - start, numel);
  }
  int64_t hi(int64_t j) const {
    return std::min((start / block + j + 1) * block, start + numel) - start;
  }
};

// A block's first half: v, the parameter step and the new absmax, its m into buf; returns the
// scale its codes take
template <int PT, int GT>
float block_move(const Segment& b, int64_t j, float* buf) {
  const int64_t lo = b.lo(j), hi = b.hi(j), n = hi - lo;
  auto* pb = static_cast<typename Elem<PT>::T*>(b.p) + lo;
  const auto* gb = static_cast<const typename Elem<GT>::T*>(b.g) + lo;
  const Hyper& h = b.h;
  float vj = b.v[j];
  if (!b.v_done) {  // else cross_sums folded this step's mean g^2 into v
    double s = 0.0;
    if (b.sums) {  // and the v_cross sums: lo is a multiple of the block, so position i is i
      double* __restrict acc = b.sums->acc(j);
#pragma omp simd reduction(+ : s)
      for (int64_t i = 0; i < n; ++i) {
        const double x = Elem<GT>::get(gb[i]);
        acc[i] += x * x;
        s += x * x;
      }
    } else {
#pragma omp simd reduction(+ : s)
      for (int64_t i = 0; i < n; ++i) {
        const double x = Elem<GT>::get(gb[i]);
        s += x * x;
      }
    }
    vj = ema_mean_sq(b.v[j], s, static_cast<double>(n), h.beta2, h.a2);
    b.v[j] = vj;
  }
  const float sv = std::sqrt(vj);
  const float old = b.absmax[j];
  const float* f = b.fac ? b.fac + (b.start + lo) % b.block : nullptr;
  // a piece's first and last blocks may be partial: their own mean of f^2
  const float amax =
      b.fac ? update<PT, GT, true>(buf, pb, gb, b.codes, lo, hi, b.four, b.levels, b.l4, old, sv,
                                   f, n == b.block ? b.fac_sq : mean_sq(f, n), h, b.l8,
                                   b.start + lo, b.pkey)
            : update<PT, GT, false>(buf, pb, gb, b.codes, lo, hi, b.four, b.levels, b.l4, old,
                                    sv / h.bc2, f, 0.0f, h, b.l8, b.start + lo, b.pkey);
  b.absmax[j] = amax;
  return amax > 0.0f ? amax : 1.0f;
}

// Blocks [j0, j1) of a segment, each block's coding after the next block's move: the coding
// waits on the block's absmax (a reduction, then a division), which the next move does not, so
// the two overlap; and a coding prefetches the block after the one just moved. ``buf`` and
// ``other`` hold the two blocks' m. Blocks share nothing but, at 4 bits, a byte where a boundary
// falls on an odd element: a move decodes its codes before the coding of the block before it
// writes their byte, and encode merges the nibble, so the same codes come out.
template <int PT, int GT>
void block_run(const Segment& b, int64_t j0, int64_t j1, float* buf, float* other,
               int32_t* idx) {
  float scale = block_move<PT, GT>(b, j0, buf);
  for (int64_t j = j0; j < j1; ++j) {
    const float next = j + 1 < j1 ? block_move<PT, GT>(b, j + 1, other) : 0.0f;
    const int64_t lo = b.lo(j), hi = b.hi(j), ahead = b.lo(j + 2);
    // and, at once, the codes that block's move decodes (an eighth or a quarter of its p and g
    // traffic): without this the move waited on them
    // (research/results/step_speed/kernel_ab_codes.json)
    const int64_t after = b.hi(j + 2);
    const int64_t c0 = b.four ? ahead / 2 : ahead, c1 = b.four ? (after + 1) / 2 : after;
    for (int64_t c = c0; c < c1; c += 64) __builtin_prefetch(b.codes + c);
    requantize_range<false>(buf, nullptr, scale, hi - lo, b.four, b.l8, b.start + lo, b.key, idx,
                            Prefetch(static_cast<typename Elem<PT>::T*>(b.p) + ahead,
                                     static_cast<const typename Elem<GT>::T*>(b.g) + ahead,
                                     std::max<int64_t>(after - ahead, 0)),
                            b.l4);
    encode(b.codes, lo, hi, b.four, idx);
    std::swap(buf, other);
    scale = next;
  }
}

// One row of a column segment, pass 1: g^2 into the column sums ``s`` (double; its own loop, as
// the mixed-width loop did not vectorise), |m| into the column maxima and m^2 into the column
// sums ``s2`` (fp32: a chunk's rows; the chunks add in double); with kRow, returns the row's own
// sum of g^2 (its v_cross entry's)
template <int GT, bool kLow, bool kRow>
inline double column_stats(const float* __restrict buf, const typename Elem<GT>::T* __restrict g,
                           const float* __restrict absmax, double* __restrict s,
                           float* __restrict s2, float* __restrict mx, int64_t n, float w) {
  double row = 0.0;
#pragma omp simd reduction(+ : row)
  for (int64_t k = 0; k < n; ++k) {
    const double x = Elem<GT>::get(g[k]);
    s[k] += x * x;
    if constexpr (kRow) row += x * x;
  }
  const float w1 = 1.0f - w;
#pragma omp simd
  for (int64_t k = 0; k < n; ++k) {
    const float m = lerp<kLow>(buf[k] * absmax[k], Elem<GT>::get(g[k]), w, w1);
    const float a = std::fabs(m);
    const float cur = mx[k];
    mx[k] = cur < a ? a : cur;  // std::max on the array element kept GCC from vectorising
    s2[k] += m * m;
  }
  return row;
}

// Pass 2: the same m again, into buf, and the parameter step with ``denominator``
// for each column's s and keep: s = col[k] (sqrt(v) / bc2), or with kFac col[k] * fr (``col``
// holds sqrt(v) per column and the row's factor ``fr`` completes it)
template <int PT, int GT, bool kLow, bool kFac>
inline void column_move(float* __restrict buf, typename Elem<PT>::T* __restrict p,
                        const typename Elem<GT>::T* __restrict g, const float* __restrict absmax,
                        const float* __restrict col, const float* __restrict keep, float fr,
                        float ib2, int64_t n, const Hyper& h, int64_t first, uint32_t pk) {
  const float w1 = 1.0f - h.w;
#pragma omp simd
  for (int64_t k = 0; k < n; ++k) {
    const float gk = Elem<GT>::get(g[k]);
    const float m = lerp<kLow>(buf[k] * absmax[k], gk, h.w, w1);
    buf[k] = m;
    const float pi = Elem<PT>::get(p[k]) * h.decay;
    const float d = denominator(kFac ? col[k] * fr : col[k], m, gk, keep[k], ib2, h);
    p[k] = Elem<PT>::put_at(pi + h.neg_step * (m / d), static_cast<uint32_t>(first + k), pk);
  }
}

// Column segments (block size -P): block k holds the segment's elements i = k mod P, so the
// blocks run across the rows of the (rows, P) view. Both passes go along rows (contiguous, with
// per-column arrays that vectorise) over fixed chunks of rows: pass 1 sums g^2 and m^2 (double)
// and finds the new |m| maxima per chunk, their fixed-order reduction gives v, the denominators,
// each column's keep (reference.block_keep) and the new absmax, pass 2 recomputes m, moves the
// parameter and writes the codes. Chunks depend on the shape, not the thread count, so results
// are the same on any number of threads; at 4 bits with odd P a chunk holds an even number of
// rows, so no byte straddles two chunks.
template <int PT, int GT>
void columns(const Segment& sg, int threads) {
  auto* pt = static_cast<typename Elem<PT>::T*>(sg.p);
  const auto* gt = static_cast<const typename Elem<GT>::T*>(sg.g);
  const int64_t start = sg.start, numel = sg.numel, period = -sg.block;
  const bool four = sg.four;
  const Hyper& h = sg.h;
  const float* fac = sg.fac;
  float* absmax = sg.absmax;
  const uint32_t pk = sg.pkey;
  const int64_t nb = std::min(numel, period);
  const int64_t rows = (numel + period - 1) / period;
  // at most 64 chunks and 16 MiB of partial sums and maxima (16 bytes per column and chunk)
  const int64_t max_chunks = std::max<int64_t>(1, std::min<int64_t>(64, (16 << 20) / (16 * nb)));
  // and at least 32 rows each: the fixed-order reduction reads every chunk's partials once, which
  // with a few rows per chunk cost as much as the rows themselves
  int64_t per = std::max<int64_t>(32, (rows + max_chunks - 1) / max_chunks);
  if (four && (period & 1) && (per & 1)) ++per;
  const int64_t chunks = (rows + per - 1) / per;
  std::vector<double> sums(chunks * nb, 0.0);
  std::vector<float> sums_m2(chunks * nb, 0.0f), maxes(chunks * nb, 0.0f);
  // with ``fold`` (a tensor held whole: its rows are the view's), each row's sum of g^2
  std::vector<double> row_sums(sg.fold ? rows : 0);
#pragma omp parallel num_threads(std::max(threads, 1)) if (threads > 1 && chunks > 1)
  {
    std::vector<float> buf(nb);
#pragma omp for schedule(static)
    for (int64_t c = 0; c < chunks; ++c) {
      double* s = sums.data() + c * nb;
      float* s2 = sums_m2.data() + c * nb;
      float* mx = maxes.data() + c * nb;
      for (int64_t r = c * per; r < std::min(rows, (c + 1) * per); ++r) {
        const int64_t lo = r * period, hi = std::min(lo + period, numel), w = hi - lo;
        decode(sg.codes, lo, hi, four, sg.levels, sg.l4, buf.data(), sg.l8);
        const float* b = buf.data();
        if (sg.fold)
          row_sums[r] =
              h.w < 0.5f ? column_stats<GT, true, true>(b, gt + lo, absmax, s, s2, mx, w, h.w)
                         : column_stats<GT, false, true>(b, gt + lo, absmax, s, s2, mx, w, h.w);
        else if (h.w < 0.5f)
          column_stats<GT, true, false>(b, gt + lo, absmax, s, s2, mx, w, h.w);
        else
          column_stats<GT, false, false>(b, gt + lo, absmax, s, s2, mx, w, h.w);
      }
    }
  }
  if (sg.fold) {  // this step's row means into v_cross (the factor came from it before the step)
    std::vector<double> counts(rows);
    for (int64_t r = 0; r < rows; ++r)
      counts[r] = static_cast<double>(std::min(period, numel - r * period));
    fold_cross(row_sums.data(), counts.data(), rows, sg.fold, h.beta2, h.a2);
  }
  // With the factor, a column's mean of f^2 (its keep's): the factor is per tensor row, and
  // column k's elements lie in the count rows of the view from the piece's first tensor row r0
  // on, or from r0 + 1 for columns from ``cut`` on (a piece that starts mid-row). Over the full
  // rows that is one of two sums (``sq_full``), plus the last, partial row's entry where column k
  // reaches it.
  const int64_t full = numel / period, cut = period - start % period, r0 = start / period;
  auto sq = [&](int64_t row) { return static_cast<double>(fac[row]) * fac[row]; };
  double sq_full[2] = {0.0, 0.0};
  for (int t = 0; fac && t < 2 && (t == 0 || cut < nb); ++t)
    for (int64_t r = 0; r < full; ++r) sq_full[t] += sq(r0 + t + r);
  const double ib2 = inv_bc1_sq(h);
  std::vector<float> col(nb), keep(nb), amax(nb), scale(nb);
  for (int64_t k = 0; k < nb; ++k) {
    double total = 0.0, total_m2 = 0.0;
    float mx = 0.0f;
    for (int64_t c = 0; c < chunks; ++c) {
      total += sums[c * nb + k];
      total_m2 += sums_m2[c * nb + k];
      mx = std::max(mx, maxes[c * nb + k]);
    }
    const int64_t count = full + (k < numel % period ? 1 : 0);
    const float vk = ema_mean_sq(sg.v[k], total, static_cast<double>(count), h.beta2, h.a2);
    sg.v[k] = vk;
    const float sv = std::sqrt(vk);
    const float mean_m2 = static_cast<float>(total_m2 / static_cast<double>(count) * ib2);
    if (fac) {
      const int t = k >= cut ? 1 : 0;
      const double f2 = sq_full[t] + (count > full ? sq(r0 + t + full) : 0.0);
      col[k] = sv;
      keep[k] = block_keep(mean_m2, sv * sv * static_cast<float>(f2 / static_cast<double>(count)));
    } else {
      col[k] = sv / h.bc2;
      keep[k] = block_keep(mean_m2, col[k] * col[k]);
    }
    amax[k] = mx;
    scale[k] = mx > 0.0f ? mx : 1.0f;
  }
  const float ib2f = static_cast<float>(ib2);
#pragma omp parallel num_threads(std::max(threads, 1)) if (threads > 1 && chunks > 1)
  {
    std::vector<float> buf(nb);
    std::vector<int32_t> idx(nb);
#pragma omp for schedule(static)
    for (int64_t c = 0; c < chunks; ++c) {
      for (int64_t r = c * per; r < std::min(rows, (c + 1) * per); ++r) {
        const int64_t lo = r * period, hi = std::min(lo + period, numel), w = hi - lo;
        decode(sg.codes, lo, hi, four, sg.levels, sg.l4, buf.data(), sg.l8);
        const float *d = col.data(), *kp = keep.data();
        if (fac) {
          // the factor is per tensor row: a piece that starts mid-row (start % period != 0) has
          // each row of its view straddle two tensor rows, from column ``cut`` on the next one
          const int64_t tr = (start + lo) / period, cw = std::min(w, cut);
          float* b = buf.data();
          const float f0 = fac[tr], f1 = cw < w ? fac[tr + 1] : 0.0f;
          const int64_t e = start + lo;
          if (h.w < 0.5f) {
            column_move<PT, GT, true, true>(b, pt + lo, gt + lo, absmax, d, kp, f0, ib2f, cw, h,
                                            e, pk);
            column_move<PT, GT, true, true>(b + cw, pt + lo + cw, gt + lo + cw, absmax + cw,
                                            d + cw, kp + cw, f1, ib2f, w - cw, h, e + cw, pk);
          } else {
            column_move<PT, GT, false, true>(b, pt + lo, gt + lo, absmax, d, kp, f0, ib2f, cw, h,
                                             e, pk);
            column_move<PT, GT, false, true>(b + cw, pt + lo + cw, gt + lo + cw, absmax + cw,
                                             d + cw, kp + cw, f1, ib2f, w - cw, h, e + cw, pk);
          }
        } else if (h.w < 0.5f)
          column_move<PT, GT, true, false>(buf.data(), pt + lo, gt + lo, absmax, d, kp, 0.0f,
                                           ib2f, w, h, start + lo, pk);
        else
          column_move<PT, GT, false, false>(buf.data(), pt + lo, gt + lo, absmax, d, kp, 0.0f,
                                            ib2f, w, h, start + lo, pk);
        const int64_t next = std::min(period, numel - hi);  // the next row's elements
        requantize_range<true>(buf.data(), scale.data(), 1.0f, w, four, sg.l8, start + lo,
                               sg.key, idx.data(), Prefetch(pt + hi, gt + hi, next), sg.l4);
        encode(sg.codes, lo, hi, four, idx.data());
      }
    }
  }
  std::copy(amax.begin(), amax.end(), absmax);
}

// B = 1 (reference.dense_update): AdamW on bf16 m and v, stored back rounded stochastically with
// the two halves of the element's hash; ``first`` is the tile's first index in its tensor
template <int PT, int GT, bool kLow>
inline void dense_tile(typename Elem<PT>::T* __restrict p, const typename Elem<GT>::T* __restrict g,
                       uint16_t* __restrict m, uint16_t* __restrict v, int64_t n, const Hyper& h,
                       int64_t first, uint32_t key) {
  const float w1 = 1.0f - h.w;
  const uint32_t pk = param_key(key);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float gi = Elem<GT>::get(g[i]);
    const float pi = Elem<PT>::get(p[i]) * h.decay;
    const float mi = lerp<kLow>(bf16_to_f32(m[i]), gi, h.w, w1);
    const float vi = bf16_to_f32(v[i]) * h.beta2 + h.a2 * gi * gi;
    const uint32_t r = mix32(static_cast<uint32_t>(first + i) ^ key);
    m[i] = f32_to_bf16_stochastic(mi, r & 0xffffu);
    v[i] = f32_to_bf16_stochastic(vi, r >> 16);
    const float denom = std::sqrt(vi) / h.bc2 + h.eps;
    p[i] = Elem<PT>::put_at(pi + h.neg_step * (mi / denom), static_cast<uint32_t>(first + i), pk);
  }
}

template <int PT, int GT>
void dense_range(void* p, const void* g, uint16_t* m, uint16_t* v, int64_t lo, int64_t hi,
                 const Hyper& h, int64_t start, uint32_t key) {
  auto* pt = static_cast<typename Elem<PT>::T*>(p) + lo;
  const auto* gt = static_cast<const typename Elem<GT>::T*>(g) + lo;
  if (h.w < 0.5f)
    dense_tile<PT, GT, true>(pt, gt, m + lo, v + lo, hi - lo, h, start + lo, key);
  else
    dense_tile<PT, GT, false>(pt, gt, m + lo, v + lo, hi - lo, h, start + lo, key);
}

// The update's fp32 row (Hyp), read as one struct.
static_assert(sizeof(Hyper) == Hyp::kCols * sizeof(float), "Hyper is one Hyp row");
static_assert(offsetof(Hyper, beta1) == Hyp::BETA1 * sizeof(float), "Hyp::BETA1");
static_assert(offsetof(Hyper, w) == Hyp::W * sizeof(float), "Hyp::W");
static_assert(offsetof(Hyper, beta2) == Hyp::BETA2 * sizeof(float), "Hyp::BETA2");
static_assert(offsetof(Hyper, a2) == Hyp::A2 * sizeof(float), "Hyp::A2");
static_assert(offsetof(Hyper, decay) == Hyp::DECAY * sizeof(float), "Hyp::DECAY");
static_assert(offsetof(Hyper, neg_step) == Hyp::NEG_STEP * sizeof(float), "Hyp::NEG_STEP");
static_assert(offsetof(Hyper, bc2) == Hyp::BC2 * sizeof(float), "Hyp::BC2");
static_assert(offsetof(Hyper, eps) == Hyp::EPS * sizeof(float), "Hyp::EPS");
static_assert(offsetof(Hyper, bc1) == Hyp::BC1 * sizeof(float), "Hyp::BC1");
static_assert(offsetof(Hyper, g_floor) == Hyp::G_FLOOR * sizeof(float), "Hyp::G_FLOOR");
constexpr int64_t kDenseTile = 16384;

using BlockFn = void (*)(const Segment&, int64_t, int64_t, float*, float*, int32_t*);
using DenseFn = void (*)(void*, const void*, uint16_t*, uint16_t*, int64_t, int64_t, const Hyper&,
                         int64_t, uint32_t);
using ColumnFn = void (*)(const Segment&, int);

struct Kernels {
  BlockFn block;
  DenseFn dense;
  ColumnFn columns;
};

template <int PT, int GT>
constexpr Kernels kernels_of() {
  return {&block_run<PT, GT>, &dense_range<PT, GT>, &columns<PT, GT>};
}

template <int PT>
bool pick_g(int gt, Kernels& k) {
  switch (gt) {
    case F32: k = kernels_of<PT, F32>(); return true;
    case BF16: k = kernels_of<PT, BF16>(); return true;
    case F16: k = kernels_of<PT, F16>(); return true;
    default: return false;
  }
}

bool pick(int pt, int gt, Kernels& k) {
  switch (pt) {
    case F32: return pick_g<F32>(gt, k);
    case BF16: return pick_g<BF16>(gt, k);
    case F16: return pick_g<F16>(gt, k);
    case BF16_SR: return pick_g<BF16_SR>(gt, k);
    default: return false;
  }
}

// The codebook's Levels4 or Levels8, built by ``build`` the first time a step meets its levels
// and shared by every segment with them (keyed by the levels, not the midpoints: each segment's
// midpoints are a tensor of their own)
template <class T, class Build>
const T* per_codebook(std::vector<std::pair<const float*, std::unique_ptr<T>>>& built,
                      const float* levels, Build build) {
  for (const auto& [key, value] : built)
    if (key == levels) return value.get();
  built.emplace_back(levels, std::make_unique<T>());
  build(*built.back().second);
  return built.back().second.get();
}

// What a segment needs besides its row: the kernel for its dtypes and the row read into a
// Segment (with its codebook's Levels4 or Levels8).
struct Prep {
  const int64_t* m;
  Kernels fn;
  Segment b;
};

#ifdef __AVX512F__
// One fp32 row of n (a multiple of 16) into the column sums ``acc`` and its own sum, in the order
// GCC's loop in cross_sums adds the other rows (lane j mod 16 in two registers, then lanes 0 to
// 15 one by one; tests/test_cpu_kernels.py holds it to that), prefetching the line kRowAhead
// bytes on, before ``end``: left to the hardware, this pass read g at well under the speed of
// a plain read of it (research/results/step_speed/kernel_ab_rowahead.json).
constexpr int64_t kRowAhead = 16384;
inline double row_sums16(const float* __restrict row, double* __restrict acc, int64_t n,
                         const float* end) {
  __m512d s0 = _mm512_setzero_pd(), s1 = _mm512_setzero_pd();
  const char* ahead = reinterpret_cast<const char*>(row) + kRowAhead;
  const int64_t room = reinterpret_cast<const char*>(end) - ahead;
  for (int64_t j = 0; j < n; j += 16) {
    if (j * 4 < room) _mm_prefetch(ahead + j * 4, _MM_HINT_T0);
    const __m512 v = _mm512_loadu_ps(row + j);
    const __m512d x0 = _mm512_cvtps_pd(_mm512_castps512_ps256(v));
    const __m512d x1 = _mm512_cvtps_pd(_mm512_extractf32x8_ps(v, 1));
    const __m512d q0 = _mm512_mul_pd(x0, x0), q1 = _mm512_mul_pd(x1, x1);
    _mm512_storeu_pd(acc + j, _mm512_add_pd(_mm512_loadu_pd(acc + j), q0));
    _mm512_storeu_pd(acc + j + 8, _mm512_add_pd(_mm512_loadu_pd(acc + j + 8), q1));
    s0 = _mm512_add_pd(s0, q0);
    s1 = _mm512_add_pd(s1, q1);
  }
  alignas(64) double lanes[16];
  _mm512_store_pd(lanes, s0);
  _mm512_store_pd(lanes + 8, s1);
  double s = 0.0;
  for (int k = 0; k < 16; ++k) s += lanes[k];
  return s;
}
#endif

// reference.cross_sums: fp64 sums of g^2 and counts per entry of a tensor's v_cross over one
// piece. Each entry's sum runs over the piece's rows in a fixed order, whatever the thread count.
// Contiguous blocks with ``v``: the rows are the piece's blocks (cut at its ends), and each one's
// mean g^2 is also folded into v (v * beta2 + a2 * mean, block_move's first pass), so a step told
// so reads the gradient once for both.
template <int GT>
void cross_sums(const void* gv, int64_t start, int64_t numel, int64_t block, double* sums,
                double* counts, int threads, float* v, float beta2, float a2) {
  const auto* g = static_cast<const typename Elem<GT>::T*>(gv);
  const bool contiguous = block > 0;
  const int64_t width = contiguous ? block : -block;
  const int64_t head = std::min((width - start % width) % width, numel);
  const int64_t whole = (numel - head) / width, tail = numel - head - whole * width;
  const int64_t row0 = (start + width - 1) / width;  // the tensor row of the first whole row
  auto sq = [&](int64_t i) {
    const double x = Elem<GT>::get(g[i]);
    return x * x;
  };
  if (contiguous) {
    auto fold = [&](int64_t j, double s, int64_t n) {
      if (v) v[j] = ema_mean_sq(v[j], s, static_cast<double>(n), beta2, a2);
    };
    const int64_t first = start % width, j0 = head ? 1 : 0;  // j0: block of the first whole row
    double edge = 0.0;
    for (int64_t i = 0; i < head; ++i) {
      const double x2 = sq(i);
      sums[first + i] += x2;
      counts[first + i] += 1.0;
      edge += x2;
    }
    if (head) fold(0, edge, head);
    // Whole rows in chunks that depend on the shape only (at most 16, at least 32 rows each):
    // a row's sum is one thread's, and each entry adds the chunks' partial sums in order. The
    // partials take at most 16 x 8 x partition.MAX_BLOCK bytes = 16 MiB, as in columns().
    const int64_t per = rows_per_chunk(whole);
    const int64_t chunks = (whole + per - 1) / per;
    std::vector<double> part(chunks * width, 0.0);
#pragma omp parallel for num_threads(std::max(threads, 1)) if (threads > 1 && chunks > 1)
    for (int64_t c = 0; c < chunks; ++c) {
      double* __restrict acc = part.data() + c * width;
      for (int64_t r = c * per; r < std::min(whole, (c + 1) * per); ++r) {
        const auto* __restrict row = g + head + r * width;
        double s = 0.0;
#ifdef __AVX512F__
        if constexpr (GT == F32) {
          if (width % 16 == 0) {
            s = row_sums16(row, acc, width, g + head + whole * width);
            fold(j0 + r, s, width);
            continue;
          }
        }
#endif
#pragma omp simd reduction(+ : s)
        for (int64_t j = 0; j < width; ++j) {
          const double x = Elem<GT>::get(row[j]);
          acc[j] += x * x;
          s += x * x;
        }
        fold(j0 + r, s, width);
      }
    }
    for (int64_t c = 0; c < chunks; ++c)
      for (int64_t j = 0; j < width; ++j) sums[j] += part[c * width + j];
    for (int64_t j = 0; whole && j < width; ++j) counts[j] += static_cast<double>(whole);
    edge = 0.0;
    for (int64_t i = 0; i < tail; ++i) {
      const double x2 = sq(numel - tail + i);
      sums[i] += x2;
      counts[i] += 1.0;
      edge += x2;
    }
    if (tail) fold(j0 + whole, edge, tail);
    return;
  }
  if (head) {
    double s = 0.0;
    for (int64_t i = 0; i < head; ++i) s += sq(i);
    sums[start / width] += s;
    counts[start / width] += static_cast<double>(head);
  }
  // Each row's sum from eight lanes (j mod 8), added pairwise at the end. With AVX-512, fp32 rows
  // go kRows at a time: a row's lanes wait on their own additions (one chain of width / 8), and
  // four rows are four chains; that took a fifth off this pass on the demo GPT.
  constexpr int kRows = 4;
  const int64_t groups = (whole + kRows - 1) / kRows;
#pragma omp parallel for num_threads(std::max(threads, 1)) if (threads > 1 && groups > 1)
  for (int64_t q = 0; q < groups; ++q) {
    const int64_t r0 = q * kRows, nr = std::min<int64_t>(kRows, whole - r0);
    const auto* row = g + head + r0 * width;
    double acc[kRows][8] = {};
    int64_t j = 0;
#ifdef __AVX512F__
    if constexpr (GT == F32) {
      if (nr == kRows) {
        __m512d a[kRows];
        for (int t = 0; t < kRows; ++t) a[t] = _mm512_setzero_pd();
        for (; j + 8 <= width; j += 8)
          for (int t = 0; t < kRows; ++t) {
            const __m512d x = _mm512_cvtps_pd(_mm256_loadu_ps(row + t * width + j));
            a[t] = _mm512_add_pd(a[t], _mm512_mul_pd(x, x));
          }
        for (int t = 0; t < kRows; ++t) _mm512_storeu_pd(acc[t], a[t]);
      }
    }
#endif
    for (int t = 0; t < nr; ++t) {
      const auto* rt = row + t * width;
      double a[8];  // eight lanes: it vectorises
      std::copy(acc[t], acc[t] + 8, a);
      int64_t i = j;
      for (; i + 8 <= width; i += 8)
        for (int k = 0; k < 8; ++k) {
          const double x = Elem<GT>::get(rt[i + k]);
          a[k] += x * x;
        }
      double s = ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
      for (; i < width; ++i) {
        const double x = Elem<GT>::get(rt[i]);
        s += x * x;
      }
      sums[row0 + r0 + t] += s;
      counts[row0 + r0 + t] += static_cast<double>(width);
    }
  }
  if (tail) {
    double s = 0.0;
    for (int64_t i = numel - tail; i < numel; ++i) s += sq(i);
    sums[row0 + whole] += s;
    counts[row0 + whole] += static_cast<double>(tail);
  }
}

// cross_sums for a g of dtype ``gdt``: false for one it refuses
bool cross_sums_of(int gdt, const void* g, int64_t start, int64_t numel, int64_t block,
                   double* sums, double* counts, int threads, float* v, float beta2, float a2) {
  switch (gdt) {
    case F32: cross_sums<F32>(g, start, numel, block, sums, counts, threads, v, beta2, a2); break;
    case BF16: cross_sums<BF16>(g, start, numel, block, sums, counts, threads, v, beta2, a2); break;
    case F16: cross_sums<F16>(g, start, numel, block, sums, counts, threads, v, beta2, a2); break;
    default: return false;
  }
  return true;
}

}  // namespace

extern "C" {

// The widest vector path this build compiled: 513 (AVX-512F with VBMI: the 4-bit grid count),
// 512 (AVX-512F), 256 (AVX2) or 0 (the scalar loops GCC vectorises as the target allows). Tests
// build each and check it against the reference.
int gefen_cpu_isa() {
#if defined(__AVX512F__) && defined(__AVX512VBMI__)
  return 513;
#elif defined(__AVX512F__)
  return 512;
#elif defined(__AVX2__)
  return 256;
#else
  return 0;
#endif
}
// Every table's columns in order, as "Table:COL,COL,...;" per table (the X-macros above): what
// native_cpu.tables() parses and tests/test_tables.py holds to segment_table's enums.
const char* gefen_cpu_tables() {
#define GEFEN_NAME(name) #name ","
#define GEFEN_LIST(table, columns) #table ":" columns(GEFEN_NAME) ";"
  static const char* const kTables = GEFEN_TABLES(GEFEN_LIST);
#undef GEFEN_LIST
#undef GEFEN_NAME
  return kTables;
}

// Adds one to each fp32 step count at ``addrs`` (0-dim CPU tensors) and writes the new counts into
// ``out``: one call where torch._foreach_add_ over the scalars cost a few percent of a small step.
void gefen_cpu_count_steps(const int64_t* addrs, int n, float* out) {
  for (int i = 0; i < n; ++i) {
    float* s = reinterpret_cast<float*>(addrs[i]);
    *s += 1.0f;
    out[i] = *s;
  }
}

// One step over a segment table: ``meta`` (n_seg x Meta::kCols int64, the columns of Meta), ``hyp``
// (n_seg x Hyp::kCols fp32: beta1, 1 - beta1, beta2, 1 - beta2, 1 - lr * wd, -lr / (1 - beta1^t),
// sqrt(1 - beta2^t), eps, 1 - beta1^t), ``v_done`` (n_seg flags, or null: 1 where gefen_cpu_cross_sums has
// folded this step's g^2 into the segment's v, contiguous blocks only). Blocks and dense tiles of
// every segment share the threads. A row with Meta::V_CROSS (a tensor held whole, B != 1, and a
// Meta::FACTOR buffer of its v_cross entries) gets its factor from v_cross as the steps before left
// it, with ``floor_c``, and this step's sums folded in after, taken in the update's own read of
// g (reference.cross_factor); where v_cross is all zero (a first step), a pass over g gives the
// sums first and the factor comes from the fold. Returns 0, or -(row + 1) for a row whose
// dtypes, bits, block size or v_cross it refuses (nothing is written then).
int gefen_cpu_step(const int64_t* meta, const float* hyp, const uint8_t* v_done, int n_seg,
                   int threads, float floor_c) {
  std::vector<Prep> prep(n_seg);
  // one Levels4 or Levels8 per codebook (a model's segments share one), not one per segment
  std::vector<std::pair<const float*, std::unique_ptr<Levels4>>> books;
  std::vector<std::pair<const float*, std::unique_ptr<Levels8>>> tables;
  // The work other than column segments, in runs of consecutive blocks (or dense tiles) of one
  // segment that the threads take in turn: as many runs to a segment as threads, except a
  // segment whose blocks share bytes, which stays one. A run starts cold (its first two blocks
  // are not prefetched): at two threads, runs of 8 blocks (the chunk the threads took before)
  // made the 100M set's step 3-4 % slower than before, where halves made both sets' faster.
  struct Run {
    int s;
    int64_t j0, j1;
  };
  std::vector<Run> runs;
  const int team = std::max(threads, 1);
  int64_t width = 1;
  for (int s = 0; s < n_seg; ++s) {
    Prep& r = prep[s];
    const int64_t* m = meta + static_cast<int64_t>(s) * Meta::kCols;
    r.m = m;
    Hyper h;
    std::memcpy(&h, hyp + static_cast<int64_t>(s) * Hyp::kCols, sizeof(Hyper));
    const int64_t numel = m[Meta::NUMEL], block = m[Meta::BLOCK], bits = m[Meta::BITS];
    if (!pick(static_cast<int>(m[Meta::P_DTYPE]), static_cast<int>(m[Meta::G_DTYPE]), r.fn) ||
        block == 0 || numel < 0 || (block != 1 && bits != 4 && bits != 8) ||
        (m[Meta::V_CROSS] && (block == 1 || m[Meta::START] != 0 || !m[Meta::FACTOR] || (v_done && v_done[s]))))
      return -(s + 1);
    const bool four = bits == 4;
    const float* levels = reinterpret_cast<const float*>(m[Meta::LEVELS]);
    const Levels4* l4 = nullptr;
    const Levels8* l8 = nullptr;
    int n_mids = 0;
    if (numel > 0 && block != 1) {
      n_mids = static_cast<int>(m[Meta::N_LEVELS]) - 1;
      if (n_mids + 1 != (four ? 16 : 256)) return -(s + 1);
      if (four) {  // stochastic rounding works on the levels; midpoints are for 8 bits
        l4 = per_codebook(books, levels, [&](Levels4& l) { levels4(levels, l); });
      } else {
        const auto* mids = reinterpret_cast<const float*>(m[Meta::MIDS]);
        l8 = per_codebook(tables, levels, [&](Levels8& l) { levels8(levels, mids, n_mids, l); });
      }
      if (block > 0) width = std::max(width, std::min(block, numel));
    }
    r.b = Segment{reinterpret_cast<void*>(m[Meta::P]), reinterpret_cast<const void*>(m[Meta::G]),
                  reinterpret_cast<uint8_t*>(m[Meta::CODES]), reinterpret_cast<float*>(m[Meta::ABSMAX]),
                  reinterpret_cast<float*>(m[Meta::V]), levels, l8, m[Meta::START], numel, block, four,
                  v_done && v_done[s], static_cast<uint32_t>(m[Meta::STEP_KEY]), h, l4,
                  reinterpret_cast<const float*>(m[Meta::FACTOR]), nullptr, nullptr,
                  param_key(static_cast<uint32_t>(m[Meta::STEP_KEY]))};
  }
  // the rows are sound: the factors, and where their sums come from
  std::vector<std::unique_ptr<Sums>> sums;
  for (int s = 0; s < n_seg; ++s) {
    Segment& b = prep[s].b;
    const int64_t* m = prep[s].m;
    auto* vx = reinterpret_cast<float*>(m[Meta::V_CROSS]);
    if (!vx || b.numel == 0) continue;
    const int64_t length = b.block > 0 ? b.block : (b.numel - b.block - 1) / -b.block;
    auto* out = reinterpret_cast<float*>(m[Meta::FACTOR]);
    if (factor_from(vx, length, b.h.bc2, floor_c, out)) {
      if (b.block > 0) {
        sums.push_back(std::make_unique<Sums>(b.numel, b.block, vx, b.h.beta2, b.h.a2));
        b.sums = sums.back().get();
      } else {
        b.fold = vx;
      }
    } else {
      std::vector<double> sc(2 * length, 0.0);
      cross_sums_of(static_cast<int>(m[Meta::G_DTYPE]), b.g, 0, b.numel, b.block, sc.data(),
                    sc.data() + length, threads, nullptr, 0.0f, 0.0f);
      factor_and_fold(sc.data(), sc.data() + length, length, vx, b.h.beta2, b.h.a2, b.h.bc2,
                      floor_c, out);
    }
  }
  for (auto& r : prep)  // every factor is known now: a whole block's mean of f^2 (block_keep's)
    if (r.b.fac && r.b.block > 1 && r.b.numel > 0) r.b.fac_sq = mean_sq(r.b.fac, r.b.block);
  for (int s = 0; s < n_seg; ++s) {  // column segments run after the others, each with all threads
    const Segment& b = prep[s].b;
    if (b.numel == 0 || b.block < 0) continue;
    const int64_t items = b.block == 1 ? (b.numel + kDenseTile - 1) / kDenseTile
                                       : (b.start + b.numel - 1) / b.block - b.start / b.block + 1;
    // at 4 bits two blocks share a byte when a boundary falls on an odd element
    const bool serial = b.block > 1 && b.four && ((b.block & 1) || (b.start & 1));
    int64_t step = serial ? items : (items + team - 1) / team;
    if (b.sums) step = (step + b.sums->per - 1) / b.sums->per * b.sums->per;  // whole chunks
    for (int64_t j = 0; j < items; j += step) runs.push_back({s, j, std::min(items, j + step)});
    if (b.sums) b.sums->left = static_cast<int>((items + step - 1) / step);
  }
  const int64_t total = static_cast<int64_t>(runs.size());
#pragma omp parallel num_threads(team) if (team > 1 && total > 1)
  {
    std::vector<float> buf(width), other(width);
    std::vector<int32_t> idx(width);
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < total; ++i) {
      const Run& run = runs[i];
      const Prep& r = prep[run.s];
      const int64_t* m = r.m;
      if (m[Meta::BLOCK] == 1) {
        for (int64_t j = run.j0; j < run.j1; ++j) {
          const int64_t lo = j * kDenseTile, hi = std::min(lo + kDenseTile, m[Meta::NUMEL]);
          r.fn.dense(reinterpret_cast<void*>(m[Meta::P]), reinterpret_cast<const void*>(m[Meta::G]),
                     reinterpret_cast<uint16_t*>(m[Meta::EXP_AVG]),
                     reinterpret_cast<uint16_t*>(m[Meta::EXP_AVG_SQ]), lo, hi, r.b.h, m[Meta::START],
                     static_cast<uint32_t>(m[Meta::STEP_KEY]));
        }
      } else {
        r.fn.block(r.b, run.j0, run.j1, buf.data(), other.data(), idx.data());
        if (r.b.sums) r.b.sums->done();
      }
    }
  }
  for (int s = 0; s < n_seg; ++s)
    if (prep[s].b.block < 0 && prep[s].b.numel > 0) prep[s].fn.columns(prep[s].b, threads);
  return 0;
}

// reference.cross_sums for a flat piece ``g`` of dtype ``g_dtype`` (0 fp32, 1 bf16, 2 fp16),
// elements [start, start + numel) of its tensor, block size ``block`` (> 1, or -P for
// columns): adds into ``sums`` and ``counts`` (fp64, the tensor's v_cross entries). Returns 0, or
// -1 for a dtype it refuses. ``v`` (or null; contiguous blocks only): the segment's fp32 block
// v, into which each block's mean g^2 is folded with ``beta2`` and ``a2`` (= 1 - beta2).
int gefen_cpu_cross_sums(const void* g, int g_dtype, int64_t start, int64_t numel, int64_t block,
                         double* sums, double* counts, int threads, float* v, float beta2,
                         float a2) {
  if (v && block < 0) return -1;
  return cross_sums_of(g_dtype, g, start, numel, block, sums, counts, threads, v, beta2, a2) ? 0
                                                                                            : -1;
}

// reference.cross_mean and reference.cross_factor of one tensor: the factor into ``out`` from
// fp32 v_cross ``v`` as the steps before left it, then this step's mean g^2 from ``sums`` and
// ``counts`` (fp64, ``n`` entries) folded into v in place; where v was all zero, the fold first
// and the factor from it.
void gefen_cpu_cross_factor(const double* sums, const double* counts, int64_t n, float* v,
                            float beta2, float a2, float bc2, float floor_c, float* out) {
  factor_and_fold(sums, counts, n, v, beta2, a2, bc2, floor_c, out);
}

// The factor pass of every factored segment of a step in one call: ``meta`` (n_seg x
// Cross::kCols int64, the columns of Cross), ``hyp`` (n_seg x 4 fp32: beta2, 1 - beta2,
// sqrt(1 - beta2^t), the factor's floor). Each row is gefen_cpu_cross_sums into its sums and
// counts, then, where it has an ``out`` (a tensor held whole, not spread over ranks),
// gefen_cpu_cross_factor into it. Segments go to threads whole, largest first, and one that
// holds over a thread's share of the elements takes all the threads itself: either way a
// segment's sums come from chunks fixed by its shape, so the bits do not depend on the
// schedule. One call instead of two per tensor saves the Python and the parallel-region start
// each would cost. Returns 0, or -(row + 1) for a row it refuses (nothing is written then).
int gefen_cpu_cross_table(const int64_t* meta, const float* hyp, int n_seg, int threads) {
  std::vector<int> order(n_seg);
  int64_t total = 0;
  for (int s = 0; s < n_seg; ++s) {
    const int64_t* m = meta + static_cast<int64_t>(s) * Cross::kCols;
    const int64_t dt = m[Cross::G_DTYPE];
    if ((dt != F32 && dt != BF16 && dt != F16) || m[Cross::BLOCK] == 0 || m[Cross::BLOCK] == 1 ||
        m[Cross::NUMEL] < 0 || (m[Cross::V] && m[Cross::BLOCK] < 0))
      return -(s + 1);
    order[s] = s;
    total += m[Cross::NUMEL];
  }
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
    return meta[static_cast<int64_t>(a) * Cross::kCols + Cross::NUMEL] >
           meta[static_cast<int64_t>(b) * Cross::kCols + Cross::NUMEL];
  });
  const int team = std::max(threads, 1);
  auto run = [&](int s, int inner) {
    const int64_t* m = meta + static_cast<int64_t>(s) * Cross::kCols;
    const float* h = hyp + static_cast<int64_t>(s) * CrossHyp::kCols;
    auto* sums = reinterpret_cast<double*>(m[Cross::SUMS]);
    auto* counts = reinterpret_cast<double*>(m[Cross::COUNTS]);
    gefen_cpu_cross_sums(reinterpret_cast<const void*>(m[Cross::G]), static_cast<int>(m[Cross::G_DTYPE]),
                         m[Cross::START], m[Cross::NUMEL], m[Cross::BLOCK], sums, counts, inner,
                         reinterpret_cast<float*>(m[Cross::V]), h[CrossHyp::BETA2],
                         h[CrossHyp::A2]);
    if (m[Cross::OUT])
      gefen_cpu_cross_factor(sums, counts, m[Cross::LENGTH], reinterpret_cast<float*>(m[Cross::V_CROSS]),
                             h[CrossHyp::BETA2], h[CrossHyp::A2], h[CrossHyp::BC2], h[CrossHyp::FLOOR],
                             reinterpret_cast<float*>(m[Cross::OUT]));
  };
  int big = 0;  // the largest first: those over a thread's share run one at a time, all threads
  while (big < n_seg && team > 1 &&
         meta[static_cast<int64_t>(order[big]) * Cross::kCols + Cross::NUMEL] * team > total)
    run(order[big++], team);
#pragma omp parallel for num_threads(team) schedule(dynamic, 1) if (team > 1 && n_seg - big > 1)
  for (int i = big; i < n_seg; ++i) run(order[i], 1);
  return 0;
}

}  // extern "C"
