//! What `dsv4_load`, `dsv4_load_tensor` and `dsv4_finalize` tell the log sink ([`crate::log`]).
//!
//! The wording is part of the interface: hosts grep these lines, so fields are only ever
//! added (at the end), never renamed or reordered. Every line is `<call>: ` followed by
//! space-separated `key=value` fields; a value never contains a space, except quoted ones
//! (`path`, `device`), which are written as Rust/JSON-style quoted strings. `-` means "not
//! applicable / not known". Seconds are wall-clock, 3 decimals; bytes are exact integers.
//!
//! **Info** (one line per call, nothing per tensor):
//!
//! `dsv4_load: source=<checkpoint|dummy> path="<dir or file>" tensors=<N> src_tensors=<M>
//! skipped=<K> files=<F> bytes=<B> secs=<S> gbps=<G> naming=<scheme> src_dtypes=<D:n,..>
//! weight_format=<as_stored|bf16|quantize> held=<kind:n,..> held_bytes=<H> numerics=<exact|official>`
//!
//! - `tensors`: engine (source) weights that received a value: dsv4_weight_count minus the
//!   derived tensors.
//! - `src_tensors`, `skipped`, `files`: checkpoint tensors read, of them skipped (`mtp.*`),
//!   safetensors files (`-` for dummy).
//! - `bytes`: checkpoint tensor bytes read (dummy: the bytes written into the store);
//!   `gbps` = bytes / secs / 1e9.
//! - `naming`: the checkpoint's naming scheme(s) (see `weights/names.rs`): `upstream`,
//!   `save_pretrained`, `hf_native`, several joined by `+` when mixed, `unknown` when no name
//!   tells; `-` for dummy.
//! - `src_dtypes`: the checkpoint's tensor dtypes with counts (`BF16:150,I64:5`).
//! - `weight_format`, `numerics`: the create options; `held`: how the engine holds its
//!   weights (`f32`, `bf16`, `fp8`, `fp4`, `i32`, with counts); `held_bytes`: their bytes
//!   (FP8/FP4 with their f32 block scales; in host memory on CPU, device memory on CUDA).
//!
//! While a load writes, every few seconds: `<call> progress: weights=<done>/<total>
//! bytes=<done>/<total> secs=<S> gbps=<G>` (weights/values.rs), so a long load never looks
//! hung; `bytes` there are bytes written in the engine's storage format.
//!
//! `dsv4_finalize: backend=<cpu|cuda:N> device="<name>" arch=<sm_..> kernel_set=<reference|fast|->
//! numerics=<..> families=<n> compiled=<n> cached=<n> rejected=<n> compile_secs=<S>
//! weights_bytes=<B> derived_bytes=<B> state_bytes=<B> workspace_bytes=<B> secs=<S>`
//!
//! - `device`, `arch`: the CUDA device's name and NVRTC architecture (`"-"`, `-` on CPU).
//! - `kernel_set`: the CUDA kernel set (`EngineOptions::kernel_set`); `-` on CPU, which runs
//!   the reference math whatever the option says.
//! - `families`, `compiled`, `cached`, `rejected`, `compile_secs`: the CUDA kernel families
//!   loaded by this engine: compiled with NVRTC, read from the on-disk cache, cache files
//!   rejected (corrupt) and recompiled, and the wall time of getting the CUBINs; `-` on CPU.
//! - `*_bytes`: the engine's memory by kind (crate::memory, the figures dsv4_get_info and
//!   dsv4_plan_memory report: CUDA, the device arena's spans; CPU, host buffers, workspace 0).
//!
//! **Debug** (per tensor; nothing is formatted unless the sink takes Debug):
//!
//! - during `dsv4_load` of a checkpoint, one line per checkpoint tensor:
//!   `dsv4_load tensor: name=<checkpoint name> dtype=<D> shape=[a,b] bytes=<B> file=<file name>
//!   role=<weight:<canonical>|scale:<canonical>|skipped>`;
//! - during a dummy `dsv4_load`, one line per weight:
//!   `dsv4_load tensor: name=<canonical> dtype=<held kind> shape=[..] bytes=<B> file=- role=dummy`;
//! - `dsv4_load_tensor: name=<name> dtype=<D> shape=[..] bytes=<B> weights=<written>
//!   loaded=<n>/<total>` for every successful dsv4_load_tensor;
//! - per CUDA kernel family at finalize: `kernel family <name>: <cache hit|compiled|recompiled>`.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;
use std::time::Instant;

