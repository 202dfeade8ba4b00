//! The engine lifecycle state machine: create -> load -> finalize -> forward / refit.
//!
//! Every wrong order is a `Status::State` error naming the call and the current phase.
//! Everything the engine owns (weights, per-slot state) is allocated in [`Engine::create`]
//! at its final address; later calls only write in place.

use std::path::{Path, PathBuf};

use crate::config::ModelConfig;
use crate::error::{Error, Result, Status};
use crate::load_report;
use crate::reference::CpuBackend;
use crate::refit_pairs::{PendingPairs, Write};
use crate::weights;
use crate::weights::load::CheckedValues;
use crate::weights::store::WeightStore;
use crate::weights::table::WeightTable;
use crate::weights::values::{Progress, WeightValues};
use crate::weights::{Bytes, UpdateTensor};

use crate::backend::Backend;
pub use crate::backend::{
    Batch, BufferSpans, DerivedTensor, DeviceBatch, Elem, LogitsOut, StreamHandle, WeightAddr,
};
pub use crate::options::{EngineOptions, KernelSetName, Numerics, WeightFormat};

/// `dsv4_load` format.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LoadFormat {
    /// Safetensors if `source` names a checkpoint, error otherwise.
    Auto,
    Safetensors,
    /// Deterministic small values; no files read.
    Dummy,
}

/// Where the model config comes from at create.
#[derive(Clone, Debug)]
pub enum ConfigSource {
    /// A `config.json` file or a directory containing one.
    Path(PathBuf),
    /// The JSON text itself.
    Json(String),
    /// The embedded tiny demo model.
    TinyDefault,
}

/// One named weight update (load_tensor / refit), from host memory. A stored-format weight
/// (F8_E4M3 / FP4_E2M1 codes) comes with its block-scale tensor as another entry of the same
/// refit, named as checkpoints name it (`<weight>.scale`, `<weight>_scale_inv`), or of another
/// chunk of the same chunked refit.
pub type TensorUpdate<'a> = crate::weights::UpdateTensor<'a>;

/// What a tensor name stands for (Engine::canonical_name).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NameKind {
    Weight,
    Scale,
    /// transformers' fused gate_up_proj of a layer's experts.
    FusedGateUp,
    /// transformers' fused down_proj.
    FusedDown,
    /// An MTP tensor: skipped.
    Skipped,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// Created: buffers allocated, weights not (fully) loaded.
    Created,
    /// Every weight has a value; derived buffers may be stale.
    Loaded,
    /// Finalized: forward and refit allowed.
    Ready,
    /// Between dsv4_refit_begin and dsv4_refit_end: refit chunks allowed, forward not (the
    /// weights may be half old, half new).
    Refitting,
}

impl Phase {
    pub fn name(self) -> &'static str {
        match self {
            Phase::Created => "created (weights not loaded)",
            Phase::Loaded => "loaded (not finalized)",
            Phase::Ready => "ready (finalized)",
            Phase::Refitting => "refitting (between dsv4_refit_begin and dsv4_refit_end)",
        }
    }
}

pub struct Engine {
    cfg: ModelConfig,
    opts: EngineOptions,
    /// Every weight's name, shape and storage: what loads and refits are validated against.
    /// The values live in the backend (DESIGN.md §2: no host mirror on CUDA).
    weights: WeightTable,
    /// Which weights have received a value (load, load_tensor or dummy).
    loaded: Vec<bool>,
    backend: Box<dyn Backend>,
    phase: Phase,
    /// Stored-format refit entries waiting for their partner (weight or scale) in a later
    /// chunk of an open chunked refit; always empty outside one.
    pending: PendingPairs,
}

impl Engine {
    /// Parses the config, picks the backend and allocates everything at its final address.
    pub fn create(source: ConfigSource, opts: EngineOptions) -> Result<Engine> {
        let cfg = match &source {
            ConfigSource::Path(p) => ModelConfig::from_path(p)?,
            ConfigSource::Json(t) => ModelConfig::from_json_str(t)?,
            ConfigSource::TinyDefault => ModelConfig::tiny_default(),
        };
        validate_options(&cfg, &opts)?;
        let weights = WeightTable::new(&cfg, opts.weight_format)?;
        let loaded = vec![false; weights.len()];
        let backend: Box<dyn Backend> = if opts.device >= 0 {
            crate::cuda::require_device(opts.device)?;
            Box::new(crate::cuda::backend::CudaBackend::new(
                &cfg, &opts, &weights,
            )?)
        } else {
            Box::new(CpuBackend::new(&cfg, &opts)?)
        };
        Ok(Engine {
            cfg,
            opts,
            weights,
            loaded,
            backend,
            phase: Phase::Created,
            pending: PendingPairs::default(),
        })
    }

