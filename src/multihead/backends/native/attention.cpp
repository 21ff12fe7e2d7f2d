// multihead's native CPU kernels (backends/native): forward passes in float32 where torch's own kernel does more work
// than the call needs.
//
// causal_forward. Torch's CPU flash kernel computes a causal call's keys in blocks of 512: a document of up to 512
// tokens costs its whole square, a longer one its triangle plus 256 keys a row. Packed documents of 170-855 tokens
// then compute about 1.8x the pairs their masks keep. This kernel takes the queries in blocks of block_rows rows; each
// block reads the keys all its rows see in chunks of block_keys, then its own diagonal square (block_rows x
// block_rows, the pairs past the diagonal set to -inf), so it computes block_rows / 2 keys a row past the triangle.
// Its matmuls are the BLAS sgemm torch links (the one torch's kernel calls), its softmax the online one of
// FlashAttention, vectorized with ATen's Vectorized<float>, and its blocks run on ATen's parallel_for (OpenMP: the
// runtime torch loaded).
//   Contract (that of torch's _scaled_dot_product_flash_attention_for_cpu with is_causal=True, in float32):
//   q (b, h, n, d), k (b, g, m, d), v (b, g, m, e) with m >= n and h a multiple of g (query head x reads key/value
//   head x / (h / g)); the last dimension of each has stride 1. Row t sees keys 0..t.
//   Returns out (b, h, n, e) and lse (b, h, n), both contiguous float32: lse[t] = log(sum_j exp(scale * q_t . k_j)).
//   Every row sees key 0, so no row is empty.
//
// paged_forward. A decode step over a page pool: torch's kernels need each sequence's keys side by side, so the
// Python path copies every page of every sequence into (S, g, width, d) for the keys and again for the values, each
// layer, each step. This kernel reads the pages where they lie.
//   q (S, g, r, d): the r queries of each key/value head together; key_pool (P, g, page, d), value_pool
//   (P, g, page, e); pages (S, C) int64, each >= 0 and < P, C * page >= width. Every query of sequence s sees keys
//   0 .. width - 1 of its pages in order (a decode step of sequences of one length). Returns out (S, g, r, e).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

extern "C" void sgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k,
                       const float* alpha, const float* a, const int* lda, const float* b, const int* ldb,
                       const float* beta, float* c, const int* ldc);

namespace {

using Vec = at::vec::Vectorized<float>;

// Row-major C (rows x cols, leading dimension ldc) = alpha * A (rows x inner, lda) . B^T (cols x inner, ldb) + beta C.
// Column-major BLAS sees C^T = B . A^T.
void matmul_transposed(int64_t rows, int64_t cols, int64_t inner, const float* a, int64_t lda, const float* b,
                       int64_t ldb, float alpha, float beta, float* c, int64_t ldc) {
  const int m = static_cast<int>(cols), n = static_cast<int>(rows), k = static_cast<int>(inner);
  const int la = static_cast<int>(ldb), lb = static_cast<int>(lda), lc = static_cast<int>(ldc);
  sgemm_("T", "N", &m, &n, &k, &alpha, b, &la, a, &lb, &beta, c, &lc);
}

// Row-major C (rows x cols, ldc) = A (rows x inner, lda) . B (inner x cols, ldb) + beta C.
void matmul(int64_t rows, int64_t cols, int64_t inner, const float* a, int64_t lda, const float* b, int64_t ldb,
            float beta, float* c, int64_t ldc) {
  const int m = static_cast<int>(cols), n = static_cast<int>(rows), k = static_cast<int>(inner);
  const int la = static_cast<int>(ldb), lb = static_cast<int>(lda), lc = static_cast<int>(ldc);
  const float one = 1.0f;
  sgemm_("N", "N", &m, &n, &k, &one, b, &la, a, &lb, &beta, c, &lc);
}

float row_max(const float* x, int64_t n) {
  return at::vec::reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, x, n);
}

// x = exp(x - shift) in place; returns their sum. exp_u20 gives 0 below ln(FLT_MIN), so -inf (a masked key) is 0.
float exp_shifted_sum(float* x, int64_t n, float shift) {
  const Vec shift_vec(shift);
  Vec total(0.0f);
  int64_t j = 0;
  for (; j + Vec::size() <= n; j += Vec::size()) {
    Vec e = (Vec::loadu(x + j) - shift_vec).exp_u20();
    e.store(x + j);
    total = total + e;
  }
  float sum = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, total);
  for (; j < n; ++j) {
    x[j] = std::exp(x[j] - shift);
    sum += x[j];
  }
  return sum;
}

float dot(const float* a, const float* b, int64_t n) {
  Vec total(0.0f);
  int64_t x = 0;
  for (; x + Vec::size() <= n; x += Vec::size()) {
    total = at::vec::fmadd(Vec::loadu(a + x), Vec::loadu(b + x), total);
  }
  float sum = at::vec::vec_reduce_all<float>([](Vec& p, Vec& q) { return p + q; }, total);
  for (; x < n; ++x) sum += a[x] * b[x];
  return sum;
}

