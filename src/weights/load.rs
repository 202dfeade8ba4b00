//! Loading weights into the [`WeightStore`]: whole checkpoints (`dsv4_load`) and single named
//! host updates (`dsv4_load_tensor`, `dsv4_refit`).
//!
//! Both go through the same two steps. *Plan*: map each source tensor's name to canonical
//! weights (`names.rs`), check its dtype class and shape against the weight table
//! (`table.rs`), pair quantised weights with their block scales, check values that must be
//! finite or in range, and turn it into a `Job` (validated source + the canonical tensors it
//! writes). The jobs together are a [`CheckedValues`]. *Write*: a backend asks it for each
//! weight's bytes in its storage layout, row chunk by row chunk (values.rs), and puts them in
//! its copy: the CPU store in place, the CUDA arena through pinned staging. Every check
//! happens in the plan, so a load that fails writes nothing, and the write step cannot fail
//! or panic on file contents.
//!
//! Accepted encodings of a float weight: F32/BF16/F16; FP8 e4m3 with a block scale
//! (F8_E8M0 or F32, blocks of `quantization_config.weight_block_size`, default 128x128,
//! ragged edges allowed); packed FP4 e2m1 (I8/U8, two per byte) with a 1x32 scale. Index
//! tables (`tid2eid`) accept I8/U8/I16/I32/I64 with values in [0, n_routed_experts).
//! HF-native fused experts (`mlp.experts.gate_up_proj`, `down_proj`) are split into the
//! per-expert canonical tensors, in checkpoints and in host updates alike.

use std::collections::BTreeMap;
use std::path::Path;

use safetensors::Dtype;

use crate::config::ModelConfig;
use crate::error::{Error, Result, Status};
use crate::weights::dtype::{self, FloatDtype, IntDtype, ScaleDtype};
use crate::weights::names::{Role, Target, classify};
use crate::weights::qmatrix::QFormat;
use crate::weights::rows::{Geometry, encode_rows};
use crate::weights::safetensors_io::{Checkpoint, TensorEntry};
use crate::weights::spec::ElemKind;
use crate::weights::store::WeightStore;
use crate::weights::table::{StorageKind, WeightTable};
use crate::weights::values::{Progress, WeightValues, write_to_store};
use crate::weights::{Bytes, HostDtype, UpdateTensor};

/// Block of the FP4 expert scales: one scale per 32 consecutive inputs of a row.
const FP4_BLOCK: usize = 32;

/// Loads every weight of `cfg` from a checkpoint directory, index file or safetensors file.
///
/// Every tensor must map to a weight of the model (`mtp.*` is skipped), have an accepted
/// dtype and the exact shape, and every weight must be provided exactly once. All of it is
/// checked before the first write.
pub fn load_checkpoint(store: &mut WeightStore, cfg: &ModelConfig, path: &Path) -> Result<()> {
    load_opened(store, cfg, &Checkpoint::open(path)?)
}

/// [`load_checkpoint`] of a checkpoint already opened (the caller reports on its tensors).
pub fn load_opened(store: &mut WeightStore, cfg: &ModelConfig, ck: &Checkpoint) -> Result<()> {
    let block = cfg.quant.as_ref().map_or([128, 128], |q| q.weight_block);
    let values = plan_checkpoint(store.table(), ck, block)?;
    let progress = Progress::new("dsv4_load", store.table(), &values.targets());
    write_to_store(store, &values, &progress);
    Ok(())
}

/// Validates one update against the weight table without writing anything: name, dtype,
/// shape, scale grid and (host) index ranges; returns the canonical weights it would write
/// (several for a fused expert tensor, none for an ignored `mtp.*` name). `scale`: the block
/// scales (E8M0 or F32; FP8 blocks are `block`) of a weight given in its stored format
/// (F8_E4M3 or packed FP4 codes); None for float / index values. Whether float values headed
/// for FP8/FP4 storage are finite is [`plan_updates`]' check, which every write runs before
/// writing anything (a full decode: it is done once).
pub fn check_update(
    table: &WeightTable,
    u: &UpdateTensor,
    scale: Option<&UpdateTensor>,
    block: [usize; 2],
) -> Result<Vec<usize>> {
    // No job for an ignored name: nothing to check.
    let job = plan_host_update(table, u, scale, block)?;
    Ok(job.map_or_else(Vec::new, |j| j.dsts()))
}

/// Validates a stored-format weight (F8_E4M3 / FP4_E2M1 codes) whose block scale will come
/// later (a chunked refit holds it meanwhile) as far as it can be checked alone: name, dtype,
/// byte count and stored shape. Returns the canonical weights it will write; [`check_update`]
/// with the scale does the rest when the scale arrives.
pub fn check_weight_awaiting_scale(
    table: &WeightTable,
    u: &UpdateTensor,
    block: [usize; 2],
) -> Result<Vec<usize>> {
    if !matches!(u.dtype, HostDtype::F8E4M3 | HostDtype::Fp4E2M1) {
        crate::bail!(
            Internal,
            "update `{}` ({}) is not in a stored format that waits for a scale",
            u.name,
            u.dtype.name()
        );
    }
    let packed = packed_shape(u);
    Ok(plan_update(table, u, &packed, HostScale::Later, block)?
        .map(|job| job.dsts())
        .unwrap_or_default())
}

/// Validates a block-scale entry whose weight will come later (a chunked refit holds it
/// meanwhile) as far as it can be checked alone: it names the scale of a float matrix of this
/// model, has a scale dtype (E8M0 / F32) and the bytes of its shape, and its shape is the scale
/// grid of that weight for FP8 codes (`block` blocks) or for FP4 codes (1x32 blocks); which one
/// is checked when the weight arrives.
pub fn check_scale_awaiting_weight(
    table: &WeightTable,
    s: &UpdateTensor,
    block: [usize; 2],
) -> Result<()> {
    let who = format!("update `{}`", s.name);
    let Some(Role::Scale(target)) = classify(s.name) else {
        crate::bail!(Internal, "{who} is not a block-scale name");
    };
    let canon = target.describe();
    let r = resolve_or(table, &target, || {
        format!("{who} is the scale of `{canon}`, which this model does not have")
    })?;
    host_scale(s, &canon)?;
    if r.kind != ElemKind::Float || r.shape.len() < 2 {
        crate::bail!(
            Tensor,
            "{who} is a block scale, but `{canon}` (shape {:?}) is not a matrix that can be stored quantised",
            r.shape
        );
    }
    let fp8 = scale_grid(Encoding::Fp8(block), &r.shape);
    let fp4 = scale_grid(Encoding::Fp4, &r.shape);
    // Packed FP4 needs an even column count: no FP4 grid otherwise.
    let fp4_ok = cols_of(&r.shape).is_multiple_of(2);
    if s.shape != fp8.as_slice() && !(fp4_ok && s.shape == fp4.as_slice()) {
        let [bo, bi] = block;
        crate::bail!(
            Tensor,
            "{who}: shape {:?} is not a scale grid of `{canon}` {:?}: expected {fp8:?} for F8_E4M3 codes ({bo}x{bi} blocks){}",
            s.shape,
            r.shape,
            if fp4_ok {
                format!(" or {fp4:?} for FP4_E2M1 codes (1x{FP4_BLOCK} blocks)")
            } else {
                String::new()
            }
        );
    }
    Ok(())
}

/// Validates and writes one host update in place (as [`check_update`]); returns the
/// canonical weights written.
pub fn write_update(
    store: &mut WeightStore,
    u: &UpdateTensor,
    scale: Option<&UpdateTensor>,
    block: [usize; 2],
) -> Result<Vec<usize>> {
    let values = plan_updates(store.table(), &[(*u, scale.copied())], block)?;
    let dsts = values.targets();
    let progress = Progress::new("dsv4_refit", store.table(), &dsts);
    write_to_store(store, &values, &progress);
    Ok(dsts)
}

