# `cmake --install build [--prefix P]`: the library, its public headers, the `dtrain` launcher and a CMake
# package, so that a user's project builds against dtrain the way it builds against LibTorch:
#
#   find_package(dtrain REQUIRED)                # CMAKE_PREFIX_PATH=P (and LibTorch's prefix, if not found)
#   target_link_libraries(app PRIVATE dtrain::dtrain)   # brings LibTorch's include paths and libraries
#
# The installed library keeps the path to the LibTorch it was built against in its RPATH (a pip LibTorch
# lives outside the loader's default paths), and the package finds that same LibTorch unless the consumer
# points Torch_DIR elsewhere. The launcher is dtrain::launcher (an imported executable) and ${dtrain_LAUNCHER}.
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

set(DTRAIN_INSTALL_CMAKEDIR ${CMAKE_INSTALL_LIBDIR}/cmake/dtrain)

# Named explicitly: INSTALL_RPATH_USE_LINK_PATH alone kept only MKL's leftovers (/lib/intel64), and a
# program's own RUNPATH does not reach its libraries' dependencies, so a consumer that needs none of
# libc10_cuda itself could not load libdtrain, which does (CudaGraphStep).
set(_dtrain_install_rpath "${TORCH_INSTALL_PREFIX}/lib")
if(CUDA_cudart_LIBRARY)  # the CUDA runtime the wheel links (dtrainFindTorch.cmake names it)
  get_filename_component(_dtrain_cudart_dir "${CUDA_cudart_LIBRARY}" DIRECTORY)
  list(APPEND _dtrain_install_rpath "${_dtrain_cudart_dir}")
endif()
set_target_properties(dtrain PROPERTIES
  VERSION ${PROJECT_VERSION}
  SOVERSION ${PROJECT_VERSION_MAJOR}.${PROJECT_VERSION_MINOR}
  INSTALL_RPATH "${_dtrain_install_rpath}"
  INSTALL_RPATH_USE_LINK_PATH TRUE)
set_target_properties(dtrain_cli PROPERTIES EXPORT_NAME launcher)

install(TARGETS dtrain dtrain_cli EXPORT dtrainTargets
  LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
  RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR}
  INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(DIRECTORY ${PROJECT_SOURCE_DIR}/include/dtrain DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}
  FILES_MATCHING PATTERN "*.h")
install(EXPORT dtrainTargets NAMESPACE dtrain:: DESTINATION ${DTRAIN_INSTALL_CMAKEDIR})

# Generated into a folder of their own, not the build tree's root: find_package searches <prefix>/ itself, and
# a build tree on CMAKE_PREFIX_PATH then took this install-only config for a package and failed inside it
# (its targets file and dtrainFindTorch.cmake exist only once installed). A project that builds dtrain
# along with itself uses add_subdirectory, which gives the same target names.
set(_dtrain_package_dir ${PROJECT_BINARY_DIR}/cmake-package)
configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/dtrainConfig.cmake.in
  ${_dtrain_package_dir}/dtrainConfig.cmake INSTALL_DESTINATION ${DTRAIN_INSTALL_CMAKEDIR})
# 0.x: a minor version may change the API, so only the same major.minor is compatible.
write_basic_package_version_file(${_dtrain_package_dir}/dtrainConfigVersion.cmake
  COMPATIBILITY SameMinorVersion)
install(FILES ${_dtrain_package_dir}/dtrainConfig.cmake ${_dtrain_package_dir}/dtrainConfigVersion.cmake
  ${PROJECT_SOURCE_DIR}/cmake/dtrainFindTorch.cmake DESTINATION ${DTRAIN_INSTALL_CMAKEDIR})
