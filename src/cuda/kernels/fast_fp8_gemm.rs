//! Rust side of the `fast_fp8_gemm` kernel family (kernels/fast_fp8_gemm.cu): the fast set's own
//! FP8 block-scaled GEMM for projections of many tokens (issue 12), on exactly the operands
//! cuBLASLt's block-scaled GEMM takes ([`GemmCall`]: e4m3 codes of the activations with an f32
//! scale per token and 128 of k, e4m3 weight codes with 128 x 128 f32 block scales, f32 or BF16
//! output),
//! so either runs from the same `fd_lt_operand_kernel` operand
//! ([`super::fast_dense_gemm`] picks). What it adds: a persistent kernel whose producer runs ahead
//! across tiles, so that a short K (1024: 8 blocks a tile) keeps the tensor cores fed while a
//! tile's outputs leave, and the outputs' bf16 rounding in its epilogue instead of a pass.
//!
//! The tensor maps of both operands are encoded on the host for each call and passed by value
//! ([`TmaMap`], a `__grid_constant__` parameter): no device memory, nothing to rebuild at refit
//! (a map holds the weight's address, which never moves), and a captured graph keeps them.

use super::fast_moe_gemm::{MAP_BYTES, TensorElem, encode_2d};
use super::{need, to_i32};
use crate::cuda::Context;
use crate::cuda::blockscaled_gemm::{GemmCall, GemmKind, GemmOut};
use crate::cuda::decl::TmaMapParam;
use crate::cuda::stream::{BorrowedStream, TMA_MAP_SLOTS, TmaMap};
use crate::error::{Error, Result, Status};
use std::ffi::c_void;

/// k of a stage: one 128-block of the scales.
pub const BLOCK_K: usize = 128;

/// A tile's tokens x outputs: the family's four entry points. Which is fastest for a shape is
/// measured (`dsv4 bench dense`'s `own_fp8_gemm_only*` lines).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TileShape {
    /// 128 x 128 (`ffg_gemm_kernel`): two consumer warpgroups.
    M128N128,
    /// 128 x 256 (`ffg_gemm_n256_kernel`): the activations cross L2 and shared memory half as
    /// often an output; the two 128-output halves run one after the other.
    M128N256,
    /// 192 x 128 (`ffg_gemm_m192_kernel`): three consumer warpgroups (one promotes while two
    /// keep the tensor cores busy), the weights cross L2 two thirds as often an output.
    M192N128,
    /// 128 x 256 in clusters of two blocks on adjacent token tiles (`ffg_gemm_pair_kernel`):
    /// each block loads half of the shared weight tile into both by a TMA multicast, so the
    /// weights cross L2 half as often as with [`TileShape::M128N256`].
    M128N256Pair,
}

impl TileShape {
    pub const ALL: [TileShape; 4] = [
        TileShape::M128N128,
        TileShape::M128N256,
        TileShape::M192N128,
        TileShape::M128N256Pair,
    ];

    /// Tokens of a tile (64 a consumer warpgroup).
    pub const fn tokens(self) -> usize {
        match self {
            TileShape::M192N128 => 192,
            _ => 128,
        }
    }

    /// Outputs of a tile.
    pub const fn outputs(self) -> usize {
        match self {
            TileShape::M128N256 | TileShape::M128N256Pair => 256,
            _ => 128,
        }
    }

    /// Blocks of a cluster (the pairs share their weight tile), 1 otherwise.
    pub const fn cluster(self) -> usize {
        match self {
            TileShape::M128N256Pair => 2,
            _ => 1,
        }
    }

    /// Weight rows of the weight's TMA box: a block's half of the tile in a pair, else the tile's.
    const fn weight_box_rows(self) -> usize {
        self.outputs() / self.cluster()
    }

    /// Threads of a block: the consumer warpgroups, then the producer warpgroup.
    pub const fn threads(self) -> usize {
        self.tokens() / 64 * 128 + 128
    }

