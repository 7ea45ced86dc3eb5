# LibTorch-facing settings shared by the library, tests, benchmarks and examples.

# c10d's ProcessGroupGloo.hpp includes <gloo/...>: Debian ships those headers in libgloo-dev, a LibTorch 2.x
# tree ships its own copy under include/.
find_path(DTRAIN_GLOO_INCLUDE_DIR gloo/algorithm.h HINTS ${TORCH_INCLUDE_DIRS})
if(NOT DTRAIN_GLOO_INCLUDE_DIR)
  message(FATAL_ERROR "Gloo headers not found (gloo/algorithm.h): install libgloo-dev (apt-get install libgloo-dev) "
                      "or point CMAKE_PREFIX_PATH at a LibTorch that ships them.")
endif()

# A CUDA LibTorch sets TORCH_CUDA_LIBRARIES; then dtrain also builds its NCCL paths.
if(TORCH_CUDA_LIBRARIES)
  set(DTRAIN_WITH_CUDA ON)
else()
  set(DTRAIN_WITH_CUDA OFF)
endif()
message(STATUS "dtrain: LibTorch ${Torch_VERSION}, CUDA/NCCL paths: ${DTRAIN_WITH_CUDA}")

# One precompiled <torch/torch.h> for every test, benchmark and example: parsing it costs ~25 s per
# translation unit on two cores, the precompiled form a fraction of that. Consumers take it with
# dtrain_use_torch_pch(target).
add_library(dtrain_torch_pch OBJECT ${PROJECT_SOURCE_DIR}/cmake/pch_anchor.cpp)
target_link_libraries(dtrain_torch_pch PRIVATE ${TORCH_LIBRARIES})
target_precompile_headers(dtrain_torch_pch PRIVATE <torch/torch.h>)

function(dtrain_use_torch_pch target)
  target_precompile_headers(${target} REUSE_FROM dtrain_torch_pch)
endfunction()
