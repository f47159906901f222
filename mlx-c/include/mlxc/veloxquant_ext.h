/* What upstream mlx-c lacks and veloxquant needs: a CPU custom primitive whose
 * work is a C callback (implemented in Rust), and the crossing of
 * `mlx.core.array` Python objects. Same conventions as mlxc.h. */
#ifndef MLXC_VELOXQUANT_EXT_H
#define MLXC_VELOXQUANT_EXT_H

#include "mlxc.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The MLX version these sources were compiled against. */
const char* vq_compiled_mlx_version(void);

/* MLX's kernel cache directory, as MLX's ptx_cache_dir() finds it
 * (MLX_PTX_CACHE_DIR, else <temp>/mlx/<version>/ptx), absolute. */
int vq_kernel_cache_dir(mlx_string* res);

/* A view of one evaluated, row-contiguous input or allocated output. */
typedef struct vq_tensor_view_ {
  void* data;
  const int* shape;
  int ndim;
  mlx_dtype dtype;
  size_t size;
} vq_tensor_view;

/* The work of a CPU primitive. Returns 0 on success; otherwise writes a
 * NUL-terminated message into `err` (at most `err_len` bytes). It runs on the
 * stream's CPU worker thread, so it must not unwind. */
typedef int (*vq_cpu_kernel_fn)(void* payload, const vq_tensor_view* inputs, size_t num_inputs,
                                vq_tensor_view* outputs, size_t num_outputs, char* err, size_t err_len);
typedef void (*vq_payload_free_fn)(void* payload);

/* Builds (lazily) the outputs of a CPU custom primitive named `name`.
 * Inputs are made row-contiguous by a lazy `contiguous` op first. The
 * primitive owns `payload` and frees it with `free_payload` when the graph
 * no longer needs it (also when this call fails). Output `i` has shape
 * `output_shapes[offsets[i] .. offsets[i] + ndims[i]]` and `output_dtypes[i]`.
 * `stream` must be a CPU stream. */
int vq_cpu_primitive_apply(mlx_vector_array* outputs, const char* name, vq_cpu_kernel_fn fn, void* payload,
                           vq_payload_free_fn free_payload, const mlx_vector_array inputs,
                           const int* output_shapes, const int* output_ndims, const mlx_dtype* output_dtypes,
                           size_t num_outputs, const mlx_stream stream);

/* ---- Graph inspection ---------------------------------------------------- */

/* Appends to `res` the name of every primitive MLX will run to evaluate
 * `outputs`: one entry per graph node not evaluated yet (outputs of one
 * primitive, such as a kernel's siblings, count once), inputs before the nodes
 * that read them. Evaluated and constant arrays add nothing. Builds and
 * evaluates nothing. `res` must be a vector from mlx_vector_string_new. */
int vq_graph_pending_primitives(mlx_vector_string res, const mlx_vector_array outputs);

/* ---- Python crossing (compiled only with the python feature) ------------- */

/* Registers this extension with mlx's nanobind domain; call once at import
 * with the extension module object. Returns 0 on success. */
int vq_python_bridge_init(void* module);
/* 1 if `obj` is an mlx.core.array, 0 otherwise. */
int vq_python_is_array(void* obj);
/* Shares the C++ array held by `obj` (no copy, no evaluation). */
int vq_python_array_borrow(mlx_array* res, void* obj);
/* A new Python mlx.core.array owning (a reference to) `arr`; NULL on failure
 * with a Python exception set. */
void* vq_python_array_wrap(const mlx_array arr);

#ifdef __cplusplus
}
#endif

#endif
