// examples/cpp/main.cpp - the smallest complete dsv4 host in C++17, through the header-only
// RAII wrapper dsv4.hpp (installed beside dsv4.h by scripts/install.sh PREFIX):
//
//   cmake -S examples -B build -DCMAKE_PREFIX_PATH=PREFIX && cmake --build build
//   c++ -std=c++17 main.cpp $(pkg-config --cflags --libs dsv4) -o dsv4_example_cpp
//
// Failures throw dsv4::Error (DSV4_HPP_EXCEPTIONS). Creates a CPU engine on the embedded
// tiny model with dummy weights, runs one forward on the prompt 1,2,3,4 (logits of the last
// token only, sized from dsv4_get_info's vocab_size) and prints "logit0 = <logits[0]>" and
// the argmax; the engine is destroyed when `engine` goes out of scope.
#define DSV4_HPP_EXCEPTIONS
#include <dsv4.hpp>

#include <algorithm>
#include <cstdio>
#include <exception>
#include <iterator>

int main() {
    try {
        if (!dsv4::abi_compatible()) {
            std::fprintf(stderr, "library ABI %u.%u cannot serve this header's %d.%d\n", dsv4_abi_version() >> 16,
                         dsv4_abi_version() & 0xffffu, DSV4_ABI_VERSION_MAJOR, DSV4_ABI_VERSION_MINOR);
            return 1;
        }
        std::printf("%s\n", dsv4_version_string());

        dsv4_create_params p = dsv4_create_params_default();
        p.use_tiny_default = 1;     // embedded tiny demo model
        p.device = DSV4_DEVICE_CPU; // CPU reference backend
        p.max_num_seqs = 1;
        p.max_num_tokens = 16;
        p.max_seq_len = 64;
        p.num_threads = 2;
        dsv4::Engine engine(p);
        engine.load_dummy();
        engine.finalize();

        dsv4_info info{};
        engine.info(info);

        // One sequence in slot 0 from position 0; only its last token's logits.
        dsv4::HostBatch batch;
        batch.all_rows = false;
        batch.add_sequence(/*slot=*/0, /*start=*/0, {1, 2, 3, 4});
        engine.forward(batch); // sizes batch.logits to num_logits * vocab_size

        const auto best = std::max_element(batch.logits.begin(), batch.logits.end());
        std::printf("vocab_size = %d\n", static_cast<int>(info.vocab_size));
        std::printf("logit0 = %.9e\n", static_cast<double>(batch.logits.at(0)));
        std::printf("argmax = %d\n", static_cast<int>(std::distance(batch.logits.begin(), best)));
        return 0;
    } catch (const dsv4::Error &e) {
        std::fprintf(stderr, "dsv4: %s\n", e.what());
    } catch (const std::exception &e) {
        std::fprintf(stderr, "error: %s\n", e.what());
    }
    return 1;
}