/// The job of one host update with its scale given or missing (packed FP4 codes given with
/// their logical shape); None for an ignored `mtp.*` name.
fn plan_host_update<'a>(
    table: &WeightTable,
    u: &UpdateTensor<'a>,
    scale: Option<&UpdateTensor<'a>>,
    block: [usize; 2],
) -> Result<Option<Job<'a>>> {
    plan_update(table, u, &packed_shape(u), HostScale::of(scale), block)
}

/// The byte shape of packed FP4 (last dimension halved, as checkpoints store it); the
/// logical shape for every other dtype.
fn packed_shape(u: &UpdateTensor) -> Vec<usize> {
    let mut s = u.shape.to_vec();
    if u.dtype == HostDtype::Fp4E2M1
        && let Some(c) = s.last_mut()
    {
        *c /= 2;
    }
    s
}

// ---------------------------------------------------------------------------------------
// Plan
// ---------------------------------------------------------------------------------------

/// How a validated source is encoded.
#[derive(Clone, Copy, Debug)]
enum Encoding {
    Float(FloatDtype),
    Int(IntDtype),
    /// FP8 e4m3 codes with `[rows, cols]` blocks of scales.
    Fp8([usize; 2]),
    /// Packed FP4 e2m1, two codes per byte, 1x32 scales.
    Fp4,
}

/// A validated source tensor: its bytes match its logical shape and encoding exactly.
///
/// The logical shape is seen as a stack of matrices `[.., mat_rows, cols]` (a 1-D tensor is
/// one row); "global row" g is row `g % mat_rows` of matrix `g / mat_rows`.
struct Source<'a> {
    enc: Encoding,
    data: Bytes<'a>,
    scale: Option<(Bytes<'a>, ScaleDtype)>,
    mat_rows: usize,
    cols: usize,
}

impl<'a> Source<'a> {
    /// Bytes of one global row.
    fn row_bytes(&self) -> usize {
        match self.enc {
            Encoding::Fp4 => self.cols / 2,
            Encoding::Fp8(_) => self.cols,
            Encoding::Float(ft) => self.cols * ft.size(),
            Encoding::Int(it) => self.cols * it.size(),
        }
    }

    /// A source without a block scale: plain values, or codes whose scale comes later.
    fn unscaled(enc: Encoding, data: Bytes<'a>, mat_rows: usize, cols: usize) -> Source<'a> {
        Source {
            enc,
            data,
            scale: None,
            mat_rows,
            cols,
        }
    }
}

/// `rows` global rows of a source starting at `row0` fill canonical weight `dst` entirely.
#[derive(Clone, Copy, Debug)]
struct Piece {
    dst: usize,
    row0: usize,
    rows: usize,
}

struct Job<'a> {
    src: Source<'a>,
    pieces: Vec<Piece>,
    /// How messages name the source (`update `x``, `tensor `x` in file `f``).
    who: String,
    /// Exclusive bound of an index table's values (checked on the device for device values).
    bound: Option<usize>,
}

impl Job<'_> {
    fn dsts(&self) -> Vec<usize> {
        self.pieces.iter().map(|p| p.dst).collect()
    }
}

/// What a [`Target`] means in this model's weight table.
struct Resolved {
    /// Logical (dequantised) shape the source must have.
    shape: Vec<usize>,
    kind: ElemKind,
    pieces: Vec<Piece>,
    /// Exclusive upper bound of index-table values (number of routed experts).
    index_bound: Option<usize>,
}

/// Canonical weight indices `[w1, w2, w3]` of every routed expert of layer `l`, in order.
fn experts_of(table: &WeightTable, l: usize) -> Vec<[usize; 3]> {
    let mut out = Vec::new();
    loop {
        let e = out.len();
        let idx = |w: &str| table.index_of(&format!("layers.{l}.ffn.experts.{e}.{w}.weight"));
        match (idx("w1"), idx("w2"), idx("w3")) {
            (Some(a), Some(b), Some(c)) => out.push([a, b, c]),
            _ => return out,
        }
    }
}

/// [`resolve`], or `Status::Tensor` with the message `missing` makes when this model has no
/// such weight.
fn resolve_or(
    table: &WeightTable,
    target: &Target,
    missing: impl FnOnce() -> String,
) -> Result<Resolved> {
    resolve(table, target).ok_or_else(|| Error::new(Status::Tensor, missing()))
}

fn resolve(table: &WeightTable, target: &Target) -> Option<Resolved> {
    match target {
        Target::Tensor(name) => {
            let i = table.index_of(name)?;
            let spec = &table.entry(i).spec;
            let shape = spec.shape.clone();
            let rows = rows_of(&shape);
            let index_bound = (spec.kind == ElemKind::Index).then(|| {
                // `layers.L.ffn.gate.tid2eid` holds expert ids of layer L.
                let l = name
                    .split('.')
                    .nth(1)
                    .and_then(|s| s.parse().ok())
                    .unwrap_or(usize::MAX);
                experts_of(table, l).len()
            });
            Some(Resolved {
                shape,
                kind: spec.kind,
                pieces: vec![Piece {
                    dst: i,
                    row0: 0,
                    rows,
                }],
                index_bound,
            })
        }
        Target::ExpertsGateUp(l) | Target::ExpertsDown(l) => {
            let experts = experts_of(table, *l);
            let first = experts.first()?;
            let gate_up = matches!(target, Target::ExpertsGateUp(_));
            let mut pieces = Vec::with_capacity(2 * experts.len());
            let shape = if gate_up {
                // [E, 2I, D]: expert e's rows are w1 (I rows) then w3 (I rows).
                let [i, d] = dims2(&table.entry(first[0]).spec.shape)?;
                for (e, w) in experts.iter().enumerate() {
                    pieces.push(Piece {
                        dst: w[0],
                        row0: e * 2 * i,
                        rows: i,
                    });
                    pieces.push(Piece {
                        dst: w[2],
                        row0: e * 2 * i + i,
                        rows: i,
                    });
                }
                vec![experts.len(), 2 * i, d]
            } else {
                // [E, D, I]: expert e is w2.
                let [d, i] = dims2(&table.entry(first[1]).spec.shape)?;
                for (e, w) in experts.iter().enumerate() {
                    pieces.push(Piece {
                        dst: w[1],
                        row0: e * d,
                        rows: d,
                    });
                }
                vec![experts.len(), d, i]
            };
            Some(Resolved {
                shape,
                kind: ElemKind::Float,
                pieces,
                index_bound: None,
            })
        }
    }
}

fn dims2(s: &[usize]) -> Option<[usize; 2]> {
    match *s {
        [a, b] => Some([a, b]),
        _ => None,
    }
}

/// Columns of the matrix view of a logical shape (last dim; 1 for a scalar).
fn cols_of(shape: &[usize]) -> usize {
    shape.last().copied().unwrap_or(1)
}

/// Global rows of the matrix view of a logical shape.
fn rows_of(shape: &[usize]) -> usize {
    let numel: usize = shape.iter().product();
    numel.checked_div(cols_of(shape)).unwrap_or(0)
}

/// A tensor's stored description, from a checkpoint file or a host update.
struct Stored<'a, 's> {
    dtype: Dtype,
    shape: &'s [usize],
    data: Bytes<'a>,
}

/// The block scale offered with a weight to [`validate_source`].
enum ScaleSrc<'a, 's> {
    /// No scale: a stored-format weight is an error.
    Missing,
    /// The scale tensor, with its description for messages.
    Given(Stored<'a, 's>, String),
    /// Not given yet: a chunked refit holds the weight until its scale arrives. The weight is
    /// validated alone; the [`Source`] built has no scale and must never be executed.
    Later,
}

