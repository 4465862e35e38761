# After find_package(Torch): is this libtorch a CUDA build, and where is the
# nccl.h that matches it? Sets DDPKIT_TORCH_HAS_CUDA and
# DDPKIT_NCCL_INCLUDE_DIR, and says what it found in the configure log.
#
# c10d's ProcessGroupNCCL.hpp embeds NCCL's ncclConfig_t, so the header must be
# the NCCL libtorch was built with. A PyTorch wheel depends on an exact
# nvidia-nccl-* package whose include/ folder is that header; it is preferred
# over the CUDA toolkit's. -DDDPKIT_NCCL_INCLUDE_DIR=... names another;
# -DDDPKIT_NCCL=OFF compiles without ddpkit's NCCL process groups.
include_guard(GLOBAL)
option(DDPKIT_NCCL "With a CUDA libtorch: compile ddpkit's NCCL process groups" ON)

# Every libtorch file must come from one installation: TorchConfig searches
# the system folders before its own, so a second libtorch there (Debian's)
# can slip in. ddpkitDependencies.cmake searches the found TorchConfig's
# prefix first; what still comes from elsewhere was given or cached (an
# earlier configure). Refuse a mixed build rather than crash at run time.
get_filename_component(_ddpkit_torch_root "${Torch_DIR}/../../.." ABSOLUTE)
foreach(_ddpkit_var IN ITEMS Caffe2_DIR TORCH_LIBRARY c10_LIBRARY C10_CUDA_LIBRARY)
  set(_ddpkit_file "${${_ddpkit_var}}")
  if(_ddpkit_file)
    get_filename_component(_ddpkit_file_abs "${_ddpkit_file}" ABSOLUTE)
    cmake_path(IS_PREFIX _ddpkit_torch_root "${_ddpkit_file_abs}" _ddpkit_inside)
    if(NOT _ddpkit_inside AND NOT _ddpkit_torch_root STREQUAL "/usr")
      message(FATAL_ERROR
        "ddpkit: libtorch's CMake files are in ${_ddpkit_torch_root}, but ${_ddpkit_var} is "
        "${_ddpkit_file}, from elsewhere (another libtorch on the system, given on the "
        "command line or cached by an earlier configure). Configure again with "
        "-U${_ddpkit_var} (or in a fresh build folder); if it persists, with "
        "-DCMAKE_PREFIX_PATH=${_ddpkit_torch_root} so its own files are found first.")
    endif()
  endif()
endforeach()

set(DDPKIT_TORCH_HAS_CUDA OFF)
if(TORCH_CUDA_LIBRARIES OR TARGET torch_cuda)
  set(DDPKIT_TORCH_HAS_CUDA ON)
endif()

# The wheel's site-packages: <site-packages>/torch/share/cmake/Torch.
get_filename_component(_ddpkit_site "${Torch_DIR}/../../../.." ABSOLUTE)

# A wheel's libtorch_cuda.so finds NCCL, cuDNN, ... in the wheel's nvidia/*/lib
# folders through its RUNPATH ($ORIGIN/...), which the loader honours but
# the link editor does not: it took the CUDA toolkit's older libnccl and
# failed on symbols only the wheel's has (torch 2.15). -rpath-link points it
# at the wheel's (added by ddpkit_link_dependencies).
set(DDPKIT_TORCH_WHEEL_LIBDIRS "")
if(DDPKIT_TORCH_HAS_CUDA)
  file(GLOB DDPKIT_TORCH_WHEEL_LIBDIRS LIST_DIRECTORIES true "${_ddpkit_site}/nvidia/*/lib")
endif()

function(_ddpkit_nccl_version header out)
  file(STRINGS "${header}" _lines REGEX "^#define NCCL_(MAJOR|MINOR|PATCH) ")
  set(v "")
  foreach(part MAJOR MINOR PATCH)
    string(REGEX MATCH "NCCL_${part} +([0-9]+)" _m "${_lines}")
    list(APPEND v ${CMAKE_MATCH_1})
  endforeach()
  list(JOIN v "." v)
  set(${out} "${v}" PARENT_SCOPE)
