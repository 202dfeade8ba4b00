//! `dsv4 bench dense`: the fast set's dense projections (kernels/fast_dense.cu, issue 12) alone at
//! Flash shapes, on random weights in their stored formats (FP8 codes with 128 x 128 power-of-two
//! scales; BF16). One JSON line per (projection, T): time per call, weight bytes read, GB/s,
//! TFLOP/s, the K split, launches per call. bench/dense_baseline.py measures the HBM and FP8
//! ceilings and PyTorch on the same shapes in the same run and adds floors and ratios.
//!
//! Up to 16 tokens each case runs twice: the activation operands made inside the gemv blocks
//! (`act_in_gemv`, what the fast set does up to `FUSED_ACT_MAX_T` tokens) and by `fd_act_kernel`
//! first. From `blockscaled_gemm::MIN_M` tokens, the projections cuBLASLt takes (all but wo_a's
//! grouped einsum) also run the GEMM path (`path: "cublaslt"`: operand kernel, cuBLASLt, BF16
//! rounding where the model rounds: the whole call, as the fast set runs it) and the cuBLASLt
//! GEMM alone (`"cublaslt_gemm_only"`, and `"cublaslt_gemm_only_bf16_out"` writing BF16
//! instead of f32: what a consumer reading BF16 would save); the FP8 ones our own GEMM takes also
//! run the GEMM path with it (`"own_fp8_gemm"`: operand kernel, kernels/fast_fp8_gemm.cu with the
//! rounding in its epilogue, the fast set's tile) and it alone (`"own_fp8_gemm_only"`, tiles of
//! 128 x 128, `"own_fp8_gemm_only_n256"`, 128 x 256, `"own_fp8_gemm_only_m192"`, 192 x 128,
//! `"own_fp8_gemm_only_pair"`, 128 x 256 in clusters of two sharing the weight tile; f32 out:
//! cuBLASLt-alone's work; `"own_fp8_gemm_only_bf16_out"`, the default tile writing BF16); the gemv
//! lines are `path: "gemv"`.
//! Together they are the crossover table (which path the fast set should take at each T).
//! `--lt-candidates N` adds `dense_lt_candidate` lines: cuBLASLt alone with each of its first N
//! algorithms for the shape, both outputs.
//!
//! `--projection groups` (and the default, after the projections): the grouped launches the fast
//! set runs up to `GROUP_MAX_T` tokens, a CSA layer's seven projections of its input u and its two
//! of q_lora, one JSON line per (group, T, path): `grouped` (one launch) and `separate` (one
//! call per member, as without grouping), with the members' weight bytes and GB/s; from
//! `GEMM_MIN_TOKENS`, `gemm_shared` (cuBLASLt with one operand per input and mode, as the fast set
//! runs a group of many tokens) and `gemm_separate` (one call per member), with TFLOP/s, each
//! also with the FP8 members through our own GEMM (`_own_fp8` suffix).
//!
//! `--projection output_chain` (and the default, after the groups): wo_a then wo_b chained, wo_b's
//! act_quant made by the pass that finishes wo_a, against the two calls (bench_dense_chain.rs).
//!
//! Timing: each case captures one call on each of R copies of the weight (together at least
//! 256 MB, so the 50 MB L2 holds none of them between calls) into a CUDA graph, replays it G
//! times between CUDA events (bench_util::time_graph), and reports the median replay / R
//! (`time_us`; the host clock's beside it, `host_time_us`).

use std::io::Write;

use crate::bench_dense_chain;
use crate::bench_util::{GraphTiming, Rng, alloc, e, kernel_cache, time_graph};
use dsv4::cuda::arena;
use dsv4::cuda::blockscaled_gemm::{self, BlockScaledGemm, GemmCall, GemmKind, GemmOut, GemmShape};
use dsv4::cuda::context::Context;
use dsv4::cuda::kernels::fast_dense::{
    self, ActMode, DenseOp, DenseWorkspace, FastDense, Shape, TOKENS,
};
use dsv4::cuda::kernels::fast_dense_gemm::{self, GemmWorkspace};
use dsv4::cuda::kernels::fast_fp8_gemm::{self, FastFp8Gemm, TileShape};
use dsv4::cuda::kernels::linear::{StorageFormat, WeightDev};
use dsv4::cuda::kernels::norm_rope::{self, NormRope, RmsNorm};
use dsv4::cuda::read_probe::{self, ReadProbe};
use dsv4::cuda::registry::Registry;
use dsv4::cuda::stream::OwnedStream;

/// One projection as the fast set runs it in a Flash layer.
pub(crate) struct Projection {
    pub(crate) name: &'static str,
    pub(crate) n: usize,
    pub(crate) k: usize,
    pub(crate) groups: usize,
    pub(crate) format: StorageFormat,
    pub(crate) mode: ActMode,
    pub(crate) round: bool,
}

/// Flash's dense projections (hidden 4096, q_lora 1024, 64 heads x 512, 8 output groups of
/// 1024, indexer 64 x 128, overlapping compressors) and the LM head (vocab 129280).
#[rustfmt::skip]
pub(crate) const FLASH: &[Projection] = &[
    Projection { name: "wq_a", n: 1024, k: 4096, groups: 1, format: FP8, mode: ActMode::Quant, round: true },
    // (wq_b's bf16 rounding is done by head_prep_kernel as it loads q: the call itself does not round.)
    Projection { name: "wq_b", n: 32768, k: 1024, groups: 1, format: FP8, mode: ActMode::Quant, round: false },
    Projection { name: "wkv", n: 512, k: 4096, groups: 1, format: FP8, mode: ActMode::Quant, round: true },
    Projection { name: "wo_a", n: 1024, k: 4096, groups: 8, format: FP8, mode: ActMode::F16, round: true },
    Projection { name: "wo_b", n: 4096, k: 8192, groups: 1, format: FP8, mode: ActMode::Quant, round: true },
    // (The indexer's wq_b: rounded by rope_kernel as it loads qi.)
    Projection { name: "indexer.wq_b", n: 8192, k: 1024, groups: 1, format: FP8, mode: ActMode::Quant, round: false },
    Projection { name: "compressor.wkv", n: 1024, k: 4096, groups: 1, format: BF16, mode: ActMode::Bf16, round: false },
    Projection { name: "indexer.weights_proj", n: 64, k: 4096, groups: 1, format: BF16, mode: ActMode::Bf16, round: true },
    Projection { name: "head", n: 129280, k: 4096, groups: 1, format: BF16, mode: ActMode::Bf16, round: false },
];