void scale_row(float* x, int64_t n, float factor) {
  at::vec::map([factor](Vec a) { return a * Vec(factor); }, x, x, n);
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> causal_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                  double scale, int64_t block_rows, int64_t block_keys) {
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(), "causal_forward: CPU tensors only");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat,
              "causal_forward: float32 only");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "causal_forward: q, k, v must be 4-D");
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1, "causal_forward: last dims must be dense");
  const int64_t b = q.size(0), h = q.size(1), n = q.size(2), d = q.size(3);
  const int64_t g = k.size(1), m = k.size(2), e = v.size(3);
  TORCH_CHECK(k.size(0) == b && v.size(0) == b && v.size(1) == g && v.size(2) == m && k.size(3) == d,
              "causal_forward: shapes disagree");
  TORCH_CHECK(g > 0 && h % g == 0 && m >= n, "causal_forward: h must be a multiple of g, and m >= n");
  TORCH_CHECK(block_rows > 0 && block_keys > 0, "causal_forward: block sizes must be positive");
  // a chunk's scores and the diagonal square share one buffer
  const int64_t keys_per_chunk = std::max(block_keys, block_rows);

  at::Tensor out = at::empty({b, h, n, e}, q.options());
  at::Tensor lse = at::empty({b, h, n}, q.options());
  if (n == 0 || b == 0 || h == 0) return {out, lse};

  const int64_t group = h / g;
  const int64_t row_blocks = (n + block_rows - 1) / block_rows;
  const float* q_data = q.data_ptr<float>();
  const float* k_data = k.data_ptr<float>();
  const float* v_data = v.data_ptr<float>();
  float* out_data = out.data_ptr<float>();
  float* lse_data = lse.data_ptr<float>();
  const float fscale = static_cast<float>(scale);
  const float minus_inf = -std::numeric_limits<float>::infinity();

  // Row block t of a head costs about t + 1 key blocks: the tasks pair the first block with the last, the second
  // with the one before it, so that the contiguous ranges parallel_for gives each thread carry equal work.
  at::parallel_for(0, b * h * row_blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(block_rows * keys_per_chunk);  // a key chunk, or the diagonal square
    std::vector<float> acc(block_rows * e);
    std::vector<float> running_max(block_rows), running_sum(block_rows);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t head_index = task / row_blocks, within = task % row_blocks;
      const int64_t block = (within % 2 == 0) ? within / 2 : row_blocks - 1 - within / 2;
      const int64_t batch = head_index / h, head = head_index % h, kv_head = head / group;
      const int64_t row0 = block * block_rows, rows = std::min(block_rows, n - row0);
      const float* q_block = q_data + batch * q.stride(0) + head * q.stride(1) + row0 * q.stride(2);
      const float* k_head = k_data + batch * k.stride(0) + kv_head * k.stride(1);
      const float* v_head = v_data + batch * v.stride(0) + kv_head * v.stride(1);
      std::fill(running_max.begin(), running_max.end(), minus_inf);
      std::fill(running_sum.begin(), running_sum.end(), 0.0f);
      const int64_t key_end = row0 + rows;  // the block's last row sees keys up to row0 + rows - 1
      // the keys every row of the block sees, in chunks of block_keys, then the block's own diagonal square
      for (int64_t key0 = 0; key0 < key_end;) {
        const int64_t keys = key0 < row0 ? std::min(keys_per_chunk, row0 - key0) : key_end - key0;
        matmul_transposed(rows, keys, d, q_block, q.stride(2), k_head + key0 * k.stride(2), k.stride(2), fscale,
                          0.0f, scores.data(), keys);
        const bool crosses_diagonal = key0 + keys > row0 + 1;
        for (int64_t r = 0; r < rows; ++r) {
          float* row = scores.data() + r * keys;
          if (crosses_diagonal) {
            const int64_t visible = std::max<int64_t>(0, std::min(keys, row0 + r + 1 - key0));
            std::fill(row + visible, row + keys, minus_inf);
          }
          const float block_max = row_max(row, keys);
          const float new_max = std::max(running_max[r], block_max);  // finite: every row sees key 0 first
          const float rescale = std::exp(running_max[r] - new_max);  // exp(-inf) = 0 on the first block
          const float block_sum = exp_shifted_sum(row, keys, new_max);
          running_sum[r] = running_sum[r] * rescale + block_sum;
          running_max[r] = new_max;
          if (key0 > 0) scale_row(acc.data() + r * e, e, rescale);
        }
        matmul(rows, e, keys, scores.data(), keys, v_head + key0 * v.stride(2), v.stride(2), key0 > 0 ? 1.0f : 0.0f,
               acc.data(), e);
        key0 += keys;
      }
      float* out_block = out_data + (head_index * n + row0) * e;
      float* lse_block = lse_data + head_index * n + row0;
      for (int64_t r = 0; r < rows; ++r) {
        const float inverse = 1.0f / running_sum[r];
        at::vec::map([inverse](Vec a) { return a * Vec(inverse); }, out_block + r * e, acc.data() + r * e, e);
        lse_block[r] = running_max[r] + std::log(running_sum[r]);
      }
    }
  });
  return {out, lse};
}