    /// The memory an engine created from `source` with `opts` would use, by kind
    /// (crate::memory), allocating nothing; the same checks as [`Engine::create`] apply.
    pub fn plan_memory(
        source: &ConfigSource,
        opts: &EngineOptions,
    ) -> Result<crate::memory::MemoryFigures> {
        let cfg = match source {
            ConfigSource::Path(p) => ModelConfig::from_path(p)?,
            ConfigSource::Json(t) => ModelConfig::from_json_str(t)?,
            ConfigSource::TinyDefault => ModelConfig::tiny_default(),
        };
        validate_options(&cfg, opts)?;
        crate::memory::plan(&cfg, opts)
    }

    /// The memory this engine allocated at create, by kind (the figures its plan gave).
    pub fn memory(&self) -> crate::memory::MemoryFigures {
        self.backend.memory()
    }

    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    pub fn options(&self) -> &EngineOptions {
        &self.opts
    }

    pub fn phase(&self) -> Phase {
        self.phase
    }

    /// Every weight's name, shape and storage layout.
    pub fn weights(&self) -> &WeightTable {
        &self.weights
    }

    /// The weights' values when they live in host memory (the CPU backend); None on CUDA,
    /// which keeps no host copy.
    pub fn host_store(&self) -> Option<&WeightStore> {
        self.backend.host_store()
    }

    /// Host memory the engine holds now beyond its fixed buffers: staging buffers while a
    /// CUDA load or refit writes, and refit halves held for their partner.
    pub fn transient_host_bytes(&self) -> u64 {
        self.backend.transient_host_bytes() + self.pending.held_bytes()
    }

    /// True when the engine runs on a CUDA device (batch buffers are device pointers).
    pub fn is_cuda(&self) -> bool {
        self.backend.is_device()
    }

    /// Where weight `i` (a source weight, `i < weights().len()`) lives: the backend's copy
    /// (device memory on CUDA), fixed from create to destroy.
    pub fn weight_addr(&self, i: usize) -> WeightAddr {
        self.backend.weight_addr(i)
    }

    fn expect_phase(&self, call: &str, allowed: &[Phase]) -> Result<()> {
        if allowed.contains(&self.phase) {
            return Ok(());
        }
        let hint = match self.phase {
            Phase::Created => "load weights and call dsv4_finalize first",
            Phase::Loaded => "call dsv4_finalize first",
            Phase::Ready => "the engine is finalized: use dsv4_refit to change weights",
            Phase::Refitting => "a chunked refit is open: call dsv4_refit_end first",
        };
        Err(Error::new(
            Status::State,
            format!(
                "{call} is not allowed: engine is {} ({hint})",
                self.phase.name()
            ),
        ))
    }

    /// Loads every weight from a checkpoint directory/file, or fills dummy values.
    pub fn load(&mut self, source: Option<&Path>, format: LoadFormat) -> Result<()> {
        self.expect_phase("dsv4_load", &[Phase::Created, Phase::Loaded])?;
        let t0 = std::time::Instant::now();
        // The values live here while they are written (a checkpoint's values borrow its mapping).
        let (dummy, ck, checked);
        let (values, from): (&dyn WeightValues, _) = match format {
            LoadFormat::Dummy => {
                dummy = weights::dummy::DummyValues::new(&self.weights, &self.cfg, DUMMY_SEED);
                (&dummy, load_report::LoadSource::Dummy)
            }
            LoadFormat::Auto | LoadFormat::Safetensors => {
                let path = source.ok_or_else(|| {
                    Error::new(
                        Status::NullPointer,
                        "dsv4_load: `source` is NULL but the format needs a checkpoint path",
                    )
                })?;
                let facts;
                (ck, facts) = load_report::open_checkpoint(path)?;
                checked = weights::load::plan_checkpoint(&self.weights, &ck, self.quant_block())?;
                (&checked, load_report::LoadSource::Checkpoint(facts))
            }
        };
        let null = std::ptr::null_mut();
        write_values(
            self.backend.as_mut(),
            &self.weights,
            "dsv4_load",
            values,
            null,
        )?;
        self.loaded.iter_mut().for_each(|l| *l = true);
        self.phase = Phase::Loaded;
        load_report::log_load(&from, &self.weights, &self.opts, t0);
        Ok(())
    }