/// The groups of projections one input feeds in a CSA layer (kernel_sets/reference/
/// attention_block.rs `input_projections` and `query`).
#[rustfmt::skip]
const GROUPS: &[(&str, &[Projection])] = &[
    ("u (CSA layer)", &[
        Projection { name: "wq_a", n: 1024, k: 4096, groups: 1, format: FP8, mode: ActMode::Quant, round: true },
        Projection { name: "wkv", n: 512, k: 4096, groups: 1, format: FP8, mode: ActMode::Quant, round: true },
        Projection { name: "compressor.wkv", n: 1024, k: 4096, groups: 1, format: BF16, mode: ActMode::Bf16, round: false },
        Projection { name: "compressor.wgate", n: 1024, k: 4096, groups: 1, format: BF16, mode: ActMode::Bf16, round: false },
        Projection { name: "indexer.compressor.wkv", n: 256, k: 4096, groups: 1, format: BF16, mode: ActMode::Bf16, round: false },
        Projection { name: "indexer.compressor.wgate", n: 256, k: 4096, groups: 1, format: BF16, mode: ActMode::Bf16, round: false },
        Projection { name: "indexer.weights_proj", n: 64, k: 4096, groups: 1, format: BF16, mode: ActMode::Bf16, round: true },
    ]),
    ("q_lora (CSA layer)", &[
        Projection { name: "wq_b", n: 32768, k: 1024, groups: 1, format: FP8, mode: ActMode::Quant, round: false },
        Projection { name: "indexer.wq_b", n: 8192, k: 1024, groups: 1, format: FP8, mode: ActMode::Quant, round: false },
    ]),
];

const FP8: StorageFormat = StorageFormat::Fp8;
const BF16: StorageFormat = StorageFormat::Bf16;

impl Projection {
    pub(crate) fn rows(&self) -> usize {
        self.n * self.groups
    }

    /// Bytes the kernels read of the weight: codes or values, and FP8's f32 block scales.
    pub(crate) fn weight_bytes(&self) -> usize {
        let (r, k) = (self.rows(), self.k);
        match self.format {
            StorageFormat::Fp8 => r * k + r.div_ceil(128) * (k / 128) * 4,
            _ => r * k * 2,
        }
    }

    fn format_name(&self) -> &'static str {
        match self.format {
            StorageFormat::Fp8 => "fp8",
            _ => "bf16",
        }
    }
}

/// How a case runs the projection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Path {
    /// The gemv kernels, the operands made inside the gemv blocks or by fd_act_kernel first, K
    /// split inside the blocks where `fast_dense::warp_split` takes the launch (`warp_split`:
    /// the default) or never (across blocks, path `gemv_cross_split`).
    Gemv { fused: bool, warp_split: bool },
    /// The fast set's GEMM path: operand kernel, cuBLASLt and its BF16 rounding pass (`own`:
    /// false), or our FP8 GEMM with the rounding in its epilogue (`own`: true, FP8 shapes only).
    Gemm { own: bool },
    /// Our FP8 GEMM alone with tiles of `tile` on an operand made beforehand, writing f32 without
    /// rounding (the same work as `GemmOnly { bf16_out: false }`) or, with `bf16_out`, BF16 (as
    /// `GemmOnly { bf16_out: true }`; the default tile only).
    OwnOnly { tile: TileShape, bf16_out: bool },
    /// cuBLASLt alone on an operand made beforehand, writing f32 (`bf16_out`: false, what the
    /// fast set runs) or BF16 (what a consumer reading BF16 would let the call write instead of
    /// f32 and its rounding pass).
    GemmOnly { bf16_out: bool },
}

impl Path {
    fn name(self) -> &'static str {
        match self {
            Path::Gemv {
                warp_split: false, ..
            } => "gemv_cross_split",
            Path::Gemv { .. } => "gemv",
            Path::Gemm { own: false } => "cublaslt",
            Path::Gemm { own: true } => "own_fp8_gemm",
            Path::OwnOnly {
                tile: TileShape::M128N128,
                bf16_out: false,
            } => "own_fp8_gemm_only",
            Path::OwnOnly {
                tile: TileShape::M128N256,
                bf16_out: false,
            } => "own_fp8_gemm_only_n256",
            Path::OwnOnly {
                tile: TileShape::M192N128,
                bf16_out: false,
            } => "own_fp8_gemm_only_m192",
            Path::OwnOnly {
                tile: TileShape::M128N256Pair,
                bf16_out: false,
            } => "own_fp8_gemm_only_pair",
            Path::OwnOnly { bf16_out: true, .. } => "own_fp8_gemm_only_bf16_out",
            Path::GemmOnly { bf16_out: false } => "cublaslt_gemm_only",
            Path::GemmOnly { bf16_out: true } => "cublaslt_gemm_only_bf16_out",
        }
    }
}

/// What a GEMM-alone line writes.
fn out_of(bf16_out: bool) -> GemmOut {
    if bf16_out {
        GemmOut::Bf16
    } else {
        GemmOut::F32
    }
}

/// An FP8 weight's 128 x 128 block scales: powers of two from 2^-12 to 2^-4.
pub(crate) fn block_scales(rng: &mut Rng, p: &Projection) -> Vec<f32> {
    let nsc = p.rows().div_ceil(128) * (p.k / 128);
    (0..nsc)
        .map(|_| 2f32.powi(-4 - (rng.next() % 9) as i32))
        .collect()
}

