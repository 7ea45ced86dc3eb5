# LibTorch-facing settings shared by the library, tests, benchmarks and examples.

# c10d's ProcessGroupGloo.hpp includes <gloo/...>. Debian's LibTorch comes with them through libgloo-dev; a
# LibTorch 2.x from pip or pytorch.org ships c10d's headers but not Gloo's. Gloo's headers are templates and
# plain declarations, so the system's copy (Debian and Ubuntu: libgloo-dev) compiles with those c10d
# headers (checked with pip's LibTorch 2.11). The LibTorch's own copy wins where it has one.
find_path(DTRAIN_GLOO_INCLUDE_DIR gloo/algorithm.h HINTS ${TORCH_INCLUDE_DIRS}
  DOC "Folder holding gloo/algorithm.h (Gloo's headers, which c10d's ProcessGroupGloo.hpp includes)")
if(NOT DTRAIN_GLOO_INCLUDE_DIR)
  message(FATAL_ERROR "Gloo's headers (gloo/algorithm.h) are neither in the LibTorch at ${TORCH_INSTALL_PREFIX} "
                      "nor in the system: install them (Debian/Ubuntu: apt-get install libgloo-dev), or pass "
                      "-DDTRAIN_GLOO_INCLUDE_DIR=/path/to/folder-holding-gloo.")
endif()

# A CUDA LibTorch sets TORCH_CUDA_LIBRARIES; then dtrain also builds its NCCL paths. c10d's
# ProcessGroupNCCL.hpp includes <nccl.h>, which a wheel keeps in site-packages/nvidia/nccl/include.
if(TORCH_CUDA_LIBRARIES)
  set(DTRAIN_WITH_CUDA ON)
  get_filename_component(_dtrain_site "${TORCH_INSTALL_PREFIX}/.." ABSOLUTE)
  find_path(DTRAIN_NCCL_INCLUDE_DIR nccl.h HINTS ${_dtrain_site}/nvidia/nccl/include ${CUDAToolkit_INCLUDE_DIRS}
    DOC "Folder holding nccl.h (NCCL's header, which c10d's ProcessGroupNCCL.hpp includes)")
  if(NOT DTRAIN_NCCL_INCLUDE_DIR)
    message(FATAL_ERROR "LibTorch at ${TORCH_INSTALL_PREFIX} is a CUDA build, but nccl.h was found neither in "
                        "${_dtrain_site}/nvidia/nccl/include nor in the CUDA toolkit: install the wheel's "
                        "nvidia-nccl package, or pass -DDTRAIN_NCCL_INCLUDE_DIR=/path/to/folder-holding-nccl.h.")
  endif()
else()
  set(DTRAIN_WITH_CUDA OFF)
endif()
message(STATUS "dtrain: LibTorch ${Torch_VERSION}, CUDA/NCCL paths: ${DTRAIN_WITH_CUDA}")

# libstdc++ first among every program's libraries. LibTorch 2.11's libtorch.so exports copies of
# std::filesystem functions (remove_all, permissions, ...) that crash when called from outside it
# (a call through a null pointer), and a program's own std::filesystem calls bind to the first
# library in its NEEDED list that defines them: libtorch, which the linker otherwise lists before
# libstdc++. Harmless where nothing is shadowed (2.15's libtorch.so exports none). dtrain::dtrain
# passes it on to the programs of projects that use it (src/CMakeLists.txt).
set(DTRAIN_STDCXX_FIRST "LINKER:--push-state,--no-as-needed,-lstdc++,--pop-state")
add_link_options(${DTRAIN_STDCXX_FIRST})

# One precompiled <torch/torch.h> for every test, benchmark and example: parsing it costs ~25 s per
# translation unit on two cores, the precompiled form a fraction of that. Consumers take it with
# dtrain_use_torch_pch(target).
add_library(dtrain_torch_pch OBJECT ${PROJECT_SOURCE_DIR}/cmake/pch_anchor.cpp)
target_link_libraries(dtrain_torch_pch PRIVATE ${TORCH_LIBRARIES})
target_precompile_headers(dtrain_torch_pch PRIVATE <torch/torch.h>)

function(dtrain_use_torch_pch target)
  target_precompile_headers(${target} REUSE_FROM dtrain_torch_pch)
endfunction()
