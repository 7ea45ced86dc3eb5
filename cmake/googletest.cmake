# googletest for dtrain's tests: the installed package (Debian's libgtest-dev) when there is one, else built
# from its sources. A LibTorch and a googletest built for different C++ ABIs (pip's LibTorch is built with
# -D_GLIBCXX_USE_CXX11_ABI=1, an older one with 0) do not link together; building googletest from source
# with the flags of this build avoids that: -DDTRAIN_GTEST_SOURCE_DIR=/usr/src/googletest (Debian's
# googletest package) or any googletest checkout.
set(DTRAIN_GTEST_SOURCE_DIR "" CACHE PATH "Build googletest from this source tree instead of find_package(GTest)")
if(NOT DTRAIN_GTEST_SOURCE_DIR)
  find_package(GTest QUIET)
  if(NOT GTest_FOUND AND EXISTS /usr/src/googletest/CMakeLists.txt)
    set(DTRAIN_GTEST_SOURCE_DIR /usr/src/googletest)
  endif()
endif()
if(DTRAIN_GTEST_SOURCE_DIR)
  if(NOT EXISTS ${DTRAIN_GTEST_SOURCE_DIR}/CMakeLists.txt)
    message(FATAL_ERROR "DTRAIN_GTEST_SOURCE_DIR=${DTRAIN_GTEST_SOURCE_DIR} holds no CMakeLists.txt: point it at a "
                        "googletest source tree (Debian: apt-get install googletest, then /usr/src/googletest).")
  endif()
  set(INSTALL_GTEST OFF CACHE BOOL "" FORCE)
  set(BUILD_GMOCK OFF CACHE BOOL "" FORCE)
  add_subdirectory(${DTRAIN_GTEST_SOURCE_DIR} ${CMAKE_BINARY_DIR}/googletest EXCLUDE_FROM_ALL)
  # GCC 12 warns falsely (-Wrestrict) in googletest's own string code: not ours to mend,
  # and a warning in every build hides the ones that are.
  if(CMAKE_CXX_COMPILER_ID STREQUAL "GNU")
    target_compile_options(gtest PRIVATE -Wno-restrict)
  endif()
  if(NOT TARGET GTest::gtest)
    add_library(GTest::gtest ALIAS gtest)
    add_library(GTest::gtest_main ALIAS gtest_main)
  endif()
  message(STATUS "dtrain: googletest built from ${DTRAIN_GTEST_SOURCE_DIR}")
elseif(NOT GTest_FOUND)
  message(FATAL_ERROR "googletest not found, and the tests need it: install it (Debian: apt-get install "
                      "libgtest-dev), pass -DDTRAIN_GTEST_SOURCE_DIR=/path/to/googletest to build it from source, "
                      "or configure with -DDTRAIN_BUILD_TESTS=OFF.")
endif()
include(GoogleTest)