/// Weight bytes as stored: FP8 codes (no NaN) or BF16 values ~ N(0, 0.05) like real weights.
pub(crate) fn weight_data(rng: &mut Rng, p: &Projection) -> Vec<u8> {
    let n = p.rows() * p.k;
    match p.format {
        StorageFormat::Fp8 => (0..n)
            .map(|_| {
                let c = (rng.next() & 0xff) as u8;
                if c & 0x7f == 0x7f { c & 0xf7 } else { c }
            })
            .collect(),
        _ => (0..n)
            .flat_map(|_| {
                let v = (rng.unit() - 0.5) * 0.17;
                half::bf16::from_f32(v).to_bits().to_le_bytes()
            })
            .collect(),
    }
}

pub fn run(
    device: i32,
    tokens: &[usize],
    only: Option<&str>,
    read_probe_blocks: &[usize],
    lt_candidates: usize,
) -> Result<(), String> {
    let ctx = Context::retain(device).map_err(e)?;
    let _g = ctx.enter().map_err(e)?;
    let stream = OwnedStream::new(&ctx).map_err(e)?;
    let s = stream.borrow();
    let families: Vec<_> = [
        &fast_dense::SOURCE,
        &fast_fp8_gemm::SOURCE,
        &read_probe::SOURCE,
    ]
    .into_iter()
    .chain(norm_rope::FAMILIES)
    .collect();
    let reg = Registry::load_families(&ctx, &families, &kernel_cache()?).map_err(e)?;
    let dense = FastDense::new(&reg).map_err(e)?;
    let nr = NormRope::new(&reg).map_err(e)?;
    let own = FastFp8Gemm::new(&reg).map_err(e)?;
    let probe = ReadProbe::new(&reg).map_err(e)?;
    let sms = ctx.info().multiprocessors.max(1) as usize;
    // A word a probe block: the most blocks of a linear probe, or of a row probe (a block a 128-row
    // tile of the largest projection).
    let probe_blocks = (sms * read_probe_blocks.iter().copied().max().unwrap_or(1)).max(
        FLASH
            .iter()
            .map(|p| p.rows().div_ceil(128))
            .max()
            .unwrap_or(1),
    );
    let (_sink_arena, sink) = alloc(&ctx, "bench_dense", &[4 * probe_blocks])?;
    let shapes: Vec<Shape> = FLASH
        .iter()
        .map(|p| Shape {
            n: p.n,
            k: p.k,
            groups: p.groups,
        })
        .collect();
    let [act, scale, part, count] = fast_dense::workspace_sizes(&shapes);
    let (_ws_arena, wp) = alloc(
        &ctx,
        "bench_dense",
        &[act * 2, scale * 4, part * 4, count * 4],
    )?;
    let ws = DenseWorkspace {
        act: wp[0],
        scale: wp[1],
        split_part: wp[2],
        split_count: wp[3],
    };
    let tmax = tokens.iter().copied().max().unwrap_or(1);
    let gemm_shape = |p: &Projection| {
        fast_dense_gemm::gemm_shape(p.format, [128, 128], p.rows(), p.k, p.groups, p.mode)
    };
    // Each shape also with a BF16 output, for the GemmOnly { bf16_out } lines.
    let mut gemm_shapes: Vec<GemmShape> = FLASH
        .iter()
        .chain(GROUPS.iter().flat_map(|(_, members)| members.iter()))
        .filter_map(gemm_shape)
        .flat_map(|s| {
            [
                s,
                GemmShape {
                    out: GemmOut::Bf16,
                    ..s
                },
            ]
        })
        .collect();
    gemm_shapes.sort_by_key(|g| (g.n, g.k, g.kind as u8, g.out as u8));
    gemm_shapes.dedup();
    // Room for a norm's two operands of each group's input (`norm_group` lines).
    let norm_ks: Vec<usize> = GROUPS.iter().map(|(_, members)| members[0].k).collect();
    let [codes, gscale] = fast_dense_gemm::gemm_workspace_sizes(&gemm_shapes, tmax, &norm_ks);
    let grouped: Vec<_> = FLASH.iter().map(|p| (p.n, p.k, p.groups)).collect();
    let gweight = fast_dense_gemm::gemm_weight_bytes(&grouped);
    let (_gemm_arena, gp) = alloc(
        &ctx,
        "bench_dense",
        &[
            codes.max(1),
            gscale.max(1) * 4,
            blockscaled_gemm::WORKSPACE_BYTES,
            gweight.max(1),
        ],
    )?;
    let gws = GemmWorkspace {
        codes: gp[0],
        scale: gp[1],
        weight: gp[3],
    };
    let gemm = match BlockScaledGemm::new(&ctx, &gemm_shapes, tmax, gp[2]) {
        Ok(g) => Some(g),
        Err(err) => {
            eprintln!("bench dense: no cuBLASLt GEMM path: {}", err.message);
            None
        }
    };
    let mut rng = Rng(0x5EED_D15E);
    if only.is_none_or(|o| o == "groups") {
        for (name, members) in GROUPS {
            let lt = gemm.as_ref().map(|g| (g, &gws));
            run_group(
                &ctx, &dense, &nr, &ws, lt, &own, s, &mut rng, name, members, tokens,
            )?;
        }
    }
    if let Some(g) = gemm
        .as_ref()
        .filter(|_| only.is_none_or(|o| o == "output_chain"))
    {
        bench_dense_chain::run(&ctx, &dense, &ws, (g, &gws), &own, s, &mut rng, tokens)?;
    }
    for p in FLASH.iter().filter(|p| only.is_none_or(|o| o == p.name)) {
        let wbytes = p.weight_bytes();
        let copies = (256usize << 20).div_ceil(wbytes).clamp(2, 64);
        let data = weight_data(&mut rng, p);
        let scales = block_scales(&mut rng, p);
        let nsc = scales.len();
        let width = p.groups * p.k;
        let fp8_weight = p.format == StorageFormat::Fp8;
        let outs = p.groups * p.n;
        let mut sizes = vec![data.len(); copies];
        sizes.extend([nsc * 4, tmax * width * 4, tmax * outs * 4]);
        let (_arena, bufs) = alloc(&ctx, "bench_dense", &sizes)?;
        for b in &bufs[..copies] {
            arena::copy_to_device_sync(*b, &data, s).map_err(e)?;
        }
        let (sc, x, y) = (bufs[copies], bufs[copies + 1], bufs[copies + 2]);
        arena::copy_to_device_sync(sc, &scales, s).map_err(e)?;
        let xs: Vec<f32> = (0..tmax * width)
            .map(|_| half::bf16::from_f32(rng.unit() * 4.0 - 2.0).to_f32())
            .collect();
        arena::copy_to_device_sync(x, &xs, s).map_err(e)?;
        let weight = |j: usize| WeightDev {
            format: p.format,
            data: bufs[j].slice(0, data.len()).unwrap(),
            scales: (p.format == StorageFormat::Fp8).then(|| sc.slice(0, nsc * 4).unwrap()),
            block: [128, 128],
            rows: p.rows(),
            cols: p.k,
        };
        // The operands made inside the gemv (as the fast set does up to FUSED_ACT_MAX_T tokens)
        // and by fd_act_kernel first, both timed up to 16 tokens.
        let gshape = gemm_shape(p);
        let gemm_at = |t: usize| gemm.as_ref().zip(gshape).filter(|(g, s)| g.covers(s, t));
        // cuBLASLt alone at t tokens on weight copy j, on the operand made beforehand in gws.
        let lt_call = |shape: GemmShape, t: usize, j: usize| {
            let fp8 = shape.kind == GemmKind::Fp8BlockScaled;
            let w = weight(j);
            GemmCall {
                shape,
                m: t,
                w: w.data,
                wscale: if fp8 { w.scales } else { None },
                a: gws.codes,
                lda: shape.k,
                ascale: fp8.then_some(gws.scale),
                y,
                ldy: outs,
            }
        };
        let variants = tokens.iter().flat_map(|&t| {
            [
                (
                    t,
                    Path::Gemv {
                        fused: true,
                        warp_split: true,
                    },
                ),
                (
                    t,
                    Path::Gemv {
                        fused: false,
                        warp_split: true,
                    },
                ),
                (
                    t,
                    Path::Gemv {
                        fused: t <= fast_dense::FUSED_ACT_MAX_T,
                        warp_split: false,
                    },
                ),
                (t, Path::Gemm { own: false }),
                (t, Path::Gemm { own: true }),
                (
                    t,
                    Path::OwnOnly {
                        tile: TileShape::M128N128,
                        bf16_out: false,
                    },
                ),
                (
                    t,
                    Path::OwnOnly {
                        tile: TileShape::M128N256,
                        bf16_out: false,
                    },
                ),
                (
                    t,
                    Path::OwnOnly {
                        tile: TileShape::M192N128,
                        bf16_out: false,
                    },
                ),
                (
                    t,
                    Path::OwnOnly {
                        tile: TileShape::M128N256Pair,
                        bf16_out: false,
                    },
                ),
                (
                    t,
                    Path::OwnOnly {
                        tile: fast_fp8_gemm::DEFAULT_TILE,
                        bf16_out: true,
                    },
                ),
                (t, Path::GemmOnly { bf16_out: false }),
                (t, Path::GemmOnly { bf16_out: true }),
            ]
            .into_iter()
            .filter(move |&(t, path)| match path {
                Path::Gemv {
                    fused,
                    warp_split: true,
                } => t <= 16 || !fused,
                // Beside the default only where it would split K inside the blocks.
                Path::Gemv {
                    warp_split: false, ..
                } => {
                    let sl = fast_dense::slices(p.n, p.k, p.groups).unwrap_or(1);
                    p.groups == 1
                        && fast_dense::warp_split(
                            t,
                            p.n.div_ceil(fast_dense::ROWS),
                            sl,
                            p.k,
                            p.format == StorageFormat::Fp8,
                            fast_dense::WARP_SPLIT_MAX_T,
                        )
                }
                // (A grouped weight's GEMMs take the operand and weight of each group in turn:
                // no GEMM-only timing.)
                Path::GemmOnly { .. } if p.groups > 1 => false,
                Path::Gemm { own: false } | Path::GemmOnly { bf16_out: false } => {
                    t >= blockscaled_gemm::MIN_M
                        && t.is_multiple_of(fast_dense_gemm::M_GRANULE)
                        && gemm_at(t).is_some()
                }
                // Where our kernel takes the call the GEMM path makes.
                Path::Gemm { own: true } => {
                    t >= blockscaled_gemm::MIN_M
                        && t.is_multiple_of(fast_dense_gemm::M_GRANULE)
                        && p.groups == 1
                        && gemm_at(t).is_some_and(|(_, s)| {
                            FastFp8Gemm::tile_for(&lt_call(s, t, 0)).is_some()
                        })
                }
                Path::OwnOnly { tile, .. } => {
                    t >= blockscaled_gemm::MIN_M
                        && t.is_multiple_of(fast_dense_gemm::M_GRANULE)
                        && p.groups == 1
                        && gemm_at(t)
                            .is_some_and(|(_, s)| FastFp8Gemm::takes(&lt_call(s, t, 0), tile))
                }
                // Only where cuBLASLt has an algorithm for the BF16 output too.
                Path::GemmOnly { bf16_out: true } => {
                    t >= blockscaled_gemm::MIN_M
                        && t.is_multiple_of(fast_dense_gemm::M_GRANULE)
                        && gemm_at(t).is_some_and(|(g, s)| {
                            g.covers(
                                &GemmShape {
                                    out: GemmOut::Bf16,
                                    ..s
                                },
                                t,
                            )
                        })
                }
            })
        });
        for (t, path) in variants {
            let fused = matches!(path, Path::Gemv { fused: true, .. });
            let warp_split = !matches!(
                path,
                Path::Gemv {
                    warp_split: false,
                    ..
                }
            );
            let op_of = |j: usize| DenseOp {
                x,
                ldx: width,
                t,
                w: weight(j),
                groups: p.groups,
                mode: p.mode,
                round: p.round,
                y,
                ldy: outs,
                fused_act_max_t: if fused { TOKENS } else { 0 },
                warp_split_max_t: if warp_split {
                    fast_dense::WARP_SPLIT_MAX_T
                } else {
                    0
                },
            };
            if matches!(path, Path::GemmOnly { .. } | Path::OwnOnly { .. }) {
                // The operand once, outside the timing: each replay is the GEMM alone.
                let (g, _) = gemm_at(t).unwrap();
                if !fast_dense_gemm::run_gemm(&dense, g, None, &ctx, &op_of(0), &gws, &ws, s)
                    .map_err(e)?
                {
                    return Err(format!("{}: T={t}: the GEMM path declined", p.name));
                }
            }
            let call = |j: usize| -> dsv4::Result<()> {
                match path {
                    Path::Gemv { .. } => dense.run(&ctx, &op_of(j), &ws, s),
                    Path::Gemm { own: use_own } => {
                        let (g, _) = gemm_at(t).unwrap();
                        let o = use_own.then_some(&own);
                        if fast_dense_gemm::run_gemm(&dense, g, o, &ctx, &op_of(j), &gws, &ws, s)? {
                            Ok(())
                        } else {
                            Err(dsv4::Error::new(
                                dsv4::Status::Internal,
                                format!("{} at T={t}: the GEMM path declined", p.name),
                            ))
                        }
                    }
                    Path::OwnOnly { tile, bf16_out } => {
                        let (_, shape) = gemm_at(t).unwrap();
                        let call = lt_call(
                            GemmShape {
                                out: out_of(bf16_out),
                                ..shape
                            },
                            t,
                            j,
                        );
                        own.run(&ctx, &call, tile, false, s)
                    }
                    Path::GemmOnly { bf16_out } => {
                        let (g, shape) = gemm_at(t).unwrap();
                        let call = lt_call(
                            GemmShape {
                                out: out_of(bf16_out),
                                ..shape
                            },
                            t,
                            j,
                        );
                        if g.run(&ctx, &call, s)? {
                            Ok(())
                        } else {
                            Err(dsv4::Error::new(
                                dsv4::Status::Internal,
                                "cuBLASLt declined",
                            ))
                        }
                    }
                }
            };
            let replays = 21;
            let timing = time_graph(s, copies, replays, call)?;
            let sec = timing.device_s;
            let flops = 2.0 * t as f64 * (p.rows() * p.k) as f64;
            println!(
                "{{\"bench\": \"dense\", \"projection\": \"{}\", \"format\": \"{}\", \"T\": {t}, \"N\": {}, \"K\": {}, \"groups\": {}, \"slices\": {}, \"path\": \"{}\", \"act_in_gemv\": {fused}, \"time_us\": {:.2}, \"host_time_us\": {:.2}, \"weight_bytes\": {wbytes}, \"gb_per_s\": {:.1}, \"tflop_per_s\": {:.2}, \"flops\": {flops:.4e}, \"launches_per_call\": {}, \"calls_timed\": {}}}",
                p.name,
                p.format_name(),
                p.n,
                p.k,
                p.groups,
                fast_dense::slices(p.n, p.k, p.groups).unwrap_or(0),
                path.name(),
                sec * 1e6,
                timing.host_s * 1e6,
                wbytes as f64 / sec / 1e9,
                flops / sec / 1e12,
                match path {
                    Path::Gemv { fused, .. } => t.div_ceil(TOKENS) * if fused { 1 } else { 2 },
                    // Ours, plus cuBLASLt's (one kernel, or two with a split-K reduction); a
                    // grouped weight: dequantization, operand and GEMM a group, one rounding.
                    Path::Gemm { .. } if p.groups > 1 => 3 * p.groups + usize::from(p.round),
                    Path::Gemm { own: false } => 2 + usize::from(p.round),
                    Path::Gemm { own: true } => 2,
                    Path::GemmOnly { .. } | Path::OwnOnly { .. } => 1,
                },
                replays * copies,
            );
            std::io::stdout().flush().ok();
        }
        // `--lt-candidates N`: cuBLASLt alone with each of its first N algorithms for the shape
        // (both outputs), against the planned first choice (`cublaslt_gemm_only` above).
        for &t in tokens.iter().filter(|_| lt_candidates > 0 && p.groups == 1) {
            let Some((g, shape)) = gemm_at(t) else {
                continue;
            };
            if t < blockscaled_gemm::MIN_M || !t.is_multiple_of(fast_dense_gemm::M_GRANULE) {
                continue;
            }
            let op = DenseOp {
                x,
                ldx: width,
                t,
                w: weight(0),
                groups: 1,
                mode: p.mode,
                round: p.round,
                y,
                ldy: outs,
                fused_act_max_t: 0,
                warp_split_max_t: 0,
            };
            // The operand once, outside the timing.
            if !fast_dense_gemm::run_gemm(&dense, g, None, &ctx, &op, &gws, &ws, s).map_err(e)? {
                continue;
            }
            for out in [GemmOut::F32, GemmOut::Bf16] {
                let shape = GemmShape { out, ..shape };
                for (i, algo) in g
                    .candidates(&shape, t, lt_candidates)
                    .map_err(e)?
                    .into_iter()
                    .enumerate()
                {
                    let call = |j: usize| -> dsv4::Result<()> {
                        if g.run_with(&ctx, &lt_call(shape, t, j), Some(algo), s)? {
                            Ok(())
                        } else {
                            Err(dsv4::Error::new(dsv4::Status::Internal, "declined"))
                        }
                    };
                    // A candidate that does not take this exact call (workspace, alignment) is
                    // reported as such, not timed.
                    let timing = match time_graph(s, copies, 21, call) {
                        Ok(tm) => tm,
                        Err(why) => {
                            println!(
                                "{{\"bench\": \"dense_lt_candidate\", \"projection\": \"{}\", \"T\": {t}, \"bf16_out\": {}, \"candidate\": {i}, \"error\": {:?}}}",
                                p.name,
                                out == GemmOut::Bf16,
                                why
                            );
                            continue;
                        }
                    };
                    let sec = timing.device_s;
                    let flops = 2.0 * t as f64 * (p.rows() * p.k) as f64;
                    println!(
                        "{{\"bench\": \"dense_lt_candidate\", \"projection\": \"{}\", \"format\": \"{}\", \"T\": {t}, \"N\": {}, \"K\": {}, \"bf16_out\": {}, \"candidate\": {i}, \"time_us\": {:.2}, \"tflop_per_s\": {:.2}, \"flops\": {flops:.4e}}}",
                        p.name,
                        p.format_name(),
                        p.n,
                        p.k,
                        out == GemmOut::Bf16,
                        sec * 1e6,
                        flops / sec / 1e12,
                    );
                    std::io::stdout().flush().ok();
                }
            }
        }
        // One read_probe line: `fields` say which probe, `call` runs it on weight copy j.
        let time_probe = |fields: String, call: &dyn Fn(usize) -> dsv4::Result<()>| {
            let replays = 21;
            let timing = time_graph(s, copies, replays, call)?;
            let sec = timing.device_s;
            println!(
                "{{\"bench\": \"read_probe\", \"projection\": \"{}\", \"bytes\": {wbytes}, {fields}, \"threads\": {}, \"time_us\": {:.2}, \"host_time_us\": {:.2}, \"gb_per_s\": {:.1}, \"calls_timed\": {}}}",
                p.name,
                read_probe::THREADS,
                sec * 1e6,
                timing.host_s * 1e6,
                wbytes as f64 / sec / 1e9,
                replays * copies,
            );
            std::io::stdout().flush().ok();
            Ok::<(), String>(())
        };
        // The gemv's own order of reads without its work (one group, FP8, one slice), its
        // blocks kept to 2 an SM as the gemv's registers keep them.
        if !read_probe_blocks.is_empty()
            && p.groups == 1
            && fp8_weight
            && p.k <= fast_dense::MAX_SLICE
        {
            for (order, order_name) in read_probe::ROW_ORDERS {
                time_probe(
                    format!(
                        "\"order\": \"{order_name}\", \"blocks_per_sm\": 2, \"exclusive\": true, \"loads_in_flight\": 16"
                    ),
                    &|j| probe.run_rows(&ctx, bufs[j], p.k, p.n, order, 2, sink[0], s),
                )?;
            }
        }
        // The same bytes read by nothing but streaming loads (the size's practical ceiling),
        // with the next call's blocks free to start beside this call's or kept out (`exclusive`).
        for &per_sm in read_probe_blocks {
            for exclusive in [false, true] {
                for in_flight in read_probe::IN_FLIGHT {
                    let blocks = (per_sm * sms) as u32;
                    let excl = exclusive.then_some(per_sm as u32);
                    time_probe(
                        format!(
                            "\"order\": \"linear\", \"blocks_per_sm\": {per_sm}, \"exclusive\": {exclusive}, \"loads_in_flight\": {in_flight}"
                        ),
                        &|j| {
                            probe.run(
                                &ctx,
                                bufs[j],
                                data.len(),
                                in_flight,
                                blocks,
                                sink[0],
                                excl,
                                s,
                            )
                        },
                    )?;
                }
            }
        }
    }
    Ok(())
}

