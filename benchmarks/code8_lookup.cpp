// The 8-bit coding's level lookup alone, three ways, on one core: code8_lookup.py builds and
// runs this and checks every exact way's codes against codes.quantize. Why: the 8-bit step
// misses fused AdamW on one thread, and the question is whether a lookup without gathers could
// close the gap. Input (binary, from the script): 255 fp32 midpoints, int32 n, n fp32 values in
// [-1, 1]; args: input path, output path (each way's n int32 codes, in turn), rounds. Prints one
// line per way: name, ns per element (median of rounds).
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

namespace {

constexpr int kCells = 8192;  // gefen_cpu.cpp's kCells8
constexpr double kSlack = 0x1p-23;

// gefen_cpu.cpp's levels8 grid: per cell, the midpoints below its widened left edge (low 32
// bits) and the bits of the next midpoint (high 32); reach: most midpoints in a widened cell
std::vector<int64_t> grid(const std::vector<float>& mids, int* reach) {
  std::vector<int64_t> pair(kCells);
  const int n = static_cast<int>(mids.size());
  int b = 0;
  *reach = 0;
  for (int c = 0; c < kCells; ++c) {
    const double lo = -1.0 + c * (2.0 / kCells) - kSlack, hi = -1.0 + (c + 1) * (2.0 / kCells) + kSlack;
    while (b < n && static_cast<double>(mids[b]) < lo) ++b;
    int inside = 0;
    while (b + inside < n && static_cast<double>(mids[b + inside]) <= hi) ++inside;
    *reach = std::max(*reach, inside);
    const float next = b < n ? mids[b] : INFINITY;
    uint32_t bits;
    std::memcpy(&bits, &next, 4);
    pair[c] = static_cast<int64_t>(static_cast<uint64_t>(bits) << 32 | static_cast<uint32_t>(b));
  }
  return pair;
}

// the kernel's way (requantize_range, reach <= 1): two 8-lane gathers of (base, next midpoint)
void gathers(const float* x, int64_t n, const int64_t* pair, int32_t* out) {
  const __m512 one = _mm512_set1_ps(1.0f), half = _mm512_set1_ps(kCells / 2);
  const __m512i last = _mm512_set1_epi32(kCells - 1), zero = _mm512_setzero_si512();
  const __m512i inc = _mm512_set1_epi32(1);
  const __m512i low = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i high = _mm512_add_epi32(low, inc);
  const auto* table = reinterpret_cast<const long long*>(pair);
  for (int64_t i = 0; i < n; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    const __m512i c = _mm512_min_epi32(
        _mm512_max_epi32(_mm512_cvttps_epi32(_mm512_mul_ps(_mm512_add_ps(v, one), half)), zero),
        last);
    const __m512i p0 = _mm512_i32gather_epi64(_mm512_castsi512_si256(c), table, 8);
    const __m512i p1 = _mm512_i32gather_epi64(_mm512_extracti32x8_epi32(c, 1), table, 8);
    const __m512i base = _mm512_permutex2var_epi32(p0, low, p1);
    const __m512 above = _mm512_castsi512_ps(_mm512_permutex2var_epi32(p0, high, p1));
    const __mmask16 up = _mm512_cmp_ps_mask(above, v, _CMP_LT_OQ);
    _mm512_storeu_si512(out + i, _mm512_mask_add_epi32(base, up, base, inc));
  }
}

// No memory lookups: a branch-free binary search for the count of midpoints below x, the 255
// midpoints (and +inf) held in registers as the search tree's eight levels (t[s]: level s's
// 2^s nodes), built once per codebook as the kernel's tables are
struct Tree {
  alignas(64) float t[8][128] = {};
  explicit Tree(const std::vector<float>& mids) {
    float tab[256];
    for (int i = 0; i < 256; ++i) tab[i] = i < static_cast<int>(mids.size()) ? mids[i] : INFINITY;
    for (int s = 0; s < 8; ++s) {
      const int bit = 128 >> s;
      for (int j = 0; j < (1 << s); ++j) t[s][j] = tab[j * 2 * bit + bit - 1];
    }
  }
};

void search(const float* x, int64_t n, const Tree& tree, int32_t* out) {
  const auto& t = tree.t;
  const __m512 t0 = _mm512_set1_ps(t[0][0]), t1 = _mm512_loadu_ps(t[1]);
  const __m512 t2 = _mm512_loadu_ps(t[2]), t3 = _mm512_loadu_ps(t[3]), t4 = _mm512_loadu_ps(t[4]);
  const __m512 t5a = _mm512_loadu_ps(t[5]), t5b = _mm512_loadu_ps(t[5] + 16);
  __m512 t6[4], t7[8];
  for (int k = 0; k < 4; ++k) t6[k] = _mm512_loadu_ps(t[6] + 16 * k);
  for (int k = 0; k < 8; ++k) t7[k] = _mm512_loadu_ps(t[7] + 16 * k);
  const __m512i inc = _mm512_set1_epi32(1), b5 = _mm512_set1_epi32(32), b6 = _mm512_set1_epi32(64);
  auto down = [&](__m512i j, __m512 node, __m512 v) {  // one level: j = 2 j + (node < v)
    const __m512i twice = _mm512_add_epi32(j, j);
    return _mm512_mask_add_epi32(twice, _mm512_cmp_ps_mask(node, v, _CMP_LT_OQ), twice, inc);
  };
  for (int64_t i = 0; i < n; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    __m512i j = _mm512_maskz_mov_epi32(_mm512_cmp_ps_mask(t0, v, _CMP_LT_OQ), inc);
    j = down(j, _mm512_permutexvar_ps(j, t1), v);
    j = down(j, _mm512_permutexvar_ps(j, t2), v);
    j = down(j, _mm512_permutexvar_ps(j, t3), v);
    j = down(j, _mm512_permutexvar_ps(j, t4), v);
    j = down(j, _mm512_permutex2var_ps(t5a, j, t5b), v);
    const __mmask16 h6 = _mm512_test_epi32_mask(j, b5);
    j = down(j,
             _mm512_mask_blend_ps(h6, _mm512_permutex2var_ps(t6[0], j, t6[1]),
                                  _mm512_permutex2var_ps(t6[2], j, t6[3])),
             v);
    const __mmask16 h7 = _mm512_test_epi32_mask(j, b5), h7b = _mm512_test_epi32_mask(j, b6);
    const __m512 a0 = _mm512_mask_blend_ps(h7, _mm512_permutex2var_ps(t7[0], j, t7[1]),
                                           _mm512_permutex2var_ps(t7[2], j, t7[3]));
    const __m512 a1 = _mm512_mask_blend_ps(h7, _mm512_permutex2var_ps(t7[4], j, t7[5]),
                                           _mm512_permutex2var_ps(t7[6], j, t7[7]));
    j = down(j, _mm512_mask_blend_ps(h7b, a0, a1), v);
    _mm512_storeu_si512(out + i, j);
  }
}

// not a coding: the same pass's load, cell arithmetic and store without any lookup, the floor
// under every way above
void floor_pass(const float* x, int64_t n, int32_t* out) {
  const __m512 one = _mm512_set1_ps(1.0f), half = _mm512_set1_ps(kCells / 2);
  for (int64_t i = 0; i < n; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    _mm512_storeu_si512(out + i, _mm512_cvttps_epi32(_mm512_mul_ps(_mm512_add_ps(v, one), half)));
  }
}

template <class F>
double timed(F f, int64_t n, int rounds) {
  std::vector<double> t;
  for (int r = 0; r < rounds; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    t.push_back(std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0)
                    .count() / n);
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 4) {
    std::fprintf(stderr, "usage: code8_lookup IN OUT ROUNDS\n");
    return 2;
  }
  FILE* in = std::fopen(argv[1], "rb");
  std::vector<float> mids(255);
  int32_t n = 0;
  if (!in || std::fread(mids.data(), 4, 255, in) != 255 || std::fread(&n, 4, 1, in) != 1 ||
      n <= 0 || n % 16) {
    std::fprintf(stderr, "bad input %s\n", argv[1]);
    return 2;
  }
  std::vector<float> x(n);
  if (std::fread(x.data(), 4, n, in) != static_cast<size_t>(n)) return 2;
  std::fclose(in);
  const int rounds = std::atoi(argv[3]);
  int reach = 0;
  const std::vector<int64_t> pair = grid(mids, &reach);
  const Tree tree(mids);
  if (reach > 1) {
    std::fprintf(stderr, "the codebook's reach is %d: the kernel would not take the gathers\n",
                 reach);
    return 3;
  }
  // passes over a block-sized slice at a time, as the kernel codes one block's m from L1
  constexpr int64_t kBlock = 2048;
  std::vector<int32_t> out(static_cast<size_t>(n) * 3);
  constexpr int kPasses = 64;  // per timed round: a round of one pass is too short to time
  auto over = [&](auto way, int32_t* dst) {
    return [&, way, dst] {
      for (int k = 0; k < kPasses; ++k)
        for (int64_t a = 0; a < n; a += kBlock)
          way(x.data() + a, std::min<int64_t>(kBlock, n - a), dst + a);
    };
  };
  const double g = timed(over([&](const float* s, int64_t m, int32_t* d) { gathers(s, m, pair.data(), d); },
                              out.data()), kPasses * n, rounds);
  const double s = timed(over([&](const float* s, int64_t m, int32_t* d) { search(s, m, tree, d); },
                              out.data() + n), kPasses * n, rounds);
  const double f = timed(over([&](const float* s, int64_t m, int32_t* d) { floor_pass(s, m, d); },
                              out.data() + 2 * n), kPasses * n, rounds);
  std::printf("gathers %.4f\nsearch %.4f\nfloor %.4f\n", g, s, f);
  FILE* o = std::fopen(argv[2], "wb");
  std::fwrite(out.data(), 4, out.size(), o);
  std::fclose(o);
  return 0;
}