    /// Slots of the ring (FFG_STAGES_M*_N*): as many as the shared memory holds. At K = 1024 a
    /// tile has 8 stages, so the ring holds most of the next tile when this one's epilogue
    /// starts.
    pub const fn stages(self) -> usize {
        match self {
            TileShape::M128N128 => 6,
            TileShape::M128N256 | TileShape::M128N256Pair => 4,
            TileShape::M192N128 => 5,
        }
    }

    /// Bytes of one slot: the tile's token codes and weight codes over 128 k, the tokens'
    /// scales and the weight rows' block scales, rounded up to the 128-byte swizzle's 1024.
    const fn slot_bytes(self) -> usize {
        (self.tokens() * BLOCK_K + self.outputs() * BLOCK_K + self.tokens() * 4 + 16).div_ceil(1024)
            * 1024
    }

    /// Shared memory of its ring and mbarriers.
    const fn smem_bytes(self) -> usize {
        self.stages() * self.slot_bytes() + 2 * self.stages() * 8
    }
}

/// What the kernel stores (FFG_OUT_*): the f32 sums, the f32 sums rounded to bf16 values (the
/// official output of a projection the model rounds), or their bf16 bits (half the bytes: what a
/// consumer reading BF16 would take; `dsv4 bench dense` measures it, the fast set reads f32).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(i32)]
pub enum OutMode {
    F32 = 0,
    F32Rounded = 1,
    Bf16 = 2,
}

/// The tile the fast set runs where it takes the call. Not yet measured against the others.
pub const DEFAULT_TILE: TileShape = TileShape::M128N128;

/// Dynamic shared memory of a block, the largest layout's (FFG_SMEM_BYTES; the kernel checks
/// each fits).
pub const SMEM_BYTES: usize = {
    let (a, b, c) = (
        TileShape::M128N128.smem_bytes(),
        TileShape::M128N256.smem_bytes(),
        TileShape::M192N128.smem_bytes(),
    );
    let ab = if a > b { a } else { b };
    if ab > c { ab } else { c }
};
const _: () = assert!(
    SMEM_BYTES <= 227 * 1024,
    "an sm_90 block takes at most 227 KiB"
);

crate::kernel_family! {
    /// The family as the registry compiles and loads it.
    pub const SOURCE = "fast_fp8_gemm", include_str!("../../../kernels/fast_fp8_gemm.cu");

    /// `y = Σ_b (a_b · W_bᵀ) · sa[b] · sw[b]` stored as `out` says ([`OutMode`]), [`GemmCall`]'s
    /// operands, tiles of 128 x 128; `a_map` / `w_map` over the codes ([`FastFp8Gemm::run`]
    /// encodes them). Grid: up to one block an SM, [`TileShape::threads`] threads.
    #[smem(SMEM_BYTES as u32)]
    #[pdl(true)]
    fn ffg_gemm_kernel(
        a_map: TmaMapParam, w_map: TmaMapParam, sa: *const f32, sw: *const f32, m: i32, n: i32,
        k: i32, out: i32, y: *mut c_void, ldy: i32,
    );
    /// The same with tiles of 128 x 256.
    #[smem(SMEM_BYTES as u32)]
    #[pdl(true)]
    fn ffg_gemm_n256_kernel(
        a_map: TmaMapParam, w_map: TmaMapParam, sa: *const f32, sw: *const f32, m: i32, n: i32,
        k: i32, out: i32, y: *mut c_void, ldy: i32,
    );
    /// The same with tiles of 192 x 128.
    #[smem(SMEM_BYTES as u32)]
    #[pdl(true)]
    fn ffg_gemm_m192_kernel(
        a_map: TmaMapParam, w_map: TmaMapParam, sa: *const f32, sw: *const f32, m: i32, n: i32,
        k: i32, out: i32, y: *mut c_void, ldy: i32,
    );
    /// The same with tiles of 128 x 256 in clusters of two (`w_map`'s boxes 128 rows).
    #[smem(SMEM_BYTES as u32)]
    #[pdl(true)]
    fn ffg_gemm_pair_kernel(
        a_map: TmaMapParam, w_map: TmaMapParam, sa: *const f32, sw: *const f32, m: i32, n: i32,
        k: i32, out: i32, y: *mut c_void, ldy: i32,
    );
}