/// Shape of the block-scale grid of a quantised source with logical shape `logical`: FP8
/// `[.., ceil(rows / bo), ceil(cols / bi)]`, FP4 `[.., rows, ceil(cols / 32)]`.
fn scale_grid(enc: Encoding, logical: &[usize]) -> Vec<usize> {
    let cols = cols_of(logical);
    match enc {
        Encoding::Fp8([bo, bi]) => {
            let k = logical.len().saturating_sub(2);
            let mat_rows = logical.get(k).copied().unwrap_or(1);
            let mut s = logical[..k].to_vec();
            s.extend([mat_rows.div_ceil(bo), cols.div_ceil(bi)]);
            s
        }
        _ => {
            let mut s = logical[..logical.len().saturating_sub(1)].to_vec();
            s.push(cols.div_ceil(FP4_BLOCK));
            s
        }
    }
}

/// Builds a validated [`Source`] for a weight whose logical shape is `logical`.
/// `who` describes the tensor for messages ("tensor `X` in file `F`"), the scale comes with
/// its own description.
fn validate_source<'a>(
    who: &str,
    canon: &str,
    kind: ElemKind,
    logical: &[usize],
    w: Stored<'a, '_>,
    scale: ScaleSrc<'a, '_>,
    block: [usize; 2],
) -> Result<Source<'a>> {
    let tensor_err = |msg: String| Error::new(Status::Tensor, format!("{who}: {msg}"));
    let shape_err = |got: &[usize], want: &[usize], what: &str| {
        tensor_err(format!(
            "{what}shape {got:?} does not match {want:?} expected for `{canon}`"
        ))
    };
    let no_scale = |scale: &ScaleSrc| match scale {
        ScaleSrc::Given(_, sname) => Err(tensor_err(format!(
            "scale tensor {sname} accompanies it, but it is not stored quantised (dtype {}); only F8_E4M3 and packed FP4 (I8/U8) weights take a scale",
            w.dtype
        ))),
        ScaleSrc::Missing | ScaleSrc::Later => Ok(()),
    };
    let (mat_rows, cols) = (
        logical.len().checked_sub(2).map_or(1, |k| logical[k]),
        cols_of(logical),
    );

    // Index tables (integer dtypes only) and float values: no scale, the logical shape.
    let unscaled = if kind == ElemKind::Index {
        let Some(it) = IntDtype::from_dtype(w.dtype) else {
            return Err(tensor_err(format!(
                "dtype {} is not accepted for index table `{canon}` (expected I64 or I32)",
                w.dtype
            )));
        };
        Some(Encoding::Int(it))
    } else {
        FloatDtype::from_dtype(w.dtype).map(Encoding::Float)
    };
    if let Some(enc) = unscaled {
        no_scale(&scale)?;
        if w.shape != logical {
            return Err(shape_err(w.shape, logical, ""));
        }
        return Ok(Source::unscaled(enc, w.data, mat_rows, cols));
    }

    let (enc, stored_shape) = match w.dtype {
        Dtype::F8_E4M3 | Dtype::I8 | Dtype::U8 if logical.len() < 2 => {
            return Err(tensor_err(format!(
                "dtype {} (quantised) is only accepted for matrices, but `{canon}` has shape {logical:?}",
                w.dtype
            )));
        }
        Dtype::F8_E4M3 => (Encoding::Fp8(block), logical.to_vec()),
        Dtype::I8 | Dtype::U8 => {
            if cols % 2 != 0 {
                return Err(tensor_err(format!(
                    "packed FP4 needs an even column count, but `{canon}` has {cols} columns (shape {logical:?})"
                )));
            }
            let mut packed = logical[..logical.len() - 1].to_vec();
            packed.push(cols / 2);
            (Encoding::Fp4, packed)
        }
        other => {
            return Err(tensor_err(format!(
                "dtype {other} is not accepted for float weight `{canon}` (expected F32, BF16, F16, F8_E4M3 + scale, or packed FP4 I8/U8 + scale)"
            )));
        }
    };
    if w.shape != stored_shape.as_slice() {
        let what = if matches!(enc, Encoding::Fp4) {
            "packed FP4 "
        } else {
            ""
        };
        return Err(shape_err(w.shape, &stored_shape, what));
    }
    let (s, sname) = match scale {
        ScaleSrc::Given(s, sname) => (s, sname),
        ScaleSrc::Missing => {
            return Err(tensor_err(format!(
                "stored quantised ({}) but no scale tensor accompanies it (expected `<name>.scale` or `<name>.weight_scale_inv`)",
                w.dtype
            )));
        }
        ScaleSrc::Later => {
            return Ok(Source::unscaled(enc, w.data, mat_rows, cols));
        }
    };
    let scale_shape = scale_grid(enc, logical);
    let sdt = ScaleDtype::from_dtype(s.dtype).ok_or_else(|| {
        tensor_err(format!(
            "its scale {sname} has dtype {}; expected F8_E8M0 or F32",
            s.dtype
        ))
    })?;
    if s.shape != scale_shape.as_slice() {
        let blk = match enc {
            Encoding::Fp8([bo, bi]) => format!("{bo}x{bi} blocks"),
            _ => format!("1x{FP4_BLOCK} blocks"),
        };
        return Err(tensor_err(format!(
            "its scale {sname} has shape {:?}, expected {scale_shape:?} ({blk} of logical shape {logical:?})",
            s.shape
        )));
    }
    Ok(Source {
        enc,
        data: w.data,
        scale: Some((s.data, sdt)),
        mat_rows,
        cols,
    })
}

/// Checks every index value of `src` lies in [0, bound).
fn check_index_range(who: &str, canon: &str, src: &Source, bound: usize) -> Result<()> {
    let Encoding::Int(it) = src.enc else {
        return Ok(());
    };
    // Device values are checked on the device (CUDA backend, before anything is written).
    let Some(data) = src.data.host() else {
        return Ok(());
    };
    if let Some((i, v)) = dtype::find_out_of_range(it, data, 0, bound as i64) {
        let (r, c) = (i / src.cols.max(1), i % src.cols.max(1));
        crate::bail!(
            Tensor,
            "{who}: value {v} at [{r}, {c}] of `{canon}` is not an expert id in [0, {bound})"
        );
    }
    Ok(())
}

