//! Pairs stored-format refit entries with their block scales: within one dsv4_refit call, and
//! across the calls of a chunked refit (dsv4_refit_begin .. dsv4_refit_end).
//!
//! A weight sent in its stored format (F8_E4M3 / FP4_E2M1 codes) means nothing without its
//! block scale, which hosts send as a separate entry (`<weight>.scale`, `<weight>_scale_inv`,
//! any naming scheme). A plain dsv4_refit must contain both. In a chunked refit they may come
//! in different chunks, in either order: hosts stream in buckets, and a checkpoint's shards
//! may split a pair (a host reading one shard per chunk). The half that comes first is
//! validated as far as it can be alone and held here, as a host copy (the host may reuse its
//! buffer once the call returns; a device entry is copied out for this, the one case where a
//! refit reads device values to the host), until
//! its partner arrives; the pair is then validated together and written exactly as if both
//! had come in one call. The engine refuses to close the refit while anything is held.
//!
//! Nothing here writes weights. [`PendingPairs::plan`] validates a chunk against the weight
//! table and the held set; the engine writes the chunk, then applies the [`HeldChange`] with
//! [`PendingPairs::commit`]. So a bad chunk leaves the weights AND the held set unchanged.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use crate::error::{Error, Result, Status};
use crate::weights::names::{Role, Target, classify};
use crate::weights::table::WeightTable;
use crate::weights::{Bytes, HostDtype, UpdateTensor, load};

/// Copies a device-memory entry to the host (the backend's staging), for a half that must be
/// held past the call: the host may free its buffer when the call returns.
pub type Stage<'s> = dyn Fn(&UpdateTensor) -> Result<Vec<u8>> + 's;

/// One half of a pair, held until its partner arrives: a host copy of the entry.
struct Held {
    name: String,
    dtype: HostDtype,
    shape: Vec<usize>,
    data: Vec<u8>,
    /// Canonical weights a held weight will write (empty for a scale). They stay reserved
    /// while it waits, so that no other entry can write them in the meantime.
    dsts: Vec<usize>,
}

impl Held {
    /// A host copy of `u`: its bytes, or for device memory what `stage` copies out of it.
    fn copy_of(u: &UpdateTensor, dsts: Vec<usize>, stage: &Stage) -> Result<Held> {
        let data = match u.data {
            Bytes::Host(b) => b.to_vec(),
            Bytes::Device { .. } => stage(u)?,
        };
        Ok(Held {
            name: u.name.to_owned(),
            dtype: u.dtype,
            shape: u.shape.to_vec(),
            data,
            dsts,
        })
    }

    fn as_update(&self) -> UpdateTensor<'_> {
        UpdateTensor {
            name: &self.name,
            dtype: self.dtype,
            shape: &self.shape,
            data: Bytes::Host(&self.data),
        }
    }

    /// How messages name it.
    fn label(&self) -> String {
        format!("`{}` (held from an earlier refit chunk)", self.name)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Half {
    Weight,
    Scale,
}

/// The halves of an open chunked refit that wait for their partner, by the weight they
/// belong to. Empty outside a chunked refit.
#[derive(Default)]
pub struct PendingPairs {
    /// Stored-format weights waiting for their scale.
    weights: BTreeMap<Target, Held>,
    /// Scales waiting for their weight.
    scales: BTreeMap<Target, Held>,
}

/// One validated weight update of a chunk: a weight and its scale (None for float / index
/// values), each from the chunk or from the held set.
pub struct Write<'a> {
    pub weight: UpdateTensor<'a>,
    pub scale: Option<UpdateTensor<'a>>,
}

/// How the held set changes once a validated chunk is written. Owns its data, so that the
/// plan's borrows of the held set can end before [`PendingPairs::commit`].
pub struct HeldChange {
    /// Held halves that this chunk completes.
    completed: Vec<(Half, Target)>,
    /// Halves of this chunk that must wait for a later one.
    new: Vec<(Half, Target, Held)>,
}

/// Codes that mean nothing without their block scale (float and index values stand alone).
fn is_stored_format(dtype: HostDtype) -> bool {
    matches!(dtype, HostDtype::F8E4M3 | HostDtype::Fp4E2M1)
}

