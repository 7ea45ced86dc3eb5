// Freeing and re-allocating the memory behind a tensor while every tensor object over it stays
// valid.
//
// Stage 3 frees a unit's gathered parameters between uses, but autograd keeps the parameters (and
// views of them, such as a Linear's weight.t()) saved for backward. Swapping the parameters' data
// would leave those saved views holding the old buffer, so its memory would never be freed.
// Instead, as FSDP does, the storage itself is emptied (0 bytes) and later re-allocated in place:
// every tensor and view over it sees the new memory, and no version counter changes (autograd's
// saved-tensor checks stay quiet). Device generic: the storage's own allocator (CPU, or the CUDA
// caching allocator) provides the memory.
#pragma once

#include <ATen/core/Tensor.h>

namespace dtrain::detail {

// Releases the memory of `tensor`'s storage; the storage object and every view over it stay alive.
void free_storage(const at::Tensor& tensor);
// Gives `tensor`'s storage `bytes` bytes of fresh (uninitialized) memory, if it holds none now.
void allocate_storage(const at::Tensor& tensor, size_t bytes);
// Bytes the storage holds right now.
size_t storage_bytes(const at::Tensor& tensor);

}  // namespace dtrain::detail