/// Times one group of projections of the same input: at every T up to `GROUP_MAX_T`, one grouped
/// launch against one call per member; from `GEMM_MIN_TOKENS` (with cuBLASLt), the GEMMs with one
/// operand per input and mode (`gemm_shared`, `run_gemm_group`, as the fast set runs a group)
/// against one call per member (`gemm_separate`), each member on the path the fast set picks;
/// where `fd_norm_operands_kernel` takes the input's norm, that norm with the group (`norm_group`:
/// the norm makes the operands, as the fast set runs the attention's norms of many tokens)
/// against the norm, then `gemm_shared` (`norm_then_group`).
#[allow(clippy::too_many_arguments)]
fn run_group(
    ctx: &Context,
    dense: &FastDense,
    nr: &NormRope,
    ws: &DenseWorkspace,
    lt: Option<(&BlockScaledGemm, &GemmWorkspace)>,
    own: &FastFp8Gemm,
    s: dsv4::cuda::stream::BorrowedStream,
    rng: &mut Rng,
    name: &str,
    members: &[Projection],
    tokens: &[usize],
) -> Result<(), String> {
    let k = members[0].k;
    let wbytes: usize = members.iter().map(Projection::weight_bytes).sum();
    let copies = (256usize << 20).div_ceil(wbytes).clamp(2, 64);
    let gemm_tokens = |t: &usize| *t >= fast_dense_gemm::GEMM_MIN_TOKENS && lt.is_some();
    let tmax = tokens
        .iter()
        .copied()
        .filter(|t| *t <= fast_dense::GROUP_MAX_T || gemm_tokens(t))
        .max()
        .unwrap_or(1);
    // Per member: `copies` weights, its scales and its output.
    let mut sizes = vec![tmax * k * 4];
    let mut data = Vec::new();
    let mut scales = Vec::new();
    for p in members {
        let d = weight_data(rng, p);
        scales.push(block_scales(rng, p));
        let nsc = scales.last().map_or(0, Vec::len);
        sizes.extend(std::iter::repeat_n(d.len(), copies));
        sizes.extend([nsc.max(1) * 4, tmax * p.n * 4]);
        data.push(d);
    }
    let (_arena, bufs) = alloc(ctx, "bench_dense", &sizes)?;
    let x = bufs[0];
    let xs: Vec<f32> = (0..tmax * k)
        .map(|_| half::bf16::from_f32(rng.unit() * 4.0 - 2.0).to_f32())
        .collect();
    arena::copy_to_device_sync(x, &xs, s).map_err(e)?;
    let base = |i: usize| 1 + i * (copies + 2);
    for (i, p) in members.iter().enumerate() {
        for c in 0..copies {
            arena::copy_to_device_sync(bufs[base(i) + c], &data[i], s).map_err(e)?;
        }
        if p.format == StorageFormat::Fp8 {
            arena::copy_to_device_sync(bufs[base(i) + copies], &scales[i], s).map_err(e)?;
        }
    }
    let op = |i: usize, copy: usize, t: usize| {
        let p = &members[i];
        let sc = bufs[base(i) + copies];
        DenseOp {
            x,
            ldx: k,
            t,
            w: WeightDev {
                format: p.format,
                data: bufs[base(i) + copy].slice(0, data[i].len()).unwrap(),
                scales: (p.format == StorageFormat::Fp8)
                    .then(|| sc.slice(0, scales[i].len() * 4).unwrap()),
                block: [128, 128],
                rows: p.rows(),
                cols: p.k,
            },
            groups: 1,
            mode: p.mode,
            round: p.round,
            y: bufs[base(i) + copies + 1],
            ldy: p.n,
            fused_act_max_t: fast_dense::FUSED_ACT_MAX_T,
            warp_split_max_t: fast_dense::WARP_SPLIT_MAX_T,
        }
    };
    if let Some((gemm, gws)) = lt {
        for &t in tokens.iter().filter(|t| gemm_tokens(t)) {
            for o in [None, Some(own)] {
                let g = (gemm, o);
                time_gemm_group(ctx, dense, ws, g, gws, s, name, members, copies, t, &op)?;
            }
            if fast_dense::norm_operands_cover(t, k) {
                let g = (dense, nr, gemm);
                time_norm_group(ctx, g, ws, gws, s, name, members, copies, t, &op)?;
            }
        }
    }
    for &t in tokens.iter().filter(|&&t| t <= fast_dense::GROUP_MAX_T) {
        let ops =
            |copy: usize| -> Vec<DenseOp> { (0..members.len()).map(|i| op(i, copy, t)).collect() };
        let chosen = fast_dense::group_slices(&ops(0)).unwrap_or(0);
        // Every K split of the grouped launch (the chosen one marked), then one call a member.
        let paths = fast_dense::valid_slices(k)
            .map(Some)
            .chain([None])
            .collect::<Vec<_>>();
        for slices in paths {
            let grouped = slices.is_some();
            let call = |copy: usize| -> dsv4::Result<()> {
                let ops = ops(copy);
                match slices {
                    Some(sl) => dense.run_group_sliced(ctx, &ops, ws, sl, s),
                    None => ops.iter().try_for_each(|o| dense.run(ctx, o, ws, s)),
                }
            };
            let replays = 21;
            let timing = time_graph(s, copies, replays, call)?;
            let sec = timing.device_s;
            println!(
                "{{\"bench\": \"dense_group\", \"group\": \"{name}\", \"members\": {}, \"T\": {t}, \"K\": {k}, \"path\": \"{}\", \"slices\": {}, \"chosen\": {}, \"time_us\": {:.2}, \"host_time_us\": {:.2}, \"weight_bytes\": {wbytes}, \"gb_per_s\": {:.1}, \"launches_per_call\": {}, \"calls_timed\": {}}}",
                members.len(),
                if grouped { "grouped" } else { "separate" },
                slices.unwrap_or(0),
                slices.is_none_or(|sl| sl == chosen),
                sec * 1e6,
                timing.host_s * 1e6,
                wbytes as f64 / sec / 1e9,
                if grouped {
                    1
                } else {
                    members.len()
                        * if t <= fast_dense::FUSED_ACT_MAX_T {
                            1
                        } else {
                            2
                        }
                },
                replays * copies,
            );
            std::io::stdout().flush().ok();
        }
        let all_quant = members
            .iter()
            .all(|p| p.mode == ActMode::Quant && p.groups == 1);
        if all_quant && fast_dense::norm_operands_cover(t, k) {
            time_norm_gemv(ctx, (dense, nr), ws, s, name, members, copies, t, &op)?;
        }
    }
    Ok(())
}

