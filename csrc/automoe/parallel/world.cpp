#include "automoe/parallel/world.h"

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>

#include "automoe/core/error.h"

namespace automoe::parallel {

Mesh make_mesh(int64_t world_size, int64_t ep, int64_t dp, int64_t num_experts,
               const std::string& origin) {
  AUTOMOE_CHECK(world_size >= 1, origin, ": the world size must be at least 1, got ", world_size);
  AUTOMOE_CHECK(ep >= 1, origin, ".ep: expected a positive number of expert-parallel ranks, got ",
                ep);
  AUTOMOE_CHECK(world_size % ep == 0, origin, ".ep = ", ep, " does not divide the ", world_size,
                " processes (world = dp x ep)");
  AUTOMOE_CHECK(ep == 1 || (num_experts > 0 && num_experts % ep == 0), origin, ".ep = ", ep,
                " does not divide the model's ", num_experts,
                " experts (each EP rank holds the same number)");
  Mesh m;
  m.world = world_size;
  m.ep = ep;
  m.dp = world_size / ep;
  AUTOMOE_CHECK(dp == 0 || dp == m.dp, origin, ".dp = ", dp, " but ", world_size,
                " processes with ep = ", ep, " make dp = ", m.dp, " (world = dp x ep; dp: auto)");
  return m;
}

ExpertRange experts_of(int64_t ep_rank, int64_t ep, int64_t num_experts) {
  const int64_t per = num_experts / ep;
  return {ep_rank * per, per};
}

World world_from_group_names(const std::string& world_group, const std::string& ep_group,
                             const std::string& dp_group, const Mesh& mesh, c10::Device device) {
  World w;
  w.mesh = mesh;
  w.device = device;
  auto resolve = [](const std::string& name, const char* role) -> Group {
    if (name.empty()) return {};
    try {
      return c10d::resolve_process_group(name);
    } catch (const std::exception& e) {
      fail("the ", role, " process group \"", name,
           "\" is not registered with torch.distributed in this process: ", e.what());
    }
  };
  w.world = resolve(world_group, "world");
  w.ep = resolve(ep_group, "expert-parallel");
  w.dp = resolve(dp_group, "data-parallel");
  AUTOMOE_CHECK(w.world, "a distributed run needs the world process group");
  w.rank = w.world->getRank();
  AUTOMOE_CHECK(w.world->getSize() == mesh.world, "the world group has ", w.world->getSize(),
                " ranks, the mesh ", mesh.world);
  auto check = [&](const Group& g, int64_t size, int64_t rank, const char* role) {
    if (size == 1 && !g) return;
    AUTOMOE_CHECK(g && g->getSize() == size && g->getRank() == rank, "the ", role,
                  " group of rank ", w.rank, " must have ", size, " ranks with this one at ", rank,
                  "; found ", g ? g->getSize() : 0, " ranks, this one at ", g ? g->getRank() : -1);
  };
  check(w.ep, mesh.ep, w.ep_rank(), "expert-parallel");
  check(w.dp, mesh.dp, w.dp_rank(), "data-parallel");
  return w;
}

void wait(const c10::intrusive_ptr<c10d::Work>& work, const char* what) {
  try {
    work->wait();
  } catch (const std::exception& e) {
    fail(what, ": a collective failed (another rank died, stalled past the timeout or ran a "
               "different step): ", e.what());
  }
}

void all_reduce_sum(const Group& group, std::vector<at::Tensor> tensors, const char* what) {
  if (!group || group->getSize() == 1 || tensors.empty()) return;
  // One collective per tensor, all in flight together (c10d's list form would also sum the
  // tensors of the list with each other: it means one tensor per local device).
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  for (const at::Tensor& t : tensors) {
    std::vector<at::Tensor> one{t};
    works.push_back(group->allreduce(one));
  }
  for (const auto& w : works) wait(w, what);
}

void all_reduce_sum(const Group& group, const at::Tensor& t, const char* what) {
  all_reduce_sum(group, std::vector<at::Tensor>{t}, what);
}

std::vector<int64_t> all_gather_ints(const Group& group, const std::vector<int64_t>& mine,
                                     c10::Device device, const char* what) {
  if (!group || group->getSize() == 1) return mine;
  const int64_t P = group->getSize(), n = static_cast<int64_t>(mine.size());
  at::Tensor in = at::tensor(mine, at::kLong).to(device);
  at::Tensor out = at::empty({P * n}, in.options());
  wait(group->_allgather_base(out, in), what);
  out = out.cpu();
  return {out.data_ptr<int64_t>(), out.data_ptr<int64_t>() + P * n};
}

at::Tensor all_gather_rows(const Group& group, const at::Tensor& rows, const char* what) {
  if (!group || group->getSize() == 1) return rows;
  at::NoGradGuard no_grad;  // (the backend fills views of `out`)
  std::vector<int64_t> shape = rows.sizes().vec();
  shape[0] *= group->getSize();
  at::Tensor out = at::empty(shape, rows.options());
  at::Tensor in = rows.detach().contiguous();
  wait(group->_allgather_base(out, in), what);
  return out;
}

std::vector<std::string> all_gather_strings(const Group& group, const std::string& mine,
                                            c10::Device device, const char* what) {
  if (!group || group->getSize() == 1) return {mine};
  const int64_t P = group->getSize();
  const auto lengths = all_gather_ints(group, {static_cast<int64_t>(mine.size())}, device, what);
  const int64_t longest = *std::max_element(lengths.begin(), lengths.end());
  at::Tensor in = at::zeros({std::max<int64_t>(longest, 1)}, at::kByte);
  std::memcpy(in.data_ptr(), mine.data(), mine.size());
  in = in.to(device);
  at::Tensor out = at::empty({P * in.numel()}, in.options());
  wait(group->_allgather_base(out, in), what);
  out = out.cpu();
  std::vector<std::string> all;
  for (int64_t r = 0; r < P; ++r) {
    const char* p = reinterpret_cast<const char*>(out.data_ptr<uint8_t>()) + r * in.numel();
    all.emplace_back(p, static_cast<size_t>(lengths[r]));
  }
  return all;
}

void agree(const Group& group, const std::string& error, c10::Device device, const char* what) {
  if (!group || group->getSize() == 1) {
    if (!error.empty()) throw Error(error);
    return;
  }
  const std::vector<std::string> all = all_gather_strings(group, error, device, what);
  for (size_t r = 0; r < all.size(); ++r) {
    if (!all[r].empty()) fail(what, ": rank ", r, ": ", all[r]);
  }
}

}  // namespace automoe::parallel
