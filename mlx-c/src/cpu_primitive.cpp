// A CPU custom primitive whose work is a C callback (the Rust kernels).
//
// It joins MLX's lazy graph like any op: building it allocates nothing and
// evaluates nothing; at evaluation, `eval_cpu` allocates the outputs and
// enqueues the callback on the stream's CPU command encoder, as MLX's own CPU
// ops do.
#include <cstdio>
#include <memory>

#include "mlx/backend/cpu/encoder.h"
#include "mlx/primitives.h"
#include "mlxc/veloxquant_ext.h"
#include "private.h"

namespace {

using namespace mlxc;

class CallbackPrimitive : public mx::Primitive {
 public:
  CallbackPrimitive(mx::Stream stream, std::string name, vq_cpu_kernel_fn fn, std::shared_ptr<void> payload)
      : mx::Primitive(stream), name_(std::move(name)), fn_(fn), payload_(std::move(payload)) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    for (auto& in : inputs) {
      if (!in.flags().row_contiguous) {
        throw std::runtime_error(name_ + ": input is not row-contiguous");
      }
    }
    for (auto& out : outputs) {
      out.set_data(mx::allocator::malloc(out.nbytes()));
    }
    // The task owns what it touches: the inputs' and outputs' buffers stay
    // alive until it has run, whatever happens to the arrays meanwhile.
    struct Task {
      std::vector<std::shared_ptr<mx::array::Data>> keep;
      std::vector<vq_tensor_view> in_views, out_views;
      std::vector<mx::Shape> shapes;
    };
    auto task = std::make_shared<Task>();
    task->shapes.reserve(inputs.size() + outputs.size());
    auto view = [&](const mx::array& a) {
      task->keep.push_back(a.data_shared_ptr());
      task->shapes.push_back(a.shape());
      return vq_tensor_view{const_cast<void*>(static_cast<const void*>(a.data<uint8_t>())),
                            task->shapes.back().data(), static_cast<int>(a.ndim()), from_dtype(a.dtype()),
                            a.size()};
    };
    for (auto& in : inputs) task->in_views.push_back(view(in));
    for (auto& out : outputs) task->out_views.push_back(view(out));

    auto& encoder = mx::cpu::get_command_encoder(stream());
    for (auto& in : inputs) encoder.set_input_array(in);
    for (auto& out : outputs) encoder.set_output_array(out);
    encoder.dispatch([task, fn = fn_, payload = payload_, name = name_]() {
      char err[512] = {0};
      int status = fn(payload.get(), task->in_views.data(), task->in_views.size(), task->out_views.data(),
                      task->out_views.size(), err, sizeof(err));
      if (status != 0) {
        // Arguments are validated when the op is built, so this is a bug in
        // the kernel; MLX reports a throwing task at the next evaluation.
        throw std::runtime_error(name + ": " + (err[0] ? err : "CPU kernel failed"));
      }
    });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error(name_ + ": this CPU primitive cannot run on a GPU stream");
  }

  const char* name() const override {
    return name_.c_str();
  }

 private:
  std::string name_;
  vq_cpu_kernel_fn fn_;
  std::shared_ptr<void> payload_;
};

}  // namespace

extern "C" {

const char* vq_compiled_mlx_version(void) {
  return VQ_MLX_VERSION;
}

int vq_cpu_primitive_apply(mlx_vector_array* outputs, const char* name, vq_cpu_kernel_fn fn, void* payload,
                           vq_payload_free_fn free_payload, const mlx_vector_array inputs,
                           const int* output_shapes, const int* output_ndims, const mlx_dtype* output_dtypes,
                           size_t num_outputs, const mlx_stream s) {
  // Own the payload first, so that every failure below frees it.
  std::shared_ptr<void> owned(payload, [free_payload](void* p) {
    if (free_payload && p) free_payload(p);
  });
  return guard([&] {
    if (!fn) throw std::invalid_argument("null CPU kernel function");
    auto& st = stream(s);
    if (st.device.type != mx::Device::cpu) {
      throw std::invalid_argument(std::string(name) + ": a CPU primitive needs a CPU stream");
    }
    std::vector<mx::array> ins;
    for (auto& in : vec(inputs)) {
      // An input already evaluated row-contiguous needs no Contiguous node
      // (host time per op is what a decode step pays).
      ins.push_back(in.is_available() && in.flags().row_contiguous ? in : mx::contiguous(in, false, st));
    }
    std::vector<mx::Shape> shapes;
    std::vector<mx::Dtype> dtypes;
    size_t offset = 0;
    for (size_t i = 0; i < num_outputs; ++i) {
      shapes.push_back(to_shape(output_shapes + offset, static_cast<size_t>(output_ndims[i])));
      dtypes.push_back(to_dtype(output_dtypes[i]));
      offset += static_cast<size_t>(output_ndims[i]);
    }
    auto prim = std::make_shared<CallbackPrimitive>(st, name ? name : "veloxquant_cpu", fn, owned);
    set_vector(outputs, mx::array::make_arrays(std::move(shapes), dtypes, prim, std::move(ins)));
  });
}

}  // extern "C"
