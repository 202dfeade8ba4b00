//! Rust side of the `indexer` kernel family (kernels/indexer.cu): typed launch wrappers.
//! See kernels/SPEC.md. The lightning indexer's scores and top-k selection, one block per
//! token; the CPU reference is `reference::attention::select_entries`.

use super::attention::BatchMeta;
use crate::cuda::kernels::{need, to_i32};
use crate::cuda::kv_pages::{KvPagesDev, RowKind};
use crate::cuda::stream::BorrowedStream;
use crate::cuda::{Context, DevicePtr};
use crate::error::{Error, Result, Status};

/// Largest dynamic shared memory of `indexer_kernel` (q of every head and a tile of keys as
/// f64, their per-head dots; afterwards the token's scores when they fit). 64 heads of 128
/// need 87.3 KB.
pub const INDEXER_MAX_SMEM: u32 = 96 * 1024;

crate::kernel_family! {
    /// The family as the registry compiles and loads it.
    pub const SOURCE = "indexer", include_str!("../../../kernels/indexer.cu");

    #[smem(INDEXER_MAX_SMEM)]
    #[pdl(true)]
    fn indexer_kernel(
        qi: *const f32, iw: *const f32, ikeys: *const u8, itable: Option<*const i32>, ipps: i32,
        positions: *const i32,
        seq_of: *const i32, seq_slots: *const i32, t: i32, hi: i32, di: i32, ratio: i32,
        topk: i32, maxe: i32, official: bool, scores: *mut f32, selected: *mut i32,
        nsel: *mut i32,
    );
}

const FAMILY: &str = "indexer";
const THREADS: u32 = 256;
/// Entries scored per tile (IDX_TILE in kernels/indexer.cu).
pub(crate) const TILE: usize = 16;

/// One CSA layer's indexer launch (kernels/SPEC.md `indexer_kernel`).
#[derive(Clone, Copy, Debug)]
pub struct IndexerArgs {
    /// Indexer queries [T, HI, DI] (after RoPE and the official quantisation).
    pub qi: DevicePtr,
    /// Head weights [T, HI], already scaled by DI^-1/2 * HI^-1/2.
    pub iw: DevicePtr,
    /// Indexer keys: `maxe` per slot.
    pub ikeys: KvPagesDev,
    pub heads: usize,
    pub dim: usize,
    pub ratio: usize,
    pub topk: usize,
    pub maxe: usize,
    pub num_slots: usize,
    pub official: bool,
    /// Workspace [T, maxe]: the scores (bf16 values if official).
    pub scores: DevicePtr,
    /// Output [T, topk] int: selected entries, best first (ties: lower index), -1 padded.
    pub selected: DevicePtr,
    /// Output `[T]` int: min(topk, visible entries).
    pub nsel: DevicePtr,
}

impl IndexerArgs {
    /// The checks every indexer launch of `t` tokens makes: shapes, buffer sizes, the keys'
    /// layout and format for the numerics.
    pub fn check(&self, family: &str, t: usize) -> Result<()> {
        let (hi, di) = (self.heads, self.dim);
        // maxe may be 0 (max_seq_len below the ratio): no key is ever visible, nothing selected.
        if hi == 0 || di == 0 || self.ratio == 0 || self.topk == 0 || self.num_slots == 0 {
            return Err(Error::new(
                Status::Internal,
                format!(
                    "{family}: {hi} heads of {di}, ratio {}, topk {}, maxe {}, {} slots",
                    self.ratio, self.topk, self.maxe, self.num_slots
                ),
            ));
        }
        if self.ikeys.rows.kind != RowKind::IndexKey || self.ikeys.rows.dim != di {
            return Err(Error::new(
                Status::Internal,
                format!("{family}: keys of {di} stored as {:?}", self.ikeys.rows),
            ));
        }
        need(family, "qi", self.qi, t * hi * di * 4)?;
        need(family, "iw", self.iw, t * hi * 4)?;
        self.ikeys
            .check(family, "ikeys", self.num_slots, self.maxe, self.official)?;
        need(family, "scores", self.scores, t * self.maxe * 4)?;
        need(family, "selected", self.selected, t * self.topk * 4)?;
        need(family, "nsel", self.nsel, t * 4)
    }

    /// Dynamic shared memory of the launch.
    pub fn smem_bytes(&self) -> usize {
        let st = self.dim.div_ceil(4) * 4 + 2;
        let base = (self.heads + TILE) * st * 8 + (TILE * self.heads + self.heads) * 4;
        // Room for every score too (the top-k then reads shared memory), when affordable.
        base.max((self.maxe * 4).min(INDEXER_MAX_SMEM as usize))
    }
}

crate::launchers! {
    /// The indexer family's entry point, resolved from a loaded registry.
    pub struct Indexer {
        indexer: indexer_kernel,
    }
}

impl Indexer {
    /// Scores every visible indexer key of each token's slot and selects the top
    /// min(topk, visible).
    pub fn select(
        &self,
        ctx: &Context,
        b: &BatchMeta,
        x: &IndexerArgs,
        stream: BorrowedStream,
    ) -> Result<()> {
        b.check(FAMILY)?;
        let (t, hi, di) = (b.num_tokens, x.heads, x.dim);
        x.check(FAMILY, t)?;
        let smem = x.smem_bytes();
        let limit = self.indexer.kernel().max_dynamic_smem;
        if smem > limit as usize {
            return Err(Error::new(
                Status::Capacity,
                format!(
                    "indexer: {hi} heads of {di} need {smem} bytes of shared memory, above {limit}"
                ),
            ));
        }
        let _g = ctx.enter()?;
        let args = indexer_kernel::Args {
            qi: x.qi,
            iw: x.iw,
            ikeys: x.ikeys.pool,
            itable: x.ikeys.table,
            ipps: to_i32(FAMILY, "pages per slot", x.ikeys.pages_per_slot)?,
            positions: b.positions,
            seq_of: b.seq_of,
            seq_slots: b.seq_slots,
            t: to_i32(FAMILY, "num_tokens", t)?,
            hi: to_i32(FAMILY, "heads", hi)?,
            di: to_i32(FAMILY, "dim", di)?,
            ratio: to_i32(FAMILY, "ratio", x.ratio)?,
            topk: to_i32(FAMILY, "topk", x.topk)?,
            maxe: to_i32(FAMILY, "maxe", x.maxe)?,
            official: x.official,
            scores: x.scores,
            selected: x.selected,
            nsel: x.nsel,
        };
        self.indexer
            .launch(t as u32, THREADS, smem as u32, stream, args)
    }
}