impl PendingPairs {
    pub fn is_empty(&self) -> bool {
        self.weights.is_empty() && self.scales.is_empty()
    }

    /// Host bytes of the held halves' copies.
    pub fn held_bytes(&self) -> u64 {
        self.weights
            .values()
            .chain(self.scales.values())
            .map(|h| h.data.len() as u64)
            .sum()
    }

    /// Drops every held half (dsv4_refit_abort: they were never written).
    pub fn clear(&mut self) {
        self.weights.clear();
        self.scales.clear();
    }

    /// Pairs and validates one refit chunk (`noun` names its entries in messages: "refit",
    /// or "load" for dsv4_load_tensors, which never holds). `may_hold`: inside a chunked refit, a half
    /// without its partner (in the chunk or held) is validated alone and held; otherwise it
    /// is an error, as in a plain dsv4_refit. Returns the writes in chunk order and the
    /// held-set change to commit once they are written. Errors name the entries involved;
    /// on error nothing is to be written and nothing changes.
    pub fn plan<'a>(
        &'a self,
        store: &WeightTable,
        updates: &'a [UpdateTensor<'a>],
        block: [usize; 2],
        may_hold: bool,
        stage: &Stage,
        noun: &str,
    ) -> Result<(Vec<Write<'a>>, HeldChange)> {
        // 1. The chunk's weights and scales by target. Two scales for one weight (two names
        //    of it, or one sent and one held) cannot both be meant.
        let mut scales: BTreeMap<Target, usize> = BTreeMap::new();
        let mut weights: BTreeSet<Target> = BTreeSet::new();
        for (k, u) in updates.iter().enumerate() {
            match classify(u.name) {
                Some(Role::Scale(t)) => {
                    let prev = scales
                        .get(&t)
                        .map(|&j| format!("`{}`", updates[j].name))
                        .or_else(|| self.scales.get(&t).map(Held::label));
                    if let Some(prev) = prev {
                        return Err(Error::new(
                            Status::InvalidArgument,
                            format!(
                                "{noun} entries {prev} and `{}` are both the scale of `{}`",
                                u.name,
                                t.describe()
                            ),
                        ));
                    }
                    scales.insert(t, k);
                }
                // Two weights of one target are caught below: both write the same weights.
                Some(Role::Weight(t)) => {
                    weights.insert(t);
                }
                _ => {}
            }
        }

        // 2. Pair, in chunk order: a weight takes the chunk's scale, else a held one; a scale
        //    whose weight is not in the chunk completes a held weight, else waits.
        let mut writes: Vec<(String, Write<'a>, bool)> = Vec::new();
        let mut completed = Vec::new();
        let mut hold: Vec<(usize, Half, Target)> = Vec::new();
        for (k, u) in updates.iter().enumerate() {
            match classify(u.name) {
                Some(Role::Scale(t)) => {
                    if weights.contains(&t) {
                        continue; // written with its weight
                    }
                    if let Some(h) = self.weights.get(&t) {
                        let write = Write {
                            weight: h.as_update(),
                            scale: Some(*u),
                        };
                        let label = format!("{noun} entry {k}, the scale of held `{}`", h.name);
                        writes.push((label, write, true));
                        completed.push((Half::Weight, t));
                    } else if may_hold {
                        hold.push((k, Half::Scale, t));
                    } else {
                        return Err(Error::new(
                            Status::Tensor,
                            format!(
                                "{noun} entry {k} `{}` is the scale of `{}`, which this call does not contain (send a quantized weight and its scale together, or in a refit both within one dsv4_refit_begin / dsv4_refit_end)",
                                u.name,
                                t.describe()
                            ),
                        ));
                    }
                }
                Some(Role::Weight(t)) => {
                    let mut scale = scales.get(&t).map(|&j| updates[j]);
                    let mut label = format!("{noun} entry {k}");
                    if scale.is_none()
                        && let Some(h) = self.scales.get(&t)
                    {
                        scale = Some(h.as_update());
                        label = format!("{label} with its held scale `{}`", h.name);
                        completed.push((Half::Scale, t.clone()));
                    }
                    if scale.is_none() && may_hold && is_stored_format(u.dtype) {
                        hold.push((k, Half::Weight, t));
                        continue;
                    }
                    writes.push((label, Write { weight: *u, scale }, false));
                }
                // `mtp.*` and unknown names: check_update ignores / rejects them.
                _ => writes.push((
                    format!("{noun} entry {k}"),
                    Write {
                        weight: *u,
                        scale: None,
                    },
                    false,
                )),
            }
        }

        // 3. Validate every write in full and every new half alone. No canonical weight may
        //    be written twice: by two entries of the chunk (aliases), or by one and a held
        //    weight (whose weights stay reserved until it is written).
        let mut claimed: HashMap<usize, String> = HashMap::new();
        for h in self.weights.values() {
            for &i in &h.dsts {
                claimed.insert(i, h.label());
            }
        }
        let mut claim = |i: usize, who: String| match claimed.get(&i) {
            Some(prev) => Err(Error::new(
                Status::InvalidArgument,
                format!(
                    "{noun} entries {prev} and {who} both write weight `{}`",
                    store.name(i)
                ),
            )),
            None => {
                claimed.insert(i, who);
                Ok(())
            }
        };
        for (label, w, held_weight) in &writes {
            let touched = load::check_update(store, &w.weight, w.scale.as_ref(), block)
                .map_err(|e| e.context(label))?;
            if !held_weight {
                for i in touched {
                    claim(i, format!("`{}`", w.weight.name))?;
                }
            }
        }
        let mut new = Vec::with_capacity(hold.len());
        for (k, half, t) in hold {
            let u = &updates[k];
            let ctx = |e: Error| e.context(format!("{noun} entry {k}"));
            let dsts = match half {
                Half::Weight => {
                    let dsts = load::check_weight_awaiting_scale(store, u, block).map_err(ctx)?;
                    for &i in &dsts {
                        claim(i, format!("`{}`", u.name))?;
                    }
                    dsts
                }
                Half::Scale => {
                    load::check_scale_awaiting_weight(store, u, block).map_err(ctx)?;
                    Vec::new()
                }
            };
            new.push((half, t, (k, dsts)));
        }

        // 4. The chunk is valid: copy the halves that wait (only now, so a bad chunk copies
        //    nothing).
        let new = new
            .into_iter()
            .map(|(half, t, (k, dsts))| Ok((half, t, Held::copy_of(&updates[k], dsts, stage)?)))
            .collect::<Result<_>>()?;
        let writes = writes.into_iter().map(|(_, w, _)| w).collect();
        Ok((writes, HeldChange { completed, new }))
    }

    /// Applies the held-set change of a chunk that has been written.
    pub fn commit(&mut self, change: HeldChange) {
        for (half, t) in change.completed {
            match half {
                Half::Weight => self.weights.remove(&t),
                Half::Scale => self.scales.remove(&t),
            };
        }
        for (half, t, held) in change.new {
            let map = match half {
                Half::Weight => &mut self.weights,
                Half::Scale => &mut self.scales,
            };
            // `plan` pairs a half with a held partner instead of holding it, and refuses a
            // second scale or a second writer of the same weights.
            let replaced = map.insert(t, held);
            debug_assert!(replaced.is_none(), "a held refit entry was replaced");
        }
    }

    /// The error dsv4_refit_end returns while halves still wait: names every one of them.
    pub fn unpaired_error(&self) -> Option<Error> {
        if self.is_empty() {
            return None;
        }
        let waiting: Vec<String> = self
            .weights
            .iter()
            .map(|(t, h)| {
                format!(
                    "`{}` ({} codes of `{}`, waiting for its scale)",
                    h.name,
                    h.dtype.name(),
                    t.describe()
                )
            })
            .chain(self.scales.iter().map(|(t, h)| {
                format!(
                    "`{}` ({} block scale of `{}`, waiting for its weight)",
                    h.name,
                    h.dtype.name(),
                    t.describe()
                )
            }))
            .collect();
        let count = match waiting.len() {
            1 => "1 refit entry still lacks its partner".to_owned(),
            n => format!("{n} refit entries still lack their partner"),
        };
        Some(Error::new(
            Status::Tensor,
            format!(
                "dsv4_refit_end: {count}: {}; the refit stays open: send the missing entries with dsv4_refit, then call dsv4_refit_end again",
                waiting.join(", ")
            ),
        ))
    }
}