    /// FP8 block shape of stored-format updates: the config's, else the upstream 128x128.
    fn quant_block(&self) -> [usize; 2] {
        self.cfg
            .quant
            .as_ref()
            .map_or([128, 128], |q| q.weight_block)
    }

    /// Loads one named weight (streaming hosts). Allowed before finalize.
    pub fn load_tensor(&mut self, update: &TensorUpdate) -> Result<()> {
        self.expect_phase("dsv4_load_tensor", &[Phase::Created, Phase::Loaded])?;
        // One update may fill several weights (HF-native fused experts) or none (`mtp.*`).
        let block = self.quant_block();
        let values = weights::load::plan_updates(&self.weights, &[(*update, None)], block)?;
        let null = std::ptr::null_mut();
        let touched = write_checked(
            self.backend.as_mut(),
            &self.weights,
            "dsv4_load_tensor",
            &values,
            null,
        )?;
        for &i in &touched {
            self.loaded[i] = true;
        }
        load_report::log_load_tensor(update, touched.len(), &self.loaded);
        if self.loaded.iter().all(|&l| l) {
            self.phase = Phase::Loaded;
        }
        Ok(())
    }

    /// Loads named weights (streaming hosts), from host or device memory, all validated before
    /// any is written; a stored-format weight comes with its scale entry in the same call.
    /// Allowed before finalize. Device values are read on `stream`.
    pub fn load_tensors(&mut self, updates: &[TensorUpdate], stream: StreamHandle) -> Result<()> {
        self.expect_phase("dsv4_load_tensors", &[Phase::Created, Phase::Loaded])?;
        let block = self.quant_block();
        let backend = self.backend.as_ref();
        let stage = |u: &UpdateTensor| stage_entry(backend, u, stream);
        let none = PendingPairs::default();
        let (writes, _) = none.plan(&self.weights, updates, block, false, &stage, "load")?;
        let staged = stage_mixed_halves(backend, &writes, stream)?;
        let pairs = pairs_of(&writes, &staged);
        let values = weights::load::plan_updates(&self.weights, &pairs, block)?;
        let touched = write_checked(
            self.backend.as_mut(),
            &self.weights,
            "dsv4_load_tensors",
            &values,
            stream,
        )?;
        for &i in &touched {
            self.loaded[i] = true;
        }
        if self.loaded.iter().all(|&l| l) {
            self.phase = Phase::Loaded;
        }
        Ok(())
    }

    /// Rebuilds derived buffers and makes the engine runnable. Idempotent.
    pub fn finalize(&mut self) -> Result<()> {
        self.finalize_on(std::ptr::null_mut())
    }

    /// [`Engine::finalize`] on the host's CUDA stream (ignored by the CPU backend).
    pub fn finalize_on(&mut self, stream: StreamHandle) -> Result<()> {
        match self.phase {
            Phase::Ready => return Ok(()),
            Phase::Refitting => {
                return Err(Error::new(
                    Status::State,
                    "dsv4_finalize is not allowed during a chunked refit: call dsv4_refit_end",
                ));
            }
            Phase::Loaded => {}
            Phase::Created => {
                let missing = self.loaded.iter().position(|&l| !l);
                let name = missing
                    .map(|i| self.weights.name(i).to_owned())
                    .unwrap_or_default();
                let count = self.loaded.iter().filter(|&&l| !l).count();
                return Err(Error::new(
                    Status::State,
                    format!(
                        "dsv4_finalize: {count} weights have no value yet (first: `{name}`); call dsv4_load first"
                    ),
                ));
            }
        }
        let t0 = std::time::Instant::now();
        self.finalize_backend(stream)?;
        self.phase = Phase::Ready;
        load_report::log_finalize(self.backend.as_ref(), &self.opts, t0);
        Ok(())
    }

    fn finalize_backend(&mut self, stream: StreamHandle) -> Result<()> {
        self.backend.finalize(stream)?;
        self.backend.end_writes();
        Ok(())
    }

    /// Runs one batch from host memory on the CPU backend; see DESIGN.md §3.
    pub fn forward(&mut self, batch: &mut Batch) -> Result<()> {
        self.expect_phase("dsv4_forward", &[Phase::Ready])?;
        self.backend.forward_host(batch)
    }