/// Validates every tensor of `ck` against `table` (see [`load_checkpoint`]); the values to
/// write, in file order.
pub fn plan_checkpoint<'a>(
    table: &WeightTable,
    ck: &'a Checkpoint,
    block: [usize; 2],
) -> Result<CheckedValues<'a>> {
    let file = |t: &TensorEntry| ck.path_of(t).display().to_string();
    let duplicate = |prev: &TensorEntry, t: &TensorEntry, weight: &str| {
        crate::err!(
            Tensor,
            "duplicate tensor: `{}` in file `{}` and `{}` in file `{}` both provide `{weight}`",
            prev.name,
            file(prev),
            t.name,
            file(t)
        )
    };
    let who = |t: &TensorEntry| format!("tensor `{}` in file `{}`", t.name, file(t));

    // 1. Names: sort every tensor into weights and scales by the canonical target.
    let mut weights: BTreeMap<Target, &TensorEntry> = BTreeMap::new();
    let mut scales: BTreeMap<Target, &TensorEntry> = BTreeMap::new();
    let mut mtp = 0usize;
    for t in ck.tensors() {
        let (target, map) = match classify(&t.name) {
            None => crate::bail!(Tensor, "unknown tensor `{}` in file `{}`", t.name, file(t)),
            Some(Role::Mtp) => {
                mtp += 1;
                continue;
            }
            Some(Role::Weight(tg)) => (tg, &mut weights),
            Some(Role::Scale(tg)) => (tg, &mut scales),
        };
        if let Some(prev) = map.get(&target) {
            return Err(duplicate(prev, t, &target.describe()));
        }
        map.insert(target, t);
    }
    for (target, s) in &scales {
        if !weights.contains_key(target) {
            crate::bail!(
                Tensor,
                "{} is a scale of `{}`, which the checkpoint does not contain",
                who(s),
                target.describe()
            );
        }
    }

    // 2. Each weight: target in this model, dtype/shape/scale, index values.
    let mut writer: Vec<Option<&TensorEntry>> = vec![None; table.len()];
    let mut jobs = Vec::with_capacity(weights.len());
    // Keep file order (weights is keyed by name) so execution reads each file sequentially.
    let mut ordered: Vec<(&Target, &&TensorEntry)> = weights.iter().collect();
    ordered.sort_by_key(|(_, t)| (t.file, ck.data(t).as_ptr() as usize));
    for (target, &t) in ordered {
        let canon = target.describe();
        let r = resolve_or(table, target, || {
            format!(
                "unknown tensor `{}` in file `{}`: this model has no weight `{canon}` (check config.json)",
                t.name,
                file(t)
            )
        })?;
        let scale = match scales.get(target) {
            Some(s) => ScaleSrc::Given(
                Stored {
                    dtype: s.dtype,
                    shape: &s.shape,
                    data: Bytes::Host(ck.data(s)),
                },
                format!("`{}` in file `{}`", s.name, file(s)),
            ),
            None => ScaleSrc::Missing,
        };
        let stored = Stored {
            dtype: t.dtype,
            shape: &t.shape,
            data: Bytes::Host(ck.data(t)),
        };
        let src = validate_source(&who(t), &canon, r.kind, &r.shape, stored, scale, block)?;
        if let Some(bound) = r.index_bound {
            check_index_range(&who(t), &canon, &src, bound)?;
        }
        for p in &r.pieces {
            if let Some(prev) = writer[p.dst].replace(t) {
                return Err(duplicate(prev, t, &table.entry(p.dst).spec.name));
            }
        }
        jobs.push(Job {
            src,
            pieces: r.pieces,
            who: who(t),
            bound: r.index_bound,
        });
    }

    // 3. Coverage: every weight of the model exactly once.
    let missing: Vec<&str> = (0..table.len())
        .filter(|&i| writer[i].is_none())
        .map(|i| table.entry(i).spec.name.as_str())
        .collect();
    if let Some(first) = missing.first() {
        let more = if missing.len() > 1 {
            format!(" (and {} more)", missing.len() - 1)
        } else {
            String::new()
        };
        crate::bail!(
            Tensor,
            "missing tensor `{first}`{more} in checkpoint `{}`",
            ck.source.display()
        );
    }
    if mtp > 0 {
        crate::log::info(&format!(
            "checkpoint `{}`: skipped {mtp} mtp.* tensors (MTP is not used)",
            ck.source.display()
        ));
    }
    check_quantizable(table, &jobs)?;
    let mut values = CheckedValues::new(jobs);
    values.mapped = true;
    Ok(values)
}

/// The block scale of a host update, as [`ScaleSrc`] for host tensors.
enum HostScale<'s, 'a> {
    Missing,
    Given(&'s UpdateTensor<'a>),
    Later,
}

impl<'s, 'a> HostScale<'s, 'a> {
    fn of(scale: Option<&'s UpdateTensor<'a>>) -> Self {
        scale.map_or(HostScale::Missing, HostScale::Given)
    }
}

/// A host scale entry's dtype and byte count, checked, as a [`Stored`] tensor.
fn host_scale<'a, 's>(s: &'s UpdateTensor<'a>, canon: &str) -> Result<Stored<'a, 's>> {
    let dtype = match s.dtype {
        HostDtype::E8M0 => Dtype::F8_E8M0,
        HostDtype::F32 => Dtype::F32,
        other => crate::bail!(
            Tensor,
            "update `{}` (scale of `{canon}`): dtype {} is not a block-scale dtype (use E8M0 or F32)",
            s.name,
            other.name()
        ),
    };
    if s.dtype.nbytes(s.shape) != Some(s.data.len()) {
        crate::bail!(
            InvalidArgument,
            "update `{}`: {} data bytes do not match shape {:?} of {}",
            s.name,
            s.data.len(),
            s.shape,
            s.dtype.name()
        );
    }
    Ok(Stored {
        dtype,
        shape: s.shape,
        data: s.data,
    })
}

fn plan_update<'a>(
    table: &WeightTable,
    u: &UpdateTensor<'a>,
    packed: &[usize],
    scale: HostScale<'_, 'a>,
    block: [usize; 2],
) -> Result<Option<Job<'a>>> {
    let (name, dtype, shape, data) = (u.name, u.dtype, u.shape, u.data);
    let who = format!("update `{name}`");
    let target = match classify(name) {
        None => crate::bail!(Tensor, "unknown weight `{name}`"),
        Some(Role::Mtp) => {
            crate::log::info(&format!("{who}: mtp.* weights are not used; ignored"));
            return Ok(None);
        }
        Some(Role::Scale(t)) => crate::bail!(
            Tensor,
            "{who} names a block-scale tensor (of `{}`) without its weight: send it in the same refit call as the weight's F8_E4M3 / FP4_E2M1 codes, or send the weight as F32/BF16/F16",
            t.describe()
        ),
        Some(Role::Weight(t)) => t,
    };
    let canon = target.describe();
    let r = resolve_or(table, &target, || {
        format!("unknown weight `{name}`: this model has no `{canon}`")
    })?;
    let st_dtype = match (r.kind, dtype) {
        (ElemKind::Float, HostDtype::F32) => Dtype::F32,
        (ElemKind::Float, HostDtype::Bf16) => Dtype::BF16,
        (ElemKind::Float, HostDtype::F16) => Dtype::F16,
        (ElemKind::Float, HostDtype::F8E4M3) => Dtype::F8_E4M3,
        (ElemKind::Float, HostDtype::Fp4E2M1) => Dtype::U8,
        (ElemKind::Index, HostDtype::I32) => Dtype::I32,
        (ElemKind::Index, HostDtype::I64) => Dtype::I64,
        (ElemKind::Float, _) => {
            crate::bail!(
                Tensor,
                "{who}: dtype {} is not accepted for float weight `{canon}` (use F32, BF16, F16, or F8_E4M3 / FP4_E2M1 with a scale entry)",
                dtype.name()
            )
        }
        (ElemKind::Index, _) => {
            crate::bail!(
                Tensor,
                "{who}: dtype {} is not accepted for index table `{canon}` (use I32 or I64)",
                dtype.name()
            )
        }
    };
    let want = dtype.nbytes(shape);
    if want != Some(data.len()) {
        crate::bail!(
            InvalidArgument,
            "{who}: {} data bytes, but shape {shape:?} of {} needs {}",
            data.len(),
            dtype.name(),
            want.map_or(
                "an even last dimension / fewer than usize::MAX bytes".to_string(),
                |w| w.to_string()
            )
        );
    }
    // Stored-format entries are validated like checkpoint tensors: logical shape for FP8,
    // the byte shape for packed FP4.
    let stored_shape: &[usize] = if dtype == HostDtype::Fp4E2M1 {
        packed
    } else {
        shape
    };
    if !matches!(dtype, HostDtype::F8E4M3 | HostDtype::Fp4E2M1) && shape != r.shape.as_slice() {
        crate::bail!(
            Tensor,
            "{who}: shape {shape:?} does not match {:?} expected for `{canon}`",
            r.shape
        );
    }
    let stored = Stored {
        dtype: st_dtype,
        shape: stored_shape,
        data,
    };
    let scale = match scale {
        HostScale::Missing => ScaleSrc::Missing,
        HostScale::Later => ScaleSrc::Later,
        HostScale::Given(s) => ScaleSrc::Given(host_scale(s, &canon)?, format!("`{}`", s.name)),
    };
    let src = validate_source(&who, &canon, r.kind, &r.shape, stored, scale, block)?;
    if let Some(bound) = r.index_bound {
        check_index_range(&who, &canon, &src, bound)?;
    }
    Ok(Some(Job {
        src,
        pieces: r.pieces,
        who,
        bound: r.index_bound,
    }))
}

