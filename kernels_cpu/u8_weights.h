// The XLA FFI entry points of a matmul on weights packed in bytes (gemv_quant.cc, gemv_group.cc):
// bf16 rows x [M, I] times uint8-packed weights, the float32 sums as they are or rounded to bf16
// in the kernel. `Impl(pool, x, w, y32, yb16)` computes the call, given exactly one of the two
// result pointers.
#pragma once

#include <cstdint>

#include "xla/ffi/api/ffi.h"
#include "layer_view.h"

namespace peagle {

using U8WeightsImpl = xla::ffi::Error (*)(xla::ffi::ThreadPool&, xla::ffi::Buffer<xla::ffi::BF16>&,
                                          xla::ffi::Buffer<xla::ffi::U8>&, float*, uint16_t*);

template <U8WeightsImpl Impl>
xla::ffi::Error U8WeightsF32(xla::ffi::ThreadPool pool, xla::ffi::Buffer<xla::ffi::BF16> x,
                             xla::ffi::Buffer<xla::ffi::U8> w, xla::ffi::ResultBuffer<xla::ffi::F32> y) {
  return Impl(pool, x, w, y->typed_data(), nullptr);
}

template <U8WeightsImpl Impl>
xla::ffi::Error U8WeightsBf16(xla::ffi::ThreadPool pool, xla::ffi::Buffer<xla::ffi::BF16> x,
                              xla::ffi::Buffer<xla::ffi::U8> w, xla::ffi::ResultBuffer<xla::ffi::BF16> y) {
  return Impl(pool, x, w, nullptr, reinterpret_cast<uint16_t*>(y->typed_data()));
}

// The same on layer `layer` of stacked weights [L, ...] (peagle/layer_view.h).
template <U8WeightsImpl Impl, xla::ffi::DataType Out>
xla::ffi::Error U8WeightsLayer(xla::ffi::ThreadPool pool, xla::ffi::Buffer<xla::ffi::BF16> x,
                               xla::ffi::Buffer<xla::ffi::U8> stack, xla::ffi::Buffer<xla::ffi::S32> layer,
                               xla::ffi::ResultBuffer<Out> y) {
  LayerOf<xla::ffi::U8> view(stack, layer);
  if (!view.ok()) return xla::ffi::Error::InvalidArgument("stacked weights [L, ...] and a layer index in [0, L) expected");
  auto w = view.buffer();
  if constexpr (Out == xla::ffi::F32) return Impl(pool, x, w, y->typed_data(), nullptr);
  else return Impl(pool, x, w, nullptr, reinterpret_cast<uint16_t*>(y->typed_data()));
}

}  // namespace peagle

#define PEAGLE_U8_WEIGHTS_HANDLER(name, entry, out)                                       \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(name, entry,                                              \
                                xla::ffi::Ffi::Bind()                                     \
                                    .Ctx<xla::ffi::ThreadPool>()                          \
                                    .Arg<xla::ffi::Buffer<xla::ffi::BF16>>()              \
                                    .Arg<xla::ffi::Buffer<xla::ffi::U8>>()                \
                                    .Ret<xla::ffi::Buffer<out>>());

#define PEAGLE_U8_LAYER_HANDLER(name, impl, out)                                          \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(name, (peagle::U8WeightsLayer<impl, out>),                \
                                xla::ffi::Ffi::Bind()                                     \
                                    .Ctx<xla::ffi::ThreadPool>()                          \
                                    .Arg<xla::ffi::Buffer<xla::ffi::BF16>>()              \
                                    .Arg<xla::ffi::Buffer<xla::ffi::U8>>()                \
                                    .Arg<xla::ffi::Buffer<xla::ffi::S32>>()               \
                                    .Ret<xla::ffi::Buffer<out>>());

// `name` (float32 sums) and `name`_to_bf16 for one implementation, and both on one layer of
// stacked weights (`name`_layer, `name`_layer_to_bf16).
#define PEAGLE_U8_WEIGHTS_HANDLERS(name, impl)                                            \
  PEAGLE_U8_WEIGHTS_HANDLER(name, peagle::U8WeightsF32<impl>, xla::ffi::F32)            \
  PEAGLE_U8_WEIGHTS_HANDLER(name##_to_bf16, peagle::U8WeightsBf16<impl>, xla::ffi::BF16) \
  PEAGLE_U8_LAYER_HANDLER(name##_layer, impl, xla::ffi::F32)                            \
  PEAGLE_U8_LAYER_HANDLER(name##_layer_to_bf16, impl, xla::ffi::BF16)