    /// Runs one batch from device memory on the CUDA backend, on `stream`: no host sync, no
    /// allocation (capturable).
    pub fn forward_device(&mut self, batch: &DeviceBatch, stream: StreamHandle) -> Result<()> {
        self.expect_phase("dsv4_forward", &[Phase::Ready])?;
        self.backend.forward_device(batch, stream)
    }

    /// Replaces named weights in place. All entries are validated before any is written.
    /// Inside a chunked refit a stored-format weight and its scale may come in different
    /// calls: the first is validated alone and held until the other arrives.
    pub fn refit(&mut self, updates: &[TensorUpdate]) -> Result<()> {
        self.refit_on(updates, std::ptr::null_mut())
    }

    /// [`Engine::refit`] copying on the host's CUDA stream (ignored by the CPU backend).
    pub fn refit_on(&mut self, updates: &[TensorUpdate], stream: StreamHandle) -> Result<()> {
        self.expect_phase("dsv4_refit", &[Phase::Ready, Phase::Refitting])?;
        let block = self.quant_block();
        // Pairs stored-format weights with their scales and validates every entry before
        // anything is written. Inside a chunked refit a half whose partner has not come yet
        // is held (a plain refit must be complete).
        let chunked = self.phase == Phase::Refitting;
        let backend = self.backend.as_ref();
        let stage = |u: &UpdateTensor| stage_entry(backend, u, stream);
        let (writes, held_change) =
            self.pending
                .plan(&self.weights, updates, block, chunked, &stage, "refit")?;
        // Every entry is valid (device values are checked on the device before anything is
        // written): write them into the backend's copies, then rebuild every derived buffer.
        let staged = stage_mixed_halves(backend, &writes, stream)?;
        let pairs = pairs_of(&writes, &staged);
        let values = weights::load::plan_updates(&self.weights, &pairs, block)?;
        let written = write_checked(
            self.backend.as_mut(),
            &self.weights,
            "dsv4_refit",
            &values,
            stream,
        );
        if written.is_err() && self.phase == Phase::Ready {
            self.backend.end_writes();
        }
        written?;
        drop(values);
        drop(pairs);
        drop(staged);
        drop(writes);
        self.pending.commit(held_change);
        // Inside a chunked refit derived buffers are rebuilt once, at dsv4_refit_end.
        if self.phase == Phase::Ready {
            self.backend.rebuild_derived(stream)?;
            self.backend.end_writes();
        }
        Ok(())
    }

    /// Opens a chunked refit: any number of [`Engine::refit`] calls follow (each validated
    /// all-or-nothing), forward is a STATE error until [`Engine::refit_end`].
    pub fn refit_begin(&mut self) -> Result<()> {
        self.expect_phase("dsv4_refit_begin", &[Phase::Ready])?;
        debug_assert!(
            self.pending.is_empty(),
            "held refit entries outside a refit"
        );
        self.phase = Phase::Refitting;
        Ok(())
    }

    /// Closes a chunked refit: rebuilds every derived buffer once and makes the engine ready.
    /// While a held stored-format weight or scale still lacks its partner it is a TENSOR
    /// error naming each of them, and the refit stays open.
    pub fn refit_end(&mut self, stream: StreamHandle) -> Result<()> {
        if self.phase != Phase::Refitting {
            return Err(Error::new(
                Status::State,
                format!(
                    "dsv4_refit_end without dsv4_refit_begin: engine is {}",
                    self.phase.name()
                ),
            ));
        }
        // A held weight without its scale (or a scale without its weight) has not been
        // written: closing now would run a half-refit model. The refit stays open so that
        // the host can send the missing entries and close again.
        if let Some(e) = self.pending.unpaired_error() {
            return Err(e);
        }
        self.backend.rebuild_derived(stream)?;
        self.backend.end_writes();
        self.phase = Phase::Ready;
        Ok(())
    }

    /// Ends an open chunked refit without completing it: the chunks already written stay
    /// written, held halves still waiting for their partner are dropped (never written), every
    /// derived buffer is rebuilt from the current weights (on `stream`), and the engine is
    /// ready. So a host that fails midway can always return to a runnable engine, with a
    /// mix of old and new weights it knows from the chunks it sent.
    pub fn refit_abort(&mut self, stream: StreamHandle) -> Result<()> {
        if self.phase != Phase::Refitting {
            return Err(Error::new(
                Status::State,
                format!(
                    "dsv4_refit_abort without dsv4_refit_begin: engine is {}",
                    self.phase.name()
                ),
            ));
        }
        self.backend.rebuild_derived(stream)?;
        self.backend.end_writes();
        self.pending.clear();
        self.phase = Phase::Ready;
        Ok(())
    }

