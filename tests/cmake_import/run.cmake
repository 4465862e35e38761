# ctest -P script: install the build tree into a fresh prefix, configure and
# build tests/cmake_import against it, run the consumer; then build one
# example on its own against the same prefix.
set(prefix ${BUILD_DIR}/cmake_import/prefix)
set(work ${BUILD_DIR}/cmake_import/build)
file(REMOVE_RECURSE ${prefix} ${work})
execute_process(COMMAND ${CMAKE_COMMAND} --install ${BUILD_DIR} --prefix ${prefix}
                RESULT_VARIABLE rc)
if(rc)
  message(FATAL_ERROR "install failed")
endif()
# The consumers build with the main build's release flags (scripts/test.sh
# uses -O1 to keep CI short).
execute_process(COMMAND ${CMAKE_COMMAND} -S ${SOURCE_DIR} -B ${work} -G Ninja
                        -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH=${prefix}
                        "-DCMAKE_CXX_FLAGS_RELEASE=${CXX_FLAGS_RELEASE}"
                RESULT_VARIABLE rc)
if(rc)
  message(FATAL_ERROR "configuring the consumer failed")
endif()
execute_process(COMMAND ${CMAKE_COMMAND} --build ${work} RESULT_VARIABLE rc)
if(rc)
  message(FATAL_ERROR "building the consumer failed")
endif()
execute_process(COMMAND ${work}/consumer RESULT_VARIABLE rc)
if(rc)
  message(FATAL_ERROR "the consumer failed")
endif()

# An example builds on its own against the installed package too.
set(ex_work ${BUILD_DIR}/cmake_import/example)
file(REMOVE_RECURSE ${ex_work})
execute_process(COMMAND ${CMAKE_COMMAND} -S ${EXAMPLE_DIR} -B ${ex_work} -G Ninja
                        -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH=${prefix}
                        "-DCMAKE_CXX_FLAGS_RELEASE=${CXX_FLAGS_RELEASE}"
                        -DDDPKIT_MODE=single
                        # one translation unit: a precompiled header would
                        # only add its own build (CI time)
                        -DCMAKE_DISABLE_PRECOMPILE_HEADERS=ON
                RESULT_VARIABLE rc)
if(rc)
  message(FATAL_ERROR "configuring examples/cifar10 alone failed")
endif()
execute_process(COMMAND ${CMAKE_COMMAND} --build ${ex_work} RESULT_VARIABLE rc)
if(rc)
  message(FATAL_ERROR "building examples/cifar10 alone failed")
endif()
execute_process(COMMAND ${ex_work}/bin/cifar10-single --help RESULT_VARIABLE rc OUTPUT_VARIABLE help)
if(rc OR NOT help MATCHES "--world-size")
  message(FATAL_ERROR "the standalone cifar10-single does not run")
endif()