/// Validates host updates, each a weight with its block scale (None for float / index values),
/// all before any is written; the values they write. An ignored `mtp.*` name writes nothing.
pub fn plan_updates<'a>(
    table: &WeightTable,
    updates: &[(UpdateTensor<'a>, Option<UpdateTensor<'a>>)],
    block: [usize; 2],
) -> Result<CheckedValues<'a>> {
    let mut jobs = Vec::with_capacity(updates.len());
    for (u, scale) in updates {
        // A job is written on the host or on the device as a whole (the engine copies the
        // device half of a mixed pair to the host first).
        if let Some(sc) = scale
            && matches!(u.data, Bytes::Host(_)) != matches!(sc.data, Bytes::Host(_))
        {
            crate::bail!(
                Internal,
                "update `{}` and its scale `{}` are in different memories",
                u.name,
                sc.name
            );
        }
        if let Some(job) = plan_host_update(table, u, scale.as_ref(), block)? {
            jobs.push(job);
        }
    }
    check_quantizable(table, &jobs)?;
    Ok(CheckedValues::new(jobs))
}

// ---------------------------------------------------------------------------------------
// Write
// ---------------------------------------------------------------------------------------

/// Elements decoded at a time by the finiteness check (bounded host memory).
const CHECK_CHUNK: usize = 1 << 20;

/// Quantizing a non-finite value is meaningless: rejects float sources with NaN/Inf headed
/// for FP8/FP4 storage, naming the weight, before anything is written.
fn check_quantizable(table: &WeightTable, jobs: &[Job]) -> Result<()> {
    let mut tmp = Vec::new();
    for job in jobs {
        if !matches!(job.src.enc, Encoding::Float(_)) {
            continue;
        }
        // Device values are checked on the device (CUDA backend, before anything is written).
        if job.src.data.host().is_none() {
            continue;
        }
        let cols = job.src.cols.max(1);
        for p in &job.pieces {
            if !table.is_quantized(p.dst) {
                continue;
            }
            let step = (CHECK_CHUNK / cols).max(1);
            let mut r = 0;
            while r < p.rows {
                let n = step.min(p.rows - r);
                tmp.resize(n * cols, 0.0f32);
                decode_rows(&job.src, p.row0 + r, &mut tmp);
                if let Some(k) = tmp.iter().position(|v| !v.is_finite()) {
                    crate::bail!(
                        Tensor,
                        "weight `{}`: element {} is {} and cannot be quantized to its FP8/FP4 storage",
                        table.name(p.dst),
                        r * cols + k,
                        tmp[k]
                    );
                }
                r += n;
            }
        }
    }
    Ok(())
}

/// How a device source is encoded; the values are kernels/weight_convert.cu's `enc` codes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(i32)]
pub enum DeviceEnc {
    F32 = 0,
    Bf16 = 1,
    F16 = 2,
    /// FP8 e4m3 codes with block scales.
    Fp8 = 3,
    /// Packed FP4 e2m1 codes with 1x32 scales.
    Fp4 = 4,
    I32 = 5,
    I64 = 6,
}

impl DeviceEnc {
    /// Bytes of one element (a packed FP4 byte holds two).
    pub fn size(self) -> usize {
        match self {
            DeviceEnc::F32 | DeviceEnc::I32 => 4,
            DeviceEnc::Bf16 | DeviceEnc::F16 => 2,
            DeviceEnc::Fp8 | DeviceEnc::Fp4 => 1,
            DeviceEnc::I64 => 8,
        }
    }
}

fn device_enc(src: &Source) -> DeviceEnc {
    match src.enc {
        Encoding::Float(FloatDtype::F32) => DeviceEnc::F32,
        Encoding::Float(FloatDtype::Bf16) => DeviceEnc::Bf16,
        Encoding::Float(FloatDtype::F16) => DeviceEnc::F16,
        Encoding::Fp8(_) => DeviceEnc::Fp8,
        Encoding::Fp4 => DeviceEnc::Fp4,
        Encoding::Int(IntDtype::I64) => DeviceEnc::I64,
        // Host updates of index tables are I32 or I64 (plan_update).
        Encoding::Int(_) => DeviceEnc::I32,
    }
}

/// A device source's block scale: UE8M0 bytes, or f32.
#[derive(Clone, Copy, Debug)]
pub struct DeviceScale {
    pub addr: u64,
    pub len: usize,
    pub f32: bool,
}

/// A validated tensor in device memory: its matrix view `[.., mat_rows, cols]` (FP8 scales per
/// matrix, `block` blocks).
#[derive(Clone, Copy, Debug)]
pub struct DeviceSource {
    pub addr: u64,
    pub len: usize,
    pub enc: DeviceEnc,
    pub scale: Option<DeviceScale>,
    pub block: [usize; 2],
    pub mat_rows: usize,
    pub cols: usize,
}

/// One weight written from device memory: source global rows `[row0, row0 + rows)` fill it.
#[derive(Clone, Debug)]
pub struct DeviceWrite {
    /// How messages name the entry (`update `x``).
    pub who: String,
    pub dst: usize,
    pub src: DeviceSource,
    pub row0: usize,
    pub rows: usize,
    /// Codes copied byte for byte and scales converted ([`copies_as_is`]); else every value
    /// decoded and encoded in the weight's storage.
    pub as_is: bool,
}

/// A check of device values that must pass before anything is written.
#[derive(Clone, Debug)]
pub struct DeviceCheck {
    /// How messages name the entry (`update `x``).
    pub who: String,
    /// The (first) weight it writes.
    pub weight: String,
    pub addr: u64,
    pub enc: DeviceEnc,
    /// Elements.
    pub n: usize,
    /// Some: integers in [0, bound) (expert ids); None: floats finite (quantized on write).
    pub bound: Option<usize>,
}

impl DeviceCheck {
    /// The TENSOR error when element `i` failed, in the host check's words.
    pub fn error(&self, i: u64) -> Error {
        let msg = match self.bound {
            Some(b) => format!(
                "{}: element {i} of `{}` is not an expert id in [0, {b})",
                self.who, self.weight
            ),
            None => format!(
                "weight `{}`: element {i} of {} is not finite (NaN or Inf) and cannot be quantized to its FP8/FP4 storage",
                self.weight, self.who
            ),
        };
        Error::new(Status::Tensor, msg)
    }
}

/// Validated sources and the weights they write: what a load or refit hands a backend.
pub struct CheckedValues<'a> {
    jobs: Vec<Job<'a>>,
    /// Weight -> (job, piece) of every host write: every chunk of a load looks its weight up.
    by_dst: std::collections::HashMap<usize, (usize, usize)>,
    /// (weight, job, piece) for every weight written from host memory, in job order.
    writes: Vec<(usize, usize, usize)>,
    /// The same for weights written from device memory (the CUDA backend writes them on the
    /// device: [`CheckedValues::device_writes`]).
    device: Vec<(usize, usize, usize)>,
    /// Sources are a checkpoint's mappings, whose pages may be dropped once written.
    mapped: bool,
}

