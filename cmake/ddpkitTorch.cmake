# Which libtorch a top-level ddpkit build uses (a project that consumes the
# installed package picks its own, with CMAKE_PREFIX_PATH or Torch_DIR).
#
#   -DDDPKIT_TORCH=auto    (default) Torch_DIR / CMAKE_PREFIX_PATH when given,
#                          otherwise the PyTorch wheel in DDPKIT_VENV
#   -DDDPKIT_TORCH=venv    the PyTorch wheel in DDPKIT_VENV (default .venv,
#                          made by scripts/install-deps.sh: torch 2.11, CUDA 13.0)
#   -DDDPKIT_TORCH=system  Debian's libtorch-dev (1.13.1, CPU only)
#   -DDDPKIT_TORCH=prefix  only what Torch_DIR / CMAKE_PREFIX_PATH find
include_guard(GLOBAL)
set(DDPKIT_TORCH "auto" CACHE STRING "libtorch to build against: auto, venv, system or prefix")
set_property(CACHE DDPKIT_TORCH PROPERTY STRINGS auto venv system prefix)
set(DDPKIT_VENV "${PROJECT_SOURCE_DIR}/.venv" CACHE PATH
    "Python virtual environment holding the PyTorch wheel (DDPKIT_TORCH=venv/auto)")

set(_ddpkit_torch_choice "${DDPKIT_TORCH}")
if(_ddpkit_torch_choice STREQUAL "auto")
  if(Torch_DIR OR CMAKE_PREFIX_PATH OR DEFINED ENV{Torch_DIR} OR DEFINED ENV{CMAKE_PREFIX_PATH})
    set(_ddpkit_torch_choice prefix)
  else()
    set(_ddpkit_torch_choice venv)
  endif()
endif()

if(_ddpkit_torch_choice STREQUAL "venv")
  file(GLOB _ddpkit_torch_cfg
       "${DDPKIT_VENV}/lib/python3*/site-packages/torch/share/cmake/Torch/TorchConfig.cmake")
  if(NOT _ddpkit_torch_cfg)
    message(FATAL_ERROR
      "ddpkit: DDPKIT_TORCH=${DDPKIT_TORCH} wants the PyTorch wheel in ${DDPKIT_VENV}, "
      "but there is no torch/share/cmake/Torch/TorchConfig.cmake under it. "
      "Run ./scripts/install-deps.sh (it makes the environment), or configure with "
      "-DDDPKIT_TORCH=system (Debian's libtorch-dev 1.13) or "
      "-DCMAKE_PREFIX_PATH=/path/to/libtorch.")
  endif()
  list(GET _ddpkit_torch_cfg 0 _ddpkit_torch_cfg)
  get_filename_component(_ddpkit_torch_dir "${_ddpkit_torch_cfg}" DIRECTORY)
  set(Torch_DIR "${_ddpkit_torch_dir}" CACHE PATH "TorchConfig.cmake's folder" FORCE)
  # TorchConfig finds Caffe2 and libc10 with PATHS hints, which come after
  # the system folders: with Debian's libtorch-dev also installed it would
  # mix its 1.13 files into this build. The wheel's prefix goes first.
  get_filename_component(_ddpkit_torch_prefix "${_ddpkit_torch_dir}/../../.." ABSOLUTE)
  list(PREPEND CMAKE_PREFIX_PATH "${_ddpkit_torch_prefix}")
elseif(_ddpkit_torch_choice STREQUAL "system")
  find_path(_ddpkit_system_torch TorchConfig.cmake
            PATHS /usr/lib/${CMAKE_LIBRARY_ARCHITECTURE}/cmake/Torch /usr/share/cmake/Torch
            NO_DEFAULT_PATH NO_CACHE)
  if(NOT _ddpkit_system_torch)
    message(FATAL_ERROR
      "ddpkit: DDPKIT_TORCH=system wants Debian's libtorch-dev, but TorchConfig.cmake "
      "is not under /usr/lib/${CMAKE_LIBRARY_ARCHITECTURE}/cmake/Torch "
      "(sudo apt-get install libtorch-dev, or run ./scripts/install-deps.sh).")
  endif()
  set(Torch_DIR "${_ddpkit_system_torch}" CACHE PATH "TorchConfig.cmake's folder" FORCE)
elseif(NOT _ddpkit_torch_choice STREQUAL "prefix")
  message(FATAL_ERROR "ddpkit: DDPKIT_TORCH='${DDPKIT_TORCH}' is not one of auto, venv, system, prefix")
endif()
message(STATUS "ddpkit: libtorch from ${_ddpkit_torch_choice} (DDPKIT_TORCH=${DDPKIT_TORCH})")