use crate::backend::Backend;
use crate::error::Result;
use crate::log::{self, Level};
use crate::options::{EngineOptions, Numerics, WeightFormat};
use crate::weights::UpdateTensor;
use crate::weights::names::{Role, classify};
use crate::weights::qmatrix::QFormat;
use crate::weights::safetensors_io::Checkpoint;
use crate::weights::table::{StorageKind, WeightTable};

/// Where a `dsv4_load` took its values from, with what the summary line reports of it.
#[derive(Clone, Debug)]
pub enum LoadSource {
    Dummy,
    Checkpoint(CheckpointFacts),
}

/// What a checkpoint load read.
#[derive(Clone, Debug, Default)]
pub struct CheckpointFacts {
    pub path: String,
    pub tensors: usize,
    pub skipped: usize,
    pub files: usize,
    pub bytes: u64,
    pub naming: String,
    /// dtype name -> count.
    pub dtypes: BTreeMap<String, usize>,
}

/// What a backend adds to the finalize line (the CPU backend: nothing).
#[derive(Clone, Debug, Default)]
pub struct BackendFacts {
    /// Device model (CUDA: cuDeviceGetName).
    pub device: Option<String>,
    /// NVRTC architecture (CUDA).
    pub arch: Option<String>,
    /// Kernel set loaded (CUDA).
    pub kernel_set: Option<&'static str>,
    /// Kernel families of this engine's registry (CUDA, once finalized).
    pub kernels: Option<KernelFacts>,
}

/// The kernel families a CUDA finalize loaded (`registry::RegistryStats`).
#[derive(Clone, Copy, Debug, Default)]
pub struct KernelFacts {
    pub families: usize,
    pub compiled: usize,
    pub cached: usize,
    pub rejected: usize,
    pub secs: f64,
}

/// Opens the checkpoint at `path`, logs its tensors at Debug and returns it with what the
/// summary line needs (the engine then plans and writes it).
pub fn open_checkpoint(path: &Path) -> Result<(Checkpoint, CheckpointFacts)> {
    let ck = Checkpoint::open(path)?;
    let facts = checkpoint_facts(&ck);
    if log::enabled(Level::Debug) {
        for t in ck.tensors() {
            let file = ck
                .path_of(t)
                .file_name()
                .map_or_else(|| "-".into(), |f| f.to_string_lossy().into_owned());
            let role = match classify(&t.name) {
                Some(Role::Weight(tg)) => format!("weight:{}", tg.describe().replace(' ', "_")),
                Some(Role::Scale(tg)) => format!("scale:{}", tg.describe().replace(' ', "_")),
                Some(Role::Mtp) => "skipped".into(),
                None => "unknown".into(),
            };
            log::debug(&format!(
                "dsv4_load tensor: name={} dtype={:?} shape={} bytes={} file={file} role={role}",
                t.name,
                t.dtype,
                shape(&t.shape),
                t.byte_len()
            ));
        }
    }
    Ok((ck, facts))
}

fn checkpoint_facts(ck: &Checkpoint) -> CheckpointFacts {
    let mut f = CheckpointFacts {
        path: ck.source.display().to_string(),
        tensors: ck.tensors().len(),
        files: ck.files().len(),
        ..Default::default()
    };
    let mut schemes = [false; 3];
    for t in ck.tensors() {
        if matches!(classify(&t.name), Some(Role::Mtp)) {
            f.skipped += 1;
        }
        f.bytes += t.byte_len() as u64;
        *f.dtypes.entry(format!("{:?}", t.dtype)).or_default() += 1;
        if let Some(s) = scheme_of(&t.name) {
            schemes[s] = true;
        }
    }
    const NAMES: [&str; 3] = ["upstream", "save_pretrained", "hf_native"];
    let seen: Vec<&str> = (0..3).filter(|&i| schemes[i]).map(|i| NAMES[i]).collect();
    f.naming = if seen.is_empty() {
        "unknown".into()
    } else {
        seen.join("+")
    };
    f
}