crate::launchers! {
    /// The family's entry point, resolved from a loaded registry.
    pub struct FastFp8Gemm {
        m128n128: ffg_gemm_kernel,
        m128n256: ffg_gemm_n256_kernel,
        m192n128: ffg_gemm_m192_kernel,
        m128n256_pair: ffg_gemm_pair_kernel,
    }
}

/// A tensor map over a row-major `[rows, k]` matrix of e4m3 codes at `addr`: boxes of 128 bytes
/// x `box_rows` rows in the 128-byte swizzle (wgmma's K-major layout), rows past `rows` read as
/// zeros.
fn codes_map(addr: u64, rows: usize, k: usize, box_rows: usize) -> Result<TmaMap> {
    let boxd = [BLOCK_K as u32, box_rows as u32];
    let bytes: [u8; MAP_BYTES] = encode_2d(addr, TensorElem::U8, [k, rows], boxd, true)?;
    let mut words = [0u64; TMA_MAP_SLOTS];
    for (w, b) in words.iter_mut().zip(bytes.chunks_exact(8)) {
        *w = u64::from_ne_bytes(b.try_into().expect("8 bytes"));
    }
    Ok(TmaMap(words))
}

impl FastFp8Gemm {
    /// Whether the kernel with `tile` takes `call`: FP8 block-scaled with both scales, packed
    /// activation rows (`lda` = K), f32 or BF16 output, N a multiple of the tile's outputs, K of [`BLOCK_K`], m a positive multiple of 4
    /// (the scales' rows are copied 16 bytes at a time), the codes 16-byte aligned (TMA) and y's
    /// rows 8-byte aligned (the epilogue stores output pairs).
    pub fn takes(call: &GemmCall, tile: TileShape) -> bool {
        let s = &call.shape;
        s.kind == GemmKind::Fp8BlockScaled
            && matches!(s.out, GemmOut::F32 | GemmOut::Bf16)
            && call.wscale.is_some()
            && call.ascale.is_some()
            && s.n > 0
            && s.n.is_multiple_of(tile.outputs())
            && s.k > 0
            && s.k.is_multiple_of(BLOCK_K)
            && call.m > 0
            && call.m.is_multiple_of(4)
            && call.lda == s.k
            && call.ldy >= s.n
            && call.ldy.is_multiple_of(2)
            && call.y.addr().is_multiple_of(8)
            && call.a.addr().is_multiple_of(16)
            && call.w.addr().is_multiple_of(16)
            && call.ascale.is_some_and(|p| p.addr().is_multiple_of(16))
    }

    /// The tile the fast set runs `call` with: [`DEFAULT_TILE`] where it takes the call, else the
    /// first of [`TileShape::ALL`] that does, else None (cuBLASLt runs it).
    pub fn tile_for(call: &GemmCall) -> Option<TileShape> {
        std::iter::once(DEFAULT_TILE)
            .chain(TileShape::ALL)
            .find(|&tile| Self::takes(call, tile))
    }

