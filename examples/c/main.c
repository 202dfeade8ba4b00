/*
 * examples/c/main.c - the smallest complete dsv4 host in C, built against an installed
 * package (scripts/install.sh PREFIX):
 *
 *   cc -std=c11 main.c $(pkg-config --cflags --libs dsv4) -o dsv4_example_c   # pkg-config
 *   cmake -S examples -B build -DCMAKE_PREFIX_PATH=PREFIX && cmake --build build  # CMake
 *
 * (pkg-config needs PKG_CONFIG_PATH=PREFIX/lib/pkgconfig when PREFIX is not a system one;
 * at run time the loader must find libdsv4.so.1: LD_LIBRARY_PATH=PREFIX/lib or an rpath.)
 *
 * Creates a CPU engine on the embedded tiny model with dummy weights, runs one forward on
 * the prompt 1,2,3,4 (logits of the last token only, the buffer sized from dsv4_get_info's
 * vocab_size) and prints "logit0 = <logits[0]>" and the argmax. Exit status 0 on success.
 */
#include <dsv4.h>

#include <stdio.h>
#include <stdlib.h>

#define CHECK(call)                                                                            \
    do {                                                                                       \
        dsv4_status s_ = (call);                                                               \
        if (s_ != DSV4_STATUS_OK) {                                                            \
            fprintf(stderr, "%s failed: %s: %s\n", #call, dsv4_status_name(s_),                \
                    dsv4_last_error());                                                        \
            goto fail;                                                                         \
        }                                                                                      \
    } while (0)

int main(void) {
    dsv4_engine *engine = NULL;
    float *logits = NULL;
    uint32_t abi = dsv4_abi_version();
    if ((abi >> 16) != DSV4_ABI_VERSION_MAJOR || (abi & 0xffffu) < DSV4_ABI_VERSION_MINOR) {
        fprintf(stderr, "library ABI %u.%u cannot serve this header's %d.%d\n", (unsigned)(abi >> 16),
                (unsigned)(abi & 0xffffu), DSV4_ABI_VERSION_MAJOR, DSV4_ABI_VERSION_MINOR);
        return 1;
    }
    printf("%s\n", dsv4_version_string());

    dsv4_create_params p = dsv4_create_params_default();
    p.use_tiny_default = 1;      /* embedded tiny demo model */
    p.device = DSV4_DEVICE_CPU;  /* CPU reference backend */
    p.max_num_seqs = 1;
    p.max_num_tokens = 16;
    p.max_seq_len = 64;
    p.num_threads = 2;
    CHECK(dsv4_create(&p, &engine));
    CHECK(dsv4_load(engine, NULL, DSV4_LOAD_DUMMY));
    CHECK(dsv4_finalize(engine, NULL));

    dsv4_info info = {0};
    info.struct_size = sizeof info;
    CHECK(dsv4_get_info(engine, &info));
    logits = calloc((size_t)info.vocab_size, sizeof *logits);
    if (logits == NULL) {
        fprintf(stderr, "out of memory\n");
        goto fail;
    }

    /* One sequence in slot 0: tokens 1,2,3,4 at positions 0..3; logits of row 3 only. */
    const int32_t tokens[4] = {1, 2, 3, 4}, positions[4] = {0, 1, 2, 3};
    const int32_t slots[1] = {0}, query_start[2] = {0, 4}, rows[1] = {3};
    dsv4_batch b = dsv4_batch_default();
    b.num_tokens = 4;
    b.num_seqs = 1;
    b.token_ids = tokens;
    b.positions = positions;
    b.seq_slots = slots;
    b.query_start = query_start;
    b.logits_rows = rows;
    b.num_logits = 1;
    b.logits = logits;
    b.logits_dtype = DSV4_LOGITS_F32;
    CHECK(dsv4_forward(engine, &b, NULL));

    int32_t best = 0;
    for (int32_t v = 1; v < info.vocab_size; v++) {
        if (logits[v] > logits[best]) {
            best = v;
        }
    }
    printf("vocab_size = %d\n", (int)info.vocab_size);
    printf("logit0 = %.9e\n", (double)logits[0]);
    printf("argmax = %d\n", (int)best);
    free(logits);
    dsv4_destroy(engine);
    return 0;

fail:
    free(logits);
    dsv4_destroy(engine);
    return 1;
}
