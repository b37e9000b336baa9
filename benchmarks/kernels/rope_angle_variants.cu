// What RoPE's angles cost at LoRA 8B's shape (csrc/kernels/rope.cu, q and k rotated in
// place inside the fused QKV projection's output [T, 6144]: B=1, T=2048, D=128, 32 / 8
// heads). rope.cu's general kernel gives a thread one head's 8 pairs and computes their 8
// sincosf, so the 40 heads of a position compute the same angles 40 times; the shipped
// launch now takes rope_rows_kernel (the shared angles below, a block a position).
// Against the general kernel (MODULEC_ROPE_ROWS=0), each timed alone with L2 flushed,
// d_x compared with its bits:
//   table   the angles read from a (cos, sin) table per (position, frequency), made once
//           by the same rope_angles code (a step would make it once for its 64 calls);
//           its making timed apart
//   shared  4 heads a warp share their angles: the lanes of one position's 8-pair unit
//           each compute 2 of its 8 sincosf and pass them round with shuffles (the same
//           sincosf calls, so the same angles; no table, nothing to plan); the shipped
//           launch does this with a block a row (one position's q and k heads)
// docs/gpu.md "LoRA" (the leads). On a GPU machine:
//   nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -Icsrc/kernels \
//     benchmarks/kernels/rope_angle_variants.cu -o /tmp/rope_angles && /tmp/rope_angles
#include "../../csrc/kernels/rope.cu"
#include "variants_harness.cuh"

#include <cstdio>
#include <vector>

using bf16 = __nv_bfloat16;

namespace exp_ {
using modulec::RopeShape;
using modulec::RopeTargets;
constexpr int VEC = 8;

// (cos, sin) of every (t, frequency), scaled and signed as rope_angles gives them
__global__ void angle_table(RopeShape s, float2* __restrict__ table) {
  const int64_t units = s.n / VEC;
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= s.T * units) return;
  const int64_t t = idx / units, unit = idx - t * units;
  float cs[VEC], sn[VEC];
  modulec::rope_angles<VEC>(s, static_cast<float>(t), unit * VEC, cs, sn);
#pragma unroll
  for (int j = 0; j < VEC; ++j) table[t * s.n + unit * VEC + j] = make_float2(cs[j], sn[j]);
}

// one head's VEC pairs at (b, t) rotated in place (rotate-half), given the angles
__device__ __forceinline__ void rotate(bf16* x, const RopeShape& s, int64_t b, int64_t t,
                                       int64_t head, int64_t i0, const float (&cs)[VEC],
                                       const float (&sn)[VEC]) {
  float lo[VEC], hi[VEC], a[VEC], c[VEC];
  const int64_t base = b * s.xb + head * s.xh + t * s.xt;
  modulec::load_vec<bf16, VEC>(x + base + i0, 0, lo);
  modulec::load_vec<bf16, VEC>(x + base + i0 + s.n, 0, hi);
#pragma unroll
  for (int j = 0; j < VEC; ++j) {
    a[j] = lo[j] * cs[j] - hi[j] * sn[j];
    c[j] = hi[j] * cs[j] + lo[j] * sn[j];
  }
  modulec::store_vec<bf16, VEC>(x + base + i0, 0, a);
  modulec::store_vec<bf16, VEC>(x + base + i0 + s.n, 0, c);
}

// the shipped mapping (a thread one head's unit, blockIdx.y the head), angles from the table
__global__ void rope_from_table(RopeTargets<bf16> p, const float2* __restrict__ table) {
  const int which = static_cast<int>(blockIdx.y) >= p.split;
  const RopeShape& s = p.s[which];
  const int64_t head = static_cast<int64_t>(blockIdx.y) - (which ? p.split : 0);
  const int64_t units = s.n / VEC;
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= s.B * s.T * units) return;
  const int64_t bt = idx / units, unit = idx - bt * units, b = bt / s.T, t = bt - b * s.T;
  const float4* at = reinterpret_cast<const float4*>(table + t * s.n + unit * VEC);
  float cs[VEC], sn[VEC];
#pragma unroll
  for (int q = 0; q < VEC / 2; ++q) {
    const float4 v = at[q];
    cs[2 * q] = v.x;
    sn[2 * q] = v.y;
    cs[2 * q + 1] = v.z;
    sn[2 * q + 1] = v.w;
  }
  rotate(const_cast<bf16*>(p.x[which]), s, b, t, head, unit * VEC, cs, sn);
}

// 4 heads a warp: lane = 8 head_in_group + unit (n == 8 VEC: 8 units a head); blockIdx.y
// the group of 4 heads; each warp one (b, t); the angles from rope.cu's warp_angles (the
// shipped rope_rows_kernel's, which gives a block one (b, t) instead)
__global__ void rope_shared(RopeTargets<bf16> p) {
  const int group = static_cast<int>(blockIdx.y);
  const int which = group >= p.split;
  const RopeShape& s = p.s[which];
  const int lane = threadIdx.x % 32, unit = lane % 8, h = lane / 8;
  const int64_t head = (static_cast<int64_t>(group) - (which ? p.split : 0)) * 4 + h;
  const int64_t bt = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  if (bt >= s.B * s.T) return;  // uniform across the warp
  const int64_t b = bt / s.T, t = bt - b * s.T;
  float cs[VEC], sn[VEC];
  modulec::warp_angles<VEC, 8>(s, static_cast<float>(t), unit, h, cs, sn);
  if (head < s.H) rotate(const_cast<bf16*>(p.x[which]), s, b, t, head, unit * VEC, cs, sn);
}
// the bytes alone: each row's q and k read and written back in place (a block a row)
__global__ void touch_rows(uint4* x, int64_t row_vecs, int64_t ld_vecs) {
  uint4* row = x + static_cast<int64_t>(blockIdx.x) * ld_vecs;
  for (int64_t i = threadIdx.x; i < row_vecs; i += blockDim.x) {
    uint4 v = row[i];
    v.x ^= 1u;  // a change, so neither load nor store can go
    row[i] = v;
  }
}
}  // namespace exp_

