//! Options fixed at create, shared by the engine and both backends (no backend imports this
//! module's users: it sits below all of them).

use std::path::PathBuf;

use crate::error::{Error, Result, Status};
pub use crate::weights::WeightFormat;

/// `numerics` create option (DESIGN.md §4).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Numerics {
    /// No precision simulation: parity with transformers in fp32.
    Exact,
    /// The official FP8/FP4 simulations (MODEL.md §3.4, §12).
    Official,
}

/// The CUDA kernel set a forward runs (DESIGN.md §4): `reference` is the f64 device oracle,
/// bit-identical to the CPU backend; `fast` runs `official` numerics on tensor cores (today its
/// MoE; its other operations run the reference kernels until their fast kernels land).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KernelSetName {
    Reference,
    Fast,
}

impl KernelSetName {
    /// Every set this build has, by its create-option name.
    pub const ALL: &'static [(&'static str, KernelSetName)] = &[
        ("reference", KernelSetName::Reference),
        ("fast", KernelSetName::Fast),
    ];

    pub fn name(self) -> &'static str {
        match self {
            KernelSetName::Reference => "reference",
            KernelSetName::Fast => "fast",
        }
    }

    /// Whether the set runs `numerics` (the fast set is `official` only).
    pub fn runs(self, numerics: Numerics) -> bool {
        self == KernelSetName::Reference || numerics == Numerics::Official
    }

    /// CONFIG naming both when the set does not run `numerics`.
    pub fn check_numerics(self, numerics: Numerics) -> Result<()> {
        if self.runs(numerics) {
            return Ok(());
        }
        Err(Error::new(
            Status::Config,
            format!(
                "kernel_set = `{}` does not run numerics = {} (it runs `official`; `exact` runs \
                 the `reference` set)",
                self.name(),
                match numerics {
                    Numerics::Exact => "exact",
                    Numerics::Official => "official",
                }
            ),
        ))
    }

    /// The set a create option names; CONFIG naming it (and the sets that exist) otherwise.
    pub fn parse(name: &str) -> Result<KernelSetName> {
        Self::ALL
            .iter()
            .find(|(n, _)| *n == name)
            .map(|&(_, k)| k)
            .ok_or_else(|| {
                let have: Vec<&str> = Self::ALL.iter().map(|(n, _)| *n).collect();
                Error::new(
                    Status::Config,
                    format!(
                        "kernel_set = `{name}` does not exist in this build (available: {})",
                        have.join(", ")
                    ),
                )
            })
    }

    /// The default for `numerics`: the fast set where it exists, else the reference set
    /// (`exact` always runs the reference set).
    pub fn default_for(numerics: Numerics) -> KernelSetName {
        match numerics {
            Numerics::Exact => KernelSetName::Reference,
            Numerics::Official => KernelSetName::Fast,
        }
    }
}

/// Capacities and options fixed at create.
#[derive(Clone, Debug)]
pub struct EngineOptions {
    /// -1 = CPU reference backend, >= 0 = CUDA device ordinal.
    pub device: i32,
    pub max_num_seqs: usize,
    pub max_num_tokens: usize,
    pub max_seq_len: usize,
    /// Worker threads of the CPU backend (0 = all cores).
    pub num_threads: usize,
    pub numerics: Numerics,
    pub weight_format: WeightFormat,
    pub cache_dir: Option<PathBuf>,
    /// CUDA kernel set; None = [`KernelSetName::default_for`] the numerics.
    pub kernel_set: Option<KernelSetName>,
    /// CUDA: total bytes of the pinned buffers that load and refit stage host values
    /// through, which bounds the host memory a load takes; 0 = the default (256 MiB).
    pub staging_bytes: usize,
}

impl EngineOptions {
    /// The kernel set in effect.
    pub fn kernel_set(&self) -> KernelSetName {
        self.kernel_set
            .unwrap_or_else(|| KernelSetName::default_for(self.numerics))
    }
}

impl Default for EngineOptions {
    fn default() -> Self {
        EngineOptions {
            device: -1,
            max_num_seqs: 8,
            max_num_tokens: 512,
            max_seq_len: 4096,
            num_threads: 0,
            numerics: Numerics::Official,
            weight_format: WeightFormat::AsStored,
            cache_dir: None,
            kernel_set: None,
            staging_bytes: 0,
        }
    }
}
