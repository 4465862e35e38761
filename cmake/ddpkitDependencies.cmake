# Finds what ddpkit's headers need and attaches it to a target. Shared by the
# build tree and the installed package (ddpkitConfig.cmake includes this file),
# so a consumer's `find_package(ddpkit)` finds exactly what our tests use.
include_guard(GLOBAL)
include(CMakeFindDependencyMacro)

# _ddpkit_torch_prefix(<out>): the install prefix of the TorchConfig.cmake
# that find_package(Torch) is about to load, without loading it: the same
# search, for the TorchConfigVersion.cmake next to it (a file that only sets
# PACKAGE_VERSION*). The folder is cached as Torch_DIR, so find_package(Torch)
# then loads that one. Empty when none is found or the layout is unknown.
function(_ddpkit_torch_prefix out)
  find_package(Torch QUIET CONFIGS TorchConfigVersion.cmake)
  set(prefix "")
  if(Torch_DIR)
    get_filename_component(dir "${Torch_DIR}" ABSOLUTE)
    # <prefix>/share/cmake/Torch (wheel, LibTorch zip), <prefix>/lib[64]/cmake/Torch,
    # <prefix>/lib/<arch>/cmake/Torch (Debian).
    if(dir MATCHES "^(.*)/(share|lib[^/]*|lib/[^/]+)/cmake/Torch$")
      set(prefix "${CMAKE_MATCH_1}")
    endif()
  endif()
  set(${out} "${prefix}" PARENT_SCOPE)
endfunction()

# libtorch: Debian's libtorch-dev (CPU) or any CUDA libtorch (e.g. the one in a
# PyTorch wheel: -DCMAKE_PREFIX_PATH=$(python3 -c 'import torch;print(torch.utils.cmake_prefix_path)')).
#
# TorchConfig.cmake finds its own libraries with
#   find_library(c10_LIBRARY c10 PATHS "${TORCH_INSTALL_PREFIX}/lib")
# (and TORCH_LIBRARY, C10_CUDA_LIBRARY, kineto alike). PATHS come after the
# CMAKE_PREFIX_PATH and system folders; PyTorch's documented prefix is the
# wheel's torch/share/cmake, whose lib/ does not exist, so with Debian's
# libtorch-dev installed it took /usr/lib/<arch>/libc10.so and libtorch.so
# beside the wheel's own targets. That TorchConfig's prefix goes first in
# CMAKE_PREFIX_PATH while find_package(Torch) runs, and only then (a
# <PackageName>_ROOT would do the same, but needs policy CMP0074, which a
# consumer's cmake_minimum_required may leave unset).
_ddpkit_torch_prefix(_ddpkit_torch_prefix)
if(DEFINED CMAKE_PREFIX_PATH)
  set(_ddpkit_saved_prefix_path "${CMAKE_PREFIX_PATH}")
endif()
if(_ddpkit_torch_prefix)
  list(PREPEND CMAKE_PREFIX_PATH "${_ddpkit_torch_prefix}")
endif()
find_dependency(Torch)
if(DEFINED _ddpkit_saved_prefix_path)
  set(CMAKE_PREFIX_PATH "${_ddpkit_saved_prefix_path}")
else()
  unset(CMAKE_PREFIX_PATH)
endif()
find_dependency(range-v3)
include("${CMAKE_CURRENT_LIST_DIR}/ddpkitCuda.cmake")
find_package(PkgConfig QUIET)
if(PkgConfig_FOUND)
  pkg_check_modules(DDPKIT_TURBOJPEG QUIET IMPORTED_TARGET libturbojpeg)
endif()
find_package(PNG QUIET)
# JPEG region decode (RandomResizedCrop decodes only the crop) uses
# libjpeg's own API, whose header is libjpeg62-turbo-dev's. Leaving it out is
# a choice (-DDDPKIT_JPEG_REGION=OFF: whole images are decoded, then
# cropped), never an accident of what a machine happens to have.
option(DDPKIT_JPEG_REGION "JPEG region decode through libjpeg's API (needs jpeglib.h)" ON)
if(DDPKIT_JPEG_REGION AND TARGET PkgConfig::DDPKIT_TURBOJPEG)
  find_path(DDPKIT_JPEGLIB_INCLUDE jpeglib.h)
  if(NOT DDPKIT_JPEGLIB_INCLUDE)
    message(FATAL_ERROR
      "ddpkit: jpeglib.h not found, which the JPEG region decode needs: install "
      "libjpeg62-turbo-dev (scripts/install-deps.sh does), or build without the "
      "region decode with -DDDPKIT_JPEG_REGION=OFF.")
  endif()