/// The `norm_gemv` and `norm_then_gemv` lines of one group at `t` tokens, its members' gemvs one
/// call each (see [`run_group`]): a unit-weight RMSNorm of x in place making the gemv's operand
/// (`run_from_act`, as the fast set runs q_lora's pair at decode), or the norm, then each gemv
/// making its own; `op(i, copy, t)` is member i on weight copy `copy`.
#[allow(clippy::too_many_arguments)]
fn time_norm_gemv(
    ctx: &Context,
    (dense, nr): (&FastDense, &NormRope),
    ws: &DenseWorkspace,
    s: dsv4::cuda::stream::BorrowedStream,
    name: &str,
    members: &[Projection],
    copies: usize,
    t: usize,
    op: &dyn Fn(usize, usize, usize) -> DenseOp,
) -> Result<(), String> {
    let k = members[0].k;
    let x = op(0, 0, t).x;
    for made in [true, false] {
        let call = |copy: usize| -> dsv4::Result<()> {
            let ops: Vec<DenseOp> = (0..members.len()).map(|i| op(i, copy, t)).collect();
            let norm = RmsNorm {
                x,
                rows: t,
                dim: k,
                ld: k,
                weight: None,
                eps: 1e-6,
                round_out: true,
            };
            if !made {
                nr.run(ctx, &norm, s)?;
                return ops.iter().try_for_each(|o| dense.run(ctx, o, ws, s));
            }
            let operands = fast_dense::NormOperands {
                norm,
                m: t,
                fp8: None,
                bf16: None,
                gemv: Some((ws.act, ws.scale)),
            };
            dense.norm_operands(ctx, &operands, s)?;
            ops.iter()
                .try_for_each(|o| dense.run_from_act(ctx, o, ws, s))
        };
        let replays = 21;
        let timing = time_graph(s, copies, replays, call)?;
        let path = if made { "norm_gemv" } else { "norm_then_gemv" };
        print_group_gemm_line(name, members, t, path, &timing, replays * copies);
    }
    Ok(())
}

