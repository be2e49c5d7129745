// torch binding of the Gefen CUDA kernels: checks what it is handed, launches on the stream it
// is given (Python passes torch.cuda.current_stream(device).cuda_stream). The segment table is
// built in Python (gefen_dist/native_cuda.py) because it changes every step (gradients may be new
// tensors) and is a few hundred rows. Only torch/extension.h and the CUDA runtime are included,
// so the binding also compiles against a CPU build of torch (CI's syntax check).
#include <torch/extension.h>

#include "gefen_cuda.h"

namespace {

void check_rows(const at::Tensor& meta, const at::Tensor& hyp) {
  TORCH_CHECK(meta.is_cuda() && hyp.is_cuda(), "gefen_cuda: meta and hyp must be CUDA tensors");
  TORCH_CHECK(meta.scalar_type() == at::kLong && meta.dim() == 2 &&
                  meta.size(1) == gefen::kMetaCols && meta.is_contiguous(),
              "gefen_cuda: meta must be contiguous int64 (segments, ", gefen::kMetaCols, ")");
  TORCH_CHECK(hyp.scalar_type() == at::kFloat && hyp.dim() == 2 &&
                  hyp.size(1) == gefen::kHypCols && hyp.size(0) == meta.size(0) &&
                  hyp.is_contiguous(),
              "gefen_cuda: hyp must be contiguous float32 (segments, ", gefen::kHypCols, ")");
}

void check_prefix(const at::Tensor& prefix, int64_t n_seg) {
  TORCH_CHECK(prefix.is_cuda() && prefix.scalar_type() == at::kLong && prefix.dim() == 1 &&
                  prefix.size(0) == n_seg + 1 && prefix.is_contiguous(),
              "gefen_cuda: a prefix must be contiguous int64 (segments + 1,) on the GPU");
}

void check_table(const at::Tensor& meta, const at::Tensor& hyp, const at::Tensor& prefix) {
  check_rows(meta, hyp);
  check_prefix(prefix, meta.size(0));
}

void blocks(const at::Tensor& meta, const at::Tensor& hyp, const at::Tensor& prefix,
            int64_t n_items, int64_t team, int64_t stream) {
  check_table(meta, hyp, prefix);
  const cudaError_t err = gefen::launch_blocks(
      meta.data_ptr<int64_t>(), hyp.data_ptr<float>(), prefix.data_ptr<int64_t>(),
      static_cast<int>(meta.size(0)), n_items, static_cast<int>(team),
      reinterpret_cast<cudaStream_t>(stream));
  TORCH_CHECK(err == cudaSuccess, "gefen_cuda blocks launch: ", cudaGetErrorString(err));
}

void dense(const at::Tensor& meta, const at::Tensor& hyp, const at::Tensor& prefix,
           int64_t n_tiles, int64_t stream) {
  check_table(meta, hyp, prefix);
  const cudaError_t err = gefen::launch_dense(meta.data_ptr<int64_t>(), hyp.data_ptr<float>(),
                                              prefix.data_ptr<int64_t>(),
                                              static_cast<int>(meta.size(0)), n_tiles,
                                              reinterpret_cast<cudaStream_t>(stream));
  TORCH_CHECK(err == cudaSuccess, "gefen_cuda dense launch: ", cudaGetErrorString(err));
}

int dtype_code(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return 0;
    case at::kBFloat16: return 1;
    case at::kHalf: return 2;
    default: TORCH_CHECK(false, "gefen_cuda: unsupported dtype ", t.scalar_type());
  }
  return -1;
}

void histogram(const at::Tensor& g, int64_t start, int64_t block, double head_amax,
               double tail_amax, at::Tensor& counts, int64_t stream) {
  TORCH_CHECK(g.is_cuda() && g.is_contiguous() && g.dim() == 1,
              "gefen_cuda histogram: g must be a contiguous 1-D CUDA tensor");
  TORCH_CHECK(counts.is_cuda() && counts.scalar_type() == at::kLong && counts.dim() == 1 &&
                  counts.is_contiguous() && counts.device() == g.device(),
              "gefen_cuda histogram: counts must be int64 (bins,) on g's device");
  TORCH_CHECK(block >= 1, "gefen_cuda histogram: block must be >= 1");
  const int bins = static_cast<int>(counts.size(0));
  TORCH_CHECK(bins >= 2 && bins <= 8192, "gefen_cuda histogram: 2..8192 bins");
  const cudaError_t err = gefen::launch_histogram(
      g.data_ptr(), dtype_code(g), start, g.numel(), block, static_cast<float>(head_amax),
      static_cast<float>(tail_amax),
      reinterpret_cast<unsigned long long*>(counts.data_ptr<int64_t>()), bins,
      reinterpret_cast<cudaStream_t>(stream));
  TORCH_CHECK(err == cudaSuccess, "gefen_cuda histogram launch: ", cudaGetErrorString(err));
}