impl<'a> CheckedValues<'a> {
    fn new(jobs: Vec<Job<'a>>) -> CheckedValues<'a> {
        let (mut writes, mut device) = (vec![], vec![]);
        for (j, job) in jobs.iter().enumerate() {
            let list = match job.src.data {
                Bytes::Host(_) => &mut writes,
                Bytes::Device { .. } => &mut device,
            };
            list.extend(job.pieces.iter().enumerate().map(|(k, p)| (p.dst, j, k)));
        }
        let by_dst = writes.iter().map(|&(d, j, k)| (d, (j, k))).collect();
        CheckedValues {
            jobs,
            by_dst,
            writes,
            device,
            mapped: false,
        }
    }

    /// Every weight these values write: from host memory ([`WeightValues::targets`]), then
    /// from device memory.
    pub fn all_targets(&self) -> Vec<usize> {
        self.writes
            .iter()
            .chain(&self.device)
            .map(|w| w.0)
            .collect()
    }

    /// The checks device values need before anything is written (the host checked its own in
    /// the plan): finite floats where they are quantized, index tables in range.
    pub fn device_checks(&self, table: &WeightTable) -> Vec<DeviceCheck> {
        let mut out = vec![];
        let mut seen = std::collections::BTreeSet::new();
        for &(_, j, _) in &self.device {
            let job = &self.jobs[j];
            if !seen.insert(j) {
                continue;
            }
            let Bytes::Device { addr, len } = job.src.data else {
                continue;
            };
            let enc = device_enc(&job.src);
            let n = len / enc.size().max(1);
            let weight = table.name(job.pieces[0].dst).to_owned();
            let who = job.who.clone();
            if let Some(bound) = job.bound {
                let bound = Some(bound);
                out.push(DeviceCheck {
                    who,
                    weight,
                    addr,
                    enc,
                    n,
                    bound,
                });
            } else if matches!(job.src.enc, Encoding::Float(_))
                && job.pieces.iter().any(|p| table.is_quantized(p.dst))
            {
                out.push(DeviceCheck {
                    who,
                    weight,
                    addr,
                    enc,
                    n,
                    bound: None,
                });
            }
        }
        out
    }

    /// The weights written from device memory, each from its source rows.
    pub fn device_writes(&self, table: &WeightTable) -> Vec<DeviceWrite> {
        self.device
            .iter()
            .filter_map(|&(dst, j, k)| {
                let (src, p) = (&self.jobs[j].src, self.jobs[j].pieces[k]);
                let Bytes::Device { addr, len } = src.data else {
                    return None;
                };
                let scale = src.scale.and_then(|(b, sdt)| match b {
                    Bytes::Device { addr, len } => Some(DeviceScale {
                        addr,
                        len,
                        f32: sdt == ScaleDtype::F32,
                    }),
                    Bytes::Host(_) => None,
                });
                let block = match src.enc {
                    Encoding::Fp8(b) => b,
                    _ => [1, 1],
                };
                Some(DeviceWrite {
                    who: self.jobs[j].who.clone(),
                    dst,
                    src: DeviceSource {
                        addr,
                        len,
                        enc: device_enc(src),
                        scale,
                        block,
                        mat_rows: src.mat_rows,
                        cols: src.cols,
                    },
                    row0: p.row0,
                    rows: p.rows,
                    as_is: copies_as_is(src, p, table.entry(dst).layout.kind),
                })
            })
            .collect()
    }

    /// The piece that writes weight `dst`, with its source.
    fn piece_of(&self, dst: usize) -> Option<(&Source<'a>, Piece)> {
        let &(j, k) = self.by_dst.get(&dst)?;
        Some((&self.jobs[j].src, self.jobs[j].pieces[k]))
    }
}

impl WeightValues for CheckedValues<'_> {
    fn targets(&self) -> Vec<usize> {
        self.writes.iter().map(|w| w.0).collect()
    }

    fn fill(
        &self,
        table: &WeightTable,
        dst: usize,
        rows: std::ops::Range<usize>,
        data: &mut [u8],
        scales: &mut [f32],
    ) {
        let Some((src, p)) = self.piece_of(dst) else {
            debug_assert!(false, "weight {dst} is not written by these values");
            return;
        };
        let g = Geometry::of(table.entry(dst));
        debug_assert_eq!(
            g.rows * g.cols,
            p.rows * src.cols,
            "piece and weight differ in size"
        );
        write_rows(src, p, g, rows, data, scales);
    }

    /// A checkpoint's bytes of the weight's rows leave the process's resident memory.
    fn written(&self, dst: usize) {
        if !self.mapped {
            return;
        }
        if let Some((src, p)) = self.piece_of(dst) {
            let rb = src.row_bytes();
            let data = src.data.host_or_empty();
            let (a, b) = (p.row0 * rb, ((p.row0 + p.rows) * rb).min(data.len()));
            crate::weights::safetensors_io::release_pages(&data[a..b.max(a)]);
        }
    }
}

/// The host bytes of a source (the plan gives host-only code paths host sources only).
fn data_of<'a>(src: &Source<'a>) -> &'a [u8] {
    src.data.host_or_empty()
}

/// Whether piece `p` of `src` is written as it is into storage `kind`: codes and scales copied,
/// since the source already has the weight's format (FP4 codes into FP4 storage; FP8 codes with
/// the storage's scale blocks, a whole matrix of the source). Otherwise it is decoded and
/// encoded. The host write and the device write (CUDA) decide alike.
fn copies_as_is(src: &Source, p: Piece, kind: StorageKind) -> bool {
    match (src.enc, kind, src.scale) {
        (Encoding::Fp8(b), StorageKind::Quant(QFormat::Fp8 { block }), Some(_)) => {
            b == block && p.row0.is_multiple_of(src.mat_rows) && p.rows == src.mat_rows
        }
        (Encoding::Fp4, StorageKind::Quant(QFormat::Fp4), Some(_)) => true,
        _ => false,
    }
}

/// Writes rows `rows` of piece `p` of `src` into a chunk of a weight with geometry `g`: codes
/// and scales are copied as they are when the source already has the weight's format (an FP4
/// expert, or an FP8 matrix with the same scale blocks); anything else is decoded and encoded
/// (f32 as is, BF16 rounded, quantized with the official rules).
fn write_rows(
    src: &Source,
    p: Piece,
    g: Geometry,
    rows: std::ops::Range<usize>,
    data: &mut [u8],
    scales: &mut [f32],
) {
    let cols = src.cols;
    let (r0, r1) = (p.row0 + rows.start, p.row0 + rows.end);
    let local = g.scale_range(&rows);
    match (src.enc, g.kind, src.scale) {
        (Encoding::Int(it), StorageKind::I32, _) => {
            let sz = it.size();
            let mut out = vec![0i32; (r1 - r0) * cols];
            dtype::decode_int(it, &data_of(src)[r0 * cols * sz..r1 * cols * sz], &mut out);
            data.chunks_exact_mut(4)
                .zip(&out)
                .for_each(|(o, v)| o.copy_from_slice(&v.to_le_bytes()));
        }
        (Encoding::Fp8(_), StorageKind::Quant(QFormat::Fp8 { block }), Some((scale, sdt)))
            if copies_as_is(src, p, g.kind) =>
        {
            let scale = scale.host_or_empty();
            data.copy_from_slice(&data_of(src)[r0 * cols..r1 * cols]);
            let per_mat = src.mat_rows.div_ceil(block[0]) * cols.div_ceil(block[1]);
            let m = p.row0 / src.mat_rows;
            scales
                .iter_mut()
                .zip(local)
                .for_each(|(s, i)| *s = sdt.get(scale, m * per_mat + i));
        }
        (Encoding::Fp4, StorageKind::Quant(QFormat::Fp4), Some((scale, sdt))) => {
            let scale = scale.host_or_empty();
            let half = cols / 2;
            data.copy_from_slice(&data_of(src)[r0 * half..r1 * half]);
            let sc = cols.div_ceil(FP4_BLOCK);
            scales
                .iter_mut()
                .zip(local)
                .for_each(|(s, i)| *s = sdt.get(scale, p.row0 * sc + i));
        }
        (_, kind, _) => {
            let mut tmp = vec![0.0f32; (r1 - r0) * cols];
            decode_rows(src, r0, &mut tmp);
            encode_rows(kind, &tmp, cols, data, scales);
        }
    }
}

