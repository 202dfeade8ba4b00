//! Kernel sets under test and the tolerance each is held to (DESIGN.md §4): a test body runs
//! once per set through [`for_each_set`], and compares with [`Tolerance::check`].
#![allow(dead_code)]

use dsv4::{KernelSetName, Numerics};

/// How a kernel set's results must compare with the reference (the CPU backend or the
/// reference set).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Tolerance {
    /// Bit for bit: the reference set (f64 kernels, the CPU reference's arithmetic).
    BitExact,
    /// Per-row cosine and top-1 agreement floors: a fast set (FP8 tensor cores, f32
    /// accumulation), with the bound its issue derives.
    Close { min_cosine: f64, min_top1: f64 },
}

impl Tolerance {
    /// Asserts that (max |d|, min per-row cosine, top-1 agreement) meet the tolerance.
    pub fn check(&self, what: &str, max_abs: f32, cosine: f64, top1: f64) {
        match *self {
            Tolerance::BitExact => assert!(
                max_abs == 0.0 && top1 == 1.0,
                "{what}: must be bit-identical, max |d| = {max_abs:.3e}, top-1 {top1}"
            ),
            Tolerance::Close {
                min_cosine,
                min_top1,
            } => assert!(
                cosine >= min_cosine && top1 >= min_top1,
                "{what}: cosine {cosine} (>= {min_cosine}), top-1 {top1} (>= {min_top1})"
            ),
        }
    }
}

/// The tolerance of `set`.
pub fn tolerance(set: KernelSetName) -> Tolerance {
    match set {
        KernelSetName::Reference => Tolerance::BitExact,
        // DESIGN.md §4 asks for per-row cosine >= 0.999 and top-1 >= 97% with BF16
        // activations and lets FP8-activation paths document a looser bound. The fast MoE
        // is one: its FP8 wgmma accumulates each 32-term product in the tensor core's
        // reduced precision (<= 2^-10 of the |product| sum, gpu_wgmma_probe), which leaves
        // ~2e-3 relative error per token at Flash shapes (gpu_fast_moe bounds it op by op).
        // On the tiny 3-layer fixtures an error that size flips later routing decisions of
        // a few rows, as FP8 activation quantisation does (their official-vs-exact distance:
        // cosine 0.94-0.97, top-1 87-96%); measured: tiny_fp8 min cosine 0.935, top-1 94.8%.
        // The floor below still catches a wrong layout, scale or token (cosine ~0).
        KernelSetName::Fast => Tolerance::Close {
            min_cosine: 0.9,
            min_top1: 0.9,
        },
    }
}

/// Every kernel set of this build that runs `numerics` (`exact`: the reference set only).
pub fn sets_for(numerics: Numerics) -> Vec<KernelSetName> {
    KernelSetName::ALL
        .iter()
        .map(|&(_, k)| k)
        .filter(|&k| k.runs(numerics))
        .collect()
}

/// Runs `body(set, tolerance)` once per kernel set that runs `numerics`.
pub fn for_each_set(numerics: Numerics, mut body: impl FnMut(KernelSetName, Tolerance)) {
    for set in sets_for(numerics) {
        println!("kernel set `{}`", set.name());
        body(set, tolerance(set));
    }
}
