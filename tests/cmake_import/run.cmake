# ctest -P script: install the build tree into a fresh prefix, then configure,
# build and run tests/cmake_import against it with the PyTorch wheel through
# its documented prefix (torch.utils.cmake_prefix_path of PYTHON's torch),
# which must give the wheel's libtorch even where Debian's libtorch-dev is
# installed too (a); then build one example on its own with nothing but
# ddpkit's prefix (the libtorch the system has) (b).
set(prefix ${BUILD_DIR}/cmake_import/prefix)
set(wheel_work ${BUILD_DIR}/cmake_import/build-wheel)
file(REMOVE_RECURSE ${prefix} ${wheel_work})
execute_process(COMMAND ${CMAKE_COMMAND} --install ${BUILD_DIR} --prefix ${prefix}
                RESULT_VARIABLE rc)
if(rc)
  message(FATAL_ERROR "install failed")
endif()
# The flight records' reader is installed and runs (it says how to use it).
execute_process(COMMAND ${prefix}/bin/ddpkit-doctor --help RESULT_VARIABLE rc
                OUTPUT_VARIABLE doctor_help)
if(rc OR NOT doctor_help MATCHES "flight")
  message(FATAL_ERROR "the installed bin/ddpkit-doctor --help failed (${rc})")
endif()
# The consumers build with the main build's release flags (scripts/test.sh
# uses -O1 to keep CI short) and its compiler launcher (ccache).
set(consumer_args -G Ninja -DCMAKE_BUILD_TYPE=Release
                  "-DCMAKE_CXX_FLAGS_RELEASE=${CXX_FLAGS_RELEASE}")
if(CXX_LAUNCHER)
  list(APPEND consumer_args "-DCMAKE_CXX_COMPILER_LAUNCHER=${CXX_LAUNCHER}")
endif()

# configure_project(<source> <work> <prefix path> <label> [cache args...]):
# configure <source> in <work> with CMAKE_PREFIX_PATH=<prefix path>; a
# failure fails the test, naming <label>.
function(configure_project source work prefix_path label)
  execute_process(COMMAND ${CMAKE_COMMAND} -S ${source} -B ${work} ${consumer_args}
                          "-DCMAKE_PREFIX_PATH=${prefix_path}" ${ARGN}
                  RESULT_VARIABLE rc)
  if(rc)
    message(FATAL_ERROR "configuring ${label} (-DCMAKE_PREFIX_PATH=${prefix_path}) failed")
  endif()
endfunction()

# build_project(<source> <work> <prefix path> <label> [cache args...]):
# configure_project, then build; a failure fails the test, naming <label>.
function(build_project source work prefix_path label)
  configure_project(${source} ${work} "${prefix_path}" "${label}" ${ARGN})
  execute_process(COMMAND ${CMAKE_COMMAND} --build ${work} RESULT_VARIABLE rc)
  if(rc)
    message(FATAL_ERROR "building ${label} failed")
  endif()
endfunction()

# consumer(<work> <prefix path> <label> <out var>): builds tests/cmake_import
# in <work> (build_project) and runs it; <out var> gets what it printed.
function(consumer work prefix_path label out_var)
  build_project(${SOURCE_DIR} ${work} "${prefix_path}" "the consumer with ${label}")
  execute_process(COMMAND ${work}/consumer RESULT_VARIABLE rc OUTPUT_VARIABLE out)
  message(STATUS "consumer (${label}): ${out}")
  if(rc)
    message(FATAL_ERROR "the consumer built with ${label} failed")
  endif()
  set(${out_var} "${out}" PARENT_SCOPE)
endfunction()

# (a) The wheel, as PyTorch documents it.
set(wheel_prefix "")
if(PYTHON AND EXISTS "${PYTHON}")
  execute_process(COMMAND ${PYTHON} -c
                          "import torch; print(torch.utils.cmake_prefix_path); print(torch.__version__.split('+')[0])"
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_QUIET
                  OUTPUT_STRIP_TRAILING_WHITESPACE)
  if(NOT rc)
    string(REPLACE "\n" ";" out "${out}")
    list(GET out 0 wheel_prefix)
    list(GET out 1 wheel_version)
  endif()
endif()
if(wheel_prefix)
  consumer(${wheel_work} "${wheel_prefix};${prefix}" "the wheel's prefix" out)
  # Its headers are the wheel's ...
  if(NOT out MATCHES "libtorch ${wheel_version},")
    message(FATAL_ERROR "the consumer built with the wheel's prefix reports '${out}', "
                        "not the wheel's libtorch ${wheel_version}")
  endif()
  # ... and so is every libtorch library it loads: libtorch.so and
  # libc10.so from the wheel's torch/lib, none from another installation.
  get_filename_component(wheel_lib "${wheel_prefix}/../../lib" ABSOLUTE)
  find_program(LDD ldd)
  if(LDD)
    execute_process(COMMAND ${LDD} ${wheel_work}/consumer OUTPUT_VARIABLE ldd RESULT_VARIABLE rc)
    string(REGEX MATCHALL "lib(torch|c10)[^ \t\n]* => [^ \t\n]+" loaded "${ldd}")
    foreach(lib IN ITEMS libtorch.so libc10.so)
      string(FIND "${loaded}" "${lib} => ${wheel_lib}/${lib}" at)
      if(at EQUAL -1)
        message(FATAL_ERROR "the wheel consumer does not load ${wheel_lib}/${lib}:\n${ldd}")
      endif()
    endforeach()
    foreach(entry IN LISTS loaded)
      string(FIND "${entry}" " => ${wheel_lib}/" at)
      if(at EQUAL -1)
        message(FATAL_ERROR "the wheel consumer loads ${entry}, not the wheel's:\n${ldd}")
      endif()
    endforeach()
  endif()
else()
  # The install script puts torch in .venv: in CI its absence is a failure,
  # not a skip.
  if("$ENV{CI}" STREQUAL "true")
    message(FATAL_ERROR "cmake_import: no torch in '${PYTHON}' (CI=true): the wheel's prefix cannot be tested")
  endif()
  message(STATUS "cmake_import: SKIPPED the wheel's prefix: no torch in '${PYTHON}'")
endif()

# (b) ddpkit's prefix alone (the libtorch the system has): the consumer and
# an example folder configure on their own against the installed package
# (find_package(ddpkit) finds its dependencies; the example's CLI11 and
# target definitions). Neither is built: (a) builds the consumer from the
# same installed headers, and stage 1 the example's code (CI time).
foreach(project IN ITEMS consumer example)
  set(work ${BUILD_DIR}/cmake_import/${project}-prefix-alone)
  file(REMOVE_RECURSE ${work})
  set(source ${SOURCE_DIR})
  set(extra "")
  set(target consumer)
  if(project STREQUAL "example")
    set(source ${EXAMPLE_DIR})
    set(extra -DDDPKIT_MODE=single)
    set(target cifar10-single)
  endif()
  configure_project(${source} ${work} "${prefix}" "${source} with ddpkit's prefix alone" ${extra})
  file(READ ${work}/build.ninja ninja_file)
  if(NOT ninja_file MATCHES "${target}")
    message(FATAL_ERROR "${source} configured alone defines no ${target} target (${work}/build.ninja)")
  endif()
endforeach()