    /// Enqueues `call` (which [`Self::takes`] must accept for `tile`): f32 outputs rounded to
    /// bf16 values when `round`, a BF16 output ([`GemmOut::Bf16`]) always rounded; one launch of
    /// up to one block an SM (a pair's clusters: two).
    pub fn run(
        &self,
        ctx: &Context,
        call: &GemmCall,
        tile: TileShape,
        round: bool,
        stream: BorrowedStream,
    ) -> Result<()> {
        const WHO: &str = "ffg_gemm_kernel";
        let (Some(ascale), Some(wscale)) = (call.ascale, call.wscale) else {
            return Err(Error::new(Status::Internal, format!("{WHO}: no scales")));
        };
        if !Self::takes(call, tile) {
            return Err(Error::new(
                Status::Internal,
                format!(
                    "{WHO}: a call it does not take with {tile:?} ({:?}, m = {}, ldy = {})",
                    call.shape, call.m, call.ldy
                ),
            ));
        }
        let (m, n, k) = (call.m, call.shape.n, call.shape.k);
        need(WHO, "a", call.a, m * k)?;
        need(WHO, "w", call.w, n * k)?;
        need(WHO, "ascale", ascale, k / BLOCK_K * m * 4)?;
        need(WHO, "wscale", wscale, n / 128 * (k / BLOCK_K) * 4)?;
        need(
            WHO,
            "y",
            call.y,
            ((m - 1) * call.ldy + n) * call.shape.out.size(),
        )?;
        let out = match (call.shape.out, round) {
            (GemmOut::Bf16, _) => OutMode::Bf16,
            (GemmOut::F32, true) => OutMode::F32Rounded,
            (GemmOut::F32, false) => OutMode::F32,
        } as i32;
        let (a_map, w_map) = (
            codes_map(call.a.addr(), m, k, tile.tokens())?,
            codes_map(call.w.addr(), n, k, tile.weight_box_rows())?,
        );
        let (m32, n32, k32) = (
            to_i32(WHO, "m", m)?,
            to_i32(WHO, "n", n)?,
            to_i32(WHO, "k", k)?,
        );
        let ldy = to_i32(WHO, "ldy", call.ldy)?;
        // Both entry points take the same arguments (their Args are two structs).
        macro_rules! args {
            ($kernel:ident) => {
                $kernel::Args {
                    a_map,
                    w_map,
                    sa: ascale,
                    sw: wscale,
                    m: m32,
                    n: n32,
                    k: k32,
                    out,
                    y: call.y,
                    ldy,
                }
            };
        }
        // Up to one block an SM; a pair's clusters take two token tiles each.
        let cl = tile.cluster();
        let units = m.div_ceil(tile.tokens()).div_ceil(cl) * (n / tile.outputs());
        let sms = ctx.info().multiprocessors.max(1) as usize;
        let grid = (cl * units.clamp(1, (sms / cl).max(1))) as u32;
        let (threads, smem) = (tile.threads() as u32, SMEM_BYTES as u32);
        let _g = ctx.enter()?;
        match tile {
            TileShape::M128N128 => {
                let args = args!(ffg_gemm_kernel);
                self.m128n128.launch(grid, threads, smem, stream, args)
            }
            TileShape::M128N256 => {
                let args = args!(ffg_gemm_n256_kernel);
                self.m128n256.launch(grid, threads, smem, stream, args)
            }
            TileShape::M192N128 => {
                let args = args!(ffg_gemm_m192_kernel);
                self.m192n128.launch(grid, threads, smem, stream, args)
            }
            TileShape::M128N256Pair => {
                let args = args!(ffg_gemm_pair_kernel);
                let c = (cl as u32, 1, 1);
                self.m128n256_pair
                    .launch_clustered(grid, threads, smem, stream, args, c)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 128 x 128: six slots of 33 KiB (two 16 KiB code tiles, 528 bytes of scales, rounded to
    /// 1 KiB) and twelve mbarriers; 128 x 256: four of 49 KiB; 192 x 128: five of 41 KiB, the
    /// largest, which the block takes. Each tile's token codes end on a 1024-byte boundary (the
    /// weight codes' swizzle), and the blocks have 384, 384 and 512 threads.
    #[test]
    fn rings_fit_and_slots_are_swizzle_aligned() {
        assert_eq!(TileShape::M128N128.smem_bytes(), 6 * 33 * 1024 + 96);
        assert_eq!(TileShape::M128N256.smem_bytes(), 4 * 49 * 1024 + 64);
        assert_eq!(TileShape::M192N128.smem_bytes(), 5 * 41 * 1024 + 80);
        assert_eq!(SMEM_BYTES, TileShape::M192N128.smem_bytes());
        for t in TileShape::ALL {
            assert_eq!((t.tokens() * BLOCK_K) % 1024, 0, "{t:?}");
        }
        let threads: Vec<usize> = TileShape::ALL.iter().map(|t| t.threads()).collect();
        assert_eq!(threads, [384, 384, 512, 384]);
        // A pair's blocks load half of the weight tile each.
        assert_eq!(
            TileShape::M128N256Pair.smem_bytes(),
            TileShape::M128N256.smem_bytes()
        );
        assert_eq!(TileShape::M128N256Pair.weight_box_rows(), 128);
        assert_eq!(TileShape::M128N256.weight_box_rows(), 256);
    }
}
