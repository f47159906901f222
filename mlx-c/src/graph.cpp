// Graph inspection: the primitives that evaluating some arrays would run.
#include <unordered_set>
#include <utility>

#include "mlx/primitives.h"
#include "mlxc/veloxquant_ext.h"
#include "private.h"

using namespace mlxc;

namespace {

// A node MLX still has to run: it has a primitive and has not been scheduled
// (evaluation detaches outputs from the graph, constants never had one).
bool pending(const mx::array& a) {
  return a.has_primitive() && a.status() == mx::array::Status::unscheduled;
}

}  // namespace

extern "C" int vq_graph_pending_primitives(mlx_vector_string res, const mlx_vector_array outputs) {
  return guard([&] {
    auto& names = strings(res);
    std::unordered_set<std::uintptr_t> seen_arrays;
    std::unordered_set<const mx::Primitive*> seen_nodes;
    // Iterative post-order walk: (array, inputs pushed). Pushed in reverse so
    // that outputs and inputs are walked in their given order.
    std::vector<std::pair<mx::array, bool>> stack;
    auto& outs = vec(outputs);
    for (auto it = outs.rbegin(); it != outs.rend(); ++it) stack.emplace_back(*it, false);
    while (!stack.empty()) {
      auto [a, expanded] = stack.back();
      stack.pop_back();
      if (!pending(a)) continue;
      if (expanded) {
        const mx::Primitive* node = &a.primitive();
        if (seen_nodes.insert(node).second) names.emplace_back(a.primitive().name());
        continue;
      }
      if (!seen_arrays.insert(a.id()).second) continue;
      stack.emplace_back(a, true);
      auto& ins = a.inputs();
      for (auto it = ins.rbegin(); it != ins.rend(); ++it) {
        if (pending(*it) && !seen_arrays.count(it->id())) stack.emplace_back(*it, false);
      }
    }
  });
}
