# One libstdc++ per process. Some toolchains link libstdc++ statically into everything they link
# (a compiler wrapper that adds -static-libstdc++, or GCC configured with static standard
# libraries; seen on the H200 machine's image, whose compiler has no shared libstdc++ of its own).
# Every shared library of the build then carries its own copy of libstdc++ and exports it.
# llama-server is fine (the executable's copy interposes all others), but in a Python process the
# libraries sit in the extension's local scope: libllama binds some std:: symbols to _core's copy
# and others to its own, and the first std::stringstream (llama_model::print_info) crashes on locale
# state from two copies. Link the shared libstdc++ instead, as distributions' toolchains do: the
# compiler's own, else the one the dynamic loader would load at run time anyway.
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
        # where a shared libstdc++ may be: the linker's search path, by either name, and the copy that
        # the dynamic loader's cache names (what every process on this machine loads)
        set(_candidates "-lstdc++" "-l:libstdc++.so.6")
        find_program(_ldconfig ldconfig PATHS /sbin /usr/sbin)
        if (_ldconfig)
            execute_process(COMMAND ${_ldconfig} -p OUTPUT_VARIABLE _ldcache ERROR_QUIET)
            string(REGEX MATCH "libstdc\\+\\+\\.so\\.6 \\([^)]*x86-64[^)]*\\) => ([^\n]+)" _m "${_ldcache}")
            if (NOT CMAKE_MATCH_1)
                string(REGEX MATCH "libstdc\\+\\+\\.so\\.6 \\([^)]*\\) => ([^\n]+)" _m "${_ldcache}")
            endif()
            if (CMAKE_MATCH_1)
                list(APPEND _candidates "${CMAKE_MATCH_1}")
            endif()
        endif()
        set(MOECACHE_SHARED_LIBSTDCXX_FLAGS "")
        foreach(_lib ${_candidates})
            set(_flags "-Wl,--push-state,--no-as-needed,${_lib},--pop-state")
            _moecache_probe_needed(_needed_fixed "${_flags}")
            if (_needed_fixed MATCHES "libstdc\\+\\+")
                set(MOECACHE_SHARED_LIBSTDCXX_FLAGS "${_flags}")
                set(_chosen "${_lib}")
                break()
            endif()
        endforeach()
        if (MOECACHE_SHARED_LIBSTDCXX_FLAGS)
            message(STATUS "moecache: ${CMAKE_CXX_COMPILER} links libstdc++ statically; linking the shared one "
                           "(${_chosen}) so that the process has one libstdc++ (a copy per library breaks the Python module)")
            foreach(kind EXE SHARED MODULE)
                set(CMAKE_${kind}_LINKER_FLAGS "${CMAKE_${kind}_LINKER_FLAGS} ${MOECACHE_SHARED_LIBSTDCXX_FLAGS}")
            endforeach()
        else()
            message(WARNING "moecache: ${CMAKE_CXX_COMPILER} links libstdc++ statically and no shared libstdc++ "
                            "could be linked instead (tried: ${_candidates}). llama-server works, but `import "
                            "moecache` may crash on model load. Fix: install the shared libstdc++ (libstdc++.so) "
                            "or build with a compiler that links it dynamically (CXX=g++ of the distribution).")
        endif()
    endif()
endif()
