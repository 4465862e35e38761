# ddpkit_add_mode_executables(<name> <source> [LIBS <lib>...]
#                             [PRECOMPILE <header>...] [PCH_FROM <target>])
#
# Builds <source> once per parallel mode as <name>-single, <name>-dp,
# <name>-ddp and <name>-zero (ZeRO-2), or only the mode named by the cache
# variable DDPKIT_MODE (single, dp, ddp, zero or all). The source selects
# `using Mode = ...` from the macros DDPKIT_MODE_SINGLE / _DP / _DDP / _ZERO.
# The mode is #defined in a generated one-line wrapper rather than with -D, so all modes share one
# precompiled header (default <ddpkit/ddpkit.hpp>; PRECOMPILE replaces the
# list; PCH_FROM reuses an existing target's precompiled header of the same
# headers instead, where that target exists). Binaries go to
# ${CMAKE_BINARY_DIR}/bin.
include_guard(GLOBAL)
set(DDPKIT_MODE "all" CACHE STRING "single, dp, ddp, zero or all")

function(ddpkit_add_mode_executables name source)
  cmake_parse_arguments(arg "" "PCH_FROM" "LIBS;PRECOMPILE" ${ARGN})
  if(NOT arg_PRECOMPILE)
    set(arg_PRECOMPILE <ddpkit/ddpkit.hpp>)
  endif()
  set(modes single dp ddp zero)
  if(NOT DDPKIT_MODE STREQUAL "all")
    if(NOT DDPKIT_MODE IN_LIST modes)
      message(FATAL_ERROR "DDPKIT_MODE='${DDPKIT_MODE}' is not one of single, dp, ddp, zero, all")
    endif()
    set(modes ${DDPKIT_MODE})
  endif()
  get_filename_component(source_abs ${source} ABSOLUTE)
  list(GET modes 0 first)
  foreach(mode IN LISTS modes)
    string(TOUPPER ${mode} MODE)
    set(wrapper ${CMAKE_CURRENT_BINARY_DIR}/${name}-${mode}.cpp)
    file(CONFIGURE OUTPUT ${wrapper}
         CONTENT "#define DDPKIT_MODE_${MODE} 1\n#include \"${source_abs}\"\n")
    add_executable(${name}-${mode} ${wrapper})
    target_link_libraries(${name}-${mode} PRIVATE ddpkit::ddpkit ${arg_LIBS})
    set_target_properties(${name}-${mode} PROPERTIES
                          RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/bin)
    if(arg_PCH_FROM AND TARGET ${arg_PCH_FROM})
      target_precompile_headers(${name}-${mode} REUSE_FROM ${arg_PCH_FROM})
    elseif(mode STREQUAL first)
      target_precompile_headers(${name}-${mode} PRIVATE ${arg_PRECOMPILE})
    else()
      target_precompile_headers(${name}-${mode} REUSE_FROM ${name}-${first})
    endif()
  endforeach()
endfunction()