/// The `norm_group` and `norm_then_group` lines of one group at `t` tokens (see [`run_group`]):
/// a unit-weight RMSNorm of x in place (official rounding; x's values stay put after the first
/// replay) with the group's GEMMs, the norm making their operands or not; `op(i, copy, t)` is
/// member i on weight copy `copy`.
#[allow(clippy::too_many_arguments)]
fn time_norm_group(
    ctx: &Context,
    (dense, nr, gemm): (&FastDense, &NormRope, &BlockScaledGemm),
    ws: &DenseWorkspace,
    gws: &GemmWorkspace,
    s: dsv4::cuda::stream::BorrowedStream,
    name: &str,
    members: &[Projection],
    copies: usize,
    t: usize,
    op: &dyn Fn(usize, usize, usize) -> DenseOp,
) -> Result<(), String> {
    let k = members[0].k;
    let alone =
        |o: &DenseOp| fast_dense_gemm::run_linear(dense, Some((gemm, gws)), None, ctx, o, ws, s);
    let x = op(0, 0, t).x;
    // Where the operands go: the same for every weight copy (they depend on x and the shapes).
    let first: Vec<DenseOp> = (0..members.len()).map(|i| op(i, 0, t)).collect();
    let Some(made) = fast_dense_gemm::norm_group_operands(gemm, gws, &first, x, k, k) else {
        eprintln!("bench dense: {name} at T = {t}: the norm makes no operand (no member's GEMM)");
        return Ok(());
    };
    for fused in [true, false] {
        let call = |copy: usize| -> dsv4::Result<()> {
            let ops: Vec<DenseOp> = (0..members.len()).map(|i| op(i, copy, t)).collect();
            let ran = if fused {
                let norm = fast_dense::NormOperands {
                    norm: RmsNorm {
                        x,
                        rows: t,
                        dim: k,
                        ld: k,
                        weight: None,
                        eps: 1e-6,
                        round_out: true,
                    },
                    m: made.m,
                    fp8: made.fp8,
                    bf16: made.bf16,
                    gemv: None,
                };
                dense.norm_operands(ctx, &norm, s)?;
                fast_dense_gemm::run_gemm_group_from(
                    dense, gemm, None, ctx, &ops, &made, gws, ws, s,
                )?
            } else {
                nr.rmsnorm(ctx, x, t, k, k, None, 1e-6, true, s)?;
                fast_dense_gemm::run_gemm_group(dense, gemm, None, ctx, &ops, gws, ws, s)?
            };
            ops.iter()
                .zip(ran)
                .filter(|(_, ran)| !ran)
                .try_for_each(|(o, _)| alone(o))
        };
        let replays = 21;
        let timing = time_graph(s, copies, replays, call)?;
        let path = if fused {
            "norm_group"
        } else {
            "norm_then_group"
        };
        print_group_gemm_line(name, members, t, path, &timing, replays * copies);
    }
    Ok(())
}

