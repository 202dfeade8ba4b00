// cpp_test_support.hpp - what the C++ test programs (cpp_wrapper.cpp, cpp_refit_guard.cpp) share:
// the failure counter with its EXPECT check, and the small engine both create.
#pragma once

#include "dsv4.hpp"

#include <cstdio>
#include <string>

static int failures = 0;

#define EXPECT(cond, what)                                                                     \
    do {                                                                                       \
        if (!(cond)) {                                                                         \
            std::fprintf(stderr, "FAIL line %d: %s (last error: %s)\n", __LINE__, what,        \
                         dsv4::last_error().c_str());                                          \
            failures++;                                                                        \
        }                                                                                      \
    } while (0)

/// Create parameters of the CPU engine the programs test: `config` is "tiny" (the embedded
/// tiny config) or a config path, which must outlive the returned parameters.
static dsv4_create_params test_params(const std::string &config) {
    dsv4_create_params p = dsv4_create_params_default();
    if (config == "tiny") {
        p.use_tiny_default = 1;
    } else {
        p.config_path = config.c_str();
    }
    p.max_num_seqs = 2;
    p.max_num_tokens = 16;
    p.max_seq_len = 64;
    p.num_threads = 2;
    p.numerics = DSV4_NUMERICS_EXACT;
    return p;
}
