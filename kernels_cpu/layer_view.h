// One layer of a stacked buffer [L, ...] as a buffer of its own, read in place: the weights of a
// target whose layers run under a scan (peagle_jax/models/layer_stack.py). Slicing the layer out
// in the graph would make XLA:CPU copy it before every call (results/compile_cost/README.md).
#pragma once

#include <cstdint>

#include "xla/ffi/api/ffi.h"

namespace peagle {

template <xla::ffi::DataType T>
class LayerOf {
 public:
  LayerOf(const xla::ffi::Buffer<T>& stack, const xla::ffi::Buffer<xla::ffi::S32>& layer) {
    auto d = stack.dimensions();
    const int64_t index = layer.element_count() == 1 ? *layer.typed_data() : -1;
    ok_ = d.size() >= 2 && index >= 0 && index < d[0];
    view_.struct_size = XLA_FFI_Buffer_STRUCT_SIZE;
    view_.extension_start = nullptr;
    view_.dtype = static_cast<XLA_FFI_DataType>(T);
    const int64_t bytes = ok_ ? static_cast<int64_t>(stack.size_bytes()) / d[0] : 0;
    view_.data = static_cast<char*>(stack.untyped_data()) + (ok_ ? index * bytes : 0);
    view_.rank = ok_ ? static_cast<int64_t>(d.size()) - 1 : 0;
    view_.dims = ok_ ? const_cast<int64_t*>(d.begin() + 1) : nullptr;
  }

  bool ok() const { return ok_; }
  xla::ffi::Buffer<T> buffer() const { return xla::ffi::Buffer<T>(&view_); }

 private:
  XLA_FFI_Buffer view_{};
  bool ok_ = false;
};

}  // namespace peagle