/// Decodes `out.len() / cols` global rows of a float source starting at `row0`.
fn decode_rows(src: &Source, row0: usize, out: &mut [f32]) {
    let cols = src.cols;
    if cols == 0 || out.is_empty() {
        return;
    }
    let rows = out.len() / cols;
    match src.enc {
        Encoding::Float(ft) => {
            let sz = ft.size();
            dtype::decode_float(
                ft,
                &data_of(src)[row0 * cols * sz..(row0 + rows) * cols * sz],
                out,
            );
        }
        Encoding::Int(_) => {}
        Encoding::Fp8(block) => {
            let Some((scale, sdt)) = src.scale else {
                return;
            };
            let scale = scale.host_or_empty();
            let per_mat = src.mat_rows.div_ceil(block[0]) * cols.div_ceil(block[1]);
            // A piece may cross matrix boundaries only for whole matrices; walk matrix by matrix.
            let mut g = row0;
            let mut out = out;
            while !out.is_empty() {
                let (m, r) = (g / src.mat_rows, g % src.mat_rows);
                let n = (src.mat_rows - r).min(out.len() / cols);
                let (head, tail) = out.split_at_mut(n * cols);
                let s = &scale[m * per_mat * sdt.size()..(m + 1) * per_mat * sdt.size()];
                dtype::dequant_fp8_rows(
                    &data_of(src)[g * cols..(g + n) * cols],
                    s,
                    sdt,
                    r,
                    cols,
                    block,
                    head,
                );
                g += n;
                out = tail;
            }
        }
        Encoding::Fp4 => {
            let Some((scale, sdt)) = src.scale else {
                return;
            };
            let scale = scale.host_or_empty();
            let sc = cols.div_ceil(FP4_BLOCK) * sdt.size();
            let half = cols / 2;
            dtype::dequant_fp4_rows(
                &data_of(src)[row0 * half..(row0 + rows) * half],
                &scale[row0 * sc..(row0 + rows) * sc],
                sdt,
                cols,
                out,
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::weights::store::TensorData;

    fn host<'a>(
        name: &'a str,
        dtype: HostDtype,
        shape: &'a [usize],
        data: &'a [u8],
    ) -> UpdateTensor<'a> {
        UpdateTensor {
            name,
            dtype,
            shape,
            data: Bytes::Host(data),
        }
    }

    /// A float / index update without scale (the form most tests need), checked.
    fn check_update(store: &WeightStore, u: UpdateTensor) -> Result<Vec<usize>> {
        super::check_update(store.table(), &u, None, [128, 128])
    }

    /// [`check_update`]'s update, written.
    fn write_update(store: &mut WeightStore, u: UpdateTensor) -> Result<Vec<usize>> {
        super::write_update(store, &u, None, [128, 128])
    }
    use crate::weights::safetensors_io::tests::TempDir;

    /// A small config: one sliding layer with hash routing and one CSA layer with top-k.
    const SMALL: &str = r#"{
      "vocab_size": 16, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
      "head_dim": 32, "qk_rope_head_dim": 16, "q_lora_rank": 32, "o_groups": 1, "o_lora_rank": 32,
      "sliding_window": 4, "layer_types": ["sliding_attention", "compressed_sparse_attention"],
      "mlp_layer_types": ["hash_moe", "moe"], "index_n_heads": 2, "index_head_dim": 16, "index_topk": 2,
      "n_routed_experts": 3, "num_experts_per_tok": 2, "n_shared_experts": 1, "moe_intermediate_size": 40,
      "hc_mult": 2
    }"#;

    fn small() -> (ModelConfig, WeightStore) {
        let cfg = ModelConfig::from_json_str(SMALL).unwrap();
        let store = WeightStore::allocate(&cfg).unwrap();
        (cfg, store)
    }

    fn f32_bytes(v: &[f32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    #[test]
    fn update_plain_and_errors() {
        let (_, mut store) = small();
        let i = store.index_of("norm.weight").unwrap();
        let vals: Vec<f32> = (0..64).map(|k| k as f32).collect();
        let touched = write_update(
            &mut store,
            host(
                "model.norm.weight",
                HostDtype::F32,
                &[64],
                &f32_bytes(&vals),
            ),
        )
        .unwrap();
        assert_eq!(touched, vec![i]);
        assert_eq!(store.f32(i), vals.as_slice());

        let bf: Vec<u8> = vals
            .iter()
            .flat_map(|x| half::bf16::from_f32(*x).to_bits().to_le_bytes())
            .collect();
        write_update(&mut store, host("norm.weight", HostDtype::Bf16, &[64], &bf)).unwrap();
        assert_eq!(store.f32(i), vals.as_slice());

        let fails = |name, dtype, shape: &[usize], data: &[u8]| {
            check_update(&store, host(name, dtype, shape, data)).unwrap_err()
        };
        let e = fails(
            "norm.weight",
            HostDtype::F32,
            &[63],
            &f32_bytes(&vals[..63]),
        );
        assert_eq!(e.status, Status::Tensor);
        assert!(
            e.message.contains("norm.weight") && e.message.contains("[63]"),
            "{}",
            e.message
        );
        let e = fails("norm.weight", HostDtype::F32, &[64], &[0; 8]);
        assert_eq!(e.status, Status::InvalidArgument, "{}", e.message);
        let e = fails("norm.weight", HostDtype::I32, &[64], &[0; 256]);
        assert_eq!(e.status, Status::Tensor);
        let e = fails(
            "layers.9.attn_norm.weight",
            HostDtype::F32,
            &[64],
            &[0; 256],
        );
        assert!(
            e.status == Status::Tensor && e.message.contains("layers.9.attn_norm.weight"),
            "{}",
            e.message
        );
        let e = fails("layers.0.attn.wq_a.scale", HostDtype::F32, &[1, 1], &[0; 4]);
        assert_eq!(e.status, Status::Tensor);
        // Sliding layer 0 has no compressor.
        let e = fails(
            "layers.0.attn.compressor.ape",
            HostDtype::F32,
            &[4, 32],
            &[0; 512],
        );
        assert_eq!(e.status, Status::Tensor);
        assert_eq!(
            check_update(
                &store,
                host("mtp.0.enorm.weight", HostDtype::F32, &[1], &[0; 4])
            )
            .unwrap(),
            Vec::<usize>::new()
        );
    }

    #[test]
    fn update_tid2eid_range() {
        let (_, mut store) = small();
        let i = store.index_of("layers.0.ffn.gate.tid2eid").unwrap();
        let ids: Vec<i64> = (0..32).map(|k| k % 3).collect();
        let b: Vec<u8> = ids.iter().flat_map(|x| x.to_le_bytes()).collect();
        write_update(
            &mut store,
            host(
                "model.layers.0.mlp.gate.tid2eid",
                HostDtype::I64,
                &[16, 2],
                &b,
            ),
        )
        .unwrap();
        assert_eq!(
            store.i32(i),
            ids.iter().map(|&x| x as i32).collect::<Vec<_>>().as_slice()
        );
        let mut bad = ids.clone();
        bad[7] = 3;
        let b: Vec<u8> = bad.iter().flat_map(|x| (*x as i32).to_le_bytes()).collect();
        let e = check_update(
            &store,
            host("layers.0.ffn.gate.tid2eid", HostDtype::I32, &[16, 2], &b),
        )
        .unwrap_err();
        assert_eq!(e.status, Status::Tensor);
        assert!(
            e.message.contains("[3, 1]") && e.message.contains("tid2eid"),
            "{}",
            e.message
        );
        let e = check_update(
            &store,
            host("layers.0.ffn.gate.tid2eid", HostDtype::F32, &[16, 2], &b),
        )
        .unwrap_err();
        assert_eq!(e.status, Status::Tensor);
    }

    /// Projection `w` (w1, w2, w3) of routed expert `x` of layer 1.
    fn layer1_expert<'s>(store: &'s WeightStore, x: usize, w: &str) -> &'s [f32] {
        store.f32(
            store
                .index_of(&format!("layers.1.ffn.experts.{x}.{w}.weight"))
                .unwrap(),
        )
    }

    #[test]
    fn update_fused_experts_split() {
        let (_, mut store) = small();
        let (e, i, d) = (3, 40, 64);
        let gu: Vec<f32> = (0..e * 2 * i * d).map(|k| k as f32).collect();
        let touched = write_update(
            &mut store,
            host(
                "model.layers.1.mlp.experts.gate_up_proj",
                HostDtype::F32,
                &[e, 2 * i, d],
                &f32_bytes(&gu),
            ),
        )
        .unwrap();
        assert_eq!(touched.len(), 2 * e);
        for x in 0..e {
            let w1 = layer1_expert(&store, x, "w1");
            let w3 = layer1_expert(&store, x, "w3");
            assert_eq!(w1, &gu[x * 2 * i * d..(x * 2 + 1) * i * d]);
            assert_eq!(w3, &gu[(x * 2 + 1) * i * d..(x + 1) * 2 * i * d]);
        }
        let dn: Vec<f32> = (0..e * d * i).map(|k| -(k as f32)).collect();
        write_update(
            &mut store,
            host(
                "model.layers.1.mlp.experts.down_proj",
                HostDtype::F32,
                &[e, d, i],
                &f32_bytes(&dn),
            ),
        )
        .unwrap();
        for x in 0..e {
            let w2 = layer1_expert(&store, x, "w2");
            assert_eq!(w2, &dn[x * d * i..(x + 1) * d * i]);
        }
        let e2 = check_update(
            &store,
            host(
                "model.layers.1.mlp.experts.down_proj",
                HostDtype::F32,
                &[e, i, d],
                &f32_bytes(&dn),
            ),
        )
        .unwrap_err();
        assert_eq!(e2.status, Status::Tensor);
        assert!(e2.message.contains("down_proj"), "{}", e2.message);
    }

    /// A checkpoint with one FP8 tensor whose scale is mis-shaped fails before writing anything.
    #[test]
    fn failed_load_writes_nothing() {
        use safetensors::tensor::TensorView;
        let (cfg, mut store) = small();
        let dir = TempDir::new("load-nowrite");
        let mut owned: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
        for t in store.tensors() {
            let s = &t.spec;
            match s.kind {
                ElemKind::Index => owned.push((
                    s.name.clone(),
                    Dtype::I64,
                    s.shape.clone(),
                    vec![0; s.numel() * 8],
                )),
                ElemKind::Float if s.name == "layers.0.attn.wq_a.weight" => {
                    owned.push((
                        s.name.clone(),
                        Dtype::F8_E4M3,
                        s.shape.clone(),
                        vec![0x38; s.numel()],
                    ));
                    owned.push((
                        "layers.0.attn.wq_a.scale".into(),
                        Dtype::F8_E8M0,
                        vec![1, 2],
                        vec![127; 2],
                    ));
                }
                ElemKind::Float => owned.push((
                    s.name.clone(),
                    Dtype::F32,
                    s.shape.clone(),
                    f32_bytes(&vec![1.0; s.numel()]),
                )),
            }
        }
        let views: Vec<(String, TensorView)> = owned
            .iter()
            .map(|(n, d, s, b)| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap()))
            .collect();
        std::fs::write(
            dir.0.join("model.safetensors"),
            safetensors::serialize(views, None).unwrap(),
        )
        .unwrap();
        // wq_a is [32, 64]: 128x128 blocks -> scale [1, 1], not [1, 2].
        let e = load_checkpoint(&mut store, &cfg, &dir.0).unwrap_err();
        assert_eq!(e.status, Status::Tensor);
        assert!(
            e.message.contains("layers.0.attn.wq_a.scale") && e.message.contains("[1, 1]"),
            "{}",
            e.message
        );
        assert!(store.tensors().iter().all(|t| match &t.data {
            TensorData::F32(v) => v.iter().all(|&x| x == 0.0),
            TensorData::Bf16(v) => v.iter().all(|&x| x == 0),
            TensorData::I32(v) => v.iter().all(|&x| x == 0),
            _ => panic!("the test config stores every weight as f32/bf16/i32"),
        }));
    }

    /// Values written in row chunks (as the CUDA upload writes them) equal the weight written
    /// whole: FP8 codes copied with their scales, FP4 codes copied, BF16 quantized on write.
    #[test]
    fn chunked_writes_equal_whole_writes() {
        // 16x16 FP8 blocks so that small weights span several block rows.
        let json = SMALL.replace(
            r#""hc_mult": 2"#,
            r#""hc_mult": 2, "quantization_config": {"weight_block_size": [16, 16]}"#,
        );
        let cfg = ModelConfig::from_json_str(&json).unwrap();
        let table = WeightTable::new(&cfg, crate::weights::WeightFormat::AsStored).unwrap();
        let w = |name: &str| table.index_of(name).unwrap();
        let shape = |name: &str| table.entry(w(name)).spec.shape.clone();
        // wq_b [heads * head_dim, q_lora] = [64, 32] as FP8 codes + E8M0 scales [4, 2].
        let sq = shape("layers.0.attn.wq_b.weight");
        let codes: Vec<u8> = (0..sq[0] * sq[1])
            .map(|k| (k * 37 % 251) as u8 & 0x7e)
            .collect();
        let grid = [sq[0].div_ceil(16), sq[1].div_ceil(16)];
        let e8: Vec<u8> = (0..grid[0] * grid[1]).map(|k| 120 + k as u8).collect();
        // A shared-expert w1 as BF16 (quantized on write).
        let se = shape("layers.1.ffn.shared_experts.w1.weight");
        let bf: Vec<u8> = (0..se[0] * se[1])
            .flat_map(|k| {
                half::bf16::from_f32((k as f32 * 0.37).sin())
                    .to_bits()
                    .to_le_bytes()
            })
            .collect();
        // A routed FP4 expert: packed codes + E8M0 scales (1x32 blocks).
        let ex = shape("layers.1.ffn.experts.0.w1.weight");
        let fp4: Vec<u8> = (0..ex[0] * ex[1] / 2)
            .map(|k| (k * 91 % 256) as u8)
            .collect();
        let s4: Vec<u8> = (0..ex[0] * ex[1].div_ceil(32))
            .map(|k| 125 + (k % 5) as u8)
            .collect();
        let scale_shape = [ex[0], ex[1].div_ceil(32)];
        // HF-native fused down_proj [E, D, I] as BF16: one piece per expert (rows at an
        // offset into the source), each quantized to FP4 on write.
        let (e, dd, ii) = (3, 64, 40);
        let fused: Vec<u8> = (0..e * dd * ii)
            .flat_map(|k| {
                half::bf16::from_f32((k as f32 * 0.11).cos() * 3.0)
                    .to_bits()
                    .to_le_bytes()
            })
            .collect();
        let fused_shape = [e, dd, ii];
        let updates = [
            (
                host("layers.0.attn.wq_b.weight", HostDtype::F8E4M3, &sq, &codes),
                Some(host(
                    "layers.0.attn.wq_b.scale",
                    HostDtype::E8M0,
                    &grid,
                    &e8,
                )),
            ),
            (
                host(
                    "layers.1.ffn.shared_experts.w1.weight",
                    HostDtype::Bf16,
                    &se,
                    &bf,
                ),
                None,
            ),
            (
                host(
                    "layers.1.ffn.experts.0.w1.weight",
                    HostDtype::Fp4E2M1,
                    &ex,
                    &fp4,
                ),
                Some(host(
                    "layers.1.ffn.experts.0.w1.scale",
                    HostDtype::E8M0,
                    &scale_shape,
                    &s4,
                )),
            ),
        ];
        let mut updates = updates.to_vec();
        updates.push((
            host(
                "model.layers.1.mlp.experts.down_proj",
                HostDtype::Bf16,
                &fused_shape,
                &fused,
            ),
            None,
        ));
        let values = plan_updates(&table, &updates, [16, 16]).unwrap();
        assert_eq!(values.targets().len(), 3 + e);
        for i in values.targets() {
            let g = Geometry::of(table.entry(i));
            assert!(table.is_quantized(i), "{}", table.name(i));
            let fill = |rows: &std::ops::Range<usize>| {
                let mut d = vec![0u8; g.data_range(rows).len()];
                let mut s = vec![0f32; g.scale_range(rows).len()];
                values.fill(&table, i, rows.clone(), &mut d, &mut s);
                (d, s)
            };
            let whole = fill(&(0..g.rows));
            let chunks = g.chunks(g.min_chunk_bytes());
            assert!(chunks.len() > 1, "{}: one chunk", table.name(i));
            let (mut d, mut s) = (vec![], vec![]);
            for c in chunks {
                let (cd, cs) = fill(&c);
                d.extend(cd);
                s.extend(cs);
            }
            assert_eq!((d, s), whole, "{}", table.name(i));
        }
    }
}
