# Helpers that give every kvpool target the same warnings and sanitizer flags, without
# touching the global CMAKE_CXX_FLAGS (third-party code is not built with -Werror).

set(KVPOOL_WARNINGS -Wall -Wextra -Werror)
if(CMAKE_CXX_COMPILER_ID MATCHES "Clang" AND KVPOOL_THREAD_SAFETY)
  list(APPEND KVPOOL_WARNINGS -Wthread-safety)
endif()
set(KVPOOL_SANITIZER_FLAGS)
if(KVPOOL_SANITIZE)
  set(KVPOOL_SANITIZER_FLAGS -fsanitize=address,undefined -fno-omit-frame-pointer
                             -fno-sanitize-recover=undefined)
endif()

# kvpool_target_options(<target>): warnings, sanitizers, C++20 for one project target.
function(kvpool_target_options target)
  target_compile_features(${target} PUBLIC cxx_std_20)
  target_compile_options(${target} PRIVATE
    $<$<COMPILE_LANGUAGE:CXX>:${KVPOOL_WARNINGS}>
    $<$<COMPILE_LANGUAGE:CXX>:${KVPOOL_SANITIZER_FLAGS}>)
  target_link_options(${target} PRIVATE ${KVPOOL_SANITIZER_FLAGS})
endfunction()

# kvpool_library(<name> SOURCES ... [PUBLIC_DEPS ...] [PRIVATE_DEPS ...])
# Defines kvpool_<name> with alias kvpool::<name>; public headers live in
# ${CMAKE_CURRENT_SOURCE_DIR}/include.
function(kvpool_library name)
  cmake_parse_arguments(ARG "" "" "SOURCES;PUBLIC_DEPS;PRIVATE_DEPS" ${ARGN})
  add_library(kvpool_${name} STATIC ${ARG_SOURCES})
  add_library(kvpool::${name} ALIAS kvpool_${name})
  if(EXISTS ${CMAKE_CURRENT_SOURCE_DIR}/include)
    target_include_directories(kvpool_${name} PUBLIC ${CMAKE_CURRENT_SOURCE_DIR}/include)
  endif()
  target_link_libraries(kvpool_${name} PUBLIC ${ARG_PUBLIC_DEPS} PRIVATE ${ARG_PRIVATE_DEPS})
  kvpool_target_options(kvpool_${name})
endfunction()

# kvpool_executable(<name> SOURCES ... [DEPS ...])
function(kvpool_executable name)
  cmake_parse_arguments(ARG "" "" "SOURCES;DEPS" ${ARGN})
  add_executable(${name} ${ARG_SOURCES})
  target_link_libraries(${name} PRIVATE ${ARG_DEPS})
  kvpool_target_options(${name})
endfunction()

# kvpool_test(<name> SOURCES ... DEPS ... [LABELS <label>])
# One GoogleTest binary per library; every TEST is discovered into CTest.
function(kvpool_test name)
  cmake_parse_arguments(ARG "" "" "SOURCES;DEPS;LABELS" ${ARGN})
  kvpool_executable(${name} SOURCES ${ARG_SOURCES}
                    DEPS ${ARG_DEPS} GTest::gtest GTest::gmock GTest::gtest_main)
  # One label per test binary (gtest_discover_tests in CMake 3.25 cannot pass a list
  # through PROPERTIES): `core` for libraries without network services (also run under
  # ASan in CI), `gpu` for CUDA tests, `integration` for multi-process runs; `unit` else.
  set(labels unit)
  if(ARG_LABELS)
    list(GET ARG_LABELS 0 labels)
  endif()
  if(labels STREQUAL "core")
    # scripts/test.sh builds exactly these under ASan (build/<preset>/kvpool-core-tests.txt).
    set_property(GLOBAL APPEND PROPERTY KVPOOL_CORE_TESTS ${name})
  endif()
  gtest_discover_tests(${name}
    WORKING_DIRECTORY ${CMAKE_CURRENT_SOURCE_DIR}
    PROPERTIES LABELS "${labels}"
               ENVIRONMENT "KVPOOL_SOURCE_DIR=${PROJECT_SOURCE_DIR}"
    DISCOVERY_TIMEOUT 60)
endfunction()