/// Which naming scheme a per-layer tensor name is written in (0 upstream, 1 save_pretrained,
/// 2 HF-native); None for names every scheme spells alike (globals, `mtp.*`, unknown).
pub fn scheme_of(name: &str) -> Option<usize> {
    let (prefixed, bare) = match name.strip_prefix("model.") {
        Some(b) => (true, b),
        None => (false, name),
    };
    let mut parts = bare.split('.');
    if parts.next() != Some("layers") {
        return None;
    }
    parts.next()?;
    let first = parts.next()?;
    let native = matches!(
        first,
        "self_attn" | "mlp" | "input_layernorm" | "post_attention_layernorm" | "attn_hc" | "ffn_hc"
    );
    let upstream_spelling = matches!(first, "attn" | "ffn" | "attn_norm" | "ffn_norm")
        || first.starts_with("hc_attn_")
        || first.starts_with("hc_ffn_");
    if native {
        Some(2)
    } else if upstream_spelling {
        Some(if prefixed { 1 } else { 0 })
    } else {
        None
    }
}

/// The Info summary of a successful `dsv4_load` that started at `start`.
pub fn log_load(source: &LoadSource, store: &WeightTable, opts: &EngineOptions, start: Instant) {
    if !log::enabled(Level::Info) {
        return;
    }
    let secs = start.elapsed().as_secs_f64();
    let (held, held_bytes) = held(store);
    let mut line = String::from("dsv4_load: ");
    let bytes = match source {
        LoadSource::Dummy => {
            let _ = write!(
                line,
                "source=dummy path=\"-\" tensors={} src_tensors=- skipped=- files=-",
                store.len()
            );
            held_bytes
        }
        LoadSource::Checkpoint(f) => {
            let _ = write!(
                line,
                "source=checkpoint path={:?} tensors={} src_tensors={} skipped={} files={}",
                f.path,
                store.len(),
                f.tensors,
                f.skipped,
                f.files
            );
            f.bytes
        }
    };
    let (naming, dtypes) = match source {
        LoadSource::Dummy => ("-".to_string(), "-".to_string()),
        LoadSource::Checkpoint(f) => (f.naming.clone(), counts(&f.dtypes)),
    };
    let _ = write!(
        line,
        " bytes={bytes} secs={secs:.3} gbps={:.3} naming={naming} src_dtypes={dtypes} \
         weight_format={} held={held} held_bytes={held_bytes} numerics={}",
        rate(bytes, secs),
        weight_format_name(opts.weight_format),
        numerics_name(opts.numerics),
    );
    log::info(&line);
    if matches!(source, LoadSource::Dummy) && log::enabled(Level::Debug) {
        for t in store.entries() {
            log::debug(&format!(
                "dsv4_load tensor: name={} dtype={} shape={} bytes={} file=- role=dummy",
                t.spec.name,
                held_kind(t.layout.kind),
                shape(&t.spec.shape),
                t.layout.bytes()
            ));
        }
    }
}

/// The Debug line of a successful `dsv4_load_tensor` that wrote `written` weights.
pub fn log_load_tensor(u: &UpdateTensor, written: usize, loaded: &[bool]) {
    if !log::enabled(Level::Debug) {
        return;
    }
    log::debug(&format!(
        "dsv4_load_tensor: name={} dtype={} shape={} bytes={} weights={written} loaded={}/{}",
        u.name,
        u.dtype.name(),
        shape(u.shape),
        u.data.len(),
        loaded.iter().filter(|&&l| l).count(),
        loaded.len()
    ));
}