    /// Tensors derived from the weights (rebuilt by finalize and refit), fixed addresses.
    pub fn derived_tensors(&self) -> Vec<DerivedTensor> {
        self.backend.derived()
    }

    /// Spans of the weight, derived, state and workspace buffers (CUDA: device addresses
    /// inside the create-time arena; CPU: none, its buffers are separate heap blocks).
    pub fn buffer_spans(&self) -> BufferSpans {
        self.backend.spans()
    }

    /// Returns and clears the first fault of a bad device batch since the last call
    /// (DESIGN.md §3), after the work enqueued on `stream` has run. None when no batch was
    /// bad; always None on the CPU backend, which reports a bad batch from dsv4_forward.
    pub fn take_device_error(
        &mut self,
        stream: StreamHandle,
    ) -> Result<Option<crate::model::batch::BatchFault>> {
        self.backend.take_device_error(stream)
    }

    /// Copies `nbytes` of device memory at `addr` (a DSV4_MEMORY_DEVICE update) to the host,
    /// on `stream` so that it is ordered after the host's writes there, and waits for it.
    /// UNSUPPORTED on the CPU backend. A bad address is a CUDA error; nothing changes.
    pub fn stage_device_bytes(
        &self,
        addr: u64,
        nbytes: usize,
        stream: StreamHandle,
        what: &str,
    ) -> Result<Vec<u8>> {
        self.backend.stage_device_bytes(addr, nbytes, stream, what)
    }

    /// What an accepted tensor name (any of the three naming schemes, a block-scale companion,
    /// transformers' fused experts, or an MTP tensor) stands for in this model, with its
    /// canonical name. TENSOR naming `name` when no scheme knows it or this model has no such
    /// weight.
    pub fn canonical_name(&self, name: &str) -> Result<(NameKind, String)> {
        use crate::weights::names::{Role, Target, classify};
        let unknown = |why: &str| Error::new(Status::Tensor, format!("tensor `{name}`: {why}"));
        let role = classify(name).ok_or_else(|| unknown("no naming scheme knows this name"))?;
        let weight = |n: String| {
            if self.weights.index_of(&n).is_some() {
                Ok(n)
            } else {
                Err(unknown(&format!("this model has no weight `{n}`")))
            }
        };
        let fused = |l: usize| {
            let n = format!("layers.{l}.ffn.experts.0.w1.weight");
            if self.weights.index_of(&n).is_some() {
                Ok(format!("layers.{l}.ffn.experts"))
            } else {
                Err(unknown(&format!(
                    "this model has no routed experts in layer {l}"
                )))
            }
        };
        Ok(match role {
            Role::Mtp => (NameKind::Skipped, name.to_owned()),
            Role::Weight(Target::Tensor(n)) => (NameKind::Weight, weight(n)?),
            Role::Scale(Target::Tensor(n)) => (NameKind::Scale, weight(n)?),
            Role::Weight(Target::ExpertsGateUp(l)) | Role::Scale(Target::ExpertsGateUp(l)) => {
                (NameKind::FusedGateUp, fused(l)?)
            }
            Role::Weight(Target::ExpertsDown(l)) | Role::Scale(Target::ExpertsDown(l)) => {
                (NameKind::FusedDown, fused(l)?)
            }
        })
    }

    /// Positions `slot` holds now (0 for a released or unused slot), after the work enqueued
    /// on `stream` has run.
    pub fn slot_length(&self, slot: i64, stream: StreamHandle) -> Result<usize> {
        let slot = self.slot_index(slot)?;
        self.backend.slot_length(slot, stream)
    }

    /// `slot` as an index of the engine's slots, or INVALID_ARGUMENT naming it.
    fn slot_index(&self, slot: i64) -> Result<usize> {
        if slot < 0 || slot as usize >= self.opts.max_num_seqs {
            return Err(Error::new(
                Status::InvalidArgument,
                format!(
                    "slot {slot} is out of range [0, max_num_seqs = {})",
                    self.opts.max_num_seqs
                ),
            ));
        }
        Ok(slot as usize)
    }

    /// Forgets the state of `slot`; its next sequence must start at position 0.
    pub fn release_slot(&mut self, slot: i64) -> Result<()> {
        let slot = self.slot_index(slot)?;
        self.backend.release_slot(slot)
    }
}

/// Seed of `dsv4_load` with format DUMMY.
const DUMMY_SEED: u64 = 0x5EED_D5F4;

