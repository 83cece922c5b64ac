# One libstdc++ per process. Some toolchains link libstdc++ statically into everything they link
# (a compiler wrapper that adds -static-libstdc++, or GCC configured with static standard
# libraries; seen on the H200 machine's image). Every shared library of the build then carries its
# own copy of libstdc++ and exports it. llama-server is fine (the executable's copy interposes all
# others), but in a Python process the libraries sit in the extension's local scope: libllama binds
# some std:: symbols to _core's copy and others to its own, and the first std::stringstream
# (llama_model::print_info) crashes on locale state from two copies. Link libstdc++ dynamically
# instead, as every distribution's toolchain does by default.
if (CMAKE_SYSTEM_NAME STREQUAL "Linux" AND CMAKE_CXX_COMPILER_ID MATCHES "GNU|Clang" AND CMAKE_OBJDUMP)
    set(_probe_dir ${CMAKE_BINARY_DIR}/moecache-libstdcxx-probe)
    file(WRITE ${_probe_dir}/probe.cpp "#include <sstream>\nint main(int argc, char **) { std::stringstream s; s << argc; return (int) s.str().size() - 1; }\n")

    # NEEDED entries of the probe linked with the given extra linker flags; "" when it did not link
    function(_moecache_probe_needed out flags)
        string(MD5 _tag "${flags}")
        set(_exe ${_probe_dir}/probe-${_tag})
        try_compile(_ok ${_probe_dir}/build-${_tag} SOURCES ${_probe_dir}/probe.cpp
                    LINK_OPTIONS ${flags} COPY_FILE ${_exe})
        set(_needed "")
        if (_ok)
            execute_process(COMMAND ${CMAKE_OBJDUMP} -p ${_exe} OUTPUT_VARIABLE _dump ERROR_QUIET)
            string(REGEX MATCHALL "NEEDED +[^\n]+" _needed "${_dump}")
        endif()
        set(${out} "${_needed}" PARENT_SCOPE)
    endfunction()

    _moecache_probe_needed(_needed "")
    if (_needed AND NOT _needed MATCHES "libstdc\\+\\+")
        set(MOECACHE_SHARED_LIBSTDCXX_FLAGS "-Wl,--push-state,--no-as-needed,-lstdc++,--pop-state")
        _moecache_probe_needed(_needed_fixed "${MOECACHE_SHARED_LIBSTDCXX_FLAGS}")
        if (_needed_fixed MATCHES "libstdc\\+\\+")
            message(STATUS "moecache: ${CMAKE_CXX_COMPILER} links libstdc++ statically; linking it dynamically "
                           "so that the process has one libstdc++ (a copy per library breaks the Python module)")
            foreach(kind EXE SHARED MODULE)
                set(CMAKE_${kind}_LINKER_FLAGS "${CMAKE_${kind}_LINKER_FLAGS} ${MOECACHE_SHARED_LIBSTDCXX_FLAGS}")
            endforeach()
        else()
            message(WARNING "moecache: ${CMAKE_CXX_COMPILER} links libstdc++ statically and no shared libstdc++ "
                            "was found to link instead. llama-server works, but `import moecache` may crash on "
                            "model load. Fix: install the toolchain's shared libstdc++ (libstdc++.so) or build "
                            "with a compiler that links it dynamically (CXX=/usr/bin/g++).")
        endif()
    endif()
endif()
