/*
 * abi_smoke.c - the C ABI end to end, from C11 and (the same file) from C++17.
 *
 *   abi_smoke CONFIG LOAD [EXPECTED [TOL [TOKENS]]]
 *
 *   CONFIG    "tiny" (embedded demo model) or a model directory / config.json path
 *   LOAD      "dummy" or a checkpoint directory / .safetensors file
 *   EXPECTED  if given: logits[last row][0] of the prompt must be within TOL
 *             (default 1e-3) of it
 *   TOKENS    the prompt, comma-separated token ids (at most 48; default "1,2,3,4")
 *
 * Creates an engine (CPU, DSV4_NUMERICS_EXACT: parity with the fp32 transformers oracle),
 * loads, finalizes, prefills the prompt in slot 0 from position 0 (logits of the last
 * row only), prints "logit0 = <value>", runs one decode step, checks error paths (NULL
 * engine, bad enum, wrong lifecycle order, struct_size too small, capacities) and that
 * dsv4_last_error() names the culprit. Exit status 0 on success; every failure prints
 * what went wrong.
 */
#include "dsv4.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int failures = 0;

#define EXPECT(cond, ...)                                                                      \
    do {                                                                                       \
        if (!(cond)) {                                                                         \
            fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__);                               \
            fprintf(stderr, __VA_ARGS__);                                                      \
            fprintf(stderr, "\n");                                                             \
            failures++;                                                                        \
        }                                                                                      \
    } while (0)

/* Checks a status and, for failures, that the last error is non-empty and mentions `needle`. */
static void expect_status(dsv4_status got, dsv4_status want, const char *needle, int line) {
    const char *msg = dsv4_last_error();
    if (got != want) {
        fprintf(stderr, "FAIL line %d: status %s, want %s (%s)\n", line, dsv4_status_name(got),
                dsv4_status_name(want), msg);
        failures++;
        return;
    }
    if (want == DSV4_STATUS_OK) {
        return;
    }
    if (msg == NULL || msg[0] == '\0') {
        fprintf(stderr, "FAIL line %d: %s without a message\n", line, dsv4_status_name(got));
        failures++;
    } else if (needle != NULL && strstr(msg, needle) == NULL) {
        fprintf(stderr, "FAIL line %d: message does not name '%s': %s\n", line, needle, msg);
        failures++;
    }
}
#define CHECK(call, want, needle) expect_status((call), (want), (needle), __LINE__)
#define MAX_PROMPT 48
#define MAX_TOKENS 64 /* params.max_num_tokens and max_seq_len */

/* Parses "a,b,c" into `out`; returns the count, or -1 if malformed or too long. */
static int parse_tokens(const char *text, int32_t *out) {
    int n = 0;
    const char *p = text;
    while (*p != '\0') {
        char *end = NULL;
        long v = strtol(p, &end, 10);
        if (end == p || v < 0 || v > 0x7fffffffL || n == MAX_PROMPT) {
            return -1;
        }
        out[n++] = (int32_t)v;
        p = end;
        if (*p == ',') {
            p++;
        } else if (*p != '\0') {
            return -1;
        }
    }
    return n;
}