/// A host copy of an entry (device memory staged through the backend).
fn stage_entry(backend: &dyn Backend, u: &UpdateTensor, stream: StreamHandle) -> Result<Vec<u8>> {
    match u.data {
        Bytes::Host(b) => Ok(b.to_vec()),
        Bytes::Device { addr, len } => {
            backend.stage_device_bytes(addr, len, stream, &format!("device data of `{}`", u.name))
        }
    }
}

/// Host copies of the device half of every pair whose weight and scale live in different
/// memories (None where nothing is copied): such a pair is written on the host. A scale is
/// small; a device weight with a host scale is the one case that takes device values through
/// the host.
fn stage_mixed_halves(
    backend: &dyn Backend,
    writes: &[Write],
    stream: StreamHandle,
) -> Result<Vec<Option<Vec<u8>>>> {
    writes
        .iter()
        .map(|w| {
            let Some(s) = &w.scale else {
                return Ok(None);
            };
            match (w.weight.data, s.data) {
                (Bytes::Host(_), Bytes::Device { .. }) => stage_entry(backend, s, stream).map(Some),
                (Bytes::Device { .. }, Bytes::Host(_)) => {
                    stage_entry(backend, &w.weight, stream).map(Some)
                }
                _ => Ok(None),
            }
        })
        .collect()
}

/// The (weight, scale) pairs to plan, with the copies of [`stage_mixed_halves`] in place of
/// the device halves they replace.
fn pairs_of<'a>(
    writes: &[Write<'a>],
    staged: &'a [Option<Vec<u8>>],
) -> Vec<(UpdateTensor<'a>, Option<UpdateTensor<'a>>)> {
    writes
        .iter()
        .zip(staged)
        .map(|(w, copy)| {
            let (mut weight, mut scale) = (w.weight, w.scale);
            if let (Some(c), Some(s)) = (copy, scale.as_mut()) {
                if matches!(s.data, Bytes::Device { .. }) {
                    s.data = Bytes::Host(c);
                } else {
                    weight.data = Bytes::Host(c);
                }
            }
            (weight, scale)
        })
        .collect()
}

/// Writes checked values into `backend`: device values are checked on the device first (a
/// failure writes nothing), then host values are written, then device values. Returns every
/// weight written.
fn write_checked(
    backend: &mut dyn Backend,
    table: &WeightTable,
    call: &'static str,
    values: &CheckedValues,
    stream: StreamHandle,
) -> Result<Vec<usize>> {
    let checks = values.device_checks(table);
    let writes = values.device_writes(table);
    if !checks.is_empty() || !writes.is_empty() {
        backend.check_device(&checks, &writes, stream)?;
    }
    // (Only host values need the staging buffers.)
    if !values.targets().is_empty() {
        write_values(backend, table, call, values, stream)?;
    }
    if !writes.is_empty() {
        backend.write_device(table, &writes, stream)?;
    }
    Ok(values.all_targets())
}

/// Writes validated `values` into `backend`'s copies, reporting progress as `call`.
fn write_values(
    backend: &mut dyn Backend,
    table: &WeightTable,
    call: &'static str,
    values: &dyn WeightValues,
    stream: StreamHandle,
) -> Result<()> {
    let progress = Progress::new(call, table, &values.targets());
    backend.write_weights(table, values, &progress, stream)
}

fn validate_options(cfg: &ModelConfig, o: &EngineOptions) -> Result<()> {
    let bad = |what: &str| Err(Error::new(Status::InvalidArgument, what.to_string()));
    if o.max_num_seqs == 0 || o.max_num_seqs > 1 << 16 {
        return bad(&format!(
            "max_num_seqs = {} must be in [1, 65536]",
            o.max_num_seqs
        ));
    }
    if o.max_num_tokens == 0 || o.max_num_tokens > 1 << 24 {
        return bad(&format!(
            "max_num_tokens = {} must be in [1, 2^24]",
            o.max_num_tokens
        ));
    }
    if o.max_seq_len == 0 || o.max_seq_len > cfg.max_position_embeddings {
        return bad(&format!(
            "max_seq_len = {} must be in [1, max_position_embeddings = {}]",
            o.max_seq_len, cfg.max_position_embeddings
        ));
    }
    if o.max_seq_len > i32::MAX as usize {
        return bad("max_seq_len must fit in int32");
    }
    if o.device < -1 {
        return bad(&format!(
            "device = {} must be -1 (CPU) or a CUDA ordinal >= 0",
            o.device
        ));
    }
    Ok(())
}