void columns(const at::Tensor& meta, const at::Tensor& hyp, const at::Tensor& aux,
             const at::Tensor& reduce_prefix, int64_t reduce_blocks, const at::Tensor& col_prefix,
             int64_t col_blocks, const at::Tensor& unit_prefix, int64_t unit_blocks,
             at::Tensor& part_sum, at::Tensor& part_max, at::Tensor& denom, at::Tensor& amax_new,
             int64_t stream) {
  check_rows(meta, hyp);
  const int64_t n_seg = meta.size(0);
  TORCH_CHECK(aux.is_cuda() && aux.scalar_type() == at::kLong && aux.dim() == 2 &&
                  aux.size(0) == n_seg && aux.size(1) == gefen::kCAuxCols && aux.is_contiguous(),
              "gefen_cuda columns: aux must be contiguous int64 (segments, ", gefen::kCAuxCols,
              ") on the GPU");
  for (const at::Tensor* t : {&reduce_prefix, &col_prefix, &unit_prefix}) check_prefix(*t, n_seg);
  TORCH_CHECK(part_sum.is_cuda() && part_sum.scalar_type() == at::kDouble &&
                  part_max.is_cuda() && part_max.scalar_type() == at::kFloat &&
                  part_max.numel() == part_sum.numel() && part_sum.is_contiguous() &&
                  part_max.is_contiguous(),
              "gefen_cuda columns: part_sum (float64) and part_max (float32) must be contiguous, "
              "of one length, on the GPU");
  TORCH_CHECK(denom.is_cuda() && amax_new.is_cuda() && denom.scalar_type() == at::kFloat &&
                  amax_new.scalar_type() == at::kFloat && denom.numel() == amax_new.numel() &&
                  denom.is_contiguous() && amax_new.is_contiguous(),
              "gefen_cuda columns: denom and amax_new must be contiguous float32 of one length on "
              "the GPU");
  const cudaError_t err = gefen::launch_columns(
      meta.data_ptr<int64_t>(), hyp.data_ptr<float>(), aux.data_ptr<int64_t>(),
      static_cast<int>(n_seg), reduce_prefix.data_ptr<int64_t>(), reduce_blocks,
      col_prefix.data_ptr<int64_t>(), col_blocks, unit_prefix.data_ptr<int64_t>(), unit_blocks,
      part_sum.data_ptr<double>(), part_max.data_ptr<float>(), denom.data_ptr<float>(),
      amax_new.data_ptr<float>(), reinterpret_cast<cudaStream_t>(stream));
  TORCH_CHECK(err == cudaSuccess, "gefen_cuda columns launch: ", cudaGetErrorString(err));
}

void cross(const at::Tensor& meta, const at::Tensor& hyp, int64_t n_rows_seg,
           const at::Tensor& row_prefix, int64_t row_items, const at::Tensor& pos_prefix,
           int64_t pos_items, const at::Tensor& col_prefix, int64_t col_items, at::Tensor& part,
           int64_t stream) {
  TORCH_CHECK(meta.is_cuda() && meta.scalar_type() == at::kLong && meta.dim() == 2 &&
                  meta.size(1) == gefen::kXCols && meta.is_contiguous(),
              "gefen_cuda cross: meta must be contiguous int64 (segments, ", gefen::kXCols,
              ") on the GPU");
  TORCH_CHECK(hyp.is_cuda() && hyp.scalar_type() == at::kFloat && hyp.dim() == 2 &&
                  hyp.size(0) == meta.size(0) && hyp.size(1) == gefen::kCrossHypCols &&
                  hyp.is_contiguous(),
              "gefen_cuda cross: hyp must be contiguous float32 (segments, ",
              gefen::kCrossHypCols, ") on the GPU");
  const int64_t n_seg = meta.size(0);
  TORCH_CHECK(n_rows_seg >= 0 && n_rows_seg <= n_seg,
              "gefen_cuda cross: n_rows_seg must be in [0, segments]");
  check_prefix(row_prefix, n_rows_seg);  // one entry per segment of its kind, plus one
  check_prefix(pos_prefix, n_rows_seg);
  check_prefix(col_prefix, n_seg - n_rows_seg);
  TORCH_CHECK(part.is_cuda() && part.scalar_type() == at::kDouble && part.is_contiguous(),
              "gefen_cuda cross: part must be contiguous float64 on the GPU");
  const cudaError_t err = gefen::launch_cross(
      meta.data_ptr<int64_t>(), hyp.data_ptr<float>(), static_cast<int>(n_seg),
      static_cast<int>(n_rows_seg), row_prefix.data_ptr<int64_t>(), row_items,
      pos_prefix.data_ptr<int64_t>(), pos_items, col_prefix.data_ptr<int64_t>(), col_items,
      part.data_ptr<double>(), reinterpret_cast<cudaStream_t>(stream));
  TORCH_CHECK(err == cudaSuccess, "gefen_cuda cross launch: ", cudaGetErrorString(err));
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("blocks", &blocks, "Blocked segments of one step (segment table)");
  m.def("dense", &dense, "B = 1 segments of one step (segment table)");
  m.def("columns", &columns, "The column segments (block size -P) of one step");
  m.def("cross", &cross, "The factor's sums, and factors, of every factored segment of a step");
  m.def("histogram", &histogram, "Add one segment's block-normalised g0 to int64 counts");
  m.attr("META_COLS") = static_cast<int>(gefen::kMetaCols);
  m.attr("HYP_COLS") = static_cast<int>(gefen::kHypCols);
  m.attr("DENSE_TILE") = gefen::kDenseTile;
}