endfunction()

# The toolkit CMake found here, and (for a wheel) the CUDA torch was built
# for, which may be newer: the driver of the machine that runs it must
# support the latter.
set(_ddpkit_cuda_version "")
if(CUDAToolkit_VERSION)
  set(_ddpkit_cuda_version "${CUDAToolkit_VERSION}")
elseif(CUDA_VERSION)
  set(_ddpkit_cuda_version "${CUDA_VERSION}")
endif()
if(EXISTS "${_ddpkit_site}/torch/version.py")
  file(STRINGS "${_ddpkit_site}/torch/version.py" _ddpkit_torch_cuda REGEX "^cuda")
  string(REGEX MATCH "'([0-9.]+)'" _m "${_ddpkit_torch_cuda}")
  if(CMAKE_MATCH_1)
    set(_ddpkit_cuda_version "${CMAKE_MATCH_1} (toolkit here: ${_ddpkit_cuda_version})")
  endif()
endif()

if(DDPKIT_TORCH_HAS_CUDA AND DDPKIT_NCCL)
  find_path(DDPKIT_NCCL_INCLUDE_DIR nccl.h
            HINTS "${_ddpkit_site}/nvidia/nccl/include" ${CUDAToolkit_INCLUDE_DIRS}
            DOC "folder of the nccl.h that matches libtorch's NCCL")
  if(NOT DDPKIT_NCCL_INCLUDE_DIR)
    message(FATAL_ERROR
      "ddpkit: libtorch is a CUDA build but no nccl.h was found (looked in "
      "${_ddpkit_site}/nvidia/nccl/include, the CUDA toolkit and the system folders). "
      "Install the NCCL headers that match libtorch's NCCL, name their folder with "
      "-DDDPKIT_NCCL_INCLUDE_DIR=..., or build without NCCL with -DDDPKIT_NCCL=OFF.")
  endif()
  _ddpkit_nccl_version("${DDPKIT_NCCL_INCLUDE_DIR}/nccl.h" _ddpkit_nccl_v)
  # The version the wheel pins, when this libtorch comes from one.
  file(GLOB _ddpkit_nccl_dist "${_ddpkit_site}/nvidia_nccl_cu*.dist-info")
  if(_ddpkit_nccl_dist)
    list(GET _ddpkit_nccl_dist 0 _ddpkit_nccl_dist)
    # The version from the folder's own name (the path above it may hold
    # other version-like parts, e.g. build-torch-2.15.0/).
    get_filename_component(_ddpkit_nccl_dist_name "${_ddpkit_nccl_dist}" NAME)
    string(REGEX MATCH "^nvidia_nccl_cu[0-9]+-([0-9]+\\.[0-9]+\\.[0-9]+)" _m "${_ddpkit_nccl_dist_name}")
    if(CMAKE_MATCH_1 AND NOT CMAKE_MATCH_1 STREQUAL _ddpkit_nccl_v)
      message(FATAL_ERROR
        "ddpkit: ${DDPKIT_NCCL_INCLUDE_DIR}/nccl.h is NCCL ${_ddpkit_nccl_v}, but this "
        "libtorch ships NCCL ${CMAKE_MATCH_1} (${_ddpkit_nccl_dist}); "
        "ProcessGroupNCCL's options would not match. Point -DDDPKIT_NCCL_INCLUDE_DIR "
        "at ${_ddpkit_site}/nvidia/nccl/include.")
    endif()
  endif()
  message(STATUS "ddpkit: libtorch ${Torch_VERSION} with CUDA ${_ddpkit_cuda_version}; "
                 "NCCL ${_ddpkit_nccl_v} headers from ${DDPKIT_NCCL_INCLUDE_DIR}")
elseif(DDPKIT_TORCH_HAS_CUDA)
  message(STATUS "ddpkit: libtorch ${Torch_VERSION} with CUDA ${_ddpkit_cuda_version}; "
                 "NCCL off (DDPKIT_NCCL=OFF)")
else()
  message(STATUS "ddpkit: libtorch ${Torch_VERSION}, CPU only (no CUDA, no NCCL)")
endif()
