// Elementwise activations and their derivatives, as runtime/kernels/activations.py writes
// them (fp32): silu, GELU in the tanh form and the exact erf form. swiglu.cu (the gated
// forms, swiglu / geglu) and gelu.cu (gelu alone) use them; `Act` numbers them as the
// launchers' `activation` argument does.
#pragma once

#include "common.cuh"

namespace modulec {
namespace act_detail {

// 1 / (1 + exp(-g)) with the precise expf, as the reference's sigmoid
__device__ __forceinline__ float sigmoid(float g) { return 1.f / (1.f + expf(-g)); }

enum Act : int { kSilu = 0, kGeluTanh = 1, kGeluErf = 2 };  // the launchers' activation

constexpr float kGeluC = 0.7978845608028654f;   // sqrt(2 / pi)
constexpr float kGeluA = 0.044715f;
constexpr float kInvSqrt2 = 0.7071067811865476f;
constexpr float kInvSqrt2Pi = 0.3989422804014327f;

// act(g) and act'(g) as runtime/kernels/activations.py writes them
template <int ACT>
__device__ __forceinline__ float act(float g) {
  if constexpr (ACT == kSilu) return g * sigmoid(g);
  if constexpr (ACT == kGeluTanh)
    return 0.5f * g * (1.f + tanhf(kGeluC * (g + kGeluA * g * g * g)));
  return 0.5f * g * (1.f + erff(g * kInvSqrt2));
}

// silu'(g) = sigmoid(g) + silu(g) * sigmoid(-g) (sigmoid(-g) computed, not 1 - sigmoid(g),
// as the reference); the GELUs' derivatives as gelu_grad's
template <int ACT>
__device__ __forceinline__ float act_grad(float g) {
  if constexpr (ACT == kSilu) return sigmoid(g) + g * sigmoid(g) * sigmoid(-g);
  if constexpr (ACT == kGeluTanh) {
    const float t = tanhf(kGeluC * (g + kGeluA * g * g * g));
    return 0.5f * (1.f + t) + 0.5f * g * (1.f - t * t) * kGeluC * (1.f + 3.f * kGeluA * g * g);
  }
  return 0.5f * (1.f + erff(g * kInvSqrt2)) + g * expf(-0.5f * g * g) * kInvSqrt2Pi;
}

}  // namespace act_detail

using act_detail::act;
using act_detail::act_grad;
using act_detail::Act;
using act_detail::kSilu;
using act_detail::kGeluTanh;
using act_detail::kGeluErf;

}  // namespace modulec
