# Finds LibTorch for dtrain and its consumers: dtrain_find_torch(<folder holding TorchConfig.cmake, or "">).
# Used by dtrain's own build and by the installed dtrainConfig.cmake, so both meet LibTorch the same way.
#
# Supported: LibTorch 2.11 to 2.15 (2.15 is what scripts/bootstrap installs; 2.11 is on the lent GPU machines).
# Anything else stops here with one line.
#
# PyPI's `torch` wheel for Linux is a CUDA build, and its TorchConfig.cmake wants a CUDA toolkit (nvcc, the
# runtime, nvrtc) even though dtrain compiles no CUDA source. The toolkit must be the wheel's own CUDA version:
# a libcudart or libnvrtc of another minor version found first (say /usr/local/cuda 13.0 beside a 13.2
# wheel) would be linked, put on the RPATH, and loaded in place of the wheel's. So where the wheel's own
# toolkit sits beside it (site-packages/nvidia/cu<major>, which `pip install cuda-toolkit[nvcc]` completes
# with nvcc), it is chosen and its versioned libraries named explicitly; a toolkit given by the caller
# (CUDAToolkit_ROOT, CMAKE_CUDA_COMPILER) is left alone. The driver stub (libcuda) is never linked: every
# binary must start on a machine without a GPU.
#
# The refusals below begin with a space: CMake prints such a message as it is, where it would otherwise wrap
# it over several lines, and the user (or a script's grep) gets the whole sentence on one line.
set(DTRAIN_TORCH_MIN_VERSION 2.11)
set(DTRAIN_TORCH_MAX_VERSION 2.15)

macro(dtrain_find_torch torch_dir_hint)
  if(NOT "${torch_dir_hint}" STREQUAL "" AND NOT Torch_DIR)
    set(Torch_DIR "${torch_dir_hint}")
  endif()
  # Where would TorchConfig.cmake come from? Look before find_package(Torch) runs its CUDA discovery.
  set(_dtrain_torch_config_dir "")
  foreach(_dtrain_dir ${Torch_DIR} ${CMAKE_PREFIX_PATH} $ENV{CMAKE_PREFIX_PATH})
    foreach(_dtrain_suffix "" /Torch /share/cmake/Torch)
      if(NOT _dtrain_torch_config_dir AND EXISTS "${_dtrain_dir}${_dtrain_suffix}/TorchConfig.cmake")
        set(_dtrain_torch_config_dir "${_dtrain_dir}${_dtrain_suffix}")
      endif()
    endforeach()
  endforeach()
  if(_dtrain_torch_config_dir AND NOT CUDAToolkit_ROOT AND NOT CMAKE_CUDA_COMPILER)
    # <site-packages>/torch/share/cmake/Torch -> <site-packages>/nvidia/cu<major>
    get_filename_component(_dtrain_site "${_dtrain_torch_config_dir}/../../../.." ABSOLUTE)
    file(GLOB _dtrain_wheel_nvcc "${_dtrain_site}/nvidia/cu*/bin/nvcc")
    if(_dtrain_wheel_nvcc)
      list(GET _dtrain_wheel_nvcc 0 _dtrain_wheel_nvcc)
      get_filename_component(_dtrain_cuda_root "${_dtrain_wheel_nvcc}/../.." ABSOLUTE)
      set(CUDAToolkit_ROOT "${_dtrain_cuda_root}")
      set(CUDA_TOOLKIT_ROOT_DIR "${_dtrain_cuda_root}" CACHE PATH "The wheel's CUDA toolkit")
      set(CMAKE_CUDA_COMPILER "${_dtrain_wheel_nvcc}" CACHE FILEPATH "The wheel's nvcc")
      # The wheel ships only versioned libraries (libcudart.so.13), which find_library would pass over for an
      # unversioned one elsewhere.
      foreach(_dtrain_lib cudart nvrtc)
        file(GLOB _dtrain_found "${_dtrain_cuda_root}/lib/lib${_dtrain_lib}.so.[0-9]*")
        if(_dtrain_found)
          list(GET _dtrain_found 0 _dtrain_found)
          set(CUDA_${_dtrain_lib}_LIBRARY "${_dtrain_found}" CACHE FILEPATH "The wheel's lib${_dtrain_lib}")
        endif()
      endforeach()
    endif()
  endif()
  # Torch's CUDA set-up asks nvcc for CMAKE_CXX_STANDARD (20), which Debian 12's CMake (3.25) cannot express
  # for nvcc ("CUDA20 ... not supported"); dtrain compiles no CUDA, so a standard nvcc knows will do. A project
  # that compiles its own kernels sets CMAKE_CUDA_STANDARD itself.
  if(NOT DEFINED CMAKE_CUDA_STANDARD)
    set(CMAKE_CUDA_STANDARD 17)
  endif()

  find_package(Torch REQUIRED)
  # A wheel records the CUDA it was built for; a toolkit of another minor version would be linked in its place.
  if(EXISTS "${TORCH_INSTALL_PREFIX}/version.py" AND CUDAToolkit_VERSION)
    file(STRINGS "${TORCH_INSTALL_PREFIX}/version.py" _dtrain_wheel_cuda REGEX "^cuda[:= ]")
    if(_dtrain_wheel_cuda MATCHES "'([0-9]+\\.[0-9]+)'")
      set(_dtrain_wheel_cuda "${CMAKE_MATCH_1}")
      if(NOT "${CUDAToolkit_VERSION_MAJOR}.${CUDAToolkit_VERSION_MINOR}" STREQUAL _dtrain_wheel_cuda)
        message(FATAL_ERROR " LibTorch ${Torch_VERSION} at ${TORCH_INSTALL_PREFIX} is built for CUDA "
                            "${_dtrain_wheel_cuda}, but the CUDA toolkit found is ${CUDAToolkit_VERSION} "
                            "(${CUDAToolkit_BIN_DIR}): pip install 'cuda-toolkit[nvcc]==${_dtrain_wheel_cuda}.*' "
                            "into the wheel's environment (scripts/bootstrap does), or set CUDAToolkit_ROOT to a "
                            "${_dtrain_wheel_cuda} toolkit.")
      endif()
    endif()
  endif()
  if(Torch_VERSION VERSION_LESS DTRAIN_TORCH_MIN_VERSION OR
     Torch_VERSION VERSION_GREATER_EQUAL "${DTRAIN_TORCH_MAX_VERSION}.99")
    message(FATAL_ERROR " dtrain supports LibTorch ${DTRAIN_TORCH_MIN_VERSION} to ${DTRAIN_TORCH_MAX_VERSION}, but "
                        "Torch_DIR=${Torch_DIR} is LibTorch ${Torch_VERSION}: point CMAKE_PREFIX_PATH or Torch_DIR "
                        "at a LibTorch in that range (scripts/bootstrap installs 2.15 into .venv/).")
  endif()
endmacro()