int main() {
  init_flush();
  cudaDeviceProp prop; cudaGetDeviceProperties(&prop, 0);
  const int64_t T = 2048, D = 128, n = 64, Hq = 32, Hk = 8, width = (Hq + 2 * Hk) * D;
  const size_t elems = T * width;
  bf16 *orig = upload(elems, 7), *ref, *got;
  CK(cudaMalloc(&ref, elems * 2));
  CK(cudaMalloc(&got, elems * 2));
  std::vector<float> freq(n);
  for (int i = 0; i < n; ++i) freq[i] = static_cast<float>(std::pow(500000.0, -2.0 * i / D));
  float* inv_freq;
  CK(cudaMalloc(&inv_freq, n * 4));
  CK(cudaMemcpy(inv_freq, freq.data(), n * 4, cudaMemcpyHostToDevice));
  float2* table;
  CK(cudaMalloc(&table, T * n * sizeof(float2)));
  // q's heads at columns 0.., k's after them: strides over (b, h, t) of [1, H, T, D] views
  auto tensor = [&](bf16* buf, int64_t col, int64_t H) {
    modulec::RopeTensor r;
    r.x = buf + col; r.out = buf + col; r.H = H;
    const int64_t st[3] = {T * width, D, width};
    for (int i = 0; i < 3; ++i) r.x_strides[i] = r.out_strides[i] = st[i];
    return r;
  };
  auto shipped = [&](bf16* buf) {
    CK(modulec::launch_rope_pair(modulec::DType::BF16, tensor(buf, 0, Hq), tensor(buf, Hq * D, Hk),
                                 nullptr, 0, 1, T, D, inv_freq, n, 1.f, false, false, 0));
  };
  auto targets = [&](bf16* buf) {
    modulec::RopeTargets<bf16> p{};
    const int64_t heads[2] = {Hq, Hk}, cols[2] = {0, Hq * D};
    for (int i = 0; i < 2; ++i) {
      p.x[i] = buf + cols[i];
      p.out[i] = buf + cols[i];
      p.s[i] = exp_::RopeShape{1, heads[i], T, D, T * width, D, width, T * width, D, width,
                               0, inv_freq, n, 0, 1.f, 1.f};
    }
    return p;
  };
  printf("%s: LoRA 8B's rope (B=1, T=2048, D=128, q 32 + k 8 heads in place in [T, %ld])\n",
         prop.name, (long)width);
  const double mb = 2.0 * T * (Hq + Hk) * D * 2 / 1e6;  // q and k read and written
  auto report = [&](const char* what, float us) {
    printf("  %-44s %7.1f us %5.2f TB/s\n", what, us, mb / us);
  };
  auto reset = [&](bf16* buf) { CK(cudaMemcpy(buf, orig, elems * 2, cudaMemcpyDeviceToDevice)); };
  reset(ref);
  setenv("MODULEC_ROPE_ROWS", "0", 1);  // rope.cu's general kernel: the reference bits
  shipped(ref);
  report("a head a thread, its 8 sincosf", time_us([&] { shipped(got); }, 25, 3));
  unsetenv("MODULEC_ROPE_ROWS");
  char buf[96];
  reset(got);
  shipped(got);
  snprintf(buf, sizeof buf, "shipped: a block a position (diff %.1e)", max_diff(ref, got, elems));
  report(buf, time_us([&] { shipped(got); }, 25, 3));
  report("  the bytes alone (q and k rows in place)", time_us([&] {
    exp_::touch_rows<<<static_cast<unsigned>(T), 320>>>(reinterpret_cast<uint4*>(got),
                                                        (Hq + Hk) * D / 8, width / 8); }, 25, 3));

  modulec::RopeTargets<bf16> p = targets(got);
  const int64_t units = n / exp_::VEC;
  const unsigned table_blocks = static_cast<unsigned>((T * units + 255) / 256);
  report("  the table made (T x n sincosf)", time_us([&] {
    exp_::angle_table<<<table_blocks, 256>>>(p.s[0], table); }, 25, 3));
  p.split = static_cast<int>(Hq);
  const dim3 grid_t(static_cast<unsigned>((T * units + 255) / 256), static_cast<unsigned>(Hq + Hk));
  reset(got);
  exp_::rope_from_table<<<grid_t, 256>>>(p, table);
  snprintf(buf, sizeof buf, "table (diff %.1e)", max_diff(ref, got, elems));
  report(buf, time_us([&] { exp_::rope_from_table<<<grid_t, 256>>>(p, table); }, 25, 3));

  p.split = static_cast<int>(Hq / 4);
  const dim3 grid_s(static_cast<unsigned>((T + 7) / 8), static_cast<unsigned>((Hq + Hk) / 4));
  reset(got);
  exp_::rope_shared<<<grid_s, 256>>>(p);
  snprintf(buf, sizeof buf, "shared, 4 heads a warp (diff %.1e)", max_diff(ref, got, elems));
  report(buf, time_us([&] { exp_::rope_shared<<<grid_s, 256>>>(p); }, 25, 3));
  cudaFree(orig); cudaFree(ref); cudaFree(got); cudaFree(inv_freq); cudaFree(table);
  return 0;
}