endif()

# ddpkit_link_dependencies(<target> [BUILD_TREE]): BUILD_TREE wraps every
# item in $<BUILD_INTERFACE:...> so the exported target stays free of paths.
function(ddpkit_link_dependencies target)
  cmake_parse_arguments(arg "BUILD_TREE" "" "" ${ARGN})
  set(libs ${TORCH_LIBRARIES} range-v3::range-v3 Threads::Threads)
  set(incs ${TORCH_INCLUDE_DIRS})
  set(defs "")
  find_package(Threads REQUIRED)
  # c10d's gloo backend headers are guarded by USE_C10D_GLOO; Debian's
  # libtorch is built with gloo, the headers come from libgloo-dev.
  find_path(DDPKIT_GLOO_INCLUDE gloo/config.h HINTS ${TORCH_INCLUDE_DIRS})
  if(DDPKIT_GLOO_INCLUDE)
    list(APPEND defs USE_C10D_GLOO DDPKIT_HAS_GLOO=1)
  endif()
  if(DDPKIT_TORCH_HAS_CUDA)
    list(APPEND defs DDPKIT_HAS_CUDA=1)
    if(DDPKIT_NCCL_INCLUDE_DIR)
      # c10d's ProcessGroupNCCL.hpp is guarded by USE_C10D_NCCL.
      list(APPEND defs USE_C10D_NCCL DDPKIT_HAS_NCCL=1)
      list(APPEND incs ${DDPKIT_NCCL_INCLUDE_DIR})
    endif()
  endif()
  if(TARGET PkgConfig::DDPKIT_TURBOJPEG)
    list(APPEND libs PkgConfig::DDPKIT_TURBOJPEG)
    list(APPEND defs DDPKIT_HAS_TURBOJPEG=1)
    if(DDPKIT_JPEG_REGION)
      list(APPEND defs DDPKIT_HAS_JPEG_REGION=1)
    else()
      list(APPEND defs DDPKIT_NO_JPEG_REGION=1)
    endif()
  endif()
  if(PNG_FOUND)
    list(APPEND libs PNG::PNG)
    list(APPEND defs DDPKIT_HAS_PNG=1)
  endif()
  if(arg_BUILD_TREE)
    list(TRANSFORM libs PREPEND "$<BUILD_INTERFACE:")
    list(TRANSFORM libs APPEND ">")
    list(TRANSFORM incs PREPEND "$<BUILD_INTERFACE:")
    list(TRANSFORM incs APPEND ">")
    list(TRANSFORM defs PREPEND "$<BUILD_INTERFACE:")
    list(TRANSFORM defs APPEND ">")
  endif()
  target_link_libraries(${target} INTERFACE ${libs})
  # The PyTorch wheels' libtorch.so exports pieces of the newer libstdc++ it
  # was built with (std::filesystem, std::chrono::tzdb, stringbuf members).
  # Listed before libstdc++ in the executable's dynamic dependencies, they
  # would replace the system's for the whole program: std::filesystem::
  # remove_all called through them jumps to a null pointer (seen with
  # torch 2.11 and GCC 12). libstdc++ goes first.
  if(CMAKE_CXX_COMPILER_ID MATCHES "GNU|Clang" AND NOT APPLE)
    target_link_options(${target} INTERFACE
      "LINKER:--push-state,--no-as-needed" "-lstdc++" "LINKER:--pop-state")
  endif()
  foreach(dir IN LISTS DDPKIT_TORCH_WHEEL_LIBDIRS)
    if(arg_BUILD_TREE)
      target_link_options(${target} INTERFACE "$<BUILD_INTERFACE:-Wl,-rpath-link,${dir}>")
    else()
      target_link_options(${target} INTERFACE "-Wl,-rpath-link,${dir}")
    endif()
  endforeach()
  target_include_directories(${target} SYSTEM INTERFACE ${incs})
  target_compile_definitions(${target} INTERFACE ${defs})
endfunction()
