// Internals of DCP safetensors folders (Note [DCP safetensors] in dtrain/dcp.h): a flat range of a
// tensor cut into n-D boxes, and a folder read as chunks of whole tensors.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace dtrain::detail {

// An n-D box of a tensor: offsets[d] .. offsets[d] + sizes[d] in every dimension d.
struct Box {
  std::vector<int64_t> offsets, sizes;
  int64_t begin = 0;  // the flat (row-major) index of its first element
  int64_t numel() const;
};

// Elements [begin, end) of a tensor of `shape` in row-major order, as the fewest boxes this
// recursion finds: at most 2*ndim-1 (one for a 0-dim tensor). Each box is contiguous in row-major
// order (all dimensions before one are of size 1, all after it whole), so its elements are flat
// elements [box.begin, box.begin + box.numel()); the boxes come in flat order. 0 <= begin <= end
// <= numel.
std::vector<Box> boxes_of_range(const std::vector<int64_t>& shape, int64_t begin, int64_t end);

// A tensor of a DCP safetensors folder: its chunks, each in one file.
struct DcpChunk {
  std::string file;  // path
  std::vector<int64_t> offsets, sizes;
};
struct DcpTensor {
  at::ScalarType dtype;
  std::vector<int64_t> shape;
  std::vector<DcpChunk> chunks;
};

// The index dtrain's export writes last (Note [DCP safetensors]).
inline constexpr const char* kDcpIndexName = "dtrain_dcp_index.json";
// "shard-00003-part-1.safetensors"
std::string dcp_part_name(int64_t rank, int64_t part);
// Whether `name` is a file name dcp_part_name() gives.
bool is_dcp_part_name(const std::string& name);

// A DCP safetensors folder: every file's header read and checked, every tensor's chunks checked to
// tile it (constructor), and the data of a file read (and its CRC-32 checked) when a chunk of it
// is first needed, then kept.
class DcpFolder {
 public:
  // Throws UsageError naming the folder, file and tensor that are wrong (Note [DCP safetensors]).
  explicit DcpFolder(std::string dir);
  const std::string& dir() const { return dir_; }
  // Every tensor by name.
  const std::map<std::string, DcpTensor>& tensors() const { return tensors_; }
  const DcpTensor* find(const std::string& name) const;
  // Copies the elements of tensor `name` that lie in `box` into `out` (of box.sizes), from
  // whichever chunks hold them.
  void read_box(const std::string& name, const Box& box, at::Tensor out);
  // The whole tensor, assembled.
  at::Tensor read(const std::string& name);

 private:
  const at::Tensor& chunk_data(const DcpChunk& chunk, const std::string& name);

  std::string dir_;
  std::map<std::string, DcpTensor> tensors_;
  std::map<std::string, std::map<std::string, at::Tensor>> data_;  // file -> name -> chunk
};

}  // namespace dtrain::detail