at::Tensor paged_forward(const at::Tensor& q, const at::Tensor& key_pool, const at::Tensor& value_pool,
                         const at::Tensor& pages, int64_t width, double scale) {
  for (const at::Tensor* t : {&q, &key_pool, &value_pool}) {
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat && t->dim() == 4 && t->stride(3) == 1,
                "paged_forward: q and the pools must be 4-D float32 CPU tensors with a dense last dimension");
  }
  TORCH_CHECK(pages.device().is_cpu() && pages.scalar_type() == at::kLong && pages.dim() == 2,
              "paged_forward: pages must be a 2-D int64 CPU tensor");
  const int64_t s = q.size(0), g = q.size(1), r = q.size(2), d = q.size(3);
  const int64_t pool_pages = key_pool.size(0), page = key_pool.size(2), e = value_pool.size(3);
  TORCH_CHECK(key_pool.size(1) == g && value_pool.size(1) == g && key_pool.size(3) == d &&
                  value_pool.size(0) == pool_pages && value_pool.size(2) == page && pages.size(0) == s,
              "paged_forward: shapes disagree");
  TORCH_CHECK(width > 0 && pages.size(1) * page >= width, "paged_forward: the pages hold fewer than width keys");
  at::Tensor table = pages.contiguous();
  const int64_t columns = (width + page - 1) / page;
  const int64_t* table_data = table.data_ptr<int64_t>();
  for (int64_t index = 0; index < s * table.size(1); ++index) {
    if (index % table.size(1) < columns) {
      TORCH_CHECK(table_data[index] >= 0 && table_data[index] < pool_pages,
                  "paged_forward: a page outside the pool");
    }
  }

  at::Tensor out = at::empty({s, g, r, e}, q.options());
  const float* q_data = q.data_ptr<float>();
  const float* k_data = key_pool.data_ptr<float>();
  const float* v_data = value_pool.data_ptr<float>();
  float* out_data = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);
  at::parallel_for(0, s * g, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(r * width);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t sequence = task / g, head = task % g;
      const int64_t* row_pages = table_data + sequence * table.size(1);
      const float* queries = q_data + sequence * q.stride(0) + head * q.stride(1);
      for (int64_t column = 0; column < columns; ++column) {  // scores: each key of the page against each query
        const float* keys = k_data + row_pages[column] * key_pool.stride(0) + head * key_pool.stride(1);
        const int64_t first = column * page, count = std::min(page, width - first);
        for (int64_t query = 0; query < r; ++query) {
          const float* q_row = queries + query * q.stride(2);
          for (int64_t key = 0; key < count; ++key) {
            const float* k_row = keys + key * key_pool.stride(2);
            scores[query * width + first + key] = dot(q_row, k_row, d) * fscale;
          }
        }
      }
      float* out_rows = out_data + (sequence * g + head) * r * e;
      for (int64_t query = 0; query < r; ++query) {  // softmax over the width, then the values it weighs
        float* row = scores.data() + query * width;
        const float inverse = 1.0f / exp_shifted_sum(row, width, row_max(row, width));
        float* out_row = out_rows + query * e;
        std::fill(out_row, out_row + e, 0.0f);
        for (int64_t column = 0; column < columns; ++column) {
          const float* values = v_data + row_pages[column] * value_pool.stride(0) + head * value_pool.stride(1);
          const int64_t first = column * page, count = std::min(page, width - first);
          for (int64_t key = 0; key < count; ++key) {
            const float* v_row = values + key * value_pool.stride(2);
            const Vec weight(row[first + key] * inverse);
            int64_t x = 0;
            for (; x + Vec::size() <= e; x += Vec::size()) {
              at::vec::fmadd(weight, Vec::loadu(v_row + x), Vec::loadu(out_row + x)).store(out_row + x);
            }
            for (; x < e; ++x) out_row[x] += row[first + key] * inverse * v_row[x];
          }
        }
      }
    }
  });
  return out;
}

TORCH_LIBRARY(multihead_native, library) {
  library.def(
      "causal_forward(Tensor q, Tensor k, Tensor v, float scale, int block_rows, int block_keys) -> (Tensor, Tensor)");
  library.impl("causal_forward", c10::DispatchKey::CPU, TORCH_FN(causal_forward));
  library.def(
      "paged_forward(Tensor q, Tensor key_pool, Tensor value_pool, Tensor pages, int width, float scale) -> Tensor");
  library.impl("paged_forward", c10::DispatchKey::CPU, TORCH_FN(paged_forward));
}