/// The Info summary of a successful `dsv4_finalize` (the backend step) that started at `start`.
pub fn log_finalize(backend: &dyn Backend, opts: &EngineOptions, start: Instant) {
    if !log::enabled(Level::Info) {
        return;
    }
    let secs = start.elapsed().as_secs_f64();
    let facts = backend.facts();
    let mem = backend.memory();
    let or_dash = |v: Option<String>| v.unwrap_or_else(|| "-".into());
    let k = facts.kernels;
    let kf = |f: fn(&KernelFacts) -> String| k.as_ref().map(f);
    log::info(&format!(
        "dsv4_finalize: backend={} device={:?} arch={} kernel_set={} numerics={} families={} \
         compiled={} cached={} rejected={} compile_secs={} weights_bytes={} derived_bytes={} \
         state_bytes={} workspace_bytes={} secs={secs:.3}",
        backend.device_name(),
        facts.device.as_deref().unwrap_or("-"),
        or_dash(facts.arch.clone()),
        facts.kernel_set.unwrap_or("-"),
        numerics_name(opts.numerics),
        or_dash(kf(|k| k.families.to_string())),
        or_dash(kf(|k| k.compiled.to_string())),
        or_dash(kf(|k| k.cached.to_string())),
        or_dash(kf(|k| k.rejected.to_string())),
        or_dash(kf(|k| format!("{:.3}", k.secs))),
        mem.weights,
        mem.derived,
        mem.state,
        mem.workspace,
    ));
}

fn rate(bytes: u64, secs: f64) -> f64 {
    if secs > 0.0 {
        bytes as f64 / secs / 1e9
    } else {
        0.0
    }
}

fn shape(s: &[usize]) -> String {
    let dims: Vec<String> = s.iter().map(|d| d.to_string()).collect();
    format!("[{}]", dims.join(","))
}

fn counts(m: &BTreeMap<String, usize>) -> String {
    if m.is_empty() {
        return "-".into();
    }
    m.iter()
        .map(|(k, v)| format!("{k}:{v}"))
        .collect::<Vec<_>>()
        .join(",")
}

fn held_kind(k: StorageKind) -> &'static str {
    match k {
        StorageKind::F32 => "f32",
        StorageKind::Bf16 => "bf16",
        StorageKind::I32 => "i32",
        StorageKind::Quant(QFormat::Fp8 { .. }) => "fp8",
        StorageKind::Quant(QFormat::Fp4) => "fp4",
    }
}

/// `held` field (kinds with counts) and the total bytes of the weights as held.
fn held(table: &WeightTable) -> (String, u64) {
    let mut kinds = BTreeMap::new();
    for t in table.entries() {
        *kinds
            .entry(held_kind(t.layout.kind).to_string())
            .or_default() += 1;
    }
    (counts(&kinds), table.total_bytes())
}

fn weight_format_name(w: WeightFormat) -> &'static str {
    match w {
        WeightFormat::AsStored => "as_stored",
        WeightFormat::Bf16 => "bf16",
        WeightFormat::Quantize => "quantize",
    }
}

fn numerics_name(n: Numerics) -> &'static str {
    match n {
        Numerics::Exact => "exact",
        Numerics::Official => "official",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn naming_schemes() {
        assert_eq!(scheme_of("layers.0.attn.wq_a.weight"), Some(0));
        assert_eq!(scheme_of("layers.0.hc_attn_fn"), Some(0));
        assert_eq!(scheme_of("model.layers.0.attn.norm.weight"), Some(1));
        assert_eq!(scheme_of("model.layers.3.ffn.experts.0.w1.weight"), Some(1));
        assert_eq!(
            scheme_of("model.layers.0.self_attn.q_a_proj.weight"),
            Some(2)
        );
        assert_eq!(
            scheme_of("model.layers.0.mlp.experts.gate_up_proj"),
            Some(2)
        );
        assert_eq!(scheme_of("model.layers.0.attn_hc.fn"), Some(2));
        assert_eq!(scheme_of("model.embed_tokens.weight"), None);
        assert_eq!(scheme_of("head.weight"), None);
        assert_eq!(scheme_of("mtp.0.attn.wq_a.weight"), None);
    }
}
