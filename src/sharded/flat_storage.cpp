// Storage freeing and re-allocation for stage 3; see flat_storage.h.
#include "sharded/flat_storage.h"

#include <c10/core/StorageImpl.h>

namespace dtrain::detail {

void free_storage(const at::Tensor& tensor) {
  // reset() drops the DataPtr (returning the memory to the allocator) and sets the size to 0;
  // LibTorch 1.13 and 2.x both have it.
  tensor.storage().unsafeGetStorageImpl()->reset();
}

void allocate_storage(const at::Tensor& tensor, size_t bytes) {
  c10::StorageImpl* storage = tensor.storage().unsafeGetStorageImpl();
  if (storage->nbytes() >= bytes && storage->data() != nullptr) return;
  storage->set_data_ptr_noswap(storage->allocator()->allocate(bytes));
  storage->set_nbytes(bytes);
}

size_t storage_bytes(const at::Tensor& tensor) { return tensor.storage().nbytes(); }

}  // namespace dtrain::detail
