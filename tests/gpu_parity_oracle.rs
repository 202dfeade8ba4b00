//! The CUDA half of the HF-oracle parity tests (parity_hf.rs and parity_c_abi.rs hold the
//! CPU half): the same scenarios (common::parity::hf and ::c_abi: one-shot, chunked with odd
//! chunks interleaved at different offsets, prefill + batched decode) for `tiny` and
//! `tiny_native`, on CUDA device 0 through the C ABI (common::rig::Rig: host slices staged
//! into fixed device buffers, logits copied back), in exact numerics.
//!
//! Every step runs on a CPU reference engine too, and the CUDA logits must equal it bit for
//! bit (exact numerics run the reference kernels, bit-identical to the CPU reference:
//! DESIGN.md §4); every logit is checked against both HF oracles with the CPU's tolerance,
//! max |dlogit| <= 1e-3. Without a GPU this prints `skipped: no CUDA device`.

mod common;

use common::gpu::has_cuda;
use common::parity::{Forward, Scenario, abi_engine, c_abi, hf};
use common::rig::{Rig, Step};
use common::{Oracle, assert_bits};

/// A CUDA engine whose every step is mirrored on a CPU engine and compared bit for bit.
struct Mirrored {
    gpu: Rig,
    cpu: Rig,
    steps: usize,
}

impl Forward for Mirrored {
    fn vocab(&self) -> usize {
        self.gpu.vocab
    }

    fn forward_step(&mut self, s: &Step) -> Vec<f32> {
        let g = self.gpu.forward(s);
        let c = self.cpu.forward(s);
        assert_bits(&format!("step {} (CUDA vs CPU)", self.steps), &g, &c);
        self.steps += 1;
        g
    }
}

/// Runs `scenario` on CUDA device 0 (mirrored on the CPU) for `model`.
fn on_cuda(scenario: Scenario, model: &str) {
    if !has_cuda() {
        return;
    }
    let mut m = Mirrored {
        gpu: abi_engine(model, 0),
        cpu: abi_engine(model, -1),
        steps: 0,
    };
    scenario(&mut m, &Oracle::load(model), &format!("{model} [CUDA]"));
    println!("{model}: {} steps, CUDA == CPU bit for bit", m.steps);
}

/// The engine-API scenarios (parity_hf's), here through the C ABI on CUDA.
mod hf_scenarios {
    use super::*;
    parity_tests!(hf, on_cuda);
}

/// parity_c_abi's scenarios on CUDA.
mod c_abi_scenarios {
    use super::*;
    parity_tests!(c_abi, on_cuda);
}