/// The `gemm_shared` and `gemm_separate` lines of one group at `t` tokens (see [`run_group`]);
/// `op(i, copy, t)` is member i on weight copy `copy`.
#[allow(clippy::too_many_arguments)]
fn time_gemm_group(
    ctx: &Context,
    dense: &FastDense,
    ws: &DenseWorkspace,
    (gemm, own): (&BlockScaledGemm, Option<&FastFp8Gemm>),
    gws: &GemmWorkspace,
    s: dsv4::cuda::stream::BorrowedStream,
    name: &str,
    members: &[Projection],
    copies: usize,
    t: usize,
    op: &dyn Fn(usize, usize, usize) -> DenseOp,
) -> Result<(), String> {
    // A member alone, as the fast set's try_linear runs it.
    let alone =
        |o: &DenseOp| fast_dense_gemm::run_linear(dense, Some((gemm, gws)), own, ctx, o, ws, s);
    for shared in [true, false] {
        let call = |copy: usize| -> dsv4::Result<()> {
            let ops: Vec<DenseOp> = (0..members.len()).map(|i| op(i, copy, t)).collect();
            if !shared {
                return ops.iter().try_for_each(alone);
            }
            let ran = fast_dense_gemm::run_gemm_group(dense, gemm, own, ctx, &ops, gws, ws, s)?;
            ops.iter()
                .zip(ran)
                .filter(|(_, ran)| !ran)
                .try_for_each(|(o, _)| alone(o))
        };
        let replays = 21;
        let timing = time_graph(s, copies, replays, call)?;
        let path = match (shared, own.is_some()) {
            (true, false) => "gemm_shared",
            (false, false) => "gemm_separate",
            (true, true) => "gemm_shared_own_fp8",
            (false, true) => "gemm_separate_own_fp8",
        };
        print_group_gemm_line(name, members, t, path, &timing, replays * copies);
    }
    Ok(())
}

/// One `dense_group` line of a group's many-token path `path` at `t` tokens: its time, the
/// members' weight bytes and FLOPs, and their rates.
fn print_group_gemm_line(
    name: &str,
    members: &[Projection],
    t: usize,
    path: &str,
    timing: &GraphTiming,
    calls: usize,
) {
    let k = members[0].k;
    let wbytes: usize = members.iter().map(Projection::weight_bytes).sum();
    let flops: f64 = members.iter().map(|p| 2.0 * (t * p.n * p.k) as f64).sum();
    let sec = timing.device_s;
    println!(
        "{{\"bench\": \"dense_group\", \"group\": \"{name}\", \"members\": {}, \"T\": {t}, \"K\": {k}, \"path\": \"{path}\", \"time_us\": {:.2}, \"host_time_us\": {:.2}, \"weight_bytes\": {wbytes}, \"gb_per_s\": {:.1}, \"flops\": {flops:.4e}, \"tflop_per_s\": {:.2}, \"calls_timed\": {calls}}}",
        members.len(),
        sec * 1e6,
        timing.host_s * 1e6,
        wbytes as f64 / sec / 1e9,
        flops / sec / 1e12,
    );
    std::io::stdout().flush().ok();
}