#define MUST(call)                                                                             \
    do {                                                                                       \
        dsv4_status s_ = (call);                                                               \
        if (s_ != DSV4_STATUS_OK) {                                                            \
            fprintf(stderr, "FATAL line %d: %s -> %s: %s\n", __LINE__, #call,                  \
                    dsv4_status_name(s_), dsv4_last_error());                                  \
            return 1;                                                                          \
        }                                                                                      \
    } while (0)

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: %s CONFIG(tiny|dir) LOAD(dummy|checkpoint) [EXPECTED [TOL [TOKENS]]]\n",
                argv[0]);
        return 2;
    }
    const char *config = argv[1];
    const char *load = argv[2];
    int32_t tokens[MAX_PROMPT];
    int32_t positions[MAX_PROMPT];
    const int ntok = parse_tokens(argc >= 6 ? argv[5] : "1,2,3,4", tokens);
    if (ntok < 1) {
        fprintf(stderr, "bad TOKENS (comma-separated ids, 1..%d of them)\n", MAX_PROMPT);
        return 2;
    }
    for (int k = 0; k < ntok; k++) {
        positions[k] = k;
    }

    /* Versions: the library must be compatible with this header. */
    uint32_t abi = dsv4_abi_version();
    EXPECT((long)(abi >> 16) == DSV4_ABI_VERSION_MAJOR && (long)(abi & 0xffffu) >= DSV4_ABI_VERSION_MINOR,
           "ABI %u.%u incompatible with header %d.%d", (unsigned)(abi >> 16), (unsigned)(abi & 0xffffu),
           DSV4_ABI_VERSION_MAJOR, DSV4_ABI_VERSION_MINOR);
    printf("%s\n", dsv4_version_string());
    EXPECT(strcmp(dsv4_status_name(DSV4_STATUS_STATE), "STATE") == 0, "status name");

    /* Struct layouts agree between this compiler and the library. */
    dsv4_create_params params = dsv4_create_params_default();
    EXPECT(params.struct_size == sizeof(dsv4_create_params), "create_params size %zu vs %zu",
           params.struct_size, sizeof(dsv4_create_params));
    EXPECT(dsv4_batch_default().struct_size == sizeof(dsv4_batch), "batch size");
    EXPECT(dsv4_tensor_default().struct_size == sizeof(dsv4_tensor), "tensor size");

    /* Error paths before any engine exists. */
    dsv4_engine *engine = NULL;
    CHECK(dsv4_create(NULL, &engine), DSV4_STATUS_NULL_POINTER, "params");
    EXPECT(engine == NULL, "engine set on failure");
    CHECK(dsv4_load(NULL, NULL, DSV4_LOAD_DUMMY), DSV4_STATUS_NULL_POINTER, "engine");
    CHECK(dsv4_finalize(NULL, NULL), DSV4_STATUS_NULL_POINTER, "engine");
    dsv4_destroy(NULL);
    dsv4_create_params small = params;
    small.struct_size = 4;
    small.use_tiny_default = 1;
    CHECK(dsv4_create(&small, &engine), DSV4_STATUS_INVALID_ARGUMENT, "struct_size");
    dsv4_create_params badenum = params;
    badenum.use_tiny_default = 1;
    badenum.numerics = 42;
    CHECK(dsv4_create(&badenum, &engine), DSV4_STATUS_INVALID_ARGUMENT, "numerics");

    /* Create. */
    if (strcmp(config, "tiny") == 0) {
        params.use_tiny_default = 1;
    } else {
        params.config_path = config;
    }
    params.max_num_seqs = 2;
    params.max_num_tokens = MAX_TOKENS;
    params.max_seq_len = MAX_TOKENS;
    params.num_threads = 2;
    params.numerics = DSV4_NUMERICS_EXACT;
    MUST(dsv4_create(&params, &engine));
    EXPECT(dsv4_last_error()[0] == '\0', "last error not cleared by a success");

    dsv4_info info;
    memset(&info, 0, sizeof info);
    info.struct_size = sizeof info;
    MUST(dsv4_get_info(engine, &info));
    EXPECT(info.phase == DSV4_PHASE_CREATED, "phase %d", info.phase);
    EXPECT(info.max_num_tokens == MAX_TOKENS && info.max_seq_len == MAX_TOKENS, "capacities in effect");
    EXPECT(info.numerics == DSV4_NUMERICS_EXACT, "numerics %d in effect, want DSV4_NUMERICS_EXACT",
           info.numerics);
    EXPECT(info.device == DSV4_DEVICE_CPU, "device %d", info.device);
    const int32_t vocab = info.vocab_size;
    for (int k = 0; k < ntok; k++) {
        if (tokens[k] >= vocab) {
            fprintf(stderr, "TOKENS[%d] = %d is not below vocab_size %d\n", k, tokens[k], vocab);
            return 2;
        }
    }

    /* Wrong order and bad enums on a live engine. */
    CHECK(dsv4_finalize(engine, NULL), DSV4_STATUS_STATE, "dsv4_load");
    CHECK(dsv4_load(engine, NULL, 99), DSV4_STATUS_INVALID_ARGUMENT, "format");

    /* Load, finalize. */
    if (strcmp(load, "dummy") == 0) {
        MUST(dsv4_load(engine, NULL, DSV4_LOAD_DUMMY));
    } else {
        MUST(dsv4_load(engine, load, DSV4_LOAD_AUTO));
    }
    CHECK(dsv4_forward(engine, NULL, NULL), DSV4_STATUS_NULL_POINTER, "batch");
    MUST(dsv4_finalize(engine, NULL));
    CHECK(dsv4_load(engine, NULL, DSV4_LOAD_DUMMY), DSV4_STATUS_STATE, "dsv4_load");

    size_t nweights = 0;
    MUST(dsv4_weight_count(engine, &nweights));
    dsv4_weight_desc w;
    memset(&w, 0, sizeof w);
    w.struct_size = sizeof w;
    MUST(dsv4_weight_info(engine, 0, &w));
    EXPECT(w.name != NULL && w.name[0] != '\0' && w.data != NULL && w.nbytes > 0, "weight 0 info");
    CHECK(dsv4_weight_info(engine, nweights, &w), DSV4_STATUS_INVALID_ARGUMENT, "index");

    /* Prefill the prompt in slot 0, logits of the last row only. */
    int32_t slots[1] = {0};
    int32_t query_start[2] = {0, ntok};
    int32_t rows[1] = {ntok - 1};
    float *logits = (float *)malloc(sizeof(float) * (size_t)vocab);
    if (logits == NULL) {
        return 1;
    }
    dsv4_batch batch = dsv4_batch_default();
    batch.num_tokens = ntok;
    batch.num_seqs = 1;
    batch.token_ids = tokens;
    batch.positions = positions;
    batch.seq_slots = slots;
    batch.query_start = query_start;
    batch.logits_rows = rows;
    batch.num_logits = 1;
    batch.logits = logits;
    MUST(dsv4_forward(engine, &batch, NULL));
    float logit0 = logits[0];
    int finite = 1;
    for (int32_t v = 0; v < vocab; v++) {
        finite &= isfinite(logits[v]) ? 1 : 0;
    }
    EXPECT(finite, "non-finite logits");
    printf("prompt: %d tokens, numerics: %s\n", ntok,
           info.numerics == DSV4_NUMERICS_EXACT ? "exact" : "official");
    printf("logit0 = %.9e\n", (double)logit0);

    if (argc >= 4) {
        double expected = atof(argv[3]);
        double tol = argc >= 5 ? atof(argv[4]) : 1e-3;
        double diff = fabs((double)logit0 - expected);
        printf("expected = %.9e, |diff| = %.3e, tol = %g\n", expected, diff, tol);
        EXPECT(diff <= tol, "logit0 %.9e, expected %.9e (tol %g)", (double)logit0, expected, tol);
    }

    /* One decode step continuing slot 0. */
    int32_t next[1] = {5};
    int32_t pos4[1] = {ntok};
    int32_t qs1[2] = {0, 1};
    batch.num_tokens = 1;
    batch.token_ids = next;
    batch.positions = pos4;
    batch.query_start = qs1;
    batch.logits_rows = NULL;
    batch.num_logits = 1;
    MUST(dsv4_forward(engine, &batch, NULL));

    /* Capacity and validation errors leave the engine usable. */
    batch.num_tokens = MAX_TOKENS + 1;
    batch.num_logits = MAX_TOKENS + 1;
    CHECK(dsv4_forward(engine, &batch, NULL), DSV4_STATUS_CAPACITY, "max_num_tokens");
    batch.num_tokens = 1;
    batch.num_logits = 1;
    int32_t far[1] = {MAX_TOKENS};
    batch.positions = far;
    CHECK(dsv4_forward(engine, &batch, NULL), DSV4_STATUS_CAPACITY, "max_seq_len");
    batch.token_ids = NULL;
    CHECK(dsv4_forward(engine, &batch, NULL), DSV4_STATUS_NULL_POINTER, "token_ids");
    CHECK(dsv4_release_slot(engine, 7), DSV4_STATUS_INVALID_ARGUMENT, "slot");
    MUST(dsv4_release_slot(engine, 0));
    batch.token_ids = tokens;
    batch.positions = positions;
    MUST(dsv4_forward(engine, &batch, NULL)); /* slot 0 restarts at position 0 */

    /* The whole prompt again from position 0 (restarting slot 0): the same logits, bit for bit. */
    batch.num_tokens = ntok;
    batch.query_start = query_start;
    batch.logits_rows = rows;
    batch.num_logits = 1;
    logits[0] = NAN;
    MUST(dsv4_forward(engine, &batch, NULL));
    EXPECT(memcmp(&logits[0], &logit0, sizeof logit0) == 0, "rerun of the prompt: logit0 %.9e, first run %.9e",
           (double)logits[0], (double)logit0);

    free(logits);
    dsv4_destroy(engine);
    if (failures != 0) {
        fprintf(stderr, "%d check(s) failed\n", failures);
        return 1;
    }
    printf("abi_smoke: OK\n");
    return 0;
}
